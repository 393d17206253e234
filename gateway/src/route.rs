//! The routing decision for one request, from one [`View`]: build a candidate per pool worker,
//! let the service's selection policy order them. The rule kind is looked at once, when the view
//! is compiled ([`ServiceRoute::prefix`] is set for KV-exact services); here a service with
//! prefix routing parses the body, takes the salt, renders + tokenizes by the prompt contract,
//! computes block keys, checks the token budget and looks the keys up in the index, and every
//! service goes through the same candidate building and [`routing_rules::policy::SelectionPolicy`].
//!
//! Cost: O(pool) without prefix routing. With it, dominated by rendering + tokenizing the prompt
//! (O(prompt length)); keys are one hash per full block; the index lookup costs O(blocks matched
//! + workers holding the first block) per the prefix-index crate; the policy O(pool · log pool).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use prefix_index::{BlockKey, HashAlgorithm, NamespaceSeed, PrefixIndex, WorkerId};
use routing_rules::policy::{Candidate, Reason};
use routing_rules::schema::{LoadMetric, SaltInputs, SaltPolicy, TokenBudgetPolicy};

use crate::error::GatewayError;
use crate::protocol::{Endpoint, InferenceBody};
use crate::view::{InFlight, PrefixRoute, ServiceRoute, View};

/// Why a request fell back from the plain choice, as a metric label. `None` for a hit or plain RR.
pub fn fallback_label(reason: Reason) -> Option<&'static str> {
    match reason {
        Reason::NoMatch | Reason::BelowMinMatch => Some("no_match"),
        Reason::LoadGuard => Some("load_guard"),
        Reason::Cost => Some("cost"),
        Reason::Unhealthy => Some("unhealthy"),
        Reason::Hit | Reason::RoundRobin | Reason::NoHealthyWorker => None,
    }
}

/// What the gateway learned about a prompt it routed by prefix.
#[derive(Clone, Debug)]
pub struct PromptFacts {
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Block keys of the full blocks.
    pub keys: Vec<BlockKey>,
    /// The namespace seed the keys were computed in (goes into the ticket).
    pub seed: NamespaceSeed,
    /// The hash algorithm of the keys (goes into the ticket).
    pub hash_algorithm: HashAlgorithm,
    /// Matched blocks per candidate worker (for the ticket's prediction).
    pub matched: Vec<(WorkerId, usize)>,
    /// Matched blocks per candidate worker as placement saw them: `matched` plus routing-time
    /// holdings (a worker computes a prefix another request of its queue is computing once, so
    /// its queued prefill counts only the rest).
    pub placed: Vec<(WorkerId, usize)>,
    /// Tokens per block.
    pub block_size: usize,
    /// Output tokens the request asks for (`max_completion_tokens`/`max_tokens`, else
    /// `prompt_profile::work::DEFAULT_OUTPUT_TOKENS`, times its choices `n`): its decode share
    /// of the worker's active tokens.
    pub output_tokens: usize,
}

/// A routing decision (the service it was taken for is kept beside it, in the request ctx).
#[derive(Clone, Debug)]
pub struct Decision {
    /// First choice, then fallbacks for connect retries (healthy workers only).
    pub order: Vec<WorkerId>,
    /// The policy's reason for the first choice.
    pub reason: Reason,
    /// Extra fallback labels (e.g. `contract` when a worker was excluded for its profile).
    pub extra_fallbacks: Vec<&'static str>,
    /// Prefix-routing facts (`None` without prefix routing).
    pub prompt: Option<PromptFacts>,
    /// The routing-time holding taken for the first choice, with its TTL (cluster mode shares
    /// it with the other replicas).
    pub pending: Option<(WorkerId, std::time::Duration)>,
    /// The admissible candidates with their placement costs, in order
    /// ([`routing_rules::policy::Selection::ranked`]; empty without prefix routing).
    pub ranked: Vec<(WorkerId, u64)>,
    /// How many leading entries of `ranked` are *close* to the first choice: their cost is at
    /// most the first's plus what this request adds to a worker's cost
    /// ([`routing_rules::policy::queued_cost`] of its attempt there) — the alternatives one
    /// other replica's placement of a request like this one on the first choice would make
    /// preferable. At most 1 for a clear winner, or when every cost is 0 (`placement =
    /// "longest_match"`). Cluster claims run when it is 2 or more ([`redirect`]).
    pub close: usize,
    /// A close decision that will claim: its mark among the service's claims in flight, so
    /// that decisions following its routing-time holding wait for the claim
    /// ([`crate::claim_wait`]).
    pub claim_mark: Option<crate::claim_wait::ClaimMark>,
    /// The number of the reservation on the first choice ([`RouteInput::numbering`], taken
    /// as the reservation is; 0 without one), published with the decision in cluster mode.
    pub seq: u64,
}

