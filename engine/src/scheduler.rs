//! Continuous batching: which sequences run, and which tokens of each go into the next
//! forward step.
//!
//! Owns the waiting queue, the running set, the [`KvCache`] (blocks, prefix cache,
//! reservations) and each sequence's block table and key chain. Does not own sampling, text
//! or event delivery: a sequence carries an opaque payload `P` for the engine.
//!
//! Policy, per step:
//! 1. **Admission** (FCFS with bounded bypass): a waiting sequence is admitted when a running
//!    slot is free and the pool can hold its cached prefix plus a reservation for every block
//!    it may still need — `ceil((prompt + max_tokens − 1) / B)` blocks in all (the last
//!    sampled token's K/V is never computed), cached prefix blocks counting as already held.
//!    When the head of the queue does not fit, later (smaller) requests may be admitted
//!    past it, but at most `max_running` times in a row, so the head cannot starve.
//! 2. **Prefix reuse** at admission: the longest verified cached prefix (see
//!    [`crate::kv::prefix_cache`]), at most `floor((prompt − 1) / B)` blocks, so the last
//!    prompt token is always computed (its logits start the answer); then, inside the next
//!    block, the longer of a kept tail's shared tokens (adopted: [`crate::kv`], "Tails") and a
//!    cached block's shared first tokens (copied into the request's own block:
//!    [`BlockCopy`], when the executor copies blocks), again never the last prompt token. A waiting sequence whose
//!    next uncached prompt block is being computed by a running, prefilling sequence (the same
//!    key at the same position, not yet registered) is not admitted yet: it waits for that
//!    block to land in the prefix cache (within the other's prefill) rather than compute it a
//!    second time, and is admitted once its next block is nobody's work in progress.
//!    A sequence that wants its prompt's log probabilities ([`SeqSpec::prompt_logits`]) reuses
//!    nothing and waits for nobody: a reused position has no logits.
//! 3. **Decodes first**: every running sequence that has a sampled token gets a one-token
//!    chunk.
//! 4. **Chunked prefill** with the rest of the token budget: first the sequences whose
//!    remaining prompt fits in one chunk (`≤ prefill_chunk`), smallest first, using at most
//!    half the budget — a short request is never queued behind long prefills; then
//!    round-robin over the other prefilling sequences (the rotation resumes after the last
//!    one served), one chunk of `≤ prefill_chunk` tokens each until the budget is spent.
//!
//! After a step, [`Scheduler::complete`] advances each sequence and offers every newly full
//! block to the prefix cache — prompt blocks and, once full, blocks of generated tokens too,
//! so the next turn of a chat reuses prompt + answer — unless the request opted out
//! (`cache_insert = false`: its blocks are freed unkeyed; it may still *read* the cache).
//!
//! Complexity per step: O(R log R + W) for R running and W examined waiting sequences,
//! plus O(B) per block allocated/registered and O(m × B) per lookup of an m-block prefix.

use std::collections::VecDeque;
use std::time::Instant;

use prefix_index::key::{ChainLink, KeyChain};
use prefix_index::BlockKey;

use crate::executor::{BlockId, KvGeometry, SeqChunk};
use crate::kv::prefix_cache::ContentRef;
use crate::kv::{BlockParent, KvCache};
use crate::EngineError;

/// Engine-wide id of a sequence (submission order).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SeqId(pub u64);

/// Scheduling limits.
#[derive(Clone, Debug)]
pub struct SchedulerConfig {
    /// Sequences admitted at once (≥ 1).
    pub max_running: usize,
    /// Tokens per forward step (≥ `max_running`, so all decodes always fit).
    pub step_token_budget: usize,
    /// Largest prefill chunk of one sequence in one step (≥ 1).
    pub prefill_chunk: usize,
    /// Reuse the first tokens of a cached block by copying it ([`BlockCopy`]; only for an
    /// executor that copies blocks, [`crate::executor::Executor::copies_blocks`]).
    pub copy_partial_blocks: bool,
    /// Largest prompt chunk of a sequence that wants every position's logits
    /// ([`SeqSpec::prompt_logits`]; ≥ 1): [`prompt_logits_chunk`] of the vocabulary.
    pub prompt_logits_chunk: usize,
}

