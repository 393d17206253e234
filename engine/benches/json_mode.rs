//! What JSON mode and structured outputs cost per generated token: the mask
//! (`engine::constraint`, `engine::json_schema`) over the default model's 49,152-token
//! vocabulary in several states of a JSON text, beside the model's own
//! single-stream decode step, measured in the same run (the ratio is the figure to read).
//!
//! ```text
//! cargo bench -p engine --bench json_mode                # release profile
//! cargo test -p engine --bench json_mode -- --bench      # the (optimized) dev profile
//! ```
//! Environment: `KVGATE_MODEL_DIR` (default `models/`), `KVGATE_BENCH_THREADS` (default 2).
//! Without `--bench` (as `cargo test --all-targets` runs it) it only says how to run.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use engine::model::{bench, EngineBenchConfig};
use engine::{Constraint, TokenTable};

fn main() {
    if !std::env::args().any(|a| a == "--bench") {
        println!("json_mode bench: run with `cargo bench -p engine --bench json_mode`");
        return;
    }
    let dir = std::env::var_os("KVGATE_MODEL_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models"));
    let path = dir.join("SmolLM2-135M-Instruct.Q4_1.gguf");
    if !path.is_file() {
        eprintln!(
            "model file {} is missing (./scripts/fetch-model.sh)",
            path.display()
        );
        std::process::exit(2);
    }
    let profile = prompt_profile::PromptProfile::from_gguf(&path).expect("profile");
    let built = Instant::now();
    let table = Arc::new(TokenTable::new(profile.token_bytes()));
    println!(
        "token table: {} tokens, built in {:.1} ms",
        table.len(),
        built.elapsed().as_secs_f64() * 1e3
    );
    let stop = profile.end_of_generation_ids().to_vec();
    let mut logits = vec![0.0f32; table.len()];
    let mut mask_us = Vec::new();
    let schema = Arc::new(
        engine::json_schema::CompiledSchema::compile(&serde_json::json!({
            "type": "object",
            "properties": {
                "name": {"type": "string"},
                "population": {"type": ["integer", "null"]},
                "tags": {"type": "array", "items": {"enum": ["big", "old", "coastal"]}}
            }
        }))
        .expect("schema"),
    );
    // Strings held to a `format` or a `pattern` and a bounded integer (engine::text_pattern):
    // compiled per request, so their compile time is a cost too.
    let held = serde_json::json!({
        "type": "object",
        "properties": {
            "when": {"type": "string", "format": "date-time"},
            "mail": {"type": "string", "format": "email"},
            "ip": {"type": "string", "format": "ipv6"},
            "id": {"type": "string", "format": "uuid"},
            "note": {"type": "string", "pattern": "(cat|dog)s?"},
            "n": {"type": "integer", "minimum": 1, "maximum": 500}
        }
    });
    let mut compile_us = f64::INFINITY;
    let mut compiled = None;
    for _ in 0..5 {
        let t = Instant::now();
        compiled = Some(engine::json_schema::CompiledSchema::compile(&held).expect("schema"));
        compile_us = compile_us.min(t.elapsed().as_secs_f64() * 1e6);
    }
    println!("compile a schema with date-time, email, ipv6, uuid, a pattern and a bounded integer: {compile_us:.0} µs");
    schema_cache_rows(&held, compile_us);
    let held = Constraint::JsonSchema(table.clone(), Arc::new(compiled.expect("compiled")));
    let constrained = |schema: serde_json::Value| {
        Constraint::JsonSchema(
            table.clone(),
            Arc::new(engine::json_schema::CompiledSchema::compile(&schema).expect("schema")),
        )
    };
    // An untagged union (pydantic's `Union[Person, Company]`): both alternatives begin
    // `{"name":`, so the automaton keeps two runs through the name.
    let union = constrained(serde_json::json!({
        "type": "object",
        "properties": {"owner": {"anyOf": [
            {"type": "object", "properties": {"name": {"type": "string"}, "email": {"type": "string"}}, "required": ["name", "email"]},
            {"type": "object", "properties": {"name": {"type": "string"}, "vat": {"type": "string"}}, "required": ["name", "vat"]}
        ]}},
        "required": ["owner"]
    }));
    let object = Constraint::JsonObject(table.clone());
    let structured = Constraint::JsonSchema(table.clone(), schema);
    // A dict and an any-value (pydantic's `dict[str, int]` and `Any`).
    let dict = constrained(serde_json::json!({
        "type": "object",
        "properties": {
            "counts": {"type": "object", "additionalProperties": {"type": "integer"}},
            "extra": {}
        },
        "required": ["counts", "extra"]
    }));
    for (state, constraint, text) in [
        ("before the object", &object, ""),
        ("after a key's colon", &object, "{\"name\": "),
        ("inside a string", &object, "{\"name\": \"Par"),
        ("after a value", &object, "{\"name\": \"Paris\""),
        ("schema: before a key", &structured, "{\"name\": \"Paris\","),
        ("schema: in a string", &structured, "{\"name\": \"Par"),
        (
            "schema: in an enum",
            &structured,
            "{\"name\": \"P\", \"population\": null, \"tags\": [\"co",
        ),
        ("format: in a date-time", &held, "{\"when\": \"2025-03-1"),
        ("format: in an email", &held, "{\"mail\": \"ada"),
        ("pattern: found anywhere", &held, "{\"note\": \"my"),
        ("integer: 1..=500", &held, "{\"n\": 4"),
        (
            "union: 2 runs, in a string",
            &union,
            "{\"owner\": {\"name\": \"Ac",
        ),
        (
            "union: 2 runs, before a key",
            &union,
            "{\"owner\": {\"name\": \"Acme\",",
        ),
        ("dict: in a key", &dict, "{\"counts\": {\"app"),
        ("dict: after an entry", &dict, "{\"counts\": {\"apple\": 3"),
        ("any: a value begins", &dict, "{\"counts\": {}, \"extra\": "),
        (
            "union: 1 run, in a string",
            &union,
            "{\"owner\": {\"name\": \"Acme\", \"vat\": \"Ac",
        ),
    ] {
        let mut c = constraint.start();
        for id in profile.encode(text, false).expect("encode") {
            c.advance(id);
        }
        let mut best = f64::INFINITY;
        for _ in 0..3 {
            let n: u32 = 200;
            let t = Instant::now();
            for i in 0..n {
                logits
                    .iter_mut()
                    .enumerate()
                    .for_each(|(j, l)| *l = ((i as usize + j) % 97) as f32);
                assert!(c.mask(&mut logits, &stop));
            }
            best = best.min(t.elapsed().as_secs_f64() / f64::from(n) * 1e6);
        }
        let allowed = logits.iter().filter(|l| l.is_finite()).count();
        println!("mask {state:<24} {best:>8.1} µs per token ({allowed} tokens allowed)");
        mask_us.push(best);
    }
    let threads = std::env::var("KVGATE_BENCH_THREADS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(2);
    let mut cfg = EngineBenchConfig::new(path, threads);
    cfg.concurrency = vec![1];
    cfg.prefill_tokens = 64;
    let report = bench::run(&cfg).expect("engine bench");
    let step_us = 1e6 / report.decode_tok_s;
    let worst = mask_us.iter().copied().fold(0.0, f64::max);
    println!(
        "decode step (1 stream, {threads} threads): {step_us:.0} µs; the costliest mask is {:.1} % of it",
        worst / step_us * 100.0
    );
}

