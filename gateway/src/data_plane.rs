//! The data plane: what every request reads and writes — the current [`View`] (rules, workers,
//! health in one snapshot), the prefix index, the metrics, the ticket signing key, the
//! decision log — and the operations of the request path on them: passive health marks and
//! the end-of-request bookkeeping (metrics, decision log, approximate index holdings).
//! Rules changes, contract checks and background tasks belong to the control plane
//! ([`crate::control_plane`]), which owns a handle to this one.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use pingora::connectors::http::Connector;
use pingora::utils::tls::CertKey;
use prefix_index::{PrefixIndex, WorkerId};
use receipts::{DecisionLog, DecisionRecord, PrecomputedSigner};

use crate::limits::RateLimits;
use crate::metrics::{Metrics, WorkerLabels};
use crate::request::RequestCtx;
use crate::view::{EventStreamState, ViewCell};

/// Milliseconds since the Unix epoch.
pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// Consecutive 5xx answers after which a worker is marked unhealthy (a connect error marks it
/// at once). Active checks bring it back.
pub const PASSIVE_5XX_THRESHOLD: u64 = 3;

/// Request ids the gateway mints for tickets, receipts and its decision log: a random 64-bit
/// prefix chosen once per gateway start and a counter, `<prefix>-<n>` in hex — unique across
/// restarts, no system call per request. A client's own `x-request-id` is never used as the
/// ticket's id (a client retrying with the same id would otherwise be refused as a replay); it
/// is carried beside it as `x-client-request-id`.
pub struct RequestIds {
    prefix: String,
    next: std::sync::atomic::AtomicU64,
}

impl RequestIds {
    /// A fresh id space.
    pub fn new() -> RequestIds {
        RequestIds {
            prefix: format!("gw-{:016x}", rand::random::<u64>()),
            next: std::sync::atomic::AtomicU64::new(1),
        }
    }

    /// The next id.
    pub fn mint(&self) -> String {
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        format!("{}-{n:x}", self.prefix)
    }
}

impl Default for RequestIds {
    fn default() -> Self {
        Self::new()
    }
}

/// Everything the request path shares.
pub struct DataPlane {
    /// The current view.
    pub views: ViewCell,
    /// Which worker holds which blocks.
    pub index: PrefixIndex,
    /// Metrics.
    pub metrics: Metrics,
    /// The gateway's signing key (route tickets, access tokens), with Ed25519 nonces computed
    /// ahead by its own thread (`receipts::signer`): the request path does no base-point
    /// multiplication while nonces are ready.
    pub signer: PrecomputedSigner,
    /// The gateway id written into tickets.
    pub gateway_id: String,
    /// The decision log, when configured.
    pub decisions: Option<DecisionLog>,
    /// The access log, when configured.
    pub access: Option<crate::access_log::AccessLog>,
    /// Request ids minted for tickets.
    pub request_ids: RequestIds,
    /// Per-tenant rate-limit buckets (kept across rules changes).
    pub limits: RateLimits,
    /// The client certificate shown to `https://` workers (mTLS), when configured.
    pub upstream_identity: Option<Arc<CertKey>>,
    /// The connector of the >64 KiB forwarding path (its CA is the proxy's).
    pub connector: Connector,
    /// HTTP client for the gateway's own calls to workers (a count on a worker,
    /// `POST /v1/responses/input_tokens`), with the upstream CA and client certificate.
    pub http: reqwest::Client,
    /// Cluster mode: where routing-time holdings go to be shared with the other replicas (a
    /// bounded queue the cluster link drains; full = dropped, never waited on).
    pub shared_holdings: arc_swap::ArcSwapOption<tokio::sync::mpsc::Sender<cluster::SharedHolding>>,
    /// Cluster mode with claims on: the atomic select-and-reserve of close placements.
    pub claims: arc_swap::ArcSwapOption<crate::cluster::Claims>,
    /// The number of this replica's last numbered reservation: each KV-exact decision's
    /// reservation is numbered as it is taken ([`crate::route::Decision::seq`]) and published
    /// with it in cluster mode; the replica's load table names the last number it covers, so
    /// the others stop counting those as reservations.
    pub holdings_seq: Arc<std::sync::atomic::AtomicU64>,
    /// Client requests in flight on the proxy (each [`crate::request::RequestCtx`] holds one
    /// guard, from `new_ctx` until the request is done) and whether the gateway drains
    /// ([`crate::RunningGateway::drain`]: the admin plane's `/ready` answers 503).
    pub drain: drain::Drain,
    /// Whether the index has caught up since the start ([`DataPlane::catching_up`]).
    pub catch_up: CatchUp,
    /// Responses stored for `previous_response_id` and `GET /v1/responses/{id}`.
    pub responses: crate::response_store::ResponseStore,
    /// Cluster mode: the other replicas' stored responses (Redis).
    pub shared_responses: arc_swap::ArcSwapOption<crate::cluster::SharedResponses>,
    /// The background responses this gateway runs.
    pub background: crate::background::BackgroundJobs,
}

