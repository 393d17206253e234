//! The one snapshot a request reads: rules, workers and their health, swapped together.
//!
//! A [`View`] is immutable. Anything that changes the rules (file reload, admin API) or a
//! worker's health builds a new `View` and swaps it into the [`ViewCell`] (`arc-swap`); a
//! request loads one `Arc<View>` in `request_filter` and keeps it until `logging`, so a long
//! stream finishes under the rules version it started with, and its rules, pool and health
//! never disagree (pingora admits in a TODO that its two separate snapshots can).
//!
//! What changes on every request (in-flight counts, event-stream progress) lives in
//! [`WorkerRuntime`], shared by reference between successive views: it is a live counter,
//! not part of the decision's identity.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use arc_swap::ArcSwap;
use parking_lot::Mutex;
use prefix_index::{HashAlgorithm, WorkerId};
use receipts::RouteMode;
use routing_rules::policy::SelectionPolicy;
use routing_rules::schema::{
    KvExactRule, Rule, ServiceSpec, TenantSpec, TokenBudgetPolicy, WorkerSpec,
};
use routing_rules::{RequestInfo, RuleSnapshot, ServiceEntry};
use sha2::Digest;

use crate::error::GatewayError;
use crate::profile::LoadedProfile;

/// Where a worker is reached.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Upstream {
    /// Resolved socket address.
    pub addr: SocketAddr,
    /// `host:port` as written in the URL (sent as `Host`).
    pub authority: String,
    /// Path prefix from the URL (`""` or `/prefix`, no trailing slash), prepended to paths.
    pub base_path: String,
    /// `https://`: TLS to the worker.
    pub tls: bool,
    /// The host of the URL without port or brackets (TLS: the SNI and the name verified).
    pub host: String,
}

impl Upstream {
    /// Parses `http://host[:port][/prefix]` or `https://host[:port][/prefix]` (default ports
    /// 80 and 443).
    pub fn parse(url: &str) -> Result<Upstream, GatewayError> {
        let bad = |why: &str| GatewayError::Config {
            reason: format!("worker url {url:?}: {why}"),
        };
        let (tls, rest) = if let Some(r) = url.strip_prefix("https://") {
            (true, r)
        } else if let Some(r) = url.strip_prefix("http://") {
            (false, r)
        } else {
            return Err(bad("must start with http:// or https://"));
        };
        let (authority, path) = match rest.find('/') {
            Some(i) => (&rest[..i], &rest[i..]),
            None => (rest, ""),
        };
        if authority.is_empty() {
            return Err(bad("no host"));
        }
        let has_port = authority.rsplit_once(':').is_some_and(|(h, p)| {
            p.parse::<u16>().is_ok() && (!h.starts_with('[') || h.ends_with(']'))
        });
        let with_port = if has_port {
            authority.to_owned()
        } else {
            format!("{authority}:{}", if tls { 443 } else { 80 })
        };
        let host = match authority.rsplit_once(':') {
            Some((h, _)) if has_port => h,
            _ => authority,
        };
        let host = host
            .trim_start_matches('[')
            .trim_end_matches(']')
            .to_owned();
        let addr = with_port
            .to_socket_addrs()
            .map_err(|e| bad(&format!("cannot resolve: {e}")))?
            .next()
            .ok_or_else(|| bad("resolves to no address"))?;
        Ok(Upstream {
            addr,
            authority: authority.to_owned(),
            base_path: path.trim_end_matches('/').to_owned(),
            tls,
            host,
        })
    }

    /// Base URL for the gateway's own HTTP calls to the worker (health, profile, events).
    pub fn base_url(&self) -> String {
        if self.tls {
            // By name: the certificate is verified against the URL's host.
            format!("https://{}{}", self.authority, self.base_path)
        } else {
            format!("http://{}{}", self.addr, self.base_path)
        }
    }
}

/// State of a worker's KV event stream, for the admin plane and metrics.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum EventStreamState {
    /// Not connected yet (or reconnecting).
    #[default]
    Connecting,
    /// Connected; events are applied as they come.
    Connected,
    /// The worker has no event stream (404): the gateway approximates its holdings.
    Unsupported,
    /// Not subscribed: no KV-exact service's pool holds the worker, so its events and load
    /// reports would feed nothing (subscribed again as soon as one does).
    NotSubscribed,
}

/// A worker's load-only stream (`GET /v1/load`: its `event: load` messages alone), read while
/// some KV-exact service routes to it and its KV events are not read (a native engine behind a
/// `kvgate sidecar`, whose sidecar reports the work it forwarded).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum LoadStreamState {
    /// Not read: its KV event stream carries its load, or no KV-exact service routes to it.
    #[default]
    Off,
    /// Not connected yet (or reconnecting).
    Connecting,
    /// Connected; its load messages are applied as they come.
    Connected,
    /// It has none (404, or an answer that is not an event stream): judged by the gateways'
    /// own count; probed again every 30 s.
    Unsupported,
}

