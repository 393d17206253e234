//! vLLM's KV-event wire format, decoded: one ZMQ message's payload is a msgpack `KVEventBatch`
//! (vLLM `vllm/distributed/kv_events.py`, checked against vLLM 0.34.0's own classes by
//! `scripts/check-vllm-events.sh`):
//!
//! - the batch is `[ts, events]` or `[ts, events, data_parallel_rank]` (msgspec `array_like`);
//!   a map `{"ts", "events", "data_parallel_rank"}` (older releases) is read too;
//! - each event is a map tagged by `"type"`: `BlockStored` (`block_hashes`,
//!   `parent_block_hash`, `token_ids`, `block_size`, `lora_id`, `medium`, `lora_name`,
//!   `extra_keys`, `group_idx`, `lookahead_token_ids`, and fields read by no one here),
//!   `BlockRemoved` (`block_hashes`, `medium`, `group_idx`), `AllBlocksCleared`;
//! - a block hash is bytes (vLLM's default) or an integer (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`).
//!
//! The msgpack reader is this module's own (the format is small): it bounds nesting (32) and
//! never reserves more elements than bytes remain, so a malformed payload is an error, not an
//! allocation. An event that cannot be read is reported as such and the others are kept.

use std::fmt;

/// Deepest msgpack nesting accepted (a batch is 4–5 levels deep).
const MAX_DEPTH: usize = 32;

/// One msgpack value.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    Nil,
    Bool(bool),
    Int(i128),
    Float(f64),
    Str(String),
    Bin(Vec<u8>),
    Array(Vec<Value>),
    Map(Vec<(Value, Value)>),
    /// An extension value (type and bytes are not needed here).
    Ext,
}

/// Why a payload or an event could not be read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Malformed(pub String);

impl fmt::Display for Malformed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

fn bad(what: impl Into<String>) -> Malformed {
    Malformed(what.into())
}

struct Reader<'a> {
    b: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], Malformed> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|&e| e <= self.b.len())
            .ok_or_else(|| bad("msgpack: truncated"))?;
        let s = &self.b[self.pos..end];
        self.pos = end;
        Ok(s)
    }

    fn uint(&mut self, n: usize) -> Result<u64, Malformed> {
        let s = self.take(n)?;
        Ok(s.iter().fold(0u64, |acc, &x| (acc << 8) | u64::from(x)))
    }

    fn int(&mut self, n: usize) -> Result<i64, Malformed> {
        let u = self.uint(n)?;
        let shift = 64 - 8 * n as u32;
        Ok(((u << shift) as i64) >> shift)
    }

    fn remaining(&self) -> usize {
        self.b.len() - self.pos
    }

    fn text(&mut self, n: usize) -> Result<Value, Malformed> {
        let s = self.take(n)?;
        String::from_utf8(s.to_vec())
            .map(Value::Str)
            .map_err(|_| bad("msgpack: a string is not UTF-8"))
    }

    fn array(&mut self, n: usize, depth: usize) -> Result<Value, Malformed> {
        if n > self.remaining() {
            return Err(bad("msgpack: an array longer than the payload"));
        }
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            out.push(self.value(depth + 1)?);
        }
        Ok(Value::Array(out))
    }

    fn map(&mut self, n: usize, depth: usize) -> Result<Value, Malformed> {
        if n.saturating_mul(2) > self.remaining() {
            return Err(bad("msgpack: a map longer than the payload"));
        }
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            let k = self.value(depth + 1)?;
            let v = self.value(depth + 1)?;
            out.push((k, v));
        }
        Ok(Value::Map(out))
    }

    fn ext(&mut self, n: usize) -> Result<Value, Malformed> {
        self.take(1 + n)?;
        Ok(Value::Ext)
    }

    fn value(&mut self, depth: usize) -> Result<Value, Malformed> {
        if depth > MAX_DEPTH {
            return Err(bad("msgpack: nested too deeply"));
        }
        let m = self.take(1)?[0];
        Ok(match m {
            0x00..=0x7f => Value::Int(i128::from(m)),
            0x80..=0x8f => return self.map(usize::from(m & 0x0f), depth),
            0x90..=0x9f => return self.array(usize::from(m & 0x0f), depth),
            0xa0..=0xbf => return self.text(usize::from(m & 0x1f)),
            0xc0 => Value::Nil,
            0xc2 => Value::Bool(false),
            0xc3 => Value::Bool(true),
            0xc4..=0xc6 => {
                let n = self.uint(1 << (m - 0xc4))? as usize;
                Value::Bin(self.take(n)?.to_vec())
            }
            0xc7..=0xc9 => {
                let n = self.uint(1 << (m - 0xc7))? as usize;
                return self.ext(n);
            }
            0xca => Value::Float(f64::from(f32::from_bits(self.uint(4)? as u32))),
            0xcb => Value::Float(f64::from_bits(self.uint(8)?)),
            0xcc..=0xcf => Value::Int(i128::from(self.uint(1 << (m - 0xcc))?)),
            0xd0..=0xd3 => Value::Int(i128::from(self.int(1 << (m - 0xd0))?)),
            0xd4..=0xd8 => return self.ext(1 << (m - 0xd4)),
            0xd9..=0xdb => {
                let n = self.uint(1 << (m - 0xd9))? as usize;
                return self.text(n);
            }
            0xdc | 0xdd => {
                let n = self.uint(2 << (m - 0xdc))? as usize;
                return self.array(n, depth);
            }
            0xde | 0xdf => {
                let n = self.uint(2 << (m - 0xde))? as usize;
                return self.map(n, depth);
            }
            0xe0..=0xff => Value::Int(i128::from(m as i8)),
            0xc1 => return Err(bad("msgpack: reserved marker 0xc1")),
        })
    }
}

