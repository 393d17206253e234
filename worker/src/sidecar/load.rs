//! The sidecar's load report: the work of every generation request it has forwarded to its
//! engine and not yet seen end, in the shape of a kvgate worker's `event: load` message
//! ([`prefix_index::WorkerLoad`], docs/kv-events.md). Every request to the engine passes
//! through the sidecar (when it requires tickets, whichever gateway sent it), so the report
//! holds the work of every gateway in front of the engine, where each gateway alone counts only
//! what it routed itself.
//!
//! A request counts from the moment it is forwarded:
//! - `running` + 1 (the engine's own admission queue is not visible: `waiting` is 0);
//! - `prefill_tokens` + the prompt tokens it must still compute: its ticket's `prompt_tokens`
//!   minus `predicted_matched_tokens` when the gateway tokenized it, else the same estimate a
//!   gateway makes for an untokenized body ([`prompt_profile::work`]: bytes / 4), until the
//!   first generated text arrives (its prefill is over) — for a whole (non-streamed) answer,
//!   until the answer;
//! - `decode_tokens` + the output it asked for ([`prompt_profile::work::queued_output_tokens`]),
//!   less one per generated piece of a stream (an engine streams one token per chunk), until
//!   it ends.
//!
//! With the engine's own view ([`super::engine_load`]: llama-server's `GET /slots`, or vLLM's
//! or SGLang's running and waiting counts), each term reported is the larger of the book's and the engine's, so requests that
//! reached the engine around the sidecar count too; without it (or while it cannot be read),
//! the book's alone.
//!
//! Subscribers are woken as a kvgate engine wakes them: when the load moved enough since the
//! last announcement ([`prefix_index::WorkerLoad::moved_from`]).

use std::sync::Arc;

use parking_lot::Mutex;
use prefix_index::WorkerLoad;
use tokio::sync::watch;

/// The forwarded requests' work, and the channel that announces it.
pub(crate) struct LoadBook {
    state: Mutex<Book>,
    tx: watch::Sender<WorkerLoad>,
    /// A forwarded request ended (the engine's view may still hold it).
    ended: tokio::sync::Notify,
}

#[derive(Default)]
struct Book {
    /// The forwarded requests' work.
    own: WorkerLoad,
    /// The engine's own view of its work, when it was read last time it was polled.
    engine: Option<WorkerLoad>,
    /// The last load that woke subscribers.
    announced: WorkerLoad,
}

impl Book {
    /// What is reported: per term the larger of the book's count and the engine's view.
    fn load(&self) -> WorkerLoad {
        match self.engine {
            None => self.own,
            Some(e) => WorkerLoad {
                running: self.own.running.max(e.running),
                waiting: self.own.waiting.max(e.waiting),
                prefill_tokens: self.own.prefill_tokens.max(e.prefill_tokens),
                decode_tokens: self.own.decode_tokens.max(e.decode_tokens),
            },
        }
    }
}

impl LoadBook {
    pub(crate) fn new() -> Arc<LoadBook> {
        let (tx, _) = watch::channel(WorkerLoad::default());
        Arc::new(LoadBook {
            state: Mutex::new(Book::default()),
            tx,
            ended: tokio::sync::Notify::new(),
        })
    }

    /// Completes when a forwarded request ended since the last call completed (or ends now).
    pub(crate) async fn ended(&self) {
        self.ended.notified().await;
    }

    /// A receiver of the current load, woken when it moved enough.
    pub(crate) fn watch(&self) -> watch::Receiver<WorkerLoad> {
        self.tx.subscribe()
    }

    /// The current load (what is reported).
    #[cfg(test)]
    pub(crate) fn current(&self) -> WorkerLoad {
        self.state.lock().load()
    }

    /// What is reported, and the engine's last view (`None`: not read).
    fn reported(&self) -> (WorkerLoad, Option<WorkerLoad>) {
        let s = self.state.lock();
        (s.load(), s.engine)
    }

    /// Replaces the engine's view (`None`: it could not be read; the book's count alone).
    pub(crate) fn set_engine(&self, engine: Option<WorkerLoad>) {
        self.update(|b| b.engine = engine);
    }

    /// Counts one forwarded request: `prefill` prompt tokens to compute, `decode` output
    /// tokens asked for. Its work leaves the book as it progresses and when the returned
    /// [`Work`] is dropped.
    pub(crate) fn begin(self: &Arc<Self>, prefill: u64, decode: u64) -> Work {
        self.change(|l| {
            l.running += 1;
            l.prefill_tokens = l.prefill_tokens.saturating_add(prefill);
            l.decode_tokens = l.decode_tokens.saturating_add(decode);
        });
        Work {
            book: self.clone(),
            prefill,
            decode,
        }
    }

