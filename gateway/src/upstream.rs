//! What both forwarding paths (pingora's proxy loop in [`crate::proxy`] and the >64 KiB path in
//! [`crate::forward`]) do the same way: the peer of a worker, the start of an attempt (in-flight
//! count, the ticket signed for the worker actually used), the request head sent upstream, the
//! decoration of the worker's response head, passive health from its status, and whether a
//! worker's refusal goes to the next candidate.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use pingora::http::{RequestHeader, ResponseHeader};
use pingora::prelude::HttpPeer;
use pingora::utils::tls::CertKey;
use pingora::{Error, ErrorType, Result};
use prefix_index::{NamespaceSeed, WorkerId};
use receipts::{RouteTicket, SignedTicket, TICKET_HEADER};
use routing_rules::schema::UpstreamSpec;
use serde_json::Value;

use crate::data_plane::DataPlane;
use crate::request::{
    RequestCtx, CLIENT_REQUEST_ID_HEADER, REASON_HEADER, RECEIPT_HEADER, VERSION_HEADER,
    WORKER_HEADER,
};
use crate::view::{InFlight, Upstream, WorkerEntry};

/// The pingora peer for a worker, with the service's timeouts; for an `https://` worker TLS
/// with the URL's host as SNI and verified name (pingora skips verification without an SNI, so
/// one is always set) and the gateway's client certificate when it has one.
pub fn peer_for(
    upstream: &Upstream,
    spec: &UpstreamSpec,
    identity: Option<&Arc<CertKey>>,
) -> HttpPeer {
    let mut peer = HttpPeer::new(upstream.addr, upstream.tls, upstream.host.clone());
    if upstream.tls {
        peer.client_cert_key = identity.cloned();
    }
    peer.options.connection_timeout = Some(Duration::from_millis(spec.connect_timeout_ms));
    peer.options.read_timeout = Some(Duration::from_millis(spec.read_timeout_ms));
    peer.options.idle_timeout = Some(Duration::from_millis(spec.idle_timeout_ms));
    peer.options.write_timeout = Some(Duration::from_millis(spec.read_timeout_ms));
    peer
}

/// Starts an attempt on `worker`: records it as the current one, counts it in flight and signs
/// the ticket for it (kept in the ctx for the decision log).
pub(crate) fn begin_attempt(data: &DataPlane, ctx: &mut RequestCtx, worker: &WorkerId) {
    ctx.attempts += 1;
    let entry = ctx.view.as_ref().and_then(|v| v.workers.get(worker));
    // The decision reserved the first choice's load (`route::decide`): an attempt there keeps
    // it; any other attempt counts its own. Without prefix routing the prompt is not
    // tokenized: a quarter of the body's bytes stands for its tokens (`prompt_profile::work`,
    // as a sidecar counts it).
    if ctx.in_flight.as_ref().map(|f| f.worker()) != Some(worker) {
        let (prefill, output) = ctx
            .decision
            .as_ref()
            .and_then(|d| d.attempt_tokens(worker))
            .unwrap_or_else(|| {
                (
                    prompt_profile::work::untokenized_prompt_tokens(ctx.body.len()),
                    prompt_profile::work::queued_output_tokens(&ctx.body),
                )
            });
        ctx.in_flight = entry.map(|e| InFlight::start(e.runtime.clone(), prefill, output));
    }
    ctx.ticket = entry.and_then(|e| ticket_for(data, ctx, e)).map(Box::new);
    ctx.current = Some(worker.clone());
    // Write-ahead: the ticket is on disk before the worker can act on it, so a gateway killed
    // now still leaves it for the audit (the final line supersedes this one).
    if let (Some(log), Some(_)) = (&data.decisions, &ctx.ticket) {
        let line = crate::data_plane::decision_record(ctx, Some(receipts::DecisionPhase::Routed));
        if let Err(e) = log.append(&line) {
            tracing::warn!(error = %e, "decision log append (routed line) failed");
        }
    }
}

