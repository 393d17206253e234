//! The Conversations API (docs/gateway.md, "Conversations"): `conv_…` objects holding an
//! ordered list of items, made and changed by `/v1/conversations…`, and grown by each
//! `POST /v1/responses` that names one as `conversation` (its input items, then its output
//! items).
//!
//! A conversation is one record of the response store ([`StoredResponse::conversation`]: the
//! conversation object as `response`, its items as `input`), so it has the store's bounds
//! (bytes, idle TTL, least recently used first out), its file (`--response-store-file`) and, in
//! cluster mode, its Redis copy. Unlike a turn it changes: every change writes the whole record
//! at the next *revision*. Here a record replaces another only at a later revision; in Redis
//! the write is a compare-and-set (revision N only over N − 1, [`SharedTurns::swap`]) of a
//! change made on the record Redis holds, so two replicas changing one conversation at once
//! never lose either change — the one that comes second is made again on the record as the
//! first left it ([`share`]). A change made while Redis does not answer waits for it
//! ([`Pending`]).
//!
//! A change costs O(the conversation's bytes) (the record is written whole), as does the
//! prompt of a turn, which sends the whole conversation to the worker anyway.

use std::sync::Arc;

use serde_json::{json, Map, Value};

use crate::error::GatewayError;
use crate::response_store::invalid;
use crate::response_store::{
    find as find_record, ResponseStore, Shared, SharedTurns, StoredResponse, Swap,
};

/// The most items one create or one `POST …/items` adds (OpenAI's bound).
pub const MAX_ITEMS_PER_CALL: usize = 20;

/// `metadata`: at most this many keys, …
pub const MAX_METADATA_KEYS: usize = 16;
/// … each at most this many characters, …
pub const MAX_METADATA_KEY_CHARS: usize = 64;
/// … with string values of at most this many.
pub const MAX_METADATA_VALUE_CHARS: usize = 512;

/// Changes made while the shared store did not answer: made there once it does ([`retry`]),
/// at most [`MAX_PENDING`] (more are made on this replica only, logged).
#[derive(Default)]
pub struct Pending {
    changes: parking_lot::Mutex<std::collections::VecDeque<(String, Option<String>, Change)>>,
}

/// Changes kept for the shared store while it does not answer.
pub const MAX_PENDING: usize = 4096;

impl Pending {
    fn push(&self, id: &str, tenant: Option<&str>, change: &Change) {
        let mut q = self.changes.lock();
        if q.len() >= MAX_PENDING {
            tracing::warn!(conversation = id, "too many conversation changes wait for Redis; this one is made on this replica only");
            return;
        }
        q.push_back((id.to_owned(), tenant.map(str::to_owned), change.clone()));
    }

    /// Changes waiting.
    pub fn len(&self) -> usize {
        self.changes.lock().len()
    }

    /// Whether none waits.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The changes waiting, oldest first: conversation id, tenant, change.
    pub fn waiting(&self) -> Vec<(String, Option<String>, Change)> {
        self.changes.lock().iter().cloned().collect()
    }

    /// Keeps changes that waited for Redis when the gateway last stopped (read back from
    /// `--response-store-file`), ahead of any made since; within [`MAX_PENDING`].
    pub fn restore(&self, changes: Vec<(String, Option<String>, Change)>) {
        for (id, tenant, change) in changes {
            self.push(&id, tenant.as_deref(), &change);
        }
    }
}

/// Makes the changes that waited for the shared store there, oldest first (the cluster link's
/// task, while Redis answers): each on the record Redis holds, as any change ([`share`]); one
/// the shared store still does not take waits again. A change made again adds nothing twice
/// (appends skip the items the conversation holds).
pub async fn retry(local: &ResponseStore, shared: &dyn SharedTurns) {
    let waiting: Vec<_> = local.pending.changes.lock().drain(..).collect();
    for (id, tenant, change) in waiting {
        match share(local, shared, &id, tenant.as_deref(), &change).await {
            Ok(_) => {
                tracing::info!(conversation = %id, "a conversation change made while Redis was away written there")
            }
            Err(GatewayError::ConversationNotFound { .. }) => {}
            Err(e) => {
                tracing::warn!(conversation = %id, error = %e, "a conversation change made while Redis was away was not written there")
            }
        }
    }
}

