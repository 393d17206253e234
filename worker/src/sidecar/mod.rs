//! `kvgate sidecar`: the receipt proxy that runs beside a native engine (llama.cpp's
//! `llama-server`, or any OpenAI-compatible server) on its host, so that a fleet of engines
//! kvgate did not build gets the same route tickets, receipts and audit as embedded workers.
//!
//! What it does, per generation request (`POST /v1/chat/completions`, `POST /v1/completions`):
//! admits the request through the same [`TicketGate`] as the embedded worker (same keys folder,
//! replay guard seeded from its receipt log, same 401/400 codes), forwards the body unchanged to
//! the engine (SSE streamed through event by event), reads the engine's own accounting from the
//! answer ([`usage`]: prompt, cached and completion tokens, finish reason, the generated text)
//! and appends a signed, hash-chained receipt to its log — the format of docs/receipts.md, so
//! `kvgate receipts verify` and `audit` work unchanged across a mixed fleet. A stream's final
//! `data: [DONE]` is held back until its receipt is written; with receipts required (default)
//! an answer whose receipt could not be written becomes `503 receipt_failed` (in-band for a
//! stream), as on the worker.
//!
//! Everything else: `GET /health` and `GET /ready` (both: the engine's health path answered
//! 2xx within 2 s, so a gateway probing either sees the engine, not just the sidecar),
//! `GET /v1/models` and llama.cpp's `GET /props` passed through; llama.cpp's `POST /tokenize`,
//! `/detokenize`, `/apply-template` and `GET /slots` passed through behind the gateway's access
//! token (when tickets are required), as the worker guards its own tokenizer; `GET /v1/keys`,
//! `GET /v1/receipts/{id}` (guarded) and `GET /metrics` are the sidecar's own. Any other path
//! is 404: nothing reaches the engine that the sidecar does not receipt or allow.
//!
//! With `--kind vllm --kv-events` ([`vllm`]) it reads vLLM's own KV events, maps them to
//! kvgate block keys and serves them as `GET /v1/kv/events`, and gives ticketed requests their
//! namespace as `cache_salt`; otherwise it publishes no KV events (the gateway approximates a
//! native engine's holdings, docs/gateway.md). It never tokenizes: the receipt's
//! `last_block_key` is absent and its `prompt_tokens` is the engine's count.
//!
//! Whatever the engine, it reports the work of the requests it forwarded ([`load`]) as a
//! kvgate worker reports its queue: `GET /v1/load` (and `event: load` in its KV event stream),
//! so that each gateway sees the work every other gateway sent this engine; with
//! `engine_load` ([`engine_load`]) it also reads llama-server's own `GET /slots`, so requests
//! that reached the engine around the sidecar count too.

pub mod engine_load;
mod load;
pub mod relay;
pub mod usage;
pub mod vllm;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::{Path, Request, State};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use prefix_index::NamespaceSeed;
use prometheus_client::registry::Registry;
use receipts::{FsyncPolicy, KeyPair, KeyRing, ReceiptLog};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::api_error::ApiError;
use crate::protocol::ReadyBody;
use crate::tickets::{TicketGate, TicketPolicy};
use crate::WorkerError;

