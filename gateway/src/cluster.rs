//! Cluster mode (`--cluster redis://…`): replicas behind one VIP share the rules, worker
//! registrations, gateway keys and per-worker load through Redis (the `cluster` crate holds the
//! key layout; docs/cluster.md). Without it nothing here runs and the gateway is exactly the
//! single-process one.
//!
//! Owned tasks (cancellation token, kept handles), each holding the control plane weakly:
//! - the **sync loop**, every `poll` (lease / 5): reads the rules document (installs a newer
//!   version; re-seeds an empty store — Redis restarted without persistence — from the rules in
//!   force, keeping their version), renews this replica's key record, reads the registrations
//!   (a change rebuilds the view), writes this replica's load table and reads the others';
//! - the **watch loop**: subscribes to the rules channel, so a change is installed within one
//!   round trip of its write (the sync loop's periodic read heals a missed message);
//! - the **holdings loops**: this replica's routing-time holdings (a KV-exact prompt's keys →
//!   the chosen worker) are published, off the request path through a bounded queue, and the
//!   others' are applied to this replica's index, so a burst with one new prefix spread over
//!   replicas still follows the first request (the KV events make them precise later).
//!
//! - the **responses writer**: the Responses API turns this replica stores are written to Redis
//!   off the request path (bounded queue; [`SharedResponses`]; what Redis did not take waits in
//!   a bounded backlog, [`crate::write_backlog`], and is written once Redis answers), and the
//!   others' are read there when a request continues or reads them.
//!
//! When Redis fails, both loops keep retrying (the connection reconnects, the subscription
//! backs off 200 ms .. 2 s) and the replica keeps serving with the last rules, registrations and
//! load it saw: `degraded` in `/admin/cluster` and `kvgate_gateway_cluster_degraded` = 1. No
//! request path waits on Redis except a close KV-exact decision's claim ([`Claims`]), for at
//! most [`ClusterSettings::claim_timeout`], and a Responses API request that continues or reads
//! a stored response ([`SharedResponses`], at most [`SHARED_RESPONSES_TIMEOUT`] per read) —
//! neither while degraded: the load guard reads two atomics the sync loop fills.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use futures::StreamExt;
use parking_lot::Mutex;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::control_plane::ControlPlane;
use crate::write_backlog::{Deferred, WriteBacklog};

/// How to join a cluster.
#[derive(Clone, Debug)]
pub struct ClusterSettings {
    /// `redis://[user:password@]host[:port][/db]` or `rediss://…` (TLS).
    pub url: String,
    /// Key prefix (several clusters can share one Redis). Default `kvgate`.
    pub prefix: String,
    /// Lease of this replica's key record and load table; registrations are read every
    /// `lease / 5`. Default 5 s.
    pub lease: Duration,
    /// How long a cold placement's claim counts for the other replicas ([`Claims`]): a bit
    /// longer than the published decision takes to reach them (then their own view counts
    /// it). Default 10 ms; zero turns claims off.
    pub claim_ttl: Duration,
    /// How long a decision waits for its claim before it keeps its own choice unclaimed.
    /// Default 25 ms (docs/cluster.md, "Claims": a claim that gave up still runs in Redis).
    pub claim_timeout: Duration,
    /// Bytes of stored Responses API turns the replicas keep in Redis together, at most
    /// (`cluster::Store::put_response`: least recently used out first); 0: bounded by the idle
    /// TTL only. Default 1 GiB.
    pub response_budget: u64,
}

impl ClusterSettings {
    /// Defaults for `url`.
    pub fn new(url: impl Into<String>) -> ClusterSettings {
        ClusterSettings {
            url: url.into(),
            prefix: "kvgate".into(),
            lease: Duration::from_secs(5),
            claim_ttl: DEFAULT_CLAIM_TTL,
            claim_timeout: DEFAULT_CLAIM_TIMEOUT,
            response_budget: DEFAULT_RESPONSE_BUDGET,
        }
    }

    /// The sync period.
    pub fn poll(&self) -> Duration {
        (self.lease / 5).max(Duration::from_millis(100))
    }
}

/// Default [`ClusterSettings::response_budget`]: 1 GiB.
pub const DEFAULT_RESPONSE_BUDGET: u64 = 1 << 30;

/// Default [`ClusterSettings::claim_ttl`].
pub const DEFAULT_CLAIM_TTL: Duration = Duration::from_millis(10);
/// Default [`ClusterSettings::claim_timeout`].
pub const DEFAULT_CLAIM_TIMEOUT: Duration = Duration::from_millis(25);

/// What `/admin/cluster` shows.
#[derive(Debug, Default)]
pub struct ClusterStatus {
    pub degraded: AtomicBool,
    /// Whether the shared rules and registrations were read at least once (at the start, or
    /// by a sync after a start without Redis): until then `/ready` answers 503.
    pub loaded: AtomicBool,
    pub last_error: Mutex<Option<String>>,
    /// The replicas whose key records were live at the last sync.
    pub replicas: Mutex<Vec<String>>,
    /// The registered worker ids at the last sync.
    pub registered: Mutex<Vec<String>>,
    /// The replicas' stored responses in Redis, bytes (`P:responses:bytes`), at the last sync.
    pub shared_response_bytes: AtomicU64,
}

/// This replica's membership: the store connection, the status and the owned loops.
pub struct ClusterLink {
    pub settings: ClusterSettings,
    pub status: ClusterStatus,
    store: arc_swap::ArcSwapOption<cluster::Store>,
    record: cluster::GatewayRecord,
    cancel: CancellationToken,
    handles: Mutex<Vec<JoinHandle<()>>>,
}

impl ClusterLink {
    /// A link for replica `gateway_id` publishing `key`'s public half (not connected yet).
    pub fn new(
        settings: ClusterSettings,
        gateway_id: &str,
        key: &receipts::KeyPair,
    ) -> Result<ClusterLink, cluster::ClusterError> {
        cluster::check_url(&settings.url)?;
        Ok(ClusterLink {
            settings,
            status: ClusterStatus::default(),
            store: arc_swap::ArcSwapOption::empty(),
            record: cluster::GatewayRecord {
                gateway_id: gateway_id.to_string(),
                key_id: key.key_id().to_string(),
                public_key_hex: hex::encode(key.public().to_bytes()),
            },
            cancel: CancellationToken::new(),
            handles: Mutex::new(Vec::new()),
        })
    }

    /// The connected store (`None` while Redis could never be reached).
    pub fn store(&self) -> Option<Arc<cluster::Store>> {
        self.store.load_full()
    }

    /// Connects (or returns the existing connection).
    pub async fn connect(&self) -> Result<Arc<cluster::Store>, cluster::ClusterError> {
        if let Some(s) = self.store() {
            return Ok(s);
        }
        let s = Arc::new(cluster::Store::connect(&self.settings.url, &self.settings.prefix).await?);
        self.store.store(Some(s.clone()));
        Ok(s)
    }

    /// This replica's id.
    pub fn replica_id(&self) -> &str {
        &self.record.gateway_id
    }

