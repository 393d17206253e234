//! The audit: gateway decisions against worker receipts, one test per discrepancy kind.
mod common;

use std::path::{Path, PathBuf};

use common::*;
use receipts::*;

struct Fleet {
    _dir: tempfile::TempDir,
    decisions: PathBuf,
    logs: Vec<PathBuf>,
    keys: KeyRing,
    gw: KeyPair,
    workers: Vec<(String, KeyPair)>,
}

/// One gateway, two workers; `n` routed requests alternating workers and modes, plus one
/// unrouted decision and one direct request per worker.
fn fleet(n: usize) -> Fleet {
    let dir = tempfile::tempdir().unwrap();
    let gw = gateway_key();
    let workers = vec![
        ("w0".to_string(), worker_key()),
        ("w1".to_string(), KeyPair::from_seed(&[0x42; 32])),
    ];
    let decisions = dir.path().join("gateway.jsonl");
    let dlog = DecisionLog::open(&decisions, FsyncPolicy::Always).unwrap();
    let logs: Vec<PathBuf> = workers
        .iter()
        .map(|(w, _)| dir.path().join(format!("{w}.jsonl")))
        .collect();
    let rlogs: Vec<ReceiptLog> = workers
        .iter()
        .zip(&logs)
        .map(|((w, k), p)| ReceiptLog::open(p, FsyncPolicy::Always, k, w).unwrap())
        .collect();
    for i in 0..n {
        let wi = i % 2;
        let w = &workers[wi].0;
        let mode = if i % 4 < 2 {
            RouteMode::KvExact
        } else {
            RouteMode::RoundRobin
        };
        let rid = format!("req-{i}");
        let t0 = T0 + i as u64 * 10;
        let st = ticket(&rid, w, mode, t0).sign(&gw);
        rlogs[wi]
            .append(draft(&rid, Some(st.clone()), t0 + 1))
            .unwrap();
        dlog.append(&decision(&rid, Some(st), 200, None)).unwrap();
    }
    dlog.append(&DecisionRecord {
        request_id: "unrouted".into(),
        at_ms: T0,
        ticket: None,
        service: None,
        rule_id: None,
        rule_version: None,
        worker: None,
        status: 404,
        error: None,
        client_request_id: None,
        receipt_named: None,
        tenant: None,
        phase: None,
    })
    .unwrap();
    for (i, l) in rlogs.iter().enumerate() {
        l.append(draft(&format!("direct-{i}"), None, T0)).unwrap();
    }
    let mut keys = ring(&[&gw]);
    for (w, k) in &workers {
        keys.insert(w.clone(), k.public().clone());
    }
    Fleet {
        _dir: dir,
        decisions,
        logs,
        keys,
        gw,
        workers,
    }
}

fn decision(
    rid: &str,
    st: Option<SignedTicket>,
    status: u16,
    error: Option<&str>,
) -> DecisionRecord {
    let t = st.as_ref().map(|s| s.ticket_unverified().clone());
    DecisionRecord {
        request_id: rid.to_string(),
        at_ms: T0,
        service: t.as_ref().map(|t| t.service.clone()),
        rule_id: t.as_ref().map(|t| t.rule_id.clone()),
        rule_version: t.as_ref().map(|t| t.rule_version),
        worker: t.as_ref().map(|t| t.worker.clone()),
        ticket: st,
        status,
        error: error.map(str::to_string),
        client_request_id: None,
        receipt_named: None,
        tenant: None,
        phase: None,
    }
}

fn append_decision(path: &Path, d: &DecisionRecord) {
    DecisionLog::open(path, FsyncPolicy::Always)
        .unwrap()
        .append(d)
        .unwrap();
}

fn kinds(r: &AuditReport) -> Vec<DiscrepancyKind> {
    r.discrepancies.iter().map(|d| d.kind).collect()
}

