//! Tokenization by segments between added tokens, with a bounded cache of segment ids.
//!
//! The `tokenizers` pipeline first splits the input at added tokens (leftmost-longest match)
//! and then tokenizes each piece in between independently. A rendered chat is mostly pieces
//! that repeat from one request to the next (every earlier turn of a conversation, the
//! system prompt), so caching the ids of each piece makes re-tokenizing turn N+1 cost about
//! as much as tokenizing the new message alone. The result is identical to a direct
//! `encode` (differential property tests against the plain path).
//!
//! Used only when every added token is "plain" (no lstrip/rstrip/single_word, and either not
//! normalized or no normalizer), so that an exact byte match is exactly how `tokenizers`
//! splits; otherwise the profile falls back to direct encoding.
//!
//! Cost: splitting is O(text bytes × added tokens sharing a first byte) in the worst case,
//! in practice one table lookup per byte; a cache hit is one hash of the piece.
//! The cache keeps two generations (current, previous) of at most `max_bytes / 2` each; a hit
//! in the previous generation is promoted, and when the current one fills up it becomes the
//! previous one (an O(1) approximation of LRU).

use std::sync::{Arc, Mutex};

use tokenizers::Tokenizer;

use crate::bpe::{ByteLevelBpe, FastMap};
use crate::error::{tk_err, Result};

/// Default cache budget in bytes (segment text + 4 bytes per id), across both generations.
pub(crate) const DEFAULT_CACHE_BYTES: usize = 64 << 20;
/// Pieces shorter than this are encoded directly (hashing them would cost about as much).
const MIN_CACHED_LEN: usize = 16;

#[derive(Default)]
struct Generations {
    current: FastMap<Box<str>, Arc<[u32]>>,
    previous: FastMap<Box<str>, Arc<[u32]>>,
    current_bytes: usize,
}

pub(crate) struct SegmentEncoder {
    /// For each first byte, the added tokens starting with it, longest first.
    by_first_byte: Vec<Vec<(Box<str>, u32)>>,
    /// The direct byte-level BPE for the pieces, where the tokenizer is one
    /// ([`crate::bpe`]); else the `tokenizers` pipeline.
    fast: Option<ByteLevelBpe>,
    cache: Mutex<Generations>,
    max_bytes: usize,
}

impl SegmentEncoder {
    /// `None` when some added token has options that an exact byte match cannot reproduce.
    pub(crate) fn new(
        tok: &Tokenizer,
        fast: Option<ByteLevelBpe>,
        max_bytes: usize,
    ) -> Option<Self> {
        let has_normalizer = tok.get_normalizer().is_some();
        let mut by_first_byte: Vec<Vec<(Box<str>, u32)>> = vec![Vec::new(); 256];
        for (id, added) in tok.get_added_tokens_decoder() {
            if added.lstrip
                || added.rstrip
                || added.single_word
                || (added.normalized && has_normalizer)
            {
                return None;
            }
            let first = *added.content.as_bytes().first()?;
            by_first_byte[first as usize].push((added.content.as_str().into(), id));
        }
        for list in &mut by_first_byte {
            list.sort_by(|a, b| b.0.len().cmp(&a.0.len()).then_with(|| a.0.cmp(&b.0)));
        }
        Some(SegmentEncoder {
            by_first_byte,
            fast,
            cache: Mutex::new(Generations::default()),
            max_bytes,
        })
    }

    /// Encode `text` with special tokens parsed, using and filling the cache.
    pub(crate) fn encode(&self, tok: &Tokenizer, text: &str) -> Result<Vec<u32>> {
        self.encode_until(tok, text, usize::MAX)
    }

    /// [`Self::encode`], stopping after the first piece that takes the count past `max` (the
    /// ids are then a prefix of the full encoding, longer than `max`).
    pub(crate) fn encode_until(&self, tok: &Tokenizer, text: &str, max: usize) -> Result<Vec<u32>> {
        let bytes = text.as_bytes();
        let mut ids = Vec::with_capacity(text.len() / 3);
        let mut start = 0;
        let mut i = 0;
        while i < bytes.len() {
            let found = self.by_first_byte[bytes[i] as usize]
                .iter()
                .find(|(t, _)| bytes[i..].starts_with(t.as_bytes()));
            match found {
                Some((t, id)) => {
                    // `i` starts a UTF-8 string, hence is a char boundary.
                    self.encode_piece(tok, text.get(start..i).unwrap_or(""), &mut ids)?;
                    ids.push(*id);
                    if ids.len() > max {
                        return Ok(ids);
                    }
                    i += t.len();
                    start = i;
                }
                None => i += 1,
            }
        }
        self.encode_piece(tok, text.get(start..).unwrap_or(""), &mut ids)?;
        Ok(ids)
    }

    fn encode_piece(&self, tok: &Tokenizer, piece: &str, out: &mut Vec<u32>) -> Result<()> {
        if piece.is_empty() {
            return Ok(());
        }
        if piece.len() < MIN_CACHED_LEN {
            return self.encode_direct(tok, piece, out);
        }
        if let Some(hit) = self.lookup(piece) {
            out.extend_from_slice(&hit);
            return Ok(());
        }
        let start = out.len();
        self.encode_direct(tok, piece, out)?;
        let ids: Arc<[u32]> = out[start..].into();
        self.insert(piece, ids);
        Ok(())
    }

    fn encode_direct(&self, tok: &Tokenizer, piece: &str, out: &mut Vec<u32>) -> Result<()> {
        match &self.fast {
            Some(bpe) => bpe.encode(piece, out),
            None => {
                let enc = tok.encode_fast(piece, false).map_err(tk_err)?;
                out.extend_from_slice(enc.get_ids());
            }
        }
        Ok(())
    }

    /// Whether the pieces go through [`crate::bpe`] (not the `tokenizers` pipeline).
    pub(crate) fn is_direct_bpe(&self) -> bool {
        self.fast.is_some()
    }

    fn lookup(&self, piece: &str) -> Option<Arc<[u32]>> {
        let mut g = self.cache.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(hit) = g.current.get(piece) {
            return Some(hit.clone());
        }
        let (key, hit) = g.previous.remove_entry(piece)?;
        let cost = key.len() + 4 * hit.len();
        g.current.insert(key, hit.clone());
        g.current_bytes += cost;
        self.maybe_rotate(&mut g);
        Some(hit)
    }

    fn insert(&self, piece: &str, ids: Arc<[u32]>) {
        let cost = piece.len() + 4 * ids.len();
        if cost > self.max_bytes / 2 {
            return;
        }
        let mut g = self.cache.lock().unwrap_or_else(|e| e.into_inner());
        if g.current.insert(piece.into(), ids).is_none() {
            g.current_bytes += cost;
        }
        self.maybe_rotate(&mut g);
    }

    fn maybe_rotate(&self, g: &mut Generations) {
        if g.current_bytes > self.max_bytes / 2 {
            g.previous = std::mem::take(&mut g.current);
            g.current_bytes = 0;
        }
    }

    /// Drop every cached piece.
    pub(crate) fn clear(&self) {
        let mut g = self.cache.lock().unwrap_or_else(|e| e.into_inner());
        *g = Generations::default();
        if let Some(bpe) = &self.fast {
            bpe.clear_cache();
        }
    }
}
