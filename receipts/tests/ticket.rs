//! Route tickets: sign / header round trip / verify, forged and expired tickets, replay.
mod common;

use common::*;
use proptest::prelude::*;
use receipts::*;

#[test]
fn header_round_trip_and_verify() {
    let gw = gateway_key();
    let st = ticket("r1", "w0", RouteMode::KvExact, T0).sign(&gw);
    let header = st.to_header_value();
    assert!(header.len() < 1024, "header is {} bytes", header.len());
    assert!(!header.contains(['=', '+', '/', ' ']));
    let parsed = SignedTicket::parse_header(&header).unwrap();
    assert_eq!(parsed, st);
    let keys = ring(&[&gw]);
    let t = parsed.verify(&keys, T0 + 10, 0).unwrap();
    assert_eq!(t.key_id, *gw.key_id(), "sign sets key_id");
    assert_eq!(t.rule_version, 7);
    assert_eq!(t.mode, RouteMode::KvExact);
    // The payload is canonical JSON with the snake_case mode.
    let payload = String::from_utf8(parsed.payload().to_vec()).unwrap();
    assert!(payload.starts_with("{\"expires_at_ms\":"), "{payload}");
    assert!(payload.contains("\"mode\":\"kv_exact\""));
    assert_eq!(TICKET_HEADER, "x-kvgate-ticket");
}

#[test]
fn wrong_key_is_unknown_and_forged_signature_is_bad() {
    let gw = gateway_key();
    let other = KeyPair::generate();
    let st = ticket("r1", "w0", RouteMode::RoundRobin, T0).sign(&gw);
    let err = st.verify(&ring(&[&other]), T0, 0).unwrap_err();
    assert_eq!(err.error_type(), "unknown_key");

    // Forgery: a ticket signed by another key but claiming the gateway's key id.
    let forged = ticket("r1", "w0", RouteMode::RoundRobin, T0).sign(&other);
    let (p, s) = forged.header().split_once('.').unwrap();
    let mut json: serde_json::Value = serde_json::from_slice(&base64_decode(p)).unwrap();
    json["key_id"] = serde_json::Value::String(gw.key_id().to_string());
    let payload = receipts::canonical::value_to_vec(&json).unwrap();
    let forged_header = format!("{}.{}", base64_encode(&payload), s);
    let parsed = SignedTicket::parse_header(&forged_header).unwrap();
    let err = parsed.verify(&ring(&[&gw]), T0, 0).unwrap_err();
    assert_eq!(err.error_type(), "bad_signature");

    // Changing the chosen worker after signing breaks the signature.
    let mut json: serde_json::Value =
        serde_json::from_slice(&base64_decode(st.header().split_once('.').unwrap().0)).unwrap();
    json["worker"] = serde_json::Value::String("w9".into());
    let payload = receipts::canonical::value_to_vec(&json).unwrap();
    let tampered = format!(
        "{}.{}",
        base64_encode(&payload),
        st.header().split_once('.').unwrap().1
    );
    let err = SignedTicket::parse_header(&tampered)
        .unwrap()
        .verify(&ring(&[&gw]), T0, 0)
        .unwrap_err();
    assert_eq!(err.error_type(), "bad_signature");
}

fn base64_decode(s: &str) -> Vec<u8> {
    use base64::Engine;
    base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(s)
        .unwrap()
}

fn base64_encode(b: &[u8]) -> String {
    use base64::Engine;
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(b)
}

#[test]
fn validity_window_with_skew() {
    let gw = gateway_key();
    let keys = ring(&[&gw]);
    let st = ticket("r1", "w0", RouteMode::RoundRobin, T0).sign(&gw);
    let exp = T0 + DEFAULT_TICKET_TTL_MS;
    assert!(st.verify(&keys, exp, 0).is_ok());
    assert_eq!(
        st.verify(&keys, exp + 1, 0).unwrap_err().error_type(),
        "ticket_expired"
    );
    assert!(st.verify(&keys, exp + 1_000, 1_000).is_ok());
    assert_eq!(
        st.verify(&keys, exp + 1_001, 1_000)
            .unwrap_err()
            .error_type(),
        "ticket_expired"
    );
    assert_eq!(
        st.verify(&keys, T0 - 1, 0).unwrap_err().error_type(),
        "ticket_not_yet_valid"
    );
    assert!(st.verify(&keys, T0 - 500, 500).is_ok());
}

#[test]
fn replay_guard_rejects_second_use_until_expiry() {
    let gw = gateway_key();
    let t = ticket("r1", "w0", RouteMode::RoundRobin, T0).sign(&gw);
    let t = t.ticket_unverified();
    let mut g = ReplayGuard::new(0);
    g.check_and_insert(t, T0).unwrap();
    assert_eq!(
        g.check_and_insert(t, T0 + 1).unwrap_err().error_type(),
        "ticket_replayed"
    );
    // After the window the entry is pruned (the ticket itself is then expired anyway).
    let later = ticket("r2", "w0", RouteMode::RoundRobin, T0 + 100_000).sign(&gw);
    g.check_and_insert(later.ticket_unverified(), T0 + 100_000)
        .unwrap();
    assert_eq!(g.len(), 1);
}

