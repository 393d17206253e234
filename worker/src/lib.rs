//! The worker's HTTP server: an OpenAI-compatible API over the embedded [`Engine`], route-ticket
//! verification, signed receipts, the KV event stream, readiness and metrics.
//!
//! Owns: the wire protocol ([`protocol`]), request validation ([`validate`]), error answers
//! ([`api_error`]), tickets and request ids ([`tickets`]), the generation endpoints
//! ([`generate`]), the KV event SSE endpoint ([`kv_events`]), the operations endpoints
//! ([`ops`]) and the metrics registry ([`metrics`]). Does not own: scheduling, KV blocks or
//! sampling (the engine), tokenization and templates (`prompt-profile`), signatures and the log
//! format (`receipts`). The HTTP contract is documented in `docs/worker-api.md` and
//! `docs/kv-events.md`.
//!
//! [`spawn`] starts a worker on a bound listener and returns a [`RunningWorker`]; tests and the
//! fleet simulator start many in one process this way (with [`EngineChoice::Sim`] they need no
//! model weights, but still render and tokenize with the GGUF's prompt profile).

pub mod api_error;
pub mod drain;
pub mod error;
pub mod generate;
pub mod kv_events;
pub mod listener;
pub mod metrics;
pub mod ops;
pub mod output_parser;
pub mod protocol;
pub mod registration;
pub mod responses;
pub mod sidecar;
pub mod tickets;
pub mod validate;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::extract::Request;
use axum::http::{HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use parking_lot::Mutex;
use prefix_index::{BlockSize, HashAlgorithm};
use prometheus_client::registry::Registry;
use prompt_profile::{ChatMessage, KeySpace, ProfileIdentity, PromptProfile};
use receipts::{FsyncPolicy, KeyPair, KeyRing, ReceiptLog};
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use engine::executor::{Executor, KvGeometry};
use engine::sampler::SamplingParams;
use engine::sim::{SimConfig, SimExecutor};
use engine::{Engine, EngineConfig, GenerateRequest, SeqEvent};

pub use api_error::ApiError;
pub use drain::DrainReport;
pub use error::WorkerError;
pub use tickets::{TicketPolicy, NO_CACHE_HEADER, RECEIPT_HEADER, REQUEST_ID_HEADER};

/// What computes tokens.
#[derive(Clone, Debug)]
pub enum EngineChoice {
    /// The candle Llama model loaded from the worker's GGUF file.
    Model {
        /// Bytes of KV cache to preallocate.
        kv_budget_bytes: usize,
        /// candle compute threads (0 = candle's default). Process-wide; effective only for
        /// the first model loaded in the process.
        threads: usize,
        /// Use CUDA device 0 (needs the `cuda` feature).
        cuda: bool,
    },
    /// The simulated executor (timing model, deterministic tokens).
    Sim(SimConfig),
}

impl EngineChoice {
    /// `model` or `sim`.
    pub fn kind(&self) -> &'static str {
        match self {
            EngineChoice::Model { .. } => "model",
            EngineChoice::Sim(_) => "sim",
        }
    }
}

/// The device executor's settings (`engine::model::DeviceExecutor`: used on CUDA, and on the
/// CPU with a `WeightFormat::Device` format).
#[derive(Clone, Copy, Debug, Default)]
pub struct DeviceSettings {
    /// Attention kernels; `None`: fused on CUDA, composed on the CPU.
    pub attention: Option<engine::model::AttentionKind>,
    /// On CUDA, the KV cache takes this share of the device memory free after the weights
    /// loaded (instead of `kv_budget_bytes`); `None` keeps `kv_budget_bytes`.
    pub kv_memory_fraction: Option<f64>,
}

/// Default preallocated KV budget of a model worker: 256 MiB (≈ 5,700 SmolLM2 tokens in f32).
pub const DEFAULT_KV_BUDGET_BYTES: usize = 256 << 20;

