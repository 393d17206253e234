//! KV-exact selection: the worker holding the longest cached prefix wins, unless the load
//! guard says it is too busy; then the next-best match.
//!
//! Definitions, over the healthy candidates only:
//! - `threshold` = max(1, ⌈min_match_tokens / block_size⌉) blocks; a candidate's *score* is its
//!   `matched_blocks` when at least `threshold`, else 0 (no hit).
//! - `mean` = mean load of the healthy candidates; `limit` = max(max_load_ratio × mean,
//!   mean + load_slack + own), where `own` is the request's own size in the load's unit when
//!   the load is `active_tokens` (its prompt tokens) and 0 for `in_flight`: a worker is not
//!   refused for being one request of this size ahead of the mean — with one long prompt
//!   computing on a mostly idle fleet, the next request of the same prefix may still join it.
//!   A candidate is *admissible* when `load < limit`. The least-loaded candidate always is (its
//!   load ≤ mean < mean + slack, slack ≥ 1), so the guard never leaves a request without a
//!   worker. Consequence (tested): with no completions, a worker's load never exceeds
//!   `limit + 1` (`in_flight`) at any point, however hot its prefix.
//! - *cost* (`placement = "least_cost"`, the default) =
//!   `uncached_weight × max(0, prompt_tokens − score × block_size) + queued_prefill +
//!   decode_weight × queued_decode`, truncated to an integer: the prompt tokens the candidate
//!   would still compute for this request, weighted, plus the work already queued there.
//!   With `placement = "longest_match"` every cost is 0.
//! - Order: admissible before inadmissible; then lower cost; then higher score; then lower
//!   load; then, for a candidate without a hit, fewer held blocks counted in this request's
//!   prompts (⌊cached_blocks / max(1, ⌊prompt_tokens / block_size⌋)⌋); then rotation: a
//!   per-policy cursor over the candidate list (starting at the replica's stagger offset)
//!   orders equal candidates by their distance from it in pool order, and after a decision
//!   whose first place was tied moves just past the worker chosen, so a tied group is served
//!   in turn ("next fit") and
//!   ties never always go to the same worker. When no admissible candidate has a hit and
//!   `on_no_match` is `round_robin`, those zero-score admissible candidates are ordered by
//!   rotation alone. The load guard stays a hard bound: cost only ranks admissible workers.
//!
//! The reason names why the first choice is not simply the longest match: `cost` (an
//! admissible worker with a longer match had more work queued than the match saves),
//! `load_guard` (a healthy worker with a longer match was over the guard), `unhealthy` (only unhealthy workers
//! hold a longer match), `below_min_match` / `no_match` (no hit anywhere), else `hit`.
//!
//! Cost per call: O(n log n) for n candidates.

use std::cmp::Reverse;
use std::sync::atomic::{AtomicUsize, Ordering};

use super::{Candidate, Reason, Selection, SelectionPolicy, Stagger};
use crate::schema::{KvExactRule, LoadMetric, NoMatchPolicy, Placement};

/// A weight that is finite and non-negative, else `default` (validation refuses the others).
fn finite_or(w: f64, default: f64) -> f64 {
    if w.is_finite() && w >= 0.0 {
        w
    } else {
        default
    }
}

/// The cursor before any decision.
const CURSOR_UNSET: usize = usize::MAX;

/// How often a decision that lost the race for the cursor picks again before it keeps its
/// pick (a bound on the work; losing it only risks two concurrent decisions on one worker).
const MAX_CURSOR_RETRIES: usize = 8;

/// The queued-work term of the cost: `queued_prefill + decode_weight × queued_decode`.
fn queued_term(decode_w: f64, prefill: u64, decode: u64) -> f64 {
    prefill as f64 + decode_w * decode as f64
}

/// What `prefill` prompt tokens and `decode` output tokens queued on a worker add to its
/// placement cost under `rule` (the queued terms of the module docs' cost; 0 with
/// `placement = "longest_match"`, whose costs are all 0). A request placed on a worker adds
/// this for the next decision: gateway replicas publish it with their cold placements.
pub fn queued_cost(rule: &KvExactRule, prefill: u64, decode: u64) -> u64 {
    match rule.placement {
        Placement::LeastCost => queued_term(
            finite_or(rule.decode_weight, crate::schema::DEFAULT_DECODE_WEIGHT),
            prefill,
            decode,
        ) as u64,
        Placement::LongestMatch => 0,
    }
}

