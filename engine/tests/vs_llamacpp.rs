//! The engine against an implementation no one here wrote: llama.cpp's `llama-server` on the same
//! GGUF (fixtures in `tests/fixtures/llamacpp/`, made by `scripts/make-llamacpp-fixtures.sh`
//! outside CI). Teacher-forced: the engine reads each prompt and then llama.cpp's own greedy
//! continuation one token at a time, and at every position its next-token distribution is
//! compared with llama.cpp's top 5.
//!
//! Architectures (`tiny_*` tests): small GGUFs with deterministic random F32 weights per
//! architecture (`engine::model::tiny`, regenerated here byte for byte: the fixture's SHA-256 is
//! checked), where both engines compute in F32: every one of llama.cpp's top-5 tokens must have
//! the engine's log-probability within 0.02, and the engine's greedy id must be llama.cpp's, at
//! every position (unless llama.cpp's own top two are within that tolerance: a tie).
//!
//! The default model (below):
//! The two are not bit-identical by design: llama.cpp quantizes activations to 8 bits for its
//! Q4_1 products, this engine keeps them F32 (docs/benchmarks.md). The checks are what that
//! allows, measured: at every position each of llama.cpp's top-5 tokens has its probability here
//! within 0.15 (the largest difference measured is printed; in log-probability the gap reaches
//! 1.2 on an unlikely token, ≤ 0.6 on 47 of 48 SmolLM2 positions; the order of a flat tail of
//! near-equal tokens may differ), and the engine's most likely token is within llama.cpp's top 3
//! (SmolLM2's first answer token
//! to "What is the capital of France?" is a near tie, "L" −1.85 vs "The" −2.09 in llama.cpp,
//! "The" −1.88 vs "L" −1.96 here: the greedy continuations diverge at once, the distributions
//! do not).

use std::path::PathBuf;
use std::sync::Arc;

