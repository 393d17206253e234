//! The prefix cache: block key → the block holding that content, verified.
//!
//! Every cached entry stores the token ids of its block and a link to its parent entry as a
//! `(block id, generation)` pair (see [`super::block_pool`]: a generation names one cached
//! content of a block). A lookup walks the request's key chain from the root and accepts
//! block `i` only when the entry's tokens equal the request's block `i` **and** its parent
//! link is the block accepted for `i − 1` (no parent for `i = 0`). By induction an accepted
//! prefix holds exactly the request's tokens, so a 64-bit key collision costs a miss, never a
//! wrong answer. (The first block of two namespaces whose keys collide *and* whose tokens are
//! equal would be shared: its K/V is identical, so the answer is still right; only the
//! namespace separation is breached, with probability ~2⁻⁶⁴ per pair.)
//!
//! One entry per key. Inserting a key that is present with the same tokens and parent is a
//! no-op (two sequences computed the same block: the second keeps its copy unkeyed);
//! inserting over a stale or colliding entry replaces it (the old block loses its key).
//! An entry whose parent was evicted becomes unreachable and ages out through the LRU.
//!
//! Complexity: lookup O(m × B) for an m-block match (hash lookup + token compare per block);
//! insert/remove O(B). Memory per entry: the B token ids (4 B bytes) plus ~64 bytes.

use std::collections::HashMap;

use prefix_index::BlockKey;

use crate::executor::BlockId;

/// A cached content: `(block id, generation of that block when it was keyed)`.
pub type ContentRef = (BlockId, u32);

/// One cached block.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CacheEntry {
    /// The block holding the K/V.
    pub block: BlockId,
    /// Its generation when keyed.
    pub generation: u32,
    /// The token ids of the block (verified on every hit).
    pub tokens: Box<[u32]>,
    /// The parent entry's content (None for a chain's first block).
    pub parent: Option<ContentRef>,
    /// The parent's key (for `Stored` events).
    pub parent_key: Option<BlockKey>,
}

/// Key → verified cached block.
#[derive(Clone, Debug, Default)]
pub struct PrefixCache {
    map: HashMap<BlockKey, CacheEntry>,
}

impl PrefixCache {
    /// An empty cache.
    pub fn new() -> Self {
        Self::default()
    }

    /// Number of cached keys.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// True when nothing is cached.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// The entry of `key`.
    pub fn get(&self, key: BlockKey) -> Option<&CacheEntry> {
        self.map.get(&key)
    }

    /// The verified entry for block `i` of a request: the entry of `key` whose tokens are
    /// `tokens` and whose parent is `parent`.
    pub fn matching(
        &self,
        key: BlockKey,
        tokens: &[u32],
        parent: Option<ContentRef>,
    ) -> Option<&CacheEntry> {
        self.map
            .get(&key)
            .filter(|e| e.parent == parent && &*e.tokens == tokens)
    }

    /// Inserts or replaces the entry of `key`; returns the replaced entry.
    pub fn insert(&mut self, key: BlockKey, entry: CacheEntry) -> Option<CacheEntry> {
        self.map.insert(key, entry)
    }

    /// Removes the entry of `key` (when its block is evicted or re-keyed).
    pub fn remove(&mut self, key: BlockKey) -> Option<CacheEntry> {
        self.map.remove(&key)
    }

    /// Test hook: plants an entry directly (e.g. to force a key collision).
    #[doc(hidden)]
    pub fn insert_raw(&mut self, key: BlockKey, entry: CacheEntry) {
        self.map.insert(key, entry);
    }

    /// Iterates over all entries.
    pub fn iter(&self) -> impl Iterator<Item = (&BlockKey, &CacheEntry)> {
        self.map.iter()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(block: BlockId, tokens: &[u32], parent: Option<ContentRef>) -> CacheEntry {
        CacheEntry {
            block,
            generation: 0,
            tokens: tokens.into(),
            parent,
            parent_key: None,
        }
    }

    #[test]
    fn matching_checks_tokens_and_parent() {
        let mut c = PrefixCache::new();
        c.insert(BlockKey(1), entry(5, &[1, 2], None));
        c.insert(BlockKey(2), entry(6, &[3, 4], Some((5, 0))));
        assert!(c.matching(BlockKey(1), &[1, 2], None).is_some());
        assert!(
            c.matching(BlockKey(1), &[1, 3], None).is_none(),
            "collision"
        );
        assert!(c.matching(BlockKey(1), &[1, 2], Some((5, 0))).is_none());
        assert!(c.matching(BlockKey(2), &[3, 4], Some((5, 0))).is_some());
        assert!(
            c.matching(BlockKey(2), &[3, 4], Some((5, 1))).is_none(),
            "stale parent"
        );
        assert_eq!(c.len(), 2);
        assert_eq!(c.remove(BlockKey(1)).map(|e| e.block), Some(5));
        assert!(c.get(BlockKey(1)).is_none());
    }
}
