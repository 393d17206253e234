//! Draining before a stop, the one rule the gateway, the worker and the native-engine sidecar
//! share: count the requests in flight (a [`Drain::enter`] guard per request, held until its
//! answer is done or dropped), and on a stop signal mark the server *draining* — its readiness
//! check fails, so whatever routes to it (a gateway's health probe, a VIP's health check) stops
//! sending — while everything in flight, and anything still sent, is answered, until nothing is
//! in flight once a grace has passed (the time those checks need to notice), or a timeout.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How often [`Drain::run`] looks at the requests in flight.
const POLL: Duration = Duration::from_millis(20);

/// What a drain ([`Drain::run`]) ended with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DrainReport {
    /// Requests still in flight when it ended (> 0 only at the timeout).
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
    /// Requests being answered now.
    pub fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::Acquire)
    }

    /// Whether a drain has begun (it never ends: a stop follows).
    pub fn draining(&self) -> bool {
        self.draining.load(Ordering::Acquire)
    }

    /// The reason a readiness check gives while draining: `draining: N requests in flight`;
    /// `None` before a drain.
    pub fn not_ready_reason(&self) -> Option<String> {
        self.draining()
            .then(|| format!("draining: {} requests in flight", self.in_flight()))
    }

    /// Counts one request until the guard is dropped.
    pub fn enter(&self) -> InFlight {
        self.in_flight.fetch_add(1, Ordering::AcqRel);
        InFlight(self.in_flight.clone())
    }

    /// Marks the server draining, then waits until no request is in flight once `grace` has
    /// passed, or until `timeout`. Returns what is left in flight.
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
}

/// One request counted in a [`Drain`] until dropped.
#[derive(Debug)]
pub struct InFlight(Arc<AtomicUsize>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_drain_waits_for_the_grace_and_the_requests_in_flight() {
        let d = Drain::default();
        assert_eq!(d.not_ready_reason(), None);
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
        assert_eq!(
            d.not_ready_reason().as_deref(),
            Some("draining: 1 requests in flight")
        );
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
