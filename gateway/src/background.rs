//! Background responses: the Responses API's `background: true` (docs/gateway.md, "Background
//! responses").
//!
//! The gateway answers such a request at once with its `response` object in status `queued`,
//! stored under the id the worker will give its answer (`resp_<request id>`), and runs the
//! request itself: the same decision, ticket and forwarding as any request
//! ([`crate::forward::forward`]), into a [`Collector`] instead of a client connection. The
//! stored record moves from `queued` to `in_progress` when the request is sent, then to the
//! worker's answer (`completed` / `incomplete`), or to `failed` (with an `error`), or to
//! `cancelled` (`POST /v1/responses/{id}/cancel`: the request to the worker is dropped, which
//! closes its connection, and the worker stops generating).
//!
//! Exactly one final state is written, whichever comes first ([`Job::end`]): a cancel that
//! loses to the answer returns the answer, and an answer that loses to a cancel is not stored,
//! so a cancelled response never turns `completed` later.
//!
//! The jobs are owned by [`BackgroundJobs`] (in the data plane): bounded in number
//! (`--max-background-responses`); each holds its request's drain guard and tenant slot, so a
//! drain waits for them and a tenant's `max_concurrent_requests` counts them. Those still running
//! when the gateway stops are recorded `failed` ([`BackgroundJobs::abandon`]).

use std::collections::HashMap;
use std::sync::Arc;

use async_trait::async_trait;
use bytes::Bytes;
use parking_lot::Mutex;
use pingora::http::{RequestHeader, ResponseHeader};
use pingora::Result;
use serde_json::{json, Value};
use tokio_util::sync::CancellationToken;

use crate::data_plane::DataPlane;
use crate::error::GatewayError;
use crate::event_log::{EventLog, Read};
use crate::forward::Downstream;
use crate::request::RequestCtx;
use crate::response_store::{self, SharedTurns, StoredResponse};

/// Default `--max-background-responses`.
pub const DEFAULT_MAX_JOBS: usize = 256;

/// How long a cancel through a replica that does not run the response waits for the one that
/// does to record it (cluster mode).
pub const CANCEL_WAIT: std::time::Duration = std::time::Duration::from_secs(1);

/// The most of a failed answer's body read for its error.
const ERROR_BODY_CAP: usize = 16 << 10;

/// One background response being run.
pub struct Job {
    /// The record as it was accepted (`queued`, as stored): the next states are written from it.
    pending: Arc<StoredResponse>,
    /// `false` once a final state was written.
    running: Mutex<bool>,
    cancel: CancellationToken,
    /// A streamed one's events (`stream: true`).
    events: Option<EventLog>,
}

impl Job {
    /// The response id.
    pub fn id(&self) -> &str {
        &self.pending.id
    }

    /// A streamed one's events.
    pub fn events(&self) -> Option<&EventLog> {
        self.events.as_ref()
    }

    /// Writes a final state with `write` when none was written yet; whether it did.
    pub fn end(&self, write: impl FnOnce()) -> bool {
        let mut running = self.running.lock();
        if !*running {
            return false;
        }
        *running = false;
        write();
        true
    }

    /// The record in status `status`, `error` set when given.
    fn record(&self, status: &str, error: Option<Value>) -> StoredResponse {
        moved(&self.pending, status, error)
    }
}

/// `r` in status `status`, `error` set when given.
fn moved(r: &StoredResponse, status: &str, error: Option<Value>) -> StoredResponse {
    let mut response = r.response.clone();
    // A record read from a file or Redis is whatever was there: only an object moves on.
    if let Value::Object(o) = &mut response {
        o.insert("status".into(), json!(status));
        if let Some(e) = error {
            o.insert("error".into(), e);
        }
    }
    r.with_response(response)
}

/// The `error` of a background response whose gateway stopped before it ended.
fn stopped_error() -> Value {
    json!({"code": "server_error",
           "message": "the gateway stopped before this background response finished"})
}

/// A record whose gateway is gone — read back from a saved store (`--response-store-file`), or
/// in cluster mode run by a replica whose lease lapsed: one still `queued` or `in_progress`
/// was running when its gateway stopped, and is `failed`; any other as it was.
pub fn interrupted(r: StoredResponse) -> StoredResponse {
    if r.running() {
        moved(&r, "failed", Some(stopped_error()))
    } else {
        r
    }
}

