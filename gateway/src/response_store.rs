//! Stored responses: the Responses API's `store` and `previous_response_id`, kept by the gateway
//! (docs/gateway.md, "Stored responses").
//!
//! A `POST /v1/responses` with `store` (default `true`) is captured as it streams back
//! ([`Capture`]: the whole answer, or only the `response.completed` / `response.incomplete`
//! event of a stream) and kept in a bounded store ([`ResponseStore`]: bytes, idle TTL, least
//! recently used first out), keyed by the response's `id`, owned by the tenant that made it. A
//! later request naming it as `previous_response_id` is sent to the workers as the whole
//! conversation ([`continue_conversation`]): every earlier turn's input items and output items,
//! then its own input — so the prompt the gateway routes on (and the worker renders) is the
//! conversation's, its prefix the one the previous turn left in a worker's cache. `instructions`
//! and `tools` are not carried over (as in OpenAI's API: each request sends its own).
//!
//! Each turn stores only its own input items and its response; a conversation is rebuilt by
//! walking `previous` links, touching every turn (so a conversation in use is not evicted). When
//! a turn of the chain was evicted, expired or deleted, the continuation is refused with
//! `previous_response_not_found`, naming it.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use parking_lot::Mutex;
use prompt_profile::BodyError;
use serde_json::{json, Map, Value};

use crate::error::GatewayError;

/// What the store keeps.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StoreLimits {
    /// Bytes of stored JSON (each turn's input items and response object), at most; 0 turns
    /// storing off (`previous_response_id` then reaches the worker, which refuses it).
    pub max_bytes: usize,
    /// A response neither read nor continued this long is dropped.
    pub idle_ttl: Duration,
}

impl StoreLimits {
    /// 64 MiB, one hour idle.
    pub const DEFAULT: StoreLimits = StoreLimits {
        max_bytes: 64 << 20,
        idle_ttl: Duration::from_secs(3600),
    };

    /// The most one turn may take (input items + response): a quarter of the store, at most
    /// 16 MiB. Larger answers are served and not stored.
    pub fn max_entry(&self) -> usize {
        (self.max_bytes / 4).min(16 << 20)
    }
}

impl Default for StoreLimits {
    fn default() -> Self {
        StoreLimits::DEFAULT
    }
}

/// One stored turn.
#[derive(Debug)]
pub struct StoredResponse {
    /// The response's `id` (`resp_…`).
    pub id: String,
    /// The tenant that made it (`None` on services without API keys): only it may read,
    /// continue or delete it.
    pub tenant: Option<String>,
    /// The `previous_response_id` it continued.
    pub previous: Option<String>,
    /// Its request's own input items (a string `input` as one user message item).
    pub input: Vec<Value>,
    /// The response object as the worker answered it.
    pub response: Value,
    bytes: usize,
}

impl StoredResponse {
    /// A turn; its size is that of its JSON.
    pub fn new(
        id: String,
        tenant: Option<String>,
        previous: Option<String>,
        input: Vec<Value>,
        response: Value,
    ) -> StoredResponse {
        let json_len = |v: &Value| serde_json::to_vec(v).map_or(0, |b| b.len());
        let bytes = id.len()
            + previous.as_ref().map_or(0, String::len)
            + input.iter().map(json_len).sum::<usize>()
            + json_len(&response);
        StoredResponse {
            id,
            tenant,
            previous,
            input,
            response,
            bytes,
        }
    }

    /// Bytes it counts for in the store.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// The response as `GET /v1/responses/{id}` gives it: stored, with the id it continued.
    pub fn retrieved(&self) -> Value {
        let mut r = self.response.clone();
        if let Value::Object(o) = &mut r {
            o.insert("store".into(), Value::Bool(true));
            o.insert(
                "previous_response_id".into(),
                self.previous.clone().map_or(Value::Null, Value::String),
            );
        }
        r
    }

