//! Owned background tasks, one pair per worker: the active health check (`GET` of the worker's
//! health path: `/ready` for kvgate workers, `/health` for native engines) and the KV event
//! subscription (`GET /v1/kv/events`, SSE; kvgate workers only — the holdings of `openai` and
//! `llama_cpp` upstreams are approximated from routed keys, bounded by their `prompt_cache`). Each task has its own cancellation token
//! and a kept `JoinHandle`; [`Supervisor::sync`] starts tasks for new workers and cancels those
//! of removed ones (and drops them from the index); [`Supervisor::shutdown`] cancels all.
//!
//! Event subscription: envelopes are parsed by `eventsource-stream` (one event at most
//! [`MAX_EVENT_BYTES`]) and applied by the index's own stream rule
//! ([`prefix_index::PrefixIndex::apply_envelope`], the protocol of docs/kv-events.md). The
//! stream is resumed from the last applied `(epoch, seq)`; the worker answers an unknown
//! position or a new epoch with `cleared` followed by a snapshot of every cached key, so
//! applying events in order always converges. A sequence gap makes the subscriber reconnect
//! from its last position (which yields the missed events or that snapshot); an envelope the
//! index refuses makes it reconnect from scratch. Nothing ends a worker's subscription but its
//! removal or the gateway's shutdown. Reconnects after failures back off exponentially
//! (100 ms .. 5 s). A worker that answers 404 has no event
//! stream: its holdings are approximated from routed keys, and the stream is probed again
//! every 30 s; meanwhile its load messages alone are read from `GET /v1/load`, when it has one.
//!
//! Load subscription: a worker whose KV events are not read (an `openai` or `llama_cpp`
//! upstream, a native engine behind a `kvgate sidecar`) while some KV-exact service routes to
//! it has its `GET /v1/load` read instead (its `event: load` messages alone, docs/kv-events.md):
//! a sidecar reports the work every gateway forwarded to its engine. A worker without one (404,
//! or an answer that is not an event stream) is probed again every 30 s and judged by the
//! gateways' own count meanwhile.

use std::collections::BTreeMap;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use eventsource_stream::Eventsource;
use futures::future::BoxFuture;
use futures::StreamExt;
use prefix_index::{EnvelopeOutcome, KvEventEnvelope, WorkerId};
use tokio::runtime::Handle;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::data_plane::DataPlane;
use crate::view::{EventStreamState, LoadStreamState, View};

/// What the health loop asks of the control plane, which owns the rules and the contract.
pub trait WorkerChecks: Send + Sync {
    /// Re-reads a worker's profile and contract state (it became healthy, its contract is not
    /// ok, or its profile is not known yet).
    fn recheck(&self, id: WorkerId) -> BoxFuture<'_, ()>;
}

/// What every task of a worker holds: the data plane (weakly: the tasks never keep a stopped
/// gateway alive), the HTTP client and the control plane's checks.
#[derive(Clone)]
struct TaskCtx {
    data: Weak<DataPlane>,
    http: reqwest::Client,
    checks: Weak<dyn WorkerChecks>,
}

const BACKOFF_MIN: Duration = Duration::from_millis(100);
const BACKOFF_MAX: Duration = Duration::from_secs(5);
const UNSUPPORTED_RETRY: Duration = Duration::from_secs(30);

struct WorkerTasks {
    /// What the tasks were started for: base URL, kind and health path (a change restarts them).
    target: String,
    cancel: CancellationToken,
    handles: Vec<JoinHandle<()>>,
}

/// The background tasks of every worker in the current view.
pub struct Supervisor {
    handle: Handle,
    ctx: TaskCtx,
    root: CancellationToken,
    tasks: BTreeMap<WorkerId, WorkerTasks>,
}

impl Supervisor {
    /// A supervisor spawning on `handle`.
    pub fn new(
        handle: Handle,
        data: Weak<DataPlane>,
        http: reqwest::Client,
        checks: Weak<dyn WorkerChecks>,
    ) -> Supervisor {
        Supervisor {
            handle,
            ctx: TaskCtx { data, http, checks },
            root: CancellationToken::new(),
            tasks: BTreeMap::new(),
        }
    }

