//! The routing decision for one request, from one [`View`]: round robin, or KV-exact
//! (parse → salt → render + tokenize → block keys → token budget → index lookup → policy).
//!
//! Cost: round robin is O(pool). KV-exact is dominated by rendering + tokenizing the prompt
//! (O(prompt length)); keys are one hash per full block; the index lookup costs O(blocks matched
//! + workers holding the first block) per the prefix-index crate; the policy O(pool · log pool).

use std::sync::atomic::Ordering;
use std::sync::Arc;

use prefix_index::{BlockKey, NamespaceSeed, PrefixIndex, WorkerId};
use routing_rules::policy::{Candidate, Reason};
use routing_rules::schema::{LoadMetric, Rule, TokenBudgetPolicy};

use crate::error::GatewayError;
use crate::protocol::{Endpoint, InferenceBody};
use crate::view::{ServiceRoute, View};

/// Why a request fell back from the plain choice, as a metric label. `None` for a hit or plain RR.
pub fn fallback_label(reason: Reason) -> Option<&'static str> {
    match reason {
        Reason::NoMatch | Reason::BelowMinMatch => Some("no_match"),
        Reason::LoadGuard => Some("load_guard"),
        Reason::Unhealthy => Some("unhealthy"),
        Reason::Hit | Reason::RoundRobin | Reason::NoHealthyWorker => None,
    }
}

/// What the gateway learned about a `kv_exact` prompt.
#[derive(Clone, Debug)]
pub struct PromptFacts {
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Block keys of the full blocks.
    pub keys: Vec<BlockKey>,
    /// The namespace seed.
    pub seed: NamespaceSeed,
    /// Matched blocks per candidate worker (for the ticket's prediction).
    pub matched: Vec<(WorkerId, usize)>,
    /// Tokens per block.
    pub block_size: usize,
}

/// A routing decision.
#[derive(Clone, Debug)]
pub struct Decision {
    /// The matched service.
    pub service: Arc<ServiceRoute>,
    /// First choice, then fallbacks for connect retries (healthy workers only).
    pub order: Vec<WorkerId>,
    /// The policy's reason for the first choice.
    pub reason: Reason,
    /// Extra fallback labels (e.g. `contract` when a worker was excluded for its profile).
    pub extra_fallbacks: Vec<&'static str>,
    /// KV-exact facts (None for round robin).
    pub prompt: Option<PromptFacts>,
    /// The namespace seed of the request (unsalted profile-less seed for round robin).
    pub seed_hex: String,
    /// The hash algorithm name for the ticket.
    pub hash_algorithm: String,
}

impl Decision {
    /// Predicted matched tokens on `worker` (KV-exact only).
    pub fn predicted_tokens(&self, worker: &WorkerId) -> Option<u32> {
        let p = self.prompt.as_ref()?;
        let blocks = p
            .matched
            .iter()
            .find(|(w, _)| w == worker)
            .map_or(0, |(_, b)| *b);
        u32::try_from(blocks * p.block_size).ok()
    }
}

/// The request facts routing needs besides the view.
pub struct RouteInput<'a> {
    /// The matched service.
    pub service: &'a Arc<ServiceRoute>,
    /// Request path.
    pub path: &'a str,
    /// The whole body.
    pub body: &'a [u8],
    /// Header lookup (lowercase names).
    pub header: &'a dyn Fn(&str) -> Option<String>,
}

fn load_of(view: &View, w: &WorkerId, metric: LoadMetric) -> u64 {
    // Only in-flight requests are known to the gateway; `active_tokens` falls back to it
    // (documented in docs/gateway.md).
    let _ = metric;
    view.workers
        .get(w)
        .map_or(0, |e| e.runtime.in_flight.load(Ordering::Relaxed))
}

