//! The text a JSON Schema string may hold (`pattern`, `format`, with `minLength` / `maxLength`):
//! a table-driven automaton over the string's *decoded* UTF-8 bytes, every state of which can
//! still end in a matching string — so a mask that refuses the bytes that lead out of it never
//! leaves a string that cannot be finished.
//!
//! Built from a regular expression by `regex-automata`'s dense DFA (anchored, every match kind
//! kept), then walked from its start into a table of its own, crossed with the count of
//! characters read when the string's length is bounded, and pruned to the states from which a
//! match can still be reached. A `maxLength` too long to cross within the state budget is held
//! instead by each state's distance to an end ([`TextPattern::fits`]). `pattern` has JSON Schema's meaning: ECMA-262 syntax, matched
//! *anywhere* in the string (`^` / `$` anchor it); `\d`, `\w`, `\b` are ASCII as in ECMA-262.
//! Syntax the DFA cannot hold (look-ahead, back-references, Unicode `\b`) is refused.

use std::collections::HashMap;

use regex_automata::{
    dfa::{dense, Automaton, StartKind},
    nfa::thompson,
    util::{primitives::StateID, start, syntax},
    Anchored, MatchKind,
};

/// The state no string can leave.
const DEAD: u16 = u16::MAX;

/// Most states the patterns of one schema may have together (each a row of 256 `u16`s: 2 MiB).
pub const MAX_PATTERN_STATES: usize = 4096;

/// Longest `pattern` source, in bytes.
pub const MAX_PATTERN_LEN: usize = 1024;

/// Memory the regex compiler may use for one pattern (NFA, determinization, DFA), bytes.
const BUILD_LIMIT: usize = 2 << 20;

/// The `format`s that can be held to, each as the regular expression its whole string matches,
/// in parts (RFC 3339 dates and times, JSON Schema's durations; `email` and `hostname` in a
/// bounded subset of their RFCs: labels of at most 32 characters, at most 6 of them, so every
/// string is within the RFCs' length limits).
const FORMATS: &[(&str, &[&str])] = &[
    ("date", &[DATE]),
    ("time", &[TIME]),
    ("date-time", &[DATE, "T", TIME]),
    ("duration", &[DURATION]),
    // A local part of dot-separated atoms (at most 64 characters), `@`, a domain of 1–4 labels
    // and an alphabetic top-level label.
    (
        "email",
        &[
            LOCAL_PART,
            "@",
            LABEL,
            "(?:\\.",
            LABEL,
            "){0,3}\\.[A-Za-z]{2,12}",
        ],
    ),
    // RFC 1123 labels, 1–6 of them.
    ("hostname", &[LABEL, "(?:\\.", LABEL, "){0,5}"]),
    ("ipv4", &[IPV4]),
    ("ipv6", &[IPV6]),
    ("uuid", &[UUID]),
    // RFC 3986 `URI`, in a subset: a scheme of at most 16 characters, then either `//`, an
    // authority (a registered name or IPv4 address, no user info, no IP literal) with an
    // optional port and a path of segments, or a path without an authority; then an optional
    // query and fragment. Every such string is an absolute URI by the RFC's grammar.
    (
        "uri",
        &[
            "[A-Za-z][A-Za-z0-9+.-]{0,15}:(?://",
            REG_NAME,
            "(?::[0-9]{1,5})?(?:/",
            PCHAR,
            "*)*|(?:/?",
            PCHAR,
            "+(?:/",
            PCHAR,
            "*)*)?)(?:\\?(?:",
            PCHAR,
            "|[/?])*)?(?:#(?:",
            PCHAR,
            "|[/?])*)?",
        ],
    ),
];

/// RFC 3986 `pchar`: unreserved, percent-encoded, sub-delims, `:`, `@`.
const PCHAR: &str = "(?:[A-Za-z0-9._~!$&'()*+,;=:@-]|%[0-9A-Fa-f]{2})";
/// RFC 3986 `reg-name` (an IPv4 address is one too): unreserved, percent-encoded, sub-delims.
const REG_NAME: &str = "(?:[A-Za-z0-9._~!$&'()*+,;=-]|%[0-9A-Fa-f]{2})*";