    fn change(&self, f: impl FnOnce(&mut WorkerLoad)) {
        self.update(|b| f(&mut b.own));
    }

    fn update(&self, f: impl FnOnce(&mut Book)) {
        let mut s = self.state.lock();
        f(&mut s);
        let load = s.load();
        let announce = load.moved_from(&s.announced);
        if announce {
            s.announced = load;
        }
        // Under the lock, so that two changes reach the channel in the order they were made.
        self.tx.send_if_modified(|l| {
            *l = load;
            announce
        });
    }
}

/// One forwarded request's share of the book.
pub(crate) struct Work {
    book: Arc<LoadBook>,
    /// Prompt tokens still counted (0 once its prefill is over).
    prefill: u64,
    /// Output tokens still counted.
    decode: u64,
}

impl Work {
    /// The first generated text arrived: the prompt no longer counts. Idempotent.
    pub(crate) fn prefilled(&mut self) {
        if self.prefill > 0 {
            let p = std::mem::take(&mut self.prefill);
            self.book
                .change(|l| l.prefill_tokens = l.prefill_tokens.saturating_sub(p));
        }
    }

    /// `n` more output tokens were generated (never more than were asked for).
    pub(crate) fn produced(&mut self, n: u64) {
        let n = n.min(self.decode);
        if n > 0 {
            self.decode -= n;
            self.book
                .change(|l| l.decode_tokens = l.decode_tokens.saturating_sub(n));
        }
    }
}

impl Drop for Work {
    fn drop(&mut self) {
        let (p, d) = (self.prefill, self.decode);
        self.book.change(|l| {
            l.running = l.running.saturating_sub(1);
            l.prefill_tokens = l.prefill_tokens.saturating_sub(p);
            l.decode_tokens = l.decode_tokens.saturating_sub(d);
        });
        self.book.ended.notify_one();
    }
}

/// Reads the book at scrape time: what is reported (`load_running`, `load_prefill_tokens`,
/// `load_decode_tokens`) and, while it is read, the engine's own view (`engine_load_running`,
/// `engine_load_decode_tokens`), under `kvgate_sidecar_`.
pub(crate) struct LoadCollector(pub(crate) Arc<LoadBook>);

impl std::fmt::Debug for LoadCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LoadCollector").finish_non_exhaustive()
    }
}

