//! The multi-worker prefix index: which worker holds which block keys, and for one key chain,
//! every worker's longest matched prefix.
//!
//! # Layout
//! * Workers get dense `u32` slots (smallest free slot first), so the set of workers holding a
//!   key is a tiny bitset ([`crate::holders`]): 16 bytes inline for up to 64 neighbouring slots.
//! * **Precise holdings** (from KV events): `S` shards, each an `RwLock<HashMap<BlockKey,
//!   Holders>>`. There is deliberately no per-worker key list: `Stored`/`Removed` name their keys,
//!   and the rare `Cleared` / worker removal scans the shards instead (O(total keys)), which keeps a
//!   (worker, block) pair at one map entry shared by every holder (≤ 64 bytes, see
//!   `docs/benchmarks.md`). Per-worker block counts are kept exactly (for metrics) because
//!   insert/remove report whether the bit changed, which also makes every event idempotent.
//! * **Approximate holdings** (keys the gateway routed to workers without events) live in
//!   separate shards, never mixed with precise ones: `key → [(slot, expiry)]`, plus a per-worker
//!   LRU queue that enforces the TTL and the per-worker capacity.
//!
//! # Concurrency: sharded locks
//! Every method takes `&self`. Readers ([`PrefixIndex::longest_matches`]) run inline on the
//! caller's thread and read-lock each shard the chain touches once (all together, for the
//! duration of the walk); writers write-lock one shard at a time (each shard once per event
//! batch), and take a per-worker mutex that serializes the events of one worker (their order matters)
//! while different workers' events apply in parallel. We chose this over Dynamo's sticky writer
//! thread because the crate is a plain synchronous structure (no threads or channels of its own),
//! a query then costs no channel hop, and readers only wait for a writer that holds the same shard
//! for one batch. The price: a query is not an atomic snapshot of an event — it may see part
//! of a concurrent event batch (the shards it already holds versus those the writer holds). That only shortens or lengthens a match by the blocks in flight, which
//! a routing heuristic tolerates; each key's holder set is always consistent.
//!
//! Lock order (no cycles): worker table → worker mutex → shard. A removed worker's slot is scrubbed
//! from every shard before it can be reused, and queries hold the worker table's read lock, so a
//! slot never changes owner under a query.
//!
//! # Complexity
//! * `apply_event`: O(k) expected for k keys (`Stored`, `Removed`); `Cleared` and
//!   `remove_worker`: O(total keys in the index).
//! * `longest_matches`: one pass over the chain, O(Σ wᵢ) where wᵢ is the number of 64-slot words
//!   of workers still matching at block i (1 for ≤ 64 workers); it stops at the first block no
//!   remaining worker holds, so workers that hold nothing of the chain cost nothing.
//! * `insert_approximate`: O(k) amortized.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, HashSet, VecDeque};
use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Mutex, RwLock, RwLockReadGuard};

use crate::clock::{Clock, SystemClock};
use crate::error::IndexError;
use crate::holders::{for_each_slot, intersect_into, words_from_slots, Holders, Word};
use crate::key::{BlockKey, WorkerId};
use crate::protocol::{KvEvent, KvEventEnvelope};

/// Tuning of a [`PrefixIndex`]. Defaults: 64 shards, approximate TTL 120 s (Dynamo's
/// approximate mode uses the same), approximate capacity 65,536 blocks per worker.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IndexConfig {
    /// Number of lock shards: a power of two in 1..=4096.
    pub shards: usize,
    /// How long an approximate holding (a routed block) is believed.
    pub approximate_ttl: Duration,
    /// Most approximate blocks kept per worker; the least recently routed go first.
    pub approximate_capacity: usize,
}

impl Default for IndexConfig {
    fn default() -> Self {
        IndexConfig {
            shards: 64,
            approximate_ttl: Duration::from_secs(120),
            approximate_capacity: 65_536,
        }
    }
}

impl IndexConfig {
    /// Checks the values; every problem is named.
    pub fn validate(&self) -> Result<(), IndexError> {
        let mut problems = Vec::new();
        if !self.shards.is_power_of_two() || self.shards > 4096 {
            problems.push(format!(
                "shards = {}: must be a power of two in 1..=4096",
                self.shards
            ));
        }
        if self.approximate_ttl.is_zero() {
            problems.push("approximate_ttl must be > 0".to_owned());
        }
        if self.approximate_capacity == 0 {
            problems.push("approximate_capacity must be > 0".to_owned());
        }
        if problems.is_empty() {
            Ok(())
        } else {
            Err(IndexError::InvalidConfig {
                reason: problems.join("; "),
            })
        }
    }
}

/// One worker's longest matched prefix of a queried chain.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WorkerMatch {
    /// The worker.
    pub worker: WorkerId,
    /// Longest matched prefix in blocks: the larger of the two below.
    pub blocks: usize,
    /// Matched blocks according to the worker's KV events.
    pub precise_blocks: usize,
    /// Matched blocks according to unexpired approximate holdings.
    pub approximate_blocks: usize,
}

/// Per-worker counts for metrics.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WorkerStats {
    /// The worker.
    pub worker: WorkerId,
    /// Blocks the worker holds according to its events.
    pub precise_blocks: u64,
    /// Approximate blocks currently kept for it (expired ones may linger until the next
    /// [`PrefixIndex::expire_approximate`] or insert; queries ignore them).
    pub approximate_blocks: u64,
    /// `(epoch, seq)` of the last envelope applied with [`PrefixIndex::apply_envelope`].
    pub last_event: Option<(u64, u64)>,
}

/// What [`PrefixIndex::apply_envelope`] did with an envelope.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EnvelopeOutcome {
    /// The next envelope in sequence, a `cleared` opening a snapshot or a part of that
    /// snapshot (or the first envelope seen): applied.
    Applied,
    /// Same epoch, `seq` not after the last applied one (and not part of a snapshot): ignored
    /// (a replay).
    Duplicate,
    /// Same epoch, but envelopes `expected..got` were never seen: NOT applied, the position is
    /// unchanged; the caller resubscribes from it (the worker then replays or sends a snapshot).
    Gap {
        /// The seq that should have come.
        expected: u64,
        /// The seq that came.
        got: u64,
    },
    /// A newer epoch: the worker's cache restarted empty, so its precise holdings were cleared
    /// before the event was applied.
    NewEpoch {
        /// The epoch before.
        previous: u64,
    },
}

// ---------------------------------------------------------------------------------------------
// hashing of keys (keys are already hashes; a seeded folded multiply stops crafted collisions)
// ---------------------------------------------------------------------------------------------

const MUL: u64 = 0x9E37_79B9_7F4A_7C15;
const MUL2: u64 = 0xD6E8_FEB8_6659_FD93;

