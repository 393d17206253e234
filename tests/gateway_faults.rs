//! Faults a hostile or careless client causes at the gateway, end to end over simulated
//! workers: bodies that cannot be parsed (400 whatever the rules match on), methods the API does
//! not have (405 before routing, and the audit knows no receipt is owed), and clients that retry
//! with their own request id (never refused as a replay: the gateway mints ticket ids).

#[path = "gateway_support/mod.rs"]
mod support;

use support::{chat, Fleet, FleetOptions};

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
    let report = receipts::audit(
        &fleet.dir.path().join("decisions.jsonl"),
        &[
            fleet.dir.path().join("receipts-w1.jsonl"),
            fleet.dir.path().join("receipts-w2.jsonl"),
        ],
        &fleet.key_ring(),
    )
    .unwrap();
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
    fleet.start_gateway(support::RR_SERVICE, false);
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
