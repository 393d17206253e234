//! Tool calls and reasoning in answers: the model's generated text split into OpenAI
//! `reasoning_content`, `content` and `tool_calls`, for the formats the common chat templates
//! define (docs/prompt-profiles.md, "Tool calls and reasoning in answers").
//!
//! One incremental parser serves both answer kinds: a streamed answer feeds it each piece of
//! text as it is generated and sends what it returns; a non-streamed answer feeds it the whole
//! text. Text that may still turn into a marker (`<think>`, `</think>`, `<tool_call>`, …) is
//! held back until it is known; a tool section that does not parse is returned as content, so
//! no generated text is ever lost.

use serde_json::Value;
use sha2::{Digest, Sha256};

/// How the model writes tool calls.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ToolCallFormat {
    /// `<tool_call>{"name": …, "arguments": {…}}</tool_call>`, one block per call (Hermes,
    /// Qwen 2.5/3, SmolLM3, …).
    Hermes,
    /// A JSON object `{"name": …, "parameters"|"arguments": {…}}` as the whole answer, several
    /// separated by `;`, optionally after `<|python_tag|>` (Llama 3.1/3.2/3.3).
    Llama3Json,
    /// `[TOOL_CALLS]` then a JSON array of `{"name", "arguments"}` (Mistral v0.3) or
    /// `name[ARGS]{…}` per call (Mistral Small 3.2 / Devstral / Magistral).
    Mistral,
    /// `<｜tool▁calls▁begin｜>` … `<｜tool▁call▁begin｜>` [`function<｜tool▁sep｜>NAME\n```json\n{…}\n```` |
    /// `NAME<｜tool▁sep｜>{…}`] `<｜tool▁call▁end｜>` … (DeepSeek V3, V3.1, R1-0528).
    DeepSeek,
}

impl ToolCallFormat {
    /// `hermes`, `llama3_json`, `mistral`, `deepseek_v3` (vLLM's parser names).
    pub fn parse_name(s: &str) -> Option<Self> {
        Some(match s {
            "hermes" => ToolCallFormat::Hermes,
            "llama3_json" => ToolCallFormat::Llama3Json,
            "mistral" => ToolCallFormat::Mistral,
            "deepseek_v3" => ToolCallFormat::DeepSeek,
            _ => return None,
        })
    }

    /// The format a chat template's source asks for, if it names one's markers.
    pub fn detect(template: &str) -> Option<Self> {
        if template.contains("<｜tool▁call▁begin｜>") || template.contains("<｜tool▁calls▁begin｜>")
        {
            Some(ToolCallFormat::DeepSeek)
        } else if template.contains("[TOOL_CALLS]") {
            Some(ToolCallFormat::Mistral)
        } else if template.contains("<tool_call>") {
            Some(ToolCallFormat::Hermes)
        } else if template.contains("<|python_tag|>") {
            Some(ToolCallFormat::Llama3Json)
        } else {
            None
        }
    }

    /// Whether the format's markers are special tokens that the detokenizer must not skip.
    pub fn needs_special_tokens(self) -> bool {
        matches!(self, ToolCallFormat::Mistral | ToolCallFormat::DeepSeek)
    }
}

/// A tool call the request forces (`tool_choice`), written as JSON under constrained decoding
/// (whatever the model's own tool-call format), so it is read as JSON, not as the model's
/// format.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ForcedCall {
    /// `{"type": "function", "function": {"name": …}}`: the answer is the arguments object of
    /// that function.
    Named(String),
    /// `required` with `parallel_tool_calls: false`: the answer is `{"name": …, "arguments":
    /// {…}}`.
    Required,
    /// `required` with parallel calls (`parallel_tool_calls` absent or `true`, OpenAI's
    /// default): the answer is a JSON array of 1 to [`MAX_PARALLEL_CALLS`] such calls.
    RequiredList,
}

/// The most calls one answer to `tool_choice: "required"` may make with parallel calls.
pub const MAX_PARALLEL_CALLS: u32 = 16;

/// How the model writes its reasoning.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReasoningFormat {
    /// `<think>…</think>` before the answer (Qwen 3, QwQ, DeepSeek R1, SmolLM3, …). When the
    /// rendered prompt ends inside an open `<think>`, the answer starts in reasoning.
    Think,
}

impl ReasoningFormat {
    /// `think` (also vLLM's `qwen3` and `deepseek_r1`).
    pub fn parse_name(s: &str) -> Option<Self> {
        matches!(s, "think" | "qwen3" | "deepseek_r1").then_some(ReasoningFormat::Think)
    }

    /// The format a chat template's source asks for.
    pub fn detect(template: &str) -> Option<Self> {
        template
            .contains("</think>")
            .then_some(ReasoningFormat::Think)
    }
}