/// A copy the caller runs after [`Scheduler::admit`] and before the next step
/// ([`Scheduler::take_copies`], [`Scheduler::copies_done`]): block `src` (a cached block, pinned
/// until then) into `dst` (the first block `seq` writes), whose first tokens `seq` reuses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockCopy {
    /// The admitted sequence.
    pub seq: SeqId,
    /// The cached block.
    pub src: BlockId,
    /// The sequence's own block.
    pub dst: BlockId,
}

/// Blocks a request needs in all: K/V of the prompt and of every generated token but the last.
pub fn blocks_needed(block_size: usize, prompt_len: usize, max_tokens: usize) -> usize {
    (prompt_len + max_tokens.max(1) - 1).div_ceil(block_size.max(1))
}

/// Rejects a request that could never be admitted, even into an empty pool of `geometry`
/// (`NeverFits`). The engine checks it at submit, before a request is queued.
pub fn check_fits(
    geometry: KvGeometry,
    prompt_len: usize,
    max_tokens: usize,
) -> Result<(), EngineError> {
    let needed = blocks_needed(geometry.block_size, prompt_len, max_tokens);
    if needed > geometry.num_blocks {
        return Err(EngineError::NeverFits {
            needed,
            total: geometry.num_blocks,
        });
    }
    Ok(())
}

/// What the engine asks the scheduler to run.
#[derive(Clone, Debug)]
pub struct SeqSpec {
    /// Prompt token ids (non-empty).
    pub prompt: Vec<u32>,
    /// Key namespace of the prompt's blocks.
    pub chain: KeyChain,
    /// Most tokens to generate (≥ 1).
    pub max_tokens: usize,
    /// False: nothing of this sequence enters the prefix cache.
    pub cache_insert: bool,
    /// When it was submitted.
    pub submitted_at: Instant,
    /// Admission deadline.
    pub deadline: Instant,
    /// Every prompt position's logits are wanted (a prompt's log probabilities): the sequence
    /// computes its whole prompt — no prefix reuse of any kind, since a reused position has no
    /// logits — in chunks of at most [`SchedulerConfig::prompt_logits_chunk`] tokens. Its blocks still enter the
    /// prefix cache (unless `cache_insert` is false).
    pub prompt_logits: bool,
}

/// The logits one step may return for a sequence that wants every position's: its prompt chunks
/// are cut to fit ([`prompt_logits_chunk`]).
pub const PROMPT_LOGITS_BYTES: usize = 32 << 20;

/// The longest prompt chunk of a sequence that wants every position's logits, for a vocabulary
/// of `vocab` ids: as many rows of F32 logits as [`PROMPT_LOGITS_BYTES`] holds, at least 1 —
/// 170 tokens for a 49,152-token vocabulary, 32 for 262,144.
pub fn prompt_logits_chunk(vocab: usize) -> usize {
    (PROMPT_LOGITS_BYTES / (vocab.max(1) * std::mem::size_of::<f32>())).max(1)
}

/// One sequence: tokens, block table, key chain, progress.
#[derive(Debug)]
pub struct Sequence<P> {
    /// Its id.
    pub id: SeqId,
    /// Engine data (sampler, channel, …).
    pub payload: P,
    tokens: Vec<u32>,
    prompt_len: usize,
    max_tokens: usize,
    num_computed: usize,
    block_table: Vec<BlockId>,
    /// Chain position of every full block of `tokens` hashed so far (`links[i]` = block i).
    links: Vec<ChainLink>,
    /// The cached content that represents block i (None: not cached).
    canon: Vec<Option<ContentRef>>,
    /// Full blocks already offered to the cache.
    registered: usize,
    reserved_total: usize,
    cached_tokens: usize,
    chain: KeyChain,
    cache_insert: bool,
    prompt_logits: bool,
    submitted_at: Instant,
    admitted_at: Option<Instant>,
    deadline: Instant,
}

