//! A direct byte-level BPE encoder for the pieces between added tokens.
//!
//! The `tokenizers` pipeline spends most of a byte-level encode on bookkeeping this crate never
//! reads: a `NormalizedString` with a per-byte alignment table for every piece, the GPT-2 byte
//! map applied as a string transformation, and a `Token` (with its string and offsets) for every
//! id — about 2 µs per token, three quarters of it in the allocator (`perf` of an encode).
//! This encoder computes the same ids with none of it:
//!
//! 1. **Splits**: the pre-tokenizer's regular expressions, in order, on Oniguruma (the engine the
//!    `tokenizers` library runs them on): each one splits every piece the previous produced into
//!    its matches and the text between them (`Split(…, Isolated)`), empty pieces dropped; the last
//!    one is GPT-2's pattern when the byte-level step applies it (`ByteLevel(use_regex = true)`).
//! 2. **Bytes**: a piece's initial symbols are its bytes (the GPT-2 byte-to-unicode map is a
//!    bijection, so a vocabulary entry is looked up by the bytes it stands for); a byte whose
//!    character is not in the vocabulary is dropped, as `tokenizers` drops it (no unknown token,
//!    no byte fallback on this path).
//! 3. **Merges**: with `ignore_merges`, a piece that is a vocabulary entry is that entry;
//!    otherwise the lowest-ranked adjacent pair is merged, leftmost first among equal ranks,
//!    until no pair has a merge — `tokenizers`' `Word::merge_all` order (a min-heap on
//!    (rank, position) with stale entries skipped). The rank of a pair is the index of its last
//!    entry in the merge list (the merge map is built by inserting the list in order).
//! 4. **Word cache**: pieces shorter than 256 bytes keep their ids in a bounded map (cleared
//!    when it reaches its capacity), as `tokenizers` caches merged words.
//!
//! Built only from a tokenizer whose serialization says exactly this (a BPE model without
//! dropout, unknown token, byte fallback, subword prefix or word suffix; no normalizer; a
//! pre-tokenizer of `Split(regex, Isolated)` steps ending in `ByteLevel(add_prefix_space =
//! false)`); anything else keeps the `tokenizers` pipeline. Differential tests compare the two on
//! every byte-level vocabulary of llama.cpp's test set (`tests/vocab.rs`) and on random text.

use std::collections::{BinaryHeap, HashMap};
use std::sync::Mutex;

use onig::Regex;
use serde_json::Value;

/// Pieces at least this long are not cached (as in `tokenizers`).
const MAX_CACHED_PIECE: usize = 256;
/// Cached pieces before the cache is emptied.
const CACHE_CAPACITY: usize = 20_000;

/// GPT-2's `bytes_to_unicode`: the character each byte is written as in the vocabulary.
fn byte_char(b: u8) -> char {
    let printable = |b: u8| (b'!'..=b'~').contains(&b) || (0xA1..=0xAC).contains(&b) || b >= 0xAE;
    if printable(b) {
        return char::from(b);
    }
    // The others, in byte order, take 256, 257, …
    let n = (0..b).filter(|&x| !printable(x)).count() as u32;
    char::from_u32(256 + n).unwrap_or('\u{fffd}')
}

/// The bytes a vocabulary string stands for, when every character is a byte-level one.
fn string_bytes(s: &str, char_byte: &HashMap<char, u8>) -> Option<Vec<u8>> {
    s.chars().map(|c| char_byte.get(&c).copied()).collect()
}

/// A word's bytes → its ids.
type WordCache = HashMap<Box<[u8]>, Box<[u32]>>;

/// See the module documentation.
pub(crate) struct ByteLevelBpe {
    splits: Vec<Regex>,
    /// The id of each single byte's character, if the vocabulary has it.
    byte_id: [Option<u32>; 256],
    /// Vocabulary by the bytes an entry stands for (only with `ignore_merges`).
    whole: HashMap<Box<[u8]>, u32>,
    /// `(left, right) → (rank, merged id)`.
    merges: HashMap<(u32, u32), (u32, u32)>,
    ignore_merges: bool,
    cache: Mutex<WordCache>,
}

/// GPT-2's split as `tokenizers`' byte-level step applies it.
const BYTE_LEVEL_PATTERN: &str =
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";

