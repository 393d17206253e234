//! Paged attention on the CPU: every query token of every chunk attends to its sequence's
//! keys `0..=position`, read in place through the sequence's block table (no gather copy),
//! with grouped KV heads and the causal mask given by true positions.
//!
//! KV layout ([`KvLayout`], per layer): K as `[blocks, n_kv_head, head_dim, block_size]` — each
//! block's keys stored dimension-major, so one 16-lane load reads one dimension of 16
//! consecutive keys — and V as `[blocks, n_kv_head, block_size, head_dim]`. Scores are then an
//! outer-product accumulation (lanes = keys, no horizontal sums) and the weighted values one
//! (lanes = dimensions).
//!
//! Work is split into `(chunk, group of up to [`TQ`] consecutive tokens, kv head)` items on the
//! rayon pool; an item computes the scores of all its query vectors (tokens × the
//! `n_head / n_kv_head` heads sharing the KV head) in one pass over the keys — each key block is
//! loaded once per item, not once per query — then a masked softmax per query, then one pass
//! over the values. Cost per layer: `O(Σ_tokens pos · n_head · head_dim)` multiply-adds (plus
//! up to `TQ − 1` masked keys per query), memory `O(TQ · n_head / n_kv_head · max_pos)` scratch
//! per thread. Hand-written AVX-512 kernels when the CPU has them and `block_size` and
//! `head_dim` are multiples of 16, AVX2 ones (8 lanes) when it has AVX2 and FMA and they are
//! multiples of 8; a portable loop over the same layout otherwise.

use rayon::prelude::*;

use super::gemm::OutPtr;

/// Tokens of one chunk sharing a pass over the keys.
const TQ: usize = 4;

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
    /// Sliding-window attention: a query at position `p` sees keys `p + 1 − window ..= p` only
    /// (llama.cpp's standard SWA mask); `None`: every earlier key.
    pub window: Option<usize>,
}

/// Where each key and value lives in a layer's K and V buffers.
#[derive(Clone, Copy, Debug)]
pub(crate) struct KvLayout {
    pub n_kv_head: usize,
    pub head_dim: usize,
    pub block_size: usize,
}

/// One layer's K and V storage in [`KvLayout`]: f32, or f16 for
/// [`super::WeightFormat::LlamaCpp`] (llama.cpp's F16 cache: every key and value rounded to
/// the nearest f16 as it is stored). An f16 store takes half the memory — twice the blocks for a
/// KV budget — and half the bytes attention reads; before the kernels run, an item converts
/// each block it reads back to f32 (exact) in its scratch, so the results equal those of an f32
/// store holding the rounded values, bit for bit (tested).
pub(crate) enum LayerKv {
    F32 { k: Vec<f32>, v: Vec<f32> },
    F16 { k: Vec<u16>, v: Vec<u16> },
}

impl LayerKv {
    /// `values` zero-filled elements in each of K and V (f16 when `f16`).
    pub(crate) fn zeroed(values: usize, f16: bool) -> Result<Self, String> {
        fn alloc<T: Clone + Default>(n: usize) -> Result<Vec<T>, String> {
            let mut v = Vec::new();
            v.try_reserve_exact(n)
                .map_err(|e| format!("cannot allocate a KV cache of {n} values: {e}"))?;
            v.resize(n, T::default());
            Ok(v)
        }
        Ok(if f16 {
            LayerKv::F16 {
                k: alloc(values)?,
                v: alloc(values)?,
            }
        } else {
            LayerKv::F32 {
                k: alloc(values)?,
                v: alloc(values)?,
            }
        })
    }
}

impl LayerKv {
    /// Copies block `src`'s keys and values (`n` elements each) over block `dst`'s.
    pub(crate) fn copy_block(&mut self, src: usize, dst: usize, n: usize) {
        fn copy<T: Copy>(x: &mut [T], src: usize, dst: usize, n: usize) {
            if src != dst {
                x.copy_within(src * n..(src + 1) * n, dst * n);
            }
        }
        match self {
            LayerKv::F32 { k, v } => {
                copy(k, src, dst, n);
                copy(v, src, dst, n);
            }
            LayerKv::F16 { k, v } => {
                copy(k, src, dst, n);
                copy(v, src, dst, n);
            }
        }
    }
}

/// Block parts of one K or V store.
#[derive(Clone, Copy)]
enum Part<'a> {
    F32(&'a [f32]),
    F16(&'a [u16]),
}

impl<'a> Part<'a> {
    /// Elements `at .. at + n` as f32: in place, or converted into `tmp` (at least `n` long).
    fn floats(self, at: usize, n: usize, tmp: &'a mut [f32]) -> &'a [f32] {
        match self {
            Part::F32(x) => &x[at..][..n],
            Part::F16(x) => {
                f16_bits_to_f32(&x[at..][..n], &mut tmp[..n]);
                &tmp[..n]
            }
        }
    }
}

/// `x` rounded to the nearest f16 (ties to even; beyond f16's range ±inf, below it subnormal or
/// zero), back in f32: what an F16 cache would hold.
pub(crate) fn round_to_f16(x: f32) -> f32 {
    half::f16::from_f32(x).to_f32()
}

/// `src` as f16 bits, each rounded to the nearest (ties to even): 8 at a time with F16C (the
/// instruction `half` uses for one value, so the same bits) where the CPU has it.
pub(crate) fn f32_to_f16_bits(src: &[f32], dst: &mut [u16]) {
    assert_eq!(src.len(), dst.len());
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("f16c") {
            // SAFETY: F16C checked just above; equal lengths asserted.
            unsafe { f16c::narrow(src, dst) };
            return;
        }
    }
    for (d, &x) in dst.iter_mut().zip(src) {
        *d = half::f16::from_f32(x).to_bits();
    }
}

/// f16 bits `src` as f32 (exact), 8 at a time with F16C where the CPU has it.
pub(crate) fn f16_bits_to_f32(src: &[u16], dst: &mut [f32]) {
    assert_eq!(src.len(), dst.len());
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("f16c") {
            // SAFETY: F16C checked just above; equal lengths asserted.
            unsafe { f16c::widen(src, dst) };
            return;
        }
    }
    for (d, &h) in dst.iter_mut().zip(src) {
        *d = half::f16::from_bits(h).to_f32();
    }
}

#[cfg(target_arch = "x86_64")]
mod f16c {
    use std::arch::x86_64::*;

    /// # Safety
    /// F16C available; `src.len() == dst.len()`.
    #[target_feature(enable = "avx,f16c")]
    pub(super) unsafe fn narrow(src: &[f32], dst: &mut [u16]) {
        let (chunks, tail) = src.as_chunks::<8>();
        let (out, out_tail) = dst.as_chunks_mut::<8>();
        for (c, o) in chunks.iter().zip(out) {
            let h = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(_mm256_loadu_ps(c.as_ptr()));
            _mm_storeu_si128(o.as_mut_ptr() as *mut __m128i, h);
        }
        for (d, &x) in out_tail.iter_mut().zip(tail) {
            *d = half::f16::from_f32(x).to_bits();
        }
    }

    /// # Safety
    /// F16C available; `src.len() == dst.len()`.
    #[target_feature(enable = "avx,f16c")]
    pub(super) unsafe fn widen(src: &[u16], dst: &mut [f32]) {
        let (chunks, tail) = src.as_chunks::<8>();
        let (out, out_tail) = dst.as_chunks_mut::<8>();
        for (c, o) in chunks.iter().zip(out) {
            let h = _mm_loadu_si128(c.as_ptr() as *const __m128i);
            _mm256_storeu_ps(o.as_mut_ptr(), _mm256_cvtph_ps(h));
        }
        for (d, &h) in out_tail.iter_mut().zip(tail) {
            *d = half::f16::from_bits(h).to_f32();
        }
    }
}

impl KvLayout {
    /// Floats per block in each of K and V.
    pub(crate) fn block_floats(&self) -> usize {
        self.n_kv_head * self.head_dim * self.block_size
    }