    /// Starts tasks for workers new to `view` (or whose URL changed, or that a KV-exact
    /// service started or stopped routing to), stops the others. A worker's KV event stream
    /// is read only while some KV-exact service's pool holds it: its events and load reports
    /// feed nothing else, so a round-robin fleet pays nothing for them.
    pub fn sync(&mut self, view: &View) {
        let routed_by_prefix: std::collections::BTreeSet<&WorkerId> = view
            .services
            .iter()
            .filter(|s| s.prefix.is_some())
            .flat_map(|s| s.pool.iter())
            .collect();
        let wanted: BTreeMap<WorkerId, (String, String, bool)> = view
            .workers
            .iter()
            .map(|(id, e)| {
                let base = e.upstream.base_url();
                let events = routed_by_prefix.contains(id);
                let target = format!(
                    "{base} {} {} events={events}",
                    e.spec.kind.as_str(),
                    e.spec.health_path()
                );
                (id.clone(), (base, target, events))
            })
            .collect();
        let stale: Vec<WorkerId> = self
            .tasks
            .iter()
            .filter(|(id, t)| wanted.get(*id).map(|w| &w.1) != Some(&t.target))
            .map(|(id, _)| id.clone())
            .collect();
        for id in stale {
            if let Some(t) = self.tasks.remove(&id) {
                t.cancel.cancel();
            }
            if let Some(data) = self.ctx.data.upgrade() {
                data.index.remove_worker(&id);
            }
        }
        for (id, (base_url, target, events)) in wanted {
            let Some(entry) = view.workers.get(&id) else {
                continue;
            };
            if let Some(data) = self.ctx.data.upgrade() {
                // A slot-based prompt cache holds at most so many prompts (may change on reload).
                let limit = entry
                    .spec
                    .prompt_cache
                    .and_then(|c| c.max_prefixes)
                    .map(|n| n as usize);
                data.index.add_worker(&id);
                let _ = data.index.set_approximate_prefixes(&id, limit);
            }
            if self.tasks.contains_key(&id) {
                continue;
            }
            let cancel = self.root.child_token();
            let health_url = format!("{base_url}{}", entry.spec.health_path());
            let mut handles = vec![self.handle.spawn(health_loop(
                self.ctx.clone(),
                id.clone(),
                health_url,
                cancel.clone(),
            ))];
            if !entry.spec.kind.has_events() {
                // No kvgate event stream to subscribe to: holdings are approximated; the load
                // comes from its load stream, when a KV-exact service routes to it.
                *entry.runtime.events.lock() = EventStreamState::Unsupported;
                if events {
                    *entry.runtime.load_stream.lock() = LoadStreamState::Connecting;
                    let (ctx, id, base_url, cancel) = (
                        self.ctx.clone(),
                        id.clone(),
                        base_url.clone(),
                        cancel.clone(),
                    );
                    handles.push(self.handle.spawn(async move {
                        load_loop(&ctx, &id, &base_url, &cancel, None).await;
                    }));
                } else {
                    *entry.runtime.load_stream.lock() = LoadStreamState::Off;
                    *entry.runtime.reported_load.lock() = None;
                }
            } else if events {
                *entry.runtime.events.lock() = EventStreamState::Connecting;
                *entry.runtime.load_stream.lock() = LoadStreamState::Off;
                handles.push(self.handle.spawn(event_loop(
                    self.ctx.clone(),
                    id.clone(),
                    base_url.clone(),
                    cancel.clone(),
                )));
            } else {
                *entry.runtime.events.lock() = EventStreamState::NotSubscribed;
                *entry.runtime.load_stream.lock() = LoadStreamState::Off;
                *entry.runtime.reported_load.lock() = None;
                entry
                    .runtime
                    .events_synced
                    .store(false, std::sync::atomic::Ordering::Release);
            }
            self.tasks.insert(
                id,
                WorkerTasks {
                    target,
                    cancel,
                    handles,
                },
            );
        }
    }

    /// Cancels every task; returns their handles to await.
    pub fn shutdown(&mut self) -> Vec<JoinHandle<()>> {
        self.root.cancel();
        std::mem::take(&mut self.tasks)
            .into_values()
            .flat_map(|t| t.handles)
            .collect()
    }
}

