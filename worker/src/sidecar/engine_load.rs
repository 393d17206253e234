//! The engine's own view of its load, read every `interval` into the load book
//! ([`super::load`]), so the sidecar's report counts the requests that reached the engine
//! around it too (direct clients, another proxy). Two sources ([`EngineLoadSource`]):
//!
//! **llama-server's `GET /slots`** (every 100 ms by default). Per slot with `is_processing`: `running` + 1 and `decode_tokens` + the output it may still
//! generate — its `next_token[0].n_remain` (llama-server's `n_predict` minus the tokens
//! generated), or, where that is −1 (no limit asked for), the default a gateway assumes for a
//! request that names none ([`prompt_profile::work::DEFAULT_OUTPUT_TOKENS`]) minus
//! `n_decoded`; never more than the slot's `n_ctx`. `/slots` does not say how much of a slot's
//! prompt is still to compute, nor how many requests wait for a slot, so `prefill_tokens` and
//! `waiting` stay the book's.
//!
//! **A Prometheus exposition** (`GET /metrics`, every 500 ms by default) with two gauges, the
//! requests running and waiting: vLLM's `vllm:num_requests_running` and
//! `vllm:num_requests_waiting`, SGLang's `sglang:num_running_reqs` and `sglang:num_queue_reqs`
//! (each summed over its label sets). `running` and `waiting` are those counts and
//! `decode_tokens` counts each of their requests as [`DEFAULT_OUTPUT_TOKENS`] (their
//! remaining output is not published); `prefill_tokens` stays the book's. An exposition with
//! neither series is "unsupported".
//!
//! While reads succeed, the end of a request the sidecar relayed brings the next read forward
//! (at most one read per 20 ms), so the ended request leaves the engine's view about as soon as
//! it left the sidecar's count.
//!
//! An answer that cannot be read (the engine down, a 5xx, a body that is not the slots array or
//! an exposition with counts in those series, larger than 1 MiB (`/slots`) or 8 MiB (an
//! exposition), or slower than 2 s) drops the engine's view until a read succeeds (the book's
//! count alone is reported), with reads backing off to one per 5 s; a 4xx or 501 (a
//! `llama-server --no-slots`, an engine without the endpoint), or an exposition without either
//! series, means "unsupported", read again every 30 s. Nothing here is a client's input; nothing panics on what the engine sends.

use std::sync::Arc;
use std::time::Duration;

use prefix_index::WorkerLoad;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;
use serde::Deserialize;
use tokio_util::sync::CancellationToken;

use prompt_profile::work::DEFAULT_OUTPUT_TOKENS;

use super::load::LoadBook;

/// What the engine's own load is read from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum EngineLoadSource {
    /// llama-server's `GET /slots` array.
    Slots,
    /// A Prometheus text exposition with a gauge of running and one of waiting requests.
    Metrics {
        /// The running requests' series name.
        running: String,
        /// The waiting requests' series name.
        waiting: String,
    },
}

impl EngineLoadSource {
    /// vLLM's `vllm:num_requests_running` / `vllm:num_requests_waiting`.
    pub fn vllm() -> Self {
        EngineLoadSource::Metrics {
            running: "vllm:num_requests_running".into(),
            waiting: "vllm:num_requests_waiting".into(),
        }
    }

    /// SGLang's `sglang:num_running_reqs` / `sglang:num_queue_reqs` (`--enable-metrics`).
    pub fn sglang() -> Self {
        EngineLoadSource::Metrics {
            running: "sglang:num_running_reqs".into(),
            waiting: "sglang:num_queue_reqs".into(),
        }
    }

