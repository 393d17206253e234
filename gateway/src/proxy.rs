//! The pingora `ProxyHttp`: one request from the VIP to a worker.
//!
//! Hook by hook (see `docs/gateway.md` for why the body is read before routing):
//! - `request_filter`: take one [`View`]; answer `Expect: 100-continue`; enable pingora's retry
//!   buffer and read the whole body (cap → 413); match the service; decide the route
//!   ([`crate::route::decide`]). Bodies up to pingora's 64 KiB retry buffer continue on
//!   pingora's proxy path; larger ones go through [`crate::forward`] from here (pingora would
//!   send their headers without the body).
//! - `upstream_peer`: the next candidate of the decision (called again after a connect failure).
//! - `upstream_request_filter`: sign the ticket for the worker actually used, add it and
//!   `x-request-id`, fix framing headers (`content-length`, no `expect`/`transfer-encoding`).
//! - `request_body_filter`: at end of stream, send the buffered body.
//! - response hooks: passive health (5xx), first-byte time; the body streams through untouched.
//! - `logging`: metrics, the decision log line, approximate index holdings.

use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use bytes::{Bytes, BytesMut};
use pingora::http::{RequestHeader, ResponseHeader};
use pingora::prelude::{HttpPeer, ProxyHttp, Session};
use pingora::{Error, ErrorType, Result};
use prefix_index::WorkerId;
use receipts::{RouteMode, RouteTicket, SignedTicket, TICKET_HEADER};

use crate::core::Shared;
use crate::error::GatewayError;
use crate::metrics::{ModeLabels, RequestLabels, ServiceLabels};
use crate::route::{self, Decision, RouteInput};
use crate::view::{InFlight, View};

/// pingora's retry buffer size (`BODY_BUF_LIMIT`): bodies above it take the forward path.
pub const RETRY_BUFFER_LIMIT: usize = 64 * 1024;

/// Header naming the worker that served a response (set by the gateway).
pub const WORKER_HEADER: &str = "x-kvgate-worker";
/// Header naming the route reason (`hit`, `no_match`, `load_guard`, `round_robin`, ...).
pub const REASON_HEADER: &str = "x-kvgate-route-reason";
/// Header carrying the rules version that routed the request.
pub const VERSION_HEADER: &str = "x-kvgate-rules-version";

/// Per-request state, from `request_filter` to `logging`.
#[derive(Default)]
pub struct RequestCtx {
    pub(crate) started: Option<Instant>,
    pub(crate) request_id: String,
    pub(crate) view: Option<Arc<View>>,
    pub(crate) body: Bytes,
    pub(crate) decision: Option<Decision>,
    /// Index into `decision.order` of the next worker to try.
    pub(crate) next: usize,
    /// The worker of the current (last) attempt.
    pub(crate) current: Option<WorkerId>,
    pub(crate) ticket: Option<SignedTicket>,
    pub(crate) in_flight: Option<InFlight>,
    pub(crate) status: Option<u16>,
    pub(crate) error: Option<String>,
    pub(crate) first_byte: Option<Instant>,
    pub(crate) decision_done: Option<Instant>,
}

/// The proxy application.
pub struct Proxy {
    shared: Arc<Shared>,
}

impl Proxy {
    /// A proxy over the gateway's shared state.
    pub fn new(shared: Arc<Shared>) -> Proxy {
        Proxy { shared }
    }

    /// The shared state.
    pub fn shared(&self) -> &Arc<Shared> {
        &self.shared
    }
}

fn header_str(req: &RequestHeader, name: &str) -> Option<String> {
    req.headers
        .get(name)
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned)
}

/// A client-supplied request id is kept when it is short printable ASCII; otherwise a UUID.
fn request_id_for(req: &RequestHeader) -> String {
    match header_str(req, "x-request-id") {
        Some(id)
            if !id.is_empty() && id.len() <= 128 && id.bytes().all(|b| b.is_ascii_graphic()) =>
        {
            id
        }
        _ => uuid::Uuid::new_v4().to_string(),
    }
}

