//! The access log (`--access-log PATH`, `-` for standard output): one JSON line per client
//! request, written when the request ends — who asked for what, where it went, what came back
//! and how long each part took. For operators and their log pipelines; the audit reads the
//! decision log instead (docs/receipts.md), which this does not replace.
//!
//! A request never waits on the log: lines go through a bounded queue to the log's own
//! thread, which writes them in batches (one `write` per batch, flushed whenever the queue is
//! empty). A line that finds the queue full is dropped and counted
//! (`kvgate_gateway_access_log_dropped_total`). A file is opened for appending, so an external
//! rotation that truncates it (`logrotate`'s `copytruncate`) keeps working. The thread ends,
//! after writing what is queued, when the log is dropped.

use std::io::Write;
use std::path::PathBuf;
use std::sync::mpsc::{Receiver, SyncSender, TrySendError};
use std::thread::JoinHandle;

use prometheus_client::metrics::counter::Counter;
use serde::Serialize;

/// Lines the queue holds before new ones are dropped.
pub const QUEUE_LINES: usize = 16_384;

/// Where access lines go.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AccessLogTarget {
    /// Standard output (`-`).
    Stdout,
    /// A file, created if missing, appended to.
    File(PathBuf),
}

impl AccessLogTarget {
    /// `-` is standard output; anything else a file path.
    pub fn parse(s: &str) -> AccessLogTarget {
        if s == "-" {
            AccessLogTarget::Stdout
        } else {
            AccessLogTarget::File(PathBuf::from(s))
        }
    }
}

/// One line of the access log (docs/gateway.md, "Access log", lists the fields).
#[derive(Debug, Serialize)]
pub struct AccessRecord<'a> {
    /// When the request ended, Unix ms.
    pub at_ms: u64,
    /// The gateway's id of the request (`x-request-id` answered; ticket, receipt, decision log).
    pub request_id: &'a str,
    /// The client's own `x-request-id`, when it sent a valid one.
    pub client_request_id: Option<&'a str>,
    /// The client's address (`ip:port`).
    pub client: Option<String>,
    /// The named listener the request arrived on (`None`: the VIP).
    pub listener: Option<&'a str>,
    /// Request method.
    pub method: &'a str,
    /// Request path (with its query).
    pub path: &'a str,
    /// The body's `model`, when it named one.
    pub model: Option<&'a str>,
    /// The matched service.
    pub service: Option<&'a str>,
    /// The authenticated tenant (services with `auth = "api_key"`).
    pub tenant: Option<&'a str>,
    /// The status answered (0: none, the client went away first).
    pub status: u16,
    /// The worker of the last attempt.
    pub worker: Option<&'a str>,
    /// Attempts sent to workers (connect failures and refusals retried elsewhere included).
    pub attempts: u32,
    /// Of which refused by their worker (429 / 503) and retried on another.
    pub refused_retries: u32,
    /// Why the first choice was chosen (`hit`, `no_match`, `round_robin`, …).
    pub route_reason: Option<&'static str>,
    /// The rules version the request read.
    pub rules_version: Option<u64>,
    /// Prompt tokens as the gateway counted them (`kv_exact`).
    pub prompt_tokens: Option<usize>,
    /// Prefix tokens the gateway expected the worker to hold (the ticket's).
    pub predicted_matched_tokens: Option<u32>,
    /// Request body bytes.
    pub request_bytes: usize,
    /// Response body bytes sent to the client.
    pub response_bytes: usize,
    /// From the request's arrival to its end, ms.
    pub duration_ms: f64,
    /// From arrival to the routing decision, ms (the wait for the routing pool included).
    pub decision_ms: Option<f64>,
    /// From arrival to the first response body byte, ms.
    pub ttft_ms: Option<f64>,
    /// A gateway-side error (the error type of a gateway answer, or what failed upstream).
    pub error: Option<&'a str>,
    /// The line of a background response's run (`crate::background`), written when it ends;
    /// the request that was answered `queued` has its own line. Absent on other lines.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub background: bool,
}

