//! Llama-architecture weights read from a GGUF file: the architecture parameters from the
//! metadata, the tensors converted at load into the layouts the executor multiplies with.
//!
//! The weights are read-only after [`LlamaWeights::load`] and shared through an `Arc`; no KV
//! state lives here. Q, K and V projections are fused into one `[q+2kv, hidden]` matrix and the
//! gate and up projections into one `[2·ffn, hidden]` matrix, so a layer runs four matmuls.
//!
//! On CPU, candle's Q4_1 matmul is scalar (measured 5× slower than Q8_0) and its quantized
//! kernels round activations to 8 bits. The default [`WeightFormat::Exact`] keeps the file's
//! blocks packed for this crate's F32-activation kernel ([`super::packed`], small steps: decode)
//! and a dense F32 copy of the same values for large steps (prefill GEMM: this crate's AVX-512
//! panel GEMM, [`super::gemm`], where the CPU has AVX-512, else candle's), so every step size
//! computes the same products and greedy answers do not depend on chunking or prefix caching.
//! The output head uses the packed kernel too (SmolLM2's tied embedding is Q8_0: the same
//! values as an F32 head at a quarter of the reads). See `docs/benchmarks.md` (section
//! "worker engine") for the measurements.

use std::borrow::Cow;
use std::path::Path;

use candle_core::quantized::{gguf_file, GgmlDType, QMatMul, QStorage, QTensor};
use candle_core::{DType, Device, Module, Tensor};

use super::gemm::DensePanels;
use super::packed::PackedMatrix;
use crate::EngineError;

/// Architecture parameters of a Llama-family model, read from GGUF metadata.
#[derive(Clone, Debug, PartialEq)]
pub struct LlamaConfig {
    /// `general.architecture`, resolved.
    pub arch: Architecture,
    /// Transformer blocks (`{arch}.block_count`).
    pub n_layer: usize,
    /// Model width (`{arch}.embedding_length`).
    pub hidden: usize,
    /// Query heads (`{arch}.attention.head_count`).
    pub n_head: usize,
    /// Key/value heads (`{arch}.attention.head_count_kv`; grouped-query attention).
    pub n_kv_head: usize,
    /// Per-head dimension (`{arch}.attention.key_length`, else `hidden / n_head`).
    pub head_dim: usize,
    /// Feed-forward width (`{arch}.feed_forward_length`).
    pub ffn: usize,
    /// RoPE base (`{arch}.rope.freq_base`, default 10000).
    pub rope_base: f32,
    /// Rotated dimensions of each head (`{arch}.rope.dimension_count`, default `head_dim`;
    /// even, ≤ `head_dim`).
    pub rope_dims: usize,
    /// RMSNorm epsilon (`{arch}.attention.layer_norm_rms_epsilon`).
    pub rms_eps: f32,
    /// Trained context length (`{arch}.context_length`).
    pub context_length: usize,
    /// Rows of the logits (the embedding matrix's row count; checked against the token list).
    pub vocab_size: usize,
    /// Sliding-window layers (`gemma3`): the window and, per layer, whether it slides.
    pub sliding_window: Option<usize>,
    pub sliding_layers: Vec<bool>,
    /// RoPE base of the sliding layers (`{arch}.rope.freq_base_swa`, default 10000).
    pub rope_base_swa: f32,
    /// `final_logit_softcapping`: logits become `c · tanh(logits / c)`.
    pub final_softcap: Option<f32>,
}

/// The decoder architectures this engine runs (`general.architecture`). All are the Llama
/// block — RMSNorm, grouped-query attention with RoPE, SiLU-gated FFN — with these differences,
/// read from the file rather than guessed:
/// - `llama` (also `mistral`): RoPE on adjacent pairs (llama.cpp's "normal" RoPE; the GGUF
///   converter permutes Q/K rows to match);
/// - `qwen2`: RoPE on the two halves of each head (llama.cpp's NEOX RoPE), and Q/K/V biases
///   (`blk.N.attn_{q,k,v}.bias`);
/// - `qwen3`: NEOX RoPE, an RMSNorm over each query and key head before RoPE
///   (`blk.N.attn_{q,k}_norm.weight`, one `head_dim` vector shared by the heads), no biases,
///   and a head size that need not be `hidden / heads` (`attention.key_length`);
/// - `phi3`: NEOX RoPE, Q/K/V in one tensor (`blk.N.attn_qkv.weight`, rows q | k | v) and gate
///   and up in one (`blk.N.ffn_up.weight`, rows gate | up);
/// - `gemma3`: NEOX RoPE; the embedding scaled by √hidden; per-head Q/K RMSNorm; RMSNorms after
///   attention and after the FFN too (`post_attention_norm`, `post_ffw_norm`) before each
///   residual add; a GELU-gated FFN (tanh GELU); sliding-window attention
///   (`attention.sliding_window` = W) on every layer except every `sliding_window_pattern`-th
///   (default 6: layers 5, 11, …), those layers with their own RoPE base (`rope.freq_base_swa`,
///   default 10000); logits soft-capped when `final_logit_softcapping` is set.
///
/// Every architecture also takes, where the file has them: RoPE over only the first
/// `rope.dimension_count` dimensions of each head (partial rotary), and per-frequency factors
/// (`rope_freqs.weight`, Llama 3.1's RoPE scaling as llama.cpp's converter writes it: each
/// frequency divided by its factor).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Architecture {
    Llama,
    Qwen2,
    Qwen3,
    Phi3,
    Gemma3,
}

impl Architecture {
    /// From `general.architecture`.
    pub fn from_name(name: &str) -> Option<Architecture> {
        match name {
            "llama" | "mistral" => Some(Architecture::Llama),
            "qwen2" => Some(Architecture::Qwen2),
            "qwen3" => Some(Architecture::Qwen3),
            "phi3" => Some(Architecture::Phi3),
            "gemma3" => Some(Architecture::Gemma3),
            _ => None,
        }
    }

    /// Whether RoPE rotates the two halves of a head (NEOX) instead of adjacent pairs.
    pub fn rope_halves(self) -> bool {
        matches!(
            self,
            Architecture::Qwen2 | Architecture::Qwen3 | Architecture::Phi3 | Architecture::Gemma3
        )
    }
}