    /// Its output items.
    fn output(&self) -> &[Value] {
        self.response["output"]
            .as_array()
            .map_or(&[], Vec::as_slice)
    }

    /// Its input items with ids (`GET /v1/responses/{id}/input_items`): an item without one
    /// is given `item_<response id>_<n>`.
    pub fn input_items(&self) -> Vec<Value> {
        let base = self.id.trim_start_matches("resp_");
        self.input
            .iter()
            .enumerate()
            .map(|(n, item)| {
                let mut item = item.clone();
                if let Value::Object(o) = &mut item {
                    if !o.get("id").is_some_and(Value::is_string) {
                        o.insert("id".into(), json!(format!("item_{base}_{n}")));
                    }
                }
                item
            })
            .collect()
    }
}

/// Why a conversation cannot be rebuilt: the turn that is not (or no longer) stored.
#[derive(Debug, PartialEq, Eq)]
pub struct MissingTurn(pub String);

struct Entry {
    record: Arc<StoredResponse>,
    seq: u64,
    used: Instant,
}

#[derive(Default)]
struct Inner {
    entries: HashMap<String, Entry>,
    /// Least recently used first.
    order: BTreeMap<u64, String>,
    next: u64,
    bytes: usize,
}

impl Inner {
    fn remove(&mut self, id: &str) -> Option<Arc<StoredResponse>> {
        let e = self.entries.remove(id)?;
        self.order.remove(&e.seq);
        self.bytes -= e.record.bytes;
        Some(e.record)
    }

    /// The entry, moved to the back of the order; `None` when absent or expired (an expired
    /// one is dropped).
    fn touch(&mut self, id: &str, now: Instant, ttl: Duration) -> Option<Arc<StoredResponse>> {
        let e = self.entries.get(id)?;
        if now.saturating_duration_since(e.used) >= ttl {
            self.remove(id);
            return None;
        }
        let seq = self.next;
        self.next += 1;
        let e = self.entries.get_mut(id)?;
        self.order.remove(&e.seq);
        e.seq = seq;
        e.used = now;
        self.order.insert(seq, id.to_owned());
        Some(e.record.clone())
    }

    /// Drops the least recently used while they are expired or the store is over `max`.
    fn evict(&mut self, now: Instant, ttl: Duration, max: usize) {
        while let Some((_, id)) = self.order.first_key_value() {
            let id = id.clone();
            let expired = self
                .entries
                .get(&id)
                .is_none_or(|e| now.saturating_duration_since(e.used) >= ttl);
            if !expired && self.bytes <= max {
                break;
            }
            if self.remove(&id).is_none() {
                self.order.pop_first();
            }
        }
    }
}

/// The gateway's stored responses (one per gateway process; see the module docs).
pub struct ResponseStore {
    limits: StoreLimits,
    inner: Mutex<Inner>,
}

impl ResponseStore {
    /// An empty store.
    pub fn new(limits: StoreLimits) -> ResponseStore {
        ResponseStore {
            limits,
            inner: Mutex::new(Inner::default()),
        }
    }

    /// Its limits.
    pub fn limits(&self) -> StoreLimits {
        self.limits
    }

    /// Whether it stores anything.
    pub fn enabled(&self) -> bool {
        self.limits.max_bytes > 0
    }

    /// Keeps a turn. `false` (nothing kept) when storing is off, the turn is larger than
    /// [`StoreLimits::max_entry`], or its id is taken.
    pub fn insert(&self, r: StoredResponse) -> bool {
        self.insert_at(r, Instant::now())
    }

    fn insert_at(&self, r: StoredResponse, now: Instant) -> bool {
        if !self.enabled() || r.bytes > self.limits.max_entry() {
            return false;
        }
        let mut g = self.inner.lock();
        if g.entries.contains_key(&r.id) {
            return false;
        }
        g.evict(
            now,
            self.limits.idle_ttl,
            self.limits.max_bytes.saturating_sub(r.bytes),
        );
        let seq = g.next;
        g.next += 1;
        g.bytes += r.bytes;
        g.order.insert(seq, r.id.clone());
        g.entries.insert(
            r.id.clone(),
            Entry {
                record: Arc::new(r),
                seq,
                used: now,
            },
        );
        true
    }