/// Contract state of a worker (its `/v1/profile` against the pinned profiles of the `kv_exact`
/// services whose pools contain it).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum ContractState {
    /// No `kv_exact` service uses this worker.
    #[default]
    NotRequired,
    /// The worker's profile agrees with every pinned profile that uses it.
    Ok,
    /// The worker could not be asked yet; it is not routed `kv_exact` requests until it is.
    Unverified(String),
    /// The worker reports a different profile: the differing fields.
    Mismatch(String),
}

/// How old a worker's `load` report may be and still count (the worker sends one within 20 ms
/// of a change and at least once a second; a stalled stream stops counting after this).
pub const REPORTED_LOAD_MAX_AGE: std::time::Duration = std::time::Duration::from_secs(2);

/// How long another replica's reservation on a worker counts here (cluster mode, from its
/// published decision): long enough for the request to reach the worker and for the worker's
/// next `load` report (sent within 20 ms of a change) to show it. It stops counting earlier
/// when the publisher's load table arrives covering it ([`RemoteReservations::drop_covered`]),
/// so no request is counted both in a table and as a reservation.
pub const REMOTE_RESERVATION_TTL: std::time::Duration = std::time::Duration::from_millis(250);

/// At most this many of the other replicas' reservations are kept per worker (the oldest go
/// first): bounded memory whatever the publishers send.
const REMOTE_RESERVATIONS_MAX: usize = 4096;

/// The other replicas' recent reservations on one worker, oldest first, with their sums.
#[derive(Debug, Default)]
pub struct RemoteReservations {
    /// (until, prefill, decode, origin: the publishing replica and its decision number, when
    /// it sent one).
    queue: VecDeque<Reservation>,
    prefill: u64,
    decode: u64,
    /// The last decision number each publisher's load table covered when this replica last
    /// read the tables ([`Self::drop_covered`]): a reservation that arrives after its
    /// publisher's table was read with it already counted is not counted again (the pub/sub
    /// message and the table travel on different connections, so the table can come first).
    covered: std::collections::BTreeMap<String, u64>,
}

/// One reservation ([`RemoteReservations`]).
type Reservation = (Instant, u64, u64, Option<(Arc<str>, u64)>);

impl RemoteReservations {
    fn push(&mut self, r: Reservation) {
        if let Some((replica, seq)) = &r.3 {
            if self.covered.get(&**replica).is_some_and(|c| seq <= c) {
                return;
            }
        }
        if self.queue.len() >= REMOTE_RESERVATIONS_MAX {
            self.pop();
        }
        self.prefill = self.prefill.saturating_add(r.1);
        self.decode = self.decode.saturating_add(r.2);
        self.queue.push_back(r);
    }

    fn pop(&mut self) {
        if let Some((_, p, d, _)) = self.queue.pop_front() {
            self.prefill -= p;
            self.decode -= d;
        }
    }

    /// The unexpired reservations' (prefill, decode) tokens at `now`; drops the expired ones.
    /// Every entry has the same TTL, so they expire in arrival order.
    fn current(&mut self, now: Instant) -> (u64, u64) {
        while self
            .queue
            .front()
            .is_some_and(|(until, _, _, _)| *until <= now)
        {
            self.pop();
        }
        (self.prefill, self.decode)
    }

    /// Drops the reservations that the publishers' load tables now count: those whose
    /// decision number is at most the last one the replica's table covers (`covered`: replica
    /// id → number), and remembers `covered` so that such a reservation arriving later is not
    /// counted either (until the next read replaces it: a publisher that restarts numbers from
    /// 0 again, and its table says so at the next read). Reservations without a number (older
    /// replicas) are kept until they expire. O(reservations + replicas).
    pub fn drop_covered(&mut self, covered: &std::collections::BTreeMap<String, u64>) {
        if self.covered != *covered {
            self.covered = covered.clone();
        }
        if covered.is_empty() || self.queue.is_empty() {
            return;
        }
        self.queue.retain(|(_, _, _, origin)| match origin {
            Some((replica, seq)) => covered.get(&**replica).is_none_or(|c| seq > c),
            None => true,
        });
        self.prefill = self.queue.iter().map(|r| r.1).fold(0, u64::saturating_add);
        self.decode = self.queue.iter().map(|r| r.2).fold(0, u64::saturating_add);
    }
}