/// What one matched block saves in placement cost under `rule` with `block_size` tokens per
/// block: `uncached_weight × block_size` (0 with `placement = "longest_match"`). A worker that
/// another replica just chose for a prompt sharing this one's first `d` blocks costs this
/// request `d ×` this less there (gateway cluster claims).
pub fn block_credit(rule: &KvExactRule, block_size: u32) -> u64 {
    match rule.placement {
        Placement::LeastCost => {
            (finite_or(rule.uncached_weight, crate::schema::DEFAULT_UNCACHED_WEIGHT)
                * f64::from(block_size.max(1))) as u64
        }
        Placement::LongestMatch => 0,
    }
}

/// KV-exact policy; see the module docs.
#[derive(Debug)]
pub struct KvExact {
    threshold_blocks: usize,
    max_load_ratio: f64,
    load_slack: u64,
    /// The guard allows the request's own prompt tokens on top of the slack (`active_tokens`).
    own_size_allowance: bool,
    on_no_match: NoMatchPolicy,
    block_size: u64,
    /// `None`: longest-match placement (no cost term).
    cost_weights: Option<(f64, f64)>,
    /// Where the next search for equal candidates starts, as an index into the candidate list
    /// ([`CURSOR_UNSET`] until the first decision, which starts at the stagger's offset).
    cursor: AtomicUsize,
    /// This replica's offset among its peers' (cluster mode; [`Stagger::SOLO`] alone).
    stagger: Stagger,
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
            own_size_allowance: rule.load_metric == LoadMetric::ActiveTokens,
            on_no_match: rule.on_no_match,
            block_size: u64::from(bs),
            cost_weights: match rule.placement {
                Placement::LeastCost => Some((
                    finite_or(rule.uncached_weight, crate::schema::DEFAULT_UNCACHED_WEIGHT),
                    finite_or(rule.decode_weight, crate::schema::DEFAULT_DECODE_WEIGHT),
                )),
                Placement::LongestMatch => None,
            },
            cursor: AtomicUsize::new(CURSOR_UNSET),
            stagger: Stagger::SOLO,
        }
    }

    /// Matched blocks needed for a hit.
    pub fn threshold_blocks(&self) -> usize {
        self.threshold_blocks
    }

    /// The load limit for a pool whose healthy candidates have these loads, for a request of
    /// `own` prompt tokens: a candidate is admissible when its load is strictly below it.
    pub fn load_limit(&self, loads: impl Iterator<Item = u64>, own: u64) -> f64 {
        let (sum, n) = loads.fold((0u128, 0u64), |(s, n), l| (s + u128::from(l), n + 1));
        if n == 0 {
            return f64::INFINITY;
        }
        let mean = sum as f64 / n as f64;
        let own = if self.own_size_allowance { own } else { 0 };
        (self.max_load_ratio * mean).max(mean + self.load_slack as f64 + own as f64)
    }

    /// The candidate's placement cost (see the module docs).
    pub fn cost(&self, c: &Candidate) -> u64 {
        let Some((uncached_w, decode_w)) = self.cost_weights else {
            return 0;
        };
        let matched = (self.score(c) as u64).saturating_mul(self.block_size);
        let uncached = c.prompt_tokens.saturating_sub(matched) as f64;
        let cost = uncached_w * uncached + queued_term(decode_w, c.queued_prefill, c.queued_decode);
        // `as` saturates (and maps NaN to 0; the weights are finite and non-negative).
        cost as u64
    }

    fn score(&self, c: &Candidate) -> usize {
        if c.matched_blocks >= self.threshold_blocks {
            c.matched_blocks
        } else {
            0
        }
    }
}

/// The admissible entries of `order` (they lead it), with the cost of their key. `keyed`:
/// (key = (inadmissible, cost, ..), candidate index < `n`). O(n).
fn ranked_costs<K>(
    keyed: &[((bool, u64, K), usize)],
    order: &[usize],
    n: usize,
) -> Vec<(usize, u64)> {
    let mut by_index: Vec<Option<(bool, u64)>> = vec![None; n];
    for ((inadmissible, cost, _), i) in keyed {
        if let Some(slot) = by_index.get_mut(*i) {
            *slot = Some((*inadmissible, *cost));
        }
    }
    order
        .iter()
        .map_while(|&i| match by_index.get(i).copied().flatten() {
            Some((false, cost)) => Some((i, cost)),
            _ => None,
        })
        .collect()
}

