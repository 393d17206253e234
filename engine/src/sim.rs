//! The simulated executor: the engine's scheduler, KV cache, prefix cache and events run
//! unchanged, with the model replaced by a timing model and deterministic tokens — so a
//! gateway can be tested and benchmarked against 64 workers on a 2-core machine.
//!
//! **Storage.** The simulator keeps a real paged "KV": per slot of every block, the token id
//! and a running hash of the sequence up to that position. `forward` writes each chunk's
//! tokens through its block table, exactly where a model would write K/V: the hash at
//! position `p` is `mix(hash at p − 1, token p)`, the previous hash being *read back through
//! the block table* (from a cached prefix block, an earlier chunk, or this one) — as
//! attention reads earlier K/V.
//!
//! **Tokens.** For a chunk that wants logits, the next token is a function of the running
//! hash at its last position p (so of the *whole* sequence as stored in the blocks) and p.
//! So greedy output is repeatable, and any mistake in block tables, prefix reuse or chunking
//! changes the output (tests use this as a model-free correctness oracle); reading a
//! position that was never written is an error. The token is never `eos_token_id` unless
//! `eos_after` says so: with `eos_after = Some(n)`, the token produced at position ≥ n (i.e.
//! once the sequence, prompt included, holds n tokens) is `eos_token_id`; `None` = never.
//! Logits are `0.0` everywhere except the chosen token (8.0) and two runner-ups (6.0, 4.0),
//! so temperature sampling has something to choose from.
//!
//! **Time.** `forward` sleeps (real time, on the engine's own thread) for
//! `decode_us_base + decode_us_per_seq × (one-token chunks) + prefill_us_per_token × (tokens
//! in longer chunks)` µs when the batch is not empty. [`SimConfig::default`] uses figures
//! near the SmolLM2 targets of this machine kind (docs/benchmarks.md): 800 prefill tok/s,
//! ~150 decode tok/s single stream.
//!
//! Cost of the simulation itself: O(1) per token written, O(vocab) per logits vector (use a
//! small vocabulary, e.g. 512); memory 16 bytes per KV slot.

use prompt_profile::TokenDecoder;

use crate::executor::{BlockId, Executor, KvGeometry, SeqChunk};
use crate::EngineError;

/// Parameters of a [`SimExecutor`].
#[derive(Clone, Debug, PartialEq)]
pub struct SimConfig {
    /// Tokens per block (1..=1024).
    pub block_size: usize,
    /// Blocks in the pool.
    pub num_blocks: usize,
    /// Logits length (≥ 4).
    pub vocab_size: usize,
    /// Cost per token of a prefill chunk (chunks of ≥ 2 tokens), µs.
    pub prefill_us_per_token: u64,
    /// Fixed cost of a non-empty step, µs.
    pub decode_us_base: u64,
    /// Cost per one-token (decode) chunk, µs.
    pub decode_us_per_seq: u64,
    /// Emit `eos_token_id` at positions ≥ this (None = never).
    pub eos_after: Option<usize>,
    /// The eos id (< vocab_size).
    pub eos_token_id: u32,
    /// Fault injection: the n-th forward step (from 1) panics, as a broken model would
    /// (None = never). For tests of what a dead engine does to its worker and the gateway.
    pub panic_at_step: Option<u64>,
}

impl Default for SimConfig {
    fn default() -> Self {
        SimConfig {
            block_size: 16,
            num_blocks: 4096,
            vocab_size: 512,
            prefill_us_per_token: 1_250,
            decode_us_base: 6_000,
            decode_us_per_seq: 700,
            eos_after: None,
            eos_token_id: 2,
            panic_at_step: None,
        }
    }
}

impl SimConfig {
    /// A configuration that never sleeps (tests).
    pub fn instant(block_size: usize, num_blocks: usize) -> Self {
        SimConfig {
            block_size,
            num_blocks,
            prefill_us_per_token: 0,
            decode_us_base: 0,
            decode_us_per_seq: 0,
            ..SimConfig::default()
        }
    }
}

