#!/usr/bin/env bash
# The native-engine fleet, for real (issue #20; outside CI: the llama.cpp build takes ~20 min on
# 2 cores the first time, then it is cached): two llama.cpp `llama-server` engines (SmolLM2 Q4_1,
# --parallel 2, --cache-ram 0, --jinja, one thread each), each behind `kvgate sidecar`
# (tickets required, receipts signed), and the gateway with a round-robin and a KV-exact service
# over `kind = "llama_cpp"` upstreams. Then:
#   1. the contract check: the gateway admits the KV-exact rule only after /props and /tokenize
#      of both engines agree with the pinned profile (a wrong pin is refused: 400);
#   2. scripts/llamacpp_fleet.py check — the official openai client, multi-turn, whole and streamed;
#   3. scripts/llamacpp_fleet.py direct — clients straight to one llama-server, around its
#      sidecar: the sidecar reads the engine's GET /slots (--engine-load, default for
#      llama_cpp), the gateway sees them in that worker's reported load, and a KV-exact
#      conversation's next turn goes to the other engine;
#      scripts/llamacpp_fleet.py kill — a sidecar SIGKILLed mid-stream; the survivor serves; the
#      killed sidecar is restarted on its port (same key, same receipt chain);
#   4. `kvgate bench --compare round_robin=smol-rr,kv_exact=smol` on a multi-turn workload: TTFT
#      p50/p95 and the engines' own cached-token counts (usage.prompt_tokens_details);
#   5. everything stopped, then `kvgate receipts verify` and `kvgate receipts audit` over the
#      gateway's decision log and both sidecars' receipt logs: clean.
# Outputs and logs under bench-out/llamacpp-fleet/. Extra arguments go to `kvgate bench`.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
name=check-llamacpp-fleet
./scripts/setup.sh >/dev/null
llama_bin="$(./scripts/build-llamacpp.sh)"
cargo build --quiet --bin kvgate
bin="$root/target/debug/kvgate"
model="${KVGATE_MODEL_DIR:-$root/models}/SmolLM2-135M-Instruct.Q4_1.gguf"
out="$root/bench-out/llamacpp-fleet"
py="$root/.venv/bin/python3"
rm -rf "$out"
mkdir -p "$out/gateway-keys" "$out/keys"

pids=()
declare -A sidecar_pid
stop_all() {
  for p in "${pids[@]}" "${sidecar_pid[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in "${pids[@]}" "${sidecar_pid[@]}"; do wait "$p" 2>/dev/null || true; done
  pids=()
  sidecar_pid=()
}
cleanup() {
  local code=$?
  stop_all
  [ $code -eq 0 ] || echo "$name: FAILED (exit $code); logs in $out" >&2
  exit $code
}
trap cleanup EXIT
wait_http() { # url what [tries of 0.5 s]
  for _ in $(seq 1 "${3:-240}"); do
    curl -fsS -o /dev/null "$1" 2>/dev/null && return 0
    sleep 0.5
  done
  echo "$name: $2 did not come up ($1)" >&2
  return 1
}
for port in 8301 8302 8311 8312 8380 8390; do
  if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
    echo "$name: port $port is in use" >&2
    exit 1
  fi
done

model_id="$("$bin" tokenize --model "$model" --text x --json | "$py" -c 'import json,sys; print(json.load(sys.stdin)["identity"]["model_id"])')"
identity="$("$bin" tokenize --model "$model" --text x --json)"
field() { echo "$identity" | "$py" -c "import json,sys; print(json.load(sys.stdin)['identity']['$1'])"; }

"$bin" keygen --out "$out/gateway-keys" --name gateway >/dev/null
for i in 1 2; do
  "$llama_bin/llama-server" -m "$model" --host 127.0.0.1 --port "830$i" --parallel 2 --cache-ram 0 \
    --jinja --alias "$model_id" -c 8192 -t 1 --no-webui >"$out/llama-server-$i.log" 2>&1 &
  pids+=($!)
done
start_sidecar() { # i
  "$bin" sidecar --engine "http://127.0.0.1:830$1" --listen "127.0.0.1:831$1" --id "s$1" \
    --model "$model" --state-dir "$out/s$1" --gateway-keys "$out/gateway-keys" --require-ticket \
    >>"$out/sidecar-$1.log" 2>&1 &
  sidecar_pid[s$1]=$!
}
for i in 1 2; do
  wait_http "http://127.0.0.1:830$i/health" "llama-server $i"
  start_sidecar "$i"
done
for i in 1 2; do
  wait_http "http://127.0.0.1:831$i/ready" "sidecar s$i"
  cp "$out/s$i/s$i.pub" "$out/keys/"
done
cp "$out/gateway-keys/gateway.pub" "$out/keys/"

