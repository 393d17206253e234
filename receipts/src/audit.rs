//! The audit: correlates the gateway's decision log with the workers' receipt logs.
//!
//! Checks: every receipt log verifies (signatures, chain, sequence, embedded tickets); every
//! decision line parses and its ticket verifies with a gateway key; the decision's service, rule,
//! rule version, worker and request id agree with its signed ticket; every routed decision has
//! exactly one receipt carrying the same ticket (log verification already requires the receipt's
//! worker to be the ticket's), with the same status
//! (a decision whose `error` is set, i.e. the gateway never got an answer, may have none); no
//! receipt carries a ticket that the gateway did not record; a ticket is not issued twice.
//! Direct (ticketless) receipts are counted per worker. Prefix parity (the gateway's and the
//! worker's last-full-block keys and prompt token counts) is reported; a mismatch is a
//! discrepancy only with [`AuditOptions::fail_on_parity_mismatch`].
//!
//! Cost: O(D + R) hash-map work plus one signature check per receipt and per ticket;
//! memory O(D + R) for the parsed decisions and receipts.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::path::{Path, PathBuf};

use serde::Serialize;

use crate::decision::DecisionRecord;
use crate::error::Result;
use crate::keys::KeyRing;
use crate::logfile::scan;
use crate::receipt::Receipt;
use crate::ticket::{RouteMode, DEFAULT_MAX_CLOCK_SKEW_MS};
use crate::verify::{verify_logs_collect, VerifyOptions, VerifyReport};

/// Audit options.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AuditOptions {
    /// Clock skew for ticket windows.
    pub max_clock_skew_ms: u64,
    /// Count prefix-parity mismatches as discrepancies.
    pub fail_on_parity_mismatch: bool,
}

impl Default for AuditOptions {
    fn default() -> Self {
        AuditOptions {
            max_clock_skew_ms: DEFAULT_MAX_CLOCK_SKEW_MS,
            fail_on_parity_mismatch: false,
        }
    }
}

/// The kind of an audit discrepancy (stable names).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum DiscrepancyKind {
    /// A receipt log failed verification (see its report).
    ReceiptLogInvalid,
    /// A decision line could not be parsed (or is a torn last line).
    DecisionMalformed,
    /// A decision's ticket does not verify with any given gateway key.
    DecisionTicketInvalid,
    /// A decision's fields disagree with its own signed ticket (rule version, worker, ...).
    DecisionTicketMismatch,
    /// The same ticket was recorded in two decisions.
    DuplicateDecision,
    /// A routed decision has no receipt.
    MissingReceipt,
    /// A ticket has more than one receipt (across all logs).
    DuplicateReceipt,
    /// A receipt carries a ticket the gateway never recorded.
    UnissuedTicket,
    /// Gateway and worker recorded different HTTP statuses.
    StatusMismatch,
    /// Gateway and worker disagree on the prompt's last block key or prompt token count.
    PrefixParity,
}

impl DiscrepancyKind {
    /// The stable name.
    pub fn as_str(&self) -> &'static str {
        match self {
            DiscrepancyKind::ReceiptLogInvalid => "receipt_log_invalid",
            DiscrepancyKind::DecisionMalformed => "decision_malformed",
            DiscrepancyKind::DecisionTicketInvalid => "decision_ticket_invalid",
            DiscrepancyKind::DecisionTicketMismatch => "decision_ticket_mismatch",
            DiscrepancyKind::DuplicateDecision => "duplicate_decision",
            DiscrepancyKind::MissingReceipt => "missing_receipt",
            DiscrepancyKind::DuplicateReceipt => "duplicate_receipt",
            DiscrepancyKind::UnissuedTicket => "unissued_ticket",
            DiscrepancyKind::StatusMismatch => "status_mismatch",
            DiscrepancyKind::PrefixParity => "prefix_parity",
        }
    }
}

/// One discrepancy.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Discrepancy {
    /// What is wrong.
    pub kind: DiscrepancyKind,
    /// The request concerned, when known.
    pub request_id: Option<String>,
    /// `file:line` where it was found.
    pub location: String,
    /// Details.
    pub detail: String,
}

