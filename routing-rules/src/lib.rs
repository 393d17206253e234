//! routing-rules: the gateway's rules file and what it decides.
//!
//! Owns: the rules file schema ([`schema`], TOML on disk, the same model as JSON in the admin
//! API), parsing with error paths ([`parse`]), validation that reports every problem with its
//! path ([`validate`]), the versioned rule store with hot reload and atomic write-back
//! ([`RuleStore`], [`RuleSnapshot`]), and the selection policies that order a pool's workers
//! for one request ([`policy`]: round robin, KV-exact).
//!
//! Does not own: block keys and the prefix index (`prefix-index`), tokenization and profiles
//! (the prompt-profile crate), health checks, load accounting, file watching, SIGHUP and HTTP
//! (the gateway). Everything here is synchronous; no tokio.
//!
//! The full schema, with every default and an example, is in `docs/rules.md`.

pub mod error;
pub mod parse;
pub mod policy;
pub mod schema;
pub mod snapshot;
pub mod store;
pub mod validate;

pub use error::{Problem, RulesError};
pub use parse::{load_toml, rules_from_json, rules_from_toml, rules_to_toml, service_from_json};
pub use policy::{Candidate, KvExact, Reason, RoundRobin, Selection, SelectionPolicy, Stagger};
pub use schema::*;
pub use snapshot::{ContentHash, RequestInfo, RuleSnapshot, RuleVersion, ServiceEntry};
pub use store::{ApplyOutcome, PreApplyCheck, RuleStore};
pub use validate::validate;
