//! Constrained decoding: JSON mode (`response_format: {"type": "json_object"}`).
//!
//! At each step the tokens whose bytes cannot continue a JSON object get a logit of −∞ before
//! the sampler sees the logits (so temperature, top-k, top-p and min-p act on the allowed
//! tokens only: the output is drawn from the model's distribution restricted to valid JSON).
//! The stop ids (eos) are allowed only once the object is complete, and then nothing else
//! (whitespace only while the stop ids are held back: `ignore_eos`, `min_tokens`).
//!
//! The automaton reads bytes: a top-level object (RFC 8259 grammar: strings with escapes and
//! well-formed UTF-8, numbers without leading zeros and with at most 64 characters and a two-digit
//! exponent — so every number fits an f64 —, `true` / `false` / `null`), nested at most
//! [`MAX_DEPTH`] deep. Whitespace between tokens of the JSON text runs at most [`MAX_WS_RUN`]
//! bytes at a time (inside the object; after it, any), so a model cannot pad forever without
//! writing the object; inside strings any content is allowed. A sequence cut by `max_tokens`
//! ends with a valid prefix of a JSON object.
//!
//! Cost per step: the tokens whose first byte may come next are checked byte by byte (in a
//! string that is most of the vocabulary: ~1 ms for 49k tokens); the rest are masked by their
//! first byte.

use std::sync::Arc;

/// Deepest nesting of objects and arrays.
pub const MAX_DEPTH: usize = 32;
/// Longest run of whitespace between JSON tokens inside the object.
pub const MAX_WS_RUN: u8 = 48;

/// The bytes each token id stands for (`None`: a special token, never allowed in JSON), indexed
/// by first byte for the mask.
#[derive(Debug)]
pub struct TokenTable {
    bytes: Vec<Option<Box<[u8]>>>,
    by_first: Vec<Vec<u32>>,
    /// Tokens that may follow any plain string content and leave it plain: whole UTF-8
    /// characters, none of them `"`, `\\` or a control character.
    string_safe: Vec<bool>,
    /// The most characters a string-safe token has.
    max_safe_chars: usize,
}

impl TokenTable {
    /// From each token id's bytes (`prompt_profile::PromptProfile::token_bytes`).
    pub fn new(bytes: Vec<Option<Vec<u8>>>) -> TokenTable {
        let mut by_first = vec![Vec::new(); 256];
        let bytes: Vec<Option<Box<[u8]>>> = bytes
            .into_iter()
            .map(|b| b.filter(|b| !b.is_empty()).map(Vec::into_boxed_slice))
            .collect();
        for (id, b) in bytes.iter().enumerate() {
            if let Some(b) = b {
                by_first[b[0] as usize].push(id as u32);
            }
        }
        let string_safe = bytes
            .iter()
            .map(|b| {
                b.as_deref().is_some_and(|b| {
                    std::str::from_utf8(b).is_ok()
                        && b.iter().all(|&c| c >= 0x20 && c != b'"' && c != b'\\')
                })
            })
            .collect();
        let max_safe_chars = bytes
            .iter()
            .zip(&string_safe)
            .filter(|(_, &safe)| safe)
            .filter_map(|(b, _)| std::str::from_utf8(b.as_deref()?).ok())
            .map(|s| s.chars().count())
            .max()
            .unwrap_or(0);
        TokenTable {
            bytes,
            by_first,
            string_safe,
            max_safe_chars,
        }
    }

    /// Tokens in the table.
    pub fn len(&self) -> usize {
        self.bytes.len()
    }

    /// Whether the table is empty.
    pub fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }

    /// The bytes of `token` (`None`: special, or out of range).
    pub fn bytes(&self, token: u32) -> Option<&[u8]> {
        self.bytes.get(token as usize)?.as_deref()
    }
}

/// A constraint on what a sequence may generate (given to the engine with its request).
#[derive(Clone, Debug)]
pub enum Constraint {
    /// A JSON object, over this vocabulary.
    JsonObject(Arc<TokenTable>),
    /// A JSON object of this schema (`crate::json_schema`), over this vocabulary.
    JsonSchema(Arc<TokenTable>, Arc<crate::json_schema::CompiledSchema>),
}

