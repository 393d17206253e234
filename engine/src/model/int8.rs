//! ggml's block products with 8-bit activations, on this crate's packed weights: the fast path of
//! [`super::WeightFormat::LlamaCpp`] for Q4_0, Q4_1, Q8_0 and Q5_0 matrices (candle's port of the
//! same arithmetic is scalar here and ~30× slower).
//!
//! Each activation row is quantized per 32 values exactly as ggml's x86 code does it
//! (`quantize_row_q8_1` / `q8_0` in `ggml-cpu/arch/x86/quants.c`, what llama.cpp runs on every
//! CPU with AVX; `scripts/check-ggml-ops.sh` compares the bits with ggml's own): `d = amax / 127`
//! stored as f16, `q = round(x · (127 / amax))` with ties to even, and for Q8_1 `s = f16(d · Σq)`
//! (candle's `from_float`, ggml's portable reference, uses `1/d`, ties away from zero and an f16
//! product for `s`, which gives other bits). A block's product is then candle's
//! `vec_dot_q4_1_q8_1` / `q4_0_q8_0` / `q8_0_q8_0`: the integer `sumi = Σ w·q` (exact), then
//! `sumf += sumi · d_w · d_a (+ m_w · s_a for Q4_1)` in block order. Every (weight row,
//! activation row) pair is computed by the same sequence of operations whatever the number of
//! rows in the step, so results do not depend on step size, chunking or prefix caching.
//!
//! Cost `O(m · n · k)` integer multiply-adds plus `O(m · k)` for the quantization; weight blocks
//! are unpacked once per tile of 8 weight rows × up to 4 activation rows (the blocks of 8 weight
//! rows are stored side by side, [`PackedMatrix::block_index`]; AVX-512 VNNI CPUs also
//! interleave their bytes, [`PackedMatrix::interleaved`], and run [`vnni`], other AVX2 CPUs
//! [`avx2`]) or per group of [`GROUP`] (the portable loop). [`PackedMatrix::matmul`] splits the work over output rows on
//! the rayon pool as for the F32 kernel.

use super::attention::round_to_f16;
use super::packed::{Kind, PackedMatrix};

/// Values per block.
const QK: usize = 32;
/// Activation rows sharing one unpacked weight block.
const GROUP: usize = 4;

/// Activation rows quantized per block: values, scales and (Q8_1) scaled sums.
pub(crate) struct Quantized {
    q: Vec<i8>,
    d: Vec<f32>,
    s: Vec<f32>,
    /// Per block, the integer `Σq` (the VNNI kernel's Q4_0 products are `Σ n·q − 8·Σq`).
    sums: Vec<i32>,
}

/// Quantizes `m` rows of `k` values (`k` a multiple of [`QK`]); `with_sums` for Q8_1 (the
/// activations of Q4_1 products).
pub(crate) fn quantize(x: &[f32], with_sums: bool) -> Quantized {
    let blocks = x.len() / QK;
    let mut out = Quantized {
        q: vec![0; x.len()],
        d: Vec::with_capacity(blocks),
        s: Vec::with_capacity(if with_sums { blocks } else { 0 }),
        sums: Vec::with_capacity(blocks),
    };
    #[cfg(target_arch = "x86_64")]
    let simd = std::arch::is_x86_feature_detected!("avx2");
    for (xb, qb) in x
        .as_chunks::<QK>()
        .0
        .iter()
        .zip(out.q.as_chunks_mut::<QK>().0)
    {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: AVX2 checked above.
        let (d, sum) = if simd {
            unsafe { quantize_avx2::block(xb, qb) }
        } else {
            quantize_block(xb, qb)
        };
        #[cfg(not(target_arch = "x86_64"))]
        let (d, sum) = quantize_block(xb, qb);
        out.d.push(round_to_f16(d));
        out.sums.push(sum);
        if with_sums {
            out.s.push(round_to_f16(d * sum as f32));
        }
    }
    out
}

/// One block as ggml's x86 `quantize_row_q8_0` / `quantize_row_q8_1` do it (the code llama.cpp
/// runs on every CPU with AVX): `d = amax / 127` (its f16 stored), `q = round(x · (127 / amax))`
/// with ties to even (`_mm256_round_ps`; ggml's portable reference uses `1/d` and ties away
/// from zero, which gives other bits), `as i8` saturating, NaN → 0. Returns the f32 `d` (Q8_1's
/// `s` is `f16(d · Σq)` with it) and `Σq`.
fn quantize_block(xb: &[f32; QK], qb: &mut [i8; QK]) -> (f32, i32) {
    let amax = xb.iter().fold(0f32, |a, v| a.max(v.abs()));
    let d = amax / 127.0;
    let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
    let mut sum = 0i32;
    for (q, &v) in qb.iter_mut().zip(xb) {
        *q = (v * id).round_ties_even() as i8;
        sum += i32::from(*q);
    }
    (d, sum)
}

/// [`quantize_block`] with AVX2, the same bits: ties to even as ggml's `_mm256_round_ps`, NaN to
/// 0 and the saturation of `as i8` by clamping to −128..127 before the conversion. (The scalar
/// rounding is a libm call: 12 % of an engine benchmark with `--numerics llama-cpp`.)
#[cfg(target_arch = "x86_64")]
mod quantize_avx2 {
    use std::arch::x86_64::*;

    use super::QK;

    /// # Safety
    /// AVX2 available.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn block(xb: &[f32; QK], qb: &mut [i8; QK]) -> (f32, i32) {
        let v: [__m256; 4] = std::array::from_fn(|j| _mm256_loadu_ps(xb.as_ptr().add(8 * j)));
        let sign = _mm256_set1_ps(-0.0);
        // `a.max(|v|)` keeps `a` where `v` is NaN; so does `max_ps(|v|, a)`.
        let mut amax = _mm256_setzero_ps();
        for vj in v {
            amax = _mm256_max_ps(_mm256_andnot_ps(sign, vj), amax);
        }
        let mut lanes = [0f32; 8];
        _mm256_storeu_ps(lanes.as_mut_ptr(), amax);
        let amax = lanes.iter().fold(0f32, |a, &v| a.max(v));
        let d = amax / 127.0;
        let id = _mm256_set1_ps(if amax != 0.0 { 127.0 / amax } else { 0.0 });
        let ints: [__m256i; 4] = std::array::from_fn(|j| {
            let y = _mm256_mul_ps(v[j], id);
            let r = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(y);
            // NaN → 0; ±∞ and anything past the range saturate as `as i8` does.
            let r = _mm256_and_ps(r, _mm256_cmp_ps::<_CMP_ORD_Q>(y, y));
            let r = _mm256_min_ps(
                _mm256_max_ps(r, _mm256_set1_ps(-128.0)),
                _mm256_set1_ps(127.0),
            );
            _mm256_cvttps_epi32(r)
        });
        // i32 → i8 in element order: the packs interleave 128-bit halves, the permute undoes it.
        let bytes = _mm256_permutevar8x32_epi32(
            _mm256_packs_epi16(
                _mm256_packs_epi32(ints[0], ints[1]),
                _mm256_packs_epi32(ints[2], ints[3]),
            ),
            _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7),
        );
        _mm256_storeu_si256(qb.as_mut_ptr() as *mut __m256i, bytes);
        let s = _mm256_add_epi32(
            _mm256_add_epi32(ints[0], ints[1]),
            _mm256_add_epi32(ints[2], ints[3]),
        );
        let mut sums = [0i32; 8];
        _mm256_storeu_si256(sums.as_mut_ptr() as *mut __m256i, s);
        (d, sums.iter().sum())
    }
}

