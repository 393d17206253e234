//! `GET /v1/kv/events`: the engine's KV event feed as Server-Sent Events, for the gateway's
//! prefix index. The wire format is specified in `docs/kv-events.md`:
//!
//! - every event is one SSE message: `id: <epoch>:<seq>` and `data: <KvEventEnvelope JSON>`;
//! - resume point: query `since_epoch=E&since_seq=S`, or `since=E:S`, or the standard SSE
//!   `Last-Event-ID: E:S` header (the query wins). Without one, or when it cannot be honoured
//!   (other epoch, seq no longer in the replay buffer), the stream starts with a `cleared`
//!   envelope and a snapshot of every cached key (`stored` envelopes), then live events;
//! - a comment line (`: keep-alive`) every 10 s keeps idle connections open;
//! - the stream ends when the worker shuts down.
//!
//! `GET /v1/load` is the same stream's load messages alone (no cache events), for a subscriber
//! that wants a worker's or a sidecar's queued work without its cache (the gateway, for a
//! native engine behind a sidecar: docs/kv-events.md, "Load messages").

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Query, State};
use axum::http::HeaderMap;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures::stream;
use serde::Deserialize;

use engine::kv::events::KvSubscription;

use crate::api_error::ApiError;
use crate::AppState;

/// Query parameters of `GET /v1/kv/events`.
#[derive(Debug, Default, Deserialize)]
pub struct EventsQuery {
    pub since_epoch: Option<u64>,
    pub since_seq: Option<u64>,
    /// `EPOCH:SEQ`.
    pub since: Option<String>,
    /// `true`: interleave `event: load` messages (the engine's queued work). Opt-in, so that a
    /// subscriber written before they existed sees the stream it knows.
    pub load: Option<bool>,
}

/// Parses `EPOCH:SEQ`.
pub fn parse_position(s: &str) -> Option<(u64, u64)> {
    let (e, q) = s.split_once(':')?;
    Some((e.trim().parse().ok()?, q.trim().parse().ok()?))
}

/// The resume position requested, if any; malformed values are a 400.
pub fn resume_position(
    q: &EventsQuery,
    headers: &HeaderMap,
) -> Result<Option<(u64, u64)>, ApiError> {
    match (q.since_epoch, q.since_seq) {
        (Some(e), Some(s)) => return Ok(Some((e, s))),
        (None, None) => {}
        _ => {
            return Err(ApiError::bad_request(
                "invalid_value",
                Some("since_epoch"),
                "`since_epoch` and `since_seq` go together",
            ))
        }
    }
    if let Some(s) = &q.since {
        return parse_position(s).map(Some).ok_or_else(|| {
            ApiError::bad_request("invalid_value", Some("since"), "`since` must be EPOCH:SEQ")
        });
    }
    if let Some(v) = headers.get("last-event-id") {
        let pos = v.to_str().ok().and_then(parse_position);
        return pos.map(Some).ok_or_else(|| {
            ApiError::bad_request(
                "invalid_value",
                Some("Last-Event-ID"),
                "`Last-Event-ID` must be EPOCH:SEQ",
            )
        });
    }
    Ok(None)
}

/// An admitted subscription: where it resumes, whether it wants load messages, and its slot.
pub(crate) struct Admitted {
    pub since: Option<(u64, u64)>,
    pub load: bool,
    permit: tokio::sync::OwnedSemaphorePermit,
}

/// Admits a `GET /v1/kv/events` (a kvgate worker's or a sidecar's): its query and resume
/// position (400 `invalid_value`), one of the `max` subscription slots (429
/// `too_many_subscriptions`, `Retry-After: retry_after_s`).
pub(crate) fn admit(
    query: Result<Query<EventsQuery>, axum::extract::rejection::QueryRejection>,
    headers: &HeaderMap,
    slots: &Arc<tokio::sync::Semaphore>,
    max: usize,
    retry_after_s: u64,
) -> Result<Admitted, ApiError> {
    let q = match query {
        Ok(Query(q)) => q,
        Err(e) => return Err(ApiError::bad_request("invalid_value", None, e.body_text())),
    };
    let since = resume_position(&q, headers)?;
    Ok(Admitted {
        since,
        load: q.load == Some(true),
        permit: slot(slots, max, retry_after_s)?,
    })
}