/// The compiled-schema cache (`engine::schema_cache`) beside compiling: the same schema sent
/// again costs its key (the schema's JSON text) and a lookup. Rows: the six-property schema
/// above, and an agent's eight tools forced with `tool_choice: "required"`.
fn schema_cache_rows(held: &serde_json::Value, compile_us: f64) {
    use engine::json_schema::CompiledSchema;
    use engine::schema_cache::{SchemaCache, SchemaKey};
    let string = serde_json::json!({"type": "string"});
    let tools: Vec<(String, serde_json::Value)> = (0..8)
        .map(|i| {
            (
                format!("tool_{i}"),
                serde_json::json!({
                    "type": "object",
                    "properties": {
                        "query": string,
                        "limit": {"type": "integer", "minimum": 1, "maximum": 100},
                        "order": {"enum": ["asc", "desc"]},
                        "since": {"type": "string", "format": "date"},
                        "filters": {"type": "array", "items": {"type": "object", "properties": {
                            "field": string, "value": {"type": ["string", "number", "null"]}}}}
                    },
                    "required": ["query"]
                }),
            )
        })
        .collect();
    let refs: Vec<(&str, &serde_json::Value)> =
        tools.iter().map(|(n, p)| (n.as_str(), p)).collect();
    let mut calls_us = f64::INFINITY;
    for _ in 0..5 {
        let t = Instant::now();
        CompiledSchema::compile_calls(&refs).expect("calls");
        calls_us = calls_us.min(t.elapsed().as_secs_f64() * 1e6);
    }
    let cache = SchemaCache::new(32 << 20);
    let hit_us = |key: &dyn Fn() -> SchemaKey| {
        let mut best = f64::INFINITY;
        for _ in 0..200 {
            let t = Instant::now();
            cache
                .get_or_compile(key(), || -> Result<CompiledSchema, ()> {
                    unreachable!("kept")
                })
                .expect("hit");
            best = best.min(t.elapsed().as_secs_f64() * 1e6);
        }
        best
    };
    cache
        .get_or_compile(SchemaKey::schema(held), || CompiledSchema::compile(held))
        .expect("schema");
    cache
        .get_or_compile(SchemaKey::calls(&refs), || {
            CompiledSchema::compile_calls(&refs).map_err(|(_, e)| e)
        })
        .expect("calls");
    let held_hit = hit_us(&|| SchemaKey::schema(held));
    let calls_hit = hit_us(&|| SchemaKey::calls(&refs));
    let st = cache.stats();
    println!("| schema | compile µs | cached µs | ratio |");
    println!("|---|---:|---:|---:|");
    println!(
        "| six properties, four formats and a pattern | {compile_us:.0} | {held_hit:.1} | {:.4} |",
        held_hit / compile_us
    );
    println!(
        "| eight tools, `tool_choice: \"required\"` | {calls_us:.0} | {calls_hit:.1} | {:.4} |",
        calls_hit / calls_us
    );
    println!("schema cache: {} entries, {} bytes", st.entries, st.bytes);
}