async fn sleep_or_cancel(d: Duration, cancel: &CancellationToken) -> bool {
    tokio::select! {
        biased;
        _ = cancel.cancelled() => false,
        _ = tokio::time::sleep(d) => true,
    }
}

async fn health_loop(ctx: TaskCtx, id: WorkerId, url: String, cancel: CancellationToken) {
    loop {
        let Some(data) = ctx.data.upgrade() else {
            return;
        };
        let interval = Duration::from_millis(
            data.views
                .load()
                .snapshot
                .rules()
                .gateway
                .health_interval_ms
                .max(10),
        );
        let timeout = interval.clamp(Duration::from_millis(200), Duration::from_secs(2));
        let probe = ctx.http.get(&url).timeout(timeout).send();
        let ok = tokio::select! {
            biased;
            _ = cancel.cancelled() => return,
            r = probe => r.is_ok_and(|r| r.status().is_success()),
        };
        let view = data.views.load();
        let entry = view.workers.get(&id);
        let was_healthy = entry.is_some_and(|e| e.healthy);
        if let (true, Some(e)) = (ok, entry) {
            e.runtime
                .consecutive_failures
                .store(0, std::sync::atomic::Ordering::Relaxed);
            let unknown = e.runtime.reported.lock().is_none();
            if !e.runtime.contract_ok() || !was_healthy || unknown {
                if let Some(checks) = ctx.checks.upgrade() {
                    checks.recheck(id.clone()).await;
                }
            }
        }
        drop(view);
        data.set_health(&id, ok);
        // Bound the memory of approximate holdings (queries already ignore expired ones).
        data.index.expire_approximate();
        drop(data);
        if !sleep_or_cancel(interval, &cancel).await {
            return;
        }
    }
}

/// Why one event stream ended.
enum StreamEnd {
    /// The task was cancelled (worker removed, gateway stopping).
    Cancelled,
    /// The worker closed the stream, or it broke (network, an event over the size cap).
    Ended,
    /// An envelope skipped some seqs: resubscribe from the last applied position.
    Gap,
    /// The index refused an envelope: resubscribe from scratch (a snapshot rebuilds it).
    IndexError,
}

/// Largest SSE event accepted from a worker (bytes between two blank lines). A snapshot run is
/// one prompt chain (context / block size keys, ~19 bytes each), far below this.
pub const MAX_EVENT_BYTES: usize = 4 << 20;

/// Sets a worker's stream state (`runtime.events`, `runtime.load_stream`) from its task, unless
/// the task was cancelled: the supervisor cancels a task before it sets the state itself
/// (`Supervisor::sync`), and the check is made under the state's lock, so a cancelled task never
/// overwrites what the supervisor set.
fn set_state<T>(slot: &parking_lot::Mutex<T>, cancel: &CancellationToken, state: T) {
    let mut s = slot.lock();
    if !cancel.is_cancelled() {
        *s = state;
    }
}

fn set_events(
    runtime: &crate::view::WorkerRuntime,
    cancel: &CancellationToken,
    state: EventStreamState,
) {
    set_state(&runtime.events, cancel, state);
}

