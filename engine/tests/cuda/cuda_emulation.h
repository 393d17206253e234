// Runs CUDA kernels written in the subset that engine/src/model/cuda/kernels.cu uses on a CPU,
// in one host thread: each CUDA thread of a block is a fiber (ucontext) with its own stack, run
// cooperatively; __syncthreads() waits for the block's fibers, __syncwarp() and the warp shuffles
// for the fiber's warp (shuffles exchange through a per-warp buffer between two such waits).
// Blocks run one after another, so a __shared__ array is a plain static shared by the running
// block's fibers. Enough to test the kernels' indexing, reductions and softmax without a GPU;
// says nothing about their speed. Deterministic: fibers switch only at synchronization points.
#pragma once

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <math.h>
#include <ucontext.h>
#include <vector>

struct EmuDim3 {
  unsigned x = 1, y = 1, z = 1;
};

namespace emu {
struct Barrier {
  unsigned size = 0, arrived = 0, generation = 0;
};
struct Warp {
  Barrier bar;
  float f[32];
  unsigned long long u[32];
};
struct Fiber {
  ucontext_t ctx;
  std::vector<char> stack;
  EmuDim3 idx;
  Warp* warp = nullptr;
  bool done = false;
};
inline EmuDim3 block_idx;
inline EmuDim3 block_dim;
inline Barrier block_barrier;
inline Fiber* cur = nullptr;
inline ucontext_t scheduler;
inline const std::function<void()>* body = nullptr;

inline void yield() { swapcontext(&cur->ctx, &scheduler); }

inline void arrive_and_wait(Barrier& b) {
  const unsigned gen = b.generation;
  if (++b.arrived == b.size) {
    b.arrived = 0;
    ++b.generation;
    return;
  }
  while (b.generation == gen) yield();
}

inline void trampoline() {
  (*body)();
  cur->done = true;
  swapcontext(&cur->ctx, &scheduler);
}

// Runs `kernel` over `grid` blocks of `block` threads (x only).
inline void launch(EmuDim3 grid, EmuDim3 block, const std::function<void()>& kernel) {
  block_dim = block;
  body = &kernel;
  const unsigned n = block.x;
  std::vector<Warp> warps((n + 31) / 32);
  for (unsigned w = 0; w < warps.size(); ++w) warps[w].bar.size = (w + 1) * 32 <= n ? 32 : n - w * 32;
  std::vector<Fiber> fibers(n);
  for (unsigned by = 0; by < grid.y; ++by) {
    for (unsigned bx = 0; bx < grid.x; ++bx) {
      block_idx = EmuDim3{bx, by, 0};
      block_barrier = Barrier{n, 0, 0};
      for (unsigned t = 0; t < n; ++t) {
        Fiber& f = fibers[t];
        f.stack.resize(256 * 1024);
        f.idx = EmuDim3{t, 0, 0};
        f.warp = &warps[t / 32];
        f.done = false;
        getcontext(&f.ctx);
        f.ctx.uc_stack.ss_sp = f.stack.data();
        f.ctx.uc_stack.ss_size = f.stack.size();
        f.ctx.uc_link = nullptr;
        makecontext(&f.ctx, trampoline, 0);
      }
      unsigned live = n;
      while (live > 0) {
        live = 0;
        for (Fiber& f : fibers) {
          if (f.done) continue;
          cur = &f;
          swapcontext(&scheduler, &f.ctx);
          if (!f.done) ++live;
        }
      }
      for (const Warp& w : warps) {
        if (w.bar.arrived != 0) {
          std::fprintf(stderr, "emulation: a warp ended with threads waiting at a barrier\n");
          std::abort();
        }
      }
    }
  }
}
}  // namespace emu

#define threadIdx (emu::cur->idx)
#define blockIdx emu::block_idx
#define blockDim emu::block_dim
#define __global__
#define __device__
#define __forceinline__ inline
#define __restrict__
#define __shared__ static

inline void __syncthreads() { emu::arrive_and_wait(emu::block_barrier); }
inline void __syncwarp() { emu::arrive_and_wait(emu::cur->warp->bar); }

template <typename V>
inline V emu_exchange(V v, int src, V* buf) {
  const int lane = threadIdx.x & 31;
  buf[lane] = v;
  emu::arrive_and_wait(emu::cur->warp->bar);
  const V r = buf[src];
  emu::arrive_and_wait(emu::cur->warp->bar);
  return r;
}

inline float __shfl_xor_sync(unsigned, float v, int mask) {
  return emu_exchange(v, (int)(threadIdx.x & 31) ^ mask, emu::cur->warp->f);
}
inline float __shfl_sync(unsigned, float v, int src) { return emu_exchange(v, src, emu::cur->warp->f); }
inline unsigned long long __shfl_xor_sync(unsigned, unsigned long long v, int mask) {
  return emu_exchange(v, (int)(threadIdx.x & 31) ^ mask, emu::cur->warp->u);
}
inline unsigned long long __shfl_sync(unsigned, unsigned long long v, int src) {
  return emu_exchange(v, src, emu::cur->warp->u);
}

inline float __uint_as_float(unsigned int u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline float __int_as_float(int i) {
  float f;
  std::memcpy(&f, &i, 4);
  return f;
}
inline unsigned int __float_as_uint(float f) {
  unsigned int u;
  std::memcpy(&u, &f, 4);
  return u;
}