/// Tries of a change that other changes keep overtaking, before 409 `conversation_conflict`.
const MAX_TRIES: usize = 12;

/// What a path under `/v1/conversations` asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Resource<'a> {
    /// `/v1/conversations` (`POST`: create).
    Collection,
    /// `/v1/conversations/{id}` (`GET`, `POST`: metadata, `DELETE`).
    Conversation(&'a str),
    /// `/v1/conversations/{id}/items` (`GET`: a page, `POST`: add).
    Items(&'a str),
    /// `/v1/conversations/{id}/items/{item_id}` (`GET`, `DELETE`).
    Item(&'a str, &'a str),
}

impl Resource<'_> {
    /// The methods it serves (the `Allow` of a 405).
    pub fn allowed(&self) -> &'static str {
        match self {
            Resource::Collection => "POST",
            Resource::Conversation(_) => "GET, POST, DELETE",
            Resource::Items(_) => "GET, POST",
            Resource::Item(..) => "GET, DELETE",
        }
    }
}

/// The resource of a path under `/v1/conversations`; `None` for any other path (or an empty
/// id).
pub fn resource_path(path: &str) -> Option<Resource<'_>> {
    let rest = path
        .trim_end_matches('/')
        .strip_prefix("/v1/conversations")?;
    if rest.is_empty() {
        return Some(Resource::Collection);
    }
    let mut parts = rest.strip_prefix('/')?.split('/');
    let id = parts.next().filter(|id| !id.is_empty())?;
    let what = match (parts.next(), parts.next(), parts.next()) {
        (None, ..) => Resource::Conversation(id),
        (Some("items"), None, _) => Resource::Items(id),
        (Some("items"), Some(item), None) if !item.is_empty() => Resource::Item(id, item),
        _ => return None,
    };
    Some(what)
}

/// A request body of the Conversations API: one JSON object.
pub fn body_object(body: &[u8]) -> Result<Map<String, Value>, GatewayError> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(Map::new());
    }
    match serde_json::from_slice::<Value>(body) {
        Ok(Value::Object(o)) => Ok(o),
        Ok(_) => Err(GatewayError::Body(
            prompt_profile::BodyError::not_an_object(),
        )),
        Err(e) => Err(GatewayError::Body(prompt_profile::BodyError::not_json(&e))),
    }
}

/// `items` as the conversation keeps them: at most [`MAX_ITEMS_PER_CALL`] objects, each
/// with a `type` (an item with a `role` and none is a `message`) and an `id` (one without is
/// given `msg_<request id>_<n>` for a message, else `item_<request id>_<n>`). `None` or `null`:
/// none.
pub fn items(v: Option<&Value>, request_id: &str) -> Result<Vec<Value>, GatewayError> {
    let list = match v {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::Array(list)) => list,
        Some(_) => {
            return Err(invalid(
                "items",
                "invalid_type",
                "`items` must be an array of items",
            ))
        }
    };
    if list.len() > MAX_ITEMS_PER_CALL {
        return Err(invalid(
            "items",
            "invalid_value",
            format!(
                "at most {MAX_ITEMS_PER_CALL} items may be added at once, not {}",
                list.len()
            ),
        ));
    }
    list.iter()
        .enumerate()
        .map(|(n, item)| {
            let at = format!("items[{n}]");
            let Value::Object(o) = item else {
                return Err(invalid(&at, "invalid_type", "an item must be an object"));
            };
            let mut o = o.clone();
            if !o.contains_key("type") && o.contains_key("role") {
                o.insert("type".into(), json!("message"));
            }
            let kind = match o.get("type") {
                Some(Value::String(t)) if !t.is_empty() => t.clone(),
                _ => {
                    return Err(invalid(
                        &at,
                        "missing_parameter",
                        "an item needs its `type`",
                    ))
                }
            };
            if kind == "message" && !o.get("role").is_some_and(Value::is_string) {
                return Err(invalid(
                    &at,
                    "missing_parameter",
                    "a message item needs its `role`",
                ));
            }
            match o.get("id") {
                Some(Value::String(id)) if !id.is_empty() => {}
                None | Some(Value::Null) => {
                    let prefix = if kind == "message" { "msg" } else { "item" };
                    o.insert("id".into(), json!(format!("{prefix}_{request_id}_{n}")));
                }
                Some(_) => {
                    return Err(invalid(
                        &at,
                        "invalid_type",
                        "an item's `id` must be a string",
                    ))
                }
            }
            Ok(Value::Object(o))
        })
        .collect()
}