    /// The engine path read by default (`/slots`, `/metrics`).
    pub fn default_path(&self) -> &'static str {
        match self {
            EngineLoadSource::Slots => "/slots",
            EngineLoadSource::Metrics { .. } => "/metrics",
        }
    }

    /// The time between two reads by default: 100 ms for `/slots` (a small answer, served
    /// between two decode steps), 500 ms for an exposition (larger, rendered per read).
    pub fn default_interval(&self) -> Duration {
        match self {
            EngineLoadSource::Slots => Duration::from_millis(100),
            EngineLoadSource::Metrics { .. } => Duration::from_millis(500),
        }
    }

    /// Largest answer read.
    fn max_bytes(&self) -> usize {
        match self {
            // llama-server's is ~400 bytes per slot.
            EngineLoadSource::Slots => 1 << 20,
            // vLLM's and SGLang's run to hundreds of kilobytes with their histograms.
            EngineLoadSource::Metrics { .. } => 8 << 20,
        }
    }

    fn load(&self, body: &[u8]) -> Result<WorkerLoad, Failure> {
        match self {
            EngineLoadSource::Slots => slots_load(body).map_err(Failure::Failed),
            EngineLoadSource::Metrics { running, waiting } => metrics_load(body, running, waiting),
        }
    }
}

/// How a sidecar reads its engine's own load.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EngineLoadConfig {
    pub source: EngineLoadSource,
    /// The engine path read ([`EngineLoadSource::default_path`]).
    pub path: String,
    /// Time between two reads ([`EngineLoadSource::default_interval`]).
    pub interval: Duration,
}

impl EngineLoadConfig {
    /// `source` at its default path and interval.
    pub fn new(source: EngineLoadSource) -> Self {
        EngineLoadConfig {
            path: source.default_path().into(),
            interval: source.default_interval(),
            source,
        }
    }
}
/// Longest wait for one read.
const READ_TIMEOUT: Duration = Duration::from_secs(2);
/// Longest wait between reads after failures.
const BACKOFF_MAX: Duration = Duration::from_secs(5);
/// Wait before asking an engine that said "unsupported" again.
const UNSUPPORTED_RETRY: Duration = Duration::from_secs(30);
/// Least time between the starts of two reads when relayed requests' ends bring them forward.
const EARLY_READ_GAP: Duration = Duration::from_millis(20);

/// One slot of llama-server's `GET /slots` (the fields read; others ignored).
#[derive(Deserialize)]
struct Slot {
    #[serde(default)]
    is_processing: bool,
    #[serde(default)]
    n_ctx: Option<i64>,
    #[serde(default)]
    next_token: Vec<NextToken>,
}

#[derive(Deserialize)]
struct NextToken {
    #[serde(default)]
    n_remain: Option<i64>,
    #[serde(default)]
    n_decoded: Option<i64>,
}

/// The load llama-server's `GET /slots` answer says its engine has (see the module doc).
pub(crate) fn slots_load(body: &[u8]) -> Result<WorkerLoad, String> {
    let slots: Vec<Slot> =
        serde_json::from_slice(body).map_err(|e| format!("not a slots array: {e}"))?;
    let mut load = WorkerLoad::default();
    for slot in slots.iter().filter(|s| s.is_processing) {
        load.running += 1;
        let next = slot.next_token.first();
        let decoded = next.and_then(|n| n.n_decoded).unwrap_or(0).max(0) as u64;
        let mut remain = match next.and_then(|n| n.n_remain) {
            Some(r) if r >= 0 => r as u64,
            _ => DEFAULT_OUTPUT_TOKENS.saturating_sub(decoded),
        };
        if let Some(n_ctx) = slot.n_ctx.filter(|&n| n > 0) {
            remain = remain.min(n_ctx as u64);
        }
        load.decode_tokens = load.decode_tokens.saturating_add(remain);
    }
    Ok(load)
}

