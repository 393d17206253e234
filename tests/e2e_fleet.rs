//! End to end with the real model: a pingora gateway in front of two SmolLM2 workers
//! (`EngineChoice::Model`, 64 MiB of KV cache and one compute thread each), all in this process
//! on ephemeral 127.0.0.1 ports. The workers require route tickets signed by the gateway's key;
//! the gateway writes a decision log; each worker signs a hash-chained receipt log.
//!
//! One test drives one fleet through three phases (the model load dominates the cost, so the
//! phases share it):
//! 1. **Chat through both services**, streaming and not: the round-robin service
//!    (`model` = `smol-rr`) alternates workers; on the KV-exact service (`model` = `smol`) the
//!    second turn of a conversation lands on the worker that served the first and reports
//!    `cached_tokens > 0`. Every answer is non-empty and carries a consistent `usage`.
//! 2. **The receipts audit passes** over the decision log and both receipt logs, as a library
//!    call (`receipts::audit`, plus `receipts::verify_log` per log) and through the CLI
//!    (`kvgate receipts audit`): zero discrepancies, every decision receipted.
//! 3. **A worker killed mid-run**: while it generates two answers (one streamed, one not) it is
//!    killed like `kill -9` (its runtime dropped: no answer, no receipt — see
//!    `e2e_support::Fleet::kill_worker`). Both clients see a failure; the requests that follow
//!    (both services, streaming and not, one continuing a conversation cached on the dead
//!    worker) are served by the survivor; the audit reports exactly the two killed requests as
//!    routed decisions without a receipt, and nothing else.
//! 4. **A graceful stop** (`RunningWorker::shutdown`) of the last worker while it generates two
//!    answers: both clients get the worker's `engine_stopped` error (503, or in-band on the
//!    stream), both requests are receipted with that code, and the audit's verdict is unchanged.
//!
//! Model-backed answers use `max_tokens` ≤ 8, except the four requests in flight at a kill or stop,
//! which ask for a long answer so that they are certainly still generating when the worker goes
//! (they cost only the tokens generated before it does).

mod e2e_support;

use std::collections::{BTreeMap, BTreeSet};
use std::process::Command;
use std::time::{Duration, Instant};

use e2e_support::{open, send, Chat, ChatReply, Fleet, Opened, KV_MODEL, RR_MODEL, WORKER_IDS};

/// `max_tokens` of every request that is expected to complete.
const MAX_TOKENS: u32 = 8;
/// `max_tokens` of the requests that are in flight when a worker is killed.
const LONG_TOKENS: u32 = 200;
/// The output of the request killed with its worker (N1): long enough that it is still
/// generating when the kill comes on a loaded machine (at 200 tokens, one CI run saw it finish
/// between the check that it runs and the kill). 108 + 600 tokens fit the KV budget beside S1.
const KILLED_TOKENS: u32 = 600;

fn msg(role: &str, content: &str) -> (String, String) {
    (role.to_owned(), content.to_owned())
}

const SYSTEM_A: &str = "You are a concise assistant for a geography quiz. Answer every question \
                        in one short sentence, without lists, and never repeat the question.";
const SYSTEM_B: &str = "You are a patient cooking teacher. Give practical answers in plain \
                        words, one short sentence at a time, and never use bullet points.";

/// Runs `kvgate receipts audit` over the fleet's logs; returns (exit code, stdout + stderr).
fn cli_audit(fleet: &Fleet) -> (i32, String) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_kvgate"));
    cmd.args(["receipts", "audit", "--decisions"])
        .arg(&fleet.decision_log)
        .arg("--receipts")
        .args(fleet.receipt_logs())
        .arg("--keys")
        .arg(&fleet.keys_dir);
    let out = cmd.output().expect("run kvgate receipts audit");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.code().unwrap_or(-1), text)
}

/// Every receipt log verifies on its own (signatures, chain, sequence, embedded tickets).
fn assert_logs_verify(fleet: &Fleet) {
    let ring = fleet.key_ring();
    for log in fleet.receipt_logs() {
        let rep = receipts::verify_log(&log, &ring).expect("read receipt log");
        assert!(rep.ok(), "{} does not verify:\n{rep}", log.display());
        assert!(rep.valid > 0, "{} holds no receipt", log.display());
    }
}

