//! vLLM's KV events, for KV-exact routing over vLLM engines (`kvgate sidecar --kind vllm
//! --kv-events tcp://…`, docs/sidecar.md).
//!
//! vLLM started with `--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq",
//! "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}'` publishes every change to
//! its prefix cache on a ZMQ PUB socket: multipart messages `[topic, seq (8 bytes, big
//! endian), payload]`, the payload a msgpack batch ([`wire`]); a ROUTER socket answers a
//! request `["", start seq]` with every buffered message from `start` on, then `seq = -1`.
//!
//! The subscriber task ([`run`]) reads them in order, maps them to kvgate block keys
//! ([`mapping`]) and publishes the result in a [`KvEventFeed`] — the feed a kvgate worker's
//! engine publishes in — which the sidecar serves as `GET /v1/kv/events`
//! (docs/kv-events.md), so a gateway subscribes to it as to a kvgate worker.
//!
//! Order and gaps: a message whose seq follows the last one is applied; an older one is a
//! repeat and skipped; a gap is filled from the replay socket, and when it cannot be (no
//! replay endpoint, the buffer no longer holds it, no answer within 5 s) the feed says
//! `cleared` and the mapping starts over, so the gateway never keeps a key the engine may have
//! dropped. After a disconnection (the engine restarted, or the network) likewise: `cleared`,
//! then everything the replay buffer holds is applied from seq 0.

pub mod mapping;
pub mod wire;

use std::sync::atomic::{AtomicI64, AtomicU64};
use std::time::Duration;

use engine::kv::events::KvEventFeed;
use prefix_index::{BlockSize, KvEvent};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use tokio_util::sync::CancellationToken;
use zeromq::{Socket, SocketEvent, SocketRecv, SocketSend, ZmqMessage};

use mapping::{Applied, EngineCacheMap};

/// Where and how to read the engine's KV events.
#[derive(Clone, Debug)]
pub struct EngineEventsConfig {
    /// The engine's PUB endpoint as reachable from here, e.g. `tcp://127.0.0.1:5557`.
    pub endpoint: String,
    /// Its replay (ROUTER) endpoint, e.g. `tcp://127.0.0.1:5558`; `None`: gaps clear.
    pub replay_endpoint: Option<String>,
    /// The topic subscribed to (vLLM's `topic`, default empty: every message).
    pub topic: String,
    /// Tokens per kvgate block: the `block_size` of the gateway's `kv_exact` rule.
    pub block_size: BlockSize,
    /// Most engine blocks remembered (new ones beyond are not mapped).
    pub max_blocks: usize,
}

impl EngineEventsConfig {
    /// The defaults for `endpoint`: no replay, every topic, blocks of 16, 262,144 blocks
    /// (about 60–90 MB of map).
    pub fn new(endpoint: impl Into<String>) -> Self {
        EngineEventsConfig {
            endpoint: endpoint.into(),
            replay_endpoint: None,
            topic: String::new(),
            block_size: BlockSize::default(),
            max_blocks: 1 << 18,
        }
    }
}

/// Largest payload read (a batch of a busy engine step is kilobytes).
const MAX_PAYLOAD_BYTES: usize = 64 << 20;
/// Longest wait for a replay to end.
const REPLAY_TIMEOUT: Duration = Duration::from_secs(5);
/// vLLM's end-of-replay marker (seq −1).
const END_SEQ: [u8; 8] = [0xff; 8];

type Labels = Vec<(&'static str, &'static str)>;

/// The subscriber's series (prefix `kvgate_sidecar_engine_`).
#[derive(Clone, Default)]
pub struct EngineEventMetrics {
    batches: Family<Labels, Counter>,
    blocks: Family<Labels, Counter>,
    gaps: Family<Labels, Counter>,
    connected: Gauge,
    remembered: Gauge,
    held: Gauge,
    bytes: Gauge,
    last_seq: Gauge<i64, AtomicI64>,
    cleared: Counter<u64, AtomicU64>,
}