impl<P> Sequence<P> {
    /// Prompt + generated tokens.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }
    /// Prompt length.
    pub fn prompt_len(&self) -> usize {
        self.prompt_len
    }
    /// Tokens generated so far.
    pub fn generated(&self) -> &[u32] {
        &self.tokens[self.prompt_len..]
    }
    /// The payload.
    pub fn payload(&self) -> &P {
        &self.payload
    }
    /// The payload (mutable) and every token (prompt, then generated), borrowed together.
    pub fn payload_and_tokens(&mut self) -> (&mut P, &[u32]) {
        (&mut self.payload, &self.tokens)
    }
    /// The payload (mutable) and the generated tokens, borrowed together.
    pub fn payload_and_generated(&mut self) -> (&mut P, &[u32]) {
        (&mut self.payload, &self.tokens[self.prompt_len..])
    }
    /// Max tokens to generate.
    pub fn max_tokens(&self) -> usize {
        self.max_tokens
    }
    /// Prompt tokens served from the prefix cache.
    pub fn cached_tokens(&self) -> usize {
        self.cached_tokens
    }
    /// Tokens whose K/V is in the blocks.
    pub fn num_computed(&self) -> usize {
        self.num_computed
    }
    /// The block table.
    pub fn block_table(&self) -> &[BlockId] {
        &self.block_table
    }
    /// Submission time.
    pub fn submitted_at(&self) -> Instant {
        self.submitted_at
    }
    /// Admission time (None while waiting).
    pub fn admitted_at(&self) -> Option<Instant> {
        self.admitted_at
    }
    /// Key of the last full block of the prompt.
    pub fn last_prompt_block_key(&self) -> Option<BlockKey> {
        let n = self.prompt_len / self.chain.block_size().get();
        n.checked_sub(1)
            .and_then(|i| self.links.get(i))
            .map(|l| l.key())
    }
    /// Output tokens it may still generate.
    fn remaining_output(&self) -> usize {
        let generated = self.tokens.len().saturating_sub(self.prompt_len);
        self.max_tokens.saturating_sub(generated)
    }
    /// Still computing its prompt.
    pub fn is_prefilling(&self) -> bool {
        self.num_computed < self.prompt_len
    }
    /// Has a sampled token whose K/V the next step computes.
    fn is_decoding(&self) -> bool {
        self.num_computed >= self.prompt_len && self.num_computed + 1 == self.tokens.len()
    }
    fn block_size(&self) -> usize {
        self.chain.block_size().get()
    }
}

/// One sequence's share of the next step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Scheduled {
    /// The sequence.
    pub id: SeqId,
    /// First position computed.
    pub start: usize,
    /// Number of tokens.
    pub len: usize,
    /// Logits wanted (last prompt chunk or a decode).
    pub want_logits: bool,
    /// Every token's logits wanted: a prompt chunk of a sequence that reports its prompt's
    /// log probabilities ([`SeqSpec::prompt_logits`]).
    pub all_logits: bool,
}

/// Waiting queue, running set and KV bookkeeping.
#[derive(Debug)]
pub struct Scheduler<P> {
    cfg: SchedulerConfig,
    kv: KvCache,
    waiting: VecDeque<Sequence<P>>,
    running: Vec<Sequence<P>>,
    /// Id of the last sequence served by the round-robin prefill pass.
    rr_last: Option<SeqId>,
    /// Admissions that bypassed the current head of the queue.
    head_bypassed: usize,
    head_id: Option<SeqId>,
    /// Copies admitted but not yet run (their sources pinned).
    copies: Vec<BlockCopy>,
}

impl<P> Scheduler<P> {
    /// A scheduler over a pool of the executor's geometry.
    pub fn new(cfg: SchedulerConfig, geometry: KvGeometry) -> Self {
        Scheduler {
            kv: KvCache::new(geometry.num_blocks, geometry.block_size),
            cfg,
            waiting: VecDeque::new(),
            running: Vec::new(),
            rr_last: None,
            head_bypassed: 0,
            head_id: None,
            copies: Vec::new(),
        }
    }

    /// The KV bookkeeping.
    pub fn kv(&self) -> &KvCache {
        &self.kv
    }

    /// Mutable KV bookkeeping (tests plant cache entries through it).
    #[doc(hidden)]
    pub fn kv_mut(&mut self) -> &mut KvCache {
        &mut self.kv
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.kv.block_size()
    }

