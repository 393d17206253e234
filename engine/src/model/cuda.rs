//! The device executor's fused CUDA kernels (`cuda/kernels.cu`): compiled once per executor
//! with NVRTC for the device's compute capability (PTX, JIT-compiled by the driver), launched
//! on the stream candle runs on, reading and writing candle's device tensors in place.
//!
//! `KVGATE_CUDA_KERNELS=FILE` replaces the built-in source with FILE's (same kernel names and
//! signatures): a kernel can be fixed and re-checked on a GPU machine without rebuilding the
//! binary (`scripts/gpu-check.sh`).
//!
//! Kernels (for `T` = `float` and bf16, suffixes `_f32` / `_bf16`):
//! - `qkv_prep_T` — grid `(tokens, n_head + 2·n_kv_head)`, 64 threads: one head vector of one
//!   token: bias, per-head RMSNorm (Q and K heads), RoPE (Q and K heads; halves or pairs, the
//!   first `rope_dims` dimensions), then Q to `q_out [T, n_head·d]` and K/V to row `slots[t]`
//!   of the layer's caches.
//! - `paged_attention_T` — grid `(tokens, n_head)`, one warp: the query of one head of one
//!   token attends keys `first ..= pos[t]` of its sequence through the block table in rounds of
//!   32 keys aligned to multiples of 32 (a lane per key for `Q·K`, the warp for `·V`), online
//!   softmax in F32. For head sizes above 128.
//! - `tile_attention_T` — grid `(tiles, n_head)`, 4 warps: up to 16 consecutive tokens of one
//!   chunk (prefill, or a decode alone); each round's 32 keys and values staged in shared
//!   memory by the whole block (coalesced), then `paged_attention`'s arithmetic exactly, so
//!   a query's output is the same bits whatever the chunking or batching. Head size ≤ 128.

use std::sync::Arc;

use candle_core::cuda_backend::cudarc::driver::{
    CudaFunction, CudaStream, DevicePtr, LaunchConfig, PushKernelArg,
};
use candle_core::cuda_backend::cudarc::nvrtc::{compile_ptx_with_opts, CompileOptions};
use candle_core::{DType, Device, Storage, Tensor};

use super::device::TILE_MAX_HEAD_DIM;
use crate::EngineError;

/// The kernels' source, built in.
pub const SOURCE: &str = include_str!("cuda/kernels.cu");

/// Environment variable naming a replacement source file.
pub const SOURCE_ENV: &str = "KVGATE_CUDA_KERNELS";

fn err(what: &str, e: impl std::fmt::Display) -> EngineError {
    EngineError::Model(format!("CUDA kernels: {what}: {e}"))
}

/// The compiled kernels and the stream they run on.
pub(crate) struct Kernels {
    stream: Arc<CudaStream>,
    qkv_prep_f32: CudaFunction,
    qkv_prep_bf16: CudaFunction,
    attention_f32: CudaFunction,
    attention_bf16: CudaFunction,
    tile_f32: CudaFunction,
    tile_bf16: CudaFunction,
    norm_f32: CudaFunction,
    norm_bf16: CudaFunction,
    act_f32: CudaFunction,
    act_bf16: CudaFunction,
    argmax: CudaFunction,
}

/// Arguments of `qkv_prep`.
pub(crate) struct QkvPrep<'a> {
    pub qkv: &'a Tensor,
    pub bias: Option<&'a Tensor>,
    pub qk_norm: Option<&'a (Tensor, Tensor)>,
    pub eps: f32,
    pub cos: &'a Tensor,
    pub sin: &'a Tensor,
    pub positions: &'a Tensor,
    pub slots: &'a Tensor,
    pub n_head: usize,
    pub n_kv_head: usize,
    pub head_dim: usize,
    pub rope_dims: usize,
    pub halves: bool,
    pub k_cache: &'a Tensor,
    pub v_cache: &'a Tensor,
}