impl Decision {
    /// Predicted matched tokens on `worker` (prefix routing only).
    pub fn predicted_tokens(&self, worker: &WorkerId) -> Option<u32> {
        let p = self.prompt.as_ref()?;
        u32::try_from(blocks_of(&p.matched, worker) * p.block_size).ok()
    }

    /// Matched tokens on `worker` as placement saw them (routing-time holdings included;
    /// prefix routing only): the part of the prompt its queued prefill does not count.
    pub fn placed_tokens(&self, worker: &WorkerId) -> Option<u64> {
        let p = self.prompt.as_ref()?;
        Some((blocks_of(&p.placed, worker) * p.block_size) as u64)
    }

    /// Counts the prompt's first `blocks` blocks (at most all its full blocks) as placed on
    /// `worker`, when placement saw fewer there ([`credit_lead`]). Returns whether that changed
    /// what an attempt there counts ([`Decision::attempt_tokens`]). The prediction (`matched`)
    /// is not touched.
    pub fn credit_placed(&mut self, worker: &WorkerId, blocks: usize) -> bool {
        let Some(p) = self.prompt.as_mut() else {
            return false;
        };
        let blocks = blocks.min(p.keys.len());
        match p.placed.iter_mut().find(|(w, _)| w == worker) {
            Some((_, b)) if *b >= blocks => false,
            Some((_, b)) => {
                *b = blocks;
                true
            }
            None if blocks == 0 => false,
            None => {
                p.placed.push((worker.clone(), blocks));
                true
            }
        }
    }

    /// The active tokens an attempt on `worker` counts there (prefix routing only): the
    /// prompt's tokens it must still compute (its matched prefix as placement saw it excluded:
    /// cached, or being computed there for another request) and the output asked for.
    pub fn attempt_tokens(&self, worker: &WorkerId) -> Option<(u64, u64)> {
        let p = self.prompt.as_ref()?;
        let placed = self.placed_tokens(worker).unwrap_or(0);
        Some((
            (p.prompt_tokens as u64).saturating_sub(placed),
            p.output_tokens as u64,
        ))
    }
}

fn blocks_of(matched: &[(WorkerId, usize)], worker: &WorkerId) -> usize {
    matched
        .iter()
        .find(|(w, _)| w == worker)
        .map_or(0, |(_, b)| *b)
}

/// The request facts routing needs besides the view (owned: prefix routing runs on the
/// gateway's routing pool, off the proxy threads).
pub struct RouteInput {
    /// The matched service.
    pub service: Arc<ServiceRoute>,
    /// Request path.
    pub path: String,
    /// The whole body.
    pub body: bytes::Bytes,
    /// The value of the service's tenant header (salt policy `tenant_header`), if sent.
    pub tenant_header: Option<String>,
    /// The tenant the request authenticated as (`auth = "api_key"`).
    pub tenant: Option<String>,
    /// Cluster claims are on ([`crate::cluster::Claims::settle`] follows the decision): a close
    /// decision leaves a mark for the decisions that follow its holding.
    pub claiming: bool,
    /// This replica's reservation numbers ([`crate::data_plane::DataPlane::holdings_seq`]):
    /// a reservation is numbered before it counts, so a load table whose counters were read
    /// before the number counts none numbered above it.
    pub numbering: Arc<AtomicU64>,
}

