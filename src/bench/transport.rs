//! The KV event transport, measured: `kvgate bench --fleet sim:N --gateways G --event-rate R`.
//!
//! Two ways for G gateway replicas to hear every one of N workers' cache events (issue #19,
//! "one prefix view"), run one after the other on the same machine with the same events:
//!
//! - `sse` (what kvgate does): each replica subscribes to each worker's `GET /v1/kv/events`
//!   (G × N HTTP connections). The workers are real simulated workers (`worker::spawn`); the
//!   bench publishes the events into their engines' real event feeds, so the wire format, the
//!   replay ring and the worker's SSE handler are the ones in production. The consumers read
//!   the stream as the gateway's supervisor does (`eventsource-stream` over `reqwest`).
//! - `redis-stream`: each worker appends its events to its own Redis Stream
//!   (`XADD <prefix>{w} MAXLEN ~ 100000 * data <envelope JSON>`, one connection per worker), and
//!   each replica reads all N streams with one blocking `XREAD BLOCK 1000 COUNT 1024 STREAMS …`
//!   per round on its own connection, resuming every stream from the last id it read.
//!
//! Every event is the `stored` envelope of `docs/kv-events.md` with `KEYS_PER_EVENT` random
//! keys (what one 64-token prefill chunk stores with blocks of 16); each worker publishes R
//! events a second for the run's seconds. A delivery's latency = the time the consumer has
//! parsed it − the time its producer published it. CPU = this process's user + system time
//! (producers, the workers' SSE handlers, consumers) plus `redis-server`'s, from
//! `/proc/<pid>/stat`, over the run. The consumers (the replicas' side: their connections,
//! reading and parsing) run on a runtime of their own, [`CONSUMER_THREADS`] threads named
//! [`CONSUMER_THREAD`], whose CPU is also given alone (`/proc/self/task/<tid>/stat` of the
//! threads of that name): what a replica pays per event it hears, apart from what the workers
//! (their SSE handlers, G copies of each event) or Redis (the fan-out) pay.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use futures::StreamExt;
use prefix_index::{BlockKey, KvEvent, KvEventEnvelope};
use worker::RunningWorker;

use super::fleet::RedisServer;

/// Keys in each published `stored` event.
pub const KEYS_PER_EVENT: usize = 4;

/// What one transport run measures (from `kvgate bench --event-rate`).
pub struct TransportRun {
    /// Workers publishing.
    pub workers: usize,
    /// Replicas consuming every worker's events.
    pub replicas: usize,
    /// Events per second per worker.
    pub rate: u64,
    /// How long each worker publishes.
    pub seconds: u64,
}

/// The figures of one transport.
#[derive(Debug)]
pub struct TransportFigures {
    pub transport: &'static str,
    /// Deliveries expected: events published × replicas.
    pub expected: u64,
    /// Deliveries seen by the consumers by the end of the drain.
    pub delivered: u64,
    /// Latency percentiles over the deliveries, seconds.
    pub p50: f64,
    pub p99: f64,
    pub max: f64,
    /// CPU seconds of this process and of `redis-server` over the run.
    pub cpu_self: f64,
    pub cpu_redis: f64,
    /// CPU seconds of the consumers' threads alone (part of `cpu_self`).
    pub cpu_consumers: f64,
    /// TCP connections the transport holds open.
    pub connections: usize,
}

impl TransportFigures {
    fn cpu_per_delivery_us(&self) -> f64 {
        (self.cpu_self + self.cpu_redis) / self.delivered.max(1) as f64 * 1e6
    }

    /// The consumers' CPU per delivery: what the replicas pay.
    fn consumer_cpu_per_delivery_us(&self) -> f64 {
        self.cpu_consumers / self.delivered.max(1) as f64 * 1e6
    }
}

/// The consumers' threads: their name (15 bytes, the most a Linux thread name keeps) and count.
pub const CONSUMER_THREAD: &str = "kvgate-consumer";
pub const CONSUMER_THREADS: usize = 2;

/// The runtime the consumers run on (see the module doc).
fn consumer_runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(CONSUMER_THREADS)
        .thread_name(CONSUMER_THREAD)
        .enable_all()
        .build()
        .context("starting the consumers' runtime")
}

