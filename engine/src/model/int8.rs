//! ggml's block products with 8-bit activations, on this crate's packed weights: the fast path of
//! [`super::WeightFormat::LlamaCpp`] for Q4_0, Q4_1, Q8_0 and Q5_0 matrices (candle's port of the
//! same arithmetic is scalar here and ~30× slower).
//!
//! Each activation row is quantized per 32 values exactly as candle's `BlockQ8_1::from_float` /
//! `BlockQ8_0::from_float` do (ggml's `quantize_row_q8_1` / `q8_0` reference): `d = amax / 127`
//! stored as f16, `q = round(x · (1/d))` (ties away from zero), and for Q8_1 the f16
//! `s = f16(Σq) · d` (an f16 product). A block's product is then candle's
//! `vec_dot_q4_1_q8_1` / `q4_0_q8_0` / `q8_0_q8_0`: the integer `sumi = Σ w·q` (exact), then
//! `sumf += sumi · d_w · d_a (+ m_w · s_a for Q4_1)` in block order. Every (weight row,
//! activation row) pair is computed by the same sequence of operations whatever the number of
//! rows in the step, so results do not depend on step size, chunking or prefix caching.
//!
//! Cost `O(m · n · k)` integer multiply-adds plus `O(m · k)` for the quantization; weight blocks
//! are unpacked once per group of [`GROUP`] activation rows. [`PackedMatrix::matmul`] splits the
//! work over output rows on the rayon pool as for the F32 kernel.

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
}

/// Quantizes `m` rows of `k` values (`k` a multiple of [`QK`]); `with_sums` for Q8_1 (the
/// activations of Q4_1 products).
pub(crate) fn quantize(x: &[f32], with_sums: bool) -> Quantized {
    let blocks = x.len() / QK;
    let mut out = Quantized {
        q: vec![0; x.len()],
        d: Vec::with_capacity(blocks),
        s: Vec::with_capacity(if with_sums { blocks } else { 0 }),
    };
    for (xb, qb) in x.chunks_exact(QK).zip(out.q.chunks_exact_mut(QK)) {
        let amax = xb.iter().fold(0f32, |a, v| a.max(v.abs()));
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        let d16 = round_to_f16(d);
        let mut sum = 0i32;
        for (q, &v) in qb.iter_mut().zip(xb) {
            *q = (v * id).round() as i8;
            sum += i32::from(*q);
        }
        out.d.push(d16);
        if with_sums {
            out.s.push(round_to_f16(round_to_f16(sum as f32) * d16));
        }
    }
    out
}

/// Fills `dst` (`[rows, m]`, from weight row `first`) from activations quantized by
/// [`quantize`]; [`PackedMatrix::matmul`] splits the rows over the pool and transposes.
pub(crate) fn rows_into(p: &PackedMatrix, xq: &Quantized, m: usize, first: usize, dst: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512bw")
            && std::arch::is_x86_feature_detected!("avx512vnni")
        {
            // SAFETY: the CPU has the features the function is compiled for (checked above).
            unsafe { rows_into_avx512(p, xq, m, first, dst) };
            return;
        }
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: as above.
            unsafe { avx2::rows_into(p, xq, m, first, dst) };
            return;
        }
    }
    rows_into_impl(p, xq, m, first, dst);
}

