#!/usr/bin/env bash
# The device executor's check on an NVIDIA GPU (docs/gpu.md), in two halves:
#
#   scripts/gpu-check.sh prepare   (here: Debian + Rust + Python, no GPU needed)
#       builds engine/examples/gpu_check.rs with `--features cuda` against the pinned CUDA 13.0
#       wheels (scripts/check-cuda.sh), strips it, and lays out what travels to the GPU machine:
#         .gpu/a/model.part-a         first 56 MiB of the default model
#         .gpu/b/model.part-b         the rest of it
#         .gpu/b/gpu_check.xz         the binary (54 MB stripped, 6 MB compressed)
#         .gpu/b/kvgate.xz            with WITH_WORKER=1: kvgate itself, --features cuda (a
#                                     release build of the whole workspace: ~25 min more)
#       (two folders, so that each fits one 64 MiB transfer of a machine that only takes that
#       much at a time; both are git-ignored).
#
#   scripts/gpu-check.sh run       (there: one NVIDIA GPU with a CUDA 13 driver, the CUDA 13
#                                   libraries cuBLAS, cuRAND, NVRTC, cudart as the pip packages of
#                                   the machine's python3 or under /usr/local/cuda; no Rust, no
#                                   network)
#       joins and verifies the model (SHA-256), points the loader at the CUDA libraries, prints
#       nvidia-smi, and runs gpu_check: device vs CPU greedy tokens on the golden prompts (cold,
#       cached, chunked, batched), fused kernels vs composed ops, every architecture on a generated
#       model, then the engine benchmark per variant. Writes $OUT/gpu-check.json (OUT defaults to
#       ./gpu-check-out) and its log; exits non-zero when an F32 device variant's tokens differ
#       from the CPU's or a stage failed. Under 8 minutes on an H200 (GPU_CHECK_DEADLINE_S=420
#       stops starting new stages after 7 minutes).
#
# GPU_CHECK_SKIP_ENGINE=1 skips the engine check (only the worker's, when kvgate travelled).
# KVGATE_CUDA_KERNELS=FILE makes the binary compile FILE instead of its built-in kernel source
# (e.g. engine/src/model/cuda/kernels.cu of the tree that travelled, after an edit).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
mode="${1:-}"
MODEL_FILE="SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_SHA256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
log() { echo "gpu-check: $*" >&2; }

case "$mode" in
prepare)
  cd "$root"
  ./scripts/fetch-model.sh >/dev/null
  eval "$(./scripts/check-cuda.sh env)"
  log "cargo build --release -p engine --features cuda --example gpu_check (CARGO_TARGET_DIR=$CARGO_TARGET_DIR)"
  cargo build --release -p engine --features cuda --example gpu_check
  rm -rf .gpu && mkdir -p .gpu/a .gpu/b
  strip -o .gpu/gpu_check "$CARGO_TARGET_DIR/release/examples/gpu_check"
  xz -T2 -6 -c .gpu/gpu_check >.gpu/b/gpu_check.xz
  rm .gpu/gpu_check
  if [ "${WITH_WORKER:-0}" = 1 ]; then
    log "cargo build --release --features cuda --bin kvgate"
    cargo build --release --features cuda --bin kvgate
    strip -o .gpu/kvgate "$CARGO_TARGET_DIR/release/kvgate"
    xz -T2 -6 -c .gpu/kvgate >.gpu/b/kvgate.xz
    rm .gpu/kvgate
  fi
  model="${KVGATE_MODEL_DIR:-$root/models}/$MODEL_FILE"
  head -c $((56 * 1024 * 1024)) "$model" >.gpu/a/model.part-a
  tail -c +$((56 * 1024 * 1024 + 1)) "$model" >.gpu/b/model.part-b
  du -sh .gpu/a .gpu/b
  log "ready: carry .gpu/a in one call and .gpu/b in the next, then run: scripts/gpu-check.sh run"
  ;;
run)
  cd "$root"
  out="${OUT:-$root/gpu-check-out}"
  mkdir -p "$out"
  exec > >(tee "$out/gpu-check.log") 2>&1
  model=/tmp/kvgate-model.gguf
  cat .gpu/a/model.part-a .gpu/b/model.part-b >"$model"
  got="$(sha256sum "$model" | cut -d' ' -f1)"
  if [ "$got" != "$MODEL_SHA256" ]; then
    log "model SHA-256 $got differs from $MODEL_SHA256"
    exit 1
  fi
  # The CUDA libraries: the pip packages' lib folders of the machine's python3 (CUDA 13 wheels
  # put them under nvidia/cu13/lib, older ones under nvidia/*/lib), then a system toolkit.
  libs=""
  for d in $(python3 - <<'EOF' 2>/dev/null
import glob, os, site, sys
roots = set(site.getsitepackages() + [site.getusersitepackages()] + sys.path)
seen = []
for r in roots:
    for pat in ("nvidia/cu13/lib", "nvidia/*/lib", "nvidia/cu13/lib64"):
        for d in glob.glob(os.path.join(r, pat)):
            if os.path.isdir(d) and d not in seen:
                seen.append(d)
print("\n".join(seen))
EOF
  ) /usr/local/nvidia/lib64 /usr/local/nvidia/lib /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do
    [ -d "$d" ] && libs="$libs${libs:+:}$d"
  done
  export LD_LIBRARY_PATH="$libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  log "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv || true
  bin=/tmp/kvgate-gpu_check
  python3 -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], "wb"))' \
    .gpu/b/gpu_check.xz "$bin"
  chmod +x "$bin"
  ldd "$bin" | grep -E "cuda|cublas|curand|nvrtc|not found" || true
  deadline="${GPU_CHECK_DEADLINE_S:-420}"
  rc=0
  if [ "${GPU_CHECK_SKIP_ENGINE:-0}" != 1 ]; then
    timeout $((deadline + 90)) "$bin" "$model" --out "$out/gpu-check.json" \
      --deadline-s "$deadline" >"$out/gpu-check.stdout" || rc=$?
  else
    : >"$out/gpu-check.stdout"
  fi
  cat "$out/gpu-check.stdout"
  log "gpu_check exited with $rc"
  # The worker over HTTP on the GPU, when kvgate travelled (WITH_WORKER=1 at prepare).
  if [ -f .gpu/b/kvgate.xz ]; then
    kv=/tmp/kvgate-cuda
    python3 -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], "wb"))' \
      .gpu/b/kvgate.xz "$kv"
    chmod +x "$kv"
    wrc=0
    timeout 420 python3 scripts/gpu-worker-check.py "$kv" "$model" >"$out/gpu-worker-check.json" || wrc=$?
    cat "$out/gpu-worker-check.json"
    log "gpu-worker-check exited with $wrc"
    [ "$rc" = 0 ] && rc=$wrc
  fi
  exit "$rc"
  ;;
*)
  echo "usage: $0 prepare | run" >&2
  exit 2
  ;;
esac