#[test]
fn consistent_fleet_passes_with_counts() {
    let f = fleet(8);
    let r = audit(&f.decisions, &f.logs, &f.keys).unwrap();
    assert!(r.ok(), "{r}");
    assert_eq!(
        (r.decisions, r.routed, r.unrouted, r.receipted),
        (9, 8, 1, 8)
    );
    assert_eq!((r.receipts, r.direct_receipts), (10, 2));
    assert_eq!(r.per_worker["w0"].decisions, 4);
    assert_eq!(r.per_worker["w1"].direct_receipts, 1);
    assert_eq!(r.per_mode["kv_exact"], 4);
    let kv = &r.per_route[&("chat".to_string(), "kv-rule".to_string(), 7)];
    assert_eq!(
        (
            kv.decisions,
            kv.receipted,
            kv.predicted_tokens,
            kv.cached_tokens
        ),
        (4, 4, 128, 128)
    );
    assert_eq!(
        (
            r.parity.compared,
            r.parity.mismatched,
            r.parity.not_applicable
        ),
        (4, 0, 4)
    );
    let text = r.to_string();
    assert!(text.starts_with("audit: OK"), "{text}");
    assert!(text.contains("chat / kv-rule / v7: decisions 4"), "{text}");
    // JSON form serializes.
    let json = serde_json::to_value(&r).unwrap();
    assert_eq!(json["per_route"][0]["rule_version"], 7);
}

#[test]
fn missing_receipt_after_tail_truncation() {
    let f = fleet(6);
    // Drop the last two lines of w0's log (whole lines: the log alone still verifies).
    let text = std::fs::read_to_string(&f.logs[0]).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    std::fs::write(&f.logs[0], lines[..lines.len() - 2].join("\n") + "\n").unwrap();
    assert!(verify_log(&f.logs[0], &f.keys).unwrap().ok());
    let r = audit(&f.decisions, &f.logs, &f.keys).unwrap();
    assert_eq!(kinds(&r), vec![DiscrepancyKind::MissingReceipt], "{r}");
    assert_eq!(r.discrepancies[0].request_id.as_deref(), Some("req-4"));
    assert!(r.to_string().starts_with("audit: FAILED"));
}

#[test]
fn upstream_error_without_receipt_is_allowed() {
    let f = fleet(2);
    let st = ticket("lost", "w1", RouteMode::RoundRobin, T0).sign(&f.gw);
    append_decision(
        &f.decisions,
        &decision("lost", Some(st.clone()), 502, Some("connect refused")),
    );
    let r = audit(&f.decisions, &f.logs, &f.keys).unwrap();
    assert!(r.ok(), "{r}");
    assert_eq!(r.failed_without_receipt, 1);
    append_decision(
        &f.decisions,
        &decision(
            "lost2",
            Some(ticket("lost2", "w1", RouteMode::RoundRobin, T0).sign(&f.gw)),
            502,
            None,
        ),
    );
    let r = audit(&f.decisions, &f.logs, &f.keys).unwrap();
    assert_eq!(kinds(&r), vec![DiscrepancyKind::MissingReceipt]);
}

/// Write-ahead `routed` lines: superseded by their request's final line; alone (the gateway
/// stopped with the request in flight) they owe no receipt, and a receipt that exists matches.
#[test]
fn routed_lines_are_superseded_or_count_as_unfinished() {
    let routed = |rid: &str, st: &SignedTicket| DecisionRecord {
        status: 0,
        phase: Some(DecisionPhase::Routed),
        ..decision(rid, Some(st.clone()), 0, None)
    };
    // A routed line followed by its final line: one decision, as without it.
    let f = fleet(2);
    let before = audit(&f.decisions, &f.logs, &f.keys).unwrap();
    let (w, k) = &f.workers[0];
    let st = ticket("done", "w0", RouteMode::RoundRobin, T0).sign(&f.gw);
    append_decision(&f.decisions, &routed("done", &st));
    let log = ReceiptLog::open(&f.logs[0], FsyncPolicy::Always, k, w).unwrap();
    log.append(draft("done", Some(st.clone()), T0)).unwrap();
    drop(log);
    append_decision(&f.decisions, &decision("done", Some(st), 200, None));
    let r = audit(&f.decisions, &f.logs, &f.keys).unwrap();
    assert!(r.ok(), "{r}");
    assert_eq!(
        (r.decisions, r.unfinished),
        (before.decisions + 1, 0),
        "{r}"
    );
    assert_eq!(r.receipted, before.receipted + 1);

    // Routed lines alone: one receipted by the worker, one that never reached it.
    let st = ticket("cut", "w0", RouteMode::KvExact, T0).sign(&f.gw);
    append_decision(&f.decisions, &routed("cut", &st));
    let log = ReceiptLog::open(&f.logs[0], FsyncPolicy::Always, k, w).unwrap();
    log.append(draft("cut", Some(st), T0)).unwrap();
    drop(log);
    let st = ticket("cut2", "w1", RouteMode::RoundRobin, T0).sign(&f.gw);
    append_decision(&f.decisions, &routed("cut2", &st));
    let r = audit(&f.decisions, &f.logs, &f.keys).unwrap();
    assert!(r.ok(), "{r}");
    assert_eq!(r.unfinished, 2, "{r}");
    assert_eq!(r.receipted, before.receipted + 2, "{r}");
    assert_eq!(r.failed_without_receipt, 1, "{r}");
    assert!(r
        .to_string()
        .contains("unfinished (the gateway stopped with them in flight) 2"));
}