/// The same products with AVX2 integer instructions (CPUs without AVX-512 VNNI): a block's
/// `sumi` is `maddubs` (unsigned × signed bytes, adjacent pairs to i16: at most 2·128·127, no
/// saturation since ggml's activations stay within ±127), `madd` with ones to i32 and a
/// horizontal sum — exact, so the same integer as the scalar loop; the float part is the scalar
/// loop's ([`rows_into_with`], shared). Signed weights (Q4_0, Q8_0) go through `|w|` and
/// `sign(x, w)`. Before, the compiler-vectorized loop widened every byte to i32.
#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::{rows_into_with, BlockDot, Quantized, QK};
    use crate::model::packed::{Kind, PackedMatrix};

    /// The block product with 256-bit integer instructions.
    struct Avx2;

    impl BlockDot for Avx2 {
        /// Block `blk`'s 32 weights as bytes in element order (Q4_1: the unsigned nibble;
        /// Q4_0: nibble − 8; Q8_0: the signed byte), and their absolute values.
        type Weights = (__m256i, __m256i);

        #[inline(always)]
        unsafe fn weights(p: &PackedMatrix, blk: usize) -> Self::Weights {
            let w = match p.kind {
                Kind::Q4_1 | Kind::Q4_0 => {
                    let q = _mm_loadu_si128(p.qs.as_ptr().add(blk * 16) as *const __m128i);
                    let mask = _mm_set1_epi8(0x0f);
                    let lo = _mm_and_si128(q, mask);
                    let hi = _mm_and_si128(_mm_srli_epi16::<4>(q), mask);
                    let w = _mm256_set_m128i(hi, lo);
                    if p.kind == Kind::Q4_0 {
                        _mm256_sub_epi8(w, _mm256_set1_epi8(8))
                    } else {
                        w
                    }
                }
                Kind::Q8_0 => _mm256_loadu_si256(p.qs.as_ptr().add(blk * QK) as *const __m256i),
            };
            (w, _mm256_abs_epi8(w))
        }

        #[inline(always)]
        unsafe fn dot(p: &PackedMatrix, w: &Self::Weights, x: &[i8]) -> i32 {
            let (w_signed, w_abs) = *w;
            debug_assert!(x.len() >= QK);
            let xv = _mm256_loadu_si256(x.as_ptr() as *const __m256i);
            let pairs = if p.kind == Kind::Q4_1 {
                _mm256_maddubs_epi16(w_signed, xv)
            } else {
                _mm256_maddubs_epi16(w_abs, _mm256_sign_epi8(xv, w_signed))
            };
            let quads = _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
            let s = _mm_add_epi32(
                _mm256_castsi256_si128(quads),
                _mm256_extracti128_si256::<1>(quads),
            );
            let s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
            let s = _mm_add_epi32(s, _mm_shuffle_epi32::<1>(s));
            _mm_cvtsi128_si32(s)
        }
    }

    /// [`super::rows_into_with`] on [`Avx2`]'s block product.
    ///
    /// # Safety
    /// AVX2 available.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn rows_into(
        p: &PackedMatrix,
        xq: &Quantized,
        m: usize,
        first: usize,
        dst: &mut [f32],
    ) {
        rows_into_with::<Avx2>(p, xq, m, first, dst);
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn rows_into_avx512(
    p: &PackedMatrix,
    xq: &Quantized,
    m: usize,
    first: usize,
    dst: &mut [f32],
) {
    rows_into_impl(p, xq, m, first, dst);
}

/// One block's integer product `Σ w·q`, computed exactly (the kernels differ only here).
trait BlockDot {
    /// A block's weights, unpacked once and used for every activation row of the group.
    type Weights;

    /// Block `blk`'s weights.
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
        match p.kind {
            Kind::Q4_1 | Kind::Q4_0 => {
                let off = if p.kind == Kind::Q4_0 { 8 } else { 0 };
                let q = &p.qs[blk * 16..][..16];
                for j in 0..16 {
                    w[j] = (q[j] & 0x0f) as i8 - off;
                    w[j + 16] = (q[j] >> 4) as i8 - off;
                }
            }
            Kind::Q8_0 => {
                for (o, &b) in w.iter_mut().zip(&p.qs[blk * QK..][..QK]) {
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

#[inline(always)]
fn rows_into_impl(p: &PackedMatrix, xq: &Quantized, m: usize, first: usize, dst: &mut [f32]) {
    // SAFETY: the scalar product needs no CPU feature.
    unsafe { rows_into_with::<Scalar>(p, xq, m, first, dst) }
}

/// The loop every kernel shares: per weight row, groups of [`GROUP`] activation rows, blocks
/// in order; `sumf += sumi · d_w · d_a (+ m_w · s_a for Q4_1)` — one float order for all.
///
/// # Safety
/// The CPU has `D`'s features.
#[inline(always)]
unsafe fn rows_into_with<D: BlockDot>(
    p: &PackedMatrix,
    xq: &Quantized,
    m: usize,
    first: usize,
    dst: &mut [f32],
) {
    if m == 0 {
        return;
    }
    let nb = p.cols() / QK;
    assert!(
        first + dst.len() / m <= p.rows() && xq.q.len() >= m * p.cols() && xq.d.len() >= m * nb
    );
    for (i, out_row) in dst.chunks_exact_mut(m).enumerate() {
        let r = first + i;
        let mut g = 0;
        while g < m {
            let rows = (m - g).min(GROUP);
            let mut acc = [0f32; GROUP];
            for b in 0..nb {
                let blk = r * nb + b;
                let w = D::weights(p, blk);
                let dw = p.scale[blk];
                for (a, acc_a) in acc.iter_mut().enumerate().take(rows) {
                    let ab = (g + a) * nb + b;
                    // SAFETY: `ab < m · nb`, so the block lies inside `xq.q` (asserted above).
                    let q = std::slice::from_raw_parts(xq.q.as_ptr().add(ab * QK), QK);
                    let sumi = D::dot(p, &w, q);
                    let da = xq.d[ab];
                    *acc_a += if p.kind == Kind::Q4_1 {
                        sumi as f32 * dw * da + p.min[blk] * xq.s[ab]
                    } else {
                        sumi as f32 * dw * da
                    };
                }
            }
            out_row[g..g + rows].copy_from_slice(&acc[..rows]);
            g += rows;
        }
    }
}

#[cfg(test)]
mod tests {
    use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
    use candle_core::{Device, Module, Tensor};

    use super::*;
    use crate::model::packed::tests::rnd_vec;

    /// Against candle's quantized matmul (the port of ggml's products) on the same blocks: the
    /// same values up to f32 rounding, for every format and row counts around the group; and
    /// each row's result does not depend on how many rows share the call.
    #[test]
    fn matches_candles_quantized_matmul_and_is_row_count_invariant() {
        let (n, k) = (24, 256);
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
            let candle = QMatMul::from_qtensor(q).unwrap();
            let m = 9;
            let x = rnd_vec(0x78, m * k);
            let got = p.matmul(&x, m).unwrap();
            let xt = Tensor::from_vec(x.clone(), (m, k), &Device::Cpu).unwrap();
            let want: Vec<f32> = candle
                .forward(&xt)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap();
            for (a, b) in got.iter().zip(&want) {
                assert!(
                    (a - b).abs() <= 1e-4 * b.abs().max(1.0),
                    "{dtype:?}: {a} vs {b}"
                );
            }
            #[cfg(target_arch = "x86_64")]
            if std::arch::is_x86_feature_detected!("avx2") {
                // The AVX2 kernel (also on AVX-512 CPUs) gives the scalar loop's bits.
                let xq = quantize(&x, p.kind == Kind::Q4_1);
                let (mut scalar, mut simd) = (vec![0f32; n * m], vec![0f32; n * m]);
                rows_into_impl(&p, &xq, m, 0, &mut scalar);
                // SAFETY: AVX2 checked above; shapes match.
                unsafe { avx2::rows_into(&p, &xq, m, 0, &mut simd) };
                assert!(
                    scalar
                        .iter()
                        .zip(&simd)
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{dtype:?}: the AVX2 kernel differs from the scalar loop"
                );
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
    /// --nocapture`): the AVX2 kernel and the compiler-vectorized loop alternated in one
    /// process, Q4_1 on SmolLM2's gate/up shape, one thread.
    #[cfg(target_arch = "x86_64")]
    #[test]
    #[ignore = "timing: run explicitly with --ignored --nocapture"]
    fn int8_timing() {
        if !std::arch::is_x86_feature_detected!("avx2") {
            return;
        }
        let (n, k) = (3072, 576);
        let w = Tensor::from_vec(rnd_vec(5, n * k), (n, k), &Device::Cpu).unwrap();
        let p = PackedMatrix::from_qtensor(&QTensor::quantize(&w, GgmlDType::Q4_1).unwrap())
            .unwrap()
            .unwrap()
            .with_int8_activations();
        for m in [1usize, 8, 32] {
            let xq = quantize(&rnd_vec(6, m * k), true);
            let mut best = [f64::INFINITY; 2];
            let mut dst = vec![0f32; n * m];
            for _ in 0..20 {
                let t = std::time::Instant::now();
                // SAFETY: AVX2 checked above.
                unsafe { avx2::rows_into(&p, &xq, m, 0, &mut dst) };
                best[0] = best[0].min(t.elapsed().as_secs_f64());
                let t = std::time::Instant::now();
                // SAFETY: as above (the loop compiled with AVX2 enabled).
                unsafe { rows_into_autovec(&p, &xq, m, 0, &mut dst) };
                best[1] = best[1].min(t.elapsed().as_secs_f64());
            }
            let gmac = |s: f64| (m * n * k) as f64 / s / 1e9;
            println!(
                "m={m}: avx2 {:.3} ms ({:.1} GMAC/s), compiler-vectorized {:.3} ms ({:.1} GMAC/s)",
                best[0] * 1e3,
                gmac(best[0]),
                best[1] * 1e3,
                gmac(best[1])
            );
        }
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
