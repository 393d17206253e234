//! Forced tool calls (`tool_choice: "required"` or a named function) through the worker's HTTP
//! API, on the real SmolLM2 model (which has no tool-call format of its own): the answer is
//! held to the call's JSON by constrained decoding and given out as `tool_calls`, streamed the
//! same, for every choice; `auto` leaves the model's prose alone.

mod server_support;

use serde_json::{json, Value};
use server_support::*;

fn tools() -> Value {
    json!([
        {"type": "function", "function": {
            "name": "get_weather",
            "description": "The current weather in a city.",
            "parameters": {"type": "object",
                           "properties": {"city": {"type": "string"},
                                          "unit": {"enum": ["celsius", "fahrenheit"]}},
                           "required": ["city"]}}},
        {"type": "function", "function": {
            "name": "get_time",
            "description": "The time in a time zone.",
            "parameters": {"type": "object",
                           "properties": {"zone": {"$ref": "#/$defs/Zone"}},
                           "required": ["zone"],
                           "$defs": {"Zone": {"enum": ["UTC", "CET", "PST"]}}}}}
    ])
}

fn ask(choice: Value, extra: Value) -> Value {
    let mut body = json!({
        "model": "smollm2",
        "messages": [
            {"role": "system", "content": "You are a helpful assistant with tools."},
            {"role": "user", "content": "What is the weather like in Paris today?"}
        ],
        "tools": tools(),
        "tool_choice": choice,
        "max_tokens": 60,
        "temperature": 0
    });
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    body
}

/// Checks one choice's call against the tools' parameters; returns (name, arguments).
fn call_of(choice: &Value) -> (String, Value) {
    let calls = calls_of(choice);
    assert_eq!(calls.len(), 1, "{choice}");
    calls.into_iter().next().unwrap()
}

/// Checks one choice's calls (at least one) against the tools' parameters; returns them as
/// (name, arguments), in order.
fn calls_of(choice: &Value) -> Vec<(String, Value)> {
    assert_eq!(choice["finish_reason"], "tool_calls", "{choice}");
    let m = &choice["message"];
    assert!(m["content"].is_null(), "{choice}");
    let calls = m["tool_calls"]
        .as_array()
        .unwrap_or_else(|| panic!("{choice}"));
    assert!(!calls.is_empty() && calls.len() <= 16, "{choice}");
    calls.iter().map(checked_call).collect()
}

