//! The engine's KV bookkeeping: which blocks are used, cached or free ([`block_pool`]), which
//! cached key lives in which block ([`prefix_cache`]), and the events that tell the gateway
//! ([`events`]). The K/V *storage* belongs to the executor; this module only hands out block
//! ids.
//!
//! [`KvCache`] ties the three together for the scheduler and keeps the admission
//! reservations: `reserved` counts blocks promised to running sequences but not yet
//! allocated, and the invariant `pool.available() >= reserved` means a sequence that was
//! admitted can always allocate the blocks it reserved (a started stream never runs out of
//! KV). Events produced by one step are buffered (adjacent ones coalesced) and taken by the
//! engine once per step.
//!
//! **Tails.** A finished sequence's last, partially filled block (the `r < B` tokens after its
//! last full block) is worth keeping too: the next turn of a chat repeats the whole previous
//! conversation, so its prompt usually runs through that block. [`KvCache::keep_tail`] keeps
//! such a block, identified by its parent — the cached content of the previous block, or the
//! chain's root key for a chain's first block (so namespaces and salts stay apart) — and its
//! tokens. The block gets a local key (never published, never in the prefix cache) so that it
//! sits in the pool's LRU like a cached block and is evicted in the same order: released with
//! its sequence's other blocks (first among them), it outlives nothing that leads to it. At
//! admission [`KvCache::find_tail`] offers the tail under the request's last hit block whose
//! tokens share the longest prefix with the request's next tokens; the request *adopts* that
//! block ([`KvCache::take_tail`]: no copy — its key is cleared, the request writes its own
//! tokens after the shared ones over the stale slots, and the block becomes an ordinary block of
//! its table). Tails send no KV events (the gateway's index only knows full blocks): they are
//! this worker's own bonus on top of the routed prefix. At most [`KvCache::max_tails`] are kept.
//!
//! Complexity: every method is O(1) per block touched, except [`KvCache::lookup`]
//! (O(m × B) for an m-block match), [`KvCache::find_tail`] and [`KvCache::keep_tail`] (O(T ×
//! B) over the T kept tails) and [`KvCache::check_invariants`] (O(n), tests).

pub mod block_pool;
pub mod events;
pub mod prefix_cache;

use std::collections::HashMap;

use prefix_index::{BlockKey, KvEvent};

use crate::executor::BlockId;
use block_pool::{BlockPool, PoolCounts};
pub use prefix_cache::BlockParent;
use prefix_cache::{CacheEntry, ContentRef, PrefixCache};

pub use events::{KvEventFeed, KvSubscription};

/// A kept partial block: `tokens` (fewer than a block) computed in `block` after `parent`.
#[derive(Debug)]
struct Tail {
    block: BlockId,
    parent: BlockParent,
    tokens: Box<[u32]>,
    /// Insertion order (the oldest goes first beyond [`KvCache::max_tails`]).
    order: u64,
}

/// Block pool + prefix cache + tails + reservations + the pending events of the current step.
#[derive(Debug)]
pub struct KvCache {
    pool: BlockPool,
    cache: PrefixCache,
    /// Kept partial blocks by their local key (the key their block holds in the pool).
    tails: HashMap<BlockKey, Tail>,
    tail_order: u64,
    block_size: usize,
    reserved: usize,
    events: Vec<KvEvent>,
}