    /// Records a failure: degraded until the next successful sync.
    pub fn failed(&self, control: &ControlPlane, e: &cluster::ClusterError) {
        if !self.status.degraded.swap(true, Ordering::Relaxed) {
            tracing::warn!(error = %e, "cluster store unreachable: serving on the last state");
        }
        *self.status.last_error.lock() = Some(e.to_string());
        control.data.metrics.cluster_degraded.set(1);
    }

    /// Records a successful read of the shared state (at the start or by a sync).
    pub fn loaded(&self) {
        self.status.loaded.store(true, Ordering::Release);
    }

    fn healthy(&self, control: &ControlPlane) {
        self.loaded();
        if self.status.degraded.swap(false, Ordering::Relaxed) {
            tracing::info!("cluster store reachable again: resynced");
        }
        control.data.metrics.cluster_degraded.set(0);
    }

    /// Starts the sync, watch and holdings loops on `handle`.
    pub fn start(self: &Arc<Self>, control: &Arc<ControlPlane>, handle: &tokio::runtime::Handle) {
        let weak = Arc::downgrade(control);
        let me = self.clone();
        let (tx, rx) = tokio::sync::mpsc::channel(HOLDINGS_QUEUE);
        control.data.shared_holdings.store(Some(Arc::new(tx)));
        if !self.settings.claim_ttl.is_zero() {
            control.data.claims.store(Some(Arc::new(Claims {
                link: self.clone(),
                seq: AtomicU64::new(0),
            })));
        }
        let sync = handle.spawn(sync_loop(me.clone(), weak.clone()));
        let watch = handle.spawn(watch_loop(me.clone(), weak.clone()));
        let publish = handle.spawn(publish_holdings(me.clone(), rx));
        let mut handles = vec![sync, watch, publish];
        let responses = control.data.responses.limits();
        if control.data.responses.enabled() {
            let (tx, rx) = tokio::sync::mpsc::channel(RESPONSES_QUEUE);
            let (events, events_rx) = tokio::sync::mpsc::channel(EVENT_QUEUE);
            let shared = Arc::new_cyclic(|this| SharedResponses {
                me: this.clone(),
                pending_cancels: Mutex::new(HashSet::new()),
                gaps: Mutex::new(HashMap::new()),
                gap_changes: AtomicU64::new(0),
                link: me.clone(),
                tx,
                writes: AtomicU64::new(0),
                backlog: Mutex::new(WriteBacklog::new(responses.max_bytes)),
                events,
                ttl: responses.idle_ttl,
                pending_deletes: Mutex::new(HashSet::new()),
                evictions: control.data.metrics.cluster_response_evictions.clone(),
            });
            handles.push(handle.spawn(write_events(
                me.clone(),
                shared.clone(),
                events_rx,
                weak.clone(),
            )));
            control.data.shared_responses.store(Some(shared.clone()));
            handles.push(handle.spawn(write_responses(me.clone(), shared.clone(), rx)));
            handles.push(handle.spawn(receive_deletions(me.clone(), weak.clone())));
            handles.push(handle.spawn(receive_cancels(me.clone(), weak.clone())));
            handles.push(handle.spawn(redo_deferred(me.clone(), shared, weak.clone())));
        }
        handles.push(handle.spawn(receive_holdings(me, weak)));
        self.handles.lock().extend(handles);
    }

    /// Stops the loops (a writer moves what its queue still holds to what waits for Redis),
    /// makes what waits for Redis there ([`SharedResponses::flush`]) and withdraws this
    /// replica's records — within [`STOP_FLUSH_TIMEOUT`] together, on a connection of its own:
    /// the shared one may be reconnecting (Redis gone) in a future that a request started on
    /// the proxy's runtime, which has stopped by now — polling that future's timer from here
    /// would panic. What Redis did not take by then stays in `data`'s shared responses, for
    /// `--response-store-file`'s last save (logged either way).
    pub fn shutdown(&self, handle: &tokio::runtime::Handle, data: &crate::data_plane::DataPlane) {
        self.cancel.cancel();
        let handles: Vec<JoinHandle<()>> = self.handles.lock().drain(..).collect();
        handle.block_on(async {
            for mut h in handles {
                // A loop notices the cancel at its next await; one in a Redis call waits for
                // its timeout (500 ms).
                if tokio::time::timeout(Duration::from_secs(1), &mut h)
                    .await
                    .is_err()
                {
                    h.abort();
                }
            }
        });
        let shared = data.shared_responses.load_full();
        let waits = shared
            .as_ref()
            .is_some_and(|s| !s.waiting().is_empty() || s.mirror_gaps() > 0)
            || !data.responses.pending.is_empty();
        if self.store().is_none() && !waits {
            // Never connected, and nothing to write: no record to withdraw either.
            return;
        }
        let id = self.record.gateway_id.clone();
        let (url, prefix) = (self.settings.url.clone(), self.settings.prefix.clone());
        let _ = handle.block_on(async {
            tokio::time::timeout(STOP_FLUSH_TIMEOUT, async {
                let s = Arc::new(cluster::Store::connect(&url, &prefix).await?);
                // Nothing is served any more: the flush writes through this connection.
                self.store.store(Some(s.clone()));
                self.status.degraded.store(false, Ordering::Relaxed);
                if let Some(shared) = &shared {
                    shared.flush(data).await;
                }
                s.withdraw_gateway(&id).await
            })
            .await
        });
        if let Some(shared) = &shared {
            let mut left = shared.waiting();
            left.changes = data.responses.pending.waiting();
            let gaps = shared.mirror_gaps();
            if left.is_empty() && gaps == 0 {
                tracing::info!("cluster: nothing waits for Redis at the stop");
            } else {
                tracing::warn!(
                    turns = left.turns.len(),
                    deletions = left.deletes.len(),
                    cancels = left.cancels.len(),
                    conversation_changes = left.changes.len(),
                    stream_mirror_gaps = gaps,
                    "cluster: Redis did not take these before the stop; --response-store-file keeps all but the mirror gaps, without it they are lost"
                );
            }
        }
    }
}

/// How long a replica's stop waits for Redis to take what waits for it, and its withdrawal.
pub const STOP_FLUSH_TIMEOUT: Duration = Duration::from_secs(2);

/// The atomic select-and-reserve of close placements across replicas. A KV-exact decision
/// whose runners-up are within one request's cost of its first choice
/// ([`crate::route::Decision::alternatives`]: typically a new prompt, which every idle worker
/// would take at the same cost) would, on two replicas deciding within the time their published
/// decisions take to reach each other (~1 ms on one host), put both requests on the same
/// worker. The decision instead claims in Redis ([`cluster::Store::claim`]: one script,
/// atomic): the alternative whose cost plus what the other replicas' live claims added there is
/// least, claimed for [`ClusterSettings::claim_ttl`] with what this request adds. A clear
/// winner (a long cached prefix), a single candidate or a store that does not answer within
/// [`ClusterSettings::claim_timeout`] keeps the local choice (no request waits longer than
/// that or fails for Redis). Costs one Redis round trip on close decisions only.
pub struct Claims {
    link: Arc<ClusterLink>,
    seq: AtomicU64,
}

