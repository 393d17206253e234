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
//! Entries are also indexed by what they continue ([`BlockParent`]: the parent content, or the
//! chain's root key for a first block), so a request whose next block is not cached can find
//! the cached blocks that share its first tokens ([`PrefixCache::children`]).
//!
//! Complexity: lookup O(m × B) for an m-block match (hash lookup + token compare per block);
//! insert/remove O(B + siblings). Memory per entry: the B token ids (4 B bytes) plus ~64 bytes.

use std::collections::HashMap;

use prefix_index::BlockKey;

use crate::executor::BlockId;

/// A cached content: `(block id, generation of that block when it was keyed)`.
pub type ContentRef = (BlockId, u32);

/// What a block continues: the cached content of the block before it, or (a chain's first
/// block) the chain's root key, which names the namespace and salt.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BlockParent {
    /// Block 0 of the chain with this root key.
    Root(BlockKey),
    /// The block after this cached content.
    Block(ContentRef),
}

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
    /// For a chain's first block, the chain's root key (indexes it under
    /// [`BlockParent::Root`]); `None` otherwise.
    pub root: Option<BlockKey>,
}

impl CacheEntry {
    /// What this block continues, when known (a first block registered without its root key
    /// is not indexed).
    pub fn under(&self) -> Option<BlockParent> {
        match (self.parent, self.root) {
            (Some(c), _) => Some(BlockParent::Block(c)),
            (None, Some(r)) => Some(BlockParent::Root(r)),
            (None, None) => None,
        }
    }
}

/// Key → verified cached block, and each parent's cached children (for partial matches).
#[derive(Clone, Debug, Default)]
pub struct PrefixCache {
    map: HashMap<BlockKey, CacheEntry>,
    children: HashMap<BlockParent, Vec<BlockKey>>,
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
        let old = self.remove(key);
        if let Some(under) = entry.under() {
            self.children.entry(under).or_default().push(key);
        }
        self.map.insert(key, entry);
        old
    }

    /// Removes the entry of `key` (when its block is evicted or re-keyed).
    pub fn remove(&mut self, key: BlockKey) -> Option<CacheEntry> {
        let e = self.map.remove(&key)?;
        if let Some(under) = e.under() {
            if let Some(keys) = self.children.get_mut(&under) {
                keys.retain(|k| *k != key);
                if keys.is_empty() {
                    self.children.remove(&under);
                }
            }
        }
        Some(e)
    }

    /// The keys of the cached blocks that continue `parent` (in insertion order).
    pub fn children(&self, parent: BlockParent) -> &[BlockKey] {
        self.children.get(&parent).map_or(&[], |v| v.as_slice())
    }

    /// Test hook: plants an entry directly (e.g. to force a key collision).
    #[doc(hidden)]
    pub fn insert_raw(&mut self, key: BlockKey, entry: CacheEntry) {
        self.insert(key, entry);
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
            root: None,
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

    #[test]
    fn children_follow_inserts_and_removals() {
        let mut c = PrefixCache::new();
        let root = BlockParent::Root(BlockKey(9));
        let mut first = entry(5, &[1, 2], None);
        first.root = Some(BlockKey(9));
        c.insert(BlockKey(1), first.clone());
        c.insert(BlockKey(2), entry(6, &[3, 4], Some((5, 0))));
        c.insert(BlockKey(3), entry(7, &[3, 5], Some((5, 0))));
        assert_eq!(c.children(root), &[BlockKey(1)]);
        assert_eq!(
            c.children(BlockParent::Root(BlockKey(8))),
            &[] as &[BlockKey]
        );
        assert_eq!(
            c.children(BlockParent::Block((5, 0))),
            &[BlockKey(2), BlockKey(3)]
        );
        assert_eq!(
            c.children(BlockParent::Block((5, 1))),
            &[] as &[BlockKey],
            "generation"
        );
        c.remove(BlockKey(2));
        assert_eq!(c.children(BlockParent::Block((5, 0))), &[BlockKey(3)]);
        // Replacing an entry re-indexes it.
        c.insert(BlockKey(3), entry(8, &[3, 6], Some((4, 0))));
        assert_eq!(c.children(BlockParent::Block((5, 0))), &[] as &[BlockKey]);
        assert_eq!(c.children(BlockParent::Block((4, 0))), &[BlockKey(3)]);
        c.remove(BlockKey(1));
        assert_eq!(c.children(root), &[] as &[BlockKey]);
        assert!(c.children.is_empty() || c.children.len() == 1);
    }
}
