//! worker: the embedded engine and its HTTP server (skeleton; being written).
//!
//! Module map (each owned by one piece of work; the contracts in `executor.rs` and the
//! public API of `engine.rs` are shared — extend them, do not rename):
//! - `error`     — the crate's one error enum
//! - `executor`  — the contract between the scheduler and what computes tokens
//! - `model`     — the candle Llama executor (real engine)
//! - `sim`       — the simulated executor (timing model)
//! - `kv`        — block pool, prefix cache, KV events
//! - `sampler`, `scheduler`, `engine` — continuous batching and the public engine API
//! - `server`    — the OpenAI-compatible HTTP server

pub mod engine;
pub mod error;
pub mod executor;
pub mod kv;
pub mod model;
pub mod sampler;
pub mod scheduler;
pub mod server;
pub mod sim;

pub use error::WorkerError;