impl Claims {
    /// Claims `decision`'s placement among its close alternatives and moves it when another
    /// replica's fresh claim makes one of them cheaper ([`crate::route::redirect`]); a decision
    /// that is not close but follows the routing-time holding of a close one whose claim is
    /// still in flight goes where that claim goes ([`crate::claim_wait`]). Records the outcome
    /// metrics.
    pub async fn settle(
        &self,
        view: &crate::view::View,
        data: &crate::data_plane::DataPlane,
        service: &crate::view::ServiceRoute,
        decision: &mut crate::route::Decision,
        reserved: &mut Option<crate::view::InFlight>,
    ) {
        // Followers learn where this decision went when it is settled (or given up: also when
        // this future is dropped).
        let mut resolving = crate::claim_wait::Resolving::new(
            &service.claims_in_flight,
            decision.claim_mark.take(),
        );
        if decision.close < 2 {
            self.follow(view, data, service, decision, reserved).await;
            return;
        }
        self.claim(view, data, service, decision, reserved).await;
        resolving.outcome = decision.order.first().cloned();
    }

    /// A clear decision whose first choice matched into a close decision's fresh holding on
    /// this replica: waits for that decision's claim (at most the claim timeout) and follows
    /// it, crediting the matched blocks there as a followed lead.
    async fn follow(
        &self,
        view: &crate::view::View,
        data: &crate::data_plane::DataPlane,
        service: &crate::view::ServiceRoute,
        decision: &mut crate::route::Decision,
        reserved: &mut Option<crate::view::InFlight>,
    ) {
        let (Some(first), Some(p)) = (decision.order.first(), decision.prompt.as_ref()) else {
            return;
        };
        let blocks = p
            .placed
            .iter()
            .find(|(w, _)| w == first)
            .map_or(0, |(_, b)| *b);
        let Some(following) = service.claims_in_flight.follow(&p.keys, blocks, first) else {
            return;
        };
        let first = first.clone();
        let blocks = following.blocks;
        let outcome = match following.outcome(self.link.settings.claim_timeout).await {
            Some(to) if to != first => {
                crate::route::redirect(
                    view,
                    &data.index,
                    decision,
                    reserved,
                    service,
                    &to,
                    &data.holdings_seq,
                );
                if decision.order.first() == Some(&to) {
                    crate::route::credit_lead(
                        view,
                        decision,
                        reserved,
                        service,
                        &to,
                        blocks,
                        &data.holdings_seq,
                    );
                    "moved"
                } else {
                    "kept"
                }
            }
            Some(_) => "kept",
            None => "failed",
        };
        data.metrics
            .cluster_claim_follows
            .get_or_create(&crate::metrics::ClaimLabels {
                outcome: outcome.to_owned(),
            })
            .inc();
    }

    /// [`Self::settle`] for a close decision: the claim itself.
    async fn claim(
        &self,
        view: &crate::view::View,
        data: &crate::data_plane::DataPlane,
        service: &crate::view::ServiceRoute,
        decision: &mut crate::route::Decision,
        reserved: &mut Option<crate::view::InFlight>,
    ) {
        let (Some(prefix), Some(first)) = (service.prefix.as_ref(), decision.order.first()) else {
            return;
        };
        // Degraded (the store did not answer the last sync): no claim, so that no decision waits
        // out the timeout while Redis is away; the next successful sync turns claims back on.
        if self.link.status.degraded.load(Ordering::Relaxed) {
            return;
        }
        let Some(store) = self.link.store() else {
            return;
        };
        let (prefill, output) = decision.attempt_tokens(first).unwrap_or((0, 0));
        let rule = &prefix.rule;
        let added = routing_rules::policy::queued_cost(rule, prefill, output);
        let credit = routing_rules::policy::block_credit(rule, prefix.profile.block_size.as_u32());
        let keys: Vec<u64> = decision
            .prompt
            .as_ref()
            .map(|p| p.keys.iter().map(|k| k.0).collect())
            .unwrap_or_default();
        let n = decision.close.min(cluster::MAX_CLAIM_CANDIDATES);
        let ranked: Vec<(&str, u64)> = decision
            .ranked
            .iter()
            .map(|(w, c)| (w.0.as_str(), *c))
            .collect();
        let id = self.seq.fetch_add(1, Ordering::Relaxed).to_string();
        let started = std::time::Instant::now();
        let claimed = tokio::time::timeout(
            self.link.settings.claim_timeout,
            store.claim(&cluster::Claim {
                replica: self.link.replica_id(),
                id: &id,
                candidates: &ranked[..n],
                others: &ranked[n..],
                added,
                credit,
                // One block of a followed lead is one block less of this request's prefill.
                lead_saving: routing_rules::policy::queued_cost(
                    rule,
                    u64::from(prefix.profile.block_size.as_u32()),
                    0,
                ),
                keys: &keys,
                ttl: self.link.settings.claim_ttl,
                lead_ttl: match rule.pending_ttl_ms {
                    0 => self.link.settings.claim_ttl,
                    ms => Duration::from_millis(ms),
                },
            }),
        )
        .await;
        data.metrics
            .cluster_claim_seconds
            .observe(started.elapsed().as_secs_f64());
        let outcome = match claimed {
            Ok(Ok(c)) => {
                let to = prefix_index::WorkerId(c.worker);
                // Following another replica's lead: that many of the prompt's first blocks are
                // being computed there already, not by this request.
                crate::route::credit_lead(
                    view,
                    decision,
                    reserved,
                    service,
                    &to,
                    usize::try_from(c.lead_blocks).unwrap_or(usize::MAX),
                    &data.holdings_seq,
                );
                if decision.order.first() == Some(&to) {
                    "kept"
                } else {
                    crate::route::redirect(
                        view,
                        &data.index,
                        decision,
                        reserved,
                        service,
                        &to,
                        &data.holdings_seq,
                    );
                    "moved"
                }
            }
            Ok(Err(e)) => {
                tracing::debug!(error = %e, "cluster claim failed: the local choice stands");
                "failed"
            }
            Err(_) => "failed",
        };
        data.metrics
            .cluster_claims
            .get_or_create(&crate::metrics::ClaimLabels {
                outcome: outcome.to_owned(),
            })
            .inc();
    }
}

/// Routing-time holdings waiting to be published; more are dropped (placement hints only).
const HOLDINGS_QUEUE: usize = 1024;

/// Publishes this replica's routing-time holdings, one `PUBLISH` each, in order.
/// Stored turns waiting to be written to Redis; more wait in the write backlog
/// ([`crate::write_backlog`]) and are written once the writer catches up.
const RESPONSES_QUEUE: usize = 1024;

/// The longest a request waits for one read of stored responses in Redis before going on with
/// this replica's own copies.
pub const SHARED_RESPONSES_TIMEOUT: Duration = Duration::from_millis(500);