/// A calendar date: February 29 only in leap years (proleptic Gregorian).
const DATE: &str = concat!(
    "(?:[0-9]{4}-(?:(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])",
    "|(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)",
    "|02-(?:0[1-9]|1[0-9]|2[0-8]))",
    "|(?:[0-9]{2}(?:0[48]|[2468][048]|[13579][26])|(?:[02468][048]|[13579][26])00)-02-29)"
);
/// RFC 3339 `full-time` (no leap second; at most 6 fraction digits: microseconds).
const TIME: &str = concat!(
    "(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:\\.[0-9]{1,6})?",
    "(?:Z|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])"
);
/// RFC 3339 Appendix A `duration` (each number at most 9 digits).
const DURATION: &str = concat!(
    "P(?:(?:[0-9]{1,9}D|[0-9]{1,9}M(?:[0-9]{1,9}D)?|[0-9]{1,9}Y(?:[0-9]{1,9}M(?:[0-9]{1,9}D)?)?)",
    "(?:T(?:[0-9]{1,9}H(?:[0-9]{1,9}M(?:[0-9]{1,9}S)?)?|[0-9]{1,9}M(?:[0-9]{1,9}S)?|[0-9]{1,9}S))?",
    "|T(?:[0-9]{1,9}H(?:[0-9]{1,9}M(?:[0-9]{1,9}S)?)?|[0-9]{1,9}M(?:[0-9]{1,9}S)?|[0-9]{1,9}S)",
    "|[0-9]{1,9}W)"
);
/// An email's local part: dot-separated atoms, at most 64 characters.
const LOCAL_PART: &str = "[A-Za-z0-9_%+-]{1,32}(?:\\.[A-Za-z0-9_%+-]{1,15}){0,2}";
/// A DNS label: letters, digits and inner hyphens, at most 32 characters.
const LABEL: &str = "[A-Za-z0-9](?:[A-Za-z0-9-]{0,30}[A-Za-z0-9])?";
/// Dotted decimal, no leading zeros.
const IPV4: &str = concat!(
    "(?:25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])",
    "(?:\\.(?:25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])){3}"
);
/// RFC 4291 text forms, `::` compression included (no embedded IPv4, no zone).
const IPV6: &str = concat!(
    "(?:(?:[0-9a-fA-F]{1,4}:){7}[0-9a-fA-F]{1,4}",
    "|(?:[0-9a-fA-F]{1,4}:){1,7}:",
    "|(?:[0-9a-fA-F]{1,4}:){1,6}:[0-9a-fA-F]{1,4}",
    "|(?:[0-9a-fA-F]{1,4}:){1,5}(?::[0-9a-fA-F]{1,4}){1,2}",
    "|(?:[0-9a-fA-F]{1,4}:){1,4}(?::[0-9a-fA-F]{1,4}){1,3}",
    "|(?:[0-9a-fA-F]{1,4}:){1,3}(?::[0-9a-fA-F]{1,4}){1,4}",
    "|(?:[0-9a-fA-F]{1,4}:){1,2}(?::[0-9a-fA-F]{1,4}){1,5}",
    "|[0-9a-fA-F]{1,4}:(?::[0-9a-fA-F]{1,4}){1,6}",
    "|:(?:(?::[0-9a-fA-F]{1,4}){1,7}|:))"
);
const UUID: &str = "[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}";

/// What a string may hold, as an automaton over its decoded bytes. State 0 is the start.
#[derive(Clone, PartialEq, Eq)]
pub struct TextPattern {
    /// `next[state * 256 + byte]`: the state after `byte`, or [`DEAD`].
    next: Vec<u16>,
    /// Whether the string read so far may end there.
    ends: Vec<bool>,
    /// The fewest characters from each state to one that may end: the string's `max` length
    /// is held with it where the automaton is not crossed with the count ([`Self::fits`]).
    left: Vec<u32>,
}

