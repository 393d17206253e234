//! The control plane: the versioned rules, the pinned profiles, the worker contract check,
//! rules changes (admin API, file watch, SIGHUP) and the owned background tasks (health checks
//! and KV-event subscriptions, [`crate::supervisor`]). It installs each new [`View`] into the
//! data plane ([`crate::data_plane::DataPlane`]) it holds; the request path never reaches back
//! here.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use futures::future::{join_all, BoxFuture};
use parking_lot::Mutex;
use prefix_index::WorkerId;
use routing_rules::schema::{Rule, RulesFile, ServiceSpec};
use routing_rules::{ApplyOutcome, Problem, RuleSnapshot, RuleStore, RulesError, Stagger};

use crate::data_plane::DataPlane;
use crate::error::GatewayError;
use crate::profile::ProfileCache;
use crate::protocol::WorkerProfile;
use crate::supervisor::{Supervisor, WorkerChecks};
use crate::view::{Carry, ContractState, View};

/// How long a worker's `/v1/profile` may take during a contract check.
pub const PROFILE_TIMEOUT: Duration = Duration::from_secs(2);

/// Rules, profiles, contract checks and background tasks.
pub struct ControlPlane {
    /// The data plane this control plane installs views into.
    pub data: Arc<DataPlane>,
    /// Per-worker state carried across views.
    pub carry: Carry,
    /// Loaded profiles.
    pub profiles: ProfileCache,
    /// The versioned rules.
    pub store: RuleStore,
    /// Client for the gateway's own calls to workers (health, profile, events).
    pub http: reqwest::Client,
    /// Bearer token of the admin plane (`None`: admin plane open, for local use only).
    pub admin_token: Option<String>,
    /// Background tasks (health checks and event subscriptions), one set per worker.
    supervisor: Mutex<Option<Supervisor>>,
    /// Serializes rules changes (the contract check is async, the store's lock is not).
    apply_lock: tokio::sync::Mutex<()>,
    /// Cluster mode's link to the shared store (`None`: a single gateway with its file).
    cluster: Mutex<Option<Arc<crate::cluster::ClusterLink>>>,
    /// Cluster mode: the workers registered in the shared store (merged into the rules'
    /// workers when views are built; a static worker of the same id wins).
    registered: Mutex<Vec<routing_rules::schema::WorkerSpec>>,
    /// Cluster mode: this replica's place among the replicas (its policies' rotation offset);
    /// [`Stagger::SOLO`] alone or before the first sync.
    stagger: Mutex<Stagger>,
    /// The rules' listener settings the gateway bound at its start ([`Self::bind_listeners`]);
    /// `None` before.
    bound: Mutex<Option<BoundListeners>>,
}

/// The rules' `gateway.listeners` and `gateway.admin_addr` as the gateway bound them at its
/// start. Sockets are bound once: a rules change that moves them is refused.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BoundListeners {
    listeners: Vec<routing_rules::schema::ListenerSpec>,
    admin_addr: Option<String>,
}

impl BoundListeners {
    fn of(rules: &RulesFile) -> BoundListeners {
        BoundListeners {
            listeners: rules.gateway.listeners.clone(),
            admin_addr: rules.gateway.admin_addr.clone(),
        }
    }

    /// The named listeners.
    pub fn listeners(&self) -> &[routing_rules::schema::ListenerSpec] {
        &self.listeners
    }

    /// The rules' admin address (validated as `ip:port`), if they name one.
    pub fn admin_addr(&self) -> Option<std::net::SocketAddr> {
        self.admin_addr.as_deref().and_then(|a| a.parse().ok())
    }

    /// Why `rules` cannot be applied to a gateway bound like this (empty: they can).
    pub fn problems(&self, rules: &RulesFile) -> Vec<Problem> {
        let now = BoundListeners::of(rules);
        let mut out = Vec::new();
        let show = |l: &[routing_rules::schema::ListenerSpec]| {
            let v: Vec<String> = l
                .iter()
                .map(|l| format!("{}={}", l.name.0, l.addr))
                .collect();
            format!("[{}]", v.join(", "))
        };
        if now.listeners != self.listeners {
            out.push(Problem::new(
                "gateway.listeners",
                format!(
                    "listeners are bound when the gateway starts ({}): changing them to {} needs a restart",
                    show(&self.listeners),
                    show(&now.listeners)
                ),
            ));
        }
        if now.admin_addr != self.admin_addr {
            out.push(Problem::new(
                "gateway.admin_addr",
                format!(
                    "the admin plane is bound when the gateway starts ({:?}): changing it to {:?} needs a restart",
                    self.admin_addr, now.admin_addr
                ),
            ));
        }
        out
    }
}

