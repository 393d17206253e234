//! The sidecar's generation path: admit (ticket), forward unchanged, relay the answer, receipt.
//!
//! Order of one request, and which outcomes get a receipt:
//! 1. [`TicketGate::admit`](crate::tickets::TicketGate::admit): 401/400, no receipt (the
//!    request was never accepted);
//! 2. the body, ≤ `max_body_bytes` (413, no receipt: the ticket is not used up);
//! 3. [`TicketGate::claim`](crate::tickets::TicketGate::claim): 401 `ticket_replayed`, no
//!    receipt (the first use has one);
//! 4. forward to the engine: unreachable → `503 engine_unavailable`, receipted;
//! 5. a whole answer (≤ `max_answer_bytes`, else `502 engine_answer_too_large`, receipted) is
//!    receipted with the engine's status and error code, then relayed byte for byte;
//! 6. a stream (`text/event-stream`) is relayed event by event; `data: [DONE]` waits for the
//!    receipt; a client that goes away (499 `client_disconnected`), an engine stream that breaks
//!    (`engine_stream_broken`, in-band error to the client) and a sidecar shutdown
//!    (`sidecar_stopping`) are receipted too.

use std::convert::Infallible;
use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use futures::StreamExt;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;
use serde_json::Value;
use sha2::{Digest, Sha256};
use tokio::sync::mpsc;

use super::usage::{event_data, SseFramer, Usage};
use super::SidecarState;
use crate::api_error::ApiError;
use crate::generate::{with_ids, CLIENT_CLOSED_STATUS};
use crate::tickets::{generate_request_id, REQUEST_ID_HEADER};

type Labels = Vec<(&'static str, String)>;

/// The sidecar's series (prefix `kvgate_sidecar_`).
#[derive(Clone)]
pub struct SidecarMetrics {
    requests: Family<Labels, Counter>,
    engine_failures: Family<Labels, Counter>,
    receipts_written: Counter,
    receipt_failures: Counter,
}

impl SidecarMetrics {
    pub(crate) fn register(
        registry: &mut Registry,
        drain: crate::drain::Drain,
        load: std::sync::Arc<super::load::LoadBook>,
    ) -> Self {
        let m = SidecarMetrics {
            requests: Family::default(),
            engine_failures: Family::default(),
            receipts_written: Counter::default(),
            receipt_failures: Counter::default(),
        };
        let r = registry.sub_registry_with_prefix("kvgate_sidecar");
        r.register(
            "requests",
            "Requests answered (generation and KV-event streams), by endpoint and status",
            m.requests.clone(),
        );
        r.register(
            "engine_failures",
            "Requests the engine did not answer properly, by code",
            m.engine_failures.clone(),
        );
        r.register(
            "receipts_written",
            "Receipts appended to the log",
            m.receipts_written.clone(),
        );
        r.register(
            "receipt_failures",
            "Receipts that could not be appended",
            m.receipt_failures.clone(),
        );
        r.register_collector(Box::new(crate::metrics::DrainCollector(drain)));
        r.register_collector(Box::new(super::load::LoadCollector(load)));
        m
    }

    pub(crate) fn request(&self, endpoint: &str, status: u16) {
        self.requests
            .get_or_create(&vec![
                ("endpoint", endpoint.to_string()),
                ("status", status.to_string()),
            ])
            .inc();
    }

    fn engine_failure(&self, code: &str) {
        self.engine_failures
            .get_or_create(&vec![("code", code.to_string())])
            .inc();
    }
}

/// `503 engine_unavailable` for an engine request that failed before any answer.
pub(crate) fn engine_unavailable(st: &SidecarState, e: &reqwest::Error) -> ApiError {
    st.metrics.engine_failure("engine_unavailable");
    let what = if e.is_timeout() {
        "timed out"
    } else if e.is_connect() {
        "refused the connection"
    } else {
        "failed"
    };
    let mut err = ApiError::new(
        StatusCode::SERVICE_UNAVAILABLE,
        "engine_unavailable",
        format!("the engine behind this sidecar {what}: {e}"),
    );
    err.retry_after_s = Some(st.cfg.retry_after_s);
    err
}

/// Reads a whole engine answer of at most `limit` bytes (`502 engine_answer_too_large`,
/// `502 engine_read_error`).
pub(crate) async fn read_bounded(resp: reqwest::Response, limit: usize) -> Result<Bytes, ApiError> {
    if resp.content_length().is_some_and(|n| n > limit as u64) {
        return Err(too_large(limit));
    }
    let mut out = Vec::new();
    let mut stream = resp.bytes_stream();
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(|e| {
            ApiError::new(
                StatusCode::BAD_GATEWAY,
                "engine_read_error",
                format!("reading the engine's answer failed: {e}"),
            )
        })?;
        if out.len() + chunk.len() > limit {
            return Err(too_large(limit));
        }
        out.extend_from_slice(&chunk);
    }
    Ok(Bytes::from(out))
}

