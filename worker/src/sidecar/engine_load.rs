//! The engine's own view of its load: llama-server's `GET /slots`, read every `interval`
//! (default 100 ms) into the load book ([`super::load`]), so the sidecar's report counts the
//! requests that reached the engine around it too (direct clients, another proxy).
//!
//! Per slot with `is_processing`: `running` + 1 and `decode_tokens` + the output it may still
//! generate — its `next_token[0].n_remain` (llama-server's `n_predict` minus the tokens
//! generated), or, where that is −1 (no limit asked for), the default a gateway assumes for a
//! request that names none ([`prompt_profile::work::DEFAULT_OUTPUT_TOKENS`]) minus
//! `n_decoded`; never more than the slot's `n_ctx`. `/slots` does not say how much of a slot's
//! prompt is still to compute, nor how many requests wait for a slot, so `prefill_tokens` and
//! `waiting` stay the book's.
//!
//! An answer that cannot be read (the engine down, a 5xx, a body that is not the slots array,
//! larger than 1 MiB, or slower than 2 s) drops the engine's view until a read succeeds (the
//! book's count alone is reported), with reads backing off to one per 5 s; a 4xx or 501 (a
//! `llama-server --no-slots`, an engine that is not llama-server) means "unsupported", read
//! again every 30 s. Nothing here is a client's input; nothing panics on what the engine sends.

use std::sync::Arc;
use std::time::Duration;

use prefix_index::WorkerLoad;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;
use serde::Deserialize;
use tokio_util::sync::CancellationToken;

use super::load::LoadBook;

/// How a sidecar reads its engine's own load.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EngineLoadConfig {
    /// The engine path answering llama-server's `GET /slots` array (default `/slots`).
    pub path: String,
    /// Time between two reads (default 100 ms).
    pub interval: Duration,
}

impl Default for EngineLoadConfig {
    fn default() -> Self {
        EngineLoadConfig {
            path: "/slots".into(),
            interval: Duration::from_millis(100),
        }
    }
}

/// Largest `/slots` answer read (llama-server's is ~400 bytes per slot).
const MAX_SLOTS_BYTES: usize = 1 << 20;
/// Longest wait for one read.
const READ_TIMEOUT: Duration = Duration::from_secs(2);
/// Longest wait between reads after failures.
const BACKOFF_MAX: Duration = Duration::from_secs(5);
/// Wait before asking an engine that said "unsupported" again.
const UNSUPPORTED_RETRY: Duration = Duration::from_secs(30);

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
            _ => prompt_profile::work::DEFAULT_OUTPUT_TOKENS.saturating_sub(decoded),
        };
        if let Some(n_ctx) = slot.n_ctx.filter(|&n| n > 0) {
            remain = remain.min(n_ctx as u64);
        }
        load.decode_tokens = load.decode_tokens.saturating_add(remain);
    }
    Ok(load)
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
                "Reads of the engine's own load (GET /slots), by outcome (ok, unsupported, failed)",
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
        let body = super::relay::read_bounded(resp, MAX_SLOTS_BYTES)
            .await
            .map_err(|e| Failure::Failed(e.message))?;
        slots_load(&body).map_err(Failure::Failed)
    }

    /// Reads until `stop`, then forgets the engine's view.
    pub(crate) async fn run(self, stop: CancellationToken) {
        let mut backoff = self.cfg.interval;
        // The last failure logged, so a failing engine logs once per change, not per read.
        let mut logged: Option<String> = None;
        loop {
            let read = tokio::select! {
                _ = stop.cancelled() => break,
                r = self.read() => r,
            };
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
