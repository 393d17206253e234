//! Gateway routing end to end over simulated workers: round-robin balance, KV-exact affinity for
//! interleaved multi-turn conversations, salts that never share a cached prefix, the load
//! guard under a single hot prefix, malformed bodies, the token budget, and tickets the workers
//! accept (they run with `TicketPolicy::Require`).

#[path = "gateway_support/mod.rs"]
mod support;

use std::collections::BTreeMap;
use std::time::Duration;

use support::{chat, free_port, Fleet, FleetOptions, KV_SERVICE, RR_SERVICE};

#[test]
fn round_robin_balances_three_workers() {
    let mut fleet = Fleet::workers(FleetOptions::default());
    fleet.start_gateway(RR_SERVICE, false);
    let mut counts: BTreeMap<String, usize> = BTreeMap::new();
    for i in 0..30 {
        let r = fleet.post(
            "/v1/chat/completions",
            &chat(&[("user", &format!("hello {i}"))], 2),
            &[],
        );
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(
            r.header("x-kvgate-route-reason").as_deref(),
            Some("round_robin")
        );
        *counts.entry(r.worker()).or_default() += 1;
    }
    assert_eq!(counts.len(), 3, "{counts:?}");
    for (w, n) in &counts {
        assert_eq!(*n, 10, "worker {w} got {n} of 30: {counts:?}");
    }
    fleet.stop();
}

#[test]
fn kv_exact_follows_each_conversation_to_its_prefix() {
    let mut fleet = Fleet::workers(FleetOptions::default());
    fleet.start_gateway(KV_SERVICE, false);
    // Six conversations, long enough system prompts to fill several blocks, interleaved turn by turn.
    let convs: Vec<String> = (0..6)
        .map(|c| {
            format!(
                "You are assistant number {c}. {}",
                "Answer briefly and precisely. ".repeat(8)
            )
        })
        .collect();
    let mut history: Vec<Vec<(String, String)>> = convs
        .iter()
        .map(|s| vec![("system".to_owned(), s.clone())])
        .collect();
    let mut owner: Vec<Option<String>> = vec![None; convs.len()];
    for turn in 0..3 {
        for c in 0..convs.len() {
            history[c].push((
                "user".into(),
                format!("conversation {c} turn {turn}: tell me more"),
            ));
            let msgs: Vec<(&str, &str)> = history[c]
                .iter()
                .map(|(r, t)| (r.as_str(), t.as_str()))
                .collect();
            let r = fleet.post("/v1/chat/completions", &chat(&msgs, 4), &[]);
            assert_eq!(r.status, 200, "{}", r.text());
            let w = r.worker();
            match &owner[c] {
                None => owner[c] = Some(w.clone()),
                Some(o) => {
                    assert_eq!(&w, o, "conversation {c} turn {turn} left its worker");
                    assert_eq!(r.header("x-kvgate-route-reason").as_deref(), Some("hit"));
                    assert!(
                        r.cached_tokens() > 0,
                        "turn {turn} of {c} reused nothing: {}",
                        r.text()
                    );
                }
            }
            let reply = r.json()["choices"][0]["message"]["content"]
                .as_str()
                .unwrap_or_default()
                .to_owned();
            history[c].push(("assistant".into(), reply));
            // Wait until the worker's KV events reached the gateway's index.
            wait_keys_indexed(&fleet, &history[c]);
        }
    }
    // The load spread over more than one worker (first turns of idle workers go least-loaded).
    let distinct: std::collections::BTreeSet<_> = owner.iter().flatten().collect();
    assert!(
        distinct.len() > 1,
        "all conversations on one worker: {owner:?}"
    );
    fleet.stop();
}

/// Waits until every full block of the conversation so far (rendered without the next user
/// turn, as the worker cached it) is in the gateway's index for some worker.
fn wait_keys_indexed(fleet: &Fleet, history: &[(String, String)]) {
    let shared = fleet.gw().data.clone();
    let view = shared.views.load();
    let svc = view
        .services
        .iter()
        .find(|s| s.name() == "chat")
        .unwrap()
        .clone();
    let profile = svc.profile().cloned().unwrap();
    // The prompt the worker just served: everything but the assistant reply.
    let served = &history[..history.len() - 1];
    let msgs: Vec<prompt_profile::ChatMessage> = served
        .iter()
        .map(|(r, c)| prompt_profile::ChatMessage::new(r.clone(), c.clone()))
        .collect();
    let tok = profile
        .keys(
            &prompt_profile::PromptSource::Chat(prompt_profile::ChatPrompt::new(msgs)),
            None,
        )
        .unwrap();
    let want = tok.keys.len();
    fleet.wait_for(
        "the served prompt's blocks in the index",
        std::time::Duration::from_secs(10),
        || {
            shared
                .index
                .longest_matches(&tok.keys)
                .iter()
                .any(|m| m.blocks >= want)
        },
    );
}

#[test]
fn different_salts_never_share_a_cached_prefix() {
    let mut fleet = Fleet::workers(FleetOptions::default());
    fleet.start_gateway(KV_SERVICE, false);
    let system = format!("Shared system prompt. {}", "Be helpful. ".repeat(20));
    let body = chat(&[("system", &system), ("user", "hi")], 2);
    let a1 = fleet.post(
        "/v1/chat/completions",
        &body,
        &[("x-tenant-id", "tenant-a")],
    );
    assert_eq!(a1.status, 200, "{}", a1.text());
    let wa = a1.worker();
    wait_body_indexed(&fleet, &body, Some("tenant-a"));
    // Same tenant: hit on the same worker, cached tokens reused.
    let a2 = fleet.post(
        "/v1/chat/completions",
        &body,
        &[("x-tenant-id", "tenant-a")],
    );
    assert_eq!(a2.worker(), wa);
    assert_eq!(a2.header("x-kvgate-route-reason").as_deref(), Some("hit"));
    assert!(a2.cached_tokens() > 0);
    // Other tenants: no match in the index; wherever they land, the worker reuses nothing.
    for t in ["tenant-b", "tenant-c", "tenant-d"] {
        let r = fleet.post("/v1/chat/completions", &body, &[("x-tenant-id", t)]);
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(
            r.header("x-kvgate-route-reason").as_deref(),
            Some("no_match"),
            "{t}"
        );
        assert_eq!(
            r.cached_tokens(),
            0,
            "tenant {t} reused tenant-a's cache on {}",
            r.worker()
        );
    }
    // The header overrides a body cache_salt: body says tenant-a, header says tenant-e.
    let mut salted = body.clone();
    salted["cache_salt"] = serde_json::json!("tenant-a");
    let e = fleet.post(
        "/v1/chat/completions",
        &salted,
        &[("x-tenant-id", "tenant-e")],
    );
    assert_eq!(
        e.header("x-kvgate-route-reason").as_deref(),
        Some("no_match")
    );
    assert_eq!(e.cached_tokens(), 0);
    // Without the header the body salt applies and finds tenant-a's prefix.
    let b = fleet.post("/v1/chat/completions", &salted, &[]);
    assert_eq!(b.worker(), wa);
    assert!(b.cached_tokens() > 0);
    fleet.stop();
}