impl EngineEventMetrics {
    pub fn register(registry: &mut Registry) -> Self {
        let m = EngineEventMetrics::default();
        let r = registry.sub_registry_with_prefix("kvgate_sidecar_engine");
        r.register(
            "event_batches",
            "Engine KV-event messages read, by outcome (applied, repeat, malformed)",
            m.batches.clone(),
        );
        r.register(
            "event_blocks",
            "Engine blocks stored, by outcome (mapped, or why not)",
            m.blocks.clone(),
        );
        r.register(
            "event_gaps",
            "Gaps in the engine's sequence numbers, by how they were resolved (replayed, cleared)",
            m.gaps.clone(),
        );
        r.register(
            "event_clears",
            "Times the mapping started over (engine cleared, gap not replayed, reconnection)",
            m.cleared.clone(),
        );
        r.register(
            "events_connected",
            "1 while connected to the engine's KV-event publisher",
            m.connected.clone(),
        );
        r.register(
            "blocks_remembered",
            "Engine blocks mapped to kvgate keys and remembered",
            m.remembered.clone(),
        );
        r.register(
            "map_bytes",
            "Memory the mapping holds (its tables and the blocks' keys), bytes",
            m.bytes.clone(),
        );
        r.register(
            "keys_held",
            "kvgate block keys the engine holds, as published",
            m.held.clone(),
        );
        r.register(
            "event_last_seq",
            "Sequence number of the last engine message applied (-1: none)",
            m.last_seq.clone(),
        );
        m.last_seq.set(-1);
        m
    }

    fn batch(&self, outcome: &'static str) {
        self.batches
            .get_or_create(&vec![("outcome", outcome)])
            .inc();
    }
}

/// One message's frames: seq and payload (the topic is not needed).
fn frames(msg: &ZmqMessage) -> Option<(u64, &[u8])> {
    if msg.len() != 3 {
        return None;
    }
    let seq: [u8; 8] = msg.get(1)?.as_ref().try_into().ok()?;
    Some((u64::from_be_bytes(seq), msg.get(2)?.as_ref()))
}

/// The subscriber's state: the mapping, the feed it publishes in, the last seq applied.
struct Subscriber {
    cfg: EngineEventsConfig,
    map: EngineCacheMap,
    feed: KvEventFeed,
    metrics: EngineEventMetrics,
    /// The last seq applied (live or replayed).
    last: Option<u64>,
    /// The last seq seen on the live socket: one publisher's live seqs only grow, so a smaller
    /// one is a new publisher (the engine restarted) even if no disconnection was seen.
    live_last: Option<u64>,
}

impl Subscriber {
    fn clear(&mut self) {
        let ev = self.map.clear();
        self.feed.publish(vec![ev]);
        self.metrics.cleared.inc();
        self.last = None;
        self.live_last = None;
        self.gauges();
    }

    fn gauges(&self) {
        self.metrics.remembered.set(self.map.engine_blocks() as i64);
        self.metrics.held.set(self.map.held_keys() as i64);
        self.metrics.bytes.set(self.map.approx_bytes() as i64);
        self.metrics
            .last_seq
            .set(self.last.map_or(-1, |s| s.min(i64::MAX as u64) as i64));
    }

    /// Applies one message's payload at `seq` (in order; the caller checked).
    fn apply(&mut self, seq: u64, payload: &[u8]) {
        self.last = Some(seq);
        if payload.len() > MAX_PAYLOAD_BYTES {
            self.metrics.batch("malformed");
            tracing::warn!(
                seq,
                bytes = payload.len(),
                "engine KV-event batch too large: skipped"
            );
            return self.gauges();
        }
        let batch = match wire::decode_batch(payload) {
            Ok(b) => b,
            Err(e) => {
                self.metrics.batch("malformed");
                tracing::warn!(seq, error = %e, "engine KV-event batch unreadable: skipped");
                return self.gauges();
            }
        };
        self.metrics.batch("applied");
        let mut out: Vec<KvEvent> = Vec::new();
        let mut applied = Applied::default();
        for ev in &batch.events {
            match ev {
                Ok(ev) => self.map.apply(ev, &mut out, &mut applied),
                Err(e) => {
                    self.metrics
                        .blocks
                        .get_or_create(&vec![("outcome", "malformed")])
                        .inc();
                    tracing::warn!(seq, error = %e, "engine KV event unreadable: skipped");
                }
            }
        }
        if out.iter().any(|e| matches!(e, KvEvent::Cleared)) {
            self.metrics.cleared.inc();
        }
        if applied.mapped > 0 {
            self.metrics
                .blocks
                .get_or_create(&vec![("outcome", "mapped")])
                .inc_by(applied.mapped as u64);
        }
        for (why, n) in applied.skipped {
            self.metrics
                .blocks
                .get_or_create(&vec![("outcome", why.as_str())])
                .inc_by(n as u64);
        }
        if !out.is_empty() {
            self.feed.publish(out);
        }
        self.gauges();
    }