    /// Stores one token's keys and values (`[n_kv_head · head_dim]` each) in `slot` (an f16
    /// store rounds them to f16).
    pub(crate) fn write(&self, kv: &mut LayerKv, slot: usize, k: &[f32], v: &[f32]) {
        let (hk, d, bs) = (self.n_kv_head, self.head_dim, self.block_size);
        let (b, o) = (slot / bs, slot % bs);
        let n = self.block_floats();
        match kv {
            LayerKv::F32 { k: kc, v: vc } => {
                let kb = &mut kc[b * n..][..n];
                for g in 0..hk {
                    for i in 0..d {
                        kb[(g * d + i) * bs + o] = k[g * d + i];
                    }
                }
                let vb = &mut vc[b * n..][..n];
                for g in 0..hk {
                    vb[(g * bs + o) * d..][..d].copy_from_slice(&v[g * d..][..d]);
                }
            }
            LayerKv::F16 { k: kc, v: vc } => {
                // Keys: converted 64 at a time through a stack buffer (no allocation per token
                // and layer), then scattered dimension-major: element `j = g·d + i` of the row
                // goes to `j·bs + o`.
                let kb = &mut kc[b * n..][..n];
                let mut buf = [0u16; 64];
                for (c, chunk) in k[..hk * d].chunks(64).enumerate() {
                    let bits = &mut buf[..chunk.len()];
                    f32_to_f16_bits(chunk, bits);
                    for (t, &h) in bits.iter().enumerate() {
                        kb[(c * 64 + t) * bs + o] = h;
                    }
                }
                let vb = &mut vc[b * n..][..n];
                for g in 0..hk {
                    f32_to_f16_bits(&v[g * d..][..d], &mut vb[(g * bs + o) * d..][..d]);
                }
            }
        }
    }

    /// Where block `b`'s keys (`[head_dim, block_size]`) or values (`[block_size, head_dim]`)
    /// of KV head `g` start, and how many there are.
    fn part(&self, b: usize, g: usize) -> (usize, usize) {
        let n = self.head_dim * self.block_size;
        (b * self.block_floats() + g * n, n)
    }
}

/// One unit of work: tokens `t0..t0 + nt` of chunk `c`, KV head `g`.
#[derive(Clone, Copy, Debug)]
struct Item {
    c: usize,
    t0: usize,
    nt: usize,
    g: usize,
}

/// Computes attention for every token of `chunks` into `out` (`[tokens, n_head · head_dim]`).
///
/// `q` holds each token's query heads at `q[t · q_stride ..][.. n_head · head_dim]` (RoPE
/// applied); `kv` is one layer's store in `layout` and already holds this step's keys and
/// values.
pub(crate) fn paged_attention(
    q: &[f32],
    kv: &LayerKv,
    chunks: &[ChunkSlots],
    layout: KvLayout,
    shape: AttnShape,
    out: &mut [f32],
) {
    let hq = shape.n_head;
    let total: usize = chunks.iter().map(|c| c.len).sum();
    assert!(
        out.len() >= total * hq * shape.head_dim
            && layout.n_kv_head == shape.n_kv_head
            && layout.head_dim == shape.head_dim
    );
    let mut items = Vec::new();
    for (ci, c) in chunks.iter().enumerate() {
        let mut t0 = 0;
        while t0 < c.len {
            let nt = (c.len - t0).min(TQ);
            for g in 0..shape.n_kv_head {
                items.push(Item { c: ci, t0, nt, g });
            }
            t0 += nt;
        }
    }
    // Every item writes only the head slices of its own tokens and KV head group.
    let ptr = OutPtr::new(out);
    let (keys, values) = match kv {
        LayerKv::F32 { k, v } => (Part::F32(k), Part::F32(v)),
        LayerKv::F16 { k, v } => (Part::F16(k), Part::F16(v)),
    };
    items
        .par_iter()
        .for_each_init(Scratch::default, |scratch, item| {
            // SAFETY: items write disjoint (token, head group) slices of `out`, sized above.
            unsafe {
                attend_item(
                    q,
                    keys,
                    values,
                    &chunks[item.c],
                    *item,
                    layout,
                    shape,
                    scratch,
                    ptr,
                )
            };
        });
}

/// Per-thread buffers.
#[derive(Default)]
struct Scratch {
    /// `[queries, keys]` scores, then probabilities.
    p: Vec<f32>,
    /// `[queries, head_dim]` outputs.
    o: Vec<f32>,
    /// `[queries, head_dim]` query vectors, gathered.
    q: Vec<f32>,
    /// Key blocks converted from an f16 store (up to `SPAN` blocks).
    k: Vec<f32>,
    /// A value block converted from an f16 store.
    v: Vec<f32>,
}

/// Key blocks per scores call.
const SPAN: usize = 4;

/// One item: its queries are `(token i, head r)` → row `i · rk + r`.
///
/// # Safety
/// `out` points to the whole `[tokens, n_head · head_dim]` output; no other item writes this
/// item's slices.
#[allow(clippy::too_many_arguments)]
unsafe fn attend_item(
    q: &[f32],
    k_store: Part<'_>,
    v_store: Part<'_>,
    c: &ChunkSlots,
    item: Item,
    layout: KvLayout,
    shape: AttnShape,
    s: &mut Scratch,
    out: OutPtr,
) {
    let (d, bs) = (shape.head_dim, layout.block_size);
    let rk = shape.n_head / shape.n_kv_head;
    let nq = item.nt * rk;
    let last_pos = c.start_pos + item.t0 + item.nt - 1;
    let n = last_pos + 1;
    let n_blocks = n.div_ceil(bs);
    let stride = n_blocks * bs;
    s.q.clear();
    for i in 0..item.nt {
        let t = c.token_offset + item.t0 + i;
        s.q.extend_from_slice(&q[t * shape.q_stride + item.g * rk * d..][..rk * d]);
    }
    s.p.clear();
    s.p.resize(nq * stride, 0.0);
    // Scores, up to SPAN key blocks at a time.
    let block_len = d * bs;
    // An f16 store under the AVX-512 kernels: they widen each key and value as they load it
    // (the same values, so the same bits) instead of a widening pass over every block first
    // (which took 9 % of an 8-stream decode, `perf record`, more than the products it fed).
    #[cfg(target_arch = "x86_64")]
    let fused = match (k_store, v_store) {
        (Part::F16(kh), Part::F16(vh))
            if bs.is_multiple_of(16) && d.is_multiple_of(16) && avx512::available() =>
        {
            Some((kh, vh))
        }
        _ => None,
    };
    #[cfg(not(target_arch = "x86_64"))]
    let fused: Option<(&[u16], &[u16])> = None;
    if matches!(k_store, Part::F16(_)) && fused.is_none() {
        s.k.resize(SPAN * block_len, 0.0);
    }
    let mut kb = 0;
    #[cfg(target_arch = "x86_64")]
    if let Some((kh, _)) = fused {
        while kb < n_blocks {
            let span = (n_blocks - kb).min(SPAN);
            let mut keys: [&[u16]; SPAN] = [&[]; SPAN];
            for (i, slot) in keys.iter_mut().enumerate().take(span) {
                let (at, n) = layout.part(c.slots[(kb + i) * bs] / bs, item.g);
                *slot = &kh[at..][..n];
            }
            // SAFETY: AVX-512F/FMA present, bs a multiple of 16 (checked above); shapes as
            // documented (checked inside).
            avx512::scores_blocks(&s.q, nq, d, bs, &keys[..span], &mut s.p, stride, kb * bs);
            kb += span;
        }
    }
    while kb < n_blocks {
        let span = (n_blocks - kb).min(SPAN);
        let mut keys: [&[f32]; SPAN] = [&[]; SPAN];
        // An f16 store's blocks are widened into SPAN chunks of `s.k`; an f32 store needs none.
        let mut tmp = s.k.chunks_mut(block_len.max(1));
        for (i, slot) in keys.iter_mut().enumerate().take(span) {
            let (at, n) = layout.part(c.slots[(kb + i) * bs] / bs, item.g);
            *slot = k_store.floats(at, n, tmp.next().unwrap_or_default());
        }
        scores_blocks(&s.q, nq, d, bs, &keys[..span], &mut s.p, stride, kb * bs);
        kb += span;
    }
    // Scale, causal (and sliding-window) mask and softmax per query.
    for i in 0..item.nt {
        let visible = c.start_pos + item.t0 + i + 1;
        let first = shape.window.map_or(0, |w| visible.saturating_sub(w));
        for r in 0..rk {
            let row = &mut s.p[(i * rk + r) * stride..][..stride];
            row[..first].fill(0.0);
            softmax_prefix(&mut row[first..], visible - first, shape.scale);
        }
    }
    // Weighted values.
    s.o.clear();
    s.o.resize(nq * d, 0.0);
    if matches!(v_store, Part::F16(_)) && fused.is_none() {
        s.v.resize(block_len, 0.0);
    }
    for kb in 0..n_blocks {
        let (at, len) = layout.part(c.slots[kb * bs] / bs, item.g);
        let keys = bs.min(n - kb * bs);
        #[cfg(target_arch = "x86_64")]
        if let Some((_, vh)) = fused {
            // SAFETY: AVX-512F/FMA present, d a multiple of 16 (checked above); shapes as
            // documented (checked inside).
            avx512::values_block(
                &s.p,
                stride,
                kb * bs,
                keys,
                nq,
                d,
                &vh[at..][..len],
                &mut s.o,
            );
            continue;
        }
        let values = v_store.floats(at, len, &mut s.v);
        values_block(&s.p, stride, kb * bs, keys, nq, d, values, &mut s.o);
    }
    for i in 0..item.nt {
        let t = c.token_offset + item.t0 + i;
        let dst = out.get().add(t * shape.n_head * d + item.g * rk * d);
        std::ptr::copy_nonoverlapping(s.o.as_ptr().add(i * rk * d), dst, rk * d);
    }
}