/// The signed route ticket of the request for one worker. `None` without a decision.
fn ticket_for(data: &DataPlane, ctx: &RequestCtx, entry: &WorkerEntry) -> Option<SignedTicket> {
    let view = ctx.view.as_ref()?;
    let service = ctx.service.as_ref()?;
    let d = ctx.decision.as_ref()?;
    let worker = &entry.spec.id;
    let now = crate::data_plane::now_ms();
    let prompt = d.prompt.as_ref();
    let ticket = RouteTicket {
        request_id: ctx.request_id.clone(),
        gateway_id: data.gateway_id.clone(),
        key_id: data.signer.key().key_id().clone(),
        service: service.name().to_owned(),
        rule_id: service.rule_id.clone(),
        rule_version: view.version(),
        mode: service.mode,
        worker: worker.clone(),
        predicted_matched_tokens: d.predicted_tokens(worker),
        prompt_tokens: prompt.and_then(|p| u32::try_from(p.prompt_tokens).ok()),
        last_block_key: prompt.and_then(|p| p.keys.last().copied()),
        // Round robin computes no keys: the all-zero namespace.
        namespace_seed: prompt.map_or(NamespaceSeed([0; 32]), |p| p.seed),
        // KV-exact: the pinned profile's algorithm; round robin: the one the worker reports.
        hash_algorithm: prompt
            .map(|p| p.hash_algorithm)
            .or_else(|| entry.runtime.reported_algorithm())
            .unwrap_or_default(),
        issued_at_ms: now,
        expires_at_ms: now + receipts::DEFAULT_TICKET_TTL_MS,
    };
    Some(ticket.sign(&data.signer))
}

/// The request head sent to the worker of the current attempt: its path prefix and `Host`,
/// `x-request-id`, the ticket, and framing for the buffered body (`content-length`, no
/// `expect` / `transfer-encoding`). `close` asks the worker to close the connection after it.
pub(crate) fn prepare_head(head: &mut RequestHeader, ctx: &RequestCtx, close: bool) -> Result<()> {
    let entry = match (&ctx.view, &ctx.current) {
        (Some(v), Some(w)) => v.workers.get(w),
        _ => None,
    };
    let Some(entry) = entry else {
        return Err(Error::explain(ErrorType::InternalError, "no worker chosen"));
    };
    if !entry.upstream.base_path.is_empty() {
        let pq = head
            .uri
            .path_and_query()
            .map_or("/", |p| p.as_str())
            .to_owned();
        let uri: http::Uri = format!("{}{}", entry.upstream.base_path, pq)
            .parse()
            .map_err(|_| Error::explain(ErrorType::InternalError, "bad upstream path"))?;
        head.set_uri(uri);
    }
    head.insert_header("host", entry.upstream.authority.as_str())?;
    head.insert_header("x-request-id", ctx.request_id.as_str())?;
    match &ctx.client_request_id {
        Some(c) => head.insert_header(CLIENT_REQUEST_ID_HEADER, c.as_str())?,
        None => {
            head.remove_header(CLIENT_REQUEST_ID_HEADER);
        }
    }
    match &ctx.ticket {
        Some(t) => head.insert_header(TICKET_HEADER, t.header())?,
        None => {
            head.remove_header(TICKET_HEADER);
        }
    }
    // What this gateway stores of a Responses API request; a client's own header never passes.
    match &ctx.stored {
        Some(s) => head.insert_header(prompt_profile::STORED_HEADER, s.header_value())?,
        None => {
            head.remove_header(prompt_profile::STORED_HEADER);
        }
    }
    if ctx.tenant.is_some() {
        // The tenant's API key is the gateway's to check, not the worker's to see.
        head.remove_header("authorization");
    }
    head.remove_header("expect");
    if close || !ctx.body.is_empty() || head.headers.contains_key("content-length") {
        head.remove_header("transfer-encoding");
        head.insert_header("content-length", ctx.body.len().to_string())?;
    }
    if close {
        head.insert_header("connection", "close")?;
    }
    Ok(())
}

