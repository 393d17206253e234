//! One request's state from `request_filter` to `logging` ([`RequestCtx`]), its metric labels,
//! and the gateway's own error answers. Shared by both forwarding paths (pingora's proxy loop
//! and [`crate::forward`]) and by the end-of-request bookkeeping of the data plane.

use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use pingora::http::ResponseHeader;
use pingora::prelude::Session;
use pingora::Result;
use prefix_index::WorkerId;
use receipts::SignedTicket;
use routing_rules::schema::TenantSpec;

use crate::error::GatewayError;
use crate::metrics::RequestLabels;
use crate::route::Decision;
use crate::view::{InFlight, ServiceRoute, View};

/// Header naming the worker that served a response (set by the gateway).
pub const WORKER_HEADER: &str = "x-kvgate-worker";
/// Header naming the route reason (`hit`, `no_match`, `load_guard`, `round_robin`, ...).
pub const REASON_HEADER: &str = "x-kvgate-route-reason";
/// Header carrying the rules version that routed the request.
pub const VERSION_HEADER: &str = "x-kvgate-rules-version";
/// The client's own request id, carried beside the gateway's (`x-request-id`).
pub const CLIENT_REQUEST_ID_HEADER: &str = "x-client-request-id";
/// The worker's header naming the receipt of its answer.
pub const RECEIPT_HEADER: &str = "x-kvgate-receipt";

/// Per-request state, from `request_filter` to `logging`.
#[derive(Default)]
pub struct RequestCtx {
    /// Counts the request in the gateway's drain until the context is dropped.
    pub(crate) _live: Option<drain::InFlight>,
    pub(crate) started: Option<Instant>,
    /// The id the gateway minted (ticket, receipt, decision log, `x-request-id` answered).
    pub(crate) request_id: String,
    /// The client's own `x-request-id`, when it sent a valid one (forwarded and echoed as
    /// `x-client-request-id`).
    pub(crate) client_request_id: Option<String>,
    /// Whether the worker's answer named a receipt (`x-kvgate-receipt`); `None` before an answer.
    pub(crate) receipt_named: Option<bool>,
    /// The one view this request reads, kept to the end.
    pub(crate) view: Option<Arc<View>>,
    pub(crate) body: Bytes,
    /// The matched service, once matched (also when routing it then failed).
    pub(crate) service: Option<Arc<ServiceRoute>>,
    /// The tenant the request authenticated as (services with `auth = "api_key"`).
    pub(crate) tenant: Option<Arc<TenantSpec>>,
    /// Counts the request against its tenant's `max_concurrent_requests` until dropped.
    pub(crate) _tenant_slot: Option<crate::limits::TenantSlot>,
    /// The routing decision, only when one was taken.
    pub(crate) decision: Option<Box<Decision>>,
    /// Index into `decision.order` of the next worker to try.
    pub(crate) next: usize,
    /// The worker of the current (last) attempt.
    pub(crate) current: Option<WorkerId>,
    /// Attempts refused by their worker (429 / 503) and offered to the next candidate
    /// ([`crate::upstream::retry_refusal`]).
    pub(crate) refusals: u32,
    /// Set from a refusal being retried until pingora's `error_while_proxy` reads it.
    pub(crate) retrying_refusal: bool,
    pub(crate) ticket: Option<Box<SignedTicket>>,
    pub(crate) in_flight: Option<InFlight>,
    pub(crate) status: Option<u16>,
    pub(crate) error: Option<String>,
    pub(crate) first_byte: Option<Instant>,
    pub(crate) decision_done: Option<Instant>,
    /// The body's `model`, when it named one (for the access log).
    pub(crate) model: Option<String>,
    /// Attempts sent to workers ([`crate::upstream::begin_attempt`]).
    pub(crate) attempts: u32,
    /// A Responses API answer to store, read as it streams back ([`crate::upstream::on_body`]).
    pub(crate) capture: Option<Box<crate::response_store::Capture>>,
    /// What this gateway stores of a Responses API request, told to the worker
    /// (`prompt_profile::STORED_HEADER`) so that its response object says so.
    pub(crate) stored: Option<prompt_profile::Stored>,
    /// `background: true` (the Responses API): set by `prepare`, then the job that runs it
    /// once the request is accepted ([`crate::background`]).
    pub(crate) background: bool,
    pub(crate) job: Option<Arc<crate::background::Job>>,
    /// The request was handed to a background job: its own bookkeeping is the job's.
    pub(crate) detached: bool,
}