    /// Asks the replay socket for every message from `from` on and applies those after the
    /// last one applied. `Ok(true)`: the replay began at `from` or earlier (no gap left).
    async fn replay(&mut self, from: u64) -> Result<bool, String> {
        let Some(endpoint) = self.cfg.replay_endpoint.clone() else {
            return Ok(false);
        };
        let work = async {
            let mut sock = zeromq::DealerSocket::new();
            sock.connect(&endpoint)
                .await
                .map_err(|e| format!("connecting to {endpoint}: {e}"))?;
            let mut req = ZmqMessage::from(Vec::<u8>::new());
            req.push_back(from.to_be_bytes().to_vec().into());
            sock.send(req).await.map_err(|e| format!("asking: {e}"))?;
            let mut first: Option<u64> = None;
            loop {
                let msg = sock.recv().await.map_err(|e| format!("reading: {e}"))?;
                // [empty delimiter(s), seq, payload]: vLLM's ROUTER sends one delimiter, and
                // the DEALER may hand it over with the one it added to the request.
                let n = msg.len();
                if n < 2 || msg.iter().take(n - 2).any(|f| !f.is_empty()) {
                    return Err(format!(
                        "a replay message of frames {:?} (bytes), not [\"\", seq, payload]",
                        msg.iter().map(|f| f.len()).collect::<Vec<_>>()
                    ));
                }
                let Some(seq) = msg
                    .get(n - 2)
                    .and_then(|s| <[u8; 8]>::try_from(s.as_ref()).ok())
                else {
                    return Err("a replay message without an 8-byte seq".into());
                };
                if seq == END_SEQ {
                    return Ok(first.is_some_and(|f| f <= from));
                }
                let seq = u64::from_be_bytes(seq);
                first.get_or_insert(seq);
                if self.last.is_none_or(|l| seq > l) {
                    if let Some(l) = self.last {
                        if Some(seq) != l.checked_add(1) {
                            return Ok(false);
                        }
                    }
                    let payload = msg.get(n - 1).map(|p| p.to_vec()).unwrap_or_default();
                    self.apply(seq, &payload);
                }
            }
        };
        match tokio::time::timeout(REPLAY_TIMEOUT, work).await {
            Ok(r) => r,
            Err(_) => Err(format!("no end of replay within {REPLAY_TIMEOUT:?}")),
        }
    }

    /// One live message at `seq`.
    async fn live(&mut self, seq: u64, payload: &[u8]) {
        if self.live_last.is_some_and(|l| seq <= l) {
            tracing::warn!(seq, "engine KV events start over: the engine restarted");
            self.clear();
        }
        self.in_order(seq, payload).await;
        self.live_last = Some(seq);
    }

    /// A live message applied in order: repeats skipped, gaps filled or cleared.
    async fn in_order(&mut self, seq: u64, payload: &[u8]) {
        match self.last {
            Some(l) if seq <= l => {
                self.metrics.batch("repeat");
                return;
            }
            Some(l) if Some(seq) == l.checked_add(1) => return self.apply(seq, payload),
            _ => {}
        }
        // First message since (re)connecting, or a gap: what the replay buffer holds first.
        let first = self.last.is_none();
        let from = self.last.map_or(0, |l| l.saturating_add(1));
        let filled = match self.replay(from).await {
            Ok(filled) => filled,
            Err(e) => {
                tracing::warn!(from, error = %e, "engine KV-event replay failed");
                false
            }
        };
        if !first {
            let resolution = if filled { "replayed" } else { "cleared" };
            self.metrics
                .gaps
                .get_or_create(&vec![("resolution", resolution)])
                .inc();
            if !filled {
                tracing::warn!(
                    from,
                    seq,
                    "engine KV events missed: the mapping starts over"
                );
                self.clear();
            }
        }
        match self.last {
            Some(l) if seq <= l => self.metrics.batch("repeat"),
            Some(l) if Some(seq) != l.checked_add(1) => {
                // The replay ended before this message: what came between is lost.
                self.clear();
                self.apply(seq, payload);
            }
            _ => self.apply(seq, payload),
        }
    }
}

