//! The pingora `ProxyHttp`: one request from the VIP to a worker.
//!
//! Hook by hook (see `docs/gateway.md` for why the body is read before routing):
//! - `request_filter`: take one [`crate::view::View`]; answer `Expect: 100-continue`; enable pingora's retry
//!   buffer and read the whole body (cap → 413); match the service; decide the route
//!   ([`crate::route::decide`]). Bodies up to pingora's 64 KiB retry buffer continue on
//!   pingora's proxy path; larger ones go through [`crate::forward`] from here (pingora would
//!   send their headers without the body).
//! - `upstream_peer`: the next candidate of the decision (called again after a connect failure).
//! - `upstream_request_filter`: start the attempt and prepare the head
//!   ([`crate::upstream::begin_attempt`], [`crate::upstream::prepare_head`]: the ticket signed
//!   for the worker actually used, `x-request-id`, framing headers).
//! - `request_body_filter`: at end of stream, send the buffered body.
//! - response hooks: [`crate::upstream::on_response`] (decoration, passive health), first-byte
//!   time; the body streams through untouched.
//! - `logging`: metrics, the decision log line, approximate index holdings.

use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use bytes::{Bytes, BytesMut};
use pingora::http::{RequestHeader, ResponseHeader};
use pingora::prelude::{HttpPeer, ProxyHttp, Session};
use pingora::{Error, ErrorType, Result};
use routing_rules::schema::{AuthPolicy, TenantSpec};

use crate::data_plane::DataPlane;
use crate::error::GatewayError;
use crate::metrics::TenantLimitLabels;
use crate::pool::{BlockingPool, PoolError};
use crate::protocol::Endpoint;
use crate::request::{respond_error, RequestCtx};
use crate::response_store::Resource;
use crate::route::{self, RouteInput};
use crate::upstream;
use crate::view::ServiceRoute;

/// pingora's retry buffer size (`BODY_BUF_LIMIT`): bodies above it take the forward path.
pub const RETRY_BUFFER_LIMIT: usize = 64 * 1024;

/// The proxy application of one listener.
pub struct Proxy {
    data: Arc<DataPlane>,
    /// The named listener (`gateway.listeners`) this proxy serves; `None`: the unnamed VIP
    /// (`--listen`). Services with `match.listener` match only on their listener.
    listener: Option<Arc<str>>,
    /// Prefix routing (parse, render, tokenize, keys, lookup) runs here, off the proxy threads
    /// (`None`: on the proxy thread itself — `routing_threads = 0`, for comparison only).
    routing: Option<Arc<BlockingPool>>,
}

impl Proxy {
    /// A proxy over the gateway's data plane, routing prefix services on `routing`.
    pub fn new(data: Arc<DataPlane>, routing: Option<Arc<BlockingPool>>) -> Proxy {
        Proxy {
            data,
            listener: None,
            routing,
        }
    }

    /// The same proxy serving the named listener `name`.
    pub fn for_listener(mut self, name: &str) -> Proxy {
        self.listener = Some(Arc::from(name));
        self
    }

    /// The data plane.
    pub fn data(&self) -> &Arc<DataPlane> {
        &self.data
    }
}

fn header_str(req: &RequestHeader, name: &str) -> Option<String> {
    req.headers
        .get(name)
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned)
}

/// The body length a request declares (`content-length`), when it declares one.
fn declared_length(req: &RequestHeader) -> Option<usize> {
    req.headers
        .get("content-length")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<usize>().ok())
}

/// `Some(None)` for `/v1/models`, `Some(Some(id))` for `/v1/models/{id}` (the id may hold
/// `/`, as `org/name` ids do), `None` for other paths.
fn models_path(path: &str) -> Option<Option<String>> {
    let path = path.trim_end_matches('/');
    if path == "/v1/models" {
        return Some(None);
    }
    path.strip_prefix("/v1/models/")
        .filter(|id| !id.is_empty())
        .map(|id| Some(id.to_owned()))
}

/// The client's own `x-request-id`, when it is 1..=128 visible ASCII characters (else ignored).
fn client_request_id(req: &RequestHeader) -> Option<String> {
    header_str(req, "x-request-id")
        .filter(|id| !id.is_empty() && id.len() <= 128 && id.bytes().all(|b| b.is_ascii_graphic()))
}

impl Proxy {
    /// The tenant of the request's `Authorization: Bearer <key>` (services with
    /// `auth = "api_key"`). Keys are compared by SHA-256; none is logged or echoed.
    fn authenticate(
        &self,
        view: &crate::view::View,
        req: &RequestHeader,
    ) -> std::result::Result<Arc<TenantSpec>, GatewayError> {
        let refuse = |reason| {
            self.data.metrics.invalid_api_keys.inc();
            GatewayError::InvalidApiKey { reason }
        };
        let Some(value) = req.headers.get("authorization") else {
            return Err(refuse(
                "this service needs an API key: send Authorization: Bearer <key>",
            ));
        };
        let key = value
            .to_str()
            .ok()
            .and_then(|v| v.split_once(' '))
            .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
            .map(|(_, key)| key.trim())
            .filter(|k| !k.is_empty());
        let Some(key) = key else {
            return Err(refuse("the Authorization header must be Bearer <key>"));
        };
        view.tenant_of(key)
            .cloned()
            .ok_or_else(|| refuse("invalid API key"))
    }