/// `p[r][j0 + j] = q_r · key_j` for the `bs` keys of one block (`keys` is `[d, bs]`).
#[allow(clippy::too_many_arguments)]
fn scores_block(
    q: &[f32],
    nq: usize,
    d: usize,
    bs: usize,
    keys: &[f32],
    p: &mut [f32],
    stride: usize,
    j0: usize,
) {
    #[cfg(target_arch = "x86_64")]
    {
        if bs.is_multiple_of(16) && avx512::available() {
            // SAFETY: AVX-512F/FMA present; shapes as documented (checked inside).
            unsafe { avx512::scores_block(q, nq, d, bs, keys, p, stride, j0) };
            return;
        }
        if bs.is_multiple_of(8) && avx2::available() {
            // SAFETY: AVX2/FMA present; shapes as documented (checked inside).
            unsafe { avx2::scores_block(q, nq, d, bs, keys, p, stride, j0) };
            return;
        }
    }
    scores_block_portable(q, nq, d, bs, keys, p, stride, j0);
}

/// [`scores_block`] over consecutive key blocks `keys` (columns `j0 ..`): the AVX-512 kernel
/// tiles across blocks, so a decode token's `n_head / n_kv_head` query rows keep enough
/// independent accumulators; every score is the same sum in the same order as per block.
#[allow(clippy::too_many_arguments)]
fn scores_blocks(
    q: &[f32],
    nq: usize,
    d: usize,
    bs: usize,
    keys: &[&[f32]],
    p: &mut [f32],
    stride: usize,
    j0: usize,
) {
    #[cfg(target_arch = "x86_64")]
    {
        if bs.is_multiple_of(16) && avx512::available() {
            // SAFETY: AVX-512F/FMA present; shapes as documented (checked inside).
            unsafe { avx512::scores_blocks(q, nq, d, bs, keys, p, stride, j0) };
            return;
        }
    }
    for (i, k) in keys.iter().enumerate() {
        scores_block(q, nq, d, bs, k, p, stride, j0 + i * bs);
    }
}

/// The portable loop of [`scores_block`].
#[allow(clippy::too_many_arguments)]
fn scores_block_portable(
    q: &[f32],
    nq: usize,
    d: usize,
    bs: usize,
    keys: &[f32],
    p: &mut [f32],
    stride: usize,
    j0: usize,
) {
    for r in 0..nq {
        let qr = &q[r * d..][..d];
        let row = &mut p[r * stride + j0..][..bs];
        row.fill(0.0);
        for (i, &qv) in qr.iter().enumerate() {
            for (o, &k) in row.iter_mut().zip(&keys[i * bs..][..bs]) {
                *o = qv.mul_add(k, *o);
            }
        }
    }
}

/// `o[r] += Σ_j p[r][j0 + j] · value_j` over the first `keys` values of one block
/// (`values` is `[bs, d]`).
#[allow(clippy::too_many_arguments)]
fn values_block(
    p: &[f32],
    stride: usize,
    j0: usize,
    keys: usize,
    nq: usize,
    d: usize,
    values: &[f32],
    o: &mut [f32],
) {
    #[cfg(target_arch = "x86_64")]
    {
        if d.is_multiple_of(16) && avx512::available() {
            // SAFETY: AVX-512F/FMA present; shapes as documented (checked inside).
            unsafe { avx512::values_block(p, stride, j0, keys, nq, d, values, o) };
            return;
        }
        if d.is_multiple_of(8) && avx2::available() {
            // SAFETY: AVX2/FMA present; shapes as documented (checked inside).
            unsafe { avx2::values_block(p, stride, j0, keys, nq, d, values, o) };
            return;
        }
    }
    values_block_portable(p, stride, j0, keys, nq, d, values, o);
}

/// The portable loop of [`values_block`].
#[allow(clippy::too_many_arguments)]
fn values_block_portable(
    p: &[f32],
    stride: usize,
    j0: usize,
    keys: usize,
    nq: usize,
    d: usize,
    values: &[f32],
    o: &mut [f32],
) {
    for r in 0..nq {
        let orow = &mut o[r * d..][..d];
        for j in 0..keys {
            let w = p[r * stride + j0 + j];
            for (x, &v) in orow.iter_mut().zip(&values[j * d..][..d]) {
                *x = w.mul_add(v, *x);
            }
        }
    }
}

