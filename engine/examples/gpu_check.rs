//! The device executor's check on a GPU, as one command (`scripts/gpu-check.sh` builds it with
//! `--features cuda`, carries it to a machine with an NVIDIA GPU and runs it there):
//!
//! 1. the CPU reference: the tuned CPU executor's greedy tokens and first logits for the golden
//!    prompts (`engine::model::golden`);
//! 2. per device variant (weights F32 / BF16 / the file's Q4_1 through candle's CUDA kernels;
//!    attention composed / fused): the same prompts cold, with a cached prefix (and one through a
//!    copied KV block), prefilled in
//!    chunks and batched with decodes together — greedy tokens against the CPU's and against
//!    the variant's own cold run, logits' largest distance;
//! 3. a generated model of every architecture, device (F32) against the CPU executor;
//! 4. the engine benchmark on the device (prefill 512 and 4,096 tokens, decode at 1/8/64
//!    streams, 1,024 cached + 16 new tokens against uncached) per variant.
//!
//! Prints one JSON object (and writes it to `--out FILE` after every stage, so a run cut short
//! keeps what it measured). Without the `cuda` feature, or with `--cpu`, the device variants
//! run on the CPU (F32, composed): a check of this program itself.
//!
//! Usage: `gpu_check MODEL.gguf [--out FILE] [--deadline-s S] [--cpu] [--quick]`

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;

use candle_core::{DType, Device};
use engine::executor::{BlockId, Executor, KvGeometry};
use engine::model::bench::{measure, EngineBenchConfig};
use engine::model::golden::{
    germany_prompt, greedy_paged, greedy_sampled, run_batched, Seq, CHAT_PROMPT, COLORS_PROMPT,
};
use engine::model::{
    AttentionKind, DeviceExecutor, EventTracking, LlamaExecutor, LlamaWeights, WeightFormat,
};
use engine::EngineError;
use serde_json::{json, Map, Value};

struct Args {
    model: PathBuf,
    out: Option<PathBuf>,
    deadline_s: f64,
    cpu: bool,
    quick: bool,
}

fn parse_args() -> Result<Args, String> {
    let mut it = std::env::args().skip(1);
    let mut a = Args {
        model: PathBuf::new(),
        out: None,
        deadline_s: 420.0,
        cpu: false,
        quick: false,
    };
    while let Some(x) = it.next() {
        match x.as_str() {
            "--out" => a.out = Some(it.next().ok_or("--out FILE")?.into()),
            "--deadline-s" => {
                a.deadline_s = it
                    .next()
                    .and_then(|v| v.parse().ok())
                    .ok_or("--deadline-s SECONDS")?
            }
            "--cpu" => a.cpu = true,
            "--quick" => a.quick = true,
            m if !m.starts_with("--") && a.model.as_os_str().is_empty() => a.model = m.into(),
            other => return Err(format!("unknown argument {other}")),
        }
    }
    if a.model.as_os_str().is_empty() {
        return Err(
            "usage: gpu_check MODEL.gguf [--out FILE] [--deadline-s S] [--cpu] [--quick]".into(),
        );
    }
    Ok(a)
}

/// A device variant: weights format, attention, and which device (event tracking on or off).
#[derive(Clone, Copy)]
struct Variant {
    name: &'static str,
    format: WeightFormat,
    attention: AttentionKind,
    tracked: bool,
}

const fn variant(
    name: &'static str,
    format: WeightFormat,
    attention: AttentionKind,
    tracked: bool,
) -> Variant {
    Variant {
        name,
        format,
        attention,
        tracked,
    }
}

const N_NEW: usize = 24;
const BLOCK: usize = 16;

fn prompts() -> Vec<Vec<u32>> {
    vec![
        CHAT_PROMPT.to_vec(),
        germany_prompt(),
        COLORS_PROMPT.to_vec(),
    ]
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(
        if a.len() == b.len() {
            0.0
        } else {
            f32::INFINITY
        },
        f32::max,
    )
}

/// Index of the first differing token (None when equal).
fn divergence(a: &[u32], b: &[u32]) -> Option<usize> {
    if a == b {
        return None;
    }
    Some(
        a.iter()
            .zip(b)
            .position(|(x, y)| x != y)
            .unwrap_or(a.len().min(b.len())),
    )
}

