//! Faults a hostile or careless client causes at the gateway, end to end over simulated
//! workers: bodies that cannot be parsed (400 whatever the rules match on), methods the API does
//! not have (405 before routing, and the audit knows no receipt is owed), clients that retry
//! with their own request id (never refused as a replay: the gateway mints ticket ids), and
//! workers that refuse a request (429 / 503: offered to the next worker, `refused_retries`).

#[path = "gateway_support/mod.rs"]
mod support;

use support::{chat, Fleet, FleetOptions};

/// Round robin over pool `all`, handing a worker's refusal straight to the client.
const RR_NO_REFUSAL_RETRY: &str = r#"
[[services]]
name = "chat"
pool = "all"
rule = { type = "round_robin" }
upstream = { refused_retries = 0 }
"#;

/// Two services told apart by `model`, as in examples/rules.toml.
const BY_MODEL: &str = r#"
[[services]]
name = "rr"
pool = "all"
match = { path_prefix = "/v1/", models = ["smol-rr"] }
rule = { type = "round_robin" }

[[services]]
name = "exact"
pool = "all"
match = { path_prefix = "/v1/", models = ["smol"] }
rule = { type = "kv_exact", profile = "smol" }
"#;

#[test]
fn unreadable_bodies_are_400_whatever_the_rules_match_on() {
    let mut fleet = Fleet::workers(FleetOptions {
        workers: 2,
        ..FleetOptions::default()
    });
    fleet.start_gateway(BY_MODEL, false);
    for (path, body) in [
        ("/v1/chat/completions", &b"{not json"[..]),
        ("/v1/chat/completions", b""),
        ("/v1/completions", b"[1,2,3]"),
        (
            "/v1/chat/completions",
            br#"{"model":"smol","messages":[]}trailing"#,
        ),
    ] {
        let r = fleet.post_raw(path, body.to_vec(), &[]);
        assert_eq!(r.status, 400, "{path} {:?}: {}", body, r.text());
        // The worker's code for the same fault (prompt_profile::BodyError).
        assert_eq!(r.json()["error"]["code"], "invalid_json", "{}", r.text());
    }
    // A well-formed body for no service is still a 404.
    let mut body = chat(&[("user", "hi")], 2);
    body["model"] = "nope".into();
    let r = fleet.post("/v1/chat/completions", &body, &[]);
    assert_eq!(r.status, 404, "{}", r.text());
    fleet.stop();
}

#[test]
fn methods_the_api_lacks_are_405_and_owe_no_receipt() {
    let mut fleet = Fleet::workers(FleetOptions {
        workers: 2,
        ..FleetOptions::default()
    });
    fleet.start_gateway(support::RR_SERVICE, true);
    let put = fleet.rt.block_on(async {
        support::Reply::read(
            fleet
                .http
                .put(fleet.url("/v1/chat/completions"))
                .json(&chat(&[("user", "hi")], 2))
                .send()
                .await
                .unwrap(),
        )
        .await
    });
    assert_eq!(put.status, 405, "{}", put.text());
    assert_eq!(put.json()["error"]["code"], "method_not_allowed");
    let ok = fleet.post("/v1/chat/completions", &chat(&[("user", "hi")], 2), &[]);
    assert_eq!(ok.status, 200);
    fleet.stop();
    // The audit of the decision log against the receipts is clean.
    let report = fleet.audit();
    assert!(report.ok(), "{report}");
    assert_eq!(report.receipted, 1, "{report}");
}

#[test]
fn a_client_retrying_with_its_own_request_id_is_served_every_time() {
    let mut fleet = Fleet::workers(FleetOptions {
        workers: 1,
        ..FleetOptions::default()
    });
    fleet.start_gateway(support::RR_SERVICE, false);
    let mut ids = std::collections::BTreeSet::new();
    for _ in 0..3 {
        let r = fleet.post(
            "/v1/chat/completions",
            &chat(&[("user", "retry me")], 2),
            &[("x-request-id", "client-retry-1")],
        );
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(
            r.header("x-client-request-id").as_deref(),
            Some("client-retry-1")
        );
        let id = r.header("x-request-id").unwrap();
        assert!(id.starts_with("gw-"), "{id}");
        let receipt = fleet
            .receipt(0, &id)
            .expect("a receipt under the gateway's id");
        assert_eq!(receipt.body.status, 200);
        ids.insert(id);
    }
    assert_eq!(ids.len(), 3, "each attempt gets its own id: {ids:?}");
    fleet.stop();
}

