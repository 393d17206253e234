//! The worker's KV event feed: every change to the prefix cache as a numbered event, for the
//! gateway's prefix index.
//!
//! Owns the epoch (random, new at every engine start), the sequence numbers (1, 2, 3, … within
//! an epoch, one per envelope), a bounded replay ring, a mirror of the cached keys (for
//! snapshots) and the fan-out to subscribers. Does not own the cache itself: the engine's step
//! thread calls [`KvEventFeed::publish`] with the events of each step.
//!
//! Guarantees to a subscriber:
//! - resume with `since = Some((epoch, seq))`: when the epoch matches and every event after
//!   `seq` is still in the replay ring, the missed events and then live ones, gap-free;
//! - otherwise (`None`, another epoch, a seq too old or from the future): one `Cleared`
//!   envelope, then a snapshot (`Stored` events covering every cached key, parents before
//!   children), then live events. Snapshot envelopes all carry the seq `S` of the last event
//!   the snapshot includes (0 before any event) and live events continue at `S + 1`, so a
//!   subscriber that records the last seq it saw can always resume;
//! - a subscriber that falls behind the broadcast channel resumes itself the same way
//!   (replay or snapshot); the step thread never waits for a subscriber.
//!
//! Publishing never blocks on subscribers: one short mutex section per step (push to the ring,
//! update the mirror, `broadcast::send`). Complexity: publish O(keys in the events);
//! subscribe O(replayed events) or O(cached keys) for a snapshot.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use parking_lot::Mutex;
use prefix_index::{BlockKey, KvEvent, KvEventEnvelope};
use tokio::sync::broadcast;

/// Envelopes kept for replay.
pub const DEFAULT_REPLAY_CAPACITY: usize = 8192;
/// Live envelopes buffered per subscriber before it lags (and resumes by replay/snapshot).
pub const DEFAULT_CHANNEL_CAPACITY: usize = 4096;

struct FeedState {
    epoch: u64,
    /// Seq of the last published envelope (0 = none yet).
    last_seq: u64,
    ring: VecDeque<KvEventEnvelope>,
    ring_capacity: usize,
    /// Cached key → its parent, mirrored from the published events.
    keys: HashMap<BlockKey, Option<BlockKey>>,
    /// `None` once the engine stopped: subscribers then end.
    tx: Option<broadcast::Sender<KvEventEnvelope>>,
}

/// Cheap, cloneable handle to the feed of one engine.
#[derive(Clone)]
pub struct KvEventFeed {
    state: Arc<Mutex<FeedState>>,
    epoch: u64,
}

impl std::fmt::Debug for KvEventFeed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvEventFeed")
            .field("epoch", &self.epoch)
            .finish_non_exhaustive()
    }
}

/// A fresh epoch: random bits mixed with the current time, so two starts differ.
fn new_epoch() -> u64 {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    // Keep it within JSON's exact-integer range (53 bits) for the SSE wire format.
    ((rand::random::<u64>() ^ nanos) & ((1u64 << 53) - 1)).max(1)
}

impl KvEventFeed {
    /// A feed with a new random epoch and the default capacities.
    pub fn new() -> Self {
        Self::with_capacity(DEFAULT_REPLAY_CAPACITY, DEFAULT_CHANNEL_CAPACITY)
    }

    /// A feed with explicit replay-ring and per-subscriber channel capacities (≥ 1 each).
    pub fn with_capacity(replay: usize, channel: usize) -> Self {
        let epoch = new_epoch();
        let (tx, _) = broadcast::channel(channel.max(1));
        KvEventFeed {
            state: Arc::new(Mutex::new(FeedState {
                epoch,
                last_seq: 0,
                ring: VecDeque::with_capacity(replay.clamp(1, 1 << 16)),
                ring_capacity: replay.max(1),
                keys: HashMap::new(),
                tx: Some(tx),
            })),
            epoch,
        }
    }

    /// The epoch of this engine run.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Seq of the last published event (0 before any).
    pub fn last_seq(&self) -> u64 {
        self.state.lock().last_seq
    }

    /// Number of keys the feed believes are cached (its snapshot size).
    pub fn cached_keys(&self) -> usize {
        self.state.lock().keys.len()
    }

    /// Every key the feed believes is cached, sorted (what a snapshot sends). O(n): for
    /// diagnostics and tests.
    pub fn keys(&self) -> Vec<BlockKey> {
        let mut out: Vec<BlockKey> = self.state.lock().keys.keys().copied().collect();
        out.sort_unstable();
        out
    }

