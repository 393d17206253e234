//! The public engine API over the simulated executor: streaming, prefix reuse, sampling and
//! stop conditions, rejections, deadlines, cancellation, shutdown, and a seeded randomized
//! accounting test over a mix of finished, cancelled and rejected requests.

mod engine_common;

use std::collections::HashSet;
use std::time::{Duration, Instant};

use engine::engine::{EngineConfig, FinishReason, SeqEvent};
use engine::sampler::SamplingParams;
use engine::sim::SimConfig;
use engine::EngineError;
use engine_common::{collect, ns, reference_greedy, req, sim_engine, test_seed, wait_stats};
use futures::FutureExt;
use prefix_index::key::{BlockSize, KeyChain};
use prefix_index::{HashAlgorithm, KvEvent};
use rand::{Rng, SeedableRng};

fn small_cfg() -> EngineConfig {
    EngineConfig {
        max_running: 8,
        max_waiting: 64,
        step_token_budget: 64,
        prefill_chunk: 16,
        ..EngineConfig::default()
    }
}

#[tokio::test]
async fn greedy_stream_matches_plain_run_and_prefix_is_reused() {
    let sim = SimConfig::instant(4, 256);
    let engine = sim_engine(sim.clone(), small_cfg());
    let prompt: Vec<u32> = (0..30).map(|i| (i * 13 + 5) % 400).collect();
    let want = reference_greedy(&sim, &prompt, 10);

    let a = collect(engine.submit(req("a", prompt.clone(), 10, ns(1))).unwrap()).await;
    assert_eq!(a.cached_tokens, Some(0));
    assert_eq!(a.tokens, want);
    let (reason, usage, last_key) = a.finish.unwrap();
    assert_eq!(reason, FinishReason::Length);
    assert_eq!(usage.prompt_tokens, 30);
    assert_eq!(usage.completion_tokens, 10);
    let keys = KeyChain::new(ns(1), HashAlgorithm::Xxh3, BlockSize::new(4).unwrap()).keys(&prompt);
    assert_eq!(
        last_key,
        keys.last().copied(),
        "key of the last full prompt block"
    );
    let expected_text: String = want.iter().map(|t| format!("t{t} ")).collect();
    assert_eq!(a.text, expected_text);

    // Same prompt, same namespace: 7 full blocks are reusable ((30 − 1) / 4), and the first
    // token of the eighth (positions 28, 29 and two answer tokens) through a block copy: all
    // but the last prompt token.
    let b = collect(engine.submit(req("b", prompt.clone(), 10, ns(1))).unwrap()).await;
    assert_eq!(b.cached_tokens, Some(29));
    assert_eq!(b.tokens, want, "prefix-cached output equals the plain run");
    assert_eq!(b.finish.unwrap().1.cached_tokens, 29);
    // Another namespace: nothing shared.
    let c = collect(engine.submit(req("c", prompt.clone(), 10, ns(2))).unwrap()).await;
    assert_eq!(c.cached_tokens, Some(0));
    assert_eq!(c.tokens, want);

    let st = wait_stats(&engine, |s| s.running == 0).await;
    assert_eq!(st.prefix_hit_tokens, 29);
    assert_eq!(st.prompt_tokens, 90);
    assert_eq!(st.generation_tokens, 30);
    assert_eq!(st.blocks_used, 0);
    assert_eq!(
        st.blocks_free + st.blocks_cached + st.blocks_tail,
        st.blocks_total
    );
    assert!(st.blocks_cached > 0);
    engine.shutdown();
}

#[tokio::test]
async fn concurrent_sequences_joining_at_different_steps_match_plain_runs() {
    let sim = SimConfig::instant(3, 512);
    let engine = sim_engine(
        sim.clone(),
        EngineConfig {
            prefill_chunk: 5,
            step_token_budget: 20,
            ..small_cfg()
        },
    );
    let mut handles = Vec::new();
    let mut prompts = Vec::new();
    for i in 0..8usize {
        let mut p: Vec<u32> = (0..10).map(|t| t * 3 + 1).collect(); // shared prefix
        p.extend((0..(i * 7 % 23 + 1)).map(|t| ((t * 11 + i * 17) % 450) as u32));
        prompts.push(p.clone());
        handles.push(
            engine
                .submit(req(&format!("r{i}"), p, 6 + i, ns(3)))
                .unwrap(),
        );
        if i % 3 == 0 {
            tokio::task::yield_now().await;
        }
    }
    for (i, h) in handles.into_iter().enumerate() {
        let o = collect(h).await;
        assert_eq!(
            o.tokens,
            reference_greedy(&sim, &prompts[i], 6 + i),
            "sequence {i}"
        );
    }
}