async fn event_loop(ctx: TaskCtx, id: WorkerId, base_url: String, cancel: CancellationToken) {
    let mut position: Option<(u64, u64)> = None;
    let mut backoff = BACKOFF_MIN;
    loop {
        let url = match position {
            Some((e, q)) => {
                format!("{base_url}/v1/kv/events?since_epoch={e}&since_seq={q}&load=true")
            }
            None => format!("{base_url}/v1/kv/events?load=true"),
        };
        let Some(runtime) = runtime_of(&ctx, &id) else {
            return;
        };
        let Some(resp) = open_stream(&ctx, &id, &url, &cancel).await else {
            return;
        };
        let wait = match resp {
            Ok(r) if r.status() == reqwest::StatusCode::NOT_FOUND => {
                set_events(&runtime, &cancel, EventStreamState::Unsupported);
                // Until the next probe, its load alone (when it has a load stream).
                set_load_stream(&runtime, &cancel, LoadStreamState::Connecting);
                let until = Instant::now() + UNSUPPORTED_RETRY;
                if !load_loop(&ctx, &id, &base_url, &cancel, Some(until)).await {
                    return;
                }
                Duration::ZERO
            }
            Ok(r) if r.status().is_success() => {
                set_events(&runtime, &cancel, EventStreamState::Connected);
                *runtime.events_last_heard.lock() = Some(Instant::now());
                let end = read_stream(&ctx.data, &id, &runtime, r, &mut position, &cancel).await;
                if matches!(end, StreamEnd::Cancelled) {
                    return;
                }
                set_events(&runtime, &cancel, EventStreamState::Connecting);
                *runtime.reported_load.lock() = None;
                runtime
                    .events_synced
                    .store(false, std::sync::atomic::Ordering::Release);
                match end {
                    StreamEnd::Cancelled => return,
                    StreamEnd::Gap => {
                        backoff = BACKOFF_MIN;
                        BACKOFF_MIN
                    }
                    StreamEnd::Ended => {
                        backoff = BACKOFF_MIN;
                        BACKOFF_MIN
                    }
                    StreamEnd::IndexError => {
                        // The index's view of this worker is unknown now: start over (the worker
                        // answers a subscription without position with cleared + snapshot).
                        position = None;
                        let w = backoff;
                        backoff = (backoff * 2).min(BACKOFF_MAX);
                        w
                    }
                }
            }
            _ => {
                set_events(&runtime, &cancel, EventStreamState::Connecting);
                let w = backoff;
                backoff = (backoff * 2).min(BACKOFF_MAX);
                w
            }
        };
        if !sleep_or_cancel(wait, &cancel).await {
            return;
        }
    }
}

/// A worker's live state, while the gateway runs and the worker is in its view.
fn runtime_of(ctx: &TaskCtx, id: &WorkerId) -> Option<Arc<crate::view::WorkerRuntime>> {
    let data = ctx.data.upgrade()?;
    let view = data.views.load();
    view.workers.get(id).map(|e| e.runtime.clone())
}

/// Opens an SSE subscription to `url` on worker `id`: `None` when the gateway stopped or
/// `cancel` fired first. A worker that requires tickets serves its streams only with the
/// gateway's access token; a fresh one per connection.
async fn open_stream(
    ctx: &TaskCtx,
    id: &WorkerId,
    url: &str,
    cancel: &CancellationToken,
) -> Option<reqwest::Result<reqwest::Response>> {
    let token = {
        let data = ctx.data.upgrade()?;
        receipts::AccessToken::new(&data.gateway_id, id, receipts::now_ms()).sign(&data.signer)
    };
    let connect = ctx
        .http
        .get(url)
        .header("accept", "text/event-stream")
        .bearer_auth(token)
        .send();
    tokio::select! {
        biased;
        _ = cancel.cancelled() => None,
        r = connect => Some(r),
    }
}

/// Records one `event: load` message's data as the worker's report (a malformed one is
/// logged and ignored).
fn apply_load(runtime: &crate::view::WorkerRuntime, id: &WorkerId, data: &str) {
    match serde_json::from_str::<prefix_index::WorkerLoad>(data) {
        Ok(load) => runtime.report_load(load, Instant::now()),
        Err(e) => tracing::warn!(worker = %id, error = %e, "malformed load event ignored"),
    }
}

fn set_load_stream(
    runtime: &crate::view::WorkerRuntime,
    cancel: &CancellationToken,
    state: LoadStreamState,
) {
    set_state(&runtime.load_stream, cancel, state);
}

