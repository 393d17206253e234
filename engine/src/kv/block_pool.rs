//! The block pool: which KV block ids are in use, by how many sequences, and which free ones
//! still hold a cached key.
//!
//! A flat array of block metadata (ids `0..num_blocks`, the executor's geometry) with a
//! reference count, an optional cached key and a generation per block, and one intrusive
//! doubly-linked free list:
//! - front: free blocks without a key (reused first);
//! - then: free blocks with a cached key, least recently released first (the LRU eviction
//!   order).
//!
//! [`BlockPool::allocate`] pops the front; when that block still has a key, the key is
//! returned as evicted (the caller drops its prefix-cache entry and publishes `Removed`).
//! [`BlockPool::incref`] on a free cached block (a prefix hit) unlinks it from the list.
//! The generation of a block changes whenever its key is cleared, so a `(block, generation)`
//! pair names one cached content for as long as it lives.
//!
//! Every operation is O(1). Memory: 24 bytes per block.

use prefix_index::BlockKey;

use crate::executor::BlockId;

const NIL: u32 = u32::MAX;

#[derive(Clone, Debug)]
struct BlockMeta {
    refcount: u32,
    key: Option<BlockKey>,
    generation: u32,
    prev: u32,
    next: u32,
}

/// Counts of blocks by state; `used + cached + free == total` always.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PoolCounts {
    /// Blocks in the pool.
    pub total: usize,
    /// Referenced by at least one sequence.
    pub used: usize,
    /// Unreferenced but still holding a cached key (evictable).
    pub cached: usize,
    /// Unreferenced, no key.
    pub free: usize,
}

/// Reference counts, cached keys and the free/LRU list of every block.
#[derive(Clone, Debug)]
pub struct BlockPool {
    meta: Vec<BlockMeta>,
    head: u32,
    tail: u32,
    free_len: usize,
    cached_free: usize,
}

impl BlockPool {
    /// A pool of `num_blocks` free, unkeyed blocks (ids ascending from the front).
    pub fn new(num_blocks: usize) -> Self {
        let n = num_blocks.min(NIL as usize - 1);
        let meta = (0..n)
            .map(|i| BlockMeta {
                refcount: 0,
                key: None,
                generation: 0,
                prev: if i == 0 { NIL } else { i as u32 - 1 },
                next: if i + 1 == n { NIL } else { i as u32 + 1 },
            })
            .collect();
        let last = if n == 0 { NIL } else { n as u32 - 1 };
        BlockPool {
            meta,
            head: if n == 0 { NIL } else { 0 },
            tail: last,
            free_len: n,
            cached_free: 0,
        }
    }

    /// Number of blocks.
    pub fn total(&self) -> usize {
        self.meta.len()
    }

    /// Blocks that can be allocated now (free, cached ones included: they are evicted).
    pub fn available(&self) -> usize {
        self.free_len
    }

    /// Counts by state.
    pub fn counts(&self) -> PoolCounts {
        let total = self.meta.len();
        PoolCounts {
            total,
            used: total - self.free_len,
            cached: self.cached_free,
            free: self.free_len - self.cached_free,
        }
    }

    /// Reference count of `b` (0 for an unknown id).
    pub fn refcount(&self, b: BlockId) -> u32 {
        self.meta.get(b as usize).map_or(0, |m| m.refcount)
    }

    /// Cached key of `b`, if any.
    pub fn key(&self, b: BlockId) -> Option<BlockKey> {
        self.meta.get(b as usize).and_then(|m| m.key)
    }

    /// Generation of `b` (changes whenever its key is cleared).
    pub fn generation(&self, b: BlockId) -> u32 {
        self.meta.get(b as usize).map_or(0, |m| m.generation)
    }

    /// Takes the front free block with refcount 1. Returns the block and the key it was
    /// evicted from (if it held one; the key is already cleared here). `None` when no block
    /// is free.
    pub fn allocate(&mut self) -> Option<(BlockId, Option<BlockKey>)> {
        let b = self.head;
        if b == NIL {
            return None;
        }
        self.unlink(b);
        let m = &mut self.meta[b as usize];
        m.refcount = 1;
        let evicted = m.key.take();
        if evicted.is_some() {
            m.generation = m.generation.wrapping_add(1);
        }
        Some((b, evicted))
    }

    /// Adds a reference to `b` (a prefix hit on a shared or cached block). Returns false for
    /// an unknown id.
    pub fn incref(&mut self, b: BlockId) -> bool {
        let Some(m) = self.meta.get(b as usize) else {
            return false;
        };
        if m.refcount == 0 {
            self.unlink(b);
        }
        self.meta[b as usize].refcount += 1;
        true
    }