#[test]
fn a_dead_engine_fails_fast_and_the_gateway_stops_routing_to_it() {
    // w1's engine panics at its first step after the start-up smoke inference (step 1-2).
    let mut fleet = Fleet::workers(FleetOptions {
        workers: 2,
        faulty: Some((0, 3)),
        ..FleetOptions::default()
    });
    // Refusals are not retried here, so the worker's 503 reaches the client (with the
    // default, `a_refused_request_goes_to_the_next_worker…` below, it would be served by w2).
    fleet.start_gateway(RR_NO_REFUSAL_RETRY, false);
    let w1 = format!("http://{}", fleet.addrs[0]);
    // Drive requests until w1's engine has died (round robin reaches it within two).
    let mut failed = None;
    for i in 0..6 {
        let r = fleet.post(
            "/v1/chat/completions",
            &chat(&[("user", &format!("fault {i}"))], 2),
            &[],
        );
        if r.status != 200 {
            failed = Some(r);
            break;
        }
    }
    let r = failed.expect("the faulty worker failed a request");
    assert_eq!(r.status, 503, "{}", r.text());
    assert_eq!(r.json()["error"]["code"], "engine_failed", "{}", r.text());
    assert_eq!(r.worker(), "w1");
    // Its readiness says so, and a direct request fails fast with the same code.
    let (ready, direct) = fleet.rt.block_on(async {
        let ready = fleet.http.get(format!("{w1}/ready")).send().await.unwrap();
        let ready = (ready.status().as_u16(), ready.text().await.unwrap());
        let direct = fleet
            .http
            .post(format!("{w1}/v1/chat/completions"))
            .json(&chat(&[("user", "direct")], 2))
            .send()
            .await
            .unwrap();
        (ready, direct.status().as_u16())
    });
    assert_eq!(ready.0, 503, "{}", ready.1);
    assert!(ready.1.contains("injected fault"), "{}", ready.1);
    assert!(direct == 401 || direct == 503, "direct request: {direct}");
    // The gateway's health check takes it out: every request now lands on w2.
    let w1_id = prefix_index::WorkerId("w1".into());
    fleet.wait_for(
        "w1 marked unhealthy",
        std::time::Duration::from_secs(10),
        || !fleet.gw().data.views.load().workers[&w1_id].healthy,
    );
    for i in 0..4 {
        let r = fleet.post(
            "/v1/chat/completions",
            &chat(&[("user", &format!("after {i}"))], 2),
            &[],
        );
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(r.worker(), "w2");
    }
    fleet.stop();
}

/// A fleet where w1 runs one sequence at a time and queues one more (so it answers 429
/// `queue_full` to a third), w2 has the default limits; sim timing slow enough (~6 ms per
/// step) that eight concurrent requests overlap.
fn cramped_fleet() -> Fleet {
    cramped_fleet_of(2, engine::EngineConfig::default().default_admission_timeout)
}

/// [`cramped_fleet`] with `workers` workers, w1 refusing a request it queued for `admission`
/// (429 `admission_timeout`).
fn cramped_fleet_of(workers: usize, admission: std::time::Duration) -> Fleet {
    Fleet::workers(FleetOptions {
        workers,
        sim: engine::sim::SimConfig {
            block_size: 16,
            num_blocks: 4096,
            ..engine::sim::SimConfig::default()
        },
        engine: Some((
            0,
            engine::EngineConfig {
                max_running: 1,
                max_waiting: 1,
                default_admission_timeout: admission,
                ..engine::EngineConfig::default()
            },
        )),
        ..FleetOptions::default()
    })
}

