//! Measures the precise index's memory per (worker, block) with a counting global allocator,
//! and checks the ≤ 64-byte target and `PrefixIndex::precise_heap_bytes` against it. Prints the
//! figures (`cargo test -p prefix-index --test memory -- --nocapture`).

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicIsize, Ordering};

use prefix_index::{BlockKey, IndexConfig, KvEvent, PrefixIndex, WorkerId};

struct Counting;

static LIVE: AtomicIsize = AtomicIsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LIVE.fetch_add(layout.size() as isize, Ordering::Relaxed);
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size() as isize, Ordering::Relaxed);
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LIVE.fetch_add(
            new_size as isize - layout.size() as isize,
            Ordering::Relaxed,
        );
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

fn key(worker: u64, i: u64) -> BlockKey {
    // distinct, well-spread keys
    BlockKey((worker << 40 | i).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0x5555)
}

/// Fills `workers` × `blocks` (worker, block) pairs, `shared` of each worker's blocks being
/// the same keys for every worker; returns (measured bytes, estimated bytes, pairs).
fn measure(workers: u64, blocks: u64, shared: u64) -> (f64, f64, u64) {
    let idx = PrefixIndex::new(IndexConfig::default()).unwrap();
    let ids: Vec<WorkerId> = (0..workers).map(|w| WorkerId(format!("w{w}"))).collect();
    for id in &ids {
        idx.add_worker(id);
    }
    let before = LIVE.load(Ordering::Relaxed);
    let mut batch = Vec::with_capacity(1024);
    for (w, id) in ids.iter().enumerate() {
        for i in 0..blocks {
            batch.push(if i < shared {
                key(u64::MAX >> 24, i)
            } else {
                key(w as u64, i)
            });
            if batch.len() == 1024 || i + 1 == blocks {
                idx.apply_event(
                    id,
                    &KvEvent::Stored {
                        parent: None,
                        keys: std::mem::take(&mut batch),
                    },
                )
                .unwrap();
                batch.reserve(1024);
            }
        }
    }
    drop(batch);
    let bytes = (LIVE.load(Ordering::Relaxed) - before) as f64;
    let pairs = workers * blocks;
    let est = idx.precise_heap_bytes() as f64;
    (bytes / pairs as f64, est / pairs as f64, pairs)
}

#[test]
fn bytes_per_worker_block_within_target() {
    // worst case for memory: no key shared between workers
    let (measured, estimated, pairs) = measure(64, 25_000, 0);
    eprintln!(
        "precise index, distinct keys: {measured:.1} bytes per (worker, block) over {pairs} pairs (estimate {estimated:.1})"
    );
    assert!(
        measured <= 64.0,
        "{measured} bytes per (worker, block) > 64"
    );
    assert!(
        (estimated - measured).abs() / measured < 0.1,
        "estimate {estimated} vs {measured}"
    );

    // a shared system prompt: half of every worker's blocks are the same keys
    let (measured, estimated, pairs) = measure(64, 25_000, 12_500);
    eprintln!(
        "precise index, half shared: {measured:.1} bytes per (worker, block) over {pairs} pairs (estimate {estimated:.1})"
    );
    assert!(measured <= 64.0);
    assert!(
        (estimated - measured).abs() / measured < 0.1,
        "estimate {estimated} vs {measured}"
    );
}
