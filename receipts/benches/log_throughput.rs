//! Receipt log throughput under each fsync policy, plus the signing and verification cost.
//!
//! Run: `cargo bench -p receipts --bench log_throughput` (set RECEIPTS_BENCH_DIR to choose the
//! file system; default: the system temp dir). Prints a Markdown table for docs/benchmarks.md.
//! No harness: each row times one run of N appends after a short warm-up.

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use receipts::*;

fn draft(i: usize, gw: &KeyPair, t0: u64) -> ReceiptDraft {
    let rid = format!("req-{i}");
    let ticket = RouteTicket {
        request_id: rid.clone(),
        gateway_id: "gw-1".into(),
        key_id: KeyId(String::new()),
        service: "chat".into(),
        rule_id: "kv".into(),
        rule_version: 1,
        mode: RouteMode::KvExact,
        worker: "w0".into(),
        predicted_matched_tokens: Some(64),
        prompt_tokens: Some(100),
        last_block_key: Some(prefix_index::BlockKey(0x0123456789abcdef)),
        namespace_seed: prefix_index::NamespaceSeed([0xab; 32]),
        hash_algorithm: prefix_index::HashAlgorithm::Xxh3,
        issued_at_ms: t0,
        expires_at_ms: t0 + DEFAULT_TICKET_TTL_MS,
    }
    .sign(gw);
    ReceiptDraft {
        request_id: rid,
        ticket: Some(ticket),
        model: "m".into(),
        profile_digest: "cd".repeat(32),
        request_sha256: sha256_hex(b"req"),
        response_sha256: sha256_hex(b"resp"),
        prompt_tokens: 100,
        cached_tokens: 64,
        completion_tokens: 20,
        finish_reason: Some("stop".into()),
        status: 200,
        error_code: None,
        received_at_ms: t0 + 1,
        first_token_at_ms: Some(t0 + 5),
        completed_at_ms: t0 + 50,
        last_block_key: Some(prefix_index::BlockKey(0x0123456789abcdef)),
    }
}

fn run(dir: &Path, policy: FsyncPolicy, threads: usize, n: usize) -> f64 {
    let gw = KeyPair::from_seed(&[1; 32]);
    let wk = KeyPair::from_seed(&[2; 32]);
    let path = dir.join(format!("bench-{}.jsonl", rand::random::<u64>()));
    let log = Arc::new(ReceiptLog::open(&path, policy, &wk, "w0").expect("open log"));
    let t0 = now_ms();
    // Drafts (including the gateway's ticket signature) are prepared outside the timed region.
    let per = n / threads;
    let drafts: Vec<Vec<ReceiptDraft>> = (0..threads)
        .map(|t| (0..per).map(|i| draft(t * per + i, &gw, t0)).collect())
        .collect();
    let start = Instant::now();
    let handles: Vec<_> = drafts
        .into_iter()
        .map(|ds| {
            let log = Arc::clone(&log);
            std::thread::spawn(move || {
                for d in ds {
                    log.append(d).expect("append");
                }
            })
        })
        .collect();
    for h in handles {
        h.join().expect("join");
    }
    drop(log); // includes the final sync of a batched log
    let secs = start.elapsed().as_secs_f64();
    let _ = std::fs::remove_file(&path);
    (per * threads) as f64 / secs
}