fn too_large(limit: usize) -> ApiError {
    ApiError::new(
        StatusCode::BAD_GATEWAY,
        "engine_answer_too_large",
        format!("the engine's answer exceeds {limit} bytes"),
    )
}

fn to_hex_sha256(b: &[u8]) -> String {
    hex::encode(Sha256::digest(b))
}

/// Signs and appends `draft` (completion time stamped now) on the blocking pool.
async fn write_receipt(st: &SidecarState, mut draft: receipts::ReceiptDraft) -> bool {
    draft.completed_at_ms = receipts::now_ms();
    let log = st.receipts.clone();
    match tokio::task::spawn_blocking(move || log.append(draft)).await {
        Ok(Ok(_)) => {
            st.metrics.receipts_written.inc();
            true
        }
        Ok(Err(e)) => {
            st.metrics.receipt_failures.inc();
            tracing::error!(error = %e, "receipt append failed");
            false
        }
        Err(e) => {
            st.metrics.receipt_failures.inc();
            tracing::error!(error = %e, "receipt task failed");
            false
        }
    }
}

fn unreceipted(st: &SidecarState) -> ApiError {
    let mut e = ApiError::new(
        StatusCode::SERVICE_UNAVAILABLE,
        "receipt_failed",
        "the answer is withheld: its receipt could not be written to the receipt log",
    );
    e.retry_after_s = Some(st.cfg.retry_after_s);
    e
}

/// An error answer after the request was accepted: receipted first.
async fn receipted_error(
    st: &SidecarState,
    endpoint: &str,
    mut draft: receipts::ReceiptDraft,
    e: ApiError,
) -> Response {
    draft.status = e.status.as_u16();
    draft.error_code = Some(e.code.to_string());
    draft.response_sha256 = to_hex_sha256(b"");
    let id = draft.request_id.clone();
    let written = write_receipt(st, draft).await;
    let e = if written || !st.cfg.require_receipts {
        e
    } else {
        unreceipted(st)
    };
    st.metrics.request(endpoint, e.status.as_u16());
    with_ids(e.into_response(), &id, written)
}

/// The body with `cache_salt` set to `salt` (vLLM keeps each salt's prefix cache apart and
/// names the salt in its KV events, which is how [`super::vllm::mapping`] learns a chain's
/// namespace). A client's own `cache_salt` is replaced: the ticket's namespace already
/// includes it (the gateway derives the namespace from it). A body that is not a JSON object
/// goes unchanged (the engine refuses it).
///
/// The usual body has no `cache_salt`: the member is spliced in before the closing brace,
/// after one validating pass that reads only the top-level keys (the rest of the body is
/// copied, not re-serialised). A body that has one is rewritten whole, in key order.
pub(crate) fn with_cache_salt(body: Bytes, salt: &str) -> Bytes {
    let Ok(top) = serde_json::from_slice::<TopLevel>(&body) else {
        return body;
    };
    let member = format!(
        "\"cache_salt\":{}",
        serde_json::to_string(salt).unwrap_or_default()
    );
    if !top.has_salt {
        // A JSON object's last non-whitespace byte is its closing brace.
        if let Some(end) = body.iter().rposition(|&b| b == b'}') {
            let mut out = Vec::with_capacity(body.len() + member.len() + 1);
            out.extend_from_slice(&body[..end]);
            if top.members > 0 {
                out.push(b',');
            }
            out.extend_from_slice(member.as_bytes());
            out.extend_from_slice(&body[end..]);
            return Bytes::from(out);
        }
    }
    match serde_json::from_slice::<serde_json::Map<String, Value>>(&body) {
        Ok(mut obj) => {
            obj.insert("cache_salt".into(), Value::String(salt.to_string()));
            serde_json::to_vec(&obj).map(Bytes::from).unwrap_or(body)
        }
        Err(_) => body,
    }
}

/// A JSON object's top level, read without keeping its values: how many members, and whether
/// one is `cache_salt`.
struct TopLevel {
    members: usize,
    has_salt: bool,
}

