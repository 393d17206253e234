//! `kvgate sidecar` in front of OpenAI-compatible engines, through the real gateway: two
//! simulated kvgate workers play the native engines (their `/v1/chat/completions` is OpenAI's;
//! they take direct requests), each behind a sidecar that requires route tickets; the rules
//! name the sidecars as `kind = "openai"` upstreams. Checked over real HTTP:
//! - round robin and KV-exact (approximate holdings: no KV events) through the sidecars, whole
//!   and streamed answers; the second turn of a conversation goes back to the sidecar whose
//!   engine cached its prefix, and that engine reports the cached tokens;
//! - every sidecar receipt carries the gateway's ticket and the engine's own counts, and the
//!   audit over the gateway's decision log and the sidecars' receipt logs is clean;
//! - the contract check of `openai` upstreams refuses a rule whose pinned `model_id` the engine
//!   does not serve (400 naming it);
//! - the sidecar's own refusals: no ticket (401 `ticket_required`), a replayed ticket (401
//!   `ticket_replayed`), the engine gone (503 `engine_unavailable`, receipted; `/ready` 503);
//! - a sidecar's load report (`GET /v1/load`): the work a second, independent gateway sent
//!   its engine moves the first gateway's KV-exact placement off it
//!   (`a_sidecar_reports_the_work_of_every_gateway`), and so does the work clients sent its
//!   engine directly, read from the engine's own `GET /slots`
//!   (`a_sidecar_counts_what_reached_its_engine_around_it`);
//! - `kind = "vllm"` sidecars reading their engines' KV events (ZMQ, msgpack, replay): KV-exact
//!   routes on what the engine reports (`vllm_kv_events_drive_kv_exact_through_sidecars`).

mod gateway_support;

use std::time::Duration;

use gateway_support::{chat, Fleet, FleetOptions, Reply};
use receipts::{KeyPair, KeyRing};
use worker::sidecar::{RunningSidecar, SidecarConfig};
use worker::TicketPolicy;

struct Sidecars {
    fleet: Fleet,
    sidecars: Vec<Option<RunningSidecar>>,
    keys: Vec<KeyPair>,
    /// The rules' `kind` of the sidecars.
    kind: &'static str,
    /// The key of a second, independent gateway (`gateway-b`) the sidecars trust too.
    second_gateway_key: KeyPair,
}

fn sidecar_id(i: usize) -> String {
    format!("s{}", i + 1)
}

impl Sidecars {
    fn start() -> Sidecars {
        let fleet = Fleet::workers(FleetOptions {
            workers: 2,
            ticket_policy: TicketPolicy::Optional,
            ..FleetOptions::default()
        });
        let engines = fleet.addrs.iter().map(|a| format!("http://{a}")).collect();
        Sidecars::start_with(fleet, engines, "openai", |_, _| {})
    }

    /// Two sidecars of `kind` in front of `engines`, sidecar `i`'s configuration finished by
    /// `configure(i, ..)`.
    fn start_with(
        fleet: Fleet,
        engines: Vec<String>,
        kind: &'static str,
        configure: impl Fn(usize, &mut SidecarConfig),
    ) -> Sidecars {
        let keys: Vec<KeyPair> = (0..2).map(|_| KeyPair::generate()).collect();
        let second_gateway_key = KeyPair::generate();
        let mut ring = KeyRing::new();
        ring.insert("gateway", fleet.gateway_key.public().clone());
        ring.insert("gateway-b", second_gateway_key.public().clone());
        let sidecars = (0..2)
            .map(|i| {
                let mut cfg = SidecarConfig::new(
                    engines[i].clone(),
                    sidecar_id(i),
                    keys[i].clone(),
                    fleet
                        .dir
                        .path()
                        .join(format!("receipts-{}.jsonl", sidecar_id(i))),
                );
                cfg.health_path = "/ready".into();
                cfg.ticket_policy = TicketPolicy::Require;
                cfg.gateway_keys = ring.clone();
                configure(i, &mut cfg);
                let s = fleet.rt.block_on(async {
                    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
                    worker::sidecar::spawn(cfg, l).await.unwrap()
                });
                Some(s)
            })
            .collect();
        Sidecars {
            fleet,
            sidecars,
            keys,
            kind,
            second_gateway_key,
        }
    }

    fn rules(&self, pinned_model: Option<&str>) -> String {
        let mut s = String::from("[gateway]\nhealth_interval_ms = 100\n");
        for (i, sc) in self.sidecars.iter().enumerate() {
            let addr = sc.as_ref().unwrap().addr();
            s.push_str(&format!(
                "\n[[workers]]\nid = \"{}\"\nurl = \"http://{addr}\"\nkind = \"{}\"\n\
                 prompt_cache = {{ ttl_ms = 60000, max_prefixes = 8 }}\n",
                sidecar_id(i),
                self.kind
            ));
        }
        s.push_str("\n[[pools]]\nid = \"all\"\nworkers = [\"s1\", \"s2\"]\n");
        let mut profile = self.fleet.profile_toml("smol", 16);
        if let Some(m) = pinned_model {
            let start = profile.find("model_id = ").unwrap();
            let end = start + profile[start..].find('\n').unwrap();
            profile.replace_range(start..end, &format!("model_id = \"{m}\""));
        }
        s.push_str(&profile);
        s.push_str(
            r#"
[[services]]
name = "rr"
pool = "all"
rule = { type = "round_robin" }
[services.match]
models = ["smol-rr"]

[[services]]
name = "exact"
pool = "all"
rule = { type = "kv_exact", profile = "smol", pending_ttl_ms = 0 }
[services.match]
models = ["smol"]
"#,
        );
        s
    }

    fn start_gateway(&mut self) {
        let path = self.fleet.dir.path().join("rules.toml");
        std::fs::write(&path, self.rules(None)).unwrap();
        self.fleet.rules_path = path.clone();
        let mut cfg = gateway::GatewayConfig::new(&path, self.fleet.gateway_key.clone());
        cfg.admin_token = Some(self.fleet.admin_token.clone());
        cfg.decision_log = Some(self.fleet.dir.path().join("decisions.jsonl"));
        self.fleet.gateway = Some(gateway::spawn(cfg).unwrap());
    }

    fn receipt(&self, i: usize, request_id: &str) -> receipts::Receipt {
        let path = self.log(i);
        let text = std::fs::read_to_string(path).unwrap_or_default();
        text.lines()
            .rev()
            .filter_map(|l| receipts::Receipt::from_line(l.as_bytes()).ok())
            .find(|r| r.body.request_id == request_id)
            .unwrap_or_else(|| panic!("no receipt for {request_id} in sidecar {i}'s log"))
    }

    fn log(&self, i: usize) -> std::path::PathBuf {
        self.fleet
            .dir
            .path()
            .join(format!("receipts-{}.jsonl", sidecar_id(i)))
    }

