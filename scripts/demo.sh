#!/usr/bin/env bash
# The demo (the README's first command): on a fresh machine it installs what it needs, fetches the
# pinned model, builds kvgate, starts two SmolLM2 workers and a gateway on localhost with the
# example rules (examples/rules.toml: service `chat-rr` = round_robin, `chat-exact` = kv_exact),
# sends a short multi-turn conversation through each service with the official openai client, prints
# the answers, each request's routing decision and cached tokens, verifies both workers' receipt
# logs and runs `kvgate receipts audit`. It stops everything it started, also on Ctrl-C or failure.
#
# Ports: workers 8101, 8102 (as in examples/rules.toml), gateway 8080, admin 9000.
# Output folder: demo-out/ (keys, receipt logs, decision log, process logs).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"

./scripts/setup.sh
echo "demo: building kvgate (first build takes ~10 minutes on 2 cores) ..."
cargo build --bin kvgate
bin="$root/target/debug/kvgate"
model="${KVGATE_MODEL_DIR:-$root/models}/SmolLM2-135M-Instruct.Q4_1.gguf"

out="$root/demo-out"
rm -rf "$out"
mkdir -p "$out/keys" "$out/gateway-keys"

pids=()
cleanup() {
  local code=$?
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
  if [ $code -ne 0 ]; then
    echo "demo: FAILED (exit $code); process logs are in $out/*.log" >&2
  fi
  exit $code
}
trap cleanup EXIT
trap 'exit 130' INT TERM

for port in 8101 8102 8080 9000; do
  if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
    echo "demo: port $port is already in use; stop what listens there first" >&2
    exit 1
  fi
done

"$bin" keygen --out "$out/gateway-keys" --name gateway >/dev/null
for w in w1 w2; do
  port=$([ "$w" = w1 ] && echo 8101 || echo 8102)
  "$bin" worker --model "$model" --listen "127.0.0.1:$port" --id "$w" \
    --state-dir "$out/$w" --gateway-keys "$out/gateway-keys" --require-ticket \
    >"$out/$w.log" 2>&1 &
  pids+=($!)
done

wait_ready() { # url name
  for _ in $(seq 1 240); do
    if curl -fsS "$1" >/dev/null 2>&1; then return 0; fi
    sleep 0.5
  done
  echo "demo: $2 did not become ready; see its log" >&2
  return 1
}
wait_ready http://127.0.0.1:8101/ready "worker w1"
wait_ready http://127.0.0.1:8102/ready "worker w2"
echo "demo: workers w1, w2 ready (smoke inference done)"

"$bin" gateway --rules examples/rules.toml --listen 127.0.0.1:8080 --admin 127.0.0.1:9000 \
  --key "$out/gateway-keys/gateway.key" --decision-log "$out/decisions.jsonl" --no-watch \
  >"$out/gateway.log" 2>&1 &
pids+=($!)
wait_ready http://127.0.0.1:9000/metrics "gateway"
echo "demo: gateway on 127.0.0.1:8080 (admin 127.0.0.1:9000)"

python3 examples/demo_client.py http://127.0.0.1:8080 smollm2-rr smollm2

echo
echo "=== gateway workers (GET /admin/workers) ==="
python3 examples/demo_client.py --admin http://127.0.0.1:9000

# Stop the workers so their receipt logs are complete, then verify and audit.
for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
pids=()

cp "$out/gateway-keys/gateway.pub" "$out/keys/"
cp "$out/w1/w1.pub" "$out/w2/w2.pub" "$out/keys/"
echo
echo "=== kvgate receipts verify ==="
for w in w1 w2; do
  "$bin" receipts verify "$out/$w/receipts.jsonl" --key "$out/keys/$w.pub" --keys "$out/keys"
done
echo
echo "=== kvgate receipts audit ==="
"$bin" receipts audit --decisions "$out/decisions.jsonl" \
  --receipts "$out/w1/receipts.jsonl" "$out/w2/receipts.jsonl" --keys "$out/keys"
echo
echo "demo: done. Keys, logs, receipts and the decision log are in $out/"