    /// Publishes events in order, one envelope each. Called by the step thread only.
    pub fn publish(&self, events: Vec<KvEvent>) {
        if events.is_empty() {
            return;
        }
        let mut st = self.state.lock();
        for event in events {
            match &event {
                KvEvent::Stored { parent, keys } => {
                    let mut p = *parent;
                    for k in keys {
                        st.keys.insert(*k, p);
                        p = Some(*k);
                    }
                }
                KvEvent::Removed { keys } => {
                    for k in keys {
                        st.keys.remove(k);
                    }
                }
                KvEvent::Cleared => st.keys.clear(),
            }
            st.last_seq += 1;
            let env = KvEventEnvelope {
                epoch: st.epoch,
                seq: st.last_seq,
                event,
            };
            if st.ring.len() == st.ring_capacity {
                st.ring.pop_front();
            }
            st.ring.push_back(env.clone());
            if let Some(tx) = &st.tx {
                // No receivers is fine: nobody listens yet.
                let _ = tx.send(env);
            }
        }
    }

    /// Ends every subscription (after what it already received). Called at engine stop.
    pub fn close(&self) {
        self.state.lock().tx = None;
    }

    /// Subscribes, resuming after `since` when possible (see the module docs).
    pub fn subscribe(&self, since: Option<(u64, u64)>) -> KvSubscription {
        let (backlog, rx, last) = self.start(since);
        KvSubscription {
            feed: self.clone(),
            backlog,
            rx,
            last_seq: last,
        }
    }

    /// Backlog (replay or Cleared+snapshot), the live receiver (subscribed under the same
    /// lock, so nothing is missed or repeated) and the seq the backlog ends at.
    fn start(
        &self,
        since: Option<(u64, u64)>,
    ) -> (
        VecDeque<KvEventEnvelope>,
        Option<broadcast::Receiver<KvEventEnvelope>>,
        u64,
    ) {
        let st = self.state.lock();
        let rx = st.tx.as_ref().map(|tx| tx.subscribe());
        let mut backlog = VecDeque::new();
        if let Some((epoch, seq)) = since {
            if epoch == st.epoch && seq <= st.last_seq {
                let oldest = st.ring.front().map_or(st.last_seq + 1, |e| e.seq);
                // Events seq+1..=last_seq must all be in the ring.
                if seq + 1 >= oldest {
                    backlog.extend(st.ring.iter().filter(|e| e.seq > seq).cloned());
                    return (backlog, rx, st.last_seq);
                }
            }
        }
        let (s, epoch) = (st.last_seq, st.epoch);
        // Copy the key set under the lock (the receiver already subscribed at seq `s`), build the
        // snapshot's runs (sorting, O(n log n)) after releasing it: the step thread publishing
        // the next step never waits for a subscriber's snapshot.
        let keys = st.keys.clone();
        drop(st);
        backlog.push_back(KvEventEnvelope {
            epoch,
            seq: s,
            event: KvEvent::Cleared,
        });
        for event in snapshot_events(&keys) {
            backlog.push_back(KvEventEnvelope {
                epoch,
                seq: s,
                event,
            });
        }
        (backlog, rx, s)
    }
}

impl Default for KvEventFeed {
    fn default() -> Self {
        Self::new()
    }
}

/// `Stored` events for every key of `keys`, grouped into parent→child runs, parents first.
/// O(n).
fn snapshot_events(keys: &HashMap<BlockKey, Option<BlockKey>>) -> Vec<KvEvent> {
    let mut children: HashMap<BlockKey, Vec<BlockKey>> = HashMap::new();
    let mut roots: Vec<(Option<BlockKey>, BlockKey)> = Vec::new();
    for (&k, &p) in keys {
        match p {
            Some(p) if keys.contains_key(&p) => children.entry(p).or_default().push(k),
            _ => roots.push((p, k)),
        }
    }
    roots.sort();
    for c in children.values_mut() {
        c.sort();
    }
    let mut out = Vec::new();
    // Depth-first: each run follows first children; siblings start new runs.
    let mut stack: Vec<(Option<BlockKey>, BlockKey)> = roots.into_iter().rev().collect();
    while let Some((parent, first)) = stack.pop() {
        let mut run = vec![first];
        let mut cur = first;
        while let Some(cs) = children.get(&cur) {
            for &c in cs.iter().skip(1).rev() {
                stack.push((Some(cur), c));
            }
            match cs.first() {
                Some(&c) => {
                    run.push(c);
                    cur = c;
                }
                None => break,
            }
        }
        out.push(KvEvent::Stored { parent, keys: run });
    }
    out
}

