//! The chat template: compiled once, rendered per request with HF-compatible extras.
//!
//! The environment mirrors what `transformers` sets up for `apply_chat_template`:
//! `trim_blocks` and `lstrip_blocks` on, `keep_trailing_newline` off, loop controls
//! (`break`/`continue`), Python string/dict/list methods via minijinja-contrib's pycompat
//! callback, `raise_exception(msg)`, a `tojson` filter that matches Python's
//! `json.dumps(x, ensure_ascii=False)` (separators `", "`/`": "`, no HTML escaping,
//! `indent`/`separators`/`sort_keys`/`ensure_ascii` arguments; an undefined value raises, as
//! Python's does), `strftime_now(fmt)`, `{% generation %}…{% endgeneration %}` rendering its body
//! (transformers' assistant-mask tag), values printed as Python prints them (`{{ x }}` and
//! `x|string` on a dict or list give its `repr`, `True`/`False`/`None`), and the `sequence` test
//! true for strings, dicts and lists (jinja2's).
//!
//! [`TemplateInputs`] are what `transformers`' `apply_chat_template` hands the template, and
//! [`ChatTemplate::render_inputs`] prepares them the way it does (null-valued message keys
//! dropped, reasoning aliased under `thinking` and `reasoning_content`, `continue_final_message`
//! by its tag-and-cut rule, special tokens defined only when the model has them, template kwargs
//! last). tests/templates.rs checks every template of llama.cpp's collection over a
//! conversation set against Python jinja2 driven the same way.
//! Rendering cost is linear in the size of the conversation.

use std::fmt::Write as _;

use minijinja::value::{Kwargs, Value, ValueKind};
use minijinja::{Environment, ErrorKind};

use crate::error::{one_line, ProfileError, Result};

const TEMPLATE_NAME: &str = "chat_template";

/// The special token strings a template may reference.
#[derive(Debug, Clone, Default)]
pub struct TemplateTokens {
    /// `bos_token`.
    pub bos: Option<String>,
    /// `eos_token`.
    pub eos: Option<String>,
    /// `unk_token`.
    pub unk: Option<String>,
    /// `pad_token`.
    pub pad: Option<String>,
}

/// Everything a chat template is rendered with: what `transformers`' `apply_chat_template`
/// receives (messages as JSON objects, `tools`, `documents`, `add_generation_prompt`,
/// `continue_final_message`, and the template kwargs).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TemplateInputs {
    /// The conversation; each message a JSON object.
    pub messages: Vec<serde_json::Value>,
    /// Tool definitions (JSON schema objects), `None` when the request offers none.
    pub tools: Option<Vec<serde_json::Value>>,
    /// Documents for retrieval-augmented templates.
    pub documents: Option<Vec<serde_json::Value>>,
    /// End with the opening of an assistant turn.
    pub add_generation_prompt: bool,
    /// Leave the final message open, to be continued (refused with `add_generation_prompt`).
    pub continue_final_message: bool,
    /// Extra template variables (`chat_template_kwargs`, e.g. `enable_thinking`); they override
    /// the special tokens of the same name.
    pub kwargs: serde_json::Map<String, serde_json::Value>,
    /// What `strftime_now` reads; `None`: the local clock (fixed values make renders
    /// reproducible in tests).
    pub now: Option<chrono::NaiveDateTime>,
}

/// The tag transformers appends to the message to continue, then cuts the render at.
const CONTINUE_TAG: &str = "CONTINUE_FINAL_MESSAGE_TAG ";
/// The message fields a message's reasoning may come under (the first is the standard one).
const REASONING_FIELDS: [&str; 3] = ["reasoning_content", "thinking", "reasoning"];
/// The context variable carrying a frozen clock to `strftime_now` (not a template variable).
const NOW_VAR: &str = "__kvgate_strftime_now";

/// A compiled chat template.
#[derive(Clone)]
pub struct ChatTemplate {
    env: Environment<'static>,
    source: String,
    tokens: TemplateTokens,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("source_len", &self.source.len())
            .field("tokens", &self.tokens)
            .finish()
    }
}

/// Error source that marks an error raised by the template through `raise_exception`.
#[derive(Debug)]
struct RaisedException(String);