#[tokio::test]
async fn seeded_sampling_is_repeatable() {
    let sim = SimConfig::instant(4, 128);
    let engine = sim_engine(sim, small_cfg());
    let mut r = req("s", (1..20).collect(), 24, ns(1));
    r.sampling = SamplingParams {
        temperature: 1.5,
        seed: Some(1234),
        ..SamplingParams::greedy()
    };
    let a = collect(engine.submit(r.clone()).unwrap()).await;
    let b = collect(engine.submit(r.clone()).unwrap()).await;
    assert_eq!(a.tokens, b.tokens);
    r.sampling.seed = Some(99);
    let c = collect(engine.submit(r).unwrap()).await;
    assert_ne!(a.tokens, c.tokens);
}

#[tokio::test]
async fn stop_strings_across_tokens_and_stop_ids() {
    let sim = SimConfig::instant(4, 128);
    let engine = sim_engine(sim.clone(), small_cfg());
    let prompt: Vec<u32> = (40..52).collect();
    let want = reference_greedy(&sim, &prompt, 12);
    // A stop string spanning the 4th and 5th tokens: "<last digit of t4> t<t5>".
    let t4 = format!("t{} ", want[3]);
    let stop = format!("{} t{}", &t4[t4.len() - 2..t4.len() - 1], want[4]);
    let mut r = req("x", prompt.clone(), 12, ns(1));
    r.stop_strings = vec![stop.clone()];
    let o = collect(engine.submit(r).unwrap()).await;
    let full: String = want.iter().map(|t| format!("t{t} ")).collect();
    let cut = full.find(&stop).unwrap();
    assert_eq!(
        o.text,
        full[..cut],
        "text up to the stop string, not including it"
    );
    assert_eq!(o.finish.unwrap().0, FinishReason::Stop);

    // Stop id = the 3rd token: two tokens emitted, the stop token is not.
    let mut r = req("y", prompt.clone(), 12, ns(1));
    r.stop_token_ids = vec![want[2]];
    let o = collect(engine.submit(r).unwrap()).await;
    assert_eq!(o.tokens, want[..2].to_vec());
    let (reason, usage, _) = o.finish.unwrap();
    assert_eq!(reason, FinishReason::Stop);
    assert_eq!(usage.completion_tokens, 3);

    // The simulator's eos ends a sequence with `stop`.
    let mut sim_eos = SimConfig::instant(4, 128);
    sim_eos.eos_after = Some(16);
    let e2 = sim_engine(sim_eos, small_cfg());
    let o = collect(e2.submit(req("z", prompt, 50, ns(1))).unwrap()).await;
    assert_eq!(o.tokens.len(), 4);
    assert_eq!(o.finish.unwrap().0, FinishReason::Stop);
}

#[tokio::test]
async fn immediate_rejections() {
    let sim = SimConfig::instant(4, 8);
    let engine = sim_engine(sim, small_cfg());
    let e = engine
        .submit(req("big", (0..30).collect(), 4, ns(1)))
        .unwrap_err();
    assert!(
        matches!(
            e,
            EngineError::NeverFits {
                needed: 9,
                total: 8
            }
        ),
        "{e}"
    );
    assert_eq!(e.error_type(), "kv_capacity_exceeded");
    let e = engine.submit(req("empty", vec![], 4, ns(1))).unwrap_err();
    assert_eq!(e.error_type(), "invalid_request");
    let e = engine
        .submit(req("oov", vec![100_000], 4, ns(1)))
        .unwrap_err();
    assert_eq!(e.error_type(), "invalid_request");
    let mut many = req("top21", vec![1], 1, ns(1));
    many.output.prompt_logprobs = Some(21);
    let e = engine.submit(many).unwrap_err();
    assert_eq!(e.error_type(), "invalid_request");
    let mut bad = req("t", vec![1], 1, ns(1));
    bad.sampling.top_p = 0.0;
    assert_eq!(
        engine.submit(bad).unwrap_err().error_type(),
        "invalid_request"
    );
    assert!(EngineConfig {
        step_token_budget: 1,
        max_running: 4,
        ..EngineConfig::default()
    }
    .validate()
    .is_err());
}

