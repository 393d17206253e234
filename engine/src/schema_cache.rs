//! Compiled schemas kept between requests: structured outputs and forced tool calls send the
//! same schema again and again (an agent's tools on every turn, one `response_format` per
//! application), and compiling one takes milliseconds (a `format`'s or `pattern`'s automaton;
//! docs/benchmarks.md, "Compiling a schema once").
//!
//! A [`SchemaCache`] maps the exact text of what was compiled (the caller's [`SchemaKey`]) to the
//! [`CompiledSchema`], which is immutable and shared (`Arc`). It is bounded in bytes (the
//! keys' text and each schema's own estimate, [`CompiledSchema::heap_bytes`]) and drops the
//! least recently used entry first; an entry above a quarter of the bound is compiled but not
//! kept. A schema that does not compile is not kept either: its error is recomputed, which is
//! cheap (compilation stops at the first error). The lock is held for the lookup and the
//! insertion only, never while compiling: two requests that miss at once both compile.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use serde_json::Value;

use crate::json_schema::CompiledSchema;

/// What a request asks to be compiled, as the exact bytes that decide the result: a kind
/// (`schema`, `call`, `calls`, `call_list <max>`) and the JSON text of each part, separated by NUL bytes (which
/// JSON text never holds unescaped). Property order is part of the text, as it is part of the
/// schema (properties are written in the schema's order).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct SchemaKey(Vec<u8>);

impl SchemaKey {
    /// A `response_format` schema ([`CompiledSchema::compile`]).
    pub fn schema(schema: &Value) -> SchemaKey {
        SchemaKey::of(b"schema", &[schema])
    }

    /// One named tool's `parameters` (`tool_choice` naming a function; compiled with
    /// [`CompiledSchema::compile`]).
    pub fn call(parameters: &Value) -> SchemaKey {
        SchemaKey::of(b"call", &[parameters])
    }

    /// Calls of one of these tools (`tool_choice: "required"`,
    /// [`CompiledSchema::compile_calls`]).
    pub fn calls(tools: &[(&str, &Value)]) -> SchemaKey {
        let mut k = b"calls".to_vec();
        for (name, params) in tools {
            k.push(0);
            write_json(&mut k, &Value::from(*name));
            k.push(0);
            write_json(&mut k, params);
        }
        SchemaKey(k)
    }

    /// A list of 1 to `max` calls of these tools ([`CompiledSchema::compile_call_list`]).
    pub fn call_list(tools: &[(&str, &Value)], max: u32) -> SchemaKey {
        let mut k = SchemaKey::calls(tools).0;
        k.splice(..b"calls".len(), format!("call_list {max}").into_bytes());
        SchemaKey(k)
    }

    fn of(kind: &[u8], parts: &[&Value]) -> SchemaKey {
        let mut k = kind.to_vec();
        for p in parts {
            k.push(0);
            write_json(&mut k, p);
        }
        SchemaKey(k)
    }
}

/// Serializing a `Value` to a `Vec` cannot fail (its keys are strings); a failure would only
/// make two keys longer, not equal.
fn write_json(out: &mut Vec<u8>, v: &Value) {
    if serde_json::to_writer(&mut *out, v).is_err() {
        out.extend_from_slice(b"\xff");
    }
}

/// Counts since the cache was made, and what it holds now.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SchemaCacheStats {
    /// Lookups answered from the cache.
    pub hits: u64,
    /// Lookups that compiled (kept or not, compiled or refused).
    pub misses: u64,
    /// Entries held.
    pub entries: usize,
    /// Their bytes (keys and schemas' estimates).
    pub bytes: usize,
}

struct Entry {
    schema: Arc<CompiledSchema>,
    /// Its place in the recency order (`Inner::order`).
    seq: u64,
    bytes: usize,
}

#[derive(Default)]
struct Inner {
    map: HashMap<Arc<SchemaKey>, Entry>,
    /// Least recently used first.
    order: BTreeMap<u64, Arc<SchemaKey>>,
    next_seq: u64,
    bytes: usize,
}

impl Inner {
    fn touch(&mut self, key: &SchemaKey) -> Option<Arc<CompiledSchema>> {
        let seq = self.next_seq;
        let entry = self.map.get_mut(key)?;
        let old = std::mem::replace(&mut entry.seq, seq);
        let schema = entry.schema.clone();
        if let Some(k) = self.order.remove(&old) {
            self.order.insert(seq, k);
        }
        self.next_seq += 1;
        Some(schema)
    }
}

/// Compiled schemas by [`SchemaKey`], at most `max_bytes` of them (see the module docs).
pub struct SchemaCache {
    max_bytes: usize,
    inner: Mutex<Inner>,
    hits: AtomicU64,
    misses: AtomicU64,
}

impl std::fmt::Debug for SchemaCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SchemaCache")
            .field("max_bytes", &self.max_bytes)
            .field("stats", &self.stats())
            .finish()
    }
}

