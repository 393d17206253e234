//! Re-checks the worked example in docs/receipts.md: every ```` ```text example:NAME ```` block
//! must equal the value computed here from the fixed RFC 8032 test keys, so the document cannot
//! drift from the code. Run with `--nocapture` to print the computed blocks.
mod common;

use std::collections::BTreeMap;

use common::*;
use receipts::*;
use sha2::Digest;

fn example_ticket() -> RouteTicket {
    RouteTicket {
        request_id: "req-0001".into(),
        gateway_id: "gw-1".into(),
        key_id: KeyId(String::new()),
        service: "chat".into(),
        rule_id: "chat-kv".into(),
        rule_version: 3,
        mode: RouteMode::KvExact,
        worker: "worker-a".into(),
        predicted_matched_tokens: Some(32),
        prompt_tokens: Some(41),
        last_block_key: Some(prefix_index::BlockKey(0x9f3c2a71d04b8e65)),
        namespace_seed: prefix_index::NamespaceSeed::from_hex(
            "6b76676174652d6578616d706c652d6e616d6573706163652d73656564000001",
        )
        .unwrap(),
        hash_algorithm: prefix_index::HashAlgorithm::Xxh3,
        issued_at_ms: 1_700_000_000_000,
        expires_at_ms: 1_700_000_060_000,
    }
}

fn example_draft(ticket: SignedTicket) -> ReceiptDraft {
    ReceiptDraft {
        request_id: "req-0001".into(),
        ticket: Some(ticket),
        model: "SmolLM2-135M-Instruct".into(),
        profile_digest: sha256_hex(b"example profile"),
        request_sha256: sha256_hex(b"{\"model\":\"smollm2\",\"messages\":[]}"),
        response_sha256: sha256_hex(b"Hello!"),
        prompt_tokens: 41,
        cached_tokens: 32,
        completion_tokens: 3,
        finish_reason: Some("stop".into()),
        status: 200,
        error_code: None,
        received_at_ms: 1_700_000_000_012,
        first_token_at_ms: Some(1_700_000_000_020),
        completed_at_ms: 1_700_000_000_031,
        last_block_key: Some(prefix_index::BlockKey(0x9f3c2a71d04b8e65)),
    }
}

fn computed() -> BTreeMap<&'static str, String> {
    let gw = gateway_key();
    let wk = worker_key();
    let st = example_ticket().sign(&gw);
    let receipt = Receipt::sign(
        example_draft(st.clone()),
        0,
        GENESIS_HASH.to_string(),
        "worker-a".into(),
        &wk,
    )
    .unwrap();
    let line = receipt.to_line().unwrap();
    let signed = receipt.signed_bytes().unwrap();
    let mut m = BTreeMap::new();
    m.insert("gateway-secret-seed-hex", GATEWAY_SEED_HEX.to_string());
    m.insert(
        "gateway-public-key-hex",
        hex::encode(gw.public().to_bytes()),
    );
    m.insert("gateway-key-id", gw.key_id().to_string());
    m.insert("gateway-public-pem", gw.public().to_pem().unwrap());
    m.insert("worker-secret-seed-hex", WORKER_SEED_HEX.to_string());
    m.insert("worker-public-key-hex", hex::encode(wk.public().to_bytes()));
    m.insert("worker-key-id", wk.key_id().to_string());
    m.insert(
        "ticket-payload",
        String::from_utf8(st.payload().to_vec()).unwrap(),
    );
    m.insert("ticket-signature-hex", hex::encode(st.signature()));
    m.insert("ticket-header", st.to_header_value());
    m.insert(
        "receipt-signed-json",
        String::from_utf8(signed[RECEIPT_DOMAIN.len()..].to_vec()).unwrap(),
    );
    m.insert("receipt-signature-hex", receipt.signature.clone());
    m.insert("receipt-line", String::from_utf8(line.clone()).unwrap());
    m.insert("receipt-line-sha256", Receipt::line_hash(&line));
    let choice = |t: &str| -> [u8; 32] { sha2::Sha256::digest(t).into() };
    m.insert(
        "response-sha256-two-choices",
        response_sha256(&[choice("Paris."), choice("It is Paris.")]),
    );
    assert_eq!(
        response_sha256(&[choice("Paris.")]),
        sha256_hex(b"Paris."),
        "one choice: its own hash"
    );
    // The receipt line verifies as a one-line log.
    let mut bytes = line;
    bytes.push(b'\n');
    let rep = verify_bytes(
        "example",
        &bytes,
        &ring(&[&gw, &wk]),
        VerifyOptions {
            require_ticket_keys: true,
            ..VerifyOptions::default()
        },
    );
    assert!(rep.ok(), "{rep}");
    m
}

fn doc_blocks(doc: &str) -> BTreeMap<String, String> {
    let mut blocks = BTreeMap::new();
    let mut current: Option<(String, Vec<&str>)> = None;
    for line in doc.lines() {
        match &mut current {
            None => {
                if let Some(name) = line.strip_prefix("```text example:") {
                    current = Some((name.trim().to_string(), Vec::new()));
                }
            }
            Some((name, body)) => {
                if line.trim_end() == "```" {
                    blocks.insert(name.clone(), body.join("\n"));
                    current = None;
                } else {
                    body.push(line);
                }
            }
        }
    }
    blocks
}

#[test]
fn docs_worked_example_matches_code() {
    let want = computed();
    for (name, value) in &want {
        println!("```text example:{name}\n{}\n```\n", value.trim_end());
    }
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/receipts.md");
    let doc = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("cannot read {path}: {e}"));
    let blocks = doc_blocks(&doc);
    for (name, value) in &want {
        let got = blocks
            .get(*name)
            .unwrap_or_else(|| panic!("docs/receipts.md has no `example:{name}` block"));
        assert_eq!(
            got.trim_end(),
            value.trim_end(),
            "example:{name} differs from the code"
        );
    }
    for name in blocks.keys() {
        assert!(
            want.contains_key(name.as_str()),
            "docs/receipts.md block example:{name} is not checked by this test"
        );
    }
}