impl std::fmt::Debug for TextPattern {
    /// Its size, not its table (up to 4,096 × 256 entries).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TextPattern")
            .field("states", &self.states())
            .finish_non_exhaustive()
    }
}

impl TextPattern {
    /// A JSON Schema `pattern` (ECMA-262, found anywhere in the string), with the string's
    /// length bounds in characters; at most `budget` states.
    pub fn search(pattern: &str, min: u32, max: u32, budget: usize) -> Result<TextPattern, String> {
        if pattern.len() > MAX_PATTERN_LEN {
            return Err(format!("`pattern` is longer than {MAX_PATTERN_LEN} bytes"));
        }
        let regex = format!("(?s:.)*(?:{})(?s:.)*", from_ecma(pattern)?);
        TextPattern::whole(&regex, min, max, budget).map_err(|e| format!("`pattern`: {e}"))
    }

    /// A JSON Schema `format` (one of [`FORMATS`]), with the string's length bounds.
    pub fn format(name: &str, min: u32, max: u32, budget: usize) -> Result<TextPattern, String> {
        let Some(&(_, parts)) = FORMATS.iter().find(|(n, _)| *n == name) else {
            let known: Vec<&str> = FORMATS.iter().map(|(n, _)| *n).collect();
            return Err(format!(
                "`format` {name:?} is not supported (supported: {})",
                known.join(", ")
            ));
        };
        TextPattern::whole(&parts.concat(), min, max, budget)
            .map_err(|e| format!("`format` {name:?}: {e}"))
    }

    /// How many states it has.
    pub fn states(&self) -> usize {
        self.ends.len()
    }

    /// The bytes its tables hold (`states × 256` transitions of 2 bytes, one end flag and one
    /// distance each).
    pub fn heap_bytes(&self) -> usize {
        self.next.capacity() * std::mem::size_of::<u16>()
            + self.ends.capacity()
            + self.left.capacity() * std::mem::size_of::<u32>()
    }

    /// The fewest characters that take a string from `state` to an end.
    pub fn left(&self, state: u16) -> u32 {
        self.left
            .get(usize::from(state))
            .copied()
            .unwrap_or(u32::MAX)
    }

    /// Whether a string in `state` with `len` characters written can still end within `max`
    /// characters. Always true where the automaton was crossed with the count (its states
    /// hold the bound); where a long `maxLength` made that too large, this is how the bound is
    /// held, and every string it lets through can still be finished.
    pub fn fits(&self, state: u16, len: u32, max: u32) -> bool {
        u64::from(len) + u64::from(self.left(state)) <= u64::from(max)
    }

    /// Whether `bytes` may follow from `state` in a string with `room` characters left before
    /// its `max`: a matching string can still follow them, within that room.
    pub fn allows_within(&self, mut state: u16, bytes: &[u8], room: u32) -> bool {
        let mut chars = 0u32;
        for &b in bytes {
            match self.step(state, b) {
                Some(n) => state = n,
                None => return false,
            }
            chars += u32::from(b & 0xc0 != 0x80);
        }
        self.fits(state, chars, room)
    }

    /// The state after `byte` from `state`, if a matching string can still follow.
    pub fn step(&self, state: u16, byte: u8) -> Option<u16> {
        let n = *self
            .next
            .get(usize::from(state) * 256 + usize::from(byte))?;
        (n != DEAD).then_some(n)
    }

    /// Whether the string may end in `state`.
    pub fn ends(&self, state: u16) -> bool {
        self.ends.get(usize::from(state)).copied().unwrap_or(false)
    }

    /// The automaton of strings `regex` (Rust syntax) matches whole, of `min..=max` characters:
    /// crossed with the count of characters up to `max`, or, when that needs more than
    /// `budget` states (a long `maxLength` on a pattern that loops: pydantic's `HttpUrl` is a
    /// `uri` of at most 2,083), crossed up to `min` only, `max` then held by [`Self::fits`].
    fn whole(regex: &str, min: u32, max: u32, budget: usize) -> Result<TextPattern, String> {
        let dfa = TextPattern::dfa(regex)?;
        match TextPattern::walk(&dfa, min, max, budget) {
            Err(e) if max != u32::MAX && e.contains("automaton states") => {
                let p = TextPattern::walk(&dfa, min, u32::MAX, budget)?;
                if !p.fits(0, 0, max) {
                    return Err(format!("no string of at most {max} characters matches it"));
                }
                Ok(p)
            }
            other => other,
        }
    }