/// Live, per-worker state that survives rule reloads.
#[derive(Debug)]
pub struct WorkerRuntime {
    /// The worker.
    pub id: WorkerId,
    /// Requests in flight from this gateway.
    pub in_flight: AtomicU64,
    /// Active tokens of this gateway's requests in flight here (`load_metric =
    /// "active_tokens"`): each request's uncached prompt tokens until its first response byte
    /// (its prefill), plus its requested output tokens until it ends.
    pub active_tokens: AtomicU64,
    /// The prefill part of `active_tokens` (uncached prompt tokens before the first byte).
    pub prefill_tokens: AtomicU64,
    /// Cluster mode: the other replicas' in-flight requests and active tokens on this worker
    /// (their leased load tables, read every sync tick); 0 otherwise.
    pub remote_in_flight: AtomicU64,
    pub remote_active_tokens: AtomicU64,
    /// The prefill part of `remote_active_tokens` (the other replicas' requests here before
    /// their first byte).
    pub remote_prefill_tokens: AtomicU64,
    /// Cluster mode: the other replicas' reservations here from their published decisions,
    /// each counted for [`REMOTE_RESERVATION_TTL`] (until the worker's report shows it).
    pub remote_reserved: Mutex<RemoteReservations>,
    /// The worker's own report of its queued work (its event stream's latest `load` message)
    /// and when it arrived; cleared when the stream ends.
    pub reported_load: Mutex<Option<(prefix_index::WorkerLoad, Instant)>>,
    /// Load reports received since start (`event: load` messages).
    pub load_reports: AtomicU64,
    /// Requests the worker refused before answering (429 / 503) since start, whether the
    /// gateway then offered them to another worker or handed the refusal to the client.
    pub refusals: AtomicU64,
    /// The current event stream delivered its snapshot (its first load message arrived: the
    /// worker sends it after the subscription's snapshot); cleared when the stream ends.
    pub events_synced: std::sync::atomic::AtomicBool,
    /// Event stream state.
    pub events: Mutex<EventStreamState>,
    /// Load-only stream state (workers whose KV events are not read).
    pub load_stream: Mutex<LoadStreamState>,
    /// When the event stream last delivered something.
    pub events_last_heard: Mutex<Option<Instant>>,
    /// Last (epoch, seq) applied.
    pub events_position: Mutex<Option<(u64, u64)>>,
    /// Events applied since start.
    pub events_applied: AtomicU64,
    /// Contract state.
    pub contract: Mutex<ContractState>,
    /// Consecutive failed checks or passive failures.
    pub consecutive_failures: AtomicU64,
    /// What the worker last reported (`GET /v1/profile`, or a native engine's report;
    /// re-read when it becomes healthy).
    pub reported: Mutex<Option<crate::control_plane::Reported>>,
}

impl WorkerRuntime {
    /// Fresh state for a worker.
    pub fn new(id: WorkerId) -> WorkerRuntime {
        WorkerRuntime {
            id,
            in_flight: AtomicU64::new(0),
            active_tokens: AtomicU64::new(0),
            prefill_tokens: AtomicU64::new(0),
            remote_in_flight: AtomicU64::new(0),
            remote_active_tokens: AtomicU64::new(0),
            remote_prefill_tokens: AtomicU64::new(0),
            remote_reserved: Mutex::new(RemoteReservations::default()),
            reported_load: Mutex::new(None),
            load_reports: AtomicU64::new(0),
            refusals: AtomicU64::new(0),
            events_synced: std::sync::atomic::AtomicBool::new(false),
            events: Mutex::new(EventStreamState::Connecting),
            load_stream: Mutex::new(LoadStreamState::Off),
            events_last_heard: Mutex::new(None),
            events_position: Mutex::new(None),
            events_applied: AtomicU64::new(0),
            contract: Mutex::new(ContractState::NotRequired),
            consecutive_failures: AtomicU64::new(0),
            reported: Mutex::new(None),
        }
    }

    /// The block-key hash algorithm the worker reported (`None` before its profile was read).
    pub fn reported_algorithm(&self) -> Option<HashAlgorithm> {
        match self.reported.lock().as_ref() {
            Some(crate::control_plane::Reported::Kvgate(p)) => Some(p.hash_algorithm),
            _ => None,
        }
    }

    /// Records the worker's load report (an event stream `load` message).
    pub fn report_load(&self, load: prefix_index::WorkerLoad, at: Instant) {
        *self.reported_load.lock() = Some((load, at));
        self.load_reports.fetch_add(1, Ordering::Relaxed);
        self.events_synced.store(true, Ordering::Release);
    }

    /// Counts another replica's reservation (its published decision) here from `now` for
    /// [`REMOTE_RESERVATION_TTL`], or until that replica's load table covers `origin` (its id
    /// and the decision's number; `None`: until it expires).
    pub fn reserve_remote(
        &self,
        prefill: u64,
        decode: u64,
        now: Instant,
        origin: Option<(Arc<str>, u64)>,
    ) {
        self.remote_reserved
            .lock()
            .push((now + REMOTE_RESERVATION_TTL, prefill, decode, origin));
    }

