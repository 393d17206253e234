//! Structured outputs (`response_format: {"type": "json_schema", …}`): a JSON Schema compiled to
//! a byte automaton that [`crate::constraint`] masks tokens with, as JSON mode does with any
//! object.
//!
//! Objects list their `properties`; the answer writes them in the schema's order, every
//! `required` one and, as the model chooses, the others (JSON Schema: a property not in
//! `required` may be absent; no `required` = all may be; at most 63 optional properties in a
//! row); `additionalProperties` `false` (absent = false: no other key is written), a schema or
//! `true` beside them (keys of the model's choice after the listed ones, none of them a listed
//! key), or, with no `properties`, a schema or `true` (a dict: keys of the model's choice, values of that schema
//! or any JSON value; `maxProperties`, and `minProperties` of at most 1, as keys cannot be held
//! distinct; keys held to `propertyNames` or one `patternProperties` pattern, an enum's keys
//! distinct); `{}` is any JSON value; `type` `object`, `array` (`items`, `minItems`, `maxItems`;
//! tuples: `prefixItems`, or a list of `items` with `additionalItems`; `uniqueItems` over
//! `enum` / `const` items, each value at most once), `string`
//! (`minLength`, `maxLength`: characters, a `\u` escape counting as one; `pattern`, ECMA-262
//! found anywhere in the string; `format` `date`, `time`, `date-time`, `duration`, `email`,
//! `hostname`, `ipv4`, `ipv6`, `uuid`, `uri` — [`crate::text_pattern`]; such a string is written
//! without `\u` escapes), `number`, `integer` (both with `minimum`, `maximum`,
//! `exclusiveMinimum`, `exclusiveMaximum`, `multipleOf`, read exactly from their JSON text; a bounded
//! `number` is written without an exponent, with at most 18 integer and 12 fraction digits),
//! `boolean`, `null`, or a list of them; `enum` / `const` of strings, numbers
//! (written as serde_json writes them), booleans and null, at most 64 values; `anyOf` /
//! `oneOf` whose alternatives begin with different characters (an object, an array, a string,
//! a number, `true`/`false`, `null`); `anyOf` (and `type` lists) whose alternatives begin alike,
//! read side by side, a run per alternative that the text still fits ([`SchemaJson`], at most
//! [`MAX_RUNS`] at once, bounded when compiled; `oneOf` refuses such alternatives, as a text
//! both match would break it); and object alternatives that form a *tagged union*: every one has a
//! property of the same name whose value is a string `const` (or one-value `enum`) of its own
//! (`discriminator.propertyName` names it, else the first such property), and the answer
//! writes that property first, then the chosen alternative's others in its order; local `$ref`s
//! (`#/$defs/…`, `#/definitions/…`, recursion included). An `integer` has at most 18
//! characters, so it fits an i64. Annotations (`title`, `description`,
//! `default`, `examples`, `$comment`, `$schema`, `$id`, `strict`) are ignored. Anything that
//! would constrain the text in a way the automaton does not enforce (`uniqueItems` over other
//! items, `patternProperties`, an `allOf` whose members do not merge (`Compiler::merge_all_of`), `not`, an unknown `format`, a `multipleOf` finer than the digits written, …)
//! is refused when the schema is compiled, naming the keyword and where it is, rather than
//! silently not enforced.

use std::collections::HashMap;

use serde_json::Value;

use crate::constraint::{is_ws, string_step, Num, Str, MAX_DEPTH, MAX_NUMBER_LEN, MAX_WS_RUN};
use crate::text_pattern::{TextPattern, MAX_PATTERN_STATES};

/// No pattern on a string (`Mode::InStr::pat`).
const NO_PATTERN: u16 = u16::MAX;

/// The characters a JSON escape other than `\u` stands for.
const ESCAPED: [u8; 8] = [b'"', b'\\', b'/', 0x08, 0x0c, b'\n', b'\r', b'\t'];

/// Longest `integer`, sign included: every one fits an i64.
const MAX_INTEGER_LEN: u8 = 18;

/// Most nodes a compiled schema may have.
const MAX_NODES: usize = 4096;

/// Most optional properties in a row (the candidates for the next key are a 64-bit mask: the
/// optional ones and the required one after them).
const MAX_OPTIONAL_RUN: usize = 63;

/// A property of an object node.
#[derive(Clone, Debug, PartialEq)]
struct Prop {
    /// The key as JSON text (`"name"`).
    key: Vec<u8>,
    /// The value's node.
    node: usize,
    /// Must be written (else it may be left out).
    required: bool,
}

/// One node of a compiled schema.
#[derive(Clone, Debug, PartialEq)]
enum Node {
    /// A string of `min..=max` characters (code points; a `\u` escape counts as one), held to
    /// `CompiledSchema::patterns[pattern]` when one is set ([`NO_PATTERN`] else).
    String { min: u32, max: u32, pattern: u16 },
    /// Any number (`integer`: no fraction or exponent), within `range` when set (then without
    /// an exponent).
    Number { integer: bool, range: Option<Range> },
    /// One of these exact texts (compact JSON of strings, booleans, null; `boolean` is
    /// `true` / `false`, `null` is `null`).
    Const(Vec<Vec<u8>>),
    /// An array of `min..=max` items: the first ones of the `prefix` nodes in turn (a tuple,
    /// `prefixItems`), the others of `items`; `unique`: no value twice (`uniqueItems`, only
    /// over a `Const` node, whose texts the array's frame marks as used).
    Array {
        items: usize,
        min: u32,
        max: u32,
        prefix: Vec<usize>,
        unique: bool,
    },
    /// An object with these properties, written in this order (the optional ones as the
    /// model chooses), then, when `extra` is set, keys of the model's choice other than the
    /// listed ones with values of node `extra` (`additionalProperties` beside `properties`:
    /// pydantic's `extra="allow"`).
    Object {
        props: Vec<Prop>,
        extra: Option<usize>,
    },
    /// An object of `min..=max` entries with keys of the model's choice — any string, or of
    /// string node `key` (`propertyNames`, a `patternProperties` pattern) — and values of node
    /// `value` (`additionalProperties` with no `properties`: pydantic's `dict[str, X]`). Keys of
    /// a `Const` node are held distinct, as `uniqueItems` holds items.
    Map {
        value: usize,
        key: Option<usize>,
        min: u32,
        max: u32,
    },
    /// One of several nodes, told apart by their first byte.
    Either(Vec<usize>),
    /// Objects told apart by their first property (`head`: its key and a `Const` node whose
    /// text `i` selects `alts[i]`, an object with that property first).
    Tagged { head: Vec<Prop>, alts: Vec<usize> },
    /// A `$ref` not resolved yet (compilation only).
    Pending,
}

/// A compiled schema: its nodes and the root's index.
#[derive(Debug, PartialEq)]
pub struct CompiledSchema {
    nodes: Vec<Node>,
    root: usize,
    /// The strings' patterns (`pattern`, `format`).
    patterns: Vec<TextPattern>,
    /// Per node, the bytes its value may begin with (a 256-bit set).
    firsts: Vec<[u64; 4]>,
}

/// Why a schema cannot be compiled: the JSON pointer of the place, and the reason.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SchemaError {
    /// Where in the schema (a JSON pointer, `""` for the root).
    pub at: String,
    /// What is wrong.
    pub reason: String,
}

impl std::fmt::Display for SchemaError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let at = if self.at.is_empty() { "/" } else { &self.at };
        write!(f, "schema at {at}: {}", self.reason)
    }
}

/// Keywords that describe but do not constrain.
const ANNOTATIONS: &[&str] = &[
    "title",
    "description",
    "default",
    "examples",
    "$comment",
    "$schema",
    "$id",
    "deprecated",
    "readOnly",
    "writeOnly",
];

struct Compiler<'a> {
    root: &'a Value,
    nodes: Vec<Node>,
    refs: HashMap<String, usize>,
    /// Schemas being compiled inside one another (nesting and `$ref` chains).
    depth: usize,
    patterns: Vec<TextPattern>,
    /// The `anyOf`s whose alternatives begin alike (their node, their place), for the bound on
    /// runs ([`MAX_RUNS`]).
    unions: Vec<(usize, String)>,
    /// The node of any JSON value (`{}`), made when first needed.
    any: Option<usize>,
}

/// Deepest nesting of schemas (and chain of `$ref`s) compiled.
const MAX_SCHEMA_DEPTH: usize = 64;

impl CompiledSchema {
    /// Compiles `schema` (the `schema` member of OpenAI's `json_schema`).
    pub fn compile(schema: &Value) -> Result<CompiledSchema, SchemaError> {
        let mut c = Compiler {
            root: schema,
            nodes: Vec::new(),
            refs: HashMap::new(),
            depth: 0,
            patterns: Vec::new(),
            unions: Vec::new(),
            any: None,
        };
        let root = c.node(schema, "")?;
        c.finish(root, b'{')
    }

    /// The schema of one call of one of `tools` (name, `parameters` schema; `tool_choice:
    /// "required"`): `{"name": <its name>, "arguments": <its parameters>}`, a tagged union on
    /// `name` when there are several. Each `parameters` is a schema of its own (its `$ref`s are
    /// its own) and must describe an object. The error names the tool (its index) and the
    /// place in its `parameters`.
    pub fn compile_calls(tools: &[(&str, &Value)]) -> Result<CompiledSchema, (usize, SchemaError)> {
        let (c, root) = Compiler::calls(tools)?;
        c.finish(root, b'{').map_err(|e| (0, e))
    }

    /// A JSON array of 1 to `max` calls, each a call of [`Self::compile_calls`]
    /// (`tool_choice: "required"` with parallel calls allowed, `parallel_tool_calls` not
    /// `false`). Errors as [`Self::compile_calls`].
    pub fn compile_call_list(
        tools: &[(&str, &Value)],
        max: u32,
    ) -> Result<CompiledSchema, (usize, SchemaError)> {
        let (mut c, call) = Compiler::calls(tools)?;
        let root = c
            .push(
                Node::Array {
                    items: call,
                    min: 1,
                    max: max.max(1),
                    prefix: Vec::new(),
                    unique: false,
                },
                "",
            )
            .map_err(|e| (0, e))?;
        c.finish(root, b'[').map_err(|e| (0, e))
    }
}

impl<'a> Compiler<'a> {
    /// The nodes of one call of one of `tools` ([`CompiledSchema::compile_calls`]) and its
    /// node.
    fn calls(tools: &[(&str, &'a Value)]) -> Result<(Compiler<'a>, usize), (usize, SchemaError)> {
        let Some(&(_, first)) = tools.first() else {
            return Err((0, err("", "no tools")));
        };
        let mut c = Compiler {
            root: first,
            nodes: Vec::new(),
            refs: HashMap::new(),
            depth: 0,
            patterns: Vec::new(),
            unions: Vec::new(),
            any: None,
        };
        let mut calls = Vec::new();
        for (i, &(name, params)) in tools.iter().enumerate() {
            c.root = params;
            c.refs.clear();
            let args = c.node(params, "").map_err(|e| (i, e))?;
            let mut firsts = [false; 256];
            first_bytes(&c.nodes, args, &mut firsts, 0);
            if firsts
                .iter()
                .enumerate()
                .any(|(b, &f)| f && b != usize::from(b'{'))
            {
                return Err((i, err("", "`parameters` must describe an object")));
            }
            let name = serde_json::to_vec(name).map_err(|e| (i, err("", e.to_string())))?;
            let name = c.push(Node::Const(vec![name]), "").map_err(|e| (i, e))?;
            let prop = |key: &[u8], node| Prop {
                key: key.to_vec(),
                node,
                required: true,
            };
            let call = c.push(
                Node::Object {
                    props: vec![prop(b"\"name\"", name), prop(b"\"arguments\"", args)],
                    extra: None,
                },
                "",
            );
            calls.push(call.map_err(|e| (i, e))?);
        }
        let root = match calls.as_slice() {
            [one] => *one,
            _ => {
                let tagged = c.tag_objects(calls, Some("name"), "").map_err(|e| (0, e))?;
                c.either(tagged, Alike::Refused, "").map_err(|e| (0, e))?
            }
        };
        Ok((c, root))
    }
}

impl Compiler<'_> {
    /// The compiled schema of root `root`, once every value is writable and the root starts
    /// with `opens` (`{`: an object, as OpenAI requires of a schema; `[`: a list of calls).
    fn finish(self, root: usize, opens: u8) -> Result<CompiledSchema, SchemaError> {
        let c = self;
        // Every value must be writable: a `$ref` cycle with no type in it never is.
        let mut begins = Vec::with_capacity(c.nodes.len());
        for n in 0..c.nodes.len() {
            let mut firsts = [false; 256];
            first_bytes(&c.nodes, n, &mut firsts, 0);
            if !firsts.contains(&true) {
                return Err(err(
                    "",
                    "a `$ref` cycle with no type in it describes no value",
                ));
            }
            let mut set = [0u64; 4];
            for (b, _) in firsts.iter().enumerate().filter(|(_, &f)| f) {
                set[b / 64] |= 1 << (b % 64);
            }
            begins.push(set);
        }
        let mut firsts = [false; 256];
        first_bytes(&c.nodes, root, &mut firsts, 0);
        if firsts
            .iter()
            .enumerate()
            .any(|(b, &f)| f && b != usize::from(opens))
        {
            return Err(err(
                "",
                "the root must be an object (`\"type\": \"object\"`), as OpenAI's structured outputs require",
            ));
        }
        if !c.unions.is_empty() {
            let runs = run_bounds(&c.nodes, &begins);
            if let Some((_, at)) = c.unions.iter().find(|(n, _)| runs[*n] > MAX_RUNS) {
                return Err(err(
                    at,
                    format!(
                        "`anyOf`s whose alternatives begin alike, nested or recursive, could leave more than {MAX_RUNS} readings of the answer open at once"
                    ),
                ));
            }
        }
        Ok(CompiledSchema {
            nodes: c.nodes,
            root,
            patterns: c.patterns,
            firsts: begins,
        })
    }
}

impl CompiledSchema {
    /// An estimate of the memory it holds: its nodes, their keys and texts, its patterns'
    /// tables (`engine::schema_cache` bounds its bytes with it).
    pub fn heap_bytes(&self) -> usize {
        let prop = |p: &Prop| std::mem::size_of::<Prop>() + p.key.capacity();
        let nodes: usize = self
            .nodes
            .iter()
            .map(|n| {
                std::mem::size_of::<Node>()
                    + match n {
                        Node::Const(texts) => texts
                            .iter()
                            .map(|t| std::mem::size_of::<Vec<u8>>() + t.capacity())
                            .sum(),
                        Node::Object { props, .. } => props.iter().map(prop).sum(),
                        Node::Either(alts) | Node::Array { prefix: alts, .. } => {
                            alts.capacity() * std::mem::size_of::<usize>()
                        }
                        Node::Tagged { head, alts } => {
                            head.iter().map(prop).sum::<usize>()
                                + alts.capacity() * std::mem::size_of::<usize>()
                        }
                        _ => 0,
                    }
            })
            .sum();
        let patterns: usize = self
            .patterns
            .iter()
            .map(|p| std::mem::size_of::<TextPattern>() + p.heap_bytes())
            .sum();
        std::mem::size_of::<CompiledSchema>()
            + nodes
            + patterns
            + self.firsts.capacity() * std::mem::size_of::<[u64; 4]>()
    }

    /// Whether a value of node `n` may begin with byte `c`.
    fn begins(&self, n: usize, c: u8) -> bool {
        self.firsts
            .get(n)
            .is_some_and(|set| set[usize::from(c / 64)] & (1 << (c % 64)) != 0)
    }

    /// The properties an object frame of `node` reads (a tagged union: its tag only, until
    /// the tag picks the alternative).
    fn props(&self, node: usize) -> Option<&[Prop]> {
        match &self.nodes[node] {
            Node::Object { props, .. } => Some(props),
            Node::Tagged { head, .. } => Some(head),
            _ => None,
        }
    }
}

/// A count keyword of `o` (`minItems`, `maxLength`, …): an integer in 0..2^32, else `default`
/// when absent.
fn bound(
    o: &serde_json::Map<String, Value>,
    k: &str,
    default: u32,
    at: &str,
) -> Result<u32, SchemaError> {
    match o.get(k) {
        None => Ok(default),
        Some(v) => v
            .as_u64()
            .and_then(|n| u32::try_from(n).ok())
            .ok_or_else(|| err(at, format!("`{k}` must be an integer in 0..2^32"))),
    }
}

/// Fraction digits a bounded `number` is written with at most: its value is then a whole
/// number of 10^-12, and bounds compare exactly.
const BOUNDED_PLACES: u8 = 12;

/// Integer digits a bounded `number` is written with at most.
const BOUNDED_INT_DIGITS: u8 = 18;

/// The values a bounded number node allows: the multiples of `step` in `lo..=hi`, in units of
/// 10^-`places` (`places` 0: an integer; [`BOUNDED_PLACES`]: a `number`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Range {
    lo: i128,
    hi: i128,
    places: u8,
    step: i128,
}

impl Range {
    /// Whether a value it allows lies in `a..=b`.
    fn meets(&self, a: i128, b: i128) -> bool {
        let (x, y) = (a.max(self.lo), b.min(self.hi));
        // The first multiple of `step` from `x` on.
        x <= y && x + (-x).rem_euclid(self.step) <= y
    }

    /// Whether it allows `v`.
    fn holds(&self, v: i128) -> bool {
        (self.lo..=self.hi).contains(&v) && v.rem_euclid(self.step) == 0
    }
}

/// The bounds of a numeric schema (`minimum`, `maximum`, `exclusiveMinimum`,
/// `exclusiveMaximum`, and `multipleOf`: a whole number of units), when it sets any, within what can be written (an integer: 18
/// characters; a number: 18 integer and 12 fraction digits, no exponent). A bound that falls
/// between the values that can be written is rounded inwards, so every value written is within
/// the bound read exactly as its JSON text.
fn range(
    o: &serde_json::Map<String, Value>,
    integer: bool,
    at: &str,
) -> Result<Option<Range>, SchemaError> {
    let places = if integer { 0 } else { BOUNDED_PLACES };
    let (mut lo, mut hi) = if integer {
        (-(10i128.pow(17) - 1), 10i128.pow(18) - 1)
    } else {
        (-(10i128.pow(30) - 1), 10i128.pow(30) - 1)
    };
    let mut any = false;
    let mut step = 1;
    if let Some(v) = o.get("multipleOf") {
        any = true;
        step = match v.as_number().and_then(|n| units(&n.to_string(), places)) {
            Some((down, up)) if down == up && down > 0 && down < 10i128.pow(30) => down,
            _ => {
                let unit = if integer { "1" } else { "10^-12" };
                return Err(err(
                    at,
                    format!("`multipleOf` must be a positive whole number of {unit} (at most 10^30 of them) to be held"),
                ));
            }
        };
    }
    for k in ["minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum"] {
        let Some(v) = o.get(k) else { continue };
        any = true;
        let (down, up) = v
            .as_number()
            .and_then(|n| units(&n.to_string(), places))
            .ok_or_else(|| err(at, format!("`{k}` must be a number")))?;
        match k {
            "minimum" => lo = lo.max(up),
            "exclusiveMinimum" => lo = lo.max(down + 1),
            "maximum" => hi = hi.min(down),
            _ => hi = hi.min(up - 1),
        }
    }
    let r = Range {
        lo,
        hi,
        places,
        step,
    };
    if !r.meets(lo, hi) {
        let what = if integer { "integer" } else { "number" };
        return Err(err(
            at,
            format!("no {what} that can be written is within the bounds"),
        ));
    }
    Ok(any.then_some(r))
}

/// A JSON number's text in units of 10^-`places`, rounded down and rounded up (magnitudes
/// clamped to 10^32, past anything that can be written).
fn units(text: &str, places: u8) -> Option<(i128, i128)> {
    const CLAMP: i128 = 10i128.pow(32);
    let (neg, rest) = match text.strip_prefix('-') {
        Some(r) => (true, r),
        None => (false, text),
    };
    let (mant, exp) = match rest.find(['e', 'E']) {
        Some(i) => (&rest[..i], rest[i + 1..].parse::<i32>().ok()?),
        None => (rest, 0),
    };
    let (int, frac) = mant.split_once('.').unwrap_or((mant, ""));
    if int.is_empty() || !int.bytes().chain(frac.bytes()).all(|b| b.is_ascii_digit()) {
        return None;
    }
    let all = format!("{int}{frac}");
    let digits = all.trim_start_matches('0');
    // The magnitude is digits × 10^shift units.
    let shift = i64::from(exp) - frac.len() as i64 + i64::from(places);
    let (floor, exact) = if digits.is_empty() {
        (0, true)
    } else if shift >= 0 {
        if digits.len() as i64 + shift > 32 {
            (CLAMP, true)
        } else {
            (
                digits.parse::<i128>().ok()? * 10i128.pow(shift as u32),
                true,
            )
        }
    } else {
        let keep = digits.len() as i64 + shift;
        if keep <= 0 {
            (0, false)
        } else if keep > 32 {
            (CLAMP, true)
        } else {
            let (whole, cut) = digits.split_at(keep as usize);
            (whole.parse::<i128>().ok()?, cut.bytes().all(|c| c == b'0'))
        }
    };
    let ceil = floor + i128::from(!exact);
    Some(if neg { (-ceil, -floor) } else { (floor, ceil) })
}

/// The digits of a number read so far.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Digits {
    /// It began with `-`.
    neg: bool,
    /// Integer digits read.
    int: u8,
    /// Fraction digits read, once `.` was.
    frac: Option<u8>,
    /// Every digit read, as one integer (saturating; exact while bounded: at most 30 digits).
    value: u128,
}

impl Digits {
    /// Integer digits a number of `r` may have.
    fn int_room(&self, r: Range) -> u8 {
        if r.places == 0 {
            // An integer's 18 characters, its sign included, always fit an i64.
            MAX_INTEGER_LEN - u8::from(self.neg)
        } else {
            BOUNDED_INT_DIGITS
        }
    }

    /// Its value in `r`'s units, as it stands (complete).
    fn units(&self, r: Range) -> i128 {
        let scale = 10i128.pow(u32::from(r.places - self.frac.unwrap_or(0)));
        let v = self.value as i128 * scale;
        if self.neg {
            -v
        } else {
            v
        }
    }