/// The background responses this gateway runs.
pub struct BackgroundJobs {
    jobs: Mutex<HashMap<String, Arc<Job>>>,
    limit: usize,
    /// Streamed jobs that ended, newest last, with when: their events stay readable a while
    /// ([`ENDED_STREAMS_KEPT_FOR`], at most [`ENDED_STREAMS_KEPT`] of them and
    /// [`ENDED_STREAM_BYTES`] of events).
    ended: Mutex<std::collections::VecDeque<(Arc<Job>, std::time::Instant)>>,
}

/// How long a streamed background response's events stay readable after it ended.
pub const ENDED_STREAMS_KEPT_FOR: std::time::Duration = std::time::Duration::from_secs(300);
/// Ended streams kept, at most.
pub const ENDED_STREAMS_KEPT: usize = 64;
/// Bytes of events of ended streams kept, at most.
pub const ENDED_STREAM_BYTES: usize = 64 << 20;

impl BackgroundJobs {
    /// At most `limit` at once (0: background requests are refused).
    pub fn new(limit: usize) -> BackgroundJobs {
        BackgroundJobs {
            jobs: Mutex::new(HashMap::new()),
            limit,
            ended: Mutex::new(std::collections::VecDeque::new()),
        }
    }

    /// The events of the streamed background response `id`: while it runs here, and for
    /// [`ENDED_STREAMS_KEPT_FOR`] after it ended (while kept).
    pub fn stream_of(&self, id: &str) -> Option<Arc<Job>> {
        if let Some(job) = self.get(id).filter(|j| j.events().is_some()) {
            return Some(job);
        }
        let mut ended = self.ended.lock();
        prune(&mut ended, std::time::Instant::now());
        ended
            .iter()
            .find(|(j, _)| j.id() == id)
            .map(|(j, _)| j.clone())
    }

    /// The ids of those running now.
    pub fn ids(&self) -> Vec<String> {
        self.jobs.lock().keys().cloned().collect()
    }

    /// How many run now.
    pub fn len(&self) -> usize {
        self.jobs.lock().len()
    }

    /// Whether none runs.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Registers the job of the accepted record `pending` (`streamed`: its events are kept);
    /// `TooManyBackground` at the limit.
    pub fn start(
        &self,
        pending: Arc<StoredResponse>,
        streamed: bool,
    ) -> Result<Arc<Job>, GatewayError> {
        let mut jobs = self.jobs.lock();
        if jobs.len() >= self.limit {
            return Err(GatewayError::TooManyBackground { limit: self.limit });
        }
        let job = Arc::new(Job {
            pending,
            running: Mutex::new(true),
            cancel: CancellationToken::new(),
            events: streamed.then(EventLog::default),
        });
        jobs.insert(job.id().to_owned(), job.clone());
        Ok(job)
    }

    /// The running job of `id`, when this gateway runs it.
    pub fn get(&self, id: &str) -> Option<Arc<Job>> {
        self.jobs.lock().get(id).cloned()
    }

    fn finished(&self, id: &str) {
        let Some(job) = self.jobs.lock().remove(id) else {
            return;
        };
        if job.events().is_some() {
            let mut ended = self.ended.lock();
            let now = std::time::Instant::now();
            ended.push_back((job, now));
            prune(&mut ended, now);
        }
    }

    /// Cancels the job of `id` when this gateway runs it and it has not ended: records it
    /// `cancelled` and stops its request. Whether it did.
    pub fn cancel(&self, data: &DataPlane, id: &str) -> bool {
        let Some(job) = self.get(id) else {
            return false;
        };
        let done = job.end(|| keep(data, job.record("cancelled", None)));
        if done {
            ended(data, "cancelled");
        }
        job.cancel.cancel();
        end_stream(data, &job);
        done
    }

    /// At a stop: every job still running is recorded `failed` (its request is dropped with
    /// the runtime).
    pub fn abandon(&self, data: &DataPlane) {
        let jobs: Vec<Arc<Job>> = self.jobs.lock().drain().map(|(_, j)| j).collect();
        for job in jobs {
            if job.end(|| keep(data, job.record("failed", Some(stopped_error())))) {
                ended(data, "failed");
            }
            job.cancel.cancel();
            end_stream(data, &job);
        }
    }
}

