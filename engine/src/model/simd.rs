//! What the AVX2 kernels of [`super::attention`], [`super::gemm`] and [`super::packed`] share:
//! the run-time check and horizontal reductions of an 8-lane register.

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2 {
    use std::arch::x86_64::*;

    /// Whether this CPU has AVX2 and FMA (the AVX2 kernels need both).
    pub(crate) fn available() -> bool {
        std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
    }

    /// The sum of `v`'s 8 lanes: `((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7))`.
    ///
    /// # Safety
    /// AVX available (implied by [`available`]).
    #[inline(always)]
    pub(crate) unsafe fn hsum(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_shuffle_ps::<1>(s, s));
        _mm_cvtss_f32(s)
    }

    /// The largest of `v`'s 8 lanes.
    ///
    /// # Safety
    /// As [`hsum`].
    #[inline(always)]
    pub(crate) unsafe fn hmax(v: __m256) -> f32 {
        let m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        let m = _mm_max_ss(m, _mm_shuffle_ps::<1>(m, m));
        _mm_cvtss_f32(m)
    }
}
