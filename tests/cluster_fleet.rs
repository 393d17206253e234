//! Cluster mode end to end, with a real `redis-server` (started and stopped by the test on an
//! ephemeral port): three gateway replicas, each with its own key, id and decision log, in
//! front of four simulated workers — three listed in the rules, one that registers itself later.
//! Checked over real HTTP:
//! - a rules change through any replica's admin API is served by all three; p99 over 50
//!   changes is printed and must be under 1 s; a stale compare-and-set is refused (conflict);
//! - the late worker gets traffic through every replica (it trusts their keys from Redis);
//! - one replica's in-flight load is seen by the others (leased load tables);
//! - a replica stopped mid-run, then Redis killed and restarted (empty) mid-run: no request
//!   through the surviving replicas fails; they report `degraded` meanwhile, refuse rules
//!   changes with 503, and resync after (rules re-seeded at their version, registration back);
//! - the audit over all three decision logs and the four receipt logs is clean.

mod gateway_support;

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use engine::sim::SimConfig;
use gateway::{GatewayConfig, RunningGateway};
use gateway_support::{model_path, Reply};
use prompt_profile::PromptProfile;
use receipts::{KeyPair, KeyRing};
use serde_json::json;
use worker::{EngineChoice, RunningWorker, TicketPolicy, WorkerConfig};

const TOKEN: &str = "cluster-admin";

