//! Scheduler + KV cache driven directly over the simulated executor: a seeded randomized
//! differential test (outputs against a plain single-sequence run, block accounting against
//! a recount of the block tables after every operation), prefix reuse rules, collision
//! safety and prefill fairness.

mod engine_common;

use std::time::{Duration, Instant};

use engine::executor::Executor;
use engine::sampler::argmax;
use engine::scheduler::{Scheduler, SchedulerConfig, SeqId, SeqSpec};
use engine::sim::{SimConfig, SimExecutor};
use engine_common::{ns, reference_greedy, test_seed};
use prefix_index::key::{BlockSize, KeyChain};
use prefix_index::{HashAlgorithm, NamespaceSeed};
use rand::{Rng, SeedableRng};

fn chain(seed: NamespaceSeed, bs: usize) -> KeyChain {
    KeyChain::new(
        seed,
        HashAlgorithm::Xxh3,
        BlockSize::new(bs as u32).unwrap(),
    )
}

fn spec(prompt: Vec<u32>, max_tokens: usize, seed: NamespaceSeed, bs: usize) -> SeqSpec {
    let now = Instant::now();
    SeqSpec {
        prompt,
        chain: chain(seed, bs),
        max_tokens,
        cache_insert: true,
        submitted_at: now,
        deadline: now + Duration::from_secs(3600),
        prompt_logits: false,
    }
}

fn sched_cfg(max_running: usize, budget: usize, chunk: usize) -> SchedulerConfig {
    SchedulerConfig {
        max_running,
        step_token_budget: budget,
        prefill_chunk: chunk,
        copy_partial_blocks: true,
        prompt_logits_chunk: 32,
    }
}

/// Runs one step: admit, schedule, forward, complete, greedy-sample. Returns finished
/// sequences as (payload, generated tokens).
fn step<P: Copy>(s: &mut Scheduler<P>, e: &mut SimExecutor, eos: u32) -> Vec<(SeqId, P, Vec<u32>)> {
    s.admit(Instant::now());
    let copies = s.take_copies();
    let ok: Vec<bool> = copies
        .iter()
        .map(|c| e.copy_block(c.src, c.dst).is_ok())
        .collect();
    s.copies_done(&copies, &ok);
    let (plan, broken) = s.schedule();
    assert!(broken.is_empty(), "broken reservations: {broken:?}");
    let mut done = Vec::new();
    if plan.is_empty() {
        return done;
    }
    let outs = {
        let chunks = s.chunks(&plan);
        assert_eq!(chunks.len(), plan.len());
        e.forward(&chunks).expect("forward")
    };
    s.complete(&plan);
    for (c, out) in plan.iter().zip(outs) {
        if !c.want_logits {
            continue;
        }
        let t = argmax(&out.expect("logits"));
        let seq = s.get(c.id).expect("running");
        let n = seq.generated().len();
        if t == eos {
            let seq = s.remove(c.id).unwrap();
            done.push((c.id, seq.payload, seq.generated().to_vec()));
            continue;
        }
        s.append_token(c.id, t);
        if n + 1 >= s.get(c.id).unwrap().max_tokens() {
            let seq = s.remove(c.id).unwrap();
            done.push((c.id, seq.payload, seq.generated().to_vec()));
        }
    }
    done
}

