# Shared by the side-by-side benchmark scripts (bench-vs-smg.sh, bench-proxy.sh); sourced, not run.
# Expects NAME (the script's name for messages) and SMG_VERSION to be set.

# The SGLang model gateway in .cache/smg-venv (installed from PyPI once); sets VENV.
smg_venv() {
  VENV=.cache/smg-venv
  if [ ! -x "$VENV/bin/smg" ]; then
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install --quiet --disable-pip-version-check "sglang-router==$SMG_VERSION"
  fi
}

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