    /// Whether a number begun so can still end within `r`: the values its endings can take
    /// form one run of `r`'s units per count of integer digits, and it can end within `r`
    /// when one of those runs meets `lo..=hi` (`-0` is not written for an integer).
    fn can_end_within(&self, r: Range) -> bool {
        let unit = |e: u32| 10i128.pow(e);
        let places = u32::from(r.places);
        let meets = |a: i128, b: i128| {
            let (a, b) = if self.neg { (-b, -a) } else { (a, b) };
            r.meets(a, b)
        };
        let v = self.value as i128;
        if let Some(m) = self.frac {
            let step = unit(places - u32::from(m));
            return meets(v * step, v * step + step - 1);
        }
        let room = u32::from(self.int_room(r));
        if self.int == 0 {
            // Only `-` so far.
            let least = i128::from(r.places == 0);
            return meets(least, unit(room + places) - 1);
        }
        if v == 0 {
            // `0` or `-0`: no more integer digits.
            return !(self.neg && r.places == 0) && meets(0, unit(places) - 1);
        }
        // With `l` integer digits in all, it lies in v·10^(l−int) units of 10^0, and any
        // fraction after them.
        for l in u32::from(self.int)..=room {
            let step = unit(l - u32::from(self.int) + places);
            if meets(v * step, v * step + step - 1) {
                return true;
            }
        }
        false
    }
}

fn err(at: &str, reason: impl Into<String>) -> SchemaError {
    SchemaError {
        at: at.to_owned(),
        reason: reason.into(),
    }
}

impl Compiler<'_> {
    fn push(&mut self, n: Node, at: &str) -> Result<usize, SchemaError> {
        if self.nodes.len() >= MAX_NODES {
            return Err(err(at, format!("more than {MAX_NODES} schema nodes")));
        }
        self.nodes.push(n);
        Ok(self.nodes.len() - 1)
    }

    fn node(&mut self, s: &Value, at: &str) -> Result<usize, SchemaError> {
        if self.depth >= MAX_SCHEMA_DEPTH {
            return Err(err(
                at,
                format!("schemas nested (or `$ref`s chained) more than {MAX_SCHEMA_DEPTH} deep"),
            ));
        }
        self.depth += 1;
        let r = self.node_inner(s, at);
        self.depth -= 1;
        r
    }

    fn node_inner(&mut self, s: &Value, at: &str) -> Result<usize, SchemaError> {
        let Some(o) = s.as_object() else {
            return Err(err(at, "a schema must be an object"));
        };
        if let Some(r) = o.get("$ref") {
            let r = r
                .as_str()
                .ok_or_else(|| err(at, "`$ref` must be a string"))?;
            return self.reference(r, at);
        }
        // `allOf` of one schema beside annotations only (as pydantic wraps a `$ref` that has a
        // description): that schema. Of several (or beside other keywords): one schema of them
        // all, when they can be merged.
        if let Some(all) = o.get("allOf") {
            match all.as_array().map(Vec::as_slice) {
                Some([one])
                    if o.keys()
                        .all(|k| k == "allOf" || ANNOTATIONS.contains(&k.as_str())) =>
                {
                    return self.node(one, &format!("{at}/allOf/0"));
                }
                Some(members) if !members.is_empty() => {
                    let merged = self.merge_all_of(o, members, at)?;
                    return self.node(&merged, at);
                }
                _ => return Err(err(at, "`allOf` must be a non-empty array")),
            }
        }
        for (k, _) in o {
            let known = ANNOTATIONS.contains(&k.as_str())
                || matches!(
                    k.as_str(),
                    "type"
                        | "properties"
                        | "required"
                        | "additionalProperties"
                        | "items"
                        | "prefixItems"
                        | "additionalItems"
                        | "uniqueItems"
                        | "minItems"
                        | "maxItems"
                        | "minProperties"
                        | "maxProperties"
                        | "propertyNames"
                        | "patternProperties"
                        | "minLength"
                        | "maxLength"
                        | "pattern"
                        | "format"
                        | "minimum"
                        | "maximum"
                        | "exclusiveMinimum"
                        | "exclusiveMaximum"
                        | "multipleOf"
                        | "enum"
                        | "const"
                        | "anyOf"
                        | "oneOf"
                        | "discriminator"
                        | "$defs"
                        | "definitions"
                );
            if !known {
                return Err(err(
                    at,
                    format!("`{k}` is not supported (the output could not be held to it)"),
                ));
            }
        }
        // These hold a typed value; beside `enum`, `const` or `anyOf` they would go unenforced.
        let held = [
            "pattern",
            "format",
            "minimum",
            "maximum",
            "exclusiveMinimum",
            "exclusiveMaximum",
            "multipleOf",
        ];
        if let Some(k) = held.iter().find(|k| o.contains_key(**k)) {
            if let Some(with) = ["enum", "const", "anyOf", "oneOf"]
                .iter()
                .find(|w| o.contains_key(**w))
            {
                return Err(err(
                    at,
                    format!("`{k}` beside `{with}` is not supported (put it in a typed schema)"),
                ));
            }
        }
        if let Some(alts) = o.get("anyOf").or_else(|| o.get("oneOf")) {
            let alts = alts
                .as_array()
                .filter(|a| !a.is_empty())
                .ok_or_else(|| err(at, "`anyOf` / `oneOf` must be a non-empty array"))?;
            let mut ids = Vec::new();
            for (i, a) in alts.iter().enumerate() {
                ids.push(self.node(a, &format!("{at}/anyOf/{i}"))?);
            }
            let tag = match o.get("discriminator") {
                None => None,
                Some(d) => Some(
                    d.get("propertyName")
                        .and_then(Value::as_str)
                        .ok_or_else(|| err(at, "`discriminator` needs a string `propertyName`"))?,
                ),
            };
            let ids = self.tag_objects(ids, tag, at)?;
            let alike = if o.contains_key("anyOf") {
                Alike::Runs
            } else {
                Alike::Refused
            };
            return self.either(ids, alike, at);
        }
        if o.contains_key("discriminator") {
            return Err(err(at, "`discriminator` goes with `anyOf` / `oneOf`"));
        }
        if let Some(v) = o.get("const") {
            return self.constants(std::slice::from_ref(v), at);
        }
        if let Some(v) = o.get("enum") {
            let vs = v
                .as_array()
                .filter(|a| !a.is_empty())
                .ok_or_else(|| err(at, "`enum` must be a non-empty array"))?;
            return self.constants(vs, at);
        }
        let types: Vec<&str> = match o.get("type") {
            Some(Value::String(t)) => vec![t.as_str()],
            Some(Value::Array(ts)) => ts
                .iter()
                .map(|t| t.as_str().ok_or_else(|| err(at, "`type` entries must be strings")))
                .collect::<Result<_, _>>()?,
            Some(_) => return Err(err(at, "`type` must be a string or an array of strings")),
            // `{}` (annotations at most): any JSON value, as JSON Schema means (pydantic's `Any`).
            None if o.keys().all(|k| {
                ANNOTATIONS.contains(&k.as_str()) || k == "$defs" || k == "definitions"
            }) =>
            {
                return self.any_value(at)
            }
            None => {
                return Err(err(
                    at,
                    "a `type` (or `enum`, `const`, `anyOf`, `$ref`) is required beside these keywords: an untyped value cannot be held to them",
                ))
            }
        };
        for (keys, tys, what) in [
            (&held[..2], &["string"][..], "`string`"),
            (
                &held[2..],
                &["integer", "number"][..],
                "`integer` and `number`",
            ),
        ] {
            if let Some(k) = keys.iter().find(|k| o.contains_key(**k)) {
                if !types.iter().any(|t| tys.contains(t)) {
                    return Err(err(at, format!("`{k}` is held only on {what} values")));
                }
            }
        }
        let mut ids = Vec::new();
        for t in types {
            let n = match t {
                "string" => {
                    let (min, max) = (
                        bound(o, "minLength", 0, at)?,
                        bound(o, "maxLength", u32::MAX, at)?,
                    );
                    if min > max {
                        return Err(err(at, "`minLength` is more than `maxLength`"));
                    }
                    let pattern = self.pattern(o, min, max, at)?;
                    self.push(Node::String { min, max, pattern }, at)?
                }
                "number" | "integer" => {
                    let integer = t == "integer";
                    let range = range(o, integer, at)?;
                    self.push(Node::Number { integer, range }, at)?
                }
                "boolean" => {
                    self.push(Node::Const(vec![b"true".to_vec(), b"false".to_vec()]), at)?
                }
                "null" => self.push(Node::Const(vec![b"null".to_vec()]), at)?,
                "array" => self.array(o, at)?,
                "object" => self.object(o, at)?,
                other => return Err(err(at, format!("unknown type `{other}`"))),
            };
            ids.push(n);
        }
        if ids.len() == 1 {
            Ok(ids[0])
        } else {
            // `["integer", "number"]`: any of them, as `anyOf`.
            self.either(ids, Alike::Runs, at)
        }
    }

    /// The pattern of a string of `min..=max` characters (`pattern` or `format`), as an index
    /// into the patterns, or [`NO_PATTERN`].
    fn pattern(
        &mut self,
        o: &serde_json::Map<String, Value>,
        min: u32,
        max: u32,
        at: &str,
    ) -> Result<u16, SchemaError> {
        let used: usize = self.patterns.iter().map(TextPattern::states).sum();
        let budget = MAX_PATTERN_STATES.saturating_sub(used);
        let text = |key: &str| {
            o.get(key)
                .map(|v| {
                    v.as_str()
                        .ok_or_else(|| err(at, format!("`{key}` must be a string")))
                })
                .transpose()
        };
        let p = match (text("pattern")?, text("format")?) {
            (None, None) => return Ok(NO_PATTERN),
            (Some(p), None) => TextPattern::search(p, min, max, budget),
            (None, Some(f)) => TextPattern::format(f, min, max, budget),
            // Both: the strings each holds (an email of one domain, a date of one year).
            (Some(p), Some(f)) => TextPattern::search(p, min, max, budget).and_then(|p| {
                let f = TextPattern::format(f, min, max, budget)?;
                let both = TextPattern::intersect(&p, &f, budget)?;
                if both.fits(0, 0, max) {
                    Ok(both)
                } else {
                    Err(format!("`pattern` with `format`: no string of at most {max} characters matches both"))
                }
            }),
        };
        let p = p.map_err(|e| {
            if budget < MAX_PATTERN_STATES && e.contains("automaton states") {
                err(
                    at,
                    format!("{e}; the schema's patterns may have {MAX_PATTERN_STATES} in all"),
                )
            } else {
                err(at, e)
            }
        })?;
        self.patterns.push(p);
        Ok((self.patterns.len() - 1) as u16)
    }

    fn object(
        &mut self,
        o: &serde_json::Map<String, Value>,
        at: &str,
    ) -> Result<usize, SchemaError> {
        let props = match o.get("properties") {
            None => serde_json::Map::new(),
            Some(Value::Object(p)) => p.clone(),
            Some(_) => return Err(err(at, "`properties` must be an object")),
        };
        let extra = match o.get("additionalProperties") {
            None | Some(Value::Bool(false)) => None,
            Some(Value::Bool(true)) => Some(None),
            Some(s @ Value::Object(_)) => Some(Some(s)),
            Some(_) => {
                return Err(err(
                    at,
                    "`additionalProperties` must be a boolean or a schema",
                ))
            }
        };
        let closed = o.get("additionalProperties") == Some(&Value::Bool(false));
        let keyed = o.contains_key("patternProperties") || o.contains_key("propertyNames");
        // Listed properties and others (`extra="allow"`) go on as an object below.
        let beside_listed = !props.is_empty() && extra.is_some() && !keyed;
        if !beside_listed
            && (extra.is_some()
                || o.contains_key("patternProperties")
                || (o.contains_key("propertyNames") && !closed))
        {
            return self.map(o, !props.is_empty(), extra, at);
        }
        if o.contains_key("propertyNames") {
            return Err(err(
                at,
                "`propertyNames` beside `additionalProperties: false` is not supported",
            ));
        }
        if let Some(k) = ["minProperties", "maxProperties"]
            .iter()
            .find(|k| o.contains_key(**k))
        {
            return Err(err(
                at,
                format!("`{k}` is held only on an object of `additionalProperties` (its listed properties are written as `required` says)"),
            ));
        }
        let mut required = Vec::new();
        if let Some(req) = o.get("required") {
            let req = req
                .as_array()
                .ok_or_else(|| err(at, "`required` must be an array"))?;
            for r in req {
                let name = r
                    .as_str()
                    .ok_or_else(|| err(at, "`required` entries must be strings"))?;
                if !props.contains_key(name) {
                    return Err(err(
                        at,
                        format!("required property {name:?} is not in `properties`"),
                    ));
                }
                required.push(name.to_string());
            }
        }
        let slot = self.push(Node::Pending, at)?;
        let mut list = Vec::new();
        let mut optional_run = 0;
        for (name, s) in &props {
            let key = serde_json::to_vec(&Value::String(name.clone()))
                .map_err(|e| err(at, e.to_string()))?;
            let child = self.node(s, &format!("{at}/properties/{name}"))?;
            let required = required.contains(name);
            optional_run = if required { 0 } else { optional_run + 1 };
            if optional_run > MAX_OPTIONAL_RUN {
                return Err(err(
                    at,
                    format!(
                        "more than {MAX_OPTIONAL_RUN} optional properties in a row (list some in `required`)"
                    ),
                ));
            }
            list.push(Prop {
                key,
                node: child,
                required,
            });
        }
        let extra = match extra {
            Some(_) if list.len() > 64 => {
                return Err(err(
                    at,
                    "`additionalProperties` beside more than 64 `properties` is not supported",
                ))
            }
            Some(Some(s)) => Some(self.node(s, &format!("{at}/additionalProperties"))?),
            Some(None) => Some(self.any_value(at)?),
            None => None,
        };
        self.nodes[slot] = Node::Object { props: list, extra };
        Ok(slot)
    }

    /// The one schema that `allOf`'s `members` and the keywords beside it (`o`) describe
    /// together: each member's `$ref`s followed, their keywords side by side — JSON Schema's
    /// keywords constrain independently, so a value valid under the union of the keyword sets
    /// is valid under every member — where a keyword in several must have one value, except
    /// `properties` (a property in several is the `allOf` of its schemas, merged in turn),
    /// `required` (every member's) and `additionalProperties: false` (the properties are then
    /// those every such member lists). Alternatives, constants, tuples and dicts do not merge:
    /// refused, as are keywords that differ (an `allOf` of an integer and a string describes
    /// nothing).
    fn merge_all_of(
        &self,
        o: &serde_json::Map<String, Value>,
        members: &[Value],
        at: &str,
    ) -> Result<Value, SchemaError> {
        let mut list: Vec<(String, &serde_json::Map<String, Value>)> = Vec::new();
        let beside: serde_json::Map<String, Value> = o
            .iter()
            .filter(|(k, _)| k.as_str() != "allOf")
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        list.push((at.to_owned(), &beside));
        for (i, m) in members.iter().enumerate() {
            let place = format!("{at}/allOf/{i}");
            let mut m = m;
            // A member that is a `$ref` (a chain of them): its target.
            for _ in 0..MAX_SCHEMA_DEPTH {
                let Some(r) = m.get("$ref").and_then(Value::as_str) else {
                    break;
                };
                m = r
                    .strip_prefix('#')
                    .filter(|_| r.starts_with("#/"))
                    .and_then(|p| self.root.pointer(p))
                    .ok_or_else(|| {
                        err(
                            &place,
                            format!("`$ref` {r:?} is not a local reference this schema has"),
                        )
                    })?;
            }
            let m = m
                .as_object()
                .ok_or_else(|| err(&place, "a schema must be an object"))?;
            if m.contains_key("$ref") || m.contains_key("allOf") {
                return Err(err(
                    &place,
                    "an `allOf` member with its own `$ref` or `allOf` beside other keywords is not merged",
                ));
            }
            list.push((place, m));
        }
        let mut out = serde_json::Map::new();
        let mut props = serde_json::Map::new();
        let mut required: Vec<Value> = Vec::new();
        // The properties of each member that allows no others.
        let mut closed: Vec<Vec<String>> = Vec::new();
        let mut constraining = 0;
        for (place, m) in &list {
            if m.keys().any(|k| !ANNOTATIONS.contains(&k.as_str())) {
                constraining += 1;
            }
            for (k, v) in m.iter() {
                match k.as_str() {
                    "properties" => {
                        let p = v
                            .as_object()
                            .ok_or_else(|| err(place, "`properties` must be an object"))?;
                        for (name, s) in p {
                            let merged = match props.get(name) {
                                Some(prev) if prev != s => json_all_of(prev, s),
                                _ => s.clone(),
                            };
                            props.insert(name.clone(), merged);
                        }
                    }
                    "required" => {
                        for r in v
                            .as_array()
                            .ok_or_else(|| err(place, "`required` must be an array"))?
                        {
                            if !required.contains(r) {
                                required.push(r.clone());
                            }
                        }
                    }
                    "additionalProperties" => {
                        match v {
                            Value::Bool(false) => closed.push(
                                m.get("properties")
                                    .and_then(Value::as_object)
                                    .map(|p| p.keys().cloned().collect())
                                    .unwrap_or_default(),
                            ),
                            Value::Bool(true) => {}
                            _ => return Err(err(
                                place,
                                "`additionalProperties` as a schema in an `allOf` is not merged",
                            )),
                        }
                    }
                    "anyOf" | "oneOf" | "enum" | "const" | "prefixItems" | "discriminator" => {
                        return Err(err(
                            place,
                            format!("`{k}` in an `allOf` of several schemas is not merged"),
                        ))
                    }
                    "$defs" | "definitions" => {}
                    _ if ANNOTATIONS.contains(&k.as_str()) => {
                        out.entry(k.clone()).or_insert_with(|| v.clone());
                    }
                    // Bounds: the tighter one holds both.
                    "minimum" | "exclusiveMinimum" | "minLength" | "minItems" | "minProperties"
                    | "maximum" | "exclusiveMaximum" | "maxLength" | "maxItems"
                    | "maxProperties"
                        if out.get(k).is_some_and(Value::is_number) && v.is_number() =>
                    {
                        let lower = k.starts_with("min") || k == "exclusiveMinimum";
                        let prev = out.get(k).cloned().unwrap_or(Value::Null);
                        let Some(order) = exact_order(&prev, v) else {
                            return Err(err(
                                place,
                                format!("`{k}` differs between the `allOf` members by less than a float can tell"),
                            ));
                        };
                        let tighter = if lower {
                            order == std::cmp::Ordering::Greater
                        } else {
                            order == std::cmp::Ordering::Less
                        };
                        if tighter {
                            out.insert(k.clone(), v.clone());
                        }
                    }
                    _ => match out.get(k) {
                        Some(prev) if prev != v => {
                            return Err(err(
                                place,
                                format!(
                                "`{k}` differs between the `allOf` members: no value meets both"
                            ),
                            ))
                        }
                        _ => {
                            out.insert(k.clone(), v.clone());
                        }
                    },
                }
            }
        }
        if constraining == 0 {
            return Err(err(at, "an `allOf` of annotations only describes no type"));
        }
        for keep in &closed {
            props.retain(|name, _| keep.contains(name));
        }
        if let Some(r) = required
            .iter()
            .find(|r| !r.as_str().is_some_and(|r| props.contains_key(r)))
        {
            return Err(err(
                at,
                format!(
                    "required property {r} is not among the properties every `allOf` member allows"
                ),
            ));
        }
        if !props.is_empty() || !required.is_empty() || !closed.is_empty() {
            out.entry("type".to_owned())
                .or_insert_with(|| Value::String("object".into()));
            out.insert("properties".into(), Value::Object(props));
            out.insert("required".into(), Value::Array(required));
        }
        Ok(Value::Object(out))
    }

    /// An object of keys of the model's choice (`additionalProperties` true or a schema, with
    /// no `properties`): `minProperties` at most 1 (keys cannot be held distinct, and a
    /// repeated key is one property once parsed), `maxProperties`.
    fn map(
        &mut self,
        o: &serde_json::Map<String, Value>,
        listed: bool,
        extra: Option<Option<&Value>>,
        at: &str,
    ) -> Result<usize, SchemaError> {
        if listed {
            return Err(err(
                at,
                "keys of the model's choice (`additionalProperties`, `patternProperties`, `propertyNames`) beside listed `properties` are not supported (such a key could repeat a listed one); list every property, or use them alone (a `dict`)",
            ));
        }
        if o.get("required")
            .and_then(Value::as_array)
            .is_some_and(|r| !r.is_empty())
        {
            return Err(err(
                at,
                "`required` keys of an `additionalProperties` object are not supported: list them in `properties`",
            ));
        }
        let (min, mut max) = (
            bound(o, "minProperties", 0, at)?,
            bound(o, "maxProperties", u32::MAX, at)?,
        );
        if min > max {
            return Err(err(at, "`minProperties` is more than `maxProperties`"));
        }
        // The keys' schema: `propertyNames` (a string schema; its `type` may go unsaid), and
        // the one pattern of `patternProperties`, both held.
        let names = match o.get("propertyNames") {
            None => None,
            Some(Value::Object(n)) => {
                let mut n = n.clone();
                let typed = ["type", "enum", "const", "$ref", "anyOf", "oneOf", "allOf"]
                    .iter()
                    .any(|k| n.contains_key(*k));
                if !typed {
                    n.insert("type".into(), Value::String("string".into()));
                }
                Some(Value::Object(n))
            }
            Some(_) => return Err(err(at, "`propertyNames` must be a schema")),
        };
        let (key_schema, value_schema, value_at) = match o.get("patternProperties") {
            None => (
                names,
                extra.flatten().cloned(),
                format!("{at}/additionalProperties"),
            ),
            Some(Value::Object(pp)) if pp.len() == 1 => {
                if extra.is_some() {
                    return Err(err(
                        at,
                        "`additionalProperties` beside `patternProperties` is not supported (keys that match and keys that do not would need telling apart)",
                    ));
                }
                let Some((pattern, value)) = pp.iter().next() else {
                    return Err(err(at, "`patternProperties` has no pattern"));
                };
                let by_pattern = serde_json::json!({"type": "string", "pattern": pattern});
                let key = match names {
                    Some(n) => serde_json::json!({"allOf": [by_pattern, n]}),
                    None => by_pattern,
                };
                (
                    Some(key),
                    Some(value.clone()),
                    format!("{at}/patternProperties"),
                )
            }
            Some(_) => {
                return Err(err(
                    at,
                    "`patternProperties` of more than one pattern is not supported",
                ))
            }
        };
        let slot = self.push(Node::Pending, at)?;
        let key = match key_schema {
            None => None,
            Some(k) => {
                let place = format!("{at}/propertyNames");
                let n = self.node(&k, &place)?;
                let mut firsts = [false; 256];
                first_bytes(&self.nodes, n, &mut firsts, 0);
                if firsts
                    .iter()
                    .enumerate()
                    .any(|(b, &f)| f && b != usize::from(b'"'))
                {
                    return Err(err(&place, "`propertyNames` must describe strings"));
                }
                Some(n)
            }
        };
        // Keys of a `Const` node are held distinct; others cannot be.
        match key.map(|k| &self.nodes[resolve(&self.nodes, k)]) {
            Some(Node::Const(texts)) => {
                max = at_most(min, max, texts.len(), at, |n| {
                    format!("`minProperties` {min} is more than the {n} keys `propertyNames` allows")
                })?;
            }
            _ if min > 1 => {
                return Err(err(
                    at,
                    "`minProperties` above 1 is not supported unless `propertyNames` is an `enum`: keys of the model's choice cannot be held distinct, and a repeated key is one property",
                ))
            }
            _ => {}
        }
        let value = match value_schema {
            Some(s) => self.node(&s, &value_at)?,
            None => self.any_value(at)?,
        };
        self.nodes[slot] = Node::Map {
            value,
            key,
            min,
            max,
        };
        Ok(slot)
    }

    /// The node of any JSON value: a string, a number, `true`, `false`, `null`, an array of
    /// them or an object of them (nesting bounded as JSON mode's).
    fn any_value(&mut self, at: &str) -> Result<usize, SchemaError> {
        if let Some(n) = self.any {
            return Ok(n);
        }
        let slot = self.push(Node::Pending, at)?;
        self.any = Some(slot);
        let alts = vec![
            self.push(
                Node::String {
                    min: 0,
                    max: u32::MAX,
                    pattern: NO_PATTERN,
                },
                at,
            )?,
            self.push(
                Node::Number {
                    integer: false,
                    range: None,
                },
                at,
            )?,
            self.push(
                Node::Const(vec![b"true".to_vec(), b"false".to_vec(), b"null".to_vec()]),
                at,
            )?,
            self.push(
                Node::Array {
                    items: slot,
                    min: 0,
                    max: u32::MAX,
                    prefix: Vec::new(),
                    unique: false,
                },
                at,
            )?,
            self.push(
                Node::Map {
                    value: slot,
                    key: None,
                    min: 0,
                    max: u32::MAX,
                },
                at,
            )?,
        ];
        self.nodes[slot] = Node::Either(alts);
        Ok(slot)
    }

    /// An array: `items` (a schema), or a tuple — `prefixItems` (or draft 7's `items` as a
    /// list) for the first items in turn, then `items` (draft 7: `additionalItems`) for the
    /// rest: a schema, `false` (no more), or absent (any JSON value).
    fn array(
        &mut self,
        o: &serde_json::Map<String, Value>,
        at: &str,
    ) -> Result<usize, SchemaError> {
        let (min, mut max) = (
            bound(o, "minItems", 0, at)?,
            bound(o, "maxItems", u32::MAX, at)?,
        );
        if min > max {
            return Err(err(at, "`minItems` is more than `maxItems`"));
        }
        let (list, list_at, rest, rest_key) = match (o.get("prefixItems"), o.get("items")) {
            (Some(p), items) => (Some(p), "prefixItems", items, "items"),
            (None, Some(Value::Array(_))) => (
                o.get("items"),
                "items",
                o.get("additionalItems"),
                "additionalItems",
            ),
            (None, Some(items)) => (None, "", Some(items), "items"),
            (None, None) => return Err(err(at, "an `array` needs `items` or `prefixItems`")),
        };
        if list.is_none() && o.contains_key("additionalItems") {
            return Err(err(at, "`additionalItems` goes with a list of `items`"));
        }
        let slot = self.push(Node::Pending, at)?;
        let mut prefix = Vec::new();
        if let Some(list) = list {
            let list = list
                .as_array()
                .ok_or_else(|| err(at, format!("`{list_at}` must be an array of schemas")))?;
            for (i, s) in list.iter().enumerate() {
                prefix.push(self.node(s, &format!("{at}/{list_at}/{i}"))?);
            }
        }
        let items = match rest {
            Some(Value::Bool(false)) => {
                max = at_most(min, max, prefix.len(), at, |n| {
                    format!(
                        "`minItems` {min} is more than the {n} items `{rest_key}: false` allows"
                    )
                })?;
                // Never read: no item comes after the prefix.
                self.any_value(at)?
            }
            None | Some(Value::Bool(true)) if list.is_some() => self.any_value(at)?,
            Some(s) => self.node(s, &format!("{at}/{rest_key}"))?,
            None => return Err(err(at, "an `array` needs `items`")),
        };
        let unique = match o.get("uniqueItems") {
            None | Some(Value::Bool(false)) => false,
            Some(Value::Bool(true)) => {
                let Node::Const(texts) = &self.nodes[resolve(&self.nodes, items)] else {
                    return Err(err(
                        at,
                        "`uniqueItems` is held only on an array of `enum` / `const` values (pydantic's `set[SomeEnum]`): strings or numbers of the model's choice cannot be held distinct",
                    ));
                };
                if !prefix.is_empty() {
                    return Err(err(at, "`uniqueItems` on a tuple is not supported"));
                }
                if texts
                    .iter()
                    .enumerate()
                    .any(|(i, t)| texts[..i].contains(t))
                {
                    return Err(err(at, "`uniqueItems` over an `enum` that repeats a value"));
                }
                max = at_most(min, max, texts.len(), at, |n| {
                    format!(
                        "`minItems` {min} is more than the {n} distinct values of `uniqueItems`"
                    )
                })?;
                true
            }
            Some(_) => return Err(err(at, "`uniqueItems` must be a boolean")),
        };
        self.nodes[slot] = Node::Array {
            items,
            min,
            max,
            prefix,
            unique,
        };
        Ok(slot)
    }

    fn constants(&mut self, vs: &[Value], at: &str) -> Result<usize, SchemaError> {
        let mut texts = Vec::new();
        for v in vs {
            match v {
                // A number is written as serde_json writes it (`1`, `-2`, `2.5`).
                Value::String(_) | Value::Bool(_) | Value::Null | Value::Number(_) => {
                    let t = serde_json::to_vec(v).map_err(|e| err(at, e.to_string()))?;
                    if !texts.contains(&t) {
                        texts.push(t);
                    }
                }
                _ => {
                    return Err(err(
                        at,
                        "`enum` / `const` values must be strings, numbers, booleans or null",
                    ))
                }
            }
        }
        if texts.len() > 64 {
            return Err(err(at, "an `enum` of more than 64 values"));
        }
        self.push(Node::Const(texts), at)
    }

    /// Replaces the object alternatives of `alts` by one [`Node::Tagged`] when there are
    /// several and they form a tagged union on `tag` (else on their first property that can
    /// tag them); leaves them as they are when they cannot be tagged, unless `tag` was named.
    fn tag_objects(
        &mut self,
        alts: Vec<usize>,
        tag: Option<&str>,
        at: &str,
    ) -> Result<Vec<usize>, SchemaError> {
        // A `$ref` is a one-alternative `Either` in front of its target.
        let resolve = |n: usize| resolve(&self.nodes, n);
        let objects: Vec<usize> = alts
            .iter()
            .copied()
            .filter(|&a| matches!(self.nodes[resolve(a)], Node::Object { extra: None, .. }))
            .collect();
        let props = |n: usize| match &self.nodes[resolve(n)] {
            Node::Object { props, .. } => props.as_slice(),
            _ => &[],
        };
        // The text of property `key` of object `n` when it is one string constant.
        let tag_text = |n: usize, key: &[u8]| -> Option<Vec<u8>> {
            let v = props(n).iter().find(|p| p.key == key)?.node;
            match &self.nodes[resolve(v)] {
                Node::Const(t) if t.len() == 1 && t[0].first() == Some(&b'"') => Some(t[0].clone()),
                _ => None,
            }
        };
        let keys: Vec<Vec<u8>> = match (tag, objects.first()) {
            (Some(t), _) => vec![serde_json::to_vec(t).map_err(|e| err(at, e.to_string()))?],
            (None, Some(&first)) => props(first).iter().map(|p| p.key.clone()).collect(),
            (None, None) => Vec::new(),
        };
        let mut found = None;
        if objects.len() >= 2 && objects.len() <= 64 {
            for key in keys {
                let texts: Option<Vec<Vec<u8>>> =
                    objects.iter().map(|&o| tag_text(o, &key)).collect();
                if let Some(texts) = texts {
                    let distinct = texts
                        .iter()
                        .enumerate()
                        .all(|(i, t)| !texts[..i].contains(t));
                    if distinct {
                        found = Some((key, texts));
                        break;
                    }
                }
            }
        }
        let Some((key, texts)) = found else {
            return match tag {
                Some(t) => Err(err(
                    at,
                    format!(
                        "discriminator {t:?}: the alternatives must be 2 to 64 objects, each with a string `const` {t:?} of its own"
                    ),
                )),
                None => Ok(alts),
            };
        };
        // Each alternative again, its tag property first.
        let lists: Vec<Vec<Prop>> = objects
            .iter()
            .map(|&o| {
                let mut list = props(o).to_vec();
                if let Some(i) = list.iter().position(|p| p.key == key) {
                    let mut p = list.remove(i);
                    // Written first, always: it says which alternative follows.
                    p.required = true;
                    list.insert(0, p);
                }
                list
            })
            .collect();
        let mut tagged = Vec::new();
        for list in lists {
            tagged.push(self.push(
                Node::Object {
                    props: list,
                    extra: None,
                },
                at,
            )?);
        }
        let tag_node = self.push(Node::Const(texts), at)?;
        let union = self.push(
            Node::Tagged {
                head: vec![Prop {
                    key,
                    node: tag_node,
                    required: true,
                }],
                alts: tagged,
            },
            at,
        )?;
        let mut out = vec![union];
        out.extend(alts.into_iter().filter(|a| !objects.contains(a)));
        Ok(out)
    }

    /// Alternatives; those that can begin with the same byte are read side by side (`anyOf`:
    /// [`Alike::Runs`]) or refused (`oneOf`, which a text both match would break).
    fn either(&mut self, alts: Vec<usize>, alike: Alike, at: &str) -> Result<usize, SchemaError> {
        let mut seen = [false; 256];
        let mut overlap = false;
        for &a in &alts {
            let mut firsts = [false; 256];
            first_bytes(&self.nodes, a, &mut firsts, 0);
            for (b, f) in firsts.iter().enumerate() {
                if *f && std::mem::replace(&mut seen[b], true) {
                    if alike == Alike::Refused {
                        return Err(err(
                            at,
                            format!(
                                "`oneOf` alternatives that can begin with the same character {:?} cannot be told apart (`anyOf` can hold them)",
                                b as u8 as char
                            ),
                        ));
                    }
                    overlap = true;
                }
            }
        }
        let n = self.push(Node::Either(alts), at)?;
        if overlap {
            self.unions.push((n, at.to_owned()));
        }
        Ok(n)
    }

    fn reference(&mut self, r: &str, at: &str) -> Result<usize, SchemaError> {
        if let Some(&n) = self.refs.get(r) {
            return Ok(n);
        }
        let target = r
            .strip_prefix('#')
            .and_then(|p| self.root.pointer(p))
            .filter(|_| r.starts_with("#/"))
            .ok_or_else(|| {
                err(
                    at,
                    format!("`$ref` {r:?} is not a local reference this schema has"),
                )
            })?;
        // Reserve the node first so that a recursive reference points at it.
        let slot = self.push(Node::Pending, at)?;
        self.refs.insert(r.to_owned(), slot);
        let n = self.node(target, &r[1..])?;
        self.nodes[slot] = Node::Either(vec![n]);
        Ok(slot)
    }
}