    /// The other replicas' reservations counted here now: (prefill, decode) tokens.
    pub fn remote_reserved_now(&self) -> (u64, u64) {
        self.remote_reserved.lock().current(Instant::now())
    }

    /// The worker's load report when it is at most [`REPORTED_LOAD_MAX_AGE`] old at `now`.
    pub fn fresh_reported_load(&self, now: Instant) -> Option<prefix_index::WorkerLoad> {
        let g = self.reported_load.lock();
        let (load, at) = g.as_ref()?;
        (now.saturating_duration_since(*at) <= REPORTED_LOAD_MAX_AGE).then_some(*load)
    }

    /// The queued work placement and the load guard see on this worker: (prefill tokens,
    /// decode tokens). Each is the larger of the gateways' count and the worker's fresh
    /// report. The gateways' count is this gateway's own requests plus, in cluster mode, the
    /// other replicas' leased tables (their prefill and decode parts) and their reservations
    /// of the last [`REMOTE_RESERVATION_TTL`]: it knows a request the moment it is routed; the
    /// worker's report knows work from every source (other gateways, direct clients) and what
    /// its cache really saved.
    pub fn queued_tokens(&self, now: Instant) -> (u64, u64) {
        let active = self.active_tokens.load(Ordering::Relaxed);
        let prefill = self.prefill_tokens.load(Ordering::Relaxed).min(active);
        let remote_active = self.remote_active_tokens.load(Ordering::Relaxed);
        let remote_prefill = self
            .remote_prefill_tokens
            .load(Ordering::Relaxed)
            .min(remote_active);
        let (rp, rd) = self.remote_reserved.lock().current(now);
        // Per term: another replica's prefill is prefill here too, so that the larger of this
        // count and the worker's report (which counts it as prefill) does not count it twice.
        let local = (
            prefill.saturating_add(remote_prefill).saturating_add(rp),
            (active - prefill)
                .saturating_add(remote_active - remote_prefill)
                .saturating_add(rd),
        );
        match self.fresh_reported_load(now) {
            Some(r) => (local.0.max(r.prefill_tokens), local.1.max(r.decode_tokens)),
            None => local,
        }
    }

    /// Whether `kv_exact` holdings of this worker must be approximated from routed keys.
    pub fn approximate(&self) -> bool {
        *self.events.lock() == EventStreamState::Unsupported
    }

    /// Whether the worker may take `kv_exact` requests (contract not violated or unverified).
    pub fn contract_ok(&self) -> bool {
        matches!(
            *self.contract.lock(),
            ContractState::Ok | ContractState::NotRequired
        )
    }
}

/// One worker in a view.
#[derive(Clone, Debug)]
pub struct WorkerEntry {
    /// As declared in the rules.
    pub spec: WorkerSpec,
    /// Where to reach it.
    pub upstream: Upstream,
    /// Health at the time the view was built.
    pub healthy: bool,
    /// Cordoned by the rules (`cordoned`): takes no new requests.
    pub cordoned: bool,
    /// Live state.
    pub runtime: Arc<WorkerRuntime>,
}

impl WorkerEntry {
    /// Whether new requests may go here: healthy and not cordoned.
    pub fn routable(&self) -> bool {
        self.healthy && !self.cordoned
    }
}

/// What a service routing by cached prefix (`kv_exact`) needs per request.
#[derive(Debug)]
pub struct PrefixRoute {
    /// The pinned profile, loaded and verified.
    pub profile: Arc<LoadedProfile>,
    /// The rule's parameters (salt policy, load metric, ...).
    pub rule: KvExactRule,
    /// The service's token-budget policy.
    pub token_budget: TokenBudgetPolicy,
}

/// One service of a view: its entry in the rules snapshot plus what the gateway loaded for it.
/// The rule kind is resolved here, once: the request path reads `mode`, `prefix` and the
/// policy, never the kind.
#[derive(Debug)]
pub struct ServiceRoute {
    snapshot: Arc<RuleSnapshot>,
    idx: usize,
    /// `service/rule-kind`: the rule id carried in tickets and metrics.
    pub rule_id: String,
    /// The pool's worker ids, in pool order.
    pub pool: Vec<WorkerId>,
    /// The routing mode written into tickets (and the `mode` metric label).
    pub mode: RouteMode,
    /// Prefix routing (`kv_exact`): `None` for round robin.
    pub prefix: Option<PrefixRoute>,
    /// Metric handles, resolved on the first request ([`ServiceRoute::handles`]).
    handles: std::sync::OnceLock<crate::metrics::ServiceHandles>,
    /// Held while a prefix-routing decision reads the workers' loads, selects and reserves the
    /// first choice's load ([`crate::route::decide`]): two concurrent decisions never both see
    /// a worker idle that one of them is about to fill. Microseconds per decision (the
    /// tokenizing and index lookup happen before it).
    pub(crate) placement: Mutex<()>,
    /// Close decisions whose cluster claim is in flight ([`crate::claim_wait`]).
    pub(crate) claims_in_flight: crate::claim_wait::InFlightClaims,
}

