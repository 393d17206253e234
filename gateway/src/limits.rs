//! Per-tenant limits: two token buckets per tenant (requests, tokens), refilled continuously
//! at the tenant's rate up to its burst, and a count of the tenant's requests in flight against
//! its `max_concurrent_requests` ([`RateLimits::enter`]: a slot held until the request ends).
//! The buckets live in the data plane and survive rules reloads (keyed by tenant id; a reload
//! that changes a tenant's rates applies the new rates from the next request); a tenant removed
//! from the rules loses its buckets at the next sweep, and its count once nothing of it is in
//! flight. O(1) per request under one short lock.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use parking_lot::Mutex;
use routing_rules::schema::{TenantId, TenantSpec};

/// One token bucket.
#[derive(Clone, Copy, Debug)]
struct Bucket {
    level: f64,
    at: Instant,
}

impl Bucket {
    fn full(burst: f64, now: Instant) -> Bucket {
        Bucket {
            level: burst,
            at: now,
        }
    }

    /// Takes `n`, or says how many seconds until `n` would be there (`n` larger than the
    /// burst can never be taken: the wait is then the time to refill the whole burst).
    fn take(&mut self, n: f64, rate: f64, burst: f64, now: Instant) -> Result<(), f64> {
        let dt = now.saturating_duration_since(self.at).as_secs_f64();
        self.level = (self.level + dt * rate).min(burst);
        self.at = now;
        if self.level >= n {
            self.level -= n;
            Ok(())
        } else {
            Err((n.min(burst) - self.level) / rate)
        }
    }
}

#[derive(Default)]
struct TenantBuckets {
    requests: Option<Bucket>,
    tokens: Option<Bucket>,
}

/// A refusal: which limit, and when to retry.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Limited {
    /// `requests`, `tokens` or `concurrency`.
    pub what: &'static str,
    /// Seconds until the request would pass.
    pub retry_after_s: f64,
}

/// The buckets of every tenant, and their requests in flight.
#[derive(Default)]
pub struct RateLimits {
    buckets: Mutex<HashMap<TenantId, TenantBuckets>>,
    in_flight: Arc<Mutex<HashMap<TenantId, u32>>>,
    /// The live gateway replicas a tenant's limits are shared by (cluster mode; 0 or 1: this
    /// gateway alone): each enforces its even share ([`RateLimits::set_replicas`]).
    replicas: std::sync::atomic::AtomicU32,
}

/// One request of a tenant in flight ([`RateLimits::enter`]); the count drops when it drops.
pub struct TenantSlot {
    counts: Arc<Mutex<HashMap<TenantId, u32>>>,
    id: TenantId,
}

impl Drop for TenantSlot {
    fn drop(&mut self) {
        let mut counts = self.counts.lock();
        if let Some(n) = counts.get_mut(&self.id) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                counts.remove(&self.id);
            }
        }
    }
}

/// `Retry-After` of a concurrency refusal: a request in flight usually ends within seconds.
const CONCURRENCY_RETRY_AFTER_S: f64 = 1.0;

/// A bucket's (rate, burst) as configured, divided among `replicas` (the burst at least 1).
fn limits(rate: Option<f64>, burst: Option<u64>, replicas: u32) -> Option<(f64, f64)> {
    let rate = rate.filter(|r| r.is_finite() && *r > 0.0)?;
    let burst = burst.map_or(rate.ceil().max(1.0), |b| (b as f64).max(1.0));
    let n = f64::from(replicas.max(1));
    Some((rate / n, (burst / n).max(1.0)))
}

impl RateLimits {
    /// Cluster mode: the tenants' limits are shared by `n` live replicas (this one included),
    /// each enforcing `1/n` of every rate and burst and `⌈max / n⌉` concurrent requests, so
    /// that a VIP spreading a tenant's requests evenly meets the configured limits fleet-wide.
    pub fn set_replicas(&self, n: usize) {
        let n = u32::try_from(n).unwrap_or(u32::MAX).max(1);
        self.replicas.store(n, std::sync::atomic::Ordering::Relaxed);
    }

    /// The replicas the limits are shared by (1 alone).
    pub fn replicas(&self) -> u32 {
        self.replicas
            .load(std::sync::atomic::Ordering::Relaxed)
            .max(1)
    }

    /// Counts one request of `t`.
    pub fn take_request(&self, t: &TenantSpec, now: Instant) -> Result<(), Limited> {
        let limit = limits(
            t.requests_per_second,
            t.request_burst.map(u64::from),
            self.replicas(),
        );
        self.take(t, "requests", |b| &mut b.requests, limit, 1.0, now)
    }

    /// Charges `tokens` to `t`.
    pub fn take_tokens(&self, t: &TenantSpec, tokens: u64, now: Instant) -> Result<(), Limited> {
        let limit = limits(t.tokens_per_second, t.token_burst, self.replicas());
        self.take(t, "tokens", |b| &mut b.tokens, limit, tokens as f64, now)
    }

    fn take(
        &self,
        t: &TenantSpec,
        what: &'static str,
        slot: fn(&mut TenantBuckets) -> &mut Option<Bucket>,
        limit: Option<(f64, f64)>,
        n: f64,
        now: Instant,
    ) -> Result<(), Limited> {
        let Some((rate, burst)) = limit else {
            return Ok(());
        };
        let mut all = self.buckets.lock();
        slot(all.entry(t.id.clone()).or_default())
            .get_or_insert_with(|| Bucket::full(burst, now))
            .take(n, rate, burst, now)
            .map_err(|wait| Limited {
                what,
                retry_after_s: wait,
            })
    }