    /// Sequences waiting for admission.
    pub fn waiting_len(&self) -> usize {
        self.waiting.len()
    }

    /// Admitted sequences.
    pub fn running_len(&self) -> usize {
        self.running.len()
    }

    /// Queued work in tokens, as the KV event stream's `load` message reports it (see
    /// [`prefix_index::WorkerLoad`]): (prompt tokens not computed yet, output tokens still
    /// allowed), over waiting and running sequences. A running sequence counts the rest of its
    /// prompt; a waiting one its prompt minus the leading blocks whose keys are in the prefix
    /// cache or being computed by a running sequence (it will reuse those, see the module
    /// docs; keys only, so an estimate). O(running blocks + waiting blocks).
    pub fn queued_tokens(&self) -> (usize, usize) {
        let mut prefill = 0usize;
        let mut decode = 0usize;
        let mut in_progress = std::collections::HashSet::new();
        for s in &self.running {
            prefill = prefill.saturating_add(s.prompt_len.saturating_sub(s.num_computed));
            decode = decode.saturating_add(s.remaining_output());
            if !self.waiting.is_empty() && s.cache_insert && s.is_prefilling() {
                in_progress.extend(s.links.iter().skip(s.registered).map(|l| l.key()));
            }
        }
        let b = self.block_size();
        for s in &self.waiting {
            let reusable = s
                .links
                .iter()
                .take(match s.prompt_logits {
                    true => 0,
                    false => s.prompt_len.saturating_sub(1) / b,
                })
                .take_while(|l| {
                    let k = l.key();
                    in_progress.contains(&k) || self.kv.cache().get(k).is_some()
                })
                .count();
            prefill = prefill.saturating_add(s.prompt_len.saturating_sub(reusable * b));
            decode = decode.saturating_add(s.remaining_output());
        }
        (prefill, decode)
    }

    /// Earliest admission deadline among waiting sequences.
    pub fn next_deadline(&self) -> Option<Instant> {
        self.waiting.iter().map(|s| s.deadline).min()
    }

    /// The running sequences (admission order).
    pub fn running(&self) -> &[Sequence<P>] {
        &self.running
    }

    /// A running sequence.
    pub fn get(&self, id: SeqId) -> Option<&Sequence<P>> {
        self.running.iter().find(|s| s.id == id)
    }

    /// A running sequence, mutably (payload access).
    pub fn get_mut(&mut self, id: SeqId) -> Option<&mut Sequence<P>> {
        self.running.iter_mut().find(|s| s.id == id)
    }

    /// Ids of every sequence, waiting or running, whose payload matches.
    pub fn ids_where(&self, mut f: impl FnMut(&P) -> bool) -> Vec<SeqId> {
        self.waiting
            .iter()
            .chain(self.running.iter())
            .filter(|s| f(&s.payload))
            .map(|s| s.id)
            .collect()
    }

    /// Queues a sequence (the caller checked [`check_fits`] and the queue bound).
    /// Hashes the prompt's full blocks: O(prompt).
    pub fn enqueue(&mut self, id: SeqId, spec: SeqSpec, payload: P) {
        let b = spec.chain.block_size().get();
        let mut links = Vec::with_capacity(spec.prompt.len() / b);
        let mut link = spec.chain.root();
        for block in spec.prompt.chunks_exact(b) {
            match spec.chain.next(&link, block) {
                Ok(l) => {
                    links.push(l);
                    link = l;
                }
                Err(_) => break,
            }
        }
        let reserved_total = blocks_needed(self.block_size(), spec.prompt.len(), spec.max_tokens);
        self.waiting.push_back(Sequence {
            id,
            payload,
            prompt_len: spec.prompt.len(),
            tokens: spec.prompt,
            max_tokens: spec.max_tokens,
            num_computed: 0,
            block_table: Vec::new(),
            links,
            canon: Vec::new(),
            registered: 0,
            reserved_total,
            cached_tokens: 0,
            chain: spec.chain,
            cache_insert: spec.cache_insert,
            prompt_logits: spec.prompt_logits,
            submitted_at: spec.submitted_at,
            admitted_at: None,
            deadline: spec.deadline,
        });
    }