/// Reads the engine's KV events until `cancel`, publishing them in `feed` (closed at the end).
pub async fn run(
    cfg: EngineEventsConfig,
    feed: KvEventFeed,
    metrics: EngineEventMetrics,
    cancel: CancellationToken,
) {
    let mut sub = Subscriber {
        map: EngineCacheMap::new(cfg.block_size, cfg.max_blocks),
        cfg,
        feed: feed.clone(),
        metrics,
        last: None,
        live_last: None,
    };
    let mut backoff = Duration::from_millis(100);
    'connect: while !cancel.is_cancelled() {
        let mut sock = zeromq::SubSocket::new();
        let mut monitor = sock.monitor();
        let connected = tokio::select! {
            _ = cancel.cancelled() => break,
            r = async {
                sock.connect(&sub.cfg.endpoint).await?;
                sock.subscribe(&sub.cfg.topic).await
            } => r,
        };
        if let Err(e) = connected {
            tracing::warn!(endpoint = %sub.cfg.endpoint, error = %e, "engine KV events: cannot connect; retrying");
            tokio::select! {
                _ = cancel.cancelled() => break,
                _ = tokio::time::sleep(backoff) => {}
            }
            backoff = (backoff * 2).min(Duration::from_secs(5));
            continue;
        }
        backoff = Duration::from_millis(100);
        sub.metrics.connected.set(1);
        tracing::info!(endpoint = %sub.cfg.endpoint, "engine KV events: subscribed");
        loop {
            tokio::select! {
                _ = cancel.cancelled() => break 'connect,
                ev = futures::StreamExt::next(&mut monitor) => {
                    if matches!(ev, Some(SocketEvent::Disconnected(_)) | None) {
                        // The engine may have restarted: what it held is unknown now.
                        tracing::info!("engine KV events: publisher disconnected; the mapping starts over");
                        sub.metrics.connected.set(0);
                        sub.clear();
                        if ev.is_none() {
                            continue 'connect;
                        }
                    } else if matches!(ev, Some(SocketEvent::Connected(..))) {
                        sub.metrics.connected.set(1);
                    }
                }
                msg = sock.recv() => match msg {
                    Ok(msg) => match frames(&msg) {
                        Some((seq, payload)) => sub.live(seq, payload).await,
                        None => sub.metrics.batch("malformed"),
                    },
                    Err(e) => {
                        tracing::warn!(error = %e, "engine KV events: receive failed; reconnecting");
                        sub.metrics.connected.set(0);
                        sub.clear();
                        tokio::select! {
                            _ = cancel.cancelled() => break 'connect,
                            _ = tokio::time::sleep(backoff) => {}
                        }
                        continue 'connect;
                    }
                },
            }
        }
    }
    sub.metrics.connected.set(0);
    feed.close();
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use super::*;

    /// The bytes vLLM 0.34.0's own `ZmqEventPublisher` sent (recorded by
    /// `scripts/check-vllm-events.sh --fixture`): decoded and mapped here, every message leaves
    /// exactly the keys the independent Python reference computed, for kvgate blocks of 16
    /// (vLLM's size) and 32.
    #[test]
    fn vllm_publisher_bytes_map_to_the_reference_keys() {
        let doc: serde_json::Value =
            serde_json::from_str(include_str!("../../../tests/fixtures/vllm_kv_events.json"))
                .unwrap();
        let messages = doc["messages"].as_array().unwrap();
        assert!(messages.len() >= 8);
        for b in [16u32, 32] {
            let mut map = EngineCacheMap::new(BlockSize::new(b).unwrap(), 1 << 20);
            let mut held: BTreeSet<String> = BTreeSet::new();
            for m in messages {
                let payload = hex::decode(m["payload_hex"].as_str().unwrap()).unwrap();
                let batch = wire::decode_batch(&payload).unwrap();
                let mut out = Vec::new();
                let mut applied = Applied::default();
                for ev in &batch.events {
                    map.apply(ev.as_ref().unwrap(), &mut out, &mut applied);
                }
                for ev in out {
                    match ev {
                        KvEvent::Stored { keys, .. } => {
                            held.extend(keys.iter().map(|k| k.to_string()))
                        }
                        KvEvent::Removed { keys } => {
                            for k in keys {
                                held.remove(&k.to_string());
                            }
                        }
                        KvEvent::Cleared => held.clear(),
                    }
                }
                let want: BTreeSet<String> = m["held"][b.to_string()]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|k| k.as_str().unwrap().to_string())
                    .collect();
                assert_eq!(held, want, "B = {b} after {:?}", m["step"]);
                assert_eq!(map.held_keys(), want.len());
            }
        }
    }

    /// Resident set size (Linux `/proc/self/statm`, pages of 4 KiB), for the bench.
    fn resident_bytes() -> i64 {
        std::fs::read_to_string("/proc/self/statm")
            .ok()
            .and_then(|s| s.split_whitespace().nth(1)?.parse::<i64>().ok())
            .map_or(0, |pages| pages * 4096)
    }

    /// vLLM's event encoding, written by `rmp-serde` for the bench.
    #[derive(serde::Serialize)]
    #[serde(tag = "type")]
    enum Event {
        BlockStored {
            block_hashes: Vec<serde_bytes_hash::Hash>,
            parent_block_hash: Option<serde_bytes_hash::Hash>,
            token_ids: Vec<u32>,
            block_size: usize,
            lora_id: Option<u32>,
            medium: Option<String>,
            lora_name: Option<String>,
            extra_keys: Option<Vec<Option<Vec<String>>>>,
        },
    }

    /// 32-byte block hashes as msgpack `bin` (vLLM's default), without a bytes crate.
    mod serde_bytes_hash {
        pub struct Hash(pub [u8; 32]);
        impl serde::Serialize for Hash {
            fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.serialize_bytes(&self.0)
            }
        }
    }

    /// vLLM's real payloads with bytes flipped, cut short or spliced: the reader and the mapping
    /// answer every one (an error or events) and never panic; the map stays bounded.
    #[test]
    fn mangled_payloads_never_panic() {
        let doc: serde_json::Value =
            serde_json::from_str(include_str!("../../../tests/fixtures/vllm_kv_events.json"))
                .unwrap();
        let payloads: Vec<Vec<u8>> = doc["messages"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| hex::decode(m["payload_hex"].as_str().unwrap()).unwrap())
            .collect();
        let mut rng = 0x2545f4914f6cdd1du64;
        let mut next = move || {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng
        };
        let mut map = EngineCacheMap::new(BlockSize::new(16).unwrap(), 256);
        let (mut read, mut refused) = (0, 0);
        for _ in 0..20_000 {
            let mut p = payloads[(next() % payloads.len() as u64) as usize].clone();
            match next() % 4 {
                0 => {
                    for _ in 0..1 + next() % 4 {
                        let i = (next() % p.len() as u64) as usize;
                        p[i] = next() as u8;
                    }
                }
                1 => p.truncate((next() % p.len() as u64) as usize),
                2 => {
                    let other = &payloads[(next() % payloads.len() as u64) as usize];
                    let cut = (next() % p.len().min(other.len()) as u64) as usize;
                    p.splice(cut.., other[cut..].iter().copied());
                }
                _ => {
                    let i = (next() % p.len() as u64) as usize;
                    p[i] = [0xdc, 0xdd, 0xde, 0xdf, 0xc6, 0xdb][(next() % 6) as usize];
                }
            }
            match wire::decode_batch(&p) {
                Ok(batch) => {
                    read += 1;
                    let mut out = Vec::new();
                    let mut applied = Applied::default();
                    for ev in batch.events.iter().flatten() {
                        map.apply(ev, &mut out, &mut applied);
                    }
                }
                Err(_) => refused += 1,
            }
            assert!(map.engine_blocks() <= 256);
        }
        assert!(read > 0 && refused > 0, "{read} read, {refused} refused");
    }

    /// One batch storing a salted root chain of `tokens.len() / 16` blocks, hashes from `first`.
    fn chain_batch(first: u8, tokens: &[u32], salt: &str) -> Vec<u8> {
        let n = tokens.len() / 16;
        let mut extra = vec![None; n];
        extra[0] = Some(vec![salt.to_string()]);
        let ev = Event::BlockStored {
            block_hashes: (0..n as u8)
                .map(|i| serde_bytes_hash::Hash([first + i; 32]))
                .collect(),
            parent_block_hash: None,
            token_ids: tokens.to_vec(),
            block_size: 16,
            lora_id: None,
            medium: Some("GPU".into()),
            lora_name: None,
            extra_keys: Some(extra),
        };
        rmp_serde::to_vec_named(&(1.0f64, vec![ev])).unwrap()
    }

    /// The live-message rules without sockets (no replay endpoint): in order applied, repeats
    /// skipped, a gap clears then applies, a seq that goes back (a restarted engine) clears.
    #[tokio::test]
    async fn live_messages_in_order_gaps_and_restarts() {
        let seed = prefix_index::NamespaceSeed([3; 32]);
        let salt = mapping::salt_for(prefix_index::HashAlgorithm::Xxh3, &seed);
        let chain = prefix_index::KeyChain::new(
            seed,
            prefix_index::HashAlgorithm::Xxh3,
            BlockSize::new(16).unwrap(),
        );
        let feed = KvEventFeed::new();
        let mut sub = Subscriber {
            cfg: EngineEventsConfig::new("tcp://127.0.0.1:1"),
            map: EngineCacheMap::new(BlockSize::new(16).unwrap(), 1 << 10),
            feed: feed.clone(),
            metrics: EngineEventMetrics::default(),
            last: None,
            live_last: None,
        };
        let a: Vec<u32> = (0..32).collect();
        let b: Vec<u32> = (100..148).collect();
        let c: Vec<u32> = (200..216).collect();
        let keys = |t: &[u32]| -> Vec<prefix_index::BlockKey> {
            let mut k = chain.keys(t);
            k.sort_unstable();
            k
        };
        sub.live(0, &chain_batch(0, &a, &salt)).await;
        assert_eq!(feed.keys(), keys(&a));
        sub.live(0, &chain_batch(0, &a, &salt)).await; // not above the last live seq: a restart
        assert_eq!(
            feed.keys(),
            keys(&a),
            "the restarted engine stored the same chain"
        );
        assert_eq!(sub.metrics.cleared.get(), 1, "after starting over");
        sub.live(1, &chain_batch(10, &b, &salt)).await;
        let mut ab = [keys(&a), keys(&b)].concat();
        ab.sort_unstable();
        assert_eq!(feed.keys(), ab);
        // Seq 2 never arrives: without a replay socket the gap clears, then 3 is applied.
        sub.live(3, &chain_batch(20, &c, &salt)).await;
        assert_eq!(feed.keys(), keys(&c));
        assert_eq!(sub.last, Some(3));
        assert_eq!(sub.metrics.cleared.get(), 2);
        // A malformed payload is skipped, its seq taken.
        sub.live(4, b"\xc1").await;
        assert_eq!(sub.last, Some(4));
        assert_eq!(feed.keys(), keys(&c));
    }

    /// What reading vLLM's events costs the sidecar, against the floor: computing the same
    /// blocks' kvgate keys (what a kvgate worker does for its own cache). 1,000 requests of 64
    /// blocks of 16 tokens, one batch each (a salted root chain), then the body rewrite of a
    /// ticketed request at three sizes against parsing the body alone.
    ///
    /// `cargo test -p worker --lib bench_engine_events -- --ignored --nocapture`
    #[test]
    #[ignore = "a benchmark: run it by name with --ignored --nocapture"]
    fn bench_engine_events() {
        use std::time::Instant;
        let bs = BlockSize::new(16).unwrap();
        let seed = prefix_index::NamespaceSeed([9; 32]);
        let salt = mapping::salt_for(prefix_index::HashAlgorithm::Xxh3, &seed);
        let (requests, blocks) = (1000usize, 64usize);
        let mut rng = 0x9e3779b97f4a7c15u64;
        let mut next = move || {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng
        };
        let prompts: Vec<Vec<u32>> = (0..requests)
            .map(|_| (0..blocks * 16).map(|_| (next() % 49152) as u32).collect())
            .collect();
        let payloads: Vec<Vec<u8>> = prompts
            .iter()
            .map(|t| {
                let hashes: Vec<serde_bytes_hash::Hash> = (0..blocks)
                    .map(|_| {
                        let mut h = [0u8; 32];
                        for c in h.chunks_mut(8) {
                            c.copy_from_slice(&next().to_le_bytes());
                        }
                        serde_bytes_hash::Hash(h)
                    })
                    .collect();
                let mut extra = vec![None; blocks];
                extra[0] = Some(vec![salt.clone()]);
                let ev = Event::BlockStored {
                    block_hashes: hashes,
                    parent_block_hash: None,
                    token_ids: t.clone(),
                    block_size: 16,
                    lora_id: None,
                    medium: Some("GPU".into()),
                    lora_name: None,
                    extra_keys: Some(extra),
                };
                rmp_serde::to_vec_named(&(1.0f64, vec![ev], 0u32)).unwrap()
            })
            .collect();
        let total_blocks = (requests * blocks) as f64;
        let chain = prefix_index::KeyChain::new(seed, prefix_index::HashAlgorithm::Xxh3, bs);
        for round in 0..3 {
            let t = Instant::now();
            let mut n = 0;
            for p in &prompts {
                n += chain.keys(p).len();
            }
            let keys_s = t.elapsed().as_secs_f64();
            assert_eq!(n, requests * blocks);
            let t = Instant::now();
            for p in &payloads {
                std::hint::black_box(wire::decode_batch(p).unwrap());
            }
            let decode_s = t.elapsed().as_secs_f64();
            let rss_before = resident_bytes();
            let mut map = EngineCacheMap::new(bs, 1 << 20);
            let t = Instant::now();
            let mut out = Vec::new();
            for p in &payloads {
                let batch = wire::decode_batch(p).unwrap();
                let mut applied = Applied::default();
                out.clear();
                for ev in &batch.events {
                    map.apply(ev.as_ref().unwrap(), &mut out, &mut applied);
                }
            }
            let map_s = t.elapsed().as_secs_f64();
            assert_eq!(map.held_keys(), requests * blocks);
            let per_block = (resident_bytes() - rss_before) as f64 / total_blocks;
            println!(
                "round {round}: the map's memory: {:.0} bytes per block by its accounting \
                 (approx_bytes), {per_block:.0} by the process's resident set",
                map.approx_bytes() as f64 / total_blocks
            );
            drop(map);
            println!(
                "round {round}: {:.0} blocks: keys alone {:.2} M blocks/s; decode {:.2} M blocks/s; \
                 decode + map {:.2} M blocks/s = {:.1}x the keys' time ({:.2} us per 64-block batch, \
                 payload {} bytes)",
                total_blocks,
                total_blocks / keys_s / 1e6,
                total_blocks / decode_s / 1e6,
                total_blocks / map_s / 1e6,
                map_s / keys_s,
                map_s / requests as f64 * 1e6,
                payloads[0].len()
            );
        }
        for size in [4usize << 10, 64 << 10, 1 << 20] {
            let text = "x".repeat(size);
            let body = serde_json::to_vec(&serde_json::json!({
                "model": "m",
                "messages": [{"role": "user", "content": text}],
                "max_tokens": 16
            }))
            .unwrap();
            let body = axum::body::Bytes::from(body);
            let iters = (64 << 20) / size;
            let t = Instant::now();
            for _ in 0..iters {
                std::hint::black_box(
                    serde_json::from_slice::<serde_json::Map<String, serde_json::Value>>(&body)
                        .unwrap(),
                );
            }
            let parse = t.elapsed().as_secs_f64() / iters as f64;
            let t = Instant::now();
            for _ in 0..iters {
                std::hint::black_box(crate::sidecar::relay::with_cache_salt(body.clone(), &salt));
            }
            let rewrite = t.elapsed().as_secs_f64() / iters as f64;
            println!(
                "cache_salt rewrite of a {} KiB body: {:.1} us (parse alone {:.1} us, {:.2}x)",
                size >> 10,
                rewrite * 1e6,
                parse * 1e6,
                rewrite / parse
            );
        }
    }
}