/// Writes an OpenAI-style error response and records it in the ctx.
pub(crate) async fn respond_error(
    session: &mut Session,
    ctx: &mut RequestCtx,
    err: &GatewayError,
) -> Result<bool> {
    let body = err.to_openai_json();
    let mut resp = ResponseHeader::build(err.status(), Some(4))?;
    resp.insert_header("content-type", "application/json")?;
    resp.insert_header("content-length", body.len().to_string())?;
    resp.insert_header("x-request-id", ctx.request_id.as_str())?;
    if let Some(v) = &ctx.view {
        resp.insert_header(VERSION_HEADER, v.version().to_string())?;
    }
    ctx.status = Some(err.status());
    ctx.error = Some(err.error_type().to_owned());
    session.write_response_header(Box::new(resp), false).await?;
    session
        .write_response_body(Some(Bytes::from(body)), true)
        .await?;
    Ok(true)
}

impl Proxy {
    /// Reads the whole request body with a cap. `Err(limit)` when over the cap.
    async fn read_body(
        session: &mut Session,
        cap: usize,
    ) -> Result<std::result::Result<Bytes, usize>> {
        let expected = session
            .req_header()
            .headers
            .get("content-length")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<usize>().ok());
        if expected.is_some_and(|n| n > cap) {
            return Ok(Err(cap));
        }
        let mut buf = BytesMut::with_capacity(expected.unwrap_or(0).min(cap));
        while let Some(chunk) = session.read_request_body().await? {
            if buf.len() + chunk.len() > cap {
                return Ok(Err(cap));
            }
            buf.extend_from_slice(&chunk);
        }
        Ok(Ok(buf.freeze()))
    }

    /// Builds and signs the ticket for `worker`.
    pub(crate) fn ticket_for(&self, ctx: &RequestCtx, worker: &WorkerId) -> Option<SignedTicket> {
        let view = ctx.view.as_ref()?;
        let d = ctx.decision.as_ref()?;
        let now = crate::core::now_ms();
        let mode = match d.service.spec().rule {
            routing_rules::schema::Rule::RoundRobin(_) => RouteMode::RoundRobin,
            routing_rules::schema::Rule::KvExact(_) => RouteMode::KvExact,
        };
        let ticket = RouteTicket {
            request_id: ctx.request_id.clone(),
            gateway_id: self.shared.gateway_id.clone(),
            key_id: self.shared.key.key_id().clone(),
            service: d.service.name().to_owned(),
            rule_id: d.service.rule_id.clone(),
            rule_version: view.version(),
            mode,
            worker: worker.0.clone(),
            predicted_matched_tokens: d.predicted_tokens(worker),
            prompt_tokens: d
                .prompt
                .as_ref()
                .and_then(|p| u32::try_from(p.prompt_tokens).ok()),
            last_block_key: d
                .prompt
                .as_ref()
                .and_then(|p| p.keys.last())
                .map(|k| k.to_string()),
            namespace_seed: if d.seed_hex.is_empty() {
                self.shared.default_seed_hex.clone()
            } else {
                d.seed_hex.clone()
            },
            hash_algorithm: if d.hash_algorithm.is_empty() {
                "xxh3".to_owned()
            } else {
                d.hash_algorithm.clone()
            },
            issued_at_ms: now,
            expires_at_ms: now + receipts::DEFAULT_TICKET_TTL_MS,
        };
        Some(ticket.sign(&self.shared.key))
    }
}

#[async_trait]
impl ProxyHttp for Proxy {
    type CTX = RequestCtx;

    fn new_ctx(&self) -> RequestCtx {
        RequestCtx::default()
    }

