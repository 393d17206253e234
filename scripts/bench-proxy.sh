#!/usr/bin/env bash
# The proxy path side by side (issue #22): nginx, the SGLang model gateway (`smg`, PyPI
# `sglang-router==0.3.2`) and kvgate round robin in front of the same simulated worker, with the
# worker alone and pingora alone (`gateway/examples/pingora_floor.rs`: the same pingora setup
# with none of kvgate's hooks) as floors. wrk on three requests — a forwarded GET
# (`GET /get_model_info`: the worker's 404, which every target forwards; smg answers unknown
# paths itself), a 1-token chat and a streamed 16-token chat — at 1 and 32 connections, targets
# alternating within each round, ROUNDS rounds (default 2).
#
#   ./scripts/bench-proxy.sh [ROUNDS] [SECONDS]        e.g. ./scripts/bench-proxy.sh 2 5
#   PROFILE=proxy-lto ./scripts/bench-proxy.sh 2 5     # kvgate and the floor built with fat LTO
#
# Prints one row per (request, connections, target, round) with req/s and p50/p99 latency, then a
# summary: the median over rounds, kvgate/nginx and kvgate/smg req/s ratios, and at 1 connection
# each proxy's added p50 latency over the worker alone.
#
# The worker is `kvgate worker --engine sim` with a near-zero timing model (1 µs per prefill
# token, 10 µs per decode step) so that the proxies, not the model, are what is measured. It
# verifies tickets when they come (kvgate's requests carry one, signed per request; nginx's and
# smg's carry none) and signs a receipt for every answer.
#
# Needs: cargo (builds target/debug/kvgate, as the README does; `PROFILE=proxy-lto`: the
# workspace's release profile with fat LTO and one codegen unit, into target/proxy-lto), nginx and wrk (Debian packages:
# `apt-get install -y nginx wrk`; installed when missing and running as root), python3 with venv
# (installs sglang-router into .cache/smg-venv), the default model file (its prompt profile).
set -euo pipefail
cd "$(dirname "$0")/.."

ROUNDS=${1:-2}
SECS=${2:-5}
OUT=${OUT:-bench-proxy-out}
SMG_VERSION=0.3.2
BASE_PORT=${BASE_PORT:-19300}
MODEL_DIR=${KVGATE_MODEL_DIR:-$PWD/models}
MODEL="$MODEL_DIR/SmolLM2-135M-Instruct.Q4_1.gguf"
GW_THREADS=${GW_THREADS:-2}
PROFILE=${PROFILE:-dev}
BIN_DIR=$PWD/target/$([ "$PROFILE" = dev ] && echo debug || echo "$PROFILE")
[ -f "$MODEL" ] || ./scripts/fetch-model.sh >/dev/null
for tool in nginx wrk; do
  if ! command -v "$tool" >/dev/null; then
    if [ "$(id -u)" = 0 ]; then
      apt-get install -y -qq nginx wrk >/dev/null
    else
      echo "bench-proxy: needs $tool (apt-get install -y nginx wrk)" >&2
      exit 1
    fi
  fi
done
NAME=bench-proxy
# shellcheck source=scripts/bench-common.sh
. scripts/bench-common.sh
smg_venv
cargo build --quiet --profile "$PROFILE" --workspace --bin kvgate --example pingora_floor
KVGATE=$BIN_DIR/kvgate
FLOOR=$BIN_DIR/examples/pingora_floor
mkdir -p "$OUT"
work=$(mktemp -d)
stop_all() {
  [ -f "$work/nginx.pid" ] && kill -QUIT "$(cat "$work/nginx.pid")" 2>/dev/null || true
  stop_pids
}
trap 'stop_all; rm -rf "$work"' EXIT

W_PORT=$((BASE_PORT + 1))
GW_PORT=$((BASE_PORT + 10))
NGX_PORT=$((BASE_PORT + 20))
SMG_PORT=$((BASE_PORT + 30))
FLOOR_PORT=$((BASE_PORT + 40))
W="127.0.0.1:$W_PORT"

sim_worker_rr
"$KVGATE" gateway --rules "$work/rules.toml" --listen "127.0.0.1:$GW_PORT" --drain-timeout-secs 0 \
  --admin "127.0.0.1:$((GW_PORT + 1))" --key "$work/keys/gateway.key" --no-watch \
  --threads "$GW_THREADS" --decision-log "$work/decisions.jsonl" >"$work/gw.log" 2>&1 &