/// One piece of a parsed answer, in order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Piece {
    /// Reasoning text.
    Reasoning(String),
    /// Answer text.
    Content(String),
    /// A complete tool call.
    ToolCall(ToolCall),
}

/// A parsed tool call.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ToolCall {
    /// Position among the answer's calls (0-based).
    pub index: usize,
    /// `call_<24 hex>`: SHA-256 of the request id, `:` and the index.
    pub id: String,
    pub name: String,
    /// The arguments object as compact JSON text.
    pub arguments: String,
}

const THINK_OPEN: &str = "<think>";
const THINK_CLOSE: &str = "</think>";
const HERMES_OPEN: &str = "<tool_call>";
const HERMES_CLOSE: &str = "</tool_call>";
const PYTHON_TAG: &str = "<|python_tag|>";
const MISTRAL_TAG: &str = "[TOOL_CALLS]";
const DS_CALLS_BEGIN: &str = "<｜tool▁calls▁begin｜>";
const DS_CALLS_END: &str = "<｜tool▁calls▁end｜>";
const DS_CALL_BEGIN: &str = "<｜tool▁call▁begin｜>";
const DS_CALL_END: &str = "<｜tool▁call▁end｜>";
const DS_SEP: &str = "<｜tool▁sep｜>";

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    /// Nothing decided yet: the answer may open with `<think>`.
    Start,
    Reasoning,
    Content,
    /// Inside the tool-call section (to the end of the answer).
    Tools,
}

/// The incremental parser of one answer.
#[derive(Debug)]
pub struct AnswerParser {
    reasoning: Option<ReasoningFormat>,
    tools: Option<ToolCallFormat>,
    phase: Phase,
    /// Text received and not yet given out.
    buf: String,
    /// Content was given out already (Llama 3 JSON calls only start an answer).
    content_started: bool,
    /// Drop whitespace before the first content after reasoning.
    strip_leading: bool,
    calls: usize,
    request_id: String,
    /// The answer is one forced call (held to the end, then given out as the call), or a
    /// list of them (each given out as soon as it is whole).
    forced: Option<ForcedCall>,
    /// `parallel_tool_calls: false`: calls after the first are not given out.
    single_call: bool,
}

impl AnswerParser {
    /// A parser for one answer. `starts_in_reasoning`: the rendered prompt ended inside an
    /// open `<think>` (see [`prompt_opens_reasoning`]).
    pub fn new(
        reasoning: Option<ReasoningFormat>,
        tools: Option<ToolCallFormat>,
        starts_in_reasoning: bool,
        request_id: &str,
    ) -> Self {
        let phase = match reasoning {
            Some(_) if starts_in_reasoning => Phase::Reasoning,
            Some(_) => Phase::Start,
            None => Phase::Content,
        };
        AnswerParser {
            reasoning,
            tools,
            phase,
            buf: String::new(),
            content_started: false,
            strip_leading: false,
            calls: 0,
            request_id: request_id.to_string(),
            forced: None,
            single_call: false,
        }
    }

    /// With `single`, at most one tool call is given out (`parallel_tool_calls: false`); the
    /// model's further calls are dropped, as vLLM drops them.
    pub fn with_single_call(mut self, single: bool) -> Self {
        self.single_call = single;
        self
    }

    /// A parser for an answer that is one forced call (no reasoning, no model format).
    pub fn forced(call: ForcedCall, request_id: &str) -> Self {
        AnswerParser {
            forced: Some(call),
            ..AnswerParser::new(None, None, false, request_id)
        }
    }

    /// Whether this parser changes anything (some format is set).
    pub fn is_active(&self) -> bool {
        self.reasoning.is_some() || self.tools.is_some() || self.forced.is_some()
    }

    /// Tool calls given out so far.
    pub fn tool_calls(&self) -> usize {
        self.calls
    }

    /// Takes newly generated text; returns the pieces now known.
    pub fn feed(&mut self, text: &str) -> Vec<Piece> {
        self.buf.push_str(text);
        let mut out = Vec::new();
        self.run(&mut out, false);
        out
    }

    /// The answer ended: everything left, as pieces.
    pub fn finish(&mut self) -> Vec<Piece> {
        let mut out = Vec::new();
        self.run(&mut out, true);
        out
    }