    /// The turn `id` when `tenant` owns it (touched: it counts as used).
    pub fn get(&self, id: &str, tenant: Option<&str>) -> Option<Arc<StoredResponse>> {
        self.get_at(id, tenant, Instant::now())
    }

    fn get_at(&self, id: &str, tenant: Option<&str>, now: Instant) -> Option<Arc<StoredResponse>> {
        let mut g = self.inner.lock();
        let owner = g.entries.get(id)?.record.tenant.clone();
        if owner.as_deref() != tenant {
            return None;
        }
        g.touch(id, now, self.limits.idle_ttl)
    }

    /// Deletes the turn `id` when `tenant` owns it; whether it did. Later turns that continued
    /// it can no longer be continued.
    pub fn delete(&self, id: &str, tenant: Option<&str>) -> bool {
        let mut g = self.inner.lock();
        match g.entries.get(id) {
            Some(e) if e.record.tenant.as_deref() == tenant => g.remove(id).is_some(),
            _ => false,
        }
    }

    /// The conversation up to and including the turn `id`, as input items: every turn's input
    /// items then output items, oldest first. Every turn is touched.
    pub fn conversation(&self, id: &str, tenant: Option<&str>) -> Result<Vec<Value>, MissingTurn> {
        self.conversation_at(id, tenant, Instant::now())
    }

    fn conversation_at(
        &self,
        id: &str,
        tenant: Option<&str>,
        now: Instant,
    ) -> Result<Vec<Value>, MissingTurn> {
        let mut turns = Vec::new();
        let mut next = Some(id.to_owned());
        while let Some(at) = next {
            // Each turn's `previous` was stored before it: a chain is never longer than the
            // store, so this ends even on a corrupted link.
            if turns.len() > self.inner.lock().entries.len() {
                return Err(MissingTurn(at));
            }
            let t = self.get_at(&at, tenant, now).ok_or(MissingTurn(at))?;
            next = t.previous.clone();
            turns.push(t);
        }
        Ok(turns
            .iter()
            .rev()
            .flat_map(|t| t.input.iter().chain(t.output()).cloned())
            .collect())
    }

    /// Turns stored and their bytes.
    pub fn stats(&self) -> (usize, usize) {
        let g = self.inner.lock();
        (g.entries.len(), g.bytes)
    }
}

/// `input` as items: a string is one user message item; absent, none.
fn input_items(input: Option<&Value>) -> Result<Vec<Value>, GatewayError> {
    match input {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::String(s)) => Ok(vec![json!({
            "type": "message", "role": "user",
            "content": [{"type": "input_text", "text": s}],
        })]),
        Some(Value::Array(items)) => Ok(items.clone()),
        Some(_) => Err(invalid(
            "input",
            "invalid_type",
            "`input` must be a string or an array of items",
        )),
    }
}

fn invalid(param: &str, code: &'static str, message: &str) -> GatewayError {
    GatewayError::Body(BodyError {
        code,
        param: Some(param.to_owned()),
        message: message.to_owned(),
    })
}

/// What storing does to one `POST /v1/responses` request.
#[derive(Debug, Default)]
pub struct Prepared {
    /// The body to send instead of the client's (a continued conversation).
    pub body: Option<Bytes>,
    /// How to capture the answer, when it is to be stored.
    pub capture: Option<Capture>,
}