/// The server's knobs (everything but the objects a worker is built from).
#[derive(Clone, Debug)]
pub struct ServerSettings {
    /// The worker's id: must equal the `worker` of the route tickets it accepts, and signs
    /// its receipts.
    pub worker_id: String,
    pub ticket_policy: TicketPolicy,
    /// Clock skew tolerated on both ends of a ticket's validity window.
    pub ticket_skew_ms: u64,
    /// Larger bodies get 413. Default 8 MiB.
    pub max_body_bytes: usize,
    /// Output budget of a request without `max_tokens`: the remaining context, capped here.
    /// Default 1024.
    pub default_max_tokens: usize,
    /// Tokens kept free beyond prompt + output (part of the token budget). Default 0.
    pub native_reserve: usize,
    /// Tokens per KV block (must equal the executor's). Default 16.
    pub block_size: BlockSize,
    pub hash_algorithm: HashAlgorithm,
    /// Accepted `model` values; empty = any (the default).
    pub served_model_names: Vec<String>,
    /// `Retry-After` seconds on 429 / 503. Default 1.
    pub retry_after_s: u64,
    /// Lower the profile's context limit (`None` = the profile's).
    pub context_limit: Option<usize>,
    /// No answer without a receipt (default true): when the receipt log cannot take a request's
    /// receipt, the answer is replaced by `503 receipt_failed` (in-band for a stream) and no
    /// `x-kvgate-receipt` header names it. False: the answer is delivered unreceipted (logged,
    /// counted in `kvgate_worker_receipts_failed_total`), still without the header.
    pub require_receipts: bool,
    /// Concurrent `GET /v1/kv/events` subscriptions; more get 429 `too_many_subscriptions`.
    /// Default 16 (a gateway holds one per worker; a fleet of gateways, one each).
    pub max_event_subscriptions: usize,
    /// How the model writes tool calls: answers to chat requests with `tools` are parsed into
    /// `tool_calls` (`None`: not parsed, the default here; the CLI detects it from the template).
    pub tool_call_parser: Option<output_parser::ToolCallFormat>,
    /// How the model writes reasoning: chat answers get `reasoning_content` (`None`: not
    /// separated, the default here; the CLI detects it from the template).
    pub reasoning_parser: Option<output_parser::ReasoningFormat>,
    /// Bytes of compiled schemas (`response_format` `json_schema`, forced tool calls) kept
    /// between requests, least recently used out first (`engine::schema_cache`); 0 compiles
    /// every request's. Default 32 MiB.
    pub schema_cache_bytes: usize,
}

impl ServerSettings {
    /// Documented defaults for a worker named `worker_id`.
    pub fn new(worker_id: impl Into<String>) -> Self {
        ServerSettings {
            worker_id: worker_id.into(),
            ticket_policy: TicketPolicy::Optional,
            ticket_skew_ms: receipts::DEFAULT_MAX_CLOCK_SKEW_MS,
            max_body_bytes: 8 << 20,
            default_max_tokens: 1024,
            native_reserve: 0,
            block_size: BlockSize::default(),
            hash_algorithm: HashAlgorithm::default(),
            served_model_names: Vec::new(),
            retry_after_s: 1,
            context_limit: None,
            require_receipts: true,
            max_event_subscriptions: 16,
            tool_call_parser: None,
            reasoning_parser: None,
            schema_cache_bytes: 32 << 20,
        }
    }
}

/// Everything a worker is built from.
pub struct WorkerConfig {
    /// The GGUF file: its prompt profile always, its weights with [`EngineChoice::Model`].
    pub model_path: PathBuf,
    /// An already loaded profile of `model_path` (saves the load when starting many workers).
    pub profile: Option<PromptProfile>,
    pub engine: EngineChoice,
    /// The model engine's arithmetic (`None`: `engine::model::default_format` for the device —
    /// `Exact` on CPU); `Some(WeightFormat::LlamaCpp)` gives llama.cpp's greedy tokens.
    pub weight_format: Option<engine::model::WeightFormat>,
    /// Where the model runs on a GPU (or with `WeightFormat::Device` on the CPU): the device
    /// executor's attention and KV budget.
    pub device: DeviceSettings,
    /// The engine's scheduler knobs; its `hash_algorithm` is overridden by the settings'.
    pub engine_config: EngineConfig,
    /// The worker's receipt-signing key.
    pub key: KeyPair,
    /// Gateway public keys trusted for route tickets.
    pub gateway_keys: KeyRing,
    pub receipt_log: PathBuf,
    pub fsync: FsyncPolicy,
    /// When the receipt log's current file is rotated (default: at 256 MiB).
    pub rotation: receipts::Rotation,
    pub settings: ServerSettings,
    /// Serve HTTPS with this material (and require client certificates when it names a client
    /// CA); `None`: plain HTTP.
    pub tls: Option<tls::ServerTls>,
    /// Cluster mode: announce this worker in the shared store and trust the gateway replicas'
    /// keys listed there ([`registration`]); `None`: static worker lists only.
    pub registration: Option<registration::Registration>,
}