fn problems_text(problems: &[Problem]) -> String {
    problems
        .iter()
        .map(|p| format!("{}: {}", p.path, p.message))
        .collect::<Vec<_>>()
        .join("; ")
}

/// Maps a store error to the admin plane's error.
pub fn rules_error(e: RulesError) -> GatewayError {
    match &e {
        RulesError::ServiceNotFound { name } => GatewayError::NotFound {
            what: format!("service {name:?}"),
        },
        _ if !e.problems().is_empty() => GatewayError::RulesRejected {
            reason: problems_text(e.problems()),
        },
        _ => GatewayError::RulesRejected {
            reason: e.to_string(),
        },
    }
}

/// The architecture a profile pins: its `architecture` field, else the `general.architecture`
/// of the GGUF the gateway loaded it from (the same prompt-profile code the workers report
/// theirs with); none for a HF source without the field.
pub fn pinned_architecture(
    pinned: &routing_rules::schema::ProfileSpec,
    loaded: Option<&crate::profile::LoadedProfile>,
) -> Option<String> {
    pinned.architecture.clone().or_else(|| {
        loaded
            .and_then(|l| l.profile.architecture())
            .map(str::to_string)
    })
}

/// The fields of a worker's profile that differ from a pinned profile (`architecture`: what
/// [`pinned_architecture`] gives; `None` pins nothing).
pub fn profile_differences(
    pinned: &routing_rules::schema::ProfileSpec,
    architecture: Option<&str>,
    got: &WorkerProfile,
) -> Vec<String> {
    let mut out = Vec::new();
    if got.model_id != pinned.model_id {
        out.push(format!(
            "model_id (pinned {:?}, worker {:?})",
            pinned.model_id, got.model_id
        ));
    }
    if let Some(a) = architecture {
        if got.architecture.as_deref() != Some(a) {
            out.push(format!(
                "architecture (pinned {a:?}, worker {})",
                match &got.architecture {
                    Some(w) => format!("{w:?}"),
                    None => "reports none".to_string(),
                }
            ));
        }
    }
    if got.template_sha256 != pinned.template_sha256 {
        out.push(format!(
            "template_sha256 (pinned {}, worker {})",
            pinned.template_sha256, got.template_sha256
        ));
    }
    if got.tokenizer_sha256 != pinned.tokenizer_sha256 {
        out.push(format!(
            "tokenizer_sha256 (pinned {}, worker {})",
            pinned.tokenizer_sha256, got.tokenizer_sha256
        ));
    }
    if got.block_size != pinned.block_size {
        out.push(format!(
            "block_size (pinned {}, worker {})",
            pinned.block_size, got.block_size
        ));
    }
    if got.hash_algorithm != pinned.hash_algorithm {
        out.push(format!(
            "hash_algorithm (pinned {}, worker {})",
            pinned.hash_algorithm, got.hash_algorithm
        ));
    }
    out
}

/// What a worker reported for the contract check, by its kind.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Reported {
    /// A kvgate worker's `GET /v1/profile`.
    Kvgate(WorkerProfile),
    /// A native engine's models, template and probe tokenizations ([`crate::native`]).
    Native(crate::native::NativeReport),
}

/// Profiles fetched from workers: `Err` holds why a worker could not be asked.
pub type FetchedProfiles = BTreeMap<WorkerId, Result<Reported, String>>;

/// The contract problems of a rules set against fetched worker profiles (`profiles`: the
/// gateway's loads of the pinned profiles, by id; a native engine's probe tokenizations are
/// compared with them). Unreachable workers are not problems (they stay `unverified` and get
/// no `kv_exact` traffic until checked).
pub fn contract_problems(
    rules: &RulesFile,
    fetched: &FetchedProfiles,
    profiles: &BTreeMap<String, Arc<crate::profile::LoadedProfile>>,
) -> Vec<Problem> {
    let mut problems = Vec::new();
    for s in &rules.services {
        let Rule::KvExact(k) = &s.rule else { continue };
        let Some(pid) = &k.profile else { continue };
        let Some(pinned) = rules.profiles.iter().find(|p| &p.id == pid) else {
            continue;
        };
        let Some(pool) = rules.pools.iter().find(|p| p.id == s.pool) else {
            continue;
        };
        let loaded = profiles.get(&pid.0).map(|p| p.as_ref());
        let arch = pinned_architecture(pinned, loaded);
        for w in &pool.workers {
            if let Some(Ok(got)) = fetched.get(w) {
                let diff = match got {
                    Reported::Kvgate(p) => profile_differences(pinned, arch.as_deref(), p),
                    Reported::Native(n) => crate::native::differences(pinned, loaded, n),
                };
                if !diff.is_empty() {
                    problems.push(Problem::new(
                        format!("services.{}.rule.profile", s.name),
                        format!(
                            "worker {w} disagrees with profile {pid}: {}",
                            diff.join(", ")
                        ),
                    ));
                }
            }
        }
    }
    problems
}

