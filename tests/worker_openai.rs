//! The official `openai` Python client against a real SmolLM2 worker started in-process:
//! runs `tests/openai_client.py` with `python3` (non-streaming, streaming, completions, an
//! unsupported parameter). Needs the model file and `python3 -m pip install openai`; fails with
//! a clear message when either is missing.

#[path = "python_support/mod.rs"]
mod python_support;

use std::path::PathBuf;
use std::time::Duration;

use receipts::KeyPair;
use worker::{EngineChoice, WorkerConfig};

fn model_path() -> PathBuf {
    let dir = std::env::var_os("KVGATE_MODEL_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("models"));
    let p = dir.join("SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(
        p.is_file(),
        "model file {} is missing: run scripts/fetch-model.sh (or set KVGATE_MODEL_DIR)",
        p.display()
    );
    p
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn official_openai_python_client_talks_to_a_real_worker() {
    let check = std::process::Command::new(python_support::python())
        .args(["-c", "import openai"])
        .output()
        .expect("python3 must be installed");
    assert!(
        check.status.success(),
        "the `openai` Python package is missing: python3 -m pip install openai"
    );
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = WorkerConfig::new(
        model_path(),
        EngineChoice::Model {
            kv_budget_bytes: 64 << 20,
            threads: 0,
            cuda: false,
        },
        KeyPair::generate(),
        dir.path().join("receipts.jsonl"),
        "w-openai",
    );
    // SmolLM2 writes Hermes-style calls when shown them (its template names no format).
    cfg.settings.tool_call_parser = Some(worker::output_parser::ToolCallFormat::Hermes);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let w = worker::spawn(cfg, listener).await.unwrap();
    w.wait_ready(Duration::from_secs(300)).await.unwrap();
    let base = format!("http://{}/v1", w.addr());
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/openai_client.py");
    let out = tokio::task::spawn_blocking(move || {
        std::process::Command::new(python_support::python())
            .arg(script)
            .arg(base)
            .output()
    })
    .await
    .unwrap()
    .expect("run python3");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    println!("{stdout}");
    assert!(
        out.status.success(),
        "openai client failed:\nstdout:\n{stdout}\nstderr:\n{stderr}"
    );
    assert!(stdout.contains("all checks passed"));

    // The tool-calling flow: tools → tool_calls → tool result → answer.
    let base = format!("http://{}/v1", w.addr());
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/openai_tools.py");
    let out = tokio::task::spawn_blocking(move || {
        std::process::Command::new(python_support::python())
            .arg(script)
            .arg(base)
            .arg("smollm2")
            .output()
    })
    .await
    .unwrap()
    .expect("run python3");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    println!("{stdout}");
    w.shutdown().await;
    assert!(
        out.status.success(),
        "openai tool flow failed:\nstdout:\n{stdout}\nstderr:\n{stderr}"
    );
    assert!(stdout.contains("tool flow ok"));
}