/// User + system CPU seconds of this process's threads named `name`.
fn threads_cpu_seconds(name: &str) -> f64 {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return 0.0;
    };
    tasks
        .flatten()
        .filter(|t| {
            std::fs::read_to_string(t.path().join("comm")).is_ok_and(|c| c.trim_end() == name)
        })
        .map(|t| cpu_seconds(&format!("self/task/{}", t.file_name().to_string_lossy())))
        .sum()
}

/// User + system CPU seconds of process `pid` ("self" for this one), from `/proc/<pid>/stat`
/// (fields 14 and 15, in clock ticks of 1/100 s, the Linux ABI's USER_HZ).
fn cpu_seconds(pid: &str) -> f64 {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return 0.0;
    };
    // The command name (field 2) may hold spaces: count from the closing parenthesis.
    let Some(rest) = stat.rsplit_once(')').map(|(_, r)| r) else {
        return 0.0;
    };
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // `rest` starts at field 3.
    let tick = |i: usize| {
        fields
            .get(i - 3)
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    (tick(14) + tick(15)) / 100.0
}

/// Publication times of one worker's events, nanoseconds since the run's start, indexed by the
/// event's number within the run (0 = not yet published).
struct SentTimes {
    at: Vec<AtomicU64>,
}

impl SentTimes {
    fn new(events: usize) -> SentTimes {
        SentTimes {
            at: (0..events).map(|_| AtomicU64::new(0)).collect(),
        }
    }
}

/// Latencies (seconds) collected by the consumers.
type Latencies = Arc<std::sync::Mutex<Vec<f64>>>;

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

/// A `stored` event of fresh random keys, chained to `parent`.
fn event(rng: &mut impl rand::Rng, parent: Option<BlockKey>) -> KvEvent {
    let keys: Vec<BlockKey> = (0..KEYS_PER_EVENT).map(|_| BlockKey(rng.gen())).collect();
    KvEvent::Stored { parent, keys }
}

/// Publishes `per_worker` events at `rate` a second from each worker, through `publish(w, i,
/// event)`, recording each one's time in `sent[w][i]` just before.
async fn produce<F, Fut>(
    workers: usize,
    rate: u64,
    per_worker: usize,
    start: Instant,
    sent: Arc<Vec<SentTimes>>,
    publish: F,
) -> anyhow::Result<()>
where
    F: Fn(usize, usize, KvEvent) -> Fut + Clone + Send + 'static,
    Fut: std::future::Future<Output = anyhow::Result<()>> + Send,
{
    let period = Duration::from_secs_f64(1.0 / rate.max(1) as f64);
    let mut tasks = tokio::task::JoinSet::new();
    for w in 0..workers {
        let (sent, publish) = (sent.clone(), publish.clone());
        // Workers start spread over one period, as independent engines would.
        let offset = period.mul_f64(w as f64 / workers as f64);
        tasks.spawn(async move {
            let mut rng = <rand_chacha::ChaCha8Rng as rand::SeedableRng>::seed_from_u64(w as u64);
            let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + offset, period);
            let mut parent = None;
            for i in 0..per_worker {
                tick.tick().await;
                let e = event(&mut rng, parent);
                if let KvEvent::Stored { keys, .. } = &e {
                    parent = keys.last().copied();
                }
                let now = start.elapsed().as_nanos().max(1) as u64;
                sent[w].at[i].store(now, Ordering::Release);
                publish(w, i, e).await?;
            }
            anyhow::Ok(())
        });
    }
    while let Some(r) = tasks.join_next().await {
        r??;
    }
    Ok(())
}

/// Records the latency of delivery `(w, i)` if it was one of the run's events.
fn record(sent: &[SentTimes], start: Instant, w: usize, i: usize, into: &Latencies) {
    let Some(at) = sent.get(w).and_then(|s| s.at.get(i)) else {
        return;
    };
    let at = at.load(Ordering::Acquire);
    if at > 0 {
        let now = start.elapsed().as_nanos() as u64;
        let l = now.saturating_sub(at) as f64 / 1e9;
        into.lock().unwrap_or_else(|e| e.into_inner()).push(l);
    }
}