/// Arguments of `paged_attention` and `tile_attention`.
pub(crate) struct Attention<'a> {
    pub q: &'a Tensor,
    /// Written: `[T, n_head·head_dim]`, the rows this launch covers.
    pub out: &'a Tensor,
    pub k_cache: &'a Tensor,
    pub v_cache: &'a Tensor,
    pub positions: &'a Tensor,
    pub seq: &'a Tensor,
    pub tables: &'a Tensor,
    pub max_blocks: usize,
    pub block_size: usize,
    pub n_head: usize,
    pub n_kv_head: usize,
    pub head_dim: usize,
    pub scale: f32,
    pub window: Option<usize>,
}

/// The device address of a contiguous tensor's first element (0 for `None`). The address stays
/// valid while the tensor lives; every launch is on the one stream candle uses, so the
/// kernels are ordered after the ops that wrote their inputs.
fn ptr(t: Option<&Tensor>, stream: &Arc<CudaStream>) -> Result<u64, EngineError> {
    let Some(t) = t else { return Ok(0) };
    let (storage, layout) = t.storage_and_layout();
    let Storage::Cuda(cs) = &*storage else {
        return Err(err("argument", "tensor is not on a CUDA device"));
    };
    let (start, _) = layout
        .contiguous_offsets()
        .ok_or_else(|| err("argument", "tensor is not contiguous"))?;
    let (base, size) = match t.dtype() {
        DType::F32 => (cs.as_cuda_slice::<f32>()?.device_ptr(stream).0, 4),
        DType::BF16 => (cs.as_cuda_slice::<half::bf16>()?.device_ptr(stream).0, 2),
        DType::U32 => (cs.as_cuda_slice::<u32>()?.device_ptr(stream).0, 4),
        other => return Err(err("argument", format!("dtype {other:?}"))),
    };
    Ok(base + (start * size) as u64)
}

fn as_i32(v: usize, what: &str) -> Result<i32, EngineError> {
    i32::try_from(v).map_err(|_| err(what, format!("{v} exceeds i32")))
}

fn as_u32(v: usize, what: &str) -> Result<u32, EngineError> {
    u32::try_from(v).map_err(|_| err(what, format!("{v} exceeds u32")))
}

impl Kernels {
    /// Compiles the kernels for `dev` (a CUDA device) and loads them.
    pub(crate) fn load(dev: &Device) -> Result<Self, EngineError> {
        let cuda = dev.as_cuda_device().map_err(|e| err("device", e))?;
        let stream = cuda.cuda_stream();
        let ctx = stream.context().clone();
        let source = match std::env::var_os(SOURCE_ENV) {
            Some(path) => std::fs::read_to_string(&path)
                .map_err(|e| err("reading $KVGATE_CUDA_KERNELS", e))?,
            None => SOURCE.to_string(),
        };
        if source.contains('\0') {
            return Err(err("source", "contains a NUL byte"));
        }
        let arch = match ctx
            .compute_capability()
            .map_err(|e| err("compute capability", e))?
        {
            (7, 5) => Some("compute_75"),
            (8, 0) => Some("compute_80"),
            (8, 6) => Some("compute_86"),
            (8, 9) => Some("compute_89"),
            (9, 0) => Some("compute_90"),
            (10, 0) => Some("compute_100"),
            (12, 0) => Some("compute_120"),
            _ => None,
        };
        let ptx = compile_ptx_with_opts(
            source,
            CompileOptions {
                arch,
                name: Some("kvgate_kernels.cu".into()),
                ..Default::default()
            },
        )
        .map_err(|e| err("NVRTC", e))?;
        let module = ctx.load_module(ptx).map_err(|e| err("loading PTX", e))?;
        let f = |name: &str| module.load_function(name).map_err(|e| err(name, e));
        Ok(Kernels {
            qkv_prep_f32: f("qkv_prep_f32")?,
            qkv_prep_bf16: f("qkv_prep_bf16")?,
            attention_f32: f("paged_attention_f32")?,
            attention_bf16: f("paged_attention_bf16")?,
            tile_f32: f("tile_attention_f32")?,
            tile_bf16: f("tile_attention_bf16")?,
            norm_f32: f("add_rms_norm_f32")?,
            norm_bf16: f("add_rms_norm_bf16")?,
            act_f32: f("gated_act_f32")?,
            act_bf16: f("gated_act_bf16")?,
            argmax: f("argmax_f32")?,
            stream,
        })
    }