/// Ends a streamed job's log, here and (cluster mode) in its mirror, once.
fn end_stream(data: &DataPlane, job: &Job) {
    let Some(log) = job.events() else { return };
    if log.end() {
        if let Some(shared) = data.shared_turns() {
            shared.publish_events(job.id(), log.next_number(), Vec::new(), true);
        }
    }
}

/// Mirrors `job`'s events from `from` on (cluster mode).
fn mirror(shared: Option<&dyn SharedTurns>, job: &Job, from: u64) {
    if let (Some(shared), Some(log)) = (shared, job.events()) {
        let events = log.texts_from(from);
        if !events.is_empty() {
            shared.publish_events(job.id(), from, events, false);
        }
    }
}

/// Counts a background response ended `status`.
fn ended(data: &DataPlane, status: &str) {
    data.metrics
        .background_responses_ended
        .get_or_create(&crate::metrics::BackgroundLabels {
            status: status.to_owned(),
        })
        .inc();
}

/// Drops the ended streams past their time, beyond their number and beyond their bytes,
/// oldest first.
fn prune(
    ended: &mut std::collections::VecDeque<(Arc<Job>, std::time::Instant)>,
    now: std::time::Instant,
) {
    let bytes = |e: &std::collections::VecDeque<(Arc<Job>, std::time::Instant)>| -> usize {
        e.iter()
            .filter_map(|(j, _)| j.events().map(EventLog::bytes))
            .sum()
    };
    while let Some((_, at)) = ended.front() {
        let old = now.saturating_duration_since(*at) >= ENDED_STREAMS_KEPT_FOR;
        if old || ended.len() > ENDED_STREAMS_KEPT || bytes(ended) > ENDED_STREAM_BYTES {
            ended.pop_front();
        } else {
            break;
        }
    }
}

fn keep(data: &DataPlane, turn: StoredResponse) {
    let shared = data.shared_turns();
    response_store::keep(&data.responses, shared.as_deref(), turn);
}

/// The `response` object a background request is answered with at once (status `queued`):
/// the request's fields as the worker's answer will repeat them
/// (`prompt_profile::echoed_fields`), no output yet.
pub fn queued_response(
    id: &str,
    model: Option<&str>,
    body: &[u8],
    stored: &prompt_profile::Stored,
    created_at: u64,
) -> Value {
    let mut r = json!({
        "id": id,
        "object": "response",
        "created_at": created_at,
        "model": model,
        "output": [],
        "error": null,
        "incomplete_details": null,
        "status": "queued",
        "usage": null,
    });
    if let Value::Object(o) = &mut r {
        o.extend(prompt_profile::echoed_fields(body, Some(stored)));
    }
    r
}

/// The answer of a background request, read where a client connection would be: its status,
/// and of an answer other than 200 the start of its body (for the `error` recorded).
pub(crate) struct Collector {
    head: RequestHeader,
    /// Bytes of the worker's answer read.
    read: usize,
    status: Option<u16>,
    error: Option<Value>,
    body: Vec<u8>,
    /// A streamed response's job: a 200's events go to its log.
    job: Option<Arc<Job>>,
    /// Cluster mode: where its events are mirrored.
    shared: Option<Arc<dyn SharedTurns>>,
}

impl Collector {
    /// For the request `head` of `job`, mirroring its events to `shared`.
    pub(crate) fn new(
        head: RequestHeader,
        job: Option<Arc<Job>>,
        shared: Option<Arc<dyn SharedTurns>>,
    ) -> Collector {
        Collector {
            head,
            read: 0,
            status: None,
            error: None,
            body: Vec::new(),
            job,
            shared,
        }
    }

    /// The `error` of a request that gave no storable answer: the gateway's own error, the
    /// worker's error object, or what went wrong with a 200.
    fn failure(&self, ctx: &RequestCtx) -> Value {
        if let Some(e) = &self.error {
            return e.clone();
        }
        match self.status {
            Some(200) => json!({"code": "server_error", "message": match &ctx.error {
                Some(e) => format!("the worker's answer was cut short ({e})"),
                None => "the worker's answer was not a response this gateway could store \
                         (larger than a stored turn may be, or not a response object)".to_owned(),
            }}),
            Some(s) => {
                let worker: Option<Value> = serde_json::from_slice(&self.body).ok();
                let e = worker.as_ref().map(|w| &w["error"]);
                json!({
                    "code": e.and_then(|e| e["code"].as_str()).unwrap_or("server_error"),
                    "message": e.and_then(|e| e["message"].as_str()).map_or_else(
                        || format!("the worker answered {s}"), str::to_owned),
                })
            }
            None => json!({"code": "server_error", "message": "no worker answered"}),
        }
    }
}

