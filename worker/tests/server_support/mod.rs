//! Shared helpers of the worker server tests: starting sim or model workers on ephemeral ports,
//! an SSE reader, receipt fetching, waiting for a condition with a timeout.
#![allow(dead_code)]

use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::Duration;

use engine::sim::SimConfig;
use engine::EngineConfig;
use futures::StreamExt;
use prompt_profile::PromptProfile;
use receipts::{KeyPair, KeyRing, Receipt};
use worker::{EngineChoice, RunningWorker, TicketPolicy, WorkerConfig};

/// The default model file: `$KVGATE_MODEL_DIR` or `<workspace>/models/`. Panics with a clear
/// message when it is missing (the test command fetches it first).
pub fn model_path() -> PathBuf {
    let dir = std::env::var_os("KVGATE_MODEL_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models"));
    let p = dir.join("SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(
        p.is_file(),
        "model file {} is missing: run scripts/fetch-model.sh (or set KVGATE_MODEL_DIR)",
        p.display()
    );
    p
}

/// The default model's prompt profile, loaded once per test binary.
pub fn profile() -> PromptProfile {
    static P: OnceLock<PromptProfile> = OnceLock::new();
    P.get_or_init(|| PromptProfile::from_gguf(model_path()).expect("load prompt profile"))
        .clone()
}

pub fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(120))
        .build()
        .unwrap()
}

/// Knobs of a test worker.
#[derive(Clone)]
pub struct SimOpts {
    pub max_running: usize,
    pub max_waiting: usize,
    pub num_blocks: usize,
    pub decode_us_base: u64,
    pub admission_timeout: Duration,
    pub context_limit: Option<usize>,
    pub max_body_bytes: usize,
    pub served_model_names: Vec<String>,
    pub ticket_policy: TicketPolicy,
    pub gateway_keys: KeyRing,
    /// Reuse a state dir and key (restart tests).
    pub state: Option<(PathBuf, KeyPair)>,
    /// Use the real model instead of the simulator.
    pub real_model: bool,
    /// `ServerSettings::max_event_subscriptions`.
    pub max_event_subscriptions: usize,
    /// `ServerSettings::reasoning_parser`.
    pub reasoning_parser: Option<worker::output_parser::ReasoningFormat>,
    /// `ServerSettings::schema_cache_bytes`.
    pub schema_cache_bytes: usize,
}

impl Default for SimOpts {
    fn default() -> Self {
        SimOpts {
            max_running: 8,
            max_waiting: 64,
            num_blocks: 1024,
            decode_us_base: 200,
            admission_timeout: Duration::from_secs(10),
            context_limit: None,
            max_body_bytes: 1 << 20,
            served_model_names: Vec::new(),
            ticket_policy: TicketPolicy::Optional,
            gateway_keys: KeyRing::new(),
            state: None,
            real_model: false,
            max_event_subscriptions: 16,
            reasoning_parser: None,
            schema_cache_bytes: 32 << 20,
        }
    }
}

pub struct TestWorker {
    pub worker: RunningWorker,
    pub key: KeyPair,
    pub receipt_log: PathBuf,
    _dir: Option<tempfile::TempDir>,
}

impl TestWorker {
    pub fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.worker.addr(), path)
    }

    /// Stops the worker; returns its temporary state dir (still on disk while held).
    pub async fn stop(self) -> Option<tempfile::TempDir> {
        self.worker.shutdown().await;
        self._dir
    }
}

/// Starts a worker (`w-test`) on an ephemeral port and waits until it is ready.
pub async fn start_sim(o: SimOpts) -> TestWorker {
    let (dir, state_dir, key) = match &o.state {
        Some((d, k)) => (None, d.clone(), k.clone()),
        None => {
            let d = tempfile::tempdir().unwrap();
            let p = d.path().to_path_buf();
            (Some(d), p, KeyPair::generate())
        }
    };
    let profile = profile();
    let engine = if o.real_model {
        EngineChoice::Model {
            kv_budget_bytes: 64 << 20,
            threads: 0,
            cuda: false,
        }
    } else {
        EngineChoice::Sim(SimConfig {
            block_size: 16,
            num_blocks: o.num_blocks,
            vocab_size: profile.vocab_size(),
            prefill_us_per_token: 5,
            decode_us_base: o.decode_us_base,
            decode_us_per_seq: 10,
            eos_after: None,
            eos_token_id: profile.eos_token_ids()[0],
            panic_at_step: None,
        })
    };
    let receipt_log = state_dir.join("receipts.jsonl");
    let mut cfg = WorkerConfig::new(model_path(), engine, key.clone(), &receipt_log, "w-test");
    cfg.profile = Some(profile);
    cfg.engine_config = EngineConfig {
        max_running: o.max_running,
        max_waiting: o.max_waiting,
        default_admission_timeout: o.admission_timeout,
        ..EngineConfig::default()
    };
    cfg.gateway_keys = o.gateway_keys.clone();
    cfg.settings.ticket_policy = o.ticket_policy;
    cfg.settings.context_limit = o.context_limit;
    cfg.settings.max_body_bytes = o.max_body_bytes;
    cfg.settings.served_model_names = o.served_model_names.clone();
    cfg.settings.max_event_subscriptions = o.max_event_subscriptions;
    cfg.settings.reasoning_parser = o.reasoning_parser;
    cfg.settings.schema_cache_bytes = o.schema_cache_bytes;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let worker = worker::spawn(cfg, listener).await.unwrap();
    worker.wait_ready(Duration::from_secs(120)).await.unwrap();
    TestWorker {
        worker,
        key,
        receipt_log,
        _dir: dir,
    }
}