/// Scales the first `visible` scores, applies a softmax over them and zeroes the rest.
fn softmax_prefix(row: &mut [f32], visible: usize, scale: f32) {
    let (live, masked) = row.split_at_mut(visible);
    masked.fill(0.0);
    #[cfg(target_arch = "x86_64")]
    {
        if avx512::available() {
            // SAFETY: AVX-512F/FMA present (checked just above).
            unsafe { avx512::softmax(live, scale) };
            return;
        }
        if avx2::available() {
            // SAFETY: AVX2/FMA present (checked just above).
            unsafe { avx2::softmax(live, scale) };
            return;
        }
    }
    let mut m = f32::NEG_INFINITY;
    for x in live.iter_mut() {
        *x *= scale;
        m = m.max(*x);
    }
    let mut sum = 0f32;
    for x in live.iter_mut() {
        *x = (*x - m).exp();
        sum += *x;
    }
    let inv = if sum > 0.0 { 1.0 / sum } else { 0.0 };
    for x in live.iter_mut() {
        *x *= inv;
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    pub(super) fn available() -> bool {
        std::arch::is_x86_feature_detected!("avx512f") && std::arch::is_x86_feature_detected!("fma")
    }

    /// A stored key or value element: f32, or f16 bits (an f16 KV cache), widened to f32 as it
    /// is loaded (exact, so the kernels give the same bits from either store).
    pub(super) trait Lane: Copy {
        /// 16 consecutive elements from `p` as f32.
        ///
        /// # Safety
        /// AVX-512F available; 16 elements readable at `p`.
        unsafe fn load16(p: *const Self) -> __m512;
    }

    impl Lane for f32 {
        #[inline(always)]
        unsafe fn load16(p: *const f32) -> __m512 {
            _mm512_loadu_ps(p)
        }
    }

    impl Lane for u16 {
        #[inline(always)]
        unsafe fn load16(p: *const u16) -> __m512 {
            _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i))
        }
    }

    /// `e^x` for `x ≤ 0` (scores minus their maximum): `x = n·ln 2 + r`, `|r| ≤ ln 2 / 2`,
    /// Cephes' degree-6 polynomial for `e^r` (relative error ≈ 1e-7, like libm's `expf` to an ulp
    /// or two), scaled by `2^n`; below −88 the result is 0 or a denormal, as `expf` gives.
    #[inline(always)]
    unsafe fn exp_nonpositive(x: __m512) -> __m512 {
        let x = _mm512_max_ps(x, _mm512_set1_ps(-88.0));
        let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
            _mm512_mul_ps(x, _mm512_set1_ps(std::f32::consts::LOG2_E)),
        );
        let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693_359_4), x);
        let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.121_944_4e-4), r);
        let mut p = _mm512_set1_ps(1.987_569_1e-4);
        for c in [
            1.398_199_9e-3,
            8.333_452e-3,
            4.166_579_6e-2,
            1.666_666_5e-1,
            0.5,
        ] {
            p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
        }
        let p = _mm512_fmadd_ps(
            p,
            _mm512_mul_ps(r, r),
            _mm512_add_ps(r, _mm512_set1_ps(1.0)),
        );
        _mm512_scalef_ps(p, n)
    }

    /// Softmax of `scale · row` in place.
    ///
    /// # Safety
    /// AVX-512F and FMA available.
    #[target_feature(enable = "avx512f,fma")]
    pub(super) unsafe fn softmax(row: &mut [f32], scale: f32) {
        let n = row.len();
        let full = n / 16 * 16;
        let tail = (1u32 << (n - full)) as u16 - 1;
        let ptr = row.as_mut_ptr();
        let sc = _mm512_set1_ps(scale);
        let mut mx = _mm512_set1_ps(f32::NEG_INFINITY);
        for i in (0..full).step_by(16) {
            let v = _mm512_mul_ps(_mm512_loadu_ps(ptr.add(i)), sc);
            _mm512_storeu_ps(ptr.add(i), v);
            mx = _mm512_max_ps(mx, v);
        }
        if tail != 0 {
            let v = _mm512_mul_ps(_mm512_maskz_loadu_ps(tail, ptr.add(full)), sc);
            _mm512_mask_storeu_ps(ptr.add(full), tail, v);
            mx = _mm512_mask_max_ps(mx, tail, mx, v);
        }
        let m = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
        let mut sum = _mm512_setzero_ps();
        for i in (0..full).step_by(16) {
            let e = exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(ptr.add(i)), m));
            _mm512_storeu_ps(ptr.add(i), e);
            sum = _mm512_add_ps(sum, e);
        }
        if tail != 0 {
            let e = exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, ptr.add(full)), m));
            _mm512_mask_storeu_ps(ptr.add(full), tail, e);
            sum = _mm512_mask_add_ps(sum, tail, sum, e);
        }
        let total = _mm512_reduce_add_ps(sum);
        let inv = _mm512_set1_ps(if total > 0.0 { 1.0 / total } else { 0.0 });
        for i in (0..full).step_by(16) {
            _mm512_storeu_ps(ptr.add(i), _mm512_mul_ps(_mm512_loadu_ps(ptr.add(i)), inv));
        }
        if tail != 0 {
            let v = _mm512_mul_ps(_mm512_maskz_loadu_ps(tail, ptr.add(full)), inv);
            _mm512_mask_storeu_ps(ptr.add(full), tail, v);
        }
    }

    /// `R` queries × `G` groups of 16 keys (lanes): `acc_rg += q_r[i] · keys_g[i · bs ..][..16]`
    /// over `i` in order, stored at columns `col0 + 16 g` of each query's row.
    #[inline(always)]
    unsafe fn scores_tile<E: Lane, const R: usize, const G: usize>(
        q: *const f32,
        d: usize,
        bs: usize,
        keys: [*const E; G],
        dst: *mut f32,
        col0: usize,
        stride: usize,
    ) {
        let mut acc = [[_mm512_setzero_ps(); G]; R];
        for i in 0..d {
            let k: [__m512; G] = std::array::from_fn(|g| E::load16(keys[g].add(i * bs)));
            for (r, acc_r) in acc.iter_mut().enumerate() {
                let qv = _mm512_set1_ps(*q.add(r * d + i));
                for (a, kg) in acc_r.iter_mut().zip(k) {
                    *a = _mm512_fmadd_ps(qv, kg, *a);
                }
            }
        }
        for (r, acc_r) in acc.iter().enumerate() {
            for (g, a) in acc_r.iter().enumerate() {
                _mm512_storeu_ps(dst.add(r * stride + col0 + 16 * g), *a);
            }
        }
    }

    /// `R` queries against every 16-key group of `keys` (consecutive blocks), `G` groups per
    /// tile: a decode token's few query rows then keep `R · G` independent accumulators.
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    unsafe fn scores_rows<E: Lane, const R: usize, const G: usize>(
        q: *const f32,
        d: usize,
        bs: usize,
        keys: &[&[E]],
        dst: *mut f32,
        j0: usize,
        stride: usize,
    ) {
        let per_block = bs / 16;
        let n_groups = keys.len() * per_block;
        // Group `x` is lanes `16 (x mod per_block)..` of block `x / per_block`: column
        // `j0 + 16 x`, as the blocks are consecutive in `j`.
        let group = |x: usize| {
            keys.get_unchecked(x / per_block)
                .as_ptr()
                .add((x % per_block) * 16)
        };
        let mut x = 0;
        while x + G <= n_groups {
            let ptrs: [*const E; G] = std::array::from_fn(|g| group(x + g));
            scores_tile::<E, R, G>(q, d, bs, ptrs, dst, j0 + 16 * x, stride);
            x += G;
        }
        while x < n_groups {
            scores_tile::<E, R, 1>(q, d, bs, [group(x)], dst, j0 + 16 * x, stride);
            x += 1;
        }
    }

    /// See [`super::scores_blocks`].
    ///
    /// # Safety
    /// AVX-512F and FMA available.
    #[target_feature(enable = "avx512f,fma")]
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn scores_blocks<E: Lane>(
        q: &[f32],
        nq: usize,
        d: usize,
        bs: usize,
        keys: &[&[E]],
        p: &mut [f32],
        stride: usize,
        j0: usize,
    ) {
        assert!(
            bs.is_multiple_of(16)
                && q.len() >= nq * d
                && keys.iter().all(|k| k.len() >= d * bs)
                && j0 + keys.len() * bs <= stride
                && p.len() >= nq * stride
        );
        let (qp, dst) = (q.as_ptr(), p.as_mut_ptr());
        let mut r = 0;
        while r < nq {
            let (qr, out) = (qp.add(r * d), dst.add(r * stride));
            r += match nq - r {
                8.. => {
                    scores_rows::<E, 8, 2>(qr, d, bs, keys, out, j0, stride);
                    8
                }
                4..=7 => {
                    scores_rows::<E, 4, 4>(qr, d, bs, keys, out, j0, stride);
                    4
                }
                3 => {
                    scores_rows::<E, 3, 4>(qr, d, bs, keys, out, j0, stride);
                    3
                }
                2 => {
                    scores_rows::<E, 2, 4>(qr, d, bs, keys, out, j0, stride);
                    2
                }
                _ => {
                    scores_rows::<E, 1, 4>(qr, d, bs, keys, out, j0, stride);
                    1
                }
            };
        }
    }

    /// See [`super::scores_block`]: [`scores_blocks`] over one block.
    ///
    /// # Safety
    /// AVX-512F and FMA available.
    #[target_feature(enable = "avx512f,fma")]
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn scores_block(
        q: &[f32],
        nq: usize,
        d: usize,
        bs: usize,
        keys: &[f32],
        p: &mut [f32],
        stride: usize,
        j0: usize,
    ) {
        scores_blocks(q, nq, d, bs, &[keys], p, stride, j0);
    }

    /// `R` queries × `C` 16-dimension columns from `c0`: `o_r += Σ_j p_r[j] · v_j`.
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    unsafe fn values_tile<E: Lane, const R: usize, const C: usize>(
        p: *const f32,
        stride: usize,
        keys: usize,
        d: usize,
        values: *const E,
        c0: usize,
        o: *mut f32,
    ) {
        let mut acc = [[_mm512_setzero_ps(); C]; R];
        for (r, acc_r) in acc.iter_mut().enumerate() {
            for (c, a) in acc_r.iter_mut().enumerate() {
                *a = _mm512_loadu_ps(o.add(r * d + c0 + 16 * c));
            }
        }
        for j in 0..keys {
            let mut v = [_mm512_setzero_ps(); C];
            for (c, vc) in v.iter_mut().enumerate() {
                *vc = E::load16(values.add(j * d + c0 + 16 * c));
            }
            for (r, acc_r) in acc.iter_mut().enumerate() {
                let w = _mm512_set1_ps(*p.add(r * stride + j));
                for (a, vc) in acc_r.iter_mut().zip(v) {
                    *a = _mm512_fmadd_ps(w, vc, *a);
                }
            }
        }
        for (r, acc_r) in acc.iter().enumerate() {
            for (c, a) in acc_r.iter().enumerate() {
                _mm512_storeu_ps(o.add(r * d + c0 + 16 * c), *a);
            }
        }
    }

    /// See [`super::values_block`].
    ///
    /// # Safety
    /// AVX-512F and FMA available.
    #[target_feature(enable = "avx512f,fma")]
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn values_block<E: Lane>(
        p: &[f32],
        stride: usize,
        j0: usize,
        keys: usize,
        nq: usize,
        d: usize,
        values: &[E],
        o: &mut [f32],
    ) {
        assert!(
            d.is_multiple_of(16)
                && p.len() >= nq * stride
                && j0 + keys <= stride
                && values.len() >= keys * d
                && o.len() >= nq * d
        );
        let pp = p.as_ptr().add(j0);
        let mut c0 = 0;
        while c0 < d {
            let cols = if d - c0 >= 64 { 4 } else { 1 };
            let mut r = 0;
            while r < nq {
                let left = nq - r;
                let (pr, or) = (pp.add(r * stride), o.as_mut_ptr().add(r * d));
                let vp = values.as_ptr();
                // A decode token's query group (`n_head / n_kv_head` rows, often 2–7) fills
                // one tile: its value loads are shared by every row.
                r += match (left, cols) {
                    (4.., 4) => {
                        values_tile::<E, 4, 4>(pr, stride, keys, d, vp, c0, or);
                        4
                    }
                    (3, 4) => {
                        values_tile::<E, 3, 4>(pr, stride, keys, d, vp, c0, or);
                        3
                    }
                    (2, 4) => {
                        values_tile::<E, 2, 4>(pr, stride, keys, d, vp, c0, or);
                        2
                    }
                    (4.., _) => {
                        values_tile::<E, 4, 1>(pr, stride, keys, d, vp, c0, or);
                        4
                    }
                    (1, 4) => {
                        values_tile::<E, 1, 4>(pr, stride, keys, d, vp, c0, or);
                        1
                    }
                    _ => {
                        values_tile::<E, 1, 1>(pr, stride, keys, d, vp, c0, or);
                        1
                    }
                };
            }
            c0 += 16 * cols;
        }
    }
}

