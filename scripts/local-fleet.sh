# Sourced by scripts/demo.sh and scripts/bench-real.sh: start two SmolLM2 workers (w1 on 8101,
# w2 on 8102, one compute thread each: two workers share the machine's 2 cores) and a gateway
# (8080, admin 9000) from examples/rules.toml; stop everything on exit, Ctrl-C or failure.
# Expects: $root, $bin, $model, $out, $name (for messages).

pids=()
fleet_stop() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
  pids=()
}
fleet_cleanup() {
  local code=$?
  fleet_stop
  if [ $code -ne 0 ]; then
    echo "$name: FAILED (exit $code); process logs are in $out/*.log" >&2
  fi
  exit $code
}
trap fleet_cleanup EXIT
trap 'exit 130' INT TERM

wait_ready() { # url what
  for _ in $(seq 1 240); do
    if curl -fsS "$1" >/dev/null 2>&1; then return 0; fi
    sleep 0.5
  done
  echo "$name: $2 did not become ready; see its log in $out" >&2
  return 1
}

fleet_start() {
  for port in 8101 8102 8080 9000; do
    if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
      echo "$name: port $port is already in use; stop what listens there first" >&2
      exit 1
    fi
  done
  mkdir -p "$out/keys" "$out/gateway-keys"
  "$bin" keygen --out "$out/gateway-keys" --name gateway >/dev/null
  local w port
  for w in w1 w2; do
    port=$([ "$w" = w1 ] && echo 8101 || echo 8102)
    "$bin" worker --model "$model" --listen "127.0.0.1:$port" --id "$w" --threads 1 \
      --state-dir "$out/$w" --gateway-keys "$out/gateway-keys" --require-ticket \
      >"$out/$w.log" 2>&1 &
    pids+=($!)
  done
  wait_ready http://127.0.0.1:8101/ready "worker w1"
  wait_ready http://127.0.0.1:8102/ready "worker w2"
  echo "$name: workers w1, w2 ready (smoke inference done)"
  "$bin" gateway --rules "$root/examples/rules.toml" --listen 127.0.0.1:8080 --admin 127.0.0.1:9000 \
    --key "$out/gateway-keys/gateway.key" --decision-log "$out/decisions.jsonl" --no-watch \
    >"$out/gateway.log" 2>&1 &
  pids+=($!)
  wait_ready http://127.0.0.1:9000/metrics "gateway"
  echo "$name: gateway on 127.0.0.1:8080 (admin 127.0.0.1:9000)"
}
