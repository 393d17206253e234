//! Paged attention on the CPU: every query token of every chunk attends to its sequence's
//! keys `0..=position`, read in place through the sequence's block table (no gather copy),
//! with grouped KV heads and the causal mask given by true positions.
//!
//! Work is split into `(token, kv head)` items run on candle's rayon pool; each item computes
//! the scores of the `n_head / n_kv_head` query heads sharing that KV head in one pass over the
//! keys, a softmax, then one pass over the values. Cost per layer: `O(Σ_tokens pos · n_head ·
//! head_dim)` multiply-adds, memory `O(n_head / n_kv_head · max_pos)` scratch per thread.
//! The inner loops are compiled twice, generic and with AVX2+FMA enabled (chosen at run time).

use rayon::prelude::*;

/// Where one chunk's tokens sit in the packed step and where its keys live.
#[derive(Clone, Debug)]
pub(crate) struct ChunkSlots {
    /// Index of the chunk's first token in the packed step.
    pub token_offset: usize,
    /// Tokens in the chunk.
    pub len: usize,
    /// Position of the chunk's first token.
    pub start_pos: usize,
    /// Cache slot (`block * block_size + offset`) of every position `0..start_pos + len`.
    pub slots: Vec<usize>,
}

/// Shapes of one attention call.
#[derive(Clone, Copy, Debug)]
pub(crate) struct AttnShape {
    pub n_head: usize,
    pub n_kv_head: usize,
    pub head_dim: usize,
    /// Floats between consecutive tokens' query rows in `q`.
    pub q_stride: usize,
    pub scale: f32,
}

/// Computes attention for every token of `chunks` into `out` (`[tokens, n_head · head_dim]`).
///
/// `q` holds each token's query heads at `q[t · q_stride ..][.. n_head · head_dim]` (RoPE
/// applied); `k_cache` / `v_cache` are `[slots, n_kv_head, head_dim]` and already hold this
/// step's keys and values.
pub(crate) fn paged_attention(
    q: &[f32],
    k_cache: &[f32],
    v_cache: &[f32],
    chunks: &[ChunkSlots],
    token_chunk: &[usize],
    shape: AttnShape,
    out: &mut [f32],
) {
    let rk = shape.n_head / shape.n_kv_head;
    let d = shape.head_dim;
    let group = rk * d;
    out.par_chunks_mut(group)
        .enumerate()
        .for_each_init(Vec::new, |scratch, (item, out_group)| {
            let t = item / shape.n_kv_head;
            let g = item % shape.n_kv_head;
            let c = &chunks[token_chunk[t]];
            let pos = c.start_pos + (t - c.token_offset);
            let q_group = &q[t * shape.q_stride + g * group..][..group];
            let keys = &c.slots[..=pos];
            attend_group(
                q_group, k_cache, v_cache, keys, g, shape, scratch, out_group,
            );
        });
}

/// One `(token, kv head)` item, dispatched to the best compiled variant.
#[allow(clippy::too_many_arguments)]
fn attend_group(
    q: &[f32],
    k_cache: &[f32],
    v_cache: &[f32],
    slots: &[usize],
    g: usize,
    shape: AttnShape,
    scratch: &mut Vec<f32>,
    out: &mut [f32],
) {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
        {
            // SAFETY: the CPU supports AVX2 and FMA (checked just above); the function has
            // no other safety requirement.
            unsafe { attend_group_avx2(q, k_cache, v_cache, slots, g, shape, scratch, out) };
            return;
        }
    }
    attend_group_impl(q, k_cache, v_cache, slots, g, shape, scratch, out);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
unsafe fn attend_group_avx2(
    q: &[f32],
    k_cache: &[f32],
    v_cache: &[f32],
    slots: &[usize],
    g: usize,
    shape: AttnShape,
    scratch: &mut Vec<f32>,
    out: &mut [f32],
) {
    attend_group_impl(q, k_cache, v_cache, slots, g, shape, scratch, out);
}

/// Dot product with 16 independent accumulators (vectorizes without float reassociation).
#[inline(always)]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 16];
    let mut ca = a.chunks_exact(16);
    let mut cb = b.chunks_exact(16);
    for (x, y) in (&mut ca).zip(&mut cb) {
        for i in 0..16 {
            acc[i] += x[i] * y[i];
        }
    }
    let mut tail = 0f32;
    for (x, y) in ca.remainder().iter().zip(cb.remainder()) {
        tail += x * y;
    }
    let mut s = [0f32; 4];
    for i in 0..4 {
        s[i] = acc[i] + acc[i + 4] + acc[i + 8] + acc[i + 12];
    }
    (s[0] + s[2]) + (s[1] + s[3]) + tail
}

#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn attend_group_impl(
    q: &[f32],
    k_cache: &[f32],
    v_cache: &[f32],
    slots: &[usize],
    g: usize,
    shape: AttnShape,
    scratch: &mut Vec<f32>,
    out: &mut [f32],
) {
    let d = shape.head_dim;
    let hk = shape.n_kv_head;
    let rk = shape.n_head / hk;
    let n = slots.len();
    scratch.clear();
    scratch.resize(rk * n, 0.0);
    // Scores: one pass over the keys, all query heads of the group.
    for (j, &slot) in slots.iter().enumerate() {
        let kr = &k_cache[(slot * hk + g) * d..][..d];
        for r in 0..rk {
            scratch[r * n + j] = dot(&q[r * d..][..d], kr) * shape.scale;
        }
    }
    // Softmax per query head.
    for r in 0..rk {
        let row = &mut scratch[r * n..][..n];
        let m = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut sum = 0f32;
        for x in row.iter_mut() {
            *x = (*x - m).exp();
            sum += *x;
        }
        let inv = if sum > 0.0 { 1.0 / sum } else { 0.0 };
        for x in row.iter_mut() {
            *x *= inv;
        }
    }
    // Weighted values: one pass over the values.
    out.fill(0.0);
    for (j, &slot) in slots.iter().enumerate() {
        let vr = &v_cache[(slot * hk + g) * d..][..d];
        for r in 0..rk {
            let p = scratch[r * n + j];
            let o = &mut out[r * d..][..d];
            for (oi, vi) in o.iter_mut().zip(vr) {
                *oi += p * vi;
            }
        }
    }
}