/// The same kernels with 8-lane AVX2 registers, for x86-64 CPUs without AVX-512 (AMD Zen 1–3,
/// Intel client cores): every output is accumulated in the same order as in the AVX-512 and
/// portable paths (scores over dimensions, values over keys, one fused multiply-add each), only
/// the lane count and tile shapes differ. Without them those CPUs ran the portable loop, whose
/// `mul_add` compiles to a call to `fmaf` per product when FMA is not enabled at compile time
/// (80 % of a prefill's time, docs/benchmarks.md "AVX2").
#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    pub(super) use crate::model::simd::avx2::available;
    use crate::model::simd::avx2::{hmax, hsum};

    /// `e^x` for `x ≤ 0`: the AVX-512 kernel's reduction and polynomial; `2^n` is applied as
    /// two exact power-of-two factors (`n ≥ −127` after the clamp, so each factor's exponent is
    /// normal) and the second product rounds once, as `scalef` does.
    #[inline(always)]
    unsafe fn exp_nonpositive(x: __m256) -> __m256 {
        let x = _mm256_max_ps(x, _mm256_set1_ps(-88.0));
        let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
            _mm256_mul_ps(x, _mm256_set1_ps(std::f32::consts::LOG2_E)),
        );
        let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693_359_4), x);
        let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.121_944_4e-4), r);
        let mut p = _mm256_set1_ps(1.987_569_1e-4);
        for c in [
            1.398_199_9e-3,
            8.333_452e-3,
            4.166_579_6e-2,
            1.666_666_5e-1,
            0.5,
        ] {
            p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
        }
        let p = _mm256_fmadd_ps(
            p,
            _mm256_mul_ps(r, r),
            _mm256_add_ps(r, _mm256_set1_ps(1.0)),
        );
        let ni = _mm256_cvtps_epi32(n);
        let n1 = _mm256_srai_epi32::<1>(ni);
        let n2 = _mm256_sub_epi32(ni, n1);
        let bias = _mm256_set1_epi32(127);
        let f1 = _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_add_epi32(n1, bias)));
        let f2 = _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_add_epi32(n2, bias)));
        _mm256_mul_ps(_mm256_mul_ps(p, f1), f2)
    }

    /// The lanes of `v` below `n` (0..=8) as a mask for `maskload`/`maskstore`.
    #[inline(always)]
    unsafe fn tail_mask(n: usize) -> __m256i {
        let lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        _mm256_cmpgt_epi32(_mm256_set1_epi32(n as i32), lanes)
    }

    /// Softmax of `scale · row` in place (see the AVX-512 kernel).
    ///
    /// # Safety
    /// AVX2 and FMA available.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn softmax(row: &mut [f32], scale: f32) {
        let n = row.len();
        let full = n / 8 * 8;
        let tail = tail_mask(n - full);
        let has_tail = n > full;
        let ptr = row.as_mut_ptr();
        let sc = _mm256_set1_ps(scale);
        let neg_inf = _mm256_set1_ps(f32::NEG_INFINITY);
        let mut mx = neg_inf;
        for i in (0..full).step_by(8) {
            let v = _mm256_mul_ps(_mm256_loadu_ps(ptr.add(i)), sc);
            _mm256_storeu_ps(ptr.add(i), v);
            mx = _mm256_max_ps(mx, v);
        }
        if has_tail {
            let v = _mm256_mul_ps(_mm256_maskload_ps(ptr.add(full), tail), sc);
            _mm256_maskstore_ps(ptr.add(full), tail, v);
            mx = _mm256_max_ps(mx, _mm256_blendv_ps(neg_inf, v, _mm256_castsi256_ps(tail)));
        }
        let m = _mm256_set1_ps(hmax(mx));
        let mut sum = _mm256_setzero_ps();
        for i in (0..full).step_by(8) {
            let e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(ptr.add(i)), m));
            _mm256_storeu_ps(ptr.add(i), e);
            sum = _mm256_add_ps(sum, e);
        }
        if has_tail {
            let e = exp_nonpositive(_mm256_sub_ps(_mm256_maskload_ps(ptr.add(full), tail), m));
            let e = _mm256_and_ps(e, _mm256_castsi256_ps(tail));
            _mm256_maskstore_ps(ptr.add(full), tail, e);
            sum = _mm256_add_ps(sum, e);
        }
        let total = hsum(sum);
        let inv = _mm256_set1_ps(if total > 0.0 { 1.0 / total } else { 0.0 });
        for i in (0..full).step_by(8) {
            _mm256_storeu_ps(ptr.add(i), _mm256_mul_ps(_mm256_loadu_ps(ptr.add(i)), inv));
        }
        if has_tail {
            let v = _mm256_mul_ps(_mm256_maskload_ps(ptr.add(full), tail), inv);
            _mm256_maskstore_ps(ptr.add(full), tail, v);
        }
    }

    /// `R` queries × `C`·8 keys from lane `l0`: `acc_r += q_r[i] · keys[i][l0..]`.
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    unsafe fn scores_tile<const R: usize, const C: usize>(
        q: *const f32,
        d: usize,
        bs: usize,
        keys: *const f32,
        l0: usize,
        dst: *mut f32,
        stride: usize,
    ) {
        let mut acc = [[_mm256_setzero_ps(); C]; R];
        for i in 0..d {
            let mut k = [_mm256_setzero_ps(); C];
            for (c, kc) in k.iter_mut().enumerate() {
                *kc = _mm256_loadu_ps(keys.add(i * bs + l0 + 8 * c));
            }
            for (r, acc_r) in acc.iter_mut().enumerate() {
                let qv = _mm256_set1_ps(*q.add(r * d + i));
                for (a, kc) in acc_r.iter_mut().zip(k) {
                    *a = _mm256_fmadd_ps(qv, kc, *a);
                }
            }
        }
        for (r, acc_r) in acc.iter().enumerate() {
            for (c, a) in acc_r.iter().enumerate() {
                _mm256_storeu_ps(dst.add(r * stride + l0 + 8 * c), *a);
            }
        }
    }

    /// See [`super::scores_block`].
    ///
    /// # Safety
    /// AVX2 and FMA available.
    #[target_feature(enable = "avx2,fma")]
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn scores_block(
        q: &[f32],
        nq: usize,
        d: usize,
        bs: usize,
        keys: &[f32],
        p: &mut [f32],
        stride: usize,
        j0: usize,
    ) {
        assert!(
            bs.is_multiple_of(8)
                && q.len() >= nq * d
                && keys.len() >= d * bs
                && j0 + bs <= stride
                && p.len() >= nq * stride
        );
        let dst = p.as_mut_ptr().add(j0);
        let kp = keys.as_ptr();
        let mut l0 = 0;
        while l0 < bs {
            let wide = bs - l0 >= 16;
            let mut r = 0;
            while r < nq {
                let left = nq - r;
                let qp = q.as_ptr().add(r * d);
                let out = dst.add(r * stride);
                r += match (left, wide) {
                    (6.., true) => {
                        scores_tile::<6, 2>(qp, d, bs, kp, l0, out, stride);
                        6
                    }
                    (3.., true) => {
                        scores_tile::<3, 2>(qp, d, bs, kp, l0, out, stride);
                        3
                    }
                    (_, true) => {
                        scores_tile::<1, 2>(qp, d, bs, kp, l0, out, stride);
                        1
                    }
                    (6.., false) => {
                        scores_tile::<6, 1>(qp, d, bs, kp, l0, out, stride);
                        6
                    }
                    _ => {
                        scores_tile::<1, 1>(qp, d, bs, kp, l0, out, stride);
                        1
                    }
                };
            }
            l0 += if wide { 16 } else { 8 };
        }
    }

    /// `R` queries × `C` 8-dimension columns from `c0`: `o_r += Σ_j p_r[j] · v_j`.
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    unsafe fn values_tile<const R: usize, const C: usize>(
        p: *const f32,
        stride: usize,
        keys: usize,
        d: usize,
        values: *const f32,
        c0: usize,
        o: *mut f32,
    ) {
        let mut acc = [[_mm256_setzero_ps(); C]; R];
        for (r, acc_r) in acc.iter_mut().enumerate() {
            for (c, a) in acc_r.iter_mut().enumerate() {
                *a = _mm256_loadu_ps(o.add(r * d + c0 + 8 * c));
            }
        }
        for j in 0..keys {
            let mut v = [_mm256_setzero_ps(); C];
            for (c, vc) in v.iter_mut().enumerate() {
                *vc = _mm256_loadu_ps(values.add(j * d + c0 + 8 * c));
            }
            for (r, acc_r) in acc.iter_mut().enumerate() {
                let w = _mm256_set1_ps(*p.add(r * stride + j));
                for (a, vc) in acc_r.iter_mut().zip(v) {
                    *a = _mm256_fmadd_ps(w, vc, *a);
                }
            }
        }
        for (r, acc_r) in acc.iter().enumerate() {
            for (c, a) in acc_r.iter().enumerate() {
                _mm256_storeu_ps(o.add(r * d + c0 + 8 * c), *a);
            }
        }
    }

    /// See [`super::values_block`].
    ///
    /// # Safety
    /// AVX2 and FMA available.
    #[target_feature(enable = "avx2,fma")]
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn values_block(
        p: &[f32],
        stride: usize,
        j0: usize,
        keys: usize,
        nq: usize,
        d: usize,
        values: &[f32],
        o: &mut [f32],
    ) {
        assert!(
            d.is_multiple_of(8)
                && p.len() >= nq * stride
                && j0 + keys <= stride
                && values.len() >= keys * d
                && o.len() >= nq * d
        );
        let pp = p.as_ptr().add(j0);
        let vp = values.as_ptr();
        let mut c0 = 0;
        while c0 < d {
            let wide = d - c0 >= 32;
            let mut r = 0;
            while r < nq {
                let left = nq - r;
                let (pr, or) = (pp.add(r * stride), o.as_mut_ptr().add(r * d));
                r += match (left, wide) {
                    (3.., true) => {
                        values_tile::<3, 4>(pr, stride, keys, d, vp, c0, or);
                        3
                    }
                    (_, true) => {
                        values_tile::<1, 4>(pr, stride, keys, d, vp, c0, or);
                        1
                    }
                    (4.., false) => {
                        values_tile::<4, 1>(pr, stride, keys, d, vp, c0, or);
                        4
                    }
                    _ => {
                        values_tile::<1, 1>(pr, stride, keys, d, vp, c0, or);
                        1
                    }
                };
            }
            c0 += if wide { 32 } else { 8 };
        }
    }
}

