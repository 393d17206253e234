//! Render + tokenize cost of chats of ~1k, 4k and 16k tokens on the default model's profile,
//! plus the one-off profile load. Needs the model (`$KVGATE_MODEL_DIR` or `<workspace>/models`).
//!
//! Run: `cargo bench -p prompt-profile --bench render_encode`
//!
//! The chats are seeded pseudo-random prose and code with many distinct words. `cold` empties
//! the profile's piece cache and the direct BPE's word cache before each call (a new
//! conversation); `next_turn` has every message but the last one cached (the next request of a
//! growing conversation). `encode_uncached` is the plain `tokenizers` pipeline, whose own BPE
//! word cache cannot be emptied from outside and stays warm.
//!
//! `truncation`: a ~16k-token conversation under a 4,096-token budget with `truncation: auto`
//! (the bisection over its user turns), against tokenizing the conversation it keeps once
//! (the same tokens), with the piece cache cold before each call and warm.

use std::path::PathBuf;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, BatchSize, BenchmarkId, Criterion, Throughput};
use prompt_profile::{ChatMessage, ChatPrompt, PromptProfile, PromptSource, TokenBudget};
use rand::{Rng, SeedableRng};

fn model_path() -> PathBuf {
    let dir = std::env::var_os("KVGATE_MODEL_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models"));
    let p = dir.join("SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(
        p.is_file(),
        "model not found at {} (run scripts/fetch-model.sh)",
        p.display()
    );
    p
}

/// A conversation of alternating user/assistant turns with at least `target` prompt tokens.
fn chat(profile: &PromptProfile, target: usize, seed: u64) -> Vec<ChatMessage> {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let syll = [
        "ka", "lo", "mi", "ne", "ru", "sta", "pre", "ion", "ing", "er", "th", "qu", "ba", "zo",
    ];
    let mut messages = vec![ChatMessage::new("system", "You are a careful assistant.")];
    loop {
        let mut text = String::new();
        for _ in 0..rng.gen_range(40..120) {
            match rng.gen_range(0..10) {
                0 => text.push_str(&format!(" {}", rng.gen_range(0..100_000))),
                1 => text.push_str("\n    let x = vec![1, 2, 3].iter().map(|v| v * 2);"),
                2 => text.push_str(" naïve café 😀"),
                _ => {
                    text.push(' ');
                    for _ in 0..rng.gen_range(1..4) {
                        text.push_str(syll[rng.gen_range(0..syll.len())]);
                    }
                }
            }
        }
        let role = if messages.len() % 2 == 1 {
            "user"
        } else {
            "assistant"
        };
        messages.push(ChatMessage::new(role, text));
        if messages.len() % 2 == 0 {
            let n = profile
                .render_and_encode(&messages)
                .map(|r| r.ids.len())
                .unwrap_or(0);
            if n >= target {
                return messages;
            }
        }
    }
}

fn bench(c: &mut Criterion) {
    let path = model_path();
    let mut g = c.benchmark_group("profile_load");
    g.sample_size(10).measurement_time(Duration::from_secs(8));
    g.bench_function("from_gguf", |b| {
        b.iter(|| PromptProfile::from_gguf(&path).unwrap())
    });
    g.finish();

    let profile = PromptProfile::from_gguf(&path).unwrap();
    let mut g = c.benchmark_group("render_encode");
    g.sample_size(20).measurement_time(Duration::from_secs(4));
    for target in [1_000usize, 4_000, 16_000] {
        let messages = chat(&profile, target, 42);
        let n = profile.render_and_encode(&messages).unwrap().ids.len();
        g.throughput(Throughput::Elements(n as u64));
        g.bench_with_input(BenchmarkId::new("render", n), &messages, |b, m| {
            b.iter(|| profile.render(m, true).unwrap())
        });
        // the same conversation again: every piece is cached
        g.bench_with_input(
            BenchmarkId::new("render_and_encode_repeat", n),
            &messages,
            |b, m| b.iter(|| profile.render_and_encode(m).unwrap()),
        );
        // a conversation never seen before: the piece cache is emptied before each call
        g.bench_with_input(
            BenchmarkId::new("render_and_encode_cold", n),
            &messages,
            |b, m| {
                b.iter_batched(
                    || profile.clear_token_cache(),
                    |()| profile.render_and_encode(m).unwrap(),
                    BatchSize::PerIteration,
                )
            },
        );
        // the next turn of a conversation: all but the last message were encoded before
        g.bench_with_input(
            BenchmarkId::new("render_and_encode_next_turn", n),
            &messages,
            |b, m| {
                b.iter_batched(
                    || {
                        profile.clear_token_cache();
                        profile.render_and_encode(&m[..m.len() - 1]).unwrap();
                    },
                    |()| profile.render_and_encode(m).unwrap(),
                    BatchSize::PerIteration,
                )
            },
        );
        // the direct tokenizers pipeline, for comparison
        let text = profile.render(&messages, true).unwrap();
        g.bench_with_input(BenchmarkId::new("encode_uncached", n), &text, |b, t| {
            b.iter(|| profile.encode_uncached(t, true).unwrap())
        });
    }
    g.finish();

    let mut g = c.benchmark_group("truncation");
    g.sample_size(20).measurement_time(Duration::from_secs(4));
    let messages = chat(&profile, 16_000, 7);
    let budget = TokenBudget {
        context_limit: 4096,
        native_reserve: 0,
    };
    let source = |m: Vec<ChatMessage>, truncate: bool| {
        let mut c = ChatPrompt::new(m);
        c.truncate = truncate;
        PromptSource::Chat(c)
    };
    let long = source(messages.clone(), true);
    let cut = profile.tokenize_within(&long, budget, Some(64)).unwrap();
    let text = cut.rendered.clone().unwrap();
    // The conversation it kept: the system message, then from the first kept user turn on.
    let first = (1..messages.len())
        .find(|&i| {
            messages[i].role == "user" && messages[i].text().is_some_and(|t| text.contains(&t))
        })
        .unwrap();
    let kept: Vec<ChatMessage> = messages[..1]
        .iter()
        .chain(&messages[first..])
        .cloned()
        .collect();
    let kept = source(kept, false);
    assert_eq!(
        profile
            .tokenize_within(&kept, budget, Some(64))
            .unwrap()
            .ids,
        cut.ids
    );
    let n = cut.ids.len();
    for (name, src) in [("auto", &long), ("kept_whole", &kept)] {
        g.bench_with_input(BenchmarkId::new(format!("{name}_warm"), n), src, |b, s| {
            b.iter(|| profile.tokenize_within(s, budget, Some(64)).unwrap())
        });
        g.bench_with_input(BenchmarkId::new(format!("{name}_cold"), n), src, |b, s| {
            b.iter_batched(
                || profile.clear_token_cache(),
                |()| profile.tokenize_within(s, budget, Some(64)).unwrap(),
                BatchSize::PerIteration,
            )
        });
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
