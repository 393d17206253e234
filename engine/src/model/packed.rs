//! Packed quantized weights multiplied with **F32 activations** on the CPU: the kernel behind
//! [`super::WeightFormat::Exact`] for small steps (decode, short chunks) and behind the output
//! head.
//!
//! Why not candle's quantized matmul: its CPU kernels first quantize the activations to 8 bits
//! per 32-value block, which flips SmolLM2's greedy answers and makes results depend on how a
//! prompt was chunked (a cached continuation took a different path than an uncached prefill).
//! Here each weight is dequantized exactly as `QTensor::dequantize` does (`q·d + m` in f32 for
//! Q4_1, `(q−8)·d` for Q4_0, `q·d` for Q8_0; Q4_K is repacked as Q4_1 blocks of 32 with
//! `d' = d·sc`, `m' = −dmin·m` and Q5_0 as Q8_0 blocks, both value for value) right before it is
//! multiplied, so the result equals
//! the dense F32 matmul over the dequantized matrix up to summation order, while the matrix is
//! read at its stored size (0.75 / 0.56 / 1.06 bytes per weight as packed here, versus 4 for
//! F32).
//!
//! Cost of `x [m, k] · Wᵀ` with `W [n, k]`: `O(m · n · k)` multiply-adds; every weight block is
//! unpacked once per group of activation rows (up to 6 with AVX-512, [`ROW_GROUP`] otherwise),
//! so a batch of decode rows (one per sequence) reads the weights about once per group. Work is
//! split over output rows on the rayon pool; memory `O(m · n)` for the output. Kernels:
//! hand-written AVX-512 for Q4_1 and Q8_0 (row-major blocks), AVX2 for Q4_1, Q4_0 and Q8_0
//! (run-time detected; the blocks of 8 weight rows side by side, [`PackedMatrix::block_index`],
//! [`PackedMatrix::for_this_cpu`]), else plain Rust over fixed-size arrays.
//!
//! Measured (docs/benchmarks.md, "worker engine"; `kernel_timing` below): faster than a dense
//! F32 GEMM for small steps (it reads a quarter of the bytes), slower for large ones, hence the
//! dense copy ([`super::gemm`]) for prefill.

use super::gemm::OutPtr;
use candle_core::quantized::{GgmlDType, QTensor};
use rayon::prelude::*;

use crate::EngineError;

/// Values per quantization block (Q4_0, Q4_1, Q8_0).
const QK: usize = 32;
/// Values per K-quant super-block.
const QK_K: usize = 256;
/// Bytes per Q4_K super-block and per Q5_0 block.
const Q4K_BYTES: usize = 144;
const Q5_0_BYTES: usize = 22;

/// Sub-block `j`'s 6-bit scale and min from a K-quant block's 12 packed bytes (ggml's
/// `get_scale_min_k4`).
fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}
/// Activation rows sharing one unpacked weight block.
pub(crate) const ROW_GROUP: usize = 4;
/// Weight rows whose blocks a matrix in tile order keeps side by side
/// ([`PackedMatrix::block_index`]).
pub(super) const TILE_ROWS: usize = 8;
/// Weight rows per tile of the AVX-512 VNNI kernel's layout ([`PackedMatrix::interleaved`]).
pub(super) const VNNI_TILE_ROWS: usize = 16;

/// The block formats this kernel reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Kind {
    /// `q·d + m`, 4-bit `q` in 0..16.
    Q4_1,
    /// `(q − 8)·d`, 4-bit `q`.
    Q4_0,
    /// `q·d`, 8-bit signed `q`.
    Q8_0,
}

/// A `[rows, cols]` matrix in one of the supported block formats, repacked with its scales as
/// f32 (converted exactly from the file's f16).
#[derive(Debug)]
pub(crate) struct PackedMatrix {
    pub(super) kind: Kind,
    rows: usize,
    cols: usize,
    /// Per block, `d`: row-major, or in [`PackedMatrix::block_index`]'s tile order (`tiled`).
    pub(super) scale: Vec<f32>,
    /// Per block, `m` (Q4_1 only; empty otherwise), in the same order as `scale`.
    pub(super) min: Vec<f32>,
    /// Per block, 16 bytes of nibbles (Q4_x: element `j` low nibble, `j + 16` high nibble of
    /// byte `j`) or 32 signed bytes (Q8_0), in the same order as `scale`.
    pub(super) qs: Vec<u8>,
    /// Multiply with 8-bit activations as ggml does ([`super::int8`], `WeightFormat::LlamaCpp`)
    /// instead of F32 ones.
    pub(super) int8_activations: bool,
    /// Weight rows whose blocks lie side by side ([`PackedMatrix::block_index`]): 1 (row-major),
    /// [`TILE_ROWS`] (tile order) or [`VNNI_TILE_ROWS`] (interleaved).
    pub(super) tile_rows: usize,
    /// Within each group of [`VNNI_TILE_ROWS`] side-by-side blocks (tile order), `qs` is
    /// interleaved by 4 bytes: the group's bytes are `[column j][row c][4 bytes]`, so byte `i` of
    /// row `c`'s block lies at `(i / 4) · 64 + c · 4 + i % 4` of the group (Q4: 4 columns, Q8_0:
    /// 8). Scales and mins are as in tile order. The AVX-512 VNNI kernel reads one column of all
    /// sixteen rows as one vector ([`super::int8`]); [`PackedMatrix::block_qs`] reads any layout.
    pub(super) interleaved: bool,
}

/// `[rows, cols]` → `[cols, rows]`, a block of [`TRANSPOSE_ROWS`] source rows at a time: the
/// writes are runs of that many values and the block's rows stay in L1 while they are read
/// across. (Element by element, each write went to another cache line: 15 % of an engine
/// benchmark with `--numerics llama-cpp`, `perf record -e cpu-clock`; that mode's kernels now
/// store `[m, n]` directly, so only the F32 kernels' output comes through here.)
fn transpose(src: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let mut out = vec![0f32; rows * cols];
    for r0 in (0..rows).step_by(TRANSPOSE_ROWS) {
        let r1 = (r0 + TRANSPOSE_ROWS).min(rows);
        for (i, out_row) in out.chunks_exact_mut(rows).enumerate() {
            for (o, r) in out_row[r0..r1].iter_mut().zip(r0..r1) {
                *o = src[r * cols + i];
            }
        }
    }
    out
}

/// Source rows per block of [`transpose`].
const TRANSPOSE_ROWS: usize = 32;

/// Exact f16 → f32 conversion (every f16 is representable in f32).
fn f16_to_f32(h: u16) -> f32 {
    let sign = u32::from(h >> 15) << 31;
    let exp = u32::from((h >> 10) & 0x1f);
    let mant = u32::from(h & 0x3ff);
    match exp {
        0 => {
            // Zero or subnormal: mant · 2^-24, exact in f32.
            let v = mant as f32 * (1.0 / 16_777_216.0);
            if sign != 0 {
                -v
            } else {
                v
            }
        }
        31 => f32::from_bits(sign | 0x7f80_0000 | (mant << 13)),
        _ => f32::from_bits(sign | ((exp + 112) << 23) | (mant << 13)),
    }
}