    /// `GET /v1/models` (`one`: `None`) or `GET /v1/models/{one}` from the `match.models` of
    /// `services`: a service behind API keys lists its models only to a valid key (401 when
    /// such services are all there is and the key is not valid); an unknown `one` is 404
    /// `model_not_found`.
    async fn answer_models(
        &self,
        session: &mut Session,
        ctx: &mut RequestCtx,
        view: &crate::view::View,
        services: &[Arc<ServiceRoute>],
        one: Option<String>,
    ) -> Result<bool> {
        // A key is checked only when one is sent: listing the open services' models without
        // one is not an invalid key.
        let keyed = session.req_header().headers.contains_key("authorization");
        let mut auth: Option<std::result::Result<Arc<TenantSpec>, GatewayError>> = None;
        let mut hidden = false;
        let mut models = std::collections::BTreeSet::new();
        for s in services {
            if s.spec().auth == AuthPolicy::ApiKey {
                let tenant = keyed
                    .then(|| {
                        auth.get_or_insert_with(|| self.authenticate(view, session.req_header()))
                    })
                    .and_then(|a| a.as_ref().ok());
                match tenant {
                    None => {
                        hidden = true;
                        continue;
                    }
                    // A valid key: only the services its tenant may call.
                    Some(t) if !t.may_use(s.name()) => continue,
                    Some(_) => {}
                }
            }
            models.extend(s.spec().matcher.models.iter().cloned());
        }
        if models.is_empty() && hidden {
            let err = match auth.take() {
                Some(Err(e)) => e,
                _ => match self.authenticate(view, session.req_header()) {
                    Err(e) => e,
                    Ok(_) => GatewayError::Internal {
                        reason: "listing models: no key, yet authenticated".into(),
                    },
                },
            };
            return respond_error(session, ctx, &err).await;
        }
        if let Some(Ok(t)) = auth {
            ctx.tenant = Some(t);
        }
        let card = |id: &str| serde_json::json!({"id": id, "object": "model", "created": 0, "owned_by": "kvgate"});
        let body = match one {
            None => serde_json::json!({
                "object": "list",
                "data": models.iter().map(|m| card(m)).collect::<Vec<_>>(),
            }),
            Some(id) if models.contains(&id) => card(&id),
            Some(id) => {
                return respond_error(session, ctx, &GatewayError::ModelNotFound { model: id })
                    .await
            }
        };
        crate::request::respond_json(session, ctx, &body).await
    }

    /// `GET /v1/responses/{id}` (the stored response), `DELETE /v1/responses/{id}`,
    /// `GET /v1/responses/{id}/input_items` and `POST /v1/responses/{id}/cancel` (a background
    /// response, [`crate::background`]). A response made on a service with API keys is its
    /// tenant's: another caller gets 404, as for an id never stored.
    #[allow(clippy::too_many_arguments)]
    async fn answer_stored(
        &self,
        session: &mut Session,
        ctx: &mut RequestCtx,
        view: &crate::view::View,
        method: &str,
        id: &str,
        what: Resource,
        query: Option<&str>,
    ) -> Result<bool> {
        let allowed = match what {
            Resource::Response => "GET, DELETE",
            Resource::InputItems => "GET",
            Resource::Cancel => "POST",
        };
        if let Some(err) = refuse_method(session, method, allowed) {
            return respond_error(session, ctx, &err).await;
        }
        if what == Resource::Cancel {
            // A cancel carries no body; one sent is read and ignored (up to 64 KiB), so the
            // connection stays usable.
            if Self::read_body(session, RETRY_BUFFER_LIMIT).await?.is_err() {
                session.set_keepalive(None);
            }
        }
        let (local, shared) = (&self.data.responses, self.data.shared_turns());
        let shared = shared.as_deref();
        let not_found = GatewayError::ResponseNotFound { id: id.to_owned() };
        let Some(r) = crate::response_store::find(local, shared, id)
            .await
            .filter(|r| !r.is_conversation())
        else {
            return respond_error(session, ctx, &not_found).await;
        };
        // A tenant's response: only to that tenant's key.
        if let Some(owner) = &r.tenant {
            let keyed = session.req_header().headers.contains_key("authorization");
            match keyed
                .then(|| self.authenticate(view, session.req_header()).ok())
                .flatten()
            {
                Some(t) if t.id.0 == *owner => ctx.tenant = Some(t),
                _ => return respond_error(session, ctx, &not_found).await,
            }
        }
        let body = match (what, method) {
            (Resource::Response, "DELETE") => {
                // A background response still running stops first (its answer would otherwise
                // be stored after the deletion).
                if r.running() {
                    self.cancel_background(id).await;
                }
                crate::response_store::remove(local, shared, id).await;
                serde_json::json!({"id": id, "object": "response", "deleted": true})
            }
            (Resource::InputItems, _) => match crate::response_store::input_items_page(&r, query) {
                Ok(b) => b,
                Err(err) => return respond_error(session, ctx, &err).await,
            },
            (Resource::Cancel, _) => {
                if !r.background() {
                    let err = GatewayError::NotBackground { id: id.to_owned() };
                    return respond_error(session, ctx, &err).await;
                }
                let r = match r.running() {
                    true => self.cancel_background(id).await.unwrap_or(r),
                    false => r,
                };
                r.retrieved()
            }
            _ => match crate::background::stream_query(query) {
                Ok(None) => r.retrieved(),
                Ok(Some(_)) if !r.background() => {
                    let err = GatewayError::NotBackground { id: id.to_owned() };
                    return respond_error(session, ctx, &err).await;
                }
                Ok(Some(from)) => return self.resume(session, ctx, id, from).await,
                Err(err) => return respond_error(session, ctx, &err).await,
            },
        };
        crate::request::respond_json(session, ctx, &body).await
    }