/// Everything a sidecar is built from.
#[derive(Clone, Debug)]
pub struct SidecarConfig {
    /// The engine's base URL (`http://host:port`, an optional path prefix kept).
    pub engine_url: String,
    /// The engine path `GET /ready` probes (llama-server and vLLM: `/health`).
    pub health_path: String,
    /// Bearer key the engine wants (`llama-server --api-key`); the client's own
    /// `Authorization` is never forwarded.
    pub engine_api_key: Option<String>,
    /// The sidecar's id: route tickets must name it (the gateway's worker id for this host).
    pub worker_id: String,
    pub ticket_policy: TicketPolicy,
    pub ticket_skew_ms: u64,
    /// Receipt-signing key.
    pub key: KeyPair,
    /// Gateway public keys trusted for tickets and access tokens.
    pub gateway_keys: KeyRing,
    pub receipt_log: PathBuf,
    pub fsync: FsyncPolicy,
    pub rotation: receipts::Rotation,
    /// Receipts' `profile_digest` (the prompt-profile identity digest of the model the engine
    /// serves, when the operator gives its GGUF; empty otherwise).
    pub profile_digest: String,
    /// Larger request bodies get 413 (default 8 MiB).
    pub max_body_bytes: usize,
    /// Largest whole (non-streamed) engine answer relayed (default 64 MiB; larger: 502).
    pub max_answer_bytes: usize,
    /// Largest single SSE event from the engine (default 4 MiB; larger ends the stream).
    pub max_event_bytes: usize,
    /// No answer without a receipt (default true), as `ServerSettings::require_receipts`.
    pub require_receipts: bool,
    pub connect_timeout: Duration,
    /// Longest wait for the engine's next bytes.
    pub read_timeout: Duration,
    /// `Retry-After` seconds on 503.
    pub retry_after_s: u64,
    /// Serve HTTPS with this material; `None`: plain HTTP.
    pub tls: Option<tls::ServerTls>,
    /// Cluster mode: announce this sidecar in the gateways' Redis under a lease and trust the
    /// gateway keys listed there, exactly as a registered worker ([`crate::registration`]);
    /// `None`: static worker lists only.
    pub registration: Option<crate::registration::Registration>,
    /// vLLM's KV events ([`vllm`]): read, mapped to kvgate block keys and served as
    /// `GET /v1/kv/events`; requests with a route ticket get their namespace as `cache_salt`.
    /// `None`: no event stream (404; the gateway approximates the engine's holdings).
    pub engine_events: Option<vllm::EngineEventsConfig>,
    /// Serve the load report ([`load`]: `GET /v1/load`, and load messages on the KV event
    /// stream); `false`: `GET /v1/load` is 404 and the event stream carries none (default true).
    pub load_report: bool,
    /// Read the engine's own load (llama-server's `GET /slots`, [`engine_load`]) into the
    /// report; `None` (default): the forwarded requests' count alone. Unused without
    /// `load_report`.
    pub engine_load: Option<engine_load::EngineLoadConfig>,
}

impl SidecarConfig {
    /// The documented defaults for a sidecar `worker_id` in front of `engine_url`.
    pub fn new(
        engine_url: impl Into<String>,
        worker_id: impl Into<String>,
        key: KeyPair,
        receipt_log: impl Into<PathBuf>,
    ) -> Self {
        SidecarConfig {
            engine_url: engine_url.into(),
            health_path: "/health".into(),
            engine_api_key: None,
            worker_id: worker_id.into(),
            ticket_policy: TicketPolicy::Optional,
            ticket_skew_ms: receipts::DEFAULT_MAX_CLOCK_SKEW_MS,
            key,
            gateway_keys: KeyRing::new(),
            receipt_log: receipt_log.into(),
            fsync: FsyncPolicy::default(),
            rotation: receipts::Rotation::default(),
            profile_digest: String::new(),
            max_body_bytes: 8 << 20,
            max_answer_bytes: 64 << 20,
            max_event_bytes: 4 << 20,
            require_receipts: true,
            connect_timeout: Duration::from_secs(2),
            read_timeout: Duration::from_secs(300),
            retry_after_s: 1,
            tls: None,
            registration: None,
            engine_events: None,
            load_report: true,
            engine_load: None,
        }
    }
}

/// The engine's base URL, checked: `http`/`https`, a host, no query; no trailing `/`.
fn engine_base(url: &str) -> Result<String, WorkerError> {
    let bad = |why: &str| WorkerError::Startup {
        what: "engine url",
        detail: format!("{url}: {why}"),
    };
    let rest = url
        .strip_prefix("http://")
        .or_else(|| url.strip_prefix("https://"))
        .ok_or_else(|| bad("must start with http:// or https://"))?;
    if rest.is_empty() || rest.starts_with('/') {
        return Err(bad("no host"));
    }
    if rest.contains(['?', '#', '@', ' ']) {
        return Err(bad("no query, fragment, user info or spaces"));
    }
    Ok(url.trim_end_matches('/').to_string())
}