/// Applies interleaved RoPE (GGUF Llama convention: pairs `(x[2i], x[2i+1])` rotate by
/// `pos · base^(-2i/d)`) in place to `heads` consecutive heads of `head_dim` at `x`.
pub(crate) fn rope_interleaved(x: &mut [f32], heads: usize, head_dim: usize, cos_sin: &[f32]) {
    // Partial rotary: only the first `cos_sin.len()` dimensions of a head rotate.
    let half = (cos_sin.len() / 2).min(head_dim / 2);
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

/// RoPE on the two halves of every head (llama.cpp's NEOX style, `qwen2`/`qwen3`): element `i`
/// and `i + head_dim/2` rotate together by frequency `i`. `cos_sin` as for
/// [`rope_interleaved`].
pub(crate) fn rope_halves(x: &mut [f32], heads: usize, head_dim: usize, cos_sin: &[f32]) {
    // Partial rotary: the first `cos_sin.len()` dimensions rotate, as halves of that span.
    let half = (cos_sin.len() / 2).min(head_dim / 2);
    for h in 0..heads {
        let xh = &mut x[h * head_dim..][..head_dim];
        for i in 0..half {
            let (c, s) = (cos_sin[2 * i], cos_sin[2 * i + 1]);
            let (x0, x1) = (xh[i], xh[i + half]);
            xh[i] = x0 * c - x1 * s;
            xh[i + half] = x0 * s + x1 * c;
        }
    }
}

/// `[cos, sin]` interleaved for every frequency of a head at position `pos`.
#[cfg(test)]
pub(crate) fn rope_cos_sin(pos: usize, head_dim: usize, base: f32, out: &mut Vec<f32>) {
    rope_cos_sin_scaled(pos, head_dim, base, None, out)
}

/// [`rope_cos_sin`] over `rot_dims` rotated dimensions, each frequency divided by its factor
/// when `factors` are given (llama.cpp's `rope_freqs`).
pub(crate) fn rope_cos_sin_scaled(
    pos: usize,
    rot_dims: usize,
    base: f32,
    factors: Option<&[f32]>,
    out: &mut Vec<f32>,
) {
    let half = rot_dims / 2;
    out.clear();
    for i in 0..half {
        let f = factors
            .and_then(|f| f.get(i))
            .map_or(1.0, |&f| f64::from(f));
        let inv_freq = 1.0 / f64::from(base).powf(2.0 * i as f64 / rot_dims as f64) / f;
        let angle = pos as f64 * inv_freq;
        out.push(angle.cos() as f32);
        out.push(angle.sin() as f32);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A seeded stream of values in [−0.5, 0.5) (an LCG: reproducible from the printed seed).
    fn rng(seed: u64) -> impl FnMut() -> f32 {
        let mut state = seed;
        move || {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((state >> 33) as f32 / (1u64 << 31) as f32) - 0.5
        }
    }

    /// The same bits everywhere.
    fn same_bits(a: &[f32], b: &[f32]) -> bool {
        a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
    }

    #[test]
    fn f16_conversions_equal_one_value_at_a_time() {
        // Ties, the largest finite f16, overflow, subnormals, underflow, signed zeros, NaN,
        // infinities, then random values; lengths around the vector width.
        let mut vals = vec![
            1.0 + 2f32.powi(-11),
            1.0 + 3.0 * 2f32.powi(-11),
            65504.0,
            65520.0,
            1e6,
            -1e6,
            2f32.powi(-24),
            2f32.powi(-26),
            3.0 * 2f32.powi(-25),
            0.0,
            -0.0,
            f32::NAN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::MIN_POSITIVE,
        ];
        vals.extend(
            crate::model::packed::tests::rnd_vec(9, 40)
                .iter()
                .map(|v| v * 300.0),
        );
        for len in [0, 1, 7, 8, 9, 15, 16, 17, vals.len()] {
            let mut got = vec![0u16; len];
            f32_to_f16_bits(&vals[..len], &mut got);
            for (g, &v) in got.iter().zip(&vals) {
                assert_eq!(*g, half::f16::from_f32(v).to_bits(), "{v}");
            }
        }
        // Every f16 back to f32, in runs that are not multiples of the vector width.
        let all: Vec<u16> = (0..=u16::MAX).collect();
        let mut wide = vec![0f32; all.len()];
        for run in all.chunks(1000).zip(wide.chunks_mut(1000)) {
            f16_bits_to_f32(run.0, run.1);
        }
        for (&h, w) in all.iter().zip(&wide) {
            let want = half::f16::from_bits(h).to_f32();
            assert!(
                w.to_bits() == want.to_bits() || (w.is_nan() && want.is_nan()),
                "{h:#06x}"
            );
        }
    }

    #[test]
    fn f16_rounding_is_round_to_nearest_even() {
        assert_eq!(round_to_f16(1.0), 1.0);
        // 1 + 2^-11 is halfway between 1 and 1 + 2^-10: ties to the even mantissa (1).
        assert_eq!(round_to_f16(1.0 + 2f32.powi(-11)), 1.0);
        assert_eq!(
            round_to_f16(1.0 + 3.0 * 2f32.powi(-11)),
            1.0 + 2.0 * 2f32.powi(-10)
        );
        assert_eq!(round_to_f16(65504.0), 65504.0);
        assert_eq!(round_to_f16(1e6), f32::INFINITY);
        assert_eq!(round_to_f16(-0.1), -0.099975586);
    }

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

    /// One chunk of the last `chunk` of `n_pos` positions, blocks placed in reverse order, against
    /// the naive attention over contiguous K/V.
    fn check(seed: u64, hq: usize, hk: usize, d: usize, block: usize, n_pos: usize, chunk: usize) {
        check_store(seed, hq, hk, d, block, n_pos, chunk, false);
        check_store(seed, hq, hk, d, block, n_pos, chunk, true);
    }

    /// [`check`] on an f32 or an f16 store; the f16 store's output also equals, bit for bit,
    /// an f32 store's holding the same values rounded to f16.
    #[allow(clippy::too_many_arguments)]
    fn check_store(
        seed: u64,
        hq: usize,
        hk: usize,
        d: usize,
        block: usize,
        n_pos: usize,
        chunk: usize,
        f16: bool,
    ) {
        println!(
            "seed {seed} hq {hq} hk {hk} d {d} block {block} n_pos {n_pos} chunk {chunk} f16 {f16}"
        );
        let mut rnd = rng(seed);
        let n_blocks = n_pos.div_ceil(block);
        // Scattered: logical block i lives in physical block n_blocks − i (block 0 unused).
        let slots: Vec<usize> = (0..n_pos)
            .map(|p| (n_blocks - p / block) * block + p % block)
            .collect();
        let layout = KvLayout {
            n_kv_head: hk,
            head_dim: d,
            block_size: block,
        };
        let round = |x: f32| if f16 { round_to_f16(x) } else { x };
        let k_contig: Vec<f32> = (0..n_pos * hk * d).map(|_| round(rnd())).collect();
        let v_contig: Vec<f32> = (0..n_pos * hk * d).map(|_| round(rnd())).collect();
        let values = (n_blocks + 1) * layout.block_floats();
        // Unwritten slots of the last block hold garbage that must never be read into a result.
        let garbage = 1e3f32;
        let mut kv = if f16 {
            let g = half::f16::from_f32(garbage).to_bits();
            LayerKv::F16 {
                k: vec![g; values],
                v: vec![g; values],
            }
        } else {
            LayerKv::F32 {
                k: vec![garbage; values],
                v: vec![garbage; values],
            }
        };
        let mut kv32 = LayerKv::F32 {
            k: vec![garbage; values],
            v: vec![garbage; values],
        };
        for p in 0..n_pos {
            let row = hk * d;
            let (k, v) = (&k_contig[p * row..][..row], &v_contig[p * row..][..row]);
            layout.write(&mut kv, slots[p], k, v);
            layout.write(&mut kv32, slots[p], k, v);
        }
        let start = n_pos - chunk;
        let q: Vec<f32> = (0..chunk * hq * d).map(|_| rnd()).collect();
        let chunks = [ChunkSlots {
            token_offset: 0,
            len: chunk,
            start_pos: start,
            slots,
        }];
        let shape = AttnShape {
            n_head: hq,
            n_kv_head: hk,
            head_dim: d,
            q_stride: hq * d,
            scale: 1.0 / (d as f32).sqrt(),
            window: None,
        };
        let mut out = vec![0f32; chunk * hq * d];
        paged_attention(&q, &kv, &chunks, layout, shape, &mut out);
        let mut out32 = vec![0f32; chunk * hq * d];
        paged_attention(&q, &kv32, &chunks, layout, shape, &mut out32);
        assert!(
            same_bits(&out, &out32),
            "the store's element type changed a result"
        );
        for t in 0..chunk {
            let want = naive(
                &q[t * hq * d..][..hq * d],
                &k_contig,
                &v_contig,
                start + t,
                hq,
                hk,
                d,
            );
            for (a, b) in out[t * hq * d..][..hq * d].iter().zip(&want) {
                assert!((a - b).abs() < 1e-5, "token {t}: {a} vs {b}");
            }
        }
    }

    /// The portable path (shapes that are not multiples of 16) and the AVX-512 path (SmolLM2's
    /// head shape, block sizes 16 and 32), chunks shorter and longer than a token group,
    /// starting mid-block.
    #[test]
    fn paged_matches_naive_with_scattered_slots() {
        check(0x5eed, 6, 2, 20, 4, 11, 3);
        check(0x5eee, 9, 3, 64, 16, 70, 9);
        check(0x5eef, 9, 3, 64, 16, 17, 1);
        check(0x5ef0, 8, 2, 32, 32, 75, 6);
        check(0x5ef1, 4, 4, 48, 16, 33, 33);
    }

    /// The AVX2 and AVX-512 score and value kernels (each where the CPU has it) give bit for
    /// bit the portable loop's results: each output is the same chain of fused
    /// multiply-adds in the same order. Shapes around every tile: block sizes 8–40, head
    /// sizes 8–72, 1–13 query rows, partial key blocks.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn vector_kernels_equal_the_portable_loop() {
        type Scores = unsafe fn(&[f32], usize, usize, usize, &[f32], &mut [f32], usize, usize);
        type Values = unsafe fn(&[f32], usize, usize, usize, usize, usize, &[f32], &mut [f32]);
        // (name, lanes: block size and head_dim must be multiples of it, kernels)
        let mut kernels: Vec<(&str, usize, Scores, Values)> = Vec::new();
        if avx2::available() {
            kernels.push(("avx2", 8, avx2::scores_block, avx2::values_block));
        }
        if avx512::available() {
            kernels.push(("avx512", 16, avx512::scores_block, avx512::values_block));
        }
        let seed = 0xa2f2_u64;
        println!("seed {seed}");
        let mut rnd = rng(seed);
        for (name, lanes, scores, weighted) in kernels {
            for bs in [8usize, 16, 24, 32, 40]
                .into_iter()
                .filter(|b| b % lanes == 0)
            {
                for d in [8usize, 24, 32, 64, 72]
                    .into_iter()
                    .filter(|d| d % lanes == 0)
                {
                    for nq in [1usize, 2, 3, 4, 5, 6, 7, 8, 9, 12, 13] {
                        let stride = 3 * bs;
                        let j0 = bs;
                        let q: Vec<f32> = (0..nq * d).map(|_| rnd()).collect();
                        let keys: Vec<f32> = (0..d * bs).map(|_| rnd()).collect();
                        let mut want = vec![f32::NAN; nq * stride];
                        let mut got = want.clone();
                        scores_block_portable(&q, nq, d, bs, &keys, &mut want, stride, j0);
                        // SAFETY: the kernel's features were checked above.
                        unsafe { scores(&q, nq, d, bs, &keys, &mut got, stride, j0) };
                        assert!(
                            same_bits(&got, &want),
                            "{name} scores bs={bs} d={d} nq={nq}"
                        );
                        let probs: Vec<f32> = (0..nq * stride).map(|_| rnd()).collect();
                        let values: Vec<f32> = (0..bs * d).map(|_| rnd()).collect();
                        for keys_used in [1, bs / 2 + 1, bs] {
                            let o0: Vec<f32> = (0..nq * d).map(|_| rnd()).collect();
                            let (mut want, mut got) = (o0.clone(), o0);
                            values_block_portable(
                                &probs, stride, j0, keys_used, nq, d, &values, &mut want,
                            );
                            // SAFETY: as above.
                            unsafe {
                                weighted(&probs, stride, j0, keys_used, nq, d, &values, &mut got)
                            };
                            assert!(
                                same_bits(&got, &want),
                                "{name} values bs={bs} d={d} nq={nq} keys={keys_used}"
                            );
                        }
                    }
                }
            }
        }
    }

    /// The AVX-512 scores over spans of 1–9 scattered key blocks (tiles across blocks, tails)
    /// equal the portable loop run block by block, bit for bit.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn avx512_scores_across_blocks_equal_the_portable_loop() {
        if !avx512::available() {
            return;
        }
        let mut rnd = rng(0x5eed_u64);
        for bs in [16usize, 32, 48] {
            for d in [16usize, 64] {
                for nq in [1usize, 2, 3, 4, 5, 8, 9, 12] {
                    for span in 1..=9usize {
                        let blocks: Vec<Vec<f32>> = (0..span)
                            .map(|_| (0..d * bs).map(|_| rnd()).collect())
                            .collect();
                        let keys: Vec<&[f32]> = blocks.iter().map(Vec::as_slice).collect();
                        let (j0, stride) = (bs, (span + 2) * bs);
                        let q: Vec<f32> = (0..nq * d).map(|_| rnd()).collect();
                        let mut want = vec![f32::NAN; nq * stride];
                        let mut got = want.clone();
                        for (i, k) in keys.iter().enumerate() {
                            scores_block_portable(&q, nq, d, bs, k, &mut want, stride, j0 + i * bs);
                        }
                        // SAFETY: AVX-512F/FMA checked above.
                        unsafe {
                            avx512::scores_blocks(&q, nq, d, bs, &keys, &mut got, stride, j0)
                        };
                        assert!(same_bits(&got, &want), "bs={bs} d={d} nq={nq} span={span}");
                    }
                }
            }
        }
    }

    /// The AVX-512 and AVX2 softmaxes (own `exp`) against the scalar one (libm `expf`) on rows of
    /// every length around the vector widths, with large negative gaps (underflow to 0).
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn vector_softmax_matches_scalar() {
        type Softmax = unsafe fn(&mut [f32], f32);
        let mut kernels: Vec<(&str, Softmax)> = Vec::new();
        if avx512::available() {
            kernels.push(("avx512", avx512::softmax));
        }
        if avx2::available() {
            kernels.push(("avx2", avx2::softmax));
        }
        let seed = 0x50f7_u64;
        println!("seed {seed}");
        let mut state = seed;
        for n in [1usize, 2, 7, 8, 9, 15, 16, 17, 33, 100, 1040] {
            let row: Vec<f32> = (0..n)
                .map(|i| {
                    state = state
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    let v = ((state >> 33) as f32 / (1u64 << 31) as f32 - 0.5) * 40.0;
                    if i % 7 == 3 {
                        v - 200.0
                    } else {
                        v
                    }
                })
                .collect();
            let mut want = row.clone();
            let scale = 0.125;
            // Scalar reference (the portable path).
            let mut m = f32::NEG_INFINITY;
            for x in want.iter_mut() {
                *x *= scale;
                m = m.max(*x);
            }
            let sum: f32 = want
                .iter_mut()
                .map(|x| {
                    *x = (*x - m).exp();
                    *x
                })
                .sum();
            want.iter_mut().for_each(|x| *x /= sum);
            for (name, kernel) in &kernels {
                let mut got = row.clone();
                // SAFETY: the CPU has the kernel's features (checked above).
                unsafe { kernel(&mut got, scale) };
                for (a, b) in got.iter().zip(&want) {
                    assert!(
                        (a - b).abs() <= 2e-6 * b.abs().max(1e-30) + 1e-12,
                        "{name} n={n}: {a} vs {b}"
                    );
                }
            }
        }
    }

    /// Kernel timing (run on purpose: `cargo test -p engine --lib attention_timing -- --ignored
    /// --nocapture`): one item's scores and weighted values over 1,040 keys (SmolLM2's shape: 3
    /// query heads per KV head × 4 tokens, head size 64, blocks of 16) with each kernel this
    /// CPU has, alternated in one process; one thread.
    #[cfg(target_arch = "x86_64")]
    #[test]
    #[ignore = "timing: run explicitly with --ignored --nocapture"]
    fn attention_timing() {
        let (nq, d, bs, n) = (12usize, 64usize, 16usize, 1040usize);
        let stride = n;
        let q = crate::model::packed::tests::rnd_vec(1, nq * d);
        let keys = crate::model::packed::tests::rnd_vec(2, d * bs);
        let values = crate::model::packed::tests::rnd_vec(3, bs * d);
        let mut p = vec![0f32; nq * stride];
        let mut o = vec![0f32; nq * d];
        type Kernels = (
            &'static str,
            unsafe fn(&[f32], usize, usize, usize, &[f32], &mut [f32], usize, usize),
            unsafe fn(&[f32], usize, usize, usize, usize, usize, &[f32], &mut [f32]),
        );
        let mut kernels: Vec<Kernels> = vec![(
            "portable",
            |q, nq, d, bs, k, p, st, j0| scores_block_portable(q, nq, d, bs, k, p, st, j0),
            |p, st, j0, keys, nq, d, v, o| values_block_portable(p, st, j0, keys, nq, d, v, o),
        )];
        if avx2::available() {
            kernels.push(("avx2", avx2::scores_block, avx2::values_block));
        }
        if avx512::available() {
            kernels.push(("avx512", avx512::scores_block, avx512::values_block));
        }
        let mut best = vec![f64::INFINITY; kernels.len()];
        for _ in 0..10 {
            for (i, (_, scores, weighted)) in kernels.iter().enumerate() {
                let t = std::time::Instant::now();
                for j0 in (0..n).step_by(bs) {
                    // SAFETY: the CPU has the kernel's features (checked above); shapes match.
                    unsafe { scores(&q, nq, d, bs, &keys, &mut p, stride, j0) };
                }
                for j0 in (0..n).step_by(bs) {
                    // SAFETY: as above.
                    unsafe { weighted(&p, stride, j0, bs, nq, d, &values, &mut o) };
                }
                best[i] = best[i].min(t.elapsed().as_secs_f64());
            }
        }
        let macs = (2 * nq * n * d) as f64;
        for ((name, _, _), s) in kernels.iter().zip(&best) {
            println!(
                "{name}: {:.3} ms ({:.2} GMAC/s, {:.1}× portable)",
                s * 1e3,
                macs / s / 1e9,
                best[0] / s
            );
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
