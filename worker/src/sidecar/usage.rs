//! What a native engine's answer says about the request it served: prompt, cached and
//! completion tokens, finish reason, the generated text (hashed into the receipt) and when the
//! first token came. Read from OpenAI-shaped answers, whole (`application/json`) or streamed
//! (SSE chunks), without changing a byte of them.
//!
//! Where the counts come from, in order: the OpenAI `usage` object (`prompt_tokens`,
//! `completion_tokens`, `prompt_tokens_details.cached_tokens`); else llama.cpp's `timings`
//! (`cache_n` cached, `prompt_n` evaluated, `predicted_n` generated; prompt = cache_n + prompt_n),
//! which `llama-server` puts on the last chunk of every stream even without
//! `stream_options.include_usage`. An engine that reports neither leaves them 0 (the receipt
//! then says 0, never a guess).
//!
//! The generated text of each choice (by its `index`, 0 when absent) is the concatenation, in
//! arrival order, of its `message.content` / `delta.content` (chat) or `text` (completions);
//! reasoning and tool-call deltas are not part of it. The receipt's `response_sha256` and
//! `finish_reason` come from the choices as on the embedded worker
//! ([`receipts::response_sha256`], [`receipts::finish_reason_of`]). O(answer bytes); the text
//! kept is bounded by the answer's size, which the relay bounds, and indexes by
//! [`MAX_CHOICES`] (a higher index counts as the last).

use serde_json::Value;
use sha2::{Digest, Sha256};

/// The most choices told apart (OpenAI's largest `n`); a choice index beyond counts as the last.
pub const MAX_CHOICES: usize = 128;

/// Accounting of one answer, fed piece by piece.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: Option<u32>,
    pub cached_tokens: Option<u32>,
    pub completion_tokens: Option<u32>,
    /// The model the engine says it ran.
    pub model: Option<String>,
    /// The generated text and finish reason of each choice seen so far, by index.
    pub choices: Vec<(String, Option<String>)>,
    /// Whether any generated text (or a finish) has been seen: the first token's mark.
    pub produced: bool,
    /// Stream chunks that carried generated output for some choice (text, reasoning or a tool
    /// call's piece), each counted once per choice: an engine streams one token per such chunk,
    /// so this is the load report's count of generated tokens ([`super::load`]).
    pub pieces: u64,
    /// `usage` was present (it wins over `timings`).
    from_usage: bool,
}

fn as_u32(v: Option<&Value>) -> Option<u32> {
    v.and_then(Value::as_u64)
        .map(|n| u32::try_from(n).unwrap_or(u32::MAX))
}

/// Whether a stream chunk's choice carries generated output: a `delta` with non-empty
/// `content`, `reasoning_content`/`reasoning` or `tool_calls`, or a non-empty `text` (the
/// completions API's stream).
fn generated_piece(choice: &Value) -> bool {
    let non_empty = |v: Option<&Value>| match v {
        Some(Value::String(s)) => !s.is_empty(),
        Some(Value::Array(a)) => !a.is_empty(),
        _ => false,
    };
    match choice.get("delta") {
        Some(d) => ["content", "reasoning_content", "reasoning", "tool_calls"]
            .iter()
            .any(|k| non_empty(d.get(*k))),
        None => non_empty(choice.get("text")),
    }
}