/// Cold greedy tokens and first logits of one prompt from position 0.
fn cold(
    exec: &mut dyn Executor,
    prompt: &[u32],
    table: &[BlockId],
) -> Result<(Vec<u32>, Vec<f32>), EngineError> {
    let first = exec
        .forward(&[engine::SeqChunk {
            tokens: prompt,
            start_pos: 0,
            block_table: table,
            want_logits: true,
            all_logits: false,
        }])?
        .into_iter()
        .next()
        .flatten()
        .ok_or_else(|| EngineError::Tensor("no logits".into()))?;
    Ok((greedy_paged(exec, prompt, table, 0, N_NEW)?, first))
}

/// Every golden run of one executor: cold, cached (32 tokens = 2 blocks of the chat prompt),
/// chunked (7 tokens per step) and batched (three prompts, chunks 7/13/64, decodes together).
struct Runs {
    cold: Vec<(Vec<u32>, Vec<f32>)>,
    /// Cold again, the argmax taken by the executor (`forward_sampled`).
    sampled: Vec<Vec<u32>>,
    cached: Vec<Vec<u32>>,
    /// Prompt 0 reusing 3 tokens of a copied block (`Executor::copy_block`).
    copied: Vec<Vec<u32>>,
    chunked: Vec<Vec<u32>>,
    batched: Vec<Vec<u32>>,
}

fn golden_runs(exec: &mut dyn Executor) -> Result<Runs, EngineError> {
    let ps = prompts();
    let blocks_each = (ps.iter().map(Vec::len).max().unwrap_or(0) + N_NEW).div_ceil(BLOCK);
    let table = |i: usize| -> Vec<BlockId> {
        (0..blocks_each)
            .map(|b| (i * blocks_each + b) as BlockId)
            .collect()
    };
    let mut cold_runs = Vec::new();
    for (i, p) in ps.iter().enumerate() {
        cold_runs.push(cold(exec, p, &table(i))?);
    }
    let mut sampled = Vec::new();
    for (i, p) in ps.iter().enumerate() {
        sampled.push(greedy_sampled(exec, p, &table(12 + i), 0, N_NEW)?);
    }
    // Cached: prompt 0's first two blocks (positions 0..32) now hold the chat prefix.
    let mut cached = Vec::new();
    for (i, p) in ps.iter().enumerate().take(2) {
        let mut t = table(0)[..2].to_vec();
        t.extend(table(3 + i)[..blocks_each - 2].iter());
        cached.push(greedy_paged(exec, p, &t, 32, N_NEW)?);
    }
    // Copied: prompt 0's block 2 (positions 32..48 of its cold run) copied into a free block,
    // then positions 35.. recomputed over the copy — the scheduler's reuse of a cached block's
    // first tokens.
    let copied = {
        let dst = table(5)[0];
        exec.copy_block(table(0)[2], dst)?;
        let mut t = table(0)[..2].to_vec();
        t.push(dst);
        t.extend(table(5)[1..blocks_each - 2].iter());
        vec![greedy_paged(exec, &ps[0], &t, 35, N_NEW)?]
    };
    let mut chunked = Vec::new();
    for (i, p) in ps.iter().enumerate() {
        let mut seqs = vec![Seq {
            tokens: p.clone(),
            prompt_len: p.len(),
            done: 0,
            table: table(6 + i),
            chunk: 7,
            join_at: 0,
            first_logits: None,
        }];
        chunked.push(run_batched(exec, &mut seqs, N_NEW)?.remove(0));
    }
    let mut seqs: Vec<Seq> = ps
        .iter()
        .enumerate()
        .map(|(i, p)| Seq {
            tokens: p.clone(),
            prompt_len: p.len(),
            done: 0,
            table: table(9 + i),
            chunk: [7, 13, 64][i],
            join_at: [0, 1, 3][i],
            first_logits: None,
        })
        .collect();
    let batched = run_batched(exec, &mut seqs, N_NEW)?;
    Ok(Runs {
        cold: cold_runs,
        sampled,
        cached,
        copied,
        chunked,
        batched,
    })
}

fn geometry() -> KvGeometry {
    KvGeometry {
        block_size: BLOCK,
        num_blocks: 16 * 5,
    }
}