/// Applies interleaved RoPE (GGUF Llama convention: pairs `(x[2i], x[2i+1])` rotate by
/// `pos · base^(-2i/d)`) in place to `heads` consecutive heads of `head_dim` at `x`.
pub(crate) fn rope_interleaved(x: &mut [f32], heads: usize, head_dim: usize, cos_sin: &[f32]) {
    let half = head_dim / 2;
    for h in 0..heads {
        let xh = &mut x[h * head_dim..][..head_dim];
        for i in 0..half {
            let (c, s) = (cos_sin[2 * i], cos_sin[2 * i + 1]);
            let (x0, x1) = (xh[2 * i], xh[2 * i + 1]);
            xh[2 * i] = x0 * c - x1 * s;
            xh[2 * i + 1] = x0 * s + x1 * c;
        }
    }
}

/// `[cos, sin]` interleaved for every frequency of a head at position `pos`.
pub(crate) fn rope_cos_sin(pos: usize, head_dim: usize, base: f32, out: &mut Vec<f32>) {
    let half = head_dim / 2;
    out.clear();
    for i in 0..half {
        let inv_freq = 1.0 / f64::from(base).powf(2.0 * i as f64 / head_dim as f64);
        let angle = pos as f64 * inv_freq;
        out.push(angle.cos() as f32);
        out.push(angle.sin() as f32);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Naive attention over a contiguous cache, for comparison.
    fn naive(
        q: &[f32],
        k: &[f32],
        v: &[f32],
        pos: usize,
        hq: usize,
        hk: usize,
        d: usize,
    ) -> Vec<f32> {
        let rk = hq / hk;
        let scale = 1.0 / (d as f32).sqrt();
        let mut out = vec![0f32; hq * d];
        for h in 0..hq {
            let g = h / rk;
            let scores: Vec<f32> = (0..=pos)
                .map(|j| {
                    (0..d)
                        .map(|i| q[h * d + i] * k[(j * hk + g) * d + i])
                        .sum::<f32>()
                        * scale
                })
                .collect();
            let m = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let e: Vec<f32> = scores.iter().map(|s| (s - m).exp()).collect();
            let z: f32 = e.iter().sum();
            for (j, w) in e.iter().enumerate() {
                for i in 0..d {
                    out[h * d + i] += w / z * v[(j * hk + g) * d + i];
                }
            }
        }
        out
    }

    #[test]
    fn paged_matches_naive_with_scattered_slots() {
        let seed = 0x5eed_u64;
        println!("seed {seed}");
        let mut state = seed;
        let mut rnd = || {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((state >> 33) as f32 / (1u64 << 31) as f32) - 0.5
        };
        let (hq, hk, d, n_pos, block) = (6, 2, 20, 11, 4);
        // Blocks 2, 0, 3 hold positions 0..4, 4..8, 8..11.
        let table = [2usize, 0, 3];
        let slots: Vec<usize> = (0..n_pos)
            .map(|p| table[p / block] * block + p % block)
            .collect();
        let k_contig: Vec<f32> = (0..n_pos * hk * d).map(|_| rnd()).collect();
        let v_contig: Vec<f32> = (0..n_pos * hk * d).map(|_| rnd()).collect();
        let mut k_cache = vec![0f32; 4 * block * hk * d];
        let mut v_cache = vec![0f32; 4 * block * hk * d];
        for p in 0..n_pos {
            let row = hk * d;
            k_cache[slots[p] * row..][..row].copy_from_slice(&k_contig[p * row..][..row]);
            v_cache[slots[p] * row..][..row].copy_from_slice(&v_contig[p * row..][..row]);
        }
        // A chunk of the last 3 positions.
        let q: Vec<f32> = (0..3 * hq * d).map(|_| rnd()).collect();
        let chunks = [ChunkSlots {
            token_offset: 0,
            len: 3,
            start_pos: 8,
            slots,
        }];
        let shape = AttnShape {
            n_head: hq,
            n_kv_head: hk,
            head_dim: d,
            q_stride: hq * d,
            scale: 1.0 / (d as f32).sqrt(),
        };
        let mut out = vec![0f32; 3 * hq * d];
        paged_attention(&q, &k_cache, &v_cache, &chunks, &[0, 0, 0], shape, &mut out);
        for t in 0..3 {
            let want = naive(
                &q[t * hq * d..][..hq * d],
                &k_contig,
                &v_contig,
                8 + t,
                hq,
                hk,
                d,
            );
            for (a, b) in out[t * hq * d..][..hq * d].iter().zip(&want) {
                assert!((a - b).abs() < 1e-5, "token {t}: {a} vs {b}");
            }
        }
    }

    #[test]
    fn rope_at_zero_is_identity() {
        let mut cs = Vec::new();
        rope_cos_sin(0, 8, 10_000.0, &mut cs);
        let mut x = vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0];
        let before = x.clone();
        rope_interleaved(&mut x, 1, 8, &cs);
        assert_eq!(x, before);
    }
}