#[test]
fn randomized_differential_accounting() {
    let seed = test_seed("randomized_differential_accounting");
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    for round in 0..6 {
        let bs = [1usize, 3, 4, 16][rng.gen_range(0..4)];
        let mut sim = SimConfig::instant(bs, rng.gen_range(8..80));
        sim.eos_after = if rng.gen_bool(0.3) {
            Some(rng.gen_range(10..60))
        } else {
            None
        };
        let mut exec = SimExecutor::new(sim.clone()).unwrap();
        let geometry = exec.geometry();
        let max_running = rng.gen_range(1..8);
        let cfg = sched_cfg(
            max_running,
            rng.gen_range(max_running..max_running + 40),
            rng.gen_range(1..20),
        );
        let mut s: Scheduler<usize> = Scheduler::new(cfg, geometry);
        // A few shared prefixes so prefix hits happen.
        let prefixes: Vec<Vec<u32>> = (0..3)
            .map(|_| {
                (0..rng.gen_range(1..40))
                    .map(|_| rng.gen_range(0..500))
                    .collect()
            })
            .collect();
        let mut prompts: Vec<(Vec<u32>, usize)> = Vec::new();
        let mut turns: Vec<Vec<u32>> = Vec::new();
        let mut live: Vec<SeqId> = Vec::new();
        let mut next_id = 0u64;
        let mut finished = 0usize;
        let mut rejected = 0usize;
        let mut cancelled = 0usize;
        let mut hits = 0usize;
        let mut tail_hits = 0usize;
        for op in 0..400 {
            match rng.gen_range(0..10) {
                0..=2 => {
                    // A new prompt on a shared prefix, or the next turn of a finished
                    // conversation (its prompt and answer: reuses full blocks and its tail).
                    let mut p = if !turns.is_empty() && rng.gen_bool(0.4) {
                        turns[rng.gen_range(0..turns.len())].clone()
                    } else {
                        prefixes[rng.gen_range(0..prefixes.len())].clone()
                    };
                    let extra = rng.gen_range(0..20);
                    p.extend((0..extra).map(|_| rng.gen_range(0..500)));
                    if p.is_empty() {
                        p.push(1);
                    }
                    let max_tokens = rng.gen_range(1..30);
                    let namespace = ns(rng.gen_range(0..2));
                    if engine::scheduler::check_fits(geometry, p.len(), max_tokens).is_err() {
                        // Differential: the naive rule.
                        assert!((p.len() + max_tokens - 1).div_ceil(bs) > geometry.num_blocks);
                        rejected += 1;
                        continue;
                    }
                    let mut sp = spec(p.clone(), max_tokens, namespace, bs);
                    sp.cache_insert = rng.gen_bool(0.8);
                    let id = SeqId(next_id);
                    next_id += 1;
                    s.enqueue(id, sp, prompts.len());
                    prompts.push((p, max_tokens));
                    live.push(id);
                }
                3 => {
                    if !live.is_empty() {
                        let id = live.swap_remove(rng.gen_range(0..live.len()));
                        if let Some(seq) = s.remove(id) {
                            // Whatever it generated so far is a prefix of the reference.
                            let (p, m) = &prompts[seq.payload];
                            let want = reference_greedy(&sim, p, *m);
                            assert!(
                                want.starts_with(seq.generated()),
                                "seed {seed} round {round} op {op}: cancelled output diverged"
                            );
                            cancelled += 1;
                        }
                    }
                }
                _ => {
                    for (id, payload, out) in step(&mut s, &mut exec, sim.eos_token_id) {
                        let (p, m) = &prompts[payload];
                        assert_eq!(
                            out,
                            reference_greedy(&sim, p, *m),
                            "seed {seed} round {round} op {op}: output differs from the plain run"
                        );
                        if p.len() + out.len() < 200 {
                            turns.push([&p[..], &out[..]].concat());
                        }
                        live.retain(|x| *x != id);
                        finished += 1;
                    }
                    tail_hits += s
                        .running()
                        .iter()
                        .filter(|q| q.cached_tokens() % bs != 0)
                        .count();
                    hits = hits.max(
                        s.running()
                            .iter()
                            .map(|q| q.cached_tokens())
                            .max()
                            .unwrap_or(0),
                    );
                }
            }
            if let Err(e) = s.check_invariants() {
                panic!("seed {seed} round {round} op {op}: {e}");
            }
            let c = s.kv().counts();
            assert_eq!(c.used + c.cached + c.free, c.total);
        }
        // Run everything still live to completion.
        let mut guard = 0;
        while s.running_len() + s.waiting_len() > 0 {
            for (id, payload, out) in step(&mut s, &mut exec, sim.eos_token_id) {
                let (p, m) = &prompts[payload];
                assert_eq!(
                    out,
                    reference_greedy(&sim, p, *m),
                    "seed {seed} round {round}"
                );
                live.retain(|x| *x != id);
                finished += 1;
            }
            s.check_invariants()
                .unwrap_or_else(|e| panic!("seed {seed} round {round}: {e}"));
            guard += 1;
            if guard == 99_999 {
                eprintln!(
                    "STUCK running {} waiting {} counts {:?} reserved {} tails {}",
                    s.running_len(),
                    s.waiting_len(),
                    s.kv().counts(),
                    s.kv().reserved(),
                    s.kv().tails()
                );
                for q in s.running() {
                    eprintln!(
                        "  run {:?} prompt {} computed {} table {:?} cached {}",
                        q.id,
                        q.prompt_len(),
                        q.num_computed(),
                        q.block_table(),
                        q.cached_tokens()
                    );
                }
            }
            assert!(guard < 100_000, "seed {seed}: no progress");
        }
        let c = s.kv().counts();
        assert_eq!(c.used, 0, "seed {seed} round {round}: leaked references");
        assert_eq!(c.free + c.cached, c.total);
        assert!(c.cached >= s.kv().tails(), "kept tails are cached blocks");
        assert_eq!(s.kv().reserved(), 0);
        println!(
            "round {round}: B={bs} blocks={} finished={finished} cancelled={cancelled} rejected={rejected} largest-hit={hits} steps-with-tail-hits={tail_hits} cached-now={}",
            c.total, c.cached
        );
    }
}