impl<'de> serde::Deserialize<'de> for TopLevel {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = TopLevel;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut m: A,
            ) -> Result<TopLevel, A::Error> {
                let mut top = TopLevel {
                    members: 0,
                    has_salt: false,
                };
                while let Some(k) = m.next_key::<std::borrow::Cow<'de, str>>()? {
                    m.next_value::<serde::de::IgnoredAny>()?;
                    top.members += 1;
                    top.has_salt |= k == "cache_salt";
                }
                Ok(top)
            }
        }
        d.deserialize_map(V)
    }
}

/// One generation request (see the module doc).
pub(crate) async fn generate(
    st: Arc<SidecarState>,
    endpoint: &'static str,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let received_at_ms = receipts::now_ms();
    let early = |e: ApiError, id: Option<&str>| {
        st.metrics.request(endpoint, e.status.as_u16());
        let id = id.map(str::to_string).unwrap_or_else(generate_request_id);
        with_ids(e.into_response(), &id, false)
    };
    let admission = match st.tickets.admit(&headers) {
        Ok(a) => a,
        Err(e) => {
            let id = crate::tickets::header_request_id(&headers).ok().flatten();
            return early(e, id.as_deref());
        }
    };
    let bytes = match crate::generate::read_body(body, &headers, st.cfg.max_body_bytes).await {
        Ok(b) => b,
        Err(e) => return early(e, Some(&admission.request_id)),
    };
    if let Err(e) = st.tickets.claim(&admission) {
        return early(e, Some(&admission.request_id));
    }
    // Read without building the body's tree (the rest of it is skipped).
    #[derive(serde::Deserialize)]
    struct ModelOnly {
        model: Option<String>,
    }
    let requested_model = serde_json::from_slice::<ModelOnly>(&bytes)
        .ok()
        .and_then(|m| m.model)
        .unwrap_or_default();
    let draft = receipts::ReceiptDraft {
        request_id: admission.request_id.clone(),
        ticket: admission.ticket.clone(),
        model: requested_model,
        profile_digest: st.cfg.profile_digest.clone(),
        request_sha256: to_hex_sha256(&bytes),
        received_at_ms,
        ..receipts::ReceiptDraft::default()
    };

    // The load report's share of this request (`super::load`): the prompt tokens it must
    // still compute as its ticket counted them, else the gateways' estimate for a body nothing
    // tokenized; the output it asked for.
    let ticketed = admission.ticket.as_ref().map(|t| t.ticket_unverified());
    let prefill = match ticketed.and_then(|t| t.prompt_tokens) {
        Some(p) => u64::from(p).saturating_sub(u64::from(
            ticketed
                .and_then(|t| t.predicted_matched_tokens)
                .unwrap_or(0),
        )),
        None => prompt_profile::work::untokenized_prompt_tokens(bytes.len()),
    };
    let decode = prompt_profile::work::queued_output_tokens(&bytes);

    // Round robin's tickets name the all-zero namespace: those requests keep the engine's
    // shared cache.
    let forwarded = match (&st.cfg.engine_events, &admission.ticket) {
        (Some(_), Some(ticket)) if admission.namespace.0 != [0; 32] => with_cache_salt(
            bytes,
            &super::vllm::mapping::salt_for(
                ticket.ticket_unverified().hash_algorithm,
                &admission.namespace,
            ),
        ),
        _ => bytes,
    };
    let mut req = st
        .http
        .post(format!("{}{endpoint}", st.engine))
        .header(reqwest::header::CONTENT_TYPE, "application/json")
        .header(REQUEST_ID_HEADER, admission.request_id.as_str())
        .body(forwarded);
    if let Some(a) = headers.get(axum::http::header::ACCEPT) {
        req = req.header(reqwest::header::ACCEPT, a.as_bytes());
    }
    if let Some(k) = &st.cfg.engine_api_key {
        req = req.bearer_auth(k);
    }
    let work = st.load.begin(prefill, decode);
    let sent = tokio::select! {
        biased;
        _ = st.shutdown.cancelled() => None,
        r = req.send() => Some(r),
    };
    let resp = match sent {
        None => {
            let mut e = ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "sidecar_stopping",
                "the sidecar is shutting down",
            );
            e.retry_after_s = Some(st.cfg.retry_after_s);
            return receipted_error(&st, endpoint, draft, e).await;
        }
        Some(Err(e)) => {
            let e = engine_unavailable(&st, &e);
            return receipted_error(&st, endpoint, draft, e).await;
        }
        Some(Ok(r)) => r,
    };
    let status = resp.status().as_u16();
    let content_type = resp.headers().get(reqwest::header::CONTENT_TYPE).cloned();
    let is_sse = content_type
        .as_ref()
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("text/event-stream"));
    if is_sse && (200..300).contains(&status) {
        return stream(st, endpoint, draft, resp, work).await;
    }
    let answer = read_bounded(resp, st.cfg.max_answer_bytes).await;
    drop(work);
    let answer = match answer {
        Ok(b) => b,
        Err(e) => {
            st.metrics.engine_failure(e.code);
            return receipted_error(&st, endpoint, draft, e).await;
        }
    };
    let mut usage = Usage::default();
    let mut draft = draft;
    match serde_json::from_slice::<Value>(&answer) {
        Ok(v) if (200..300).contains(&status) => usage.feed(&v),
        Ok(v) => {
            draft.error_code =
                Some(Usage::error_code(&v).unwrap_or_else(|| format!("engine_http_{status}")))
        }
        Err(_) if (200..300).contains(&status) => {
            st.metrics.engine_failure("engine_answer_not_json");
            draft.error_code = Some("engine_answer_not_json".into());
        }
        Err(_) => draft.error_code = Some(format!("engine_http_{status}")),
    }
    fill(&mut draft, &usage);
    draft.status = status;
    let id = draft.request_id.clone();
    let written = write_receipt(&st, draft).await;
    if !written && st.cfg.require_receipts {
        let e = unreceipted(&st);
        st.metrics.request(endpoint, e.status.as_u16());
        return with_ids(e.into_response(), &id, false);
    }
    st.metrics.request(endpoint, status);
    let code = StatusCode::from_u16(status).unwrap_or(StatusCode::BAD_GATEWAY);
    let mut r = (code, answer).into_response();
    if let Some(ct) = content_type.and_then(|v| HeaderValue::from_bytes(v.as_bytes()).ok()) {
        r.headers_mut().insert(axum::http::header::CONTENT_TYPE, ct);
    }
    with_ids(r, &id, written)
}