impl SchemaCache {
    /// A cache of at most `max_bytes`; 0 keeps nothing (every lookup compiles).
    pub fn new(max_bytes: usize) -> SchemaCache {
        SchemaCache {
            max_bytes,
            inner: Mutex::new(Inner::default()),
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
        }
    }

    /// The schema compiled for `key`: the kept one, else `compile()`'s (kept when it compiled
    /// and fits). `compile` must be what `key` names.
    pub fn get_or_compile<E>(
        &self,
        key: SchemaKey,
        compile: impl FnOnce() -> Result<CompiledSchema, E>,
    ) -> Result<Arc<CompiledSchema>, E> {
        if let Some(s) = self.lock().touch(&key) {
            self.hits.fetch_add(1, Ordering::Relaxed);
            return Ok(s);
        }
        self.misses.fetch_add(1, Ordering::Relaxed);
        let schema = Arc::new(compile()?);
        let bytes = key
            .0
            .len()
            .saturating_add(schema.heap_bytes())
            .saturating_add(std::mem::size_of::<Entry>() + std::mem::size_of::<SchemaKey>());
        if bytes > self.max_bytes / 4 {
            return Ok(schema);
        }
        let mut inner = self.lock();
        if let Some(kept) = inner.touch(&key) {
            // Another request compiled it meanwhile: share that one.
            return Ok(kept);
        }
        while inner.bytes + bytes > self.max_bytes {
            let Some((_, oldest)) = inner.order.pop_first() else {
                break;
            };
            if let Some(e) = inner.map.remove(&oldest) {
                inner.bytes -= e.bytes;
            }
        }
        let key = Arc::new(key);
        let seq = inner.next_seq;
        inner.next_seq += 1;
        inner.order.insert(seq, key.clone());
        inner.map.insert(
            key,
            Entry {
                schema: schema.clone(),
                seq,
                bytes,
            },
        );
        inner.bytes += bytes;
        Ok(schema)
    }

    /// Hits, misses, entries and bytes.
    pub fn stats(&self) -> SchemaCacheStats {
        let (entries, bytes) = {
            let inner = self.lock();
            (inner.map.len(), inner.bytes)
        };
        SchemaCacheStats {
            hits: self.hits.load(Ordering::Relaxed),
            misses: self.misses.load(Ordering::Relaxed),
            entries,
            bytes,
        }
    }

    /// The bound it was made with.
    pub fn max_bytes(&self) -> usize {
        self.max_bytes
    }

    /// The map stays consistent across a panic elsewhere (every update is completed under the
    /// lock before anything can panic), so a poisoned lock is used as it is.
    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn compile(v: &Value) -> Result<CompiledSchema, String> {
        CompiledSchema::compile(v).map_err(|e| e.to_string())
    }

    #[test]
    fn a_kept_schema_is_the_one_compiled_and_shared() {
        let cache = SchemaCache::new(8 << 20);
        let s =
            json!({"type": "object", "properties": {"a": {"type": "string", "format": "email"}}});
        let first = cache
            .get_or_compile(SchemaKey::schema(&s), || compile(&s))
            .unwrap();
        let mut compiled = false;
        let again = cache
            .get_or_compile(SchemaKey::schema(&s), || {
                compiled = true;
                compile(&s)
            })
            .unwrap();
        assert!(!compiled, "the second lookup compiled again");
        assert!(Arc::ptr_eq(&first, &again));
        assert_eq!(*again, compile(&s).unwrap());
        let st = cache.stats();
        assert_eq!((st.hits, st.misses, st.entries), (1, 1, 1));
        assert!(st.bytes >= first.heap_bytes(), "{st:?}");
    }

