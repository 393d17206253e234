//! [`DeviceExecutor`]: the forward pass as candle tensor operations on one device — a CUDA GPU
//! (the crate's `cuda` feature) or the CPU — with the paged KV cache held in device tensors.
//!
//! What lives where: the weights (dense in the executor's dtype, or candle's quantized
//! matrices), the per-layer K and V caches, the RoPE tables and every activation stay on the
//! device for the whole step. The host keeps what it keeps for the CPU executor — block pool,
//! prefix cache, events, scheduler — as metadata, and per step uploads one `u32` buffer (token
//! ids, positions, the slot of every new token, and the attention's block tables or context
//! slots) plus, for batched decodes, one `f32` mask; nothing per layer. Logits come back only
//! for the rows that sample.
//!
//! KV layout (per layer, K and V alike): `[num_blocks · block_size, n_kv_head · head_dim]`,
//! row `slot = block · block_size + offset` holding one token's keys (or values) of every KV
//! head, head-major. A step's keys and values are written by a scatter over its slot mapping.
//!
//! Attention ([`AttentionKind`]):
//! - [`AttentionKind::Composed`] — candle ops on any device: per prefill chunk, gather its
//!   context rows through its slots, `Q·Kᵀ` per KV head (grouped query heads side by side),
//!   causal (and sliding-window) mask built from positions, softmax, `·V`; decodes (one-token
//!   chunks) are batched: contexts gathered into a padded `[B, L_max]` block with an additive
//!   mask. Scores and softmax in F32 whatever the activation dtype. The rest of the layer is
//!   candle ops too.
//! - [`AttentionKind::Fused`] — the CUDA kernels of `cuda/kernels.cu` (compiled at start with
//!   NVRTC): Q/K/V preparation (bias, per-head RMSNorm, RoPE) with the KV write, tile attention
//!   (or the per-token kernel above head size 128; both compute the same bits per query), the
//!   residual add fused with the next RMSNorm, and the gated activation — 9 launches per layer
//!   with the four matmuls, into buffers allocated once per step. The composed path is its
//!   reference (`scripts/gpu-check.sh` compares them on a GPU; the kernels' logic is checked on
//!   the CPU by `engine/tests/cuda_kernels_emulated.rs`). docs/gpu.md describes both.
//!
//! Numerics: with F32 weights on the CPU this executor gives the greedy tokens of the tuned
//! CPU executor ([`super::LlamaExecutor`]) — cold, cached, chunked and batched
//! (`engine/tests/device_executor.rs`); on an H200 F32 does too, and BF16 keeps cached =
//! chunked = batched = cold while differing from F32 at near ties (docs/benchmarks.md,
//! "GPU engine").

use std::sync::Arc;

use candle_core::{DType, Device, Tensor};

use super::attention::{rope_cos_sin_scaled, ChunkSlots};
use super::executor::{chunk_slots, logit_rows};
use super::weights::{Architecture, Linear, LlamaWeights, WeightFormat};
use crate::executor::{BlockId, Executor, KvGeometry, Sampled, SeqChunk};
use crate::EngineError;

/// How attention runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttentionKind {
    /// candle tensor ops (any device; the reference).
    Composed,
    /// The CUDA kernels (CUDA devices with F32 or BF16 activations, head size ≤ 512).
    Fused,
}

impl AttentionKind {
    /// The name in reports (`composed` / `fused`).
    pub fn name(self) -> &'static str {
        match self {
            AttentionKind::Composed => "composed",
            AttentionKind::Fused => "fused",
        }
    }
}

/// Largest head size the fused kernels take (their shared-memory buffers).
pub const FUSED_MAX_HEAD_DIM: usize = 512;

/// Small per-layer tensors in the activation dtype (and F32 copies for the fused kernels).
struct LayerExtras {
    attn_norm: Tensor,
    ffn_norm: Tensor,
    qkv_bias: Option<Tensor>,
    qk_norm: Option<(Tensor, Tensor)>,
    post_norms: Option<(Tensor, Tensor)>,
    /// F32 `[q+2kv]` bias and `[head_dim]` Q/K norms, for the fused kernels.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    bias_f32: Option<Tensor>,
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    qk_norm_f32: Option<(Tensor, Tensor)>,
}

/// RoPE tables for positions `0..rows`: `[rows, rope_dims / 2]` cos and sin, F32 (fused
/// kernels) and in the activation dtype (candle's rope ops), for the main base and, for
/// sliding-window layers, their own base.
struct RopeTables {
    rows: usize,
    main: RopePair,
    swa: Option<RopePair>,
}

struct RopePair {
    cos: Tensor,
    sin: Tensor,
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    cos_f32: Tensor,
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    sin_f32: Tensor,
}

impl RopePair {
    fn new(
        rows: usize,
        rot_dims: usize,
        base: f32,
        factors: Option<&[f32]>,
        dtype: DType,
        dev: &Device,
    ) -> Result<Self, EngineError> {
        let half = rot_dims / 2;
        let mut cos = Vec::with_capacity(rows * half);
        let mut sin = Vec::with_capacity(rows * half);
        let mut buf = Vec::with_capacity(rot_dims);
        for p in 0..rows {
            rope_cos_sin_scaled(p, rot_dims, base, factors, &mut buf);
            for cs in buf.chunks_exact(2) {
                cos.push(cs[0]);
                sin.push(cs[1]);
            }
        }
        let cos_f32 = Tensor::from_vec(cos, (rows, half), dev)?;
        let sin_f32 = Tensor::from_vec(sin, (rows, half), dev)?;
        Ok(RopePair {
            cos: cos_f32.to_dtype(dtype)?,
            sin: sin_f32.to_dtype(dtype)?,
            cos_f32,
            sin_f32,
        })
    }
}