/// The replicas' stored Responses API turns in Redis (`P:response:<id>`, docs/cluster.md):
/// written by [`write_responses`] off the request path, read by the request that continues,
/// reads or deletes one. Reads renew the key's TTL (the idle TTL), as a local read does.
pub struct SharedResponses {
    link: Arc<ClusterLink>,
    /// Turns to write, each with its write's sequence number ([`Self::writes`]).
    tx: tokio::sync::mpsc::Sender<(u64, Arc<crate::response_store::StoredResponse>)>,
    /// The last write's sequence number.
    writes: AtomicU64,
    /// Writes Redis did not take (it did not answer, or the queue was full), tried again by
    /// [`write_responses`] while Redis answers.
    backlog: Mutex<WriteBacklog>,
    /// Streamed background responses' events to mirror ([`write_events`]).
    events: tokio::sync::mpsc::Sender<EventBatch>,
    ttl: Duration,
    /// Deletions made while Redis did not answer, written there by [`redo_deferred`] once it
    /// does (so that a turn deleted during an outage does not come back from Redis, or from
    /// another replica's copy); meanwhile this replica reads them as deleted. At most
    /// [`MAX_PENDING_DELETES`].
    pending_deletes: Mutex<HashSet<String>>,
    /// Records evicted from Redis to make room (`cluster_response_evictions_total`).
    evictions: prometheus_client::metrics::counter::Counter,
    /// Cancels asked through this replica that Redis did not take, written by
    /// [`redo_deferred`] once it does. At most [`MAX_PENDING_CANCELS`].
    pending_cancels: Mutex<HashSet<String>>,
    /// Itself, for the tasks [`crate::response_store::SharedTurns::cancel`] spawns.
    me: Weak<SharedResponses>,
    /// Streamed background responses whose mirror has a gap: id → the first event not
    /// mirrored, and the [`Self::gap_changes`] count when it last moved. At most
    /// [`MAX_MIRROR_GAPS`].
    gaps: Mutex<HashMap<String, (u64, u64)>>,
    gap_changes: AtomicU64,
}

/// Mirrors with a gap kept for filling; more are left with their gap (logged).
pub const MAX_MIRROR_GAPS: usize = 4096;

/// Deletions kept for Redis while it does not answer; more are made on this replica only
/// (logged).
pub const MAX_PENDING_DELETES: usize = 65_536;

/// Cancels of background responses other replicas run, kept while Redis does not answer; more
/// are dropped (logged).
pub const MAX_PENDING_CANCELS: usize = 4096;

/// Ticks every [`REDO_PERIOD`] (a late tick moves the next ones, none is made up).
fn redo_ticks() -> tokio::time::Interval {
    let mut t = tokio::time::interval(REDO_PERIOD);
    t.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    t
}

/// How often what waits for Redis (deletions, cancels, conversation changes, stored turns) is
/// tried again, and running background responses are checked for cancels.
const REDO_PERIOD: Duration = Duration::from_millis(500);

impl SharedResponses {
    /// Keeps a deletion Redis did not take, for [`redo_deferred`].
    fn defer_delete(&self, id: &str) {
        let mut pending = self.pending_deletes.lock();
        if pending.len() < MAX_PENDING_DELETES {
            pending.insert(id.to_owned());
        } else {
            tracing::warn!(id, "stored responses: too many deletions wait for Redis; this one is made on this replica only");
        }
    }

    /// Deletions waiting for Redis.
    pub fn pending_deletes(&self) -> usize {
        self.pending_deletes.lock().len()
    }

    /// Streamed background responses whose mirror waits to be filled.
    pub fn mirror_gaps(&self) -> usize {
        self.gaps.lock().len()
    }

    /// The mirror of `id` misses event `from` (and maybe more after it).
    fn gap(&self, id: &str, from: u64) {
        let change = self.gap_changes.fetch_add(1, Ordering::Relaxed) + 1;
        let mut gaps = self.gaps.lock();
        if let Some((first, changed)) = gaps.get_mut(id) {
            *first = (*first).min(from);
            *changed = change;
        } else if gaps.len() < MAX_MIRROR_GAPS {
            gaps.insert(id.to_owned(), (from, change));
        } else {
            tracing::warn!(
                id,
                "background stream mirror: too many gaps wait to be filled; this one stays"
            );
        }
    }

    /// Writes batch `b` to its mirror, unless that mirror has a gap to fill first.
    async fn mirror(&self, b: EventBatch) {
        if self.gaps.lock().contains_key(&b.id) {
            return;
        }
        let Some(store) = self.store() else {
            self.gap(&b.id, b.first);
            return;
        };
        let append = store.append_events(&b.id, b.first, &b.events, b.end);
        match tokio::time::timeout(SHARED_RESPONSES_TIMEOUT, append).await {
            Ok(Ok(_)) => {}
            failed => {
                if let Ok(Err(e)) = failed {
                    tracing::debug!(error = %e, id = %b.id, "background stream events not mirrored yet");
                }
                self.gap(&b.id, b.first);
            }
        }
    }

    /// Fills the mirrors' gaps from the responses' own event logs (running here, or ended and
    /// still kept: [`crate::background::BackgroundJobs::stream_of`]), each from its first
    /// missing event to the log's end (the end marker too once the log has ended); stops at
    /// the first append that fails. A gap whose log no longer has its first event is filled
    /// from the oldest it has (the resume then reports the rest gone); one whose response is
    /// no longer kept here is dropped.
    async fn fill_gaps(&self, jobs: &crate::background::BackgroundJobs) {
        let Some(store) = self.store() else { return };
        let gaps: Vec<(String, (u64, u64))> = self
            .gaps
            .lock()
            .iter()
            .map(|(k, v)| (k.clone(), *v))
            .collect();
        for (id, (from, change)) in gaps {
            let read = jobs
                .stream_of(&id)
                .and_then(|job| job.events().map(|log| log.read_texts(from)));
            let Some((first, texts, ended)) = read else {
                self.gaps.lock().remove(&id);
                continue;
            };
            let to = first + texts.len() as u64;
            let append = store.append_events(&id, first, &texts, ended);
            if !matches!(
                tokio::time::timeout(SHARED_RESPONSES_TIMEOUT, append).await,
                Ok(Ok(_))
            ) {
                return;
            }
            let mut gaps = self.gaps.lock();
            match gaps.get_mut(&id) {
                // Nothing was dropped since the read: the mirror has all the log had.
                Some((_, c)) if *c == change => {
                    gaps.remove(&id);
                }
                // A batch was dropped meanwhile: the mirror has everything before `to`.
                Some((f, _)) => *f = to,
                None => {}
            }
            drop(gaps);
            tracing::info!(%id, from = first, to, "background stream mirror filled");
        }
    }

    /// Cancels waiting for Redis.
    pub fn pending_cancels(&self) -> usize {
        self.pending_cancels.lock().len()
    }