impl ByteLevelBpe {
    /// From a tokenizer's serialization (`Tokenizer::to_string`); `None` unless it is exactly
    /// the shape described in the module documentation.
    pub(crate) fn from_serialized(tok: &Value) -> Option<Self> {
        if !tok.get("normalizer").is_none_or(Value::is_null) {
            return None;
        }
        let model = tok.get("model")?;
        let is_null_or_empty = |k: &str| {
            model
                .get(k)
                .is_none_or(|v| v.is_null() || v.as_str() == Some(""))
        };
        if model.get("type")?.as_str()? != "BPE"
            || !model.get("dropout").is_none_or(Value::is_null)
            || !model.get("unk_token").is_none_or(Value::is_null)
            || !is_null_or_empty("continuing_subword_prefix")
            || !is_null_or_empty("end_of_word_suffix")
            || model.get("byte_fallback").and_then(Value::as_bool) != Some(false)
        {
            return None;
        }
        let ignore_merges = model
            .get("ignore_merges")
            .and_then(Value::as_bool)
            .unwrap_or(false);
        let splits = Self::splits(tok.get("pre_tokenizer")?)?;

        let char_byte: HashMap<char, u8> = (0..=255u8).map(|b| (byte_char(b), b)).collect();
        let vocab = model.get("vocab")?.as_object()?;
        let mut by_string: HashMap<&str, u32> = HashMap::with_capacity(vocab.len());
        let mut byte_id = [None; 256];
        let mut whole = HashMap::new();
        for (s, id) in vocab {
            let id = u32::try_from(id.as_u64()?).ok()?;
            by_string.insert(s.as_str(), id);
            let mut chars = s.chars();
            if let (Some(c), None) = (chars.next(), chars.next()) {
                if let Some(&b) = char_byte.get(&c) {
                    byte_id[b as usize] = Some(id);
                }
            }
            if ignore_merges {
                if let Some(bytes) = string_bytes(s, &char_byte) {
                    whole.insert(bytes.into_boxed_slice(), id);
                }
            }
        }
        let list = model.get("merges")?.as_array()?;
        let mut merges = HashMap::with_capacity(list.len());
        for (rank, m) in list.iter().enumerate() {
            let (a, b) = match m {
                Value::Array(pair) if pair.len() == 2 => (pair[0].as_str()?, pair[1].as_str()?),
                Value::String(s) => s.split_once(' ')?,
                _ => return None,
            };
            let merged = format!("{a}{b}");
            let (&ia, &ib, &im) = (
                by_string.get(a)?,
                by_string.get(b)?,
                by_string.get(merged.as_str())?,
            );
            merges.insert((ia, ib), (u32::try_from(rank).ok()?, im));
        }
        Some(ByteLevelBpe {
            splits,
            byte_id,
            whole,
            merges,
            ignore_merges,
            cache: Mutex::new(HashMap::new()),
        })
    }

    /// The split patterns of a `Split(regex, Isolated)*` + `ByteLevel` pre-tokenizer.
    fn splits(pre: &Value) -> Option<Vec<Regex>> {
        let steps: Vec<&Value> = match pre.get("type")?.as_str()? {
            "Sequence" => pre.get("pretokenizers")?.as_array()?.iter().collect(),
            _ => vec![pre],
        };
        let (last, rest) = steps.split_last()?;
        let mut patterns = Vec::new();
        for step in rest {
            if step.get("type")?.as_str()? != "Split"
                || step.get("behavior")?.as_str()? != "Isolated"
                || step.get("invert")?.as_bool()?
            {
                return None;
            }
            patterns.push(step.get("pattern")?.get("Regex")?.as_str()?.to_string());
        }
        if last.get("type")?.as_str()? != "ByteLevel" || last.get("add_prefix_space")?.as_bool()? {
            return None;
        }
        if last.get("use_regex")?.as_bool()? {
            patterns.push(BYTE_LEVEL_PATTERN.to_string());
        }
        patterns.iter().map(|p| Regex::new(p).ok()).collect()
    }

