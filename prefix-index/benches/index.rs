//! The prefix index at the scale: 64 workers × 100,000 precise blocks each.
//! * `longest_match_256/all_64_hold_chain`: every worker holds the whole 256-block query chain
//!   (the most work per block: 64 workers stay active through all 256 blocks); same chain each
//!   iteration, so its entries are cache-warm.
//! * `longest_match_256/random_chain_cold`: each iteration queries a different worker's
//!   256-block chain out of 25,000 (one worker matches all of it, mostly cache-cold lookups).
//! * `ingest/stored_then_removed_256`: one `Stored` of 256 fresh keys then one `Removed` of
//!   them, into the full index: 512 block operations per iteration.
//!
//! Targets: longest match ≤ 20 µs; ingestion ≥ 5 M blocks/s on one core.

use criterion::{black_box, criterion_group, criterion_main, Criterion, Throughput};
use prefix_index::{BlockKey, IndexConfig, KvEvent, PrefixIndex, WorkerId};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::time::Duration;

const WORKERS: usize = 64;
const BLOCKS: usize = 100_000;
const CHAIN: usize = 256;

struct Fixture {
    idx: PrefixIndex,
    ids: Vec<WorkerId>,
    shared: Vec<BlockKey>,
    chains: Vec<Vec<BlockKey>>, // per-worker private chains
}

fn fixture() -> Fixture {
    let mut rng = StdRng::seed_from_u64(42);
    let idx = PrefixIndex::new(IndexConfig::default()).unwrap();
    let ids: Vec<WorkerId> = (0..WORKERS)
        .map(|w| WorkerId(format!("worker-{w:02}")))
        .collect();
    let shared: Vec<BlockKey> = (0..CHAIN).map(|_| BlockKey(rng.gen())).collect();
    let mut chains = Vec::new();
    for id in &ids {
        idx.add_worker(id);
        idx.apply_event(
            id,
            &KvEvent::Stored {
                parent: None,
                keys: shared.clone(),
            },
        )
        .unwrap();
        let mut held = CHAIN;
        while held < BLOCKS {
            let n = CHAIN.min(BLOCKS - held);
            let chain: Vec<BlockKey> = (0..n).map(|_| BlockKey(rng.gen())).collect();
            idx.apply_event(
                id,
                &KvEvent::Stored {
                    parent: None,
                    keys: chain.clone(),
                },
            )
            .unwrap();
            held += n;
            if n == CHAIN {
                chains.push(chain);
            }
        }
    }
    Fixture {
        idx,
        ids,
        shared,
        chains,
    }
}

fn index(c: &mut Criterion) {
    let f = fixture();
    assert_eq!(f.idx.precise_keys(), CHAIN + WORKERS * (BLOCKS - CHAIN));
    let mut g = c.benchmark_group("longest_match_256");
    g.bench_function("all_64_hold_chain", |b| {
        b.iter(|| {
            let m = f.idx.longest_matches(black_box(&f.shared));
            debug_assert_eq!(m.len(), WORKERS);
            m.len()
        })
    });
    let mut i = 0usize;
    g.bench_function("random_chain_cold", |b| {
        b.iter(|| {
            i = (i + 7919) % f.chains.len();
            f.idx.longest_matches(black_box(&f.chains[i])).len()
        })
    });
    g.finish();

    let mut g = c.benchmark_group("ingest");
    g.throughput(Throughput::Elements(2 * CHAIN as u64));
    let mut rng = StdRng::seed_from_u64(7);
    let fresh: Vec<Vec<BlockKey>> = (0..1024)
        .map(|_| (0..CHAIN).map(|_| BlockKey(rng.gen())).collect())
        .collect();
    let mut j = 0usize;
    let id = &f.ids[3];
    g.bench_function("stored_then_removed_256", |b| {
        b.iter(|| {
            j = (j + 1) % fresh.len();
            let keys = &fresh[j];
            f.idx
                .apply_event(
                    id,
                    &KvEvent::Stored {
                        parent: None,
                        keys: keys.clone(),
                    },
                )
                .unwrap();
            f.idx
                .apply_event(id, &KvEvent::Removed { keys: keys.clone() })
                .unwrap();
        })
    });
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().warm_up_time(Duration::from_secs(1)).measurement_time(Duration::from_secs(3)).sample_size(30);
    targets = index
}
criterion_main!(benches);
