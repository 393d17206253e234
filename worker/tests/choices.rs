//! `n` choices through HTTP: each choice is its own sequence (seed + index), the choices share
//! the prompt's prefill through the prefix cache, usage counts the prompt once and every
//! choice's tokens, the receipt commits to every choice, and a refused choice frees the others.

mod server_support;

use serde_json::{json, Value};
use server_support::*;
use sha2::{Digest, Sha256};

/// A prompt of several blocks, so that the choices have a prefix to share.
fn long_prompt(tag: &str) -> String {
    format!(
        "{tag}: {}",
        "the quick brown fox jumps over the lazy dog. ".repeat(12)
    )
}

fn body(content: &str, extra: Value) -> Value {
    let mut b = json!({
        "model": "smollm2",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 16,
        "temperature": 1.0,
        "seed": 7
    });
    for (k, v) in extra.as_object().unwrap() {
        b[k] = v.clone();
    }
    b
}

fn metric(text: &str, name: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or_else(|| panic!("no {name} in\n{text}"))
}

fn texts(v: &Value) -> Vec<String> {
    v["choices"]
        .as_array()
        .unwrap_or_else(|| panic!("{v}"))
        .iter()
        .enumerate()
        .map(|(i, c)| {
            assert_eq!(c["index"], i, "{v}");
            c["message"]["content"]
                .as_str()
                .or(c["text"].as_str())
                .unwrap()
                .to_string()
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn n_choices_follow_their_seeds_share_the_prefill_and_are_receipted() {
    let w = start_sim(SimOpts::default()).await;
    let prompt = long_prompt("choices");
    let hits_before = metric(
        &metrics_text(&w).await,
        "kvgate_worker_prefix_hit_tokens_total",
    );
    let resp = client()
        .post(w.url("/v1/chat/completions"))
        .header("x-request-id", "n3")
        .json(&body(&prompt, json!({"n": 3})))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let v: Value = resp.json().await.unwrap();
    let got = texts(&v);
    assert_eq!(got.len(), 3);
    for c in v["choices"].as_array().unwrap() {
        assert_eq!(c["finish_reason"], "length");
    }
    let prompt_tokens = v["usage"]["prompt_tokens"].as_u64().unwrap();
    assert_eq!(v["usage"]["completion_tokens"], 48, "{v}");
    assert_eq!(
        v["usage"]["total_tokens"].as_u64(),
        Some(prompt_tokens + 48)
    );
    assert_eq!(v["usage"]["prompt_tokens_details"]["cached_tokens"], 0);

    // Choices 1 and 2 reused choice 0's prompt blocks instead of computing them again.
    let block = 16u64;
    let shared = (prompt_tokens - 1) / block * block;
    let hits = metric(
        &metrics_text(&w).await,
        "kvgate_worker_prefix_hit_tokens_total",
    ) - hits_before;
    assert!(
        hits >= (2 * shared) as f64,
        "{hits} hit tokens; 2 × {shared} expected"
    );

    // Choice i is the answer of the same request with n = 1 and seed 7 + i.
    for (i, text) in got.iter().enumerate() {
        let one = post_json(
            &w,
            "/v1/chat/completions",
            &body(&prompt, json!({"seed": 7 + i})),
        )
        .await;
        assert_eq!(&texts(&one)[0], text, "choice {i}");
    }
    assert!(got[0] != got[1] || got[1] != got[2], "{got:?}");

    // The receipt: the prompt once, every choice's tokens, a hash of the choices' hashes.
    let r = get_receipt(&w, "n3").await;
    assert_eq!(r.body.prompt_tokens as u64, prompt_tokens);
    assert_eq!(r.body.completion_tokens, 48);
    assert_eq!(r.body.finish_reason.as_deref(), Some("length"));
    let mut all = Sha256::new();
    for t in &got {
        all.update(Sha256::digest(t.as_bytes()));
    }
    assert_eq!(r.body.response_sha256, hex::encode(all.finalize()));

    // Streamed: every choice's role chunk first, its text, one finish; usage of all at the end.
    let chunks = post_sse_json(
        &w,
        "/v1/chat/completions",
        &body(
            &prompt,
            json!({"n": 3, "stream": true, "stream_options": {"include_usage": true}}),
        ),
    )
    .await;
    let mut streamed = vec![String::new(); 3];
    let mut finishes = [0; 3];
    let mut roles = [0; 3];
    for (k, c) in chunks.iter().enumerate() {
        let Some(choice) = c["choices"].as_array().unwrap().first() else {
            assert_eq!(k, chunks.len() - 1, "only the last chunk has no choice");
            assert_eq!(c["usage"]["completion_tokens"], 48);
            assert_eq!(c["usage"]["prompt_tokens"].as_u64(), Some(prompt_tokens));
            continue;
        };
        let i = choice["index"].as_u64().unwrap() as usize;
        assert!(finishes[i] == 0, "chunk after choice {i}'s finish");
        if choice["delta"]["role"] == "assistant" {
            roles[i] += 1;
            assert!(streamed[i].is_empty(), "role chunk of {i} not first");
        }
        assert_eq!(roles[i], 1, "choice {i} without its role chunk");
        if let Some(t) = choice["delta"]["content"].as_str() {
            streamed[i].push_str(t);
        }
        if !choice["finish_reason"].is_null() {
            finishes[i] += 1;
        }
    }
    assert_eq!(finishes, [1, 1, 1]);
    assert_eq!(streamed, got);

    // Completions, with log probabilities per choice.
    let c = post_json(
        &w,
        "/v1/completions",
        &json!({"model": "smollm2", "prompt": prompt, "max_tokens": 5, "n": 2,
                "temperature": 1.0, "seed": 3, "logprobs": 1}),
    )
    .await;
    assert_eq!(texts(&c).len(), 2);
    for choice in c["choices"].as_array().unwrap() {
        assert_eq!(choice["logprobs"]["tokens"].as_array().unwrap().len(), 5);
    }
    assert_eq!(c["usage"]["completion_tokens"], 10);
    w.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_choice_refuses_the_request_and_frees_the_others() {
    // One running sequence (a long stream holds it) and room for two waiting: of three
    // choices, the third is refused at submission.
    let w = start_sim(SimOpts {
        max_running: 1,
        max_waiting: 2,
        decode_us_base: 20_000,
        ..SimOpts::default()
    })
    .await;
    let long = client()
        .post(w.url("/v1/chat/completions"))
        .json(&body(
            "long one",
            json!({"max_tokens": 200, "stream": true}),
        ))
        .send()
        .await
        .unwrap();
    assert_eq!(long.status(), 200);
    let resp = client()
        .post(w.url("/v1/chat/completions"))
        .header("x-request-id", "n3-refused")
        .json(&body("x", json!({"n": 3})))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 429);
    assert!(resp.headers().contains_key("retry-after"));
    let e: Value = resp.json().await.unwrap();
    assert_eq!(e["error"]["code"], "queue_full", "{e}");
    assert_eq!(get_receipt(&w, "n3-refused").await.body.status, 429);
    // The two submitted choices were withdrawn: nothing waits, and once the long stream is
    // gone two choices are served, one after the other (one running at a time).
    wait_until(std::time::Duration::from_secs(10), || {
        w.worker.engine().stats().waiting == 0
    })
    .await;
    drop(long);
    let v = post_json(
        &w,
        "/v1/chat/completions",
        &body("x", json!({"n": 2, "max_tokens": 4})),
    )
    .await;
    assert_eq!(texts(&v).len(), 2);
    assert_eq!(v["usage"]["completion_tokens"], 8);
    wait_until(std::time::Duration::from_secs(10), || {
        let s = w.worker.engine().stats();
        s.waiting == 0 && s.running == 0
    })
    .await;
    w.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_model_choices_greedy_agree_and_each_json_choice_parses() {
    let w = start_sim(SimOpts {
        real_model: true,
        ..SimOpts::default()
    })
    .await;
    let ask = json!({
        "model": "smollm2",
        "messages": [
            {"role": "system", "content": "You are a concise assistant. Answer in one short sentence."},
            {"role": "user", "content": "What is the capital of France?"}
        ],
        "max_tokens": 12,
        "temperature": 0
    });
    let one = texts(&post_json(&w, "/v1/chat/completions", &ask).await);
    let mut three = ask.clone();
    three["n"] = json!(3);
    let got = texts(&post_json(&w, "/v1/chat/completions", &three).await);
    assert_eq!(
        got,
        vec![one[0].clone(); 3],
        "greedy choices are the greedy answer"
    );

    // JSON mode: each choice has its own automaton, and each answer parses.
    let mut json_mode = ask.clone();
    json_mode["messages"][1]["content"] =
        json!("What is the capital of France? Answer in JSON with keys city and country.");
    json_mode["response_format"] = json!({"type": "json_object"});
    json_mode["n"] = json!(2);
    json_mode["max_tokens"] = json!(40);
    json_mode["temperature"] = json!(0.7);
    json_mode["seed"] = json!(11);
    let v = post_json(&w, "/v1/chat/completions", &json_mode).await;
    for (i, t) in texts(&v).iter().enumerate() {
        if v["choices"][i]["finish_reason"] == "stop" {
            let parsed: Value = serde_json::from_str(t).unwrap_or_else(|e| panic!("{e}: {t}"));
            assert!(parsed.is_object(), "{t}");
        }
    }
    assert!(
        v["choices"]
            .as_array()
            .unwrap()
            .iter()
            .any(|c| c["finish_reason"] == "stop"),
        "{v}"
    );
    w.stop().await;
}
