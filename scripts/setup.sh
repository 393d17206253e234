#!/usr/bin/env bash
# Install what building and testing kvgate needs on a fresh Debian machine with Rust and Python 3:
#   - cmake (pingora's zlib-ng build needs it)
#   - promtool (Debian's `prometheus` package, unpacked into .cache/tools/bin: the metrics tests
#     check both servers' exposition with `promtool check metrics`; no Prometheus server is
#     installed or started)
#   - the official `openai` Python client (used as a test client) and Python `cryptography`
#     (reads kvgate's key files in a test)
#   - the pinned default model (scripts/fetch-model.sh)
# Idempotent and quiet when everything is already there.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"

need_apt=()
command -v cmake >/dev/null 2>&1 || need_apt+=(cmake)

if [ ${#need_apt[@]} -gt 0 ]; then
  echo "setup: apt-get install ${need_apt[*]}"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need_apt[@]}" >/dev/null
fi

# promtool, taken out of Debian's prometheus package (no service is installed).
tools="$root/.cache/tools/bin"
if ! command -v promtool >/dev/null 2>&1 && [ ! -x "$tools/promtool" ]; then
  echo "setup: promtool from Debian's prometheus package -> $tools"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  tmp="$(mktemp -d)"
  if ! (cd "$tmp" && apt-get download prometheus >/dev/null 2>&1); then
    $SUDO apt-get update -qq
    (cd "$tmp" && apt-get download prometheus >/dev/null)
  fi
  dpkg-deb -x "$tmp"/prometheus_*.deb "$tmp/x"
  mkdir -p "$tools"
  cp "$tmp/x/usr/bin/promtool" "$tools/promtool"
  rm -rf "$tmp"
fi

OPENAI_VERSION="3.57.0"
if ! python3 -c "import openai, sys; sys.exit(0 if openai.__version__ == '$OPENAI_VERSION' else 1)" >/dev/null 2>&1; then
  echo "setup: pip install openai==$OPENAI_VERSION"
  python3 -m pip install --quiet --disable-pip-version-check "openai==$OPENAI_VERSION"
fi
# Python `cryptography`: the key-interoperability test loads kvgate's keys with it.
if ! python3 -c "import cryptography" >/dev/null 2>&1; then
  echo "setup: pip install cryptography==48.0.0"
  python3 -m pip install --quiet --disable-pip-version-check "cryptography==48.0.0"
fi

"$root/scripts/fetch-model.sh"