/// A simulator slow enough that one request occupies the engine for a while.
fn slow_sim(num_blocks: usize) -> SimConfig {
    SimConfig {
        decode_us_base: 2_000,
        ..SimConfig::instant(4, num_blocks)
    }
}

#[tokio::test]
async fn queue_full_and_admission_timeout() {
    let engine = sim_engine(
        slow_sim(64),
        EngineConfig {
            max_running: 1,
            max_waiting: 1,
            step_token_budget: 16,
            prefill_chunk: 16,
            ..EngineConfig::default()
        },
    );
    // Occupies the only running slot for ~200 steps × 2 ms.
    let mut busy = engine
        .submit(req("busy", (0..8).collect(), 200, ns(1)))
        .unwrap();
    assert!(matches!(busy.next().await, Some(SeqEvent::Started { .. })));
    let mut waiting = req("late", (0..8).collect(), 4, ns(1));
    waiting.deadline = Some(Instant::now() + Duration::from_millis(30));
    let waiting = engine.submit(waiting).unwrap();
    let e = engine
        .submit(req("full", (0..8).collect(), 4, ns(1)))
        .unwrap_err();
    assert!(matches!(e, EngineError::QueueFull { waiting: 1 }), "{e}");
    let o = collect(waiting).await;
    assert_eq!(o.failed, Some("admission_timeout"));
    assert_eq!(o.cached_tokens, None, "never started");
    assert_eq!(engine.stats().waiting, 0);
    drop(busy);
    wait_stats(&engine, |s| s.running == 0 && s.blocks_used == 0).await;
}

#[tokio::test]
async fn dropping_a_handle_frees_its_blocks() {
    let engine = sim_engine(slow_sim(64), small_cfg());
    let mut h = engine
        .submit(req("c", (0..40).collect(), 150, ns(1)))
        .unwrap();
    let mut tokens = 0;
    while tokens < 3 {
        if let Some(SeqEvent::Token { .. }) = h.next().await {
            tokens += 1;
        }
    }
    let st = engine.stats();
    assert_eq!(st.running, 1);
    assert!(st.blocks_used >= 11, "{st:?}");
    drop(h);
    let st = wait_stats(&engine, |s| s.running == 0).await;
    assert_eq!(st.blocks_used, 0);
    assert_eq!(
        st.blocks_free + st.blocks_cached + st.blocks_tail,
        st.blocks_total
    );
    // The prompt's full blocks stay cached for the next request.
    assert!(st.blocks_cached >= 10, "{st:?}");
}

#[tokio::test]
async fn shutdown_fails_pending_and_ends_feeds() {
    let engine = sim_engine(
        slow_sim(64),
        EngineConfig {
            max_running: 1,
            ..small_cfg()
        },
    );
    let feed = engine.kv_events();
    let mut sub = feed.subscribe(None);
    let a = engine
        .submit(req("a", (0..9).collect(), 200, ns(1)))
        .unwrap();
    let b = engine.submit(req("b", (0..9).collect(), 5, ns(1))).unwrap();
    let clone = engine.clone();
    tokio::task::spawn_blocking(move || clone.shutdown())
        .await
        .unwrap();
    assert_eq!(collect(a).await.failed, Some("engine_stopped"));
    assert_eq!(collect(b).await.failed, Some("engine_stopped"));
    assert_eq!(
        engine
            .submit(req("c", vec![1], 1, ns(1)))
            .unwrap_err()
            .error_type(),
        "engine_stopped"
    );
    // The feed ends after what it had.
    let end = tokio::time::timeout(Duration::from_secs(5), async {
        while sub.next().await.is_some() {}
    })
    .await;
    assert!(end.is_ok());
    engine.shutdown(); // idempotent
}