    fn dfa(regex: &str) -> Result<dense::DFA<Vec<u32>>, String> {
        dense::Builder::new()
            .configure(
                dense::Config::new()
                    .match_kind(MatchKind::All)
                    .start_kind(StartKind::Anchored)
                    .dfa_size_limit(Some(BUILD_LIMIT))
                    .determinize_size_limit(Some(BUILD_LIMIT)),
            )
            .syntax(syntax::Config::new().nest_limit(64))
            .thompson(thompson::Config::new().nfa_size_limit(Some(BUILD_LIMIT)))
            .build(regex)
            .map_err(|e| e.to_string())
    }

    /// The automaton of `dfa`'s whole matches crossed with the count of characters up to
    /// `max` (with no `max`, up to `min`), pruned to the states that can still end.
    fn walk(
        dfa: &dense::DFA<Vec<u32>>,
        min: u32,
        max: u32,
        budget: usize,
    ) -> Result<TextPattern, String> {
        let start = dfa
            .start_state(&start::Config::new().anchored(Anchored::Yes))
            .map_err(|e| e.to_string())?;
        // Characters are counted up to `cap`: past `max` a string is refused, and with no
        // `max` only reaching `min` matters.
        let bounded = max != u32::MAX;
        let cap = if bounded { max } else { min };
        let mut ids: HashMap<(StateID, u32), u16> = HashMap::new();
        let mut order: Vec<(StateID, u32)> = vec![(start, 0)];
        ids.insert((start, 0), 0);
        let mut next: Vec<u16> = Vec::new();
        let mut ends: Vec<bool> = Vec::new();
        let mut i = 0;
        while i < order.len() {
            let (s, count) = order[i];
            ends.push(count >= min && dfa.is_match_state(dfa.next_eoi_state(s)));
            for byte in 0..=255u8 {
                let n = dfa.next_state(s, byte);
                // A character begins with every byte but UTF-8's continuation bytes.
                let c = if byte & 0xc0 == 0x80 {
                    count
                } else {
                    count + 1
                };
                if dfa.is_dead_state(n) || dfa.is_quit_state(n) || (bounded && c > max) {
                    next.push(DEAD);
                    continue;
                }
                let key = (n, c.min(cap));
                let id = match ids.get(&key) {
                    Some(&id) => id,
                    None => {
                        if order.len() >= budget.min(usize::from(DEAD)) {
                            return Err(format!(
                                "needs more than {} automaton states (with the length bounds)",
                                budget
                            ));
                        }
                        let id = order.len() as u16;
                        ids.insert(key, id);
                        order.push(key);
                        id
                    }
                };
                next.push(id);
            }
            i += 1;
        }
        TextPattern::pruned(next, ends)
    }

    /// Strings both `a` and `b` hold (`pattern` beside `format`): their product automaton,
    /// pruned to the states that can still end, at most `budget` states.
    pub fn intersect(
        a: &TextPattern,
        b: &TextPattern,
        budget: usize,
    ) -> Result<TextPattern, String> {
        let mut ids: HashMap<(u16, u16), u16> = HashMap::new();
        let mut order: Vec<(u16, u16)> = vec![(0, 0)];
        ids.insert((0, 0), 0);
        let mut next: Vec<u16> = Vec::new();
        let mut ends: Vec<bool> = Vec::new();
        let mut i = 0;
        while i < order.len() {
            let (sa, sb) = order[i];
            ends.push(a.ends(sa) && b.ends(sb));
            for byte in 0..=255u8 {
                let (Some(na), Some(nb)) = (a.step(sa, byte), b.step(sb, byte)) else {
                    next.push(DEAD);
                    continue;
                };
                let id = match ids.get(&(na, nb)) {
                    Some(&id) => id,
                    None => {
                        if order.len() >= budget.min(usize::from(DEAD)) {
                            return Err(format!(
                                "`pattern` with `format` needs more than {budget} automaton states"
                            ));
                        }
                        let id = order.len() as u16;
                        ids.insert((na, nb), id);
                        order.push((na, nb));
                        id
                    }
                };
                next.push(id);
            }
            i += 1;
        }
        TextPattern::pruned(next, ends).map_err(|e| format!("`pattern` with `format`: {e}"))
    }