#[test]
fn prefix_reuse_never_covers_the_last_prompt_token() {
    let bs = 4;
    let sim = SimConfig::instant(bs, 64);
    let mut exec = SimExecutor::new(sim.clone()).unwrap();
    let mut s: Scheduler<()> = Scheduler::new(sched_cfg(4, 64, 64), exec.geometry());
    // 12 tokens = exactly 3 blocks.
    let p: Vec<u32> = (10..22).collect();
    s.enqueue(SeqId(1), spec(p.clone(), 3, ns(1), bs), ());
    while s.running_len() + s.waiting_len() > 0 {
        step(&mut s, &mut exec, 2);
    }
    s.enqueue(SeqId(2), spec(p.clone(), 3, ns(1), bs), ());
    s.admit(Instant::now());
    assert_eq!(
        s.get(SeqId(2)).unwrap().cached_tokens(),
        11,
        "2 of 3 blocks, and 3 of the third's 4 tokens copied: all but the last"
    );
    // 13 tokens: all 3 full blocks are reusable.
    let mut p13 = p.clone();
    p13.push(5);
    s.enqueue(SeqId(3), spec(p13, 3, ns(1), bs), ());
    s.admit(Instant::now());
    assert_eq!(s.get(SeqId(3)).unwrap().cached_tokens(), 12);
    // Another namespace shares nothing.
    s.enqueue(SeqId(4), spec(p, 3, ns(2), bs), ());
    s.admit(Instant::now());
    assert_eq!(s.get(SeqId(4)).unwrap().cached_tokens(), 0);
    s.check_invariants().unwrap();
}

#[test]
fn key_collision_costs_a_miss_not_a_wrong_answer() {
    let bs = 4;
    let sim = SimConfig::instant(bs, 32);
    let mut exec = SimExecutor::new(sim.clone()).unwrap();
    let mut s: Scheduler<()> = Scheduler::new(sched_cfg(2, 64, 64), exec.geometry());
    let p: Vec<u32> = (100..110).collect();
    let keys = chain(ns(7), bs).keys(&p);
    // Plant the prompt's first key on block 31 with other tokens: a forced collision.
    s.kv_mut().plant_entry(keys[0], 31, &[1, 2, 3, 4], None);
    s.check_invariants().unwrap();
    s.enqueue(SeqId(1), spec(p.clone(), 5, ns(7), bs), ());
    s.admit(Instant::now());
    assert_eq!(
        s.get(SeqId(1)).unwrap().cached_tokens(),
        0,
        "collision is a miss"
    );
    let mut out = Vec::new();
    while s.running_len() > 0 {
        for (_, _, o) in step(&mut s, &mut exec, 2) {
            out = o;
        }
    }
    assert_eq!(out, reference_greedy(&sim, &p, 5));
    // The colliding entry was replaced by the verified one: the next request hits (2 blocks,
    // and the first token of the third, copied: all but the last prompt token).
    s.enqueue(SeqId(2), spec(p.clone(), 5, ns(7), bs), ());
    s.admit(Instant::now());
    assert_eq!(s.get(SeqId(2)).unwrap().cached_tokens(), 9);
    s.check_invariants().unwrap();

    // A second block planted with the right tokens but no parent link is not trusted.
    let q: Vec<u32> = (200..210).collect();
    let qk = chain(ns(8), bs).keys(&q);
    s.kv_mut().plant_entry(qk[0], 30, &q[0..4], None);
    s.kv_mut().plant_entry(qk[1], 29, &q[4..8], Some((28, 0)));
    s.enqueue(SeqId(3), spec(q, 2, ns(8), bs), ());
    s.admit(Instant::now());
    assert_eq!(
        s.get(SeqId(3)).unwrap().cached_tokens(),
        4,
        "stops at the bad parent"
    );
}