#[tokio::test]
async fn kv_events_track_the_cache_and_resume() {
    let sim = SimConfig::instant(4, 24);
    let engine = sim_engine(sim, small_cfg());
    let feed = engine.kv_events();
    let mut live = feed.subscribe(Some((feed.epoch(), 0)));
    // Many distinct prompts through a 24-block pool: stores and evictions.
    let mut last_seq = 0;
    let mut applied: HashSet<prefix_index::BlockKey> = HashSet::new();
    let mut removed_seen = false;
    for i in 0..12u32 {
        let p: Vec<u32> = (0..17).map(|t| (t * 7 + i * 31) % 400).collect();
        let o = collect(
            engine
                .submit(req(&format!("e{i}"), p.clone(), 3, ns(5)))
                .unwrap(),
        )
        .await;
        assert!(o.finish.is_some());
        // Every stored key is a key of this prompt (+answer) in namespace 5.
        let chain = KeyChain::new(ns(5), HashAlgorithm::Xxh3, BlockSize::new(4).unwrap());
        let mut full = p.clone();
        full.extend(&o.tokens);
        let prompt_keys: HashSet<_> = chain.keys(&full).into_iter().collect();
        // Drain what is there now.
        while let Some(Some(env)) = live.next().now_or_never() {
            assert_eq!(env.epoch, feed.epoch());
            assert_eq!(env.seq, last_seq + 1, "gap-free, in order");
            last_seq = env.seq;
            match env.event {
                KvEvent::Stored { keys, .. } => {
                    for k in &keys {
                        assert!(prompt_keys.contains(k), "stored key not of request {i}");
                    }
                    applied.extend(keys);
                }
                KvEvent::Removed { keys } => {
                    removed_seen = true;
                    for k in keys {
                        assert!(applied.remove(&k), "removed a key never stored");
                    }
                }
                KvEvent::Cleared => applied.clear(),
            }
        }
    }
    assert!(removed_seen, "the small pool evicted");
    let st = wait_stats(&engine, |s| s.running == 0).await;
    assert_eq!(
        applied.len(),
        st.blocks_cached,
        "applied events mirror the cache"
    );
    assert_eq!(feed.cached_keys(), applied.len());

    // A fresh subscriber (or one from another epoch) gets Cleared + the same set.
    for since in [None, Some((feed.epoch() + 1, 3))] {
        let mut sub = feed.subscribe(since);
        let first = sub.next().await.unwrap();
        assert_eq!(first.event, KvEvent::Cleared);
        let mut snap = HashSet::new();
        while let Some(Some(env)) = sub.next().now_or_never() {
            if let KvEvent::Stored { keys, .. } = env.event {
                snap.extend(keys);
            }
        }
        assert_eq!(snap, applied);
    }
    // Resuming from a recent seq replays exactly the rest.
    let mut sub = feed.subscribe(Some((feed.epoch(), last_seq - 2)));
    let seqs: Vec<u64> =
        std::iter::from_fn(|| sub.next().now_or_never().flatten().map(|e| e.seq)).collect();
    assert_eq!(seqs, vec![last_seq - 1, last_seq]);

    // A restart is a new epoch.
    let other = sim_engine(SimConfig::instant(4, 24), small_cfg());
    assert_ne!(other.kv_events().epoch(), feed.epoch());
}

#[tokio::test]
async fn opt_out_publishes_nothing() {
    let engine = sim_engine(SimConfig::instant(4, 64), small_cfg());
    let feed = engine.kv_events();
    let mut r = req("private", (0..33).collect(), 9, ns(1));
    r.cache_insert = false;
    collect(engine.submit(r).unwrap()).await;
    let st = wait_stats(&engine, |s| s.running == 0).await;
    assert_eq!(st.blocks_cached, 0);
    assert_eq!(feed.last_seq(), 0);
    let again = collect(
        engine
            .submit(req("p2", (0..33).collect(), 2, ns(1)))
            .unwrap(),
    )
    .await;
    assert_eq!(again.cached_tokens, Some(0));
}

