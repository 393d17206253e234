#!/usr/bin/env bash
# kvgate's gateway against the SGLang model gateway (`smg`, PyPI `sglang-router==0.3.2`) on the
# same fleet of simulated kvgate workers, side by side in one run (issue #17).
#
#   ./scripts/bench-vs-smg.sh [N] [SEEDS]          e.g. ./scripts/bench-vs-smg.sh 4 "1 2 3"
#   WORKLOADS="prefix-chat" ./scripts/bench-vs-smg.sh 16 1   # a subset of the workloads
#   MAX_TOKENS=64 ./scripts/bench-vs-smg.sh 16 1                # longer answers (default 8)
#   KVGATE_BIN=/path/to/kvgate ./scripts/bench-vs-smg.sh …      # another build (e.g. a baseline)
#
# For each seed and each of four routers — kvgate round_robin, kvgate kv_exact (its defaults),
# smg round_robin, smg cache_aware (smg's defaults) — it starts N fresh simulated workers
# (`kvgate worker --engine sim`: the real scheduler, block pool, prefix cache and KV events, a
# timing model in place of the model: prefill 125 µs per uncached token, a decode step
# 8 ms + 0.5 ms per sequence — the fleet bench's), the router in front of them, and runs the same
# `kvgate bench --target` workloads (shared-prefix, multi-turn and prefix-chat — conversations
# over shared system prompts —, the fleet bench's shapes)
# through it. Hit rate comes from the workers' `cached_tokens`, the worker of each answer from its
# `x-kvgate-worker-id` header. Prints one table; outputs under $OUT (default bench-vs-smg-out/),
# kvgate's decision log (its gateway runs with `--decision-log`, as deployed) and its /metrics
# (gateway-metrics.txt: route decision, tokenizing CPU and TTFT histograms) beside each run's records.
#
# Needs: cargo (builds target/debug/kvgate), python3 with venv (installs sglang-router into
# .cache/smg-venv), the default model file (its prompt profile; scripts/fetch-model.sh).
set -euo pipefail
cd "$(dirname "$0")/.."

N=${1:-4}
SEEDS=${2:-"1 2 3"}
OUT=${OUT:-bench-vs-smg-out}
SMG_VERSION=0.3.2
BASE_PORT=${BASE_PORT:-19100}
NAME=bench-vs-smg
# shellcheck source=scripts/bench-common.sh
. scripts/bench-common.sh
smg_venv
kvgate_bin
bench_model
MAX_TOKENS=${MAX_TOKENS:-8}
mkdir -p "$OUT"
work=$(mktemp -d)
trap 'stop_pids; rm -rf "$work"' EXIT

start_workers() { # dir (holding keys/gateway.pub)
  local urls=()
  for i in $(seq 1 "$N"); do
    local port=$((BASE_PORT + i))
    "$KVGATE" worker --engine sim --model "$MODEL" --id "w$i" --listen "127.0.0.1:$port" --drain-timeout-secs 0 \
      --state-dir "$1/w$i" --gateway-keys "$1/keys" \
      "${SIM_TIMING[@]}" \
      >"$1/w$i.log" 2>&1 &
    pids+=($!)
    urls+=("http://127.0.0.1:$port")
  done
  for u in "${urls[@]}"; do wait_http "$u/ready" "worker $u"; done
  WORKER_URLS=("${urls[@]}")
}

kvgate_rules() { # dir, rule
  "$KVGATE" tokenize --model "$MODEL" --text x --json >"$1/profile.json"
  python3 - "$1/profile.json" "$MODEL" "$2" "${WORKER_URLS[@]}" >"$1/rules.toml" <<'PY'
import json, sys
ident = json.load(open(sys.argv[1]))["identity"]
model, rule, urls = sys.argv[2], sys.argv[3], sys.argv[4:]
out = []
for i, u in enumerate(urls, 1):
    out += ["[[workers]]", f'id = "w{i}"', f'url = "{u}"']
ids = ", ".join(f'"w{i}"' for i in range(1, len(urls) + 1))
out += ["[[pools]]", 'id = "all"', f"workers = [{ids}]"]
out += ["[[profiles]]", 'id = "sim"', f'model_id = "{ident["model_id"]}"',
        f'revision = "{ident["revision"]}"', f'source = {{ gguf = "{model}" }}',
        f'template_sha256 = "{ident["template_sha256"]}"',
        f'tokenizer_sha256 = "{ident["tokenizer_sha256"]}"', "block_size = 16",
        'hash_algorithm = "xxh3"', f'context_limit = {ident["context_limit"]}',
        "native_reserve_tokens = 0"]
out += ["[[services]]", 'name = "chat"', 'pool = "all"', f"rule = {rule}"]
print("\n".join(out))
PY
}

