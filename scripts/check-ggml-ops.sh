#!/usr/bin/env bash
# Checks the ops `--numerics llama-cpp` reproduces against ggml itself, bit for bit: compiles
# scripts/ggml-ops/ops.cpp against the llama.cpp build (scripts/build-llamacpp.sh), dumps what
# ggml's CPU backend computes (Q8_1/Q8_0 activation quantization, GELU), then runs the engine's
# ignored tests that compare with the dump:
#   engine int8::tests::quantization_equals_ggmls, executor::tests::gelu_table_equals_ggmls.
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
KVGATE_GGML_OPS="$tmp/ops.json" cargo test -p engine --lib -- --ignored --exact \
  model::int8::tests::quantization_equals_ggmls model::executor::tests::gelu_table_equals_ggmls