fn wait_body_indexed(fleet: &Fleet, body: &serde_json::Value, salt: Option<&str>) {
    let shared = fleet.gw().data.clone();
    let view = shared.views.load();
    let profile = view.services[0].profile().cloned().unwrap();
    let msgs: Vec<prompt_profile::ChatMessage> =
        serde_json::from_value(body["messages"].clone()).unwrap();
    let tok = profile
        .keys(
            &prompt_profile::PromptSource::Chat(prompt_profile::ChatPrompt::new(msgs)),
            salt,
        )
        .unwrap();
    let want = tok.keys.len();
    assert!(want > 0);
    fleet.wait_for(
        "prompt blocks in the index",
        std::time::Duration::from_secs(10),
        || {
            shared
                .index
                .longest_matches(&tok.keys)
                .iter()
                .any(|m| m.blocks >= want)
        },
    );
}

/// `kv_exact` with the request-count load guard and no routing-time holdings.
const KV_IN_FLIGHT_SERVICE: &str = r#"
[[services]]
name = "chat"
pool = "all"
rule = { type = "kv_exact", profile = "smol", load_metric = "in_flight", pending_ttl_ms = 0, salt = { mode = "tenant_header", header = "x-tenant-id", allow_body_salt = true } }
"#;

/// The defaults (`active_tokens`, routing-time holdings for 2 s): a burst of one *new* prefix,
/// sent while the first request is still prefilling, stays on the first request's worker (the
/// holding is counted for placement) — the tickets predict no cached tokens for them (a
/// routing-time holding is never a predicted hit) — and the worker computes the prefix once:
/// the later requests wait for its blocks and report them cached.
#[test]
fn a_cold_burst_stays_on_one_worker_and_is_computed_once() {
    let mut sim = engine::sim::SimConfig::instant(16, 4096);
    sim.prefill_us_per_token = 2_000; // ~200 prompt tokens: ~0.4 s of prefill
    let mut fleet = Fleet::workers(FleetOptions {
        sim,
        ..FleetOptions::default()
    });
    fleet.start_gateway(KV_SERVICE, false);
    let system = format!("A new prefix. {}", "Nobody asked this before. ".repeat(30));
    let url = fleet.url("/v1/chat/completions");
    let bodies: Vec<serde_json::Value> = (0..3)
        .map(|i| {
            chat(
                &[("system", &system), ("user", &format!("question {i}"))],
                2,
            )
        })
        .collect();
    let replies = fleet.rt.block_on(async {
        let mut pending = Vec::new();
        for b in &bodies {
            let req = fleet.http.post(&url).json(b).send();
            pending.push(tokio::spawn(req));
            // Sent one after another, each while the first is still prefilling.
            tokio::time::sleep(std::time::Duration::from_millis(30)).await;
        }
        let mut out = Vec::new();
        for p in pending {
            let r = p.await.unwrap().unwrap();
            let h = |n: &str| r.headers().get(n).unwrap().to_str().unwrap().to_owned();
            let (w, id) = (h("x-kvgate-worker"), h("x-request-id"));
            let body: serde_json::Value = r.json().await.unwrap();
            out.push((w, id, body));
        }
        out
    });
    let first = &replies[0].0;
    for (w, id, body) in &replies {
        assert_eq!(w, first, "the burst scattered: {replies:?}");
        let i: usize = w.trim_start_matches('w').parse::<usize>().unwrap() - 1;
        let receipt = fleet.receipt(i, id).expect("receipt");
        let ticket = receipt
            .body
            .ticket
            .as_ref()
            .unwrap()
            .ticket_unverified()
            .clone();
        assert_eq!(
            ticket.predicted_matched_tokens,
            Some(0),
            "a routing-time holding predicted as a hit"
        );
        let _ = body;
    }
    let cached: Vec<u64> = replies
        .iter()
        .map(|(_, _, b)| {
            b["usage"]["prompt_tokens_details"]["cached_tokens"]
                .as_u64()
                .unwrap()
        })
        .collect();
    assert_eq!(cached[0], 0);
    assert!(
        cached[1] > 0 && cached[2] > 0,
        "computed more than once: {cached:?}"
    );
    fleet.stop();
}

/// A burst of one new prefix sent all at once (no gap between the requests): the gateway's two
/// routing threads decide them concurrently, and each decision reads the index under the
/// service's placement lock, after the decisions before it left their routing-time holdings —
/// so the burst stays on one worker. (With the lookup made before the lock, two decisions that
/// tokenized at the same time both saw no holding and put the prefix on two workers.)
#[test]
fn a_simultaneous_cold_burst_stays_on_one_worker() {
    let mut sim = engine::sim::SimConfig::instant(16, 4096);
    sim.prefill_us_per_token = 2_000;
    let mut fleet = Fleet::workers(FleetOptions {
        sim,
        ..FleetOptions::default()
    });
    fleet.start_gateway(KV_SERVICE, false);
    let url = fleet.url("/v1/chat/completions");
    for round in 0..3 {
        let system = format!(
            "Burst {round} opens a prefix. {}",
            "Nobody sent this one before. ".repeat(30)
        );
        let workers = fleet.rt.block_on(async {
            let sends: Vec<_> = (0..8)
                .map(|i| {
                    let body = chat(
                        &[("system", &system), ("user", &format!("question {i}"))],
                        2,
                    );
                    tokio::spawn(fleet.http.post(&url).json(&body).send())
                })
                .collect();
            let mut out = Vec::new();
            for s in sends {
                let r = s.await.unwrap().unwrap();
                assert_eq!(r.status(), 200);
                out.push(
                    r.headers()
                        .get("x-kvgate-worker")
                        .unwrap()
                        .to_str()
                        .unwrap()
                        .to_owned(),
                );
            }
            out
        });
        assert!(
            workers.iter().all(|w| w == &workers[0]),
            "burst {round} split over workers: {workers:?}"
        );
    }
    fleet.stop();
}

