//! Draining before a stop: the inference requests in flight, counted from arrival until their
//! answer's body is done or dropped (a stream counts for as long as it runs), and the drain
//! itself — `/ready` answers 503 `draining` so that gateways stop routing here, while what is in
//! flight (and anything still sent) is answered, until nothing is in flight once a grace has
//! passed, or a timeout. Used by the worker and the native-engine sidecar alike.

use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::Response;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How often [`Drain::run`] looks at the requests in flight.
const POLL: Duration = Duration::from_millis(20);

/// What a drain ([`Drain::run`]) ended with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DrainReport {
    /// Inference requests still in flight when it ended (> 0 only at the timeout).
    pub in_flight_left: usize,
    /// How long it took.
    pub waited: Duration,
}

/// The requests in flight and the draining flag of one server (cheap to clone: shared).
#[derive(Clone, Debug, Default)]
pub struct Drain {
    in_flight: Arc<AtomicUsize>,
    draining: Arc<AtomicBool>,
}

impl Drain {
    /// Inference requests being answered now.
    pub fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::Acquire)
    }

    /// Whether a drain has begun (it never ends: a stop follows).
    pub fn draining(&self) -> bool {
        self.draining.load(Ordering::Acquire)
    }

    /// Marks the server draining, then waits until no request is in flight once `grace` has
    /// passed (the time gateways need to see `/ready` fail: one health interval, default
    /// 1 s), or until `timeout`. Returns what is left in flight.
    pub async fn run(&self, grace: Duration, timeout: Duration) -> DrainReport {
        let started = Instant::now();
        self.draining.store(true, Ordering::Release);
        let deadline = started + timeout;
        let grace_end = started + grace.min(timeout);
        loop {
            let now = Instant::now();
            let left = self.in_flight();
            if (left == 0 && now >= grace_end) || now >= deadline {
                return DrainReport {
                    in_flight_left: left,
                    waited: now - started,
                };
            }
            tokio::time::sleep(POLL).await;
        }
    }

    /// `/ready`'s answer while draining: 503, reason `draining: N requests in flight`; `None`
    /// before a drain.
    pub fn ready_refusal(&self) -> Option<Response> {
        use axum::response::IntoResponse;
        self.draining().then(|| {
            (
                axum::http::StatusCode::SERVICE_UNAVAILABLE,
                axum::Json(crate::protocol::ReadyBody {
                    ready: false,
                    reason: Some(format!("draining: {} requests in flight", self.in_flight())),
                }),
            )
                .into_response()
        })
    }

    fn enter(&self) -> InFlightGuard {
        self.in_flight.fetch_add(1, Ordering::AcqRel);
        InFlightGuard(self.in_flight.clone())
    }
}

/// Middleware of the inference routes: counts a request from its arrival until its answer's
/// body has been sent or dropped.
pub async fn count_in_flight(State(drain): State<Drain>, req: Request, next: Next) -> Response {
    let guard = drain.enter();
    next.run(req).await.map(|inner| {
        axum::body::Body::new(CountedBody {
            inner,
            _guard: guard,
        })
    })
}

/// One request counted until dropped.
struct InFlightGuard(Arc<AtomicUsize>);

impl Drop for InFlightGuard {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// An answer's body that keeps its request counted until it is done or dropped (size hint and
/// end of stream passed through, so a `Content-Length` stays).
struct CountedBody {
    inner: axum::body::Body,
    _guard: InFlightGuard,
}

impl axum::body::HttpBody for CountedBody {
    type Data = bytes::Bytes;
    type Error = axum::Error;

    fn poll_frame(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        std::pin::Pin::new(&mut self.get_mut().inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_drain_waits_for_the_grace_and_the_requests_in_flight() {
        let d = Drain::default();
        // Nothing in flight: it still waits out the grace.
        let r = d
            .run(Duration::from_millis(60), Duration::from_secs(5))
            .await;
        assert!(d.draining());
        assert_eq!(r.in_flight_left, 0);
        assert!(r.waited >= Duration::from_millis(60), "{r:?}");
        // A request in flight past the grace: it waits for the request.
        let guard = d.enter();
        assert_eq!(d.in_flight(), 1);
        let release = async {
            tokio::time::sleep(Duration::from_millis(150)).await;
            drop(guard);
        };
        let (r, ()) = tokio::join!(
            d.run(Duration::from_millis(10), Duration::from_secs(5)),
            release
        );
        assert_eq!(r.in_flight_left, 0);
        assert!(r.waited >= Duration::from_millis(150), "{r:?}");
        // A request that never ends: the timeout.
        let _stuck = d.enter();
        let r = d
            .run(Duration::from_millis(10), Duration::from_millis(80))
            .await;
        assert_eq!(r.in_flight_left, 1);
        assert!(r.waited >= Duration::from_millis(80), "{r:?}");
    }
}