/// Reads a Responses API body for storing: with `previous_response_id`, the body the workers get
/// is the whole conversation (`previous_response_id` removed, `input` = the stored turns' items
/// then the request's own); with `store` (default `true`), a [`Capture`] for its answer.
/// `max_body` bounds the continued body (`conversation_too_large`). With storing off nothing is
/// done: the worker refuses `previous_response_id` itself.
pub fn continue_conversation(
    store: &ResponseStore,
    body: &[u8],
    tenant: Option<&str>,
    max_body: u64,
) -> Result<Prepared, GatewayError> {
    if !store.enabled() {
        return Ok(Prepared::default());
    }
    let v: Value =
        serde_json::from_slice(body).map_err(|e| GatewayError::Body(BodyError::not_json(&e)))?;
    let Value::Object(mut o) = v else {
        return Err(GatewayError::Body(BodyError::not_an_object()));
    };
    let keep = match o.get("store") {
        None | Some(Value::Null) => true,
        Some(Value::Bool(b)) => *b,
        Some(_) => {
            return Err(invalid(
                "store",
                "invalid_type",
                "`store` must be a boolean",
            ))
        }
    };
    let stream = matches!(o.get("stream"), Some(Value::Bool(true)));
    let previous = match o.get("previous_response_id") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) if !s.is_empty() => Some(s.clone()),
        Some(_) => {
            return Err(invalid(
                "previous_response_id",
                "invalid_type",
                "`previous_response_id` must be a response id",
            ))
        }
    };
    let own = input_items(o.get("input"))?;
    let mut out = Prepared::default();
    if let Some(prev) = &previous {
        let mut items = store
            .conversation(prev, tenant)
            .map_err(
                |MissingTurn(missing)| GatewayError::PreviousResponseNotFound {
                    id: prev.clone(),
                    missing,
                },
            )?;
        items.extend(own.iter().cloned());
        o.remove("previous_response_id");
        o.insert("input".into(), Value::Array(items));
        let rewritten =
            serde_json::to_vec(&Value::Object(o)).map_err(|e| GatewayError::Internal {
                reason: format!("writing the continued conversation: {e}"),
            })?;
        if rewritten.len() as u64 > max_body {
            return Err(GatewayError::ConversationTooLarge {
                bytes: rewritten.len(),
                limit: max_body,
            });
        }
        out.body = Some(Bytes::from(rewritten));
    }
    if keep {
        out.capture = Some(Capture {
            streamed: stream,
            buf: Vec::new(),
            cap: store.limits().max_entry(),
            over: false,
            done: None,
            tenant: tenant.map(str::to_owned),
            previous,
            input: own,
        });
    }
    Ok(out)
}

/// An answer to store, read as it streams to the client. Keeps at most one turn's size: a
/// whole JSON answer, or of a stream only the event being read (deltas are dropped as they
/// end; the `response.completed` / `response.incomplete` event carries the whole response).
#[derive(Debug)]
pub struct Capture {
    streamed: bool,
    buf: Vec<u8>,
    cap: usize,
    over: bool,
    done: Option<Value>,
    tenant: Option<String>,
    previous: Option<String>,
    input: Vec<Value>,
}

impl Capture {
    /// Reads the next chunk of the answer's body.
    pub fn feed(&mut self, chunk: &[u8]) {
        if self.over {
            return;
        }
        if !self.streamed {
            if self.buf.len() + chunk.len() > self.cap {
                self.over = true;
                self.buf = Vec::new();
            } else {
                self.buf.extend_from_slice(chunk);
            }
            return;
        }
        self.buf
            .extend(chunk.iter().copied().filter(|&b| b != b'\r'));
        while let Some(end) = self.buf.windows(2).position(|w| w == b"\n\n") {
            let event: Vec<u8> = self.buf.drain(..end + 2).collect();
            if end > self.cap {
                self.over = true;
                self.buf = Vec::new();
                return;
            }
            self.event(&event[..end]);
        }
        if self.buf.len() > self.cap {
            self.over = true;
            self.buf = Vec::new();
        }
    }

