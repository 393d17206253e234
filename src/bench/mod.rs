//! `kvgate bench`: a load generator for any OpenAI-compatible endpoint (a gateway or a worker),
//! the fleet simulation (`--fleet sim:N`: simulated workers + a gateway in-process, run under
//! round-robin, kv_exact and an oracle), and the engine benchmark (`--engine-model PATH`).

pub mod client;
pub mod fleet;
pub mod report;
pub mod transport;
pub mod workload;

use std::io::IsTerminal;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use client::{ChatCall, RequestRecord};
use workload::{SessionPlan, WorkloadKind};

/// How a VIP in front of several targets (gateway replicas) spreads a wave's requests.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Spread {
    /// Each request to the next target in turn (an L7 balancer, or an L4 VIP in front of
    /// clients that open a connection per request).
    #[default]
    Request,
    /// Each session to the next target in turn, all its turns to that one (an L4 VIP in
    /// front of clients that keep their connection alive, or a balancer hashing a session
    /// key).
    Session,
}

impl Spread {
    pub fn as_str(self) -> &'static str {
        match self {
            Spread::Request => "request",
            Spread::Session => "session",
        }
    }
}

/// How one wave is run.
pub struct WaveSpec<'a> {
    pub label: &'a str,
    /// Base URLs; requests are spread over them as `spread` says, as a VIP spreads them over
    /// gateway replicas (one target: all go there).
    pub targets: &'a [String],
    pub spread: Spread,
    pub model: &'a str,
    pub kind: WorkloadKind,
    pub plans: Vec<SessionPlan>,
    /// Sessions in flight at once.
    pub concurrency: usize,
    /// Bound on the whole wave; sessions not finished by then stop (the run is marked truncated).
    pub max_duration: Duration,
    pub request_timeout: Duration,
    pub context_limit: Option<u64>,
}

/// The result of one wave.
pub struct Wave {
    pub records: Vec<RequestRecord>,
    pub seconds: f64,
    pub truncated: bool,
}