    /// Asks the replica running the background response `id` to cancel it (through Redis);
    /// whether Redis took the cancel.
    async fn ask_cancel(&self, id: &str) -> bool {
        let Some(store) = self.store() else {
            return false;
        };
        let ask = store.cancel_response(id, self.ttl);
        match tokio::time::timeout(SHARED_RESPONSES_TIMEOUT, ask).await {
            Ok(Ok(())) => true,
            Ok(Err(e)) => {
                tracing::debug!(error = %e, %id, "background cancel not taken by Redis yet");
                false
            }
            Err(_) => false,
        }
    }

    /// Keeps a cancel Redis did not take, for [`redo_deferred`].
    fn defer_cancel(&self, id: &str) {
        let mut pending = self.pending_cancels.lock();
        if pending.len() < MAX_PENDING_CANCELS {
            pending.insert(id.to_owned());
        } else {
            tracing::warn!(
                id,
                "stored responses: too many cancels wait for Redis; this one is dropped"
            );
        }
    }

    /// What waits here for Redis, but the conversation changes (the local store keeps those:
    /// [`crate::conversation::Pending`]).
    pub fn waiting(&self) -> crate::write_backlog::Waiting {
        let turns = self.backlog.lock().waiting();
        crate::write_backlog::Waiting {
            turns: turns.into_iter().map(|(_, t)| t).collect(),
            deletes: self.pending_deletes.lock().iter().cloned().collect(),
            cancels: self.pending_cancels.lock().iter().cloned().collect(),
            changes: Vec::new(),
        }
    }

    /// Takes back what waited for Redis when this gateway last stopped (read back from
    /// `--response-store-file`), before any request: each turn gets a write number of this
    /// process, oldest first, so a newer write of it made here later still wins. Within the
    /// bounds; what is over them is logged.
    pub fn restore_waiting(&self, w: crate::write_backlog::Waiting) {
        for turn in &w.turns {
            let seq = self.writes.fetch_add(1, Ordering::Relaxed) + 1;
            self.defer_write(seq, turn);
        }
        for id in &w.deletes {
            self.defer_delete(id);
        }
        for id in &w.cancels {
            self.defer_cancel(id);
        }
    }

    /// Makes what waits for Redis there, on a store that answers (the replica's stop):
    /// deletions first (a turn deleted here is then not written), the write backlog, cancels,
    /// conversation changes, then the stream mirrors' gaps. Each step stops at its first
    /// failure; what is left stays waiting.
    async fn flush(&self, data: &crate::data_plane::DataPlane) {
        let Some(store) = self.store() else { return };
        let deletes: Vec<String> = self.pending_deletes.lock().iter().cloned().collect();
        for id in deletes {
            if self.retire(&store, &id).await.is_none() {
                break;
            }
            self.pending_deletes.lock().remove(&id);
        }
        let waiting = self.backlog.lock().waiting();
        for (seq, turn) in waiting {
            if !self.write(seq, &turn).await {
                break;
            }
        }
        let cancels: Vec<String> = self.pending_cancels.lock().iter().cloned().collect();
        for id in cancels {
            if !self.ask_cancel(&id).await {
                break;
            }
            self.pending_cancels.lock().remove(&id);
        }
        if !data.responses.pending.is_empty() {
            crate::conversation::retry(&data.responses, self).await;
        }
        if !self.gaps.lock().is_empty() {
            self.fill_gaps(&data.background).await;
        }
    }

    /// Stored turns waiting for Redis: how many, and their bytes.
    pub fn pending_writes(&self) -> (usize, usize) {
        let b = self.backlog.lock();
        (b.len(), b.bytes())
    }

    /// Keeps write `seq` of `turn` for [`write_responses`] to try again.
    fn defer_write(&self, seq: u64, turn: &Arc<crate::response_store::StoredResponse>) {
        if self.backlog.lock().defer(seq, turn) == Deferred::Full {
            tracing::warn!(id = %turn.id, "stored responses: too many turns wait for Redis; this one is kept on this replica only");
        }
    }

    /// Writes `turn` (write `seq`) to Redis, or keeps it for a later try; whether it landed.
    async fn write(&self, seq: u64, turn: &Arc<crate::response_store::StoredResponse>) -> bool {
        if self.backlog.lock().supersedes(&turn.id, seq) {
            // A newer write of it waits in the backlog: that one is made instead.
            return true;
        }
        // Deleted here while Redis was away: the deletion is written instead
        // ([`redo_deferred`]), and Redis's `deleted` marker stops any later write.
        if self.pending_deletes.lock().contains(&turn.id) {
            self.backlog.lock().landed(&turn.id, seq);
            return true;
        }
        let Some(store) = self.store() else {
            self.defer_write(seq, turn);
            return false;
        };
        let (json, now) = (turn.to_json(), receipts::now_ms());
        let budget = self.link.settings.response_budget;
        let put = async {
            if turn.background() {
                store
                    .replace_response(&turn.id, &json, self.ttl, budget, now)
                    .await
            } else {
                store
                    .put_response(&turn.id, &json, self.ttl, budget, now)
                    .await
            }
        };
        match tokio::time::timeout(SHARED_RESPONSES_TIMEOUT, put).await {
            Ok(Ok(evicted)) => {
                self.evictions.inc_by(evicted.unwrap_or(0));
                self.backlog.lock().landed(&turn.id, seq);
                true
            }
            failed => {
                let error = match failed {
                    Ok(Err(e)) => e.to_string(),
                    _ => "no answer in time".to_owned(),
                };
                tracing::debug!(%error, id = %turn.id, "stored response not shared yet; kept for a later try");
                self.defer_write(seq, turn);
                false
            }
        }
    }

    /// Writes the deletion of `id` (the `deleted` marker): whether a turn was there, `None`
    /// when Redis did not answer.
    async fn retire(&self, store: &cluster::Store, id: &str) -> Option<bool> {
        let old = tokio::time::timeout(
            SHARED_RESPONSES_TIMEOUT,
            store.retire_response(id, self.ttl),
        )
        .await
        .ok()?
        .ok()?;
        Some(old.is_some_and(|o| o != cluster::RESPONSE_DELETED))
    }

    /// The store, unless degraded or never connected.
    fn store(&self) -> Option<Arc<cluster::Store>> {
        if self.link.status.degraded.load(Ordering::Relaxed) {
            return None;
        }
        self.link.store()
    }
}

