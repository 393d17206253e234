//! Selection policy properties (proptest) and a seeded randomized differential test of
//! KvExact against a naive reading of its specification.

use std::collections::HashMap;

use prefix_index::WorkerId;
use proptest::prelude::*;
use rand::{Rng, SeedableRng};
use routing_rules::{
    Candidate, KvExact, KvExactRule, NoMatchPolicy, Placement, Reason, RoundRobin, SelectionPolicy,
    Stagger,
};

fn cand(i: usize, healthy: bool, load: u64, matched: usize) -> Candidate {
    Candidate {
        cached_blocks: 0,
        worker: WorkerId(format!("w{i}")),
        healthy,
        load,
        matched_blocks: matched,
        weight: 1,
        prompt_tokens: 0,
        queued_prefill: 0,
        queued_decode: 0,
    }
}

fn kv_rule(ratio: f64, slack: Option<u64>, min_tokens: u32) -> KvExactRule {
    KvExactRule {
        profile: None,
        salt: Default::default(),
        max_load_ratio: ratio,
        load_slack: slack,
        min_match_tokens: min_tokens,
        on_no_match: NoMatchPolicy::LeastLoaded,
        // The policy tests count requests (slack 1 by default).
        load_metric: routing_rules::schema::LoadMetric::InFlight,
        pending_ttl_ms: 0,
        placement: Placement::LeastCost,
        uncached_weight: 2.0,
        decode_weight: 0.25,
    }
}

/// A candidate for a 1,600-token prompt (blocks of 16) with `queued` prefill tokens ahead.
fn costed(i: usize, load: u64, matched: usize, queued: u64) -> Candidate {
    Candidate {
        prompt_tokens: 1600,
        queued_prefill: queued,
        ..cand(i, true, load, matched)
    }
}

fn idx(w: &WorkerId) -> usize {
    w.0[1..].parse().unwrap()
}

