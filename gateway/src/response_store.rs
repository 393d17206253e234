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
//! Each turn stores only its own input items, its response and the ids of the turns before it
//! (`chain`); a conversation is rebuilt from those, touching every turn (so a conversation in
//! use is not evicted). When a turn of the chain was evicted, expired or deleted, the
//! continuation is refused with `previous_response_not_found`, naming it.
//!
//! In cluster mode the replicas share their turns ([`SharedTurns`], Redis in
//! [`crate::cluster::SharedResponses`]): every stored turn is also written there, a replica
//! reads a conversation's turns there first (one round trip; a turn another replica stored, a
//! deletion another replica made), and falls back to its own copies when the shared store does
//! not answer — so no request fails because Redis went away.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use bytes::Bytes;
use parking_lot::Mutex;
use prompt_profile::BodyError;
use serde::{Deserialize, Serialize};
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

/// The most turns one conversation keeps: a turn that would continue a longer one is served and
/// not stored (and a record naming more, read from the shared store, is not used).
pub const MAX_TURNS: usize = 4096;

/// The longest response id looked up; a longer one is not stored anywhere.
pub const MAX_ID_LEN: usize = prompt_profile::responses::MAX_RESPONSE_ID_LEN;

impl Default for StoreLimits {
    fn default() -> Self {
        StoreLimits::DEFAULT
    }
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// Whether a record of `id` continuing `chain` is within [`MAX_TURNS`] and [`MAX_ID_LEN`].
fn within_limits(id: &str, chain: &[String]) -> bool {
    chain.len() < MAX_TURNS && id.len() <= MAX_ID_LEN
}

/// One stored turn (also its JSON form in the shared store), or a conversation
/// ([`crate::conversation`]: `response` is the conversation object, `input` its items).
#[derive(Debug, Serialize, Deserialize)]
pub struct StoredResponse {
    /// A conversation's revision (1 when created, one more at each change); 0, and not written,
    /// for a turn. First in the JSON, so that the shared store's compare-and-set reads it
    /// without parsing the record (`{"revision":N,…`, docs/cluster.md).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub revision: u64,
    /// The response's `id` (`resp_…`), or the conversation's (`conv_…`).
    pub id: String,
    /// The tenant that made it (`None` on services without API keys): only it may read,
    /// continue or delete it.
    pub tenant: Option<String>,
    /// The ids of the turns before it, oldest first: the last is the `previous_response_id`
    /// it continued.
    pub chain: Vec<String>,
    /// Its request's own input items (a string `input` as one user message item).
    pub input: Vec<Value>,
    /// The response object as the worker answered it.
    pub response: Value,
    /// A background response's: the gateway replica running it (cluster mode: a record left
    /// running by a replica that is gone is read as failed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub runner: Option<String>,
    /// Its input items then output items as JSON, comma-separated: what a continuation
    /// copies into its body, written once.
    #[serde(skip)]
    items: String,
    #[serde(skip)]
    bytes: usize,
}

impl StoredResponse {
    /// A turn; its size is that of its JSON.
    pub fn new(
        id: String,
        tenant: Option<String>,
        chain: Vec<String>,
        input: Vec<Value>,
        response: Value,
    ) -> StoredResponse {
        StoredResponse {
            revision: 0,
            id,
            tenant,
            chain,
            input,
            response,
            runner: None,
            items: String::new(),
            bytes: 0,
        }
        .sized()
    }

    /// A conversation's record at `revision`: `object` (its `id`, `created_at`, `metadata`) and
    /// its items, owned by `tenant`.
    pub fn conversation(
        revision: u64,
        tenant: Option<String>,
        object: Value,
        items: Vec<Value>,
    ) -> StoredResponse {
        StoredResponse {
            revision,
            id: object["id"].as_str().unwrap_or_default().to_owned(),
            tenant,
            chain: Vec::new(),
            input: items,
            response: object,
            runner: None,
            items: String::new(),
            bytes: 0,
        }
        .sized()
    }

    /// Whether it is a conversation's record rather than a response's.
    pub fn is_conversation(&self) -> bool {
        self.response["object"] == "conversation"
    }

    /// Whether it may replace `old`, the record its id holds: a background response's later
    /// state, a conversation's later revision. Any other id is written once.
    fn supersedes(&self, old: &StoredResponse) -> bool {
        if self.is_conversation() {
            return old.is_conversation() && self.revision > old.revision;
        }
        old.background() && self.background() && self.stage() >= old.stage()
    }

    /// Its size counted anew (its JSON, then the items a continuation copies).
    fn sized(mut self) -> StoredResponse {
        self.bytes = self.to_json().len();
        self.write_items();
        self
    }

    /// The same turn, run by the gateway replica `runner`.
    pub fn run_by(mut self, runner: &str) -> StoredResponse {
        self.runner = Some(runner.to_owned());
        self.sized()
    }

    /// [`Self::new`] within the record limits ([`MAX_TURNS`], [`MAX_ID_LEN`]); `None` beyond them.
    pub fn checked(
        id: String,
        tenant: Option<String>,
        chain: Vec<String>,
        input: Vec<Value>,
        response: Value,
    ) -> Option<StoredResponse> {
        within_limits(&id, &chain).then(|| StoredResponse::new(id, tenant, chain, input, response))
    }

    /// Fills `items` and counts it in `bytes`.
    fn write_items(&mut self) {
        let mut items = String::new();
        for item in self.input.iter().chain(self.output_items()) {
            if !items.is_empty() {
                items.push(',');
            }
            items.push_str(&serde_json::to_string(item).unwrap_or_else(|_| "null".into()));
        }
        self.bytes += items.len();
        self.items = items;
    }

    /// Its JSON (the shared store's form).
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).unwrap_or_default()
    }

    /// From its JSON; `None` when it is not one.
    pub fn from_json(s: &str) -> Option<StoredResponse> {
        let mut r: StoredResponse = serde_json::from_str(s).ok()?;
        if !within_limits(&r.id, &r.chain) {
            return None;
        }
        r.bytes = s.len();
        r.write_items();
        Some(r)
    }

    /// Its response's `status`: `completed` or `incomplete` for an answer; `queued`,
    /// `in_progress`, `failed` or `cancelled` for a background response
    /// ([`crate::background`]).
    pub fn status(&self) -> &str {
        self.response["status"].as_str().unwrap_or("")
    }

    /// Whether a request may continue it (`previous_response_id`): an answer, whole or cut by
    /// `max_output_tokens`; not a background response still running, failed or cancelled.
    pub fn continuable(&self) -> bool {
        matches!(self.status(), "completed" | "incomplete")
    }

    /// Whether it is a background response that has not ended (`queued`, `in_progress`).
    pub fn running(&self) -> bool {
        matches!(self.status(), "queued" | "in_progress")
    }

    /// How far a background response has come: 0 `queued`, 1 `in_progress`, 2 ended.
    pub fn stage(&self) -> u8 {
        match self.status() {
            "queued" => 0,
            "in_progress" => 1,
            _ => 2,
        }
    }

    /// Whether it was made with `background: true`.
    pub fn background(&self) -> bool {
        self.response["background"] == Value::Bool(true)
    }

    /// The same turn with `response` in place of its response (a background response's next
    /// state).
    pub fn with_response(&self, response: Value) -> StoredResponse {
        StoredResponse {
            revision: self.revision,
            id: self.id.clone(),
            tenant: self.tenant.clone(),
            chain: self.chain.clone(),
            input: self.input.clone(),
            response,
            runner: self.runner.clone(),
            items: String::new(),
            bytes: 0,
        }
        .sized()
    }

    /// The `previous_response_id` it continued.
    pub fn previous(&self) -> Option<&str> {
        self.chain.last().map(String::as_str)
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
                self.previous()
                    .map_or(Value::Null, |p| Value::String(p.to_owned())),
            );
        }
        r
    }

    /// Its output items.
    pub fn output_items(&self) -> &[Value] {
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
    /// Insertions, removals and uses so far (what tells a saver that there is something new
    /// to save, [`ResponseStore::changes`]).
    changes: u64,
    /// Of the entries, conversations.
    conversations: usize,
}