impl RouteInput {
    /// The tenant header a service's salt policy reads, lowercase (`None`: it reads none).
    pub fn tenant_header(service: &ServiceRoute) -> Option<String> {
        match service.prefix.as_ref().map(|p| &p.rule.salt) {
            Some(SaltPolicy::TenantHeader { header, .. }) => Some(header.to_ascii_lowercase()),
            _ => None,
        }
    }
}

/// What prefix routing found before the policy runs.
struct Looked {
    keys: Vec<BlockKey>,
    prompt_tokens: usize,
    output_tokens: usize,
    seed: NamespaceSeed,
    matches: Vec<prefix_index::WorkerMatch>,
    /// False for a request that reuses no cached prefix on any worker (a completion asking its
    /// prompt's log probabilities, `prompt_profile::scores_prompt`): no match is looked up, so
    /// none is predicted or weighed; its blocks still become the chosen worker's holding.
    reads_cache: bool,
}

/// Parse, salt, tokenize, keys, budget. The index lookup is not here: [`decide`] makes it under
/// the service's placement lock, so that it sees every earlier decision's routing-time holding.
fn look_up(prefix: &PrefixRoute, input: &RouteInput) -> Result<Looked, GatewayError> {
    let endpoint = Endpoint::from_path(&input.path).ok_or_else(|| GatewayError::InvalidBody {
        reason: format!(
            "kv_exact routes only /v1/chat/completions and /v1/completions, not {}",
            input.path
        ),
    })?;
    let body = InferenceBody::parse(endpoint, &input.body)?;
    let salt = prefix
        .rule
        .salt
        .effective_salt(SaltInputs {
            header: input.tenant_header.as_deref(),
            tenant: input.tenant.as_deref(),
            body: body.cache_salt.as_deref(),
        })
        .map_err(|r| GatewayError::InvalidBody {
            reason: r.reason.to_owned(),
        })?;
    // With the budget enforced, a prompt that provably cannot fit is refused before (or while)
    // it is tokenized; the exact check follows (the worker's own cap does not change the
    // verdict, see `TokenBudget`).
    let requested = body
        .max_tokens
        .map(|m| usize::try_from(m).unwrap_or(usize::MAX));
    // A prompt that truncates needs the budget to know where to cut, whatever the policy: the
    // worker cuts it there too.
    let budget = (prefix.token_budget == TokenBudgetPolicy::Reject || body.prompt.truncates())
        .then(|| (prefix.profile.budget(), requested));
    let tok = prefix
        .profile
        .keys_within(&body.prompt, salt.as_deref(), budget)?;
    if let Some((b, requested)) = budget {
        if let Err(e) = b.output_tokens(tok.tokens.len(), requested, usize::MAX) {
            return Err(GatewayError::from_prompt(e, body.prompt.param()));
        }
    }
    Ok(Looked {
        prompt_tokens: tok.tokens.len(),
        output_tokens: requested
            .unwrap_or(prompt_profile::work::DEFAULT_OUTPUT_TOKENS as usize)
            .saturating_mul(body.choices),
        keys: tok.keys,
        seed: tok.seed,
        matches: Vec::new(),
        reads_cache: !body.scores_prompt,
    })
}

/// `POST /v1/responses/input_tokens` on a prefix-routed service: the prompt tokens the same
/// body would send to a worker (its `usage.input_tokens`), by the pinned profile and the
/// reading routing uses ([`InferenceBody::parse`] → `PromptProfile::tokenize_within`). With
/// `truncation: "auto"` the count is of the turns kept; without it a prompt over the context is
/// still counted (a create would be refused `context_length_exceeded`). O(body) CPU: callers
/// run it on the routing pool.
pub fn input_tokens(
    profile: &crate::profile::LoadedProfile,
    body: &[u8],
) -> Result<usize, GatewayError> {
    let body = InferenceBody::parse(Endpoint::Responses, body)?;
    let requested = body
        .max_tokens
        .map(|m| usize::try_from(m).unwrap_or(usize::MAX));
    let budget = body
        .prompt
        .truncates()
        .then(|| (profile.budget(), requested));
    Ok(profile.tokenize(&body.prompt, budget)?.len())
}