impl WorkerConfig {
    /// A config with the documented defaults.
    pub fn new(
        model_path: impl Into<PathBuf>,
        engine: EngineChoice,
        key: KeyPair,
        receipt_log: impl Into<PathBuf>,
        worker_id: impl Into<String>,
    ) -> Self {
        WorkerConfig {
            model_path: model_path.into(),
            profile: None,
            engine,
            weight_format: None,
            device: DeviceSettings::default(),
            engine_config: EngineConfig::default(),
            key,
            gateway_keys: KeyRing::new(),
            receipt_log: receipt_log.into(),
            fsync: FsyncPolicy::default(),
            rotation: receipts::Rotation::default(),
            settings: ServerSettings::new(worker_id),
            tls: None,
            registration: None,
        }
    }
}

/// Shared state of one running worker.
pub struct AppState {
    pub(crate) settings: ServerSettings,
    pub(crate) engine: Engine,
    pub(crate) engine_kind: &'static str,
    /// The model engine's arithmetic (`WeightFormat::name`); `None` for the simulated engine.
    pub(crate) numerics: Option<&'static str>,
    pub(crate) profile: PromptProfile,
    pub(crate) identity: ProfileIdentity,
    pub(crate) profile_digest: String,
    pub(crate) fingerprint: String,
    pub(crate) context_limit: usize,
    pub(crate) block_size: BlockSize,
    /// The block-key space of this worker's profile (the prompt contract's namespace rule).
    pub(crate) key_space: KeySpace,
    pub(crate) key: KeyPair,
    /// Request ids, route tickets, the replay guard and access tokens.
    pub(crate) tickets: tickets::TicketGate,
    pub(crate) receipts: Arc<ReceiptLog>,
    pub(crate) metrics: metrics::ServerMetrics,
    pub(crate) registry: Registry,
    pub(crate) ready: Arc<AtomicBool>,
    pub(crate) ready_reason: Mutex<String>,
    pub(crate) shutdown: CancellationToken,
    pub(crate) started_at_ms: u64,
    /// Permits of concurrent KV-event subscriptions.
    pub(crate) subscriptions: Arc<tokio::sync::Semaphore>,
    /// Inference requests in flight (`/v1/chat/completions`, `/v1/completions`) and whether
    /// the worker drains ([`RunningWorker::drain`]: `/ready` answers 503).
    pub(crate) drain: drain::Drain,
    /// Each token's bytes, for JSON mode (built at the first request that asks for it).
    pub(crate) token_table: std::sync::OnceLock<Arc<engine::TokenTable>>,
    /// Compiled `json_schema`s and forced tool calls' schemas, kept between requests.
    pub(crate) schemas: Arc<engine::schema_cache::SchemaCache>,
}

impl AppState {
    /// The vocabulary's token bytes (`engine::constraint`), built once.
    pub(crate) fn token_table(&self) -> Arc<engine::TokenTable> {
        self.token_table
            .get_or_init(|| Arc::new(engine::TokenTable::new(self.profile.token_bytes())))
            .clone()
    }
}

fn startup(what: &'static str, detail: impl std::fmt::Display) -> WorkerError {
    WorkerError::Startup {
        what,
        detail: detail.to_string(),
    }
}

/// A started worker.
pub struct RunningWorker {
    addr: SocketAddr,
    state: Arc<AppState>,
    server: JoinHandle<std::io::Result<()>>,
    smoke: JoinHandle<()>,
    ready_rx: watch::Receiver<Option<Result<(), String>>>,
    /// The registration loop, in cluster mode.
    registration: Option<registration::RegistrationTask>,
}

impl RunningWorker {
    /// The bound address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The receipt log (tests inject faults through it).
    pub fn receipt_log(&self) -> &Arc<ReceiptLog> {
        &self.state.receipts
    }

    /// The engine (stats, block counts).
    pub fn engine(&self) -> &Engine {
        &self.state.engine
    }

