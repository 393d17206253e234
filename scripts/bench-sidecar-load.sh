#!/usr/bin/env bash
# Independent gateways in front of native-engine sidecars, with and without the sidecars' load
# reports (docs/sidecar.md, "Load reports"), side by side in one run.
#
#   ./scripts/bench-sidecar-load.sh [N] [G] [SEEDS]      e.g. ./scripts/bench-sidecar-load.sh 4 3 "1 2 3"
#   WORKLOADS="shared-prefix" QUESTIONS=24 ./scripts/bench-sidecar-load.sh 4 3 1   # a subset, longer
#   CONCURRENCY=16 MAX_TOKENS=64 CONVERSATIONS=32 …    # defaults: max(8, 2N), 8 tokens, max(8, 2N)
#   ARMS="load no-load" …                              # a subset of the arms
#
# For each seed and each arm it starts N fresh simulated kvgate workers as the engines
# (`kvgate worker --engine sim`, the timing model of bench-vs-smg.sh), a `kvgate sidecar` in
# front of each (kind "openai" in the rules: holdings approximated, as for any native engine),
# and G independent gateways (no cluster: none knows the others' requests), each with its own
# key and a `kv_exact` service over the N sidecars; then runs `kvgate bench --target` with the
# requests spread over the G gateways in turn (`--vip request`). Arms:
#   load     the sidecars report the work every gateway forwarded (GET /v1/load, the default);
#   no-load  the sidecars start with --no-load-report: each gateway judges an engine by its own
#            requests there alone;
#   one-gw   one gateway instead of G (sidecars reporting): what a single router does, for scale.
# Hit rate comes from the engines' `cached_tokens`, the sidecar of each answer from its
# `x-kvgate-worker-id` header. Prints one table; outputs under $OUT (default bench-sidecar-load-out/).
#
# Needs: cargo (builds target/debug/kvgate), python3, the default model file (its prompt profile;
# scripts/fetch-model.sh).
set -euo pipefail
cd "$(dirname "$0")/.."

N=${1:-4}
G=${2:-3}
SEEDS=${3:-"1 2 3"}
OUT=${OUT:-bench-sidecar-load-out}
BASE_PORT=${BASE_PORT:-19400}
NAME=bench-sidecar-load
# shellcheck source=scripts/bench-common.sh
. scripts/bench-common.sh
kvgate_bin
bench_model
MAX_TOKENS=${MAX_TOKENS:-8}
mkdir -p "$OUT"
work=$(mktemp -d)
trap 'stop_pids; rm -rf "$work"' EXIT