/// `{"allOf": [a, b]}`, flattening `a` when it is such an `allOf` already (a property listed
/// in several `allOf` members).
fn json_all_of(a: &Value, b: &Value) -> Value {
    let mut members = match a.get("allOf").and_then(Value::as_array) {
        Some(m) if a.as_object().is_some_and(|o| o.len() == 1) => m.clone(),
        _ => vec![a.clone()],
    };
    members.push(b.clone());
    serde_json::json!({ "allOf": members })
}

/// How JSON number `b` compares with `a`, exactly: as integers when both are, else as the
/// floats serde_json read them as; `None` when the floats are equal but the numbers may not be
/// (an integer beyond 2^53 beside a float).
fn exact_order(a: &Value, b: &Value) -> Option<std::cmp::Ordering> {
    let int = |v: &Value| {
        v.as_i64()
            .map(i128::from)
            .or_else(|| v.as_u64().map(i128::from))
    };
    if let (Some(x), Some(y)) = (int(a), int(b)) {
        return Some(y.cmp(&x));
    }
    let (x, y) = (a.as_f64()?, b.as_f64()?);
    match y.partial_cmp(&x)? {
        std::cmp::Ordering::Equal => {
            let exact = |v: &Value| int(v).is_none_or(|i| i.unsigned_abs() <= 1 << 53);
            (exact(a) && exact(b)).then_some(std::cmp::Ordering::Equal)
        }
        order => Some(order),
    }
}

/// A count bound `max` lowered to `n`, the most there can be (distinct values, a tuple's
/// places); refused with `why(n)` when `min` is above it.
fn at_most(
    min: u32,
    max: u32,
    n: usize,
    at: &str,
    why: impl FnOnce(u32) -> String,
) -> Result<u32, SchemaError> {
    let n = u32::try_from(n).unwrap_or(u32::MAX);
    if min > n {
        return Err(err(at, why(n)));
    }
    Ok(max.min(n))
}

/// Node `n` past the one-alternative `Either`s that stand for `$ref`s.
fn resolve(nodes: &[Node], mut n: usize) -> usize {
    for _ in 0..MAX_SCHEMA_DEPTH {
        match &nodes[n] {
            Node::Either(one) if one.len() == 1 => n = one[0],
            _ => break,
        }
    }
    n
}

/// What alternatives that can begin with the same byte mean.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Alike {
    /// Each is read in a run of its own until the text tells them apart (`anyOf`: the text
    /// matches at least one).
    Runs,
    /// Refused (`oneOf`: a text that matched two would match none of its meaning).
    Refused,
}

/// For each node (its first bytes in `firsts`, as `CompiledSchema::firsts` keeps them), the most
/// runs ([`SchemaJson`]) its value can keep open at once: one, but for
/// an `Either`, the sum over its alternatives that can begin with one byte (each starts a run
/// of its own, and its own nested ones), the largest over bytes. A container holds one value
/// open at a time, and the runs of a value that ended are one again (they reach the same
/// state), so an object's or array's is its largest child's. Found as the least fixed point,
/// each node capped at `MAX_RUNS + 1` (recursion through such an `anyOf` grows to the cap): a
/// node whose bound grew puts its parents back on the work list, so each node is looked at
/// most `MAX_RUNS + 1` times per child.
fn run_bounds(nodes: &[Node], firsts: &[[u64; 4]]) -> Vec<usize> {
    let children = |n: &Node| -> Vec<usize> {
        match n {
            Node::Array { items, prefix, .. } => prefix
                .iter()
                .copied()
                .chain(std::iter::once(*items))
                .collect(),
            Node::Object { props, extra } => props.iter().map(|p| p.node).chain(*extra).collect(),
            Node::Tagged { head, alts } => head
                .iter()
                .map(|p| p.node)
                .chain(alts.iter().copied())
                .collect(),
            Node::Either(alts) => alts.clone(),
            Node::Map { value, key, .. } => std::iter::once(*value).chain(*key).collect(),
            Node::String { .. } | Node::Number { .. } | Node::Const(_) | Node::Pending => {
                Vec::new()
            }
        }
    };
    let mut parents = vec![Vec::new(); nodes.len()];
    for (n, node) in nodes.iter().enumerate() {
        for c in children(node) {
            parents[c].push(n);
        }
    }
    let begins = |n: usize, b: usize| firsts[n][b / 64] & (1 << (b % 64)) != 0;
    let mut runs = vec![1usize; nodes.len()];
    let mut queued = vec![true; nodes.len()];
    let mut work: std::collections::VecDeque<usize> = (0..nodes.len()).collect();
    while let Some(n) = work.pop_front() {
        queued[n] = false;
        let v = match &nodes[n] {
            Node::Either(alts) => (0..256)
                .map(|b| {
                    alts.iter()
                        .filter(|&&a| begins(a, b))
                        .map(|&a| runs[a])
                        .sum::<usize>()
                })
                .max()
                .unwrap_or(1),
            other => children(other)
                .into_iter()
                .map(|c| runs[c])
                .max()
                .unwrap_or(1),
        }
        .clamp(1, MAX_RUNS + 1);
        if v > runs[n] {
            runs[n] = v;
            for &p in &parents[n] {
                if !std::mem::replace(&mut queued[p], true) {
                    work.push_back(p);
                }
            }
        }
    }
    runs
}

/// Where a `Const` node's value stands once `read` bytes matched the texts `alive`, one of
/// which ended there when `ended`: the value is complete unless a longer text is still alive
/// (strings end with their quote and words differ, so only numbers are prefixes of others).
fn const_mode(texts: &[Vec<u8>], node: usize, alive: u64, read: usize, ended: bool) -> Mode {
    let longer = texts
        .iter()
        .enumerate()
        .take(64)
        .any(|(i, t)| alive & (1 << i) != 0 && t.len() > read);
    match (ended, longer) {
        (true, false) => Mode::After,
        (complete, _) => Mode::InConst {
            node,
            alive,
            read,
            complete,
        },
    }
}

/// The candidates for the next key among `rest` (the properties not written yet): the optional
/// ones up to and including the first required one, as a mask over `rest` (at most 64:
/// the compiler bounds runs of optional properties).
fn candidates(rest: &[Prop]) -> u64 {
    let mut mask = 0u64;
    for (k, p) in rest.iter().enumerate().take(64) {
        mask |= 1 << k;
        if p.required {
            break;
        }
    }
    mask
}

/// The bytes a value of node `n` may begin with.
fn first_bytes(nodes: &[Node], n: usize, out: &mut [bool; 256], depth: usize) {
    if depth > 64 {
        return;
    }
    match &nodes[n] {
        Node::String { .. } => out[b'"' as usize] = true,
        Node::Number { .. } => {
            out[b'-' as usize] = true;
            for d in b'0'..=b'9' {
                out[d as usize] = true;
            }
        }
        Node::Const(ts) => {
            for t in ts {
                out[t[0] as usize] = true;
            }
        }
        Node::Array { .. } => out[b'[' as usize] = true,
        Node::Object { .. } | Node::Tagged { .. } | Node::Map { .. } => out[b'{' as usize] = true,
        Node::Either(alts) => {
            for &a in alts {
                first_bytes(nodes, a, out, depth + 1);
            }
        }
        Node::Pending => {}
    }
}

/// An open container of the text.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Frame {
    /// An object of node `node` whose property `next` comes next.
    Object { node: usize, next: usize },
    /// An array of node `node`, `count` items begun; of a `unique` one, the texts of its
    /// items' `Const` node written so far (a bit per text).
    Array { node: usize, count: u32, used: u64 },
    /// A map of node `node`, `count` entries begun; `in_key` while a key of its key node is
    /// read; of a map whose keys are a `Const` node's texts, those written so far (a bit each).
    Map {
        node: usize,
        count: u32,
        used: u64,
        in_key: bool,
    },
}

/// Where the automaton is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    /// A value of `node` (whitespace first).
    Value { node: usize },
    /// After `[`: `]` or the first item.
    ArrayOpen,
    /// After an array item: `,` or `]`.
    AfterItem,
    /// In an object, after `{` (`first`) or after a property: the next key (after `,` unless
    /// `first`), or `}` when no required property is left.
    BeforeKey { first: bool },
    /// After `,` in an object: a key must come.
    AfterComma,
    /// Reading the key of the innermost object's next property: of the candidates (bit `k`:
    /// property `next + k`, the optional ones that may be skipped and the required one after
    /// them), those still possible, and how many bytes were read.
    Key { read: usize, alive: u64 },
    /// After a key: `:`.
    Colon,
    /// Reading a key of the model's choice in an object with listed properties: which listed
    /// keys' texts the bytes so far still equal (none may be written whole), `read` bytes.
    /// Such a key is written without escapes, so its bytes are its text.
    ExtraKey { at: Str, read: usize, alive: u64 },
    /// After such a key: `:`.
    ExtraColon,
    /// After a map's `{` (`first`) or after `,` in it: a key's `"` (or, when `first`, `}`).
    MapKeyStart { first: bool },
    /// In a map's key.
    MapKey { at: Str },
    /// After a map's key: `:`.
    MapColon,
    /// After a map's value: `,` or `}`.
    AfterEntry,
    /// In a string value: `len` characters written, `min..=max` allowed; its pattern's index
    /// (or [`NO_PATTERN`]) and the pattern's state over the bytes decoded so far.
    InStr {
        at: Str,
        len: u32,
        min: u32,
        max: u32,
        pat: u16,
        ps: u16,
    },
    /// In a number of node `node`: `len` characters, its digits `d` (for its range).
    InNum {
        at: Num,
        len: u8,
        node: usize,
        d: Digits,
    },
    /// In one of the texts of a `Const` node: which are still possible (a bit mask over its
    /// texts, at most 64) and how many bytes were read; `complete`: one of them was read to its
    /// end and a longer one is still possible (numbers: `1` and `12`), so a byte that continues
    /// none of them ends the value.
    InConst {
        node: usize,
        alive: u64,
        read: usize,
        complete: bool,
    },
    /// The value of the innermost container (or the root) is complete.
    After,
    /// The root value is complete.
    Done,
}

/// Most runs a schema's automaton keeps at once: readings of the answer that differ in the
/// alternative they took at an `anyOf` whose alternatives begin alike, and are all still
/// possible. A schema that could need more is refused when it is compiled.
pub(crate) const MAX_RUNS: usize = 16;

/// A schema's automaton over the bytes of the answer: the runs still alive, each one reading
/// of the text (one, unless the alternatives of an `anyOf` that begin alike are still open:
/// then one per alternative that the bytes so far fit). A byte may come next when it may in
/// one of them; runs that reach the same state are one again.
#[derive(Clone, Debug)]
pub(crate) struct SchemaJson {
    first: Run,
    more: Vec<Run>,
}

impl SchemaJson {
    pub(crate) fn new(s: &CompiledSchema) -> SchemaJson {
        SchemaJson {
            first: Run {
                stack: smallvec::SmallVec::new(),
                mode: Mode::Value { node: s.root },
                ws: 0,
            },
            more: Vec::new(),
        }
    }

    fn runs(&self) -> impl Iterator<Item = &Run> {
        std::iter::once(&self.first).chain(&self.more)
    }

    pub(crate) fn is_complete(&self) -> bool {
        self.runs().any(|r| r.mode == Mode::Done)
    }

    /// Inside a string between characters: how many more it may take (`None` elsewhere); of
    /// several runs, the most any of them in such a string may take (every whole character
    /// within that is allowed by that run).
    pub(crate) fn plain_string_room(&self) -> Option<u32> {
        self.runs().filter_map(Run::plain_string_room).max()
    }