impl fmt::Display for Discrepancy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.kind.as_str(), self.location)?;
        if let Some(r) = &self.request_id {
            write!(f, " request {r}")?;
        }
        write!(f, ": {}", self.detail)
    }
}

/// Counts for one (service, rule id, rule version).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct RouteCounts {
    /// Routed decisions.
    pub decisions: u64,
    /// Of which with exactly one matching receipt.
    pub receipted: u64,
    /// Sum of the gateway's predicted matched tokens (KV-exact tickets).
    pub predicted_tokens: u64,
    /// Sum of the cached tokens the workers observed, over receipted decisions.
    pub cached_tokens: u64,
    /// Sum of prompt tokens the workers observed, over receipted decisions.
    pub prompt_tokens: u64,
    /// Sum of the tokens the workers generated, over receipted decisions.
    pub completion_tokens: u64,
}

/// What one tenant used, by the decision lines that name it (`tenant`: services with
/// `auth = "api_key"`) and the worker-signed receipts their tickets match. Tokens count the
/// receipts of work done for the tenant: a 2xx status, or 499 (`client_disconnected`: what was
/// generated before the client went away). A refused attempt (429 / 503) or an error counts
/// none.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct TenantUsage {
    /// The tenant's requests: its decision lines other than `retried` attempts.
    pub requests: u64,
    /// Of which the gateway answered itself, routing nothing (a rate limit, a refused body).
    pub unrouted: u64,
    /// Receipts with a 2xx status matched to the tenant's decisions.
    pub answered: u64,
    /// Receipts with status 499: the client disconnected while the worker generated.
    pub disconnected: u64,
    /// Prompt tokens of the answered and disconnected receipts, as the workers tokenized them.
    pub prompt_tokens: u64,
    /// Of which reused from the workers' prefix caches.
    pub cached_tokens: u64,
    /// Tokens those receipts say were generated.
    pub completion_tokens: u64,
}

/// Counts for one worker.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct WorkerCounts {
    /// Decisions that chose this worker.
    pub decisions: u64,
    /// Valid receipts with a ticket.
    pub ticketed_receipts: u64,
    /// Valid direct (ticketless) receipts.
    pub direct_receipts: u64,
}

/// Prefix parity between the gateway's ticket and the worker's receipt (tickets that carry a
/// last block key, i.e. where the gateway tokenized).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct ParityCounts {
    /// Pairs compared.
    pub compared: u64,
    /// Pairs whose last block key or prompt tokens differ.
    pub mismatched: u64,
    /// Pairs not compared (no gateway tokenization, e.g. round-robin).
    pub not_applicable: u64,
    /// Compared pairs whose receipt has no last block key (a `kvgate sidecar`'s: the engine
    /// behind it computes no kvgate block keys): compared on prompt tokens only.
    pub tokens_only: u64,
}

