//! Tampering: byte flips, truncation, reordering, duplication, splicing, wrong keys, forged and
//! expired tickets — every one must fail verification and name the right line.
mod common;

use common::*;
use rand::{Rng, SeedableRng};
use receipts::*;

fn opts() -> VerifyOptions {
    VerifyOptions {
        require_ticket_keys: true,
        ..VerifyOptions::default()
    }
}

fn log_bytes(n: usize) -> Vec<u8> {
    let dir = tempfile::tempdir().unwrap();
    std::fs::read(write_log(dir.path(), "w0.jsonl", n)).unwrap()
}

fn lines(bytes: &[u8]) -> Vec<Vec<u8>> {
    bytes
        .split_inclusive(|&b| b == b'\n')
        .map(<[u8]>::to_vec)
        .collect()
}

/// 1-based line number (in `bytes`) of byte position `pos`.
fn line_of(bytes: &[u8], pos: usize) -> u64 {
    bytes[..pos.min(bytes.len())]
        .iter()
        .filter(|&&b| b == b'\n')
        .count() as u64
        + 1
}

fn keys() -> KeyRing {
    ring(&[&gateway_key(), &worker_key()])
}

#[test]
fn intact_log_verifies() {
    let b = log_bytes(6);
    let rep = verify_bytes("log", &b, &keys(), opts());
    assert!(rep.ok(), "{rep}");
    assert_eq!((rep.valid, rep.tickets_verified, rep.direct), (6, 4, 2));
}

#[test]
fn flipping_any_byte_fails_and_names_its_line() {
    let b = log_bytes(3);
    let k = keys();
    let mut checked = 0;
    for pos in 0..b.len() {
        // Every byte, with a low bit, the ASCII case bit (hex case!) or the UTF-8 high bit.
        {
            let mask = [0x01u8, 0x20, 0x80][pos % 3];
            let mut m = b.clone();
            m[pos] ^= mask;
            let rep = verify_bytes("log", &m, &k, opts());
            let first = rep
                .first_failure()
                .unwrap_or_else(|| panic!("flip {mask:#04x} at byte {pos} was not detected"));
            assert_eq!(
                first.line,
                line_of(&b, pos),
                "flip {mask:#04x} at byte {pos}: {first}"
            );
            checked += 1;
        }
    }
    assert_eq!(checked, b.len());
}

#[test]
fn truncated_logs() {
    let b = log_bytes(5);
    let l = lines(&b);
    let k = keys();
    // Head removed.
    let rep = verify_bytes("log", &l[2..].concat(), &k, opts());
    let f = rep.first_failure().unwrap();
    assert_eq!((f.line, f.kind), (1, FailureKind::BadStart));
    // Cut mid-line.
    let cut = &b[..b.len() - 30];
    let rep = verify_bytes("log", cut, &k, opts());
    let f = rep.first_failure().unwrap();
    assert_eq!((f.line, f.kind), (5, FailureKind::TornLine));
    assert_eq!(rep.valid, 4);
    // A middle line removed.
    let mut m = l.clone();
    m.remove(2);
    let rep = verify_bytes("log", &m.concat(), &k, opts());
    let f = rep.first_failure().unwrap();
    assert_eq!((f.line, f.kind), (3, FailureKind::SeqGap));
    assert!(rep.failure_counts.contains_key(&FailureKind::ChainBreak));
    // Whole lines cut from the tail cannot be seen from the log alone (the audit sees them:
    // see audit.rs `missing_receipt_after_tail_truncation`).
    let rep = verify_bytes("log", &l[..3].concat(), &k, opts());
    assert!(rep.ok());
}

#[test]
fn reordered_and_duplicated_lines() {
    let l = lines(&log_bytes(5));
    let k = keys();
    let mut m = l.clone();
    m.swap(1, 3);
    let rep = verify_bytes("log", &m.concat(), &k, opts());
    let f = rep.first_failure().unwrap();
    assert_eq!((f.line, f.kind), (2, FailureKind::SeqGap));
    let mut m = l.clone();
    m.insert(2, l[1].clone());
    let rep = verify_bytes("log", &m.concat(), &k, opts());
    let f = rep.first_failure().unwrap();
    assert_eq!(f.line, 3);
    assert!(rep
        .failure_counts
        .contains_key(&FailureKind::DuplicateTicket));
    assert!(rep.failure_counts.contains_key(&FailureKind::ChainBreak));
}