impl PackedMatrix {
    /// Repacks a `[rows, cols]` quantized tensor; `Ok(None)` when its format is not one this
    /// kernel reads (the caller then uses dense F32 weights).
    pub(crate) fn from_qtensor(q: &QTensor) -> Result<Option<Self>, EngineError> {
        let (kind, block_bytes, block_values) = match q.dtype() {
            GgmlDType::Q4_1 => (Kind::Q4_1, 20, QK),
            GgmlDType::Q4_0 => (Kind::Q4_0, 18, QK),
            GgmlDType::Q8_0 => (Kind::Q8_0, 34, QK),
            // Re-expressed losslessly in the kinds above (see `from_q4k` / `from_q5_0`).
            GgmlDType::Q4K => (Kind::Q4_1, Q4K_BYTES, QK_K),
            GgmlDType::Q5_0 => (Kind::Q8_0, Q5_0_BYTES, QK),
            _ => return Ok(None),
        };
        let (rows, cols) = q.shape().dims2()?;
        if cols % block_values != 0 {
            return Ok(None);
        }
        let data = q.data()?;
        let blocks = rows * (cols / block_values);
        if data.len() != blocks * block_bytes {
            return Err(EngineError::Model(format!(
                "{:?} tensor of {rows}×{cols} has {} bytes, expected {}",
                q.dtype(),
                data.len(),
                blocks * block_bytes
            )));
        }
        Ok(Some(match q.dtype() {
            GgmlDType::Q4K => Self::from_q4k(rows, cols, &data),
            GgmlDType::Q5_0 => Self::from_q5_0(rows, cols, &data),
            _ => Self::from_blocks(kind, rows, cols, &data, block_bytes),
        }))
    }

    /// Q4_K (256-value super-blocks: f16 `d` and `dmin`, 12 bytes of 6-bit sub-block scales and
    /// mins, 128 bytes of nibbles) as Q4_1 blocks of 32: candle dequantizes sub-block `j` as
    /// `(d·sc_j)·q − (dmin·m_j)`, which is `q·d' + m'` with `d' = d·sc_j` and `m' = −(dmin·m_j)`
    /// computed once here in the same f32 operations — the same value for every weight.
    fn from_q4k(rows: usize, cols: usize, data: &[u8]) -> Self {
        let subs = data.len() / Q4K_BYTES * (QK_K / QK);
        let mut scale = Vec::with_capacity(subs);
        let mut min = Vec::with_capacity(subs);
        let mut qs = Vec::with_capacity(subs * QK / 2);
        for b in data.chunks_exact(Q4K_BYTES) {
            let d = f16_to_f32(u16::from_le_bytes([b[0], b[1]]));
            let dmin = f16_to_f32(u16::from_le_bytes([b[2], b[3]]));
            let scales = &b[4..16];
            let nibbles = &b[16..Q4K_BYTES];
            for g in 0..QK_K / 64 {
                let q = &nibbles[g * 32..][..32];
                for half in 0..2 {
                    let (sc, m) = scale_min_k4(2 * g + half, scales);
                    scale.push(d * f32::from(sc));
                    min.push(-(dmin * f32::from(m)));
                    let v = |i: usize| if half == 0 { q[i] & 0x0f } else { q[i] >> 4 };
                    for j in 0..QK / 2 {
                        qs.push(v(j) | (v(j + QK / 2) << 4));
                    }
                }
            }
        }
        PackedMatrix {
            kind: Kind::Q4_1,
            rows,
            cols,
            scale,
            min,
            qs,
            int8_activations: false,
            tile_rows: 1,
            interleaved: false,
        }
    }

    /// Q5_0 (32 values: f16 `d`, 4 bytes of high bits, 16 bytes of low nibbles) as Q8_0 blocks:
    /// candle dequantizes `(q5 − 16)·d`, the Q8_0 formula for the signed byte `q5 − 16`.
    fn from_q5_0(rows: usize, cols: usize, data: &[u8]) -> Self {
        let blocks = data.len() / Q5_0_BYTES;
        let mut scale = Vec::with_capacity(blocks);
        let mut qs = Vec::with_capacity(blocks * QK);
        for b in data.chunks_exact(Q5_0_BYTES) {
            scale.push(f16_to_f32(u16::from_le_bytes([b[0], b[1]])));
            let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
            let lo = &b[6..Q5_0_BYTES];
            let value = |j: usize| -> u8 {
                let (nibble, bit) = if j < QK / 2 {
                    (lo[j] & 0x0f, (qh >> j) & 1)
                } else {
                    (lo[j - QK / 2] >> 4, (qh >> j) & 1)
                };
                ((i16::from(nibble | ((bit as u8) << 4)) - 16) as i8) as u8
            };
            for j in 0..QK {
                qs.push(value(j));
            }
        }
        PackedMatrix {
            kind: Kind::Q8_0,
            rows,
            cols,
            scale,
            min: Vec::new(),
            qs,
            int8_activations: false,
            tile_rows: 1,
            interleaved: false,
        }
    }

    /// Several matrices with the same width and format stacked along the rows (fused
    /// projections); `Ok(None)` when any is unsupported or the formats differ.
    pub(crate) fn stacked(parts: &[&QTensor]) -> Result<Option<Self>, EngineError> {
        let mut out: Option<PackedMatrix> = None;
        for q in parts {
            let Some(p) = Self::from_qtensor(q)? else {
                return Ok(None);
            };
            match &mut out {
                None => out = Some(p),
                Some(o) => {
                    if o.kind != p.kind || o.cols != p.cols {
                        return Ok(None);
                    }
                    o.rows += p.rows;
                    o.scale.extend_from_slice(&p.scale);
                    o.min.extend_from_slice(&p.min);
                    o.qs.extend_from_slice(&p.qs);
                }
            }
        }
        Ok(out)
    }

    fn from_blocks(kind: Kind, rows: usize, cols: usize, data: &[u8], block_bytes: usize) -> Self {
        let blocks = data.len() / block_bytes;
        let q_bytes = if kind == Kind::Q8_0 { QK } else { QK / 2 };
        let mut scale = Vec::with_capacity(blocks);
        let mut min = Vec::with_capacity(if kind == Kind::Q4_1 { blocks } else { 0 });
        let mut qs = Vec::with_capacity(blocks * q_bytes);
        for b in data.chunks_exact(block_bytes) {
            scale.push(f16_to_f32(u16::from_le_bytes([b[0], b[1]])));
            let q_start = if kind == Kind::Q4_1 {
                min.push(f16_to_f32(u16::from_le_bytes([b[2], b[3]])));
                4
            } else {
                2
            };
            qs.extend_from_slice(&b[q_start..q_start + q_bytes]);
        }
        PackedMatrix {
            kind,
            rows,
            cols,
            scale,
            min,
            qs,
            int8_activations: false,
            tile_rows: 1,
            interleaved: false,
        }
    }

    /// This matrix multiplied with 8-bit activations, ggml's arithmetic ([`super::int8`]), with
    /// its blocks in tile order (the int8 kernels read them so), interleaved where this CPU runs
    /// the AVX-512 VNNI kernel.
    pub(crate) fn with_int8_activations(self) -> Self {
        let vnni = super::int8::vnni_available();
        self.with_int8_layout(vnni)
    }

