//! The engine benchmark: drives an executor directly (no scheduler; greedy decode through
//! [`Executor::forward_sampled`], as the engine does for greedy requests) and measures
//! single-stream prefill and decode, aggregate batched decode at several concurrencies, and
//! the prefill of a prompt whose prefix is already in the KV cache versus fully uncached, and
//! the cost of scoring a prompt (every position's log probabilities, a completion's `echo` with
//! `logprobs`) against computing it in the same chunks.
//!
//! Prompts are deterministic pseudo-random token ids (ids 100..20000): the cost of a forward
//! does not depend on which tokens it sees. Each figure is the best of `repeats` runs.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use super::executor::LlamaExecutor;
use super::reference::argmax;
use super::weights::{LlamaWeights, WeightFormat};
use crate::executor::{BlockId, Executor, KvGeometry, Sampled, SeqChunk};
use crate::EngineError;

/// What to measure.
#[derive(Clone, Debug)]
pub struct EngineBenchConfig {
    /// The GGUF model.
    pub model_path: PathBuf,
    /// Compute threads (see [`super::configure_compute_threads`]; 0 = candle's default).
    pub threads: usize,
    /// Weight format (default [`WeightFormat::CPU_DEFAULT`]).
    pub format: WeightFormat,
    /// Prompt length of the single-stream prefill figure.
    pub prefill_tokens: usize,
    /// Prompt length before the decode figures.
    pub decode_context: usize,
    /// Decode steps timed per figure.
    pub decode_steps: usize,
    /// Concurrent streams of the aggregate decode figures.
    pub concurrency: Vec<usize>,
    /// Cached prefix and new suffix of the TTFT figure.
    pub cached_prefix: usize,
    /// New tokens after the cached prefix.
    pub cached_suffix: usize,
    /// Runs per figure; the best is reported.
    pub repeats: usize,
    /// KV block size.
    pub block_size: usize,
}

impl EngineBenchConfig {
    /// The benchmark: 512-token prefill, 64-token context then 64 decode steps,
    /// 1/4/8/16 streams, 1,024 cached + 16 new tokens, best of 3, block size 16.
    pub fn new(model_path: impl Into<PathBuf>, threads: usize) -> Self {
        EngineBenchConfig {
            model_path: model_path.into(),
            threads,
            format: WeightFormat::CPU_DEFAULT,
            prefill_tokens: 512,
            decode_context: 64,
            decode_steps: 64,
            concurrency: vec![1, 4, 8, 16],
            cached_prefix: 1024,
            cached_suffix: 16,
            repeats: 3,
            block_size: 16,
        }
    }
}

/// Measured figures.
#[derive(Clone, Debug)]
pub struct EngineBenchReport {
    /// The model's architecture (`general.architecture`, resolved).
    pub architecture: super::weights::Architecture,
    /// Compute threads candle used.
    pub threads: usize,
    /// Weight format.
    pub format: WeightFormat,
    /// Seconds to load and convert the weights.
    pub load_s: f64,
    /// Prompt length of `prefill_tok_s`.
    pub prefill_tokens: usize,
    /// Single-stream prefill throughput (one forward over the whole prompt).
    pub prefill_tok_s: f64,
    /// Single-stream decode throughput.
    pub decode_tok_s: f64,
    /// `(streams, aggregate decode tok/s)`.
    pub aggregate: Vec<(usize, f64)>,
    /// `(cached_prefix, cached_suffix)`.
    pub ttft_shape: (usize, usize),
    /// Milliseconds to prefill the whole prompt uncached.
    pub ttft_uncached_ms: f64,
    /// Milliseconds to prefill only the suffix with the prefix in the KV cache.
    pub ttft_cached_ms: f64,
    /// Tokens per chunk of `chunked_ms` and `scored_ms`.
    pub scoring_chunk: usize,
    /// Milliseconds to prefill the `prefill_tokens` prompt in chunks of
    /// [`crate::scheduler::prompt_logits_chunk`] tokens (the engine's for this vocabulary), the
    /// last chunk's last logits only.
    pub chunked_ms: f64,
    /// The same chunks scored, as the engine scores a prompt: every row's logits
    /// (`SeqChunk::all_logits`) and each next token's log probability with 5 alternatives
    /// (`TokenLogprobs::of`).
    pub scored_ms: f64,
    /// Of `scored_ms`, the log probabilities (`TokenLogprobs::of` over every row).
    pub logprobs_ms: f64,
}