/// Decodes one msgpack value that must fill `bytes` exactly.
pub fn decode(bytes: &[u8]) -> Result<Value, Malformed> {
    let mut r = Reader { b: bytes, pos: 0 };
    let v = r.value(0)?;
    if r.remaining() != 0 {
        return Err(bad("msgpack: bytes after the value"));
    }
    Ok(v)
}

/// A vLLM block hash, as 128 bits: an integer hash (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`,
/// 64 bits) as is; a bytes hash (the default: 32 bytes of SHA-256) as the first 16 bytes of its
/// SHA-256, so that any byte format spreads evenly. Two distinct hashes share it with
/// probability ~2^-128 per pair: the map keeps 16 bytes per block instead of the hash's bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct EngineHash(pub u128);

impl EngineHash {
    /// An integer hash (a negative one as its 64-bit two's complement).
    pub fn from_int(i: u64) -> Self {
        EngineHash(u128::from(i))
    }

    /// A bytes hash.
    pub fn from_bytes(b: &[u8]) -> Self {
        use sha2::Digest;
        let d = sha2::Sha256::digest(b);
        let mut x = [0u8; 16];
        x.copy_from_slice(&d[..16]);
        // The top bit set: never equal to an integer hash (at most 64 bits wide).
        EngineHash(u128::from_be_bytes(x) | 1 << 127)
    }

    fn read(v: &Value) -> Result<Self, Malformed> {
        match v {
            Value::Int(i) => u64::try_from(*i)
                .or_else(|_| i64::try_from(*i).map(|v| v as u64))
                .map(EngineHash::from_int)
                .map_err(|_| bad("an integer block hash wider than 64 bits")),
            Value::Bin(b) => Ok(EngineHash::from_bytes(b)),
            _ => Err(bad("a block hash is neither bytes nor a 64-bit integer")),
        }
    }
}

/// One entry of a block's `extra_keys` tuple, as vLLM publishes them untagged: a LoRA name or
/// a cache salt is a string; multimodal `(identifier, offset)` pairs and prompt-embedding
/// digests are anything else.
#[derive(Clone, Debug, PartialEq)]
pub enum ExtraKey {
    Text(String),
    Other,
}