    /// Append the ids of `text` (a piece with no added token in it) to `out`.
    pub(crate) fn encode(&self, text: &str, out: &mut Vec<u32>) {
        let mut pieces = vec![(0usize, text.len())];
        let mut next = Vec::new();
        for re in &self.splits {
            next.clear();
            for &(s, e) in &pieces {
                let mut prev = s;
                for (ms, me) in re.find_iter(&text[s..e]) {
                    let (ms, me) = (s + ms, s + me);
                    if prev < ms {
                        next.push((prev, ms));
                    }
                    if ms < me {
                        next.push((ms, me));
                    }
                    prev = me;
                }
                if prev < e {
                    next.push((prev, e));
                }
            }
            std::mem::swap(&mut pieces, &mut next);
        }
        for (s, e) in pieces {
            self.encode_word(&text.as_bytes()[s..e], out);
        }
    }

    fn encode_word(&self, word: &[u8], out: &mut Vec<u32>) {
        if self.ignore_merges {
            if let Some(&id) = self.whole.get(word) {
                out.push(id);
                return;
            }
        }
        let cacheable = word.len() < MAX_CACHED_PIECE;
        if cacheable {
            let cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(ids) = cache.get(word) {
                out.extend_from_slice(ids);
                return;
            }
        }
        let ids = self.merge(word);
        out.extend_from_slice(&ids);
        if cacheable {
            let mut cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
            if cache.len() >= CACHE_CAPACITY {
                cache.clear();
            }
            cache.insert(word.into(), ids.into_boxed_slice());
        }
    }

    /// Empty the word cache (benchmarks of new text).
    pub(crate) fn clear_cache(&self) {
        self.cache.lock().unwrap_or_else(|e| e.into_inner()).clear();
    }

    /// `tokenizers`' `Word::merge_all` over the word's byte symbols.
    fn merge(&self, word: &[u8]) -> Vec<u32> {
        let mut id: Vec<u32> = word
            .iter()
            .filter_map(|&b| self.byte_id[b as usize])
            .collect();
        let n = id.len();
        if n < 2 {
            return id;
        }
        let mut prev: Vec<isize> = (0..n as isize).map(|i| i - 1).collect();
        let mut next: Vec<isize> = (0..n as isize).map(|i| i + 1).collect();
        next[n - 1] = -1;
        let mut alive = vec![true; n];
        // Min-heap on (rank, position): `Reverse` of the pair.
        let mut heap = BinaryHeap::with_capacity(n);
        for i in 0..n - 1 {
            if let Some(&(rank, new_id)) = self.merges.get(&(id[i], id[i + 1])) {
                heap.push(std::cmp::Reverse((rank, i, new_id)));
            }
        }
        while let Some(std::cmp::Reverse((_, pos, new_id))) = heap.pop() {
            if !alive[pos] || next[pos] < 0 {
                continue;
            }
            let right = next[pos] as usize;
            // A stale entry: the pair at `pos` changed since it was pushed.
            if self.merges.get(&(id[pos], id[right])).map(|m| m.1) != Some(new_id) {
                continue;
            }
            id[pos] = new_id;
            alive[right] = false;
            next[pos] = next[right];
            if next[right] >= 0 {
                prev[next[right] as usize] = pos as isize;
            }
            if prev[pos] >= 0 {
                let p = prev[pos] as usize;
                if let Some(&(rank, nid)) = self.merges.get(&(id[p], id[pos])) {
                    heap.push(std::cmp::Reverse((rank, p, nid)));
                }
            }
            if next[pos] >= 0 {
                let nx = next[pos] as usize;
                if let Some(&(rank, nid)) = self.merges.get(&(id[pos], id[nx])) {
                    heap.push(std::cmp::Reverse((rank, pos, nid)));
                }
            }
        }
        (0..n).filter(|&i| alive[i]).map(|i| id[i]).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_byte_map_is_gpt2s() {
        assert_eq!(byte_char(b'a'), 'a');
        assert_eq!(byte_char(b' '), 'Ġ');
        assert_eq!(byte_char(b'\n'), 'Ċ');
        assert_eq!(byte_char(0), 'Ā');
        assert_eq!(byte_char(0xAD), 'Ń');
        let all: std::collections::HashSet<char> = (0..=255u8).map(byte_char).collect();
        assert_eq!(all.len(), 256);
    }
}
