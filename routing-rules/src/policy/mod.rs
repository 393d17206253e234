//! Selection policies: given per-worker candidates built by the caller from ONE rules
//! snapshot (health, load, matched prefix blocks), return an ordered list of workers (first
//! choice, then fallbacks for connect retries) and the reason for the first choice.
//!
//! Contract shared by every policy:
//! - `order` never contains an unhealthy candidate. When no candidate is healthy (or there are
//!   none), `order` is empty and the reason is [`Reason::NoHealthyWorker`]; the gateway answers
//!   503 rather than sending traffic to a worker its health checks consider down.
//! - `order` holds every healthy candidate exactly once.
//! - Policies are `Send + Sync`, keep their rotation state inside (atomics or a short lock),
//!   and are built per service when a snapshot is built (a reload starts rotation afresh).

mod kv_exact;
mod round_robin;

use std::fmt;

use prefix_index::WorkerId;

pub use kv_exact::{block_credit, queued_cost, KvExact};
pub use round_robin::RoundRobin;

use crate::schema::Rule;

/// One worker as the caller sees it for one request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Candidate {
    /// The worker.
    pub worker: WorkerId,
    /// Whether health checks currently consider it up.
    pub healthy: bool,
    /// Its load in the rule's `load_metric` (in-flight requests or active tokens).
    pub load: u64,
    /// How many leading full blocks of this request's prefix it holds (0 for round robin).
    pub matched_blocks: usize,
    /// Its weight (from the rules file; 0 is treated as 1).
    pub weight: u32,
    /// Blocks the index believes it holds in all (0 when unknown). KV-exact uses it to place a
    /// request that matches nowhere: among equally loaded workers, the one holding least, so new
    /// conversations spread over the fleet instead of landing beside others' cached prefixes.
    pub cached_blocks: u64,
    /// The request's prompt tokens (`kv_exact` least-cost placement; 0 for round robin).
    pub prompt_tokens: u64,
    /// Prompt tokens already queued on the worker, not computed yet (least-cost placement).
    pub queued_prefill: u64,
    /// Output tokens still to generate on the worker (least-cost placement).
    pub queued_decode: u64,
}

/// Why the first choice was chosen; a metric label via [`Reason::as_str`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Reason {
    /// The first choice holds the longest matched prefix (at least the hit threshold).
    Hit,
    /// No worker holds any block of the prefix.
    NoMatch,
    /// Some worker holds blocks, but fewer than `min_match_tokens` asks for a hit.
    BelowMinMatch,
    /// A worker with a longer match was over the load guard; the next-best was chosen.
    LoadGuard,
    /// A worker with a longer match passed the guard but had more work queued than its match
    /// saves (least-cost placement); a cheaper one was chosen.
    Cost,
    /// A worker with a longer match is unhealthy; the best healthy one was chosen.
    Unhealthy,
    /// Plain round-robin choice.
    RoundRobin,
    /// No healthy candidate: `order` is empty.
    NoHealthyWorker,
}

impl Reason {
    /// Every reason, for pre-registering metric label values.
    pub const ALL: [Reason; 8] = [
        Reason::Hit,
        Reason::NoMatch,
        Reason::BelowMinMatch,
        Reason::LoadGuard,
        Reason::Cost,
        Reason::Unhealthy,
        Reason::RoundRobin,
        Reason::NoHealthyWorker,
    ];

    /// Stable string for metric labels and logs.
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::Hit => "hit",
            Reason::NoMatch => "no_match",
            Reason::BelowMinMatch => "below_min_match",
            Reason::LoadGuard => "load_guard",
            Reason::Cost => "cost",
            Reason::Unhealthy => "unhealthy",
            Reason::RoundRobin => "round_robin",
            Reason::NoHealthyWorker => "no_healthy_worker",
        }
    }
}

impl fmt::Display for Reason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A policy's answer for one request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Selection {
    /// First choice, then fallbacks; only healthy workers; empty when none is healthy.
    pub order: Vec<WorkerId>,
    /// Why the first choice.
    pub reason: Reason,
    /// `kv_exact` only: the admissible candidates (they lead `order`), each with the placement
    /// cost this decision ranked it by (first = the first choice). Empty for round robin.
    /// Gateway replicas re-rank the close ones atomically (cluster claims), adding the other
    /// replicas' fresh placements to each cost.
    pub ranked: Vec<(WorkerId, u64)>,
}

impl Selection {
    /// The answer when no candidate is healthy.
    pub fn none_healthy() -> Self {
        Self {
            order: Vec::new(),
            reason: Reason::NoHealthyWorker,
            ranked: Vec::new(),
        }
    }

    /// The first choice, if any.
    pub fn first(&self) -> Option<&WorkerId> {
        self.order.first()
    }
}

/// A selection policy. Implementations keep their own rotation state.
pub trait SelectionPolicy: Send + Sync + fmt::Debug {
    /// The policy's name (`round_robin`, `kv_exact`), a metric label.
    fn name(&self) -> &'static str;

    /// Order the candidates for one request (see the module docs for the contract).
    fn select(&self, candidates: &[Candidate]) -> Selection;
}

/// Build the policy of a rule. `block_size` is the tokens per block of the rule's profile
/// (used by `kv_exact` to turn `min_match_tokens` into blocks; ignored by round robin).
pub fn build(rule: &Rule, block_size: u32) -> Box<dyn SelectionPolicy> {
    build_staggered(rule, block_size, Stagger::SOLO)
}

/// Where one gateway replica's rotations sit among its peers' (cluster mode): replica `index`
/// of `of`, by the sorted replica ids. Round robin's rotation over n workers is offset by
/// ⌊index · n / of⌋, so replicas that have made the same number of decisions stay n / of apart;
/// kv_exact's tie-break cursor over a pool of n candidates starts at that offset and moves just
/// past each worker it picks, so replicas walk the pool apart whichever members of a tied group
/// each one's view holds: their picks over one idle pool at the same instant are disjoint for
/// n / of decisions each.
/// A single gateway is [`Stagger::SOLO`] (offset 0).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Stagger {
    index: usize,
    of: usize,
}

impl Stagger {
    /// One gateway alone.
    pub const SOLO: Stagger = Stagger { index: 0, of: 1 };

    /// Replica `index` of `of` (`of` 0 is treated as 1, `index` is taken modulo `of`).
    pub fn new(index: usize, of: usize) -> Stagger {
        let of = of.max(1);
        Stagger {
            index: index % of,
            of,
        }
    }

    /// This replica's place (0-based).
    pub fn index(self) -> usize {
        self.index
    }

    /// How many replicas.
    pub fn of(self) -> usize {
        self.of
    }

    /// The offset of this replica's rotation over a group of `n`: ⌊index · n / of⌋ (< n).
    pub fn offset(self, n: usize) -> usize {
        (self.index as u128 * n as u128 / self.of as u128) as usize
    }
}

/// [`build`] with the rotations (round robin's next worker, kv_exact's tie-break) staggered
/// for replica `stagger` of a cluster, so that the replicas' first decisions over an idle pool
/// spread instead of all choosing its first worker.
pub fn build_staggered(rule: &Rule, block_size: u32, stagger: Stagger) -> Box<dyn SelectionPolicy> {
    match rule {
        Rule::RoundRobin(r) => Box::new(RoundRobin::new(r.weighted).staggered(stagger)),
        Rule::KvExact(k) => Box::new(KvExact::new(k, block_size).staggered(stagger)),
    }
}