/// Workers that belong to the pool of some `kv_exact` service.
pub fn kv_exact_workers(rules: &RulesFile) -> BTreeSet<WorkerId> {
    let mut out = BTreeSet::new();
    for s in &rules.services {
        if matches!(s.rule, Rule::KvExact(_)) {
            if let Some(pool) = rules.pools.iter().find(|p| p.id == s.pool) {
                out.extend(pool.workers.iter().cloned());
            }
        }
    }
    out
}

impl ControlPlane {
    /// A control plane over `data`, with no background tasks yet ([`Self::start_supervisor`]).
    pub fn new(
        data: Arc<DataPlane>,
        store: RuleStore,
        http: reqwest::Client,
        admin_token: Option<String>,
    ) -> ControlPlane {
        ControlPlane {
            data,
            carry: Carry::default(),
            profiles: ProfileCache::default(),
            store,
            http,
            admin_token,
            supervisor: Mutex::new(None),
            apply_lock: tokio::sync::Mutex::new(()),
            cluster: Mutex::new(None),
            registered: Mutex::new(Vec::new()),
            stagger: Mutex::new(Stagger::SOLO),
            bound: Mutex::new(None),
        }
    }

    /// Records the listener settings of the rules in force as bound (at the start) and
    /// returns them; later changes of them are refused ([`BoundListeners::problems`]).
    pub fn bind_listeners(&self) -> BoundListeners {
        let bound = BoundListeners::of(self.store.snapshot().rules());
        *self.bound.lock() = Some(bound.clone());
        bound
    }

    /// Joins a cluster: rules changes go through the shared store from now on.
    pub fn set_cluster(&self, link: Arc<crate::cluster::ClusterLink>) {
        *self.cluster.lock() = Some(link);
    }

    /// The cluster link, in cluster mode.
    pub fn cluster(&self) -> Option<Arc<crate::cluster::ClusterLink>> {
        self.cluster.lock().clone()
    }

    /// Why the gateway is not ready to take traffic (`GET /ready`), in order: draining; in
    /// cluster mode, the shared rules and registrations not read yet (a replica that started
    /// while Redis was unreachable serves its file's rules, but the registered workers are not
    /// in its pools and their KV event snapshots not in its index); the KV event snapshots at
    /// the start ([`DataPlane::catching_up`], asked only once the cluster was read, so that it
    /// waits for the registered workers too). Both catch-ups end at the catch-up limit.
    pub fn not_ready_reason(&self) -> Option<String> {
        let data = &self.data;
        data.drain.not_ready_reason().or_else(|| {
            let unread = self.cluster().filter(|l| {
                !l.status.loaded.load(std::sync::atomic::Ordering::Acquire)
                    && !data.catch_up.expired()
            });
            match unread {
                Some(l) => Some(format!(
                    "catching up: the cluster store has not been read yet ({})",
                    l.status
                        .last_error
                        .lock()
                        .clone()
                        .unwrap_or_else(|| "connecting".into())
                )),
                None => data.catching_up(),
            }
        })
    }

    /// `rules` with the registered workers added (those whose id a static worker already
    /// has are skipped): what views are compiled from.
    pub fn effective(&self, rules: &RulesFile) -> RulesFile {
        let registered = self.registered.lock();
        if registered.is_empty() {
            return rules.clone();
        }
        let mut out = rules.clone();
        for w in registered.iter() {
            if !out.workers.iter().any(|s| s.id == w.id) {
                out.workers.push(w.clone());
            }
        }
        out
    }