    /// Inside a string held to a pattern, between characters, with one run: the pattern, its
    /// state, and how many more characters the string may take.
    pub(crate) fn plain_pattern<'s>(
        &self,
        s: &'s CompiledSchema,
    ) -> Option<(&'s TextPattern, u16, u32)> {
        if self.more.is_empty() {
            self.first.plain_pattern(s)
        } else {
            None
        }
    }

    /// Whether `bytes` may come next (no change): in some run, or in a run one starts.
    pub(crate) fn accepts(&self, s: &CompiledSchema, bytes: &[u8]) -> bool {
        self.runs().any(|r| r.clone().accepts(s, bytes))
    }

    /// Reads one byte; `false` (the state then is unspecified: call on a copy) when it may not
    /// come next in any run.
    pub(crate) fn step(&mut self, s: &CompiledSchema, c: u8) -> bool {
        let mut forks = Vec::new();
        let mut alive = Vec::new();
        if self.more.is_empty() {
            let ok = self.first.step(s, c, &mut forks);
            if forks.is_empty() {
                return ok;
            }
            if ok {
                alive.push(self.first.clone());
            }
        } else {
            let more = std::mem::take(&mut self.more);
            for mut r in std::iter::once(self.first.clone()).chain(more) {
                if r.step(s, c, &mut forks) {
                    alive.push(r);
                }
            }
        }
        alive.append(&mut forks);
        let mut runs: Vec<Run> = Vec::with_capacity(alive.len());
        for r in alive {
            if !runs.contains(&r) {
                runs.push(r);
            }
        }
        // The compiler bounds the runs a schema can need by `MAX_RUNS`; should more ever be
        // alive, those kept are still readings of the text, so what is written stays valid.
        runs.truncate(MAX_RUNS);
        let mut runs = runs.into_iter();
        match runs.next() {
            Some(first) => {
                self.first = first;
                self.more = runs.collect();
                true
            }
            None => false,
        }
    }
}

/// One reading of the answer: the automaton's state along one choice of alternative at each
/// `anyOf` whose alternatives begin alike.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Run {
    /// The open containers, innermost last (inline up to 6: cloned for every token the mask
    /// tries).
    stack: smallvec::SmallVec<[Frame; 6]>,
    mode: Mode,
    ws: u8,
}

impl Run {
    /// Whether `bytes` may come next in this run or in one it starts on the way (each followed
    /// on its own: no merging, which only saves work over many bytes).
    fn accepts(mut self, s: &CompiledSchema, bytes: &[u8]) -> bool {
        for (i, &c) in bytes.iter().enumerate() {
            let mut forks = Vec::new();
            let ok = self.step(s, c, &mut forks);
            if forks.into_iter().any(|f| f.accepts(s, &bytes[i + 1..])) {
                return true;
            }
            if !ok {
                return false;
            }
        }
        true
    }

    /// Inside a string between characters: how many more it may take (`None` elsewhere).
    fn plain_string_room(&self) -> Option<u32> {
        match self.mode {
            Mode::InStr {
                at: Str::Plain,
                len,
                max,
                pat: NO_PATTERN,
                ..
            } => Some(max - len),
            Mode::MapKey { at: Str::Plain } => Some(u32::MAX),
            _ => None,
        }
    }