    async fn request_filter(&self, session: &mut Session, ctx: &mut RequestCtx) -> Result<bool> {
        ctx.started = Some(Instant::now());
        ctx.request_id = request_id_for(session.req_header());
        let view = self.shared.views.load();
        ctx.view = Some(view.clone());
        let req = session.req_header();
        let path = req.uri.path().to_owned();
        let method = req.method.as_str().to_owned();
        let host = header_str(req, "host").or_else(|| req.uri.host().map(str::to_owned));
        let expect_continue =
            header_str(req, "expect").is_some_and(|v| v.eq_ignore_ascii_case("100-continue"));

        let Some(limit) = view.body_limit_for(host.as_deref(), &path) else {
            // The body stays unread: the connection can't be reused.
            session.set_keepalive(None);
            let err = GatewayError::ServiceNotFound {
                method,
                path,
                model: None,
            };
            return respond_error(session, ctx, &err).await;
        };
        let cap = usize::try_from(limit).unwrap_or(usize::MAX);
        if expect_continue {
            session.write_continue_response().await?;
        }
        session.enable_retry_buffering();
        let body = match Self::read_body(session, cap).await? {
            Ok(b) => b,
            Err(limit) => {
                // The connection can't be reused: the rest of the body is unread.
                session.set_keepalive(None);
                return respond_error(session, ctx, &GatewayError::BodyTooLarge { limit }).await;
            }
        };
        let model = crate::protocol::peek_model(&body);
        let Some(service) = view
            .match_service(host.as_deref(), &path, model.as_deref())
            .cloned()
        else {
            let err = GatewayError::ServiceNotFound {
                method,
                path,
                model,
            };
            return respond_error(session, ctx, &err).await;
        };
        if body.len() as u64 > service.spec().max_body_bytes {
            let limit = usize::try_from(service.spec().max_body_bytes).unwrap_or(usize::MAX);
            return respond_error(session, ctx, &GatewayError::BodyTooLarge { limit }).await;
        }
        let req = session.req_header();
        let header = |name: &str| header_str(req, name);
        let decided = route::decide(
            &view,
            &self.shared.index,
            &RouteInput {
                service: &service,
                path: &path,
                body: &body,
                header: &header,
            },
        );
        let decision_time = ctx.started.map(|s| s.elapsed()).unwrap_or_default();
        ctx.decision_done = Some(Instant::now());
        self.shared
            .metrics
            .route_decision_seconds
            .get_or_create(&ModeLabels {
                service: service.name().to_owned(),
                mode: service.mode().to_owned(),
            })
            .observe(decision_time.as_secs_f64());
        let decision = match decided {
            Ok(d) => d,
            Err(err) => {
                let label = match &err {
                    GatewayError::InvalidBody { .. } | GatewayError::Prompt { .. } => {
                        Some("unparsable_body")
                    }
                    GatewayError::ContextLengthExceeded { .. } => Some("budget"),
                    GatewayError::NoHealthyWorker { .. } => Some("unhealthy"),
                    _ => None,
                };
                if let Some(l) = label {
                    self.shared.metrics.fallback(service.name(), l);
                }
                ctx.decision = None;
                ctx.body = body;
                // Keep the service for logging labels.
                ctx.error = Some(err.error_type().to_owned());
                let r = respond_error(session, ctx, &err).await;
                ctx.decision = Some(Decision {
                    service,
                    order: Vec::new(),
                    reason: routing_rules::policy::Reason::NoHealthyWorker,
                    extra_fallbacks: Vec::new(),
                    prompt: None,
                    seed_hex: String::new(),
                    hash_algorithm: String::new(),
                });
                return r;
            }
        };
        let svc_name = decision.service.name().to_owned();
        if let Some(l) = route::fallback_label(decision.reason) {
            self.shared.metrics.fallback(&svc_name, l);
        }
        for l in &decision.extra_fallbacks {
            self.shared.metrics.fallback(&svc_name, l);
        }
        if let Some(p) = &decision.prompt {
            let labels = ServiceLabels {
                service: svc_name.clone(),
            };
            self.shared
                .metrics
                .lookup_tokens
                .get_or_create(&labels)
                .inc_by(p.prompt_tokens as u64);
            if let Some(first) = decision.order.first() {
                let predicted = decision.predicted_tokens(first).unwrap_or(0);
                self.shared
                    .metrics
                    .matched_tokens
                    .get_or_create(&labels)
                    .inc_by(u64::from(predicted));
            }
        }
        ctx.decision = Some(decision);
        ctx.body = body;
        if ctx.body.len() > RETRY_BUFFER_LIMIT {
            // pingora would forward only the headers of a body its retry buffer truncated.
            crate::forward::forward(self, session, ctx).await?;
            return Ok(true);
        }
        Ok(false)
    }