/// Reads a worker's `GET /v1/load` (its load messages alone) into its runtime, reconnecting
/// after failures with backoff and after a 404 (or an answer that is not an event stream)
/// every 30 s, until cancelled — or until `until`, when given (then the state goes back to
/// `Off` and the report is forgotten). Returns `false` when cancelled (or the gateway is gone).
async fn load_loop(
    ctx: &TaskCtx,
    id: &WorkerId,
    base_url: &str,
    cancel: &CancellationToken,
    until: Option<Instant>,
) -> bool {
    let url = format!("{base_url}/v1/load");
    let mut backoff = BACKOFF_MIN;
    loop {
        let Some(runtime) = runtime_of(ctx, id) else {
            break false;
        };
        if until.is_some_and(|u| Instant::now() >= u) {
            set_load_stream(&runtime, cancel, LoadStreamState::Off);
            *runtime.reported_load.lock() = None;
            break true;
        }
        let Some(resp) = open_stream(ctx, id, &url, cancel).await else {
            break false;
        };
        let sse = |r: &reqwest::Response| {
            r.headers()
                .get(reqwest::header::CONTENT_TYPE)
                .and_then(|v| v.to_str().ok())
                .is_some_and(|v| v.starts_with("text/event-stream"))
        };
        let wait = match resp {
            Ok(r) if r.status().is_success() && sse(&r) => {
                set_load_stream(&runtime, cancel, LoadStreamState::Connected);
                let ended = read_load_stream(id, &runtime, r, cancel, until).await;
                *runtime.reported_load.lock() = None;
                if !ended {
                    break false;
                }
                set_load_stream(&runtime, cancel, LoadStreamState::Connecting);
                backoff = BACKOFF_MIN;
                BACKOFF_MIN
            }
            Ok(r) if r.status().is_success() || r.status().is_client_error() => {
                // No load stream here (a native engine without a sidecar, an older sidecar).
                set_load_stream(&runtime, cancel, LoadStreamState::Unsupported);
                UNSUPPORTED_RETRY
            }
            _ => {
                set_load_stream(&runtime, cancel, LoadStreamState::Connecting);
                let w = backoff;
                backoff = (backoff * 2).min(BACKOFF_MAX);
                w
            }
        };
        let wait = match until {
            Some(u) => wait.min(u.saturating_duration_since(Instant::now())),
            None => wait,
        };
        if !sleep_or_cancel(wait, cancel).await {
            break false;
        }
    }
}

/// Applies a load stream's messages (other events are ignored: this stream feeds no index)
/// until it ends (`true`), `until` passes (`true`) or `cancel` fires (`false`).
async fn read_load_stream(
    id: &WorkerId,
    runtime: &Arc<crate::view::WorkerRuntime>,
    resp: reqwest::Response,
    cancel: &CancellationToken,
    until: Option<Instant>,
) -> bool {
    let heard = runtime.clone();
    let bytes = BoundedEvents::new(resp.bytes_stream(), MAX_LOAD_EVENT_BYTES, move || {
        *heard.events_last_heard.lock() = Some(Instant::now());
    });
    let mut events = bytes.eventsource();
    let deadline = until.map(tokio::time::Instant::from_std);
    loop {
        let next = tokio::select! {
            biased;
            _ = cancel.cancelled() => return false,
            _ = async {
                match deadline {
                    Some(d) => tokio::time::sleep_until(d).await,
                    None => std::future::pending().await,
                }
            } => return true,
            e = events.next() => e,
        };
        match next {
            None => return true,
            Some(Err(e)) => {
                tracing::debug!(worker = %id, error = %e, "load stream broke");
                return true;
            }
            Some(Ok(ev)) if ev.event == prefix_index::protocol::LOAD_EVENT_NAME => {
                apply_load(runtime, id, &ev.data)
            }
            Some(Ok(_)) => {}
        }
    }
}

/// Largest SSE event accepted on a load stream (a load message is ~80 bytes).
const MAX_LOAD_EVENT_BYTES: usize = 64 << 10;