/// The result of an audit.
/// A routed request that failed upstream and has no receipt (allowed, but listed).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct FailedRequest {
    pub request_id: String,
    /// The client's own request id, when the decision recorded one.
    pub client_request_id: Option<String>,
    /// The worker the ticket chose.
    pub worker: String,
    /// The gateway's error for it.
    pub error: String,
    /// `file:line` of the decision.
    pub location: String,
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct AuditReport {
    /// Decision lines read.
    pub decisions: u64,
    /// Decisions with a ticket.
    pub routed: u64,
    /// Decisions without a ticket (rejected before routing).
    pub unrouted: u64,
    /// Routed decisions whose `error` is set and that have no receipt (allowed).
    pub failed_without_receipt: u64,
    /// Routed decisions with only their `routed` line (no final line: the gateway stopped with
    /// the request in flight). A receipt is not required; one that exists is checked as usual
    /// (except its status, which the gateway never saw).
    pub unfinished: u64,
    /// Attempts the worker refused (429 / 503) before the gateway offered the request to the
    /// next candidate (`retried` lines). Checked as decisions (their receipt, their status).
    pub retried_attempts: u64,
    /// Those requests, one entry each: the requests the gateway routed but the worker never
    /// answered (connect error, reset, worker killed).
    pub failed_requests: Vec<FailedRequest>,
    /// Routed decisions the worker refused before accepting their ticket (its answer named no
    /// receipt: bad ticket, oversized body, unknown method), which owe no receipt.
    pub refused_by_worker: u64,
    /// Those requests (`error` = `refused by the worker: status N`).
    pub refused_requests: Vec<FailedRequest>,
    /// Routed decisions matched to exactly one receipt.
    pub receipted: u64,
    /// Valid receipts across all logs.
    pub receipts: u64,
    /// Valid direct (ticketless) receipts across all logs.
    pub direct_receipts: u64,
    /// Per (service, rule id, rule version); serialized as a list of objects.
    #[serde(serialize_with = "serialize_routes")]
    pub per_route: BTreeMap<(String, String, u64), RouteCounts>,
    /// Per mode.
    pub per_mode: BTreeMap<&'static str, u64>,
    /// Per worker.
    pub per_worker: BTreeMap<String, WorkerCounts>,
    /// Per tenant (decision lines that name one).
    pub per_tenant: BTreeMap<String, TenantUsage>,
    /// Prefix parity.
    pub parity: ParityCounts,
    /// The verification report of each receipt log.
    pub logs: Vec<VerifyReport>,
    /// Prefix-parity mismatches (also in `discrepancies` with `fail_on_parity_mismatch`).
    pub parity_mismatches: Vec<Discrepancy>,
    /// Every discrepancy found.
    pub discrepancies: Vec<Discrepancy>,
}

fn serialize_routes<S: serde::Serializer>(
    routes: &BTreeMap<(String, String, u64), RouteCounts>,
    s: S,
) -> std::result::Result<S::Ok, S::Error> {
    #[derive(Serialize)]
    struct Row<'a> {
        service: &'a str,
        rule_id: &'a str,
        rule_version: u64,
        #[serde(flatten)]
        counts: &'a RouteCounts,
    }
    s.collect_seq(routes.iter().map(|((service, rule_id, v), counts)| Row {
        service,
        rule_id,
        rule_version: *v,
        counts,
    }))
}

impl AuditReport {
    /// True when there is no discrepancy.
    pub fn ok(&self) -> bool {
        self.discrepancies.is_empty()
    }

    /// Discrepancies per kind.
    pub fn discrepancy_counts(&self) -> BTreeMap<DiscrepancyKind, u64> {
        let mut m = BTreeMap::new();
        for d in &self.discrepancies {
            *m.entry(d.kind).or_insert(0) += 1;
        }
        m
    }
}

/// ` (client ID)` when the decision recorded the client's own id.
fn client_suffix(r: &FailedRequest) -> String {
    r.client_request_id
        .as_deref()
        .map(|c| format!(" (client {c})"))
        .unwrap_or_default()
}