impl std::fmt::Display for RaisedException {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for RaisedException {}

impl ChatTemplate {
    /// Compile `source`. Syntax errors are reported here, not at render time.
    pub fn new(source: impl Into<String>, tokens: TemplateTokens) -> Result<Self> {
        let source = source.into();
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_keep_trailing_newline(false);
        minijinja_contrib::add_to_environment(&mut env);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_filter("tojson", tojson);
        env.add_filter("string", py_string);
        env.add_test("sequence", is_py_sequence);
        env.add_test("iterable", is_py_iterable);
        env.add_test("none", is_py_none);
        env.add_filter("length", py_length);
        env.add_filter("count", py_length);
        env.add_filter("indent", py_indent);
        env.add_filter(
            "map",
            |state: &minijinja::State, v: Value, args: minijinja::value::Rest<Value>| {
                lazy(&v, || minijinja::filters::map(state, v.clone(), args))
            },
        );
        env.add_filter(
            "select",
            |state: &minijinja::State,
             v: Value,
             test: Option<String>,
             args: minijinja::value::Rest<Value>| {
                lazy(&v, || {
                    minijinja::filters::select(state, v.clone(), test.map(Into::into), args)
                })
            },
        );
        env.add_filter(
            "reject",
            |state: &minijinja::State,
             v: Value,
             test: Option<String>,
             args: minijinja::value::Rest<Value>| {
                lazy(&v, || {
                    minijinja::filters::reject(state, v.clone(), test.map(Into::into), args)
                })
            },
        );
        env.add_filter(
            "selectattr",
            |state: &minijinja::State,
             v: Value,
             attr: String,
             test: Option<String>,
             args: minijinja::value::Rest<Value>| {
                lazy(&v, || {
                    minijinja::filters::selectattr(
                        state,
                        v.clone(),
                        attr.into(),
                        test.map(Into::into),
                        args,
                    )
                })
            },
        );
        env.add_filter(
            "rejectattr",
            |state: &minijinja::State,
             v: Value,
             attr: String,
             test: Option<String>,
             args: minijinja::value::Rest<Value>| {
                lazy(&v, || {
                    minijinja::filters::rejectattr(
                        state,
                        v.clone(),
                        attr.into(),
                        test.map(Into::into),
                        args,
                    )
                })
            },
        );
        env.set_formatter(|out, _state, value| {
            let mut s = String::new();
            write_py_str(&mut s, value);
            out.write_str(&s).map_err(|e| {
                minijinja::Error::new(ErrorKind::WriteFailure, "write failed").with_source(e)
            })
        });
        env.add_template_owned(TEMPLATE_NAME, rewrite_generation_tags(&source))
            .map_err(|e| template_error(&e))?;
        Ok(ChatTemplate {
            env,
            source,
            tokens,
        })
    }

    /// The template text.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Render already-built template values (`messages` as a value, no tools): for callers
    /// that hold minijinja values. [`Self::render_inputs`] is the request path.
    pub fn render(&self, messages: Value, add_generation_prompt: bool) -> Result<String> {
        let mut ctx = self.base_context(add_generation_prompt);
        ctx.insert("messages".into(), messages);
        self.render_context(ctx)
    }

    /// Render `inputs` the way `transformers`' `apply_chat_template(…, tokenize=False)` does.
    pub fn render_inputs(&self, inputs: &TemplateInputs) -> Result<String> {
        if inputs.messages.is_empty() {
            return Err(ProfileError::EmptyPrompt { param: "messages" });
        }
        if inputs.continue_final_message && inputs.add_generation_prompt {
            return Err(ProfileError::InvalidMessage {
                index: inputs.messages.len() - 1,
                reason: "continue_final_message and add_generation_prompt cannot both be true"
                    .into(),
            });
        }
        let mut chat = Vec::with_capacity(inputs.messages.len());
        for (index, m) in inputs.messages.iter().enumerate() {
            let serde_json::Value::Object(m) = m else {
                return Err(ProfileError::InvalidMessage {
                    index,
                    reason: "a message must be a JSON object".into(),
                });
            };
            // transformers drops null-valued keys, then aliases reasoning.
            let m: serde_json::Map<String, serde_json::Value> = m
                .iter()
                .filter(|(_, v)| !v.is_null())
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect();
            chat.push(alias_reasoning(m));
        }
        for (what, list) in [("tools", &inputs.tools), ("documents", &inputs.documents)] {
            if let Some(list) = list {
                if let Some(i) = list.iter().position(|t| !t.is_object()) {
                    return Err(ProfileError::InvalidMessage {
                        index: i,
                        reason: format!("{what}[{i}] must be a JSON object"),
                    });
                }
            }
        }
        let continued = if inputs.continue_final_message {
            Some(self.tag_final_message(&mut chat)?)
        } else {
            None
        };
        let last = chat.len() - 1;
        let mut ctx = self.base_context(inputs.add_generation_prompt);
        ctx.insert(
            "messages".into(),
            py_list(
                chat.into_iter()
                    .map(serde_json::Value::Object)
                    .collect::<Vec<_>>()
                    .iter(),
            ),
        );
        let opt = |v: &Option<Vec<serde_json::Value>>| match v {
            Some(list) => py_list(list.iter()),
            None => py_none(),
        };
        ctx.insert("tools".into(), opt(&inputs.tools));
        ctx.insert("documents".into(), opt(&inputs.documents));
        for (k, v) in &inputs.kwargs {
            ctx.insert(k.clone(), py_value(v));
        }
        if let Some(now) = inputs.now {
            ctx.insert(
                NOW_VAR.into(),
                Value::from(now.format("%Y-%m-%dT%H:%M:%S%.f").to_string()),
            );
        }
        let text = self.render_context(ctx)?;
        match continued {
            None => Ok(text),
            Some(final_text) => cut_at_continue_tag(text, &final_text, last),
        }
    }

