//! `POST /v1/responses`, the OpenAI Responses API, on the chat path: the request is read as the
//! chat request it asks for (`prompt_profile::responses_to_chat`, shared with the gateway), run
//! and receipted as one (`generate`), and its answer written as a `response` object — output
//! items `reasoning` (when a reasoning parser separated it), `message` (`output_text`) and
//! `function_call` — or, streamed, as the Responses API's typed events (docs/worker-api.md,
//! "Responses API").

use std::convert::Infallible;
use std::sync::Arc;

use axum::response::sse::Event;
use futures::stream::{self, Stream, StreamExt};
use serde_json::{json, Map, Value};
use tokio::sync::mpsc;

use crate::generate::{AnswerStream, Msg, ResponseMeta};
use crate::protocol::{ChatChoice, ChatDelta, UsageBody};

/// The request fields a `response` object repeats, with their defaults
/// (`prompt_profile::echoed_fields`, which the gateway's background answers use too).
#[derive(Clone, Debug)]
pub(crate) struct Echo(Map<String, Value>);

impl Echo {
    /// From the request body (already validated through its chat translation) and what the
    /// gateway that forwarded it stores of it (`store: false` and no `previous_response_id`
    /// without one: the worker stores nothing).
    pub(crate) fn of(body: &[u8], stored: Option<prompt_profile::Stored>) -> Echo {
        Echo(prompt_profile::echoed_fields(body, stored.as_ref()))
    }
}

/// The Responses API's `usage` of the chat usage.
fn usage(u: &UsageBody) -> Value {
    json!({
        "input_tokens": u.prompt_tokens,
        "input_tokens_details": {"cached_tokens": u.prompt_tokens_details.cached_tokens},
        "output_tokens": u.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": u.total_tokens,
    })
}

/// A `response` object: `output` items, the finish reason (`length`: `incomplete`), usage.
fn response(
    meta: &ResponseMeta,
    echo: &Echo,
    output: Vec<Value>,
    finish: Option<&str>,
    u: Option<&UsageBody>,
) -> Value {
    let mut r = json!({
        "id": meta.id,
        "object": "response",
        "created_at": meta.created,
        "model": meta.model,
        "output": output,
        "error": null,
        "incomplete_details": null,
        "status": match finish {
            None => "in_progress",
            Some("length") => "incomplete",
            Some(_) => "completed",
        },
        "usage": u.map(usage),
    });
    if finish == Some("length") {
        r["incomplete_details"] = json!({"reason": "max_output_tokens"});
    }
    if let Value::Object(o) = &mut r {
        for (k, v) in &echo.0 {
            o.insert(k.clone(), v.clone());
        }
    }
    r
}

/// Item ids: `msg_…`, `rs_…`, `fc_…` from the response id.
fn item_id(meta: &ResponseMeta, kind: &str, n: usize) -> String {
    let base = meta.id.trim_start_matches("resp_");
    format!("{kind}_{base}_{n}")
}

