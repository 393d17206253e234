//! The device executor's fused CUDA kernels (`engine/src/model/cuda/kernels.cu`), checked on
//! the CPU: the kernel source is compiled as C++ with `tests/cuda/cuda_emulation.h` (each CUDA
//! thread a fiber, barriers and warp shuffles emulated) into `tests/cuda/kernels_emulated.cpp`,
//! which compares Q/K/V preparation, the per-token attention kernel, the residual-add + RMSNorm
//! and the gated activation against a double-precision reference in F32 and BF16, the argmax
//! against the host sampler's rule (ties, NaN, soft-capping) — GQA, bias,
//! per-head norms, partial rotary, sliding windows, scattered block tables, multi-round
//! contexts, head sizes 32 to 256 — and requires the tile attention kernel's output to equal
//! the per-token kernel's bit for bit (the engine's cached = uncached = chunked property on a
//! GPU rests on it). Needs a C++20 compiler (`$CXX`, else `c++`): the
//! machine's gcc. On a GPU the same kernels are compared with the composed tensor path by
//! `scripts/gpu-check.sh`.

use std::path::PathBuf;
use std::process::Command;

#[test]
fn fused_cuda_kernels_match_a_reference_under_cpu_emulation() {
    let tests = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/cuda");
    let dir = tempfile::tempdir().unwrap();
    let exe = dir.path().join("kernels_emulated");
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
    let build = Command::new(&cxx)
        .args(["-std=c++20", "-O2", "-Wall", "-Wno-unknown-pragmas", "-I"])
        .arg(&tests)
        .arg(tests.join("kernels_emulated.cpp"))
        .arg("-o")
        .arg(&exe)
        .output()
        .unwrap_or_else(|e| panic!("running {cxx}: {e}"));
    assert!(
        build.status.success(),
        "compiling the emulated kernels failed:\n{}",
        String::from_utf8_lossy(&build.stderr)
    );
    let run = Command::new(&exe).output().unwrap();
    let out = String::from_utf8_lossy(&run.stdout);
    println!("{out}");
    assert!(
        run.status.success(),
        "emulated kernels differ from the reference:\n{out}"
    );
    assert!(out.contains("all cases ok"), "{out}");
    // Every case ran: 9 attention cases in both storage types, the norm / activation pair in
    // both, the argmax.
    assert_eq!(
        out.lines().filter(|l| l.ends_with("  ok")).count(),
        21,
        "{out}"
    );
}