/// The start-up catch-up of the prefix index: latched once every healthy worker a `kv_exact`
/// service routes to has delivered its event stream's snapshot, or once `limit` has passed.
#[derive(Debug)]
pub struct CatchUp {
    started: std::time::Instant,
    limit: std::time::Duration,
    done: std::sync::atomic::AtomicBool,
}

impl CatchUp {
    /// From now, for at most `limit`.
    pub fn new(limit: std::time::Duration) -> CatchUp {
        CatchUp {
            started: std::time::Instant::now(),
            limit,
            done: std::sync::atomic::AtomicBool::new(false),
        }
    }

    /// Whether the catch-up limit has passed since the start.
    pub fn expired(&self) -> bool {
        self.started.elapsed() >= self.limit
    }
}

impl DataPlane {
    /// Cluster mode: offers a KV-exact decision to the other replicas — the load it reserved
    /// on its first choice and, when it took one, its routing-time holding there.
    pub fn share_holding(&self, d: &crate::route::Decision) {
        let (Some(tx), Some(p), Some(first)) =
            (self.shared_holdings.load_full(), &d.prompt, d.order.first())
        else {
            return;
        };
        let (prefill_tokens, decode_tokens) = d.attempt_tokens(first).unwrap_or((0, 0));
        let (keys, ttl_ms) = match &d.pending {
            Some((w, ttl)) if w == first => (
                p.keys.iter().map(|k| k.0).collect(),
                u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX),
            ),
            _ => (Vec::new(), 0),
        };
        // Numbered before its load counted here (the sync loop reads the counters before the
        // number: a table covering n counts no reservation numbered above n). A decision
        // without a reservation here gets a number now.
        let seq = match d.seq {
            0 => {
                self.holdings_seq
                    .fetch_add(1, std::sync::atomic::Ordering::AcqRel)
                    + 1
            }
            n => n,
        };
        let _ = tx.try_send(cluster::SharedHolding {
            replica: self.gateway_id.clone(),
            worker: first.0.clone(),
            keys,
            ttl_ms,
            prefill_tokens,
            decode_tokens,
            seq,
        });
    }

    /// Sets a worker's health in the view; returns whether it changed.
    pub fn set_health(&self, id: &WorkerId, healthy: bool) -> bool {
        let changed = self.views.set_health(id, healthy);
        self.metrics
            .worker_healthy
            .get_or_create(&WorkerLabels {
                worker: id.0.clone(),
            })
            .set(i64::from(healthy));
        changed
    }

    /// Passive mark: a connect error (at once) or a 5xx (after a few in a row).
    pub fn mark_failure(&self, id: &WorkerId, connect: bool) {
        let view = self.views.load();
        let Some(entry) = view.workers.get(id) else {
            return;
        };
        let n = entry
            .runtime
            .consecutive_failures
            .fetch_add(1, Ordering::Relaxed)
            + 1;
        if connect || n >= PASSIVE_5XX_THRESHOLD {
            self.set_health(id, false);
        }
    }

    /// Passive mark: a good answer resets the failure count.
    pub fn mark_success(&self, id: &WorkerId) {
        let view = self.views.load();
        if let Some(entry) = view.workers.get(id) {
            entry
                .runtime
                .consecutive_failures
                .store(0, Ordering::Relaxed);
        }
    }

    /// Cluster mode: where the other replicas' stored responses are read and this replica's
    /// are shared; `None` on one gateway.
    pub fn shared_turns(&self) -> Option<Arc<dyn crate::response_store::SharedTurns>> {
        self.shared_responses
            .load_full()
            .map(|s| s as Arc<dyn crate::response_store::SharedTurns>)
    }

    /// Refreshes the gauges that mirror state owned elsewhere (index size, event lag, load).
    pub fn refresh_gauges(&self) {
        let total: u64 = self
            .index
            .all_worker_stats()
            .iter()
            .map(|s| s.precise_blocks + s.approximate_blocks)
            .sum();
        self.metrics
            .index_blocks
            .set(i64::try_from(total).unwrap_or(i64::MAX));
        self.metrics
            .requests_in_flight
            .set(i64::try_from(self.drain.in_flight()).unwrap_or(i64::MAX));
        self.metrics.draining.set(i64::from(self.drain.draining()));
        let (stored, stored_bytes) = self.responses.stats();
        let conversations = self.responses.conversations();
        self.metrics
            .stored_responses
            .set(i64::try_from(stored.saturating_sub(conversations)).unwrap_or(i64::MAX));
        self.metrics
            .stored_conversations
            .set(i64::try_from(conversations).unwrap_or(i64::MAX));
        self.metrics
            .stored_response_bytes
            .set(i64::try_from(stored_bytes).unwrap_or(i64::MAX));
        self.metrics
            .background_responses
            .set(i64::try_from(self.background.len()).unwrap_or(i64::MAX));
        if let Some(shared) = self.shared_responses.load().as_ref() {
            let waiting = [
                ("turns", shared.pending_writes().0),
                ("deletions", shared.pending_deletes()),
                ("cancels", shared.pending_cancels()),
                ("stream_mirror_gaps", shared.mirror_gaps()),
                ("conversation_changes", self.responses.pending.len()),
            ];
            for (what, n) in waiting {
                self.metrics
                    .cluster_waiting_for_redis
                    .get_or_create(&crate::metrics::WaitingLabels { what })
                    .set(i64::try_from(n).unwrap_or(i64::MAX));
            }
        }
        let view = self.views.load();
        for t in view.tenants.values() {
            self.metrics
                .tenant_in_flight
                .get_or_create(&crate::metrics::TenantLabels {
                    tenant: t.id.0.clone(),
                })
                .set(i64::from(self.limits.in_flight(&t.id)));
        }
        for (id, e) in &view.workers {
            let labels = WorkerLabels {
                worker: id.0.clone(),
            };
            let lag = match (
                &*e.runtime.events.lock(),
                *e.runtime.events_last_heard.lock(),
            ) {
                (EventStreamState::Connected, Some(t)) => t.elapsed().as_secs_f64(),
                _ => -1.0,
            };
            self.metrics
                .event_lag_seconds
                .get_or_create(&labels)
                .set(lag);
            self.metrics.worker_in_flight.get_or_create(&labels).set(
                i64::try_from(e.runtime.in_flight.load(Ordering::Relaxed)).unwrap_or(i64::MAX),
            );
            let clamp = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
            let now = std::time::Instant::now();
            let (prefill, decode) = e.runtime.queued_tokens(now);
            self.metrics
                .worker_queued_prefill_tokens
                .get_or_create(&labels)
                .set(clamp(prefill));
            self.metrics
                .worker_queued_decode_tokens
                .get_or_create(&labels)
                .set(clamp(decode));
            let report = e.runtime.fresh_reported_load(now);
            self.metrics
                .worker_reported_running
                .get_or_create(&labels)
                .set(report.map_or(-1, |r| clamp(r.running)));
            self.metrics
                .worker_reported_waiting
                .get_or_create(&labels)
                .set(report.map_or(-1, |r| clamp(r.waiting)));
            self.metrics
                .worker_healthy
                .get_or_create(&labels)
                .set(i64::from(e.healthy));
            self.metrics
                .worker_cordoned
                .get_or_create(&labels)
                .set(i64::from(e.cordoned));
            // The counter only moves forward: a worker removed and added again starts a new
            // count below the exported one, which then waits for it to pass.
            let reports = self.metrics.worker_load_reports.get_or_create(&labels);
            let seen = e.runtime.load_reports.load(Ordering::Relaxed);
            reports.inc_by(seen.saturating_sub(reports.get()));
            let refusals = self.metrics.worker_refusals.get_or_create(&labels);
            let seen = e.runtime.refusals.load(Ordering::Relaxed);
            refusals.inc_by(seen.saturating_sub(refusals.get()));
        }
    }

    /// Why the gateway is not ready for `kv_exact` traffic yet: at the start, the workers
    /// whose KV event snapshot has not arrived — healthy workers in a `kv_exact` service's pool
    /// with an event stream (a worker's first `event: load` message follows its snapshot,
    /// docs/kv-events.md), so a replica that joins a fleet does not take traffic on an empty
    /// index. `None` once every such snapshot arrived, or after the catch-up limit; latched, so
    /// a worker that breaks later does not take the gateway out (its own health does that).
    pub fn catching_up(&self) -> Option<String> {
        if self.catch_up.done.load(Ordering::Acquire) {
            return None;
        }
        let view = self.views.load();
        // Each such worker once, whether its snapshot arrived.
        let routed: std::collections::BTreeMap<&str, bool> = view
            .services
            .iter()
            .filter(|s| s.prefix.is_some())
            .flat_map(|s| s.pool.iter())
            .filter_map(|w| view.workers.get(w).map(|e| (w, e)))
            .filter(|(_, e)| {
                e.healthy
                    && matches!(
                        *e.runtime.events.lock(),
                        EventStreamState::Connecting | EventStreamState::Connected
                    )
            })
            .map(|(w, e)| {
                let synced = e.runtime.events_synced.load(Ordering::Acquire);
                (w.0.as_str(), synced)
            })
            .collect();
        let pending: Vec<&str> = routed
            .iter()
            .filter(|(_, synced)| !**synced)
            .map(|(w, _)| *w)
            .collect();
        if pending.is_empty() || self.catch_up.expired() {
            if !pending.is_empty() {
                tracing::warn!(workers = ?pending, "catch-up limit passed: ready without their KV event snapshots");
            }
            self.catch_up.done.store(true, Ordering::Release);
            return None;
        }
        Some(format!(
            "catching up: the KV event snapshots of {} ({} of {} kv_exact workers) have not arrived",
            pending.join(", "),
            pending.len(),
            routed.len()
        ))
    }

    /// End-of-request bookkeeping: metrics, decision log, approximate holdings.
    pub fn finish_request(&self, ctx: &mut RequestCtx) {
        if ctx.detached {
            // Accepted as a background response: the job does this when it ends.
            return;
        }
        match &ctx.service {
            Some(s) => {
                s.handles(&self.metrics)
                    .request(&self.metrics, ctx.current.as_ref(), ctx.status)
            }
            None => {
                self.metrics.requests.get_or_create(&ctx.labels()).inc();
            }
        }
        if let (Some(fb), Some(dd), Some(s)) = (ctx.first_byte, ctx.decision_done, &ctx.service) {
            s.handles(&self.metrics)
                .ttft
                .observe(fb.saturating_duration_since(dd).as_secs_f64());
        }
        // Approximate holdings: a worker without an event stream is assumed to hold the blocks
        // of a prompt it answered successfully, for a while.
        if let (Some(d), Some(w), Some(status)) = (&ctx.decision, &ctx.current, ctx.status) {
            if (200..300).contains(&status) {
                if let Some(p) = &d.prompt {
                    let entry = ctx.view.as_ref().and_then(|v| v.workers.get(w));
                    let approximate = entry.is_some_and(|e| e.runtime.approximate());
                    // The worker's own `prompt_cache.ttl_ms`, else the gateway's default.
                    let ttl = entry
                        .and_then(|e| e.spec.prompt_cache)
                        .and_then(|c| c.ttl_ms)
                        .map_or(self.index.config().approximate_ttl, Duration::from_millis);
                    if approximate && !p.keys.is_empty() {
                        if let Err(e) = self.index.insert_approximate_for(w, &p.keys, ttl) {
                            tracing::debug!(worker = %w, error = %e, "approximate insert skipped");
                        }
                    }
                }
            }
        }
        if let Some(log) = &self.decisions {
            if let Err(e) = log.append(&decision_record(ctx, None)) {
                tracing::warn!(error = %e, "decision log append failed");
            }
        }
        ctx.in_flight = None;
    }
}

