//! `kvgate worker`: one worker process — the embedded engine behind the OpenAI-compatible HTTP
//! server (`worker::server`). See `docs/worker-api.md`.
//!
//! State: unless `--key` and `--receipts` are given, the worker keeps its signing key and its
//! receipt log in `--state-dir` (default `kvgate-state/<id>/`): `<id>.key` (PKCS#8 PEM, mode
//! 0600) and `<id>.pub` are generated on first start and reused afterwards, and
//! `receipts.jsonl` continues its hash chain across restarts.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use engine::sim::SimConfig;
use engine::EngineConfig;
use prefix_index::{BlockSize, HashAlgorithm};
use receipts::{FsyncPolicy, KeyPair, KeyRing};
use worker::{EngineChoice, ServerSettings, TicketPolicy, WorkerConfig};

/// The default model file name inside the model folder.
pub const DEFAULT_MODEL_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum EngineKind {
    /// The candle Llama model (real inference).
    Model,
    /// The simulated executor (timing model, deterministic tokens; still tokenizes with the
    /// model file's prompt profile).
    Sim,
}

/// `--numerics`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Numerics {
    /// F32 activations throughout (`WeightFormat::Exact`).
    Exact,
    /// llama.cpp's arithmetic (`WeightFormat::LlamaCpp`).
    LlamaCpp,
    /// The device executor with dense F32 weights (on the CPU: the GPU path's code, for
    /// checks; on CUDA: F32 cuBLAS).
    DeviceF32,
    /// The device executor with dense BF16 weights (the default with `--cuda`).
    DeviceBf16,
    /// The device executor with the file's quantized weights (candle's CUDA kernels; F32
    /// activations).
    DeviceQuantized,
}

impl Numerics {
    /// The engine's weight format for this choice.
    pub fn weight_format(self) -> engine::model::WeightFormat {
        match self {
            Numerics::Exact => engine::model::WeightFormat::CPU_DEFAULT,
            Numerics::LlamaCpp => engine::model::WeightFormat::LlamaCpp,
            Numerics::DeviceF32 => engine::model::WeightFormat::Device(engine::model::DType::F32),
            Numerics::DeviceBf16 => engine::model::WeightFormat::Device(engine::model::DType::BF16),
            Numerics::DeviceQuantized => engine::model::WeightFormat::AsStored,
        }
    }
}

/// The share of free device memory the KV cache takes with `--cuda` when neither
/// `--kv-budget-mb` nor `--kv-memory-fraction` is given.
pub const DEFAULT_KV_MEMORY_FRACTION: f64 = 0.85;

/// Scheduler defaults with `--cuda`: a GPU step costs about the same for 1 or 100 sequences
/// (reading the weights dominates), so many more run at once and steps hold more tokens
/// (docs/gpu.md). Each is still overridden by its flag.
pub fn gpu_engine_config() -> EngineConfig {
    EngineConfig {
        max_running: 128,
        max_waiting: 1024,
        step_token_budget: 4096,
        prefill_chunk: 2048,
        ..EngineConfig::default()
    }
}

