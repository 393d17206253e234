#!/usr/bin/env bash
# The embedded engine beside llama.cpp on the same GGUF files, one per architecture, side by side
# in one run (issue #16): `kvgate bench --engine-model F` and `llama-bench -m F` alternated per
# file, so machine load affects both alike. Slow (llama.cpp is built by scripts/build-llamacpp.sh,
# ~20 min the first time; the runs take ~15 min), so never in CI.
#
# Files: the real SmolLM2-135M-Instruct Q4_1 (llama; scripts/fetch-model.sh) and Gemma 3 270M
# Q4_K_M (gemma3; scripts/fetch-gemma3.sh), and generated files at SmolLM2-135M's shapes with
# pseudo-random Q8_0 weights (`engine/examples/tiny_gguf.rs --bench-shape`: the speed of a
# forward does not depend on the weights' values) for llama3 (RoPE frequency factors), qwen2,
# qwen3 and phi3 (with llama.cpp's phi-3 vocabulary, 32k tokens, which its phi3 loader
# requires; the others carry SmolLM2's 49k) — no real file of those is on PyPI.
#
# Measures (both engines, T threads, prompts of arbitrary token ids):
#   prefill  kvgate: one 512-token forward, best of 3    llama.cpp: pp512, mean of 3 (-r 3)
#   decode   kvgate: 64 steps after a 64-token prompt    llama.cpp: tg64 from an empty context
# Prints a Markdown table (tok/s and kvgate/llama.cpp ratios); raw outputs under $OUT.
#   KVGATE_BENCH_THREADS  threads of both engines (default 1)
#   KVGATE_BENCH_ONLY     space-separated architectures to run (default: all)
#   OUT                   folder for the raw outputs (default bench-out/architectures)
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
threads="${KVGATE_BENCH_THREADS:-1}"
out="${OUT:-bench-out/architectures}"
mkdir -p "$out"

bin="$(./scripts/build-llamacpp.sh | tail -1)"
llama_bench="$bin/llama-bench"
[ -x "$llama_bench" ] || { echo "bench: $llama_bench missing" >&2; exit 1; }
./scripts/fetch-model.sh >/dev/null
smol="${KVGATE_MODEL_DIR:-$root/models}/SmolLM2-135M-Instruct.Q4_1.gguf"
gemma="$(./scripts/fetch-gemma3.sh | tail -1)"
cargo build --quiet --workspace --bin kvgate --example tiny_gguf
kvgate="${CARGO_TARGET_DIR:-$root/target}/debug/kvgate"
tiny="${CARGO_TARGET_DIR:-$root/target}/debug/examples/tiny_gguf"

gen="$out/models"
mkdir -p "$gen"
files=("llama|Q4_1 (real SmolLM2-135M)|$smol" "gemma3|Q4_K_M (real Gemma 3 270M)|$gemma")
only="${KVGATE_BENCH_ONLY:-}"   # e.g. `phi3`: run only the entries of these architectures
vocabs="$(./scripts/fetch-fixtures.sh | tail -1)"
for a in llama3 qwen2 qwen3 phi3; do
  f="$gen/$a-q8_0-bench.gguf"
  tok="$smol"
  # llama.cpp's phi3 loader insists on the phi-3 vocabulary (as scripts/make-llamacpp-fixtures.sh).
  [ "$a" = phi3 ] && tok="$vocabs/ggml-vocab-phi-3.gguf"
  [ -f "$f" ] || "$tiny" "$a-q8_0" "$tok" "$f" --bench-shape
  files+=("$a|Q8_0 (generated, SmolLM2 shapes)|$f")
done

cpu="$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//')"
echo "machine: $cpu, $(nproc) vCPUs; threads $threads; $(date -u '+%Y-%m-%d %H:%M UTC')"
echo
echo "| architecture | file | kvgate prefill 512 | llama.cpp pp512 | ratio | kvgate decode | llama.cpp tg64 | ratio |"
echo "|---|---|---:|---:|---:|---:|---:|---:|"
for entry in "${files[@]}"; do
  IFS='|' read -r arch label f <<<"$entry"
  [ -n "$only" ] && [[ " $only " != *" $arch "* ]] && continue
  name="$(basename "$f" .gguf)"
  "$kvgate" bench --engine-model "$f" --engine-threads "$threads" >"$out/$name.kvgate.txt" 2>&1
  "$llama_bench" -m "$f" -p 512 -n 64 -t "$threads" -r 3 -o json >"$out/$name.llamacpp.json" 2>"$out/$name.llamacpp.err"
  row="$(.venv/bin/python3 scripts/engine_bench_row.py "$out/$name.kvgate.txt" "$out/$name.llamacpp.json")"
  echo "| $arch | $label | $row |"
done