/// How matrices are stored for the matmuls.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WeightFormat {
    /// Keep the file's quantization (Q4_1 for the default model; the right choice on CUDA,
    /// which has Q4_1 kernels, slow on CPU).
    AsStored,
    /// Requantize everything to Q8_0 (SIMD CPU kernels).
    Q8_0,
    /// Dequantize to dense F32 (fast GEMM for large batches, slow for single rows).
    F32,
    /// The file's weights exactly, always with F32 activations: steps with fewer than
    /// `dense_min_tokens` tokens multiply the stored blocks (Q4_0 / Q4_1 / Q8_0) with this
    /// crate's kernel ([`super::packed`]), larger steps use a dense F32 GEMM over the same
    /// dequantized values. Both paths compute the same products (only the summation order
    /// differs), so greedy results do not depend on step size, chunking or prefix caching.
    /// Matrices in other formats use the dense copy for every step.
    Exact {
        /// Smallest step (total tokens) that uses the dense F32 copy.
        dense_min_tokens: usize,
    },
    /// Q8_0 for steps with fewer than `dense_min_tokens` tokens, dense F32 otherwise. Not
    /// step-size invariant: candle's Q8_0 kernel rounds activations to 8 bits, so a cached
    /// continuation can take a different greedy path than an uncached prefill.
    Hybrid {
        /// Smallest step (total tokens) that uses the dense F32 copy.
        dense_min_tokens: usize,
    },
    /// llama.cpp's arithmetic, for fleets where kvgate workers and `llama-server` must give the
    /// same greedy tokens: ggml's quantized block products (each activation row quantized to
    /// 8 bits per 32 values as ggml's x86 code does it — Q8_1 for Q4_1, Q8_0 for
    /// Q4_0/Q8_0/Q5_0 — integer dot products per block; [`super::int8`] on the packed blocks,
    /// candle's port for the K-quants), SiLU and GELU as ggml computes them, and every key and value
    /// stored as f16, as llama.cpp's default F16 cache stores them (half the KV bytes of the
    /// other CPU formats). All are per row and per token, so results do not depend on step
    /// size, chunking or prefix caching. Faster than [`WeightFormat::Exact`] on AVX-512 VNNI
    /// CPUs, slower prefill on AVX2 ones (docs/benchmarks.md).
    LlamaCpp,
    /// Dense matrices in `DType` on the model's device (no host copies) for
    /// [`super::device::DeviceExecutor`]: `BF16` (the default with `--cuda`, cuBLAS) or `F16` on
    /// a GPU, `F32` on the CPU (the device executor's CPU check). The embedding is kept in the
    /// same dtype.
    Device(DType),
}

impl WeightFormat {
    /// The CPU default: [`WeightFormat::Exact`], packed kernel below 32 tokens per step, dense
    /// F32 GEMM from 32 (see docs/benchmarks.md, section "worker engine").
    pub const CPU_DEFAULT: WeightFormat = WeightFormat::Exact {
        dense_min_tokens: 32,
    };

    /// The format's name in the worker's `/v1/profile` (`numerics`).
    pub fn name(&self) -> &'static str {
        match self {
            WeightFormat::AsStored => "as_stored",
            WeightFormat::Q8_0 => "q8_0",
            WeightFormat::F32 => "f32",
            WeightFormat::Exact { .. } => "exact",
            WeightFormat::Hybrid { .. } => "hybrid",
            WeightFormat::LlamaCpp => "llama_cpp",
            WeightFormat::Device(DType::BF16) => "device_bf16",
            WeightFormat::Device(DType::F16) => "device_f16",
            WeightFormat::Device(_) => "device_f32",
        }
    }

    /// Whether keys and values are rounded to f16 as they enter the KV cache
    /// ([`WeightFormat::LlamaCpp`]).
    pub fn rounds_kv_to_f16(&self) -> bool {
        matches!(self, WeightFormat::LlamaCpp)
    }

    /// Whether the feed-forward's activations are computed as ggml's CPU code computes them
    /// (SiLU through its vector `expf`, GELU through its f16 table; [`WeightFormat::LlamaCpp`];
    /// see `model::activation`).
    pub fn ggml_activations(&self) -> bool {
        matches!(self, WeightFormat::LlamaCpp)
    }

    /// Whether a step of `tokens` tokens multiplies with the dense copy.
    pub fn use_dense(&self, tokens: usize) -> bool {
        match self {
            WeightFormat::AsStored | WeightFormat::Q8_0 | WeightFormat::LlamaCpp => false,
            WeightFormat::F32 | WeightFormat::Device(_) => true,
            WeightFormat::Hybrid { dense_min_tokens }
            | WeightFormat::Exact { dense_min_tokens } => tokens >= *dense_min_tokens,
        }
    }
}

/// One weight matrix `[out, in]`, in the representations its [`WeightFormat`] asks for.
#[derive(Debug)]
pub(crate) struct Linear {
    /// Stored blocks for the F32-activation kernel ([`WeightFormat::Exact`], CPU only).
    packed: Option<PackedMatrix>,
    /// The dense copy in panel layout for this crate's AVX-512 GEMM ([`super::gemm`]; CPU
    /// with AVX-512 only, replacing `dense`).
    panels: Option<DensePanels>,
    /// candle's quantized product, one per run of stacked parts that share a stored format
    /// (outputs concatenated in order); empty when the format does not use it.
    quant: Vec<QMatMul>,
    dense: Option<Tensor>,
    out_features: usize,
    in_features: usize,
}