/// One subscriber's stream of envelopes.
pub struct KvSubscription {
    feed: KvEventFeed,
    backlog: VecDeque<KvEventEnvelope>,
    rx: Option<broadcast::Receiver<KvEventEnvelope>>,
    last_seq: u64,
}

impl KvSubscription {
    /// The next envelope; `None` once the engine has stopped and everything was delivered.
    pub async fn next(&mut self) -> Option<KvEventEnvelope> {
        loop {
            if let Some(e) = self.backlog.pop_front() {
                self.last_seq = e.seq;
                return Some(e);
            }
            let rx = self.rx.as_mut()?;
            match rx.recv().await {
                Ok(e) => {
                    // Live events already covered by the backlog are skipped.
                    if e.seq <= self.last_seq {
                        continue;
                    }
                    self.last_seq = e.seq;
                    return Some(e);
                }
                Err(broadcast::error::RecvError::Lagged(_)) => {
                    let since = Some((self.feed.epoch, self.last_seq));
                    let (backlog, rx, _) = self.feed.start(since);
                    self.backlog = backlog;
                    self.rx = rx;
                }
                Err(broadcast::error::RecvError::Closed) => {
                    self.rx = None;
                    return None;
                }
            }
        }
    }

    /// Seq of the last envelope returned (the value to resume from).
    pub fn last_seq(&self) -> u64 {
        self.last_seq
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn k(n: u64) -> BlockKey {
        BlockKey(n)
    }

    fn stored(parent: Option<u64>, keys: &[u64]) -> KvEvent {
        KvEvent::Stored {
            parent: parent.map(k),
            keys: keys.iter().map(|&n| k(n)).collect(),
        }
    }

    async fn drain(sub: &mut KvSubscription, n: usize) -> Vec<KvEventEnvelope> {
        let mut out = Vec::new();
        for _ in 0..n {
            let e = tokio::time::timeout(std::time::Duration::from_secs(5), sub.next())
                .await
                .expect("event in time")
                .expect("feed open");
            out.push(e);
        }
        out
    }

    #[test]
    fn epochs_differ_between_feeds() {
        let a = KvEventFeed::new();
        let b = KvEventFeed::new();
        assert_ne!(a.epoch(), b.epoch());
        assert!(a.epoch() < (1 << 53));
    }

    #[tokio::test]
    async fn live_events_are_numbered_from_one() {
        let feed = KvEventFeed::new();
        let mut sub = feed.subscribe(Some((feed.epoch(), 0)));
        feed.publish(vec![
            stored(None, &[1, 2]),
            KvEvent::Removed { keys: vec![k(2)] },
        ]);
        let got = drain(&mut sub, 2).await;
        assert_eq!(got[0].seq, 1);
        assert_eq!(got[1].seq, 2);
        assert_eq!(got[0].epoch, feed.epoch());
        assert_eq!(got[1].event, KvEvent::Removed { keys: vec![k(2)] });
    }

    #[tokio::test]
    async fn resume_replays_missed_events() {
        let feed = KvEventFeed::new();
        feed.publish(vec![
            stored(None, &[1]),
            stored(Some(1), &[2]),
            stored(Some(2), &[3]),
        ]);
        let mut sub = feed.subscribe(Some((feed.epoch(), 1)));
        feed.publish(vec![KvEvent::Removed { keys: vec![k(3)] }]);
        let got = drain(&mut sub, 3).await;
        let seqs: Vec<u64> = got.iter().map(|e| e.seq).collect();
        assert_eq!(seqs, vec![2, 3, 4]);
        assert_eq!(got[0].event, stored(Some(1), &[2]));
    }

    #[tokio::test]
    async fn unknown_epoch_or_old_seq_gets_cleared_and_snapshot() {
        let feed = KvEventFeed::with_capacity(2, 16);
        feed.publish(vec![
            stored(None, &[1, 2]),
            stored(Some(2), &[3]),
            stored(Some(1), &[9]),
            stored(None, &[7]),
            KvEvent::Removed { keys: vec![k(7)] },
        ]);
        // seq 1 fell out of a ring of 2 → snapshot.
        let since_list = [
            None,
            Some((feed.epoch() ^ 1, 3)),
            Some((feed.epoch(), 1)),
            Some((feed.epoch(), 99)),
        ];
        for since in since_list {
            let s0 = feed.last_seq();
            let mut sub = feed.subscribe(since);
            let first = drain(&mut sub, 1).await;
            assert_eq!(first[0].event, KvEvent::Cleared, "{since:?}");
            assert_eq!(first[0].seq, s0);
            // Snapshot: runs 1→2→3 and 1→9, parents first.
            let mut seen: HashMap<BlockKey, Option<BlockKey>> = HashMap::new();
            let snap = drain(&mut sub, 2).await;
            for e in &snap {
                assert_eq!(e.seq, s0);
                let KvEvent::Stored { parent, keys } = &e.event else {
                    panic!("not stored: {e:?}")
                };
                if let Some(p) = parent {
                    assert!(seen.contains_key(p), "parent after child");
                }
                let mut p = *parent;
                for key in keys {
                    seen.insert(*key, p);
                    p = Some(*key);
                }
            }
            let want: HashMap<BlockKey, Option<BlockKey>> = [
                (k(1), None),
                (k(2), Some(k(1))),
                (k(3), Some(k(2))),
                (k(9), Some(k(1))),
            ]
            .into_iter()
            .collect();
            assert_eq!(seen, want);
            // Then live events continue right after the snapshot's seq.
            feed.publish(vec![
                KvEvent::Removed { keys: vec![k(9)] },
                stored(Some(1), &[9]),
            ]);
            let live = drain(&mut sub, 2).await;
            assert_eq!(live[0].seq, s0 + 1);
            assert_eq!(live[1].seq, s0 + 2);
        }
    }

    #[tokio::test]
    async fn resume_at_ring_edge_is_replay() {
        let feed = KvEventFeed::with_capacity(2, 16);
        feed.publish(vec![
            stored(None, &[1]),
            stored(Some(1), &[2]),
            stored(Some(2), &[3]),
        ]);
        // Ring holds seqs 2 and 3: resuming after 1 is still gap-free.
        let mut sub = feed.subscribe(Some((feed.epoch(), 1)));
        let got = drain(&mut sub, 2).await;
        assert_eq!(got.iter().map(|e| e.seq).collect::<Vec<_>>(), vec![2, 3]);
        // Resuming at the head gives nothing until a new event.
        let mut sub = feed.subscribe(Some((feed.epoch(), 3)));
        feed.publish(vec![KvEvent::Cleared]);
        let got = drain(&mut sub, 1).await;
        assert_eq!(got[0].seq, 4);
        assert_eq!(feed.cached_keys(), 0);
    }

    #[tokio::test]
    async fn lagging_subscriber_recovers_without_gaps() {
        let feed = KvEventFeed::with_capacity(4, 2);
        let mut sub = feed.subscribe(Some((feed.epoch(), 0)));
        // 10 events overflow a channel of 2 and a ring of 4 → snapshot recovery.
        for i in 1..=10u64 {
            feed.publish(vec![stored(if i == 1 { None } else { Some(i - 1) }, &[i])]);
        }
        let mut got = Vec::new();
        loop {
            let e = drain(&mut sub, 1).await.remove(0);
            let done = e.seq == 10 && !matches!(e.event, KvEvent::Cleared);
            got.push(e);
            if done {
                break;
            }
        }
        // Applying what arrived gives the full key set 1..=10.
        let mut keys = std::collections::HashSet::new();
        for e in &got {
            match &e.event {
                KvEvent::Cleared => keys.clear(),
                KvEvent::Stored { keys: ks, .. } => keys.extend(ks.iter().copied()),
                KvEvent::Removed { keys: ks } => {
                    for x in ks {
                        keys.remove(x);
                    }
                }
            }
        }
        assert_eq!(keys.len(), 10);
        // Seqs never go backwards.
        assert!(got.windows(2).all(|w| w[0].seq <= w[1].seq));
    }

    #[tokio::test]
    async fn close_ends_subscriptions() {
        let feed = KvEventFeed::new();
        let mut sub = feed.subscribe(Some((feed.epoch(), 0)));
        feed.publish(vec![stored(None, &[1])]);
        feed.close();
        assert_eq!(drain(&mut sub, 1).await[0].seq, 1);
        assert!(sub.next().await.is_none());
    }
}
