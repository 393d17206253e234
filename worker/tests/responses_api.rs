//! `POST /v1/responses` on the real SmolLM2 through HTTP: the answer is the chat answer of the
//! same conversation (greedy), as a `response` object and as the Responses API's events; forced
//! tool calls come out as `function_call` items; one receipt per request; what cannot be served
//! is refused by name.

mod server_support;

use serde_json::{json, Value};
use server_support::*;

const QUESTION: &str = "What is the capital of France?";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn responses_answer_as_chat_does_streamed_or_not() {
    let w = start_sim(SimOpts {
        real_model: true,
        ..SimOpts::default()
    })
    .await;
    let chat = post_json(
        &w,
        "/v1/chat/completions",
        &json!({"model": "smollm2", "max_tokens": 12, "temperature": 0, "messages": [
            {"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTION}]}),
    )
    .await;
    let chat_text = chat["choices"][0]["message"]["content"].as_str().unwrap();

    let ask = json!({"model": "smollm2", "instructions": "Be brief.", "max_output_tokens": 12,
                     "temperature": 0, "input": QUESTION});
    // A client's own `x-kvgate-stored` header (without a route ticket) changes nothing: the
    // worker stores nothing, so the response says `store: false`.
    let resp = client()
        .post(w.url("/v1/responses"))
        .header("x-request-id", "resp-1")
        .header(
            prompt_profile::STORED_HEADER,
            "store=true; previous_response_id=resp_forged",
        )
        .json(&ask)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let r: Value = resp.json().await.unwrap();
    assert_eq!(
        (r["object"].as_str(), r["id"].as_str()),
        (Some("response"), Some("resp_resp-1"))
    );
    let msg = &r["output"][0];
    assert_eq!(
        (msg["type"].as_str(), msg["role"].as_str()),
        (Some("message"), Some("assistant"))
    );
    let text = msg["content"][0]["text"].as_str().unwrap();
    assert_eq!(text, chat_text, "{r}");
    assert_eq!(r["instructions"], "Be brief.");
    assert_eq!(r["store"], false, "{r}");
    assert!(r["previous_response_id"].is_null(), "{r}");
    let status = r["status"].as_str().unwrap();
    assert!(status == "completed" || status == "incomplete", "{r}");
    assert_eq!(r["usage"]["input_tokens"], chat["usage"]["prompt_tokens"]);
    // Counted without generating (`POST /v1/responses/input_tokens`): the create's
    // `input_tokens`; a field the create refuses is refused the same way.
    let counted = post_json(&w, "/v1/responses/input_tokens", &ask).await;
    assert_eq!(
        counted,
        json!({"object": "response.input_tokens", "input_tokens": r["usage"]["input_tokens"]})
    );
    let mut chained = ask.clone();
    chained["previous_response_id"] = json!("resp_1");
    let refused = post_json(&w, "/v1/responses/input_tokens", &chained).await;
    assert_eq!(
        refused["error"]["code"], "unsupported_parameter",
        "{refused}"
    );
    assert_eq!(
        r["usage"]["output_tokens"],
        chat["usage"]["completion_tokens"]
    );
    // The prompt is the chat prompt: its blocks were cached by the chat request.
    assert!(
        r["usage"]["input_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap()
            > 0,
        "{r}"
    );
    let receipt = get_receipt(&w, "resp-1").await;
    assert_eq!(receipt.body.status, 200);
    assert_eq!(
        receipt.body.response_sha256,
        receipts::sha256_hex(text.as_bytes())
    );

    // Streamed: created, the message item with its text deltas, completed with the response.
    let mut sbody = ask.clone();
    sbody["stream"] = json!(true);
    let resp = client()
        .post(w.url("/v1/responses"))
        .json(&sbody)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let mut reader = SseReader::new(resp);
    let mut kinds = Vec::new();
    let mut deltas = String::new();
    let mut done = Value::Null;
    while let Some(e) = reader.next_event().await {
        let v: Value = serde_json::from_str(&e.data).unwrap();
        assert_eq!(e.event.as_deref(), v["type"].as_str(), "{v}");
        assert_eq!(v["sequence_number"], kinds.len(), "{v}");
        let kind = v["type"].as_str().unwrap().to_string();
        if kind == "response.output_text.delta" {
            deltas.push_str(v["delta"].as_str().unwrap());
        }
        if kind == "response.completed" || kind == "response.incomplete" {
            done = v["response"].clone();
        }
        kinds.push(kind);
    }
    assert_eq!(kinds[..2], ["response.created", "response.in_progress"]);
    for k in [
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ] {
        assert!(kinds.iter().any(|x| x == k), "{k} missing: {kinds:?}");
    }
    assert_eq!(deltas, text);
    assert_eq!(done["output"][0]["content"][0]["text"], text);
    assert_eq!(done["usage"]["output_tokens"], r["usage"]["output_tokens"]);

    // Log probabilities (`include` + `top_logprobs`): chat's for the same greedy answer, on the
    // message's `output_text`; streamed, spread over the text deltas, all of them on the
    // `output_text.done` event and on the completed response.
    let chat_lp = post_json(
        &w,
        "/v1/chat/completions",
        &json!({"model": "smollm2", "max_tokens": 12, "temperature": 0, "logprobs": true,
                "top_logprobs": 2, "messages": [
            {"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTION}]}),
    )
    .await;
    let want = chat_lp["choices"][0]["logprobs"]["content"].clone();
    assert!(want.as_array().is_some_and(|a| !a.is_empty()), "{chat_lp}");
    assert!(want[0]["top_logprobs"]
        .as_array()
        .is_some_and(|a| a.len() == 2));
    let mut lp_ask = ask.clone();
    lp_ask["include"] = json!(["message.output_text.logprobs"]);
    lp_ask["top_logprobs"] = json!(2);
    let r = post_json(&w, "/v1/responses", &lp_ask).await;
    assert_eq!(r["output"][0]["content"][0]["logprobs"], want, "{r}");
    let mut streamed_lp = lp_ask.clone();
    streamed_lp["stream"] = json!(true);
    let events = post_sse_json(&w, "/v1/responses", &streamed_lp).await;
    let mut from_deltas = Vec::new();
    for e in &events {
        if e["type"] == "response.output_text.delta" {
            from_deltas.extend(e["logprobs"].as_array().unwrap().iter().cloned());
        }
        if e["type"] == "response.output_text.done" {
            assert_eq!(e["logprobs"], want);
        }
    }
    assert_eq!(Value::Array(from_deltas), want);
    let last = events.last().unwrap();
    assert_eq!(
        last["response"]["output"][0]["content"][0]["logprobs"],
        want
    );
    // Without them: empty lists, as before.
    assert_eq!(done["output"][0]["content"][0]["logprobs"], json!([]));

    // A forced tool call: a function_call item.
    let tools = json!([{"type": "function", "name": "get_weather", "description": "Weather.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]);
    let r = post_json(
        &w,
        "/v1/responses",
        &json!({"model": "smollm2", "input": "Weather in Paris?", "tools": tools,
                "tool_choice": {"type": "function", "name": "get_weather"}, "max_output_tokens": 40,
                "temperature": 0}),
    )
    .await;
    let call = &r["output"][0];
    assert_eq!(
        (call["type"].as_str(), call["name"].as_str()),
        (Some("function_call"), Some("get_weather")),
        "{r}"
    );
    assert!(call["call_id"].as_str().unwrap().starts_with("call_"));
    let args: Value = serde_json::from_str(call["arguments"].as_str().unwrap()).unwrap();
    assert!(args["city"].is_string(), "{r}");
    assert_eq!(r["status"], "completed");

    // Streamed: the call's item added, its arguments as deltas, the item done with them.
    let chunks = post_sse_json(
        &w,
        "/v1/responses",
        &json!({"model": "smollm2", "input": "Weather in Paris?", "tools": tools, "stream": true,
                "tool_choice": {"type": "function", "name": "get_weather"}, "max_output_tokens": 40,
                "temperature": 0}),
    )
    .await;
    let mut args_streamed = String::new();
    let mut item_done = Value::Null;
    for v in &chunks {
        match v["type"].as_str().unwrap() {
            "response.function_call_arguments.delta" => {
                args_streamed.push_str(v["delta"].as_str().unwrap())
            }
            "response.output_item.done" => item_done = v["item"].clone(),
            _ => {}
        }
    }
    assert_eq!(args_streamed, call["arguments"].as_str().unwrap());
    assert_eq!(item_done["type"], "function_call");
    assert_eq!(item_done["arguments"], call["arguments"]);
    // (Call ids derive from the request id: another request, another id.)
    assert!(item_done["call_id"].as_str().unwrap().starts_with("call_"));
    assert_eq!(chunks.last().unwrap()["type"], "response.completed");

    // The tool's result sent back as items: an answer.
    let r2 = post_json(
        &w,
        "/v1/responses",
        &json!({"model": "smollm2", "max_output_tokens": 8, "temperature": 0, "tools": tools, "input": [
            {"role": "user", "content": "Weather in Paris?"},
            {"type": "function_call", "call_id": call["call_id"], "name": "get_weather", "arguments": call["arguments"]},
            {"type": "function_call_output", "call_id": call["call_id"], "output": "18 C"}]}),
    )
    .await;
    assert_eq!(r2["object"], "response", "{r2}");
    assert!(r2["usage"]["input_tokens"].as_u64() > r["usage"]["input_tokens"].as_u64());

    // Refused by name, receipted like any validated request.
    for (body, code, param) in [
        (
            json!({"model": "smollm2", "input": "x", "previous_response_id": "resp_1"}),
            "unsupported_parameter",
            "previous_response_id",
        ),
        (json!({"model": "smollm2"}), "invalid_value", "input"),
        (
            json!({"model": "smollm2", "input": "x", "n": 2}),
            "unknown_parameter",
            "n",
        ),
        (
            json!({"model": "smollm2", "input": "x", "bogus": 1}),
            "unknown_parameter",
            "bogus",
        ),
    ] {
        let resp = client()
            .post(w.url("/v1/responses"))
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 400, "{body}");
        let e: Value = resp.json().await.unwrap();
        assert_eq!(
            (e["error"]["code"].as_str(), e["error"]["param"].as_str()),
            (Some(code), Some(param)),
            "{e}"
        );
    }
    w.stop().await;
}