fn main() {
    let dir = std::env::var_os("RECEIPTS_BENCH_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(std::env::temp_dir);
    println!("receipt log throughput, files in {}", dir.display());
    println!();
    println!("| policy | threads | receipts | receipts/s |");
    println!("|---|---|---|---|");
    let cases: &[(&str, FsyncPolicy, usize, usize)] = &[
        ("always", FsyncPolicy::Always, 1, 500),
        ("always", FsyncPolicy::Always, 4, 500),
        (
            "batched 64 / 10 ms",
            FsyncPolicy::Batched {
                max_receipts: 64,
                max_ms: 10,
            },
            1,
            20_000,
        ),
        (
            "batched 64 / 10 ms",
            FsyncPolicy::Batched {
                max_receipts: 64,
                max_ms: 10,
            },
            4,
            20_000,
        ),
        (
            "batched 1024 / 100 ms",
            FsyncPolicy::Batched {
                max_receipts: 1024,
                max_ms: 100,
            },
            1,
            20_000,
        ),
    ];
    let _ = run(&dir, FsyncPolicy::Always, 1, 50); // warm-up
    for (name, policy, threads, n) in cases {
        let rate = run(&dir, *policy, *threads, *n);
        println!("| {name} | {threads} | {n} | {rate:.0} |");
    }

    // Signing alone and verification of a log.
    let gw = KeyPair::from_seed(&[1; 32]);
    let wk = KeyPair::from_seed(&[2; 32]);
    let n = 20_000;
    let drafts: Vec<ReceiptDraft> = (0..n).map(|i| draft(i, &gw, now_ms())).collect();
    let start = Instant::now();
    for (i, d) in drafts.into_iter().enumerate() {
        let r = Receipt::sign(d, i as u64, GENESIS_HASH.into(), "w0".into(), &wk).expect("sign");
        std::hint::black_box(r);
    }
    let sign_rate = n as f64 / start.elapsed().as_secs_f64();
    let path = dir.join(format!("bench-verify-{}.jsonl", rand::random::<u64>()));
    {
        let log = ReceiptLog::open(
            &path,
            FsyncPolicy::Batched {
                max_receipts: 4096,
                max_ms: 1000,
            },
            &wk,
            "w0",
        )
        .expect("open");
        for i in 0..n {
            log.append(draft(i, &gw, now_ms())).expect("append");
        }
    }
    let mut ring = KeyRing::new();
    ring.insert("gw", gw.public().clone());
    ring.insert("w0", wk.public().clone());
    let start = Instant::now();
    let report = verify_log(&path, &ring).expect("verify");
    let verify_rate = n as f64 / start.elapsed().as_secs_f64();
    assert!(report.ok(), "{report}");
    let bytes = std::fs::metadata(&path).map(|m| m.len()).unwrap_or(0);
    let _ = std::fs::remove_file(&path);
    println!();
    println!("| operation | receipts | receipts/s |");
    println!("|---|---|---|");
    println!("| sign + canonical encode (no I/O) | {n} | {sign_rate:.0} |");
    println!("| verify_log (receipt + ticket signatures, chain) | {n} | {verify_rate:.0} |");
    println!();
    println!("average line: {} bytes", bytes / n as u64);

    // The gateway's decision log at its policy (synced by the background thread every 100 ms):
    // one final line per request, or the write-ahead routed line and the final line.
    let n = 20_000;
    let records: Vec<(DecisionRecord, DecisionRecord)> = (0..n)
        .map(|i| {
            let d = draft(i, &gw, now_ms());
            let last = DecisionRecord {
                request_id: d.request_id.clone(),
                at_ms: now_ms(),
                ticket: d.ticket.clone(),
                service: Some("chat".into()),
                rule_id: Some("kv".into()),
                rule_version: Some(1),
                worker: Some("w0".into()),
                status: 200,
                error: None,
                client_request_id: None,
                receipt_named: Some(true),
                tenant: None,
                phase: None,
            };
            let routed = DecisionRecord {
                status: 0,
                receipt_named: None,
                phase: Some(DecisionPhase::Routed),
                ..last.clone()
            };
            (routed, last)
        })
        .collect();
    println!();
    println!("| decision log (batched, 100 ms) | requests | µs per request |");
    println!("|---|---|---|");
    for with_routed in [false, true, false, true] {
        let path = dir.join(format!("bench-decisions-{}.jsonl", rand::random::<u64>()));
        let log = DecisionLog::open(
            &path,
            FsyncPolicy::Batched {
                max_receipts: u32::MAX,
                max_ms: 100,
            },
        )
        .expect("open decision log");
        let start = Instant::now();
        for (routed, last) in &records {
            if with_routed {
                log.append(routed).expect("append");
            }
            log.append(last).expect("append");
        }
        let us = start.elapsed().as_secs_f64() * 1e6 / n as f64;
        drop(log);
        let _ = std::fs::remove_file(&path);
        let what = if with_routed {
            "routed + final line"
        } else {
            "final line only"
        };
        println!("| {what} | {n} | {us:.1} |");
    }
}