impl prometheus_client::collector::Collector for LoadCollector {
    fn encode(&self, mut enc: prometheus_client::encoding::DescriptorEncoder) -> std::fmt::Result {
        let (l, engine) = self.0.reported();
        let clamp = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
        crate::metrics::gauge(
            &mut enc,
            "load_running",
            "The load report's running: generation requests forwarded to the engine and not ended, or the engine's busy slots where more",
            clamp(l.running),
        )?;
        crate::metrics::gauge(
            &mut enc,
            "load_prefill_tokens",
            "Prompt tokens of forwarded requests whose first output has not arrived, less the cached tokens their tickets predicted",
            clamp(l.prefill_tokens),
        )?;
        crate::metrics::gauge(
            &mut enc,
            "load_decode_tokens",
            "The load report's decode tokens: output forwarded requests asked for and have not generated yet, or the engine's own remaining output where more",
            clamp(l.decode_tokens),
        )?;
        if let Some(e) = engine {
            crate::metrics::gauge(
                &mut enc,
                "engine_load_running",
                "The engine's busy slots at its last poll (GET /slots)",
                clamp(e.running),
            )?;
            crate::metrics::gauge(
                &mut enc,
                "engine_load_decode_tokens",
                "Output tokens the engine's busy slots may still generate at its last poll",
                clamp(e.decode_tokens),
            )?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn load(running: u64, prefill_tokens: u64, decode_tokens: u64) -> WorkerLoad {
        WorkerLoad {
            running,
            waiting: 0,
            prefill_tokens,
            decode_tokens,
        }
    }

    #[test]
    fn work_enters_progresses_and_leaves() {
        let book = LoadBook::new();
        let mut a = book.begin(600, 100);
        let mut b = book.begin(40, 8);
        assert_eq!(book.current(), load(2, 640, 108));
        a.prefilled();
        a.prefilled();
        assert_eq!(book.current(), load(2, 40, 108));
        a.produced(30);
        assert_eq!(book.current(), load(2, 40, 78));
        // Never more than asked for, whatever the engine streams.
        b.produced(50);
        assert_eq!(book.current(), load(2, 40, 70));
        drop(b);
        assert_eq!(book.current(), load(1, 0, 70));
        drop(a);
        assert_eq!(book.current(), load(0, 0, 0));
    }

    #[test]
    fn subscribers_wake_when_the_load_moved_enough() {
        let book = LoadBook::new();
        let mut rx = book.watch();
        let mut a = book.begin(0, 400);
        assert!(rx.has_changed().unwrap(), "a request arriving is announced");
        assert_eq!(*rx.borrow_and_update(), load(1, 0, 400));
        // One token of 400: not enough to wake anyone, but the value is current.
        a.produced(1);
        assert!(!rx.has_changed().unwrap());
        assert_eq!(*rx.borrow(), load(1, 0, 399));
        // 1/8 of 400 since the announcement: announced.
        a.produced(49);
        assert!(rx.has_changed().unwrap());
        assert_eq!(*rx.borrow_and_update(), load(1, 0, 350));
        drop(a);
        assert!(rx.has_changed().unwrap(), "a request ending is announced");
        assert_eq!(*rx.borrow_and_update(), load(0, 0, 0));
    }

    #[test]
    fn the_engines_view_raises_each_term_and_leaves_with_its_reads() {
        let book = LoadBook::new();
        let mut rx = book.watch();
        let _a = book.begin(500, 100);
        rx.borrow_and_update();
        // Two requests the sidecar never saw: the engine's view is larger on running and
        // decode; the book's prefill stays.
        book.set_engine(Some(load(2, 0, 700)));
        assert!(rx.has_changed().unwrap(), "the engine's view is announced");
        assert_eq!(*rx.borrow_and_update(), load(2, 500, 700));
        // The engine's view of the sidecar's own request alone: never counted twice.
        book.set_engine(Some(load(1, 0, 90)));
        assert_eq!(book.current(), load(1, 500, 100));
        // It could not be read: the book's count alone.
        book.set_engine(Some(load(3, 0, 900)));
        book.set_engine(None);
        assert_eq!(book.current(), load(1, 500, 100));
        assert_eq!(*rx.borrow_and_update(), load(1, 500, 100));
    }

    /// What the book costs a relayed request: `cargo test --release -p worker --lib
    /// bench_load_book -- --ignored --nocapture` (docs/benchmarks.md, "Sidecar load reports").
    #[test]
    #[ignore]
    fn bench_load_book() {
        let book = LoadBook::new();
        // A subscriber, as when a gateway reads the stream (woken, never reading here).
        let _rx = book.watch();
        let chunks = 256u64;
        let requests = 20_000u64;
        let t = std::time::Instant::now();
        for _ in 0..requests {
            let mut w = book.begin(1000, chunks);
            w.prefilled();
            for _ in 0..chunks {
                w.produced(1);
            }
        }
        let per_request = t.elapsed().as_secs_f64() / requests as f64;
        let t = std::time::Instant::now();
        for _ in 0..requests {
            drop(book.begin(1000, chunks));
        }
        let begin_end = t.elapsed().as_secs_f64() / requests as f64;
        // Beside it, what the relay already does per chunk: parse it and fold it in.
        let chunk = r#"{"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"content":" token"},"finish_reason":null}]}"#;
        let mut usage = super::super::usage::Usage::default();
        let n = 200_000u32;
        let t = std::time::Instant::now();
        for _ in 0..n {
            let v: serde_json::Value = serde_json::from_str(std::hint::black_box(chunk)).unwrap();
            usage.feed(&v);
        }
        let relay_chunk = t.elapsed().as_secs_f64() / f64::from(n);
        println!(
            "relay's own work per chunk (parse + usage): {:.0} ns",
            relay_chunk * 1e9
        );
        println!(
            "load book: begin + end {:.0} ns; a request of {chunks} streamed chunks {:.1} us \
             ({:.0} ns per chunk)",
            begin_end * 1e9,
            per_request * 1e6,
            (per_request - begin_end) / chunks as f64 * 1e9,
        );
        assert_eq!(book.current(), WorkerLoad::default());
    }

    #[test]
    fn concurrent_requests_balance_out() {
        let book = LoadBook::new();
        std::thread::scope(|s| {
            for t in 0..4u64 {
                let book = book.clone();
                s.spawn(move || {
                    for i in 0..500u64 {
                        let mut w = book.begin(100 + t, 10 + i % 7);
                        if i % 2 == 0 {
                            w.prefilled();
                        }
                        w.produced(i % 5);
                    }
                });
            }
        });
        assert_eq!(book.current(), WorkerLoad::default());
        assert_eq!(*book.watch().borrow(), WorkerLoad::default());
    }
}
