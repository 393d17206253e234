//! Shared machinery of the end-to-end tests (`tests/e2e_fleet.rs`): a fleet of REAL SmolLM2
//! workers (`worker::spawn` with `EngineChoice::Model`) and a pingora gateway, all
//! in-process on ephemeral 127.0.0.1 ports, plus an OpenAI client (non-streaming and SSE) that
//! reads the gateway's routing headers.
//!
//! Owns: starting and stopping the fleet (a [`Fleet`] stops everything it started when dropped,
//! also while a failing test unwinds), the rules file (one `round_robin` and one `kv_exact`
//! service over the two workers, told apart by the body's `model`), the keys (one per worker
//! plus the gateway's, public halves written as `*.pub` for `kvgate receipts audit --keys`), and
//! the log paths the audit reads. Its only check is the generic one on a complete answer
//! ([`ChatReply::assert_complete`]); routing and receipt assertions live in the test file.
//!
//! Each worker runs on its own tokio runtime so that [`Fleet::kill_worker`] can end it the way a
//! `kill -9` would: the runtime is dropped with `shutdown_background`, which drops every task of
//! the worker at once (its listener, open connections and in-flight request drivers: no
//! response, no receipt); the engine thread and the receipt log are then reaped with
//! `RunningWorker::shutdown`. [`Fleet::stop_worker`] is the graceful stop.

#![allow(dead_code)]

use std::collections::BTreeMap;
use std::future::Future;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use engine::engine::EngineStats;
use futures::StreamExt;
use gateway::{GatewayConfig, RunningGateway};
use prefix_index::WorkerId;
use prompt_profile::PromptProfile;
use receipts::{DecisionRecord, KeyPair, KeyRing, Receipt};
use serde_json::{json, Value};
use worker::{EngineChoice, RunningWorker, TicketPolicy, WorkerConfig};

/// `model` of requests for the round-robin service.
pub const RR_MODEL: &str = "smol-rr";
/// `model` of requests for the KV-exact service.
pub const KV_MODEL: &str = "smol";
/// Service names in the rules file.
pub const RR_SERVICE: &str = "chat-rr";
pub const KV_SERVICE: &str = "chat-exact";
/// Worker ids.
pub const WORKER_IDS: [&str; 2] = ["w1", "w2"];
/// Preallocated KV cache per worker (≈ 1,400 SmolLM2 tokens in f32).
pub const KV_BUDGET_BYTES: usize = 64 << 20;
/// How long one model worker may take to load and answer its smoke inference.
pub const READY_TIMEOUT: Duration = Duration::from_secs(120);
/// Upper bound for one HTTP exchange in these tests.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(60);

/// The default model file: `$KVGATE_MODEL_DIR` or `<workspace>/models`, else a clear failure.
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

/// The model every worker of a [`Fleet`] embeds, and what the rules pin for it.
#[derive(Clone, Debug)]
pub struct FleetModel {
    /// The GGUF file.
    pub gguf: PathBuf,
    /// A Jinja chat template to use instead of the GGUF's (`--chat-template`; the profile
    /// pins it as `source = { gguf, chat_template }`).
    pub chat_template: Option<PathBuf>,
    /// The profile id in the rules.
    pub profile_id: &'static str,
    /// The workers' tool-call parser.
    pub tool_call_parser: Option<worker::output_parser::ToolCallFormat>,
    /// The KV-exact service takes a body's `cache_salt` (`salt = { mode = "per_request" }`)
    /// instead of refusing it.
    pub per_request_salt: bool,
}

impl FleetModel {
    /// SmolLM2-135M-Instruct, the default model (it writes Hermes-style calls when shown them;
    /// its template names no format).
    pub fn smollm2() -> FleetModel {
        FleetModel {
            gguf: model_path(),
            chat_template: None,
            profile_id: "smollm2",
            tool_call_parser: Some(worker::output_parser::ToolCallFormat::Hermes),
            per_request_salt: false,
        }
    }