#[test]
fn spliced_logs() {
    let k = keys();
    let l = lines(&log_bytes(4));
    // A line from another worker's log (other key, other worker id).
    let dir = tempfile::tempdir().unwrap();
    let other_key = KeyPair::generate();
    let p = dir.path().join("w1.jsonl");
    let other = ReceiptLog::open(&p, FsyncPolicy::Always, &other_key, "w1").unwrap();
    for i in 0..3 {
        other.append(draft(&format!("x{i}"), None, T0)).unwrap();
    }
    drop(other);
    let ol = lines(&std::fs::read(&p).unwrap());
    let mut m = l.clone();
    m.insert(2, ol[2].clone());
    let rep = verify_bytes("log", &m.concat(), &k, opts());
    let f = rep.first_failure().unwrap();
    assert_eq!(f.line, 3);
    for kind in [
        FailureKind::ChainBreak,
        FailureKind::UnknownKey,
        FailureKind::WorkerChanged,
    ] {
        assert!(rep.failure_counts.contains_key(&kind), "{kind:?}: {rep}");
    }
    // Even with the other worker's key trusted, the splice breaks the chain.
    let mut k2 = keys();
    k2.insert("w1", other_key.public().clone());
    let rep = verify_bytes("log", &m.concat(), &k2, opts());
    assert_eq!(rep.first_failure().unwrap().line, 3);
    // Two whole logs of the same worker concatenated: the second restarts at seq 0.
    let mut m = l.clone();
    m.extend(l.iter().cloned());
    let rep = verify_bytes("log", &m.concat(), &k, opts());
    let f = rep.first_failure().unwrap();
    assert_eq!((f.line, f.kind), (5, FailureKind::SeqGap));
}

#[test]
fn wrong_key() {
    let b = log_bytes(3);
    let rep = verify_bytes("log", &b, &ring(&[&KeyPair::generate()]), opts());
    let f = rep.first_failure().unwrap();
    assert_eq!((f.line, f.kind), (1, FailureKind::UnknownKey));
    // Only the worker key: tickets unchecked by default, failing with require_ticket_keys.
    let wk = ring(&[&worker_key()]);
    let rep = verify_bytes("log", &b, &wk, VerifyOptions::default());
    assert!(rep.ok(), "{rep}");
    assert_eq!(rep.tickets_unchecked, 2);
    let rep = verify_bytes("log", &b, &wk, opts());
    assert_eq!(
        rep.first_failure().unwrap().kind,
        FailureKind::TicketUnknownKey
    );
}

fn one_receipt_log(t: SignedTicket, received_at_ms: u64) -> Vec<u8> {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("w0.jsonl");
    let log = ReceiptLog::open(&p, FsyncPolicy::Always, &worker_key(), "w0").unwrap();
    let rid = t.ticket_unverified().request_id.clone();
    log.append(draft(&rid, Some(t), received_at_ms)).unwrap();
    drop(log);
    std::fs::read(&p).unwrap()
}