    /// The worker's `/v1/profile` body.
    pub fn profile(&self) -> protocol::ProfileBody {
        ops::profile_body(&self.state)
    }

    /// Whether the smoke inference has produced a token.
    pub fn is_ready(&self) -> bool {
        self.state.ready.load(Ordering::Acquire)
    }

    /// Waits for the smoke inference; `Err` if it failed or `timeout` passed.
    pub async fn wait_ready(&self, timeout: Duration) -> Result<(), WorkerError> {
        let mut rx = self.ready_rx.clone();
        let res = tokio::time::timeout(timeout, rx.wait_for(Option::is_some)).await;
        match res {
            Err(_) => Err(startup("smoke inference", "timed out")),
            Ok(Err(_)) => Err(startup("smoke inference", "worker stopped")),
            Ok(Ok(v)) => match v.clone() {
                Some(Ok(())) => Ok(()),
                Some(Err(e)) => Err(startup("smoke inference", e)),
                None => Err(startup("smoke inference", "no result")),
            },
        }
    }

    /// Inference requests being answered now.
    pub fn in_flight(&self) -> usize {
        self.state.drain.in_flight()
    }

    /// Drains the worker before a stop: withdraws its registration (cluster mode), then
    /// [`drain::Drain::run`]: `/ready` answers 503 `draining` so that gateways stop routing
    /// here, and requests in flight — and any that still arrive — are answered until none is
    /// in flight once `grace` has passed, or until `timeout`. Idempotent.
    pub async fn drain(&mut self, grace: Duration, timeout: Duration) -> DrainReport {
        if let Some(task) = self.registration.take() {
            registration::stop(task).await;
        }
        tracing::info!(
            worker = %self.state.settings.worker_id,
            in_flight = self.in_flight(),
            "draining: /ready answers 503, requests in flight finish"
        );
        self.state.drain.run(grace, timeout).await
    }

    /// Graceful stop: stop accepting, end streams (their receipts are written), stop the
    /// engine, flush the receipt log. [`RunningWorker::drain`] first lets streams finish.
    pub async fn shutdown(self) {
        if let Some(task) = self.registration {
            // Withdraw first: gateways stop routing here before the server stops.
            registration::stop(task).await;
        }
        self.state.shutdown.cancel();
        self.smoke.abort();
        match tokio::time::timeout(Duration::from_secs(10), self.server).await {
            Ok(Ok(Ok(()))) => {}
            Ok(Ok(Err(e))) => tracing::warn!(error = %e, "server ended with an error"),
            Ok(Err(e)) => tracing::warn!(error = %e, "server task failed"),
            Err(_) => tracing::warn!("server did not stop within 10 s"),
        }
        let engine = self.state.engine.clone();
        let receipts = self.state.receipts.clone();
        let _ = tokio::task::spawn_blocking(move || {
            engine.shutdown();
            if let Err(e) = receipts.sync() {
                tracing::warn!(error = %e, "receipt log sync failed at shutdown");
            }
        })
        .await;
    }
}