/// The composed attention's plan for one step (shared by every layer).
struct ComposedPlan {
    /// One-token chunks attended together: their tokens' rows in the step, their padded
    /// context slots `[B · l_max]`, and additive masks `[B, 1, 1, l_max]` (full layers, and
    /// sliding layers when the model has them).
    decodes: Option<DecodeBatch>,
    /// Every other chunk: its first row, length, start position, context slots `[start+len]`
    /// and its masks `[len, start+len]` (None for a one-token chunk: it sees every key).
    chunks: Vec<ChunkPlan>,
    /// Row of every step token in the concatenation `[decodes…, chunks…]`, when that is not
    /// the step's own order.
    perm: Option<Tensor>,
}

struct DecodeBatch {
    rows: Tensor,
    batch: usize,
    l_max: usize,
    slots: Tensor,
    mask: Tensor,
    mask_swa: Option<Tensor>,
}

struct ChunkPlan {
    offset: usize,
    len: usize,
    ctx: usize,
    slots: Tensor,
    mask: Option<Tensor>,
    /// Sliding layers: the mask with the window, or (one token) the first visible key.
    mask_swa: Option<Tensor>,
    first_swa: usize,
}

/// What every layer of one step reads.
struct Step {
    total: usize,
    /// `[T]` u32 positions.
    positions: Tensor,
    /// `[T]` u32 cache slot of each token.
    slots: Tensor,
    /// `[T, 1, rope_dims/2]` cos/sin in the activation dtype (composed path), main and SWA.
    rope: Option<(Tensor, Tensor)>,
    rope_swa: Option<(Tensor, Tensor)>,
    /// `[T, n_kv_head · head_dim]` u32: each token's slot repeated over a row (the scatter's
    /// index; composed path).
    kv_index: Option<Tensor>,
    composed: Option<ComposedPlan>,
    /// Fused path: chunk indices, block tables, tiles and rows.
    fused: Option<FusedPlan>,
}

/// The fused attention's plan for one step.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
struct FusedPlan {
    /// `[T]` chunk index of each token.
    seq: Tensor,
    /// `[chunks · max_blocks]` block tables.
    tables: Tensor,
    max_blocks: usize,
    /// `[n · 3]` tiles covering every token (first row, rows, chunk) and their count, when the
    /// head size allows the tile kernel; `None`: every token through the per-token kernel.
    /// Both compute the same bits for a query (`cuda/kernels.cu`).
    tiles: Option<(Tensor, usize)>,
}

/// Queries per tile of the tile kernel (`KV_TILE_Q` in `cuda/kernels.cu`).
pub(crate) const TILE_QUERIES: usize = 16;
/// Largest head size the tile kernel takes (`KV_TILE_MAX_DIM`).
pub(crate) const TILE_MAX_HEAD_DIM: usize = 128;

/// The Llama-family forward on one device with a device-resident paged KV cache.
pub struct DeviceExecutor {
    weights: Arc<LlamaWeights>,
    geometry: KvGeometry,
    dtype: DType,
    attention: AttentionKind,
    layers: Vec<LayerExtras>,
    output_norm: Tensor,
    k_cache: Vec<Tensor>,
    v_cache: Vec<Tensor>,
    rope: RopeTables,
    #[cfg(feature = "cuda")]
    kernels: Option<super::cuda::Kernels>,
}

impl std::fmt::Debug for DeviceExecutor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceExecutor")
            .field("geometry", &self.geometry)
            .field("dtype", &self.dtype)
            .field("attention", &self.attention)
            .field("config", self.weights.config())
            .finish_non_exhaustive()
    }
}

fn vec_tensor(v: &[f32], dtype: DType, dev: &Device) -> Result<Tensor, EngineError> {
    Ok(Tensor::from_slice(v, v.len(), dev)?.to_dtype(dtype)?)
}

impl DeviceExecutor {
    /// The activation (and KV) dtype for weights loaded in `format`: the dense dtype of
    /// [`WeightFormat::Device`], F32 for quantized ([`WeightFormat::AsStored`]) weights.
    pub fn activation_dtype(format: WeightFormat) -> Option<DType> {
        match format {
            WeightFormat::Device(dt) => Some(dt),
            WeightFormat::AsStored => Some(DType::F32),
            _ => None,
        }
    }

    /// Bytes of KV cache one token occupies with weights loaded in `format`.
    pub fn kv_bytes_per_token(weights: &LlamaWeights) -> usize {
        let dt = Self::activation_dtype(weights.format()).unwrap_or(DType::F32);
        weights.config().kv_bytes_per_token_in(dt)
    }