    fn run(&mut self, out: &mut Vec<Piece>, end: bool) {
        if self.forced == Some(ForcedCall::RequiredList) {
            self.take_whole_calls(out, end);
            return;
        }
        if let Some(call) = &self.forced {
            if !end {
                return;
            }
            let text = std::mem::take(&mut self.buf);
            let parsed = match call {
                // The arguments as written (cut short by `max_tokens`, a prefix of them, as
                // OpenAI gives them with finish reason `length`).
                ForcedCall::Named(name) => Some((name.clone(), text.trim().to_string())),
                ForcedCall::Required | ForcedCall::RequiredList => parse_call(&text),
            };
            match parsed {
                Some((name, args)) => out.push(self.call(name, args)),
                // A `required` call cut short: no name to give it; the text is content.
                None => self.push_content(out, text),
            }
            return;
        }
        loop {
            match self.phase {
                Phase::Start => {
                    let t = self.buf.trim_start();
                    if let Some(rest) = t.strip_prefix(THINK_OPEN) {
                        self.buf = rest.to_string();
                        self.phase = Phase::Reasoning;
                    } else if !end && THINK_OPEN.starts_with(t) {
                        return; // may still become `<think>`
                    } else {
                        self.phase = Phase::Content;
                    }
                }
                Phase::Reasoning => match self.buf.find(THINK_CLOSE) {
                    Some(i) => {
                        let reasoning = self.buf[..i].to_string();
                        self.buf.drain(..i + THINK_CLOSE.len());
                        push_reasoning(out, reasoning);
                        self.phase = Phase::Content;
                        self.strip_leading = true;
                    }
                    None => {
                        let keep = if end {
                            0
                        } else {
                            held_suffix(&self.buf, &[THINK_CLOSE])
                        };
                        let cut = self.buf.len() - keep;
                        let reasoning: String = self.buf.drain(..cut).collect();
                        push_reasoning(out, reasoning);
                        return;
                    }
                },
                Phase::Content => {
                    if self.strip_leading {
                        let trimmed = self.buf.trim_start().len();
                        self.buf.drain(..self.buf.len() - trimmed);
                        if self.buf.is_empty() {
                            return;
                        }
                        self.strip_leading = false;
                    }
                    match self.tools {
                        None => {
                            let all = std::mem::take(&mut self.buf);
                            self.push_content(out, all);
                            return;
                        }
                        Some(ToolCallFormat::Llama3Json) => {
                            if self.content_started {
                                let all = std::mem::take(&mut self.buf);
                                self.push_content(out, all);
                                return;
                            }
                            let t = self.buf.trim_start();
                            if t.starts_with('{') || t.starts_with(PYTHON_TAG) {
                                self.phase = Phase::Tools;
                            } else if !end && (t.is_empty() || PYTHON_TAG.starts_with(t)) {
                                return;
                            } else {
                                let all = std::mem::take(&mut self.buf);
                                self.push_content(out, all);
                                return;
                            }
                        }
                        Some(format) => {
                            let markers = open_markers(format);
                            let hit = markers.iter().filter_map(|m| self.buf.find(m)).min();
                            match hit {
                                Some(i) => {
                                    let before: String = self.buf.drain(..i).collect();
                                    self.push_content(out, before);
                                    self.phase = Phase::Tools;
                                }
                                None => {
                                    let keep = if end {
                                        0
                                    } else {
                                        held_suffix(&self.buf, markers)
                                    };
                                    let cut = self.buf.len() - keep;
                                    let text: String = self.buf.drain(..cut).collect();
                                    self.push_content(out, text);
                                    return;
                                }
                            }
                        }
                    }
                }
                Phase::Tools => {
                    if self.tools == Some(ToolCallFormat::Hermes) {
                        // Calls are given out as each block closes.
                        let t = self.buf.trim_start();
                        if let Some(body) = t.strip_prefix(HERMES_OPEN) {
                            if let Some(close) = body.find(HERMES_CLOSE) {
                                let call = parse_call(&body[..close]);
                                let consumed =
                                    self.buf.len() - body.len() + close + HERMES_CLOSE.len();
                                match call {
                                    Some((name, args)) => {
                                        self.buf.drain(..consumed);
                                        self.push_call(out, name, args);
                                        continue;
                                    }
                                    None => {
                                        // Not a call: the rest is content.
                                        self.phase_to_plain_content();
                                        continue;
                                    }
                                }
                            }
                            if end {
                                // No closing tag (the answer stopped at eos): parse what is there.
                                if let Some((name, args)) = parse_call(body) {
                                    self.buf.clear();
                                    self.push_call(out, name, args);
                                    return;
                                }
                                self.phase_to_plain_content();
                                continue;
                            }
                            return;
                        }
                        if t.is_empty() && !end {
                            return;
                        }
                        if !end && HERMES_OPEN.starts_with(t) {
                            return;
                        }
                        // Text after the calls: content again (more calls may follow).
                        self.phase = Phase::Content;
                        if t.is_empty() {
                            self.buf.clear();
                            return;
                        }
                        continue;
                    }
                    if !end {
                        return;
                    }
                    let section = std::mem::take(&mut self.buf);
                    match parse_section(self.tools, &section) {
                        Some(calls) if !calls.is_empty() => {
                            for (name, args) in calls {
                                self.push_call(out, name, args);
                            }
                        }
                        _ => self.push_content(out, section),
                    }
                    return;
                }
            }
        }
    }