impl Constraint {
    /// The per-sequence state that enforces it.
    pub fn start(&self) -> ConstraintState {
        match self {
            Constraint::JsonObject(t) => ConstraintState {
                table: t.clone(),
                machine: Machine::Object(Json::default()),
            },
            Constraint::JsonSchema(t, s) => ConstraintState {
                table: t.clone(),
                machine: Machine::Schema(s.clone(), crate::json_schema::SchemaJson::new(s)),
            },
        }
    }
}

/// The automaton a constraint runs (one per sequence, made once: the schema variant's size,
/// its open containers kept inline, costs nothing on the mask's path).
#[allow(clippy::large_enum_variant)]
enum Machine {
    Object(Json),
    Schema(
        Arc<crate::json_schema::CompiledSchema>,
        crate::json_schema::SchemaJson,
    ),
}

impl Machine {
    fn accepts(&self, bytes: &[u8]) -> bool {
        match self {
            Machine::Object(j) => j.accepts(bytes),
            Machine::Schema(s, j) => j.accepts(s, bytes),
        }
    }

    fn step(&mut self, c: u8) -> bool {
        match self {
            Machine::Object(j) => j.step(c),
            Machine::Schema(s, j) => {
                // A refused byte leaves the schema automaton unspecified: step a copy.
                let mut next = j.clone();
                let ok = next.step(s, c);
                if ok {
                    *j = next;
                }
                ok
            }
        }
    }

    fn is_complete(&self) -> bool {
        match self {
            Machine::Object(j) => j.is_complete(),
            Machine::Schema(_, j) => j.is_complete(),
        }
    }

    /// Inside a string held to a pattern, between characters: the pattern, its state and the
    /// characters left before the string's `max`.
    fn plain_pattern(&self) -> Option<(&crate::text_pattern::TextPattern, u16, u32)> {
        match self {
            Machine::Object(_) => None,
            Machine::Schema(s, j) => j.plain_pattern(s),
        }
    }

    /// Inside a string between characters: how many more characters it may take.
    fn plain_string_room(&self) -> Option<u32> {
        match self {
            Machine::Object(j) => j.in_plain_string().then_some(u32::MAX),
            Machine::Schema(_, j) => j.plain_string_room(),
        }
    }
}

/// Masks every logit but the `allowed` (id, logit) pairs, which keep their values; returns
/// whether any of them can be sampled.
fn keep_only(logits: &mut [f32], allowed: Vec<(u32, f32)>) -> bool {
    logits.fill(f32::NEG_INFINITY);
    let mut any = false;
    for (id, l) in allowed {
        logits[id as usize] = l;
        any |= !l.is_nan() && l > f32::NEG_INFINITY;
    }
    any
}

/// A constraint's state in one sequence.
pub struct ConstraintState {
    table: Arc<TokenTable>,
    machine: Machine,
}

