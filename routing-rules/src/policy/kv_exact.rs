//! KV-exact selection: the worker holding the longest cached prefix wins, unless the load
//! guard says it is too busy; then the next-best match.
//!
//! Definitions, over the healthy candidates only:
//! - `threshold` = max(1, ⌈min_match_tokens / block_size⌉) blocks; a candidate's *score* is its
//!   `matched_blocks` when at least `threshold`, else 0 (no hit).
//! - `mean` = mean load of the healthy candidates; `limit` = max(max_load_ratio × mean,
//!   mean + load_slack). A candidate is *admissible* when `load < limit`. The least-loaded
//!   candidate always is (its load ≤ mean < mean + slack, slack ≥ 1), so the guard never leaves
//!   a request without a worker. Consequence (tested): with no completions, a worker's load
//!   never exceeds `limit + 1` at any point, however hot its prefix.
//! - Order: admissible before inadmissible; then higher score; then lower load; then rotation
//!   (a per-policy counter shifts which of equal candidates comes first, so ties never always
//!   go to the same worker). When no admissible candidate has a hit and `on_no_match` is
//!   `round_robin`, those zero-score admissible candidates are ordered by rotation alone.
//!
//! The reason names why the first choice is not simply the longest match: `load_guard` (a
//! healthy worker with a longer match was over the guard), `unhealthy` (only unhealthy workers
//! hold a longer match), `below_min_match` / `no_match` (no hit anywhere), else `hit`.
//!
//! Cost per call: O(n log n) for n candidates.

use std::cmp::Reverse;
use std::sync::atomic::{AtomicUsize, Ordering};

use super::{Candidate, Reason, Selection, SelectionPolicy};
use crate::schema::{KvExactRule, NoMatchPolicy};

/// KV-exact policy; see the module docs.
#[derive(Debug)]
pub struct KvExact {
    threshold_blocks: usize,
    max_load_ratio: f64,
    load_slack: u64,
    on_no_match: NoMatchPolicy,
    rotation: AtomicUsize,
}

impl KvExact {
    /// Build from a rule and its profile's block size (tokens per block; 0 is treated as 1).
    pub fn new(rule: &KvExactRule, block_size: u32) -> Self {
        let bs = block_size.max(1);
        let blocks = rule.min_match_tokens.div_ceil(bs) as usize;
        Self {
            threshold_blocks: blocks.max(1),
            max_load_ratio: if rule.max_load_ratio.is_finite() {
                rule.max_load_ratio.max(1.0)
            } else {
                crate::schema::DEFAULT_MAX_LOAD_RATIO
            },
            load_slack: rule.effective_load_slack().max(1),
            on_no_match: rule.on_no_match,
            rotation: AtomicUsize::new(0),
        }
    }

    /// Matched blocks needed for a hit.
    pub fn threshold_blocks(&self) -> usize {
        self.threshold_blocks
    }

    /// The load limit for a pool whose healthy candidates have these loads: a candidate is
    /// admissible when its load is strictly below it.
    pub fn load_limit(&self, loads: impl Iterator<Item = u64>) -> f64 {
        let (sum, n) = loads.fold((0u128, 0u64), |(s, n), l| (s + u128::from(l), n + 1));
        if n == 0 {
            return f64::INFINITY;
        }
        let mean = sum as f64 / n as f64;
        (self.max_load_ratio * mean).max(mean + self.load_slack as f64)
    }

    fn score(&self, c: &Candidate) -> usize {
        if c.matched_blocks >= self.threshold_blocks {
            c.matched_blocks
        } else {
            0
        }
    }
}

impl KvExact {
    /// Starts the tie-break rotation at `start` (gateway replicas start apart, so that their
    /// first ties do not all go to the same worker).
    pub fn starting_at(self, start: usize) -> Self {
        self.rotation.store(start, Ordering::Relaxed);
        self
    }
}

impl SelectionPolicy for KvExact {
    fn name(&self) -> &'static str {
        "kv_exact"
    }

    fn select(&self, candidates: &[Candidate]) -> Selection {
        let n = candidates.len();
        let rot = self.rotation.fetch_add(1, Ordering::Relaxed);
        let healthy: Vec<usize> = (0..n).filter(|&i| candidates[i].healthy).collect();
        if healthy.is_empty() {
            return Selection::none_healthy();
        }
        let limit = self.load_limit(healthy.iter().map(|&i| candidates[i].load));
        let admissible = |i: usize| (candidates[i].load as f64) < limit;
        let rank = |i: usize| (i + n - rot % n) % n;
        let best_admissible_score = healthy
            .iter()
            .filter(|&&i| admissible(i))
            .map(|&i| self.score(&candidates[i]))
            .max()
            .unwrap_or(0);
        let rotate_no_match =
            best_admissible_score == 0 && self.on_no_match == NoMatchPolicy::RoundRobin;

        let key = |i: usize| {
            let c = &candidates[i];
            let adm = admissible(i);
            let load = if rotate_no_match && adm { 0 } else { c.load };
            let score = self.score(c);
            // Without a match, prefer the worker holding least (then rotation).
            let spread = if score == 0 && !rotate_no_match {
                c.cached_blocks
            } else {
                0
            };
            (!adm, Reverse(score), load, spread)
        };
        let mut order = healthy.clone();
        order.sort_by_key(|&i| (key(i), rank(i)));
        // Rotate within the group tied for first place, so that consecutive decisions pick
        // different members even when the group is a sparse subset of the pool.
        let top = key(order[0]);
        let tied = order.iter().take_while(|&&i| key(i) == top).count();
        if tied > 1 {
            order[..tied].rotate_left(rot % tied);
        }

        let first = &candidates[order[0]];
        let chosen = self.score(first);
        let best_healthy = healthy
            .iter()
            .map(|&i| self.score(&candidates[i]))
            .max()
            .unwrap_or(0);
        let best_unhealthy = candidates
            .iter()
            .filter(|c| !c.healthy)
            .map(|c| self.score(c))
            .max()
            .unwrap_or(0);
        let reason = if best_healthy > chosen {
            Reason::LoadGuard
        } else if best_unhealthy > chosen {
            Reason::Unhealthy
        } else if chosen > 0 {
            Reason::Hit
        } else if candidates.iter().any(|c| c.matched_blocks > 0) {
            Reason::BelowMinMatch
        } else {
            Reason::NoMatch
        };
        Selection {
            order: order
                .iter()
                .map(|&i| candidates[i].worker.clone())
                .collect(),
            reason,
        }
    }
}
