//! Fleet simulation: `kvgate bench --fleet sim:N` starts N simulated workers (the real scheduler,
//! KV pool, prefix cache and KV events; the model replaced by a timing model) and a real pingora
//! gateway in-process, and runs the same workload under these policies, each on a fresh fleet
//! (cold caches):
//!
//! - `round_robin`;
//! - `kv_exact` with its defaults: the load guard (`max_load_ratio` 1.5) over `active_tokens`,
//!   routing-time holdings for 2 s;
//! - `kv_longest`: `kv_exact` with `placement = "longest_match"` (the ranking before least-cost
//!   placement: longest match, then lower load);
//! - `kv_in_flight`: the guard over in-flight requests, no routing-time holdings (the defaults
//!   before 2026-12-01);
//! - `oracle`: the worker with the longest cached prefix, ignoring load — implemented as
//!   `kv_exact` with the load guard switched off (`max_load_ratio` 1e9). It reads the same
//!   precise, event-fed index as `kv_exact`, so it measures what the load guard costs in hits,
//!   not gateway-index staleness.
//!
//! Verdicts on the targets: `kv_exact` hit rate ≥ 95% of the oracle's; `kv_exact` TTFT
//! p50 ≤ 50% of round-robin's (multi-turn and shared-prefix); no worker above 1.5× the mean
//! share under `kv_exact`.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use engine::sim::SimConfig;
use engine::EngineConfig;
use prompt_profile::PromptProfile;
use receipts::KeyPair;
use worker::{EngineChoice, RunningWorker, WorkerConfig};

use super::report::{self, Summary, Verdict};
use super::workload::{self, WorkloadKind};
use super::{run_wave, WaveSpec};

/// The policies compared, with the `[services.rule]` TOML of each.
const POLICIES: &[(&str, &str)] = &[
    ("round_robin", "type = \"round_robin\"\n"),
    (
        "kv_exact",
        "type = \"kv_exact\"\nprofile = \"sim\"\nmax_load_ratio = 1.5\nmin_match_tokens = 16\non_no_match = \"least_loaded\"\nload_metric = \"active_tokens\"\npending_ttl_ms = 2000\n",
    ),
    (
        "kv_longest",
        "type = \"kv_exact\"\nprofile = \"sim\"\nmax_load_ratio = 1.5\nmin_match_tokens = 16\non_no_match = \"least_loaded\"\nload_metric = \"active_tokens\"\npending_ttl_ms = 2000\nplacement = \"longest_match\"\n",
    ),
    (
        "kv_in_flight",
        "type = \"kv_exact\"\nprofile = \"sim\"\nmax_load_ratio = 1.5\nmin_match_tokens = 16\non_no_match = \"least_loaded\"\nload_metric = \"in_flight\"\npending_ttl_ms = 0\n",
    ),
    (
        "oracle",
        "type = \"kv_exact\"\nprofile = \"sim\"\nmax_load_ratio = 1000000000.0\nmin_match_tokens = 16\non_no_match = \"least_loaded\"\nload_metric = \"in_flight\"\npending_ttl_ms = 0\n",
    ),
];

