//! The feed-forward's gated activations, `act(gate) · up` per row (`gu` is `[rows, 2·ffn]`,
//! gate then up): SiLU (Llama, Qwen, Phi-3) and GELU's tanh form (Gemma), each in two
//! arithmetics:
//! - the default (`exact`): SiLU as `x / (1 + e^(−x))` with libm's `expf` (candle's formula),
//!   GELU in f32;
//! - llama.cpp's ([`super::WeightFormat::LlamaCpp`]), as ggml's CPU code computes them, bit for
//!   bit (`scripts/check-ggml-ops.sh` compares with ggml itself): SiLU through ggml's vector
//!   `expf` (`ggml_v_silu`: a degree-5 polynomial after a `2^n` range reduction, then
//!   `x / (1 + e^(−x))`, 16 lanes with AVX-512F+DQ, 8 with AVX2+FMA — the two round
//!   differently, and llama.cpp built for the CPU uses the wider one it has; the lanes left
//!   over and CPUs with neither take the libm formula, as ggml does); GELU through ggml's f16
//!   table ([`GeluTable`]).
//!
//! Cost: O(rows · ffn), one `expf` (or a table lookup) per value.

use super::attention::{f16_bits_to_f32, f32_to_f16_bits};
use crate::EngineError;

/// GELU's tanh form in f32, as ggml's `ggml_gelu_f32` computes it:
/// `0.5·x·(1 + tanh(√(2/π)·x·(1 + 0.044715·x·x)))`, where GCC fuses `1 + (0.044715·x)·x` into
/// one multiply-add (ggml's table differs from the unfused form at one f16 value, −1.999).
fn gelu(g: f32) -> f32 {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    0.5 * g * (1.0 + (SQRT_2_OVER_PI * g * (0.044_715 * g).mul_add(g, 1.0)).tanh())
}

/// ggml's CPU GELU (`GGML_GELU_FP16`, on in every llama.cpp build): for `−10 < x < 10` the input
/// rounded to f16 indexes a table of `f16(gelu(x))` over all 65,536 f16 values; below −10 it is
/// 0, from 10 on `x`. [`super::WeightFormat::LlamaCpp`] uses it, so Gemma's feed-forward takes
/// the values llama.cpp's does (`O(65,536)` `tanh` calls and 128 KiB, once per executor).
pub(crate) struct GeluTable(Vec<u16>);

impl GeluTable {
    pub(crate) fn new() -> Self {
        let x: Vec<f32> = (0..=u16::MAX)
            .map(|h| half::f16::from_bits(h).to_f32())
            .collect();
        let y: Vec<f32> = x.iter().map(|&v| gelu(v)).collect();
        let mut bits = vec![0u16; y.len()];
        f32_to_f16_bits(&y, &mut bits);
        GeluTable(bits)
    }

    /// `gelu(x)` for every value of `x` (in place), ggml's way.
    fn apply(&self, x: &mut [f32]) {
        let mut h = [0u16; 64];
        let mut y = [0f32; 64];
        for chunk in x.chunks_mut(64) {
            let n = chunk.len();
            f32_to_f16_bits(chunk, &mut h[..n]);
            for hv in &mut h[..n] {
                *hv = self.0[usize::from(*hv)];
            }
            f16_bits_to_f32(&h[..n], &mut y[..n]);
            for (v, &t) in chunk.iter_mut().zip(&y[..n]) {
                *v = if *v <= -10.0 {
                    0.0
                } else if *v >= 10.0 {
                    *v
                } else {
                    t
                };
            }
        }
    }
}

fn check_shape(gu: &[f32], rows: usize, ffn: usize) -> Result<(), EngineError> {
    if gu.len() != rows * 2 * ffn {
        return Err(EngineError::Tensor(format!(
            "gate/up projection gave {} values, expected {rows}×{}",
            gu.len(),
            2 * ffn
        )));
    }
    Ok(())
}