#[test]
fn load_guard_spreads_a_single_hot_prefix() {
    // Slow decoding so that a burst overlaps.
    let mut sim = engine::sim::SimConfig::instant(16, 4096);
    sim.decode_us_base = 20_000; // 500 tokens = 10 s: the streams stay open for the whole burst
    let mut fleet = Fleet::workers(FleetOptions {
        sim,
        ..FleetOptions::default()
    });
    // The request-count guard, without routing-time holdings (the defaults are
    // `active_tokens` and 2 s; see `a_cold_burst_stays_on_one_worker_...` for those).
    fleet.start_gateway(KV_IN_FLIGHT_SERVICE, false);
    let system = format!(
        "Hot prefix. {}",
        "Everyone asks the same thing. ".repeat(20)
    );
    let body = chat(&[("system", &system), ("user", "go")], 2);
    let warm = fleet.post("/v1/chat/completions", &body, &[]);
    assert_eq!(warm.status, 200);
    let hot = warm.worker();
    wait_body_indexed(&fleet, &body, None);
    // A burst of 9 long streams with the hot prefix, each held open (in flight) before the next
    // is sent, so the loads the policy sees are deterministic.
    let mut burst = body.clone();
    burst["max_tokens"] = serde_json::json!(500);
    burst["stream"] = serde_json::json!(true);
    let url = fleet.url("/v1/chat/completions");
    let (workers, reasons) = fleet.rt.block_on(async {
        let mut open = Vec::new();
        let mut workers = Vec::new();
        let mut reasons = Vec::new();
        for _ in 0..9 {
            let r = fleet.http.post(&url).json(&burst).send().await.unwrap();
            assert_eq!(r.status(), 200);
            let h = |n: &str| r.headers().get(n).unwrap().to_str().unwrap().to_owned();
            workers.push(h("x-kvgate-worker"));
            reasons.push(h("x-kvgate-route-reason"));
            open.push(r);
        }
        // While the streams are open the admin plane shows their active tokens: at least the
        // 500 requested output tokens of each open stream on its worker.
        let admin = format!("http://{}/admin/workers", fleet.gw().admin_addr);
        let v: serde_json::Value = fleet
            .http
            .get(&admin)
            .bearer_auth(&fleet.admin_token)
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        for w in v["workers"].as_array().unwrap() {
            let id = w["id"].as_str().unwrap();
            let open_here = workers.iter().filter(|x| x.as_str() == id).count() as u64;
            let active = w["active_tokens"].as_u64().unwrap();
            assert!(active >= 500 * open_here, "{w}");
            assert_eq!(w["in_flight"].as_u64(), Some(open_here), "{w}");
        }
        drop(open); // client disconnects: the workers cancel the streams
        (workers, reasons)
    });
    let mut counts: BTreeMap<String, usize> = BTreeMap::new();
    for w in &workers {
        *counts.entry(w.clone()).or_default() += 1;
    }
    let guarded = reasons
        .iter()
        .filter(|r| r.as_str() == "load_guard")
        .count();
    // With 3 workers, max_load_ratio 1.5 and slack 1, a worker at load L is skipped once
    // L >= max(1.5 × mean, mean + 1): the hot worker takes 2, then the guard spreads the rest.
    assert_eq!(workers[0], hot, "{workers:?}");
    assert_eq!(workers[1], hot, "{workers:?}");
    assert_ne!(workers[2], hot, "{workers:?} {reasons:?}");
    assert!(counts.len() == 3, "the hot prefix piled up: {counts:?}");
    assert!(counts[&hot] <= 5, "{counts:?}");
    assert!(guarded > 0, "no load_guard decision: {reasons:?}");
    let metrics = fleet.admin(reqwest::Method::GET, "/metrics", None).text();
    assert!(metrics.contains("reason=\"load_guard\""), "{metrics}");
    fleet.stop();
}

/// The workers' own load reports (`event: load` on their KV event streams) reach the gateway
/// and steer placement: a stream sent straight to w1 — work the gateway never routed, so its
/// own count for w1 stays 0 — shows in the admin plane as w1's `reported_load`, and new
/// conversations (no match anywhere) go to the idle workers instead of rotating onto w1.
#[test]
fn worker_load_reports_steer_placement_away_from_work_the_gateway_did_not_route() {
    let mut sim = engine::sim::SimConfig::instant(16, 4096);
    sim.decode_us_base = 20_000; // 500 tokens = 10 s: the direct stream outlives the test
    let mut fleet = Fleet::workers(FleetOptions {
        workers: 2,
        sim,
        ticket_policy: worker::TicketPolicy::Optional,
        ..FleetOptions::default()
    });
    fleet.start_gateway(KV_SERVICE, false);
    let direct = format!("http://{}/v1/chat/completions", fleet.addrs[0]);
    let mut long = chat(&[("user", "a long story, straight to w1")], 500);
    long["stream"] = serde_json::json!(true);
    let open = fleet.rt.block_on(async {
        let r = fleet.http.post(&direct).json(&long).send().await.unwrap();
        assert_eq!(r.status(), 200);
        r
    });
    let reported = |fleet: &Fleet| {
        let v = fleet
            .admin(reqwest::Method::GET, "/admin/workers", None)
            .json();
        v["workers"]
            .as_array()
            .unwrap()
            .iter()
            .find(|w| w["id"] == "w1")
            .unwrap()
            .clone()
    };
    fleet.wait_for(
        "w1's report of the direct stream",
        Duration::from_secs(10),
        || {
            reported(&fleet)["reported_load"]["decode_tokens"]
                .as_u64()
                .is_some_and(|d| d > 400)
        },
    );
    let w1 = reported(&fleet);
    assert_eq!(w1["in_flight"], 0, "{w1}");
    assert_eq!(w1["reported_load"]["running"], 1, "{w1}");
    // Four new conversations, one after another: without the report the gateway would see two
    // idle workers and alternate; with it every one goes to w2.
    for i in 0..4 {
        let r = fleet.post(
            "/v1/chat/completions",
            &chat(&[("user", &format!("a new conversation number {i}"))], 2),
            &[],
        );
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(
            r.worker(),
            "w2",
            "request {i}: {:?}",
            r.header("x-kvgate-route-reason")
        );
    }
    drop(open);
    // Once w1 is idle again its report says so (and placement alternates again).
    fleet.wait_for("w1's idle report", Duration::from_secs(10), || {
        reported(&fleet)["reported_load"]["decode_tokens"] == 0
    });
    fleet.stop();
}

/// A burst of new conversations sent at once splits evenly over two idle workers: each
/// decision reserves its worker's load as it selects (under the service's placement lock), so
/// the next decision — even one taken before the first request reached its worker — sees it.
#[test]
fn a_simultaneous_burst_of_new_conversations_splits_evenly() {
    let mut sim = engine::sim::SimConfig::instant(16, 4096);
    sim.prefill_us_per_token = 3_000; // ~40-token prompts: ~120 ms of prefill each
    let mut fleet = Fleet::workers(FleetOptions {
        workers: 2,
        sim,
        ..FleetOptions::default()
    });
    fleet.start_gateway(KV_SERVICE, false);
    let url = fleet.url("/v1/chat/completions");
    for round in 0..3 {
        let workers: Vec<String> = fleet.rt.block_on(async {
            let sends = (0..8).map(|i| {
                // Distinct from the first block on (a system message of its own: the
                // template's default one would be a prefix they all share).
                let system = format!("{round}{i} is the number of this conversation.");
                let body = chat(&[("system", &system), ("user", "hello there")], 2);
                let (http, url) = (fleet.http.clone(), url.clone());
                async move {
                    let r = http.post(&url).json(&body).send().await.unwrap();
                    assert_eq!(r.status(), 200);
                    r.headers()["x-kvgate-worker"].to_str().unwrap().to_owned()
                }
            });
            futures::future::join_all(sends).await
        });
        let on_w1 = workers.iter().filter(|w| w.as_str() == "w1").count();
        assert_eq!(on_w1, 4, "round {round}: {workers:?}");
    }
    fleet.stop();
}

