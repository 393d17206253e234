//! What kvgate gateway replicas and workers share through Redis (or Valkey: the same protocol),
//! and nothing else: the key layout, the records, and the few operations on them. Owns no
//! background task (the gateway and the worker run their own loops around [`Store`]) and knows
//! nothing of rules, profiles or routing — the rules document is opaque text here.
//!
//! Keys (prefix `P`, default `kvgate`; every record is JSON):
//!
//! | key | type | what | lifetime |
//! |---|---|---|---|
//! | `P:rules` | hash `version`, `sha256`, `text`, `updated_at_ms`, `by` | the rules document (TOML) | until replaced (compare-and-set on `version`) |
//! | `P:rules:changed` | pub/sub channel | the new version, on every write | — |
//! | `P:workers` | set of ids | registered workers | members whose record is gone are removed by readers |
//! | `P:worker:<id>` | string: [`WorkerRecord`] | one registration | `PX` lease, renewed by the worker |
//! | `P:gateways` | set of ids | gateway replicas | as `P:workers` |
//! | `P:gateway:<id>` | string: [`GatewayRecord`] | a replica's ticket-signing public key | `PX` lease, renewed by the replica |
//! | `P:load:<id>` | hash worker id → `"<in_flight> <active_tokens> <prefill_tokens>"`, and `#seq` → the last published decision number the table covers | one replica's load per worker | `PX` lease, rewritten by the replica |
//! | `P:holdings` | pub/sub channel: [`SharedHolding`] | a replica's KV-exact decision: its routing-time holding (prompt keys → chosen worker) and the load it reserved there, for the others' placement | — (the receiver applies the TTLs) |
//! | `P:claims:<id>` | sorted set, member `"<replica>\|<added cost>\|<claim id>"`, score = expiry (ms, Redis clock) | the live claimed placements on one worker ([`Store::claim`]) | members pruned by each claim; the key `PX` the claim TTL |
//! | `P:response:<id>` | string: a stored Responses API turn (opaque JSON, the gateway's), or [`RESPONSE_DELETED`] | one replica's stored answer, readable by every replica ([`Store::put_response`]; a background response's record is replaced as it moves on, by the replica running it: [`Store::replace_response`]) | `PX` the idle TTL, renewed by each read (`GETEX`) |
//! | `P:responses` | sorted set, member = a stored turn's id, score = its last use (ms, the replicas' clocks) | the stored turns, least recently used first: what goes out when they are over the budget | members removed by eviction, deletion, or past the idle TTL (at the next store) |
//! | `P:responses:size` | hash id → bytes | each listed turn's size | as `P:responses` |
//! | `P:responses:bytes` | string, integer | the listed turns' bytes (≤ the budget after each store) | — |
//! | `P:responses:deleted` | pub/sub channel: a deleted turn's id | every replica drops its copy at once ([`Store::response_deletions`]) | — |
//! | `P:responses:cancel` | pub/sub channel: a background response's id | the replica running it cancels it ([`Store::cancel_response`]) | — |
//! | `P:cancel:<id>` | string `1` | a cancel asked for the background response `id`, for the replica running it to find at its next check when it missed the message ([`Store::cancels_asked`]) | `PX` the idle TTL |
//! | `P:events:<id>` | stream: entry `<n + 1>-0` = event `n` of a streamed background response (field `e`: its SSE text), then one entry with field `end` | another replica resumes its stream from there ([`Store::append_events`], [`Store::events_after`]); at most [`MAX_STREAM_EVENTS`] entries (`MAXLEN ~`) | `PX` [`EVENTS_TTL`] after the last append |
//! | `P:lead:<block key>` | string `"<replica>\|<worker id>"` | the worker a replica just placed a prompt with this chain key on ([`Store::claim`]) | `PX` the claim TTL |
//!
//! Every write that must be atomic is one Lua script (`EVALSHA`) or one `MULTI` pipeline, so a
//! reader never sees half of it. Costs: rules read/write O(document); listing registrations or
//! load O(members) in one round trip each (`SMEMBERS`, then one pipeline).

use std::collections::BTreeMap;
use std::time::Duration;

use futures::StreamExt;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// The crate's error.
#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    /// The URL is not `redis://` / `rediss://` or does not parse.
    #[error("cluster url {url:?}: {detail}")]
    Url { url: String, detail: String },
    /// Redis could not be reached or answered an error.
    #[error("redis: {0}")]
    Redis(String),
    /// A compare-and-set lost: the document is at `current`.
    #[error("the rules changed meanwhile: the cluster is at version {current}")]
    Conflict { current: u64 },
    /// A record in Redis does not parse.
    #[error("malformed {what} in redis: {detail}")]
    Malformed { what: &'static str, detail: String },
}

impl ClusterError {
    /// Stable name (metric label, error code).
    pub fn error_type(&self) -> &'static str {
        match self {
            ClusterError::Url { .. } => "cluster_url",
            ClusterError::Redis(_) => "cluster_unavailable",
            ClusterError::Conflict { .. } => "rules_conflict",
            ClusterError::Malformed { .. } => "cluster_malformed",
        }
    }
}

impl From<redis::RedisError> for ClusterError {
    fn from(e: redis::RedisError) -> Self {
        ClusterError::Redis(e.to_string())
    }
}

pub type Result<T> = std::result::Result<T, ClusterError>;

/// The rules document as stored.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RulesDoc {
    /// ≥ 1; every accepted write adds one.
    pub version: u64,
    /// SHA-256 (hex) of `text`.
    pub sha256: String,
    /// The rules file (TOML).
    pub text: String,
}

impl RulesDoc {
    /// A document for `text` at `version`.
    pub fn new(version: u64, text: String) -> RulesDoc {
        RulesDoc {
            version,
            sha256: hex::encode(Sha256::digest(text.as_bytes())),
            text,
        }
    }
}

/// A worker's registration (`kvgate worker --register`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WorkerRecord {
    /// Worker id (route tickets name it).
    pub id: String,
    /// Base URL the gateways reach it at.
    pub url: String,
    /// Its receipt-signing key id and raw public key (hex), for auditors.
    pub key_id: String,
    pub public_key_hex: String,
    /// Its prompt-profile identity digest.
    pub profile_digest: String,
    /// Labels pools select on.
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    /// What serves behind the URL, as a rules file's `[[workers]] kind` names it (`openai`,
    /// `llama_cpp`: a `kvgate sidecar` in front of a native engine); absent: a kvgate worker.
    /// Absent from a kvgate worker's record, so replicas older than this field still read it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
}

/// A gateway replica's public ticket key (the private key never leaves its host).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GatewayRecord {
    pub gateway_id: String,
    pub key_id: String,
    pub public_key_hex: String,
}

/// What one replica's KV-exact decision took on `worker`, published so the other replicas see
/// it at once: the routing-time holding (the prompt's block keys, so concurrent requests with
/// the same new prefix follow it; empty when none was taken) and the load it reserved there
/// (so two replicas placing new prompts at the same moment do not both take the same idle
/// worker). Unknown fields are ignored (a newer replica's message still applies).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SharedHolding {
    pub replica: String,
    pub worker: String,
    /// The prompt's block keys, in chain order (empty: no holding was taken).
    pub keys: Vec<u64>,
    /// How long the holding counts (0: no holding).
    pub ttl_ms: u64,
    /// The reserved load: prompt tokens the worker must still compute for this request, and
    /// the output tokens it asked for (0 and 0 from a replica older than these fields).
    #[serde(default)]
    pub prefill_tokens: u64,
    #[serde(default)]
    pub decode_tokens: u64,
    /// The publishing replica's number for this decision (1, 2, …; 0 from a replica older
    /// than this field). Its load table names the last number it covers ([`FleetLoad`]), so a
    /// receiver stops counting the reservation once the table counts the request.
    #[serde(default)]
    pub seq: u64,
}