rules() { # template_sha256
  cat <<TOML
[gateway]
health_interval_ms = 200

[[workers]]
id = "s1"
url = "http://127.0.0.1:8311"
kind = "llama_cpp"
prompt_cache = { max_prefixes = 2 }

[[workers]]
id = "s2"
url = "http://127.0.0.1:8312"
kind = "llama_cpp"
prompt_cache = { max_prefixes = 2 }

[[pools]]
id = "engines"
workers = ["s1", "s2"]

[[profiles]]
id = "smollm2"
model_id = "$model_id"
revision = "$(field revision)"
source = { gguf = "$model" }
template_sha256 = "$1"
tokenizer_sha256 = "$(field tokenizer_sha256)"
block_size = 16
context_limit = 4096

[[services]]
name = "chat-rr"
pool = "engines"
rule = { type = "round_robin" }
[services.match]
models = ["smol-rr"]

[[services]]
name = "chat-exact"
pool = "engines"
rule = { type = "kv_exact", profile = "smollm2" }
[services.match]
models = ["smol"]
TOML
}
rules "$(field template_sha256)" >"$out/rules.toml"
"$bin" gateway --rules "$out/rules.toml" --listen 127.0.0.1:8380 --admin 127.0.0.1:8390 \
  --key "$out/gateway-keys/gateway.key" --decision-log "$out/decisions.jsonl" \
  >"$out/gateway.log" 2>&1 &
pids+=($!)
wait_http http://127.0.0.1:8390/metrics gateway
for _ in $(seq 1 100); do
  ok="$(curl -fsS http://127.0.0.1:8390/admin/workers | "$py" -c 'import json,sys; w=json.load(sys.stdin)["workers"]; print(sum(1 for x in w if x["healthy"] and x["contract"]["state"] == "ok"))')"
  [ "$ok" = 2 ] && break
  sleep 0.2
done
curl -fsS http://127.0.0.1:8390/admin/workers >"$out/workers.json"
echo "$name: gateway up; workers: $(cat "$out/workers.json" | head -c 600)"

# 1. A wrong template pin is refused (400) and the rules in force stay.
rules "$(printf 'f%.0s' $(seq 1 64))" >"$out/rules.toml.bad"
cp "$out/rules.toml" "$out/rules.toml.good"
cp "$out/rules.toml.bad" "$out/rules.toml"
code="$(curl -s -o "$out/refused.json" -w '%{http_code}' -X POST http://127.0.0.1:8390/admin/reload)"
cp "$out/rules.toml.good" "$out/rules.toml"
grep -q template_sha256 "$out/refused.json" && [ "$code" = 400 ] \
  || { echo "$name: a wrong template pin was not refused with 400: $code $(cat "$out/refused.json")" >&2; exit 1; }
echo "$name: wrong template pin refused: $(head -c 300 "$out/refused.json")"

# 2 and 3.
export KVGATE_BASE_URL=http://127.0.0.1:8380
"$py" scripts/llamacpp_fleet.py check
KVGATE_ADMIN_URL=http://127.0.0.1:8390 \
  KVGATE_ENGINE_URLS='{"s1": "http://127.0.0.1:8301", "s2": "http://127.0.0.1:8302"}' \
  "$py" scripts/llamacpp_fleet.py direct
KVGATE_SIDECAR_PIDS="{\"s1\": ${sidecar_pid[s1]}, \"s2\": ${sidecar_pid[s2]}}" \
  "$py" scripts/llamacpp_fleet.py kill
for i in 1 2; do
  if ! kill -0 "${sidecar_pid[s$i]}" 2>/dev/null; then
    wait "${sidecar_pid[s$i]}" 2>/dev/null || true
    echo "$name: restarting sidecar s$i"
    start_sidecar "$i"
    wait_http "http://127.0.0.1:831$i/ready" "sidecar s$i (restarted)"
  fi
done
sleep 1

# 4.
bench_args=("$@")
[ ${#bench_args[@]} -gt 0 ] || bench_args=(--conversations 6 --turns 3 --long-words 400)
"$bin" bench --target http://127.0.0.1:8380 --compare round_robin=smol-rr,kv_exact=smol --pool s1,s2 \
  --workload multi-turn --max-tokens 16 --concurrency 2 --max-seconds 900 --out "$out/bench" \
  "${bench_args[@]}" | tee "$out/bench.txt" || true

# 5.
stop_all
"$bin" receipts verify --keys "$out/keys" --require-ticket-keys "$out"/s1/receipts*.jsonl "$out"/s2/receipts*.jsonl \
  | tee "$out/verify.txt"
"$bin" receipts audit --decisions "$out/decisions.jsonl" --receipts "$out"/s1/receipts*.jsonl "$out"/s2/receipts*.jsonl \
  --keys "$out/keys" | tee "$out/audit.txt"
echo "$name: PASS"