/// Builds the executor (loading weights for the model engine: seconds).
fn build_executor(
    choice: &EngineChoice,
    model_path: &std::path::Path,
    block_size: usize,
    weight_format: Option<engine::model::WeightFormat>,
    dev_settings: DeviceSettings,
) -> Result<(Box<dyn Executor>, Option<&'static str>), WorkerError> {
    match choice {
        EngineChoice::Sim(cfg) => {
            if cfg.block_size != block_size {
                return Err(startup(
                    "sim engine",
                    format!(
                        "sim block size {} differs from the worker's {block_size}",
                        cfg.block_size
                    ),
                ));
            }
            Ok((Box::new(SimExecutor::new(cfg.clone())?), None))
        }
        EngineChoice::Model {
            kv_budget_bytes,
            threads,
            cuda,
        } => {
            engine::model::configure_compute_threads(*threads);
            let device = engine::model::device(*cuda)?;
            let format = weight_format.unwrap_or_else(|| engine::model::default_format(&device));
            let weights = Arc::new(engine::model::LlamaWeights::load(
                model_path, &device, format,
            )?);
            let on_device =
                !device.is_cpu() || matches!(format, engine::model::WeightFormat::Device(_));
            let (per_token, budget) = if on_device {
                let budget = match (
                    dev_settings.kv_memory_fraction,
                    engine::model::device_memory(&device),
                ) {
                    (Some(f), Some((free, _))) if f > 0.0 && f <= 1.0 => (free as f64 * f) as usize,
                    (Some(f), Some(_)) => {
                        return Err(startup(
                            "model engine",
                            format!("--kv-memory-fraction {f} is not within (0, 1]"),
                        ))
                    }
                    _ => *kv_budget_bytes,
                };
                (
                    engine::model::DeviceExecutor::kv_bytes_per_token(&weights),
                    budget,
                )
            } else {
                (weights.kv_bytes_per_token(), *kv_budget_bytes)
            };
            let num_blocks = engine::model::blocks_for_budget(per_token, budget, block_size);
            if num_blocks == 0 {
                return Err(startup(
                    "model engine",
                    format!("a KV budget of {budget} bytes holds no block"),
                ));
            }
            let geometry = KvGeometry {
                block_size,
                num_blocks,
            };
            let exec: Box<dyn Executor> = if on_device {
                let attention = dev_settings.attention.unwrap_or(if device.is_cuda() {
                    engine::model::AttentionKind::Fused
                } else {
                    engine::model::AttentionKind::Composed
                });
                Box::new(engine::model::DeviceExecutor::new(
                    weights, geometry, attention,
                )?)
            } else {
                Box::new(engine::model::LlamaExecutor::new(weights, geometry)?)
            };
            Ok((exec, Some(format.name())))
        }
    }
}

/// Starts a worker on `listener`: loads the profile (and the model), starts the engine, opens
/// the receipt log, serves HTTP, and runs the smoke inference in the background (`/ready`
/// turns true when it produced a token).
pub async fn spawn(
    config: WorkerConfig,
    listener: TcpListener,
) -> Result<RunningWorker, WorkerError> {
    let addr = listener.local_addr().map_err(|e| startup("listener", e))?;
    let WorkerConfig {
        model_path,
        profile,
        engine: choice,
        weight_format,
        device: dev_settings,
        mut engine_config,
        key,
        gateway_keys,
        receipt_log,
        fsync,
        rotation,
        settings,
        tls,
        registration,
    } = config;
    // A bad certificate or key stops the start, before anything is loaded.
    let tls = tls
        .map(|t| t.server_config())
        .transpose()
        .map_err(|e| startup("tls", e))?;
    let block_size = settings.block_size;
    engine_config.hash_algorithm = settings.hash_algorithm;

    let (profile, executor, numerics) = {
        let path = model_path.clone();
        let choice = choice.clone();
        tokio::task::spawn_blocking(move || -> Result<_, WorkerError> {
            let profile = match profile {
                Some(p) => p,
                None => PromptProfile::from_gguf(&path)
                    .map_err(|e| startup("prompt profile", format!("{}: {e}", path.display())))?,
            };
            profile.warm_up();
            let (exec, numerics) = build_executor(
                &choice,
                &path,
                block_size.get(),
                weight_format,
                dev_settings,
            )?;
            Ok((profile, exec, numerics))
        })
        .await
        .map_err(|e| startup("loader task", e))??
    };
    let decoder: Arc<dyn prompt_profile::TokenDecoder> = Arc::new(profile.clone());
    let engine = Engine::start(executor, decoder, engine_config)?;
    if engine.block_size() != block_size.get() {
        engine.shutdown();
        return Err(startup(
            "engine",
            format!(
                "engine block size {} differs from the configured {}",
                engine.block_size(),
                block_size
            ),
        ));
    }
    let receipts = {
        let (path, key, id) = (receipt_log.clone(), key.clone(), settings.worker_id.clone());
        let opened = tokio::task::spawn_blocking(move || {
            ReceiptLog::open_with(&path, fsync, &key, &id, rotation)
        })
        .await
        .map_err(|e| startup("receipt log", e))?;
        match opened {
            Ok(log) => Arc::new(log),
            Err(e) => {
                engine.shutdown();
                return Err(startup(
                    "receipt log",
                    format!("{}: {e}", receipt_log.display()),
                ));
            }
        }
    };
    if let Some(t) = &receipts.open_report().torn_tail {
        tracing::warn!("receipt log: {}", receipts::receipt_log::describe_torn(t));
    }
    let identity = profile.identity().clone();
    let key_space = KeySpace::of(&identity, block_size, settings.hash_algorithm);
    let max_subscriptions = settings.max_event_subscriptions.max(1);
    // Tickets accepted before a restart stay used: the gate's replay guard is seeded from the log.
    let tickets = tickets::TicketGate::seeded(
        settings.worker_id.clone(),
        settings.ticket_policy,
        settings.ticket_skew_ms,
        Some(settings.hash_algorithm),
        gateway_keys,
        key_space.seed(None),
        &receipts,
    );
    let profile_limit = identity.context_limit as usize;
    let context_limit = settings
        .context_limit
        .map_or(profile_limit, |c| c.min(profile_limit));
    let profile_digest = identity.digest();
    let fingerprint = format!("kvgate-{}", &profile_digest[..profile_digest.len().min(16)]);
    let ready = Arc::new(AtomicBool::new(false));
    let mut registry = Registry::default();
    let drain = drain::Drain::default();
    let schemas = Arc::new(engine::schema_cache::SchemaCache::new(
        settings.schema_cache_bytes,
    ));
    let metrics = metrics::ServerMetrics::register(
        &mut registry,
        engine.clone(),
        ready.clone(),
        drain.clone(),
        schemas.clone(),
    );
    let state = Arc::new(AppState {
        tickets,
        settings,
        engine_kind: choice.kind(),
        numerics,
        engine,
        profile,
        identity,
        profile_digest,
        fingerprint,
        context_limit,
        block_size,
        key_space,
        key,
        receipts,
        metrics,
        registry,
        ready: ready.clone(),
        ready_reason: Mutex::new("smoke inference pending".into()),
        shutdown: CancellationToken::new(),
        started_at_ms: receipts::now_ms(),
        subscriptions: Arc::new(tokio::sync::Semaphore::new(max_subscriptions)),
        drain,
        token_table: std::sync::OnceLock::new(),
        schemas,
    });

    let app = router(state.clone());
    let token = state.shutdown.clone();
    let server = tokio::spawn(listener::serve(listener, tls, app, token));
    let (ready_tx, ready_rx) = watch::channel(None);
    let smoke = tokio::spawn(smoke_inference(state.clone(), ready_tx));
    let registration = registration.map(|reg| {
        registration::start(
            reg,
            &state.settings.worker_id,
            &state.key,
            &state.profile_digest,
            state.clone(),
        )
    });
    Ok(RunningWorker {
        addr,
        state,
        server,
        smoke,
        ready_rx,
        registration,
    })
}