/// The simulated executor.
#[derive(Debug)]
pub struct SimExecutor {
    cfg: SimConfig,
    /// Per KV slot: (token id, running hash); token `u32::MAX` = never written.
    slots: Vec<(u32, u64)>,
    /// Forward steps run.
    steps: u64,
}

const EMPTY: u32 = u32::MAX;
const HASH_SEED: u64 = 0xcbf2_9ce4_8422_2325;

fn mix(prev: u64, token: u32) -> u64 {
    let mut h = (prev ^ u64::from(token)).wrapping_mul(0x0000_0100_0000_01b3);
    h ^= h >> 31;
    h
}

impl SimExecutor {
    /// Allocates the slot storage (4 bytes per slot). Errors on a zero or oversized
    /// geometry.
    pub fn new(cfg: SimConfig) -> Result<Self, EngineError> {
        if cfg.block_size == 0 || cfg.block_size > 1024 {
            return Err(EngineError::InvalidRequest(format!(
                "sim block_size {} outside 1..=1024",
                cfg.block_size
            )));
        }
        if cfg.vocab_size < 4 || cfg.eos_token_id as usize >= cfg.vocab_size {
            return Err(EngineError::InvalidRequest(format!(
                "sim vocab_size {} must be >= 4 and hold eos {}",
                cfg.vocab_size, cfg.eos_token_id
            )));
        }
        let n = cfg
            .block_size
            .checked_mul(cfg.num_blocks)
            .filter(|&n| n <= 1 << 32)
            .ok_or_else(|| EngineError::InvalidRequest("sim KV too large".into()))?;
        Ok(SimExecutor {
            slots: vec![(EMPTY, 0); n],
            cfg,
            steps: 0,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &SimConfig {
        &self.cfg
    }

    fn slot(&self, table: &[BlockId], pos: usize) -> Result<usize, EngineError> {
        let b = self.cfg.block_size;
        let blk = *table
            .get(pos / b)
            .ok_or_else(|| EngineError::Tensor(format!("position {pos} beyond the block table")))?
            as usize;
        if blk >= self.cfg.num_blocks {
            return Err(EngineError::Tensor(format!("block {blk} out of range")));
        }
        Ok(blk * b + pos % b)
    }

    /// The running hash stored at `pos`, read through `table`.
    fn hash_at(&self, table: &[BlockId], pos: usize) -> Result<u64, EngineError> {
        let (t, h) = self.slots[self.slot(table, pos)?];
        if t == EMPTY {
            return Err(EngineError::Tensor(format!(
                "position {pos} read before it was written"
            )));
        }
        Ok(h)
    }

    /// The greedy token after the sequence stored through `table` up to position `last`.
    fn next_token(&self, table: &[BlockId], last: usize) -> Result<(u32, u64), EngineError> {
        let mut h = self.hash_at(table, last)?;
        h = (h ^ last as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        h ^= h >> 29;
        let v = self.cfg.vocab_size as u64;
        let eos = self.cfg.eos_token_id;
        let tok = match self.cfg.eos_after {
            Some(n) if last + 1 >= n => eos,
            _ => {
                let t = (h % v) as u32;
                if t == eos {
                    (t + 1) % v as u32
                } else {
                    t
                }
            }
        };
        Ok((tok, h))
    }
}

impl Executor for SimExecutor {
    fn geometry(&self) -> KvGeometry {
        KvGeometry {
            block_size: self.cfg.block_size,
            num_blocks: self.cfg.num_blocks,
        }
    }

    fn copies_blocks(&self) -> bool {
        true
    }

    fn copy_block(&mut self, src: BlockId, dst: BlockId) -> Result<(), EngineError> {
        let b = self.cfg.block_size;
        let (src, dst) = self.geometry().block_copy(src, dst)?;
        self.slots.copy_within(src * b..(src + 1) * b, dst * b);
        Ok(())
    }

    fn vocab_size(&self) -> usize {
        self.cfg.vocab_size
    }

    fn forward(&mut self, chunks: &[SeqChunk<'_>]) -> Result<Vec<Option<Vec<f32>>>, EngineError> {
        if chunks.is_empty() {
            return Ok(Vec::new());
        }
        self.steps += 1;
        if self.cfg.panic_at_step == Some(self.steps) {
            panic!("injected fault at step {}", self.steps);
        }
        let mut us = self.cfg.decode_us_base;
        for c in chunks {
            if c.tokens.len() == 1 {
                us += self.cfg.decode_us_per_seq;
            } else {
                us += self.cfg.prefill_us_per_token * c.tokens.len() as u64;
            }
        }
        let start = std::time::Instant::now();
        let mut out = Vec::with_capacity(chunks.len());
        for c in chunks {
            for (i, &t) in c.tokens.iter().enumerate() {
                let pos = c.start_pos + i;
                let prev = if pos == 0 {
                    HASH_SEED
                } else {
                    self.hash_at(c.block_table, pos - 1)?
                };
                let s = self.slot(c.block_table, pos)?;
                self.slots[s] = (t, mix(prev, t));
            }
        }
        for c in chunks {
            if c.tokens.is_empty() || !(c.want_logits || c.all_logits) {
                out.push(None);
                continue;
            }
            let end = c.start_pos + c.tokens.len();
            let first = if c.all_logits { c.start_pos } else { end - 1 };
            let v = self.cfg.vocab_size;
            let mut logits = vec![0.0f32; v * (end - first)];
            for (pos, row) in (first..end).zip(logits.chunks_exact_mut(v)) {
                let (tok, h) = self.next_token(c.block_table, pos)?;
                let r1 = ((h >> 20) % v as u64) as usize;
                let r2 = ((h >> 40) % v as u64) as usize;
                row[r2] = 4.0;
                row[r1] = 6.0;
                row[tok as usize] = 8.0;
            }
            out.push(Some(logits));
        }
        let want = std::time::Duration::from_micros(us);
        let spent = start.elapsed();
        if want > spent {
            std::thread::sleep(want - spent);
        }
        Ok(out)
    }
}

/// A [`TokenDecoder`] for simulated tokens: id `n` reads as `"t{n} "`; the eos id of the
/// default config (2) reads as nothing. Pure ASCII, so every prefix is valid UTF-8.
#[derive(Clone, Copy, Debug, Default)]
pub struct SimDecoder;

impl TokenDecoder for SimDecoder {
    fn decode(&self, ids: &[u32], _skip_special: bool) -> prompt_profile::Result<String> {
        let mut s = String::with_capacity(ids.len() * 5);
        for &id in ids {
            if id == 2 {
                continue;
            }
            s.push('t');
            s.push_str(&id.to_string());
            s.push(' ');
        }
        Ok(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn exec(bs: usize, n: usize) -> SimExecutor {
        SimExecutor::new(SimConfig::instant(bs, n)).unwrap()
    }

    fn argmax(l: &[f32]) -> u32 {
        crate::sampler::argmax(l)
    }

    #[test]
    fn same_tokens_same_output_regardless_of_blocks_and_chunking() {
        let prompt: Vec<u32> = (0..23).map(|i| (i * 7 + 3) % 500).collect();
        // One chunk in blocks 0..3.
        let mut a = exec(4, 32);
        let t1: Vec<u32> = (0..6).collect();
        let la = a
            .forward(&[SeqChunk {
                tokens: &prompt,
                start_pos: 0,
                block_table: &t1,
                want_logits: true,
                all_logits: false,
            }])
            .unwrap();
        // Three odd chunks in scattered blocks.
        let mut b = exec(4, 32);
        let t2: Vec<u32> = vec![31, 5, 17, 2, 9, 11];
        for (s, e) in [(0, 5), (5, 18)] {
            b.forward(&[SeqChunk {
                tokens: &prompt[s..e],
                start_pos: s,
                block_table: &t2,
                want_logits: false,
                all_logits: false,
            }])
            .unwrap();
        }
        let lb = b
            .forward(&[SeqChunk {
                tokens: &prompt[18..],
                start_pos: 18,
                block_table: &t2,
                want_logits: true,
                all_logits: false,
            }])
            .unwrap();
        let ta = argmax(la[0].as_ref().unwrap());
        assert_eq!(ta, argmax(lb[0].as_ref().unwrap()));
        // A different token anywhere in the prefix changes the output (with overwhelming
        // probability for this fixed input).
        let mut p2 = prompt.clone();
        p2[1] += 1;
        let mut c = exec(4, 32);
        let lc = c
            .forward(&[SeqChunk {
                tokens: &p2,
                start_pos: 0,
                block_table: &t1,
                want_logits: true,
                all_logits: false,
            }])
            .unwrap();
        assert_ne!(ta, argmax(lc[0].as_ref().unwrap()));
    }

    #[test]
    fn reading_unwritten_or_unmapped_positions_is_an_error() {
        let mut e = exec(4, 8);
        let r = e.forward(&[SeqChunk {
            tokens: &[1, 2],
            start_pos: 2,
            block_table: &[0],
            want_logits: true,
            all_logits: false,
        }]);
        assert!(r.is_err(), "positions 0..2 never written");
        let r = e.forward(&[SeqChunk {
            tokens: &[1, 2, 3, 4, 5],
            start_pos: 0,
            block_table: &[0],
            want_logits: false,
            all_logits: false,
        }]);
        assert!(r.is_err(), "position 4 has no block");
    }

    #[test]
    fn eos_after_and_never_eos() {
        let mut cfg = SimConfig::instant(4, 8);
        // The token produced at position 2 (after a 2-token prompt) is eos.
        cfg.eos_after = Some(2);
        let mut e = SimExecutor::new(cfg).unwrap();
        let l = e
            .forward(&[SeqChunk {
                tokens: &[5, 6],
                start_pos: 0,
                block_table: &[0],
                want_logits: true,
                all_logits: false,
            }])
            .unwrap();
        assert_eq!(argmax(l[0].as_ref().unwrap()), 2);
        let mut e = exec(4, 64);
        let table: Vec<u32> = (0..64).collect();
        let mut toks = vec![7u32];
        for _ in 0..200 {
            let p = toks.len() - 1;
            let l = e
                .forward(&[SeqChunk {
                    tokens: &toks[p..],
                    start_pos: p,
                    block_table: &table,
                    want_logits: true,
                    all_logits: false,
                }])
                .unwrap();
            let t = argmax(l[0].as_ref().unwrap());
            assert_ne!(t, 2);
            toks.push(t);
        }
    }

    #[test]
    fn timing_model_sleeps_for_the_modelled_time() {
        let mut cfg = SimConfig::instant(4, 8);
        cfg.decode_us_base = 2_000;
        cfg.prefill_us_per_token = 1_000;
        let mut e = SimExecutor::new(cfg).unwrap();
        let t = std::time::Instant::now();
        e.forward(&[SeqChunk {
            tokens: &[1, 2, 3, 4],
            start_pos: 0,
            block_table: &[0],
            want_logits: true,
            all_logits: false,
        }])
        .unwrap();
        assert!(t.elapsed() >= std::time::Duration::from_micros(6_000));
    }

    #[test]
    fn sim_decoder_is_ascii() {
        assert_eq!(SimDecoder.decode(&[5, 2, 17], true).unwrap(), "t5 t17 ");
    }

    #[test]
    fn bad_configs_are_rejected() {
        assert!(SimExecutor::new(SimConfig::instant(0, 8)).is_err());
        assert!(SimExecutor::new(SimConfig::instant(2000, 8)).is_err());
        let mut c = SimConfig::instant(4, 8);
        c.eos_token_id = 9999;
        assert!(SimExecutor::new(c).is_err());
    }
}
