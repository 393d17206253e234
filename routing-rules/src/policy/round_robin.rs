//! Round robin over the healthy candidates, plain or smooth-weighted.
//!
//! Plain: a shared atomic counter `c`; the first choice is the `c mod h`-th healthy candidate
//! (in the caller's order), the fallbacks follow it cyclically. With a fixed set of N healthy
//! workers, any k·N consecutive calls give each exactly k first choices.
//!
//! Weighted: smooth weighted round robin (as in nginx): each call adds every healthy worker's
//! weight to its current score, picks the highest, and subtracts the total from it. Over any
//! window of W = Σ weights consecutive calls (fixed healthy set) each worker is picked exactly
//! `weight` times, interleaved rather than in bursts. State is a short `parking_lot` lock.
//!
//! Cost per call: O(n) for n candidates.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};

use parking_lot::Mutex;
use prefix_index::WorkerId;

use super::{Candidate, Reason, Selection, SelectionPolicy, Stagger};

/// Round-robin policy; see the module docs.
#[derive(Debug)]
pub struct RoundRobin {
    next: AtomicUsize,
    /// This replica's offset among its peers' (cluster mode; [`Stagger::SOLO`] alone).
    stagger: Stagger,
    /// Current scores of smooth weighted round robin; `None` when unweighted.
    weighted: Option<Mutex<HashMap<WorkerId, i64>>>,
}

impl RoundRobin {
    /// A fresh policy; `weighted` selects smooth weighted round robin.
    pub fn new(weighted: bool) -> Self {
        Self {
            next: AtomicUsize::new(0),
            stagger: Stagger::SOLO,
            weighted: weighted.then(|| Mutex::new(HashMap::new())),
        }
    }

    /// Offsets the rotation for one replica of a cluster (unweighted; see
    /// [`super::Stagger`]).
    pub fn staggered(mut self, stagger: Stagger) -> Self {
        self.stagger = stagger;
        self
    }
}

impl SelectionPolicy for RoundRobin {
    fn name(&self) -> &'static str {
        "round_robin"
    }

    fn select(&self, candidates: &[Candidate]) -> Selection {
        let healthy: Vec<&Candidate> = candidates.iter().filter(|c| c.healthy).collect();
        if healthy.is_empty() {
            return Selection::none_healthy();
        }
        let start = match &self.weighted {
            None => {
                let n = healthy.len();
                (self.next.fetch_add(1, Ordering::Relaxed) % n + self.stagger.offset(n)) % n
            }
            Some(state) => {
                let mut scores = state.lock();
                // Forget workers that left the pool so the map stays bounded.
                scores.retain(|w, _| candidates.iter().any(|c| &c.worker == w));
                let mut total: i64 = 0;
                let mut best = 0usize;
                let mut best_score = i64::MIN;
                for (i, c) in healthy.iter().enumerate() {
                    let w = i64::from(c.weight.max(1));
                    total += w;
                    let s = scores.entry(c.worker.clone()).or_insert(0);
                    *s += w;
                    if *s > best_score {
                        best_score = *s;
                        best = i;
                    }
                }
                if let Some(s) = scores.get_mut(&healthy[best].worker) {
                    *s -= total;
                }
                best
            }
        };
        let order: Vec<WorkerId> = (0..healthy.len())
            .map(|k| healthy[(start + k) % healthy.len()].worker.clone())
            .collect();
        Selection {
            order,
            reason: Reason::RoundRobin,
            ranked: Vec::new(),
        }
    }
}
