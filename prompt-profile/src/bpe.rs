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
//!    Four patterns have a hand-written scanner ([`Scanner`]): GPT-2's, `\p{N}` (SmolLM2's and
//!    StarCoder's pre-tokenizer is these two, GPT-2's family the first alone), Llama 3's and
//!    Qwen 2's (`crate::pretokenizer`). Oniguruma was
//!    about 60 % of an encode of new text (`perf`); a scanner takes the same pieces in one pass
//!    over the characters, with each character's class (`\s`, `\p{L}`, `\p{N}`, other) read
//!    from Oniguruma itself, so the classes are the regex's. Differential tests: every string
//!    of up to 4 characters over an alphabet of each class (ASCII and beyond), random text, and
//!    the vocabulary tests.
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
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Mutex};

use onig::Regex;
use serde_json::Value;

/// Pieces at least this long are not cached (as in `tokenizers`).
/// Words of at most this many byte symbols merge without a heap ([`ByteLevelBpe::merge_short`]).
const SHORT_WORD: usize = 32;
const MAX_CACHED_PIECE: usize = 256;
/// Cached pieces before the cache is emptied.
const CACHE_CAPACITY: usize = 20_000;

/// GPT-2's `bytes_to_unicode`: the character each byte is written as in the vocabulary.
pub(crate) fn byte_char(b: u8) -> char {
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

/// The tables of the encoding's inner loops, keyed by client text (words) or looked up once per
/// merge: `ahash`'s keyed hash, randomly seeded per process (SipHash, std's default, took 7 % of
/// an encode; an unkeyed hash would let a client pick colliding words).
pub(crate) type FastMap<K, V> = HashMap<K, V, ahash::RandomState>;

/// A word's bytes → its ids.
type WordCache = FastMap<Box<[u8]>, Box<[u32]>>;

/// See the module documentation.
pub(crate) struct ByteLevelBpe {
    splits: Vec<Split>,
    /// The id of each single byte's character, if the vocabulary has it.
    byte_id: [Option<u32>; 256],
    /// Vocabulary by the bytes an entry stands for (only with `ignore_merges`).
    whole: FastMap<Box<[u8]>, u32>,
    /// `(left, right) → (rank, merged id)`.
    merges: FastMap<(u32, u32), (u32, u32)>,
    ignore_merges: bool,
    cache: Mutex<WordCache>,
}

/// GPT-2's split as `tokenizers`' byte-level step applies it.
const BYTE_LEVEL_PATTERN: &str =
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";

/// Llama 3's split as its `tokenizer.json` writes it: the contractions case-insensitive as a
/// group, which Oniguruma matches as llama.cpp's `'[sS]|…` form but for `ſ` (U+017F, which folds
/// to `s`).
const HF_LLAMA3: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Qwen 2's split as its `tokenizer.json` writes it (Llama 3's with single numbers).
const HF_QWEN2: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// One split step: its regex, and a scanner that gives the same pieces when the pattern is one
/// that has one.
struct Split {
    regex: Regex,
    scanner: Option<Scanner>,
}

impl Split {
    /// `classes`: the character classes the profile's scanners share (`None`: no scanner).
    fn new(pattern: &str, classes: Option<&Arc<Classes>>) -> Option<Split> {
        let regex = Regex::new(pattern).ok()?;
        let kind = ScanKind::of(pattern);
        Some(Split {
            regex,
            scanner: kind.zip(classes).map(|(kind, classes)| Scanner {
                kind,
                classes: classes.clone(),
            }),
        })
    }

    /// The matches of this step in `piece` (byte ranges, in order, non-empty): the scanner's
    /// where it applies, else the regex's.
    fn matches(&self, piece: &str, out: &mut Vec<(usize, usize)>) {
        match &self.scanner {
            Some(sc) => sc.matches(piece, out),
            None => out.extend(self.regex.find_iter(piece)),
        }
    }
}

/// The patterns with a hand-written scanner.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ScanKind {
    /// `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+`
    /// (`any_space`), or llama.cpp's copy without the last `|\s+`: it splits the same (the one
    /// whitespace character that alternative would match stays a piece of its own between two
    /// matches), but is not a match.
    Gpt2 { any_space: bool },
    /// `\p{N}`: every number character is a piece.
    EachNumber,
    /// Llama 3's `(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+`
    /// (`max_digits` 3), or Qwen 2's, the same with `\p{N}` (`max_digits` 1); `long_s`: their
    /// `tokenizer.json` form, `(?i:'s|…)`, whose `'s` also matches `'ſ`.
    Llama3 { max_digits: usize, long_s: bool },
}

