//! Shared helpers of the gateway's end-to-end tests: a fleet of simulated workers started
//! in-process (the `worker` crate with `EngineChoice::Sim`, which still renders and tokenizes
//! with the real GGUF prompt profile), a rules file for them, and a gateway in front.
//!
//! Everything binds ephemeral ports on 127.0.0.1 and is stopped by `Fleet::stop` / `Drop`.
#![allow(dead_code)]

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use engine::sim::SimConfig;
use gateway::{GatewayConfig, RunningGateway};
use prompt_profile::PromptProfile;
use receipts::{KeyPair, KeyRing};
use worker::{EngineChoice, RunningWorker, TicketPolicy, WorkerConfig};

/// A free port on 127.0.0.1 (bound, then released: whoever binds it next must do so soon).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// The default model file (its prompt profile; sim workers never load weights).
pub fn model_path() -> PathBuf {
    let dir = std::env::var_os("KVGATE_MODEL_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("models"));
    let p = dir.join("SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(
        p.is_file(),
        "model file {} is missing: run scripts/fetch-model.sh (or set KVGATE_MODEL_DIR)",
        p.display()
    );
    p
}

/// How the fleet's simulated workers behave.
#[derive(Clone)]
pub struct FleetOptions {
    pub workers: usize,
    /// Sim timing; `SimConfig::instant` by default.
    pub sim: SimConfig,
    pub ticket_policy: TicketPolicy,
    /// The workers' block-key hash algorithm (and the pinned profile's).
    pub hash_algorithm: prefix_index::HashAlgorithm,
    /// Fault injection: worker `i`'s engine panics at its n-th forward step.
    pub faulty: Option<(usize, u64)>,
    /// Workers serve HTTPS with this material (the rules then name `https://127.0.0.1:port`).
    pub worker_tls: Option<tls::ServerTls>,
    /// A HF folder (`tokenizer.json`, `tokenizer_config.json`) to use as the profile of the
    /// workers and the gateway instead of the GGUF's.
    pub hf_profile: Option<PathBuf>,
    /// A GGUF (e.g. a vocabulary-only one with a chat template) to use as the profile of the
    /// workers and the gateway instead of the default model's.
    pub gguf_profile: Option<PathBuf>,
    /// Worker `i`'s engine limits instead of the defaults (e.g. a tiny queue, so it refuses).
    pub engine: Option<(usize, engine::EngineConfig)>,
}

impl Default for FleetOptions {
    fn default() -> Self {
        FleetOptions {
            workers: 3,
            sim: SimConfig::instant(16, 4096),
            ticket_policy: TicketPolicy::Require,
            hash_algorithm: prefix_index::HashAlgorithm::Xxh3,
            faulty: None,
            worker_tls: None,
            hf_profile: None,
            gguf_profile: None,
            engine: None,
        }
    }
}

/// Simulated workers plus a gateway.
pub struct Fleet {
    pub rt: tokio::runtime::Runtime,
    pub dir: tempfile::TempDir,
    pub profile: PromptProfile,
    pub gateway_key: KeyPair,
    pub worker_keys: Vec<KeyPair>,
    pub workers: Vec<Option<RunningWorker>>,
    pub addrs: Vec<SocketAddr>,
    pub opts: FleetOptions,
    pub gateway: Option<RunningGateway>,
    pub rules_path: PathBuf,
    pub http: reqwest::Client,
    pub admin_token: String,
}

fn worker_id(i: usize) -> String {
    format!("w{}", i + 1)
}

impl Fleet {
    /// Starts `opts.workers` simulated workers (no gateway yet).
    pub fn workers(opts: FleetOptions) -> Fleet {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let dir = tempfile::tempdir().unwrap();
        let profile = match &opts.hf_profile {
            Some(dir) => PromptProfile::from_hf(
                dir.join("tokenizer.json"),
                dir.join("tokenizer_config.json"),
            )
            .unwrap(),
            None => PromptProfile::from_gguf(opts.gguf_profile.clone().unwrap_or_else(model_path))
                .unwrap(),
        };
        let gateway_key = KeyPair::generate();
        let mut fleet = Fleet {
            rt,
            dir,
            profile,
            gateway_key,
            worker_keys: (0..opts.workers).map(|_| KeyPair::generate()).collect(),
            workers: Vec::new(),
            addrs: Vec::new(),
            opts: opts.clone(),
            gateway: None,
            rules_path: PathBuf::new(),
            http: reqwest::Client::new(),
            admin_token: "test-admin-token".into(),
        };
        for i in 0..opts.workers {
            let w = fleet.start_worker(i, None);
            fleet.addrs.push(w.addr());
            fleet.workers.push(Some(w));
        }
        fleet
    }

    /// Starts worker `i` (on `addr` when given: a restart on the same port).
    pub fn start_worker(&self, i: usize, addr: Option<SocketAddr>) -> RunningWorker {
        let mut ring = KeyRing::new();
        ring.insert("gateway", self.gateway_key.public().clone());
        // The sim must emit ids the profile's tokenizer knows.
        let mut sim = self.opts.sim.clone();
        sim.vocab_size = self.profile.vocab_size();
        if let Some((fi, step)) = self.opts.faulty {
            if fi == i {
                sim.panic_at_step = Some(step);
            }
        }
        let mut cfg = WorkerConfig::new(
            model_path(),
            EngineChoice::Sim(sim),
            self.worker_keys[i].clone(),
            self.dir
                .path()
                .join(format!("receipts-{}.jsonl", worker_id(i))),
            worker_id(i),
        );
        cfg.profile = Some(self.profile.clone());
        cfg.gateway_keys = ring;
        cfg.settings.ticket_policy = self.opts.ticket_policy;
        cfg.settings.hash_algorithm = self.opts.hash_algorithm;
        cfg.tls = self.opts.worker_tls.clone();
        if let Some((ei, engine)) = &self.opts.engine {
            if *ei == i {
                cfg.engine_config = engine.clone();
            }
        }
        self.rt.block_on(async {
            let listener = tokio::net::TcpListener::bind(
                addr.unwrap_or_else(|| "127.0.0.1:0".parse().unwrap()),
            )
            .await
            .unwrap();
            let w = worker::spawn(cfg, listener).await.unwrap();
            w.wait_ready(Duration::from_secs(30)).await.unwrap();
            w
        })
    }

    /// Stops worker `i`.
    pub fn stop_worker(&mut self, i: usize) {
        if let Some(w) = self.workers[i].take() {
            self.rt.block_on(w.shutdown());
        }
    }

    /// Restarts worker `i` on its old port.
    pub fn restart_worker(&mut self, i: usize) {
        let w = self.start_worker(i, Some(self.addrs[i]));
        self.workers[i] = Some(w);
    }

    /// The `[[profiles]]` table pinning the workers' profile (block size 16, xxh3).
    pub fn profile_toml(&self, id: &str, block_size: u32) -> String {
        let p = self.workers.iter().flatten().next().unwrap().profile();
        format!(
            r#"
[[profiles]]
id = "{id}"
model_id = "{}"
revision = "{}"
source = {}
template_sha256 = "{}"
tokenizer_sha256 = "{}"
block_size = {block_size}
hash_algorithm = "{}"
context_limit = {}
native_reserve_tokens = 0
"#,
            p.model_id,
            p.revision,
            match &self.opts.hf_profile {
                Some(dir) => format!(
                    "{{ tokenizer_json = \"{}\", tokenizer_config = \"{}\" }}",
                    dir.join("tokenizer.json").display(),
                    dir.join("tokenizer_config.json").display()
                ),
                None => format!(
                    "{{ gguf = \"{}\" }}",
                    self.opts
                        .gguf_profile
                        .clone()
                        .unwrap_or_else(model_path)
                        .display()
                ),
            },
            p.template_sha256,
            p.tokenizer_sha256,
            self.opts.hash_algorithm,
            p.context_limit,
        )
    }

    /// Workers, one pool `all`, the profile `smol`, and the given services (TOML).
    pub fn rules_toml(&self, services: &str) -> String {
        let mut s = String::from("[gateway]\nhealth_interval_ms = 100\n");
        let scheme = if self.opts.worker_tls.is_some() {
            "https"
        } else {
            "http"
        };
        for (i, a) in self.addrs.iter().enumerate() {
            s.push_str(&format!(
                "\n[[workers]]\nid = \"{}\"\nurl = \"{scheme}://{a}\"\n",
                worker_id(i)
            ));
        }
        let ids: Vec<String> = (0..self.addrs.len())
            .map(|i| format!("\"{}\"", worker_id(i)))
            .collect();
        s.push_str(&format!(
            "\n[[pools]]\nid = \"all\"\nworkers = [{}]\n",
            ids.join(", ")
        ));
        s.push_str(&self.profile_toml("smol", 16));
        s.push_str(services);
        s
    }

    /// Writes the rules and starts a gateway over them.
    pub fn start_gateway(&mut self, services: &str, decision_log: bool) {
        self.start_gateway_with(services, decision_log, |_| {});
    }

    /// [`Self::start_gateway`] with the configuration adjusted by `tweak`.
    pub fn start_gateway_with(
        &mut self,
        services: &str,
        decision_log: bool,
        tweak: impl FnOnce(&mut GatewayConfig),
    ) {
        self.rules_path = self.dir.path().join("rules.toml");
        std::fs::write(&self.rules_path, self.rules_toml(services)).unwrap();
        let mut cfg = GatewayConfig::new(&self.rules_path, self.gateway_key.clone());
        cfg.admin_token = Some(self.admin_token.clone());
        if decision_log {
            cfg.decision_log = Some(self.dir.path().join("decisions.jsonl"));
        }
        tweak(&mut cfg);
        self.gateway = Some(gateway::spawn(cfg).unwrap());
    }

    pub fn gw(&self) -> &RunningGateway {
        self.gateway.as_ref().unwrap()
    }

    /// The `Authorization` value the gateway's access token for worker `i` makes (what opens the
    /// worker's guarded endpoints such as `/v1/tokenize`).
    pub fn worker_access(&self, i: usize) -> String {
        let token = receipts::AccessToken::new(
            "gateway",
            &worker_id(i).as_str().into(),
            receipts::now_ms(),
        )
        .sign(&self.gateway_key);
        format!("Bearer {token}")
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.gw().listen_addr)
    }

    pub fn admin_url(&self, path: &str) -> String {
        format!("http://{}{path}", self.gw().admin_addr)
    }

    /// The gateway's `GET /metrics` (admin plane) as text.
    pub fn metrics(&self) -> String {
        self.rt.block_on(async {
            let r = self.http.get(self.admin_url("/metrics"));
            let r = r.bearer_auth(&self.admin_token).send().await.unwrap();
            r.text().await.unwrap()
        })
    }

    /// GETs `path` from the VIP, with `Authorization: Bearer <bearer>` when given.
    pub fn get(&self, path: &str, bearer: Option<&str>) -> Reply {
        self.rt.block_on(async {
            let mut r = self.http.get(self.url(path));
            if let Some(k) = bearer {
                r = r.bearer_auth(k);
            }
            Reply::read(r.send().await.unwrap()).await
        })
    }

    /// POSTs JSON to the VIP; returns (status, headers, body).
    pub fn post(&self, path: &str, body: &serde_json::Value, headers: &[(&str, &str)]) -> Reply {
        self.post_raw(path, serde_json::to_vec(body).unwrap(), headers)
    }

    pub fn post_raw(&self, path: &str, body: Vec<u8>, headers: &[(&str, &str)]) -> Reply {
        self.rt.block_on(async {
            let mut req = self
                .http
                .post(self.url(path))
                .header("content-type", "application/json")
                .body(body);
            for (k, v) in headers {
                req = req.header(*k, *v);
            }
            let r = req.send().await.unwrap();
            Reply::read(r).await
        })
    }

    /// POSTs `body` straight to worker `i`, past the gateway (no ticket: the fleet needs
    /// `TicketPolicy::Optional` for an answer other than 401).
    pub fn post_to_worker(&self, i: usize, path: &str, body: Vec<u8>) -> Reply {
        self.rt.block_on(async {
            let r = self
                .http
                .post(format!("http://{}{path}", self.addrs[i]))
                .header("content-type", "application/json")
                .body(body)
                .send()
                .await
                .unwrap();
            Reply::read(r).await
        })
    }

    /// Admin call with the bearer token.
    pub fn admin(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<serde_json::Value>,
    ) -> Reply {
        self.rt.block_on(async {
            let mut req = self
                .http
                .request(method, self.admin_url(path))
                .bearer_auth(&self.admin_token);
            if let Some(b) = body {
                req = req.json(&b);
            }
            Reply::read(req.send().await.unwrap()).await
        })
    }

    /// The workers of `GET /admin/workers` (empty when the answer has none).
    pub fn admin_workers(&self) -> Vec<serde_json::Value> {
        let w = self
            .admin(reqwest::Method::GET, "/admin/workers", None)
            .json();
        w["workers"].as_array().cloned().unwrap_or_default()
    }

    /// Worker `id` of `GET /admin/workers` (`null` when it is not listed).
    pub fn admin_worker(&self, id: &str) -> serde_json::Value {
        self.admin_workers()
            .into_iter()
            .find(|w| w["id"] == id)
            .unwrap_or_default()
    }

    /// Waits until `f` holds (polling every 10 ms), panicking after `timeout` with `what`.
    pub fn wait_for(&self, what: &str, timeout: Duration, mut f: impl FnMut() -> bool) {
        let deadline = Instant::now() + timeout;
        while !f() {
            assert!(Instant::now() < deadline, "timed out waiting for {what}");
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Waits until the gateway's index holds at least `blocks` blocks of worker `id`.
    pub fn wait_indexed(&self, id: &str, blocks: usize) {
        let wid = prefix_index::WorkerId(id.to_owned());
        self.wait_for(
            &format!("{blocks} indexed blocks of {id}"),
            Duration::from_secs(10),
            || {
                self.gw()
                    .data
                    .index
                    .worker_stats(&wid)
                    .map_or(0, |s| s.precise_blocks as usize)
                    >= blocks
            },
        );
    }

    /// A key ring with the gateway's and every worker's public key (for the audit).
    /// The audit of the gateway's decision log (`decisions.jsonl`) against every worker's
    /// receipt log.
    pub fn audit(&self) -> receipts::AuditReport {
        let logs: Vec<PathBuf> = (0..self.addrs.len())
            .map(|i| {
                self.dir
                    .path()
                    .join(format!("receipts-{}.jsonl", worker_id(i)))
            })
            .collect();
        receipts::audit(
            &self.dir.path().join("decisions.jsonl"),
            &logs,
            &self.key_ring(),
        )
        .unwrap()
    }

    pub fn key_ring(&self) -> KeyRing {
        let mut ring = KeyRing::new();
        ring.insert("gateway", self.gateway_key.public().clone());
        for (i, k) in self.worker_keys.iter().enumerate() {
            ring.insert(worker_id(i), k.public().clone());
        }
        ring
    }

    /// The receipt worker `i` wrote for `request_id`, read from its log file.
    /// For a routed answer: the index of the worker that served it, its receipt and the route
    /// ticket the receipt holds (panics when any is missing: a routed request has all three).
    pub fn routed(&self, r: &Reply) -> (usize, receipts::Receipt, receipts::RouteTicket) {
        let id = r.header("x-request-id").expect("request id");
        let i = r.worker().trim_start_matches('w').parse::<usize>().unwrap() - 1;
        let receipt = self.receipt(i, &id).expect("the worker's receipt");
        let ticket = receipt
            .body
            .ticket
            .as_ref()
            .expect("a ticketed request")
            .ticket_unverified()
            .clone();
        (i, receipt, ticket)
    }

    pub fn receipt(&self, i: usize, request_id: &str) -> Option<receipts::Receipt> {
        let path = self
            .dir
            .path()
            .join(format!("receipts-{}.jsonl", worker_id(i)));
        let text = std::fs::read_to_string(path).ok()?;
        text.lines()
            .rev()
            .filter_map(|l| receipts::Receipt::from_line(l.as_bytes()).ok())
            .find(|r| r.body.request_id == request_id)
    }

    /// Stops the gateway and the workers.
    pub fn stop(&mut self) {
        if let Some(mut g) = self.gateway.take() {
            g.shutdown();
        }
        for i in 0..self.workers.len() {
            self.stop_worker(i);
        }
    }
}

impl Drop for Fleet {
    fn drop(&mut self) {
        self.stop();
    }
}

/// A response read whole.
pub struct Reply {
    pub status: u16,
    pub headers: reqwest::header::HeaderMap,
    pub body: Vec<u8>,
}

impl Reply {
    pub async fn read(r: reqwest::Response) -> Reply {
        let status = r.status().as_u16();
        let headers = r.headers().clone();
        let body = r.bytes().await.unwrap().to_vec();
        Reply {
            status,
            headers,
            body,
        }
    }

    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(&self.body)))
    }

    /// The ids of a `GET /v1/models` list.
    pub fn model_ids(&self) -> Vec<String> {
        self.json()["data"]
            .as_array()
            .unwrap_or_else(|| panic!("not a model list: {}", self.text()))
            .iter()
            .map(|m| m["id"].as_str().unwrap().to_owned())
            .collect()
    }

    pub fn header(&self, name: &str) -> Option<String> {
        self.headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
    }

    /// The worker that served it (`x-kvgate-worker`).
    pub fn worker(&self) -> String {
        self.header("x-kvgate-worker").unwrap_or_else(|| {
            panic!(
                "no worker header; status {} body {}",
                self.status,
                self.text()
            )
        })
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    /// `usage.prompt_tokens_details.cached_tokens`.
    pub fn cached_tokens(&self) -> u64 {
        self.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap_or(0)
    }
}

