//! Verification of a receipt log: every receipt signature, every embedded ticket signature, the
//! hash chain, sequence numbers, ticket/receipt consistency and torn lines.
//!
//! One pass, O(lines) signature checks and O(tickets) memory (one 64-byte ticket signature per
//! ticket, to find duplicates). Verification keeps going after a failure so that the report lists
//! every failing line (the first [`MAX_LISTED_FAILURES`] in detail); a line that cannot be parsed
//! still advances the chain with its raw bytes, so a single flipped byte shows up at its own line
//! (and as a chain break at the next one).

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::fmt;
use std::path::Path;

use serde::Serialize;

use crate::error::{ReceiptsError, Result};
use crate::keys::{KeyId, KeyRing};
use crate::logfile::scan;
use crate::receipt::{Receipt, GENESIS_HASH};
use crate::ticket::{check_window, DEFAULT_MAX_CLOCK_SKEW_MS};

/// Failures stored in detail per report (all are counted).
pub const MAX_LISTED_FAILURES: usize = 100;

/// What a log verification checks beyond the defaults.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VerifyOptions {
    /// Fail embedded tickets whose gateway key is not in the key ring (otherwise they are counted
    /// as "unchecked").
    pub require_ticket_keys: bool,
    /// Clock skew allowed when checking that a receipt's `received_at_ms` lies in its ticket's
    /// validity window.
    pub max_clock_skew_ms: u64,
}

impl Default for VerifyOptions {
    fn default() -> Self {
        VerifyOptions {
            require_ticket_keys: false,
            max_clock_skew_ms: DEFAULT_MAX_CLOCK_SKEW_MS,
        }
    }
}

/// The kind of a verification failure (stable names, printed by the CLI).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FailureKind {
    /// The line is not a receipt (bad JSON, unknown or missing field, bad ticket encoding).
    Malformed,
    /// The line parses but is not in canonical form.
    NonCanonical,
    /// The first line is not seq 0 with the genesis hash (the head of the log is missing).
    BadStart,
    /// The sequence number is not the previous one plus one (gap, reorder or duplicate).
    SeqGap,
    /// `prev_hash` is not the hash of the previous line.
    ChainBreak,
    /// The receipt signature does not verify.
    BadSignature,
    /// The receipt's key id is not among the given keys.
    UnknownKey,
    /// The embedded ticket's signature does not verify.
    TicketBadSignature,
    /// The embedded ticket's gateway key is unknown (only with `require_ticket_keys`).
    TicketUnknownKey,
    /// The ticket names another worker or request id than the receipt, or was signed by the
    /// receipt's own (worker) key.
    TicketMismatch,
    /// The receipt was received outside the ticket's validity window.
    TicketOutsideWindow,
    /// The same ticket appears in two receipts.
    DuplicateTicket,
    /// A receipt names another worker id than the first receipt of the log.
    WorkerChanged,
    /// The last line has no newline (a crash during a write, or truncation).
    TornLine,
}

impl FailureKind {
    /// The stable name.
    pub fn as_str(&self) -> &'static str {
        match self {
            FailureKind::Malformed => "malformed",
            FailureKind::NonCanonical => "non_canonical",
            FailureKind::BadStart => "bad_start",
            FailureKind::SeqGap => "seq_gap",
            FailureKind::ChainBreak => "chain_break",
            FailureKind::BadSignature => "bad_signature",
            FailureKind::UnknownKey => "unknown_key",
            FailureKind::TicketBadSignature => "ticket_bad_signature",
            FailureKind::TicketUnknownKey => "ticket_unknown_key",
            FailureKind::TicketMismatch => "ticket_mismatch",
            FailureKind::TicketOutsideWindow => "ticket_outside_window",
            FailureKind::DuplicateTicket => "duplicate_ticket",
            FailureKind::WorkerChanged => "worker_changed",
            FailureKind::TornLine => "torn_line",
        }
    }
}

/// One failed check, with its 1-based line number.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct VerifyFailure {
    /// 1-based line number in the log.
    pub line: u64,
    /// What failed.
    pub kind: FailureKind,
    /// Details.
    pub detail: String,
}

