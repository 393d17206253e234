//! The OpenAI Responses API's request (`POST /v1/responses`) read as the chat request it asks
//! for, so that the gateway (routing, block keys) and the worker (generation) render the same
//! prompt from it through the chat path: one translation, called by both.
//!
//! | Responses field | chat field |
//! |---|---|
//! | `instructions` | a first `system` message |
//! | `input` (string) | one `user` message |
//! | `input` items: `{"role", "content"}` (`type` absent or `message`; roles `user`, `assistant`, `system`, `developer` → `system`; content a string or `input_text` / `output_text` parts) | messages |
//! | `function_call` items (`call_id`, `name`, `arguments`) | an `assistant` message's `tool_calls` (consecutive calls: one message) |
//! | `function_call_output` items (`call_id`, `output`) | a `tool` message |
//! | `reasoning` items | dropped (a model's earlier reasoning is not re-sent) |
//! | `tools` `[{"type": "function", "name", "description", "parameters"}]` | `tools` `[{"type": "function", "function": {…}}]` |
//! | `tool_choice` `{"type": "function", "name"}` | `{"type": "function", "function": {"name"}}` (strings as they are) |
//! | `text.format` `text` / `json_object` / `json_schema` (`name`, `schema`, `strict`) | `response_format` |
//! | `max_output_tokens` | `max_completion_tokens` |
//! | `truncation` `auto` (`disabled`: nothing) | `truncation: "auto"` |
//! | `stream` | `stream` with `stream_options.include_usage` |
//! | `include: ["message.output_text.logprobs"]`, `top_logprobs` (0–20) | `logprobs: true` (either asks for it: `top_logprobs` > 0 alone too), `top_logprobs` |
//! | `temperature`, `top_p`, `user`, `metadata`, `parallel_tool_calls`, `service_tier` and any other key | as they are (the chat validation judges them: an unknown key is `unknown_parameter`) |
//!
//! `truncation: "auto"` goes to chat as `truncation: "auto"` (a conversation over the context
//! loses its oldest turns: `PromptProfile::tokenize_within`).
//!
//! Refused (`unsupported_parameter`, naming the field): `previous_response_id` and
//! `conversation` (the worker stores nothing; the gateway resolves `previous_response_id`
//! before this translation, `gateway::response_store`), `background: true`, `include` entries other than
//! `message.output_text.logprobs`, a non-empty `reasoning`, items and
//! content parts of other types (images, files, built-in tools). `store` is accepted and nothing
//! is stored by the worker.
//!
//! What the gateway stores is told to the worker in one header, [`STORED_HEADER`] ([`Stored`]),
//! so that the response object the worker writes says `store` and `previous_response_id` as
//! the client's request set them (the worker honours it only on a request with a verified route
//! ticket: the gateway removes any the client sent).

use serde_json::{json, Map, Value};

use crate::body::BodyError;
use crate::prompt::FieldError;

/// The header a gateway that stores Responses API answers sends with each `POST /v1/responses`
/// it forwards ([`Stored`]).
pub const STORED_HEADER: &str = "x-kvgate-stored";

/// What the gateway does with a Responses API request, for the response object's `store`,
/// `background` and `previous_response_id`: header value `store=true` or `store=false`, then
/// `; background=true` when the gateway runs it as a background response, then
/// `; previous_response_id=<id>` when it continued a stored conversation, then
/// `; conversation=<id>` when it is a turn of a conversation object (the Conversations API);
/// ids of visible ASCII without `;`, `=` or spaces, at most 256 bytes (another is left out).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Stored {
    /// The gateway stores the answer.
    pub store: bool,
    /// The gateway runs the request in the background (the client polls for the answer).
    pub background: bool,
    /// The stored turn the request continued.
    pub previous_response_id: Option<String>,
    /// The conversation (`conv_…`) the request is a turn of.
    pub conversation: Option<String>,
}

/// The longest response id kvgate stores, looks up or carries in [`STORED_HEADER`].
pub const MAX_RESPONSE_ID_LEN: usize = 256;