    fn direct(&self, i: usize, body: &serde_json::Value, headers: &[(&str, String)]) -> Reply {
        let addr = self.sidecars[i].as_ref().unwrap().addr();
        self.fleet.rt.block_on(async {
            let mut req = self
                .fleet
                .http
                .post(format!("http://{addr}/v1/chat/completions"))
                .json(body);
            for (k, v) in headers {
                req = req.header(*k, v);
            }
            Reply::read(req.send().await.unwrap()).await
        })
    }

    /// The route ticket sidecar `i` receipted for the answer `r`.
    fn ticket(&self, i: usize, r: &Reply) -> receipts::RouteTicket {
        let rec = self.receipt(i, &r.header("x-request-id").unwrap());
        rec.body
            .ticket
            .as_ref()
            .unwrap()
            .ticket_unverified()
            .clone()
    }

    /// Sidecar `i`'s `/metrics`.
    fn metrics(&self, i: usize) -> String {
        let addr = self.sidecars[i].as_ref().unwrap().addr();
        self.fleet.rt.block_on(async {
            reqwest::get(format!("http://{addr}/metrics"))
                .await
                .unwrap()
                .text()
                .await
                .unwrap()
        })
    }

    /// Writes `rules` to the rules file, asks the gateway to reload, puts the file back; the
    /// reload's status and body (what a refused change says).
    fn reload_refused(&self, rules: String) -> (u16, String) {
        let fleet = &self.fleet;
        let good = std::fs::read_to_string(&fleet.rules_path).unwrap();
        std::fs::write(&fleet.rules_path, rules).unwrap();
        let out = fleet.rt.block_on(async {
            let r = fleet
                .http
                .post(fleet.admin_url("/admin/reload"))
                .bearer_auth(&fleet.admin_token)
                .send()
                .await
                .unwrap();
            (r.status().as_u16(), r.text().await.unwrap())
        });
        std::fs::write(&fleet.rules_path, good).unwrap();
        out
    }

    fn stop(&mut self) {
        if let Some(mut g) = self.fleet.gateway.take() {
            g.shutdown();
        }
        for s in self.sidecars.iter_mut() {
            if let Some(s) = s.take() {
                self.fleet.rt.block_on(s.shutdown());
            }
        }
        self.fleet.stop();
    }
}

fn index_of(r: &Reply) -> usize {
    let w = r.worker();
    w.trim_start_matches('s').parse::<usize>().unwrap() - 1
}