#[test]
fn opt_out_requests_leave_nothing_cached() {
    let bs = 4;
    let sim = SimConfig::instant(bs, 32);
    let mut exec = SimExecutor::new(sim).unwrap();
    let mut s: Scheduler<()> = Scheduler::new(sched_cfg(2, 64, 64), exec.geometry());
    let p: Vec<u32> = (1..30).collect();
    let mut sp = spec(p.clone(), 6, ns(1), bs);
    sp.cache_insert = false;
    s.enqueue(SeqId(1), sp, ());
    while s.running_len() + s.waiting_len() > 0 {
        step(&mut s, &mut exec, 2);
    }
    assert_eq!(s.kv().cache().len(), 0);
    assert_eq!(s.kv().counts().cached, 0);
    assert_eq!(s.take_events(), vec![]);
    s.enqueue(SeqId(2), spec(p, 6, ns(1), bs), ());
    s.admit(Instant::now());
    assert_eq!(s.get(SeqId(2)).unwrap().cached_tokens(), 0);
}

#[test]
fn generated_blocks_are_cached_for_the_next_turn() {
    let bs = 4;
    let sim = SimConfig::instant(bs, 64);
    let mut exec = SimExecutor::new(sim.clone()).unwrap();
    let mut s: Scheduler<()> = Scheduler::new(sched_cfg(2, 64, 64), exec.geometry());
    let p: Vec<u32> = (1..7).collect(); // 6 tokens
    s.enqueue(SeqId(1), spec(p.clone(), 12, ns(1), bs), ());
    let mut answer = Vec::new();
    while s.running_len() + s.waiting_len() > 0 {
        for (_, _, o) in step(&mut s, &mut exec, 2) {
            answer = o;
        }
    }
    assert_eq!(answer.len(), 12);
    // K/V exists for prompt + answer minus its last token = 17 tokens = 4 full blocks and a
    // 1-token tail, which the next turn adopts.
    let mut turn2 = p.clone();
    turn2.extend(&answer);
    turn2.extend([9, 9, 9]);
    s.enqueue(SeqId(2), spec(turn2.clone(), 2, ns(1), bs), ());
    s.admit(Instant::now());
    assert_eq!(s.get(SeqId(2)).unwrap().cached_tokens(), 17);
    assert_eq!(s.kv().tails(), 0, "adopted");
    s.check_invariants().unwrap();
    let mut out = Vec::new();
    while s.running_len() > 0 {
        for (_, _, o) in step(&mut s, &mut exec, 2) {
            out = o;
        }
    }
    assert_eq!(out, reference_greedy(&sim, &turn2, 2));
}