fn header_safe_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= MAX_RESPONSE_ID_LEN
        && id
            .bytes()
            .all(|b| b.is_ascii_graphic() && b != b';' && b != b'=')
}

impl Stored {
    /// The header's value.
    pub fn header_value(&self) -> String {
        let mut v = format!("store={}", self.store);
        if self.background {
            v.push_str("; background=true");
        }
        if let Some(id) = self
            .previous_response_id
            .as_deref()
            .filter(|id| header_safe_id(id))
        {
            v.push_str("; previous_response_id=");
            v.push_str(id);
        }
        if let Some(id) = self.conversation.as_deref().filter(|id| header_safe_id(id)) {
            v.push_str("; conversation=");
            v.push_str(id);
        }
        v
    }

    /// From the header's value; `None` when it is not one.
    pub fn parse(value: &str) -> Option<Stored> {
        let mut parts = value.split(';').map(str::trim);
        let store = match parts.next()? {
            "store=true" => true,
            "store=false" => false,
            _ => return None,
        };
        let mut next = parts.next();
        let background = next == Some("background=true");
        if background {
            next = parts.next();
        }
        // `name=<id>` when `next` is that part (then the part after it is next).
        let mut take = |name: &str| -> Option<Option<String>> {
            let Some(id) = next.and_then(|p| p.strip_prefix(name)) else {
                return Some(None);
            };
            next = parts.next();
            header_safe_id(id).then(|| Some(id.to_owned()))
        };
        let previous_response_id = take("previous_response_id=")?;
        let conversation = take("conversation=")?;
        next.is_none().then_some(Stored {
            store,
            background,
            previous_response_id,
            conversation,
        })
    }
}

/// The request fields a `response` object repeats, with their defaults when the request did
/// not set them, and `store`, `background` and `previous_response_id` as [`Stored`] says (all
/// `false` / `null` without one: nothing stored). One list for the worker, which writes the
/// response, and the gateway, which answers a background request with the object before the
/// worker has written it.
pub fn echoed_fields(body: &[u8], stored: Option<&Stored>) -> Map<String, Value> {
    let v: Value = serde_json::from_slice(body).unwrap_or(Value::Null);
    let mut m = Map::new();
    for (k, default) in [
        ("instructions", Value::Null),
        ("max_output_tokens", Value::Null),
        ("metadata", json!({})),
        ("parallel_tool_calls", json!(true)),
        ("temperature", json!(1.0)),
        ("top_p", json!(1.0)),
        ("tool_choice", json!("auto")),
        ("tools", json!([])),
        ("text", json!({"format": {"type": "text"}})),
        ("truncation", json!("disabled")),
        ("user", Value::Null),
    ] {
        let given = v.get(k).filter(|x| !x.is_null()).cloned();
        m.insert(k.into(), given.unwrap_or(default));
    }
    let none = Stored::default();
    let stored = stored.unwrap_or(&none);
    m.insert("store".into(), json!(stored.store));
    m.insert("background".into(), json!(stored.background));
    m.insert(
        "previous_response_id".into(),
        json!(stored.previous_response_id),
    );
    m.insert(
        "conversation".into(),
        stored
            .conversation
            .as_ref()
            .map_or(Value::Null, |id| json!({ "id": id })),
    );
    m
}

fn unsupported(param: impl Into<String>, reason: &str) -> BodyError {
    BodyError::field(FieldError {
        param: param.into(),
        reason: reason.to_string(),
        unsupported: true,
    })
}

fn invalid(param: impl Into<String>, reason: &str) -> BodyError {
    BodyError::field(FieldError {
        param: param.into(),
        reason: reason.to_string(),
        unsupported: false,
    })
}

/// Neutral: absent, `null`, `false`, an empty string, array or object.
fn neutral(v: Option<&Value>) -> bool {
    match v {
        None | Some(Value::Null) | Some(Value::Bool(false)) => true,
        Some(Value::String(s)) => s.is_empty(),
        Some(Value::Array(a)) => a.is_empty(),
        Some(Value::Object(o)) => o.values().all(Value::is_null),
        _ => false,
    }
}

