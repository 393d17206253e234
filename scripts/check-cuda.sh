#!/usr/bin/env bash
# Prove that the `cuda` feature of the `engine` crate compiles on a machine with NO system CUDA
# toolkit and NO GPU (Debian + Rust + Python 3, x86_64), using NVIDIA's CUDA 13.0 wheels from PyPI.
#
# What it does (idempotent; a second run reuses everything):
#   1. creates (or reuses) a Python venv, default <repo>/../cuda-venv (override: CUDA_VENV), and
#      pip-installs pinned CUDA 13.0 wheels into it: nvcc + cicc/nvvm + crt headers, the runtime
#      headers/libs, CCCL, NVRTC, cuBLAS, cuRAND. They all land in one toolkit-shaped folder
#      <venv>/lib/pythonX.Y/site-packages/nvidia/cu13/{bin,include,lib,nvvm}.
#   2. makes that folder linkable like a real toolkit: unversioned symlinks (libcudart.so ->
#      libcudart.so.13, ...) and a link-time-only stub lib/stubs/libcuda.so (SONAME libcuda.so.1)
#      generated from the driver symbols cudarc declares. The wheels ship no libcuda (it belongs to
#      the driver); binaries linked here load the real libcuda.so.1 of the GPU machine at run time.
#      Only needed for targets that link (bins, tests); `cargo check` and `build --lib` do not.
#   3. exports the environment (CUDA_HOME/CUDA_PATH/CUDA_ROOT, PATH with nvcc, CUDA_COMPUTE_CAP,
#      CUDARC_CUDA_VERSION, LIBRARY_PATH) and runs cargo.
#
# Why CUDA 13.0 exactly: the GPU machine has driver 580 (CUDA 13.0). PTX from a newer nvcc (13.1+)
# uses a PTX ISA that driver 580 cannot JIT, and cudarc (dynamic-linking, as candle sets it) links
# libcublas.so.13 / libnvrtc.so.13 / libcurand.so.10, which that machine's CUDA 13 provides.
# Kernels are built for compute capability 90 (H100/H200); cudaforge turns it into sm_90a.
#
# Usage: scripts/check-cuda.sh [check|build|env]
#   check (default)  NVRTC-compile the device executor's kernels (scripts/nvrtc-compile.py) and
#                    ptxas them for sm_90, then cargo check -p engine --features cuda --all-targets
#   build            check, then cargo build -p engine --features cuda --lib
#                    (runs nvcc on every candle kernel: PTX + libmoe.a under the target dir)
#   env              only set up the venv and print `export ...` lines: eval "$(scripts/check-cuda.sh env)"
# Environment overrides:
#   CUDA_VENV         venv folder (default <repo>/../cuda-venv)
#   CARGO_TARGET_DIR  cargo target dir (default <repo>/target/cuda: inside the git-ignored /target,
#                     and apart from the shared CPU build so the two never rebuild each other)
#   CUDA_COMPUTE_CAP  default 90
#   CUDAFORGE_THREADS parallel nvcc jobs in candle-kernels' build script (default 2)
#   PYTHON            interpreter that creates the venv (default python3)
# Nothing here needs a GPU or network access other than PyPI (and crates.io for cargo).
set -euo pipefail

root="$(cd "$(dirname "$0")/.." && pwd)"
mode="${1:-check}"
case "$mode" in check | build | env) ;; *)
  echo "usage: $0 [check|build|env]" >&2
  exit 2
  ;;
esac

# Pinned CUDA 13.0 (update 2) wheels. Keep the versions together: nvcc/crt/nvvm must match.
WHEELS=(
  "nvidia-cuda-nvcc==13.0.88"
  "nvidia-cuda-crt==13.0.88"
  "nvidia-nvvm==13.0.88"
  "nvidia-cuda-runtime==13.0.96"
  "nvidia-cuda-cccl==13.0.85"
  "nvidia-cuda-nvrtc==13.0.88"
  "nvidia-cublas==13.1.0.3"
  "nvidia-curand==10.4.0.35"
)

log() { echo "check-cuda: $*" >&2; }

venv="${CUDA_VENV:-$(dirname "$root")/cuda-venv}"
py="${PYTHON:-python3}"
if [ ! -x "$venv/bin/python" ]; then
  log "creating venv $venv"
  "$py" -m venv "$venv"
fi
vpy="$venv/bin/python"

# Install only when a pin is missing or differs (pip freeze is offline and fast).
frozen="$("$vpy" -m pip freeze --disable-pip-version-check 2>/dev/null || true)"
missing=()
for w in "${WHEELS[@]}"; do
  grep -qixF "$w" <<<"$frozen" || missing+=("$w")