/// A round-robin service over pool `all`.
pub const RR_SERVICE: &str = r#"
[[services]]
name = "chat"
pool = "all"
rule = { type = "round_robin" }
"#;

/// A kv_exact service over pool `all`, tenant-header salt.
pub const KV_SERVICE: &str = r#"
[[services]]
name = "chat"
pool = "all"
rule = { type = "kv_exact", profile = "smol", salt = { mode = "tenant_header", header = "x-tenant-id", allow_body_salt = true } }
"#;

/// A chat body.
pub fn chat(messages: &[(&str, &str)], max_tokens: u64) -> serde_json::Value {
    let msgs: Vec<serde_json::Value> = messages
        .iter()
        .map(|(r, c)| serde_json::json!({"role": r, "content": c}))
        .collect();
    serde_json::json!({"model": "smol", "messages": msgs, "max_tokens": max_tokens})
}

/// `$KVGATE_PROMTOOL`, `.cache/tools/bin/promtool`, or `promtool` on the PATH.
pub fn promtool() -> std::path::PathBuf {
    if let Some(p) = std::env::var_os("KVGATE_PROMTOOL") {
        return std::path::PathBuf::from(p);
    }
    let cached =
        std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(".cache/tools/bin/promtool");
    if cached.is_file() {
        return cached;
    }
    let on_path = std::process::Command::new("promtool")
        .arg("--version")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status();
    assert!(
        on_path.is_ok_and(|s| s.success()),
        "promtool is missing: run scripts/setup.sh (or set KVGATE_PROMTOOL)"
    );
    std::path::PathBuf::from("promtool")
}

/// `promtool check metrics` on an exposition: no error and no lint finding.
pub fn promtool_check(text: &str, what: &str) {
    use std::io::Write;
    let mut child = std::process::Command::new(promtool())
        .args(["check", "metrics"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("promtool runs");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    let report = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success() && report.trim().is_empty(),
        "promtool check metrics on the {what}:\n{report}\n--- exposition ---\n{text}"
    );
}
