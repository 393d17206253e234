//! The gateway's Prometheus metrics, registered once into a `Registry` the gateway owns
//! (no global statics). Served by the admin plane's `GET /metrics`, as OpenMetrics or the classic
//! text format by the scraper's `Accept` (`exposition`).
//!
//! Gauges that describe state owned elsewhere (index size, event lag) are refreshed from that
//! state just before each scrape, so they are never stale and cost nothing on the request path.

use parking_lot::Mutex;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;
use std::sync::atomic::AtomicU64;

/// Labels of `kvgate_gateway_requests_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RequestLabels {
    /// Matched service (`-` when none matched).
    pub service: String,
    /// Rule id (`-` when none).
    pub rule: String,
    /// `round_robin`, `kv_exact` or `-`.
    pub mode: String,
    /// The worker that served it (`-` when none).
    pub worker: String,
    /// HTTP status sent to the client.
    pub status: String,
}

/// Labels of a per-service counter.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ServiceLabels {
    /// The service.
    pub service: String,
}

/// Labels of `kvgate_gateway_fallbacks_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct FallbackLabels {
    /// The service.
    pub service: String,
    /// `no_match`, `load_guard`, `unhealthy`, `unparsable_body`, `contract`, `budget`, `connect`.
    pub reason: String,
}

/// Labels of `kvgate_gateway_rate_limited_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TenantLimitLabels {
    /// The tenant.
    pub tenant: String,
    /// `requests`, `tokens` or `concurrency`.
    pub limit: String,
}

/// Labels of `kvgate_gateway_background_responses_ended_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct BackgroundLabels {
    /// How it ended: `completed`, `incomplete`, `failed` or `cancelled`.
    pub status: String,
}

/// Labels of `kvgate_gateway_tenant_denied_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TenantServiceLabels {
    /// The tenant.
    pub tenant: String,
    /// The service it may not call.
    pub service: String,
}

/// Labels of a per-tenant gauge.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TenantLabels {
    /// The tenant.
    pub tenant: String,
}

/// Labels of a per-mode histogram.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ModeLabels {
    /// The service.
    pub service: String,
    /// `round_robin` or `kv_exact`.
    pub mode: String,
}

/// Labels of the cluster claims counter: `kept` (the first choice was claimed), `moved` (another
/// replica had just placed a new prompt there: a cold alternative was claimed), `failed` (Redis
/// did not answer in time or at all: the first choice stands, unclaimed).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ClaimLabels {
    pub outcome: String,
}

/// Labels of the gauge of what waits for Redis (cluster mode): `turns` (stored turns and
/// background records), `deletions`, `cancels`, `conversation_changes`, `stream_mirror_gaps`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct WaitingLabels {
    pub what: &'static str,
}

/// Labels of a per-worker gauge.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct WorkerLabels {
    /// The worker.
    pub worker: String,
}