/// Randomized mix of finished, cancelled (before and after start), timed-out and rejected
/// requests; afterwards every block is free or cached and none is referenced.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn randomized_accounting_mix() {
    let seed = test_seed("randomized_accounting_mix");
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let mut sim = SimConfig::instant(4, 48);
    sim.eos_after = Some(70);
    let engine = sim_engine(
        sim.clone(),
        EngineConfig {
            max_running: 4,
            max_waiting: 6,
            step_token_budget: 24,
            prefill_chunk: 7,
            ..EngineConfig::default()
        },
    );
    let prefixes: Vec<Vec<u32>> = (0..3)
        .map(|_| {
            (0..rng.gen_range(4..30))
                .map(|_| rng.gen_range(3..400))
                .collect()
        })
        .collect();
    let mut tasks = Vec::new();
    let mut rejected = 0;
    for i in 0..120 {
        let mut p = prefixes[rng.gen_range(0..3)].clone();
        p.extend((0..rng.gen_range(0..40)).map(|_| rng.gen_range(3..400)));
        let max_tokens = if rng.gen_bool(0.05) {
            500 // never fits in 48 blocks of 4
        } else {
            rng.gen_range(1..60)
        };
        let mut r = req(
            &format!("m{i}"),
            p.clone(),
            max_tokens,
            ns(rng.gen_range(0..2)),
        );
        r.cache_insert = rng.gen_bool(0.8);
        if rng.gen_bool(0.1) {
            r.deadline = Some(Instant::now());
        }
        let mode = rng.gen_range(0..4); // 0: drop at once, 1: drop after k events, else read all
        let k = rng.gen_range(1..5);
        match engine.submit(r) {
            Err(e) => {
                assert!(
                    matches!(
                        e,
                        EngineError::QueueFull { .. } | EngineError::NeverFits { .. }
                    ),
                    "seed {seed}: {e}"
                );
                rejected += 1;
                // Let the queue drain a little so most requests get in.
                wait_stats(&engine, |s| s.waiting < 3).await;
            }
            Ok(h) if mode == 0 => drop(h),
            Ok(mut h) => {
                let sim = sim.clone();
                tasks.push(tokio::spawn(async move {
                    if mode == 1 {
                        for _ in 0..k {
                            if h.next().await.is_none() {
                                break;
                            }
                        }
                        return;
                    }
                    let o = collect(h).await;
                    if o.failed.is_none() {
                        let want = reference_greedy(&sim, &p, max_tokens);
                        assert_eq!(o.tokens, want, "seed {seed}: request {i}");
                    }
                }));
            }
        }
        if rng.gen_bool(0.3) {
            tokio::task::yield_now().await;
        }
    }
    for t in tasks {
        t.await.unwrap();
    }
    let st = wait_stats(&engine, |s| s.running == 0 && s.waiting == 0).await;
    println!("seed {seed}: rejected {rejected}, stats {st:?}");
    assert!(st.prompt_tokens > 0 && st.generation_tokens > 0);
    assert_eq!(st.blocks_used, 0, "seed {seed}: reference leak");
    assert_eq!(
        st.blocks_free + st.blocks_cached + st.blocks_tail,
        st.blocks_total
    );
    assert_eq!(engine.kv_events().cached_keys(), st.blocks_cached);
    engine.shutdown();
}

/// The fairness probe on the simulator: a 64-token request submitted right after twelve
/// 2,048-token requests gets its first token before any of them.
#[tokio::test]
async fn short_request_overtakes_long_prefills() {
    let sim = SimConfig {
        prefill_us_per_token: 20,
        ..SimConfig::instant(16, 4096)
    };
    let engine = sim_engine(
        sim,
        EngineConfig {
            max_running: 16,
            step_token_budget: 512,
            prefill_chunk: 256,
            ..EngineConfig::default()
        },
    );
    let mut long = Vec::new();
    for i in 0..12u32 {
        let p: Vec<u32> = (0..2048).map(|t| (t * 7 + i * 13) % 500).collect();
        long.push(
            engine
                .submit(req(&format!("long{i}"), p, 4, ns(1)))
                .unwrap(),
        );
    }
    let t0 = Instant::now();
    let mut short = engine
        .submit(req("short", (0..64).collect(), 4, ns(1)))
        .unwrap();
    loop {
        match short.next().await {
            Some(SeqEvent::Token { .. }) => break,
            Some(_) => {}
            None => panic!("short request ended without a token"),
        }
    }
    let ttft = t0.elapsed();
    for h in &mut long {
        while let Some(Some(ev)) = h.next().now_or_never() {
            assert!(
                !matches!(ev, SeqEvent::Token { .. }),
                "a long request produced a token before the short one ({ttft:?})"
            );
        }
    }
    println!("short TTFT behind 12 × 2048-token prefills (sim, 20 µs/token): {ttft:?}");
    engine.shutdown();
}