pids+=($!)

# nginx: one worker process per core, keepalive to the upstream, no buffering (SSE-safe).
cat >"$work/nginx.conf" <<EOF
daemon off;
worker_processes 2;
pid $work/nginx.pid;
error_log $work/nginx-error.log;
events { worker_connections 1024; }
http {
  access_log off;
  client_body_temp_path $work;
  proxy_temp_path $work;
  upstream w { server $W; keepalive 64; }
  server {
    listen 127.0.0.1:$NGX_PORT;
    location / {
      proxy_pass http://w;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_buffering off;
    }
  }
}
EOF
nginx -c "$work/nginx.conf" -p "$work" >/dev/null 2>&1 &
pids+=($!)

"$VENV/bin/smg" launch --host 127.0.0.1 --port "$SMG_PORT" --policy round_robin \
  --worker-urls "http://$W" --prometheus-port $((SMG_PORT + 2)) >"$work/smg.log" 2>&1 &
pids+=($!)

# pingora alone (same ServerConf and allocator, no kvgate hooks): the floor of kvgate's path.
"$FLOOR" "127.0.0.1:$FLOOR_PORT" "$W" "$GW_THREADS" >"$work/floor.log" 2>&1 &
pids+=($!)

wait_http "http://127.0.0.1:$NGX_PORT/ready" nginx
wait_http "http://127.0.0.1:$FLOOR_PORT/ready" "pingora floor"
wait_http "http://127.0.0.1:$SMG_PORT/health" smg
for _ in $(seq 1 300); do
  curl -fsS "http://127.0.0.1:$((GW_PORT + 1))/admin/workers" 2>/dev/null |
    grep -q '"healthy":true' && break
  sleep 0.1
done

cat >"$work/chat1.lua" <<'EOF'
wrk.method = "POST"
wrk.body = '{"model":"smollm2","messages":[{"role":"user","content":"hi"}],"max_tokens":1}'
wrk.headers["Content-Type"] = "application/json"
EOF
cat >"$work/stream16.lua" <<'EOF'
wrk.method = "POST"
wrk.body = '{"model":"smollm2","messages":[{"role":"user","content":"hi"}],"max_tokens":16,"stream":true}'
wrk.headers["Content-Type"] = "application/json"
EOF

# Every target must answer each request the same way before anything is timed.
check() { # name base
  local get chat stream
  get=$(curl -s -o /dev/null -w '%{http_code}' "$2/get_model_info")
  chat=$(curl -s -o /dev/null -w '%{http_code}' -H 'content-type: application/json' \
    -d '{"model":"smollm2","messages":[{"role":"user","content":"hi"}],"max_tokens":1}' \
    "$2/v1/chat/completions")
  stream=$(curl -sN -H 'content-type: application/json' \
    -d '{"model":"smollm2","messages":[{"role":"user","content":"hi"}],"max_tokens":16,"stream":true}' \
    "$2/v1/chat/completions" | grep -c '^data: {' || true)
  if [ "$get" != 404 ] || [ "$chat" != 200 ] || [ "$stream" -lt 16 ]; then
    echo "bench-proxy: $1 answers GET $get, chat $chat, $stream stream chunks" >&2
    exit 1
  fi
}
targets=("worker=http://$W" "kvgate=http://127.0.0.1:$GW_PORT"
  "nginx=http://127.0.0.1:$NGX_PORT" "smg=http://127.0.0.1:$SMG_PORT"
  "pingora=http://127.0.0.1:$FLOOR_PORT")
for t in "${targets[@]}"; do check "${t%%=*}" "${t#*=}"; done

# wrk's --latency output → "req/s p50_ms p99_ms"
parse() {
  python3 -c '
import re, sys
t = sys.stdin.read()
def ms(v):
    n, u = re.match(r"([\d.]+)(us|ms|s)", v).groups()
    return float(n) * {"us": 1e-3, "ms": 1.0, "s": 1e3}[u]
rps = float(re.search(r"Requests/sec:\s+([\d.]+)", t).group(1))
p50 = ms(re.search(r"^\s+50%\s+(\S+)", t, re.M).group(1))
p99 = ms(re.search(r"^\s+99%\s+(\S+)", t, re.M).group(1))
errs = re.search(r"Non-2xx or 3xx responses: (\d+)", t)
print(f"{rps:.0f} {p50:.3f} {p99:.3f} {errs.group(1) if errs else 0}")'
}