    /// The Conversations API (`crate::conversation`; docs/gateway.md, "Conversations"): create,
    /// read, change the metadata of and delete a conversation; list, add, read and delete its
    /// items. A key, when one is sent, must be valid, and its tenant owns what it makes: another
    /// caller gets 404, as for an id never made.
    #[allow(clippy::too_many_arguments)]
    async fn answer_conversation(
        &self,
        session: &mut Session,
        ctx: &mut RequestCtx,
        view: &crate::view::View,
        method: &str,
        what: crate::conversation::Resource<'_>,
        query: Option<&str>,
    ) -> Result<bool> {
        use crate::conversation::{self as conv, Resource};
        let allowed = what.allowed();
        if let Some(err) = refuse_method(session, method, allowed) {
            return respond_error(session, ctx, &err).await;
        }
        let (local, shared) = (&self.data.responses, self.data.shared_turns());
        let shared = shared.as_deref();
        // The body (a POST's; another method's is read and ignored, so the connection stays
        // usable), at most one record's size.
        let cap = local.limits().max_entry().max(RETRY_BUFFER_LIMIT);
        let body = match Self::read_body(session, cap).await? {
            Ok(b) => b,
            Err(limit) => {
                session.set_keepalive(None);
                return respond_error(session, ctx, &GatewayError::BodyTooLarge { limit }).await;
            }
        };
        // A key that names a tenant: that tenant's conversations. A key that names none is
        // refused where the rules define tenants, and means nothing where they define none
        // (clients send one whatever the server).
        if view.has_tenants() && session.req_header().headers.contains_key("authorization") {
            match self.authenticate(view, session.req_header()) {
                Ok(t) => ctx.tenant = Some(t),
                Err(err) => return respond_error(session, ctx, &err).await,
            }
        }
        // A tenant's calls count against its request rate, as its inference requests do.
        if let Some(t) = ctx.tenant.clone() {
            if let Err(l) = self.data.limits.take_request(&t, Instant::now()) {
                let err = self.limited(&t, l);
                return respond_error(session, ctx, &err).await;
            }
        }
        if !local.enabled() {
            return respond_error(session, ctx, &GatewayError::ConversationsOff).await;
        }
        let tenant = ctx.tenant.as_ref().map(|t| t.id.0.clone());
        let tenant = tenant.as_deref();
        let fields = if method == "POST" {
            match conv::body_object(&body) {
                Ok(o) => o,
                Err(err) => return respond_error(session, ctx, &err).await,
            }
        } else {
            serde_json::Map::new()
        };
        let rid = ctx.request_id.clone();
        let answer: std::result::Result<serde_json::Value, GatewayError> = async {
            Ok(match (what, method) {
                (Resource::Collection, _) => {
                    let items = conv::items(fields.get("items"), &rid)?;
                    let metadata = conv::metadata(fields.get("metadata"))?;
                    let created_at = crate::data_plane::now_ms() / 1000;
                    let record =
                        conv::create(&rid, tenant.map(str::to_owned), created_at, metadata, items);
                    conv::object(&*conv::keep(local, shared, record).await?)
                }
                (Resource::Conversation(id), "GET") => {
                    conv::object(&*conv::find(local, shared, id, tenant).await?)
                }
                (Resource::Conversation(id), "POST") => {
                    let Some(metadata) = conv::metadata(fields.get("metadata"))? else {
                        return Err(GatewayError::Body(prompt_profile::BodyError {
                            code: "missing_parameter",
                            param: Some("metadata".into()),
                            message: "a conversation's update sets its `metadata`".into(),
                        }));
                    };
                    let change = conv::set_metadata(metadata);
                    conv::object(&*conv::update(local, shared, id, tenant, change).await?)
                }
                (Resource::Conversation(id), _) => {
                    conv::find(local, shared, id, tenant).await?;
                    crate::response_store::remove(local, shared, id).await;
                    conv::deleted(id)
                }
                (Resource::Items(id), "GET") => {
                    let r = conv::find(local, shared, id, tenant).await?;
                    crate::response_store::items_page(r.input.clone(), query)?
                }
                (Resource::Items(id), _) => {
                    let items = conv::items(fields.get("items"), &rid)?;
                    if items.is_empty() {
                        return Err(GatewayError::Body(prompt_profile::BodyError {
                            code: "missing_parameter",
                            param: Some("items".into()),
                            message: "`items` names the items to add (1 to 20)".into(),
                        }));
                    }
                    let added = items.clone();
                    conv::update(local, shared, id, tenant, conv::append(items)).await?;
                    crate::response_store::list(&added, false)
                }
                (Resource::Item(id, item), "GET") => {
                    conv::item(&*conv::find(local, shared, id, tenant).await?, item)?
                }
                (Resource::Item(id, item), _) => {
                    conv::item(&*conv::find(local, shared, id, tenant).await?, item)?;
                    let change = conv::remove_item(item);
                    conv::object(&*conv::update(local, shared, id, tenant, change).await?)
                }
            })
        }
        .await;
        match answer {
            Ok(body) => crate::request::respond_json(session, ctx, &body).await,
            Err(err) => respond_error(session, ctx, &err).await,
        }
    }