#[test]
fn sidecars_receipt_openai_engines_behind_the_gateway() {
    let mut sc = Sidecars::start();
    sc.start_gateway();
    let fleet = &sc.fleet;
    fleet.wait_for("both sidecars healthy", Duration::from_secs(10), || {
        let w = fleet
            .admin(reqwest::Method::GET, "/admin/workers", None)
            .json();
        let healthy = |v: &serde_json::Value| v["healthy"] == true;
        match w.as_array().or_else(|| w["workers"].as_array()) {
            Some(a) => a.iter().filter(|v| healthy(v)).count() == 2,
            None => false,
        }
    });

    // Round robin, whole answers: alternates, every answer receipted by its sidecar with the
    // gateway's ticket and the engine's counts.
    let mut seen = std::collections::BTreeSet::new();
    for n in 0..4 {
        let mut body = chat(&[("user", &format!("round robin {n}"))], 5);
        body["model"] = "smol-rr".into();
        let r = fleet.post("/v1/chat/completions", &body, &[]);
        assert_eq!(r.status, 200, "{}", r.text());
        let i = index_of(&r);
        seen.insert(i);
        let id = r.header("x-request-id").unwrap();
        let rec = sc.receipt(i, &id);
        let t = rec
            .body
            .ticket
            .as_ref()
            .expect("ticket")
            .ticket_unverified();
        assert_eq!(t.service, "rr");
        assert_eq!(t.worker.as_str(), sidecar_id(i));
        assert_eq!(rec.body.status, 200);
        assert_eq!(rec.body.completion_tokens, 5);
        let usage = &r.json()["usage"];
        assert_eq!(
            rec.body.prompt_tokens as u64,
            usage["prompt_tokens"].as_u64().unwrap()
        );
        assert_eq!(rec.body.finish_reason.as_deref(), Some("length"));
        let content = r.json()["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .to_string();
        assert_eq!(
            rec.body.response_sha256,
            hex::encode(<sha2::Sha256 as sha2::Digest>::digest(content.as_bytes()))
        );
    }
    assert_eq!(seen.len(), 2, "round robin used both sidecars");

    // Streamed through the gateway and the sidecar: [DONE] arrives after the receipt exists.
    let mut body = chat(&[("user", "stream please")], 6);
    body["model"] = "smol-rr".into();
    body["stream"] = true.into();
    body["stream_options"] = serde_json::json!({"include_usage": true});
    let r = fleet.post("/v1/chat/completions", &body, &[]);
    assert_eq!(r.status, 200);
    let text = r.text();
    assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
    let rec = sc.receipt(index_of(&r), &r.header("x-request-id").unwrap());
    assert_eq!(rec.body.completion_tokens, 6);
    assert!(rec.body.first_token_at_ms.is_some());
    assert!(rec.body.prompt_tokens > 0);

    // KV-exact over approximate holdings: the second turn follows the first to its sidecar,
    // and that engine reports a cached prefix.
    let long = "Tell me about paged attention and prefix caching in LLM serving. ".repeat(6);
    let first = chat(&[("system", "You are terse."), ("user", &long)], 4);
    let r1 = fleet.post("/v1/chat/completions", &first, &[]);
    assert_eq!(r1.status, 200, "{}", r1.text());
    let answer = r1.json()["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_string();
    let second = chat(
        &[
            ("system", "You are terse."),
            ("user", &long),
            ("assistant", &answer),
            ("user", "And more?"),
        ],
        4,
    );
    let r2 = fleet.post("/v1/chat/completions", &second, &[]);
    assert_eq!(r2.status, 200, "{}", r2.text());
    assert_eq!(
        r1.worker(),
        r2.worker(),
        "the second turn follows its prefix"
    );
    let rec2 = sc.receipt(index_of(&r2), &r2.header("x-request-id").unwrap());
    let t2 = rec2.body.ticket.as_ref().unwrap().ticket_unverified();
    assert_eq!(t2.service, "exact");
    assert!(
        t2.predicted_matched_tokens.unwrap_or(0) >= 16,
        "the gateway predicted a cached prefix: {t2:?}"
    );
    assert!(
        rec2.body.cached_tokens >= 16,
        "the engine reported cached tokens: {:?}",
        rec2.body
    );
    assert_eq!(rec2.body.cached_tokens as u64, r2.cached_tokens());

    // The contract check of openai upstreams: a pinned model the engines do not serve is
    // refused with 400 naming it.
    let (status, text) = sc.reload_refused(sc.rules(Some("not-served-here")));
    assert_eq!(status, 400, "{text}");
    assert!(
        text.contains("not-served-here") && text.contains("worker s1"),
        "{text}"
    );

    // Audit: the gateway's decisions against the sidecars' receipts.
    let ring = {
        let mut ring = fleet.key_ring();
        for (i, k) in sc.keys.iter().enumerate() {
            ring.insert(sidecar_id(i), k.public().clone());
        }
        ring
    };
    let decisions = fleet.dir.path().join("decisions.jsonl");
    if let Some(mut g) = sc.fleet.gateway.take() {
        g.shutdown();
    }
    for i in 0..2 {
        sc.sidecars[i]
            .as_ref()
            .unwrap()
            .receipt_log()
            .sync()
            .unwrap();
    }
    let logs = vec![sc.log(0), sc.log(1)];
    let report = receipts::audit(&decisions, &logs, &ring).unwrap();
    assert!(
        report.discrepancies.is_empty(),
        "audit: {:?}",
        report.discrepancies
    );
    assert_eq!(report.receipted, report.routed, "{report:?}");
    assert!(report.routed >= 7, "{report:?}");

    // The sidecar's own refusals, directly.
    let body = chat(&[("user", "direct")], 2);
    let r = sc.direct(0, &body, &[]);
    assert_eq!(r.status, 401);
    assert_eq!(r.json()["error"]["code"], "ticket_required");
    let now = receipts::now_ms();
    let ticket = receipts::RouteTicket {
        request_id: "direct-1".into(),
        gateway_id: "gateway".into(),
        key_id: sc.fleet.gateway_key.key_id().clone(),
        service: "rr".into(),
        rule_id: "rr/round_robin".into(),
        rule_version: 1,
        mode: receipts::RouteMode::RoundRobin,
        worker: "s1".into(),
        predicted_matched_tokens: None,
        prompt_tokens: None,
        last_block_key: None,
        namespace_seed: prefix_index::NamespaceSeed([0; 32]),
        hash_algorithm: prefix_index::HashAlgorithm::Sha256,
        issued_at_ms: now,
        expires_at_ms: now + 30_000,
    }
    .sign(&sc.fleet.gateway_key)
    .to_header_value();
    let h = [(receipts::TICKET_HEADER, ticket.clone())];
    let r = sc.direct(0, &body, &h);
    assert_eq!(
        r.status,
        200,
        "any hash algorithm is fine for a sidecar: {}",
        r.text()
    );
    let r = sc.direct(0, &body, &h);
    assert_eq!(r.status, 401);
    assert_eq!(r.json()["error"]["code"], "ticket_replayed");
    // A ticket for the other sidecar.
    let r = sc.direct(1, &body, &[(receipts::TICKET_HEADER, ticket)]);
    assert_eq!(r.json()["error"]["code"], "ticket_wrong_worker");

    // The engine goes away: 503 engine_unavailable, receipted; /ready says so.
    sc.fleet.stop_worker(0);
    let now = receipts::now_ms();
    let ticket = receipts::RouteTicket {
        request_id: "direct-2".into(),
        gateway_id: "gateway".into(),
        key_id: sc.fleet.gateway_key.key_id().clone(),
        service: "rr".into(),
        rule_id: "rr/round_robin".into(),
        rule_version: 1,
        mode: receipts::RouteMode::RoundRobin,
        worker: "s1".into(),
        predicted_matched_tokens: None,
        prompt_tokens: None,
        last_block_key: None,
        namespace_seed: prefix_index::NamespaceSeed([0; 32]),
        hash_algorithm: prefix_index::HashAlgorithm::Xxh3,
        issued_at_ms: now,
        expires_at_ms: now + 30_000,
    }
    .sign(&sc.fleet.gateway_key)
    .to_header_value();
    let r = sc.direct(0, &body, &[(receipts::TICKET_HEADER, ticket)]);
    assert_eq!(r.status, 503, "{}", r.text());
    assert_eq!(r.json()["error"]["code"], "engine_unavailable");
    assert_eq!(r.header("x-kvgate-receipt").as_deref(), Some("direct-2"));
    let rec = sc.receipt(0, "direct-2");
    assert_eq!(rec.body.status, 503);
    assert_eq!(rec.body.error_code.as_deref(), Some("engine_unavailable"));
    let addr = sc.sidecars[0].as_ref().unwrap().addr();
    let ready = sc.fleet.rt.block_on(async {
        reqwest::get(format!("http://{addr}/ready"))
            .await
            .unwrap()
            .status()
            .as_u16()
    });
    assert_eq!(ready, 503);
    sc.stop();
}

/// vLLM's side of its KV-event wire, as the test plays it: msgpack written by `rmp-serde` (not
/// the sidecar's reader), integer block hashes (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`), the
/// event maps tagged by `type` and the batch an array `[ts, events]`, as vLLM 0.34 sends them
/// (the bytes of vLLM's own classes are checked by `scripts/check-vllm-events.sh`).
#[derive(serde::Serialize)]
#[serde(tag = "type")]
enum VllmEvent {
    BlockStored {
        block_hashes: Vec<u64>,
        parent_block_hash: Option<u64>,
        token_ids: Vec<u32>,
        block_size: usize,
        lora_id: Option<u32>,
        medium: Option<String>,
        lora_name: Option<String>,
        extra_keys: Option<Vec<Option<Vec<String>>>>,
    },
    BlockRemoved {
        block_hashes: Vec<u64>,
        medium: Option<String>,
    },
    AllBlocksCleared,
}

/// Passes a request on to `target` (method, path and query, content type, body) and answers
/// what it answers (status, content type, body streamed as it comes: an event stream too).
async fn forward(
    http: &reqwest::Client,
    target: &str,
    parts: &axum::http::request::Parts,
    bytes: bytes::Bytes,
) -> axum::response::Response {
    use axum::response::IntoResponse;
    let mut out = http.request(parts.method.clone(), format!("{target}{}", parts.uri));
    if let Some(ct) = parts.headers.get("content-type") {
        out = out.header("content-type", ct.as_bytes());
    }
    let resp = out.body(bytes).send().await.unwrap();
    let status = axum::http::StatusCode::from_u16(resp.status().as_u16()).unwrap();
    let ct = resp
        .headers()
        .get("content-type")
        .map(|v| v.to_str().unwrap().to_string())
        .unwrap_or_default();
    let body = axum::body::Body::from_stream(resp.bytes_stream());
    (status, [("content-type", ct)], body).into_response()
}

/// An engine that records every generation body it is sent and passes the request on to
/// `target` (a simulated worker), answering what it answers.
async fn recording_engine(
    target: String,
    seen: std::sync::Arc<parking_lot::Mutex<Vec<serde_json::Value>>>,
) -> std::net::SocketAddr {
    use axum::extract::Request;
    let http = reqwest::Client::new();
    let app = axum::Router::new().fallback(move |req: Request| {
        let (http, target, seen) = (http.clone(), target.clone(), seen.clone());
        async move {
            let (parts, body) = req.into_parts();
            let bytes = axum::body::to_bytes(body, 16 << 20).await.unwrap();
            if parts.uri.path().ends_with("/completions") {
                seen.lock().push(serde_json::from_slice(&bytes).unwrap());
            }
            forward(&http, &target, &parts, bytes).await
        }
    });
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(l, app).await.unwrap() });
    addr
}