/// A refusal retried on another worker: the refused attempt's `retried` line supersedes its
/// routed line and is checked against the refusing worker's receipt (status 429 on both); the
/// request's final line names the second ticket.
#[test]
fn a_refused_attempt_retried_elsewhere_is_checked_like_a_decision() {
    let f = fleet(2);
    let before = audit(&f.decisions, &f.logs, &f.keys).unwrap();
    let line = |st: &SignedTicket, status: u16, phase: Option<DecisionPhase>| DecisionRecord {
        phase,
        receipt_named: Some(true),
        ..decision("busy", Some(st.clone()), status, None)
    };
    let first = ticket("busy", "w0", RouteMode::KvExact, T0).sign(&f.gw);
    let second = ticket("busy", "w1", RouteMode::KvExact, T0 + 5).sign(&f.gw);
    let (w0, k0) = &f.workers[0];
    let (w1, k1) = &f.workers[1];
    append_decision(&f.decisions, &line(&first, 0, Some(DecisionPhase::Routed)));
    let log = ReceiptLog::open(&f.logs[0], FsyncPolicy::Always, k0, w0).unwrap();
    let mut refused = draft("busy", Some(first.clone()), T0);
    refused.status = 429;
    refused.error_code = Some("queue_full".into());
    log.append(refused).unwrap();
    drop(log);
    append_decision(
        &f.decisions,
        &line(&first, 429, Some(DecisionPhase::Retried)),
    );
    append_decision(&f.decisions, &line(&second, 0, Some(DecisionPhase::Routed)));
    let log = ReceiptLog::open(&f.logs[1], FsyncPolicy::Always, k1, w1).unwrap();
    log.append(draft("busy", Some(second.clone()), T0 + 5))
        .unwrap();
    drop(log);
    append_decision(&f.decisions, &line(&second, 200, None));
    let r = audit(&f.decisions, &f.logs, &f.keys).unwrap();
    assert!(r.ok(), "{r}");
    assert_eq!(
        (r.decisions, r.receipted, r.unfinished, r.retried_attempts),
        (before.decisions + 2, before.receipted + 2, 0, 1),
        "{r}"
    );
    assert!(r
        .to_string()
        .contains("attempts refused and retried on another worker 1"));
    // The retried line's status is checked against the refusing worker's receipt.
    let third = ticket("busy2", "w0", RouteMode::KvExact, T0).sign(&f.gw);
    let log = ReceiptLog::open(&f.logs[0], FsyncPolicy::Always, k0, w0).unwrap();
    let mut refused = draft("busy2", Some(third.clone()), T0);
    refused.status = 503;
    log.append(refused).unwrap();
    drop(log);
    let mut d = line(&third, 429, Some(DecisionPhase::Retried));
    d.request_id = "busy2".into();
    append_decision(&f.decisions, &d);
    let r = audit(&f.decisions, &f.logs, &f.keys).unwrap();
    assert_eq!(kinds(&r), vec![DiscrepancyKind::StatusMismatch], "{r}");
}

