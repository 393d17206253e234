//! The worker's and the sidecar's side of draining (the rule itself: the `drain` crate): the
//! middleware that counts an inference request until its answer's body is done or dropped (a
//! stream counts for as long as it runs), and `/ready`'s answer while draining.

use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
pub use drain::{Drain, DrainReport};

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

/// `/ready`'s answer while draining: 503, reason `draining: N requests in flight`; `None`
/// before a drain.
pub fn ready_refusal(drain: &Drain) -> Option<Response> {
    drain.not_ready_reason().map(|reason| {
        (
            axum::http::StatusCode::SERVICE_UNAVAILABLE,
            axum::Json(crate::protocol::ReadyBody {
                ready: false,
                reason: Some(reason),
            }),
        )
            .into_response()
    })
}

/// An answer's body that keeps its request counted until it is done or dropped (size hint and
/// end of stream passed through, so a `Content-Length` stays).
struct CountedBody {
    inner: axum::body::Body,
    _guard: drain::InFlight,
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
