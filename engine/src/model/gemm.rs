//! Dense F32 GEMM for large steps (prefill chunks): `x [m, k] · Wᵀ → [m, n]` with `W [n, k]`
//! repacked once at load into panels of [`NR`] weight rows stored column by column
//! (`panel[kk][j] = W[p·NR + j][kk]`), so the inner loop reads the panel sequentially and
//! broadcasts one activation per row.
//!
//! Why not candle's GEMM: candle 0.11 multiplies F32 on the CPU with the `gemm` crate's AVX2
//! kernels (8 lanes; its AVX-512 kernels need a nightly compiler), 19 GMAC/s per core on this
//! machine kind, where AVX-512 FMA peaks near 87. This kernel holds a `MR × 32` tile of the
//! output in 2·MR zmm registers (MR = 12: 24 accumulators) and is FMA-bound. Measured in
//! `docs/benchmarks.md` ("worker engine") and by `cargo test --release -p engine --lib
//! gemm_timing -- --ignored --nocapture`.
//!
//! Numerics: every output is `Σ_kk x[i][kk] · W[j][kk]` accumulated in `kk` order with fused
//! multiply-adds over the same F32 weights as the dense copy — the same products as every other
//! path of [`super::WeightFormat::Exact`], in a different summation order.
//!
//! Cost: `O(m·n·k)` multiply-adds; memory `O(n·k)` for the panels (the dense copy, padded to a
//! multiple of 32 rows). Work is split into (row block × panel group) tasks on the rayon pool;
//! each task writes a disjoint rectangle of the output. CPUs with AVX2 and FMA but no AVX-512
//! run an 8-lane kernel over the same panels (a `6 × 16` tile); others a portable loop (correct,
//! slower: callers prefer candle's GEMM there, see [`DensePanels::is_fast`]). All three compute
//! each output as the same `kk`-ordered chain of fused multiply-adds: the same bits.

use rayon::prelude::*;

use crate::EngineError;

/// Weight rows per panel (two 16-lane registers).
pub(crate) const NR: usize = 32;
/// Activation rows per micro-tile.
const MR: usize = 12;
/// Activation rows per task (a multiple of [`MR`]; `MC · k` floats stay in L2).
const MC: usize = 96;

/// A dense `[n, k]` F32 matrix in panel layout.
#[derive(Debug)]
pub(crate) struct DensePanels {
    n: usize,
    k: usize,
    /// `ceil(n / NR)` panels of `k · NR` floats; rows past `n` are zero.
    data: Vec<f32>,
}

/// A raw output pointer shared by parallel tasks that each write a disjoint part of one output
/// (this GEMM's rectangles, attention's per-item head slices).
#[derive(Clone, Copy)]
pub(crate) struct OutPtr(*mut f32);
// SAFETY: every user hands each task a part of the output no other task writes, and the output
// outlives the parallel loop (joined before the user returns).
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

impl OutPtr {
    /// Wraps the output's base pointer.
    pub(crate) fn new(out: &mut [f32]) -> Self {
        OutPtr(out.as_mut_ptr())
    }

    /// The pointer (a method, so closures capture the whole `Send` wrapper).
    pub(crate) fn get(self) -> *mut f32 {
        self.0
    }
}

impl DensePanels {
    /// Repacks row-major `w` (`[n, k]`).
    pub(crate) fn new(w: &[f32], n: usize, k: usize) -> Result<Self, EngineError> {
        if w.len() != n * k || n == 0 || k == 0 {
            return Err(EngineError::Model(format!(
                "dense matrix of {} values is not {n}×{k}",
                w.len()
            )));
        }
        let panels = n.div_ceil(NR);
        let mut data = vec![0f32; panels * k * NR];
        for (r, row) in w.chunks_exact(k).enumerate() {
            let (p, j) = (r / NR, r % NR);
            let panel = &mut data[p * k * NR..][..k * NR];
            for (kk, &v) in row.iter().enumerate() {
                panel[kk * NR + j] = v;
            }
        }
        Ok(DensePanels { n, k, data })
    }