    #[test]
    fn keys_tell_apart_what_compiles_differently() {
        let ab = json!({"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "integer"}}});
        let ba = json!({"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}});
        // Property order is part of the schema (the answer writes them in that order).
        assert_ne!(compile(&ab).unwrap(), compile(&ba).unwrap());
        assert_ne!(SchemaKey::schema(&ab), SchemaKey::schema(&ba));
        // The same text as a response_format and as a named tool's parameters.
        assert_ne!(SchemaKey::schema(&ab), SchemaKey::call(&ab));
        // Tool names and where one tool ends and the next begins.
        let p = json!({"type": "object"});
        let q = json!({"type": "object", "properties": {}});
        assert_ne!(
            SchemaKey::calls(&[("f", &p), ("g", &q)]),
            SchemaKey::calls(&[("g", &p), ("f", &q)])
        );
        assert_ne!(
            SchemaKey::calls(&[("f", &p)]),
            SchemaKey::calls(&[("f", &p), ("f", &p)])
        );
        // One call, or a list of up to 8 or 16 of them.
        assert_ne!(
            SchemaKey::calls(&[("f", &p)]),
            SchemaKey::call_list(&[("f", &p)], 8)
        );
        assert_ne!(
            SchemaKey::call_list(&[("f", &p)], 8),
            SchemaKey::call_list(&[("f", &p)], 16)
        );
        // A name holding what a separator would look like is escaped in its JSON text.
        assert_ne!(
            SchemaKey::calls(&[("a\u{0}\"b", &p)]),
            SchemaKey::calls(&[("a", &p), ("b", &p)])
        );
        let cache = SchemaCache::new(8 << 20);
        let x = cache
            .get_or_compile(SchemaKey::schema(&ab), || compile(&ab))
            .unwrap();
        let y = cache
            .get_or_compile(SchemaKey::schema(&ba), || compile(&ba))
            .unwrap();
        assert_ne!(*x, *y);
        assert_eq!(cache.stats().entries, 2);
    }

    #[test]
    fn the_least_recently_used_goes_first_within_the_bound() {
        let schemas: Vec<Value> = (0..6)
            .map(|i| json!({"type": "object", "properties": {format!("p{i}"): {"type": "string"}}}))
            .collect();
        let one = {
            let c = SchemaCache::new(usize::MAX);
            c.get_or_compile(SchemaKey::schema(&schemas[0]), || compile(&schemas[0]))
                .unwrap();
            c.stats().bytes
        };
        // Room for four such entries (each is a little under a quarter of the bound).
        let cache = SchemaCache::new(one * 4 + one / 2);
        for s in &schemas[..4] {
            cache
                .get_or_compile(SchemaKey::schema(s), || compile(s))
                .unwrap();
        }
        assert_eq!(cache.stats().entries, 4);
        // Using the first makes the second the oldest.
        cache
            .get_or_compile(SchemaKey::schema(&schemas[0]), || -> Result<_, String> {
                panic!("kept")
            })
            .unwrap();
        cache
            .get_or_compile(SchemaKey::schema(&schemas[4]), || compile(&schemas[4]))
            .unwrap();
        let st = cache.stats();
        assert_eq!(st.entries, 4);
        assert!(st.bytes <= cache.max_bytes(), "{st:?}");
        let mut recompiled = Vec::new();
        for (i, s) in schemas[..5].iter().enumerate() {
            cache
                .get_or_compile(SchemaKey::schema(s), || {
                    recompiled.push(i);
                    compile(s)
                })
                .unwrap();
        }
        // The second was dropped; compiling it again drops the next oldest (the third), and so on.
        assert_eq!(recompiled[0], 1, "{recompiled:?}");
        assert!(!recompiled.contains(&0), "{recompiled:?}");
    }

    #[test]
    fn refusals_and_oversize_schemas_are_not_kept() {
        let cache = SchemaCache::new(8 << 20);
        let bad =
            json!({"type": "object", "properties": {"a": {"type": "string", "pattern": "(?=x)"}}});
        for _ in 0..2 {
            assert!(cache
                .get_or_compile(SchemaKey::schema(&bad), || compile(&bad))
                .is_err());
        }
        let st = cache.stats();
        assert_eq!((st.hits, st.misses, st.entries, st.bytes), (0, 2, 0, 0));
        // An IPv6 format's automaton is far above a quarter of a 64 KiB cache: compiled, not kept.
        let small = SchemaCache::new(64 << 10);
        let big =
            json!({"type": "object", "properties": {"ip": {"type": "string", "format": "ipv6"}}});
        let s = small
            .get_or_compile(SchemaKey::schema(&big), || compile(&big))
            .unwrap();
        assert!(s.heap_bytes() > 16 << 10, "{}", s.heap_bytes());
        assert_eq!(small.stats().entries, 0);
        // Nothing kept at all with a bound of 0.
        let off = SchemaCache::new(0);
        let plain = json!({"type": "object"});
        off.get_or_compile(SchemaKey::schema(&plain), || compile(&plain))
            .unwrap();
        assert_eq!(off.stats().entries, 0);
    }

    #[test]
    fn concurrent_lookups_share_one_entry() {
        let cache = Arc::new(SchemaCache::new(8 << 20));
        let s = json!({"type": "object", "properties": {"d": {"type": "string", "format": "date-time"}}});
        let got: Vec<Arc<CompiledSchema>> = std::thread::scope(|scope| {
            let handles: Vec<_> = (0..4)
                .map(|_| {
                    let cache = cache.clone();
                    let s = s.clone();
                    scope.spawn(move || {
                        let mut last = None;
                        for _ in 0..50 {
                            last = Some(
                                cache
                                    .get_or_compile(SchemaKey::schema(&s), || compile(&s))
                                    .unwrap(),
                            );
                        }
                        last.unwrap()
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let st = cache.stats();
        assert_eq!(st.entries, 1);
        assert_eq!(st.hits + st.misses, 200);
        // Every thread ends on the kept entry.
        for g in &got[1..] {
            assert!(Arc::ptr_eq(g, &got[0]));
        }
    }
}
