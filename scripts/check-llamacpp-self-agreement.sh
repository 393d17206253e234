#!/usr/bin/env bash
# The noise floor of the engine's agreement with llama.cpp (engine/tests/vs_llamacpp.rs): runs
# llama-server on each real model's committed fixture with one setting changed (default
# `-fa off`: attention without flash attention, as the fixtures were made with it on) and prints,
# per model, the statistics the Rust test prints for the engine (`scripts/llamacpp-reference.py
# --against`).
# Outside CI: needs the llama.cpp build (scripts/build-llamacpp.sh).
#   ./scripts/check-llamacpp-self-agreement.sh            # -fa off
#   ARGS="-t 1" ./scripts/check-llamacpp-self-agreement.sh
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
bin="$(./scripts/build-llamacpp.sh)"
py="$root/.venv/bin/python3"
port="${PORT:-8398}"
models="${KVGATE_MODEL_DIR:-$root/models}"
read -r -a extra <<<"${ARGS:--fa off}"
for pair in "SmolLM2-135M-Instruct.Q4_1.gguf smollm2-q4_1.json" "gemma-3-270m-q4_k_m.gguf gemma3-270m-q4_k_m.json"; do
  read -r model fixture <<<"$pair"
  "$bin/llama-server" -m "$models/$model" --host 127.0.0.1 --port "$port" -t 2 -c 4096 --no-webui \
    "${extra[@]}" >/tmp/llamacpp-self-agreement.log 2>&1 &
  pid=$!
  for _ in $(seq 1 120); do curl -fs "127.0.0.1:$port/health" >/dev/null && break; sleep 0.5; done
  "$py" scripts/llamacpp-reference.py --server "http://127.0.0.1:$port" \
    --against "tests/fixtures/llamacpp/$fixture" || { kill $pid; exit 1; }
  kill $pid 2>/dev/null || true
  wait $pid 2>/dev/null || true
done