impl fmt::Display for VerifyFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "line {}: {}: {}",
            self.line,
            self.kind.as_str(),
            self.detail
        )
    }
}

/// The result of verifying one log.
#[derive(Debug, Clone, Default, Serialize)]
pub struct VerifyReport {
    /// The log's name (its path).
    pub source: String,
    /// Lines read (complete lines plus a torn last line).
    pub lines: u64,
    /// Receipts that passed every check.
    pub valid: u64,
    /// Direct (ticketless) receipts.
    pub direct: u64,
    /// Embedded tickets whose signature verified.
    pub tickets_verified: u64,
    /// Embedded tickets whose gateway key was not given (signature not checked).
    pub tickets_unchecked: u64,
    /// Worker ids seen.
    pub worker_ids: BTreeSet<String>,
    /// Receipt key ids seen.
    pub key_ids: BTreeSet<KeyId>,
    /// Failures per kind (all of them).
    pub failure_counts: BTreeMap<FailureKind, u64>,
    /// The first [`MAX_LISTED_FAILURES`] failures in line order.
    pub failures: Vec<VerifyFailure>,
}

impl VerifyReport {
    /// True when nothing failed.
    pub fn ok(&self) -> bool {
        self.failure_counts.is_empty()
    }

    /// The first failure (lowest line number), if any.
    pub fn first_failure(&self) -> Option<&VerifyFailure> {
        self.failures.first()
    }

    /// Total number of failures.
    pub fn failure_total(&self) -> u64 {
        self.failure_counts.values().sum()
    }

    fn fail(&mut self, line: u64, kind: FailureKind, detail: impl Into<String>) {
        *self.failure_counts.entry(kind).or_insert(0) += 1;
        if self.failures.len() < MAX_LISTED_FAILURES {
            self.failures.push(VerifyFailure {
                line,
                kind,
                detail: detail.into(),
            });
        }
    }
}

impl fmt::Display for VerifyReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let status = if self.ok() { "OK" } else { "FAILED" };
        writeln!(f, "{}: {status}", self.source)?;
        writeln!(
            f,
            "  lines {}, valid receipts {}, direct {}, tickets verified {}, tickets unchecked {}",
            self.lines, self.valid, self.direct, self.tickets_verified, self.tickets_unchecked
        )?;
        let workers: Vec<&str> = self.worker_ids.iter().map(String::as_str).collect();
        let keys: Vec<&str> = self.key_ids.iter().map(KeyId::as_str).collect();
        writeln!(
            f,
            "  workers [{}], keys [{}]",
            workers.join(", "),
            keys.join(", ")
        )?;
        if self.tickets_unchecked > 0 {
            writeln!(
                f,
                "  note: {} ticket signatures not checked (gateway key not given; use --keys DIR)",
                self.tickets_unchecked
            )?;
        }
        if let Some(first) = self.first_failure() {
            writeln!(f, "  first failure: {first}")?;
            let counts: Vec<String> = self
                .failure_counts
                .iter()
                .map(|(k, n)| format!("{} {n}", k.as_str()))
                .collect();
            writeln!(
                f,
                "  failures: {} ({})",
                self.failure_total(),
                counts.join(", ")
            )?;
            for fl in self.failures.iter().skip(1) {
                writeln!(f, "    {fl}")?;
            }
            let listed = self.failures.len() as u64;
            if self.failure_total() > listed {
                writeln!(f, "    ... {} more", self.failure_total() - listed)?;
            }
        }
        Ok(())
    }
}

/// Streaming verifier: feed lines in order, then [`LogVerifier::finish`].
pub(crate) struct LogVerifier<'k> {
    keys: &'k KeyRing,
    opts: VerifyOptions,
    report: VerifyReport,
    prev_hash: Option<String>,
    prev_seq: Option<u64>,
    first_worker: Option<String>,
    seen_tickets: HashSet<[u8; 64]>,
}

