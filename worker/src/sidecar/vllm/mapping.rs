//! vLLM's cache, in kvgate block keys: what [`super::wire`] decodes becomes the `stored` /
//! `removed` / `cleared` events of docs/kv-events.md, so the gateway's prefix index sees a vLLM
//! engine exactly as it sees a kvgate worker.
//!
//! vLLM names a block by its own hash (of the parent's hash, the block's tokens and extra keys,
//! seeded per process); kvgate by the docs/block-keys.md chain of a namespace. The mapping does
//! not recompute vLLM's hash: a `BlockStored` event carries the block's token ids and its
//! parent's hash, so each vLLM block is remembered with the kvgate chain state at its end and
//! the kvgate keys are computed from the tokens, chained from the parent's state (the approach
//! of Dynamo's router). A `BlockRemoved` then names the kvgate keys that block completed.
//!
//! **The namespace.** A chain's first block carries the request's `cache_salt` in its extra
//! keys. For a request with a route ticket the sidecar sets that salt to
//! [`salt_for`]`(algorithm, seed)` — the ticket's namespace — so a root block whose only extra
//! key is such a salt starts a chain in that namespace. Any other root (no salt, another salt,
//! multimodal or prompt-embedding keys) is a prefix no kvgate request could reuse (vLLM keeps
//! salted and unsalted blocks apart), and is not mapped.
//!
//! **Block sizes.** vLLM's block size need not be kvgate's `B`: a vLLM block remembers the
//! chain link at the last full kvgate block before its end and the tokens after it (< B), and
//! completes the kvgate blocks that end inside it. Several vLLM blocks can complete the same
//! kvgate key only when `B` is not a multiple of vLLM's size; a key is held while any vLLM block
//! that completed it is (a count per key).
//!
//! **Not mapped** (counted by reason, [`Skip`]): blocks of a KV-cache group other than 0 (the
//! full-attention group of a plain model; hybrid models' other groups), LoRA blocks, blocks
//! hashed with lookahead tokens, blocks with extra keys after the first, blocks whose parent is
//! unknown (stored before the sidecar listened, or under a skipped root), and new blocks once
//! `max_blocks` vLLM blocks are remembered. Skipping loses hits, never invents one: a key is
//! held only while vLLM holds a block whose tokens, in that namespace, produce it.

use std::collections::HashMap;

use prefix_index::{
    BlockKey, BlockSize, ChainLink, HashAlgorithm, KeyChain, KvEvent, NamespaceSeed,
};

use super::wire::{EngineEvent, EngineHash, ExtraKey, Stored};

/// The `cache_salt` the sidecar gives vLLM for a request in namespace `seed`:
/// `kvgate/v1/<algorithm>/<seed hex>`.
pub fn salt_for(algorithm: HashAlgorithm, seed: &NamespaceSeed) -> String {
    format!("kvgate/v1/{}/{}", algorithm.as_str(), seed.to_hex())
}

/// The namespace a [`salt_for`] salt names.
pub fn parse_salt(salt: &str) -> Option<(HashAlgorithm, NamespaceSeed)> {
    let rest = salt.strip_prefix("kvgate/v1/")?;
    let (alg, hex) = rest.split_once('/')?;
    Some((alg.parse().ok()?, NamespaceSeed::from_hex(hex).ok()?))
}

/// Why engine blocks were not mapped.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Skip {
    /// A KV-cache group other than 0.
    Group,
    /// Stored for a LoRA adapter.
    Lora,
    /// Hashed with lookahead tokens.
    Lookahead,
    /// A root without a kvgate salt (direct requests, another salt).
    Unsalted,
    /// Extra keys other than the kvgate salt (multimodal, prompt embeddings).
    ExtraKeys,
    /// The parent block is not known here.
    Unchained,
    /// `max_blocks` engine blocks are remembered already.
    Capacity,
}

impl Skip {
    /// The metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Skip::Group => "group",
            Skip::Lora => "lora",
            Skip::Lookahead => "lookahead",
            Skip::Unsalted => "unsalted",
            Skip::ExtraKeys => "extra_keys",
            Skip::Unchained => "unchained",
            Skip::Capacity => "capacity",
        }
    }
}