    /// `GET /v1/responses/{id}?stream=true[&starting_after=N]` of a background response: its
    /// events from `from` on while this gateway runs it; else (ended, or run by another
    /// replica) its final event once it has ended.
    async fn resume(
        &self,
        session: &mut Session,
        ctx: &mut RequestCtx,
        id: &str,
        from: u64,
    ) -> Result<bool> {
        if let Some(job) = self.data.background.stream_of(id) {
            if let Some(log) = job.events() {
                return crate::background::stream(session, ctx, log, from).await;
            }
        }
        let data = self.data.clone();
        let key = id.to_owned();
        let poll = move || {
            let (data, id) = (data.clone(), key.clone());
            async move {
                let shared = data.shared_turns();
                crate::response_store::find(&data.responses, shared.as_deref(), &id).await
            }
        };
        // Cluster mode: from the events another replica mirrored.
        let mirror = self.data.shared_turns();
        crate::background::stream_elsewhere(session, ctx, mirror, id, from, poll).await
    }

    /// Cancels the background response `id`: here when this gateway runs it, else (cluster
    /// mode) by asking the replica that does and waiting, at most
    /// [`crate::background::CANCEL_WAIT`], for its record to end. The record as it then is.
    async fn cancel_background(
        &self,
        id: &str,
    ) -> Option<Arc<crate::response_store::StoredResponse>> {
        let (local, shared) = (&self.data.responses, self.data.shared_turns());
        if self.data.background.cancel(&self.data, id) {
            return local.peek(id);
        }
        let shared = shared.as_deref()?;
        shared.cancel(id);
        let deadline = Instant::now() + crate::background::CANCEL_WAIT;
        loop {
            let r = crate::response_store::find(local, Some(shared), id).await;
            if !r.as_ref().is_some_and(|r| r.running()) || Instant::now() >= deadline {
                return r;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// Accepts the background request of `ctx` (its decision taken): stores its `queued`
    /// record, hands the request to a job ([`crate::background::run`]) and answers the record.
    async fn detach(&self, session: &mut Session, ctx: &mut RequestCtx) -> Result<bool> {
        let id = format!("resp_{}", ctx.request_id);
        let (Some(capture), Some(stored)) = (ctx.capture.as_ref(), ctx.stored.as_ref()) else {
            let err = GatewayError::Internal {
                reason: "a background request without its capture".into(),
            };
            return respond_error(session, ctx, &err).await;
        };
        let created_at = crate::data_plane::now_ms() / 1000;
        let queued = crate::background::queued_response(
            &id,
            ctx.model.as_deref(),
            &ctx.body,
            stored,
            created_at,
        );
        let gateway = self.data.gateway_id.as_str();
        let pending = Arc::new(capture.pending_turn(id.clone(), queued).run_by(gateway));
        if pending.bytes() > self.data.responses.limits().max_entry() {
            let limit = self.data.responses.limits().max_entry();
            return respond_error(session, ctx, &GatewayError::BodyTooLarge { limit }).await;
        }
        let streamed = capture.streamed();
        let job = match self.data.background.start(pending.clone(), streamed) {
            Ok(j) => j,
            Err(err) => return respond_error(session, ctx, &err).await,
        };
        let shared = self.data.shared_turns();
        crate::response_store::keep(&self.data.responses, shared.as_deref(), pending.clone());
        // The request (its decision, load, drain guard, tenant slot) goes to the job; this
        // context keeps what the access log of the accepting answer reads.
        let mut job_ctx = std::mem::take(ctx);
        job_ctx.job = Some(job.clone());
        ctx._live = Some(self.data.drain.enter());
        ctx.detached = true;
        ctx.started = job_ctx.started;
        ctx.request_id.clone_from(&job_ctx.request_id);
        ctx.client_request_id.clone_from(&job_ctx.client_request_id);
        ctx.view.clone_from(&job_ctx.view);
        ctx.service.clone_from(&job_ctx.service);
        ctx.tenant.clone_from(&job_ctx.tenant);
        ctx.model.clone_from(&job_ctx.model);
        ctx.body = job_ctx.body.clone();
        let head = session.req_header().clone();
        let origin = crate::background::Origin {
            listener: self.listener.clone(),
            client: session.client_addr().map(|a| a.to_string()),
        };
        tokio::spawn(crate::background::run(
            self.data.clone(),
            head,
            origin,
            job_ctx,
            job.clone(),
        ));
        match job.events() {
            // Streamed: its events as they come (the job goes on if the client goes).
            Some(log) => crate::background::stream(session, ctx, log, 0).await,
            None => crate::request::respond_json(session, ctx, &pending.retrieved()).await,
        }
    }

    /// `POST /v1/responses/input_tokens`: the prompt's tokens as a create of the same body would
    /// send them (a conversation continued by `previous_response_id` whole), counted here with
    /// the service's pinned profile ([`route::input_tokens`], on the routing pool); no worker is
    /// asked, so nothing is decided, ticketed or receipted.
    async fn count_input_tokens(
        &self,
        session: &mut Session,
        ctx: &mut RequestCtx,
        service: &ServiceRoute,
        body: Bytes,
    ) -> Result<bool> {
        let body = match self.prepare(ctx, service, &body).await {
            Ok(p) => p.body.unwrap_or(body),
            Err(err) => return respond_error(session, ctx, &err).await,
        };
        let Some(profile) = service.prefix.as_ref().map(|p| p.profile.clone()) else {
            return match self.count_on_worker(service, body).await {
                Ok((status, answer)) => {
                    crate::request::respond_worker_json(session, ctx, status, answer).await
                }
                Err(err) => respond_error(session, ctx, &err).await,
            };
        };
        let count = move || route::input_tokens(&profile, &body);
        let counted = match &self.routing {
            Some(pool) => pool
                .run(count)
                .await
                .unwrap_or_else(|e| Err(pool_failed(e, "counting"))),
            None => count(),
        };
        match counted {
            Ok(n) => {
                let answer =
                    serde_json::json!({"object": "response.input_tokens", "input_tokens": n});
                crate::request::respond_json(session, ctx, &answer).await
            }
            Err(err) => respond_error(session, ctx, &err).await,
        }
    }

    /// `POST /v1/responses/input_tokens` on a service that pins no profile (round robin): asks
    /// the first routable kvgate worker of its pool (`POST /v1/responses/input_tokens` with the
    /// gateway's access token, at most [`COUNT_TIMEOUT`]), whose count is its own prompt
    /// contract's, and answers what it answers (its 4xx as they are). No kvgate worker in the
    /// pool, or one that does not count (404): `input_tokens_unavailable`; none routable:
    /// `no_healthy_worker`.
    async fn count_on_worker(
        &self,
        service: &ServiceRoute,
        body: Bytes,
    ) -> std::result::Result<(u16, Vec<u8>), GatewayError> {
        let unavailable = || GatewayError::InputTokensUnavailable {
            service: service.name().to_owned(),
        };
        // (worker, URL, routable) of the pool's kvgate workers, in pool order.
        let kvgate: Vec<(prefix_index::WorkerId, String, bool)> = {
            let view = self.data.views.load();
            let mut found = Vec::new();
            for id in &service.pool {
                let Some(e) = view.workers.get(id) else {
                    continue;
                };
                if e.spec.kind == routing_rules::schema::UpstreamKind::Kvgate {
                    found.push((id.clone(), e.spec.url.clone(), e.routable()));
                }
            }
            found
        };
        if kvgate.is_empty() {
            return Err(unavailable());
        }
        let Some((id, base, _)) = kvgate.into_iter().find(|w| w.2) else {
            return Err(GatewayError::NoHealthyWorker {
                service: service.name().to_owned(),
            });
        };
        let url = format!("{}/v1/responses/input_tokens", base.trim_end_matches('/'));
        let token = receipts::AccessToken::new(&self.data.gateway_id, &id, receipts::now_ms())
            .sign(&self.data.signer);
        let failed = |reason: String| GatewayError::UpstreamUnavailable {
            service: service.name().to_owned(),
            reason,
        };
        let mut sent = self
            .data
            .http
            .post(url)
            .bearer_auth(token)
            .header("content-type", "application/json")
            .timeout(COUNT_TIMEOUT)
            .body(body)
            .send()
            .await
            .map_err(|e| failed(format!("{id}: {e}")))?;
        let status = sent.status().as_u16();
        if status == 404 {
            return Err(unavailable());
        }
        // A count is a few bytes: an answer over 64 KiB is not one.
        let mut answer = Vec::new();
        while let Some(chunk) = sent
            .chunk()
            .await
            .map_err(|e| failed(format!("{id}: {e}")))?
        {
            if answer.len() + chunk.len() > RETRY_BUFFER_LIMIT {
                return Err(GatewayError::Upstream {
                    worker: id.0.clone(),
                    reason: "counting input tokens: an answer over 64 KiB".into(),
                });
            }
            answer.extend_from_slice(&chunk);
        }
        if status >= 500 || serde_json::from_slice::<serde::de::IgnoredAny>(&answer).is_err() {
            return Err(GatewayError::Upstream {
                worker: id.0.clone(),
                reason: format!("counting input tokens: status {status}"),
            });
        }
        Ok((status, answer))
    }

    /// What storing does to the Responses API body of `ctx` on `service`
    /// ([`crate::response_store::prepare`]: a conversation continued or named, sent whole).
    async fn prepare(
        &self,
        ctx: &RequestCtx,
        service: &ServiceRoute,
        body: &[u8],
    ) -> std::result::Result<crate::response_store::Prepared, GatewayError> {
        let tenant = ctx.tenant.as_ref().map(|t| t.id.0.as_str());
        let shared = self.data.shared_turns();
        let limit = service.spec().max_body_bytes;
        crate::response_store::prepare(&self.data.responses, shared.as_deref(), body, tenant, limit)
            .await
    }

    /// The 429 for a tenant over its limit (counted).
    fn limited(&self, t: &TenantSpec, l: crate::limits::Limited) -> GatewayError {
        self.data
            .metrics
            .rate_limited
            .get_or_create(&TenantLimitLabels {
                tenant: t.id.0.clone(),
                limit: l.what.to_owned(),
            })
            .inc();
        GatewayError::RateLimited {
            tenant: t.id.0.clone(),
            limit: l.what,
            // Whole seconds, rounded up, at least 1 (`Retry-After` takes integers).
            retry_after_s: (l.retry_after_s.ceil() as u64).max(1),
        }
    }

    /// Reads the whole request body with a cap. `Err(limit)` when over the cap.
    async fn read_body(
        session: &mut Session,
        cap: usize,
    ) -> Result<std::result::Result<Bytes, usize>> {
        let expected = declared_length(session.req_header());
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
}

/// The 405 for `method` on a path that serves `allowed` (`"GET, DELETE"`), when it is not one
/// of them; the connection then closes (its body stays unread).
fn refuse_method(
    session: &mut Session,
    method: &str,
    allowed: &'static str,
) -> Option<GatewayError> {
    if allowed.split(", ").any(|m| m == method) {
        return None;
    }
    session.set_keepalive(None);
    Some(GatewayError::MethodNotAllowed {
        method: method.to_owned(),
        path: session.req_header().uri.path().to_owned(),
        allowed,
    })
}

/// The longest a count asked of a worker may take (`Proxy::count_on_worker`).
const COUNT_TIMEOUT: Duration = Duration::from_secs(10);

/// A job the routing pool did not run, as the client's error: 503 when its queue is full.
fn pool_failed(e: PoolError, job: &str) -> GatewayError {
    match e {
        PoolError::Full => GatewayError::Overloaded {
            what: "the routing pool's queue is full",
        },
        PoolError::Lost => GatewayError::Internal {
            reason: format!("the {job} job did not complete"),
        },
    }
}

#[async_trait]
impl ProxyHttp for Proxy {
    type CTX = RequestCtx;

    fn new_ctx(&self) -> RequestCtx {
        RequestCtx {
            _live: Some(self.data.drain.enter()),
            ..RequestCtx::default()
        }
    }

    async fn request_filter(&self, session: &mut Session, ctx: &mut RequestCtx) -> Result<bool> {
        ctx.started = Some(Instant::now());
        // Draining: this answer closes its connection (`Connection: close`), so that the
        // client's next request opens a new one, which the VIP sends to another replica.
        if self.data.drain.draining() {
            session.set_keepalive(None);
        }
        ctx.request_id = self.data.request_ids.mint();
        ctx.client_request_id = client_request_id(session.req_header());
        let view = self.data.views.load();
        ctx.view = Some(view.clone());
        let req = session.req_header();
        let path = req.uri.path().to_owned();
        let method = req.method.as_str().to_owned();
        let host = header_str(req, "host").or_else(|| req.uri.host().map(str::to_owned));
        let expect_continue =
            header_str(req, "expect").is_some_and(|v| v.eq_ignore_ascii_case("100-continue"));
        let endpoint = Endpoint::from_path(&path);
        // The OpenAI API's own paths have fixed methods: refuse others before routing, so a
        // worker never sees (and never has to receipt) a request it cannot serve.
        if let Some(allowed) = crate::protocol::allowed_method(&path) {
            if method != allowed {
                session.set_keepalive(None);
                let err = GatewayError::MethodNotAllowed {
                    method,
                    path,
                    allowed,
                };
                return respond_error(session, ctx, &err).await;
            }
        }

        let listener = self.listener.as_deref();
        // `GET /v1/models[/{id}]`: answered here when every service that could take it names
        // its models (with models told apart by `match.models`, no one worker knows them all).
        if method == "GET" {
            if let Some(one) = models_path(&path) {
                if let Some(services) = view.listing_services(listener, host.as_deref(), &path) {
                    let services: Vec<Arc<ServiceRoute>> = services.into_iter().cloned().collect();
                    return self
                        .answer_models(session, ctx, &view, &services, one)
                        .await;
                }
            }
        }
        // Stored responses (`GET`/`DELETE /v1/responses/{id}`, `GET …/input_items`): the
        // gateway's own.
        if let Some((id, what)) = crate::response_store::resource_path(&path) {
            let (id, query) = (
                id.to_owned(),
                session.req_header().uri.query().map(str::to_owned),
            );
            return self
                .answer_stored(session, ctx, &view, &method, &id, what, query.as_deref())
                .await;
        }
        // The Conversations API: the gateway's own.
        if let Some(what) = crate::conversation::resource_path(&path) {
            let query = session.req_header().uri.query().map(str::to_owned);
            return self
                .answer_conversation(session, ctx, &view, &method, what, query.as_deref())
                .await;
        }
        let Some(limit) = view.body_limit_for(listener, host.as_deref(), &path) else {
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
            // A declared length over the cap is refused before the client is told to send it.
            if declared_length(session.req_header()).is_some_and(|n| n > cap) {
                session.set_keepalive(None);
                let err = GatewayError::BodyTooLarge { limit: cap };
                return respond_error(session, ctx, &err).await;
            }
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
        // A prompt-carrying body that is not a JSON object is the client's error, whatever the
        // rules match on.
        let counting = path.trim_end_matches('/') == crate::protocol::INPUT_TOKENS_PATH;
        if endpoint.is_some() || counting {
            if let Err(err) = crate::protocol::check_json_object(&body) {
                return respond_error(session, ctx, &err).await;
            }
        }
        let model = crate::protocol::peek_model(&body);
        ctx.model.clone_from(&model);
        let Some(service) = view
            .match_service(listener, host.as_deref(), &path, model.as_deref())
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
        ctx.service = Some(service.clone());
        if service.spec().auth == AuthPolicy::ApiKey {
            match self.authenticate(&view, session.req_header()) {
                Ok(t) if !t.may_use(service.name()) => {
                    // Answered as a service that does not exist: a tenant learns nothing of
                    // the services it may not call.
                    self.data
                        .metrics
                        .tenant_denied
                        .get_or_create(&crate::metrics::TenantServiceLabels {
                            tenant: t.id.0.clone(),
                            service: service.name().to_owned(),
                        })
                        .inc();
                    ctx.tenant = Some(t);
                    let err = GatewayError::ServiceNotFound {
                        method,
                        path,
                        model,
                    };
                    return respond_error(session, ctx, &err).await;
                }
                Ok(t) => ctx.tenant = Some(t),
                Err(err) => return respond_error(session, ctx, &err).await,
            }
        }
        if let Some(t) = ctx.tenant.clone() {
            // The concurrency limit first: a request it refuses spends nothing of the buckets.
            match self.data.limits.enter(&t) {
                Ok(slot) => ctx._tenant_slot = Some(slot),
                Err(l) => {
                    let err = self.limited(&t, l);
                    return respond_error(session, ctx, &err).await;
                }
            }
            if let Err(l) = self.data.limits.take_request(&t, Instant::now()) {
                let err = self.limited(&t, l);
                return respond_error(session, ctx, &err).await;
            }
        }
        if counting {
            return self.count_input_tokens(session, ctx, &service, body).await;
        }
        // The Responses API's stored conversations: one continued by `previous_response_id` is
        // sent whole (and routed as such); an answer to store is read on its way back.
        let body = if endpoint == Some(Endpoint::Responses) {
            match self.prepare(ctx, &service, &body).await {
                Ok(p) => {
                    ctx.capture = p.capture.map(Box::new);
                    ctx.stored = p.stored;
                    ctx.background = p.background;
                    p.body.unwrap_or(body)
                }
                Err(err) => return respond_error(session, ctx, &err).await,
            }
        } else {
            body
        };
        let tenant_header =
            RouteInput::tenant_header(&service).and_then(|h| header_str(session.req_header(), &h));
        let input = RouteInput {
            service: service.clone(),
            path: path.clone(),
            body: body.clone(),
            tenant_header,
            tenant: ctx.tenant.as_ref().map(|t| t.id.0.clone()),
            claiming: self.data.claims.load().is_some(),
            numbering: self.data.holdings_seq.clone(),
        };
        let (decided, decision_cpu) =
            if let (true, Some(pool)) = (service.prefix.is_some(), &self.routing) {
                // CPU in proportion to the prompt: on the bounded routing pool.
                let (view, data) = (view.clone(), self.data.clone());
                match pool
                    .run(move || route::decide_timed(&view, &data.index, &input))
                    .await
                {
                    Ok(d) => d,
                    Err(e) => (Err(pool_failed(e, "routing")), None),
                }
            } else {
                route::decide_timed(&view, &self.data.index, &input)
            };
        // Cluster claims: a cold placement is settled atomically with the other replicas'.
        let decided = match decided {
            Ok((mut d, mut reserved)) => {
                if let Some(claims) = self.data.claims.load_full() {
                    claims
                        .settle(&view, &self.data, &service, &mut d, &mut reserved)
                        .await;
                }
                Ok((d, reserved))
            }
            Err(e) => Err(e),
        };
        let decision_time = ctx.started.map(|s| s.elapsed()).unwrap_or_default();
        ctx.decision_done = Some(Instant::now());
        let handles = service.handles(&self.data.metrics);
        handles.route_decision.observe(decision_time.as_secs_f64());
        if let Some(cpu) = decision_cpu {
            handles.route_decision_cpu.observe(cpu.total.as_secs_f64());
            if service.prefix.is_some() {
                handles
                    .route_tokenize_cpu
                    .observe(cpu.tokenize.as_secs_f64());
            }
        }
        let decision = match decided {
            Ok((d, reserved)) => {
                self.data.share_holding(&d);
                // The first choice's load, counted from the decision on (the first attempt
                // keeps it).
                ctx.in_flight = reserved;
                d
            }
            Err(err) => {
                let label = match &err {
                    GatewayError::InvalidBody { .. }
                    | GatewayError::Body(_)
                    | GatewayError::Prompt { .. } => Some("unparsable_body"),
                    GatewayError::ContextLengthExceeded { .. } => Some("budget"),
                    GatewayError::NoHealthyWorker { .. } => Some("unhealthy"),
                    _ => None,
                };
                if let Some(l) = label {
                    self.data.metrics.fallback(service.name(), l);
                }
                ctx.body = body;
                return respond_error(session, ctx, &err).await;
            }
        };
        if let Some(t) = &ctx.tenant {
            // Prompt tokens as the gateway counted them (kv_exact), else body bytes / 4; plus
            // the output tokens asked for.
            let prompt = decision.prompt.as_ref().map_or(
                prompt_profile::work::untokenized_prompt_tokens(body.len()),
                |p| p.prompt_tokens as u64,
            );
            let tokens = prompt.saturating_add(crate::protocol::peek_output_tokens(&body));
            if let Err(l) = self.data.limits.take_tokens(t, tokens, Instant::now()) {
                let err = self.limited(t, l);
                ctx.body = body;
                return respond_error(session, ctx, &err).await;
            }
        }
        let svc_name = service.name().to_owned();
        if let Some(l) = route::fallback_label(decision.reason) {
            self.data.metrics.fallback(&svc_name, l);
        }
        for l in &decision.extra_fallbacks {
            self.data.metrics.fallback(&svc_name, l);
        }
        if let Some(p) = &decision.prompt {
            let h = service.handles(&self.data.metrics);
            h.lookup_tokens.inc_by(p.prompt_tokens as u64);
            if let Some(first) = decision.order.first() {
                let predicted = decision.predicted_tokens(first).unwrap_or(0);
                h.matched_tokens.inc_by(u64::from(predicted));
            }
        }
        ctx.decision = Some(Box::new(decision));
        ctx.body = body;
        if ctx.background {
            return self.detach(session, ctx).await;
        }
        if ctx.body.len() > RETRY_BUFFER_LIMIT {
            // pingora would forward only the headers of a body its retry buffer truncated.
            crate::forward::forward(&self.data, session, ctx).await?;
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
        if ctx.decision.is_none() {
            return Err(Error::explain(ErrorType::InternalError, "no decision"));
        }
        let Some(worker) = upstream::next_candidate(&self.data, ctx) else {
            return Err(Error::explain(
                ErrorType::ConnectNoRoute,
                "no candidate left",
            ));
        };
        // A new attempt: a refusal's retry flag never outlives the attempt it was set for.
        ctx.retrying_refusal = false;
        let entry = view
            .workers
            .get(&worker)
            .ok_or_else(|| Error::explain(ErrorType::InternalError, "worker left the view"))?;
        let spec = ctx
            .service
            .as_ref()
            .map(|s| s.spec().upstream.clone())
            .unwrap_or_default();
        let peer = upstream::peer_for(&entry.upstream, &spec, self.data.upstream_identity.as_ref());
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
            self.data.mark_failure(w, true);
            if let Some(s) = &ctx.service {
                self.data.metrics.fallback(s.name(), "connect");
            }
        }
        // Nothing was sent yet: try the next candidate if there is one.
        e.set_retry(upstream::candidate_left(&self.data, ctx));
        e
    }

    async fn upstream_request_filter(
        &self,
        _session: &mut Session,
        head: &mut RequestHeader,
        ctx: &mut RequestCtx,
    ) -> Result<()> {
        let Some(worker) = ctx.current.clone() else {
            return Err(Error::explain(ErrorType::InternalError, "no worker chosen"));
        };
        upstream::begin_attempt(&self.data, ctx, &worker);
        upstream::prepare_head(head, ctx, false)
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
        resp: &mut ResponseHeader,
        ctx: &mut RequestCtx,
    ) -> Result<()> {
        upstream::on_response(&self.data, resp, ctx)?;
        if upstream::retry_refusal(&self.data, ctx) {
            // Nothing reached the client: pingora's loop asks `upstream_peer` for the next
            // candidate and re-sends the buffered body (`error_while_proxy` keeps the retry).
            ctx.retrying_refusal = true;
            let mut e = Error::explain(
                ErrorType::HTTPStatus(resp.status.as_u16()),
                "the worker refused the request before answering: offered to the next candidate",
            );
            e.set_retry(true);
            return Err(e);
        }
        Ok(())
    }

    fn error_while_proxy(
        &self,
        peer: &HttpPeer,
        session: &mut Session,
        e: Box<Error>,
        ctx: &mut RequestCtx,
        client_reused: bool,
    ) -> Box<Error> {
        let mut e = e.more_context(format!("Peer: {peer}"));
        if std::mem::take(&mut ctx.retrying_refusal) {
            // A refusal (`upstream_response_filter`): the worker did not take the request.
            e.set_retry(true);
        } else if !session.req_header().method.is_idempotent()
            || session.as_ref().retry_buffer_truncated()
        {
            // pingora's own policy: a POST that reached a worker is never sent again.
            e.set_retry(false);
        } else {
            e.retry.decide_reuse(client_reused);
        }
        e
    }

    fn suppress_proxy_warn_log(
        &self,
        _session: &Session,
        ctx: &RequestCtx,
        e: &Error,
        _context: pingora::proxy::ProxyWarnLogContext,
    ) -> bool {
        // A retried refusal is routine under load (counted, logged at debug), not a failure.
        ctx.refusals > 0
            && matches!(e.etype(), ErrorType::HTTPStatus(s) if upstream::is_refusal(*s))
    }

    fn response_body_filter(
        &self,
        _session: &mut Session,
        body: &mut Option<Bytes>,
        end_of_stream: bool,
        ctx: &mut RequestCtx,
    ) -> Result<Option<Duration>> {
        let chunk = body.as_deref().unwrap_or_default();
        upstream::on_body(&self.data, ctx, chunk, end_of_stream);
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
        self.data.finish_request(ctx);
        if let Some(log) = &self.data.access {
            let req = session.req_header();
            let path = req.uri.path_and_query().map_or("", |p| p.as_str());
            log.append(&crate::access_log::AccessRecord::of(
                ctx,
                self.listener.as_deref(),
                req.method.as_str(),
                path,
                session.client_addr().map(|a| a.to_string()),
                session.body_bytes_sent(),
            ));
        }
    }

    async fn fail_to_proxy(
        &self,
        session: &mut Session,
        e: &Error,
        ctx: &mut RequestCtx,
    ) -> pingora::proxy::FailToProxy {
        let service = ctx
            .service
            .as_ref()
            .map(|s| s.name().to_owned())
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