impl<'k> LogVerifier<'k> {
    pub(crate) fn new(source: String, keys: &'k KeyRing, opts: VerifyOptions) -> Self {
        LogVerifier {
            keys,
            opts,
            report: VerifyReport {
                source,
                ..VerifyReport::default()
            },
            prev_hash: None,
            prev_seq: None,
            first_worker: None,
            seen_tickets: HashSet::new(),
        }
    }

    /// Check one complete line; returns the receipt when every check passed.
    pub(crate) fn line(&mut self, line_no: u64, bytes: &[u8]) -> Option<Receipt> {
        use FailureKind as K;
        self.report.lines += 1;
        let failures_before = self.report.failure_total();
        let this_hash = Receipt::line_hash(bytes);
        let expected_prev = self.prev_hash.replace(this_hash);
        let expected_seq = self.prev_seq.take().map(|s| s + 1);
        let r = match Receipt::from_line(bytes) {
            Ok(r) => r,
            Err(ReceiptsError::NonCanonical { .. }) => {
                self.report
                    .fail(line_no, K::NonCanonical, "receipt is not canonical JSON");
                return None;
            }
            Err(e) => {
                self.report.fail(line_no, K::Malformed, e.to_string());
                return None;
            }
        };
        self.prev_seq = Some(r.seq);
        match expected_prev {
            None => {
                if r.seq != 0 || r.prev_hash != GENESIS_HASH {
                    self.report.fail(
                        line_no,
                        K::BadStart,
                        format!(
                            "log starts at seq {} (prev_hash {}…); the head of the log is missing",
                            r.seq,
                            r.prev_hash.get(..12).unwrap_or(&r.prev_hash)
                        ),
                    );
                }
            }
            Some(prev) => {
                if let Some(exp) = expected_seq {
                    if r.seq != exp {
                        self.report.fail(
                            line_no,
                            K::SeqGap,
                            format!("seq {} where {exp} was expected", r.seq),
                        );
                    }
                }
                if r.prev_hash != prev {
                    self.report.fail(
                        line_no,
                        K::ChainBreak,
                        "prev_hash is not the SHA-256 of the previous line",
                    );
                }
            }
        }
        match r.verify_signature(self.keys) {
            Ok(()) => {}
            Err(ReceiptsError::UnknownKey { key_id, .. }) => {
                self.report.fail(
                    line_no,
                    K::UnknownKey,
                    format!("receipt signed by unknown key {key_id}"),
                );
            }
            Err(e) => self.report.fail(line_no, K::BadSignature, e.to_string()),
        }
        match &self.first_worker {
            None => self.first_worker = Some(r.worker_id.0.clone()),
            Some(w) if *w != r.worker_id.0 => {
                let msg = format!("worker_id {} in a log of {w}", r.worker_id);
                self.report.fail(line_no, K::WorkerChanged, msg);
            }
            Some(_) => {}
        }
        self.report.worker_ids.insert(r.worker_id.0.clone());
        self.report.key_ids.insert(r.key_id.clone());
        match &r.body.ticket {
            None => self.report.direct += 1,
            Some(st) => {
                match st.verify_signature(self.keys) {
                    Ok(_) => self.report.tickets_verified += 1,
                    Err(ReceiptsError::UnknownKey { key_id, .. }) => {
                        if self.opts.require_ticket_keys {
                            self.report.fail(
                                line_no,
                                K::TicketUnknownKey,
                                format!("ticket signed by unknown gateway key {key_id}"),
                            );
                        } else {
                            self.report.tickets_unchecked += 1;
                        }
                    }
                    Err(e) => self
                        .report
                        .fail(line_no, K::TicketBadSignature, e.to_string()),
                }
                let t = st.ticket_unverified();
                if t.key_id == r.key_id {
                    let msg = format!("ticket signed by the worker's own key {}", r.key_id);
                    self.report.fail(line_no, K::TicketMismatch, msg);
                }
                if t.worker != r.worker_id || t.request_id != r.body.request_id {
                    let msg = format!(
                        "ticket is for worker {} / request {}, receipt is worker {} / request {}",
                        t.worker, t.request_id, r.worker_id, r.body.request_id
                    );
                    self.report.fail(line_no, K::TicketMismatch, msg);
                }
                if let Err(e) = check_window(t, r.body.received_at_ms, self.opts.max_clock_skew_ms)
                {
                    self.report.fail(
                        line_no,
                        K::TicketOutsideWindow,
                        format!("at received_at_ms: {e}"),
                    );
                }
                if !self.seen_tickets.insert(*st.signature()) {
                    let msg = format!("ticket for request {} already used", t.request_id);
                    self.report.fail(line_no, K::DuplicateTicket, msg);
                }
            }
        }
        if self.report.failure_total() == failures_before {
            self.report.valid += 1;
            Some(r)
        } else {
            None
        }
    }