/// A worker's load in `metric` given its queued (prefill, decode) tokens: in-flight requests
/// are this replica's plus, in cluster mode, the others' (leased tables); active tokens are the
/// queued tokens ([`crate::view::WorkerRuntime::queued_tokens`]: the gateways' count or the
/// worker's own report, whichever is larger).
fn load_of(runtime: &crate::view::WorkerRuntime, metric: LoadMetric, queued: (u64, u64)) -> u64 {
    match metric {
        LoadMetric::InFlight => runtime
            .in_flight
            .load(Ordering::Relaxed)
            .saturating_add(runtime.remote_in_flight.load(Ordering::Relaxed)),
        LoadMetric::ActiveTokens => queued.0.saturating_add(queued.1),
    }
}

/// The CPU time a decision's thread spent on it ([`decide_timed`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DecisionCpu {
    /// The whole decision.
    pub total: std::time::Duration,
    /// Of which parsing, rendering, tokenizing and block keys (everything before the placement
    /// lock): the part that depends on the prompt and on this replica's tokenizer caches, not
    /// on the workers' load.
    pub tokenize: std::time::Duration,
}

/// [`decide`] with the CPU time its thread spent on it (`None` where the thread clock is not
/// available): the cost of the decision itself, without the wait for a CPU or a pool thread,
/// and the part of it spent tokenizing.
#[allow(clippy::type_complexity)]
pub fn decide_timed(
    view: &View,
    index: &PrefixIndex,
    input: &RouteInput,
) -> (
    Result<(Decision, Option<InFlight>), GatewayError>,
    Option<DecisionCpu>,
) {
    let clock = crate::metrics::thread_cpu_time;
    let before = clock();
    let looked = tokenize(input);
    let tokenized = clock();
    let decided = looked.and_then(|l| place(view, index, input, l));
    let after = clock();
    let cpu = before
        .zip(tokenized)
        .zip(after)
        .map(|((b, t), a)| DecisionCpu {
            total: a.saturating_sub(b),
            tokenize: t.saturating_sub(b),
        });
    (decided, cpu)
}

/// Decides where a request goes, and with prefix routing reserves the first choice's load at
/// once (the [`InFlight`] the first attempt keeps, [`crate::upstream::begin_attempt`]): reading
/// the loads, selecting and reserving happen under the service's placement lock, so two
/// concurrent decisions see each other's choice. Errors are client errors (400/503) to answer
/// directly.
pub fn decide(
    view: &View,
    index: &PrefixIndex,
    input: &RouteInput,
) -> Result<(Decision, Option<InFlight>), GatewayError> {
    place(view, index, input, tokenize(input)?)
}

/// The first half of [`decide`]: with prefix routing, the prompt's tokens and keys (the
/// decision's main cost, which runs outside the placement lock).
fn tokenize(input: &RouteInput) -> Result<Option<Looked>, GatewayError> {
    input
        .service
        .prefix
        .as_ref()
        .map(|p| look_up(p, input))
        .transpose()
}