/// `gelu(gate) · up` per row, GELU's tanh form as llama.cpp's `ggml_geglu` computes it: in
/// f32, or through ggml's f16 table (`table`).
pub(crate) fn gelu_mul(
    gu: &[f32],
    rows: usize,
    ffn: usize,
    table: Option<&GeluTable>,
) -> Result<Vec<f32>, EngineError> {
    check_shape(gu, rows, ffn)?;
    let mut out = Vec::with_capacity(rows * ffn);
    let mut act = vec![0f32; ffn];
    for row in gu.chunks_exact(2 * ffn) {
        let (gate, up) = row.split_at(ffn);
        match table {
            Some(t) => {
                act.copy_from_slice(gate);
                t.apply(&mut act);
            }
            None => {
                for (a, &g) in act.iter_mut().zip(gate) {
                    *a = gelu(g);
                }
            }
        }
        out.extend(act.iter().zip(up).map(|(&a, &u)| a * u));
    }
    Ok(out)
}

/// Which SiLU (module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Silu {
    /// `x / (1 + e^(−x))` with libm's `expf`.
    Libm,
    /// ggml's vector SiLU for this CPU.
    Ggml,
}

/// `x / (1 + e^(−x))` with libm's `expf` (candle's `silu`, ggml's `ggml_silu_f32`).
fn silu_libm(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// `silu(gate) · up` per row.
pub(crate) fn silu_mul(
    gu: &[f32],
    rows: usize,
    ffn: usize,
    silu: Silu,
) -> Result<Vec<f32>, EngineError> {
    check_shape(gu, rows, ffn)?;
    let mut out = Vec::with_capacity(rows * ffn);
    let mut act = vec![0f32; ffn];
    for row in gu.chunks_exact(2 * ffn) {
        let (gate, up) = row.split_at(ffn);
        match silu {
            Silu::Libm => {
                for (a, &g) in act.iter_mut().zip(gate) {
                    *a = silu_libm(g);
                }
            }
            Silu::Ggml => ggml_silu(gate, &mut act),
        }
        out.extend(act.iter().zip(up).map(|(&a, &u)| a * u));
    }
    Ok(out)
}

/// ggml's `ggml_vec_silu_f32` on this CPU: `y[i] = silu(x[i])`.
pub(crate) fn ggml_silu(x: &[f32], y: &mut [f32]) {
    assert_eq!(x.len(), y.len());
    let mut done = 0;
    #[cfg(target_arch = "x86_64")]
    {
        if x86::avx512_available() {
            // SAFETY: AVX-512F and DQ checked just above; lengths equal (asserted).
            done = unsafe { x86::silu16(x, y) };
        } else if super::simd::avx2::available() {
            // SAFETY: AVX2 and FMA checked just above; lengths equal (asserted).
            done = unsafe { x86::silu8(x, y) };
        }
    }
    for (o, &v) in y[done..].iter_mut().zip(&x[done..]) {
        *o = silu_libm(v);
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    /// The constants of ggml's vector `expf`: `1.5·2^23` (rounds `z` to an integer in its
    /// mantissa), `log2 e`, `ln 2` split into two parts, and the polynomial's coefficients.
    const ROUND: f32 = 12_582_912.0;
    const LOG2E: u32 = 0x3fb8_aa3b;
    const LN2_LO: u32 = 0x35bf_be8e;
    const LN2_HI: u32 = 0x3f31_7200;
    const P0: u32 = 0x3c07_2010;
    const P1: u32 = 0x3d2b_9f17;
    const P2: u32 = 0x3e2a_af33;
    const P3: u32 = 0x3eff_fedb;
    const P4: u32 = 0x3f7f_fff6;

    pub(super) fn avx512_available() -> bool {
        std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512dq")
    }

    /// ggml's 16-lane `ggml_v_expf` (AVX-512): `e^x = 2^n · j(b)`, `n = round(x·log2 e)`,
    /// `b = x − n·ln 2`, scaled with `vscalefps`; `|n| > 192` saturates to 0 or ∞.
    #[inline]
    #[target_feature(enable = "avx512f,avx512dq")]
    unsafe fn expf16(x: __m512) -> __m512 {
        let c = |b: u32| _mm512_set1_ps(f32::from_bits(b));
        let r = _mm512_set1_ps(ROUND);
        let z = _mm512_fmadd_ps(x, c(LOG2E), r);
        let n = _mm512_sub_ps(z, r);
        let b = _mm512_fnmadd_ps(n, c(LN2_LO), _mm512_fnmadd_ps(n, c(LN2_HI), x));
        let d = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(_mm512_abs_ps(n), _mm512_set1_ps(192.0));
        let u = _mm512_mul_ps(b, b);
        let j = _mm512_fmadd_ps(
            _mm512_fmadd_ps(
                _mm512_fmadd_ps(c(P0), b, c(P1)),
                u,
                _mm512_fmadd_ps(c(P2), b, c(P3)),
            ),
            u,
            _mm512_fmadd_ps(c(P4), b, _mm512_set1_ps(1.0)),
        );
        let res = _mm512_scalef_ps(j, n);
        if d == 0 {
            return res;
        }
        let zero = _mm512_setzero_ps();
        let alt = _mm512_mask_blend_ps(
            _mm512_cmp_ps_mask::<_CMP_LE_OQ>(n, zero),
            _mm512_set1_ps(f32::INFINITY),
            zero,
        );
        _mm512_mask_blend_ps(d, res, alt)
    }

    /// ggml's 8-lane `ggml_v_expf` (AVX2 + FMA): the same reduction, `2^n` built in the
    /// exponent bits, with its own handling of `|n| > 126` and `> 192`.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn expf8(x: __m256) -> __m256 {
        let c = |b: u32| _mm256_set1_ps(f32::from_bits(b));
        let r = _mm256_set1_ps(ROUND);
        let z = _mm256_fmadd_ps(x, c(LOG2E), r);
        let n = _mm256_sub_ps(z, r);
        let b = _mm256_fnmadd_ps(n, c(LN2_LO), _mm256_fnmadd_ps(n, c(LN2_HI), x));
        let e = _mm256_slli_epi32::<23>(_mm256_castps_si256(z));
        let k = _mm256_castsi256_ps(_mm256_add_epi32(
            e,
            _mm256_castps_si256(_mm256_set1_ps(1.0)),
        ));
        let abs_n = _mm256_andnot_ps(_mm256_set1_ps(-0.0), n);
        let cbig = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_GT_OQ>(abs_n, _mm256_set1_ps(126.0)));
        let u = _mm256_mul_ps(b, b);
        let j = _mm256_fmadd_ps(
            _mm256_fmadd_ps(
                _mm256_fmadd_ps(c(P0), b, c(P1)),
                u,
                _mm256_fmadd_ps(c(P2), b, c(P3)),
            ),
            u,
            _mm256_mul_ps(c(P4), b),
        );
        if _mm256_movemask_ps(_mm256_castsi256_ps(cbig)) == 0 {
            return _mm256_fmadd_ps(j, k, k);
        }
        let g = _mm256_and_si256(
            _mm256_castps_si256(_mm256_cmp_ps::<_CMP_LE_OQ>(n, _mm256_setzero_ps())),
            _mm256_set1_epi32(0x8200_0000u32 as i32),
        );
        let s1 = _mm256_castsi256_ps(_mm256_add_epi32(g, _mm256_set1_epi32(0x7f00_0000)));
        let s2 = _mm256_castsi256_ps(_mm256_sub_epi32(e, g));
        let d = _mm256_cmp_ps::<_CMP_GT_OQ>(abs_n, _mm256_set1_ps(192.0));
        let cbig = _mm256_castsi256_ps(cbig);
        _mm256_or_ps(
            _mm256_and_ps(d, _mm256_mul_ps(s1, s1)),
            _mm256_andnot_ps(
                d,
                _mm256_or_ps(
                    _mm256_and_ps(cbig, _mm256_mul_ps(_mm256_fmadd_ps(s2, j, s2), s1)),
                    _mm256_andnot_ps(cbig, _mm256_fmadd_ps(k, j, k)),
                ),
            ),
        )
    }

    /// `silu` of every whole group of 16 values of `x` into `y`; returns how many were done.
    ///
    /// # Safety
    /// AVX-512F and DQ available; `y` at least as long as `x`.
    #[target_feature(enable = "avx512f,avx512dq")]
    pub(super) unsafe fn silu16(x: &[f32], y: &mut [f32]) -> usize {
        let (xs, _) = x.as_chunks::<16>();
        let (ys, _) = y.as_chunks_mut::<16>();
        for (xc, yc) in xs.iter().zip(ys) {
            let v = _mm512_loadu_ps(xc.as_ptr());
            let e = expf16(_mm512_sub_ps(_mm512_setzero_ps(), v));
            let s = _mm512_div_ps(v, _mm512_add_ps(_mm512_set1_ps(1.0), e));
            _mm512_storeu_ps(yc.as_mut_ptr(), s);
        }
        xs.len() * 16
    }

    /// `silu` of every whole group of 8 values of `x` into `y`; returns how many were done.
    ///
    /// # Safety
    /// AVX2 and FMA available; `y` at least as long as `x`.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn silu8(x: &[f32], y: &mut [f32]) -> usize {
        let (xs, _) = x.as_chunks::<8>();
        let (ys, _) = y.as_chunks_mut::<8>();
        for (xc, yc) in xs.iter().zip(ys) {
            let v = _mm256_loadu_ps(xc.as_ptr());
            let e = expf8(_mm256_sub_ps(_mm256_setzero_ps(), v));
            let s = _mm256_div_ps(v, _mm256_add_ps(_mm256_set1_ps(1.0), e));
            _mm256_storeu_ps(yc.as_mut_ptr(), s);
        }
        xs.len() * 8
    }
}