proptest! {
    /// RR over N healthy workers: any k·N consecutive requests give each worker exactly k
    /// (so balance within ±1 holds for every window that is a multiple of N).
    #[test]
    fn rr_is_balanced_over_any_k_n_window(n in 1usize..8, warmup in 0usize..20, k in 1usize..5) {
        let rr = RoundRobin::new(false);
        let cands: Vec<Candidate> = (0..n).map(|i| cand(i, true, 0, 0)).collect();
        for _ in 0..warmup {
            rr.select(&cands);
        }
        let mut count = vec![0usize; n];
        for _ in 0..k * n {
            let s = rr.select(&cands);
            prop_assert_eq!(s.reason, Reason::RoundRobin);
            count[idx(&s.order[0])] += 1;
        }
        prop_assert!(count.iter().all(|&c| c == k), "{:?}", count);
    }

    /// RR never returns an unhealthy worker and lists every healthy one once.
    #[test]
    fn rr_skips_unhealthy(health in prop::collection::vec(any::<bool>(), 0..8), calls in 1usize..20) {
        let rr = RoundRobin::new(false);
        let cands: Vec<Candidate> =
            health.iter().enumerate().map(|(i, &h)| cand(i, h, 0, 0)).collect();
        let healthy: Vec<usize> = (0..cands.len()).filter(|&i| health[i]).collect();
        for _ in 0..calls {
            let s = rr.select(&cands);
            let mut got: Vec<usize> = s.order.iter().map(idx).collect();
            got.sort();
            prop_assert_eq!(&got, &healthy);
            if healthy.is_empty() {
                prop_assert_eq!(s.reason, Reason::NoHealthyWorker);
            }
        }
    }

    /// Smooth weighted RR: any Σweight consecutive requests give each worker its weight.
    #[test]
    fn weighted_rr_follows_weights(weights in prop::collection::vec(1u32..6, 1..6), warmup in 0usize..30) {
        let rr = RoundRobin::new(true);
        let cands: Vec<Candidate> = weights
            .iter()
            .enumerate()
            .map(|(i, &w)| Candidate { weight: w, ..cand(i, true, 0, 0) })
            .collect();
        for _ in 0..warmup {
            rr.select(&cands);
        }
        let total: u32 = weights.iter().sum();
        let mut count = vec![0u32; weights.len()];
        for _ in 0..total {
            count[idx(&rr.select(&cands).order[0])] += 1;
        }
        prop_assert_eq!(count, weights);
    }

    /// KvExact never returns an unhealthy worker; it returns every healthy one exactly once;
    /// it returns nothing only when nothing is healthy.
    #[test]
    fn kv_exact_never_returns_unhealthy(
        cs in prop::collection::vec((any::<bool>(), 0u64..20, 0usize..6), 0..10),
        ratio in 1.0f64..3.0,
        min_tokens in 0u32..64,
    ) {
        let p = KvExact::new(&kv_rule(ratio, None, min_tokens), 16);
        let cands: Vec<Candidate> =
            cs.iter().enumerate().map(|(i, &(h, l, m))| cand(i, h, l, m)).collect();
        let s = p.select(&cands);
        let mut got: Vec<usize> = s.order.iter().map(idx).collect();
        got.sort();
        let healthy: Vec<usize> = (0..cands.len()).filter(|&i| cands[i].healthy).collect();
        prop_assert_eq!(&got, &healthy);
        prop_assert_eq!(s.order.is_empty(), s.reason == Reason::NoHealthyWorker);
    }

    /// At equal load every worker is admissible, so the longest match wins.
    #[test]
    fn kv_exact_prefers_longest_match_at_equal_load(
        matched in prop::collection::vec(0usize..10, 1..8),
        load in 0u64..50,
    ) {
        let p = KvExact::new(&kv_rule(1.5, None, 0), 16);
        let cands: Vec<Candidate> =
            matched.iter().enumerate().map(|(i, &m)| cand(i, true, load, m)).collect();
        let s = p.select(&cands);
        let best = *matched.iter().max().unwrap();
        prop_assert_eq!(matched[idx(&s.order[0])], best);
        prop_assert_eq!(s.reason, if best > 0 { Reason::Hit } else { Reason::NoMatch });
        // Fallbacks are in non-increasing match order.
        let ms: Vec<usize> = s.order.iter().map(|w| matched[idx(w)]).collect();
        prop_assert!(ms.windows(2).all(|w| w[0] >= w[1]), "{:?}", ms);
    }

    /// A single hot prefix, held by worker 0 only; requests arrive and never complete. At every
    /// step no worker's load exceeds the guard's limit (computed from the current loads) by
    /// more than the one request just assigned, and the hot worker is never chosen while it is
    /// at or over the limit.
    #[test]
    fn kv_exact_hot_prefix_respects_the_guard(
        n in 2usize..8,
        ratio in 1.0f64..3.0,
        slack in 1u64..4,
        steps in 1usize..200,
    ) {
        let p = KvExact::new(&kv_rule(ratio, Some(slack), 0), 16);
        let mut loads = vec![0u64; n];
        for _ in 0..steps {
            let cands: Vec<Candidate> =
                (0..n).map(|i| cand(i, true, loads[i], if i == 0 { 8 } else { 0 })).collect();
            let mean = loads.iter().sum::<u64>() as f64 / n as f64;
            let limit = (ratio * mean).max(mean + slack as f64);
            let s = p.select(&cands);
            let first = idx(&s.order[0]);
            if first == 0 {
                prop_assert!((loads[0] as f64) < limit, "hot worker at {} chosen, limit {limit}", loads[0]);
                prop_assert_eq!(s.reason, Reason::Hit);
            } else {
                prop_assert!((loads[0] as f64) >= limit);
                prop_assert_eq!(s.reason, Reason::LoadGuard);
            }
            loads[first] += 1;
            let mean = loads.iter().sum::<u64>() as f64 / n as f64;
            let limit = (ratio * mean).max(mean + slack as f64);
            prop_assert!(loads.iter().all(|&l| (l as f64) <= limit + 1.0), "{:?} limit {limit}", loads);
        }
        // While the others were idle, the hot worker took at most what the guard allows:
        // with others at 0, load L is admissible only while L < max(ratio·L/n, L/n + slack).
        prop_assert!(loads[0] >= 1);
    }
}

#[test]
fn kv_exact_hot_prefix_with_idle_others_stops_at_the_guard() {
    // 4 workers, ratio 1.5, slack 1: with others idle, worker 0 takes requests while
    // L < max(1.5·L/4, L/4 + 1), i.e. L = 0 and L = 1, then the guard sends the next one away.
    let p = KvExact::new(&kv_rule(1.5, Some(1), 0), 16);
    let mut loads = [0u64; 4];
    let mut reasons = Vec::new();
    for _ in 0..3 {
        let cands: Vec<Candidate> = (0..4)
            .map(|i| cand(i, true, loads[i], if i == 0 { 5 } else { 0 }))
            .collect();
        let s = p.select(&cands);
        loads[idx(&s.order[0])] += 1;
        reasons.push(s.reason);
    }
    assert_eq!(loads[0], 2);
    assert_eq!(reasons, [Reason::Hit, Reason::Hit, Reason::LoadGuard]);
}