/// `metadata`: at most [`MAX_METADATA_KEYS`] keys of at most [`MAX_METADATA_KEY_CHARS`]
/// characters, string values of at most [`MAX_METADATA_VALUE_CHARS`]. `None` when absent or
/// `null`.
pub fn metadata(v: Option<&Value>) -> Result<Option<Map<String, Value>>, GatewayError> {
    let m = match v {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::Object(m)) => m,
        Some(_) => {
            return Err(invalid(
                "metadata",
                "invalid_type",
                "`metadata` must be an object",
            ))
        }
    };
    if m.len() > MAX_METADATA_KEYS {
        return Err(invalid(
            "metadata",
            "invalid_value",
            format!("`metadata` has at most {MAX_METADATA_KEYS} keys"),
        ));
    }
    for (k, v) in m {
        if k.chars().count() > MAX_METADATA_KEY_CHARS {
            return Err(invalid(
                "metadata",
                "invalid_value",
                format!("a `metadata` key has at most {MAX_METADATA_KEY_CHARS} characters"),
            ));
        }
        match v {
            Value::String(s) if s.chars().count() <= MAX_METADATA_VALUE_CHARS => {}
            _ => {
                return Err(invalid(
                    &format!("metadata.{k}"),
                    "invalid_value",
                    format!("a `metadata` value is a string of at most {MAX_METADATA_VALUE_CHARS} characters"),
                ))
            }
        }
    }
    Ok(Some(m.clone()))
}

/// A new conversation's record (revision 1): `conv_<request id>`, made now.
pub fn create(
    request_id: &str,
    tenant: Option<String>,
    created_at: u64,
    metadata: Option<Map<String, Value>>,
    items: Vec<Value>,
) -> StoredResponse {
    let object = json!({
        "id": format!("conv_{request_id}"),
        "object": "conversation",
        "created_at": created_at,
        "metadata": metadata.unwrap_or_default(),
    });
    StoredResponse::conversation(1, tenant, object, items)
}

/// The conversation object as the API answers it.
pub fn object(r: &StoredResponse) -> Value {
    r.response.clone()
}

/// `{"id", "object": "conversation.deleted", "deleted": true}`.
pub fn deleted(id: &str) -> Value {
    json!({"id": id, "object": "conversation.deleted", "deleted": true})
}

/// The item `item` of conversation `r`.
pub fn item(r: &StoredResponse, item: &str) -> Result<Value, GatewayError> {
    r.input
        .iter()
        .find(|i| i["id"].as_str() == Some(item))
        .cloned()
        .ok_or_else(|| GatewayError::ItemNotFound {
            conversation: r.id.clone(),
            id: item.to_owned(),
        })
}

/// The conversation `id` when `tenant` owns it (the shared store's latest revision first).
pub async fn find(
    local: &ResponseStore,
    shared: Option<&dyn SharedTurns>,
    id: &str,
    tenant: Option<&str>,
) -> Result<Arc<StoredResponse>, GatewayError> {
    let not_found = || GatewayError::ConversationNotFound { id: id.to_owned() };
    if !id.starts_with("conv_") {
        return Err(not_found());
    }
    find_record(local, shared, id)
        .await
        .filter(|r| owned(r, tenant))
        .ok_or_else(not_found)
}

fn owned(r: &StoredResponse, tenant: Option<&str>) -> bool {
    r.is_conversation() && r.tenant.as_deref() == tenant
}