/// Usage per tenant: requests from the decision lines naming the tenant (retried attempts not
/// counted again), tokens from the matched receipts of work done (2xx and 499), none from a
/// refusal or an error answer.
#[test]
fn usage_per_tenant_counts_the_receipts_of_work_done() {
    let f = fleet(2);
    let (w0, k0) = &f.workers[0];
    let (w1, k1) = &f.workers[1];
    let line = |rid: &str, st: Option<&SignedTicket>, status: u16, tenant: &str| DecisionRecord {
        tenant: Some(tenant.into()),
        receipt_named: st.map(|_| true),
        ..decision(rid, st.cloned(), status, None)
    };
    let append = |i: usize, d: ReceiptDraft| {
        let (w, k) = if i == 0 { (w0, k0) } else { (w1, k1) };
        ReceiptLog::open(&f.logs[i], FsyncPolicy::Always, k, w)
            .unwrap()
            .append(d)
            .unwrap();
    };
    // acme 1: refused by w0 (429, retried), answered by w1 (48 prompt, 32 cached, 3 generated).
    let refused = ticket("a1", "w0", RouteMode::KvExact, T0).sign(&f.gw);
    let served = ticket("a1", "w1", RouteMode::KvExact, T0 + 5).sign(&f.gw);
    let mut r = draft("a1", Some(refused.clone()), T0);
    (r.status, r.completion_tokens) = (429, 0);
    append(0, r);
    append_decision(
        &f.decisions,
        &DecisionRecord {
            phase: Some(DecisionPhase::Retried),
            ..line("a1", Some(&refused), 429, "acme")
        },
    );
    append(1, draft("a1", Some(served.clone()), T0 + 5));
    append_decision(&f.decisions, &line("a1", Some(&served), 200, "acme"));
    // acme 2: the client went away after 2 tokens (499 receipt; the gateway records an error).
    let cut = ticket("a2", "w0", RouteMode::RoundRobin, T0).sign(&f.gw);
    let mut r = draft("a2", Some(cut.clone()), T0);
    (r.status, r.completion_tokens) = (499, 2);
    append(0, r);
    append_decision(
        &f.decisions,
        &DecisionRecord {
            error: Some("client disconnected".into()),
            ..line("a2", Some(&cut), 200, "acme")
        },
    );
    // acme 3: rate-limited by the gateway (no ticket).
    append_decision(&f.decisions, &line("a3", None, 429, "acme"));
    // beta: a 400 from the worker: a request, no tokens.
    let bad = ticket("b1", "w1", RouteMode::KvExact, T0).sign(&f.gw);
    let mut r = draft("b1", Some(bad.clone()), T0);
    (r.status, r.completion_tokens) = (400, 0);
    append(1, r);
    append_decision(&f.decisions, &line("b1", Some(&bad), 400, "beta"));
    let r = audit(&f.decisions, &f.logs, &f.keys).unwrap();
    assert!(r.ok(), "{r}");
    // 48 prompt tokens per receipt unless the ticket names a count (common::draft).
    let prompt = |st: &SignedTicket| u64::from(st.ticket_unverified().prompt_tokens.unwrap_or(48));
    assert_eq!(
        r.per_tenant["acme"],
        TenantUsage {
            requests: 3,
            unrouted: 1,
            answered: 1,
            disconnected: 1,
            prompt_tokens: prompt(&served) + prompt(&cut),
            cached_tokens: 64,
            completion_tokens: 5,
        },
        "{r}"
    );
    assert_eq!(
        r.per_tenant["beta"],
        TenantUsage {
            requests: 1,
            ..TenantUsage::default()
        },
        "{r}"
    );
    // Decisions without a tenant are in no tenant's usage.
    assert_eq!(r.per_tenant.len(), 2, "{r}");
    let text = r.to_string();
    assert!(
        text.contains("acme: requests 3 (unrouted 1), answered 1, disconnected 1"),
        "{text}"
    );
    let json = serde_json::to_value(&r).unwrap();
    assert_eq!(json["per_tenant"]["acme"]["completion_tokens"], 5, "{json}");
}