fn vllm_payload(events: Vec<VllmEvent>) -> Vec<u8> {
    rmp_serde::to_vec_named(&(1.0f64, events)).unwrap()
}

/// `[topic, seq, payload]`, as vLLM's publisher frames it.
fn vllm_message(seq: u64, payload: Vec<u8>) -> zeromq::ZmqMessage {
    let mut m = zeromq::ZmqMessage::from(Vec::<u8>::new());
    m.push_back(seq.to_be_bytes().to_vec().into());
    m.push_back(payload.into());
    m
}

/// `n` blocks of 16 stored by one request, hashes `first..first + n`, the first a root with
/// the request's salt.
fn stored_blocks(first: u64, tokens: &[u32], salt: Option<&str>) -> VllmEvent {
    let n = tokens.len() / 16;
    let mut extra: Vec<Option<Vec<String>>> = vec![None; n];
    extra[0] = salt.map(|s| vec![s.to_string()]);
    VllmEvent::BlockStored {
        block_hashes: (first..first + n as u64).collect(),
        parent_block_hash: None,
        token_ids: tokens[..n * 16].to_vec(),
        block_size: 16,
        lora_id: None,
        medium: Some("GPU".into()),
        lora_name: None,
        extra_keys: salt.map(|_| extra),
    }
}

