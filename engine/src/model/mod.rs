//! The real engine's model: a Llama-architecture GGUF (SmolLM2 by default; Llama 3.x and
//! Mistral files with the same tensor names too) on candle, behind the [`Executor`] trait.
//!
//! Owns: loading and converting weights ([`weights`]), the paged-KV batched forward
//! ([`LlamaExecutor`]), paged attention ([`attention`]), a plain uncached single-sequence
//! forward used as a test oracle ([`reference`]) and the engine benchmark ([`bench`]).
//! Does not own: which KV blocks a sequence uses (the engine's block pool), sampling,
//! scheduling, tokenization.
//!
//! Device: CPU by default. With the crate's `cuda` feature, [`device`] can return CUDA device 0;
//! the matmuls then run on the GPU while attention and the KV cache stay in host memory (see
//! [`executor`]'s docs: correct, not tuned).
//!
//! Threads: candle runs CPU work on one process-wide pool sized from `CANDLE_NUM_THREADS` /
//! `RAYON_NUM_THREADS` when it first starts; [`configure_compute_threads`] sets them and must run
//! before the first model call. Size it to the cores left free of HTTP and tokenizer work:
//! candle's spin-waiting pool collapses when its threads compete for cores.
//!
//! [`Executor`]: crate::executor::Executor

pub mod attention;
pub mod bench;
pub mod executor;
pub(crate) mod gemm;
pub(crate) mod int8;
pub(crate) mod packed;
pub mod reference;
pub mod tiny;
pub mod weights;

pub use bench::{run_engine_bench, EngineBenchConfig, EngineBenchReport};
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

/// The compute device: CUDA device 0 when `cuda` is requested and the crate was built with the
/// `cuda` feature, else the CPU.
pub fn device(cuda: bool) -> Result<candle_core::Device, EngineError> {
    if cuda {
        #[cfg(feature = "cuda")]
        {
            return candle_core::Device::new_cuda(0)
                .map_err(|e| EngineError::Model(format!("CUDA device 0: {e}")));
        }
        #[cfg(not(feature = "cuda"))]
        {
            return Err(EngineError::Model(
                "this build has no CUDA support (build with `--features cuda`)".into(),
            ));
        }
    }
    Ok(candle_core::Device::Cpu)
}

/// The default weight format for a device: [`WeightFormat::Exact`] on CPU, the file's own
/// quantization on GPUs (candle has Q4_1 CUDA kernels).
pub fn default_format(device: &candle_core::Device) -> WeightFormat {
    if device.is_cpu() {
        WeightFormat::CPU_DEFAULT
    } else {
        WeightFormat::AsStored
    }
}