impl ServiceRoute {
    fn entry(&self) -> &ServiceEntry {
        &self.snapshot.services()[self.idx]
    }

    /// The service as configured.
    pub fn spec(&self) -> &ServiceSpec {
        &self.entry().spec
    }

    /// The service name.
    pub fn name(&self) -> &str {
        self.spec().name.as_str()
    }

    /// The rule's selection policy (rotation state is per rules version).
    pub fn policy(&self) -> &dyn SelectionPolicy {
        self.entry().policy.as_ref()
    }

    /// This service's metric handles in `m` (resolved once per rules version).
    pub fn handles(&self, m: &crate::metrics::Metrics) -> &crate::metrics::ServiceHandles {
        self.handles.get_or_init(|| {
            crate::metrics::ServiceHandles::resolve(
                m,
                self.name(),
                &self.rule_id,
                self.mode.as_str(),
            )
        })
    }

    /// The pinned profile of a prefix-routed service.
    pub fn profile(&self) -> Option<&Arc<LoadedProfile>> {
        self.prefix.as_ref().map(|p| &p.profile)
    }
}

/// Everything a request reads, as of one moment.
#[derive(Debug)]
pub struct View {
    /// The rules snapshot.
    pub snapshot: Arc<RuleSnapshot>,
    /// Services, in file order (index-aligned with `snapshot.services()`).
    pub services: Vec<Arc<ServiceRoute>>,
    /// Workers by id.
    pub workers: BTreeMap<WorkerId, WorkerEntry>,
    /// Tenants by the SHA-256 of their API keys.
    pub tenants: HashMap<[u8; 32], Arc<TenantSpec>>,
}

impl View {
    /// The tenant an API key belongs to (by its SHA-256; the keys are never stored).
    pub fn tenant_of(&self, api_key: &str) -> Option<&Arc<TenantSpec>> {
        let digest: [u8; 32] = sha2::Sha256::digest(api_key.as_bytes()).into();
        self.tenants.get(&digest)
    }

    /// Whether the rules define tenants (API keys).
    pub fn has_tenants(&self) -> bool {
        !self.tenants.is_empty()
    }
}

/// Long-lived things a view is compiled with, reused across rule versions.
#[derive(Default)]
pub struct Carry {
    /// Runtimes by worker id.
    pub runtimes: Mutex<BTreeMap<WorkerId, Arc<WorkerRuntime>>>,
}

impl View {
    /// Rules version.
    pub fn version(&self) -> u64 {
        self.snapshot.version().0
    }

    /// Rules content hash (hex).
    pub fn content_hash(&self) -> String {
        self.snapshot.content_hash().to_hex()
    }

    /// Compiles a rules snapshot. `profiles` must hold a loaded profile for every profile id a
    /// `kv_exact` service uses; `previous` gives the health of known workers (new workers start
    /// healthy and are probed at once).
    pub fn compile(
        snapshot: Arc<RuleSnapshot>,
        profiles: &BTreeMap<String, Arc<LoadedProfile>>,
        previous: Option<&View>,
        carry: &Carry,
    ) -> Result<View, GatewayError> {
        let mut workers = BTreeMap::new();
        let mut runtimes = carry.runtimes.lock();
        for w in &snapshot.rules().workers {
            let upstream = Upstream::parse(&w.url)?;
            let runtime = runtimes
                .entry(w.id.clone())
                .or_insert_with(|| Arc::new(WorkerRuntime::new(w.id.clone())))
                .clone();
            let healthy = previous
                .and_then(|p| p.workers.get(&w.id))
                .is_none_or(|e| e.healthy);
            workers.insert(
                w.id.clone(),
                WorkerEntry {
                    spec: w.clone(),
                    upstream,
                    healthy,
                    cordoned: snapshot.rules().is_cordoned(&w.id),
                    runtime,
                },
            );
        }
        runtimes.retain(|id, _| workers.contains_key(id));
        drop(runtimes);
        let mut services = Vec::new();
        for (idx, entry) in snapshot.services().iter().enumerate() {
            let s = &entry.spec;
            let (mode, prefix) =
                match &s.rule {
                    Rule::KvExact(k) => {
                        let id = k.profile.as_ref().ok_or_else(|| GatewayError::Config {
                            reason: format!("service {}: kv_exact without a profile", s.name),
                        })?;
                        let profile = profiles.get(id.as_str()).cloned().ok_or_else(|| {
                            GatewayError::Config {
                                reason: format!("service {}: profile {id} not loaded", s.name),
                            }
                        })?;
                        let prefix = PrefixRoute {
                            profile,
                            rule: k.clone(),
                            token_budget: s.token_budget,
                        };
                        (RouteMode::KvExact, Some(prefix))
                    }
                    Rule::RoundRobin(_) => (RouteMode::RoundRobin, None),
                };
            services.push(Arc::new(ServiceRoute {
                snapshot: snapshot.clone(),
                idx,
                rule_id: format!("{}/{}", s.name, s.rule.kind()),
                pool: entry.workers.iter().map(|w| w.id.clone()).collect(),
                mode,
                prefix,
                handles: std::sync::OnceLock::new(),
                placement: Mutex::new(()),
                claims_in_flight: Default::default(),
            }));
        }
        let mut tenants = HashMap::new();
        for t in &snapshot.rules().tenants {
            let t = Arc::new(t.clone());
            for h in &t.api_keys_sha256 {
                let mut digest = [0u8; 32];
                if hex::decode_to_slice(h, &mut digest).is_ok() {
                    tenants.insert(digest, t.clone());
                }
            }
        }
        Ok(View {
            snapshot,
            services,
            workers,
            tenants,
        })
    }

