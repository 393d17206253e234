// Checks the device executor's fused CUDA kernels (engine/src/model/cuda/kernels.cu) on a CPU,
// under cuda_emulation.h, against a plain double-precision reference: Q/K/V preparation (bias,
// per-head RMSNorm, RoPE by halves or pairs over all or part of the head, the cache write at each
// token's slot) and paged attention (block tables, causal and sliding-window ranges, contexts of
// many 32-key rounds and partial last rounds, grouped KV heads), in float and in bf16.
// Built and run by engine/tests/cuda_kernels_emulated.rs; prints one line per case and exits 1
// on the first error beyond tolerance.
#include "cuda_emulation.h"
#include "../../src/model/cuda/kernels.cu"

#include <algorithm>
#include <cstdint>
#include <cstdio>

namespace {

struct Rng {
  uint64_t s;
  uint64_t next() {
    s += 0x9E3779B97F4A7C15ull;
    uint64_t z = s;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  float uniform() { return (float)((next() >> 40) / (double)(1ull << 24) * 2.0 - 1.0); }
};

// The kernels' extern "C" entry points per storage type.
template <typename T>
struct Entry;
template <>
struct Entry<float> {
  static constexpr auto prep = qkv_prep_f32;
  static constexpr auto attn = paged_attention_f32;
  static constexpr auto tile = tile_attention_f32;
  static constexpr auto norm = add_rms_norm_f32;
  static constexpr auto act = gated_act_f32;
};
template <>
struct Entry<kv_bf16> {
  static constexpr auto prep = qkv_prep_bf16;
  static constexpr auto attn = paged_attention_bf16;
  static constexpr auto tile = tile_attention_bf16;
  static constexpr auto norm = add_rms_norm_bf16;
  static constexpr auto act = gated_act_bf16;
};

// Storage helpers: float, or bf16 rounded as the kernel rounds.
template <typename T>
T store_of(float v) {
  T out;
  kv_store(&out, v);
  return out;
}
template <typename T>
float value_of(T v) {
  return kv_load(&v);
}

struct Case {
  const char* name;
  int n_head, n_kv_head, head_dim, rope_dims;
  bool halves, bias, qk_norm;
  int block_size;
  int window;  // 0 = none
  // chunks: (start position, length)
  std::vector<std::pair<int, int>> chunks;
};

template <typename T>
bool run_case(const Case& c, const char* dtype, double tol_q, double tol_attn, uint64_t seed) {
  Rng rng{seed};
  const int hq = c.n_head, hk = c.n_kv_head, d = c.head_dim, rd = c.rope_dims;
  const int heads = hq + 2 * hk;
  const int bs = c.block_size;
  const float eps = 1e-6f;
  // Block tables: each chunk's sequence gets blocks from a shuffled pool.
  int max_ctx = 0;
  for (auto& ch : c.chunks) max_ctx = std::max(max_ctx, ch.first + ch.second);
  const int max_blocks = (max_ctx + bs - 1) / bs;
  const int n_chunks = (int)c.chunks.size();
  const int num_blocks = max_blocks * n_chunks + 3;
  std::vector<unsigned> pool(num_blocks);
  for (int i = 0; i < num_blocks; ++i) pool[i] = i;
  for (int i = num_blocks - 1; i > 0; --i) std::swap(pool[i], pool[rng.next() % (i + 1)]);
  std::vector<unsigned> tables((size_t)n_chunks * max_blocks, 0);
  for (int s = 0; s < n_chunks; ++s)
    for (int b = 0; b < max_blocks; ++b) tables[s * max_blocks + b] = pool[s * max_blocks + b];
  const int n_slots = num_blocks * bs;
  auto slot_of = [&](int s, int p) { return tables[s * max_blocks + p / bs] * bs + p % bs; };

  // Caches: earlier positions hold random keys and values; this step writes the rest.
  std::vector<T> kc((size_t)n_slots * hk * d), vc((size_t)n_slots * hk * d);
  for (auto& x : kc) x = store_of<T>(rng.uniform());
  for (auto& x : vc) x = store_of<T>(rng.uniform());

  // The step: tokens of every chunk.
  std::vector<unsigned> pos, slots, tok_seq;
  for (int s = 0; s < n_chunks; ++s)
    for (int i = 0; i < c.chunks[s].second; ++i) {
      const int p = c.chunks[s].first + i;
      pos.push_back(p);
      slots.push_back(slot_of(s, p));
      tok_seq.push_back(s);
    }
  const int T_ = (int)pos.size();
  std::vector<T> qkv((size_t)T_ * heads * d);
  for (auto& x : qkv) x = store_of<T>(rng.uniform() * 2.0f);
  std::vector<float> bias(c.bias ? (size_t)heads * d : 0), qn(c.qk_norm ? d : 0), kn(c.qk_norm ? d : 0);
  for (auto& x : bias) x = rng.uniform() * 0.5f;
  for (auto& x : qn) x = 1.0f + rng.uniform() * 0.5f;
  for (auto& x : kn) x = 1.0f + rng.uniform() * 0.5f;
  const int half = rd / 2;
  std::vector<float> cos_t((size_t)max_ctx * half), sin_t((size_t)max_ctx * half);
  for (int p = 0; p < max_ctx; ++p)
    for (int i = 0; i < half; ++i) {
      const double a = p / std::pow(10000.0, 2.0 * i / rd);
      cos_t[p * half + i] = (float)std::cos(a);
      sin_t[p * half + i] = (float)std::sin(a);
    }

  // Reference Q/K/V (double, from the stored inputs).
  std::vector<double> q_ref((size_t)T_ * hq * d);
  std::vector<double> k_ref(kc.size()), v_ref(vc.size());
  for (size_t i = 0; i < kc.size(); ++i) {
    k_ref[i] = value_of(kc[i]);
    v_ref[i] = value_of(vc[i]);
  }
  for (int t = 0; t < T_; ++t)
    for (int h = 0; h < heads; ++h) {
      std::vector<double> x(d);
      for (int e = 0; e < d; ++e)
        x[e] = value_of(qkv[((size_t)t * heads + h) * d + e]) + (c.bias ? bias[h * d + e] : 0.0);
      const bool is_q = h < hq, is_k = !is_q && h < hq + hk;
      if (c.qk_norm && (is_q || is_k)) {
        double ss = 0;
        for (double v : x) ss += v * v;
        const double m = std::sqrt(ss / d + eps);
        for (int e = 0; e < d; ++e) x[e] = x[e] / m * (is_q ? qn[e] : kn[e]);
      }
      std::vector<double> y = x;
      if (is_q || is_k) {
        const int p = pos[t];
        for (int i = 0; i < half; ++i) {
          const double cs = cos_t[p * half + i], sn = sin_t[p * half + i];
          const int a = c.halves ? i : 2 * i, b = c.halves ? i + half : 2 * i + 1;
          y[a] = x[a] * cs - x[b] * sn;
          y[b] = x[a] * sn + x[b] * cs;
        }
      }
      for (int e = 0; e < d; ++e) {
        if (is_q) q_ref[((size_t)t * hq + h) * d + e] = y[e];
        else if (is_k) k_ref[((size_t)slots[t] * hk + (h - hq)) * d + e] = y[e];
        else v_ref[((size_t)slots[t] * hk + (h - hq - hk)) * d + e] = y[e];
      }
    }

  std::vector<T> q_out((size_t)T_ * hq * d, store_of<T>(0.f));
  emu::launch(EmuDim3{(unsigned)T_, (unsigned)heads, 1}, EmuDim3{64, 1, 1}, [&] {
    Entry<T>::prep(qkv.data(), c.bias ? bias.data() : nullptr, c.qk_norm ? qn.data() : nullptr,
                    c.qk_norm ? kn.data() : nullptr, eps, cos_t.data(), sin_t.data(), pos.data(),
                    slots.data(), q_out.data(), kc.data(), vc.data(), hq, hk, d, rd, c.halves ? 1 : 0);
  });
  double err_q = 0, scale_q = 1e-30;
  for (size_t i = 0; i < q_out.size(); ++i) {
    err_q = std::max(err_q, std::abs(value_of(q_out[i]) - q_ref[i]));
    scale_q = std::max(scale_q, std::abs(q_ref[i]));
  }
  for (size_t i = 0; i < kc.size(); ++i) {
    err_q = std::max(err_q, std::abs(value_of(kc[i]) - k_ref[i]));
    err_q = std::max(err_q, std::abs(value_of(vc[i]) - v_ref[i]));
  }
  const double rel_q = err_q / scale_q;

  // Reference attention over the caches as the kernel left them (double).
  const double scale = 1.0 / std::sqrt((double)d);
  const int g = hq / hk;
  std::vector<double> o_ref((size_t)T_ * hq * d, 0.0);
  for (int t = 0; t < T_; ++t)
    for (int h = 0; h < hq; ++h) {
      const int p = pos[t];
      const int first = (c.window > 0 && p + 1 > c.window) ? p + 1 - c.window : 0;
      std::vector<double> sc;
      double mx = -1e300;
      for (int j = first; j <= p; ++j) {
        const size_t off = ((size_t)slot_of(tok_seq[t], j) * hk + h / g) * d;
        double dot = 0;
        for (int e = 0; e < d; ++e)
          dot += (double)value_of(q_out[((size_t)t * hq + h) * d + e]) * value_of(kc[off + e]);
        sc.push_back(dot * scale);
        mx = std::max(mx, sc.back());
      }
      double sum = 0;
      for (double& s : sc) sum += (s = std::exp(s - mx));
      for (int j = first; j <= p; ++j) {
        const size_t off = ((size_t)slot_of(tok_seq[t], j) * hk + h / g) * d;
        for (int e = 0; e < d; ++e)
          o_ref[((size_t)t * hq + h) * d + e] += sc[j - first] / sum * value_of(vc[off + e]);
      }
    }
  std::vector<T> out((size_t)T_ * hq * d, store_of<T>(0.f));
  emu::launch(EmuDim3{(unsigned)T_, (unsigned)hq, 1}, EmuDim3{32, 1, 1}, [&] {
    Entry<T>::attn(q_out.data(), kc.data(), vc.data(), pos.data(), tok_seq.data(), tables.data(),
                    max_blocks, bs, hq, hk, d, (float)scale, c.window, out.data());
  });
  double err_o = 0;
  for (size_t i = 0; i < out.size(); ++i) err_o = std::max(err_o, std::abs(value_of(out[i]) - o_ref[i]));
  // The same attention through the tile kernel, every chunk in tiles of up to KV_TILE_Q rows
  // (where the head size allows): its results must equal the per-token kernel's bit for bit.
  std::vector<unsigned> tiles;
  {
    unsigned row = 0;
    for (int s = 0; s < n_chunks; ++s) {
      const unsigned len = (unsigned)c.chunks[s].second;
      for (unsigned r = 0; r < len; r += KV_TILE_Q)
        tiles.insert(tiles.end(), {row + r, std::min<unsigned>(KV_TILE_Q, len - r), (unsigned)s});
      row += len;
    }
  }
  const bool tiled = d <= KV_TILE_MAX_DIM;
  std::vector<T> out2 = out;
  if (tiled) {
    for (auto& v : out2) v = store_of<T>(0.f);
    emu::launch(EmuDim3{(unsigned)(tiles.size() / 3), (unsigned)hq, 1}, EmuDim3{128, 1, 1}, [&] {
      Entry<T>::tile(q_out.data(), kc.data(), vc.data(), pos.data(), tiles.data(), tables.data(),
                     max_blocks, bs, hq, hk, d, (float)scale, c.window, out2.data());
    });
  }
  const bool identical = std::memcmp(out.data(), out2.data(), out.size() * sizeof(T)) == 0;
  double err_t = 0;
  for (size_t i = 0; i < out2.size(); ++i) err_t = std::max(err_t, std::abs(value_of(out2[i]) - o_ref[i]));
  const bool ok = rel_q <= tol_q && err_o <= tol_attn && err_t <= tol_attn && identical;
  std::printf("%-30s %-4s tokens %3d  qkv_prep rel err %.1e (tol %.0e)  attention max err %.1e (tol %.0e), tiles %s  %s\n",
              c.name, dtype, T_, rel_q, tol_q, err_o, tol_attn,
              !tiled ? "n/a (head size)" : identical ? "bit-identical" : "DIFFER", ok ? "ok" : "FAILED");
  return ok;
}

// The residual add + RMSNorm and the gated activation against double-precision references
// computed from the stored inputs (the residual sum as stored: rounded to T).
template <typename T>
bool run_elementwise(const char* dtype, double tol, uint64_t seed) {
  Rng rng{seed};
  const int rows = 3, n = 576, ffn = 200;
  const float eps = 1e-5f;
  std::vector<T> x(rows * n), y(rows * n), alpha(n), h(rows * n);
  for (auto& v : x) v = store_of<T>(rng.uniform() * 4.f);
  for (auto& v : y) v = store_of<T>(rng.uniform());
  for (auto& v : alpha) v = store_of<T>(1.f + rng.uniform() * 0.5f);
  std::vector<T> x_in = x;
  emu::launch(EmuDim3{(unsigned)rows, 1, 1}, EmuDim3{256, 1, 1},
              [&] { Entry<T>::norm(x.data(), y.data(), alpha.data(), eps, n, h.data()); });
  double err = 0, scale = 1e-30;
  for (int r = 0; r < rows; ++r) {
    double ss = 0;
    std::vector<double> sum(n);
    for (int e = 0; e < n; ++e) {
      sum[e] = value_of(store_of<T>(value_of(x_in[r * n + e]) + value_of(y[r * n + e])));
      ss += sum[e] * sum[e];
      err = std::max(err, std::abs(value_of(x[r * n + e]) - sum[e]));
    }
    const double m = std::sqrt(ss / n + eps);
    for (int e = 0; e < n; ++e) {
      const double want = sum[e] / m * value_of(alpha[e]);
      err = std::max(err, std::abs(value_of(h[r * n + e]) - want));
      scale = std::max(scale, std::abs(want));
    }
  }
  // The norm alone (no residual): x unchanged.
  std::vector<T> x2 = x_in, h2(rows * n);
  emu::launch(EmuDim3{(unsigned)rows, 1, 1}, EmuDim3{256, 1, 1},
              [&] { Entry<T>::norm(x2.data(), nullptr, alpha.data(), eps, n, h2.data()); });
  bool unchanged = true;
  for (int i = 0; i < rows * n; ++i) unchanged &= value_of(x2[i]) == value_of(x_in[i]);
  const double rel_norm = err / scale;
  double err_act = 0;
  for (int gelu = 0; gelu < 2; ++gelu) {
    std::vector<T> gu(rows * 2 * ffn), out(rows * ffn);
    for (auto& v : gu) v = store_of<T>(rng.uniform() * 3.f);
    const unsigned blocks = (rows * ffn + 255) / 256;
    emu::launch(EmuDim3{blocks, 1, 1}, EmuDim3{256, 1, 1},
                [&] { Entry<T>::act(gu.data(), rows, ffn, gelu, out.data()); });
    for (int r = 0; r < rows; ++r)
      for (int c = 0; c < ffn; ++c) {
        const double g = value_of(gu[r * 2 * ffn + c]), u = value_of(gu[r * 2 * ffn + ffn + c]);
        const double a = gelu ? 0.5 * g * (1 + std::tanh(0.7978845608 * g * (1 + 0.044715 * g * g)))
                              : g / (1 + std::exp(-g));
        err_act = std::max(err_act, std::abs(value_of(out[r * ffn + c]) - a * u) / 9.0);
      }
  }
  const bool ok = rel_norm <= tol && err_act <= tol && unchanged;
  std::printf("%-30s %-4s add_rms_norm rel err %.1e, gated act rel err %.1e (tol %.0e)%s  %s\n",
              "residual + norm, gated act", dtype, rel_norm, err_act, tol,
              unchanged ? "" : ", norm alone CHANGED x", ok ? "ok" : "FAILED");
  return ok;
}

// argmax_f32 against the host sampler's rule (largest value, lowest index on ties, NaN never
// chosen, 0 when nothing is above -inf), with and without soft-capping.
bool run_argmax(uint64_t seed) {
  Rng rng{seed};
  const int vocab = 1000;
  std::vector<std::vector<float>> rows;
  for (int r = 0; r < 5; ++r) {
    std::vector<float> row(vocab);
    for (auto& v : row) v = rng.uniform() * 10.f;
    rows.push_back(row);
  }
  rows[1][700] = rows[1][300] = 50.f;                    // a tie: the lower index wins
  rows[2][5] = NAN;                                      // NaN is never the answer
  rows[2][900] = 40.f;
  std::fill(rows[3].begin(), rows[3].end(), -INFINITY);  // nothing finite: 0
  rows[3][0] = NAN;
  rows[4][999] = 1e6f;                                   // the last index
  std::vector<float> flat;
  for (auto& r : rows) flat.insert(flat.end(), r.begin(), r.end());
  bool ok = true;
  for (float cap : {0.f, 30.f}) {
    std::vector<unsigned> got(rows.size());
    emu::launch(EmuDim3{(unsigned)rows.size(), 1, 1}, EmuDim3{256, 1, 1},
                [&] { argmax_f32(flat.data(), vocab, cap, got.data()); });
    for (size_t r = 0; r < rows.size(); ++r) {
      unsigned want = 0;
      float best = -INFINITY;
      for (int i = 0; i < vocab; ++i) {
        float v = rows[r][i];
        if (cap > 0.f) v = cap * std::tanh(v / cap);
        if (v > best) {
          best = v;
          want = i;
        }
      }
      ok &= got[r] == want;
    }
  }
  std::printf("%-30s      argmax over 5 rows of 1000 (ties, NaN, -inf, soft-cap)  %s\n", "argmax_f32",
              ok ? "ok" : "FAILED");
  return ok;
}

}  // namespace

int main() {
  // Values and tolerances: float must agree with the double reference to float rounding; bf16
  // stores each result with 8 significant bits (relative error up to 2^-9 per stored value).
  const std::vector<Case> cases = {
      {"llama: pairs, GQA 4/2, d 64", 4, 2, 64, 64, false, false, false, 4, 0, {{0, 9}, {5, 1}, {40, 1}, {70, 3}}},
      {"qwen2: halves, bias", 6, 2, 64, 64, true, true, false, 16, 0, {{0, 37}, {100, 1}, {31, 1}}},
      {"qwen3/gemma3: q/k norm, d 40", 4, 4, 40, 40, true, false, true, 8, 0, {{3, 20}, {64, 1}}},
      {"phi3: partial rotary 24 of 40", 4, 1, 40, 24, true, false, false, 5, 0, {{0, 6}, {33, 1}, {12, 1}}},
      {"gemma3 sliding window 7", 2, 1, 64, 64, true, false, true, 4, 7, {{0, 12}, {50, 1}, {3, 2}}},
      {"decode batch, long contexts", 3, 1, 32, 32, false, false, false, 16, 0, {{200, 1}, {31, 1}, {64, 1}, {0, 1}}},
      {"long prefill, d 128, window 40", 4, 2, 128, 128, false, false, false, 16, 40, {{0, 70}, {90, 33}}},
      {"d 256 (gemma3 270M): no tiles", 2, 1, 256, 256, true, false, true, 8, 0, {{10, 21}, {0, 1}}},
      {"window across rounds, tails", 4, 1, 96, 64, false, true, false, 4, 45, {{61, 40}, {100, 1}, {7, 3}}},
  };
  bool ok = true;
  // bf16 stores round to nearest, ties to even (as candle's `half` does): 1 + 2^-8 lies halfway
  // between 1 and 1 + 2^-7 (even: 1); 1 + 3·2^-8 between 1 + 2^-7 and 1 + 2^-6 (even: the latter).
  {
    const float tie_down = 1.0f + std::ldexp(1.0f, -8), tie_up = 1.0f + 3 * std::ldexp(1.0f, -8);
    const float a = value_of(store_of<kv_bf16>(tie_down)), b = value_of(store_of<kv_bf16>(tie_up));
    const bool r = a == 1.0f && b == 1.0f + std::ldexp(1.0f, -6) &&
                   value_of(store_of<kv_bf16>(-2.5f)) == -2.5f && std::isnan(value_of(store_of<kv_bf16>(NAN)));
    std::printf("bf16 rounding (ties to even, NaN kept): %s\n", r ? "ok" : "FAILED");
    ok &= r;
  }
  uint64_t seed = 2026120400;
  for (const Case& c : cases) {
    ok &= run_case<float>(c, "f32", 2e-6, 2e-5, seed++);
    ok &= run_case<kv_bf16>(c, "bf16", 1e-2, 1e-2, seed++);
  }
  ok &= run_elementwise<float>("f32", 2e-6, seed++);
  ok &= run_elementwise<kv_bf16>("bf16", 1e-2, seed++);
  ok &= run_argmax(seed++);
  std::printf("%s\n", ok ? "all cases ok" : "some cases FAILED");
  return ok ? 0 : 1;
}