    /// Cluster mode: replaces the registered workers (from the shared store); a change
    /// rebuilds the view (new workers get health checks and event subscriptions, lapsed ones
    /// leave every pool).
    pub async fn set_registered(&self, records: Vec<cluster::WorkerRecord>) {
        let specs: Vec<routing_rules::schema::WorkerSpec> = records
            .into_iter()
            .filter_map(|r| {
                let id = prefix_index::WorkerId(r.id.clone());
                if crate::view::Upstream::parse(&r.url).is_err() || r.id.is_empty() {
                    tracing::warn!(worker = %r.id, url = %r.url, "registration ignored: bad id or url");
                    return None;
                }
                let kind = match r.kind.as_deref() {
                    None => routing_rules::schema::UpstreamKind::Kvgate,
                    Some(k) => match serde_json::from_value(serde_json::Value::from(k)) {
                        Ok(kind) => kind,
                        Err(_) => {
                            tracing::warn!(worker = %r.id, kind = %k, "registration ignored: unknown kind");
                            return None;
                        }
                    },
                };
                Some(routing_rules::schema::WorkerSpec {
                    id,
                    url: r.url,
                    weight: 1,
                    labels: r.labels,
                    kind,
                    health_path: None,
                    prompt_cache: None,
                })
            })
            .collect();
        let _g = self.apply_lock.lock().await;
        if *self.registered.lock() == specs {
            return;
        }
        *self.registered.lock() = specs;
        self.rebuild_view("registered workers").await;
    }

    /// Rebuilds the view of the rules in force (after a change to what [`Self::effective`]
    /// or [`Self::install_current`] reads); the caller holds `apply_lock`.
    async fn rebuild_view(&self, why: &str) {
        let rules = self.effective(self.store.snapshot().rules());
        let ids = kv_exact_workers(&rules);
        let fetched = self.fetch_profiles(&rules, &ids).await;
        if let Err(e) = self.install_current(&fetched) {
            tracing::warn!(error = %e, "{why}: view not rebuilt");
        }
    }

    /// This replica's place among the replicas ([`Stagger::SOLO`] alone).
    pub fn stagger(&self) -> Stagger {
        *self.stagger.lock()
    }

    /// Cluster mode: this replica is `index` of `of` replicas (sorted ids); rebuilds the view
    /// when that changed, so that its rotations sit apart from the others' ([`Stagger`]).
    pub async fn set_stagger(&self, stagger: Stagger) {
        let _g = self.apply_lock.lock().await;
        if *self.stagger.lock() == stagger {
            return;
        }
        *self.stagger.lock() = stagger;
        self.rebuild_view("replica stagger").await;
    }

    /// Cluster mode: installs the shared store's rules document when its version differs from
    /// the one in force. The replica that wrote it validated and contract-checked it; here the
    /// contract states of this replica's workers are recorded as they are.
    pub async fn apply_remote(&self, doc: &cluster::RulesDoc) {
        let _g = self.apply_lock.lock().await;
        let current = self.store.snapshot();
        if current.version().0 == doc.version {
            return;
        }
        let rules = match routing_rules::rules_from_toml(&doc.text) {
            Ok(r) => r,
            Err(problems) => {
                tracing::warn!(version = doc.version, problems = %problems_text(&problems), "cluster rules refused: they do not parse here");
                return;
            }
        };
        if let Some(bound) = self.bound.lock().as_ref() {
            let problems = bound.problems(&rules);
            if !problems.is_empty() {
                // Another replica cannot write such a change (it refuses it as this one
                // would); a store seeded from a different file can hold it. Installed all the
                // same, so that the replicas agree on services: the sockets stay as bound.
                tracing::warn!(version = doc.version, problems = %problems_text(&problems), "cluster rules: listener settings differ from those bound here; they apply at the next start");
            }
        }
        let eff = self.effective(&rules);
        let ids = kv_exact_workers(&eff);
        let fetched = self.fetch_profiles(&eff, &ids).await;
        let accept = |_: &RuleSnapshot| Ok(());
        match self
            .store
            .replace_versioned(rules, routing_rules::RuleVersion(doc.version), &accept)
        {
            Ok(ApplyOutcome::Applied { .. }) => {
                self.data.metrics.rules_reloads.inc();
                if let Err(e) = self.install_current(&fetched) {
                    tracing::warn!(error = %e, "cluster rules: view not built");
                }
            }
            Ok(ApplyOutcome::Unchanged { .. }) => {}
            Err(e) => tracing::warn!(version = doc.version, error = %e, "cluster rules refused"),
        }
    }