#[inline]
fn fold(x: u64) -> u64 {
    let p = (x as u128).wrapping_mul(MUL as u128);
    (p as u64) ^ ((p >> 64) as u64)
}

#[derive(Clone, Copy)]
struct KeyHash(u64);

impl BuildHasher for KeyHash {
    type Hasher = KeyHasher;
    #[inline]
    fn build_hasher(&self) -> KeyHasher {
        KeyHasher {
            seed: self.0,
            state: 0,
        }
    }
}

struct KeyHasher {
    seed: u64,
    state: u64,
}

impl Hasher for KeyHasher {
    #[inline]
    fn finish(&self) -> u64 {
        self.state
    }
    #[inline]
    fn write_u64(&mut self, n: u64) {
        self.state = fold(self.state ^ n ^ self.seed);
    }
    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8) {
            let mut b = [0u8; 8];
            b[..chunk.len()].copy_from_slice(chunk);
            self.write_u64(u64::from_le_bytes(b));
        }
    }
}

type PreciseShard = HashMap<BlockKey, Holders, KeyHash>;
type ApproxShard = HashMap<BlockKey, Vec<(u32, Instant)>, KeyHash>;

// ---------------------------------------------------------------------------------------------
// workers
// ---------------------------------------------------------------------------------------------

/// Least-recently-routed queue of one worker's approximate blocks. `map` holds the live stamp of
/// every key; `queue` is in touch order (= expiry order, the TTL being constant and the clock
/// monotonic) and may hold stale entries (older stamps), skipped lazily and compacted when they
/// outnumber live ones.
#[derive(Default)]
struct ApproxLru {
    map: HashMap<BlockKey, u64>,
    queue: VecDeque<(BlockKey, u64, Instant)>,
    next: u64,
}

impl ApproxLru {
    /// Touches `key`; true when it was not there.
    fn touch(&mut self, key: BlockKey, expires: Instant) -> bool {
        let stamp = self.next;
        self.next += 1;
        let new = self.map.insert(key, stamp).is_none();
        self.queue.push_back((key, stamp, expires));
        if self.queue.len() > 2 * self.map.len() + 64 {
            let map = &self.map;
            self.queue.retain(|(k, s, _)| map.get(k) == Some(s));
        }
        new
    }

    /// Pops the least recently touched key if `pred(expiry)` holds for it.
    fn pop_front_if(&mut self, pred: impl Fn(Instant) -> bool) -> Option<BlockKey> {
        while let Some(&(k, s, exp)) = self.queue.front() {
            if self.map.get(&k) != Some(&s) {
                self.queue.pop_front();
                continue;
            }
            if !pred(exp) {
                return None;
            }
            self.queue.pop_front();
            self.map.remove(&k);
            return Some(k);
        }
        None
    }
}

#[derive(Default)]
struct WriterState {
    last: Option<(u64, u64)>,
    /// A `cleared` envelope was applied at `last`'s seq and nothing after it yet: envelopes
    /// with that same seq are parts of the worker's snapshot.
    in_snapshot: bool,
    lru: ApproxLru,
    /// Most prompts (key chains) believed held at once ([`PrefixIndex::set_approximate_prefixes`]).
    prefix_limit: Option<usize>,
    /// The routed chains, oldest first (kept only with a `prefix_limit`).
    chains: VecDeque<Vec<BlockKey>>,
}

struct WorkerSlot {
    id: WorkerId,
    slot: u32,
    alive: AtomicBool,
    precise_blocks: AtomicU64,
    approx_blocks: AtomicU64,
    writer: Mutex<WriterState>,
}

#[derive(Default)]
struct Workers {
    by_id: HashMap<WorkerId, u32>,
    slots: Vec<Option<Arc<WorkerSlot>>>,
    free: BinaryHeap<Reverse<u32>>,
}

// ---------------------------------------------------------------------------------------------
// PrefixIndex
// ---------------------------------------------------------------------------------------------

/// Which workers hold which block keys, precisely (events) and approximately (routing), and the
/// longest matched prefix of a chain per worker. See the module docs for layout, concurrency and
/// complexity.
pub struct PrefixIndex {
    config: IndexConfig,
    clock: Arc<dyn Clock>,
    shard_seed: u64,
    shard_shift: u32,
    precise: Box<[RwLock<PreciseShard>]>,
    approx: Box<[RwLock<ApproxShard>]>,
    approx_entries: AtomicUsize,
    workers: RwLock<Workers>,
}

impl std::fmt::Debug for PrefixIndex {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PrefixIndex")
            .field("config", &self.config)
            .field("workers", &self.workers.read().by_id.len())
            .finish_non_exhaustive()
    }
}

impl Default for PrefixIndex {
    fn default() -> Self {
        Self::build(IndexConfig::default(), Arc::new(SystemClock))
    }
}

impl PrefixIndex {
    /// An empty index with the real clock.
    pub fn new(config: IndexConfig) -> Result<Self, IndexError> {
        Self::with_clock(config, Arc::new(SystemClock))
    }

    /// An empty index reading time from `clock` (for the approximate TTL).
    pub fn with_clock(config: IndexConfig, clock: Arc<dyn Clock>) -> Result<Self, IndexError> {
        config.validate()?;
        Ok(Self::build(config, clock))
    }

    fn build(config: IndexConfig, clock: Arc<dyn Clock>) -> Self {
        let rs = std::collections::hash_map::RandomState::new();
        let seed = rs.hash_one(0x6b76_6761_7465u64);
        let hash = KeyHash(fold(seed));
        let shard_seed = fold(seed ^ MUL2);
        let bits = config.shards.trailing_zeros();
        let precise = (0..config.shards)
            .map(|_| RwLock::new(HashMap::with_hasher(hash)))
            .collect();
        let approx = (0..config.shards)
            .map(|_| RwLock::new(HashMap::with_hasher(hash)))
            .collect();
        PrefixIndex {
            config,
            clock,
            shard_seed,
            shard_shift: 64 - bits,
            precise,
            approx,
            approx_entries: AtomicUsize::new(0),
            workers: RwLock::new(Workers::default()),
        }
    }

    /// The configuration.
    pub fn config(&self) -> &IndexConfig {
        &self.config
    }

    #[inline]
    fn shard_of(&self, key: BlockKey) -> usize {
        ((key.0 ^ self.shard_seed).wrapping_mul(MUL2))
            .checked_shr(self.shard_shift)
            .unwrap_or(0) as usize
    }

    // -- workers ------------------------------------------------------------------------------

