//! Gateway measurements (ignored by default; run on purpose):
//!
//! ```text
//! cargo test --test gateway_bench -- --ignored --nocapture --test-threads 1
//! ```
//!
//! - `route_decision_vs_tokenization`: time of the whole KV-exact decision (parse, salt, render,
//!   tokenize, keys, index lookup over 3 workers, policy) for 1k / 4k / 16k-token chats, beside
//!   rendering + tokenizing alone (the floor). Median of 40 runs each.
//! - `ticket_signing_cost`: a route ticket's sign + encode, RFC 8032 deterministic vs with a
//!   precomputed nonce (`receipts::PrecomputedSigner`).
//!
//! - `short_requests_while_long_prompts_arrive`: p50 / p99 latency of 1-token round-robin
//!   chats while 3 clients keep sending KV-exact prompts that are refused in the end — 4 MiB and
//!   1,000 KiB ones (the byte floor refuses them before tokenizing) and 60 KiB ones (under the
//!   floor: tokenized in full, then refused by the exact count) — with routing on the proxy
//!   threads (`routing_threads = 0`, the old placement) and on the routing pool (the default),
//!   in one run.
//!
//! - `saving_stored_responses`: a full default store of stored responses copied, saved to
//!   `--response-store-file` and read back, beside one plain write of the same bytes.
//!
//! Figures go to `docs/benchmarks.md` (section `## gateway`). The proxy path against nginx and
//! the SGLang model gateway is `scripts/bench-proxy.sh`.

#[path = "gateway_support/mod.rs"]
mod support;

use std::time::{Duration, Instant};

use gateway::route::{decide, RouteInput};
use prompt_profile::{ChatMessage, ChatPrompt, PromptSource};
use support::{Fleet, FleetOptions};

const KV_NO_BUDGET: &str = r#"
[[services]]
name = "chat"
pool = "all"
token_budget = "off"
rule = { type = "kv_exact", profile = "smol" }
"#;

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

#[test]
#[ignore = "measurement; run with --ignored --nocapture"]
fn route_decision_vs_tokenization() {
    let mut fleet = Fleet::workers(FleetOptions::default());
    fleet.start_gateway(KV_NO_BUDGET, false);
    let shared = fleet.gw().data.clone();
    let view = shared.views.load();
    let service = view.services[0].clone();
    let profile = service.profile().cloned().unwrap();
    println!(
        "| prompt tokens | render + tokenize (floor) | full decision | ratio | \
         `tokenizers` pipeline alone | pipeline / floor |"
    );
    println!("|---:|---:|---:|---:|---:|---:|");
    for target in [1_000usize, 4_000, 16_000] {
        // Grow a user message of seeded varied prose (many distinct words, numbers and
        // identifiers, so neither word cache answers for most of it) until the rendered prompt
        // has about `target` tokens.
        let mut reps = target / 3;
        let (body, tokens) = loop {
            let msgs = vec![
                serde_json::json!({"role": "system", "content": "You are a helpful assistant."}),
                serde_json::json!({"role": "user", "content": varied_prose(reps)}),
            ];
            let chat: Vec<ChatMessage> = serde_json::from_value(serde_json::json!(msgs)).unwrap();
            let n = profile
                .tokenize(&PromptSource::Chat(ChatPrompt::new(chat)), None)
                .unwrap()
                .len();
            if n >= target {
                break (
                    serde_json::json!({"model": "smol", "messages": msgs, "max_tokens": 16}),
                    n,
                );
            }
            reps += (target - n) / 3 + 1;
        };
        let bytes = serde_json::to_vec(&body).unwrap();
        let msgs: Vec<prompt_profile::ChatMessage> =
            serde_json::from_value(body["messages"].clone()).unwrap();
        // Index the prompt's keys on one worker so the lookup walks the whole chain.
        let keys = profile
            .keys(&PromptSource::Chat(ChatPrompt::new(msgs.clone())), None)
            .unwrap()
            .keys;
        let w1 = prefix_index::WorkerId("w1".into());
        shared
            .index
            .apply_event(&w1, &prefix_index::KvEvent::Stored { parent: None, keys })
            .unwrap();
        let mut floor = Vec::new();
        let mut full = Vec::new();
        let mut pipeline = Vec::new();
        let rendered = fleet.profile.render_and_encode(&msgs).unwrap().text;
        for _ in 0..40 {
            // A new prompt each time: the piece and word caches start empty.
            fleet.profile.clear_token_cache();
            profile.profile.clear_token_cache();
            let t = Instant::now();
            let ids = fleet.profile.render_and_encode(&msgs).unwrap().ids;
            floor.push(t.elapsed());
            assert!(ids.len() >= target);
            let t = Instant::now();
            let reference = fleet.profile.encode_uncached(&rendered, true).unwrap();
            pipeline.push(t.elapsed());
            assert_eq!(reference, ids);
            fleet.profile.clear_token_cache();
            profile.profile.clear_token_cache();
            let t = Instant::now();
            let (d, _reserved) = decide(
                &view,
                &shared.index,
                &RouteInput {
                    service: service.clone(),
                    path: "/v1/chat/completions".into(),
                    body: bytes.clone().into(),
                    tenant_header: None,
                    tenant: None,
                    claiming: false,
                    numbering: Default::default(),
                },
            )
            .unwrap();
            full.push(t.elapsed());
            assert_eq!(d.order[0], w1);
        }
        let (f, d, p) = (median(floor), median(full), median(pipeline));
        println!(
            "| {tokens} | {:.2} ms | {:.2} ms | {:.2}× | {:.2} ms | {:.2}× |",
            f.as_secs_f64() * 1e3,
            d.as_secs_f64() * 1e3,
            d.as_secs_f64() / f.as_secs_f64(),
            p.as_secs_f64() * 1e3,
            p.as_secs_f64() / f.as_secs_f64()
        );
    }
    fleet.stop();
}