/// A change of a conversation: from its object and items, the new ones. Made again on a later
/// revision when another change came first, so it depends only on what it is given; data, so
/// that one waiting for Redis can be kept in `--response-store-file` (docs/gateway.md).
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Change {
    /// Appends the items, but those whose id the conversation holds already: made again on a
    /// record that has them (a write whose outcome was not known), it adds nothing twice.
    Append(Vec<Value>),
    /// Removes the item of this id; none there, nothing changes (made again, it removes
    /// nothing more).
    RemoveItem(String),
    /// Replaces the metadata.
    SetMetadata(Map<String, Value>),
}

impl Change {
    /// The object and items after the change.
    fn apply(&self, object: &Value, items: &[Value]) -> (Value, Vec<Value>) {
        match self {
            Change::Append(new) => {
                let held: std::collections::HashSet<&str> =
                    items.iter().filter_map(|i| i["id"].as_str()).collect();
                let mut all = items.to_vec();
                all.extend(
                    new.iter()
                        .filter(|i| i["id"].as_str().is_none_or(|id| !held.contains(id)))
                        .cloned(),
                );
                (object.clone(), all)
            }
            Change::RemoveItem(item) => {
                let rest = items
                    .iter()
                    .filter(|i| i["id"].as_str() != Some(item.as_str()))
                    .cloned()
                    .collect();
                (object.clone(), rest)
            }
            Change::SetMetadata(metadata) => {
                let mut object = object.clone();
                object["metadata"] = Value::Object(metadata.clone());
                (object, items.to_vec())
            }
        }
    }
}

/// [`Change::Append`].
pub fn append(new: Vec<Value>) -> Change {
    Change::Append(new)
}

/// [`Change::RemoveItem`].
pub fn remove_item(item: &str) -> Change {
    Change::RemoveItem(item.to_owned())
}

/// [`Change::SetMetadata`].
pub fn set_metadata(metadata: Map<String, Value>) -> Change {
    Change::SetMetadata(metadata)
}

/// `change` made on `base`: the record at the next revision, within the store's bound on one
/// record.
fn changed(
    local: &ResponseStore,
    base: &StoredResponse,
    change: &Change,
) -> Result<Arc<StoredResponse>, GatewayError> {
    let (object, items) = change.apply(&base.response, &base.input);
    let next = StoredResponse::conversation(base.revision + 1, base.tenant.clone(), object, items);
    let limit = local.limits().max_entry();
    if next.bytes() > limit {
        return Err(GatewayError::ConversationFull {
            id: base.id.clone(),
            bytes: next.bytes(),
            limit,
        });
    }
    Ok(Arc::new(next))
}

/// Makes `change` on this replica's copy of conversation `id` (a compare-and-set on its
/// revision, tried again while another change overtakes it). No wait: what a turn's answer
/// does on its way to the client, so that the client's next turn finds it; in cluster mode
/// the copy is then ahead of the shared store until [`share`] writes the change there.
pub fn change_here(
    local: &ResponseStore,
    id: &str,
    tenant: Option<&str>,
    change: &Change,
) -> Result<Arc<StoredResponse>, GatewayError> {
    for _ in 0..MAX_TRIES {
        let base = local
            .peek(id)
            .filter(|r| owned(r, tenant))
            .ok_or_else(|| GatewayError::ConversationNotFound { id: id.to_owned() })?;
        let next = changed(local, &base, change)?;
        if local.insert(next.clone()).is_some() {
            return Ok(next);
        }
    }
    Err(GatewayError::ConversationConflict { id: id.to_owned() })
}