/// Sends one request, remembering its id in `sent`.
fn chat(fleet: &Fleet, sent: &mut Vec<String>, c: Chat) -> ChatReply {
    sent.push(c.request_id.clone());
    fleet.block_on(send(&fleet.http, &fleet.base_url(), &c))
}

#[test]
fn gateway_two_real_workers_receipts_and_a_killed_worker() {
    let t0 = Instant::now();
    let mut fleet = Fleet::start();
    println!("fleet up in {:.1} s", t0.elapsed().as_secs_f64());
    let mut sent: Vec<String> = Vec::new();

    // ---- Phase 1a: round robin alternates workers, streaming and not.
    let questions = [
        "What is the capital of France?",
        "Name a large ocean.",
        "What colour is the sky on a clear day?",
        "How many legs does a spider have?",
    ];
    let mut rr = Vec::new();
    for (i, q) in questions.iter().enumerate() {
        let c = Chat::new(
            RR_MODEL,
            &format!("e2e-rr-{i}"),
            &[msg("user", q)],
            MAX_TOKENS,
            i % 2 == 1,
        );
        let r = chat(&fleet, &mut sent, c);
        r.assert_complete(MAX_TOKENS);
        assert_eq!(r.reason.as_deref(), Some("round_robin"), "{r:?}");
        println!(
            "rr {i} ({}) on {:?}: {:?}",
            if i % 2 == 1 { "stream" } else { "json" },
            r.worker,
            r.text
        );
        rr.push(r);
    }
    let rr_workers: Vec<String> = rr
        .iter()
        .map(|r| r.worker.clone().expect("worker header"))
        .collect();
    assert_ne!(
        rr_workers[0], rr_workers[1],
        "round robin did not alternate: {rr_workers:?}"
    );
    assert_eq!(
        rr_workers[2], rr_workers[0],
        "round robin did not alternate: {rr_workers:?}"
    );
    assert_eq!(
        rr_workers[3], rr_workers[1],
        "round robin did not alternate: {rr_workers:?}"
    );

    // ---- Phase 1b: KV-exact keeps each conversation on the worker that caches its prefix.
    // Conversation A: turn 1 JSON, turn 2 streamed; B the other way round; interleaved.
    let mut hist_a = vec![
        msg("system", SYSTEM_A),
        msg("user", "Which river flows through Cairo?"),
    ];
    let mut hist_b = vec![
        msg("system", SYSTEM_B),
        msg("user", "How long should I boil an egg?"),
    ];
    let a1 = chat(
        &fleet,
        &mut sent,
        Chat::new(KV_MODEL, "e2e-kv-a1", &hist_a, MAX_TOKENS, false),
    );
    a1.assert_complete(MAX_TOKENS);
    let b1 = chat(
        &fleet,
        &mut sent,
        Chat::new(KV_MODEL, "e2e-kv-b1", &hist_b, MAX_TOKENS, true),
    );
    b1.assert_complete(MAX_TOKENS);
    let owner_a = a1.worker.clone().expect("worker header");
    let owner_b = b1.worker.clone().expect("worker header");
    // The next turn may only be routed once the worker's KV events reached the gateway's index.
    fleet.wait_prompt_indexed(&hist_a);
    fleet.wait_prompt_indexed(&hist_b);
    hist_a.push(msg("assistant", &a1.text));
    hist_a.push(msg("user", "And which sea does it flow into?"));
    hist_b.push(msg("assistant", &b1.text));
    hist_b.push(msg("user", "And how do I peel it easily?"));
    let a2 = chat(
        &fleet,
        &mut sent,
        Chat::new(KV_MODEL, "e2e-kv-a2", &hist_a, MAX_TOKENS, true),
    );
    let b2 = chat(
        &fleet,
        &mut sent,
        Chat::new(KV_MODEL, "e2e-kv-b2", &hist_b, MAX_TOKENS, false),
    );
    for (turn1, turn2, owner) in [(&a1, &a2, &owner_a), (&b1, &b2, &owner_b)] {
        turn2.assert_complete(MAX_TOKENS);
        println!(
            "kv {} on {owner} ({:?}, cached {}) then {} on {:?} ({:?}, cached {} of {})",
            turn1.request_id,
            turn1.reason,
            turn1.cached_tokens(),
            turn2.request_id,
            turn2.worker,
            turn2.reason,
            turn2.cached_tokens(),
            turn2
                .usage
                .as_ref()
                .map_or(0, |u| u["prompt_tokens"].as_u64().unwrap_or(0)),
        );
        assert_eq!(
            turn2.worker.as_ref(),
            Some(owner),
            "{} left its conversation's worker",
            turn2.request_id
        );
        assert_eq!(turn2.reason.as_deref(), Some("hit"), "{turn2:?}");
        assert!(
            turn2.cached_tokens() >= 16,
            "{} reused no cached block: {:?}",
            turn2.request_id,
            turn2.usage
        );
    }

    // ---- Phase 2: the audit passes (library and CLI).
    let decisions = fleet.wait_decisions(sent.len());
    let logged: Vec<&str> = decisions.iter().map(|d| d.request_id.as_str()).collect();
    assert_eq!(
        logged, sent,
        "the decision log does not hold exactly the requests sent"
    );
    assert_logs_verify(&fleet);
    let rep = receipts::audit(
        &fleet.decision_log,
        &fleet.receipt_logs(),
        &fleet.key_ring(),
    )
    .expect("audit");
    println!("{rep}");
    assert!(rep.ok(), "audit failed:\n{rep}");
    assert_eq!(rep.decisions, sent.len() as u64);
    assert_eq!(rep.routed, sent.len() as u64);
    assert_eq!(rep.receipted, sent.len() as u64);
    assert_eq!(rep.failed_without_receipt, 0);
    assert_eq!(rep.direct_receipts, 0);
    assert_eq!(rep.per_mode.get("round_robin"), Some(&4));
    assert_eq!(rep.per_mode.get("kv_exact"), Some(&4));
    // The gateway tokenized every kv_exact prompt exactly as the worker did.
    assert_eq!(
        (rep.parity.compared, rep.parity.mismatched),
        (4, 0),
        "{rep}"
    );
    let (code, out) = cli_audit(&fleet);
    println!("{out}");
    assert_eq!(code, 0, "kvgate receipts audit failed:\n{out}");
    assert!(out.contains("audit: OK"), "{out}");

    // ---- Phase 3: kill the worker holding conversation A while it generates two answers.
    let victim = owner_a.clone();
    let survivor = WORKER_IDS
        .iter()
        .find(|w| **w != victim)
        .map(|w| (*w).to_owned())
        .expect("two workers");
    let idle = fleet.engine_stats(&victim);
    assert_eq!(
        idle.running + idle.waiting,
        0,
        "{victim} is not idle: {idle:?}"
    );
    // N1: a non-streaming KV-exact turn of conversation A (a hit on the victim).
    hist_a.push(msg("assistant", &a2.text));
    hist_a.push(msg("user", "Now count from 1 to 100, separated by commas."));
    let mut n1 = Chat::new(KV_MODEL, "e2e-kill-n1", &hist_a, KILLED_TOKENS, false);
    // It must still be generating at the kill: the model's own answer may end (eos) after
    // ~130 tokens, before a loaded machine got S1 going (seen once in CI), so it runs to
    // KILLED_TOKENS.
    n1.min_tokens = Some(KILLED_TOKENS);
    sent.push(n1.request_id.clone());
    let n1_task = {
        let (http, base) = (fleet.http.clone(), fleet.base_url());
        fleet
            .ctl
            .spawn(async move { send(&http, &base, &n1).await })
    };
    fleet.wait_for("N1 running on the victim", Duration::from_secs(20), || {
        fleet.engine_stats(&victim).running >= 1
    });
    // S1: a streamed round-robin request; round robin's next pick is rr_workers[0] (four
    // alternating picks so far), so first spend one pick on the survivor if needed.
    if rr_workers[0] != victim {
        let c = Chat::new(
            RR_MODEL,
            "e2e-rr-filler",
            &[msg("user", "Say hello.")],
            MAX_TOKENS,
            false,
        );
        let r = chat(&fleet, &mut sent, c);
        r.assert_complete(MAX_TOKENS);
        assert_eq!(r.worker.as_deref(), Some(survivor.as_str()), "{r:?}");
    }
    let s1 = Chat::new(
        RR_MODEL,
        "e2e-kill-s1",
        &[msg("user", "Count from 1 to 100, separated by commas.")],
        LONG_TOKENS,
        true,
    );
    sent.push(s1.request_id.clone());
    let mut s1_stream = match fleet.block_on(open(&fleet.http, &fleet.base_url(), &s1)) {
        Opened::Stream(s) => s,
        Opened::Whole(r) => panic!("S1 was not streamed: {r:?}"),
    };
    assert_eq!(
        s1_stream.reply.worker.as_deref(),
        Some(victim.as_str()),
        "S1 not on the victim"
    );
    assert!(
        fleet.block_on(s1_stream.read_first_content()),
        "S1 ended before its first token"
    );
    fleet.wait_for(
        "N1 and S1 generating on the victim",
        Duration::from_secs(20),
        || fleet.engine_stats(&victim).running == 2,
    );
    let killed_at = Instant::now();
    fleet.kill_worker(&victim);
    println!(
        "killed {victim} in {:.0} ms",
        killed_at.elapsed().as_secs_f64() * 1e3
    );

    // Both in-flight clients see a failure, and nobody answered them from the other worker.
    let n1_reply = fleet.block_on(n1_task).expect("N1 task");
    println!("N1 after the kill: {n1_reply:?}");
    assert!(
        n1_reply.status >= 500 || n1_reply.error.is_some(),
        "N1 did not fail: {n1_reply:?}"
    );
    assert_ne!(
        n1_reply.worker.as_deref(),
        Some(survivor.as_str()),
        "N1 was re-sent to {survivor}"
    );
    fleet.block_on(s1_stream.read_to_end());
    println!("S1 after the kill: {:?}", s1_stream.reply);
    assert!(
        !s1_stream.reply.done,
        "S1 completed although its worker was killed"
    );

    // The following requests go to the survivor and succeed (the first one right away, before
    // the gateway's health check can have noticed: a connect failure moves it on).
    let follow = [
        Chat::new(
            RR_MODEL,
            "e2e-after-rr-json",
            &[msg("user", "Name a fruit.")],
            MAX_TOKENS,
            false,
        ),
        Chat::new(
            RR_MODEL,
            "e2e-after-rr-stream",
            &[msg("user", "Name a colour.")],
            MAX_TOKENS,
            true,
        ),
        Chat::new(
            KV_MODEL,
            "e2e-after-kv-a",
            &[
                msg("system", SYSTEM_A),
                msg("user", "Which river flows through Cairo? Answer again."),
            ],
            MAX_TOKENS,
            false,
        ),
        Chat::new(KV_MODEL, "e2e-after-kv-b", &hist_b, MAX_TOKENS, true),
    ];
    for c in follow {
        let r = chat(&fleet, &mut sent, c);
        r.assert_complete(MAX_TOKENS);
        assert_eq!(r.worker.as_deref(), Some(survivor.as_str()), "{r:?}");
    }

    // ---- The audit reports exactly the two killed requests, and nothing else.
    let killed: BTreeSet<&str> = ["e2e-kill-n1", "e2e-kill-s1"].into();
    let decisions = fleet.wait_decisions(sent.len());
    let logged: BTreeSet<&str> = decisions.iter().map(|d| d.request_id.as_str()).collect();
    assert_eq!(
        logged,
        sent.iter().map(String::as_str).collect::<BTreeSet<_>>()
    );
    let by_id: BTreeMap<&str, &receipts::DecisionRecord> = decisions
        .iter()
        .map(|d| (d.request_id.as_str(), d))
        .collect();
    for id in &killed {
        let d = by_id[id];
        assert_eq!(
            d.worker.as_ref().map(|w| w.as_str()),
            Some(victim.as_str()),
            "{id}: {d:?}"
        );
        assert!(d.ticket.is_some(), "{id} was not routed: {d:?}");
    }
    // Requests that have a receipt, across both logs (receipts carry the gateway's ids).
    let client_of = fleet.client_ids();
    let receipted: BTreeSet<String> = fleet
        .receipt_logs()
        .iter()
        .flat_map(|l| e2e_support::read_receipts(l))
        .filter(|r| r.body.ticket.is_some())
        .filter_map(|r| client_of.get(&r.body.request_id).cloned())
        .collect();
    let without_receipt: BTreeSet<&str> = decisions
        .iter()
        .filter(|d| d.ticket.is_some() && !receipted.contains(&d.request_id))
        .map(|d| d.request_id.as_str())
        .collect();
    assert_eq!(without_receipt, killed, "decisions without a receipt");
    let gateway_errors: BTreeSet<&str> = decisions
        .iter()
        .filter(|d| d.error.is_some())
        .map(|d| d.request_id.as_str())
        .collect();
    assert_eq!(
        gateway_errors, killed,
        "decisions the gateway recorded as failed"
    );

    assert_logs_verify(&fleet);
    let rep = receipts::audit(
        &fleet.decision_log,
        &fleet.receipt_logs(),
        &fleet.key_ring(),
    )
    .expect("audit");
    println!("{rep}");
    assert!(rep.discrepancies.is_empty(), "audit after the kill:\n{rep}");
    assert_eq!(rep.routed, sent.len() as u64);
    assert_eq!(rep.failed_without_receipt, killed.len() as u64, "{rep}");
    assert_eq!(rep.receipted, (sent.len() - killed.len()) as u64, "{rep}");
    // The audit itself names exactly the killed requests.
    let listed: BTreeSet<&str> = rep
        .failed_requests
        .iter()
        .filter_map(|f| client_of.get(&f.request_id).map(String::as_str))
        .collect();
    assert_eq!(listed, killed, "audit's failed requests:\n{rep}");
    assert!(
        rep.failed_requests.iter().all(|f| f.worker == victim),
        "{rep}"
    );
    let (code, out) = cli_audit(&fleet);
    println!("{out}");
    assert_eq!(code, 0, "kvgate receipts audit failed:\n{out}");
    assert!(out.contains("failed upstream without receipt 2"), "{out}");
    for id in &killed {
        assert!(
            out.contains(&format!("(client {id}) on worker {victim}")),
            "{out}"
        );
    }

    // ---- Phase 4: a graceful stop (`RunningWorker::shutdown`) of the last worker while it
    // generates two answers: both clients get the worker's `engine_stopped` error, both requests
    // are receipted, and the audit's verdict does not change.
    let idle = fleet.engine_stats(&survivor);
    assert_eq!(
        idle.running + idle.waiting,
        0,
        "{survivor} is not idle: {idle:?}"
    );
    let mut hist_c = hist_b.clone();
    hist_c.push(msg("user", "Now count from 1 to 100, separated by commas."));
    let g1 = Chat::new(KV_MODEL, "e2e-stop-g1", &hist_c, LONG_TOKENS, false);
    sent.push(g1.request_id.clone());
    let g1_task = {
        let (http, base) = (fleet.http.clone(), fleet.base_url());
        fleet
            .ctl
            .spawn(async move { send(&http, &base, &g1).await })
    };
    fleet.wait_for(
        "G1 running on the last worker",
        Duration::from_secs(20),
        || fleet.engine_stats(&survivor).running >= 1,
    );
    let g2 = Chat::new(
        RR_MODEL,
        "e2e-stop-g2",
        &[msg("user", "Count from 1 to 100, separated by commas.")],
        LONG_TOKENS,
        true,
    );
    sent.push(g2.request_id.clone());
    let mut g2_stream = match fleet.block_on(open(&fleet.http, &fleet.base_url(), &g2)) {
        Opened::Stream(s) => s,
        Opened::Whole(r) => panic!("G2 was not streamed: {r:?}"),
    };
    assert_eq!(
        g2_stream.reply.worker.as_deref(),
        Some(survivor.as_str()),
        "G2 not on {survivor}"
    );
    assert!(
        fleet.block_on(g2_stream.read_first_content()),
        "G2 ended before its first token"
    );
    fleet.wait_for(
        "G1 and G2 generating on the last worker",
        Duration::from_secs(20),
        || fleet.engine_stats(&survivor).running == 2,
    );
    let stopping = Instant::now();
    fleet.stop_worker(&survivor);
    println!(
        "stopped {survivor} gracefully in {:.0} ms",
        stopping.elapsed().as_secs_f64() * 1e3
    );
    let g1_reply = fleet.block_on(g1_task).expect("G1 task");
    println!("G1 after the stop: {g1_reply:?}");
    assert_eq!(g1_reply.status, 503, "{g1_reply:?}");
    assert_eq!(
        g1_reply.error.as_deref(),
        Some("engine_stopped"),
        "{g1_reply:?}"
    );
    fleet.block_on(g2_stream.read_to_end());
    println!("G2 after the stop: {:?}", g2_stream.reply);
    assert!(
        !g2_stream.reply.done,
        "G2 completed although its worker stopped"
    );
    assert!(
        g2_stream
            .reply
            .error
            .as_deref()
            .is_some_and(|e| e.contains("engine_stopped")),
        "G2 did not get the in-band engine_stopped error: {:?}",
        g2_stream.reply
    );
    let decisions = fleet.wait_decisions(sent.len());
    assert_eq!(decisions.len(), sent.len());
    let client_of = fleet.client_ids();
    let stopped: BTreeMap<String, receipts::Receipt> =
        e2e_support::read_receipts(&fleet.host(&survivor).receipt_log)
            .into_iter()
            .filter_map(|r| client_of.get(&r.body.request_id).cloned().map(|c| (c, r)))
            .filter(|(c, _)| c.starts_with("e2e-stop-"))
            .collect();
    for (id, status) in [("e2e-stop-g1", 503), ("e2e-stop-g2", 200)] {
        let r = stopped
            .get(id)
            .unwrap_or_else(|| panic!("no receipt for {id}"));
        assert_eq!(
            r.body.error_code.as_deref(),
            Some("engine_stopped"),
            "{id}: {r:?}"
        );
        assert_eq!(r.body.status, status, "{id}: {r:?}");
    }
    assert_logs_verify(&fleet);
    let rep = receipts::audit(
        &fleet.decision_log,
        &fleet.receipt_logs(),
        &fleet.key_ring(),
    )
    .expect("audit");
    println!("{rep}");
    assert!(
        rep.discrepancies.is_empty(),
        "audit after the graceful stop:\n{rep}"
    );
    assert_eq!(rep.routed, sent.len() as u64);
    assert_eq!(rep.failed_without_receipt, killed.len() as u64, "{rep}");
    assert_eq!(rep.receipted, (sent.len() - killed.len()) as u64, "{rep}");

    fleet.stop();
    println!("e2e fleet test: {:.1} s", t0.elapsed().as_secs_f64());
}

