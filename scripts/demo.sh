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
name=demo
rm -rf "$out"
mkdir -p "$out"
# shellcheck source=scripts/local-fleet.sh
. "$root/scripts/local-fleet.sh"
fleet_start

"${KVGATE_PYTHON:-$root/.venv/bin/python3}" examples/demo_client.py http://127.0.0.1:8080 smollm2-rr smollm2

echo
echo "=== gateway workers (GET /admin/workers) ==="
"${KVGATE_PYTHON:-$root/.venv/bin/python3}" examples/demo_client.py --admin http://127.0.0.1:9000

# Stop the workers so their receipt logs are complete, then verify and audit.
fleet_stop

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