/// Every metric the gateway exports.
pub struct Metrics {
    registry: Mutex<Registry>,
    /// Requests by service / rule / mode / worker / status.
    pub requests: Family<RequestLabels, Counter>,
    /// Time to decide a route (match + parse + render + tokenize + keys + lookup + policy).
    pub route_decision_seconds: Family<ModeLabels, Histogram>,
    /// CPU time of the routing computation alone (parse + render + tokenize + keys + lookup +
    /// policy), on the thread that ran it: unlike `route_decision_seconds` it leaves out the wait
    /// for a CPU and for the routing pool, so it is the decision's cost on a shared machine.
    pub route_decision_cpu_seconds: Family<ModeLabels, Histogram>,
    /// Of which tokenizing (parse, render, tokenize, keys), `kv_exact` services only.
    pub route_tokenize_cpu_seconds: Family<ModeLabels, Histogram>,
    /// Prompt tokens the gateway looked up in the index (`kv_exact`).
    pub lookup_tokens: Family<ServiceLabels, Counter>,
    /// Prompt tokens the chosen worker was predicted to hold (`kv_exact`).
    pub matched_tokens: Family<ServiceLabels, Counter>,
    /// Fallbacks by reason.
    pub fallbacks: Family<FallbackLabels, Counter>,
    /// Time to first response-body byte as seen by the gateway.
    pub ttft_seconds: Family<ModeLabels, Histogram>,
    /// Blocks in the prefix index (precise + approximate, all workers).
    pub index_blocks: Gauge,
    /// Seconds since each worker's event stream was last heard from (-1: not connected).
    pub event_lag_seconds: Family<WorkerLabels, Gauge<f64, AtomicU64>>,
    /// 1 when the worker is healthy.
    pub worker_healthy: Family<WorkerLabels, Gauge>,
    /// 1 when the rules cordon the worker (no new requests).
    pub worker_cordoned: Family<WorkerLabels, Gauge>,
    /// Requests in flight from this gateway to the worker.
    pub worker_in_flight: Family<WorkerLabels, Gauge>,
    /// The queued prefill / decode tokens placement and the load guard see on the worker.
    pub worker_queued_prefill_tokens: Family<WorkerLabels, Gauge>,
    pub worker_queued_decode_tokens: Family<WorkerLabels, Gauge>,
    /// The worker's fresh load report: running / waiting sequences (-1: no fresh report).
    pub worker_reported_running: Family<WorkerLabels, Gauge>,
    pub worker_reported_waiting: Family<WorkerLabels, Gauge>,
    /// `event: load` reports received from the worker (brought up to the worker's count at
    /// each scrape).
    pub worker_load_reports: Family<WorkerLabels, Counter>,
    pub worker_refusals: Family<WorkerLabels, Counter>,
    /// Rules version currently served.
    pub rules_version: Gauge,
    /// Client requests in flight on the proxy.
    pub requests_in_flight: Gauge,
    /// 1 while the gateway drains before a stop.
    pub draining: Gauge,
    /// Responses stored for `previous_response_id` (`crate::response_store`).
    pub stored_responses: Gauge,
    /// Their bytes (input items and response objects as JSON), conversations' included.
    pub stored_response_bytes: Gauge,
    /// Conversations held (`crate::conversation`).
    pub stored_conversations: Gauge,
    /// Background responses running now (`crate::background`).
    pub background_responses: Gauge,
    /// Background responses ended, by how.
    pub background_responses_ended: Family<BackgroundLabels, Counter>,
    /// Saves of the stored responses to `--response-store-file` that failed
    /// (`crate::response_file`).
    pub response_store_save_failures: Counter,
    /// Cluster mode: stored turns deleted from Redis to keep the replicas' stored responses
    /// within `--cluster-response-mb` (by this replica's writes).
    pub cluster_response_evictions: Counter,
    /// Cluster mode: the replicas' stored responses in Redis, bytes, at the last sync.
    pub cluster_stored_response_bytes: Gauge,
    pub cluster_waiting_for_redis: Family<WaitingLabels, Gauge>,
    /// Cluster mode: 1 while the shared store is unreachable (serving on the last rules,
    /// registrations and local load), else 0.
    pub cluster_degraded: Gauge,
    /// Cluster mode: cold placements claimed in Redis, by outcome ([`ClaimLabels`]).
    pub cluster_claims: Family<ClaimLabels, Counter>,
    /// Cluster mode: seconds a claim took (its Redis round trip, within the decision's time).
    pub cluster_claim_seconds: Histogram,
    /// Cluster mode: decisions that followed a close decision's fresh holding on this replica
    /// and waited for its claim, by outcome: `moved` (went where the claim went), `kept` (the
    /// claim kept its worker, or the claimed one was not admissible), `failed` (the claim gave
    /// up or did not settle within the claim timeout).
    pub cluster_claim_follows: Family<ClaimLabels, Counter>,
    /// Rules changes applied (file, admin, SIGHUP).
    pub rules_reloads: Counter,
    /// Rules changes refused.
    pub rules_rejected: Counter,
    /// Requests refused by a tenant's rate limit.
    pub rate_limited: Family<TenantLimitLabels, Counter>,
    pub tenant_in_flight: Family<TenantLabels, Gauge>,
    /// Requests refused for a missing or unknown API key.
    pub invalid_api_keys: Counter,
    /// Requests of a tenant to a service outside its `services` (answered 404).
    pub tenant_denied: Family<TenantServiceLabels, Counter>,
    /// Access-log lines dropped because the log's queue was full.
    pub access_log_dropped: Counter,
}

fn latency_histogram() -> Histogram {
    // 10 µs .. ~40 s
    Histogram::new(exponential_buckets(1e-5, 2.5, 17))
}

