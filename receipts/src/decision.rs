//! The gateway's decision log: one canonical-JSON line per request the gateway handled, holding
//! the signed route ticket it issued (if it routed the request) and the outcome it saw, and
//! before it, for a routed request, a `routed` line written as the request is sent (so that a
//! gateway killed with requests in flight still leaves their tickets on disk).
//!
//! Lines are not individually signed or chained: the ticket inside is signed, and the audit
//! correlates it with the workers' signed, chained receipts. Torn last lines are recovered as for
//! the receipt log. `append` is `&self` and thread-safe.

use std::path::Path;

use prefix_index::WorkerId;
use serde::{Deserialize, Serialize};

use crate::canonical;
use crate::error::{ReceiptsError, Result};
use crate::logfile::{cut_torn_tail, scan, Appender, FsyncPolicy, TornTail};
use crate::ticket::SignedTicket;

/// One gateway decision and its outcome.
///
/// Fields are declared in canonical key order (bytewise), so that the canonical encoder writes
/// them straight out without buffering and sorting (the bytes are the same either way).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DecisionRecord {
    /// When the gateway finished with the request (Unix ms).
    pub at_ms: u64,
    /// The client's own `x-request-id`, when it sent one (the ticket carries the gateway's id).
    #[serde(default)]
    pub client_request_id: Option<String>,
    /// A gateway-side failure talking to the worker (connect error, timeout, reset, ...). When
    /// set, the worker may not have written a receipt and the audit does not require one.
    pub error: Option<String>,
    /// `routed` on the line written as the gateway sends the request to the worker (before any
    /// answer: `status` 0, `at_ms` the sending time); `retried` on the line that ends an
    /// attempt the worker refused before answering (429 / 503: `status` is the worker's, which
    /// the client never saw) when the request was then offered to another worker; absent on the
    /// line written when the gateway has finished with the request. A `retried` or final line
    /// supersedes the routed line of its ticket. A routed line without either means the gateway
    /// stopped (crashed, was killed) with the request in flight.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<DecisionPhase>,
    /// Whether the worker's answer named a receipt (`x-kvgate-receipt`): `false` means the
    /// worker refused the request before accepting its ticket (bad ticket, oversized body,
    /// unknown method), so no receipt is owed. `null` when no answer came (or in logs written
    /// before this field existed).
    #[serde(default)]
    pub receipt_named: Option<bool>,
    /// The request id the gateway assigned.
    pub request_id: String,
    /// The rule that decided, if any (must agree with the ticket).
    pub rule_id: Option<String>,
    /// The rules snapshot version used, if any (must agree with the ticket).
    pub rule_version: Option<u64>,
    /// The matched service, if any (must agree with the ticket).
    pub service: Option<String>,
    /// The HTTP status the gateway returned to the client.
    pub status: u16,
    /// The tenant the request authenticated as (services with `auth = "api_key"`); absent
    /// otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant: Option<String>,
    /// The signed ticket sent to the worker; `None` when the request was not routed (rejected
    /// before a worker was chosen: no service, bad request, no healthy worker).
    pub ticket: Option<SignedTicket>,
    /// The worker the request went to, if any (must agree with the ticket).
    pub worker: Option<WorkerId>,
}

/// [`DecisionRecord::phase`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DecisionPhase {
    /// Written when the request is sent to the worker.
    Routed,
    /// Ends an attempt the worker refused (429 / 503) before the request went to the next
    /// candidate; it carries the worker's status and `receipt_named`.
    Retried,
}

impl DecisionPhase {
    /// Whether a line of this phase ends its ticket's attempt (a final line does too).
    pub fn ends_attempt(phase: Option<DecisionPhase>) -> bool {
        !matches!(phase, Some(DecisionPhase::Routed))
    }
}

impl DecisionRecord {
    /// Parse one decision line.
    pub fn from_line(line: &[u8]) -> Result<DecisionRecord> {
        serde_json::from_slice(line).map_err(|e| ReceiptsError::Malformed {
            what: "decision",
            detail: e.to_string(),
        })
    }

    /// The canonical line.
    pub fn to_line(&self) -> Result<Vec<u8>> {
        canonical::to_vec(self)
    }
}

/// The gateway's append-only decision log.
pub struct DecisionLog {
    appender: Appender,
    torn_tail: Option<TornTail>,
    existing: u64,
}

impl std::fmt::Debug for DecisionLog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DecisionLog")
            .field("path", &self.appender.path())
            .finish()
    }
}

impl DecisionLog {
    /// Open or create the log; a torn last line is cut (saved beside the log) and reported.
    /// Complete lines are not re-parsed.
    pub fn open(path: &Path, policy: FsyncPolicy) -> Result<DecisionLog> {
        let mut existing = 0u64;
        let (valid_len, torn) = scan(path, |_, _, _| {
            existing += 1;
            Ok(())
        })?;
        let torn_tail = match torn {
            Some((_, bytes)) => Some(cut_torn_tail(path, valid_len, existing + 1, &bytes)?),
            None => None,
        };
        Ok(DecisionLog {
            appender: Appender::open(path, policy)?,
            torn_tail,
            existing,
        })
    }

    /// A torn last line removed on open.
    pub fn torn_tail(&self) -> Option<&TornTail> {
        self.torn_tail.as_ref()
    }

    /// Complete lines found on open.
    pub fn existing_lines(&self) -> u64 {
        self.existing
    }

    /// Append one decision.
    pub fn append(&self, record: &DecisionRecord) -> Result<()> {
        let line = record.to_line()?;
        self.appender.append(&line)?;
        Ok(())
    }

    /// Force appended decisions to stable storage now.
    pub fn sync(&self) -> Result<()> {
        self.appender.sync()
    }

    /// The log file.
    pub fn path(&self) -> &Path {
        self.appender.path()
    }
}