    /// Preallocates the KV cache for `geometry` on the weights' device and prepares the RoPE
    /// tables (and, for [`AttentionKind::Fused`], compiles the kernels). The weights must be
    /// loaded in [`WeightFormat::Device`] or [`WeightFormat::AsStored`] on that device.
    pub fn new(
        weights: Arc<LlamaWeights>,
        geometry: KvGeometry,
        attention: AttentionKind,
    ) -> Result<Self, EngineError> {
        let cfg = weights.config().clone();
        let dev = weights.device().clone();
        let dtype = Self::activation_dtype(weights.format()).ok_or_else(|| {
            EngineError::Model(format!(
                "the device executor needs weights loaded as `device` or `as_stored`, not {}",
                weights.format().name()
            ))
        })?;
        if geometry.block_size == 0 || geometry.num_blocks == 0 {
            return Err(EngineError::InvalidRequest(format!(
                "KV geometry needs at least one block of at least one token: {geometry:?}"
            )));
        }
        let slots = geometry
            .num_blocks
            .checked_mul(geometry.block_size)
            .filter(|&s| s <= u32::MAX as usize)
            .ok_or_else(|| {
                EngineError::InvalidRequest(format!("KV geometry too large: {geometry:?}"))
            })?;
        if attention == AttentionKind::Fused {
            if !dev.is_cuda() {
                return Err(EngineError::Model(
                    "fused attention runs on CUDA devices only".into(),
                ));
            }
            if !matches!(dtype, DType::F32 | DType::BF16) || cfg.head_dim > FUSED_MAX_HEAD_DIM {
                return Err(EngineError::Model(format!(
                    "fused attention takes F32 or BF16 activations and head size ≤ {FUSED_MAX_HEAD_DIM} (have {dtype:?}, {})",
                    cfg.head_dim
                )));
            }
        }
        let kv_width = cfg.n_kv_head * cfg.head_dim;
        let mut k_cache = Vec::with_capacity(cfg.n_layer);
        let mut v_cache = Vec::with_capacity(cfg.n_layer);
        for _ in 0..cfg.n_layer {
            k_cache.push(Tensor::zeros((slots, kv_width), dtype, &dev)?);
            v_cache.push(Tensor::zeros((slots, kv_width), dtype, &dev)?);
        }
        let mut layers = Vec::with_capacity(cfg.n_layer);
        for l in &weights.layers {
            let pair = |p: &Option<(Vec<f32>, Vec<f32>)>, dt: DType| {
                p.as_ref()
                    .map(|(a, b)| {
                        Ok::<_, EngineError>((vec_tensor(a, dt, &dev)?, vec_tensor(b, dt, &dev)?))
                    })
                    .transpose()
            };
            layers.push(LayerExtras {
                attn_norm: vec_tensor(&l.attn_norm_host, dtype, &dev)?,
                ffn_norm: vec_tensor(&l.ffn_norm_host, dtype, &dev)?,
                qkv_bias: l
                    .qkv_bias
                    .as_ref()
                    .map(|b| vec_tensor(b, dtype, &dev))
                    .transpose()?,
                qk_norm: pair(&l.qk_norm, dtype)?,
                post_norms: pair(&l.post_norms, dtype)?,
                bias_f32: l
                    .qkv_bias
                    .as_ref()
                    .map(|b| vec_tensor(b, DType::F32, &dev))
                    .transpose()?,
                qk_norm_f32: pair(&l.qk_norm, DType::F32)?,
            });
        }
        let output_norm = vec_tensor(&weights.output_norm_host, dtype, &dev)?;
        let rows = cfg.context_length.clamp(1, slots);
        let rope = Self::rope_tables(&weights, rows, dtype)?;
        #[cfg(feature = "cuda")]
        let kernels = match attention {
            AttentionKind::Fused => Some(super::cuda::Kernels::load(&dev)?),
            AttentionKind::Composed => None,
        };
        dev.synchronize()?;
        Ok(DeviceExecutor {
            weights,
            geometry,
            dtype,
            attention,
            layers,
            output_norm,
            k_cache,
            v_cache,
            rope,
            #[cfg(feature = "cuda")]
            kernels,
        })
    }

    fn rope_tables(
        weights: &LlamaWeights,
        rows: usize,
        dtype: DType,
    ) -> Result<RopeTables, EngineError> {
        let cfg = weights.config();
        let dev = weights.device();
        let factors = weights.rope_freqs.as_deref();
        Ok(RopeTables {
            rows,
            main: RopePair::new(rows, cfg.rope_dims, cfg.rope_base, factors, dtype, dev)?,
            swa: match cfg.sliding_window {
                Some(_) => Some(RopePair::new(
                    rows,
                    cfg.rope_dims,
                    cfg.rope_base_swa,
                    factors,
                    dtype,
                    dev,
                )?),
                None => None,
            },
        })
    }

    /// The shared weights.
    pub fn weights(&self) -> &Arc<LlamaWeights> {
        &self.weights
    }

    /// The activation and KV dtype.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// How attention runs.
    pub fn attention(&self) -> AttentionKind {
        self.attention
    }

    /// `x [T, in] → [T, out]` in the activation dtype (quantized matrices take F32).
    fn linear(&self, l: &Linear, x: &Tensor) -> Result<Tensor, EngineError> {
        if l.is_dense() {
            l.forward(x, true)
        } else {
            Ok(l.forward(&x.to_dtype(DType::F32)?, false)?
                .to_dtype(self.dtype)?)
        }
    }

    fn rms(&self, x: &Tensor, alpha: &Tensor) -> Result<Tensor, EngineError> {
        Ok(candle_nn::ops::rms_norm(
            x,
            alpha,
            self.weights.config().rms_eps,
        )?)
    }