/// Shared state of a running sidecar.
pub(crate) struct SidecarState {
    pub(crate) cfg: SidecarConfig,
    pub(crate) engine: String,
    pub(crate) tickets: TicketGate,
    pub(crate) receipts: Arc<ReceiptLog>,
    pub(crate) http: reqwest::Client,
    pub(crate) metrics: relay::SidecarMetrics,
    registry: Registry,
    pub(crate) shutdown: CancellationToken,
    /// Inference requests in flight and the draining flag ([`RunningSidecar::drain`]).
    pub(crate) drain: crate::drain::Drain,
    /// The engine's cache in kvgate keys (with `engine_events`), and the subscription slots
    /// of `GET /v1/kv/events`.
    pub(crate) feed: Option<engine::kv::events::KvEventFeed>,
    subscriptions: Arc<tokio::sync::Semaphore>,
    /// The work of the requests forwarded to the engine and not ended ([`load`]).
    pub(crate) load: Arc<load::LoadBook>,
}

/// A started sidecar.
pub struct RunningSidecar {
    addr: SocketAddr,
    state: Arc<SidecarState>,
    server: JoinHandle<std::io::Result<()>>,
    registration: Option<crate::registration::RegistrationTask>,
    /// The engine-event subscriber ([`vllm::run`]) and the engine-load reader
    /// ([`engine_load`]), both stopped by `tasks_stop`.
    events: Option<JoinHandle<()>>,
    engine_load: Option<JoinHandle<()>>,
    tasks_stop: CancellationToken,
}

/// Most `GET /v1/kv/events` streams open at once on a sidecar (as on a worker).
pub const MAX_EVENT_SUBSCRIPTIONS: usize = 16;

impl RunningSidecar {
    /// The bound address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The receipt log.
    pub fn receipt_log(&self) -> &Arc<ReceiptLog> {
        &self.state.receipts
    }

    /// Inference requests being relayed now.
    pub fn in_flight(&self) -> usize {
        self.state.drain.in_flight()
    }

    /// Drains before a stop, as [`crate::RunningWorker::drain`] does: withdraws the
    /// registration (cluster mode), `/ready` answers 503 `draining`, requests in flight (and
    /// any still sent) are relayed until none is in flight after `grace`, or `timeout`.
    pub async fn drain(&mut self, grace: Duration, timeout: Duration) -> crate::DrainReport {
        if let Some(task) = self.registration.take() {
            crate::registration::stop(task).await;
        }
        self.state.drain.run(grace, timeout).await
    }

    /// Graceful stop: withdraw the registration (cluster mode), stop accepting, end streams
    /// (their receipts are written), flush the log. [`RunningSidecar::drain`] first lets
    /// streams finish.
    pub async fn shutdown(self) {
        if let Some(task) = self.registration {
            crate::registration::stop(task).await;
        }
        self.tasks_stop.cancel();
        for (task, what) in [
            (self.events, "engine-event subscriber"),
            (self.engine_load, "engine-load reader"),
        ] {
            let Some(task) = task else { continue };
            if tokio::time::timeout(Duration::from_secs(5), task)
                .await
                .is_err()
            {
                tracing::warn!("{what} did not stop within 5 s");
            }
        }
        self.state.shutdown.cancel();
        match tokio::time::timeout(Duration::from_secs(10), self.server).await {
            Ok(Ok(Ok(()))) => {}
            Ok(Ok(Err(e))) => tracing::warn!(error = %e, "sidecar server ended with an error"),
            Ok(Err(e)) => tracing::warn!(error = %e, "sidecar server task failed"),
            Err(_) => tracing::warn!("sidecar server did not stop within 10 s"),
        }
        let log = self.state.receipts.clone();
        let _ = tokio::task::spawn_blocking(move || {
            if let Err(e) = log.sync() {
                tracing::warn!(error = %e, "receipt log sync failed at shutdown");
            }
        })
        .await;
    }
}

fn startup(what: &'static str, detail: impl std::fmt::Display) -> WorkerError {
    WorkerError::Startup {
        what,
        detail: detail.to_string(),
    }
}