#[test]
fn kv_exact_rejects_malformed_bodies_and_over_budget_prompts() {
    let mut fleet = Fleet::workers(FleetOptions {
        workers: 1,
        // Straight to the worker without a ticket, for the comparison below.
        ticket_policy: worker::TicketPolicy::Optional,
        ..FleetOptions::default()
    });
    fleet.start_gateway(KV_SERVICE, false);
    let r = fleet.post_raw(
        "/v1/chat/completions",
        b"{\"model\": \"smol\", \"messages\": [".to_vec(),
        &[],
    );
    assert_eq!(r.status, 400, "{}", r.text());
    assert_eq!(r.json()["error"]["code"], "invalid_json");
    let r = fleet.post_raw(
        "/v1/chat/completions",
        br#"{"messages": "nope"}"#.to_vec(),
        &[],
    );
    assert_eq!(r.status, 400);
    assert_eq!(
        (&r.json()["error"]["code"], &r.json()["error"]["param"]),
        (
            &serde_json::json!("invalid_type"),
            &serde_json::json!("messages")
        )
    );
    // Over budget: a prompt of ~12k tokens against the model's context limit, with and without
    // `max_tokens`. The gateway refuses it itself, with what the worker answers the same body:
    // code, param (`max_tokens` when the request named it) and the four numbers.
    let long = "word ".repeat(12_000);
    let mut unnamed = chat(&[("user", &long)], 16);
    unnamed.as_object_mut().unwrap().remove("max_tokens");
    for (body, param) in [
        (chat(&[("user", &long)], 16), "max_tokens"),
        (unnamed, "messages"),
    ] {
        let r = fleet.post("/v1/chat/completions", &body, &[]);
        assert_eq!(r.status, 400, "{}", r.text());
        assert!(
            r.header("x-kvgate-worker").is_none(),
            "refused at the gateway"
        );
        let direct = fleet.post_to_worker(
            0,
            "/v1/chat/completions",
            serde_json::to_vec(&body).unwrap(),
        );
        assert_eq!(direct.status, 400, "{}", direct.text());
        let (g, w) = (&r.json()["error"], &direct.json()["error"]);
        for field in [
            "code",
            "param",
            "context_limit",
            "prompt_tokens",
            "max_tokens",
            "native_reserve",
        ] {
            assert_eq!(g[field], w[field], "{field}: gateway {g} worker {w}");
        }
        assert_eq!(
            (&g["code"], &g["param"]),
            (
                &serde_json::json!("context_length_exceeded"),
                &serde_json::json!(param)
            )
        );
    }
    // Unknown path for this service.
    let r = fleet.post("/v1/embeddings", &serde_json::json!({"input": "x"}), &[]);
    assert_eq!(r.status, 400);
    let m = fleet.admin(reqwest::Method::GET, "/metrics", None).text();
    assert!(m.contains("reason=\"unparsable_body\""), "{m}");
    assert!(m.contains("reason=\"budget\""), "{m}");
    fleet.stop();
}

/// Values that break a field's type, range or encoding.
fn odd_value(rng: &mut impl rand::Rng) -> serde_json::Value {
    use serde_json::json;
    let odd = [
        json!(null),
        json!(true),
        json!(0),
        json!(-1),
        json!(2_147_483_648u64),
        json!(u64::MAX),
        json!(i64::MIN),
        json!(1e308),
        json!(-1e308),
        json!(1.5),
        json!(1e-320),
        json!(""),
        json!("x"),
        json!("\u{0}"),
        json!("😀".repeat(40)),
        json!("a".repeat(3000)),
        json!([]),
        json!([null]),
        json!([1, 2]),
        json!({}),
        json!({"a": 1}),
        json!({"type": "text", "text": "hi"}),
        json!([{"type": "text", "text": "hi"}, {"type": "text", "text": "there"}]),
        json!([{"type": "image_url", "image_url": {"url": "x"}}]),
        json!("<|im_start|>assistant"),
        json!("{{ raise_exception('x') }}"),
        json!([[[[[[[[[[[]]]]]]]]]]]),
    ];
    odd[rng.gen_range(0..odd.len())].clone()
}

/// A chat or completions body: a valid one with up to three fields made odd.
fn random_body(rng: &mut impl rand::Rng, chat: bool) -> serde_json::Value {
    use serde_json::json;
    const FIELDS: &[&str] = &[
        "model",
        "messages",
        "prompt",
        "max_tokens",
        "max_completion_tokens",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "stream",
        "stream_options",
        "stop",
        "seed",
        "logprobs",
        "top_logprobs",
        "n",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "tools",
        "tool_choice",
        "response_format",
        "user",
        "echo",
        "ignore_eos",
        "min_tokens",
        "chat_template_kwargs",
        "separate_reasoning",
        "stop_token_ids",
        "logit_bias",
        "parallel_tool_calls",
        "rid",
        "return_logprob",
        "suffix",
        "add_generation_prompt",
        "continue_final_message",
        "kvgate_salt",
    ];
    let mut b = json!({"model": "smol", "max_tokens": 3, "stream": rng.gen_bool(0.3)});
    if chat {
        let n = rng.gen_range(1..4);
        let roles = [
            "user",
            "user",
            "user",
            "system",
            "assistant",
            "tool",
            "developer",
            "x",
        ];
        let msgs: Vec<serde_json::Value> = (0..n)
            .map(|_| {
                let mut m =
                    json!({"role": roles[rng.gen_range(0..roles.len())], "content": "hello there"});
                if rng.gen_bool(0.15) {
                    m["content"] = odd_value(rng);
                }
                if rng.gen_bool(0.1) {
                    m["tool_calls"] = json!([{"id": odd_value(rng), "type": "function",
                        "function": {"name": odd_value(rng), "arguments": odd_value(rng)}}]);
                }
                m
            })
            .collect();
        b["messages"] = json!(msgs);
    } else {
        let prompts = [
            json!("hello"),
            json!([1, 2, 3]),
            json!([[1, 2], [3]]),
            json!([-1]),
            json!([1u64 << 40]),
            json!(["a", "b"]),
        ];
        b["prompt"] = prompts[rng.gen_range(0..prompts.len())].clone();
    }
    for _ in 0..rng.gen_range(0..4) {
        let f = FIELDS[rng.gen_range(0..FIELDS.len())];
        b[f] = if f == "tools" && rng.gen_bool(0.5) {
            json!([{"type": "function", "function": {"name": odd_value(rng),
                "description": odd_value(rng), "parameters": odd_value(rng)}}])
        } else {
            odd_value(rng)
        };
    }
    b
}