/// A chunk of the answer's body on its way to the client (`end`: the last): the first marks
/// time to first byte and the end of the worker's prefill; a Responses API answer to store is
/// read, and kept once it is complete with status 200 (`crate::response_store`).
pub(crate) fn on_body(data: &Arc<DataPlane>, ctx: &mut RequestCtx, chunk: &[u8], end: bool) {
    if ctx.first_byte.is_none() && !chunk.is_empty() {
        ctx.first_byte = Some(std::time::Instant::now());
        if let Some(f) = ctx.in_flight.as_mut() {
            f.prefill_done();
        }
    }
    if let Some(c) = ctx.capture.as_mut() {
        c.feed(chunk);
    }
    // Stored as soon as it is complete (before this chunk is written to the client), else at
    // the end.
    if end || ctx.capture.as_ref().is_some_and(|c| c.complete()) {
        let Some(capture) = ctx.capture.take().filter(|_| ctx.status == Some(200)) else {
            return;
        };
        let (stores, conversation) = (capture.keeps(), capture.conversation().map(str::to_owned));
        let tenant = capture.tenant().map(str::to_owned);
        if let Some(turn) = capture.finish() {
            let shared = data.shared_turns();
            let keep = || {
                if let Some(id) = &conversation {
                    add_turn(data, id, tenant.as_deref(), &turn);
                }
                if stores {
                    crate::response_store::keep(&data.responses, shared.as_deref(), turn);
                }
            };
            // A background response's answer is its final state unless it was cancelled first.
            match &ctx.job {
                Some(job) => {
                    job.end(keep);
                }
                None => keep(),
            }
        }
    }
}

/// Adds a turn's input items, then its output items, to conversation `id`: here at once (its
/// answer's last chunk waits for it, so that the client's next turn finds it), then in the
/// shared store by an owned task (`conversation::share`). A conversation gone, or too full for
/// them, gets nothing (logged): the answer was served.
fn add_turn(
    data: &Arc<DataPlane>,
    id: &str,
    tenant: Option<&str>,
    turn: &crate::response_store::StoredResponse,
) {
    use crate::conversation;
    // Every item with an id (the worker's output items have theirs).
    let mut items = turn.input_items();
    let base = turn.id.trim_start_matches("resp_");
    items.extend(turn.output_items().iter().enumerate().map(|(n, item)| {
        let mut item = item.clone();
        if let Value::Object(o) = &mut item {
            if !o.get("id").is_some_and(Value::is_string) {
                o.insert("id".into(), Value::String(format!("item_{base}_out_{n}")));
            }
        }
        item
    }));
    let change = conversation::append(items);
    let here = conversation::change_here(&data.responses, id, tenant, &change);
    let Some(shared) = data.shared_turns() else {
        if let Err(e) = here {
            tracing::warn!(conversation = id, turn = %turn.id, error = %e, "a turn's items were not added to its conversation");
        }
        return;
    };
    // Bounded: each read and write waits at most `cluster::SHARED_RESPONSES_TIMEOUT`, a few
    // tries.
    let (data, id, tenant, turn) = (
        data.clone(),
        id.to_owned(),
        tenant.map(str::to_owned),
        turn.id.clone(),
    );
    tokio::spawn(async move {
        let shared = shared.as_ref();
        let tenant = tenant.as_deref();
        if let Err(e) = conversation::share(&data.responses, shared, &id, tenant, &change).await {
            tracing::warn!(conversation = %id, %turn, error = %e, "a turn's items were not added to its conversation");
        }
    });
}

/// Decorates the worker's response head (worker, route reason, rules version, request id),
/// records the status and marks passive health (a 5xx counts against the worker).
pub(crate) fn on_response(
    data: &DataPlane,
    resp: &mut ResponseHeader,
    ctx: &mut RequestCtx,
) -> Result<()> {
    let status = resp.status.as_u16();
    ctx.status = Some(status);
    if let Some(c) = ctx.capture.as_mut() {
        let length = resp
            .headers
            .get("content-length")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse().ok());
        c.expect_length(length);
    }
    ctx.receipt_named = Some(resp.headers.contains_key(RECEIPT_HEADER));
    if let Some(w) = &ctx.current {
        if is_refusal(status) {
            if let Some(e) = ctx.view.as_ref().and_then(|v| v.workers.get(w)) {
                e.runtime.refusals.fetch_add(1, Ordering::Relaxed);
            }
        }
        if status >= 500 {
            data.mark_failure(w, false);
        } else {
            data.mark_success(w);
        }
        resp.insert_header(WORKER_HEADER, w.0.as_str())?;
    }
    if let Some(d) = &ctx.decision {
        resp.insert_header(REASON_HEADER, d.reason.as_str())?;
    }
    if let Some(v) = &ctx.view {
        resp.insert_header(VERSION_HEADER, v.version().to_string())?;
    }
    resp.insert_header("x-request-id", ctx.request_id.as_str())?;
    if let Some(c) = &ctx.client_request_id {
        resp.insert_header(CLIENT_REQUEST_ID_HEADER, c.as_str())?;
    }
    Ok(())
}

