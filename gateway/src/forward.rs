//! The gateway's own forwarding path for request bodies larger than pingora's 64 KiB retry
//! buffer (pingora 0.9 re-sends a body consumed before peer selection only from that buffer;
//! above it the upstream would get the headers and no body).
//!
//! Same semantics as the proxy path: candidates in the decision's order; a connect failure
//! (nothing sent) moves to the next candidate; once the request head was written to a worker
//! the request is never sent anywhere else. The response streams back chunk by chunk (SSE
//! included). A fresh upstream connection is used for each such request and closed after it,
//! so a stale pooled connection can never turn into a spurious failure after bytes were sent.

use std::time::{Duration, Instant};

use bytes::Bytes;
use pingora::connectors::http::Connector;
use pingora::http::{RequestHeader, ResponseHeader};
use pingora::prelude::{HttpPeer, Session};
use pingora::Result;
use receipts::TICKET_HEADER;
use routing_rules::schema::UpstreamSpec;

use crate::error::GatewayError;
use crate::proxy::{
    respond_error, Proxy, RequestCtx, REASON_HEADER, VERSION_HEADER, WORKER_HEADER,
};
use crate::view::{InFlight, Upstream};

/// The pingora peer for a worker, with the service's timeouts.
pub fn peer_for(upstream: &Upstream, spec: &UpstreamSpec) -> HttpPeer {
    let mut peer = HttpPeer::new(upstream.addr, false, String::new());
    peer.options.connection_timeout = Some(Duration::from_millis(spec.connect_timeout_ms));
    peer.options.read_timeout = Some(Duration::from_millis(spec.read_timeout_ms));
    peer.options.idle_timeout = Some(Duration::from_millis(spec.idle_timeout_ms));
    peer.options.write_timeout = Some(Duration::from_millis(spec.read_timeout_ms));
    peer
}

/// Forwards the buffered request of `ctx` and streams the answer to `session`. Always leaves a
/// response on the session (an error response when no worker could be reached).
pub(crate) async fn forward(
    proxy: &Proxy,
    session: &mut Session,
    ctx: &mut RequestCtx,
) -> Result<()> {
    let (Some(view), Some(decision)) = (ctx.view.clone(), ctx.decision.clone()) else {
        let err = GatewayError::Internal {
            reason: "forward without a decision".into(),
        };
        respond_error(session, ctx, &err).await?;
        return Ok(());
    };
    let connector = Connector::new(None);
    let mut last_err = String::from("no candidate");
    for worker in &decision.order {
        ctx.next += 1;
        let Some(entry) = view.workers.get(worker) else {
            continue;
        };
        let peer = peer_for(&entry.upstream, &decision.service.spec().upstream);
        let mut upstream = match connector.get_http_session(&peer).await {
            Ok((s, _reused)) => s,
            Err(e) => {
                proxy.shared().mark_failure(worker, true);
                proxy
                    .shared()
                    .metrics
                    .fallback(decision.service.name(), "connect");
                last_err = e.to_string();
                continue;
            }
        };
        ctx.current = Some(worker.clone());
        ctx.in_flight = Some(InFlight::start(entry.runtime.clone()));
        let ticket = proxy.ticket_for(ctx, worker);
        let mut head: RequestHeader = session.req_header().clone();
        if !entry.upstream.base_path.is_empty() {
            let pq = head
                .uri
                .path_and_query()
                .map_or("/", |p| p.as_str())
                .to_owned();
            if let Ok(uri) = format!("{}{}", entry.upstream.base_path, pq).parse::<http::Uri>() {
                head.set_uri(uri);
            }
        }
        head.insert_header("host", entry.upstream.authority.as_str())?;
        head.insert_header("x-request-id", ctx.request_id.as_str())?;
        if let Some(t) = &ticket {
            head.insert_header(TICKET_HEADER, t.header())?;
        }
        head.remove_header("expect");
        head.remove_header("transfer-encoding");
        head.insert_header("content-length", ctx.body.len().to_string())?;
        head.insert_header("connection", "close")?;
        ctx.ticket = ticket;
        // From here on the worker may have accepted the request: no retry elsewhere.
        let sent = async {
            upstream.write_request_header(Box::new(head)).await?;
            upstream.write_request_body(ctx.body.clone(), true).await?;
            upstream.finish_request_body().await?;
            upstream.read_response_header().await
        }
        .await;
        if let Err(e) = sent {
            proxy.shared().mark_failure(worker, false);
            let err = GatewayError::Upstream {
                worker: worker.0.clone(),
                reason: e.to_string(),
            };
            respond_error(session, ctx, &err).await?;
            return Ok(());
        }
        let Some(resp) = upstream.response_header() else {
            let err = GatewayError::Upstream {
                worker: worker.0.clone(),
                reason: "no response header".into(),
            };
            respond_error(session, ctx, &err).await?;
            return Ok(());
        };
        let mut resp: ResponseHeader = resp.clone();
        let status = resp.status.as_u16();
        ctx.status = Some(status);
        if status >= 500 {
            proxy.shared().mark_failure(worker, false);
        } else {
            proxy.shared().mark_success(worker);
        }
        resp.insert_header(WORKER_HEADER, worker.0.as_str())?;
        resp.insert_header(REASON_HEADER, decision.reason.as_str())?;
        resp.insert_header(VERSION_HEADER, view.version().to_string())?;
        resp.insert_header("x-request-id", ctx.request_id.as_str())?;
        resp.remove_header("connection");
        session.write_response_header(Box::new(resp), false).await?;
        loop {
            match upstream.read_response_body().await {
                Ok(Some(chunk)) => {
                    if ctx.first_byte.is_none() && !chunk.is_empty() {
                        ctx.first_byte = Some(Instant::now());
                    }
                    session.write_response_body(Some(chunk), false).await?;
                }
                Ok(None) => break,
                Err(e) => {
                    ctx.error = Some(format!("upstream_error: {}", e.etype().as_str()));
                    break;
                }
            }
            if upstream.response_done() {
                break;
            }
        }
        session
            .write_response_body(Some(Bytes::new()), true)
            .await?;
        upstream.shutdown().await;
        return Ok(());
    }
    let err = GatewayError::UpstreamUnavailable {
        service: decision.service.name().to_owned(),
        reason: last_err,
    };
    respond_error(session, ctx, &err).await?;
    Ok(())
}