/// The other replicas' load tables, summed per worker, and the last published decision number
/// each table covers (`P:load:<id>` field `#seq`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FleetLoad {
    pub load: BTreeMap<String, Load>,
    pub covered: BTreeMap<String, u64>,
}

/// The `P:load:<id>` field holding the table's covered decision number (not a worker id: a
/// worker id is never `#seq`, the table skips such a worker).
pub const LOAD_SEQ_FIELD: &str = "#seq";

/// One replica's load on one worker.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Load {
    pub in_flight: u64,
    pub active_tokens: u64,
    /// The part of `active_tokens` still to prefill (uncached prompt tokens before the first
    /// byte): a reader counts it as queued prefill, the rest as decode. A table written without
    /// it (an older replica) reads 0: all its active tokens count as decode.
    pub prefill_tokens: u64,
}

/// The key names under one prefix.
#[derive(Clone, Debug)]
pub struct Keys {
    prefix: String,
}

impl Keys {
    pub fn new(prefix: &str) -> Keys {
        Keys {
            prefix: prefix.to_string(),
        }
    }
    pub fn rules(&self) -> String {
        format!("{}:rules", self.prefix)
    }
    pub fn rules_channel(&self) -> String {
        format!("{}:rules:changed", self.prefix)
    }
    pub fn workers(&self) -> String {
        format!("{}:workers", self.prefix)
    }
    pub fn worker(&self, id: &str) -> String {
        format!("{}:worker:{id}", self.prefix)
    }
    pub fn gateways(&self) -> String {
        format!("{}:gateways", self.prefix)
    }
    pub fn gateway(&self, id: &str) -> String {
        format!("{}:gateway:{id}", self.prefix)
    }
    pub fn load(&self, id: &str) -> String {
        format!("{}:load:{id}", self.prefix)
    }
    pub fn holdings_channel(&self) -> String {
        format!("{}:holdings", self.prefix)
    }
    pub fn claims(&self, worker: &str) -> String {
        format!("{}:claims:{worker}", self.prefix)
    }
    pub fn lead(&self, key: u64) -> String {
        format!("{}:lead:{key}", self.prefix)
    }
    pub fn response(&self, id: &str) -> String {
        format!("{}:response:{id}", self.prefix)
    }
    /// What every `P:response:<id>` begins with.
    pub fn response_prefix(&self) -> String {
        format!("{}:response:", self.prefix)
    }
    pub fn responses(&self) -> String {
        format!("{}:responses", self.prefix)
    }
    pub fn response_sizes(&self) -> String {
        format!("{}:responses:size", self.prefix)
    }
    pub fn response_bytes(&self) -> String {
        format!("{}:responses:bytes", self.prefix)
    }
    /// The channel a deletion's id is published on ([`Store::retire_response`]).
    pub fn response_deletions(&self) -> String {
        format!("{}:responses:deleted", self.prefix)
    }
    /// A streamed background response's events ([`Store::append_events`]).
    pub fn events(&self, id: &str) -> String {
        format!("{}:events:{id}", self.prefix)
    }
    /// The channel a background response's cancel is published on
    /// ([`Store::cancel_response`]).
    pub fn response_cancels(&self) -> String {
        format!("{}:responses:cancel", self.prefix)
    }
    /// A background response's cancel, kept for the replica running it
    /// ([`Store::cancel_response`], [`Store::cancels_asked`]).
    pub fn response_cancel(&self, id: &str) -> String {
        format!("{}:cancel:{id}", self.prefix)
    }
}

/// Stores a turn unless its id is taken (with ARGV[7] `1`: replaces it unless it was deleted;
/// with `2`, a conversation's record at revision ARGV[9]: replaces it when it holds the revision
/// before (read from the record's start, `{"revision":N,`) or nothing, else not: -1 when it was
/// deleted, 0 when it holds another revision),
/// lists it, and keeps the listed turns within the budget (see [`Store::put_response`]).
/// KEYS: `P:response:<id>`, `P:responses`, `P:responses:bytes`, `P:responses:size`.
/// ARGV: id, value, TTL ms, budget bytes (0: none), now ms, `P:response:`, mode (`0`/`1`/`2`),
/// [`RESPONSE_DELETED`], revision.
/// Returns 0 when the id was taken (or deleted), else 1 + the turns evicted.
const PUT_RESPONSE: &str = r#"
if ARGV[7] == '1' then
  if redis.call('GET', KEYS[1]) == ARGV[8] then return 0 end
  redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
elseif ARGV[7] == '2' then
  local cur = redis.call('GET', KEYS[1])
  if cur == ARGV[8] then return -1 end
  if cur and tonumber(string.match(cur, '^{"revision":(%d+)') or '0') ~= tonumber(ARGV[9]) - 1 then
    return 0
  end
  redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
elseif not redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3], 'NX') then return 0 end
local now = tonumber(ARGV[5])
local len = string.len(ARGV[2])
local before = tonumber(redis.call('HGET', KEYS[4], ARGV[1]) or '0')
redis.call('ZADD', KEYS[2], now, ARGV[1])
redis.call('HSET', KEYS[4], ARGV[1], len)
redis.call('INCRBY', KEYS[3], len - before)
local function forget(id)
  local n = tonumber(redis.call('HGET', KEYS[4], id) or '0')
  redis.call('HDEL', KEYS[4], id)
  redis.call('ZREM', KEYS[2], id)
  redis.call('DECRBY', KEYS[3], n)
end
local stale = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now - tonumber(ARGV[3]), 'LIMIT', 0, 64)
for _, id in ipairs(stale) do forget(id) end
local budget = tonumber(ARGV[4])
local evicted = 0
if budget > 0 then
  while tonumber(redis.call('GET', KEYS[3]) or '0') > budget do
    local oldest = redis.call('ZRANGE', KEYS[2], 0, 0)
    if #oldest == 0 or oldest[1] == ARGV[1] then break end
    forget(oldest[1])
    redis.call('DEL', ARGV[6] .. oldest[1])
    evicted = evicted + 1
  end
end
return 1 + evicted
"#;

/// Replaces a stored turn by [`RESPONSE_DELETED`], unlists it and publishes its id (see
/// [`Store::retire_response`]). KEYS as [`PUT_RESPONSE`], then `P:responses:deleted`; ARGV:
/// id, TTL ms, [`RESPONSE_DELETED`]. Returns the old value.
const RETIRE_RESPONSE: &str = r#"
local old = redis.call('SET', KEYS[1], ARGV[3], 'PX', ARGV[2], 'GET')
local n = redis.call('HGET', KEYS[4], ARGV[1])
if n then
  redis.call('HDEL', KEYS[4], ARGV[1])
  redis.call('ZREM', KEYS[2], ARGV[1])
  redis.call('DECRBY', KEYS[3], tonumber(n))
end
redis.call('PUBLISH', KEYS[5], ARGV[1])
return old
"#;