    /// Removes a sequence (waiting or running) and frees its blocks and reservation.
    pub fn remove(&mut self, id: SeqId) -> Option<Sequence<P>> {
        if let Some(i) = self.waiting.iter().position(|s| s.id == id) {
            return self.waiting.remove(i);
        }
        let i = self.running.iter().position(|s| s.id == id)?;
        if let Some(c) = self.copies.iter().find(|c| c.seq == id).copied() {
            self.copies_done(&[c], &[false]);
        }
        let s = self.running.remove(i);
        self.kv
            .unreserve(s.reserved_total.saturating_sub(s.block_table.len()));
        // The last, partially computed block becomes a tail (see `KvCache::keep_tail`) when the
        // request may populate the cache and the block before it is cached.
        let b = s.block_size();
        let (h, r) = (s.num_computed / b, s.num_computed % b);
        let parent = match h {
            0 => Some(BlockParent::Root(s.chain.root().key())),
            _ => s
                .canon
                .get(h - 1)
                .copied()
                .flatten()
                .map(BlockParent::Block),
        };
        match (s.cache_insert && r > 0, parent, s.block_table.get(h)) {
            (true, Some(parent), Some(&tail)) => {
                self.kv.release(&s.block_table[h + 1..]);
                self.kv
                    .keep_tail(tail, parent, &s.tokens[h * b..s.num_computed]);
                self.kv.release(&s.block_table[..h]);
            }
            _ => self.kv.release(&s.block_table),
        }
        Some(s)
    }

    /// Removes and returns the waiting sequences whose admission deadline passed.
    pub fn expire(&mut self, now: Instant) -> Vec<Sequence<P>> {
        let mut out = Vec::new();
        let mut i = 0;
        while i < self.waiting.len() {
            if self.waiting[i].deadline <= now {
                if let Some(s) = self.waiting.remove(i) {
                    out.push(s);
                }
            } else {
                i += 1;
            }
        }
        out
    }