/// What one [`EngineCacheMap::apply`] did.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Applied {
    /// Engine blocks now remembered (new ones; a re-stored block counts once).
    pub mapped: usize,
    /// Engine blocks not mapped, by reason.
    pub skipped: Vec<(Skip, usize)>,
}

impl Applied {
    fn skip(&mut self, why: Skip, n: usize) {
        if n == 0 {
            return;
        }
        match self.skipped.iter_mut().find(|(w, _)| *w == why) {
            Some((_, c)) => *c += n,
            None => self.skipped.push((why, n)),
        }
    }
}

/// Most distinct namespaces (chain roots' salts) and media remembered; a block of one more is
/// not mapped (`capacity`) until the map is cleared.
const MAX_NAMESPACES: usize = 1 << 16;
const MAX_MEDIA: usize = 64;

/// One remembered engine block (≈ 90 bytes, plus its keys and tail when not empty).
struct Node {
    /// Index of its chain's namespace in `EngineCacheMap::chains`.
    chain: u32,
    /// The chain link at the last full kvgate block ending at or before this block's end
    /// (the namespace's root before the first).
    link: ChainLink,
    /// Whether `link` is a block's (not the root): its key is then the parent of the next.
    past_root: bool,
    /// Tokens after `link` (fewer than B; none when B divides the engine's block size).
    tail: Box<[u32]>,
    /// The kvgate keys of the blocks that end inside this engine block.
    ends: Box<[BlockKey]>,
}

fn node_heap(node: &Node) -> usize {
    node.tail.len() * 4 + node.ends.len() * 8
}

/// Where a chain continues from: a remembered block's end, or a namespace root.
struct ChainState {
    chain: u32,
    link: ChainLink,
    past_root: bool,
    tail: Vec<u32>,
}

/// vLLM's cache (one engine, group 0) as kvgate keys.
pub struct EngineCacheMap {
    block_size: BlockSize,
    max_blocks: usize,
    /// Remembered engine blocks by (medium index, hash).
    nodes: HashMap<(u8, EngineHash), Node>,
    /// Held kvgate keys: how many remembered engine blocks completed each.
    held: HashMap<BlockKey, u32>,
    /// The namespaces seen, interned (a node names its chain by index).
    chains: Vec<KeyChain>,
    chain_ids: HashMap<(NamespaceSeed, HashAlgorithm), u32>,
    /// The media seen, interned (`None` is a medium too).
    media: Vec<Option<String>>,
    /// Bytes the nodes' keys and tails take on the heap.
    node_heap: usize,
}

impl EngineCacheMap {
    /// An empty map for kvgate blocks of `block_size` tokens, remembering at most `max_blocks`
    /// engine blocks.
    pub fn new(block_size: BlockSize, max_blocks: usize) -> Self {
        EngineCacheMap {
            block_size,
            max_blocks,
            nodes: HashMap::new(),
            held: HashMap::new(),
            chains: Vec::new(),
            chain_ids: HashMap::new(),
            media: Vec::new(),
            node_heap: 0,
        }
    }

    /// Memory the map holds, in bytes: its tables at their capacity (entries and control
    /// bytes) and the nodes' keys and tails (not counting the allocator's own overhead).
    pub fn approx_bytes(&self) -> usize {
        use std::mem::size_of;
        let node_entry = size_of::<((u8, EngineHash), Node)>() + 1;
        let held_entry = size_of::<(BlockKey, u32)>() + 1;
        self.nodes.capacity() * node_entry
            + self.node_heap
            + self.held.capacity() * held_entry
            + self.chains.capacity() * size_of::<KeyChain>()
            + self.chain_ids.capacity() * (size_of::<((NamespaceSeed, HashAlgorithm), u32)>() + 1)
    }

    /// Engine blocks remembered.
    pub fn engine_blocks(&self) -> usize {
        self.nodes.len()
    }