/// `words` words of seeded pseudo-random prose with numbers and identifiers.
fn varied_prose(words: usize) -> String {
    varied_prose_seeded(words, 0)
}

/// [`varied_prose`] from another seed (texts that share no run of words).
fn varied_prose_seeded(words: usize, seed: u64) -> String {
    const WORDS: &[&str] = &[
        "the",
        "gateway",
        "routes",
        "each",
        "request",
        "to",
        "a",
        "worker",
        "holding",
        "longest",
        "cached",
        "prefix",
        "of",
        "its",
        "prompt",
        "while",
        "load",
        "stays",
        "balanced",
        "across",
        "fleet",
        "tokens",
        "blocks",
        "keys",
        "are",
        "salted",
        "and",
        "chained",
        "café",
        "naïve",
        "Straße",
        "résumé",
        "kernel",
        "attention",
        "decode",
        "prefill",
        "batch",
        "scheduler",
    ];
    let mut s = 0x9E37_79B9_7F4A_7C15u64 ^ seed.wrapping_mul(0xD1B5_4A32_D192_ED03);
    let mut out = String::new();
    for i in 0..words {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        out.push(' ');
        match s % 7 {
            0 => out.push_str(&format!("{}", s % 100_000)),
            1 => out.push_str(&format!("id_{:x}", s % 65_536)),
            _ => out.push_str(WORDS[(s >> 8) as usize % WORDS.len()]),
        }
        if i % 17 == 16 {
            out.push_str(".\n");
        }
    }
    out
}