    /// Admits waiting sequences (see the module docs); returns the ids admitted, in order.
    /// Their prefix hits are already in their block tables.
    pub fn admit(&mut self, now: Instant) -> Vec<SeqId> {
        let mut admitted = Vec::new();
        let head = self.waiting.front().map(|s| s.id);
        if head != self.head_id {
            self.head_id = head;
            self.head_bypassed = 0;
        }
        let mut i = 0;
        while i < self.waiting.len() && self.running.len() < self.cfg.max_running {
            let s = &self.waiting[i];
            let b = self.block_size();
            // A sequence that wants every prompt position's logits reuses nothing.
            let max_hit = match s.prompt_logits {
                true => 0,
                false => (s.prompt_len - 1) / b,
            };
            let hits = self.kv.lookup(
                &s.links.iter().map(|l| l.key()).collect::<Vec<_>>(),
                &s.tokens,
                max_hit,
            );
            // Another sequence is computing this one's next prompt block right now: wait for it
            // (it lands in the prefix cache within that sequence's prefill) instead of
            // computing the same block twice.
            if let Some(next) = s.links.get(hits.len()).filter(|_| hits.len() < max_hit) {
                let at = hits.len();
                let key = next.key();
                let in_progress = self.running.iter().any(|r| {
                    r.cache_insert
                        && r.is_prefilling()
                        && r.registered <= at
                        && r.links.get(at).is_some_and(|l| l.key() == key)
                });
                if in_progress {
                    i += 1;
                    continue;
                }
            }
            // A kept tail continuing the last hit: its shared tokens are reused too (never the
            // last prompt token).
            let h = hits.len();
            let parent = match hits.last() {
                Some(&c) => BlockParent::Block(c),
                None => BlockParent::Root(s.chain.root().key()),
            };
            let next = s.tokens.get(h * b..s.prompt_len).unwrap_or_default();
            let max_len = match s.prompt_logits {
                true => 0,
                false => (s.prompt_len - 1).saturating_sub(h * b),
            };
            let mut tail = (max_len > 0)
                .then(|| self.kv.find_tail(parent, next, max_len))
                .flatten();
            // Or the first tokens of a cached block, copied (when more than a tail gives).
            let mut partial = if self.cfg.copy_partial_blocks && max_len > 0 {
                self.kv
                    .find_partial(parent, next, max_len)
                    .filter(|&(_, n)| n > tail.map_or(0, |t| t.1))
            } else {
                None
            };
            // A copied block is pinned like a hit until the copy has run: one block more than
            // without it, so it is dropped when only that block is missing.
            let mut pinned: Vec<ContentRef> = hits.clone();
            if let Some((src, _)) = partial {
                pinned.push(src);
                if self
                    .kv
                    .can_admit(&pinned, false, s.reserved_total.saturating_sub(h))
                {
                    tail = None;
                } else {
                    pinned.pop();
                    partial = None;
                }
            }
            let new_blocks = s
                .reserved_total
                .saturating_sub(h + usize::from(tail.is_some()));
            if !self.kv.can_admit(&pinned, tail.is_some(), new_blocks) {
                if i == 0 && self.head_bypassed >= self.cfg.max_running {
                    break;
                }
                i += 1;
                continue;
            }
            let Some(mut s) = self.waiting.remove(i) else {
                break;
            };
            if i > 0 {
                self.head_bypassed += 1;
            } else {
                self.head_id = self.waiting.front().map(|s| s.id);
                self.head_bypassed = 0;
            }
            self.kv.admit(&pinned, new_blocks);
            s.block_table = hits.iter().map(|c| c.0).collect();
            s.canon = hits.iter().map(|&c| Some(c)).collect();
            s.registered = h;
            s.num_computed = h * b;
            if let Some(block) = tail.and_then(|(key, _)| self.kv.take_tail(key)) {
                s.block_table.push(block);
                s.num_computed += tail.map_or(0, |(_, shared)| shared);
            }
            if let Some(((src, _), shared)) = partial {
                match self.kv.allocate_reserved() {
                    Some(dst) => {
                        s.block_table.push(dst);
                        s.num_computed += shared;
                        self.copies.push(BlockCopy {
                            seq: s.id,
                            src,
                            dst,
                        });
                    }
                    // A broken reservation (a bug): no reuse, the pin goes.
                    None => self.kv.release(&[src]),
                }
            }
            s.cached_tokens = s.num_computed;
            s.admitted_at = Some(now);
            admitted.push(s.id);
            self.running.push(s);
        }
        admitted
    }

    /// The block copies admitted since the last call; run each on the executor, then report
    /// them with [`Scheduler::copies_done`] before the next [`Scheduler::schedule`] (a copy
    /// still pending then is abandoned: its sequence recomputes the block).
    pub fn take_copies(&mut self) -> Vec<BlockCopy> {
        self.copies.clone()
    }

    /// Unpins the sources of `copies` (from [`Scheduler::take_copies`]); where `ok` is false the
    /// copy did not happen and its sequence recomputes that block from its start.
    pub fn copies_done(&mut self, copies: &[BlockCopy], ok: &[bool]) {
        for (i, c) in copies.iter().enumerate() {
            let Some(at) = self.copies.iter().position(|p| p == c) else {
                continue;
            };
            self.copies.swap_remove(at);
            self.kv.release(&[c.src]);
            if !ok.get(i).copied().unwrap_or(false) {
                self.forget_partial(c.seq);
            }
        }
    }

    /// A sequence whose block copy did not run starts again at its block boundary.
    fn forget_partial(&mut self, id: SeqId) {
        if let Some(s) = self.running.iter_mut().find(|s| s.id == id) {
            let b = s.block_size();
            s.num_computed = s.num_computed / b * b;
            s.cached_tokens = s.num_computed;
        }
    }

    /// The longest prefill chunk of a sequence (`prompt_logits_chunk` at most for one that
    /// wants every prompt position's logits).
    fn prefill_chunk_of(&self, prompt_logits: bool) -> usize {
        match prompt_logits {
            true => self
                .cfg
                .prefill_chunk
                .min(self.cfg.prompt_logits_chunk.max(1)),
            false => self.cfg.prefill_chunk,
        }
    }

