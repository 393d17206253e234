// kvgate's fused CUDA kernels for the device executor (engine/src/model/device.rs, launched by
// engine/src/model/cuda.rs). Compiled at run time with NVRTC; needs no header: bf16 values travel
// as their 16 bits in an unsigned short and are widened to float for every computation.
//
// The same file compiles as plain C++ under engine/tests/cuda_emulation.h, which runs each block's
// threads as host threads, so the kernels' logic is tested on a CPU (engine/tests/cuda_kernels_emulated.rs).
//
// Layouts (row-major, element counts):
//   qkv      [T, (n_head + 2 n_kv_head) * head_dim]  one row per token: Q heads | K heads | V heads
//   q        [T, n_head * head_dim]
//   caches   [slots, n_kv_head * head_dim]           row `slot` = block * block_size + offset
//   cos, sin [positions, rope_dims / 2] float
//   tables   [chunks, max_blocks] u32                 block ids of each chunk's sequence
//   pos, slots, tok_seq [T] u32                       position, cache slot, chunk of each token

#define KV_MAX_HEAD_DIM 512
#define KV_FULL_MASK 0xffffffffu
#define KV_NEG_INF __int_as_float(0xff800000)

typedef unsigned long long kv_size;

typedef unsigned short kv_bf16;

__device__ __forceinline__ float kv_load(const float* p) { return *p; }
__device__ __forceinline__ float kv_load(const kv_bf16* p) {
  return __uint_as_float(((unsigned int)(*p)) << 16);
}
__device__ __forceinline__ void kv_store(float* p, float v) { *p = v; }
// Round to nearest, ties to even (what candle / the `half` crate do); NaN stays NaN.
__device__ __forceinline__ void kv_store(kv_bf16* p, float v) {
  unsigned int u = __float_as_uint(v);
  if ((u & 0x7fffffffu) > 0x7f800000u) {
    *p = (kv_bf16)((u >> 16) | 0x40u);
    return;
  }
  u += 0x7fffu + ((u >> 16) & 1u);
  *p = (kv_bf16)(u >> 16);
}

// One head vector of one token: bias, per-head RMSNorm (Q and K heads, when given), RoPE (Q and
// K heads), then Q into q_out and K / V into the caches at the token's slot.
// Grid (T, n_head + 2 n_kv_head), blockDim.x a multiple of 32 (64 is used).
template <typename T>
__device__ void qkv_prep(const T* __restrict__ qkv, const float* __restrict__ bias,
                         const float* __restrict__ q_norm, const float* __restrict__ k_norm,
                         float eps, const float* __restrict__ cos_tab,
                         const float* __restrict__ sin_tab, const unsigned int* __restrict__ pos,
                         const unsigned int* __restrict__ slots, T* __restrict__ q_out,
                         T* __restrict__ k_cache, T* __restrict__ v_cache, int n_head,
                         int n_kv_head, int head_dim, int rope_dims, int halves) {
  __shared__ float buf[KV_MAX_HEAD_DIM];
  __shared__ float red[32];
  const int t = blockIdx.x;
  const int h = blockIdx.y;
  const int d = head_dim;
  const int tid = threadIdx.x;
  const int nthreads = blockDim.x;
  const kv_size width = (kv_size)(n_head + 2 * n_kv_head) * d;
  const T* src = qkv + (kv_size)t * width + (kv_size)h * d;
  for (int e = tid; e < d; e += nthreads) {
    float v = kv_load(src + e);
    if (bias) v += bias[(kv_size)h * d + e];
    buf[e] = v;
  }
  __syncthreads();
  const bool is_q = h < n_head;
  const bool is_k = !is_q && h < n_head + n_kv_head;
  const float* alpha = is_q ? q_norm : (is_k ? k_norm : (const float*)0);
  if (alpha) {
    float part = 0.f;
    for (int e = tid; e < d; e += nthreads) part += buf[e] * buf[e];
    for (int o = 16; o > 0; o >>= 1) part += __shfl_xor_sync(KV_FULL_MASK, part, o);
    if ((tid & 31) == 0) red[tid >> 5] = part;
    __syncthreads();
    float sum = 0.f;
    for (int w = 0; w < nthreads / 32; ++w) sum += red[w];
    const float m = sqrtf(sum / (float)d + eps);
    // Each thread rescales only its own elements; the sync below publishes them.
    for (int e = tid; e < d; e += nthreads) buf[e] = buf[e] / m * alpha[e];
    __syncthreads();
  }
  const unsigned int p = pos[t];
  const int half = rope_dims / 2;
  const unsigned int slot = slots[t];
  for (int e = tid; e < d; e += nthreads) {
    float out = buf[e];
    if ((is_q || is_k) && e < rope_dims) {
      int i;
      bool first;
      float x0, x1;
      if (halves) {
        first = e < half;
        i = first ? e : e - half;
        x0 = buf[i];
        x1 = buf[i + half];
      } else {
        first = (e & 1) == 0;
        i = e >> 1;
        x0 = buf[2 * i];
        x1 = buf[2 * i + 1];
      }
      const float c = cos_tab[(kv_size)p * half + i];
      const float s = sin_tab[(kv_size)p * half + i];
      out = first ? x0 * c - x1 * s : x0 * s + x1 * c;
    }
    if (is_q) {
      kv_store(q_out + ((kv_size)t * n_head + h) * d + e, out);
    } else if (is_k) {
      kv_store(k_cache + ((kv_size)slot * n_kv_head + (h - n_head)) * d + e, out);
    } else {
      kv_store(v_cache + ((kv_size)slot * n_kv_head + (h - n_head - n_kv_head)) * d + e, out);
    }
  }
}

