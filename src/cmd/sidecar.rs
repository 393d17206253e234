//! `kvgate sidecar`: the receipt proxy beside a native engine (`llama-server`, or any
//! OpenAI-compatible server) — route tickets verified as a kvgate worker verifies them, the
//! request forwarded unchanged, a signed receipt per request (`worker::sidecar`,
//! docs/sidecar.md).
//!
//! State as `kvgate worker`: unless `--key` and `--receipts` are given, the key and the receipt
//! log live in `--state-dir` (default `kvgate-state/<id>/`).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use worker::sidecar::SidecarConfig;
use worker::TicketPolicy;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// The engine's base URL (e.g. llama-server's `http://127.0.0.1:8080`).
    #[arg(long)]
    pub engine: String,
    /// Address to listen on (the URL the gateway's rules name for this worker).
    #[arg(long, default_value = "127.0.0.1:8201")]
    pub listen: SocketAddr,
    /// Worker id (route tickets must name it; receipts are signed under it).
    #[arg(long, default_value = "sidecar-1")]
    pub id: String,
    /// What the engine is, as a rules file's `[[workers]] kind` names it (`llama_cpp`,
    /// `openai` or `vllm`): what a registered sidecar announces (`--register`), so the gateways
    /// treat it as that kind of upstream.
    #[arg(long, default_value = "llama_cpp", value_parser = ["llama_cpp", "openai", "vllm"])]
    pub kind: String,
    /// vLLM's KV-event publisher (`--kv-events-config` `endpoint`) as reachable from here,
    /// e.g. `tcp://127.0.0.1:5557` (`--kind vllm` only): the sidecar maps its events to kvgate
    /// block keys and serves them as `GET /v1/kv/events`; ticketed requests get their
    /// namespace as `cache_salt`.
    #[arg(long)]
    pub kv_events: Option<String>,
    /// vLLM's replay endpoint (`replay_endpoint`), e.g. `tcp://127.0.0.1:5558`: missed events
    /// are read from it (without it a gap clears what the gateway believes the engine holds).
    #[arg(long, requires = "kv_events")]
    pub kv_events_replay: Option<String>,
    /// vLLM's KV-event `topic`.
    #[arg(long, default_value = "", requires = "kv_events")]
    pub kv_events_topic: String,
    /// Tokens per kvgate block: the `block_size` of the gateway's `kv_exact` rule for this
    /// engine (vLLM's own block size may differ).
    #[arg(long, default_value_t = 16, requires = "kv_events")]
    pub block_size: u32,
    /// Most engine blocks remembered for the mapping (new ones beyond are not mapped); each
    /// takes about 240–330 bytes.
    #[arg(long, default_value_t = 1 << 18, requires = "kv_events")]
    pub kv_events_max_blocks: usize,
    /// Engine path probed by `GET /ready`.
    #[arg(long, default_value = "/health")]
    pub health_path: String,
    /// Bearer key the engine expects (`llama-server --api-key`); read from the environment
    /// variable KVGATE_ENGINE_API_KEY when set.
    #[arg(long, env = "KVGATE_ENGINE_API_KEY", hide_env_values = true)]
    pub engine_api_key: Option<String>,
    /// The model the engine serves, a GGUF file or a model folder (`tokenizer.json`,
    /// `tokenizer_config.json`): its prompt-profile digest goes into every receipt
    /// (`profile_digest`; empty without it).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Folder for the generated key and the receipt log [default: kvgate-state/<id>].
    #[arg(long)]
    pub state_dir: Option<PathBuf>,
    /// Private key file (PKCS#8 PEM) [default: <state-dir>/<id>.key, generated if missing].
    #[arg(long)]
    pub key: Option<PathBuf>,
    /// Folder of trusted gateway public keys (`*.pub`) for route tickets.
    #[arg(long)]
    pub gateway_keys: Option<PathBuf>,
    /// Refuse requests without a route ticket (401 `ticket_required`).
    #[arg(long)]
    pub require_ticket: bool,
    /// Deliver answers whose receipt could not be written (default: 503 `receipt_failed`).
    #[arg(long)]
    pub allow_unreceipted: bool,
    /// Report no load: `GET /v1/load` answers 404 and the KV event stream carries no load
    /// messages, so gateways judge this engine by their own counts (docs/sidecar.md, "Load
    /// reports"; for comparisons: `scripts/bench-sidecar-load.sh`).
    #[arg(long)]
    pub no_load_report: bool,
    /// Read the engine's own load into the report, so requests that reach the engine around
    /// the sidecar count too: `slots` reads llama-server's `GET /slots`; `vllm` and `sglang`
    /// their `GET /metrics` (running and waiting requests); `auto` (default) is `slots` for
    /// `--kind llama_cpp` and `off` otherwise (docs/sidecar.md, "The engine's own view").
    #[arg(long, default_value = "auto", value_parser = ["auto", "slots", "vllm", "sglang", "off"])]
    pub engine_load: String,
    /// The engine path read [default: /slots, or /metrics for vllm and sglang].
    #[arg(long)]
    pub engine_load_path: Option<String>,
    /// Time between two reads of the engine's load, ms [default: 100 for slots, 500 for
    /// vllm and sglang].
    #[arg(long)]
    pub engine_load_interval_ms: Option<u64>,
    /// Clock skew tolerated on ticket validity windows, ms.
    #[arg(long, default_value_t = receipts::DEFAULT_MAX_CLOCK_SKEW_MS)]
    pub ticket_skew_ms: u64,
    /// Receipt log (JSON Lines) [default: <state-dir>/receipts.jsonl].
    #[arg(long)]
    pub receipts: Option<PathBuf>,
    /// Rotate the receipt log's current file at this size, MiB (0 = never).
    #[arg(long, default_value_t = 256)]
    pub receipts_rotate_mib: u64,
    /// Receipt fsync policy: `always`, or `batched:<receipts>:<ms>`.
    #[arg(long, default_value = "always")]
    pub fsync: String,
    /// Largest request body (bytes); larger gets 413.
    #[arg(long, default_value_t = 8 << 20)]
    pub max_body_bytes: usize,
    /// Engine connect timeout, ms.
    #[arg(long, default_value_t = 2000)]
    pub connect_timeout_ms: u64,
    /// Longest wait for the engine's next bytes, ms.
    #[arg(long, default_value_t = 300_000)]
    pub read_timeout_ms: u64,
    #[command(flatten)]
    pub tls: super::tls_args::ServerTlsArgs,
    #[command(flatten)]
    pub cluster: super::register_args::RegisterArgs,
    #[command(flatten)]
    pub drain: super::shutdown::DrainArgs,
}