struct Redis {
    child: Option<Child>,
    port: u16,
    _dir: tempfile::TempDir,
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

impl Redis {
    fn start(port: u16, dir: tempfile::TempDir) -> Redis {
        let child = Command::new("redis-server")
            .args([
                "--port",
                &port.to_string(),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--protected-mode",
                "no",
            ])
            .current_dir(dir.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server is missing: scripts/setup.sh installs it (apt redis-server)");
        let r = Redis {
            child: Some(child),
            port,
            _dir: dir,
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Ok(mut s) = TcpStream::connect(("127.0.0.1", port)) {
                use std::io::{Read, Write};
                let mut buf = [0u8; 16];
                if s.write_all(b"PING\r\n").is_ok() && s.read(&mut buf).is_ok_and(|n| n > 0) {
                    break;
                }
            }
            assert!(Instant::now() < deadline, "redis-server did not start");
            std::thread::sleep(Duration::from_millis(20));
        }
        r
    }

    fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for Redis {
    fn drop(&mut self) {
        self.kill();
    }
}

struct Cluster {
    rt: tokio::runtime::Runtime,
    dir: tempfile::TempDir,
    profile: PromptProfile,
    gateway_keys: Vec<KeyPair>,
    worker_keys: Vec<KeyPair>,
    workers: Vec<Option<RunningWorker>>,
    gateways: Vec<Option<RunningGateway>>,
    http: reqwest::Client,
    redis: Redis,
}

impl Cluster {
    /// A fresh `redis-server`, keys for `gateways` replicas and `workers` workers, and the three
    /// static simulated workers (w1..w3) started; no replica started yet.
    fn new(gateways: usize, workers: usize) -> Cluster {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let redis = Redis::start(free_port(), tempfile::tempdir().unwrap());
        let mut c = Cluster {
            rt,
            profile: PromptProfile::from_gguf(model_path()).unwrap(),
            dir: tempfile::tempdir().unwrap(),
            gateway_keys: (0..gateways).map(|_| KeyPair::generate()).collect(),
            worker_keys: (0..workers).map(|_| KeyPair::generate()).collect(),
            workers: Vec::new(),
            gateways: (0..gateways).map(|_| None).collect(),
            http: reqwest::Client::new(),
            redis,
        };
        for i in 0..3 {
            let w = c.start_worker(i, false);
            c.workers.push(Some(w));
        }
        c
    }

    fn start_worker(&self, i: usize, register: bool) -> RunningWorker {
        let id = format!("w{}", i + 1);
        let mut sim = SimConfig::instant(16, 4096);
        sim.vocab_size = self.profile.vocab_size();
        // ~3 ms per decoded token: a 300-token stream stays in flight for about a second.
        sim.decode_us_base = 3_000;
        let mut cfg = WorkerConfig::new(
            model_path(),
            EngineChoice::Sim(sim),
            self.worker_keys[i].clone(),
            self.dir.path().join(format!("receipts-{id}.jsonl")),
            id.clone(),
        );
        cfg.profile = Some(self.profile.clone());
        cfg.settings.ticket_policy = TicketPolicy::Require;
        if !register {
            let mut ring = KeyRing::new();
            for (g, k) in self.gateway_keys.iter().enumerate() {
                ring.insert(format!("gw-{}", g + 1), k.public().clone());
            }
            cfg.gateway_keys = ring;
        }
        self.rt.block_on(async {
            let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            if register {
                cfg.registration = Some(worker::registration::Registration {
                    url: self.redis.url(),
                    prefix: "kvgate".into(),
                    advertise_url: format!("http://{}", l.local_addr().unwrap()),
                    labels: [("tier".to_string(), "sim".to_string())].into(),
                    lease: Duration::from_millis(1500),
                    kind: None,
                });
            }
            let w = worker::spawn(cfg, l).await.unwrap();
            w.wait_ready(Duration::from_secs(30)).await.unwrap();
            w
        })
    }

    fn rules(&self) -> String {
        let p = self.workers[0].as_ref().unwrap().profile();
        let mut s = String::from("[gateway]\nhealth_interval_ms = 100\n");
        for i in 0..3 {
            s.push_str(&format!(
                "\n[[workers]]\nid = \"w{}\"\nurl = \"http://{}\"\nlabels = {{ tier = \"sim\" }}\n",
                i + 1,
                self.workers[i].as_ref().unwrap().addr()
            ));
        }
        s.push_str(&format!(
            r#"
[[pools]]
id = "all"
selector = {{ tier = "sim" }}

[[profiles]]
id = "smol"
model_id = "{}"
revision = "{}"
source = {{ gguf = "{}" }}
template_sha256 = "{}"
tokenizer_sha256 = "{}"
block_size = 16
context_limit = {}

[[services]]
name = "rr"
pool = "all"
rule = {{ type = "round_robin" }}
[services.match]
models = ["rr"]

[[services]]
name = "exact"
pool = "all"
rule = {{ type = "kv_exact", profile = "smol" }}
[services.match]
models = ["smol"]
"#,
            p.model_id,
            p.revision,
            model_path().display(),
            p.template_sha256,
            p.tokenizer_sha256,
            p.context_limit
        ));
        s
    }

    fn start_gateway(&mut self, g: usize) {
        self.start_gateway_with(g, |_| {});
    }

    /// Starts replica `g` with `f` applied to its configuration.
    fn start_gateway_with(&mut self, g: usize, f: impl FnOnce(&mut GatewayConfig)) {
        let path = self.dir.path().join("rules.toml");
        if !path.exists() {
            std::fs::write(&path, self.rules()).unwrap();
        }
        let mut cfg = GatewayConfig::new(&path, self.gateway_keys[g].clone());
        cfg.gateway_id = format!("gw-{}", g + 1);
        cfg.admin_token = Some(TOKEN.into());
        cfg.watch_rules = false;
        cfg.decision_log = Some(self.decisions(g));
        let mut c = gateway::cluster::ClusterSettings::new(self.redis.url());
        c.lease = Duration::from_millis(1000);
        cfg.cluster = Some(c);
        f(&mut cfg);
        self.gateways[g] = Some(gateway::spawn(cfg).unwrap());
    }

    fn decisions(&self, g: usize) -> PathBuf {
        self.dir
            .path()
            .join(format!("decisions-gw-{}.jsonl", g + 1))
    }

    fn gw(&self, g: usize) -> &RunningGateway {
        self.gateways[g].as_ref().unwrap()
    }

    fn version(&self, g: usize) -> u64 {
        self.gw(g).data.views.load().version()
    }

    /// A request to `addr`, with the admin token or none.
    fn request(
        &self,
        addr: SocketAddr,
        admin: bool,
        method: reqwest::Method,
        path: &str,
        body: Option<serde_json::Value>,
    ) -> Reply {
        self.rt.block_on(async {
            let mut r = self.http.request(method, format!("http://{addr}{path}"));
            if admin {
                r = r.bearer_auth(TOKEN);
            }
            if let Some(b) = body {
                r = r.json(&b);
            }
            Reply::read(r.send().await.unwrap()).await
        })
    }

    /// A request to replica `g`'s admin plane.
    fn admin(
        &self,
        g: usize,
        method: reqwest::Method,
        path: &str,
        body: Option<serde_json::Value>,
    ) -> Reply {
        self.request(self.gw(g).admin_addr, true, method, path, body)
    }

    fn chat(&self, g: usize, model: &str, text: &str, max_tokens: u64) -> Reply {
        let url = format!("http://{}/v1/chat/completions", self.gw(g).listen_addr);
        let body = json!({"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens});
        self.rt.block_on(async {
            Reply::read(self.http.post(url).json(&body).send().await.unwrap()).await
        })
    }

    /// A client request through replica `g`'s VIP.
    fn call(
        &self,
        g: usize,
        method: reqwest::Method,
        path: &str,
        body: Option<serde_json::Value>,
    ) -> Reply {
        self.request(self.gw(g).listen_addr, false, method, path, body)
    }

    fn wait_for(&self, what: &str, timeout: Duration, mut f: impl FnMut() -> bool) {
        let deadline = Instant::now() + timeout;
        while !f() {
            assert!(Instant::now() < deadline, "timed out waiting for {what}");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Stops the in-process replicas and every worker, then audits every replica's decision log
    /// against every worker's receipt log.
    fn stop_and_audit(&mut self) -> receipts::AuditReport {
        for gw in self.gateways.iter_mut() {
            if let Some(mut gw) = gw.take() {
                gw.shutdown();
            }
        }
        for w in self.workers.iter_mut() {
            if let Some(w) = w.take() {
                self.rt.block_on(w.shutdown());
            }
        }
        let mut ring = KeyRing::new();
        for (g, k) in self.gateway_keys.iter().enumerate() {
            ring.insert(format!("gw-{}", g + 1), k.public().clone());
        }
        for (i, k) in self.worker_keys.iter().enumerate() {
            ring.insert(format!("w{}", i + 1), k.public().clone());
        }
        let decisions: Vec<PathBuf> = (0..self.gateway_keys.len())
            .map(|g| self.decisions(g))
            .collect();
        let logs: Vec<PathBuf> = (1..=self.worker_keys.len())
            .map(|i| self.dir.path().join(format!("receipts-w{i}.jsonl")))
            .collect();
        receipts::audit_replicas(&decisions, &logs, &ring, receipts::AuditOptions::default())
            .unwrap()
    }

    fn routable(&self, g: usize, id: &str) -> bool {
        let v = self.gw(g).data.views.load();
        v.workers
            .get(&prefix_index::WorkerId(id.into()))
            .is_some_and(|e| e.healthy)
            && v.services.iter().all(|s| s.pool.iter().any(|w| w.0 == id))
    }
}

/// A fresh `redis-server` and a store on it (keys under `prefix`), with a one-thread runtime.
fn fresh_store(prefix: &str) -> (tokio::runtime::Runtime, Redis, cluster::Store) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let redis = Redis::start(free_port(), tempfile::tempdir().unwrap());
    let store = rt
        .block_on(cluster::Store::connect(&redis.url(), prefix))
        .unwrap();
    (rt, redis, store)
}

/// The text of each item of a conversation's item page (a string content as it is, any other
/// as JSON).
fn item_texts(r: &Reply) -> Vec<String> {
    r.json()["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| {
            i["content"]
                .as_str()
                .map_or_else(|| i["content"].to_string(), str::to_owned)
        })
        .collect()
}

fn percentile(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[((v.len() as f64 - 1.0) * p).round() as usize]
}

#[test]
fn three_replicas_share_rules_workers_keys_and_load_through_redis() {
    let mut c = Cluster::new(3, 4);
    let redis_port = c.redis.port;
    for g in 0..3 {
        c.start_gateway(g);
    }
    for g in 0..3 {
        for w in ["w1", "w2", "w3"] {
            c.wait_for("static workers routable", Duration::from_secs(10), || {
                c.routable(g, w)
            });
        }
    }
    let v0 = c.version(0);
    assert!((0..3).all(|g| c.version(g) == v0), "one version everywhere");
    let cl = c
        .admin(1, reqwest::Method::GET, "/admin/cluster", None)
        .json();
    assert_eq!(cl["mode"], "cluster");
    assert_eq!(cl["state"], "ok", "{cl}");

    // The replicas stagger their rotations: each knows its own place among the three.
    let mut places: Vec<u64> = (0..3)
        .map(|g| {
            let mut place = None;
            c.wait_for("a place among 3 replicas", Duration::from_secs(5), || {
                let cl = c
                    .admin(g, reqwest::Method::GET, "/admin/cluster", None)
                    .json();
                let ok = cl["place"]["of"] == 3;
                place = cl["place"]["index"].as_u64();
                ok
            });
            place.unwrap()
        })
        .collect();
    places.sort_unstable();
    assert_eq!(places, [0, 1, 2]);

    // A KV-exact decision on one replica is counted on its worker by the others at once (the
    // load it reserved, published with its holding), not only at the next load-table sync.
    let url = format!("http://{}/v1/chat/completions", c.gw(0).listen_addr);
    let body = json!({"model": "smol", "messages": [{"role": "user",
        "content": "a reservation the other replicas must see"}], "max_tokens": 300, "temperature": 0});
    let sent = Instant::now();
    let pending = c.rt.spawn(c.http.post(url).json(&body).send());
    let mut seen = [None::<Duration>; 2];
    while seen.iter().any(Option::is_none) && sent.elapsed() < Duration::from_secs(5) {
        for (k, g) in [1usize, 2].into_iter().enumerate() {
            let v = c.gw(g).data.views.load();
            if seen[k].is_none()
                && v.workers
                    .values()
                    .any(|e| e.runtime.remote_reserved_now().1 >= 300)
            {
                seen[k] = Some(sent.elapsed());
            }
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    let r = c.rt.block_on(pending).unwrap().unwrap();
    assert_eq!(r.status(), 200);
    println!("a decision's reservation seen by the other replicas after {seen:?} (request sent to first seen)");
    assert!(
        seen.iter().all(Option::is_some),
        "replicas 2 and 3 never counted replica 1's reservation: {seen:?}"
    );

    // 50 rules changes, each through one replica's admin API, served by all three.
    let mut lat = Vec::new();
    for n in 0..50u64 {
        let g = (n % 3) as usize;
        let body = json!({"name": "rr", "pool": "all", "rule": {"type": "round_robin"},
            "match": {"models": ["rr"]}, "max_body_bytes": 1_000_000 + n});
        let t = Instant::now();
        let r = c.admin(g, reqwest::Method::PUT, "/admin/services/rr", Some(body));
        assert_eq!(r.status, 200, "{}", r.text());
        let v = r.json()["version"].as_u64().unwrap();
        c.wait_for("a change on every replica", Duration::from_secs(5), || {
            (0..3).all(|g| c.version(g) == v)
        });
        lat.push(t.elapsed().as_secs_f64());
    }
    let p50 = percentile(&mut lat, 0.5);
    let p99 = percentile(&mut lat, 0.99);
    println!(
        "cluster: rules change served by all 3 replicas: p50 {:.1} ms, p99 {:.1} ms over 50 changes",
        p50 * 1e3,
        p99 * 1e3
    );
    assert!(p99 < 1.0, "p99 {p99} s");
    // A stale compare-and-set loses.
    let store =
        c.rt.block_on(cluster::Store::connect(&c.redis.url(), "kvgate"))
            .unwrap();
    let doc = c.rt.block_on(store.rules()).unwrap().unwrap();
    assert_eq!(doc.version, c.version(0));
    match c
        .rt
        .block_on(store.put_rules(doc.version - 1, doc.text.clone(), "test"))
    {
        Err(cluster::ClusterError::Conflict { current }) => assert_eq!(current, doc.version),
        other => panic!("expected a conflict, got {other:?}"),
    }

    // Leases: a record not renewed disappears from every listing (a crashed worker or replica
    // leaves no registration, key or load behind).
    let ghost = cluster::WorkerRecord {
        id: "ghost".into(),
        url: "http://127.0.0.1:9".into(),
        key_id: "00".into(),
        public_key_hex: "00".into(),
        profile_digest: String::new(),
        labels: Default::default(),
        kind: None,
    };
    c.rt.block_on(store.announce_worker(&ghost, Duration::from_millis(150)))
        .unwrap();
    let load = std::collections::BTreeMap::from([(
        "w1".to_string(),
        cluster::Load {
            in_flight: 99,
            active_tokens: 9999,
            prefill_tokens: 9000,
        },
    )]);
    c.rt.block_on(async {
        store
            .announce_gateway(
                &cluster::GatewayRecord {
                    gateway_id: "gw-ghost".into(),
                    key_id: "00".into(),
                    public_key_hex: "00".into(),
                },
                Duration::from_millis(150),
            )
            .await
            .unwrap();
        store
            .put_load("gw-ghost", &load, 7, Duration::from_millis(150))
            .await
            .unwrap();
    });
    assert!(c
        .rt
        .block_on(store.workers())
        .unwrap()
        .iter()
        .any(|w| w.id == "ghost"));
    let fleet = c.rt.block_on(store.fleet_load("gw-1")).unwrap();
    assert_eq!(fleet.load["w1"].in_flight, 99);
    // The table names the last published decision it covers.
    assert_eq!(fleet.covered.get("gw-ghost"), Some(&7));
    std::thread::sleep(Duration::from_millis(300));
    assert!(!c
        .rt
        .block_on(store.workers())
        .unwrap()
        .iter()
        .any(|w| w.id == "ghost"));
    assert!(!c
        .rt
        .block_on(store.gateways())
        .unwrap()
        .iter()
        .any(|g| g.gateway_id == "gw-ghost"));
    assert!(c
        .rt
        .block_on(store.fleet_load("gw-1"))
        .unwrap()
        .load
        .get("w1")
        .is_none_or(|l| l.in_flight < 99));

    // A worker that registers later gets traffic through every replica.
    let w4 = c.start_worker(3, true);
    c.workers.push(Some(w4));
    for g in 0..3 {
        c.wait_for("w4 routable everywhere", Duration::from_secs(10), || {
            c.routable(g, "w4")
        });
    }
    for g in 0..3 {
        let mut served = false;
        for n in 0..8 {
            let r = c.chat(g, "rr", &format!("to w4 via {g}, {n}"), 2);
            assert_eq!(r.status, 200, "{}", r.text());
            served |= r.worker() == "w4";
        }
        assert!(served, "replica {g} never routed to the registered worker");
    }
    // A cordon through one replica's admin API is a rules change: every replica takes the
    // registered worker out of new routing, and back when another replica lifts it.
    let cordoned =
        |g: usize| c.gw(g).data.views.load().workers[&prefix_index::WorkerId("w4".into())].cordoned;
    let t = Instant::now();
    let r = c.admin(1, reqwest::Method::POST, "/admin/workers/w4/cordon", None);
    assert_eq!(r.status, 200, "{}", r.text());
    c.wait_for("w4 cordoned everywhere", Duration::from_secs(1), || {
        (0..3).all(cordoned)
    });
    println!("cordon seen by all 3 replicas after {:?}", t.elapsed());
    for g in 0..3 {
        for n in 0..6 {
            let r = c.chat(g, "rr", &format!("not to w4 via {g}, {n}"), 2);
            assert_eq!(r.status, 200, "{}", r.text());
            assert_ne!(r.worker(), "w4", "replica {g} routed to a cordoned worker");
        }
    }
    let r = c.admin(2, reqwest::Method::POST, "/admin/workers/w4/uncordon", None);
    assert_eq!(r.status, 200, "{}", r.text());
    c.wait_for("w4 uncordoned everywhere", Duration::from_secs(1), || {
        !(0..3).any(cordoned)
    });

    // Fleet-wide load: long streams through replica 0 show up in replica 2's view of the fleet.
    let url0 = format!("http://{}/v1/chat/completions", c.gw(0).listen_addr);
    let streams: Vec<_> = (0..4)
        .map(|n| {
            let http = c.http.clone();
            let url = url0.clone();
            c.rt.spawn(async move {
                let body = json!({"model": "rr", "stream": true, "max_tokens": 300, "temperature": 0,
                    "messages": [{"role": "user", "content": format!("long {n}")}]});
                let r = http.post(url).json(&body).send().await.unwrap();
                r.bytes().await.map(|b| b.len()).unwrap_or(0)
            })
        })
        .collect();
    c.wait_for(
        "replica 2 sees replica 0's in-flight load",
        Duration::from_secs(5),
        || {
            let v = c.gw(2).data.views.load();
            v.workers
                .values()
                .map(|e| e.runtime.remote_in_flight.load(Ordering::Relaxed))
                .sum::<u64>()
                >= 2
        },
    );
    for s in streams {
        assert!(c.rt.block_on(s).unwrap() > 0);
    }

    // Traffic through replicas 1 and 2 while replica 0 stops and Redis dies and comes back.
    let stop = Arc::new(AtomicBool::new(false));
    let ok = Arc::new(AtomicU64::new(0));
    let failed = Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    let vips: Vec<SocketAddr> = (1..3).map(|g| c.gw(g).listen_addr).collect();
    let load = {
        let (stop, ok, failed, http) = (stop.clone(), ok.clone(), failed.clone(), c.http.clone());
        c.rt.spawn(async move {
            let mut n = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let vip = vips[(n % 2) as usize];
                let model = if n.is_multiple_of(3) { "smol" } else { "rr" };
                let body = json!({"model": model, "max_tokens": 2,
                    "messages": [{"role": "user", "content": format!("steady {n}")}]});
                match http
                    .post(format!("http://{vip}/v1/chat/completions"))
                    .json(&body)
                    .send()
                    .await
                {
                    Ok(r) if r.status().is_success() => {
                        ok.fetch_add(1, Ordering::Relaxed);
                    }
                    Ok(r) => failed
                        .lock()
                        .unwrap()
                        .push(format!("{vip}: {}", r.status())),
                    Err(e) => failed.lock().unwrap().push(format!("{vip}: {e}")),
                }
                n += 1;
            }
        })
    };
    std::thread::sleep(Duration::from_millis(300));
    if let Some(mut g0) = c.gateways[0].take() {
        g0.shutdown();
    }
    std::thread::sleep(Duration::from_millis(300));
    c.redis.kill();
    c.wait_for("replicas degraded", Duration::from_secs(5), || {
        c.admin(1, reqwest::Method::GET, "/admin/cluster", None)
            .json()["state"]
            == "degraded"
    });
    let r = c.admin(
        2,
        reqwest::Method::PUT,
        "/admin/services/rr",
        Some(
            json!({"name": "rr", "pool": "all", "rule": {"type": "round_robin"},
            "match": {"models": ["rr"]}, "max_body_bytes": 7}),
        ),
    );
    assert_eq!(r.status, 503, "{}", r.text());
    assert_eq!(r.json()["error"]["code"], "cluster_unavailable");
    std::thread::sleep(Duration::from_millis(500));
    let version_before = c.version(1);
    c.redis = Redis::start(redis_port, tempfile::tempdir().unwrap());
    c.wait_for("replicas resynced", Duration::from_secs(10), || {
        (1..3).all(|g| {
            c.admin(g, reqwest::Method::GET, "/admin/cluster", None)
                .json()["state"]
                == "ok"
        })
    });
    let doc = c.rt.block_on(async {
        let s = cluster::Store::connect(&c.redis.url(), "kvgate")
            .await
            .unwrap();
        let regs = s.workers().await.unwrap();
        (s.rules().await.unwrap(), regs)
    });
    assert_eq!(
        doc.0.map(|d| d.version),
        Some(version_before),
        "the empty store is re-seeded at the version in force"
    );
    c.wait_for("w4 registered again", Duration::from_secs(5), || {
        c.rt.block_on(async {
            let s = cluster::Store::connect(&c.redis.url(), "kvgate")
                .await
                .unwrap();
            s.workers().await.unwrap().iter().any(|w| w.id == "w4")
        })
    });
    std::thread::sleep(Duration::from_millis(300));
    stop.store(true, Ordering::Relaxed);
    c.rt.block_on(load).unwrap();
    let failures = failed.lock().unwrap().clone();
    println!(
        "cluster: {} requests through the surviving replicas while one stopped and Redis restarted, {} failed",
        ok.load(Ordering::Relaxed),
        failures.len()
    );
    assert!(failures.is_empty(), "{failures:?}");
    assert!(ok.load(Ordering::Relaxed) > 20);

    // Audit: all three decision logs against the four receipt logs.
    let report = c.stop_and_audit();
    assert!(
        report.discrepancies.is_empty(),
        "{:?}",
        report.discrepancies
    );
    assert_eq!(report.receipted, report.routed, "{report:?}");
    println!(
        "cluster: audit over 3 decision logs and 4 receipt logs: {} routed, {} receipted, 0 discrepancies",
        report.routed, report.receipted
    );
}

/// A replica that is a real `kvgate gateway` process, killed with SIGKILL while it streams:
/// only its in-flight requests fail; the other replica (in-process) serves every request before,
/// during and after; the killed replica leaves no phantom load in the survivor's view once its
/// lease lapses. The audit over both decision logs is clean: the killed replica's in-flight
/// requests left their write-ahead `routed` lines (docs/receipts.md), which the audit counts as
/// `unfinished`, and the workers receipted them as the connections closed.
#[test]
fn a_killed_replica_process_fails_only_its_own_in_flight_requests() {
    let mut c = Cluster::new(2, 3);
    // Replica 1 in-process (it seeds the cluster's rules), replica 2 a real process.
    c.start_gateway(0);
    for w in ["w1", "w2", "w3"] {
        c.wait_for(
            "workers routable on replica 1",
            Duration::from_secs(10),
            || c.routable(0, w),
        );
    }
    c.gateway_keys[1]
        .write_to_dir(c.dir.path(), "gw-2")
        .expect("write replica 2's key");
    let (listen2, admin2) = (free_port(), free_port());
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvgate"))
        .args(["gateway", "--rules"])
        .arg(c.dir.path().join("rules.toml"))
        .arg("--key")
        .arg(c.dir.path().join("gw-2.key"))
        .args(["--gateway-id", "gw-2", "--admin-token", TOKEN, "--no-watch"])
        .args(["--listen", &format!("127.0.0.1:{listen2}")])
        .args(["--admin", &format!("127.0.0.1:{admin2}")])
        .arg("--decision-log")
        .arg(c.decisions(1))
        .args(["--cluster", &c.redis.url(), "--cluster-lease-ms", "1000"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start kvgate gateway");
    let url2 = format!("http://127.0.0.1:{listen2}/v1/chat/completions");
    let url1 = format!("http://{}/v1/chat/completions", c.gw(0).listen_addr);
    let chat = |url: &str, text: &str, max_tokens: u64| {
        let body = json!({"model": "rr", "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": text}]});
        c.rt.block_on(async {
            match c.http.post(url).json(&body).send().await {
                Ok(r) => Some(Reply::read(r).await.status),
                Err(_) => None,
            }
        })
    };
    c.wait_for(
        "replica 2 (a process) serving",
        Duration::from_secs(30),
        || chat(&url2, "hello 2", 2) == Some(200),
    );

    // Load through replica 1 all along; long streams in flight through replica 2 at the kill.
    let stop = Arc::new(AtomicBool::new(false));
    let (ok, failed) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let load = {
        let (stop, ok, failed) = (stop.clone(), ok.clone(), failed.clone());
        let (http, url) = (c.http.clone(), url1.clone());
        c.rt.spawn(async move {
            let mut n = 0u64;
            while !stop.load(Ordering::Relaxed) {
                n += 1;
                let body = json!({"model": "rr", "max_tokens": 4,
                    "messages": [{"role": "user", "content": format!("steady {n}")}]});
                let served = match http.post(&url).json(&body).send().await {
                    Ok(r) => r.status() == 200 && r.bytes().await.is_ok(),
                    Err(_) => false,
                };
                if served {
                    ok.fetch_add(1, Ordering::Relaxed);
                } else {
                    failed.fetch_add(1, Ordering::Relaxed);
                }
            }
        })
    };
    let in_flight: Vec<_> = (0..4)
        .map(|n| {
            let (http, url) = (c.http.clone(), url2.clone());
            c.rt.spawn(async move {
                // ~9 s at the workers' 3 ms per decode step: long enough for the replicas'
                // 200 ms load syncs to show all four on a busy 2-core CI machine; `min_tokens`
                // so that no end token of the simulated model ends one before the kill (one CI
                // run at c159dc9 saw a stream complete first).
                let body = json!({"model": "rr", "stream": true, "max_tokens": 3000, "min_tokens": 3000,
                    "messages": [{"role": "user", "content": format!("long via 2, {n}")}]});
                let r = http.post(url).json(&body).send().await.ok()?;
                // A complete stream ends with `data: [DONE]`.
                let text = r.text().await.ok()?;
                Some(text.contains("[DONE]"))
            })
        })
        .collect();
    let seen = std::cell::Cell::new(0u64);
    c.wait_for(
        "replica 1 sees replica 2's 4 streams as fleet load",
        Duration::from_secs(15),
        || {
            let v = c.gw(0).data.views.load();
            let sum = v
                .workers
                .values()
                .map(|e| e.runtime.remote_in_flight.load(Ordering::Relaxed))
                .sum::<u64>();
            if sum > seen.get() {
                seen.set(sum);
                println!("replica 1 sees {sum} of replica 2's streams");
            }
            sum >= 4
        },
    );
    child.kill().expect("SIGKILL replica 2");
    let _ = child.wait();
    let outcomes: Vec<Option<bool>> = in_flight
        .into_iter()
        .map(|h| c.rt.block_on(h).unwrap())
        .collect();
    assert!(
        outcomes.iter().all(|o| *o != Some(true)),
        "a stream through the killed replica completed: {outcomes:?}"
    );
    assert_eq!(chat(&url2, "after the kill", 2), None, "replica 2 is gone");
    // Its lease (1 s) lapses: no phantom load in replica 1's view.
    c.wait_for(
        "the killed replica's load gone from replica 1's view",
        Duration::from_secs(5),
        || {
            let v = c.gw(0).data.views.load();
            v.workers
                .values()
                .all(|e| e.runtime.remote_in_flight.load(Ordering::Relaxed) == 0)
        },
    );
    std::thread::sleep(Duration::from_millis(300));
    stop.store(true, Ordering::Relaxed);
    c.rt.block_on(load).unwrap();
    println!(
        "cluster: replica 2 (a process) SIGKILLed with {} streams in flight; replica 1 served {} requests meanwhile, {} failed",
        outcomes.len(),
        ok.load(Ordering::Relaxed),
        failed.load(Ordering::Relaxed)
    );
    assert_eq!(failed.load(Ordering::Relaxed), 0);
    assert!(ok.load(Ordering::Relaxed) > 20);

    // The audit over both decision logs: every decision receipted, no discrepancy.
    let report = c.stop_and_audit();
    println!(
        "cluster: audit after the kill: {} routed, {} receipted, {} unfinished, {} discrepancies",
        report.routed,
        report.receipted,
        report.unfinished,
        report.discrepancies.len()
    );
    assert!(
        report.discrepancies.is_empty(),
        "{:?}",
        report.discrepancies
    );
    assert_eq!(report.receipted, report.routed, "{report:?}");
    // The killed replica's in-flight streams: routed lines only (written before they were
    // sent), receipted by the workers as the connections closed.
    assert_eq!(report.unfinished, outcomes.len() as u64, "{report:?}");
}

/// The claim script alone, on a real `redis-server`: a replica's fresh placement makes its
/// worker dearer for the others (not for itself) until the claim's TTL passes, a prompt follows
/// another replica's fresh placement of its prefix (even onto a worker it did not name as a
/// candidate), and replicas claiming at the same instant over an idle pool all get different
/// workers.
#[test]
fn claims_select_and_reserve_atomically_across_replicas() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let redis = Redis::start(free_port(), tempfile::tempdir().unwrap());
    rt.block_on(async {
        let store = cluster::Store::connect(&redis.url(), "claims-test")
            .await
            .unwrap();
        let ids = AtomicU64::new(0);
        let long = Duration::from_secs(30);
        let base = cluster::Claim {
            replica: "",
            id: "",
            candidates: &[],
            others: &[],
            added: 100,
            credit: 0,
            lead_saving: 0,
            keys: &[],
            ttl: long,
            lead_ttl: long,
        };
        let idle: &[(&str, u64)] = &[("w1", 0), ("w2", 0)];
        let on = |replica, candidates| cluster::Claim {
            replica,
            candidates,
            ..base
        };
        // A places first; B, a moment later, sees A's claim on w1.
        assert_eq!(claim(&store, &ids, on("gw-a", idle)).await, "w1");
        assert_eq!(claim(&store, &ids, on("gw-b", idle)).await, "w2");
        // A's own claims are not added for A (its view counts them exactly): w1 = 0 for A,
        // w2 = 0 + B's 100.
        assert_eq!(claim(&store, &ids, on("gw-a", idle)).await, "w1");
        // Costs still rule: for B, w1 = 0 + A's 200 is cheaper than w2 = 500.
        assert_eq!(
            claim(&store, &ids, on("gw-b", &[("w1", 0), ("w2", 500)])).await,
            "w1"
        );
        // Ties go to the caller's own order.
        assert_eq!(
            claim(&store, &ids, on("gw-c", &[("w3", 0), ("w4", 0)])).await,
            "w3"
        );

        // Eight replicas at once over eight idle workers: eight different workers.
        let pool: Vec<String> = (0..8).map(|i| format!("r{i}")).collect();
        let cands: Vec<(&str, u64)> = pool.iter().map(|w| (w.as_str(), 0)).collect();
        let replicas: Vec<String> = (0..8).map(|g| format!("gw-{g}")).collect();
        let picks = futures::future::join_all(replicas.iter().map(|r| {
            let c = cluster::Claim {
                added: 1_000,
                ..on(r, &cands)
            };
            claim(&store, &ids, c)
        }))
        .await;
        let mut distinct = picks.clone();
        distinct.sort_unstable();
        distinct.dedup();
        assert_eq!(distinct.len(), 8, "one worker each: {picks:?}");

        // Leads: gw-a places a 20-block prompt on p1; gw-b's prompt shares its first 16 blocks
        // (the deepest sampled depth they share) and names p2, p3 as candidates: p1, brought in
        // from `others`, costs max(0, 200 + 100 − 10·16) = 140 < 150.
        let chain: Vec<u64> = (1..=20).collect();
        let mut sharing: Vec<u64> = (1..=16).collect();
        sharing.extend(1001..=1004);
        let lead = |replica, candidates, keys| cluster::Claim {
            others: &[("p1", 200), ("p4", 0)],
            credit: 10,
            lead_saving: 5,
            keys,
            ..on(replica, candidates)
        };
        assert_eq!(
            claim(&store, &ids, lead("gw-a", &[("p1", 0)], &chain)).await,
            "p1"
        );
        let p2_p3: &[(&str, u64)] = &[("p2", 150), ("p3", 150)];
        // The answer names the depth credited, so that the request's reservation on p1 does not
        // count those 16 blocks as its own prefill.
        assert_eq!(
            claim_full(&store, &ids, lead("gw-b", p2_p3, &sharing)).await,
            cluster::Claimed {
                worker: "p1".into(),
                lead_blocks: 16
            }
        );
        // A prompt sharing only the first 4 blocks: p1 = 200 + 100 (gw-a's claim; gw-b's, the
        // lead's own replica's, adds max(0, 20 − 10·4) = 0) − 40 = 260 > 150. The leads now point at p1 for
        // gw-b; gw-b's own leads are not followed by gw-b. Not the lead's worker: nothing
        // credited.
        let mut short: Vec<u64> = (1..=4).collect();
        short.extend(2001..=2016);
        assert_eq!(
            claim_full(&store, &ids, lead("gw-c", p2_p3, &short)).await,
            cluster::Claimed {
                worker: "p2".into(),
                lead_blocks: 0
            }
        );
        // gw-b, following the lead 16 blocks deep, added 100 − 5·16 = 20 to p1, not 100: for
        // gw-d p1 costs 0 + 100 (gw-a) + 20 (gw-b) = 120 < 150 (it would be 200 otherwise).
        assert_eq!(
            claim(&store, &ids, on("gw-d", &[("p1", 0), ("p5", 150)])).await,
            "p1"
        );
        // The lead replica's own claims on the lead's worker are not added: the caller's costs
        // count that request already once its published decision arrived (~1 ms), and it is
        // the request this one follows. gw-f's view counts gw-e's request on q1 (150 + 100):
        // q1 = 250 − 10·16 = 90 < 150. Adding gw-e's claim too (+100: 190) sent the prompt's
        // second request to q2, computing the prefix twice.
        let mut fresh: Vec<u64> = (3001..=3016).collect();
        fresh.extend(3101..=3104);
        let placed = cluster::Claim {
            others: &[],
            credit: 10,
            lead_saving: 5,
            keys: &fresh,
            ..on("gw-e", &[("q1", 150)])
        };
        assert_eq!(claim(&store, &ids, placed).await, "q1");
        let mut second: Vec<u64> = (3001..=3016).collect();
        second.extend(3201..=3204);
        let follower = cluster::Claim {
            others: &[("q1", 250)],
            credit: 10,
            lead_saving: 5,
            keys: &second,
            ..on("gw-f", &[("q2", 150), ("q3", 150)])
        };
        assert_eq!(claim(&store, &ids, follower).await, "q1");
        // A shallow lead is not a reason to stack: every chat prompt shares its template's first
        // block, so its `P:lead` key names whatever worker another replica claimed last. gw-g
        // places a new 20-block prompt (1,331 tokens' cost) on s1; 1 ms later gw-h's new prompt,
        // sharing that first block only, sees s1 and s2 cold and equal (its view does not count
        // gw-g's request yet). s1 = 2658 + max(0, 1331 − 32·1) − 32 = 3925 > 2658: s2. Dropping
        // gw-g's claim in full (the rule for a lead as deep as the prefix) made s1 2626 and put
        // the second prefix behind the first one's prefill: seen in the N = 64 fleet bench as
        // a split prefix (docs/benchmarks.md, "The same command on an Intel Xeon").
        let mut first: Vec<u64> = (5001..=5020).collect();
        let placed = cluster::Claim {
            others: &[],
            credit: 32,
            lead_saving: 16,
            added: 1_331,
            keys: &first,
            ..on("gw-g", &[("s1", 2_658), ("s2", 2_658)])
        };
        assert_eq!(claim(&store, &ids, placed).await, "s1");
        first.truncate(1);
        first.extend(5601..=5619);
        let other_prefix = cluster::Claim {
            others: &[],
            credit: 32,
            lead_saving: 16,
            added: 1_331,
            keys: &first,
            ..on("gw-h", &[("s2", 2_658), ("s1", 2_658)])
        };
        assert_eq!(
            claim_full(&store, &ids, other_prefix).await,
            cluster::Claimed {
                worker: "s2".into(),
                lead_blocks: 0
            }
        );
        assert_eq!(
            cluster::sample_chain(&chain),
            vec![(16, 16), (8, 8), (4, 4), (2, 2), (1, 1)],
            "the sampled depths, deepest first"
        );
        // Ids that cannot travel in the script's arguments make no claim.
        assert_eq!(claim(&store, &ids, on("gw a", idle)).await, "w1");

        // A claim counts for its TTL only.
        let brief = |replica| cluster::Claim {
            ttl: Duration::from_millis(40),
            lead_ttl: Duration::from_millis(40),
            ..on(replica, &[("e1", 0), ("e2", 0)])
        };
        assert_eq!(claim(&store, &ids, brief("gw-a")).await, "e1");
        assert_eq!(claim(&store, &ids, brief("gw-b")).await, "e2");
        tokio::time::sleep(Duration::from_millis(80)).await;
        assert_eq!(claim(&store, &ids, brief("gw-c")).await, "e1");
    });
}

/// One claim with its own id (a replica numbers its claims: each is its own member).
async fn claim_full(
    store: &cluster::Store,
    ids: &AtomicU64,
    c: cluster::Claim<'_>,
) -> cluster::Claimed {
    let id = ids.fetch_add(1, Ordering::Relaxed).to_string();
    store.claim(&cluster::Claim { id: &id, ..c }).await.unwrap()
}

/// [`claim_full`]'s chosen worker.
async fn claim(store: &cluster::Store, ids: &AtomicU64, c: cluster::Claim<'_>) -> String {
    claim_full(store, ids, c).await.worker
}

/// Claims through a real replica: another replica's fresh cold placements on two of three idle
/// workers send a new prompt to the third, wherever this replica's own rotation would have put
/// it (the decision is moved with its reservation and routing-time holding), and the moved
/// requests' tickets and receipts still audit clean.
#[test]
fn a_replica_places_a_new_prompt_beside_the_others_fresh_claims() {
    let mut c = Cluster::new(1, 3);
    c.start_gateway(0);
    let store = routable_with_a_store(&c);
    let ttl = Duration::from_millis(700);
    for (round, target) in ["w3", "w1", "w2"].iter().enumerate() {
        // "gw-other" has just placed new prompts everywhere but `target`.
        claim_all_but(&c, &store, target, round, ttl);
        // A new prompt (it shares only the template's system-prompt block with the others).
        let topic = ["Rivers", "Volcanoes", "Glaciers"][round];
        let text = format!(
            "{topic} {}",
            "shape the land over long spans of time. ".repeat(8)
        );
        let r = c.chat(0, "smol", &text, 4);
        assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
        assert_eq!(r.header("x-kvgate-worker").as_deref(), Some(*target));
        std::thread::sleep(ttl + Duration::from_millis(100));
    }
    let metrics = c.admin(0, reqwest::Method::GET, "/metrics", None);
    let text = String::from_utf8_lossy(&metrics.body).to_string();
    let count = |outcome: &str| -> u64 {
        text.lines()
            .find(|l| l.contains("cluster_claims_total") && l.contains(&format!("\"{outcome}\"")))
            .and_then(|l| l.rsplit(' ').next()?.parse().ok())
            .unwrap_or(0)
    };
    // The replica's own first choice is one worker: the other two targets were moves.
    assert!(count("moved") >= 2, "{text}");
    assert_eq!(count("moved") + count("kept"), 3, "{text}");
    assert_eq!(count("failed"), 0);
    let report = c.stop_and_audit();
    assert!(report.discrepancies.is_empty(), "{report:?}");
    assert_eq!((report.routed, report.receipted), (3, 3), "{report:?}");
}

/// Another replica ("gw-other") has just placed new prompts on every worker of w1–w3 but
/// `target`, each claimed for `ttl`.
/// Waits until replica 0 routes to w1..w3, then connects a store to the cluster's Redis
/// (for the claims a test makes as another replica).
fn routable_with_a_store(c: &Cluster) -> cluster::Store {
    for w in ["w1", "w2", "w3"] {
        c.wait_for("static workers routable", Duration::from_secs(10), || {
            c.routable(0, w)
        });
    }
    c.rt.block_on(cluster::Store::connect(&c.redis.url(), "kvgate"))
        .unwrap()
}

fn claim_all_but(c: &Cluster, store: &cluster::Store, target: &str, round: usize, ttl: Duration) {
    for w in ["w1", "w2", "w3"].iter().filter(|w| **w != target) {
        c.rt.block_on(store.claim(&cluster::Claim {
            replica: "gw-other",
            id: &format!("{round}"),
            candidates: &[(w, 0)],
            others: &[],
            added: 1_000_000_000,
            credit: 0,
            lead_saving: 0,
            keys: &[],
            ttl,
            lead_ttl: ttl,
        }))
        .unwrap();
    }
}

/// A second request of a new prompt's prefix that places on the same replica while the first
/// one's claim is still in flight follows the first wherever its claim takes it: the prefix is
/// computed once. Redis is paused (`CLIENT PAUSE`) for 400 ms so that the first request's claim
/// waits there while the second places; another replica's fresh claims make the claim move the
/// first request off the replica's own choice in most rounds. Without the wait for the claim
/// (`claim_wait`), the second request stays on that choice, where the first request's
/// routing-time holding made it a clear winner.
#[test]
fn a_request_that_follows_a_claim_in_flight_goes_where_the_claim_went() {
    let mut c = Cluster::new(1, 3);
    c.start_gateway_with(0, |cfg| {
        if let Some(cl) = cfg.cluster.as_mut() {
            cl.claim_timeout = Duration::from_secs(3);
        }
    });
    let store = routable_with_a_store(&c);
    let ttl = Duration::from_secs(2);
    for (round, target) in ["w3", "w1", "w2"].iter().enumerate() {
        claim_all_but(&c, &store, target, round, ttl);
        let topic = ["Rivers", "Volcanoes", "Glaciers"][round];
        let doc = format!(
            "{topic} {}",
            "shape the land over long spans of time. ".repeat(16)
        );
        assert_eq!(redis_command(c.redis.port, "CLIENT PAUSE 400 ALL"), "+OK");
        let url = format!("http://{}/v1/chat/completions", c.gw(0).listen_addr);
        let ask = |after_ms: u64, question: &str| {
            let body = json!({"model": "smol", "max_tokens": 4,
                "messages": [{"role": "user", "content": format!("{doc} {question}")}]});
            let (http, url) = (c.http.clone(), url.clone());
            async move {
                tokio::time::sleep(Duration::from_millis(after_ms)).await;
                Reply::read(http.post(url).json(&body).send().await.unwrap()).await
            }
        };
        let (first, second) =
            c.rt.block_on(async { tokio::join!(ask(50, "How fast?"), ask(200, "Where most?")) });
        for r in [&first, &second] {
            assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
            assert_eq!(
                r.header("x-kvgate-worker").as_deref(),
                Some(*target),
                "round {round}"
            );
        }
        std::thread::sleep(ttl + Duration::from_millis(100));
    }
    let metrics = c.admin(0, reqwest::Method::GET, "/metrics", None);
    let text = String::from_utf8_lossy(&metrics.body).to_string();
    let count = |metric: &str, outcome: &str| -> u64 {
        text.lines()
            .find(|l| l.starts_with(metric) && l.contains(&format!("\"{outcome}\"")))
            .and_then(|l| l.rsplit(' ').next()?.parse().ok())
            .unwrap_or(0)
    };
    let claims = "kvgate_gateway_cluster_claims_total";
    let follows = "kvgate_gateway_cluster_claim_follows_total";
    assert!(count(claims, "moved") >= 2, "{text}");
    assert_eq!(count(claims, "moved") + count(claims, "kept"), 3, "{text}");
    // Each moved claim was followed there; the others' followers stayed with them.
    assert_eq!(count(follows, "moved"), count(claims, "moved"), "{text}");
    assert_eq!(count(follows, "kept"), count(claims, "kept"), "{text}");
    assert_eq!(count(follows, "failed"), 0, "{text}");
    let report = c.stop_and_audit();
    assert!(report.discrepancies.is_empty(), "{report:?}");
    assert_eq!((report.routed, report.receipted), (6, 6), "{report:?}");
}

/// What one claim costs against a `PING`, on a real `redis-server` over loopback: 2,000 of each,
/// one at a time, a 64-worker pool (8 close candidates, 56 others) and a 1,300-token prompt
/// (82 blocks: 13 sampled chain keys), once following another replica's lead and once for
/// prompts no replica has placed. `cargo test --test cluster_fleet claim_round_trip --
/// --ignored --nocapture`.
#[test]
#[ignore]
fn claim_round_trip_against_ping() {
    let (rt, _redis, store) = fresh_store("claims-timing");
    rt.block_on(async {
        let pool: Vec<String> = (0..64).map(|i| format!("w{i}")).collect();
        let ranked: Vec<(&str, u64)> = pool.iter().map(|w| (w.as_str(), 2_600)).collect();
        let keys: Vec<u64> = (1..=82).collect();
        let n = 2_000;
        // One claim over the 8 close candidates and 56 others, as `replica`, for `keys`.
        let claim = |replica: &'static str, id: String, keys: Vec<u64>| {
            let (store, ranked) = (&store, &ranked);
            async move {
                store
                    .claim(&cluster::Claim {
                        replica,
                        id: &id,
                        candidates: &ranked[..8],
                        others: &ranked[8..],
                        added: 1_300,
                        credit: 32,
                        lead_saving: 16,
                        keys: &keys,
                        ttl: Duration::from_millis(10),
                        lead_ttl: Duration::from_millis(10),
                    })
                    .await
                    .unwrap();
            }
        };
        for round in 0..2 {
            let t = Instant::now();
            for _ in 0..n {
                store.ping().await.unwrap();
            }
            let ping = t.elapsed() / n;
            // Two replicas in turn over one prompt: each follows the other's lead.
            let t = Instant::now();
            for i in 0..n {
                let replica = if i % 2 == 0 { "gw-a" } else { "gw-b" };
                claim(replica, i.to_string(), keys.clone()).await;
            }
            let following = t.elapsed() / n;
            // New prompts: no other replica has placed their blocks (every lead key read is
            // empty), as in a cold wave.
            let t = Instant::now();
            for i in 0..n {
                let fresh = (1..=82).map(|k| k + 1_000 * (u64::from(i) + 1)).collect();
                claim("gw-a", i.to_string(), fresh).await;
            }
            let cold = t.elapsed() / n;
            println!(
                "round {round}: PING {ping:?}, claim following a lead {following:?}, claim of a new prompt {cold:?} (mean of {n} each)"
            );
        }
    });
}

/// Other replicas' load tables come from the network: a corrupt or hostile one (counts at
/// `u64::MAX`, fields that are not numbers, more prefill than active tokens) is read without
/// overflowing or failing — sums saturate, what does not parse counts 0, prefill is at most a
/// table's active tokens — so the sync loop that reads them keeps running. A table without the
/// prefill field (an older replica) reads its prefill as 0.
#[test]
fn hostile_load_tables_saturate_instead_of_overflowing() {
    let (rt, redis, store) = fresh_store("hostile");
    rt.block_on(async {
        let huge = cluster::Load {
            in_flight: u64::MAX,
            active_tokens: u64::MAX,
            prefill_tokens: u64::MAX,
        };
        let table: std::collections::BTreeMap<String, cluster::Load> =
            [("w1".to_string(), huge)].into();
        for g in ["g1", "g2"] {
            store
                .put_load(g, &table, 1, Duration::from_secs(30))
                .await
                .unwrap();
        }
        let client = redis::Client::open(redis.url()).unwrap();
        let mut con = client.get_multiplexed_async_connection().await.unwrap();
        let keys = store.keys();
        let _: () = redis::cmd("HSET")
            .arg(keys.load("g3"))
            .arg("w1")
            .arg("7 x")
            .arg("w2")
            .arg("not numbers at all")
            .arg("w3")
            .arg("1 300")
            .arg("w4")
            .arg("1 100 900")
            .query_async(&mut con)
            .await
            .unwrap();
        let _: () = redis::cmd("SADD")
            .arg(keys.gateways())
            .arg(&["g1", "g2", "g3", "me"][..])
            .query_async(&mut con)
            .await
            .unwrap();
        let fleet = store.fleet_load("me").await.unwrap();
        assert_eq!(fleet.load.get("w1").copied(), Some(huge));
        assert_eq!(
            fleet.load.get("w2").copied(),
            Some(cluster::Load::default())
        );
        let load = |in_flight, active_tokens, prefill_tokens| cluster::Load {
            in_flight,
            active_tokens,
            prefill_tokens,
        };
        assert_eq!(fleet.load.get("w3").copied(), Some(load(1, 300, 0)));
        assert_eq!(fleet.load.get("w4").copied(), Some(load(1, 100, 100)));
    });
}

/// An engine kvgate did not build, as far as a sidecar sees one: `/health` and a fixed chat
/// answer.
async fn fake_engine() -> std::net::SocketAddr {
    use axum::routing::{get, post};
    let app = axum::Router::new()
        .route("/health", get(|| async { axum::Json(json!({"status": "ok"})) }))
        .route(
            "/v1/chat/completions",
            post(|| async {
                axum::Json(json!({
                    "id": "chatcmpl-native",
                    "object": "chat.completion",
                    "created": 0,
                    "model": "native",
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}],
                    "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}
                }))
            }),
        );
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(l, app).await });
    addr
}

