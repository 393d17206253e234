#!/usr/bin/env bash
# The embedded engine against llama.cpp on the default model (SmolLM2-135M-Instruct Q4_1), side
# by side in one run (issue #18): for each thread count (1 and 2) and each of two rounds,
# `kvgate bench --engine-model` then `llama-bench -p 512 -n 128` on the same file and threads,
# alternating so that machine load affects both alike. Slow (llama.cpp is built by
# scripts/build-llamacpp.sh, ~20 min the first time; the runs ~8 min), so never in CI.
#
# Prints one Markdown table: prefill 512 (kvgate: one forward, best of 3; llama.cpp: pp512, mean
# of 3), single-stream decode (kvgate: 64 steps after a 64-token prompt; llama.cpp: tg128), their
# ratios, kvgate's aggregate decode at 8 streams (and its multiple of one stream) and 16 streams,
# and the 16-token chunk after 1,024 cached tokens as % of the uncached prefill. Raw outputs in
# $OUT. The #18 goals: decode ≥ 1.0×, prefill ≥ 2×, 8 streams ≥ 4× one stream, cached ≤ 5 %.
#   KVGATE_BENCH_NUMERICS the engine's arithmetic, `exact` (default: F32 activations) or
#                         `llama-cpp` (8-bit activations in the block products, as llama.cpp)
#   KVGATE_BENCH_THREADS  thread counts (default "1 2")
#   KVGATE_BENCH_ROUNDS   rounds per thread count (default 2)
#   OUT                   raw outputs (default bench-out/vs-llamacpp)
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
threads_list="${KVGATE_BENCH_THREADS:-1 2}"
rounds="${KVGATE_BENCH_ROUNDS:-2}"
numerics="${KVGATE_BENCH_NUMERICS:-exact}"
out="${OUT:-bench-out/vs-llamacpp}"
mkdir -p "$out"

bin="$(./scripts/build-llamacpp.sh | tail -1)"
llama_bench="$bin/llama-bench"
[ -x "$llama_bench" ] || { echo "bench: $llama_bench missing" >&2; exit 1; }
./scripts/fetch-model.sh >/dev/null
model="${KVGATE_MODEL_DIR:-$root/models}/SmolLM2-135M-Instruct.Q4_1.gguf"
cargo build --quiet --workspace --bin kvgate
kvgate="${CARGO_TARGET_DIR:-$root/target}/debug/kvgate"

cpu="$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//')"
echo "machine: $cpu, $(nproc) vCPUs; $(date -u '+%Y-%m-%d %H:%M UTC'); $(basename "$model"); kvgate --numerics $numerics"
echo
echo "| threads | round | kvgate prefill 512 | llama.cpp pp512 | ratio | kvgate decode | llama.cpp tg128 | ratio | kvgate 8 streams | × one | kvgate 16 streams | 16 after 1,024 cached |"
echo "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
for t in $threads_list; do
  for r in $(seq 1 "$rounds"); do
    name="t$t-r$r"
    "$kvgate" bench --engine-model "$model" --engine-threads "$t" --engine-numerics "$numerics" >"$out/$name.kvgate.txt" 2>&1
    "$llama_bench" -m "$model" -p 512 -n 128 -t "$t" -r 3 -o json >"$out/$name.llamacpp.json" 2>"$out/$name.llamacpp.err"
    row="$(.venv/bin/python3 scripts/engine_bench_row.py "$out/$name.kvgate.txt" "$out/$name.llamacpp.json" --full)"
    echo "| $t | $r | $row |"
  done
done