#[cfg(test)]
mod tests {
    use super::super::attention::round_to_f16;
    use super::*;

    /// The dump `scripts/check-ggml-ops.sh` writes with the llama.cpp build (`KVGATE_GGML_OPS`).
    fn ggml_dump() -> serde_json::Value {
        let path = std::env::var("KVGATE_GGML_OPS").expect("KVGATE_GGML_OPS: the dump's path");
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
    }

    fn floats(v: &serde_json::Value) -> Vec<f32> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|u| f32::from_bits(u.as_u64().unwrap() as u32))
            .collect()
    }

    /// The first few `(x, ours, ggml's)` that differ in bits.
    fn differing(x: &[f32], got: &[f32], want: &[f32]) -> Vec<(f32, f32, f32)> {
        x.iter()
            .zip(got)
            .zip(want)
            .filter(|((_, g), w)| g.to_bits() != w.to_bits())
            .map(|((&x, &g), &w)| (x, g, w))
            .take(10)
            .collect()
    }

    /// ggml's GELU, bit for bit: every finite f16 value and values beyond ±10.
    #[test]
    #[ignore = "needs the dump of scripts/check-ggml-ops.sh"]
    fn gelu_table_equals_ggmls() {
        let dump = ggml_dump();
        let x = floats(&dump["gelu"]["x"]);
        let want = floats(&dump["gelu"]["y"]);
        let mut got = x.clone();
        GeluTable::new().apply(&mut got);
        let d = differing(&x, &got, &want);
        assert!(d.is_empty(), "(x, ours, ggml's): {d:?}");
        println!("{} values equal ggml's GELU", x.len());
    }

    /// ggml's SiLU on this CPU, bit for bit, over values from 1e-30 to 1e6 of both signs,
    /// zeros and where ggml's `expf` saturates.
    #[test]
    #[ignore = "needs the dump of scripts/check-ggml-ops.sh"]
    fn silu_equals_ggmls() {
        let dump = ggml_dump();
        let x = floats(&dump["silu"]["x"]);
        let want = floats(&dump["silu"]["y"]);
        let mut got = vec![0f32; x.len()];
        ggml_silu(&x, &mut got);
        let d = differing(&x, &got, &want);
        assert!(d.is_empty(), "(x, ours, ggml's): {d:?}");
        println!("{} values equal ggml's SiLU", x.len());
    }

    /// ggml's 8-lane SiLU (its AVX2 build's), bit for bit, against the dump of
    /// `scripts/ggml-ops/silu_avx2.cpp` (`KVGATE_GGML_SILU_AVX2`).
    #[cfg(target_arch = "x86_64")]
    #[test]
    #[ignore = "needs the dump of scripts/check-ggml-ops.sh"]
    fn silu8_equals_ggmls_avx2_build() {
        assert!(super::super::simd::avx2::available(), "needs AVX2 and FMA");
        let path = std::env::var("KVGATE_GGML_SILU_AVX2").expect("KVGATE_GGML_SILU_AVX2");
        let dump: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        let x = floats(&dump["x"]);
        let want = floats(&dump["y"]);
        let mut got = vec![0f32; x.len()];
        // SAFETY: AVX2 and FMA asserted above; equal lengths.
        let done = unsafe { x86::silu8(&x, &mut got) };
        assert_eq!(done, x.len());
        let d = differing(&x, &got, &want);
        assert!(d.is_empty(), "(x, ours, ggml's): {d:?}");
        println!("{} values equal ggml's 8-lane SiLU", x.len());
    }

    /// The table path is GELU rounded through f16, close to the f32 formula.
    #[test]
    fn gelu_table_is_the_f16_rounded_formula() {
        let table = GeluTable::new();
        let xs = [
            -12.0f32, -10.0, -3.3, -1.0, -0.01, 0.0, 0.3, 1.0, 2.5, 9.9, 10.0, 11.0,
        ];
        let mut got = xs;
        table.apply(&mut got);
        for (&x, &y) in xs.iter().zip(&got) {
            let want = if x <= -10.0 {
                0.0
            } else if x >= 10.0 {
                x
            } else {
                round_to_f16(gelu(round_to_f16(x)))
            };
            assert_eq!(y.to_bits(), want.to_bits(), "gelu({x})");
            assert!(
                (y - gelu(x)).abs() <= 2e-3 * gelu(x).abs().max(1e-2),
                "gelu({x})"
            );
        }
    }

    /// Both vector SiLUs are within 2 ulps of the exact value (f64) over a sweep of magnitudes
    /// and signs, 0 at ±0 and where `e^(−x)` overflows, `x` where it underflows; the lanes left
    /// over by a length that is not a multiple of the width take the libm formula.
    #[test]
    fn vector_silus_are_close_to_exact_and_handle_the_ends() {
        let mut x: Vec<f32> = vec![0.0, -0.0, 1e-30, -1e-30, 88.0, -88.0, 104.0, -104.0];
        x.extend([150.0f32, -150.0, 1e6, -1e6, 200.0, -200.0]);
        let mut v = 1e-6f32;
        while v < 1e3 {
            x.push(v);
            x.push(-v);
            v *= 1.037;
        }
        x.push(0.5); // a tail lane
        let exact = |t: f32| {
            let t = f64::from(t);
            t / (1.0 + (-t).exp())
        };
        let check = |name: &str, got: &[f32], done: usize| {
            for (i, (&t, &g)) in x.iter().zip(got).enumerate() {
                if i >= done {
                    assert_eq!(g.to_bits(), silu_libm(t).to_bits(), "{name} tail at {t}");
                    continue;
                }
                let e = exact(t);
                let ulp = (e.abs() as f32).max(f32::MIN_POSITIVE) * f32::EPSILON;
                assert!(
                    (f64::from(g) - e).abs() <= 2.0 * f64::from(ulp)
                        || (e.abs() < 1e-30 && g.abs() < 1e-30),
                    "{name}: silu({t}) = {g}, exact {e}"
                );
            }
        };
        #[cfg(target_arch = "x86_64")]
        {
            type Kernel = unsafe fn(&[f32], &mut [f32]) -> usize;
            let kernels: [(&str, bool, Kernel); 2] = [
                ("avx512", x86::avx512_available(), x86::silu16),
                ("avx2", super::super::simd::avx2::available(), x86::silu8),
            ];
            for (name, available, kernel) in kernels {
                if !available {
                    continue;
                }
                let mut y = vec![0f32; x.len()];
                // SAFETY: the kernel's features are available (checked above); equal lengths.
                let done = unsafe { kernel(&x, &mut y) };
                for (o, &t) in y[done..].iter_mut().zip(&x[done..]) {
                    *o = silu_libm(t);
                }
                check(name, &y, done);
            }
        }
        let mut y = vec![0f32; x.len()];
        ggml_silu(&x, &mut y);
        check("dispatch", &y, x.len());
    }
}