    /// Registers a worker (idempotent); true when it was new.
    pub fn add_worker(&self, worker: &WorkerId) -> bool {
        let mut w = self.workers.write();
        if w.by_id.contains_key(worker) {
            return false;
        }
        let slot = match w.free.pop() {
            Some(Reverse(s)) => s,
            None => {
                w.slots.push(None);
                (w.slots.len() - 1) as u32
            }
        };
        w.slots[slot as usize] = Some(Arc::new(WorkerSlot {
            id: worker.clone(),
            slot,
            alive: AtomicBool::new(true),
            precise_blocks: AtomicU64::new(0),
            approx_blocks: AtomicU64::new(0),
            writer: Mutex::new(WriterState::default()),
        }));
        w.by_id.insert(worker.clone(), slot);
        true
    }

    /// Removes a worker and everything it holds (precise and approximate); true when it was
    /// known. O(total keys in the index).
    pub fn remove_worker(&self, worker: &WorkerId) -> bool {
        let ws = {
            let mut w = self.workers.write();
            let Some(slot) = w.by_id.remove(worker) else {
                return false;
            };
            match w.slots.get(slot as usize).and_then(Clone::clone) {
                Some(ws) => ws,
                None => return false,
            }
        };
        {
            let mut st = ws.writer.lock();
            ws.alive.store(false, Ordering::Release);
            self.scrub_precise(&ws);
            self.clear_approx_locked(&ws, &mut st);
        }
        let mut w = self.workers.write();
        if let Some(entry) = w.slots.get_mut(ws.slot as usize) {
            *entry = None;
        }
        w.free.push(Reverse(ws.slot));
        true
    }

    /// The registered workers, in slot order.
    pub fn workers(&self) -> Vec<WorkerId> {
        let w = self.workers.read();
        w.slots.iter().flatten().map(|s| s.id.clone()).collect()
    }

    fn slot_of(&self, worker: &WorkerId) -> Result<Arc<WorkerSlot>, IndexError> {
        let w = self.workers.read();
        w.by_id
            .get(worker)
            .and_then(|&s| w.slots.get(s as usize).and_then(Clone::clone))
            .ok_or_else(|| IndexError::UnknownWorker {
                worker: worker.0.clone(),
            })
    }

    /// Counts for one worker, or `None` when it is unknown.
    pub fn worker_stats(&self, worker: &WorkerId) -> Option<WorkerStats> {
        let ws = self.slot_of(worker).ok()?;
        Some(Self::stats_of(&ws))
    }

    /// Counts for every worker, in slot order.
    pub fn all_worker_stats(&self) -> Vec<WorkerStats> {
        let slots: Vec<Arc<WorkerSlot>> = self
            .workers
            .read()
            .slots
            .iter()
            .flatten()
            .cloned()
            .collect();
        slots.iter().map(|ws| Self::stats_of(ws)).collect()
    }

    fn stats_of(ws: &WorkerSlot) -> WorkerStats {
        let last = ws.writer.lock().last;
        WorkerStats {
            worker: ws.id.clone(),
            precise_blocks: ws.precise_blocks.load(Ordering::Relaxed),
            approximate_blocks: ws.approx_blocks.load(Ordering::Relaxed),
            last_event: last,
        }
    }

    /// Number of distinct keys held precisely by at least one worker.
    pub fn precise_keys(&self) -> usize {
        self.precise.iter().map(|s| s.read().len()).sum()
    }

    /// Every key `worker` holds precisely, sorted. O(total keys): for diagnostics and tests
    /// (comparing the index with a worker's own cache), not for the request path.
    pub fn precise_keys_of(&self, worker: &WorkerId) -> Result<Vec<BlockKey>, IndexError> {
        let ws = self.slot_of(worker)?;
        let mut out: Vec<BlockKey> = Vec::new();
        for shard in &self.precise {
            out.extend(
                shard
                    .read()
                    .iter()
                    .filter(|(_, h)| h.contains(ws.slot))
                    .map(|(k, _)| *k),
            );
        }
        out.sort_unstable();
        Ok(out)
    }

    /// Workers that precisely hold `key`, in slot order.
    pub fn holders(&self, key: BlockKey) -> Vec<WorkerId> {
        let w = self.workers.read();
        let mut out = Vec::new();
        if let Some(h) = self.precise[self.shard_of(key)].read().get(&key) {
            h.with_words(|words| {
                for_each_slot(words, |s| {
                    if let Some(Some(ws)) = w.slots.get(s as usize) {
                        if ws.alive.load(Ordering::Acquire) {
                            out.push(ws.id.clone());
                        }
                    }
                })
            });
        }
        out
    }

    // -- precise events -----------------------------------------------------------------------

    /// Applies one event of `worker`. Idempotent: storing a held key or removing a missing one
    /// changes nothing, so events may be replayed, and a batch may be split or merged freely.
    /// `Stored.parent` is not needed by this flat index (a key already identifies its whole
    /// prefix) and is ignored.
    pub fn apply_event(&self, worker: &WorkerId, event: &KvEvent) -> Result<(), IndexError> {
        let ws = self.slot_of(worker)?;
        let _st = ws.writer.lock();
        if !ws.alive.load(Ordering::Acquire) {
            return Err(IndexError::UnknownWorker {
                worker: worker.0.clone(),
            });
        }
        self.apply_locked(&ws, event);
        Ok(())
    }

    /// Applies an envelope by the stream protocol of docs/kv-events.md; see
    /// [`EnvelopeOutcome`]. Per worker, with `(E, S)` the last applied position:
    /// - nothing applied yet, or another epoch (epochs are random, not ordered): apply (another
    ///   epoch first drops the worker's precise holdings: its cache restarted empty);
    /// - a `cleared` with seq ≥ S: apply; it opens a snapshot, whose `stored` envelopes all carry
    ///   that same seq and are applied too;
    /// - seq = S + 1: apply (a live event; it closes any snapshot);
    /// - seq ≤ S otherwise: ignore ([`EnvelopeOutcome::Duplicate`]);
    /// - seq > S + 1: ignore and report [`EnvelopeOutcome::Gap`] — the position stays at `S`, so
    ///   resubscribing from it yields the missed events or a snapshot.
    ///
    /// Sequence arithmetic saturates (a `seq` of `u64::MAX` is no panic).
    pub fn apply_envelope(
        &self,
        worker: &WorkerId,
        env: &KvEventEnvelope,
    ) -> Result<EnvelopeOutcome, IndexError> {
        let ws = self.slot_of(worker)?;
        let mut st = ws.writer.lock();
        if !ws.alive.load(Ordering::Acquire) {
            return Err(IndexError::UnknownWorker {
                worker: worker.0.clone(),
            });
        }
        let cleared = env.event == KvEvent::Cleared;
        let outcome = match st.last {
            None => EnvelopeOutcome::Applied,
            Some((epoch, _)) if env.epoch != epoch => {
                self.scrub_precise(&ws);
                EnvelopeOutcome::NewEpoch { previous: epoch }
            }
            Some((_, seq)) if cleared && env.seq >= seq => EnvelopeOutcome::Applied,
            Some((_, seq)) if env.seq == seq && st.in_snapshot => EnvelopeOutcome::Applied,
            Some((_, seq)) if env.seq <= seq => return Ok(EnvelopeOutcome::Duplicate),
            Some((_, seq)) if Some(env.seq) == seq.checked_add(1) => EnvelopeOutcome::Applied,
            Some((_, seq)) => {
                return Ok(EnvelopeOutcome::Gap {
                    expected: seq.saturating_add(1),
                    got: env.seq,
                })
            }
        };
        self.apply_locked(&ws, &env.event);
        let same_seq = st.last.is_some_and(|(e, s)| e == env.epoch && s == env.seq);
        st.in_snapshot = cleared || (st.in_snapshot && same_seq);
        st.last = Some((env.epoch, env.seq));
        Ok(outcome)
    }