impl fmt::Display for AuditReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "audit: {}", if self.ok() { "OK" } else { "FAILED" })?;
        writeln!(
            f,
            "decisions {} (routed {}, unrouted {}), receipted {}, failed upstream without \
             receipt {}, refused by the worker before its ticket was accepted {}, unfinished \
             (the gateway stopped with them in flight) {}, attempts refused and retried on \
             another worker {}",
            self.decisions,
            self.routed,
            self.unrouted,
            self.receipted,
            self.failed_without_receipt,
            self.refused_by_worker,
            self.unfinished,
            self.retried_attempts
        )?;
        for r in &self.refused_requests {
            writeln!(
                f,
                "  refused: request {}{} on worker {} ({}) at {}",
                r.request_id,
                client_suffix(r),
                r.worker,
                r.error,
                r.location
            )?;
        }
        for r in &self.failed_requests {
            writeln!(
                f,
                "  failed upstream: request {}{} on worker {} ({}) at {}",
                r.request_id,
                client_suffix(r),
                r.worker,
                r.error,
                r.location
            )?;
        }
        writeln!(
            f,
            "receipts {} (direct {}) in {} log(s)",
            self.receipts,
            self.direct_receipts,
            self.logs.len()
        )?;
        for l in &self.logs {
            let state = if l.ok() { "ok" } else { "FAILED" };
            write!(
                f,
                "  {}: {state}, {} valid of {} lines",
                l.source, l.valid, l.lines
            )?;
            match l.first_failure() {
                Some(first) => writeln!(f, ", first failure {first}")?,
                None => writeln!(f)?,
            }
        }
        writeln!(f, "per service / rule / version:")?;
        for ((svc, rule, ver), c) in &self.per_route {
            writeln!(
                f,
                "  {svc} / {rule} / v{ver}: decisions {}, receipted {}, predicted tokens {}, \
                 cached tokens {}, prompt tokens {}, completion tokens {}",
                c.decisions,
                c.receipted,
                c.predicted_tokens,
                c.cached_tokens,
                c.prompt_tokens,
                c.completion_tokens
            )?;
        }
        let modes: Vec<String> = self
            .per_mode
            .iter()
            .map(|(m, n)| format!("{m} {n}"))
            .collect();
        writeln!(f, "per mode: {}", modes.join(", "))?;
        writeln!(f, "per worker:")?;
        for (w, c) in &self.per_worker {
            writeln!(
                f,
                "  {w}: decisions {}, ticketed receipts {}, direct receipts {}",
                c.decisions, c.ticketed_receipts, c.direct_receipts
            )?;
        }
        if !self.per_tenant.is_empty() {
            writeln!(f, "per tenant (tokens of 2xx and 499 receipts):")?;
            for (t, u) in &self.per_tenant {
                writeln!(
                    f,
                    "  {t}: requests {} (unrouted {}), answered {}, disconnected {}, prompt \
                     tokens {} (cached {}), completion tokens {}",
                    u.requests,
                    u.unrouted,
                    u.answered,
                    u.disconnected,
                    u.prompt_tokens,
                    u.cached_tokens,
                    u.completion_tokens
                )?;
            }
        }
        writeln!(
            f,
            "prefix parity: compared {} ({} on prompt tokens only), mismatched {}, not applicable {}",
            self.parity.compared,
            self.parity.tokens_only,
            self.parity.mismatched,
            self.parity.not_applicable
        )?;
        for d in &self.parity_mismatches {
            writeln!(f, "  {d}")?;
        }
        let counts = self.discrepancy_counts();
        if !counts.is_empty() {
            let c: Vec<String> = counts
                .iter()
                .map(|(k, n)| format!("{} {n}", k.as_str()))
                .collect();
            writeln!(
                f,
                "discrepancies: {} ({})",
                self.discrepancies.len(),
                c.join(", ")
            )?;
        }
        for d in &self.discrepancies {
            writeln!(f, "  {d}")?;
        }
        Ok(())
    }
}

/// Audit with default options.
pub fn audit(decisions: &Path, receipt_logs: &[PathBuf], keys: &KeyRing) -> Result<AuditReport> {
    audit_with(decisions, receipt_logs, keys, AuditOptions::default())
}

fn disc(
    kind: DiscrepancyKind,
    request_id: Option<&str>,
    location: String,
    detail: String,
) -> Discrepancy {
    Discrepancy {
        kind,
        request_id: request_id.map(str::to_string),
        location,
        detail,
    }
}

struct Found {
    location: String,
    receipt: Receipt,
}

/// Audit the gateway decision log against the workers' receipt logs. `keys` holds the gateway
/// and worker public keys. Returns `Err` only for I/O errors (a missing file); everything else
/// is a discrepancy in the report.
pub fn audit_with(
    decisions: &Path,
    receipt_logs: &[PathBuf],
    keys: &KeyRing,
    opts: AuditOptions,
) -> Result<AuditReport> {
    audit_replicas(&[decisions.to_path_buf()], receipt_logs, keys, opts)
}

