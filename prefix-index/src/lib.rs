//! prefix-index: salted, parent-chained block keys and the multi-worker prefix index.
//!
//! Owns: the byte-level block key definition ([`key`], documented in `docs/block-keys.md`),
//! the KV event wire types ([`protocol`]) and the crate's error type ([`error`]).
//! Does not own: transport of events (SSE subscription lives in `gateway`, publication in
//! `worker`), routing policy (`routing-rules`), tokenization (the profile crate).
//! Plain synchronous data structures; no async runtime.
//!
//! The public names below are a contract shared with `routing-rules`, `worker` and `gateway`:
//! extend them, do not rename them.

pub mod error;
pub mod key;
pub mod protocol;

pub use error::IndexError;
pub use key::{
    BlockKey, BlockSize, ChainLink, HashAlgorithm, KeyChain, NamespaceInputs, NamespaceSeed,
    WorkerId,
};
pub use protocol::{KvEvent, KvEventEnvelope};
