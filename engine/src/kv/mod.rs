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
//! Complexity: every method is O(1) per block touched, except [`KvCache::lookup`]
//! (O(m × B) for an m-block match) and [`KvCache::check_invariants`] (O(n), tests).

pub mod block_pool;
pub mod events;
pub mod prefix_cache;

use prefix_index::{BlockKey, KvEvent};

use crate::executor::BlockId;
use block_pool::{BlockPool, PoolCounts};
use prefix_cache::{CacheEntry, ContentRef, PrefixCache};

pub use events::{KvEventFeed, KvSubscription};

/// Block pool + prefix cache + reservations + the pending events of the current step.
#[derive(Debug)]
pub struct KvCache {
    pool: BlockPool,
    cache: PrefixCache,
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

    /// Whether a sequence can take references on `hits` and reserve `new_blocks` more while
    /// every existing reservation stays satisfiable.
    pub fn can_admit(&self, hits: &[ContentRef], new_blocks: usize) -> bool {
        let hits_free = hits
            .iter()
            .filter(|(b, _)| self.pool.refcount(*b) == 0)
            .count();
        self.pool.available() >= hits_free + self.reserved + new_blocks
    }

    /// Takes references on `hits` and reserves `new_blocks`. Call only after
    /// [`KvCache::can_admit`] said yes.
    pub fn admit(&mut self, hits: &[ContentRef], new_blocks: usize) {
        for (b, _) in hits {
            self.pool.incref(*b);
        }
        self.reserved += new_blocks;
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
            // Only remove the map entry if it points at this block (it always should).
            if self.cache.get(key).is_some_and(|e| e.block == b) {
                self.cache.remove(key);
            }
            self.push_event(KvEvent::Removed { keys: vec![key] });
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

    /// Offers a full, computed block to the cache. `first`: this is block 0 of its chain.
    /// `parent`: the cached content and key of the previous block, `None` when that block is
    /// not cached (then this one is not cached either: it could never be reached). Returns
    /// the content that now represents this block in the cache (this block, or an identical
    /// one already cached), or `None` when it was not cached.
    pub fn register(
        &mut self,
        block: BlockId,
        key: BlockKey,
        tokens: &[u32],
        first: bool,
        parent: Option<(ContentRef, BlockKey)>,
    ) -> Option<ContentRef> {
        if tokens.len() != self.block_size || self.pool.refcount(block) == 0 {
            return None;
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
                match self.cache.get(k) {
                    Some(e) if e.block == b && e.generation == self.pool.generation(b) => {}
                    other => return Err(format!("block {b} keyed {k} but entry is {other:?}")),
                }
            }
        }
        if keyed != self.cache.len() {
            return Err(format!(
                "{keyed} keyed blocks but {} cache entries",
                self.cache.len()
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