impl Linear {
    /// Builds a matrix from F32 data on the CPU (`[out, in]`), in `format`, on `device`.
    fn from_dense_cpu(
        w: Tensor,
        stored: &[QTensor],
        format: WeightFormat,
        device: &Device,
    ) -> Result<Self, EngineError> {
        let (out_features, in_features) = w.dims2()?;
        let stored_refs: Vec<&QTensor> = stored.iter().collect();
        // LlamaCpp: ggml's products with 8-bit activations on the packed blocks where the
        // activation quantization is the one ggml uses with them (Q8_1 / Q8_0 per 32 values);
        // K-quants (Q8_K activations) stay on candle's port.
        let int8 = format == WeightFormat::LlamaCpp
            && device.is_cpu()
            && stored.iter().all(|q| int8_format(q.dtype()));
        let packed = if matches!(format, WeightFormat::Exact { .. }) && device.is_cpu() {
            PackedMatrix::stacked(&stored_refs)?.map(PackedMatrix::for_this_cpu)
        } else if int8 {
            PackedMatrix::stacked(&stored_refs)?.map(PackedMatrix::with_int8_activations)
        } else {
            None
        };
        if stored.is_empty() {
            return Err(EngineError::Model(
                "weight matrix without stored tensor".into(),
            ));
        }
        let want_q8 = matches!(format, WeightFormat::Q8_0 | WeightFormat::Hybrid { .. });
        let want_dense = matches!(
            format,
            WeightFormat::F32 | WeightFormat::Hybrid { .. } | WeightFormat::Exact { .. }
        );
        let quant = if format == WeightFormat::AsStored
            || (format == WeightFormat::LlamaCpp && packed.is_none())
        {
            // The file's own blocks: quantizing the dequantized values again would not give
            // them back for the K-quants (their scales are searched for), so the product would
            // run on other weights.
            stored_onto(&stored_refs, device)?
        } else if want_q8 {
            vec![QMatMul::from_qtensor(requantize_onto(
                &w,
                GgmlDType::Q8_0,
                device,
            )?)?]
        } else {
            Vec::new()
        };
        let panels = if want_dense && device.is_cpu() && DensePanels::is_fast() {
            let (n, k) = w.dims2()?;
            let values: Vec<f32> = w.flatten_all()?.to_vec1()?;
            Some(DensePanels::new(&values, n, k)?)
        } else {
            None
        };
        let dense = if let WeightFormat::Device(dtype) = format {
            Some(w.to_dtype(dtype)?.to_device(device)?)
        } else if want_dense && panels.is_none() {
            Some(w.to_device(device)?)
        } else {
            None
        };
        Ok(Linear {
            packed,
            panels,
            quant,
            dense,
            out_features,
            in_features,
        })
    }

    /// Whether the matrix has a dense copy on its device (else it is quantized: candle's
    /// `QMatMul`, which takes F32 activations).
    pub(crate) fn is_dense(&self) -> bool {
        self.dense.is_some()
    }

    /// Output width.
    pub(crate) fn out_features(&self) -> usize {
        self.out_features
    }

    /// `x [m, in] → [m, out]` on host slices: the packed kernel or the panel GEMM directly,
    /// else (other formats, other devices) through candle tensors on `device` and back.
    pub(crate) fn forward_host(
        &self,
        x: &[f32],
        m: usize,
        dense: bool,
        device: &Device,
    ) -> Result<Vec<f32>, EngineError> {
        let has_dense = self.dense.is_some() || self.panels.is_some();
        if let Some(p) = &self.packed {
            if !dense || !has_dense {
                return p.matmul(x, m);
            }
        }
        if let Some(p) = &self.panels {
            if dense || self.quant.is_empty() {
                return p.matmul(x, m);
            }
        }
        if x.len() != m * self.in_features {
            return Err(EngineError::Tensor(format!(
                "matmul input has {} values, expected {m}×{}",
                x.len(),
                self.in_features
            )));
        }
        let t = Tensor::from_slice(x, (m, self.in_features), &Device::Cpu)?.to_device(device)?;
        Ok(self
            .forward(&t, dense)?
            .to_device(&Device::Cpu)?
            .flatten_all()?
            .to_vec1()?)
    }

    /// `x [T, in] → [T, out]`; `dense` selects the dense copy when there is one.
    pub(crate) fn forward(&self, x: &Tensor, dense: bool) -> Result<Tensor, EngineError> {
        let has_dense = self.dense.is_some() || self.panels.is_some();
        if let Some(p) = &self.packed {
            if !dense || !has_dense {
                return host_forward(x, p.cols(), p.rows(), |xs, m| p.matmul(xs, m));
            }
        }
        if let Some(p) = &self.panels {
            if dense || self.quant.is_empty() {
                return host_forward(x, p.cols(), p.rows(), |xs, m| p.matmul(xs, m));
            }
        }
        match (&self.dense, self.quant.as_slice()) {
            (Some(w), _) if dense => Ok(x.matmul(&w.t()?)?),
            (_, [q]) => Ok(q.forward(x)?),
            (_, [_, ..]) => {
                let parts = self
                    .quant
                    .iter()
                    .map(|q| q.forward(x))
                    .collect::<Result<Vec<_>, _>>()?;
                Ok(Tensor::cat(&parts, 1)?)
            }
            (Some(w), []) => Ok(x.matmul(&w.t()?)?),
            (None, []) => Err(EngineError::Model("weight matrix has no storage".into())),
        }
    }
}

/// `x [T, cols] · Wᵀ → [T, rows]` for a CPU tensor through a host-slice kernel `mm`
/// (the packed kernel or the panel GEMM).
fn host_forward(
    x: &Tensor,
    cols: usize,
    rows: usize,
    mm: impl FnOnce(&[f32], usize) -> Result<Vec<f32>, EngineError>,
) -> Result<Tensor, EngineError> {
    let (m, k) = x.dims2()?;
    if k != cols {
        return Err(EngineError::Tensor(format!(
            "matmul input width {k}, weight width {cols}"
        )));
    }
    let xs: Vec<f32> = x.flatten_all()?.to_vec1()?;
    Ok(Tensor::from_vec(mm(&xs, m)?, (m, rows), &Device::Cpu)?)
}

/// The stored matrices `stored` (stacked by rows, each `[rows_i, cols]`) as candle quantized
/// products on `device`, block for block as the file holds them: one product per run of
/// consecutive parts in the same format (their blocks concatenated), so a stack of one format
/// is one product.
fn stored_onto(stored: &[&QTensor], device: &Device) -> Result<Vec<QMatMul>, EngineError> {
    stored
        .chunk_by(|a, b| a.dtype() == b.dtype())
        .map(|run| {
            let cols = run[0].shape().dims2()?.1;
            let (mut rows, mut bytes) = (0, Vec::new());
            for q in run {
                let (r, c) = q.shape().dims2()?;
                if c != cols {
                    return Err(EngineError::Model(format!(
                        "stacked matrices of widths {cols} and {c}"
                    )));
                }
                rows += r;
                bytes.extend_from_slice(&q.data()?);
            }
            Ok(QMatMul::from_qtensor(
                candle_core::quantized::ggml_file::qtensor_from_ggml(
                    run[0].dtype(),
                    &bytes,
                    vec![rows, cols],
                    device,
                )?,
            )?)
        })
        .collect()
}

