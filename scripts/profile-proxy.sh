#!/usr/bin/env bash
# Where a forwarded request's CPU goes (issue #22), counted in instructions, which — unlike
# wall time on a shared VM — do not move between runs: kvgate round robin and pingora alone
# (`gateway/examples/pingora_floor.rs`) run under valgrind's callgrind in front of one simulated
# worker; after a warm-up their counters are zeroed, `wrk` sends SECONDS of `GET /get_model_info`
# (the worker's 404, forwarded) at 4 connections to each in turn, and the counters are dumped.
# Prints instructions per request for both and kvgate's costliest functions (inclusive), per
# request.
#
#   ./scripts/profile-proxy.sh [SECONDS]         e.g. ./scripts/profile-proxy.sh 20
#
# Needs: valgrind (`callgrind_control`, `callgrind_annotate`) and wrk — Debian packages, installed
# when missing and running as root — and the default model file (its prompt profile). Outputs
# stay in OUT (default profile-proxy-out): callgrind.kvgate.*, callgrind.floor.*, summary.txt.
# Instructions are not time (AWS-LC's multiply-heavy field arithmetic does more per instruction
# than most code); docs/benchmarks.md puts the counts beside measured CPU time.
set -euo pipefail
cd "$(dirname "$0")/.."

SECS=${1:-20}
OUT=${OUT:-profile-proxy-out}
BASE_PORT=${BASE_PORT:-19500}
MODEL_DIR=${KVGATE_MODEL_DIR:-$PWD/models}
MODEL="$MODEL_DIR/SmolLM2-135M-Instruct.Q4_1.gguf"
[ -f "$MODEL" ] || ./scripts/fetch-model.sh >/dev/null
if ! command -v valgrind >/dev/null || ! command -v wrk >/dev/null; then
  if [ "$(id -u)" = 0 ]; then
    apt-get install -y -qq valgrind wrk >/dev/null
  else
    echo "profile-proxy: needs valgrind and wrk (apt-get install -y valgrind wrk)" >&2
    exit 1
  fi
fi
NAME=profile-proxy
SMG_VERSION=unused
# shellcheck source=scripts/bench-common.sh
. scripts/bench-common.sh
cargo build --quiet --workspace --bin kvgate --example pingora_floor
KVGATE=$PWD/target/debug/kvgate
FLOOR=$PWD/target/debug/examples/pingora_floor
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
rm -f "$OUT"/callgrind.*
work=$(mktemp -d)
trap 'stop_pids; rm -rf "$work"' EXIT

W="127.0.0.1:$((BASE_PORT + 1))"
GW_PORT=$((BASE_PORT + 10))
FLOOR_PORT=$((BASE_PORT + 40))
sim_worker_rr
valgrind --tool=callgrind --callgrind-out-file="$OUT/callgrind.kvgate.%p" "$KVGATE" gateway \
  --rules "$work/rules.toml" --listen "127.0.0.1:$GW_PORT" --admin "127.0.0.1:$((GW_PORT + 1))" \
  --key "$work/keys/gateway.key" --no-watch --threads 2 --decision-log "$work/decisions.jsonl" \
  >"$work/gw.log" 2>&1 &
GW_PID=$!
pids+=($GW_PID)
valgrind --tool=callgrind --callgrind-out-file="$OUT/callgrind.floor.%p" "$FLOOR" \
  "127.0.0.1:$FLOOR_PORT" "$W" 2 >"$work/floor.log" 2>&1 &
FLOOR_PID=$!
pids+=($FLOOR_PID)
# Under valgrind start-up takes a while (the gateway loads the prompt profile).
for _ in $(seq 1 1200); do
  curl -fsS "http://127.0.0.1:$((GW_PORT + 1))/admin/workers" 2>/dev/null |
    grep -q '"healthy":true' && break
  sleep 0.1
done
for _ in $(seq 1 600); do
  [ "$(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$FLOOR_PORT/get_model_info")" = 404 ] && break
  sleep 0.1
done
for port in $GW_PORT $FLOOR_PORT; do
  code=$(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$port/get_model_info")
  [ "$code" = 404 ] || { echo "$NAME: port $port answers $code, not the worker's 404" >&2; exit 1; }
  for _ in $(seq 1 20); do curl -s -o /dev/null "http://127.0.0.1:$port/get_model_info"; done
done
callgrind_control -z "$GW_PID" >/dev/null 2>&1
callgrind_control -z "$FLOOR_PID" >/dev/null 2>&1
n_gw=$(wrk -t1 -c4 -d"${SECS}s" "http://127.0.0.1:$GW_PORT/get_model_info" | awk '/requests in/{print $1}')
n_floor=$(wrk -t1 -c4 -d"${SECS}s" "http://127.0.0.1:$FLOOR_PORT/get_model_info" | awk '/requests in/{print $1}')
callgrind_control -d "$GW_PID" >/dev/null 2>&1
callgrind_control -d "$FLOOR_PID" >/dev/null 2>&1
sleep 2
total() { callgrind_annotate "$1" 2>/dev/null | awk '/PROGRAM TOTALS/{gsub(",","",$1); print $1}'; }
gw_file=$(ls "$OUT"/callgrind.kvgate.*.1)
floor_file=$(ls "$OUT"/callgrind.floor.*.1)
{
  echo "requests: kvgate $n_gw, pingora alone $n_floor (wrk -t1 -c4 -d${SECS}s each, under callgrind)"
  python3 - "$(total "$gw_file")" "$n_gw" "$(total "$floor_file")" "$n_floor" <<'EOF'
import sys
gi, gn, fi, fn = (int(x) for x in sys.argv[1:])
print(f"instructions per request: kvgate {gi / gn:,.0f}, pingora alone {fi / fn:,.0f} "
      f"({gi / gn / (fi / fn):.2f}x)")
EOF
  echo "kvgate's costliest functions, inclusive instructions per request:"
  callgrind_annotate --inclusive=yes --threshold=100 "$gw_file" 2>/dev/null |
    awk -v n="$n_gw" '/^ *[0-9,]+ / && /(gateway|receipts|aws_lc|ed25519|canonical|insert_header|__rust_alloc|memcpy)/ {
        c=$1; gsub(",","",c); $1=""; if (c/n >= 2000) printf "%9.0f %s\n", c/n, substr($0, 1, 150) }' |
    grep -v '=>' | sed -E "s# $PWD/# #; s# \\[[^]]*\\]\$##" | sort -rn | awk '!seen[$0]++' | head -25
} | tee "$OUT/summary.txt"