/// Waits until the consumers' deliveries reach `expected` or `drain` passes after the last
/// publication.
async fn drain(delivered: &AtomicU64, expected: u64, drain: Duration) {
    let deadline = tokio::time::Instant::now() + drain;
    while delivered.load(Ordering::Relaxed) < expected && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn figures(
    transport: &'static str,
    expected: u64,
    delivered: u64,
    lat: &Latencies,
    cpu: (f64, f64, f64),
    connections: usize,
) -> TransportFigures {
    let mut l = std::mem::take(&mut *lat.lock().unwrap_or_else(|e| e.into_inner()));
    l.sort_by(f64::total_cmp);
    TransportFigures {
        transport,
        expected,
        delivered,
        p50: percentile(&l, 0.5),
        p99: percentile(&l, 0.99),
        max: l.last().copied().unwrap_or(f64::NAN),
        cpu_self: cpu.0,
        cpu_redis: cpu.1,
        cpu_consumers: cpu.2,
        connections,
    }
}

/// Today's transport: G replicas × N SSE subscriptions to real workers.
async fn run_sse(
    args: &TransportRun,
    workers: &[RunningWorker],
) -> anyhow::Result<TransportFigures> {
    let per_worker = (args.rate * args.seconds) as usize;
    let sent: Arc<Vec<SentTimes>> = Arc::new(
        (0..workers.len())
            .map(|_| SentTimes::new(per_worker))
            .collect(),
    );
    let lat: Latencies = Arc::default();
    let delivered = Arc::new(AtomicU64::new(0));
    let connected = Arc::new(AtomicU64::new(0));
    let start = Instant::now();
    // Each worker's feed: the run's events are the ones after its current last sequence number.
    let bases: Vec<u64> = workers
        .iter()
        .map(|w| w.engine().kv_events().last_seq())
        .collect();
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(args.replicas)
        .build()?;
    let rt = consumer_runtime()?;
    let mut consumers = tokio::task::JoinSet::new();
    for _ in 0..args.replicas {
        for (w, worker) in workers.iter().enumerate() {
            let url = format!("http://{}/v1/kv/events", worker.addr());
            let (client, sent, lat, delivered, connected) = (
                client.clone(),
                sent.clone(),
                lat.clone(),
                delivered.clone(),
                connected.clone(),
            );
            let base = bases[w];
            let consumer = async move {
                let resp = client.get(&url).send().await?.error_for_status()?;
                connected.fetch_add(1, Ordering::Relaxed);
                let mut events = eventsource_stream::Eventsource::eventsource(resp.bytes_stream());
                while let Some(ev) = events.next().await {
                    let ev = ev.map_err(|e| anyhow::anyhow!("{e}"))?;
                    let Ok(env) = serde_json::from_str::<KvEventEnvelope>(&ev.data) else {
                        continue;
                    };
                    if env.seq > base {
                        record(&sent, start, w, (env.seq - base - 1) as usize, &lat);
                        delivered.fetch_add(1, Ordering::Relaxed);
                    }
                }
                anyhow::Ok(())
            };
            consumers.spawn_on(consumer, rt.handle());
        }
    }
    let all = (args.replicas * workers.len()) as u64;
    let deadline = Instant::now() + Duration::from_secs(30);
    while connected.load(Ordering::Relaxed) < all {
        if Instant::now() > deadline {
            anyhow::bail!("SSE subscriptions not all open in 30 s");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Let the snapshots (a `cleared` envelope per subscription) pass.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let (cpu0, consumers0) = (cpu_seconds("self"), threads_cpu_seconds(CONSUMER_THREAD));
    let feeds: Arc<Vec<engine::kv::KvEventFeed>> =
        Arc::new(workers.iter().map(|w| w.engine().kv_events()).collect());
    produce(workers.len(), args.rate, per_worker, start, sent.clone(), {
        let feeds = feeds.clone();
        move |w, _i, e| {
            let feeds = feeds.clone();
            async move {
                feeds[w].publish(vec![e]);
                Ok(())
            }
        }
    })
    .await?;
    let expected = (per_worker * workers.len() * args.replicas) as u64;
    drain(&delivered, expected, Duration::from_secs(5)).await;
    let cpu = (
        cpu_seconds("self") - cpu0,
        0.0,
        threads_cpu_seconds(CONSUMER_THREAD) - consumers0,
    );
    consumers.abort_all();
    while consumers.join_next().await.is_some() {}
    rt.shutdown_background();
    Ok(figures(
        "sse",
        expected,
        delivered.load(Ordering::Relaxed),
        &lat,
        cpu,
        args.replicas * workers.len(),
    ))
}

/// Entries of an `XREAD` reply (RESP2: `[[stream, [[id, [field, value, …]], …]], …]`) as
/// (stream, id, `data` field).
fn xread_entries(reply: &redis::Value) -> Vec<(String, String, String)> {
    use redis::Value;
    let text = |v: &Value| match v {
        Value::BulkString(b) => String::from_utf8_lossy(b).into_owned(),
        Value::SimpleString(s) => s.clone(),
        _ => String::new(),
    };
    let mut out = Vec::new();
    let Value::Array(streams) = reply else {
        return out;
    };
    for s in streams {
        let Value::Array(pair) = s else { continue };
        let (Some(name), Some(Value::Array(entries))) = (pair.first(), pair.get(1)) else {
            continue;
        };
        let name = text(name);
        for e in entries {
            let Value::Array(e) = e else { continue };
            let (Some(id), Some(Value::Array(fields))) = (e.first(), e.get(1)) else {
                continue;
            };
            let data = fields
                .chunks(2)
                .find(|kv| kv.first().map(text).as_deref() == Some("data"))
                .and_then(|kv| kv.get(1))
                .map(text)
                .unwrap_or_default();
            out.push((name.clone(), text(id), data));
        }
    }
    out
}

/// The alternative: one Redis Stream per worker, read by every replica with resume by id.
async fn run_redis(args: &TransportRun) -> anyhow::Result<TransportFigures> {
    let redis = RedisServer::start()?;
    let pid = redis.pid().to_string();
    let client = redis::Client::open(redis.url())?;
    let prefix = "bench:events:";
    let per_worker = (args.rate * args.seconds) as usize;
    let n = args.workers;
    let sent: Arc<Vec<SentTimes>> = Arc::new((0..n).map(|_| SentTimes::new(per_worker)).collect());
    let lat: Latencies = Arc::default();
    let delivered = Arc::new(AtomicU64::new(0));
    let start = Instant::now();
    let rt = consumer_runtime()?;
    let mut consumers = tokio::task::JoinSet::new();
    for _ in 0..args.replicas {
        let (sent, lat, delivered) = (sent.clone(), lat.clone(), delivered.clone());
        let client = client.clone();
        let consumer = async move {
            // Connected here, so that its I/O runs on the consumers' runtime.
            let mut con = client
                .get_multiplexed_async_connection()
                .await
                .context("connecting to redis-server")?;
            // Every stream from its beginning ("0"), then from the last id read.
            let mut ids: Vec<String> = vec!["0".into(); n];
            loop {
                let mut cmd = redis::cmd("XREAD");
                cmd.arg("BLOCK")
                    .arg(1000)
                    .arg("COUNT")
                    .arg(1024)
                    .arg("STREAMS");
                for w in 0..n {
                    cmd.arg(format!("{prefix}{w}"));
                }
                for id in &ids {
                    cmd.arg(id);
                }
                let reply: redis::Value = cmd.query_async(&mut con).await?;
                for (stream, id, data) in xread_entries(&reply) {
                    let Some(w) = stream
                        .strip_prefix(prefix)
                        .and_then(|w| w.parse::<usize>().ok())
                        .filter(|&w| w < n)
                    else {
                        continue;
                    };
                    ids[w] = id;
                    if let Ok(env) = serde_json::from_str::<KvEventEnvelope>(&data) {
                        record(&sent, start, w, env.seq.saturating_sub(1) as usize, &lat);
                        delivered.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
            #[allow(unreachable_code)]
            anyhow::Ok(())
        };
        consumers.spawn_on(consumer, rt.handle());
    }
    let mut producers = Vec::with_capacity(n);
    for _ in 0..n {
        producers.push(client.get_multiplexed_async_connection().await?);
    }
    let producers = Arc::new(producers);
    tokio::time::sleep(Duration::from_millis(200)).await;
    let (cpu0, redis0, consumers0) = (
        cpu_seconds("self"),
        cpu_seconds(&pid),
        threads_cpu_seconds(CONSUMER_THREAD),
    );
    produce(n, args.rate, per_worker, start, sent.clone(), {
        let producers = producers.clone();
        move |w, i, e| {
            let mut con = producers[w].clone();
            async move {
                let env = KvEventEnvelope {
                    epoch: 1,
                    seq: i as u64 + 1,
                    event: e,
                };
                let data = serde_json::to_string(&env)?;
                let _: String = redis::cmd("XADD")
                    .arg(format!("{prefix}{w}"))
                    .arg("MAXLEN")
                    .arg("~")
                    .arg(100_000)
                    .arg("*")
                    .arg("data")
                    .arg(data)
                    .query_async(&mut con)
                    .await?;
                Ok(())
            }
        }
    })
    .await?;
    let expected = (per_worker * n * args.replicas) as u64;
    drain(&delivered, expected, Duration::from_secs(5)).await;
    let cpu = (
        cpu_seconds("self") - cpu0,
        cpu_seconds(&pid) - redis0,
        threads_cpu_seconds(CONSUMER_THREAD) - consumers0,
    );
    consumers.abort_all();
    while consumers.join_next().await.is_some() {}
    rt.shutdown_background();
    Ok(figures(
        "redis-stream",
        expected,
        delivered.load(Ordering::Relaxed),
        &lat,
        cpu,
        args.replicas + n,
    ))
}

/// Runs both transports (SSE first, on `workers`), prints one table and gives both figures.
pub async fn run(
    args: &TransportRun,
    workers: &[RunningWorker],
) -> anyhow::Result<[TransportFigures; 2]> {
    println!(
        "KV event transport: {} workers × {} events/s × {} s ({} keys each), {} replicas",
        args.workers, args.rate, args.seconds, KEYS_PER_EVENT, args.replicas
    );
    let sse = run_sse(args, workers).await?;
    let redis = run_redis(args).await?;
    println!(
        "{:<13} {:>10} {:>10} {:>9} {:>9} {:>9} {:>9} {:>9} {:>12} {:>9} {:>12} {:>6}",
        "transport",
        "delivered",
        "expected",
        "p50_ms",
        "p99_ms",
        "max_ms",
        "cpu_s",
        "redis_s",
        "cpu_us/dlv",
        "consum_s",
        "consum_us/dlv",
        "conns"
    );
    for f in [&sse, &redis] {
        println!(
            "{:<13} {:>10} {:>10} {:>9.3} {:>9.3} {:>9.3} {:>9.2} {:>9.2} {:>12.1} {:>9.2} {:>12.1} {:>6}",
            f.transport,
            f.delivered,
            f.expected,
            f.p50 * 1e3,
            f.p99 * 1e3,
            f.max * 1e3,
            f.cpu_self,
            f.cpu_redis,
            f.cpu_per_delivery_us(),
            f.cpu_consumers,
            f.consumer_cpu_per_delivery_us(),
            f.connections
        );
    }
    println!(
        "  ratios redis-stream / sse: p50 {:.2}, p99 {:.2}, CPU per delivery {:.2}, consumers' CPU per delivery {:.2}",
        redis.p50 / sse.p50,
        redis.p99 / sse.p99,
        redis.cpu_per_delivery_us() / sse.cpu_per_delivery_us(),
        redis.consumer_cpu_per_delivery_us() / sse.consumer_cpu_per_delivery_us()
    );
    Ok([sse, redis])
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The CPU of threads of one name is theirs alone: a thread that spins shows; a name no
    /// thread has shows nothing.
    #[test]
    fn threads_are_counted_by_name() {
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let spinning = stop.clone();
        let t = std::thread::Builder::new()
            .name("kvgate-cputest".into())
            .spawn(move || {
                let mut x = 0u64;
                while !spinning.load(Ordering::Relaxed) {
                    x = std::hint::black_box(x.wrapping_mul(31).wrapping_add(7));
                }
                x
            })
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        while threads_cpu_seconds("kvgate-cputest") < 0.05 {
            assert!(
                Instant::now() < deadline,
                "a spinning thread's CPU never showed"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        stop.store(true, Ordering::Relaxed);
        t.join().unwrap();
        assert_eq!(threads_cpu_seconds("kvgate-no-such"), 0.0);
    }
}