    /// A raw table (`next`, rows of 256; `ends`) pruned to the states from which an end is
    /// reachable, renumbered (the start stays 0), with each state's distance to an end.
    fn pruned(next: Vec<u16>, ends: Vec<bool>) -> Result<TextPattern, String> {
        // Keep the states from which an end is reachable: a fixpoint over the table.
        let states = ends.len();
        let mut live = ends.clone();
        loop {
            let mut changed = false;
            for s in 0..states {
                if !live[s]
                    && next[s * 256..(s + 1) * 256]
                        .iter()
                        .any(|&n| n != DEAD && live[usize::from(n)])
                {
                    live[s] = true;
                    changed = true;
                }
            }
            if !changed {
                break;
            }
        }
        if !live[0] {
            return Err("no string matches it".into());
        }
        // Renumber the live states (the start stays 0).
        let mut new_id = vec![DEAD; states];
        let mut kept = 0u16;
        for s in 0..states {
            if live[s] {
                new_id[s] = kept;
                kept += 1;
            }
        }
        let mut table = Vec::with_capacity(usize::from(kept) * 256);
        let mut kept_ends = Vec::with_capacity(usize::from(kept));
        for s in (0..states).filter(|&s| live[s]) {
            table.extend(next[s * 256..(s + 1) * 256].iter().map(|&n| {
                if n == DEAD {
                    DEAD
                } else {
                    new_id[usize::from(n)]
                }
            }));
            kept_ends.push(ends[s]);
        }
        let left = distances(&table, &kept_ends);
        Ok(TextPattern {
            next: table,
            ends: kept_ends,
            left,
        })
    }
}

/// For each state of `next` (rows of 256), the fewest characters to a state of `ends`: a
/// shortest-path search backwards from the ends, a byte that begins a character costing 1 and a
/// UTF-8 continuation byte 0 (a deque: 0-cost steps to the front).
fn distances(next: &[u16], ends: &[bool]) -> Vec<u32> {
    let states = ends.len();
    // Who reaches whom, and at what cost.
    let mut into: Vec<Vec<(u16, u32)>> = vec![Vec::new(); states];
    for s in 0..states {
        for b in 0..=255u8 {
            let n = next[s * 256 + usize::from(b)];
            if n != DEAD {
                into[usize::from(n)].push((s as u16, u32::from(b & 0xc0 != 0x80)));
            }
        }
    }
    let mut left = vec![u32::MAX; states];
    let mut todo = std::collections::VecDeque::new();
    for (s, &e) in ends.iter().enumerate() {
        if e {
            left[s] = 0;
            todo.push_back(s);
        }
    }
    while let Some(n) = todo.pop_front() {
        for &(s, cost) in &into[n] {
            let d = left[n].saturating_add(cost);
            if d < left[usize::from(s)] {
                left[usize::from(s)] = d;
                if cost == 0 {
                    todo.push_front(usize::from(s));
                } else {
                    todo.push_back(usize::from(s));
                }
            }
        }
    }
    left
}

