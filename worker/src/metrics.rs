//! The worker's Prometheus metrics: one [`Registry`] owned by the running server (no globals),
//! rendered by `GET /metrics` in the OpenMetrics text format of `prometheus-client`.
//!
//! Two kinds of series:
//! - request-path series the server updates itself ([`ServerMetrics`]): requests by endpoint and
//!   status, rejections by reason (the `ApiError` code), TTFT, inter-token latency, queue time,
//!   end-to-end duration, receipts written / failed;
//! - engine series read from [`engine::EngineStats`] at scrape time ([`EngineCollector`]):
//!   running / waiting sequences, KV blocks by state, prefix-hit / prompt / generation tokens,
//!   engine steps. Reading them at scrape time keeps the engine free of metric code.
//!
//! Every name is prefixed `kvgate_worker_`; the list is in `docs/worker-api.md`.

use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;

use engine::{Engine, EngineStats};

type Labels = Vec<(&'static str, String)>;

/// Series the request path updates.
#[derive(Clone)]
pub struct ServerMetrics {
    requests: Family<Labels, Counter>,
    rejections: Family<Labels, Counter>,
    ttft: Histogram,
    itl: Histogram,
    queue_time: Histogram,
    e2e: Histogram,
    receipts_written: Counter,
    receipt_failures: Counter,
    cancelled: Counter,
    routed_prefix: Family<Labels, Counter>,
    constrained: Family<Labels, Counter>,
}

impl ServerMetrics {
    /// Registers the server's series and the engine collector into `registry`.
    pub fn register(
        registry: &mut Registry,
        engine: Engine,
        ready: Arc<AtomicBool>,
        drain: crate::drain::Drain,
        schemas: Arc<engine::schema_cache::SchemaCache>,
    ) -> Self {
        let m = ServerMetrics {
            requests: Family::default(),
            rejections: Family::default(),
            // 1 ms .. ~65 s
            ttft: Histogram::new(exponential_buckets(0.001, 2.0, 17)),
            // 0.5 ms .. ~16 s
            itl: Histogram::new(exponential_buckets(0.0005, 2.0, 16)),
            queue_time: Histogram::new(exponential_buckets(0.0005, 2.0, 18)),
            e2e: Histogram::new(exponential_buckets(0.005, 2.0, 16)),
            receipts_written: Counter::default(),
            receipt_failures: Counter::default(),
            cancelled: Counter::default(),
            routed_prefix: Family::default(),
            constrained: Family::default(),
        };
        let r = registry.sub_registry_with_prefix("kvgate_worker");
        r.register(
            "requests",
            "HTTP requests answered, by endpoint and status code",
            m.requests.clone(),
        );
        r.register(
            "rejections",
            "Requests refused, by reason (the error code)",
            m.rejections.clone(),
        );
        r.register(
            "time_to_first_token_seconds",
            "Time from request received to first generated token",
            m.ttft.clone(),
        );
        r.register(
            "inter_token_latency_seconds",
            "Time between consecutive generated tokens of one sequence",
            m.itl.clone(),
        );
        r.register(
            "queue_time_seconds",
            "Time a sequence waited for admission before it was scheduled",
            m.queue_time.clone(),
        );
        r.register(
            "request_duration_seconds",
            "Time from request received to its last byte, for admitted generation requests",
            m.e2e.clone(),
        );
        r.register(
            "receipts_written",
            "Signed receipts appended to the receipt log",
            m.receipts_written.clone(),
        );
        r.register(
            "receipt_failures",
            "Receipts that could not be appended to the receipt log",
            m.receipt_failures.clone(),
        );
        r.register(
            "cancelled",
            "Generation requests whose client went away before the end",
            m.cancelled.clone(),
        );
        r.register(
            "routed_prefix_tokens",
            "Prompt tokens of answered kv_exact requests by the ticket's service and rule: the \
             gateway's predicted cached tokens (kind=predicted) and the engine's (kind=cached)",
            m.routed_prefix.clone(),
        );
        r.register(
            "constrained_requests",
            "Generation requests whose answer a response_format or a forced tool call \
             constrains, by format (json_object, json_schema, tool_call)",
            m.constrained.clone(),
        );
        r.register_collector(Box::new(EngineCollector { engine, ready }));
        r.register_collector(Box::new(DrainCollector(drain)));
        r.register_collector(Box::new(SchemaCacheCollector(schemas)));
        m
    }

    /// Counts an answered request's predicted (ticket) and observed (engine) cached tokens.
    pub fn routed_prefix(&self, service: &str, rule_id: &str, predicted: u32, cached: u32) {
        for (kind, n) in [("predicted", predicted), ("cached", cached)] {
            self.routed_prefix
                .get_or_create(&vec![
                    ("service", service.to_owned()),
                    ("rule_id", rule_id.to_owned()),
                    ("kind", kind.to_owned()),
                ])
                .inc_by(u64::from(n));
        }
    }

    /// Counts one answered request.
    pub fn request(&self, endpoint: &'static str, status: u16) {
        self.requests
            .get_or_create(&vec![
                ("endpoint", endpoint.to_string()),
                ("status", status.to_string()),
            ])
            .inc();
    }

    /// Counts one refusal by its error code.
    pub fn rejection(&self, reason: &str) {
        self.rejections
            .get_or_create(&vec![("reason", reason.to_string())])
            .inc();
    }

    pub fn observe_ttft(&self, s: f64) {
        self.ttft.observe(s);
    }

    pub fn observe_itl(&self, s: f64) {
        self.itl.observe(s);
    }

    pub fn observe_queue_time(&self, s: f64) {
        self.queue_time.observe(s);
    }

    pub fn observe_e2e(&self, s: f64) {
        self.e2e.observe(s);
    }

    pub fn receipt_written(&self) {
        self.receipts_written.inc();
    }

    pub fn receipt_failed(&self) {
        self.receipt_failures.inc();
    }

    pub fn cancelled(&self) {
        self.cancelled.inc();
    }

    /// Counts a request submitted with a constraint (`response_format`, or `tool_call` for a
    /// forced tool call).
    pub fn constrained(&self, format: &'static str) {
        self.constrained
            .get_or_create(&vec![("format", format.to_owned())])
            .inc();
    }
}

/// Reads [`EngineStats`] at scrape time.
struct EngineCollector {
    engine: Engine,
    ready: Arc<AtomicBool>,
}

impl fmt::Debug for EngineCollector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EngineCollector").finish_non_exhaustive()
    }
}