    /// The variables every render has: the special tokens the model defines (others stay
    /// undefined, as transformers leaves them), `add_generation_prompt`, `tools` and
    /// `documents` as `None`.
    fn base_context(
        &self,
        add_generation_prompt: bool,
    ) -> std::collections::BTreeMap<String, Value> {
        let mut ctx = std::collections::BTreeMap::new();
        for (name, tok) in [
            ("bos_token", &self.tokens.bos),
            ("eos_token", &self.tokens.eos),
            ("unk_token", &self.tokens.unk),
            ("pad_token", &self.tokens.pad),
        ] {
            if let Some(t) = tok {
                ctx.insert(name.to_owned(), Value::from(t.as_str()));
            }
        }
        ctx.insert(
            "add_generation_prompt".into(),
            Value::from(add_generation_prompt),
        );
        ctx.insert("tools".into(), py_none());
        ctx.insert("documents".into(), py_none());
        ctx
    }

    fn render_context(&self, ctx: std::collections::BTreeMap<String, Value>) -> Result<String> {
        let tmpl = self
            .env
            .get_template(TEMPLATE_NAME)
            .map_err(|e| template_error(&e))?;
        tmpl.render(Value::from_iter(ctx))
            .map_err(|e| render_error(&e))
    }

    /// transformers' `continue_final_message`: the final message's content (the last text part
    /// of a list) gets the tag appended; returns the text being continued.
    fn tag_final_message(
        &self,
        chat: &mut [serde_json::Map<String, serde_json::Value>],
    ) -> Result<String> {
        let index = chat.len() - 1;
        let bad = |reason: &str| ProfileError::InvalidMessage {
            index,
            reason: reason.to_owned(),
        };
        if !self.source.contains("content") {
            return Err(bad(
                "continue_final_message: this chat template never reads a message's content",
            ));
        }
        let last = &mut chat[index];
        match last.get_mut("content") {
            None => Err(bad(
                "continue_final_message: the final message has no content",
            )),
            Some(serde_json::Value::String(s)) => {
                let text = s.clone();
                s.push_str(CONTINUE_TAG);
                Ok(text)
            }
            Some(serde_json::Value::Array(parts)) => {
                for part in parts.iter_mut().rev() {
                    if let Some(serde_json::Value::String(t)) = part.get_mut("text") {
                        let text = t.clone();
                        t.push_str(CONTINUE_TAG);
                        return Ok(text);
                    }
                }
                Err(bad(
                    "continue_final_message: the final message has no text to continue",
                ))
            }
            Some(_) => Err(bad(
                "continue_final_message: the final message's content is not text",
            )),
        }
    }
}

/// transformers' alias: a message with reasoning under any of the three names becomes
/// `{"thinking": r, **message, "reasoning_content": r}` (r the first one present).
fn alias_reasoning(
    m: serde_json::Map<String, serde_json::Value>,
) -> serde_json::Map<String, serde_json::Value> {
    let Some(r) = REASONING_FIELDS
        .iter()
        .find_map(|k| m.get(*k).filter(|v| !v.is_null()).cloned())
    else {
        return m;
    };
    let mut out = serde_json::Map::with_capacity(m.len() + 2);
    out.insert("thinking".into(), r.clone());
    for (k, v) in m {
        out.insert(k, v);
    }
    out.insert("reasoning_content".into(), r);
    out
}

/// Cut a render at the last continue tag (keeping the tag's space when the template kept it),
/// after checking that the template kept both the text and the tag.
fn cut_at_continue_tag(text: String, final_text: &str, index: usize) -> Result<String> {
    let tag = CONTINUE_TAG.trim_end();
    if !text.contains(final_text.trim()) || !text.contains(tag) {
        return Err(ProfileError::InvalidMessage {
            index,
            reason: "continue_final_message: the chat template does not keep the final message"
                .into(),
        });
    }
    let at = text.rfind(tag).unwrap_or(text.len());
    if text[at..].starts_with(CONTINUE_TAG) {
        Ok(text[..at].to_owned())
    } else {
        Ok(text[..at].trim_end().to_owned())
    }
}

/// `{% generation %}` / `{% endgeneration %}` (transformers' assistant-mask tags, which only
/// mark spans) become a block that always renders its body, keeping their whitespace control.
fn rewrite_generation_tags(source: &str) -> String {
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    while let Some(i) = rest.find("{%") {
        out.push_str(&rest[..i]);
        let tag = &rest[i..];
        let Some(end) = tag.find("%}") else {
            out.push_str(tag);
            return out;
        };
        let inner = &tag[2..end];
        let (lead, body) = match inner.strip_prefix(['-', '+']) {
            Some(b) => (&inner[..1], b),
            None => ("", inner),
        };
        let (body, trail) = match body.strip_suffix(['-', '+']) {
            Some(b) => (b, &body[body.len() - 1..]),
            None => (body, ""),
        };
        match body.trim() {
            "generation" => out.push_str(&format!("{{%{lead} if true {trail}%}}")),
            "endgeneration" => out.push_str(&format!("{{%{lead} endif {trail}%}}")),
            _ => out.push_str(&tag[..end + 2]),
        }
        rest = &tag[end + 2..];
    }
    out.push_str(rest);
    out
}

/// A render-time error: raised by the template, or a failure on the request's data.
fn render_error(e: &minijinja::Error) -> ProfileError {
    match template_error(e) {
        ProfileError::Template { reason } => ProfileError::TemplateRender { reason },
        other => other,
    }
}

fn template_error(e: &minijinja::Error) -> ProfileError {
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(err) = cur {
        if let Some(raised) = err.downcast_ref::<RaisedException>() {
            return ProfileError::TemplateRaised {
                message: one_line(&raised.0),
            };
        }
        cur = err.source();
    }
    let mut reason = e.to_string();
    if let Some(line) = e.line() {
        if !reason.contains("line") {
            let _ = write!(reason, " (line {line})");
        }
    }
    ProfileError::Template {
        reason: one_line(reason),
    }
}

fn raise_exception(message: String) -> Result<Value, minijinja::Error> {
    Err(
        minijinja::Error::new(ErrorKind::InvalidOperation, message.clone())
            .with_source(RaisedException(message)),
    )
}

/// `strftime_now(format)`: the local time (or the render's frozen clock) formatted with
/// Python/C `strftime` directives.
fn strftime_now(state: &minijinja::State, format: String) -> Result<Value, minijinja::Error> {
    let frozen = state
        .lookup(NOW_VAR)
        .and_then(|v| v.as_str().map(str::to_owned))
        .and_then(|s| chrono::NaiveDateTime::parse_from_str(&s, "%Y-%m-%dT%H:%M:%S%.f").ok());
    let now = frozen.unwrap_or_else(|| chrono::Local::now().naive_local());
    let mut out = String::new();
    write!(out, "{}", now.format(&format)).map_err(|_| {
        minijinja::Error::new(
            ErrorKind::InvalidOperation,
            format!("strftime_now: invalid format string {format:?}"),
        )
    })?;
    Ok(Value::from(out))
}

/// Python `json.dumps` options.
struct JsonStyle {
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    sort_keys: bool,
    ensure_ascii: bool,
}

/// `tojson(value, indent=None, separators=None, sort_keys=False, ensure_ascii=False)`.
fn tojson(value: &Value, indent: Option<Value>, kwargs: Kwargs) -> Result<Value, minijinja::Error> {
    let indent = match kwargs.get::<Option<Value>>("indent")? {
        Some(v) => Some(v),
        None => indent,
    };
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() || v.is_undefined() => None,
        Some(v) if v.kind() == ValueKind::String => Some(v.as_str().unwrap_or("").to_string()),
        Some(v) => match v.as_i64() {
            Some(n) => Some(" ".repeat(usize::try_from(n).unwrap_or(0))),
            None => {
                return Err(minijinja::Error::new(
                    ErrorKind::InvalidOperation,
                    "tojson: indent must be an integer or a string",
                ))
            }
        },
    };
    let (mut item_sep, key_sep) = match kwargs.get::<Option<Value>>("separators")? {
        Some(seps) if !seps.is_none() => {
            let a = seps.get_item_by_index(0)?;
            let b = seps.get_item_by_index(1)?;
            match (a.as_str(), b.as_str()) {
                (Some(a), Some(b)) => (a.to_string(), b.to_string()),
                _ => {
                    return Err(minijinja::Error::new(
                        ErrorKind::InvalidOperation,
                        "tojson: separators must be a pair of strings",
                    ))
                }
            }
        }
        _ => (", ".to_string(), ": ".to_string()),
    };
    if indent.is_some() && kwargs.get::<Option<Value>>("separators")?.is_none() {
        item_sep = ",".to_string();
    }
    let style = JsonStyle {
        indent,
        item_sep,
        key_sep,
        sort_keys: kwargs.get::<Option<bool>>("sort_keys")?.unwrap_or(false),
        ensure_ascii: kwargs.get::<Option<bool>>("ensure_ascii")?.unwrap_or(false),
    };
    kwargs.assert_all_used()?;
    let mut out = String::new();
    write_json(&mut out, value, &style, 0)?;
    Ok(Value::from(out))
}