/// Starts a sidecar on `listener`: opens the receipt log (seeding the replay guard from it) and
/// serves. It does not wait for the engine: `GET /ready` says whether the engine answers.
pub async fn spawn(
    cfg: SidecarConfig,
    listener: TcpListener,
) -> Result<RunningSidecar, WorkerError> {
    let addr = listener.local_addr().map_err(|e| startup("listener", e))?;
    let engine = engine_base(&cfg.engine_url)?;
    if !cfg.health_path.starts_with('/') {
        return Err(startup(
            "health path",
            format!("{:?} must start with /", cfg.health_path),
        ));
    }
    if let Some(el) = &cfg.engine_load {
        if !el.path.starts_with('/') || el.interval.is_zero() {
            return Err(startup(
                "engine load",
                format!(
                    "path {:?} must start with / and the interval be above 0",
                    el.path
                ),
            ));
        }
    }
    let tls = cfg
        .tls
        .as_ref()
        .map(|t| t.server_config())
        .transpose()
        .map_err(|e| startup("tls", e))?;
    let receipts = {
        let (path, key, id, fsync, rotation) = (
            cfg.receipt_log.clone(),
            cfg.key.clone(),
            cfg.worker_id.clone(),
            cfg.fsync,
            cfg.rotation,
        );
        tokio::task::spawn_blocking(move || {
            ReceiptLog::open_with(&path, fsync, &key, &id, rotation)
        })
        .await
        .map_err(|e| startup("receipt log", e))?
        .map(Arc::new)
        .map_err(|e| startup("receipt log", format!("{}: {e}", cfg.receipt_log.display())))?
    };
    if let Some(t) = &receipts.open_report().torn_tail {
        tracing::warn!("receipt log: {}", receipts::receipt_log::describe_torn(t));
    }
    let tickets = TicketGate::seeded(
        cfg.worker_id.clone(),
        cfg.ticket_policy,
        cfg.ticket_skew_ms,
        None,
        cfg.gateway_keys.clone(),
        // Direct requests: the engine keeps its own cache; no kvgate namespace applies.
        NamespaceSeed([0; 32]),
        &receipts,
    );
    let http = reqwest::Client::builder()
        .connect_timeout(cfg.connect_timeout)
        .read_timeout(cfg.read_timeout)
        .tcp_nodelay(true)
        .pool_idle_timeout(Duration::from_secs(60))
        .build()
        .map_err(|e| startup("http client", e))?;
    let mut registry = Registry::default();
    let drain = crate::drain::Drain::default();
    let load = load::LoadBook::new();
    let metrics = relay::SidecarMetrics::register(&mut registry, drain.clone(), load.clone());
    let tasks_stop = CancellationToken::new();
    let (feed, events) = match cfg.engine_events.clone() {
        None => (None, None),
        Some(ev) => {
            let feed = engine::kv::events::KvEventFeed::new();
            let m = vllm::EngineEventMetrics::register(&mut registry);
            let task = tokio::spawn(vllm::run(ev, feed.clone(), m, tasks_stop.clone()));
            (Some(feed), Some(task))
        }
    };
    let engine_load = match (&cfg.engine_load, cfg.load_report) {
        (Some(el), true) => {
            let reader = engine_load::EngineLoadReader {
                cfg: el.clone(),
                http: http.clone(),
                url: format!("{engine}{}", el.path),
                api_key: cfg.engine_api_key.clone(),
                book: load.clone(),
                metrics: engine_load::EngineLoadMetrics::register(&mut registry),
            };
            Some(tokio::spawn(reader.run(tasks_stop.clone())))
        }
        _ => None,
    };
    let state = Arc::new(SidecarState {
        cfg,
        engine,
        tickets,
        receipts,
        http,
        metrics,
        registry,
        shutdown: CancellationToken::new(),
        drain,
        feed,
        subscriptions: Arc::new(tokio::sync::Semaphore::new(MAX_EVENT_SUBSCRIPTIONS)),
        load,
    });
    let app = router(state.clone());
    let server = tokio::spawn(crate::listener::serve(
        listener,
        tls,
        app,
        state.shutdown.clone(),
    ));
    let registration = state.cfg.registration.clone().map(|reg| {
        crate::registration::start(
            reg,
            &state.cfg.worker_id,
            &state.cfg.key,
            &state.cfg.profile_digest,
            state.clone(),
        )
    });
    Ok(RunningSidecar {
        addr,
        state,
        server,
        registration,
        events,
        engine_load,
        tasks_stop,
    })
}

