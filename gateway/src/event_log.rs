//! The events of a streamed background response, kept for its stream and for streams that
//! resume it (`GET /v1/responses/{id}?stream=true&starting_after=N`; docs/gateway.md,
//! "Background responses").
//!
//! The worker's answer is split into its SSE events ([`EventLog::feed`]); keep-alive comments
//! are dropped. The worker numbers a Responses API stream's events from 0, one by one
//! (`sequence_number`), so an event's place in the log is its sequence number. The log keeps at
//! most [`LOG_CAP`] bytes: beyond, the oldest events go (a resume from before them is refused,
//! [`Read::Gone`]). Readers wait on a [`tokio::sync::watch`] that every change bumps.

use std::collections::VecDeque;

use bytes::Bytes;
use parking_lot::Mutex;
use tokio::sync::watch;

/// Bytes of events one log keeps, at most.
pub const LOG_CAP: usize = 4 << 20;

/// The longest event read: a longer one ends the log (the worker's events are far smaller).
const EVENT_CAP: usize = 1 << 20;

#[derive(Default)]
struct Inner {
    events: VecDeque<Bytes>,
    /// The sequence number of `events[0]`.
    first: u64,
    bytes: usize,
    /// An event not yet whole.
    partial: Vec<u8>,
    ended: bool,
}

/// What a reader gets from [`EventLog::read`].
#[derive(Debug, PartialEq, Eq)]
pub enum Read {
    /// The events from the asked number on (maybe none yet), and whether the log has ended.
    Events(Vec<Bytes>, bool),
    /// The asked event is gone: the oldest kept is this one.
    Gone(u64),
}

/// One streamed background response's events.
pub struct EventLog {
    inner: Mutex<Inner>,
    changed: watch::Sender<u64>,
}

impl Default for EventLog {
    fn default() -> Self {
        EventLog {
            inner: Mutex::new(Inner::default()),
            changed: watch::channel(0).0,
        }
    }
}

impl EventLog {
    /// Reads the next piece of the worker's stream.
    pub fn feed(&self, chunk: &[u8]) {
        let mut g = self.inner.lock();
        if g.ended {
            return;
        }
        g.partial
            .extend(chunk.iter().copied().filter(|&b| b != b'\r'));
        let mut added = false;
        while let Some(end) = g.partial.windows(2).position(|w| w == b"\n\n") {
            let event: Vec<u8> = g.partial.drain(..end + 2).collect();
            // A comment (keep-alive) carries no data.
            if event
                .split(|&b| b == b'\n')
                .any(|l| l.starts_with(b"data:"))
            {
                push(&mut g, Bytes::from(event));
                added = true;
            }
        }
        if g.partial.len() > EVENT_CAP {
            g.partial = Vec::new();
            g.ended = true;
            added = true;
        }
        drop(g);
        if added {
            self.changed.send_modify(|n| *n += 1);
        }
    }

    /// Adds one whole event of the gateway's own (its text ends with a blank line).
    pub fn push(&self, event: Bytes) {
        let mut g = self.inner.lock();
        if g.ended {
            return;
        }
        push(&mut g, event);
        drop(g);
        self.changed.send_modify(|n| *n += 1);
    }

    /// Bytes of the events it keeps.
    pub fn bytes(&self) -> usize {
        self.inner.lock().bytes
    }

    /// The sequence number the next event gets.
    pub fn next_number(&self) -> u64 {
        let g = self.inner.lock();
        g.first + g.events.len() as u64
    }

    /// Ends the log: readers get what it holds, then the end. Whether it was open.
    pub fn end(&self) -> bool {
        let was_open = !std::mem::replace(&mut self.inner.lock().ended, true);
        self.changed.send_modify(|n| *n += 1);
        was_open
    }

    /// The events from sequence number `from` on, as text (what another replica mirrors).
    pub fn texts_from(&self, from: u64) -> Vec<String> {
        match self.read(from) {
            Read::Events(events, _) => events
                .iter()
                .map(|e| String::from_utf8_lossy(e).into_owned())
                .collect(),
            Read::Gone(_) => Vec::new(),
        }
    }