fn write_json(
    out: &mut String,
    value: &Value,
    style: &JsonStyle,
    level: usize,
) -> Result<(), minijinja::Error> {
    match value.kind() {
        ValueKind::Undefined => {
            return Err(minijinja::Error::new(
                ErrorKind::InvalidOperation,
                "tojson: Object of type Undefined is not JSON serializable",
            ))
        }
        ValueKind::None => out.push_str("null"),
        _ if value.downcast_object_ref::<PyNone>().is_some() => out.push_str("null"),
        ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
        ValueKind::Number => {
            if value.is_integer() {
                let _ = write!(out, "{value}");
            } else {
                let f = f64::try_from(value.clone()).map_err(|_| {
                    minijinja::Error::new(ErrorKind::InvalidOperation, "tojson: bad number")
                })?;
                write_py_float(out, f);
            }
        }
        ValueKind::String => write_json_str(out, value.as_str().unwrap_or(""), style.ensure_ascii),
        ValueKind::Bytes => {
            return Err(minijinja::Error::new(
                ErrorKind::InvalidOperation,
                "tojson: bytes are not JSON serializable",
            ))
        }
        ValueKind::Iterable => {
            return Err(minijinja::Error::new(
                ErrorKind::InvalidOperation,
                "tojson: Object of type generator is not JSON serializable",
            ))
        }
        ValueKind::Seq => {
            let items: Vec<Value> = value.try_iter()?.collect();
            write_container(out, style, level, '[', ']', items.len(), |out, i| {
                write_json(out, &items[i], style, level + 1)
            })?;
        }
        ValueKind::Map => {
            let mut keys: Vec<Value> = value.try_iter()?.collect();
            if style.sort_keys {
                keys.sort_by_key(py_key);
            }
            let mut pairs = Vec::with_capacity(keys.len());
            for k in keys {
                let v = value.get_item(&k)?;
                pairs.push((py_key(&k), v));
            }
            write_container(out, style, level, '{', '}', pairs.len(), |out, i| {
                write_json_str(out, &pairs[i].0, style.ensure_ascii);
                out.push_str(&style.key_sep);
                write_json(out, &pairs[i].1, style, level + 1)
            })?;
        }
        _ => {
            return Err(minijinja::Error::new(
                ErrorKind::InvalidOperation,
                format!(
                    "tojson: value of kind {} is not JSON serializable",
                    value.kind()
                ),
            ))
        }
    }
    Ok(())
}