impl ConstraintState {
    /// Sets the logit of every token that may not come next to −∞. Once the object is complete
    /// only the stop ids are allowed (a model that would rather pad with whitespace ends there),
    /// or whitespace while there are none (`ignore_eos`, `min_tokens`). Returns whether any
    /// token is still allowed.
    pub fn mask(&self, logits: &mut [f32], stop_ids: &[u32]) -> bool {
        let table = &self.table;
        // In a string held to a pattern (which bounds its length too, with the room left where
        // a long `maxLength` kept it from being crossed with the count): a string-safe token is
        // allowed when the pattern's automaton takes its bytes, with no copy of the JSON
        // automaton; the others (quotes, escapes, partial characters) are simulated.
        if let Some((pattern, state, room)) = self.machine.plain_pattern() {
            let mut allowed: Vec<(u32, f32)> = Vec::new();
            for first in 0..=255u8 {
                if !self.machine.accepts(&[first]) {
                    continue;
                }
                for &id in &table.by_first[first as usize] {
                    let (Some(b), Some(&l)) = (table.bytes(id), logits.get(id as usize)) else {
                        continue;
                    };
                    let ok = if table.string_safe.get(id as usize).copied().unwrap_or(false) {
                        pattern.allows_within(state, b, room)
                    } else {
                        b.len() == 1 || self.machine.accepts(b)
                    };
                    if ok {
                        allowed.push((id, l));
                    }
                }
            }
            return keep_only(logits, allowed);
        }
        // (A string that may take fewer characters than the longest string-safe token has goes
        // the general way: every token is simulated.)
        if self
            .machine
            .plain_string_room()
            .is_some_and(|room| room as usize >= table.max_safe_chars)
        {
            // Most of the vocabulary is allowed: masked in place, and whole characters of
            // string content need no simulation.
            let mut any = false;
            for (id, l) in logits.iter_mut().enumerate() {
                let ok = table.string_safe.get(id).copied().unwrap_or(false)
                    || table
                        .bytes(id as u32)
                        .is_some_and(|b| self.machine.accepts(b));
                if ok {
                    any |= !l.is_nan() && *l > f32::NEG_INFINITY;
                } else {
                    *l = f32::NEG_INFINITY;
                }
            }
            return any;
        }
        // Few tokens are allowed: collected, then everything else masked.
        let mut allowed: Vec<(u32, f32)> = Vec::new();
        let done = self.machine.is_complete();
        if !done || stop_ids.is_empty() {
            // Between JSON tokens few bytes may come: filter by the first two bytes, then
            // simulate what is left.
            for first in 0..=255u8 {
                if !self.machine.accepts(&[first]) {
                    continue;
                }
                let mut second = [false; 256];
                for (s, ok) in second.iter_mut().enumerate() {
                    *ok = self.machine.accepts(&[first, s as u8]);
                }
                for &id in &table.by_first[first as usize] {
                    let Some(l) = logits.get(id as usize) else {
                        continue;
                    };
                    let ok = match table.bytes(id) {
                        Some(b) if b.len() == 1 => true,
                        Some(b) if !second[b[1] as usize] => false,
                        Some(b) if b.len() == 2 => true,
                        Some(b) => self.machine.accepts(b),
                        None => false,
                    };
                    if ok {
                        allowed.push((id, *l));
                    }
                }
            }
        }
        if done {
            for &id in stop_ids {
                if let Some(l) = logits.get(id as usize) {
                    allowed.push((id, *l));
                }
            }
        }
        keep_only(logits, allowed)
    }

    /// Advances past the chosen token (a stop id or special token changes nothing).
    pub fn advance(&mut self, token: u32) {
        if let Some(b) = self.table.bytes(token) {
            for &c in b {
                if !self.machine.step(c) {
                    // The mask never lets such a token through; stay put rather than panic.
                    return;
                }
            }
        }
    }
}

/// Whether `text` is what JSON mode lets a sequence write: `Some(true)` a complete JSON object
/// (whitespace may follow), `Some(false)` a proper prefix of one, `None` neither.
pub fn json_object_prefix(text: &[u8]) -> Option<bool> {
    let mut j = Json::default();
    for &c in text {
        if !j.step(c) {
            return None;
        }
    }
    Some(j.is_complete())
}

/// An open container.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Frame {
    Object,
    Array,
}

/// Where in a number.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Num {
    /// After `-`: a digit must follow.
    Minus,
    /// After a leading `0`.
    Zero,
    /// In the integer digits.
    Int,
    /// After `.`: a digit must follow.
    Dot,
    /// In the fraction digits.
    Frac,
    /// After `e` / `E`.
    Exp,
    /// After the exponent's sign: a digit must follow.
    ExpSign,
    /// After the exponent's first digit.
    ExpDigit,
    /// After its second: the exponent has at most two digits, so every number fits an f64
    /// (parsers such as serde_json refuse `1e400`).
    ExpDigits,
}

impl Num {
    /// Whether the number may end here.
    pub(crate) fn complete(self) -> bool {
        matches!(
            self,
            Num::Zero | Num::Int | Num::Frac | Num::ExpDigit | Num::ExpDigits
        )
    }

    pub(crate) fn step(self, c: u8) -> Option<Num> {
        Some(match (self, c) {
            (Num::Minus, b'0') => Num::Zero,
            (Num::Minus, b'1'..=b'9') => Num::Int,
            (Num::Int, b'0'..=b'9') => Num::Int,
            (Num::Zero | Num::Int, b'.') => Num::Dot,
            (Num::Dot | Num::Frac, b'0'..=b'9') => Num::Frac,
            (Num::Zero | Num::Int | Num::Frac, b'e' | b'E') => Num::Exp,
            (Num::Exp, b'+' | b'-') => Num::ExpSign,
            (Num::Exp | Num::ExpSign, b'0'..=b'9') => Num::ExpDigit,
            (Num::ExpDigit, b'0'..=b'9') => Num::ExpDigits,
            _ => return None,
        })
    }
}

