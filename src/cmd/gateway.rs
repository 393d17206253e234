//! `kvgate gateway`: run the gateway (the VIP) in front of a worker fleet.
//!
//! `kvgate gateway --rules examples/rules.toml --listen 127.0.0.1:8080 --admin 127.0.0.1:9000
//! --key keys/gateway.key [--admin-token T] [--decision-log decisions.jsonl]`
//! Runs until SIGINT or SIGTERM; SIGHUP and edits of the rules file reload the rules.
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;

/// Arguments of `kvgate gateway`.
#[derive(clap::Args)]
pub struct Args {
    /// The rules file (TOML; see docs/rules.md).
    #[arg(long)]
    pub rules: PathBuf,
    /// Address of the VIP (OpenAI API).
    #[arg(long, default_value = "127.0.0.1:8080")]
    pub listen: SocketAddr,
    /// Address of the admin plane (admin API and /metrics). Default: the rules'
    /// `gateway.admin_addr`, else 127.0.0.1:9000.
    #[arg(long)]
    pub admin: Option<SocketAddr>,
    /// The gateway's Ed25519 private key (from `kvgate keygen`), signs route tickets.
    #[arg(long)]
    pub key: PathBuf,
    /// Bearer token of the admin plane. Without it the admin plane is open: bind it to localhost.
    #[arg(long, env = "KVGATE_ADMIN_TOKEN")]
    pub admin_token: Option<String>,
    /// Append one JSON line per request (ticket + outcome) here: the input of `kvgate receipts audit`.
    #[arg(long)]
    pub decision_log: Option<PathBuf>,
    /// Write one JSON line per client request here (`-`: standard output): status, service,
    /// worker, timings, bytes (docs/gateway.md, "Access log").
    #[arg(long)]
    pub access_log: Option<String>,
    /// Gateway id written into route tickets.
    #[arg(long, default_value = "gateway")]
    pub gateway_id: String,
    /// Threads of the routing pool: KV-exact parsing, rendering and tokenizing run there, never
    /// on the proxy threads.
    #[arg(long, default_value_t = 2)]
    pub routing_threads: usize,
    /// Requests that may wait for the routing pool; more get 503 `gateway_overloaded`.
    #[arg(long, default_value_t = 64)]
    pub routing_queue: usize,
    /// Ed25519 nonces for route tickets precomputed by an idle-priority thread (0: off, every
    /// ticket signed the RFC 8032 deterministic way). Shortens the request path by ~20 µs where
    /// cores are spare; on a 2-core box it raised 1-connection p99s (docs/benchmarks.md).
    #[arg(long, default_value_t = 0)]
    pub nonce_pool: usize,
    /// Proxy worker threads.
    #[arg(long, default_value_t = 2)]
    pub threads: usize,
    /// Do not reload when the rules file changes on disk (SIGHUP and POST /admin/reload still do).
    #[arg(long)]
    pub no_watch: bool,
    #[command(flatten)]
    pub tls: super::tls_args::ServerTlsArgs,
    /// Serve the admin plane over HTTPS with this certificate chain (PEM, leaf first); needs
    /// --admin-tls-key. Default: plain HTTP (bind it to localhost or a management network).
    #[arg(long, requires = "admin_tls_key")]
    pub admin_tls_cert: Option<PathBuf>,
    /// The private key of --admin-tls-cert (PEM).
    #[arg(long, requires = "admin_tls_cert")]
    pub admin_tls_key: Option<PathBuf>,
    /// Require every admin client (health checks included) to show a certificate signed by
    /// this CA (PEM): mTLS on the admin plane.
    #[arg(long, requires = "admin_tls_cert")]
    pub admin_tls_client_ca: Option<PathBuf>,
    /// Trust only this CA (PEM) for `https://` workers (default: the platform's roots).
    #[arg(long)]
    pub upstream_ca: Option<PathBuf>,
    /// Client certificate (PEM) shown to `https://` workers that require one (mTLS); needs
    /// --upstream-client-key and --upstream-ca.
    #[arg(long, requires_all = ["upstream_client_key", "upstream_ca"])]
    pub upstream_client_cert: Option<PathBuf>,
    /// The private key of --upstream-client-cert (PEM).
    #[arg(long, requires = "upstream_client_cert")]
    pub upstream_client_key: Option<PathBuf>,
    /// Cluster mode: share rules, worker registrations, gateway keys and load with the other
    /// replicas through this Redis (`redis://[user:password@]host[:port][/db]`, `rediss://` for
    /// TLS); also from KVGATE_CLUSTER. Give each replica its own --gateway-id and --key.
    #[arg(long, env = "KVGATE_CLUSTER", hide_env_values = true)]
    pub cluster: Option<String>,
    /// Key prefix in the cluster's Redis.
    #[arg(long, default_value = "kvgate")]
    pub cluster_prefix: String,
    /// Lease of this replica's records in Redis, ms (synced every lease / 5).
    #[arg(long, default_value_t = 5000)]
    pub cluster_lease_ms: u64,
    /// How long a cold placement's claim counts for the other replicas, ms (the atomic
    /// select-and-reserve of new prompts, docs/cluster.md "Claims"); 0 turns claims off.
    #[arg(long, default_value_t = 10)]
    pub cluster_claim_ms: u64,
    /// How long a decision waits for its claim before keeping its own choice, ms.
    #[arg(long, default_value_t = 25)]
    pub cluster_claim_timeout_ms: u64,
    /// Cluster mode: MiB of stored responses the replicas keep in Redis together, least
    /// recently used out first; 0: bounded by --response-idle-ttl-s only. Give every
    /// replica the same value.
    #[arg(long, default_value_t = 1024)]
    pub cluster_response_mb: u64,
    /// Memory for stored Responses API answers (`store`, `previous_response_id`,
    /// `GET /v1/responses/{id}`), MiB; 0 stores none (docs/gateway.md, "Stored responses").
    #[arg(long, default_value_t = 64)]
    pub response_store_mb: usize,
    /// A stored response neither read nor continued for this long is dropped, seconds.
    #[arg(long, default_value_t = 3600)]
    pub response_idle_ttl_s: u64,
    /// Keep the stored responses across restarts in this file: read at the start, written
    /// when they changed (every --response-save-interval-s) and at shutdown.
    #[arg(long)]
    pub response_store_file: Option<std::path::PathBuf>,
    /// How often changed stored responses are written to --response-store-file, seconds.
    #[arg(long, default_value_t = 30)]
    pub response_save_interval_s: u64,
    /// Background responses (`background: true`) this gateway runs at once; more are
    /// refused with 429 `too_many_background_responses`; 0 refuses them all.
    #[arg(long, default_value_t = gateway::background::DEFAULT_MAX_JOBS)]
    pub max_background_responses: usize,
    /// Keep transparent huge pages for this process. By default the gateway turns them off:
    /// zeroing a new 2 MiB page on first touch stalled KV-exact decisions by milliseconds
    /// (docs/gateway.md, "Memory").
    #[arg(long)]
    pub transparent_huge_pages: bool,
    #[command(flatten)]
    pub drain: super::shutdown::DrainArgs,
}