#[async_trait::async_trait]
impl crate::response_store::SharedTurns for SharedResponses {
    async fn fetch(
        &self,
        ids: &[String],
        whole: &[bool],
    ) -> Option<Vec<crate::response_store::Shared>> {
        use crate::response_store::{Shared, StoredResponse};
        let store = self.store()?;
        let reads: Vec<(String, bool)> = ids.iter().cloned().zip(whole.iter().copied()).collect();
        let read = tokio::time::timeout(
            SHARED_RESPONSES_TIMEOUT,
            store.responses(&reads, self.ttl, receipts::now_ms()),
        );
        let values = read.await.ok()?.ok()?;
        // Deleted here while Redis was away, not yet written there (the lock is not held while
        // the turns are parsed).
        let pending: Vec<bool> = {
            let p = self.pending_deletes.lock();
            ids.iter().map(|id| p.contains(id)).collect()
        };
        let mut out: Vec<Shared> = values
            .into_iter()
            .zip(whole)
            .zip(pending)
            .map(|((v, whole), pending)| match v {
                _ if pending => Shared::Deleted,
                None => Shared::Absent,
                Some(s) if s == cluster::RESPONSE_DELETED => Shared::Deleted,
                Some(_) if !whole => Shared::Present,
                // A record this gateway cannot read is as good as absent.
                Some(s) => StoredResponse::from_json(&s)
                    .map_or(Shared::Absent, |t| Shared::Kept(Box::new(t))),
            })
            .collect();
        // A background response another replica runs: still running only while that replica
        // is (its key record's lease); else it stopped with it.
        for s in &mut out {
            let Shared::Kept(t) = s else { continue };
            let Some(runner) = t
                .runner
                .clone()
                .filter(|r| t.running() && r != self.link.replica_id())
            else {
                continue;
            };
            let live = tokio::time::timeout(SHARED_RESPONSES_TIMEOUT, store.gateway_live(&runner));
            if matches!(live.await, Ok(Ok(false))) {
                if let Shared::Kept(t) = std::mem::replace(s, Shared::Absent) {
                    *s = Shared::Kept(Box::new(crate::background::interrupted(*t)));
                }
            }
        }
        Some(out)
    }

    fn publish(&self, turn: &Arc<crate::response_store::StoredResponse>) {
        let seq = self.writes.fetch_add(1, Ordering::Relaxed) + 1;
        if let Err(tokio::sync::mpsc::error::TrySendError::Full((seq, turn))) =
            self.tx.try_send((seq, turn.clone()))
        {
            self.defer_write(seq, &turn);
        }
    }

    fn publish_events(&self, id: &str, first: u64, events: Vec<String>, end: bool) {
        let batch = EventBatch {
            id: id.to_owned(),
            first,
            events,
            end,
        };
        if self.events.try_send(batch).is_err() {
            tracing::debug!(
                id,
                "background stream events not queued for the mirror: queue full"
            );
            self.gap(id, first);
        }
    }

    async fn events_from(&self, id: &str, from: u64) -> Option<Vec<cluster::StreamEntry>> {
        let store = self.store()?;
        let read = store.events_after(id, from, EVENTS_PER_READ);
        tokio::time::timeout(SHARED_RESPONSES_TIMEOUT, read)
            .await
            .ok()?
            .ok()
    }

    fn cancel(&self, id: &str) {
        let Some(me) = self.me.upgrade() else { return };
        let id = id.to_owned();
        // One round trip, off the request path; the caller waits for the record, not for this.
        tokio::spawn(async move {
            if !me.ask_cancel(&id).await {
                me.defer_cancel(&id);
            }
        });
    }

    async fn swap(
        &self,
        record: &Arc<crate::response_store::StoredResponse>,
    ) -> Option<crate::response_store::Swap> {
        use crate::response_store::Swap;
        if self.pending_deletes.lock().contains(&record.id) {
            return Some(Swap::Deleted);
        }
        let store = self.store()?;
        let (json, budget) = (record.to_json(), self.link.settings.response_budget);
        let write = store.swap_response(
            &record.id,
            &json,
            record.revision,
            self.ttl,
            budget,
            receipts::now_ms(),
        );
        let done = tokio::time::timeout(SHARED_RESPONSES_TIMEOUT, write);
        Some(match done.await.ok()?.ok()? {
            cluster::Swapped::Written(evicted) => {
                self.evictions.inc_by(evicted);
                Swap::Written
            }
            cluster::Swapped::Stale => Swap::Stale,
            cluster::Swapped::Deleted => Swap::Deleted,
        })
    }

    async fn delete(&self, id: &str) -> Option<bool> {
        let done = match self.store() {
            Some(store) => self.retire(&store, id).await,
            None => None,
        };
        if done.is_none() {
            self.defer_delete(id);
        }
        done
    }
}

/// Cancels the background responses this replica runs when a cancel reaches another replica
/// (`P:responses:cancel`); resubscribes with backoff. A cancel published while this replica was
/// not subscribed is lost: the replica that took it answers the record as it is after
/// [`crate::background::CANCEL_WAIT`].
async fn receive_cancels(link: Arc<ClusterLink>, control: Weak<ControlPlane>) {
    follow(
        &link,
        |store| async move { store.response_cancels().await },
        |id: String| {
            let Some(c) = control.upgrade() else {
                return false;
            };
            c.data.background.cancel(&c.data, &id);
            true
        },
    )
    .await
}

/// Drops this replica's copy of every stored turn deleted through any replica, as the deletion
/// is published (`P:responses:deleted`); resubscribes with backoff. A deletion published while
/// this replica was not subscribed is learnt at its next read of the turn (the `deleted`
/// marker).
async fn receive_deletions(link: Arc<ClusterLink>, control: Weak<ControlPlane>) {
    follow(
        &link,
        |store| async move { store.response_deletions().await },
        |id: String| {
            let Some(c) = control.upgrade() else {
                return false;
            };
            c.data.responses.delete(&id);
            true
        },
    )
    .await
}

/// Every [`REDO_PERIOD`] while Redis answers, until the link is cancelled: makes in Redis what
/// this replica could not make there when it was asked (Redis away) — deletions, then cancels,
/// then conversation changes ([`crate::conversation::retry`]) — and cancels the background
/// responses this replica runs that some replica was asked to cancel (`P:cancel:<id>`): a
/// cancel whose message this replica missed (it was not subscribed: a reconnect, Redis
/// restarted) is found here (one `EXISTS` per running response, in one pipeline, only while
/// some run).
async fn redo_deferred(
    link: Arc<ClusterLink>,
    shared: Arc<SharedResponses>,
    control: Weak<ControlPlane>,
) {
    loop {
        tokio::select! {
            _ = link.cancel.cancelled() => return,
            _ = tokio::time::sleep(REDO_PERIOD) => {}
        }
        let Some(c) = control.upgrade() else {
            return;
        };
        let Some(store) = shared.store() else {
            continue;
        };
        let deletes: Vec<String> = shared.pending_deletes.lock().iter().cloned().collect();
        for id in deletes {
            if shared.retire(&store, &id).await.is_none() {
                break;
            }
            shared.pending_deletes.lock().remove(&id);
            tracing::info!(%id, "stored responses: a deletion made while Redis was away written there");
        }
        let cancels: Vec<String> = shared.pending_cancels.lock().iter().cloned().collect();
        for id in cancels {
            if !shared.ask_cancel(&id).await {
                break;
            }
            shared.pending_cancels.lock().remove(&id);
            tracing::info!(%id, "background cancel asked while Redis was away written there");
        }
        if !c.data.responses.pending.is_empty() {
            crate::conversation::retry(&c.data.responses, shared.as_ref()).await;
        }
        let running = c.data.background.ids();
        if running.is_empty() {
            continue;
        }
        let asked = store.cancels_asked(&running);
        let Ok(Ok(asked)) = tokio::time::timeout(SHARED_RESPONSES_TIMEOUT, asked).await else {
            continue;
        };
        for (id, _) in running.iter().zip(asked).filter(|(_, a)| *a) {
            if c.data.background.cancel(&c.data, id) {
                tracing::info!(%id, "background response cancelled: a cancel found in Redis");
            }
        }
    }
}

