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
//!   `ticket_replayed`), the engine gone (503 `engine_unavailable`, receipted; `/ready` 503).

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
        let keys: Vec<KeyPair> = (0..2).map(|_| KeyPair::generate()).collect();
        let mut ring = KeyRing::new();
        ring.insert("gateway", fleet.gateway_key.public().clone());
        let sidecars = (0..2)
            .map(|i| {
                let mut cfg = SidecarConfig::new(
                    format!("http://{}", fleet.addrs[i]),
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
        }
    }

    fn rules(&self, pinned_model: Option<&str>) -> String {
        let mut s = String::from("[gateway]\nhealth_interval_ms = 100\n");
        for (i, sc) in self.sidecars.iter().enumerate() {
            let addr = sc.as_ref().unwrap().addr();
            s.push_str(&format!(
                "\n[[workers]]\nid = \"{}\"\nurl = \"http://{addr}\"\nkind = \"openai\"\n\
                 prompt_cache = {{ ttl_ms = 60000, max_prefixes = 8 }}\n",
                sidecar_id(i)
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
    let good = std::fs::read_to_string(&fleet.rules_path).unwrap();
    std::fs::write(&fleet.rules_path, sc.rules(Some("not-served-here"))).unwrap();
    let (status, text) = fleet.rt.block_on(async {
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