#[test]
fn rejects_malformed_headers() {
    let gw = gateway_key();
    let st = ticket("r1", "w0", RouteMode::KvExact, T0).sign(&gw);
    let (p, s) = st.header().split_once('.').unwrap();
    for bad in [
        "".to_string(),
        "abc".to_string(),
        format!("{p}."),
        format!("{p}.{}", &s[..10]),
        format!("{p}={s}"),
        format!("{p}.{s}.x"),
    ] {
        assert!(SignedTicket::parse_header(&bad).is_err(), "{bad}");
    }
    // Non-canonical payload (whitespace) is refused even though the JSON is fine.
    let json: serde_json::Value = serde_json::from_slice(&base64_decode(p)).unwrap();
    let pretty = serde_json::to_vec_pretty(&json).unwrap();
    let err = SignedTicket::parse_header(&format!("{}.{s}", base64_encode(&pretty))).unwrap_err();
    assert_eq!(err.error_type(), "non_canonical");
    // Unknown fields are refused.
    let mut extra = json.clone();
    extra["extra"] = serde_json::json!(1);
    let payload = receipts::canonical::value_to_vec(&extra).unwrap();
    let err = SignedTicket::parse_header(&format!("{}.{s}", base64_encode(&payload))).unwrap_err();
    assert_eq!(err.error_type(), "malformed");
}

fn arb_ticket() -> impl Strategy<Value = RouteTicket> {
    (
        "[a-zA-Z0-9_-]{1,40}",
        "\\PC{0,20}",
        any::<u64>(),
        any::<bool>(),
        prop::option::of(any::<u32>()),
        prop::option::of(any::<u64>().prop_map(prefix_index::BlockKey)),
        0u64..(1 << 50),
        0u64..(1 << 20),
    )
        .prop_map(|(rid, svc, ver, kv, pred, lbk, iat, ttl)| {
            let mut t = ticket(
                &rid,
                "w-1",
                if kv {
                    RouteMode::KvExact
                } else {
                    RouteMode::RoundRobin
                },
                iat,
            );
            t.service = svc;
            t.rule_version = ver;
            t.predicted_matched_tokens = pred;
            t.last_block_key = lbk;
            t.expires_at_ms = iat + ttl;
            t
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Any ticket round-trips through its header and verifies; flipping any bit of the header
    /// makes it fail to parse or fail to verify.
    #[test]
    fn any_ticket_round_trips_and_any_flip_fails(t in arb_ticket(), pos in any::<prop::sample::Index>(), bit in 0u8..8) {
        let gw = gateway_key();
        let keys = ring(&[&gw]);
        let st = t.sign(&gw);
        let parsed = SignedTicket::parse_header(st.header()).unwrap();
        prop_assert_eq!(&parsed, &st);
        prop_assert!(parsed.verify_signature(&keys).is_ok());
        let mut bytes = st.header().as_bytes().to_vec();
        let i = pos.index(bytes.len());
        bytes[i] ^= 1 << bit;
        if let Ok(s) = String::from_utf8(bytes) {
            if let Ok(p) = SignedTicket::parse_header(&s) {
                prop_assert!(p.verify_signature(&keys).is_err(), "flip at {} verified", i);
            }
        }
    }
}

/// The ticket and decision-line structs declare their fields in canonical key order, so the
/// canonical encoder writes them without buffering: their declaration-order JSON (serde_json)
/// is already the canonical bytes. (Speed only — any order gives the same canonical bytes.)
#[test]
fn ticket_and_decision_fields_are_declared_in_canonical_order() {
    let t = ticket("req-1", "w1", RouteMode::KvExact, 1_700_000_000_000);
    assert_eq!(
        serde_json::to_vec(&t).unwrap(),
        receipts::canonical::to_vec(&t).unwrap()
    );
    let signed = t.sign(&gateway_key());
    let line = receipts::DecisionRecord {
        at_ms: 1,
        client_request_id: Some("c".into()),
        error: None,
        phase: None,
        receipt_named: Some(true),
        request_id: "req-1".into(),
        rule_id: Some("r".into()),
        rule_version: Some(3),
        service: Some("s".into()),
        status: 200,
        tenant: None,
        ticket: Some(signed),
        worker: Some(t.worker.clone()),
    };
    assert_eq!(
        serde_json::to_vec(&line).unwrap(),
        receipts::canonical::to_vec(&line).unwrap()
    );
}