    /// Closes the current file's report (recording a torn last line) and starts the report of
    /// the next file of the same chain: sequence, hash chain, worker and seen tickets carry on.
    pub(crate) fn next_file(&mut self, torn: Option<(u64, usize)>, source: String) -> VerifyReport {
        self.record_torn(torn);
        std::mem::replace(
            &mut self.report,
            VerifyReport {
                source,
                ..VerifyReport::default()
            },
        )
    }

    fn record_torn(&mut self, torn: Option<(u64, usize)>) {
        if let Some((line_no, len)) = torn {
            self.report.lines += 1;
            self.report.fail(
                line_no,
                FailureKind::TornLine,
                format!(
                    "last line ({len} bytes) has no newline: a write torn by a crash or a \
                     truncation; it is not counted (the worker cuts it on restart)"
                ),
            );
        }
    }

    /// Record a torn last line (no newline) and return the report.
    pub(crate) fn finish(mut self, torn: Option<(u64, usize)>) -> VerifyReport {
        self.record_torn(torn);
        self.report
    }
}

/// The first receipt line of a file: (worker id, seq), if it parses.
fn head_of(path: &Path) -> Option<(String, u64)> {
    #[derive(serde::Deserialize)]
    struct Head {
        worker_id: String,
        seq: u64,
    }
    let f = std::fs::File::open(path).ok()?;
    let mut line = Vec::new();
    std::io::BufRead::read_until(&mut std::io::BufReader::new(f), b'\n', &mut line).ok()?;
    let h: Head = serde_json::from_slice(line.strip_suffix(b"\n")?).ok()?;
    Some((h.worker_id, h.seq))
}

/// Orders receipt log files into chains: a worker's rotated files and its current file are one
/// chain, ordered by their first receipt's seq. Files are grouped by the worker of their first
/// receipt; a file whose first line cannot be read is a chain of its own (and fails on its own),
/// and so is a file starting at a seq the worker's chain already has a file for (a copy: the
/// audit then reports its receipts as duplicates, not the chain as broken). Chains come in the
/// order their first file was given.
pub fn chains(paths: &[std::path::PathBuf]) -> Vec<Vec<std::path::PathBuf>> {
    /// A chain being gathered: its worker (`None`: unreadable head) and its files by first seq.
    type Group = (Option<String>, Vec<(u64, std::path::PathBuf)>);
    let mut groups: Vec<Group> = Vec::new();
    for p in paths {
        match head_of(p) {
            Some((worker, seq)) => {
                // A file whose first seq another file of the worker's chain already has (a copy,
                // a restored backup) cannot continue that chain: it starts one of its own.
                let joins = |(w, files): &&mut Group| {
                    w.as_ref() == Some(&worker) && files.iter().all(|(s, _)| *s != seq)
                };
                match groups.iter_mut().find(joins) {
                    Some((_, files)) => files.push((seq, p.clone())),
                    None => groups.push((Some(worker), vec![(seq, p.clone())])),
                }
            }
            None => groups.push((None, vec![(0, p.clone())])),
        }
    }
    groups
        .into_iter()
        .map(|(_, mut files)| {
            files.sort_by_key(|(seq, _)| *seq);
            files.into_iter().map(|(_, p)| p).collect()
        })
        .collect()
}