/// Applies one subscription's envelopes to the index by the stream protocol
/// ([`prefix_index::PrefixIndex::apply_envelope`]), keeping `position` at the last applied one.
async fn read_stream(
    data: &Weak<DataPlane>,
    id: &WorkerId,
    runtime: &Arc<crate::view::WorkerRuntime>,
    resp: reqwest::Response,
    position: &mut Option<(u64, u64)>,
    cancel: &CancellationToken,
) -> StreamEnd {
    let heard = runtime.clone();
    let bytes = BoundedEvents::new(resp.bytes_stream(), MAX_EVENT_BYTES, move || {
        *heard.events_last_heard.lock() = Some(Instant::now());
    });
    let mut events = bytes.eventsource();
    loop {
        let next = tokio::select! {
            biased;
            _ = cancel.cancelled() => return StreamEnd::Cancelled,
            e = events.next() => e,
        };
        let ev = match next {
            None => return StreamEnd::Ended,
            Some(Err(e)) => {
                tracing::debug!(worker = %id, error = %e, "KV event stream broke");
                return StreamEnd::Ended;
            }
            Some(Ok(ev)) => ev,
        };
        if ev.data.is_empty() {
            continue;
        }
        if ev.event == prefix_index::protocol::LOAD_EVENT_NAME {
            apply_load(runtime, id, &ev.data);
            continue;
        }
        let env: KvEventEnvelope = match serde_json::from_str(&ev.data) {
            Ok(e) => e,
            Err(e) => {
                tracing::warn!(worker = %id, error = %e, "malformed KV event ignored");
                continue;
            }
        };
        let Some(d) = data.upgrade() else {
            return StreamEnd::Cancelled;
        };
        match d.index.apply_envelope(id, &env) {
            Ok(EnvelopeOutcome::Applied | EnvelopeOutcome::NewEpoch { .. }) => {
                *position = Some((env.epoch, env.seq));
                *runtime.events_position.lock() = *position;
                runtime
                    .events_applied
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
            Ok(EnvelopeOutcome::Duplicate) => {}
            Ok(EnvelopeOutcome::Gap { expected, got }) => {
                tracing::debug!(worker = %id, expected, got, "KV event gap: resubscribing");
                return StreamEnd::Gap;
            }
            Err(e) => {
                tracing::debug!(worker = %id, error = %e, "KV event not applied");
                return StreamEnd::IndexError;
            }
        }
    }
}

/// A byte stream that fails once one SSE event (the bytes between two blank lines) grows
/// past a cap, so a worker that never ends an event cannot grow the gateway's memory; calls
/// `on_bytes` for every chunk (keep-alive comments included). O(1) per byte, no rescans.
struct BoundedEvents<S, F> {
    inner: S,
    cap: usize,
    since_boundary: usize,
    /// The last byte seen was `\n` (ignoring `\r`): a second one ends an event.
    after_newline: bool,
    on_bytes: F,
}

impl<S, F> BoundedEvents<S, F> {
    fn new(inner: S, cap: usize, on_bytes: F) -> Self {
        BoundedEvents {
            inner,
            cap,
            since_boundary: 0,
            after_newline: true,
            on_bytes,
        }
    }
}

/// The error of a [`BoundedEvents`] stream.
#[derive(Debug, thiserror::Error)]
enum EventStreamError {
    #[error("an event exceeds {0} bytes")]
    TooLarge(usize),
    #[error(transparent)]
    Http(#[from] reqwest::Error),
}

impl<S, F> futures::Stream for BoundedEvents<S, F>
where
    S: futures::Stream<Item = Result<bytes::Bytes, reqwest::Error>> + Unpin,
    F: FnMut() + Unpin,
{
    type Item = Result<bytes::Bytes, EventStreamError>;

    fn poll_next(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Self::Item>> {
        use std::task::Poll;
        let this = &mut *self;
        match std::pin::Pin::new(&mut this.inner).poll_next(cx) {
            Poll::Ready(Some(Ok(chunk))) => {
                (this.on_bytes)();
                for &b in chunk.iter() {
                    match b {
                        b'\r' => {}
                        b'\n' if this.after_newline => this.since_boundary = 0,
                        b'\n' => this.after_newline = true,
                        _ => {
                            this.after_newline = false;
                            this.since_boundary += 1;
                            if this.since_boundary > this.cap {
                                return Poll::Ready(Some(Err(EventStreamError::TooLarge(
                                    this.cap,
                                ))));
                            }
                        }
                    }
                }
                Poll::Ready(Some(Ok(chunk)))
            }
            Poll::Ready(Some(Err(e))) => Poll::Ready(Some(Err(e.into()))),
            Poll::Ready(None) => Poll::Ready(None),
            Poll::Pending => Poll::Pending,
        }
    }
}

impl Drop for Supervisor {
    fn drop(&mut self) {
        self.root.cancel();
    }
}