impl<'a> AccessRecord<'a> {
    /// The line of the request `ctx`, which ends now: what it read and where it went, its
    /// timings from its arrival.
    pub(crate) fn of(
        ctx: &'a crate::request::RequestCtx,
        listener: Option<&'a str>,
        method: &'a str,
        path: &'a str,
        client: Option<String>,
        response_bytes: usize,
    ) -> AccessRecord<'a> {
        let ms = |d: std::time::Duration| d.as_secs_f64() * 1e3;
        let since = |t: Option<std::time::Instant>| ctx.started.zip(t).map(|(s, t)| ms(t - s));
        AccessRecord {
            at_ms: receipts::now_ms(),
            request_id: &ctx.request_id,
            client_request_id: ctx.client_request_id.as_deref(),
            client,
            listener,
            method,
            path,
            model: ctx.model.as_deref(),
            service: ctx.service.as_ref().map(|s| s.name()),
            tenant: ctx.tenant.as_ref().map(|t| t.id.0.as_str()),
            status: ctx.status.unwrap_or(0),
            worker: ctx.current.as_ref().map(|w| w.0.as_str()),
            attempts: ctx.attempts,
            refused_retries: ctx.refusals,
            route_reason: ctx.decision.as_ref().map(|d| d.reason.as_str()),
            rules_version: ctx.view.as_ref().map(|v| v.version()),
            prompt_tokens: ctx
                .decision
                .as_ref()
                .and_then(|d| d.prompt.as_ref())
                .map(|p| p.prompt_tokens),
            predicted_matched_tokens: ctx
                .ticket
                .as_ref()
                .and_then(|t| t.ticket_unverified().predicted_matched_tokens),
            request_bytes: ctx.body.len(),
            response_bytes,
            duration_ms: ctx.started.map_or(0.0, |s| ms(s.elapsed())),
            decision_ms: since(ctx.decision_done),
            ttft_ms: since(ctx.first_byte),
            error: ctx.error.as_deref(),
            background: ctx.job.is_some(),
        }
    }
}

/// An open access log: the queue's sending end and the writer thread.
pub struct AccessLog {
    tx: Option<SyncSender<Vec<u8>>>,
    writer: Option<JoinHandle<()>>,
    dropped: Counter,
}

impl AccessLog {
    /// Opens `target` (a file is created if missing, and appended to) and starts the writer
    /// thread; `dropped` counts lines the full queue turned away.
    pub fn open(target: &AccessLogTarget, dropped: Counter) -> std::io::Result<AccessLog> {
        let out: Box<dyn Write + Send> = match target {
            AccessLogTarget::Stdout => Box::new(std::io::stdout()),
            AccessLogTarget::File(p) => Box::new(
                std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(p)?,
            ),
        };
        let (tx, rx) = std::sync::mpsc::sync_channel(QUEUE_LINES);
        let writer = std::thread::Builder::new()
            .name("kvgate-access-log".into())
            .spawn(move || write_lines(rx, out))?;
        Ok(AccessLog {
            tx: Some(tx),
            writer: Some(writer),
            dropped,
        })
    }

    /// Queues one record; `false` when the queue was full (the line is dropped and counted).
    pub fn append(&self, record: &AccessRecord<'_>) -> bool {
        let Ok(mut line) = serde_json::to_vec(record) else {
            return false;
        };
        line.push(b'\n');
        match self.tx.as_ref().map(|tx| tx.try_send(line)) {
            Some(Ok(())) => true,
            Some(Err(TrySendError::Full(_))) | Some(Err(TrySendError::Disconnected(_))) | None => {
                self.dropped.inc();
                false
            }
        }
    }
}

impl Drop for AccessLog {
    /// Closes the queue; the writer writes what is queued, flushes and ends.
    fn drop(&mut self) {
        self.tx = None;
        if let Some(w) = self.writer.take() {
            let _ = w.join();
        }
    }
}