results="$OUT/results.tsv"
echo -e "request\tconns\ttarget\tround\treq_s\tp50_ms\tp99_ms\tnon2xx" >"$results"
printf '%-10s %5s %-7s %5s %9s %9s %9s\n' request conns target round req/s p50_ms p99_ms
for round in $(seq 1 "$ROUNDS"); do
  for req in get chat1 stream16; do
    for conns in 1 32; do
      threads=$((conns < 2 ? 1 : 2))
      for t in "${targets[@]}"; do
        name=${t%%=*} base=${t#*=}
        case $req in
          get) args=("$base/get_model_info") ;;
          chat1) args=(-s "$work/chat1.lua" "$base/v1/chat/completions") ;;
          stream16) args=(-s "$work/stream16.lua" "$base/v1/chat/completions") ;;
        esac
        line=$(wrk -t"$threads" -c"$conns" -d"${SECS}s" --latency "${args[@]}" | parse)
        read -r rps p50 p99 non2xx <<<"$line"
        # The forwarded GET is a 404 on purpose; anything else must be 2xx.
        [ "$req" = get ] && non2xx=0
        printf '%-10s %5s %-7s %5s %9s %9s %9s\n' "$req" "$conns" "$name" "$round" "$rps" "$p50" "$p99"
        echo -e "$req\t$conns\t$name\t$round\t$rps\t$p50\t$p99\t$non2xx" >>"$results"
      done
    done
  done
done

# kvgate's own accounting stayed whole: one receipt per answered request, every one verified.
"$KVGATE" receipts verify "$work/w1/receipts.jsonl" --key "$work/w1/w1.pub" >"$work/verify.log" 2>&1 || {
  echo "bench-proxy: receipts verify failed:" >&2
  tail -5 "$work/verify.log" >&2
  exit 1
}
echo "receipts: $(tail -1 "$work/verify.log")"

python3 - "$results" <<'PY'
import csv, statistics, sys
rows = list(csv.DictReader(open(sys.argv[1]), delimiter="\t"))
bad = [r for r in rows if int(r["non2xx"]) > 0]
if bad:
    print("non-2xx answers:", [(r["request"], r["conns"], r["target"], r["non2xx"]) for r in bad])
med = {}
for r in rows:
    k = (r["request"], r["conns"], r["target"])
    med.setdefault(k, []).append(r)
def m(k, f):
    return statistics.median(float(r[f]) for r in med[k])
print()
print("median over rounds")
print(f"{'request':10} {'conns':>5} {'worker':>8} {'pingora':>8} {'kvgate':>8} {'nginx':>8} {'smg':>8} "
      f"{'kv/nginx':>8} {'kv/smg':>7} {'kv/pingora':>10}  p50 added (kvgate / nginx / smg / pingora, µs)  p99 ms (kv / nginx / smg)")
for req in ("get", "chat1", "stream16"):
    for conns in ("1", "32"):
        rps = {t: m((req, conns, t), "req_s") for t in ("worker", "pingora", "kvgate", "nginx", "smg")}
        p50 = {t: m((req, conns, t), "p50_ms") for t in rps}
        p99 = {t: m((req, conns, t), "p99_ms") for t in rps}
        added = " / ".join(f"{(p50[t] - p50['worker']) * 1000:.0f}" for t in ("kvgate", "nginx", "smg", "pingora"))
        tail = " / ".join(f"{p99[t]:.2f}" for t in ("kvgate", "nginx", "smg"))
        print(f"{req:10} {conns:>5} {rps['worker']:8.0f} {rps['pingora']:8.0f} {rps['kvgate']:8.0f} "
              f"{rps['nginx']:8.0f} {rps['smg']:8.0f} {rps['kvgate'] / rps['nginx']:8.2f} "
              f"{rps['kvgate'] / rps['smg']:7.2f} {rps['kvgate'] / rps['pingora']:10.2f}"
              f"  {added:>46}  {tail}")
PY
