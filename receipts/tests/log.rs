//! The receipt log: append / get, chain, resume after restart, torn write + resume, concurrent
//! appends, batched fsync, ownership.
mod common;

use std::io::Write;
use std::sync::Arc;

use common::*;
use receipts::*;

#[test]
fn append_chains_and_get_finds_by_request_id() {
    let dir = tempfile::tempdir().unwrap();
    let path = write_log(dir.path(), "w0.jsonl", 5);
    let wk = worker_key();
    let log = ReceiptLog::open(&path, FsyncPolicy::Always, &wk, "w0").unwrap();
    assert_eq!(log.len(), 5);
    assert_eq!(log.open_report().torn_tail, None);
    let r3 = log.get("req-3").unwrap().unwrap();
    assert_eq!(r3.seq, 3);
    assert!(log.get("nope").unwrap().is_none());
    // prev_hash of each line is the SHA-256 of the previous line.
    let text = std::fs::read(&path).unwrap();
    let lines: Vec<&[u8]> = text
        .split(|&b| b == b'\n')
        .filter(|l| !l.is_empty())
        .collect();
    let r4: Receipt = Receipt::from_line(lines[4]).unwrap();
    assert_eq!(r4.prev_hash, Receipt::line_hash(lines[3]));
    let r0: Receipt = Receipt::from_line(lines[0]).unwrap();
    assert_eq!(r0.prev_hash, GENESIS_HASH);
    // A new append continues the chain.
    let r5 = log.append(draft("req-5", None, T0 + 10_000)).unwrap();
    assert_eq!(r5.seq, 5);
    assert_eq!(r5.prev_hash, Receipt::line_hash(lines[4]));
    assert_eq!(log.get("req-5").unwrap().unwrap(), r5);
    let keys = ring(&[&gateway_key(), &wk]);
    let rep = verify_log(&path, &keys).unwrap();
    assert!(rep.ok(), "{rep}");
    assert_eq!(rep.valid, 6);
    assert_eq!(rep.tickets_verified, 4);
    assert_eq!(rep.direct, 2);
}

#[test]
fn torn_write_is_cut_reported_and_chain_resumes() {
    let dir = tempfile::tempdir().unwrap();
    let path = write_log(dir.path(), "w0.jsonl", 4);
    let intact = std::fs::read(&path).unwrap();
    // Simulate kill -9 in the middle of writing a fifth receipt: half a line, no newline.
    let wk = worker_key();
    let other_dir = tempfile::tempdir().unwrap();
    let full = write_log(other_dir.path(), "full.jsonl", 5);
    let full_bytes = std::fs::read(&full).unwrap();
    let fifth = &full_bytes[intact.len()..];
    let mut f = std::fs::OpenOptions::new()
        .append(true)
        .open(&path)
        .unwrap();
    f.write_all(&fifth[..fifth.len() / 2]).unwrap();
    drop(f);

    let keys = ring(&[&gateway_key(), &wk]);
    // Before restart, verify names the torn line and does not count it.
    let rep = verify_log(&path, &keys).unwrap();
    assert!(!rep.ok());
    assert_eq!(rep.valid, 4);
    let first = rep.first_failure().unwrap();
    assert_eq!((first.line, first.kind), (5, FailureKind::TornLine));

    // Restart: the torn line is cut and reported; no complete line is lost.
    let log = ReceiptLog::open(&path, FsyncPolicy::Always, &wk, "w0").unwrap();
    let torn = log.open_report().torn_tail.clone().unwrap();
    assert_eq!(torn.line, 5);
    assert_eq!(torn.offset, intact.len() as u64);
    assert_eq!(torn.len, (fifth.len() / 2) as u64);
    assert_eq!(
        std::fs::read(torn.saved_to.unwrap()).unwrap(),
        &fifth[..fifth.len() / 2]
    );
    assert_eq!(std::fs::read(&path).unwrap(), intact);
    assert_eq!(log.len(), 4);
    // The chain resumes at seq 4 from the last complete line.
    let r = log.append(draft("after-crash", None, T0 + 99_000)).unwrap();
    assert_eq!(r.seq, 4);
    drop(log);
    let rep = verify_log(&path, &keys).unwrap();
    assert!(rep.ok(), "{rep}");
    assert_eq!(rep.valid, 5);
}

#[test]
fn torn_line_missing_only_its_newline_is_still_cut() {
    let dir = tempfile::tempdir().unwrap();
    let path = write_log(dir.path(), "w0.jsonl", 3);
    let mut bytes = std::fs::read(&path).unwrap();
    bytes.pop();
    std::fs::write(&path, &bytes).unwrap();
    let log = ReceiptLog::open(&path, FsyncPolicy::Always, &worker_key(), "w0").unwrap();
    assert_eq!(log.open_report().torn_tail.as_ref().unwrap().line, 3);
    assert_eq!(log.len(), 2);
    assert_eq!(log.append(draft("x", None, T0)).unwrap().seq, 2);
}