pub(crate) fn gauge(enc: &mut DescriptorEncoder, name: &str, help: &str, v: i64) -> fmt::Result {
    let g = ConstGauge::new(v);
    let me = enc.encode_descriptor(name, help, None, g.metric_type())?;
    g.encode(me)
}

fn counter(enc: &mut DescriptorEncoder, name: &str, help: &str, v: u64) -> fmt::Result {
    let c = ConstCounter::new(v);
    let me = enc.encode_descriptor(name, help, None, c.metric_type())?;
    c.encode(me)
}

fn clamp(v: usize) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

impl Collector for EngineCollector {
    fn encode(&self, mut enc: DescriptorEncoder) -> fmt::Result {
        let s: EngineStats = self.engine.stats();
        gauge(
            &mut enc,
            "running_sequences",
            "Sequences in the running batch",
            clamp(s.running),
        )?;
        gauge(
            &mut enc,
            "waiting_sequences",
            "Sequences waiting for admission",
            clamp(s.waiting),
        )?;
        {
            let mut me = enc.encode_descriptor(
                "kv_blocks",
                "KV cache blocks by state (used = referenced by a sequence, cached = unreferenced but holding a cached prefix key, tail = unreferenced partial last block of a finished sequence kept for reuse, free)",
                None,
                MetricType::Gauge,
            )?;
            for (state, v) in [
                ("used", s.blocks_used),
                ("cached", s.blocks_cached),
                ("tail", s.blocks_tail),
                ("free", s.blocks_free),
            ] {
                let labels: Labels = vec![("state", state.to_string())];
                me.encode_family(&labels)?.encode_gauge(&clamp(v))?;
            }
        }
        gauge(
            &mut enc,
            "kv_blocks_capacity",
            "KV cache blocks preallocated",
            clamp(s.blocks_total),
        )?;
        counter(
            &mut enc,
            "prefix_hit_tokens",
            "Prompt tokens reused from the prefix cache",
            s.prefix_hit_tokens,
        )?;
        counter(
            &mut enc,
            "prompt_tokens",
            "Prompt tokens of admitted sequences",
            s.prompt_tokens,
        )?;
        counter(
            &mut enc,
            "generation_tokens",
            "Tokens generated",
            s.generation_tokens,
        )?;
        counter(&mut enc, "engine_steps", "Engine forward steps", s.steps)?;
        gauge(
            &mut enc,
            "engine_step_budget_tokens",
            "Tokens the next engine step may hold (the fixed step token budget, or what the step time target allows)",
            clamp(s.step_budget_tokens),
        )?;
        gauge(
            &mut enc,
            "ready",
            "1 while the worker serves: the start-up smoke inference produced a token and the engine runs",
            i64::from(
                self.ready.load(Ordering::Acquire)
                    && self.engine.health() == engine::EngineHealth::Running,
            ),
        )
    }
}