/// Runs the gateway until SIGINT/SIGTERM.
pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    super::init_logs();
    let _ = crate::memory::apply(crate::memory::HugePages::from_flag(
        args.transparent_huge_pages,
    ));
    let key = receipts::KeyPair::load_private(&args.key)
        .with_context(|| format!("loading gateway key {}", args.key.display()))?;
    let mut config = gateway::GatewayConfig::new(&args.rules, key);
    config.listen = args.listen;
    config.admin = args.admin;
    config.admin_token = args.admin_token;
    config.decision_log = args.decision_log;
    config.access_log = args
        .access_log
        .as_deref()
        .map(gateway::access_log::AccessLogTarget::parse);
    config.gateway_id = args.gateway_id;
    config.threads = args.threads;
    config.routing_threads = args.routing_threads;
    config.routing_queue = args.routing_queue;
    config.nonce_pool = args.nonce_pool;
    config.responses = gateway::response_store::StoreLimits {
        max_bytes: args.response_store_mb.saturating_mul(1 << 20),
        idle_ttl: std::time::Duration::from_secs(args.response_idle_ttl_s),
    };
    config.response_file = args.response_store_file;
    config.response_save_interval =
        std::time::Duration::from_secs(args.response_save_interval_s.max(1));
    config.max_background = args.max_background_responses;
    config.watch_rules = !args.no_watch;
    config.sighup = true;
    config.tls = args.tls.server_tls();
    config.admin_tls = match (&args.admin_tls_cert, &args.admin_tls_key) {
        (Some(cert), Some(key)) => Some(tls::ServerTls {
            cert: cert.clone(),
            key: key.clone(),
            client_ca: args.admin_tls_client_ca.clone(),
        }),
        _ => None,
    };
    if let Some(url) = &args.cluster {
        let mut c = gateway::cluster::ClusterSettings::new(url.clone());
        c.prefix = args.cluster_prefix.clone();
        c.lease = std::time::Duration::from_millis(args.cluster_lease_ms.max(500));
        c.claim_ttl = std::time::Duration::from_millis(args.cluster_claim_ms);
        c.response_budget = args.cluster_response_mb.saturating_mul(1 << 20);
        c.claim_timeout = std::time::Duration::from_millis(args.cluster_claim_timeout_ms.max(1));
        config.cluster = Some(c);
    }
    config.upstream_tls = tls::ClientTls {
        ca: args.upstream_ca.clone(),
        identity: match (&args.upstream_client_cert, &args.upstream_client_key) {
            (Some(cert), Some(key)) => Some(tls::Identity {
                cert: cert.clone(),
                key: key.clone(),
            }),
            _ => None,
        },
    };
    let scheme = if config.tls.is_some() {
        "https"
    } else {
        "http"
    };
    let admin_scheme = if config.admin_tls.is_some() {
        "https"
    } else {
        "http"
    };
    let mut running = gateway::spawn(config)?;
    eprintln!(
        "kvgate gateway: VIP on {scheme}://{}, admin on {admin_scheme}://{} (rules version {})",
        running.listen_addr,
        running.admin_addr,
        running.data.views.load().version()
    );
    for (name, addr) in &running.listeners {
        eprintln!("kvgate gateway: listener {name:?} on {scheme}://{addr}");
    }
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("signal runtime")?;
    rt.block_on(super::shutdown::signal());
    let n = running.data.drain.in_flight();
    rt.block_on(super::shutdown::drain_unless_signalled(
        "kvgate gateway",
        &args.drain,
        n,
        |g, t| running.drain(g, t),
    ));
    eprintln!("kvgate gateway: stopping");
    running.shutdown();
    Ok(ExitCode::SUCCESS)
}