/// Decides where a request goes. Errors are client errors (400/503) to answer directly.
pub fn decide(
    view: &View,
    index: &PrefixIndex,
    input: &RouteInput<'_>,
) -> Result<Decision, GatewayError> {
    let service = input.service;
    match &service.spec().rule {
        Rule::RoundRobin(_) => {
            let candidates: Vec<Candidate> = service
                .pool
                .iter()
                .filter_map(|w| view.workers.get(w))
                .map(|e| Candidate {
                    worker: e.spec.id.clone(),
                    healthy: e.healthy,
                    load: e.runtime.in_flight.load(Ordering::Relaxed),
                    matched_blocks: 0,
                    weight: e.spec.weight,
                    cached_blocks: 0,
                })
                .collect();
            let sel = service.policy().select(&candidates);
            if sel.order.is_empty() {
                return Err(GatewayError::NoHealthyWorker {
                    service: service.name().to_owned(),
                });
            }
            Ok(Decision {
                service: service.clone(),
                order: sel.order,
                reason: sel.reason,
                extra_fallbacks: Vec::new(),
                prompt: None,
                seed_hex: String::new(),
                hash_algorithm: String::new(),
            })
        }
        Rule::KvExact(rule) => {
            let profile = service
                .profile
                .as_ref()
                .ok_or_else(|| GatewayError::Internal {
                    reason: format!("service {} has no loaded profile", service.name()),
                })?;
            let endpoint =
                Endpoint::from_path(input.path).ok_or_else(|| GatewayError::InvalidBody {
                    reason: format!(
                        "kv_exact routes only /v1/chat/completions and /v1/completions, not {}",
                        input.path
                    ),
                })?;
            let body = InferenceBody::parse(endpoint, input.body)?;
            let header_salt = match &rule.salt {
                routing_rules::schema::SaltPolicy::TenantHeader { header, .. } => {
                    (input.header)(&header.to_ascii_lowercase())
                }
                _ => None,
            };
            let salt = rule
                .salt
                .effective_salt(header_salt.as_deref(), body.cache_salt.as_deref())
                .map_err(|r| GatewayError::InvalidBody {
                    reason: r.reason.to_owned(),
                })?;
            let tok = profile.keys(&body.prompt, salt.as_deref())?;
            if service.spec().token_budget == TokenBudgetPolicy::Reject {
                let requested = body
                    .max_tokens
                    .map(|m| usize::try_from(m).unwrap_or(usize::MAX));
                // The worker's own cap does not change the verdict (see `TokenBudget`).
                if let Err(prompt_profile::ProfileError::ContextLengthExceeded {
                    context_limit,
                    prompt_tokens,
                    max_tokens,
                    native_reserve,
                    ..
                }) = profile
                    .budget()
                    .output_tokens(tok.tokens.len(), requested, usize::MAX)
                {
                    return Err(GatewayError::ContextLengthExceeded {
                        prompt_tokens,
                        max_tokens,
                        reserve_tokens: native_reserve,
                        context_limit,
                    });
                }
            }
            let matches = index.longest_matches(&tok.keys);
            let matched_of = |w: &WorkerId| -> usize {
                matches
                    .iter()
                    .find(|m| &m.worker == w)
                    .map_or(0, |m| m.blocks)
            };
            let mut extra = Vec::new();
            let mut candidates = Vec::with_capacity(service.pool.len());
            for w in &service.pool {
                let Some(e) = view.workers.get(w) else {
                    continue;
                };
                let contract_ok = e.runtime.contract_ok();
                if !contract_ok {
                    extra.push("contract");
                }
                candidates.push(Candidate {
                    worker: w.clone(),
                    healthy: e.healthy && contract_ok,
                    load: load_of(view, w, rule.load_metric),
                    matched_blocks: matched_of(w),
                    weight: e.spec.weight,
                    cached_blocks: index
                        .worker_stats(w)
                        .map_or(0, |s| s.precise_blocks + s.approximate_blocks),
                });
            }
            let sel = service.policy().select(&candidates);
            if sel.order.is_empty() {
                return Err(GatewayError::NoHealthyWorker {
                    service: service.name().to_owned(),
                });
            }
            let matched = candidates
                .iter()
                .map(|c| (c.worker.clone(), c.matched_blocks))
                .collect();
            Ok(Decision {
                service: service.clone(),
                order: sel.order,
                reason: sel.reason,
                extra_fallbacks: extra,
                seed_hex: tok.seed.to_hex(),
                hash_algorithm: profile.algorithm().as_str().to_owned(),
                prompt: Some(PromptFacts {
                    prompt_tokens: tok.tokens.len(),
                    keys: tok.keys,
                    seed: tok.seed,
                    matched,
                    block_size: profile.block_size.get(),
                }),
            })
        }
    }
}