    /// The prompt profile of the model (with the template file, when one is given).
    pub fn profile(&self) -> PromptProfile {
        match &self.chat_template {
            None => PromptProfile::from_gguf(&self.gguf),
            Some(t) => {
                let text = std::fs::read_to_string(t)
                    .unwrap_or_else(|e| panic!("chat template {}: {e}", t.display()));
                PromptProfile::from_gguf_with_template(&self.gguf, text)
            }
        }
        .expect("prompt profile of the model file")
    }
}

/// One worker and the runtime that drives it.
pub struct WorkerHost {
    pub id: String,
    pub addr: SocketAddr,
    pub receipt_log: PathBuf,
    rt: Option<tokio::runtime::Runtime>,
    worker: Option<RunningWorker>,
}

/// Two real model workers behind a gateway.
pub struct Fleet {
    /// The runtime of the test's HTTP clients.
    pub ctl: tokio::runtime::Runtime,
    pub dir: tempfile::TempDir,
    pub gateway_key: KeyPair,
    pub worker_keys: Vec<KeyPair>,
    pub hosts: Vec<WorkerHost>,
    pub gateway: Option<RunningGateway>,
    pub rules_path: PathBuf,
    pub decision_log: PathBuf,
    /// `*.pub` of the gateway and every worker (for `kvgate receipts audit --keys`).
    pub keys_dir: PathBuf,
    pub http: reqwest::Client,
}

fn runtime(threads: usize, name: &str) -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads)
        .thread_name(name)
        .enable_all()
        .build()
        .expect("tokio runtime")
}

/// The rules file: both workers in one pool, the profile pinned from `profile`'s identity, a
/// round-robin service (`model` = [`RR_MODEL`]) and a KV-exact one (`model` = [`KV_MODEL`]).
pub fn rules_toml(
    profile: &PromptProfile,
    model: &FleetModel,
    addrs: &[(String, SocketAddr)],
) -> String {
    let id = profile.identity();
    let mut s = String::from("[gateway]\nhealth_interval_ms = 100\n");
    for (wid, a) in addrs {
        s.push_str(&format!(
            "\n[[workers]]\nid = \"{wid}\"\nurl = \"http://{a}\"\n"
        ));
    }
    let ids: Vec<String> = addrs.iter().map(|(w, _)| format!("\"{w}\"")).collect();
    s.push_str(&format!(
        "\n[[pools]]\nid = \"local\"\nworkers = [{}]\n",
        ids.join(", ")
    ));
    let source = match &model.chat_template {
        None => format!("{{ gguf = {:?} }}", model.gguf.display().to_string()),
        Some(t) => format!(
            "{{ gguf = {:?}, chat_template = {:?} }}",
            model.gguf.display().to_string(),
            t.display().to_string()
        ),
    };
    s.push_str(&format!(
        "\n[[profiles]]\nid = {:?}\nmodel_id = {:?}\nrevision = {:?}\nsource = {source}\n\
         template_sha256 = {:?}\ntokenizer_sha256 = {:?}\nblock_size = 16\nhash_algorithm = \"xxh3\"\n\
         context_limit = {}\nnative_reserve_tokens = 0\n",
        model.profile_id,
        id.model_id,
        id.revision,
        id.template_sha256,
        id.tokenizer_sha256,
        id.context_limit,
    ));
    s.push_str(&format!(
        r#"
[[services]]
name = "{RR_SERVICE}"
pool = "local"
match = {{ path_prefix = "/v1/", models = ["{RR_MODEL}"] }}
rule = {{ type = "round_robin" }}

[[services]]
name = "{KV_SERVICE}"
pool = "local"
match = {{ path_prefix = "/v1/", models = ["{KV_MODEL}"] }}

[services.rule]
type = "kv_exact"
profile = "{}"
max_load_ratio = 1.5
min_match_tokens = 16
on_no_match = "least_loaded"
load_metric = "in_flight"
"#,
        model.profile_id
    ));
    if model.per_request_salt {
        s.push_str("salt = { mode = \"per_request\" }\n");
    }
    s
}