/// Whether `live` (the data plane's view: health and cordons as of now, not as of the
/// request's view) takes `worker` out: unhealthy or cordoned. A worker the live view no longer
/// lists (a reload removed it) is not: the request keeps the view it started with.
fn taken_out(live: &crate::view::View, worker: &WorkerId) -> bool {
    live.workers.get(worker).is_some_and(|e| !e.routable())
}

/// The decision's next candidate, advancing `ctx.next` past it. The first attempt takes the
/// decision's first choice as decided; a retry (after a connect failure or a refusal) skips
/// the candidates that turned unhealthy since the decision — a health probe or another
/// request's connect failure marked them, or an operator cordoned them — and counts each skip as
/// `fallbacks_total{reason="unhealthy"}`. `None` when no candidate is left.
pub(crate) fn next_candidate(data: &DataPlane, ctx: &mut RequestCtx) -> Option<WorkerId> {
    let order = &ctx.decision.as_ref()?.order;
    let live = data.views.load();
    while let Some(worker) = order.get(ctx.next) {
        ctx.next += 1;
        if ctx.next > 1 && taken_out(&live, worker) {
            if let Some(s) = &ctx.service {
                data.metrics.fallback(s.name(), "unhealthy");
            }
            tracing::debug!(request_id = %ctx.request_id, worker = %worker.0,
                "skipping a candidate that turned unhealthy since the decision");
            continue;
        }
        return Some(worker.clone());
    }
    None
}

/// Whether a retry has a candidate left: one after `ctx.next` the live view does not mark
/// unhealthy (what [`next_candidate`] would return, without taking it).
pub(crate) fn candidate_left(data: &DataPlane, ctx: &RequestCtx) -> bool {
    let live = data.views.load();
    ctx.decision
        .as_ref()
        .is_some_and(|d| d.order.iter().skip(ctx.next).any(|w| !taken_out(&live, w)))
}

/// Whether a worker's status refuses the request before answering it: 429 (`queue_full`,
/// `admission_timeout`) or 503 (`engine_stopped`, `engine_failed`, `receipt_failed`; a sidecar's
/// `engine_unavailable`; a native engine's own 503 while it loads). The client got nothing yet,
/// so the request may go elsewhere.
pub(crate) fn is_refusal(status: u16) -> bool {
    matches!(status, 429 | 503)
}

/// After [`on_response`] on the current attempt: whether its refusal is offered to the
/// decision's next candidate — the status is a refusal, the service's
/// `upstream.refused_retries` is not used up and a candidate is left. When it is, the attempt's
/// `retried` decision line is written (the worker's status and receipt), the refusal is counted
/// (`fallbacks_total{reason="refused"}`) and the attempt's outcome is cleared for the next one.
/// Both forwarding paths call this; the last refusal reaches the client unchanged.
pub(crate) fn retry_refusal(data: &DataPlane, ctx: &mut RequestCtx) -> bool {
    let (Some(status), Some(service)) = (ctx.status, &ctx.service) else {
        return false;
    };
    if !is_refusal(status)
        || ctx.refusals >= service.spec().upstream.refused_retries
        || !candidate_left(data, ctx)
    {
        return false;
    }
    ctx.refusals += 1;
    data.metrics.fallback(service.name(), "refused");
    tracing::debug!(
        request_id = %ctx.request_id,
        worker = ?ctx.current,
        status,
        "worker refused the request: offering it to the next candidate"
    );
    if let (Some(log), Some(_)) = (&data.decisions, &ctx.ticket) {
        let line = crate::data_plane::decision_record(ctx, Some(receipts::DecisionPhase::Retried));
        if let Err(e) = log.append(&line) {
            tracing::warn!(error = %e, "decision log append (retried line) failed");
        }
    }
    ctx.status = None;
    ctx.receipt_named = None;
    true
}