#[test]
fn staggered_replicas_pick_disjoint_workers_of_an_idle_pool() {
    // G replicas deciding in lockstep over one idle pool of n: each replica's first n / G
    // picks are its own, so no worker is chosen twice before every worker was chosen once —
    // for kv_exact's ties and for plain round robin.
    for (n, g) in [(64usize, 8usize), (64, 3), (16, 3), (8, 8), (5, 2)] {
        let kv: Vec<KvExact> = (0..g)
            .map(|k| KvExact::new(&kv_rule(1.5, None, 0), 16).staggered(Stagger::new(k, g)))
            .collect();
        let rr: Vec<RoundRobin> = (0..g)
            .map(|k| RoundRobin::new(false).staggered(Stagger::new(k, g)))
            .collect();
        let cands: Vec<Candidate> = (0..n).map(|i| cand(i, true, 0, 0)).collect();
        for (name, picks) in [
            (
                "kv_exact",
                (0..n / g)
                    .flat_map(|_| kv.iter().map(|p| idx(&p.select(&cands).order[0])))
                    .collect::<Vec<_>>(),
            ),
            (
                "round_robin",
                (0..n / g)
                    .flat_map(|_| rr.iter().map(|p| idx(&p.select(&cands).order[0])))
                    .collect::<Vec<_>>(),
            ),
        ] {
            let mut seen = vec![false; n];
            for &w in &picks {
                assert!(
                    !seen[w],
                    "{name}, n = {n}, G = {g}: w{w} chosen twice in {picks:?}"
                );
                seen[w] = true;
            }
        }
    }
    // One gateway is unchanged: offset 0.
    assert_eq!(Stagger::SOLO.offset(64), 0);
    assert_eq!(Stagger::new(3, 8).offset(64), 24);
    assert_eq!(Stagger::new(9, 8), Stagger::new(1, 8));
    assert_eq!(Stagger::new(0, 0), Stagger::SOLO);
}

#[test]
fn staggered_replicas_stay_disjoint_when_they_see_each_other_late() {
    // G replicas take first turns (no match anywhere) in turn over one idle pool of n; each
    // sees its own picks at once and the others' only `lag` decisions later, as a published
    // reservation arrives after the decision. The tie groups their views hold then differ, and
    // still no worker gets two first turns among the first n − lag: each replica's cursor
    // walks its own part of the pool, and reaches another's part only after that part's picks
    // are visible. (The last `lag` may collide: the only workers left may be ones another
    // replica has just taken without this one seeing it yet.) With `hits`, every first turn
    // is followed by a later turn of an earlier conversation, a hit on its worker, which must
    // not move the cursor.
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    for hits in [false, true] {
        for (n, g, lag) in [
            (64usize, 3usize, 4usize),
            (64, 8, 8),
            (16, 3, 2),
            (48, 4, 6),
        ] {
            let kv: Vec<KvExact> = (0..g)
                .map(|k| KvExact::new(&kv_rule(1.5, None, 0), 16).staggered(Stagger::new(k, g)))
                .collect();
            let prompt = 685u64;
            // (replica, worker, first turn) of every decision so far.
            let mut picks: Vec<(usize, usize, bool)> = Vec::new();
            let mut firsts = 0;
            while firsts < n {
                let t = picks.len();
                let me = t % g;
                let follow_up = hits && t % 2 == 1;
                let mut load = vec![0u64; n];
                // A conversation counts once on its worker (its turns follow one another).
                for (at, p) in picks.iter().enumerate() {
                    if p.2 && (p.0 == me || at + lag <= t) {
                        load[p.1] += 1;
                    }
                }
                let held = if follow_up {
                    let earlier: Vec<usize> = picks.iter().filter(|p| p.2).map(|p| p.1).collect();
                    Some(earlier[rng.gen_range(0..earlier.len())])
                } else {
                    None
                };
                let cands: Vec<Candidate> = (0..n)
                    .map(|i| Candidate {
                        prompt_tokens: prompt,
                        queued_prefill: prompt * load[i],
                        ..cand(i, true, load[i], if held == Some(i) { 40 } else { 0 })
                    })
                    .collect();
                let w = idx(&kv[me].select(&cands).order[0]);
                if let Some(h) = held {
                    assert_eq!(w, h, "a follow-up goes to its conversation's worker");
                } else {
                    firsts += 1;
                }
                picks.push((me, w, held.is_none()));
            }
            let first: Vec<usize> = picks.iter().filter(|p| p.2).map(|p| p.1).collect();
            let mut seen = vec![false; n];
            for &w in &first[..n - lag] {
                assert!(
                    !seen[w],
                    "n = {n}, G = {g}, lag = {lag}, hits = {hits}: w{w} twice in {picks:?}"
                );
                seen[w] = true;
            }
        }
    }
}

