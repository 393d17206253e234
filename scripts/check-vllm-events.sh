#!/usr/bin/env bash
# kvgate's reading of vLLM's KV events, checked against vLLM's own publisher classes (outside
# CI: it downloads the 239 MB vLLM wheel once). Usage:
#
#   ./scripts/check-vllm-events.sh [--fixture worker/tests/fixtures/vllm_kv_events.json]
#
# Sets up .cache/vllm-events/: a virtualenv with msgspec, pyzmq and xxhash (pinned), and
# `vllm/distributed/kv_events.py` from `vllm==0.34.0` (the wheel's SHA-256 pinned; no torch
# needed: that module imports msgspec and zmq only). Builds `kvgate` (debug) and runs
# scripts/check-vllm-events.py (what it checks is in its docstring). --fixture rewrites the
# committed fixture the Rust tests decode in CI.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cache="$root/.cache/vllm-events"
WHEEL="vllm-0.34.0-cp38-abi3-manylinux_2_28_x86_64.whl"
WHEEL_SHA="79ca4b3cd74aec08c4bf476bdf0cb15735b605ae5368526a2faae1e30f044ca2"
mkdir -p "$cache"
if [ ! -x "$cache/venv/bin/python" ]; then
  python3 -m venv "$cache/venv"
  "$cache/venv/bin/pip" install --quiet --disable-pip-version-check \
    msgspec==0.23.0 pyzmq==27.3.0 xxhash==4.1.0
fi
if [ ! -f "$cache/kv_events.py" ]; then
  if [ ! -f "$cache/$WHEEL" ] || [ "$(sha256sum "$cache/$WHEEL" | cut -d' ' -f1)" != "$WHEEL_SHA" ]; then
    echo "check-vllm-events: downloading $WHEEL (239 MB) from PyPI ..." >&2
    "$cache/venv/bin/pip" download --quiet --no-deps --disable-pip-version-check \
      -d "$cache" "vllm==0.34.0"
  fi
  got="$(sha256sum "$cache/$WHEEL" | cut -d' ' -f1)"
  if [ "$got" != "$WHEEL_SHA" ]; then
    echo "check-vllm-events: refusing $WHEEL: SHA-256 $got is not the pinned $WHEEL_SHA" >&2
    exit 1
  fi
  "$cache/venv/bin/python" - "$cache/$WHEEL" "$cache/kv_events.py" <<'PY'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z, open(sys.argv[2], "wb") as out:
    out.write(z.read("vllm/distributed/kv_events.py"))
PY
fi
(cd "$root" && cargo build --quiet --bin kvgate)
exec "$cache/venv/bin/python" "$root/scripts/check-vllm-events.py" \
  --kvgate "$root/target/debug/kvgate" --kv-events-py "$cache/kv_events.py" "$@"