/// Run every session of a plan against `target`, `concurrency` sessions at a time.
pub async fn run_wave(client: &reqwest::Client, spec: WaveSpec<'_>) -> Wave {
    let total: usize = spec.plans.iter().map(|p| p.user_turns.len()).sum();
    let done = Arc::new(AtomicUsize::new(0));
    let sem = Arc::new(tokio::sync::Semaphore::new(spec.concurrency.max(1)));
    let t0 = Instant::now();
    let deadline = t0 + spec.max_duration;
    let progress = if std::io::stderr().is_terminal() {
        let done = done.clone();
        let label = spec.label.to_string();
        Some(tokio::spawn(async move {
            loop {
                let d = done.load(Ordering::Relaxed);
                let width = 30;
                let filled = (d * width) / total.max(1);
                eprint!(
                    "\r{label:<10} [{}{}] {d}/{total} requests {:.1}s",
                    "=".repeat(filled),
                    " ".repeat(width - filled),
                    t0.elapsed().as_secs_f64()
                );
                if d >= total {
                    eprintln!();
                    break;
                }
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
        }))
    } else {
        None
    };
    let mut tasks = tokio::task::JoinSet::new();
    let next_target = Arc::new(AtomicUsize::new(0));
    let targets: Arc<Vec<String>> = Arc::new(spec.targets.to_vec());
    for plan in spec.plans {
        let client = client.clone();
        let sem = sem.clone();
        let done = done.clone();
        let targets = targets.clone();
        let next_target = next_target.clone();
        let model = spec.model.to_string();
        let label = spec.label.to_string();
        let workload = spec.kind.as_str().to_string();
        let timeout = spec.request_timeout;
        let context_limit = spec.context_limit;
        let spread = spec.spread;
        // Sessions that start at once take their permits here, in the plan's order, so that
        // the seed fixes which sessions are in flight together and which one starts when a
        // permit frees: tasks racing for the semaphore made that the runtime's choice, and two
        // runs with one seed sent a different first wave (kv_exact, 4 workers, shared-prefix:
        // 200 and 254 output tok/s from one seed and router). A delayed session (the fairness
        // probe) queues for its permit when its delay is over.
        let permit = if plan.start_delay.is_zero() {
            match sem.clone().acquire_owned().await {
                Ok(p) => Some(p),
                Err(_) => break,
            }
        } else {
            None
        };
        tasks.spawn(async move {
            let _permit = match permit {
                Some(p) => p,
                None => {
                    tokio::time::sleep(plan.start_delay).await;
                    let Ok(p) = sem.acquire_owned().await else {
                        return Vec::new();
                    };
                    p
                }
            };
            let mut messages: Vec<Value> = Vec::new();
            if let Some(s) = &plan.system {
                messages.push(json!({"role": "system", "content": s}));
            }
            let mut out = Vec::new();
            // Spread::Session: the target the session's first request went to.
            let mut pinned: Option<usize> = None;
            for (turn, user) in plan.user_turns.iter().enumerate() {
                // The user's think time (part of the workload's arrival pattern, not a wait for
                // an event).
                if let Some(t) = plan.think.get(turn).filter(|t| !t.is_zero()) {
                    tokio::time::sleep(*t).await;
                }
                if Instant::now() >= deadline {
                    break;
                }
                messages.push(json!({"role": "user", "content": user}));
                let mut rec = RequestRecord {
                    label: label.clone(),
                    workload: workload.clone(),
                    session: plan.id.clone(),
                    class: plan.class.to_string(),
                    turn,
                    request_id: String::new(),
                    context_limit,
                    actual_prompt_tokens: None,
                    requested_output_tokens: plan.max_tokens,
                    actual_output_tokens: None,
                    finish_reason: None,
                    cached_tokens: None,
                    ttft_seconds: None,
                    inter_token_latencies: Vec::new(),
                    e2e_seconds: 0.0,
                    started_at: t0.elapsed().as_secs_f64(),
                    status: 0,
                    worker: None,
                    error: None,
                    answer: String::new(),
                };
                let remaining = deadline.saturating_duration_since(Instant::now());
                let next = || next_target.fetch_add(1, Ordering::Relaxed) % targets.len().max(1);
                let i = match spread {
                    Spread::Request => next(),
                    Spread::Session => *pinned.get_or_insert_with(next),
                };
                let target = targets.get(i).cloned().unwrap_or_default();
                let call = ChatCall {
                    base_url: &target,
                    model: &model,
                    messages: &messages,
                    max_tokens: plan.max_tokens,
                    request_id: format!("{label}-{}-t{turn}-{}", plan.id, rand::random::<u32>()),
                    timeout: timeout.min(remaining.max(Duration::from_millis(1))),
                };
                client::chat(&client, call, &mut rec).await;
                let ok = rec.ok();
                // Replay the answer exactly into the next turn's history.
                messages.push(json!({"role": "assistant", "content": rec.answer}));
                out.push(rec);
                done.fetch_add(1, Ordering::Relaxed);
                if !ok {
                    break;
                }
            }
            out
        });
    }
    let mut records = Vec::new();
    while let Some(r) = tasks.join_next().await {
        if let Ok(mut recs) = r {
            records.append(&mut recs);
        }
    }
    let seconds = t0.elapsed().as_secs_f64();
    if let Some(p) = progress {
        done.store(total, Ordering::Relaxed);
        let _ = p.await;
    }
    let truncated = Instant::now() >= deadline && records.len() < total;
    records.sort_by(|a, b| a.started_at.total_cmp(&b.started_at));
    Wave {
        records,
        seconds,
        truncated,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Sessions that start at once begin in the plan's order, whatever the runtime's threads
    /// do: with 2 in flight, the i-th session to start is the plan's i-th give or take its
    /// partner in the pair. (Before, tasks raced for the semaphore and one seed gave different
    /// first waves from run to run.)
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn sessions_start_in_plan_order() {
        use axum::routing::post;
        let app = axum::Router::new().route(
            "/v1/chat/completions",
            post(|| async {
                tokio::time::sleep(Duration::from_millis(3)).await;
                (axum::http::StatusCode::SERVICE_UNAVAILABLE, "busy")
            }),
        );
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let server = tokio::spawn(async move { axum::serve(l, app).await });
        let n = 40;
        let plans = (0..n)
            .map(|i| SessionPlan {
                id: format!("s{i}"),
                class: "question",
                system: None,
                user_turns: vec!["q".into()],
                start_delay: Duration::ZERO,
                think: vec![Duration::ZERO],
                max_tokens: 1,
            })
            .collect();
        let wave = run_wave(
            &reqwest::Client::new(),
            WaveSpec {
                label: "order",
                targets: &[format!("http://{addr}")],
                spread: Spread::Request,
                model: "m",
                kind: WorkloadKind::SharedPrefix,
                plans,
                concurrency: 2,
                max_duration: Duration::from_secs(30),
                request_timeout: Duration::from_secs(5),
                context_limit: None,
            },
        )
        .await;
        server.abort();
        assert_eq!(wave.records.len(), n);
        // Records come sorted by start time.
        for (pos, r) in wave.records.iter().enumerate() {
            let i: usize = r.session[1..].parse().unwrap();
            assert!(
                i.abs_diff(pos) <= 1,
                "session {} started {pos}th: {:?}",
                r.session,
                wave.records.iter().map(|r| &r.session).collect::<Vec<_>>()
            );
        }
    }

    /// `--vip session` keeps every turn of a session on the target its first request went to,
    /// the sessions taking the targets in turn; `--vip request` sends each request to the next.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn spread_by_request_or_by_session() {
        use axum::routing::post;
        let mut targets = Vec::new();
        let mut servers = Vec::new();
        for name in ["a", "b", "c"] {
            let app = axum::Router::new().route(
                "/v1/chat/completions",
                post(move || async move {
                    (
                        [
                            ("x-kvgate-worker-id", name),
                            ("content-type", "text/event-stream"),
                        ],
                        "data: {\"choices\":[{\"delta\":{\"content\":\"x\"},\"finish_reason\":\"stop\"}]}\n\n\
                         data: [DONE]\n\n",
                    )
                }),
            );
            let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            targets.push(format!("http://{}", l.local_addr().unwrap()));
            servers.push(tokio::spawn(async move { axum::serve(l, app).await }));
        }
        let plans = || -> Vec<SessionPlan> {
            (0..6)
                .map(|i| SessionPlan {
                    id: format!("s{i}"),
                    class: "conversation",
                    system: None,
                    user_turns: vec!["q".into(); 4],
                    start_delay: Duration::ZERO,
                    think: vec![Duration::ZERO; 4],
                    max_tokens: 1,
                })
                .collect()
        };
        let mut by_spread = Vec::new();
        for spread in [Spread::Session, Spread::Request] {
            let wave = run_wave(
                &reqwest::Client::new(),
                WaveSpec {
                    label: spread.as_str(),
                    targets: &targets,
                    spread,
                    model: "m",
                    kind: WorkloadKind::MultiTurn,
                    plans: plans(),
                    concurrency: 1,
                    max_duration: Duration::from_secs(30),
                    request_timeout: Duration::from_secs(5),
                    context_limit: None,
                },
            )
            .await;
            assert_eq!(wave.records.len(), 24, "{spread:?}");
            assert!(wave.records.iter().all(|r| r.ok()), "{spread:?}");
            let mut per_session = std::collections::BTreeMap::<String, Vec<String>>::new();
            for r in &wave.records {
                per_session
                    .entry(r.session.clone())
                    .or_default()
                    .push(r.worker.clone().unwrap_or_default());
            }
            by_spread.push(per_session);
        }
        for s in &servers {
            s.abort();
        }
        // One session at a time: s0 → a, s1 → b, s2 → c, s3 → a, ...
        let names = ["a", "b", "c"];
        for (i, (session, workers)) in by_spread[0].iter().enumerate() {
            assert_eq!(session, &format!("s{i}"));
            assert_eq!(workers, &vec![names[i % 3].to_string(); 4], "{session}");
        }
        // Each request to the next target: a session's 4 turns visit all three.
        for (session, workers) in &by_spread[1] {
            let mut distinct = workers.clone();
            distinct.sort();
            distinct.dedup();
            assert_eq!(distinct.len(), 3, "{session}: {workers:?}");
        }
    }
}