/// The decision line of `ctx`: the final one (`phase` none), the `routed` one written as the
/// request is sent (`status` 0, no outcome yet), or the `retried` one ending an attempt its
/// worker refused (the worker's status). Only a routed request (one with a ticket) names
/// service, rule, version and worker.
pub(crate) fn decision_record(
    ctx: &RequestCtx,
    phase: Option<receipts::DecisionPhase>,
) -> DecisionRecord {
    let routed = ctx.ticket.is_some();
    let finished = receipts::DecisionPhase::ends_attempt(phase);
    DecisionRecord {
        request_id: ctx.request_id.clone(),
        at_ms: now_ms(),
        ticket: ctx.ticket.as_deref().cloned(),
        service: ctx
            .service
            .as_ref()
            .filter(|_| routed)
            .map(|s| s.name().to_owned()),
        rule_id: ctx
            .service
            .as_ref()
            .filter(|_| routed)
            .map(|s| s.rule_id.clone()),
        rule_version: ctx.view.as_ref().filter(|_| routed).map(|v| v.version()),
        worker: ctx.current.clone().filter(|_| routed),
        status: if finished { ctx.status.unwrap_or(0) } else { 0 },
        error: ctx.error.clone().filter(|_| finished),
        client_request_id: ctx.client_request_id.clone(),
        receipt_named: ctx.receipt_named.filter(|_| finished),
        tenant: ctx.tenant.as_ref().map(|t| t.id.0.clone()),
        phase,
    }
}