    /// kvgate keys held.
    pub fn held_keys(&self) -> usize {
        self.held.len()
    }

    /// Forgets everything; the event that says so.
    pub fn clear(&mut self) -> KvEvent {
        self.nodes.clear();
        self.held.clear();
        self.chains.clear();
        self.chain_ids.clear();
        self.media.clear();
        self.node_heap = 0;
        KvEvent::Cleared
    }

    /// The index of `medium` (interned when `add`); `None` when unknown and not added, or when
    /// `MAX_MEDIA` are known.
    fn medium(&mut self, medium: &Option<String>, add: bool) -> Option<u8> {
        if let Some(i) = self.media.iter().position(|m| m == medium) {
            return Some(i as u8);
        }
        if !add || self.media.len() >= MAX_MEDIA {
            return None;
        }
        self.media.push(medium.clone());
        Some((self.media.len() - 1) as u8)
    }

    /// Applies one engine event; the kvgate events it makes are appended to `out`.
    pub fn apply(&mut self, ev: &EngineEvent, out: &mut Vec<KvEvent>, applied: &mut Applied) {
        match ev {
            EngineEvent::Cleared => out.push(self.clear()),
            EngineEvent::Removed {
                hashes,
                medium,
                group,
            } => {
                if *group != 0 {
                    return;
                }
                let Some(m) = self.medium(medium, false) else {
                    return;
                };
                let mut gone = Vec::new();
                for h in hashes {
                    let Some(node) = self.nodes.remove(&(m, *h)) else {
                        continue;
                    };
                    self.node_heap -= node_heap(&node);
                    for k in node.ends.iter() {
                        if let Some(count) = self.held.get_mut(k) {
                            *count -= 1;
                            if *count == 0 {
                                self.held.remove(k);
                                gone.push(*k);
                            }
                        }
                    }
                }
                if !gone.is_empty() {
                    out.push(KvEvent::Removed { keys: gone });
                }
            }
            EngineEvent::Stored(s) => self.stored(s, out, applied),
        }
    }

    /// The chain state a root block starts from, by its extra keys.
    fn root(&mut self, extra: Option<&Vec<ExtraKey>>) -> Result<ChainState, Skip> {
        let salt = match extra.map(Vec::as_slice) {
            Some([ExtraKey::Text(s)]) => s,
            None | Some([]) => return Err(Skip::Unsalted),
            Some(_) => return Err(Skip::ExtraKeys),
        };
        let (alg, seed) = parse_salt(salt).ok_or(Skip::Unsalted)?;
        let chain = match self.chain_ids.get(&(seed, alg)) {
            Some(&i) => i,
            None if self.chains.len() < MAX_NAMESPACES => {
                self.chains.push(KeyChain::new(seed, alg, self.block_size));
                let i = (self.chains.len() - 1) as u32;
                self.chain_ids.insert((seed, alg), i);
                i
            }
            None => return Err(Skip::Capacity),
        };
        Ok(ChainState {
            chain,
            link: self.chains[chain as usize].root(),
            past_root: false,
            tail: Vec::new(),
        })
    }

    fn state_of(node: &Node) -> ChainState {
        ChainState {
            chain: node.chain,
            link: node.link,
            past_root: node.past_root,
            tail: node.tail.to_vec(),
        }
    }