/// Reads the compiled-schema cache's counts at scrape time.
struct SchemaCacheCollector(Arc<engine::schema_cache::SchemaCache>);

impl fmt::Debug for SchemaCacheCollector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SchemaCacheCollector")
            .finish_non_exhaustive()
    }
}

impl Collector for SchemaCacheCollector {
    fn encode(&self, mut enc: DescriptorEncoder) -> fmt::Result {
        let s = self.0.stats();
        {
            let mut me = enc.encode_descriptor(
                "schema_cache_lookups",
                "Schemas of json_schema answers and forced tool calls looked up in the compiled-schema cache, by result (hit: kept from an earlier request; miss: compiled)",
                None,
                MetricType::Counter,
            )?;
            for (result, v) in [("hit", s.hits), ("miss", s.misses)] {
                let labels: Labels = vec![("result", result.to_string())];
                me.encode_family(&labels)?
                    .encode_counter::<prometheus_client::encoding::NoLabelSet, _, u64>(&v, None)?;
            }
        }
        gauge(
            &mut enc,
            "schema_cache_entries",
            "Compiled schemas kept",
            clamp(s.entries),
        )?;
        gauge(
            &mut enc,
            "schema_cache_bytes",
            "Bytes of the compiled schemas kept (their keys' text and the schemas' estimate), bounded by --schema-cache-mb",
            clamp(s.bytes),
        )
    }
}

/// Reads a server's [`crate::drain::Drain`] at scrape time: `draining` and
/// `requests_in_flight`, under the registry's prefix (`kvgate_worker_`, `kvgate_sidecar_`).
pub(crate) struct DrainCollector(pub(crate) crate::drain::Drain);

impl fmt::Debug for DrainCollector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DrainCollector").finish_non_exhaustive()
    }
}

impl Collector for DrainCollector {
    fn encode(&self, mut enc: DescriptorEncoder) -> fmt::Result {
        gauge(
            &mut enc,
            "draining",
            "1 while the server drains before a stop (/ready answers 503, requests in flight finish)",
            i64::from(self.0.draining()),
        )?;
        gauge(
            &mut enc,
            "requests_in_flight",
            "Inference requests being answered (until their answer's body is done)",
            clamp(self.0.in_flight()),
        )
    }
}
