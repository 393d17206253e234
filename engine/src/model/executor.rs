//! [`LlamaExecutor`]: the candle Llama forward over a paged KV cache, implementing
//! [`Executor`].
//!
//! The executor owns the KV *storage* — per layer one K and one V buffer of
//! `num_blocks` blocks of `block_size` tokens in [`KvLayout`] (f32; f16 with
//! [`super::WeightFormat::LlamaCpp`], [`LayerKv`]), preallocated — and nothing else: which
//! blocks a sequence uses is the caller's block table. One `forward` packs the tokens of all
//! chunks into one `[total_tokens, hidden]` activation so every matmul runs once per step,
//! writes each token's K/V into its slot, attends through the block tables
//! ([`super::attention`]), and computes the output projection only for the last token of the
//! chunks that want logits.
//!
//! The residual stream, the element-wise ops (RMSNorm, SiLU·up, residual adds; computed as
//! candle computes them), attention and the KV buffers live in host memory: on the CPU the
//! matmuls read host slices directly (no tensor round trips, no per-op thread-pool dispatch,
//! which dominated decode). On a CUDA device every matmul's input and output round-trip
//! through the host (correct, not fast: a device KV cache and kernels are not written).

use std::sync::Arc;

use candle_core::{Device, Tensor};

use super::activation::{gelu_mul, silu_mul, GeluTable, Silu};
use super::attention::{
    paged_attention, rope_cos_sin_scaled, rope_halves, rope_interleaved, AttnShape, ChunkSlots,
    KvLayout, LayerKv,
};
use super::weights::{Architecture, LlamaWeights};
use crate::executor::{BlockId, Executor, KvGeometry, SeqChunk};
use crate::EngineError;

/// The candle Llama model with its paged KV storage.
pub struct LlamaExecutor {
    weights: Arc<LlamaWeights>,
    geometry: KvGeometry,
    /// Per layer, `num_blocks` blocks in [`KvLayout`] (K dimension-major within a block, V
    /// token-major); f16 with [`super::WeightFormat::LlamaCpp`].
    kv: Vec<LayerKv>,
    /// ggml's GELU table, for Gemma 3 with [`super::WeightFormat::LlamaCpp`].
    gelu_table: Option<GeluTable>,
    /// Which SiLU the feed-forward uses (ggml's with [`super::WeightFormat::LlamaCpp`]).
    silu: Silu,
}

impl std::fmt::Debug for LlamaExecutor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LlamaExecutor")
            .field("geometry", &self.geometry)
            .field("config", self.weights.config())
            .finish_non_exhaustive()
    }
}

impl LlamaExecutor {
    /// Preallocates the KV storage for `geometry` (`kv_bytes_per_token · block_size ·
    /// num_blocks` bytes; see [`LlamaWeights::blocks_for_budget`]).
    pub fn new(weights: Arc<LlamaWeights>, geometry: KvGeometry) -> Result<Self, EngineError> {
        if geometry.block_size == 0 || geometry.num_blocks == 0 {
            return Err(EngineError::InvalidRequest(format!(
                "KV geometry needs at least one block of at least one token: {geometry:?}"
            )));
        }
        let cfg = weights.config();
        let per_layer = geometry
            .num_blocks
            .checked_mul(geometry.block_size)
            .and_then(|s| s.checked_mul(cfg.n_kv_head * cfg.head_dim))
            .ok_or_else(|| {
                EngineError::InvalidRequest(format!("KV geometry too large: {geometry:?}"))
            })?;
        let f16 = weights.format().rounds_kv_to_f16();
        let mut kv = Vec::with_capacity(cfg.n_layer);
        for _ in 0..cfg.n_layer {
            kv.push(LayerKv::zeroed(per_layer, f16).map_err(EngineError::Model)?);
        }
        let ggml = weights.format().ggml_activations();
        let gelu_table = (cfg.arch == Architecture::Gemma3 && ggml).then(GeluTable::new);
        let silu = if ggml { Silu::Ggml } else { Silu::Libm };
        Ok(LlamaExecutor {
            weights,
            geometry,
            kv,
            gelu_table,
            silu,
        })
    }