/// The load a Prometheus text exposition says its engine has (see the module doc): the
/// samples of the series named `running` and `waiting`, each summed over its label sets.
fn metrics_load(body: &[u8], running: &str, waiting: &str) -> Result<WorkerLoad, Failure> {
    let text = std::str::from_utf8(body)
        .map_err(|_| Failure::Failed("the exposition is not UTF-8".into()))?;
    let (mut r, mut w) = (None::<u64>, None::<u64>);
    for line in text.lines() {
        let line = line.trim_start();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let name_end = line.find(['{', ' ', '\t']).unwrap_or(line.len());
        let slot = match &line[..name_end] {
            n if n == running => &mut r,
            n if n == waiting => &mut w,
            _ => continue,
        };
        // The value follows the labels, if any (a label value may hold spaces, not `}` here:
        // vLLM's and SGLang's labels are model names and engine indexes).
        let rest = &line[name_end..];
        let rest = match rest.strip_prefix('{') {
            Some(labels) => labels
                .find('}')
                .map(|end| &labels[end + 1..])
                .ok_or_else(|| Failure::Failed(format!("unterminated labels: {line:.120}")))?,
            None => rest,
        };
        let value = rest
            .split_whitespace()
            .next()
            .and_then(|v| v.parse::<f64>().ok())
            .filter(|v| v.is_finite() && *v >= 0.0)
            .ok_or_else(|| Failure::Failed(format!("not a count: {line:.120}")))?;
        // At most 2^53: a count beyond is not an engine's.
        let value = value.min(9_007_199_254_740_992.0).round() as u64;
        *slot = Some(slot.unwrap_or(0).saturating_add(value));
    }
    if r.is_none() && w.is_none() {
        return Err(Failure::Unsupported(format!(
            "no {running} or {waiting} series in the exposition"
        )));
    }
    let (running, waiting) = (r.unwrap_or(0), w.unwrap_or(0));
    Ok(WorkerLoad {
        running,
        waiting,
        prefill_tokens: 0,
        decode_tokens: running
            .saturating_add(waiting)
            .saturating_mul(DEFAULT_OUTPUT_TOKENS),
    })
}

/// The reader's series: `kvgate_sidecar_engine_load_reads_total{outcome}`.
#[derive(Clone, Default)]
pub(crate) struct EngineLoadMetrics {
    reads: Family<Vec<(&'static str, &'static str)>, Counter>,
}

impl EngineLoadMetrics {
    pub(crate) fn register(registry: &mut Registry) -> Self {
        let m = EngineLoadMetrics::default();
        registry
            .sub_registry_with_prefix("kvgate_sidecar")
            .register(
                "engine_load_reads",
                "Reads of the engine's own load (GET /slots or its metrics), by outcome (ok, unsupported, failed)",
                m.reads.clone(),
            );
        m
    }

    fn read(&self, outcome: &'static str) {
        self.reads.get_or_create(&vec![("outcome", outcome)]).inc();
    }
}

enum Failure {
    /// The engine has no such endpoint (or refuses it): read again much later.
    Unsupported(String),
    /// It could not be read this time.
    Failed(String),
}

impl Failure {
    fn outcome(&self) -> &'static str {
        match self {
            Failure::Unsupported(_) => "unsupported",
            Failure::Failed(_) => "failed",
        }
    }

    fn why(&self) -> &str {
        match self {
            Failure::Unsupported(w) | Failure::Failed(w) => w,
        }
    }
}

/// Everything the reader needs.
pub(crate) struct EngineLoadReader {
    pub(crate) cfg: EngineLoadConfig,
    pub(crate) http: reqwest::Client,
    /// `{engine base}{path}`.
    pub(crate) url: String,
    pub(crate) api_key: Option<String>,
    pub(crate) book: Arc<LoadBook>,
    pub(crate) metrics: EngineLoadMetrics,
}

impl EngineLoadReader {
    async fn read(&self) -> Result<WorkerLoad, Failure> {
        let mut req = self.http.get(&self.url).timeout(READ_TIMEOUT);
        if let Some(k) = &self.api_key {
            req = req.bearer_auth(k);
        }
        let resp = req
            .send()
            .await
            .map_err(|e| Failure::Failed(format!("unreachable: {e}")))?;
        let status = resp.status();
        if status.is_client_error() || status == reqwest::StatusCode::NOT_IMPLEMENTED {
            return Err(Failure::Unsupported(format!("answered {status}")));
        }
        if !status.is_success() {
            return Err(Failure::Failed(format!("answered {status}")));
        }
        let body = super::relay::read_bounded(resp, self.cfg.source.max_bytes())
            .await
            .map_err(|e| Failure::Failed(e.message))?;
        self.cfg.source.load(&body)
    }