impl Inner {
    fn remove(&mut self, id: &str) -> Option<Arc<StoredResponse>> {
        let e = self.entries.remove(id)?;
        self.order.remove(&e.seq);
        self.bytes -= e.record.bytes;
        self.conversations -= usize::from(e.record.is_conversation());
        self.changes += 1;
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
        let record = e.record.clone();
        self.order.insert(seq, id.to_owned());
        self.changes += 1;
        Some(record)
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
    /// One lock per conversation being changed here ([`ResponseStore::changing`]); an entry
    /// nobody holds is dropped as others are taken.
    changing: Mutex<HashMap<String, std::sync::Weak<tokio::sync::Mutex<()>>>>,
    /// Conversation changes made while the shared store did not answer, to be made there.
    pub pending: crate::conversation::Pending,
}

impl ResponseStore {
    /// An empty store.
    pub fn new(limits: StoreLimits) -> ResponseStore {
        ResponseStore {
            limits,
            inner: Mutex::new(Inner::default()),
            changing: Mutex::new(HashMap::new()),
            pending: crate::conversation::Pending::default(),
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

    /// Keeps a turn; the kept turn, or `None` when storing is off, the turn is larger than
    /// [`StoreLimits::max_entry`], or its id is taken.
    pub fn insert(&self, r: impl Into<Arc<StoredResponse>>) -> Option<Arc<StoredResponse>> {
        let r = r.into();
        self.insert_at(r.clone(), Instant::now()).then_some(r)
    }

    fn insert_at(&self, r: Arc<StoredResponse>, now: Instant) -> bool {
        if !self.enabled() || r.bytes > self.limits.max_entry() {
            return false;
        }
        let mut g = self.inner.lock();
        if let Some(e) = g.entries.get(&r.id) {
            if !r.supersedes(&e.record) {
                return false;
            }
            g.remove(&r.id);
        }
        g.evict(
            now,
            self.limits.idle_ttl,
            self.limits.max_bytes.saturating_sub(r.bytes),
        );
        let seq = g.next;
        g.next += 1;
        g.bytes += r.bytes;
        g.conversations += usize::from(r.is_conversation());
        g.changes += 1;
        g.order.insert(seq, r.id.clone());
        g.entries.insert(
            r.id.clone(),
            Entry {
                record: r,
                seq,
                used: now,
            },
        );
        true
    }

    /// Waits for, then holds, the right to change conversation `id` on this replica: its
    /// changes in the shared store are then made one at a time here, so that only replicas
    /// contend for a revision ([`crate::conversation::share`]).
    pub async fn changing(&self, id: &str) -> tokio::sync::OwnedMutexGuard<()> {
        let lock = {
            let mut g = self.changing.lock();
            if g.len() >= 1024 {
                g.retain(|_, l| l.strong_count() > 0);
            }
            match g.get(id).and_then(std::sync::Weak::upgrade) {
                Some(l) => l,
                None => {
                    let l = Arc::new(tokio::sync::Mutex::new(()));
                    g.insert(id.to_owned(), Arc::downgrade(&l));
                    l
                }
            }
        };
        lock.lock_owned().await
    }

    /// Keeps a conversation's record written to the shared store
    /// ([`crate::conversation::share`]) in place of this replica's copy at that revision or an
    /// earlier one (a copy at the same revision was a change made here first, which the
    /// written record holds). Whether it was kept.
    pub fn replace(&self, r: Arc<StoredResponse>) -> bool {
        {
            let mut g = self.inner.lock();
            let older = g
                .entries
                .get(&r.id)
                .is_some_and(|e| e.record.is_conversation() && e.record.revision <= r.revision);
            if older {
                g.remove(&r.id);
            }
        }
        self.insert_at(r, Instant::now())
    }

    /// The turn `id`, whoever owns it (touched: it counts as used).
    pub fn peek(&self, id: &str) -> Option<Arc<StoredResponse>> {
        self.peek_at(id, Instant::now())
    }

    fn peek_at(&self, id: &str, now: Instant) -> Option<Arc<StoredResponse>> {
        self.inner.lock().touch(id, now, self.limits.idle_ttl)
    }

    /// The turn `id` when `tenant` owns it (touched).
    pub fn get(&self, id: &str, tenant: Option<&str>) -> Option<Arc<StoredResponse>> {
        self.get_at(id, tenant, Instant::now())
    }

    fn get_at(&self, id: &str, tenant: Option<&str>, now: Instant) -> Option<Arc<StoredResponse>> {
        self.peek_at(id, now)
            .filter(|r| r.tenant.as_deref() == tenant)
    }

    /// Deletes the turn `id` (whoever owns it: the caller checked); whether it was here.
    pub fn delete(&self, id: &str) -> bool {
        self.inner.lock().remove(id).is_some()
    }

    /// The turns of the conversation ending at `id`, oldest first, from this store alone;
    /// every one touched.
    pub fn turns(
        &self,
        id: &str,
        tenant: Option<&str>,
    ) -> Result<Vec<Arc<StoredResponse>>, MissingTurn> {
        self.turns_at(id, tenant, Instant::now())
    }

    fn turns_at(
        &self,
        id: &str,
        tenant: Option<&str>,
        now: Instant,
    ) -> Result<Vec<Arc<StoredResponse>>, MissingTurn> {
        let owned = |at: &str| {
            self.get_at(at, tenant, now)
                .filter(|t| !t.is_conversation())
                .ok_or_else(|| MissingTurn(at.to_owned()))
        };
        let last = owned(id)?;
        let mut turns = last
            .chain
            .iter()
            .map(|at| owned(at))
            .collect::<Result<Vec<_>, _>>()?;
        turns.push(last);
        Ok(turns)
    }

    /// Keeps a turn read back from a saved file ([`crate::response_file`]), unused for `idle`
    /// already: it expires that much sooner, and turns restored oldest first keep their order.
    /// Whether it was kept (as [`Self::insert`]; an expired one is not).
    pub fn restore(&self, r: StoredResponse, idle: Duration) -> bool {
        if idle >= self.limits.idle_ttl {
            return false;
        }
        let now = Instant::now();
        let used = now.checked_sub(idle).unwrap_or(now);
        self.insert_at(Arc::new(crate::background::interrupted(r)), used)
    }

    /// Every turn, least recently used first, with how long it has been unused.
    pub fn snapshot(&self) -> Vec<(Arc<StoredResponse>, Duration)> {
        let now = Instant::now();
        let g = self.inner.lock();
        g.order
            .values()
            .filter_map(|id| g.entries.get(id))
            .map(|e| (e.record.clone(), now.saturating_duration_since(e.used)))
            .collect()
    }

    /// A count of insertions, removals and uses: unchanged means nothing to save.
    pub fn changes(&self) -> u64 {
        self.inner.lock().changes
    }

    /// Conversations held (of the [`Self::stats`] records).
    pub fn conversations(&self) -> usize {
        self.inner.lock().conversations
    }

    /// Records held (turns and conversations) and their bytes.
    pub fn stats(&self) -> (usize, usize) {
        let g = self.inner.lock();
        (g.entries.len(), g.bytes)
    }
}

/// A conversation's turns as one JSON array of input items — every turn's input items then
/// output items, then `own` (the request's) — spliced from each turn's JSON (no stored value is
/// copied or written again).
fn conversation_json(turns: &[Arc<StoredResponse>], own: &[Value]) -> String {
    let mut out = String::with_capacity(turns.iter().map(|t| t.items.len() + 1).sum::<usize>() + 2);
    out.push('[');
    let own = own
        .iter()
        .map(|v| serde_json::to_string(v).unwrap_or_else(|_| "null".into()));
    for part in turns.iter().map(|t| t.items.clone()).chain(own) {
        if part.is_empty() {
            continue;
        }
        if out.len() > 1 {
            out.push(',');
        }
        out.push_str(&part);
    }
    out.push(']');
    out
}

/// A turn as the shared store has it.
#[derive(Debug)]
pub enum Shared {
    /// Stored (by this replica or another).
    Kept(Box<StoredResponse>),
    /// Stored, and not read (a probe: this replica holds a copy).
    Present,
    /// Deleted through some replica.
    Deleted,
    /// Not there (never stored there, expired, or not written yet).
    Absent,
}

/// What the shared store did with a conversation's record ([`SharedTurns::swap`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Swap {
    /// Written: it held an earlier revision, or nothing.
    Written,
    /// Not written: it holds this revision or a later one (another change came first).
    Stale,
    /// Not written: the conversation was deleted.
    Deleted,
}

/// Where the other gateway replicas' turns are (cluster mode: Redis,
/// [`crate::cluster::SharedResponses`]). Every call is bounded in time; `None` means the shared
/// store did not answer, and the replica goes on with its own copies.
#[async_trait]
pub trait SharedTurns: Send + Sync {
    /// The turns `ids`, in order: read whole where `whole[i]`, else only probed
    /// ([`Shared::Present`] rather than [`Shared::Kept`]).
    async fn fetch(&self, ids: &[String], whole: &[bool]) -> Option<Vec<Shared>>;
    /// Shares a turn this replica stored (never waits: what the shared store cannot take now
    /// is kept for a later try, within a bound).
    fn publish(&self, turn: &Arc<StoredResponse>);
    /// Deletes a turn everywhere; whether the shared store had it.
    async fn delete(&self, id: &str) -> Option<bool>;
    /// Writes a conversation's record ([`crate::conversation`]) unless the shared store holds
    /// that revision or a later one, or the conversation was deleted; `None` when the shared
    /// store did not answer.
    async fn swap(&self, record: &Arc<StoredResponse>) -> Option<Swap>;
    /// Asks the replica that runs the background response `id` to cancel it (never waits).
    fn cancel(&self, id: &str);
    /// Mirrors events `first`, `first + 1`, … of the streamed background response `id` (with
    /// `end`: then its end) for the other replicas' resumes (never waits: a full queue drops
    /// them).
    fn publish_events(&self, id: &str, first: u64, events: Vec<String>, end: bool);
    /// The mirrored entries of the streamed background response `id` from event `from` on;
    /// `None` when the shared store does not answer.
    async fn events_from(&self, id: &str, from: u64) -> Option<Vec<cluster::StreamEntry>>;
}

/// How long a replica waits, at most, for a turn another replica has just stored to reach the
/// shared store (it is written off that replica's request path once the answer is complete,
/// one `SET` round trip on an idle host, not timed; longer on a busy one): three more reads,
/// 10, 40 and 150 ms later.
/// Only an id the shared store does not have waits them all (an unknown id: 200 ms).
const SHARED_RETRIES: [Duration; 3] = [
    Duration::from_millis(10),
    Duration::from_millis(40),
    Duration::from_millis(150),
];

/// The turn `id` whoever owns it: the shared store's copy first (a deletion there wins), then
/// this replica's.
pub async fn find(
    local: &ResponseStore,
    shared: Option<&dyn SharedTurns>,
    id: &str,
) -> Option<Arc<StoredResponse>> {
    let Some(shared) = shared.filter(|_| id.len() <= MAX_ID_LEN) else {
        return local.peek(id);
    };
    let mut retries = SHARED_RETRIES.iter();
    loop {
        let here = local.peek(id);
        // A background response still running here, or a conversation, may have moved on
        // there: read it whole.
        let whole = here
            .as_ref()
            .is_none_or(|h| h.running() || h.is_conversation());
        match shared
            .fetch(&[id.to_owned()], &[whole])
            .await
            .and_then(|mut v| v.pop())
        {
            Some(Shared::Kept(t)) => return Some(adopt(local, *t)),
            Some(Shared::Deleted) => {
                local.delete(id);
                return None;
            }
            Some(Shared::Present | Shared::Absent) if here.is_some() => return here,
            Some(Shared::Present | Shared::Absent) => {
                tokio::time::sleep(*retries.next()?).await;
            }
            None => return here,
        }
    }
}

/// A turn read from the shared store, kept here as well (this replica's copy, for when the
/// shared store does not answer); the copy already here when there is one.
fn adopt(local: &ResponseStore, t: StoredResponse) -> Arc<StoredResponse> {
    if let Some(here) = local.peek(&t.id) {
        // A background response's later state, or a conversation's later revision, replaces
        // the copy here.
        let later = match t.is_conversation() {
            true => t.supersedes(&here),
            false => here.running() && t.background() && t.stage() > here.stage(),
        };
        if !later {
            return here;
        }
    }
    // Not kept when it does not fit here: served all the same.
    let t = Arc::new(t);
    local.insert_at(t.clone(), Instant::now());
    t
}

/// The turns of the conversation ending at `id`, oldest first, when `tenant` owns them. With a
/// shared store: one read of every turn there (a turn this replica holds is only probed: is it
/// still there, or deleted through another replica?; the others are read whole), a turn not
/// there taken from this replica's copies; plus, when this replica lacks the named turn
/// itself, one read of it first. From this replica alone when there is no shared store or it
/// does not answer.
pub async fn conversation(
    local: &ResponseStore,
    shared: Option<&dyn SharedTurns>,
    id: &str,
    tenant: Option<&str>,
) -> Result<Vec<Arc<StoredResponse>>, MissingTurn> {
    let Some(shared_store) = shared else {
        return local.turns(id, tenant);
    };
    let owned = |t: Option<Arc<StoredResponse>>, at: &str| {
        t.filter(|t| t.tenant.as_deref() == tenant && !t.is_conversation())
            .ok_or_else(|| MissingTurn(at.to_owned()))
    };
    // The named turn: this replica's copy (checked with the others below), else the shared
    // store's (checked now).
    let here = local.peek(id);
    let checked = here.is_none();
    let last = match here {
        Some(t) => owned(Some(t), id)?,
        None => owned(find(local, shared, id).await, id)?,
    };
    let mut ids = last.chain.clone();
    if !checked {
        ids.push(id.to_owned());
    }
    if ids.is_empty() {
        return Ok(vec![last]);
    }
    let held: Vec<Option<Arc<StoredResponse>>> = ids.iter().map(|at| local.peek(at)).collect();
    let whole: Vec<bool> = held.iter().map(Option::is_none).collect();
    let Some(states) = shared_store.fetch(&ids, &whole).await else {
        return local.turns(id, tenant);
    };
    let mut turns = Vec::with_capacity(ids.len() + 1);
    for ((at, state), held) in ids.iter().zip(states).zip(held) {
        let t = match state {
            Shared::Kept(t) => Some(adopt(local, *t)),
            Shared::Deleted => {
                local.delete(at);
                None
            }
            Shared::Present | Shared::Absent => held,
        };
        turns.push(owned(t, at)?);
    }
    if checked {
        turns.push(last);
    }
    Ok(turns)
}

/// Keeps a turn here and shares it.
pub fn keep(
    local: &ResponseStore,
    shared: Option<&dyn SharedTurns>,
    turn: impl Into<Arc<StoredResponse>>,
) {
    if let (Some(t), Some(s)) = (local.insert(turn), shared) {
        s.publish(&t);
    }
}

/// Deletes the turn `id` here and in the shared store; whether either had it.
pub async fn remove(local: &ResponseStore, shared: Option<&dyn SharedTurns>, id: &str) -> bool {
    let here = local.delete(id);
    let there = match shared {
        Some(s) => s.delete(id).await.unwrap_or(false),
        None => false,
    };
    here || there
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

/// A 400 about the body's `param`.
pub(crate) fn invalid(param: &str, code: &'static str, message: impl Into<String>) -> GatewayError {
    GatewayError::Body(BodyError {
        code,
        param: Some(param.to_owned()),
        message: message.into(),
    })
}

/// What storing does to one `POST /v1/responses` request.
#[derive(Debug, Default)]
pub struct Prepared {
    /// The body to send instead of the client's (a continued conversation).
    pub body: Option<Bytes>,
    /// How to capture the answer, when it is to be stored.
    pub capture: Option<Capture>,
    /// `store` and `previous_response_id` as the worker's response object must say them
    /// (`prompt_profile::STORED_HEADER`); `None` with storing off.
    pub stored: Option<prompt_profile::Stored>,
    /// `background: true`: the gateway answers at once and runs the request itself
    /// ([`crate::background`]); the body sent to the workers has no `background`.
    pub background: bool,
}

/// Reads a Responses API body for storing: with `previous_response_id`, the body the workers get
/// is the whole conversation (`previous_response_id` removed, `input` = the stored turns' items
/// then the request's own; [`conversation`]); with `store` (default `true`), a [`Capture`] for
/// its answer. `max_body` bounds the continued body (`conversation_too_large`). With storing
/// off nothing is done: the worker refuses `previous_response_id` itself.
pub async fn prepare(
    local: &ResponseStore,
    shared: Option<&dyn SharedTurns>,
    body: &[u8],
    tenant: Option<&str>,
    max_body: u64,
) -> Result<Prepared, GatewayError> {
    if !local.enabled() {
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
    let background = match o.get("background") {
        None | Some(Value::Null) | Some(Value::Bool(false)) => false,
        Some(Value::Bool(true)) => true,
        Some(_) => {
            return Err(invalid(
                "background",
                "invalid_type",
                "`background` must be a boolean",
            ))
        }
    };
    if background && !keep {
        return Err(invalid(
            "background",
            "invalid_value",
            "a background response is stored: `background: true` needs `store` true or absent",
        ));
    }
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
    let conv = match o.get("conversation") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) if !s.is_empty() => Some(s.clone()),
        Some(Value::Object(c))
            if c.get("id")
                .is_some_and(|id| id.as_str().is_some_and(|s| !s.is_empty())) =>
        {
            c.get("id").and_then(Value::as_str).map(str::to_owned)
        }
        Some(_) => {
            return Err(invalid(
                "conversation",
                "invalid_type",
                "`conversation` must be a conversation id, or an object with its `id`",
            ))
        }
    };
    if conv.is_some() && previous.is_some() {
        return Err(invalid(
            "conversation",
            "invalid_value",
            "`conversation` and `previous_response_id` cannot be used together",
        ));
    }
    let own = input_items(o.get("input"))?;
    let mut out = Prepared {
        stored: Some(prompt_profile::Stored {
            store: keep,
            background,
            previous_response_id: previous.clone(),
            conversation: conv.clone(),
        }),
        background,
        ..Prepared::default()
    };
    let mut chain = Vec::new();
    if background {
        o.remove("background");
    }
    if let Some(id) = &conv {
        let c = crate::conversation::find(local, shared, id, tenant).await?;
        o.remove("conversation");
        out.body = Some(with_input(
            o,
            &conversation_json(&[c], &own),
            "conversation",
            max_body,
        )?);
    } else if let Some(prev) = &previous {
        let turns =
            conversation(local, shared, prev, tenant)
                .await
                .map_err(
                    |MissingTurn(missing)| GatewayError::PreviousResponseNotFound {
                        id: prev.clone(),
                        missing,
                    },
                )?;
        if let Some(t) = turns.iter().find(|t| !t.continuable()) {
            return Err(GatewayError::PreviousResponseNotReady {
                id: t.id.clone(),
                status: t.status().to_owned(),
            });
        }
        chain = turns.iter().map(|t| t.id.clone()).collect();
        o.remove("previous_response_id");
        let input = conversation_json(&turns, &own);
        out.body = Some(with_input(o, &input, "previous_response_id", max_body)?);
    } else if background {
        out.body = Some(Bytes::from(serde_json::to_vec(&Value::Object(o)).map_err(
            |e| GatewayError::Internal {
                reason: format!("writing the background request: {e}"),
            },
        )?));
    }
    if keep || conv.is_some() {
        out.capture = Some(Capture {
            keep,
            conversation: conv,
            streamed: stream,
            buf: Vec::new(),
            expected: None,
            cap: local.limits().max_entry(),
            over: false,
            done: None,
            tenant: tenant.map(str::to_owned),
            chain,
            input: own,
        });
    }
    Ok(out)
}

/// `o` with `input` = `input` (a JSON array), within `max_body` (else
/// `conversation_too_large`, naming `param`, the field that named the conversation): the body
/// without `input`, then `input` spliced in before its closing brace.
fn with_input(
    mut o: Map<String, Value>,
    input: &str,
    param: &'static str,
    max_body: u64,
) -> Result<Bytes, GatewayError> {
    o.remove("input");
    let mut rewritten =
        serde_json::to_vec(&Value::Object(o)).map_err(|e| GatewayError::Internal {
            reason: format!("writing the continued conversation: {e}"),
        })?;
    rewritten.pop();
    if rewritten.len() > 1 {
        rewritten.push(b',');
    }
    rewritten.extend_from_slice(b"\"input\":");
    rewritten.extend_from_slice(input.as_bytes());
    rewritten.push(b'}');
    if rewritten.len() as u64 > max_body {
        return Err(GatewayError::ConversationTooLarge {
            param,
            bytes: rewritten.len(),
            limit: max_body,
        });
    }
    Ok(Bytes::from(rewritten))
}

/// An answer to store, read as it streams to the client. Keeps at most one turn's size: a
/// whole JSON answer, or of a stream only the event being read (deltas are dropped as they
/// end; the `response.completed` / `response.incomplete` event carries the whole response).
#[derive(Debug)]
pub struct Capture {
    /// The turn is stored (`store`).
    keep: bool,
    /// The conversation its items are added to.
    conversation: Option<String>,
    streamed: bool,
    buf: Vec<u8>,
    /// A whole answer's `content-length`, when the worker sent one.
    expected: Option<usize>,
    cap: usize,
    over: bool,
    done: Option<Value>,
    tenant: Option<String>,
    chain: Vec<String>,
    input: Vec<Value>,
}

impl Capture {
    /// The answer's `content-length` (a whole answer is then complete at that length).
    pub fn expect_length(&mut self, content_length: Option<usize>) {
        self.expected = content_length;
    }