/// Admits a `GET /v1/load`: one of the same `max` subscription slots as `GET /v1/kv/events`
/// (429 `too_many_subscriptions`).
fn admit_load(
    slots: &Arc<tokio::sync::Semaphore>,
    max: usize,
    retry_after_s: u64,
) -> Result<Admitted, ApiError> {
    Ok(Admitted {
        since: None,
        load: true,
        permit: slot(slots, max, retry_after_s)?,
    })
}

fn slot(
    slots: &Arc<tokio::sync::Semaphore>,
    max: usize,
    retry_after_s: u64,
) -> Result<tokio::sync::OwnedSemaphorePermit, ApiError> {
    slots.clone().try_acquire_owned().map_err(|_| {
        let mut e = ApiError::new(
            axum::http::StatusCode::TOO_MANY_REQUESTS,
            "too_many_subscriptions",
            format!("at most {max} KV-event and load subscriptions at once"),
        );
        e.retry_after_s = Some(retry_after_s);
        e
    })
}

/// The SSE answer of an admitted subscription: the cache events of `feed` (none without one:
/// `GET /v1/load`), with load messages from `load` when it asked for them.
pub(crate) fn stream_response(
    admitted: Admitted,
    feed: Option<&engine::kv::events::KvEventFeed>,
    load: Option<tokio::sync::watch::Receiver<prefix_index::WorkerLoad>>,
    shutdown: tokio_util::sync::CancellationToken,
) -> Response {
    let state = StreamState {
        sub: feed.map(|f| f.subscribe(admitted.since)),
        load: if admitted.load { load } else { None },
        load_pending: true,
        next_load_at: tokio::time::Instant::now(),
        heartbeat_at: tokio::time::Instant::now() + LOAD_HEARTBEAT,
        shutdown,
        _permit: admitted.permit,
    };
    // The permit lives as long as the stream (dropped with it when the client goes away).
    let events = stream::unfold(state, |mut s| async move {
        let ev = s.next_event().await?;
        Some((Ok::<_, Infallible>(ev), s))
    });
    Sse::new(events)
        .keep_alive(KeepAlive::new().interval(Duration::from_secs(10)))
        .into_response()
}

/// `GET /v1/kv/events`.
pub async fn kv_events(
    State(st): State<Arc<AppState>>,
    query: Result<Query<EventsQuery>, axum::extract::rejection::QueryRejection>,
    headers: HeaderMap,
) -> Response {
    let admitted = match admit(
        query,
        &headers,
        &st.subscriptions,
        st.settings.max_event_subscriptions,
        st.settings.retry_after_s,
    ) {
        Ok(a) => a,
        Err(e) => {
            st.metrics.request("kv_events", e.status.as_u16());
            return e.into_response();
        }
    };
    st.metrics.request("kv_events", 200);
    let load = admitted.load.then(|| st.engine.watch_load());
    stream_response(
        admitted,
        Some(&st.engine.kv_events()),
        load,
        st.shutdown.clone(),
    )
}

/// `GET /v1/load`: the engine's load messages alone.
pub async fn load(State(st): State<Arc<AppState>>) -> Response {
    let (response, status) = load_response(
        &st.subscriptions,
        st.settings.max_event_subscriptions,
        st.settings.retry_after_s,
        st.engine.watch_load(),
        st.shutdown.clone(),
    );
    st.metrics.request("load", status);
    response
}

/// A `GET /v1/load` answer (a worker's or a sidecar's): the stream of `load`'s messages in one
/// of the `max` subscription slots, or 429 `too_many_subscriptions`; with the status, for the
/// server's request counter.
pub(crate) fn load_response(
    slots: &Arc<tokio::sync::Semaphore>,
    max: usize,
    retry_after_s: u64,
    load: tokio::sync::watch::Receiver<prefix_index::WorkerLoad>,
    shutdown: tokio_util::sync::CancellationToken,
) -> (Response, u16) {
    match admit_load(slots, max, retry_after_s) {
        Ok(admitted) => (stream_response(admitted, None, Some(load), shutdown), 200),
        Err(e) => {
            let status = e.status.as_u16();
            (e.into_response(), status)
        }
    }
}