/// The model file whose prompt profile the simulated workers and the gateway share.
pub fn default_model_path() -> PathBuf {
    let dir = std::env::var_os("KVGATE_MODEL_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("models"));
    dir.join("SmolLM2-135M-Instruct.Q4_1.gguf")
}

/// Timing model of a simulated worker: a small GPU-class engine (prefill 8k tok/s, a decode step
/// 8 ms + 0.5 ms per sequence in the batch).
fn sim_config(vocab_size: usize) -> SimConfig {
    SimConfig {
        block_size: 16,
        num_blocks: 4096,
        // The prompts are tokenized with the real tokenizer, so the simulated vocabulary is its.
        vocab_size,
        prefill_us_per_token: 125,
        decode_us_base: 8_000,
        decode_us_per_seq: 500,
        eos_after: None,
        eos_token_id: 2,
        panic_at_step: None,
    }
}

struct Fleet {
    workers: Vec<RunningWorker>,
    gateways: Vec<gateway::RunningGateway>,
}

impl Fleet {
    async fn stop(mut self) {
        for mut g in self.gateways.drain(..) {
            let _ = tokio::task::spawn_blocking(move || g.shutdown()).await;
        }
        for w in self.workers.drain(..) {
            w.shutdown().await;
        }
    }
}

fn rules_toml(
    profile: &PromptProfile,
    model_path: &Path,
    workers: &[RunningWorker],
    rule: &str,
) -> String {
    let id = profile.identity();
    let mut s = String::new();
    for (i, w) in workers.iter().enumerate() {
        s.push_str(&format!(
            "[[workers]]\nid = \"w{i}\"\nurl = \"http://{}\"\n\n",
            w.addr()
        ));
    }
    let ids: Vec<String> = (0..workers.len()).map(|i| format!("\"w{i}\"")).collect();
    s.push_str(&format!(
        "[[pools]]\nid = \"fleet\"\nworkers = [{}]\n\n",
        ids.join(", ")
    ));
    s.push_str(&format!(
        "[[profiles]]\nid = \"sim\"\nmodel_id = {:?}\nrevision = {:?}\nsource = {{ gguf = {:?} }}\ntemplate_sha256 = {:?}\ntokenizer_sha256 = {:?}\nblock_size = 16\nhash_algorithm = \"xxh3\"\ncontext_limit = {}\nnative_reserve_tokens = 0\n\n",
        id.model_id,
        id.revision,
        model_path.display().to_string(),
        id.template_sha256,
        id.tokenizer_sha256,
        id.context_limit,
    ));
    s.push_str("[[services]]\nname = \"bench\"\npool = \"fleet\"\nmatch = { path_prefix = \"/v1/\" }\n\n[services.rule]\n");
    s.push_str(rule);
    s
}

/// A `redis-server` the bench starts for its cluster-mode fleets (ephemeral port, no
/// persistence); killed on drop.
pub(crate) struct RedisServer {
    child: std::process::Child,
    url: String,
}

impl RedisServer {
    /// Its URL (`redis://127.0.0.1:PORT`).
    pub(crate) fn url(&self) -> &str {
        &self.url
    }

    /// Its process id.
    pub(crate) fn pid(&self) -> u32 {
        self.child.id()
    }

    pub(crate) fn start() -> anyhow::Result<RedisServer> {
        let port = std::net::TcpListener::bind("127.0.0.1:0")?
            .local_addr()?
            .port();
        let child = std::process::Command::new("redis-server")
            .args([
                "--port",
                &port.to_string(),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
            ])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .context(
                "starting redis-server (install Debian's redis-server; scripts/setup.sh does)",
            )?;
        let mut r = RedisServer {
            child,
            url: format!("redis://127.0.0.1:{port}"),
        };
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            if std::time::Instant::now() > deadline {
                let _ = r.child.kill();
                anyhow::bail!("redis-server did not start on port {port}");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(r)
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts `n` simulated workers `w0`… (trusting `gateway_keys`' tickets) into `into` and waits
/// until they are ready; on an error the ones started are in `into`, for the caller to stop.
async fn start_workers(
    n: usize,
    dir: &Path,
    model_path: &Path,
    profile: &PromptProfile,
    gateway_keys: &receipts::KeyRing,
    into: &mut Vec<RunningWorker>,
) -> anyhow::Result<()> {
    for i in 0..n {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let mut cfg = WorkerConfig::new(
            model_path,
            EngineChoice::Sim(sim_config(profile.vocab_size())),
            KeyPair::generate(),
            dir.join(format!("w{i}.receipts.jsonl")),
            format!("w{i}"),
        );
        cfg.profile = Some(profile.clone());
        cfg.gateway_keys = gateway_keys.clone();
        cfg.engine_config = EngineConfig {
            max_waiting: 256,
            ..EngineConfig::default()
        };
        let w = worker::spawn(cfg, listener)
            .await
            .with_context(|| format!("starting simulated worker w{i}"))?;
        into.push(w);
    }
    for w in into.iter() {
        w.wait_ready(Duration::from_secs(30))
            .await
            .context("simulated worker not ready")?;
    }
    Ok(())
}

/// `kvgate bench --fleet sim:N --gateways G --event-rate R`: the KV event transports compared
/// on N simulated workers ([`super::transport`]).
pub async fn run_transport(
    n: usize,
    replicas: usize,
    rate: u64,
    seconds: u64,
) -> anyhow::Result<ExitCode> {
    transport_figures(n, replicas, rate, seconds)
        .await
        .map(|_| ExitCode::SUCCESS)
}

/// [`run_transport`]'s figures: SSE's, then Redis Streams'.
async fn transport_figures(
    n: usize,
    replicas: usize,
    rate: u64,
    seconds: u64,
) -> anyhow::Result<[super::transport::TransportFigures; 2]> {
    let model_path =
        std::fs::canonicalize(default_model_path()).unwrap_or_else(|_| default_model_path());
    let profile = PromptProfile::from_gguf(&model_path).with_context(|| {
        format!(
            "loading the prompt profile from {} (run scripts/fetch-model.sh)",
            model_path.display()
        )
    })?;
    let tmp = tempfile::tempdir()?;
    let mut workers = Vec::with_capacity(n);
    let started = start_workers(
        n,
        tmp.path(),
        &model_path,
        &profile,
        &receipts::KeyRing::new(),
        &mut workers,
    )
    .await;
    let args = super::transport::TransportRun {
        workers: n,
        replicas: replicas.max(1),
        rate,
        seconds,
    };
    let result = match started {
        Ok(()) => super::transport::run(&args, &workers).await,
        Err(e) => Err(e),
    };
    for w in workers {
        w.shutdown().await;
    }
    result
}

/// `gateways` replicas (cluster mode on `cluster` = (Redis URL, key prefix) when more than
/// one) in front of `n` simulated workers.
async fn start_fleet(
    n: usize,
    gateways: usize,
    cluster: Option<(&str, &str, Duration, Duration)>,
    dir: &Path,
    model_path: &Path,
    profile: &PromptProfile,
    rule: &str,
) -> anyhow::Result<Fleet> {
    let mut fleet = Fleet {
        workers: Vec::with_capacity(n),
        gateways: Vec::new(),
    };
    let keys: Vec<KeyPair> = (0..gateways.max(1)).map(|_| KeyPair::generate()).collect();
    let mut gateway_keys = receipts::KeyRing::new();
    for (g, k) in keys.iter().enumerate() {
        gateway_keys.insert(format!("gw{g}"), k.public().clone());
    }
    let result = async {
        start_workers(
            n,
            dir,
            model_path,
            profile,
            &gateway_keys,
            &mut fleet.workers,
        )
        .await?;
        let rules_path = dir.join("rules.toml");
        std::fs::write(
            &rules_path,
            rules_toml(profile, model_path, &fleet.workers, rule),
        )?;
        for (g, key) in keys.iter().enumerate() {
            let mut gcfg = gateway::GatewayConfig::new(&rules_path, key.clone());
            gcfg.gateway_id = format!("gw{g}");
            gcfg.watch_rules = false;
            gcfg.threads = 2;
            if let Some((url, prefix, claim_ttl, claim_timeout)) = cluster {
                let mut c = gateway::cluster::ClusterSettings::new(url);
                c.prefix = prefix.to_string();
                c.lease = Duration::from_millis(1000);
                c.claim_ttl = claim_ttl;
                c.claim_timeout = claim_timeout;
                gcfg.cluster = Some(c);
            }
            let g = tokio::task::spawn_blocking(move || gateway::spawn(gcfg)).await??;
            fleet.gateways.push(g);
        }
        if cluster.is_some() {
            wait_for_places(&fleet, Duration::from_secs(10)).await?;
        }
        anyhow::Ok(())
    }
    .await;
    match result {
        Ok(()) => Ok(fleet),
        Err(e) => {
            fleet.stop().await;
            Err(e)
        }
    }
}

/// Waits until every replica of `fleet` knows its place among all of them (`/admin/cluster`
/// `place.of` = the number of replicas, places distinct): until then a replica's rotations
/// start where a lone gateway's would, and the first requests of a run would measure the
/// replicas' start-up rather than their routing. A replica learns its peers on its next sync
/// with Redis (every lease / 5).
async fn wait_for_places(fleet: &Fleet, limit: Duration) -> anyhow::Result<()> {
    let client = reqwest::Client::new();
    let g = fleet.gateways.len();
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        let mut places = Vec::with_capacity(g);
        for gw in &fleet.gateways {
            let place = async {
                let v: serde_json::Value = client
                    .get(format!("http://{}/admin/cluster", gw.admin_addr))
                    .send()
                    .await
                    .ok()?
                    .json()
                    .await
                    .ok()?;
                Some((v["place"]["index"].as_u64()?, v["place"]["of"].as_u64()?))
            }
            .await;
            places.push(place);
        }
        let mut indexes: Vec<u64> = places
            .iter()
            .filter_map(|p| p.filter(|&(_, of)| of == g as u64).map(|(i, _)| i))
            .collect();
        indexes.sort_unstable();
        indexes.dedup();
        if indexes.len() == g {
            return Ok(());
        }
        if tokio::time::Instant::now() >= deadline {
            anyhow::bail!(
                "the {g} replicas did not all learn their places in {limit:?}: {places:?}"
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn find<'a>(s: &'a [Summary], label: &str) -> Option<&'a Summary> {
    s.iter().find(|s| s.label == label)
}

/// The targets for one workload, over whichever of the labels `round_robin`, `kv_exact`
/// and `oracle` were run: `kv_exact` hit rate ≥ 95% of the oracle's; `kv_exact` TTFT p50 ≤ 50% of
/// round-robin's (multi-turn and shared-prefix); no worker above 1.5× the mean share under
/// `kv_exact`.
pub fn fleet_verdicts(kind: WorkloadKind, s: &[Summary]) -> Vec<Verdict> {
    let Some(kv) = find(s, "kv_exact") else {
        return Vec::new();
    };
    let mut out = Vec::new();
    let ratio = |a: Option<f64>, b: Option<f64>| match (a, b) {
        (Some(a), Some(b)) if b > 0.0 => Some(a / b),
        (Some(_), Some(_)) => Some(1.0),
        _ => None,
    };
    if let Some(or) = find(s, "oracle") {
        out.push(report::judge(
            "kv_exact hit rate / oracle hit rate >= 0.95".into(),
            ratio(kv.hit_rate, or.hit_rate),
            false,
            0.95,
            &[kv, or],
        ));
    }
    if let Some(rr) = find(s, "round_robin") {
        if matches!(
            kind,
            WorkloadKind::MultiTurn | WorkloadKind::SharedPrefix | WorkloadKind::PrefixChat
        ) {
            out.push(report::judge(
                "kv_exact TTFT p50 / round_robin TTFT p50 <= 0.5".into(),
                ratio(kv.ttft.map(|p| p.p50), rr.ttft.map(|p| p.p50)),
                true,
                0.5,
                &[kv, rr],
            ));
        }
    }
    out.push(report::judge(
        "kv_exact max worker share / mean share <= 1.5".into(),
        kv.max_share_over_mean,
        true,
        1.5,
        &[kv],
    ));
    out
}

/// A run's mean route decision over every request its gateways decided, seconds.
#[derive(Debug, Clone, Copy, Default)]
pub struct DecisionCost {
    /// From request start to decision (`kvgate_gateway_route_decision_seconds`): includes the
    /// wait for the routing pool and for a CPU.
    pub wall: Option<f64>,
    /// CPU time of the routing computation on its thread
    /// (`kvgate_gateway_route_decision_cpu_seconds`): what the decision costs, whatever else
    /// shares the machine.
    pub cpu: Option<f64>,
    /// Of `cpu`, the part spent tokenizing (`kvgate_gateway_route_tokenize_cpu_seconds`:
    /// parse, render, tokenize, block keys); the rest is placement (index lookup, loads,
    /// policy, reservation), the part that shared load changes.
    pub tokenize_cpu: Option<f64>,
    /// Cluster claims by outcome: kept, moved, failed (`kvgate_gateway_cluster_claims_total`).
    pub claims: [u64; 3],
    /// Decisions that followed a close decision's fresh holding and waited for its claim, by
    /// outcome: kept, moved, failed (`kvgate_gateway_cluster_claim_follows_total`).
    pub follows: [u64; 3],
    /// Mean claim round trip (`kvgate_gateway_cluster_claim_seconds`), seconds.
    pub claim: Option<f64>,
    /// Decisions whose CPU time was above [`SLOW_DECISION_CPU`] (the histogram bucket at or
    /// above it), with that bucket's bound: the tail a mean hides.
    pub slow: Option<(u64, f64)>,
}

/// A decision above this much CPU is counted as slow ([`DecisionCost::slow`]): a KV-exact
/// decision on the fleet bench's prompts takes well under 1 ms.
const SLOW_DECISION_CPU: f64 = 0.002;

/// The mean route decision of `fleet`'s gateways, from their histograms (admin `/metrics`).
async fn mean_decision(client: &reqwest::Client, fleet: &Fleet) -> DecisionCost {
    let mut sums = [(0.0, 0.0); 4];
    let mut claims = [0u64; 3];
    let mut follows = [0u64; 3];
    // Cumulative counts of the decision CPU histogram by bucket bound, over every gateway.
    let mut cpu_buckets: Vec<(f64, f64)> = Vec::new();
    for g in &fleet.gateways {
        let text = match client
            .get(format!("http://{}/metrics", g.admin_addr))
            .send()
            .await
        {
            Ok(r) => r.text().await.unwrap_or_default(),
            Err(_) => return DecisionCost::default(),
        };
        for line in text.lines() {
            let value = || {
                line.rsplit(' ')
                    .next()
                    .and_then(|v| v.parse::<f64>().ok())
                    .unwrap_or(0.0)
            };
            if let Some(le) = line
                .strip_prefix("kvgate_gateway_route_decision_cpu_seconds_bucket{")
                .and_then(|rest| rest.split("le=\"").nth(1))
                .and_then(|rest| rest.split('"').next())
                .and_then(|le| le.parse::<f64>().ok())
            {
                match cpu_buckets.iter_mut().find(|(b, _)| *b == le) {
                    Some((_, c)) => *c += value(),
                    None => cpu_buckets.push((le, value())),
                }
            }
            for (i, outcome) in ["kept", "moved", "failed"].iter().enumerate() {
                if !line.contains(&format!("outcome=\"{outcome}\"")) {
                    continue;
                }
                if line.starts_with("kvgate_gateway_cluster_claims_total") {
                    claims[i] += value() as u64;
                } else if line.starts_with("kvgate_gateway_cluster_claim_follows_total") {
                    follows[i] += value() as u64;
                }
            }
            for (i, name) in [
                "kvgate_gateway_route_decision_seconds",
                "kvgate_gateway_route_decision_cpu_seconds",
                "kvgate_gateway_cluster_claim_seconds",
                "kvgate_gateway_route_tokenize_cpu_seconds",
            ]
            .iter()
            .enumerate()
            {
                if let Some(rest) = line.strip_prefix(name) {
                    if rest.starts_with("_sum") {
                        sums[i].0 += value();
                    } else if rest.starts_with("_count") {
                        sums[i].1 += value();
                    }
                }
            }
        }
    }
    let mean = |(sum, count): (f64, f64)| (count > 0.0).then(|| sum / count);
    let slow = cpu_buckets
        .iter()
        .filter(|(le, _)| *le >= SLOW_DECISION_CPU && le.is_finite())
        .min_by(|a, b| a.0.total_cmp(&b.0))
        .map(|&(le, below)| ((sums[1].1 - below).max(0.0) as u64, le));
    DecisionCost {
        slow,
        wall: mean(sums[0]),
        cpu: mean(sums[1]),
        claims,
        follows,
        claim: mean(sums[2]),
        tokenize_cpu: mean(sums[3]),
    }
}

/// The targets of a replicated run (`--gateways G`, G > 1), over `[single, shared, apart]`: one
/// gateway, G replicas sharing Redis, and G replicas sharing nothing (the control: the same G
/// gateways on this machine's cores, without the cluster). Against one gateway: hit rate ≥
/// 0.95×, TTFT p50 ≤ 1.1×, and the route decision's CPU ≤ 1.3×; no worker above 1.5× the mean
/// share. The decision is judged twice, on CPU time (G replicas on shared cores wait for a CPU
/// in a way replicas on their own machines would not; the wall time is printed beside it):
/// against one gateway, and against the control, which isolates what the sharing itself adds;
/// and its placement part alone (the CPU after tokenizing) against one gateway's: G replicas
/// behind a VIP each tokenize a prompt they have not seen before up to G times as often as one
/// gateway, which the whole decision's CPU includes and shared load does not cause.
pub fn replica_verdicts(runs: [&Summary; 3], decisions: [DecisionCost; 3]) -> Vec<Verdict> {
    let [single, replicated, apart] = runs;
    let ratio = |a: Option<f64>, b: Option<f64>| match (a, b) {
        (Some(a), Some(b)) if b > 0.0 => Some(a / b),
        (Some(_), Some(_)) => Some(1.0),
        _ => None,
    };
    let decision = |base: &Summary, base_cost: DecisionCost| {
        report::judge(
            format!(
                "{} mean route decision CPU / {} mean route decision CPU <= 1.3",
                replicated.label, base.label
            ),
            ratio(decisions[1].cpu, base_cost.cpu),
            true,
            1.3,
            &[replicated, base],
        )
    };
    vec![
        report::judge(
            format!(
                "{} hit rate / {} hit rate >= 0.95",
                replicated.label, single.label
            ),
            ratio(replicated.hit_rate, single.hit_rate),
            false,
            0.95,
            &[replicated, single],
        ),
        report::judge(
            format!(
                "{} TTFT p50 / {} TTFT p50 <= 1.1",
                replicated.label, single.label
            ),
            ratio(replicated.ttft.map(|p| p.p50), single.ttft.map(|p| p.p50)),
            true,
            1.1,
            &[replicated, single],
        ),
        report::judge(
            format!("{} max worker share / mean share <= 1.5", replicated.label),
            replicated.max_share_over_mean,
            true,
            1.5,
            &[replicated],
        ),
        decision(single, decisions[0]),
        decision(apart, decisions[2]),
        report::judge(
            format!(
                "{} mean placement CPU / {} mean placement CPU <= 1.3",
                replicated.label, single.label
            ),
            ratio(decisions[1].placement_cpu(), decisions[0].placement_cpu()),
            true,
            1.3,
            &[replicated, single],
        ),
    ]
}

impl DecisionCost {
    /// The decision's CPU after tokenizing: lookup, loads, policy and reservation.
    pub fn placement_cpu(&self) -> Option<f64> {
        self.cpu
            .zip(self.tokenize_cpu)
            .map(|(all, tok)| (all - tok).max(0.0))
    }
}

/// What a fleet run measures (from the `kvgate bench --fleet` flags).
pub struct FleetRun<'a> {
    /// Workloads, one comparison each.
    pub workload: &'a [WorkloadKind],
    /// Their shape.
    pub shape: &'a workload::WorkloadShape,
    /// The `model` of every request.
    pub model: &'a str,
    /// Requests in flight.
    pub concurrency: usize,
    /// Longest run per policy, seconds.
    pub max_seconds: u64,
    /// Per-request timeout, seconds.
    pub request_timeout: u64,
    /// Where records and summaries go.
    pub out: &'a std::path::Path,
    /// Gateway replicas (`--gateways G`): with G > 1, `kv_exact` on one gateway against
    /// `kv_exact` on G replicas in cluster mode (a `redis-server` the bench starts), requests
    /// spread over the replicas as `vip` says.
    pub gateways: usize,
    /// How the VIP spreads requests over the replicas (`--vip`).
    pub vip: super::Spread,
    /// With one gateway: the policies to run (names of [`POLICIES`]); empty = all.
    pub policies: &'a [String],
    /// Cluster mode: the replicas' claim TTL (0: claims off), docs/cluster.md "Claims".
    pub claim_ttl: Duration,
    /// Cluster mode: how long a decision waits for its claim.
    pub claim_timeout: Duration,
}

/// Runs `plans` through the fleet's gateways (requests spread over them as `args.vip` says) with the
/// run's concurrency and timeouts.
async fn run_plans(
    client: &reqwest::Client,
    args: &FleetRun<'_>,
    profile: &PromptProfile,
    fleet: &Fleet,
    label: &str,
    kind: WorkloadKind,
    plans: Vec<workload::SessionPlan>,
) -> anyhow::Result<super::Wave> {
    let targets: Vec<String> = fleet
        .gateways
        .iter()
        .map(|g| format!("http://{}", g.listen_addr))
        .collect();
    if targets.is_empty() {
        anyhow::bail!("no gateway started");
    }
    Ok(run_wave(
        client,
        WaveSpec {
            label,
            targets: &targets,
            spread: args.vip,
            model: args.model,
            kind,
            plans,
            concurrency: args.concurrency,
            max_duration: Duration::from_secs(args.max_seconds),
            request_timeout: Duration::from_secs(args.request_timeout),
            context_limit: Some(u64::from(profile.context_limit())),
        },
    )
    .await)
}

/// Runs every workload of `args` against `n` simulated workers under each policy.
pub async fn run(n: usize, args: &FleetRun<'_>) -> anyhow::Result<ExitCode> {
    // Absolute: the rules file (and, in cluster mode, its copy in Redis) names it, and relative
    // profile paths resolve against the rules file's folder.
    let model_path =
        std::fs::canonicalize(default_model_path()).unwrap_or_else(|_| default_model_path());
    let profile = PromptProfile::from_gguf(&model_path).with_context(|| {
        format!(
            "loading the prompt profile from {} (run scripts/fetch-model.sh)",
            model_path.display()
        )
    })?;
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(64)
        .build()?;
    let mut failed = false;
    let g = args.gateways.max(1);
    // (label, rule, gateways, sharing through Redis)
    let runs: Vec<(String, &str, usize, bool)> = if g == 1 {
        if let Some(unknown) = args
            .policies
            .iter()
            .find(|p| !POLICIES.iter().any(|(l, _)| l == p))
        {
            let known: Vec<&str> = POLICIES.iter().map(|(l, _)| *l).collect();
            anyhow::bail!(
                "--policies: unknown policy `{unknown}` (known: {})",
                known.join(", ")
            );
        }
        let runs: Vec<(String, &str, usize, bool)> = if args.policies.is_empty() {
            POLICIES
                .iter()
                .map(|(l, r)| (l.to_string(), *r, 1, false))
                .collect()
        } else {
            args.policies
                .iter()
                .filter_map(|p| POLICIES.iter().find(|(l, _)| l == p))
                .map(|(l, r)| (l.to_string(), *r, 1, false))
                .collect()
        };
        let names: Vec<&str> = runs.iter().map(|(l, _, _, _)| l.as_str()).collect();
        println!(
            "fleet: {n} simulated workers + gateway, policies: {}",
            names.join(", ")
        );
        runs
    } else {
        println!(
            "fleet: {n} simulated workers; kv_exact behind 1 gateway vs {g} replicas sharing \
             Redis (and, as a control, {g} replicas sharing nothing); the VIP spreads each {}",
            args.vip.as_str()
        );
        let kv = POLICIES[1].1;
        vec![
            ("kv_exact".to_string(), kv, 1, false),
            (format!("kv_exact_{g}gw"), kv, g, true),
            (format!("kv_exact_{g}gw_apart"), kv, g, false),
        ]
    };
    let redis = if g > 1 {
        Some(RedisServer::start()?)
    } else {
        None
    };
    // Warm-up, not recorded: the process's one-time costs (thread pools, first connections,
    // allocator growth) otherwise fall on the first policy's first requests only — measured at
    // +20–60 ms TTFT on the first wave of a 4-worker multi-turn run.
    if let (Some(kind), Some((_, rule, _, _))) = (args.workload.first(), runs.first()) {
        let tmp = tempfile::tempdir()?;
        let fleet = start_fleet(n, 1, None, tmp.path(), &model_path, &profile, rule).await?;
        let mut plans = workload::plan(*kind, args.shape);
        plans.truncate(args.concurrency.max(1));
        for p in &mut plans {
            p.user_turns.truncate(1);
            p.think.truncate(1);
        }
        run_plans(&client, args, &profile, &fleet, "warm-up", *kind, plans).await?;
        fleet.stop().await;
    }
    for kind in args.workload {
        let mut summaries = Vec::new();
        let mut records = Vec::new();
        let mut decisions = Vec::new();
        for (i, (label, rule, gws, shared)) in runs.iter().enumerate() {
            let tmp = tempfile::tempdir()?;
            let prefix = format!("bench-{}-{i}-{}", kind.as_str(), rand::random::<u32>());
            let cluster = match (&redis, *shared) {
                (Some(r), true) => {
                    Some((r.url(), prefix.as_str(), args.claim_ttl, args.claim_timeout))
                }
                _ => None,
            };
            let fleet =
                start_fleet(n, *gws, cluster, tmp.path(), &model_path, &profile, rule).await?;
            let plans = workload::plan(*kind, args.shape);
            let wave = run_plans(&client, args, &profile, &fleet, label, *kind, plans).await?;
            decisions.push(mean_decision(&client, &fleet).await);
            fleet.stop().await;
            let pool: Vec<String> = (0..n).map(|i| format!("w{i}")).collect();
            summaries.push(report::summarize(
                label,
                &wave.records,
                wave.seconds,
                wave.truncated,
                &pool,
            ));
            records.extend(wave.records);
        }
        for (s, d) in summaries.iter().zip(&decisions) {
            let us = |v: Option<f64>| v.map_or("n/a".into(), |v| format!("{:.1} µs", v * 1e6));
            if d.wall.is_none() {
                continue; // a policy that decides nothing to time (round_robin, oracle)
            }
            let claims = if g > 1 {
                format!(
                    "; claims kept {} moved {} failed {}, mean claim {}; followers kept {} moved {} failed {}",
                    d.claims[0],
                    d.claims[1],
                    d.claims[2],
                    us(d.claim),
                    d.follows[0],
                    d.follows[1],
                    d.follows[2]
                )
            } else {
                String::new()
            };
            let slow = d.slow.map_or(String::new(), |(n, le)| {
                format!("; {n} over {:.2} ms CPU", le * 1e3)
            });
            println!(
                "  {}: mean route decision {} wall, {} CPU ({} tokenizing, {} placing){slow}{claims}",
                s.label,
                us(d.wall),
                us(d.cpu),
                us(d.tokenize_cpu),
                us(d.placement_cpu()),
            );
        }
        let verdicts = if g == 1 {
            fleet_verdicts(*kind, &summaries)
        } else {
            replica_verdicts(
                [&summaries[0], &summaries[1], &summaries[2]],
                [decisions[0], decisions[1], decisions[2]],
            )
        };
        let gsuffix = if g > 1 {
            format!(" x{g} gateways")
        } else {
            String::new()
        };
        println!("\n== {} (fleet sim:{n}{gsuffix})", kind.as_str());
        let dir = if g > 1 {
            args.out
                .join(format!("fleet-sim-{n}-gw{g}"))
                .join(kind.as_str())
        } else {
            args.out.join(format!("fleet-sim-{n}")).join(kind.as_str())
        };
        failed |= !report::print_and_write(&dir, &records, &summaries, &verdicts)?;
    }
    Ok(if failed {
        ExitCode::from(2)
    } else {
        ExitCode::SUCCESS
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Both transports carry every event of a small run to every replica (real simulated
    /// workers' SSE feeds, a real `redis-server`), and the replicas' CPU is a part of the
    /// process's.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn both_event_transports_deliver_every_event_to_every_replica() {
        let [sse, redis] = transport_figures(2, 2, 20, 1).await.unwrap();
        for f in [&sse, &redis] {
            assert_eq!(f.expected, 2 * 20 * 2, "{f:?}");
            assert_eq!(f.delivered, f.expected, "{f:?}");
            assert!(f.p50 > 0.0 && f.p50 <= f.p99 && f.p99 <= f.max, "{f:?}");
            assert!(f.cpu_consumers <= f.cpu_self + 0.011, "{f:?}");
        }
        assert_eq!((sse.connections, redis.connections), (4, 4));
    }
}