/// The text of a message's `content`: a string, or `input_text` / `output_text` parts joined.
fn content_text(v: &Value, at: &str) -> Result<String, BodyError> {
    match v {
        Value::String(s) => Ok(s.clone()),
        Value::Array(parts) => {
            let mut text = String::new();
            for (j, p) in parts.iter().enumerate() {
                match p.get("type").and_then(Value::as_str) {
                    Some("input_text" | "output_text" | "text") => {
                        let t = p.get("text").and_then(Value::as_str).ok_or_else(|| {
                            invalid(format!("{at}[{j}].text"), "a text part needs `text`")
                        })?;
                        text.push_str(t);
                    }
                    Some(other) => {
                        return Err(unsupported(
                            format!("{at}[{j}].type"),
                            &format!("`{other}` content is not supported (text only)"),
                        ))
                    }
                    None => return Err(invalid(format!("{at}[{j}].type"), "a part needs `type`")),
                }
            }
            Ok(text)
        }
        _ => Err(invalid(at, "must be a string or an array of text parts")),
    }
}

fn str_field<'a>(item: &'a Value, key: &str, at: &str) -> Result<&'a str, BodyError> {
    item.get(key)
        .and_then(Value::as_str)
        .ok_or_else(|| invalid(format!("{at}.{key}"), "must be a string"))
}

/// The chat messages of `input` (after `instructions`).
fn messages(instructions: Option<&Value>, input: &Value) -> Result<Vec<Value>, BodyError> {
    let mut out = Vec::new();
    match instructions {
        None | Some(Value::Null) => {}
        Some(Value::String(s)) => out.push(json!({"role": "system", "content": s})),
        Some(_) => return Err(invalid("instructions", "must be a string")),
    }
    let items = match input {
        Value::String(s) => {
            out.push(json!({"role": "user", "content": s}));
            return Ok(out);
        }
        Value::Array(items) => items,
        _ => return Err(invalid("input", "must be a string or an array of items")),
    };
    for (i, item) in items.iter().enumerate() {
        let at = format!("input[{i}]");
        if !item.is_object() {
            return Err(invalid(at, "an item must be an object"));
        }
        match item.get("type").and_then(Value::as_str) {
            None | Some("message") => {
                let role = match str_field(item, "role", &at)? {
                    "developer" | "system" => "system",
                    r @ ("user" | "assistant") => r,
                    _ => {
                        return Err(invalid(
                            format!("{at}.role"),
                            "must be `user`, `assistant`, `system` or `developer`",
                        ))
                    }
                };
                let content = item
                    .get("content")
                    .ok_or_else(|| invalid(format!("{at}.content"), "a message needs `content`"))?;
                let text = content_text(content, &format!("{at}.content"))?;
                out.push(json!({"role": role, "content": text}));
            }
            Some("function_call") => {
                let call = json!({
                    "id": str_field(item, "call_id", &at)?,
                    "type": "function",
                    "function": {
                        "name": str_field(item, "name", &at)?,
                        "arguments": str_field(item, "arguments", &at)?,
                    }
                });
                // Consecutive calls are one assistant turn (parallel calls).
                let merged = out.last_mut().and_then(|m| {
                    let calls = m.get_mut("tool_calls")?.as_array_mut()?;
                    calls.push(call.clone());
                    Some(())
                });
                if merged.is_none() {
                    out.push(json!({"role": "assistant", "content": "", "tool_calls": [call]}));
                }
            }
            Some("function_call_output") => {
                let output = item
                    .get("output")
                    .ok_or_else(|| invalid(format!("{at}.output"), "needs `output`"))?;
                let text = content_text(output, &format!("{at}.output"))?;
                out.push(json!({
                    "role": "tool",
                    "tool_call_id": str_field(item, "call_id", &at)?,
                    "content": text,
                }));
            }
            Some("reasoning") => {}
            Some(other) => {
                return Err(unsupported(
                    format!("{at}.type"),
                    &format!("`{other}` items are not supported"),
                ))
            }
        }
    }
    Ok(out)
}