/// Where in a string.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Str {
    /// Plain content.
    Plain,
    /// After `\`.
    Escape,
    /// At the first hex digit of `\uXXXX` (`low`: the second escape of a surrogate pair,
    /// which must be a low surrogate, `DC00`–`DFFF`).
    HexFirst { low: bool },
    /// At the second hex digit of a `\uD…` escape: it says whether it is a surrogate.
    HexSecond { low: bool },
    /// In `\uXXXX`: this many hex digits still to come; `pair`: the escape is a high
    /// surrogate, so a low one (`\uDC00`–`\uDFFF`) must follow.
    Hex { left: u8, pair: bool },
    /// After a high surrogate's escape: `\` of the low one.
    PairSlash,
    /// After that `\`: `u`.
    PairU,
    /// In a UTF-8 sequence: continuation bytes still to come, and the range the next one
    /// must fall in.
    Utf8 { left: u8, lo: u8, hi: u8 },
}

/// The automaton's mode.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    /// Before the top-level `{`.
    Start,
    /// After `{`: a key or `}`.
    KeyOrEnd,
    /// After `,` in an object: a key.
    Key,
    /// After a key: `:`.
    Colon,
    /// A value.
    Value,
    /// After `[`: a value or `]`.
    ValueOrEnd,
    /// After a value: `,` or the closing bracket of the innermost container.
    After,
    /// In a string (a key when `key`).
    InStr { key: bool, at: Str },
    /// In a number (`len` bytes so far).
    InNum { at: Num, len: u8 },
    /// In `true`, `false` or `null`: the word and how much of it was read.
    InWord { word: &'static [u8], read: u8 },
    /// The top-level object is complete.
    Done,
}

/// Longest number, in bytes.
pub(crate) const MAX_NUMBER_LEN: u8 = 64;

/// A JSON-object recognizer fed one byte at a time.
#[derive(Clone, Debug)]
pub(crate) struct Json {
    stack: Vec<Frame>,
    mode: Mode,
    ws_run: u8,
}

impl Default for Json {
    fn default() -> Self {
        Json {
            stack: Vec::new(),
            mode: Mode::Start,
            ws_run: 0,
        }
    }
}

/// The container stack as one step sees it: the sequence's own frames (read-only, of which the
/// top `popped` are closed) plus frames opened during this check.
struct Frames<'a> {
    base: &'a [Frame],
    popped: usize,
    pushed: [Frame; 16],
    pushed_len: usize,
}

impl Frames<'_> {
    fn depth(&self) -> usize {
        self.base.len() - self.popped + self.pushed_len
    }

    fn top(&self) -> Option<Frame> {
        if self.pushed_len > 0 {
            Some(self.pushed[self.pushed_len - 1])
        } else {
            self.base
                .len()
                .checked_sub(self.popped + 1)
                .map(|i| self.base[i])
        }
    }

    fn push(&mut self, f: Frame) -> bool {
        if self.depth() >= MAX_DEPTH || self.pushed_len == self.pushed.len() {
            return false;
        }
        self.pushed[self.pushed_len] = f;
        self.pushed_len += 1;
        true
    }

    fn pop(&mut self) {
        if self.pushed_len > 0 {
            self.pushed_len -= 1;
        } else {
            self.popped += 1;
        }
    }
}

pub(crate) fn is_ws(c: u8) -> bool {
    matches!(c, b' ' | b'\t' | b'\n' | b'\r')
}

impl Json {
    /// Whether the top-level object is complete (only whitespace may follow).
    pub(crate) fn is_complete(&self) -> bool {
        self.mode == Mode::Done
    }

    /// Whether the text is inside a string, between characters (no escape or UTF-8 sequence
    /// open): any whole characters but `"`, `\\` and controls may follow.
    fn in_plain_string(&self) -> bool {
        matches!(self.mode, Mode::InStr { at: Str::Plain, .. })
    }