    /// Give up on tool parsing for the rest of the answer: it is content.
    fn phase_to_plain_content(&mut self) {
        self.tools = None;
        self.phase = Phase::Content;
    }

    /// A forced list `[call, call, …]`: gives out each call as soon as it is whole, so a client
    /// can start the first tool while the model writes the next. At the end, text that is not
    /// a whole call (a call cut by `max_tokens`) is content: the cut call's text after whole
    /// ones, or everything when no call was whole.
    /// The text stays whole in `buf` until the first call is (its `[` included), so an answer
    /// cut before it is given out as it was written.
    fn take_whole_calls(&mut self, out: &mut Vec<Piece>, end: bool) {
        loop {
            // The first call follows the `[`, the next ones a `,`.
            let opens = if self.calls == 0 { '[' } else { ',' };
            let Some(item) = self.buf.trim_start().strip_prefix(opens) else {
                break;
            };
            let item = item.trim_start();
            let mut values = serde_json::Deserializer::from_str(item).into_iter::<Value>();
            let Some(call) = values.next().and_then(Result::ok).and_then(|v| call_of(&v)) else {
                break;
            };
            let rest = item
                .get(values.byte_offset()..)
                .unwrap_or_default()
                .to_string();
            self.buf = rest;
            let piece = self.call(call.0, call.1);
            out.push(piece);
        }
        if !end {
            return;
        }
        let text = std::mem::take(&mut self.buf);
        let opens = if self.calls == 0 { '[' } else { ',' };
        let rest = text.trim_start();
        let rest = rest.strip_prefix(opens).unwrap_or(rest).trim();
        if rest.is_empty() || rest == "]" {
            return;
        }
        let given = if self.calls == 0 {
            // No whole call: everything, as written.
            text.to_string()
        } else {
            rest.to_string()
        };
        self.push_content(out, given);
    }

    fn push_content(&mut self, out: &mut Vec<Piece>, text: String) {
        if text.is_empty() {
            return;
        }
        self.content_started = true;
        if let Some(Piece::Content(prev)) = out.last_mut() {
            prev.push_str(&text);
        } else {
            out.push(Piece::Content(text));
        }
    }

    /// Gives out a parsed call unless one was given and only one may be.
    fn push_call(&mut self, out: &mut Vec<Piece>, name: String, arguments: String) {
        if self.single_call && self.calls > 0 {
            return;
        }
        let piece = self.call(name, arguments);
        out.push(piece);
    }

    fn call(&mut self, name: String, arguments: String) -> Piece {
        let index = self.calls;
        self.calls += 1;
        let digest = Sha256::digest(format!("{}:{index}", self.request_id).as_bytes());
        Piece::ToolCall(ToolCall {
            index,
            id: format!("call_{}", &hex::encode(digest)[..24]),
            name,
            arguments,
        })
    }
}

fn push_reasoning(out: &mut Vec<Piece>, text: String) {
    if text.is_empty() {
        return;
    }
    if let Some(Piece::Reasoning(prev)) = out.last_mut() {
        prev.push_str(&text);
    } else {
        out.push(Piece::Reasoning(text));
    }
}

/// Whether a rendered prompt ends inside an open `<think>` (its last `<think>` is after its
/// last `</think>`), so the answer starts in reasoning (DeepSeek R1, QwQ, …).
pub fn prompt_opens_reasoning(prompt: &str) -> bool {
    match (prompt.rfind(THINK_OPEN), prompt.rfind(THINK_CLOSE)) {
        (Some(o), Some(c)) => o > c,
        (Some(_), None) => true,
        _ => false,
    }
}

fn open_markers(format: ToolCallFormat) -> &'static [&'static str] {
    match format {
        ToolCallFormat::Hermes => &[HERMES_OPEN],
        ToolCallFormat::Mistral => &[MISTRAL_TAG],
        ToolCallFormat::DeepSeek => &[DS_CALLS_BEGIN, DS_CALL_BEGIN],
        ToolCallFormat::Llama3Json => &[PYTHON_TAG],
    }
}

/// The length of the longest suffix of `text` that is a proper prefix of one of `markers`
/// (on a char boundary).
fn held_suffix(text: &str, markers: &[&str]) -> usize {
    for (at, _) in text.char_indices() {
        let suffix = &text[at..];
        if markers
            .iter()
            .any(|m| m.len() > suffix.len() && m.starts_with(suffix))
        {
            return suffix.len();
        }
    }
    0
}