pub fn config_from_args(args: &Args) -> anyhow::Result<SidecarConfig> {
    let state_dir = args
        .state_dir
        .clone()
        .unwrap_or_else(|| PathBuf::from("kvgate-state").join(&args.id));
    std::fs::create_dir_all(&state_dir)
        .with_context(|| format!("creating state dir {}", state_dir.display()))?;
    let key = super::worker::load_or_create_key(args.key.as_deref(), &state_dir, &args.id)?;
    let gateway_keys = super::worker::gateway_key_ring(
        args.gateway_keys.as_deref(),
        args.require_ticket,
        args.cluster.register.is_some(),
    )?;
    let receipts = args
        .receipts
        .clone()
        .unwrap_or_else(|| state_dir.join("receipts.jsonl"));
    let mut cfg = SidecarConfig::new(args.engine.clone(), args.id.clone(), key, receipts);
    cfg.health_path = args.health_path.clone();
    cfg.engine_api_key = args.engine_api_key.clone();
    cfg.gateway_keys = gateway_keys;
    cfg.ticket_policy = if args.require_ticket {
        TicketPolicy::Require
    } else {
        TicketPolicy::Optional
    };
    cfg.ticket_skew_ms = args.ticket_skew_ms;
    cfg.require_receipts = !args.allow_unreceipted;
    cfg.load_report = !args.no_load_report;
    cfg.engine_load = engine_load(args);
    cfg.fsync = super::worker::parse_fsync(&args.fsync)?;
    cfg.rotation = receipts::Rotation {
        max_bytes: (args.receipts_rotate_mib > 0).then_some(args.receipts_rotate_mib << 20),
        max_age: None,
    };
    cfg.max_body_bytes = args.max_body_bytes;
    cfg.connect_timeout = Duration::from_millis(args.connect_timeout_ms.max(1));
    cfg.read_timeout = Duration::from_millis(args.read_timeout_ms.max(1));
    if let Some(model) = &args.model {
        let profile = super::tokenize::load_profile(model, None)?;
        cfg.profile_digest = profile.identity().digest();
    }
    if let Some(endpoint) = &args.kv_events {
        anyhow::ensure!(
            args.kind == "vllm",
            "--kv-events reads vLLM's KV events: it needs --kind vllm"
        );
        anyhow::ensure!(
            endpoint.starts_with("tcp://"),
            "--kv-events {endpoint}: only tcp:// endpoints are supported"
        );
        let mut ev = worker::sidecar::vllm::EngineEventsConfig::new(endpoint.clone());
        ev.replay_endpoint = args.kv_events_replay.clone();
        ev.topic = args.kv_events_topic.clone();
        ev.block_size = prefix_index::BlockSize::new(args.block_size)
            .map_err(|e| anyhow::anyhow!("--block-size {}: {e}", args.block_size))?;
        ev.max_blocks = args.kv_events_max_blocks;
        cfg.engine_events = Some(ev);
    }
    cfg.tls = args.tls.server_tls();
    cfg.registration =
        args.cluster
            .registration(args.listen, cfg.tls.is_some(), Some(args.kind.as_str()))?;
    Ok(cfg)
}