    /// The container stack as a step sees it, nothing closed or opened yet.
    fn frames(&self) -> Frames<'_> {
        Frames {
            base: &self.stack,
            popped: 0,
            pushed: [Frame::Object; 16],
            pushed_len: 0,
        }
    }

    /// Whether `bytes` may come next (the state does not change).
    pub(crate) fn accepts(&self, bytes: &[u8]) -> bool {
        let mut frames = self.frames();
        let mut mode = self.mode;
        let mut ws = self.ws_run;
        bytes
            .iter()
            .all(|&c| transition(&mut mode, &mut ws, &mut frames, c))
    }

    /// Reads one byte; `false` (and no change) when it may not come next.
    pub(crate) fn step(&mut self, c: u8) -> bool {
        let mut frames = self.frames();
        let mut mode = self.mode;
        let mut ws = self.ws_run;
        if !transition(&mut mode, &mut ws, &mut frames, c) {
            return false;
        }
        let (popped, pushed) = (frames.popped, frames.pushed[..frames.pushed_len].to_vec());
        self.stack.truncate(self.stack.len() - popped);
        self.stack.extend(pushed);
        self.mode = mode;
        self.ws_run = ws;
        true
    }
}

/// One byte of the automaton: updates `mode`, the whitespace run and the frames; `false` when
/// `c` may not come next.
fn transition(mode: &mut Mode, ws: &mut u8, frames: &mut Frames<'_>, c: u8) -> bool {
    // Whitespace between JSON tokens: bounded inside the object, free after it.
    let between = matches!(
        *mode,
        Mode::Start
            | Mode::KeyOrEnd
            | Mode::Key
            | Mode::Colon
            | Mode::Value
            | Mode::ValueOrEnd
            | Mode::After
            | Mode::Done
    );
    if between && is_ws(c) {
        if *mode == Mode::Done {
            return true;
        }
        if *ws >= MAX_WS_RUN {
            return false;
        }
        *ws += 1;
        return true;
    }
    if let Mode::InNum { at, len } = *mode {
        if let Some(next) = at.step(c) {
            if len >= MAX_NUMBER_LEN {
                return false;
            }
            *mode = Mode::InNum {
                at: next,
                len: len + 1,
            };
            return true;
        }
        if !at.complete() {
            return false;
        }
        // The number ended; `c` is read after it.
        *mode = Mode::After;
        return transition(mode, ws, frames, c);
    }
    *ws = 0;
    match *mode {
        Mode::Start => {
            if c == b'{' && frames.push(Frame::Object) {
                *mode = Mode::KeyOrEnd;
                true
            } else {
                false
            }
        }
        Mode::KeyOrEnd | Mode::Key => match c {
            b'"' => {
                *mode = Mode::InStr {
                    key: true,
                    at: Str::Plain,
                };
                true
            }
            b'}' if *mode == Mode::KeyOrEnd => close(mode, frames),
            _ => false,
        },
        Mode::Colon => {
            if c == b':' {
                *mode = Mode::Value;
                true
            } else {
                false
            }
        }
        Mode::Value | Mode::ValueOrEnd => {
            if c == b']' && *mode == Mode::ValueOrEnd {
                return close(mode, frames);
            }
            value_start(mode, frames, c)
        }
        Mode::After => match (c, frames.top()) {
            (b',', Some(Frame::Object)) => {
                *mode = Mode::Key;
                true
            }
            (b',', Some(Frame::Array)) => {
                *mode = Mode::Value;
                true
            }
            (b'}', Some(Frame::Object)) | (b']', Some(Frame::Array)) => close(mode, frames),
            _ => false,
        },
        Mode::InStr { key, at } => match string_step(at, c) {
            Some(None) => {
                *mode = if key { Mode::Colon } else { Mode::After };
                true
            }
            Some(Some(next)) => {
                *mode = Mode::InStr { key, at: next };
                true
            }
            None => false,
        },
        Mode::InWord { word, read } => {
            if word.get(read as usize) != Some(&c) {
                return false;
            }
            let read = read + 1;
            *mode = if read as usize == word.len() {
                Mode::After
            } else {
                Mode::InWord { word, read }
            };
            true
        }
        Mode::InNum { .. } | Mode::Done => false,
    }
}

/// Closes the innermost container; the top-level object's close completes the text.
fn close(mode: &mut Mode, frames: &mut Frames<'_>) -> bool {
    frames.pop();
    *mode = if frames.depth() == 0 {
        Mode::Done
    } else {
        Mode::After
    };
    true
}