/// A request body from a client is never a reason to fail: 400 random bodies — valid ones with
/// fields of the wrong type, range or encoding, truncated JSON, bytes that are not UTF-8 —
/// through the gateway (KV-exact: it renders and tokenizes them) to a worker (which checks and
/// runs them) are each answered 200 or a 4xx with an OpenAI error object, and both still serve
/// afterwards. Where the gateway refuses a body itself, the same bytes sent straight to a worker
/// are refused too, with the same code wherever the worker names the same field
/// (`prompt_profile::BodyError`, one classification for both). Seeded, so a failure names the
/// body that caused it (`KVGATE_TEST_SEED=n` runs another seed).
#[test]
fn random_bodies_get_an_answer_or_a_4xx_error_never_a_5xx() {
    use rand::{Rng, SeedableRng};
    let mut fleet = Fleet::workers(FleetOptions {
        workers: 2,
        // Straight to a worker without a ticket, for the comparison.
        ticket_policy: worker::TicketPolicy::Optional,
        ..FleetOptions::default()
    });
    fleet.start_gateway(KV_SERVICE, false);
    // Another seed: KVGATE_TEST_SEED=n.
    let seed = std::env::var("KVGATE_TEST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(17);
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let mut statuses: BTreeMap<u16, usize> = BTreeMap::new();
    let mut codes: BTreeMap<String, usize> = BTreeMap::new();
    let mut same_code = 0;
    for i in 0..400 {
        let chat = rng.gen_bool(0.75);
        let path = if chat {
            "/v1/chat/completions"
        } else {
            "/v1/completions"
        };
        let body = random_body(&mut rng, chat);
        let mut bytes = serde_json::to_vec(&body).unwrap();
        match rng.gen_range(0..20) {
            0 => bytes.truncate(rng.gen_range(0..bytes.len())),
            1 => {
                let at = rng.gen_range(0..bytes.len());
                bytes.insert(at, 0xff);
            }
            _ => {}
        }
        let r = fleet.post_raw(path, bytes.clone(), &[]);
        let shown: String = String::from_utf8_lossy(&bytes).chars().take(600).collect();
        *statuses.entry(r.status).or_default() += 1;
        match r.status {
            200 => {
                if body["stream"] == serde_json::json!(true) {
                    assert!(
                        r.text().trim_end().ends_with("data: [DONE]"),
                        "#{i} {shown}: {}",
                        r.text()
                    );
                } else {
                    assert!(r.json()["choices"].is_array(), "#{i} {shown}: {}", r.text());
                }
            }
            400..=499 => {
                let e = r.json();
                let code = e["error"]["code"].as_str().unwrap_or_else(|| {
                    panic!(
                        "#{i} {shown}: a {} without an error code: {}",
                        r.status,
                        r.text()
                    )
                });
                assert!(
                    e["error"]["message"].is_string(),
                    "#{i} {shown}: {}",
                    r.text()
                );
                *codes.entry(format!("{} {code}", r.status)).or_default() += 1;
                if r.header("x-kvgate-worker").is_none() {
                    // Refused by the gateway: what does the worker itself say?
                    let w = fleet.post_to_worker(0, path, bytes.clone());
                    assert!(
                        (400..500).contains(&w.status),
                        "#{i} {shown}: the worker said {}: {}",
                        w.status,
                        w.text()
                    );
                    let we = w.json();
                    if we["error"]["param"] == e["error"]["param"] {
                        assert_eq!(
                            we["error"]["code"],
                            e["error"]["code"],
                            "#{i} {shown}: gateway {} worker {}",
                            r.text(),
                            w.text()
                        );
                        same_code += 1;
                    }
                }
            }
            s => panic!("#{i} {path} {shown}: status {s}: {}", r.text()),
        }
    }
    println!("statuses {statuses:?}\nerror codes {codes:?}\nrefused by the gateway with the worker's own code and param: {same_code}");
    // Not a vacuous pass: many bodies ran, the errors came from several checks, and many of
    // the gateway's refusals were compared with the worker's.
    assert!(
        statuses.get(&200).copied().unwrap_or(0) >= 40,
        "{statuses:?}"
    );
    assert!(codes.len() >= 5, "{codes:?}");
    assert!(same_code >= 50, "{same_code}");
    // Both still serve.
    for _ in 0..2 {
        let r = fleet.post(
            "/v1/chat/completions",
            &chat(&[("user", "still there?")], 3),
            &[],
        );
        assert_eq!(r.status, 200, "{}", r.text());
    }
    fleet.stop();
}

// ---- tenants: API keys, tenant salts, rate limits ----

fn sha256_hex(s: &str) -> String {
    use sha2::Digest;
    hex::encode(sha2::Sha256::digest(s.as_bytes()))
}

/// Two KV-exact services behind API keys: `chat` (salted by tenant) and `limited` (a tenant
/// with a 2-request burst and a 60-token bucket).
fn tenant_services() -> String {
    format!(
        r#"
[[tenants]]
id = "acme"
api_keys_sha256 = ["{}", "{}"]

[[tenants]]
id = "beta"
api_keys_sha256 = ["{}"]

[[tenants]]
id = "slow"
api_keys_sha256 = ["{}"]
requests_per_second = 0.5
request_burst = 2
tokens_per_second = 1.0
token_burst = 400

[[services]]
name = "chat"
pool = "all"
auth = "api_key"
rule = {{ type = "kv_exact", profile = "smol", salt = {{ mode = "tenant" }} }}
"#,
        sha256_hex("acme-key-1"),
        sha256_hex("acme-key-2"),
        sha256_hex("beta-key"),
        sha256_hex("slow-key"),
    )
}

#[test]
fn api_keys_authenticate_tenants_and_tenants_never_share_a_cache() {
    let mut fleet = Fleet::workers(FleetOptions::default());
    fleet.start_gateway(&tenant_services(), true);
    let system = format!("Tenant system prompt. {}", "Be precise. ".repeat(20));
    let body = chat(&[("system", &system), ("user", "hi")], 2);
    let path = "/v1/chat/completions";

    // No key, a key no tenant has, a non-Bearer scheme: 401 invalid_api_key, never routed.
    for headers in [
        vec![],
        vec![("authorization", "Bearer wrong-key")],
        vec![("authorization", "Basic YWNtZS1rZXktMQ==")],
        vec![("authorization", "Bearer ")],
    ] {
        let r = fleet.post(path, &body, &headers);
        assert_eq!(r.status, 401, "{headers:?}: {}", r.text());
        assert_eq!(r.json()["error"]["code"], "invalid_api_key");
        assert_eq!(r.json()["error"]["type"], "authentication_error");
        assert_eq!(r.header("www-authenticate").as_deref(), Some("Bearer"));
        assert!(!r.text().contains("wrong-key"), "the key is echoed");
        assert!(r.header("x-kvgate-worker").is_none());
    }

    // acme: served, then a hit on the same worker with its cache reused — under either key.
    let a1 = fleet.post(path, &body, &[("authorization", "Bearer acme-key-1")]);
    assert_eq!(a1.status, 200, "{}", a1.text());
    wait_body_indexed(&fleet, &body, Some("tenant:acme"));
    let a2 = fleet.post(path, &body, &[("authorization", "bearer acme-key-2")]);
    assert_eq!(a2.status, 200, "{}", a2.text());
    assert_eq!(a2.worker(), a1.worker());
    assert_eq!(a2.header("x-kvgate-route-reason").as_deref(), Some("hit"));
    assert!(a2.cached_tokens() > 0);
    // beta, same prompt: no match, and wherever it lands the worker reuses nothing of acme's.
    let b = fleet.post(path, &body, &[("authorization", "Bearer beta-key")]);
    assert_eq!(b.status, 200, "{}", b.text());
    assert_eq!(
        b.header("x-kvgate-route-reason").as_deref(),
        Some("no_match")
    );
    assert_eq!(b.cached_tokens(), 0, "beta reused acme's cache");
    // The receipts carry different namespaces: the salt reached the workers through the ticket.
    let seed = |r: &support::Reply| {
        let i: usize = r.worker()[1..].parse::<usize>().unwrap() - 1;
        let id = r.header("x-request-id").unwrap();
        let receipt = fleet.receipt(i, &id).expect("receipt");
        receipt
            .body
            .ticket
            .as_ref()
            .unwrap()
            .ticket_unverified()
            .namespace_seed
    };
    assert_eq!(seed(&a1), seed(&a2));
    assert_ne!(seed(&a1), seed(&b));
    // A client never picks its salt here: a body cache_salt is refused.
    let mut salted = body.clone();
    salted["cache_salt"] = serde_json::json!("tenant:beta");
    let r = fleet.post(path, &salted, &[("authorization", "Bearer acme-key-1")]);
    assert_eq!(r.status, 400, "{}", r.text());
    assert_eq!(r.json()["error"]["code"], "invalid_request_body");

    // The decision log names the tenant of routed and refused requests alike.
    let log = std::fs::read_to_string(fleet.dir.path().join("decisions.jsonl")).unwrap_or_default();
    let tenants: Vec<Option<String>> = log
        .lines()
        .map(|l| {
            receipts::DecisionRecord::from_line(l.as_bytes())
                .unwrap()
                .tenant
        })
        .collect();
    assert!(tenants.contains(&Some("acme".into())), "{log}");
    assert!(tenants.contains(&Some("beta".into())), "{log}");
    // Metrics count the refused keys.
    let metrics = fleet.admin(reqwest::Method::GET, "/metrics", None).text();
    assert!(
        metrics.contains("kvgate_gateway_invalid_api_keys_total 4"),
        "{metrics}"
    );
    fleet.stop();
    // The audit's usage per tenant: requests from the decision log, tokens from the workers'
    // signed receipts, equal to what the answers' `usage` told the clients.
    let report = fleet.audit();
    assert!(report.ok(), "{report}");
    let usage = |replies: &[&support::Reply]| receipts::TenantUsage {
        requests: replies.len() as u64,
        unrouted: 0,
        answered: replies.len() as u64,
        disconnected: 0,
        prompt_tokens: replies
            .iter()
            .map(|r| r.json()["usage"]["prompt_tokens"].as_u64().unwrap())
            .sum(),
        cached_tokens: replies.iter().map(|r| r.cached_tokens()).sum(),
        completion_tokens: replies
            .iter()
            .map(|r| r.json()["usage"]["completion_tokens"].as_u64().unwrap())
            .sum(),
    };
    // acme's third request (the refused cache_salt) was answered by the gateway: unrouted.
    let mut acme = usage(&[&a1, &a2]);
    acme.requests += 1;
    acme.unrouted += 1;
    assert!(
        acme.completion_tokens > 0 && acme.cached_tokens > 0,
        "{acme:?}"
    );
    assert_eq!(report.per_tenant.get("acme"), Some(&acme), "{report}");
    assert_eq!(
        report.per_tenant.get("beta"),
        Some(&usage(&[&b])),
        "{report}"
    );
    assert_eq!(report.per_tenant.len(), 2, "{report}");
    assert!(report.to_string().contains("per tenant"), "{report}");
}

#[test]
fn tenant_rate_limits_answer_429_with_retry_after() {
    let mut fleet = Fleet::workers(FleetOptions::default());
    fleet.start_gateway(&tenant_services(), false);
    let path = "/v1/chat/completions";
    let key = [("authorization", "Bearer slow-key")];
    // The request bucket holds 2: two pass, the third is refused with a whole-second wait.
    let small = chat(&[("user", "hello")], 2);
    for _ in 0..2 {
        let r = fleet.post(path, &small, &key);
        assert_eq!(r.status, 200, "{}", r.text());
    }
    let r = fleet.post(path, &small, &key);
    assert_eq!(r.status, 429, "{}", r.text());
    assert_eq!(r.json()["error"]["code"], "rate_limit_exceeded");
    assert_eq!(r.json()["error"]["type"], "rate_limit_error");
    let wait: u64 = r.header("retry-after").unwrap().parse().unwrap();
    assert!((1..=2).contains(&wait), "retry-after {wait}");
    // Other tenants are not affected.
    let r = fleet.post(path, &small, &[("authorization", "Bearer acme-key-1")]);
    assert_eq!(r.status, 200, "{}", r.text());
    // After the wait two more requests fit, but one asking for more tokens than the token
    // bucket holds (400) is refused by the token limit: 16 choices of 100 tokens count 1600.
    std::thread::sleep(std::time::Duration::from_millis(4100));
    let mut many = chat(&[("user", "hello")], 100);
    many["n"] = serde_json::json!(16);
    let r = fleet.post(path, &many, &key);
    assert_eq!(r.status, 429, "{}", r.text());
    assert!(r.json()["error"]["message"]
        .as_str()
        .unwrap()
        .contains("(tokens)"));
    // One choice of 100 tokens fits.
    let one = chat(&[("user", "hello")], 100);
    let r = fleet.post(path, &one, &key);
    assert_eq!(r.status, 200, "{}", r.text());
    let metrics = fleet.admin(reqwest::Method::GET, "/metrics", None).text();
    assert!(
        metrics.contains("kvgate_gateway_rate_limited_total{tenant=\"slow\",limit=\"requests\"} 1"),
        "{metrics}"
    );
    assert!(
        metrics.contains("kvgate_gateway_rate_limited_total{tenant=\"slow\",limit=\"tokens\"} 1"),
        "{metrics}"
    );
    fleet.stop();
}

/// A tenant's `max_concurrent_requests`: with 2 allowed, 4 concurrent requests get 2 answers
/// and 2 × 429 `rate_limit_exceeded` (limit `concurrency`, `Retry-After: 1`), without touching
/// another tenant; slots free as answers end (streams included), and the gauge says so.
#[test]
fn a_tenant_over_its_concurrency_limit_gets_429_and_its_slots_free_when_answers_end() {
    let mut fleet = Fleet::workers(FleetOptions {
        workers: 2,
        // ~6 ms per decode step: a 40-token answer stays in flight for about 0.3 s.
        sim: engine::sim::SimConfig {
            block_size: 16,
            num_blocks: 4096,
            ..engine::sim::SimConfig::default()
        },
        ..FleetOptions::default()
    });
    let services = format!(
        r#"
[[tenants]]
id = "narrow"
api_keys_sha256 = ["{}"]
max_concurrent_requests = 2

[[tenants]]
id = "wide"
api_keys_sha256 = ["{}"]

[[services]]
name = "chat"
pool = "all"
auth = "api_key"
rule = {{ type = "round_robin" }}
"#,
        sha256_hex("narrow-key"),
        sha256_hex("wide-key"),
    );
    fleet.start_gateway(&services, false);
    let send_all = |key: &str, n: usize| {
        fleet.rt.block_on(async {
            let sends = (0..n).map(|i| {
                let mut body = chat(&[("user", &format!("concurrent {i}"))], 40);
                body["stream"] = serde_json::json!(i % 2 == 0);
                let req = fleet
                    .http
                    .post(fleet.url("/v1/chat/completions"))
                    .bearer_auth(key)
                    .json(&body);
                async move { support::Reply::read(req.send().await.unwrap()).await }
            });
            futures::future::join_all(sends).await
        })
    };
    let replies = send_all("narrow-key", 4);
    let ok = replies.iter().filter(|r| r.status == 200).count();
    let refused: Vec<_> = replies.iter().filter(|r| r.status == 429).collect();
    assert_eq!(
        (ok, refused.len()),
        (2, 2),
        "{:?}",
        replies.iter().map(|r| r.status).collect::<Vec<_>>()
    );
    for r in &refused {
        assert_eq!(
            r.json()["error"]["code"],
            "rate_limit_exceeded",
            "{}",
            r.text()
        );
        assert!(r.text().contains("(concurrency)"), "{}", r.text());
        assert_eq!(r.header("retry-after").as_deref(), Some("1"));
    }
    // Another tenant is not limited by it: 4 at once, all served.
    let wide = send_all("wide-key", 4);
    assert!(wide.iter().all(|r| r.status == 200));
    // The answers ended: the slots are free again.
    let again = send_all("narrow-key", 2);
    assert!(again.iter().all(|r| r.status == 200), "{}", again[0].text());
    let metrics = fleet.admin(reqwest::Method::GET, "/metrics", None).text();
    assert!(
        metrics.contains(
            "kvgate_gateway_rate_limited_total{tenant=\"narrow\",limit=\"concurrency\"} 2"
        ),
        "{metrics}"
    );
    assert!(
        metrics.contains("kvgate_gateway_tenant_requests_in_flight{tenant=\"narrow\"} 0"),
        "{metrics}"
    );
    fleet.stop();
}

/// `GET /v1/models` with services told apart by `model`: the gateway answers from their
/// `match.models`; a service behind API keys lists its models only to a valid key, and with no
/// other service an invalid key is 401; `GET /v1/models/{id}` finds one or is 404
/// `model_not_found`. A service that takes any model leaves the listing to its workers.
#[test]
fn the_gateway_lists_the_models_its_services_name() {
    let mut fleet = Fleet::workers(FleetOptions {
        workers: 1,
        ..FleetOptions::default()
    });
    let services = format!(
        r#"
[[tenants]]
id = "acme"
api_keys_sha256 = ["{}"]

[[services]]
name = "private"
pool = "all"
auth = "api_key"
match = {{ models = ["smol-private", "org/smol-private"] }}
rule = {{ type = "round_robin" }}

[[services]]
name = "open"
pool = "all"
match = {{ models = ["smol"] }}
rule = {{ type = "kv_exact", profile = "smol" }}
"#,
        sha256_hex("acme-key")
    );
    fleet.start_gateway(&services, false);
    let get = |path: &str, key: Option<&str>| fleet.get(path, key);
    let ids = |r: &support::Reply| r.model_ids();
    let r = get("/v1/models", None);
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["object"], "list");
    assert_eq!(ids(&r), ["smol"]);
    // Listing without a key is not an invalid key.
    let metrics = fleet.admin(reqwest::Method::GET, "/metrics", None).text();
    assert!(
        metrics.contains("kvgate_gateway_invalid_api_keys_total 0"),
        "{metrics}"
    );
    let r = get("/v1/models", Some("acme-key"));
    assert_eq!(ids(&r), ["org/smol-private", "smol", "smol-private"]);
    let r = get("/v1/models/org/smol-private", Some("acme-key"));
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["id"], "org/smol-private");
    assert_eq!(r.json()["object"], "model");
    let r = get("/v1/models/smol-private", None);
    assert_eq!(r.status, 404, "{}", r.text());
    assert_eq!(r.json()["error"]["code"], "model_not_found");
    assert_eq!(r.json()["error"]["param"], "model");
    // Only the service behind keys left: a bad key is told so.
    let only_private = services
        .split("[[services]]\nname = \"open\"")
        .next()
        .unwrap()
        .to_owned();
    std::fs::write(&fleet.rules_path, fleet.rules_toml(&only_private)).unwrap();
    let r = fleet.admin(reqwest::Method::POST, "/admin/reload", None);
    assert_eq!(r.status, 200, "{}", r.text());
    for key in [Some("wrong-key"), None] {
        let r = get("/v1/models", key);
        assert_eq!(r.status, 401, "{key:?}: {}", r.text());
        assert_eq!(r.json()["error"]["code"], "invalid_api_key");
    }
    // A service that takes any model: its worker answers (the model it serves).
    std::fs::write(&fleet.rules_path, fleet.rules_toml(RR_SERVICE)).unwrap();
    let r = fleet.admin(reqwest::Method::POST, "/admin/reload", None);
    assert_eq!(r.status, 200, "{}", r.text());
    let r = get("/v1/models", None);
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.header("x-kvgate-worker").as_deref(), Some("w1"));
    fleet.stop();
}