    /// The same view with one worker's health changed (`None` when nothing changes).
    pub fn with_health(&self, id: &WorkerId, healthy: bool) -> Option<View> {
        let entry = self.workers.get(id)?;
        if entry.healthy == healthy {
            return None;
        }
        let mut workers = self.workers.clone();
        if let Some(e) = workers.get_mut(id) {
            e.healthy = healthy;
        }
        Some(View {
            snapshot: self.snapshot.clone(),
            services: self.services.clone(),
            workers,
            tenants: self.tenants.clone(),
        })
    }

    /// The service that takes a request arriving on `listener` (`None`: the unnamed VIP);
    /// validation guarantees at most one.
    pub fn match_service(
        &self,
        listener: Option<&str>,
        host: Option<&str>,
        path: &str,
        model: Option<&str>,
    ) -> Option<&Arc<ServiceRoute>> {
        let info = RequestInfo {
            listener,
            host,
            path,
            model,
        };
        let idx = self
            .snapshot
            .services()
            .iter()
            .position(|s| s.matches(&info))?;
        self.services.get(idx)
    }

    /// `GET /v1/models` as the gateway answers it: the services that could take a request on
    /// `listener` to `host` and `path` whatever its model, when every one of them names its
    /// models (`match.models`). `None` when none could, or when one takes any model: then the
    /// request is routed like any other and a worker of that service answers.
    pub fn listing_services(
        &self,
        listener: Option<&str>,
        host: Option<&str>,
        path: &str,
    ) -> Option<Vec<&Arc<ServiceRoute>>> {
        let mut out = Vec::new();
        for (entry, route) in self.snapshot.services().iter().zip(&self.services) {
            let models = &entry.spec.matcher.models;
            let probe = models.first().map(String::as_str);
            let info = RequestInfo {
                listener,
                host,
                path,
                model: probe,
            };
            if !entry.matches(&info) {
                continue;
            }
            if models.is_empty() {
                return None;
            }
            out.push(route);
        }
        (!out.is_empty()).then_some(out)
    }

    /// The largest body limit of any service that could take this request whatever its model
    /// (the body is read before the model is known). `None` if no service could.
    pub fn body_limit_for(
        &self,
        listener: Option<&str>,
        host: Option<&str>,
        path: &str,
    ) -> Option<u64> {
        self.snapshot
            .services()
            .iter()
            .filter(|s| {
                let probe = s.spec.matcher.models.first().map(String::as_str);
                s.matches(&RequestInfo {
                    listener,
                    host,
                    path,
                    model: probe,
                })
            })
            .map(|s| s.spec.max_body_bytes)
            .max()
    }
}

/// The swappable cell holding the current view.
pub struct ViewCell {
    cell: ArcSwap<View>,
}

impl ViewCell {
    /// A cell holding `view`.
    pub fn new(view: View) -> ViewCell {
        ViewCell {
            cell: ArcSwap::from_pointee(view),
        }
    }

    /// The current view; keep the `Arc` for a request's whole life.
    pub fn load(&self) -> Arc<View> {
        self.cell.load_full()
    }

    /// Replaces the view.
    pub fn store(&self, view: View) {
        self.cell.store(Arc::new(view));
    }

    /// Sets a worker's health; returns whether it changed.
    pub fn set_health(&self, id: &WorkerId, healthy: bool) -> bool {
        let mut changed = false;
        self.cell.rcu(|cur| match cur.with_health(id, healthy) {
            Some(v) => {
                changed = true;
                Arc::new(v)
            }
            None => {
                changed = false;
                cur.clone()
            }
        });
        changed
    }
}

