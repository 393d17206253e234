//! `kvgate bench`: load generator (`--target URL`), fleet simulation (`--fleet sim:N`).
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{bail, Context};

use crate::bench::report;
use crate::bench::workload::{self, WorkloadKind, WorkloadShape};
use crate::bench::{run_wave, WaveSpec};

#[derive(clap::Args)]
pub struct Args {
    /// Base URL of an OpenAI-compatible endpoint (a kvgate gateway or worker, or any other
    /// server); several, comma-separated (e.g. independent gateways in front of one fleet), get
    /// the requests spread over them as --vip says.
    #[arg(long, conflicts_with = "fleet")]
    pub target: Option<String>,
    /// Simulated fleet: `sim:N` starts N simulated workers and a gateway in-process and runs the
    /// workload under round_robin, kv_exact and an oracle.
    #[arg(long, conflicts_with = "engine_model")]
    pub fleet: Option<String>,
    /// With --fleet: gateway replicas. G > 1 compares kv_exact behind one gateway with kv_exact
    /// behind G replicas in cluster mode (a redis-server the bench starts), requests spread
    /// over the replicas as --vip says.
    #[arg(long, default_value_t = 1)]
    pub gateways: usize,
    /// With --gateways G > 1 (or several --target URLs): how the VIP spreads requests over the
    /// replicas: `request` (each request to the next replica) or `session` (each conversation
    /// or session pinned to the replica its first request went to, as an L4 VIP does with
    /// kept-alive connections).
    #[arg(long, value_enum, default_value_t = crate::bench::Spread::Request)]
    pub vip: crate::bench::Spread,
    /// With --gateways G > 1: the replicas' claim TTL in ms (the atomic select-and-reserve of
    /// cold placements, docs/cluster.md "Claims"); 0 turns claims off.
    #[arg(long, default_value_t = 10)]
    pub cluster_claim_ms: u64,
    /// With --gateways G > 1: how long a decision waits for its claim, ms.
    #[arg(long, default_value_t = 25)]
    pub cluster_claim_timeout_ms: u64,
    /// With --fleet: instead of a workload, compare the KV event transports (SSE from every
    /// worker to every replica vs one Redis Stream per worker) at this many events a second
    /// per worker, to the --gateways replicas.
    #[arg(long)]
    pub event_rate: Option<u64>,
    /// With --event-rate: how long each worker publishes, seconds.
    #[arg(long, default_value_t = 5)]
    pub event_seconds: u64,
    /// With --fleet and one gateway: the policies to run, in order (default: all of
    /// round_robin, kv_exact, kv_longest, kv_in_flight, oracle).
    #[arg(long, value_delimiter = ',')]
    pub policies: Vec<String>,
    /// Engine benchmark on a GGUF model (no HTTP): single-stream prefill and decode tok/s,
    /// aggregate decode at 1/4/8/16 streams, cached vs uncached prefill of a 1,040-token prompt.
    #[arg(long, conflicts_with = "target")]
    pub engine_model: Option<PathBuf>,
    /// Compute threads of the engine benchmark (0 = candle's default).
    #[arg(long, default_value_t = 1)]
    pub engine_threads: usize,
    /// The engine benchmark's arithmetic (as `kvgate worker --numerics`; default `exact`).
    #[arg(long, value_enum, default_value_t = crate::cmd::worker::Numerics::Exact)]
    pub engine_numerics: crate::cmd::worker::Numerics,
    /// Workloads to run, in order.
    #[arg(long, value_enum, value_delimiter = ',', default_value = "multi-turn")]
    pub workload: Vec<WorkloadKind>,
    #[command(flatten)]
    pub shape: WorkloadShape,
    /// `model` field sent in each request.
    #[arg(long, default_value = "SmolLM2-135M-Instruct")]
    pub model: String,
    /// Sessions in flight at once.
    #[arg(long, default_value_t = 4)]
    pub concurrency: usize,
    /// Bound on each wave, seconds.
    #[arg(long, default_value_t = 300)]
    pub max_seconds: u64,
    /// Per-request timeout, seconds.
    #[arg(long, default_value_t = 120)]
    pub request_timeout: u64,
    /// Label of this run in the outputs (with --target).
    #[arg(long, default_value = "target")]
    pub label: String,
    /// With --target: run the workload once per `LABEL=MODEL` pair (e.g. a gateway's services
    /// `round_robin=smollm2-rr,kv_exact=smollm2`) and compare them in one report; the labels
    /// `round_robin` / `kv_exact` / `oracle` get the fleet targets as verdicts.
    #[arg(long, value_delimiter = ',')]
    pub compare: Vec<String>,
    /// Declared thresholds, e.g. `ttft_p50<=0.5`, `hit_rate>=0.3` (with --target).
    #[arg(long = "threshold")]
    pub thresholds: Vec<String>,
    /// With --target: every worker id of the pool behind it (`w1,w2,...`, as in
    /// `x-kvgate-worker`), so that idle workers count in the share figures; without it only the
    /// workers that served something are known.
    #[arg(long, value_delimiter = ',')]
    pub pool: Vec<String>,
    /// With --target: open a new connection for every request instead of reusing idle
    /// keep-alive connections (for servers that close them under the client: against
    /// llama-server's cpp-httplib, reused connections failed some sends before any response).
    #[arg(long)]
    pub fresh_connections: bool,
    /// Output folder: records.jsonl, records.csv, summary.json, ttft.svg per workload.
    #[arg(long, default_value = "bench-out")]
    pub out: PathBuf,
    /// With --fleet: keep transparent huge pages for the process (its gateways and simulated
    /// workers). By default they are off, as `kvgate gateway` runs (docs/gateway.md, "Memory").
    #[arg(long)]
    pub transparent_huge_pages: bool,
}

pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    if let Some(model) = &args.engine_model {
        let mut cfg = engine::model::bench::EngineBenchConfig::new(model, args.engine_threads);
        cfg.format = args.engine_numerics.weight_format();
        let report = engine::model::bench::run(&cfg)
            .with_context(|| format!("engine benchmark on {}", model.display()))?;
        println!("{report}");
        return Ok(ExitCode::SUCCESS);
    }
    if args.fleet.is_some() {
        let choice = crate::memory::HugePages::from_flag(args.transparent_huge_pages);
        let in_effect = crate::memory::apply(choice);
        println!("transparent huge pages: {in_effect:?}");
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    rt.block_on(async move {
        if let Some(fleet) = &args.fleet {
            let n: usize = fleet
                .strip_prefix("sim:")
                .and_then(|n| n.parse().ok())
                .filter(|n| *n > 0)
                .with_context(|| format!("--fleet `{fleet}`: expected sim:N with N > 0"))?;
            if let Some(rate) = args.event_rate {
                if rate == 0 || args.event_seconds == 0 {
                    bail!("--event-rate and --event-seconds must be > 0");
                }
                return crate::bench::fleet::run_transport(
                    n,
                    args.gateways,
                    rate,
                    args.event_seconds,
                )
                .await;
            }
            let run = crate::bench::fleet::FleetRun {
                workload: &args.workload,
                shape: &args.shape,
                model: &args.model,
                concurrency: args.concurrency,
                max_seconds: args.max_seconds,
                request_timeout: args.request_timeout,
                out: &args.out,
                gateways: args.gateways,
                vip: args.vip,
                policies: &args.policies,
                claim_ttl: std::time::Duration::from_millis(args.cluster_claim_ms),
                claim_timeout: std::time::Duration::from_millis(
                    args.cluster_claim_timeout_ms.max(1),
                ),
            };
            return crate::bench::fleet::run(n, &run).await;
        }
        let Some(target) = args.target.clone() else {
            bail!("give --target URL or --fleet sim:N");
        };
        let targets: Vec<String> = target
            .split(',')
            .map(|t| t.trim().trim_end_matches('/').to_string())
            .filter(|t| !t.is_empty())
            .collect();
        let Some(first) = targets.first().cloned() else {
            bail!("--target: no URL in `{target}`");
        };
        let thresholds: Vec<_> = args
            .thresholds
            .iter()
            .map(|t| report::parse_threshold(t).map_err(anyhow::Error::msg))
            .collect::<Result<_, _>>()?;
        let mut builder = reqwest::Client::builder();
        if args.fresh_connections {
            builder = builder.pool_max_idle_per_host(0);
        }
        let client = builder.build()?;
        let context_limit = crate::bench::client::context_limit(&client, &first).await;
        let runs: Vec<(String, String)> = if args.compare.is_empty() {
            vec![(args.label.clone(), args.model.clone())]
        } else {
            args.compare
                .iter()
                .map(|p| {
                    p.split_once('=')
                        .map(|(l, m)| (l.to_string(), m.to_string()))
                        .with_context(|| format!("--compare `{p}`: expected LABEL=MODEL"))
                })
                .collect::<Result<_, _>>()?
        };
        let mut failed = false;
        for kind in &args.workload {
            let mut summaries = Vec::new();
            let mut records = Vec::new();
            for (label, model) in &runs {
                let wave = run_wave(
                    &client,
                    WaveSpec {
                        label,
                        targets: &targets,
                        spread: args.vip,
                        model,
                        kind: *kind,
                        plans: workload::plan(*kind, &args.shape),
                        concurrency: args.concurrency,
                        max_duration: Duration::from_secs(args.max_seconds),
                        request_timeout: Duration::from_secs(args.request_timeout),
                        context_limit,
                    },
                )
                .await;
                summaries.push(report::summarize(
                    label,
                    &wave.records,
                    wave.seconds,
                    wave.truncated,
                    &args.pool,
                ));
                records.extend(wave.records);
            }
            let mut verdicts = crate::bench::fleet::fleet_verdicts(*kind, &summaries);
            for s in &summaries {
                for (name, le, limit) in &thresholds {
                    let v = report::metric(name, s).ok().flatten();
                    let op = if *le { "<=" } else { ">=" };
                    verdicts.push(report::judge(
                        format!("{}: {name}{op}{limit}", s.label),
                        v,
                        *le,
                        *limit,
                        &[s],
                    ));
                }
            }
            println!("== {} against {target}", kind.as_str());
            let dir = args.out.join(kind.as_str());
            failed |= !report::print_and_write(&dir, &records, &summaries, &verdicts)?;
        }
        Ok(if failed {
            ExitCode::from(2)
        } else {
            ExitCode::SUCCESS
        })
    })
}