    /// [`Self::with_int8_activations`] with the layout chosen: tile order, and `interleaved`
    /// ([`PackedMatrix::interleaved`]) or not.
    pub(super) fn with_int8_layout(self, interleaved: bool) -> Self {
        let mut p = if interleaved {
            self.into_tile_order(VNNI_TILE_ROWS).into_interleaved()
        } else {
            self.into_tile_order(TILE_ROWS)
        };
        p.int8_activations = true;
        p
    }

    /// Bytes of one block's quantized values: 16 (Q4) or 32 (Q8_0).
    fn q_bytes(&self) -> usize {
        match self.kind {
            Kind::Q4_1 | Kind::Q4_0 => 16,
            Kind::Q8_0 => QK,
        }
    }

    /// The tile-ordered blocks' values interleaved by 4 bytes ([`PackedMatrix::interleaved`]).
    fn into_interleaved(mut self) -> Self {
        assert_eq!(
            self.tile_rows, VNNI_TILE_ROWS,
            "interleaving works on 16-row tiles"
        );
        if self.interleaved {
            return self;
        }
        let q_bytes = self.q_bytes();
        let group = VNNI_TILE_ROWS * q_bytes;
        let mut out = vec![0u8; self.qs.len()];
        for (src, dst) in self.qs.chunks_exact(group).zip(out.chunks_exact_mut(group)) {
            for (c, block) in src.chunks_exact(q_bytes).enumerate() {
                for (j, column) in block.chunks_exact(4).enumerate() {
                    dst[j * VNNI_TILE_ROWS * 4 + c * 4..][..4].copy_from_slice(column);
                }
            }
        }
        self.qs = out;
        self.interleaved = true;
        self
    }

    /// The quantized values of the block at `blk` ([`PackedMatrix::block_index`]) in their
    /// file order, whatever the layout: the first 16 bytes (Q4) or all 32 (Q8_0).
    #[inline(always)]
    pub(super) fn block_qs(&self, blk: usize) -> [u8; QK] {
        let q_bytes = self.q_bytes();
        let mut out = [0u8; QK];
        if self.interleaved {
            let t = VNNI_TILE_ROWS;
            let group = &self.qs[(blk / t) * t * q_bytes..][..t * q_bytes];
            let c = blk % t;
            for (j, column) in out[..q_bytes].chunks_exact_mut(4).enumerate() {
                column.copy_from_slice(&group[j * t * 4 + c * 4..][..4]);
            }
        } else {
            out[..q_bytes].copy_from_slice(&self.qs[blk * q_bytes..][..q_bytes]);
        }
        out
    }

    /// This matrix laid out for the kernel that will multiply it on this CPU: row-major for the
    /// AVX-512 F32 kernel, else tile order ([`PackedMatrix::block_index`]), which the AVX2
    /// kernels read as one sequential stream per tile of weight rows (row-major, a tile reads as
    /// many streams as it has rows; measured in docs/benchmarks.md).
    pub(crate) fn for_this_cpu(self) -> Self {
        if self.avx512_f32_kernel() {
            self
        } else {
            self.into_tile_order(TILE_ROWS)
        }
    }

    /// Whether the blocks are in tile order (of any height).
    pub(super) fn tiled(&self) -> bool {
        self.tile_rows > 1
    }

