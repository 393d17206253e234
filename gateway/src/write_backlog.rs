//! The stored turns a replica could not write to Redis yet (cluster mode): Redis did not answer,
//! or the write queue was full. [`crate::cluster::SharedResponses`] keeps them here and its
//! writer tries them again while Redis answers, so a turn stored (or a background response that
//! moved on or ended) while Redis was away reaches the other replicas once it is back.
//!
//! Each write carries a sequence number, taken when the turn was handed to the writer; the
//! backlog keeps the newest write per id and forgets it once that write, or a newer one, has
//! landed. Bounded: at most [`MAX_TURNS`] ids and `max_bytes` bytes of turns (the local store's
//! own budget: the turns are mostly the store's own, shared); past either bound a turn stays on
//! this replica only, as before the backlog existed.
//!
//! [`Waiting`] is everything a replica keeps for Redis — these turns, deletions, cancels and
//! conversation changes — in one value: what `--response-store-file` keeps across a restart
//! ([`crate::response_file`]) and the replica takes back when it starts again.

use std::collections::HashMap;
use std::sync::Arc;

use crate::conversation::Change;
use crate::response_store::StoredResponse;

/// What a replica keeps for Redis while Redis does not take it (see the module doc).
#[derive(Clone, Debug, Default)]
pub struct Waiting {
    /// Turns to write, oldest write first.
    pub turns: Vec<Arc<StoredResponse>>,
    /// Deletions to write (the `deleted` marker and its message).
    pub deletes: Vec<String>,
    /// Cancels of background responses other replicas run, to ask.
    pub cancels: Vec<String>,
    /// Conversation changes to make there, oldest first: id, tenant, change.
    pub changes: Vec<(String, Option<String>, Change)>,
}

/// Equal when the same things wait in the same order (turns compared by their JSON).
impl PartialEq for Waiting {
    fn eq(&self, other: &Waiting) -> bool {
        self.turns.len() == other.turns.len()
            && self
                .turns
                .iter()
                .zip(&other.turns)
                .all(|(a, b)| a.to_json() == b.to_json())
            && self.deletes == other.deletes
            && self.cancels == other.cancels
            && self.changes == other.changes
    }
}

impl Eq for Waiting {}

impl Waiting {
    /// How many things wait, of every kind.
    pub fn len(&self) -> usize {
        self.turns.len() + self.deletes.len() + self.cancels.len() + self.changes.len()
    }

    /// Whether nothing waits.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// A digest of what waits: a different one means something changed (a save is due). The
    /// turns count by identity (each write is a new record), the rest by content.
    pub fn digest(&self) -> u64 {
        use std::hash::{Hash, Hasher};
        let mut h = std::collections::hash_map::DefaultHasher::new();
        for t in &self.turns {
            (Arc::as_ptr(t) as usize, t.id.as_str()).hash(&mut h);
        }
        let mut rest: Vec<&str> = self.deletes.iter().map(String::as_str).collect();
        rest.sort_unstable();
        rest.hash(&mut h);
        let mut cancels: Vec<&str> = self.cancels.iter().map(String::as_str).collect();
        cancels.sort_unstable();
        cancels.hash(&mut h);
        for (id, tenant, change) in &self.changes {
            (
                id,
                tenant,
                serde_json::to_string(change).unwrap_or_default(),
            )
                .hash(&mut h);
        }
        h.finish()
    }
}

/// The most turns kept waiting.
pub const MAX_TURNS: usize = 65_536;

/// What [`WriteBacklog::defer`] did with a turn.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Deferred {
    /// Kept (replacing an older write of the same id, if any).
    Kept,
    /// A newer write of the id is already waiting, or has landed.
    Superseded,
    /// Over a bound: not kept.
    Full,
}

/// Turns waiting for Redis, the newest write of each id (see the module doc).
#[derive(Debug)]
pub struct WriteBacklog {
    turns: HashMap<String, (u64, Arc<StoredResponse>)>,
    bytes: usize,
    max_bytes: usize,
}

impl WriteBacklog {
    /// An empty backlog of at most `max_bytes` bytes of turns.
    pub fn new(max_bytes: usize) -> WriteBacklog {
        WriteBacklog {
            turns: HashMap::new(),
            bytes: 0,
            max_bytes,
        }
    }