/// Fills `dst` (`[m, rows]`, from weight row `first`) from activations quantized by
/// [`quantize`] (the tests' entry; [`PackedMatrix::matmul`] splits the rows over the pool
/// through [`rows_into_strided`]).
#[cfg(test)]
pub(crate) fn rows_into(p: &PackedMatrix, xq: &Quantized, m: usize, first: usize, dst: &mut [f32]) {
    let (out, n_rows) = Out::of(dst, m);
    // SAFETY: `out` covers `dst`, `[m, n_rows]`.
    unsafe { rows_into_strided(p, xq, m, first, n_rows, out) }
}

/// Runs a kernel's activation-row tiles over rows `0..m`: the widest arm that fits (arms in
/// decreasing widths, the last of width 1), `a0` bound to each tile's first row.
macro_rules! row_tiles {
    ($m:expr, $a0:ident, { $($w:literal => $call:expr),+ $(,)? }) => {{
        let m = $m;
        let mut $a0 = 0;
        while $a0 < m {
            let left = m - $a0;
            $(
                if left >= $w {
                    $call;
                    $a0 += $w;
                    continue;
                }
            )+
        }
    }};
}
pub(crate) use row_tiles;

/// Where a kernel call's results go: the result of weight row `first + i` (the call's `i`-th
/// row) and activation row `a` at `base[a · stride + i]` — activation-major, so a tile of
/// weight rows stores each activation row's results as one vector, straight into the
/// `[m, n]` product.
#[derive(Clone, Copy)]
pub(crate) struct Out {
    pub(crate) base: *mut f32,
    pub(crate) stride: usize,
}

impl Out {
    /// `dst` as the `[m, dst.len() / m]` output of its own rows, and that row count.
    #[cfg(test)]
    fn of(dst: &mut [f32], m: usize) -> (Out, usize) {
        let n_rows = dst.len().checked_div(m).unwrap_or(0);
        assert_eq!(n_rows * m, dst.len(), "output is not [m, rows]");
        (
            Out {
                base: dst.as_mut_ptr(),
                stride: n_rows,
            },
            n_rows,
        )
    }

    /// The place of the call's row `i`, activation row `a`.
    ///
    /// # Safety
    /// Inside the output the caller handed over.
    #[inline(always)]
    unsafe fn at(self, i: usize, a: usize) -> *mut f32 {
        self.base.add(a * self.stride + i)
    }

    /// The same output seen from the call's row `i` on.
    ///
    /// # Safety
    /// As [`Out::at`].
    #[inline(always)]
    unsafe fn skip_rows(self, i: usize) -> Out {
        Out {
            base: self.base.add(i),
            stride: self.stride,
        }
    }
}

/// Results of weight rows `first .. first + n_rows` against the `m` activation rows of `xq`
/// into `out`.
///
/// # Safety
/// `out` is valid for writes at `base[a · stride + i]` for every `a < m`, `i < n_rows` (so
/// `stride >= n_rows`), and nothing else touches those places meanwhile.
pub(crate) unsafe fn rows_into_strided(
    p: &PackedMatrix,
    xq: &Quantized,
    m: usize,
    first: usize,
    n_rows: usize,
    out: Out,
) {
    assert!(out.stride >= n_rows || m <= 1);
    // Every kernel gives the scalar loop's bits; the layout says which one reads the matrix.
    #[cfg(target_arch = "x86_64")]
    {
        if p.interleaved && vnni::available() {
            // SAFETY: the CPU has the features the function is compiled for (checked above);
            // the output as the caller promised.
            unsafe { vnni::rows_into_strided(p, xq, m, first, n_rows, out) };
            return;
        }
        if !p.interleaved && std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: as above.
            unsafe { avx2::rows_into_strided(p, xq, m, first, n_rows, out) };
            return;
        }
    }
    // SAFETY: the scalar product needs no CPU feature; the output as promised.
    unsafe { rows_into_with::<Scalar>(p, xq, m, first, n_rows, out) }
}