impl Usage {
    /// Folds one JSON object (a whole answer or one stream chunk) in.
    pub fn feed(&mut self, v: &Value) {
        if let Some(m) = v.get("model").and_then(Value::as_str) {
            if self.model.is_none() && !m.is_empty() {
                self.model = Some(m.to_string());
            }
        }
        if let Some(choices) = v.get("choices").and_then(Value::as_array) {
            for c in choices {
                let index = c
                    .get("index")
                    .and_then(Value::as_u64)
                    .map_or(0, |i| i.min(MAX_CHOICES as u64 - 1) as usize);
                if self.choices.len() <= index {
                    self.choices.resize(index + 1, (String::new(), None));
                }
                let (text, finish) = &mut self.choices[index];
                let piece = c
                    .get("delta")
                    .or_else(|| c.get("message"))
                    .and_then(|m| m.get("content"))
                    .and_then(Value::as_str)
                    .or_else(|| c.get("text").and_then(Value::as_str));
                if let Some(p) = piece {
                    if !p.is_empty() {
                        text.push_str(p);
                        self.produced = true;
                    }
                }
                if generated_piece(c) {
                    self.pieces += 1;
                }
                if let Some(f) = c.get("finish_reason").and_then(Value::as_str) {
                    *finish = Some(f.to_string());
                    self.produced = true;
                }
            }
        }
        if let Some(u) = v.get("usage").filter(|u| u.is_object()) {
            self.from_usage = true;
            self.prompt_tokens = as_u32(u.get("prompt_tokens")).or(self.prompt_tokens);
            self.completion_tokens = as_u32(u.get("completion_tokens")).or(self.completion_tokens);
            if let Some(c) = as_u32(
                u.get("prompt_tokens_details")
                    .and_then(|d| d.get("cached_tokens")),
            ) {
                self.cached_tokens = Some(c);
            }
        }
        if let Some(t) = v.get("timings").filter(|t| t.is_object()) {
            let cache_n = as_u32(t.get("cache_n"));
            let prompt_n = as_u32(t.get("prompt_n"));
            if self.cached_tokens.is_none() || !self.from_usage {
                self.cached_tokens = cache_n.or(self.cached_tokens);
            }
            if !self.from_usage {
                if let (Some(c), Some(p)) = (cache_n, prompt_n) {
                    self.prompt_tokens = Some(c.saturating_add(p));
                }
                self.completion_tokens = as_u32(t.get("predicted_n")).or(self.completion_tokens);
            }
        }
    }

    /// The receipt's `response_sha256` of the choices seen.
    pub fn response_sha256(&self) -> String {
        let hashes: Vec<[u8; 32]> = self
            .choices
            .iter()
            .map(|(t, _)| Sha256::digest(t).into())
            .collect();
        receipts::response_sha256(&hashes)
    }

    /// The receipt's `finish_reason` of the choices seen.
    pub fn finish_reason(&self) -> Option<String> {
        receipts::finish_reason_of(self.choices.iter().filter_map(|(_, f)| f.as_deref()))
    }

    /// The generated text of choice 0 (what the tests read).
    #[cfg(test)]
    fn text(&self) -> &str {
        self.choices.first().map_or("", |(t, _)| t)
    }

    /// The `error.code` (else `error.type`) of an error answer, as a receipt's `error_code`.
    pub fn error_code(v: &Value) -> Option<String> {
        let e = v.get("error")?;
        let code = e.get("code");
        match code {
            Some(Value::String(s)) if !s.is_empty() => return Some(s.clone()),
            Some(Value::Number(n)) => {
                // llama-server puts the HTTP status in `code`; its `type` names the error.
                if let Some(t) = e.get("type").and_then(Value::as_str) {
                    return Some(t.to_string());
                }
                return Some(format!("engine_error_{n}"));
            }
            _ => {}
        }
        e.get("type").and_then(Value::as_str).map(str::to_string)
    }
}

/// Splits an SSE byte stream into whole events (the bytes up to and including a blank line),
/// so the relay can forward event by event and hold one back. Any line ending (`\n`, `\r\n`,
/// `\r`) is understood. One event larger than `cap` bytes is an error (the engine never ends
/// it: the relay stops instead of growing). O(1) amortized per byte.
#[derive(Debug)]
pub struct SseFramer {
    buf: Vec<u8>,
    /// Bytes of `buf` already scanned for a boundary.
    scanned: usize,
    cap: usize,
}

/// An event exceeded the framer's cap.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EventTooLarge(pub usize);

impl SseFramer {
    pub fn new(cap: usize) -> Self {
        SseFramer {
            buf: Vec::new(),
            scanned: 0,
            cap,
        }
    }

    /// Appends `chunk`; returns the events it completed, in order.
    pub fn push(&mut self, chunk: &[u8]) -> Result<Vec<Vec<u8>>, EventTooLarge> {
        self.buf.extend_from_slice(chunk);
        let mut out = Vec::new();
        loop {
            let Some(end) = boundary(&self.buf, self.scanned.saturating_sub(3)) else {
                self.scanned = self.buf.len();
                break;
            };
            let rest = self.buf.split_off(end);
            out.push(std::mem::replace(&mut self.buf, rest));
            self.scanned = 0;
        }
        if self.buf.len() > self.cap {
            return Err(EventTooLarge(self.cap));
        }
        Ok(out)
    }

