//! The chat template: compiled once, rendered per request with HF-compatible extras.
//!
//! The environment mirrors what `transformers` sets up for `apply_chat_template`:
//! `trim_blocks` and `lstrip_blocks` on, `keep_trailing_newline` off, loop controls
//! (`break`/`continue`), Python string/dict/list methods via minijinja-contrib's pycompat
//! callback, `raise_exception(msg)`, a `tojson` filter that matches Python's
//! `json.dumps(x, ensure_ascii=False)` (separators `", "`/`": "`, no HTML escaping,
//! `indent`/`separators`/`sort_keys`/`ensure_ascii` arguments), and `strftime_now(fmt)`.
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
        env.add_template_owned(TEMPLATE_NAME, source.clone())
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

    /// Render `messages` (already converted to template values).
    pub fn render(&self, messages: Value, add_generation_prompt: bool) -> Result<String> {
        let tmpl = self
            .env
            .get_template(TEMPLATE_NAME)
            .map_err(|e| template_error(&e))?;
        let ctx = minijinja::context! {
            messages => messages,
            add_generation_prompt => add_generation_prompt,
            bos_token => self.tokens.bos.as_deref().unwrap_or(""),
            eos_token => self.tokens.eos.as_deref().unwrap_or(""),
            unk_token => self.tokens.unk.as_deref(),
            pad_token => self.tokens.pad.as_deref(),
            tools => Value::from(()),
            documents => Value::from(()),
        };
        tmpl.render(ctx).map_err(|e| template_error(&e))
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

/// `strftime_now(format)`: the local time formatted with Python/C `strftime` directives.
fn strftime_now(format: String) -> Result<Value, minijinja::Error> {
    let now = chrono::Local::now();
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
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
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
        ValueKind::Seq | ValueKind::Iterable => {
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
