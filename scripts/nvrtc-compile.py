#!/usr/bin/env python3
"""Compile the device executor's CUDA kernels (engine/src/model/cuda/kernels.cu) with NVRTC, as
the engine does at start on a GPU (same options: --gpu-architecture=compute_XX, no headers), and
write the PTX. Needs only the NVRTC library (the nvidia-cuda-nvrtc wheel), no GPU: run by
scripts/check-cuda.sh, which then assembles the PTX with ptxas -v (registers, spills).

usage: nvrtc-compile.py LIBNVRTC KERNELS.cu OUT.ptx [compute_90]
"""
import ctypes
import sys


def main() -> int:
    lib, src_path, out_path = sys.argv[1:4]
    arch = sys.argv[4] if len(sys.argv) > 4 else "compute_90"
    nvrtc = ctypes.CDLL(lib)
    src = open(src_path, "rb").read()
    prog = ctypes.c_void_p()
    rc = nvrtc.nvrtcCreateProgram(ctypes.byref(prog), src, b"kvgate_kernels.cu", 0, None, None)
    if rc != 0:
        print(f"nvrtcCreateProgram failed: {rc}", file=sys.stderr)
        return 1
    opts = [f"--gpu-architecture={arch}".encode()]
    rc = nvrtc.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
    size = ctypes.c_size_t()
    nvrtc.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    nvrtc.nvrtcGetProgramLog(prog, log)
    if log.value.strip():
        print(log.value.decode(), file=sys.stderr)
    if rc != 0:
        print(f"NVRTC compile failed: {rc}", file=sys.stderr)
        return 1
    nvrtc.nvrtcGetPTXSize(prog, ctypes.byref(size))
    ptx = ctypes.create_string_buffer(size.value)
    nvrtc.nvrtcGetPTX(prog, ptx)
    text = ptx.value.decode()
    entries = [l.split()[2].rstrip("(") for l in text.splitlines() if l.startswith(".visible .entry")]
    open(out_path, "w").write(text)
    print(f"NVRTC ({arch}): {len(text)} bytes of PTX, entries {', '.join(entries)}")
    want = {"qkv_prep_f32", "qkv_prep_bf16", "paged_attention_f32", "paged_attention_bf16"}
    missing = want - set(entries)
    if missing:
        print(f"missing kernels: {sorted(missing)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