/// One call's type, id, name and arguments checked against its tool's parameters.
fn checked_call(c: &Value) -> (String, Value) {
    assert_eq!(c["type"], "function");
    assert!(c["id"].as_str().unwrap().starts_with("call_"), "{c}");
    let name = c["function"]["name"].as_str().unwrap().to_string();
    let args: Value = serde_json::from_str(c["function"]["arguments"].as_str().unwrap())
        .unwrap_or_else(|e| panic!("{e}: {c}"));
    match name.as_str() {
        "get_weather" => {
            // `unit` is optional: left out, or one of its values.
            let keys: Vec<&String> = args.as_object().unwrap().keys().collect();
            assert!(keys == ["city"] || keys == ["city", "unit"], "{args}");
            assert!(args["city"].is_string(), "{args}");
            assert!(
                args.get("unit")
                    .is_none_or(|u| u == "celsius" || u == "fahrenheit"),
                "{args}"
            );
        }
        "get_time" => assert!(
            ["UTC", "CET", "PST"].contains(&args["zone"].as_str().unwrap_or_default()),
            "{args}"
        ),
        other => panic!("{other}"),
    }
    (name, args)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forced_tool_calls_are_held_to_the_tools_schemas() {
    let w = start_sim(SimOpts {
        real_model: true,
        ..SimOpts::default()
    })
    .await;
    // `auto`: SmolLM2 has no tool-call format; it answers in prose, no calls.
    let r = post_json(&w, "/v1/chat/completions", &ask(json!("auto"), json!({}))).await;
    assert!(r["choices"][0]["message"]["tool_calls"].is_null(), "{r}");
    assert!(r["choices"][0]["message"]["content"].is_string(), "{r}");

    // A named function: its arguments.
    let named = json!({"type": "function", "function": {"name": "get_time"}});
    let r = post_json(&w, "/v1/chat/completions", &ask(named.clone(), json!({}))).await;
    let (name, args) = call_of(&r["choices"][0]);
    assert_eq!(name, "get_time");
    println!("named: get_time {args}");

    // `required`: calls of them, the model choosing which and how many (OpenAI's default
    // `parallel_tool_calls`: a list of 1 to 16 calls).
    let r = post_json(
        &w,
        "/v1/chat/completions",
        &ask(json!("required"), json!({})),
    )
    .await;
    let calls = calls_of(&r["choices"][0]);
    println!("required: {calls:?}");

    // `parallel_tool_calls: false`: exactly one call.
    let r = post_json(
        &w,
        "/v1/chat/completions",
        &ask(json!("required"), json!({"parallel_tool_calls": false})),
    )
    .await;
    let (name, args) = call_of(&r["choices"][0]);
    println!("required, one call: {name} {args}");

    // Streamed: the calls arrive as tool_calls deltas (id, name, then the arguments, by
    // index) that accumulate to the same calls; the last choice chunk's finish reason is
    // `tool_calls`.
    let chunks = post_sse_json(
        &w,
        "/v1/chat/completions",
        &ask(json!("required"), json!({"stream": true})),
    )
    .await;
    let mut streamed: Vec<(String, String)> = Vec::new();
    let mut finish = String::new();
    for c in &chunks {
        let Some(ch) = c["choices"].as_array().and_then(|a| a.first()) else {
            continue;
        };
        for d in ch["delta"]["tool_calls"].as_array().into_iter().flatten() {
            let i = d["index"].as_u64().unwrap() as usize;
            if streamed.len() <= i {
                streamed.resize(i + 1, Default::default());
            }
            streamed[i]
                .0
                .push_str(d["function"]["name"].as_str().unwrap_or_default());
            streamed[i]
                .1
                .push_str(d["function"]["arguments"].as_str().unwrap_or_default());
        }
        if let Some(f) = ch["finish_reason"].as_str() {
            finish = f.to_string();
        }
    }
    assert_eq!(finish, "tool_calls");
    let streamed: Vec<(String, Value)> = streamed
        .into_iter()
        .map(|(n, a)| (n, serde_json::from_str::<Value>(&a).unwrap()))
        .collect();
    assert_eq!(streamed, calls);

    // Every choice is a call (sampled, so they may differ), with ids of their own. One call
    // each: sampled, this small model repeats calls in a list until `max_tokens` cuts it.
    let r = post_json(
        &w,
        "/v1/chat/completions",
        &ask(
            json!("required"),
            json!({"n": 3, "temperature": 0.7, "seed": 4, "max_tokens": 200,
                   "parallel_tool_calls": false}),
        ),
    )
    .await;
    let choices = r["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 3);
    let mut ids = std::collections::BTreeSet::new();
    let mut made = 0;
    for c in choices {
        made += calls_of(c).len();
        for call in c["message"]["tool_calls"].as_array().unwrap() {
            ids.insert(call["id"].as_str().unwrap().to_string());
        }
    }
    assert_eq!(ids.len(), made, "{r}");

    // A list cut by max_tokens inside its first call: no whole call, the text is content.
    let r = post_json(
        &w,
        "/v1/chat/completions",
        &ask(json!("required"), json!({"max_tokens": 6})),
    )
    .await;
    let c = &r["choices"][0];
    assert_eq!(c["finish_reason"], "length", "{r}");
    assert!(c["message"]["tool_calls"].is_null(), "{r}");
    assert!(
        c["message"]["content"]
            .as_str()
            .is_some_and(|t| t.starts_with('[')),
        "{r}"
    );

    // Cut by max_tokens: the named call's arguments so far, finish reason `length`.
    let r = post_json(
        &w,
        "/v1/chat/completions",
        &ask(named, json!({"max_tokens": 3})),
    )
    .await;
    let c = &r["choices"][0];
    assert_eq!(c["finish_reason"], "length", "{r}");
    assert_eq!(
        c["message"]["tool_calls"][0]["function"]["name"],
        "get_time"
    );
    let m = metrics_text(&w).await;
    assert!(
        m.contains("kvgate_worker_constrained_requests_total{format=\"tool_call\"} 7"),
        "{m}"
    );
    // Three schemas compiled (get_time's arguments; a list of calls of either tool; one
    // call of either), each kept for the requests after it.
    for line in [
        "kvgate_worker_schema_cache_lookups_total{result=\"miss\"} 3",
        "kvgate_worker_schema_cache_lookups_total{result=\"hit\"} 4",
        "kvgate_worker_schema_cache_entries 3",
    ] {
        assert!(m.contains(line), "{line}\n{m}");
    }
    w.stop().await;
}