#[test]
fn forged_expired_and_misdirected_tickets() {
    let k = keys();
    // A worker inventing a ticket with its own (trusted) key.
    let forged = ticket("r1", "w0", RouteMode::KvExact, T0).sign(&worker_key());
    let rep = verify_bytes("log", &one_receipt_log(forged, T0), &k, opts());
    assert_eq!(
        rep.first_failure().unwrap().kind,
        FailureKind::TicketMismatch
    );
    assert!(rep.first_failure().unwrap().detail.contains("own key"));
    let attacker = KeyPair::generate();
    let forged = ticket("r1", "w0", RouteMode::KvExact, T0).sign(&attacker);
    let rep = verify_bytes("log", &one_receipt_log(forged, T0), &k, opts());
    assert_eq!(
        rep.first_failure().unwrap().kind,
        FailureKind::TicketUnknownKey
    );
    // A genuine gateway ticket altered after signing (rule version changed), inside a receipt
    // the worker signed correctly.
    let good = ticket("r1", "w0", RouteMode::KvExact, T0).sign(&gateway_key());
    let (p, sig) = good.header().split_once('.').unwrap();
    use base64::Engine;
    let b64 = base64::engine::general_purpose::URL_SAFE_NO_PAD;
    let mut json: serde_json::Value = serde_json::from_slice(&b64.decode(p).unwrap()).unwrap();
    json["rule_version"] = serde_json::json!(8);
    let payload = receipts::canonical::value_to_vec(&json).unwrap();
    let altered = SignedTicket::parse_header(&format!("{}.{sig}", b64.encode(payload))).unwrap();
    let rep = verify_bytes("log", &one_receipt_log(altered, T0), &k, opts());
    let f = rep.first_failure().unwrap();
    assert_eq!((f.line, f.kind), (1, FailureKind::TicketBadSignature));
    // Expired at the time the worker received the request.
    let t = ticket("r2", "w0", RouteMode::RoundRobin, T0).sign(&gateway_key());
    let late = T0 + DEFAULT_TICKET_TTL_MS + DEFAULT_MAX_CLOCK_SKEW_MS + 1;
    let rep = verify_bytes("log", &one_receipt_log(t.clone(), late), &k, opts());
    let f = rep.first_failure().unwrap();
    assert_eq!((f.line, f.kind), (1, FailureKind::TicketOutsideWindow));
    assert!(verify_bytes("log", &one_receipt_log(t, T0 + 1), &k, opts()).ok());
    // A ticket for another worker.
    let t = ticket("r3", "w9", RouteMode::RoundRobin, T0).sign(&gateway_key());
    let rep = verify_bytes("log", &one_receipt_log(t, T0), &k, opts());
    assert_eq!(
        rep.first_failure().unwrap().kind,
        FailureKind::TicketMismatch
    );
}

/// Seeded randomized differential test against the naive model "a mutated log is valid iff it
/// is the original cut at a line boundary; otherwise the first failure is at the line of the
/// first byte that differs".
#[test]
fn random_mutations_match_naive_model() {
    let seed: u64 = std::env::var("RECEIPTS_TEST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(rand::random);
    println!("random_mutations_match_naive_model seed={seed} (RECEIPTS_TEST_SEED to replay)");
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let orig = log_bytes(6);
    let ol = lines(&orig);
    let dir = tempfile::tempdir().unwrap();
    let other_key = KeyPair::generate();
    let p = dir.path().join("w1.jsonl");
    let other = ReceiptLog::open(&p, FsyncPolicy::Always, &other_key, "w1").unwrap();
    for i in 0..3 {
        other.append(draft(&format!("x{i}"), None, T0)).unwrap();
    }
    drop(other);
    let foreign = lines(&std::fs::read(&p).unwrap());
    let k = keys();
    for case in 0..300 {
        let mut m: Vec<Vec<u8>> = ol.clone();
        let what = rng.gen_range(0..6);
        let mut flat;
        match what {
            0 => {
                flat = m.concat();
                let i = rng.gen_range(0..flat.len());
                flat[i] ^= 1 << rng.gen_range(0..8);
            }
            1 => {
                m.remove(rng.gen_range(0..m.len()));
                flat = m.concat();
            }
            2 => {
                let (a, b) = (rng.gen_range(0..m.len()), rng.gen_range(0..m.len()));
                m.swap(a, b);
                flat = m.concat();
            }
            3 => {
                let a = rng.gen_range(0..m.len());
                let line = m[a].clone();
                m.insert(rng.gen_range(0..=m.len()), line);
                flat = m.concat();
            }
            4 => {
                let f = foreign[rng.gen_range(0..foreign.len())].clone();
                m.insert(rng.gen_range(0..=m.len()), f);
                flat = m.concat();
            }
            _ => {
                flat = m.concat();
                flat.truncate(rng.gen_range(0..=flat.len()));
            }
        }
        let first_diff = flat
            .iter()
            .zip(orig.iter())
            .position(|(a, b)| a != b)
            .unwrap_or(flat.len().min(orig.len()));
        let is_line_prefix = orig.starts_with(&flat) && (flat.is_empty() || flat.ends_with(b"\n"));
        let rep = verify_bytes("log", &flat, &k, opts());
        if is_line_prefix {
            assert!(rep.ok(), "seed {seed} case {case} op {what}: {rep}");
        } else {
            let f = rep.first_failure().unwrap_or_else(|| {
                panic!("seed {seed} case {case} op {what}: mutation not detected")
            });
            assert_eq!(
                f.line,
                line_of(&flat, first_diff),
                "seed {seed} case {case} op {what}: {f}"
            );
        }
    }
}