/// Partial copies: a request sharing only the first tokens of a cached block gets them by a
/// copy into its own block (the cached block is never written), under its own namespace only;
/// the copy's source stays pinned until the copy is reported; a copy that did not run leaves
/// the request recomputing the block, still exact.
#[test]
fn cached_blocks_are_copied_for_their_shared_first_tokens() {
    let bs = 4;
    let sim = SimConfig::instant(bs, 32);
    let mut exec = SimExecutor::new(sim.clone()).unwrap();
    let mut s: Scheduler<()> = Scheduler::new(sched_cfg(4, 64, 64), exec.geometry());
    let finish = |s: &mut Scheduler<()>, exec: &mut SimExecutor| {
        let mut outs = Vec::new();
        while s.running_len() + s.waiting_len() > 0 {
            outs.extend(step(s, exec, 2).into_iter().map(|(id, _, o)| (id, o)));
        }
        s.check_invariants().unwrap();
        outs
    };
    // A "system prompt" of 6 tokens, then the first user's 6.
    let sys: Vec<u32> = (1..7).collect();
    let a = [&sys[..], &[50, 51, 52, 53, 54, 55]].concat();
    s.enqueue(SeqId(1), spec(a.clone(), 2, ns(1), bs), ());
    finish(&mut s, &mut exec);
    // A second user: one full block (4) and 2 tokens copied out of the cached block [5, 6, 50, 51].
    let b = [&sys[..], &[60, 61, 62]].concat();
    s.enqueue(SeqId(2), spec(b.clone(), 3, ns(1), bs), ());
    s.admit(Instant::now());
    assert_eq!(s.get(SeqId(2)).unwrap().cached_tokens(), 6);
    let copies = s.take_copies();
    assert_eq!(copies.len(), 1);
    let own = s.get(SeqId(2)).unwrap().block_table()[1];
    assert_ne!(copies[0].src, own, "the request writes its own block");
    assert_eq!(copies[0].dst, own);
    assert!(s.kv().pool().refcount(copies[0].src) >= 1, "pinned");
    s.check_invariants().unwrap();
    exec.copy_block(copies[0].src, copies[0].dst).unwrap();
    s.copies_done(&copies, &[true]);
    s.check_invariants().unwrap();
    let outs = finish(&mut s, &mut exec);
    assert_eq!(outs, vec![(SeqId(2), reference_greedy(&sim, &b, 3))]);
    // Another namespace shares nothing.
    s.enqueue(SeqId(3), spec(b.clone(), 3, ns(2), bs), ());
    s.admit(Instant::now());
    assert_eq!(s.get(SeqId(3)).unwrap().cached_tokens(), 0);
    assert!(s.take_copies().is_empty());
    finish(&mut s, &mut exec);
    // A copy that did not run: the request recomputes the block, exactly.
    let c = [&sys[..], &[70, 71, 72]].concat();
    s.enqueue(SeqId(4), spec(c.clone(), 3, ns(1), bs), ());
    s.admit(Instant::now());
    assert_eq!(s.get(SeqId(4)).unwrap().cached_tokens(), 6);
    let copies = s.take_copies();
    s.copies_done(&copies, &[false]);
    assert_eq!(s.get(SeqId(4)).unwrap().cached_tokens(), 4);
    s.check_invariants().unwrap();
    assert_eq!(
        finish(&mut s, &mut exec),
        vec![(SeqId(4), reference_greedy(&sim, &c, 3))]
    );
    // A copy never reported is abandoned at the next schedule, exactly too.
    let d = [&sys[..], &[80, 81, 82]].concat();
    s.enqueue(SeqId(5), spec(d.clone(), 3, ns(1), bs), ());
    s.admit(Instant::now());
    assert_eq!(s.take_copies().len(), 1);
    let (plan, broken) = s.schedule();
    assert!(broken.is_empty());
    assert_eq!(plan[0].start, 4, "recomputes the copied block");
    let outs = exec.forward(&s.chunks(&plan)).unwrap();
    s.complete(&plan);
    let first = engine::sampler::argmax(outs[0].as_ref().unwrap());
    assert_eq!(first, reference_greedy(&sim, &d, 1)[0]);
    s.remove(SeqId(5));
    s.check_invariants().unwrap();
}