#[test]
#[ignore = "measurement; run with --ignored --nocapture"]
fn ticket_signing_cost() {
    // What every routed request pays for its signed route ticket (canonical JSON + Ed25519).
    let key = receipts::KeyPair::generate();
    let ticket = receipts::RouteTicket {
        request_id: "0f0e7a4e-2b1c-4d8e-9a57-3c1d2e4f5a6b".into(),
        gateway_id: "gateway".into(),
        key_id: key.key_id().clone(),
        service: "chat".into(),
        rule_id: "chat/round_robin".into(),
        rule_version: 3,
        mode: receipts::RouteMode::RoundRobin,
        worker: "w1".into(),
        predicted_matched_tokens: None,
        prompt_tokens: None,
        last_block_key: None,
        namespace_seed: prefix_index::NamespaceSeed([0; 32]),
        hash_algorithm: prefix_index::HashAlgorithm::Xxh3,
        issued_at_ms: 1,
        expires_at_ms: 2,
    };
    let n = 2_000u32;
    let t = Instant::now();
    let mut len = 0;
    for _ in 0..n {
        len += ticket.sign(&key).header().len();
    }
    let deterministic = t.elapsed() / n;
    // The gateway's signer: nonces computed ahead by its thread (wait until they are ready, so
    // this times the request path's part only).
    let signer = receipts::PrecomputedSigner::new(key.clone(), n as usize).unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while signer.ready() < n as usize && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    let t = Instant::now();
    for _ in 0..n {
        len += ticket.sign(&signer).header().len();
    }
    let precomputed = t.elapsed() / n;
    println!(
        "ticket sign + encode per request: {:.1} µs with RFC 8032 deterministic signing, \
         {:.1} µs with a precomputed nonce ({:?}; header {} bytes)",
        deterministic.as_secs_f64() * 1e6,
        precomputed.as_secs_f64() * 1e6,
        signer.stats(),
        len / (2 * n as usize)
    );
}

const MIXED: &str = r#"
[[services]]
name = "rr"
pool = "all"
match = { models = ["rr"] }
rule = { type = "round_robin" }

[[services]]
name = "exact"
pool = "all"
match = { models = ["smol"] }
rule = { type = "kv_exact", profile = "smol" }
"#;

#[test]
#[ignore = "measurement; run with --ignored --nocapture"]
fn short_requests_while_long_prompts_arrive() {
    println!("| routing | long prompt | short p50 | short p99 | short max | long refused / s |");
    println!("|---|---:|---:|---:|---:|---:|");
    for routing_threads in [0usize, 2] {
        for long_bytes in [4usize << 20, 1000 << 10, 60 << 10] {
            let mut fleet = Fleet::workers(FleetOptions {
                workers: 2,
                ..FleetOptions::default()
            });
            fleet.start_gateway_with(MIXED, false, |c| {
                c.routing_threads = routing_threads;
                // The proxy's own threads: the VIP serves with 2, as by default.
                c.threads = 2;
            });
            let url = fleet.url("/v1/chat/completions");
            let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
            // Prompts the tokenizer must see are all different (a counter first), so its piece
            // cache never answers for them; they are built before the measurement, so the
            // clients cost no CPU while it runs. (Prompts the byte floor refuses are never
            // tokenized: one body serves.)
            let filler = "many words here ".repeat(long_bytes / 16);
            let distinct = if long_bytes <= 64 << 10 { 600 } else { 1 };
            let bodies: std::sync::Arc<Vec<bytes::Bytes>> = std::sync::Arc::new(
                (0..distinct)
                    .map(|n| {
                        serde_json::to_vec(&serde_json::json!({
                            "model": "smol",
                            "messages": [{"role": "user", "content": format!("{n} {filler}")}],
                            "max_tokens": 4,
                        }))
                        .unwrap()
                        .into()
                    })
                    .collect(),
            );
            let (lat, answered) = fleet.rt.block_on(async {
                let mut long_clients = Vec::new();
                for c in 0..3usize {
                    let (url, stop, bodies) = (url.clone(), stop.clone(), bodies.clone());
                    long_clients.push(tokio::spawn(async move {
                        let http = reqwest::Client::new();
                        let mut answered = 0u32;
                        let mut n = c * 200;
                        while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                            n += 1;
                            let r = http
                                .post(&url)
                                .header("content-type", "application/json")
                                .body(bodies[n % bodies.len()].clone())
                                .send()
                                .await;
                            if r.is_ok_and(|r| r.status() == 400) {
                                answered += 1;
                            }
                        }
                        answered
                    }));
                }
                tokio::time::sleep(Duration::from_millis(300)).await;
                let window = Instant::now();
                let http = reqwest::Client::new();
                let mut lat = Vec::new();
                for i in 0..150 {
                    let t = Instant::now();
                    let r = http
                        .post(&url)
                        .json(&serde_json::json!({"model": "rr", "messages": [{"role": "user", "content": format!("hi {i}")}], "max_tokens": 1}))
                        .send()
                        .await
                        .unwrap();
                    assert_eq!(r.status(), 200);
                    let _ = r.bytes().await;
                    lat.push(t.elapsed());
                }
                stop.store(true, std::sync::atomic::Ordering::Relaxed);
                let seconds = (window.elapsed() + Duration::from_millis(300)).as_secs_f64();
                let mut answered = 0;
                for h in long_clients {
                    answered += h.await.unwrap();
                }
                (lat, f64::from(answered) / seconds)
            });
            let mut lat = lat;
            lat.sort();
            let pct = |q: f64| lat[((lat.len() - 1) as f64 * q) as usize].as_secs_f64() * 1e3;
            println!(
                "| {} | {} KiB | {:.1} ms | {:.1} ms | {:.1} ms | {answered:.0} |",
                if routing_threads == 0 {
                    "proxy threads"
                } else {
                    "routing pool (2)"
                },
                long_bytes >> 10,
                pct(0.5),
                pct(0.99),
                pct(1.0),
            );
            fleet.stop();
        }
    }
}