/// Whether this CPU runs the AVX-512 VNNI kernel ([`PackedMatrix::with_int8_activations`] then
/// interleaves the blocks for it).
pub(crate) fn vnni_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        vnni::available()
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// The same products with AVX2 integer instructions (CPUs without AVX-512 VNNI), register-tiled.
///
/// A block's `sumi` is `maddubs` (unsigned × signed bytes, adjacent pairs to i16: at most
/// 2·128·127, no saturation since ggml's activations stay within ±127) and `madd` with ones to
/// eight i32 — exact, so the same integer as the scalar loop. Signed weights (Q4_0, Q8_0) go
/// through `|w|` and `sign(x, w)`.
///
/// The tile ([`tile`]) is [`TILE_ROWS`] weight rows × `R` activation rows (4, else 2, else 1;
/// 4 measured fastest, `int8_timing`): the eight partial-sum
/// vectors of one activation row against the tile's weight rows are reduced together by a tree of
/// `hadd`s into one vector of eight block sums (one lane per weight row), and the float part —
/// `acc += sumi · d_w · d_a (+ m_w · s_a)` — runs lane-wise, every lane doing the scalar loop's
/// operations in its order ([`rows_into_with`]), so the bits are the scalar loop's (asserted).
/// The weights' scales of the tile's rows are one vector load thanks to the matrix's tile order
/// ([`PackedMatrix::block_index`]). Rows outside whole tiles take the untiled loop
/// ([`rows_into_with`] over [`Avx2`]'s block product).
#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::{rows_into_with, BlockDot, Out, Quantized, QK};
    use crate::model::packed::{Kind, PackedMatrix, TILE_ROWS};

    /// The 32 nibbles of the Q4 block at `blk` ([`PackedMatrix::block_index`]) as bytes in
    /// element order (low nibbles are elements 0..16).
    #[inline(always)]
    unsafe fn q4_nibbles(p: &PackedMatrix, blk: usize) -> __m256i {
        let q = _mm_loadu_si128(p.qs.as_ptr().add(blk * 16) as *const __m128i);
        let mask = _mm_set1_epi8(0x0f);
        let lo = _mm_and_si128(q, mask);
        let hi = _mm_and_si128(_mm_srli_epi16::<4>(q), mask);
        _mm256_set_m128i(hi, lo)
    }

    /// A block format of the tiled kernel.
    trait Format {
        /// Signed weights (the products go through `|w|` and `sign(x, w)`).
        const SIGNED: bool;
        /// Q4_1: `+ m_w · s_a` per block.
        const WITH_MIN: bool;
        /// The sum of 16 products fits in an i16 (4-bit weights: at most 16·15·127 for Q4_1,
        /// 16·8·127 for Q4_0), so the reduction runs on `maddubs`'s i16 pairs without `madd`.
        const I16_SUMS: bool;
        /// The weights of the block at `blk` ([`PackedMatrix::block_index`]) as bytes (signed
        /// unless Q4_1).
        ///
        /// # Safety
        /// AVX2 available; `blk` a valid block of `p` (not checked).
        unsafe fn weights(p: &PackedMatrix, blk: usize) -> __m256i;
    }

    struct Q41;
    struct Q40;
    struct Q80;

    impl Format for Q41 {
        const I16_SUMS: bool = true;
        const SIGNED: bool = false;
        const WITH_MIN: bool = true;
        #[inline(always)]
        unsafe fn weights(p: &PackedMatrix, blk: usize) -> __m256i {
            q4_nibbles(p, blk)
        }
    }

    impl Format for Q40 {
        const I16_SUMS: bool = true;
        const SIGNED: bool = true;
        const WITH_MIN: bool = false;
        #[inline(always)]
        unsafe fn weights(p: &PackedMatrix, blk: usize) -> __m256i {
            _mm256_sub_epi8(q4_nibbles(p, blk), _mm256_set1_epi8(8))
        }
    }

    impl Format for Q80 {
        const I16_SUMS: bool = false;
        const SIGNED: bool = true;
        const WITH_MIN: bool = false;
        #[inline(always)]
        unsafe fn weights(p: &PackedMatrix, blk: usize) -> __m256i {
            _mm256_loadu_si256(p.qs.as_ptr().add(blk * QK) as *const __m256i)
        }
    }

    /// Sixteen i16 sums of adjacent products `w·x` over one block (exact: `maddubs`).
    #[inline(always)]
    unsafe fn pair_products<F: Format>(w: __m256i, x: __m256i) -> __m256i {
        if F::SIGNED {
            _mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(x, w))
        } else {
            _mm256_maddubs_epi16(w, x)
        }
    }

    /// Eight i32 partial sums of `Σ w·x` over one block (exact).
    #[inline(always)]
    unsafe fn products<F: Format>(w: __m256i, x: __m256i) -> __m256i {
        _mm256_madd_epi16(pair_products::<F>(w, x), _mm256_set1_epi16(1))
    }

    /// One level of the reduction tree: horizontal sums of adjacent lanes of `a` and `b`
    /// (i16 lanes for [`Format::I16_SUMS`], else i32), per 128-bit half.
    #[inline(always)]
    unsafe fn hadd<F: Format>(a: __m256i, b: __m256i) -> __m256i {
        if F::I16_SUMS {
            _mm256_hadd_epi16(a, b)
        } else {
            _mm256_hadd_epi32(a, b)
        }
    }

    /// A block's partial sums against one weight row, as the reduction tree takes them.
    #[inline(always)]
    unsafe fn leaf<F: Format>(w: __m256i, x: __m256i) -> __m256i {
        if F::I16_SUMS {
            pair_products::<F>(w, x)
        } else {
            products::<F>(w, x)
        }
    }

    /// Weight rows `r0..r0 + 8` (`r0` a multiple of [`TILE_ROWS`]) against activation rows
    /// `a0..a0 + R`; `out` seen from row `r0` (result `(r0 + c, a)` at `out.at(c, a)`).
    #[inline(always)]
    unsafe fn tile<F: Format, const R: usize>(
        p: &PackedMatrix,
        xq: &Quantized,
        a0: usize,
        r0: usize,
        out: Out,
    ) {
        let nb = p.cols() / QK;
        let params = p.block_index(r0, 0);
        let mut acc = [_mm256_setzero_ps(); R];
        for b in 0..nb {
            let mut x = [_mm256_setzero_si256(); R];
            for (a, xa) in x.iter_mut().enumerate() {
                *xa = _mm256_loadu_si256(
                    xq.q.as_ptr().add(((a0 + a) * nb + b) * QK) as *const __m256i
                );
            }
            // Per activation row, two levels of the tree over weight rows 0..4 and 4..8: per
            // 128-bit half (block elements 0..16 and 16..32), each weight row's sums in
            // adjacent lanes.
            let mut quads = [[_mm256_setzero_si256(); R]; 2];
            for (quad, qv) in quads.iter_mut().enumerate() {
                let mut pairs = [[_mm256_setzero_si256(); R]; 2];
                for (pair, pv) in pairs.iter_mut().enumerate() {
                    let c = b * TILE_ROWS + quad * 4 + pair * 2;
                    let w0 = F::weights(p, params + c);
                    let w1 = F::weights(p, params + c + 1);
                    for (pa, xa) in pv.iter_mut().zip(&x) {
                        *pa = hadd::<F>(leaf::<F>(w0, *xa), leaf::<F>(w1, *xa));
                    }
                }
                for (qa, (p0, p1)) in qv.iter_mut().zip(pairs[0].iter().zip(&pairs[1])) {
                    *qa = hadd::<F>(*p0, *p1);
                }
            }
            let dw = _mm256_loadu_ps(p.scale.as_ptr().add(params + b * TILE_ROWS));
            let mw = if F::WITH_MIN {
                _mm256_loadu_ps(p.min.as_ptr().add(params + b * TILE_ROWS))
            } else {
                _mm256_setzero_ps()
            };
            for (a, (acc_a, (lo, hi))) in acc
                .iter_mut()
                .zip(quads[0].iter().zip(&quads[1]))
                .enumerate()
            {
                // The last level: lane c holds weight row c's sum over the block.
                let sumi = if F::I16_SUMS {
                    // Per half, lane c = row c's 16 products (fits an i16); widen, add halves.
                    let h = _mm256_hadd_epi16(*lo, *hi);
                    _mm256_add_epi32(
                        _mm256_cvtepi16_epi32(_mm256_castsi256_si128(h)),
                        _mm256_cvtepi16_epi32(_mm256_extracti128_si256::<1>(h)),
                    )
                } else {
                    _mm256_add_epi32(
                        _mm256_permute2x128_si256::<0x20>(*lo, *hi),
                        _mm256_permute2x128_si256::<0x31>(*lo, *hi),
                    )
                };
                let ab = (a0 + a) * nb + b;
                accumulate(acc_a, sumi, dw, mw, F::WITH_MIN, xq, ab);
            }
        }
        for (a, acc_a) in acc.iter().enumerate() {
            _mm256_storeu_ps(out.at(0, a0 + a), *acc_a);
        }
    }

    /// `acc += sumi · d_w · d_a (+ m_w · s_a)` lane-wise for activation block `ab`: the scalar
    /// loop's operations in its order ([`super::rows_into_with`]), so the same bits.
    ///
    /// # Safety
    /// AVX2 available; `ab` a block of `xq` (and of its sums `s` when `with_min`).
    #[inline(always)]
    pub(super) unsafe fn accumulate(
        acc: &mut __m256,
        sumi: __m256i,
        dw: __m256,
        mw: __m256,
        with_min: bool,
        xq: &Quantized,
        ab: usize,
    ) {
        let da = _mm256_set1_ps(*xq.d.get_unchecked(ab));
        let mut t = _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(sumi), dw), da);
        if with_min {
            t = _mm256_add_ps(
                t,
                _mm256_mul_ps(mw, _mm256_set1_ps(*xq.s.get_unchecked(ab))),
            );
        }
        *acc = _mm256_add_ps(*acc, t);
    }

    /// Whole tiles: `tiles` groups of [`TILE_ROWS`] weight rows from `first`, every activation
    /// row.
    #[inline(always)]
    unsafe fn tiles_into<F: Format>(
        p: &PackedMatrix,
        xq: &Quantized,
        m: usize,
        first: usize,
        tiles: usize,
        out: Out,
    ) {
        for t in 0..tiles {
            let r0 = first + t * TILE_ROWS;
            let tile_out = out.skip_rows(t * TILE_ROWS);
            super::row_tiles!(m, a0, {
                4 => tile::<F, 4>(p, xq, a0, r0, tile_out),
                2 => tile::<F, 2>(p, xq, a0, r0, tile_out),
                1 => tile::<F, 1>(p, xq, a0, r0, tile_out),
            });
        }
    }

    /// The block product for the rows outside whole tiles.
    struct Avx2;

    impl BlockDot for Avx2 {
        /// Block `blk`'s 32 weights as bytes (signed unless Q4_1).
        type Weights = __m256i;

        #[inline(always)]
        unsafe fn weights(p: &PackedMatrix, blk: usize) -> __m256i {
            match p.kind {
                Kind::Q4_1 => Q41::weights(p, blk),
                Kind::Q4_0 => Q40::weights(p, blk),
                Kind::Q8_0 => Q80::weights(p, blk),
            }
        }

        #[inline(always)]
        unsafe fn dot(p: &PackedMatrix, w: &__m256i, x: &[i8]) -> i32 {
            debug_assert!(x.len() >= QK);
            let xv = _mm256_loadu_si256(x.as_ptr() as *const __m256i);
            let quads = if p.kind == Kind::Q4_1 {
                products::<Q41>(*w, xv)
            } else {
                products::<Q80>(*w, xv)
            };
            let s = _mm_add_epi32(
                _mm256_castsi256_si128(quads),
                _mm256_extracti128_si256::<1>(quads),
            );
            let s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
            let s = _mm_add_epi32(s, _mm_shuffle_epi32::<1>(s));
            _mm_cvtsi128_si32(s)
        }
    }

    /// The untiled loop alone (every row through [`Avx2`]'s block product), for the timing.
    ///
    /// # Safety
    /// AVX2 available.
    #[cfg(test)]
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn rows_into_untiled(
        p: &PackedMatrix,
        xq: &Quantized,
        m: usize,
        first: usize,
        dst: &mut [f32],
    ) {
        let (out, n_rows) = Out::of(dst, m);
        rows_into_with::<Avx2>(p, xq, m, first, n_rows, out);
    }

    /// Weight rows `first .. first + n_rows` into `out` ([`super::rows_into_strided`]): whole
    /// tiles through [`tile`], the rest through [`super::rows_into_with`] on [`Avx2`]'s block
    /// product.
    ///
    /// # Safety
    /// AVX2 available; `p` in tile order (asserted); `out` as [`super::rows_into_strided`]
    /// requires.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn rows_into_strided(
        p: &PackedMatrix,
        xq: &Quantized,
        m: usize,
        first: usize,
        n_rows: usize,
        out: Out,
    ) {
        if m == 0 {
            return;
        }
        let nb = p.cols() / QK;
        assert!(
            p.tile_rows == TILE_ROWS
                && !p.interleaved
                && first + n_rows <= p.rows()
                && xq.q.len() >= m * p.cols()
                && xq.d.len() >= m * nb
                && (p.kind != Kind::Q4_1 || xq.s.len() >= m * nb)
        );
        // Whole tiles start at a multiple of TILE_ROWS (the scales' groups) and end inside the
        // matrix, whose tile-ordered scales are padded to whole groups.
        let tiles = if first.is_multiple_of(TILE_ROWS) {
            n_rows / TILE_ROWS
        } else {
            0
        };
        match p.kind {
            Kind::Q4_1 => tiles_into::<Q41>(p, xq, m, first, tiles, out),
            Kind::Q4_0 => tiles_into::<Q40>(p, xq, m, first, tiles, out),
            Kind::Q8_0 => tiles_into::<Q80>(p, xq, m, first, tiles, out),
        }
        let done = tiles * TILE_ROWS;
        rows_into_with::<Avx2>(p, xq, m, first + done, n_rows - done, out.skip_rows(done));
    }
}