/// Compares a variant's runs with the CPU reference's cold runs and with its own cold runs.
fn compare(runs: &Runs, reference: &Runs) -> Value {
    let mut per_prompt = Vec::new();
    for (i, (toks, logits)) in runs.cold.iter().enumerate() {
        let (want, want_logits) = &reference.cold[i];
        let mode = |v: &Vec<Vec<u32>>| -> Value {
            match v.get(i) {
                Some(got) => json!({
                    "equals_cpu": got == want,
                    "equals_own_cold": got == toks,
                    "first_divergence_from_cpu": divergence(got, want),
                }),
                None => Value::Null,
            }
        };
        per_prompt.push(json!({
            "cold_equals_cpu": toks == want,
            "cold_first_divergence_from_cpu": divergence(toks, want),
            "first_logits_max_abs_diff_vs_cpu": max_abs_diff(logits, want_logits),
            "argmax_by_executor": mode(&runs.sampled),
            "cached": mode(&runs.cached),
            "copied_block": mode(&runs.copied),
            "chunked": mode(&runs.chunked),
            "batched": mode(&runs.batched),
        }));
    }
    let all = |f: &dyn Fn(usize, &Vec<u32>) -> bool, v: &Vec<Vec<u32>>| {
        v.iter().enumerate().all(|(i, t)| f(i, t))
    };
    let equals_cpu = |i: usize, t: &Vec<u32>| *t == reference.cold[i].0;
    let equals_own = |i: usize, t: &Vec<u32>| *t == runs.cold[i].0;
    let cold: Vec<Vec<u32>> = runs.cold.iter().map(|c| c.0.clone()).collect();
    json!({
        "all_equal_cpu": all(&equals_cpu, &cold) && all(&equals_cpu, &runs.cached)
            && all(&equals_cpu, &runs.copied)
            && all(&equals_cpu, &runs.chunked) && all(&equals_cpu, &runs.batched),
        "cached_chunked_batched_equal_own_cold": all(&equals_own, &runs.cached)
            && all(&equals_own, &runs.copied)
            && all(&equals_own, &runs.chunked) && all(&equals_own, &runs.batched),
        "argmax_by_executor_equals_own_cold": all(&equals_own, &runs.sampled),
        "prompts": per_prompt,
    })
}

struct Report {
    root: Map<String, Value>,
    out: Option<PathBuf>,
}

impl Report {
    fn set(&mut self, key: &str, v: Value) {
        self.root.insert(key.to_string(), v);
        if let Some(p) = &self.out {
            if let Ok(s) = serde_json::to_string_pretty(&Value::Object(self.root.clone())) {
                let _ = std::fs::write(p, s);
            }
        }
    }
}

fn device_info(dev: &Device) -> Value {
    #[cfg(feature = "cuda")]
    if let Ok(cuda) = dev.as_cuda_device() {
        let stream = cuda.cuda_stream();
        let ctx = stream.context();
        return json!({
            "kind": "cuda",
            "name": ctx.name().unwrap_or_default(),
            "compute_capability": ctx.compute_capability().ok(),
            "memory_free_total_bytes": ctx.mem_get_info().ok(),
        });
    }
    json!({ "kind": if dev.is_cpu() { "cpu" } else { "other" } })
}