/// A sidecar in front of a native engine registers itself as a worker does: it joins every
/// replica's pool by its labels, takes route tickets signed by keys it read from Redis (it has
/// no key folder and requires tickets), leaves the pools when it stops, and its receipts audit
/// clean against both replicas' decision logs.
#[test]
fn a_registered_sidecar_serves_through_every_replica_and_leaves_when_it_stops() {
    let mut c = Cluster::new(2, 4);
    c.start_gateway(0);
    c.start_gateway(1);
    let sidecar = c.rt.block_on(async {
        let engine = fake_engine().await;
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let mut cfg = worker::sidecar::SidecarConfig::new(
            format!("http://{engine}"),
            "w4",
            c.worker_keys[3].clone(),
            c.dir.path().join("receipts-w4.jsonl"),
        );
        cfg.ticket_policy = TicketPolicy::Require;
        cfg.registration = Some(worker::registration::Registration {
            url: c.redis.url(),
            prefix: "kvgate".into(),
            advertise_url: format!("http://{}", l.local_addr().unwrap()),
            labels: [("tier".to_string(), "sim".to_string())].into(),
            lease: Duration::from_millis(1500),
            kind: Some("openai".into()),
        });
        worker::sidecar::spawn(cfg, l).await.unwrap()
    });
    for g in 0..2 {
        c.wait_for(
            "the sidecar in every replica's pool",
            Duration::from_secs(10),
            || c.routable(g, "w4"),
        );
        // Announced as what it fronts: the replicas treat it as that kind of upstream.
        let kind = c.gw(g).data.views.load().workers[&prefix_index::WorkerId("w4".into())]
            .spec
            .kind;
        assert_eq!(kind, routing_rules::schema::UpstreamKind::Openai);
    }
    // Round robin over four workers: within 12 requests per replica, the sidecar serves some,
    // with tickets it verified against keys it only knows from Redis.
    for g in 0..2 {
        let mut served = 0;
        for i in 0..12 {
            let r = c.chat(g, "rr", &format!("native {g} {i}"), 4);
            assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
            if r.header("x-kvgate-worker").as_deref() == Some("w4") {
                served += 1;
                assert_eq!(r.json()["choices"][0]["message"]["content"], "hi");
            }
        }
        assert!(
            served >= 2,
            "replica {g}: the sidecar served {served} of 12"
        );
    }
    c.rt.block_on(sidecar.shutdown());
    for g in 0..2 {
        c.wait_for(
            "the stopped sidecar out of the pools",
            Duration::from_secs(5),
            || !c.routable(g, "w4"),
        );
    }
    let report = c.stop_and_audit();
    assert!(report.discrepancies.is_empty(), "{report:?}");
    assert_eq!(report.receipted, report.routed, "{report:?}");
}