    /// Admits one request of `t` while fewer than its `max_concurrent_requests` are in flight
    /// (every request counts, so the count is right when a limit is added by a reload); the
    /// slot counts it until dropped.
    pub fn enter(&self, t: &TenantSpec) -> Result<TenantSlot, Limited> {
        let replicas = self.replicas();
        let mut counts = self.in_flight.lock();
        let n = counts.entry(t.id.clone()).or_insert(0);
        if t.max_concurrent_requests
            .is_some_and(|max| *n >= max.div_ceil(replicas))
        {
            return Err(Limited {
                what: "concurrency",
                retry_after_s: CONCURRENCY_RETRY_AFTER_S,
            });
        }
        *n += 1;
        Ok(TenantSlot {
            counts: self.in_flight.clone(),
            id: t.id.clone(),
        })
    }

    /// Requests of tenant `id` in flight now.
    pub fn in_flight(&self, id: &TenantId) -> u32 {
        self.in_flight.lock().get(id).copied().unwrap_or(0)
    }

    /// Drops the buckets of tenants not in `keep` (after a rules change). Counts in flight
    /// stay until their requests end.
    pub fn retain(&self, keep: impl Fn(&TenantId) -> bool) {
        self.buckets.lock().retain(|id, _| keep(id));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn tenant(rps: Option<f64>, burst: Option<u32>, tps: Option<f64>) -> TenantSpec {
        TenantSpec {
            services: Vec::new(),
            id: "t".into(),
            api_keys_sha256: vec!["0".repeat(64)],
            requests_per_second: rps,
            request_burst: burst,
            tokens_per_second: tps,
            token_burst: None,
            max_concurrent_requests: None,
        }
    }

    #[test]
    fn replicas_share_every_limit_evenly() {
        let l = RateLimits::default();
        l.set_replicas(2);
        let now = Instant::now();
        // 4/s with a burst of 4, over 2 replicas: 2 here.
        let mut t = tenant(Some(4.0), Some(4), None);
        assert!(l.take_request(&t, now).is_ok());
        assert!(l.take_request(&t, now).is_ok());
        let e = l.take_request(&t, now).unwrap_err();
        // Refilled at 2/s: one more after half a second.
        assert!((e.retry_after_s - 0.5).abs() < 1e-9, "{e:?}");
        // 3 concurrent over 2 replicas: ⌈1.5⌉ = 2 here.
        t.max_concurrent_requests = Some(3);
        let a = l.enter(&t).unwrap();
        let b = l.enter(&t).unwrap();
        assert!(l.enter(&t).is_err());
        drop((a, b));
        // A burst or a cap below the replica count still admits one here.
        l.set_replicas(8);
        let mut u = tenant(Some(1.0), Some(2), None);
        u.id = "u".into();
        assert!(l.take_request(&u, now).is_ok());
        assert!(l.take_request(&u, now).is_err());
        assert_eq!(l.replicas(), 8);
        l.set_replicas(0);
        assert_eq!(l.replicas(), 1);
    }

    #[test]
    fn concurrency_slots_admit_up_to_the_limit_and_free_on_drop() {
        let l = RateLimits::default();
        let mut t = tenant(None, None, None);
        t.max_concurrent_requests = Some(2);
        let a = l.enter(&t).unwrap();
        let b = l.enter(&t).unwrap();
        let e = l.enter(&t).err().unwrap();
        assert_eq!(e.what, "concurrency");
        assert_eq!(l.in_flight(&t.id), 2);
        drop(a);
        let c = l.enter(&t).unwrap();
        drop((b, c));
        assert_eq!(l.in_flight(&t.id), 0);
        // Without a limit every request is admitted (and still counted).
        t.max_concurrent_requests = None;
        let slots: Vec<_> = (0..10).map(|_| l.enter(&t).unwrap()).collect();
        assert_eq!(l.in_flight(&t.id), 10);
        drop(slots);
        assert_eq!(l.in_flight(&t.id), 0);
    }

    #[test]
    fn buckets_allow_the_burst_then_the_rate() {
        let l = RateLimits::default();
        let t = tenant(Some(2.0), Some(3), None);
        let t0 = Instant::now();
        for _ in 0..3 {
            l.take_request(&t, t0).unwrap();
        }
        let e = l.take_request(&t, t0).unwrap_err();
        assert_eq!(e.what, "requests");
        assert!((e.retry_after_s - 0.5).abs() < 1e-9, "{e:?}");
        // Half a second later one more fits, then none.
        let t1 = t0 + Duration::from_millis(500);
        l.take_request(&t, t1).unwrap();
        assert!(l.take_request(&t, t1).is_err());
        // Unlimited tenants are never limited.
        let free = tenant(None, None, None);
        for _ in 0..1000 {
            l.take_request(&free, t0).unwrap();
            l.take_tokens(&free, 1 << 20, t0).unwrap();
        }
        // Tokens: 100/s, burst 100; a 150-token request waits for the whole burst.
        let t = tenant(None, None, Some(100.0));
        l.take_tokens(&t, 60, t0).unwrap();
        let e = l.take_tokens(&t, 150, t0).unwrap_err();
        assert_eq!(e.what, "tokens");
        assert!((e.retry_after_s - 0.6).abs() < 1e-9, "{e:?}");
        l.retain(|_| false);
        l.take_tokens(&t, 100, t0).unwrap();
    }
}