    /// Builds the step's metadata and uploads it (one `u32` buffer, one `f32` buffer for
    /// batched decode masks).
    fn plan(&mut self, layouts: &[ChunkSlots], ids: &[u32]) -> Result<(Tensor, Step), EngineError> {
        let cfg = self.weights.config().clone();
        let dev = self.weights.device().clone();
        let total = ids.len();
        let max_pos = layouts
            .iter()
            .map(|l| l.start_pos + l.len)
            .max()
            .unwrap_or(0);
        if max_pos > self.rope.rows {
            let rows = max_pos
                .next_power_of_two()
                .min(self.geometry.num_blocks * self.geometry.block_size)
                .max(max_pos);
            self.rope = Self::rope_tables(&self.weights, rows, self.dtype)?;
        }
        // The u32 buffer: ids | positions | slots | attention's own sections.
        let mut meta: Vec<u32> = Vec::with_capacity(3 * total);
        meta.extend_from_slice(ids);
        for l in layouts {
            meta.extend((l.start_pos..l.start_pos + l.len).map(|p| p as u32));
        }
        for l in layouts {
            meta.extend(l.slots[l.start_pos..].iter().map(|&s| s as u32));
        }
        let mut masks: Vec<f32> = Vec::new();
        enum Sec {
            Composed {
                decodes: Option<(usize, usize, usize, usize, Option<usize>, usize)>,
                chunks: Vec<(usize, usize)>,
                perm: Option<usize>,
            },
            Fused {
                seq: usize,
                tables: usize,
                max_blocks: usize,
                tiles: Option<(usize, usize)>,
            },
        }
        let window = cfg.sliding_window;
        let sec = match self.attention {
            AttentionKind::Fused => {
                let seq = meta.len();
                for (i, l) in layouts.iter().enumerate() {
                    meta.extend(std::iter::repeat_n(i as u32, l.len));
                }
                let bs = self.geometry.block_size;
                let max_blocks = layouts
                    .iter()
                    .map(|l| l.slots.len().div_ceil(bs))
                    .max()
                    .unwrap_or(1)
                    .max(1);
                let tables = meta.len();
                for l in layouts {
                    let blocks: Vec<u32> = l
                        .slots
                        .iter()
                        .step_by(bs)
                        .map(|&s| (s / bs) as u32)
                        .collect();
                    meta.extend_from_slice(&blocks);
                    meta.extend(std::iter::repeat_n(0, max_blocks - blocks.len()));
                }
                // Tiles of up to TILE_QUERIES consecutive tokens of one chunk, over every chunk.
                let tiles = if cfg.head_dim <= TILE_MAX_HEAD_DIM {
                    let at = meta.len();
                    for (i, l) in layouts.iter().enumerate() {
                        for r in (0..l.len).step_by(TILE_QUERIES) {
                            meta.extend_from_slice(&[
                                (l.token_offset + r) as u32,
                                TILE_QUERIES.min(l.len - r) as u32,
                                i as u32,
                            ]);
                        }
                    }
                    Some((at, (meta.len() - at) / 3))
                } else {
                    None
                };
                Sec::Fused {
                    seq,
                    tables,
                    max_blocks,
                    tiles,
                }
            }
            AttentionKind::Composed => {
                let dec: Vec<usize> = (0..layouts.len())
                    .filter(|&i| layouts[i].len == 1)
                    .collect();
                let batched = dec.len() >= 2;
                let mut order: Vec<usize> = Vec::with_capacity(total);
                let decodes = if batched {
                    let b = dec.len();
                    let l_max = dec
                        .iter()
                        .map(|&i| layouts[i].start_pos + 1)
                        .max()
                        .unwrap_or(1);
                    let rows_at = meta.len();
                    meta.extend(dec.iter().map(|&i| layouts[i].token_offset as u32));
                    let slots_at = meta.len();
                    let mask_at = masks.len();
                    for &i in &dec {
                        let l = &layouts[i];
                        meta.extend(l.slots.iter().map(|&s| s as u32));
                        meta.extend(std::iter::repeat_n(0, l_max - l.slots.len()));
                        masks.extend(std::iter::repeat_n(0.0, l.slots.len()));
                        masks.extend(std::iter::repeat_n(
                            f32::NEG_INFINITY,
                            l_max - l.slots.len(),
                        ));
                    }
                    let swa_at = window.map(|w| {
                        let at = masks.len();
                        for &i in &dec {
                            let l = &layouts[i];
                            let first = (l.start_pos + 1).saturating_sub(w);
                            for j in 0..l_max {
                                masks.push(if j >= first && j <= l.start_pos {
                                    0.0
                                } else {
                                    f32::NEG_INFINITY
                                });
                            }
                        }
                        at
                    });
                    order.extend(dec.iter().map(|&i| layouts[i].token_offset));
                    Some((rows_at, slots_at, b, l_max, swa_at, mask_at))
                } else {
                    None
                };
                let mut chunks = Vec::new();
                for (i, l) in layouts.iter().enumerate() {
                    if batched && l.len == 1 {
                        continue;
                    }
                    chunks.push((i, meta.len()));
                    meta.extend(l.slots.iter().map(|&s| s as u32));
                    order.extend(l.token_offset..l.token_offset + l.len);
                }
                // order[k] = the step row placed k-th; perm[t] = k.
                let identity = order.iter().enumerate().all(|(k, &t)| k == t);
                let perm = if identity {
                    None
                } else {
                    let at = meta.len();
                    let mut perm = vec![0u32; total];
                    for (k, &t) in order.iter().enumerate() {
                        perm[t] = k as u32;
                    }
                    meta.extend_from_slice(&perm);
                    Some(at)
                };
                Sec::Composed {
                    decodes,
                    chunks,
                    perm,
                }
            }
        };
        // One upload each; every view below is a narrow of these.
        let meta_len = meta.len();
        let meta = Tensor::from_vec(meta, meta_len, &dev)?;
        let masks = if masks.is_empty() {
            None
        } else {
            let n = masks.len();
            Some(Tensor::from_vec(masks, n, &dev)?)
        };
        let ids_t = meta.narrow(0, 0, total)?;
        let positions = meta.narrow(0, total, total)?;
        let slots = meta.narrow(0, 2 * total, total)?;
        let mut step = Step {
            total,
            positions,
            slots,
            rope: None,
            rope_swa: None,
            kv_index: None,
            composed: None,
            fused: None,
        };
        match sec {
            Sec::Fused {
                seq,
                tables,
                max_blocks,
                tiles,
            } => {
                step.fused = Some(FusedPlan {
                    seq: meta.narrow(0, seq, total)?,
                    tables: meta.narrow(0, tables, layouts.len() * max_blocks)?,
                    max_blocks,
                    tiles: tiles
                        .map(|(at, n)| Ok::<_, EngineError>((meta.narrow(0, at, 3 * n)?, n)))
                        .transpose()?,
                });
            }
            Sec::Composed {
                decodes,
                chunks,
                perm,
            } => {
                let half = cfg.rope_dims / 2;
                let positions = &step.positions;
                let gather = |p: &RopePair| -> Result<(Tensor, Tensor), EngineError> {
                    Ok((
                        p.cos
                            .index_select(positions, 0)?
                            .reshape((total, 1, half))?,
                        p.sin
                            .index_select(positions, 0)?
                            .reshape((total, 1, half))?,
                    ))
                };
                let main = gather(&self.rope.main)?;
                let swa = self.rope.swa.as_ref().map(gather).transpose()?;
                step.rope = Some(main);
                step.rope_swa = swa;
                let kv_width = cfg.n_kv_head * cfg.head_dim;
                step.kv_index = Some(
                    step.slots
                        .reshape((total, 1))?
                        .broadcast_as((total, kv_width))?
                        .contiguous()?,
                );
                let decodes = match decodes {
                    Some((rows_at, slots_at, b, l_max, swa_at, mask_at)) => {
                        let masks = masks.as_ref().ok_or_else(|| {
                            EngineError::Tensor("batched decode without masks".into())
                        })?;
                        let m = |at: usize| -> Result<Tensor, EngineError> {
                            Ok(masks.narrow(0, at, b * l_max)?.reshape((b, 1, 1, l_max))?)
                        };
                        Some(DecodeBatch {
                            rows: meta.narrow(0, rows_at, b)?,
                            batch: b,
                            l_max,
                            slots: meta.narrow(0, slots_at, b * l_max)?,
                            mask: m(mask_at)?,
                            mask_swa: swa_at.map(m).transpose()?,
                        })
                    }
                    None => None,
                };
                let mut plans = Vec::with_capacity(chunks.len());
                for (i, at) in chunks {
                    let l = &layouts[i];
                    let ctx = l.start_pos + l.len;
                    let (mask, mask_swa, first_swa) = if l.len == 1 {
                        let first = window.map_or(0, |w| ctx.saturating_sub(w));
                        (None, None, first)
                    } else {
                        (
                            Some(causal_mask(&dev, l.start_pos, l.len, None)?),
                            window
                                .map(|w| causal_mask(&dev, l.start_pos, l.len, Some(w)))
                                .transpose()?,
                            0,
                        )
                    };
                    plans.push(ChunkPlan {
                        offset: l.token_offset,
                        len: l.len,
                        ctx,
                        slots: meta.narrow(0, at, ctx)?,
                        mask,
                        mask_swa,
                        first_swa,
                    });
                }
                step.composed = Some(ComposedPlan {
                    decodes,
                    chunks: plans,
                    perm: perm.map(|at| meta.narrow(0, at, total)).transpose()?,
                });
            }
        }
        Ok((ids_t, step))
    }