    /// Drops a reference to `b`. At zero the block joins the free list: unkeyed blocks at the
    /// front (reused first), keyed blocks at the back (most recently used, evicted last).
    /// Returns false (and changes nothing) for an unknown or unreferenced id.
    pub fn decref(&mut self, b: BlockId) -> bool {
        let Some(m) = self.meta.get_mut(b as usize) else {
            return false;
        };
        if m.refcount == 0 {
            return false;
        }
        m.refcount -= 1;
        if m.refcount == 0 {
            self.link_free(b);
        }
        true
    }

    /// Gives `b` a cached key (replacing none). The caller owns the key → block map.
    pub fn set_key(&mut self, b: BlockId, key: BlockKey) {
        if let Some(m) = self.meta.get_mut(b as usize) {
            debug_assert!(m.key.is_none());
            if m.refcount == 0 {
                // Re-position as a cached free block.
                self.unlink(b);
                self.meta[b as usize].key = Some(key);
                self.link_free(b);
            } else {
                m.key = Some(key);
            }
        }
    }

    /// Removes the cached key of `b` (the block stays where it is in use, or becomes an
    /// unkeyed free block). Returns the key it had.
    pub fn clear_key(&mut self, b: BlockId) -> Option<BlockKey> {
        let m = self.meta.get(b as usize)?;
        m.key?;
        let free = m.refcount == 0;
        if free {
            self.unlink(b);
        }
        let m = &mut self.meta[b as usize];
        let key = m.key.take();
        m.generation = m.generation.wrapping_add(1);
        if free {
            self.link_free(b);
        }
        key
    }

    /// Appends a free block (refcount 0, not in the list) at its place.
    fn link_free(&mut self, b: BlockId) {
        let keyed = self.meta[b as usize].key.is_some();
        self.free_len += 1;
        if keyed {
            self.cached_free += 1;
            // Back of the list.
            let old_tail = self.tail;
            {
                let m = &mut self.meta[b as usize];
                m.prev = old_tail;
                m.next = NIL;
            }
            if old_tail == NIL {
                self.head = b;
            } else {
                self.meta[old_tail as usize].next = b;
            }
            self.tail = b;
        } else {
            // Front of the list.
            let old_head = self.head;
            {
                let m = &mut self.meta[b as usize];
                m.prev = NIL;
                m.next = old_head;
            }
            if old_head == NIL {
                self.tail = b;
            } else {
                self.meta[old_head as usize].prev = b;
            }
            self.head = b;
        }
    }

    /// Removes a free block from the list.
    fn unlink(&mut self, b: BlockId) {
        let (prev, next, keyed) = {
            let m = &self.meta[b as usize];
            (m.prev, m.next, m.key.is_some())
        };
        if prev == NIL {
            self.head = next;
        } else {
            self.meta[prev as usize].next = next;
        }
        if next == NIL {
            self.tail = prev;
        } else {
            self.meta[next as usize].prev = prev;
        }
        let m = &mut self.meta[b as usize];
        m.prev = NIL;
        m.next = NIL;
        self.free_len -= 1;
        if keyed {
            self.cached_free -= 1;
        }
    }