/// The second half of [`decide`]: index lookup, policy and reservation under the service's
/// placement lock.
fn place(
    view: &View,
    index: &PrefixIndex,
    input: &RouteInput,
    looked: Option<Looked>,
) -> Result<(Decision, Option<InFlight>), GatewayError> {
    let service = &input.service;
    let mut looked = service.prefix.as_ref().zip(looked);
    // Round robin reads no load: no lock.
    let _placing = looked.as_ref().map(|_| service.placement.lock());
    // The lookup under the lock: a concurrent decision for the same new prefix that took the
    // lock first has left its routing-time holding in the index by now, so this one follows it
    // instead of placing the prefix a second time (measured: two requests of one new prefix
    // 0.5 ms apart on one gateway went to two workers when the lookup ran before the lock).
    if let Some((_, l)) = looked.as_mut().filter(|(_, l)| l.reads_cache) {
        l.matches = index.longest_matches(&l.keys);
    }
    let mut extra = Vec::new();
    let mut candidates = Vec::with_capacity(service.pool.len());
    let mut predicted_blocks = Vec::with_capacity(service.pool.len());
    let mut placed_blocks = Vec::with_capacity(service.pool.len());
    let now = std::time::Instant::now();
    for w in &service.pool {
        let Some(e) = view.workers.get(w) else {
            continue;
        };
        let (contract_ok, matched_blocks, cached_blocks, metric) = match &looked {
            None => (true, 0, 0, LoadMetric::InFlight),
            Some((p, l)) => {
                let m = l.matches.iter().find(|m| &m.worker == w);
                // A worker with KV events: its approximate holdings are routing-time ones,
                // good for placement, never a predicted hit.
                let predicted = if e.runtime.approximate() {
                    m.map_or(0, |m| m.blocks)
                } else {
                    m.map_or(0, |m| m.precise_blocks)
                };
                predicted_blocks.push((w.clone(), predicted));
                placed_blocks.push((w.clone(), m.map_or(0, |m| m.blocks)));
                (
                    e.runtime.contract_ok(),
                    m.map_or(0, |m| m.blocks),
                    index
                        .worker_stats(w)
                        .map_or(0, |s| s.precise_blocks + s.approximate_blocks),
                    p.rule.load_metric,
                )
            }
        };
        if !contract_ok {
            extra.push("contract");
        }
        // Round robin reads no queue (it would cost a lock per worker for nothing).
        let queued = if looked.is_some() {
            e.runtime.queued_tokens(now)
        } else {
            (0, 0)
        };
        candidates.push(Candidate {
            worker: w.clone(),
            healthy: e.routable() && contract_ok,
            load: load_of(&e.runtime, metric, queued),
            matched_blocks,
            weight: e.spec.weight,
            cached_blocks,
            prompt_tokens: looked.as_ref().map_or(0, |(_, l)| l.prompt_tokens as u64),
            queued_prefill: queued.0,
            queued_decode: queued.1,
        });
    }
    let sel = service.policy().select(&candidates);
    if sel.order.is_empty() {
        return Err(GatewayError::NoHealthyWorker {
            service: service.name().to_owned(),
        });
    }
    // Routing-time holdings: the chosen worker is believed to hold the prompt's blocks from now
    // on, for placement, until its events confirm them or the TTL passes.
    let mut pending = None;
    if let (Some((p, l)), Some(first)) = (&looked, sel.order.first()) {
        let event_fed = view
            .workers
            .get(first)
            .is_some_and(|e| !e.runtime.approximate());
        if p.rule.pending_ttl_ms > 0 && event_fed && !l.keys.is_empty() {
            let ttl = std::time::Duration::from_millis(p.rule.pending_ttl_ms);
            match index.insert_approximate_for(first, &l.keys, ttl) {
                Ok(()) => pending = Some((first.clone(), ttl)),
                Err(e) => {
                    tracing::debug!(worker = %first, error = %e, "routing-time holding skipped")
                }
            }
        }
    }
    let prompt = looked.map(|(p, l)| PromptFacts {
        prompt_tokens: l.prompt_tokens,
        keys: l.keys,
        seed: l.seed,
        hash_algorithm: p.profile.algorithm(),
        matched: predicted_blocks,
        placed: placed_blocks,
        block_size: p.profile.block_size.get(),
        output_tokens: l.output_tokens,
    });
    let mut decision = Decision {
        pending,
        ranked: Vec::new(),
        close: 0,
        claim_mark: None,
        seq: 0,
        order: sel.order,
        reason: sel.reason,
        extra_fallbacks: extra,
        prompt,
    };
    if let (Some(p), Some(first)) = (&service.prefix, decision.order.first()) {
        let (prefill, output) = decision.attempt_tokens(first).unwrap_or((0, 0));
        let window = routing_rules::policy::queued_cost(&p.rule, prefill, output);
        if let (Some(&(_, first_cost)), true) = (sel.ranked.first(), window > 0) {
            let bound = first_cost.saturating_add(window);
            decision.close = sel.ranked.iter().take_while(|(_, c)| *c <= bound).count();
        }
        decision.ranked = sel.ranked;
    }
    // Still under the lock, with the holding: a decision that follows it from now on sees
    // the mark and waits for the claim.
    if let (true, true, Some((w, _)), Some(p)) = (
        input.claiming,
        decision.close >= 2,
        &decision.pending,
        &decision.prompt,
    ) {
        let held = blocks_of(&p.placed, w);
        decision.claim_mark = service.claims_in_flight.mark(&p.keys, held, w);
    }
    let reserved = match decision.order.first().cloned() {
        Some(first) => reserve(view, &mut decision, &first, &input.numbering),
        None => None,
    };
    Ok((decision, reserved))
}