impl Metrics {
    /// Creates and registers every metric.
    pub fn new() -> Metrics {
        let mut registry = Registry::with_prefix("kvgate_gateway");
        let requests = Family::<RequestLabels, Counter>::default();
        registry.register(
            "requests",
            "Requests by service, rule, mode, worker and status",
            requests.clone(),
        );
        let route_decision_seconds = Family::<ModeLabels, Histogram>::new_with_constructor(
            latency_histogram as fn() -> Histogram,
        );
        registry.register(
            "route_decision_seconds",
            "Time to take a routing decision",
            route_decision_seconds.clone(),
        );
        let route_decision_cpu_seconds = Family::<ModeLabels, Histogram>::new_with_constructor(
            latency_histogram as fn() -> Histogram,
        );
        registry.register(
            "route_decision_cpu_seconds",
            "CPU time of the routing computation on the thread that ran it",
            route_decision_cpu_seconds.clone(),
        );
        let route_tokenize_cpu_seconds = Family::<ModeLabels, Histogram>::new_with_constructor(
            latency_histogram as fn() -> Histogram,
        );
        registry.register(
            "route_tokenize_cpu_seconds",
            "Of the routing computation's CPU time, the part spent parsing, rendering, tokenizing and computing block keys (kv_exact)",
            route_tokenize_cpu_seconds.clone(),
        );
        let lookup_tokens = Family::<ServiceLabels, Counter>::default();
        registry.register(
            "lookup_prompt_tokens",
            "Prompt tokens looked up in the prefix index",
            lookup_tokens.clone(),
        );
        let matched_tokens = Family::<ServiceLabels, Counter>::default();
        registry.register(
            "matched_prompt_tokens",
            "Prompt tokens predicted cached on the chosen worker",
            matched_tokens.clone(),
        );
        let fallbacks = Family::<FallbackLabels, Counter>::default();
        registry.register(
            "fallbacks",
            "Routing fallbacks by reason",
            fallbacks.clone(),
        );
        let ttft_seconds = Family::<ModeLabels, Histogram>::new_with_constructor(
            latency_histogram as fn() -> Histogram,
        );
        registry.register(
            "ttft_seconds",
            "Time to first response byte as seen by the gateway",
            ttft_seconds.clone(),
        );
        let index_blocks = Gauge::default();
        registry.register(
            "index_blocks",
            "Blocks in the prefix index",
            index_blocks.clone(),
        );
        let event_lag_seconds = Family::<WorkerLabels, Gauge<f64, AtomicU64>>::default();
        registry.register(
            "event_lag_seconds",
            "Seconds since the worker's KV event stream was last heard from (-1 = not connected)",
            event_lag_seconds.clone(),
        );
        let worker_healthy = Family::<WorkerLabels, Gauge>::default();
        registry.register(
            "worker_healthy",
            "1 when the worker is healthy",
            worker_healthy.clone(),
        );
        let worker_cordoned = Family::<WorkerLabels, Gauge>::default();
        registry.register(
            "worker_cordoned",
            "1 when the rules cordon the worker: it takes no new requests",
            worker_cordoned.clone(),
        );
        let worker_in_flight = Family::<WorkerLabels, Gauge>::default();
        registry.register(
            "worker_in_flight",
            "Requests in flight to the worker",
            worker_in_flight.clone(),
        );
        let worker_queued_prefill_tokens = Family::<WorkerLabels, Gauge>::default();
        registry.register(
            "worker_queued_prefill_tokens",
            "Prompt tokens queued on the worker as placement sees them: the larger of the gateways' count and the worker's fresh report",
            worker_queued_prefill_tokens.clone(),
        );
        let worker_queued_decode_tokens = Family::<WorkerLabels, Gauge>::default();
        registry.register(
            "worker_queued_decode_tokens",
            "Output tokens queued on the worker as placement sees them: the larger of the gateways' count and the worker's fresh report",
            worker_queued_decode_tokens.clone(),
        );
        let worker_reported_running = Family::<WorkerLabels, Gauge>::default();
        registry.register(
            "worker_reported_running",
            "Running sequences in the worker's fresh load report (-1: no fresh report)",
            worker_reported_running.clone(),
        );
        let worker_reported_waiting = Family::<WorkerLabels, Gauge>::default();
        registry.register(
            "worker_reported_waiting",
            "Waiting sequences in the worker's fresh load report (-1: no fresh report)",
            worker_reported_waiting.clone(),
        );
        let worker_load_reports = Family::<WorkerLabels, Counter>::default();
        registry.register(
            "worker_load_reports",
            "Load reports (event: load messages) received from the worker",
            worker_load_reports.clone(),
        );
        let worker_refusals = Family::<WorkerLabels, Counter>::default();
        registry.register(
            "worker_refusals",
            "Requests the worker refused before answering (429 / 503), retried elsewhere or not",
            worker_refusals.clone(),
        );
        let requests_in_flight = Gauge::default();
        registry.register(
            "requests_in_flight",
            "Client requests in flight on the proxy",
            requests_in_flight.clone(),
        );
        let draining = Gauge::default();
        registry.register(
            "draining",
            "1 while the gateway drains before a stop (/ready answers 503, requests in flight finish)",
            draining.clone(),
        );
        let rules_version = Gauge::default();
        registry.register(
            "rules_version",
            "Rules version in force",
            rules_version.clone(),
        );
        let cluster_degraded = Gauge::default();
        registry.register(
            "cluster_degraded",
            "1 while the cluster store (Redis) is unreachable",
            cluster_degraded.clone(),
        );
        let cluster_claims = Family::<ClaimLabels, Counter>::default();
        registry.register(
            "cluster_claims",
            "Cluster mode: cold placements claimed in Redis, by outcome (kept, moved, failed)",
            cluster_claims.clone(),
        );
        let cluster_claim_follows = Family::<ClaimLabels, Counter>::default();
        registry.register(
            "cluster_claim_follows",
            "Cluster mode: decisions that followed another decision's fresh holding on this replica and waited for its claim, by outcome (kept, moved, failed)",
            cluster_claim_follows.clone(),
        );
        let cluster_claim_seconds = latency_histogram();
        registry.register(
            "cluster_claim_seconds",
            "Cluster mode: seconds a cold placement's claim took",
            cluster_claim_seconds.clone(),
        );
        let rules_reloads = Counter::default();
        registry.register(
            "rules_changes",
            "Rules changes applied",
            rules_reloads.clone(),
        );
        let rules_rejected = Counter::default();
        registry.register(
            "rules_rejected",
            "Rules changes refused",
            rules_rejected.clone(),
        );
        let rate_limited = Family::<TenantLimitLabels, Counter>::default();
        registry.register(
            "rate_limited",
            "Requests refused by a tenant's rate limit (429)",
            rate_limited.clone(),
        );
        let tenant_in_flight = Family::<TenantLabels, Gauge>::default();
        registry.register(
            "tenant_requests_in_flight",
            "Requests of the tenant in flight (against its max_concurrent_requests)",
            tenant_in_flight.clone(),
        );
        let invalid_api_keys = Counter::default();
        registry.register(
            "invalid_api_keys",
            "Requests refused for a missing or unknown API key (401)",
            invalid_api_keys.clone(),
        );
        let tenant_denied = Family::<TenantServiceLabels, Counter>::default();
        registry.register(
            "tenant_denied",
            "Requests of a tenant to a service outside its `services` (answered 404 service_not_found)",
            tenant_denied.clone(),
        );
        let stored_responses = Gauge::default();
        registry.register(
            "stored_responses",
            "Responses API answers stored for previous_response_id and GET /v1/responses/{id}",
            stored_responses.clone(),
        );
        let stored_response_bytes = Gauge::default();
        registry.register(
            "stored_response_bytes",
            "Bytes of the stored responses and conversations (their items and objects as JSON)",
            stored_response_bytes.clone(),
        );
        let stored_conversations = Gauge::default();
        registry.register(
            "stored_conversations",
            "Conversations (the Conversations API) held by this gateway",
            stored_conversations.clone(),
        );
        let background_responses = Gauge::default();
        registry.register(
            "background_responses",
            "Background responses (background: true) this gateway runs now",
            background_responses.clone(),
        );
        let background_responses_ended = Family::<BackgroundLabels, Counter>::default();
        registry.register(
            "background_responses_ended",
            "Background responses this gateway ran, by how they ended (completed, incomplete, failed, cancelled)",
            background_responses_ended.clone(),
        );
        let response_store_save_failures = Counter::default();
        registry.register(
            "response_store_save_failures",
            "Saves of the stored responses to --response-store-file that failed (the previous file is kept)",
            response_store_save_failures.clone(),
        );
        let cluster_response_evictions = Counter::default();
        registry.register(
            "cluster_response_evictions",
            "Cluster mode: stored responses deleted from Redis, least recently used first, to keep the replicas' stored responses within --cluster-response-mb (counted by the replica whose write made room)",
            cluster_response_evictions.clone(),
        );
        let cluster_stored_response_bytes = Gauge::default();
        registry.register(
            "cluster_stored_response_bytes",
            "Cluster mode: bytes of the replicas' stored responses in Redis (all replicas together, bounded by --cluster-response-mb), read at each sync",
            cluster_stored_response_bytes.clone(),
        );
        let cluster_waiting_for_redis = Family::<WaitingLabels, Gauge>::default();
        registry.register(
            "cluster_waiting_for_redis",
            "Cluster mode: what this replica made while Redis did not take it, waiting to be written there once Redis answers (what: turns, deletions, cancels, conversation_changes, stream_mirror_gaps: streamed background responses whose mirror misses events)",
            cluster_waiting_for_redis.clone(),
        );
        let access_log_dropped = Counter::default();
        registry.register(
            "access_log_dropped",
            "Access-log lines dropped because the log's queue was full (the writer fell behind)",
            access_log_dropped.clone(),
        );
        Metrics {
            registry: Mutex::new(registry),
            access_log_dropped,
            rate_limited,
            tenant_in_flight,
            invalid_api_keys,
            tenant_denied,
            requests,
            route_decision_seconds,
            route_decision_cpu_seconds,
            route_tokenize_cpu_seconds,
            lookup_tokens,
            matched_tokens,
            fallbacks,
            ttft_seconds,
            index_blocks,
            event_lag_seconds,
            worker_healthy,
            worker_cordoned,
            worker_in_flight,
            worker_queued_prefill_tokens,
            worker_queued_decode_tokens,
            worker_reported_running,
            worker_reported_waiting,
            worker_load_reports,
            worker_refusals,
            rules_version,
            requests_in_flight,
            draining,
            stored_responses,
            stored_response_bytes,
            stored_conversations,
            background_responses,
            background_responses_ended,
            response_store_save_failures,
            cluster_response_evictions,
            cluster_stored_response_bytes,
            cluster_waiting_for_redis,
            cluster_degraded,
            cluster_claims,
            cluster_claim_seconds,
            cluster_claim_follows,
            rules_reloads,
            rules_rejected,
        }
    }