    /// The events from sequence number `from` on as text, or from the oldest kept when
    /// `from` is gone: (the first one's number, the texts, whether the log has ended).
    pub fn read_texts(&self, from: u64) -> (u64, Vec<String>, bool) {
        let g = self.inner.lock();
        let first = from.max(g.first);
        let skip = usize::try_from(first - g.first).unwrap_or(usize::MAX);
        let texts = g
            .events
            .iter()
            .skip(skip)
            .map(|e| String::from_utf8_lossy(e).into_owned())
            .collect();
        (first, texts, g.ended)
    }

    /// The events from sequence number `from` on.
    pub fn read(&self, from: u64) -> Read {
        let g = self.inner.lock();
        if from < g.first {
            return Read::Gone(g.first);
        }
        let skip = usize::try_from(from - g.first).unwrap_or(usize::MAX);
        Read::Events(g.events.iter().skip(skip).cloned().collect(), g.ended)
    }

    /// A receiver that changes with every event and at the end.
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.changed.subscribe()
    }
}

fn push(g: &mut Inner, event: Bytes) {
    g.bytes += event.len();
    g.events.push_back(event);
    while g.bytes > LOG_CAP && g.events.len() > 1 {
        if let Some(old) = g.events.pop_front() {
            g.bytes -= old.len();
            g.first += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn events(r: Read) -> (Vec<String>, bool) {
        match r {
            Read::Events(v, ended) => (
                v.iter()
                    .map(|b| String::from_utf8(b.to_vec()).unwrap())
                    .collect(),
                ended,
            ),
            Read::Gone(n) => panic!("gone up to {n}"),
        }
    }

    #[test]
    fn events_are_read_whole_in_any_chunking_and_comments_are_dropped() {
        let stream = "event: a\ndata: {\"sequence_number\":0}\n\n: keep-alive\n\n\
                      event: b\r\ndata: {\"sequence_number\":1}\r\n\r\n";
        for size in [1, 3, 7, stream.len()] {
            let log = EventLog::default();
            for c in stream.as_bytes().chunks(size) {
                log.feed(c);
            }
            let (v, ended) = events(log.read(0));
            assert_eq!(
                v,
                [
                    "event: a\ndata: {\"sequence_number\":0}\n\n",
                    "event: b\ndata: {\"sequence_number\":1}\n\n"
                ],
                "{size}"
            );
            assert!(!ended);
            assert_eq!(events(log.read(1)).0.len(), 1);
            assert_eq!(events(log.read(5)).0.len(), 0);
            assert_eq!(log.next_number(), 2);
        }
    }

    #[test]
    fn the_log_stays_bounded_and_says_what_is_gone() {
        let log = EventLog::default();
        let big = format!("data: {}\n\n", "x".repeat(1 << 20));
        for _ in 0..6 {
            log.feed(big.as_bytes());
        }
        assert_eq!(log.read(0), Read::Gone(3));
        let (v, _) = events(log.read(3));
        assert_eq!(v.len(), 3);
        assert_eq!(log.next_number(), 6);
        // A mirror's fill from a gone event starts at the oldest kept, and says the end.
        let (first, texts, ended) = log.read_texts(1);
        assert_eq!((first, texts.len(), ended), (3, 3, false));
        assert_eq!(texts[0], big);
        log.end();
        assert_eq!(log.read_texts(5).0, 5);
        assert_eq!(log.read_texts(5).1.len(), 1);
        assert!(log.read_texts(9).2);
        assert!(log.read_texts(9).1.is_empty());
    }

    #[test]
    fn readers_wake_on_events_and_at_the_end() {
        let log = EventLog::default();
        let mut rx = log.subscribe();
        rx.borrow_and_update();
        log.push(Bytes::from_static(b"data: 1\n\n"));
        assert!(rx.has_changed().unwrap());
        rx.borrow_and_update();
        assert!(log.end(), "open until now");
        assert!(!log.end(), "ended once");
        assert!(rx.has_changed().unwrap());
        assert_eq!(log.texts_from(0), ["data: 1\n\n"]);
        assert_eq!(events(log.read(0)), (vec!["data: 1\n\n".to_owned()], true));
        // Nothing is added after the end.
        log.push(Bytes::from_static(b"data: 2\n\n"));
        assert_eq!(log.next_number(), 1);
        // An endless event ends the log rather than growing without bound.
        let log = EventLog::default();
        log.feed(&vec![b'x'; EVENT_CAP + 1]);
        assert_eq!(events(log.read(0)), (vec![], true));
    }
}