/// `BlockStored`: full blocks the engine cached (or, since vLLM 0.34, reused), in chain order.
#[derive(Clone, Debug, PartialEq)]
pub struct Stored {
    pub hashes: Vec<EngineHash>,
    pub parent: Option<EngineHash>,
    /// The tokens of all the blocks, `hashes.len() × block_size` of them.
    pub token_ids: Vec<u32>,
    pub block_size: usize,
    /// Stored for a LoRA adapter (`lora_name` or `lora_id` set).
    pub lora: bool,
    pub medium: Option<String>,
    /// One entry per block (`None`: the block has none), or `None` for all.
    pub extra_keys: Option<Vec<Option<Vec<ExtraKey>>>>,
    /// The KV-cache group (`None` reads as 0).
    pub group: i128,
    /// The hashes also cover tokens after each block (`lookahead_token_ids` set).
    pub lookahead: bool,
}

/// One event of a batch.
#[derive(Clone, Debug, PartialEq)]
pub enum EngineEvent {
    Stored(Stored),
    Removed {
        hashes: Vec<EngineHash>,
        medium: Option<String>,
        group: i128,
    },
    Cleared,
}

/// One decoded `KVEventBatch`.
#[derive(Debug)]
pub struct Batch {
    /// Each event, or why it could not be read.
    pub events: Vec<Result<EngineEvent, Malformed>>,
}

fn field<'v>(map: &'v [(Value, Value)], name: &str) -> Option<&'v Value> {
    map.iter()
        .find(|(k, _)| matches!(k, Value::Str(s) if s == name))
        .map(|(_, v)| v)
        .filter(|v| !matches!(v, Value::Nil))
}

fn hashes(v: Option<&Value>) -> Result<Vec<EngineHash>, Malformed> {
    match v {
        Some(Value::Array(a)) => a.iter().map(EngineHash::read).collect(),
        _ => Err(bad("block_hashes is not an array")),
    }
}

fn opt_text(v: Option<&Value>, name: &str) -> Result<Option<String>, Malformed> {
    match v {
        None => Ok(None),
        Some(Value::Str(s)) => Ok(Some(s.clone())),
        Some(_) => Err(bad(format!("{name} is not a string"))),
    }
}

fn int(v: Option<&Value>, name: &str) -> Result<Option<i128>, Malformed> {
    match v {
        None => Ok(None),
        Some(Value::Int(i)) => Ok(Some(*i)),
        Some(_) => Err(bad(format!("{name} is not an integer"))),
    }
}

fn extra_keys(v: Option<&Value>) -> Result<Option<Vec<Option<Vec<ExtraKey>>>>, Malformed> {
    let Some(v) = v else { return Ok(None) };
    let Value::Array(blocks) = v else {
        return Err(bad("extra_keys is not an array"));
    };
    let mut out = Vec::with_capacity(blocks.len());
    for b in blocks {
        out.push(match b {
            Value::Nil => None,
            Value::Array(keys) => Some(
                keys.iter()
                    .map(|k| match k {
                        Value::Str(s) => ExtraKey::Text(s.clone()),
                        _ => ExtraKey::Other,
                    })
                    .collect(),
            ),
            _ => return Err(bad("an extra_keys entry is neither null nor an array")),
        });
    }
    Ok(Some(out))
}

fn stored(m: &[(Value, Value)]) -> Result<Stored, Malformed> {
    let hashes = hashes(field(m, "block_hashes"))?;
    let parent = field(m, "parent_block_hash")
        .map(EngineHash::read)
        .transpose()?;
    let token_ids = match field(m, "token_ids") {
        Some(Value::Array(a)) => a
            .iter()
            .map(|t| match t {
                Value::Int(i) => u32::try_from(*i).map_err(|_| bad("a token id is out of range")),
                _ => Err(bad("a token id is not an integer")),
            })
            .collect::<Result<Vec<u32>, _>>()?,
        _ => return Err(bad("token_ids is not an array")),
    };
    let block_size = int(field(m, "block_size"), "block_size")?
        .and_then(|b| usize::try_from(b).ok())
        .filter(|&b| b > 0)
        .ok_or_else(|| bad("block_size is not a positive integer"))?;
    if Some(token_ids.len()) != hashes.len().checked_mul(block_size) {
        return Err(bad(format!(
            "{} token ids for {} blocks of {block_size}",
            token_ids.len(),
            hashes.len()
        )));
    }
    let extra_keys = extra_keys(field(m, "extra_keys"))?;
    if extra_keys.as_ref().is_some_and(|e| e.len() != hashes.len()) {
        return Err(bad("extra_keys does not have one entry per block"));
    }
    Ok(Stored {
        parent,
        token_ids,
        block_size,
        lora: field(m, "lora_name").is_some() || field(m, "lora_id").is_some(),
        medium: opt_text(field(m, "medium"), "medium")?,
        extra_keys,
        group: int(field(m, "group_idx"), "group_idx")?.unwrap_or(0),
        lookahead: field(m, "lookahead_token_ids").is_some(),
        hashes,
    })
}