/// Quantizes F32 `w` to `dtype` (falling back to Q8_0, then to F32, when the row length does
/// not divide into the format's blocks) and places it on `device`.
fn requantize_onto(w: &Tensor, dtype: GgmlDType, device: &Device) -> Result<QTensor, EngineError> {
    let (_, k) = w.dims2()?;
    let dtype = if k % dtype.block_size() == 0 {
        dtype
    } else if k % GgmlDType::Q8_0.block_size() == 0 {
        GgmlDType::Q8_0
    } else {
        GgmlDType::F32
    };
    Ok(QTensor::quantize_onto(w, dtype, device)?)
}

/// One transformer block.
#[derive(Debug)]
pub(crate) struct LayerWeights {
    pub(crate) attn_norm: Tensor,
    /// `attn_norm` on the host (the executor's element-wise ops run on host slices).
    pub(crate) attn_norm_host: Vec<f32>,
    /// `ffn_norm` on the host.
    pub(crate) ffn_norm_host: Vec<f32>,
    pub(crate) wqkv: Linear,
    pub(crate) wo: Linear,
    pub(crate) ffn_norm: Tensor,
    pub(crate) w_gate_up: Linear,
    pub(crate) w_down: Linear,
    /// Q|K|V biases (`qwen2`), `[q_width + 2 kv_width]`, added after the projection.
    pub(crate) qkv_bias: Option<Vec<f32>>,
    /// Per-head RMSNorm weights of queries and keys (`qwen3`, `gemma3`), `[head_dim]` each.
    pub(crate) qk_norm: Option<(Vec<f32>, Vec<f32>)>,
    /// RMSNorms of the attention output and of the FFN output before their residual adds
    /// (`gemma3`), `[hidden]` each.
    pub(crate) post_norms: Option<(Vec<f32>, Vec<f32>)>,
}

/// A loaded Llama-architecture model: read-only, shareable (`Arc<LlamaWeights>`).
#[derive(Debug)]
pub struct LlamaWeights {
    config: LlamaConfig,
    format: WeightFormat,
    device: Device,
    /// `[vocab, hidden]` F32, for the embedding lookup.
    pub(crate) embedding: Tensor,
    pub(crate) layers: Vec<LayerWeights>,
    /// Per-frequency RoPE factors (`rope_freqs.weight`, `[rope_dims / 2]`), when the file has them.
    pub(crate) rope_freqs: Option<Vec<f32>>,
    pub(crate) output_norm: Tensor,
    /// `output_norm` on the host.
    pub(crate) output_norm_host: Vec<f32>,
    /// Output projection, quantized (used with [`HeadPrecision::Quantized`]).
    lm_head_q: Option<QMatMul>,
    /// Output projection `[vocab, hidden]` F32 when the file has an untied `output.weight`
    /// (tied models use `embedding`), used with [`HeadPrecision::F32`].
    lm_head_dense: Option<Tensor>,
    /// Output projection as stored, for the F32-activation kernel ([`WeightFormat::Exact`]
    /// with [`HeadPrecision::F32`] on CPU: same values as the F32 head, a quarter of the reads
    /// for SmolLM2's Q8_0 embedding).
    lm_head_packed: Option<PackedMatrix>,
    head: HeadPrecision,
}

/// How the output projection (the largest matrix: `vocab × hidden`) is computed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HeadPrecision {
    /// F32 weights and activations. Measured necessary for SmolLM2: with a Q8_0 head (whose
    /// kernel also quantizes the activations to 8 bits) the greedy answer to "What is the
    /// capital of France?" flips from "The capital of France is Paris." to "L'Étoile, …"
    /// (the top two logits are 0.08 apart). Costs about 2× the Q8_0 head per logits row.
    F32,
    /// The file's (or Q8_0) weights with 8-bit activations: faster, less exact.
    Quantized,
}

/// Whether [`WeightFormat::LlamaCpp`] multiplies a matrix stored as `dtype` through this crate's
/// 8-bit-activation kernel ([`super::int8`]: the formats whose ggml activation type is Q8_0 or
/// Q8_1 per 32 values); K-quants (Q8_K activations) go through candle's port.
fn int8_format(dtype: GgmlDType) -> bool {
    matches!(
        dtype,
        GgmlDType::Q4_1 | GgmlDType::Q4_0 | GgmlDType::Q8_0 | GgmlDType::Q5_0
    )
}

/// Reads GGUF metadata value `key` as an integer.
fn meta_usize(content: &gguf_file::Content, key: &str) -> Result<usize, EngineError> {
    let v = content
        .metadata
        .get(key)
        .ok_or_else(|| EngineError::Model(format!("GGUF metadata key `{key}` is missing")))?;
    let n = match v {
        gguf_file::Value::U8(x) => u64::from(*x),
        gguf_file::Value::U16(x) => u64::from(*x),
        gguf_file::Value::U32(x) => u64::from(*x),
        gguf_file::Value::U64(x) => *x,
        gguf_file::Value::I32(x) if *x >= 0 => *x as u64,
        gguf_file::Value::I64(x) if *x >= 0 => *x as u64,
        other => {
            return Err(EngineError::Model(format!(
                "GGUF metadata key `{key}` is not a non-negative integer: {other:?}"
            )))
        }
    };
    usize::try_from(n).map_err(|_| EngineError::Model(format!("`{key}` = {n} is too large")))
}

/// Reads GGUF metadata value `key` as a float, `default` when absent.
fn meta_f32(content: &gguf_file::Content, key: &str, default: f32) -> Result<f32, EngineError> {
    match content.metadata.get(key) {
        None => Ok(default),
        Some(v) => v
            .to_f32()
            .or_else(|_| v.to_f64().map(|x| x as f32))
            .map_err(|e| EngineError::Model(format!("GGUF metadata key `{key}`: {e}"))),
    }
}

