//! `receipts`: what makes every request kvgate serves auditable after the fact.
//!
//! Owns: Ed25519 keys and key rings ([`keys`]), the canonical JSON bytes that are signed
//! ([`canonical`]), the gateway's signed route tickets ([`ticket`]), the worker's signed receipts
//! ([`receipt`]), the worker's hash-chained receipt log ([`receipt_log`]) and the gateway's
//! decision log ([`decision`]) over a crash-safe JSON Lines appender with a configurable fsync
//! policy ([`logfile`]), log verification ([`verify`]) and the gateway/worker audit ([`audit`]).
//!
//! Does not own: HTTP (the gateway sets and the worker reads [`TICKET_HEADER`]), clocks (callers
//! pass Unix milliseconds), or what the worker puts in a receipt (it fills a [`ReceiptDraft`]).
//! Wire formats and a worked example are in `docs/receipts.md`.

pub mod access;
pub mod audit;
pub mod canonical;
pub mod decision;
pub mod error;
pub mod keys;
pub mod logfile;
pub mod receipt;
pub mod receipt_log;
pub mod signer;
pub mod ticket;
pub mod verify;

pub use access::{AccessToken, ACCESS_DOMAIN, DEFAULT_ACCESS_TTL_MS};
pub use audit::{
    audit, audit_replicas, audit_with, AuditOptions, AuditReport, Discrepancy, DiscrepancyKind,
    FailedRequest, TenantUsage,
};
pub use decision::{DecisionLog, DecisionPhase, DecisionRecord};
pub use error::{ReceiptsError, Result};
pub use keys::{KeyId, KeyPair, KeyRing, PublicKey};
pub use logfile::{FsyncPolicy, TornTail};
pub use receipt::{
    finish_reason_of, response_sha256, sha256_hex, Receipt, ReceiptDraft, GENESIS_HASH,
    RECEIPT_DOMAIN,
};
pub use receipt_log::{rotated_files, OpenReport, ReceiptLog, Rotation};
pub use signer::{PrecomputedSigner, Signer, SignerStats};
pub use ticket::{
    check_window, ReplayGuard, RouteMode, RouteTicket, SignedTicket, DEFAULT_MAX_CLOCK_SKEW_MS,
    DEFAULT_TICKET_TTL_MS, TICKET_DOMAIN, TICKET_HEADER,
};
pub use verify::{
    chains, verify_bytes, verify_log, verify_log_with, verify_logs_collect, verify_logs_with,
    FailureKind, VerifyFailure, VerifyOptions, VerifyReport,
};

/// The current time in Unix milliseconds (0 if the clock is before 1970).
pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}