#[tokio::test]
async fn min_tokens_masks_stop_ids_and_defers_stop_strings() {
    // The simulator's eos comes at every position from 16 on: 4 tokens for a 12-token prompt.
    let mut sim = SimConfig::instant(4, 128);
    sim.eos_after = Some(16);
    let engine = sim_engine(sim, small_cfg());
    let prompt: Vec<u32> = (40..52).collect();
    let mut r = req("m", prompt.clone(), 50, ns(1));
    r.output.min_tokens = 8;
    let o = collect(engine.submit(r).unwrap()).await;
    // eos cannot be sampled before 8 tokens; the 9th is eos again and ends it.
    assert_eq!(o.tokens.len(), 8, "{o:?}");
    assert!(!o.tokens.contains(&2));
    let (reason, usage, _) = o.finish.unwrap();
    assert_eq!(reason, FinishReason::Stop);
    assert_eq!(usage.completion_tokens, 9);

    // min_tokens above max_tokens is refused.
    let mut r = req("m2", prompt, 4, ns(1));
    r.output.min_tokens = 5;
    assert!(matches!(
        engine.submit(r).unwrap_err(),
        engine::EngineError::InvalidRequest(_)
    ));

    // Stop strings: matched only from the min_tokens-th token's text on.
    let sim = SimConfig::instant(4, 128);
    let engine = sim_engine(sim.clone(), small_cfg());
    let prompt: Vec<u32> = (40..52).collect();
    let want = reference_greedy(&sim, &prompt, 12);
    let full: String = want.iter().map(|t| format!("t{t} ")).collect();
    let stop = format!("t{} t{}", want[1], want[2]); // inside tokens 2–3
    let mut r = req("s", prompt.clone(), 12, ns(1));
    r.stop_strings = vec![stop.clone()];
    r.output.min_tokens = 6;
    let o = collect(engine.submit(r).unwrap()).await;
    let from6: usize = want[..5].iter().map(|t| format!("t{t} ").len()).sum();
    let expected = match full[from6..].find(&stop) {
        Some(k) => &full[..from6 + k],
        None => &full[..],
    };
    assert!(o.text.contains(&stop), "not cut before min_tokens");
    assert_eq!(o.text, expected);
}

#[tokio::test]
async fn a_kept_stop_string_ends_the_text() {
    let sim = SimConfig::instant(4, 128);
    let engine = sim_engine(sim.clone(), small_cfg());
    let prompt: Vec<u32> = (40..52).collect();
    let want = reference_greedy(&sim, &prompt, 12);
    let full: String = want.iter().map(|t| format!("t{t} ")).collect();
    let t4 = format!("t{} ", want[3]);
    let stop = format!("{} t{}", &t4[t4.len() - 2..t4.len() - 1], want[4]);
    let cut = full.find(&stop).unwrap();
    let mut r = req("k", prompt, 12, ns(1));
    r.stop_strings = vec![stop.clone()];
    r.output.include_stop_str = true;
    let o = collect(engine.submit(r).unwrap()).await;
    // The stop string is kept; nothing after it.
    assert_eq!(o.text, full[..cut + stop.len()]);
    assert_eq!(o.finish.unwrap().0, FinishReason::Stop);
}