// One query head of one token attends keys first ..= pos[t] of its sequence (first = 0, or
// pos + 1 - window for a sliding-window layer), read through the chunk's block table. One warp
// (blockDim.x == 32): keys in rounds of 32 aligned to multiples of 32, a lane per key for the
// scores (dot product over the dimensions in order), the warp for the values (lane owns
// dimensions lane, lane + 32, ...); online softmax in float, updated once per round. For head
// sizes the tile kernel does not take. Grid (T, n_head).
template <typename T>
__device__ void paged_attention(const T* __restrict__ q, const T* __restrict__ k_cache,
                                const T* __restrict__ v_cache, const unsigned int* __restrict__ pos,
                                const unsigned int* __restrict__ tok_seq,
                                const unsigned int* __restrict__ tables, int max_blocks,
                                int block_size, int n_head, int n_kv_head, int head_dim,
                                float scale, int window, T* __restrict__ out) {
  __shared__ float qs[KV_MAX_HEAD_DIM];
  const int t = blockIdx.x;
  const int h = blockIdx.y;
  const int lane = threadIdx.x;
  const int d = head_dim;
  const int g = h / (n_head / n_kv_head);
  for (int e = lane; e < d; e += 32) qs[e] = kv_load(q + ((kv_size)t * n_head + h) * d + e) * scale;
  __syncwarp();
  const unsigned int p = pos[t];
  const unsigned int first =
      (window > 0 && p + 1 > (unsigned int)window) ? p + 1 - (unsigned int)window : 0u;
  const unsigned int* table = tables + (kv_size)tok_seq[t] * max_blocks;
  const kv_size row = (kv_size)n_kv_head * d;
  const int per_lane = (d + 31) / 32;
  float acc[KV_MAX_HEAD_DIM / 32];
#pragma unroll
  for (int i = 0; i < KV_MAX_HEAD_DIM / 32; ++i) acc[i] = 0.f;
  float m = KV_NEG_INF;
  float l = 0.f;
  // Rounds cover keys [32 r, 32 r + 32): aligned to absolute positions, so that this kernel and
  // tile_attention group a query's keys alike and compute bit-identical results.
  for (unsigned int base = first & ~31u; base <= p; base += 32) {
    const unsigned int j = base + lane;
    const bool valid = j >= first && j <= p;
    float s = KV_NEG_INF;
    unsigned long long off = 0;
    if (valid) {
      const unsigned int slot =
          table[j / (unsigned int)block_size] * (unsigned int)block_size + j % (unsigned int)block_size;
      off = (unsigned long long)slot * row + (unsigned long long)g * d;
      float dot = 0.f;
      for (int e = 0; e < d; ++e) dot += qs[e] * kv_load(k_cache + off + e);
      s = dot;
    }
    float mb = s;
    for (int o = 16; o > 0; o >>= 1) mb = fmaxf(mb, __shfl_xor_sync(KV_FULL_MASK, mb, o));
    const float m_new = fmaxf(m, mb);
    const float pe = valid ? expf(s - m_new) : 0.f;
    float ps = pe;
    for (int o = 16; o > 0; o >>= 1) ps += __shfl_xor_sync(KV_FULL_MASK, ps, o);
    const float corr = expf(m - m_new);
    l = l * corr + ps;
#pragma unroll
    for (int i = 0; i < KV_MAX_HEAD_DIM / 32; ++i) acc[i] *= corr;
    const unsigned int left = p + 1 - base;
    const int n = left < 32u ? (int)left : 32;
    for (int jj = 0; jj < n; ++jj) {
      if (base + (unsigned int)jj < first) continue;
      const float pj = __shfl_sync(KV_FULL_MASK, pe, jj);
      const unsigned long long oj = __shfl_sync(KV_FULL_MASK, off, jj);
#pragma unroll
      for (int i = 0; i < KV_MAX_HEAD_DIM / 32; ++i) {
        const int e = lane + 32 * i;
        if (i < per_lane && e < d) acc[i] += pj * kv_load(v_cache + oj + e);
      }
    }
    m = m_new;
  }
  const float inv = 1.f / l;
#pragma unroll
  for (int i = 0; i < KV_MAX_HEAD_DIM / 32; ++i) {
    const int e = lane + 32 * i;
    if (i < per_lane && e < d) kv_store(out + ((kv_size)t * n_head + h) * d + e, acc[i] * inv);
  }
}


