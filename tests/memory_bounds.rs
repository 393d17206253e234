//! Memory per request stays a small multiple of its body: a burst of large prompts refused by
//! the gateway and by a worker does not grow the process by more than a bounded amount, and
//! the growth does not accumulate from one burst to the next. Its own test binary, with one
//! test: the measure is this process's resident set (`/proc/self/statm`), which other tests
//! running beside it would disturb.

#[path = "gateway_support/mod.rs"]
mod support;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use support::{Fleet, FleetOptions, KV_SERVICE};

fn rss_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages: u64 = statm
        .split_whitespace()
        .nth(1)
        .and_then(|p| p.parse().ok())
        .unwrap_or(0);
    pages * 4096
}

/// Samples the resident set every 2 ms until dropped; `peak()` is the largest seen.
struct PeakRss {
    peak: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl PeakRss {
    fn start() -> PeakRss {
        let peak = Arc::new(AtomicU64::new(rss_bytes()));
        let stop = Arc::new(AtomicBool::new(false));
        let (p, s) = (peak.clone(), stop.clone());
        let thread = std::thread::spawn(move || {
            while !s.load(Ordering::Relaxed) {
                p.fetch_max(rss_bytes(), Ordering::Relaxed);
                std::thread::sleep(Duration::from_millis(2));
            }
        });
        PeakRss {
            peak,
            stop,
            thread: Some(thread),
        }
    }

    fn peak(&self) -> u64 {
        self.peak.load(Ordering::Relaxed)
    }
}

impl Drop for PeakRss {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

const MIB: u64 = 1 << 20;

#[test]
fn bursts_of_large_bodies_keep_memory_bounded() {
    let mut fleet = Fleet::workers(FleetOptions {
        workers: 2,
        ticket_policy: worker::TicketPolicy::Optional,
        ..FleetOptions::default()
    });
    fleet.start_gateway(KV_SERVICE, false);
    let body = |bytes: usize, n: usize| -> Vec<u8> {
        serde_json::to_vec(&serde_json::json!({
            "model": "smol",
            "messages": [{"role": "user", "content": format!("{n} {}", "many words here ".repeat(bytes / 16))}],
            "max_tokens": 4,
        }))
        .unwrap()
    };
    let gw = fleet.url("/v1/chat/completions");
    let direct = format!("http://{}/v1/chat/completions", fleet.addrs[0]);
    // One burst: 3 concurrent 4 MiB prompts to the gateway, 3 concurrent 7 MiB bodies straight
    // to a worker; every one is refused (context_length_exceeded).
    let burst = |round: usize| {
        fleet.rt.block_on(async {
            let http = reqwest::Client::new();
            let mut tasks = Vec::new();
            for i in 0..3 {
                for (url, size) in [(&gw, 4 << 20), (&direct, 7 << 20)] {
                    let (http, url, b) = (http.clone(), url.clone(), body(size, round * 10 + i));
                    tasks.push(tokio::spawn(async move {
                        let r = http
                            .post(url)
                            .header("content-type", "application/json")
                            .body(b)
                            .send()
                            .await
                            .unwrap();
                        let status = r.status().as_u16();
                        let text = r.text().await.unwrap();
                        (status, text)
                    }));
                }
            }
            for t in tasks {
                let (status, text) = t.await.unwrap();
                assert_eq!(status, 400, "{text}");
                assert!(text.contains("context_length_exceeded"), "{text}");
            }
        })
    };
    burst(0); // warm up: arenas, caches, connections
    let baseline = rss_bytes();
    let sampler = PeakRss::start();
    for round in 1..=5 {
        burst(round);
    }
    let peak = sampler.peak();
    drop(sampler);
    let after = rss_bytes();
    // In flight at once: 3 × 4 MiB + 3 × 7 MiB = 33 MiB of bodies (and the client's copies, in
    // this same process). Measured: see docs/benchmarks.md; the old code grew by ~60× a body.
    println!(
        "rss: baseline {} MiB, peak {} MiB (+{}), after {} MiB",
        baseline / MIB,
        peak / MIB,
        peak.saturating_sub(baseline) / MIB,
        after / MIB
    );
    assert!(
        peak.saturating_sub(baseline) <= 160 * MIB,
        "peak grew {} MiB over the baseline",
        peak.saturating_sub(baseline) / MIB
    );
    assert!(
        after.saturating_sub(baseline) <= 128 * MIB,
        "memory kept after the bursts: {} MiB",
        after.saturating_sub(baseline) / MIB
    );
    fleet.stop();
}
