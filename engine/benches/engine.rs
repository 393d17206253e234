//! The engine benchmark: single-stream prefill and decode, aggregate batched decode at 1/4/8/16
//! streams, and the prefill of 16 new tokens after 1,024 cached ones, on the default model.
//!
//! ```text
//! cargo bench -p engine --bench engine                   # release profile
//! cargo test -p engine --bench engine -- --bench         # the (optimized) dev profile, no release rebuild
//! ```
//! (`kvgate bench --engine-model FILE` runs the same code.) Environment: `KVGATE_MODEL_DIR`
//! (default `models/`), `KVGATE_BENCH_THREADS` (default 2), `KVGATE_BENCH_FORMAT` = `exact`
//! (default, `WeightFormat::CPU_DEFAULT`) | `hybrid` | `q8_0` | `f32` | `packed` (`Exact` with the
//! packed kernel for every step size), `KVGATE_BENCH_REPEATS` (runs per figure, default 3, best
//! reported). Without `--bench` (as `cargo test --all-targets` runs it) it only says how to run.

use std::path::PathBuf;

use engine::model::{bench, EngineBenchConfig, WeightFormat};

fn main() {
    if !std::env::args().any(|a| a == "--bench") {
        println!("engine bench: run with `cargo bench -p engine --bench engine`");
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
    match bench::run(&cfg) {
        Ok(report) => println!("{report}"),
        Err(e) => {
            eprintln!("engine bench failed: {e}");
            std::process::exit(1);
        }
    }
}