/// Appends a streamed background response's events to its stream, skipping those it already
/// has (see [`Store::append_events`]). KEYS: `P:events:<id>`. ARGV: `MAXLEN ~` bound, TTL ms,
/// the first event's number, `1` to end the stream after them (else `0`), then the events'
/// texts. Returns the entries added.
const APPEND_EVENTS: &str = r#"
local top = redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', 1)
local last = 0
if #top > 0 then last = tonumber(string.match(top[1][1], '^(%d+)')) end
local first = tonumber(ARGV[3])
local added = 0
local function add(id, field, value)
  if id > last then
    redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[1], id .. '-0', field, value)
    last = id
    added = added + 1
  end
end
for i = 5, #ARGV do add(first + i - 4, 'e', ARGV[i]) end
if ARGV[4] == '1' then add(first + #ARGV - 3, 'end', '1') end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return added
"#;

/// How [`PUT_RESPONSE`] writes a record.
#[derive(Clone, Copy, Debug)]
enum Write {
    /// Unless the id is taken.
    New,
    /// Over what the id holds, unless it was deleted.
    Replace,
    /// A conversation's record at this revision: over the revision before only.
    Revision(u64),
}

/// What [`Store::swap_response`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Swapped {
    /// Written; that many other records evicted to stay within the budget.
    Written(u64),
    /// Not written: the key holds another revision than the one before.
    Stale,
    /// Not written: the record was deleted.
    Deleted,
}

/// The value a deleted stored response leaves under `P:response:<id>` for its TTL, so that the
/// replicas holding a copy learn of the deletion ([`Store::retire_response`]).
pub const RESPONSE_DELETED: &str = "deleted";

/// The most entries one background response's event stream keeps in Redis (`MAXLEN ~`).
pub const MAX_STREAM_EVENTS: u64 = 65_536;

/// How long a background response's event stream stays after its last append.
pub const EVENTS_TTL: Duration = Duration::from_secs(300);

/// One entry of a background response's event stream ([`Store::events_after`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StreamEntry {
    /// Event `n` (its sequence number) and its SSE text.
    Event(u64, String),
    /// The stream ended; no event `n` or later.
    End(u64),
}

/// `XRANGE`'s answer as entries; anything not shaped as this module writes is skipped.
fn stream_entries(raw: redis::Value) -> Vec<StreamEntry> {
    let text = |v: &redis::Value| -> Option<String> {
        match v {
            redis::Value::BulkString(b) => String::from_utf8(b.clone()).ok(),
            redis::Value::SimpleString(s) => Some(s.clone()),
            _ => None,
        }
    };
    let redis::Value::Array(items) = raw else {
        return Vec::new();
    };
    items
        .iter()
        .filter_map(|item| {
            let redis::Value::Array(pair) = item else {
                return None;
            };
            let [id, fields] = pair.as_slice() else {
                return None;
            };
            let n = text(id)?
                .strip_suffix("-0")?
                .parse::<u64>()
                .ok()?
                .checked_sub(1)?;
            let redis::Value::Array(fields) = fields else {
                return None;
            };
            match (
                fields.first().and_then(text).as_deref(),
                fields.get(1).and_then(text),
            ) {
                (Some("e"), Some(event)) => Some(StreamEntry::Event(n, event)),
                (Some("end"), _) => Some(StreamEntry::End(n)),
                _ => None,
            }
        })
        .collect()
}

/// Atomic select-and-reserve (see [`Store::claim`]).
/// KEYS: `P:claims:<w>` for the K candidates, then `P:lead:<key>` for the prompt's sampled chain
/// keys, deepest first. ARGV: 1 replica, 2 ttl_ms, 3 added cost, 4 claim id, 5 credit per
/// block, 6 K, 7 the `P:claims:` prefix, 8 the other admissible workers' costs (`"<id> <cost>\n"`
/// each), 9 the leads' ttl_ms, 10 what one block of a followed lead takes off the added cost,
/// then the K candidate ids, the K candidate costs, and the sampled depths (one per lead key).
/// Returns the chosen worker id and the lead depth credited to it (0 when it is not the lead's
/// worker).
const CLAIM: &str = r"
local me, ttl, added = ARGV[1], tonumber(ARGV[2]), ARGV[3]
local credit, K = tonumber(ARGV[5]) or 0, tonumber(ARGV[6])
local M = #KEYS - K
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local lead, lead_who, lead_depth = nil, nil, 0
for j = 1, M do
  local v = redis.call('GET', KEYS[K + j])
  if v then
    local who, w = string.match(v, '^([^|]*)|(.*)$')
    if who ~= nil and who ~= me then
      lead, lead_who, lead_depth = w, who, tonumber(ARGV[10 + 2 * K + j]) or 0
      break
    end
  end
end
local ids, costs, keys = {}, {}, {}
for i = 1, K do
  ids[i], costs[i], keys[i] = ARGV[10 + i], tonumber(ARGV[10 + K + i]) or 0, KEYS[i]
end
if lead then
  local found = false
  for i = 1, K do if ids[i] == lead then found = true end end
  if not found then
    for w, c in string.gmatch(ARGV[8], '([^ \n]+) (%d+)') do
      if w == lead then
        ids[K + 1], costs[K + 1], keys[K + 1] = w, tonumber(c), ARGV[7] .. w
        break
      end
    end
  end
end
local best, best_cost = 1, nil
for i = 1, #ids do
  local cost = costs[i]
  for _, m in ipairs(redis.call('ZRANGEBYSCORE', keys[i], now, '+inf')) do
    local who, a = string.match(m, '^([^|]*)|(%d+)|')
    if who ~= nil and who ~= me then
      local add = tonumber(a)
      if ids[i] == lead and who == lead_who then add = math.max(0, add - credit * lead_depth) end
      cost = cost + add
    end
  end
  if ids[i] == lead then cost = math.max(0, cost - credit * lead_depth) end
  if best_cost == nil or cost < best_cost then best, best_cost = i, cost end
end
-- Following a lead, this request computes only what the lead's request does not: its claim
-- adds that much less.
local credited = 0
if ids[best] == lead then
  credited = lead_depth
  local left = (tonumber(added) or 0) - (tonumber(ARGV[10]) or 0) * lead_depth
  added = string.format('%d', math.max(0, math.floor(left)))
end
redis.call('ZREMRANGEBYSCORE', keys[best], '-inf', now)
redis.call('ZADD', keys[best], now + ttl, me .. '|' .. added .. '|' .. ARGV[4])
redis.call('PEXPIRE', keys[best], ttl)
for j = 1, M do
  redis.call('SET', KEYS[K + j], me .. '|' .. ids[best], 'PX', ARGV[9])
end
return {ids[best], credited}
";

/// What a claim settled ([`Store::claim`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Claimed {
    /// The chosen worker.
    pub worker: String,
    /// When the chosen worker is another replica's lead for this prompt: the depth (in blocks)
    /// of the deepest sampled chain key that replica placed there, i.e. at least this many of
    /// the prompt's first blocks are being computed (or held) there for that replica's request.
    /// 0 otherwise.
    pub lead_blocks: u64,
}

/// At most this many candidates are claimed among (the close ones; a lead adds one more).
pub const MAX_CLAIM_CANDIDATES: usize = 8;