    /// Whether [`PackedMatrix::matmul`] runs the AVX-512 F32 kernel for this matrix on this CPU
    /// (row-major blocks — int8-activation matrices are always tiled — and not Q4_0).
    fn avx512_f32_kernel(&self) -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            !self.tiled()
                && self.kind != Kind::Q4_0
                && std::arch::is_x86_feature_detected!("avx512f")
                && std::arch::is_x86_feature_detected!("fma")
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            false
        }
    }

    /// The blocks reordered so that those of `t` consecutive weight rows at one block position
    /// lie side by side ([`PackedMatrix::block_index`]): values, scales and mins.
    fn into_tile_order(mut self, t: usize) -> Self {
        assert!(!self.tiled(), "the blocks are row-major before tiling");
        let nb = self.cols / QK;
        let padded = self.rows.div_ceil(t) * t * nb;
        let tiled_index = |blk: usize| (blk / nb / t) * t * nb + (blk % nb) * t + (blk / nb) % t;
        let tiled = |row_major: &[f32]| {
            let mut out = vec![0f32; padded];
            for (blk, &v) in row_major.iter().enumerate() {
                out[tiled_index(blk)] = v;
            }
            out
        };
        self.scale = tiled(&self.scale);
        if self.kind == Kind::Q4_1 {
            self.min = tiled(&self.min);
        }
        let q_bytes = self.q_bytes();
        let mut qs = vec![0u8; padded * q_bytes];
        for (blk, q) in self.qs.chunks_exact(q_bytes).enumerate() {
            qs[tiled_index(blk) * q_bytes..][..q_bytes].copy_from_slice(q);
        }
        self.qs = qs;
        self.tile_rows = t;
        self
    }

    /// Where block `b` of weight row `r` lies (its scale, min and quantized values, in block
    /// units): with `t` = [`PackedMatrix::tile_rows`], `(r / t) · t · nb + b · t + r % t` — `r ·
    /// nb + b` when row-major (`t` = 1); in tile order the blocks of weight rows `tg..tg + t` at
    /// block position `b` are contiguous (rows padded to a multiple of `t` with zeros).
    #[inline(always)]
    pub(super) fn block_index(&self, r: usize, b: usize) -> usize {
        let nb = self.cols / QK;
        let t = self.tile_rows;
        (r / t) * t * nb + b * t + r % t
    }

    /// How far apart consecutive blocks of one weight row lie: `block_index(r, b)` is
    /// `block_index(r, 0) + b · block_step()` in every layout.
    #[inline(always)]
    pub(super) fn block_step(&self) -> usize {
        self.tile_rows
    }

    /// Output width (`rows` of the weight matrix).
    pub(crate) fn rows(&self) -> usize {
        self.rows
    }

    /// Input width.
    pub(crate) fn cols(&self) -> usize {
        self.cols
    }

    /// Dequantizes block `block` (row-major block index) into `out`, exactly as candle does.
    #[inline(always)]
    fn dequant_block(&self, block: usize, out: &mut [f32; QK]) {
        let nb = self.cols / QK;
        let at = self.block_index(block / nb, block % nb);
        let d = self.scale[at];
        let q = self.block_qs(at);
        match self.kind {
            Kind::Q4_1 => {
                let m = self.min[at];
                for j in 0..16 {
                    out[j] = f32::from(q[j] & 0x0f) * d + m;
                    out[j + 16] = f32::from(q[j] >> 4) * d + m;
                }
            }
            Kind::Q4_0 => {
                for j in 0..16 {
                    out[j] = f32::from(i16::from(q[j] & 0x0f) - 8) * d;
                    out[j + 16] = f32::from(i16::from(q[j] >> 4) - 8) * d;
                }
            }
            Kind::Q8_0 => {
                for j in 0..QK {
                    out[j] = f32::from(q[j] as i8) * d;
                }
            }
        }
    }

    /// `x [m, cols] · Wᵀ → [m, rows]` (row-major): F32 activations, or 8-bit ones when built
    /// [`Self::with_int8_activations`].
    pub(crate) fn matmul(&self, x: &[f32], m: usize) -> Result<Vec<f32>, EngineError> {
        if x.len() != m * self.cols {
            return Err(EngineError::Tensor(format!(
                "packed matmul: input has {} values, expected {m}×{}",
                x.len(),
                self.cols
            )));
        }
        let n = self.rows;
        let threads = rayon::current_num_threads().max(1);
        // A multiple of every tile width (2, 3, 4, 8 weight rows; 16 in the VNNI layout), so
        // that tasks start on tile boundaries.
        let unit = if self.tile_rows == VNNI_TILE_ROWS {
            48
        } else {
            24
        };
        let rows_per_task = n.div_ceil(threads * 4).clamp(unit, 240).div_ceil(unit) * unit;
        if self.int8_activations {
            // With 8-bit activations ([`super::int8`]) each row is quantized once, before the
            // split, and the kernels store `[m, n]` directly: each task writes its weight rows'
            // columns of every activation row.
            let xq = super::int8::quantize(x, self.kind == Kind::Q4_1);
            let mut out = vec![0f32; m * n];
            let base = OutPtr::new(&mut out);
            (0..n.div_ceil(rows_per_task))
                .into_par_iter()
                .for_each(|task| {
                    let first = task * rows_per_task;
                    let rows = rows_per_task.min(n - first);
                    let dst = super::int8::Out {
                        // SAFETY: `first < n`: inside `out`.
                        base: unsafe { base.get().add(first) },
                        stride: n,
                    };
                    // SAFETY: `dst` covers columns `first .. first + rows` of the `m` rows of
                    // `out` (`[m, n]`), which no other task writes; `out` outlives the loop.
                    unsafe { super::int8::rows_into_strided(self, &xq, m, first, rows, dst) };
                });
            return Ok(out);
        }
        // Transposed output [n, m]: each task owns a contiguous run of weight rows.
        let mut out_t = vec![0f32; n * m];
        out_t
            .par_chunks_mut(rows_per_task * m)
            .enumerate()
            .for_each(|(task, dst)| self.rows_into(x, m, task * rows_per_task, dst));
        if m == 1 {
            return Ok(out_t);
        }
        Ok(transpose(&out_t, n, m))
    }

    /// Fills `dst` (`[rows, m]`, starting at weight row `first`).
    fn rows_into(&self, x: &[f32], m: usize, first: usize, dst: &mut [f32]) {
        #[cfg(target_arch = "x86_64")]
        {
            if self.avx512_f32_kernel() {
                // SAFETY: the CPU supports AVX-512F and FMA (checked just above); slice bounds
                // are checked inside before any raw load.
                unsafe { avx512::rows_into(self, x, m, first, dst) };
                return;
            }
            if avx2::available() {
                // SAFETY: the CPU supports AVX2 and FMA (checked just above); slice bounds are
                // checked inside before any raw load.
                unsafe { avx2::rows_into(self, x, m, first, dst) };
                return;
            }
        }
        self.rows_into_portable(x, m, first, dst);
    }

    /// The plain-Rust loop (CPUs without AVX2).
    fn rows_into_portable(&self, x: &[f32], m: usize, first: usize, dst: &mut [f32]) {
        let nb = self.cols / QK;
        let mut w = [0f32; QK];
        for (i, out_row) in dst.chunks_exact_mut(m).enumerate() {
            let r = first + i;
            let mut g = 0;
            while g < m {
                let rows = (m - g).min(ROW_GROUP);
                let mut acc = [[0f32; 16]; ROW_GROUP];
                for b in 0..nb {
                    self.dequant_block(r * nb + b, &mut w);
                    for (a, acc_r) in acc.iter_mut().enumerate().take(rows) {
                        let xb = &x[(g + a) * self.cols + b * QK..][..QK];
                        for j in 0..16 {
                            acc_r[j] += w[j] * xb[j];
                        }
                        for j in 0..16 {
                            acc_r[j] += w[j + 16] * xb[j + 16];
                        }
                    }
                }
                for (a, acc_r) in acc.iter().enumerate().take(rows) {
                    let mut s = [0f32; 4];
                    for k in 0..4 {
                        s[k] = (acc_r[k] + acc_r[k + 4]) + (acc_r[k + 8] + acc_r[k + 12]);
                    }
                    out_row[g + a] = (s[0] + s[2]) + (s[1] + s[3]);
                }
                g += rows;
            }
        }
    }
}