    /// The shared weights.
    pub fn weights(&self) -> &Arc<LlamaWeights> {
        &self.weights
    }

    fn forward_inner(
        &mut self,
        chunks: &[SeqChunk<'_>],
    ) -> Result<Vec<Option<Vec<f32>>>, EngineError> {
        let w = Arc::clone(&self.weights);
        let cfg = w.config();
        let dev = w.device();
        let (hq, hk, d) = (cfg.n_head, cfg.n_kv_head, cfg.head_dim);

        let mut ids = Vec::new();
        let mut layouts = Vec::with_capacity(chunks.len());
        for c in chunks {
            layouts.push(chunk_slots(
                self.geometry,
                self.weights.config().vocab_size,
                c,
                ids.len(),
            )?);
            ids.extend_from_slice(c.tokens);
        }
        let total = ids.len();
        // cos/sin of every token's position, [total, rope_dims].
        let rd = cfg.rope_dims;
        let table = |base: f32| {
            let mut cs = Vec::with_capacity(total * rd);
            let mut buf = Vec::with_capacity(rd);
            for l in &layouts {
                for p in l.start_pos..l.start_pos + l.len {
                    rope_cos_sin_scaled(p, rd, base, w.rope_freqs.as_deref(), &mut buf);
                    cs.extend_from_slice(&buf);
                }
            }
            cs
        };
        let cos_sin = table(cfg.rope_base);
        // Sliding-window layers (gemma3) rotate with their own base.
        let cos_sin_swa = cfg.sliding_window.map(|_| table(cfg.rope_base_swa));
        let dense = w.format().use_dense(total);
        let q_width = hq * d;
        let kv_width = hk * d;
        let qkv_width = q_width + 2 * kv_width;
        let shape = AttnShape {
            n_head: hq,
            n_kv_head: hk,
            head_dim: d,
            q_stride: qkv_width,
            scale: 1.0 / (d as f32).sqrt(),
            window: None,
        };
        let kv_layout = KvLayout {
            n_kv_head: hk,
            head_dim: d,
            block_size: self.geometry.block_size,
        };

        let id_tensor = Tensor::from_vec(ids, total, dev)?;
        let hidden = cfg.hidden;
        let mut x: Vec<f32> = w
            .embedding
            .index_select(&id_tensor, 0)?
            .to_device(&Device::Cpu)?
            .flatten_all()?
            .to_vec1()?;
        if cfg.arch == Architecture::Gemma3 {
            let s = (hidden as f32).sqrt();
            x.iter_mut().for_each(|v| *v *= s);
        }
        let mut h = vec![0f32; total * hidden];
        let mut attn_out = vec![0f32; total * q_width];
        for (li, layer) in w.layers.iter().enumerate() {
            rms_norm(&x, &layer.attn_norm_host, cfg.rms_eps, &mut h);
            let mut qkv = layer.wqkv.forward_host(&h, total, dense, dev)?;
            if qkv.len() != total * qkv_width {
                return Err(EngineError::Tensor(format!(
                    "QKV projection gave {} values, expected {}",
                    qkv.len(),
                    total * qkv_width
                )));
            }
            let kv = &mut self.kv[li];
            let halves = cfg.arch.rope_halves();
            let sliding = cfg.sliding_layers.get(li).copied().unwrap_or(false);
            let (cos_sin, shape) = match (&cos_sin_swa, sliding) {
                (Some(t), true) => (
                    t,
                    AttnShape {
                        window: cfg.sliding_window,
                        ..shape
                    },
                ),
                _ => (&cos_sin, shape),
            };
            for l in &layouts {
                for i in 0..l.len {
                    let t = l.token_offset + i;
                    let row = &mut qkv[t * qkv_width..][..qkv_width];
                    if let Some(b) = &layer.qkv_bias {
                        for (x, bias) in row.iter_mut().zip(b) {
                            *x += bias;
                        }
                    }
                    if let Some((qn, kn)) = &layer.qk_norm {
                        let mut tmp = vec![0f32; d];
                        for (h, head) in row[..q_width + kv_width].chunks_exact_mut(d).enumerate() {
                            let alpha = if h < hq { qn } else { kn };
                            rms_norm(head, alpha, cfg.rms_eps, &mut tmp);
                            head.copy_from_slice(&tmp);
                        }
                    }
                    let cs = &cos_sin[t * rd..][..rd];
                    if halves {
                        rope_halves(&mut row[..q_width + kv_width], hq + hk, d, cs);
                    } else {
                        rope_interleaved(&mut row[..q_width + kv_width], hq + hk, d, cs);
                    }
                    let (k, v) = row[q_width..].split_at(kv_width);
                    kv_layout.write(kv, l.slots[l.start_pos + i], k, v);
                }
            }
            paged_attention(&qkv, kv, &layouts, kv_layout, shape, &mut attn_out);
            let mut o = layer.wo.forward_host(&attn_out, total, dense, dev)?;
            if let Some((post_attn, _)) = &layer.post_norms {
                let mut tmp = vec![0f32; o.len()];
                rms_norm(&o, post_attn, cfg.rms_eps, &mut tmp);
                o = tmp;
            }
            add_into(&mut x, &o)?;
            rms_norm(&x, &layer.ffn_norm_host, cfg.rms_eps, &mut h);
            let gu = layer.w_gate_up.forward_host(&h, total, dense, dev)?;
            let ffn = layer.w_gate_up.out_features() / 2;
            let act = if cfg.arch == Architecture::Gemma3 {
                gelu_mul(&gu, total, ffn, self.gelu_table.as_ref())?
            } else {
                silu_mul(&gu, total, ffn, self.silu)?
            };
            let mut down = layer.w_down.forward_host(&act, total, dense, dev)?;
            if let Some((_, post_ffn)) = &layer.post_norms {
                let mut tmp = vec![0f32; down.len()];
                rms_norm(&down, post_ffn, cfg.rms_eps, &mut tmp);
                down = tmp;
            }
            add_into(&mut x, &down)?;
        }

        let rows: Vec<usize> = chunks
            .iter()
            .zip(&layouts)
            .flat_map(|(c, l)| logit_rows(c, l.token_offset))
            .collect();
        let mut out = vec![None; chunks.len()];
        if rows.is_empty() {
            return Ok(out);
        }
        let n_rows = rows.len();
        let mut last = Vec::with_capacity(n_rows * hidden);
        for &r in &rows {
            last.extend_from_slice(&x[r * hidden..][..hidden]);
        }
        let mut normed = vec![0f32; n_rows * hidden];
        rms_norm(&last, &w.output_norm_host, cfg.rms_eps, &mut normed);
        let mut logits = w.lm_head_host(&normed, n_rows)?;
        if let Some(c) = cfg.final_softcap {
            logits.iter_mut().for_each(|v| *v = c * (*v / c).tanh());
        }
        let vocab = logits.len() / n_rows;
        let mut at = 0;
        for (slot, c) in out.iter_mut().zip(chunks) {
            let n = logit_rows(c, 0).len() * vocab;
            if n > 0 {
                *slot = logits.get(at..at + n).map(<[f32]>::to_vec);
                at += n;
            }
        }
        Ok(out)
    }
}

/// The rows of a step's hidden states whose logits a chunk wants, the chunk's first token at row
/// `token_offset`: every token's with `all_logits`, else the last one's with `want_logits`,
/// else none (shared by [`LlamaExecutor`] and [`super::device::DeviceExecutor`]).
pub(crate) fn logit_rows(c: &SeqChunk<'_>, token_offset: usize) -> std::ops::Range<usize> {
    let end = token_offset + c.tokens.len();
    match (c.all_logits, c.want_logits) {
        (true, _) => token_offset..end,
        (false, true) => end.saturating_sub(1)..end,
        (false, false) => end..end,
    }
}

/// Checks a chunk against the KV geometry and the vocabulary and lists the cache slot of every
/// position `0..start_pos + len` (shared by [`LlamaExecutor`] and
/// [`super::device::DeviceExecutor`], so both refuse the same chunks).
pub(crate) fn chunk_slots(
    geometry: KvGeometry,
    vocab: usize,
    c: &SeqChunk<'_>,
    token_offset: usize,
) -> Result<ChunkSlots, EngineError> {
    let bs = geometry.block_size;
    if c.tokens.is_empty() {
        return Err(EngineError::InvalidRequest("empty chunk".into()));
    }
    if let Some(t) = c.tokens.iter().find(|&&t| t as usize >= vocab) {
        return Err(EngineError::InvalidRequest(format!(
            "token id {t} outside the vocabulary of {vocab}"
        )));
    }
    let end = c.start_pos + c.tokens.len();
    let blocks = end.div_ceil(bs);
    if c.block_table.len() < blocks {
        return Err(EngineError::InvalidRequest(format!(
            "block table has {} blocks, positions up to {end} need {blocks}",
            c.block_table.len()
        )));
    }
    let mut slots = Vec::with_capacity(end);
    for &b in &c.block_table[..blocks] {
        let b = b as usize;
        if b >= geometry.num_blocks {
            return Err(EngineError::InvalidRequest(format!(
                "block id {b} outside the cache of {} blocks",
                geometry.num_blocks
            )));
        }
        let room = (end - slots.len()).min(bs);
        slots.extend((0..room).map(|o| b * bs + o));
    }
    Ok(ChunkSlots {
        token_offset,
        len: c.tokens.len(),
        start_pos: c.start_pos,
        slots,
    })
}

/// RMSNorm of every row of `x` (`[rows, alpha.len()]`) into `out`, computed as candle's
/// `rms_norm` computes it (sequential sum of squares in f32, `x / rms · alpha`).
fn rms_norm(x: &[f32], alpha: &[f32], eps: f32, out: &mut [f32]) {
    let n = alpha.len();
    for (src, dst) in x.chunks_exact(n).zip(out.chunks_exact_mut(n)) {
        let sum2: f32 = src.iter().map(|&v| v * v).sum();
        let m = (sum2 / n as f32 + eps).sqrt();
        for ((d, &s), &a) in dst.iter_mut().zip(src).zip(alpha) {
            *d = s / m * a;
        }
    }
}

/// `x += y`, element-wise.
fn add_into(x: &mut [f32], y: &[f32]) -> Result<(), EngineError> {
    if x.len() != y.len() {
        return Err(EngineError::Tensor(format!(
            "residual add of {} and {} values",
            x.len(),
            y.len()
        )));
    }
    for (a, &b) in x.iter_mut().zip(y) {
        *a += b;
    }
    Ok(())
}

impl Executor for LlamaExecutor {
    fn geometry(&self) -> KvGeometry {
        self.geometry
    }

    fn copies_blocks(&self) -> bool {
        true
    }

    fn copy_block(&mut self, src: BlockId, dst: BlockId) -> Result<(), EngineError> {
        let cfg = self.weights.config();
        let n = cfg.n_kv_head * cfg.head_dim * self.geometry.block_size;
        let (src, dst) = self.geometry.block_copy(src, dst)?;
        for layer in &mut self.kv {
            layer.copy_block(src, dst, n);
        }
        Ok(())
    }

    fn vocab_size(&self) -> usize {
        self.weights.config().vocab_size
    }

    fn forward(&mut self, chunks: &[SeqChunk<'_>]) -> Result<Vec<Option<Vec<f32>>>, EngineError> {
        if chunks.is_empty() {
            return Ok(Vec::new());
        }
        let device = self.weights.device().clone();
        device.with_context(|| self.forward_inner(chunks))
    }
}
