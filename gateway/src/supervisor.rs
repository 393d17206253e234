//! Owned background tasks, one pair per worker: the active health check (`GET /ready`) and the
//! KV event subscription (`GET /v1/kv/events`, SSE). Each task has its own cancellation token
//! and a kept `JoinHandle`; [`Supervisor::sync`] starts tasks for new workers and cancels those
//! of removed ones (and drops them from the index); [`Supervisor::shutdown`] cancels all.
//!
//! Event subscription: the stream is resumed from the last applied `(epoch, seq)`; the worker
//! answers an unknown position or a new epoch with `cleared` followed by a snapshot of every
//! cached key, so applying events in order always converges. A sequence gap inside a stream
//! makes the subscriber reconnect from its last position (which yields that snapshot).
//! Reconnects back off exponentially (100 ms .. 5 s). A worker that answers 404 has no event
//! stream: its holdings are approximated from routed keys, and the stream is probed again
//! every 30 s.

use std::collections::BTreeMap;
use std::sync::Weak;
use std::time::{Duration, Instant};

use futures::StreamExt;
use prefix_index::{KvEvent, KvEventEnvelope, WorkerId};
use tokio::runtime::Handle;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::core::Shared;
use crate::view::{EventStreamState, View};

const BACKOFF_MIN: Duration = Duration::from_millis(100);
const BACKOFF_MAX: Duration = Duration::from_secs(5);
const UNSUPPORTED_RETRY: Duration = Duration::from_secs(30);

struct WorkerTasks {
    base_url: String,
    cancel: CancellationToken,
    handles: Vec<JoinHandle<()>>,
}

/// The background tasks of every worker in the current view.
pub struct Supervisor {
    handle: Handle,
    shared: Weak<Shared>,
    root: CancellationToken,
    tasks: BTreeMap<WorkerId, WorkerTasks>,
}

impl Supervisor {
    /// A supervisor spawning on `handle`.
    pub fn new(handle: Handle, shared: Weak<Shared>) -> Supervisor {
        Supervisor {
            handle,
            shared,
            root: CancellationToken::new(),
            tasks: BTreeMap::new(),
        }
    }

