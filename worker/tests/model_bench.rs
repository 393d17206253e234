//! The engine benchmark as an ignored test (a test-profile build: dependencies and the worker
//! crate are optimized in dev, so no release rebuild of the workspace is needed):
//!
//! ```text
//! KVGATE_BENCH_THREADS=2 cargo test -p worker --test model_bench -- --ignored --nocapture
//! ```
//! `KVGATE_BENCH_FORMAT` = `exact` (default, `WeightFormat::CPU_DEFAULT`) | `hybrid` | `q8_0` |
//! `f32` | `packed` (`Exact` with the packed kernel for every step size) picks the weight format;
//! `KVGATE_BENCH_REPEATS` the runs per figure (default 3, best reported).

use std::path::PathBuf;

use worker::model::{bench, EngineBenchConfig, WeightFormat};

#[test]
#[ignore = "benchmark: run explicitly with --ignored --nocapture"]
fn engine_bench() {
    let dir = std::env::var_os("KVGATE_MODEL_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models"));
    let path = dir.join("SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(path.is_file(), "model file {} is missing", path.display());
    let threads = std::env::var("KVGATE_BENCH_THREADS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(2);
    let mut cfg = EngineBenchConfig::new(path, threads);
    cfg.format = match std::env::var("KVGATE_BENCH_FORMAT").as_deref() {
        Ok("q8_0") => WeightFormat::Q8_0,
        Ok("f32") => WeightFormat::F32,
        Ok("packed") => WeightFormat::Exact {
            dense_min_tokens: usize::MAX,
        },
        Ok("hybrid") => WeightFormat::Hybrid {
            dense_min_tokens: 32,
        },
        _ => WeightFormat::CPU_DEFAULT,
    };
    if let Some(r) = std::env::var("KVGATE_BENCH_REPEATS")
        .ok()
        .and_then(|s| s.parse().ok())
    {
        cfg.repeats = r;
    }
    let report = bench::run(&cfg).unwrap();
    println!("{report}");
}