impl Fleet {
    /// Loads two model workers (in parallel), waits for their smoke inference, writes the keys
    /// and the rules, starts the gateway with a decision log, and waits until both workers are
    /// routable (healthy, contract checked, KV events connected).
    pub fn start() -> Fleet {
        Fleet::start_with(FleetModel::smollm2())
    }

    /// [`Fleet::start`] with `model` in every worker.
    pub fn start_with(model: FleetModel) -> Fleet {
        let dir = tempfile::tempdir().expect("tempdir");
        let profile = model.profile();
        let gateway_key = KeyPair::generate();
        let worker_keys: Vec<KeyPair> = WORKER_IDS.iter().map(|_| KeyPair::generate()).collect();
        let keys_dir = dir.path().join("keys");
        std::fs::create_dir_all(&keys_dir).expect("keys dir");
        gateway_key
            .write_to_dir(&keys_dir, "gateway")
            .expect("write gateway key");
        for (wid, k) in WORKER_IDS.iter().zip(&worker_keys) {
            k.write_to_dir(&keys_dir, wid).expect("write worker key");
        }
        let mut fleet = Fleet {
            ctl: runtime(2, "e2e-client"),
            decision_log: dir.path().join("decisions.jsonl"),
            rules_path: dir.path().join("rules.toml"),
            keys_dir,
            dir,
            gateway_key,
            worker_keys,
            hosts: Vec::new(),
            gateway: None,
            http: reqwest::Client::builder()
                .timeout(REQUEST_TIMEOUT)
                .build()
                .expect("http client"),
        };
        // Load both models at once (each load is seconds of CPU work on its own thread).
        let started: Vec<Result<WorkerHost, String>> = std::thread::scope(|s| {
            let handles: Vec<_> = WORKER_IDS
                .iter()
                .enumerate()
                .map(|(i, wid)| {
                    let cfg = fleet.worker_config(i, &model, &profile);
                    let log = cfg.receipt_log.clone();
                    s.spawn(move || start_worker(wid, cfg, log))
                })
                .collect();
            handles
                .into_iter()
                .map(|h| {
                    h.join()
                        .unwrap_or_else(|_| Err("worker start panicked".into()))
                })
                .collect()
        });
        let mut failures = Vec::new();
        for r in started {
            match r {
                Ok(h) => fleet.hosts.push(h),
                Err(e) => failures.push(e),
            }
        }
        // `fleet` drops (stopping what did start) if this fails.
        assert!(failures.is_empty(), "workers failed to start: {failures:?}");

        let addrs: Vec<(String, SocketAddr)> =
            fleet.hosts.iter().map(|h| (h.id.clone(), h.addr)).collect();
        std::fs::write(&fleet.rules_path, rules_toml(&profile, &model, &addrs))
            .expect("rules file");
        let mut cfg = GatewayConfig::new(&fleet.rules_path, fleet.gateway_key.clone());
        cfg.decision_log = Some(fleet.decision_log.clone());
        cfg.watch_rules = false;
        cfg.threads = 2;
        fleet.gateway = Some(gateway::spawn(cfg).expect("gateway start"));
        fleet.wait_routable(&WORKER_IDS);
        fleet
    }

    fn worker_config(&self, i: usize, model: &FleetModel, profile: &PromptProfile) -> WorkerConfig {
        let mut ring = KeyRing::new();
        ring.insert("gateway", self.gateway_key.public().clone());
        let mut cfg = WorkerConfig::new(
            &model.gguf,
            EngineChoice::Model {
                kv_budget_bytes: KV_BUDGET_BYTES,
                threads: 1,
                cuda: false,
            },
            self.worker_keys[i].clone(),
            self.dir
                .path()
                .join(format!("receipts-{}.jsonl", WORKER_IDS[i])),
            WORKER_IDS[i],
        );
        cfg.profile = Some(profile.clone());
        cfg.gateway_keys = ring;
        cfg.settings.ticket_policy = TicketPolicy::Require;
        cfg.settings.tool_call_parser = model.tool_call_parser;
        cfg
    }