/// Hands each item of `rx` to `write` with the store (while connected; otherwise the item is
/// dropped), in order, until the link is cancelled or the queue closes.
async fn drain_to_store<T, F, Fut>(
    link: Arc<ClusterLink>,
    mut rx: tokio::sync::mpsc::Receiver<T>,
    mut write: F,
) where
    F: FnMut(Arc<cluster::Store>, T) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    loop {
        let item = tokio::select! {
            biased;
            _ = link.cancel.cancelled() => return,
            item = rx.recv() => item,
        };
        let Some(item) = item else { return };
        if let Some(store) = link.store() {
            write(store, item).await;
        }
    }
}

/// Events of a streamed background response to mirror in Redis (`cluster::Store::append_events`).
pub struct EventBatch {
    id: String,
    first: u64,
    events: Vec<String>,
    end: bool,
}

/// Event batches waiting to be mirrored; more are dropped (a resume through another replica
/// then gets a gap: `stream_events_gone`, or the final event).
const EVENT_QUEUE: usize = 4096;

/// Entries read per `XRANGE` of a resume.
const EVENTS_PER_READ: usize = 512;

/// Mirrors streamed background responses' events to Redis, in order, until the link is
/// cancelled. A batch Redis did not take (or that found the queue full) leaves a gap in the
/// mirror from its first event: later batches of that response are not written (the stream's
/// entries must follow each other), and every [`REDO_PERIOD`], while Redis answers, the gap is
/// filled from the response's own event log ([`SharedResponses::fill_gaps`]).
async fn write_events(
    link: Arc<ClusterLink>,
    shared: Arc<SharedResponses>,
    mut rx: tokio::sync::mpsc::Receiver<EventBatch>,
    control: Weak<ControlPlane>,
) {
    let mut retry = redo_ticks();
    loop {
        tokio::select! {
            biased;
            _ = link.cancel.cancelled() => {
                // Stopping: what the queue holds is a gap for the stop's flush to fill.
                rx.close();
                while let Ok(b) = rx.try_recv() {
                    shared.gap(&b.id, b.first);
                }
                return;
            }
            item = rx.recv() => {
                let Some(b) = item else { return };
                shared.mirror(b).await;
            }
            _ = retry.tick() => {
                if shared.gaps.lock().is_empty() || shared.store().is_none() {
                    continue;
                }
                let Some(c) = control.upgrade() else { return };
                shared.fill_gaps(&c.data.background).await;
            }
        }
    }
}

/// Writes the turns this replica stores to Redis (within the replicas' budget,
/// `ClusterSettings::response_budget`; the turns that made room are counted in `evictions`), in order, until the link is cancelled; every
/// [`REDO_PERIOD`], while Redis answers, the backlog's too (oldest first, stopping at the
/// first that fails). One task makes every write of this replica's turns, so an older write of
/// an id never lands after a newer one.
async fn write_responses(
    link: Arc<ClusterLink>,
    shared: Arc<SharedResponses>,
    mut rx: tokio::sync::mpsc::Receiver<(u64, Arc<crate::response_store::StoredResponse>)>,
) {
    let mut retry = redo_ticks();
    loop {
        tokio::select! {
            biased;
            _ = link.cancel.cancelled() => {
                // Stopping: what the queue holds waits for the stop's flush.
                rx.close();
                while let Ok((seq, turn)) = rx.try_recv() {
                    shared.defer_write(seq, &turn);
                }
                return;
            }
            item = rx.recv() => {
                let Some((seq, turn)) = item else { return };
                shared.write(seq, &turn).await;
            }
            _ = retry.tick() => {
                if shared.backlog.lock().is_empty() || shared.store().is_none() {
                    continue;
                }
                let waiting = shared.backlog.lock().waiting();
                let n = waiting.len();
                let mut written = 0;
                for (seq, turn) in waiting {
                    if !shared.write(seq, &turn).await {
                        break;
                    }
                    written += 1;
                }
                if written > 0 {
                    tracing::info!(written, of = n, "stored responses: turns kept while Redis was away written there");
                }
            }
        }
    }
}

async fn publish_holdings(
    link: Arc<ClusterLink>,
    rx: tokio::sync::mpsc::Receiver<cluster::SharedHolding>,
) {
    drain_to_store(link, rx, |store, h| async move {
        // A lost hint costs a cache hit at worst; the sync loop reports the store's state.
        let _ = store.publish_holding(&h).await;
    })
    .await
}

/// Applies the other replicas' published decisions: their routing-time holdings to this
/// replica's index (event-fed workers only, with the TTL the publisher used), so that
/// concurrent requests with one new prefix follow the first wherever they arrive; and the load
/// they reserved to the worker's count here (for [`crate::view::REMOTE_RESERVATION_TTL`]), so
/// that two replicas placing new prompts close together do not both take one idle worker.
async fn receive_holdings(link: Arc<ClusterLink>, control: Weak<ControlPlane>) {
    let me = link.replica_id().to_owned();
    follow(
        &link,
        |store| async move { store.holdings().await },
        |h: cluster::SharedHolding| {
            if h.replica == me {
                return true;
            }
            let Some(c) = control.upgrade() else {
                return false;
            };
            let id = prefix_index::WorkerId(h.worker);
            let view = c.data.views.load();
            let Some(entry) = view.workers.get(&id) else {
                return true;
            };
            if h.prefill_tokens > 0 || h.decode_tokens > 0 {
                let origin = (h.seq > 0).then(|| (Arc::<str>::from(h.replica.as_str()), h.seq));
                entry.runtime.reserve_remote(
                    h.prefill_tokens,
                    h.decode_tokens,
                    std::time::Instant::now(),
                    origin,
                );
            }
            let event_fed = !entry.runtime.approximate();
            if event_fed && h.ttl_ms > 0 && !h.keys.is_empty() {
                let keys: Vec<prefix_index::BlockKey> =
                    h.keys.into_iter().map(prefix_index::BlockKey).collect();
                let _ = c.data.index.insert_approximate_for(
                    &id,
                    &keys,
                    Duration::from_millis(h.ttl_ms.min(60_000)),
                );
            }
            true
        },
    )
    .await
}