/// [`audit_with`] over the decision logs of several gateway replicas at once (cluster mode:
/// each replica logs its own decisions with its own key; a worker's receipts may answer any of
/// them). A ticket recorded by two logs is `duplicate_ticket`, as within one.
pub fn audit_replicas(
    decision_logs: &[PathBuf],
    receipt_logs: &[PathBuf],
    keys: &KeyRing,
    opts: AuditOptions,
) -> Result<AuditReport> {
    use DiscrepancyKind as D;
    let mut rep = AuditReport::default();

    // 1. Receipt logs: verify each, keep the valid receipts by ticket signature.
    let vopts = VerifyOptions {
        require_ticket_keys: true,
        max_clock_skew_ms: opts.max_clock_skew_ms,
    };
    let mut by_ticket: HashMap<[u8; 64], Vec<Found>> = HashMap::new();
    let mut discrepancies = Vec::new();
    // A worker's rotated files and its current file are verified as one chain.
    let reports = verify_logs_collect(receipt_logs, keys, vopts, |path, line, r| {
        rep.receipts += 1;
        let wc = rep.per_worker.entry(r.worker_id.0.clone()).or_default();
        match &r.body.ticket {
            None => {
                rep.direct_receipts += 1;
                wc.direct_receipts += 1;
            }
            Some(t) => {
                wc.ticketed_receipts += 1;
                by_ticket.entry(*t.signature()).or_default().push(Found {
                    location: format!("{}:{line}", path.display()),
                    receipt: r,
                });
            }
        }
    })?;
    for report in reports {
        let display = report.source.clone();
        if !report.ok() {
            for fl in &report.failures {
                discrepancies.push(disc(
                    D::ReceiptLogInvalid,
                    None,
                    format!("{display}:{}", fl.line),
                    format!("{}: {}", fl.kind.as_str(), fl.detail),
                ));
            }
            let listed = report.failures.len() as u64;
            if report.failure_total() > listed {
                discrepancies.push(disc(
                    D::ReceiptLogInvalid,
                    None,
                    display.clone(),
                    format!("{} more failures", report.failure_total() - listed),
                ));
            }
        }
        rep.logs.push(report);
    }

    // 2. Decisions, of every gateway replica's log (one ticket may appear in only one).
    let mut issued: HashMap<[u8; 64], String> = HashMap::new();
    let mut lines: Vec<(String, u64, DecisionRecord)> = Vec::new();
    for decisions in decision_logs {
        let dpath = decisions.display().to_string();
        if !decisions.exists() {
            return Err(crate::error::ReceiptsError::io(
                "open",
                decisions,
                std::io::Error::from(std::io::ErrorKind::NotFound),
            ));
        }
        let mut count = 0u64;
        let (_, torn) = scan(decisions, |n, _, bytes| {
            count += 1;
            match DecisionRecord::from_line(bytes) {
                Ok(d) => lines.push((dpath.clone(), n, d)),
                Err(e) => discrepancies.push(disc(
                    D::DecisionMalformed,
                    None,
                    format!("{dpath}:{n}"),
                    e.to_string(),
                )),
            }
            Ok(())
        })?;
        if let Some((_, bytes)) = torn {
            let n = count + 1;
            discrepancies.push(disc(
                D::DecisionMalformed,
                None,
                format!("{dpath}:{n}"),
                format!("torn last line ({} bytes, no newline)", bytes.len()),
            ));
        }
    }
    // A `routed` line is superseded by the `retried` or final line of the same ticket; without one the
    // request was in flight when the gateway stopped: kept, as a failure that owes no receipt.
    let finished: std::collections::HashSet<[u8; 64]> = lines
        .iter()
        .filter(|(_, _, d)| crate::DecisionPhase::ends_attempt(d.phase))
        .filter_map(|(_, _, d)| d.ticket.as_ref().map(|t| *t.signature()))
        .collect();
    let lines: Vec<(String, u64, DecisionRecord)> = lines
        .into_iter()
        .filter_map(|(p, n, mut d)| {
            if d.phase == Some(crate::DecisionPhase::Retried) {
                rep.retried_attempts += 1;
            } else if d.phase.is_some() {
                if d.ticket
                    .as_ref()
                    .is_some_and(|t| finished.contains(t.signature()))
                {
                    return None;
                }
                rep.unfinished += 1;
                if d.error.is_none() {
                    d.error = Some(
                        "unfinished: the gateway stopped with the request in flight (routed line only)"
                            .into(),
                    );
                }
            }
            Some((p, n, d))
        })
        .collect();
    for (dpath, n, d) in lines {
        rep.decisions += 1;
        let loc = format!("{dpath}:{n}");
        let rid = Some(d.request_id.as_str());
        if let Some(u) = d
            .tenant
            .as_ref()
            .map(|t| rep.per_tenant.entry(t.clone()).or_default())
        {
            if d.phase != Some(crate::DecisionPhase::Retried) {
                u.requests += 1;
            }
            if d.ticket.is_none() {
                u.unrouted += 1;
            }
        }
        let Some(st) = &d.ticket else {
            rep.unrouted += 1;
            continue;
        };
        rep.routed += 1;
        let t = match st.verify_signature(keys) {
            Ok(t) => t,
            Err(e) => {
                discrepancies.push(disc(D::DecisionTicketInvalid, rid, loc, e.to_string()));
                continue;
            }
        };
        if let Some(prev) = issued.insert(*st.signature(), loc.clone()) {
            discrepancies.push(disc(
                D::DuplicateDecision,
                rid,
                loc,
                format!("the same ticket is already recorded at {prev}"),
            ));
            continue;
        }
        let mut mismatches = Vec::new();
        if t.request_id != d.request_id {
            mismatches.push(format!(
                "request_id {} vs ticket {}",
                d.request_id, t.request_id
            ));
        }
        if d.service.as_deref().is_some_and(|s| s != t.service) {
            mismatches.push(format!("service {:?} vs ticket {}", d.service, t.service));
        }
        if d.rule_id.as_deref().is_some_and(|s| s != t.rule_id) {
            mismatches.push(format!("rule_id {:?} vs ticket {}", d.rule_id, t.rule_id));
        }
        if d.rule_version.is_some_and(|v| v != t.rule_version) {
            mismatches.push(format!(
                "rule_version {:?} vs ticket {}",
                d.rule_version, t.rule_version
            ));
        }
        if d.worker.as_ref().is_some_and(|w| *w != t.worker) {
            mismatches.push(format!("worker {:?} vs ticket {}", d.worker, t.worker));
        }
        if !mismatches.is_empty() {
            discrepancies.push(disc(
                D::DecisionTicketMismatch,
                rid,
                loc.clone(),
                mismatches.join("; "),
            ));
        }
        *rep.per_mode.entry(t.mode.as_str()).or_insert(0) += 1;
        rep.per_worker
            .entry(t.worker.0.clone())
            .or_default()
            .decisions += 1;
        let route = rep
            .per_route
            .entry((t.service.clone(), t.rule_id.clone(), t.rule_version))
            .or_default();
        route.decisions += 1;
        if t.mode == RouteMode::KvExact {
            route.predicted_tokens += u64::from(t.predicted_matched_tokens.unwrap_or(0));
        }
        let found = by_ticket
            .get(st.signature())
            .map(Vec::as_slice)
            .unwrap_or(&[]);
        match found {
            [] => {
                if let Some(err) = &d.error {
                    rep.failed_without_receipt += 1;
                    rep.failed_requests.push(FailedRequest {
                        request_id: d.request_id.clone(),
                        client_request_id: d.client_request_id.clone(),
                        worker: t.worker.0.clone(),
                        error: err.clone(),
                        location: loc.clone(),
                    });
                } else if d.receipt_named == Some(false) {
                    rep.refused_by_worker += 1;
                    rep.refused_requests.push(FailedRequest {
                        request_id: d.request_id.clone(),
                        client_request_id: d.client_request_id.clone(),
                        worker: t.worker.0.clone(),
                        error: format!("refused by the worker: status {}", d.status),
                        location: loc.clone(),
                    });
                } else {
                    discrepancies.push(disc(
                        D::MissingReceipt,
                        rid,
                        loc,
                        format!("no receipt from worker {} for this ticket", t.worker),
                    ));
                }
            }
            [one] => {
                let r = &one.receipt;
                rep.receipted += 1;
                route.receipted += 1;
                route.cached_tokens += u64::from(r.body.cached_tokens);
                route.prompt_tokens += u64::from(r.body.prompt_tokens);
                route.completion_tokens += u64::from(r.body.completion_tokens);
                if let (Some(t), 200..=299 | 499) = (&d.tenant, r.body.status) {
                    let u = rep.per_tenant.entry(t.clone()).or_default();
                    if r.body.status == 499 {
                        u.disconnected += 1;
                    } else {
                        u.answered += 1;
                    }
                    u.prompt_tokens += u64::from(r.body.prompt_tokens);
                    u.cached_tokens += u64::from(r.body.cached_tokens);
                    u.completion_tokens += u64::from(r.body.completion_tokens);
                }
                if d.error.is_none() && d.status != r.body.status {
                    discrepancies.push(disc(
                        D::StatusMismatch,
                        rid,
                        format!("{loc} / {}", one.location),
                        format!(
                            "gateway status {}, worker status {}",
                            d.status, r.body.status
                        ),
                    ));
                }
                // A worker that refused the request before it rendered the prompt (a parameter
                // it does not serve, say) has no prompt to compare.
                let refused_unread = !(200..=299).contains(&r.body.status)
                    && r.body.prompt_tokens == 0
                    && r.body.last_block_key.is_none();
                match &t.last_block_key {
                    None => rep.parity.not_applicable += 1,
                    Some(_) if refused_unread => rep.parity.not_applicable += 1,
                    Some(gk) => {
                        rep.parity.compared += 1;
                        let key_ok = match &r.body.last_block_key {
                            Some(k) => k == gk,
                            None if r.body.prompt_tokens > 0 => {
                                rep.parity.tokens_only += 1;
                                true
                            }
                            None => false,
                        };
                        let tok_ok = t.prompt_tokens.is_none_or(|p| p == r.body.prompt_tokens);
                        if !(key_ok && tok_ok) {
                            rep.parity.mismatched += 1;
                            let detail = format!(
                                "prefix parity: gateway last block {gk} / {:?} prompt tokens, \
                                 worker {} {:?} / {} prompt tokens",
                                t.prompt_tokens,
                                r.worker_id,
                                r.body.last_block_key,
                                r.body.prompt_tokens
                            );
                            let d = disc(
                                D::PrefixParity,
                                rid,
                                format!("{loc} / {}", one.location),
                                detail,
                            );
                            if opts.fail_on_parity_mismatch {
                                discrepancies.push(d.clone());
                            }
                            rep.parity_mismatches.push(d);
                        }
                    }
                }
            }
            many => {
                let locs: Vec<&str> = many.iter().map(|f| f.location.as_str()).collect();
                discrepancies.push(disc(
                    D::DuplicateReceipt,
                    rid,
                    loc,
                    format!(
                        "{} receipts for one ticket: {}",
                        many.len(),
                        locs.join(", ")
                    ),
                ));
            }
        }
    }

    // 3. Receipts whose ticket the gateway never recorded.
    let mut unissued: Vec<&Found> = by_ticket
        .iter()
        .filter(|(sig, _)| !issued.contains_key(*sig))
        .flat_map(|(_, v)| v.iter())
        .collect();
    unissued.sort_by(|a, b| a.location.cmp(&b.location));
    for f in unissued {
        discrepancies.push(disc(
            D::UnissuedTicket,
            Some(&f.receipt.body.request_id),
            f.location.clone(),
            "receipt carries a ticket that is not in the decision log".into(),
        ));
    }
    rep.discrepancies = discrepancies;
    Ok(rep)
}