    /// One SSE event (its lines): the response of the last one.
    fn event(&mut self, event: &[u8]) {
        let is_last = |needle: &[u8]| event.windows(needle.len()).any(|w| w == needle);
        if !is_last(b"response.completed") && !is_last(b"response.incomplete") {
            return;
        }
        let mut data = Vec::new();
        for line in event.split(|&b| b == b'\n') {
            if let Some(d) = line.strip_prefix(b"data:") {
                if !data.is_empty() {
                    data.push(b'\n');
                }
                data.extend_from_slice(d.strip_prefix(b" ").unwrap_or(d));
            }
        }
        let Ok(mut v) = serde_json::from_slice::<Value>(&data) else {
            return;
        };
        if matches!(
            v["type"].as_str(),
            Some("response.completed" | "response.incomplete")
        ) {
            self.done = Some(v["response"].take());
        }
    }

    /// The turn to store, once the whole answer went through: `None` when it was larger than a
    /// turn may be, was cut short, or is not a completed (or incomplete) `response` with an id.
    pub fn finish(mut self) -> Option<StoredResponse> {
        if self.over {
            return None;
        }
        let response = if self.streamed {
            self.done.take()?
        } else {
            serde_json::from_slice::<Value>(&self.buf).ok()?
        };
        let o: &Map<String, Value> = response.as_object()?;
        if o.get("object").and_then(Value::as_str) != Some("response")
            || !matches!(
                o.get("status").and_then(Value::as_str),
                Some("completed" | "incomplete")
            )
        {
            return None;
        }
        let id = o.get("id").and_then(Value::as_str)?.to_owned();
        Some(StoredResponse::new(
            id,
            self.tenant,
            self.previous,
            self.input,
            response,
        ))
    }
}

/// `/v1/responses/{id}` → `(id, false)`, `/v1/responses/{id}/input_items` → `(id, true)`.
pub fn resource_path(path: &str) -> Option<(&str, bool)> {
    let rest = path.trim_end_matches('/').strip_prefix("/v1/responses/")?;
    let (id, items) = match rest.split_once('/') {
        None => (rest, false),
        Some((id, "input_items")) => (id, true),
        Some(_) => return None,
    };
    (!id.is_empty()).then_some((id, items))
}