// Attention for a tile of up to KV_TILE_Q consecutive tokens of one chunk (a prefill chunk, or
// one decode) and one query head, with paged_attention's arithmetic exactly: the same rounds of
// 32 keys aligned to multiples of 32, the same per-lane dot products and warp reductions, so a
// query's result does not depend on which kernel, tile or chunk computed it. The block stages
// each round's 32 keys and values in shared memory (coalesced loads, rows padded against bank
// conflicts) and its queries (scaled) too; 4 warps of KV_TILE_QW queries each. A round that
// misses a query's range [first, position] is skipped for it, as paged_attention never visits it.
// head_dim <= KV_TILE_MAX_DIM. Grid (tiles, n_head), 128 threads; tiles[3 i .. 3 i + 3] = first
// row, rows, chunk.
#define KV_TILE_WARPS 4
#define KV_TILE_QW 4
#define KV_TILE_Q (KV_TILE_WARPS * KV_TILE_QW)
#define KV_TILE_MAX_DIM 128
#define KV_TILE_STRIDE (KV_TILE_MAX_DIM + 1)
template <typename T>
__device__ void tile_attention(const T* __restrict__ q, const T* __restrict__ k_cache,
                               const T* __restrict__ v_cache, const unsigned int* __restrict__ pos,
                               const unsigned int* __restrict__ tiles,
                               const unsigned int* __restrict__ tables, int max_blocks,
                               int block_size, int n_head, int n_kv_head, int head_dim, float scale,
                               int window, T* __restrict__ out) {
  __shared__ float ks[32 * KV_TILE_STRIDE];
  __shared__ float vs[32 * KV_TILE_STRIDE];
  __shared__ float qs[KV_TILE_Q * KV_TILE_MAX_DIM];
  const int tile = blockIdx.x;
  const int h = blockIdx.y;
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int d = head_dim;
  const int g = h / (n_head / n_kv_head);
  const unsigned int first_row = tiles[3 * tile];
  const unsigned int n_rows = tiles[3 * tile + 1];
  const unsigned int* table = tables + (kv_size)tiles[3 * tile + 2] * max_blocks;
  const int per_lane = (d + 31) / 32;
  for (int x = tid; x < (int)n_rows * d; x += blockDim.x) {
    const kv_size row = first_row + (unsigned int)(x / d);
    qs[x] = kv_load(q + (row * n_head + h) * d + x % d) * scale;
  }
  float acc[KV_TILE_QW][KV_TILE_MAX_DIM / 32];
  float m[KV_TILE_QW], l[KV_TILE_QW];
  unsigned int qpos[KV_TILE_QW], qfirst[KV_TILE_QW];
  bool active[KV_TILE_QW];
#pragma unroll
  for (int qi = 0; qi < KV_TILE_QW; ++qi) {
    const unsigned int r = (unsigned int)(warp * KV_TILE_QW + qi);
    active[qi] = r < n_rows;
    qpos[qi] = pos[first_row + (active[qi] ? r : 0u)];
    qfirst[qi] = (window > 0 && qpos[qi] + 1 > (unsigned int)window) ? qpos[qi] + 1 - window : 0u;
    m[qi] = KV_NEG_INF;
    l[qi] = 0.f;
#pragma unroll
    for (int i = 0; i < KV_TILE_MAX_DIM / 32; ++i) acc[qi][i] = 0.f;
  }
  const unsigned int p_lo = pos[first_row];
  const unsigned int p_hi = pos[first_row + n_rows - 1];
  const unsigned int k_lo = (window > 0 && p_lo + 1 > (unsigned int)window) ? p_lo + 1 - window : 0u;
  const kv_size row_stride = (kv_size)n_kv_head * d;
  for (unsigned int base = k_lo & ~31u; base <= p_hi; base += 32) {
    __syncthreads();
    for (int x = tid; x < 32 * d; x += blockDim.x) {
      const unsigned int key = base + (unsigned int)(x / d);
      if (key > p_hi) continue;
      const int e = x % d;
      const unsigned int slot =
          table[key / (unsigned int)block_size] * (unsigned int)block_size + key % (unsigned int)block_size;
      const kv_size off = (kv_size)slot * row_stride + (kv_size)g * d + e;
      ks[(x / d) * KV_TILE_STRIDE + e] = kv_load(k_cache + off);
      vs[(x / d) * KV_TILE_STRIDE + e] = kv_load(v_cache + off);
    }
    __syncthreads();
#pragma unroll
    for (int qi = 0; qi < KV_TILE_QW; ++qi) {
      if (!active[qi] || base > qpos[qi] || base + 31 < qfirst[qi]) continue;
      const float* qrow = qs + (warp * KV_TILE_QW + qi) * d;
      const unsigned int j = base + lane;
      const bool valid = j >= qfirst[qi] && j <= qpos[qi];
      float s = KV_NEG_INF;
      if (valid) {
        float dot = 0.f;
        for (int e = 0; e < d; ++e) dot += qrow[e] * ks[lane * KV_TILE_STRIDE + e];
        s = dot;
      }
      float mb = s;
      for (int o = 16; o > 0; o >>= 1) mb = fmaxf(mb, __shfl_xor_sync(KV_FULL_MASK, mb, o));
      const float m_new = fmaxf(m[qi], mb);
      const float pe = valid ? expf(s - m_new) : 0.f;
      float ps = pe;
      for (int o = 16; o > 0; o >>= 1) ps += __shfl_xor_sync(KV_FULL_MASK, ps, o);
      const float corr = expf(m[qi] - m_new);
      l[qi] = l[qi] * corr + ps;
#pragma unroll
      for (int i = 0; i < KV_TILE_MAX_DIM / 32; ++i) acc[qi][i] *= corr;
      const unsigned int left = qpos[qi] + 1 - base;
      const int n = left < 32u ? (int)left : 32;
      for (int jj = 0; jj < n; ++jj) {
        if (base + (unsigned int)jj < qfirst[qi]) continue;
        const float pj = __shfl_sync(KV_FULL_MASK, pe, jj);
#pragma unroll
        for (int i = 0; i < KV_TILE_MAX_DIM / 32; ++i) {
          const int e = lane + 32 * i;
          if (i < per_lane && e < d) acc[qi][i] += pj * vs[jj * KV_TILE_STRIDE + e];
        }
      }
      m[qi] = m_new;
    }
  }
#pragma unroll
  for (int qi = 0; qi < KV_TILE_QW; ++qi) {
    if (!active[qi]) continue;
    const kv_size row = first_row + (unsigned int)(warp * KV_TILE_QW + qi);
    const float inv = 1.f / l[qi];
#pragma unroll
    for (int i = 0; i < KV_TILE_MAX_DIM / 32; ++i) {
      const int e = lane + 32 * i;
      if (i < per_lane && e < d) kv_store(out + (row * n_head + h) * d + e, acc[qi][i] * inv);
    }
  }
}