#[test]
fn a_worker_refusal_before_accepting_the_ticket_owes_no_receipt() {
    let f = fleet(2);
    // The worker answered 405 without naming a receipt: refused, not lost.
    let mut d = decision(
        "put",
        Some(ticket("put", "w1", RouteMode::RoundRobin, T0).sign(&f.gw)),
        405,
        None,
    );
    d.receipt_named = Some(false);
    append_decision(&f.decisions, &d);
    let r = audit(&f.decisions, &f.logs, &f.keys).unwrap();
    assert!(r.ok(), "{r}");
    assert_eq!(r.refused_by_worker, 1);
    assert_eq!(r.refused_requests[0].request_id, "put");
    assert!(r.to_string().contains("refused: request put"), "{r}");
    // A worker that named a receipt and wrote none is still a missing receipt.
    let mut d = decision(
        "named",
        Some(ticket("named", "w1", RouteMode::RoundRobin, T0).sign(&f.gw)),
        200,
        None,
    );
    d.receipt_named = Some(true);
    append_decision(&f.decisions, &d);
    let r = audit(&f.decisions, &f.logs, &f.keys).unwrap();
    assert_eq!(kinds(&r), vec![DiscrepancyKind::MissingReceipt]);
}

#[test]
fn unissued_ticket_and_duplicate_receipt() {
    let f = fleet(2);
    // A receipt carrying a gateway-signed ticket that the decision log does not have.
    let (w, k) = &f.workers[0];
    let log = ReceiptLog::open(&f.logs[0], FsyncPolicy::Always, k, w).unwrap();
    let st = ticket("ghost", "w0", RouteMode::KvExact, T0).sign(&f.gw);
    log.append(draft("ghost", Some(st), T0)).unwrap();
    drop(log);
    let r = audit(&f.decisions, &f.logs, &f.keys).unwrap();
    assert_eq!(kinds(&r), vec![DiscrepancyKind::UnissuedTicket], "{r}");

    // The same ticket receipted in two logs of w0 (e.g. a rotated log passed twice).
    let f = fleet(2);
    let mut logs = f.logs.clone();
    let copy = f.decisions.with_file_name("w0-copy.jsonl");
    std::fs::copy(&f.logs[0], &copy).unwrap();
    logs.push(copy);
    let r = audit(&f.decisions, &logs, &f.keys).unwrap();
    assert_eq!(kinds(&r), vec![DiscrepancyKind::DuplicateReceipt], "{r}");
}

#[test]
fn decision_disagreeing_with_its_ticket() {
    let f = fleet(0);
    let (w, k) = &f.workers[0];
    let st = ticket("r", w, RouteMode::KvExact, T0).sign(&f.gw);
    let log = ReceiptLog::open(&f.logs[0], FsyncPolicy::Always, k, w).unwrap();
    log.append(draft("r", Some(st.clone()), T0)).unwrap();
    drop(log);
    let mut d = decision("r", Some(st), 200, None);
    d.rule_version = Some(6);
    d.worker = Some("w1".into());
    append_decision(&f.decisions, &d);
    let r = audit(&f.decisions, &f.logs, &f.keys).unwrap();
    assert_eq!(
        kinds(&r),
        vec![DiscrepancyKind::DecisionTicketMismatch],
        "{r}"
    );
    let detail = &r.discrepancies[0].detail;
    assert!(
        detail.contains("rule_version") && detail.contains("worker"),
        "{detail}"
    );
}

#[test]
fn status_mismatch_duplicate_decision_bad_ticket_and_malformed_line() {
    let f = fleet(2);
    // Re-record req-0's ticket with another status: duplicate decision.
    let text = std::fs::read_to_string(&f.decisions).unwrap();
    let first: DecisionRecord =
        DecisionRecord::from_line(text.lines().next().unwrap().as_bytes()).unwrap();
    let mut dup = first.clone();
    dup.status = 500;
    append_decision(&f.decisions, &dup);
    // A decision whose ticket was signed by an unknown key.
    let rogue = KeyPair::generate();
    let st = ticket("rogue", "w0", RouteMode::RoundRobin, T0).sign(&rogue);
    append_decision(&f.decisions, &decision("rogue", Some(st), 200, None));
    // A garbage line.
    let mut bytes = std::fs::read(&f.decisions).unwrap();
    bytes.extend_from_slice(b"{\"not\":\"a decision\"}\n");
    std::fs::write(&f.decisions, bytes).unwrap();
    let r = audit(&f.decisions, &f.logs, &f.keys).unwrap();
    let mut k = kinds(&r);
    k.sort();
    assert_eq!(
        k,
        vec![
            DiscrepancyKind::DecisionMalformed,
            DiscrepancyKind::DecisionTicketInvalid,
            DiscrepancyKind::DuplicateDecision,
        ],
        "{r}"
    );
    let malformed = r
        .discrepancies
        .iter()
        .find(|d| d.kind == DiscrepancyKind::DecisionMalformed)
        .unwrap();
    assert!(malformed.location.ends_with(":6"), "{}", malformed.location);

    // Status disagreement between gateway and worker.
    let f = fleet(0);
    let (w, k) = &f.workers[1];
    let st = ticket("s", w, RouteMode::RoundRobin, T0).sign(&f.gw);
    let log = ReceiptLog::open(&f.logs[1], FsyncPolicy::Always, k, w).unwrap();
    log.append(draft("s", Some(st.clone()), T0)).unwrap();
    drop(log);
    append_decision(&f.decisions, &decision("s", Some(st), 503, None));
    let r = audit(&f.decisions, &f.logs, &f.keys).unwrap();
    assert_eq!(kinds(&r), vec![DiscrepancyKind::StatusMismatch], "{r}");
}