impl std::fmt::Display for EngineBenchReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "architecture {:?}, threads {}, weights {:?}, CPU kernels {}, load {:.2} s",
            self.architecture,
            self.threads,
            self.format,
            super::cpu_kernels(),
            self.load_s
        )?;
        writeln!(f, "| measure | value |")?;
        writeln!(f, "|---|---|")?;
        writeln!(
            f,
            "| prefill, {} tokens, 1 stream | {:.1} tok/s |",
            self.prefill_tokens, self.prefill_tok_s
        )?;
        writeln!(f, "| decode, 1 stream | {:.1} tok/s |", self.decode_tok_s)?;
        for (n, r) in &self.aggregate {
            writeln!(f, "| decode, {n} streams (aggregate) | {r:.1} tok/s |")?;
        }
        let (p, s) = self.ttft_shape;
        writeln!(
            f,
            "| prefill {} tokens uncached | {:.1} ms |",
            p + s,
            self.ttft_uncached_ms
        )?;
        writeln!(
            f,
            "| prefill {s} tokens after {p} cached | {:.1} ms ({:.1}% of uncached) |",
            self.ttft_cached_ms,
            100.0 * self.ttft_cached_ms / self.ttft_uncached_ms.max(f64::MIN_POSITIVE)
        )?;
        let chunk = self.scoring_chunk;
        writeln!(
            f,
            "| prefill {} tokens in chunks of {chunk} | {:.1} ms |",
            self.prefill_tokens, self.chunked_ms
        )?;
        writeln!(
            f,
            "| the same, scored (every row's logits, log probabilities, top 5) | {:.1} ms ({:.2}× the chunks) |",
            self.scored_ms,
            self.scored_ms / self.chunked_ms.max(f64::MIN_POSITIVE)
        )?;
        writeln!(
            f,
            "| of which the log probabilities | {:.1} ms |",
            self.logprobs_ms
        )
    }
}

/// Deterministic token ids for prompt `seed`.
fn prompt(seed: u64, len: usize) -> Vec<u32> {
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            100 + (s % 19_900) as u32
        })
        .collect()
}

/// Hands out disjoint block tables.
struct Tables {
    next: usize,
    block_size: usize,
    num_blocks: usize,
}

impl Tables {
    fn take(&mut self, tokens: usize) -> Result<Vec<BlockId>, EngineError> {
        let n = tokens.div_ceil(self.block_size);
        if self.next + n > self.num_blocks {
            return Err(EngineError::NeverFits {
                needed: self.next + n,
                total: self.num_blocks,
            });
        }
        let t = (self.next..self.next + n).map(|b| b as BlockId).collect();
        self.next += n;
        Ok(t)
    }
}

/// Runs the benchmark with the defaults of [`EngineBenchConfig::new`].
pub fn run_engine_bench(
    model_path: impl AsRef<Path>,
    threads: usize,
) -> Result<EngineBenchReport, EngineError> {
    run(&EngineBenchConfig::new(model_path.as_ref(), threads))
}

/// Runs the benchmark described by `cfg` on the CPU executor.
pub fn run(cfg: &EngineBenchConfig) -> Result<EngineBenchReport, EngineError> {
    let threads = super::configure_compute_threads(cfg.threads);
    let t0 = Instant::now();
    let weights = Arc::new(LlamaWeights::load(
        &cfg.model_path,
        &candle_core::Device::Cpu,
        cfg.format,
    )?);
    let load_s = t0.elapsed().as_secs_f64();
    let mut exec = LlamaExecutor::new(Arc::clone(&weights), cfg.geometry())?;
    measure(
        cfg,
        &mut exec,
        weights.config().arch,
        threads,
        cfg.format,
        load_s,
    )
}