/// Verify a set of receipt log files — rotated files and current files of one or more workers,
/// in any order — as chains ([`chains`]): one report per file, in chain order. Every fully valid
/// receipt goes to `on_valid` with its file and line.
pub fn verify_logs_collect(
    paths: &[std::path::PathBuf],
    keys: &KeyRing,
    opts: VerifyOptions,
    mut on_valid: impl FnMut(&Path, u64, Receipt),
) -> Result<Vec<VerifyReport>> {
    let mut reports = Vec::new();
    for chain in chains(paths) {
        let mut v: Option<LogVerifier<'_>> = None;
        let mut torn_prev: Option<(u64, usize)> = None;
        for path in &chain {
            if !path.exists() {
                return Err(ReceiptsError::io(
                    "open",
                    path,
                    std::io::Error::from(std::io::ErrorKind::NotFound),
                ));
            }
            let source = path.display().to_string();
            match v.as_mut() {
                None => v = Some(LogVerifier::new(source, keys, opts)),
                Some(v) => reports.push(v.next_file(torn_prev.take(), source)),
            }
            let Some(ver) = v.as_mut() else { continue };
            let mut last_line = 0;
            let (_, torn) = scan(path, |n, _, bytes| {
                last_line = n;
                if let Some(r) = ver.line(n, bytes) {
                    on_valid(path, n, r);
                }
                Ok(())
            })?;
            torn_prev = torn.map(|(_, b)| (last_line + 1, b.len()));
        }
        if let Some(v) = v {
            reports.push(v.finish(torn_prev));
        }
    }
    Ok(reports)
}

/// [`verify_logs_collect`] without the receipts.
pub fn verify_logs_with(
    paths: &[std::path::PathBuf],
    keys: &KeyRing,
    opts: VerifyOptions,
) -> Result<Vec<VerifyReport>> {
    verify_logs_collect(paths, keys, opts, |_, _, _| {})
}

/// Verify the receipt log at `path` with default options.
pub fn verify_log(path: &Path, keys: &KeyRing) -> Result<VerifyReport> {
    verify_log_with(path, keys, VerifyOptions::default())
}

/// Verify the receipt log at `path`.
pub fn verify_log_with(path: &Path, keys: &KeyRing, opts: VerifyOptions) -> Result<VerifyReport> {
    verify_log_collect(path, keys, opts, |_, _| {})
}

/// Verify a log, handing every fully valid receipt (with its line number) to `on_valid`.
pub(crate) fn verify_log_collect(
    path: &Path,
    keys: &KeyRing,
    opts: VerifyOptions,
    mut on_valid: impl FnMut(u64, Receipt),
) -> Result<VerifyReport> {
    if !path.exists() {
        return Err(ReceiptsError::io(
            "open",
            path,
            std::io::Error::from(std::io::ErrorKind::NotFound),
        ));
    }
    let mut v = LogVerifier::new(path.display().to_string(), keys, opts);
    let mut last_line = 0;
    let (_, torn) = scan(path, |n, _, bytes| {
        last_line = n;
        if let Some(r) = v.line(n, bytes) {
            on_valid(n, r);
        }
        Ok(())
    })?;
    Ok(v.finish(torn.map(|(_, b)| (last_line + 1, b.len()))))
}

/// Verify a log held in memory (same checks as [`verify_log_with`]).
pub fn verify_bytes(
    source: &str,
    bytes: &[u8],
    keys: &KeyRing,
    opts: VerifyOptions,
) -> VerifyReport {
    let mut v = LogVerifier::new(source.to_string(), keys, opts);
    let mut rest = bytes;
    let mut line_no = 0u64;
    while !rest.is_empty() {
        line_no += 1;
        match rest.iter().position(|&b| b == b'\n') {
            Some(i) => {
                v.line(line_no, &rest[..i]);
                rest = &rest[i + 1..];
            }
            None => return v.finish(Some((line_no, rest.len()))),
        }
    }
    v.finish(None)
}