impl ScanKind {
    /// The scanner kind of a split pattern, if it has one (the pattern strings exactly).
    fn of(pattern: &str) -> Option<ScanKind> {
        if pattern == BYTE_LEVEL_PATTERN {
            Some(ScanKind::Gpt2 { any_space: true })
        } else if pattern == crate::pretokenizer::GPT2 {
            Some(ScanKind::Gpt2 { any_space: false })
        } else if pattern == r"\p{N}" {
            Some(ScanKind::EachNumber)
        } else if pattern == crate::pretokenizer::LLAMA3 || pattern == HF_LLAMA3 {
            Some(ScanKind::Llama3 {
                max_digits: 3,
                long_s: pattern == HF_LLAMA3,
            })
        } else if pattern == crate::pretokenizer::QWEN2 || pattern == HF_QWEN2 {
            Some(ScanKind::Llama3 {
                max_digits: 1,
                long_s: pattern == HF_QWEN2,
            })
        } else {
            None
        }
    }
}

/// A character's class in the patterns' terms.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Class {
    /// `\p{L}`
    Letter = 1,
    /// `\p{N}`
    Number = 2,
    /// `\s`
    Space = 3,
    /// Anything else: `[^\s\p{L}\p{N}]`.
    Other = 4,
}

/// Oniguruma's own classes, one character at a time.
struct Classifier {
    letter: Regex,
    number: Regex,
    space: Regex,
}

impl Classifier {
    fn new() -> Option<Classifier> {
        let is = |re: &str| Regex::new(re).ok();
        Some(Classifier {
            letter: is(r"\A\p{L}\z")?,
            number: is(r"\A\p{N}\z")?,
            space: is(r"\A\s\z")?,
        })
    }

    /// The classes Oniguruma puts `c` in (in the patterns' order: letter, number, space).
    fn classes(&self, c: char) -> Vec<Class> {
        let mut buf = [0u8; 4];
        let s: &str = c.encode_utf8(&mut buf);
        [
            (&self.letter, Class::Letter),
            (&self.number, Class::Number),
            (&self.space, Class::Space),
        ]
        .iter()
        .filter(|(re, _)| re.is_match(s))
        .map(|(_, class)| *class)
        .collect()
    }
}

/// Character classes as Oniguruma gives them, shared by a profile's scanners: the 128 ASCII
/// ones read when built, the rest of the Basic Multilingual Plane read on first sight and kept
/// (one byte each), the planes above read each time (emoji and rarer scripts).
struct Classes {
    ascii: [Class; 128],
    /// Code point → `Class as u8`, 0 until first seen: one table of 65,536 per Unicode plane,
    /// made when a character of the plane is first seen (emoji are in plane 1: asking
    /// Oniguruma again for each one took a tenth of encoding text that has them).
    planes: [std::sync::OnceLock<Box<[AtomicU8]>>; 17],
    classifier: Classifier,
}

impl Classes {
    /// `None` when Oniguruma puts an ASCII character in more than one class (never expected;
    /// the regexes then do the work).
    fn new() -> Option<Classes> {
        let classifier = Classifier::new()?;
        let mut ascii = [Class::Other; 128];
        for (b, c) in ascii.iter_mut().enumerate() {
            let found = classifier.classes(char::from(u8::try_from(b).ok()?));
            if found.len() > 1 {
                return None;
            }
            *c = found.first().copied().unwrap_or(Class::Other);
        }
        Some(Classes {
            ascii,
            planes: std::array::from_fn(|_| std::sync::OnceLock::new()),
            classifier,
        })
    }

    /// The class of a character beyond ASCII: the first of Oniguruma's classes for it, in the
    /// alternatives' order (the Unicode categories are disjoint; no character is in two).
    fn class_of(&self, c: char) -> Class {
        let read = || {
            self.classifier
                .classes(c)
                .first()
                .copied()
                .unwrap_or(Class::Other)
        };
        let cp = u32::from(c) as usize;
        let Some(slot) = self.planes.get(cp >> 16).and_then(|plane| {
            plane
                .get_or_init(|| (0..=u16::MAX).map(|_| AtomicU8::new(0)).collect())
                .get(cp & 0xFFFF)
        }) else {
            return read();
        };
        match slot.load(Ordering::Relaxed) {
            1 => Class::Letter,
            2 => Class::Number,
            3 => Class::Space,
            4 => Class::Other,
            _ => {
                let class = read();
                slot.store(class as u8, Ordering::Relaxed);
                class
            }
        }
    }