/// One greedy token through the whole engine; sets readiness.
async fn smoke_inference(st: Arc<AppState>, ready_tx: watch::Sender<Option<Result<(), String>>>) {
    let started = Instant::now();
    let result = smoke_once(&st).await;
    match &result {
        Ok(()) => {
            st.ready.store(true, Ordering::Release);
            tracing::info!(
                worker = %st.settings.worker_id,
                ms = started.elapsed().as_millis() as u64,
                cpu_kernels = engine::model::cpu_kernels(),
                "smoke inference produced a token: ready"
            );
        }
        Err(e) => {
            *st.ready_reason.lock() = format!("smoke inference failed: {e}");
            tracing::error!(worker = %st.settings.worker_id, error = %e, "smoke inference failed");
        }
    }
    let _ = ready_tx.send(Some(result));
}

async fn smoke_once(st: &Arc<AppState>) -> Result<(), String> {
    let profile = st.profile.clone();
    let prompt = tokio::task::spawn_blocking(move || {
        profile.render_and_encode(&[ChatMessage::new("user", "Hi")])
    })
    .await
    .map_err(|e| e.to_string())?
    .map_err(|e| e.to_string())?
    .ids;
    let mut handle = st
        .engine
        .submit(GenerateRequest {
            request_id: format!("smoke-{}", st.settings.worker_id),
            prompt,
            namespace: st.tickets.default_namespace,
            sampling: SamplingParams::greedy(),
            max_tokens: 1,
            stop_token_ids: Vec::new(),
            stop_strings: Vec::new(),
            output: engine::OutputParams::default(),
            cache_insert: false,
            deadline: None,
            constraint: None,
        })
        .map_err(|e| e.to_string())?;
    loop {
        match handle.next().await {
            Some(SeqEvent::Token { .. }) => return Ok(()),
            Some(SeqEvent::Finished { usage, .. }) if usage.completion_tokens > 0 => return Ok(()),
            Some(SeqEvent::Finished { .. }) => return Err("finished without a token".into()),
            Some(SeqEvent::Failed { error, code }) => return Err(format!("{code}: {error}")),
            Some(SeqEvent::Started { .. } | SeqEvent::PromptLogprobs(_)) => {}
            None => return Err("engine stopped".into()),
        }
    }
}