/// Hand-written AVX-512 kernels for Q4_1 and Q8_0, register-tiled: a tile of `R` activation
/// rows × `C` weight rows keeps `R·C` 16-lane accumulators, so every dequantized weight block
/// is used `R` times and every loaded activation vector `C` times, and the `R·C` independent
/// FMA chains hide the FMA latency (one chain per tile was latency-bound: 3.4 GMAC/s for one
/// activation row). Dequantization is exactly candle's (`q·d + m` with separate rounding, `q·d`
/// for Q8_0): Q4_1 builds the 16 possible values of a block once (`iota·d + m`) and looks the
/// nibbles up with a lane permute. Tiles (R × C): 6 × 2, 4 × 3, 2 × 4, 1 × 4. One activation
/// row is bound by dequantization (≈ 10 vector µops per 32-weight block): two rows cost the
/// same time as one (`kernel_timing`).
#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    use super::{Kind, PackedMatrix, QK};

    /// A block format: how one 32-value block is dequantized into two 16-lane halves.
    trait Format {
        /// Elements `0..16` and `16..32` of block `blk`.
        ///
        /// # Safety
        /// AVX-512F available; `blk` is a valid block index of `p` (not checked).
        unsafe fn block(p: &PackedMatrix, blk: usize) -> (__m512, __m512);
    }

    struct Q41;
    struct Q80;

    impl Format for Q41 {
        #[inline(always)]
        unsafe fn block(p: &PackedMatrix, blk: usize) -> (__m512, __m512) {
            let iota = _mm512_setr_ps(
                0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0, 12.0, 13.0, 14.0,
                15.0,
            );
            let d = _mm512_set1_ps(*p.scale.get_unchecked(blk));
            let mn = _mm512_set1_ps(*p.min.get_unchecked(blk));
            // The 16 values a nibble can stand for, rounded as candle rounds `q·d + m`.
            let table = _mm512_add_ps(_mm512_mul_ps(iota, d), mn);
            let q = _mm_loadu_si128(p.qs.as_ptr().add(blk * 16) as *const __m128i);
            let b = _mm512_cvtepu8_epi32(q);
            // vpermps reads only the low 4 bits of each index: the low nibble needs no mask.
            (
                _mm512_permutexvar_ps(b, table),
                _mm512_permutexvar_ps(_mm512_srli_epi32::<4>(b), table),
            )
        }
    }

    impl Format for Q80 {
        #[inline(always)]
        unsafe fn block(p: &PackedMatrix, blk: usize) -> (__m512, __m512) {
            let d = _mm512_set1_ps(*p.scale.get_unchecked(blk));
            let base = p.qs.as_ptr().add(blk * QK);
            let q0 = _mm512_cvtepi8_epi32(_mm_loadu_si128(base as *const __m128i));
            let q1 = _mm512_cvtepi8_epi32(_mm_loadu_si128(base.add(16) as *const __m128i));
            (
                _mm512_mul_ps(_mm512_cvtepi32_ps(q0), d),
                _mm512_mul_ps(_mm512_cvtepi32_ps(q1), d),
            )
        }
    }

    /// `R` activation rows from `x` (row stride `cols`) against weight rows `r0..r0 + C`;
    /// result `(r0 + c, a)` goes to `dst[(r0 + c − first)·m + a]` (`dst` already offset to the
    /// first activation row of the tile).
    #[inline(always)]
    unsafe fn tile<F: Format, const R: usize, const C: usize>(
        p: &PackedMatrix,
        r0: usize,
        x: *const f32,
        dst: *mut f32,
        m: usize,
    ) {
        let nb = p.cols / QK;
        let mut acc = [[_mm512_setzero_ps(); R]; C];
        for b in 0..nb {
            for (c, acc_c) in acc.iter_mut().enumerate() {
                let (w0, w1) = F::block(p, (r0 + c) * nb + b);
                for (a, acc_ca) in acc_c.iter_mut().enumerate() {
                    let xa = x.add(a * p.cols + b * QK);
                    *acc_ca = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xa), *acc_ca);
                    *acc_ca = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xa.add(16)), *acc_ca);
                }
            }
        }
        for (c, acc_c) in acc.iter().enumerate() {
            for (a, acc_ca) in acc_c.iter().enumerate() {
                *dst.add(c * m + a) = _mm512_reduce_add_ps(*acc_ca);
            }
        }
    }

    /// All weight rows of the task against activation rows `g..g + R`, `C` weight rows at a
    /// time (single rows for the remainder).
    #[inline(always)]
    unsafe fn sweep<F: Format, const R: usize, const C: usize>(
        p: &PackedMatrix,
        x: &[f32],
        m: usize,
        g: usize,
        first: usize,
        n_rows: usize,
        dst: &mut [f32],
    ) {
        let xg = x.as_ptr().add(g * p.cols);
        let out = dst.as_mut_ptr().add(g);
        let mut i = 0;
        while i + C <= n_rows {
            tile::<F, R, C>(p, first + i, xg, out.add(i * m), m);
            i += C;
        }
        while i < n_rows {
            tile::<F, R, 1>(p, first + i, xg, out.add(i * m), m);
            i += 1;
        }
    }

    #[inline(always)]
    unsafe fn rows_into_format<F: Format>(
        p: &PackedMatrix,
        x: &[f32],
        m: usize,
        first: usize,
        dst: &mut [f32],
    ) {
        let n_rows = dst.len() / m;
        // Activation rows outer (a group of up to 6 rows, ≤ 6 · cols floats, stays close),
        // weight rows inner (the task's rows stay in L2).
        let mut g = 0;
        while g < m {
            let left = m - g;
            let step = if left >= 6 {
                sweep::<F, 6, 2>(p, x, m, g, first, n_rows, dst);
                6
            } else if left >= 4 {
                sweep::<F, 4, 3>(p, x, m, g, first, n_rows, dst);
                4
            } else if left >= 2 {
                sweep::<F, 2, 4>(p, x, m, g, first, n_rows, dst);
                2
            } else {
                sweep::<F, 1, 4>(p, x, m, g, first, n_rows, dst);
                1
            };
            g += step;
        }
    }

    /// Fills `dst` (`[rows, m]` from weight row `first`).
    ///
    /// # Safety
    /// The CPU must support AVX-512F and FMA; `x.len() == m · cols`, `first + dst.len() / m`
    /// at most `rows` (checked here).
    #[target_feature(enable = "avx512f,fma")]
    pub(super) unsafe fn rows_into(
        p: &PackedMatrix,
        x: &[f32],
        m: usize,
        first: usize,
        dst: &mut [f32],
    ) {
        if m == 0 {
            return;
        }
        let n_rows = dst.len() / m;
        assert!(!p.tiled(), "the AVX-512 kernel reads row-major blocks");
        assert!(
            x.len() == m * p.cols
                && dst.len() == n_rows * m
                && first + n_rows <= p.rows
                && p.kind != Kind::Q4_0
        );
        match p.kind {
            Kind::Q4_1 => rows_into_format::<Q41>(p, x, m, first, dst),
            _ => rows_into_format::<Q80>(p, x, m, first, dst),
        }
    }
}

