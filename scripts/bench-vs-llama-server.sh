#!/usr/bin/env bash
# Serving side by side (issue #18 item 6): one kvgate worker (the embedded engine) and one
# llama.cpp `llama-server` on the same model file and thread count, each freshly started per run,
# the same `kvgate bench --target` workloads (multi-turn and shared-prefix) at each concurrency,
# alternating the two so machine load affects both alike. Slow (llama.cpp is built by
# scripts/build-llamacpp.sh, ~20 min the first time; the runs several minutes), so never in CI.
#
# llama-server: its prompt cache on (`cache_prompt` is its default; `--cache-ram` left at its
# default, so slots' prompts are also kept in host memory and reused across slots), `--parallel`
# = concurrency, `-c 4096 × concurrency` (4,096 tokens per slot), `--jinja` (the file's chat
# template, which the worker's pinned profile renders identically for SmolLM2). kvgate worker:
# defaults but `--threads`, `--kv-budget-mb 1024` (F32 K/V, ~22k tokens; f16 with `--numerics
# llama-cpp`, ~44k: neither side evicts).
# Both report cached prompt tokens in `usage.prompt_tokens_details.cached_tokens`. The bench opens
# a fresh connection per request (`--fresh-connections`) for both: cpp-httplib closes idle
# keep-alive connections under the client, which failed some of llama-server's sends otherwise.
#
# Prints one Markdown table: TTFT p50/p95, ITL p50, wall output tok/s and cached/prompt tokens
# per workload × concurrency × engine, and kvgate/llama-server ratios (for TTFT and ITL below 1
# is better; for tok/s above 1). Raw outputs (records, summaries, server logs) in $OUT.
#   KVGATE_BENCH_THREADS  engine threads for both (default 2)
#   KVGATE_BENCH_NUMERICS the kvgate worker's `--numerics` (default exact; llama-cpp: 8-bit
#                         activations as llama.cpp)
#   CONCURRENCY           concurrencies (default "1 4 8")
#   WORKLOADS             default "multi-turn shared-prefix"
#   OUT                   raw outputs (default bench-out/vs-llama-server)
#   extra arguments       passed to every `kvgate bench` (e.g. --long-words 200 --seed 3)
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
NAME=bench-vs-llama-server
threads="${KVGATE_BENCH_THREADS:-2}"
numerics="${KVGATE_BENCH_NUMERICS:-exact}"
concurrency_list="${CONCURRENCY:-1 4 8}"
workloads="${WORKLOADS:-multi-turn shared-prefix}"
out="${OUT:-bench-out/vs-llama-server}"
extra=("$@")
rm -rf "$out"
mkdir -p "$out"
# shellcheck source=scripts/bench-common.sh
. "$root/scripts/bench-common.sh"
trap stop_pids EXIT

llama_bin="$(./scripts/build-llamacpp.sh | tail -1)"
[ -x "$llama_bin/llama-server" ] || { echo "$NAME: $llama_bin/llama-server missing" >&2; exit 1; }
./scripts/fetch-model.sh >/dev/null
model="${KVGATE_MODEL_DIR:-$root/models}/SmolLM2-135M-Instruct.Q4_1.gguf"
cargo build --quiet --bin kvgate
kvgate="${CARGO_TARGET_DIR:-$root/target}/debug/kvgate"
py="$root/.venv/bin/python3"
port=8461

start_kvgate() { # dir
  "$kvgate" worker --model "$model" --listen "127.0.0.1:$port" --id w1 --state-dir "$1/state" --drain-timeout-secs 0 \
    --threads "$threads" --numerics "$numerics" --kv-budget-mb 1024 >"$1/server.log" 2>&1 &
  pids+=($!)
  wait_http "http://127.0.0.1:$port/ready" "kvgate worker"
}
start_llama() { # dir, concurrency
  "$llama_bin/llama-server" -m "$model" --host 127.0.0.1 --port "$port" --parallel "$2" \
    -c "$((4096 * $2))" -t "$threads" --jinja --alias SmolLM2-135M-Instruct --no-webui \
    >"$1/server.log" 2>&1 &
  pids+=($!)
  wait_http "http://127.0.0.1:$port/health" "llama-server"
}

cpu="$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//')"
echo "machine: $cpu, $(nproc) vCPUs; $(date -u '+%Y-%m-%d %H:%M UTC'); $(basename "$model"), $threads threads; kvgate --numerics $numerics"
for c in $concurrency_list; do
  for w in $workloads; do
    for engine in kvgate llama-server; do
      dir="$out/c$c/$w/$engine"
      mkdir -p "$dir"
      if [ "$engine" = kvgate ]; then start_kvgate "$dir"; else start_llama "$dir" "$c"; fi
      "$kvgate" bench --target "http://127.0.0.1:$port" --label "$engine" --workload "$w" \
        --concurrency "$c" --max-seconds 900 --request-timeout 300 --fresh-connections --out "$dir/bench" \
        "${extra[@]}" >"$dir/bench.txt" 2>&1 \
        || { echo "$NAME: bench against $engine failed (c=$c, $w); see $dir/bench.txt" >&2; exit 1; }
      stop_pids
    done
  done
done
echo
"$py" - "$out" "$concurrency_list" "$workloads" <<'PYEOF'
import json, sys
out, cs, ws = sys.argv[1], sys.argv[2].split(), sys.argv[3].split()
def s(c, w, e):
    return json.load(open(f"{out}/c{c}/{w}/{e}/bench/{w}/summary.json"))["summaries"][0]
def ms(p, k):
    return p[k] * 1000 if p else float("nan")
print("| workload | conc. | engine | TTFT p50 ms | TTFT p95 ms | ITL p50 ms | output tok/s | cached / prompt tokens | errors |")
print("|---|---:|---|---:|---:|---:|---:|---:|---:|")
ratios = []
for w in ws:
    for c in cs:
        a, b = s(c, w, "kvgate"), s(c, w, "llama-server")
        for e, x in (("kvgate", a), ("llama-server", b)):
            print(f"| {w} | {c} | {e} | {ms(x['ttft'], 'p50'):.0f} | {ms(x['ttft'], 'p95'):.0f} | "
                  f"{ms(x['itl'], 'p50'):.1f} | {x['wall_output_tok_per_s']:.1f} | "
                  f"{x['cached_tokens']} / {x['prompt_tokens']} | {x['errors']} |")
        r = lambda k, p: ms(a[k], p) / ms(b[k], p)
        ratios.append((w, c, r("ttft", "p50"), r("ttft", "p95"), r("itl", "p50"),
                       a["wall_output_tok_per_s"] / b["wall_output_tok_per_s"],
                       a["cached_tokens"] / max(b["cached_tokens"], 1)))
print()
print("| workload | conc. | TTFT p50 kvgate/llama | TTFT p95 | ITL p50 | output tok/s | cached tokens |")
print("|---|---:|---:|---:|---:|---:|---:|")
for w, c, *v in ratios:
    print(f"| {w} | {c} | " + " | ".join(f"{x:.2f}×" for x in v) + " |")
PYEOF