impl LlamaConfig {
    /// Reads the architecture parameters from GGUF metadata (`{arch}.*` keys where `arch` is
    /// `general.architecture`, which must be a Llama-family name).
    pub fn from_gguf(content: &gguf_file::Content) -> Result<Self, EngineError> {
        let arch = match content.metadata.get("general.architecture") {
            Some(v) => v
                .to_string()
                .map_err(|e| EngineError::Model(format!("general.architecture: {e}")))?
                .clone(),
            None => "llama".to_string(),
        };
        let Some(architecture) = Architecture::from_name(&arch) else {
            return Err(EngineError::Model(format!(
                "unsupported architecture `{arch}` (this engine runs llama, mistral, qwen2, qwen3, phi3 and gemma3)"
            )));
        };
        let k = |s: &str| format!("{arch}.{s}");
        let hidden = meta_usize(content, &k("embedding_length"))?;
        let n_head = meta_usize(content, &k("attention.head_count"))?;
        let n_kv_head = match content.metadata.get(&k("attention.head_count_kv")) {
            Some(_) => meta_usize(content, &k("attention.head_count_kv"))?,
            None => n_head,
        };
        if n_head == 0 || n_kv_head == 0 || n_head % n_kv_head != 0 || hidden % n_head != 0 {
            return Err(EngineError::Model(format!(
                "inconsistent heads: hidden {hidden}, heads {n_head}, kv heads {n_kv_head}"
            )));
        }
        let head_dim = match content.metadata.get(&k("attention.key_length")) {
            Some(_) => meta_usize(content, &k("attention.key_length"))?,
            None => hidden / n_head,
        };
        if head_dim % 2 != 0 {
            return Err(EngineError::Model(format!("odd head dimension {head_dim}")));
        }
        let embd = content
            .tensor_infos
            .get("token_embd.weight")
            .ok_or_else(|| EngineError::Model("tensor `token_embd.weight` is missing".into()))?;
        let vocab_size = embd.shape.dims().first().copied().unwrap_or(0);
        if let Some(gguf_file::Value::Array(tokens)) = content.metadata.get("tokenizer.ggml.tokens")
        {
            if tokens.len() > vocab_size {
                return Err(EngineError::Model(format!(
                    "token list has {} entries but the embedding only {vocab_size} rows",
                    tokens.len()
                )));
            }
        }
        LlamaConfig {
            arch: architecture,
            n_layer: meta_usize(content, &k("block_count"))?,
            hidden,
            n_head,
            n_kv_head,
            head_dim,
            ffn: meta_usize(content, &k("feed_forward_length"))?,
            rope_base: meta_f32(content, &k("rope.freq_base"), 10_000.0)?,
            rope_dims: {
                let n = match content.metadata.get(&k("rope.dimension_count")) {
                    Some(_) => meta_usize(content, &k("rope.dimension_count"))?,
                    None => head_dim,
                };
                if n == 0 || n % 2 != 0 || n > head_dim {
                    return Err(EngineError::Model(format!(
                        "rope.dimension_count {n} must be even and within the head size {head_dim}"
                    )));
                }
                n
            },
            rms_eps: meta_f32(content, &k("attention.layer_norm_rms_epsilon"), 1e-5)?,
            context_length: meta_usize(content, &k("context_length"))?,
            vocab_size,
            sliding_window: None,
            sliding_layers: Vec::new(),
            rope_base_swa: meta_f32(content, &k("rope.freq_base_swa"), 10_000.0)?,
            final_softcap: match content.metadata.get(&k("final_logit_softcapping")) {
                Some(_) => Some(meta_f32(content, &k("final_logit_softcapping"), 0.0)?)
                    .filter(|c| *c > 0.0),
                None => None,
            },
        }
        .with_sliding(content, &k)
    }

    /// Reads the sliding-window layout (`gemma3`: window and pattern; others: none).
    fn with_sliding(
        mut self,
        content: &gguf_file::Content,
        k: &dyn Fn(&str) -> String,
    ) -> Result<Self, EngineError> {
        if self.arch != Architecture::Gemma3 {
            return Ok(self);
        }
        let w = match content.metadata.get(&k("attention.sliding_window")) {
            Some(_) => meta_usize(content, &k("attention.sliding_window"))?,
            None => 0,
        };
        if w == 0 {
            return Ok(self);
        }
        let layers = match content.metadata.get(&k("attention.sliding_window_pattern")) {
            Some(gguf_file::Value::Array(a)) => a
                .iter()
                .map(|v| v.to_bool().map_err(|e| EngineError::Model(e.to_string())))
                .collect::<Result<Vec<bool>, _>>()?,
            Some(_) => {
                let n = meta_usize(content, &k("attention.sliding_window_pattern"))?;
                (0..self.n_layer).map(|i| n == 0 || i % n < n - 1).collect()
            }
            None => (0..self.n_layer).map(|i| i % 6 < 5).collect(),
        };
        if layers.len() != self.n_layer {
            return Err(EngineError::Model(format!(
                "sliding_window_pattern names {} layers, the model has {}",
                layers.len(),
                self.n_layer
            )));
        }
        self.sliding_window = Some(w);
        self.sliding_layers = layers;
        Ok(self)
    }

    /// Bytes of f32 K and V cache one token occupies across all layers.
    pub fn kv_bytes_per_token(&self) -> usize {
        self.kv_bytes_per_token_in(DType::F32)
    }

    /// Bytes of K and V cache one token occupies across all layers with elements of `dtype`.
    pub fn kv_bytes_per_token_in(&self, dtype: DType) -> usize {
        self.n_layer * self.n_kv_head * self.head_dim * 2 * dtype.size_in_bytes()
    }
}

/// Reads named tensors from an open GGUF file.
struct GgufReader<'a> {
    content: &'a gguf_file::Content,
    file: std::fs::File,
}