    /// Output width.
    pub(crate) fn rows(&self) -> usize {
        self.n
    }

    /// Input width.
    pub(crate) fn cols(&self) -> usize {
        self.k
    }

    /// Whether this CPU runs the AVX-512 or the AVX2 kernel (else the portable loop is used).
    pub(crate) fn is_fast() -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            avx512::available() || avx2::available()
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            false
        }
    }

    /// `x [m, k] · Wᵀ → [m, n]` (row-major).
    pub(crate) fn matmul(&self, x: &[f32], m: usize) -> Result<Vec<f32>, EngineError> {
        if x.len() != m * self.k {
            return Err(EngineError::Tensor(format!(
                "dense matmul: input has {} values, expected {m}×{}",
                x.len(),
                self.k
            )));
        }
        let n = self.n;
        let mut out = vec![0f32; m * n];
        if m == 0 {
            return Ok(out);
        }
        let panels = n.div_ceil(NR);
        let row_blocks = m.div_ceil(MC);
        // Enough tasks for the pool, each at least a few panels wide.
        let threads = rayon::current_num_threads().max(1);
        let want_groups = (threads * 2).div_ceil(row_blocks).max(1);
        let panels_per_group = panels.div_ceil(want_groups).max(1);
        let groups = panels.div_ceil(panels_per_group);
        let ptr = OutPtr::new(&mut out);
        (0..row_blocks * groups).into_par_iter().for_each(|task| {
            let (rb, g) = (task / groups, task % groups);
            let rows = rb * MC..((rb + 1) * MC).min(m);
            let ps = g * panels_per_group..((g + 1) * panels_per_group).min(panels);
            // SAFETY: tasks cover disjoint (rows × panels) rectangles of `out` (`m × n`),
            // which lives until the parallel loop has joined.
            unsafe { self.block(x, rows, ps, ptr.get(), m) };
        });
        Ok(out)
    }

    /// Output rows `rows` × the columns of panels `ps`.
    ///
    /// # Safety
    /// `out` points to `m × n` floats; no other thread writes this rectangle.
    unsafe fn block(
        &self,
        x: &[f32],
        rows: std::ops::Range<usize>,
        ps: std::ops::Range<usize>,
        out: *mut f32,
        m: usize,
    ) {
        debug_assert!(rows.end <= m);
        #[cfg(target_arch = "x86_64")]
        {
            if avx512::available() {
                // SAFETY: AVX-512F and FMA are present (checked above); the caller's contract.
                avx512::block(self, x, rows, ps, out);
                return;
            }
            if avx2::available() {
                // SAFETY: AVX2 and FMA are present (checked above); the caller's contract.
                avx2::block(self, x, rows, ps, out);
                return;
            }
        }
        self.block_portable(x, rows, ps, out);
    }

    /// The portable loop over the same panels.
    ///
    /// # Safety
    /// As [`DensePanels::block`].
    unsafe fn block_portable(
        &self,
        x: &[f32],
        rows: std::ops::Range<usize>,
        ps: std::ops::Range<usize>,
        out: *mut f32,
    ) {
        let (n, k) = (self.n, self.k);
        for p in ps {
            let panel = &self.data[p * k * NR..][..k * NR];
            let width = (n - p * NR).min(NR);
            for i in rows.clone() {
                let xr = &x[i * k..][..k];
                let mut acc = [0f32; NR];
                for (kk, &xv) in xr.iter().enumerate() {
                    for (a, &w) in acc.iter_mut().zip(&panel[kk * NR..][..NR]) {
                        *a = xv.mul_add(w, *a);
                    }
                }
                for (j, &a) in acc.iter().enumerate().take(width) {
                    *out.add(i * n + p * NR + j) = a;
                }
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    use super::{DensePanels, MR, NR};

    pub(super) fn available() -> bool {
        std::arch::is_x86_feature_detected!("avx512f") && std::arch::is_x86_feature_detected!("fma")
    }

    /// `R` activation rows from row `i0` against panel `p`: a `R × 32` output tile.
    #[inline(always)]
    unsafe fn tile<const R: usize>(
        w: &DensePanels,
        x: *const f32,
        i0: usize,
        p: usize,
        out: *mut f32,
    ) {
        let (n, k) = (w.n, w.k);
        let panel = w.data.as_ptr().add(p * k * NR);
        let xs = x.add(i0 * k);
        let mut acc = [[_mm512_setzero_ps(); 2]; R];
        for kk in 0..k {
            let w0 = _mm512_loadu_ps(panel.add(kk * NR));
            let w1 = _mm512_loadu_ps(panel.add(kk * NR + 16));
            for (a, acc_a) in acc.iter_mut().enumerate() {
                let xv = _mm512_set1_ps(*xs.add(a * k + kk));
                acc_a[0] = _mm512_fmadd_ps(xv, w0, acc_a[0]);
                acc_a[1] = _mm512_fmadd_ps(xv, w1, acc_a[1]);
            }
        }
        let width = (n - p * NR).min(NR);
        for (a, acc_a) in acc.iter().enumerate() {
            let dst = out.add((i0 + a) * n + p * NR);
            if width == NR {
                _mm512_storeu_ps(dst, acc_a[0]);
                _mm512_storeu_ps(dst.add(16), acc_a[1]);
            } else {
                let mut tmp = [0f32; NR];
                _mm512_storeu_ps(tmp.as_mut_ptr(), acc_a[0]);
                _mm512_storeu_ps(tmp.as_mut_ptr().add(16), acc_a[1]);
                std::ptr::copy_nonoverlapping(tmp.as_ptr(), dst, width);
            }
        }
    }

    /// Output rows `rows` × panels `ps`, panel by panel (the panel stays in L1/L2 while the
    /// row block streams through it).
    ///
    /// # Safety
    /// AVX-512F and FMA available; `x` holds `rows.end · k` floats; `out` points to an
    /// output of `rows.end · n` floats or more whose rectangle no other thread writes.
    #[target_feature(enable = "avx512f,fma")]
    pub(super) unsafe fn block(
        w: &DensePanels,
        x: &[f32],
        rows: std::ops::Range<usize>,
        ps: std::ops::Range<usize>,
        out: *mut f32,
    ) {
        assert!(x.len() >= rows.end * w.k && ps.end * NR < w.n + NR);
        let xp = x.as_ptr();
        for p in ps {
            let mut i = rows.start;
            while i < rows.end {
                let left = rows.end - i;
                i += if left >= MR {
                    tile::<MR>(w, xp, i, p, out);
                    MR
                } else if left >= 8 {
                    tile::<8>(w, xp, i, p, out);
                    8
                } else if left >= 4 {
                    tile::<4>(w, xp, i, p, out);
                    4
                } else if left >= 2 {
                    tile::<2>(w, xp, i, p, out);
                    2
                } else {
                    tile::<1>(w, xp, i, p, out);
                    1
                };
            }
        }
    }
}

/// The same panels with 8-lane AVX2 registers (CPUs without AVX-512): a `3 × 32` tile in 12
/// accumulators (of 16 registers), the weights' four vectors loaded once per `kk` and used by
/// every row. Every output is the same `kk`-ordered chain of fused multiply-adds as in the
/// AVX-512 kernel, so both give the same bits.
/// The same panels with 8-lane AVX2 registers (CPUs without AVX-512): a `6 × 16` tile (half a
/// panel) in 12 accumulators of the 16 registers; per `kk` two weight vectors and six
/// broadcast activations feed 12 fused multiply-adds. Every output is the same `kk`-ordered
/// chain of fused multiply-adds as in the AVX-512 kernel, so both give the same bits.
#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::{DensePanels, NR};

    /// Activation rows per micro-tile (a divisor of [`super::MC`]).
    const MR: usize = 6;
    /// Columns per micro-tile: half a panel, two registers.
    const NC: usize = 16;

    pub(super) use crate::model::simd::avx2::available;

    /// `R` activation rows from row `i0` against columns `h·16..h·16 + 16` of panel `p`.
    #[inline(always)]
    unsafe fn tile<const R: usize>(
        w: &DensePanels,
        x: *const f32,
        i0: usize,
        p: usize,
        h: usize,
        out: *mut f32,
    ) {
        let (n, k) = (w.n, w.k);
        let col0 = p * NR + h * NC;
        if col0 >= n {
            return;
        }
        let panel = w.data.as_ptr().add(p * k * NR + h * NC);
        let xs = x.add(i0 * k);
        let mut acc = [[_mm256_setzero_ps(); 2]; R];
        for kk in 0..k {
            let w0 = _mm256_loadu_ps(panel.add(kk * NR));
            let w1 = _mm256_loadu_ps(panel.add(kk * NR + 8));
            for (a, acc_a) in acc.iter_mut().enumerate() {
                let xv = _mm256_set1_ps(*xs.add(a * k + kk));
                acc_a[0] = _mm256_fmadd_ps(xv, w0, acc_a[0]);
                acc_a[1] = _mm256_fmadd_ps(xv, w1, acc_a[1]);
            }
        }
        let width = (n - col0).min(NC);
        for (a, acc_a) in acc.iter().enumerate() {
            let dst = out.add((i0 + a) * n + col0);
            if width == NC {
                _mm256_storeu_ps(dst, acc_a[0]);
                _mm256_storeu_ps(dst.add(8), acc_a[1]);
            } else {
                let mut tmp = [0f32; NC];
                _mm256_storeu_ps(tmp.as_mut_ptr(), acc_a[0]);
                _mm256_storeu_ps(tmp.as_mut_ptr().add(8), acc_a[1]);
                std::ptr::copy_nonoverlapping(tmp.as_ptr(), dst, width);
            }
        }
    }

    /// As the AVX-512 `block`.
    ///
    /// # Safety
    /// AVX2 and FMA available; `x` holds `rows.end · k` floats; `out` points to an output of
    /// `rows.end · n` floats or more whose rectangle no other thread writes.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn block(
        w: &DensePanels,
        x: &[f32],
        rows: std::ops::Range<usize>,
        ps: std::ops::Range<usize>,
        out: *mut f32,
    ) {
        assert!(x.len() >= rows.end * w.k && ps.end * NR < w.n + NR);
        let xp = x.as_ptr();
        for p in ps {
            for h in 0..NR / NC {
                let mut i = rows.start;
                while i < rows.end {
                    let left = rows.end - i;
                    i += if left >= MR {
                        tile::<MR>(w, xp, i, p, h, out);
                        MR
                    } else if left >= 3 {
                        tile::<3>(w, xp, i, p, h, out);
                        3
                    } else {
                        tile::<1>(w, xp, i, p, h, out);
                        1
                    };
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::packed::tests::rnd_vec;
    use super::*;

    fn naive(x: &[f32], w: &[f32], m: usize, n: usize, k: usize) -> Vec<f32> {
        let mut out = vec![0f32; m * n];
        for i in 0..m {
            for j in 0..n {
                out[i * n + j] = (0..k)
                    .map(|kk| f64::from(x[i * k + kk]) * f64::from(w[j * k + kk]))
                    .sum::<f64>() as f32;
            }
        }
        out
    }

    /// The kernels against an f64 reference, and against each other bit for bit for shapes around the tile and task sizes
    /// (ragged last panel, row tails of every tile height, several row blocks).
    #[test]
    fn matches_naive_matmul() {
        let seed = 0x6e33_u64;
        println!("seed {seed}");
        for (m, n, k) in [
            (1, 1, 1),
            (3, 37, 96),
            (13, 64, 40),
            (25, 70, 33),
            (97, 33, 64),
            (200, 96, 17),
        ] {
            let w = rnd_vec(seed + n as u64, n * k);
            let x = rnd_vec(seed + m as u64, m * k);
            let p = DensePanels::new(&w, n, k).unwrap();
            let want = naive(&x, &w, m, n, k);
            let got = p.matmul(&x, m).unwrap();
            let mut portable = vec![0f32; m * n];
            // SAFETY: one thread writes the whole output.
            unsafe { p.block_portable(&x, 0..m, 0..n.div_ceil(NR), portable.as_mut_ptr()) };
            #[cfg(target_arch = "x86_64")]
            if avx2::available() {
                let mut v8 = vec![0f32; m * n];
                // SAFETY: AVX2/FMA checked; one thread writes the whole output.
                unsafe { avx2::block(&p, &x, 0..m, 0..n.div_ceil(NR), v8.as_mut_ptr()) };
                assert!(
                    v8.iter()
                        .zip(&portable)
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "avx2 m={m} n={n} k={k}: not the portable loop's bits"
                );
            }
            assert!(
                got.iter()
                    .zip(&portable)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "m={m} n={n} k={k}: the dispatched kernel differs from the portable loop"
            );
            for ((a, b), c) in got.iter().zip(&want).zip(&portable) {
                let tol = 1e-5 * (k as f32).sqrt() * 4.0;
                assert!((a - b).abs() < tol, "m={m} n={n} k={k}: {a} vs {b}");
                assert!(
                    (c - b).abs() < tol,
                    "portable m={m} n={n} k={k}: {c} vs {b}"
                );
            }
        }
    }

    #[test]
    fn rejects_wrong_shapes() {
        assert!(DensePanels::new(&[1.0; 6], 2, 4).is_err());
        let p = DensePanels::new(&[1.0; 8], 2, 4).unwrap();
        assert!(p.matmul(&[1.0; 5], 1).is_err());
        assert_eq!(p.matmul(&[1.0; 4], 1).unwrap(), vec![4.0, 4.0]);
    }

    /// Kernel timing (run on purpose: `cargo test --release -p engine --lib gemm_timing --
    /// --ignored --nocapture`): this GEMM and candle's alternated in one process on SmolLM2's
    /// gate/up shape, all on all cores, with the packed Q4_1 kernel for comparison.
    #[test]
    #[ignore = "timing: run explicitly with --ignored --nocapture"]
    fn gemm_timing() {
        use candle_core::{Device, Tensor};
        let (n, k) = (3072, 576);
        let w = rnd_vec(5, n * k);
        let p = DensePanels::new(&w, n, k).unwrap();
        let wd = Tensor::from_vec(w, (n, k), &Device::Cpu).unwrap();
        let q =
            candle_core::quantized::QTensor::quantize(&wd, candle_core::quantized::GgmlDType::Q4_1)
                .unwrap();
        let packed = super::super::packed::PackedMatrix::from_qtensor(&q)
            .unwrap()
            .unwrap();
        let wt = wd.t().unwrap();
        for m in [8usize, 16, 32, 64, 128, 512] {
            let x = rnd_vec(6, m * k);
            let xt = Tensor::from_vec(x.clone(), (m, k), &Device::Cpu).unwrap();
            let mut best = [f64::INFINITY; 3];
            for _ in 0..10 {
                let t = std::time::Instant::now();
                let _ = p.matmul(&x, m).unwrap();
                best[0] = best[0].min(t.elapsed().as_secs_f64());
                let t = std::time::Instant::now();
                let _ = xt.matmul(&wt).unwrap();
                best[1] = best[1].min(t.elapsed().as_secs_f64());
                let t = std::time::Instant::now();
                let _ = packed.matmul(&x, m).unwrap();
                best[2] = best[2].min(t.elapsed().as_secs_f64());
            }
            let gmac = |s: f64| (m * n * k) as f64 / s / 1e9;
            println!(
                "m={m}: panels {:.3} ms ({:.1} GMAC/s), candle F32 {:.3} ms ({:.1}), packed Q4_1 {:.3} ms ({:.1})",
                best[0] * 1e3,
                gmac(best[0]),
                best[1] * 1e3,
                gmac(best[1]),
                best[2] * 1e3,
                gmac(best[2]),
            );
        }
    }
}
