//! The real engine's model: a Llama-architecture GGUF (SmolLM2 by default; Llama 3.x and
//! Mistral files with the same tensor names too) on candle, behind the [`Executor`] trait.
//!
//! Owns: loading and converting weights ([`weights`]), the paged-KV batched forward
//! ([`LlamaExecutor`]), paged attention ([`attention`]), a plain uncached single-sequence
//! forward used as a test oracle ([`reference`]) and the engine benchmark ([`bench`]).
//! Does not own: which KV blocks a sequence uses (the engine's block pool), sampling,
//! scheduling, tokenization.
//!
//! Device: CPU by default ([`LlamaExecutor`]: host kernels, host KV cache). On a GPU (the
//! crate's `cuda` feature, [`device`] returning CUDA device 0) the model runs in
//! [`DeviceExecutor`] ([`device`](mod@device)): weights, activations, the paged KV cache and
//! attention on the device, per step one upload of token ids, positions and block tables and
//! one download of the sampling rows' logits. The same executor runs on the CPU with F32
//! weights, which is how its equality with [`LlamaExecutor`] is tested without a GPU.
//!
//! Threads: candle runs CPU work on one process-wide pool sized from `CANDLE_NUM_THREADS` /
//! `RAYON_NUM_THREADS` when it first starts; [`configure_compute_threads`] sets them and must run
//! before the first model call. Size it to the cores left free of HTTP and tokenizer work:
//! candle's spin-waiting pool collapses when its threads compete for cores.
//!
//! [`Executor`]: crate::executor::Executor

pub(crate) mod activation;
pub mod attention;
pub mod bench;
#[cfg(feature = "cuda")]
pub(crate) mod cuda;
pub mod device;
pub mod executor;
pub(crate) mod gemm;
pub mod golden;
pub(crate) mod int8;
pub(crate) mod packed;
pub mod reference;
pub(crate) mod simd;
pub mod tiny;
pub mod weights;

pub use bench::{run_engine_bench, EngineBenchConfig, EngineBenchReport};
/// The element types of [`WeightFormat::Device`] (candle's).
pub use candle_core::DType;
pub use device::{AttentionKind, DeviceExecutor};
pub use executor::LlamaExecutor;
pub use weights::{blocks_for_budget, HeadPrecision, LlamaConfig, LlamaWeights, WeightFormat};

use crate::EngineError;

/// Sets the size of candle's CPU compute pool (process-wide). Effective only before the first
/// candle CPU operation of the process; returns the thread count candle will use (or already
/// uses). `threads == 0` keeps candle's default (physical cores).
pub fn configure_compute_threads(threads: usize) -> usize {
    if threads > 0 {
        let n = threads.to_string();
        // candle reads these once, when its pool starts.
        std::env::set_var("CANDLE_NUM_THREADS", &n);
        std::env::set_var("RAYON_NUM_THREADS", &n);
    }
    candle_core::utils::get_num_threads()
}

/// Which hand-written CPU kernels this CPU runs (attention, dense GEMM, packed blocks):
/// `"avx512"`, `"avx2"` (AVX2 and FMA, no AVX-512F) or `"portable"` (plain Rust loops,
/// several times slower: docs/benchmarks.md "CPUs without AVX-512"). Logged by the worker
/// when it is ready and printed by the engine benchmark.
pub fn cpu_kernels() -> &'static str {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("fma")
        {
            return "avx512";
        }
        if simd::avx2::available() {
            return "avx2";
        }
    }
    "portable"
}

/// The compute device: CUDA device 0 when `cuda` is requested and the crate was built with the
/// `cuda` feature, else the CPU. On CUDA every operation of the process runs on one stream of
/// its own (whichever thread issues it), so they are ordered without events.
pub fn device(cuda: bool) -> Result<candle_core::Device, EngineError> {
    device_with(cuda, EventTracking::Off)
}

/// Whether candle records a CUDA event on every tensor use ([`device_with`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EventTracking {
    /// candle's default: each op waits for the last writer of its inputs by event, which
    /// multi-stream code needs and one stream does not (an event record and wait per op).
    On,
    /// Off: correct because every op is issued on the device's one stream.
    Off,
}

/// [`device`] with a choice of candle's per-tensor event tracking (measured both ways by
/// `scripts/gpu-check.sh`).
pub fn device_with(
    cuda: bool,
    tracking: EventTracking,
) -> Result<candle_core::Device, EngineError> {
    if cuda {
        #[cfg(feature = "cuda")]
        {
            let dev = candle_core::Device::new_cuda_with_stream(0)
                .map_err(|e| EngineError::Model(format!("CUDA device 0: {e}")))?;
            if tracking == EventTracking::Off {
                if let Ok(c) = dev.as_cuda_device() {
                    // SAFETY: every tensor of this device is created and used on its one
                    // stream (`new_cuda_with_stream`), so stream order alone orders writes
                    // before reads and uses before frees; host reads synchronize the stream.
                    unsafe { c.disable_event_tracking() };
                }
            }
            return Ok(dev);
        }
        #[cfg(not(feature = "cuda"))]
        {
            let _ = tracking;
            return Err(EngineError::Model(
                "this build has no CUDA support (build with `--features cuda`)".into(),
            ));
        }
    }
    Ok(candle_core::Device::Cpu)
}

/// The default weight format for a device: [`WeightFormat::Exact`] on CPU (the host
/// kernels of [`LlamaExecutor`]), dense BF16 on GPUs ([`DeviceExecutor`], cuBLAS).
pub fn default_format(device: &candle_core::Device) -> WeightFormat {
    if device.is_cpu() {
        WeightFormat::CPU_DEFAULT
    } else {
        WeightFormat::Device(candle_core::DType::BF16)
    }
}

/// `(free, total)` bytes of a CUDA device's memory; `None` on other devices.
pub fn device_memory(device: &candle_core::Device) -> Option<(usize, usize)> {
    #[cfg(feature = "cuda")]
    if let Ok(cuda) = device.as_cuda_device() {
        return cuda.cuda_stream().context().mem_get_info().ok();
    }
    let _ = device;
    None
}
