//! HTTP-level tests of the worker server on simulated-engine workers (fast; they still render
//! and tokenize with the default model's prompt profile, so the GGUF must be present):
//! every error path with its status and code, streaming and non-streaming answers, receipts
//! (signed, chained, continued across a restart), tickets, cancellation freeing blocks, the KV
//! event stream, and the metrics text checked by a strict OpenMetrics parser.

mod server_support;

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use futures::StreamExt;
use receipts::{KeyPair, KeyRing, Receipt, RouteMode, RouteTicket};
use serde_json::{json, Value};
use server_support::*;
use worker::TicketPolicy;

fn chat_body(content: &str, extra: Value) -> Value {
    let mut b = json!({
        "model": "smollm2",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 4,
        "temperature": 0
    });
    if let (Some(o), Some(e)) = (b.as_object_mut(), extra.as_object()) {
        for (k, v) in e {
            o.insert(k.clone(), v.clone());
        }
    }
    b
}

async fn post(w: &TestWorker, path: &str, body: &Value) -> reqwest::Response {
    client().post(w.url(path)).json(body).send().await.unwrap()
}

async fn error_of(resp: reqwest::Response) -> (u16, Value) {
    let status = resp.status().as_u16();
    let v: Value = resp.json().await.unwrap();
    (status, v["error"].clone())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_non_streaming_answers_with_usage_ids_and_a_verifiable_receipt() {
    let w = start_sim(SimOpts::default()).await;
    let resp = client()
        .post(w.url("/v1/chat/completions"))
        .header("x-request-id", "test-req-1")
        .json(&chat_body("Hello there", json!({})))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["x-request-id"], "test-req-1");
    assert_eq!(resp.headers()["x-kvgate-receipt"], "test-req-1");
    assert_eq!(resp.headers()["x-kvgate-worker-id"], "w-test");
    let v: Value = resp.json().await.unwrap();
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["id"], "chatcmpl-test-req-1");
    assert_eq!(v["choices"][0]["message"]["role"], "assistant");
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    let usage = &v["usage"];
    assert_eq!(usage["completion_tokens"], 4);
    let prompt_tokens = usage["prompt_tokens"].as_u64().unwrap();
    assert!(prompt_tokens > 5);
    assert_eq!(usage["total_tokens"].as_u64().unwrap(), prompt_tokens + 4);
    assert!(usage["prompt_tokens_details"]["cached_tokens"].is_u64());

    // The receipt: fetched by request id, signed by the worker key, hashes match.
    let r = client()
        .get(w.url("/v1/receipts/test-req-1"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let line = r.bytes().await.unwrap();
    let receipt = Receipt::from_line(&line).unwrap();
    let mut ring = KeyRing::new();
    ring.insert("w", w.key.public().clone());
    receipt.verify_signature(&ring).unwrap();
    assert_eq!(receipt.body.request_id, "test-req-1");
    assert_eq!(receipt.body.status, 200);
    assert_eq!(receipt.body.finish_reason.as_deref(), Some("length"));
    assert_eq!(receipt.body.prompt_tokens as u64, prompt_tokens);
    assert_eq!(receipt.body.completion_tokens, 4);
    assert!(receipt.body.ticket.is_none());
    let content = v["choices"][0]["message"]["content"].as_str().unwrap();
    assert_eq!(
        receipt.body.response_sha256,
        receipts::sha256_hex(content.as_bytes())
    );
    // Prompt of more than one block: the worker reports its last full block key.
    assert!(receipt.body.last_block_key.is_some());
    w.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_streaming_sends_role_content_finish_usage_and_done() {
    let w = start_sim(SimOpts::default()).await;
    let body = chat_body(
        "Stream please",
        json!({"stream": true, "stream_options": {"include_usage": true}, "max_tokens": 5}),
    );
    let resp = post(&w, "/v1/chat/completions", &body).await;
    assert_eq!(resp.status(), 200);
    assert!(resp.headers()["content-type"]
        .to_str()
        .unwrap()
        .starts_with("text/event-stream"));
    let id = resp.headers()["x-request-id"].to_str().unwrap().to_string();
    let events = read_sse(resp).await;
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    assert!(chunks
        .iter()
        .all(|c| c["object"] == "chat.completion.chunk"));
    let finish: Vec<&Value> = chunks
        .iter()
        .filter(|c| {
            !c["choices"][0]["finish_reason"].is_null()
                && c["choices"].as_array().is_some_and(|a| !a.is_empty())
        })
        .collect();
    assert_eq!(finish.len(), 1);
    assert_eq!(finish[0]["choices"][0]["finish_reason"], "length");
    let last = &chunks[chunks.len() - 1];
    assert_eq!(last["choices"].as_array().unwrap().len(), 0);
    assert_eq!(last["usage"]["completion_tokens"], 5);
    // Every other chunk carries "usage": null when include_usage is set.
    assert!(chunks[..chunks.len() - 1]
        .iter()
        .all(|c| c["usage"].is_null()));
    let text: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    let receipt = get_receipt(&w, &id).await;
    assert_eq!(receipt.body.status, 200);
    assert_eq!(receipt.body.completion_tokens, 5);
    assert_eq!(
        receipt.body.response_sha256,
        receipts::sha256_hex(text.as_bytes())
    );
    w.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completions_accept_text_and_token_ids() {
    let w = start_sim(SimOpts::default()).await;
    let resp = post(
        &w,
        "/v1/completions",
        &json!({"model": "m", "prompt": "Once upon a time", "max_tokens": 3}),
    )
    .await;
    assert_eq!(resp.status(), 200);
    let v: Value = resp.json().await.unwrap();
    assert_eq!(v["object"], "text_completion");
    assert_eq!(v["usage"]["completion_tokens"], 3);
    let resp = post(
        &w,
        "/v1/completions",
        &json!({"model": "m", "prompt": [1, 4093, 198, 100, 200], "max_tokens": 2, "stream": true}),
    )
    .await;
    assert_eq!(resp.status(), 200);
    let events = read_sse(resp).await;
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    let first: Value = serde_json::from_str(&events[0]).unwrap();
    assert_eq!(first["object"], "text_completion");
    // Out-of-vocabulary ids are refused, naming the index.
    let (s, e) = error_of(
        post(
            &w,
            "/v1/completions",
            &json!({"model": "m", "prompt": [1, 99999999]}),
        )
        .await,
    )
    .await;
    assert_eq!((s, e["param"].as_str()), (400, Some("prompt[1]")));
    w.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_request_error_has_its_status_code_and_param() {
    let opts = SimOpts {
        context_limit: Some(256),
        max_body_bytes: 4096,
        served_model_names: vec!["smollm2".into()],
        ..SimOpts::default()
    };
    let w = start_sim(opts).await;

    // Malformed JSON.
    let resp = client()
        .post(w.url("/v1/chat/completions"))
        .header("content-type", "application/json")
        .body("{\"model\": ")
        .send()
        .await
        .unwrap();
    let (s, e) = error_of(resp).await;
    assert_eq!((s, e["code"].as_str()), (400, Some("invalid_json")));
    assert_eq!(e["type"], "invalid_request_error");
    // Wrong type names the field.
    let (s, e) = error_of(
        post(
            &w,
            "/v1/chat/completions",
            &chat_body("x", json!({"max_tokens": "ten"})),
        )
        .await,
    )
    .await;
    assert_eq!(
        (s, e["code"].as_str(), e["param"].as_str()),
        (400, Some("invalid_type"), Some("max_tokens"))
    );
    // Unknown parameter.
    let (s, e) = error_of(
        post(
            &w,
            "/v1/chat/completions",
            &chat_body("x", json!({"best_of": 2})),
        )
        .await,
    )
    .await;
    assert_eq!(
        (s, e["code"].as_str(), e["param"].as_str()),
        (400, Some("unknown_parameter"), Some("best_of"))
    );
    // Unsupported parameters, never silently ignored.
    for (k, v) in [
        ("return_hidden_states", json!(true)),
        (
            "response_format",
            json!({"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}),
        ),
    ] {
        let (s, e) =
            error_of(post(&w, "/v1/chat/completions", &chat_body("x", json!({ k: v }))).await)
                .await;
        assert_eq!(
            (s, e["code"].as_str(), e["param"].as_str()),
            (400, Some("unsupported_parameter"), Some(k)),
            "{k}"
        );
    }
    // Model not served.
    let mut b = chat_body("x", json!({}));
    b["model"] = json!("gpt-4");
    let (s, e) = error_of(post(&w, "/v1/chat/completions", &b).await).await;
    assert_eq!(
        (s, e["code"].as_str(), e["param"].as_str()),
        (404, Some("model_not_found"), Some("model"))
    );
    // Token budget: the three numbers.
    let (s, e) = error_of(
        post(
            &w,
            "/v1/chat/completions",
            &chat_body("hello", json!({"max_tokens": 250})),
        )
        .await,
    )
    .await;
    assert_eq!(
        (s, e["code"].as_str()),
        (400, Some("context_length_exceeded"))
    );
    assert_eq!(e["context_limit"], 256);
    assert_eq!(e["max_tokens"], 250);
    assert_eq!(e["native_reserve"], 0);
    let pt = e["prompt_tokens"].as_u64().unwrap();
    assert!(pt > 0 && pt + 250 > 256);
    assert!(e["message"].as_str().unwrap().contains(&pt.to_string()));
    // Without max_tokens the default fits the remaining budget.
    let resp = post(
        &w,
        "/v1/chat/completions",
        &json!({"model": "smollm2", "messages": [{"role": "user", "content": "hi"}]}),
    )
    .await;
    assert_eq!(resp.status(), 200);
    let v: Value = resp.json().await.unwrap();
    let used = v["usage"]["prompt_tokens"].as_u64().unwrap()
        + v["usage"]["completion_tokens"].as_u64().unwrap();
    assert!(used <= 256);
    // Body over the limit: 413.
    let big = chat_body(&"a".repeat(8000), json!({}));
    let (s, e) = error_of(post(&w, "/v1/chat/completions", &big).await).await;
    assert_eq!((s, e["code"].as_str()), (413, Some("body_too_large")));
    // Bad request id.
    let resp = client()
        .post(w.url("/v1/chat/completions"))
        .header("x-request-id", "a b")
        .json(&chat_body("x", json!({})))
        .send()
        .await
        .unwrap();
    let (s, e) = error_of(resp).await;
    assert_eq!((s, e["code"].as_str()), (400, Some("invalid_request_id")));
    // Unknown route.
    let resp = client().get(w.url("/v1/nothing")).send().await.unwrap();
    assert_eq!(resp.status(), 404);
    // Validation failures after the body was read are receipted.
    let resp = client()
        .post(w.url("/v1/chat/completions"))
        .header("x-request-id", "bad-n")
        .json(&chat_body("x", json!({"n": 17})))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 400);
    let r = get_receipt(&w, "bad-n").await;
    assert_eq!(
        (r.body.status, r.body.error_code.as_deref()),
        (400, Some("invalid_value"))
    );
    w.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overload_is_429_with_retry_after() {
    // One running sequence and room for one waiting: a third concurrent request is refused.
    let opts = SimOpts {
        max_running: 1,
        max_waiting: 1,
        decode_us_base: 20_000,
        ..SimOpts::default()
    };
    let w = start_sim(opts).await;
    let long = client()
        .post(w.url("/v1/chat/completions"))
        .json(&chat_body(
            "long one",
            json!({"max_tokens": 200, "stream": true}),
        ))
        .send()
        .await
        .unwrap();
    assert_eq!(long.status(), 200);
    let waiting = tokio::spawn(
        client()
            .post(w.url("/v1/chat/completions"))
            .json(&chat_body("waits", json!({})))
            .send(),
    );
    wait_until(Duration::from_secs(10), || {
        w.worker.engine().stats().waiting == 1
    })
    .await;
    let resp = post(&w, "/v1/chat/completions", &chat_body("third", json!({}))).await;
    assert_eq!(resp.status(), 429);
    assert_eq!(resp.headers()["retry-after"], "1");
    let id = resp.headers()["x-request-id"].to_str().unwrap().to_string();
    let (_, e) = error_of(resp).await;
    assert_eq!(e["code"], "queue_full");
    assert_eq!(e["type"], "rate_limit_error");
    let r = get_receipt(&w, &id).await;
    assert_eq!(r.body.status, 429);
    drop(long);
    // Once the long stream is gone the waiting request is served.
    let resp = waiting.await.unwrap().unwrap();
    assert_eq!(resp.status(), 200);
    w.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admission_timeout_is_429() {
    // The KV cache (16 blocks of 16) fits one request at a time; the second waits past its
    // admission deadline.
    let opts = SimOpts {
        max_running: 4,
        num_blocks: 16,
        admission_timeout: Duration::from_millis(200),
        decode_us_base: 20_000,
        ..SimOpts::default()
    };
    let w = start_sim(opts).await;
    let t: Value = post(
        &w,
        "/v1/tokenize",
        &json!({"messages": [{"role": "user", "content": "long one"}]}),
    )
    .await
    .json()
    .await
    .unwrap();
    let p = t["count"].as_u64().unwrap();
    // Reserves ceil((p + m - 1) / 16) = 16 blocks: the whole cache.
    let m = 16 * 16 + 1 - p;
    let long = client()
        .post(w.url("/v1/chat/completions"))
        .json(&chat_body(
            "long one",
            json!({"max_tokens": m, "stream": true}),
        ))
        .send()
        .await
        .unwrap();
    assert_eq!(long.status(), 200);
    let resp = post(
        &w,
        "/v1/chat/completions",
        &chat_body("second", json!({"max_tokens": 8})),
    )
    .await;
    assert_eq!(resp.status(), 429);
    assert!(resp.headers().contains_key("retry-after"));
    let (_, e) = error_of(resp).await;
    assert_eq!(e["code"], "admission_timeout");
    // A request that could never fit is a 400, at once.
    let (s, e) = error_of(
        post(
            &w,
            "/v1/chat/completions",
            &chat_body("x", json!({"max_tokens": 1000})),
        )
        .await,
    )
    .await;
    assert_eq!((s, e["code"].as_str()), (400, Some("kv_capacity_exceeded")));
    drop(long);
    w.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_disconnect_mid_stream_frees_blocks_at_once() {
    let opts = SimOpts {
        decode_us_base: 10_000,
        ..SimOpts::default()
    };
    let w = start_sim(opts).await;
    let total = w.worker.engine().stats().blocks_total;
    let resp = client()
        .post(w.url("/v1/chat/completions"))
        .header("x-request-id", "to-cancel")
        .json(&chat_body(
            "a prompt that will be abandoned",
            json!({"max_tokens": 2000, "stream": true}),
        ))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let mut stream = resp.bytes_stream();
    // Read until some content has arrived: the sequence is running and holds blocks.
    let mut seen = String::new();
    while seen.matches("data:").count() < 3 {
        let chunk = tokio::time::timeout(Duration::from_secs(10), stream.next())
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        seen.push_str(&String::from_utf8_lossy(&chunk));
    }
    let s = w.worker.engine().stats();
    assert_eq!(s.running, 1);
    assert!(s.blocks_used > 0);
    drop(stream);
    // Wait for the event: the engine reports no running sequence and no used block.
    wait_until(Duration::from_secs(5), || {
        let s = w.worker.engine().stats();
        s.running == 0 && s.blocks_used == 0
    })
    .await;
    let s = w.worker.engine().stats();
    assert_eq!(s.blocks_free + s.blocks_cached + s.blocks_tail, total);
    let r = wait_receipt(&w, "to-cancel").await;
    assert_eq!(
        (r.body.status, r.body.error_code.as_deref()),
        (499, Some("client_disconnected"))
    );
    assert!(r.body.completion_tokens < 2000);
    let m = metrics_text(&w).await;
    let fams = parse_openmetrics(&m).unwrap();
    assert_eq!(
        sample(&fams, "kvgate_worker_cancelled_total", &[]),
        Some(1.0)
    );
    w.stop().await;
}

fn ticket_for(
    gw: &KeyPair,
    worker: &str,
    request_id: &str,
    seed_hex: &str,
    issued: u64,
    expires: u64,
) -> String {
    RouteTicket {
        request_id: request_id.into(),
        gateway_id: "gw-1".into(),
        key_id: gw.key_id().clone(),
        service: "chat".into(),
        rule_id: "r1".into(),
        rule_version: 3,
        mode: RouteMode::KvExact,
        worker: worker.into(),
        predicted_matched_tokens: Some(0),
        prompt_tokens: Some(10),
        last_block_key: None,
        namespace_seed: prefix_index::NamespaceSeed::from_hex(seed_hex).unwrap(),
        hash_algorithm: prefix_index::HashAlgorithm::Xxh3,
        issued_at_ms: issued,
        expires_at_ms: expires,
    }
    .sign(gw)
    .to_header_value()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tickets_are_required_verified_and_land_in_the_receipt() {
    let gw = KeyPair::generate();
    let other = KeyPair::generate();
    let mut opts = SimOpts {
        ticket_policy: TicketPolicy::Require,
        ..SimOpts::default()
    };
    opts.gateway_keys.insert("gw-1", gw.public().clone());
    let w = start_sim(opts).await;
    let seed = w.worker.profile().default_namespace_seed;
    let now = receipts::now_ms();
    let send = |ticket: Option<String>, id: Option<&str>| {
        let mut rb = client()
            .post(w.url("/v1/chat/completions"))
            .json(&chat_body("ticketed", json!({})));
        if let Some(t) = ticket {
            rb = rb.header(receipts::TICKET_HEADER, t);
        }
        if let Some(id) = id {
            rb = rb.header("x-request-id", id);
        }
        rb.send()
    };
    let (s, e) = error_of(send(None, None).await.unwrap()).await;
    assert_eq!(
        (s, e["code"].as_str(), e["type"].as_str()),
        (401, Some("ticket_required"), Some("authentication_error"))
    );
    let (s, e) = error_of(send(Some("garbage".into()), None).await.unwrap()).await;
    assert_eq!((s, e["code"].as_str()), (401, Some("malformed")));
    let expired = ticket_for(&gw, "w-test", "t-exp", &seed, now - 120_000, now - 60_000);
    let (s, e) = error_of(send(Some(expired), None).await.unwrap()).await;
    assert_eq!((s, e["code"].as_str()), (401, Some("ticket_expired")));
    let unknown = ticket_for(&other, "w-test", "t-unk", &seed, now, now + 60_000);
    let (s, e) = error_of(send(Some(unknown), None).await.unwrap()).await;
    assert_eq!((s, e["code"].as_str()), (401, Some("unknown_key")));
    let wrong = ticket_for(&gw, "w-other", "t-wrong", &seed, now, now + 60_000);
    let (s, e) = error_of(send(Some(wrong), None).await.unwrap()).await;
    assert_eq!((s, e["code"].as_str()), (401, Some("ticket_wrong_worker")));
    let good = ticket_for(&gw, "w-test", "t-good", &seed, now, now + 60_000);
    let (s, e) = error_of(send(Some(good.clone()), Some("different")).await.unwrap()).await;
    assert_eq!(
        (s, e["code"].as_str()),
        (401, Some("ticket_request_mismatch"))
    );
    let good = ticket_for(&gw, "w-test", "t-good2", &seed, now, now + 60_000);
    let resp = send(Some(good.clone()), None).await.unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["x-request-id"], "t-good2");
    // The receipt endpoint wants the gateway's access token from a ticket-requiring worker.
    let r = client()
        .get(w.url("/v1/receipts/t-good2"))
        .send()
        .await
        .unwrap();
    let (s, e) = error_of(r).await;
    assert_eq!((s, e["code"].as_str()), (401, Some("access_required")));
    let forged = receipts::AccessToken::new("gw-1", &"w-test".into(), now).sign(&other);
    let r = client()
        .get(w.url("/v1/receipts/t-good2"))
        .bearer_auth(&forged)
        .send()
        .await
        .unwrap();
    let (s, e) = error_of(r).await;
    assert_eq!((s, e["code"].as_str()), (401, Some("unknown_key")));
    let token = receipts::AccessToken::new("gw-1", &"w-test".into(), now).sign(&gw);
    let r = get_receipt_as(&w, "t-good2", Some(&token)).await;
    assert_eq!(
        r.body.ticket.as_ref().map(|t| t.header()),
        Some(good.as_str())
    );
    // A replayed ticket is refused.
    let (s, e) = error_of(send(Some(good), None).await.unwrap()).await;
    assert_eq!((s, e["code"].as_str()), (401, Some("ticket_replayed")));
    w.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ops_endpoints_report_profile_readiness_models_keys_and_tokens() {
    let w = start_sim(SimOpts::default()).await;
    let c = client();
    assert_eq!(c.get(w.url("/health")).send().await.unwrap().status(), 200);
    let r: Value = c
        .get(w.url("/ready"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(r["ready"], true);
    let p: Value = c
        .get(w.url("/v1/profile"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    for k in [
        "model_id",
        "revision",
        "template_sha256",
        "tokenizer_sha256",
        "profile_digest",
        "context_limit",
        "native_reserve",
        "block_size",
        "hash_algorithm",
        "default_namespace_seed",
    ] {
        assert!(!p[k].is_null(), "{k}");
    }
    assert_eq!(p["block_size"], 16);
    assert_eq!(p["hash_algorithm"], "xxh3");
    assert_eq!(p["context_limit"], 8192);
    assert_eq!(p["engine"], "sim");
    // The GGUF's `general.architecture`, over HTTP; the simulated engine has no numerics.
    assert_eq!(p["architecture"], "llama");
    assert!(p["numerics"].is_null(), "{p}");
    let m: Value = c
        .get(w.url("/v1/models"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(m["object"], "list");
    assert_eq!(m["data"][0]["object"], "model");
    let k: Value = c
        .get(w.url("/v1/keys"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(k["key_id"], w.key.key_id().as_str());
    assert_eq!(k["public_key_hex"], hex::encode(w.key.public().to_bytes()));
    let t: Value = post(
        &w,
        "/v1/tokenize",
        &json!({"messages": [{"role": "user", "content": "Hi"}]}),
    )
    .await
    .json()
    .await
    .unwrap();
    let tokens = t["tokens"].as_array().unwrap();
    assert_eq!(t["count"].as_u64().unwrap() as usize, tokens.len());
    assert!(t["prompt"]
        .as_str()
        .unwrap()
        .contains("<|im_start|>user\nHi<|im_end|>"));
    assert_eq!(t["block_keys"].as_array().unwrap().len(), tokens.len() / 16);
    let t: Value = post(&w, "/v1/tokenize", &json!({"prompt": "<|im_start|>user\n"}))
        .await
        .json()
        .await
        .unwrap();
    // Completion text follows the prompt contract (the gateway's rule too): special-token text
    // is parsed, so `<|im_start|>` is the one control token, not its characters.
    assert_eq!(t["tokens"], json!([1, 4093, 198]));
    let (s, _) = error_of(post(&w, "/v1/tokenize", &json!({})).await).await;
    assert_eq!(s, 400);
    w.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefix_reuse_shows_in_cached_tokens_and_the_opt_out_inserts_nothing() {
    let w = start_sim(SimOpts::default()).await;
    let long = "The quick brown fox jumps over the lazy dog. ".repeat(8);
    let cached = |v: &Value| {
        v["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap()
    };
    // Opted out (header): a repeat finds nothing cached.
    let opt_out = || {
        client()
            .post(w.url("/v1/chat/completions"))
            .header("x-kvgate-no-cache", "1")
            .json(&chat_body(&long, json!({})))
            .send()
    };
    let a: Value = opt_out().await.unwrap().json().await.unwrap();
    let b: Value = opt_out().await.unwrap().json().await.unwrap();
    assert_eq!(cached(&a), 0);
    assert_eq!(cached(&b), 0);
    // Opted out (body): same.
    let c: Value = post(
        &w,
        "/v1/chat/completions",
        &chat_body(&long, json!({"kvgate": {"cache": false}})),
    )
    .await
    .json()
    .await
    .unwrap();
    assert_eq!(cached(&c), 0);
    // Normal: the second finds the first's full blocks.
    let d: Value = post(&w, "/v1/chat/completions", &chat_body(&long, json!({})))
        .await
        .json()
        .await
        .unwrap();
    let e: Value = post(&w, "/v1/chat/completions", &chat_body(&long, json!({})))
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(cached(&d), 0);
    let prompt = e["usage"]["prompt_tokens"].as_u64().unwrap();
    assert!(cached(&e) >= 16 && cached(&e) < prompt, "{e}");
    w.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_events_stream_snapshots_and_resumes() {
    let w = start_sim(SimOpts::default()).await;
    let long = "Tell me a story about a lighthouse keeper and the sea. ".repeat(4);
    let resp = post(&w, "/v1/chat/completions", &chat_body(&long, json!({}))).await;
    assert_eq!(resp.status(), 200);
    let _ = resp.bytes().await.unwrap();

    // Fresh subscription: cleared, then a snapshot of the cached keys.
    let resp = client().get(w.url("/v1/kv/events")).send().await.unwrap();
    assert_eq!(resp.status(), 200);
    let mut sse = SseReader::new(resp);
    let first = sse.next_cache_event().await.unwrap();
    let env: Value = serde_json::from_str(&first.data).unwrap();
    assert_eq!(env["type"], "cleared");
    let epoch = env["epoch"].as_u64().unwrap();
    assert_eq!(
        first.id.as_deref(),
        Some(format!("{epoch}:{}", env["seq"]).as_str())
    );
    let snap: Value = serde_json::from_str(&sse.next_cache_event().await.unwrap().data).unwrap();
    assert_eq!(snap["type"], "stored");
    assert!(!snap["keys"].as_array().unwrap().is_empty());
    let snap_seq = snap["seq"].as_u64().unwrap();
    // A live event: a new prompt stores new blocks.
    let other = "A completely different prompt about mountains and rivers. ".repeat(4);
    let _ = post(&w, "/v1/chat/completions", &chat_body(&other, json!({})))
        .await
        .bytes()
        .await;
    let live = loop {
        let ev: Value = serde_json::from_str(&sse.next_cache_event().await.unwrap().data).unwrap();
        if ev["seq"].as_u64().unwrap() > snap_seq {
            break ev;
        }
    };
    assert_eq!(live["type"], "stored");
    assert_eq!(live["epoch"].as_u64().unwrap(), epoch);
    let live_seq = live["seq"].as_u64().unwrap();
    drop(sse);

    // Resume from the snapshot position: the missed live event comes first, no `cleared`.
    let resp = client()
        .get(w.url(&format!(
            "/v1/kv/events?since_epoch={epoch}&since_seq={snap_seq}"
        )))
        .send()
        .await
        .unwrap();
    let mut sse = SseReader::new(resp);
    let ev: Value = serde_json::from_str(&sse.next_cache_event().await.unwrap().data).unwrap();
    assert_eq!(ev["type"], "stored");
    assert_eq!(ev["seq"].as_u64().unwrap(), snap_seq + 1);
    assert!(ev["seq"].as_u64().unwrap() <= live_seq);
    drop(sse);

    // Another epoch: cleared + snapshot again (via Last-Event-ID).
    let resp = client()
        .get(w.url("/v1/kv/events"))
        .header("last-event-id", format!("{}:1", epoch + 1))
        .send()
        .await
        .unwrap();
    let mut sse = SseReader::new(resp);
    let ev: Value = serde_json::from_str(&sse.next_cache_event().await.unwrap().data).unwrap();
    assert_eq!(ev["type"], "cleared");
    drop(sse);
    // Malformed resume position.
    let resp = client()
        .get(w.url("/v1/kv/events?since=12"))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 400);
    let resp = client()
        .get(w.url("/v1/kv/events?load=maybe"))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 400);
    let body: Value = resp.json().await.unwrap();
    assert_eq!(body["error"]["code"], "invalid_value", "{body}");
    w.stop().await;
}

/// A simulated worker with one running slot and 20 ms decode steps.
async fn start_one_slow_slot() -> TestWorker {
    start_sim(SimOpts {
        max_running: 1,
        decode_us_base: 20_000,
        ..SimOpts::default()
    })
    .await
}

/// `GET /v1/load` is the load messages alone: idle at first, a request's work while it runs,
/// idle again after — and never a cache event, though the request stores blocks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn load_stream_carries_the_load_alone() {
    let w = start_one_slow_slot().await;
    let resp = client().get(w.url("/v1/load")).send().await.unwrap();
    assert_eq!(resp.status(), 200);
    assert!(resp.headers()["content-type"]
        .to_str()
        .unwrap()
        .starts_with("text/event-stream"));
    let mut sse = SseReader::new(resp);
    let idle = json!({"running": 0, "waiting": 0, "prefill_tokens": 0, "decode_tokens": 0});
    let only_load = |ev: &server_support::SseEvent| {
        assert_eq!(ev.event.as_deref(), Some("load"), "{:?}", ev.data);
        assert!(ev.id.is_none());
        serde_json::from_str::<Value>(&ev.data).unwrap()
    };
    assert_eq!(only_load(&sse.next_event().await.unwrap()), idle);
    let prompt = "Tell me a story about a lighthouse keeper and the sea. ".repeat(8);
    let body = chat_body(&prompt, json!({"max_tokens": 20}));
    let request = async {
        let r = post(&w, "/v1/chat/completions", &body).await;
        assert_eq!(r.status(), 200);
        r.bytes().await.unwrap()
    };
    let watch = async {
        let mut saw_busy = false;
        loop {
            let l = only_load(&sse.next_event().await.unwrap());
            saw_busy |= l["running"] == 1;
            if saw_busy && l == idle {
                break;
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(30), async {
        tokio::join!(request, watch)
    })
    .await
    .expect("the load went busy and idle again");
    w.stop().await;
}

/// `w`'s KV event stream with load messages.
async fn load_events(w: &TestWorker) -> SseReader {
    let resp = client()
        .get(w.url("/v1/kv/events?load=true"))
        .send()
        .await
        .unwrap();
    SseReader::new(resp)
}

/// The event stream interleaves `event: load` messages (no id) with the cache events: the
/// first right after subscribing, then one within 20 ms of each change — a request's prompt
/// shows as prefill tokens while it waits, its output budget as decode tokens, and both go back
/// to 0 when it ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_events_stream_reports_the_engine_load() {
    // One running slot and slow decode steps: the second request waits behind the first.
    let w = start_one_slow_slot().await;
    // Without `load=true` the stream carries cache events only.
    let resp = client().get(w.url("/v1/kv/events")).send().await.unwrap();
    let mut plain = SseReader::new(resp);
    let first = plain.next_event().await.unwrap();
    assert_eq!(first.event, None, "{:?}", first.data);
    // (longer than the 1 s heartbeat of load messages)
    let quiet = tokio::time::timeout(Duration::from_millis(1500), plain.next_event()).await;
    assert!(
        quiet.is_err(),
        "unexpected message: {:?}",
        quiet.map(|e| e.map(|e| e.event))
    );
    drop(plain);
    let mut sse = load_events(&w).await;
    let idle = sse.next_load().await.unwrap();
    assert_eq!(
        idle,
        json!({"running": 0, "waiting": 0, "prefill_tokens": 0, "decode_tokens": 0})
    );
    let prompt = "Tell me a story about a lighthouse keeper and the sea. ".repeat(8);
    let body = chat_body(&prompt, json!({"max_tokens": 40}));
    let request = || async {
        let r = post(&w, "/v1/chat/completions", &body).await;
        assert_eq!(r.status(), 200);
        r.bytes().await.unwrap()
    };
    // Within the two requests' lifetime the load shows one running and one waiting, the
    // waiting one's prompt as prefill and both output budgets as decode tokens.
    let watch = async {
        let mut saw_busy = false;
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        let idle = json!({"running": 0, "waiting": 0, "prefill_tokens": 0, "decode_tokens": 0});
        loop {
            let l = sse.next_load().await.unwrap();
            // (`waiting` counts a submission the step loop has not taken in yet; its tokens
            // count from the next step on.)
            if l["running"] == 1 && l["waiting"] == 1 && l["prefill_tokens"].as_u64() > Some(0) {
                assert!(l["decode_tokens"].as_u64().unwrap() > 40, "{l}");
                assert!(l["decode_tokens"].as_u64().unwrap() <= 80, "{l}");
                saw_busy = true;
            }
            if saw_busy && l == idle {
                break;
            }
            assert!(std::time::Instant::now() < deadline, "last load {l}");
        }
    };
    tokio::join!(request(), request(), watch);
    w.stop().await;
}

/// Load messages follow moves, not steps: a 48-token answer at 20 ms per decode step changes
/// `decode_tokens` on each of its ~48 steps (one message per step before the rule), but only
/// moves of at least 1/8 and 16 tokens, a sequence queued, admitted or finished, and a count
/// reaching 0 are announced (`WorkerLoad::moved_from`, docs/kv-events.md).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_events_load_messages_follow_moves_not_steps() {
    let w = start_one_slow_slot().await;
    let mut sse = load_events(&w).await;
    let idle = json!({"running": 0, "waiting": 0, "prefill_tokens": 0, "decode_tokens": 0});
    assert_eq!(sse.next_load().await.unwrap(), idle);
    let body = chat_body("Count the waves.", json!({"max_tokens": 48}));
    let request = async {
        let r = post(&w, "/v1/chat/completions", &body).await;
        assert_eq!(r.status(), 200);
        let v: Value = serde_json::from_slice(&r.bytes().await.unwrap()).unwrap();
        assert_eq!(v["usage"]["completion_tokens"], 48, "{v}");
    };
    let watch = async {
        let mut seen = Vec::new();
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        loop {
            let l = sse.next_load().await.unwrap();
            seen.push(l["decode_tokens"].as_u64().unwrap());
            if l == idle && seen.len() > 1 {
                return seen;
            }
            assert!(std::time::Instant::now() < deadline, "loads {seen:?}");
        }
    };
    let ((), seen) = tokio::join!(request, watch);
    // Queued, admitted, two or three decode moves, done; a 1 s heartbeat may add one.
    assert!(
        seen.len() >= 3 && seen.len() <= 12,
        "decode_tokens per message: {seen:?}"
    );
    assert!(
        seen.iter().any(|&d| d > 16),
        "the answer's budget showed: {seen:?}"
    );
    w.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_text_is_valid_openmetrics_with_the_expected_series() {
    let w = start_sim(SimOpts::default()).await;
    for i in 0..3 {
        let r = post(
            &w,
            "/v1/chat/completions",
            &chat_body(&format!("metrics {i}"), json!({})),
        )
        .await;
        assert_eq!(r.status(), 200);
        let _ = r.bytes().await;
    }
    let (s, _) = error_of(
        post(
            &w,
            "/v1/chat/completions",
            &chat_body("x", json!({"return_hidden_states": true})),
        )
        .await,
    )
    .await;
    assert_eq!(s, 400);
    let resp = client()
        .get(w.url("/metrics"))
        .header("accept", "application/openmetrics-text; version=1.0.0")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert!(resp.headers()["content-type"]
        .to_str()
        .unwrap()
        .starts_with("application/openmetrics-text"));
    let text = resp.text().await.unwrap();
    let fams = parse_openmetrics(&text).unwrap_or_else(|e| panic!("{e}\n{text}"));
    for (name, ty) in [
        ("kvgate_worker_requests", "counter"),
        ("kvgate_worker_rejections", "counter"),
        ("kvgate_worker_time_to_first_token_seconds", "histogram"),
        ("kvgate_worker_inter_token_latency_seconds", "histogram"),
        ("kvgate_worker_queue_time_seconds", "histogram"),
        ("kvgate_worker_running_sequences", "gauge"),
        ("kvgate_worker_waiting_sequences", "gauge"),
        ("kvgate_worker_kv_blocks", "gauge"),
        ("kvgate_worker_prefix_hit_tokens", "counter"),
        ("kvgate_worker_prompt_tokens", "counter"),
        ("kvgate_worker_generation_tokens", "counter"),
        ("kvgate_worker_ready", "gauge"),
    ] {
        assert_eq!(fams.get(name).map(|f| f.kind.as_str()), Some(ty), "{name}");
    }
    assert_eq!(
        sample(
            &fams,
            "kvgate_worker_requests_total",
            &[("endpoint", "chat_completions"), ("status", "200")]
        ),
        Some(3.0)
    );
    assert_eq!(
        sample(
            &fams,
            "kvgate_worker_rejections_total",
            &[("reason", "unsupported_parameter")]
        ),
        Some(1.0)
    );
    assert_eq!(
        sample(
            &fams,
            "kvgate_worker_time_to_first_token_seconds_count",
            &[]
        ),
        Some(3.0)
    );
    // 3 requests × 4 tokens → 3 × 3 gaps.
    assert_eq!(
        sample(
            &fams,
            "kvgate_worker_inter_token_latency_seconds_count",
            &[]
        ),
        Some(9.0)
    );
    assert!(sample(&fams, "kvgate_worker_generation_tokens_total", &[]).unwrap() >= 12.0);
    assert_eq!(sample(&fams, "kvgate_worker_ready", &[]), Some(1.0));
    let total = sample(&fams, "kvgate_worker_kv_blocks_capacity", &[]).unwrap();
    let sum: f64 = ["used", "cached", "tail", "free"]
        .iter()
        .map(|s| sample(&fams, "kvgate_worker_kv_blocks", &[("state", s)]).unwrap())
        .sum();
    assert_eq!(sum, total);
    // The parser itself rejects broken text.
    assert!(parse_openmetrics("# TYPE a counter\na_total 1\n").is_err()); // no EOF
    assert!(parse_openmetrics("a_total 1\n# EOF\n").is_err()); // no TYPE
    assert!(parse_openmetrics("# TYPE a gauge\na{x=\"1} 2\n# EOF\n").is_err());
    assert!(parse_openmetrics("# TYPE h histogram\nh_bucket{le=\"1\"} 3\nh_bucket{le=\"+Inf\"} 2\nh_sum 1\nh_count 2\n# EOF\n").is_err());
    w.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_worker_continues_its_receipt_chain() {
    let dir = tempfile::tempdir().unwrap();
    let key = KeyPair::generate();
    let opts = SimOpts {
        state: Some((dir.path().to_path_buf(), key.clone())),
        ..SimOpts::default()
    };
    let w = start_sim(opts.clone()).await;
    for i in 0..2 {
        let r = post(
            &w,
            "/v1/chat/completions",
            &chat_body(&format!("first life {i}"), json!({})),
        )
        .await;
        assert_eq!(r.status(), 200);
        let _ = r.bytes().await;
    }
    let log = w.receipt_log.clone();
    w.stop().await;
    let w = start_sim(opts).await;
    let resp = client()
        .post(w.url("/v1/chat/completions"))
        .header("x-request-id", "second-life")
        .json(&chat_body("second life", json!({})))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let _ = resp.bytes().await;
    let r = get_receipt(&w, "second-life").await;
    assert_eq!(r.seq, 2);
    w.stop().await;
    let mut ring = KeyRing::new();
    ring.insert("w", key.public().clone());
    let report = receipts::verify_log(&log, &ring).unwrap();
    assert!(report.ok(), "{:?}", report.first_failure());
    assert_eq!(report.valid, 3);
}

/// A simulated worker with 10 ms decode steps.
async fn start_paced() -> TestWorker {
    start_sim(SimOpts {
        decode_us_base: 10_000,
        ..SimOpts::default()
    })
    .await
}

/// A streamed chat completion of `max_tokens` (request id `id`) on `w`, running once its first
/// event arrived; the events after it are read to the end by the returned task.
async fn running_stream(
    w: &TestWorker,
    id: &str,
    max_tokens: u64,
) -> tokio::task::JoinHandle<Vec<String>> {
    let resp = client()
        .post(w.url("/v1/chat/completions"))
        .header("x-request-id", id)
        .json(&chat_body(
            "long",
            json!({"max_tokens": max_tokens, "stream": true}),
        ))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let mut sse = SseReader::new(resp);
    let _first = sse.next_event().await.unwrap();
    tokio::spawn(async move {
        let mut out = Vec::new();
        while let Some(e) = sse.next_event().await {
            out.push(e.data);
        }
        out
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_ends_open_streams_and_receipts_them() {
    let w = start_paced().await;
    let log = w.receipt_log.clone();
    let reader = running_stream(&w, "cut-by-shutdown", 5000).await;
    let _dir = tokio::time::timeout(Duration::from_secs(15), w.stop())
        .await
        .unwrap();
    let events = tokio::time::timeout(Duration::from_secs(5), reader)
        .await
        .unwrap()
        .unwrap();
    let last: Value = serde_json::from_str(events.last().unwrap()).unwrap();
    assert_eq!(last["error"]["code"], "engine_stopped");
    let text = std::fs::read_to_string(&log).unwrap();
    let r = Receipt::from_line(text.lines().last().unwrap().as_bytes()).unwrap();
    assert_eq!(r.body.request_id, "cut-by-shutdown");
    assert_eq!(r.body.error_code.as_deref(), Some("engine_stopped"));
}

/// A drain lets streams finish: `/ready` turns 503 `draining` at once, a request that still
/// arrives during the grace is answered, the open stream ends with `[DONE]` (not
/// `engine_stopped`), and the drain returns once nothing is in flight after the grace.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drain_lets_open_streams_finish_before_the_stop() {
    let mut w = start_paced().await;
    let reader = running_stream(&w, "drained", 60).await;
    assert_eq!(w.worker.in_flight(), 1);
    let url = w.url("");
    let during = async {
        // (the drain has begun: the request is sent after /ready turned 503)
        let ready = client().get(format!("{url}/ready")).send().await.unwrap();
        let late = client()
            .post(format!("{url}/v1/chat/completions"))
            .json(&chat_body("late", json!({"max_tokens": 3})))
            .send()
            .await
            .unwrap();
        (ready, late)
    };
    let started = std::time::Instant::now();
    let (report, (ready, late)) = tokio::join!(
        w.worker
            .drain(Duration::from_millis(300), Duration::from_secs(20)),
        async {
            tokio::time::sleep(Duration::from_millis(50)).await;
            during.await
        }
    );
    assert_eq!(ready.status(), 503);
    let body: Value = ready.json().await.unwrap();
    assert!(
        body["reason"].as_str().unwrap().starts_with("draining"),
        "{body}"
    );
    assert_eq!(late.status(), 200, "answered while draining");
    assert_eq!(report.in_flight_left, 0, "{report:?}");
    assert!(report.waited >= Duration::from_millis(300), "{report:?}");
    assert!(started.elapsed() < Duration::from_secs(20));
    let events = reader.await.unwrap();
    assert_eq!(
        events.last().map(String::as_str),
        Some("[DONE]"),
        "{events:?}"
    );
    assert!(
        !events.iter().any(|e| e.contains("engine_stopped")),
        "{events:?}"
    );
    // The metrics say so too.
    let m = client()
        .get(w.url("/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(m.contains("kvgate_worker_draining 1"), "{m}");
    assert!(m.contains("kvgate_worker_requests_in_flight 0"), "{m}");
    w.stop().await;
}

/// A drain waits at most its timeout: a stream longer than that is left to the stop, which
/// ends it with `engine_stopped` (and receipts it) as before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drain_gives_up_at_its_timeout() {
    let mut w = start_paced().await;
    let reader = running_stream(&w, "outlasts-the-drain", 5000).await;
    let report = w
        .worker
        .drain(Duration::from_millis(50), Duration::from_millis(400))
        .await;
    assert_eq!(report.in_flight_left, 1, "{report:?}");
    assert!(report.waited >= Duration::from_millis(400), "{report:?}");
    w.stop().await;
    let events = reader.await.unwrap();
    let last: Value = serde_json::from_str(events.last().unwrap()).unwrap();
    assert_eq!(last["error"]["code"], "engine_stopped");
}

/// Metric families parsed from OpenMetrics text.
#[derive(Debug, Default)]
struct Family {
    kind: String,
    samples: Vec<(String, BTreeMap<String, String>, f64)>,
}

fn sample(fams: &HashMap<String, Family>, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    fams.values()
        .flat_map(|f| f.samples.iter())
        .find(|(n, l, _)| {
            n == name
                && l.len() == labels.len()
                && labels
                    .iter()
                    .all(|(k, v)| l.get(*k).map(String::as_str) == Some(*v))
        })
        .map(|(_, _, v)| *v)
}

fn valid_name(n: &str) -> bool {
    let mut cs = n.chars();
    matches!(cs.next(), Some(c) if c.is_ascii_alphabetic() || c == '_' || c == ':')
        && cs.all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
}

/// A strict parser of the OpenMetrics text format (the subset prometheus-client emits):
/// `# HELP`, `# TYPE`, `# UNIT` lines, samples with escaped label values, `# EOF` last; each
/// sample belongs to a declared family with a suffix allowed by its type; histogram buckets
/// are cumulative and end at `+Inf` equal to `_count`.
fn parse_openmetrics(text: &str) -> Result<HashMap<String, Family>, String> {
    let mut fams: HashMap<String, Family> = HashMap::new();
    let mut lines: Vec<&str> = text.split('\n').collect();
    if lines.last() != Some(&"") {
        return Err("text must end with a newline".into());
    }
    lines.pop();
    if lines.last() != Some(&"# EOF") {
        return Err("missing `# EOF` as the last line".into());
    }
    lines.pop();
    for (i, line) in lines.iter().enumerate() {
        let ln = i + 1;
        if let Some(rest) = line.strip_prefix("# ") {
            let mut parts = rest.splitn(3, ' ');
            let (kw, name) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
            if !valid_name(name) {
                return Err(format!("line {ln}: bad metric name `{name}`"));
            }
            match kw {
                "TYPE" => {
                    let t = parts.next().unwrap_or("");
                    if ![
                        "counter",
                        "gauge",
                        "histogram",
                        "summary",
                        "info",
                        "stateset",
                        "unknown",
                        "gaugehistogram",
                    ]
                    .contains(&t)
                    {
                        return Err(format!("line {ln}: bad type `{t}`"));
                    }
                    if fams.contains_key(name) {
                        return Err(format!("line {ln}: family `{name}` declared twice"));
                    }
                    fams.insert(
                        name.to_string(),
                        Family {
                            kind: t.into(),
                            samples: vec![],
                        },
                    );
                }
                "HELP" | "UNIT" => {}
                _ => return Err(format!("line {ln}: unknown comment `{kw}`")),
            }
            continue;
        }
        if line.is_empty() || line.starts_with('#') {
            return Err(format!("line {ln}: empty or malformed line"));
        }
        // name{labels} value
        let (name, rest) = match line.find(['{', ' ']) {
            Some(p) => (&line[..p], &line[p..]),
            None => return Err(format!("line {ln}: no value")),
        };
        if !valid_name(name) {
            return Err(format!("line {ln}: bad sample name `{name}`"));
        }
        let mut labels = BTreeMap::new();
        let rest = if let Some(body) = rest.strip_prefix('{') {
            let mut chars = body.char_indices().peekable();
            let end;
            loop {
                // key
                let start = match chars.peek() {
                    Some(&(_, '}')) => {
                        end = chars.next().map(|(p, _)| p);
                        break;
                    }
                    Some(&(p, _)) => p,
                    None => return Err(format!("line {ln}: unterminated labels")),
                };
                let mut eq = None;
                for (p, c) in chars.by_ref() {
                    if c == '=' {
                        eq = Some(p);
                        break;
                    }
                }
                let eq = eq.ok_or(format!("line {ln}: label without `=`"))?;
                let key = &body[start..eq];
                if !valid_name(key) {
                    return Err(format!("line {ln}: bad label name `{key}`"));
                }
                if chars.next().map(|(_, c)| c) != Some('"') {
                    return Err(format!("line {ln}: label value not quoted"));
                }
                let mut val = String::new();
                let mut closed = false;
                while let Some((_, c)) = chars.next() {
                    match c {
                        '\\' => match chars.next().map(|(_, c)| c) {
                            Some('n') => val.push('\n'),
                            Some('"') => val.push('"'),
                            Some('\\') => val.push('\\'),
                            _ => return Err(format!("line {ln}: bad escape")),
                        },
                        '"' => {
                            closed = true;
                            break;
                        }
                        '\n' => return Err(format!("line {ln}: newline in label value")),
                        c => val.push(c),
                    }
                }
                if !closed {
                    return Err(format!("line {ln}: unterminated label value"));
                }
                if labels.insert(key.to_string(), val).is_some() {
                    return Err(format!("line {ln}: duplicate label `{key}`"));
                }
                match chars.next() {
                    Some((_, ',')) => continue,
                    Some((p, '}')) => {
                        end = Some(p);
                        break;
                    }
                    _ => return Err(format!("line {ln}: expected `,` or `}}` after a label")),
                }
            }
            let end = end.ok_or(format!("line {ln}: unterminated labels"))?;
            &body[end + 1..]
        } else {
            rest
        };
        let value_str = rest
            .strip_prefix(' ')
            .ok_or(format!("line {ln}: expected one space before the value"))?;
        let value_str = value_str.split(' ').next().unwrap_or("");
        let value: f64 = match value_str {
            "+Inf" => f64::INFINITY,
            "-Inf" => f64::NEG_INFINITY,
            "NaN" => f64::NAN,
            v => v
                .parse()
                .map_err(|_| format!("line {ln}: bad value `{v}`"))?,
        };
        // Find the family: the longest declared name that the sample name extends with an
        // allowed suffix.
        let fam_name = fams
            .iter()
            .filter(|(f, fam)| {
                let suffixes: &[&str] = match fam.kind.as_str() {
                    "counter" => &["_total", "_created"],
                    "gauge" | "unknown" | "stateset" => &[""],
                    "info" => &["_info"],
                    "histogram" | "gaugehistogram" => {
                        &["_bucket", "_sum", "_count", "_created", "_gcount", "_gsum"]
                    }
                    "summary" => &["", "_sum", "_count", "_created"],
                    _ => &[],
                };
                suffixes.iter().any(|s| name == format!("{f}{s}"))
            })
            .map(|(f, _)| f.clone())
            .max_by_key(|f| f.len())
            .ok_or(format!(
                "line {ln}: sample `{name}` belongs to no declared family"
            ))?;
        let fam = fams.get_mut(&fam_name).ok_or("family vanished")?;
        if fam.kind == "counter" && name.ends_with("_total") && value < 0.0 {
            return Err(format!("line {ln}: negative counter"));
        }
        fam.samples.push((name.to_string(), labels, value));
    }
    // Histogram checks: cumulative buckets, +Inf == count, per label set.
    for (fname, fam) in &fams {
        if fam.kind != "histogram" {
            continue;
        }
        type Series = (Vec<(f64, f64)>, Option<f64>);
        let mut series: BTreeMap<String, Series> = BTreeMap::new();
        for (n, l, v) in &fam.samples {
            let mut base = l.clone();
            let le = base.remove("le");
            let key = format!("{base:?}");
            let entry = series.entry(key).or_default();
            if n.ends_with("_bucket") {
                let le = le.ok_or(format!("{fname}: bucket without le"))?;
                let b = if le == "+Inf" {
                    f64::INFINITY
                } else {
                    le.parse().map_err(|_| format!("{fname}: bad le"))?
                };
                entry.0.push((b, *v));
            } else if n.ends_with("_count") {
                entry.1 = Some(*v);
            }
        }
        for (k, (buckets, count)) in series {
            let mut prev = (f64::NEG_INFINITY, 0.0);
            for &(b, v) in &buckets {
                if b <= prev.0 || v < prev.1 {
                    return Err(format!("{fname}{k}: buckets not increasing/cumulative"));
                }
                prev = (b, v);
            }
            if prev.0 != f64::INFINITY || Some(prev.1) != count {
                return Err(format!(
                    "{fname}{k}: +Inf bucket missing or not equal to _count"
                ));
            }
        }
    }
    Ok(fams)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ticket_stays_used_across_a_restart_and_a_refused_body_uses_none() {
    let dir = tempfile::tempdir().unwrap();
    let key = KeyPair::generate();
    let gw = KeyPair::generate();
    let mut opts = SimOpts {
        state: Some((dir.path().to_path_buf(), key.clone())),
        ticket_policy: TicketPolicy::Require,
        max_body_bytes: 4096,
        ..SimOpts::default()
    };
    opts.gateway_keys.insert("gw-1", gw.public().clone());
    let w = start_sim(opts.clone()).await;
    let seed = w.worker.profile().default_namespace_seed;
    let now = receipts::now_ms();
    let send = |url: String, ticket: String, body: Value| async move {
        client()
            .post(url)
            .header(receipts::TICKET_HEADER, ticket)
            .json(&body)
            .send()
            .await
            .unwrap()
    };
    // An oversized body is refused before the ticket is used: the same ticket then serves.
    let t = ticket_for(&gw, "w-test", "t-big", &seed, now, now + 60_000);
    let big = chat_body(&"x".repeat(8192), json!({}));
    let (s, e) = error_of(send(w.url("/v1/chat/completions"), t.clone(), big).await).await;
    assert_eq!((s, e["code"].as_str()), (413, Some("body_too_large")));
    let r = send(
        w.url("/v1/chat/completions"),
        t,
        chat_body("small", json!({})),
    )
    .await;
    assert_eq!(r.status(), 200);
    let _ = r.bytes().await;
    // Served once, then the worker restarts: the replay is still refused.
    let t = ticket_for(&gw, "w-test", "t-once", &seed, now, now + 60_000);
    let r = send(
        w.url("/v1/chat/completions"),
        t.clone(),
        chat_body("once", json!({})),
    )
    .await;
    assert_eq!(r.status(), 200);
    let _ = r.bytes().await;
    w.stop().await;
    let w = start_sim(opts).await;
    let (s, e) = error_of(
        send(
            w.url("/v1/chat/completions"),
            t,
            chat_body("again", json!({})),
        )
        .await,
    )
    .await;
    assert_eq!((s, e["code"].as_str()), (401, Some("ticket_replayed")));
    // A fresh ticket still serves.
    let t = ticket_for(&gw, "w-test", "t-new", &seed, now, now + 60_000);
    let r = send(
        w.url("/v1/chat/completions"),
        t,
        chat_body("new", json!({})),
    )
    .await;
    assert_eq!(r.status(), 200);
    let _ = r.bytes().await;
    w.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn side_doors_need_the_gateways_token_and_subscriptions_are_capped() {
    let gw = KeyPair::generate();
    let mut opts = SimOpts {
        ticket_policy: TicketPolicy::Require,
        max_event_subscriptions: 2,
        ..SimOpts::default()
    };
    opts.gateway_keys.insert("gw-1", gw.public().clone());
    let w = start_sim(opts).await;
    let token = receipts::AccessToken::new("gw-1", &"w-test".into(), receipts::now_ms()).sign(&gw);
    let c = client();
    // Without the token: 401 on every guarded endpoint; probes and the profile stay open.
    for (method, path) in [
        (reqwest::Method::GET, "/v1/kv/events"),
        (reqwest::Method::POST, "/v1/tokenize"),
        (reqwest::Method::GET, "/v1/receipts/anything"),
    ] {
        let r = c
            .request(method.clone(), w.url(path))
            .json(&json!({"prompt": "hi"}))
            .send()
            .await
            .unwrap();
        let (s, e) = error_of(r).await;
        assert_eq!(
            (s, e["code"].as_str()),
            (401, Some("access_required")),
            "{path}"
        );
    }
    for path in ["/health", "/ready", "/v1/profile", "/v1/models"] {
        assert_eq!(
            c.get(w.url(path)).send().await.unwrap().status(),
            200,
            "{path}"
        );
    }
    // With it: served.
    let r = c
        .post(w.url("/v1/tokenize"))
        .bearer_auth(&token)
        .json(&json!({"prompt": "hi"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    // Two subscriptions at once are allowed, a third is refused until one closes.
    let sub = || c.get(w.url("/v1/kv/events")).bearer_auth(&token).send();
    let a = sub().await.unwrap();
    let b = sub().await.unwrap();
    assert_eq!((a.status().as_u16(), b.status().as_u16()), (200, 200));
    let (s, e) = error_of(sub().await.unwrap()).await;
    assert_eq!(
        (s, e["code"].as_str()),
        (429, Some("too_many_subscriptions"))
    );
    drop(a);
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let r = sub().await.unwrap();
        if r.status() == 200 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the closed subscription's permit never returned"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    drop(b);
    w.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_answer_without_a_receipt() {
    let w = start_sim(SimOpts::default()).await;
    let log = w.worker.receipt_log().clone();
    // Non-streaming: the answer is withheld, no header names a receipt.
    log.fail_next_appends(1);
    let r = post(
        &w,
        "/v1/chat/completions",
        &chat_body("unreceipted", json!({})),
    )
    .await;
    assert!(r.headers().get("x-kvgate-receipt").is_none());
    let (s, e) = error_of(r).await;
    assert_eq!((s, e["code"].as_str()), (503, Some("receipt_failed")));
    // A refusal (validation error) whose receipt fails: the same.
    log.fail_next_appends(1);
    let r = post(
        &w,
        "/v1/chat/completions",
        &chat_body("bad", json!({"temperature": 9})),
    )
    .await;
    assert!(r.headers().get("x-kvgate-receipt").is_none());
    let (s, e) = error_of(r).await;
    assert_eq!((s, e["code"].as_str()), (503, Some("receipt_failed")));
    // Streaming: the stream ends with the in-band error instead of [DONE].
    log.fail_next_appends(1);
    let r = post(
        &w,
        "/v1/chat/completions",
        &chat_body("stream", json!({"stream": true, "max_tokens": 3})),
    )
    .await;
    assert_eq!(r.status(), 200);
    let text = r.text().await.unwrap();
    assert!(text.contains("receipt_failed"), "{text}");
    assert!(!text.contains("[DONE]"), "{text}");
    // Once the log takes receipts again, answers are receipted and named.
    let r = post(&w, "/v1/chat/completions", &chat_body("fine", json!({}))).await;
    assert_eq!(r.status(), 200);
    let id = r.headers()["x-kvgate-receipt"].to_str().unwrap().to_owned();
    let _ = r.bytes().await;
    assert_eq!(get_receipt(&w, &id).await.body.status, 200);
    w.stop().await;
}

/// A chat whose rendered prompt ends inside an open `<think>` (here by continuing an assistant
/// message that opened one): with a reasoning parser, the answer is `reasoning_content`, streamed
/// as reasoning deltas; `separate_reasoning: false` leaves it in `content`;
/// `stream_reasoning: false` sends it in one delta.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reasoning_is_separated_streamed_or_held_as_asked() {
    let w = start_sim(SimOpts {
        reasoning_parser: Some(worker::output_parser::ReasoningFormat::Think),
        ..SimOpts::default()
    })
    .await;
    let body = |extra: Value| {
        let mut b = json!({
            "model": "m",
            "messages": [{"role": "user", "content": "2+2?"},
                         {"role": "assistant", "content": "<think>\nLet me"}],
            "add_generation_prompt": false,
            "continue_final_message": true,
            "max_tokens": 6,
            "temperature": 0,
        });
        for (k, v) in extra.as_object().unwrap() {
            b[k] = v.clone();
        }
        b
    };
    let r = post_json(&w, "/v1/chat/completions", &body(json!({}))).await;
    let m = &r["choices"][0]["message"];
    let reasoning = m["reasoning_content"]
        .as_str()
        .unwrap_or_else(|| panic!("{r}"));
    assert!(!reasoning.is_empty(), "{r}");
    assert_eq!(m["content"], "", "{r}");
    assert!(m.get("tool_calls").is_none(), "{r}");

    let r = post_json(
        &w,
        "/v1/chat/completions",
        &body(json!({"separate_reasoning": false})),
    )
    .await;
    let m = &r["choices"][0]["message"];
    assert_eq!(m["content"].as_str(), Some(reasoning), "{r}");
    assert!(m.get("reasoning_content").is_none(), "{r}");

    for (stream_reasoning, most) in [(true, 6), (false, 1)] {
        let chunks = post_sse_json(
            &w,
            "/v1/chat/completions",
            &body(json!({"stream": true, "stream_reasoning": stream_reasoning})),
        )
        .await;
        let deltas: Vec<Value> = chunks
            .iter()
            .filter_map(|c| c["choices"][0]["delta"].get("reasoning_content").cloned())
            .collect();
        let joined: String = deltas.iter().map(|d| d.as_str().unwrap()).collect();
        assert_eq!(joined, reasoning, "{chunks:?}");
        assert!(!deltas.is_empty() && deltas.len() <= most, "{chunks:?}");
        if !stream_reasoning {
            assert_eq!(deltas.len(), 1);
        }
    }
    w.stop().await;
}
