//! gateway: kvgate's front door — a pingora proxy that matches each request to a service,
//! routes it round-robin or KV-exact (to the worker holding the longest cached prefix of the
//! prompt), signs a route ticket, and streams the answer back.
//!
//! Owns, in two planes:
//! - the **data plane** ([`data_plane`]), everything one request touches: the `ProxyHttp`
//!   implementation ([`proxy`]) and its own forwarding path for bodies over pingora's 64 KiB
//!   retry buffer ([`forward`]), the steps both share ([`upstream`]: attempt, ticket, request
//!   head, response decoration), the per-request state ([`request`]), the routing decision
//!   ([`route`]), the snapshot of rules + workers + health ([`view`]), the pinned prompt
//!   profiles ([`profile`]), the wire types routing reads ([`protocol`]) and metrics
//!   ([`metrics`]);
//! - the **control plane** ([`control_plane`]): rules changes and the worker contract check,
//!   the owned background tasks (KV-event subscriptions and health checks, [`supervisor`]), the
//!   admin API ([`admin`]) and hot reload (file watch + SIGHUP, in this module).
//!
//! The control plane holds the data plane and installs views into it; nothing on the request
//! path imports the control plane.
//!
//! Does not own: the rules schema, store and selection policies (`routing-rules`), block keys and
//! the prefix index (`prefix-index`), tokenization (`prompt-profile`), tickets and the decision
//! log format (`receipts`). It never depends on the `worker` crate: the two meet over HTTP.
//!
//! Start one in-process with [`spawn`]; stop it with [`RunningGateway::shutdown`].

pub mod access_log;
pub mod admin;
pub mod background;
pub mod claim_wait;
pub mod cluster;
pub mod control_plane;
pub mod conversation;
pub mod data_plane;
pub mod error;
pub mod event_log;
pub mod forward;
pub mod limits;
pub mod metrics;
pub mod native;
pub mod pool;
pub mod profile;
pub mod protocol;
pub mod proxy;
pub mod request;
pub mod response_file;
pub mod response_store;
pub mod route;
pub mod supervisor;
pub mod upstream;
pub mod view;
pub mod write_backlog;

use std::collections::{BTreeMap, BTreeSet};
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use parking_lot::Mutex;
use pingora::server::configuration::ServerConf;
use pingora::server::{ExecutionPhase, RunArgs, Server, ShutdownSignal, ShutdownSignalWatch};
use prefix_index::{IndexConfig, PrefixIndex};
use receipts::{DecisionLog, FsyncPolicy, KeyPair};
use routing_rules::RuleStore;

pub use crate::control_plane::ControlPlane;
pub use crate::data_plane::DataPlane;
pub use crate::error::GatewayError;

/// Default TTL of approximate holdings (keys routed to a worker without an event stream).
pub const DEFAULT_APPROX_TTL: Duration = Duration::from_secs(120);