/// A Responses API request body as the chat request body it asks for (see the module docs).
/// Never panics on client input; errors name the Responses field.
pub fn responses_to_chat(body: &[u8]) -> Result<Vec<u8>, BodyError> {
    let v: Value = serde_json::from_slice(body).map_err(|e| BodyError::not_json(&e))?;
    let Value::Object(mut o) = v else {
        return Err(BodyError::not_an_object());
    };
    for (k, why) in [
        (
            "previous_response_id",
            "responses are not stored: send the whole conversation in `input`",
        ),
        (
            "conversation",
            "conversations are not stored: send the whole conversation in `input`",
        ),
        ("background", "background responses are not supported"),
        ("reasoning", "reasoning options are not supported"),
        ("prompt", "stored prompts are not supported"),
    ] {
        if !neutral(o.get(k)) {
            return Err(unsupported(k, why));
        }
        o.remove(k);
    }
    // `auto` goes to the chat prompt (`ChatTemplateFields::truncation`); the default,
    // `disabled`, need not.
    let truncate = match o.remove("truncation") {
        None | Some(Value::Null) => false,
        Some(Value::String(s)) if s == "disabled" => false,
        Some(Value::String(s)) if s == "auto" => true,
        Some(_) => return Err(invalid("truncation", "must be `auto` or `disabled`")),
    };
    // Log probabilities: `include` asks for them, `top_logprobs` for their alternatives (the
    // chat validation judges the count).
    const LOGPROBS: &str = "message.output_text.logprobs";
    let mut logprobs = false;
    match o.remove("include") {
        None | Some(Value::Null) => {}
        Some(Value::Array(a)) => {
            for (i, x) in a.iter().enumerate() {
                match x.as_str() {
                    Some(LOGPROBS) => logprobs = true,
                    Some(other) => {
                        return Err(unsupported(
                            format!("include[{i}]"),
                            &format!("`{other}` cannot be included (only `{LOGPROBS}`)"),
                        ))
                    }
                    None => return Err(invalid(format!("include[{i}]"), "must be a string")),
                }
            }
        }
        Some(_) => return Err(invalid("include", "`include` must be an array of strings")),
    }
    let top = o.remove("top_logprobs").filter(|v| !v.is_null());
    if top.as_ref().is_some_and(|v| v.as_u64() != Some(0)) {
        logprobs = true;
    }
    o.remove("store");
    let input = o
        .remove("input")
        .ok_or_else(|| invalid("input", "`input` is required"))?;
    let msgs = messages(o.get("instructions"), &input)?;
    o.remove("instructions");
    let mut chat = Map::new();
    chat.insert("messages".into(), Value::Array(msgs));
    if let Some(m) = o.remove("max_output_tokens") {
        chat.insert("max_completion_tokens".into(), m);
    }
    if logprobs {
        chat.insert("logprobs".into(), Value::Bool(true));
    }
    if truncate {
        chat.insert("truncation".into(), json!("auto"));
    }
    if let Some(t) = top {
        chat.insert("top_logprobs".into(), t);
    }
    if let Some(tools) = o.remove("tools") {
        let Value::Array(tools) = tools else {
            return Err(invalid("tools", "must be an array"));
        };
        let mut out = Vec::new();
        for (i, t) in tools.into_iter().enumerate() {
            match t.get("type").and_then(Value::as_str) {
                Some("function") => {
                    let mut f = Map::new();
                    for k in ["name", "description", "parameters", "strict"] {
                        if let Some(v) = t.get(k) {
                            f.insert(k.into(), v.clone());
                        }
                    }
                    out.push(json!({"type": "function", "function": f}));
                }
                _ => {
                    return Err(unsupported(
                        format!("tools[{i}].type"),
                        "only `function` tools are supported",
                    ))
                }
            }
        }
        chat.insert("tools".into(), Value::Array(out));
    }
    if let Some(choice) = o.remove("tool_choice") {
        let choice = match &choice {
            Value::Object(c) if c.get("type").and_then(Value::as_str) == Some("function") => {
                let name = c
                    .get("name")
                    .cloned()
                    .ok_or_else(|| invalid("tool_choice.name", "a function choice needs `name`"))?;
                json!({"type": "function", "function": {"name": name}})
            }
            Value::Object(_) => {
                return Err(unsupported(
                    "tool_choice.type",
                    "only `function` choices are supported",
                ))
            }
            _ => choice,
        };
        chat.insert("tool_choice".into(), choice);
    }
    if let Some(text) = o.remove("text") {
        let Value::Object(mut text) = text else {
            return Err(invalid("text", "must be an object"));
        };
        if let Some(format) = text.remove("format") {
            let format = match format.get("type").and_then(Value::as_str) {
                Some("text") | None if format.is_null() => None,
                Some("text") => None,
                Some("json_object") => Some(json!({"type": "json_object"})),
                Some("json_schema") => {
                    let mut js = Map::new();
                    for k in ["name", "schema", "strict", "description"] {
                        if let Some(v) = format.get(k) {
                            js.insert(k.into(), v.clone());
                        }
                    }
                    Some(json!({"type": "json_schema", "json_schema": js}))
                }
                _ => {
                    return Err(invalid(
                        "text.format.type",
                        "must be `text`, `json_object` or `json_schema`",
                    ))
                }
            };
            if let Some(f) = format {
                chat.insert("response_format".into(), f);
            }
        }
        text.remove("verbosity");
        if let Some(k) = text.keys().next() {
            return Err(invalid(format!("text.{k}"), "unknown field"));
        }
    }
    if let Some(s) = o.remove("stream") {
        if s == Value::Bool(true) {
            chat.insert("stream_options".into(), json!({"include_usage": true}));
        }
        chat.insert("stream".into(), s);
    }
    // Everything else as it is: the chat validation reads (or refuses) it.
    for (k, v) in o {
        chat.entry(k).or_insert(v);
    }
    serde_json::to_vec(&Value::Object(chat)).map_err(|e| BodyError::not_json(&e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_stored_header_round_trips_and_refuses_what_it_cannot_carry() {
        let stored = |store: bool, background: bool, previous: Option<&str>| Stored {
            store,
            background,
            previous_response_id: previous.map(str::to_owned),
            conversation: None,
        };
        let conv = |store: bool, background: bool, conv: &str| Stored {
            store,
            background,
            previous_response_id: None,
            conversation: Some(conv.to_owned()),
        };
        for s in [
            stored(true, false, None),
            stored(false, false, Some("resp_abc-1")),
            stored(true, false, Some("resp_x")),
            stored(true, true, None),
            stored(true, true, Some("resp_y")),
            conv(true, false, "conv_1"),
            conv(false, true, "conv_2"),
        ] {
            assert_eq!(
                Stored::parse(&s.header_value()),
                Some(s.clone()),
                "{}",
                s.header_value()
            );
        }
        assert_eq!(stored(true, false, None).header_value(), "store=true");
        assert_eq!(
            stored(true, true, Some("resp_1")).header_value(),
            "store=true; background=true; previous_response_id=resp_1"
        );
        // An id the header cannot carry is left out, not mangled.
        for bad in ["a b", "a;b", "a=b", "", "é", &"r".repeat(257)] {
            let s = stored(true, false, Some(bad));
            assert_eq!(s.header_value(), "store=true", "{bad:?}");
        }
        for bad in [
            "",
            "store",
            "store=yes",
            "store=true;",
            "store=true; previous_response_id=",
            "store=true; previous_response_id=a b",
            "store=true; other=x",
            "store=true; previous_response_id=a; x=y",
            "store=true; background=false",
            "store=true; previous_response_id=a; background=true",
            "store=true; background=true; background=true",
            "store=true; conversation=c; previous_response_id=a",
            "store=true; conversation=",
            "store=true; conversation=c; conversation=d",
        ] {
            assert_eq!(Stored::parse(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn truncation_auto_goes_to_chat_and_disabled_goes_nowhere() {
        let c = chat(json!({"model": "m", "input": "x", "truncation": "auto"}));
        assert_eq!(c["truncation"], "auto");
        let c = chat(json!({"model": "m", "input": "x", "truncation": "disabled"}));
        assert!(c.get("truncation").is_none(), "{c}");
    }

    #[test]
    fn a_response_repeats_the_request_fields_and_what_is_stored() {
        let body = br#"{"model":"m","input":"x","temperature":0.5,"metadata":{"k":"v"}}"#;
        let m = echoed_fields(body, None);
        assert_eq!(m["temperature"], json!(0.5));
        assert_eq!(m["metadata"], json!({"k": "v"}));
        assert_eq!(m["top_p"], json!(1.0));
        assert_eq!(m["tools"], json!([]));
        assert_eq!(
            (&m["store"], &m["background"], &m["previous_response_id"]),
            (&json!(false), &json!(false), &Value::Null)
        );
        let s = Stored {
            store: true,
            background: true,
            previous_response_id: Some("resp_0".into()),
            conversation: None,
        };
        let m = echoed_fields(body, Some(&s));
        assert_eq!(
            (&m["store"], &m["background"], &m["previous_response_id"]),
            (&json!(true), &json!(true), &json!("resp_0"))
        );
        assert_eq!(m["conversation"], Value::Null);
        let s = Stored {
            conversation: Some("conv_1".into()),
            ..Stored::default()
        };
        assert_eq!(
            echoed_fields(body, Some(&s))["conversation"],
            json!({"id": "conv_1"})
        );
        // Not JSON: the defaults.
        assert_eq!(echoed_fields(b"{", None)["temperature"], json!(1.0));
    }

    fn chat(v: Value) -> Value {
        serde_json::from_slice(&responses_to_chat(v.to_string().as_bytes()).unwrap()).unwrap()
    }

    fn err(v: Value) -> (&'static str, Option<String>) {
        let e = responses_to_chat(v.to_string().as_bytes()).unwrap_err();
        (e.code, e.param)
    }

    #[test]
    fn a_conversation_with_tools_becomes_its_chat_request() {
        let c = chat(json!({
            "model": "m", "instructions": "Be brief.", "max_output_tokens": 9, "stream": true,
            "temperature": 0.5, "store": true, "seed": 3,
            "input": [
                {"role": "developer", "content": "Use tools."},
                {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather in "}, {"type": "input_text", "text": "Paris?"}]},
                {"type": "reasoning", "id": "rs_1", "summary": []},
                {"type": "function_call", "call_id": "c1", "name": "w", "arguments": "{\"city\":\"Paris\"}"},
                {"type": "function_call", "call_id": "c2", "name": "w", "arguments": "{\"city\":\"Lyon\"}"},
                {"type": "function_call_output", "call_id": "c1", "output": "18 C"},
                {"role": "assistant", "content": [{"type": "output_text", "text": "It is 18 C."}]}
            ],
            "tools": [{"type": "function", "name": "w", "parameters": {"type": "object", "properties": {}}}],
            "tool_choice": {"type": "function", "name": "w"},
            "text": {"format": {"type": "json_schema", "name": "s", "schema": {"type": "object"}, "strict": true}}
        }));
        assert_eq!(
            c["messages"],
            json!([
                {"role": "system", "content": "Be brief."},
                {"role": "system", "content": "Use tools."},
                {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "w", "arguments": "{\"city\":\"Paris\"}"}},
                    {"id": "c2", "type": "function", "function": {"name": "w", "arguments": "{\"city\":\"Lyon\"}"}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "18 C"},
                {"role": "assistant", "content": "It is 18 C."}
            ])
        );
        assert_eq!(c["tools"][0]["function"]["name"], "w");
        assert_eq!(
            c["tool_choice"],
            json!({"type": "function", "function": {"name": "w"}})
        );
        assert_eq!(c["response_format"]["json_schema"]["name"], "s");
        assert_eq!(c["max_completion_tokens"], 9);
        assert_eq!(c["stream_options"], json!({"include_usage": true}));
        assert_eq!(
            (c["temperature"].clone(), c["seed"].clone()),
            (json!(0.5), json!(3))
        );
        assert!(c.get("store").is_none() && c.get("input").is_none());
        // A string input is one user message.
        assert_eq!(
            chat(json!({"model": "m", "input": "hi"}))["messages"],
            json!([{"role": "user", "content": "hi"}])
        );
    }

    #[test]
    fn log_probabilities_are_asked_by_include_or_top_logprobs() {
        let with = |extra: Value| {
            let mut b = json!({"model": "m", "input": "x"});
            for (k, v) in extra.as_object().unwrap() {
                b[k] = v.clone();
            }
            let c = chat(b);
            (c.get("logprobs").cloned(), c.get("top_logprobs").cloned())
        };
        let lp = json!(["message.output_text.logprobs"]);
        assert_eq!(with(json!({})), (None, None));
        assert_eq!(with(json!({"include": []})), (None, None));
        assert_eq!(with(json!({"include": lp})), (Some(json!(true)), None));
        assert_eq!(
            with(json!({"include": lp, "top_logprobs": 3})),
            (Some(json!(true)), Some(json!(3)))
        );
        assert_eq!(
            with(json!({"top_logprobs": 2})),
            (Some(json!(true)), Some(json!(2)))
        );
        assert_eq!(with(json!({"top_logprobs": 0})), (None, Some(json!(0))));
        assert_eq!(with(json!({"top_logprobs": null})), (None, None));
    }

    #[test]
    fn what_cannot_be_served_is_refused_by_name() {
        for (body, code, param) in [
            (
                json!({"model": "m", "input": "x", "include": ["reasoning.encrypted_content"]}),
                "unsupported_parameter",
                "include[0]",
            ),
            (
                json!({"model": "m", "input": "x", "include": "message.output_text.logprobs"}),
                "invalid_value",
                "include",
            ),
            (json!({"model": "m"}), "invalid_value", "input"),
            (
                json!({"model": "m", "input": "x", "previous_response_id": "resp_1"}),
                "unsupported_parameter",
                "previous_response_id",
            ),
            (
                json!({"model": "m", "input": "x", "background": true}),
                "unsupported_parameter",
                "background",
            ),
            (
                json!({"model": "m", "input": "x", "truncation": "some"}),
                "invalid_value",
                "truncation",
            ),
            (
                json!({"model": "m", "input": "x", "reasoning": {"effort": "high"}}),
                "unsupported_parameter",
                "reasoning",
            ),
            (
                json!({"model": "m", "input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}),
                "unsupported_parameter",
                "input[0].content[0].type",
            ),
            (
                json!({"model": "m", "input": [{"type": "web_search_call"}]}),
                "unsupported_parameter",
                "input[0].type",
            ),
            (
                json!({"model": "m", "input": [{"role": "robot", "content": "x"}]}),
                "invalid_value",
                "input[0].role",
            ),
            (
                json!({"model": "m", "input": [{"type": "function_call", "name": "w"}]}),
                "invalid_value",
                "input[0].call_id",
            ),
            (
                json!({"model": "m", "input": "x", "tools": [{"type": "web_search"}]}),
                "unsupported_parameter",
                "tools[0].type",
            ),
            (
                json!({"model": "m", "input": "x", "text": {"format": {"type": "yaml"}}}),
                "invalid_value",
                "text.format.type",
            ),
            (json!({"model": "m", "input": 5}), "invalid_value", "input"),
        ] {
            assert_eq!(err(body.clone()), (code, Some(param.to_string())), "{body}");
        }
        assert_eq!(responses_to_chat(b"[1]").unwrap_err().code, "invalid_json");
        assert_eq!(responses_to_chat(b"{").unwrap_err().code, "invalid_json");
    }
}