/// One claim ([`Store::claim`]).
#[derive(Clone, Copy, Debug)]
pub struct Claim<'a> {
    /// The claiming replica.
    pub replica: &'a str,
    /// Makes the claim unique among the replica's.
    pub id: &'a str,
    /// The close alternatives (worker id, this replica's placement cost), in its order of
    /// preference; at most [`MAX_CLAIM_CANDIDATES`] are used.
    pub candidates: &'a [(&'a str, u64)],
    /// The other admissible workers with their costs: where another replica's lead may point.
    pub others: &'a [(&'a str, u64)],
    /// What this request adds to the cost of the worker it goes to.
    pub added: u64,
    /// What one block of a prefix the worker is about to compute saves this request.
    pub credit: u64,
    /// What one block of a followed lead takes off `added` (the prefill tokens of a block the
    /// lead's request computes there: the block size; 0 keeps `added` whole).
    pub lead_saving: u64,
    /// The prompt's block keys, in chain order.
    pub keys: &'a [u64],
    /// How long the claim's added cost counts (a few times the time the published decision
    /// takes to reach the other replicas: after that they count it themselves).
    pub ttl: Duration,
    /// How long the prompt's leads count: as long as its routing-time holding (the rule's
    /// `pending_ttl_ms`), which says the same thing to the replicas that received it.
    pub lead_ttl: Duration,
}

/// The chain depths (in blocks) a claim samples, deepest first, with the key there: 1, 2, 4,
/// then every 8th block up to 512. Two prompts sharing their first `d` blocks share every
/// sampled key at depth ≤ `d` (the keys are parent-chained), so the deepest shared sample is
/// within 8 blocks of `d` (up to 512 blocks).
pub fn sample_chain(keys: &[u64]) -> Vec<(usize, u64)> {
    let mut out: Vec<(usize, u64)> = [1usize, 2, 4]
        .into_iter()
        .chain((8..=512).step_by(8))
        .take_while(|&d| d <= keys.len())
        .map(|d| (d, keys[d - 1]))
        .collect();
    out.reverse();
    out
}

/// Whether a worker id can travel in a claim's arguments (no separator characters).
fn claimable_id(id: &str) -> bool {
    !id.is_empty() && !id.contains(['|', ' ', '\n'])
}

/// The largest cost a claim carries (Lua numbers are doubles: exact below 2^53).
pub const MAX_CLAIM_COST: u64 = 1 << 50;

/// Writes the document when `P:rules` is at version ARGV[1] (`0`: absent); publishes.
const CAS_RULES: &str = r"
local cur = redis.call('HGET', KEYS[1], 'version')
if (cur == false and ARGV[1] == '0') or cur == ARGV[1] then
  redis.call('HSET', KEYS[1], 'version', ARGV[2], 'sha256', ARGV[3], 'text', ARGV[4],
             'updated_at_ms', ARGV[5], 'by', ARGV[6])
  redis.call('PUBLISH', KEYS[2], ARGV[2])
  return {1, ARGV[2]}
end
return {0, cur or '0'}
";

/// Writes the document only when `P:rules` is absent; returns what is there after.
const SEED_RULES: &str = r"
if redis.call('EXISTS', KEYS[1]) == 0 then
  redis.call('HSET', KEYS[1], 'version', ARGV[1], 'sha256', ARGV[2], 'text', ARGV[3],
             'updated_at_ms', ARGV[4], 'by', ARGV[5])
  redis.call('PUBLISH', KEYS[2], ARGV[1])
end
return redis.call('HMGET', KEYS[1], 'version', 'sha256', 'text')
";

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// Checks a cluster URL: `redis://[user:password@]host[:port][/db]` or `rediss://...` (TLS).
pub fn check_url(url: &str) -> Result<redis::Client> {
    if !(url.starts_with("redis://") || url.starts_with("rediss://")) {
        return Err(ClusterError::Url {
            url: redact(url),
            detail: "must start with redis:// or rediss://".into(),
        });
    }
    redis::Client::open(url).map_err(|e| ClusterError::Url {
        url: redact(url),
        detail: e.to_string(),
    })
}

/// `url` without its password (for logs and errors).
pub fn redact(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(s), Some(at)) if at > s => {
            let userinfo = &url[s + 3..at];
            let user = userinfo.split(':').next().unwrap_or("");
            format!("{}{user}:***{}", &url[..s + 3], &url[at..])
        }
        _ => url.to_string(),
    }
}

/// A connection to the shared store (reconnects by itself; every call has a 2 s timeout).
#[derive(Clone)]
pub struct Store {
    client: redis::Client,
    con: ConnectionManager,
    keys: Keys,
    claim_script: redis::Script,
    put_response_script: redis::Script,
    retire_response_script: redis::Script,
    append_events_script: redis::Script,
}

fn parse_doc(v: Vec<Option<String>>) -> Result<Option<RulesDoc>> {
    let mut it = v.into_iter();
    let (Some(version), sha256, text) = (
        it.next().flatten(),
        it.next().flatten(),
        it.next().flatten(),
    ) else {
        return Ok(None);
    };
    let version = version
        .parse::<u64>()
        .map_err(|e| ClusterError::Malformed {
            what: "rules version",
            detail: e.to_string(),
        })?;
    let text = text.unwrap_or_default();
    let doc = RulesDoc::new(version, text);
    if sha256.as_deref() != Some(doc.sha256.as_str()) {
        return Err(ClusterError::Malformed {
            what: "rules document",
            detail: "its sha256 does not match its text".into(),
        });
    }
    Ok(Some(doc))
}