    /// One step; `argmax` flags the chunks whose logits' argmax is enough (taken on the
    /// device, only the ids copied back).
    fn forward_inner(
        &mut self,
        chunks: &[SeqChunk<'_>],
        argmax: &[bool],
    ) -> Result<Vec<Option<Sampled>>, EngineError> {
        let w = Arc::clone(&self.weights);
        let cfg = w.config();
        let mut ids = Vec::new();
        let mut layouts = Vec::with_capacity(chunks.len());
        for c in chunks {
            layouts.push(chunk_slots(self.geometry, cfg.vocab_size, c, ids.len())?);
            ids.extend_from_slice(c.tokens);
        }
        let (ids_t, step) = self.plan(&layouts, &ids)?;
        let mut x = w.embedding.index_select(&ids_t, 0)?.to_dtype(self.dtype)?;
        if cfg.arch == Architecture::Gemma3 {
            x = x.affine(f64::from((cfg.hidden as f32).sqrt()), 0.0)?;
        }
        // The final hidden states, RMS-normed with the output norm, `[T, hidden]`.
        let normed_all = match self.attention {
            AttentionKind::Composed => self.layers_composed(x, &step)?,
            AttentionKind::Fused => self.layers_fused(x, &step)?,
        };
        let rows: Vec<u32> = chunks
            .iter()
            .zip(&layouts)
            .flat_map(|(c, l)| logit_rows(c, l.token_offset))
            .map(|r| r as u32)
            .collect();
        let mut out = vec![None; chunks.len()];
        if rows.is_empty() {
            // Nothing comes back: wait for the step so its errors surface here.
            w.device().synchronize()?;
            return Ok(out);
        }
        let n_rows = rows.len();
        let normed = if n_rows == step.total {
            normed_all
        } else {
            let idx = Tensor::from_vec(rows, n_rows, w.device())?;
            normed_all.index_select(&idx, 0)?
        };
        // `[n_rows, vocab]` F32 on the device, soft-capping not applied yet.
        let logits = w.lm_head_device(&normed)?;
        // Which logit rows go back whole and which only as their argmax (a chunk that wants
        // every row's logits never goes back as an argmax).
        let wanted: Vec<bool> = chunks
            .iter()
            .enumerate()
            .flat_map(|(i, c)| {
                let id_only = !c.all_logits && argmax.get(i).copied().unwrap_or(false);
                logit_rows(c, 0).map(move |_| id_only)
            })
            .collect();
        let pick = |flag: bool| -> Vec<u32> {
            (0..n_rows as u32)
                .filter(|&r| wanted[r as usize] == flag)
                .collect()
        };
        let select = |rows: &[u32]| -> Result<Tensor, EngineError> {
            Ok(if rows.len() == n_rows {
                logits.clone()
            } else {
                logits.index_select(&Tensor::from_slice(rows, rows.len(), w.device())?, 0)?
            })
        };
        let (full_rows, id_rows) = (pick(false), pick(true));
        let mut full: Vec<f32> = if full_rows.is_empty() {
            Vec::new()
        } else {
            select(&full_rows)?.flatten_all()?.to_vec1()?
        };
        if let Some(cap) = cfg.final_softcap {
            full.iter_mut().for_each(|v| *v = cap * (*v / cap).tanh());
        }
        let ids: Vec<u32> = if id_rows.is_empty() {
            Vec::new()
        } else {
            self.argmax_rows(&select(&id_rows)?)?
        };
        let vocab = cfg.vocab_size;
        let mut full_rows_out = full.chunks_exact(vocab.max(1));
        let mut ids_out = ids.into_iter();
        let mut row = 0;
        for (slot, c) in out.iter_mut().zip(chunks) {
            let n = logit_rows(c, 0).len();
            if n == 0 {
                continue;
            }
            *slot = if wanted[row] {
                ids_out.next().map(Sampled::Token)
            } else {
                let mut all = Vec::with_capacity(n * vocab);
                for l in full_rows_out.by_ref().take(n) {
                    all.extend_from_slice(l);
                }
                (all.len() == n * vocab).then_some(Sampled::Logits(all))
            };
            row += n;
        }
        Ok(out)
    }

    /// The argmax of each row of `logits` (`[rows, vocab]` F32, before soft-capping) as the
    /// host sampler picks it (`crate::sampler::argmax` after soft-capping): a kernel on CUDA,
    /// the host on other devices.
    fn argmax_rows(&self, logits: &Tensor) -> Result<Vec<u32>, EngineError> {
        let cap = self.weights.config().final_softcap;
        #[cfg(feature = "cuda")]
        if let Some(k) = &self.kernels {
            return Ok(k.argmax(logits, cap)?.to_vec1()?);
        }
        let (_, vocab) = logits.dims2()?;
        let mut host: Vec<f32> = logits.flatten_all()?.to_vec1()?;
        if let Some(cap) = cap {
            host.iter_mut().for_each(|v| *v = cap * (*v / cap).tanh());
        }
        Ok(host
            .chunks_exact(vocab.max(1))
            .map(crate::sampler::argmax)
            .collect())
    }

    /// Every layer with candle ops around the composed attention; returns the output-normed
    /// hidden states.
    fn layers_composed(&self, mut x: Tensor, step: &Step) -> Result<Tensor, EngineError> {
        let w = Arc::clone(&self.weights);
        let cfg = w.config();
        for (li, layer) in w.layers.iter().enumerate() {
            let sliding = cfg.sliding_window.is_some()
                && cfg.sliding_layers.get(li).copied().unwrap_or(false);
            let h = self.rms(&x, &self.layers[li].attn_norm)?;
            let qkv = self.linear(&layer.wqkv, &h)?;
            let attn = self.composed_attention(li, &qkv, step, sliding)?;
            let mut o = self.linear(&layer.wo, &attn)?;
            if let Some((post_attn, _)) = &self.layers[li].post_norms {
                o = self.rms(&o, post_attn)?;
            }
            x = (x + o)?;
            let h = self.rms(&x, &self.layers[li].ffn_norm)?;
            let gu = self.linear(&layer.w_gate_up, &h)?;
            let ffn = layer.w_gate_up.out_features() / 2;
            let gate = gu.narrow(1, 0, ffn)?;
            let up = gu.narrow(1, ffn, ffn)?;
            let act = if cfg.arch == Architecture::Gemma3 {
                (gate.gelu()? * up)?
            } else {
                (candle_nn::ops::silu(&gate)? * up)?
            };
            let mut down = self.linear(&layer.w_down, &act)?;
            if let Some((_, post_ffn)) = &self.layers[li].post_norms {
                down = self.rms(&down, post_ffn)?;
            }
            x = (x + down)?;
        }
        self.rms(&x, &self.output_norm)
    }

    #[cfg(not(feature = "cuda"))]
    fn layers_fused(&self, _x: Tensor, _step: &Step) -> Result<Tensor, EngineError> {
        Err(EngineError::Model(
            "fused attention needs a build with the `cuda` feature".into(),
        ))
    }

    /// Every layer with the fused kernels: per layer the four matmuls, `qkv_prep`, attention,
    /// two `add_rms_norm` (each residual add with the norm after it) and `gated_act` (plus
    /// gemma3's post-norms) — 9 launches — into buffers allocated once per step. The residual
    /// stream `x` (this step's own tensor) is updated in place.
    #[cfg(feature = "cuda")]
    fn layers_fused(&self, x: Tensor, step: &Step) -> Result<Tensor, EngineError> {
        let w = Arc::clone(&self.weights);
        let cfg = w.config();
        let kernels = self
            .kernels
            .as_ref()
            .ok_or_else(|| EngineError::Model("fused attention without its kernels".into()))?;
        let (t, dt, dev) = (step.total, self.dtype, x.device().clone());
        // `x` may share storage with the embedding lookup's result only; a copy makes it ours.
        let x = x.copy()?;
        let h = Tensor::zeros((t, cfg.hidden), dt, &dev)?;
        let q = Tensor::zeros((t, cfg.n_head * cfg.head_dim), dt, &dev)?;
        let attn = Tensor::zeros((t, cfg.n_head * cfg.head_dim), dt, &dev)?;
        let act = Tensor::zeros((t, cfg.ffn), dt, &dev)?;
        let eps = cfg.rms_eps;
        match self.layers.first() {
            Some(l0) => kernels.add_rms_norm(&x, None, &l0.attn_norm, eps, &h)?,
            None => kernels.add_rms_norm(&x, None, &self.output_norm, eps, &h)?,
        }
        for (li, layer) in w.layers.iter().enumerate() {
            let ex = &self.layers[li];
            let sliding = cfg.sliding_window.is_some()
                && cfg.sliding_layers.get(li).copied().unwrap_or(false);
            let qkv = self.linear(&layer.wqkv, &h)?;
            self.fused_attention(kernels, li, &qkv, step, sliding, &q, &attn)?;
            let mut o = self.linear(&layer.wo, &attn)?;
            if let Some((post_attn, _)) = &ex.post_norms {
                o = self.rms(&o, post_attn)?;
            }
            kernels.add_rms_norm(&x, Some(&o), &ex.ffn_norm, eps, &h)?;
            let gu = self.linear(&layer.w_gate_up, &h)?;
            kernels.gated_act(&gu, cfg.arch == Architecture::Gemma3, &act)?;
            let mut down = self.linear(&layer.w_down, &act)?;
            if let Some((_, post_ffn)) = &ex.post_norms {
                down = self.rms(&down, post_ffn)?;
            }
            let next = self
                .layers
                .get(li + 1)
                .map_or(&self.output_norm, |l| &l.attn_norm);
            kernels.add_rms_norm(&x, Some(&down), next, eps, &h)?;
        }
        Ok(h)
    }

    /// Q/K/V from the projection (bias, per-head norms, RoPE), the step's K/V written into
    /// the layer's cache, attention over every chunk with candle ops. Returns `[T, q_width]`.
    fn composed_attention(
        &self,
        li: usize,
        qkv: &Tensor,
        step: &Step,
        sliding: bool,
    ) -> Result<Tensor, EngineError> {
        let cfg = self.weights.config();
        let ex = &self.layers[li];
        let (hq, hk, d) = (cfg.n_head, cfg.n_kv_head, cfg.head_dim);
        let (qw, kw) = (hq * d, hk * d);
        let t = step.total;
        let qkv = match &ex.qkv_bias {
            Some(b) => qkv.broadcast_add(b)?,
            None => qkv.clone(),
        };
        let mut q = qkv.narrow(1, 0, qw)?.contiguous()?.reshape((t, hq, d))?;
        let mut k = qkv.narrow(1, qw, kw)?.contiguous()?.reshape((t, hk, d))?;
        let v = qkv.narrow(1, qw + kw, kw)?.contiguous()?;
        if let Some((qn, kn)) = &ex.qk_norm {
            q = self.rms(&q, qn)?;
            k = self.rms(&k, kn)?;
        }
        let (cos, sin) = match (sliding, &step.rope_swa, &step.rope) {
            (true, Some(r), _) | (_, _, Some(r)) => r,
            _ => {
                return Err(EngineError::Tensor(
                    "composed step without RoPE tables".into(),
                ))
            }
        };
        let halves = cfg.arch.rope_halves();
        q = rope(&q, cos, sin, cfg.rope_dims, halves)?;
        k = rope(&k, cos, sin, cfg.rope_dims, halves)?;
        let index = step
            .kv_index
            .as_ref()
            .ok_or_else(|| EngineError::Tensor("composed step without a KV index".into()))?;
        self.k_cache[li].scatter_set(index, &k.reshape((t, kw))?, 0)?;
        self.v_cache[li].scatter_set(index, &v, 0)?;

        let plan = step
            .composed
            .as_ref()
            .ok_or_else(|| EngineError::Tensor("composed step without a plan".into()))?;
        let g = hq / hk;
        let scale = 1.0 / (d as f64).sqrt();
        let (kc, vc) = (&self.k_cache[li], &self.v_cache[li]);
        let mut parts = Vec::with_capacity(plan.chunks.len() + 1);
        if let Some(db) = &plan.decodes {
            let (b, l) = (db.batch, db.l_max);
            // [B, L, hk, d] → [B, hk, L, d]
            let gather = |c: &Tensor| -> Result<Tensor, EngineError> {
                Ok(c.index_select(&db.slots, 0)?
                    .to_dtype(DType::F32)?
                    .reshape((b, l, hk, d))?
                    .transpose(1, 2)?
                    .contiguous()?)
            };
            let (keys, values) = (gather(kc)?, gather(vc)?);
            let qb = q
                .index_select(&db.rows, 0)?
                .to_dtype(DType::F32)?
                .reshape((b, hk, g, d))?;
            let mask = match (sliding, &db.mask_swa) {
                (true, Some(m)) => m,
                _ => &db.mask,
            };
            let scores = (qb.matmul(&keys.t()?)? * scale)?.broadcast_add(mask)?;
            let probs = candle_nn::ops::softmax_last_dim(&scores)?;
            let o = probs.matmul(&values)?.reshape((b, qw))?;
            parts.push(o.to_dtype(self.dtype)?);
        }
        for c in &plan.chunks {
            let (first, mask) = if sliding {
                (c.first_swa, c.mask_swa.as_ref())
            } else {
                (0, c.mask.as_ref())
            };
            let n_keys = c.ctx - first;
            let slots = c.slots.narrow(0, first, n_keys)?;
            let gather = |cache: &Tensor| -> Result<Tensor, EngineError> {
                Ok(cache
                    .index_select(&slots, 0)?
                    .to_dtype(DType::F32)?
                    .reshape((n_keys, hk, d))?
                    .transpose(0, 1)?
                    .contiguous()?)
            };
            let (keys, values) = (gather(kc)?, gather(vc)?);
            // [len, hq, d] → [hk, g·len, d] (query heads of one KV head side by side).
            let qc = q
                .narrow(0, c.offset, c.len)?
                .to_dtype(DType::F32)?
                .reshape((c.len, hk, g, d))?
                .permute((1, 2, 0, 3))?
                .contiguous()?
                .reshape((hk, g * c.len, d))?;
            let mut scores = (qc.matmul(&keys.t()?)? * scale)?;
            if let Some(m) = mask {
                scores = scores
                    .reshape((hk, g, c.len, n_keys))?
                    .broadcast_add(m)?
                    .reshape((hk, g * c.len, n_keys))?;
            }
            let probs = candle_nn::ops::softmax_last_dim(&scores)?;
            let o = probs
                .matmul(&values)?
                .reshape((hk, g, c.len, d))?
                .permute((2, 0, 1, 3))?
                .contiguous()?
                .reshape((c.len, qw))?;
            parts.push(o.to_dtype(self.dtype)?);
        }
        let all = match parts.len() {
            1 => parts.swap_remove(0),
            _ => Tensor::cat(&parts, 0)?,
        };
        Ok(match &plan.perm {
            Some(p) => all.index_select(p, 0)?,
            None => all,
        })
    }

    /// The fused kernels: Q/K/V preparation with the cache write into `q`, then attention into
    /// `out` (the tile kernel, or the per-token kernel for head sizes above 128).
    #[cfg(feature = "cuda")]
    #[allow(clippy::too_many_arguments)]
    fn fused_attention(
        &self,
        kernels: &super::cuda::Kernels,
        li: usize,
        qkv: &Tensor,
        step: &Step,
        sliding: bool,
        q: &Tensor,
        out: &Tensor,
    ) -> Result<(), EngineError> {
        let cfg = self.weights.config();
        let ex = &self.layers[li];
        let plan = step
            .fused
            .as_ref()
            .ok_or_else(|| EngineError::Tensor("fused step without block tables".into()))?;
        let rope = match (sliding, &self.rope.swa) {
            (true, Some(r)) => r,
            _ => &self.rope.main,
        };
        kernels.qkv_prep(
            super::cuda::QkvPrep {
                qkv,
                bias: ex.bias_f32.as_ref(),
                qk_norm: ex.qk_norm_f32.as_ref(),
                eps: cfg.rms_eps,
                cos: &rope.cos_f32,
                sin: &rope.sin_f32,
                positions: &step.positions,
                slots: &step.slots,
                n_head: cfg.n_head,
                n_kv_head: cfg.n_kv_head,
                head_dim: cfg.head_dim,
                rope_dims: cfg.rope_dims,
                halves: cfg.arch.rope_halves(),
                k_cache: &self.k_cache[li],
                v_cache: &self.v_cache[li],
            },
            q,
        )?;
        let a = super::cuda::Attention {
            q,
            out,
            k_cache: &self.k_cache[li],
            v_cache: &self.v_cache[li],
            positions: &step.positions,
            seq: &plan.seq,
            tables: &plan.tables,
            max_blocks: plan.max_blocks,
            block_size: self.geometry.block_size,
            n_head: cfg.n_head,
            n_kv_head: cfg.n_kv_head,
            head_dim: cfg.head_dim,
            scale: 1.0 / (cfg.head_dim as f32).sqrt(),
            window: if sliding { cfg.sliding_window } else { None },
        };
        match &plan.tiles {
            Some((tiles, n)) => kernels.tile_attention(&a, tiles, *n),
            None => kernels.attention(&a),
        }
    }
}

/// Additive causal mask `[len, start+len]` (F32: 0 visible, −1e30 hidden) for queries at
/// positions `start..start+len` over keys `0..start+len`; with a window `w`, a query at `p`
/// sees keys `p+1−w ..= p` only.
fn causal_mask(
    dev: &Device,
    start: usize,
    len: usize,
    window: Option<usize>,
) -> Result<Tensor, EngineError> {
    let ctx = start + len;
    let q = Tensor::arange(start as u32, ctx as u32, dev)?.reshape((len, 1))?;
    let k = Tensor::arange(0u32, ctx as u32, dev)?.reshape((1, ctx))?;
    let mut visible = k.broadcast_le(&q)?;
    if let Some(w) = window {
        // k + w > p  ⟺  k ≥ p + 1 − w (no u32 underflow).
        let kw = Tensor::arange(w as u32, (ctx + w) as u32, dev)?.reshape((1, ctx))?;
        visible = (visible * kw.broadcast_gt(&q)?)?;
    }
    Ok(visible.to_dtype(DType::F32)?.affine(1e30, -1e30)?)
}

/// RoPE over the first `rot_dims` dimensions of every head of `x` (`[T, H, d]`), `cos`/`sin`
/// `[T, 1, rot_dims/2]`: halves (NEOX) or adjacent pairs, as candle's `rope` / `rope_i`.
fn rope(
    x: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    rot_dims: usize,
    halves: bool,
) -> Result<Tensor, EngineError> {
    let (t, h, d) = x.dims3()?;
    let x4 = x.reshape((t, h, 1, d))?;
    let apply = |a: &Tensor| -> Result<Tensor, EngineError> {
        Ok(if halves {
            candle_nn::rotary_emb::rope(a, cos, sin)?
        } else {
            candle_nn::rotary_emb::rope_i(a, cos, sin)?
        })
    };
    let y = if rot_dims == d {
        apply(&x4.contiguous()?)?
    } else {
        let a = apply(&x4.narrow(3, 0, rot_dims)?.contiguous()?)?;
        let b = x4.narrow(3, rot_dims, d - rot_dims)?;
        Tensor::cat(&[a, b], 3)?
    };
    Ok(y.reshape((t, h, d))?)
}

impl Executor for DeviceExecutor {
    fn geometry(&self) -> KvGeometry {
        self.geometry
    }