/// The gateway's added work for a Responses API request that continues a stored conversation
/// (`previous_response_id`): `response_store::prepare` — parse, read the stored turns, rebuild
/// and write the body — beside the KV-exact decision on the body it produces (with the prompt
/// caches emptied, as for a new prompt, and warm, as for a conversation whose earlier turns
/// this gateway tokenized before). Conversations of 4, 16 and 64 turns (user ~150 words,
/// answer ~50 words each). Median of 40 runs each.
#[test]
#[ignore = "measurement; run with --ignored --nocapture"]
fn continuing_a_stored_conversation() {
    use gateway::response_store::{prepare, ResponseStore, StoreLimits, StoredResponse};
    let mut fleet = Fleet::workers(FleetOptions::default());
    fleet.start_gateway(KV_NO_BUDGET, false);
    let shared = fleet.gw().data.clone();
    let view = shared.views.load();
    let service = view.services[0].clone();
    let profile = service.profile().cloned().unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    println!(
        "| turns | body bytes | prompt tokens | prepare | decision, caches empty | decision, caches warm | prepare / decision (empty, warm) |"
    );
    println!("|---:|---:|---:|---:|---:|---:|---:|");
    let mut conversations = Vec::new();
    for turns in [4usize, 16, 64] {
        let store = ResponseStore::new(StoreLimits::DEFAULT);
        let mut chain = Vec::new();
        for t in 0..turns {
            let id = format!("resp_bench_{t}");
            let input = vec![serde_json::json!({"role": "user", "content": [
                {"type": "input_text", "text": varied_prose_seeded(150, 2 * t as u64 + 1)}]})];
            let response = serde_json::json!({"id": id, "object": "response", "status": "completed",
                "output": [{"type": "message", "id": format!("msg_{t}"), "status": "completed", "role": "assistant",
                            "content": [{"type": "output_text", "text": varied_prose_seeded(50, 2 * t as u64 + 2), "annotations": [], "logprobs": []}]}]});
            store
                .insert(StoredResponse::new(
                    id.clone(),
                    None,
                    chain.clone(),
                    input,
                    response,
                ))
                .unwrap();
            chain.push(id);
        }
        let body = serde_json::json!({"model": "smol", "previous_response_id": chain.last(),
                                      "input": "And what came after that?", "max_output_tokens": 16});
        let body = serde_json::to_vec(&body).unwrap();
        let (mut prep, mut cold, mut warm) = (Vec::new(), Vec::new(), Vec::new());
        let mut sent = bytes::Bytes::new();
        for _ in 0..40 {
            let t = Instant::now();
            let p = rt
                .block_on(prepare(&store, None, &body, None, u64::MAX))
                .unwrap();
            prep.push(t.elapsed());
            sent = p.body.unwrap();
            for (clear, out) in [(true, &mut cold), (false, &mut warm)] {
                if clear {
                    profile.profile.clear_token_cache();
                }
                let input = RouteInput {
                    service: service.clone(),
                    path: "/v1/responses".into(),
                    body: sent.clone(),
                    tenant_header: None,
                    tenant: None,
                    claiming: false,
                    numbering: Default::default(),
                };
                let t = Instant::now();
                let (d, _reserved) = decide(&view, &shared.index, &input).unwrap();
                out.push(t.elapsed());
                assert!(d.prompt.is_some());
            }
        }
        let tokens = {
            let input = RouteInput {
                service: service.clone(),
                path: "/v1/responses".into(),
                body: sent.clone(),
                tenant_header: None,
                tenant: None,
                claiming: false,
                numbering: Default::default(),
            };
            decide(&view, &shared.index, &input)
                .unwrap()
                .0
                .prompt
                .unwrap()
                .prompt_tokens
        };
        let (p, c, w) = (median(prep), median(cold), median(warm));
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        println!(
            "| {turns} | {} | {tokens} | {:.3} ms | {:.2} ms | {:.2} ms | {:.2}×, {:.2}× |",
            sent.len(),
            ms(p),
            ms(c),
            ms(w),
            ms(p) / ms(c),
            ms(p) / ms(w)
        );
        conversations.push((turns, chain.clone(), store, w));
    }
    // The same turns held as one conversation (`conversation` instead of
    // `previous_response_id`): the request written with its items, and a turn's two items
    // appended to it (what an answer's end does, on the record here; the record put back after
    // each run, so every run appends to the same size).
    println!();
    println!(
        "| turns | record bytes | prepare, conversation | prepare, previous_response_id | a turn appended | decision, caches warm | appended / decision |"
    );
    println!("|---:|---:|---:|---:|---:|---:|---:|");
    for (turns, chain, store, warm) in conversations {
        use gateway::conversation;
        let mut items = Vec::new();
        for id in &chain {
            let t = store.peek(id).unwrap();
            items.extend(t.input_items());
            items.extend(t.output_items().iter().cloned());
        }
        let record = conversation::create("bench", None, 0, None, items);
        let (id, bytes) = (record.id.clone(), record.bytes());
        let record = std::sync::Arc::new(record);
        store.insert(record.clone()).unwrap();
        let body = serde_json::json!({"model": "smol", "conversation": id,
                                      "input": "And what came after that?", "max_output_tokens": 16});
        let body = serde_json::to_vec(&body).unwrap();
        let previous = serde_json::json!({"model": "smol", "previous_response_id": chain.last(),
                                          "input": "And what came after that?", "max_output_tokens": 16});
        let previous = serde_json::to_vec(&previous).unwrap();
        let turn = vec![
            serde_json::json!({"type": "message", "role": "user", "id": "msg_new_0",
                               "content": [{"type": "input_text", "text": "And what came after that?"}]}),
            serde_json::json!({"type": "message", "role": "assistant", "id": "msg_new_1",
                               "content": [{"type": "output_text", "text": varied_prose_seeded(50, 999), "annotations": []}]}),
        ];
        let (mut conv, mut prev, mut append) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..40 {
            let t = Instant::now();
            rt.block_on(prepare(&store, None, &body, None, u64::MAX))
                .unwrap();
            conv.push(t.elapsed());
            let t = Instant::now();
            rt.block_on(prepare(&store, None, &previous, None, u64::MAX))
                .unwrap();
            prev.push(t.elapsed());
            let change = conversation::append(turn.clone());
            let t = Instant::now();
            conversation::change_here(&store, &id, None, &change).unwrap();
            append.push(t.elapsed());
            store.delete(&id);
            store.insert(record.clone()).unwrap();
        }
        let (c, p, a) = (median(conv), median(prev), median(append));
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        println!(
            "| {turns} | {bytes} | {:.3} ms | {:.3} ms | {:.3} ms | {:.2} ms | {:.2}× |",
            ms(c),
            ms(p),
            ms(a),
            ms(warm),
            ms(a) / ms(warm)
        );
    }
    fleet.stop();
}