    /// Counts one fallback.
    pub fn fallback(&self, service: &str, reason: &str) {
        self.fallbacks
            .get_or_create(&FallbackLabels {
                service: service.to_owned(),
                reason: reason.to_owned(),
            })
            .inc();
    }

    /// The registry as OpenMetrics text.
    pub fn encode(&self) -> String {
        self.render(exposition::Format::OpenMetrics)
    }

    /// The registry in the negotiated exposition format.
    pub fn render(&self, format: exposition::Format) -> String {
        let registry = self.registry.lock();
        // Writing into a String cannot fail.
        exposition::render(&registry, format).unwrap_or_default()
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}

/// One service's metric handles, resolved once (per service and rules version, on its first
/// request) instead of building label strings and looking them up on every request. The
/// per-(worker, status) request counters are resolved once per pair and kept here.
#[derive(Debug)]
pub struct ServiceHandles {
    pub route_decision: Histogram,
    pub route_decision_cpu: Histogram,
    /// Of which tokenizing.
    pub route_tokenize_cpu: Histogram,
    pub ttft: Histogram,
    pub lookup_tokens: Counter,
    pub matched_tokens: Counter,
    service: String,
    rule: String,
    mode: String,
    requests: parking_lot::RwLock<std::collections::HashMap<RequestKey, Counter>>,
}

/// A request counter's varying labels within one service: the worker and the status.
type RequestKey = (Option<prefix_index::WorkerId>, Option<u16>);

impl ServiceHandles {
    /// The handles of `service` (rule id `rule`, mode `mode`) in `m`.
    pub fn resolve(m: &Metrics, service: &str, rule: &str, mode: &str) -> ServiceHandles {
        let ml = ModeLabels {
            service: service.to_owned(),
            mode: mode.to_owned(),
        };
        let sl = ServiceLabels {
            service: service.to_owned(),
        };
        ServiceHandles {
            route_decision: m.route_decision_seconds.get_or_create(&ml).clone(),
            route_decision_cpu: m.route_decision_cpu_seconds.get_or_create(&ml).clone(),
            route_tokenize_cpu: m.route_tokenize_cpu_seconds.get_or_create(&ml).clone(),
            ttft: m.ttft_seconds.get_or_create(&ml).clone(),
            lookup_tokens: m.lookup_tokens.get_or_create(&sl).clone(),
            matched_tokens: m.matched_tokens.get_or_create(&sl).clone(),
            service: service.to_owned(),
            rule: rule.to_owned(),
            mode: mode.to_owned(),
            requests: parking_lot::RwLock::new(std::collections::HashMap::new()),
        }
    }