#[test]
fn open_refuses_corrupt_middle_and_foreign_logs() {
    let dir = tempfile::tempdir().unwrap();
    let path = write_log(dir.path(), "w0.jsonl", 4);
    let wk = worker_key();
    let err = ReceiptLog::open(&path, FsyncPolicy::Always, &wk, "w1").unwrap_err();
    assert_eq!(err.error_type(), "log_owner");
    let text = std::fs::read_to_string(&path).unwrap();
    let mut lines: Vec<&str> = text.lines().collect();
    lines.swap(1, 2);
    std::fs::write(&path, lines.join("\n") + "\n").unwrap();
    let err = ReceiptLog::open(&path, FsyncPolicy::Always, &wk, "w0").unwrap_err();
    assert_eq!(err.error_type(), "corrupt_log");
    assert!(err.to_string().contains("line 2"), "{err}");
}

#[test]
fn concurrent_appends_keep_one_valid_chain() {
    for policy in [
        FsyncPolicy::Always,
        FsyncPolicy::Batched {
            max_receipts: 16,
            max_ms: 5,
        },
    ] {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("w0.jsonl");
        let gw = gateway_key();
        let wk = worker_key();
        let log = Arc::new(ReceiptLog::open(&path, policy, &wk, "w0").unwrap());
        let threads: Vec<_> = (0..4)
            .map(|t| {
                let log = Arc::clone(&log);
                let gw = gw.clone();
                std::thread::spawn(move || {
                    for i in 0..25 {
                        let rid = format!("t{t}-{i}");
                        let tk = ticket(&rid, "w0", RouteMode::KvExact, T0).sign(&gw);
                        log.append(draft(&rid, Some(tk), T0 + 1)).unwrap();
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(log.len(), 100);
        assert_eq!(log.get("t3-24").unwrap().unwrap().body.request_id, "t3-24");
        drop(log); // stops the flusher, final sync
        let rep = verify_log(&path, &ring(&[&gw, &wk])).unwrap();
        assert!(rep.ok(), "{policy:?}: {rep}");
        assert_eq!(rep.valid, 100);
        assert_eq!(rep.tickets_verified, 100);
    }
}

#[test]
fn decision_log_appends_and_recovers_torn_tail() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("gw.jsonl");
    let gw = gateway_key();
    let log = DecisionLog::open(&path, FsyncPolicy::default()).unwrap();
    let st = ticket("r1", "w0", RouteMode::RoundRobin, T0).sign(&gw);
    let rec = DecisionRecord {
        request_id: "r1".into(),
        at_ms: T0 + 50,
        ticket: Some(st.clone()),
        service: Some("chat".into()),
        rule_id: Some("rr-rule".into()),
        rule_version: Some(7),
        worker: Some("w0".into()),
        status: 200,
        error: None,
        client_request_id: None,
        receipt_named: None,
        tenant: None,
        phase: None,
    };
    log.append(&rec).unwrap();
    drop(log);
    let mut bytes = std::fs::read(&path).unwrap();
    let line = bytes.clone();
    assert_eq!(
        DecisionRecord::from_line(&line[..line.len() - 1]).unwrap(),
        rec
    );
    bytes.extend_from_slice(&line[..20]);
    std::fs::write(&path, &bytes).unwrap();
    let log = DecisionLog::open(&path, FsyncPolicy::default()).unwrap();
    assert_eq!(log.existing_lines(), 1);
    assert_eq!(log.torn_tail().unwrap().line, 2);
    assert_eq!(std::fs::read(&path).unwrap(), line);
}

#[test]
fn fsync_policy_config_json() {
    let p: FsyncPolicy =
        serde_json::from_str(r#"{"mode":"batched","max_receipts":64,"max_ms":10}"#).unwrap();
    assert_eq!(
        p,
        FsyncPolicy::Batched {
            max_receipts: 64,
            max_ms: 10
        }
    );
    assert_eq!(
        serde_json::to_string(&FsyncPolicy::Always).unwrap(),
        r#"{"mode":"always"}"#
    );
}

/// Child side of `kill_9_mid_stream_then_resume`: appends until killed. A no-op unless the
/// parent set RECEIPTS_CRASH_CHILD.
#[test]
fn crash_child_helper() {
    let Some(path) = std::env::var_os("RECEIPTS_CRASH_CHILD") else {
        return;
    };
    let gw = gateway_key();
    let log = ReceiptLog::open(
        std::path::Path::new(&path),
        FsyncPolicy::Batched {
            max_receipts: 8,
            max_ms: 5,
        },
        &worker_key(),
        "w0",
    )
    .unwrap();
    let mut out = std::io::stdout();
    for i in 0.. {
        let rid = format!("c{i}");
        let t = ticket(&rid, "w0", RouteMode::KvExact, T0).sign(&gw);
        let r = log.append(draft(&rid, Some(t), T0 + 1)).unwrap();
        writeln!(out, "appended {}", r.seq).unwrap();
        out.flush().unwrap();
    }
}

/// A real `kill -9` of a process appending receipts: every acknowledged receipt survives, the
/// chain resumes, and the log verifies.
#[cfg(unix)]
#[test]
fn kill_9_mid_stream_then_resume() {
    use std::io::BufRead;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("w0.jsonl");
    let mut child = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "crash_child_helper",
            "--nocapture",
            "--test-threads",
            "1",
        ])
        .env("RECEIPTS_CRASH_CHILD", &path)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let mut acked = 0u64;
    // Keep the pipe open until after the kill, so the child dies by SIGKILL and not by EPIPE.
    let mut lines = std::io::BufReader::new(stdout).lines();
    for line in &mut lines {
        let line = line.unwrap();
        if let Some(seq) = line.strip_prefix("appended ") {
            acked = seq.trim().parse::<u64>().unwrap() + 1;
            if acked >= 40 {
                break;
            }
        }
    }
    child.kill().unwrap(); // SIGKILL
    let status = child.wait().unwrap();
    drop(lines);
    {
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(
            status.signal(),
            Some(9),
            "child did not die by SIGKILL: {status:?}"
        );
    }
    assert!(acked >= 40, "child stopped early after {acked} receipts");
    let wk = worker_key();
    let log = ReceiptLog::open(&path, FsyncPolicy::Always, &wk, "w0").unwrap();
    assert!(
        log.len() >= acked,
        "lost acknowledged receipts: {} < {acked}",
        log.len()
    );
    let before = log.len();
    let r = log.append(draft("after-kill", None, T0 + 5)).unwrap();
    assert_eq!(r.seq, before);
    drop(log);
    let rep = verify_log(&path, &ring(&[&gateway_key(), &wk])).unwrap();
    assert!(rep.ok(), "{rep}");
    assert_eq!(rep.valid, before + 1);
}

#[test]
fn rotation_keeps_one_chain_across_files_and_restarts() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("receipts.jsonl");
    let wk = worker_key();
    let keys = ring(&[&gateway_key(), &wk]);
    // Each receipt line is ~700 bytes: a 2 KiB cap puts at most 2 in a file.
    let rotation = Rotation {
        max_bytes: Some(2048),
        max_age: None,
    };
    let log = ReceiptLog::open_with(&path, FsyncPolicy::Always, &wk, "w0", rotation).unwrap();
    for i in 0..7 {
        log.append(draft(&format!("req-{i}"), None, T0 + i))
            .unwrap();
    }
    let rotated = rotated_files(&path).unwrap();
    assert!(rotated.len() >= 3, "{rotated:?}");
    assert!(rotated[0]
        .file_name()
        .unwrap()
        .to_string_lossy()
        .ends_with(".00000000000000000000.jsonl"));
    // The current file serves its own receipts only.
    assert!(log.get("req-6").unwrap().is_some());
    assert!(log.get("req-0").unwrap().is_none());
    drop(log);
    // A restart continues the chain from the current file (and from the last rotated file when
    // the current one is empty).
    let log = ReceiptLog::open_with(&path, FsyncPolicy::Always, &wk, "w0", rotation).unwrap();
    assert_eq!(log.len(), 7);
    let r = log.append(draft("req-7", None, T0 + 7)).unwrap();
    assert_eq!(r.seq, 7);
    drop(log);
    // Verified as one chain, given in any order; the current file alone lacks its head.
    let mut set: Vec<std::path::PathBuf> = rotated_files(&path).unwrap();
    set.push(path.clone());
    set.reverse();
    let reports = verify_logs_with(&set, &keys, VerifyOptions::default()).unwrap();
    assert_eq!(reports.len(), set.len());
    assert!(reports.iter().all(|r| r.ok()), "{reports:?}");
    assert_eq!(reports.iter().map(|r| r.valid).sum::<u64>(), 8);
    let alone = verify_log(&path, &keys).unwrap();
    assert!(!alone.ok(), "the current file alone starts mid-chain");
    // Dropping a middle file breaks the chain where it was.
    let mut gap = set.clone();
    gap.retain(|p| p != &rotated_files(&path).unwrap()[1]);
    let reports = verify_logs_with(&gap, &keys, VerifyOptions::default()).unwrap();
    assert!(reports.iter().any(|r| !r.ok()));
    // A crash right after a rotation leaves no current file: the head comes from the last
    // rotated file.
    let text = std::fs::read_to_string(&path).unwrap();
    let first = Receipt::from_line(text.lines().next().unwrap().as_bytes()).unwrap();
    std::fs::rename(
        &path,
        dir.path().join(format!("receipts.{:020}.jsonl", first.seq)),
    )
    .unwrap();
    let log = ReceiptLog::open_with(&path, FsyncPolicy::Always, &wk, "w0", rotation).unwrap();
    assert_eq!(log.len(), 8);
    let r = log.append(draft("req-8", None, T0 + 8)).unwrap();
    assert_eq!(r.seq, 8);
    drop(log);
    let mut set = rotated_files(&path).unwrap();
    set.push(path.clone());
    let reports = verify_logs_with(&set, &keys, VerifyOptions::default()).unwrap();
    assert!(reports.iter().all(|r| r.ok()), "{reports:?}");
}