/// `kind = "vllm"` sidecars that read their engines' KV events: the gateway routes on what the
/// engine reports, exactly. Each sidecar subscribes to a ZMQ PUB socket the test owns (the
/// engine's publisher) and a ROUTER socket that answers its replay requests; the
/// engines are simulated kvgate workers behind a recorder, and publish nothing there. A first
/// request goes to some sidecar, which forwards it with the salt of its ticket's namespace
/// (`kvgate/v1/<alg>/<namespace>`, what vLLM names in the root block's extra keys; a
/// round-robin request goes unchanged); the test then has the *other* engine report the
/// prompt's blocks under that salt: the repeat goes to that sidecar, predicted to hit every
/// block — a decision only the events can explain (routing-time holdings are off). Removals shorten the prediction, a gap is filled from the
/// replay socket, an unsalted chain is not mapped, and `AllBlocksCleared` empties the view.
#[test]
fn vllm_kv_events_drive_kv_exact_through_sidecars() {
    use zeromq::{Socket, SocketRecv, SocketSend};
    let rt = tokio::runtime::Runtime::new().unwrap();
    // The engines' publishers and sidecar 2's replay socket.
    let (mut pubs, endpoints): (Vec<zeromq::PubSocket>, Vec<String>) = rt.block_on(async {
        let mut pubs = Vec::new();
        let mut eps = Vec::new();
        for _ in 0..2 {
            let mut p = zeromq::PubSocket::new();
            let ep = p.bind("tcp://127.0.0.1:0").await.unwrap();
            eps.push(ep.to_string());
            pubs.push(p);
        }
        (pubs, eps)
    });
    type Replayable = std::sync::Arc<parking_lot::Mutex<Vec<(u64, Vec<u8>)>>>;
    let replayable: Vec<Replayable> = vec![Default::default(), Default::default()];
    let (replay_eps, replay_tasks): (Vec<String>, Vec<tokio::task::JoinHandle<()>>) = (0..2)
        .map(|i| {
            rt.block_on(async {
                let mut router = zeromq::RouterSocket::new();
                let ep = router.bind("tcp://127.0.0.1:0").await.unwrap().to_string();
                let held = replayable[i].clone();
                let task = tokio::spawn(async move {
                    while let Ok(req) = router.recv().await {
                        let frames = req.into_vec();
                        let (id, start) = (frames[0].clone(), &frames[2]);
                        let start = u64::from_be_bytes(start.as_ref().try_into().unwrap());
                        let batches: Vec<(u64, Vec<u8>)> = held.lock().clone();
                        for (seq, payload) in batches.into_iter().filter(|(s, _)| *s >= start) {
                            let mut m = zeromq::ZmqMessage::from(id.clone());
                            m.push_back(Vec::<u8>::new().into());
                            m.push_back(seq.to_be_bytes().to_vec().into());
                            m.push_back(payload.into());
                            router.send(m).await.unwrap();
                        }
                        let mut end = zeromq::ZmqMessage::from(id);
                        end.push_back(Vec::<u8>::new().into());
                        end.push_back(vec![0xff; 8].into());
                        end.push_back(Vec::<u8>::new().into());
                        router.send(end).await.unwrap();
                    }
                });
                (ep, task)
            })
        })
        .unzip();
    let fleet = Fleet::workers(FleetOptions {
        workers: 2,
        ticket_policy: TicketPolicy::Optional,
        ..FleetOptions::default()
    });
    let seen: Vec<std::sync::Arc<parking_lot::Mutex<Vec<serde_json::Value>>>> =
        vec![Default::default(), Default::default()];
    let engines = (0..2)
        .map(|i| {
            let a = rt.block_on(recording_engine(
                format!("http://{}", fleet.addrs[i]),
                seen[i].clone(),
            ));
            format!("http://{a}")
        })
        .collect();
    let mut sc = Sidecars::start_with(fleet, engines, "vllm", |i, cfg| {
        let mut ev = worker::sidecar::vllm::EngineEventsConfig::new(endpoints[i].clone());
        ev.replay_endpoint = Some(replay_eps[i].clone());
        cfg.engine_events = Some(ev);
    });
    sc.start_gateway();
    let fleet = &sc.fleet;
    let sidecar_metric = |i: usize, series: &str| -> f64 {
        sc.metrics(i)
            .lines()
            .find_map(|l| l.strip_prefix(series)?.trim().parse().ok())
            .unwrap_or(0.0)
    };
    fleet.wait_for(
        "both event streams connected and both publishers subscribed",
        Duration::from_secs(20),
        || {
            let w = fleet
                .admin(reqwest::Method::GET, "/admin/workers", None)
                .json();
            // The load messages come on the event stream (`load=true`), not a load stream.
            let connected = w["workers"].as_array().is_some_and(|a| {
                a.iter()
                    .filter(|v| {
                        v["events"]["state"] == "connected"
                            && v["healthy"] == true
                            && v["events"]["load_stream"] == "off"
                            && v["reported_load"]["running"] == 0
                    })
                    .count()
                    == 2
            });
            connected
                && (0..2)
                    .all(|i| sidecar_metric(i, "kvgate_sidecar_engine_events_connected") == 1.0)
        },
    );

    // A first request lands on some sidecar; its ticket names the namespace.
    let long = "Paged attention keeps the KV cache in fixed-size blocks. ".repeat(8);
    let body = chat(&[("system", "You are terse."), ("user", &long)], 3);
    let r = fleet.post("/v1/chat/completions", &body, &[]);
    assert_eq!(r.status, 200, "{}", r.text());
    let first = index_of(&r);
    let other = 1 - first;
    let ticket = sc.ticket(first, &r);
    let salt =
        worker::sidecar::vllm::mapping::salt_for(ticket.hash_algorithm, &ticket.namespace_seed);
    let forwarded = seen[first].lock().last().cloned().unwrap();
    assert_eq!(
        forwarded["cache_salt"],
        salt.as_str(),
        "the engine got the namespace as salt"
    );
    assert_eq!(forwarded["messages"], body["messages"]);
    // Round robin (the all-zero namespace) is forwarded as it came.
    let mut rr = chat(&[("user", "round robin through vllm sidecars")], 2);
    rr["model"] = "smol-rr".into();
    let r = fleet.post("/v1/chat/completions", &rr, &[]);
    assert_eq!(r.status, 200, "{}", r.text());
    let forwarded = seen[index_of(&r)].lock().last().cloned().unwrap();
    assert!(forwarded.get("cache_salt").is_none(), "{forwarded}");
    // The prompt's tokens, as the engine (and the gateway: the same code) render them.
    let tok_body = serde_json::json!({"messages": body["messages"]});
    let tokens: Vec<u32> = serde_json::from_value(
        fleet
            .post_to_worker(
                first,
                "/v1/tokenize",
                serde_json::to_vec(&tok_body).unwrap(),
            )
            .json()["tokens"]
            .clone(),
    )
    .unwrap();
    let n = tokens.len() / 16;
    assert!(n >= 4, "{} tokens", tokens.len());
    assert_eq!(ticket.prompt_tokens, Some(tokens.len() as u32));

    // The other engine reports the prompt's blocks (published until its sidecar has them: a
    // ZMQ subscription takes a moment to reach the publisher).
    let mut seq = [0u64; 2];
    let publish = |pubs: &mut Vec<zeromq::PubSocket>,
                   seq: &mut [u64; 2],
                   i: usize,
                   events: Vec<VllmEvent>| {
        let payload = vllm_payload(events);
        replayable[i].lock().push((seq[i], payload.clone()));
        rt.block_on(pubs[i].send(vllm_message(seq[i], payload)))
            .unwrap();
        seq[i] += 1;
    };
    let other_id = sidecar_id(other);
    let indexed = |blocks: usize| {
        fleet
            .gw()
            .data
            .index
            .worker_stats(&prefix_index::WorkerId(other_id.clone()))
            .map_or(0, |s| s.precise_blocks as usize)
            == blocks
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !indexed(n) {
        assert!(
            std::time::Instant::now() < deadline,
            "the stored blocks never reached the gateway"
        );
        publish(
            &mut pubs,
            &mut seq,
            other,
            vec![stored_blocks(1, &tokens, Some(&salt))],
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let route = |what: &str| -> (usize, receipts::RouteTicket) {
        let r = fleet.post("/v1/chat/completions", &body, &[]);
        assert_eq!(r.status, 200, "{what}: {}", r.text());
        let i = index_of(&r);
        (i, sc.ticket(i, &r))
    };
    let (i, t) = route("after the engine stored the prompt");
    assert_eq!(
        i, other,
        "the repeat goes where the engine holds its prefix"
    );
    assert_eq!(t.predicted_matched_tokens, Some((n * 16) as u32), "{t:?}");
    assert_eq!(
        sidecar_metric(
            other,
            "kvgate_sidecar_engine_event_blocks_total{outcome=\"mapped\"}"
        ),
        n as f64
    );

    // The engine evicts the last two blocks: the prediction shrinks by two blocks.
    publish(
        &mut pubs,
        &mut seq,
        other,
        vec![VllmEvent::BlockRemoved {
            block_hashes: vec![n as u64, n as u64 - 1],
            medium: Some("GPU".into()),
        }],
    );
    fleet.wait_for("the removal indexed", Duration::from_secs(10), || {
        indexed(n - 2)
    });
    let (i, t) = route("after the eviction");
    assert_eq!(i, other);
    assert_eq!(t.predicted_matched_tokens, Some(((n - 2) * 16) as u32));

    // A chain without the kvgate salt (a direct client's) is not mapped.
    publish(
        &mut pubs,
        &mut seq,
        other,
        vec![stored_blocks(1000, &tokens, None)],
    );
    fleet.wait_for(
        "the unsalted chain counted",
        Duration::from_secs(10),
        || {
            sidecar_metric(
                other,
                "kvgate_sidecar_engine_event_blocks_total{outcome=\"unsalted\"}",
            ) == n as f64
        },
    );
    assert!(indexed(n - 2));

    // Everything cleared: no holding is left.
    publish(
        &mut pubs,
        &mut seq,
        other,
        vec![VllmEvent::AllBlocksCleared],
    );
    fleet.wait_for("the clear indexed", Duration::from_secs(10), || indexed(0));

    // A gap is read from the replay socket: a batch the sidecar never got live (only the
    // replay socket has it) is applied before the one after it.
    let missed = vllm_payload(vec![stored_blocks(2000, &tokens, Some(&salt))]);
    replayable[other].lock().push((seq[other], missed));
    seq[other] += 1;
    publish(
        &mut pubs,
        &mut seq,
        other,
        vec![VllmEvent::BlockRemoved {
            block_hashes: vec![2000 + n as u64 - 1],
            medium: Some("GPU".into()),
        }],
    );
    fleet.wait_for(
        "the replayed blocks indexed",
        Duration::from_secs(10),
        || indexed(n - 1),
    );
    assert_eq!(
        sidecar_metric(
            other,
            "kvgate_sidecar_engine_event_gaps_total{resolution=\"replayed\"}"
        ),
        1.0
    );
    let (i, t) = route("after the replayed batch");
    assert_eq!(i, other);
    assert_eq!(t.predicted_matched_tokens, Some(((n - 1) * 16) as u32));
    // The engine restarts without the sidecar seeing a disconnection: its publisher's seqs
    // start again at 0 (and its replay buffer holds only the new process's messages). The
    // sidecar starts over: only what the new engine stores is held.
    {
        let restarted = vllm_payload(vec![stored_blocks(3000, &tokens[..32], Some(&salt))]);
        let mut held = replayable[other].lock();
        held.clear();
        held.push((0, restarted.clone()));
        drop(held);
        rt.block_on(pubs[other].send(vllm_message(0, restarted)))
            .unwrap();
    }
    fleet.wait_for(
        "only the restarted engine's blocks",
        Duration::from_secs(10),
        || indexed(2),
    );
    let (i, t) = route("after the engine restarted");
    assert_eq!(i, other);
    assert_eq!(t.predicted_matched_tokens, Some(32));

    // The contract check reads the block size the sidecars map into: a profile pinning
    // another is refused (400 naming it), as a key that could never match.
    let good = std::fs::read_to_string(&fleet.rules_path).unwrap();
    assert!(good.contains("block_size = 16"));
    let (status, text) = sc.reload_refused(good.replace("block_size = 16", "block_size = 32"));
    assert_eq!(status, 400, "{text}");
    assert!(
        text.contains("block_size (pinned 32") && text.contains("--block-size 32"),
        "{text}"
    );

    // The sidecar's exposition, every engine-event series populated, passes promtool.
    let text = sc.metrics(other);
    assert!(
        text.contains("kvgate_sidecar_engine_event_gaps_total"),
        "{text}"
    );
    gateway_support::promtool_check(&text, "vllm sidecar");
    drop(pubs);
    for t in replay_tasks {
        t.abort();
    }
    sc.stop();
}

/// llama-server's `GET /slots` of a 4-slot engine whose busy slots may still generate the
/// tokens listed (`n_remain`; one token decoded each), in the fields `server_slot::to_json`
/// writes.
fn slots_json(busy: &[i64]) -> String {
    let slots: Vec<_> = (0..4)
        .map(|i| match busy.get(i) {
            Some(&n_remain) => serde_json::json!({
                "id": i, "n_ctx": 8192, "speculative": false, "is_processing": true,
                "id_task": 100 + i, "n_prompt_tokens": 40, "n_prompt_tokens_processed": 40,
                "n_prompt_tokens_cache": 0, "params": {"n_predict": n_remain + 1},
                "next_token": [{"has_next_token": true, "has_new_line": false,
                                "n_remain": n_remain, "n_decoded": 1}],
            }),
            None => serde_json::json!({
                "id": i, "n_ctx": 8192, "speculative": false, "is_processing": false,
            }),
        })
        .collect();
    serde_json::Value::Array(slots).to_string()
}

/// An engine in front of `target` (a simulated worker) that holds every streamed chat request
/// whose `user` is `"hold"`: it streams one generated token, then waits for `release` before it
/// finishes the answer. It answers `GET /slots` as llama-server does, a held request occupying
/// a slot ([`slots_json`]). The paths in `missing` are 404 (`/v1/load`: a native engine);
/// everything else passes through to `target`.
async fn holding_engine(
    target: String,
    release: tokio::sync::watch::Receiver<bool>,
    missing: &'static [&'static str],
) -> std::net::SocketAddr {
    use axum::extract::Request;
    use axum::response::IntoResponse;
    use futures::StreamExt;
    /// A held request's slot: its remaining output, freed when the answer ends.
    struct Occupied(std::sync::Arc<std::sync::Mutex<Vec<(u64, i64)>>>, u64);
    impl Drop for Occupied {
        fn drop(&mut self) {
            self.0.lock().unwrap().retain(|(id, _)| *id != self.1);
        }
    }
    let busy = std::sync::Arc::new(std::sync::Mutex::new(Vec::<(u64, i64)>::new()));
    let next_id = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let http = reqwest::Client::new();
    let app = axum::Router::new().fallback(move |req: Request| {
        let (http, target, mut release) = (http.clone(), target.clone(), release.clone());
        let (busy, next_id) = (busy.clone(), next_id.clone());
        async move {
            let (parts, body) = req.into_parts();
            let bytes = axum::body::to_bytes(body, 16 << 20).await.unwrap();
            let v: serde_json::Value = serde_json::from_slice(&bytes).unwrap_or_default();
            if missing.contains(&parts.uri.path()) {
                return axum::http::StatusCode::NOT_FOUND.into_response();
            }
            if parts.uri.path() == "/slots" {
                let remain: Vec<i64> = busy.lock().unwrap().iter().map(|b| b.1).collect();
                return ([("content-type", "application/json")], slots_json(&remain))
                    .into_response();
            }
            if parts.uri.path() == "/v1/chat/completions" && v["user"] == "hold" {
                let id = next_id.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                busy.lock()
                    .unwrap()
                    .push((id, v["max_tokens"].as_i64().map_or(-1, |m| m - 1)));
                let slot = Occupied(busy.clone(), id);
                let chunk = |delta: serde_json::Value, finish: Option<&str>| {
                    let c = serde_json::json!({
                        "id": "held", "object": "chat.completion.chunk", "model": "held",
                        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
                    });
                    format!("data: {c}\n\n")
                };
                let first = chunk(
                    serde_json::json!({"role": "assistant", "content": "x"}),
                    None,
                );
                let last = format!(
                    "{}data: [DONE]\n\n",
                    chunk(serde_json::json!({}), Some("stop"))
                );
                let rest = async move {
                    let _ = release.wait_for(|r| *r).await;
                    drop(slot);
                    Ok::<_, std::convert::Infallible>(bytes::Bytes::from(last))
                };
                let body = futures::stream::once(async move {
                    Ok::<_, std::convert::Infallible>(bytes::Bytes::from(first))
                })
                .chain(futures::stream::once(rest));
                return (
                    axum::http::StatusCode::OK,
                    [("content-type", "text/event-stream")],
                    axum::body::Body::from_stream(body),
                )
                    .into_response();
            }
            forward(&http, &target, &parts, bytes).await
        }
    });
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(l, app).await.unwrap() });
    addr
}