impl KvExact {
    /// Starts the tie-break cursor at this replica's offset in a cluster ([`super::Stagger`]:
    /// the replicas' cursors walk the pool apart, so their first ties do not all go to the
    /// same worker).
    pub fn staggered(mut self, stagger: Stagger) -> Self {
        self.stagger = stagger;
        self
    }
}

impl SelectionPolicy for KvExact {
    fn name(&self) -> &'static str {
        "kv_exact"
    }

    fn select(&self, candidates: &[Candidate]) -> Selection {
        let n = candidates.len();
        let healthy: Vec<usize> = (0..n).filter(|&i| candidates[i].healthy).collect();
        if healthy.is_empty() {
            return Selection::none_healthy();
        }
        let own = healthy
            .iter()
            .map(|&i| candidates[i].prompt_tokens)
            .max()
            .unwrap_or(0);
        let limit = self.load_limit(healthy.iter().map(|&i| candidates[i].load), own);
        let admissible = |i: usize| (candidates[i].load as f64) < limit;
        let best_admissible_score = healthy
            .iter()
            .filter(|&&i| admissible(i))
            .map(|&i| self.score(&candidates[i]))
            .max()
            .unwrap_or(0);
        let rotate_no_match =
            best_admissible_score == 0 && self.on_no_match == NoMatchPolicy::RoundRobin;
        // The request's prompt in blocks (at least 1; 0 prompt tokens: 1).
        let prompt_blocks = (own / self.block_size).max(1);

        let key = |i: usize| {
            let c = &candidates[i];
            let adm = admissible(i);
            let load = if rotate_no_match && adm { 0 } else { c.load };
            let score = self.score(c);
            // Without a match, prefer the worker holding least, counted in prompts of this
            // request's size (then rotation): workers within one such prompt of each other
            // tie, so the rotation spreads new requests over them — and gateway replicas,
            // whose cursors start apart, do not all pick the same least-holding worker in
            // the same instant.
            let spread = if score == 0 && !rotate_no_match {
                c.cached_blocks / prompt_blocks
            } else {
                0
            };
            let cost = if rotate_no_match && adm {
                0
            } else {
                self.cost(c)
            };
            (!adm, cost, (Reverse(score), load, spread))
        };
        let keyed: Vec<_> = healthy.iter().map(|&i| (key(i), i)).collect();
        // Rotation: equal candidates are taken in pool order from the cursor on, and when the
        // first place was tied the cursor then moves just past the one chosen ("next fit"). A tied group is served in
        // turn however sparse it is in the pool, and replicas whose cursors start apart walk
        // apart, whichever members each one's view has tied. Concurrent decisions of this
        // replica race for the cursor: the loser re-reads it and picks again, so they too
        // take different members.
        let mut order = Vec::with_capacity(keyed.len());
        for attempt in 0.. {
            let seen = self.cursor.load(Ordering::Acquire);
            let start = if seen == CURSOR_UNSET {
                self.stagger.offset(n)
            } else {
                seen % n
            };
            let rank = |i: usize| (i + n - start) % n;
            let mut sorted = keyed.clone();
            sorted.sort_by_key(|&(k, i)| (k, rank(i)));
            order.clear();
            order.extend(sorted.iter().map(|&(_, i)| i));
            // A choice the rotation did not make (one candidate alone in first place: a hit,
            // a cheaper queue) leaves the cursor where it is, so that replicas' cursors stay
            // in their own parts of the pool however their hits fall.
            if sorted.get(1).is_none_or(|second| second.0 != sorted[0].0) {
                break;
            }
            let next = (order[0] + 1) % n;
            let moved = self
                .cursor
                .compare_exchange(seen, next, Ordering::AcqRel, Ordering::Acquire)
                .is_ok();
            if moved || attempt >= MAX_CURSOR_RETRIES {
                break;
            }
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
        let reason = if best_admissible_score > chosen {
            Reason::Cost
        } else if best_healthy > chosen {
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
        // The admissible candidates in order, with the costs this decision ranked them by
        // (the rotation's zeroed costs included).
        let ranked = ranked_costs(&keyed, &order, n);
        Selection {
            order: order
                .iter()
                .map(|&i| candidates[i].worker.clone())
                .collect(),
            reason,
            ranked: ranked
                .into_iter()
                .map(|(i, cost)| (candidates[i].worker.clone(), cost))
                .collect(),
        }
    }
}
