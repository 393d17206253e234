# Shared by the side-by-side benchmark scripts (bench-vs-smg.sh, bench-proxy.sh,
# bench-sidecar-load.sh, bench-engine-load.sh); sourced, not run.
# Expects NAME (the script's name for messages); smg_venv also SMG_VERSION.

# The default model (SmolLM2-135M-Instruct Q4_1 under $KVGATE_MODEL_DIR, else models/),
# fetched (SHA-256 pinned) when missing; sets MODEL.
bench_model() {
  MODEL="${KVGATE_MODEL_DIR:-$PWD/models}/SmolLM2-135M-Instruct.Q4_1.gguf"
  [ -f "$MODEL" ] || ./scripts/fetch-model.sh >/dev/null
}

# The SGLang model gateway in .cache/smg-venv (installed from PyPI once); sets VENV.
smg_venv() {
  VENV=.cache/smg-venv
  if [ ! -x "$VENV/bin/smg" ]; then
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install --quiet --disable-pip-version-check "sglang-router==$SMG_VERSION"
  fi
}

# The kvgate binary: $KVGATE_BIN (another build, e.g. a baseline), else target/debug/kvgate,
# built now; sets KVGATE.
kvgate_bin() {
  if [ -n "${KVGATE_BIN:-}" ]; then
    KVGATE=$KVGATE_BIN
  else
    cargo build --quiet --bin kvgate
    KVGATE=$PWD/target/debug/kvgate
  fi
}

# The simulated workers' timing model and limits (`kvgate worker --engine sim`): prefill 125 µs
# per uncached token, a decode step 8 ms + 0.5 ms per sequence — the fleet bench's.
SIM_TIMING=(--sim-num-blocks 4096 --sim-prefill-us-per-token 125 --sim-decode-us-base 8000
  --sim-decode-us-per-seq 500 --max-running 64)

# Background processes the script started: `pids+=($!)` after each, `stop_pids` stops them all.
pids=()
stop_pids() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
  pids=()
}

wait_http() { # url, what: wait up to 30 s for a 2xx answer
  for _ in $(seq 1 300); do
    if curl -fsS -o /dev/null "$1" 2>/dev/null; then return 0; fi
    sleep 0.1
  done
  echo "$NAME: $2 did not come up ($1)" >&2
  return 1
}

# One simulated worker w1 at $W with a near-zero timing model (1 µs per prefill token, 10 µs per
# decode step; it verifies the tickets that come and signs a receipt per answer), a gateway key
# in $work/keys, and $work/rules.toml: one round-robin service over it for every path. Expects
# KVGATE, MODEL, W and work.
sim_worker_rr() {
  "$KVGATE" keygen --out "$work/keys" --name gateway >/dev/null
  "$KVGATE" worker --engine sim --model "$MODEL" --id w1 --listen "$W" --state-dir "$work/w1" --drain-timeout-secs 0 \
    --gateway-keys "$work/keys" --sim-prefill-us-per-token 1 --sim-decode-us-base 10 \
    --sim-decode-us-per-seq 1 --max-running 64 >"$work/w1.log" 2>&1 &
  pids+=($!)
  wait_http "http://$W/ready" "the worker"
  cat >"$work/rules.toml" <<EOF
[[workers]]
id = "w1"
url = "http://$W"

[[pools]]
id = "all"
workers = ["w1"]

[[services]]
name = "rr"
pool = "all"
match = { path_prefix = "/" }
rule = { type = "round_robin" }
EOF
}

# CPU time (µs) used so far by process $1 and its live descendants: the sum of their threads'
# on-CPU time from /proc/<pid>/task/<tid>/schedstat (nanoseconds; the 10 ms ticks of
# /proc/<pid>/stat are too coarse for a run of a few hundred requests).
tree_cpu_us() {
  local p kids
  kids=$(pgrep -P "$1" 2>/dev/null || true)
  for p in $1 $kids $(for c in $kids; do pgrep -P "$c" 2>/dev/null || true; done); do
    cat /proc/"$p"/task/*/schedstat 2>/dev/null
  done | awk '{ ns += $1 } END { printf "%d\n", ns / 1000 }'
}