fn write_container(
    out: &mut String,
    style: &JsonStyle,
    level: usize,
    open: char,
    close: char,
    len: usize,
    mut item: impl FnMut(&mut String, usize) -> Result<(), minijinja::Error>,
) -> Result<(), minijinja::Error> {
    out.push(open);
    if len == 0 {
        out.push(close);
        return Ok(());
    }
    for i in 0..len {
        if i > 0 {
            out.push_str(&style.item_sep);
        }
        if let Some(ind) = &style.indent {
            out.push('\n');
            for _ in 0..=level {
                out.push_str(ind);
            }
        }
        item(out, i)?;
    }
    if let Some(ind) = &style.indent {
        out.push('\n');
        for _ in 0..level {
            out.push_str(ind);
        }
    }
    out.push(close);
    Ok(())
}

/// A dict key as Python's json module stringifies it.
fn py_key(k: &Value) -> String {
    match k.kind() {
        ValueKind::String => k.as_str().unwrap_or("").to_string(),
        ValueKind::None | ValueKind::Undefined => "null".into(),
        ValueKind::Bool => (if k.is_true() { "true" } else { "false" }).into(),
        ValueKind::Number if !k.is_integer() => {
            let mut s = String::new();
            write_py_float(&mut s, f64::try_from(k.clone()).unwrap_or(f64::NAN));
            s
        }
        _ => k.to_string(),
    }
}