/// Tails: reused only under their own parent (another namespace or a different prefix gets
/// nothing), up to the shared tokens, never the last prompt token; a longer tail replaces a
/// shorter one; under memory pressure tails go first, before cached full blocks.
#[test]
fn partial_tails_are_reused_exactly_and_given_up_first() {
    let bs = 4;
    let sim = SimConfig::instant(bs, 16);
    let mut exec = SimExecutor::new(sim.clone()).unwrap();
    let mut s: Scheduler<()> = Scheduler::new(sched_cfg(2, 64, 64), exec.geometry());
    let run = |s: &mut Scheduler<()>, exec: &mut SimExecutor, id: u64, p: &[u32], n: usize| {
        s.enqueue(SeqId(id), spec(p.to_vec(), n, ns(1), bs), ());
        let mut out = Vec::new();
        while s.running_len() + s.waiting_len() > 0 {
            for (_, _, o) in step(s, exec, 2) {
                out = o;
            }
        }
        s.check_invariants().unwrap();
        assert_eq!(out, reference_greedy(&sim, p, n), "request {id}");
        out
    };
    // 6 prompt tokens, 1 generated: 6 computed = 1 block + a 2-token tail [5, 6].
    let p: Vec<u32> = (1..7).collect();
    run(&mut s, &mut exec, 1, &p, 1);
    assert_eq!(s.kv().tails(), 1);
    // Another namespace: nothing.
    s.enqueue(SeqId(2), spec([&p[..], &[40]].concat(), 1, ns(2), bs), ());
    s.admit(Instant::now());
    assert_eq!(s.get(SeqId(2)).unwrap().cached_tokens(), 0);
    s.remove(SeqId(2));
    // Same first block, the tail's first token only: 4 + 1.
    let q = vec![1, 2, 3, 4, 5, 77, 78];
    s.enqueue(SeqId(3), spec(q.clone(), 1, ns(1), bs), ());
    s.admit(Instant::now());
    assert_eq!(s.get(SeqId(3)).unwrap().cached_tokens(), 5);
    s.remove(SeqId(3));
    s.check_invariants().unwrap();
    // Seq 3 computed nothing after adopting; its removal keeps the adopted block as the tail
    // [5] (what it had computed there).
    assert_eq!(s.kv().tails(), 1);
    // The prompt itself (6 tokens) may reuse 5 at most: the last token is computed.
    s.enqueue(SeqId(4), spec(p.clone(), 1, ns(1), bs), ());
    s.admit(Instant::now());
    assert_eq!(s.get(SeqId(4)).unwrap().cached_tokens(), 5);
    s.remove(SeqId(4));
    // A run through the whole tail and beyond, exact.
    let r = vec![1, 2, 3, 4, 5, 6, 9, 9];
    run(&mut s, &mut exec, 5, &r, 2);
    assert!(s.kv().tails() >= 1);
    // A request that needs the whole pool (60 + 5 − 1 = 64 tokens = 16 blocks) is admitted:
    // kept tails are evictable like cached blocks.
    let big: Vec<u32> = (100..160).collect();
    run(&mut s, &mut exec, 6, &big, 5);
    assert_eq!(
        s.kv().tails(),
        0,
        "evicted; 64 computed tokens leave no partial block"
    );
}

#[test]
fn short_prefill_is_not_queued_behind_long_ones() {
    let bs = 16;
    let sim = SimConfig::instant(bs, 4096);
    let mut exec = SimExecutor::new(sim).unwrap();
    let mut s: Scheduler<usize> = Scheduler::new(sched_cfg(16, 512, 256), exec.geometry());
    for i in 0..12 {
        let p: Vec<u32> = (0..2048).map(|t| ((t * 31 + i * 7) % 500) as u32).collect();
        s.enqueue(SeqId(i as u64), spec(p, 8, ns(1), bs), i);
    }
    // Two steps of long prefill happen before the short request arrives.
    step(&mut s, &mut exec, 2);
    step(&mut s, &mut exec, 2);
    s.enqueue(SeqId(100), spec((0..64).collect(), 8, ns(1), bs), 100);
    s.admit(Instant::now());
    let (plan, _) = s.schedule();
    let short = plan
        .iter()
        .find(|c| c.id == SeqId(100))
        .expect("short scheduled at once");
    assert_eq!((short.start, short.len, short.want_logits), (0, 64, true));
    let total: usize = plan.iter().map(|c| c.len).sum();
    assert!(total <= 512);
}

#[test]
fn round_robin_spreads_prefill_evenly() {
    let bs = 16;
    let sim = SimConfig::instant(bs, 4096);
    let mut exec = SimExecutor::new(sim).unwrap();
    // Budget of 2 chunks per step over 6 long prompts.
    let mut s: Scheduler<usize> = Scheduler::new(sched_cfg(8, 256, 128), exec.geometry());
    for i in 0..6u64 {
        let p: Vec<u32> = (0..1024)
            .map(|t| ((t + i as usize * 3) % 500) as u32)
            .collect();
        s.enqueue(SeqId(i), spec(p, 4, ns(1), bs), i as usize);
    }
    for _ in 0..9 {
        step(&mut s, &mut exec, 2);
        let done: Vec<usize> = s.running().iter().map(|q| q.num_computed()).collect();
        let (lo, hi) = (done.iter().min().unwrap(), done.iter().max().unwrap());
        assert!(hi - lo <= 128, "uneven prefill progress {done:?}");
    }
}