    /// Whether the answer read so far is complete: a stream's last event was read, or a whole
    /// answer reached its `content-length`. The turn is then stored before this chunk reaches
    /// the client, so a client that continues the conversation the moment it has the answer
    /// finds it.
    pub fn complete(&self) -> bool {
        !self.over
            && if self.streamed {
                self.done.is_some()
            } else {
                self.expected == Some(self.buf.len())
            }
    }

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

    /// Whether the answer is a stream of events.
    pub fn streamed(&self) -> bool {
        self.streamed
    }

    /// Whether the turn is to be stored (`store`; else it is read only for its conversation).
    pub fn keeps(&self) -> bool {
        self.keep
    }

    /// The conversation the turn's items are added to.
    pub fn conversation(&self) -> Option<&str> {
        self.conversation.as_deref()
    }

    /// The tenant that made the request.
    pub fn tenant(&self) -> Option<&str> {
        self.tenant.as_deref()
    }

    /// The turn of a background response that has no answer yet: its request's input items and
    /// owner, and `response` (a `queued` one).
    pub fn pending_turn(&self, id: String, response: Value) -> StoredResponse {
        StoredResponse::new(
            id,
            self.tenant.clone(),
            self.chain.clone(),
            self.input.clone(),
            response,
        )
    }

    /// The turn to store, once the whole answer went through: `None` when it was larger than a
    /// turn may be, was cut short, or is not a completed (or incomplete) `response` with an id.
    pub fn finish(mut self) -> Option<StoredResponse> {
        if self.over || self.chain.len() >= MAX_TURNS {
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
        let id = o
            .get("id")
            .and_then(Value::as_str)
            .filter(|id| !id.is_empty() && id.len() <= MAX_ID_LEN)?
            .to_owned();
        Some(StoredResponse::new(
            id,
            self.tenant,
            self.chain,
            self.input,
            response,
        ))
    }
}

/// What a path under `/v1/responses/{id}` asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Resource {
    /// `/v1/responses/{id}`: the response (`GET`, `DELETE`).
    Response,
    /// `/v1/responses/{id}/input_items` (`GET`).
    InputItems,
    /// `/v1/responses/{id}/cancel` (`POST`: a background response, [`crate::background`]).
    Cancel,
}

/// `/v1/responses/{id}[/input_items|/cancel]` → the id and what is asked of it.
pub fn resource_path(path: &str) -> Option<(&str, Resource)> {
    let rest = path.trim_end_matches('/').strip_prefix("/v1/responses/")?;
    if rest == "input_tokens" {
        // `POST /v1/responses/input_tokens`: a count, served on the service's profile.
        return None;
    }
    let (id, what) = match rest.split_once('/') {
        None => (rest, Resource::Response),
        Some((id, "input_items")) => (id, Resource::InputItems),
        Some((id, "cancel")) => (id, Resource::Cancel),
        Some(_) => return None,
    };
    (!id.is_empty()).then_some((id, what))
}

/// `GET /v1/responses/{id}/input_items`: the turn's own input items ([`items_page`]).
pub fn input_items_page(r: &StoredResponse, query: Option<&str>) -> Result<Value, GatewayError> {
    items_page(r.input_items(), query)
}

/// A page of `items` as OpenAI lists them, with the query's `order` (`desc`, the default, or
/// `asc`), `limit` (1–100, default 20) and `after` (an item id).
pub fn items_page(mut items: Vec<Value>, query: Option<&str>) -> Result<Value, GatewayError> {
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
                    "`after` names no item of this list",
                )
            })?,
    };
    let page: Vec<Value> = items.iter().skip(start).take(limit).cloned().collect();
    let more = start + page.len() < items.len();
    Ok(list(&page, more))
}