#[async_trait]
impl Downstream for Collector {
    fn request_head(&self) -> &RequestHeader {
        &self.head
    }

    async fn fail(&mut self, ctx: &mut RequestCtx, err: &GatewayError) -> Result<()> {
        ctx.error = Some(err.error_type().to_owned());
        ctx.status = Some(err.status());
        self.status = Some(err.status());
        self.error = Some(json!({"code": err.error_type(), "message": err.to_string()}));
        Ok(())
    }

    async fn head(&mut self, resp: ResponseHeader) -> Result<()> {
        self.status = Some(resp.status.as_u16());
        Ok(())
    }

    async fn body(&mut self, chunk: Bytes, _end: bool) -> Result<()> {
        self.read += chunk.len();
        if self.status == Some(200) {
            if let Some(job) = &self.job {
                if let Some(log) = job.events() {
                    let from = log.next_number();
                    log.feed(&chunk);
                    mirror(self.shared.as_deref(), job, from);
                }
            }
        } else if self.body.len() + chunk.len() <= ERROR_BODY_CAP {
            self.body.extend_from_slice(&chunk);
        }
        Ok(())
    }
}

/// Where the request of a background response arrived (for its access log line).
pub(crate) struct Origin {
    /// The named listener (`None`: the VIP).
    pub listener: Option<Arc<str>>,
    /// The client's address.
    pub client: Option<String>,
}

/// Runs the accepted background request of `ctx` (its decision taken, `ctx.job` set) to its
/// end: `in_progress`, then the answer, `failed` or `cancelled`; then the request's
/// bookkeeping (metrics, decision log, its access log line) as for any request.
pub(crate) async fn run(
    data: Arc<DataPlane>,
    head: RequestHeader,
    origin: Origin,
    mut ctx: RequestCtx,
    job: Arc<Job>,
) {
    {
        let running = job.running.lock();
        if *running {
            keep(&data, job.record("in_progress", None));
        }
    }
    let mut out = Collector::new(head, Some(job.clone()), data.shared_turns());
    let cancelled = tokio::select! {
        biased;
        _ = job.cancel.cancelled() => true,
        r = crate::forward::forward(&data, &mut out, &mut ctx) => {
            if let Err(e) = r {
                ctx.error.get_or_insert_with(|| format!("upstream_error: {}", e.etype().as_str()));
            }
            false
        }
    };
    if cancelled {
        // Recorded by whoever cancelled; the worker's request was dropped with its connection.
        ctx.status = Some(499);
        ctx.error = Some("cancelled".into());
        ctx.capture = None;
    } else {
        let failed = job.record("failed", Some(out.failure(&ctx)));
        let event = job.events().map(|log| {
            let last = json!({"type": "response.failed", "sequence_number": log.next_number(),
                              "response": failed.retrieved()});
            last_event("response.failed", &last)
        });
        if job.end(|| keep(&data, failed)) {
            ended(&data, "failed");
            if let (Some(log), Some(e)) = (job.events(), event) {
                let from = log.next_number();
                log.push(e);
                mirror(out.shared.as_deref(), &job, from);
            }
        } else if let Some(r) = data.responses.peek(job.id()) {
            // Ended by its answer (or a cancel that came first, counted there).
            if r.status() != "cancelled" {
                ended(&data, r.status());
            }
        }
    }
    // Out of the running jobs (a streamed one among the ended streams kept) before its stream
    // ends, so a resume from then on reads the ended log or the record.
    data.background.finished(job.id());
    end_stream(&data, &job);
    data.finish_request(&mut ctx);
    if let Some(log) = &data.access {
        let path = out.head.uri.path_and_query().map_or("", |p| p.as_str());
        log.append(&crate::access_log::AccessRecord::of(
            &ctx,
            origin.listener.as_deref(),
            out.head.method.as_str(),
            path,
            origin.client,
            out.read,
        ));
    }
}