    /// Starts owning the background tasks (on `handle`); they follow every installed view.
    pub fn start_supervisor(self: &Arc<Self>, handle: tokio::runtime::Handle) {
        let checks: std::sync::Weak<dyn WorkerChecks> = Arc::downgrade(self) as _;
        let sup = Supervisor::new(
            handle,
            Arc::downgrade(&self.data),
            self.http.clone(),
            checks,
        );
        *self.supervisor.lock() = Some(sup);
        let view = self.data.views.load();
        if let Some(s) = self.supervisor.lock().as_mut() {
            s.sync(&view);
        }
    }

    /// The directory of the rules file: relative profile paths are resolved against it.
    pub fn rules_dir(&self) -> Option<std::path::PathBuf> {
        self.store
            .path()
            .and_then(|p| p.parent())
            .map(|d| {
                if d.as_os_str().is_empty() {
                    std::path::Path::new(".")
                } else {
                    d
                }
            })
            .map(std::path::Path::to_path_buf)
    }

    /// Stops the background tasks; returns their handles to await.
    pub fn stop_supervisor(&self) -> Vec<tokio::task::JoinHandle<()>> {
        self.supervisor
            .lock()
            .as_mut()
            .map(Supervisor::shutdown)
            .unwrap_or_default()
    }

    /// Fetches what the given workers report (URLs and kinds from `rules`), in parallel: a
    /// kvgate worker's `/v1/profile`, a native engine's models / template / probe
    /// tokenizations ([`crate::native::fetch`]).
    pub async fn fetch_profiles(
        &self,
        rules: &RulesFile,
        ids: &BTreeSet<WorkerId>,
    ) -> FetchedProfiles {
        let futs = rules
            .workers
            .iter()
            .filter(|w| ids.contains(&w.id))
            .map(|w| {
                let http = self.http.clone();
                let id = w.id.clone();
                let kind = w.kind;
                let base = crate::view::Upstream::parse(&w.url).map(|u| u.base_url());
                let token =
                    receipts::AccessToken::new(&self.data.gateway_id, &id, receipts::now_ms())
                        .sign(&self.data.signer);
                async move {
                    let res = match base {
                        Err(e) => Err(e.to_string()),
                        Ok(base) if kind == routing_rules::schema::UpstreamKind::Kvgate => {
                            let url = format!("{base}/v1/profile");
                            match http.get(&url).timeout(PROFILE_TIMEOUT).send().await {
                                Err(e) => Err(format!("unreachable: {e}")),
                                Ok(r) if !r.status().is_success() => {
                                    Err(format!("GET /v1/profile: {}", r.status()))
                                }
                                Ok(r) => r
                                    .json::<WorkerProfile>()
                                    .await
                                    .map(Reported::Kvgate)
                                    .map_err(|e| format!("bad /v1/profile body: {e}")),
                            }
                        }
                        Ok(base) => {
                            crate::native::fetch(&http, &base, kind, &token, PROFILE_TIMEOUT)
                                .await
                                .map(Reported::Native)
                        }
                    };
                    (id, res)
                }
            });
        join_all(futs).await.into_iter().collect()
    }

    /// The contract problems of `rules` against `fetched`, with the pinned profiles loaded
    /// (from the cache when they did not change).
    pub fn problems(&self, rules: &RulesFile, fetched: &FetchedProfiles) -> Vec<Problem> {
        match self.profiles.load_for(rules, self.rules_dir().as_deref()) {
            Ok(profiles) => contract_problems(rules, fetched, &profiles),
            Err(e) => vec![Problem::new("profiles", e.to_string())],
        }
    }

    /// The pre-apply check of every rules change: the pinned profiles load and match their
    /// files, and every reachable worker of a `kv_exact` pool agrees with its service's profile.
    fn check_candidate(
        &self,
        snap: &RuleSnapshot,
        fetched: &FetchedProfiles,
    ) -> Result<(), Vec<Problem>> {
        let mut problems = self.problems(snap.rules(), fetched);
        if let Some(bound) = self.bound.lock().as_ref() {
            problems.extend(bound.problems(snap.rules()));
        }
        if problems.is_empty() {
            Ok(())
        } else {
            Err(problems)
        }
    }

