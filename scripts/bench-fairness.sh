#!/usr/bin/env bash
# The fairness probe on the real engine (issue #18 item 5), several scheduler settings side by
# side: per round, each setting gets a freshly started SmolLM2 worker (2 threads, 1.3 GB of KV)
# and `kvgate bench --workload overload-fairness` (twelve ~2,039-token prompts, then 200 ms later
# one ~62-token request: the probe), settings alternating so machine load affects each alike.
# Slow (~1 min per run), so never in CI.
#
# Prints per run the probe's TTFT, the long prompts' TTFT p50 and last, and the long prompts'
# prefill throughput (their prompt tokens / the last long TTFT), the worker's engine steps and its
# last step budget (kvgate_worker_engine_step_budget_tokens); then per setting the runs with
# the probe ≤ 2 s and the median throughput against the first setting's.
#   SETTINGS  space-separated NAME=FLAGS, FLAGS with commas for spaces (default below)
#   ROUNDS    rounds (default 5)
#   OUT       raw outputs (default bench-out/fairness)
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
NAME=bench-fairness
settings="${SETTINGS:-default= step256=--step-token-budget,256,--prefill-chunk,128}"
rounds="${ROUNDS:-5}"
out="${OUT:-bench-out/fairness}"
rm -rf "$out"
mkdir -p "$out"
# shellcheck source=scripts/bench-common.sh
. "$root/scripts/bench-common.sh"
trap stop_pids EXIT
./scripts/fetch-model.sh >/dev/null
model="${KVGATE_MODEL_DIR:-$root/models}/SmolLM2-135M-Instruct.Q4_1.gguf"
cargo build --quiet --bin kvgate
kvgate="${CARGO_TARGET_DIR:-$root/target}/debug/kvgate"
py="$root/.venv/bin/python3"
port=8471

cpu="$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//')"
echo "machine: $cpu, $(nproc) vCPUs; $(date -u '+%Y-%m-%d %H:%M UTC')"
for r in $(seq 1 "$rounds"); do
  for s in $settings; do
    name="${s%%=*}"
    IFS=',' read -r -a flags <<<"${s#*=}"
    dir="$out/$name/r$r"
    mkdir -p "$dir"
    "$kvgate" worker --model "$model" --listen "127.0.0.1:$port" --id w1 --state-dir "$dir/state" --drain-timeout-secs 0 \
      --threads 2 --kv-budget-mb 1300 "${flags[@]}" >"$dir/worker.log" 2>&1 &
    pids+=($!)
    wait_http "http://127.0.0.1:$port/ready" "kvgate worker ($name)"
    "$kvgate" bench --target "http://127.0.0.1:$port" --workload overload-fairness \
      --long-words 1850 --max-tokens 4 --concurrency 13 --request-timeout 300 --max-seconds 600 \
      --out "$dir/bench" >"$dir/bench.txt" 2>&1 \
      || { echo "$NAME: bench failed ($name, round $r); see $dir/bench.txt" >&2; exit 1; }
    curl -fsS "http://127.0.0.1:$port/metrics" >"$dir/metrics.txt"
    stop_pids
  done
done
"$py" - "$out" "$settings" "$rounds" <<'PYEOF'
import json, statistics, sys
out, settings, rounds = sys.argv[1], [s.split("=")[0] for s in sys.argv[2].split()], int(sys.argv[3])
def run(name, r):
    recs = [json.loads(l) for l in open(f"{out}/{name}/r{r}/bench/overload-fairness/records.jsonl")]
    probe = [x for x in recs if x["class"] == "probe"][0]
    long = [x for x in recs if x["class"] == "long"]
    if probe.get("ttft_seconds") is None or any(x.get("ttft_seconds") is None for x in long):
        sys.exit(f"bench-fairness: a request failed in {name} round {r}")
    ttfts = sorted(x["ttft_seconds"] for x in long)
    toks = sum(x["actual_prompt_tokens"] for x in long)
    steps = budget = "?"
    for line in open(f"{out}/{name}/r{r}/metrics.txt"):
        if line.startswith("kvgate_worker_engine_steps_total "):
            steps = line.split()[1]
        if line.startswith("kvgate_worker_engine_step_budget_tokens "):
            budget = line.split()[1]
    return probe["ttft_seconds"], statistics.median(ttfts), ttfts[-1], toks / ttfts[-1], steps, budget
print("| setting | round | probe TTFT s | long TTFT p50 s | last long TTFT s | long prefill tok/s | engine steps | last step budget |")
print("|---|---:|---:|---:|---:|---:|---:|---:|")
res = {n: [run(n, r) for r in range(1, rounds + 1)] for n in settings}
for r in range(rounds):
    for n in settings:
        p, m, last, tps, steps, budget = res[n][r]
        print(f"| {n} | {r + 1} | {p:.2f} | {m:.1f} | {last:.1f} | {tps:.0f} | {steps} | {budget} |")
print()
base = statistics.median(x[3] for x in res[settings[0]])
print(f"| setting | probe ≤ 2 s | probe TTFT max s | long prefill tok/s median | vs {settings[0]} |")
print("|---|---:|---:|---:|---:|")
for n in settings:
    med = statistics.median(x[3] for x in res[n])
    ok = sum(1 for x in res[n] if x[0] <= 2.0)
    print(f"| {n} | {ok} of {rounds} | {max(x[0] for x in res[n]):.2f} | {med:.0f} | {med / base:.3f}× |")
PYEOF