/// One SSE message.
#[derive(Debug, Clone, Default)]
pub struct SseEvent {
    pub id: Option<String>,
    /// The `event:` field (`None`: the default `message`).
    pub event: Option<String>,
    pub data: String,
}

/// Incremental SSE parser over a response body.
pub struct SseReader {
    stream: futures::stream::BoxStream<'static, reqwest::Result<bytes::Bytes>>,
    buf: String,
}

impl SseReader {
    pub fn new(resp: reqwest::Response) -> Self {
        SseReader {
            stream: resp.bytes_stream().boxed(),
            buf: String::new(),
        }
    }

    /// The next KV cache event of a `/v1/kv/events` stream (its `event: load` messages
    /// skipped).
    pub async fn next_cache_event(&mut self) -> Option<SseEvent> {
        loop {
            let ev = self.next_event().await?;
            if ev.event.as_deref() != Some("load") {
                return Some(ev);
            }
        }
    }

    /// The next `event: load` message of a `/v1/kv/events` stream, parsed (cache events
    /// skipped).
    pub async fn next_load(&mut self) -> Option<serde_json::Value> {
        loop {
            let ev = self.next_event().await?;
            if ev.event.as_deref() == Some("load") {
                assert!(ev.id.is_none(), "load messages carry no id: {:?}", ev.id);
                return Some(serde_json::from_str(&ev.data).expect("load JSON"));
            }
        }
    }

    /// The next message with data (comments skipped); `None` at the end of the body.
    pub async fn next_event(&mut self) -> Option<SseEvent> {
        loop {
            if let Some(pos) = self.buf.find("\n\n") {
                let block: String = self.buf[..pos].to_string();
                self.buf.drain(..pos + 2);
                let mut ev = SseEvent::default();
                let mut has_data = false;
                for line in block.lines() {
                    if let Some(d) = line.strip_prefix("data:") {
                        if has_data {
                            ev.data.push('\n');
                        }
                        ev.data.push_str(d.strip_prefix(' ').unwrap_or(d));
                        has_data = true;
                    } else if let Some(i) = line.strip_prefix("id:") {
                        ev.id = Some(i.trim().to_string());
                    } else if let Some(e) = line.strip_prefix("event:") {
                        ev.event = Some(e.trim().to_string());
                    }
                }
                if has_data {
                    return Some(ev);
                }
                continue;
            }
            let chunk = tokio::time::timeout(Duration::from_secs(60), self.stream.next())
                .await
                .expect("SSE stream stalled for 60 s")?;
            self.buf.push_str(&String::from_utf8_lossy(&chunk.ok()?));
        }
    }
}

/// POSTs `body` as JSON to `path` and parses the answer as JSON.
pub async fn post_json(w: &TestWorker, path: &str, body: &serde_json::Value) -> serde_json::Value {
    client()
        .post(w.url(path))
        .json(body)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

/// POSTs `body` and returns every `data:` payload of the SSE answer but `[DONE]`, parsed.
pub async fn post_sse_json(
    w: &TestWorker,
    path: &str,
    body: &serde_json::Value,
) -> Vec<serde_json::Value> {
    let resp = client().post(w.url(path)).json(body).send().await.unwrap();
    read_sse(resp)
        .await
        .into_iter()
        .filter(|d| d != "[DONE]")
        .map(|d| serde_json::from_str(&d).unwrap())
        .collect()
}

/// Every `data:` payload of an SSE response.
pub async fn read_sse(resp: reqwest::Response) -> Vec<String> {
    let mut r = SseReader::new(resp);
    let mut out = Vec::new();
    while let Some(e) = r.next_event().await {
        out.push(e.data);
    }
    out
}

pub async fn get_receipt(w: &TestWorker, id: &str) -> Receipt {
    get_receipt_as(w, id, None).await
}

/// [`get_receipt`] with the gateway's access token (workers that require tickets want one).
pub async fn get_receipt_as(w: &TestWorker, id: &str, token: Option<&str>) -> Receipt {
    let mut rb = client().get(w.url(&format!("/v1/receipts/{id}")));
    if let Some(t) = token {
        rb = rb.bearer_auth(t);
    }
    let r = rb.send().await.unwrap();
    assert_eq!(r.status(), 200, "receipt of {id}");
    Receipt::from_line(&r.bytes().await.unwrap()).unwrap()
}

/// Waits for the receipt of `id` to appear (it is written when the driver sees the end).
pub async fn wait_receipt(w: &TestWorker, id: &str) -> Receipt {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let r = client()
            .get(w.url(&format!("/v1/receipts/{id}")))
            .send()
            .await
            .unwrap();
        if r.status() == 200 {
            return Receipt::from_line(&r.bytes().await.unwrap()).unwrap();
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no receipt for {id}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Polls `cond` until true; panics after `timeout`.
pub async fn wait_until(timeout: Duration, mut cond: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + timeout;
    while !cond() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "condition not met in {timeout:?}"
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

pub async fn metrics_text(w: &TestWorker) -> String {
    client()
        .get(w.url("/metrics"))
        .header("accept", "application/openmetrics-text; version=1.0.0")
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap()
}