/// The same products with AVX-512 VNNI (`vpdpbusd`: unsigned × signed bytes, four adjacent
/// products added into an i32 lane), on blocks interleaved by 4 bytes in tiles of 16 weight
/// rows ([`PackedMatrix::interleaved`]).
///
/// A tile is [`VNNI_TILE_ROWS`] weight rows × `R` activation rows (8, else 4, 2, 1). Vector `j`
/// of a block holds elements `4j..4j + 4` of all sixteen weight rows, one per i32 lane (one
/// 64-byte load per column for Q8_0; for Q4 a load gives the columns of elements `4j..4j + 4`
/// (low nibbles) and `16 + 4j..` (high nibbles)), and the activation's four elements are one
/// 4-byte broadcast: eight `vpdpbusd` leave every weight row's block sum in its own lane — no
/// reduction at all. The sums are exact integers, so the same as the scalar loop's: Q4_1
/// nibbles are unsigned as they are; Q4_0 is `Σ n·q − 8·Σq` (nibbles `n`, the activation
/// block's `Σq` from [`quantize`]); Q8_0 goes through `|w|` and `q` negated where `w < 0`
/// (ggml's activations stay within ±127). The float part runs on 16 lanes, each doing the
/// scalar loop's operations in its order, so the bits are the scalar loop's (asserted). A tile
/// that the call's rows cut (the matrix's last rows, or a call that starts off a tile boundary)
/// is computed whole into a scratch buffer, reading the zero-padded rows, and copied.
#[cfg(target_arch = "x86_64")]
mod vnni {
    use std::arch::x86_64::*;

    use super::{Out, Quantized, QK};
    use crate::model::packed::{Kind, PackedMatrix, VNNI_TILE_ROWS};

    /// Weight rows per tile.
    const T: usize = VNNI_TILE_ROWS;

    /// The CPU has AVX-512 F/BW and VNNI.
    pub(super) fn available() -> bool {
        std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512bw")
            && std::arch::is_x86_feature_detected!("avx512vnni")
    }

    /// A block format of the kernel.
    trait Format {
        /// Q4_1: `+ m_w · s_a` per block.
        const WITH_MIN: bool;
        /// Q4_0: the nibbles are `w + 8`.
        const OFFSET8: bool;
        /// Q8_0: signed bytes, 32 per block.
        const SIGNED: bool;
    }

    struct Q41;
    struct Q40;
    struct Q80;

    impl Format for Q41 {
        const WITH_MIN: bool = true;
        const OFFSET8: bool = false;
        const SIGNED: bool = false;
    }

    impl Format for Q40 {
        const WITH_MIN: bool = false;
        const OFFSET8: bool = true;
        const SIGNED: bool = false;
    }

    impl Format for Q80 {
        const WITH_MIN: bool = false;
        const OFFSET8: bool = false;
        const SIGNED: bool = true;
    }