/// The engine's accounting into the receipt.
fn fill(draft: &mut receipts::ReceiptDraft, usage: &Usage) {
    if let Some(m) = &usage.model {
        draft.model = m.clone();
    }
    draft.prompt_tokens = usage.prompt_tokens.unwrap_or(0);
    draft.cached_tokens = usage.cached_tokens.unwrap_or(0);
    draft.completion_tokens = usage.completion_tokens.unwrap_or(0);
    draft.finish_reason = usage.finish_reason();
    draft.response_sha256 = usage.response_sha256();
}

/// An OpenAI error as one SSE event.
fn error_event(e: &ApiError) -> Bytes {
    let body = serde_json::to_string(&e.body()).unwrap_or_default();
    Bytes::from(format!("data: {body}\n\n"))
}

/// Why a relayed stream ended.
enum End {
    /// `data: [DONE]` arrived (held back: the event itself).
    Done(Vec<u8>),
    /// The client went away.
    ClientGone,
    /// The engine's stream ended or broke before `[DONE]`.
    Broken(String),
    /// The sidecar is stopping.
    Stopping,
}

async fn stream(
    st: Arc<SidecarState>,
    endpoint: &'static str,
    mut draft: receipts::ReceiptDraft,
    resp: reqwest::Response,
    mut work: super::load::Work,
) -> Response {
    let (tx, rx) = mpsc::channel::<Result<Bytes, Infallible>>(16);
    let id = draft.request_id.clone();
    let st2 = st.clone();
    tokio::spawn(async move {
        let st = st2;
        let mut framer = SseFramer::new(st.cfg.max_event_bytes);
        let mut usage = Usage::default();
        let mut in_band_error: Option<String> = None;
        let mut chunks = resp.bytes_stream();
        let end = 'relay: loop {
            let next = tokio::select! {
                biased;
                _ = st.shutdown.cancelled() => break End::Stopping,
                _ = tx.closed() => break End::ClientGone,
                c = chunks.next() => c,
            };
            let chunk = match next {
                None => break End::Broken("the engine ended the stream before [DONE]".into()),
                Some(Err(e)) => break End::Broken(format!("the engine's stream broke: {e}")),
                Some(Ok(c)) => c,
            };
            let events = match framer.push(&chunk) {
                Ok(evs) => evs,
                Err(e) => break End::Broken(format!("an engine event exceeds {} bytes", e.0)),
            };
            for ev in events {
                if let Some(data) = event_data(&ev) {
                    if data.trim() == "[DONE]" {
                        break 'relay End::Done(ev);
                    }
                    if let Ok(v) = serde_json::from_str::<Value>(&data) {
                        if v.get("error").is_some() {
                            in_band_error = Usage::error_code(&v).or(Some("engine_error".into()));
                        }
                        let before = usage.produced;
                        let pieces = usage.pieces;
                        usage.feed(&v);
                        if usage.produced && !before && draft.first_token_at_ms.is_none() {
                            draft.first_token_at_ms = Some(receipts::now_ms());
                        }
                        if usage.pieces > pieces {
                            work.prefilled();
                            work.produced(usage.pieces - pieces);
                        }
                    }
                }
                if tx.send(Ok(Bytes::from(ev))).await.is_err() {
                    break 'relay End::ClientGone;
                }
            }
        };
        drop(chunks);
        drop(work);
        fill(&mut draft, &usage);
        draft.status = 200;
        draft.error_code = in_band_error;
        match end {
            End::Done(done) => {
                let written = write_receipt(&st, draft).await;
                let last = if written || !st.cfg.require_receipts {
                    Bytes::from(done)
                } else {
                    error_event(&unreceipted(&st))
                };
                let _ = tx.send(Ok(last)).await;
            }
            End::ClientGone => {
                draft.status = CLIENT_CLOSED_STATUS;
                draft.error_code = Some("client_disconnected".into());
                write_receipt(&st, draft).await;
            }
            End::Broken(why) => {
                st.metrics.engine_failure("engine_stream_broken");
                draft.finish_reason = None;
                draft.error_code = Some("engine_stream_broken".into());
                write_receipt(&st, draft).await;
                let e = ApiError::new(StatusCode::BAD_GATEWAY, "engine_stream_broken", why);
                let _ = tx.send(Ok(error_event(&e))).await;
            }
            End::Stopping => {
                draft.finish_reason = None;
                draft.error_code = Some("sidecar_stopping".into());
                write_receipt(&st, draft).await;
                let e = ApiError::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "sidecar_stopping",
                    "the sidecar is shutting down",
                );
                let _ = tx.send(Ok(error_event(&e))).await;
            }
        }
    });
    st.metrics.request(endpoint, 200);
    let body = Body::from_stream(tokio_stream_from(rx));
    let mut r = Response::new(body);
    r.headers_mut().insert(
        axum::http::header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream"),
    );
    r.headers_mut().insert(
        axum::http::header::CACHE_CONTROL,
        HeaderValue::from_static("no-cache"),
    );
    with_ids(r, &id, true)
}