    /// Plans the next step within the configured `step_token_budget`; see
    /// [`Scheduler::schedule_within`].
    pub fn schedule(&mut self) -> (Vec<Scheduled>, Vec<SeqId>) {
        self.schedule_within(self.cfg.step_token_budget)
    }

    /// Plans the next step with at most `tokens` tokens (clamped to `[max_running,
    /// step_token_budget]`, so every decode fits) and allocates the blocks it writes.
    /// Sequences whose allocation failed (a broken reservation: a bug) are returned in the
    /// second list; the caller fails and removes them.
    pub fn schedule_within(&mut self, tokens: usize) -> (Vec<Scheduled>, Vec<SeqId>) {
        if !self.copies.is_empty() {
            let pending = self.copies.clone();
            self.copies_done(&pending, &vec![false; pending.len()]);
        }
        let mut plan = Vec::new();
        let mut broken = Vec::new();
        let cap = self.cfg.step_token_budget.max(1);
        let mut budget = tokens.clamp(self.cfg.max_running.clamp(1, cap), cap);
        // 1. Decodes.
        for s in self.running.iter().filter(|s| s.is_decoding()) {
            if budget == 0 {
                break;
            }
            plan.push(Scheduled {
                id: s.id,
                start: s.num_computed,
                len: 1,
                want_logits: true,
                all_logits: false,
            });
            budget -= 1;
        }
        // 2. Prefill: finishers (remaining ≤ chunk), smallest first, ≤ half the budget.
        let mut served: Vec<SeqId> = Vec::new();
        let mut finishers: Vec<(usize, SeqId, usize, bool)> = self
            .running
            .iter()
            .filter(|s| s.is_prefilling())
            .map(|s| {
                let rem = s.prompt_len - s.num_computed;
                (rem, s.id, s.num_computed, s.prompt_logits)
            })
            .filter(|&(rem, _, _, all)| rem <= self.prefill_chunk_of(all))
            .collect();
        finishers.sort();
        let finisher_cap = budget / 2;
        let mut finisher_used = 0;
        for (rem, id, start, all_logits) in finishers {
            if finisher_used + rem > finisher_cap || rem > budget {
                break;
            }
            plan.push(Scheduled {
                id,
                start,
                len: rem,
                want_logits: true,
                all_logits,
            });
            served.push(id);
            finisher_used += rem;
            budget -= rem;
        }
        // 3. Round-robin over the other prefilling sequences, resuming after the last served.
        let mut order: Vec<&Sequence<P>> = self
            .running
            .iter()
            .filter(|s| s.is_prefilling() && !served.contains(&s.id))
            .collect();
        order.sort_by_key(|s| s.id);
        let start_at = match self.rr_last {
            Some(last) => order.iter().position(|s| s.id > last).unwrap_or(0),
            None => 0,
        };
        let n = order.len();
        for k in 0..n {
            if budget == 0 {
                break;
            }
            let s = order[(start_at + k) % n];
            let rem = s.prompt_len - s.num_computed;
            let len = rem.min(self.prefill_chunk_of(s.prompt_logits)).min(budget);
            plan.push(Scheduled {
                id: s.id,
                start: s.num_computed,
                len,
                want_logits: len == rem,
                all_logits: s.prompt_logits,
            });
            self.rr_last = Some(s.id);
            budget -= len;
        }
        // Allocate the blocks every planned chunk writes.
        let b = self.block_size();
        plan.retain(|c| {
            let Some(s) = self.running.iter_mut().find(|s| s.id == c.id) else {
                return false;
            };
            let blocks_needed = (c.start + c.len).div_ceil(b);
            while s.block_table.len() < blocks_needed {
                if s.block_table.len() >= s.reserved_total {
                    broken.push(s.id);
                    return false;
                }
                match self.kv.allocate_reserved() {
                    Some(blk) => s.block_table.push(blk),
                    None => {
                        broken.push(s.id);
                        return false;
                    }
                }
            }
            true
        });
        (plan, broken)
    }