/// Python's `repr(float)`: shortest round-trip digits, exponent form below 1e-4 and from 1e16.
fn write_py_float(out: &mut String, f: f64) {
    if f.is_nan() {
        out.push_str("NaN");
        return;
    }
    if f.is_infinite() {
        out.push_str(if f > 0.0 { "Infinity" } else { "-Infinity" });
        return;
    }
    let sci = format!("{f:e}"); // e.g. "1.5e-7", "-1e20"
    let (mantissa, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    if (-4..16).contains(&exp) {
        let plain = format!("{f}");
        out.push_str(&plain);
        if !plain.contains('.') {
            out.push_str(".0");
        }
    } else {
        out.push_str(mantissa);
        let _ = write!(out, "e{}{:02}", if exp < 0 { '-' } else { '+' }, exp.abs());
    }
}

fn write_json_str(out: &mut String, s: &str, ensure_ascii: bool) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{08}' => out.push_str("\\b"),
            '\u{0c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c if ensure_ascii && (c as u32) > 0x7e => {
                let mut buf = [0u16; 2];
                for unit in c.encode_utf16(&mut buf) {
                    let _ = write!(out, "\\u{unit:04x}");
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// `value|string`: Python's `str(value)`.
fn py_string(value: &Value) -> Value {
    if value.kind() == ValueKind::String {
        return value.clone();
    }
    let mut s = String::new();
    write_py_str(&mut s, value);
    Value::from(s)
}

/// Python's `None` where jinja2 and minijinja disagree about it: minijinja iterates `none` as
/// empty, Python raises (`for t in tools` with no tools). `tools` and `documents` are this
/// when the request has none; it is falsy, prints `None`, serializes as `null`, is `none` to
/// the test, and refuses iteration and `length` as Python does.
#[derive(Debug)]
struct PyNone;

impl minijinja::value::Object for PyNone {
    fn repr(self: &std::sync::Arc<Self>) -> minijinja::value::ObjectRepr {
        minijinja::value::ObjectRepr::Plain
    }

    fn is_true(self: &std::sync::Arc<Self>) -> bool {
        false
    }

    fn render(self: &std::sync::Arc<Self>, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("None")
    }
}

fn py_none() -> Value {
    Value::from_object(PyNone)
}

/// A Python dict from the request: keys in request order, printed (`{{ }}`, `~`, `|string`,
/// `|trim`) as Python's `repr`.
#[derive(Debug)]
struct PyDict(Vec<(Value, Value)>);

impl minijinja::value::Object for PyDict {
    fn repr(self: &std::sync::Arc<Self>) -> minijinja::value::ObjectRepr {
        minijinja::value::ObjectRepr::Map
    }

    fn get_value(self: &std::sync::Arc<Self>, key: &Value) -> Option<Value> {
        self.0
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.clone())
    }

    fn enumerate(self: &std::sync::Arc<Self>) -> minijinja::value::Enumerator {
        minijinja::value::Enumerator::Values(self.0.iter().map(|(k, _)| k.clone()).collect())
    }

    fn enumerator_len(self: &std::sync::Arc<Self>) -> Option<usize> {
        Some(self.0.len())
    }

    fn render(self: &std::sync::Arc<Self>, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut s = String::new();
        write_py_repr(&mut s, &Value::from_dyn_object(self.clone()));
        f.write_str(&s)
    }
}

/// A Python list from the request (negative indices count from the end), printed as `repr`.
#[derive(Debug)]
struct PyList(Vec<Value>);

impl minijinja::value::Object for PyList {
    fn repr(self: &std::sync::Arc<Self>) -> minijinja::value::ObjectRepr {
        minijinja::value::ObjectRepr::Seq
    }

    fn get_value(self: &std::sync::Arc<Self>, key: &Value) -> Option<Value> {
        let i = key.as_i64()?;
        let len = i64::try_from(self.0.len()).ok()?;
        let i = if i < 0 { len + i } else { i };
        usize::try_from(i).ok().and_then(|i| self.0.get(i)).cloned()
    }

    fn enumerate(self: &std::sync::Arc<Self>) -> minijinja::value::Enumerator {
        minijinja::value::Enumerator::Seq(self.0.len())
    }

    fn render(self: &std::sync::Arc<Self>, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut s = String::new();
        write_py_repr(&mut s, &Value::from_dyn_object(self.clone()));
        f.write_str(&s)
    }
}

/// The lazy result of jinja2's `map`/`select`/`reject`/`selectattr`/`rejectattr`: a generator
/// — iterable once materialized here, but without a length and not JSON-serializable, as in
/// Python.
#[derive(Debug)]
struct PyGenerator(Vec<Value>);

impl minijinja::value::Object for PyGenerator {
    fn repr(self: &std::sync::Arc<Self>) -> minijinja::value::ObjectRepr {
        minijinja::value::ObjectRepr::Iterable
    }

    fn enumerate(self: &std::sync::Arc<Self>) -> minijinja::value::Enumerator {
        minijinja::value::Enumerator::Iter(Box::new(self.0.clone().into_iter()))
    }

    fn render(self: &std::sync::Arc<Self>, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("<generator object>")
    }
}

/// jinja2's filters of sequences skip a falsy input (`if value:`): `None` gives nothing.
fn lazy(
    v: &Value,
    run: impl FnOnce() -> Result<Vec<Value>, minijinja::Error>,
) -> Result<Value, minijinja::Error> {
    if is_py_none_value(v) || v.is_undefined() {
        return Ok(Value::from_object(PyGenerator(Vec::new())));
    }
    Ok(Value::from_object(PyGenerator(run()?)))
}

/// A JSON value as the template sees it (Python objects for containers).
fn py_value(v: &serde_json::Value) -> Value {
    match v {
        serde_json::Value::Array(items) => py_list(items.iter()),
        serde_json::Value::Object(map) => Value::from_object(PyDict(
            map.iter()
                .map(|(k, v)| (Value::from(k.as_str()), py_value(v)))
                .collect(),
        )),
        other => Value::from_serialize(other),
    }
}

fn py_list<'a>(items: impl Iterator<Item = &'a serde_json::Value>) -> Value {
    Value::from_object(PyList(items.map(py_value).collect()))
}

/// `length`: Python's `len()` — an undefined value has length 0 (jinja2's `Undefined`), `None`
/// and generators have none.
fn py_length(v: &Value) -> Result<usize, minijinja::Error> {
    if v.is_undefined() {
        return Ok(0);
    }
    if is_py_none_value(v) {
        return Err(minijinja::Error::new(
            ErrorKind::InvalidOperation,
            "object of type 'NoneType' has no len()",
        ));
    }
    minijinja::filters::length(v)
}