    /// Bytes of an unfinished event (what a stream that ended mid-event leaves).
    pub fn pending(&self) -> &[u8] {
        &self.buf
    }
}

/// The end (exclusive) of the first event in `b`, scanning from `from`: the position after a
/// blank line (two line ends in a row).
fn boundary(b: &[u8], from: usize) -> Option<usize> {
    let mut i = from;
    // Whether the byte before `i` ended a line.
    let mut after_eol = i == 0 || matches!(b.get(i - 1), Some(b'\n') | Some(b'\r'));
    if i > 0 && b.get(i - 1) == Some(&b'\r') && b.get(i) == Some(&b'\n') {
        // A `\r\n` split by `from`: the `\n` belongs to the same line end.
        i += 1;
    }
    while i < b.len() {
        match b[i] {
            b'\n' | b'\r' => {
                let len = if b[i] == b'\r' && b.get(i + 1) == Some(&b'\n') {
                    2
                } else if b[i] == b'\r' && i + 1 == b.len() {
                    // A trailing `\r` may be the first half of `\r\n`: wait for the next byte.
                    return None;
                } else {
                    1
                };
                if after_eol && i > 0 {
                    return Some(i + len);
                }
                after_eol = true;
                i += len;
            }
            _ => {
                after_eol = false;
                i += 1;
            }
        }
    }
    None
}