    fn stored(&mut self, s: &Stored, out: &mut Vec<KvEvent>, applied: &mut Applied) {
        let n = s.hashes.len();
        if s.group != 0 {
            return applied.skip(Skip::Group, n);
        }
        if s.lora {
            return applied.skip(Skip::Lora, n);
        }
        if s.lookahead {
            return applied.skip(Skip::Lookahead, n);
        }
        let Some(m) = self.medium(&s.medium, true) else {
            return applied.skip(Skip::Capacity, n);
        };
        let extra = |i: usize| s.extra_keys.as_ref().and_then(|e| e[i].as_ref());
        // The state before block 0: the parent's, or a namespace root.
        let mut state = match &s.parent {
            Some(p) => match self.nodes.get(&(m, *p)) {
                Some(node) if extra(0).is_none() => Self::state_of(node),
                Some(_) => return applied.skip(Skip::ExtraKeys, n),
                None => return applied.skip(Skip::Unchained, n),
            },
            None => match self.root(extra(0)) {
                Ok(state) => state,
                Err(why) => return applied.skip(why, n),
            },
        };
        let b = self.block_size.get();
        // A run of newly held keys, in chain order, with the key before it.
        let mut run: Option<(Option<BlockKey>, Vec<BlockKey>)> = None;
        let flush = |run: &mut Option<(Option<BlockKey>, Vec<BlockKey>)>,
                     out: &mut Vec<KvEvent>| {
            if let Some((parent, keys)) = run.take() {
                out.push(KvEvent::Stored { parent, keys });
            }
        };
        for (i, hash) in s.hashes.iter().enumerate() {
            if i > 0 && extra(i).is_some() {
                applied.skip(Skip::ExtraKeys, n - i);
                break;
            }
            if let Some(node) = self.nodes.get(&(m, *hash)) {
                // Re-stored or reused: known already; continue from it.
                state = Self::state_of(node);
                flush(&mut run, out);
                continue;
            }
            if self.nodes.len() >= self.max_blocks {
                applied.skip(Skip::Capacity, n - i);
                break;
            }
            let chain = self.chains[state.chain as usize];
            state
                .tail
                .extend_from_slice(&s.token_ids[i * s.block_size..(i + 1) * s.block_size]);
            let mut ends = Vec::new();
            let mut used = 0;
            while state.tail.len() - used >= b {
                let Ok(next) = chain.next(&state.link, &state.tail[used..used + b]) else {
                    break;
                };
                let parent = state.past_root.then(|| state.link.key());
                used += b;
                state.link = next;
                state.past_root = true;
                let key = next.key();
                ends.push(key);
                let count = self.held.entry(key).or_insert(0);
                *count += 1;
                if *count == 1 {
                    match &mut run {
                        Some((_, keys)) => keys.push(key),
                        None => run = Some((parent, vec![key])),
                    }
                } else {
                    flush(&mut run, out);
                }
            }
            state.tail.drain(..used);
            let node = Node {
                chain: state.chain,
                link: state.link,
                past_root: state.past_root,
                tail: state.tail.clone().into_boxed_slice(),
                ends: ends.into_boxed_slice(),
            };
            self.node_heap += node_heap(&node);
            self.nodes.insert((m, *hash), node);
            applied.mapped += 1;
        }
        flush(&mut run, out);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seed(n: u8) -> NamespaceSeed {
        NamespaceSeed([n; 32])
    }

    fn h(n: u64) -> EngineHash {
        EngineHash::from_int(n)
    }

    fn stored(
        hashes: &[u64],
        parent: Option<u64>,
        tokens: &[u32],
        bs: usize,
        salt: Option<&str>,
    ) -> EngineEvent {
        let mut extra: Vec<Option<Vec<ExtraKey>>> = vec![None; hashes.len()];
        if let Some(s) = salt {
            extra[0] = Some(vec![ExtraKey::Text(s.to_string())]);
        }
        EngineEvent::Stored(Stored {
            hashes: hashes.iter().map(|&x| h(x)).collect(),
            parent: parent.map(h),
            token_ids: tokens.to_vec(),
            block_size: bs,
            lora: false,
            medium: Some("GPU".into()),
            extra_keys: salt.map(|_| extra),
            group: 0,
            lookahead: false,
        })
    }

    fn removed(hashes: &[u64]) -> EngineEvent {
        EngineEvent::Removed {
            hashes: hashes.iter().map(|&x| h(x)).collect(),
            medium: Some("GPU".into()),
            group: 0,
        }
    }

    fn run(map: &mut EngineCacheMap, ev: EngineEvent) -> (Vec<KvEvent>, Applied) {
        let mut out = Vec::new();
        let mut a = Applied::default();
        map.apply(&ev, &mut out, &mut a);
        (out, a)
    }

    #[test]
    fn salts_round_trip() {
        let s = salt_for(HashAlgorithm::Sha256, &seed(7));
        assert_eq!(parse_salt(&s), Some((HashAlgorithm::Sha256, seed(7))));
        assert_eq!(parse_salt("kvgate/v1/md5/00"), None);
        assert_eq!(parse_salt("tenant-a"), None);
    }

    /// Equal block sizes: one key per engine block, chained as a kvgate worker chains them,
    /// across events (parent by engine hash), removed when the engine removes the block.
    #[test]
    fn keys_equal_the_chain_of_the_same_tokens() {
        let bs = BlockSize::new(4).unwrap();
        let chain = KeyChain::new(seed(1), HashAlgorithm::Xxh3, bs);
        let tokens: Vec<u32> = (0..16).collect();
        let want = chain.keys(&tokens);
        let salt = salt_for(HashAlgorithm::Xxh3, &seed(1));
        let mut map = EngineCacheMap::new(bs, 100);
        let (out, a) = run(
            &mut map,
            stored(&[10, 11], None, &tokens[..8], 4, Some(&salt)),
        );
        assert_eq!(a.mapped, 2);
        assert_eq!(
            out,
            vec![KvEvent::Stored {
                parent: None,
                keys: want[..2].to_vec()
            }]
        );
        let (out, _) = run(&mut map, stored(&[12, 13], Some(11), &tokens[8..], 4, None));
        assert_eq!(
            out,
            vec![KvEvent::Stored {
                parent: Some(want[1]),
                keys: want[2..].to_vec()
            }]
        );
        // Reported again (a reuse): nothing new.
        let (out, a) = run(
            &mut map,
            stored(&[10, 11], None, &tokens[..8], 4, Some(&salt)),
        );
        assert!(out.is_empty());
        assert_eq!(a.mapped, 0);
        let (out, _) = run(&mut map, removed(&[13, 99]));
        assert_eq!(
            out,
            vec![KvEvent::Removed {
                keys: vec![want[3]]
            }]
        );
        assert_eq!(map.held_keys(), 3);
        assert_eq!(
            run(&mut map, EngineEvent::Cleared).0,
            vec![KvEvent::Cleared]
        );
        assert_eq!((map.held_keys(), map.engine_blocks()), (0, 0));
    }

    /// vLLM blocks of 4, kvgate blocks of 6: keys end inside engine blocks; a key completed by
    /// two engine blocks (two continuations of one prefix) stays held until both are removed.
    #[test]
    fn other_block_sizes_chain_across_engine_blocks() {
        let bs = BlockSize::new(6).unwrap();
        let chain = KeyChain::new(seed(2), HashAlgorithm::Sha256, bs);
        let a: Vec<u32> = (100..112).collect();
        let mut b = a.clone();
        b[7] = 7; // differs in the second engine block, after the first kvgate block
        let salt = salt_for(HashAlgorithm::Sha256, &seed(2));
        let mut map = EngineCacheMap::new(bs, 100);
        let (out, _) = run(&mut map, stored(&[1, 2, 3], None, &a, 4, Some(&salt)));
        let ka = chain.keys(&a);
        assert_eq!(
            out,
            vec![KvEvent::Stored {
                parent: None,
                keys: ka.clone()
            }]
        );
        // b shares engine block 1 (tokens 0..4); its blocks 4 and 5 complete ka[0] again and
        // its own second key.
        let (out, _) = run(&mut map, stored(&[4, 5], Some(1), &b[4..], 4, None));
        let kb = chain.keys(&b);
        assert_eq!(kb[0], ka[0]);
        assert_ne!(kb[1], ka[1]);
        assert_eq!(
            out,
            vec![KvEvent::Stored {
                parent: Some(ka[0]),
                keys: vec![kb[1]]
            }]
        );
        // Engine block 1 completes no key; block 2 completed ka[0], but so did block 4.
        assert!(run(&mut map, removed(&[1])).0.is_empty());
        assert!(run(&mut map, removed(&[2])).0.is_empty());
        let (out, _) = run(&mut map, removed(&[3]));
        assert_eq!(out, vec![KvEvent::Removed { keys: vec![ka[1]] }]);
        let (out, _) = run(&mut map, removed(&[4]));
        assert_eq!(out, vec![KvEvent::Removed { keys: vec![ka[0]] }]);
        assert_eq!(map.held_keys(), 1);
    }

    #[test]
    fn what_no_kvgate_request_could_reuse_is_not_mapped() {
        let bs = BlockSize::new(2).unwrap();
        let salt = salt_for(HashAlgorithm::Xxh3, &seed(3));
        let mut map = EngineCacheMap::new(bs, 3);
        let t = [1, 2, 3, 4];
        assert_eq!(
            run(&mut map, stored(&[1, 2], None, &t, 2, None)).1.skipped,
            vec![(Skip::Unsalted, 2)]
        );
        assert_eq!(
            run(&mut map, stored(&[1, 2], None, &t, 2, Some("tenant-a")))
                .1
                .skipped,
            vec![(Skip::Unsalted, 2)]
        );
        assert_eq!(
            run(&mut map, stored(&[5], Some(77), &t[..2], 2, None))
                .1
                .skipped,
            vec![(Skip::Unchained, 1)]
        );
        let mut lora = stored(&[1], None, &t[..2], 2, Some(&salt));
        if let EngineEvent::Stored(s) = &mut lora {
            s.lora = true;
        }
        assert_eq!(run(&mut map, lora).1.skipped, vec![(Skip::Lora, 1)]);
        let mut mm = stored(&[1, 2], None, &t, 2, Some(&salt));
        if let EngineEvent::Stored(s) = &mut mm {
            s.extra_keys.as_mut().unwrap()[1] = Some(vec![ExtraKey::Other]);
        }
        let (out, a) = run(&mut map, mm);
        assert_eq!(
            (a.mapped, a.skipped.clone()),
            (1, vec![(Skip::ExtraKeys, 1)])
        );
        assert_eq!(out.len(), 1);
        let mut g = stored(&[8], None, &t[..2], 2, Some(&salt));
        if let EngineEvent::Stored(s) = &mut g {
            s.group = 1;
        }
        assert_eq!(run(&mut map, g).1.skipped, vec![(Skip::Group, 1)]);
        // Capacity 3: one block remembered, two more fit, the fourth does not.
        let (_, a) = run(
            &mut map,
            stored(&[20, 21, 22], Some(1), &[5, 6, 7, 8, 9, 10], 2, None),
        );
        assert_eq!((a.mapped, a.skipped), (2, vec![(Skip::Capacity, 1)]));
        // Removing a block of another group or an unknown one changes nothing.
        let (out, _) = run(
            &mut map,
            EngineEvent::Removed {
                hashes: vec![h(1)],
                medium: Some("GPU".into()),
                group: 1,
            },
        );
        assert!(out.is_empty());
        assert_eq!(map.held_keys(), 3);
    }

    /// Blocks of the same hash on two media (GPU, CPU offload) are two engine blocks: the key
    /// stays held until both are gone.
    #[test]
    fn media_are_counted_apart() {
        let bs = BlockSize::new(2).unwrap();
        let salt = salt_for(HashAlgorithm::Xxh3, &seed(4));
        let mut map = EngineCacheMap::new(bs, 10);
        run(&mut map, stored(&[1], None, &[1, 2], 2, Some(&salt)));
        let mut cpu = stored(&[1], None, &[1, 2], 2, Some(&salt));
        if let EngineEvent::Stored(s) = &mut cpu {
            s.medium = Some("CPU".into());
        }
        assert!(run(&mut map, cpu).0.is_empty());
        assert!(run(&mut map, removed(&[1])).0.is_empty());
        assert_eq!(map.held_keys(), 1);
        let (out, _) = run(
            &mut map,
            EngineEvent::Removed {
                hashes: vec![h(1)],
                medium: Some("CPU".into()),
                group: 0,
            },
        );
        assert_eq!(out.len(), 1);
        assert_eq!(map.held_keys(), 0);
    }
}