impl GgufReader<'_> {
    fn qtensor(&mut self, name: &str) -> Result<QTensor, EngineError> {
        if !self.content.tensor_infos.contains_key(name) {
            return Err(EngineError::Model(format!("tensor `{name}` is missing")));
        }
        self.content
            .tensor(&mut self.file, name, &Device::Cpu)
            .map_err(|e| EngineError::Model(format!("reading tensor `{name}`: {e}")))
    }

    fn dense(&mut self, name: &str) -> Result<(Tensor, Vec<QTensor>), EngineError> {
        let q = self.qtensor(name)?;
        let t = q.dequantize(&Device::Cpu)?.to_dtype(DType::F32)?;
        Ok((t, vec![q]))
    }

    /// Several matrices with the same input width, concatenated along the output rows.
    fn fused(&mut self, names: &[String]) -> Result<(Tensor, Vec<QTensor>), EngineError> {
        let mut parts = Vec::with_capacity(names.len());
        let mut stored = Vec::with_capacity(names.len());
        for n in names {
            let (t, q) = self.dense(n)?;
            parts.push(t);
            stored.extend(q);
        }
        if parts.is_empty() {
            return Err(EngineError::Model("no tensors to fuse".into()));
        }
        Ok((Tensor::cat(&parts, 0)?, stored))
    }
}

impl LlamaWeights {
    /// Loads a Llama-architecture GGUF file onto `device` in `format`.
    ///
    /// Cost: reads the file once and converts every matrix (a few seconds for 135M parameters).
    pub fn load(
        path: impl AsRef<Path>,
        device: &Device,
        format: WeightFormat,
    ) -> Result<Self, EngineError> {
        Self::load_with_head(path, device, format, HeadPrecision::F32)
    }

    /// [`LlamaWeights::load`] with a choice of output-projection precision.
    pub fn load_with_head(
        path: impl AsRef<Path>,
        device: &Device,
        format: WeightFormat,
        head: HeadPrecision,
    ) -> Result<Self, EngineError> {
        let path = path.as_ref();
        let mut file = std::fs::File::open(path)
            .map_err(|e| EngineError::Model(format!("opening {}: {e}", path.display())))?;
        let content = gguf_file::Content::read(&mut file)
            .map_err(|e| EngineError::Model(format!("reading GGUF {}: {e}", path.display())))?;
        let config = LlamaConfig::from_gguf(&content)?;
        let mut r = GgufReader {
            content: &content,
            file,
        };

        let embd_q = r.qtensor("token_embd.weight")?;
        let embedding = embd_q.dequantize(&Device::Cpu)?.to_dtype(match format {
            WeightFormat::Device(dtype) => dtype,
            _ => DType::F32,
        })?;
        let (rows, cols) = embedding.dims2()?;
        if rows != config.vocab_size || cols != config.hidden {
            return Err(EngineError::Model(format!(
                "token_embd.weight is {rows}×{cols}, expected {}×{}",
                config.vocab_size, config.hidden
            )));
        }
        let untied = content.tensor_infos.contains_key("output.weight");
        let head_q = if untied {
            r.qtensor("output.weight")?
        } else {
            embd_q
        };
        // The packed head: F32 activations for `Exact`; for `LlamaCpp` the 8-bit-activation
        // product llama.cpp runs on the same blocks (its output matmul quantizes the hidden
        // state as for any other Q4/Q8/Q5_0 matrix), where the head is in such a format.
        let lm_head_packed = match format {
            _ if !device.is_cpu() || head != HeadPrecision::F32 => None,
            WeightFormat::Exact { .. } => {
                PackedMatrix::from_qtensor(&head_q)?.map(PackedMatrix::for_this_cpu)
            }
            WeightFormat::LlamaCpp if int8_format(head_q.dtype()) => {
                PackedMatrix::from_qtensor(&head_q)?.map(PackedMatrix::with_int8_activations)
            }
            _ => None,
        };
        let (lm_head_q, lm_head_dense) = match head {
            HeadPrecision::Quantized => (Some(quantized_head(head_q, device)?), None),
            HeadPrecision::F32 if lm_head_packed.is_some() => (None, None),
            HeadPrecision::F32 if untied => (
                None,
                Some(
                    head_q
                        .dequantize(&Device::Cpu)?
                        .to_dtype(match format {
                            WeightFormat::Device(dtype) => dtype,
                            _ => DType::F32,
                        })?
                        .to_device(device)?,
                ),
            ),
            HeadPrecision::F32 => (None, None),
        };
        let output_norm = r.dense("output_norm.weight")?.0;
        let output_norm_host: Vec<f32> = output_norm.to_vec1()?;
        let output_norm = output_norm.to_device(device)?;

        let mut layers = Vec::with_capacity(config.n_layer);
        for i in 0..config.n_layer {
            let p = |s: &str| format!("blk.{i}.{s}.weight");
            let (qkv, qkv_q) = if config.arch == Architecture::Phi3 {
                r.dense(&p("attn_qkv"))?
            } else {
                r.fused(&[p("attn_q"), p("attn_k"), p("attn_v")])?
            };
            let expect_qkv = (config.n_head + 2 * config.n_kv_head) * config.head_dim;
            if qkv.dims2()? != (expect_qkv, config.hidden) {
                return Err(EngineError::Model(format!(
                    "layer {i}: fused QKV is {:?}, expected ({expect_qkv}, {})",
                    qkv.dims(),
                    config.hidden
                )));
            }
            let (wo, wo_q) = r.dense(&p("attn_output"))?;
            let (gu, gu_q) = if config.arch == Architecture::Phi3 {
                r.dense(&p("ffn_up"))?
            } else {
                r.fused(&[p("ffn_gate"), p("ffn_up")])?
            };
            if gu.dims2()? != (2 * config.ffn, config.hidden) {
                return Err(EngineError::Model(format!(
                    "layer {i}: fused gate/up is {:?}, expected ({}, {})",
                    gu.dims(),
                    2 * config.ffn,
                    config.hidden
                )));
            }
            let (down, down_q) = r.dense(&p("ffn_down"))?;
            let attn_norm = r.dense(&p("attn_norm"))?.0;
            let ffn_norm = r.dense(&p("ffn_norm"))?.0;
            let vec_of = |r: &mut GgufReader<'_>,
                          name: String,
                          len: usize|
             -> Result<Vec<f32>, EngineError> {
                let v: Vec<f32> = r.dense(&name)?.0.flatten_all()?.to_vec1()?;
                if v.len() != len {
                    return Err(EngineError::Model(format!(
                        "`{name}` has {} values, expected {len}",
                        v.len()
                    )));
                }
                Ok(v)
            };
            let (qw, kw) = (
                config.n_head * config.head_dim,
                config.n_kv_head * config.head_dim,
            );
            let qkv_bias = if config.arch == Architecture::Qwen2 {
                let b = |s: &str| format!("blk.{i}.{s}.bias");
                let mut v = vec_of(&mut r, b("attn_q"), qw)?;
                v.extend(vec_of(&mut r, b("attn_k"), kw)?);
                v.extend(vec_of(&mut r, b("attn_v"), kw)?);
                Some(v)
            } else {
                None
            };
            let post_norms = if config.arch == Architecture::Gemma3 {
                Some((
                    vec_of(&mut r, p("post_attention_norm"), config.hidden)?,
                    vec_of(&mut r, p("post_ffw_norm"), config.hidden)?,
                ))
            } else {
                None
            };
            let qk_norm = if matches!(config.arch, Architecture::Qwen3 | Architecture::Gemma3) {
                Some((
                    vec_of(&mut r, p("attn_q_norm"), config.head_dim)?,
                    vec_of(&mut r, p("attn_k_norm"), config.head_dim)?,
                ))
            } else {
                None
            };
            layers.push(LayerWeights {
                qkv_bias,
                qk_norm,
                post_norms,
                attn_norm_host: attn_norm.to_vec1()?,
                ffn_norm_host: ffn_norm.to_vec1()?,
                attn_norm: attn_norm.to_device(device)?,
                wqkv: Linear::from_dense_cpu(qkv, &qkv_q, format, device)?,
                wo: Linear::from_dense_cpu(wo, &wo_q, format, device)?,
                ffn_norm: ffn_norm.to_device(device)?,
                w_gate_up: Linear::from_dense_cpu(gu, &gu_q, format, device)?,
                w_down: Linear::from_dense_cpu(down, &down_q, format, device)?,
            });
        }
        let rope_freqs = if content.tensor_infos.contains_key("rope_freqs.weight") {
            let v: Vec<f32> = r.dense("rope_freqs.weight")?.0.flatten_all()?.to_vec1()?;
            if v.len() != config.rope_dims / 2 || v.iter().any(|f| !(f.is_finite() && *f > 0.0)) {
                return Err(EngineError::Model(format!(
                    "rope_freqs.weight has {} values (expected {}, all positive)",
                    v.len(),
                    config.rope_dims / 2
                )));
            }
            Some(v)
        } else {
            None
        };
        Ok(LlamaWeights {
            rope_freqs,
            config,
            format,
            device: device.clone(),
            embedding: embedding.to_device(device)?,
            layers,
            output_norm,
            output_norm_host,
            lm_head_q,
            lm_head_dense,
            lm_head_packed,
            head,
        })
    }

