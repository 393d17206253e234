//! The one error type of the `receipts` crate.
//!
//! Every variant has a stable [`ReceiptsError::error_type`] string, usable as a metric label or an
//! OpenAI-style error `code` (e.g. a worker refusing a ticket answers with `ticket_expired`).

use std::path::PathBuf;

/// Errors from keys, tickets, receipts and the logs.
#[derive(Debug, thiserror::Error)]
pub enum ReceiptsError {
    /// An I/O operation on a key or log file failed.
    #[error("{op} {path}: {io}")]
    Io {
        /// What was being done ("open", "read", "write", "fsync", ...).
        op: &'static str,
        /// The file concerned.
        path: PathBuf,
        /// The underlying error (in the message, not repeated as a `source()`).
        io: std::io::Error,
    },
    /// A private key file is readable or writable by group or others.
    #[error(
        "refusing to load private key {path}: its permissions are {mode:04o}, they must be 0600 or \
         stricter (run `chmod 600 {path}`)"
    )]
    KeyPermissions {
        /// The key file.
        path: PathBuf,
        /// Its permission bits.
        mode: u32,
    },
    /// A key file exists already (keygen never overwrites a key).
    #[error("refusing to overwrite existing key file {path}")]
    KeyExists {
        /// The existing file.
        path: PathBuf,
    },
    /// A key file could not be decoded.
    #[error("invalid key {what}: {detail}")]
    InvalidKey {
        /// The file or description of the key.
        what: String,
        /// Why it is invalid.
        detail: String,
    },
    /// A ticket header value or a log line could not be decoded.
    #[error("malformed {what}: {detail}")]
    Malformed {
        /// What was being decoded ("ticket", "receipt", "decision").
        what: &'static str,
        /// Why it is malformed.
        detail: String,
    },
    /// A signed payload is not in canonical form (its bytes differ from their canonical re-encoding).
    #[error("{what} is not in canonical form")]
    NonCanonical {
        /// What was being decoded.
        what: &'static str,
    },
    /// A value cannot be encoded canonically (e.g. a float).
    #[error("cannot encode canonically: {0}")]
    Canonical(String),
    /// The signature does not verify with the key named by the key id.
    #[error("bad {what} signature (key {key_id})")]
    BadSignature {
        /// "ticket" or "receipt".
        what: &'static str,
        /// The key id named in the signed object.
        key_id: String,
    },
    /// The key id named in a signed object is not in the key ring.
    #[error("unknown {what} key id {key_id}")]
    UnknownKey {
        /// "ticket" or "receipt".
        what: &'static str,
        /// The key id that was not found.
        key_id: String,
    },
    /// A ticket's validity window ended before `now` (beyond the allowed clock skew).
    #[error("ticket expired: expires_at_ms={expires_at_ms}, now_ms={now_ms}")]
    TicketExpired {
        /// The end of the ticket's validity window.
        expires_at_ms: u64,
        /// The verifier's clock.
        now_ms: u64,
    },
    /// A ticket was issued after `now` (beyond the allowed clock skew).
    #[error("ticket not yet valid: issued_at_ms={issued_at_ms}, now_ms={now_ms}")]
    TicketNotYetValid {
        /// When the ticket says it was issued.
        issued_at_ms: u64,
        /// The verifier's clock.
        now_ms: u64,
    },
    /// A ticket with this request id was already accepted inside its validity window.
    #[error("ticket replayed: request id {request_id} was already accepted")]
    TicketReplayed {
        /// The request id seen twice.
        request_id: String,
    },
    /// An existing log file is corrupt before its last line (it cannot be resumed safely).
    #[error("receipt log {path} is corrupt at line {line}: {detail}")]
    CorruptLog {
        /// The log file.
        path: PathBuf,
        /// 1-based line number of the first bad line.
        line: u64,
        /// What is wrong.
        detail: String,
    },
    /// An existing log was written by another worker id or key.
    #[error("receipt log {path} belongs to {found}, not to {expected}")]
    LogOwner {
        /// The log file.
        path: PathBuf,
        /// Who this process is.
        expected: String,
        /// Who wrote the log.
        found: String,
    },
}

impl ReceiptsError {
    /// A stable, snake_case name for the kind of error (metric label / API error code).
    pub fn error_type(&self) -> &'static str {
        match self {
            ReceiptsError::Io { .. } => "io",
            ReceiptsError::KeyPermissions { .. } => "key_permissions",
            ReceiptsError::KeyExists { .. } => "key_exists",
            ReceiptsError::InvalidKey { .. } => "invalid_key",
            ReceiptsError::Malformed { .. } => "malformed",
            ReceiptsError::NonCanonical { .. } => "non_canonical",
            ReceiptsError::Canonical(_) => "canonical_encoding",
            ReceiptsError::BadSignature { .. } => "bad_signature",
            ReceiptsError::UnknownKey { .. } => "unknown_key",
            ReceiptsError::TicketExpired { .. } => "ticket_expired",
            ReceiptsError::TicketNotYetValid { .. } => "ticket_not_yet_valid",
            ReceiptsError::TicketReplayed { .. } => "ticket_replayed",
            ReceiptsError::CorruptLog { .. } => "corrupt_log",
            ReceiptsError::LogOwner { .. } => "log_owner",
        }
    }

    pub(crate) fn io(op: &'static str, path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        ReceiptsError::Io {
            op,
            path: path.into(),
            io: source,
        }
    }
}

/// Result alias for this crate.
pub type Result<T, E = ReceiptsError> = std::result::Result<T, E>;