/// How to run a gateway.
#[derive(Clone)]
pub struct GatewayConfig {
    /// The rules file (TOML).
    pub rules_path: PathBuf,
    /// The VIP (the unnamed listener: it serves the services without `match.listener`). Port 0
    /// picks a free port. The rules' `gateway.listeners` are bound beside it.
    pub listen: SocketAddr,
    /// The admin plane. Port 0 picks a free port. `None`: the rules' `gateway.admin_addr`,
    /// else [`DEFAULT_ADMIN_ADDR`].
    pub admin: Option<SocketAddr>,
    /// The gateway's Ed25519 key (signs route tickets).
    pub key: KeyPair,
    /// Gateway id written into tickets.
    pub gateway_id: String,
    /// Bearer token of the admin plane; `None` leaves it open (local use only).
    pub admin_token: Option<String>,
    /// Where to append the decision log (one JSON line per request); `None`: no log.
    pub decision_log: Option<PathBuf>,
    /// Where to write the access log (one JSON line per client request); `None`: none.
    pub access_log: Option<access_log::AccessLogTarget>,
    /// pingora worker threads of the proxy.
    pub threads: usize,
    /// Reload when the rules file changes on disk.
    pub watch_rules: bool,
    /// Reload on SIGHUP (the CLI sets it; tests leave it off).
    pub sighup: bool,
    /// TTL of approximate holdings.
    pub approx_ttl: Duration,
    /// Threads of the routing pool (KV-exact parse, render, tokenize, keys, lookup), off the
    /// proxy threads. 0 routes on the proxy threads themselves (for comparison only: a large
    /// prompt then stalls every request on that thread).
    pub routing_threads: usize,
    /// Requests that may wait for the routing pool; more get `503 gateway_overloaded`.
    pub routing_queue: usize,
    /// Ticket nonces kept ready by the signer's idle-priority thread (`receipts::signer`);
    /// 0 (the default): no thread, deterministic RFC 8032 signing.
    pub nonce_pool: usize,
    /// Serve the VIP over TLS with this material (requiring client certificates when it names
    /// a client CA); `None`: plain HTTP. The admin plane has its own, [`Self::admin_tls`].
    pub tls: Option<tls::ServerTls>,
    /// Serve the admin plane over TLS with this material (requiring client certificates when
    /// it names a client CA); `None`: plain HTTP.
    pub admin_tls: Option<tls::ServerTls>,
    /// How the gateway trusts `https://` workers (a CA file, else the platform's roots) and the
    /// client certificate it shows them (mTLS).
    pub upstream_tls: tls::ClientTls,
    /// Cluster mode: share rules, registrations, keys and load with other replicas through
    /// Redis (docs/cluster.md); `None` (the default): one gateway with its rules file.
    pub cluster: Option<cluster::ClusterSettings>,
    /// Stored responses (the Responses API's `store` and `previous_response_id`): how much
    /// this gateway keeps ([`response_store::StoreLimits`]; `max_bytes` 0: none).
    pub responses: response_store::StoreLimits,
    /// Keep the stored responses across a restart in this file ([`response_file`]): read at
    /// the start, written when they changed every [`Self::response_save_interval`] and at
    /// shutdown. `None` (the default): they live in memory only.
    pub response_file: Option<PathBuf>,
    /// How often the stored responses are saved to [`Self::response_file`] when they changed.
    pub response_save_interval: Duration,
    /// Background responses run at once, at most ([`background`]); 0 refuses them.
    pub max_background: usize,
    /// The longest the admin plane's `GET /ready` waits, after the start, for the KV event
    /// snapshots of the healthy workers `kv_exact` services route to
    /// ([`data_plane::DataPlane::catching_up`]).
    pub catch_up_limit: Duration,
}

/// The admin plane's address when neither the command line nor the rules name one.
pub const DEFAULT_ADMIN_ADDR: SocketAddr =
    SocketAddr::new(std::net::IpAddr::V4(std::net::Ipv4Addr::LOCALHOST), 9000);

/// Default [`GatewayConfig::catch_up_limit`].
pub const DEFAULT_CATCH_UP_LIMIT: Duration = Duration::from_secs(30);

impl GatewayConfig {
    /// A configuration with defaults: ephemeral ports on 127.0.0.1, no token, no decision log,
    /// two proxy threads, file watch on, SIGHUP off.
    pub fn new(rules_path: impl Into<PathBuf>, key: KeyPair) -> GatewayConfig {
        GatewayConfig {
            rules_path: rules_path.into(),
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            admin: Some(SocketAddr::from(([127, 0, 0, 1], 0))),
            key,
            gateway_id: "gateway".into(),
            admin_token: None,
            decision_log: None,
            access_log: None,
            threads: 2,
            watch_rules: true,
            sighup: false,
            approx_ttl: DEFAULT_APPROX_TTL,
            catch_up_limit: DEFAULT_CATCH_UP_LIMIT,
            routing_threads: 2,
            routing_queue: 64,
            nonce_pool: 0,
            tls: None,
            admin_tls: None,
            upstream_tls: tls::ClientTls::default(),
            cluster: None,
            responses: response_store::StoreLimits::DEFAULT,
            response_file: None,
            response_save_interval: Duration::from_secs(30),
            max_background: background::DEFAULT_MAX_JOBS,
        }
    }
}

