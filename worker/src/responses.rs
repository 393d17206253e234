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

/// The request fields a `response` object repeats, with their defaults.
#[derive(Clone, Debug)]
pub(crate) struct Echo(Map<String, Value>);

impl Echo {
    /// From the request body (already validated through its chat translation).
    pub(crate) fn of(body: &[u8]) -> Echo {
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
        m.insert("store".into(), json!(false));
        Echo(m)
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

fn message_item(id: &str, text: &str, done: bool) -> Value {
    let status = if done { "completed" } else { "in_progress" };
    let content = if done {
        json!([{"type": "output_text", "text": text, "annotations": [], "logprobs": []}])
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
    if let Some(c) = m
        .content
        .as_deref()
        .filter(|c| !c.is_empty() || m.tool_calls.is_empty())
    {
        output.push(message_item(&item_id(meta, "msg", output.len()), c, true));
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
    let finish = match choice.finish_reason.as_str() {
        "tool_calls" => "stop",
        f => f,
    };
    response(meta, echo, output, Some(finish), Some(u))
}

/// An open output item of a streamed response.
enum Open {
    Message {
        id: String,
        text: String,
    },
    Reasoning {
        id: String,
        text: String,
    },
    Call {
        id: String,
        call_id: String,
        name: String,
        arguments: String,
    },
}

/// The state of a streamed response: the items given out, the one open, the event count.
struct Events {
    meta: Arc<ResponseMeta>,
    echo: Echo,
    done: Vec<Value>,
    open: Option<Open>,
    seq: u64,
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
        let i = self.index();
        let item = match self.open.take() {
            None => return,
            Some(Open::Message { id, text }) => {
                let part =
                    json!({"type": "output_text", "text": text, "annotations": [], "logprobs": []});
                let e = self.event("response.output_text.done", json!({"item_id": id, "output_index": i, "content_index": 0, "text": text, "logprobs": []}));
                out.push(e);
                let e = self.event(
                    "response.content_part.done",
                    json!({"item_id": id, "output_index": i, "content_index": 0, "part": part}),
                );
                out.push(e);
                message_item(&id, &text, true)
            }
            Some(Open::Reasoning { id, text }) => reasoning_item(&id, &text),
            Some(Open::Call {
                id,
                call_id,
                name,
                arguments,
            }) => {
                let e = self.event(
                    "response.function_call_arguments.done",
                    json!({"item_id": id, "output_index": i, "arguments": arguments}),
                );
                out.push(e);
                call_item(&id, &call_id, &name, &arguments, true)
            }
        };
        let e = self.event(
            "response.output_item.done",
            json!({"output_index": i, "item": item}),
        );
        out.push(e);
        self.done.push(item);
    }

    /// One chat delta as events.
    fn delta(&mut self, d: ChatDelta, out: &mut Vec<Event>) {
        if let Some(r) = d.reasoning_content.filter(|r| !r.is_empty()) {
            if !matches!(self.open, Some(Open::Reasoning { .. })) {
                self.close(out);
                let id = item_id(&self.meta, "rs", self.index());
                let item = json!({"type": "reasoning", "id": id, "summary": [], "content": [], "status": "in_progress"});
                let e = self.event(
                    "response.output_item.added",
                    json!({"output_index": self.index(), "item": item}),
                );
                out.push(e);
                self.open = Some(Open::Reasoning {
                    id,
                    text: String::new(),
                });
            }
            let i = self.index();
            if let Some(Open::Reasoning { id, text }) = &mut self.open {
                text.push_str(&r);
                let id = id.clone();
                let e = self.event(
                    "response.reasoning_text.delta",
                    json!({"item_id": id, "output_index": i, "content_index": 0, "delta": r}),
                );
                out.push(e);
            }
        }
        if let Some(c) = d.content.filter(|c| !c.is_empty()) {
            if !matches!(self.open, Some(Open::Message { .. })) {
                self.close(out);
                let id = item_id(&self.meta, "msg", self.index());
                let e = self.event(
                    "response.output_item.added",
                    json!({"output_index": self.index(), "item": message_item(&id, "", false)}),
                );
                out.push(e);
                let e = self.event("response.content_part.added", json!({"item_id": id, "output_index": self.index(), "content_index": 0, "part": {"type": "output_text", "text": "", "annotations": [], "logprobs": []}}));
                out.push(e);
                self.open = Some(Open::Message {
                    id,
                    text: String::new(),
                });
            }
            let i = self.index();
            if let Some(Open::Message { id, text }) = &mut self.open {
                text.push_str(&c);
                let id = id.clone();
                let e = self.event("response.output_text.delta", json!({"item_id": id, "output_index": i, "content_index": 0, "delta": c, "logprobs": []}));
                out.push(e);
            }
        }
        for t in d.tool_calls.into_iter().flatten() {
            // A call's first delta names it; the next carries its arguments.
            if let Some(call_id) = t.id {
                self.close(out);
                let id = item_id(&self.meta, "fc", self.index());
                let name = t.function.name.unwrap_or_default();
                let e = self.event("response.output_item.added", json!({"output_index": self.index(), "item": call_item(&id, &call_id, &name, "", false)}));
                out.push(e);
                self.open = Some(Open::Call {
                    id,
                    call_id,
                    name,
                    arguments: String::new(),
                });
            }
            let i = self.index();
            if let (Some(a), Some(Open::Call { id, arguments, .. })) = (
                t.function.arguments.filter(|a| !a.is_empty()),
                &mut self.open,
            ) {
                arguments.push_str(&a);
                let id = id.clone();
                let e = self.event(
                    "response.function_call_arguments.delta",
                    json!({"item_id": id, "output_index": i, "delta": a}),
                );
                out.push(e);
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
            Some(Msg::Text(_, t, _)) => {
                for d in answer.feed(&t) {
                    ev.delta(d, &mut out);
                }
            }
            Some(Msg::Finish(..)) => {}
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