/// Eight concurrent chat requests through the VIP; `big`: with bodies over 64 KiB, which take
/// the gateway's own forwarding path. Their replies.
fn eight_at_once(fleet: &Fleet, big: bool) -> Vec<support::Reply> {
    fleet.rt.block_on(async {
        let sends = (0..8).map(|i| {
            let pad = if big {
                " ".repeat(70 * 1024)
            } else {
                String::new()
            };
            // Every other request streams: a refusal comes before any event.
            let stream = i % 2 == 1;
            let body = format!(
                r#"{{"model":"smol",{pad}"messages":[{{"role":"user","content":"busy {i}"}}],"max_tokens":48,"stream":{stream}}}"#
            );
            let req = fleet
                .http
                .post(fleet.url("/v1/chat/completions"))
                .header("content-type", "application/json")
                .body(body);
            async move { support::Reply::read(req.send().await.unwrap()).await }
        });
        futures::future::join_all(sends).await
    })
}

/// A worker that refuses a request before answering it (429 `queue_full` here) does not fail
/// the client: the gateway offers the request to the next candidate (`upstream.refused_retries`,
/// default 2), on pingora's proxy path and on the >64 KiB forwarding path alike (one round of
/// eight concurrent requests each). Every refused
/// attempt leaves a `retried` decision line checked against the refusing worker's receipt.
#[test]
fn a_refused_request_goes_to_the_next_worker_and_the_audit_sees_each_attempt() {
    let mut fleet = cramped_fleet();
    fleet.start_gateway(support::RR_SERVICE, true);
    // Pingora's proxy path, then the >64 KiB forwarding path.
    let rounds = [eight_at_once(&fleet, false), eight_at_once(&fleet, true)];
    for replies in &rounds {
        let statuses: Vec<u16> = replies.iter().map(|r| r.status).collect();
        assert!(statuses.iter().all(|s| *s == 200), "{statuses:?}");
        for r in replies.iter().skip(1).step_by(2) {
            assert!(
                r.text().trim_end().ends_with("data: [DONE]"),
                "{}",
                r.text()
            );
        }
    }
    let metrics = fleet.admin(reqwest::Method::GET, "/metrics", None).text();
    let refused: u64 = metrics
        .lines()
        .find(|l| {
            l.starts_with("kvgate_gateway_fallbacks_total{") && l.contains("reason=\"refused\"")
        })
        .and_then(|l| l.rsplit(' ').next())
        .map_or(0, |v| v.parse().unwrap());
    // Round robin sends four of each eight to w1, which can hold two: at least two refused.
    assert!(
        refused >= 4,
        "refused retries counted: {refused}\n{metrics}"
    );
    // Per worker: every refusal was w1's.
    let w1_refusals = metrics
        .lines()
        .find(|l| l.starts_with("kvgate_gateway_worker_refusals_total{worker=\"w1\"}"))
        .and_then(|l| l.rsplit(' ').next())
        .map_or(0, |v| v.parse::<u64>().unwrap());
    assert_eq!(w1_refusals, refused, "{metrics}");
    let workers = fleet
        .admin(reqwest::Method::GET, "/admin/workers", None)
        .json();
    let by_id = |id: &str| {
        workers["workers"]
            .as_array()
            .unwrap()
            .iter()
            .find(|w| w["id"] == id)
            .unwrap()["refusals"]
            .as_u64()
            .unwrap()
    };
    assert_eq!((by_id("w1"), by_id("w2")), (refused, 0), "{workers}");
    fleet.stop();
    let decisions = fleet.dir.path().join("decisions.jsonl");
    let text = std::fs::read_to_string(&decisions).unwrap();
    let retried: Vec<receipts::DecisionRecord> = text
        .lines()
        .map(|l| receipts::DecisionRecord::from_line(l.as_bytes()).unwrap())
        .filter(|d| d.phase == Some(receipts::DecisionPhase::Retried))
        .collect();
    assert_eq!(retried.len() as u64, refused, "{text}");
    for d in &retried {
        assert_eq!(d.status, 429, "{d:?}");
        assert_eq!(d.worker.as_ref().map(|w| w.0.as_str()), Some("w1"), "{d:?}");
    }
    // Both paths retried: each round has requests with a `retried` line, served by w2.
    for (round, replies) in rounds.iter().enumerate() {
        let ids: Vec<String> = replies
            .iter()
            .map(|r| r.header("x-request-id").unwrap())
            .collect();
        let here: Vec<_> = retried
            .iter()
            .filter(|d| ids.contains(&d.request_id))
            .collect();
        assert!(!here.is_empty(), "round {round}: nothing retried");
        for d in here {
            let r = &replies[ids.iter().position(|i| *i == d.request_id).unwrap()];
            assert_eq!(r.worker(), "w2", "round {round}");
        }
    }
    let report = receipts::audit(
        &decisions,
        &[
            fleet.dir.path().join("receipts-w1.jsonl"),
            fleet.dir.path().join("receipts-w2.jsonl"),
        ],
        &fleet.key_ring(),
    )
    .unwrap();
    assert!(report.ok(), "{report}");
    assert_eq!(report.retried_attempts, refused, "{report}");
    assert_eq!(report.unfinished, 0, "{report}");
    // Each refused attempt has the refusing worker's 429 receipt; each request one 200.
    assert_eq!(report.receipted, 16 + refused, "{report}");
}