/// `{"name": …, "arguments"|"parameters": {…}}` → (name, compact arguments JSON).
fn parse_call(json: &str) -> Option<(String, String)> {
    let v: Value = serde_json::from_str(json.trim()).ok()?;
    call_of(&v)
}

fn call_of(v: &Value) -> Option<(String, String)> {
    let name = v.get("name")?.as_str()?.to_string();
    let args = v
        .get("arguments")
        .or_else(|| v.get("parameters"))
        .cloned()
        .unwrap_or(Value::Object(Default::default()));
    let args = match args {
        // Some models write the arguments as a JSON string.
        Value::String(s) => serde_json::from_str::<Value>(&s).ok()?,
        other => other,
    };
    if !args.is_object() {
        return None;
    }
    Some((name, serde_json::to_string(&args).ok()?))
}

/// The calls of a whole tool section (all formats but Hermes, which is parsed block by block).
fn parse_section(format: Option<ToolCallFormat>, section: &str) -> Option<Vec<(String, String)>> {
    match format? {
        ToolCallFormat::Hermes => None,
        ToolCallFormat::Llama3Json => {
            let body = section.trim_start();
            let mut rest = body.strip_prefix(PYTHON_TAG).unwrap_or(body);
            let mut calls = Vec::new();
            loop {
                let t = rest.trim_start();
                if t.is_empty() {
                    break;
                }
                let mut values = serde_json::Deserializer::from_str(t).into_iter::<Value>();
                let v = values.next()?.ok()?;
                calls.push(call_of(&v)?);
                // Calls are separated by `;`.
                let after = t[values.byte_offset()..].trim_start();
                rest = match after.strip_prefix(';') {
                    Some(r) => r,
                    None if after.is_empty() => "",
                    None => return None,
                };
            }
            Some(calls)
        }
        ToolCallFormat::Mistral => {
            let body = section.trim_start().strip_prefix(MISTRAL_TAG)?.trim();
            if body.starts_with('[') {
                let v: Value = serde_json::from_str(body).ok()?;
                return v.as_array()?.iter().map(call_of).collect();
            }
            // `name[ARGS]{…}` per call, each after its own [TOOL_CALLS].
            let mut calls = Vec::new();
            for part in body.split(MISTRAL_TAG) {
                let part = part.trim();
                if part.is_empty() {
                    continue;
                }
                let (name, args) = part.split_once("[ARGS]")?;
                let args: Value = serde_json::from_str(args.trim()).ok()?;
                if !args.is_object() || name.trim().is_empty() {
                    return None;
                }
                calls.push((name.trim().to_string(), serde_json::to_string(&args).ok()?));
            }
            Some(calls)
        }
        ToolCallFormat::DeepSeek => {
            let body = section.trim();
            let body = body.strip_prefix(DS_CALLS_BEGIN).unwrap_or(body);
            let body = body.trim_end();
            let body = body.strip_suffix(DS_CALLS_END).unwrap_or(body);
            let mut calls = Vec::new();
            for part in body.split(DS_CALL_BEGIN) {
                if part.trim().is_empty() {
                    continue;
                }
                let inner = part.trim().strip_suffix(DS_CALL_END)?;
                let (head, tail) = inner.split_once(DS_SEP)?;
                let (name, args) = if head.trim() == "function" {
                    // V3: `function<sep>NAME\n```json\n{…}\n````
                    let (name, rest) = tail.split_once('\n')?;
                    let rest = rest.trim();
                    let rest = rest.strip_prefix("```json").unwrap_or(rest);
                    let rest = rest.trim().strip_suffix("```").unwrap_or(rest);
                    (name.trim(), rest.trim())
                } else {
                    // V3.1: `NAME<sep>{…}`
                    (head.trim(), tail.trim())
                };
                let args: Value = serde_json::from_str(args).ok()?;
                if !args.is_object() || name.is_empty() {
                    return None;
                }
                calls.push((name.to_string(), serde_json::to_string(&args).ok()?));
            }
            Some(calls)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// (reasoning, content, calls as (name, arguments)).
    type Parsed = (String, String, Vec<(String, String)>);

    fn merge(pieces: Vec<Piece>) -> Parsed {
        let mut p = Parsed::default();
        for piece in pieces {
            match piece {
                Piece::Reasoning(r) => p.0.push_str(&r),
                Piece::Content(c) => p.1.push_str(&c),
                Piece::ToolCall(t) => p.2.push((t.name, t.arguments)),
            }
        }
        p
    }

    /// A forced answer fed whole, then split in two at every place, then a char at a time:
    /// the same pieces every way.
    fn forced(call: ForcedCall, text: &str) -> Parsed {
        let run = |parts: &[&str]| {
            let mut p = AnswerParser::forced(call.clone(), "req-1");
            let mut pieces = Vec::new();
            for part in parts {
                pieces.extend(p.feed(part));
            }
            pieces.extend(p.finish());
            merge(pieces)
        };
        let whole = run(&[text]);
        for (at, _) in text.char_indices().skip(1) {
            assert_eq!(
                run(&[&text[..at], &text[at..]]),
                whole,
                "split at {at} of {text:?}"
            );
        }
        let chars: Vec<String> = text.chars().map(String::from).collect();
        let chars: Vec<&str> = chars.iter().map(String::as_str).collect();
        assert_eq!(run(&chars), whole, "char by char: {text:?}");
        whole
    }

    #[test]
    fn a_forced_list_gives_each_call_as_soon_as_it_is_whole() {
        let mut p = AnswerParser::forced(ForcedCall::RequiredList, "req-1");
        let mut first = p.feed(r#"[{"name":"f","arguments":{"a":1}}"#);
        first.extend(p.feed(r#", {"name":"g","argu"#));
        assert_eq!(
            merge(first),
            (
                String::new(),
                String::new(),
                vec![("f".to_string(), r#"{"a":1}"#.to_string())]
            )
        );
        let rest = p.feed(r#"ments":{}}]"#).into_iter().chain(p.finish());
        assert_eq!(
            merge(rest.collect()),
            (
                String::new(),
                String::new(),
                vec![("g".to_string(), "{}".to_string())]
            )
        );
    }

    #[test]
    fn a_list_of_forced_calls_gives_every_whole_call() {
        let call = |n: &str, a: &str| (n.to_string(), a.to_string());
        // Whole lists: one call, two, whitespace as the automaton allows it.
        assert_eq!(
            forced(
                ForcedCall::RequiredList,
                r#"[{"name":"f","arguments":{"a":1}}]"#
            ),
            (String::new(), String::new(), vec![call("f", r#"{"a":1}"#)])
        );
        assert_eq!(
            forced(
                ForcedCall::RequiredList,
                r#" [ {"name": "f", "arguments": {}} ,
 {"name": "g", "arguments": {"b": "x, y]"}} ] "#
            ),
            (
                String::new(),
                String::new(),
                vec![call("f", "{}"), call("g", r#"{"b":"x, y]"}"#)]
            )
        );
        // Cut by max_tokens: the whole calls, then the cut one's text as content.
        assert_eq!(
            forced(
                ForcedCall::RequiredList,
                r#"[{"name":"f","arguments":{}}, {"name":"g","argu"#
            ),
            (
                String::new(),
                r#"{"name":"g","argu"#.to_string(),
                vec![call("f", "{}")]
            )
        );
        // Cut right after a call: nothing lost, nothing added.
        assert_eq!(
            forced(ForcedCall::RequiredList, r#"[{"name":"f","arguments":{}},"#),
            (String::new(), String::new(), vec![call("f", "{}")])
        );
        // No whole call: the text as content, as a single cut call is.
        let cut = r#"[{"name":"f","arg"#;
        assert_eq!(
            forced(ForcedCall::RequiredList, cut),
            (String::new(), cut.to_string(), vec![])
        );
        // Ids: one per call, in order, distinct.
        let mut p = AnswerParser::forced(ForcedCall::RequiredList, "req-1");
        let ids: Vec<String> = p
            .feed(r#"[{"name":"f","arguments":{}},{"name":"f","arguments":{}}]"#)
            .into_iter()
            .chain(p.finish())
            .filter_map(|piece| match piece {
                Piece::ToolCall(t) => Some(format!("{}:{}", t.index, t.id)),
                _ => None,
            })
            .collect();
        assert_eq!(ids.len(), 2);
        assert!(ids[0].starts_with("0:call_") && ids[1].starts_with("1:call_"));
        assert_ne!(ids[0][2..], ids[1][2..]);
    }

    fn parser(r: bool, t: Option<ToolCallFormat>, open: bool) -> AnswerParser {
        AnswerParser::new(r.then_some(ReasoningFormat::Think), t, open, "req-1")
    }

    /// Whole text at once, and every split into two feeds, and one char per feed: all equal.
    fn parse_all_ways(r: bool, t: Option<ToolCallFormat>, open: bool, text: &str) -> Parsed {
        let mut p = parser(r, t, open);
        let mut pieces = p.feed(text);
        pieces.extend(p.finish());
        let whole = merge(pieces);
        for (at, _) in text.char_indices().skip(1) {
            let mut p = parser(r, t, open);
            let mut pieces = p.feed(&text[..at]);
            pieces.extend(p.feed(&text[at..]));
            pieces.extend(p.finish());
            assert_eq!(merge(pieces), whole, "split at {at} of {text:?}");
        }
        let mut p = parser(r, t, open);
        let mut pieces = Vec::new();
        for c in text.chars() {
            pieces.extend(p.feed(&c.to_string()));
        }
        pieces.extend(p.finish());
        assert_eq!(merge(pieces), whole, "char by char: {text:?}");
        whole
    }

    fn call(name: &str, args: &str) -> (String, String) {
        (name.to_string(), args.to_string())
    }

    #[test]
    fn hermes_calls_with_reasoning_and_text() {
        let h = Some(ToolCallFormat::Hermes);
        let text = "<think>\nThe user wants Paris.\n</think>\n\nLet me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"unit\": \"C\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call>";
        let p = parse_all_ways(true, h, false, text);
        assert_eq!(p.0, "\nThe user wants Paris.\n");
        assert_eq!(p.1, "Let me check.\n");
        assert_eq!(
            p.2,
            vec![
                call("get_weather", r#"{"city":"Paris","unit":"C"}"#),
                call("get_time", "{}")
            ]
        );
        // What SmolLM2 writes with few-shot examples (measured): one call, nothing else.
        let p = parse_all_ways(
            false,
            h,
            false,
            "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>",
        );
        assert_eq!(
            p,
            (
                String::new(),
                String::new(),
                vec![call("get_weather", r#"{"city":"Paris"}"#)]
            )
        );
        // Cut by eos before the closing tag: still a call.
        let p = parse_all_ways(
            false,
            h,
            false,
            "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": 1}}",
        );
        assert_eq!(p.2, vec![call("f", r#"{"a":1}"#)]);
        // Not JSON: kept as content, nothing lost.
        let bad = "Sure <tool_call>{not json}</tool_call> done";
        let p = parse_all_ways(false, h, false, bad);
        assert_eq!(p, (String::new(), bad.to_string(), vec![]));
        // Plain text that merely looks like a tag's start.
        let p = parse_all_ways(false, h, false, "a < b and <tool is fine");
        assert_eq!(p.1, "a < b and <tool is fine");
    }

    #[test]
    fn reasoning_opened_by_the_prompt_and_unclosed() {
        // The prompt ended with `<think>\n`: the answer starts inside reasoning (DeepSeek R1).
        assert!(prompt_opens_reasoning("<|im_start|>assistant\n<think>\n"));
        assert!(!prompt_opens_reasoning("<think>\n\n</think>\n\n"));
        assert!(!prompt_opens_reasoning("plain"));
        let p = parse_all_ways(true, None, true, "Two plus two.</think>\n\nIt is 4.");
        assert_eq!((p.0.as_str(), p.1.as_str()), ("Two plus two.", "It is 4."));
        // Cut by max_tokens inside reasoning: everything is reasoning.
        let p = parse_all_ways(true, None, false, "<think>still thinking");
        assert_eq!((p.0.as_str(), p.1.as_str()), ("still thinking", ""));
        // No think block at all: content.
        let p = parse_all_ways(true, None, false, "Just <b>bold</b>.");
        assert_eq!((p.0.as_str(), p.1.as_str()), ("", "Just <b>bold</b>."));
    }

    /// `parallel_tool_calls: false`: the first call is given out, the model's further calls
    /// are not (Hermes blocks one by one, a Llama 3 section at once); text around them stays.
    #[test]
    fn one_call_when_parallel_calls_are_off() {
        let single = |t: Option<ToolCallFormat>, text: &str| {
            let mut p = parser(false, t, false).with_single_call(true);
            let mut pieces = p.feed(text);
            pieces.extend(p.finish());
            (merge(pieces), p.tool_calls())
        };
        let (p, given) = single(
            Some(ToolCallFormat::Hermes),
            "Checking.\n<tool_call>\n{\"name\": \"a\", \"arguments\": {}}\n</tool_call>\n<tool_call>\n{\"name\": \"b\", \"arguments\": {}}\n</tool_call>",
        );
        assert_eq!(p.1, "Checking.\n");
        assert_eq!((p.2, given), (vec![call("a", "{}")], 1));
        let (p, given) = single(
            Some(ToolCallFormat::Llama3Json),
            "<|python_tag|>{\"name\": \"a\", \"parameters\": {}}; {\"name\": \"b\", \"parameters\": {}}",
        );
        assert_eq!((p.2, given), (vec![call("a", "{}")], 1));
        // Off by default: both.
        let mut p = parser(false, Some(ToolCallFormat::Llama3Json), false);
        p.feed("{\"name\": \"a\", \"parameters\": {}}; {\"name\": \"b\", \"parameters\": {}}");
        p.finish();
        assert_eq!(p.tool_calls(), 2);
    }

    #[test]
    fn llama3_json_calls() {
        let l = Some(ToolCallFormat::Llama3Json);
        let p = parse_all_ways(
            false,
            l,
            false,
            "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\"}}",
        );
        assert_eq!(p.2, vec![call("get_weather", r#"{"city":"Paris"}"#)]);
        assert_eq!(p.1, "");
        let p = parse_all_ways(
            false,
            l,
            false,
            "<|python_tag|>{\"name\": \"a\", \"parameters\": {}}; {\"name\": \"b\", \"arguments\": \"{\\\"x\\\": 2}\"}",
        );
        assert_eq!(p.2, vec![call("a", "{}"), call("b", r#"{"x":2}"#)]);
        // Prose is content, even with JSON later in it.
        let t = "The answer is {\"name\": \"x\"}";
        assert_eq!(parse_all_ways(false, l, false, t).1, t);
        // Broken JSON: content.
        let t = "{\"name\": \"get_weather\", \"parameters\": {\"city\": ";
        assert_eq!(
            parse_all_ways(false, l, false, t),
            (String::new(), t.to_string(), vec![])
        );
    }

    #[test]
    fn mistral_calls_both_syntaxes() {
        let m = Some(ToolCallFormat::Mistral);
        let p = parse_all_ways(
            false,
            m,
            false,
            "[TOOL_CALLS] [{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}, {\"name\": \"t\", \"arguments\": {}}]",
        );
        assert_eq!(
            p.2,
            vec![call("get_weather", r#"{"city":"Paris"}"#), call("t", "{}")]
        );
        let p = parse_all_ways(
            false,
            m,
            false,
            "Checking.[TOOL_CALLS]get_weather[ARGS]{\"city\": \"Paris\"}[TOOL_CALLS]t[ARGS]{}",
        );
        assert_eq!(p.1, "Checking.");
        assert_eq!(
            p.2,
            vec![call("get_weather", r#"{"city":"Paris"}"#), call("t", "{}")]
        );
    }

    #[test]
    fn deepseek_calls_v3_and_v31() {
        let d = Some(ToolCallFormat::DeepSeek);
        let v3 = "Let me look.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{\"city\": \"Paris\"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>";
        let p = parse_all_ways(false, d, false, v3);
        assert_eq!(p.1, "Let me look.");
        assert_eq!(p.2, vec![call("get_weather", r#"{"city":"Paris"}"#)]);
        let v31 = "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{\"city\": \"Paris\"}<｜tool▁call▁end｜><｜tool▁call▁begin｜>t<｜tool▁sep｜>{}<｜tool▁call▁end｜><｜tool▁calls▁end｜>";
        let p = parse_all_ways(false, d, false, v31);
        assert_eq!(
            p.2,
            vec![call("get_weather", r#"{"city":"Paris"}"#), call("t", "{}")]
        );
    }

    #[test]
    fn ids_are_stable_per_request_and_index() {
        let mut p = parser(false, Some(ToolCallFormat::Hermes), false);
        let mut pieces = p.feed("<tool_call>{\"name\":\"a\",\"arguments\":{}}</tool_call><tool_call>{\"name\":\"b\",\"arguments\":{}}</tool_call>");
        pieces.extend(p.finish());
        let ids: Vec<String> = pieces
            .into_iter()
            .filter_map(|x| match x {
                Piece::ToolCall(t) => Some(t.id),
                _ => None,
            })
            .collect();
        assert_eq!(ids.len(), 2);
        assert_ne!(ids[0], ids[1]);
        assert!(ids.iter().all(|i| i.starts_with("call_") && i.len() == 29));
        assert_eq!(p.tool_calls(), 2);
    }

    #[test]
    fn formats_from_templates_and_names() {
        assert_eq!(
            ToolCallFormat::detect("{{ '<tool_call>' }}"),
            Some(ToolCallFormat::Hermes)
        );
        assert_eq!(
            ToolCallFormat::detect("[TOOL_CALLS]"),
            Some(ToolCallFormat::Mistral)
        );
        assert_eq!(
            ToolCallFormat::detect("<|python_tag|>"),
            Some(ToolCallFormat::Llama3Json)
        );
        assert_eq!(
            ToolCallFormat::detect("<｜tool▁calls▁begin｜>"),
            Some(ToolCallFormat::DeepSeek)
        );
        assert_eq!(ToolCallFormat::detect("{{ messages }}"), None);
        assert_eq!(
            ReasoningFormat::detect("</think>"),
            Some(ReasoningFormat::Think)
        );
        assert_eq!(
            ToolCallFormat::parse_name("hermes"),
            Some(ToolCallFormat::Hermes)
        );
        assert_eq!(
            ReasoningFormat::parse_name("deepseek_r1"),
            Some(ReasoningFormat::Think)
        );
        assert_eq!(ToolCallFormat::parse_name("nope"), None);
    }
}