    /// Inside a string held to a pattern, between characters: the pattern, its state, and how
    /// many more characters the string may take.
    fn plain_pattern<'s>(&self, s: &'s CompiledSchema) -> Option<(&'s TextPattern, u16, u32)> {
        match self.mode {
            Mode::InStr {
                at: Str::Plain,
                pat,
                ps,
                len,
                max,
                ..
            } if pat != NO_PATTERN => Some((s.patterns.get(usize::from(pat))?, ps, max - len)),
            _ => None,
        }
    }

    /// Reads one byte; `false` (the state then is unspecified) when it may not come next. The
    /// runs that an `anyOf` whose alternatives begin alike starts besides this one, each past
    /// `c`, go to `forks`.
    fn step(&mut self, s: &CompiledSchema, c: u8, forks: &mut Vec<Run>) -> bool {
        let between = matches!(
            self.mode,
            Mode::Value { .. }
                | Mode::ArrayOpen
                | Mode::AfterItem
                | Mode::BeforeKey { .. }
                | Mode::AfterComma
                | Mode::Colon
                | Mode::ExtraColon
                | Mode::MapKeyStart { .. }
                | Mode::MapColon
                | Mode::AfterEntry
                | Mode::After
                | Mode::Done
        );
        if between && is_ws(c) {
            if self.mode == Mode::Done {
                return true;
            }
            if self.ws >= MAX_WS_RUN {
                return false;
            }
            self.ws += 1;
            return true;
        }
        if let Mode::InNum { at, len, node, d } = self.mode {
            let Node::Number { integer, range } = s.nodes[node] else {
                return false;
            };
            let next = at
                .step(c)
                .filter(|n| !integer || matches!(n, Num::Zero | Num::Int));
            if let Some(next) = next {
                // An integer's at most 18 characters always fit an i64.
                let max = if integer {
                    MAX_INTEGER_LEN
                } else {
                    MAX_NUMBER_LEN
                };
                if len >= max {
                    return false;
                }
                let mut d = d;
                match c {
                    b'0'..=b'9' => {
                        d.value = d
                            .value
                            .saturating_mul(10)
                            .saturating_add(u128::from(c - b'0'));
                        match &mut d.frac {
                            Some(f) => *f = f.saturating_add(1),
                            None => d.int = d.int.saturating_add(1),
                        }
                    }
                    b'.' => d.frac = Some(0),
                    _ => {}
                }
                if let Some(r) = range {
                    // A bounded number: no exponent, its digits within what it may have.
                    let fits = matches!(next, Num::Zero | Num::Int | Num::Dot | Num::Frac)
                        && d.int <= d.int_room(r)
                        && d.frac.is_none_or(|f| f <= r.places)
                        && d.can_end_within(r);
                    if !fits {
                        return false;
                    }
                }
                self.mode = Mode::InNum {
                    at: next,
                    len: len + 1,
                    node,
                    d,
                };
                return true;
            }
            if !at.complete() {
                return false;
            }
            if range.is_some_and(|r| !r.holds(d.units(r))) {
                return false;
            }
            self.mode = Mode::After;
            return self.step(s, c, forks);
        }
        self.ws = 0;
        match self.mode {
            Mode::Value { node } => self.value(s, node, c, forks),
            Mode::ArrayOpen | Mode::AfterItem => {
                let open = self.mode == Mode::ArrayOpen;
                let Some(Frame::Array { node, count, .. }) = self.stack.last_mut() else {
                    return false;
                };
                let Node::Array {
                    items,
                    min,
                    max,
                    ref prefix,
                    ..
                } = s.nodes[*node]
                else {
                    return false;
                };
                // The node of item `i` (from 0).
                let item = |i: u32| prefix.get(i as usize).copied().unwrap_or(items);
                match c {
                    b']' => *count >= min && self.close(),
                    // The first item, or `,` and the next one, while fewer than `max`.
                    _ if open && max > 0 => {
                        *count = 1;
                        self.value(s, item(0), c, forks)
                    }
                    b',' if !open && *count < max => {
                        self.mode = Mode::Value { node: item(*count) };
                        *count += 1;
                        true
                    }
                    _ => false,
                }
            }
            Mode::BeforeKey { first } => {
                let Some(&Frame::Object { node, next }) = self.stack.last() else {
                    return false;
                };
                let Some(props) = s.props(node) else {
                    return false;
                };
                if c == b'}' {
                    return props[next..].iter().all(|p| !p.required) && self.close();
                }
                if next == props.len()
                    && !matches!(s.nodes[node], Node::Object { extra: Some(_), .. })
                {
                    return false;
                }
                if !first {
                    // The separator before every key but the first.
                    if c == b',' {
                        self.mode = Mode::AfterComma;
                        return true;
                    }
                    return false;
                }
                self.key_start(s, c, forks)
            }
            Mode::AfterComma => self.key_start(s, c, forks),
            Mode::ExtraKey { at, read, alive } => {
                let Some(&Frame::Object { node, .. }) = self.stack.last() else {
                    return false;
                };
                let Some(props) = s.props(node) else {
                    return false;
                };
                if c == b'\\' {
                    return false;
                }
                let mut still = 0u64;
                for (k, p) in props.iter().enumerate().take(64) {
                    if alive & (1 << k) != 0 && p.key.get(read) == Some(&c) {
                        still |= 1 << k;
                    }
                }
                match string_step(at, c) {
                    // The closing quote: not the text of a listed key.
                    Some(None) => {
                        let listed = props
                            .iter()
                            .enumerate()
                            .take(64)
                            .any(|(k, p)| still & (1 << k) != 0 && p.key.len() == read + 1);
                        if listed {
                            return false;
                        }
                        // The listed properties are behind: only such keys may follow.
                        if let Some(Frame::Object { next, .. }) = self.stack.last_mut() {
                            *next = props.len();
                        }
                        self.mode = Mode::ExtraColon;
                        true
                    }
                    Some(Some(at)) => {
                        self.mode = Mode::ExtraKey {
                            at,
                            read: read + 1,
                            alive: still,
                        };
                        true
                    }
                    None => false,
                }
            }
            Mode::ExtraColon => {
                let Some(&Frame::Object { node, .. }) = self.stack.last() else {
                    return false;
                };
                let Node::Object {
                    extra: Some(value), ..
                } = s.nodes[node]
                else {
                    return false;
                };
                if c != b':' {
                    return false;
                }
                self.mode = Mode::Value { node: value };
                true
            }
            Mode::Key { read, alive } => {
                let Some(Frame::Object { node, next }) = self.stack.last_mut() else {
                    return false;
                };
                let Some(props) = s.props(*node) else {
                    return false;
                };
                let mut still = 0u64;
                let mut ended = None;
                for (k, p) in props[*next..].iter().enumerate().take(64) {
                    if alive & (1 << k) != 0 && p.key.get(read) == Some(&c) {
                        still |= 1 << k;
                        if p.key.len() == read + 1 {
                            ended = Some(k);
                        }
                    }
                }
                if still == 0 {
                    return false;
                }
                // No key is a proper prefix of another (each ends with its quote).
                self.mode = match ended {
                    Some(k) => {
                        *next += k;
                        Mode::Colon
                    }
                    None => Mode::Key {
                        read: read + 1,
                        alive: still,
                    },
                };
                true
            }
            Mode::Colon => {
                if c != b':' {
                    return false;
                }
                let Some(Frame::Object { node, next }) = self.stack.last_mut() else {
                    return false;
                };
                let Some(props) = s.props(*node) else {
                    return false;
                };
                let child = props[*next].node;
                *next += 1;
                self.mode = Mode::Value { node: child };
                true
            }
            Mode::InStr {
                at,
                len,
                min,
                max,
                pat,
                ps,
            } => match string_step(at, c) {
                Some(None) => {
                    self.mode = Mode::After;
                    len >= min && (pat == NO_PATTERN || s.patterns[usize::from(pat)].ends(ps))
                }
                Some(Some(next)) => {
                    // The pattern reads the string's decoded bytes: a plain byte as it is, an
                    // escape's at its second byte; `\u` escapes are not written in such strings.
                    // A character begins with a byte read between characters.
                    let chars = match at {
                        Str::Plain if len >= max => return false,
                        Str::Plain => len + 1,
                        _ => len,
                    };
                    let ps = if pat == NO_PATTERN {
                        ps
                    } else {
                        let pattern = &s.patterns[usize::from(pat)];
                        let decoded = match (at, c) {
                            // An escape only where one of the characters it may stand for can
                            // come next, and the string can still end within `max` after it.
                            (Str::Plain, b'\\') => {
                                if !ESCAPED.iter().any(|&e| {
                                    pattern
                                        .step(ps, e)
                                        .is_some_and(|n| pattern.fits(n, chars, max))
                                }) {
                                    return false;
                                }
                                None
                            }
                            (Str::Escape, b'u') => return false,
                            (Str::Escape, b'b') => Some(0x08),
                            (Str::Escape, b'f') => Some(0x0c),
                            (Str::Escape, b'n') => Some(b'\n'),
                            (Str::Escape, b'r') => Some(b'\r'),
                            (Str::Escape, b't') => Some(b'\t'),
                            // `\"`, `\\`, `\/`, plain bytes and UTF-8's continuation bytes.
                            _ => Some(c),
                        };
                        match decoded {
                            None => ps,
                            // The string must still be able to end within `max` characters
                            // (the pattern's own states hold that unless a long `maxLength`
                            // kept it from being crossed with the count).
                            Some(d) => match pattern.step(ps, d) {
                                Some(n) if pattern.fits(n, chars, max) => n,
                                _ => return false,
                            },
                        }
                    };
                    let len = chars;
                    self.mode = Mode::InStr {
                        at: next,
                        len,
                        min,
                        max,
                        pat,
                        ps,
                    };
                    true
                }
                None => false,
            },
            Mode::InConst {
                node,
                alive,
                read,
                complete,
            } => {
                let Node::Const(texts) = &s.nodes[node] else {
                    return false;
                };
                let mut still = 0u64;
                let mut ended = None;
                for (i, t) in texts.iter().enumerate().take(64) {
                    if alive & (1 << i) != 0 && t.get(read) == Some(&c) {
                        still |= 1 << i;
                        if t.len() == read + 1 {
                            ended = Some(i);
                        }
                    }
                }
                if still == 0 {
                    // A number read to its end, and this byte is what follows it.
                    if complete {
                        self.mode = Mode::After;
                        self.mark_used(s, node, alive, read);
                        return self.step(s, c, forks);
                    }
                    return false;
                }
                // The tag of a tagged union: the rest of the object is the chosen alternative.
                if let (Some(i), Some(Frame::Object { node: f, next: 1 })) =
                    (ended, self.stack.last_mut())
                {
                    if let Node::Tagged { head, alts } = &s.nodes[*f] {
                        if head[0].node == node {
                            *f = alts[i];
                        }
                    }
                }
                self.mode = const_mode(texts, node, still, read + 1, ended.is_some());
                if self.mode == Mode::After {
                    self.mark_used(s, node, still, read + 1);
                }
                true
            }
            Mode::MapKeyStart { first } => {
                let Some(Frame::Map {
                    node,
                    count,
                    in_key,
                    ..
                }) = self.stack.last_mut()
                else {
                    return false;
                };
                let Node::Map { min, max, key, .. } = s.nodes[*node] else {
                    return false;
                };
                match (c, key) {
                    (b'}', _) if first => *count >= min && self.close(),
                    (b'"', None) if *count < max => {
                        self.mode = Mode::MapKey { at: Str::Plain };
                        true
                    }
                    // A key of the key node, read as a value of it; `Mode::After` then
                    // expects the colon.
                    (b'"', Some(k)) if *count < max => {
                        *in_key = true;
                        self.value(s, k, c, forks)
                    }
                    _ => false,
                }
            }
            Mode::MapKey { at } => match string_step(at, c) {
                Some(None) => {
                    self.mode = Mode::MapColon;
                    true
                }
                Some(Some(next)) => {
                    self.mode = Mode::MapKey { at: next };
                    true
                }
                None => false,
            },
            Mode::MapColon => {
                if c != b':' {
                    return false;
                }
                let Some(Frame::Map { node, count, .. }) = self.stack.last_mut() else {
                    return false;
                };
                let Node::Map { value, .. } = s.nodes[*node] else {
                    return false;
                };
                *count += 1;
                self.mode = Mode::Value { node: value };
                true
            }
            Mode::AfterEntry => {
                let Some(&Frame::Map { node, count, .. }) = self.stack.last() else {
                    return false;
                };
                let Node::Map { min, max, .. } = s.nodes[node] else {
                    return false;
                };
                match c {
                    b'}' => count >= min && self.close(),
                    b',' if count < max => {
                        self.mode = Mode::MapKeyStart { first: false };
                        true
                    }
                    _ => false,
                }
            }
            Mode::After => match self.stack.last_mut() {
                None => false,
                Some(Frame::Map { in_key: true, .. }) => {
                    if let Some(Frame::Map { in_key, .. }) = self.stack.last_mut() {
                        *in_key = false;
                    }
                    self.mode = Mode::MapColon;
                    self.step(s, c, forks)
                }
                Some(Frame::Map { .. }) => {
                    self.mode = Mode::AfterEntry;
                    self.step(s, c, forks)
                }
                Some(Frame::Array { .. }) => {
                    self.mode = Mode::AfterItem;
                    self.step(s, c, forks)
                }
                Some(Frame::Object { .. }) => {
                    self.mode = Mode::BeforeKey { first: false };
                    self.step(s, c, forks)
                }
            },
            Mode::InNum { .. } | Mode::Done => false,
        }
    }

    /// The first byte `c` of a value of `node`.
    fn value(&mut self, s: &CompiledSchema, node: usize, c: u8, forks: &mut Vec<Run>) -> bool {
        match &s.nodes[node] {
            Node::Either(alts) => {
                let fits = |a: usize| s.begins(a, c);
                let mut fitting = alts.iter().copied().filter(|&a| fits(a));
                let Some(one) = fitting.next() else {
                    return false;
                };
                let mut others = fitting.peekable();
                if others.peek().is_none() {
                    return self.value(s, one, c, forks);
                }
                // Alternatives that begin alike: a run for each that takes `c`.
                let mut taken: Option<Run> = None;
                for a in std::iter::once(one).chain(others) {
                    let mut r = self.clone();
                    if r.value(s, a, c, forks) {
                        match taken {
                            None => taken = Some(r),
                            Some(_) => forks.push(r),
                        }
                    }
                }
                match taken {
                    Some(r) => {
                        *self = r;
                        true
                    }
                    None => false,
                }
            }
            Node::String { min, max, pattern } => {
                self.mode = Mode::InStr {
                    at: Str::Plain,
                    len: 0,
                    min: *min,
                    max: *max,
                    pat: *pattern,
                    ps: 0,
                };
                c == b'"'
            }
            Node::Number { range, .. } => {
                let at = match c {
                    b'-' => Num::Minus,
                    b'0' => Num::Zero,
                    b'1'..=b'9' => Num::Int,
                    _ => return false,
                };
                let neg = c == b'-';
                let d = Digits {
                    neg,
                    int: u8::from(!neg),
                    frac: None,
                    value: if neg { 0 } else { u128::from(c - b'0') },
                };
                if range.is_some_and(|r| !d.can_end_within(r)) {
                    return false;
                }
                self.mode = Mode::InNum {
                    at,
                    len: 1,
                    node,
                    d,
                };
                true
            }
            Node::Const(texts) => {
                let mut alive = 0u64;
                for (i, t) in texts.iter().enumerate().take(64) {
                    if t[0] == c {
                        alive |= 1 << i;
                    }
                }
                // An item of a `uniqueItems` array, a key of a map: not one it has already.
                alive &= !self.used_here(s);
                if alive == 0 {
                    return false;
                }
                let ended = texts
                    .iter()
                    .enumerate()
                    .take(64)
                    .any(|(i, t)| alive & (1 << i) != 0 && t.len() == 1);
                self.mode = const_mode(texts, node, alive, 1, ended);
                if self.mode == Mode::After {
                    self.mark_used(s, node, alive, 1);
                }
                true
            }
            Node::Array { .. } => {
                if c != b'[' || self.stack.len() >= MAX_DEPTH {
                    return false;
                }
                self.stack.push(Frame::Array {
                    node,
                    count: 0,
                    used: 0,
                });
                self.mode = Mode::ArrayOpen;
                true
            }
            Node::Object { .. } | Node::Tagged { .. } => {
                if c != b'{' || self.stack.len() >= MAX_DEPTH {
                    return false;
                }
                self.stack.push(Frame::Object { node, next: 0 });
                self.mode = Mode::BeforeKey { first: true };
                true
            }
            Node::Map { .. } => {
                if c != b'{' || self.stack.len() >= MAX_DEPTH {
                    return false;
                }
                self.stack.push(Frame::Map {
                    node,
                    count: 0,
                    used: 0,
                    in_key: false,
                });
                self.mode = Mode::MapKeyStart { first: true };
                true
            }
            Node::Pending => false,
        }
    }

    /// The first byte `c` of a key in the innermost object: a listed candidate's and, where the
    /// object takes keys of the model's choice and every listed property left may be skipped,
    /// one of those too (a run of its own, [`Mode::ExtraKey`]; each key's text begins `"`).
    fn key_start(&mut self, s: &CompiledSchema, c: u8, forks: &mut Vec<Run>) -> bool {
        let Some(&Frame::Object { node, next }) = self.stack.last() else {
            return false;
        };
        let Some(props) = s.props(node) else {
            return false;
        };
        let extra = matches!(s.nodes[node], Node::Object { extra: Some(_), .. });
        if extra && c == b'"' && props[next..].iter().all(|p| !p.required) {
            let mut own = self.clone();
            own.mode = Mode::ExtraKey {
                at: Str::Plain,
                read: 1,
                // Every listed key, as each begins with `"` (at most 64: the compiler's bound).
                alive: if props.len() >= 64 {
                    u64::MAX
                } else {
                    (1u64 << props.len()) - 1
                },
            };
            if next == props.len() {
                *self = own;
                return true;
            }
            forks.push(own);
        }
        if next == props.len() {
            return false;
        }
        self.mode = Mode::Key {
            read: 0,
            alive: candidates(&props[next..]),
        };
        self.step(s, c, forks)
    }

    /// The `Const` texts a value begun here may not take: those the innermost array has, when
    /// it is a `uniqueItems` one, or the keys the innermost map has, while a key is read (a
    /// bit each); else none.
    fn used_here(&self, s: &CompiledSchema) -> u64 {
        match self.stack.last() {
            Some(&Frame::Array { node, used, .. })
                if matches!(s.nodes[node], Node::Array { unique: true, .. }) =>
            {
                used
            }
            // A map's keys of a `Const` node (the only node whose texts are marked).
            Some(&Frame::Map {
                used, in_key: true, ..
            }) => used,
            _ => 0,
        }
    }

    /// A value of `Const` node `node` ended after `read` bytes, one of the texts `alive`: in a
    /// `uniqueItems` array, or as a key of a map whose keys are that node, that text is used.
    fn mark_used(&mut self, s: &CompiledSchema, node: usize, alive: u64, read: usize) {
        let Node::Const(texts) = &s.nodes[node] else {
            return;
        };
        let used = match self.stack.last_mut() {
            Some(Frame::Array { node: a, used, .. })
                if matches!(s.nodes[*a], Node::Array { unique: true, .. }) =>
            {
                used
            }
            Some(Frame::Map {
                node: m,
                used,
                in_key: true,
                ..
            }) if matches!(s.nodes[*m], Node::Map { key: Some(k), .. } if resolve(&s.nodes, k) == node) => {
                used
            }
            _ => return,
        };
        if let Some(i) =
            (0..texts.len().min(64)).find(|&i| alive & (1 << i) != 0 && texts[i].len() == read)
        {
            *used |= 1 << i;
        }
    }

    /// Closes the innermost container.
    fn close(&mut self) -> bool {
        self.stack.pop();
        self.mode = if self.stack.is_empty() {
            Mode::Done
        } else {
            Mode::After
        };
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};
    use serde_json::json;

    /// A schema as pydantic writes one: `$defs`, a nullable field (`anyOf` with null), an
    /// enum, an integer, an array of nested objects, a boolean.
    fn person() -> Value {
        json!({
            "title": "Person",
            "type": "object",
            "properties": {
                "name": {"type": "string", "description": "full name"},
                "age": {"type": "integer"},
                "score": {"anyOf": [{"type": "number"}, {"type": "null"}]},
                "role": {"enum": ["admin", "user", "guest"]},
                "pets": {"type": "array", "items": {"$ref": "#/$defs/Pet"}},
                "active": {"type": "boolean"}
            },
            "required": ["name", "age", "score", "role", "pets", "active"],
            "additionalProperties": false,
            "$defs": {
                "Pet": {
                    "type": "object",
                    "properties": {"kind": {"type": "string"}, "legs": {"type": ["integer", "null"]}},
                    "required": ["kind", "legs"],
                    "additionalProperties": false
                }
            }
        })
    }

    fn run_bytes(s: &CompiledSchema, text: &[u8]) -> Option<bool> {
        let mut j = SchemaJson::new(s);
        for &c in text {
            if !j.step(s, c) {
                return None;
            }
        }
        Some(j.is_complete())
    }

    fn run(s: &CompiledSchema, text: &str) -> Option<bool> {
        let mut j = SchemaJson::new(s);
        for &c in text.as_bytes() {
            if !j.step(s, c) {
                return None;
            }
        }
        Some(j.is_complete())
    }

    #[test]
    fn accepts_what_the_schema_describes_and_nothing_else() {
        let s = CompiledSchema::compile(&person()).unwrap();
        let ok = json!({"name": "Ann \"A\" Lee", "age": -3, "score": null, "role": "guest",
            "pets": [{"kind": "cat", "legs": 4}, {"kind": "fish", "legs": null}], "active": true});
        for text in [
            serde_json::to_string(&ok).unwrap(),
            serde_json::to_string_pretty(&ok).unwrap(),
        ] {
            assert_eq!(run(&s, &text), Some(true), "{text}");
        }
        assert_eq!(
            run(
                &s,
                r#"{"name":"x","age":1,"score":2.5e3,"role":"admin","pets":[],"active":false}"#
            ),
            Some(true)
        );
        assert_eq!(run(&s, r#"{"name":"x","age":1"#), Some(false), "a prefix");
        for bad in [
            // another order, a missing property, an extra one
            r#"{"age":1,"name":"x""#,
            r#"{"name":"x","score":null"#,
            r#"{"name":"x","age":1,"score":null,"role":"user","pets":[],"active":true,"x":1}"#,
            // wrong types: a float for an integer, a string for a number, an unknown enum value
            r#"{"name":"x","age":1.5"#,
            r#"{"name":"x","age":1,"score":"2""#,
            r#"{"name":"x","age":1,"score":null,"role":"root""#,
            r#"{"name":"x","age":1,"score":null,"role":"user","pets":[{"kind":"cat","legs":"4"}"#,
            r#"{"name":"x","age":1,"score":null,"role":"user","pets":{}"#,
            r#"[]"#,
            r#""x""#,
        ] {
            assert_eq!(run(&s, bad), None, "{bad}");
        }
    }

    #[test]
    fn schemas_the_automaton_cannot_hold_are_refused_with_the_place() {
        for (schema, at, says) in [
            (
                json!({"type": "object", "properties": {"a": {"type": "string", "pattern": "(?=a)"}}}),
                "/properties/a",
                "`pattern`",
            ),
            (
                json!({"type": "object", "properties": {"d": {"type": "string", "format": "iri"}}}),
                "/properties/d",
                "`format` \"iri\" is not supported",
            ),
            (
                json!({"type": "object", "properties": {"n": {"type": "string", "minimum": 0}}}),
                "/properties/n",
                "held only on `integer` and `number`",
            ),
            (
                json!({"type": "object", "properties": {"n": {"type": "number", "minimum": 1e-13, "maximum": 9e-13}}}),
                "/properties/n",
                "no number that can be written",
            ),
            (
                json!({"type": "object", "properties": {"n": {"allOf": [{"type": "integer"}, {"type": "string"}]}}}),
                "/properties/n/allOf/1",
                "`type` differs between the `allOf` members",
            ),
            (
                json!({"type": "object", "properties": {"n": {"allOf": [{"anyOf": [{"type": "integer"}, {"type": "null"}]}], "minimum": 1}}}),
                "/properties/n/allOf/0",
                "`anyOf` in an `allOf` of several schemas is not merged",
            ),
            (
                json!({"type": "object", "properties": {"o": {"allOf": [
                    {"type": "object", "properties": {"a": {"type": "string"}}, "additionalProperties": false},
                    {"properties": {"b": {"type": "string"}}, "required": ["b"]}]}}}),
                "/properties/o",
                "required property \"b\" is not among the properties every `allOf` member allows",
            ),
            (
                json!({"type": "object", "properties": {"n": {"type": "array", "items": {"type": "integer"}, "uniqueItems": true}}}),
                "/properties/n",
                "`uniqueItems` is held only on an array of `enum`",
            ),
            (
                json!({"type": "object", "properties": {"n": {"type": "array", "items": {"enum": ["a", "b"]}, "uniqueItems": true, "minItems": 3}}}),
                "/properties/n",
                "more than the 2 distinct values",
            ),
            (
                json!({"type": "object", "properties": {"n": {"type": "integer", "multipleOf": 2.5}}}),
                "/properties/n",
                "`multipleOf` must be a positive whole number of 1",
            ),
            (
                json!({"type": "object", "properties": {"n": {"type": "number", "multipleOf": 1e-13}}}),
                "/properties/n",
                "`multipleOf` must be a positive whole number of 10^-12",
            ),
            (
                json!({"type": "object", "properties": {"n": {"type": "integer", "multipleOf": 10, "minimum": 1, "maximum": 9}}}),
                "/properties/n",
                "no integer",
            ),
            (
                json!({"type": "object", "properties": {"n": {"type": "integer", "minimum": 5, "maximum": 4}}}),
                "/properties/n",
                "no integer",
            ),
            (
                json!({"type": "object", "properties": {"e": {"enum": ["a", "b"], "pattern": "a"}}}),
                "/properties/e",
                "beside `enum`",
            ),
            (
                json!({"type": "object", "properties": {"s": {"type": "string", "pattern": "^a", "format": "date"}}}),
                "/properties/s",
                "no string matches",
            ),
            (
                json!({"type": "object", "properties": {"s": {"type": "string", "format": "uuid", "maxLength": 10}}}),
                "/properties/s",
                "no string",
            ),
            (
                json!({"type": "object", "properties": {"a": {"type": "string"}}, "patternProperties": {"^x": {}}}),
                "",
                "beside listed `properties`",
            ),
            (
                json!({"type": "object", "properties": {"m": {"type": "object", "additionalProperties": {"type": "integer"}, "minProperties": 2}}}),
                "/properties/m",
                "`minProperties` above 1",
            ),
            (
                json!({"type": "object", "properties": {"m": {"type": "object", "additionalProperties": true, "required": ["k"]}}}),
                "/properties/m",
                "`required` keys",
            ),
            (
                json!({"type": "object", "properties": {"m": {"type": "object", "additionalProperties": 3}}}),
                "/properties/m",
                "a boolean or a schema",
            ),
            (
                json!({"type": "object", "properties": {"o": {"type": "object", "properties": {"k": {"type": "null"}}, "maxProperties": 1}}}),
                "/properties/o",
                "`maxProperties` is held only",
            ),
            (json!({"type": "string"}), "", "root must be an object"),
            (
                json!({"type": "object", "properties": {"a": {"properties": {}}}}),
                "/properties/a",
                "`type`",
            ),
            (
                json!({"type": "object", "properties": {"a": {"enum": [{"x": 1}]}}}),
                "/properties/a",
                "strings, numbers, booleans or null",
            ),
            (
                json!({"type": "object", "properties": {"a": {"oneOf": [{"type": "string"}, {"enum": ["x"]}]}}}),
                "/properties/a",
                "cannot be told apart (`anyOf` can hold them)",
            ),
            (
                json!({"type": "object", "properties": {"a": {"$ref": "#/$defs/Nope"}}}),
                "/properties/a",
                "local reference",
            ),
            (
                json!({"type": "object", "required": ["b"], "properties": {}}),
                "",
                "not in `properties`",
            ),
            (
                json!({"type": "object", "properties": {"a": {"$ref": "#/$defs/x"}},
                    "$defs": {"x": {"$ref": "#/$defs/y"}, "y": {"$ref": "#/$defs/x"}}}),
                "",
                "cycle",
            ),
        ] {
            let e = CompiledSchema::compile(&schema).unwrap_err();
            assert_eq!(e.at, at, "{schema}: {e}");
            assert!(e.reason.contains(says), "{schema}: {e}");
        }
    }

    /// Deep schemas and long `$ref` chains are refused, not a stack overflow.
    #[test]
    fn depth_is_bounded() {
        let mut deep = json!({"type": "string"});
        for _ in 0..100 {
            deep = json!({"type": "object", "properties": {"a": deep}});
        }
        let e = CompiledSchema::compile(&deep).unwrap_err();
        assert!(e.reason.contains("nested"), "{e}");
        let mut defs = serde_json::Map::new();
        for i in 0..5000 {
            defs.insert(
                format!("d{i}"),
                json!({"$ref": format!("#/$defs/d{}", i + 1)}),
            );
        }
        defs.insert("d5000".into(), json!({"type": "object"}));
        let chain = json!({"$ref": "#/$defs/d0", "$defs": defs});
        let e = CompiledSchema::compile(&chain).unwrap_err();
        assert!(e.reason.contains("chained"), "{e}");
    }

    #[test]
    fn recursive_references_nest() {
        let tree = json!({
            "$ref": "#/$defs/Node",
            "$defs": {"Node": {"type": "object", "properties": {
                "v": {"type": "integer"},
                "kids": {"type": "array", "items": {"$ref": "#/$defs/Node"}}
            }, "required": ["v", "kids"]}}
        });
        let s = CompiledSchema::compile(&tree).unwrap();
        let text = r#"{"v":1,"kids":[{"v":2,"kids":[]},{"v":3,"kids":[{"v":4,"kids":[]}]}]}"#;
        assert_eq!(run(&s, text), Some(true));
        assert_eq!(run(&s, r#"{"v":1,"kids":[{"v":2}]}"#), None);
    }

    /// Random-logit decoding under the schema's mask over a toy vocabulary: every finished
    /// answer parses and has exactly the schema's keys, in order, with values of its types.
    #[test]
    fn masked_decoding_writes_only_what_the_schema_allows() {
        let pieces = [
            "{\"", "\":", "\": ", ", \"", "\"}", "name", "age", "score", "role", "pets", "active",
            "kind", "legs", "null", "true", "false", "admin", "user", "guest", "[{", "}]", "12",
            ".5", "e3", "\"ab", "cat", "\n  ", "é",
        ];
        let answers = masked_answers(&person(), &pieces, 5, 150);
        for v in &answers {
            let keys: Vec<&String> = v.as_object().unwrap().keys().collect();
            assert_eq!(keys, ["name", "age", "score", "role", "pets", "active"]);
            // An integer: serde_json reads `-0` as the float −0.0.
            let int = |x: &Value| x.as_f64().is_some_and(|f| f.fract() == 0.0);
            assert!(v["name"].is_string() && int(&v["age"]) && v["active"].is_boolean());
            assert!(v["score"].is_number() || v["score"].is_null());
            assert!(["admin", "user", "guest"].contains(&v["role"].as_str().unwrap()));
            for p in v["pets"].as_array().unwrap() {
                assert!(
                    p["kind"].is_string() && (int(&p["legs"]) || p["legs"].is_null()),
                    "{v}"
                );
            }
        }
        assert!(
            answers.len() > 20,
            "only {} of 150 runs finished",
            answers.len()
        );
    }

    /// A pydantic discriminated union (`Field(discriminator="pet_type")`), nullable, with the
    /// tag not first in one alternative.
    fn pets() -> Value {
        json!({
            "type": "object",
            "properties": {
                "pet": {
                    "anyOf": [
                        {"oneOf": [{"$ref": "#/$defs/Cat"}, {"$ref": "#/$defs/Dog"}],
                         "discriminator": {"propertyName": "pet_type",
                                           "mapping": {"cat": "#/$defs/Cat", "dog": "#/$defs/Dog"}}},
                        {"type": "null"}
                    ]
                }
            },
            "required": ["pet"],
            "$defs": {
                "Cat": {"type": "object", "properties": {
                    "pet_type": {"const": "cat", "type": "string"}, "meows": {"type": "integer"}},
                    "required": ["pet_type", "meows"]},
                "Dog": {"type": "object", "properties": {
                    "barks": {"type": "number"}, "pet_type": {"enum": ["dog"]}},
                    "required": ["barks", "pet_type"]}
            }
        })
    }

    #[test]
    fn tagged_unions_are_told_apart_by_their_tag() {
        let s = CompiledSchema::compile(&pets()).unwrap();
        for ok in [
            r#"{"pet":{"pet_type":"cat","meows":3}}"#,
            r#"{"pet":{"pet_type":"dog","barks":1.5}}"#,
            r#"{ "pet" : { "pet_type" : "dog" , "barks" : -2 } }"#,
            r#"{"pet":null}"#,
        ] {
            assert_eq!(run(&s, ok), Some(true), "{ok}");
        }
        for bad in [
            r#"{"pet":{"meows":3"#,                    // the tag comes first
            r#"{"pet":{"barks":1"#,                    // also for Dog, whose schema lists it last
            r#"{"pet":{"pet_type":"cat","barks""#,     // Cat's properties after Cat's tag
            r#"{"pet":{"pet_type":"dog","meows""#,     // and Dog's after Dog's
            r#"{"pet":{"pet_type":"bird""#,            // no such alternative
            r#"{"pet":{"pet_type":"cat","meows":1.5"#, // Cat's types
            r#"{"pet":{"pet_type":"cat","meows":3,"x""#,
        ] {
            assert_eq!(run(&s, bad), None, "{bad}");
        }
        // Without a `discriminator`, the first property that tags them does.
        let plain = json!({"type": "object", "properties": {"call": {"anyOf": [
            {"type": "object", "properties": {"name": {"const": "a"}, "arguments": {"type": "object", "properties": {"x": {"type": "integer"}}}}},
            {"type": "object", "properties": {"name": {"const": "b"}, "arguments": {"type": "object", "properties": {}}}}
        ]}}});
        let s = CompiledSchema::compile(&plain).unwrap();
        assert_eq!(
            run(&s, r#"{"call":{"name":"a","arguments":{"x":1}}}"#),
            Some(true)
        );
        assert_eq!(
            run(&s, r#"{"call":{"name":"b","arguments":{}}}"#),
            Some(true)
        );
        assert_eq!(run(&s, r#"{"call":{"name":"b","arguments":{"x""#), None);
        // A discriminator that does not tag the alternatives, or objects that no property tags.
        for (schema, says) in [
            (
                json!({"type": "object", "properties": {"p": {"oneOf": [
                    {"type": "object", "properties": {"k": {"const": "a"}}},
                    {"type": "object", "properties": {"k": {"const": "a"}}}],
                    "discriminator": {"propertyName": "k"}}}}),
                "discriminator \"k\"",
            ),
            (
                json!({"type": "object", "properties": {"p": {"oneOf": [
                    {"type": "object", "properties": {"k": {"type": "string"}}},
                    {"type": "object", "properties": {"j": {"const": "a"}}}]}}}),
                "cannot be told apart",
            ),
            (
                json!({"type": "object", "properties": {"p": {"type": "object", "discriminator": {"propertyName": "k"}}}}),
                "goes with `anyOf`",
            ),
        ] {
            let e = CompiledSchema::compile(&schema).unwrap_err();
            assert!(e.to_string().contains(says), "{e} / {says}");
            assert_eq!(e.at, "/properties/p", "{e}");
        }
    }

    #[test]
    fn masked_decoding_of_a_tagged_union_writes_one_alternative() {
        let pieces = [
            "{\"", "\":", "\"}", "pet", "pet_type", "cat", "dog", "meows", "barks", "null", "12",
            ".5", "}}",
        ];
        let mut kinds = std::collections::BTreeSet::new();
        for v in masked_answers(&pets(), &pieces, 9, 200) {
            let pet = &v["pet"];
            let keys =
                |p: &Value| -> Vec<String> { p.as_object().unwrap().keys().cloned().collect() };
            let kind = match pet["pet_type"].as_str() {
                None => {
                    assert!(pet.is_null(), "{v}");
                    "null"
                }
                Some("cat") => {
                    assert_eq!(keys(pet), ["pet_type", "meows"], "{v}");
                    assert!(pet["meows"].as_f64().is_some_and(|f| f.fract() == 0.0));
                    "cat"
                }
                Some("dog") => {
                    assert_eq!(keys(pet), ["pet_type", "barks"], "{v}");
                    assert!(pet["barks"].is_number());
                    "dog"
                }
                Some(other) => panic!("{other}: {v}"),
            };
            kinds.insert(kind);
        }
        assert_eq!(kinds.len(), 3, "{kinds:?}");
    }

    /// pydantic's `dict[str, int]`, `dict[str, Any]`, `Any` and a bounded `dict[str,
    /// list[float]]`, as it writes them.
    fn dicts() -> Value {
        json!({
            "type": "object",
            "properties": {
                "a": {"type": "object", "additionalProperties": {"type": "integer"}, "title": "A"},
                "b": {"type": "object", "additionalProperties": true},
                "c": {"title": "C"},
                "d": {"type": "object", "additionalProperties": {"type": "array", "items": {"type": "number"}},
                      "maxProperties": 2, "minProperties": 1}
            },
            "required": ["a", "b", "c", "d"]
        })
    }

    /// `additionalProperties` (a schema, or `true`) with no `properties`: keys of the model's
    /// choice, values of the schema (any JSON value for `true`), `maxProperties` and a
    /// `minProperties` of at most 1; `{}`: any JSON value.
    #[test]
    fn dicts_and_any_values() {
        let s = CompiledSchema::compile(&dicts()).unwrap();
        for ok in [
            r#"{"a":{},"b":{},"c":null,"d":{"x":[]}}"#,
            r#"{"a":{"one":1,"two":-2},"b":{"k":[1,{"n":"s\u00e9"}],"t":true},"c":[{},[],"x",1.5e3,false],"d":{"x":[1.5],"y":[]}}"#,
            r#"{ "a" : { "q\"uote" : 3 } , "b" : { } , "c" : { "deep" : { "er" : [ null ] } } , "d" : { "" : [ 0 ] } }"#,
            r#"{"a":{},"b":{},"c":"text","d":{"x":[1,2,3]}}"#,
        ] {
            assert_eq!(run(&s, ok), Some(true), "{ok}");
            serde_json::from_str::<Value>(ok).unwrap();
        }
        for bad in [
            r#"{"a":{"one":1.5},"b":{},"c":1,"d":{"x":[]}}"#,
            r#"{"a":{"one":1,},"b":{},"c":1,"d":{"x":[]}}"#,
            r#"{"a":{one:1},"b":{},"c":1,"d":{"x":[]}}"#,
            r#"{"a":{},"b":{},"c":1,"d":{}}"#,
            r#"{"a":{},"b":{},"c":1,"d":{"x":[],"y":[],"z":[]}}"#,
            r#"{"a":{},"b":{},"c":tru,"d":{"x":[]}}"#,
            r#"{"a":{},"b":{"k":[1,]},"c":1,"d":{"x":[]}}"#,
        ] {
            assert_ne!(run(&s, bad), Some(true), "{bad}");
        }
        assert_eq!(run(&s, r#"{"a":{"one":1.5"#), None);
        assert_eq!(run(&s, r#"{"a":{},"b":{},"c":1,"d":{"x":[],"y":[],"#), None);
        // Nesting in an any-value is bounded as elsewhere.
        let deep = format!(r#"{{"a":{{}},"b":{{}},"c":{}"#, "[".repeat(MAX_DEPTH));
        assert_eq!(run(&s, &deep), None);
        // A dict as a tool's parameters, and beside an object in an `anyOf` (both begin
        // with `{`: two runs).
        let s = CompiledSchema::compile(&json!({"type": "object", "properties": {"v": {"anyOf": [
            {"type": "object", "properties": {"k": {"type": "integer"}}, "required": ["k"]},
            {"type": "object", "additionalProperties": {"type": "string"}}]}}, "required": ["v"]}))
        .unwrap();
        assert_eq!(run(&s, r#"{"v":{"k":1}}"#), Some(true));
        assert_eq!(run(&s, r#"{"v":{"k":"one"}}"#), Some(true));
        assert_eq!(run(&s, r#"{"v":{"j":1}}"#), None);
        assert!(CompiledSchema::compile_calls(&[(
            "f",
            &json!({"type": "object", "additionalProperties": {"type": "integer"}})
        )])
        .is_ok());
    }

    /// Dicts whose keys are held: `propertyNames` (pydantic's `dict[Color, int]`, `dict[Literal[…],
    /// float]`; an enum's keys distinct) and `patternProperties` (`dict[constr(pattern=…), int]`,
    /// with `propertyNames: {"maxLength": …}` beside it).
    #[test]
    fn dict_keys_held_to_a_schema() {
        let schema = json!({"type": "object", "properties": {
            "a": {"type": "object", "additionalProperties": {"type": "integer"}, "propertyNames": {"$ref": "#/$defs/C"}},
            "b": {"type": "object", "additionalProperties": {"type": "number"}, "propertyNames": {"enum": ["x", "y"]}, "minProperties": 2},
            "c": {"type": "object", "patternProperties": {"^[a-z]+$": {"type": "integer"}}, "propertyNames": {"maxLength": 8}}},
            "$defs": {"C": {"enum": ["red", "blue"], "type": "string"}}});
        let s = CompiledSchema::compile(&schema).unwrap();
        for ok in [
            r#"{"a":{}}"#,
            r#"{"a":{"red":1,"blue":2}}"#,
            r#"{"a":{ "blue" : 2 }}"#,
            r#"{"b":{"y":1.5,"x":2}}"#,
            r#"{"c":{"abc":1,"z":2}}"#,
            r#"{"c":{"abcdefgh":1}}"#,
        ] {
            assert_eq!(run(&s, ok), Some(true), "{ok}");
        }
        for bad in [
            r#"{"a":{"green":1}}"#,
            r#"{"a":{"red":1,"red":2}}"#,
            r#"{"a":{"red":1.5}}"#,
            r#"{"b":{"x":1}}"#,
            r#"{"b":{"x":1,"x":2}}"#,
            r#"{"c":{"Abc":1}}"#,
            r#"{"c":{"abcdefghi":1}}"#,
            r#"{"c":{"":1}}"#,
        ] {
            assert_ne!(run(&s, bad), Some(true), "{bad}");
        }
        // A used key cannot begin again, and with both keys written no `,` follows.
        assert_eq!(run(&s, r#"{"a":{"red":1,"r"#), None);
        assert_eq!(run(&s, r#"{"a":{"red":1,"blue":2,"#), None);
        let mut both = 0;
        for v in masked_answers(
            &schema,
            &["{\"", "\":", "red", "blue", "\"x\":", "\"y\":", "abc", "}}"],
            17,
            150,
        ) {
            for key in ["a", "b", "c"] {
                if let Some(m) = v.get(key).and_then(Value::as_object) {
                    if key == "b" {
                        assert!(
                            valid(&Value::Object(m.clone()), &schema["properties"]["b"]),
                            "{v}"
                        );
                    }
                    both += usize::from(m.len() == 2);
                }
            }
            if let Some(a) = v.get("a").and_then(Value::as_object) {
                assert!(a.keys().all(|k| k == "red" || k == "blue"), "{v}");
            }
            if let Some(c) = v.get("c").and_then(Value::as_object) {
                assert!(
                    c.keys()
                        .all(|k| (1..=8).contains(&k.len())
                            && k.bytes().all(|b| b.is_ascii_lowercase())),
                    "{v}"
                );
            }
        }
        assert!(both > 0);
        for (prop, says) in [
            (
                json!({"type": "object", "propertyNames": {"type": "integer"}}),
                "must describe strings",
            ),
            (
                json!({"type": "object", "additionalProperties": true, "propertyNames": {"enum": ["x", "y"]}, "minProperties": 3}),
                "more than the 2 keys",
            ),
            (
                json!({"type": "object", "patternProperties": {"^a": {}, "^b": {}}}),
                "more than one pattern",
            ),
            (
                json!({"type": "object", "patternProperties": {"^a": {}}, "additionalProperties": true}),
                "beside `patternProperties`",
            ),
            (
                json!({"type": "object", "propertyNames": {"maxLength": 3}, "additionalProperties": false}),
                "beside `additionalProperties: false`",
            ),
            (
                json!({"type": "object", "properties": {"k": {}}, "propertyNames": {"maxLength": 3}}),
                "beside listed `properties`",
            ),
        ] {
            let e = CompiledSchema::compile(&json!({"type": "object", "properties": {"m": prop}}))
                .unwrap_err();
            assert!(e.at.starts_with("/properties/m"), "{e}");
            assert!(e.reason.contains(says), "{e} / {says}");
        }
    }

    /// `additionalProperties` beside `properties` (pydantic's `extra="allow"`): the listed
    /// properties in order, then keys of the model's choice that are none of the listed ones.
    #[test]
    fn extra_properties_follow_the_listed_ones() {
        let schema = json!({"type": "object", "properties": {
            "m": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"], "additionalProperties": true},
            "o": {"type": "object", "properties": {"a": {"type": "null"}, "b": {"type": "null"}}, "additionalProperties": {"type": "integer"}}}});
        let s = CompiledSchema::compile(&schema).unwrap();
        for ok in [
            r#"{"m":{"x":1}}"#,
            r#"{"m":{"x":1,"y":"z","w":[1,{"x":2}]}}"#,
            r#"{"m":{"x":1,"xy":2,"":3}}"#,
            r#"{"o":{}}"#,
            r#"{"o":{"c":1}}"#,
            r#"{"o":{"a":null,"c":1,"d":2}}"#,
            r#"{"o":{"aa":1,"b ":2}}"#,
        ] {
            assert_eq!(run(&s, ok), Some(true), "{ok}");
        }
        for bad in [
            r#"{"m":{"x":1,"x":2}}"#,
            r#"{"m":{"y":1}}"#,
            r#"{"m":{"x":1,"\u0078":2}}"#,
            r#"{"o":{"c":1,"a":null}}"#,
            r#"{"o":{"a":1}}"#,
            r#"{"o":{"c":null}}"#,
            r#"{"o":{"b":null,"b":null}}"#,
        ] {
            assert_ne!(run(&s, bad), Some(true), "{bad}");
        }
        // A listed key cannot be closed as an extra one; a longer one can.
        assert_eq!(run(&s, r#"{"m":{"x":1,"x""#), None);
        assert_eq!(run(&s, r#"{"m":{"x":1,"xa""#), Some(false));
        let mut extras = 0;
        for v in masked_answers(
            &schema,
            &["{\"", "\":", "x", "a", "b", "1,", "null", "}}"],
            18,
            200,
        ) {
            assert!(valid(&v, &schema), "{v}");
            for key in ["m", "o"] {
                if let Some(m) = v.get(key).and_then(Value::as_object) {
                    extras += m
                        .keys()
                        .filter(|k| !["x", "a", "b"].contains(&k.as_str()))
                        .count();
                }
            }
        }
        assert!(extras > 0);
        let many: serde_json::Map<String, Value> = (0..65)
            .map(|i| (format!("p{i}"), json!({"type": "null"})))
            .collect();
        let names: Vec<&String> = many.keys().collect();
        let e = CompiledSchema::compile(&json!({"type": "object", "properties": many, "required": names, "additionalProperties": true})).unwrap_err();
        assert!(e.reason.contains("more than 64"), "{e}");
    }

    #[test]
    fn masked_decoding_writes_dicts_and_any_values() {
        let pieces = [
            "{\"", "\":", "\"}", "a", "b", "c", "d", "one", "two", "[1", ".5]", "true", "null",
            "\":{", "}}", "12", "],",
        ];
        let mut saw_entries = 0;
        for v in masked_answers(&dicts(), &pieces, 13, 200) {
            for (_, n) in v["a"].as_object().unwrap() {
                assert!(n.is_i64(), "{v}");
                saw_entries += 1;
            }
            assert!(v["b"].is_object(), "{v}");
            let d = v["d"].as_object().unwrap();
            assert!((1..=2).contains(&d.len()), "{v}");
            assert!(
                d.values()
                    .all(|l| l.as_array().unwrap().iter().all(Value::is_number)),
                "{v}"
            );
        }
        assert!(saw_entries > 0);
    }

    /// Tuples: `prefixItems` (pydantic's `tuple[int, str]`), draft 7's `items` list with
    /// `additionalItems`, and what may follow the listed items.
    #[test]
    fn tuples_hold_each_place() {
        let s = CompiledSchema::compile(&json!({"type": "object", "properties": {
            "a": {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}], "minItems": 2, "maxItems": 2},
            "b": {"type": "array", "items": [{"type": "boolean"}], "additionalItems": {"type": "null"}},
            "c": {"type": "array", "prefixItems": [{"const": "x"}], "maxItems": 3},
            "d": {"type": "array", "prefixItems": [{"type": "integer"}], "items": false}}}))
        .unwrap();
        for ok in [
            r#"{"a":[1,"one"]}"#,
            r#"{"b":[]}"#,
            r#"{"b":[true,null,null]}"#,
            r#"{"c":["x",{"any":[1]},2]}"#,
            r#"{"d":[]}"#,
            r#"{"d":[7]}"#,
        ] {
            assert_eq!(run(&s, ok), Some(true), "{ok}");
        }
        for bad in [
            r#"{"a":["one",1]}"#,
            r#"{"a":[1]}"#,
            r#"{"a":[1,"one",2]}"#,
            r#"{"b":[null]}"#,
            r#"{"b":[true,false]}"#,
            r#"{"c":["y"]}"#,
            r#"{"c":["x",1,2,3]}"#,
            r#"{"d":[7,8]}"#,
        ] {
            assert_ne!(run(&s, bad), Some(true), "{bad}");
        }
        for (schema, says) in [
            (
                json!({"type": "array", "prefixItems": [{"type": "integer"}], "items": false, "minItems": 2}),
                "more than the 1 items",
            ),
            (
                json!({"type": "array", "items": {"type": "integer"}, "additionalItems": false}),
                "`additionalItems` goes with a list",
            ),
            (json!({"type": "array"}), "needs `items` or `prefixItems`"),
            (
                json!({"type": "array", "prefixItems": {"type": "integer"}}),
                "`prefixItems` must be an array",
            ),
        ] {
            let e =
                CompiledSchema::compile(&json!({"type": "object", "properties": {"t": schema}}))
                    .unwrap_err();
            assert_eq!(e.at, "/properties/t", "{e}");
            assert!(e.reason.contains(says), "{e} / {says}");
        }
        let coords = json!({"type": "object", "properties": {"at": {"type": "array",
            "prefixItems": [{"type": "number", "minimum": -90, "maximum": 90}, {"type": "number", "minimum": -180, "maximum": 180}],
            "minItems": 2, "maxItems": 2}}, "required": ["at"]});
        for v in masked_answers(&coords, &["[4", "8.8", "5,", "2.3", "]}", "-1"], 14, 100) {
            let at = v["at"].as_array().unwrap();
            assert_eq!(at.len(), 2, "{v}");
            assert!(at[0].as_f64().unwrap().abs() <= 90.0, "{v}");
            assert!(at[1].as_f64().unwrap().abs() <= 180.0, "{v}");
        }
    }

    /// `allOf` of several schemas (OpenAPI's composition of a base object and its extension,
    /// bounds split over members): one schema of them all.
    #[test]
    fn all_of_several_schemas_merges_them() {
        let s = CompiledSchema::compile(&json!({
            "type": "object",
            "properties": {"pet": {"allOf": [
                {"$ref": "#/$defs/Base"},
                {"type": "object", "properties": {
                    "name": {"type": "string"},
                    "meta": {"type": "object", "properties": {"b": {"type": "boolean"}}, "required": ["b"]}},
                    "required": ["name"]}]},
                "n": {"allOf": [{"type": "integer", "minimum": 0}, {"maximum": 10}, {"minimum": 3}]}},
            "$defs": {"Base": {"type": "object", "properties": {
                "id": {"type": "integer"},
                "meta": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}},
                "required": ["id"]}}
        }))
        .unwrap();
        for ok in [
            r#"{"pet":{"id":1,"meta":{"a":1,"b":true},"name":"Rex"}}"#,
            r#"{"pet":{"id":1,"name":"Rex"}}"#,
            r#"{"n":3}"#,
            r#"{"n":10}"#,
        ] {
            assert_eq!(run(&s, ok), Some(true), "{ok}");
        }
        for bad in [
            r#"{"pet":{"id":1}}"#,
            r#"{"pet":{"name":"Rex"}}"#,
            r#"{"pet":{"id":1,"meta":{"a":1},"name":"Rex"}}"#,
            r#"{"pet":{"id":1,"meta":{"b":true},"name":"Rex"}}"#,
            r#"{"n":2}"#,
            r#"{"n":11}"#,
        ] {
            assert_ne!(run(&s, bad), Some(true), "{bad}");
        }
        // A member that allows no other properties keeps the merge to its own.
        let s = CompiledSchema::compile(&json!({"type": "object", "properties": {"o": {"allOf": [
            {"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "string"}}, "additionalProperties": false},
            {"properties": {"b": {"type": "string"}, "c": {"type": "string"}}, "required": ["b"]}]}}}))
        .unwrap();
        assert_eq!(run(&s, r#"{"o":{"a":"x","b":"y"}}"#), Some(true));
        assert_eq!(run(&s, r#"{"o":{"b":"y","c":"z"}}"#), None);
        // Bounds compared exactly: integers as integers beyond a float's precision; an
        // integer beside a float it cannot be told from is refused, not guessed.
        let big = |a: Value, b: Value| {
            CompiledSchema::compile(&json!({"type": "object", "properties": {"n": {"allOf": [
                {"type": "integer", "maximum": a}, {"maximum": b}]}}}))
        };
        let s = big(json!(9007199254740993u64), json!(9007199254740992u64)).unwrap();
        assert_eq!(run(&s, r#"{"n":9007199254740992}"#), Some(true));
        assert_eq!(run(&s, r#"{"n":9007199254740993}"#), None);
        let e = big(json!(9007199254740993u64), json!(9007199254740992.0)).unwrap_err();
        assert!(e.reason.contains("less than a float can tell"), "{e}");
        assert_eq!(
            exact_order(&json!(1), &json!(1.0)),
            Some(std::cmp::Ordering::Equal)
        );
        assert_eq!(
            exact_order(&json!(-2), &json!(1.5)),
            Some(std::cmp::Ordering::Greater)
        );
    }

    /// `uniqueItems` over `enum` items (pydantic's `set[Color]`, `frozenset[Literal[…]]`): a
    /// value already in the array cannot begin again, so no prefix is a dead end, and the
    /// array holds at most as many items as there are values.
    #[test]
    fn unique_items_of_an_enum() {
        let schema = json!({"type": "object", "properties": {
            "c": {"type": "array", "items": {"$ref": "#/$defs/Color"}, "uniqueItems": true},
            "n": {"type": "array", "items": {"enum": [1, 12, 2]}, "uniqueItems": true, "minItems": 1},
            "b": {"type": "array", "items": {"type": "boolean"}, "uniqueItems": true}},
            "$defs": {"Color": {"enum": ["red", "blue", "green"], "type": "string"}}});
        let s = CompiledSchema::compile(&schema).unwrap();
        for ok in [
            r#"{"c":[]}"#,
            r#"{"c":["red","blue","green"]}"#,
            r#"{"n":[12,1,2]}"#,
            r#"{"n":[1]}"#,
            r#"{"b":[true,false]}"#,
        ] {
            assert_eq!(run(&s, ok), Some(true), "{ok}");
        }
        for bad in [
            r#"{"c":["red","red"]}"#,
            r#"{"c":["red","blue","red"]}"#,
            r#"{"n":[1,1]}"#,
            r#"{"n":[12,12]}"#,
            r#"{"n":[]}"#,
            r#"{"b":[true,true]}"#,
            r#"{"c":["red","blue","green",]}"#,
        ] {
            assert_ne!(run(&s, bad), Some(true), "{bad}");
        }
        // A used value cannot even begin: `"r` after "red", `12` after 12 (while `1`, a
        // prefix of it, is still free).
        assert_eq!(run(&s, r#"{"c":["red","r"#), None);
        assert_eq!(run(&s, r#"{"n":[12,1"#), Some(false));
        assert_eq!(run(&s, r#"{"n":[12,12"#), None);
        // Every value used: no `,` for a fourth.
        assert_eq!(run(&s, r#"{"c":["red","blue","green","#), None);
        let mut seen = 0;
        for v in masked_answers(
            &schema,
            &["[\"", "\",\"", "red", "blue", "green", "\"]", "12", "1,"],
            15,
            200,
        ) {
            for key in ["c", "n", "b"] {
                if let Some(items) = v.get(key).and_then(Value::as_array) {
                    let texts: Vec<String> = items.iter().map(Value::to_string).collect();
                    let distinct: std::collections::BTreeSet<&String> = texts.iter().collect();
                    assert_eq!(distinct.len(), texts.len(), "{v}");
                    seen += usize::from(texts.len() > 1);
                }
            }
        }
        assert!(seen > 0);
    }

    /// A random schema of the supported keywords, nested at most 3 deep.
    fn random_schema(rng: &mut rand_chacha::ChaCha8Rng, depth: u32) -> Value {
        let values = [
            json!("a"),
            json!("ab"),
            json!("b"),
            json!(1),
            json!(12),
            json!(2.5),
            json!(true),
            json!(null),
        ];
        let names = ["a", "b", "ab", "c"];
        let kinds = if depth >= 3 { 7 } else { 14 };
        match rng.gen_range(0..kinds) {
            0 => {
                let min = rng.gen_range(0..3u32);
                let mut s = json!({"type": "string", "minLength": min});
                if rng.gen_bool(0.5) {
                    s["maxLength"] = json!(min + rng.gen_range(0..6u32));
                }
                s
            }
            1 => {
                let lo = rng.gen_range(-20..20i64);
                let mut s = json!({"type": "integer"});
                if rng.gen_bool(0.5) {
                    s["minimum"] = json!(lo);
                    s["maximum"] = json!(lo + rng.gen_range(0..30i64));
                }
                s
            }
            2 => json!({"type": "number"}),
            3 => json!({"type": "boolean"}),
            4 => json!({"type": "null"}),
            5 => {
                let mut vs: Vec<Value> = values
                    .iter()
                    .filter(|_| rng.gen_bool(0.4))
                    .cloned()
                    .collect();
                if vs.is_empty() {
                    vs.push(json!("a"));
                }
                json!({"enum": vs})
            }
            6 => json!({"const": values[rng.gen_range(0..values.len())].clone()}),
            7 => {
                let min = rng.gen_range(0..3u32);
                json!({"type": "array", "items": random_schema(rng, depth + 1), "minItems": min, "maxItems": min + rng.gen_range(0..3u32)})
            }
            8 => {
                json!({"type": "array", "items": {"enum": ["x", "y", "xy"]}, "uniqueItems": true, "minItems": rng.gen_range(0..3u32)})
            }
            9 => {
                let n = rng.gen_range(1..4);
                let prefix: Vec<Value> = (0..n).map(|_| random_schema(rng, depth + 1)).collect();
                let mut s = json!({"type": "array", "prefixItems": prefix});
                match rng.gen_range(0..3) {
                    0 => s["items"] = json!(false),
                    1 => s["items"] = random_schema(rng, depth + 1),
                    _ => s["maxItems"] = json!(n + 1),
                }
                s
            }
            10 => {
                let mut props = serde_json::Map::new();
                let mut required = Vec::new();
                for name in names.iter().take(rng.gen_range(1..4)) {
                    props.insert((*name).to_owned(), random_schema(rng, depth + 1));
                    if rng.gen_bool(0.5) {
                        required.push(json!(name));
                    }
                }
                let mut s = json!({"type": "object", "properties": props, "required": required});
                match rng.gen_range(0..4) {
                    0 => s["additionalProperties"] = json!(true),
                    1 => s["additionalProperties"] = random_schema(rng, depth + 1),
                    _ => {}
                }
                s
            }
            11 => {
                let extra = if rng.gen_bool(0.3) {
                    json!(true)
                } else {
                    random_schema(rng, depth + 1)
                };
                let min = rng.gen_range(0..2u32);
                let mut s = json!({"type": "object", "additionalProperties": extra, "minProperties": min, "maxProperties": min + rng.gen_range(0..3u32)});
                match rng.gen_range(0..3) {
                    0 => s["propertyNames"] = json!({"enum": ["a", "ab", "b"]}),
                    1 => s["propertyNames"] = json!({"maxLength": 2}),
                    _ => {}
                }
                s
            }
            13 => {
                // Two objects (sharing a property), or bounds split over members.
                if rng.gen_bool(0.5) {
                    let member = |rng: &mut rand_chacha::ChaCha8Rng, names: &[&str]| {
                        let mut props = serde_json::Map::new();
                        let mut required = Vec::new();
                        for name in names {
                            props.insert((*name).to_owned(), random_schema(rng, depth + 1));
                            if rng.gen_bool(0.5) {
                                required.push(json!(name));
                            }
                        }
                        json!({"type": "object", "properties": props, "required": required})
                    };
                    json!({"allOf": [member(rng, &["a", "b"]), member(rng, &["b", "c"])]})
                } else {
                    let lo = rng.gen_range(-5..5i64);
                    json!({"allOf": [{"type": "integer", "minimum": lo}, {"maximum": lo + rng.gen_range(0..9i64)}]})
                }
            }
            _ => {
                let alts: Vec<Value> = (0..rng.gen_range(2..4))
                    .map(|_| {
                        if rng.gen_bool(0.1) {
                            json!({})
                        } else {
                            random_schema(rng, depth + 1)
                        }
                    })
                    .collect();
                json!({"anyOf": alts})
            }
        }
    }

    /// Whether `v` is valid under `s`, for the keywords [`random_schema`] writes: an
    /// implementation of their JSON Schema meaning apart from the automaton. An object schema
    /// without `additionalProperties` allows no other key (the compiler's reading, stricter
    /// than JSON Schema's), except as an `allOf` member, where the other members' keys are
    /// JSON Schema's "additional" ones.
    fn valid(v: &Value, s: &Value) -> bool {
        valid_in(v, s, false)
    }

    fn valid_in(v: &Value, s: &Value, member: bool) -> bool {
        let Some(o) = s.as_object() else {
            return false;
        };
        if let Some(alts) = o.get("anyOf").and_then(Value::as_array) {
            return alts.iter().any(|a| valid(v, a));
        }
        if let Some(all) = o.get("allOf").and_then(Value::as_array) {
            return all.iter().all(|a| valid_in(v, a, true));
        }
        if let Some(c) = o.get("const") {
            return v == c;
        }
        if let Some(e) = o.get("enum").and_then(Value::as_array) {
            return e.contains(v);
        }
        let count = |k: &str| o.get(k).and_then(Value::as_u64);
        match o.get("type").and_then(Value::as_str) {
            // Bounds beside no type hold on the values of their type only.
            None => {
                v.as_f64().is_none_or(|x| {
                    o.get("minimum")
                        .and_then(Value::as_f64)
                        .is_none_or(|m| x >= m)
                        && o.get("maximum")
                            .and_then(Value::as_f64)
                            .is_none_or(|m| x <= m)
                }) && v.as_str().is_none_or(|t| {
                    let n = t.chars().count() as u64;
                    count("minLength").is_none_or(|m| n >= m)
                        && count("maxLength").is_none_or(|m| n <= m)
                })
            }
            Some("string") => v.as_str().is_some_and(|t| {
                let n = t.chars().count() as u64;
                count("minLength").is_none_or(|m| n >= m)
                    && count("maxLength").is_none_or(|m| n <= m)
            }),
            // `-0` is an integer (serde_json reads it as the float -0.0).
            Some("integer") => v.as_f64().is_some_and(|i| {
                i.fract() == 0.0
                    && o.get("minimum")
                        .and_then(Value::as_f64)
                        .is_none_or(|m| i >= m)
                    && o.get("maximum")
                        .and_then(Value::as_f64)
                        .is_none_or(|m| i <= m)
            }),
            Some("number") => v.is_number(),
            Some("boolean") => v.is_boolean(),
            Some("null") => v.is_null(),
            Some("array") => {
                v.as_array().is_some_and(|items| {
                    let n = items.len() as u64;
                    let prefix = o.get("prefixItems").and_then(Value::as_array);
                    let each = items.iter().enumerate().all(|(i, item)| {
                        match prefix.and_then(|p| p.get(i)) {
                            Some(p) => valid(item, p),
                            None => match o.get("items") {
                                Some(Value::Bool(b)) => *b,
                                Some(s) => valid(item, s),
                                None => true,
                            },
                        }
                    });
                    let unique = o.get("uniqueItems") != Some(&json!(true))
                        || items
                            .iter()
                            .enumerate()
                            .all(|(i, x)| !items[..i].contains(x));
                    each && unique
                        && count("minItems").is_none_or(|m| n >= m)
                        && count("maxItems").is_none_or(|m| n <= m)
                })
            }
            Some("object") => v.as_object().is_some_and(|m| {
                let n = m.len() as u64;
                let props = o.get("properties").and_then(Value::as_object);
                let required = o
                    .get("required")
                    .and_then(Value::as_array)
                    .is_none_or(|r| r.iter().all(|k| m.contains_key(k.as_str().unwrap_or(""))));
                let names = o
                    .get("propertyNames")
                    .is_none_or(|n| m.keys().all(|k| valid(&json!(k), n)));
                let each = names
                    && m.iter().all(|(k, x)| match props.and_then(|p| p.get(k)) {
                        Some(p) => valid(x, p),
                        None => match o.get("additionalProperties") {
                            Some(Value::Bool(true)) => true,
                            Some(s @ Value::Object(_)) => valid(x, s),
                            None => member,
                            _ => false,
                        },
                    });
                required
                    && each
                    && count("minProperties").is_none_or(|c| n >= c)
                    && count("maxProperties").is_none_or(|c| n <= c)
            }),
            Some(_) => false,
        }
    }

    /// Random schemas of every supported keyword together (unions of alternatives that begin
    /// alike, dicts, tuples, sets, any-values, bounds): compiling never panics, masked
    /// decoding never reaches a prefix nothing may follow (`masked_answers` asserts it) and
    /// every answer it finishes is valid under the schema by a separate validator.
    #[test]
    fn random_schemas_give_valid_answers() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(16);
        let pieces = [
            "{\"", "\":", "\"}", "[", "]", ",", "\"a\"", "\"ab\"", "12", "2.5", "true", "null",
            "false", "}", "\"a\":", "-1", "\"x\"", "\"xy\"",
        ];
        let (mut compiled, mut refused, mut answers) = (0, 0, 0);
        for i in 0..300u64 {
            let mut props = serde_json::Map::new();
            for name in ["a", "b", "c"].iter().take(rng.gen_range(1..4)) {
                props.insert((*name).to_owned(), random_schema(&mut rng, 0));
            }
            let required: Vec<&String> = props.keys().filter(|_| rng.gen_bool(0.6)).collect();
            let schema = json!({"type": "object", "properties": props, "required": required});
            if CompiledSchema::compile(&schema).is_err() {
                refused += 1;
                continue;
            }
            compiled += 1;
            for v in masked_answers(&schema, &pieces, i, 6) {
                assert!(valid(&v, &schema), "{v}\nis not valid under\n{schema}");
                answers += 1;
            }
        }
        assert!(
            compiled >= 200 && answers >= 500,
            "{compiled} compiled, {refused} refused, {answers} answers"
        );
    }

    /// pydantic's `Union[Cat, Dog]` without a discriminator: two objects that no property
    /// tags, both beginning `{"name":`.
    fn untagged_pets() -> Value {
        json!({
            "type": "object",
            "properties": {"pet": {"anyOf": [{"$ref": "#/$defs/Cat"}, {"$ref": "#/$defs/Dog"}]}},
            "required": ["pet"],
            "$defs": {
                "Cat": {"type": "object", "properties": {
                    "name": {"type": "string", "maxLength": 8}, "lives": {"type": "integer", "minimum": 1, "maximum": 9}},
                    "required": ["name", "lives"]},
                "Dog": {"type": "object", "properties": {
                    "name": {"type": "string"}, "good": {"type": "boolean"}},
                    "required": ["name", "good"]}
            }
        })
    }

    /// An `anyOf` whose alternatives begin alike is read side by side, one run per
    /// alternative, until the text tells them apart; once its value ends the runs are one
    /// again. `oneOf` keeps refusing them (a text both match is not `oneOf`).
    #[test]
    fn untagged_unions_are_read_side_by_side() {
        let s = CompiledSchema::compile(&untagged_pets()).unwrap();
        assert_eq!(run(&s, r#"{"pet":{"name":"Tom","lives":9}}"#), Some(true));
        assert_eq!(run(&s, r#"{"pet":{"name":"Rex","good":true}}"#), Some(true));
        // The cat's name is at most 8 characters, the dog's is not bounded.
        assert_eq!(
            run(&s, r#"{"pet":{"name":"Sir Barksalot","good":false}}"#),
            Some(true)
        );
        assert_eq!(
            run(&s, r#"{"pet":{"name":"Sir Barksalot","lives":1}}"#),
            None
        );
        assert_eq!(run(&s, r#"{"pet":{"name":"Tom","lives":10}}"#), None);
        assert_eq!(
            run(&s, r#"{"pet":{"name":"Tom","lives":9,"good":true}}"#),
            None
        );
        assert_eq!(run(&s, r#"{"pet":{"name":"Tom"}}"#), None);
        assert_eq!(run(&s, r#"{"pet":{"name":"Tom","#), Some(false));
        let mut j = SchemaJson::new(&s);
        let mut open = Vec::new();
        for &c in br#"{"pet":{"name":"Tom","lives":9}}"# {
            assert!(j.step(&s, c));
            open.push(1 + j.more.len());
        }
        // One run until the pet's `{`, two through `"name":"Tom",` (the cat's 8-character bound
        // still holds), one from the key that tells them apart.
        let text = br#"{"pet":{"name":"Tom","lives":9}}"#;
        let at = |needle: &[u8]| {
            text.windows(needle.len())
                .position(|w| w == needle)
                .unwrap()
        };
        assert_eq!(open[at(b"{\"name")], 2);
        assert_eq!(open[at(b"Tom")], 2);
        assert_eq!(open[at(b"lives") - 1], 2);
        assert_eq!(open[at(b"lives")], 1);
        assert_eq!(*open.last().unwrap(), 1);

        // Numbers, strings and constants that begin alike.
        let s = CompiledSchema::compile(&json!({"type": "object", "properties": {
            "n": {"type": ["integer", "number"]},
            "d": {"anyOf": [{"type": "string", "format": "date"}, {"type": "string", "format": "uuid"}, {"const": "today"}]},
            "k": {"anyOf": [{"type": "integer", "maximum": 9}, {"enum": [12, 100]}]}}}))
        .unwrap();
        for ok in [
            r#"{"n":1}"#,
            r#"{"n":-1.5e3}"#,
            r#"{"d":"2025-01-31"}"#,
            r#"{"d":"today"}"#,
            r#"{"d":"123e4567-e89b-12d3-a456-426614174000"}"#,
            r#"{"d":"2025-02-28","k":9}"#,
            r#"{"k":12}"#,
            r#"{"k":100}"#,
            r#"{"k":-3}"#,
        ] {
            assert_eq!(run(&s, ok), Some(true), "{ok}");
        }
        for bad in [
            r#"{"d":"2025-02-30"}"#,
            r#"{"d":"tomorrow"}"#,
            r#"{"k":10}"#,
            r#"{"k":1000}"#,
            r#"{"n":"1"}"#,
        ] {
            assert_eq!(run(&s, bad), None, "{bad}");
        }

        // `oneOf` of the same alternatives, and more runs than the bound, are refused with
        // their place.
        let mut one_of = untagged_pets();
        let alts = one_of["properties"]["pet"]["anyOf"].take();
        one_of["properties"]["pet"] = json!({"oneOf": alts});
        let e = CompiledSchema::compile(&one_of).unwrap_err();
        assert!(e.reason.contains("`anyOf` can hold them"), "{e}");
        assert_eq!(e.at, "/properties/pet");
        let many: Vec<Value> = (0..=MAX_RUNS)
            .map(|i| json!({"type": "string", "maxLength": i + 1}))
            .collect();
        let e = CompiledSchema::compile(
            &json!({"type": "object", "properties": {"s": {"anyOf": many}}}),
        )
        .unwrap_err();
        assert!(e.reason.contains("more than 16 readings"), "{e}");
        assert_eq!(e.at, "/properties/s");
        // Nested: 4 × 4 = 16 is within the bound, 4 × 5 is not.
        let nested = |inner: usize| {
            let strings: Vec<Value> = (0..inner)
                .map(|i| json!({"type": "string", "maxLength": i + 1}))
                .collect();
            let objects: Vec<Value> = (0..4)
                .map(|i| json!({"type": "object", "properties": {"v": {"anyOf": strings}, format!("k{i}"): {"type": "null"}}, "required": ["v"]}))
                .collect();
            json!({"type": "object", "properties": {"o": {"anyOf": objects}}})
        };
        let s = CompiledSchema::compile(&nested(4)).unwrap();
        assert_eq!(run(&s, r#"{"o":{"v":"abcd","k3":null}}"#), Some(true));
        assert_eq!(run(&s, r#"{"o":{"v":"abcde"}}"#), None);
        let e = CompiledSchema::compile(&nested(5)).unwrap_err();
        assert_eq!(e.at, "/properties/o", "{e}");
        // Recursion through such an `anyOf` has no bound; through an alternative that begins
        // with a byte of its own it has one.
        let tree = json!({"type": "object", "properties": {"t": {"$ref": "#/$defs/T"}}, "$defs": {"T": {"anyOf": [
            {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#/$defs/T"}}}},
            {"type": "object", "properties": {"leaf": {"type": "string"}}}]}}});
        let e = CompiledSchema::compile(&tree).unwrap_err();
        assert!(e.reason.contains("readings"), "{e}");
        let list = json!({"type": "object", "properties": {"t": {"$ref": "#/$defs/T"}}, "$defs": {"T": {"anyOf": [
            {"type": "array", "items": {"$ref": "#/$defs/T"}},
            {"type": "integer"}, {"type": "number"}]}}});
        let s = CompiledSchema::compile(&list).unwrap();
        assert_eq!(run(&s, r#"{"t":[1,[2.5,[3]],4]}"#), Some(true));
    }

    #[test]
    fn masked_decoding_of_an_untagged_union_writes_one_alternative() {
        let pieces = [
            "{\"",
            "\":",
            "\"}",
            "pet",
            "name",
            "lives",
            "good",
            "true",
            "false",
            "Tom",
            "Rex",
            "Sir Barksalot",
            "12",
            "}}",
        ];
        let mut kinds = std::collections::BTreeSet::new();
        for v in masked_answers(&untagged_pets(), &pieces, 11, 200) {
            let pet = v["pet"].as_object().unwrap();
            let keys: Vec<&str> = pet.keys().map(String::as_str).collect();
            let name = pet["name"].as_str().unwrap();
            match keys.as_slice() {
                ["name", "lives"] => {
                    assert!(name.chars().count() <= 8, "{v}");
                    assert!((1..=9).contains(&pet["lives"].as_i64().unwrap()), "{v}");
                    kinds.insert("cat");
                }
                ["name", "good"] => {
                    assert!(pet["good"].is_boolean(), "{v}");
                    kinds.insert("dog");
                }
                _ => panic!("{v}"),
            }
            if name.chars().count() > 8 {
                kinds.insert("long-named dog");
            }
        }
        assert_eq!(kinds.len(), 3, "{kinds:?}");
        // Strings of two bounds side by side: the longer bound is the one that holds (the
        // mask's shortcut takes the most room of the runs).
        let schema = json!({"type": "object", "properties": {"s": {"anyOf": [
            {"type": "string", "maxLength": 2}, {"type": "string", "maxLength": 5}]}}, "required": ["s"]});
        let mut longest = 0;
        for v in masked_answers(&schema, &["ab", "abc", "\"}"], 12, 100) {
            let n = v["s"].as_str().unwrap().chars().count();
            assert!(n <= 5, "{v}");
            longest = longest.max(n);
        }
        assert_eq!(longest, 5);
    }

    #[test]
    fn a_call_of_one_of_the_tools() {
        let weather = json!({"type": "object", "properties": {"city": {"$ref": "#/$defs/City"}},
            "$defs": {"City": {"type": "string"}}});
        let time = json!({"type": "object", "properties": {"tz": {"$ref": "#/$defs/Tz"}},
            "$defs": {"Tz": {"enum": ["UTC", "CET"]}}});
        let s = CompiledSchema::compile_calls(&[("get_weather", &weather), ("get_time", &time)])
            .unwrap();
        for ok in [
            r#"{"name":"get_weather","arguments":{"city":"Paris"}}"#,
            r#"{"name": "get_time", "arguments": {"tz": "CET"}}"#,
        ] {
            assert_eq!(run(&s, ok), Some(true), "{ok}");
        }
        for bad in [
            r#"{"name":"get_weather","arguments":{"tz""#,
            r#"{"name":"get_time","arguments":{"tz":"PST""#,
            r#"{"name":"get_date""#,
            r#"{"arguments""#,
        ] {
            assert_eq!(run(&s, bad), None, "{bad}");
        }
        let one = CompiledSchema::compile_calls(&[("get_time", &time)]).unwrap();
        assert_eq!(
            run(&one, r#"{"name":"get_time","arguments":{"tz":"UTC"}}"#),
            Some(true)
        );
        assert_eq!(run(&one, r#"{"name":"get_weather""#), None);
        // A tool whose parameters the automaton cannot hold, or that are not an object: its index.
        let e = CompiledSchema::compile_calls(&[
            ("a", &weather),
            ("b", &json!({"type": "object", "properties": {"d": {"type": "string", "format": "iri"}}})),
        ])
        .unwrap_err();
        assert_eq!((e.0, e.1.at.as_str()), (1, "/properties/d"));
        let e = CompiledSchema::compile_calls(&[("a", &json!({"type": "string"}))]).unwrap_err();
        assert!(e.1.reason.contains("object"), "{:?}", e);
        // Two tools of one name cannot be told apart.
        assert!(CompiledSchema::compile_calls(&[("a", &weather), ("a", &time)]).is_err());
    }

    /// pydantic's `HttpUrl` (`format: uri`, `maxLength: 2083`) and other long bounds on
    /// looping patterns compile (the bound held by the distance to an end, not by crossing
    /// the pattern with the count), and hold exactly.
    #[test]
    fn a_long_max_length_on_a_pattern_holds_exactly() {
        let s = CompiledSchema::compile(&json!({"type": "object", "properties": {
            "url": {"type": "string", "format": "uri", "minLength": 1, "maxLength": 2083},
            "q": {"type": "string", "pattern": "^(ab)*$", "maxLength": 4999}}}))
        .unwrap();
        assert_eq!(
            run(&s, r#"{"url":"https://example.com/a?b=c","q":"abab"}"#),
            Some(true)
        );
        let long = "a".repeat(2072);
        assert_eq!(
            run(&s, &format!(r#"{{"url":"https://{long}.io","#)),
            Some(false),
            "2,083 characters"
        );
        assert_eq!(run(&s, &format!(r#"{{"url":"https://{long}.com"#)), None);
        let pairs = "ab".repeat(2499);
        assert_eq!(
            run(&s, &format!(r#"{{"url":"a:","q":"{pairs}"}}"#)),
            Some(true)
        );
        // One more `a` could only end at 5,000 characters.
        assert_eq!(run(&s, &format!(r#"{{"url":"a:","q":"{pairs}a"#)), None);
        // An escape counts as the character it stands for, and needs room for what follows.
        let slash = CompiledSchema::compile(&json!({"type": "object", "properties": {
            "p": {"type": "string", "pattern": "^(/x)*$", "maxLength": 4999}}}))
        .unwrap();
        let most = "/x".repeat(2499);
        assert_eq!(run(&slash, &format!(r#"{{"p":"{most}"}}"#)), Some(true));
        assert_eq!(run(&slash, &format!(r#"{{"p":"{most}\"#)), None);
        let fewer = "/x".repeat(2498);
        assert_eq!(run(&slash, &format!(r#"{{"p":"{fewer}\/x"}}"#)), Some(true));
    }

    /// `pattern` beside `format`: the strings both hold (an email of one domain, a date of one
    /// year), also with length bounds.
    #[test]
    fn a_pattern_beside_a_format_holds_both() {
        let s = CompiledSchema::compile(&json!({"type": "object", "properties": {
            "m": {"type": "string", "format": "email", "pattern": "@example\\.com$"},
            "d": {"type": "string", "format": "date", "pattern": "^2025-"},
            "u": {"type": "string", "format": "uri", "pattern": "^https://", "maxLength": 2083}}}))
        .unwrap();
        assert_eq!(
            run(
                &s,
                r#"{"m":"ada@example.com","d":"2025-02-28","u":"https://x.io/a"}"#
            ),
            Some(true)
        );
        for bad in [
            // another domain, or an address that is not an email
            r#"{"m":"ada@example.org""#,
            r#"{"m":"a b@example.com""#,
            // another year, or not a date of 2025
            r#"{"m":"a@example.com","d":"2024-"#,
            r#"{"m":"a@example.com","d":"2025-02-29""#,
            r#"{"m":"a@example.com","d":"2025-01-01","u":"http:"#,
        ] {
            assert_eq!(run(&s, bad), None, "{bad}");
        }
    }

    #[test]
    fn a_list_of_one_to_max_calls() {
        let weather = json!({"type": "object", "properties": {"city": {"type": "string"}}});
        let time = json!({"type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}}});
        let tools = [("get_weather", &weather), ("get_time", &time)];
        let s = CompiledSchema::compile_call_list(&tools, 2).unwrap();
        for ok in [
            r#"[{"name":"get_weather","arguments":{"city":"Paris"}}]"#,
            r#"[{"name":"get_weather","arguments":{"city":"Paris"}}, {"name":"get_time","arguments":{"tz":"CET"}}]"#,
        ] {
            assert_eq!(run(&s, ok), Some(true), "{ok}");
        }
        // Open while the next call may follow.
        assert_eq!(
            run(&s, r#"[{"name":"get_time","arguments":{}},"#),
            Some(false)
        );
        for bad in [
            // At least one call, at most `max`, each a call of one of the tools.
            "[]",
            r#"[{"name":"get_time","arguments":{}},{"name":"get_time","arguments":{}},"#,
            r#"[{"name":"get_date""#,
            r#"{"name":"get_time""#,
        ] {
            assert_eq!(run(&s, bad), None, "{bad}");
        }
        // A tool the automaton cannot hold: its index, as for one call.
        let e = CompiledSchema::compile_call_list(
            &[("a", &weather), ("b", &json!({"type": "string"}))],
            4,
        )
        .unwrap_err();
        assert_eq!(e.0, 1);
    }

    #[test]
    fn optional_properties_may_be_left_out_in_order() {
        let s = CompiledSchema::compile(&json!({"type": "object", "properties": {
            "a": {"type": "integer"}, "b": {"type": "integer"}, "c": {"type": "string"},
            "d": {"type": "integer"}}, "required": ["a", "d"]}))
        .unwrap();
        for ok in [
            r#"{"a":1,"d":2}"#,
            r#"{"a":1,"b":2,"d":3}"#,
            r#"{"a":1,"c":"x","d":3}"#,
            r#"{ "a" : 1 , "b" : 2 , "c" : "x" , "d" : 3 }"#,
        ] {
            assert_eq!(run(&s, ok), Some(true), "{ok}");
        }
        for bad in [
            r#"{}"#,                 // a is required
            r#"{"b":1"#,             // so it comes first
            r#"{"a":1}"#,            // d is required
            r#"{"a":1,"c":"x","b""#, // the schema's order
            r#"{"a":1,}"#,           // no trailing comma
            r#"{"a":1,"d":2,"b""#,   // nothing after the last
            r#"{"a":1,"e""#,         // no other key
        ] {
            assert_eq!(run(&s, bad), None, "{bad}");
        }
        // No `required`: every property may be left out, `{}` included.
        let s = CompiledSchema::compile(&json!({"type": "object", "properties": {
            "x": {"type": "string"}, "y": {"type": "boolean"}}}))
        .unwrap();
        for ok in [
            r#"{}"#,
            r#"{"y":true}"#,
            r#"{"x":"a"}"#,
            r#"{"x":"a","y":false}"#,
        ] {
            assert_eq!(run(&s, ok), Some(true), "{ok}");
        }
        assert_eq!(run(&s, r#"{"y":true,"x""#), None);
        // Keys that share a prefix are told apart to their last byte.
        let s = CompiledSchema::compile(&json!({"type": "object", "properties": {
            "ab": {"type": "integer"}, "abc": {"type": "integer"}, "a": {"type": "integer"}}}))
        .unwrap();
        for ok in [r#"{"abc":1}"#, r#"{"ab":1,"a":2}"#, r#"{"a":2}"#] {
            assert_eq!(run(&s, ok), Some(true), "{ok}");
        }
        // Runs of optional properties are bounded.
        let many: serde_json::Map<String, Value> = (0..64)
            .map(|i| (format!("p{i}"), json!({"type": "integer"})))
            .collect();
        let e =
            CompiledSchema::compile(&json!({"type": "object", "properties": many})).unwrap_err();
        assert!(e.reason.contains("optional properties in a row"), "{e}");
    }

    #[test]
    fn masked_decoding_leaves_out_optional_properties_or_writes_them() {
        let schema = json!({"type": "object", "properties": {
            "id": {"type": "integer"}, "note": {"type": "string"},
            "tags": {"type": "array", "items": {"type": "string"}},
            "ok": {"type": "boolean"}}, "required": ["id", "ok"]});
        let pieces = [
            "{\"", "\":", "\",\"", "id", "note", "tags", "ok", "true", "[\"", "\"]", "12",
        ];
        let mut shapes = std::collections::BTreeSet::new();
        for v in masked_answers(&schema, &pieces, 3, 200) {
            let keys: Vec<&str> = v.as_object().unwrap().keys().map(String::as_str).collect();
            let order = ["id", "note", "tags", "ok"];
            let mut at = 0;
            for k in &keys {
                let i = order.iter().position(|o| o == k).unwrap();
                assert!(i >= at, "{v}");
                at = i + 1;
            }
            assert!(keys.contains(&"id") && keys.contains(&"ok"), "{v}");
            shapes.insert(keys.join(","));
        }
        // Both kinds of answer occur: optional properties left out and written.
        assert!(shapes.contains("id,ok"), "{shapes:?}");
        assert!(
            shapes
                .iter()
                .any(|s| s.contains("note") || s.contains("tags")),
            "{shapes:?}"
        );
    }

    #[test]
    fn number_enums_are_written_as_listed() {
        let s = CompiledSchema::compile(&json!({"type": "object", "properties": {
            "p": {"enum": [1, 12, -3, 2.5]}, "q": {"const": 7}, "r": {"type": "array", "items": {"enum": [1, 10]}}},
            "required": ["p", "q", "r"]}))
        .unwrap();
        for ok in [
            r#"{"p":1,"q":7,"r":[]}"#,
            r#"{"p":12,"q":7,"r":[10,1,10]}"#,
            r#"{"p":-3 ,"q":7,"r":[1 ]}"#,
            r#"{"p":2.5,"q":7,"r":[1]}"#,
        ] {
            assert_eq!(run(&s, ok), Some(true), "{ok}");
        }
        for bad in [
            r#"{"p":2,"#,  // not listed
            r#"{"p":123"#, // longer than any
            r#"{"p":1.0"#, // written as listed: 1, not 1.0
            r#"{"p":1,"q":70"#,
            r#"{"p":1,"q":7,"r":[100"#,
            r#"{"p":"1""#,
        ] {
            assert_eq!(run(&s, bad), None, "{bad}");
        }
        let many: Vec<Value> = (0..65).map(|i| json!(i)).collect();
        let e = CompiledSchema::compile(
            &json!({"type": "object", "properties": {"a": {"enum": many}}}),
        )
        .unwrap_err();
        assert!(e.reason.contains("more than 64"), "{e}");
    }

    #[test]
    fn arrays_hold_their_item_bounds() {
        let s = CompiledSchema::compile(&json!({"type": "object", "properties": {
            "three": {"type": "array", "items": {"type": "integer"}, "minItems": 3, "maxItems": 3},
            "some": {"type": "array", "items": {"type": "string"}, "minItems": 1},
            "none": {"type": "array", "items": {"type": "string"}, "maxItems": 0}},
            "required": ["three", "some", "none"]}))
        .unwrap();
        for ok in [
            r#"{"three":[1,2,3],"some":["a"],"none":[]}"#,
            r#"{"three":[ 1 , 2 , 3 ],"some":["a","b","c","d"],"none":[ ]}"#,
        ] {
            assert_eq!(run(&s, ok), Some(true), "{ok}");
        }
        for bad in [
            r#"{"three":[1,2]"#,
            r#"{"three":[1,2,3,"#,
            r#"{"three":[]"#,
            r#"{"three":[1,2,3],"some":[]"#,
            r#"{"three":[1,2,3],"some":["a"],"none":["a"#,
        ] {
            assert_eq!(run(&s, bad), None, "{bad}");
        }
        for (schema, says) in [
            (
                json!({"type": "array", "items": {"type": "string"}, "minItems": 2, "maxItems": 1}),
                "more than",
            ),
            (
                json!({"type": "array", "items": {"type": "string"}, "minItems": -1}),
                "`minItems`",
            ),
            (
                json!({"type": "array", "items": {"type": "string"}, "maxItems": 1.5}),
                "`maxItems`",
            ),
        ] {
            let e =
                CompiledSchema::compile(&json!({"type": "object", "properties": {"a": schema}}))
                    .unwrap_err();
            assert!(e.reason.contains(says) && e.at == "/properties/a", "{e}");
        }
    }

    /// The finished answers of `runs` random-logit decodings (at most 400 tokens each) under
    /// `schema`'s mask, over the byte tokens and `pieces`; after every token the text so far is
    /// a valid prefix.
    fn masked_answers(schema: &Value, pieces: &[&str], seed: u64, runs: usize) -> Vec<Value> {
        use crate::constraint::{Constraint, TokenTable};
        use std::sync::Arc;
        let schema = Arc::new(CompiledSchema::compile(schema).unwrap());
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        let mut vocab: Vec<Option<Vec<u8>>> = (0..=255u8).map(|b| Some(vec![b])).collect();
        vocab.extend(pieces.iter().map(|p| Some(p.as_bytes().to_vec())));
        let stop = vocab.len() as u32;
        vocab.push(None);
        let table = Arc::new(TokenTable::new(vocab));
        let mut out = Vec::new();
        for _ in 0..runs {
            let mut state = Constraint::JsonSchema(table.clone(), schema.clone()).start();
            let mut text = Vec::new();
            for _ in 0..400 {
                let mut logits: Vec<f32> =
                    (0..table.len()).map(|_| rng.gen_range(-5.0..5.0)).collect();
                assert!(
                    state.mask(&mut logits, &[stop]),
                    "nothing may follow {:?}",
                    String::from_utf8_lossy(&text)
                );
                let t = crate::sampler::argmax(&logits);
                if t == stop {
                    out.push(
                        serde_json::from_slice(&text)
                            .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&text))),
                    );
                    break;
                }
                text.extend_from_slice(table.bytes(t).unwrap());
                state.advance(t);
                assert!(
                    run_bytes(&schema, &text).is_some(),
                    "token {:?} made {}",
                    String::from_utf8_lossy(table.bytes(t).unwrap()),
                    String::from_utf8_lossy(&text)
                );
            }
        }
        out
    }

    #[test]
    fn masked_decoding_writes_bounded_arrays_and_number_enums() {
        let schema = json!({"type": "object", "properties": {
            "three": {"type": "array", "items": {"enum": [1, 12, 2.5]}, "minItems": 3, "maxItems": 3},
            "few": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2}},
            "required": ["three", "few"]});
        let answers = masked_answers(&schema, &["{\"", "\":", "12", "2.5", "true", "[1,"], 8, 150);
        assert!(answers.len() > 20, "only {} finished", answers.len());
        for v in &answers {
            let three = v["three"].as_array().unwrap();
            assert_eq!(three.len(), 3, "{v}");
            assert!(
                three
                    .iter()
                    .all(|x| [1.0, 12.0, 2.5].contains(&x.as_f64().unwrap())),
                "{v}"
            );
            assert!(v["few"].as_array().unwrap().len() <= 2, "{v}");
        }
    }

    #[test]
    fn strings_hold_their_length_bounds() {
        let s = CompiledSchema::compile(&json!({"type": "object", "properties": {
            "code": {"type": "string", "minLength": 2, "maxLength": 3}},
            "required": ["code"]}))
        .unwrap();
        for ok in [
            r#"{"code":"ab"}"#,
            r#"{"code":"abc"}"#,
            r#"{"code":"é€"}"#,        // characters, not bytes (2 + 3 bytes)
            r#"{"code":"a\n\u00e9"}"#, // an escape is one character
        ] {
            assert_eq!(run(&s, ok), Some(true), "{ok}");
        }
        for bad in [
            r#"{"code":"a"}"#,
            r#"{"code":"abcd"#,
            r#"{"code":"ab\"x"#,
            r#"{"code":"""#,
        ] {
            assert_eq!(run(&s, bad), None, "{bad}");
        }
        let e = CompiledSchema::compile(&json!({"type": "object", "properties": {
            "a": {"type": "string", "minLength": 3, "maxLength": 2}}}))
        .unwrap_err();
        assert!(
            e.reason.contains("more than") && e.at == "/properties/a",
            "{e}"
        );
    }

    #[test]
    fn masked_decoding_writes_strings_within_their_bounds() {
        // Long string-safe tokens (up to 12 characters) against a maximum of 10: near the
        // maximum every token is simulated, so none overflows it.
        let schema = json!({"type": "object", "properties": {
            "s": {"type": "string", "minLength": 4, "maxLength": 10},
            "t": {"type": "string", "maxLength": 200}},
            "required": ["s", "t"]});
        let answers = masked_answers(
            &schema,
            &[
                "{\"",
                "\":\"",
                "\",\"",
                "abcdefghijkl",
                "xyz",
                "é",
                "\"}",
                "\\n",
            ],
            13,
            150,
        );
        assert!(answers.len() > 20, "only {} finished", answers.len());
        for v in &answers {
            let n = v["s"].as_str().unwrap().chars().count();
            assert!((4..=10).contains(&n), "{v}");
            assert!(v["t"].as_str().unwrap().chars().count() <= 200, "{v}");
        }
    }

    #[test]
    fn strings_hold_their_pattern_and_format() {
        let s = CompiledSchema::compile(&json!({"type": "object", "properties": {
            "code": {"type": "string", "pattern": "^[A-Z]{2}-\\d{3}$"},
            "when": {"type": "string", "format": "date"},
            "tag": {"type": "string", "pattern": "x\\\\y", "maxLength": 5}},
            "required": ["code", "when", "tag"]}))
        .unwrap();
        for ok in [
            r#"{"code":"AB-123","when":"2024-02-29","tag":"x\\y"}"#,
            r#"{"code":"AB-123","when":"2024-02-29","tag":"ax\\yb"}"#,
            // `\/` is `/`, `\n` a newline: escapes are read decoded.
            r#"{"code":"AB-123","when":"2024-02-29","tag":"\nx\\y"}"#,
        ] {
            assert_eq!(run(&s, ok), Some(true), "{ok}");
        }
        for bad in [
            r#"{"code":"ab-123""#,
            r#"{"code":"AB-1234""#,
            r#"{"code":"AB-12""#,
            r#"{"code":"AB-123","when":"2023-02-29""#,
            r#"{"code":"AB-123","when":"2024-02-29","tag":"xy""#,
            r#"{"code":"AB-123","when":"2024-02-29","tag":"aax\\yb""#,
            // no `\u` escapes in a string with a pattern, nor an escape no character of which
            // the pattern allows next
            r#"{"code":"\u0041"#,
            r#"{"code":"AB-12\"#,
        ] {
            assert_eq!(run(&s, bad), None, "{bad}");
        }
        // A prefix that cannot end in a match is refused at once, not at the quote.
        assert_eq!(
            run(&s, r#"{"code":"AB-123","when":"2023-02-2"#),
            Some(false)
        );
        assert_eq!(run(&s, r#"{"code":"AB-123","when":"2023-02-29"#), None);
    }

    #[test]
    fn integers_hold_their_bounds() {
        let s = CompiledSchema::compile(&json!({"type": "object", "properties": {
            "pct": {"type": "integer", "minimum": 0, "maximum": 100},
            "neg": {"type": "integer", "exclusiveMaximum": 0, "minimum": -12.5},
            "big": {"type": "integer", "minimum": 1000}},
            "required": ["pct", "neg", "big"]}))
        .unwrap();
        for ok in [
            r#"{"pct":0,"neg":-1,"big":1000}"#,
            r#"{"pct":100,"neg":-12,"big":99999999}"#,
            r#"{"pct":57,"neg":-5,"big":1001}"#,
        ] {
            assert_eq!(run(&s, ok), Some(true), "{ok}");
        }
        for bad in [
            r#"{"pct":-"#,   // no negative percentage
            r#"{"pct":101"#, // 101 > 100 as soon as its third digit is read
            r#"{"pct":1000"#,
            r#"{"pct":0,"neg":0"#,
            r#"{"pct":0,"neg":-13"#,
            r#"{"pct":0,"neg":-1,"big":0"#,
        ] {
            assert_eq!(run(&s, bad), None, "{bad}");
        }
        // 999 could still become 9990: refused only at its end.
        assert_eq!(run(&s, r#"{"pct":0,"neg":-1,"big":999"#), Some(false));
        assert_eq!(run(&s, r#"{"pct":0,"neg":-1,"big":999}"#), None);
        // A prefix is taken exactly when an integer within the bounds begins with it: brute
        // force over short ones (integers are written without leading zeros, so a text is a
        // prefix only of the integers it begins).
        // With `multipleOf` too.
        for step in [1i64, 3, 7] {
            for lo in [-30i64, -1, 0, 7, 95] {
                for hi in [lo, lo + 1, lo + 9, lo + 100] {
                    let held = |w: &i64| (lo..=hi).contains(w) && w % step == 0;
                    let schema = json!({"type": "object", "properties": {
                        "n": {"type": "integer", "minimum": lo, "maximum": hi, "multipleOf": step}},
                        "required": ["n"]});
                    let Ok(s) = CompiledSchema::compile(&schema) else {
                        assert!(!(lo..=hi).any(|w| held(&w)), "{schema}");
                        continue;
                    };
                    for v in -200i64..=200 {
                        let text = v.to_string();
                        let reachable = (lo..=hi)
                            .filter(held)
                            .any(|w| w.to_string().starts_with(&text));
                        let taken = run(&s, &format!("{{\"n\":{text}"));
                        assert_eq!(taken.is_some(), reachable, "{text} in {schema}");
                        let whole = run(&s, &format!("{{\"n\":{text}}}"));
                        assert_eq!(whole == Some(true), held(&v), "{text} in {schema}");
                    }
                    assert_eq!(run(&s, "{\"n\":-0"), None, "-0 is not written");
                }
            }
        }
    }

    #[test]
    fn all_of_one_schema_is_that_schema() {
        let s = CompiledSchema::compile(&json!({"type": "object", "required": ["a"], "properties": {
            "a": {"allOf": [{"$ref": "#/$defs/A"}], "description": "wrapped as pydantic does"}},
            "$defs": {"A": {"type": "object", "required": ["x"], "properties": {"x": {"type": "integer"}}}}}))
        .unwrap();
        assert_eq!(run(&s, r#"{"a":{"x":1}}"#), Some(true));
        assert_eq!(run(&s, r#"{"a":{"y""#), None);
    }

    #[test]
    fn numbers_hold_their_bounds() {
        let s = CompiledSchema::compile(&json!({"type": "object", "properties": {
            "p": {"type": "number", "minimum": 0, "maximum": 1},
            "q": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 0.3},
            "t": {"type": "number", "minimum": -2.5, "maximum": -0.25}},
            "required": ["p", "q", "t"]}))
        .unwrap();
        for ok in [
            r#"{"p":0,"q":0.1,"t":-2.5}"#,
            r#"{"p":1,"q":0.299999999999,"t":-0.25}"#,
            r#"{"p":1.000,"q":0.000000000001,"t":-1}"#,
            r#"{"p":0.5,"q":0.2,"t":-0.250}"#,
            r#"{"p":-0.0,"q":0.2,"t":-2.49}"#,
        ] {
            assert_eq!(run(&s, ok), Some(true), "{ok}");
        }
        for bad in [
            r#"{"p":1.01"#,
            r#"{"p":2"#,
            r#"{"p":-0.1"#,
            r#"{"p":1e0"#,                  // no exponent in a bounded number
            r#"{"p":0.1234567890123"#,      // at most 12 fraction digits
            r#"{"p":0,"q":0.3"#,            // 0.3 itself is excluded
            r#"{"p":0,"q":0.000000000000"#, // nothing left above 0 in 12 places
            r#"{"p":0,"q":0.1,"t":-0.1"#,
            r#"{"p":0,"q":0.1,"t":-0.24"#,
            r#"{"p":0,"q":0.1,"t":-3"#,
            r#"{"p":0,"q":0.1,"t":0"#,
        ] {
            assert_eq!(run(&s, bad), None, "{bad}");
        }
        // `0` may still become 0.1, `-0.2` may still become -0.25 (and end there).
        assert_eq!(run(&s, r#"{"p":0,"q":0"#), Some(false));
        assert_eq!(run(&s, r#"{"p":0,"q":0}"#), None);
        assert_eq!(run(&s, r#"{"p":0,"q":0.1,"t":-0.2"#), Some(false));
        assert_eq!(run(&s, r#"{"p":0,"q":0.1,"t":-0.2}"#), None);
        assert_eq!(run(&s, r#"{"p":0,"q":0.1,"t":-0.25}"#), Some(true));
        // `multipleOf` on a number: quarters in 0..=1.
        let s = CompiledSchema::compile(&json!({"type": "object", "properties": {
            "q": {"type": "number", "minimum": 0, "maximum": 1, "multipleOf": 0.25}}}))
        .unwrap();
        for (text, taken) in [
            (r#"{"q":0.25}"#, Some(true)),
            (r#"{"q":1.0}"#, Some(true)),
            (r#"{"q":0.2"#, Some(false)), // may still become 0.25
            (r#"{"q":0.2}"#, None),
            (r#"{"q":0.3"#, None), // nothing in [0.3, 0.4) is a quarter
            (r#"{"q":0.750000000000}"#, Some(true)),
        ] {
            assert_eq!(run(&s, text), taken, "{text}");
        }
        // Bounds read exactly from their JSON text, whatever their form.
        assert_eq!(units("1e-3", 12), Some((1_000_000_000, 1_000_000_000)));
        assert_eq!(units("-2.5", 0), Some((-3, -2)));
        assert_eq!(units("0.3", 12), Some((300_000_000_000, 300_000_000_000)));
        assert_eq!(units("1e-13", 12), Some((0, 1)));
        assert_eq!(units("1e300", 12), Some((10i128.pow(32), 10i128.pow(32))));
        assert_eq!(units("12", 0), Some((12, 12)));
    }

    #[test]
    fn masked_decoding_writes_patterns_formats_and_bounded_integers() {
        let schema = json!({"type": "object", "properties": {
            "id": {"type": "string", "format": "uuid"},
            "at": {"type": "string", "format": "date-time"},
            "ip": {"type": "string", "format": "ipv6"},
            "code": {"type": "string", "pattern": "^[A-Z]{2}-\\d{3}$"},
            "n": {"type": "integer", "minimum": -5, "maximum": 250},
            "x": {"type": "number", "minimum": 0, "exclusiveMaximum": 1},
            "t": {"type": "number", "minimum": -2.5, "maximum": -0.25}},
            "required": ["id", "at", "ip", "code", "n", "x", "t"]});
        let answers = masked_answers(
            &schema,
            &[
                "{\"", "\":\"", "\",\"", "\":", "2024", "-02-", "T12:", "::", "ab", "AB-", "12",
                "99", "0.", "-0.", "-2.", "5,\"",
            ],
            21,
            150,
        );
        assert!(answers.len() > 100, "only {} finished", answers.len());
        let full = |p: &TextPattern, t: &str| {
            let mut s = 0u16;
            t.bytes().all(|b| p.step(s, b).map(|n| s = n).is_some()) && p.ends(s)
        };
        let date_time = TextPattern::format("date-time", 0, u32::MAX, 4096).unwrap();
        let uuid = TextPattern::format("uuid", 0, u32::MAX, 4096).unwrap();
        let mut widths = std::collections::BTreeSet::new();
        for v in &answers {
            assert!(full(&uuid, v["id"].as_str().unwrap()), "{v}");
            assert!(full(&date_time, v["at"].as_str().unwrap()), "{v}");
            let ip = v["ip"].as_str().unwrap();
            assert!(ip.parse::<std::net::Ipv6Addr>().is_ok(), "{v}");
            let code = v["code"].as_str().unwrap().as_bytes();
            assert!(
                code.len() == 6
                    && code[..2].iter().all(u8::is_ascii_uppercase)
                    && code[2] == b'-'
                    && code[3..].iter().all(u8::is_ascii_digit),
                "{v}"
            );
            let n = v["n"].as_i64().unwrap();
            assert!((-5..=250).contains(&n), "{v}");
            let x = v["x"].as_f64().unwrap();
            assert!((0.0..1.0).contains(&x), "{v}");
            let t = v["t"].as_f64().unwrap();
            assert!((-2.5..=-0.25).contains(&t), "{v}");
            widths.insert(n.to_string().len());
        }
        // The answers differ (the mask does not force one text).
        assert!(widths.len() > 1, "{widths:?}");
    }

    /// In a string held to a pattern the mask takes a shortcut (the pattern's automaton alone
    /// for string-safe tokens): it allows exactly the tokens the whole automaton accepts.
    #[test]
    fn the_pattern_shortcut_allows_what_the_automaton_accepts() {
        use crate::constraint::{Constraint, TokenTable};
        use std::sync::Arc;
        let s = Arc::new(
            CompiledSchema::compile(&json!({"type": "object", "properties": {
                "m": {"type": "string", "format": "email"},
                "p": {"type": "string", "pattern": "(cat|dog)s?$", "maxLength": 12},
                "d": {"type": "string", "format": "date-time"},
                "u": {"type": "string", "format": "uri", "minLength": 1, "maxLength": 2083},
                "q": {"type": "string", "pattern": "^(ab)*$", "maxLength": 4999}}}))
            .unwrap(),
        );
        let pairs = format!("{{\"q\":\"{}", "ab".repeat(2499));
        let pairs_and_a = format!("{{\"q\":\"{}a", "ab".repeat(2498));
        let pieces = [
            "ab",
            "abab",
            "b\"",
            "https://",
            "example.com",
            "/a?b=c",
            "%2",
            "%20",
            "ada",
            "@",
            ".org",
            "cat",
            "dogs",
            "s\"",
            "\"}",
            "\\n",
            "\\u00e9",
            "é",
            "2024-",
            "02-29T",
            "12:",
            "00Z\"",
            "x\"",
            "\u{e9}t\u{e9}",
            "\\\"",
            "\\/",
            "a\"",
            "-",
            ".",
        ];
        let mut vocab: Vec<Option<Vec<u8>>> = (0..=255u8).map(|b| Some(vec![b])).collect();
        vocab.extend(pieces.iter().map(|p| Some(p.as_bytes().to_vec())));
        vocab.push(Some(vec![0xc3]));
        vocab.push(None);
        let table = Arc::new(TokenTable::new(vocab));
        let mut checked = 0;
        for text in [
            "{\"m\":\"",
            "{\"m\":\"ada",
            "{\"m\":\"ada@x",
            "{\"m\":\"ada@x.o",
            "{\"p\":\"",
            "{\"p\":\"my ca",
            "{\"p\":\"my cat",
            "{\"p\":\"abcdefghi",
            "{\"p\":\"abcdefghidog",
            "{\"d\":\"2024-02-2",
            "{\"d\":\"2024-02-29T12:00:00",
            "{\"u\":\"",
            "{\"u\":\"https://example.com",
            "{\"u\":\"https://example.com/a%2",
            pairs.as_str(),
            pairs_and_a.as_str(),
        ] {
            let mut j = SchemaJson::new(&s);
            let mut c = Constraint::JsonSchema(table.clone(), s.clone()).start();
            for b in text.bytes() {
                assert!(j.step(&s, b), "{text}");
                c.advance(u32::from(b));
            }
            assert!(j.plain_pattern(&s).is_some(), "{text}");
            let mut logits = vec![0.0f32; table.len()];
            c.mask(&mut logits, &[table.len() as u32 - 1]);
            for (id, l) in logits.iter().enumerate() {
                let simulated = table.bytes(id as u32).is_some_and(|b| j.accepts(&s, b));
                assert_eq!(
                    *l == 0.0,
                    simulated,
                    "{text} + {:?}",
                    table.bytes(id as u32).map(String::from_utf8_lossy)
                );
                checked += usize::from(simulated);
            }
        }
        assert!(checked > 100, "{checked}");
    }
}