use engine::executor::{Executor, KvGeometry, SeqChunk};
use engine::model::{LlamaExecutor, LlamaWeights, WeightFormat};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn model_path() -> PathBuf {
    let dir = std::env::var_os("KVGATE_MODEL_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| root().join("models"));
    let p = dir.join("SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(p.is_file(), "model file {} is missing", p.display());
    p
}

fn log_softmax_top(logits: &[f32], k: usize) -> Vec<(u32, f64)> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let lse = max
        + logits
            .iter()
            .map(|&x| (x as f64 - max).exp())
            .sum::<f64>()
            .ln();
    let mut idx: Vec<u32> = (0..logits.len() as u32).collect();
    idx.sort_by(|&a, &b| logits[b as usize].total_cmp(&logits[a as usize]));
    idx.into_iter()
        .take(k)
        .map(|i| (i, logits[i as usize] as f64 - lse))
        .collect()
}

/// A released model against its fixture: each of llama.cpp's top-5 tokens has (within 0.15) its
/// probability here, and the engine's argmax is in llama.cpp's top 3, at every position. Returns
/// the largest probability difference.
fn real_model_agrees(model: &std::path::Path, fixture: &str) -> f64 {
    real_model_agrees_with(model, fixture, WeightFormat::CPU_DEFAULT).worst
}

/// A position where the engine's argmax is not llama.cpp's greedy token.
#[derive(Debug)]
struct Differs {
    case: String,
    position: usize,
    /// llama.cpp's log-probability gap between its top two.
    their_gap: f64,
    /// Ours, between our argmax and llama.cpp's greedy token (which must be in our top 5).
    our_gap: f64,
}

/// How closely the engine followed a fixture (teacher-forced along llama.cpp's tokens).
struct Agreement {
    /// Largest probability difference on llama.cpp's top-5 tokens.
    worst: f64,
    /// Mean |log-probability difference| on llama.cpp's top-5 tokens.
    mean: f64,
    /// Positions where the engine's argmax is not llama.cpp's greedy token.
    differs: Vec<Differs>,
}

/// [`real_model_agrees`] with the weights in `format`.
fn real_model_agrees_with(
    model: &std::path::Path,
    fixture: &str,
    format: WeightFormat,
) -> Agreement {
    let fixture: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(root().join("tests/fixtures/llamacpp").join(fixture))
            .expect("fixture"),
    )
    .unwrap();
    let sha = {
        use sha2::Digest;
        hex::encode(sha2::Sha256::digest(std::fs::read(model).unwrap()))
    };
    assert_eq!(
        fixture["model_sha256"].as_str(),
        Some(sha.as_str()),
        "not the fixture's model"
    );
    let weights = Arc::new(LlamaWeights::load(model, &candle_core::Device::Cpu, format).unwrap());
    let block_size = 16;
    let mut exec = LlamaExecutor::new(
        weights,
        KvGeometry {
            block_size,
            num_blocks: 16,
        },
    )
    .unwrap();
    let table: Vec<u32> = (0..16).collect();
    let mut worst: f64 = 0.0;
    // Mean |log-probability difference| over llama.cpp's top 5 at every position.
    let (mut lp_diff_sum, mut lp_diffs) = (0f64, 0usize);
    let mut positions = 0;
    let mut greedy_differs = Vec::new();
    for case in fixture["cases"].as_array().unwrap() {
        let name = case["name"].as_str().unwrap();
        let prompt: Vec<u32> = case["prompt_ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect();
        let steps = case["steps"].as_array().unwrap();
        let mut tokens = prompt.clone();
        let mut done = 0;
        for (k, step) in steps.iter().enumerate() {
            let chunk = [SeqChunk {
                tokens: &tokens[done..],
                start_pos: done,
                block_table: &table,
                want_logits: true,
                all_logits: false,
            }];
            let logits = exec.forward(&chunk).unwrap().remove(0).unwrap();
            done = tokens.len();
            let all = log_softmax_top(&logits, logits.len());
            let ours = &all[..5];
            let theirs: Vec<(u32, f64)> = step["top"]
                .as_array()
                .unwrap()
                .iter()
                .map(|t| (t[0].as_u64().unwrap() as u32, t[1].as_f64().unwrap()))
                .collect();
            let at = format!("{name} position {k}: ours {ours:?}, llama.cpp {theirs:?}");
            // Every one of llama.cpp's top 5 with (nearly) its probability here.
            for (id, their) in &theirs {
                let lp = all
                    .iter()
                    .find(|(t, _)| t == id)
                    .map_or(f64::NEG_INFINITY, |x| x.1);
                let d = (lp.exp() - their.exp()).abs();
                worst = worst.max(d);
                lp_diff_sum += (lp - their).abs();
                lp_diffs += 1;
                assert!(
                    d <= 0.15,
                    "probability difference {d:.3} > 0.15 for {id} at {at}"
                );
            }
            assert!(
                theirs.iter().take(3).any(|(t, _)| *t == ours[0].0),
                "our argmax {} is not in llama.cpp's top 3 at {at}",
                ours[0].0
            );
            positions += 1;
            // Teacher forcing: continue with llama.cpp's token.
            let theirs_greedy = step["id"].as_u64().unwrap() as u32;
            if ours[0].0 != theirs_greedy {
                greedy_differs.push(Differs {
                    case: name.to_string(),
                    position: k,
                    their_gap: theirs[0].1 - theirs[1].1,
                    our_gap: ours
                        .iter()
                        .find(|(t, _)| *t == theirs_greedy)
                        .map_or(f64::INFINITY, |x| ours[0].1 - x.1),
                });
            }
            tokens.push(theirs_greedy);
        }
        // The next case starts again at position 0 and overwrites these KV slots.
    }
    println!(
        "vs llama.cpp, {} ({format:?}): {positions} positions compared, largest probability difference on shared top-5 tokens {worst:.3}, mean log-probability difference {:.4}, greedy token differs at {greedy_differs:?}",
        model.display(),
        lp_diff_sum / lp_diffs.max(1) as f64
    );
    Agreement {
        worst,
        mean: lp_diff_sum / lp_diffs.max(1) as f64,
        differs: greedy_differs,
    }
}

#[test]
fn next_token_distributions_agree_with_llama_cpp() {
    real_model_agrees(&model_path(), "smollm2-q4_1.json");
}

/// `WeightFormat::LlamaCpp` (llama.cpp's arithmetic: 8-bit activations in the block products,
/// quantized as ggml's x86 code does it; keys and values stored as f16; SiLU and GELU as ggml
/// computes them) against llama-server's fixtures, with bounds set by llama.cpp's own noise
/// floor (`scripts/check-llamacpp-self-agreement.sh`, 2026-12-05). Teacher-forced the same way,
/// llama.cpp itself with only flash attention turned off differs from its fixture by a mean
/// |log-probability difference| on the top 5 of 0.106 (SmolLM2) and 0.111 (Gemma 3 270M), by at
/// most 0.043 / 0.055 in probability, and takes another greedy token at one position of each
/// (SmolLM2 `count` 1, its top two 0.094 apart; Gemma `capital` 7, 0.0016). With flash
/// attention on but each forced prefix prefilled in one batch instead of decoded token by token,
/// Gemma still differs by 0.052 on average and at `count` 9 (0.17 apart): llama.cpp's Gemma
/// results depend on batching. Each op emulated is bit for bit ggml's
/// (`scripts/check-ggml-ops.sh`), but the summation orders around them are not, so the figures
/// below move within that noise from one faithful change to the next: the largest difference,
/// a maximum over 240 values, most of all (SmolLM2: 0.074 → 0.092 with ggml's quantization →
/// 0.115 with ggml's SiLU, while the mean went 0.114 → 0.101 → 0.105). Flash attention's f16
/// accumulator, emulated to 5·10⁻⁷ of ggml's, was not kept (mean 0.110, two differences).
///
/// Measured (AMD EPYC, AVX-512 VNNI, 2026-12-05): SmolLM2 mean 0.105, largest 0.115, all 48
/// greedy tokens equal; Gemma mean 0.116, largest 0.041, greedy differs at one of 36
/// positions (`count` 11), where llama.cpp's top two are 0.014 apart. (`Exact`: SmolLM2
/// 0.113 / 0.117 and one greedy difference; Gemma 0.132 / 0.043 and two.) Until the K-quant
/// matrices ran on the file's own blocks (they were quantized again from their values, which
/// gives other blocks: `weights::tests::quantized_products_use_the_stored_blocks`), Gemma was
/// at 0.157 / 0.060 and three differences, one where llama.cpp's top two are 0.14 apart.
/// Asserted: SmolLM2 mean ≤ 0.125 (llama.cpp's own 0.106 and a margin), largest ≤ 0.15 (the
/// per-token bound of [`real_model_agrees`]), at most one greedy difference and only where our
/// own top two are within 0.02 (the machine's summation order decides those: an AVX2-only EPYC
/// once took the other token at `kv` 9); Gemma mean ≤ 0.14 (llama.cpp's own 0.111 and a
/// margin) and at most two greedy differences, each where llama.cpp's top two are within 0.05.
#[test]
fn llama_cpp_numerics_give_llama_cpps_greedy_tokens() {
    let smol = real_model_agrees_with(&model_path(), "smollm2-q4_1.json", WeightFormat::LlamaCpp);
    let gemma_path = model_path().with_file_name("gemma-3-270m-q4_k_m.gguf");
    let gemma = real_model_agrees_with(
        &gemma_path,
        "gemma3-270m-q4_k_m.json",
        WeightFormat::LlamaCpp,
    );
    for d in smol.differs.iter().chain(&gemma.differs) {
        println!(
            "{} position {}: our top two {:.3} apart, llama.cpp's {:.3}",
            d.case, d.position, d.our_gap, d.their_gap
        );
    }
    let differs = &smol.differs;
    assert!(
        differs.iter().all(|d| d.our_gap < 0.02),
        "greedy tokens differ beyond our own near ties: {differs:?}"
    );
    assert!(
        differs.len() <= 1,
        "more than one of 48 positions differs: {differs:?}"
    );
    assert!(
        smol.worst <= 0.15,
        "largest probability difference {:.3} > 0.15",
        smol.worst
    );
    assert!(
        smol.mean <= 0.125,
        "mean log-probability difference {:.3} > 0.125",
        smol.mean
    );
    assert!(
        gemma.differs.iter().all(|d| d.their_gap < 0.05) && gemma.differs.len() <= 2,
        "greedy differs beyond llama.cpp's near ties: {:?}",
        gemma.differs
    );
    assert!(
        gemma.mean <= 0.14,
        "Gemma: mean log-probability difference {:.3} > 0.14",
        gemma.mean
    );
}

/// Gemma 3 270M (Q4_K_M, from PyPI: scripts/fetch-gemma3.sh, which scripts/setup.sh runs).
#[test]
fn gemma3_270m_distributions_agree_with_llama_cpp() {
    let dir = std::env::var_os("KVGATE_MODEL_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| root().join("models"));
    let p = dir.join("gemma-3-270m-q4_k_m.gguf");
    assert!(
        p.is_file(),
        "{} is missing: run scripts/fetch-gemma3.sh",
        p.display()
    );
    real_model_agrees(&p, "gemma3-270m-q4_k_m.json");
}

fn tiny_arch_agrees(arch: &str) {
    tiny_arch_agrees_within(arch, 0.02);
}

/// [`tiny_arch_agrees`] with its own log-probability tolerance (quantized weights: llama.cpp
/// quantizes activations for those products, this engine does not).
fn tiny_arch_agrees_within(arch: &str, tol: f64) {
    tiny_arch_agrees_as(arch, tol, WeightFormat::CPU_DEFAULT);
}

/// [`tiny_arch_agrees_within`] with the weights in `format`; returns the largest log-probability
/// difference.
fn tiny_arch_agrees_as(arch: &str, tol: f64, format: WeightFormat) -> f64 {
    let fixture: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(root().join(format!("tests/fixtures/llamacpp/tiny-{arch}.json")))
            .expect("fixture"),
    )
    .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join(format!("tiny-{arch}.gguf"));
    let tokenizer = if arch.starts_with("phi3") {
        // llama.cpp's phi3 loader wants the Phi-3 vocabulary (scripts/fetch-fixtures.sh).
        let dir = std::env::var_os("KVGATE_FIXTURES_DIR")
            .map(PathBuf::from)
            .unwrap_or_else(|| root().join(".cache/fixtures"));
        let p = dir.join("llama.cpp/models/ggml-vocab-phi-3.gguf");
        assert!(
            p.is_file(),
            "{} is missing: run scripts/fetch-fixtures.sh (scripts/setup.sh does)",
            p.display()
        );
        p
    } else {
        model_path()
    };
    engine::model::tiny::write_tiny_gguf(arch, &tokenizer, &path).unwrap();
    let bytes = std::fs::read(&path).unwrap();
    let sha = {
        use sha2::Digest;
        hex::encode(sha2::Sha256::digest(&bytes))
    };
    assert_eq!(
        fixture["model_sha256"].as_str(),
        Some(sha.as_str()),
        "the regenerated tiny {arch} model differs from the one the fixture was made from"
    );
    let weights = Arc::new(LlamaWeights::load(&path, &candle_core::Device::Cpu, format).unwrap());
    let mut exec = LlamaExecutor::new(
        weights,
        KvGeometry {
            block_size: 16,
            num_blocks: 8,
        },
    )
    .unwrap();
    let table: Vec<u32> = (0..8).collect();
    let mut worst: f64 = 0.0;
    let mut positions = 0;
    for case in fixture["cases"].as_array().unwrap() {
        let mut tokens: Vec<u32> = case["prompt_ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect();
        let mut done = 0;
        for (k, step) in case["steps"].as_array().unwrap().iter().enumerate() {
            let chunk = [SeqChunk {
                tokens: &tokens[done..],
                start_pos: done,
                block_table: &table,
                want_logits: true,
                all_logits: false,
            }];
            let logits = exec.forward(&chunk).unwrap().remove(0).unwrap();
            done = tokens.len();
            let all = log_softmax_top(&logits, logits.len());
            let lp = |id: u32| all.iter().find(|(t, _)| *t == id).map(|(_, l)| *l);
            // Greedy ids equal llama.cpp's (its continuation is the fixture's step ids), unless
            // its own top two are within the tolerance of each other (a tie either engine may
            // break either way; reported).
            let top = step["top"].as_array().unwrap();
            let gap = top[0][1].as_f64().unwrap() - top[1][1].as_f64().unwrap();
            let greedy_id = step["id"].as_u64().unwrap() as u32;
            if gap > tol {
                assert_eq!(
                    all[0].0, greedy_id,
                    "tiny {arch}, {} position {k}: greedy id {} here, {greedy_id} in llama.cpp",
                    case["name"], all[0].0
                );
            } else if all[0].0 != greedy_id {
                println!(
                    "tiny {arch}: near tie at {} position {k} (gap {gap:.4})",
                    case["name"]
                );
            }
            for t in step["top"].as_array().unwrap() {
                let (id, theirs) = (t[0].as_u64().unwrap() as u32, t[1].as_f64().unwrap());
                let ours = lp(id).unwrap();
                let d = (ours - theirs).abs();
                worst = worst.max(d);
                assert!(
                    d <= tol,
                    "tiny {arch}, {} position {k}: token {id} log-prob {ours:.4} here, {theirs:.4} in llama.cpp",
                    case["name"]
                );
            }
            positions += 1;
            tokens.push(step["id"].as_u64().unwrap() as u32);
        }
    }
    println!(
        "vs llama.cpp, tiny {arch} ({format:?}): {positions} positions, largest log-prob difference {worst:.5}"
    );
    worst
}

#[test]
fn tiny_llama_agrees_with_llama_cpp() {
    tiny_arch_agrees("llama");
}

#[test]
fn tiny_qwen2_agrees_with_llama_cpp() {
    tiny_arch_agrees("qwen2");
}

#[test]
fn tiny_qwen3_agrees_with_llama_cpp() {
    tiny_arch_agrees("qwen3");
}

#[test]
fn tiny_llama3_rope_factors_agree_with_llama_cpp() {
    tiny_arch_agrees("llama3");
}

#[test]
fn tiny_phi3_agrees_with_llama_cpp() {
    tiny_arch_agrees("phi3");
}

#[test]
fn tiny_gemma3_agrees_with_llama_cpp() {
    tiny_arch_agrees("gemma3");
}

/// The exact-output property per architecture and weight format: the paged cache keeps every
/// position's K/V for every layer (sliding layers only stop *reading* keys older than their
/// window), so a run that reuses two cached blocks, a run that reuses a copy of a cached block's
/// first 4 positions, and a run whose prompt is prefilled in chunks of 7, give the same greedy
/// tokens as a cold one-chunk run, and bit-identical logits for
/// every format but the packed-kernel ones (Q8_0, Q4_0, Q4_1: within 1e-5, measured ~1e-6).
#[test]
fn cached_and_chunked_runs_equal_cold_runs_for_every_architecture_and_format() {
    let dir = tempfile::tempdir().unwrap();
    let mut results = Vec::new();
    // The name, and `+llama-cpp` for the same file under `WeightFormat::LlamaCpp`.
    for name in [
        "llama",
        "llama3",
        "qwen2",
        "qwen3",
        "gemma3",
        "llama-f16",
        "llama-bf16",
        "llama-q8_0",
        "llama-q4_0",
        "llama-q4_1",
        "llama-q4_k",
        "llama-q5_k",
        "llama-q6_k",
        "llama-q4_1+llama-cpp",
        "llama-q8_0+llama-cpp",
        "gemma3-q4_k+llama-cpp",
    ] {
        let (arch, format) = match name.strip_suffix("+llama-cpp") {
            Some(a) => (a, WeightFormat::LlamaCpp),
            None => (name, WeightFormat::CPU_DEFAULT),
        };
        let path = dir.path().join(format!("tiny-{arch}.gguf"));
        if !path.exists() {
            engine::model::tiny::write_tiny_gguf(arch, &model_path(), &path).unwrap();
        }
        let weights =
            Arc::new(LlamaWeights::load(&path, &candle_core::Device::Cpu, format).unwrap());
        if arch.starts_with("gemma3") {
            assert_eq!(weights.config().sliding_window, Some(4));
        }
        let mut exec = LlamaExecutor::new(
            weights,
            KvGeometry {
                block_size: 16,
                num_blocks: 8,
            },
        )
        .unwrap();
        let prompt: Vec<u32> = (0..40u32).map(|i| 100 + i * 37).collect();
        // Greedy from `start` (positions before it already cached), prefilling `chunk` tokens
        // per step; returns the tokens and the logits of every step.
        let greedy = |exec: &mut LlamaExecutor, table: &[u32], start: usize, chunk: usize| {
            let mut tokens = prompt.clone();
            let mut done = start;
            let mut out = Vec::new();
            let mut all = Vec::new();
            while out.len() < 6 {
                let end = if done < prompt.len() {
                    (done + chunk).min(prompt.len())
                } else {
                    tokens.len()
                };
                let c = [SeqChunk {
                    tokens: &tokens[done..end],
                    start_pos: done,
                    block_table: table,
                    want_logits: end >= prompt.len(),
                    all_logits: false,
                }];
                let logits = exec.forward(&c).unwrap().remove(0);
                done = end;
                if let Some(l) = logits {
                    let next = log_softmax_top(&l, 1)[0].0;
                    all.push(l);
                    tokens.push(next);
                    out.push(next);
                }
            }
            (out, all)
        };
        let cold = greedy(&mut exec, &[0, 1, 2], 0, 64);
        let cached = greedy(&mut exec, &[0, 1, 3], 32, 64);
        let chunked = greedy(&mut exec, &[4, 5, 6], 0, 7);
        // A partial reuse through a block copy (the scheduler's copy of a cached block whose
        // first tokens a request shares): block 1 (positions 16..32) copied to block 7, then
        // positions 20.. recomputed over the copy's other slots.
        exec.copy_block(1, 7).unwrap();
        let copied = greedy(&mut exec, &[0, 7, 5], 20, 64);
        let diff = |a: &[Vec<f32>], b: &[Vec<f32>]| {
            a.iter()
                .flatten()
                .zip(b.iter().flatten())
                .map(|(x, y)| (x - y).abs())
                .fold(0f32, f32::max)
        };
        println!(
            "exact output, {name}: cached max |Δlogit| {}, copied {}, chunked {}; greedy equal {} / {} / {}",
            diff(&cold.1, &cached.1),
            diff(&cold.1, &copied.1),
            diff(&cold.1, &chunked.1),
            cold.0 == cached.0,
            cold.0 == copied.0,
            cold.0 == chunked.0
        );
        assert_eq!(cold.0, cached.0, "{name}: cached greedy tokens differ");
        assert_eq!(cold.0, chunked.0, "{name}: chunked greedy tokens differ");
        assert_eq!(
            cold.0, copied.0,
            "{name}: greedy tokens after a block copy differ"
        );
        results.push((
            name,
            diff(&cold.1, &cached.1).max(diff(&cold.1, &copied.1)),
            diff(&cold.1, &chunked.1),
        ));
    }
    // Measured: bit-identical everywhere but the packed-kernel formats (Q8_0, Q4_0, Q4_1, and Q4_K
    // repacked as Q4_1), whose logits differ by ~1e-6 between step sizes at this width (the
    // greedy tokens do not).
    let packed = ["llama-q8_0", "llama-q4_0", "llama-q4_1", "llama-q4_k"];
    let inexact: Vec<_> = results
        .iter()
        .filter(|(arch, a, b)| {
            let limit = if packed.contains(arch) { 1e-5 } else { 0.0 };
            *a > limit || *b > limit
        })
        .collect();
    assert!(inexact.is_empty(), "beyond their limits: {inexact:?}");
}

/// Weight formats: the tiny llama with every matrix but the embedding stored in each format
/// (K-quants at width 256). Tolerances: 0.02 where llama.cpp keeps activations in F32 or F16
/// for the product, wider for the 8-bit activation quantization it applies with block formats
/// (measured maxima printed by each run).
/// The same files under `--numerics llama-cpp` (`WeightFormat::LlamaCpp`: 8-bit activations in
/// the block products, f16 keys and values): within the same tolerance. Measured 2026-12-05
/// (AMD EPYC, AVX-512 VNNI), largest log-probability difference: F16 0.0009, BF16 0.0052, Q8_0
/// 0.022, Q4_0 0.020, Q4_1 0.022, Q4_K 0.020, Q5_K 0.019, Q6_K 0.023 — about what the default
/// gives (these random-weight files' differences come from elsewhere; rounding the activations
/// to BF16 before BF16 products, as ggml does, moved BF16's only from 0.0052 to 0.0051 and was
/// not kept).
#[test]
fn tiny_llama_weight_formats_agree_with_llama_cpp_under_its_numerics() {
    for fmt in [
        "f16", "bf16", "q8_0", "q4_0", "q4_1", "q4_k", "q5_k", "q6_k",
    ] {
        tiny_arch_agrees_as(&format!("llama-{fmt}"), 0.05, WeightFormat::LlamaCpp);
    }
}

#[test]
fn tiny_llama_weight_formats_agree_with_llama_cpp() {
    for (fmt, tol) in [
        ("f16", 0.02),
        ("bf16", 0.05),
        ("q8_0", 0.05),
        ("q4_0", 0.05),
        ("q4_1", 0.05),
        ("q4_k", 0.05),
        ("q5_k", 0.05),
        ("q6_k", 0.05),
    ] {
        tiny_arch_agrees_within(&format!("llama-{fmt}"), tol);
    }
}
