//! Time source of the approximate index (its TTL), injectable so tests never sleep.

use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

/// A monotonic time source. [`SystemClock`] in production, [`ManualClock`] in tests.
pub trait Clock: Send + Sync {
    /// The current instant; must never go backwards.
    fn now(&self) -> Instant;
}

/// The real monotonic clock (`Instant::now()`).
#[derive(Clone, Copy, Debug, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> Instant {
        Instant::now()
    }
}

/// A clock that moves only when told to. Clones share the same time.
#[derive(Clone, Debug)]
pub struct ManualClock {
    base: Instant,
    offset: Arc<Mutex<Duration>>,
}

impl ManualClock {
    /// A clock stopped at an arbitrary instant.
    pub fn new() -> Self {
        ManualClock {
            base: Instant::now(),
            offset: Arc::new(Mutex::new(Duration::ZERO)),
        }
    }

    /// Moves the clock forward by `d`.
    pub fn advance(&self, d: Duration) {
        *self.offset.lock() += d;
    }
}

impl Default for ManualClock {
    fn default() -> Self {
        Self::new()
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Instant {
        self.base + *self.offset.lock()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn manual_clock_moves_only_when_advanced_and_clones_share_time() {
        let c = ManualClock::new();
        let t0 = c.now();
        assert_eq!(c.now(), t0);
        let c2 = c.clone();
        c2.advance(Duration::from_secs(5));
        assert_eq!(c.now(), t0 + Duration::from_secs(5));
    }
}