done
if [ ${#missing[@]} -gt 0 ]; then
  log "pip install ${missing[*]}"
  "$vpy" -m pip install --quiet --disable-pip-version-check "${WHEELS[@]}" >&2
fi

site="$("$vpy" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
cuda="$site/nvidia/cu13"
for f in bin/nvcc nvvm/bin/cicc include/cuda_runtime.h include/cuda_fp16.h lib/libcudart.so.13; do
  [ -e "$cuda/$f" ] || {
    log "missing $cuda/$f after installing the wheels"
    exit 1
  }
done

# Unversioned names for the linker (-lcudart -lcublas ...), as a toolkit's lib64 has them.
for so in libcudart.so.13 libcublas.so.13 libcublasLt.so.13 libcurand.so.10 libnvrtc.so.13; do
  [ -e "$cuda/lib/${so%.so.*}.so" ] || ln -sf "$so" "$cuda/lib/${so%.so.*}.so"
done

# Link-time stub for the driver library (-lcuda), like a toolkit's lib64/stubs/libcuda.so: every
# cu* function cudarc's driver bindings declare, as an empty symbol. Never loaded at run time
# (SONAME libcuda.so.1 makes the loader pick the driver's real library).
stub="$cuda/lib/stubs/libcuda.so"
if [ ! -e "$stub" ]; then
  cudarc_src="$(
    ls -d "${CARGO_HOME:-$HOME/.cargo}"/registry/src/*/cudarc-0.19.* 2>/dev/null | sort -V | tail -1 || true
  )"
  if [ -z "$cudarc_src" ]; then
    (cd "$root" && cargo fetch --quiet) >&2
    cudarc_src="$(ls -d "${CARGO_HOME:-$HOME/.cargo}"/registry/src/*/cudarc-0.19.* | sort -V | tail -1)"
  fi
  tmp="$(mktemp -d)"
  grep -oE '^pub unsafe fn cu[A-Za-z0-9_]+' "$cudarc_src/src/driver/sys/mod.rs" |
    awk '{print $4}' | sort -u | sed 's/.*/void &(void) {}/' >"$tmp/libcuda_stub.c"
  mkdir -p "$cuda/lib/stubs"
  ${CC:-cc} -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$stub" "$tmp/libcuda_stub.c"
  log "generated $stub ($(wc -l <"$tmp/libcuda_stub.c") symbols)"
  rm -rf "$tmp"
fi

export CUDA_HOME="$cuda" CUDA_PATH="$cuda" CUDA_ROOT="$cuda"
export PATH="$cuda/bin:$PATH"
export CUDA_COMPUTE_CAP="${CUDA_COMPUTE_CAP:-90}"
export CUDARC_CUDA_VERSION=13000
export CUDAFORGE_THREADS="${CUDAFORGE_THREADS:-2}"
export LIBRARY_PATH="$cuda/lib:$cuda/lib/stubs${LIBRARY_PATH:+:$LIBRARY_PATH}"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$root/target/cuda}"

if [ "$mode" = env ]; then
  for v in CUDA_HOME CUDA_PATH CUDA_ROOT PATH CUDA_COMPUTE_CAP CUDARC_CUDA_VERSION CUDAFORGE_THREADS \
    LIBRARY_PATH CARGO_TARGET_DIR; do
    printf 'export %s=%q\n' "$v" "${!v}"
  done
  exit 0
fi

log "$(nvcc --version | tail -2 | head -1)"
log "CUDA_HOME=$CUDA_HOME CUDA_COMPUTE_CAP=$CUDA_COMPUTE_CAP CARGO_TARGET_DIR=$CARGO_TARGET_DIR"
cd "$root"

# The device executor's own kernels, compiled as the engine compiles them on a GPU (NVRTC, no
# headers), then assembled for sm_90 to report registers and spills.
ptx="$(mktemp --suffix=.ptx)"
LD_LIBRARY_PATH="$cuda/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" "$vpy" "$root/scripts/nvrtc-compile.py" \
  "$cuda/lib/libnvrtc.so.13" "$root/engine/src/model/cuda/kernels.cu" "$ptx" "compute_$CUDA_COMPUTE_CAP"
"$cuda/bin/ptxas" -arch="sm_$CUDA_COMPUTE_CAP" -v "$ptx" -o /dev/null 2>&1 |
  grep -E "Compiling entry|registers|spill" >&2
rm -f "$ptx"

t0=$SECONDS
log "cargo check -p engine --features cuda --all-targets"
cargo check -p engine --features cuda --all-targets
log "check passed in $((SECONDS - t0)) s"

if [ "$mode" = build ]; then
  t1=$SECONDS
  log "cargo build -p engine --features cuda --lib"
  cargo build -p engine --features cuda --lib
  ptx="$(find "$CARGO_TARGET_DIR/debug/build" -path '*candle-kernels-*/out/*.ptx' | wc -l)"
  moe="$(find "$CARGO_TARGET_DIR/debug/build" -path '*candle-kernels-*/out/libmoe.a' | head -1)"
  log "build passed in $((SECONDS - t1)) s: $ptx PTX files, libmoe.a: ${moe:-MISSING}"
  [ "$ptx" -gt 0 ] && [ -n "$moe" ]
fi
