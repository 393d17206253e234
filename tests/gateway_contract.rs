//! The contracts between gateway and worker, through real HTTP: the same prompt gives the same
//! token ids and block keys on both sides (special-token text included), round-robin tickets
//! carry the hash algorithm the worker runs, and the gateway's KV-event subscriber rebuilds a
//! worker's cache from a snapshot exactly.

#[path = "gateway_support/mod.rs"]
mod support;

use std::time::Duration;

use prefix_index::{HashAlgorithm, WorkerId};
use support::{Fleet, FleetOptions, KV_SERVICE, RR_SERVICE};

/// A completion prompt holding special-token text, long enough for several full blocks.
fn special_token_prompt() -> String {
    format!(
        "<|im_start|>system\n{}<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
        "You are a careful assistant. ".repeat(6)
    )
}

#[test]
fn special_token_text_gives_the_gateways_keys_on_the_worker() {
    let mut fleet = Fleet::workers(FleetOptions {
        workers: 2,
        ..FleetOptions::default()
    });
    fleet.start_gateway(KV_SERVICE, false);
    let body =
        serde_json::json!({"model": "smol", "prompt": special_token_prompt(), "max_tokens": 2});
    let r = fleet.post("/v1/completions", &body, &[]);
    assert_eq!(r.status, 200, "{}", r.text());
    let (worker, receipt, ticket) = fleet.routed(&r);
    // The gateway's count and last block key (in the ticket) are the worker's (in its receipt).
    assert_eq!(
        ticket.prompt_tokens,
        Some(receipt.body.prompt_tokens),
        "prompt tokens differ"
    );
    assert!(receipt.body.prompt_tokens >= 32, "{receipt:?}");
    assert!(ticket.last_block_key.is_some());
    assert_eq!(ticket.last_block_key, receipt.body.last_block_key);
    // Special-token text is one control token on both sides, not its characters.
    let ids = fleet
        .profile
        .prompt_ids(&prompt_profile::PromptSource::Text(special_token_prompt()))
        .unwrap();
    assert_eq!(ids[0], fleet.profile.token_to_id("<|im_start|>").unwrap());
    assert_eq!(ids.len() as u32, receipt.body.prompt_tokens);

    // The worker's metrics carry predicted vs observed cached tokens per service and rule:
    // repeat the prompt until the gateway predicts a hit (its index learned the blocks), then
    // the counters equal the sums over the tickets and receipts of that worker.
    let mut sums = [
        u64::from(ticket.predicted_matched_tokens.unwrap()),
        u64::from(receipt.body.cached_tokens),
    ];
    let mut predicted_hit = false;
    for _ in 0..50 {
        let r = fleet.post("/v1/completions", &body, &[]);
        assert_eq!(r.status, 200, "{}", r.text());
        let (w, rc, t) = fleet.routed(&r);
        if w == worker {
            sums[0] += u64::from(t.predicted_matched_tokens.unwrap());
            sums[1] += u64::from(rc.body.cached_tokens);
        }
        if w == worker && t.predicted_matched_tokens.unwrap() > 0 {
            assert!(
                rc.body.cached_tokens > 0,
                "predicted a hit the engine did not see"
            );
            predicted_hit = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(
        predicted_hit,
        "the gateway never predicted the repeated prompt's blocks"
    );
    let metrics_url = format!("http://{}/metrics", fleet.addrs[worker]);
    let text = fleet.rt.block_on(async {
        fleet
            .http
            .get(&metrics_url)
            .header("authorization", fleet.worker_access(worker))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap()
    });
    for kind in ["predicted", "cached"] {
        let line = text
            .lines()
            .find(|l| {
                l.starts_with("kvgate_worker_routed_prefix_tokens_total{")
                    && l.contains(&format!("kind=\"{kind}\""))
                    && l.contains("service=\"chat\"")
            })
            .unwrap_or_else(|| panic!("no {kind} series in\n{text}"));
        let value: u64 = line.rsplit(' ').next().unwrap().parse().unwrap();
        let want = if kind == "predicted" {
            sums[0]
        } else {
            sums[1]
        };
        assert!(want > 0);
        assert_eq!(value, want, "{line}");
    }
    fleet.stop();
}

/// A completion that asks its prompt's log probabilities (`echo` with `logprobs`) reuses no
/// cached prefix on the worker; the gateway, reading the same rule
/// (`prompt_profile::scores_prompt`), predicts none for it even where its index holds the
/// prompt — while the same prompt without them is predicted and served from the cache. The two
/// sides' prompt counts and last block keys agree for both.
#[test]
fn a_scored_prompt_is_predicted_uncached_as_the_worker_serves_it() {
    let mut fleet = Fleet::workers(FleetOptions {
        workers: 2,
        ..FleetOptions::default()
    });
    fleet.start_gateway(KV_SERVICE, false);
    let prompt = special_token_prompt();
    let plain = serde_json::json!({"model": "smol", "prompt": prompt, "max_tokens": 2});
    let mut predicted = false;
    for _ in 0..50 {
        let r = fleet.post("/v1/completions", &plain, &[]);
        assert_eq!(r.status, 200, "{}", r.text());
        let (_, receipt, ticket) = fleet.routed(&r);
        if ticket.predicted_matched_tokens.unwrap() > 0 {
            assert!(
                receipt.body.cached_tokens > 0,
                "predicted a hit the engine did not see"
            );
            predicted = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(predicted, "the gateway never predicted the prompt's blocks");
    for stream in [false, true] {
        let scored = serde_json::json!({"model": "smol", "prompt": prompt, "max_tokens": 0,
                                        "echo": true, "logprobs": 1, "stream": stream});
        let r = fleet.post("/v1/completions", &scored, &[]);
        assert_eq!(r.status, 200, "{}", r.text());
        let (_, receipt, ticket) = fleet.routed(&r);
        assert_eq!(ticket.predicted_matched_tokens, Some(0), "stream {stream}");
        assert_eq!(receipt.body.cached_tokens, 0, "stream {stream}");
        assert_eq!(receipt.body.completion_tokens, 0);
        assert_eq!(ticket.prompt_tokens, Some(receipt.body.prompt_tokens));
        assert_eq!(ticket.last_block_key, receipt.body.last_block_key);
        if !stream {
            let v: serde_json::Value = serde_json::from_str(&r.text()).unwrap();
            assert_eq!(v["choices"][0]["text"], prompt.as_str());
            let lps = v["choices"][0]["logprobs"]["token_logprobs"]
                .as_array()
                .unwrap();
            assert_eq!(lps.len() as u32, receipt.body.prompt_tokens);
            assert!(lps[0].is_null() && lps[1..].iter().all(|l| l.as_f64().is_some()));
        }
    }
    fleet.stop();
}

#[test]
fn a_sha256_worker_behind_round_robin_answers() {
    let mut fleet = Fleet::workers(FleetOptions {
        workers: 2,
        hash_algorithm: HashAlgorithm::Sha256,
        ..FleetOptions::default()
    });
    fleet.start_gateway(RR_SERVICE, false);
    for i in 0..4 {
        let r = fleet.post(
            "/v1/chat/completions",
            &support::chat(&[("user", &format!("hello {i}"))], 2),
            &[],
        );
        assert_eq!(r.status, 200, "{}", r.text());
        let id = r.header("x-request-id").unwrap();
        let w: usize = r.worker().trim_start_matches('w').parse::<usize>().unwrap() - 1;
        let receipt = fleet.receipt(w, &id).unwrap();
        let t = receipt.body.ticket.unwrap();
        assert_eq!(t.ticket_unverified().hash_algorithm, HashAlgorithm::Sha256);
    }
    fleet.stop();
}

#[test]
fn a_snapshot_rebuilds_the_workers_cache_in_the_gateways_index() {
    // Direct requests fill the caches: tickets optional.
    let mut fleet = Fleet::workers(FleetOptions {
        workers: 2,
        ticket_policy: worker::TicketPolicy::Optional,
        ..FleetOptions::default()
    });
    // Fill both caches with several separate chains before any gateway subscribes: the first
    // subscription then gets `cleared` and a snapshot of several `stored` envelopes, all with
    // the same seq.
    let client = reqwest::Client::new();
    for (i, addr) in fleet.addrs.clone().iter().enumerate() {
        for c in 0..5 {
            let body = support::chat(
                &[(
                    "user",
                    &format!("worker {i} chain {c}: {}", "tell me a story. ".repeat(6)),
                )],
                3,
            );
            let status = fleet.rt.block_on(async {
                client
                    .post(format!("http://{addr}/v1/chat/completions"))
                    .json(&body)
                    .send()
                    .await
                    .unwrap()
                    .status()
            });
            assert!(status.is_success(), "{status}");
        }
    }
    // A KV-exact service: the gateway reads only the event streams of workers one routes to.
    fleet.start_gateway(KV_SERVICE, false);
    for (i, w) in fleet.workers.iter().enumerate() {
        let w = w.as_ref().unwrap();
        let want = w.engine().kv_events().keys();
        assert!(
            want.len() >= 10,
            "worker {i} cached only {} keys",
            want.len()
        );
        let id = WorkerId(format!("w{}", i + 1));
        fleet.wait_for(
            &format!("worker {i}'s snapshot in the gateway's index"),
            Duration::from_secs(10),
            || fleet.gw().data.index.precise_keys_of(&id).unwrap() == want,
        );
    }
    fleet.stop();
}

/// A fake worker speaking just enough HTTP/1.1 for the gateway's background tasks: `/ready` is
/// 200, `/v1/profile` 404, the n-th `GET /v1/kv/events` gets `streams[n]` (SSE lines), and
/// `POST /v1/chat/completions` a worker's 429 (`Retry-After: 7`, its own error body); then the
/// connection closes. Returns its address and the request heads it saw.
fn fake_worker(
    rt: &tokio::runtime::Runtime,
    streams: Vec<String>,
) -> (
    std::net::SocketAddr,
    std::sync::Arc<parking_lot::Mutex<Vec<String>>>,
) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = rt
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .unwrap();
    let addr = listener.local_addr().unwrap();
    let seen = std::sync::Arc::new(parking_lot::Mutex::new(Vec::new()));
    let log = seen.clone();
    let streams = std::sync::Arc::new(parking_lot::Mutex::new(
        streams
            .into_iter()
            .collect::<std::collections::VecDeque<_>>(),
    ));
    rt.spawn(async move {
        loop {
            let Ok((mut sock, _)) = listener.accept().await else {
                return;
            };
            let log = log.clone();
            let streams = streams.clone();
            tokio::spawn(async move {
                let mut buf = vec![0u8; 4096];
                let mut got = Vec::new();
                while !got.windows(4).any(|w| w == b"\r\n\r\n") {
                    match sock.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => got.extend_from_slice(&buf[..n]),
                    }
                }
                let head = String::from_utf8_lossy(&got).into_owned();
                let line = head.lines().next().unwrap_or_default().to_owned();
                log.lock().push(head.split("\r\n\r\n").next().unwrap_or_default().to_owned());
                let reply = if line.starts_with("GET /ready") {
                    "HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok".to_owned()
                } else if line.starts_with("GET /v1/kv/events") {
                    let body = streams.lock().pop_front().unwrap_or_default();
                    format!("HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n{body}")
                } else if line.starts_with("POST /v1/chat/completions") {
                    let body = WORKER_429_BODY;
                    format!(
                        "HTTP/1.1 429 Too Many Requests\r\ncontent-type: application/json\r\nretry-after: 7\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                        body.len()
                    )
                } else {
                    "HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\nconnection: close\r\n\r\n".to_owned()
                };
                let _ = sock.write_all(reply.as_bytes()).await;
                let _ = sock.shutdown().await;
            });
        }
    });
    (addr, seen)
}

const WORKER_429_BODY: &str =
    r#"{"error":{"message":"queue full","type":"server_error","param":null,"code":"queue_full"}}"#;

#[test]
fn worker_429s_pass_through_and_tenant_keys_stay_at_the_gateway() {
    use sha2::Digest;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let (addr, seen) = fake_worker(&rt, vec![]);
    let dir = tempfile::tempdir().unwrap();
    let rules = dir.path().join("rules.toml");
    let key_hash = hex::encode(sha2::Sha256::digest(b"acme-secret"));
    std::fs::write(
        &rules,
        format!(
            "[gateway]\nhealth_interval_ms = 50\n[[workers]]\nid = \"f\"\nurl = \"http://{addr}\"\n\
             [[pools]]\nid = \"p\"\nworkers = [\"f\"]\n\
             [[tenants]]\nid = \"acme\"\napi_keys_sha256 = [\"{key_hash}\"]\n\
             [[services]]\nname = \"chat\"\npool = \"p\"\nauth = \"api_key\"\nrule = {{ type = \"round_robin\" }}\n"
        ),
    )
    .unwrap();
    let mut gw = gateway::spawn(gateway::GatewayConfig::new(
        &rules,
        receipts::KeyPair::generate(),
    ))
    .unwrap();
    let url = format!("http://{}/v1/chat/completions", gw.listen_addr);
    let body = r#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#;
    let http = reqwest::Client::new();
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let (status, retry_after, text) = loop {
        let r = rt.block_on(
            http.post(&url)
                .header("authorization", "Bearer acme-secret")
                .header("content-type", "application/json")
                .body(body)
                .send(),
        );
        let r = r.unwrap();
        let status = r.status().as_u16();
        // Until the health check marks the fake worker up the gateway answers 503.
        if status != 503 || std::time::Instant::now() > deadline {
            let retry = r
                .headers()
                .get("retry-after")
                .map(|v| v.to_str().unwrap().to_owned());
            break (status, retry, rt.block_on(r.text()).unwrap());
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    // The worker's 429 reaches the client unchanged: status, Retry-After, its own error body.
    assert_eq!(status, 429, "{text}");
    assert_eq!(retry_after.as_deref(), Some("7"));
    assert_eq!(text, WORKER_429_BODY);
    // The tenant's key was checked at the gateway and not sent on.
    let heads = seen.lock().clone();
    let post = heads
        .iter()
        .find(|h| h.starts_with("POST /v1/chat/completions"))
        .expect("the request reached the worker");
    assert!(
        !post.to_ascii_lowercase().contains("authorization"),
        "{post}"
    );
    assert!(!post.contains("acme-secret"), "{post}");
    gw.shutdown();
}

fn sse(epoch: u64, seq: u64, event: &str) -> String {
    format!("data: {{\"epoch\":{epoch},\"seq\":{seq},{event}}}\n\n")
}

#[test]
fn the_subscriber_survives_the_largest_seq_and_follows_a_new_epoch() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let k1 = "00000000000000a1";
    let k2 = "00000000000000b2";
    let streams = vec![
        // A snapshot at the largest seq, then the stream ends.
        sse(7, u64::MAX, r#""type":"cleared""#)
            + &sse(
                7,
                u64::MAX,
                &format!(r#""type":"stored","parent":null,"keys":["{k1}"]"#),
            )
            + &sse(
                7,
                u64::MAX,
                &format!(r#""type":"stored","parent":null,"keys":["{k2}"]"#),
            ),
        // The worker restarted: a new epoch with one key.
        sse(
            8,
            1,
            &format!(r#""type":"stored","parent":null,"keys":["{k2}"]"#),
        ),
    ];
    let (addr, seen) = fake_worker(&rt, streams);
    // A KV-exact service over the fake worker (the gateway reads only the event streams of
    // workers one routes to); its profile pinned from a real worker's.
    let real = Fleet::workers(FleetOptions {
        workers: 1,
        ..FleetOptions::default()
    });
    let dir = tempfile::tempdir().unwrap();
    let rules = dir.path().join("rules.toml");
    std::fs::write(
        &rules,
        format!(
            "[gateway]\nhealth_interval_ms = 50\n[[workers]]\nid = \"f\"\nurl = \"http://{addr}\"\n\
             [[pools]]\nid = \"p\"\nworkers = [\"f\"]\n{}{}",
            real.profile_toml("smol", 16),
            KV_SERVICE.replace("\"all\"", "\"p\"")
        ),
    )
    .unwrap();
    let mut gw = gateway::spawn(gateway::GatewayConfig::new(
        &rules,
        receipts::KeyPair::generate(),
    ))
    .unwrap();
    let id = WorkerId("f".into());
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let keys = gw.data.index.precise_keys_of(&id).unwrap();
        if keys == vec![prefix_index::BlockKey(0xb2)] {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "index never followed the new epoch: {keys:?}; requests: {:?}",
            seen.lock()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    // The second subscription resumed from the last applied position.
    let resumed = format!("since_epoch=7&since_seq={}", u64::MAX);
    assert!(
        seen.lock().iter().any(|l| l.contains(&resumed)),
        "{:?}",
        seen.lock()
    );
    gw.shutdown();
}

#[path = "../prompt-profile/tests/fixture_dir/mod.rs"]
mod fixture_dir;
use fixture_dir::llama_models;

/// A Hugging Face folder: SmolLM2's tokenizer with Qwen 3's chat template (tools, reasoning,
/// `enable_thinking`), the way a Qwen 3 fleet's `tokenizer_config.json` pins it.
fn qwen3_template_folder(profile: &prompt_profile::PromptProfile) -> (tempfile::TempDir, String) {
    let dir = tempfile::tempdir().unwrap();
    let template =
        std::fs::read_to_string(llama_models().join("templates/Qwen-Qwen3-0.6B.jinja")).unwrap();
    std::fs::write(
        dir.path().join("tokenizer.json"),
        profile.tokenizer_json().unwrap(),
    )
    .unwrap();
    let cfg = serde_json::json!({
        "eos_token": "<|im_end|>",
        "model_max_length": 8192,
        "chat_template": template,
    });
    std::fs::write(
        dir.path().join("tokenizer_config.json"),
        serde_json::to_vec(&cfg).unwrap(),
    )
    .unwrap();
    (dir, template)
}

/// Render with the independent jinja2 reference (tests/python_support).
fn jinja2_render(
    template: &str,
    messages: &serde_json::Value,
    tools: &serde_json::Value,
    kwargs: &serde_json::Value,
) -> String {
    jinja2_try_render(template, messages, tools, kwargs, None, Some("<|im_end|>"))
        .unwrap_or_else(|e| panic!("reference: {e}"))
}

/// The jinja2 reference's text, or its error.
fn jinja2_try_render(
    template: &str,
    messages: &serde_json::Value,
    tools: &serde_json::Value,
    kwargs: &serde_json::Value,
    bos: Option<&str>,
    eos: Option<&str>,
) -> Result<String, String> {
    use std::io::Write;
    let script = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/python_support/chat_template_reference.py");
    let mut child = std::process::Command::new(python_support::python())
        .arg(script)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("the reference renderer");
    let req = serde_json::json!({
        "template": template, "messages": messages, "tools": tools,
        "add_generation_prompt": true, "continue_final_message": false,
        "kwargs": kwargs, "bos_token": bos, "eos_token": eos,
    });
    child
        .stdin
        .take()
        .unwrap()
        .write_all(&serde_json::to_vec(&req).unwrap())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "the reference renderer failed");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    if v["ok"] == true {
        Ok(v["text"].as_str().unwrap().to_owned())
    } else {
        Err(v["error"].as_str().unwrap_or("").to_owned())
    }
}

#[path = "python_support/mod.rs"]
mod python_support;

#[test]
fn tools_reasoning_and_template_kwargs_give_the_gateways_keys_on_the_worker() {
    let base = prompt_profile::PromptProfile::from_gguf(support::model_path()).unwrap();
    let (hf, template) = qwen3_template_folder(&base);
    let mut fleet = Fleet::workers(FleetOptions {
        workers: 2,
        hf_profile: Some(hf.path().to_path_buf()),
        ..FleetOptions::default()
    });
    fleet.start_gateway(KV_SERVICE, false);
    let tools = serde_json::json!([{
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather now in a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                           "required": ["city"]}
        }
    }]);
    // As the official client sends them: tool-call arguments as a JSON string.
    let messages = serde_json::json!([
        {"role": "system", "content": "You are a careful assistant. ".repeat(4)},
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": "", "reasoning_content": "The user wants Paris.",
         "tool_calls": [{"id": "call_1", "type": "function",
                         "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, clear"},
        {"role": "user", "content": [{"type": "text", "text": "And tomorrow?"}]}
    ]);
    // What transformers and vLLM give the template: arguments parsed, text parts joined.
    let mut reference_messages = messages.clone();
    reference_messages[2]["tool_calls"][0]["function"]["arguments"] =
        serde_json::json!({"city": "Paris"});
    reference_messages[4]["content"] = serde_json::json!("And tomorrow?");

    let mut counts = Vec::new();
    for (with_tools, thinking) in [(true, false), (true, true), (false, false)] {
        let mut body = serde_json::json!({
            "model": "smol", "messages": messages, "max_tokens": 2,
            "chat_template_kwargs": {"enable_thinking": thinking},
        });
        if with_tools {
            body["tools"] = tools.clone();
            body["tool_choice"] = serde_json::json!("auto");
        }
        let r = fleet.post("/v1/chat/completions", &body, &[]);
        assert_eq!(r.status, 200, "{}", r.text());
        let (worker, receipt, ticket) = fleet.routed(&r);
        // The gateway's count and last block key (ticket) are the worker's (receipt).
        assert_eq!(ticket.prompt_tokens, Some(receipt.body.prompt_tokens));
        assert!(ticket.last_block_key.is_some());
        assert_eq!(ticket.last_block_key, receipt.body.last_block_key);

        // The worker's rendered prompt is jinja2's, text for text.
        let mut tok = body.clone();
        tok.as_object_mut().unwrap().remove("max_tokens");
        let worker_url = format!("http://{}/v1/tokenize", fleet.addrs[worker]);
        let t: serde_json::Value = fleet.rt.block_on(async {
            fleet
                .http
                .post(&worker_url)
                .header("authorization", fleet.worker_access(worker))
                .json(&tok)
                .send()
                .await
                .unwrap()
                .json()
                .await
                .unwrap()
        });
        let expected = jinja2_render(
            &template,
            &reference_messages,
            if with_tools {
                &tools
            } else {
                &serde_json::Value::Null
            },
            &serde_json::json!({"enable_thinking": thinking}),
        );
        assert_eq!(t["prompt"].as_str(), Some(expected.as_str()), "{t}");
        assert_eq!(t["count"].as_u64(), Some(receipt.body.prompt_tokens as u64));
        assert_eq!(with_tools, expected.contains("<tools>"));
        assert_eq!(!thinking, expected.ends_with("<think>\n\n</think>\n\n"));
        counts.push(receipt.body.prompt_tokens);
    }
    // Dropping tools or the kwargs would be visible: each variant is a different prompt.
    assert_ne!(counts[0], counts[1]);
    assert_ne!(counts[0], counts[2]);
    fleet.stop();
}

/// Every complete profile of llama.cpp's tokenizer test set (the vocabulary-only GGUFs that
/// carry a chat template: Command R, Gemma 4, Phi-3, Qwen 2, Qwen 3.5) and the default model:
/// a chat body with tools, a tool-call history, reasoning and template kwargs gives the same
/// prompt tokens and last block key at the gateway (ticket) and the worker (receipt), and the
/// worker's rendered prompt is jinja2's; a template that refuses the conversation is refused
/// by both sides and by jinja2.
#[test]
fn every_profile_of_the_test_set_agrees_between_gateway_and_worker() {
    let models = llama_models();
    let mut profiles: Vec<std::path::PathBuf> =
        ["command-r", "gemma-4", "phi-3", "qwen2", "qwen35"]
            .iter()
            .map(|f| models.join(format!("ggml-vocab-{f}.gguf")))
            .collect();
    profiles.push(support::model_path());
    let tools = serde_json::json!([{
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather now.",
                     "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}
    }]);
    let messages = serde_json::json!([
        {"role": "system", "content": "You are a careful assistant. ".repeat(4)},
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": "", "reasoning_content": "Paris, so call the tool.",
         "tool_calls": [{"id": "call_1", "type": "function",
                         "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
        {"role": "user", "content": "Thanks. And tomorrow?"}
    ]);
    let mut reference_messages = messages.clone();
    reference_messages[2]["tool_calls"][0]["function"]["arguments"] =
        serde_json::json!({"city": "Paris"});
    let kwargs = serde_json::json!({"enable_thinking": false});
    let with_tools = serde_json::json!({
        "model": "smol", "messages": messages, "tools": tools, "max_tokens": 2,
        "chat_template_kwargs": kwargs,
    });
    let plain_messages = serde_json::json!([
        {"role": "system", "content": "You are a careful assistant. ".repeat(4)},
        {"role": "user", "content": "What is the weather in Paris?"}
    ]);
    let plain = serde_json::json!({"model": "smol", "messages": plain_messages, "max_tokens": 2});
    let cases = [
        (
            "tools",
            with_tools,
            reference_messages,
            tools.clone(),
            kwargs.clone(),
        ),
        (
            "plain",
            plain,
            plain_messages.clone(),
            serde_json::Value::Null,
            serde_json::json!({}),
        ),
    ];
    let mut report = Vec::new();
    let mut agreed = 0;
    for gguf in &profiles {
        let name = gguf.file_stem().unwrap().to_string_lossy().into_owned();
        let mut fleet = Fleet::workers(FleetOptions {
            workers: 1,
            gguf_profile: Some(gguf.clone()),
            ..FleetOptions::default()
        });
        fleet.start_gateway(KV_SERVICE, false);
        let p = fleet.profile.clone();
        let bos = p.bos_token_id().and_then(|id| p.id_to_token(id));
        let eos = p.eos_token_ids().first().and_then(|&id| p.id_to_token(id));
        for (case, body, reference_messages, tools, kwargs) in &cases {
            let name = format!("{name} / {case}");
            let expected = jinja2_try_render(
                p.template_source(),
                reference_messages,
                tools,
                kwargs,
                bos.as_deref(),
                eos.as_deref(),
            );
            let r = fleet.post("/v1/chat/completions", body, &[]);
            let mut tok = body.clone();
            tok.as_object_mut().unwrap().remove("max_tokens");
            let worker_url = format!("http://{}/v1/tokenize", fleet.addrs[0]);
            let (t_status, t): (u16, serde_json::Value) = fleet.rt.block_on(async {
                let resp = fleet
                    .http
                    .post(&worker_url)
                    .header("authorization", fleet.worker_access(0))
                    .json(&tok)
                    .send()
                    .await
                    .unwrap();
                (resp.status().as_u16(), resp.json().await.unwrap())
            });
            match &expected {
                Ok(text) => {
                    assert_eq!(r.status, 200, "{name}: {}", r.text());
                    let (_, receipt, ticket) = fleet.routed(&r);
                    assert_eq!(
                        ticket.prompt_tokens,
                        Some(receipt.body.prompt_tokens),
                        "{name}"
                    );
                    assert!(ticket.last_block_key.is_some(), "{name}");
                    assert_eq!(ticket.last_block_key, receipt.body.last_block_key, "{name}");
                    assert_eq!(t_status, 200, "{name}: {t}");
                    assert_eq!(t["prompt"].as_str(), Some(text.as_str()), "{name}");
                    assert_eq!(
                        t["count"].as_u64(),
                        Some(u64::from(receipt.body.prompt_tokens))
                    );
                    agreed += 1;
                    report.push(format!(
                        "{name}: {} tokens, identical{}",
                        receipt.body.prompt_tokens,
                        if *case == "plain" || text.contains("get_weather") {
                            ""
                        } else {
                            " (this template renders neither tools nor tool calls)"
                        }
                    ));
                }
                Err(e) => {
                    assert_eq!(
                        r.status,
                        400,
                        "{name}: jinja2 refused ({e}) but: {}",
                        r.text()
                    );
                    assert_eq!(
                        t_status, 400,
                        "{name}: jinja2 refused ({e}) but the worker: {t}"
                    );
                    report.push(format!(
                        "{name}: refused by jinja2, gateway and worker ({e})"
                    ));
                }
            }
        }
        fleet.stop();
    }
    println!("{}", report.join("\n"));
    assert!(agreed >= 10, "{}", report.join("\n"));
}