impl RequestCtx {
    /// Labels for the request counter.
    pub(crate) fn labels(&self) -> RequestLabels {
        let (service, rule, mode) = match &self.service {
            Some(s) => (
                s.name().to_owned(),
                s.rule_id.clone(),
                s.mode.as_str().to_owned(),
            ),
            None => ("-".into(), "-".into(), "-".into()),
        };
        RequestLabels {
            service,
            rule,
            mode,
            worker: self
                .current
                .as_ref()
                .map_or_else(|| "-".to_owned(), |w| w.0.clone()),
            status: self
                .status
                .map_or_else(|| "0".to_owned(), |s| s.to_string()),
        }
    }
}

/// Writes a JSON answer of the gateway's own (status 200: `GET /v1/models`) and records it in
/// the ctx.
pub(crate) async fn respond_json(
    session: &mut Session,
    ctx: &mut RequestCtx,
    body: &serde_json::Value,
) -> Result<bool> {
    let body = serde_json::to_vec(body).unwrap_or_default();
    respond(session, ctx, 200, body, |_| Ok(())).await
}

/// Writes a worker's JSON answer of status `status` as it came (a count a worker made,
/// `POST /v1/responses/input_tokens`) and records it in the ctx.
pub(crate) async fn respond_worker_json(
    session: &mut Session,
    ctx: &mut RequestCtx,
    status: u16,
    body: Vec<u8>,
) -> Result<bool> {
    respond(session, ctx, status, body, |_| Ok(())).await
}

/// Writes an OpenAI-style error response and records it in the ctx.
pub(crate) async fn respond_error(
    session: &mut Session,
    ctx: &mut RequestCtx,
    err: &GatewayError,
) -> Result<bool> {
    let body = err.to_openai_json();
    ctx.error = Some(err.error_type().to_owned());
    respond(session, ctx, err.status(), body, |resp| {
        match err {
            GatewayError::Overloaded { .. } => resp.insert_header("retry-after", "1")?,
            GatewayError::RateLimited { retry_after_s, .. } => {
                resp.insert_header("retry-after", retry_after_s.to_string())?
            }
            GatewayError::InvalidApiKey { .. } => {
                resp.insert_header("www-authenticate", "Bearer")?
            }
            _ => {}
        }
        Ok(())
    })
    .await
}

/// A whole JSON answer of the gateway's own: status, `content-type`, `content-length`, the
/// request ids and rules version, whatever `decorate` adds, then the body; the status is
/// recorded in the ctx.
async fn respond(
    session: &mut Session,
    ctx: &mut RequestCtx,
    status: u16,
    body: Vec<u8>,
    decorate: impl FnOnce(&mut ResponseHeader) -> Result<()>,
) -> Result<bool> {
    let mut resp = ResponseHeader::build(status, Some(4))?;
    resp.insert_header("content-type", "application/json")?;
    resp.insert_header("content-length", body.len().to_string())?;
    resp.insert_header("x-request-id", ctx.request_id.as_str())?;
    if let Some(c) = &ctx.client_request_id {
        resp.insert_header(CLIENT_REQUEST_ID_HEADER, c.as_str())?;
    }
    decorate(&mut resp)?;
    if let Some(v) = &ctx.view {
        resp.insert_header(VERSION_HEADER, v.version().to_string())?;
    }
    ctx.status = Some(status);
    session.write_response_header(Box::new(resp), false).await?;
    session
        .write_response_body(Some(Bytes::from(body)), true)
        .await?;
    Ok(true)
}