    /// Starts tasks for workers new to `view` (or whose URL changed), stops the others.
    pub fn sync(&mut self, view: &View) {
        let wanted: BTreeMap<WorkerId, String> = view
            .workers
            .iter()
            .map(|(id, e)| (id.clone(), e.upstream.base_url()))
            .collect();
        let stale: Vec<WorkerId> = self
            .tasks
            .iter()
            .filter(|(id, t)| wanted.get(*id) != Some(&t.base_url))
            .map(|(id, _)| id.clone())
            .collect();
        for id in stale {
            if let Some(t) = self.tasks.remove(&id) {
                t.cancel.cancel();
            }
            if let Some(shared) = self.shared.upgrade() {
                shared.index.remove_worker(&id);
            }
        }
        for (id, base_url) in wanted {
            if self.tasks.contains_key(&id) {
                continue;
            }
            if let Some(shared) = self.shared.upgrade() {
                shared.index.add_worker(&id);
            }
            let cancel = self.root.child_token();
            let health = self.handle.spawn(health_loop(
                self.shared.clone(),
                id.clone(),
                base_url.clone(),
                cancel.clone(),
            ));
            let events = self.handle.spawn(event_loop(
                self.shared.clone(),
                id.clone(),
                base_url.clone(),
                cancel.clone(),
            ));
            self.tasks.insert(
                id,
                WorkerTasks {
                    base_url,
                    cancel,
                    handles: vec![health, events],
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

async fn health_loop(
    shared: Weak<Shared>,
    id: WorkerId,
    base_url: String,
    cancel: CancellationToken,
) {
    let url = format!("{base_url}/ready");
    loop {
        let Some(s) = shared.upgrade() else { return };
        let interval = Duration::from_millis(
            s.views
                .load()
                .snapshot
                .rules()
                .gateway
                .health_interval_ms
                .max(10),
        );
        let timeout = interval.clamp(Duration::from_millis(200), Duration::from_secs(2));
        let probe = s.http.get(&url).timeout(timeout).send();
        let ok = tokio::select! {
            biased;
            _ = cancel.cancelled() => return,
            r = probe => r.is_ok_and(|r| r.status().is_success()),
        };
        let was_healthy = s.views.load().workers.get(&id).is_some_and(|e| e.healthy);
        if ok {
            if let Some(e) = s.views.load().workers.get(&id) {
                e.runtime
                    .consecutive_failures
                    .store(0, std::sync::atomic::Ordering::Relaxed);
                if !e.runtime.contract_ok() || !was_healthy {
                    s.recheck_contract(&id).await;
                }
            }
        }
        s.set_health(&id, ok);
        // Bound the memory of approximate holdings (queries already ignore expired ones).
        s.index.expire_approximate();
        drop(s);
        if !sleep_or_cancel(interval, &cancel).await {
            return;
        }
    }
}

enum StreamEnd {
    Cancelled,
    Ended,
    Gap,
}

async fn event_loop(
    shared: Weak<Shared>,
    id: WorkerId,
    base_url: String,
    cancel: CancellationToken,
) {
    let mut position: Option<(u64, u64)> = None;
    let mut backoff = BACKOFF_MIN;
    loop {
        let Some(s) = shared.upgrade() else { return };
        let url = match position {
            Some((e, q)) => format!("{base_url}/v1/kv/events?since_epoch={e}&since_seq={q}"),
            None => format!("{base_url}/v1/kv/events"),
        };
        let runtime = s.views.load().workers.get(&id).map(|e| e.runtime.clone());
        let Some(runtime) = runtime else { return };
        let connect = s
            .http
            .get(&url)
            .header("accept", "text/event-stream")
            .send();
        let resp = tokio::select! {
            biased;
            _ = cancel.cancelled() => return,
            r = connect => r,
        };
        let wait = match resp {
            Ok(r) if r.status() == reqwest::StatusCode::NOT_FOUND => {
                *runtime.events.lock() = EventStreamState::Unsupported;
                UNSUPPORTED_RETRY
            }
            Ok(r) if r.status().is_success() => {
                *runtime.events.lock() = EventStreamState::Connected;
                *runtime.events_last_heard.lock() = Some(Instant::now());
                backoff = BACKOFF_MIN;
                drop(s);
                let end = read_stream(&shared, &id, &runtime, r, &mut position, &cancel).await;
                *runtime.events.lock() = EventStreamState::Connecting;
                match end {
                    StreamEnd::Cancelled => return,
                    StreamEnd::Gap | StreamEnd::Ended => BACKOFF_MIN,
                }
            }
            _ => {
                *runtime.events.lock() = EventStreamState::Connecting;
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

async fn read_stream(
    shared: &Weak<Shared>,
    id: &WorkerId,
    runtime: &crate::view::WorkerRuntime,
    resp: reqwest::Response,
    position: &mut Option<(u64, u64)>,
    cancel: &CancellationToken,
) -> StreamEnd {
    let mut stream = resp.bytes_stream();
    let mut buf: Vec<u8> = Vec::new();
    loop {
        let chunk = tokio::select! {
            biased;
            _ = cancel.cancelled() => return StreamEnd::Cancelled,
            c = stream.next() => c,
        };
        let Some(Ok(chunk)) = chunk else {
            return StreamEnd::Ended;
        };
        *runtime.events_last_heard.lock() = Some(Instant::now());
        buf.extend_from_slice(&chunk);
        while let Some(nl) = buf.iter().position(|&b| b == b'\n') {
            let line: Vec<u8> = buf.drain(..=nl).collect();
            let line = line.strip_suffix(b"\n").unwrap_or(&line);
            let line = line.strip_suffix(b"\r").unwrap_or(line);
            let Some(data) = line.strip_prefix(b"data:") else {
                continue;
            };
            let data = data.strip_prefix(b" ").unwrap_or(data);
            let env: KvEventEnvelope = match serde_json::from_slice(data) {
                Ok(e) => e,
                Err(e) => {
                    tracing::warn!(worker = %id, error = %e, "malformed KV event ignored");
                    continue;
                }
            };
            // Snapshot envelopes share the seq S of the last event they include (after a
            // `cleared` with that seq), live events continue at S + 1: accept `seq >= last`
            // (re-applying an equal-seq event is idempotent), skip older ones, and resync on
            // a gap.
            let same_epoch = position.is_some_and(|(epoch, _)| epoch == env.epoch);
            if let (true, Some((_, seq))) = (same_epoch, *position) {
                if env.seq < seq {
                    continue;
                }
                if env.seq > seq + 1 {
                    return StreamEnd::Gap;
                }
            }
            let Some(s) = shared.upgrade() else {
                return StreamEnd::Cancelled;
            };
            if !same_epoch && position.is_some() && env.event != KvEvent::Cleared {
                // A new epoch means the worker's cache restarted empty.
                let _ = s.index.apply_event(id, &KvEvent::Cleared);
            }
            if let Err(e) = s.index.apply_event(id, &env.event) {
                tracing::debug!(worker = %id, error = %e, "KV event not applied");
                return StreamEnd::Cancelled;
            }
            *position = Some((env.epoch, env.seq));
            *runtime.events_position.lock() = *position;
            runtime
                .events_applied
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
    }
}

impl Drop for Supervisor {
    fn drop(&mut self) {
        self.root.cancel();
    }
}