/// Follows a subscription on `link`'s store (`subscribe`), handing each message to `on_message`
/// until the link is cancelled or `on_message` returns `false`; subscribes again with backoff
/// (200 ms, doubling to 2 s) when the subscription fails or ends.
async fn follow<T, S, Fut>(link: &ClusterLink, subscribe: S, mut on_message: impl FnMut(T) -> bool)
where
    S: Fn(Arc<cluster::Store>) -> Fut,
    Fut: std::future::Future<
        Output = Result<futures::stream::BoxStream<'static, T>, cluster::ClusterError>,
    >,
{
    let mut backoff = Duration::from_millis(200);
    loop {
        let stream = match link.connect().await {
            Ok(store) => subscribe(store).await,
            Err(e) => Err(e),
        };
        if let Ok(mut messages) = stream {
            backoff = Duration::from_millis(200);
            loop {
                let next = tokio::select! {
                    biased;
                    _ = link.cancel.cancelled() => return,
                    m = messages.next() => m,
                };
                let Some(m) = next else { break };
                if !on_message(m) {
                    return;
                }
            }
        }
        if !sleep_or_cancel(backoff, &link.cancel).await {
            return;
        }
        backoff = (backoff * 2).min(Duration::from_secs(2));
    }
}

async fn sleep_or_cancel(d: Duration, cancel: &CancellationToken) -> bool {
    tokio::select! {
        biased;
        _ = cancel.cancelled() => false,
        _ = tokio::time::sleep(d) => true,
    }
}

/// One sync: rules, key record, registrations, load.
async fn sync_once(
    link: &ClusterLink,
    control: &ControlPlane,
) -> Result<(), cluster::ClusterError> {
    let store = link.connect().await?;
    // A restarted Redis lost its script cache: reload the claim script before a claim pays
    // for it (best effort; a claim still works without).
    if let Err(e) = store.ensure_scripts().await {
        tracing::debug!(error = %e, "the claim script could not be loaded");
    }
    // Rules: a newer version is installed; an empty store (Redis restarted without its data)
    // is re-seeded from the rules in force, keeping their version.
    match store.rules().await? {
        Some(doc) => control.apply_remote(&doc).await,
        None => {
            let snap = control.store.snapshot();
            let text = routing_rules::rules_to_toml(snap.rules()).map_err(|e| {
                cluster::ClusterError::Malformed {
                    what: "local rules",
                    detail: e.to_string(),
                }
            })?;
            let doc = cluster::RulesDoc::new(snap.version().0, text);
            let now = store.seed_rules(&doc, link.replica_id()).await?;
            control.apply_remote(&now).await;
        }
    }
    store
        .announce_gateway(&link.record, link.settings.lease)
        .await?;
    let mut replicas: Vec<String> = store
        .gateways()
        .await?
        .into_iter()
        .map(|g| g.gateway_id)
        .collect();
    replicas.sort_unstable();
    replicas.dedup();
    // This replica's place among the live ones staggers its rotations (it announced itself
    // above; if its record is not listed yet it counts itself in).
    let (place, live) = match replicas.binary_search_by(|r| r.as_str().cmp(link.replica_id())) {
        Ok(i) => (i, replicas.len()),
        Err(i) => (i, replicas.len() + 1),
    };
    let stagger = routing_rules::Stagger::new(place, live);
    // The tenants' limits are the fleet's: each live replica enforces its share.
    control.data.limits.set_replicas(live);
    *link.status.replicas.lock() = replicas;
    control.set_stagger(stagger).await;
    let registered = store.workers().await?;
    *link.status.registered.lock() = registered.iter().map(|w| w.id.clone()).collect();
    control.set_registered(registered).await;
    // Load: ours out, the others' in. The counters are read before the reservation number:
    // a reservation is numbered before it counts, so every one they count is numbered up to
    // it and the others drop it (or skip it when its message comes later) — none is counted
    // twice. (Numbered after, at publication, a decision still claiming was in the counters
    // but not covered: counted twice for 250 ms, docs/cluster.md "Load".) One numbered up
    // to it that starts counting after the read is missed until the next table.
    let view = control.data.views.load();
    let ours: BTreeMap<String, cluster::Load> = view
        .workers
        .iter()
        .map(|(id, e)| {
            (
                id.0.clone(),
                cluster::Load {
                    in_flight: e.runtime.in_flight.load(Ordering::Relaxed),
                    active_tokens: e.runtime.active_tokens.load(Ordering::Relaxed),
                    prefill_tokens: e.runtime.prefill_tokens.load(Ordering::Relaxed),
                },
            )
        })
        .collect();
    std::sync::atomic::fence(Ordering::Acquire);
    let covered = control.data.holdings_seq.load(Ordering::Acquire);
    store
        .put_load(link.replica_id(), &ours, covered, link.settings.lease)
        .await?;
    let others = store.fleet_load(link.replica_id()).await?;
    for (id, e) in &view.workers {
        // The reservations these tables now count stop counting as reservations.
        e.runtime
            .remote_reserved
            .lock()
            .drop_covered(&others.covered);
        let l = others.load.get(&id.0).copied().unwrap_or_default();
        e.runtime
            .remote_in_flight
            .store(l.in_flight, Ordering::Relaxed);
        e.runtime
            .remote_active_tokens
            .store(l.active_tokens, Ordering::Relaxed);
        e.runtime
            .remote_prefill_tokens
            .store(l.prefill_tokens, Ordering::Relaxed);
    }
    if control.data.responses.enabled() {
        let bytes = store.response_bytes().await?;
        link.status
            .shared_response_bytes
            .store(bytes, Ordering::Relaxed);
        control
            .data
            .metrics
            .cluster_stored_response_bytes
            .set(i64::try_from(bytes).unwrap_or(i64::MAX));
    }
    Ok(())
}

async fn sync_loop(link: Arc<ClusterLink>, control: Weak<ControlPlane>) {
    loop {
        let Some(c) = control.upgrade() else { return };
        match sync_once(&link, &c).await {
            Ok(()) => link.healthy(&c),
            Err(e) => link.failed(&c, &e),
        }
        drop(c);
        if !sleep_or_cancel(link.settings.poll(), &link.cancel).await {
            return;
        }
    }
}

async fn watch_loop(link: Arc<ClusterLink>, control: Weak<ControlPlane>) {
    let mut backoff = Duration::from_millis(200);
    loop {
        let stream = match link.connect().await {
            Ok(store) => store.rules_changes().await.map(|s| (store, s)),
            Err(e) => Err(e),
        };
        match stream {
            Ok((store, mut changes)) => {
                backoff = Duration::from_millis(200);
                loop {
                    let next = tokio::select! {
                        biased;
                        _ = link.cancel.cancelled() => return,
                        v = changes.next() => v,
                    };
                    let Some(version) = next else { break };
                    let Some(c) = control.upgrade() else { return };
                    if version > c.store.snapshot().version().0 {
                        match store.rules().await {
                            Ok(Some(doc)) => c.apply_remote(&doc).await,
                            Ok(None) => {}
                            Err(e) => link.failed(&c, &e),
                        }
                    }
                }
            }
            Err(e) => {
                if let Some(c) = control.upgrade() {
                    link.failed(&c, &e);
                }
            }
        }
        if !sleep_or_cancel(backoff, &link.cancel).await {
            return;
        }
        backoff = (backoff * 2).min(Duration::from_secs(2));
    }
}