/// A gateway running in this process.
pub struct RunningGateway {
    /// The VIP (the unnamed listener).
    pub listen_addr: SocketAddr,
    /// The named listeners of the rules' `gateway.listeners`, as bound (a `:0` port resolved).
    pub listeners: BTreeMap<String, SocketAddr>,
    /// The admin plane.
    pub admin_addr: SocketAddr,
    /// The data plane (for tests and embedding: view, index, metrics).
    pub data: Arc<DataPlane>,
    /// The control plane (rules store, profiles, contract state).
    pub control: Arc<ControlPlane>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    server: Option<std::thread::JoinHandle<()>>,
    runtime: Option<tokio::runtime::Runtime>,
    _watcher: Option<notify::RecommendedWatcher>,
    /// Saves the stored responses to `--response-store-file` (stopped after the listeners).
    saver: Option<response_file::Saver>,
}

struct ChannelSignal {
    rx: Mutex<Option<tokio::sync::oneshot::Receiver<()>>>,
}

#[async_trait]
impl ShutdownSignalWatch for ChannelSignal {
    async fn recv(&self) -> ShutdownSignal {
        let rx = self.rx.lock().take();
        if let Some(rx) = rx {
            // A dropped sender also means: stop.
            let _ = rx.await;
        }
        ShutdownSignal::FastShutdown
    }
}

/// A port the kernel picked for a `:0` listen address, held until pingora listens on it.
///
/// pingora cannot report the port it bound for `:0`, so the gateway asks the kernel for one
/// first. The socket that got it stays bound, with `SO_REUSEADDR` and without `listen()`, until
/// the gateway's listeners accept: pingora (which also sets `SO_REUSEADDR`) can bind and listen
/// next to a socket that is not listening, while any other `bind(:0)` or outgoing connection in
/// the meantime gets another port. Dropping the listener and binding again later let a worker in
/// the same process take the port in between, and the readiness check then reached the worker.
struct PortReservation {
    addr: SocketAddr,
    _socket: Option<tokio::net::TcpSocket>,
}

fn reserve_port(addr: SocketAddr) -> Result<PortReservation, GatewayError> {
    if addr.port() != 0 {
        return Ok(PortReservation {
            addr,
            _socket: None,
        });
    }
    let err = |e: std::io::Error| GatewayError::Config {
        reason: format!("cannot bind {addr}: {e}"),
    };
    let socket = if addr.is_ipv4() {
        tokio::net::TcpSocket::new_v4()
    } else {
        tokio::net::TcpSocket::new_v6()
    }
    .map_err(err)?;
    socket.set_reuseaddr(true).map_err(err)?;
    socket.bind(addr).map_err(err)?;
    let addr = socket.local_addr().map_err(err)?;
    Ok(PortReservation {
        addr,
        _socket: Some(socket),
    })
}

