//! engine: kvgate's embedded inference engine — everything between a request's prompt token ids
//! and its generated tokens, with no HTTP stack and no receipts code.
//!
//! Owns:
//! - [`executor`] — the contract between the scheduler and whatever computes tokens;
//! - [`model`] — the candle Llama executor (paged KV, batched forward, AVX-512 kernels), its
//!   uncached reference forward and the engine benchmark;
//! - [`sim`] — the simulated executor (timing model, deterministic tokens);
//! - [`kv`] — block pool, prefix cache (keyed by `prefix-index` block keys) and the KV-event feed;
//! - [`scheduler`] — continuous batching with chunked prefill and KV reservations;
//! - [`sampler`] — sampling, penalties and stop strings;
//! - [`constraint`] — constrained decoding (JSON mode): the token mask applied before sampling;
//!   [`json_schema`] — structured outputs: a JSON Schema compiled to the mask's automaton;
//!   [`text_pattern`] — what a schema's string may hold (`pattern`, `format`), as an automaton;
//! - [`engine`] — the step loop on its own thread and the [`Engine`] handle.
//!
//! Does not own: tokenization and templates (`prompt-profile`; the engine only turns generated
//! ids into text with [`prompt_profile::DecodeStream`]), HTTP, tickets, receipts, metrics
//! registries (`worker`), routing (`gateway`).

pub mod constraint;
pub mod engine;
pub mod error;
pub mod executor;
pub mod json_schema;
pub mod kv;
pub mod model;
pub mod sampler;
pub mod scheduler;
pub mod schema_cache;
pub mod sim;
pub mod step_budget;
pub mod text_pattern;

pub use constraint::{Constraint, TokenTable};
pub use engine::{
    Engine, EngineConfig, EngineHealth, EngineStats, FinishReason, GenerateRequest, OutputParams,
    SeqEvent, SequenceHandle, TokenLogprobs, Usage, MAX_TOP_LOGPROBS,
};
pub use error::EngineError;
pub use executor::{BlockId, Executor, KvGeometry, Sampled, SeqChunk};