/// An ECMA-262 pattern in the regex crate's syntax: `\d`, `\w`, `\b` (and their negations) are
/// ASCII in ECMA-262 and Unicode-aware there, so they are spelled out.
fn from_ecma(pattern: &str) -> Result<String, String> {
    let mut out = String::with_capacity(pattern.len() + 16);
    let mut chars = pattern.chars();
    while let Some(c) = chars.next() {
        if c != '\\' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('d') => out.push_str("[0-9]"),
            Some('D') => out.push_str("[^0-9]"),
            Some('w') => out.push_str("[0-9A-Za-z_]"),
            Some('W') => out.push_str("[^0-9A-Za-z_]"),
            Some('b') => out.push_str("(?-u:\\b)"),
            Some('B') => out.push_str("(?-u:\\B)"),
            Some(other) => {
                out.push('\\');
                out.push(other);
            }
            None => return Err("`pattern` ends with a lone backslash".into()),
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn full(p: &TextPattern, text: &str) -> bool {
        let mut s = 0u16;
        for &b in text.as_bytes() {
            match p.step(s, b) {
                Some(n) => s = n,
                None => return false,
            }
        }
        p.ends(s)
    }

    #[test]
    fn a_pattern_is_found_anywhere_unless_anchored() {
        let p = TextPattern::search("ab+c", 0, u32::MAX, 4096).unwrap();
        assert!(full(&p, "abc"));
        assert!(full(&p, "xxabbbcyy"));
        assert!(!full(&p, "ac"));
        assert!(!full(&p, "xyz"));
        let p = TextPattern::search("^\\d{3}-\\d{4}$", 0, u32::MAX, 4096).unwrap();
        assert!(full(&p, "555-1234"));
        assert!(!full(&p, "x555-1234"));
        assert!(!full(&p, "555-12345"));
        // ECMA-262's \d is ASCII: an Arabic-Indic digit is not one.
        assert!(!full(&p, "\u{0665}55-1234"));
        // `$` is the end of the string only.
        let p = TextPattern::search("a$", 0, u32::MAX, 4096).unwrap();
        assert!(full(&p, "ba"));
        assert!(!full(&p, "ab"));
        assert!(!full(&p, "a\n"));
    }

    #[test]
    fn every_state_can_still_reach_an_end() {
        for p in [
            TextPattern::search("^(ab|cd)e$", 0, u32::MAX, 4096).unwrap(),
            TextPattern::format("uri", 1, u32::MAX, 4096).unwrap(),
            TextPattern::format("date", 0, u32::MAX, 4096).unwrap(),
            TextPattern::format("ipv6", 0, u32::MAX, 4096).unwrap(),
            TextPattern::search("^[a-z]+$", 3, 5, 4096).unwrap(),
        ] {
            // From every state, a breadth-first walk reaches a state that may end.
            for s in 0..p.states() as u16 {
                let mut seen = vec![false; p.states()];
                let mut todo = vec![s];
                let mut found = false;
                while let Some(t) = todo.pop() {
                    if p.ends(t) {
                        found = true;
                        break;
                    }
                    for b in 0..=255u8 {
                        if let Some(n) = p.step(t, b) {
                            if !seen[usize::from(n)] {
                                seen[usize::from(n)] = true;
                                todo.push(n);
                            }
                        }
                    }
                }
                assert!(found, "state {s} is a dead end");
            }
        }
    }

    #[test]
    fn uris_hold_rfc_3986() {
        let uri = TextPattern::format("uri", 1, u32::MAX, 4096).unwrap();
        for ok in [
            "https://example.com",
            "https://example.com/",
            "http://www.example.com:8080/a/b%20c/?q=1&r=a+b#frag/x?y",
            "file:///tmp/x.txt",
            "mailto:someone@example.com",
            "urn:isbn:0451450523",
            "tel:+1-816-555-1212",
            "ftp://192.0.2.16/pub",
            "a:",
        ] {
            assert!(full(&uri, ok), "{ok}");
        }
        for bad in [
            "example.com",
            "//example.com",
            "1http://x",
            "http://exa mple.com",
            "http://a@b@c",
            "http://host:port/",
            "http://x/%zz",
            "http://x/#a#b",
            "http://x/\"",
            "https://ex\u{e9}.com",
            "",
        ] {
            assert!(!full(&uri, bad), "{bad}");
        }
    }

    /// A `maxLength` too long to cross with the count is held by the distance to an end: the
    /// automaton stays small, and what it lets through can still end within the bound.
    #[test]
    fn a_long_max_length_is_held_by_the_distance_to_an_end() {
        // pydantic's HttpUrl: `format: uri`, 1 to 2,083 characters.
        let url = TextPattern::format("uri", 1, 2083, 4096).unwrap();
        assert!(url.states() < 100, "{}", url.states());
        assert_eq!(url.left(0), 2, "`a:` is the shortest");
        assert!(full(&url, "https://example.com/a"));
        let pairs = TextPattern::search("^(ab)*$", 0, 4999, 4096).unwrap();
        assert!(pairs.states() < 8, "{}", pairs.states());
        // After 4,998 characters, an `a` would need a `b` past the bound; the string may end.
        let mut s = 0u16;
        for b in "ab".repeat(2499).bytes() {
            s = pairs.step(s, b).unwrap();
        }
        assert!(pairs.ends(s) && pairs.fits(s, 4998, 4999));
        let a = pairs.step(s, b'a').unwrap();
        assert!(!pairs.fits(a, 4999, 4999) && pairs.fits(a, 4999, 5000));
        assert!(!pairs.allows_within(s, b"a", 1) && pairs.allows_within(s, b"ab", 2));
        // A character's continuation bytes cost nothing; its first byte one.
        let accents = TextPattern::search("^é+$", 1, 100_000, 64).unwrap();
        assert_eq!(accents.left(0), 1);
        assert_eq!(accents.left(accents.step(0, 0xc3).unwrap()), 0);
        // A bound no string meets is still refused.
        let e = TextPattern::search("^(abc){500}(abc)*$", 0, 1000, 4096).unwrap_err();
        assert!(e.contains("no string"), "{e}");
    }

    #[test]
    fn an_intersection_holds_what_both_hold() {
        let email = TextPattern::format("email", 0, u32::MAX, 4096).unwrap();
        let domain = TextPattern::search("@example\\.com$", 0, u32::MAX, 4096).unwrap();
        let both = TextPattern::intersect(&email, &domain, 4096).unwrap();
        assert!(full(&both, "ada@example.com"));
        assert!(!full(&both, "ada@example.org"), "not the domain");
        assert!(!full(&both, "x y@example.com"), "not an email");
        assert!(full(&email, "x@y.org") && !full(&both, "x@y.org"));
        // Bounds apply through either side; nothing in common is refused.
        let short = TextPattern::search("^a+$", 0, 3, 4096).unwrap();
        let any = TextPattern::search("a", 0, u32::MAX, 4096).unwrap();
        let both = TextPattern::intersect(&short, &any, 4096).unwrap();
        assert!(full(&both, "aaa") && !full(&both, "aaaa"));
        let date = TextPattern::format("date", 0, u32::MAX, 4096).unwrap();
        let letters = TextPattern::search("^[a-z]+$", 0, u32::MAX, 4096).unwrap();
        assert!(TextPattern::intersect(&date, &letters, 4096)
            .unwrap_err()
            .contains("no string"));
        // And within the budget.
        assert!(TextPattern::intersect(&email, &domain, 8)
            .unwrap_err()
            .contains("automaton states"));
    }

    #[test]
    fn length_bounds_count_characters() {
        let p = TextPattern::search("^[a-zé]+$", 2, 3, 4096).unwrap();
        assert!(!full(&p, "a"));
        assert!(full(&p, "ab"));
        assert!(full(&p, "éé"));
        assert!(full(&p, "aéb"));
        assert!(!full(&p, "abcd"));
        // A bound the pattern cannot meet leaves nothing.
        let e = TextPattern::format("uuid", 0, 10, 4096).unwrap_err();
        assert!(e.contains("no string"), "{e}");
    }

    #[test]
    fn formats_hold_their_rfcs() {
        let date = TextPattern::format("date", 0, u32::MAX, 4096).unwrap();
        for ok in ["2024-02-29", "2000-02-29", "2023-12-31", "1999-04-30"] {
            assert!(full(&date, ok), "{ok}");
        }
        for bad in [
            "2023-02-29",
            "1900-02-29",
            "2023-04-31",
            "2023-13-01",
            "2023-00-10",
            "23-01-01",
        ] {
            assert!(!full(&date, bad), "{bad}");
        }
        let dt = TextPattern::format("date-time", 0, u32::MAX, 4096).unwrap();
        assert!(full(&dt, "2024-05-06T07:08:09Z"));
        assert!(full(&dt, "2024-05-06T07:08:09.123456+02:00"));
        assert!(!full(&dt, "2024-05-06T24:00:00Z"));
        assert!(!full(&dt, "2024-05-06 07:08:09Z"));
        assert!(!full(&dt, "2024-05-06T07:08:09"));
        let v4 = TextPattern::format("ipv4", 0, u32::MAX, 4096).unwrap();
        assert!(full(&v4, "192.168.0.1") && full(&v4, "255.255.255.255"));
        assert!(!full(&v4, "256.1.1.1") && !full(&v4, "01.1.1.1") && !full(&v4, "1.1.1"));
        let v6 = TextPattern::format("ipv6", 0, u32::MAX, 4096).unwrap();
        for ok in ["::", "::1", "fe80::1:2", "2001:db8:0:0:0:0:2:1", "1::"] {
            assert!(full(&v6, ok), "{ok}");
            assert!(ok.parse::<std::net::Ipv6Addr>().is_ok(), "{ok}");
        }
        for bad in [":::", "1:2:3:4:5:6:7:8:9", "12345::", "1::2::3"] {
            assert!(!full(&v6, bad), "{bad}");
        }
        let dur = TextPattern::format("duration", 0, u32::MAX, 4096).unwrap();
        for ok in ["P1D", "PT5M", "P1Y2M3DT4H5M6S", "P3W"] {
            assert!(full(&dur, ok), "{ok}");
        }
        for bad in ["P", "PT", "P1H", "P1W2D"] {
            assert!(!full(&dur, bad), "{bad}");
        }
        let e = TextPattern::format("email", 0, u32::MAX, 4096).unwrap();
        assert!(full(&e, "ada.lovelace@example.org"));
        assert!(!full(&e, "ada@@example.org") && !full(&e, "ada@example") && !full(&e, ".a@b.org"));
        assert!(TextPattern::format("iri", 0, u32::MAX, 4096).is_err());
    }

    #[test]
    fn what_a_dfa_cannot_hold_is_refused() {
        for p in ["a(?=b)", "(a)\\1", "\\", "a{5000}{5000}"] {
            assert!(TextPattern::search(p, 0, u32::MAX, 4096).is_err(), "{p}");
        }
        // A pattern whose automaton outgrows the budget.
        let e = TextPattern::search("(a|b)*a(a|b){12}", 0, u32::MAX, 4096).unwrap_err();
        assert!(
            e.contains("states") || e.contains("limit") || e.contains("exceed"),
            "{e}"
        );
    }

    /// Patterns that would build huge automata are refused by the builder's limits or the
    /// state budget, never built without bound (printed: how long each took).
    #[test]
    fn hostile_patterns_stay_within_the_budget() {
        let alternations = "(a|b)".repeat(200);
        for (p, max) in [
            ("(((a{100}){100}){100})", u32::MAX),
            ("[\\s\\S]{0,1000}", u32::MAX),
            ("\\p{L}{200}", u32::MAX),
            ("(a|aa)*b", u32::MAX),
            ("^[a-z]+$", 100_000),
            (alternations.as_str(), u32::MAX),
        ] {
            let t = std::time::Instant::now();
            let r = TextPattern::search(p, 0, max, MAX_PATTERN_STATES);
            if let Ok(tp) = &r {
                assert!(tp.states() <= MAX_PATTERN_STATES, "{p}");
            }
            println!(
                "{:.40} (max {max}): {} in {:?}",
                p,
                r.map(|t| format!("{} states", t.states()))
                    .unwrap_or_else(|e| e.chars().take(60).collect()),
                t.elapsed()
            );
        }
    }
}