/// Makes `change` in the shared store: on the record it holds, written only over that
/// revision ([`SharedTurns::swap`]); when another change came first, again on the record as
/// that one left it. The record written replaces this replica's copy. The shared store's
/// record is the base even when this replica's copy is ahead of it (a turn's items added here
/// first): only a revision the shared store holds is unique to one content. Where the shared
/// store does not hold the record (restarted empty), this replica's copy is the base, and the
/// record changed goes there; where it does not answer, the change is made here, and kept to
/// be made there once it answers again ([`Pending`], [`retry`]).
pub async fn share(
    local: &ResponseStore,
    shared: &dyn SharedTurns,
    id: &str,
    tenant: Option<&str>,
    change: &Change,
) -> Result<Arc<StoredResponse>, GatewayError> {
    let gone = || GatewayError::ConversationNotFound { id: id.to_owned() };
    let _one_at_a_time = local.changing(id).await;
    for attempt in 0..MAX_TRIES {
        if attempt > 0 {
            // Another replica's change came first: wait a little, more each time, at random
            // (so that the replicas that lost do not meet again), at most ~64 ms.
            let ms = rand::random::<u64>() % (2u64 << attempt.min(5)) + 1;
            tokio::time::sleep(std::time::Duration::from_millis(ms)).await;
        }
        let base: Arc<StoredResponse> = match shared
            .fetch(&[id.to_owned()], &[true])
            .await
            .and_then(|mut v| v.pop())
        {
            None => return made_here(local, id, tenant, change),
            Some(Shared::Kept(t)) => Arc::new(*t),
            // Not there (Redis restarted empty, or the record was never written there): this
            // replica's copy, written there as changed.
            Some(Shared::Absent | Shared::Present) => local.peek(id).ok_or_else(gone)?,
            Some(Shared::Deleted) => {
                local.delete(id);
                return Err(gone());
            }
        };
        if !owned(&base, tenant) {
            return Err(gone());
        }
        let next = changed(local, &base, change)?;
        match shared.swap(&next).await {
            Some(Swap::Written) => {
                local.replace(next.clone());
                return Ok(next);
            }
            Some(Swap::Stale) => {}
            Some(Swap::Deleted) => {
                local.delete(id);
                return Err(gone());
            }
            // Whether it was written is not known: made here too, and again there later (an
            // append made twice adds its items once).
            None => return made_here(local, id, tenant, change),
        }
    }
    Err(GatewayError::ConversationConflict { id: id.to_owned() })
}

/// `change` made here while the shared store does not answer, and kept to be made there
/// ([`retry`]).
fn made_here(
    local: &ResponseStore,
    id: &str,
    tenant: Option<&str>,
    change: &Change,
) -> Result<Arc<StoredResponse>, GatewayError> {
    let r = change_here(local, id, tenant, change)?;
    local.pending.push(id, tenant, change);
    Ok(r)
}

/// Makes `change` on conversation `id` (owned by `tenant`): in the shared store ([`share`])
/// in cluster mode, else here.
pub async fn update(
    local: &ResponseStore,
    shared: Option<&dyn SharedTurns>,
    id: &str,
    tenant: Option<&str>,
    change: Change,
) -> Result<Arc<StoredResponse>, GatewayError> {
    find(local, shared, id, tenant).await?;
    match shared {
        Some(s) => share(local, s, id, tenant, &change).await,
        None => change_here(local, id, tenant, &change),
    }
}