    async fn upstream_peer(
        &self,
        _session: &mut Session,
        ctx: &mut RequestCtx,
    ) -> Result<Box<HttpPeer>> {
        let view = ctx
            .view
            .clone()
            .ok_or_else(|| Error::explain(ErrorType::InternalError, "no view"))?;
        let decision = ctx
            .decision
            .as_ref()
            .ok_or_else(|| Error::explain(ErrorType::InternalError, "no decision"))?;
        let Some(worker) = decision.order.get(ctx.next).cloned() else {
            return Err(Error::explain(
                ErrorType::ConnectNoRoute,
                "no candidate left",
            ));
        };
        ctx.next += 1;
        let entry = view
            .workers
            .get(&worker)
            .ok_or_else(|| Error::explain(ErrorType::InternalError, "worker left the view"))?;
        let peer = crate::forward::peer_for(&entry.upstream, &decision.service.spec().upstream);
        ctx.current = Some(worker);
        Ok(Box::new(peer))
    }

    fn fail_to_connect(
        &self,
        _session: &mut Session,
        _peer: &HttpPeer,
        ctx: &mut RequestCtx,
        mut e: Box<Error>,
    ) -> Box<Error> {
        if let Some(w) = &ctx.current {
            self.shared.mark_failure(w, true);
            if let Some(d) = &ctx.decision {
                self.shared.metrics.fallback(d.service.name(), "connect");
            }
        }
        // Nothing was sent yet: try the next candidate if there is one.
        let left = ctx
            .decision
            .as_ref()
            .is_some_and(|d| ctx.next < d.order.len());
        e.set_retry(left);
        e
    }

    async fn upstream_request_filter(
        &self,
        _session: &mut Session,
        upstream: &mut RequestHeader,
        ctx: &mut RequestCtx,
    ) -> Result<()> {
        let Some(worker) = ctx.current.clone() else {
            return Err(Error::explain(ErrorType::InternalError, "no worker chosen"));
        };
        let view = ctx.view.clone();
        if let Some(entry) = view.as_ref().and_then(|v| v.workers.get(&worker)) {
            ctx.in_flight = Some(InFlight::start(entry.runtime.clone()));
            if !entry.upstream.base_path.is_empty() {
                let pq = upstream
                    .uri
                    .path_and_query()
                    .map_or("/", |p| p.as_str())
                    .to_owned();
                let uri: http::Uri = format!("{}{}", entry.upstream.base_path, pq)
                    .parse()
                    .map_err(|_| Error::explain(ErrorType::InternalError, "bad upstream path"))?;
                upstream.set_uri(uri);
            }
            upstream.insert_header("host", entry.upstream.authority.as_str())?;
        }
        let ticket = self.ticket_for(ctx, &worker);
        upstream.insert_header("x-request-id", ctx.request_id.as_str())?;
        if let Some(t) = &ticket {
            upstream.insert_header(TICKET_HEADER, t.header())?;
        }
        ctx.ticket = ticket;
        upstream.remove_header("expect");
        if !ctx.body.is_empty() || upstream.headers.contains_key("content-length") {
            upstream.remove_header("transfer-encoding");
            upstream.insert_header("content-length", ctx.body.len().to_string())?;
        }
        Ok(())
    }

    async fn request_body_filter(
        &self,
        _session: &mut Session,
        body: &mut Option<Bytes>,
        end_of_stream: bool,
        ctx: &mut RequestCtx,
    ) -> Result<()> {
        if end_of_stream {
            *body = if ctx.body.is_empty() {
                None
            } else {
                Some(ctx.body.clone())
            };
        } else {
            *body = None;
        }
        Ok(())
    }