    /// Logits `[rows, vocab]` of final-normed hidden states `x` (`[rows, hidden]`).
    pub(crate) fn lm_head(&self, x: &Tensor) -> Result<Tensor, EngineError> {
        if let Some(p) = &self.lm_head_packed {
            return host_forward(x, p.cols(), p.rows(), |xs, m| p.matmul(xs, m));
        }
        match (&self.lm_head_q, &self.lm_head_dense) {
            (Some(q), _) => Ok(q.forward(x)?),
            (None, Some(w)) => Ok(x.matmul(&w.t()?)?),
            (None, None) => Ok(x.matmul(&self.embedding.t()?)?),
        }
    }

    /// [`LlamaWeights::lm_head`] on host slices (`x` is `[rows, hidden]`, final-normed).
    pub(crate) fn lm_head_host(&self, x: &[f32], rows: usize) -> Result<Vec<f32>, EngineError> {
        if let Some(p) = &self.lm_head_packed {
            return p.matmul(x, rows);
        }
        let t = Tensor::from_slice(x, (rows, self.config.hidden), &Device::Cpu)?
            .to_device(&self.device)?;
        Ok(self
            .lm_head(&t)?
            .to_device(&Device::Cpu)?
            .flatten_all()?
            .to_vec1()?)
    }

    /// Logits `[rows, vocab]` (F32) of final-normed hidden states `x` on the weights' device, in
    /// the dtype of the dense head (the embedding when tied) or through the quantized head.
    pub(crate) fn lm_head_device(&self, x: &Tensor) -> Result<Tensor, EngineError> {
        let y = match (&self.lm_head_q, &self.lm_head_dense) {
            (Some(q), _) => q.forward(&x.to_dtype(DType::F32)?)?,
            (None, Some(w)) => x.to_dtype(w.dtype())?.matmul(&w.t()?)?,
            (None, None) => x
                .to_dtype(self.embedding.dtype())?
                .matmul(&self.embedding.t()?)?,
        };
        Ok(y.to_dtype(DType::F32)?)
    }

    /// How the output projection is computed.
    pub fn head_precision(&self) -> HeadPrecision {
        self.head
    }

    /// The architecture parameters.
    pub fn config(&self) -> &LlamaConfig {
        &self.config
    }

    /// The matmul format chosen at load.
    pub fn format(&self) -> WeightFormat {
        self.format
    }

    /// The device the weights live on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Bytes of the CPU executor's KV cache one token occupies (K and V, all layers): f16
    /// elements with [`WeightFormat::LlamaCpp`] (its cache rounds them to f16 as llama.cpp's
    /// does, so it stores them as f16), f32 otherwise.
    pub fn kv_bytes_per_token(&self) -> usize {
        if self.format.rounds_kv_to_f16() {
            self.config.kv_bytes_per_token_in(DType::F16)
        } else {
            self.config.kv_bytes_per_token()
        }
    }

    /// How many blocks of `block_size` tokens fit in `budget_bytes` of KV cache.
    pub fn blocks_for_budget(&self, budget_bytes: usize, block_size: usize) -> usize {
        blocks_for_budget(self.kv_bytes_per_token(), budget_bytes, block_size)
    }
}