/// The `data` of one SSE event (its `data:` lines joined by `\n`), `None` when it has none
/// (a comment or keep-alive).
pub fn event_data(event: &[u8]) -> Option<String> {
    let text = String::from_utf8_lossy(event);
    let mut data: Option<String> = None;
    for line in text.split(['\n', '\r']) {
        if let Some(rest) = line.strip_prefix("data") {
            let value = match rest.strip_prefix(':') {
                Some(v) => v.strip_prefix(' ').unwrap_or(v),
                None if rest.is_empty() => "",
                None => continue,
            };
            match &mut data {
                Some(d) => {
                    d.push('\n');
                    d.push_str(value);
                }
                None => data = Some(value.to_string()),
            }
        }
    }
    data
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn whole_chat_answer_with_usage() {
        let mut u = Usage::default();
        u.feed(&json!({
            "model": "m", "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hi there"},
            "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 12, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 8}},
            "timings": {"cache_n": 7, "prompt_n": 5, "predicted_n": 3}
        }));
        assert_eq!(u.text(), "Hi there");
        assert_eq!(u.finish_reason().as_deref(), Some("stop"));
        assert_eq!(u.response_sha256(), receipts::sha256_hex(b"Hi there"));
        assert_eq!(
            (u.prompt_tokens, u.cached_tokens, u.completion_tokens),
            (Some(12), Some(8), Some(3))
        );
        assert_eq!(u.model.as_deref(), Some("m"));
    }

    #[test]
    fn stream_without_usage_takes_llama_cpp_timings() {
        let mut u = Usage::default();
        u.feed(&json!({"choices": [{"delta": {"role": "assistant", "content": null}}]}));
        assert!(!u.produced);
        u.feed(&json!({"choices": [{"delta": {"content": "a"}}]}));
        assert!(u.produced);
        u.feed(&json!({"choices": [{"delta": {"content": "b"}}]}));
        u.feed(
            &json!({"choices": [{"delta": {}, "finish_reason": "length"}],
            "timings": {"cache_n": 16, "prompt_n": 4, "predicted_n": 2}}),
        );
        assert_eq!(u.text(), "ab");
        assert_eq!(
            (u.prompt_tokens, u.cached_tokens, u.completion_tokens),
            (Some(20), Some(16), Some(2))
        );
        assert_eq!(u.finish_reason().as_deref(), Some("length"));
    }

    #[test]
    fn stream_pieces_count_generated_output_of_every_kind() {
        let mut u = Usage::default();
        for chunk in [
            json!({"choices": [{"delta": {"role": "assistant", "content": ""}}]}),
            json!({"choices": [{"delta": {"reasoning_content": "hm"}}]}),
            json!({"choices": [{"delta": {"reasoning": "m"}}]}),
            json!({"choices": [{"delta": {"content": "a"}}, {"index": 1, "delta": {"content": "b"}}]}),
            json!({"choices": [{"delta": {"tool_calls": [{"index": 0, "function": {"arguments": "{"}}]}}]}),
            json!({"choices": [{"delta": {"tool_calls": []}}]}),
            json!({"choices": [{"text": "x"}]}),
            json!({"choices": [{"text": ""}]}),
            json!({"choices": [{"delta": {}, "finish_reason": "stop"}]}),
            json!({"choices": [], "usage": {"completion_tokens": 6}}),
            json!({"choices": [{"message": {"content": "whole"}}]}),
        ] {
            u.feed(&chunk);
        }
        assert_eq!(u.pieces, 6);
    }

    #[test]
    fn several_choices_are_told_apart_by_index() {
        let mut u = Usage::default();
        for (i, t) in [(1, "It is"), (0, "Par"), (1, " Paris."), (0, "is.")] {
            u.feed(&json!({"choices": [{"index": i, "delta": {"content": t}}]}));
        }
        u.feed(&json!({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}));
        u.feed(&json!({"choices": [{"index": 1, "delta": {}, "finish_reason": "length"}]}));
        let one = |t: &str| -> [u8; 32] { Sha256::digest(t).into() };
        assert_eq!(
            u.response_sha256(),
            receipts::response_sha256(&[one("Paris."), one("It is Paris.")])
        );
        assert_eq!(u.finish_reason().as_deref(), Some("length"));
        // An index past the bound counts as the last choice: no unbounded growth.
        u.feed(&json!({"choices": [{"index": u64::MAX, "text": "x"}]}));
        assert_eq!(u.choices.len(), MAX_CHOICES);
    }

    #[test]
    fn completions_text_and_errors() {
        let mut u = Usage::default();
        u.feed(&json!({"choices": [{"text": "xyz", "finish_reason": "stop"}]}));
        assert_eq!(u.text(), "xyz");
        assert_eq!(
            Usage::error_code(&json!({"error": {"code": 400, "type": "invalid_request_error"}})),
            Some("invalid_request_error".into())
        );
        assert_eq!(
            Usage::error_code(&json!({"error": {"code": "model_not_found"}})),
            Some("model_not_found".into())
        );
        assert_eq!(Usage::error_code(&json!({"x": 1})), None);
    }

    #[test]
    fn framer_splits_events_across_chunks_and_line_endings() {
        let mut f = SseFramer::new(1 << 10);
        let stream = b"data: {\"a\":1}\n\ndata: x\r\n\r\n: keep-alive\n\ndata: [DONE]\n\n";
        for split in 0..stream.len() {
            let mut f2 = SseFramer::new(1 << 10);
            let mut evs = f2.push(&stream[..split]).unwrap();
            evs.extend(f2.push(&stream[split..]).unwrap());
            let data: Vec<Option<String>> = evs.iter().map(|e| event_data(e)).collect();
            assert_eq!(
                data,
                vec![
                    Some("{\"a\":1}".into()),
                    Some("x".into()),
                    None,
                    Some("[DONE]".into())
                ],
                "split at {split}"
            );
            assert_eq!(evs.concat(), stream.to_vec(), "bytes kept at split {split}");
            assert!(f2.pending().is_empty());
        }
        // Byte by byte.
        let mut n = 0;
        for b in stream.iter() {
            n += f.push(std::slice::from_ref(b)).unwrap().len();
        }
        assert_eq!(n, 4);
    }

    #[test]
    fn framer_refuses_an_endless_event() {
        let mut f = SseFramer::new(8);
        assert!(f.push(b"data: 1234").is_err());
        let mut f = SseFramer::new(8);
        assert_eq!(f.push(b"data: 1\n\n").unwrap().len(), 1);
    }

    #[test]
    fn multi_line_data_joins() {
        assert_eq!(event_data(b"data: a\ndata: b\n\n").as_deref(), Some("a\nb"));
        assert_eq!(event_data(b"event: x\ndata:y\n\n").as_deref(), Some("y"));
        assert_eq!(event_data(b": c\n\n"), None);
    }
}