/// `--engine-load` and its path and interval.
fn engine_load(args: &Args) -> Option<worker::sidecar::engine_load::EngineLoadConfig> {
    use worker::sidecar::engine_load::{EngineLoadConfig, EngineLoadSource};
    let source = match (args.engine_load.as_str(), args.kind.as_str()) {
        ("slots", _) | ("auto", "llama_cpp") => EngineLoadSource::Slots,
        ("vllm", _) => EngineLoadSource::vllm(),
        ("sglang", _) => EngineLoadSource::sglang(),
        _ => return None,
    };
    let mut cfg = EngineLoadConfig::new(source);
    if let Some(path) = &args.engine_load_path {
        cfg.path = path.clone();
    }
    if let Some(ms) = args.engine_load_interval_ms {
        cfg.interval = Duration::from_millis(ms.max(1));
    }
    Some(cfg)
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
        let engine = cfg.engine_url.clone();
        let scheme = if cfg.tls.is_some() { "https" } else { "http" };
        let s = worker::sidecar::spawn(cfg, listener).await?;
        eprintln!(
            "kvgate sidecar {}: listening on {scheme}://{} in front of {engine}, receipts in {}",
            args.id,
            s.addr(),
            receipts_path.display()
        );
        let mut s = s;
        super::shutdown::signal().await;
        let n = s.in_flight();
        let label = format!("kvgate sidecar {}", args.id);
        super::shutdown::drain_unless_signalled(&label, &args.drain, n, |g, t| s.drain(g, t)).await;
        eprintln!("kvgate sidecar {}: shutting down", args.id);
        s.shutdown().await;
        Ok::<_, anyhow::Error>(())
    })?;
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;
    use worker::sidecar::engine_load::{EngineLoadConfig, EngineLoadSource};

    #[derive(clap::Parser)]
    struct Cli {
        #[command(flatten)]
        args: Args,
    }

    fn engine_load_of(argv: &[&str]) -> Option<EngineLoadConfig> {
        use clap::Parser;
        let mut all = vec!["sidecar", "--engine", "http://127.0.0.1:8080"];
        all.extend_from_slice(argv);
        engine_load(&Cli::try_parse_from(all).unwrap().args)
    }

    #[test]
    fn engine_load_follows_the_kind_unless_named() {
        let slots = EngineLoadConfig::new(EngineLoadSource::Slots);
        assert_eq!(engine_load_of(&[]), Some(slots.clone()));
        assert_eq!(
            (slots.path.as_str(), slots.interval.as_millis()),
            ("/slots", 100)
        );
        assert_eq!(engine_load_of(&["--kind", "openai"]), None);
        assert_eq!(engine_load_of(&["--kind", "vllm"]), None);
        assert_eq!(engine_load_of(&["--engine-load", "off"]), None);
        let vllm = engine_load_of(&["--kind", "vllm", "--engine-load", "vllm"]).unwrap();
        assert_eq!(vllm, EngineLoadConfig::new(EngineLoadSource::vllm()));
        assert_eq!(
            (vllm.path.as_str(), vllm.interval.as_millis()),
            ("/metrics", 500)
        );
        let sglang = engine_load_of(&[
            "--kind",
            "openai",
            "--engine-load",
            "sglang",
            "--engine-load-path",
            "/engine/metrics",
            "--engine-load-interval-ms",
            "250",
        ])
        .unwrap();
        assert_eq!(sglang.source, EngineLoadSource::sglang());
        assert_eq!(
            (sglang.path.as_str(), sglang.interval.as_millis()),
            ("/engine/metrics", 250)
        );
        use clap::Parser;
        assert!(
            Cli::try_parse_from(["sidecar", "--engine", "x", "--engine-load", "nope"]).is_err()
        );
    }
}