impl KvCache {
    /// `num_blocks` blocks of `block_size` tokens, all free.
    pub fn new(num_blocks: usize, block_size: usize) -> Self {
        KvCache {
            pool: BlockPool::new(num_blocks),
            cache: PrefixCache::new(),
            tails: HashMap::new(),
            tail_order: 0,
            block_size: block_size.max(1),
            reserved: 0,
            events: Vec::new(),
        }
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Blocks by state.
    pub fn counts(&self) -> PoolCounts {
        self.pool.counts()
    }

    /// Blocks promised to running sequences and not yet allocated.
    pub fn reserved(&self) -> usize {
        self.reserved
    }

    /// The pool (read-only; tests and stats).
    pub fn pool(&self) -> &BlockPool {
        &self.pool
    }

    /// The prefix cache (read-only).
    pub fn cache(&self) -> &PrefixCache {
        &self.cache
    }

    /// The longest verified cached prefix: for block `i < max_blocks` with key `keys[i]` and
    /// tokens `tokens[i*B..(i+1)*B]`, accept it when the cache holds exactly those tokens
    /// under that key with the previously accepted block as parent. Returns the accepted
    /// contents in order. Changes nothing.
    pub fn lookup(&self, keys: &[BlockKey], tokens: &[u32], max_blocks: usize) -> Vec<ContentRef> {
        let b = self.block_size;
        let mut out: Vec<ContentRef> = Vec::new();
        for (i, &key) in keys.iter().enumerate().take(max_blocks) {
            let Some(block_tokens) = tokens.get(i * b..(i + 1) * b) else {
                break;
            };
            let parent = out.last().copied();
            match self.cache.matching(key, block_tokens, parent) {
                Some(e) => out.push((e.block, e.generation)),
                None => break,
            }
        }
        out
    }

    /// Whether a sequence can take references on `hits`, adopt a kept tail (`adopts`) and
    /// reserve `new_blocks` more while every existing reservation stays satisfiable.
    pub fn can_admit(&self, hits: &[ContentRef], adopts: bool, new_blocks: usize) -> bool {
        let hits_free = hits
            .iter()
            .filter(|(b, _)| self.pool.refcount(*b) == 0)
            .count();
        self.pool.available() >= hits_free + usize::from(adopts) + self.reserved + new_blocks
    }

    /// Takes references on `hits` and reserves `new_blocks`. Call only after
    /// [`KvCache::can_admit`] said yes.
    pub fn admit(&mut self, hits: &[ContentRef], new_blocks: usize) {
        for (b, _) in hits {
            self.pool.incref(*b);
        }
        self.reserved += new_blocks;
    }

    /// Kept tails (free blocks with a local key, counted as cached by the pool).
    pub fn tails(&self) -> usize {
        self.tails.len()
    }

    /// At most this many tails are kept: an eighth of the pool (at least one).
    pub fn max_tails(&self) -> usize {
        (self.pool.total() / 8).max(1)
    }

    /// Keeps `block` — holding `tokens` (1 to B − 1 of them) computed after `parent` — as a
    /// tail, and drops the caller's reference on it. A tail with the same parent whose tokens
    /// are a prefix of these is dropped (this one serves everything it did); one whose tokens
    /// extend these makes this one redundant; beyond [`KvCache::max_tails`] the oldest is
    /// dropped. A block that cannot be a tail (token count out of range, keyed, unreferenced)
    /// is just released.
    pub fn keep_tail(&mut self, block: BlockId, parent: BlockParent, tokens: &[u32]) {
        let key = tail_key(parent, tokens);
        let usable = !tokens.is_empty()
            && tokens.len() < self.block_size
            && self.pool.refcount(block) > 0
            && self.pool.key(block).is_none()
            && self.cache.get(key).is_none()
            && !self.tails.contains_key(&key)
            && !self
                .tails
                .values()
                .any(|t| t.parent == parent && t.tokens.starts_with(tokens));
        if !usable {
            self.pool.decref(block);
            return;
        }
        let shorter: Vec<BlockKey> = self
            .tails
            .iter()
            .filter(|(_, t)| t.parent == parent && tokens.starts_with(&t.tokens))
            .map(|(k, _)| *k)
            .collect();
        for k in shorter {
            self.drop_tail(k);
        }
        self.pool.set_key(block, key);
        self.tail_order += 1;
        self.tails.insert(
            key,
            Tail {
                block,
                parent,
                tokens: tokens.into(),
                order: self.tail_order,
            },
        );
        self.pool.decref(block);
        while self.tails.len() > self.max_tails() {
            let Some(oldest) = self
                .tails
                .iter()
                .min_by_key(|(_, t)| t.order)
                .map(|(k, _)| *k)
            else {
                break;
            };
            self.drop_tail(oldest);
        }
    }

    /// The kept tail under `parent` sharing the longest prefix with `tokens`, capped at
    /// `max_len` tokens: `(its key, shared tokens ≥ 1)`. Changes nothing.
    pub fn find_tail(
        &self,
        parent: BlockParent,
        tokens: &[u32],
        max_len: usize,
    ) -> Option<(BlockKey, usize)> {
        self.tails
            .iter()
            .filter(|(_, t)| t.parent == parent)
            .map(|(k, t)| (*k, shared_prefix(&t.tokens, tokens).min(max_len), t.order))
            .filter(|&(_, n, _)| n > 0)
            .max_by_key(|&(_, n, order)| (n, order))
            .map(|(k, n, _)| (k, n))
    }

    /// The cached full block continuing `parent` whose tokens share the longest prefix with
    /// `tokens` (fewer than all of them: a whole match is a hit), capped at `max_len`: `(its
    /// content, shared tokens ≥ 1)`. A request reuses those tokens by copying the block
    /// (it must not write into a cached block). Changes nothing.
    pub fn find_partial(
        &self,
        parent: BlockParent,
        tokens: &[u32],
        max_len: usize,
    ) -> Option<(ContentRef, usize)> {
        self.cache
            .children(parent)
            .iter()
            .filter_map(|&k| {
                let e = self.cache.get(k)?;
                let content = (e.block, e.generation);
                if !self.is_current(content, k) {
                    return None;
                }
                Some((content, shared_prefix(&e.tokens, tokens).min(max_len)))
            })
            .filter(|&(_, n)| n > 0)
            .max_by_key(|&(_, n)| n)
    }

    /// Removes the tail `key` (from [`KvCache::find_tail`]) and hands its block to the caller
    /// with one reference, unkeyed (the caller overwrites it past the shared tokens).
    pub fn take_tail(&mut self, key: BlockKey) -> Option<BlockId> {
        let t = self.tails.remove(&key)?;
        self.pool.incref(t.block);
        self.pool.clear_key(t.block);
        Some(t.block)
    }

    /// Forgets tail `key`; its block becomes an unkeyed free block.
    fn drop_tail(&mut self, key: BlockKey) {
        if let Some(t) = self.tails.remove(&key) {
            self.pool.clear_key(t.block);
        }
    }

    /// Allocates one block against a reservation, evicting the least recently used cached
    /// block when no unkeyed block is free (its key leaves the cache, a `Removed` event is
    /// queued). `None` only if the reservation invariant was broken (a bug, reported by the
    /// caller as an engine error rather than a panic).
    pub fn allocate_reserved(&mut self) -> Option<BlockId> {
        if self.reserved == 0 {
            return None;
        }
        let (b, evicted) = self.pool.allocate()?;
        self.reserved -= 1;
        if let Some(key) = evicted {
            if self.tails.get(&key).is_some_and(|t| t.block == b) {
                // An evicted tail leaves quietly: it was never announced.
                self.tails.remove(&key);
            } else {
                // Only remove the map entry if it points at this block (it always should).
                if self.cache.get(key).is_some_and(|e| e.block == b) {
                    self.cache.remove(key);
                }
                self.push_event(KvEvent::Removed { keys: vec![key] });
            }
        }
        Some(b)
    }

    /// Returns `n` unused reserved blocks (a sequence ended before using them).
    pub fn unreserve(&mut self, n: usize) {
        self.reserved = self.reserved.saturating_sub(n);
    }

    /// Drops one reference on each block of a block table, last block first (so a chain's
    /// tail is evicted before its head, which is more likely shared).
    pub fn release(&mut self, blocks: &[BlockId]) {
        for &b in blocks.iter().rev() {
            self.pool.decref(b);
        }
    }

    /// Whether `c` still names the cached content keyed `key`.
    pub fn is_current(&self, c: ContentRef, key: BlockKey) -> bool {
        self.pool.generation(c.0) == c.1 && self.pool.key(c.0) == Some(key)
    }

    /// Offers a full, computed block to the cache. `root`: `Some(the chain's root key)` when
    /// this is block 0 of its chain. `parent`: the cached content and key of the previous
    /// block, `None` when that block is not cached (then this one is not cached either: it
    /// could never be reached). Returns the content that now represents this block in the
    /// cache (this block, or an identical one already cached), or `None` when it was not
    /// cached.
    pub fn register(
        &mut self,
        block: BlockId,
        key: BlockKey,
        tokens: &[u32],
        root: Option<BlockKey>,
        parent: Option<(ContentRef, BlockKey)>,
    ) -> Option<ContentRef> {
        let first = root.is_some();
        if tokens.len() != self.block_size || self.pool.refcount(block) == 0 {
            return None;
        }
        if self.tails.contains_key(&key) {
            // A tail's local key equal to a real one (~2⁻⁶⁴): the tail gives way.
            self.drop_tail(key);
        }
        let parent_ref = match (first, parent) {
            (true, _) => None,
            (false, None) => return None,
            (false, Some((c, pk))) => {
                if !self.is_current(c, pk) {
                    return None;
                }
                Some(c)
            }
        };
        if let Some(e) = self.cache.get(key) {
            if e.parent == parent_ref && &*e.tokens == tokens {
                return Some((e.block, e.generation));
            }
            // Stale or colliding entry: replace it.
            let old = e.block;
            self.cache.remove(key);
            self.pool.clear_key(old);
            self.push_event(KvEvent::Removed { keys: vec![key] });
        }
        if self.pool.key(block).is_some() {
            // Already keyed (a hit block offered again): leave it.
            return None;
        }
        self.pool.set_key(block, key);
        let generation = self.pool.generation(block);
        let parent_key = parent.map(|(_, k)| k).filter(|_| !first);
        self.cache.insert(
            key,
            CacheEntry {
                block,
                generation,
                tokens: tokens.into(),
                parent: parent_ref,
                parent_key,
                root,
            },
        );
        self.push_event(KvEvent::Stored {
            parent: parent_key,
            keys: vec![key],
        });
        Some((block, generation))
    }

    /// Test hook: plants a cache entry for `key` on a free or used `block` that has no key
    /// (to force collisions). Publishes nothing.
    #[doc(hidden)]
    pub fn plant_entry(
        &mut self,
        key: BlockKey,
        block: BlockId,
        tokens: &[u32],
        parent: Option<ContentRef>,
    ) {
        if self.pool.key(block).is_some() {
            return;
        }
        self.pool.set_key(block, key);
        let generation = self.pool.generation(block);
        self.cache.insert_raw(
            key,
            CacheEntry {
                block,
                generation,
                tokens: tokens.into(),
                parent,
                parent_key: None,
                root: None,
            },
        );
    }

    /// Events queued since the last call, in order.
    pub fn take_events(&mut self) -> Vec<KvEvent> {
        std::mem::take(&mut self.events)
    }

    fn push_event(&mut self, ev: KvEvent) {
        match (self.events.last_mut(), ev) {
            (Some(KvEvent::Removed { keys }), KvEvent::Removed { keys: more }) => {
                keys.extend(more);
            }
            (Some(KvEvent::Stored { keys, .. }), KvEvent::Stored { parent, keys: more })
                if keys.last().copied() == parent && parent.is_some() =>
            {
                keys.extend(more);
            }
            (_, ev) => self.events.push(ev),
        }
    }

    /// Checks pool structure, the key ↔ entry correspondence and the reservation invariant.
    /// O(n); for tests.
    pub fn check_invariants(&self) -> Result<(), String> {
        self.pool.check_invariants()?;
        let mut keyed = 0usize;
        for b in 0..self.pool.total() as BlockId {
            if let Some(k) = self.pool.key(b) {
                keyed += 1;
                if let Some(t) = self.tails.get(&k).filter(|t| t.block == b) {
                    if self.pool.refcount(b) != 0 {
                        return Err(format!("tail block {b} is referenced"));
                    }
                    if t.tokens.is_empty() || t.tokens.len() >= self.block_size {
                        return Err(format!("tail of {} tokens", t.tokens.len()));
                    }
                    continue;
                }
                match self.cache.get(k) {
                    Some(e) if e.block == b && e.generation == self.pool.generation(b) => {}
                    other => return Err(format!("block {b} keyed {k} but entry is {other:?}")),
                }
            }
        }
        if keyed != self.cache.len() + self.tails.len() {
            return Err(format!(
                "{keyed} keyed blocks but {} cache entries and {} tails",
                self.cache.len(),
                self.tails.len()
            ));
        }
        if self.tails.len() > self.max_tails() {
            return Err(format!(
                "{} tails kept, at most {}",
                self.tails.len(),
                self.max_tails()
            ));
        }
        if self.pool.available() < self.reserved {
            return Err(format!(
                "reservations {} exceed available blocks {}",
                self.reserved,
                self.pool.available()
            ));
        }
        Ok(())
    }
}

/// How many leading tokens `a` and `b` share.
fn shared_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// A tail's local key: a hash of its parent and tokens (this process only; never published).
fn tail_key(parent: BlockParent, tokens: &[u32]) -> BlockKey {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    ("kvgate tail", parent, tokens).hash(&mut h);
    BlockKey(h.finish())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Block `b` registered as a cached chain head with `tokens`, then released (cached, free).
    fn cached_block(kv: &mut KvCache, key: u64, tokens: &[u32]) -> BlockId {
        kv.admit(&[], 1);
        let b = kv.allocate_reserved().unwrap();
        assert!(kv
            .register(b, BlockKey(key), tokens, Some(BlockKey(99)), None)
            .is_some());
        kv.release(&[b]);
        b
    }

    /// `find_partial` offers a cached child of the request's parent (under a root key for a
    /// first block: no other namespace's), the longest shared prefix, never a stale content.
    #[test]
    fn partial_matches_come_from_current_children_of_the_same_parent() {
        let mut kv = KvCache::new(4, 4);
        let root = BlockKey(99); // `cached_block`'s root key
        let a = cached_block(&mut kv, 7, &[1, 2, 3, 4]);
        let under_root = BlockParent::Root(root);
        assert_eq!(
            kv.find_partial(under_root, &[1, 2, 9], 3),
            Some(((a, kv.pool().generation(a)), 2))
        );
        assert_eq!(
            kv.find_partial(under_root, &[1, 2, 3, 9], 2).map(|x| x.1),
            Some(2),
            "cap"
        );
        assert_eq!(kv.find_partial(under_root, &[9], 3), None);
        assert_eq!(
            kv.find_partial(BlockParent::Root(BlockKey(98)), &[1, 2], 3),
            None
        );
        // A child of `a`, and a second child sharing more.
        let ca = (a, kv.pool().generation(a));
        let child = |kv: &mut KvCache, key, tokens: &[u32]| {
            kv.admit(&[], 1);
            let b = kv.allocate_reserved().unwrap();
            kv.register(b, BlockKey(key), tokens, None, Some((ca, BlockKey(7))));
            kv.release(&[b]);
            b
        };
        child(&mut kv, 8, &[5, 6, 7, 8]);
        let c2 = child(&mut kv, 9, &[5, 6, 0, 0]);
        let best = kv.find_partial(BlockParent::Block(ca), &[5, 6, 0, 1], 3);
        assert_eq!(best, Some(((c2, kv.pool().generation(c2)), 3)));
        kv.check_invariants().unwrap();
        // Evicted content is never offered.
        kv.admit(&[], 4);
        for _ in 0..4 {
            kv.allocate_reserved().unwrap();
        }
        assert_eq!(kv.find_partial(BlockParent::Block(ca), &[5, 6], 3), None);
        assert_eq!(kv.find_partial(under_root, &[1, 2], 3), None);
        kv.check_invariants().unwrap();
    }

    /// A tail is evicted in LRU order with the cached blocks, quietly (no `Removed` event), and
    /// adopting one takes it off the free list.
    #[test]
    fn tails_age_with_cached_blocks_and_leave_quietly() {
        let mut kv = KvCache::new(4, 4);
        let a = cached_block(&mut kv, 7, &[1, 2, 3, 4]);
        kv.admit(&[], 1);
        let t = kv.allocate_reserved().unwrap();
        let parent = BlockParent::Block((a, kv.pool().generation(a)));
        kv.keep_tail(t, parent, &[5, 6]);
        assert_eq!(
            (kv.tails(), kv.counts().cached, kv.counts().used),
            (1, 2, 0)
        );
        kv.check_invariants().unwrap();
        kv.take_events();
        // Two unkeyed blocks go first, then the least recently released: `a`, then the tail.
        kv.admit(&[], 3);
        let got: Vec<BlockId> = (0..3).map(|_| kv.allocate_reserved().unwrap()).collect();
        assert!(got.contains(&a) && !got.contains(&t));
        assert_eq!(
            kv.take_events(),
            vec![KvEvent::Removed {
                keys: vec![BlockKey(7)]
            }]
        );
        assert_eq!(
            kv.tails(),
            1,
            "the tail is still there (useless now: its parent is gone)"
        );
        assert_eq!(kv.find_tail(parent, &[5, 6], 2).map(|x| x.1), Some(2));
        kv.admit(&[], 1);
        assert_eq!(kv.allocate_reserved(), Some(t));
        assert_eq!(kv.tails(), 0);
        assert_eq!(kv.take_events(), vec![], "an evicted tail sends nothing");
        kv.check_invariants().unwrap();
        // Adoption: the block comes back referenced and unkeyed.
        kv.release(&got);
        kv.release(&[t]);
        kv.admit(&[], 1);
        let u = kv.allocate_reserved().unwrap();
        let root = BlockParent::Root(BlockKey(3));
        kv.keep_tail(u, root, &[8]);
        let (key, shared) = kv.find_tail(root, &[8, 9], 1).unwrap();
        assert_eq!(shared, 1);
        assert!(kv.can_admit(&[], true, 3));
        assert!(!kv.can_admit(&[], true, 4));
        assert_eq!(kv.take_tail(key), Some(u));
        assert_eq!((kv.pool().refcount(u), kv.pool().key(u)), (1, None));
        kv.check_invariants().unwrap();
    }

    #[test]
    fn a_tail_is_found_under_its_parent_only_and_the_longer_one_wins() {
        let mut kv = KvCache::new(8, 4);
        let root = BlockParent::Root(BlockKey(1));
        let other = BlockParent::Root(BlockKey(2));
        for tokens in [&[5u32][..], &[5, 6, 7], &[5, 6]] {
            kv.admit(&[], 1);
            let b = kv.allocate_reserved().unwrap();
            kv.keep_tail(b, root, tokens);
        }
        // [5] was replaced by [5, 6, 7], which makes [5, 6] redundant.
        assert_eq!(kv.tails(), 1);
        kv.check_invariants().unwrap();
        let shared = |t: &[u32], max| kv.find_tail(root, t, max).map(|x| x.1);
        assert_eq!(shared(&[5, 6, 9], 3), Some(2));
        assert_eq!(shared(&[5, 6, 7, 8], 3), Some(3));
        assert_eq!(shared(&[5, 6, 7, 8], 1), Some(1), "capped");
        assert_eq!(kv.find_tail(root, &[9], 3), None);
        assert_eq!(
            kv.find_tail(other, &[5, 6, 7], 3),
            None,
            "another namespace"
        );
        let (key, _) = kv.find_tail(root, &[5], 1).unwrap();
        let b = kv.take_tail(key).unwrap();
        assert_eq!(kv.pool().refcount(b), 1, "handed over with one reference");
        assert_eq!(kv.tails(), 0);
        // Out of range: a full block's worth of tokens is not a tail.
        kv.keep_tail(b, root, &[1, 2, 3, 4]);
        assert_eq!((kv.tails(), kv.pool().refcount(b)), (0, 0));
        // At most an eighth of the pool (1 of 8): the newest is kept.
        for t in [&[1u32][..], &[2]] {
            kv.admit(&[], 1);
            let b = kv.allocate_reserved().unwrap();
            kv.keep_tail(b, root, t);
        }
        assert_eq!(kv.tails(), 1);
        assert_eq!(kv.find_tail(root, &[2], 1).map(|x| x.1), Some(1));
        assert_eq!(kv.find_tail(root, &[1], 1), None);
        kv.check_invariants().unwrap();
    }
}