#[derive(clap::Args, Debug)]
pub struct Args {
    /// GGUF model file [default: $KVGATE_MODEL_DIR or ./models, then SmolLM2-135M-Instruct.Q4_1.gguf].
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:8101")]
    pub listen: SocketAddr,
    /// A Jinja chat template file to use instead of the GGUF's (required for a GGUF without one,
    /// e.g. Gemma 3 270M from scripts/fetch-gemma3.sh). The profile's template hash is then this
    /// file's, which a gateway's pinned profile must match.
    #[arg(long)]
    pub chat_template: Option<PathBuf>,
    /// What computes tokens.
    #[arg(long, value_enum, default_value_t = EngineKind::Model)]
    pub engine: EngineKind,
    /// The model engine's arithmetic: `exact` (F32 activations, the CPU default) or
    /// `llama-cpp` (llama.cpp's: 8-bit activations in the block products, keys and values
    /// rounded to f16 — the same greedy tokens as llama-server on the same file; slower).
    #[arg(long, value_enum)]
    pub numerics: Option<Numerics>,
    /// Worker id (route tickets must name it; receipts are signed under it).
    #[arg(long, default_value = "worker-1")]
    pub id: String,
    /// Folder for the generated key and the receipt log [default: kvgate-state/<id>].
    #[arg(long)]
    pub state_dir: Option<PathBuf>,
    /// Private key file (PKCS#8 PEM, as `kvgate keygen` writes) [default: <state-dir>/<id>.key, generated if missing].
    #[arg(long)]
    pub key: Option<PathBuf>,
    /// Folder of trusted gateway public keys (`*.pub`) for route tickets.
    #[arg(long)]
    pub gateway_keys: Option<PathBuf>,
    /// Refuse requests without a route ticket (401 `ticket_required`).
    #[arg(long)]
    pub require_ticket: bool,
    /// Deliver answers whose receipt could not be written (default: withhold them with 503
    /// `receipt_failed`: no answer without a receipt).
    #[arg(long)]
    pub allow_unreceipted: bool,
    /// Most concurrent KV-event subscriptions (more get 429).
    #[arg(long, default_value_t = 16)]
    pub max_event_subscriptions: usize,
    /// How the model writes tool calls, for answers to chat requests with `tools`: `auto` (from
    /// the chat template's markers), `none`, `hermes`, `llama3_json`, `mistral`, `deepseek_v3`.
    #[arg(long, default_value = "auto")]
    pub tool_call_parser: String,
    /// How the model writes reasoning (`<think>…</think>` → `reasoning_content`): `auto` (when
    /// the chat template mentions `</think>`), `none`, `think` (also `qwen3`, `deepseek_r1`).
    #[arg(long, default_value = "auto")]
    pub reasoning_parser: String,
    /// Clock skew tolerated on ticket validity windows, ms.
    #[arg(long, default_value_t = receipts::DEFAULT_MAX_CLOCK_SKEW_MS)]
    pub ticket_skew_ms: u64,
    /// Receipt log (JSON Lines) [default: <state-dir>/receipts.jsonl].
    #[arg(long)]
    pub receipts: Option<PathBuf>,
    /// Rotate the receipt log's current file at this size, MiB (0 = never); the chain continues
    /// across files (`docs/receipts.md`).
    #[arg(long, default_value_t = 256)]
    pub receipts_rotate_mib: u64,
    /// Also rotate it when its first receipt is older than this many hours (0 = never).
    #[arg(long, default_value_t = 0)]
    pub receipts_rotate_hours: u64,
    /// Receipt fsync policy: `always`, or `batched:<receipts>:<ms>`.
    #[arg(long, default_value = "always")]
    pub fsync: String,
    /// Largest request body (bytes); larger gets 413.
    #[arg(long, default_value_t = 8 << 20)]
    pub max_body_bytes: usize,
    /// Output tokens of a request without max_tokens: the remaining context capped here.
    #[arg(long, default_value_t = 1024)]
    pub default_max_tokens: usize,
    /// MiB of compiled schemas (`json_schema` answers, forced tool calls) kept between
    /// requests, least recently used out first; 0 compiles every request's schema.
    #[arg(long, default_value_t = 32)]
    pub schema_cache_mb: usize,
    /// Tokens kept free beyond prompt + output in the token budget.
    #[arg(long, default_value_t = 0)]
    pub native_reserve: usize,
    /// Lower the model's context limit.
    #[arg(long)]
    pub context_limit: Option<usize>,
    /// KV block size (tokens).
    #[arg(long, default_value_t = 16)]
    pub block_size: u32,
    /// Block-key hash algorithm: xxh3 or sha256.
    #[arg(long, default_value = "xxh3")]
    pub hash_algorithm: String,
    /// Accepted `model` names (repeatable); none = accept any.
    #[arg(long = "served-model-name")]
    pub served_model_names: Vec<String>,
    /// Retry-After seconds on 429 / 503.
    #[arg(long, default_value_t = 1)]
    pub retry_after_s: u64,
    /// KV cache budget of the model engine, MiB [default: 256; with --cuda the KV cache is
    /// sized by --kv-memory-fraction instead unless this is given].
    #[arg(long)]
    pub kv_budget_mb: Option<usize>,
    /// candle compute threads (0 = all cores).
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
    /// Run the model on CUDA device 0 (needs a `--features cuda` build): the device executor,
    /// BF16 weights unless --numerics says otherwise, GPU-sized scheduler defaults (see
    /// docs/gpu.md) and, unless --kv-budget-mb is given, --kv-memory-fraction 0.85.
    #[arg(long)]
    pub cuda: bool,
    /// Device executor's attention: `fused` (CUDA kernels; the default on CUDA) or `composed`
    /// (candle tensor ops; the default on the CPU).
    #[arg(long, value_parser = ["fused", "composed"])]
    pub attention: Option<String>,
    /// On CUDA: the KV cache takes this share of the device memory left free by the weights.
    #[arg(long)]
    pub kv_memory_fraction: Option<f64>,
    /// Sequences running at once.
    #[arg(long)]
    pub max_running: Option<usize>,
    /// Waiting queue bound (beyond it: 429 queue_full).
    #[arg(long)]
    pub max_waiting: Option<usize>,
    /// Tokens per engine step.
    #[arg(long)]
    pub step_token_budget: Option<usize>,
    /// Largest prefill chunk per sequence and step.
    #[arg(long)]
    pub prefill_chunk: Option<usize>,
    /// Time target per engine step, ms (0 = none: every step may hold the full
    /// --step-token-budget). With a target, each step holds as many tokens as fit in it on this
    /// machine (learned from the steps run; at most the token budget): a short request arriving
    /// behind long prompts waits about two steps for its first token. The default, 600 ms, keeps
    /// that wait under 2 s on a slow 2-vCPU VM (docs/benchmarks.md, "fairness probe").
    #[arg(long, default_value_t = 600)]
    pub step_time_target_ms: u64,
    /// Admission deadline, ms (beyond it: 429 admission_timeout).
    #[arg(long)]
    pub admission_timeout_ms: Option<u64>,
    /// Sim engine: KV blocks.
    #[arg(long, default_value_t = 4096)]
    pub sim_num_blocks: usize,
    /// Sim engine: µs per uncached prefill token.
    #[arg(long, default_value_t = 20)]
    pub sim_prefill_us_per_token: u64,
    /// Sim engine: µs per decode step.
    #[arg(long, default_value_t = 2000)]
    pub sim_decode_us_base: u64,
    /// Sim engine: extra µs per decode step per running sequence.
    #[arg(long, default_value_t = 100)]
    pub sim_decode_us_per_seq: u64,
    /// Sim engine: emit EOS after this many tokens (default: never).
    #[arg(long)]
    pub sim_eos_after: Option<usize>,
    #[command(flatten)]
    pub tls: super::tls_args::ServerTlsArgs,
    #[command(flatten)]
    pub cluster: super::register_args::RegisterArgs,
    #[command(flatten)]
    pub drain: super::shutdown::DrainArgs,
}