    /// Counts one finished request of this service, served by `worker` with `status`.
    pub fn request(
        &self,
        m: &Metrics,
        worker: Option<&prefix_index::WorkerId>,
        status: Option<u16>,
    ) {
        let key = (worker.cloned(), status);
        if let Some(c) = self.requests.read().get(&key) {
            c.inc();
            return;
        }
        let c = m
            .requests
            .get_or_create(&RequestLabels {
                service: self.service.clone(),
                rule: self.rule.clone(),
                mode: self.mode.clone(),
                worker: worker.map_or_else(|| "-".to_owned(), |w| w.0.clone()),
                status: status.map_or_else(|| "0".to_owned(), |s| s.to_string()),
            })
            .clone();
        c.inc();
        let mut map = self.requests.write();
        // Bounded by the pool's workers × the statuses seen; a pathological spread of statuses
        // still only costs the label lookup again.
        if map.len() < 4096 {
            map.insert(key, c);
        }
    }
}

/// CPU time consumed so far by the calling thread (`CLOCK_THREAD_CPUTIME_ID`); `None` where the
/// clock is not available. The difference of two readings on one thread is the CPU that thread
/// spent between them, whatever else the machine ran meanwhile.
pub fn thread_cpu_time() -> Option<std::time::Duration> {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec for the duration of the call.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    (rc == 0).then(|| {
        std::time::Duration::new(
            u64::try_from(ts.tv_sec).unwrap_or(0),
            u32::try_from(ts.tv_nsec).unwrap_or(0),
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn the_thread_clock_counts_work_and_not_sleep() {
        let start = thread_cpu_time().expect("CLOCK_THREAD_CPUTIME_ID on Linux");
        // Work until this thread's clock moved 10 ms (bounded by 10 s of wall time).
        let wall = std::time::Instant::now();
        let mut x = 0u64;
        while thread_cpu_time().unwrap() - start < Duration::from_millis(10) {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1);
            assert!(
                wall.elapsed() < Duration::from_secs(10),
                "the clock never moved"
            );
        }
        std::hint::black_box(x);
        let worked = thread_cpu_time().unwrap();
        std::thread::sleep(Duration::from_millis(200));
        let slept = thread_cpu_time().unwrap() - worked;
        assert!(
            slept < Duration::from_millis(100),
            "sleeping used {slept:?} of CPU"
        );
    }

    #[test]
    fn encodes_registered_families() {
        let m = Metrics::new();
        m.requests
            .get_or_create(&RequestLabels {
                service: "chat".into(),
                rule: "chat/kv_exact".into(),
                mode: "kv_exact".into(),
                worker: "w1".into(),
                status: "200".into(),
            })
            .inc();
        m.fallback("chat", "no_match");
        let text = m.encode();
        assert!(text.contains(
            "kvgate_gateway_requests_total{service=\"chat\",rule=\"chat/kv_exact\",mode=\"kv_exact\",worker=\"w1\",status=\"200\"} 1"
        ), "{text}");
        assert!(
            text.contains("kvgate_gateway_fallbacks_total{service=\"chat\",reason=\"no_match\"} 1")
        );
        assert!(text.ends_with("# EOF\n"));
    }
}