#[path = "python_support/mod.rs"]
mod python_support;

/// The official `openai` client's tool-calling flow (tests/openai_tools.py) through the gateway's
/// KV-exact service: the gateway renders the `tools` and the `tool_calls` history exactly as the
/// worker does (the ticket's prompt tokens equal the receipt's, checked by the audit), and the
/// worker parses the model's Hermes call into `tool_calls`.
#[test]
fn openai_tool_calling_flow_through_the_gateway() {
    let mut fleet = Fleet::start();
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/openai_tools.py");
    let out = Command::new(python_support::python())
        .arg(&script)
        .arg(fleet.base_url() + "/v1")
        .arg(KV_MODEL)
        .arg("gateway")
        .output()
        .expect("python3 must be installed");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "openai_tools.py through the gateway failed\nstdout:\n{stdout}\nstderr:\n{stderr}"
    );
    assert!(stdout.contains("tool flow ok"), "{stdout}");
    assert!(stdout.contains("forced calls ok"), "{stdout}");
    assert!(stdout.contains("stored responses flow ok"), "{stdout}");
    println!("{stdout}");
    // The script sends seven chat requests and three Responses API requests (one continuing a
    // stored response); each was routed, answered and receipted, and the gateway's prompt
    // (tools and tool-call history rendered, the stored conversation included) is the worker's.
    let decisions = fleet.wait_decisions(10);
    assert_eq!(decisions.len(), 10, "{decisions:?}");
    let rep = receipts::audit(
        &fleet.decision_log,
        &fleet.receipt_logs(),
        &fleet.key_ring(),
    )
    .expect("audit");
    assert!(rep.ok(), "audit failed:\n{rep}");
    assert_eq!(rep.receipted, 10, "{rep}");
    assert_eq!(
        (rep.parity.compared, rep.parity.mismatched),
        (10, 0),
        "{rep}"
    );
    fleet.stop();
}
