//! JSON mode (`response_format: {"type": "json_object"}`) and `logit_bias` through the worker's
//! HTTP API: on the real SmolLM2 model, a question that unconstrained gets a sentence gets a
//! JSON object (checked by `serde_json`), streamed the same; on the simulated engine (whose
//! logits know nothing of JSON) the answer is still a JSON object or, cut by `max_tokens`, a
//! prefix of one; the request checks.

mod server_support;

use serde_json::{json, Value};
use server_support::*;

fn ask(extra: Value, max_tokens: u64) -> Value {
    let mut body = json!({
        "model": "smollm2",
        "messages": [
            {"role": "system", "content": "You are a concise assistant."},
            {"role": "user", "content": "What is the capital of France? Give the city and the country."}
        ],
        "max_tokens": max_tokens,
        "temperature": 0
    });
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    body
}

async fn answer(w: &TestWorker, body: &Value) -> (String, String) {
    let r = post_json(w, "/v1/chat/completions", body).await;
    let text = r["choices"][0]["message"]["content"]
        .as_str()
        .unwrap_or_else(|| panic!("{r}"))
        .to_owned();
    let finish = r["choices"][0]["finish_reason"]
        .as_str()
        .unwrap()
        .to_owned();
    (text, finish)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_mode_turns_a_real_answer_into_a_json_object() {
    let w = start_sim(SimOpts {
        real_model: true,
        ..SimOpts::default()
    })
    .await;
    // Unconstrained, the model answers in prose.
    let (prose, _) = answer(&w, &ask(json!({}), 40)).await;
    assert!(
        serde_json::from_str::<Value>(&prose).is_err(),
        "already JSON without the mode: {prose}"
    );
    // In JSON mode: a complete object, ended by the model itself.
    let mode = json!({"response_format": {"type": "json_object"}});
    let (text, finish) = answer(&w, &ask(mode.clone(), 120)).await;
    assert_eq!(finish, "stop", "{text}");
    let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"));
    assert!(v.is_object(), "{text}");
    println!("JSON mode answer: {text}");
    // Streamed: the same text.
    let mut body = ask(mode, 120);
    body["stream"] = json!(true);
    let resp = client()
        .post(w.url("/v1/chat/completions"))
        .json(&body)
        .send()
        .await
        .unwrap();
    let events = read_sse(resp).await;
    let streamed: String = events[..events.len() - 1]
        .iter()
        .filter_map(|e| {
            serde_json::from_str::<Value>(e).unwrap()["choices"][0]["delta"]["content"]
                .as_str()
                .map(str::to_owned)
        })
        .collect();
    assert_eq!(streamed, text);
    // Structured outputs: the schema's properties, in its order, of its types.
    let schema = json!({"type": "object", "additionalProperties": false,
    "required": ["city", "country", "population_millions", "capital"],
    "properties": {
        "city": {"type": "string"},
        "country": {"type": "string"},
        "population_millions": {"type": ["number", "null"]},
        "capital": {"type": "boolean"}
    }});
    let structured = json!({"response_format": {"type": "json_schema",
        "json_schema": {"name": "city", "strict": true, "schema": schema}}});
    let (text, finish) = answer(&w, &ask(structured, 120)).await;
    assert_eq!(finish, "stop", "{text}");
    let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"));
    let keys: Vec<&String> = v.as_object().unwrap().keys().collect();
    assert_eq!(
        keys,
        ["city", "country", "population_millions", "capital"],
        "{text}"
    );
    assert!(v["city"].is_string() && v["country"].is_string(), "{text}");
    assert!(v["population_millions"].is_number() || v["population_millions"].is_null());
    assert!(v["capital"].is_boolean(), "{text}");
    println!("structured answer: {text}");
    // logit_bias bans the token the greedy answer started with; the answer changes.
    let first = profile().encode(&prose, false).unwrap()[0];
    let mut banned = ask(json!({}), 40);
    banned["logit_bias"] = json!({ first.to_string(): -100 });
    let (other, _) = answer(&w, &banned).await;
    assert!(!other.is_empty());
    assert_ne!(
        profile().encode(&other, false).unwrap()[0],
        first,
        "{prose} / {other}"
    );
    w.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_mode_holds_on_logits_that_know_nothing_of_json() {
    let w = start_sim(SimOpts::default()).await;
    let mode = json!({"response_format": {"type": "json_object"}, "temperature": 1.0});
    let mut complete = 0;
    for seed in 0..12 {
        let mut body = ask(mode.clone(), 64);
        body["seed"] = json!(seed);
        let (text, finish) = answer(&w, &body).await;
        match finish.as_str() {
            "stop" => {
                let v: Value =
                    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"));
                assert!(v.is_object(), "{text}");
                complete += 1;
            }
            "length" => {
                assert!(
                    engine::constraint::json_object_prefix(text.as_bytes()).is_some(),
                    "not a JSON object prefix: {text}"
                );
            }
            other => panic!("{other}: {text}"),
        }
    }
    println!("{complete} of 12 simulated answers completed their object");
    // A schema holds the simulated engine too: its keys, in order, when it completes.
    let schema = json!({"type": "object", "properties": {
        "ok": {"type": "boolean"}, "n": {"type": "integer"}, "tag": {"enum": ["a", "b"]}},
        "required": ["ok", "n", "tag"]});
    let mut schema_complete = 0;
    let mut answers = Vec::new();
    for seed in 0..12 {
        let mut body = ask(
            json!({"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}},
                   "temperature": 1.0, "seed": seed}),
            48,
        );
        body["max_tokens"] = json!(48);
        let (text, finish) = answer(&w, &body).await;
        answers.push(text.clone());
        if finish == "stop" {
            let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"));
            let keys: Vec<&String> = v.as_object().unwrap().keys().collect();
            assert_eq!(keys, ["ok", "n", "tag"], "{text}");
            assert!(v["ok"].is_boolean() && v["n"].as_f64().is_some_and(|n| n.fract() == 0.0));
            assert!(["a", "b"].contains(&v["tag"].as_str().unwrap()), "{text}");
            schema_complete += 1;
        } else {
            assert!(
                engine::constraint::json_object_prefix(text.as_bytes()).is_some(),
                "{text}"
            );
        }
    }
    println!("{schema_complete} of 12 simulated schema answers completed");
    // Counted by format.
    let metrics = metrics_text(&w).await;
    for line in [
        "kvgate_worker_constrained_requests_total{format=\"json_object\"} 12",
        "kvgate_worker_constrained_requests_total{format=\"json_schema\"} 12",
        // The schema was compiled once, for the first request; the other eleven reused it.
        "kvgate_worker_schema_cache_lookups_total{result=\"miss\"} 1",
        "kvgate_worker_schema_cache_lookups_total{result=\"hit\"} 11",
        "kvgate_worker_schema_cache_entries 1",
    ] {
        assert!(metrics.contains(line), "{line}\n{metrics}");
    }
    w.stop().await;
    // A worker that keeps no schema compiles each request's and gives the same answers.
    let fresh = start_sim(SimOpts {
        schema_cache_bytes: 0,
        ..SimOpts::default()
    })
    .await;
    for (seed, kept) in answers.iter().enumerate() {
        let mut body = ask(
            json!({"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}},
                   "temperature": 1.0, "seed": seed}),
            48,
        );
        body["max_tokens"] = json!(48);
        let (text, _) = answer(&fresh, &body).await;
        assert_eq!(&text, kept, "seed {seed}");
    }
    let metrics = metrics_text(&fresh).await;
    for line in [
        "kvgate_worker_schema_cache_lookups_total{result=\"miss\"} 12",
        "kvgate_worker_schema_cache_entries 0",
    ] {
        assert!(metrics.contains(line), "{line}\n{metrics}");
    }
    fresh.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_mode_and_logit_bias_are_checked() {
    let w = start_sim(SimOpts::default()).await;
    let vocab = profile().vocab_size();
    for (extra, code, param) in [
        (
            json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
                "type": "object", "properties": {"a": {"type": "string", "pattern": "(?=x)"}}}}}}),
            "unsupported_parameter",
            "response_format",
        ),
        (
            json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string"}}}}),
            "unsupported_parameter",
            "response_format",
        ),
        (
            json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}),
            "invalid_value",
            "response_format",
        ),
        (
            json!({"response_format": {"type": "yaml"}}),
            "invalid_value",
            "response_format",
        ),
        (
            json!({"response_format": "json_object"}),
            "invalid_type",
            "response_format",
        ),
        (
            json!({"response_format": {"type": "json_object"},
                   "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]}),
            "unsupported_parameter",
            "response_format",
        ),
        (
            json!({"logit_bias": {"x": 1}}),
            "invalid_value",
            "logit_bias",
        ),
        (
            json!({"logit_bias": {"5": 101}}),
            "invalid_value",
            "logit_bias",
        ),
        (
            json!({"logit_bias": {"5": "1"}}),
            "invalid_value",
            "logit_bias",
        ),
        (json!({"logit_bias": [1]}), "invalid_type", "logit_bias"),
        (
            json!({"logit_bias": { vocab.to_string(): 1 }}),
            "invalid_value",
            "logit_bias",
        ),
    ] {
        let resp = client()
            .post(w.url("/v1/chat/completions"))
            .json(&ask(extra.clone(), 4))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 400, "{extra}");
        let e: Value = resp.json().await.unwrap();
        assert_eq!(
            (e["error"]["code"].as_str(), e["error"]["param"].as_str()),
            (Some(code), Some(param)),
            "{extra}: {e}"
        );
    }
    // The neutral and valid forms are served.
    for extra in [
        json!({"response_format": {"type": "text"}}),
        json!({"response_format": {"type": "json_object"}, "tools": [], "tool_choice": "none"}),
        json!({"logit_bias": {"5": -100, "7": 2.5}}),
        json!({"logit_bias": {}}),
    ] {
        let resp = client()
            .post(w.url("/v1/chat/completions"))
            .json(&ask(extra.clone(), 4))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200, "{extra}");
    }
    w.stop().await;
}