    /// The class and byte length of the character at byte `i` of `t` (a char boundary).
    fn at(&self, t: &str, i: usize) -> Option<(Class, usize)> {
        let b = *t.as_bytes().get(i)?;
        if b < 0x80 {
            return Some((self.ascii[usize::from(b)], 1));
        }
        let c = t.get(i..)?.chars().next()?;
        Some((self.class_of(c), c.len_utf8()))
    }
}

/// A scanner for one [`ScanKind`], over the shared [`Classes`].
struct Scanner {
    kind: ScanKind,
    classes: Arc<Classes>,
}

impl Scanner {
    /// The class and byte length of the character at byte `i` of `t` (a char boundary).
    fn at(&self, t: &str, i: usize) -> Option<(Class, usize)> {
        self.classes.at(t, i)
    }

    /// The run of `class` starting at byte `i`: its end and the start of its last character
    /// (`i` itself when the run is empty).
    fn run(&self, t: &str, mut i: usize, class: Class) -> (usize, usize) {
        let mut last = i;
        while let Some((c, len)) = self.at(t, i) {
            if c != class {
                break;
            }
            last = i;
            i += len;
        }
        (i, last)
    }

    /// The pattern's matches in `t`, as `Regex::find_iter` gives them.
    fn matches(&self, t: &str, out: &mut Vec<(usize, usize)>) {
        let mut i = 0;
        while let Some((class, len)) = self.at(t, i) {
            match self.kind {
                ScanKind::EachNumber => {
                    if class == Class::Number {
                        out.push((i, i + len));
                    }
                    i += len;
                }
                ScanKind::Gpt2 { any_space } => {
                    let (end, by_any_space) = self.gpt2_at(t, i, class);
                    if any_space || !by_any_space {
                        out.push((i, end));
                    }
                    i = end;
                }
                ScanKind::Llama3 { max_digits, long_s } => {
                    let end = self.llama3_at(t, i, class, len, max_digits, long_s);
                    out.push((i, end));
                    i = end;
                }
            }
        }
    }

    /// The end of GPT-2's match at byte `i`, whose character is of `class` (every position of
    /// a text starts one: the last alternative, `\s+`, takes what the others leave, which is
    /// whitespace), and whether that last alternative is the one that matched.
    fn gpt2_at(&self, t: &str, i: usize, class: Class) -> (usize, bool) {
        let rest = &t.as_bytes()[i..];
        // 's|'t|'re|'ve|'m|'ll|'d
        if rest.first() == Some(&b'\'') {
            for c in [&b"s"[..], b"t", b"re", b"ve", b"m", b"ll", b"d"] {
                if rest[1..].starts_with(c) {
                    return (i + 1 + c.len(), false);
                }
            }
        }
        // ` ?\p{L}+`, ` ?\p{N}+`, ` ?[^\s\p{L}\p{N}]+`, in that order: with the space first
        // (`?` is greedy), then without.
        let after_space = if rest.first() == Some(&b' ') {
            self.at(t, i + 1).map(|(c, _)| c)
        } else {
            None
        };
        for want in [Class::Letter, Class::Number, Class::Other] {
            if after_space == Some(want) {
                return (self.run(t, i + 1, want).0, false);
            }
            if class == want {
                return (self.run(t, i, want).0, false);
            }
        }
        // Whitespace. `\s+(?!\S)`: the whole run when the text ends there, else the run but its
        // last character (which is left to precede what follows) when that leaves any; `\s+`
        // otherwise (a run of one).
        let (end, last) = self.run(t, i, Class::Space);
        if end == t.len() {
            (end, false)
        } else if last > i {
            (last, false)
        } else {
            (end, true)
        }
    }