fn event(v: &Value) -> Result<EngineEvent, Malformed> {
    let Value::Map(m) = v else {
        return Err(bad("an event is not a map"));
    };
    match field(m, "type") {
        Some(Value::Str(t)) if t == "BlockStored" => stored(m).map(EngineEvent::Stored),
        Some(Value::Str(t)) if t == "BlockRemoved" => Ok(EngineEvent::Removed {
            hashes: hashes(field(m, "block_hashes"))?,
            medium: opt_text(field(m, "medium"), "medium")?,
            group: int(field(m, "group_idx"), "group_idx")?.unwrap_or(0),
        }),
        Some(Value::Str(t)) if t == "AllBlocksCleared" => Ok(EngineEvent::Cleared),
        Some(Value::Str(t)) => Err(bad(format!("unknown event type {t:?}"))),
        _ => Err(bad("an event has no type")),
    }
}

/// Decodes one ZMQ payload (a `KVEventBatch`).
pub fn decode_batch(payload: &[u8]) -> Result<Batch, Malformed> {
    // `ts` and `data_parallel_rank` are not needed: one sidecar reads one rank's socket.
    let events = match decode(payload)? {
        Value::Array(a) => a.into_iter().nth(1),
        Value::Map(m) => field(&m, "events").cloned(),
        _ => return Err(bad("a batch is neither an array nor a map")),
    };
    let Some(Value::Array(events)) = events else {
        return Err(bad("the batch has no events array"));
    };
    Ok(Batch {
        events: events.iter().map(event).collect(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scalars_and_containers() {
        assert_eq!(decode(&[0x05]).unwrap(), Value::Int(5));
        assert_eq!(decode(&[0xff]).unwrap(), Value::Int(-1));
        assert_eq!(decode(&[0xd0, 0x80]).unwrap(), Value::Int(-128));
        assert_eq!(
            decode(&[0xcf, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff]).unwrap(),
            Value::Int(i128::from(u64::MAX))
        );
        assert_eq!(
            decode(&[0xd3, 0x80, 0, 0, 0, 0, 0, 0, 0]).unwrap(),
            Value::Int(i128::from(i64::MIN))
        );
        assert_eq!(
            decode(&[0xa2, b'h', b'i']).unwrap(),
            Value::Str("hi".into())
        );
        assert_eq!(decode(&[0xc4, 1, 7]).unwrap(), Value::Bin(vec![7]));
        assert_eq!(
            decode(&[0x92, 0xc0, 0xc3]).unwrap(),
            Value::Array(vec![Value::Nil, Value::Bool(true)])
        );
        assert_eq!(
            decode(&[0x81, 0xa1, b'a', 0x01]).unwrap(),
            Value::Map(vec![(Value::Str("a".into()), Value::Int(1))])
        );
        assert_eq!(
            decode(&[0xcb, 0x3f, 0xf0, 0, 0, 0, 0, 0, 0]).unwrap(),
            Value::Float(1.0)
        );
    }

    #[test]
    fn malformed_payloads_are_errors_not_allocations() {
        // An array claiming 2^32 - 1 elements in a 5-byte payload.
        assert!(decode(&[0xdd, 0xff, 0xff, 0xff, 0xff]).is_err());
        assert!(decode(&[0xdf, 0xff, 0xff, 0xff, 0xff]).is_err());
        assert!(decode(&[0xc6, 0xff, 0xff, 0xff, 0xff]).is_err());
        assert!(decode(&[0xc1]).is_err());
        assert!(decode(&[0x01, 0x02]).is_err());
        assert!(decode(&[]).is_err());
        // Nesting beyond the bound.
        let deep = vec![0x91; 100];
        assert!(decode(&deep).is_err());
        assert!(decode_batch(&[0x05]).is_err());
    }
}