run_one() { # arm seed workload-args...
  local arm=$1 seed=$2 workload=$4 dir="$work/$1-$2-$4" gws=$G
  [ "$arm" = one-gw ] && gws=1
  rm -rf "$dir"
  mkdir -p "$dir/keys"
  for g in $(seq 1 "$gws"); do "$KVGATE" keygen --out "$dir/keys" --name "g$g" >/dev/null; done
  local sidecars=() flag=()
  [ "$arm" = no-load ] && flag=(--no-load-report)
  for i in $(seq 1 "$N"); do
    local wport=$((BASE_PORT + i)) sport=$((BASE_PORT + 50 + i))
    "$KVGATE" worker --engine sim --model "$MODEL" --id "w$i" --listen "127.0.0.1:$wport" \
      --drain-timeout-secs 0 --state-dir "$dir/w$i" \
      "${SIM_TIMING[@]}" \
      >"$dir/w$i.log" 2>&1 &
    pids+=($!)
    "$KVGATE" sidecar --engine "http://127.0.0.1:$wport" --listen "127.0.0.1:$sport" --id "s$i" \
      --health-path /ready --state-dir "$dir/s$i" --gateway-keys "$dir/keys" --require-ticket \
      --drain-timeout-secs 0 "${flag[@]}" >"$dir/s$i.log" 2>&1 &
    pids+=($!)
    sidecars+=("http://127.0.0.1:$sport")
  done
  for s in "${sidecars[@]}"; do wait_http "$s/ready" "sidecar $s"; done
  "$KVGATE" tokenize --model "$MODEL" --text x --json >"$dir/profile.json"
  python3 - "$dir/profile.json" "$MODEL" "${sidecars[@]}" >"$dir/rules.toml" <<'PY'
import json, sys
ident = json.load(open(sys.argv[1]))["identity"]
model, urls = sys.argv[2], sys.argv[3:]
out = ["[gateway]", "health_interval_ms = 200"]
for i, u in enumerate(urls, 1):
    out += ["[[workers]]", f'id = "s{i}"', f'url = "{u}"', 'kind = "openai"']
ids = ", ".join(f'"s{i}"' for i in range(1, len(urls) + 1))
out += ["[[pools]]", 'id = "all"', f"workers = [{ids}]"]
out += ["[[profiles]]", 'id = "sim"', f'model_id = "{ident["model_id"]}"',
        f'revision = "{ident["revision"]}"', f'source = {{ gguf = "{model}" }}',
        f'template_sha256 = "{ident["template_sha256"]}"',
        f'tokenizer_sha256 = "{ident["tokenizer_sha256"]}"', "block_size = 16",
        'hash_algorithm = "xxh3"', f'context_limit = {ident["context_limit"]}',
        "native_reserve_tokens = 0"]
out += ["[[services]]", 'name = "chat"', 'pool = "all"',
        'rule = { type = "kv_exact", profile = "sim", min_match_tokens = 16 }']
print("\n".join(out))
PY
  local targets=() want=connected
  [ "$arm" = no-load ] && want=unsupported
  for g in $(seq 1 "$gws"); do
    local port=$((BASE_PORT + 100 + 2 * g))
    "$KVGATE" gateway --rules "$dir/rules.toml" --listen "127.0.0.1:$port" --drain-timeout-secs 0 \
      --admin "127.0.0.1:$((port + 1))" --key "$dir/keys/g$g.key" --gateway-id "g$g" --no-watch \
      >"$dir/g$g.log" 2>&1 &
    pids+=($!)
    targets+=("http://127.0.0.1:$port")
  done
  # Every gateway: every sidecar healthy, contract checked, its load stream as the arm says.
  for g in $(seq 1 "$gws"); do
    local admin=$((BASE_PORT + 101 + 2 * g)) ready=0
    for _ in $(seq 1 300); do
      if curl -fsS "http://127.0.0.1:$admin/admin/workers" 2>/dev/null | WANT=$want python3 -c '
import json, os, sys
ws = json.load(sys.stdin)["workers"]
ok = all(w["healthy"] and w["contract"]["state"] == "ok"
         and w["events"]["load_stream"] == os.environ["WANT"] for w in ws)
sys.exit(0 if ok and ws else 1)' 2>/dev/null; then ready=1; break; fi
      sleep 0.1
    done
    [ "$ready" = 1 ] || { echo "$NAME: gateway g$g did not get ready ($arm)" >&2; return 1; }
  done
  local pool
  pool=$(seq -s, 1 "$N" | sed 's/\([0-9]*\)/s\1/g')
  shift 2
  "$KVGATE" bench --target "$(IFS=,; echo "${targets[*]}")" --vip request --label "$arm" \
    --seed "$seed" --pool "$pool" --out "$OUT/n$N-g$G-seed$seed/$arm" "$@" >"$dir/bench.log" 2>&1 || {
      echo "$NAME: the bench ($arm, seed $seed) failed:" >&2
      tail -20 "$dir/bench.log" >&2
      return 1
    }
  grep -E "^$arm " "$dir/bench.log" | awk -v s="$seed" '{ printf "seed %s  %s\n", s, $0 }'
  stop_pids
}

P=$(( N / 4 > 4 ? N / 4 : 4 ))
C=${CONCURRENCY:-$(( N * 2 > 8 ? N * 2 : 8 ))}
CONV=${CONVERSATIONS:-$(( N * 2 > 8 ? N * 2 : 8 ))}
for workload in ${WORKLOADS:-shared-prefix prefix-chat}; do
  echo "== $workload, $N sidecars (simulated engines), $G independent gateways, concurrency $C"
  echo "seed  label    reqs  err  ttft_p50  ttft_p95   itl_p50   e2e_p50      hit wall_tok/s  max_share"
  for seed in $SEEDS; do
    for arm in ${ARMS:-load no-load one-gw}; do
      run_one "$arm" "$seed" --workload "$workload" --prefixes "$P" --questions "${QUESTIONS:-6}" \
        --conversations "$CONV" --turns 4 --long-words 1200 --max-tokens "$MAX_TOKENS" \
        --concurrency "$C" --model smollm2
    done
  done
done