/// Requests sharing a long prefix, submitted together: the first computes the prefix; the
/// others wait for its blocks instead of computing them again, reuse them, and answer exactly
/// as a cold run does.
#[tokio::test]
async fn concurrent_requests_with_one_new_prefix_compute_it_once() {
    let sim = SimConfig::instant(4, 512);
    let engine = sim_engine(sim.clone(), small_cfg());
    let shared: Vec<u32> = (100..164).collect(); // 16 blocks
    let prompts: Vec<Vec<u32>> = (0..4u32)
        .map(|q| {
            let mut p = shared.clone();
            p.extend([200 + q, 201 + q, 202 + q]);
            p
        })
        .collect();
    let handles: Vec<_> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| {
            engine
                .submit(req(&format!("q{i}"), p.clone(), 4, ns(1)))
                .unwrap()
        })
        .collect();
    let mut cached = Vec::new();
    for (h, p) in handles.into_iter().zip(&prompts) {
        let o = collect(h).await;
        assert_eq!(
            o.tokens,
            reference_greedy(&sim, p, 4),
            "same answer as cold"
        );
        cached.push(o.finish.unwrap().1.cached_tokens);
    }
    assert_eq!(cached[0], 0);
    // Every later one reused the whole shared prefix (64 tokens = 16 blocks).
    assert!(cached[1..].iter().all(|&c| c == 64), "{cached:?}");
    let stats = engine.stats();
    assert_eq!(stats.prompt_tokens, 4 * 67);
    assert_eq!(stats.prefix_hit_tokens, 3 * 64);
}

/// With a time target, the step loop learns how many tokens fit in it from the steps it runs
/// (the sim executor sleeps 0.2 ms per prefill token, so 40 ms hold 200), and chunking by the
/// learned budget leaves the greedy output as a plain run's.
#[tokio::test]
async fn a_step_time_target_sizes_steps_by_their_measured_cost() {
    let sim = SimConfig {
        prefill_us_per_token: 200,
        decode_us_base: 0,
        decode_us_per_seq: 0,
        ..SimConfig::instant(16, 512)
    };
    let cfg = EngineConfig {
        max_running: 4,
        step_token_budget: 512,
        prefill_chunk: 512,
        step_time_target: Some(Duration::from_millis(40)),
        ..EngineConfig::default()
    };
    let engine = sim_engine(sim.clone(), cfg);
    assert_eq!(
        engine.stats().step_budget_tokens,
        512,
        "nothing learned yet"
    );
    let prompt: Vec<u32> = (0..2000).map(|i| (i * 7 + 3) % 500).collect();
    let want = reference_greedy(&sim, &prompt, 4);
    let out = collect(engine.submit(req("long", prompt, 4, ns(1))).unwrap()).await;
    assert_eq!(
        out.tokens, want,
        "time-sized chunks give the plain run's tokens"
    );
    let st = wait_stats(&engine, |s| s.running == 0).await;
    // Each step runs a little longer than its modelled sleep, so the budget sits just below 200.
    assert!(
        (120..=200).contains(&st.step_budget_tokens),
        "learned budget {}",
        st.step_budget_tokens
    );
    assert!(
        st.steps >= 8,
        "2,000 tokens in steps of about 200: {} steps",
        st.steps
    );
    engine.shutdown();
}

/// Without a target the budget stays the configured token count.
#[tokio::test]
async fn without_a_step_time_target_the_budget_is_fixed() {
    let sim = SimConfig {
        prefill_us_per_token: 200,
        ..SimConfig::instant(16, 512)
    };
    let cfg = EngineConfig {
        max_running: 4,
        step_token_budget: 512,
        prefill_chunk: 512,
        ..EngineConfig::default()
    };
    let engine = sim_engine(sim, cfg);
    let prompt: Vec<u32> = (0..1200).map(|i| (i * 7 + 3) % 500).collect();
    let _ = collect(engine.submit(req("long", prompt, 2, ns(1))).unwrap()).await;
    let st = wait_stats(&engine, |s| s.running == 0).await;
    assert_eq!(st.step_budget_tokens, 512);
    assert!(
        st.steps <= 5,
        "1,200 tokens in steps of 512: {} steps",
        st.steps
    );
    engine.shutdown();
}

