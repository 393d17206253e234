//! prefix-index: salted, parent-chained block keys and the multi-worker prefix index.
//!
//! Owns: the byte-level block key definition ([`key`], documented in `docs/block-keys.md`),
//! the KV event wire types ([`protocol`]), the index of which worker holds which keys with its
//! longest-prefix query ([`index`]), and the crate's error type ([`error`]).
//! Does not own: transport of events (SSE subscription lives in `gateway`, publication in
//! `worker`), routing policy (`routing-rules`), tokenization (the profile crate).
//! Plain synchronous data structures with `&self` methods; no async runtime, no threads.
//!
//! The public names below are a contract shared with `routing-rules`, `worker` and `gateway`:
//! extend them, do not rename them.

pub mod clock;
pub mod error;
mod holders;
pub mod index;
pub mod key;
pub mod protocol;

pub use clock::{Clock, ManualClock, SystemClock};
pub use error::IndexError;
pub use index::{EnvelopeOutcome, IndexConfig, PrefixIndex, WorkerMatch, WorkerStats};
pub use key::{
    BlockKey, BlockSize, ChainLink, HashAlgorithm, KeyChain, NamespaceInputs, NamespaceSeed,
    WorkerId,
};
pub use protocol::{KvEvent, KvEventEnvelope, WorkerLoad};