/// The control: with `refused_retries = 0` the same load hands w1's 429s to the clients.
#[test]
fn without_refusal_retries_the_same_load_reaches_the_client_as_429() {
    let mut fleet = cramped_fleet();
    fleet.start_gateway(RR_NO_REFUSAL_RETRY, false);
    let replies = eight_at_once(&fleet, false);
    let refused: Vec<&support::Reply> = replies.iter().filter(|r| r.status != 200).collect();
    assert!(!refused.is_empty(), "no request was refused");
    for r in &refused {
        assert_eq!(r.status, 429, "{}", r.text());
        assert_eq!(r.json()["error"]["code"], "queue_full", "{}", r.text());
        assert_eq!(r.worker(), "w1");
        assert!(r.header("retry-after").is_some());
    }
    // Refusals handed to the client count against the worker too.
    let workers = fleet
        .admin(reqwest::Method::GET, "/admin/workers", None)
        .json();
    let w1 = workers["workers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|w| w["id"] == "w1")
        .unwrap();
    assert_eq!(w1["refusals"].as_u64(), Some(refused.len() as u64), "{w1}");
    fleet.stop();
}

/// A retry skips a candidate that turned unhealthy after the decision. Round robin over w1, w2,
/// w3: w1 runs one sequence and queues one, and refuses a queued request after 4 s
/// (`admission_timeout`). A long request occupies w1; two short ones move the rotation on; the
/// fourth is decided [w1, w2, w3] and waits in w1's queue. While it waits, w2 stops and the
/// health probe marks it down. The refusal's retry then goes to w3 without trying w2: no
/// connect failure is counted, the skip is (`fallbacks_total{reason="unhealthy"}`). `big`: the
/// request that is refused has a body over 64 KiB (the gateway's own forwarding path).
fn a_retry_skips_a_candidate_that_turned_unhealthy(big: bool) {
    // Deadlines with room for a loaded machine: w2's stop and its probe must both fall
    // inside w1's 4 s admission deadline, itself inside the long request's ~9 s.
    let mut fleet = cramped_fleet_of(3, std::time::Duration::from_secs(4));
    fleet.start_gateway(support::RR_SERVICE, true);
    // Greedy: sampled at the default temperature, the simulated model's flat logits give
    // every token of the vocabulary a chance, stop tokens included, and the long answer ended
    // early (386 of 1500 tokens) in about one run in ten, before the fourth request's deadline.
    let body = |text: &str, max_tokens: u64, pad: usize| {
        format!(
            r#"{{"model":"smol",{}"messages":[{{"role":"user","content":"{text}"}}],"max_tokens":{max_tokens},"temperature":0}}"#,
            " ".repeat(pad)
        )
    };
    let send = |b: String| {
        let req = fleet
            .http
            .post(fleet.url("/v1/chat/completions"))
            .header("content-type", "application/json")
            .body(b);
        async move { support::Reply::read(req.send().await.unwrap()).await }
    };
    // Inside the runtime: the admin API through the async client.
    let in_flight = |id: &'static str| {
        let req = fleet
            .http
            .get(fleet.admin_url("/admin/workers"))
            .bearer_auth(&fleet.admin_token);
        async move {
            let w: serde_json::Value = req.send().await.unwrap().json().await.unwrap();
            w["workers"]
                .as_array()
                .unwrap()
                .iter()
                .find(|w| w["id"] == id)
                .unwrap()["in_flight"]
                .as_u64()
                .unwrap()
        }
    };
    let w2 = prefix_index::WorkerId("w2".into());
    let (long, short, refused) = fleet.rt.block_on(async {
        // The long one: w1's running slot for ~9 s (6 ms steps).
        let long = tokio::spawn(send(body("long", 1500, 0)));
        let until = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while in_flight("w1").await < 1 {
            assert!(
                std::time::Instant::now() < until,
                "the long request never reached w1"
            );
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        let short = [send(body("b", 2, 0)).await, send(body("c", 2, 0)).await];
        // Decided [w1, w2, w3]: waits in w1's queue.
        let pad = if big { 70 * 1024 } else { 0 };
        let refused = tokio::spawn(send(body("d", 2, pad)));
        while in_flight("w1").await < 2 {
            assert!(
                std::time::Instant::now() < until,
                "the fourth request never reached w1"
            );
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        (long, short, refused)
    });
    // w2 goes away while the fourth request waits; the probe (every 100 ms) marks it.
    fleet.stop_worker(1);
    fleet.wait_for(
        "w2 marked unhealthy",
        std::time::Duration::from_secs(3),
        || !fleet.gw().data.views.load().workers[&w2].healthy,
    );
    let (long, refused) = fleet
        .rt
        .block_on(async { (long.await.unwrap(), refused.await.unwrap()) });
    assert_eq!(long.status, 200, "{}", long.text());
    assert_eq!(long.worker(), "w1");
    let workers: Vec<String> = short.iter().map(|r| r.worker()).collect();
    assert_eq!(workers, ["w2", "w3"], "the rotation");
    assert_eq!(refused.status, 200, "{}", refused.text());
    assert_eq!(refused.worker(), "w3", "the retry skipped w2");
    let metrics = fleet.admin(reqwest::Method::GET, "/metrics", None).text();
    let fallbacks = |reason: &str| -> u64 {
        metrics
            .lines()
            .find(|l| {
                l.starts_with("kvgate_gateway_fallbacks_total{")
                    && l.contains(&format!("reason=\"{reason}\""))
            })
            .and_then(|l| l.rsplit(' ').next())
            .map_or(0, |v| v.parse().unwrap())
    };
    assert_eq!(fallbacks("refused"), 1, "{metrics}");
    assert_eq!(fallbacks("unhealthy"), 1, "{metrics}");
    assert_eq!(fallbacks("connect"), 0, "{metrics}");
    let id = refused.header("x-request-id").unwrap();
    fleet.stop();
    // The decision log: w1's 429 retried, then w3's answer; the audit is clean.
    let decisions = fleet.dir.path().join("decisions.jsonl");
    let lines: Vec<receipts::DecisionRecord> = std::fs::read_to_string(&decisions)
        .unwrap()
        .lines()
        .map(|l| receipts::DecisionRecord::from_line(l.as_bytes()).unwrap())
        .filter(|d| d.request_id == id && d.phase != Some(receipts::DecisionPhase::Routed))
        .collect();
    let attempts: Vec<(Option<&str>, u16)> = lines
        .iter()
        .map(|d| (d.worker.as_ref().map(|w| w.0.as_str()), d.status))
        .collect();
    assert_eq!(
        attempts,
        [(Some("w1"), 429), (Some("w3"), 200)],
        "{lines:?}"
    );
    let report = fleet.audit();
    assert!(report.ok(), "{report}");
    assert_eq!(report.retried_attempts, 1, "{report}");
}

#[test]
fn a_refusals_retry_skips_a_candidate_that_turned_unhealthy() {
    a_retry_skips_a_candidate_that_turned_unhealthy(false);
}

#[test]
fn a_refusals_retry_skips_a_candidate_that_turned_unhealthy_on_the_forwarding_path() {
    a_retry_skips_a_candidate_that_turned_unhealthy(true);
}