    /// The tile's weights at one block position, from its group's first block `blk0`: vector
    /// `j` holds elements `4j..4j + 4` of weight row `c` in bytes `4c..4c + 4` (unsigned for
    /// Q4, `|w|` for Q8_0), and for Q8_0 the masks of the negative weights.
    #[inline(always)]
    unsafe fn weights<F: Format>(p: &PackedMatrix, blk0: usize) -> ([__m512i; 8], [__mmask64; 8]) {
        let mut w = [_mm512_setzero_si512(); 8];
        let mut neg = [0; 8];
        if F::SIGNED {
            let base = p.qs.as_ptr().add(blk0 * QK);
            for j in 0..8 {
                let v = _mm512_loadu_si512(base.add(64 * j) as *const _);
                neg[j] = _mm512_movepi8_mask(v);
                w[j] = _mm512_abs_epi8(v);
            }
        } else {
            // Column j holds bytes 4j..4j + 4: elements 4j.. in the low nibbles, 16 + 4j.. high.
            let base = p.qs.as_ptr().add(blk0 * 16);
            let mask = _mm512_set1_epi8(0x0f);
            for j in 0..4 {
                let c = _mm512_loadu_si512(base.add(64 * j) as *const _);
                w[j] = _mm512_and_si512(c, mask);
                w[4 + j] = _mm512_and_si512(_mm512_srli_epi16::<4>(c), mask);
            }
        }
        (w, neg)
    }

    /// Weight rows `r0..r0 + 16` (`r0` a multiple of [`T`]; rows past the matrix are its zero
    /// padding) against activation rows `a0..a0 + R`; `out` seen from row `r0` (result
    /// `(r0 + c, a)` at `out.at(c, a)`).
    #[inline(always)]
    unsafe fn tile<F: Format, const R: usize>(
        p: &PackedMatrix,
        xq: &Quantized,
        a0: usize,
        r0: usize,
        out: Out,
    ) {
        let nb = p.cols() / QK;
        let params = p.block_index(r0, 0);
        let qb = if F::SIGNED { QK } else { 16 };
        let mut acc = [_mm512_setzero_ps(); R];
        for b in 0..nb {
            let blk0 = params + b * T;
            // The values 4 block positions ahead (the next tile's past the row's end): with
            // this, 1-row products of matrices larger than L2 ran ~1.4× faster (`int8_timing`,
            // `KVGATE_KERNEL_ROWS=49152`). A prefetch never faults.
            let ahead = p.qs.as_ptr().wrapping_add((blk0 + 4 * T) * qb) as *const i8;
            for l in 0..qb * T / 64 {
                _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(64 * l));
            }
            let (w, neg) = weights::<F>(p, blk0);
            let dw = _mm512_loadu_ps(p.scale.as_ptr().add(blk0));
            let mw = if F::WITH_MIN {
                _mm512_loadu_ps(p.min.as_ptr().add(blk0))
            } else {
                _mm512_setzero_ps()
            };
            for (a, acc_a) in acc.iter_mut().enumerate() {
                let ab = (a0 + a) * nb + b;
                let x = xq.q.as_ptr().add(ab * QK) as *const i32;
                // Two chains of four, joined: the products do not all wait on each other.
                let mut dots = [_mm512_setzero_si512(); 2];
                for j in 0..8 {
                    // Q4: vectors 0..4 are elements 4j.., 4..8 are 16 + 4(j − 4).. = 4j.. too.
                    let xj = _mm512_set1_epi32(x.add(j).read_unaligned());
                    let xj = if F::SIGNED {
                        _mm512_mask_sub_epi8(xj, neg[j], _mm512_setzero_si512(), xj)
                    } else {
                        xj
                    };
                    dots[j % 2] = _mm512_dpbusd_epi32(dots[j % 2], w[j], xj);
                }
                let mut sumi = _mm512_add_epi32(dots[0], dots[1]);
                if F::OFFSET8 {
                    sumi =
                        _mm512_sub_epi32(sumi, _mm512_set1_epi32(8 * *xq.sums.get_unchecked(ab)));
                }
                // `acc += sumi · d_w · d_a (+ m_w · s_a)`: the scalar loop's order, per lane.
                let da = _mm512_set1_ps(*xq.d.get_unchecked(ab));
                let mut t = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(sumi), dw), da);
                if F::WITH_MIN {
                    t = _mm512_add_ps(
                        t,
                        _mm512_mul_ps(mw, _mm512_set1_ps(*xq.s.get_unchecked(ab))),
                    );
                }
                *acc_a = _mm512_add_ps(*acc_a, t);
            }
        }
        for (a, acc_a) in acc.iter().enumerate() {
            _mm512_storeu_ps(out.at(0, a0 + a), *acc_a);
        }
    }

    /// One tile (weight rows `r0..r0 + 16`) against every activation row into `out` (seen
    /// from row `r0`).
    #[inline(always)]
    unsafe fn tile_rows<F: Format>(
        p: &PackedMatrix,
        xq: &Quantized,
        m: usize,
        r0: usize,
        out: Out,
    ) {
        super::row_tiles!(m, a0, {
            8 => tile::<F, 8>(p, xq, a0, r0, out),
            4 => tile::<F, 4>(p, xq, a0, r0, out),
            2 => tile::<F, 2>(p, xq, a0, r0, out),
            1 => tile::<F, 1>(p, xq, a0, r0, out),
        });
    }

    #[inline(always)]
    unsafe fn rows_into_format<F: Format>(
        p: &PackedMatrix,
        xq: &Quantized,
        m: usize,
        first: usize,
        n_rows: usize,
        out: Out,
    ) {
        let end = first + n_rows;
        let mut scratch = Vec::new();
        let mut r0 = first / T * T;
        while r0 < end {
            if r0 >= first && r0 + T <= end {
                tile_rows::<F>(p, xq, m, r0, out.skip_rows(r0 - first));
            } else {
                // A cut tile: whole into `[m, T]`, then the call's rows of it.
                scratch.resize(T * m, 0f32);
                let whole = Out {
                    base: scratch.as_mut_ptr(),
                    stride: T,
                };
                tile_rows::<F>(p, xq, m, r0, whole);
                let (lo, hi) = (r0.max(first), (r0 + T).min(end));
                for a in 0..m {
                    std::ptr::copy_nonoverlapping(
                        scratch.as_ptr().add(a * T + lo - r0),
                        out.at(lo - first, a),
                        hi - lo,
                    );
                }
            }
            r0 += T;
        }
    }

    /// Weight rows `first .. first + n_rows` into `out` ([`super::rows_into_strided`]).
    ///
    /// # Safety
    /// [`available`]; `p` interleaved (asserted); `out` as [`super::rows_into_strided`]
    /// requires.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    pub(super) unsafe fn rows_into_strided(
        p: &PackedMatrix,
        xq: &Quantized,
        m: usize,
        first: usize,
        n_rows: usize,
        out: Out,
    ) {
        if m == 0 {
            return;
        }
        let nb = p.cols() / QK;
        // Tiles read whole groups of T rows: the tile-ordered matrix is padded to them.
        assert!(
            p.tile_rows == T
                && p.interleaved
                && first + n_rows <= p.rows()
                && p.scale.len() >= p.rows().div_ceil(T) * T * nb
                && xq.q.len() >= m * p.cols()
                && xq.d.len() >= m * nb
                && xq.sums.len() >= m * nb
                && (p.kind != Kind::Q4_1 || xq.s.len() >= m * nb)
        );
        match p.kind {
            Kind::Q4_1 => rows_into_format::<Q41>(p, xq, m, first, n_rows, out),
            Kind::Q4_0 => rows_into_format::<Q40>(p, xq, m, first, n_rows, out),
            Kind::Q8_0 => rows_into_format::<Q80>(p, xq, m, first, n_rows, out),
        }
    }
}

