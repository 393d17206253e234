#!/usr/bin/env bash
# Checks the ops `--numerics llama-cpp` reproduces against ggml itself, bit for bit: compiles
# scripts/ggml-ops/ops.cpp against the llama.cpp build (scripts/build-llamacpp.sh), dumps what
# ggml's CPU backend computes (Q8_1/Q8_0 activation quantization, GELU, SiLU), then runs the
# engine's ignored tests that compare with the dump: int8::tests::quantization_equals_ggmls,
# activation::tests::gelu_table_equals_ggmls, activation::tests::silu_equals_ggmls; and compiles
# scripts/ggml-ops/silu_avx2.cpp (ggml's own 8-lane SiLU, without AVX-512) for
# activation::tests::silu8_equals_ggmls_avx2_build.
# Outside CI (needs the llama.cpp build, ~10-20 min the first time).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
bin="$(./scripts/build-llamacpp.sh)"
base="$(dirname "$(dirname "$bin")")"   # <cache>/build/bin -> <cache>
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
c++ -O2 -std=c++17 scripts/ggml-ops/ops.cpp -I"$base/src/ggml/include" \
  -L"$base/build/ggml/src" -lggml -lggml-cpu -lggml-base -fopenmp -lpthread -o "$tmp/ggml-ops"
"$tmp/ggml-ops" >"$tmp/ops.json"
# ggml's AVX2 SiLU, compiled from its own header without AVX-512 (what an AVX2-only build runs).
src="$base/src/ggml"
c++ -O2 -std=c++17 -mavx2 -mfma -mf16c -mno-avx512f -I"$src/src/ggml-cpu" -I"$src/src" \
  -I"$src/include" scripts/ggml-ops/silu_avx2.cpp -o "$tmp/silu-avx2"
"$tmp/silu-avx2" >"$tmp/silu-avx2.json"
KVGATE_GGML_OPS="$tmp/ops.json" KVGATE_GGML_SILU_AVX2="$tmp/silu-avx2.json" \
  cargo test -p engine --lib -- --ignored --exact \
  model::int8::tests::quantization_equals_ggmls model::activation::tests::gelu_table_equals_ggmls \
  model::activation::tests::silu_equals_ggmls model::activation::tests::silu8_equals_ggmls_avx2_build