// The residual add and the next RMSNorm in one pass over a row: x[r] += y[r] (stored, rounded
// to T, as a separate add would store it), then h[r] = x[r] / sqrt(mean(x[r]^2) + eps) * alpha
// (sum of squares in float). y == null: the norm alone. Grid (rows), 256 threads.
template <typename T>
__device__ void add_rms_norm(T* __restrict__ x, const T* __restrict__ y,
                             const T* __restrict__ alpha, float eps, int n, T* __restrict__ h) {
  __shared__ float red[32];
  const kv_size r = blockIdx.x;
  const int tid = threadIdx.x;
  T* xr = x + r * n;
  float part = 0.f;
  for (int e = tid; e < n; e += blockDim.x) {
    float v = kv_load(xr + e);
    if (y) {
      kv_store(xr + e, v + kv_load(y + r * n + e));
      v = kv_load(xr + e);
    }
    part += v * v;
  }
  for (int o = 16; o > 0; o >>= 1) part += __shfl_xor_sync(KV_FULL_MASK, part, o);
  if ((tid & 31) == 0) red[tid >> 5] = part;
  __syncthreads();
  float sum = 0.f;
  for (int w = 0; w < (int)(blockDim.x / 32); ++w) sum += red[w];
  const float m = sqrtf(sum / (float)n + eps);
  for (int e = tid; e < n; e += blockDim.x) kv_store(h + r * n + e, kv_load(xr + e) / m * kv_load(alpha + e));
}