    /// Runs `f` on the client runtime.
    pub fn block_on<F: Future>(&self, f: F) -> F::Output {
        self.ctl.block_on(f)
    }

    pub fn gw(&self) -> &RunningGateway {
        self.gateway.as_ref().expect("gateway running")
    }

    /// The VIP's base URL.
    pub fn base_url(&self) -> String {
        format!("http://{}", self.gw().listen_addr)
    }

    pub fn host(&self, id: &str) -> &WorkerHost {
        self.hosts
            .iter()
            .find(|h| h.id == id)
            .unwrap_or_else(|| panic!("no worker {id}"))
    }

    fn host_mut(&mut self, id: &str) -> &mut WorkerHost {
        self.hosts
            .iter_mut()
            .find(|h| h.id == id)
            .unwrap_or_else(|| panic!("no worker {id}"))
    }

    /// A running worker.
    pub fn running(&self, id: &str) -> &RunningWorker {
        self.host(id)
            .worker
            .as_ref()
            .unwrap_or_else(|| panic!("worker {id} is not running"))
    }

    /// The engine counters of a running worker.
    pub fn engine_stats(&self, id: &str) -> EngineStats {
        self.host(id)
            .worker
            .as_ref()
            .unwrap_or_else(|| panic!("worker {id} is not running"))
            .engine()
            .stats()
    }

    /// Every worker's receipt log, in `WORKER_IDS` order.
    pub fn receipt_logs(&self) -> Vec<PathBuf> {
        self.hosts.iter().map(|h| h.receipt_log.clone()).collect()
    }

    /// The gateway's and every worker's public key.
    pub fn key_ring(&self) -> KeyRing {
        let mut ring = KeyRing::new();
        ring.insert("gateway", self.gateway_key.public().clone());
        for (wid, k) in WORKER_IDS.iter().zip(&self.worker_keys) {
            ring.insert(*wid, k.public().clone());
        }
        ring
    }