/// One block's integer product `Σ w·q`, computed exactly (the kernels differ only here).
trait BlockDot {
    /// A block's weights, unpacked once and used for every activation row of the group.
    type Weights;

    /// The weights of the block at `blk` ([`PackedMatrix::block_index`]).
    ///
    /// # Safety
    /// The CPU has the implementation's features; `blk` is a valid block of `p`.
    unsafe fn weights(p: &PackedMatrix, blk: usize) -> Self::Weights;

    /// `Σ w·q` over the block's 32 values (`q` holds at least 32).
    ///
    /// # Safety
    /// As [`BlockDot::weights`].
    unsafe fn dot(p: &PackedMatrix, w: &Self::Weights, q: &[i8]) -> i32;
}

/// The portable block product.
struct Scalar;

impl BlockDot for Scalar {
    /// The 32 weights as signed integers (Q4_1: the unsigned nibble).
    type Weights = [i8; QK];

    #[inline(always)]
    unsafe fn weights(p: &PackedMatrix, blk: usize) -> [i8; QK] {
        let mut w = [0i8; QK];
        let q = p.block_qs(blk);
        match p.kind {
            Kind::Q4_1 | Kind::Q4_0 => {
                let off = if p.kind == Kind::Q4_0 { 8 } else { 0 };
                for j in 0..16 {
                    w[j] = (q[j] & 0x0f) as i8 - off;
                    w[j + 16] = (q[j] >> 4) as i8 - off;
                }
            }
            Kind::Q8_0 => {
                for (o, &b) in w.iter_mut().zip(&q) {
                    *o = b as i8;
                }
            }
        }
        w
    }

    #[inline(always)]
    unsafe fn dot(_: &PackedMatrix, w: &[i8; QK], q: &[i8]) -> i32 {
        w.iter()
            .zip(&q[..QK])
            .map(|(&a, &b)| i32::from(a) * i32::from(b))
            .sum()
    }
}

#[cfg(test)]
#[inline(always)]
fn rows_into_impl(p: &PackedMatrix, xq: &Quantized, m: usize, first: usize, dst: &mut [f32]) {
    let (out, n_rows) = Out::of(dst, m);
    // SAFETY: the scalar product needs no CPU feature; `out` covers `dst`.
    unsafe { rows_into_with::<Scalar>(p, xq, m, first, n_rows, out) }
}

/// The loop every kernel shares: per weight row, groups of [`GROUP`] activation rows, blocks
/// in order; `sumf += sumi · d_w · d_a (+ m_w · s_a for Q4_1)` — one float order for all.
///
/// # Safety
/// The CPU has `D`'s features; `out` as [`rows_into_strided`] requires.
#[inline(always)]
unsafe fn rows_into_with<D: BlockDot>(
    p: &PackedMatrix,
    xq: &Quantized,
    m: usize,
    first: usize,
    n_rows: usize,
    out: Out,
) {
    if m == 0 {
        return;
    }
    let nb = p.cols() / QK;
    assert!(first + n_rows <= p.rows() && xq.q.len() >= m * p.cols() && xq.d.len() >= m * nb);
    for i in 0..n_rows {
        let r = first + i;
        let mut g = 0;
        while g < m {
            let rows = (m - g).min(GROUP);
            let mut acc = [0f32; GROUP];
            for b in 0..nb {
                let at = p.block_index(r, b);
                let w = D::weights(p, at);
                let dw = p.scale[at];
                for (a, acc_a) in acc.iter_mut().enumerate().take(rows) {
                    let ab = (g + a) * nb + b;
                    // SAFETY: `ab < m · nb`, so the block lies inside `xq.q` (asserted above).
                    let q = std::slice::from_raw_parts(xq.q.as_ptr().add(ab * QK), QK);
                    let sumi = D::dot(p, &w, q);
                    let da = xq.d[ab];
                    *acc_a += if p.kind == Kind::Q4_1 {
                        sumi as f32 * dw * da + p.min[at] * xq.s[ab]
                    } else {
                        sumi as f32 * dw * da
                    };
                }
            }
            for (a, v) in acc.iter().enumerate().take(rows) {
                *out.at(i, g + a) = *v;
            }
            g += rows;
        }
    }
}

#[cfg(test)]
mod tests {
    use candle_core::quantized::k_quants::{BlockQ4_0, BlockQ4_1, BlockQ5_0, BlockQ8_0, GgmlType};
    use candle_core::quantized::{GgmlDType, QTensor};
    use candle_core::{Device, Tensor};

    use super::*;
    use crate::model::packed::tests::rnd_vec;

    /// Runs a strided kernel `f(rows, out)` into `dst` (`[m, rows]`).
    fn strided(dst: &mut [f32], m: usize, f: impl FnOnce(usize, Out)) {
        let (out, n_rows) = Out::of(dst, m);
        f(n_rows, out)
    }