/// How many blocks of `block_size` tokens at `bytes_per_token` fit in `budget_bytes`.
pub fn blocks_for_budget(bytes_per_token: usize, budget_bytes: usize, block_size: usize) -> usize {
    budget_bytes
        .checked_div(bytes_per_token.saturating_mul(block_size))
        .unwrap_or(0)
}

/// The output projection: kept quantized (Q8_0 on CPU when the file's format has no fast
/// CPU kernel; as stored on CUDA).
fn quantized_head(q: QTensor, device: &Device) -> Result<QMatMul, EngineError> {
    let fast_on_cpu = matches!(
        q.dtype(),
        GgmlDType::Q8_0 | GgmlDType::Q4_0 | GgmlDType::Q4K | GgmlDType::Q6K
    );
    let q = if device.is_cpu() && !fast_on_cpu {
        let w = q.dequantize(&Device::Cpu)?;
        requantize_onto(&w, GgmlDType::Q8_0, device)?
    } else if device.is_cpu() {
        q
    } else {
        let data: Cow<'_, [u8]> = q.data()?;
        QTensor::new(QStorage::from_data(data, device, q.dtype())?, q.shape())?
    };
    Ok(QMatMul::from_qtensor(q)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_for_budget_rounds_down() {
        assert_eq!(blocks_for_budget(100, 1000, 4), 2);
        assert_eq!(blocks_for_budget(100, 399, 4), 0);
        assert_eq!(blocks_for_budget(0, 1000, 4), 0);
    }

    #[test]
    fn hybrid_threshold() {
        let f = WeightFormat::Hybrid {
            dense_min_tokens: 32,
        };
        assert!(!f.use_dense(31));
        assert!(f.use_dense(32));
        assert!(!WeightFormat::Q8_0.use_dense(1000));
        assert!(WeightFormat::F32.use_dense(1));
    }

    /// `[rows, cols]` pseudo-random values in [-1, 1).
    fn random(rows: usize, cols: usize, seed: u64) -> Tensor {
        let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        let v: Vec<f32> = (0..rows * cols)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (x >> 40) as f32 / (1u64 << 23) as f32 - 1.0
            })
            .collect();
        Tensor::from_vec(v, (rows, cols), &Device::Cpu).unwrap()
    }

    fn values(t: &Tensor) -> Vec<f32> {
        t.flatten_all().unwrap().to_vec1().unwrap()
    }

    /// A `[rows, cols]` matrix of pseudo-random Q4_K or Q6_K blocks (any bits, with small
    /// finite scales), as a quantizer that searches its scales (llama.cpp's) may write them.
    fn blocks(dtype: GgmlDType, rows: usize, cols: usize, seed: u64) -> QTensor {
        let n = rows * cols / dtype.block_size();
        let size = dtype.type_size();
        let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        let mut bytes: Vec<u8> = (0..n * size)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (x >> 32) as u8
            })
            .collect();
        let scales: &[usize] = match dtype {
            GgmlDType::Q4K => &[0, 2], // d, dmin
            GgmlDType::Q6K => &[208],  // d
            _ => panic!("{dtype:?}"),
        };
        for b in bytes.chunks_mut(size) {
            for &at in scales {
                b[at..at + 2].copy_from_slice(&half::f16::from_f32(0.01).to_le_bytes());
            }
        }
        candle_core::quantized::ggml_file::qtensor_from_ggml(
            dtype,
            &bytes,
            vec![rows, cols],
            &Device::Cpu,
        )
        .unwrap()
    }

    /// `LlamaCpp` (and `AsStored`) multiply K-quant matrices with candle's product on the
    /// file's own blocks. Quantizing the dequantized values again gives other blocks (the
    /// K-quants' scales are searched for), which is what these formats did before: Gemma 3
    /// 270M's greedy tokens then differed from llama.cpp's at 3 of 36 fixture positions, now at 1.
    #[test]
    fn quantized_products_use_the_stored_blocks() {
        let cols = 512;
        let stored = |rows, seed, dtype| blocks(dtype, rows, cols, seed);
        let deq = |q: &QTensor| q.dequantize(&Device::Cpu).unwrap();
        // Why it matters: a second quantization of Q4_K's values is not the stored matrix.
        let q4k = stored(8, 1, GgmlDType::Q4K);
        let again = QTensor::quantize(&deq(&q4k), GgmlDType::Q4K).unwrap();
        assert_ne!(values(&deq(&again)), values(&deq(&q4k)));

        let x = random(3, cols, 4);
        for format in [WeightFormat::LlamaCpp, WeightFormat::AsStored] {
            // One format: one product over the stacked blocks, which are the stored ones.
            let parts = [stored(8, 1, GgmlDType::Q4K), stored(3, 3, GgmlDType::Q4K)];
            let w = Tensor::cat(&[deq(&parts[0]), deq(&parts[1])], 0).unwrap();
            let lin = Linear::from_dense_cpu(w.clone(), &parts, format, &Device::Cpu).unwrap();
            assert_eq!(lin.quant.len(), 1, "{format:?}");
            let QMatMul::QTensor(q) = &lin.quant[0] else {
                panic!("{format:?}: not a quantized product");
            };
            assert_eq!(q.dtype(), GgmlDType::Q4K);
            let mut bytes = parts[0].data().unwrap().to_vec();
            bytes.extend_from_slice(&parts[1].data().unwrap());
            assert_eq!(q.data().unwrap().as_ref(), bytes.as_slice(), "{format:?}");

            // Two formats: one product each on its stored blocks, outputs side by side.
            let parts = [stored(8, 1, GgmlDType::Q4K), stored(4, 2, GgmlDType::Q6K)];
            let w = Tensor::cat(&[deq(&parts[0]), deq(&parts[1])], 0).unwrap();
            let lin = Linear::from_dense_cpu(w, &parts, format, &Device::Cpu).unwrap();
            assert_eq!(lin.quant.len(), 2, "{format:?}");
            let got = lin.forward(&x, false).unwrap();
            let [a, b] = parts;
            let want = Tensor::cat(
                &[
                    QMatMul::from_qtensor(a).unwrap().forward(&x).unwrap(),
                    QMatMul::from_qtensor(b).unwrap().forward(&x).unwrap(),
                ],
                1,
            )
            .unwrap();
            assert_eq!(values(&got), values(&want), "{format:?}");
        }
    }
}