/// The routes. The operations endpoints that expose the cache, the tokenizer or the receipts
/// need the gateway's access token when the worker requires route tickets ([`require_access`]).
fn router(state: Arc<AppState>) -> Router {
    let guarded = Router::new()
        .route("/v1/tokenize", post(ops::tokenize))
        .route("/v1/responses/input_tokens", post(generate::input_tokens))
        .route("/v1/kv/events", get(kv_events::kv_events))
        .route("/v1/load", get(kv_events::load))
        .route("/v1/receipts/{request_id}", get(ops::receipt))
        .route_layer(axum::middleware::from_fn_with_state(
            state.clone(),
            require_access,
        ));
    let inference = Router::new()
        .route("/v1/chat/completions", post(generate::chat_completions))
        .route("/v1/completions", post(generate::completions))
        .route("/v1/responses", post(generate::responses))
        .route_layer(axum::middleware::from_fn_with_state(
            state.drain.clone(),
            drain::count_in_flight,
        ));
    Router::new()
        .merge(inference)
        .route("/v1/models", get(ops::models))
        .route("/v1/profile", get(ops::profile))
        .merge(guarded)
        .route("/v1/keys", get(ops::keys))
        .route("/health", get(ops::health))
        .route("/ready", get(ops::ready))
        .route("/metrics", get(ops::metrics))
        .fallback(|| async { ApiError::not_found("not_found", "no such endpoint").into_response() })
        .method_not_allowed_fallback(|| async {
            ApiError::new(
                StatusCode::METHOD_NOT_ALLOWED,
                "method_not_allowed",
                "method not allowed on this endpoint",
            )
            .into_response()
        })
        .layer(axum::middleware::from_fn(echo_request_id))
        .layer(axum::middleware::from_fn_with_state(
            // Converted once; an id that is no valid header value gets no header.
            HeaderValue::from_str(&state.settings.worker_id).ok(),
            worker_id_header,
        ))
        .with_state(state)
}

/// With `TicketPolicy::Require`, the guarded endpoints answer only a request carrying the
/// gateway's access token (`Authorization: Bearer`, `receipts::AccessToken`, signed by a key of
/// the gateway key ring for this worker): 401 `access_required` without one, 401 with the
/// token's error code (`bad_signature`, `unknown_key`, `ticket_expired`, `malformed`, ...) for a
/// bad one. With optional tickets (local use) they stay open.
async fn require_access(
    axum::extract::State(st): axum::extract::State<Arc<AppState>>,
    req: Request,
    next: Next,
) -> Response {
    match st.tickets.check_access(req.headers()) {
        Ok(()) => next.run(req).await,
        Err(e) => e.into_response(),
    }
}

/// `x-kvgate-worker-id: <worker id>` on every answer, so that a client behind any proxy (not
/// only kvgate's gateway, which names the worker itself) can tell which worker served it.
pub(crate) async fn worker_id_header(
    axum::extract::State(id): axum::extract::State<Option<HeaderValue>>,
    req: Request,
    next: Next,
) -> Response {
    let mut resp = next.run(req).await;
    if let Some(v) = id {
        resp.headers_mut().insert(WORKER_ID_HEADER, v);
    }
    resp
}

/// The header naming the worker that answered.
pub const WORKER_ID_HEADER: &str = "x-kvgate-worker-id";

/// Echoes a valid `x-request-id` (or a generated one) on answers that don't set their own.
async fn echo_request_id(req: Request, next: Next) -> Response {
    let id = tickets::header_request_id(req.headers()).ok().flatten();
    let mut resp = next.run(req).await;
    if !resp.headers().contains_key(REQUEST_ID_HEADER) {
        let id = id.unwrap_or_else(tickets::generate_request_id);
        if let Ok(v) = HeaderValue::from_str(&id) {
            resp.headers_mut().insert(REQUEST_ID_HEADER, v);
        }
    }
    resp
}
