//! Batched decode alone, for profiles and A/B runs of two builds: `streams` sequences of a
//! 64-token prompt decode `steps` tokens together (greedy, one `forward_sampled` per step) on
//! one thread; prints the best aggregate tok/s of `repeats` runs. The engine benchmark's decode
//! figure without its prefill figures, so `perf record` sees decode steps (and the prompts'
//! prefill, a small share):
//!
//!     cargo build -p engine --example decode_streams
//!     ./target/debug/examples/decode_streams MODEL.gguf 8 llama-cpp 64 20
//!     perf record -e cpu-clock -g ./target/debug/examples/decode_streams MODEL.gguf 8
//!
//! Arguments: model, streams (default 8), numerics `exact` | `llama-cpp` (default
//! `llama-cpp`), decode steps (default 64), repeats (default 20).

use engine::model::{bench, EngineBenchConfig, WeightFormat};

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let Some(model) = args.get(1) else {
        eprintln!("usage: decode_streams MODEL.gguf [STREAMS] [exact|llama-cpp] [STEPS] [REPEATS]");
        std::process::exit(2);
    };
    let num = |i: usize, default: usize| -> usize {
        match args.get(i).map(|s| s.parse::<usize>()) {
            None => default,
            Some(Ok(v)) if v > 0 => v,
            Some(_) => {
                eprintln!("argument {i} must be a positive integer");
                std::process::exit(2);
            }
        }
    };
    let format = match args.get(3).map(String::as_str) {
        None | Some("llama-cpp") => WeightFormat::LlamaCpp,
        Some("exact") => WeightFormat::CPU_DEFAULT,
        Some(other) => {
            eprintln!("numerics must be exact or llama-cpp, not {other}");
            std::process::exit(2);
        }
    };
    let streams = num(2, 8);
    let mut cfg = EngineBenchConfig::new(model, 1);
    cfg.format = format;
    cfg.prefill_tokens = 16;
    cfg.cached_prefix = 16;
    cfg.concurrency = vec![streams];
    cfg.decode_steps = num(4, 64);
    cfg.repeats = num(5, 20);
    match bench::run(&cfg) {
        Ok(r) => {
            for (n, tok_s) in r.aggregate {
                if n == streams {
                    println!("{streams} streams: {tok_s:.1} tok/s");
                }
            }
        }
        Err(e) => {
            eprintln!("decode_streams: {e}");
            std::process::exit(1);
        }
    }
}