fn tokio_stream_from(
    mut rx: mpsc::Receiver<Result<Bytes, Infallible>>,
) -> impl futures::Stream<Item = Result<Bytes, Infallible>> {
    futures::stream::poll_fn(move |cx| rx.poll_recv(cx))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cache_salt_is_set_or_replaced_and_the_rest_kept() {
        let body = Bytes::from_static(br#"{"model":"m","messages":[],"cache_salt":"mine","n":1}"#);
        let out = with_cache_salt(body, "kvgate/v1/xxh3/00");
        assert_eq!(
            &out[..],
            br#"{"model":"m","messages":[],"cache_salt":"kvgate/v1/xxh3/00","n":1}"#
        );
        let out = with_cache_salt(Bytes::from_static(br#"{"model":"m"}"#), "s");
        assert_eq!(&out[..], br#"{"model":"m","cache_salt":"s"}"#);
        // Spliced: the rest byte for byte (spacing, escapes), the member before the brace.
        let out = with_cache_salt(
            Bytes::from_static(b"{ \"a\" : \"x\\u0041}\" ,\"b\":[1, {}] }\n"),
            "s",
        );
        assert_eq!(
            &out[..],
            &b"{ \"a\" : \"x\\u0041}\" ,\"b\":[1, {}] ,\"cache_salt\":\"s\"}\n"[..]
        );
        let v: serde_json::Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(v["cache_salt"], "s");
        assert_eq!(
            &with_cache_salt(Bytes::from_static(b"{}"), "s")[..],
            br#"{"cache_salt":"s"}"#
        );
        // An escaped key naming cache_salt is the same member: replaced, not doubled.
        let out = with_cache_salt(Bytes::from_static(br#"{"cache\u005fsalt":"t"}"#), "s");
        assert_eq!(&out[..], br#"{"cache_salt":"s"}"#);
        // Not a JSON object: unchanged (the engine answers it).
        for raw in [&b"[1,2]"[..], b"not json", b""] {
            assert_eq!(&with_cache_salt(Bytes::copy_from_slice(raw), "s")[..], raw);
        }
    }
}