#[test]
fn kv_exact_ties_rotate_in_a_sparse_group() {
    // A tied group spread over the pool (every third worker idle, the rest loaded) is served
    // in turn: 2·k consecutive decisions give each member exactly 2.
    let p = KvExact::new(&kv_rule(100.0, Some(100), 0), 16);
    let cands: Vec<Candidate> = (0..9)
        .map(|i| cand(i, true, if i % 3 == 1 { 0 } else { 5 }, 0))
        .collect();
    let mut count = vec![0usize; 9];
    for _ in 0..6 {
        count[idx(&p.select(&cands).order[0])] += 1;
    }
    assert_eq!(count, [0, 2, 0, 0, 2, 0, 0, 2, 0]);
}

#[test]
fn kv_exact_ties_rotate() {
    // Every pool size, odd and even: k·n consecutive ties give each worker exactly k firsts.
    for n in 1..=8 {
        let p = KvExact::new(&kv_rule(1.5, None, 0), 16);
        let cands: Vec<Candidate> = (0..n).map(|i| cand(i, true, 2, 4)).collect();
        let mut count = vec![0usize; n];
        for _ in 0..2 * n {
            count[idx(&p.select(&cands).order[0])] += 1;
        }
        assert!(
            count.iter().all(|&c| c == 2),
            "n = {n}: ties must rotate: {count:?}"
        );
    }
}

#[test]
fn kv_exact_ties_prefer_lower_load() {
    let p = KvExact::new(&kv_rule(1.5, None, 0), 16);
    let cands = vec![
        cand(0, true, 3, 4),
        cand(1, true, 2, 4),
        cand(2, true, 2, 1),
    ];
    for _ in 0..5 {
        let s = p.select(&cands);
        assert_eq!(idx(&s.order[0]), 1);
        assert_eq!(s.reason, Reason::Hit);
    }
}

#[test]
fn kv_exact_reasons() {
    let p = KvExact::new(&kv_rule(1.5, None, 32), 16); // threshold: 2 blocks
                                                       // Longest match unhealthy.
    let s = p.select(&[cand(0, false, 0, 5), cand(1, true, 0, 3)]);
    assert_eq!((idx(&s.order[0]), s.reason), (1, Reason::Unhealthy));
    // Only below-threshold matches.
    let s = p.select(&[cand(0, true, 0, 1), cand(1, true, 0, 0)]);
    assert_eq!(s.reason, Reason::BelowMinMatch);
    // Nothing matched: least loaded.
    let s = p.select(&[cand(0, true, 3, 0), cand(1, true, 1, 0)]);
    assert_eq!((idx(&s.order[0]), s.reason), (1, Reason::NoMatch));
    // Guard: worker 0 has the match but is far above the mean.
    let s = p.select(&[
        cand(0, true, 10, 5),
        cand(1, true, 0, 0),
        cand(2, true, 0, 2),
    ]);
    assert_eq!((idx(&s.order[0]), s.reason), (2, Reason::LoadGuard));
    assert_eq!(
        idx(s.order.last().unwrap()),
        0,
        "the guarded worker is the last fallback"
    );
    // Nobody healthy.
    let s = p.select(&[cand(0, false, 0, 5)]);
    assert!(s.order.is_empty());
    assert_eq!(s.reason.as_str(), "no_healthy_worker");
    assert!(p.select(&[]).order.is_empty());
}