    fn apply_locked(&self, ws: &WorkerSlot, event: &KvEvent) {
        let slot = ws.slot;
        match event {
            KvEvent::Stored { keys, .. } => {
                let mut added = 0u64;
                self.for_each_by_shard(keys, |shard, k| match shard.get_mut(&k) {
                    Some(h) => added += u64::from(h.insert(slot)),
                    None => {
                        shard.insert(k, Holders::single(slot));
                        added += 1;
                    }
                });
                ws.precise_blocks.fetch_add(added, Ordering::Relaxed);
            }
            KvEvent::Removed { keys } => {
                let mut removed = 0u64;
                self.for_each_by_shard(keys, |shard, k| {
                    if let Some(h) = shard.get_mut(&k) {
                        if h.remove(slot) {
                            removed += 1;
                            if h.is_empty() {
                                shard.remove(&k);
                            }
                        }
                    }
                });
                ws.precise_blocks.fetch_sub(removed, Ordering::Relaxed);
            }
            KvEvent::Cleared => self.scrub_precise(ws),
        }
    }

    /// Calls `f` for every key under its shard's write lock. Small batches lock per key; larger
    /// ones are grouped by shard (O(k log k) sort) so each shard is locked once and the map
    /// updates of one shard run back to back.
    fn for_each_by_shard(&self, keys: &[BlockKey], mut f: impl FnMut(&mut PreciseShard, BlockKey)) {
        if keys.len() < 16 {
            for &k in keys {
                f(&mut self.precise[self.shard_of(k)].write(), k);
            }
            return;
        }
        let mut by_shard: Vec<(u16, BlockKey)> =
            keys.iter().map(|&k| (self.shard_of(k) as u16, k)).collect();
        by_shard.sort_unstable_by_key(|x| x.0);
        for run in by_shard.chunk_by(|a, b| a.0 == b.0) {
            let mut shard = self.precise[run[0].0 as usize].write();
            for &(_, k) in run {
                f(&mut shard, k);
            }
        }
    }

    /// Removes `ws`'s slot from every precise shard (stops early once its count is reached).
    fn scrub_precise(&self, ws: &WorkerSlot) {
        let mut remaining = ws.precise_blocks.load(Ordering::Relaxed);
        for shard in self.precise.iter() {
            if remaining == 0 {
                break;
            }
            let mut shard = shard.write();
            shard.retain(|_, h| {
                if h.remove(ws.slot) {
                    remaining = remaining.saturating_sub(1);
                }
                !h.is_empty()
            });
        }
        ws.precise_blocks.store(0, Ordering::Relaxed);
    }

    // -- approximate holdings -----------------------------------------------------------------

    /// Records that `keys` were routed to `worker` (a worker without KV events): each is believed
    /// held until the TTL passes or the worker's approximate capacity evicts it (least recently
    /// routed first). Re-inserting a key refreshes it. Kept apart from precise holdings.
    pub fn insert_approximate(
        &self,
        worker: &WorkerId,
        keys: &[BlockKey],
    ) -> Result<(), IndexError> {
        self.insert_approximate_for(worker, keys, self.config.approximate_ttl)
    }