/// A `GET /v1/responses/{id}` query's stream: `Ok(None)` without `stream=true`, else the
/// sequence number to start from (`starting_after` + 1, or 0); a `starting_after` that is not
/// a number → 400 `invalid_value`. Other parameters are ignored.
pub fn stream_query(query: Option<&str>) -> Result<Option<u64>, GatewayError> {
    let (mut stream, mut after) = (false, None);
    for (k, v) in query
        .unwrap_or("")
        .split('&')
        .filter_map(|kv| kv.split_once('='))
    {
        match k {
            "stream" => stream = v == "true",
            "starting_after" => {
                let n = v
                    .parse::<u64>()
                    .ok()
                    .filter(|n| *n < u64::MAX)
                    .ok_or_else(|| {
                        GatewayError::Body(prompt_profile::BodyError {
                            code: "invalid_value",
                            param: Some("starting_after".into()),
                            message: "`starting_after` must be an event's sequence number".into(),
                        })
                    })?;
                after = Some(n);
            }
            _ => {}
        }
    }
    Ok(stream.then(|| after.map_or(0, |n| n + 1)))
}

/// One SSE event: `event: <kind>`, then `data: <json>`.
fn last_event(kind: &str, data: &Value) -> Bytes {
    Bytes::from(format!("event: {kind}\ndata: {data}\n\n"))
}

/// The event that ends a stream of the finished record `r` (`response.completed`,
/// `response.incomplete` or `response.failed`, numbered `number`); `None` for one cancelled
/// (the Responses API has no event for it: the stream just ends) or still running.
pub fn final_event(r: &StoredResponse, number: u64) -> Option<Bytes> {
    let kind = match r.status() {
        "completed" => "response.completed",
        "incomplete" => "response.incomplete",
        "failed" => "response.failed",
        _ => return None,
    };
    let data = json!({"type": kind, "sequence_number": number, "response": r.retrieved()});
    Some(last_event(kind, &data))
}

/// How often a stream that waits sends an SSE comment, so that a proxy keeps it open and a
/// client gone is noticed.
const KEEP_ALIVE: std::time::Duration = std::time::Duration::from_secs(15);

/// Sends an SSE comment; whether the client is still there.
async fn keep_alive(session: &mut pingora::prelude::Session) -> bool {
    let ping = Bytes::from_static(b": keep-alive\n\n");
    session.write_response_body(Some(ping), false).await.is_ok()
}

/// Starts an SSE answer of the gateway's own (status 200).
async fn stream_head(session: &mut pingora::prelude::Session, ctx: &mut RequestCtx) -> Result<()> {
    let mut resp = ResponseHeader::build(200, Some(4))?;
    resp.insert_header("content-type", "text/event-stream")?;
    resp.insert_header("cache-control", "no-cache")?;
    resp.insert_header("transfer-encoding", "chunked")?;
    resp.insert_header("x-request-id", ctx.request_id.as_str())?;
    ctx.status = Some(200);
    session.write_response_header(Box::new(resp), false).await
}

/// Streams `log`'s events from sequence number `from` to the client, as they come, until the
/// log ends or the client goes (the job goes on either way). A resume from before the oldest
/// event kept gets an `error` event (`code` `stream_events_gone`).
pub(crate) async fn stream(
    session: &mut pingora::prelude::Session,
    ctx: &mut RequestCtx,
    log: &EventLog,
    from: u64,
) -> Result<bool> {
    stream_head(session, ctx).await?;
    let mut rx = log.subscribe();
    let mut next = from;
    loop {
        rx.borrow_and_update();
        match log.read(next) {
            Read::Gone(first) => {
                let _ = session
                    .write_response_body(Some(events_gone(first, next)), false)
                    .await;
                break;
            }
            Read::Events(events, ended) => {
                for e in events {
                    next += 1;
                    if session.write_response_body(Some(e), false).await.is_err() {
                        return Ok(true);
                    }
                }
                if ended {
                    break;
                }
            }
        }
        match tokio::time::timeout(KEEP_ALIVE, rx.changed()).await {
            Ok(Ok(())) => {}
            Ok(Err(_)) => break,
            Err(_) => {
                if !keep_alive(session).await {
                    return Ok(true);
                }
            }
        }
    }
    let _ = session.write_response_body(Some(Bytes::new()), true).await;
    Ok(true)
}

/// The `error` event of a resume from `next`, before the oldest event kept (`first`).
fn events_gone(first: u64, next: u64) -> Bytes {
    let e = json!({"type": "error", "code": "stream_events_gone", "param": "starting_after",
        "message": format!("events before {first} are no longer kept: retrieve the response instead"),
        "sequence_number": next});
    last_event("error", &e)
}