/// A message item; `logprobs`: its `output_text`'s (`[]` unless asked).
fn message_item(id: &str, text: &str, done: bool, logprobs: &[Value]) -> Value {
    let status = if done { "completed" } else { "in_progress" };
    let content = if done {
        json!([{"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}])
    } else {
        json!([])
    };
    json!({"type": "message", "id": id, "status": status, "role": "assistant", "content": content})
}

fn reasoning_item(id: &str, text: &str) -> Value {
    json!({"type": "reasoning", "id": id, "summary": [],
           "content": [{"type": "reasoning_text", "text": text}], "status": "completed"})
}

fn call_item(id: &str, call_id: &str, name: &str, arguments: &str, done: bool) -> Value {
    json!({"type": "function_call", "id": id, "call_id": call_id, "name": name,
           "arguments": arguments, "status": if done { "completed" } else { "in_progress" }})
}

/// The non-streamed `response` of one chat choice.
pub(crate) fn body(meta: &ResponseMeta, echo: &Echo, choice: &ChatChoice, u: &UsageBody) -> Value {
    let m = &choice.message;
    let mut output = Vec::new();
    if let Some(r) = &m.reasoning_content {
        output.push(reasoning_item(&item_id(meta, "rs", output.len()), r));
    }
    let message = m
        .content
        .as_deref()
        .filter(|c| !c.is_empty() || m.tool_calls.is_empty());
    let push_message = |output: &mut Vec<Value>| {
        if let Some(c) = message {
            // Asked for (`include`, `top_logprobs`): every generated token's, as chat gives
            // them.
            let logprobs = choice
                .logprobs
                .as_ref()
                .and_then(|l| l["content"].as_array().cloned())
                .unwrap_or_default();
            let id = item_id(meta, "msg", output.len());
            output.push(message_item(&id, c, true, &logprobs));
        }
    };
    // Items in the order they were written (as streamed): the text first, unless it came
    // after the calls (a forced list cut by `max_output_tokens`).
    if !choice.content_after_calls {
        push_message(&mut output);
    }
    for t in &m.tool_calls {
        let id = item_id(meta, "fc", output.len());
        output.push(call_item(
            &id,
            &t.id,
            &t.function.name,
            &t.function.arguments,
            true,
        ));
    }
    if choice.content_after_calls {
        push_message(&mut output);
    }
    let finish = match choice.finish_reason.as_str() {
        "tool_calls" => "stop",
        f => f,
    };
    response(meta, echo, output, Some(finish), Some(u))
}

/// What an open output item of a streamed response is.
#[derive(Clone, PartialEq)]
enum Kind {
    Reasoning,
    Message,
    Call { call_id: String, name: String },
}

/// An open output item: its kind, id and the text (or arguments) streamed so far, with the
/// log probabilities its deltas carried (a message's).
struct Open {
    kind: Kind,
    id: String,
    text: String,
    logprobs: Vec<Value>,
}

/// The state of a streamed response: the items given out, the one open, the event count.
struct Events {
    meta: Arc<ResponseMeta>,
    echo: Echo,
    done: Vec<Value>,
    open: Option<Open>,
    seq: u64,
    /// Log probabilities of tokens generated since the last `output_text` delta (asked for:
    /// `include`, `top_logprobs`): the next message delta carries them.
    pending: Vec<Value>,
}

impl Events {
    fn event(&mut self, kind: &str, mut data: Value) -> Event {
        data["type"] = json!(kind);
        data["sequence_number"] = json!(self.seq);
        self.seq += 1;
        Event::default()
            .event(kind)
            .data(serde_json::to_string(&data).unwrap_or_default())
    }

    fn index(&self) -> usize {
        self.done.len()
    }

    /// Closes the open item, if any: its `done` events.
    fn close(&mut self, out: &mut Vec<Event>) {
        let Some(Open {
            kind,
            id,
            text,
            logprobs,
        }) = self.open.take()
        else {
            return;
        };
        let i = self.index();
        let item = match kind {
            Kind::Message => {
                let part = json!({"type": "output_text", "text": text, "annotations": [],
                                  "logprobs": logprobs});
                let ids = json!({"item_id": id, "output_index": i, "content_index": 0});
                let mut done = ids.clone();
                done["text"] = json!(text);
                done["logprobs"] = json!(logprobs);
                out.push(self.event("response.output_text.done", done));
                let mut part_done = ids;
                part_done["part"] = part;
                out.push(self.event("response.content_part.done", part_done));
                message_item(&id, &text, true, &logprobs)
            }
            Kind::Reasoning => reasoning_item(&id, &text),
            Kind::Call { call_id, name } => {
                let e = self.event(
                    "response.function_call_arguments.done",
                    json!({"item_id": id, "output_index": i, "arguments": text}),
                );
                out.push(e);
                call_item(&id, &call_id, &name, &text, true)
            }
        };
        let e = self.event(
            "response.output_item.done",
            json!({"output_index": i, "item": item}),
        );
        out.push(e);
        self.done.push(item);
    }

    /// Adds `piece` to the open item of `kind` — opening one (closing the one before) unless
    /// `kind` is open and `new` is false — with its `added` and delta events.
    fn piece(&mut self, kind: Kind, new: bool, piece: &str, out: &mut Vec<Event>) {
        if new || self.open.as_ref().map(|o| &o.kind) != Some(&kind) {
            self.close(out);
            let i = self.index();
            let (prefix, item) = match &kind {
                Kind::Reasoning => ("rs", None),
                Kind::Message => ("msg", None),
                Kind::Call { call_id, name } => ("fc", Some((call_id.clone(), name.clone()))),
            };
            let id = item_id(&self.meta, prefix, i);
            let item = match (&kind, item) {
                (Kind::Reasoning, _) => json!({"type": "reasoning", "id": id, "summary": [],
                                               "content": [], "status": "in_progress"}),
                (_, Some((call_id, name))) => call_item(&id, &call_id, &name, "", false),
                _ => message_item(&id, "", false, &[]),
            };
            let e = self.event(
                "response.output_item.added",
                json!({"output_index": i, "item": item}),
            );
            out.push(e);
            if kind == Kind::Message {
                let part =
                    json!({"type": "output_text", "text": "", "annotations": [], "logprobs": []});
                let e = self.event(
                    "response.content_part.added",
                    json!({"item_id": id, "output_index": i, "content_index": 0, "part": part}),
                );
                out.push(e);
            }
            self.open = Some(Open {
                kind: kind.clone(),
                id,
                text: String::new(),
                logprobs: Vec::new(),
            });
        }
        if piece.is_empty() {
            return;
        }
        let i = self.index();
        let Some(open) = self.open.as_mut() else {
            return;
        };
        open.text.push_str(piece);
        let mut data = json!({"item_id": open.id, "output_index": i, "delta": piece});
        let kind = match kind {
            Kind::Reasoning => "response.reasoning_text.delta",
            Kind::Message => "response.output_text.delta",
            Kind::Call { .. } => "response.function_call_arguments.delta",
        };
        if kind != "response.function_call_arguments.delta" {
            data["content_index"] = json!(0);
        }
        if kind == "response.output_text.delta" {
            let lps = std::mem::take(&mut self.pending);
            open.logprobs.extend(lps.iter().cloned());
            data["logprobs"] = Value::Array(lps);
        }
        out.push(self.event(kind, data));
    }

    /// One chat delta as events.
    fn delta(&mut self, d: ChatDelta, out: &mut Vec<Event>) {
        if let Some(r) = d.reasoning_content.filter(|r| !r.is_empty()) {
            self.piece(Kind::Reasoning, false, &r, out);
        }
        if let Some(c) = d.content.filter(|c| !c.is_empty()) {
            self.piece(Kind::Message, false, &c, out);
        }
        for t in d.tool_calls.into_iter().flatten() {
            let arguments = t.function.arguments.unwrap_or_default();
            match (t.id, &self.open) {
                // A call's first delta names it (a new item); the next carries its arguments.
                (Some(call_id), _) => {
                    let name = t.function.name.unwrap_or_default();
                    self.piece(Kind::Call { call_id, name }, true, &arguments, out);
                }
                (
                    None,
                    Some(Open {
                        kind: k @ Kind::Call { .. },
                        ..
                    }),
                ) => {
                    let k = k.clone();
                    self.piece(k, false, &arguments, out);
                    // A call's arguments come whole in this one delta (the answer parser gives
                    // out only whole calls), so its item is done now, not when the next item
                    // opens: a client can run it while the model writes the next.
                    self.close(out);
                }
                (None, _) => {}
            }
        }
    }
}

/// Streaming: the driver's messages as the Responses API's events — `response.created`, then
/// per output item `response.output_item.added`, its deltas and its `…done` events, then
/// `response.completed` (or `response.incomplete` when cut by `max_output_tokens`) with the
/// whole response and its usage; a failure is an `error` event.
pub(crate) fn events(
    meta: ResponseMeta,
    echo: Echo,
    answer: AnswerStream,
    rx: mpsc::Receiver<Msg>,
) -> impl Stream<Item = Result<Event, Infallible>> {
    let meta = Arc::new(meta);
    let mut ev = Events {
        meta: meta.clone(),
        echo,
        done: Vec::new(),
        open: None,
        seq: 0,
        pending: Vec::new(),
    };
    let created = {
        let r = response(&meta, &ev.echo, Vec::new(), None, None);
        let first = ev.event("response.created", json!({"response": r.clone()}));
        let second = ev.event("response.in_progress", json!({"response": r}));
        vec![first, second]
    };
    let body = stream::unfold(Some((rx, answer, ev)), move |state| async move {
        let (mut rx, mut answer, mut ev) = state?;
        let mut out = Vec::new();
        match rx.recv().await {
            None => return None,
            Some(Msg::Text(_, t, item)) => {
                ev.pending.extend(item.map(|i| i.chat_entry()));
                for d in answer.feed(&t) {
                    ev.delta(d, &mut out);
                }
            }
            // Completions only.
            Some(Msg::Finish(..)) | Some(Msg::Echo(..)) => {}
            Some(Msg::End {
                last: (_, finish),
                usage: u,
                ..
            }) => {
                for d in answer.finish() {
                    ev.delta(d, &mut out);
                }
                ev.close(&mut out);
                let kind = if finish == "length" {
                    "response.incomplete"
                } else {
                    "response.completed"
                };
                let r = response(
                    &ev.meta,
                    &ev.echo,
                    std::mem::take(&mut ev.done),
                    Some(&finish),
                    Some(&u),
                );
                out.push(ev.event(kind, json!({"response": r})));
                return Some((out, None));
            }
            Some(Msg::Fail(e, _)) => {
                let err = e.body().error;
                out.push(ev.event(
                    "error",
                    json!({"code": err.code, "message": err.message, "param": err.param}),
                ));
                return Some((out, None));
            }
        }
        Some((out, Some((rx, answer, ev))))
    });
    // The first events go out with the first generated piece (as a chat stream's role chunk
    // does), so the first body byte a proxy sees marks the first token.
    let mut first = Some(created);
    body.map(move |mut events| {
        if let Some(mut head) = first.take() {
            head.append(&mut events);
            events = head;
        }
        events
    })
    .flat_map(stream::iter)
    .map(Ok)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::{FunctionDelta, ToolCallDelta};

    fn call_delta(index: usize, id: Option<&str>, name: Option<&str>, args: &str) -> ChatDelta {
        ChatDelta {
            tool_calls: Some(vec![ToolCallDelta {
                index,
                id: id.map(str::to_string),
                kind: id.map(|_| "function".to_string()),
                function: FunctionDelta {
                    name: name.map(str::to_string),
                    arguments: Some(args.to_string()),
                },
            }]),
            ..ChatDelta::default()
        }
    }

    /// A whole response keeps the items in the order they were written, as streamed: text
    /// before the calls, or after them when a forced list was cut in its next call.
    #[test]
    fn a_whole_response_keeps_the_written_order() {
        use crate::protocol::{AssistantMessage, FunctionCallBody, ToolCallBody};
        let meta = ResponseMeta {
            id: "resp_1".into(),
            created: 0,
            model: "m".into(),
            fingerprint: "fp".into(),
        };
        let echo = Echo::of(b"{}", None);
        let usage = UsageBody::new(10, 0, 5);
        for (after, order) in [
            (false, ["message", "function_call"]),
            (true, ["function_call", "message"]),
        ] {
            let choice = ChatChoice {
                index: 0,
                message: AssistantMessage {
                    role: "assistant".into(),
                    content: Some(r#"{"name":"g","argu"#.into()),
                    reasoning_content: None,
                    tool_calls: vec![ToolCallBody {
                        id: "call_a".into(),
                        kind: "function".into(),
                        function: FunctionCallBody {
                            name: "f".into(),
                            arguments: "{}".into(),
                        },
                    }],
                },
                logprobs: None,
                finish_reason: "length".into(),
                content_after_calls: after,
            };
            let r = body(&meta, &echo, &choice, &usage);
            let types: Vec<&str> = r["output"]
                .as_array()
                .unwrap()
                .iter()
                .map(|o| o["type"].as_str().unwrap())
                .collect();
            assert_eq!(types, order, "{r}");
        }
    }

    /// A call's item is done with its arguments delta (calls are given out whole), not when
    /// the next item opens or the answer ends: a client can run it at once.
    #[test]
    fn a_call_item_is_done_with_its_arguments() {
        let meta = Arc::new(ResponseMeta {
            id: "resp_1".into(),
            created: 0,
            model: "m".into(),
            fingerprint: "fp".into(),
        });
        let mut ev = Events {
            meta,
            echo: Echo::of(b"{}", None),
            done: Vec::new(),
            open: None,
            seq: 0,
            pending: Vec::new(),
        };
        for (i, (id, city)) in [("call_a", "Paris"), ("call_b", "Rome")].iter().enumerate() {
            let mut out = Vec::new();
            ev.delta(call_delta(i, Some(id), Some("get_weather"), ""), &mut out);
            assert_eq!(out.len(), 1, "output_item.added");
            assert!(ev.open.is_some());
            let mut out = Vec::new();
            let args = format!(r#"{{"city":"{city}"}}"#);
            ev.delta(call_delta(i, None, None, &args), &mut out);
            // arguments.delta, arguments.done, output_item.done
            assert_eq!(out.len(), 3);
            assert!(ev.open.is_none());
            assert_eq!(ev.done.len(), i + 1);
            assert_eq!(ev.done[i]["call_id"], *id);
            assert_eq!(ev.done[i]["arguments"], args);
            assert_eq!(ev.done[i]["status"], "completed");
        }
    }
}