/// Shortest time between two `event: load` messages on one stream: the engine's load changes
/// every step; a subscriber needs it fresh, not every step.
pub const LOAD_INTERVAL: Duration = Duration::from_millis(20);

/// Longest time between two `event: load` messages on one stream (sent unchanged if need be).
pub const LOAD_HEARTBEAT: Duration = Duration::from_secs(1);

/// One subscription: cache events in order, interleaved with the latest load.
struct StreamState {
    /// `None`: load messages only (`GET /v1/load`).
    sub: Option<KvSubscription>,
    /// `None` once the engine is gone (no more load messages).
    load: Option<tokio::sync::watch::Receiver<prefix_index::WorkerLoad>>,
    /// The load changed since the last message (the first message is always sent).
    load_pending: bool,
    next_load_at: tokio::time::Instant,
    /// When the load is sent again even if unchanged (so a subscriber can tell a quiet worker
    /// from a stalled stream).
    heartbeat_at: tokio::time::Instant,
    shutdown: tokio_util::sync::CancellationToken,
    _permit: tokio::sync::OwnedSemaphorePermit,
}

impl StreamState {
    /// The next SSE message; `None` ends the stream (shutdown, or the feed closed).
    async fn next_event(&mut self) -> Option<Event> {
        loop {
            if self.sub.is_none() && self.load.is_none() {
                // A load-only stream whose engine is gone.
                return None;
            }
            let has_load = self.load.is_some();
            tokio::select! {
                biased;
                _ = self.shutdown.cancelled() => return None,
                env = async {
                    match self.sub.as_mut() {
                        Some(s) => s.next().await,
                        None => std::future::pending().await,
                    }
                } => {
                    let env = env?;
                    let data = serde_json::to_string(&env).ok()?;
                    return Some(
                        Event::default()
                            .id(format!("{}:{}", env.epoch, env.seq))
                            .data(data),
                    );
                }
                _ = tokio::time::sleep_until(self.next_load_at), if has_load && self.load_pending => {
                    let Some(rx) = self.load.as_mut() else { continue };
                    let load = *rx.borrow_and_update();
                    self.load_pending = false;
                    let now = tokio::time::Instant::now();
                    self.next_load_at = now + LOAD_INTERVAL;
                    self.heartbeat_at = now + LOAD_HEARTBEAT;
                    let Ok(data) = serde_json::to_string(&load) else { continue };
                    return Some(Event::default().event(prefix_index::protocol::LOAD_EVENT_NAME).data(data));
                }
                _ = tokio::time::sleep_until(self.heartbeat_at), if has_load && !self.load_pending => {
                    self.load_pending = true;
                }
                changed = async {
                    match self.load.as_mut() {
                        Some(rx) => rx.changed().await.is_ok(),
                        None => std::future::pending().await,
                    }
                }, if has_load && !self.load_pending => {
                    if changed {
                        self.load_pending = true;
                    } else {
                        self.load = None;
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

    #[test]
    fn resume_position_sources() {
        let h = HeaderMap::new();
        assert_eq!(resume_position(&EventsQuery::default(), &h).unwrap(), None);
        let q = EventsQuery {
            since_epoch: Some(3),
            since_seq: Some(9),
            since: None,
            load: Some(true),
        };
        assert_eq!(resume_position(&q, &h).unwrap(), Some((3, 9)));
        let q = EventsQuery {
            since_epoch: Some(3),
            ..EventsQuery::default()
        };
        assert!(resume_position(&q, &h).is_err());
        let q = EventsQuery {
            since: Some("5:6".into()),
            ..EventsQuery::default()
        };
        assert_eq!(resume_position(&q, &h).unwrap(), Some((5, 6)));
        let q = EventsQuery {
            since: Some("56".into()),
            ..EventsQuery::default()
        };
        assert!(resume_position(&q, &h).is_err());
        let mut h = HeaderMap::new();
        h.insert("last-event-id", HeaderValue::from_static("7:8"));
        assert_eq!(
            resume_position(&EventsQuery::default(), &h).unwrap(),
            Some((7, 8))
        );
    }
}
