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
        assert_eq!(
            r.json()["error"]["code"],
            "invalid_request_body",
            "{}",
            r.text()
        );
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