/// Redis's own count of `name`'s calls since the last `CONFIG RESETSTAT` (0 when none).
async fn command_calls(con: &mut redis::aio::MultiplexedConnection, name: &str) -> u64 {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(con)
        .await
        .unwrap();
    let prefix = format!("cmdstat_{name}:calls=");
    info.lines()
        .find_map(|l| l.strip_prefix(prefix.as_str()))
        .and_then(|rest| rest.split(',').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}

/// A claim is one `EVALSHA`: the store loads the claim script when it connects, and again
/// (`ensure_scripts`, every sync tick of a gateway) when Redis lost it — not on a claim's own
/// time as `NOSCRIPT`, `SCRIPT LOAD`, `EVALSHA`, three round trips against a 5 ms timeout.
#[test]
fn a_claim_is_one_round_trip_on_a_fresh_or_flushed_redis() {
    let (rt, redis, store) = fresh_store("scripts");
    rt.block_on(async {
        let client = redis::Client::open(redis.url()).unwrap();
        let mut con = client.get_multiplexed_async_connection().await.unwrap();
        let ids = AtomicU64::new(0);
        let idle: &[(&str, u64)] = &[("w1", 0), ("w2", 0)];
        let c = cluster::Claim {
            replica: "gw-a",
            id: "",
            candidates: idle,
            others: &[],
            added: 100,
            credit: 0,
            lead_saving: 0,
            keys: &[1, 2, 3],
            ttl: Duration::from_secs(5),
            lead_ttl: Duration::from_secs(5),
        };
        let _: () = redis::cmd("CONFIG")
            .arg("RESETSTAT")
            .query_async(&mut con)
            .await
            .unwrap();
        assert_eq!(claim(&store, &ids, c).await, "w1");
        assert_eq!(command_calls(&mut con, "evalsha").await, 1);
        assert_eq!(command_calls(&mut con, "script|load").await, 0);
        assert!(!store.ensure_scripts().await.unwrap(), "already loaded");
        // Redis lost its scripts (a restart, `SCRIPT FLUSH`): the next sync reloads them.
        let _: () = redis::cmd("SCRIPT")
            .arg("FLUSH")
            .query_async(&mut con)
            .await
            .unwrap();
        assert!(store.ensure_scripts().await.unwrap(), "reloaded");
        let _: () = redis::cmd("CONFIG")
            .arg("RESETSTAT")
            .query_async(&mut con)
            .await
            .unwrap();
        let b = cluster::Claim {
            replica: "gw-b",
            ..c
        };
        assert_eq!(claim(&store, &ids, b).await, "w2", "beside gw-a's claim");
        assert_eq!(command_calls(&mut con, "evalsha").await, 1);
        assert_eq!(command_calls(&mut con, "script|load").await, 0);
        // Without the reload, the claim still succeeds, paying the round trips itself.
        let _: () = redis::cmd("SCRIPT")
            .arg("FLUSH")
            .query_async(&mut con)
            .await
            .unwrap();
        let c3 = cluster::Claim {
            replica: "gw-c",
            ..c
        };
        assert_eq!(
            claim(&store, &ids, c3).await,
            "w1",
            "equal costs: its own order"
        );
        assert!(command_calls(&mut con, "evalsha").await >= 2);
    });
}

/// Sends one inline command to the Redis on `port` and returns its first reply line.
fn redis_command(port: u16, command: &str) -> String {
    use std::io::{BufRead, BufReader, Write};
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.write_all(format!("{command}\r\n").as_bytes()).unwrap();
    let mut line = String::new();
    BufReader::new(s).read_line(&mut line).unwrap();
    line.trim_end().to_owned()
}

/// A replica that starts while Redis answers no command (it accepts connections; every call
/// times out, as through a partition) serves its file's rules, degraded, but its `/ready`
/// answers 503 until it has read the shared rules and registrations and the registered
/// workers' KV event snapshots have arrived. Then the registered worker takes traffic.
#[test]
fn a_replica_started_while_redis_does_not_answer_is_ready_once_it_read_the_cluster() {
    let mut c = Cluster::new(1, 4);
    let w4 = c.start_worker(3, true);
    c.workers.push(Some(w4));
    let pause_ms = 8_000;
    assert_eq!(
        redis_command(c.redis.port, &format!("CLIENT PAUSE {pause_ms} ALL")),
        "+OK"
    );
    let paused = Instant::now();
    c.start_gateway(0);
    let ready = |c: &Cluster| {
        let url = format!("http://{}/ready", c.gw(0).admin_addr);
        c.rt.block_on(async { Reply::read(c.http.get(url).send().await.unwrap()).await })
    };
    let r = ready(&c);
    assert!(
        paused.elapsed() < Duration::from_millis(pause_ms),
        "the start outlasted the pause"
    );
    assert_eq!(r.status, 503, "{}", r.text());
    assert!(
        r.text().contains("the cluster store has not been read yet"),
        "{}",
        r.text()
    );
    assert!(!c.routable(0, "w4"), "w4 is known before Redis answered");
    // Degraded, it serves the file's rules meanwhile.
    let r = c.chat(0, "rr", "while Redis is away", 2);
    assert_eq!(r.status, 200, "{}", r.text());
    c.wait_for("ready", Duration::from_secs(30), || ready(&c).status == 200);
    assert!(
        paused.elapsed() >= Duration::from_millis(pause_ms),
        "ready before Redis answered"
    );
    // The registered worker joins the pools at its first passing health probe (every
    // `health_interval_ms` = 100): readiness does not wait for it (a run of the whole binary on
    // 2 busy cores once saw it unprobed at the moment ready turned 200).
    c.wait_for(
        "the registered worker routable",
        Duration::from_secs(5),
        || c.routable(0, "w4"),
    );
    let served: Vec<String> = (0..8)
        .map(|i| c.chat(0, "rr", &format!("after {i}"), 2).worker())
        .collect();
    assert!(served.iter().any(|w| w == "w4"), "{served:?}");
    let report = c.stop_and_audit();
    assert!(report.ok(), "{report}");
}

/// A tenant's limits are the fleet's: with 2 live replicas each enforces half of them. A cap
/// of 2 concurrent requests admits 1 per replica: 2 long requests through one replica get one
/// answer and one 429 (concurrency); 1 through each replica, both are served.
#[test]
fn replicas_share_a_tenants_limits() {
    use sha2::Digest;
    let mut c = Cluster::new(2, 3);
    let key_hash = hex::encode(sha2::Sha256::digest(b"tenant-key"));
    let rules = format!(
        "{}\n[[tenants]]\nid = \"t\"\napi_keys_sha256 = [\"{key_hash}\"]\nmax_concurrent_requests = 2\n\n\
         [[services]]\nname = \"keyed\"\npool = \"all\"\nauth = \"api_key\"\nrule = {{ type = \"round_robin\" }}\n\
         [services.match]\nmodels = [\"keyed\"]\n",
        c.rules()
    );
    std::fs::write(c.dir.path().join("rules.toml"), rules).unwrap();
    c.start_gateway(0);
    c.start_gateway(1);
    for g in 0..2 {
        c.wait_for("both replicas live", Duration::from_secs(10), || {
            c.gw(g).data.limits.replicas() == 2
        });
    }
    // ~3 ms per token: 300 tokens keep a request in flight for about a second.
    let send = |c: &Cluster, gs: &[usize]| -> Vec<Reply> {
        c.rt.block_on(async {
            let sends = gs.iter().enumerate().map(|(i, g)| {
                let url = format!("http://{}/v1/chat/completions", c.gw(*g).listen_addr);
                let body = json!({"model": "keyed", "messages": [{"role": "user", "content": format!("long {i}")}], "max_tokens": 300, "temperature": 0});
                let req = c.http.post(url).bearer_auth("tenant-key").json(&body);
                async move { Reply::read(req.send().await.unwrap()).await }
            });
            futures::future::join_all(sends).await
        })
    };
    let one_replica = send(&c, &[0, 0]);
    let mut statuses: Vec<u16> = one_replica.iter().map(|r| r.status).collect();
    statuses.sort_unstable();
    assert_eq!(
        statuses,
        [200, 429],
        "{:?}",
        one_replica.iter().map(Reply::text).collect::<Vec<_>>()
    );
    let refused = one_replica.iter().find(|r| r.status == 429).unwrap();
    assert!(
        refused.text().contains("(concurrency)"),
        "{}",
        refused.text()
    );
    let both = send(&c, &[0, 1]);
    assert!(
        both.iter().all(|r| r.status == 200),
        "{:?}",
        both.iter().map(Reply::text).collect::<Vec<_>>()
    );
    let report = c.stop_and_audit();
    assert!(report.ok(), "{report}");
}

#[test]
fn stored_responses_are_continued_and_deleted_through_any_replica() {
    use sha2::Digest;
    let mut c = Cluster::new(3, 3);
    let key_hash = hex::encode(sha2::Sha256::digest(b"tenant-key"));
    let rules = format!(
        "{}\n[[tenants]]\nid = \"t\"\napi_keys_sha256 = [\"{key_hash}\"]\n\n\
         [[services]]\nname = \"keyed\"\npool = \"all\"\nauth = \"api_key\"\nrule = {{ type = \"round_robin\" }}\n\
         [services.match]\nmodels = [\"keyed\"]\n",
        c.rules()
    );
    std::fs::write(c.dir.path().join("rules.toml"), rules).unwrap();
    for g in 0..3 {
        c.start_gateway(g);
    }
    let call = |c: &Cluster,
                g: usize,
                method: reqwest::Method,
                path: &str,
                body: Option<serde_json::Value>,
                key: Option<&str>| {
        let url = format!("http://{}{path}", c.gw(g).listen_addr);
        c.rt.block_on(async {
            let mut r = c.http.request(method, url);
            if let Some(b) = body {
                r = r.json(&b);
            }
            if let Some(k) = key {
                r = r.bearer_auth(k);
            }
            Reply::read(r.send().await.unwrap()).await
        })
    };
    let ask = |c: &Cluster, g: usize, body: serde_json::Value| {
        call(
            c,
            g,
            reqwest::Method::POST,
            "/v1/responses",
            Some(body),
            None,
        )
    };
    let id_of = |r: &Reply| -> String {
        assert_eq!(r.status, 200, "{}", r.text());
        r.json()["id"].as_str().unwrap().to_owned()
    };
    // Turn 1 through replica 1; turn 2 at once through replica 2 (the turn reaches Redis after
    // turn 1's answer ended: replica 2 reads again for up to 200 ms); turn 3 through replica 3.
    let r1 = ask(
        &c,
        0,
        json!({"model": "smol", "input": "The first question, about lighthouses.", "max_output_tokens": 4}),
    );
    let (id1, in1) = (
        id_of(&r1),
        r1.json()["usage"]["input_tokens"].as_u64().unwrap(),
    );
    let r2 = ask(
        &c,
        1,
        json!({"model": "smol", "previous_response_id": id1, "input": "And then?", "max_output_tokens": 4}),
    );
    let id2 = id_of(&r2);
    assert!(
        r2.json()["usage"]["input_tokens"].as_u64().unwrap() > in1,
        "{}",
        r2.text()
    );
    let r3 = ask(
        &c,
        2,
        json!({"model": "smol", "previous_response_id": id2, "input": "Third.", "max_output_tokens": 4, "stream": true}),
    );
    assert_eq!(r3.status, 200, "{}", r3.text());
    let got = call(
        &c,
        2,
        reqwest::Method::GET,
        &format!("/v1/responses/{id2}"),
        None,
        None,
    );
    assert_eq!(got.status, 200, "{}", got.text());
    assert_eq!(got.json()["previous_response_id"], json!(id1));
    // Deleted through replica 3: replica 1, which stored turn 1 and kept its copy, drops the
    // copy at once (the deletion is published), and no longer continues it, nor serves it.
    assert!(c.gw(0).data.responses.peek(&id1).is_some());
    let d = call(
        &c,
        2,
        reqwest::Method::DELETE,
        &format!("/v1/responses/{id1}"),
        None,
        None,
    );
    assert_eq!(d.status, 200, "{}", d.text());
    c.wait_for("replica 1 drops its copy", Duration::from_secs(2), || {
        c.gw(0).data.responses.peek(&id1).is_none()
    });
    let r = ask(
        &c,
        0,
        json!({"model": "smol", "previous_response_id": id2, "input": "Fourth."}),
    );
    assert_eq!(r.status, 400, "{}", r.text());
    assert_eq!(r.json()["error"]["code"], "previous_response_not_found");
    assert!(r.text().contains(&id1), "{}", r.text());
    assert_eq!(
        call(
            &c,
            0,
            reqwest::Method::GET,
            &format!("/v1/responses/{id1}"),
            None,
            None
        )
        .status,
        404
    );
    // A tenant's turn, made through replica 1: replica 2 serves it to the tenant's key only.
    let mine = call(
        &c,
        0,
        reqwest::Method::POST,
        "/v1/responses",
        Some(json!({"model": "keyed", "input": "Mine.", "max_output_tokens": 3})),
        Some("tenant-key"),
    );
    let mine = id_of(&mine);
    let path = format!("/v1/responses/{mine}");
    c.wait_for("the tenant's turn in Redis", Duration::from_secs(5), || {
        call(&c, 1, reqwest::Method::GET, &path, None, Some("tenant-key")).status == 200
    });
    assert_eq!(
        call(&c, 1, reqwest::Method::GET, &path, None, None).status,
        404
    );
    assert_eq!(
        call(&c, 1, reqwest::Method::GET, &path, None, Some("wrong-key")).status,
        404
    );
    let r = call(
        &c,
        2,
        reqwest::Method::POST,
        "/v1/responses",
        Some(
            json!({"model": "keyed", "previous_response_id": mine, "input": "More.", "max_output_tokens": 3}),
        ),
        Some("tenant-key"),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    // A turn replica 2 holds a copy of, to be deleted through replica 1 while Redis is away.
    let doomed = id_of(&ask(
        &c,
        0,
        json!({"model": "smol", "input": "Delete me later.", "max_output_tokens": 3}),
    ));
    let doomed_path = format!("/v1/responses/{doomed}");
    c.wait_for("replica 2 reads the turn", Duration::from_secs(5), || {
        call(&c, 1, reqwest::Method::GET, &doomed_path, None, None).status == 200
    });
    // The replicas' turns in Redis, as each replica's sync reads them, within the budget.
    let shared = |c: &Cluster, g: usize| {
        c.admin(g, reqwest::Method::GET, "/admin/cluster", None)
            .json()["stored_responses"]
            .clone()
    };
    c.wait_for(
        "the stored bytes in /admin/cluster",
        Duration::from_secs(5),
        || shared(&c, 2)["bytes_in_redis"].as_u64().unwrap_or(0) > 0,
    );
    assert_eq!(
        shared(&c, 2)["budget_bytes"].as_u64(),
        Some(gateway::cluster::DEFAULT_RESPONSE_BUDGET)
    );
    // Redis gone: each replica goes on with the turns it holds; no request fails for it.
    let redis_port = c.redis.port;
    c.redis.kill();
    let r = ask(
        &c,
        0,
        json!({"model": "smol", "input": "While Redis is away.", "max_output_tokens": 3}),
    );
    let away = id_of(&r);
    let r = ask(
        &c,
        0,
        json!({"model": "smol", "previous_response_id": away, "input": "Still here?", "max_output_tokens": 3}),
    );
    let still = id_of(&r);
    // Both turns wait in replica 1's write backlog for Redis.
    c.wait_for(
        "the turns made while Redis is away wait for it",
        Duration::from_secs(5),
        || shared(&c, 0)["pending_writes"] == 2,
    );
    assert!(shared(&c, 0)["pending_write_bytes"].as_u64().unwrap() > 0);
    let waiting = |c: &Cluster, what: &str| -> String {
        let m = c.admin(0, reqwest::Method::GET, "/metrics", None);
        let text = String::from_utf8_lossy(&m.body).to_string();
        gateway_support::promtool_check(&text, "a replica's /metrics while Redis is away");
        let series = format!("kvgate_gateway_cluster_waiting_for_redis{{what=\"{what}\"}} ");
        text.lines()
            .find_map(|l| l.strip_prefix(&series))
            .unwrap_or_else(|| panic!("no {series}in {text}"))
            .to_owned()
    };
    assert_eq!(waiting(&c, "turns"), "2");
    let d = call(&c, 0, reqwest::Method::DELETE, &doomed_path, None, None);
    assert_eq!(d.status, 200, "{}", d.text());
    assert_eq!(
        call(&c, 0, reqwest::Method::GET, &doomed_path, None, None).status,
        404
    );
    // Replica 2 cannot know yet: it serves its copy.
    assert_eq!(
        call(&c, 1, reqwest::Method::GET, &doomed_path, None, None).status,
        200
    );
    assert_eq!(shared(&c, 0)["pending_deletes"], 1);
    assert_eq!(waiting(&c, "deletions"), "1");
    // Redis back (empty: it keeps nothing on disk here). Replica 1 writes the deletion it
    // made meanwhile, and replica 2 drops its copy at its next read.
    c.redis = Redis::start(redis_port, tempfile::tempdir().unwrap());
    c.wait_for("replicas back", Duration::from_secs(10), || {
        (0..3).all(|g| {
            c.admin(g, reqwest::Method::GET, "/admin/cluster", None)
                .json()["state"]
                == "ok"
        })
    });
    c.wait_for(
        "the deletion reaches replica 2 through Redis",
        Duration::from_secs(5),
        || call(&c, 1, reqwest::Method::GET, &doomed_path, None, None).status == 404,
    );
    c.wait_for("no deletion waits", Duration::from_secs(5), || {
        shared(&c, 0)["pending_deletes"] == 0
    });
    assert_eq!(
        call(&c, 2, reqwest::Method::GET, &doomed_path, None, None).status,
        404
    );
    // The two turns replica 1 stored while Redis was away are written there now: replica 2
    // continues the conversation, whose turns it never saw.
    c.wait_for("no turn waits for Redis", Duration::from_secs(5), || {
        shared(&c, 0)["pending_writes"] == 0
    });
    assert_eq!(shared(&c, 0)["pending_write_bytes"], 0);
    assert_eq!(waiting(&c, "turns"), "0");
    assert_eq!(waiting(&c, "deletions"), "0");
    let r = ask(
        &c,
        1,
        json!({"model": "smol", "previous_response_id": still, "input": "Yes.", "max_output_tokens": 3}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let got = call(
        &c,
        2,
        reqwest::Method::GET,
        &format!("/v1/responses/{still}"),
        None,
        None,
    );
    assert_eq!(
        got.json()["previous_response_id"],
        json!(away),
        "{}",
        got.text()
    );
    let report = c.stop_and_audit();
    assert!(report.ok(), "{report}");
}

/// What a replica keeps for Redis while Redis is away — turns, a deletion, a conversation
/// change — is kept in its `--response-store-file` when it stops, and written to Redis after
/// it starts again; at a stop while Redis answers, it is written before the replica goes.
#[test]
fn what_waits_for_redis_is_kept_across_a_replica_restart() {
    let mut c = Cluster::new(2, 3);
    let file = c.dir.path().join("responses-gw-1.jsonl");
    let with_file = |cfg: &mut GatewayConfig| cfg.response_file = Some(file.clone());
    c.start_gateway_with(0, with_file);
    c.start_gateway(1);
    let ask = |c: &Cluster, g: usize, body: serde_json::Value| -> String {
        let r = c.call(g, reqwest::Method::POST, "/v1/responses", Some(body));
        assert_eq!(r.status, 200, "{}", r.text());
        r.json()["id"].as_str().unwrap().to_owned()
    };
    let status =
        |c: &Cluster, g: usize, path: &str| c.call(g, reqwest::Method::GET, path, None).status;
    let shared = |c: &Cluster, g: usize| {
        c.admin(g, reqwest::Method::GET, "/admin/cluster", None)
            .json()["stored_responses"]
            .clone()
    };
    let waiting_lines = |kind: &str| -> usize {
        let text = std::fs::read_to_string(&file).unwrap_or_default();
        let tag = format!("{{\"redis\":\"{kind}\"");
        text.lines().filter(|l| l.starts_with(&tag)).count()
    };
    let items = |c: &Cluster, g: usize, conv: &str| -> Vec<String> {
        let r = c.call(
            g,
            reqwest::Method::GET,
            &format!("/v1/conversations/{conv}/items?order=asc"),
            None,
        );
        assert_eq!(r.status, 200, "{}", r.text());
        item_texts(&r)
    };
    // Before the outage: a conversation made through replica 1 (replica 2 never reads it), and
    // a turn replica 2 holds a copy of.
    let made = c.call(
        0,
        reqwest::Method::POST,
        "/v1/conversations",
        Some(json!({"items": [{"role": "user", "content": "Before."}]})),
    );
    assert_eq!(made.status, 200, "{}", made.text());
    let conv = made.json()["id"].as_str().unwrap().to_owned();
    let doomed = ask(
        &c,
        1,
        json!({"model": "smol", "input": "Delete me while Redis is away.", "max_output_tokens": 3}),
    );
    let doomed_path = format!("/v1/responses/{doomed}");
    c.wait_for(
        "replica 1 reads replica 2's turn",
        Duration::from_secs(5),
        || status(&c, 0, &doomed_path) == 200,
    );
    // Redis away: replica 1 stores two turns of a conversation, deletes the turn and adds an
    // item to the conversation; all four wait for Redis.
    let redis_port = c.redis.port;
    c.redis.kill();
    let away = ask(
        &c,
        0,
        json!({"model": "smol", "input": "While Redis is away.", "max_output_tokens": 3}),
    );
    let still = ask(
        &c,
        0,
        json!({"model": "smol", "previous_response_id": away, "input": "Still here?", "max_output_tokens": 3}),
    );
    let d = c.call(0, reqwest::Method::DELETE, &doomed_path, None);
    assert_eq!(d.status, 200, "{}", d.text());
    let added = c.call(
        0,
        reqwest::Method::POST,
        &format!("/v1/conversations/{conv}/items"),
        Some(json!({"items": [{"role": "user", "content": "During."}]})),
    );
    assert_eq!(added.status, 200, "{}", added.text());
    c.wait_for(
        "the outage's changes wait for Redis",
        Duration::from_secs(5),
        || {
            let s = shared(&c, 0);
            s["pending_writes"] == 2 && s["pending_deletes"] == 1
        },
    );
    assert_eq!(c.gw(0).data.responses.pending.len(), 1);
    // Replica 1 stops while Redis is still away: its file keeps what waits.
    let started = Instant::now();
    c.gateways[0].take().unwrap().shutdown();
    println!("replica stopped in {:?} with Redis away", started.elapsed());
    assert_eq!(
        [
            waiting_lines("write"),
            waiting_lines("delete"),
            waiting_lines("conversation")
        ],
        [2, 1, 1],
        "{}",
        std::fs::read_to_string(&file).unwrap()
    );
    // Redis back, empty; replica 1 back from its file: it writes what waited.
    c.redis = Redis::start(redis_port, tempfile::tempdir().unwrap());
    c.start_gateway_with(0, with_file);
    c.wait_for(
        "nothing waits on replica 1",
        Duration::from_secs(10),
        || {
            let s = shared(&c, 0);
            s["pending_writes"] == 0
                && s["pending_deletes"] == 0
                && c.gw(0).data.responses.pending.is_empty()
        },
    );
    // Replica 2 continues the conversation whose turns it never saw, no longer serves the turn
    // deleted during the outage, and reads the conversation with the item added then.
    let r = c.call(
        1,
        reqwest::Method::POST,
        "/v1/responses",
        Some(
            json!({"model": "smol", "previous_response_id": still, "input": "Yes.", "max_output_tokens": 3}),
        ),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let got = c.call(
        1,
        reqwest::Method::GET,
        &format!("/v1/responses/{still}"),
        None,
    );
    assert_eq!(
        got.json()["previous_response_id"],
        json!(away),
        "{}",
        got.text()
    );
    c.wait_for(
        "the deletion reaches replica 2",
        Duration::from_secs(5),
        || status(&c, 1, &doomed_path) == 404,
    );
    assert_eq!(items(&c, 1, &conv), ["Before.", "During."]);
    // Redis away again: a turn waits; Redis back, and replica 1 stopped at once, before its
    // own retry: the stop writes it, and the file keeps nothing for Redis.
    c.redis.kill();
    let late = ask(
        &c,
        0,
        json!({"model": "smol", "input": "Just before the stop.", "max_output_tokens": 3}),
    );
    c.wait_for("the turn waits for Redis", Duration::from_secs(5), || {
        shared(&c, 0)["pending_writes"] == 1
    });
    c.redis = Redis::start(redis_port, tempfile::tempdir().unwrap());
    let started = Instant::now();
    c.gateways[0].take().unwrap().shutdown();
    println!("replica stopped in {:?} with Redis back", started.elapsed());
    assert_eq!(
        waiting_lines("write"),
        0,
        "{}",
        std::fs::read_to_string(&file).unwrap()
    );
    c.wait_for("replica 2 back", Duration::from_secs(10), || {
        c.admin(1, reqwest::Method::GET, "/admin/cluster", None)
            .json()["state"]
            == "ok"
    });
    assert_eq!(status(&c, 1, &format!("/v1/responses/{late}")), 200);
    let report = c.stop_and_audit();
    assert!(report.ok(), "{report}");
}

/// The replicas' stored turns in Redis stay within the budget: the least recently used (stored
/// or read) go first, a deletion or an expiry frees its bytes, and the byte count is the sum
/// of what is listed.
#[test]
fn stored_responses_in_redis_stay_within_the_budget() {
    let (rt, _redis, store) = fresh_store("responses-budget");
    rt.block_on(async {
        let ttl = Duration::from_secs(60);
        let value =
            |t: usize| format!("{{\"id\":\"resp_{t:03}\",\"pad\":\"{}\"}}", "x".repeat(980));
        let len = value(0).len() as u64;
        let budget = 4 * len + len / 2;
        let now = receipts::now_ms();
        let put = |t: usize, at: u64| {
            let store = &store;
            let v = value(t);
            async move {
                store
                    .put_response(&format!("resp_{t}"), &v, ttl, budget, at)
                    .await
                    .unwrap()
            }
        };
        for t in 0..4 {
            assert_eq!(put(t, now + t as u64).await, Some(0), "turn {t}");
        }
        assert_eq!(store.response_bytes().await.unwrap(), 4 * len);
        // Reading turn 0 makes turn 1 the least recently used.
        let read = store
            .responses(&[("resp_0".into(), false)], ttl, now + 10)
            .await
            .unwrap();
        assert!(read[0].is_some());
        assert_eq!(put(4, now + 11).await, Some(1));
        let present = |ids: Vec<usize>| {
            let store = &store;
            async move {
                let reads: Vec<(String, bool)> =
                    ids.iter().map(|t| (format!("resp_{t}"), true)).collect();
                store
                    .responses(&reads, ttl, now + 12)
                    .await
                    .unwrap()
                    .iter()
                    .map(Option::is_some)
                    .collect::<Vec<bool>>()
            }
        };
        assert_eq!(
            present(vec![0, 1, 2, 3, 4]).await,
            [true, false, true, true, true]
        );
        assert_eq!(store.response_bytes().await.unwrap(), 4 * len);
        // An id taken is not stored again, nor counted twice.
        assert_eq!(put(4, now + 13).await, None);
        assert_eq!(store.response_bytes().await.unwrap(), 4 * len);
        // A deletion frees its bytes; its marker is not listed.
        assert!(store
            .retire_response("resp_2", ttl)
            .await
            .unwrap()
            .is_some());
        assert_eq!(store.response_bytes().await.unwrap(), 3 * len);
        assert_eq!(put(2, now + 14).await, None, "a deleted id stays deleted");
        assert_eq!(put(5, now + 16).await, Some(0));
        assert_eq!(store.response_bytes().await.unwrap(), 4 * len);
        // Turns idle past the TTL (their keys expired) are unlisted at the next store (every
        // turn has the replicas' one idle TTL; here 100 ms, on the real clock).
        let brief = cluster::Store::connect(&_redis.url(), "responses-brief")
            .await
            .unwrap();
        let short = Duration::from_millis(100);
        brief
            .put_response("resp_a", &value(7), short, budget, receipts::now_ms())
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_millis(250)).await;
        brief
            .put_response("resp_b", &value(8), short, budget, receipts::now_ms())
            .await
            .unwrap();
        assert_eq!(brief.response_bytes().await.unwrap(), len);
        // Without a budget nothing is evicted.
        for t in 10..20 {
            assert_eq!(
                store
                    .put_response(&format!("resp_{t}"), &value(t), ttl, 0, now + 20)
                    .await
                    .unwrap(),
                Some(0)
            );
        }
        assert_eq!(store.response_bytes().await.unwrap(), 14 * len);
    });
}

/// What a continuation through another replica adds in cluster mode: one pipelined `GETEX` of
/// a conversation's turns (`cluster::Store::responses`), against a `PING` on the same
/// connection. Run with `--ignored --nocapture`; figures in docs/benchmarks.md.
#[test]
#[ignore]
fn stored_response_reads_against_ping() {
    let (rt, _redis, store) = fresh_store("responses-timing");
    rt.block_on(async {
        let ttl = Duration::from_secs(60);
        let turn = |t: usize| {
            let text = "lighthouse keepers tended the lamps through the winter storms ".repeat(16);
            gateway::response_store::StoredResponse::new(
                format!("resp_{t}"),
                None,
                (0..t).map(|p| format!("resp_{p}")).collect(),
                vec![json!({"role": "user", "content": text})],
                json!({"id": format!("resp_{t}"), "object": "response", "status": "completed",
                       "output": [{"type": "message", "role": "assistant",
                                   "content": [{"type": "output_text", "text": text}]}]}),
            )
        };
        for t in 0..64 {
            let r = turn(t);
            store
                .put_response(&r.id, &r.to_json(), ttl, 0, receipts::now_ms())
                .await
                .unwrap();
        }
        let n = 500u32;
        for round in 0..2 {
            let t = Instant::now();
            for _ in 0..n {
                store.ping().await.unwrap();
            }
            let ping = t.elapsed() / n;
            let mut line = format!("round {round}: PING {ping:?}");
            for k in [1usize, 4, 16, 64] {
                for whole in [true, false] {
                    let reads: Vec<(String, bool)> =
                        (0..k).map(|p| (format!("resp_{p}"), whole)).collect();
                    let t = Instant::now();
                    for _ in 0..n {
                        let got = store
                            .responses(&reads, ttl, receipts::now_ms())
                            .await
                            .unwrap();
                        assert!(got.iter().all(Option::is_some));
                    }
                    let each = t.elapsed() / n;
                    let how = if whole { "read" } else { "probed" };
                    line.push_str(&format!(
                        ", {k} turns {how} {each:?} ({:.1}× PING)",
                        each.as_secs_f64() / ping.as_secs_f64()
                    ));
                }
            }
            // The same 64 whole reads without the LRU touch (`ZADD … XX` per turn, which keeps
            // the shared turns within `--cluster-response-mb`): what the read cost before it.
            let client = redis::Client::open(_redis.url()).unwrap();
            let mut con = client.get_multiplexed_async_connection().await.unwrap();
            let t = Instant::now();
            for _ in 0..n {
                let mut pipe = redis::pipe();
                for p in 0..64 {
                    pipe.cmd("GETEX")
                        .arg(format!("responses-timing:response:resp_{p}"))
                        .arg("PX")
                        .arg(60_000);
                }
                let got: Vec<Option<String>> = pipe.query_async(&mut con).await.unwrap();
                assert!(got.iter().all(Option::is_some));
            }
            let bare = t.elapsed() / n;
            line.push_str(&format!(
                ", 64 turns read without the LRU touch {bare:?} ({:.1}× PING)",
                bare.as_secs_f64() / ping.as_secs_f64()
            ));
            // What a replica then does with a whole read: parse every turn.
            let ids: Vec<(String, bool)> = (0..64).map(|p| (format!("resp_{p}"), true)).collect();
            let values = store
                .responses(&ids, ttl, receipts::now_ms())
                .await
                .unwrap();
            let t = Instant::now();
            for _ in 0..n {
                for v in values.iter().flatten() {
                    assert!(gateway::response_store::StoredResponse::from_json(v).is_some());
                }
            }
            line.push_str(&format!(", parsing 64 turns read {:?}", t.elapsed() / n));
            println!(
                "{line} (mean of {n} each; one turn's JSON {} bytes)",
                turn(1).to_json().len()
            );
        }
    });
}

/// A background response accepted by one replica is polled through another to its answer, and
/// a long one is cancelled through a third: the replica running it stops it, and every replica
/// then reads it `cancelled`.
#[test]
fn background_responses_are_polled_and_cancelled_through_any_replica() {
    let mut c = Cluster::new(3, 3);
    std::fs::write(c.dir.path().join("rules.toml"), c.rules()).unwrap();
    for g in 0..3 {
        c.start_gateway(g);
    }
    let status = |c: &Cluster, g: usize, id: &str| -> String {
        let r = c.call(
            g,
            reqwest::Method::GET,
            &format!("/v1/responses/{id}"),
            None,
        );
        assert_eq!(r.status, 200, "{}", r.text());
        r.json()["status"].as_str().unwrap().to_owned()
    };
    let start = |c: &Cluster, g: usize, tokens: u64| -> String {
        let r = c.call(
            g,
            reqwest::Method::POST,
            "/v1/responses",
            Some(
                json!({"model": "smol", "input": format!("A question of {tokens} tokens."),
                        "max_output_tokens": tokens, "background": true}),
            ),
        );
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(r.json()["status"], "queued", "{}", r.text());
        r.json()["id"].as_str().unwrap().to_owned()
    };
    // Accepted by replica 1, read through replica 2 as it moves on, to its answer.
    let short = start(&c, 0, 4);
    c.wait_for(
        "the answer through replica 2",
        Duration::from_secs(10),
        || status(&c, 1, &short) == "incomplete",
    );
    assert_eq!(status(&c, 2, &short), "incomplete");
    // A long one, cancelled through replica 3 while replica 1 runs it.
    let long = start(&c, 0, 3000);
    c.wait_for(
        "in progress through replica 3",
        Duration::from_secs(10),
        || status(&c, 2, &long) == "in_progress",
    );
    assert!(c.gw(0).data.background.get(&long).is_some());
    let cancel = |c: &Cluster, g: usize, id: &str| {
        c.call(
            g,
            reqwest::Method::POST,
            &format!("/v1/responses/{id}/cancel"),
            None,
        )
    };
    let t = std::time::Instant::now();
    let r = cancel(&c, 2, &long);
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["status"], "cancelled", "{}", r.text());
    println!(
        "cancel through another replica answered in {:.1} ms",
        t.elapsed().as_secs_f64() * 1e3
    );
    c.wait_for("replica 1 drops the job", Duration::from_secs(2), || {
        c.gw(0).data.background.is_empty()
    });
    std::thread::sleep(Duration::from_millis(300));
    for g in 0..3 {
        assert_eq!(status(&c, g, &long), "cancelled", "replica {}", g + 1);
    }
    // A streamed one: its client reads a few events through replica 1 and goes; it resumes
    // through replica 2 while replica 1 still runs it, from the events replica 1 mirrors in
    // Redis, to the end.
    let data_of = |text: &str| -> Vec<serde_json::Value> {
        text.split("\n\n")
            .filter_map(|e| e.lines().find_map(|l| l.strip_prefix("data: ")))
            .map(|d| serde_json::from_str::<serde_json::Value>(d).unwrap())
            .collect()
    };
    let deltas = |events: &[serde_json::Value]| -> String {
        events
            .iter()
            .filter(|e| e["type"] == "response.output_text.delta")
            .map(|e| e["delta"].as_str().unwrap().to_owned())
            .collect()
    };
    // Starts a streamed background response through replica 1 and reads its first 8 events,
    // then hangs up.
    let first_events = |c: &Cluster, body: serde_json::Value| -> Vec<serde_json::Value> {
        c.rt.block_on(async {
            let url = format!("http://{}/v1/responses", c.gw(0).listen_addr);
            let mut r = c.http.post(url).json(&body).send().await.unwrap();
            let mut text = String::new();
            loop {
                let chunk = r.chunk().await.unwrap().expect("the stream ended early");
                text.push_str(&String::from_utf8_lossy(&chunk));
                if let Some(whole) = text.rfind("\n\n") {
                    let events = data_of(&text[..whole]);
                    if events.len() >= 8 {
                        return events;
                    }
                }
            }
        })
    };
    let first = first_events(
        &c,
        json!({"model": "smol", "input": "A streamed question.",
               "max_output_tokens": 300, "background": true, "stream": true}),
    );
    let id = first[0]["response"]["id"].as_str().unwrap().to_owned();
    let cursor = first.last().unwrap()["sequence_number"].as_u64().unwrap();
    assert!(
        c.gw(0).data.background.get(&id).is_some(),
        "still running on replica 1"
    );
    // Resumes `id` through replica 2 after event `cursor`: every later event, numbered on, to
    // the end; the first part and this one make the answer. The last event.
    let resumed = |c: &Cluster, id: &str, first: &[serde_json::Value], cursor: u64| {
        let r = c.call(
            1,
            reqwest::Method::GET,
            &format!("/v1/responses/{id}?stream=true&starting_after={cursor}"),
            None,
        );
        let rest = data_of(&r.text());
        assert_eq!(rest[0]["sequence_number"], cursor + 1, "{}", r.text());
        for w in rest.windows(2) {
            assert_eq!(
                w[1]["sequence_number"].as_u64(),
                w[0]["sequence_number"].as_u64().map(|n| n + 1),
                "{}",
                r.text()
            );
        }
        let last = rest.last().unwrap().clone();
        assert_eq!(last["type"], "response.incomplete", "{last}");
        let text = last["response"]["output"][0]["content"][0]["text"]
            .as_str()
            .unwrap();
        assert_eq!(format!("{}{}", deltas(first), deltas(&rest)), text);
        last
    };
    let last = resumed(&c, &id, &first, cursor);
    assert_eq!(last["response"]["usage"]["output_tokens"], 300);
    // A streamed one whose mirror missed events while Redis took no writes (paused): replica 1
    // fills the gap from its own log once Redis takes them again, so a resume through replica
    // 2 from before the pause still gets every event.
    let first = first_events(
        &c,
        json!({"model": "smol", "input": "A streamed question, paused.",
               "max_output_tokens": 1200, "temperature": 0,
               "background": true, "stream": true}),
    );
    let paused = first[0]["response"]["id"].as_str().unwrap().to_owned();
    let cursor = first.last().unwrap()["sequence_number"].as_u64().unwrap();
    assert_eq!(
        redis_command(c.redis.port, "CLIENT PAUSE 1500 WRITE"),
        "+OK"
    );
    let gaps = |c: &Cluster| {
        c.admin(0, reqwest::Method::GET, "/admin/cluster", None)
            .json()["stored_responses"]["stream_mirror_gaps"]
            .as_u64()
            .unwrap()
    };
    c.wait_for("a gap in the mirror", Duration::from_secs(5), || {
        gaps(&c) == 1
    });
    assert!(
        c.gw(0).data.background.get(&paused).is_some(),
        "still running on replica 1"
    );
    c.wait_for("the gap filled", Duration::from_secs(10), || gaps(&c) == 0);
    c.wait_for("its end on replica 1", Duration::from_secs(20), || {
        c.gw(0).data.background.get(&paused).is_none()
    });
    resumed(&c, &paused, &first, cursor);
    // A background response not streamed, resumed through another replica: its final event.
    let quiet = start(&c, 0, 4);
    c.wait_for("the quiet one's end", Duration::from_secs(10), || {
        status(&c, 1, &quiet) == "incomplete"
    });
    let r = c.call(
        2,
        reqwest::Method::GET,
        &format!("/v1/responses/{quiet}?stream=true"),
        None,
    );
    let only = data_of(&r.text());
    assert_eq!(only.len(), 1, "{}", r.text());
    assert_eq!(
        (&only[0]["type"], &only[0]["sequence_number"]),
        (&json!("response.incomplete"), &json!(0))
    );
    // A record left running by a replica that is gone (a crash: no last write) reads as failed;
    // one a live replica runs is left as it is.
    let store =
        c.rt.block_on(cluster::Store::connect(&c.redis.url(), "kvgate"))
            .unwrap();
    for (id, runner) in [("resp_orphan", "gw-gone"), ("resp_alive", "gw-1")] {
        let r = gateway::response_store::StoredResponse::new(
            id.into(),
            None,
            Vec::new(),
            vec![json!({"role": "user", "content": "x"})],
            json!({"id": id, "object": "response", "status": "in_progress", "background": true,
                   "output": [], "error": null}),
        )
        .run_by(runner);
        c.rt.block_on(store.replace_response(id, &r.to_json(), Duration::from_secs(60), 0, 1))
            .unwrap();
    }
    let orphan = c
        .call(1, reqwest::Method::GET, "/v1/responses/resp_orphan", None)
        .json();
    assert_eq!(orphan["status"], "failed", "{orphan}");
    assert_eq!(orphan["error"]["code"], "server_error", "{orphan}");
    assert_eq!(status(&c, 1, "resp_alive"), "in_progress");
    // A cancel whose message replica 1 missed (only its key is in Redis, as when replica 1 was
    // not subscribed as it was published): replica 1 finds it at its next check.
    let ask_long = |c: &Cluster, tokens: u64| -> String {
        let r = c.call(
            0,
            reqwest::Method::POST,
            "/v1/responses",
            Some(
                json!({"model": "smol", "input": format!("A long question of {tokens} tokens."),
                        "max_output_tokens": tokens, "temperature": 0, "background": true}),
            ),
        );
        assert_eq!(r.status, 200, "{}", r.text());
        let id = r.json()["id"].as_str().unwrap().to_owned();
        c.wait_for(
            "in progress through replica 2",
            Duration::from_secs(10),
            || status(c, 1, &id) == "in_progress",
        );
        id
    };
    let missed = ask_long(&c, 3000);
    assert_eq!(
        redis_command(c.redis.port, &format!("SET kvgate:cancel:{missed} 1")),
        "+OK"
    );
    c.wait_for("replica 1 finds the cancel", Duration::from_secs(5), || {
        c.gw(0).data.background.get(&missed).is_none()
    });
    assert_eq!(
        status(&c, 0, &missed),
        "cancelled",
        "ended by the cancel, not by itself"
    );
    c.wait_for(
        "cancelled through every replica",
        Duration::from_secs(5),
        || (0..3).all(|g| status(&c, g, &missed) == "cancelled"),
    );
    // A cancel asked through replica 2 while Redis is away waits there, and reaches replica 1
    // once Redis is back (empty).
    let cluster_of = |c: &Cluster, g: usize| {
        c.admin(g, reqwest::Method::GET, "/admin/cluster", None)
            .json()["stored_responses"]
            .clone()
    };
    let outage = ask_long(&c, 3500);
    let redis_port = c.redis.port;
    c.redis.kill();
    let r = cancel(&c, 1, &outage);
    // Answered with the record as replica 2 has it (its copy, still running), after its wait.
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["status"], "in_progress", "{}", r.text());
    c.wait_for(
        "the cancel waits on replica 2",
        Duration::from_secs(5),
        || cluster_of(&c, 1)["pending_cancels"] == 1,
    );
    assert!(
        c.gw(0).data.background.get(&outage).is_some(),
        "still running on replica 1"
    );
    c.redis = Redis::start(redis_port, tempfile::tempdir().unwrap());
    c.wait_for(
        "replica 1 cancels it once Redis is back",
        Duration::from_secs(8),
        || c.gw(0).data.background.get(&outage).is_none(),
    );
    assert_eq!(status(&c, 0, &outage), "cancelled");
    assert_eq!(cluster_of(&c, 1)["pending_cancels"], 0);
    // One that ends while Redis is away (and comes back empty): replica 1 keeps its last
    // record for Redis and writes it there once Redis answers, so the other replicas read the
    // end rather than nothing (or, had Redis kept its data, `in_progress` for as long as
    // replica 1 lives).
    let r = c.call(
        0,
        reqwest::Method::POST,
        "/v1/responses",
        Some(
            json!({"model": "smol", "input": "A question asked before an outage.",
                    "max_output_tokens": 1000, "temperature": 0, "background": true}),
        ),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let late = r.json()["id"].as_str().unwrap().to_owned();
    c.wait_for(
        "in progress through replica 2",
        Duration::from_secs(10),
        || status(&c, 1, &late) == "in_progress",
    );
    c.redis.kill();
    c.wait_for("its end on replica 1", Duration::from_secs(30), || {
        status(&c, 0, &late) == "incomplete"
    });
    let pending = |c: &Cluster| cluster_of(c, 0)["pending_writes"].as_u64().unwrap();
    c.wait_for(
        "its last record waits for Redis",
        Duration::from_secs(5),
        || pending(&c) >= 1,
    );
    c.redis = Redis::start(redis_port, tempfile::tempdir().unwrap());
    let ended = |c: &Cluster, g: usize| {
        let r = c.call(
            g,
            reqwest::Method::GET,
            &format!("/v1/responses/{late}"),
            None,
        );
        r.status == 200 && r.json()["status"] == "incomplete"
    };
    c.wait_for(
        "its end through replicas 2 and 3",
        Duration::from_secs(10),
        || ended(&c, 1) && ended(&c, 2),
    );
    assert_eq!(pending(&c), 0);
    let report = c.stop_and_audit();
    assert!(report.ok(), "{report}");
}

/// A stream mirror's append is idempotent: events the stream already has are skipped (a
/// write made again after its outcome was not known, a gap filled from an earlier event), the
/// end marker follows the last event once, and a batch past a hole is written after it.
#[test]
fn stream_mirror_appends_skip_what_the_stream_has() {
    let (rt, _redis, store) = fresh_store("mirror");
    // Events first..end of stream `id` (texts `e<n>`), then the end marker with `end`: the
    // entries added.
    let append = |id: &'static str, first: u64, r: std::ops::Range<u64>, end: bool| {
        let texts: Vec<String> = r.map(|n| format!("e{n}")).collect();
        let store = &store;
        async move { store.append_events(id, first, &texts, end).await.unwrap() }
    };
    rt.block_on(async {
        assert_eq!(append("r", 0, 0..4, false).await, 4);
        // 2..6 again from 2: only 4 and 5 are new.
        assert_eq!(append("r", 2, 2..6, false).await, 2);
        // The whole log again, ended: only the end marker.
        assert_eq!(append("r", 0, 0..6, true).await, 1);
        assert_eq!(append("r", 0, 0..6, true).await, 0);
        let all = store.events_after("r", 0, 100).await.unwrap();
        let mut want: Vec<cluster::StreamEntry> = (0..6)
            .map(|n| cluster::StreamEntry::Event(n, format!("e{n}")))
            .collect();
        want.push(cluster::StreamEntry::End(6));
        assert_eq!(all, want);
        // Past a hole (events 7..9 never written): written after it, the hole left as it is
        // (a resume reports it), nothing before it added again.
        assert_eq!(append("h", 0, 0..2, false).await, 2);
        assert_eq!(append("h", 7, 7..9, false).await, 2);
        assert_eq!(append("h", 1, 1..3, false).await, 0);
        let numbers: Vec<u64> = store
            .events_after("h", 0, 100)
            .await
            .unwrap()
            .iter()
            .map(|e| match e {
                cluster::StreamEntry::Event(n, _) | cluster::StreamEntry::End(n) => *n,
            })
            .collect();
        assert_eq!(numbers, [0, 1, 7, 8]);
    });
}

/// Conversations live in Redis: made through one replica, changed through the others at once
/// without losing a change (each write a compare-and-set on the record's revision), a turn
/// through one replica seen through the next, a deletion seen everywhere.
#[test]
fn conversations_are_shared_and_concurrent_changes_are_all_kept() {
    use sha2::Digest;
    let mut c = Cluster::new(3, 3);
    let key_hash = hex::encode(sha2::Sha256::digest(b"tenant-key"));
    let rules = format!(
        "{}\n[[tenants]]\nid = \"t\"\napi_keys_sha256 = [\"{key_hash}\"]\n\
         requests_per_second = 0.001\nrequest_burst = 3\n",
        c.rules()
    );
    std::fs::write(c.dir.path().join("rules.toml"), rules).unwrap();
    for g in 0..3 {
        c.start_gateway(g);
    }
    let send = |c: &Cluster,
                g: usize,
                method: reqwest::Method,
                path: &str,
                body: Option<serde_json::Value>| {
        let url = format!("http://{}{path}", c.gw(g).listen_addr);
        let mut r = c.http.request(method, url);
        if let Some(b) = body {
            r = r.json(&b);
        }
        async move { Reply::read(r.send().await.unwrap()).await }
    };
    let call =
        |c: &Cluster,
         g: usize,
         method: reqwest::Method,
         path: &str,
         body: Option<serde_json::Value>| { c.rt.block_on(send(c, g, method, path, body)) };
    let made = call(
        &c,
        0,
        reqwest::Method::POST,
        "/v1/conversations",
        Some(json!({"items": [{"role": "system", "content": "You are brief."}]})),
    );
    assert_eq!(made.status, 200, "{}", made.text());
    let id = made.json()["id"].as_str().unwrap().to_owned();
    // 30 items added at once, 10 through each replica.
    let adds: Vec<_> = (0..30)
        .map(|i| {
            send(
                &c,
                i % 3,
                reqwest::Method::POST,
                &format!("/v1/conversations/{id}/items"),
                Some(json!({"items": [{"role": "user", "content": format!("note {i}")}]})),
            )
        })
        .collect();
    let started = std::time::Instant::now();
    let replies = c.rt.block_on(futures::future::join_all(adds));
    let took = started.elapsed();
    let conflicts = replies.iter().filter(|r| r.status == 409).count();
    for r in &replies {
        assert!(r.status == 200 || r.status == 409, "{}", r.text());
    }
    let listed = |c: &Cluster, g: usize| -> Vec<String> {
        let r = call(
            c,
            g,
            reqwest::Method::GET,
            &format!("/v1/conversations/{id}/items?order=asc&limit=100"),
            None,
        );
        assert_eq!(r.status, 200, "{}", r.text());
        item_texts(&r)
    };
    let mut notes = listed(&c, 2);
    assert_eq!(notes.remove(0), "You are brief.");
    notes.sort();
    let mut want: Vec<String> = replies
        .iter()
        .enumerate()
        .filter(|(_, r)| r.status == 200)
        .map(|(i, _)| format!("note {i}"))
        .collect();
    want.sort();
    assert_eq!(
        notes, want,
        "an accepted change was lost, or a refused one kept"
    );
    assert!(conflicts <= 3, "{conflicts} of 30 changes gave up");
    println!(
        "30 concurrent item adds through 3 replicas: {} kept, {conflicts} refused (409), {took:?}",
        want.len()
    );
    for g in 0..2 {
        assert_eq!(listed(&c, g).len(), want.len() + 1, "replica {}", g + 1);
    }
    // A turn through replica 2; its items read through replica 3, and the next turn through
    // replica 1 is sent with them.
    let turn = |c: &Cluster, g: usize, text: &str| {
        let r = call(
            c,
            g,
            reqwest::Method::POST,
            "/v1/responses",
            Some(
                json!({"model": "smol", "conversation": id, "input": text, "max_output_tokens": 4}),
            ),
        );
        assert_eq!(r.status, 200, "{}", r.text());
        r.json()
    };
    let before = listed(&c, 2).len();
    let one = turn(&c, 1, "Where is the harbour?");
    c.wait_for(
        "the turn's items through replica 3",
        Duration::from_secs(5),
        || listed(&c, 2).len() == before + 2,
    );
    let two = turn(&c, 0, "And the ships?");
    assert!(
        two["usage"]["input_tokens"].as_u64() > one["usage"]["input_tokens"].as_u64(),
        "{one} {two}"
    );
    c.wait_for(
        "both turns through replica 2",
        Duration::from_secs(5),
        || listed(&c, 1).len() == before + 4,
    );
    // A tenant's conversation: only to its key, through any replica; a key that names no
    // tenant is refused.
    let keyed = |c: &Cluster, g: usize, method: reqwest::Method, path: &str, key: &str| {
        let url = format!("http://{}{path}", c.gw(g).listen_addr);
        let r = c
            .http
            .request(method, url)
            .bearer_auth(key)
            .json(&json!({}));
        c.rt.block_on(async { Reply::read(r.send().await.unwrap()).await })
    };
    let mine = keyed(
        &c,
        0,
        reqwest::Method::POST,
        "/v1/conversations",
        "tenant-key",
    );
    assert_eq!(mine.status, 200, "{}", mine.text());
    let mine = mine.json()["id"].as_str().unwrap().to_owned();
    let path = format!("/v1/conversations/{mine}");
    assert_eq!(
        keyed(&c, 1, reqwest::Method::GET, &path, "tenant-key").status,
        200
    );
    assert_eq!(call(&c, 1, reqwest::Method::GET, &path, None).status, 404);
    // Its calls count against its request rate (a burst of 3 here): the third passes, the
    // fourth is refused.
    assert_eq!(
        keyed(&c, 2, reqwest::Method::GET, &path, "tenant-key").status,
        200
    );
    let over = keyed(&c, 0, reqwest::Method::GET, &path, "tenant-key");
    assert_eq!(
        (over.status, &over.json()["error"]["code"]),
        (429, &json!("rate_limit_exceeded"))
    );
    let wrong = keyed(&c, 2, reqwest::Method::GET, &path, "wrong-key");
    assert_eq!(
        (wrong.status, &wrong.json()["error"]["code"]),
        (401, &json!("invalid_api_key"))
    );
    // Redis gone: an item added through replica 1 is made there and kept; Redis back (empty),
    // replica 1 writes it there, and replica 2 reads it.
    let redis_port = c.redis.port;
    let held = listed(&c, 1).len();
    c.redis.kill();
    let r = call(
        &c,
        0,
        reqwest::Method::POST,
        &format!("/v1/conversations/{id}/items"),
        Some(json!({"items": [{"role": "user", "content": "while Redis is away"}]})),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let pending = |c: &Cluster| {
        let r = c
            .admin(0, reqwest::Method::GET, "/admin/cluster", None)
            .json();
        r["stored_responses"]["pending_conversation_changes"]
            .as_u64()
            .unwrap()
    };
    assert_eq!(pending(&c), 1);
    c.redis = Redis::start(redis_port, tempfile::tempdir().unwrap());
    c.wait_for(
        "the change made while Redis was away, through replica 2",
        Duration::from_secs(10),
        || {
            let r = call(
                &c,
                1,
                reqwest::Method::GET,
                &format!("/v1/conversations/{id}/items?limit=1"),
                None,
            );
            r.status == 200 && r.json()["data"][0]["content"] == "while Redis is away"
        },
    );
    assert_eq!(listed(&c, 1).len(), held + 1);
    assert_eq!(pending(&c), 0);
    // Deleted through replica 3: gone through the others.
    let r = call(
        &c,
        2,
        reqwest::Method::DELETE,
        &format!("/v1/conversations/{id}"),
        None,
    );
    assert_eq!(r.status, 200, "{}", r.text());
    for g in 0..2 {
        let r = call(
            &c,
            g,
            reqwest::Method::GET,
            &format!("/v1/conversations/{id}"),
            None,
        );
        assert_eq!(r.status, 404, "replica {}: {}", g + 1, r.text());
    }
    let report = c.stop_and_audit();
    assert!(report.ok(), "{report}");
}
