//! The gateway's own forwarding path for request bodies larger than pingora's 64 KiB retry
//! buffer (pingora 0.9 re-sends a body consumed before peer selection only from that buffer;
//! above it the upstream would get the headers and no body).
//!
//! Same semantics as the proxy path, through the same [`crate::upstream`] steps: candidates in
//! the decision's order; a connect failure (nothing sent) moves to the next candidate, and so
//! does a worker's refusal before answering (429 / 503, [`upstream::retry_refusal`]); otherwise,
//! once the request head was written to a worker the request is never sent anywhere else. The response
//! streams back chunk by chunk (SSE included). A fresh upstream connection is used for each
//! such request and closed after it (`connection: close`), so a stale pooled connection can never turn into a
//! spurious failure after bytes were sent.
//!
//! The answer goes to a [`Downstream`]: the client's pingora session, or a background
//! response's collector ([`crate::background`]), which has no client connection.

use async_trait::async_trait;
use bytes::Bytes;
use pingora::http::{RequestHeader, ResponseHeader};
use pingora::prelude::Session;
use pingora::Result;

use std::sync::Arc;

use crate::data_plane::DataPlane;
use crate::error::GatewayError;
use crate::request::{respond_error, RequestCtx};
use crate::upstream;

/// Where a forwarded answer goes.
#[async_trait]
pub(crate) trait Downstream: Send {
    /// The client's request head (sent on, prepared for the worker).
    fn request_head(&self) -> &RequestHeader;
    /// The gateway's own error answer (no worker answered); recorded in `ctx`.
    async fn fail(&mut self, ctx: &mut RequestCtx, err: &GatewayError) -> Result<()>;
    /// The worker's response head, decorated.
    async fn head(&mut self, resp: ResponseHeader) -> Result<()>;
    /// A piece of the worker's answer; `end` after the last.
    async fn body(&mut self, chunk: Bytes, end: bool) -> Result<()>;
}

#[async_trait]
impl Downstream for Session {
    fn request_head(&self) -> &RequestHeader {
        self.req_header()
    }

    async fn fail(&mut self, ctx: &mut RequestCtx, err: &GatewayError) -> Result<()> {
        respond_error(self, ctx, err).await.map(|_| ())
    }

    async fn head(&mut self, resp: ResponseHeader) -> Result<()> {
        self.write_response_header(Box::new(resp), false).await
    }

    async fn body(&mut self, chunk: Bytes, end: bool) -> Result<()> {
        self.write_response_body(Some(chunk), end).await
    }
}

/// Forwards the buffered request of `ctx` and streams the answer to `session`. Always leaves a
/// response on the session (an error response when no worker could be reached).
pub(crate) async fn forward<D: Downstream + ?Sized>(
    data: &Arc<DataPlane>,
    session: &mut D,
    ctx: &mut RequestCtx,
) -> Result<()> {
    let (Some(view), Some(service), Some(_)) =
        (ctx.view.clone(), ctx.service.clone(), ctx.decision.as_ref())
    else {
        let err = GatewayError::Internal {
            reason: "forward without a decision".into(),
        };
        return session.fail(ctx, &err).await;
    };
    let connector = &data.connector;
    let mut last_err = String::from("no candidate");
    while let Some(worker) = upstream::next_candidate(data, ctx) {
        let worker = &worker;
        let Some(entry) = view.workers.get(worker) else {
            continue;
        };
        let peer = upstream::peer_for(
            &entry.upstream,
            &service.spec().upstream,
            data.upstream_identity.as_ref(),
        );
        let mut up = match connector.get_http_session(&peer).await {
            Ok((s, _reused)) => s,
            Err(e) => {
                data.mark_failure(worker, true);
                data.metrics.fallback(service.name(), "connect");
                last_err = e.to_string();
                continue;
            }
        };
        upstream::begin_attempt(data, ctx, worker);
        let mut head: RequestHeader = session.request_head().clone();
        upstream::prepare_head(&mut head, ctx, true)?;
        // From here on the worker may have accepted the request: no retry elsewhere.
        let sent = async {
            up.write_request_header(Box::new(head)).await?;
            up.write_request_body(ctx.body.clone(), true).await?;
            up.finish_request_body().await?;
            up.read_response_header().await
        }
        .await;
        if let Err(e) = sent {
            data.mark_failure(worker, false);
            let err = GatewayError::Upstream {
                worker: worker.0.clone(),
                reason: e.to_string(),
            };
            return session.fail(ctx, &err).await;
        }
        let Some(resp) = up.response_header() else {
            let err = GatewayError::Upstream {
                worker: worker.0.clone(),
                reason: "no response header".into(),
            };
            return session.fail(ctx, &err).await;
        };
        let mut resp: ResponseHeader = resp.clone();
        upstream::on_response(data, &mut resp, ctx)?;
        if upstream::retry_refusal(data, ctx) {
            // The worker refused before answering: nothing reached the client.
            up.shutdown().await;
            continue;
        }
        resp.remove_header("connection");
        session.head(resp).await?;
        loop {
            match up.read_response_body().await {
                Ok(Some(chunk)) => {
                    upstream::on_body(data, ctx, &chunk, false);
                    session.body(chunk, false).await?;
                }
                Ok(None) => break,
                Err(e) => {
                    ctx.error = Some(format!("upstream_error: {}", e.etype().as_str()));
                    // Cut short: nothing of it is stored.
                    ctx.capture = None;
                    break;
                }
            }
            if up.response_done() {
                break;
            }
        }
        upstream::on_body(data, ctx, &[], true);
        session.body(Bytes::new(), true).await?;
        up.shutdown().await;
        return Ok(());
    }
    let err = GatewayError::UpstreamUnavailable {
        service: service.name().to_owned(),
        reason: last_err,
    };
    session.fail(ctx, &err).await
}