/// A stream of a background response whose events this gateway does not hold (it ended and
/// its events are no longer kept, it was not streamed, or another replica runs it).
///
/// With a `mirror` (cluster mode: the events the running replica mirrors in the shared store,
/// `P:events:<id>`): every event from `from` on, read every 100 ms as they are mirrored, until
/// the end marker; a cursor before the oldest entry kept gets an `error` event
/// (`stream_events_gone`). When there are no events to read, `poll` (the record) is read with
/// keep-alive comments until the response has ended — three reads in a row with a mirror, whose
/// last events may still be on their way; one without, polled every 250 ms — and its final
/// event (numbered as the next event) ends the stream.
pub(crate) async fn stream_elsewhere<F, Fut>(
    session: &mut pingora::prelude::Session,
    ctx: &mut RequestCtx,
    mirror: Option<Arc<dyn SharedTurns>>,
    id: &str,
    from: u64,
    mut poll: F,
) -> Result<bool>
where
    F: FnMut() -> Fut + Send,
    Fut: std::future::Future<Output = Option<Arc<StoredResponse>>> + Send,
{
    use cluster::StreamEntry;
    let (pause, ended_reads_needed) = match mirror {
        Some(_) => (std::time::Duration::from_millis(100), 3),
        None => (std::time::Duration::from_millis(250), 1),
    };
    stream_head(session, ctx).await?;
    let (mut next, mut quiet, mut ended_reads) = (from, std::time::Instant::now(), 0);
    loop {
        let entries = match &mirror {
            Some(m) => m.events_from(id, next).await.unwrap_or_default(),
            None => Vec::new(),
        };
        let first = entries.first().map(|e| match e {
            StreamEntry::Event(n, _) | StreamEntry::End(n) => *n,
        });
        if let Some(first) = first.filter(|&n| n > next) {
            let _ = session
                .write_response_body(Some(events_gone(first, next)), false)
                .await;
            break;
        }
        let got = !entries.is_empty();
        let mut ended = false;
        for e in entries {
            match e {
                StreamEntry::Event(n, text) => {
                    next = n + 1;
                    let chunk = Bytes::from(text);
                    if session
                        .write_response_body(Some(chunk), false)
                        .await
                        .is_err()
                    {
                        return Ok(true);
                    }
                }
                StreamEntry::End(_) => ended = true,
            }
        }
        if ended {
            break;
        }
        if got {
            quiet = std::time::Instant::now();
            continue;
        }
        match poll().await {
            None => break,
            Some(r) if !r.running() => {
                ended_reads += 1;
                if ended_reads >= ended_reads_needed {
                    if let Some(e) = final_event(&r, next) {
                        let _ = session.write_response_body(Some(e), false).await;
                    }
                    break;
                }
            }
            Some(_) => {}
        }
        if quiet.elapsed() >= KEEP_ALIVE {
            quiet = std::time::Instant::now();
            if !keep_alive(session).await {
                return Ok(true);
            }
        }
        tokio::time::sleep(pause).await;
    }
    let _ = session.write_response_body(Some(Bytes::new()), true).await;
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pending(id: &str) -> Arc<StoredResponse> {
        let stored = prompt_profile::Stored {
            store: true,
            background: true,
            previous_response_id: None,
            conversation: None,
        };
        let r = queued_response(
            id,
            Some("m"),
            br#"{"input":"x","temperature":0.2}"#,
            &stored,
            7,
        );
        Arc::new(StoredResponse::new(
            id.into(),
            None,
            Vec::new(),
            Vec::new(),
            r,
        ))
    }

    #[test]
    fn a_queued_response_repeats_the_request_and_says_background() {
        let r = pending("resp_1").response.clone();
        assert_eq!(r["status"], "queued");
        assert_eq!(r["background"], true);
        assert_eq!(r["store"], true);
        assert_eq!(r["temperature"], 0.2);
        assert_eq!(r["model"], "m");
        assert_eq!(r["output"], json!([]));
        assert_eq!(r["created_at"], 7);
    }

    #[test]
    fn one_final_state_is_written_whichever_comes_first() {
        let jobs = BackgroundJobs::new(2);
        let job = jobs.start(pending("resp_a"), false).unwrap();
        let mut written = Vec::new();
        assert!(job.end(|| written.push("completed")));
        assert!(!job.end(|| written.push("cancelled")));
        assert_eq!(written, ["completed"]);
        let r = job.record("failed", Some(json!({"code": "x"})));
        assert_eq!(
            (r.status(), &r.response["error"]["code"]),
            ("failed", &json!("x"))
        );
        assert!(r.background() && !r.continuable() && !r.running());
    }

    #[test]
    fn a_record_read_back_running_failed_with_its_gateway() {
        let r = interrupted(moved(&pending("resp_r"), "in_progress", None));
        assert_eq!(r.status(), "failed");
        assert_eq!(r.response["error"]["code"], "server_error");
        let done = interrupted(moved(&pending("resp_r"), "completed", None));
        assert_eq!(
            (done.status(), &done.response["error"]),
            ("completed", &Value::Null)
        );
    }

    #[test]
    fn ended_streams_stay_readable_within_their_bounds() {
        let jobs = BackgroundJobs::new(ENDED_STREAMS_KEPT + 8);
        for i in 0..ENDED_STREAMS_KEPT + 2 {
            let id = format!("resp_{i}");
            jobs.start(pending(&id), true).unwrap();
            jobs.start(pending(&format!("{id}_quiet")), false).unwrap();
            jobs.finished(&id);
            jobs.finished(&format!("{id}_quiet"));
        }
        assert!(jobs.is_empty());
        // The oldest went beyond the number kept; a job without a stream is not kept.
        assert!(jobs.stream_of("resp_0").is_none() && jobs.stream_of("resp_1").is_none());
        assert!(jobs.stream_of("resp_2").is_some());
        assert!(jobs.stream_of("resp_3_quiet").is_none());
        // Beyond their time.
        let mut ended = jobs.ended.lock();
        let later = std::time::Instant::now() + ENDED_STREAMS_KEPT_FOR;
        prune(&mut ended, later);
        assert!(ended.is_empty());
    }

    #[test]
    fn the_stream_query_reads_the_cursor() {
        assert_eq!(stream_query(None).unwrap(), None);
        assert_eq!(
            stream_query(Some("stream=false&starting_after=3")).unwrap(),
            None
        );
        assert_eq!(stream_query(Some("stream=true")).unwrap(), Some(0));
        assert_eq!(
            stream_query(Some("starting_after=41&stream=true&x=y")).unwrap(),
            Some(42)
        );
        for bad in [
            "stream=true&starting_after=-1",
            "stream=true&starting_after=a",
        ] {
            let e = stream_query(Some(bad)).unwrap_err();
            assert_eq!(
                (e.error_type(), e.status()),
                ("invalid_value", 400),
                "{bad}"
            );
        }
    }

    #[test]
    fn jobs_are_bounded_and_leave_when_finished() {
        let jobs = BackgroundJobs::new(1);
        jobs.start(pending("resp_a"), false).unwrap();
        let e = jobs.start(pending("resp_b"), false).err().unwrap();
        assert_eq!(
            (e.error_type(), e.status()),
            ("too_many_background_responses", 429)
        );
        jobs.finished("resp_a");
        assert!(jobs.is_empty());
        assert!(jobs.start(pending("resp_b"), false).is_ok());
        assert!(jobs.get("resp_b").is_some() && jobs.get("resp_a").is_none());
    }

    #[test]
    fn a_failure_names_what_failed() {
        let c = |status: Option<u16>, body: &[u8]| Collector {
            head: RequestHeader::build("POST", b"/v1/responses", None).unwrap(),
            read: 0,
            status,
            error: None,
            body: body.to_vec(),
            job: None,
            shared: None,
        };
        let ctx = RequestCtx::default();
        let e = c(
            Some(400),
            br#"{"error":{"code":"invalid_value","message":"bad temperature"}}"#,
        )
        .failure(&ctx);
        assert_eq!(
            e,
            json!({"code": "invalid_value", "message": "bad temperature"})
        );
        let e = c(Some(502), b"<html>").failure(&ctx);
        assert_eq!(e["code"], "server_error");
        assert!(e["message"].as_str().unwrap().contains("502"));
        let e = c(Some(200), b"").failure(&ctx);
        assert!(e["message"].as_str().unwrap().contains("not a response"));
        let e = c(None, b"").failure(&ctx);
        assert_eq!(e["message"], "no worker answered");
    }
}