/// Keeps a new conversation here and in the shared store.
pub async fn keep(
    local: &ResponseStore,
    shared: Option<&dyn SharedTurns>,
    record: StoredResponse,
) -> Result<Arc<StoredResponse>, GatewayError> {
    let limit = local.limits().max_entry();
    if record.bytes() > limit {
        return Err(GatewayError::ConversationFull {
            id: record.id.clone(),
            bytes: record.bytes(),
            limit,
        });
    }
    let record = local.insert(record).ok_or_else(|| GatewayError::Internal {
        reason: "a new conversation's id is taken".into(),
    })?;
    if let Some(s) = shared {
        if s.swap(&record).await == Some(Swap::Stale) {
            return Err(GatewayError::Internal {
                reason: "a new conversation's id is taken in the shared store".into(),
            });
        }
    }
    Ok(record)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::response_store::tests::FakeShared;
    use crate::response_store::{prepare, StoreLimits};

    fn block_on<F: std::future::Future>(f: F) -> F::Output {
        tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap()
            .block_on(f)
    }

    fn said(text: &str) -> Value {
        json!({"type": "message", "role": "user", "content": text})
    }

    fn texts(r: &StoredResponse) -> Vec<String> {
        r.input
            .iter()
            .map(|i| i["content"].as_str().unwrap_or_default().to_owned())
            .collect()
    }

    fn made(local: &ResponseStore, shared: Option<&dyn SharedTurns>, rid: &str) -> String {
        let items = items(Some(&json!([said("first")])), rid).unwrap();
        let r = block_on(keep(local, shared, create(rid, None, 0, None, items))).unwrap();
        r.id.clone()
    }

    #[test]
    fn paths_name_what_they_ask_for() {
        assert_eq!(
            resource_path("/v1/conversations"),
            Some(Resource::Collection)
        );
        assert_eq!(
            resource_path("/v1/conversations/"),
            Some(Resource::Collection)
        );
        assert_eq!(
            resource_path("/v1/conversations/conv_1"),
            Some(Resource::Conversation("conv_1"))
        );
        assert_eq!(
            resource_path("/v1/conversations/conv_1/items"),
            Some(Resource::Items("conv_1"))
        );
        assert_eq!(
            resource_path("/v1/conversations/conv_1/items/msg_2/"),
            Some(Resource::Item("conv_1", "msg_2"))
        );
        for other in [
            "/v1/conversationsx",
            "/v1/conversations//items",
            "/v1/conversations/conv_1/other",
            "/v1/conversations/conv_1/items/a/b",
            "/v1/responses",
        ] {
            assert_eq!(resource_path(other), None, "{other}");
        }
    }

    #[test]
    fn items_get_a_type_and_an_id_and_bad_ones_are_refused() {
        let got = items(
            Some(&json!([
                {"role": "user", "content": "hi"},
                {"type": "message", "role": "assistant", "content": "yo", "id": "msg_mine"},
                {"type": "function_call_output", "call_id": "c", "output": "4"},
            ])),
            "gw-1",
        )
        .unwrap();
        assert_eq!(got[0]["type"], "message");
        assert_eq!(got[0]["id"], "msg_gw-1_0");
        assert_eq!(got[1]["id"], "msg_mine");
        assert_eq!(got[2]["id"], "item_gw-1_2");
        assert!(items(None, "r").unwrap().is_empty());
        let code = |v: Value| match items(Some(&v), "r") {
            Err(GatewayError::Body(b)) => (b.code, b.param),
            other => panic!("{other:?}"),
        };
        assert_eq!(code(json!("x")), ("invalid_type", Some("items".into())));
        assert_eq!(code(json!([1])), ("invalid_type", Some("items[0]".into())));
        assert_eq!(
            code(json!([{"content": "no type"}])),
            ("missing_parameter", Some("items[0]".into()))
        );
        assert_eq!(
            code(json!([{"type": "message", "content": "no role"}])),
            ("missing_parameter", Some("items[0]".into()))
        );
        assert_eq!(
            code(json!([{"role": "user", "content": "x", "id": 3}])),
            ("invalid_type", Some("items[0]".into()))
        );
        let many: Vec<Value> = (0..21).map(|i| said(&i.to_string())).collect();
        assert_eq!(code(json!(many)), ("invalid_value", Some("items".into())));
    }

    #[test]
    fn metadata_is_bounded() {
        assert_eq!(metadata(None).unwrap(), None);
        assert!(metadata(Some(&json!({"k": "v"}))).unwrap().is_some());
        let long_key = "k".repeat(65);
        let many: Map<String, Value> = (0..17).map(|i| (i.to_string(), json!("v"))).collect();
        for bad in [
            json!("x"),
            json!({"k": 1}),
            json!({"k": "v".repeat(513)}),
            json!({ long_key: "v" }),
            Value::Object(many),
        ] {
            assert!(metadata(Some(&bad)).is_err(), "{bad}");
        }
    }

    #[test]
    fn changes_move_the_revision_on_and_are_owned() {
        let local = ResponseStore::new(StoreLimits::DEFAULT);
        let id = made(&local, None, "gw-a");
        assert_eq!(id, "conv_gw-a");
        let add = |t: &str| {
            let new = items(Some(&json!([said(t)])), &format!("gw-{t}")).unwrap();
            block_on(update(&local, None, &id, None, append(new)))
        };
        add("second").unwrap();
        let r = add("third").unwrap();
        assert_eq!(
            (r.revision, texts(&r)),
            (3, vec!["first".into(), "second".into(), "third".into()])
        );
        let meta: Map<String, Value> = [("topic".to_owned(), json!("harbour"))]
            .into_iter()
            .collect();
        let r = block_on(update(&local, None, &id, None, set_metadata(meta))).unwrap();
        assert_eq!(
            (r.revision, &r.response["metadata"]["topic"]),
            (4, &json!("harbour"))
        );
        let second = r.input[1]["id"].as_str().unwrap().to_owned();
        let r = block_on(update(&local, None, &id, None, remove_item(&second))).unwrap();
        assert_eq!(texts(&r), vec!["first".to_owned(), "third".into()]);
        let again = block_on(update(&local, None, &id, None, remove_item(&second))).unwrap();
        assert_eq!(texts(&again), texts(&r));
        assert!(matches!(
            item(&again, &second),
            Err(GatewayError::ItemNotFound { .. })
        ));
        // Another tenant's, or not a conversation: not found.
        assert!(matches!(
            block_on(find(&local, None, &id, Some("acme"))),
            Err(GatewayError::ConversationNotFound { .. })
        ));
        local.insert(StoredResponse::new(
            "conv_fake".into(),
            None,
            vec![],
            vec![],
            json!({"object": "response"}),
        ));
        assert!(block_on(find(&local, None, "conv_fake", None)).is_err());
        // A conversation is not a response: not continued as one.
        assert!(local.turns(&id, None).is_err());
        // Counted once however often it changed; gone with its deletion.
        assert_eq!((local.stats().0, local.conversations()), (2, 1));
        local.delete(&id);
        assert_eq!((local.stats().0, local.conversations()), (1, 0));
    }

    #[test]
    fn a_conversation_stays_within_one_record() {
        let local = ResponseStore::new(StoreLimits {
            max_bytes: 64 << 10,
            ..StoreLimits::DEFAULT
        });
        let id = made(&local, None, "gw-b");
        let big = vec![said(&"x".repeat(5 << 10))];
        block_on(update(&local, None, &id, None, append(big.clone()))).unwrap();
        let err = block_on(update(&local, None, &id, None, append(big))).unwrap_err();
        assert!(
            matches!(err, GatewayError::ConversationFull { .. }),
            "{err:?}"
        );
        assert_eq!(err.status(), 413);
        // Unchanged.
        assert_eq!(local.peek(&id).unwrap().revision, 2);
    }

    #[test]
    fn two_replicas_changing_one_conversation_lose_neither_change() {
        let shared = FakeShared::default();
        let (a, b) = (
            ResponseStore::new(StoreLimits::DEFAULT),
            ResponseStore::new(StoreLimits::DEFAULT),
        );
        let id = made(&a, Some(&shared), "gw-c");
        // B reads it from the shared store and adds to it.
        let from_b = items(Some(&json!([said("from b")])), "gw-b1").unwrap();
        block_on(update(&b, Some(&shared), &id, None, append(from_b))).unwrap();
        // A adds a turn to its own copy at once (still revision 1 there), as an answer's end
        // does: its revision 2 is not the shared store's. Shared, the turn is added on the
        // shared store's revision 2 (B's), and the result replaces A's copy.
        let change = append(items(Some(&json!([said("from a")])), "gw-a1").unwrap());
        let here = change_here(&a, &id, None, &change).unwrap();
        assert_eq!((here.revision, texts(&here).len()), (2, 2));
        let merged = block_on(share(&a, &shared, &id, None, &change)).unwrap();
        assert_eq!(merged.revision, 3);
        assert_eq!(
            texts(&merged),
            vec!["first".to_owned(), "from b".into(), "from a".into()]
        );
        assert_eq!(a.peek(&id).unwrap().revision, 3);
        // Made again (a write whose outcome was not known), the turn is not added twice.
        let again = block_on(share(&a, &shared, &id, None, &change)).unwrap();
        assert_eq!(texts(&again).len(), 3);
        // B sees both.
        let r = block_on(find(&b, Some(&shared), &id, None)).unwrap();
        assert_eq!(texts(&r).len(), 3);
        // Deleted through B: A's next change finds it gone, and drops its copy.
        block_on(crate::response_store::remove(&b, Some(&shared), &id));
        assert!(matches!(
            block_on(share(&a, &shared, &id, None, &change)),
            Err(GatewayError::ConversationNotFound { .. })
        ));
        assert!(a.peek(&id).is_none());
        // The shared store restarted empty: A's copy is the base, and the change goes there.
        let id = made(&a, Some(&shared), "gw-e");
        shared.turns.lock().clear();
        let add = append(items(Some(&json!([said("after")])), "gw-e1").unwrap());
        block_on(update(&a, Some(&shared), &id, None, add)).unwrap();
        let r = block_on(find(&b, Some(&shared), &id, None)).unwrap();
        assert_eq!(
            (r.revision, texts(&r)),
            (2, vec!["first".to_owned(), "after".into()])
        );
        // The shared store away: the change is made here.
        let id = made(&a, Some(&shared), "gw-d");
        shared
            .down
            .store(true, std::sync::atomic::Ordering::Relaxed);
        let r = block_on(update(
            &a,
            Some(&shared),
            &id,
            None,
            append(items(Some(&json!([said("offline")])), "gw-d1").unwrap()),
        ))
        .unwrap();
        assert_eq!(r.revision, 2);
        assert_eq!(a.pending.len(), 1);
        // Back, with a change through B first (on its revision 1, without A's): A's change,
        // kept, is made there on B's, and neither is lost.
        shared
            .down
            .store(false, std::sync::atomic::Ordering::Relaxed);
        let from_b = append(items(Some(&json!([said("b meanwhile")])), "gw-d2").unwrap());
        block_on(update(&b, Some(&shared), &id, None, from_b)).unwrap();
        block_on(retry(&a, &shared));
        assert!(a.pending.is_empty());
        let r = block_on(find(&b, Some(&shared), &id, None)).unwrap();
        assert_eq!(
            texts(&r),
            vec!["first".to_owned(), "b meanwhile".into(), "offline".into()]
        );
        assert_eq!(texts(&a.peek(&id).unwrap()), texts(&r));
    }

    #[test]
    fn a_turn_of_a_conversation_is_sent_with_its_items() {
        let local = ResponseStore::new(StoreLimits::DEFAULT);
        let id = made(&local, None, "gw-e");
        let body = json!({"model": "m", "conversation": id, "input": "next", "store": false});
        let p = block_on(prepare(
            &local,
            None,
            body.to_string().as_bytes(),
            None,
            1 << 20,
        ))
        .unwrap();
        let sent: Value = serde_json::from_slice(&p.body.unwrap()).unwrap();
        assert!(sent.get("conversation").is_none(), "{sent}");
        assert_eq!(sent["input"][0]["content"], "first");
        assert_eq!(sent["input"][1]["content"][0]["text"], "next");
        assert_eq!(p.stored.unwrap().conversation.as_deref(), Some(id.as_str()));
        // Read for the conversation even when not stored.
        let c = p.capture.unwrap();
        assert_eq!((c.keeps(), c.conversation()), (false, Some(id.as_str())));
        let object = json!({"model": "m", "conversation": {"id": id}, "input": "x"});
        assert!(block_on(prepare(
            &local,
            None,
            object.to_string().as_bytes(),
            None,
            1 << 20
        ))
        .is_ok());
        let code = |v: Value| match block_on(prepare(
            &local,
            None,
            v.to_string().as_bytes(),
            None,
            1 << 20,
        )) {
            Err(e) => (e.error_type(), e.status()),
            Ok(_) => panic!("{v} accepted"),
        };
        assert_eq!(
            code(json!({"conversation": id, "previous_response_id": "resp_1"})),
            ("invalid_value", 400)
        );
        assert_eq!(code(json!({"conversation": 3})), ("invalid_type", 400));
        assert_eq!(
            code(json!({"conversation": "conv_none"})),
            ("conversation_not_found", 404)
        );
        assert_eq!(
            code(json!({"conversation": id, "input": "x".repeat(2 << 20)})),
            ("conversation_too_large", 413)
        );
        // A conversation is not a previous response.
        assert_eq!(
            code(json!({"previous_response_id": id})),
            ("previous_response_not_found", 400)
        );
    }
}