/// The trusted gateway keys of `--gateway-keys DIR` (none without it); `--require-ticket` needs
/// at least one, unless the keys come from a cluster (`keys_from_cluster`).
pub(crate) fn gateway_key_ring(
    dir: Option<&Path>,
    require_ticket: bool,
    keys_from_cluster: bool,
) -> anyhow::Result<KeyRing> {
    let ring = match dir {
        Some(dir) => KeyRing::load_dir(dir)
            .with_context(|| format!("loading gateway keys from {}", dir.display()))?,
        None => KeyRing::new(),
    };
    if require_ticket && ring.is_empty() && !keys_from_cluster {
        anyhow::bail!(
            "--require-ticket needs --gateway-keys DIR with at least one gateway public key \
             (a worker may instead --register, trusting the keys the gateway replicas publish)"
        );
    }
    Ok(ring)
}

/// The model folder: `$KVGATE_MODEL_DIR`, else `./models`.
pub fn default_model_path() -> PathBuf {
    let dir = std::env::var_os("KVGATE_MODEL_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("models"));
    dir.join(DEFAULT_MODEL_FILE)
}

/// Parses `always` or `batched:<receipts>:<ms>`.
pub fn parse_fsync(s: &str) -> anyhow::Result<FsyncPolicy> {
    if s == "always" {
        return Ok(FsyncPolicy::Always);
    }
    let parts: Vec<&str> = s.split(':').collect();
    match parts.as_slice() {
        ["batched", n, ms] => Ok(FsyncPolicy::Batched {
            max_receipts: n.parse().context("--fsync batched:<receipts>:<ms>")?,
            max_ms: ms.parse().context("--fsync batched:<receipts>:<ms>")?,
        }),
        _ => anyhow::bail!("--fsync must be `always` or `batched:<receipts>:<ms>`, got `{s}`"),
    }
}

/// Loads `key`, or the state dir's key, or generates and writes one there.
pub(crate) fn load_or_create_key(
    key: Option<&Path>,
    state_dir: &Path,
    id: &str,
) -> anyhow::Result<KeyPair> {
    if let Some(path) = key {
        return KeyPair::load_private(path)
            .with_context(|| format!("loading worker key {}", path.display()));
    }
    let path = state_dir.join(format!("{id}.key"));
    if path.exists() {
        return KeyPair::load_private(&path)
            .with_context(|| format!("loading worker key {}", path.display()));
    }
    let kp = KeyPair::generate();
    kp.write_to_dir(state_dir, id)
        .with_context(|| format!("writing a new worker key into {}", state_dir.display()))?;
    eprintln!(
        "kvgate worker: generated signing key {} ({})",
        kp.key_id(),
        path.display()
    );
    Ok(kp)
}

/// Builds the worker config from the flags.
pub fn config_from_args(args: &Args) -> anyhow::Result<WorkerConfig> {
    let model = args.model.clone().unwrap_or_else(default_model_path);
    if !model.is_file() {
        anyhow::bail!(
            "model file {} not found (fetch it with scripts/fetch-model.sh, or pass --model)",
            model.display()
        );
    }
    let state_dir = args
        .state_dir
        .clone()
        .unwrap_or_else(|| PathBuf::from("kvgate-state").join(&args.id));
    std::fs::create_dir_all(&state_dir)
        .with_context(|| format!("creating state dir {}", state_dir.display()))?;
    let key = load_or_create_key(args.key.as_deref(), &state_dir, &args.id)?;
    let gateway_keys = gateway_key_ring(
        args.gateway_keys.as_deref(),
        args.require_ticket,
        args.cluster.register.is_some(),
    )?;
    let block_size = BlockSize::new(args.block_size).context("--block-size")?;
    let hash_algorithm: HashAlgorithm = args.hash_algorithm.parse().context("--hash-algorithm")?;
    let profile = match &args.chat_template {
        Some(t) => {
            let template = std::fs::read_to_string(t)
                .with_context(|| format!("reading the chat template {}", t.display()))?;
            prompt_profile::PromptProfile::from_gguf_with_template(&model, template)
        }
        None => prompt_profile::PromptProfile::from_gguf(&model),
    }
    .with_context(|| format!("loading the prompt profile of {}", model.display()))?;
    let engine = match args.engine {
        EngineKind::Model => EngineChoice::Model {
            kv_budget_bytes: args.kv_budget_mb.unwrap_or(256).saturating_mul(1 << 20),
            threads: args.threads,
            cuda: args.cuda,
        },
        EngineKind::Sim => EngineChoice::Sim(SimConfig {
            block_size: block_size.get(),
            num_blocks: args.sim_num_blocks,
            vocab_size: profile.vocab_size(),
            prefill_us_per_token: args.sim_prefill_us_per_token,
            decode_us_base: args.sim_decode_us_base,
            decode_us_per_seq: args.sim_decode_us_per_seq,
            eos_after: args.sim_eos_after,
            eos_token_id: profile.eos_token_ids().first().copied().unwrap_or(0),
            panic_at_step: None,
        }),
    };
    let mut engine_config = if args.cuda {
        gpu_engine_config()
    } else {
        EngineConfig::default()
    };
    if let Some(v) = args.max_running {
        engine_config.max_running = v;
    }
    if let Some(v) = args.max_waiting {
        engine_config.max_waiting = v;
    }
    if let Some(v) = args.step_token_budget {
        engine_config.step_token_budget = v;
    }
    if let Some(v) = args.prefill_chunk {
        engine_config.prefill_chunk = v;
    }
    engine_config.step_time_target =
        (args.step_time_target_ms > 0).then(|| Duration::from_millis(args.step_time_target_ms));
    if let Some(ms) = args.admission_timeout_ms {
        engine_config.default_admission_timeout = Duration::from_millis(ms);
    }
    let mut settings = ServerSettings::new(args.id.clone());
    settings.ticket_policy = if args.require_ticket {
        TicketPolicy::Require
    } else {
        TicketPolicy::Optional
    };
    settings.ticket_skew_ms = args.ticket_skew_ms;
    settings.max_body_bytes = args.max_body_bytes;
    settings.default_max_tokens = args.default_max_tokens;
    settings.native_reserve = args.native_reserve;
    settings.block_size = block_size;
    settings.hash_algorithm = hash_algorithm;
    settings.served_model_names = args.served_model_names.clone();
    settings.retry_after_s = args.retry_after_s;
    settings.context_limit = args.context_limit;
    settings.require_receipts = !args.allow_unreceipted;
    settings.max_event_subscriptions = args.max_event_subscriptions;
    settings.schema_cache_bytes = args
        .schema_cache_mb
        .checked_mul(1 << 20)
        .context("--schema-cache-mb is too large")?;
    let template = profile.template_source();
    settings.tool_call_parser = match args.tool_call_parser.as_str() {
        "auto" => worker::output_parser::ToolCallFormat::detect(template),
        "none" => None,
        name => Some(
            worker::output_parser::ToolCallFormat::parse_name(name).with_context(|| {
                format!(
                    "--tool-call-parser {name:?}: expected auto, none, hermes, llama3_json, \
                     mistral or deepseek_v3"
                )
            })?,
        ),
    };
    settings.reasoning_parser = match args.reasoning_parser.as_str() {
        "auto" => worker::output_parser::ReasoningFormat::detect(template),
        "none" => None,
        name => Some(
            worker::output_parser::ReasoningFormat::parse_name(name).with_context(|| {
                format!(
                    "--reasoning-parser {name:?}: expected auto, none, think, qwen3 or deepseek_r1"
                )
            })?,
        ),
    };
    let receipts = args
        .receipts
        .clone()
        .unwrap_or_else(|| state_dir.join("receipts.jsonl"));
    let mut cfg = WorkerConfig::new(model, engine, key, receipts, args.id.clone());
    cfg.engine_config = engine_config;
    cfg.gateway_keys = gateway_keys;
    cfg.fsync = parse_fsync(&args.fsync)?;
    cfg.rotation = receipts::Rotation {
        max_bytes: (args.receipts_rotate_mib > 0).then_some(args.receipts_rotate_mib << 20),
        max_age: (args.receipts_rotate_hours > 0)
            .then(|| std::time::Duration::from_secs(args.receipts_rotate_hours * 3600)),
    };
    cfg.settings = settings;
    cfg.profile = Some(profile);
    cfg.weight_format = args.numerics.map(Numerics::weight_format);
    cfg.device = worker::DeviceSettings {
        attention: match args.attention.as_deref() {
            Some("fused") => Some(engine::model::AttentionKind::Fused),
            Some("composed") => Some(engine::model::AttentionKind::Composed),
            _ => None,
        },
        kv_memory_fraction: match (args.kv_memory_fraction, args.cuda, args.kv_budget_mb) {
            (Some(f), _, _) => Some(f),
            (None, true, None) => Some(DEFAULT_KV_MEMORY_FRACTION),
            _ => None,
        },
    };
    cfg.tls = args.tls.server_tls();
    cfg.registration = args
        .cluster
        .registration(args.listen, cfg.tls.is_some(), None)?;
    Ok(cfg)
}

pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    super::init_logs();
    let cfg = config_from_args(&args)?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    rt.block_on(async move {
        let listener = tokio::net::TcpListener::bind(args.listen)
            .await
            .with_context(|| format!("binding {}", args.listen))?;
        let receipts_path = cfg.receipt_log.clone();
        let scheme = if cfg.tls.is_some() { "https" } else { "http" };
        let w = worker::spawn(cfg, listener).await?;
        eprintln!(
            "kvgate worker {}: listening on {scheme}://{} (engine {}), receipts in {}",
            args.id,
            w.addr(),
            w.profile().engine,
            receipts_path.display()
        );
        match w.wait_ready(Duration::from_secs(600)).await {
            Ok(()) => eprintln!("kvgate worker {}: ready", args.id),
            Err(e) => eprintln!("kvgate worker {}: NOT ready: {e}", args.id),
        }
        let mut w = w;
        super::shutdown::signal().await;
        let n = w.in_flight();
        let label = format!("kvgate worker {}", args.id);
        super::shutdown::drain_unless_signalled(&label, &args.drain, n, |g, t| w.drain(g, t)).await;
        eprintln!("kvgate worker {}: shutting down", args.id);
        w.shutdown().await;
        Ok::<_, anyhow::Error>(())
    })?;
    Ok(ExitCode::SUCCESS)
}
