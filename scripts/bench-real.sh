#!/usr/bin/env bash
# Real-engine comparison: two SmolLM2 workers and a gateway on this machine (as in the demo), then
# `kvgate bench` runs the same workload through the round-robin service and the kv_exact service
# of examples/rules.toml and judges them side by side. Outputs under bench-out/real/.
# Arguments replace the default workload flags (e.g. --conversations 6 --turns 3 --long-words 900).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
./scripts/setup.sh
cargo build --bin kvgate
bin="$root/target/debug/kvgate"
model="${KVGATE_MODEL_DIR:-$root/models}/SmolLM2-135M-Instruct.Q4_1.gguf"
out="$root/bench-out/real"
name=bench-real
rm -rf "$out"
mkdir -p "$out"
# shellcheck source=scripts/local-fleet.sh
. "$root/scripts/local-fleet.sh"
fleet_start
workload=("$@")
[ ${#workload[@]} -gt 0 ] || workload=(--conversations 6 --turns 3 --long-words 900)
"$bin" bench --target http://127.0.0.1:8080 --compare round_robin=smollm2-rr,kv_exact=smollm2 --pool w1,w2 \
  --workload multi-turn --max-tokens 16 --concurrency 2 --max-seconds 900 --out "$out" \
  "${workload[@]}" && code=0 || code=$?
fleet_stop
[ $code -eq 0 ] || echo "$name: not every verdict is PASS (exit $code); see above" >&2
trap - EXIT
exit $code
