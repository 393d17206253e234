//! The worker server on the real SmolLM2 model (one worker for the whole file: loading takes
//! seconds): readiness after the smoke inference, greedy answers that are repeatable, streamed
//! text equal to the non-streamed text, and prefix reuse reported as cached tokens.

mod server_support;

use serde_json::{json, Value};
use server_support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_model_worker_answers_streams_and_reuses_prefixes() {
    let opts = SimOpts {
        real_model: true,
        ..SimOpts::default()
    };
    let w = start_sim(opts).await;
    let p: Value = client()
        .get(w.url("/v1/profile"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(p["engine"], "model");
    let body = json!({
        "model": "smollm2",
        "messages": [
            {"role": "system", "content": "You are a concise assistant. Answer in one short sentence."},
            {"role": "user", "content": "What is the capital of France?"}
        ],
        "max_tokens": 12,
        "temperature": 0
    });
    let a: Value = client()
        .post(w.url("/v1/chat/completions"))
        .json(&body)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let text_a = a["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(!text_a.trim().is_empty(), "{a}");
    assert!(text_a.contains("Paris"), "{text_a}");
    assert_eq!(a["usage"]["prompt_tokens_details"]["cached_tokens"], 0);

    // Same request again: greedy ⇒ same text; the prompt's full blocks come from the cache.
    let b: Value = client()
        .post(w.url("/v1/chat/completions"))
        .json(&body)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(
        b["choices"][0]["message"]["content"],
        a["choices"][0]["message"]["content"]
    );
    let prompt = b["usage"]["prompt_tokens"].as_u64().unwrap();
    let cached = b["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(
        cached >= 16 && cached < prompt,
        "cached {cached} of {prompt}"
    );

    // Streaming gives the same text.
    let mut sbody = body.clone();
    sbody["stream"] = json!(true);
    let resp = client()
        .post(w.url("/v1/chat/completions"))
        .json(&sbody)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let events = read_sse(resp).await;
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    let streamed: String = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str::<Value>(e).unwrap())
        .filter_map(|c| {
            c["choices"][0]["delta"]["content"]
                .as_str()
                .map(str::to_string)
        })
        .collect();
    assert_eq!(streamed, text_a);
    w.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_and_sglang_output_extensions_shape_real_answers() {
    let w = start_sim(SimOpts {
        real_model: true,
        ..SimOpts::default()
    })
    .await;
    let ask = |extra: Value| {
        let mut body = json!({
            "model": "smollm2",
            "messages": [
                {"role": "system", "content": "You are a concise assistant. Answer in one short sentence."},
                {"role": "user", "content": "What is the capital of France?"}
            ],
            "max_tokens": 40,
            "temperature": 0
        });
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        let url = w.url("/v1/chat/completions");
        async move {
            let r: Value = client()
                .post(url)
                .json(&body)
                .send()
                .await
                .unwrap()
                .json()
                .await
                .unwrap();
            let text = r["choices"][0]["message"]["content"]
                .as_str()
                .unwrap_or_else(|| panic!("{r}"))
                .to_string();
            let finish = r["choices"][0]["finish_reason"]
                .as_str()
                .unwrap()
                .to_string();
            let n = r["usage"]["completion_tokens"].as_u64().unwrap();
            (text, finish, n)
        }
    };
    let (plain, finish, n) = ask(json!({})).await;
    assert_eq!(
        finish, "stop",
        "the model ends its sentence with eos: {plain}"
    );
    assert!(plain.contains("Paris") && n < 30, "{plain} ({n} tokens)");

    // ignore_eos: eos is generated (and counted) but does not end the answer; with
    // skip_special_tokens false its text is shown.
    let (shown, finish, m) = ask(json!({"ignore_eos": true, "skip_special_tokens": false,
                                       "max_tokens": n + 4}))
    .await;
    assert_eq!((finish.as_str(), m), ("length", n + 4));
    assert!(
        shown.starts_with(&format!("{plain}<|im_end|>")),
        "{shown:?}"
    );
    let (hidden, _, _) = ask(json!({"ignore_eos": true, "max_tokens": n + 4})).await;
    assert!(
        hidden.starts_with(&plain) && !hidden.contains("<|im_end|>"),
        "{hidden:?}"
    );

    // min_tokens: eos cannot end it before; the first n-1 tokens are the plain answer's.
    let (longer, _, k) = ask(json!({"min_tokens": n + 3})).await;
    assert!(k >= n + 3, "{k} < {}", n + 3);
    assert_ne!(longer, plain);

    // no_stop_trim / include_stop_str_in_output keep the stop string.
    let (cut, finish, _) = ask(json!({"stop": ["Paris"]})).await;
    assert_eq!(finish, "stop");
    assert!(!cut.contains("Paris") && plain.starts_with(&cut), "{cut:?}");
    let (kept, _, _) = ask(json!({"stop": ["Paris"], "no_stop_trim": true})).await;
    assert_eq!(kept, format!("{cut}Paris"));
    let (kept2, _, _) = ask(json!({"stop": ["Paris"], "include_stop_str_in_output": true})).await;
    assert_eq!(kept2, kept);
    w.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logprobs_of_real_answers_are_consistent_streamed_or_not() {
    let w = start_sim(SimOpts {
        real_model: true,
        ..SimOpts::default()
    })
    .await;
    let body = json!({
        "model": "smollm2",
        "messages": [{"role": "user", "content": "Name a color."}],
        "max_tokens": 6, "temperature": 0, "ignore_eos": true,
        "logprobs": true, "top_logprobs": 3
    });
    let r: Value = client()
        .post(w.url("/v1/chat/completions"))
        .json(&body)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let content = r["choices"][0]["logprobs"]["content"]
        .as_array()
        .unwrap_or_else(|| panic!("{r}"))
        .clone();
    assert_eq!(content.len(), 6, "one entry per generated token: {r}");
    let mut joined = String::new();
    for e in &content {
        let lp = e["logprob"].as_f64().unwrap();
        let top = e["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), 3, "{e}");
        let tops: Vec<f64> = top.iter().map(|t| t["logprob"].as_f64().unwrap()).collect();
        assert!(tops.windows(2).all(|w| w[0] >= w[1]), "{e}");
        assert!(
            tops.iter().map(|l| l.exp()).sum::<f64>() <= 1.0 + 1e-6,
            "{e}"
        );
        // Greedy: the chosen token is the most likely one.
        assert_eq!(e["token"], top[0]["token"], "{e}");
        assert!((lp - tops[0]).abs() < 1e-6 && lp <= 0.0, "{e}");
        let token = e["token"].as_str().unwrap();
        assert_eq!(e["bytes"], json!(token.as_bytes()));
        joined.push_str(token);
    }
    assert_eq!(
        r["choices"][0]["message"]["content"].as_str(),
        Some(joined.as_str()),
        "the tokens spell the answer"
    );

    // Streamed: the same entries, spread over the chunks.
    let mut sbody = body.clone();
    sbody["stream"] = json!(true);
    let text = client()
        .post(w.url("/v1/chat/completions"))
        .json(&sbody)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let streamed: Vec<Value> = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str::<Value>(d).unwrap())
        .filter_map(|c| c["choices"][0]["logprobs"]["content"].as_array().cloned())
        .flatten()
        .collect();
    // Same tokens; the log probabilities agree to float noise (the second request reads its
    // prompt's blocks from the prefix cache, which sums in another order).
    assert_eq!(streamed.len(), content.len());
    for (a, b) in streamed.iter().zip(&content) {
        assert_eq!(a["token"], b["token"]);
        let (x, y) = (
            a["logprob"].as_f64().unwrap(),
            b["logprob"].as_f64().unwrap(),
        );
        assert!((x - y).abs() < 1e-3, "{a} vs {b}");
        let ta: Vec<&Value> = a["top_logprobs"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| &t["token"])
            .collect();
        let tb: Vec<&Value> = b["top_logprobs"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| &t["token"])
            .collect();
        assert_eq!(ta, tb);
    }

    // Completions: the legacy shape.
    let r: Value = client()
        .post(w.url("/v1/completions"))
        .json(
            &json!({"model": "smollm2", "prompt": "The sky is", "max_tokens": 4,
                      "temperature": 0, "ignore_eos": true, "logprobs": 2}),
        )
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let lp = &r["choices"][0]["logprobs"];
    let tokens = lp["tokens"].as_array().unwrap_or_else(|| panic!("{r}"));
    assert_eq!(tokens.len(), 4);
    assert_eq!(lp["token_logprobs"].as_array().unwrap().len(), 4);
    assert_eq!(lp["text_offset"][0], 0);
    for t in lp["top_logprobs"].as_array().unwrap() {
        assert_eq!(t.as_object().unwrap().len(), 2, "{t}");
    }
    let joined: String = tokens.iter().map(|t| t.as_str().unwrap()).collect();
    assert_eq!(r["choices"][0]["text"].as_str(), Some(joined.as_str()));
    w.stop().await;
}