/// The same tiling with 8-lane AVX2 registers, for CPUs without AVX-512 (AMD Zen 1–3, Intel
/// client cores), for Q4_1, Q4_0 and Q8_0. A block is dequantized into four 8-lane vectors
/// with candle's values (`q·d + m` as one fused multiply-add — the same value, since `q·d` is
/// exact; `(q − 8)·d`; `q·d`; `avx2_dequantization_equals_candles`), computed
/// directly (a 16-entry table lookup costs more µops with 8-lane permutes). Tiles (R × C):
/// 8 × 1, 4 × 2, 2 × 4, 1 × 4 — at most 8 accumulators plus the block's 4 vectors in the 16
/// registers. Before this the plain-Rust loop ran there at about a sixth of the speed
/// (docs/benchmarks.md "AVX2").
#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::{Kind, PackedMatrix, QK};
    pub(super) use crate::model::simd::avx2::available;
    use crate::model::simd::avx2::hsum;

    /// A block format: how one 32-value block is dequantized into four 8-lane vectors.
    trait Format {
        /// Elements `8i..8i + 8` of block `blk`, `i` in 0..4.
        ///
        /// # Safety
        /// AVX2 available; `blk` is a valid block index of `p` (not checked).
        unsafe fn block(p: &PackedMatrix, blk: usize) -> [__m256; 4];
    }

    struct Q41;
    struct Q40;
    struct Q80;

    /// The 32 nibbles of a Q4 block as four vectors of 8 integers (low nibbles are elements
    /// 0..16, high ones 16..32): each 8 bytes zero-extended once, then masked or shifted.
    #[inline(always)]
    unsafe fn nibbles(p: &PackedMatrix, blk: usize) -> [__m256i; 4] {
        let base = p.qs.as_ptr().add(blk * 16);
        let b0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(base as *const __m128i));
        let b1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(base.add(8) as *const __m128i));
        let mask = _mm256_set1_epi32(0x0f);
        [
            _mm256_and_si256(b0, mask),
            _mm256_and_si256(b1, mask),
            _mm256_srli_epi32::<4>(b0),
            _mm256_srli_epi32::<4>(b1),
        ]
    }

    impl Format for Q41 {
        #[inline(always)]
        unsafe fn block(p: &PackedMatrix, blk: usize) -> [__m256; 4] {
            let d = _mm256_set1_ps(*p.scale.get_unchecked(blk));
            let mn = _mm256_set1_ps(*p.min.get_unchecked(blk));
            // No closures here: a closure is compiled without the caller's target features,
            // so the intrinsics in it would become calls.
            let q = nibbles(p, blk);
            let mut out = [_mm256_setzero_ps(); 4];
            // One fused multiply-add gives candle's two roundings bit for bit: `q·d` is exact
            // in f32 (a 4-bit `q` times a `d` of at most 17 significant bits: an f16, or for
            // repacked Q4_K an f16 times a 6-bit scale), so `fl(fl(q·d) + m) = fl(q·d + m)`.
            for (o, qi) in out.iter_mut().zip(q) {
                *o = _mm256_fmadd_ps(_mm256_cvtepi32_ps(qi), d, mn);
            }
            out
        }
    }

    impl Format for Q40 {
        #[inline(always)]
        unsafe fn block(p: &PackedMatrix, blk: usize) -> [__m256; 4] {
            let d = _mm256_set1_ps(*p.scale.get_unchecked(blk));
            let eight = _mm256_set1_epi32(8);
            let q = nibbles(p, blk);
            let mut out = [_mm256_setzero_ps(); 4];
            for (o, qi) in out.iter_mut().zip(q) {
                *o = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(qi, eight)), d);
            }
            out
        }
    }

    impl Format for Q80 {
        #[inline(always)]
        unsafe fn block(p: &PackedMatrix, blk: usize) -> [__m256; 4] {
            let d = _mm256_set1_ps(*p.scale.get_unchecked(blk));
            let base = p.qs.as_ptr().add(blk * QK);
            let mut out = [_mm256_setzero_ps(); 4];
            for (i, o) in out.iter_mut().enumerate() {
                let q = _mm_loadl_epi64(base.add(8 * i) as *const __m128i);
                *o = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), d);
            }
            out
        }
    }

    /// As the AVX-512 `tile`: `R` activation rows against weight rows `r0..r0 + C`.
    #[inline(always)]
    unsafe fn tile<F: Format, const R: usize, const C: usize>(
        p: &PackedMatrix,
        r0: usize,
        x: *const f32,
        dst: *mut f32,
        m: usize,
    ) {
        let nb = p.cols / QK;
        let mut acc = [[_mm256_setzero_ps(); R]; C];
        // Each weight row's first block; block `b` lies `b · step` further (either layout).
        let mut first_block = [0usize; C];
        for (c, f) in first_block.iter_mut().enumerate() {
            *f = p.block_index(r0 + c, 0);
        }
        let step = p.block_step();
        for b in 0..nb {
            for (c, acc_c) in acc.iter_mut().enumerate() {
                let w = F::block(p, first_block[c] + b * step);
                for (a, acc_ca) in acc_c.iter_mut().enumerate() {
                    let xa = x.add(a * p.cols + b * QK);
                    for (i, wi) in w.iter().enumerate() {
                        *acc_ca = _mm256_fmadd_ps(*wi, _mm256_loadu_ps(xa.add(8 * i)), *acc_ca);
                    }
                }
            }
        }
        for (c, acc_c) in acc.iter().enumerate() {
            for (a, acc_ca) in acc_c.iter().enumerate() {
                *dst.add(c * m + a) = hsum(*acc_ca);
            }
        }
    }

    #[inline(always)]
    unsafe fn sweep<F: Format, const R: usize, const C: usize>(
        p: &PackedMatrix,
        x: &[f32],
        m: usize,
        g: usize,
        first: usize,
        n_rows: usize,
        dst: &mut [f32],
    ) {
        let xg = x.as_ptr().add(g * p.cols);
        let out = dst.as_mut_ptr().add(g);
        let mut i = 0;
        while i + C <= n_rows {
            tile::<F, R, C>(p, first + i, xg, out.add(i * m), m);
            i += C;
        }
        while i < n_rows {
            tile::<F, R, 1>(p, first + i, xg, out.add(i * m), m);
            i += 1;
        }
    }

    #[inline(always)]
    unsafe fn rows_into_format<F: Format>(
        p: &PackedMatrix,
        x: &[f32],
        m: usize,
        first: usize,
        dst: &mut [f32],
    ) {
        let n_rows = dst.len() / m;
        let mut g = 0;
        while g < m {
            let left = m - g;
            g += if left >= 8 {
                sweep::<F, 8, 1>(p, x, m, g, first, n_rows, dst);
                8
            } else if left >= 4 {
                sweep::<F, 4, 2>(p, x, m, g, first, n_rows, dst);
                4
            } else if left >= 2 {
                sweep::<F, 2, 4>(p, x, m, g, first, n_rows, dst);
                2
            } else {
                sweep::<F, 1, 4>(p, x, m, g, first, n_rows, dst);
                1
            };
        }
    }

    /// Block `blk`'s 32 values as this kernel dequantizes them (for the tests).
    ///
    /// # Safety
    /// AVX2 and FMA available.
    #[cfg(test)]
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn block_values(p: &PackedMatrix, blk: usize) -> [f32; QK] {
        assert!(blk < p.scale.len());
        let v = match p.kind {
            Kind::Q4_1 => Q41::block(p, blk),
            Kind::Q4_0 => Q40::block(p, blk),
            Kind::Q8_0 => Q80::block(p, blk),
        };
        let mut out = [0f32; QK];
        for (i, vi) in v.iter().enumerate() {
            _mm256_storeu_ps(out.as_mut_ptr().add(8 * i), *vi);
        }
        out
    }

    /// Fills `dst` (`[rows, m]` from weight row `first`).
    ///
    /// # Safety
    /// The CPU must support AVX2 and FMA; `x.len() == m · cols`, `first + dst.len() / m` at
    /// most `rows` (checked here).
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn rows_into(
        p: &PackedMatrix,
        x: &[f32],
        m: usize,
        first: usize,
        dst: &mut [f32],
    ) {
        if m == 0 {
            return;
        }
        let n_rows = dst.len() / m;
        assert!(
            x.len() == m * p.cols
                && dst.len() == n_rows * m
                && first + n_rows <= p.rows
                && !p.interleaved
        );
        match p.kind {
            Kind::Q4_1 => rows_into_format::<Q41>(p, x, m, first, dst),
            Kind::Q4_0 => rows_into_format::<Q40>(p, x, m, first, dst),
            Kind::Q8_0 => rows_into_format::<Q80>(p, x, m, first, dst),
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use candle_core::{Device, Tensor};

    #[test]
    fn blocked_transpose_moves_every_value() {
        for (rows, cols) in [
            (1, 1),
            (1, 7),
            (31, 3),
            (32, 5),
            (33, 1),
            (70, 16),
            (100, 9),
        ] {
            let src: Vec<f32> = (0..rows * cols).map(|v| v as f32).collect();
            let t = transpose(&src, rows, cols);
            for r in 0..rows {
                for c in 0..cols {
                    assert_eq!(
                        t[c * rows + r],
                        src[r * cols + c],
                        "{rows}×{cols} at {r},{c}"
                    );
                }
            }
        }
    }

    /// Deterministic values in [−1, 1) (xorshift), shared by the kernel tests.
    pub(crate) fn rnd_vec(seed: u64, n: usize) -> Vec<f32> {
        let mut s = seed | 1;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                ((s >> 11) as f32 / (1u64 << 53) as f32) * 2.0 - 1.0
            })
            .collect()
    }

    #[test]
    fn f16_conversion_is_exact() {
        assert_eq!(f16_to_f32(0x3c00), 1.0);
        assert_eq!(f16_to_f32(0xc000), -2.0);
        assert_eq!(f16_to_f32(0x0001), 2f32.powi(-24));
        assert_eq!(f16_to_f32(0x7bff), 65504.0);
        assert!(f16_to_f32(0x7c00).is_infinite());
    }

    /// Every format [`PackedMatrix::from_qtensor`] reads (Q4_K and Q5_0 repacked).
    const PACKED_FORMATS: [GgmlDType; 5] = [
        GgmlDType::Q4_1,
        GgmlDType::Q4_0,
        GgmlDType::Q8_0,
        GgmlDType::Q4K,
        GgmlDType::Q5_0,
    ];

    /// The AVX2 kernel dequantizes every block to candle's values bit for bit (its Q4_1 path
    /// uses one fused multiply-add for candle's `q·d + m`, exact because `q·d` is), over
    /// weights spanning nine orders of magnitude, for every format it reads (Q4_K and Q5_0 as
    /// repacked).
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn avx2_dequantization_equals_candles() {
        if !avx2::available() {
            return;
        }
        let (n, k) = (16, 512);
        let scales: Vec<f32> = (0..n).map(|r| 10f32.powi(r as i32 % 9 - 6)).collect();
        let values: Vec<f32> = rnd_vec(0x5a, n * k)
            .iter()
            .enumerate()
            .map(|(i, v)| (v + 0.3) * scales[i / k])
            .collect();
        let w = Tensor::from_vec(values, (n, k), &Device::Cpu).unwrap();
        for dtype in PACKED_FORMATS {
            let q = QTensor::quantize(&w, dtype).unwrap();
            let p = PackedMatrix::from_qtensor(&q).unwrap().unwrap();
            let want: Vec<f32> = q
                .dequantize(&Device::Cpu)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap();
            // Row-major and in tile order (the layout the AVX2 kernels get).
            for p in [
                p.into_tile_order(TILE_ROWS),
                PackedMatrix::from_qtensor(&q).unwrap().unwrap(),
            ] {
                for b in 0..n * k / QK {
                    let at = p.block_index(b / (k / QK), b % (k / QK));
                    // SAFETY: AVX2 and FMA checked above; `at` is a block of `p`.
                    let got = unsafe { avx2::block_values(&p, at) };
                    assert!(
                        got.iter()
                            .zip(&want[b * QK..][..QK])
                            .all(|(g, w)| g.to_bits() == w.to_bits()),
                        "{dtype:?} block {b}: {got:?} vs {:?}",
                        &want[b * QK..][..QK]
                    );
                }
            }
        }
    }

    /// Every layout keeps every block's values where `block_index` and `block_qs` find them:
    /// row-major, tile order and the VNNI kernel's interleaved 16-row tiles (with a cut tile).
    #[test]
    fn every_layout_dequantizes_to_the_same_values() {
        let (n, k) = (21, 128);
        let w = Tensor::from_vec(rnd_vec(0x52, n * k), (n, k), &Device::Cpu).unwrap();
        for dtype in [GgmlDType::Q4_1, GgmlDType::Q4_0, GgmlDType::Q8_0] {
            let q = QTensor::quantize(&w, dtype).unwrap();
            let plain = PackedMatrix::from_qtensor(&q).unwrap().unwrap();
            let layouts = [
                PackedMatrix::from_qtensor(&q)
                    .unwrap()
                    .unwrap()
                    .with_int8_layout(false),
                PackedMatrix::from_qtensor(&q)
                    .unwrap()
                    .unwrap()
                    .with_int8_layout(true),
            ];
            let (mut want, mut got) = ([0f32; QK], [0f32; QK]);
            for layout in &layouts {
                for b in 0..n * k / QK {
                    plain.dequant_block(b, &mut want);
                    layout.dequant_block(b, &mut got);
                    assert_eq!(
                        want, got,
                        "{dtype:?}, {} rows per tile: block {b}",
                        layout.tile_rows
                    );
                }
            }
        }
    }

    /// Q4_K and Q5_0 are re-expressed as Q4_1 and Q8_0 blocks with every weight's value
    /// unchanged: the packed blocks dequantize to candle's values bit for bit.
    #[test]
    fn k_quant_and_q5_0_repacking_keeps_every_value() {
        let (n, k) = (5, 512);
        let w = Tensor::from_vec(rnd_vec(0x51, n * k), (n, k), &Device::Cpu).unwrap();
        for dtype in [GgmlDType::Q4K, GgmlDType::Q5_0] {
            let q = QTensor::quantize(&w, dtype).unwrap();
            let p = PackedMatrix::from_qtensor(&q).unwrap().unwrap();
            let want: Vec<f32> = q
                .dequantize(&Device::Cpu)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap();
            let mut got = Vec::with_capacity(n * k);
            let mut block = [0f32; QK];
            for b in 0..n * k / QK {
                p.dequant_block(b, &mut block);
                got.extend_from_slice(&block);
            }
            let same = got
                .iter()
                .zip(&want)
                .all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "{dtype:?}: repacked values differ from candle's");
        }
    }

    /// The packed kernels equal a dense F32 matmul over candle's dequantized weights (same
    /// weights exactly; only summation order differs) for every supported format and batch
    /// sizes around the row group and tiles, and give each activation row the same bits
    /// whatever rows share its step.
    #[test]
    fn matches_dense_matmul_over_dequantized_weights() {
        let seed = 0x9ac4_u64;
        println!("seed {seed}");
        let (n, k) = (37, 256);
        let w = Tensor::from_vec(rnd_vec(seed, n * k), (n, k), &Device::Cpu).unwrap();
        for dtype in PACKED_FORMATS {
            let q = QTensor::quantize(&w, dtype).unwrap();
            let p = PackedMatrix::from_qtensor(&q).unwrap().unwrap();
            // The same matrix in tile order (what the AVX2 kernels get).
            let tiled = PackedMatrix::from_qtensor(&q)
                .unwrap()
                .unwrap()
                .into_tile_order(TILE_ROWS);
            let deq = q.dequantize(&Device::Cpu).unwrap();
            let x17 = rnd_vec(seed + 17, 17 * k);
            // Every kernel this CPU has, called directly (the AVX2 one on AVX-512 CPUs too):
            // against the dense product, and each row's bits independent of the rows beside it.
            type Kernel = unsafe fn(&PackedMatrix, &[f32], usize, usize, &mut [f32]);
            let mut kernels: Vec<(&str, Kernel, &PackedMatrix)> = Vec::new();
            #[cfg(target_arch = "x86_64")]
            {
                if p.kind != Kind::Q4_0 && std::arch::is_x86_feature_detected!("avx512f") {
                    kernels.push(("avx512", avx512::rows_into, &p));
                }
                if avx2::available() {
                    kernels.push(("avx2", avx2::rows_into, &p));
                    kernels.push(("avx2, tile order", avx2::rows_into, &tiled));
                }
            }
            let portable: Kernel = |p, x, m, first, dst| p.rows_into_portable(x, m, first, dst);
            kernels.push(("portable", portable, &p));
            kernels.push(("portable, tile order", portable, &tiled));
            let mut by_layout: Vec<Vec<f32>> = Vec::new();
            for (name, kernel, p) in &kernels {
                let run = |m: usize| {
                    let mut dst = vec![0f32; n * m];
                    // SAFETY: the CPU has the kernel's features (checked above); shapes match.
                    unsafe { kernel(p, &x17[..m * k], m, 0, &mut dst) };
                    dst
                };
                let all = run(17);
                if name.ends_with("tile order") {
                    // The layout does not change the arithmetic: the row-major run's bits.
                    let row_major = by_layout.last().unwrap();
                    assert!(
                        all.iter()
                            .zip(row_major)
                            .all(|(a, b)| a.to_bits() == b.to_bits()),
                        "{name} {dtype:?}: differs from the row-major layout"
                    );
                }
                by_layout.push(all.clone());
                for m in [1, 2, 3, 4, 5, 8, 9, 12] {
                    let part = run(m);
                    for r in 0..n {
                        for a in 0..m {
                            assert_eq!(
                                part[r * m + a].to_bits(),
                                all[r * 17 + a].to_bits(),
                                "{name} {dtype:?}: row {a} of {m} differs from the same row of 17"
                            );
                        }
                    }
                }
                let want: Vec<f32> = Tensor::from_vec(x17.clone(), (17, k), &Device::Cpu)
                    .unwrap()
                    .matmul(&deq.t().unwrap())
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .to_vec1()
                    .unwrap();
                for r in 0..n {
                    for a in 0..17 {
                        let (got, want) = (all[r * 17 + a], want[a * n + r]);
                        assert!(
                            (got - want).abs() < 1e-4,
                            "{name} {dtype:?}: {got} vs {want}"
                        );
                    }
                }
            }
            for (m, p) in [1, 2, 3, 4, 8, 9, 15, 17]
                .into_iter()
                .flat_map(|m| [(m, &p), (m, &tiled)])
            {
                let x = rnd_vec(seed + m as u64, m * k);
                let got = p.matmul(&x, m).unwrap();
                let xt = Tensor::from_vec(x, (m, k), &Device::Cpu).unwrap();
                let want: Vec<f32> = xt
                    .matmul(&deq.t().unwrap())
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .to_vec1()
                    .unwrap();
                for (a, b) in got.iter().zip(&want) {
                    assert!((a - b).abs() < 1e-4, "{dtype:?} m={m}: {a} vs {b}");
                }
            }
        }
    }

    /// Kernel timing (run on purpose: `cargo test -p engine --lib kernel_timing -- --ignored
    /// --nocapture`): the AVX-512 (where the CPU has it), AVX2 and portable kernels and candle's
    /// F32 matmul alternated in one process on SmolLM2's gate/up shape (`KVGATE_KERNEL_ROWS=98304` for a 42 MB matrix that
    /// does not stay in L2), so machine load affects both alike. Single thread.
    #[cfg(target_arch = "x86_64")]
    #[test]
    #[ignore = "timing: run explicitly with --ignored --nocapture"]
    fn kernel_timing() {
        let (n, k) = match std::env::var("KVGATE_KERNEL_ROWS") {
            Ok(v) => (v.parse().expect("KVGATE_KERNEL_ROWS is a row count"), 576),
            Err(_) => (3072, 576),
        };
        let w = Tensor::from_vec(rnd_vec(5, n * k), (n, k), &Device::Cpu).unwrap();
        let p = PackedMatrix::from_qtensor(&QTensor::quantize(&w, GgmlDType::Q4_1).unwrap())
            .unwrap()
            .unwrap();
        // What AVX2 CPUs get (`PackedMatrix::for_this_cpu`).
        let tiled = PackedMatrix::from_qtensor(&QTensor::quantize(&w, GgmlDType::Q4_1).unwrap())
            .unwrap()
            .unwrap()
            .into_tile_order(TILE_ROWS);
        let wt = w.t().unwrap();
        let have = [
            std::arch::is_x86_feature_detected!("avx512f"),
            avx2::available(),
            avx2::available(),
            true,
            true,
        ];
        for m in [1usize, 2, 4, 8, 16, 32] {
            let x = rnd_vec(6, m * k);
            let xt = Tensor::from_vec(x.clone(), (m, k), &Device::Cpu).unwrap();
            let mut best = [f64::INFINITY; 5];
            for _ in 0..20 {
                let mut dst = vec![0f32; n * m];
                let t = std::time::Instant::now();
                if have[0] {
                    unsafe { avx512::rows_into(&p, &x, m, 0, &mut dst) };
                }
                best[0] = best[0].min(t.elapsed().as_secs_f64());
                let t = std::time::Instant::now();
                if have[1] {
                    unsafe { avx2::rows_into(&tiled, &x, m, 0, &mut dst) };
                }
                best[1] = best[1].min(t.elapsed().as_secs_f64());
                let t = std::time::Instant::now();
                if have[2] {
                    unsafe { avx2::rows_into(&p, &x, m, 0, &mut dst) };
                }
                best[2] = best[2].min(t.elapsed().as_secs_f64());
                let t = std::time::Instant::now();
                p.rows_into_portable(&x, m, 0, &mut dst);
                best[3] = best[3].min(t.elapsed().as_secs_f64());
                let t = std::time::Instant::now();
                let _ = xt.matmul(&wt).unwrap();
                best[4] = best[4].min(t.elapsed().as_secs_f64());
            }
            let gmac = |s: f64| (m * n * k) as f64 / s / 1e9;
            let names = [
                "avx512",
                "avx2 (tile order)",
                "avx2 (row-major)",
                "portable",
                "candle F32",
            ];
            // A kernel the CPU lacks is not run: not printed.
            let line: Vec<String> = names
                .iter()
                .zip(best)
                .zip(have)
                .filter(|(_, have)| *have)
                .map(|(named, _)| named)
                .map(|(name, s)| format!("{name} {:.3} ms ({:.1} GMAC/s)", s * 1e3, gmac(s)))
                .collect();
            println!("m={m}: {}", line.join(", "));
        }
    }

    #[test]
    fn stacking_equals_separate_matrices() {
        let a = Tensor::from_vec(rnd_vec(1, 3 * 64), (3, 64), &Device::Cpu).unwrap();
        let b = Tensor::from_vec(rnd_vec(2, 5 * 64), (5, 64), &Device::Cpu).unwrap();
        let qa = QTensor::quantize(&a, GgmlDType::Q4_1).unwrap();
        let qb = QTensor::quantize(&b, GgmlDType::Q4_1).unwrap();
        let s = PackedMatrix::stacked(&[&qa, &qb]).unwrap().unwrap();
        assert_eq!((s.rows(), s.cols()), (8, 64));
        let x = rnd_vec(3, 64);
        let got = s.matmul(&x, 1).unwrap();
        let mut want = PackedMatrix::from_qtensor(&qa)
            .unwrap()
            .unwrap()
            .matmul(&x, 1)
            .unwrap();
        want.extend(
            PackedMatrix::from_qtensor(&qb)
                .unwrap()
                .unwrap()
                .matmul(&x, 1)
                .unwrap(),
        );
        assert_eq!(got, want);
        let q8 = QTensor::quantize(&b, GgmlDType::Q8_0).unwrap();
        assert!(PackedMatrix::stacked(&[&qa, &q8]).unwrap().is_none());
    }
}