/// Starts a gateway: loads and checks the rules, starts health checks and event subscriptions,
/// then the proxy and admin listeners on a pingora `Server` in its own thread. Returns once
/// both listeners accept connections.
pub fn spawn(config: GatewayConfig) -> Result<RunningGateway, GatewayError> {
    let cfg_err = |reason: String| GatewayError::Config { reason };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("kvgate-gw-bg")
        .enable_all()
        .build()
        .map_err(|e| cfg_err(format!("background runtime: {e}")))?;
    let store = RuleStore::open(&config.rules_path)
        .map_err(|e| cfg_err(format!("rules {}: {e}", config.rules_path.display())))?;
    let decisions = match &config.decision_log {
        Some(p) => Some(
            DecisionLog::open(
                p,
                // Synced by the log's background thread every 100 ms, never inside a request:
                // a line-count trigger syncs inside `append`, on a proxy thread, and put
                // 4.6 ms p99s on 1-connection GETs (`scripts/bench-proxy.sh`). On power loss
                // at most the last 100 ms of decisions are lost; on a crash, none.
                FsyncPolicy::Batched {
                    max_receipts: u32::MAX,
                    max_ms: 100,
                },
            )
            .map_err(|e| cfg_err(format!("decision log {}: {e}", p.display())))?,
        ),
        None => None,
    };
    // TLS material is read now: a bad file stops the start with its name.
    if let Some(t) = &config.tls {
        t.server_config()
            .map_err(|e| cfg_err(format!("VIP TLS: {e}")))?;
    }
    if let Some(t) = &config.admin_tls {
        t.server_config()
            .map_err(|e| cfg_err(format!("admin TLS: {e}")))?;
    }
    let upstream_client = config
        .upstream_tls
        .client_config()
        .map_err(|e| cfg_err(format!("upstream TLS: {e}")))?;
    let upstream_identity = match &config.upstream_tls.identity {
        Some(id) => {
            let (certs, key) = id
                .der()
                .map_err(|e| cfg_err(format!("upstream TLS: {e}")))?;
            Some(Arc::new(pingora::utils::tls::CertKey::new(certs, key)))
        }
        None => None,
    };
    let ca_file = match &config.upstream_tls.ca {
        Some(p) => Some(
            p.to_str()
                .ok_or_else(|| cfg_err(format!("upstream CA path {} is not UTF-8", p.display())))?
                .to_owned(),
        ),
        None => None,
    };
    let mut http = reqwest::Client::builder().pool_idle_timeout(Duration::from_secs(30));
    if let Some(c) = upstream_client {
        http = http.use_preconfigured_tls(c);
    }
    let http = http
        .build()
        .map_err(|e| cfg_err(format!("http client: {e}")))?;
    let mut connector_options = pingora::connectors::ConnectorOptions::new(0);
    connector_options.ca_file = ca_file.clone();
    let snapshot = store.snapshot();
    let empty =
        routing_rules::RuleSnapshot::build(Default::default(), routing_rules::RuleVersion(0))
            .map_err(|e| cfg_err(e.to_string()))?;
    let metrics = metrics::Metrics::new();
    let data = Arc::new(DataPlane {
        // Replaced by the real view (profiles loaded, contract checked) below.
        views: view::ViewCell::new(view::View::compile(
            Arc::new(empty),
            &Default::default(),
            None,
            &Default::default(),
        )?),
        index: PrefixIndex::new(IndexConfig {
            approximate_ttl: config.approx_ttl,
            ..IndexConfig::default()
        })
        .map_err(|e| cfg_err(format!("prefix index: {e}")))?,
        access: match &config.access_log {
            Some(target) => Some(
                access_log::AccessLog::open(target, metrics.access_log_dropped.clone())
                    .map_err(|e| cfg_err(format!("access log {target:?}: {e}")))?,
            ),
            None => None,
        },
        metrics,
        signer: receipts::PrecomputedSigner::new(config.key.clone(), config.nonce_pool)
            .map_err(|e| cfg_err(format!("ticket signer thread: {e}")))?,
        gateway_id: config.gateway_id.clone(),
        decisions,
        request_ids: data_plane::RequestIds::new(),
        limits: limits::RateLimits::default(),
        upstream_identity,
        connector: pingora::connectors::http::Connector::new(Some(connector_options)),
        http: http.clone(),
        shared_holdings: arc_swap::ArcSwapOption::empty(),
        claims: arc_swap::ArcSwapOption::empty(),
        holdings_seq: Default::default(),
        drain: drain::Drain::default(),
        catch_up: data_plane::CatchUp::new(config.catch_up_limit),
        responses: response_store::ResponseStore::new(config.responses),
        shared_responses: arc_swap::ArcSwapOption::empty(),
        background: background::BackgroundJobs::new(config.max_background),
    });
    // Stored responses of the last run, before any request can store new ones; what waited for
    // Redis then is handed to the cluster link once it starts.
    let mut waited = write_backlog::Waiting::default();
    let saved_changes = match &config.response_file {
        Some(path) if data.responses.enabled() => {
            let mut report = response_file::load(path, &data.responses, receipts::now_ms())
                .map_err(|e| cfg_err(format!("--response-store-file {}: {e}", path.display())))?;
            if let Some(why) = &report.ignored {
                tracing::warn!(path = %path.display(), "stored responses: file left alone: {why}; the next save replaces it");
            }
            tracing::info!(
                path = %path.display(),
                restored = report.restored,
                expired = report.expired,
                skipped = report.skipped,
                waiting_for_redis = report.waiting.len(),
                "stored responses read back"
            );
            if config.cluster.is_none() && !report.waiting.is_empty() {
                tracing::warn!(
                    waiting = report.waiting.len(),
                    "stored responses: the file keeps writes for Redis, and this gateway runs without --cluster: they are dropped (the turns themselves are kept)"
                );
                report.waiting = write_backlog::Waiting::default();
            }
            // Written back at once: a file the gateway cannot write is an error now, not a
            // warning every interval, and what was skipped is gone from it.
            response_file::save(
                path,
                &data.responses.snapshot(),
                &report.waiting,
                receipts::now_ms(),
            )
            .map_err(|e| {
                cfg_err(format!(
                    "--response-store-file {}: cannot be written: {e}",
                    path.display()
                ))
            })?;
            let digest = report.waiting.digest();
            waited = report.waiting;
            Some((data.responses.changes(), digest))
        }
        _ => None,
    };
    let control = Arc::new(ControlPlane::new(
        data.clone(),
        store,
        http,
        config.admin_token.clone(),
    ));
    // Cluster mode: the shared store's rules win over the file (an empty store is seeded from
    // it); registered workers join. Redis unreachable: start from the file, degraded.
    if let Some(cs) = &config.cluster {
        let link = Arc::new(
            cluster::ClusterLink::new(cs.clone(), &config.gateway_id, &config.key)
                .map_err(|e| cfg_err(e.to_string()))?,
        );
        control.set_cluster(link.clone());
        let joined = runtime.block_on(async {
            let store = link.connect().await?;
            let text = routing_rules::rules_to_toml(snapshot.rules()).map_err(|e| {
                ::cluster::ClusterError::Malformed {
                    what: "rules file",
                    detail: e.to_string(),
                }
            })?;
            let doc = store
                .seed_rules(&::cluster::RulesDoc::new(1, text), &config.gateway_id)
                .await?;
            let workers = store.workers().await?;
            Ok::<_, ::cluster::ClusterError>((doc, workers))
        });
        match joined {
            Ok((doc, workers)) => {
                let rules = routing_rules::rules_from_toml(&doc.text).map_err(|p| {
                    cfg_err(format!(
                        "the cluster's rules (version {}) do not parse: {}",
                        doc.version,
                        p.iter()
                            .map(|p| format!("{}: {}", p.path, p.message))
                            .collect::<Vec<_>>()
                            .join("; ")
                    ))
                })?;
                control
                    .store
                    .replace_versioned(rules, routing_rules::RuleVersion(doc.version), &|_| Ok(()))
                    .map_err(|e| cfg_err(format!("the cluster's rules: {e}")))?;
                runtime.block_on(control.set_registered(workers));
                link.loaded();
            }
            Err(e) => link.failed(&control, &e),
        }
    }
    // Start-up: every worker's profile is read (round-robin tickets carry its hash algorithm);
    // reachable kv_exact workers must agree with their profiles.
    let rules = control.effective(control.store.snapshot().rules());
    let ids: BTreeSet<_> = rules.workers.iter().map(|w| w.id.clone()).collect();
    let fetched = runtime.block_on(control.fetch_profiles(&rules, &ids));
    let problems = control.problems(&rules, &fetched);
    if !problems.is_empty() {
        return Err(GatewayError::Contract {
            reason: problems
                .iter()
                .map(|p| format!("{}: {}", p.path, p.message))
                .collect::<Vec<_>>()
                .join("; "),
        });
    }
    control.install_current(&fetched)?;
    // The listeners: the VIP, the rules' named ones, the admin plane. Bound once: a rules
    // change that moves them is refused (`ControlPlane::listener_problems`).
    let bound = control.bind_listeners();
    let named = named_listeners(bound.listeners(), config.listen)?;
    let admin = config
        .admin
        .or(bound.admin_addr())
        .unwrap_or(DEFAULT_ADMIN_ADDR);
    // Held until this function returns: see `PortReservation`.
    let listen_reservation = reserve_port(config.listen)?;
    let admin_reservation = reserve_port(admin)?;
    let named_reservations = named
        .iter()
        .map(|(name, addr)| Ok((name.clone(), reserve_port(*addr)?)))
        .collect::<Result<Vec<_>, GatewayError>>()?;
    let (listen_addr, admin_addr) = (listen_reservation.addr, admin_reservation.addr);
    let listeners: BTreeMap<String, SocketAddr> = named_reservations
        .iter()
        .map(|(n, r)| (n.clone(), r.addr))
        .collect();
    control.start_supervisor(runtime.handle().clone());
    if let Some(link) = control.cluster() {
        link.start(&control, runtime.handle());
        if !waited.is_empty() {
            data.responses
                .pending
                .restore(std::mem::take(&mut waited.changes));
            if let Some(shared) = data.shared_responses.load_full() {
                shared.restore_waiting(waited);
            }
        }
    }

    let watcher = if config.watch_rules {
        Some(watch_rules_file(
            &config.rules_path,
            &control,
            runtime.handle(),
        )?)
    } else {
        None
    };
    if config.sighup {
        let weak = Arc::downgrade(&control);
        runtime.spawn(async move {
            let Ok(mut hup) =
                tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup())
            else {
                return;
            };
            while hup.recv().await.is_some() {
                let Some(s) = weak.upgrade() else { return };
                match s.reload_from_file().await {
                    Ok(o) => tracing::info!(version = o.version().0, "SIGHUP: rules reloaded"),
                    Err(e) => tracing::warn!(error = %e, "SIGHUP: rules reload refused"),
                }
            }
        });
    }

    let mut conf = ServerConf {
        threads: config.threads.max(1),
        grace_period_seconds: Some(0),
        graceful_shutdown_timeout_seconds: Some(0),
        ..ServerConf::default()
    };
    conf.upstream_keepalive_pool_size = 256;
    conf.ca_file = ca_file;
    let routing = match config.routing_threads {
        0 => None,
        n => Some(Arc::new(
            pool::BlockingPool::new("kvgate-routing", n, config.routing_queue)
                .map_err(|e| cfg_err(format!("routing pool: {e}")))?,
        )),
    };
    let mut server = Server::new_with_opt_and_conf(None, conf);
    server.bootstrap();
    // One proxy service per listener (each knows its name), all on one data plane and one
    // routing pool; every VIP listener serves TLS when the gateway has TLS material.
    let vip_listeners = std::iter::once((None, listen_addr))
        .chain(listeners.iter().map(|(n, a)| (Some(n.as_str()), *a)));
    for (name, addr) in vip_listeners {
        let app = proxy::Proxy::new(data.clone(), routing.clone());
        let (app, service_name) = match name {
            Some(n) => (app.for_listener(n), format!("kvgate-proxy-{n}")),
            None => (app, "kvgate-proxy".to_owned()),
        };
        let mut proxy =
            pingora::proxy::http_proxy_service_with_name(&server.configuration, app, &service_name);
        match &config.tls {
            Some(t) => {
                proxy.add_tls_with_settings(&addr.to_string(), None, listener_tls(t, "VIP")?)
            }
            None => proxy.add_tcp(&addr.to_string()),
        }
        server.add_service(proxy);
    }
    let mut admin = pingora::services::listening::Service::new(
        "kvgate-admin".to_owned(),
        admin::Admin::new(control.clone()),
    );
    match &config.admin_tls {
        Some(t) => {
            admin.add_tls_with_settings(&admin_addr.to_string(), None, listener_tls(t, "admin")?)
        }
        None => admin.add_tcp(&admin_addr.to_string()),
    }
    server.add_service(admin);
    let mut phases = server.watch_execution_phase();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel();
    let signal = ChannelSignal {
        rx: Mutex::new(Some(stop_rx)),
    };
    let thread = std::thread::Builder::new()
        .name("kvgate-gw-server".into())
        .spawn(move || {
            server.run(RunArgs {
                shutdown_signal: Box::new(signal),
            })
        })
        .map_err(|e| cfg_err(format!("server thread: {e}")))?;
    let mut running = RunningGateway {
        listen_addr,
        listeners: listeners.clone(),
        admin_addr,
        data,
        control,
        stop: Some(stop_tx),
        server: Some(thread),
        runtime: Some(runtime),
        _watcher: watcher,
        saver: None,
    };
    if let (Some(path), Some(saved), Some(rt)) =
        (&config.response_file, saved_changes, &running.runtime)
    {
        running.saver = Some(response_file::Saver::start(
            rt.handle(),
            running.data.clone(),
            path.clone(),
            config.response_save_interval,
            saved,
        ));
    }
    // Wait for Running, then until both listeners accept.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        match phases.try_recv() {
            Ok(ExecutionPhase::Running) => break,
            Ok(_) => continue,
            Err(tokio::sync::broadcast::error::TryRecvError::Empty) => {}
            Err(tokio::sync::broadcast::error::TryRecvError::Lagged(_)) => continue,
            Err(tokio::sync::broadcast::error::TryRecvError::Closed) => {
                running.shutdown();
                return Err(cfg_err("the pingora server stopped during start-up".into()));
            }
        }
        if Instant::now() > deadline {
            running.shutdown();
            return Err(cfg_err("the pingora server did not start in 20 s".into()));
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    for addr in [listen_addr, admin_addr]
        .into_iter()
        .chain(listeners.values().copied())
    {
        while TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_err() {
            if Instant::now() > deadline {
                running.shutdown();
                return Err(cfg_err(format!("{addr} does not accept connections")));
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }
    drop((listen_reservation, admin_reservation, named_reservations));
    Ok(running)
}

/// The pingora TLS settings of a listener (the certificate chain and key, and the client CA
/// when clients must show a certificate); `what` names it in errors.
fn listener_tls(
    t: &tls::ServerTls,
    what: &str,
) -> Result<pingora::listeners::tls::TlsSettings, GatewayError> {
    let cfg_err = |reason: String| GatewayError::Config { reason };
    let path = |p: &std::path::Path| {
        p.to_str()
            .map(str::to_owned)
            .ok_or_else(|| cfg_err(format!("TLS path {} is not UTF-8", p.display())))
    };
    let mut settings =
        pingora::listeners::tls::TlsSettings::intermediate(&path(&t.cert)?, &path(&t.key)?)
            .map_err(|e| cfg_err(format!("{what} TLS: {e}")))?;
    if let Some(ca) = &t.client_ca {
        settings.set_client_cert_verifier(
            tls::client_verifier(ca).map_err(|e| cfg_err(format!("{what} TLS: {e}")))?,
        );
    }
    Ok(settings)
}

/// The rules' named listeners as (name, address), refused when two would take the same port
/// or one the VIP's (`vip`); the validation of the rules already checked names and syntax.
fn named_listeners(
    specs: &[routing_rules::schema::ListenerSpec],
    vip: SocketAddr,
) -> Result<Vec<(String, SocketAddr)>, GatewayError> {
    let mut out: Vec<(String, SocketAddr)> = Vec::new();
    for l in specs {
        let addr: SocketAddr = l.addr.parse().map_err(|_| GatewayError::Config {
            reason: format!("gateway.listeners: {:?} is not ip:port", l.addr),
        })?;
        // Same port, and the same IP or either one the unspecified address (which takes the
        // port on every interface).
        let overlaps = |a: SocketAddr, b: SocketAddr| {
            a.port() != 0
                && a.port() == b.port()
                && (a.ip() == b.ip() || a.ip().is_unspecified() || b.ip().is_unspecified())
        };
        let clash = if overlaps(addr, vip) {
            Some("the VIP (--listen)".to_owned())
        } else {
            out.iter()
                .find(|(_, a)| overlaps(*a, addr))
                .map(|(n, _)| format!("listener {n:?}"))
        };
        if let Some(other) = clash {
            return Err(GatewayError::Config {
                reason: format!(
                    "gateway.listeners: {:?} has the address {addr} of {other}",
                    l.name.0
                ),
            });
        }
        out.push((l.name.0.clone(), addr));
    }
    Ok(out)
}

/// Watches the rules file's directory and reloads when the file changes (debounced 100 ms).
fn watch_rules_file(
    path: &std::path::Path,
    control: &Arc<ControlPlane>,
    handle: &tokio::runtime::Handle,
) -> Result<notify::RecommendedWatcher, GatewayError> {
    use notify::Watcher;
    let file = std::fs::canonicalize(path).map_err(|e| GatewayError::Config {
        reason: format!("rules {}: {e}", path.display()),
    })?;
    let dir = file
        .parent()
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("."));
    let name = file.file_name().map(|n| n.to_os_string());
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<()>();
    let mut watcher = notify::recommended_watcher(move |res: notify::Result<notify::Event>| {
        if let Ok(ev) = res {
            let ours = ev
                .paths
                .iter()
                .any(|p| p.file_name().map(|n| n.to_os_string()) == name);
            let modifying = !matches!(ev.kind, notify::EventKind::Access(_));
            if ours && modifying {
                let _ = tx.send(());
            }
        }
    })
    .map_err(|e| GatewayError::Config {
        reason: format!("file watch: {e}"),
    })?;
    watcher
        .watch(&dir, notify::RecursiveMode::NonRecursive)
        .map_err(|e| GatewayError::Config {
            reason: format!("file watch {}: {e}", dir.display()),
        })?;
    let weak = Arc::downgrade(control);
    handle.spawn(async move {
        while rx.recv().await.is_some() {
            // Debounce: editors write in several steps.
            tokio::time::sleep(Duration::from_millis(100)).await;
            while rx.try_recv().is_ok() {}
            let Some(s) = weak.upgrade() else { return };
            match s.reload_from_file().await {
                Ok(o) => tracing::info!(version = o.version().0, "rules file changed: reloaded"),
                Err(e) => tracing::warn!(error = %e, "rules file changed: reload refused"),
            }
        }
    });
    Ok(watcher)
}

impl RunningGateway {
    /// Stops the proxy (no grace period), the background tasks and the runtime; waits for them.
    pub fn shutdown(&mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        if let Some(t) = self.server.take() {
            let _ = t.join();
        }
        // The proxy's runtime dropped the background responses still running: say so.
        self.data.background.abandon(&self.data);
        if let (Some(link), Some(rt)) = (self.control.cluster(), &self.runtime) {
            link.shutdown(rt.handle(), &self.data);
        }
        // The listeners are closed: the last turns are stored; save them.
        if let (Some(saver), Some(rt)) = (self.saver.take(), &self.runtime) {
            rt.block_on(saver.stop());
        }
        let handles = self.control.stop_supervisor();
        self._watcher = None;
        if let Some(rt) = self.runtime.take() {
            rt.block_on(async {
                for h in handles {
                    let _ = h.await;
                }
            });
            rt.shutdown_timeout(Duration::from_secs(2));
        }
    }

    /// Drains before a stop: the admin plane's `GET /ready` answers 503 `draining` (so that a
    /// VIP's health check takes this replica out), and client requests — in flight and any
    /// still sent — are proxied until none is in flight once `grace` has passed, or until
    /// `timeout` (`drain::Drain::run`). [`RunningGateway::shutdown`] follows.
    pub async fn drain(&self, grace: Duration, timeout: Duration) -> drain::DrainReport {
        tracing::info!(
            in_flight = self.data.drain.in_flight(),
            "draining: /ready answers 503, requests in flight finish"
        );
        self.data.drain.run(grace, timeout).await
    }

    /// Blocks until the server thread ends (the CLI: it ends on SIGINT/SIGTERM handling).
    pub fn wait(mut self) {
        if let Some(t) = self.server.take() {
            let _ = t.join();
        }
        self.shutdown();
    }
}

impl Drop for RunningGateway {
    fn drop(&mut self) {
        self.shutdown();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reserved_port_stays_taken_until_the_reservation_drops() {
        let reservation = reserve_port("127.0.0.1:0".parse().unwrap()).unwrap();
        let addr = reservation.addr;
        assert_ne!(addr.port(), 0);
        // A socket without SO_REUSEADDR (as the kernel treats every `bind(:0)` search) cannot
        // have it while it is held ...
        let other = tokio::net::TcpSocket::new_v4().unwrap();
        let err = other.bind(addr).unwrap_err();
        assert_eq!(err.kind(), std::io::ErrorKind::AddrInUse);
        // ... while a listener that sets SO_REUSEADDR, as pingora's does, binds and listens.
        let pingora_like = tokio::net::TcpSocket::new_v4().unwrap();
        pingora_like.set_reuseaddr(true).unwrap();
        pingora_like.bind(addr).unwrap();
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let _listening = rt.block_on(async { pingora_like.listen(16) }).unwrap();
        TcpStream::connect_timeout(&addr, Duration::from_secs(2)).unwrap();
        drop(reservation);
        // An explicit port is used as given, with nothing held.
        let fixed = reserve_port(addr).unwrap();
        assert_eq!(fixed.addr, addr);
        assert!(fixed._socket.is_none());
    }
}