    /// The AVX2 quantization gives the reference's bits: random blocks at many scales, ties at
    /// ±½ steps, zeros, subnormals (whose `1/d` overflows), infinities and NaNs.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn avx2_quantization_equals_the_reference() {
        if !std::arch::is_x86_feature_detected!("avx2") {
            return;
        }
        let mut blocks: Vec<[f32; QK]> = Vec::new();
        for (i, scale) in [1e-38f32, 1e-30, 1e-6, 0.01, 1.0, 127.0, 3e5, 1e30]
            .into_iter()
            .enumerate()
        {
            for seed in 0..8 {
                let v = rnd_vec(0x100 + 8 * i as u64 + seed, QK);
                blocks.push(std::array::from_fn(|j| v[j] * scale));
            }
        }
        // Values that land on x.5 after scaling by 127 / amax (amax 127: 1/d = 1).
        blocks.push(std::array::from_fn(|j| {
            if j == 0 {
                127.0
            } else {
                (j as f32 - 16.0) + 0.5
            }
        }));
        blocks.push([0.0; QK]);
        blocks.push(std::array::from_fn(
            |j| if j % 2 == 0 { -0.0 } else { 1e-45 },
        ));
        blocks.push(std::array::from_fn(|j| match j {
            0 => f32::NAN,
            1 => f32::INFINITY,
            2 => f32::NEG_INFINITY,
            _ => j as f32,
        }));
        blocks.push(std::array::from_fn(|j| {
            if j == 3 {
                f32::NAN
            } else {
                -(j as f32)
            }
        }));
        for (n, xb) in blocks.iter().enumerate() {
            let (mut want, mut got) = ([0i8; QK], [0i8; QK]);
            let reference = quantize_block(xb, &mut want);
            // SAFETY: AVX2 checked above.
            let simd = unsafe { quantize_avx2::block(xb, &mut got) };
            assert_eq!(want, got, "block {n}: {xb:?}");
            assert_eq!(reference.0.to_bits(), simd.0.to_bits(), "block {n}: d");
            assert_eq!(reference.1, simd.1, "block {n}: Σq");
        }
    }

    /// ggml's own quantization, from the dump `scripts/check-ggml-ops.sh` writes with the
    /// llama.cpp build (`KVGATE_GGML_OPS`; outside CI): the same `d`, `s` and values for Q8_1 and
    /// Q8_0 on every block (random at scales 1e-20 to 1e20, exact ties, zeros).
    #[test]
    #[ignore = "needs the dump of scripts/check-ggml-ops.sh"]
    fn quantization_equals_ggmls() {
        let path = std::env::var("KVGATE_GGML_OPS").expect("KVGATE_GGML_OPS: the dump's path");
        let dump: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        let f16_bits = |x: f32| half::f16::from_f32(x).to_bits();
        let ints = |v: &serde_json::Value| -> Vec<i64> {
            v.as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_i64().unwrap())
                .collect()
        };
        let blocks = dump["blocks"].as_array().unwrap();
        for (n, b) in blocks.iter().enumerate() {
            let x: Vec<f32> = ints(&b["x"])
                .iter()
                .map(|&u| f32::from_bits(u as u32))
                .collect();
            for (key, with_sums) in [("q8_1", true), ("q8_0", false)] {
                let q = quantize(&x, with_sums);
                let want = &b[key];
                let got_qs: Vec<i64> = q.q.iter().map(|&v| i64::from(v)).collect();
                assert_eq!(got_qs, ints(&want["qs"]), "block {n} {key}: values");
                assert_eq!(
                    i64::from(f16_bits(q.d[0])),
                    want["d"].as_i64().unwrap(),
                    "block {n} {key}: d"
                );
                if with_sums {
                    assert_eq!(
                        i64::from(f16_bits(q.s[0])),
                        want["s"].as_i64().unwrap(),
                        "block {n} {key}: s"
                    );
                }
            }
        }
        println!(
            "{} blocks equal ggml's Q8_1 and Q8_0 quantization",
            blocks.len()
        );
    }

    /// `bytes` as candle blocks of type `T` (ggml's `#[repr(C)]` layout, read unaligned).
    fn candle_blocks<T: GgmlType>(bytes: &[u8]) -> Vec<T> {
        let size = std::mem::size_of::<T>();
        assert_eq!(bytes.len() % size, 0);
        (0..bytes.len() / size)
            // SAFETY: in bounds (checked above); `T` is a plain `#[repr(C)]` block of f16 and
            // integer fields, valid for any bytes.
            .map(|i| unsafe { std::ptr::read_unaligned(bytes.as_ptr().add(i * size) as *const T) })
            .collect()
    }

    /// One activation row quantized by [`quantize`] in ggml's block layout: per block `d` (f16),
    /// for Q8_1 `s` (f16), then the 32 values.
    fn activation_bytes(q: &Quantized, with_sums: bool) -> Vec<u8> {
        let mut out = Vec::new();
        for (b, qs) in q.q.chunks_exact(QK).enumerate() {
            out.extend(half::f16::from_f32(q.d[b]).to_bits().to_le_bytes());
            if with_sums {
                out.extend(half::f16::from_f32(q.s[b]).to_bits().to_le_bytes());
            }
            out.extend(qs.iter().map(|&v| v as u8));
        }
        out
    }

    /// candle's block product (its port of ggml's `vec_dot_*`) of weight row `wr` (`W`'s bytes)
    /// with an activation row in its `VecDotType`'s bytes.
    fn candle_dot<W: GgmlType>(wr: &[u8], act: &[u8], k: usize) -> f32 {
        W::vec_dot(
            k,
            &candle_blocks::<W>(wr),
            &candle_blocks::<W::VecDotType>(act),
        )
    }

    /// Against candle's block products (its port of ggml's `vec_dot_*`) on the same weight blocks
    /// and the same quantized activations (ours: ggml's x86 quantization, which candle's
    /// `from_float` — ggml's portable reference — does not reproduce): the same values up to
    /// f32 rounding, for every format and row counts around the group; and each row's result
    /// does not depend on how many rows share the call.
    #[test]
    fn matches_candles_block_products_and_is_row_count_invariant() {
        // 28 weight rows: three whole tiles of the AVX2 kernel and a 4-row rest.
        let (n, k) = (28, 256);
        let w = Tensor::from_vec(rnd_vec(0x77, n * k), (n, k), &Device::Cpu).unwrap();
        for dtype in [
            GgmlDType::Q4_1,
            GgmlDType::Q4_0,
            GgmlDType::Q8_0,
            GgmlDType::Q5_0,
        ] {
            let q = QTensor::quantize(&w, dtype).unwrap();
            let p = PackedMatrix::from_qtensor(&q)
                .unwrap()
                .unwrap()
                .with_int8_activations();
            let m = 9;
            let x = rnd_vec(0x78, m * k);
            let got = p.matmul(&x, m).unwrap();
            let with_sums = dtype == GgmlDType::Q4_1;
            let wdata = q.data().unwrap();
            let row_bytes = wdata.len() / n;
            let mut want = Vec::with_capacity(m * n);
            for r in 0..m {
                let act = activation_bytes(&quantize(&x[r * k..][..k], with_sums), with_sums);
                for wr in wdata.chunks_exact(row_bytes) {
                    want.push(match dtype {
                        GgmlDType::Q4_1 => candle_dot::<BlockQ4_1>(wr, &act, k),
                        GgmlDType::Q4_0 => candle_dot::<BlockQ4_0>(wr, &act, k),
                        GgmlDType::Q8_0 => candle_dot::<BlockQ8_0>(wr, &act, k),
                        _ => candle_dot::<BlockQ5_0>(wr, &act, k),
                    });
                }
            }
            for (a, b) in got.iter().zip(&want) {
                assert!(
                    (a - b).abs() <= 1e-4 * b.abs().max(1.0),
                    "{dtype:?}: {a} vs {b}"
                );
            }
            // Every kernel gives the scalar loop's bits on its layout: tiles of 4, 2 and 1
            // activation rows, whole weight tiles and the cut ones (the last 4 rows, a call that
            // starts inside the matrix as the pool's tasks do, or off a tile boundary).
            let plain = PackedMatrix::from_qtensor(&q)
                .unwrap()
                .unwrap()
                .with_int8_layout(false);
            let interleaved = PackedMatrix::from_qtensor(&q)
                .unwrap()
                .unwrap()
                .with_int8_layout(true);
            for rows in [1, 2, 3, m] {
                let xq = quantize(&x[..rows * k], p.kind == Kind::Q4_1);
                for (first, len) in [(0, n), (8, 16), (3, 9), (24, 4)] {
                    let mut scalar = vec![0f32; len * rows];
                    rows_into_impl(&plain, &xq, rows, first, &mut scalar);
                    let mut kernels: Vec<(&str, Vec<f32>)> = Vec::new();
                    let mut run = |name, f: &dyn Fn(&mut [f32])| {
                        let mut out = vec![1f32; len * rows];
                        f(&mut out);
                        kernels.push((name, out));
                    };
                    run("scalar, interleaved", &|out| {
                        rows_into_impl(&interleaved, &xq, rows, first, out)
                    });
                    run("dispatch", &|out| rows_into(&p, &xq, rows, first, out));
                    #[cfg(target_arch = "x86_64")]
                    if std::arch::is_x86_feature_detected!("avx2") {
                        // SAFETY: AVX2 checked above; shapes match.
                        run("avx2", &|out| unsafe {
                            strided(out, rows, |n, o| {
                                avx2::rows_into_strided(&plain, &xq, rows, first, n, o)
                            })
                        });
                    }
                    #[cfg(target_arch = "x86_64")]
                    if vnni::available() {
                        // SAFETY: the CPU has the kernel's features (checked above).
                        run("avx512 vnni", &|out| unsafe {
                            strided(out, rows, |n, o| {
                                vnni::rows_into_strided(&interleaved, &xq, rows, first, n, o)
                            })
                        });
                    }
                    for (name, got) in &kernels {
                        assert!(
                            scalar
                                .iter()
                                .zip(got)
                                .all(|(a, b)| a.to_bits() == b.to_bits()),
                            "{dtype:?}: the {name} kernel differs from the scalar loop \
                             ({rows} rows, weight rows {first}..{})",
                            first + len
                        );
                    }
                }
            }
            for rows in [1, 2, 3, 5] {
                let part = p.matmul(&x[..rows * k], rows).unwrap();
                assert!(
                    part.iter()
                        .zip(&got[..rows * n])
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{dtype:?}: {rows} rows differ from the same rows in a step of {m}"
                );
            }
        }
    }
    /// Kernel timing (run on purpose: `cargo test -p engine --lib int8_timing -- --ignored
    /// --nocapture`): the AVX-512 VNNI kernel where the CPU has it, the tiled AVX2 kernel, the
    /// untiled AVX2 loop (one block product at a
    /// time, what ran before the tiles) and the compiler-vectorized loop alternated in one
    /// process, Q4_1 on SmolLM2's gate/up shape, one thread (`KVGATE_KERNEL_ROWS=49152` for
    /// a matrix of the output head's size, larger than the caches; `KVGATE_KERNEL_FORMAT=q8_0`
    /// for Q8_0 weights).
    #[cfg(target_arch = "x86_64")]
    #[test]
    #[ignore = "timing: run explicitly with --ignored --nocapture"]
    fn int8_timing() {
        if !std::arch::is_x86_feature_detected!("avx2") {
            return;
        }
        let n = std::env::var("KVGATE_KERNEL_ROWS")
            .map(|v| v.parse().expect("KVGATE_KERNEL_ROWS is a row count"))
            .unwrap_or(3072);
        let k = 576;
        let dtype = match std::env::var("KVGATE_KERNEL_FORMAT").as_deref() {
            Ok("q8_0") => GgmlDType::Q8_0,
            _ => GgmlDType::Q4_1,
        };
        let w = Tensor::from_vec(rnd_vec(5, n * k), (n, k), &Device::Cpu).unwrap();
        let q = QTensor::quantize(&w, dtype).unwrap();
        let plain = PackedMatrix::from_qtensor(&q)
            .unwrap()
            .unwrap()
            .with_int8_layout(false);
        let interleaved = PackedMatrix::from_qtensor(&q)
            .unwrap()
            .unwrap()
            .with_int8_layout(true);
        type Kernel<'a> = (&'a str, Box<dyn Fn(&Quantized, usize, &mut [f32]) + 'a>);
        let mut kernels: Vec<Kernel> = Vec::new();
        if vnni::available() {
            kernels.push((
                "avx512 vnni (interleaved)",
                // SAFETY: the CPU has the kernel's features (checked above).
                Box::new(|xq, m, dst| unsafe {
                    strided(dst, m, |n, o| {
                        vnni::rows_into_strided(&interleaved, xq, m, 0, n, o)
                    })
                }),
            ));
        }
        // SAFETY (these three): AVX2 checked above.
        kernels.push((
            "avx2 tiled",
            Box::new(|xq, m, dst| unsafe {
                strided(dst, m, |n, o| {
                    avx2::rows_into_strided(&plain, xq, m, 0, n, o)
                })
            }),
        ));
        kernels.push((
            "avx2 untiled",
            Box::new(|xq, m, dst| unsafe { avx2::rows_into_untiled(&plain, xq, m, 0, dst) }),
        ));
        kernels.push((
            "compiler-vectorized",
            Box::new(|xq, m, dst| unsafe { rows_into_autovec(&plain, xq, m, 0, dst) }),
        ));
        println!(
            "qs alignment mod 64: {}",
            interleaved.qs.as_ptr() as usize % 64
        );
        if vnni::available() {
            // SAFETY: the CPU has the features (checked above).
            let peak = (0..3)
                .map(|_| unsafe { vnni_peak_gmacs() })
                .fold(0f64, f64::max);
            println!("avx512 vnni peak (independent vpdpbusd only): {peak:.1} GMAC/s");
        }
        for m in [1usize, 4, 8, 32] {
            let xq = quantize(&rnd_vec(6, m * k), dtype == GgmlDType::Q4_1);
            let mut best = vec![f64::INFINITY; kernels.len()];
            let mut dst = vec![0f32; n * m];
            for _ in 0..20 {
                for ((_, f), best) in kernels.iter().zip(best.iter_mut()) {
                    let t = std::time::Instant::now();
                    f(&xq, m, &mut dst);
                    *best = best.min(t.elapsed().as_secs_f64());
                }
            }
            let gmac = |s: f64| (m * n * k) as f64 / s / 1e9;
            let line: Vec<String> = kernels
                .iter()
                .zip(&best)
                .map(|((name, _), s)| format!("{name} {:.3} ms ({:.1} GMAC/s)", s * 1e3, gmac(*s)))
                .collect();
            println!("m={m}: {}", line.join(", "));
        }
    }

    /// What this core's `vpdpbusd` can do at most: twelve independent accumulator chains of
    /// register operands, nothing else (64 multiply-adds per instruction). The kernel's GMAC/s
    /// beside it show how much of the products' time goes to everything around them.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    unsafe fn vnni_peak_gmacs() -> f64 {
        use std::arch::x86_64::*;
        const CHAINS: usize = 12;
        let iters = 2_000_000;
        let mut acc = [_mm512_set1_epi32(1); CHAINS];
        // Opaque operands: nothing for the compiler to fold.
        let (w, x) = std::hint::black_box((_mm512_set1_epi8(3), _mm512_set1_epi8(-5)));
        let t = std::time::Instant::now();
        for _ in 0..iters {
            for a in acc.iter_mut() {
                *a = _mm512_dpbusd_epi32(*a, w, x);
            }
        }
        let s = t.elapsed().as_secs_f64();
        std::hint::black_box(acc);
        (iters * CHAINS * 64) as f64 / s / 1e9
    }

    /// The scalar loop compiled with AVX2 enabled (what AVX2 CPUs ran before [`avx2`]).
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    unsafe fn rows_into_autovec(
        p: &PackedMatrix,
        xq: &Quantized,
        m: usize,
        first: usize,
        dst: &mut [f32],
    ) {
        rows_into_impl(p, xq, m, first, dst);
    }
}