    async fn upstream_response_filter(
        &self,
        _session: &mut Session,
        upstream: &mut ResponseHeader,
        ctx: &mut RequestCtx,
    ) -> Result<()> {
        let status = upstream.status.as_u16();
        ctx.status = Some(status);
        if let Some(w) = &ctx.current {
            if status >= 500 {
                self.shared.mark_failure(w, false);
            } else {
                self.shared.mark_success(w);
            }
            upstream.insert_header(WORKER_HEADER, w.0.as_str())?;
        }
        if let Some(d) = &ctx.decision {
            upstream.insert_header(REASON_HEADER, d.reason.as_str())?;
        }
        if let Some(v) = &ctx.view {
            upstream.insert_header(VERSION_HEADER, v.version().to_string())?;
        }
        upstream.insert_header("x-request-id", ctx.request_id.as_str())?;
        Ok(())
    }

    fn response_body_filter(
        &self,
        _session: &mut Session,
        body: &mut Option<Bytes>,
        _end_of_stream: bool,
        ctx: &mut RequestCtx,
    ) -> Result<Option<Duration>> {
        if ctx.first_byte.is_none() && body.as_ref().is_some_and(|b| !b.is_empty()) {
            ctx.first_byte = Some(Instant::now());
        }
        Ok(None)
    }

    async fn logging(&self, session: &mut Session, e: Option<&Error>, ctx: &mut RequestCtx) {
        if ctx.status.is_none() {
            ctx.status = session.response_written().map(|r| r.status.as_u16());
        }
        if let Some(e) = e {
            if ctx.error.is_none() {
                ctx.error = Some(match e.etype() {
                    ErrorType::ConnectNoRoute
                    | ErrorType::ConnectTimedout
                    | ErrorType::ConnectRefused
                    | ErrorType::ConnectError => "upstream_unavailable".to_owned(),
                    other => format!("upstream_error: {}", other.as_str()),
                });
            }
            if ctx.status.is_none() || ctx.status == Some(200) && ctx.first_byte.is_none() {
                ctx.status = Some(match e.etype() {
                    ErrorType::ConnectNoRoute
                    | ErrorType::ConnectTimedout
                    | ErrorType::ConnectRefused
                    | ErrorType::ConnectError => 503,
                    _ => 502,
                });
            }
        }
        self.shared.finish_request(ctx);
    }

    async fn fail_to_proxy(
        &self,
        session: &mut Session,
        e: &Error,
        ctx: &mut RequestCtx,
    ) -> pingora::proxy::FailToProxy {
        let service = ctx
            .decision
            .as_ref()
            .map(|d| d.service.name().to_owned())
            .unwrap_or_default();
        let err = match e.etype() {
            ErrorType::ConnectNoRoute
            | ErrorType::ConnectTimedout
            | ErrorType::ConnectRefused
            | ErrorType::ConnectError => GatewayError::UpstreamUnavailable {
                service,
                reason: e.to_string(),
            },
            _ => GatewayError::Upstream {
                worker: ctx
                    .current
                    .as_ref()
                    .map(|w| w.0.clone())
                    .unwrap_or_default(),
                reason: e.etype().as_str().to_owned(),
            },
        };
        // Write an error only if nothing was sent downstream yet.
        let code = if session.response_written().is_none() {
            let _ = respond_error(session, ctx, &err).await;
            err.status()
        } else {
            0
        };
        pingora::proxy::FailToProxy {
            error_code: code,
            can_reuse_downstream: false,
        }
    }
}

/// Labels for the request counter from a finished ctx.
pub(crate) fn request_labels(ctx: &RequestCtx) -> RequestLabels {
    let (service, rule, mode) = match &ctx.decision {
        Some(d) => (
            d.service.name().to_owned(),
            d.service.rule_id.clone(),
            d.service.mode().to_owned(),
        ),
        None => ("-".into(), "-".into(), "-".into()),
    };
    RequestLabels {
        service,
        rule,
        mode,
        worker: ctx
            .current
            .as_ref()
            .map_or_else(|| "-".to_owned(), |w| w.0.clone()),
        status: ctx.status.map_or_else(|| "0".to_owned(), |s| s.to_string()),
    }
}