/// The first byte of a value.
fn value_start(mode: &mut Mode, frames: &mut Frames<'_>, c: u8) -> bool {
    *mode = match c {
        b'{' => {
            if !frames.push(Frame::Object) {
                return false;
            }
            Mode::KeyOrEnd
        }
        b'[' => {
            if !frames.push(Frame::Array) {
                return false;
            }
            Mode::ValueOrEnd
        }
        b'"' => Mode::InStr {
            key: false,
            at: Str::Plain,
        },
        b'-' => Mode::InNum {
            at: Num::Minus,
            len: 1,
        },
        b'0' => Mode::InNum {
            at: Num::Zero,
            len: 1,
        },
        b'1'..=b'9' => Mode::InNum {
            at: Num::Int,
            len: 1,
        },
        b't' => Mode::InWord {
            word: b"true",
            read: 1,
        },
        b'f' => Mode::InWord {
            word: b"false",
            read: 1,
        },
        b'n' => Mode::InWord {
            word: b"null",
            read: 1,
        },
        _ => return false,
    };
    true
}

/// Inside a UTF-8 sequence: `left` continuation bytes to come, the next one in `lo..=hi`.
const fn utf8(left: u8, lo: u8, hi: u8) -> Str {
    Str::Utf8 { left, lo, hi }
}