    /// The executor's view of a plan (borrows the sequences' tokens and block tables).
    pub fn chunks<'a>(&'a self, plan: &[Scheduled]) -> Vec<SeqChunk<'a>> {
        plan.iter()
            .filter_map(|c| {
                let s = self.get(c.id)?;
                Some(SeqChunk {
                    tokens: s.tokens.get(c.start..c.start + c.len)?,
                    start_pos: c.start,
                    block_table: &s.block_table,
                    want_logits: c.want_logits,
                    all_logits: c.all_logits,
                })
            })
            .collect()
    }

    /// Records that a plan ran: advances every sequence and offers its newly full blocks to
    /// the prefix cache.
    pub fn complete(&mut self, plan: &[Scheduled]) {
        for c in plan {
            let Some(i) = self.running.iter().position(|s| s.id == c.id) else {
                continue;
            };
            let s = &mut self.running[i];
            s.num_computed = s.num_computed.max(c.start + c.len);
            Self::register_full_blocks(&mut self.kv, s);
        }
    }

    fn register_full_blocks(kv: &mut KvCache, s: &mut Sequence<P>) {
        let b = s.block_size();
        while s.registered < s.num_computed / b {
            let i = s.registered;
            let Some(block_tokens) = s.tokens.get(i * b..(i + 1) * b) else {
                break;
            };
            if s.links.len() <= i {
                let parent = if i == 0 {
                    s.chain.root()
                } else {
                    match s.links.get(i - 1) {
                        Some(l) => *l,
                        None => break,
                    }
                };
                match s.chain.next(&parent, block_tokens) {
                    Ok(l) => s.links.push(l),
                    Err(_) => break,
                }
            }
            let canon = match (s.cache_insert, s.block_table.get(i)) {
                (true, Some(&blk)) => {
                    let parent = if i == 0 {
                        None
                    } else {
                        s.canon
                            .get(i - 1)
                            .copied()
                            .flatten()
                            .zip(s.links.get(i - 1).map(|l| l.key()))
                    };
                    let root = (i == 0).then(|| s.chain.root().key());
                    kv.register(blk, s.links[i].key(), block_tokens, root, parent)
                }
                _ => None,
            };
            s.canon.push(canon);
            s.registered += 1;
        }
    }

    /// Appends a sampled token to a running sequence (its K/V is computed next step).
    pub fn append_token(&mut self, id: SeqId, token: u32) {
        if let Some(s) = self.get_mut(id) {
            s.tokens.push(token);
        }
    }

    /// Queued events of the KV cache.
    pub fn take_events(&mut self) -> Vec<prefix_index::KvEvent> {
        self.kv.take_events()
    }

    /// Removes every sequence (engine stop), freeing all blocks.
    pub fn drain_all(&mut self) -> Vec<Sequence<P>> {
        let ids: Vec<SeqId> = self
            .waiting
            .iter()
            .chain(self.running.iter())
            .map(|s| s.id)
            .collect();
        ids.into_iter().filter_map(|id| self.remove(id)).collect()
    }

    /// Checks the KV invariants plus: every block referenced exactly as often as block
    /// tables hold it; reservations equal the sum of outstanding ones. O(blocks + tokens);
    /// for tests.
    pub fn check_invariants(&self) -> Result<(), String> {
        self.kv.check_invariants()?;
        let total = self.kv.pool().total();
        let mut refs = vec![0u32; total];
        for c in &self.copies {
            *refs
                .get_mut(c.src as usize)
                .ok_or_else(|| format!("bad copy source {}", c.src))? += 1;
        }
        let mut outstanding = 0usize;
        for s in &self.running {
            for &b in &s.block_table {
                *refs
                    .get_mut(b as usize)
                    .ok_or_else(|| format!("bad block {b}"))? += 1;
            }
            if s.block_table.len() > s.reserved_total {
                return Err(format!("{:?} holds more than it reserved", s.id));
            }
            outstanding += s.reserved_total - s.block_table.len();
        }
        for (b, &r) in refs.iter().enumerate() {
            let rc = self.kv.pool().refcount(b as BlockId);
            if rc != r {
                return Err(format!("block {b}: refcount {rc}, held by tables {r}"));
            }
        }
        if outstanding != self.kv.reserved() {
            return Err(format!(
                "reserved {} but outstanding {outstanding}",
                self.kv.reserved()
            ));
        }
        Ok(())
    }
}