    /// [`Self::insert_approximate`] with its own TTL: the gateway's routing-time holdings of a
    /// worker *with* KV events (believed for a short while, until the worker's `stored` events
    /// make them precise or they expire). A worker's holdings should all use one TTL: expiry
    /// is enforced in insertion order, so with mixed TTLs an expired holding may stay in memory
    /// (never in a query's answer) until the ones before it expire.
    pub fn insert_approximate_for(
        &self,
        worker: &WorkerId,
        keys: &[BlockKey],
        ttl: Duration,
    ) -> Result<(), IndexError> {
        let ws = self.slot_of(worker)?;
        let mut st = ws.writer.lock();
        if !ws.alive.load(Ordering::Acquire) {
            return Err(IndexError::UnknownWorker {
                worker: worker.0.clone(),
            });
        }
        let now = self.clock.now();
        self.expire_locked(&ws, &mut st, now);
        let expires = now + ttl;
        let slot = ws.slot;
        for &k in keys {
            st.lru.touch(k, expires);
            let mut shard = self.approx[self.shard_of(k)].write();
            let v = shard.entry(k).or_default();
            match v.binary_search_by_key(&slot, |e| e.0) {
                Ok(i) => v[i].1 = expires,
                Err(i) => {
                    v.insert(i, (slot, expires));
                    self.approx_entries.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
        if st.prefix_limit.is_some() && !keys.is_empty() {
            // The engine puts this prompt in the slot of the most similar one: chains that
            // start like it are replaced (their keys this chain does not repeat are forgotten).
            let first = keys[0];
            let (same, other): (Vec<_>, Vec<_>) = std::mem::take(&mut st.chains)
                .into_iter()
                .partition(|c| c.first() == Some(&first));
            st.chains = other.into();
            st.chains.push_back(keys.to_vec());
            for old in same {
                self.forget_chain_locked(&ws, &mut st, &old);
            }
            self.trim_chains_locked(&ws, &mut st);
        }
        while st.lru.map.len() > self.config.approximate_capacity {
            match st.lru.pop_front_if(|_| true) {
                Some(k) => self.remove_approx_entry(slot, k),
                None => break,
            }
        }
        ws.approx_blocks
            .store(st.lru.map.len() as u64, Ordering::Relaxed);
        Ok(())
    }

    /// Forgets `keys` as approximate holdings of `worker` (those it does not hold
    /// approximately are skipped; precise holdings are untouched): a routing-time holding taken
    /// for a choice the gateway then moved elsewhere. O(keys).
    pub fn remove_approximate(
        &self,
        worker: &WorkerId,
        keys: &[BlockKey],
    ) -> Result<(), IndexError> {
        let ws = self.slot_of(worker)?;
        let mut st = ws.writer.lock();
        for k in keys {
            if st.lru.map.remove(k).is_some() {
                self.remove_approx_entry(ws.slot, *k);
            }
        }
        ws.approx_blocks
            .store(st.lru.map.len() as u64, Ordering::Relaxed);
        Ok(())
    }

    /// Bounds how many routed prompts (key chains) of `worker` are believed held at once, as a
    /// slot-based prompt cache holds them (`llama-server --parallel N` without its RAM prompt
    /// cache keeps one prompt per slot): inserting a chain first drops the held chains that
    /// start with the same block (the engine reuses the most similar slot), then, beyond
    /// `limit`, the oldest chains — their keys that no remaining chain holds stop being
    /// approximate holdings. `None` (the default): only the TTL and the block capacity apply.
    /// O(limit × chain length) per insert.
    pub fn set_approximate_prefixes(
        &self,
        worker: &WorkerId,
        limit: Option<usize>,
    ) -> Result<(), IndexError> {
        let ws = self.slot_of(worker)?;
        let mut st = ws.writer.lock();
        st.prefix_limit = limit.map(|n| n.max(1));
        if st.prefix_limit.is_none() {
            st.chains.clear();
        } else {
            self.trim_chains_locked(&ws, &mut st);
        }
        Ok(())
    }

    /// Drops the oldest chains beyond the prefix limit (and their keys no other chain holds).
    fn trim_chains_locked(&self, ws: &WorkerSlot, st: &mut WriterState) {
        let Some(limit) = st.prefix_limit else { return };
        while st.chains.len() > limit {
            let Some(old) = st.chains.pop_front() else {
                break;
            };
            self.forget_chain_locked(ws, st, &old);
        }
        ws.approx_blocks
            .store(st.lru.map.len() as u64, Ordering::Relaxed);
    }

    fn forget_chain_locked(&self, ws: &WorkerSlot, st: &mut WriterState, chain: &[BlockKey]) {
        let kept: HashSet<BlockKey> = st.chains.iter().flatten().copied().collect();
        for k in chain {
            if !kept.contains(k) && st.lru.map.remove(k).is_some() {
                self.remove_approx_entry(ws.slot, *k);
            }
        }
    }

    /// Drops every expired approximate holding now (queries already ignore them); returns how
    /// many were dropped. Call it periodically to bound memory.
    pub fn expire_approximate(&self) -> usize {
        let now = self.clock.now();
        let slots: Vec<Arc<WorkerSlot>> = self
            .workers
            .read()
            .slots
            .iter()
            .flatten()
            .cloned()
            .collect();
        let mut n = 0;
        for ws in slots {
            let mut st = ws.writer.lock();
            if ws.alive.load(Ordering::Acquire) {
                n += self.expire_locked(&ws, &mut st, now);
            }
        }
        n
    }

    /// Forgets every approximate holding of `worker` (e.g. it started sending events).
    pub fn clear_approximate(&self, worker: &WorkerId) -> Result<(), IndexError> {
        let ws = self.slot_of(worker)?;
        let mut st = ws.writer.lock();
        self.clear_approx_locked(&ws, &mut st);
        Ok(())
    }

    fn expire_locked(&self, ws: &WorkerSlot, st: &mut WriterState, now: Instant) -> usize {
        let mut n = 0;
        while let Some(k) = st.lru.pop_front_if(|exp| exp <= now) {
            self.remove_approx_entry(ws.slot, k);
            n += 1;
        }
        ws.approx_blocks
            .store(st.lru.map.len() as u64, Ordering::Relaxed);
        n
    }

    fn clear_approx_locked(&self, ws: &WorkerSlot, st: &mut WriterState) {
        st.chains.clear();
        let lru = std::mem::take(&mut st.lru);
        for (k, _) in lru.map {
            self.remove_approx_entry(ws.slot, k);
        }
        ws.approx_blocks.store(0, Ordering::Relaxed);
    }

    fn remove_approx_entry(&self, slot: u32, key: BlockKey) {
        let mut shard = self.approx[self.shard_of(key)].write();
        if let Some(v) = shard.get_mut(&key) {
            if let Ok(i) = v.binary_search_by_key(&slot, |e| e.0) {
                v.remove(i);
                self.approx_entries.fetch_sub(1, Ordering::Relaxed);
            }
            if v.is_empty() {
                shard.remove(&key);
            }
        }
    }

    // -- queries ------------------------------------------------------------------------------

    /// Every worker's longest matched prefix of the chain `keys` (in blocks), precise and
    /// approximate, in one pass each. Only workers that match at least one block appear; sorted
    /// by `blocks` descending, then worker id. See the module docs for the cost.
    pub fn longest_matches(&self, keys: &[BlockKey]) -> Vec<WorkerMatch> {
        let workers = self.workers.read();
        let mut precise = Vec::new();
        self.walk_precise(keys, &mut precise);
        let mut approx = Vec::new();
        if self.approx_entries.load(Ordering::Relaxed) > 0 {
            self.walk_approx(keys, self.clock.now(), &mut approx);
        }
        precise.sort_unstable();
        approx.sort_unstable();
        let mut out = Vec::with_capacity(precise.len().max(approx.len()));
        let (mut i, mut j) = (0, 0);
        while i < precise.len() || j < approx.len() {
            let (slot, p, a) = match (precise.get(i), approx.get(j)) {
                (Some(&(sp, lp)), Some(&(sa, la))) if sp == sa => {
                    i += 1;
                    j += 1;
                    (sp, lp, la)
                }
                (Some(&(sp, lp)), Some(&(sa, _))) if sp < sa => {
                    i += 1;
                    (sp, lp, 0)
                }
                (Some(&(sp, lp)), None) => {
                    i += 1;
                    (sp, lp, 0)
                }
                (_, Some(&(sa, la))) => {
                    j += 1;
                    (sa, 0, la)
                }
                (None, None) => break,
            };
            if let Some(Some(ws)) = workers.slots.get(slot as usize) {
                if ws.alive.load(Ordering::Acquire) {
                    out.push(WorkerMatch {
                        worker: ws.id.clone(),
                        blocks: p.max(a),
                        precise_blocks: p,
                        approximate_blocks: a,
                    });
                }
            }
        }
        out.sort_unstable_by(|x, y| {
            y.blocks
                .cmp(&x.blocks)
                .then_with(|| x.worker.cmp(&y.worker))
        });
        out
    }

    /// Pushes `(slot, matched blocks)` for every slot matching ≥ 1 block precisely.
    ///
    /// The first key is looked up alone (most chains nobody holds stop there). Then the read
    /// locks of every shard the rest of the chain touches are taken once, in ascending order,
    /// and the walk continues without further atomics: independent lookups can then overlap
    /// their cache misses, which per-key locking (a locked instruction per key) prevents. Writers
    /// hold one shard at a time and never wait while holding one, so this cannot deadlock.
    fn walk_precise(&self, keys: &[BlockKey], out: &mut Vec<(u32, usize)>) {
        let Some((&first, rest)) = keys.split_first() else {
            return;
        };
        let mut active: Vec<Word> = Vec::new();
        match self.precise[self.shard_of(first)].read().get(&first) {
            Some(h) => h.with_words(|w| active.extend_from_slice(w)),
            None => return,
        }
        if rest.is_empty() {
            for_each_slot(&active, |s| out.push((s, 1)));
            return;
        }
        let shard_ids: Vec<u16> = rest.iter().map(|&k| self.shard_of(k) as u16).collect();
        let mut needed = vec![false; self.precise.len()];
        for &s in &shard_ids {
            needed[s as usize] = true;
        }
        let guards: Vec<Option<RwLockReadGuard<'_, PreciseShard>>> = self
            .precise
            .iter()
            .zip(&needed)
            .map(|(shard, &need)| need.then(|| shard.read()))
            .collect();
        for (j, (&k, &s)) in rest.iter().zip(&shard_ids).enumerate() {
            let i = j + 1;
            let holders = guards[s as usize].as_ref().and_then(|g| g.get(&k));
            match holders {
                None => {
                    for_each_slot(&active, |s| out.push((s, i)));
                    return;
                }
                Some(h) => h.with_words(|w| intersect_into(&mut active, w, |s| out.push((s, i)))),
            }
            if active.is_empty() {
                return;
            }
        }
        for_each_slot(&active, |s| out.push((s, keys.len())));
    }

    /// Like [`Self::walk_precise`] over unexpired approximate holdings.
    fn walk_approx(&self, keys: &[BlockKey], now: Instant, out: &mut Vec<(u32, usize)>) {
        let mut active: Vec<Word> = Vec::new();
        let mut here: Vec<Word> = Vec::new();
        for (i, &k) in keys.iter().enumerate() {
            here.clear();
            if let Some(v) = self.approx[self.shard_of(k)].read().get(&k) {
                words_from_slots(v.iter().filter(|e| e.1 > now).map(|e| e.0), &mut here);
            }
            if i == 0 {
                std::mem::swap(&mut active, &mut here);
            } else {
                intersect_into(&mut active, &here, |s| out.push((s, i)));
            }
            if active.is_empty() {
                return;
            }
        }
        for_each_slot(&active, |s| out.push((s, keys.len())));
    }

    /// Bytes allocated by the precise index's maps, computed from their capacities (hashbrown
    /// layout: one control byte per bucket plus the entries) and the spilled holder lists.
    /// The memory test checks it against a counting allocator.
    pub fn precise_heap_bytes(&self) -> usize {
        let entry = std::mem::size_of::<(BlockKey, Holders)>();
        self.precise
            .iter()
            .map(|s| {
                let s = s.read();
                let cap = s.capacity();
                let buckets = if cap == 0 {
                    0
                } else if cap < 8 {
                    (cap + 1).next_power_of_two()
                } else {
                    (cap * 8 / 7).next_power_of_two()
                };
                let table = if buckets == 0 {
                    0
                } else {
                    buckets * (entry + 1) + 16
                };
                table + s.values().map(Holders::heap_bytes).sum::<usize>()
            })
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::ManualClock;

    fn w(s: &str) -> WorkerId {
        WorkerId(s.to_owned())
    }

    fn keys(range: std::ops::Range<u64>) -> Vec<BlockKey> {
        range.map(BlockKey).collect()
    }

    fn stored(ks: &[BlockKey]) -> KvEvent {
        KvEvent::Stored {
            parent: None,
            keys: ks.to_vec(),
        }
    }

    fn summary(m: &[WorkerMatch]) -> Vec<(String, usize, usize, usize)> {
        m.iter()
            .map(|m| {
                (
                    m.worker.0.clone(),
                    m.blocks,
                    m.precise_blocks,
                    m.approximate_blocks,
                )
            })
            .collect()
    }

    fn small() -> (PrefixIndex, ManualClock) {
        let clock = ManualClock::new();
        let idx = PrefixIndex::with_clock(
            IndexConfig {
                shards: 4,
                approximate_ttl: Duration::from_secs(10),
                approximate_capacity: 3,
            },
            Arc::new(clock.clone()),
        )
        .unwrap();
        (idx, clock)
    }

    #[test]
    fn config_validation_names_every_problem() {
        let err = IndexConfig {
            shards: 3,
            approximate_ttl: Duration::ZERO,
            approximate_capacity: 0,
        }
        .validate()
        .unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("shards = 3") && msg.contains("ttl") && msg.contains("capacity"));
        assert_eq!(err.error_type(), "invalid_config");
        assert!(IndexConfig::default().validate().is_ok());
        assert!(PrefixIndex::new(IndexConfig {
            shards: 8192,
            ..IndexConfig::default()
        })
        .is_err());
    }

    #[test]
    fn longest_prefix_per_worker() {
        let (idx, _) = small();
        for n in ["a", "b", "c", "d"] {
            idx.add_worker(&w(n));
        }
        let chain = keys(100..110);
        idx.apply_event(&w("a"), &stored(&chain[..3])).unwrap();
        idx.apply_event(&w("b"), &stored(&chain)).unwrap();
        // c holds blocks 1.. but not block 0: no prefix
        idx.apply_event(&w("c"), &stored(&chain[1..])).unwrap();
        // d holds 0,1 and 3: prefix 2
        idx.apply_event(&w("d"), &stored(&[chain[0], chain[1], chain[3]]))
            .unwrap();
        assert_eq!(
            summary(&idx.longest_matches(&chain)),
            vec![
                ("b".into(), 10, 10, 0),
                ("a".into(), 3, 3, 0),
                ("d".into(), 2, 2, 0)
            ]
        );
        assert!(idx.longest_matches(&[]).is_empty());
        assert!(idx.longest_matches(&keys(5000..5003)).is_empty());
        assert_eq!(idx.holders(chain[1]), vec![w("a"), w("b"), w("c"), w("d")]);
    }

    #[test]
    fn events_are_idempotent_and_counted() {
        let (idx, _) = small();
        idx.add_worker(&w("a"));
        let chain = keys(1..6);
        for _ in 0..3 {
            idx.apply_event(&w("a"), &stored(&chain)).unwrap();
        }
        assert_eq!(idx.worker_stats(&w("a")).unwrap().precise_blocks, 5);
        let rm = KvEvent::Removed {
            keys: vec![chain[4], chain[4], BlockKey(999)],
        };
        idx.apply_event(&w("a"), &rm).unwrap();
        idx.apply_event(&w("a"), &rm).unwrap();
        assert_eq!(idx.worker_stats(&w("a")).unwrap().precise_blocks, 4);
        assert_eq!(
            summary(&idx.longest_matches(&chain)),
            vec![("a".into(), 4, 4, 0)]
        );
        idx.apply_event(&w("a"), &KvEvent::Cleared).unwrap();
        idx.apply_event(&w("a"), &KvEvent::Cleared).unwrap();
        assert_eq!(idx.worker_stats(&w("a")).unwrap().precise_blocks, 0);
        assert_eq!(idx.precise_keys(), 0);
        assert!(idx.longest_matches(&chain).is_empty());
    }

    #[test]
    fn unknown_and_removed_workers() {
        let (idx, _) = small();
        let err = idx.apply_event(&w("x"), &KvEvent::Cleared).unwrap_err();
        assert_eq!(err.error_type(), "unknown_worker");
        assert!(idx.add_worker(&w("a")));
        assert!(!idx.add_worker(&w("a")));
        assert!(idx.add_worker(&w("b")));
        idx.apply_event(&w("a"), &stored(&keys(1..4))).unwrap();
        idx.apply_event(&w("b"), &stored(&keys(1..3))).unwrap();
        idx.insert_approximate(&w("a"), &keys(1..2)).unwrap();
        assert!(idx.remove_worker(&w("a")));
        assert!(!idx.remove_worker(&w("a")));
        assert_eq!(idx.workers(), vec![w("b")]);
        assert!(idx.worker_stats(&w("a")).is_none());
        assert!(idx.insert_approximate(&w("a"), &keys(1..2)).is_err());
        // the slot is reused by a new worker, which must not inherit anything
        assert!(idx.add_worker(&w("c")));
        assert_eq!(idx.workers(), vec![w("c"), w("b")]);
        assert_eq!(
            summary(&idx.longest_matches(&keys(1..4))),
            vec![("b".into(), 2, 2, 0)]
        );
        assert_eq!(idx.precise_keys(), 2);
        assert_eq!(idx.approx_entries.load(Ordering::Relaxed), 0);
    }

    #[test]
    fn envelopes_follow_the_stream_protocol() {
        let (idx, _) = small();
        let a = w("a");
        idx.add_worker(&a);
        let env = |epoch, seq, event| KvEventEnvelope { epoch, seq, event };
        let apply = |e: KvEventEnvelope| idx.apply_envelope(&a, &e).unwrap();
        let blocks = || idx.worker_stats(&a).unwrap().precise_blocks;
        assert_eq!(
            apply(env(1, 10, stored(&keys(1..3)))),
            EnvelopeOutcome::Applied
        );
        assert_eq!(
            apply(env(1, 11, stored(&keys(3..4)))),
            EnvelopeOutcome::Applied
        );
        // A replayed live event is ignored.
        assert_eq!(
            apply(env(1, 11, stored(&keys(9..10)))),
            EnvelopeOutcome::Duplicate
        );
        assert_eq!(blocks(), 3);
        // A gap is reported and NOT applied: the position stays, so a resubscription from it
        // gets the missed events.
        assert_eq!(
            apply(env(1, 14, stored(&keys(4..5)))),
            EnvelopeOutcome::Gap {
                expected: 12,
                got: 14
            }
        );
        assert_eq!(blocks(), 3);
        assert_eq!(idx.worker_stats(&a).unwrap().last_event, Some((1, 11)));
        // A snapshot after resuming at 11: `cleared` and every `stored` of it carry seq 11...
        assert_eq!(
            apply(env(1, 11, KvEvent::Cleared)),
            EnvelopeOutcome::Applied
        );
        assert_eq!(blocks(), 0);
        assert_eq!(
            apply(env(1, 11, stored(&keys(1..3)))),
            EnvelopeOutcome::Applied
        );
        assert_eq!(
            apply(env(1, 11, stored(&keys(5..6)))),
            EnvelopeOutcome::Applied
        );
        assert_eq!(blocks(), 3);
        // ...then live events continue at 12, which closes the snapshot.
        assert_eq!(
            apply(env(1, 12, stored(&keys(6..7)))),
            EnvelopeOutcome::Applied
        );
        assert_eq!(
            apply(env(1, 12, stored(&keys(9..10)))),
            EnvelopeOutcome::Duplicate
        );
        assert_eq!(blocks(), 4);
        // An old `cleared` (seq before the position) is a replay, not a reset.
        assert_eq!(
            apply(env(1, 5, KvEvent::Cleared)),
            EnvelopeOutcome::Duplicate
        );
        assert_eq!(blocks(), 4);
        // Another epoch, numerically smaller or larger (epochs are random): the cache restarted.
        assert_eq!(
            apply(env(0, 99, stored(&keys(7..8)))),
            EnvelopeOutcome::NewEpoch { previous: 1 }
        );
        let st = idx.worker_stats(&a).unwrap();
        assert_eq!(st.precise_blocks, 1);
        assert_eq!(st.last_event, Some((0, 99)));
        assert!(idx.longest_matches(&keys(1..3)).is_empty());
        // The largest seq does not overflow.
        assert_eq!(
            apply(env(0, u64::MAX, stored(&keys(8..9)))),
            EnvelopeOutcome::Gap {
                expected: 100,
                got: u64::MAX
            }
        );
        assert_eq!(
            apply(env(0, u64::MAX, KvEvent::Cleared)),
            EnvelopeOutcome::Applied
        );
        assert_eq!(
            apply(env(0, u64::MAX, stored(&keys(8..9)))),
            EnvelopeOutcome::Applied
        );
        assert_eq!(
            apply(env(0, u64::MAX, KvEvent::Cleared)),
            EnvelopeOutcome::Applied
        );
        assert_eq!(blocks(), 0);
    }

    #[test]
    fn approximate_prefix_limit_models_a_slot_cache() {
        let idx = PrefixIndex::new(IndexConfig::default()).unwrap();
        let a = w("a");
        idx.add_worker(&a);
        idx.set_approximate_prefixes(&a, Some(2)).unwrap();
        let conv1 = keys(1..4);
        let conv2 = keys(10..13);
        let conv3 = keys(20..22);
        idx.insert_approximate(&a, &conv1).unwrap();
        idx.insert_approximate(&a, &conv2).unwrap();
        assert_eq!(idx.worker_stats(&a).unwrap().approximate_blocks, 6);
        // conv1's next turn takes conv1's slot: its keys stay, nothing else is dropped
        let conv1_next = keys(1..6);
        idx.insert_approximate(&a, &conv1_next).unwrap();
        assert_eq!(idx.worker_stats(&a).unwrap().approximate_blocks, 8);
        // a third prompt evicts the oldest slot (conv2), not conv1
        idx.insert_approximate(&a, &conv3).unwrap();
        assert_eq!(summary(&idx.longest_matches(&conv2)), vec![]);
        assert_eq!(
            summary(&idx.longest_matches(&conv1_next)),
            vec![("a".into(), 5, 0, 5)]
        );
        assert_eq!(idx.worker_stats(&a).unwrap().approximate_blocks, 7);
        assert_eq!(idx.approx_entries.load(Ordering::Relaxed), 7);
        // lowering the limit drops the oldest now; lifting it keeps what is held
        idx.set_approximate_prefixes(&a, Some(1)).unwrap();
        assert_eq!(summary(&idx.longest_matches(&conv1_next)), vec![]);
        assert_eq!(idx.worker_stats(&a).unwrap().approximate_blocks, 2);
        idx.set_approximate_prefixes(&a, None).unwrap();
        idx.insert_approximate(&a, &conv2).unwrap();
        assert_eq!(idx.worker_stats(&a).unwrap().approximate_blocks, 5);
    }

    #[test]
    fn approximate_ttl_and_lru_capacity_are_apart_from_precise() {
        let (idx, clock) = small();
        let (a, b) = (w("a"), w("b"));
        idx.add_worker(&a);
        idx.add_worker(&b);
        let chain = keys(1..6);
        idx.insert_approximate(&a, &chain[..3]).unwrap();
        idx.apply_event(&b, &stored(&chain[..1])).unwrap();
        assert_eq!(
            summary(&idx.longest_matches(&chain)),
            vec![("a".into(), 3, 0, 3), ("b".into(), 1, 1, 0)]
        );
        // capacity 3: touching key 1 again then adding key 4 evicts key 2 (LRU), not key 1
        clock.advance(Duration::from_secs(5));
        idx.insert_approximate(&a, &chain[..1]).unwrap();
        idx.insert_approximate(&a, &chain[3..4]).unwrap();
        assert_eq!(idx.worker_stats(&a).unwrap().approximate_blocks, 3);
        assert_eq!(
            summary(&idx.longest_matches(&chain)),
            vec![("a".into(), 1, 0, 1), ("b".into(), 1, 1, 0)]
        );
        // at t=10 key 3 (inserted at t=0) has expired; key 1 (refreshed at t=5) lives on
        clock.advance(Duration::from_secs(5));
        assert_eq!(idx.longest_matches(&chain[..1]).len(), 2);
        clock.advance(Duration::from_secs(5));
        assert_eq!(
            summary(&idx.longest_matches(&chain)),
            vec![("b".into(), 1, 1, 0)]
        );
        // at t=15 keys 1 and 4 expire too
        assert_eq!(idx.expire_approximate(), 3);
        assert_eq!(idx.worker_stats(&a).unwrap().approximate_blocks, 0);
        assert_eq!(idx.approx_entries.load(Ordering::Relaxed), 0);
        // precise holdings untouched by approximate expiry
        assert_eq!(idx.worker_stats(&b).unwrap().precise_blocks, 1);
        idx.insert_approximate(&a, &chain).unwrap();
        idx.clear_approximate(&a).unwrap();
        assert_eq!(idx.approx_entries.load(Ordering::Relaxed), 0);
    }

    #[test]
    fn removed_approximate_keys_are_forgotten_and_the_rest_kept() {
        let (idx, _) = small();
        let (a, b) = (w("a"), w("b"));
        idx.add_worker(&a);
        idx.add_worker(&b);
        let chain = keys(1..4);
        idx.insert_approximate(&a, &chain).unwrap();
        idx.insert_approximate(&b, &chain[..1]).unwrap();
        idx.apply_event(&a, &stored(&chain[..1])).unwrap();
        // A moved routing-time holding: keys 2 and 3 forgotten on `a`; key 1 stays (precise and
        // approximate), `b`'s untouched; a key `a` never held is skipped.
        idx.remove_approximate(&a, &chain[1..]).unwrap();
        idx.remove_approximate(&a, &keys(9..10)).unwrap();
        assert_eq!(
            summary(&idx.longest_matches(&chain)),
            vec![("a".into(), 1, 1, 1), ("b".into(), 1, 0, 1)]
        );
        assert_eq!(idx.worker_stats(&a).unwrap().approximate_blocks, 1);
        assert_eq!(idx.approx_entries.load(Ordering::Relaxed), 2);
        assert!(idx.remove_approximate(&w("nobody"), &chain).is_err());
    }

    #[test]
    fn many_workers_across_words() {
        let (idx, _) = small();
        let chain = keys(1..9);
        for i in 0..200u64 {
            let id = w(&format!("w{i:03}"));
            idx.add_worker(&id);
            let n = (i % 9) as usize;
            idx.apply_event(&id, &stored(&chain[..n])).unwrap();
        }
        let m = idx.longest_matches(&chain);
        assert_eq!(m.len(), 200 - 200usize.div_ceil(9));
        for x in &m {
            let i: u64 = x.worker.0[1..].parse().unwrap();
            assert_eq!(x.blocks as u64, i % 9);
        }
        assert!(m.windows(2).all(|p| p[0].blocks >= p[1].blocks));
    }

    #[test]
    fn concurrent_readers_and_writers() {
        let idx = Arc::new(PrefixIndex::new(IndexConfig::default()).unwrap());
        let chain = keys(1..65);
        for i in 0..4 {
            idx.add_worker(&w(&format!("w{i}")));
        }
        std::thread::scope(|s| {
            for i in 0..4 {
                let idx = &idx;
                let chain = &chain;
                s.spawn(move || {
                    let id = w(&format!("w{i}"));
                    for round in 0..200 {
                        let n = (round * 7 + i) % 64 + 1;
                        idx.apply_event(&id, &stored(&chain[..n])).unwrap();
                        idx.apply_event(
                            &id,
                            &KvEvent::Removed {
                                keys: chain[n / 2..].to_vec(),
                            },
                        )
                        .unwrap();
                    }
                });
            }
            for _ in 0..2 {
                let idx = &idx;
                let chain = &chain;
                s.spawn(move || {
                    for _ in 0..500 {
                        for m in idx.longest_matches(chain) {
                            assert!(m.blocks >= 1 && m.blocks <= 64);
                        }
                    }
                });
            }
        });
        // final state is each writer's last event pair
        for i in 0..4usize {
            let n = (199 * 7 + i) % 64 + 1;
            let st = idx.worker_stats(&w(&format!("w{i}"))).unwrap();
            assert_eq!(st.precise_blocks as usize, n / 2);
        }
    }

    #[test]
    fn heap_estimate_is_positive_and_grows() {
        let (idx, _) = small();
        idx.add_worker(&w("a"));
        let before = idx.precise_heap_bytes();
        idx.apply_event(&w("a"), &stored(&keys(1..1000))).unwrap();
        assert!(idx.precise_heap_bytes() > before + 999 * 16);
    }
}