#[test]
fn kv_exact_on_no_match_round_robin_rotates_over_unequal_loads() {
    let mut rule = kv_rule(1.5, Some(10), 0);
    rule.on_no_match = NoMatchPolicy::RoundRobin;
    let p = KvExact::new(&rule, 16);
    let cands = vec![
        cand(0, true, 0, 0),
        cand(1, true, 5, 0),
        cand(2, true, 1, 0),
    ];
    let mut firsts = std::collections::BTreeSet::new();
    for _ in 0..3 {
        let s = p.select(&cands);
        assert_eq!(s.reason, Reason::NoMatch);
        firsts.insert(idx(&s.order[0]));
    }
    assert_eq!(firsts.len(), 3);
}

/// Seeded randomized differential test: the first choice of KvExact must be one that a naive
/// reading of the specification allows (admissible, highest hit score among admissible, lowest
/// load among those). Set KVGATE_TEST_SEED to reproduce a failure.
#[test]
fn kv_exact_matches_naive_specification() {
    let seed: u64 = std::env::var("KVGATE_TEST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(rand::random);
    println!("kv_exact_matches_naive_specification seed = {seed}");
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    for case in 0..5_000 {
        let n = rng.gen_range(1..10);
        let ratio = rng.gen_range(1.0..4.0);
        let slack = rng.gen_range(1..5);
        let block = rng.gen_range(1..=32);
        let min_tokens = rng.gen_range(0..100);
        let p = KvExact::new(&kv_rule(ratio, Some(slack), min_tokens), block);
        let cands: Vec<Candidate> = (0..n)
            .map(|i| {
                cand(
                    i,
                    rng.gen_bool(0.8),
                    rng.gen_range(0..30),
                    rng.gen_range(0..8),
                )
            })
            .collect();
        let s = p.select(&cands);

        let healthy: Vec<&Candidate> = cands.iter().filter(|c| c.healthy).collect();
        if healthy.is_empty() {
            assert!(s.order.is_empty(), "seed {seed} case {case}");
            continue;
        }
        let threshold = (min_tokens as usize).div_ceil(block as usize).max(1);
        let mean = healthy.iter().map(|c| c.load).sum::<u64>() as f64 / healthy.len() as f64;
        let limit = (ratio * mean).max(mean + slack as f64);
        let score = |c: &Candidate| {
            if c.matched_blocks >= threshold {
                c.matched_blocks
            } else {
                0
            }
        };
        let admissible: Vec<&&Candidate> =
            healthy.iter().filter(|c| (c.load as f64) < limit).collect();
        assert!(
            !admissible.is_empty(),
            "seed {seed} case {case}: least loaded is admissible"
        );
        let best = admissible.iter().map(|c| score(c)).max().unwrap();
        let min_load = admissible
            .iter()
            .filter(|c| score(c) == best)
            .map(|c| c.load)
            .min()
            .unwrap();
        let allowed: Vec<&WorkerId> = admissible
            .iter()
            .filter(|c| score(c) == best && c.load == min_load)
            .map(|c| &c.worker)
            .collect();
        assert!(
            allowed.contains(&&s.order[0]),
            "seed {seed} case {case}: chose {:?}, allowed {allowed:?}, cands {cands:?}",
            s.order[0]
        );
        // `ranked`: the admissible head of `order`, each with its cost, in non-decreasing cost.
        assert_eq!(s.ranked.len(), admissible.len(), "seed {seed} case {case}");
        for (k, (w, cost)) in s.ranked.iter().enumerate() {
            assert_eq!(w, &s.order[k], "seed {seed} case {case}");
            let c = cands.iter().find(|c| &c.worker == w).unwrap();
            assert!(
                (c.load as f64) < limit,
                "seed {seed} case {case}: inadmissible ranked"
            );
            assert_eq!(*cost, p.cost(c), "seed {seed} case {case}");
        }
        assert!(s.ranked.windows(2).all(|p| p[0].1 <= p[1].1));
        let best_healthy = healthy.iter().map(|c| score(c)).max().unwrap();
        if best_healthy > best {
            assert_eq!(s.reason, Reason::LoadGuard, "seed {seed} case {case}");
        } else if best > 0 && s.reason != Reason::Unhealthy {
            assert_eq!(s.reason, Reason::Hit, "seed {seed} case {case}");
        }
    }
}

#[test]
fn policies_are_built_per_rule_and_shared_across_threads() {
    use routing_rules::{policy, Rule};
    let p = policy::build(&Rule::KvExact(kv_rule(1.5, None, 0)), 16);
    assert_eq!(p.name(), "kv_exact");
    let p: std::sync::Arc<dyn SelectionPolicy> =
        std::sync::Arc::from(policy::build(&Rule::RoundRobin(Default::default()), 16));
    assert_eq!(p.name(), "round_robin");
    let cands: Vec<Candidate> = (0..4).map(|i| cand(i, true, 0, 0)).collect();
    let handles: Vec<_> = (0..4)
        .map(|_| {
            let p = std::sync::Arc::clone(&p);
            let cands = cands.clone();
            std::thread::spawn(move || {
                let mut c: HashMap<usize, usize> = HashMap::new();
                for _ in 0..100 {
                    *c.entry(idx(&p.select(&cands).order[0])).or_default() += 1;
                }
                c
            })
        })
        .collect();
    let mut total = vec![0usize; 4];
    for h in handles {
        for (k, v) in h.join().unwrap() {
            total[k] += v;
        }
    }
    // 400 calls over 4 workers from 4 threads: the shared counter keeps them exact.
    assert_eq!(total, vec![100; 4]);
}

#[test]
fn kv_exact_places_unmatched_requests_on_the_worker_holding_least() {
    let p = KvExact::new(&kv_rule(1.5, Some(1), 16), 16);
    let mut c: Vec<Candidate> = (0..4).map(|i| cand(i, true, 0, 0)).collect();
    c[0].cached_blocks = 40;
    c[1].cached_blocks = 8;
    c[2].cached_blocks = 0;
    c[3].cached_blocks = 16;
    for _ in 0..8 {
        let sel = p.select(&c);
        assert_eq!(sel.order[0], WorkerId("w2".into()), "{sel:?}");
        assert_eq!(sel.reason, Reason::NoMatch);
    }
    // Load still comes first: a busier empty worker loses to an idle one holding more.
    c[2].load = 3;
    assert_eq!(p.select(&c).order[0], WorkerId("w1".into()));
    // And a match still wins over holding less.
    c[0].matched_blocks = 4;
    assert_eq!(p.select(&c).order[0], WorkerId("w0".into()));
}

#[test]
fn least_cost_weighs_the_uncached_prompt_against_the_queue() {
    let p = KvExact::new(&kv_rule(1e9, None, 0), 16);
    // w0 holds 1,488 of the 1,600 tokens with 1,000 queued: 2·112 + 1000 = 1224; w1 is cold
    // and idle: 2·1600 = 3200. The holder wins.
    let s = p.select(&[costed(0, 1, 93, 1000), costed(1, 0, 0, 0)]);
    assert_eq!((idx(&s.order[0]), s.reason), (0, Reason::Hit));
    // With 4,000 queued there (4224 > 3200) the cold, idle worker is cheaper: reason `cost`.
    let s = p.select(&[costed(0, 1, 93, 4000), costed(1, 0, 0, 0)]);
    assert_eq!((idx(&s.order[0]), s.reason), (1, Reason::Cost));
    // A shorter match with a short queue beats a longer one with a long queue.
    let s = p.select(&[
        costed(0, 1, 93, 3000),
        costed(1, 1, 50, 0),
        costed(2, 0, 0, 0),
    ]);
    assert_eq!(idx(&s.order[0]), 1);
    // Queued decode tokens count at decode_weight (0.25): 4,000 of them = 1,000 prefill tokens.
    let decoding = Candidate {
        queued_decode: 4000,
        ..costed(0, 1, 93, 0)
    };
    let s = p.select(&[decoding.clone(), costed(1, 0, 50, 0)]);
    // w0: 2·112 + 1000 = 1224; w1: 2·800 = 1600.
    assert_eq!(idx(&s.order[0]), 0);
    let s = p.select(&[
        Candidate {
            queued_decode: 8000,
            ..decoding
        },
        costed(1, 0, 50, 0),
    ]);
    // w0: 224 + 2000 = 2224 > 1600.
    assert_eq!((idx(&s.order[0]), s.reason), (1, Reason::Cost));
}

#[test]
fn queued_cost_is_the_cost_terms_of_queued_work() {
    let rule = kv_rule(1e9, None, 0);
    // decode_weight 0.25: 1,000 prefill + 4,000 decode tokens queued = 2,000.
    assert_eq!(routing_rules::policy::queued_cost(&rule, 1000, 4000), 2000);
    // What it adds is what the policy's cost sees on a worker with that queue.
    let p = KvExact::new(&rule, 16);
    let queued = Candidate {
        queued_decode: 4000,
        ..costed(0, 0, 0, 1000)
    };
    assert_eq!(p.cost(&queued) - p.cost(&costed(0, 0, 0, 0)), 2000);
    let longest = KvExactRule {
        placement: Placement::LongestMatch,
        ..rule
    };
    assert_eq!(routing_rules::policy::queued_cost(&longest, 1000, 4000), 0);
}

#[test]
fn least_cost_ties_go_to_the_longer_match_and_the_guard_stays_hard() {
    let p = KvExact::new(&kv_rule(1.5, Some(1), 0), 16);
    // Equal cost (2·1600 = 2·800 + 1600): the longer match wins the tie.
    let s = p.select(&[costed(0, 0, 0, 0), costed(1, 0, 50, 1600)]);
    assert_eq!((idx(&s.order[0]), s.reason), (1, Reason::Hit));
    // The cheapest worker is over the guard (load 10 against a mean of 5): never first.
    let s = p.select(&[costed(0, 10, 100, 0), costed(1, 0, 0, 5000)]);
    assert_eq!((idx(&s.order[0]), s.reason), (1, Reason::LoadGuard));
    // longest_match placement ignores the queue.
    let mut rule = kv_rule(1e9, None, 0);
    rule.placement = Placement::LongestMatch;
    let p = KvExact::new(&rule, 16);
    let s = p.select(&[costed(0, 1, 93, 100_000), costed(1, 0, 0, 0)]);
    assert_eq!((idx(&s.order[0]), s.reason), (0, Reason::Hit));
}

/// With `active_tokens`, the guard allows a worker one request of this size (its prompt tokens)
/// above the mean plus the slack: on a mostly idle fleet, the worker computing one long prompt
/// still takes the next request of the same prefix (which waits for that prefill and computes
/// only its suffix) instead of sending it cold elsewhere; a worker further ahead is refused.
#[test]
fn active_tokens_guard_allows_one_request_of_this_size_above_the_mean() {
    let mut rule = kv_rule(1.5, None, 0);
    rule.load_metric = routing_rules::schema::LoadMetric::ActiveTokens;
    let p = KvExact::new(&rule, 16);
    // w0 is computing the 1,600-token prefix (load 1,608: its prefill and 8 output tokens) and
    // holds it for placement; 15 idle workers. Mean ≈ 100.5, limit ≈ 100.5 + 1024 + 1600.
    let mut cands = vec![costed(0, 1608, 99, 1600)];
    cands.extend((1..16).map(|i| costed(i, 0, 0, 0)));
    let s = p.select(&cands);
    assert_eq!((idx(&s.order[0]), s.reason), (0, Reason::Hit));
    // Two such prefills queued ahead (load 3,216 > 201 + 2,624): over the guard.
    cands[0] = costed(0, 3216, 99, 3200);
    let s = p.select(&cands);
    assert_ne!(idx(&s.order[0]), 0);
    assert_eq!(s.reason, Reason::LoadGuard);
    // `in_flight` counts requests: no allowance for the request's size (limit = mean + 1).
    let p = KvExact::new(&kv_rule(1.5, None, 0), 16);
    let mut cands = vec![costed(0, 2, 99, 1600)];
    cands.extend((1..16).map(|i| costed(i, 0, 0, 0)));
    assert_eq!(p.select(&cands).reason, Reason::LoadGuard);
}

/// Without a hit, holdings count in prompts of this request's size: workers within one prompt
/// of each other tie and the rotation spreads over them; a worker holding a prompt more loses.
#[test]
fn unmatched_holdings_count_in_prompts_of_this_size() {
    let p = KvExact::new(&kv_rule(1.5, Some(1), 16), 16);
    // A 1,600-token prompt = 100 blocks; w0..w3 hold 40, 8, 0, 99 blocks (all < one prompt),
    // w4 holds 150 (one prompt more).
    let held = [40, 8, 0, 99, 150];
    let c: Vec<Candidate> = held
        .iter()
        .enumerate()
        .map(|(i, &h)| Candidate {
            cached_blocks: h,
            ..costed(i, 0, 0, 0)
        })
        .collect();
    let mut firsts = std::collections::BTreeSet::new();
    for _ in 0..4 {
        let s = p.select(&c);
        assert_eq!(s.reason, Reason::NoMatch);
        firsts.insert(idx(&s.order[0]));
    }
    assert_eq!(
        firsts,
        (0..4).collect(),
        "rotation over the four tied workers"
    );
}