    /// Records the contract state of every worker from a fetch.
    fn record_contracts(&self, rules: &RulesFile, fetched: &FetchedProfiles) {
        let needed = kv_exact_workers(rules);
        let profiles = self
            .profiles
            .load_for(rules, self.rules_dir().as_deref())
            .unwrap_or_default();
        let runtimes = self.carry.runtimes.lock();
        for (id, rt) in runtimes.iter() {
            if let Some(Ok(p)) = fetched.get(id) {
                *rt.reported.lock() = Some(p.clone());
            }
            let state = if !needed.contains(id) {
                ContractState::NotRequired
            } else {
                match fetched.get(id) {
                    Some(Ok(_)) => {
                        let problems = contract_problems(
                            rules,
                            &BTreeMap::from([(id.clone(), fetched[id].clone())]),
                            &profiles,
                        );
                        if problems.is_empty() {
                            ContractState::Ok
                        } else {
                            ContractState::Mismatch(problems_text(&problems))
                        }
                    }
                    Some(Err(e)) => ContractState::Unverified(e.clone()),
                    None => ContractState::Unverified("not checked yet".into()),
                }
            };
            *rt.contract.lock() = state;
        }
    }

    /// Builds a view from the store's current snapshot and installs it; syncs background tasks.
    pub fn install_current(&self, fetched: &FetchedProfiles) -> Result<(), GatewayError> {
        let base = self.store.snapshot();
        let snap = match self.cluster() {
            None if self.registered.lock().is_empty() => base,
            // Cluster mode: the registered workers join, and this replica's rotations sit at
            // its own place among the replicas', so replicas do not all pick the same worker.
            _ => Arc::new(
                RuleSnapshot::build_staggered(
                    self.effective(base.rules()),
                    base.version(),
                    *self.stagger.lock(),
                )
                .map_err(rules_error)?,
            ),
        };
        let profiles = self
            .profiles
            .load_for(snap.rules(), self.rules_dir().as_deref())?;
        let previous = self.data.views.load();
        let view = View::compile(snap.clone(), &profiles, Some(&previous), &self.carry)?;
        self.record_contracts(snap.rules(), fetched);
        // Rate-limit buckets outlive a change; a removed tenant's go.
        let tenants: std::collections::HashSet<_> =
            snap.rules().tenants.iter().map(|t| t.id.clone()).collect();
        self.data.limits.retain(|id| tenants.contains(id));
        self.data.views.store(view);
        self.data
            .metrics
            .rules_version
            .set(i64::try_from(snap.version().0).unwrap_or(i64::MAX));
        if let Some(sup) = self.supervisor.lock().as_mut() {
            sup.sync(&self.data.views.load());
        }
        Ok(())
    }

    async fn change(
        &self,
        candidate: RulesFile,
        apply: impl FnOnce(
            &dyn Fn(&RuleSnapshot) -> Result<(), Vec<Problem>>,
        ) -> Result<ApplyOutcome, RulesError>,
    ) -> Result<ApplyOutcome, GatewayError> {
        if let Some(link) = self.cluster() {
            return self.change_in_cluster(&link, candidate).await;
        }
        let _g = self.apply_lock.lock().await;
        let ids = kv_exact_workers(&candidate);
        let fetched = self.fetch_profiles(&candidate, &ids).await;
        let check = |snap: &RuleSnapshot| self.check_candidate(snap, &fetched);
        match apply(&check) {
            Ok(outcome) => {
                if let ApplyOutcome::Applied { .. } = outcome {
                    self.data.metrics.rules_reloads.inc();
                    self.install_current(&fetched)?;
                } else {
                    self.record_contracts(self.store.snapshot().rules(), &fetched);
                }
                Ok(outcome)
            }
            Err(e) => {
                self.data.metrics.rules_rejected.inc();
                Err(rules_error(e))
            }
        }
    }