/// The load an attempt of `decision` on `worker` counts there ([`Decision::attempt_tokens`]),
/// reserved on the worker's runtime until the returned [`InFlight`] drops; numbered first
/// ([`Decision::seq`]).
fn reserve(
    view: &View,
    decision: &mut Decision,
    worker: &WorkerId,
    numbering: &AtomicU64,
) -> Option<InFlight> {
    let (prefill, output) = decision.attempt_tokens(worker)?;
    let e = view.workers.get(worker)?;
    decision.seq = numbering.fetch_add(1, Ordering::AcqRel) + 1;
    // Pairs with the sync loop's acquire fence: a table that reads this reservation in the
    // counters reads its number too.
    std::sync::atomic::fence(Ordering::Release);
    Some(InFlight::start(e.runtime.clone(), prefill, output))
}

/// Counts the prompt's first `blocks` blocks as placed on `worker` (no fewer than placement saw
/// there): a cluster claim followed another replica's *lead* to it — that replica has just
/// placed a prompt sharing those blocks there, whose holding this replica may not have received
/// yet. So an attempt there reserves only the rest of the prompt as prefill (when `worker` is
/// the first choice the reservation is taken again), and the decision this replica publishes
/// counts it the same way: without it, two requests of one new prefix placed by two replicas
/// counted its prefill twice on its worker, and the prefix's next request went cold elsewhere
/// (docs/benchmarks.md, "The N = 64 shared-prefix share"). Never a predicted hit: the ticket's
/// prediction reads `matched`, which this does not touch. Under the service's placement lock,
/// as [`decide`].
pub fn credit_lead(
    view: &View,
    decision: &mut Decision,
    reserved: &mut Option<InFlight>,
    service: &ServiceRoute,
    worker: &WorkerId,
    blocks: usize,
    numbering: &AtomicU64,
) {
    let _placing = service.placement.lock();
    if decision.credit_placed(worker, blocks) && decision.order.first() == Some(worker) {
        *reserved = reserve(view, decision, worker, numbering);
    }
}