fn router(st: Arc<SidecarState>) -> Router {
    let guarded = Router::new()
        .route("/tokenize", post(passthrough))
        .route("/detokenize", post(passthrough))
        .route("/apply-template", post(passthrough))
        .route("/slots", get(passthrough))
        .route("/v1/receipts/{request_id}", get(receipt))
        .route("/v1/kv/events", get(kv_events))
        .route("/v1/kv/config", get(kv_config))
        .route("/v1/load", get(load_stream))
        .route_layer(axum::middleware::from_fn_with_state(
            st.clone(),
            require_access,
        ));
    let inference = Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route_layer(axum::middleware::from_fn_with_state(
            st.drain.clone(),
            crate::drain::count_in_flight,
        ));
    Router::new()
        .merge(inference)
        .route("/v1/models", get(passthrough))
        .route("/props", get(passthrough))
        .merge(guarded)
        .route("/v1/keys", get(keys))
        .route("/health", get(ready))
        .route("/ready", get(ready))
        .route("/metrics", get(metrics))
        .fallback(|| async { ApiError::not_found("not_found", "no such endpoint").into_response() })
        .method_not_allowed_fallback(|| async {
            ApiError::new(
                StatusCode::METHOD_NOT_ALLOWED,
                "method_not_allowed",
                "method not allowed on this endpoint",
            )
            .into_response()
        })
        .layer(axum::middleware::from_fn_with_state(
            HeaderValue::from_str(&st.cfg.worker_id).ok(),
            crate::worker_id_header,
        ))
        .with_state(st)
}

async fn require_access(
    State(st): State<Arc<SidecarState>>,
    req: Request,
    next: axum::middleware::Next,
) -> Response {
    match st.tickets.check_access(req.headers()) {
        Ok(()) => next.run(req).await,
        Err(e) => e.into_response(),
    }
}

async fn chat(State(st): State<Arc<SidecarState>>, headers: HeaderMap, body: Body) -> Response {
    relay::generate(st, "/v1/chat/completions", headers, body).await
}

async fn completions(
    State(st): State<Arc<SidecarState>>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    relay::generate(st, "/v1/completions", headers, body).await
}

/// `GET /v1/kv/events`: the engine's cache in kvgate keys (docs/kv-events.md), with the
/// sidecar's load messages ([`load`]) when asked. 404 `not_found` without `engine_events`.
async fn kv_events(
    State(st): State<Arc<SidecarState>>,
    query: Result<
        axum::extract::Query<crate::kv_events::EventsQuery>,
        axum::extract::rejection::QueryRejection,
    >,
    headers: HeaderMap,
) -> Response {
    let Some(feed) = &st.feed else {
        st.metrics.request("kv_events", 404);
        return ApiError::not_found(
            "not_found",
            "this sidecar reads no engine KV events (start it with --kv-events)",
        )
        .into_response();
    };
    match crate::kv_events::admit(
        query,
        &headers,
        &st.subscriptions,
        MAX_EVENT_SUBSCRIPTIONS,
        st.cfg.retry_after_s,
    ) {
        Ok(admitted) => {
            st.metrics.request("kv_events", 200);
            let load = (admitted.load && st.cfg.load_report).then(|| st.load.watch());
            crate::kv_events::stream_response(admitted, Some(feed), load, st.shutdown.clone())
        }
        Err(e) => {
            st.metrics.request("kv_events", e.status.as_u16());
            e.into_response()
        }
    }
}

/// `GET /v1/load`: the sidecar's load messages alone ([`load`]; docs/kv-events.md), whatever
/// the engine: how a gateway learns the work other gateways sent this engine.
async fn load_stream(State(st): State<Arc<SidecarState>>) -> Response {
    if !st.cfg.load_report {
        st.metrics.request("load", 404);
        return ApiError::not_found(
            "not_found",
            "this sidecar reports no load (started with --no-load-report)",
        )
        .into_response();
    }
    let (response, status) = crate::kv_events::load_response(
        &st.subscriptions,
        MAX_EVENT_SUBSCRIPTIONS,
        st.cfg.retry_after_s,
        st.load.watch(),
        st.shutdown.clone(),
    );
    st.metrics.request("load", status);
    response
}

/// `GET /v1/kv/config`: how the engine's KV events are mapped (`{"source": "vllm",
/// "block_size": B}`), for the gateway's contract check. 404 `not_found` without
/// `engine_events`.
async fn kv_config(State(st): State<Arc<SidecarState>>) -> Response {
    match &st.cfg.engine_events {
        Some(ev) => Json(serde_json::json!({
            "source": "vllm",
            "block_size": ev.block_size.as_u32(),
        }))
        .into_response(),
        None => ApiError::not_found("not_found", "this sidecar reads no engine KV events")
            .into_response(),
    }
}