    /// A rules change in cluster mode: validated and contract-checked here as in a single
    /// gateway, then written to the shared store with a compare-and-set on the version in force
    /// (409 `rules_conflict` when another replica wrote first; 503 `cluster_unavailable` when
    /// the store cannot be reached — a change must reach every replica or none), then installed
    /// here under the store's new version; the others install it from the announcement.
    async fn change_in_cluster(
        &self,
        link: &crate::cluster::ClusterLink,
        candidate: RulesFile,
    ) -> Result<ApplyOutcome, GatewayError> {
        let _g = self.apply_lock.lock().await;
        let current = self.store.snapshot();
        let next = routing_rules::RuleVersion(current.version().0 + 1);
        let snap = RuleSnapshot::build(candidate.clone(), next).map_err(|e| {
            self.data.metrics.rules_rejected.inc();
            rules_error(e)
        })?;
        if snap.content_hash() == current.content_hash() {
            return Ok(ApplyOutcome::Unchanged {
                version: current.version(),
            });
        }
        let eff = self.effective(&candidate);
        let ids = kv_exact_workers(&eff);
        let fetched = self.fetch_profiles(&eff, &ids).await;
        let eff_snap = RuleSnapshot::build(eff, next).map_err(rules_error)?;
        if let Err(problems) = self.check_candidate(&eff_snap, &fetched) {
            self.data.metrics.rules_rejected.inc();
            return Err(rules_error(RulesError::Rejected { problems }));
        }
        let store = link
            .store()
            .ok_or_else(|| GatewayError::ClusterUnavailable {
                reason: "not connected".into(),
            })?;
        let text = routing_rules::rules_to_toml(&candidate).map_err(rules_error)?;
        let doc = match store
            .put_rules(current.version().0, text, link.replica_id())
            .await
        {
            Ok(doc) => doc,
            Err(cluster::ClusterError::Conflict { current }) => {
                self.data.metrics.rules_rejected.inc();
                return Err(GatewayError::RulesConflict { current });
            }
            Err(e) => {
                link.failed(self, &e);
                return Err(GatewayError::ClusterUnavailable {
                    reason: e.to_string(),
                });
            }
        };
        let accept = |_: &RuleSnapshot| Ok(());
        let outcome = self
            .store
            .replace_versioned(candidate, routing_rules::RuleVersion(doc.version), &accept)
            .map_err(rules_error)?;
        self.data.metrics.rules_reloads.inc();
        self.install_current(&fetched)?;
        Ok(outcome)
    }

    /// Admin: create or replace one service.
    pub async fn put_service(&self, spec: ServiceSpec) -> Result<ApplyOutcome, GatewayError> {
        let mut candidate = self.store.snapshot().rules().clone();
        candidate.upsert_service(spec.clone());
        self.change(candidate, |check| self.store.put_service_with(spec, check))
            .await
    }

    /// Admin: cordon worker `id` (no new requests) or lift its cordon; a rules change like any
    /// other (validated, versioned, written back; in cluster mode shared with every replica).
    pub async fn set_cordoned(
        &self,
        id: &WorkerId,
        cordoned: bool,
    ) -> Result<ApplyOutcome, GatewayError> {
        let mut candidate = self.store.snapshot().rules().clone();
        candidate.set_cordoned(id, cordoned);
        self.change(candidate, |check| {
            self.store.set_cordoned_with(id, cordoned, check)
        })
        .await
    }

    /// Admin: delete one service.
    pub async fn delete_service(&self, name: &str) -> Result<ApplyOutcome, GatewayError> {
        let mut candidate = self.store.snapshot().rules().clone();
        candidate.remove_service(name);
        self.change(candidate, |check| {
            self.store.delete_service_with(name, check)
        })
        .await
    }

    /// File watch, SIGHUP, `POST /admin/reload`: re-read the rules file.
    pub async fn reload_from_file(&self) -> Result<ApplyOutcome, GatewayError> {
        let candidate = match self.store.path() {
            Some(p) => std::fs::read_to_string(p)
                .ok()
                .and_then(|t| routing_rules::rules_from_toml(&t).ok())
                .unwrap_or_else(|| self.store.snapshot().rules().clone()),
            None => self.store.snapshot().rules().clone(),
        };
        self.change(candidate, |check| self.store.reload_from_file_with(check))
            .await
    }

    /// Re-reads one worker's profile (after it became healthy or reachable, or while it is
    /// unknown): keeps what it reports (round-robin tickets carry its hash algorithm) and, for a
    /// worker of a `kv_exact` pool, its contract state.
    pub async fn refresh_worker(&self, id: &WorkerId) {
        let rules = self.store.snapshot().rules().clone();
        let fetched = self
            .fetch_profiles(&rules, &BTreeSet::from([id.clone()]))
            .await;
        let needs_contract = kv_exact_workers(&rules).contains(id);
        let runtimes = self.carry.runtimes.lock();
        if let (Some(rt), Some(res)) = (runtimes.get(id), fetched.get(id)) {
            if let Ok(p) = res {
                *rt.reported.lock() = Some(p.clone());
            }
            if needs_contract {
                *rt.contract.lock() = match res {
                    Ok(_) => {
                        let problems = self.problems(&rules, &fetched);
                        if problems.is_empty() {
                            ContractState::Ok
                        } else {
                            ContractState::Mismatch(problems_text(&problems))
                        }
                    }
                    Err(e) => ContractState::Unverified(e.clone()),
                };
            }
        }
    }
}