/// One byte inside a string: `Some(None)` = the closing quote, `Some(Some(s))` = still inside,
/// `None` = not allowed.
pub(crate) fn string_step(at: Str, c: u8) -> Option<Option<Str>> {
    Some(Some(match at {
        Str::Plain => match c {
            b'"' => return Some(None),
            b'\\' => Str::Escape,
            0x00..=0x1f => return None,
            0x20..=0x7f => Str::Plain,
            // UTF-8 lead bytes, with the range of the byte after them (no overlongs, no
            // surrogates, nothing above U+10FFFF).
            0xc2..=0xdf => utf8(1, 0x80, 0xbf),
            0xe0 => utf8(2, 0xa0, 0xbf),
            0xed => utf8(2, 0x80, 0x9f),
            0xe1..=0xef => utf8(2, 0x80, 0xbf),
            0xf0 => utf8(3, 0x90, 0xbf),
            0xf1..=0xf3 => utf8(3, 0x80, 0xbf),
            0xf4 => utf8(3, 0x80, 0x8f),
            _ => return None,
        },
        Str::Escape => match c {
            b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't' => Str::Plain,
            b'u' => Str::HexFirst { low: false },
            _ => return None,
        },
        // Surrogates come in pairs (a high one, `D800`–`DBFF`, then a low one, `DC00`–`DFFF`),
        // so that every string is text (RFC 8259 §8.2; serde_json refuses lone ones).
        Str::HexFirst { low } => match c {
            b'd' | b'D' => Str::HexSecond { low },
            _ if low || !c.is_ascii_hexdigit() => return None,
            _ => Str::Hex {
                left: 3,
                pair: false,
            },
        },
        Str::HexSecond { low } => match (low, c) {
            (false, b'8'..=b'9' | b'a'..=b'b' | b'A'..=b'B') => Str::Hex {
                left: 2,
                pair: true,
            },
            (false, b'0'..=b'7') | (true, b'c'..=b'f' | b'C'..=b'F') => Str::Hex {
                left: 2,
                pair: false,
            },
            _ => return None,
        },
        Str::Hex { left, pair } => {
            if !c.is_ascii_hexdigit() {
                return None;
            }
            match (left, pair) {
                (1, false) => Str::Plain,
                (1, true) => Str::PairSlash,
                _ => Str::Hex {
                    left: left - 1,
                    pair,
                },
            }
        }
        Str::PairSlash => match c {
            b'\\' => Str::PairU,
            _ => return None,
        },
        Str::PairU => match c {
            b'u' => Str::HexFirst { low: true },
            _ => return None,
        },
        Str::Utf8 { left, lo, hi } => {
            if !(lo..=hi).contains(&c) {
                return None;
            }
            if left == 1 {
                Str::Plain
            } else {
                utf8(left - 1, 0x80, 0xbf)
            }
        }
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    fn feed(text: &[u8]) -> Option<Json> {
        let mut j = Json::default();
        for &c in text {
            if !j.step(c) {
                return None;
            }
        }
        Some(j)
    }

    fn complete(text: &str) -> bool {
        feed(text.as_bytes()).is_some_and(|j| j.is_complete())
    }

    #[test]
    fn accepts_json_objects_and_nothing_else() {
        for ok in [
            "{}",
            " {\"a\": 1}\n",
            "{\"a\":[1,-2.5e+3,0,0.25,1E9,true,false,null,{}],\"b\":{\"c\":\"\\u00e9\\n\\\"\"}}",
            "{\"naïve 😀\": \"café\"}",
            "{\n  \"list\": [\n    {\"x\": -0.0}\n  ]\n}",
        ] {
            assert!(complete(ok), "{ok}");
        }
        for bad in [
            "[]",
            "1",
            "\"s\"",
            "{\"a\":01}",
            "{\"a\":1,}",
            "{\"a\" 1}",
            "{a:1}",
            "{\"a\":tru}",
            "{\"a\":\"\u{1}\"}",
            "{\"a\":\"\\x\"}",
            "{\"a\":\"\\u12G4\"}",
            "{\"a\":1}}",
            "{\"a\":1} x",
            "{\"a\":-}",
            "{\"a\":1.}",
            "{\"a\":1e}",
            "{\"a\":[1 2]}",
            "{\"a\":1e400}",
        ] {
            assert!(!complete(bad), "{bad}");
        }
        // Invalid UTF-8 inside strings: overlong, surrogate, lone continuation, too high.
        for bad in [
            &b"{\"a\":\"\xc0\x80\"}"[..],
            b"{\"a\":\"\xed\xa0\x80\"}",
            b"{\"a\":\"\x80\"}",
            b"{\"a\":\"\xf4\x90\x80\x80\"}",
        ] {
            assert!(feed(bad).is_none(), "{bad:?}");
        }
        // Unfinished texts are valid prefixes, not complete ones.
        let partial = feed(b"{\"a\": [1, {\"b\": \"x").unwrap();
        assert!(!partial.is_complete());
    }

    #[test]
    fn nesting_and_whitespace_are_bounded() {
        let open = "{\"a\":";
        assert!(feed(format!("{}1", open.repeat(MAX_DEPTH)).as_bytes()).is_some());
        assert!(feed(format!("{}1", open.repeat(MAX_DEPTH + 1)).as_bytes()).is_none());
        assert!(feed(format!("{}[1]", open.repeat(MAX_DEPTH)).as_bytes()).is_none());
        let pad = " ".repeat(MAX_WS_RUN as usize);
        assert!(complete(&format!("{{{pad}\"a\":1}}")));
        assert!(!complete(&format!("{{{pad} \"a\":1}}")));
        // After the object, any whitespace.
        assert!(complete(&format!("{{}}{pad}{pad}{pad}")));
        // Inside strings, any content.
        assert!(complete(&format!("{{\"a\":\"{pad}{pad}\"}}")));
    }

    #[test]
    fn accepts_agrees_with_step() {
        let text = b"{\"k\": [1, 2.5, \"v\\u0041\", {\"z\": null}], \"t\": true}";
        for cut in 0..text.len() {
            let j = feed(&text[..cut]).unwrap();
            for len in 1..=(text.len() - cut).min(7) {
                assert!(j.accepts(&text[cut..cut + len]), "{cut}+{len}");
            }
            assert!(!j.accepts(b"\x01"));
        }
    }

    /// Random serde values, serialized compact and pretty: every one is accepted and complete.
    #[test]
    fn surrogate_escapes_come_in_pairs() {
        for ok in [
            r#"{"a":"\ud83d\ude00"}"#,
            r#"{"a":"\uD83D\uDE00x"}"#,
            r#"{"a":"\u00e9\ud7ff\ue000\uffff"}"#,
        ] {
            assert!(complete(ok), "{ok}");
            let v: serde_json::Value = serde_json::from_str(ok).unwrap();
            assert!(v["a"].is_string());
        }
        for bad in [
            r#"{"a":"\ud83d""#,      // a high surrogate alone
            r#"{"a":"\ud83dx"#,      // followed by something else
            r#"{"a":"\ud83d\n"#,     // or another escape
            r#"{"a":"\ud83d\u0041"#, // or a character that is not a low surrogate
            r#"{"a":"\ude00"#,       // a low surrogate alone
        ] {
            assert!(feed(bad.as_bytes()).is_none(), "{bad}");
            // serde_json refuses each once the string ends, as the automaton does at once.
            let closed = format!("{}\"}}", bad.trim_end_matches('"'));
            assert!(
                serde_json::from_str::<serde_json::Value>(&closed).is_err(),
                "{closed}"
            );
        }
    }

    #[test]
    fn every_serialized_object_is_accepted() {
        fn value(rng: &mut rand_chacha::ChaCha8Rng, depth: usize) -> serde_json::Value {
            use serde_json::Value;
            match rng.gen_range(0..if depth > 4 { 4 } else { 6 }) {
                0 => Value::Null,
                1 => Value::Bool(rng.gen()),
                2 => serde_json::json!(rng.gen_range(-1e6..1e6)),
                3 => {
                    let n = rng.gen_range(0..8);
                    Value::String(
                        (0..n)
                            .map(|_| {
                                ['a', 'é', '"', '\\', '\n', '😀', '\u{1}', ' ', '/', 'ß']
                                    [rng.gen_range(0..10)]
                            })
                            .collect(),
                    )
                }
                4 => Value::Array(
                    (0..rng.gen_range(0..4))
                        .map(|_| value(rng, depth + 1))
                        .collect(),
                ),
                _ => Value::Object(
                    (0..rng.gen_range(0..4))
                        .map(|i| (format!("k{i}"), value(rng, depth + 1)))
                        .collect(),
                ),
            }
        }
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
        for _ in 0..500 {
            let obj = serde_json::Value::Object(
                (0..rng.gen_range(0..5))
                    .map(|i| (format!("key {i}"), value(&mut rng, 1)))
                    .collect(),
            );
            for text in [
                serde_json::to_string(&obj).unwrap(),
                serde_json::to_string_pretty(&obj).unwrap(),
            ] {
                assert!(complete(&text), "{text}");
            }
        }
    }

    /// A toy vocabulary of JSON pieces and random multi-byte tokens, random logits, sampled
    /// greedily under the mask: every run is a valid prefix, and every run that chose the stop
    /// id parses as a JSON object.
    #[test]
    fn masked_greedy_decoding_only_writes_json_objects() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(11);
        let mut vocab: Vec<Option<Vec<u8>>> = (0..=255u8).map(|b| Some(vec![b])).collect();
        for piece in [
            "{", "}", "[", "]", "\"", ":", ",", " ", "\n", "{\"", "\":", "\",", "\"}", "true",
            "null", "fal", "se", "12", ".5", "e-", "\\n", "\\u00", "é", "😀", "},", "]}", "\":\"",
        ] {
            vocab.push(Some(piece.as_bytes().to_vec()));
        }
        for _ in 0..300 {
            let n = rng.gen_range(2..6);
            vocab.push(Some((0..n).map(|_| rng.gen_range(0x20..0x7f)).collect()));
        }
        let stop = vocab.len() as u32;
        vocab.push(None);
        let table = Arc::new(TokenTable::new(vocab));
        let mut finished = 0;
        for _ in 0..200 {
            let mut state = Constraint::JsonObject(table.clone()).start();
            let mut out = Vec::new();
            for _ in 0..200 {
                let mut logits: Vec<f32> =
                    (0..table.len()).map(|_| rng.gen_range(-5.0..5.0)).collect();
                // Lean away from the stop id: it must come only after a complete object.
                logits[stop as usize] = 4.9;
                assert!(state.mask(&mut logits, &[stop]));
                let t = crate::sampler::argmax(&logits);
                if t == stop {
                    break;
                }
                out.extend_from_slice(table.bytes(t).unwrap());
                state.advance(t);
                assert!(feed(&out).is_some(), "{}", String::from_utf8_lossy(&out));
            }
            if state.machine.is_complete() {
                let v: serde_json::Value = serde_json::from_slice(&out)
                    .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out)));
                assert!(v.is_object());
                finished += 1;
            }
        }
        assert!(
            finished > 50,
            "only {finished} of 200 runs completed an object"
        );
    }
}