/// Two simulated workers that take direct requests, each behind a [`holding_engine`] that has
/// no `missing` paths; the engines' URLs, and the sender that releases held answers.
fn held_fleet(
    missing: &'static [&'static str],
) -> (Fleet, Vec<String>, tokio::sync::watch::Sender<bool>) {
    let fleet = Fleet::workers(FleetOptions {
        workers: 2,
        ticket_policy: TicketPolicy::Optional,
        ..FleetOptions::default()
    });
    let (release_tx, release_rx) = tokio::sync::watch::channel(false);
    let engines = fleet
        .addrs
        .clone()
        .iter()
        .map(|a| {
            let e = fleet.rt.block_on(holding_engine(
                format!("http://{a}"),
                release_rx.clone(),
                missing,
            ));
            format!("http://{e}")
        })
        .collect();
    (fleet, engines, release_tx)
}

/// Three streamed chat answers of `max_tokens` 4000 to `base` (a gateway, or an engine
/// directly) that a [`holding_engine`] holds open after one token: their tasks (status, body).
fn hold_answers(fleet: &Fleet, base: &str) -> Vec<tokio::task::JoinHandle<(u16, String)>> {
    (0..3)
        .map(|n| {
            let body = serde_json::json!({
                "model": "held", "user": "hold", "stream": true, "max_tokens": 4000,
                "messages": [{"role": "user", "content": format!("a long answer, please ({n})")}],
            });
            let (http, url) = (fleet.http.clone(), format!("{base}/v1/chat/completions"));
            fleet.rt.spawn(async move {
                let r = http.post(url).json(&body).send().await.unwrap();
                (r.status().as_u16(), r.text().await.unwrap())
            })
        })
        .collect()
}