/// The writer thread: a batch per wake-up, flushed when the queue is empty.
fn write_lines(rx: Receiver<Vec<u8>>, out: Box<dyn Write + Send>) {
    let mut out = std::io::BufWriter::with_capacity(64 * 1024, out);
    let mut failed = false;
    let report = |e: std::io::Error, failed: &mut bool| {
        // Once per run of failures: a full disk must not flood the log.
        if !*failed {
            tracing::warn!(error = %e, "access log write failed; lines are lost until it works again");
        }
        *failed = true;
    };
    while let Ok(first) = rx.recv() {
        let mut batch = Some(first);
        while let Some(line) = batch.take().or_else(|| rx.try_recv().ok()) {
            if let Err(e) = out.write_all(&line) {
                report(e, &mut failed);
            }
        }
        match out.flush() {
            Ok(()) => failed = false,
            Err(e) => report(e, &mut failed),
        }
    }
    let _ = out.flush();
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(id: &str) -> AccessRecord<'_> {
        AccessRecord {
            at_ms: 1,
            request_id: id,
            client_request_id: None,
            client: None,
            listener: None,
            method: "POST",
            path: "/v1/chat/completions",
            model: Some("smol"),
            service: Some("chat"),
            tenant: None,
            status: 200,
            worker: Some("w1"),
            attempts: 1,
            refused_retries: 0,
            route_reason: Some("hit"),
            rules_version: Some(3),
            prompt_tokens: Some(40),
            predicted_matched_tokens: Some(32),
            request_bytes: 100,
            response_bytes: 200,
            duration_ms: 12.5,
            decision_ms: Some(0.2),
            ttft_ms: Some(4.0),
            error: None,
            background: false,
        }
    }

    #[test]
    fn every_queued_line_is_written_by_the_time_the_log_is_dropped() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("access.jsonl");
        std::fs::write(&path, "an earlier line\n").unwrap();
        let dropped = Counter::default();
        let log = AccessLog::open(&AccessLogTarget::File(path.clone()), dropped.clone()).unwrap();
        for i in 0..1000 {
            assert!(log.append(&record(&format!("r{i}"))));
        }
        drop(log);
        let text = std::fs::read_to_string(&path).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 1001, "appended after the earlier line");
        assert_eq!(lines[0], "an earlier line");
        let last: serde_json::Value = serde_json::from_str(lines[1000]).unwrap();
        assert_eq!(last["request_id"], "r999");
        assert_eq!(last["route_reason"], "hit");
        assert_eq!(dropped.get(), 0);
    }

    #[test]
    fn a_full_queue_drops_and_counts_instead_of_waiting() {
        // A writer that never finishes its first write: the queue fills, then lines are
        // dropped at once.
        struct Stuck(std::sync::mpsc::Receiver<()>);
        impl Write for Stuck {
            fn write(&mut self, _: &[u8]) -> std::io::Result<usize> {
                let _ = self.0.recv();
                Err(std::io::Error::other("released"))
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let (release, stuck) = std::sync::mpsc::channel();
        let (tx, rx) = std::sync::mpsc::sync_channel(QUEUE_LINES);
        let writer = std::thread::spawn(move || {
            // The buffer fills after ~100 lines; its flush then blocks on the stuck writer.
            let out = Box::new(Stuck(stuck));
            write_lines(rx, out)
        });
        let dropped = Counter::default();
        let log = AccessLog {
            tx: Some(tx),
            writer: Some(writer),
            dropped: dropped.clone(),
        };
        let started = std::time::Instant::now();
        let mut refused = 0;
        for i in 0..(QUEUE_LINES + 200_000) {
            if !log.append(&record(&format!("r{i}"))) {
                refused += 1;
            }
        }
        assert!(refused > 0, "nothing dropped");
        assert_eq!(dropped.get(), refused as u64);
        assert!(started.elapsed() < std::time::Duration::from_secs(30));
        drop(release);
        drop(log);
    }
}