    /// Keeps write `seq` of `turn` for a later try, unless a newer write of it waits.
    pub fn defer(&mut self, seq: u64, turn: &Arc<StoredResponse>) -> Deferred {
        let size = turn.bytes();
        let old = match self.turns.get(&turn.id) {
            Some((s, _)) if *s >= seq => return Deferred::Superseded,
            Some((_, t)) => t.bytes(),
            None if self.turns.len() >= MAX_TURNS => return Deferred::Full,
            None => 0,
        };
        if self.bytes - old + size > self.max_bytes {
            return Deferred::Full;
        }
        self.bytes = self.bytes - old + size;
        self.turns.insert(turn.id.clone(), (seq, turn.clone()));
        Deferred::Kept
    }

    /// Write `seq` of `id` landed: a waiting write of it no newer than that is done.
    pub fn landed(&mut self, id: &str, seq: u64) {
        if self.turns.get(id).is_some_and(|(s, _)| *s <= seq) {
            if let Some((_, t)) = self.turns.remove(id) {
                self.bytes -= t.bytes();
            }
        }
    }

    /// Whether write `seq` of `id` is older than one waiting here (so not worth making).
    pub fn supersedes(&self, id: &str, seq: u64) -> bool {
        self.turns.get(id).is_some_and(|(s, _)| *s > seq)
    }

    /// The waiting writes, oldest first.
    pub fn waiting(&self) -> Vec<(u64, Arc<StoredResponse>)> {
        let mut v: Vec<_> = self.turns.values().cloned().collect();
        v.sort_unstable_by_key(|(s, _)| *s);
        v
    }

    /// How many turns wait.
    pub fn len(&self) -> usize {
        self.turns.len()
    }

    /// Whether none waits.
    pub fn is_empty(&self) -> bool {
        self.turns.is_empty()
    }

    /// The waiting turns' bytes.
    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn turn(id: &str, status: &str, text: &str) -> Arc<StoredResponse> {
        Arc::new(StoredResponse::new(
            id.into(),
            None,
            Vec::new(),
            vec![json!({"role": "user", "content": text})],
            json!({"id": id, "object": "response", "status": status, "output": []}),
        ))
    }

    #[test]
    fn the_newest_write_of_an_id_waits_and_an_older_landing_leaves_it() {
        let mut b = WriteBacklog::new(1 << 20);
        let (queued, done) = (turn("r1", "queued", "x"), turn("r1", "completed", "x"));
        assert_eq!(b.defer(3, &queued), Deferred::Kept);
        assert_eq!(b.defer(5, &done), Deferred::Kept);
        // An older write failing again does not replace the newer one.
        assert_eq!(b.defer(4, &queued), Deferred::Superseded);
        assert_eq!(b.len(), 1);
        assert_eq!(b.bytes(), done.bytes());
        assert!(b.supersedes("r1", 4));
        assert!(!b.supersedes("r1", 5));
        // Write 4 landed (from the queue): write 5 still has to.
        b.landed("r1", 4);
        assert_eq!(b.waiting()[0].1.status(), "completed");
        b.landed("r1", 5);
        assert!(b.is_empty());
        assert_eq!(b.bytes(), 0);
    }

    #[test]
    fn writes_wait_oldest_first_within_the_bytes() {
        let (a, c) = (
            turn("a", "completed", "one"),
            turn("c", "completed", "three"),
        );
        let mut b = WriteBacklog::new(a.bytes() + c.bytes());
        assert_eq!(b.defer(9, &c), Deferred::Kept);
        assert_eq!(b.defer(2, &a), Deferred::Kept);
        let order: Vec<_> = b
            .waiting()
            .iter()
            .map(|(s, t)| (*s, t.id.clone()))
            .collect();
        assert_eq!(order, [(2, "a".to_owned()), (9, "c".to_owned())]);
        // One more byte than the bound allows: not kept, nothing else changes.
        assert_eq!(b.defer(10, &turn("d", "completed", "x")), Deferred::Full);
        assert_eq!((b.len(), b.bytes()), (2, a.bytes() + c.bytes()));
        // A newer write of a waiting id within the bound replaces it.
        let bigger = turn("a", "completed", "one more");
        assert_eq!(b.defer(11, &bigger), Deferred::Full);
        let same = turn("a", "completed", "two");
        assert_eq!(b.defer(11, &same), Deferred::Kept);
        assert_eq!(b.bytes(), same.bytes() + c.bytes());
    }
}