    /// The end of Llama 3's (or Qwen 2's) match at byte `i`, whose character is of `class` and
    /// `len` bytes long (every position starts one: the last alternative, `\s+`, takes what the
    /// others leave, which is whitespace).
    fn llama3_at(
        &self,
        t: &str,
        i: usize,
        class: Class,
        len: usize,
        max_digits: usize,
        long_s: bool,
    ) -> usize {
        let b = t.as_bytes();
        // (?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])
        if b[i] == b'\'' {
            for c in [&b"s"[..], b"t", b"re", b"ve", b"m", b"ll", b"d"] {
                if b.len() > i + c.len() && b[i + 1..=i + c.len()].eq_ignore_ascii_case(c) {
                    return i + 1 + c.len();
                }
            }
            let long = "ſ".as_bytes();
            if long_s && b[i + 1..].starts_with(long) {
                return i + 1 + long.len();
            }
        }
        let next = self.at(t, i + len).map(|(c, _)| c);
        let crlf = |k: usize| matches!(b.get(k), Some(b'\r' | b'\n'));
        // [^\r\n\p{L}\p{N}]?\p{L}+
        if class != Class::Letter
            && class != Class::Number
            && !crlf(i)
            && next == Some(Class::Letter)
        {
            return self.run(t, i + len, Class::Letter).0;
        }
        if class == Class::Letter {
            return self.run(t, i, Class::Letter).0;
        }
        // \p{N}{1,max_digits}
        if class == Class::Number {
            let mut end = i;
            for _ in 0..max_digits {
                match self.at(t, end) {
                    Some((Class::Number, l)) => end += l,
                    _ => break,
                }
            }
            return end;
        }
        // ` ?[^\s\p{L}\p{N}]+[\r\n]*`
        let others_from = if b[i] == b' ' && next == Some(Class::Other) {
            Some(i + 1)
        } else if class == Class::Other {
            Some(i)
        } else {
            None
        };
        if let Some(from) = others_from {
            let mut end = self.run(t, from, Class::Other).0;
            while crlf(end) {
                end += 1;
            }
            return end;
        }
        // Whitespace. `\s*[\r\n]+`: through the run's last `\r` or `\n`, if it has one;
        // then `\s+(?!\S)` and `\s+` as in GPT-2's pattern.
        let (end, last) = self.run(t, i, Class::Space);
        if let Some(k) = b[i..end].iter().rposition(|&c| c == b'\r' || c == b'\n') {
            return i + k + 1;
        }
        if end == t.len() || last == i {
            end
        } else {
            last
        }
    }
}

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
        let mut whole = FastMap::default();
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
        let mut merges = FastMap::with_capacity_and_hasher(list.len(), Default::default());
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
            cache: Mutex::new(FastMap::default()),
        })
    }

    /// The split patterns of a `Split(regex, Isolated)*` + `ByteLevel` pre-tokenizer.
    fn splits(pre: &Value) -> Option<Vec<Split>> {
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
        // The classes only where some step has a scanner (a 64 KiB table and 384 regex matches).
        let classes = patterns
            .iter()
            .any(|p| ScanKind::of(p).is_some())
            .then(Classes::new)
            .flatten()
            .map(Arc::new);
        patterns
            .iter()
            .map(|p| Split::new(p, classes.as_ref()))
            .collect()
    }

    /// Append the ids of `text` (a piece with no added token in it) to `out`.
    pub(crate) fn encode(&self, text: &str, out: &mut Vec<u32>) {
        let mut pieces = vec![(0usize, text.len())];
        let mut next = Vec::new();
        let mut found = Vec::new();
        for split in &self.splits {
            next.clear();
            for &(s, e) in &pieces {
                let mut prev = s;
                found.clear();
                split.matches(&text[s..e], &mut found);
                for &(ms, me) in &found {
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

    /// The byte strings of the vocabulary's multi-byte entries (tests).
    #[cfg(test)]
    fn whole_words_for_tests(&self) -> Vec<Vec<u8>> {
        let mut by_id: Vec<Vec<u8>> = Vec::new();
        // Rebuild every merged token's bytes from the merges: (a, b) → merged.
        let mut bytes: std::collections::HashMap<u32, Vec<u8>> = (0..=255u8)
            .filter_map(|b| self.byte_id[b as usize].map(|id| (id, vec![b])))
            .collect();
        // (rank, left, right, merged)
        let mut merges: Vec<[u32; 4]> = self
            .merges
            .iter()
            .map(|(&(a, b), &(rank, m))| [rank, a, b, m])
            .collect();
        merges.sort_unstable();
        for [_, a, b, m] in merges {
            if let (Some(x), Some(y)) = (bytes.get(&a), bytes.get(&b)) {
                let w: Vec<u8> = x.iter().chain(y).copied().collect();
                by_id.push(w.clone());
                bytes.insert(m, w);
            }
        }
        by_id
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
        if id.len() <= SHORT_WORD {
            self.merge_short(&mut id);
            id
        } else {
            self.merge_heap(id)
        }
    }

    /// [`Self::merge`] for a word of at most [`SHORT_WORD`] symbols, without a heap: each
    /// adjacent pair's (rank, merged id) in an array, the pair of lowest rank (the leftmost of
    /// equal ones) merged and its two neighbours' entries looked up again, until no pair has a
    /// merge. The same merges in the same order as [`Self::merge_heap`], which takes the lowest
    /// (rank, position) too; an array scan is cheaper than a heap at these sizes and allocates
    /// nothing.
    fn merge_short(&self, id: &mut Vec<u32>) {
        const NONE: (u32, u32) = (u32::MAX, 0);
        let mut len = id.len();
        if len < 2 {
            return;
        }
        let look = |a: u32, b: u32| self.merges.get(&(a, b)).copied().unwrap_or(NONE);
        let mut pair = [NONE; SHORT_WORD];
        for i in 0..len - 1 {
            pair[i] = look(id[i], id[i + 1]);
        }
        loop {
            let mut best: Option<usize> = None;
            let mut best_rank = u32::MAX;
            for (i, &(rank, _)) in pair[..len - 1].iter().enumerate() {
                if rank < best_rank {
                    best_rank = rank;
                    best = Some(i);
                }
            }
            let Some(i) = best else {
                break;
            };
            id[i] = pair[i].1;
            id.remove(i + 1);
            // Pairs right of the merged one move one place left.
            if i + 2 < len - 1 {
                pair.copy_within(i + 2..len - 1, i + 1);
            }
            len -= 1;
            if i > 0 {
                pair[i - 1] = look(id[i - 1], id[i]);
            }
            if i + 1 < len {
                pair[i] = look(id[i], id[i + 1]);
            }
        }
    }

    /// [`Self::merge`] with a heap of candidate merges, for longer words.
    fn merge_heap(&self, mut id: Vec<u32>) -> Vec<u32> {
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
    use rand::{Rng, SeedableRng};

    /// Characters of every class, the contraction letters, whitespace of each kind, ASCII and
    /// beyond (multi-byte letters, numbers, spaces and others).
    const ALPHABET: &[char] = &[
        ' ', '\t', '\n', '\r', '\u{b}', '\u{1c}', 'a', 'Z', 's', 'S', '\'', 't', 'r', 'E', 'l',
        '1', '!', '\0', '-', 'é', '٣', '\u{a0}', '\u{3000}', '😀', '\u{301}', 'v', 'M', 'd', 'ſ',
    ];

    /// The heap-free merge of short words gives what the heap merge gives, on the default
    /// model's vocabulary: every word of up to 32 random bytes drawn from letters, digits,
    /// spaces and bytes beyond ASCII, and words cut from the vocabulary's own entries.
    #[test]
    fn short_words_merge_as_the_heap_merges_them() {
        let model = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../models/SmolLM2-135M-Instruct.Q4_1.gguf");
        let model = std::env::var_os("KVGATE_MODEL_DIR")
            .map(|d| std::path::PathBuf::from(d).join("SmolLM2-135M-Instruct.Q4_1.gguf"))
            .unwrap_or(model);
        let p = crate::PromptProfile::from_gguf(&model)
            .expect("the default model (scripts/fetch-model.sh)");
        let json: Value = serde_json::from_str(&p.tokenizer_json().unwrap()).unwrap();
        let bpe = ByteLevelBpe::from_serialized(&json).expect("a byte-level BPE");
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
        let alphabet: Vec<u8> = b"etaoinshrdlu ETAO0123456789'-.\n"
            .iter()
            .copied()
            .chain([0xc3, 0xa9, 0xe2, 0x80, 0x99, 0xf0, 0x9f, 0x98, 0x80])
            .collect();
        let mut words: Vec<Vec<u8>> = (0..20_000)
            .map(|_| {
                let n = rng.gen_range(0..=SHORT_WORD);
                (0..n)
                    .map(|_| alphabet[rng.gen_range(0..alphabet.len())])
                    .collect()
            })
            .collect();
        // Words that merge all the way: the vocabulary's entries, and pairs of them.
        let vocab: Vec<Vec<u8>> = bpe.whole_words_for_tests();
        for _ in 0..20_000 {
            let a = &vocab[rng.gen_range(0..vocab.len())];
            let b = &vocab[rng.gen_range(0..vocab.len())];
            let w: Vec<u8> = a.iter().chain(b).copied().take(SHORT_WORD).collect();
            words.push(w);
        }
        for w in &words {
            let mut id: Vec<u32> = w.iter().filter_map(|&b| bpe.byte_id[b as usize]).collect();
            let heap = bpe.merge_heap(id.clone());
            bpe.merge_short(&mut id);
            assert_eq!(id, heap, "{:?}", String::from_utf8_lossy(w));
        }
    }

    fn by_regex(split: &Split, text: &str) -> Vec<(usize, usize)> {
        split.regex.find_iter(text).collect()
    }

    fn by_scanner(split: &Split, text: &str) -> Vec<(usize, usize)> {
        let mut out = Vec::new();
        split
            .scanner
            .as_ref()
            .expect("a scanner for this pattern")
            .matches(text, &mut out);
        out
    }

    fn patterns() -> Vec<Split> {
        let classes = Arc::new(Classes::new().unwrap());
        [
            BYTE_LEVEL_PATTERN,
            crate::pretokenizer::GPT2,
            r"\p{N}",
            crate::pretokenizer::LLAMA3,
            crate::pretokenizer::QWEN2,
            HF_LLAMA3,
            HF_QWEN2,
        ]
        .iter()
        .map(|p| Split::new(p, Some(&classes)).unwrap())
        .collect()
    }

    #[test]
    fn classes_are_onigurumas() {
        let classes = Classes::new().unwrap();
        let class = |c: char| classes.at(&c.to_string(), 0).unwrap().0;
        assert_eq!(class('a'), Class::Letter);
        assert_eq!(class('7'), Class::Number);
        for c in [' ', '\t', '\n', '\r', '\u{b}', '\u{c}'] {
            assert_eq!(class(c), Class::Space, "{c:?}");
        }
        for c in ['\'', '!', '\0', '\u{7f}'] {
            assert_eq!(class(c), Class::Other, "{c:?}");
        }
        // Beyond ASCII, read from Oniguruma (twice: the second from the table).
        for _ in 0..2 {
            assert_eq!(class('é'), Class::Letter);
            assert_eq!(class('中'), Class::Letter);
            assert_eq!(class('٣'), Class::Number);
            assert_eq!(class('²'), Class::Number);
            assert_eq!(class('\u{a0}'), Class::Space);
            assert_eq!(class('\u{3000}'), Class::Space);
            assert_eq!(class('\u{301}'), Class::Other);
            assert_eq!(class('😀'), Class::Other);
            assert_eq!(class('𝐀'), Class::Letter);
        }
    }

    /// Every string of up to 4 characters over [`ALPHABET`], then 300,000 random ones of 5 to
    /// 9: the scanners split exactly as the regexes. Each alternative looks at most one character past a run, so
    /// short strings meet every pair of alternatives; the longer ones mix runs.
    #[test]
    fn scanners_split_every_short_string_as_the_regex() {
        let splits = patterns();
        let k = ALPHABET.len();
        let check = |text: &str| {
            for split in &splits {
                assert_eq!(by_scanner(split, text), by_regex(split, text), "{text:?}");
            }
        };
        for len in 1..=4u32 {
            for mut code in 0..k.pow(len) {
                let mut text = String::new();
                for _ in 0..len {
                    text.push(ALPHABET[code % k]);
                    code /= k;
                }
                check(&text);
            }
        }
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(5);
        for _ in 0..300_000 {
            let n = rng.gen_range(5..10);
            let text: String = (0..n).map(|_| ALPHABET[rng.gen_range(0..k)]).collect();
            check(&text);
        }
    }

    /// Random text of longer parts, ASCII and not: the pieces are the regex's.
    #[test]
    fn scanners_split_random_text_as_the_regex() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
        let words = [
            " ",
            "  ",
            "   ",
            "\n",
            "\n\n",
            "\t",
            " \n ",
            "'s",
            "'ll",
            "'re",
            "'x",
            "'",
            "a",
            "Word",
            " the",
            "123",
            " 45",
            "!!",
            " ?",
            "...",
            "\r\n",
            "\x00",
            "café",
            " naïve",
            "😀",
            "\u{a0}",
            "x'S",
            "don't",
            "'ſ",
            "'ﬅ",
            "'\u{212a}",
            "'ǉ",
            "'LL",
            "'rE",
            "'Ve",
            "I'M",
            "'D",
        ];
        let splits = patterns();
        for _ in 0..5_000 {
            let n = rng.gen_range(1..40);
            let text: String = (0..n)
                .map(|_| words[rng.gen_range(0..words.len())])
                .collect();
            for split in &splits {
                let mut got = Vec::new();
                split.matches(&text, &mut got);
                assert_eq!(got, by_regex(split, &text), "{text:?}");
            }
        }
    }

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