impl Store {
    /// Connects to `url` (see [`check_url`]); keys under `prefix`.
    pub async fn connect(url: &str, prefix: &str) -> Result<Store> {
        let client = check_url(url)?;
        let cfg = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(Duration::from_secs(2)))
            .set_response_timeout(Some(Duration::from_secs(2)))
            .set_number_of_retries(1)
            .set_max_delay(Duration::from_secs(2));
        let con = tokio::time::timeout(
            Duration::from_secs(3),
            ConnectionManager::new_with_config(client.clone(), cfg),
        )
        .await
        .map_err(|_| ClusterError::Redis("connect timed out".into()))??;
        let store = Store {
            client,
            con,
            keys: Keys::new(prefix),
            claim_script: redis::Script::new(CLAIM),
            put_response_script: redis::Script::new(PUT_RESPONSE),
            retire_response_script: redis::Script::new(RETIRE_RESPONSE),
            append_events_script: redis::Script::new(APPEND_EVENTS),
        };
        // Best effort: a user whose ACL denies `SCRIPT` still claims (by `EVAL` on `NOSCRIPT`);
        // the gateway's sync tries again, and logs the error, on every tick.
        let _ = store.ensure_scripts().await;
        Ok(store)
    }

    /// Makes sure Redis holds the claim script in its script cache (`SCRIPT EXISTS`, then
    /// `SCRIPT LOAD` when it does not: a new or restarted Redis starts with an empty cache), so
    /// that a claim is one `EVALSHA` round trip rather than `EVALSHA` answered `NOSCRIPT`,
    /// `SCRIPT LOAD` and `EVALSHA` again — three round trips that, on a busy host, outlast a
    /// claim's few-millisecond timeout. Returns whether it had to load it.
    pub async fn ensure_scripts(&self) -> Result<bool> {
        let mut con = self.con.clone();
        let exists: Vec<bool> = redis::cmd("SCRIPT")
            .arg("EXISTS")
            .arg(self.claim_script.get_hash())
            .query_async(&mut con)
            .await?;
        if exists.first() == Some(&true) {
            return Ok(false);
        }
        self.claim_script.load_async(&mut con).await?;
        Ok(true)
    }

    /// The key names.
    pub fn keys(&self) -> &Keys {
        &self.keys
    }

    /// `PING`.
    pub async fn ping(&self) -> Result<()> {
        let mut con = self.con.clone();
        redis::cmd("PING").query_async::<String>(&mut con).await?;
        Ok(())
    }

    /// The rules document, if any.
    pub async fn rules(&self) -> Result<Option<RulesDoc>> {
        let mut con = self.con.clone();
        let v: Vec<Option<String>> = redis::cmd("HMGET")
            .arg(self.keys.rules())
            .arg("version")
            .arg("sha256")
            .arg("text")
            .query_async(&mut con)
            .await?;
        parse_doc(v)
    }

    /// Writes `doc` when the store has no rules yet; returns the document in force after.
    pub async fn seed_rules(&self, doc: &RulesDoc, by: &str) -> Result<RulesDoc> {
        let mut con = self.con.clone();
        let v: Vec<Option<String>> = redis::Script::new(SEED_RULES)
            .key(self.keys.rules())
            .key(self.keys.rules_channel())
            .arg(doc.version)
            .arg(&doc.sha256)
            .arg(&doc.text)
            .arg(now_ms())
            .arg(by)
            .invoke_async(&mut con)
            .await?;
        parse_doc(v)?.ok_or_else(|| ClusterError::Malformed {
            what: "rules document",
            detail: "absent right after seeding".into(),
        })
    }

    /// Writes `text` as version `expected + 1` if the stored version is `expected` (0: none);
    /// else [`ClusterError::Conflict`] with the stored version. Publishes the new version.
    pub async fn put_rules(&self, expected: u64, text: String, by: &str) -> Result<RulesDoc> {
        let doc = RulesDoc::new(expected + 1, text);
        let mut con = self.con.clone();
        let (ok, cur): (i64, String) = redis::Script::new(CAS_RULES)
            .key(self.keys.rules())
            .key(self.keys.rules_channel())
            .arg(expected)
            .arg(doc.version)
            .arg(&doc.sha256)
            .arg(&doc.text)
            .arg(now_ms())
            .arg(by)
            .invoke_async(&mut con)
            .await?;
        if ok == 1 {
            Ok(doc)
        } else {
            Err(ClusterError::Conflict {
                current: cur.parse().unwrap_or(0),
            })
        }
    }

    /// A stream of announced rules versions (its own connection; ends when it breaks).
    pub async fn rules_changes(&self) -> Result<futures::stream::BoxStream<'static, u64>> {
        Ok(self
            .messages(self.keys.rules_channel())
            .await?
            .filter_map(|p| futures::future::ready(p.parse().ok()))
            .boxed())
    }

    /// The text messages of `channel`, on a subscription connection of their own (connected
    /// within 3 s).
    async fn messages(
        &self,
        channel: String,
    ) -> Result<futures::stream::BoxStream<'static, String>> {
        let mut ps = tokio::time::timeout(Duration::from_secs(3), self.client.get_async_pubsub())
            .await
            .map_err(|_| ClusterError::Redis("pubsub connect timed out".into()))??;
        ps.subscribe(channel).await?;
        Ok(ps
            .into_on_message()
            .filter_map(|m| futures::future::ready(m.get_payload::<String>().ok()))
            .boxed())
    }

    /// The ids of stored turns deleted through any replica, as they are deleted (a subscription
    /// to `P:responses:deleted`; what it misses while disconnected, a replica learns at its next
    /// read of the turn).
    pub async fn response_deletions(&self) -> Result<futures::stream::BoxStream<'static, String>> {
        self.messages(self.keys.response_deletions()).await
    }

    /// Asks whichever replica runs the background response `id` to cancel it: `P:cancel:<id>`
    /// set for `ttl`, which that replica's periodic check reads ([`Store::cancels_asked`]: a
    /// cancel published while it was not subscribed is not lost), and the id published on
    /// `P:responses:cancel` (at once). One atomic pipeline.
    pub async fn cancel_response(&self, id: &str, ttl: Duration) -> Result<()> {
        let mut con = self.con.clone();
        redis::pipe()
            .atomic()
            .cmd("SET")
            .arg(self.keys.response_cancel(id))
            .arg(1)
            .arg("PX")
            .arg(ttl.as_millis().max(1) as u64)
            .ignore()
            .cmd("PUBLISH")
            .arg(self.keys.response_cancels())
            .arg(id)
            .ignore()
            .query_async::<()>(&mut con)
            .await?;
        Ok(())
    }

    /// Which of the background responses `ids` some replica was asked to cancel
    /// (`P:cancel:<id>`, [`Store::cancel_response`]): one `EXISTS` each, in one pipeline.
    pub async fn cancels_asked(&self, ids: &[String]) -> Result<Vec<bool>> {
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        let mut con = self.con.clone();
        let mut p = redis::pipe();
        for id in ids {
            p.cmd("EXISTS").arg(self.keys.response_cancel(id));
        }
        Ok(p.query_async::<Vec<bool>>(&mut con).await?)
    }

    /// The ids of background responses some replica was asked to cancel, as they are asked
    /// (a subscription to `P:responses:cancel`).
    pub async fn response_cancels(&self) -> Result<futures::stream::BoxStream<'static, String>> {
        self.messages(self.keys.response_cancels()).await
    }

    /// Publishes a routing-time holding (fire and forget: one `PUBLISH`).
    pub async fn publish_holding(&self, h: &SharedHolding) -> Result<()> {
        let json = serde_json::to_string(h).map_err(|e| ClusterError::Malformed {
            what: "holding",
            detail: e.to_string(),
        })?;
        let mut con = self.con.clone();
        redis::cmd("PUBLISH")
            .arg(self.keys.holdings_channel())
            .arg(json)
            .query_async::<i64>(&mut con)
            .await?;
        Ok(())
    }

    /// Atomic select-and-reserve among a decision's close alternatives (one `EVALSHA`; Redis
    /// runs one script at a time, so two replicas deciding at the same instant see each other's
    /// choice). The other replicas' live claims on a candidate add what they added to its cost
    /// (a replica's own are not counted: its view has them exactly). A *lead* — the deepest of
    /// the prompt's sampled chain keys ([`sample_chain`]) that another replica placed within
    /// its TTL — takes `credit` × its depth off its worker's cost, and brings that worker in
    /// from `others` when it is not a candidate, so a burst with one new prefix spread over
    /// replicas follows its first request. The least cost wins (ties: the earlier candidate);
    /// it is claimed for `ttl` with `added`, and every sampled key of this prompt leads there
    /// for `lead_ttl`. Returns the chosen worker id, with the lead's depth when it is the lead's
    /// worker ([`Claimed`]). Ids with `|`, space or newline make no claim (the first candidate
    /// is returned). Cost in Redis: O((candidates + 1) × their live claims
    /// + sampled depths + others).
    pub async fn claim(&self, c: &Claim<'_>) -> Result<Claimed> {
        let candidates = &c.candidates[..c.candidates.len().min(MAX_CLAIM_CANDIDATES)];
        let Some((first, _)) = candidates.first() else {
            return Err(ClusterError::Malformed {
                what: "claim",
                detail: "no candidate".into(),
            });
        };
        if !claimable_id(c.replica)
            || !claimable_id(c.id)
            || !candidates.iter().all(|(w, _)| claimable_id(w))
        {
            return Ok(Claimed {
                worker: first.to_string(),
                lead_blocks: 0,
            });
        }
        let chain = sample_chain(c.keys);
        let mut inv = self.claim_script.prepare_invoke();
        for (w, _) in candidates {
            inv.key(self.keys.claims(w));
        }
        for (_, key) in &chain {
            inv.key(self.keys.lead(*key));
        }
        let mut others = String::new();
        for (w, cost) in c.others.iter().filter(|(w, _)| claimable_id(w)) {
            others.push_str(&format!("{w} {}\n", (*cost).min(MAX_CLAIM_COST)));
        }
        inv.arg(c.replica)
            .arg(u64::try_from(c.ttl.as_millis()).unwrap_or(u64::MAX).max(1))
            .arg(c.added.min(MAX_CLAIM_COST))
            .arg(c.id)
            // credit × depth (≤ 512 = 2^9) stays below 2^50 as well.
            .arg(c.credit.min(MAX_CLAIM_COST >> 10))
            .arg(candidates.len())
            .arg(self.keys.claims(""))
            .arg(others)
            .arg(
                u64::try_from(c.lead_ttl.as_millis())
                    .unwrap_or(u64::MAX)
                    .max(1),
            )
            // lead_saving × depth (≤ 512) stays below 2^50 as well.
            .arg(c.lead_saving.min(MAX_CLAIM_COST >> 10));
        for (w, _) in candidates {
            inv.arg(*w);
        }
        for (_, cost) in candidates {
            inv.arg((*cost).min(MAX_CLAIM_COST));
        }
        for (d, _) in &chain {
            inv.arg(*d);
        }
        let mut con = self.con.clone();
        let (worker, lead_blocks): (String, u64) = inv.invoke_async(&mut con).await?;
        Ok(Claimed {
            worker,
            lead_blocks,
        })
    }

    /// The stream of every replica's published holdings (its own connection; ends when it
    /// breaks). Messages that do not parse are skipped.
    pub async fn holdings(&self) -> Result<futures::stream::BoxStream<'static, SharedHolding>> {
        Ok(self
            .messages(self.keys.holdings_channel())
            .await?
            .filter_map(|p| futures::future::ready(serde_json::from_str::<SharedHolding>(&p).ok()))
            .boxed())
    }

    async fn put_leased<T: Serialize>(
        &self,
        set: String,
        key: String,
        id: &str,
        rec: &T,
        lease: Duration,
    ) -> Result<()> {
        let json = serde_json::to_string(rec).map_err(|e| ClusterError::Malformed {
            what: "record",
            detail: e.to_string(),
        })?;
        let mut con = self.con.clone();
        redis::pipe()
            .atomic()
            .cmd("SET")
            .arg(&key)
            .arg(json)
            .arg("PX")
            .arg(lease.as_millis().max(1) as u64)
            .ignore()
            .cmd("SADD")
            .arg(&set)
            .arg(id)
            .ignore()
            .query_async::<()>(&mut con)
            .await?;
        Ok(())
    }

    async fn list_leased<T: for<'de> Deserialize<'de>>(
        &self,
        set: String,
        key_of: impl Fn(&str) -> String,
        what: &'static str,
    ) -> Result<Vec<T>> {
        let mut con = self.con.clone();
        let ids: Vec<String> = redis::cmd("SMEMBERS")
            .arg(&set)
            .query_async(&mut con)
            .await?;
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        let keys: Vec<String> = ids.iter().map(|i| key_of(i)).collect();
        let vals: Vec<Option<String>> = redis::cmd("MGET").arg(&keys).query_async(&mut con).await?;
        let mut out = Vec::new();
        let mut lapsed = Vec::new();
        for (id, v) in ids.iter().zip(vals) {
            match v {
                None => lapsed.push(id.clone()),
                Some(text) => match serde_json::from_str::<T>(&text) {
                    Ok(r) => out.push(r),
                    Err(e) => {
                        return Err(ClusterError::Malformed {
                            what,
                            detail: format!("{id}: {e}"),
                        })
                    }
                },
            }
        }
        if !lapsed.is_empty() {
            // A member whose lease lapsed: forget it (a renewal adds it back).
            let _ = redis::cmd("SREM")
                .arg(&set)
                .arg(&lapsed)
                .query_async::<i64>(&mut con)
                .await;
        }
        Ok(out)
    }

    async fn remove_leased(&self, set: String, key: String, id: &str) -> Result<()> {
        let mut con = self.con.clone();
        redis::pipe()
            .atomic()
            .cmd("DEL")
            .arg(&key)
            .ignore()
            .cmd("SREM")
            .arg(&set)
            .arg(id)
            .ignore()
            .query_async::<()>(&mut con)
            .await?;
        Ok(())
    }

    /// Stores a Responses API turn under its id for `ttl`, unless the id is taken (`SET … NX`;
    /// `Ok(None)` then), and lists it as used now (`now_ms`, this host's clock). Then, in the
    /// same script, listed turns idle past `ttl` are unlisted (their keys expired; at most 64
    /// per call), and while the listed turns' bytes exceed `budget` (0: no bound) the least
    /// recently used are deleted — so Redis holds at most about `budget` of stored turns
    /// (plus the one just stored, when it alone exceeds the budget). `Ok(Some(n))`: stored,
    /// `n` others evicted.
    pub async fn put_response(
        &self,
        id: &str,
        json: &str,
        ttl: Duration,
        budget: u64,
        now_ms: u64,
    ) -> Result<Option<u64>> {
        let n = self
            .write_response(id, json, ttl, budget, now_ms, Write::New)
            .await?;
        Ok(u64::try_from(n).ok().and_then(|n| n.checked_sub(1)))
    }

    /// [`Self::put_response`] of a conversation's record at `revision` (its JSON begins
    /// `{"revision":N,`): written over revision `revision - 1` (or nothing), else not —
    /// [`Swapped::Stale`] when the key holds another revision (another change came first),
    /// [`Swapped::Deleted`] when the conversation was deleted. One script: a compare-and-set,
    /// so each revision is written once and a change made on revision N lands only on N.
    pub async fn swap_response(
        &self,
        id: &str,
        json: &str,
        revision: u64,
        ttl: Duration,
        budget: u64,
        now_ms: u64,
    ) -> Result<Swapped> {
        Ok(
            match self
                .write_response(id, json, ttl, budget, now_ms, Write::Revision(revision))
                .await?
            {
                -1 => Swapped::Deleted,
                0 => Swapped::Stale,
                n => Swapped::Written(n.unsigned_abs() - 1),
            },
        )
    }

    /// [`Self::put_response`] replacing what the id holds, unless the turn was deleted
    /// ([`RESPONSE_DELETED`]; `Ok(None)` then): a background response's record as it moves
    /// on (`queued`, `in_progress`, its end), written by the one replica that runs it.
    pub async fn replace_response(
        &self,
        id: &str,
        json: &str,
        ttl: Duration,
        budget: u64,
        now_ms: u64,
    ) -> Result<Option<u64>> {
        let n = self
            .write_response(id, json, ttl, budget, now_ms, Write::Replace)
            .await?;
        Ok(u64::try_from(n).ok().and_then(|n| n.checked_sub(1)))
    }

    /// The write script ([`PUT_RESPONSE`]) in the mode of `how`.
    async fn write_response(
        &self,
        id: &str,
        json: &str,
        ttl: Duration,
        budget: u64,
        now_ms: u64,
        how: Write,
    ) -> Result<i64> {
        let mut con = self.con.clone();
        let (mode, revision) = match how {
            Write::New => ("0", 0),
            Write::Replace => ("1", 0),
            Write::Revision(r) => ("2", r),
        };
        let n: i64 = self
            .put_response_script
            .key(self.keys.response(id))
            .key(self.keys.responses())
            .key(self.keys.response_bytes())
            .key(self.keys.response_sizes())
            .arg(id)
            .arg(json)
            .arg(ttl.as_millis().max(1) as u64)
            .arg(budget)
            .arg(now_ms)
            .arg(self.keys.response_prefix())
            .arg(mode)
            .arg(RESPONSE_DELETED)
            .arg(revision)
            .invoke_async(&mut con)
            .await?;
        Ok(n)
    }

    /// The listed stored turns' bytes (`P:responses:bytes`).
    pub async fn response_bytes(&self) -> Result<u64> {
        let mut con = self.con.clone();
        let n: Option<i64> = redis::cmd("GET")
            .arg(self.keys.response_bytes())
            .query_async(&mut con)
            .await?;
        Ok(n.map_or(0, |n| n.max(0) as u64))
    }

    /// The stored turns `reads` (id, whole), each key's TTL renewed to `ttl`, in one round
    /// trip: a whole read gives the value (`GETEX`), a probe only its first 16 bytes
    /// (`GETRANGE` + `PEXPIRE`: enough to tell a turn from [`RESPONSE_DELETED`]); `None` where
    /// the key is absent.
    pub async fn responses(
        &self,
        reads: &[(String, bool)],
        ttl: Duration,
        now_ms: u64,
    ) -> Result<Vec<Option<String>>> {
        if reads.is_empty() {
            return Ok(Vec::new());
        }
        let ttl_ms = ttl.as_millis().max(1) as u64;
        let mut pipe = redis::pipe();
        for (id, whole) in reads {
            let key = self.keys.response(id);
            if *whole {
                pipe.cmd("GETEX").arg(&key).arg("PX").arg(ttl_ms);
            } else {
                pipe.cmd("GETRANGE").arg(&key).arg(0).arg(15);
                pipe.cmd("PEXPIRE").arg(&key).arg(ttl_ms).ignore();
            }
        }
        // Used now: last out under the budget (a deleted or unknown id is not listed); one
        // command for all of them.
        let touch = pipe.cmd("ZADD").arg(self.keys.responses()).arg("XX");
        for (id, _) in reads {
            touch.arg(now_ms).arg(id);
        }
        touch.ignore();
        let mut con = self.con.clone();
        let values = pipe.query_async::<Vec<Option<String>>>(&mut con).await?;
        // `GETRANGE` of an absent key is "".
        Ok(values
            .into_iter()
            .map(|v| v.filter(|s| !s.is_empty()))
            .collect())
    }

    /// Deletes a stored turn: [`RESPONSE_DELETED`] replaces it for `ttl` (so replicas holding a
    /// copy drop it when they next read it). Returns what was there.
    pub async fn retire_response(&self, id: &str, ttl: Duration) -> Result<Option<String>> {
        let mut con = self.con.clone();
        Ok(self
            .retire_response_script
            .key(self.keys.response(id))
            .key(self.keys.responses())
            .key(self.keys.response_bytes())
            .key(self.keys.response_sizes())
            .key(self.keys.response_deletions())
            .arg(id)
            .arg(ttl.as_millis().max(1) as u64)
            .arg(RESPONSE_DELETED)
            .invoke_async(&mut con)
            .await?)
    }

    /// Appends the events `first`, `first + 1`, … of the streamed background response `id` to
    /// `P:events:<id>` (entry ids `<n + 1>-0`), then, with `end`, the end marker after them;
    /// the key expires [`EVENTS_TTL`] after this append. One script ([`APPEND_EVENTS`]), so
    /// idempotent: entries the stream already has (a write made again after its outcome was
    /// not known, a resync from an earlier event) are skipped. Returns the entries added.
    pub async fn append_events(
        &self,
        id: &str,
        first: u64,
        events: &[String],
        end: bool,
    ) -> Result<u64> {
        let mut con = self.con.clone();
        let mut inv = self.append_events_script.prepare_invoke();
        inv.key(self.keys.events(id))
            .arg(MAX_STREAM_EVENTS)
            .arg(EVENTS_TTL.as_millis() as u64)
            .arg(first)
            .arg(if end { "1" } else { "0" });
        for e in events {
            inv.arg(e);
        }
        Ok(inv.invoke_async(&mut con).await?)
    }

    /// The entries of `P:events:<id>` from event `from` on, at most `count` (`XRANGE`).
    pub async fn events_after(
        &self,
        id: &str,
        from: u64,
        count: usize,
    ) -> Result<Vec<StreamEntry>> {
        let mut con = self.con.clone();
        let raw: redis::Value = redis::cmd("XRANGE")
            .arg(self.keys.events(id))
            .arg(format!("{}-0", from.saturating_add(1)))
            .arg("+")
            .arg("COUNT")
            .arg(count)
            .query_async(&mut con)
            .await?;
        Ok(stream_entries(raw))
    }

    /// Announces (or renews) a worker's registration for `lease`.
    pub async fn announce_worker(&self, rec: &WorkerRecord, lease: Duration) -> Result<()> {
        self.put_leased(
            self.keys.workers(),
            self.keys.worker(&rec.id),
            &rec.id,
            rec,
            lease,
        )
        .await
    }

    /// Withdraws a registration (a worker stopping cleanly).
    pub async fn withdraw_worker(&self, id: &str) -> Result<()> {
        self.remove_leased(self.keys.workers(), self.keys.worker(id), id)
            .await
    }

    /// The live registrations, by id.
    pub async fn workers(&self) -> Result<Vec<WorkerRecord>> {
        let keys = self.keys.clone();
        let mut v: Vec<WorkerRecord> = self
            .list_leased(self.keys.workers(), |i| keys.worker(i), "worker record")
            .await?;
        v.sort_by(|a, b| a.id.cmp(&b.id));
        Ok(v)
    }

    /// Publishes (or renews) a gateway replica's public key for `lease`.
    pub async fn announce_gateway(&self, rec: &GatewayRecord, lease: Duration) -> Result<()> {
        self.put_leased(
            self.keys.gateways(),
            self.keys.gateway(&rec.gateway_id),
            &rec.gateway_id,
            rec,
            lease,
        )
        .await
    }

    /// Withdraws a gateway replica (a clean stop).
    pub async fn withdraw_gateway(&self, id: &str) -> Result<()> {
        self.remove_leased(self.keys.gateways(), self.keys.gateway(id), id)
            .await?;
        let mut con = self.con.clone();
        redis::cmd("DEL")
            .arg(self.keys.load(id))
            .query_async::<i64>(&mut con)
            .await?;
        Ok(())
    }

    /// The live gateway replicas' keys.
    /// Whether replica `id`'s key record is live (its lease not lapsed): one `EXISTS`.
    pub async fn gateway_live(&self, id: &str) -> Result<bool> {
        let mut con = self.con.clone();
        let n: i64 = redis::cmd("EXISTS")
            .arg(self.keys.gateway(id))
            .query_async(&mut con)
            .await?;
        Ok(n > 0)
    }

    pub async fn gateways(&self) -> Result<Vec<GatewayRecord>> {
        let keys = self.keys.clone();
        let mut v: Vec<GatewayRecord> = self
            .list_leased(self.keys.gateways(), |i| keys.gateway(i), "gateway record")
            .await?;
        v.sort_by(|a, b| a.gateway_id.cmp(&b.gateway_id));
        Ok(v)
    }

    /// Replaces replica `id`'s load table (leased: a replica that dies leaves no load behind).
    pub async fn put_load(
        &self,
        id: &str,
        load: &BTreeMap<String, Load>,
        covered: u64,
        lease: Duration,
    ) -> Result<()> {
        let key = self.keys.load(id);
        let mut pipe = redis::pipe();
        pipe.atomic().cmd("DEL").arg(&key).ignore();
        if !load.is_empty() {
            let mut h = redis::cmd("HSET");
            h.arg(&key);
            h.arg(LOAD_SEQ_FIELD).arg(covered);
            for (w, l) in load.iter().filter(|(w, _)| w.as_str() != LOAD_SEQ_FIELD) {
                h.arg(w).arg(format!(
                    "{} {} {}",
                    l.in_flight, l.active_tokens, l.prefill_tokens
                ));
            }
            pipe.add_command(h).ignore();
            pipe.cmd("PEXPIRE")
                .arg(&key)
                .arg(lease.as_millis().max(1) as u64)
                .ignore();
        }
        let mut con = self.con.clone();
        pipe.query_async::<()>(&mut con).await?;
        Ok(())
    }

    /// Every live replica's load per worker, except `except`'s (the caller's own), summed.
    pub async fn fleet_load(&self, except: &str) -> Result<FleetLoad> {
        let mut con = self.con.clone();
        let ids: Vec<String> = redis::cmd("SMEMBERS")
            .arg(self.keys.gateways())
            .query_async(&mut con)
            .await?;
        let others: Vec<&String> = ids.iter().filter(|i| i.as_str() != except).collect();
        let mut out = FleetLoad::default();
        if others.is_empty() {
            return Ok(out);
        }
        let mut pipe = redis::pipe();
        for id in &others {
            pipe.cmd("HGETALL").arg(self.keys.load(id));
        }
        let tables: Vec<BTreeMap<String, String>> = pipe.query_async(&mut con).await?;
        for (id, t) in others.iter().zip(tables) {
            for (w, v) in t {
                if w == LOAD_SEQ_FIELD {
                    if let Ok(seq) = v.parse::<u64>() {
                        out.covered.insert(id.to_string(), seq);
                    }
                    continue;
                }
                // Another replica's table, read from the network: a field that does not parse
                // counts 0, and sums saturate (a corrupt or hostile table cannot overflow them).
                let mut it = v.split(' ').map(|x| x.parse::<u64>().unwrap_or(0));
                let e = out.load.entry(w).or_default();
                e.in_flight = e.in_flight.saturating_add(it.next().unwrap_or(0));
                let active = it.next().unwrap_or(0);
                e.active_tokens = e.active_tokens.saturating_add(active);
                // Never more prefill than active tokens, per table.
                let prefill = it.next().unwrap_or(0).min(active);
                e.prefill_tokens = e.prefill_tokens.saturating_add(prefill);
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stream_entries_are_read_as_written_and_anything_else_is_skipped() {
        use redis::Value;
        let s = |t: &str| Value::BulkString(t.as_bytes().to_vec());
        let entry =
            |id: &str, f: &str, v: &str| Value::Array(vec![s(id), Value::Array(vec![s(f), s(v)])]);
        let raw = Value::Array(vec![
            entry("1-0", "e", "data: a\n\n"),
            entry("2-0", "e", "data: b\n\n"),
            entry("3-1", "e", "not ours"),
            entry("0-0", "e", "no event -1"),
            entry("4-0", "other", "x"),
            Value::Int(3),
            entry("5-0", "end", "1"),
        ]);
        assert_eq!(
            stream_entries(raw),
            [
                StreamEntry::Event(0, "data: a\n\n".into()),
                StreamEntry::Event(1, "data: b\n\n".into()),
                StreamEntry::End(4),
            ]
        );
        assert!(stream_entries(Value::Nil).is_empty());
    }

    #[test]
    fn urls_and_redaction() {
        assert!(check_url("redis://127.0.0.1:6379").is_ok());
        assert!(check_url("rediss://user:pw@h:6380/2").is_ok());
        assert!(matches!(
            check_url("http://h"),
            Err(ClusterError::Url { .. })
        ));
        assert_eq!(
            redact("redis://alice:s3cret@h:1/0"),
            "redis://alice:***@h:1/0"
        );
        assert_eq!(redact("redis://h:1"), "redis://h:1");
    }

    #[test]
    fn docs_hash_their_text_and_records_pin_their_json() {
        let d = RulesDoc::new(3, "x = 1\n".into());
        assert_eq!(d.sha256, hex::encode(Sha256::digest(b"x = 1\n")));
        assert!(parse_doc(vec![Some("3".into()), Some("bad".into()), Some("x".into())]).is_err());
        assert_eq!(parse_doc(vec![None, None, None]).unwrap(), None);
        let r = WorkerRecord {
            id: "w1".into(),
            url: "http://10.0.0.1:8101".into(),
            key_id: "00".into(),
            public_key_hex: "ab".into(),
            profile_digest: "cd".into(),
            labels: BTreeMap::from([("zone".into(), "a".into())]),
            kind: None,
        };
        assert_eq!(
            serde_json::to_string(&r).unwrap(),
            r#"{"id":"w1","url":"http://10.0.0.1:8101","key_id":"00","public_key_hex":"ab","profile_digest":"cd","labels":{"zone":"a"}}"#
        );
    }

    #[test]
    fn shared_holdings_pin_their_json_and_read_older_and_newer_messages() {
        let h = SharedHolding {
            replica: "gw-1".into(),
            worker: "w3".into(),
            keys: vec![7, 9],
            ttl_ms: 2000,
            prefill_tokens: 1200,
            decode_tokens: 8,
            seq: 42,
        };
        let json = serde_json::to_string(&h).unwrap();
        assert_eq!(
            json,
            r#"{"replica":"gw-1","worker":"w3","keys":[7,9],"ttl_ms":2000,"prefill_tokens":1200,"decode_tokens":8,"seq":42}"#
        );
        assert_eq!(serde_json::from_str::<SharedHolding>(&json).unwrap(), h);
        // A replica from before the reservation fields: a holding, no reserved load.
        let old: SharedHolding =
            serde_json::from_str(r#"{"replica":"gw-1","worker":"w3","keys":[7],"ttl_ms":5}"#)
                .unwrap();
        assert_eq!((old.prefill_tokens, old.decode_tokens, old.seq), (0, 0, 0));
        // A newer replica's extra field does not make the message unreadable.
        let newer: SharedHolding = serde_json::from_str(
            r#"{"replica":"gw-1","worker":"w3","keys":[],"ttl_ms":0,"prefill_tokens":3,"decode_tokens":4,"later":true}"#,
        )
        .unwrap();
        assert_eq!((newer.prefill_tokens, newer.decode_tokens), (3, 4));
    }
}