/// While `busy` holds `turn`'s prefix and reports the `held` answers, the turn goes to `other`
/// (`load_guard`); once they are released (each ending whole) `busy`'s report (in
/// `/admin/workers`) empties and the turn is a `hit` again (on either: both hold
/// the prefix by then).
fn moved_off_until_released(
    fleet: &Fleet,
    turn: &serde_json::Value,
    (busy, other): (&str, &str),
    release_tx: &tokio::sync::watch::Sender<bool>,
    held: Vec<tokio::task::JoinHandle<(u16, String)>>,
) {
    let r = fleet.post("/v1/chat/completions", turn, &[]);
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.worker(), other, "the busy worker's report moves the turn");
    assert_eq!(
        r.header("x-kvgate-route-reason").as_deref(),
        Some("load_guard")
    );
    release_tx.send(true).unwrap();
    for h in held {
        let (status, text) = fleet.rt.block_on(h).unwrap();
        assert_eq!(status, 200);
        assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
    }
    fleet.wait_for("the report empties", Duration::from_secs(10), || {
        let l = &fleet.admin_worker(busy)["reported_load"];
        l["running"] == 0 && l["decode_tokens"] == 0
    });
    let r = fleet.post("/v1/chat/completions", turn, &[]);
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.header("x-kvgate-route-reason").as_deref(), Some("hit"));
}

/// Two independent gateways (not a cluster: neither knows the other's requests) in front of the
/// same two sidecars. Gateway A's KV-exact service has a conversation cached on one sidecar's
/// engine; gateway B then streams three long answers through that sidecar, which its engine
/// holds open. Only the sidecar sees both gateways' work: its load report (`GET /v1/load`,
/// which gateway A reads for `openai` upstreams) shows B's requests, and A's next turn of the
/// conversation goes to the other sidecar (`load_guard`) though the first holds its prefix —
/// without the report A would see that sidecar idle. When B's answers end the report empties
/// and the turn is a hit again. An engine without a sidecar (`GET /v1/load` 404) in a KV-exact
/// pool is marked `unsupported` and still serves.
#[test]
fn a_sidecar_reports_the_work_of_every_gateway() {
    let (fleet, engines, release_tx) = held_fleet(&["/v1/load"]);
    let engines_for_raw = engines[0].clone();
    let mut sc = Sidecars::start_with(fleet, engines, "openai", |_, _| {});
    sc.start_gateway();
    let fleet = &sc.fleet;
    let workers = || fleet.admin_workers();
    let worker = |id: &str| fleet.admin_worker(id);
    fleet.wait_for(
        "both sidecars healthy, their load streams read",
        Duration::from_secs(10),
        || {
            let w = workers();
            w.len() == 2
                && w.iter().all(|w| {
                    w["healthy"] == true
                        && w["events"]["load_stream"] == "connected"
                        && w["reported_load"]["running"] == 0
                })
        },
    );

    // A conversation, cached on the sidecar W its first turn went to.
    let long = "Explain how a paged KV cache shares blocks between requests. ".repeat(6);
    let turn = chat(&[("system", "You are terse."), ("user", &long)], 4);
    let r = fleet.post("/v1/chat/completions", &turn, &[]);
    assert_eq!(r.status, 200, "{}", r.text());
    let w = r.worker();
    let other = if w == "s1" { "s2" } else { "s1" };
    let r = fleet.post("/v1/chat/completions", &turn, &[]);
    assert_eq!(r.worker(), w, "the repeat follows its prefix");
    assert_eq!(r.header("x-kvgate-route-reason").as_deref(), Some("hit"));

    // Gateway B: round robin over W alone.
    let rules_b = fleet.dir.path().join("rules-b.toml");
    let addr_w = sc.sidecars[index_of(&r)].as_ref().unwrap().addr();
    std::fs::write(
        &rules_b,
        format!(
            "[[workers]]\nid = \"{w}\"\nurl = \"http://{addr_w}\"\nkind = \"openai\"\n\n\
             [[pools]]\nid = \"one\"\nworkers = [\"{w}\"]\n\n\
             [[services]]\nname = \"held\"\npool = \"one\"\nrule = {{ type = \"round_robin\" }}\n\
             [services.match]\nmodels = [\"held\"]\n"
        ),
    )
    .unwrap();
    let mut cfg = gateway::GatewayConfig::new(&rules_b, sc.second_gateway_key.clone());
    cfg.gateway_id = "gateway-b".into();
    let mut gateway_b = gateway::spawn(cfg).unwrap();
    let vip_b = gateway_b.listen_addr;
    let held = hold_answers(fleet, &format!("http://{vip_b}"));

    // The sidecar counts B's three answers (4000 tokens asked each, one generated); A reads it.
    fleet.wait_for(
        "gateway A sees the work gateway B sent",
        Duration::from_secs(10),
        || {
            let l = &worker(&w)["reported_load"];
            l["running"] == 3 && l["decode_tokens"] == 3 * 3999 && l["prefill_tokens"] == 0
        },
    );
    assert_eq!(worker(other)["reported_load"]["running"], 0);
    let own = worker(&w);
    assert_eq!(own["in_flight"], 0, "gateway A routed none of it: {own}");
    let m = sc.metrics(index_of(&r));
    assert!(m.contains("kvgate_sidecar_load_running 3"), "{m}");
    assert!(m.contains("kvgate_sidecar_load_decode_tokens 11997"), "{m}");
    gateway_support::promtool_check(&m, "the sidecar's /metrics");

    // The busy sidecar's report moves the turn off its prefix; when B's answers end the report
    // empties, and the turn is a hit again.
    moved_off_until_released(fleet, &turn, (&w, other), &release_tx, held);

    // An engine without a sidecar (no `GET /v1/load`) in a KV-exact pool: probed, marked
    // `unsupported`, judged by the gateway's own count; it still serves.
    let raw_url = engines_for_raw;
    let mut rules = sc.rules(None);
    rules.push_str(&format!(
        "\n[[workers]]\nid = \"raw\"\nurl = \"{raw_url}\"\nkind = \"openai\"\n\n\
         [[pools]]\nid = \"raw\"\nworkers = [\"raw\"]\n\n\
         [[services]]\nname = \"exact-raw\"\npool = \"raw\"\n\
         rule = {{ type = \"kv_exact\", profile = \"smol\" }}\n\
         [services.match]\nmodels = [\"smol-raw\"]\n"
    ));
    std::fs::write(&fleet.rules_path, rules).unwrap();
    let reload = fleet.admin(reqwest::Method::POST, "/admin/reload", None);
    assert_eq!(reload.status, 200, "{}", reload.text());
    fleet.wait_for(
        "the raw engine's load stream probed",
        Duration::from_secs(10),
        || {
            let raw = worker("raw");
            raw["healthy"] == true
                && raw["events"]["load_stream"] == "unsupported"
                && raw["reported_load"].is_null()
        },
    );
    let mut body = turn.clone();
    body["model"] = "smol-raw".into();
    let r = fleet.post("/v1/chat/completions", &body, &[]);
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.worker(), "raw");

    gateway_b.shutdown();
    sc.stop();
}