    /// Checks every invariant (list structure, counts, key placement). O(n); for tests.
    pub fn check_invariants(&self) -> Result<(), String> {
        let mut seen = 0usize;
        let mut cached = 0usize;
        let mut cur = self.head;
        let mut prev = NIL;
        let mut in_keyed_part = false;
        while cur != NIL {
            let m = self
                .meta
                .get(cur as usize)
                .ok_or_else(|| format!("bad id {cur} in free list"))?;
            if m.refcount != 0 {
                return Err(format!(
                    "block {cur} in free list with refcount {}",
                    m.refcount
                ));
            }
            if m.prev != prev {
                return Err(format!("block {cur} has prev {} not {prev}", m.prev));
            }
            if m.key.is_some() {
                cached += 1;
                in_keyed_part = true;
            } else if in_keyed_part {
                return Err(format!("unkeyed block {cur} after keyed ones"));
            }
            seen += 1;
            if seen > self.meta.len() {
                return Err("cycle in free list".into());
            }
            prev = cur;
            cur = m.next;
        }
        if prev != self.tail {
            return Err("tail mismatch".into());
        }
        let unreferenced = self.meta.iter().filter(|m| m.refcount == 0).count();
        if seen != self.free_len || unreferenced != seen || cached != self.cached_free {
            return Err(format!(
                "counts: list {seen} free_len {} unreferenced {unreferenced} cached {cached}/{}",
                self.free_len, self.cached_free
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    #[test]
    fn allocate_all_then_none() {
        let mut p = BlockPool::new(3);
        let ids: Vec<_> = (0..3).map(|_| p.allocate().unwrap().0).collect();
        assert_eq!(ids, vec![0, 1, 2]);
        assert!(p.allocate().is_none());
        assert_eq!(p.counts().used, 3);
        p.check_invariants().unwrap();
    }

    #[test]
    fn unkeyed_reused_before_cached_and_lru_order() {
        let mut p = BlockPool::new(4);
        let b: Vec<_> = (0..4).map(|_| p.allocate().unwrap().0).collect();
        p.set_key(b[0], BlockKey(10));
        p.set_key(b[1], BlockKey(11));
        // Release 1 then 0 (reverse order): 1 is older → evicted first.
        p.decref(b[1]);
        p.decref(b[0]);
        p.decref(b[2]); // unkeyed → reused first
        assert_eq!(
            p.counts(),
            PoolCounts {
                total: 4,
                used: 1,
                cached: 2,
                free: 1
            }
        );
        p.check_invariants().unwrap();
        assert_eq!(p.allocate(), Some((b[2], None)));
        assert_eq!(p.allocate(), Some((b[1], Some(BlockKey(11)))));
        assert_eq!(p.allocate(), Some((b[0], Some(BlockKey(10)))));
        assert!(p.allocate().is_none());
        p.check_invariants().unwrap();
    }

    #[test]
    fn hit_on_cached_block_unlinks_it_and_generation_changes_on_clear() {
        let mut p = BlockPool::new(2);
        let (a, _) = p.allocate().unwrap();
        p.set_key(a, BlockKey(1));
        p.decref(a);
        assert_eq!(p.counts().cached, 1);
        assert!(p.incref(a));
        assert_eq!(p.counts().cached, 0);
        assert_eq!(p.refcount(a), 1);
        let g = p.generation(a);
        assert_eq!(p.clear_key(a), Some(BlockKey(1)));
        assert_ne!(p.generation(a), g);
        p.decref(a);
        assert_eq!(p.counts().free, 2);
        assert!(!p.decref(a), "double free refused");
        assert!(!p.incref(99));
        p.check_invariants().unwrap();
    }

    /// Randomized differential test against a naive model (vectors and linear scans).
    #[test]
    fn randomized_against_naive_model() {
        let seed: u64 = rand::random();
        println!("block_pool randomized seed = {seed}");
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        let n = 16;
        let mut p = BlockPool::new(n);
        // Naive: refcounts, keys, free order as a Vec (front = next allocated).
        let mut rc = vec![0u32; n];
        let mut keys: Vec<Option<u64>> = vec![None; n];
        let mut order: Vec<u32> = (0..n as u32).collect();
        let mut next_key = 0u64;
        for step in 0..20_000 {
            match rng.gen_range(0..5) {
                0 => {
                    let got = p.allocate();
                    if order.is_empty() {
                        assert!(got.is_none());
                    } else {
                        let b = order.remove(0);
                        let k = keys[b as usize].take().map(BlockKey);
                        rc[b as usize] = 1;
                        assert_eq!(got, Some((b, k)), "step {step}");
                    }
                }
                1 => {
                    let b = rng.gen_range(0..n as u32);
                    if rc[b as usize] > 0 {
                        p.decref(b);
                        rc[b as usize] -= 1;
                        if rc[b as usize] == 0 {
                            if keys[b as usize].is_some() {
                                order.push(b);
                            } else {
                                order.insert(0, b);
                            }
                        }
                    }
                }
                2 => {
                    let b = rng.gen_range(0..n as u32);
                    if keys[b as usize].is_some() {
                        p.incref(b);
                        if rc[b as usize] == 0 {
                            order.retain(|&x| x != b);
                        }
                        rc[b as usize] += 1;
                    }
                }
                3 => {
                    let b = rng.gen_range(0..n as u32);
                    if rc[b as usize] > 0 && keys[b as usize].is_none() {
                        next_key += 1;
                        p.set_key(b, BlockKey(next_key));
                        keys[b as usize] = Some(next_key);
                    }
                }
                _ => {
                    let b = rng.gen_range(0..n as u32);
                    let had = keys[b as usize].take();
                    assert_eq!(p.clear_key(b), had.map(BlockKey));
                    if had.is_some() && rc[b as usize] == 0 {
                        order.retain(|&x| x != b);
                        order.insert(0, b);
                    }
                }
            }
            p.check_invariants()
                .unwrap_or_else(|e| panic!("seed {seed} step {step}: {e}"));
            let c = p.counts();
            assert_eq!(c.used + c.cached + c.free, n);
            assert_eq!(c.free + c.cached, order.len(), "seed {seed} step {step}");
            for (b, &r) in rc.iter().enumerate() {
                assert_eq!(p.refcount(b as u32), r, "seed {seed} step {step}");
            }
        }
    }
}