    /// Reads until `stop`, then forgets the engine's view. While reads succeed, a relayed
    /// request's end brings the next read forward (at most one read per [`EARLY_READ_GAP`]):
    /// the ended request is out of the sidecar's count at once, and would otherwise stay in
    /// the engine's view — with the output it did not generate — until the next read.
    pub(crate) async fn run(self, stop: CancellationToken) {
        let mut backoff = self.cfg.interval;
        // The last failure logged, so a failing engine logs once per change, not per read.
        let mut logged: Option<String> = None;
        loop {
            let started = tokio::time::Instant::now();
            let read = tokio::select! {
                _ = stop.cancelled() => break,
                r = self.read() => r,
            };
            let early = read.is_ok();
            let wait = match read {
                Ok(load) => {
                    self.metrics.read("ok");
                    self.book.set_engine(Some(load));
                    if logged.take().is_some() {
                        tracing::info!(url = %self.url, "the engine's own load is read again");
                    }
                    backoff = self.cfg.interval;
                    self.cfg.interval
                }
                Err(f) => {
                    self.metrics.read(f.outcome());
                    self.book.set_engine(None);
                    if logged.as_deref() != Some(f.why()) {
                        tracing::warn!(
                            url = %self.url,
                            outcome = f.outcome(),
                            why = f.why(),
                            "the engine's own load cannot be read; reporting the forwarded requests' alone"
                        );
                        logged = Some(f.why().to_string());
                    }
                    match f {
                        Failure::Unsupported(_) => UNSUPPORTED_RETRY,
                        Failure::Failed(_) => {
                            backoff = (backoff * 2).clamp(self.cfg.interval, BACKOFF_MAX);
                            backoff
                        }
                    }
                }
            };
            tokio::select! {
                _ = stop.cancelled() => break,
                _ = tokio::time::sleep(wait) => {}
                _ = self.book.ended(), if early => {
                    tokio::select! {
                        _ = stop.cancelled() => break,
                        _ = tokio::time::sleep_until(started + EARLY_READ_GAP) => {}
                    }
                }
            }
        }
        self.book.set_engine(None);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two slots of llama-server 11434's answer (fields as `server_slot::to_json`).
    const SLOTS: &str = r#"[
      {"id":0,"n_ctx":4096,"speculative":false,"is_processing":true,"id_task":7,
       "n_prompt_tokens":120,"n_prompt_tokens_processed":100,"n_prompt_tokens_cache":20,
       "params":{"n_predict":300},
       "next_token":[{"has_next_token":true,"has_new_line":false,"n_remain":290,"n_decoded":10}]},
      {"id":1,"n_ctx":4096,"speculative":false,"is_processing":true,"id_task":8,
       "next_token":[{"has_next_token":true,"has_new_line":false,"n_remain":-1,"n_decoded":6}]},
      {"id":2,"n_ctx":4096,"speculative":false,"is_processing":false,"id_task":3,
       "next_token":[{"has_next_token":false,"has_new_line":false,"n_remain":50,"n_decoded":9}]},
      {"id":3,"n_ctx":4096,"speculative":false,"is_processing":false}
    ]"#;

    #[test]
    fn busy_slots_count_with_their_remaining_output() {
        let l = slots_load(SLOTS.as_bytes()).unwrap();
        assert_eq!(l.running, 2);
        // 290 asked and left; a slot with no limit counts 256 − 6; idle slots nothing.
        assert_eq!(l.decode_tokens, 290 + 250);
        assert_eq!((l.waiting, l.prefill_tokens), (0, 0));
    }