    /// Runs `qkv_prep`: writes Q into `q_out` (`[T, n_head·head_dim]`, RoPE applied) and the
    /// step's keys and values into the caches.
    pub(crate) fn qkv_prep(&self, a: QkvPrep<'_>, q_out: &Tensor) -> Result<(), EngineError> {
        let (t, width) = a.qkv.dims2()?;
        let heads = a.n_head + 2 * a.n_kv_head;
        if width != heads * a.head_dim || t == 0 {
            return Err(err("qkv_prep", format!("qkv is {t}×{width}")));
        }
        let dtype = a.qkv.dtype();
        let func = match dtype {
            DType::F32 => &self.qkv_prep_f32,
            DType::BF16 => &self.qkv_prep_bf16,
            other => return Err(err("qkv_prep", format!("dtype {other:?}"))),
        };
        for c in [a.k_cache, a.v_cache] {
            if c.dtype() != dtype {
                return Err(err("qkv_prep", "cache dtype differs from activations"));
            }
        }
        if q_out.dims2()? != (t, a.n_head * a.head_dim) || q_out.dtype() != dtype {
            return Err(err("qkv_prep", "output buffer shape"));
        }
        let qkv = a.qkv.contiguous()?;
        let s = &self.stream;
        let (qn, kn) = match a.qk_norm {
            Some((q, k)) => (Some(q), Some(k)),
            None => (None, None),
        };
        let args = [
            ptr(Some(&qkv), s)?,
            ptr(a.bias, s)?,
            ptr(qn, s)?,
            ptr(kn, s)?,
            ptr(Some(a.cos), s)?,
            ptr(Some(a.sin), s)?,
            ptr(Some(a.positions), s)?,
            ptr(Some(a.slots), s)?,
            ptr(Some(q_out), s)?,
            ptr(Some(a.k_cache), s)?,
            ptr(Some(a.v_cache), s)?,
        ];
        let ints = [
            as_i32(a.n_head, "n_head")?,
            as_i32(a.n_kv_head, "n_kv_head")?,
            as_i32(a.head_dim, "head_dim")?,
            as_i32(a.rope_dims, "rope_dims")?,
            i32::from(a.halves),
        ];
        let mut b = self.stream.launch_builder(func);
        for p in &args[..4] {
            b.arg(p);
        }
        b.arg(&a.eps);
        for p in &args[4..] {
            b.arg(p);
        }
        for i in &ints {
            b.arg(i);
        }
        let cfg = LaunchConfig {
            grid_dim: (as_u32(t, "tokens")?, as_u32(heads, "heads")?, 1),
            block_dim: (64, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: the arguments match the kernel's signature (kernels.cu); every pointer is a
        // live, contiguous tensor of the checked dtype and size; the launch is ordered on
        // candle's stream after the ops that produced its inputs.
        unsafe { b.launch(cfg) }.map_err(|e| err("qkv_prep launch", e))?;
        Ok(())
    }

    /// Runs `add_rms_norm` over the rows of `x` (`[rows, n]`): `x += y` in place (when `y` is
    /// given), then `h = rms_norm(x) · alpha`. `x` must be a tensor no other holds a view of.
    pub(crate) fn add_rms_norm(
        &self,
        x: &Tensor,
        y: Option<&Tensor>,
        alpha: &Tensor,
        eps: f32,
        h: &Tensor,
    ) -> Result<(), EngineError> {
        let (rows, n) = x.dims2()?;
        let dtype = x.dtype();
        let same = |t: &Tensor| t.dims2().ok() == Some((rows, n)) && t.dtype() == dtype;
        if !same(h) || y.is_some_and(|y| !same(y)) || alpha.dims1()? != n || alpha.dtype() != dtype
        {
            return Err(err("add_rms_norm", "shapes or dtypes differ"));
        }
        let func = match dtype {
            DType::F32 => &self.norm_f32,
            DType::BF16 => &self.norm_bf16,
            other => return Err(err("add_rms_norm", format!("dtype {other:?}"))),
        };
        if rows == 0 {
            return Ok(());
        }
        let s = &self.stream;
        let y = y.map(Tensor::contiguous).transpose()?;
        let args = [ptr(Some(x), s)?, ptr(y.as_ref(), s)?, ptr(Some(alpha), s)?];
        let n32 = as_i32(n, "width")?;
        let h_ptr = ptr(Some(h), s)?;
        let mut b = self.stream.launch_builder(func);
        for p in &args {
            b.arg(p);
        }
        b.arg(&eps);
        b.arg(&n32);
        b.arg(&h_ptr);
        let cfg = LaunchConfig {
            grid_dim: (as_u32(rows, "rows")?, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: as in `qkv_prep`; `x`, `y` and `h` are `[rows, n]`, `alpha` is `[n]`.
        unsafe { b.launch(cfg) }.map_err(|e| err("add_rms_norm launch", e))?;
        Ok(())
    }

    /// Runs `gated_act`: `out [rows, ffn] = act(gate) · up` from `gu [rows, 2·ffn]` (gate |
    /// up), SiLU or (gelu) GELU's tanh form.
    pub(crate) fn gated_act(
        &self,
        gu: &Tensor,
        gelu: bool,
        out: &Tensor,
    ) -> Result<(), EngineError> {
        let (rows, two_ffn) = gu.dims2()?;
        let ffn = two_ffn / 2;
        let dtype = gu.dtype();
        if two_ffn % 2 != 0 || out.dims2()? != (rows, ffn) || out.dtype() != dtype {
            return Err(err("gated_act", "shapes or dtypes differ"));
        }
        let func = match dtype {
            DType::F32 => &self.act_f32,
            DType::BF16 => &self.act_bf16,
            other => return Err(err("gated_act", format!("dtype {other:?}"))),
        };
        let total = rows * ffn;
        if total == 0 {
            return Ok(());
        }
        let s = &self.stream;
        let gu = gu.contiguous()?;
        let (gu_ptr, out_ptr) = (ptr(Some(&gu), s)?, ptr(Some(out), s)?);
        let (rows32, ffn32, gelu32) = (as_i32(rows, "rows")?, as_i32(ffn, "ffn")?, i32::from(gelu));
        let mut b = self.stream.launch_builder(func);
        b.arg(&gu_ptr);
        b.arg(&rows32);
        b.arg(&ffn32);
        b.arg(&gelu32);
        b.arg(&out_ptr);
        let cfg = LaunchConfig {
            grid_dim: (as_u32(total.div_ceil(256), "blocks")?, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: as in `qkv_prep`.
        unsafe { b.launch(cfg) }.map_err(|e| err("gated_act launch", e))?;
        Ok(())
    }

    /// Runs `paged_attention` into `a.out` for every token.
    pub(crate) fn attention(&self, a: &Attention<'_>) -> Result<(), EngineError> {
        let (t, _) = self.check(a)?;
        let func = match a.q.dtype() {
            DType::F32 => &self.attention_f32,
            _ => &self.attention_bf16,
        };
        // SAFETY (of the launch): as in `qkv_prep`; `seq` gives every token's chunk, whose
        // block table covers its position.
        self.launch_attention(func, a, a.seq, t, 32, "paged_attention")
    }

    /// Runs `tile_attention` into `a.out` over `n_tiles` tiles (`tiles`: first row, rows,
    /// chunk per tile; rows ≤ [`super::device::TILE_QUERIES`], all of one chunk).
    pub(crate) fn tile_attention(
        &self,
        a: &Attention<'_>,
        tiles: &Tensor,
        n_tiles: usize,
    ) -> Result<(), EngineError> {
        self.check(a)?;
        if a.head_dim > TILE_MAX_HEAD_DIM {
            return Err(err("tile_attention", format!("head size {}", a.head_dim)));
        }
        if n_tiles == 0 {
            return Ok(());
        }
        let func = match a.q.dtype() {
            DType::F32 => &self.tile_f32,
            _ => &self.tile_bf16,
        };
        // SAFETY (of the launch): as in `qkv_prep`; every tile's rows are rows of `q` and `out`
        // of one chunk whose block table covers their positions.
        self.launch_attention(func, a, tiles, n_tiles, 128, "tile_attention")
    }

    /// Launches an attention kernel (both take the same arguments; `index` is the per-token
    /// chunk index or the tile list) over a `(grid_x, n_head)` grid of `threads` threads.
    fn launch_attention(
        &self,
        func: &CudaFunction,
        a: &Attention<'_>,
        index: &Tensor,
        grid_x: usize,
        threads: u32,
        name: &str,
    ) -> Result<(), EngineError> {
        let s = &self.stream;
        let args = [
            ptr(Some(a.q), s)?,
            ptr(Some(a.k_cache), s)?,
            ptr(Some(a.v_cache), s)?,
            ptr(Some(a.positions), s)?,
            ptr(Some(index), s)?,
            ptr(Some(a.tables), s)?,
        ];
        let ints = [
            as_i32(a.max_blocks, "max_blocks")?,
            as_i32(a.block_size, "block_size")?,
            as_i32(a.n_head, "n_head")?,
            as_i32(a.n_kv_head, "n_kv_head")?,
            as_i32(a.head_dim, "head_dim")?,
        ];
        let window = as_i32(a.window.unwrap_or(0), "window")?;
        let out_ptr = ptr(Some(a.out), s)?;
        let mut b = self.stream.launch_builder(func);
        for p in &args {
            b.arg(p);
        }
        for i in &ints {
            b.arg(i);
        }
        b.arg(&a.scale);
        b.arg(&window);
        b.arg(&out_ptr);
        let cfg = LaunchConfig {
            grid_dim: (as_u32(grid_x, "grid")?, as_u32(a.n_head, "heads")?, 1),
            block_dim: (threads, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: the arguments match both kernels' signature (kernels.cu); the callers checked
        // shapes and dtypes (`check`) and what `index` holds.
        unsafe { b.launch(cfg) }.map_err(|e| err(name, e))?;
        Ok(())
    }

    /// Runs `argmax_f32`: the index of each row's largest logit (`logits` `[rows, vocab]` F32;
    /// soft-capped first when `softcap` is given), lowest index on ties, NaN never chosen.
    /// Returns `[rows]` u32 on the device.
    pub(crate) fn argmax(
        &self,
        logits: &Tensor,
        softcap: Option<f32>,
    ) -> Result<Tensor, EngineError> {
        let (rows, vocab) = logits.dims2()?;
        if logits.dtype() != DType::F32 {
            return Err(err("argmax", "logits must be F32"));
        }
        let out = Tensor::zeros(rows, DType::U32, logits.device())?;
        if rows == 0 {
            return Ok(out);
        }
        let s = &self.stream;
        let logits = logits.contiguous()?;
        let (l_ptr, o_ptr) = (ptr(Some(&logits), s)?, ptr(Some(&out), s)?);
        let vocab32 = as_i32(vocab, "vocab")?;
        let cap = softcap.unwrap_or(0.0);
        let mut b = self.stream.launch_builder(&self.argmax);
        b.arg(&l_ptr);
        b.arg(&vocab32);
        b.arg(&cap);
        b.arg(&o_ptr);
        let cfg = LaunchConfig {
            grid_dim: (as_u32(rows, "rows")?, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: as in `qkv_prep`; `logits` is `[rows, vocab]`, `out` `[rows]`.
        unsafe { b.launch(cfg) }.map_err(|e| err("argmax launch", e))?;
        Ok(out)
    }

    /// Checks shapes and dtypes shared by both attention kernels; returns `(T, width)`.
    fn check(&self, a: &Attention<'_>) -> Result<(usize, usize), EngineError> {
        let (t, width) = a.q.dims2()?;
        if width != a.n_head * a.head_dim
            || a.n_kv_head == 0
            || !a.n_head.is_multiple_of(a.n_kv_head)
            || a.out.dims2()? != (t, width)
        {
            return Err(err("attention", format!("q is {t}×{width}")));
        }
        let dtype = a.q.dtype();
        if !matches!(dtype, DType::F32 | DType::BF16)
            || [a.out, a.k_cache, a.v_cache]
                .iter()
                .any(|x| x.dtype() != dtype)
        {
            return Err(err("attention", format!("dtype {dtype:?}")));
        }
        Ok((t, width))
    }
}