/// Two services: `internal` only on the named listener `internal`, `public` on every listener.
const LISTENER_SERVICES: &str = r#"
[[services]]
name = "internal"
pool = "all"
match = { listener = "internal", models = ["smol-internal"] }
rule = { type = "round_robin" }

[[services]]
name = "public"
pool = "all"
match = { models = ["smol"] }
rule = { type = "kv_exact", profile = "smol" }
"#;

/// The rules' `gateway.listeners` are bound beside the VIP, each serving the services without
/// `match.listener` and its own; the VIP serves only the former. `gateway.admin_addr` places
/// the admin plane when the configuration names none. Both are bound once: a rules change that
/// moves them is refused, by the file reload and by the admin API.
#[test]
fn named_listeners_serve_their_services_and_stay_as_bound() {
    let mut fleet = Fleet::workers(FleetOptions {
        workers: 2,
        ..FleetOptions::default()
    });
    let admin_port = free_port();
    let gateway_table = format!(
        "[gateway]\nhealth_interval_ms = 100\nadmin_addr = \"127.0.0.1:{admin_port}\"\n\
         listeners = [{{ name = \"internal\", addr = \"127.0.0.1:0\" }}]\n"
    );
    let rules = fleet.rules_toml(LISTENER_SERVICES).replacen(
        "[gateway]\nhealth_interval_ms = 100\n",
        &gateway_table,
        1,
    );
    fleet.rules_path = fleet.dir.path().join("rules.toml");
    std::fs::write(&fleet.rules_path, &rules).unwrap();
    let mut cfg = gateway::GatewayConfig::new(&fleet.rules_path, fleet.gateway_key.clone());
    cfg.admin_token = Some(fleet.admin_token.clone());
    cfg.admin = None; // the rules' admin_addr
    fleet.gateway = Some(gateway::spawn(cfg).unwrap());
    let gw = fleet.gw();
    assert_eq!(gw.admin_addr.port(), admin_port);
    let internal = gw.listeners["internal"];
    assert_ne!(internal, gw.listen_addr);
    let post = |addr: std::net::SocketAddr, model: &str| {
        let mut body = chat(&[("user", "which listener?")], 2);
        body["model"] = model.into();
        fleet.rt.block_on(async {
            support::Reply::read(
                fleet
                    .http
                    .post(format!("http://{addr}/v1/chat/completions"))
                    .json(&body)
                    .send()
                    .await
                    .unwrap(),
            )
            .await
        })
    };
    let vip = gw.listen_addr;
    // The VIP: the public service only.
    let r = post(vip, "smol");
    assert_eq!(r.status, 200, "{}", r.text());
    assert_ne!(
        r.header("x-kvgate-route-reason").as_deref(),
        Some("round_robin")
    );
    let r = post(vip, "smol-internal");
    assert_eq!(r.status, 404, "{}", r.text());
    assert_eq!(r.json()["error"]["code"], "service_not_found");
    // The named listener: its own service and the public one.
    let r = post(internal, "smol-internal");
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(
        r.header("x-kvgate-route-reason").as_deref(),
        Some("round_robin")
    );
    let r = post(internal, "smol");
    assert_eq!(r.status, 200, "{}", r.text());

    // Moving the listener in the file: the reload is refused and names the field.
    let moved = rules.replace("addr = \"127.0.0.1:0\"", "addr = \"127.0.0.1:1\"");
    std::fs::write(&fleet.rules_path, &moved).unwrap();
    let r = fleet.admin(reqwest::Method::POST, "/admin/reload", None);
    assert_eq!(r.status, 400, "{}", r.text());
    assert_eq!(r.json()["error"]["code"], "rules_rejected", "{}", r.text());
    assert!(r.text().contains("gateway.listeners"), "{}", r.text());
    assert!(r.text().contains("needs a restart"), "{}", r.text());
    // So is a moved admin plane; a change of services alone still applies.
    let moved = rules.replace(
        &format!("admin_addr = \"127.0.0.1:{admin_port}\""),
        "admin_addr = \"127.0.0.1:1\"",
    );
    std::fs::write(&fleet.rules_path, &moved).unwrap();
    let r = fleet.admin(reqwest::Method::POST, "/admin/reload", None);
    assert_eq!(r.status, 400, "{}", r.text());
    assert!(r.text().contains("gateway.admin_addr"), "{}", r.text());
    let version = fleet.gw().data.views.load().version();
    std::fs::write(
        &fleet.rules_path,
        rules.replace("models = [\"smol-internal\"]", "models = [\"smol-inside\"]"),
    )
    .unwrap();
    let r = fleet.admin(reqwest::Method::POST, "/admin/reload", None);
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(fleet.gw().data.views.load().version() > version);
    let r = post(internal, "smol-inside");
    assert_eq!(r.status, 200, "{}", r.text());
    fleet.stop();
}

