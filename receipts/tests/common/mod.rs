//! Shared fixtures for the receipts integration tests: fixed keys (RFC 8032 test secrets),
//! tickets, drafts and small logs.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

use receipts::*;

/// RFC 8032 §7.1 TEST 1 secret key: the example gateway key.
pub const GATEWAY_SEED_HEX: &str =
    "9d61b19deffd5a60ba844af492ec2cc44449c5697b326919703bac031cae7f60";
/// RFC 8032 §7.1 TEST 2 secret key: the example worker key.
pub const WORKER_SEED_HEX: &str =
    "4ccd089b28ff96da9db6c346ec114e0f5b8a319f35aba624da8cf6ed4fb8a6fb";

pub const T0: u64 = 1_700_000_000_000;

pub fn seed(hex_str: &str) -> [u8; 32] {
    hex::decode(hex_str).unwrap().try_into().unwrap()
}

pub fn gateway_key() -> KeyPair {
    KeyPair::from_seed(&seed(GATEWAY_SEED_HEX))
}

pub fn worker_key() -> KeyPair {
    KeyPair::from_seed(&seed(WORKER_SEED_HEX))
}

pub fn ring(keys: &[&KeyPair]) -> KeyRing {
    let mut r = KeyRing::new();
    for (i, k) in keys.iter().enumerate() {
        r.insert(format!("k{i}"), k.public().clone());
    }
    r
}

pub fn ticket(request_id: &str, worker: &str, mode: RouteMode, issued_at_ms: u64) -> RouteTicket {
    let kv = mode == RouteMode::KvExact;
    RouteTicket {
        request_id: request_id.to_string(),
        gateway_id: "gw-1".into(),
        key_id: KeyId(String::new()),
        service: "chat".into(),
        rule_id: if kv {
            "kv-rule".into()
        } else {
            "rr-rule".into()
        },
        rule_version: 7,
        mode,
        worker: prefix_index::WorkerId(worker.to_string()),
        predicted_matched_tokens: kv.then_some(32),
        prompt_tokens: kv.then_some(48),
        last_block_key: kv.then_some(prefix_index::BlockKey(0x00112233445566aa)),
        namespace_seed: prefix_index::NamespaceSeed([0x5e; 32]),
        hash_algorithm: prefix_index::HashAlgorithm::Xxh3,
        issued_at_ms,
        expires_at_ms: issued_at_ms + DEFAULT_TICKET_TTL_MS,
    }
}

pub fn draft(request_id: &str, ticket: Option<SignedTicket>, received_at_ms: u64) -> ReceiptDraft {
    let last_block_key = ticket
        .as_ref()
        .and_then(|t| t.ticket_unverified().last_block_key);
    let prompt_tokens = ticket
        .as_ref()
        .and_then(|t| t.ticket_unverified().prompt_tokens)
        .unwrap_or(48);
    ReceiptDraft {
        request_id: request_id.to_string(),
        ticket,
        model: "SmolLM2-135M-Instruct".into(),
        profile_digest: "ab".repeat(32),
        request_sha256: sha256_hex(format!("body of {request_id}").as_bytes()),
        response_sha256: sha256_hex(b"Hello!"),
        prompt_tokens,
        cached_tokens: 32,
        completion_tokens: 3,
        finish_reason: Some("stop".into()),
        status: 200,
        error_code: None,
        received_at_ms,
        first_token_at_ms: Some(received_at_ms + 12),
        completed_at_ms: received_at_ms + 40,
        last_block_key,
    }
}

/// A log of `n` receipts for worker "w0" alternating ticketed (KV-exact / RR) and direct.
pub fn write_log(dir: &Path, name: &str, n: usize) -> PathBuf {
    let gw = gateway_key();
    let wk = worker_key();
    let path = dir.join(name);
    let log = ReceiptLog::open(&path, FsyncPolicy::Always, &wk, "w0").unwrap();
    for i in 0..n {
        let t0 = T0 + i as u64 * 100;
        let rid = format!("req-{i}");
        let t = match i % 3 {
            0 => Some(ticket(&rid, "w0", RouteMode::KvExact, t0).sign(&gw)),
            1 => Some(ticket(&rid, "w0", RouteMode::RoundRobin, t0).sign(&gw)),
            _ => None,
        };
        log.append(draft(&rid, t, t0 + 5)).unwrap();
    }
    path
}