// The gated FFN activation: out[r, i] = act(gu[r, i]) * gu[r, ffn + i], act = SiLU (v / (1 +
// e^-v)) or, gelu != 0, GELU's tanh form; computed in float, stored once. Grid (ceil(rows * ffn /
// 256)), 256 threads.
template <typename T>
__device__ void gated_act(const T* __restrict__ gu, int rows, int ffn, int gelu, T* __restrict__ out) {
  const kv_size i = (kv_size)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= (kv_size)rows * ffn) return;
  const kv_size r = i / ffn, c = i % ffn;
  const float g = kv_load(gu + r * 2 * ffn + c);
  const float u = kv_load(gu + r * 2 * ffn + ffn + c);
  const float a = gelu ? 0.5f * g * (1.f + tanhf(0.7978846f * g * (1.f + 0.044715f * g * g)))
                       : g / (1.f + expf(-g));
  kv_store(out + i, a * u);
}

// The argmax of each row of F32 logits, as the engine's host sampler picks it: the largest value
// (NaN never chosen), the lowest index among equal maxima; 0 when no value is above -inf. With
// softcap > 0, each logit is first replaced by softcap * tanh(logit / softcap) (Gemma's final
// soft-capping). Grid (rows), 256 threads; out[r] = the index.
__device__ __forceinline__ bool kv_better(float v, unsigned int i, float bv, unsigned int bi) {
  return v > bv || (v == bv && v > KV_NEG_INF && i < bi);
}
__device__ void argmax_rows(const float* __restrict__ logits, int vocab, float softcap,
                            unsigned int* __restrict__ out) {
  __shared__ float sv[32];
  __shared__ unsigned int si[32];
  const kv_size r = blockIdx.x;
  const int tid = threadIdx.x;
  const float* row = logits + r * vocab;
  float bv = KV_NEG_INF;
  unsigned int bi = 0xffffffffu;
  for (int i = tid; i < vocab; i += blockDim.x) {
    float v = row[i];
    if (softcap > 0.f) v = softcap * tanhf(v / softcap);
    if (kv_better(v, (unsigned int)i, bv, bi)) {
      bv = v;
      bi = (unsigned int)i;
    }
  }
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(KV_FULL_MASK, bv, o);
    const unsigned int oi = (unsigned int)__shfl_xor_sync(KV_FULL_MASK, (unsigned long long)bi, o);
    if (kv_better(ov, oi, bv, bi)) {
      bv = ov;
      bi = oi;
    }
  }
  if ((tid & 31) == 0) {
    sv[tid >> 5] = bv;
    si[tid >> 5] = bi;
  }
  __syncthreads();
  if (tid == 0) {
    for (int w = 1; w < (int)(blockDim.x / 32); ++w) {
      if (kv_better(sv[w], si[w], bv, bi)) {
        bv = sv[w];
        bi = si[w];
      }
    }
    out[r] = bi == 0xffffffffu ? 0u : bi;
  }
}

