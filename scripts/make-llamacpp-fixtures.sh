#!/usr/bin/env bash
# Writes tests/fixtures/llamacpp/smollm2-q4_1.json: llama.cpp's greedy continuations and top-5
# log-probabilities for a few prompts of the default model (scripts/llamacpp-reference.py), the
# independent reference tests/engine_vs_llamacpp.rs compares the engine with. Outside CI (builds
# llama.cpp once, ~15-35 min on 2 cores; scripts/build-llamacpp.sh). The JSON is committed.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
./scripts/setup.sh >/dev/null
bin="$(./scripts/build-llamacpp.sh)"
cargo build --quiet --bin kvgate
k="$root/target/debug/kvgate"
model="${KVGATE_MODEL_DIR:-$root/models}/SmolLM2-135M-Instruct.Q4_1.gguf"
py="$root/.venv/bin/python3"
port="${PORT:-8399}"
"$bin/llama-server" -m "$model" --host 127.0.0.1 --port "$port" -t 2 -c 4096 --no-webui \
  >/tmp/make-llamacpp-fixtures.log 2>&1 &
pid=$!
trap 'kill $pid 2>/dev/null || true' EXIT
for _ in $(seq 1 120); do curl -fs "127.0.0.1:$port/health" >/dev/null && break; sleep 0.5; done
ids() { # name, messages json
  "$k" tokenize --model "$model" --messages <(echo "$2") --json \
    | "$py" -c "import json,sys; print(json.dumps({'name': '$1', 'ids': json.load(sys.stdin)['ids']}))"
}
{
  ids capital '[{"role":"system","content":"You are a helpful AI assistant named SmolLM, trained by Hugging Face"},{"role":"user","content":"What is the capital of France?"}]'
  ids count '[{"role":"user","content":"Count from one to ten in words, separated by commas."}]'
  ids code '[{"role":"user","content":"Write a Python function that returns the square of a number."}]'
  ids kv '[{"role":"system","content":"You are terse."},{"role":"user","content":"Explain what a KV cache is in one sentence."}]'
} | "$py" scripts/llamacpp-reference.py --server "http://127.0.0.1:$port" --model "$model" \
      --out tests/fixtures/llamacpp/smollm2-q4_1.json --command "./scripts/make-llamacpp-fixtures.sh"
echo "wrote tests/fixtures/llamacpp/smollm2-q4_1.json"