impl WorkerChecks for ControlPlane {
    fn recheck(&self, id: WorkerId) -> BoxFuture<'_, ()> {
        Box::pin(async move { self.refresh_worker(&id).await })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const RULES: &str = r#"
[[workers]]
id = "w1"
url = "http://127.0.0.1:1"
[[workers]]
id = "w2"
url = "http://127.0.0.1:2"
[[workers]]
id = "w3"
url = "http://127.0.0.1:3"
[[pools]]
id = "p"
workers = ["w1", "w2", "w3"]
[[profiles]]
id = "smol"
model_id = "m"
revision = "r"
source = { gguf = "x.gguf" }
template_sha256 = "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"
tokenizer_sha256 = "bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb"
block_size = 16
context_limit = 8192
[[services]]
name = "chat"
pool = "p"
rule = { type = "kv_exact", profile = "smol" }
"#;

    fn agreeing() -> WorkerProfile {
        WorkerProfile {
            model_id: "m".into(),
            revision: Some("r".into()),
            architecture: Some("llama".into()),
            template_sha256: "a".repeat(64),
            tokenizer_sha256: "b".repeat(64),
            block_size: 16,
            hash_algorithm: prefix_index::HashAlgorithm::Xxh3,
            context_limit: Some(8192),
            native_reserve: Some(0),
        }
    }

    #[test]
    fn contract_check_names_workers_and_fields() {
        let rules = routing_rules::rules_from_toml(RULES).unwrap();
        assert_eq!(kv_exact_workers(&rules).len(), 3);
        let mut bad = agreeing();
        bad.block_size = 32;
        bad.hash_algorithm = prefix_index::HashAlgorithm::Sha256;
        let fetched: FetchedProfiles = BTreeMap::from([
            (WorkerId("w1".into()), Ok(Reported::Kvgate(agreeing()))),
            (WorkerId("w2".into()), Ok(Reported::Kvgate(bad))),
            (WorkerId("w3".into()), Err("unreachable".into())),
        ]);
        let problems = contract_problems(&rules, &fetched, &BTreeMap::new());
        assert_eq!(problems.len(), 1, "{problems:?}");
        let msg = &problems[0].message;
        assert!(msg.contains("worker w2"), "{msg}");
        assert!(msg.contains("block_size (pinned 16, worker 32)"), "{msg}");
        assert!(
            msg.contains("hash_algorithm (pinned xxh3, worker sha256)"),
            "{msg}"
        );
        assert!(!msg.contains("template_sha256"), "{msg}");
        assert_eq!(problems[0].path, "services.chat.rule.profile");
        // Round-robin services need no contract.
        let rr = RULES.replace(
            r#"{ type = "kv_exact", profile = "smol" }"#,
            r#"{ type = "round_robin" }"#,
        );
        let rules = routing_rules::rules_from_toml(&rr).unwrap();
        assert!(kv_exact_workers(&rules).is_empty());
        assert!(contract_problems(&rules, &fetched, &BTreeMap::new()).is_empty());
    }

    #[test]
    fn contract_check_compares_the_architecture() {
        // Pinned explicitly: a worker reporting another one, or none, disagrees.
        let pinned = RULES.replace(
            "revision = \"r\"",
            "revision = \"r\"\narchitecture = \"llama\"",
        );
        let rules = routing_rules::rules_from_toml(&pinned).unwrap();
        let mut gemma = agreeing();
        gemma.architecture = Some("gemma3".into());
        let mut none = agreeing();
        none.architecture = None;
        let fetched: FetchedProfiles = BTreeMap::from([
            (WorkerId("w1".into()), Ok(Reported::Kvgate(agreeing()))),
            (WorkerId("w2".into()), Ok(Reported::Kvgate(gemma))),
            (WorkerId("w3".into()), Ok(Reported::Kvgate(none))),
        ]);
        let problems = contract_problems(&rules, &fetched, &BTreeMap::new());
        let text: Vec<&str> = problems.iter().map(|p| p.message.as_str()).collect();
        assert_eq!(problems.len(), 2, "{text:?}");
        assert!(
            text[0].contains("worker w2")
                && text[0].contains(r#"architecture (pinned "llama", worker "gemma3")"#),
            "{text:?}"
        );
        assert!(
            text[1].contains("worker w3")
                && text[1].contains(r#"architecture (pinned "llama", worker reports none)"#),
            "{text:?}"
        );
        // Nothing pinned and no loaded GGUF to take it from: not compared.
        let rules = routing_rules::rules_from_toml(RULES).unwrap();
        assert!(contract_problems(&rules, &fetched, &BTreeMap::new()).is_empty());
    }
}