#[test]
fn tampered_receipt_log_is_a_discrepancy_with_its_line() {
    let f = fleet(4);
    let mut bytes = std::fs::read(&f.logs[1]).unwrap();
    let second_line = bytes.iter().position(|&b| b == b'\n').unwrap() + 1;
    bytes[second_line + 40] ^= 0x01;
    std::fs::write(&f.logs[1], bytes).unwrap();
    let r = audit(&f.decisions, &f.logs, &f.keys).unwrap();
    let first = &r.discrepancies[0];
    assert_eq!(first.kind, DiscrepancyKind::ReceiptLogInvalid);
    assert!(first.location.ends_with("w1.jsonl:2"), "{}", first.location);
    assert!(kinds(&r).contains(&DiscrepancyKind::MissingReceipt));
}

#[test]
fn prefix_parity_mismatch_reported_and_optionally_fatal() {
    let f = fleet(0);
    let (w, k) = &f.workers[0];
    let st = ticket("p", w, RouteMode::KvExact, T0).sign(&f.gw);
    let log = ReceiptLog::open(&f.logs[0], FsyncPolicy::Always, k, w).unwrap();
    let mut d = draft("p", Some(st.clone()), T0);
    d.last_block_key = Some(prefix_index::BlockKey(u64::MAX));
    log.append(d).unwrap();
    drop(log);
    append_decision(&f.decisions, &decision("p", Some(st), 200, None));
    let r = audit(&f.decisions, &f.logs, &f.keys).unwrap();
    assert!(r.ok(), "{r}");
    assert_eq!((r.parity.compared, r.parity.mismatched), (1, 1));
    assert!(r.to_string().contains("prefix_parity"), "{r}");
    let strict = AuditOptions {
        fail_on_parity_mismatch: true,
        ..AuditOptions::default()
    };
    let r = audit_with(&f.decisions, &f.logs, &f.keys, strict).unwrap();
    assert_eq!(kinds(&r), vec![DiscrepancyKind::PrefixParity]);
}

#[test]
fn a_request_the_worker_refused_unread_has_no_prefix_to_compare() {
    let f = fleet(0);
    let (w, k) = &f.workers[0];
    let st = ticket("q", w, RouteMode::KvExact, T0).sign(&f.gw);
    assert!(st.ticket_unverified().last_block_key.is_some());
    let log = ReceiptLog::open(&f.logs[0], FsyncPolicy::Always, k, w).unwrap();
    // Refused by the worker's validation (400) before it rendered the prompt: no tokens, no key.
    let mut d = draft("q", Some(st.clone()), T0);
    d.status = 400;
    d.error_code = Some("unsupported_parameter".into());
    d.prompt_tokens = 0;
    d.cached_tokens = 0;
    d.completion_tokens = 0;
    d.last_block_key = None;
    d.first_token_at_ms = None;
    log.append(d).unwrap();
    drop(log);
    append_decision(&f.decisions, &decision("q", Some(st), 400, None));
    let strict = AuditOptions {
        fail_on_parity_mismatch: true,
        ..AuditOptions::default()
    };
    let r = audit_with(&f.decisions, &f.logs, &f.keys, strict).unwrap();
    assert!(r.ok(), "{r}");
    assert_eq!(
        (
            r.parity.compared,
            r.parity.mismatched,
            r.parity.not_applicable
        ),
        (0, 0, 1),
        "{r}"
    );
}