/// Two named listeners on one address, or one on the VIP's, stop the start with a clear error.
#[test]
fn listeners_that_share_an_address_stop_the_start() {
    let fleet = Fleet::workers(FleetOptions {
        workers: 1,
        ..FleetOptions::default()
    });
    let port = free_port();
    let rules = fleet.rules_toml(support::RR_SERVICE).replacen(
        "[gateway]\n",
        &format!(
            "[gateway]\nlisteners = [{{ name = \"a\", addr = \"127.0.0.1:{port}\" }}, \
             {{ name = \"b\", addr = \"127.0.0.1:{port}\" }}]\n"
        ),
        1,
    );
    let path = fleet.dir.path().join("clash.toml");
    std::fs::write(&path, rules).unwrap();
    let err = gateway::spawn(gateway::GatewayConfig::new(
        &path,
        fleet.gateway_key.clone(),
    ))
    .err()
    .expect("the start must fail");
    let text = err.to_string();
    assert!(
        text.contains("\"b\" has the address") && text.contains("listener \"a\""),
        "{text}"
    );
}

/// A tenant's `services` list: requests to a service outside it get exactly the answer a
/// service that does not exist gets (404 `service_not_found`, nothing routed), are counted per
/// tenant and service, and its model listing names only the models it may call; a tenant
/// without the list calls every keyed service.
#[test]
fn a_tenant_calls_only_the_services_it_is_given() {
    let mut fleet = Fleet::workers(FleetOptions {
        workers: 1,
        ..FleetOptions::default()
    });
    let services = format!(
        r#"
[[tenants]]
id = "acme"
api_keys_sha256 = ["{}"]

[[tenants]]
id = "beta"
api_keys_sha256 = ["{}"]
services = ["code"]

[[services]]
name = "chat"
pool = "all"
auth = "api_key"
match = {{ models = ["smol-chat"] }}
rule = {{ type = "round_robin" }}

[[services]]
name = "code"
pool = "all"
auth = "api_key"
match = {{ models = ["smol-code"] }}
rule = {{ type = "round_robin" }}
"#,
        sha256_hex("acme-key"),
        sha256_hex("beta-key"),
    );
    fleet.start_gateway(&services, true);
    let path = "/v1/chat/completions";
    let ask = |model: &str, key: &str| {
        let mut body = chat(&[("user", "hello")], 2);
        body["model"] = model.into();
        fleet.post(path, &body, &[("authorization", &format!("Bearer {key}"))])
    };
    for model in ["smol-chat", "smol-code"] {
        let r = ask(model, "acme-key");
        assert_eq!(r.status, 200, "acme {model}: {}", r.text());
    }
    assert_eq!(ask("smol-code", "beta-key").status, 200);
    let denied = ask("smol-chat", "beta-key");
    let missing = ask("smol-none", "beta-key");
    assert_eq!(denied.status, 404, "{}", denied.text());
    assert!(denied.header("x-kvgate-worker").is_none());
    // Word for word what a model that does not exist gets, but for the model's name.
    assert_eq!(
        denied.text().replace("smol-chat", "M"),
        missing.text().replace("smol-none", "M")
    );
    assert_eq!(denied.json()["error"]["code"], "service_not_found");
    let metrics = fleet.admin(reqwest::Method::GET, "/metrics", None).text();
    assert!(
        metrics.contains("kvgate_gateway_tenant_denied_total{tenant=\"beta\",service=\"chat\"} 1"),
        "{metrics}"
    );
    // The listing follows the same list.
    let models = |key: &str| -> Vec<String> {
        let r = fleet.get("/v1/models", Some(key));
        assert_eq!(r.status, 200, "{}", r.text());
        r.model_ids()
    };
    assert_eq!(models("acme-key"), ["smol-chat", "smol-code"]);
    assert_eq!(models("beta-key"), ["smol-code"]);
    fleet.stop();
    // The denied request is in the decision log under its tenant, unrouted (the unknown
    // model matched no service, so no key was checked: no tenant).
    let log = std::fs::read_to_string(fleet.dir.path().join("decisions.jsonl")).unwrap();
    let refused: Vec<receipts::DecisionRecord> = log
        .lines()
        .map(|l| receipts::DecisionRecord::from_line(l.as_bytes()).unwrap())
        .filter(|d| d.status == 404)
        .collect();
    let tenants: Vec<Option<&str>> = refused.iter().map(|d| d.tenant.as_deref()).collect();
    assert_eq!(tenants, [Some("beta"), None], "{log}");
    assert!(refused.iter().all(|d| d.ticket.is_none()), "{log}");
}