run_one() { # router policy seed workload-args...
  local router=$1 policy=$2 seed=$3 workload=$5 dir="$work/$1-$2-$3-$5"
  rm -rf "$dir"
  mkdir -p "$dir"
  "$KVGATE" keygen --out "$dir/keys" --name gateway >/dev/null
  start_workers "$dir"
  local port=$((BASE_PORT + 100))
  if [ "$router" = kvgate ]; then
    local rule='{ type = "round_robin" }'
    [ "$policy" = kv_exact ] && rule='{ type = "kv_exact", profile = "sim", min_match_tokens = 16 }'
    kvgate_rules "$dir" "$rule"
    "$KVGATE" gateway --rules "$dir/rules.toml" --listen "127.0.0.1:$port" --drain-timeout-secs 0 \
      --admin "127.0.0.1:$((port + 1))" --key "$dir/keys/gateway.key" --no-watch \
      --decision-log "$dir/decisions.jsonl" >"$dir/gw.log" 2>&1 &
    pids+=($!)
    gw=$!
  else
    "$VENV/bin/smg" launch --host 127.0.0.1 --port "$port" --policy "$policy" \
      --worker-urls "${WORKER_URLS[@]}" --prometheus-port $((port + 2)) >"$dir/gw.log" 2>&1 &
    pids+=($!)
    gw=$!
  fi
  if [ "$router" = kvgate ]; then
    # Every worker healthy, contract checked and its KV events connected (round robin: not
    # subscribed, nothing reads them).
    local ready=0
    for _ in $(seq 1 300); do
      if curl -fsS "http://127.0.0.1:$((port + 1))/admin/workers" 2>/dev/null | python3 -c '
import json, sys
ws = json.load(sys.stdin)["workers"]
ok = all(w["healthy"] and w["contract"]["state"] in ("ok", "not_required")
         and w["events"]["state"] in ("connected", "not_subscribed") for w in ws)
sys.exit(0 if ok and ws else 1)' 2>/dev/null; then ready=1; break; fi
      sleep 0.1
    done
    [ "$ready" = 1 ] || { echo "bench-vs-smg: the kvgate gateway did not get ready" >&2; return 1; }
  else
    wait_http "http://127.0.0.1:$port/health" "smg $policy"
  fi
  local pool cpu0 cpu1 loads0=0 loads1=0
  [ "$router" = kvgate ] && loads0=$(load_reports $((port + 1)))
  cpu0=$(tree_cpu_us "$gw")
  pool=$(seq -s, 1 "$N" | sed 's/\([0-9]*\)/w\1/g')
  shift 3
  "$KVGATE" bench --target "http://127.0.0.1:$port" --label "$router-$policy" --seed "$seed" \
    --pool "$pool" --out "$OUT/n$N-seed$seed/$router-$policy" "$@" >"$dir/bench.log" 2>&1 || {
      echo "bench-vs-smg: the bench through $router $policy failed (seed $seed):" >&2
      tail -20 "$dir/bench.log" >&2
      return 1
    }
  cpu1=$(tree_cpu_us "$gw")
  [ "$router" = kvgate ] && loads1=$(load_reports $((port + 1)))
  # The router's own CPU (user + system, its process tree) over the bench, per request; and
  # kvgate's `event: load` messages received over the bench, per request.
  grep -E "^(label|$router-$policy) " "$dir/bench.log" | tail -n +2 | awk -v c=$((cpu1 - cpu0)) \
    -v l=$((loads1 - loads0)) -v k="$router" -v s="$seed" '{ n = ($2 > 0 ? $2 : 1)
      printf "seed %s  %s %12.3f %10s\n", s, $0, c / 1000 / n, (k == "kvgate" ? sprintf("%.1f", l / n) : "-") }'
  if [ "$router" = kvgate ]; then # its route decision and TTFT histograms, for the record
    # (one file per workload: each workload runs on a freshly started gateway)
    curl -fsS "http://127.0.0.1:$((port + 1))/metrics" \
      >"$OUT/n$N-seed$seed/$router-$policy/$workload/gateway-metrics.txt" 2>/dev/null || true
    # Which worker each request went to, with its ticket (predicted matched tokens), for the
    # record beside the bench's own per-request records.
    cp "$dir/decisions.jsonl" "$OUT/n$N-seed$seed/$router-$policy/$workload/decisions.jsonl" \
      2>/dev/null || true
  fi
  stop_pids
}

# Sum of kvgate_gateway_worker_load_reports_total over the workers (admin port $1).
load_reports() {
  curl -fsS "http://127.0.0.1:$1/metrics" 2>/dev/null |
    awk '/^kvgate_gateway_worker_load_reports_total/ { s += $2 } END { printf "%d\n", s }'
}

P=$(( N / 4 > 4 ? N / 4 : 4 ))
C=$(( N / 2 > 4 ? N / 2 : 4 ))
CONV=$(( N > 8 ? N : 8 ))
for workload in ${WORKLOADS:-shared-prefix multi-turn prefix-chat}; do
  echo "== $workload, $N simulated workers"
  echo "seed  label           reqs  err  ttft_p50  ttft_p95   itl_p50   e2e_p50      hit wall_tok/s  max_share  router_cpu_ms/req  loads/req"
  for seed in $SEEDS; do
    for rp in "kvgate round_robin" "kvgate kv_exact" "smg round_robin" "smg cache_aware"; do
      # shellcheck disable=SC2086
      run_one $rp "$seed" --workload "$workload" --prefixes "$P" --questions 6 \
        --conversations "$CONV" --turns 4 --long-words 1200 --max-tokens "$MAX_TOKENS" --concurrency "$C" \
        --model smollm2
    done
  done
done