/// Moves `decision`'s first choice to `to`, another admissible candidate (a cluster claim chose
/// it: another replica placed a request on the first choice a moment ago, or a prompt sharing
/// this one's prefix on `to`): `to` goes first (the rest keep their order), the reservation
/// moves there (the old one is released as it drops) and so does the routing-time holding —
/// the keys it added on the old choice are forgotten there (those the old choice held before
/// stay) and held on `to` for the same TTL. The ticket's prediction follows, being read per
/// worker. Under the service's placement lock, as [`decide`]. A `to` that is not admissible
/// (in `ranked`), or already first, changes nothing.
pub fn redirect(
    view: &View,
    index: &PrefixIndex,
    decision: &mut Decision,
    reserved: &mut Option<InFlight>,
    service: &ServiceRoute,
    to: &WorkerId,
    numbering: &AtomicU64,
) {
    if !decision.ranked.iter().any(|(w, _)| w == to) {
        return;
    }
    let Some(pos) = decision.order.iter().position(|w| w == to) else {
        return;
    };
    if pos == 0 {
        return;
    }
    let _placing = service.placement.lock();
    let old = decision.order[0].clone();
    let moved = decision.order.remove(pos);
    decision.order.insert(0, moved);
    if let (Some((w, ttl)), Some(p)) = (decision.pending.take(), decision.prompt.as_ref()) {
        if w == old {
            let held_before = blocks_of(&p.placed, &old).min(p.keys.len());
            if let Err(e) = index.remove_approximate(&old, &p.keys[held_before..]) {
                tracing::debug!(worker = %old, error = %e, "moved holding not forgotten");
            }
        }
        let event_fed = view
            .workers
            .get(to)
            .is_some_and(|e| !e.runtime.approximate());
        if event_fed && index.insert_approximate_for(to, &p.keys, ttl).is_ok() {
            decision.pending = Some((to.clone(), ttl));
        }
    }
    *reserved = reserve(view, decision, to, numbering);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::view::WorkerRuntime;

    fn decision(first: &str, placed: &[(&str, usize)]) -> Decision {
        Decision {
            order: vec![WorkerId(first.into()), WorkerId("w9".into())],
            reason: Reason::NoMatch,
            extra_fallbacks: Vec::new(),
            prompt: Some(PromptFacts {
                prompt_tokens: 1329,
                keys: (0..83).map(BlockKey).collect(),
                seed: NamespaceSeed([0; 32]),
                hash_algorithm: HashAlgorithm::Xxh3,
                matched: Vec::new(),
                placed: placed
                    .iter()
                    .map(|(w, b)| (WorkerId((*w).into()), *b))
                    .collect(),
                block_size: 16,
                output_tokens: 8,
            }),
            pending: None,
            ranked: Vec::new(),
            close: 0,
            claim_mark: None,
            seq: 0,
        }
    }

    /// A followed lead counts as placed: the attempt's prefill is only the prompt past it, so
    /// the reservation taken from it counts that much on the worker; never more blocks than the
    /// prompt has, never fewer than placement saw, never a predicted hit.
    #[test]
    fn a_credited_lead_leaves_only_the_rest_of_the_prompt_to_reserve() {
        let w2 = WorkerId("w2".into());
        let mut d = decision("w2", &[]);
        assert_eq!(d.attempt_tokens(&w2), Some((1329, 8)));
        assert!(d.credit_placed(&w2, 64));
        assert_eq!(d.attempt_tokens(&w2), Some((1329 - 64 * 16, 8)));
        assert_eq!(d.predicted_tokens(&w2), Some(0), "a lead is not a hit");
        // Less than what is already counted changes nothing.
        assert!(!d.credit_placed(&w2, 8));
        assert_eq!(d.attempt_tokens(&w2), Some((305, 8)));
        // Deeper than the prompt's full blocks: all of them, the partial last block still to
        // compute.
        assert!(d.credit_placed(&w2, 10_000));
        assert_eq!(d.attempt_tokens(&w2), Some((1329 - 83 * 16, 8)));
        assert!(!d.credit_placed(&w2, 0));

        // What the worker's count sees from the reservation taken from it.
        let r = std::sync::Arc::new(WorkerRuntime::new(w2.clone()));
        let (prefill, output) = d.attempt_tokens(&w2).unwrap();
        let reserved = InFlight::start(r.clone(), prefill, output);
        assert_eq!(r.queued_tokens(std::time::Instant::now()), (1, 8));
        drop(reserved);
        assert_eq!(r.queued_tokens(std::time::Instant::now()), (0, 0));

        // Placement saw 40 blocks held there: a 16-block lead adds nothing.
        let mut d = decision("w2", &[("w2", 40)]);
        assert!(!d.credit_placed(&w2, 16));
        assert_eq!(d.attempt_tokens(&w2), Some((1329 - 640, 8)));
        // No prompt facts (round robin): nothing to credit.
        let mut rr = decision("w2", &[]);
        rr.prompt = None;
        assert!(!rr.credit_placed(&w2, 16));
    }
}