/// Counts a request in flight on a worker, and its active tokens, for as long as the guard
/// lives.
#[derive(Debug)]
pub struct InFlight {
    runtime: Arc<WorkerRuntime>,
    /// Uncached prompt tokens still counted (until [`InFlight::prefill_done`]).
    prefill: u64,
    /// Requested output tokens (counted until the end).
    output: u64,
}

impl InFlight {
    /// Increments the worker's in-flight count and adds the request's active tokens: `prefill`
    /// uncached prompt tokens and `output` requested output tokens.
    pub fn start(runtime: Arc<WorkerRuntime>, prefill: u64, output: u64) -> InFlight {
        runtime.in_flight.fetch_add(1, Ordering::Relaxed);
        runtime
            .active_tokens
            .fetch_add(prefill + output, Ordering::Relaxed);
        runtime.prefill_tokens.fetch_add(prefill, Ordering::Relaxed);
        InFlight {
            runtime,
            prefill,
            output,
        }
    }

    /// The worker it counts on.
    pub fn worker(&self) -> &WorkerId {
        &self.runtime.id
    }

    /// The first response byte arrived: the prompt's prefill no longer counts. Idempotent.
    pub fn prefill_done(&mut self) {
        if self.prefill > 0 {
            self.runtime
                .active_tokens
                .fetch_sub(self.prefill, Ordering::Relaxed);
            self.runtime
                .prefill_tokens
                .fetch_sub(self.prefill, Ordering::Relaxed);
            self.prefill = 0;
        }
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.runtime.in_flight.fetch_sub(1, Ordering::Relaxed);
        self.runtime
            .active_tokens
            .fetch_sub(self.prefill + self.output, Ordering::Relaxed);
        self.runtime
            .prefill_tokens
            .fetch_sub(self.prefill, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_upstream_urls() {
        let u = Upstream::parse("http://127.0.0.1:8001").unwrap();
        assert_eq!(u.addr, "127.0.0.1:8001".parse().unwrap());
        assert_eq!(u.base_path, "");
        let u = Upstream::parse("http://127.0.0.1:8001/api/").unwrap();
        assert_eq!(u.base_path, "/api");
        assert_eq!(u.base_url(), "http://127.0.0.1:8001/api");
        assert!(!u.tls);
        let u = Upstream::parse("https://localhost:8443/v").unwrap();
        assert!(u.tls);
        assert_eq!(u.host, "localhost");
        assert_eq!(u.base_url(), "https://localhost:8443/v");
        let u = Upstream::parse("https://127.0.0.1").unwrap();
        assert_eq!(u.addr.port(), 443);
        assert_eq!(u.host, "127.0.0.1");
        let u = Upstream::parse("http://[::1]:9").unwrap();
        assert_eq!(u.host, "::1");
        assert_eq!(u.addr, "[::1]:9".parse().unwrap());
        assert!(Upstream::parse("ftp://x:1").is_err());
        assert!(Upstream::parse("http://").is_err());
    }

    #[test]
    fn remote_reservations_stop_counting_once_the_publishers_table_covers_them() {
        let r = Arc::new(WorkerRuntime::new(WorkerId("w1".into())));
        let now = Instant::now();
        let (a, b): (Arc<str>, Arc<str>) = ("gw-a".into(), "gw-b".into());
        r.reserve_remote(100, 1, now, Some((a.clone(), 1)));
        r.reserve_remote(200, 2, now, Some((a.clone(), 2)));
        r.reserve_remote(400, 4, now, Some((b.clone(), 1)));
        r.reserve_remote(800, 8, now, None);
        assert_eq!(r.queued_tokens(now), (1500, 15));
        // gw-a's table now covers its decision 1: that request is in the table, not here.
        let covered = std::collections::BTreeMap::from([("gw-a".to_string(), 1)]);
        r.remote_reserved.lock().drop_covered(&covered);
        assert_eq!(r.queued_tokens(now), (1400, 14));
        // Both replicas' tables cover everything they sent; a reservation without a number
        // (an older replica) stays until it expires.
        let covered =
            std::collections::BTreeMap::from([("gw-a".to_string(), 5), ("gw-b".to_string(), 1)]);
        r.remote_reserved.lock().drop_covered(&covered);
        assert_eq!(r.queued_tokens(now), (800, 8));
        assert_eq!(r.queued_tokens(now + REMOTE_RESERVATION_TTL), (0, 0));
    }

    /// A published decision that arrives after its publisher's load table was read with it
    /// already counted (the table covers its number) is not counted again; a later one is.
    /// (Seen in the N = 64 shared-prefix bench: a worker that had just taken one new prompt
    /// counted it twice for 250 ms, and the load guard refused it for the prompt's next
    /// request.) A publisher whose table numbers restart lower (it restarted) is believed at the
    /// next read.
    #[test]
    fn a_reservation_its_publishers_table_already_counts_is_not_counted_again() {
        let r = Arc::new(WorkerRuntime::new(WorkerId("w1".into())));
        let now = Instant::now();
        let a: Arc<str> = "gw-a".into();
        let covered = std::collections::BTreeMap::from([("gw-a".to_string(), 7)]);
        r.remote_reserved.lock().drop_covered(&covered);
        r.reserve_remote(1329, 8, now, Some((a.clone(), 7)));
        r.reserve_remote(100, 1, now, Some((a.clone(), 6)));
        assert_eq!(r.queued_tokens(now), (0, 0));
        r.reserve_remote(1329, 8, now, Some((a.clone(), 8)));
        r.reserve_remote(50, 2, now, None);
        r.reserve_remote(40, 4, now, Some(("gw-b".into(), 1)));
        assert_eq!(r.queued_tokens(now), (1419, 14));
        // gw-a restarted: its table now covers its decision 2.
        let covered = std::collections::BTreeMap::from([("gw-a".to_string(), 2)]);
        r.remote_reserved.lock().drop_covered(&covered);
        r.reserve_remote(10, 1, now, Some((a.clone(), 3)));
        assert_eq!(r.queued_tokens(now), (1429, 15));
    }

    /// Another replica's request computing its prompt here is prefill in its load table, and
    /// in the worker's report: counted as prefill on both sides, the larger of the two counts
    /// it once. (It was counted as decode here, so the report's prefill came on top: a worker
    /// that had just taken one new prompt looked twice as loaded to the other replicas, which
    /// the load guard then refused for the prompt's next request.)
    #[test]
    fn another_replicas_prefill_meets_the_report_as_prefill() {
        let r = Arc::new(WorkerRuntime::new(WorkerId("w1".into())));
        let now = Instant::now();
        r.remote_active_tokens.store(1337, Ordering::Relaxed);
        r.remote_prefill_tokens.store(1329, Ordering::Relaxed);
        assert_eq!(r.queued_tokens(now), (1329, 8));
        r.report_load(
            prefix_index::WorkerLoad {
                running: 1,
                waiting: 0,
                prefill_tokens: 1201,
                decode_tokens: 8,
            },
            now,
        );
        assert_eq!(r.queued_tokens(now), (1329, 8));
        // With this replica's own requests: each part adds to its own term.
        let own = InFlight::start(r.clone(), 100, 10);
        assert_eq!(r.queued_tokens(now), (1429, 18));
        drop(own);
        // A table from an older replica (no prefill part): its active tokens count as decode.
        r.remote_prefill_tokens.store(0, Ordering::Relaxed);
        assert_eq!(r.queued_tokens(now), (1201, 1337));
        // More prefill than active tokens never makes decode negative.
        r.remote_prefill_tokens.store(5000, Ordering::Relaxed);
        assert_eq!(r.queued_tokens(now), (1337, 8));
    }

    #[test]
    fn remote_reservations_count_until_they_expire_and_meet_the_report_by_max() {
        let r = Arc::new(WorkerRuntime::new(WorkerId("w1".into())));
        let t0 = Instant::now();
        let ttl = REMOTE_RESERVATION_TTL;
        // This replica's own request adds to the others' reservations.
        let own = InFlight::start(r.clone(), 100, 10);
        r.reserve_remote(1000, 8, t0, None);
        assert_eq!(r.queued_tokens(t0), (1100, 18));
        drop(own);
        assert_eq!(r.queued_tokens(t0), (1000, 8));
        r.reserve_remote(500, 16, t0 + ttl / 2, None);
        assert_eq!(r.queued_tokens(t0), (1500, 24));
        // The first expires, the second still counts.
        assert_eq!(r.queued_tokens(t0 + ttl), (500, 16));
        assert_eq!(r.queued_tokens(t0 + ttl + ttl / 2), (0, 0));
        // With a fresh report the larger of the two counts, per term.
        let now = Instant::now();
        r.reserve_remote(1000, 8, now, None);
        r.report_load(
            prefix_index::WorkerLoad {
                running: 1,
                waiting: 0,
                prefill_tokens: 600,
                decode_tokens: 100,
            },
            now,
        );
        assert_eq!(r.queued_tokens(now), (1000, 100));
        // Memory stays bounded whatever the publishers send.
        for _ in 0..(REMOTE_RESERVATIONS_MAX + 10) {
            r.reserve_remote(1, 1, now, None);
        }
        assert_eq!(
            r.remote_reserved.lock().queue.len(),
            REMOTE_RESERVATIONS_MAX
        );
        assert_eq!(
            r.remote_reserved.lock().current(now),
            (
                REMOTE_RESERVATIONS_MAX as u64,
                REMOTE_RESERVATIONS_MAX as u64
            )
        );
    }
}