    #[test]
    fn remaining_output_is_bounded_by_the_context() {
        let body = r#"[{"is_processing":true,"n_ctx":512,"next_token":[{"n_remain":2000000000,"n_decoded":0}]},
                       {"is_processing":true,"next_token":[{"n_remain":-1,"n_decoded":9999}]},
                       {"is_processing":true}]"#;
        let l = slots_load(body.as_bytes()).unwrap();
        // 512 (the context), 0 (past the default), 256 (nothing known).
        assert_eq!((l.running, l.decode_tokens), (3, 512 + 256));
    }

    /// The two series as vLLM's V1 engine writes them (one label set per engine core), among
    /// others with names that start the same.
    const VLLM: &str =
        "# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine=\"0\",model_name=\"Qwen/Qwen3-0.6B\"} 3.0
vllm:num_requests_running{engine=\"1\",model_name=\"Qwen/Qwen3-0.6B\"} 2.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine=\"0\",model_name=\"Qwen/Qwen3-0.6B\"} 4.0
vllm:num_requests_waiting_by_reason{reason=\"capacity\"} 100.0
vllm:num_requests_running_total 77
vllm:request_prompt_tokens_bucket{le=\"+Inf\"} 12.0
";

    fn metrics(body: &str) -> Result<WorkerLoad, Failure> {
        EngineLoadSource::vllm().load(body.as_bytes())
    }

    #[test]
    fn an_exposition_gives_running_and_waiting_summed_over_label_sets() {
        let l = metrics(VLLM).ok().unwrap();
        assert_eq!((l.running, l.waiting, l.prefill_tokens), (5, 4, 0));
        assert_eq!(l.decode_tokens, 9 * DEFAULT_OUTPUT_TOKENS);
        // No labels, an exponent, a timestamp; one series alone is enough.
        let l = metrics("vllm:num_requests_running 1e1 1700000000\n")
            .ok()
            .unwrap();
        assert_eq!((l.running, l.waiting), (10, 0));
        let l = EngineLoadSource::sglang()
            .load(b"sglang:num_running_reqs{model_name=\"m\"} 2\nsglang:num_queue_reqs{model_name=\"m\"} 1\n")
            .ok()
            .unwrap();
        assert_eq!((l.running, l.waiting), (2, 1));
    }

    #[test]
    fn an_exposition_without_counts_is_refused() {
        for (body, unsupported) in [
            ("", true),
            ("# only comments\nvllm:num_requests_running_total 3\n", true),
            ("vllm:num_requests_running NaN\n", false),
            ("vllm:num_requests_running -1\n", false),
            ("vllm:num_requests_running +Inf\n", false),
            ("vllm:num_requests_running\n", false),
            ("vllm:num_requests_running{engine=\"0\" 3\n", false),
            ("vllm:num_requests_running{engine=\"0\"} three\n", false),
        ] {
            match metrics(body) {
                Err(Failure::Unsupported(_)) => assert!(unsupported, "{body:?}"),
                Err(Failure::Failed(_)) => assert!(!unsupported, "{body:?}"),
                Ok(l) => panic!("{body:?} read as {l:?}"),
            }
        }
        assert!(matches!(
            EngineLoadSource::vllm().load(&[0xff, 0xfe]),
            Err(Failure::Failed(_))
        ));
        // Counts beyond any engine's are held, not overflowed.
        let l = metrics("vllm:num_requests_running 1e300\nvllm:num_requests_waiting 1e300\n")
            .ok()
            .unwrap();
        assert_eq!(l.running, 1 << 53);
        assert_eq!(
            l.decode_tokens,
            ((1u64 << 54).saturating_mul(DEFAULT_OUTPUT_TOKENS))
        );
    }

    #[test]
    fn what_is_not_a_slots_array_is_refused() {
        for body in [
            "",
            "{}",
            "null",
            r#"{"error":{"code":501,"message":"This server does not support slots endpoint"}}"#,
            r#"[{"is_processing":"yes"}]"#,
            r#"[{"is_processing":true,"next_token":[{"n_remain":1e400}]}]"#,
            "[1,2]",
        ] {
            assert!(slots_load(body.as_bytes()).is_err(), "{body:?}");
        }
        assert_eq!(slots_load(b"[]").unwrap(), WorkerLoad::default());
    }
}
