//! TEMPORARY stand-in for `prefix_index::PrefixIndex` while that crate's index lands; same
//! method names as the gateway uses. To be deleted.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::{Duration, Instant};

use parking_lot::RwLock;
use prefix_index::{BlockKey, KvEvent, WorkerId};

/// Naive index: per worker a set of keys.
#[derive(Default)]
pub struct PrefixIndex {
    precise: RwLock<HashMap<WorkerId, HashSet<BlockKey>>>,
    approx: RwLock<HashMap<WorkerId, HashMap<BlockKey, Instant>>>,
}

impl PrefixIndex {
    /// Empty.
    pub fn new() -> PrefixIndex {
        PrefixIndex::default()
    }

    /// Applies one event of a worker.
    pub fn apply(&self, worker: &WorkerId, event: &KvEvent) {
        let mut p = self.precise.write();
        let set = p.entry(worker.clone()).or_default();
        match event {
            KvEvent::Stored { keys, .. } => set.extend(keys.iter().copied()),
            KvEvent::Removed { keys } => {
                for k in keys {
                    set.remove(k);
                }
            }
            KvEvent::Cleared => set.clear(),
        }
    }

    /// Drops a worker.
    pub fn remove_worker(&self, worker: &WorkerId) {
        self.precise.write().remove(worker);
        self.approx.write().remove(worker);
    }

    /// Approximate holdings with a TTL.
    pub fn insert_approximate(&self, worker: &WorkerId, keys: &[BlockKey], ttl: Duration) {
        let until = Instant::now() + ttl;
        let mut a = self.approx.write();
        let m = a.entry(worker.clone()).or_default();
        for k in keys {
            m.insert(*k, until);
        }
    }

    /// Longest matched prefix (blocks) per worker holding at least the first key.
    pub fn longest_matches(&self, keys: &[BlockKey]) -> Vec<(WorkerId, usize)> {
        let now = Instant::now();
        let p = self.precise.read();
        let a = self.approx.read();
        let mut out = Vec::new();
        let mut workers: HashSet<&WorkerId> = p.keys().collect();
        workers.extend(a.keys());
        for w in workers {
            let n = keys
                .iter()
                .take_while(|k| {
                    p.get(w).is_some_and(|s| s.contains(k))
                        || a.get(w).and_then(|m| m.get(k)).is_some_and(|t| *t > now)
                })
                .count();
            if n > 0 {
                out.push((w.clone(), n));
            }
        }
        out
    }

    /// Blocks per worker.
    pub fn blocks_per_worker(&self) -> BTreeMap<WorkerId, usize> {
        let mut out = BTreeMap::new();
        for (w, s) in self.precise.read().iter() {
            *out.entry(w.clone()).or_default() += s.len();
        }
        for (w, s) in self.approx.read().iter() {
            *out.entry(w.clone()).or_default() += s.len();
        }
        out
    }
}