fn main() -> ExitCode {
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(2);
        }
    };
    let started = Instant::now();
    let over = |what: &str| {
        let late = started.elapsed().as_secs_f64() > args.deadline_s;
        if late {
            eprintln!("gpu_check: deadline reached, skipping {what}");
        }
        late
    };
    let mut report = Report {
        root: Map::new(),
        out: args.out.clone(),
    };
    let cpu_threads = engine::model::configure_compute_threads(
        std::thread::available_parallelism().map_or(2, |n| n.get().min(8)),
    );
    let dev = if args.cpu {
        Ok(Device::Cpu)
    } else {
        engine::model::device_with(true, EventTracking::Off)
    };
    let (bf16, f32w) = (
        WeightFormat::Device(DType::BF16),
        WeightFormat::Device(DType::F32),
    );
    let (fused, composed) = (AttentionKind::Fused, AttentionKind::Composed);
    let (dev, tracked_dev, variants): (Device, Option<Device>, Vec<Variant>) = match dev {
        Ok(d) if d.is_cuda() => (
            d,
            engine::model::device_with(true, EventTracking::On).ok(),
            vec![
                variant("bf16_composed", bf16, composed, false),
                variant("f32_composed", f32w, composed, false),
                variant("f32_fused", f32w, fused, false),
                variant("bf16_fused", bf16, fused, false),
                variant("q4_1_fused", WeightFormat::AsStored, fused, false),
                variant("bf16_fused_event_tracking", bf16, fused, true),
            ],
        ),
        other => {
            if let Err(e) = other {
                eprintln!(
                    "gpu_check: no CUDA device ({e}); running the device executor on the CPU"
                );
                report.set("cuda_error", json!(e.to_string()));
            }
            (
                Device::Cpu,
                None,
                vec![variant("f32_composed", f32w, composed, false)],
            )
        }
    };
    let device_of = |v: &Variant| -> Result<Device, EngineError> {
        match (v.tracked, &tracked_dev) {
            (false, _) => Ok(dev.clone()),
            (true, Some(d)) => Ok(d.clone()),
            (true, None) => Err(EngineError::Model("no event-tracking device".into())),
        }
    };
    report.set("device", device_info(&dev));
    report.set("cpu_threads", json!(cpu_threads));
    report.set("model", json!(args.model.display().to_string()));

    // 1. The CPU reference.
    let t = Instant::now();
    let reference = LlamaWeights::load(&args.model, &Device::Cpu, WeightFormat::CPU_DEFAULT)
        .map(Arc::new)
        .and_then(|w| LlamaExecutor::new(w, geometry()))
        .and_then(|mut e| golden_runs(&mut e));
    let reference = match reference {
        Ok(r) => r,
        Err(e) => {
            report.set("error", json!(format!("CPU reference: {e}")));
            println!("{}", Value::Object(report.root));
            return ExitCode::FAILURE;
        }
    };
    report.set(
        "cpu_reference",
        json!({
            "seconds": t.elapsed().as_secs_f64(),
            "cold_tokens": reference.cold.iter().map(|c| c.0.clone()).collect::<Vec<_>>(),
            "self": compare(&reference, &reference),
        }),
    );

    // 2 and 4, per device variant (composed first: a fault in a fused kernel would end the
    // CUDA context for everything after it): the golden runs, then the engine benchmark.
    let mut checks = Map::new();
    let mut first_logits: Vec<(&str, Vec<f32>)> = Vec::new();
    let mut ok = true;
    let mut benches = Map::new();
    for v in &variants {
        if over(v.name) {
            break;
        }
        let t = Instant::now();
        let r = device_of(v)
            .and_then(|d| LlamaWeights::load(&args.model, &d, v.format))
            .map(Arc::new)
            .and_then(|w| DeviceExecutor::new(w, geometry(), v.attention))
            .and_then(|mut e| golden_runs(&mut e));
        let entry = match r {
            Ok(runs) => {
                let c = compare(&runs, &reference);
                if v.format == WeightFormat::Device(DType::F32)
                    && c["all_equal_cpu"] != Value::Bool(true)
                {
                    ok = false;
                }
                first_logits.push((v.name, runs.cold[0].1.clone()));
                let mut c = c;
                c["seconds"] = json!(t.elapsed().as_secs_f64());
                c["tokens"] = json!(runs.cold.iter().map(|c| c.0.clone()).collect::<Vec<_>>());
                c
            }
            Err(e) => {
                ok = false;
                json!({ "error": e.to_string() })
            }
        };
        checks.insert(v.name.to_string(), entry);
        report.set("golden", Value::Object(checks.clone()));
        if over(&format!("bench {}", v.name)) {
            break;
        }
        let mut cfg = EngineBenchConfig::new(&args.model, 0);
        cfg.format = v.format;
        cfg.concurrency = vec![1, 8, 64];
        cfg.prefill_tokens = 512;
        if args.quick || dev.is_cpu() {
            cfg.concurrency = vec![1, 8];
            cfg.decode_steps = 8;
            cfg.repeats = 1;
        }
        let r = (|| -> Result<Value, EngineError> {
            let t = Instant::now();
            let w = Arc::new(LlamaWeights::load(&args.model, &device_of(v)?, v.format)?);
            let load_s = t.elapsed().as_secs_f64();
            let mut g = cfg.geometry();
            // Room for the 4,096-token prefill too.
            g.num_blocks = g.num_blocks.max(4096 / BLOCK + 1);
            let mut e = DeviceExecutor::new(Arc::clone(&w), g, v.attention)?;
            let rep = measure(&cfg, &mut e, w.config().arch, 0, v.format, load_s)?;
            // Prefill of 4,096 tokens, best of the repeats.
            let long: Vec<u32> = (0..4096u32).map(|i| 100 + (i * 7919) % 19_900).collect();
            let table: Vec<BlockId> = (0..(4096 / BLOCK) as BlockId).collect();
            let mut best = f64::INFINITY;
            for _ in 0..cfg.repeats.max(1) {
                let t = Instant::now();
                e.forward(&[engine::SeqChunk {
                    tokens: &long,
                    start_pos: 0,
                    block_table: &table,
                    want_logits: true,
                    all_logits: false,
                }])?;
                best = best.min(t.elapsed().as_secs_f64());
            }
            // The host's share of a 64-stream decode step: the same steps with logits for one
            // row instead of 64 (the rest of the step is identical).
            let logits_cost = if dev.is_cuda() && !args.quick {
                let n = 64usize;
                let ctx: Vec<Vec<u32>> = (0..n)
                    .map(|s| {
                        (0..64u32)
                            .map(|i| 100 + (i * 31 + s as u32 * 977) % 19_900)
                            .collect()
                    })
                    .collect();
                let per = (64 + 33usize).div_ceil(BLOCK);
                let tables: Vec<Vec<BlockId>> = (0..n)
                    .map(|s| ((s * per) as BlockId..((s + 1) * per) as BlockId).collect())
                    .collect();
                // mode 0: every row's logits back; 1: one row's; 2: every row's argmax, taken
                // by the executor (what the engine does for greedy requests).
                let mut time_steps = |mode: u8| -> Result<f64, EngineError> {
                    for s in 0..n {
                        e.forward(&[engine::SeqChunk {
                            tokens: &ctx[s],
                            start_pos: 0,
                            block_table: &tables[s],
                            want_logits: true,
                            all_logits: false,
                        }])?;
                    }
                    let argmax = vec![mode == 2; n];
                    let t = Instant::now();
                    for step in 0..32usize {
                        let toks: Vec<[u32; 1]> =
                            (0..n).map(|s| [(s + step) as u32 + 100]).collect();
                        let chunks: Vec<engine::SeqChunk<'_>> = (0..n)
                            .map(|s| engine::SeqChunk {
                                tokens: &toks[s],
                                start_pos: 64 + step,
                                block_table: &tables[s],
                                want_logits: mode != 1 || s == 0,
                                all_logits: false,
                            })
                            .collect();
                        e.forward_sampled(&chunks, &argmax)?;
                    }
                    Ok(t.elapsed().as_secs_f64() * 1e3 / 32.0)
                };
                let (all, one, ids) = (time_steps(0)?, time_steps(1)?, time_steps(2)?);
                let (all2, one2, ids2) = (time_steps(0)?, time_steps(1)?, time_steps(2)?);
                json!({
                    "streams": n,
                    "step_ms_logits_all_rows": all.min(all2),
                    "step_ms_logits_one_row": one.min(one2),
                    "step_ms_argmax_on_device_all_rows": ids.min(ids2),
                })
            } else {
                Value::Null
            };
            drop(e);
            // Decode over long contexts: 64 streams of 1,024 tokens each (attention's share).
            let long_ctx = if dev.is_cuda() && !args.quick {
                let mut lc = cfg.clone();
                lc.decode_context = 1024;
                lc.decode_steps = 32;
                lc.concurrency = vec![64];
                lc.prefill_tokens = 16;
                lc.cached_prefix = 16;
                lc.cached_suffix = 16;
                lc.repeats = 1;
                let mut e = DeviceExecutor::new(Arc::clone(&w), lc.geometry(), v.attention)?;
                let r = measure(&lc, &mut e, w.config().arch, 0, v.format, load_s)?;
                json!({ "streams": 64, "context": 1024, "steps": 32, "tok_s": r.aggregate.first().map(|x| x.1) })
            } else {
                Value::Null
            };
            Ok(json!({
                "decode_64_streams_logits_cost": logits_cost,
                "decode_64_streams_context_1024": long_ctx,
                "load_s": rep.load_s,
                "prefill_512_tok_s": rep.prefill_tok_s,
                "prefill_4096_tok_s": 4096.0 / best,
                "decode_1_stream_tok_s": rep.decode_tok_s,
                "decode_aggregate_tok_s": rep.aggregate.iter().map(|(n, r)| json!({"streams": n, "tok_s": r})).collect::<Vec<_>>(),
                "decode_context": cfg.decode_context,
                "decode_steps": cfg.decode_steps,
                "ttft_uncached_ms": rep.ttft_uncached_ms,
                "ttft_cached_ms": rep.ttft_cached_ms,
                "ttft_shape": rep.ttft_shape,
                "repeats": cfg.repeats,
            }))
        })();
        benches.insert(
            v.name.into(),
            r.unwrap_or_else(|e| json!({ "error": e.to_string() })),
        );
        report.set("bench", Value::Object(benches.clone()));
    }
    // Fused against composed, same weights: the kernels against their reference.
    let mut pairs = Map::new();
    for (a, b) in [
        ("bf16_fused", "bf16_composed"),
        ("f32_fused", "f32_composed"),
    ] {
        let la = first_logits.iter().find(|x| x.0 == a);
        let lb = first_logits.iter().find(|x| x.0 == b);
        if let (Some(la), Some(lb)) = (la, lb) {
            pairs.insert(format!("{a}_vs_{b}"), json!(max_abs_diff(&la.1, &lb.1)));
        }
    }
    report.set(
        "fused_vs_composed_first_logits_max_abs_diff",
        Value::Object(pairs),
    );

    // 3. Every architecture on a generated model (F32), device against the CPU executor.
    if !over("architectures") {
        let mut archs = Map::new();
        let dir = std::env::temp_dir().join(format!("kvgate-gpu-check-{}", std::process::id()));
        let _ = std::fs::create_dir_all(&dir);
        let attentions: &[AttentionKind] = if dev.is_cuda() {
            &[AttentionKind::Composed, AttentionKind::Fused]
        } else {
            &[AttentionKind::Composed]
        };
        for arch in ["llama", "llama3", "qwen2", "qwen3", "phi3", "gemma3"] {
            let path = dir.join(format!("{arch}.gguf"));
            let r = (|| -> Result<Value, String> {
                engine::model::tiny::write_tiny_gguf(arch, &args.model, &path)
                    .map_err(|e| e.to_string())?;
                let cpu = Arc::new(
                    LlamaWeights::load(&path, &Device::Cpu, WeightFormat::F32)
                        .map_err(|e| e.to_string())?,
                );
                let mut reference =
                    LlamaExecutor::new(cpu, geometry()).map_err(|e| e.to_string())?;
                let want = golden_runs(&mut reference).map_err(|e| e.to_string())?;
                let w = Arc::new(
                    LlamaWeights::load(&path, &dev, WeightFormat::Device(DType::F32))
                        .map_err(|e| e.to_string())?,
                );
                let mut out = Map::new();
                for &a in attentions {
                    let mut e = DeviceExecutor::new(Arc::clone(&w), geometry(), a)
                        .map_err(|e| e.to_string())?;
                    let runs = golden_runs(&mut e).map_err(|e| e.to_string())?;
                    let c = compare(&runs, &want);
                    let worst = runs
                        .cold
                        .iter()
                        .zip(&want.cold)
                        .map(|(a, b)| max_abs_diff(&a.1, &b.1))
                        .fold(0.0f32, f32::max);
                    out.insert(
                        a.name().into(),
                        json!({ "all_equal_cpu": c["all_equal_cpu"], "first_logits_max_abs_diff": worst }),
                    );
                }
                Ok(Value::Object(out))
            })();
            let v = r.unwrap_or_else(|e| json!({ "error": e }));
            if v.get("error").is_some() {
                ok = false;
            }
            archs.insert(arch.into(), v);
        }
        let _ = std::fs::remove_dir_all(&dir);
        report.set("architectures", Value::Object(archs));
    }

    report.set("seconds", json!(started.elapsed().as_secs_f64()));
    report.set("ok", json!(ok));
    println!(
        "{}",
        serde_json::to_string_pretty(&Value::Object(report.root)).unwrap_or_default()
    );
    if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