async fn keys(State(st): State<Arc<SidecarState>>) -> Response {
    crate::ops::keys_body(&st.cfg.key, &st.cfg.worker_id)
}

async fn receipt(State(st): State<Arc<SidecarState>>, Path(id): Path<String>) -> Response {
    crate::ops::receipt_line(st.receipts.clone(), id).await
}

async fn metrics(State(st): State<Arc<SidecarState>>, headers: HeaderMap) -> Response {
    crate::ops::render_metrics(&st.registry, &headers)
}

/// `GET /ready` and `GET /health`: 200 while the engine's health path answers 2xx within 2 s;
/// 503 `draining` once a drain began.
async fn ready(State(st): State<Arc<SidecarState>>) -> Response {
    if let Some(refusal) = crate::drain::ready_refusal(&st.drain) {
        return refusal;
    }
    let url = format!("{}{}", st.engine, st.cfg.health_path);
    let mut req = st.http.get(&url).timeout(Duration::from_secs(2));
    if let Some(k) = &st.cfg.engine_api_key {
        req = req.bearer_auth(k);
    }
    let reason = match req.send().await {
        Ok(r) if r.status().is_success() => None,
        Ok(r) => Some(format!(
            "the engine's {} answered {}",
            st.cfg.health_path,
            r.status()
        )),
        Err(e) => Some(format!("the engine is unreachable: {e}")),
    };
    let status = if reason.is_none() {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (
        status,
        Json(ReadyBody {
            ready: reason.is_none(),
            reason,
        }),
    )
        .into_response()
}

/// Largest request body of a pass-through endpoint, and largest answer relayed from one.
const PASSTHROUGH_MAX_BYTES: usize = 1 << 20;
const PASSTHROUGH_MAX_ANSWER_BYTES: usize = 16 << 20;

/// Relays a read-only engine endpoint: same method, path and query, the body (≤ 1 MiB) and
/// content type; the answer's status, content type and body (≤ 16 MiB) back.
async fn passthrough(State(st): State<Arc<SidecarState>>, req: Request) -> Response {
    let (parts, body) = req.into_parts();
    let path_q = parts
        .uri
        .path_and_query()
        .map_or(parts.uri.path(), |p| p.as_str())
        .to_string();
    let bytes = match crate::generate::read_body(body, &parts.headers, PASSTHROUGH_MAX_BYTES).await
    {
        Ok(b) => b,
        Err(e) => return e.into_response(),
    };
    let method = if parts.method == Method::POST {
        reqwest::Method::POST
    } else {
        reqwest::Method::GET
    };
    let mut out = st
        .http
        .request(method, format!("{}{path_q}", st.engine))
        .timeout(Duration::from_secs(30));
    if let Some(ct) = parts.headers.get(axum::http::header::CONTENT_TYPE) {
        out = out.header(reqwest::header::CONTENT_TYPE, ct.as_bytes());
    }
    if let Some(k) = &st.cfg.engine_api_key {
        out = out.bearer_auth(k);
    }
    if !bytes.is_empty() {
        out = out.body(bytes);
    }
    let resp = match out.send().await {
        Ok(r) => r,
        Err(e) => return relay::engine_unavailable(&st, &e).into_response(),
    };
    let status = StatusCode::from_u16(resp.status().as_u16()).unwrap_or(StatusCode::BAD_GATEWAY);
    let ct = resp.headers().get(reqwest::header::CONTENT_TYPE).cloned();
    match relay::read_bounded(resp, PASSTHROUGH_MAX_ANSWER_BYTES).await {
        Ok(b) => {
            let mut r = (status, b).into_response();
            if let Some(ct) = ct.and_then(|v| HeaderValue::from_bytes(v.as_bytes()).ok()) {
                r.headers_mut().insert(axum::http::header::CONTENT_TYPE, ct);
            }
            r
        }
        Err(e) => e.into_response(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn engine_urls() {
        assert_eq!(
            engine_base("http://127.0.0.1:8080/").unwrap(),
            "http://127.0.0.1:8080"
        );
        assert_eq!(engine_base("https://h/p").unwrap(), "https://h/p");
        for bad in [
            "127.0.0.1:8080",
            "http://",
            "http:///x",
            "http://h?q=1",
            "http://u@h",
        ] {
            assert!(engine_base(bad).is_err(), "{bad}");
        }
    }
}