/// A llama-server that clients also reach directly, around its sidecar: the sidecar reads the
/// engine's own `GET /slots` (`engine_load`) and reports the busy slots it never forwarded.
/// Three direct answers held open on the engine under a gateway's cached conversation move
/// the conversation's next turn to the other sidecar (`load_guard`) — without the engine's
/// view the sidecar would report itself idle (its book is empty) — and when they end the turn
/// is a `hit` again.
#[test]
fn a_sidecar_counts_what_reached_its_engine_around_it() {
    let (fleet, engines, release_tx) = held_fleet(&["/v1/load"]);
    let direct_engines = engines.clone();
    let mut sc = Sidecars::start_with(fleet, engines, "openai", |_, cfg| {
        cfg.engine_load = Some(worker::sidecar::engine_load::EngineLoadConfig {
            interval: Duration::from_millis(20),
            ..worker::sidecar::engine_load::EngineLoadConfig::new(
                worker::sidecar::engine_load::EngineLoadSource::Slots,
            )
        });
    });
    sc.start_gateway();
    let fleet = &sc.fleet;
    let worker = |id: &str| fleet.admin_worker(id);
    fleet.wait_for(
        "both sidecars' load streams read",
        Duration::from_secs(10),
        || {
            ["s1", "s2"].iter().all(|id| {
                let w = worker(id);
                w["events"]["load_stream"] == "connected" && w["reported_load"]["running"] == 0
            })
        },
    );

    let long = "Explain how a radix tree indexes cached prompt prefixes. ".repeat(6);
    let turn = chat(&[("system", "You are terse."), ("user", &long)], 4);
    let r = fleet.post("/v1/chat/completions", &turn, &[]);
    assert_eq!(r.status, 200, "{}", r.text());
    let w = r.worker();
    let other = if w == "s1" { "s2" } else { "s1" };
    let r = fleet.post("/v1/chat/completions", &turn, &[]);
    assert_eq!(r.header("x-kvgate-route-reason").as_deref(), Some("hit"));

    // Three clients straight to W's engine: no sidecar, no gateway sees them.
    let engine_w = direct_engines[index_of(&r)].clone();
    let held = hold_answers(fleet, &engine_w);
    fleet.wait_for(
        "the gateway sees the engine's direct work",
        Duration::from_secs(10),
        || {
            let l = &worker(&w)["reported_load"];
            l["running"] == 3 && l["decode_tokens"] == 3 * 3999
        },
    );
    let m = sc.metrics(index_of(&r));
    assert!(m.contains("kvgate_sidecar_engine_load_running 3"), "{m}");
    assert!(
        m.contains("kvgate_sidecar_engine_load_decode_tokens 11997"),
        "{m}"
    );
    assert!(m.contains("kvgate_sidecar_load_running 3"), "{m}");
    assert!(
        m.contains(r#"kvgate_sidecar_engine_load_reads_total{outcome="ok"}"#),
        "{m}"
    );
    gateway_support::promtool_check(&m, "the sidecar's /metrics");
    // The gateway's own exposition of what placement sees there.
    let g = fleet.admin(reqwest::Method::GET, "/metrics", None).text();
    for series in [
        format!("kvgate_gateway_worker_queued_decode_tokens{{worker=\"{w}\"}} 11997"),
        format!("kvgate_gateway_worker_reported_running{{worker=\"{w}\"}} 3"),
        format!("kvgate_gateway_worker_reported_waiting{{worker=\"{w}\"}} 0"),
        format!("kvgate_gateway_worker_queued_decode_tokens{{worker=\"{other}\"}} 0"),
    ] {
        assert!(g.lines().any(|l| l == series), "{series} not in\n{g}");
    }
    gateway_support::promtool_check(&g, "the gateway's /metrics");

    moved_off_until_released(fleet, &turn, (&w, other), &release_tx, held);
    sc.stop();
}

/// A kvgate worker whose KV event stream cannot be reached (404: an older worker, or a proxy
/// in front that does not pass the path) takes the native engines' path: its holdings are
/// approximated from the prompts routed there — the repeat of a prompt follows it, a `hit` —
/// and its load is read from `GET /v1/load` until the next probe of its events.
#[test]
fn a_kvgate_worker_without_events_is_approximated_and_its_load_read() {
    let (mut fleet, proxies, _release) = held_fleet(&["/v1/kv/events"]);
    let rules = format!(
        "[gateway]\nhealth_interval_ms = 100\n\n\
         [[workers]]\nid = \"w1\"\nurl = \"{}\"\n\n[[workers]]\nid = \"w2\"\nurl = \"{}\"\n\n\
         [[pools]]\nid = \"all\"\nworkers = [\"w1\", \"w2\"]\n{}\n\
         [[services]]\nname = \"exact\"\npool = \"all\"\n\
         rule = {{ type = \"kv_exact\", profile = \"smol\", pending_ttl_ms = 0 }}\n\
         [services.match]\nmodels = [\"smol\"]\n",
        proxies[0],
        proxies[1],
        fleet.profile_toml("smol", 16)
    );
    fleet.rules_path = fleet.dir.path().join("rules.toml");
    std::fs::write(&fleet.rules_path, rules).unwrap();
    let mut cfg = gateway::GatewayConfig::new(&fleet.rules_path, fleet.gateway_key.clone());
    cfg.admin_token = Some(fleet.admin_token.clone());
    fleet.gateway = Some(gateway::spawn(cfg).unwrap());
    let workers = || fleet.admin_workers();
    fleet.wait_for(
        "both workers approximated, their loads read",
        Duration::from_secs(10),
        || {
            let w = workers();

            w.len() == 2
                && w.iter().all(|w| {
                    w["healthy"] == true
                        && w["contract"]["state"] == "ok"
                        && w["events"]["state"] == "unsupported (approximate holdings)"
                        && w["events"]["load_stream"] == "connected"
                        && w["reported_load"]["running"] == 0
                })
        },
    );
    let long = "Approximate holdings stand in for a worker's missing KV events. ".repeat(6);
    let turn = chat(&[("system", "You are terse."), ("user", &long)], 4);
    let r1 = fleet.post("/v1/chat/completions", &turn, &[]);
    assert_eq!(r1.status, 200, "{}", r1.text());
    let r2 = fleet.post("/v1/chat/completions", &turn, &[]);
    assert_eq!(r2.status, 200, "{}", r2.text());
    assert_eq!(r2.worker(), r1.worker(), "the repeat follows its prefix");
    assert_eq!(r2.header("x-kvgate-route-reason").as_deref(), Some("hit"));
    let held = workers()
        .into_iter()
        .find(|w| w["id"] == r1.worker().as_str())
        .unwrap();
    assert!(held["approximate_blocks"].as_u64().unwrap() > 0, "{held}");
    assert_eq!(held["indexed_blocks"], 0, "{held}");
    fleet.stop();
}