    /// Polls `f` every 5 ms until it holds; panics with `what` after `timeout`.
    pub fn wait_for(&self, what: &str, timeout: Duration, mut f: impl FnMut() -> bool) {
        let deadline = Instant::now() + timeout;
        while !f() {
            assert!(
                Instant::now() < deadline,
                "timed out after {timeout:?} waiting for {what}"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Waits until the gateway sees each of `ids` healthy, contract-checked and with its KV
    /// event stream connected.
    pub fn wait_routable(&self, ids: &[&str]) {
        let shared = self.gw().data.clone();
        self.wait_for(
            "workers routable by the gateway",
            Duration::from_secs(20),
            || {
                let view = shared.views.load();
                ids.iter().all(|id| {
                    view.workers
                        .get(&WorkerId((*id).to_owned()))
                        .is_some_and(|e| {
                            e.healthy
                                && e.runtime.contract_ok()
                                && *e.runtime.events.lock()
                                    == gateway::view::EventStreamState::Connected
                        })
                })
            },
        );
    }

    /// Waits until the gateway's index holds every full block of the chat prompt `messages`
    /// (as the `kv_exact` service renders it, unsalted) on some worker.
    pub fn wait_prompt_indexed(&self, messages: &[(String, String)]) {
        let shared = self.gw().data.clone();
        let view = shared.views.load();
        let svc = view
            .services
            .iter()
            .find(|s| s.name() == KV_SERVICE)
            .expect("kv_exact service in the view")
            .clone();
        let profile = svc
            .profile()
            .cloned()
            .expect("kv_exact service has a profile");
        let msgs: Vec<prompt_profile::ChatMessage> = messages
            .iter()
            .map(|(r, c)| prompt_profile::ChatMessage::new(r.clone(), c.clone()))
            .collect();
        let tok = profile
            .keys(
                &prompt_profile::PromptSource::Chat(prompt_profile::ChatPrompt::new(msgs)),
                None,
            )
            .expect("gateway tokenizes the prompt");
        let want = tok.keys.len();
        assert!(want > 0, "the prompt fills no full block");
        self.wait_for(
            "the served prompt's blocks in the gateway index",
            Duration::from_secs(10),
            || {
                shared
                    .index
                    .longest_matches(&tok.keys)
                    .iter()
                    .any(|m| m.blocks >= want)
            },
        );
    }

    /// Waits until the decision log holds `n` complete lines; returns them.
    /// The decision log's records once it holds `n`, each keyed by the id the client sent
    /// (`client_request_id`; the gateway's own minted id is what tickets, receipts and the
    /// audit use — see [`client_ids`] to translate those).
    pub fn wait_decisions(&self, n: usize) -> Vec<DecisionRecord> {
        let mut records = Vec::new();
        self.wait_for(
            &format!("{n} lines in the decision log"),
            Duration::from_secs(10),
            || {
                records = read_decisions(&self.decision_log);
                records.len() >= n
            },
        );
        for r in &mut records {
            if let Some(c) = r.client_request_id.clone() {
                r.request_id = c;
            }
        }
        records
    }

    /// The gateway's request id → the id the client sent, from the decision log.
    pub fn client_ids(&self) -> BTreeMap<String, String> {
        read_decisions(&self.decision_log)
            .into_iter()
            .filter_map(|d| d.client_request_id.map(|c| (d.request_id, c)))
            .collect()
    }

    /// Ends worker `id` abruptly, like `kill -9`: its runtime is shut down, so its listener,
    /// connections and request drivers vanish without answering or writing a receipt. The
    /// engine thread and the receipt log are then reaped with `RunningWorker::shutdown` (which
    /// finds the server task already gone). The runtime's threads are waited for (up to 2 s)
    /// before that: with a shutdown in the background, a starved runtime thread could still
    /// write a request's `503 engine_stopped` once the engine stopped — an answer a killed
    /// process never gives, which the gateway rightly retries on another worker (seen once in
    /// CI on 2 busy cores: N1 of `e2e_fleet` answered by the survivor).
    pub fn kill_worker(&mut self, id: &str) {
        let host = self.host_mut(id);
        let (rt, w) = (host.rt.take(), host.worker.take());
        if let Some(rt) = rt {
            rt.shutdown_timeout(Duration::from_secs(2));
        }
        if let Some(w) = w {
            self.ctl.block_on(w.shutdown());
        }
    }

    /// Stops worker `id` gracefully (`RunningWorker::shutdown` on its own runtime).
    pub fn stop_worker(&mut self, id: &str) {
        let host = self.host_mut(id);
        let (rt, w) = (host.rt.take(), host.worker.take());
        if let (Some(rt), Some(w)) = (&rt, w) {
            rt.block_on(w.shutdown());
        }
        if let Some(rt) = rt {
            rt.shutdown_timeout(Duration::from_secs(2));
        }
    }

    /// Stops the gateway, then every worker still running.
    pub fn stop(&mut self) {
        if let Some(mut g) = self.gateway.take() {
            g.shutdown();
        }
        let ids: Vec<String> = self.hosts.iter().map(|h| h.id.clone()).collect();
        for id in ids {
            self.stop_worker(&id);
        }
    }
}

impl Drop for Fleet {
    fn drop(&mut self) {
        self.stop();
    }
}

fn start_worker(id: &str, cfg: WorkerConfig, receipt_log: PathBuf) -> Result<WorkerHost, String> {
    let rt = runtime(1, &format!("e2e-{id}"));
    let started = rt.block_on(async {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .map_err(|e| format!("{id}: bind: {e}"))?;
        let w = worker::spawn(cfg, listener)
            .await
            .map_err(|e| format!("{id}: spawn: {e}"))?;
        if let Err(e) = w.wait_ready(READY_TIMEOUT).await {
            w.shutdown().await;
            return Err(format!("{id}: not ready: {e}"));
        }
        Ok(w)
    });
    match started {
        Ok(w) => Ok(WorkerHost {
            id: id.to_owned(),
            addr: w.addr(),
            receipt_log,
            rt: Some(rt),
            worker: Some(w),
        }),
        Err(e) => {
            rt.shutdown_timeout(Duration::from_secs(2));
            Err(e)
        }
    }
}

/// The complete lines of a decision log.
pub fn read_decisions(path: &Path) -> Vec<DecisionRecord> {
    let Ok(bytes) = std::fs::read(path) else {
        return Vec::new();
    };
    bytes
        .split_inclusive(|b| *b == b'\n')
        .filter(|l| l.ends_with(b"\n"))
        .map(|l| DecisionRecord::from_line(&l[..l.len() - 1]).expect("decision line parses"))
        // The final line of each request (its write-ahead `routed` line is superseded).
        .filter(|d| d.phase.is_none())
        .collect()
}

/// The complete lines of a receipt log (parsed, not verified).
pub fn read_receipts(path: &Path) -> Vec<Receipt> {
    let Ok(bytes) = std::fs::read(path) else {
        return Vec::new();
    };
    bytes
        .split_inclusive(|b| *b == b'\n')
        .filter(|l| l.ends_with(b"\n"))
        .map(|l| Receipt::from_line(&l[..l.len() - 1]).expect("receipt line parses"))
        .collect()
}

/// One chat request to the gateway.
#[derive(Clone, Debug)]
pub struct Chat {
    pub model: &'static str,
    pub messages: Vec<(String, String)>,
    pub max_tokens: u32,
    pub stream: bool,
    pub request_id: String,
    /// `min_tokens` (the answer cannot end before; `None`: not sent).
    pub min_tokens: Option<u32>,
}

impl Chat {
    pub fn new(
        model: &'static str,
        request_id: &str,
        messages: &[(String, String)],
        max_tokens: u32,
        stream: bool,
    ) -> Chat {
        Chat {
            model,
            messages: messages.to_vec(),
            max_tokens,
            stream,
            request_id: request_id.to_owned(),
            min_tokens: None,
        }
    }

    /// The OpenAI body (greedy sampling; usage requested on streams).
    pub fn body(&self) -> Value {
        let msgs: Vec<Value> = self
            .messages
            .iter()
            .map(|(r, c)| json!({"role": r, "content": c}))
            .collect();
        let mut b = json!({
            "model": self.model,
            "messages": msgs,
            "max_tokens": self.max_tokens,
            "temperature": 0.0,
            "stream": self.stream,
        });
        if self.stream {
            b["stream_options"] = json!({"include_usage": true});
        }
        if let Some(m) = self.min_tokens {
            b["min_tokens"] = json!(m);
        }
        b
    }
}

/// What came back, read whole.
#[derive(Clone, Debug)]
pub struct ChatReply {
    pub request_id: String,
    pub status: u16,
    /// `x-kvgate-worker`.
    pub worker: Option<String>,
    /// `x-kvgate-route-reason`.
    pub reason: Option<String>,
    /// The assistant text (concatenated deltas when streaming).
    pub text: String,
    pub finish_reason: Option<String>,
    /// The `usage` object (the last chunk's when streaming).
    pub usage: Option<Value>,
    /// Whether a stream ended with `[DONE]` (always true for a complete non-streaming answer).
    pub done: bool,
    /// A transport error or an in-band error event, if any.
    pub error: Option<String>,
    /// The raw body of a non-streaming answer.
    pub raw: String,
}

impl ChatReply {
    /// `usage.prompt_tokens_details.cached_tokens`.
    pub fn cached_tokens(&self) -> u64 {
        self.usage
            .as_ref()
            .and_then(|u| u["prompt_tokens_details"]["cached_tokens"].as_u64())
            .unwrap_or(0)
    }

    /// Panics unless this is a complete 200 answer with text and a consistent `usage`.
    pub fn assert_complete(&self, max_tokens: u32) {
        assert_eq!(
            self.status, 200,
            "{}: status {} body {}",
            self.request_id, self.status, self.raw
        );
        assert!(
            self.error.is_none(),
            "{}: {:?}",
            self.request_id,
            self.error
        );
        assert!(
            self.done,
            "{}: the answer did not end properly",
            self.request_id
        );
        assert!(
            !self.text.trim().is_empty(),
            "{}: empty answer",
            self.request_id
        );
        assert!(
            self.finish_reason.is_some(),
            "{}: no finish_reason",
            self.request_id
        );
        let u = self
            .usage
            .as_ref()
            .unwrap_or_else(|| panic!("{}: no usage", self.request_id));
        let prompt = u["prompt_tokens"].as_u64().expect("usage.prompt_tokens");
        let completion = u["completion_tokens"]
            .as_u64()
            .expect("usage.completion_tokens");
        let total = u["total_tokens"].as_u64().expect("usage.total_tokens");
        assert!(prompt > 0, "{}: usage {u}", self.request_id);
        assert!(
            (1..=u64::from(max_tokens)).contains(&completion),
            "{}: {completion} completion tokens for max_tokens {max_tokens}",
            self.request_id
        );
        assert_eq!(total, prompt + completion, "{}: usage {u}", self.request_id);
        assert!(
            self.cached_tokens() <= prompt,
            "{}: more cached than prompt tokens: {u}",
            self.request_id
        );
    }
}

fn header(r: &reqwest::Response, name: &str) -> Option<String> {
    r.headers()
        .get(name)
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned)
}

/// Sends `chat` to `base` and reads the whole answer (streamed or not).
pub async fn send(http: &reqwest::Client, base: &str, chat: &Chat) -> ChatReply {
    match open(http, base, chat).await {
        Opened::Whole(r) => r,
        Opened::Stream(mut s) => {
            s.read_to_end().await;
            s.reply
        }
    }
}

/// An answer whose headers arrived.
pub enum Opened {
    /// Non-streaming, or a streaming request answered with an error status.
    Whole(ChatReply),
    Stream(SseReply),
}

/// Sends `chat`; a streaming 200 is returned unread so that the caller can read it event by
/// event.
pub async fn open(http: &reqwest::Client, base: &str, chat: &Chat) -> Opened {
    let sent = http
        .post(format!("{base}/v1/chat/completions"))
        .header("x-request-id", &chat.request_id)
        .json(&chat.body())
        .send()
        .await;
    let mut reply = ChatReply {
        request_id: chat.request_id.clone(),
        status: 0,
        worker: None,
        reason: None,
        text: String::new(),
        finish_reason: None,
        usage: None,
        done: false,
        error: None,
        raw: String::new(),
    };
    let resp = match sent {
        Ok(r) => r,
        Err(e) => {
            reply.error = Some(format!("send: {e}"));
            return Opened::Whole(reply);
        }
    };
    reply.status = resp.status().as_u16();
    reply.worker = header(&resp, "x-kvgate-worker");
    reply.reason = header(&resp, "x-kvgate-route-reason");
    if chat.stream && reply.status == 200 {
        return Opened::Stream(SseReply {
            reply,
            body: Box::pin(resp.bytes_stream().map(|c| c.map(|b| b.to_vec()))),
            buf: Vec::new(),
        });
    }
    match resp.bytes().await {
        Err(e) => reply.error = Some(format!("body: {e}")),
        Ok(b) => {
            reply.raw = String::from_utf8_lossy(&b).into_owned();
            if let Ok(v) = serde_json::from_slice::<Value>(&b) {
                if reply.status == 200 {
                    reply.text = v["choices"][0]["message"]["content"]
                        .as_str()
                        .unwrap_or_default()
                        .to_owned();
                    reply.finish_reason =
                        v["choices"][0]["finish_reason"].as_str().map(str::to_owned);
                    reply.usage = v.get("usage").cloned().filter(|u| !u.is_null());
                    reply.done = true;
                } else {
                    reply.error = Some(v["error"]["code"].as_str().unwrap_or("no code").to_owned());
                }
            }
        }
    }
    Opened::Whole(reply)
}

/// The body of a streaming answer, chunk by chunk.
type ByteStream = std::pin::Pin<Box<dyn futures::Stream<Item = reqwest::Result<Vec<u8>>> + Send>>;

/// A streaming answer being read.
pub struct SseReply {
    pub reply: ChatReply,
    body: ByteStream,
    buf: Vec<u8>,
}

/// One server-sent event.
#[derive(Debug)]
pub enum SseEvent {
    /// A JSON `data:` payload.
    Data(Value),
    /// `data: [DONE]`.
    Done,
}

impl SseReply {
    /// The next event; `None` at the end of the body or on a transport error (recorded in
    /// `reply.error`).
    pub async fn next_event(&mut self) -> Option<SseEvent> {
        loop {
            if let Some(pos) = find_event_end(&self.buf) {
                let raw: Vec<u8> = self.buf.drain(..pos.0 + pos.1).collect();
                let text = String::from_utf8_lossy(&raw[..pos.0]).into_owned();
                let data: Vec<&str> = text
                    .lines()
                    .filter_map(|l| l.strip_prefix("data:"))
                    .map(|d| d.strip_prefix(' ').unwrap_or(d))
                    .collect();
                if data.is_empty() {
                    continue; // a comment / keep-alive
                }
                let data = data.join("\n");
                if data == "[DONE]" {
                    return Some(SseEvent::Done);
                }
                return match serde_json::from_str(&data) {
                    Ok(v) => Some(SseEvent::Data(v)),
                    Err(e) => {
                        self.reply.error = Some(format!("bad SSE data ({e}): {data}"));
                        None
                    }
                };
            }
            match self.body.next().await {
                Some(Ok(chunk)) => self.buf.extend_from_slice(&chunk),
                Some(Err(e)) => {
                    self.reply.error = Some(format!("stream: {e}"));
                    return None;
                }
                None => return None,
            }
        }
    }

    /// Applies one event to the reply; returns whether it carried content text.
    fn apply(&mut self, ev: &SseEvent) -> bool {
        match ev {
            SseEvent::Done => {
                self.reply.done = true;
                false
            }
            SseEvent::Data(v) => {
                if v.get("error").is_some() {
                    self.reply.error = Some(format!("in-band error: {v}"));
                    return false;
                }
                if let Some(u) = v.get("usage").filter(|u| !u.is_null()) {
                    self.reply.usage = Some(u.clone());
                }
                let choice = &v["choices"][0];
                if let Some(f) = choice["finish_reason"].as_str() {
                    self.reply.finish_reason = Some(f.to_owned());
                }
                match choice["delta"]["content"].as_str() {
                    Some(t) if !t.is_empty() => {
                        self.reply.text.push_str(t);
                        true
                    }
                    _ => false,
                }
            }
        }
    }

    /// Reads until the first event with content text; false if the stream ended first.
    pub async fn read_first_content(&mut self) -> bool {
        while let Some(ev) = self.next_event().await {
            if self.apply(&ev) {
                return true;
            }
            if matches!(ev, SseEvent::Done) {
                return false;
            }
        }
        false
    }

    /// Reads the rest of the stream.
    pub async fn read_to_end(&mut self) {
        while let Some(ev) = self.next_event().await {
            self.apply(&ev);
            if matches!(ev, SseEvent::Done) {
                // Drain to the end of the body (nothing should follow).
                while self.next_event().await.is_some() {}
                return;
            }
        }
    }
}

/// Where the first event in `buf` ends: (length of the event, length of its separator).
fn find_event_end(buf: &[u8]) -> Option<(usize, usize)> {
    let lf = buf.windows(2).position(|w| w == b"\n\n").map(|p| (p, 2));
    let crlf = buf
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .map(|p| (p, 4));
    match (lf, crlf) {
        (Some(a), Some(b)) => Some(if a.0 <= b.0 { a } else { b }),
        (a, b) => a.or(b),
    }
}