#[test]
fn admission_waits_for_blocks_and_bypass_is_bounded() {
    let bs = 4;
    let sim = SimConfig::instant(bs, 10);
    let exec = SimExecutor::new(sim).unwrap();
    let mut s: Scheduler<()> = Scheduler::new(sched_cfg(4, 64, 64), exec.geometry());
    // Needs (20 + 8 − 1)/4 → 7 blocks.
    s.enqueue(SeqId(1), spec((0..20).collect(), 8, ns(1), bs), ());
    assert_eq!(s.admit(Instant::now()), vec![SeqId(1)]);
    // Needs 7 again: does not fit (3 left), but a 2-block request behind it may pass.
    s.enqueue(SeqId(2), spec((50..70).collect(), 8, ns(1), bs), ());
    s.enqueue(SeqId(3), spec((80..84).collect(), 2, ns(1), bs), ());
    assert_eq!(s.admit(Instant::now()), vec![SeqId(3)]);
    assert_eq!(s.waiting_len(), 1);
    assert!(engine::scheduler::check_fits(exec.geometry(), 40, 1).is_ok());
    assert!(engine::scheduler::check_fits(exec.geometry(), 40, 2).is_err());
    // Expiry removes waiting requests past their deadline.
    let expired = s.expire(Instant::now() + Duration::from_secs(7200));
    assert_eq!(expired.len(), 1);
    s.check_invariants().unwrap();
}

/// A sequence that wants every prompt position's logits reuses nothing — not the cached
/// prefix, not a tail, not a copy — and is cut into chunks of at most `prompt_logits_chunk`
/// tokens, each asking for every row (the executor gives back one row per token); a plain
/// sequence of the same prompt beside it reuses the cache and keeps the ordinary chunks.
#[test]
fn a_scored_prompt_reuses_nothing_and_takes_bounded_chunks() {
    let bs = 4;
    let sim = SimConfig::instant(bs, 256);
    let vocab = sim.vocab_size;
    let mut exec = SimExecutor::new(sim.clone()).unwrap();
    let mut cfg = sched_cfg(4, 256, 64);
    cfg.prompt_logits_chunk = 24;
    let mut s: Scheduler<usize> = Scheduler::new(cfg, exec.geometry());
    let p: Vec<u32> = (0..100).map(|t| (t * 7 % 500) as u32).collect();
    // The prompt's blocks (and a tail) in the cache.
    s.enqueue(SeqId(0), spec(p.clone(), 1, ns(1), bs), 0);
    let mut warmed = false;
    for _ in 0..20 {
        if step(&mut s, &mut exec, sim.eos_token_id)
            .iter()
            .any(|d| d.0 == SeqId(0))
        {
            warmed = true;
            break;
        }
    }
    assert!(warmed, "the first run did not finish");

    let mut scored = spec(p.clone(), 1, ns(1), bs);
    scored.prompt_logits = true;
    s.enqueue(SeqId(1), scored, 1);
    s.enqueue(SeqId(2), spec(p.clone(), 1, ns(1), bs), 2);
    assert_eq!(s.admit(Instant::now()), vec![SeqId(1), SeqId(2)]);
    assert_eq!(
        s.get(SeqId(1)).unwrap().cached_tokens(),
        0,
        "nothing reused"
    );
    assert_eq!(
        s.get(SeqId(2)).unwrap().cached_tokens(),
        99,
        "the plain one reuses"
    );
    let mut starts = Vec::new();
    while s.get(SeqId(1)).unwrap().is_prefilling() {
        let (plan, broken) = s.schedule();
        assert!(broken.is_empty());
        let outs = exec.forward(&s.chunks(&plan)).expect("forward");
        for (c, out) in plan.iter().zip(&outs) {
            if c.id == SeqId(1) {
                assert!(c.all_logits && c.len <= 24, "{c:?}");
                assert_eq!(c.want_logits, c.start + c.len == p.len(), "{c:?}");
                let rows = out.as_ref().expect("every row's logits").len() / vocab;
                assert_eq!(rows, c.len);
                starts.push(c.start);
            } else {
                assert!(!c.all_logits, "{c:?}");
            }
        }
        s.complete(&plan);
    }
    assert_eq!(starts, vec![0, 24, 48, 72, 96]);
}