    fn copies_blocks(&self) -> bool {
        true
    }

    /// Rows `src·B..(src+1)·B` of every layer's K and V cache copied over block `dst`'s, on the
    /// device (a block-sized temporary per tensor: `slice_set` refuses a source sharing the
    /// destination's storage).
    fn copy_block(&mut self, src: BlockId, dst: BlockId) -> Result<(), EngineError> {
        let bs = self.geometry.block_size;
        let (src, dst) = self.geometry.block_copy(src, dst)?;
        if src == dst {
            return Ok(());
        }
        for cache in self.k_cache.iter().chain(&self.v_cache) {
            let rows = cache.narrow(0, src * bs, bs)?.copy()?;
            cache.slice_set(&rows, 0, dst * bs)?;
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
        Ok(self
            .forward_inner(chunks, &[])?
            .into_iter()
            .map(|o| match o {
                Some(Sampled::Logits(l)) => Some(l),
                _ => None,
            })
            .collect())
    }

    fn forward_sampled(
        &mut self,
        chunks: &[SeqChunk<'_>],
        argmax: &[bool],
    ) -> Result<Vec<Option<Sampled>>, EngineError> {
        if chunks.is_empty() {
            return Ok(Vec::new());
        }
        self.forward_inner(chunks, argmax)
    }
}