/// jinja2's `indent(width=4, first=False, blank=False)`, its newline quirk included (a trailing
/// newline survives).
fn py_indent(
    value: &Value,
    width: Option<Value>,
    first: Option<bool>,
    blank: Option<bool>,
    kwargs: Kwargs,
) -> Result<Value, minijinja::Error> {
    let width = kwargs.get::<Option<Value>>("width")?.or(width);
    let first = kwargs
        .get::<Option<bool>>("first")?
        .or(first)
        .unwrap_or(false);
    let blank = kwargs
        .get::<Option<bool>>("blank")?
        .or(blank)
        .unwrap_or(false);
    kwargs.assert_all_used()?;
    let indention = match width {
        None => "    ".to_owned(),
        Some(w) if w.kind() == ValueKind::String => w.as_str().unwrap_or("").to_owned(),
        Some(w) => " ".repeat(usize::try_from(w.as_i64().unwrap_or(4)).unwrap_or(0)),
    };
    let mut text = String::new();
    write_py_str(&mut text, value);
    text.push('\n');
    let lines = py_splitlines(&text);
    let mut rv = if blank {
        lines.join(&format!("\n{indention}"))
    } else {
        let mut it = lines.into_iter();
        let mut rv = it.next().unwrap_or_default().to_owned();
        let rest: Vec<String> = it
            .map(|l| {
                if l.is_empty() {
                    String::new()
                } else {
                    format!("{indention}{l}")
                }
            })
            .collect();
        if !rest.is_empty() {
            rv.push('\n');
            rv.push_str(&rest.join("\n"));
        }
        rv
    };
    if first {
        rv.insert_str(0, &indention);
    }
    Ok(Value::from(rv))
}

/// Python's `str.splitlines()`.
fn py_splitlines(s: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let mut start = 0;
    let mut chars = s.char_indices().peekable();
    while let Some((i, c)) = chars.next() {
        let is_break = matches!(
            c,
            '\n' | '\r'
                | '\u{0b}'
                | '\u{0c}'
                | '\u{1c}'
                | '\u{1d}'
                | '\u{1e}'
                | '\u{85}'
                | '\u{2028}'
                | '\u{2029}'
        );
        if is_break {
            out.push(&s[start..i]);
            let mut next = i + c.len_utf8();
            if c == '\r' {
                if let Some(&(j, '\n')) = chars.peek() {
                    chars.next();
                    next = j + 1;
                }
            }
            start = next;
        }
    }
    if start < s.len() {
        out.push(&s[start..]);
    }
    out
}

fn is_py_none_value(v: &Value) -> bool {
    v.is_none() || v.downcast_object_ref::<PyNone>().is_some()
}

/// The `none` test, true for [`PyNone`] too.
fn is_py_none(v: &Value) -> bool {
    is_py_none_value(v)
}

/// jinja2's `iterable` test: strings, lists, dicts (never `None`).
fn is_py_iterable(v: &Value) -> bool {
    !is_py_none_value(v) && !v.is_undefined() && v.try_iter().is_ok()
}

/// jinja2's `sequence` test: anything with a length and item access — strings, lists, dicts.
fn is_py_sequence(value: &Value) -> bool {
    matches!(
        value.kind(),
        ValueKind::String | ValueKind::Seq | ValueKind::Map
    )
}

/// Python's `str(value)`: strings as they are, the rest as `repr`.
fn write_py_str(out: &mut String, value: &Value) {
    match value.kind() {
        ValueKind::Undefined => {}
        ValueKind::String => out.push_str(value.as_str().unwrap_or("")),
        _ => write_py_repr(out, value),
    }
}

/// Python's `repr(value)` for JSON-like values.
fn write_py_repr(out: &mut String, value: &Value) {
    match value.kind() {
        ValueKind::Undefined => {}
        ValueKind::None => out.push_str("None"),
        ValueKind::Bool => out.push_str(if value.is_true() { "True" } else { "False" }),
        ValueKind::Number => {
            if value.is_integer() {
                let _ = write!(out, "{value}");
            } else {
                write_py_float(out, f64::try_from(value.clone()).unwrap_or(f64::NAN));
            }
        }
        ValueKind::String => write_py_repr_str(out, value.as_str().unwrap_or("")),
        ValueKind::Seq => {
            out.push('[');
            if let Ok(items) = value.try_iter() {
                for (i, item) in items.enumerate() {
                    if i > 0 {
                        out.push_str(", ");
                    }
                    write_py_repr(out, &item);
                }
            }
            out.push(']');
        }
        ValueKind::Map => {
            out.push('{');
            if let Ok(keys) = value.try_iter() {
                for (i, k) in keys.enumerate() {
                    if i > 0 {
                        out.push_str(", ");
                    }
                    write_py_repr(out, &k);
                    out.push_str(": ");
                    write_py_repr(out, &value.get_item(&k).unwrap_or_default());
                }
            }
            out.push('}');
        }
        _ => {
            let _ = write!(out, "{value}");
        }
    }
}