#define KV_QKV_PREP(NAME, T)                                                                      \
  extern "C" __global__ void NAME(const T* qkv, const float* bias, const float* q_norm,          \
                                  const float* k_norm, float eps, const float* cos_tab,          \
                                  const float* sin_tab, const unsigned int* pos,                 \
                                  const unsigned int* slots, T* q_out, T* k_cache, T* v_cache,   \
                                  int n_head, int n_kv_head, int head_dim, int rope_dims,        \
                                  int halves) {                                                  \
    qkv_prep<T>(qkv, bias, q_norm, k_norm, eps, cos_tab, sin_tab, pos, slots, q_out, k_cache,    \
                v_cache, n_head, n_kv_head, head_dim, rope_dims, halves);                        \
  }

#define KV_ATTENTION(NAME, T)                                                                     \
  extern "C" __global__ void NAME(const T* q, const T* k_cache, const T* v_cache,                \
                                  const unsigned int* pos, const unsigned int* tok_seq,          \
                                  const unsigned int* tables, int max_blocks, int block_size,    \
                                  int n_head, int n_kv_head, int head_dim, float scale,          \
                                  int window, T* out) {                                          \
    paged_attention<T>(q, k_cache, v_cache, pos, tok_seq, tables, max_blocks, block_size,        \
                       n_head, n_kv_head, head_dim, scale, window, out);                         \
  }

#define KV_TILE_ATTENTION(NAME, T)                                                                \
  extern "C" __global__ void NAME(const T* q, const T* k_cache, const T* v_cache,                \
                                  const unsigned int* pos, const unsigned int* tiles,            \
                                  const unsigned int* tables, int max_blocks, int block_size,    \
                                  int n_head, int n_kv_head, int head_dim, float scale,          \
                                  int window, T* out) {                                          \
    tile_attention<T>(q, k_cache, v_cache, pos, tiles, tables, max_blocks, block_size, n_head,   \
                      n_kv_head, head_dim, scale, window, out);                                  \
  }

KV_QKV_PREP(qkv_prep_f32, float)
KV_QKV_PREP(qkv_prep_bf16, kv_bf16)
KV_ATTENTION(paged_attention_f32, float)
KV_ATTENTION(paged_attention_bf16, kv_bf16)
KV_TILE_ATTENTION(tile_attention_f32, float)
KV_TILE_ATTENTION(tile_attention_bf16, kv_bf16)

#define KV_ADD_RMS_NORM(NAME, T)                                                                  \
  extern "C" __global__ void NAME(T* x, const T* y, const T* alpha, float eps, int n, T* h) {    \
    add_rms_norm<T>(x, y, alpha, eps, n, h);                                                     \
  }
#define KV_GATED_ACT(NAME, T)                                                                     \
  extern "C" __global__ void NAME(const T* gu, int rows, int ffn, int gelu, T* out) {            \
    gated_act<T>(gu, rows, ffn, gelu, out);                                                      \
  }
KV_ADD_RMS_NORM(add_rms_norm_f32, float)
KV_ADD_RMS_NORM(add_rms_norm_bf16, kv_bf16)
KV_GATED_ACT(gated_act_f32, float)
KV_GATED_ACT(gated_act_bf16, kv_bf16)

extern "C" __global__ void argmax_f32(const float* logits, int vocab, float softcap, unsigned int* out) {
  argmax_rows(logits, vocab, softcap, out);
}