/// Items as OpenAI lists them: `{"object": "list", "data", "first_id", "last_id", "has_more"}`.
pub fn list(page: &[Value], has_more: bool) -> Value {
    json!({
        "object": "list",
        "data": page,
        "first_id": page.first().map(|i| i["id"].clone()),
        "last_id": page.last().map(|i| i["id"].clone()),
        "has_more": has_more,
    })
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    fn turn(id: &str, chain: &[&str], said: &str, answered: &str) -> StoredResponse {
        StoredResponse::new(
            id.into(),
            None,
            chain.iter().map(|c| c.to_string()).collect(),
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

    fn block_on<F: std::future::Future>(f: F) -> F::Output {
        tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap()
            .block_on(f)
    }

    fn said(
        turns: Result<Vec<Arc<StoredResponse>>, MissingTurn>,
    ) -> Result<Vec<String>, MissingTurn> {
        turns.map(|t| {
            let v: Value = serde_json::from_str(&conversation_json(&t, &[])).unwrap();
            texts(v.as_array().unwrap())
        })
    }

    #[test]
    fn a_conversation_is_every_turn_in_order() {
        let s = ResponseStore::new(StoreLimits::DEFAULT);
        assert!(s.insert(turn("resp_1", &[], "a", "b")).is_some());
        assert!(s.insert(turn("resp_2", &["resp_1"], "c", "d")).is_some());
        assert!(s
            .insert(turn("resp_3", &["resp_1", "resp_2"], "e", "f"))
            .is_some());
        assert!(
            s.insert(turn("resp_3", &[], "x", "y")).is_none(),
            "an id is never replaced"
        );
        assert_eq!(
            said(s.turns("resp_3", None)).unwrap(),
            ["a", "b", "c", "d", "e", "f"]
        );
        assert_eq!(said(s.turns("resp_1", None)).unwrap(), ["a", "b"]);
        // A deleted turn breaks the chains through it, naming it.
        assert!(s.delete("resp_2"));
        assert!(!s.delete("resp_2"));
        assert_eq!(
            said(s.turns("resp_3", None)),
            Err(MissingTurn("resp_2".into()))
        );
        assert_eq!(
            said(s.turns("resp_9", None)),
            Err(MissingTurn("resp_9".into()))
        );
        // The JSON form round-trips, with its size.
        let t = turn("resp_j", &["resp_1"], "a", "b");
        let back = StoredResponse::from_json(&t.to_json()).unwrap();
        assert_eq!(
            (back.id.as_str(), back.previous(), back.bytes()),
            ("resp_j", Some("resp_1"), t.bytes())
        );
    }

    #[test]
    fn only_the_owner_sees_its_turns() {
        let s = ResponseStore::new(StoreLimits::DEFAULT);
        let mut t = turn("resp_1", &[], "a", "b");
        t.tenant = Some("acme".into());
        assert!(s.insert(t).is_some());
        assert!(s.get("resp_1", None).is_none());
        assert!(s.get("resp_1", Some("other")).is_none());
        assert!(s.turns("resp_1", Some("other")).is_err());
        assert!(s.get("resp_1", Some("acme")).is_some());
        assert!(s.turns("resp_1", Some("acme")).is_ok());
    }

    #[test]
    fn the_least_recently_used_goes_first_and_bytes_stay_bounded() {
        let one = turn("resp_0", &[], "a", "b").bytes();
        // Room for four turns of this size (a turn may take a quarter of the store).
        let limits = StoreLimits {
            max_bytes: one * 4 + one / 2,
            idle_ttl: Duration::from_secs(60),
        };
        assert!(one <= limits.max_entry());
        let s = ResponseStore::new(limits);
        let t0 = Instant::now();
        let put = |t: StoredResponse, at| s.insert_at(Arc::new(t), at);
        for i in 0..4 {
            assert!(put(turn(&format!("resp_{i}"), &[], "a", "b"), t0));
        }
        // resp_0 is used: resp_1 is now the least recently used.
        assert!(s.peek_at("resp_0", t0).is_some());
        assert!(put(turn("resp_4", &[], "a", "b"), t0));
        assert!(s.peek_at("resp_1", t0).is_none(), "evicted");
        for id in ["resp_0", "resp_2", "resp_3", "resp_4"] {
            assert!(s.peek_at(id, t0).is_some(), "{id}");
        }
        let (n, bytes) = s.stats();
        assert_eq!(n, 4);
        assert!(bytes <= limits.max_bytes, "{bytes}");
        // A turn larger than a quarter of the store is not kept.
        assert!(!put(turn("resp_big", &[], &"x".repeat(one * 2), "b"), t0));
        // Off: nothing is kept.
        let off = ResponseStore::new(StoreLimits {
            max_bytes: 0,
            ..limits
        });
        assert!(off.insert(turn("resp_1", &[], "a", "b")).is_none());
    }

    #[test]
    fn an_idle_turn_expires_and_use_keeps_it() {
        let limits = StoreLimits {
            max_bytes: 1 << 20,
            idle_ttl: Duration::from_secs(10),
        };
        let s = ResponseStore::new(limits);
        let t0 = Instant::now();
        let at = |secs| t0 + Duration::from_secs(secs);
        assert!(s.insert_at(Arc::new(turn("resp_1", &[], "a", "b")), t0));
        assert!(s.insert_at(Arc::new(turn("resp_2", &["resp_1"], "c", "d")), t0));
        // Continuing resp_2 at 8 s touches both turns; at 16 s they are 8 s idle.
        assert!(s.turns_at("resp_2", None, at(8)).is_ok());
        assert!(s.turns_at("resp_2", None, at(16)).is_ok());
        // 10 s after the last use: gone, and an insert sweeps them.
        assert!(s.peek_at("resp_1", at(26)).is_none());
        assert!(s.insert_at(Arc::new(turn("resp_3", &[], "e", "f")), at(27)));
        assert_eq!(s.stats().0, 1);
    }

    /// A shared store in memory, that can stop answering.
    #[derive(Default)]
    pub(crate) struct FakeShared {
        pub(crate) turns: Mutex<HashMap<String, Option<String>>>,
        pub(crate) down: std::sync::atomic::AtomicBool,
        pub(crate) reads: std::sync::atomic::AtomicUsize,
    }

    #[async_trait]
    impl SharedTurns for FakeShared {
        async fn fetch(&self, ids: &[String], whole: &[bool]) -> Option<Vec<Shared>> {
            self.reads
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            if self.down.load(std::sync::atomic::Ordering::Relaxed) {
                return None;
            }
            let g = self.turns.lock();
            Some(
                ids.iter()
                    .zip(whole)
                    .map(|(id, whole)| match g.get(id) {
                        None => Shared::Absent,
                        Some(None) => Shared::Deleted,
                        Some(Some(_)) if !whole => Shared::Present,
                        Some(Some(j)) => StoredResponse::from_json(j)
                            .map_or(Shared::Absent, |t| Shared::Kept(Box::new(t))),
                    })
                    .collect(),
            )
        }
        fn publish(&self, turn: &Arc<StoredResponse>) {
            // As `cluster::Store`: written once, but a background record replaced unless
            // deleted.
            let mut g = self.turns.lock();
            let e = g.entry(turn.id.clone()).or_insert(Some(turn.to_json()));
            if turn.background() && e.is_some() {
                *e = Some(turn.to_json());
            }
        }
        async fn delete(&self, id: &str) -> Option<bool> {
            let old = self.turns.lock().insert(id.to_owned(), None);
            Some(matches!(old, Some(Some(_))))
        }
        async fn swap(&self, record: &Arc<StoredResponse>) -> Option<Swap> {
            // As `cluster::Store::swap_response`: over the revision before only (or nothing).
            if self.down.load(std::sync::atomic::Ordering::Relaxed) {
                return None;
            }
            let mut g = self.turns.lock();
            match g.get(&record.id) {
                Some(None) => return Some(Swap::Deleted),
                Some(Some(j)) => {
                    let held = StoredResponse::from_json(j).map_or(0, |t| t.revision);
                    if held + 1 != record.revision {
                        return Some(Swap::Stale);
                    }
                }
                None => {}
            }
            g.insert(record.id.clone(), Some(record.to_json()));
            Some(Swap::Written)
        }
        fn cancel(&self, _id: &str) {}
        fn publish_events(&self, _id: &str, _first: u64, _events: Vec<String>, _end: bool) {}
        async fn events_from(&self, _id: &str, _from: u64) -> Option<Vec<cluster::StreamEntry>> {
            None
        }
    }

    fn background(id: &str, status: &str) -> StoredResponse {
        StoredResponse::new(
            id.into(),
            None,
            Vec::new(),
            Vec::new(),
            json!({"id": id, "object": "response", "status": status, "background": true,
                   "output": []}),
        )
    }

    #[test]
    fn a_background_record_moves_on_here_and_on_the_other_replicas() {
        let shared = FakeShared::default();
        let (a, b) = (
            ResponseStore::new(StoreLimits::DEFAULT),
            ResponseStore::new(StoreLimits::DEFAULT),
        );
        let sh: Option<&dyn SharedTurns> = Some(&shared);
        let status =
            |s: &ResponseStore| block_on(find(s, sh, "resp_bg")).map(|r| r.status().to_owned());
        keep(&a, sh, background("resp_bg", "queued"));
        assert_eq!(status(&b).as_deref(), Some("queued"));
        keep(&a, sh, background("resp_bg", "in_progress"));
        assert_eq!(
            status(&b).as_deref(),
            Some("in_progress"),
            "B's copy is read again"
        );
        keep(&a, sh, background("resp_bg", "completed"));
        assert_eq!(status(&a).as_deref(), Some("completed"));
        assert_eq!(status(&b).as_deref(), Some("completed"));
        // An earlier state never replaces a later one, and a turn not made in the background is
        // written once.
        assert!(a.insert(background("resp_bg", "in_progress")).is_none());
        assert_eq!(a.peek("resp_bg").unwrap().status(), "completed");
        a.insert(turn("resp_t", &[], "x", "y")).unwrap();
        assert!(a.insert(turn("resp_t", &[], "x", "z")).is_none());
        // Read back from a saved store while still running: its gateway stopped, so failed.
        let file = ResponseStore::new(StoreLimits::DEFAULT);
        assert!(file.restore(background("resp_r", "in_progress"), Duration::ZERO));
        assert_eq!(file.peek("resp_r").unwrap().status(), "failed");
        // A deleted one stays deleted when its job writes its end afterwards.
        keep(&a, sh, background("resp_d", "in_progress"));
        block_on(remove(&a, sh, "resp_d"));
        keep(&a, sh, background("resp_d", "completed"));
        assert!(status_of(&b, sh, "resp_d").is_none());
    }

    fn status_of(s: &ResponseStore, sh: Option<&dyn SharedTurns>, id: &str) -> Option<String> {
        block_on(find(s, sh, id)).map(|r| r.status().to_owned())
    }

    #[test]
    fn replicas_share_turns_and_deletions_and_go_on_alone_when_the_shared_store_is_down() {
        let shared = FakeShared::default();
        let (a, b) = (
            ResponseStore::new(StoreLimits::DEFAULT),
            ResponseStore::new(StoreLimits::DEFAULT),
        );
        let sh: Option<&dyn SharedTurns> = Some(&shared);
        // Replica A stores two turns; replica B continues the conversation from them.
        keep(&a, sh, turn("resp_1", &[], "a", "b"));
        keep(&a, sh, turn("resp_2", &["resp_1"], "c", "d"));
        let got = block_on(conversation(&b, sh, "resp_2", None));
        assert_eq!(said(got).unwrap(), ["a", "b", "c", "d"]);
        assert_eq!(b.stats().0, 2, "B keeps copies");
        // Deleted through B: A's own copy is no longer continued.
        assert!(block_on(remove(&b, sh, "resp_1")));
        assert!(!block_on(remove(&b, sh, "resp_1")));
        assert!(a.peek("resp_1").is_some());
        assert_eq!(
            said(block_on(conversation(&a, sh, "resp_2", None))),
            Err(MissingTurn("resp_1".into()))
        );
        assert!(a.peek("resp_1").is_none(), "A dropped its copy");
        assert!(block_on(find(&a, sh, "resp_1")).is_none());
        // The shared store down: each replica goes on with its own copies.
        keep(&a, sh, turn("resp_3", &[], "e", "f"));
        shared
            .down
            .store(true, std::sync::atomic::Ordering::Relaxed);
        keep(&a, sh, turn("resp_4", &["resp_3"], "g", "h"));
        assert_eq!(
            said(block_on(conversation(&a, sh, "resp_4", None))).unwrap(),
            ["e", "f", "g", "h"]
        );
        assert!(block_on(conversation(&b, sh, "resp_4", None)).is_err());
        // A turn not yet in the shared store is read again, twice, before it is missing.
        shared
            .down
            .store(false, std::sync::atomic::Ordering::Relaxed);
        let before = shared.reads.load(std::sync::atomic::Ordering::Relaxed);
        assert!(block_on(find(&b, sh, "resp_9")).is_none());
        assert_eq!(
            shared.reads.load(std::sync::atomic::Ordering::Relaxed) - before,
            4
        );
        // Another tenant's turn is missing to the caller.
        let mut t = turn("resp_t", &[], "a", "b");
        t.tenant = Some("acme".into());
        keep(&a, sh, t);
        assert!(block_on(conversation(&b, sh, "resp_t", None)).is_err());
        assert!(block_on(conversation(&b, sh, "resp_t", Some("acme"))).is_ok());
    }

    fn completed(id: &str) -> String {
        json!({"type": "response.completed", "sequence_number": 9, "response": {
            "id": id, "object": "response", "status": "completed",
            "output": [{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "hi\n\nthere"}]}]}})
        .to_string()
    }

    fn capture(stream: bool) -> Capture {
        let s = ResponseStore::new(StoreLimits::DEFAULT);
        let body = json!({"model": "m", "input": "hello", "stream": stream});
        block_on(prepare(
            &s,
            None,
            body.to_string().as_bytes(),
            None,
            1 << 20,
        ))
        .unwrap()
        .capture
        .unwrap()
    }

    #[test]
    fn a_stream_is_captured_from_its_last_event_in_any_chunking() {
        let stream = format!(
            "event: response.created\ndata: {{\"type\":\"response.created\"}}\n\n\
             event: response.output_text.delta\r\ndata: {{\"type\":\"response.output_text.delta\",\"delta\":\"hi\"}}\r\n\r\n\
             event: response.completed\ndata: {}\n\n",
            completed("resp_s")
        );
        for size in [1, 2, 7, 64, stream.len()] {
            let mut c = capture(true);
            for chunk in stream.as_bytes().chunks(size) {
                c.feed(chunk);
                assert!(c.buf.len() <= stream.len());
            }
            assert!(c.complete());
            let t = c.finish().expect("stored");
            assert_eq!(t.id, "resp_s");
            assert_eq!(t.output_items()[0]["content"][0]["text"], "hi\n\nthere");
        }
        // Cut before its last event: nothing to store.
        let mut c = capture(true);
        c.feed(&stream.as_bytes()[..stream.len() - 10]);
        assert!(!c.complete());
        assert!(c.finish().is_none());
        // An event larger than a turn may be: not stored.
        let mut c = capture(true);
        c.cap = 100;
        c.feed(stream.as_bytes());
        assert!(c.finish().is_none());
    }

    #[test]
    fn a_whole_answer_is_captured_when_it_is_a_finished_response() {
        let mut c = capture(false);
        let ok =
            json!({"id": "resp_w", "object": "response", "status": "incomplete", "output": []});
        let body = ok.to_string();
        c.expect_length(Some(body.len()));
        c.feed(&body.as_bytes()[..5]);
        assert!(!c.complete());
        c.feed(&body.as_bytes()[5..]);
        assert!(c.complete(), "complete at its content-length");
        assert_eq!(c.finish().unwrap().id, "resp_w");
        for bad in [
            json!({"id": "resp_w", "object": "response", "status": "failed", "output": []}),
            json!({"object": "response", "status": "completed"}),
            json!({"id": "r".repeat(MAX_ID_LEN + 1), "object": "response", "status": "completed"}),
            json!({"error": {"code": "x"}}),
        ] {
            let mut c = capture(false);
            c.feed(bad.to_string().as_bytes());
            assert!(c.finish().is_none(), "{bad}");
        }
        // A conversation at its longest: its next turn is served, not stored.
        let mut c = capture(false);
        c.chain = c_chain();
        c.feed(ok.to_string().as_bytes());
        assert!(c.finish().is_none());
        // Nor is such a record used when read from the shared store.
        let long = StoredResponse::new("resp_l".into(), None, c_chain(), Vec::new(), json!({}));
        assert!(StoredResponse::from_json(&long.to_json()).is_none());
    }

    fn c_chain() -> Vec<String> {
        (0..MAX_TURNS).map(|t| format!("resp_{t}")).collect()
    }

    #[test]
    fn a_continued_request_carries_the_conversation() {
        let s = ResponseStore::new(StoreLimits::DEFAULT);
        assert!(s.insert(turn("resp_1", &[], "a", "b")).is_some());
        let run = |s: &ResponseStore, body: &Value, tenant, max| {
            block_on(prepare(s, None, body.to_string().as_bytes(), tenant, max))
        };
        let body = json!({"model": "m", "previous_response_id": "resp_1", "input": "c",
                          "instructions": "be brief", "store": false});
        let p = run(&s, &body, None, 1 << 20).unwrap();
        assert!(p.capture.is_none(), "store: false");
        let sent: Value = serde_json::from_slice(&p.body.unwrap()).unwrap();
        assert!(sent.get("previous_response_id").is_none());
        assert_eq!(sent["instructions"], "be brief");
        assert_eq!(texts(sent["input"].as_array().unwrap()), ["a", "b", "c"]);
        // A body of nothing else is still one JSON object.
        let bare = json!({"previous_response_id": "resp_1"});
        let sent: Value =
            serde_json::from_slice(&run(&s, &bare, None, 1 << 20).unwrap().body.unwrap()).unwrap();
        assert_eq!(texts(sent["input"].as_array().unwrap()), ["a", "b"]);
        assert_eq!(sent.as_object().unwrap().len(), 1);
        // Stored, it names the turns before it.
        let stored = json!({"model": "m", "previous_response_id": "resp_1", "input": "c"});
        assert_eq!(
            run(&s, &stored, None, 1 << 20)
                .unwrap()
                .capture
                .unwrap()
                .chain,
            ["resp_1"]
        );
        // Over the service's body limit.
        let e = run(&s, &body, None, 50).unwrap_err();
        assert_eq!(e.error_type(), "conversation_too_large");
        // Unknown, of another tenant, malformed.
        let e = run(&s, &body, Some("t"), 1 << 20).unwrap_err();
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
            let GatewayError::Body(b) = run(&s, &bad, None, 1 << 20).unwrap_err() else {
                panic!("{bad}")
            };
            assert_eq!(b.param.as_deref(), Some(param));
        }
        // Background: the body goes without `background`, the worker is told, and it is stored.
        let bg = json!({"model": "m", "input": "c", "background": true, "metadata": {"k": "v"}});
        let p = run(&s, &bg, None, 1 << 20).unwrap();
        assert!(p.background && p.capture.is_some());
        assert!(p.stored.as_ref().is_some_and(|s| s.background && s.store));
        let sent: Value = serde_json::from_slice(&p.body.unwrap()).unwrap();
        assert_eq!(
            sent,
            json!({"model": "m", "input": "c", "metadata": {"k": "v"}})
        );
        // Continuing a conversation in the background: both rewrites.
        let bg = json!({"model": "m", "input": "c", "background": true, "previous_response_id": "resp_1"});
        let p = run(&s, &bg, None, 1 << 20).unwrap();
        let sent: Value = serde_json::from_slice(&p.body.unwrap()).unwrap();
        assert!(sent.get("background").is_none() && sent.get("previous_response_id").is_none());
        assert_eq!(texts(sent["input"].as_array().unwrap()), ["a", "b", "c"]);
        assert!(
            !run(
                &s,
                &json!({"input": "c", "background": false}),
                None,
                1 << 20
            )
            .unwrap()
            .background
        );
        for (bad, param, code) in [
            (
                json!({"input": "c", "background": "yes"}),
                "background",
                "invalid_type",
            ),
            (
                json!({"input": "c", "background": true, "store": false}),
                "background",
                "invalid_value",
            ),
        ] {
            let GatewayError::Body(b) = run(&s, &bad, None, 1 << 20).unwrap_err() else {
                panic!("{bad}")
            };
            assert_eq!((b.param.as_deref(), b.code), (Some(param), code), "{bad}");
        }
        // A background response not yet answered, failed or cancelled is not continued.
        for status in ["queued", "in_progress", "failed", "cancelled"] {
            s.insert(StoredResponse::new(
                "resp_bg".into(),
                None,
                Vec::new(),
                Vec::new(),
                json!({"id": "resp_bg", "object": "response", "status": status, "background": true, "output": []}),
            ));
            let next = json!({"model": "m", "previous_response_id": "resp_bg", "input": "d"});
            let e = run(&s, &next, None, 1 << 20).unwrap_err();
            assert_eq!(
                (e.error_type(), e.status()),
                ("previous_response_not_ready", 400),
                "{status}"
            );
            assert!(e.to_string().contains(status), "{e}");
        }
        // Storing off: nothing read or changed.
        let off = ResponseStore::new(StoreLimits {
            max_bytes: 0,
            ..StoreLimits::DEFAULT
        });
        let p = run(&off, &body, None, 1 << 20).unwrap();
        assert!(p.body.is_none() && p.capture.is_none());
    }

    #[test]
    fn input_items_list_in_openai_order_and_pages() {
        let r = StoredResponse::new(
            "resp_p".into(),
            None,
            Vec::new(),
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
            Some(("resp_1", Resource::Response))
        );
        assert_eq!(
            resource_path("/v1/responses/resp_1/input_items"),
            Some(("resp_1", Resource::InputItems))
        );
        assert_eq!(
            resource_path("/v1/responses/resp_1/cancel/"),
            Some(("resp_1", Resource::Cancel))
        );
        assert_eq!(resource_path("/v1/responses/resp_1/other"), None);
        assert_eq!(resource_path("/v1/responses"), None);
        assert_eq!(resource_path("/v1/responses/input_tokens"), None);
    }
}