/// The log probabilities a plain one-chunk forward of the whole `prompt` gives each prompt
/// token after the first, on a fresh simulator (contiguous blocks).
fn reference_prompt_logprobs(
    sim: &SimConfig,
    prompt: &[u32],
    k: usize,
) -> Vec<engine::TokenLogprobs> {
    use engine::executor::{Executor, SeqChunk};
    let mut cfg = sim.clone();
    cfg.num_blocks = prompt.len().div_ceil(cfg.block_size);
    let mut e = engine::sim::SimExecutor::new(cfg.clone()).expect("sim");
    let table: Vec<u32> = (0..cfg.num_blocks as u32).collect();
    let rows = e
        .forward(&[SeqChunk {
            tokens: prompt,
            start_pos: 0,
            block_table: &table,
            want_logits: true,
            all_logits: true,
        }])
        .expect("forward")
        .remove(0)
        .expect("rows");
    rows.chunks_exact(cfg.vocab_size)
        .zip(&prompt[1..])
        .map(|(row, &next)| engine::TokenLogprobs::of(row, next, k))
        .collect()
}

/// `prompt_logprobs`: every prompt token after the first gets its log probability given the
/// tokens before it — what one plain forward of the whole prompt gives, whatever the chunking
/// (chunks of 16 and of 64; the scheduler's cap is `engine_scheduler.rs`'s) — in one
/// event before the first token. Such a request reuses no cached prefix (a reused position has
/// no logits) yet enters its blocks in the cache, and answers what a plain run answers.
/// `max_tokens = 0` computes the prompt only.
#[tokio::test]
async fn prompt_logprobs_cover_the_whole_prompt_and_reuse_nothing() {
    let sim = SimConfig::instant(4, 256);
    let prompt: Vec<u32> = (0..70).map(|i| (i * 13 + 5) % 400).collect();
    let want = reference_greedy(&sim, &prompt, 6);
    let want_lps = reference_prompt_logprobs(&sim, &prompt, 3);
    assert_eq!(want_lps.len(), 69);
    for chunk in [16, 64] {
        let engine = sim_engine(
            sim.clone(),
            EngineConfig {
                prefill_chunk: chunk,
                step_token_budget: 128,
                ..small_cfg()
            },
        );
        // A plain run first: the prompt's blocks are cached.
        let a = collect(engine.submit(req("a", prompt.clone(), 6, ns(1))).unwrap()).await;
        assert_eq!(a.tokens, want);
        let mut r = req("b", prompt.clone(), 6, ns(1));
        r.output.prompt_logprobs = Some(3);
        let b = collect(engine.submit(r).unwrap()).await;
        assert_eq!(b.cached_tokens, Some(0), "chunk {chunk}: nothing reused");
        let (lps, tokens_before) = b.prompt_logprobs.expect("prompt log probabilities");
        assert_eq!(tokens_before, 0, "before the first token");
        assert_eq!(lps, want_lps, "chunk {chunk}");
        assert_eq!(b.tokens, want, "chunk {chunk}: the answer of a plain run");
        assert_eq!(b.finish.unwrap().1.cached_tokens, 0);

        // The prompt only, under another namespace: no token, its blocks cached all the same.
        let mut r = req("c", prompt.clone(), 0, ns(2));
        r.output.prompt_logprobs = Some(0);
        let c = collect(engine.submit(r).unwrap()).await;
        assert!(c.tokens.is_empty());
        let (reason, usage, _) = c.finish.expect("finished");
        assert_eq!((reason, usage.completion_tokens), (FinishReason::Length, 0));
        let (lps, _) = c.prompt_logprobs.expect("prompt log probabilities");
        assert_eq!(lps.len(), 69);
        assert!(lps.iter().all(|l| l.top.is_empty()));
        let d = collect(engine.submit(req("d", prompt.clone(), 2, ns(2))).unwrap()).await;
        assert_eq!(
            d.cached_tokens,
            Some(69),
            "the prompt-only run's blocks were cached"
        );
        assert_eq!(d.tokens, want[..2]);
        // `max_tokens = 0` without log probabilities: reuses the cache, samples nothing.
        let e = collect(engine.submit(req("e", prompt.clone(), 0, ns(2))).unwrap()).await;
        assert_eq!(e.cached_tokens, Some(69));
        assert!(e.tokens.is_empty() && e.prompt_logprobs.is_none());
        assert_eq!(e.finish.unwrap().0, FinishReason::Length);
        let st = wait_stats(&engine, |s| s.running == 0).await;
        assert_eq!(st.blocks_used, 0);
        engine.shutdown();
    }
}