/// Python's `repr(str)`: single quotes unless the text has `'` and no `"`; `\\`, `\n`, `\r`,
/// `\t` and other non-printable characters escaped.
fn write_py_repr_str(out: &mut String, s: &str) {
    let quote = if s.contains('\'') && !s.contains('"') {
        '"'
    } else {
        '\''
    };
    out.push(quote);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if (c as u32) < 0x20 || c as u32 == 0x7f => {
                let _ = write!(out, "\\x{:02x}", c as u32);
            }
            c if (0x80..0xa0).contains(&(c as u32)) => {
                let _ = write!(out, "\\x{:02x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push(quote);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn render_expr(expr: &str, ctx: Value) -> Result<String> {
        let t = ChatTemplate::new(expr, TemplateTokens::default())?;
        t.render(ctx, false)
    }

    #[test]
    fn tojson_matches_python_json_dumps() {
        let msgs = Value::from_serialize(serde_json::json!({
            "a": [1, 2.5, "x<y>&'z", null, true, {"b": []}, {}],
            "u": "héllo ✓ 😀\n\u{1}"
        }));
        let out = render_expr("{{ messages|tojson }}", msgs.clone()).unwrap();
        // json.dumps({"a": [1, 2.5, "x<y>&'z", None, True, {"b": []}, {}], "u": "héllo ✓ 😀\n\x01"}, ensure_ascii=False)
        assert_eq!(
            out,
            r#"{"a": [1, 2.5, "x<y>&'z", null, true, {"b": []}, {}], "u": "héllo ✓ 😀\n\u0001"}"#
        );
        let out = render_expr("{{ messages|tojson(indent=2) }}", msgs.clone()).unwrap();
        assert_eq!(
            out,
            "{\n  \"a\": [\n    1,\n    2.5,\n    \"x<y>&'z\",\n    null,\n    true,\n    {\n      \"b\": []\n    },\n    {}\n  ],\n  \"u\": \"héllo ✓ 😀\\n\\u0001\"\n}"
        );
        let out = render_expr("{{ messages.u|tojson(ensure_ascii=true) }}", msgs).unwrap();
        assert_eq!(out, r#""h\u00e9llo \u2713 \ud83d\ude00\n\u0001""#);
    }

    #[test]
    fn tojson_sort_keys_and_separators() {
        let v = Value::from_serialize(serde_json::json!({"b": 1, "a": {"d": 1e20, "c": 1e-5}}));
        let out = render_expr(
            "{{ messages|tojson(sort_keys=true, separators=[',', ':']) }}",
            v,
        )
        .unwrap();
        assert_eq!(out, r#"{"a":{"c":1e-05,"d":1e+20},"b":1}"#);
    }

    #[test]
    fn python_float_repr() {
        for (f, want) in [
            (1.0, "1.0"),
            (0.1, "0.1"),
            (-2.5, "-2.5"),
            (1e16, "1e+16"),
            (1.5e-7, "1.5e-07"),
            (123456.789, "123456.789"),
            (0.0001, "0.0001"),
        ] {
            let mut s = String::new();
            write_py_float(&mut s, f);
            assert_eq!(s, want, "{f}");
        }
    }

    #[test]
    fn raise_exception_becomes_template_raised() {
        let err = render_expr("{{ raise_exception('bad role\nx') }}", Value::from(())).unwrap_err();
        match err {
            ProfileError::TemplateRaised { message } => assert_eq!(message, "bad role x"),
            other => panic!("unexpected {other:?}"),
        }
    }

    #[test]
    fn syntax_error_at_compile_time_is_one_line() {
        let err = ChatTemplate::new("{% for x in %}", TemplateTokens::default()).unwrap_err();
        assert_eq!(err.error_type(), "template_error");
        assert!(!err.to_string().contains('\n'), "{err}");
    }

    #[test]
    fn message_fields_keep_their_order() {
        #[derive(serde::Serialize)]
        struct M {
            role: &'static str,
            content: &'static str,
            name: &'static str,
        }
        let v = Value::from_serialize(vec![M {
            role: "user",
            content: "hi",
            name: "bob",
        }]);
        let out = render_expr(
            "{{ messages[0]|tojson }}|{% for k in messages[0] %}{{ k }},{% endfor %}",
            v,
        )
        .unwrap();
        assert_eq!(
            out,
            r#"{"role": "user", "content": "hi", "name": "bob"}|role,content,name,"#
        );
    }

    #[test]
    fn pycompat_methods_and_strftime() {
        let v = Value::from_serialize(serde_json::json!({"s": "  Hi  ", "d": {"k": 1}}));
        let out = render_expr(
            "{{ messages.s.strip().upper() }}|{% for k, v in messages.d.items() %}{{k}}={{v}}{% endfor %}|{{ strftime_now('%Y') | length }}",
            v,
        )
        .unwrap();
        assert_eq!(out, "HI|k=1|4");
    }

    #[test]
    fn trim_and_lstrip_blocks_and_loop_controls() {
        let v = Value::from_serialize(serde_json::json!([1, 2, 3]));
        let out = render_expr(
            "{% for m in messages %}\n  {% if m == 2 %}{% continue %}{% endif %}\n{{ m }}\n{% endfor %}\n",
            v,
        )
        .unwrap();
        assert_eq!(out, "1\n3\n");
    }
}