impl EngineBenchConfig {
    /// The KV geometry the benchmark needs: every figure's sequences side by side, plus one
    /// block.
    pub fn geometry(&self) -> KvGeometry {
        let bs = self.block_size.max(1);
        let max_streams = self.concurrency.iter().copied().max().unwrap_or(1).max(1);
        let per_stream = self.decode_context + self.decode_steps + 1;
        let need = (self.prefill_tokens.div_ceil(bs))
            .max(max_streams * per_stream.div_ceil(bs))
            .max((self.cached_prefix + self.cached_suffix).div_ceil(bs))
            + 1;
        KvGeometry {
            block_size: bs,
            num_blocks: need,
        }
    }
}

/// Measures `cfg`'s figures on any executor whose KV storage is at least
/// [`EngineBenchConfig::geometry`] (the CPU executor, or the device executor on a GPU:
/// `engine/examples/gpu_check.rs`). Every timed step returns logits, so a device's queue is
/// drained inside each timing.
pub fn measure(
    cfg: &EngineBenchConfig,
    exec: &mut dyn Executor,
    architecture: super::weights::Architecture,
    threads: usize,
    format: WeightFormat,
    load_s: f64,
) -> Result<EngineBenchReport, EngineError> {
    let geometry = exec.geometry();
    let bs = geometry.block_size;
    let need = geometry.num_blocks;
    if bs != cfg.block_size.max(1) || need < cfg.geometry().num_blocks {
        return Err(EngineError::InvalidRequest(format!(
            "the executor's KV storage {geometry:?} is smaller than the benchmark's {:?}",
            cfg.geometry()
        )));
    }
    let repeats = cfg.repeats.max(1);
    let fresh = || Tables {
        next: 0,
        block_size: bs,
        num_blocks: need,
    };

    // Single-stream prefill.
    let p = prompt(1, cfg.prefill_tokens);
    let mut best = f64::INFINITY;
    for _ in 0..repeats {
        let table = fresh().take(p.len())?;
        let t = Instant::now();
        exec.forward(&[SeqChunk {
            tokens: &p,
            start_pos: 0,
            block_table: &table,
            want_logits: true,
            all_logits: false,
        }])?;
        best = best.min(t.elapsed().as_secs_f64());
    }
    let prefill_tok_s = p.len() as f64 / best;

    // Decode at each concurrency (1 stream is the single-stream figure).
    let mut aggregate = Vec::new();
    let mut levels = cfg.concurrency.clone();
    if !levels.contains(&1) {
        levels.insert(0, 1);
    }
    let greedy = vec![true; levels.iter().copied().max().unwrap_or(1)];
    for &n in &levels {
        let mut best = f64::INFINITY;
        for _ in 0..repeats {
            let mut tables = fresh();
            let mut seqs = Vec::with_capacity(n);
            for s in 0..n {
                let toks = prompt(100 + s as u64, cfg.decode_context.max(1));
                let table = tables.take(toks.len() + cfg.decode_steps + 1)?;
                let logits = exec.forward(&[SeqChunk {
                    tokens: &toks,
                    start_pos: 0,
                    block_table: &table,
                    want_logits: true,
                    all_logits: false,
                }])?;
                let next = logits
                    .first()
                    .and_then(|l| l.as_ref())
                    .map(|l| argmax(l))
                    .unwrap_or(0);
                seqs.push((table, toks.len(), next));
            }
            let t = Instant::now();
            for _ in 0..cfg.decode_steps {
                let toks: Vec<[u32; 1]> = seqs.iter().map(|s| [s.2]).collect();
                let chunks: Vec<SeqChunk<'_>> = seqs
                    .iter()
                    .zip(&toks)
                    .map(|(s, tk)| SeqChunk {
                        tokens: tk,
                        start_pos: s.1,
                        block_table: &s.0,
                        want_logits: true,
                        all_logits: false,
                    })
                    .collect();
                // Greedy: the executor may take the argmax where the logits are.
                let out = exec.forward_sampled(&chunks, &greedy[..chunks.len()])?;
                for (s, next) in seqs.iter_mut().zip(out) {
                    s.1 += 1;
                    s.2 = match next {
                        Some(Sampled::Token(t)) => t,
                        Some(Sampled::Logits(l)) => argmax(&l),
                        None => 0,
                    };
                }
            }
            best = best.min(t.elapsed().as_secs_f64());
        }
        aggregate.push((n, (n * cfg.decode_steps) as f64 / best));
    }
    let decode_tok_s = aggregate
        .iter()
        .find(|(n, _)| *n == 1)
        .map(|(_, r)| *r)
        .unwrap_or(0.0);
    aggregate.retain(|(n, _)| cfg.concurrency.contains(n));

    // Prefix in cache vs uncached.
    let full = prompt(7, cfg.cached_prefix + cfg.cached_suffix);
    let (mut best_uncached, mut best_cached) = (f64::INFINITY, f64::INFINITY);
    for _ in 0..repeats {
        let table = fresh().take(full.len())?;
        let t = Instant::now();
        exec.forward(&[SeqChunk {
            tokens: &full,
            start_pos: 0,
            block_table: &table,
            want_logits: true,
            all_logits: false,
        }])?;
        best_uncached = best_uncached.min(t.elapsed().as_secs_f64());
        // The prefix's K/V are now in `table`'s blocks; recompute only the suffix.
        let t = Instant::now();
        exec.forward(&[SeqChunk {
            tokens: &full[cfg.cached_prefix..],
            start_pos: cfg.cached_prefix,
            block_table: &table,
            want_logits: true,
            all_logits: false,
        }])?;
        best_cached = best_cached.min(t.elapsed().as_secs_f64());
    }

    // Scoring a prompt against computing it in the same chunks.
    let vocab = exec.vocab_size();
    let chunk = crate::scheduler::prompt_logits_chunk(vocab);
    let (mut best_chunked, mut best_scored) = (f64::INFINITY, f64::INFINITY);
    let mut logprobs_ms = 0.0;
    for _ in 0..repeats {
        for scored in [false, true] {
            let table = fresh().take(p.len())?;
            let t = Instant::now();
            let mut kept = 0usize;
            let mut in_logprobs = 0.0;
            for start in (0..p.len()).step_by(chunk) {
                let end = (start + chunk).min(p.len());
                let out = exec.forward(&[SeqChunk {
                    tokens: &p[start..end],
                    start_pos: start,
                    block_table: &table,
                    want_logits: end == p.len(),
                    all_logits: scored,
                }])?;
                if let (true, Some(Some(rows))) = (scored, out.first()) {
                    let lt = Instant::now();
                    for (r, row) in rows.chunks_exact(vocab.max(1)).enumerate() {
                        if let Some(&next) = p.get(start + r + 1) {
                            kept += crate::engine::TokenLogprobs::of(row, next, 5).top.len();
                        }
                    }
                    in_logprobs += lt.elapsed().as_secs_f64();
                }
            }
            let s = t.elapsed().as_secs_f64();
            if scored {
                if kept == 0 {
                    return Err(EngineError::Tensor("scoring kept no alternatives".into()));
                }
                if s < best_scored {
                    best_scored = s;
                    logprobs_ms = in_logprobs * 1e3;
                }
            } else {
                best_chunked = best_chunked.min(s);
            }
        }
    }

    Ok(EngineBenchReport {
        scoring_chunk: chunk,
        chunked_ms: best_chunked * 1e3,
        scored_ms: best_scored * 1e3,
        logprobs_ms,
        architecture,
        threads,
        format,
        load_s,
        prefill_tokens: p.len(),
        prefill_tok_s,
        decode_tok_s,
        aggregate,
        ttft_shape: (cfg.cached_prefix, cfg.cached_suffix),
        ttft_uncached_ms: best_uncached * 1e3,
        ttft_cached_ms: best_cached * 1e3,
    })
}