/// Keeping stored responses across a restart (`--response-store-file`): a full default store
/// (64 MiB of turns of a ~1,000-word user message and a ~300-word answer) copied under the
/// store's lock (`snapshot`, the only part that holds the request path), written to the file
/// (serialize, write, fsync, rename: the saver's background work) and read back into an empty
/// store (the start), beside writing the same bytes with one `std::fs::write` + fsync (the
/// floor). Median of 5 runs each.
#[test]
#[ignore = "measurement; run with --ignored --nocapture"]
fn saving_stored_responses() {
    use gateway::response_file::{load, save};
    use gateway::response_store::{ResponseStore, StoreLimits, StoredResponse};
    use receipts::now_ms;
    let store = ResponseStore::new(StoreLimits::DEFAULT);
    let mut t = 0u64;
    loop {
        let id = format!("resp_save_{t}");
        let input = vec![serde_json::json!({"role": "user", "content": [
            {"type": "input_text", "text": varied_prose_seeded(1000, 2 * t + 1)}]})];
        let response = serde_json::json!({"id": id, "object": "response", "status": "completed",
            "output": [{"type": "message", "id": format!("msg_{t}"), "status": "completed", "role": "assistant",
                        "content": [{"type": "output_text", "text": varied_prose_seeded(300, 2 * t + 2), "annotations": [], "logprobs": []}]}]});
        let r = StoredResponse::new(id, None, Vec::new(), input, response);
        let (_, bytes) = store.stats();
        if bytes + r.bytes() > StoreLimits::DEFAULT.max_bytes {
            break;
        }
        store.insert(r).unwrap();
        t += 1;
    }
    let (turns, bytes) = store.stats();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("responses.jsonl");
    let floor_path = dir.path().join("floor.bin");
    let (mut snap, mut saving, mut reading, mut floor) = (vec![], vec![], vec![], vec![]);
    let mut written = 0;
    for _ in 0..5 {
        let t0 = Instant::now();
        let copy = store.snapshot();
        snap.push(t0.elapsed());
        let t0 = Instant::now();
        written = save(&path, &copy, &Default::default(), now_ms()).unwrap();
        saving.push(t0.elapsed());
        let back = ResponseStore::new(StoreLimits::DEFAULT);
        let t0 = Instant::now();
        let report = load(&path, &back, now_ms()).unwrap();
        reading.push(t0.elapsed());
        assert_eq!(report.restored, turns, "{report:?}");
        let data = std::fs::read(&path).unwrap();
        let t0 = Instant::now();
        std::fs::write(&floor_path, &data).unwrap();
        std::fs::File::open(&floor_path)
            .unwrap()
            .sync_all()
            .unwrap();
        floor.push(t0.elapsed());
    }
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let (snap, saving, reading, floor) =
        (median(snap), median(saving), median(reading), median(floor));
    println!("{turns} turns, {bytes} bytes in the store, a {written}-byte file");
    println!("| step | median | / the floor |");
    println!("|---|---:|---:|");
    println!(
        "| snapshot (under the store's lock) | {:.2} ms | {:.3} |",
        ms(snap),
        ms(snap) / ms(floor)
    );
    println!(
        "| save (serialize, write, fsync, rename) | {:.1} ms | {:.2} |",
        ms(saving),
        ms(saving) / ms(floor)
    );
    println!(
        "| read back into an empty store | {:.1} ms | {:.2} |",
        ms(reading),
        ms(reading) / ms(floor)
    );
    println!(
        "| floor: one write + fsync of the same bytes | {:.1} ms | 1 |",
        ms(floor)
    );
}