/// `GET /v1/responses/{id}/input_items`: the turn's own input items, OpenAI's list with its
/// `order` (`desc`, the default, or `asc`), `limit` (1–100, default 20) and `after` (an item
/// id) from the query.
pub fn input_items_page(r: &StoredResponse, query: Option<&str>) -> Result<Value, GatewayError> {
    let mut items = r.input_items();
    let (mut limit, mut after, mut desc) = (20usize, None::<String>, true);
    for (k, v) in query
        .unwrap_or("")
        .split('&')
        .filter_map(|kv| kv.split_once('='))
    {
        match k {
            "order" if v == "asc" => desc = false,
            "order" if v == "desc" => desc = true,
            "order" => {
                return Err(invalid(
                    "order",
                    "invalid_value",
                    "`order` must be `asc` or `desc`",
                ))
            }
            "limit" => {
                limit = v
                    .parse()
                    .ok()
                    .filter(|n| (1..=100).contains(n))
                    .ok_or_else(|| invalid("limit", "invalid_value", "`limit` must be 1..=100"))?;
            }
            "after" => after = Some(v.to_owned()),
            _ => {}
        }
    }
    if desc {
        items.reverse();
    }
    let start = match &after {
        None => 0,
        Some(a) => items
            .iter()
            .position(|i| i["id"].as_str() == Some(a))
            .map(|p| p + 1)
            .ok_or_else(|| {
                invalid(
                    "after",
                    "invalid_value",
                    "`after` names no item of this response",
                )
            })?,
    };
    let page: Vec<Value> = items.iter().skip(start).take(limit).cloned().collect();
    Ok(json!({
        "object": "list",
        "data": page,
        "first_id": page.first().map(|i| i["id"].clone()),
        "last_id": page.last().map(|i| i["id"].clone()),
        "has_more": start + page.len() < items.len(),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn turn(id: &str, previous: Option<&str>, said: &str, answered: &str) -> StoredResponse {
        StoredResponse::new(
            id.into(),
            None,
            previous.map(str::to_owned),
            vec![json!({"role": "user", "content": said})],
            json!({"id": id, "object": "response", "status": "completed", "output": [
                {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": answered}]}
            ]}),
        )
    }

    fn texts(items: &[Value]) -> Vec<String> {
        items
            .iter()
            .map(|i| match &i["content"] {
                Value::String(s) => s.clone(),
                c => c[0]["text"].as_str().unwrap_or("?").to_owned(),
            })
            .collect()
    }

    #[test]
    fn a_conversation_is_every_turn_in_order() {
        let s = ResponseStore::new(StoreLimits::DEFAULT);
        assert!(s.insert(turn("resp_1", None, "a", "b")));
        assert!(s.insert(turn("resp_2", Some("resp_1"), "c", "d")));
        assert!(s.insert(turn("resp_3", Some("resp_2"), "e", "f")));
        assert!(
            !s.insert(turn("resp_3", None, "x", "y")),
            "an id is never replaced"
        );
        let c = s.conversation("resp_3", None).unwrap();
        assert_eq!(texts(&c), ["a", "b", "c", "d", "e", "f"]);
        assert_eq!(texts(&s.conversation("resp_1", None).unwrap()), ["a", "b"]);
        // A deleted turn breaks the chains through it, naming it.
        assert!(s.delete("resp_2", None));
        assert!(!s.delete("resp_2", None));
        assert_eq!(
            s.conversation("resp_3", None),
            Err(MissingTurn("resp_2".into()))
        );
        assert_eq!(
            s.conversation("resp_9", None),
            Err(MissingTurn("resp_9".into()))
        );
    }

    #[test]
    fn only_the_owner_sees_its_turns() {
        let s = ResponseStore::new(StoreLimits::DEFAULT);
        let mut t = turn("resp_1", None, "a", "b");
        t.tenant = Some("acme".into());
        assert!(s.insert(t));
        assert!(s.get("resp_1", None).is_none());
        assert!(s.get("resp_1", Some("other")).is_none());
        assert!(!s.delete("resp_1", Some("other")));
        assert!(s.conversation("resp_1", Some("other")).is_err());
        assert!(s.get("resp_1", Some("acme")).is_some());
        assert!(s.delete("resp_1", Some("acme")));
    }

    #[test]
    fn the_least_recently_used_goes_first_and_bytes_stay_bounded() {
        let one = turn("resp_0", None, "a", "b").bytes();
        // Room for four turns of this size (a turn may take a quarter of the store).
        let limits = StoreLimits {
            max_bytes: one * 4 + one / 2,
            idle_ttl: Duration::from_secs(60),
        };
        assert!(one <= limits.max_entry());
        let s = ResponseStore::new(limits);
        let t0 = Instant::now();
        for i in 0..4 {
            assert!(s.insert_at(turn(&format!("resp_{i}"), None, "a", "b"), t0));
        }
        // resp_0 is used: resp_1 is now the least recently used.
        assert!(s.get_at("resp_0", None, t0).is_some());
        assert!(s.insert_at(turn("resp_4", None, "a", "b"), t0));
        assert!(s.get_at("resp_1", None, t0).is_none(), "evicted");
        for id in ["resp_0", "resp_2", "resp_3", "resp_4"] {
            assert!(s.get_at(id, None, t0).is_some(), "{id}");
        }
        let (n, bytes) = s.stats();
        assert_eq!(n, 4);
        assert!(bytes <= limits.max_bytes, "{bytes}");
        // A turn larger than a quarter of the store is not kept.
        let big = turn("resp_big", None, &"x".repeat(one * 2), "b");
        assert!(!s.insert_at(big, t0));
        // Off: nothing is kept.
        let off = ResponseStore::new(StoreLimits {
            max_bytes: 0,
            ..limits
        });
        assert!(!off.insert(turn("resp_1", None, "a", "b")));
    }

    #[test]
    fn an_idle_turn_expires_and_use_keeps_it() {
        let limits = StoreLimits {
            max_bytes: 1 << 20,
            idle_ttl: Duration::from_secs(10),
        };
        let s = ResponseStore::new(limits);
        let t0 = Instant::now();
        assert!(s.insert_at(turn("resp_1", None, "a", "b"), t0));
        assert!(s.insert_at(turn("resp_2", Some("resp_1"), "c", "d"), t0));
        // Continuing resp_2 at 8 s touches both turns; at 16 s they are 8 s idle.
        assert!(s
            .conversation_at("resp_2", None, t0 + Duration::from_secs(8))
            .is_ok());
        assert!(s
            .conversation_at("resp_2", None, t0 + Duration::from_secs(16))
            .is_ok());
        // 10 s after the last use: gone, and an insert sweeps them.
        assert!(s
            .get_at("resp_1", None, t0 + Duration::from_secs(26))
            .is_none());
        assert!(s.insert_at(turn("resp_3", None, "e", "f"), t0 + Duration::from_secs(27)));
        assert_eq!(s.stats().0, 1);
    }

    fn completed(id: &str) -> String {
        json!({"type": "response.completed", "sequence_number": 9, "response": {
            "id": id, "object": "response", "status": "completed",
            "output": [{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "hi\n\nthere"}]}]}})
        .to_string()
    }

    #[test]
    fn a_stream_is_captured_from_its_last_event_in_any_chunking() {
        let stream = format!(
            "event: response.created\ndata: {{\"type\":\"response.created\"}}\n\n\
             event: response.output_text.delta\r\ndata: {{\"type\":\"response.output_text.delta\",\"delta\":\"hi\"}}\r\n\r\n\
             event: response.completed\ndata: {}\n\n",
            completed("resp_s")
        );
        let body = prepared_capture(true);
        for size in [1, 2, 7, 64, stream.len()] {
            let mut c = Capture {
                ..body.clone_empty()
            };
            for chunk in stream.as_bytes().chunks(size) {
                c.feed(chunk);
                assert!(c.buf.len() <= stream.len());
            }
            let t = c.finish().expect("stored");
            assert_eq!(t.id, "resp_s");
            assert_eq!(t.output()[0]["content"][0]["text"], "hi\n\nthere");
        }
        // Cut before its last event: nothing to store.
        let mut c = body.clone_empty();
        c.feed(&stream.as_bytes()[..stream.len() - 10]);
        assert!(c.finish().is_none());
        // An event larger than a turn may be: not stored.
        let mut c = body.clone_empty();
        c.cap = 100;
        c.feed(stream.as_bytes());
        assert!(c.finish().is_none());
    }

    #[test]
    fn a_whole_answer_is_captured_when_it_is_a_finished_response() {
        let mut c = prepared_capture(false);
        let ok =
            json!({"id": "resp_w", "object": "response", "status": "incomplete", "output": []});
        c.feed(ok.to_string().as_bytes());
        assert_eq!(c.finish().unwrap().id, "resp_w");
        for bad in [
            json!({"id": "resp_w", "object": "response", "status": "failed", "output": []}),
            json!({"object": "response", "status": "completed"}),
            json!({"error": {"code": "x"}}),
        ] {
            let mut c = prepared_capture(false);
            c.feed(bad.to_string().as_bytes());
            assert!(c.finish().is_none(), "{bad}");
        }
    }

    fn prepared_capture(stream: bool) -> Capture {
        let s = ResponseStore::new(StoreLimits::DEFAULT);
        let body = json!({"model": "m", "input": "hello", "stream": stream});
        continue_conversation(&s, body.to_string().as_bytes(), None, 1 << 20)
            .unwrap()
            .capture
            .unwrap()
    }

    impl Capture {
        fn clone_empty(&self) -> Capture {
            Capture {
                streamed: self.streamed,
                buf: Vec::new(),
                cap: self.cap,
                over: false,
                done: None,
                tenant: self.tenant.clone(),
                previous: self.previous.clone(),
                input: self.input.clone(),
            }
        }
    }

    #[test]
    fn a_continued_request_carries_the_conversation() {
        let s = ResponseStore::new(StoreLimits::DEFAULT);
        assert!(s.insert(turn("resp_1", None, "a", "b")));
        let body = json!({"model": "m", "previous_response_id": "resp_1", "input": "c",
                          "instructions": "be brief", "store": false});
        let p = continue_conversation(&s, body.to_string().as_bytes(), None, 1 << 20).unwrap();
        assert!(p.capture.is_none(), "store: false");
        let sent: Value = serde_json::from_slice(&p.body.unwrap()).unwrap();
        assert!(sent.get("previous_response_id").is_none());
        assert_eq!(sent["instructions"], "be brief");
        assert_eq!(texts(sent["input"].as_array().unwrap()), ["a", "b", "c"]);
        // Over the service's body limit.
        let e = continue_conversation(&s, body.to_string().as_bytes(), None, 50).unwrap_err();
        assert_eq!(e.error_type(), "conversation_too_large");
        // Unknown, of another tenant, malformed.
        let e =
            continue_conversation(&s, body.to_string().as_bytes(), Some("t"), 1 << 20).unwrap_err();
        assert_eq!(e.error_type(), "previous_response_not_found");
        assert_eq!(e.status(), 400);
        for (bad, param) in [
            (
                json!({"model": "m", "input": "c", "previous_response_id": 3}),
                "previous_response_id",
            ),
            (json!({"model": "m", "input": "c", "store": "yes"}), "store"),
            (json!({"model": "m", "input": 3}), "input"),
        ] {
            let e =
                continue_conversation(&s, bad.to_string().as_bytes(), None, 1 << 20).unwrap_err();
            let GatewayError::Body(b) = e else {
                panic!("{e}")
            };
            assert_eq!(b.param.as_deref(), Some(param));
        }
        // Storing off: nothing read or changed.
        let off = ResponseStore::new(StoreLimits {
            max_bytes: 0,
            ..StoreLimits::DEFAULT
        });
        let p = continue_conversation(&off, body.to_string().as_bytes(), None, 1 << 20).unwrap();
        assert!(p.body.is_none() && p.capture.is_none());
    }

    #[test]
    fn input_items_list_in_openai_order_and_pages() {
        let r = StoredResponse::new(
            "resp_p".into(),
            None,
            None,
            (0..5)
                .map(|i| json!({"role": "user", "content": format!("m{i}")}))
                .collect(),
            json!({}),
        );
        let ids = |v: &Value| -> Vec<String> {
            v["data"]
                .as_array()
                .unwrap()
                .iter()
                .map(|i| i["id"].as_str().unwrap().to_owned())
                .collect()
        };
        let desc = input_items_page(&r, None).unwrap();
        assert_eq!(ids(&desc)[0], "item_p_4");
        let asc = input_items_page(&r, Some("order=asc&limit=2")).unwrap();
        assert_eq!(ids(&asc), ["item_p_0", "item_p_1"]);
        assert_eq!(asc["has_more"], true);
        let next = input_items_page(&r, Some("order=asc&limit=2&after=item_p_1")).unwrap();
        assert_eq!(ids(&next), ["item_p_2", "item_p_3"]);
        assert!(input_items_page(&r, Some("limit=0")).is_err());
        assert!(input_items_page(&r, Some("after=nope")).is_err());
        assert_eq!(
            resource_path("/v1/responses/resp_1"),
            Some(("resp_1", false))
        );
        assert_eq!(
            resource_path("/v1/responses/resp_1/input_items"),
            Some(("resp_1", true))
        );
        assert_eq!(resource_path("/v1/responses/resp_1/cancel"), None);
        assert_eq!(resource_path("/v1/responses"), None);
    }
}
