//! KV event wire types: what a worker publishes about its prefix cache, and what the gateway
//! applies to its [`crate::PrefixIndex`].
//!
//! JSON shape (one object per event; the envelope's fields and the event's fields side by side,
//! the event kind in `"type"`):
//!
//! ```json
//! {"epoch":1,"seq":5,"type":"stored","parent":"00000000000000aa","keys":["00000000000000bb"]}
//! {"epoch":1,"seq":6,"type":"removed","keys":["00000000000000bb"]}
//! {"epoch":1,"seq":7,"type":"cleared"}
//! ```
//!
//! `parent` is `null` for blocks that start a chain. Keys are 16-digit lowercase hex
//! ([`BlockKey`]). `epoch` changes when the worker's cache restarts from empty; `seq` increases
//! by one per event within an epoch.
use serde::{Deserialize, Serialize};

use crate::key::BlockKey;

/// One change to a worker's cache.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "lowercase")]
pub enum KvEvent {
    /// Blocks stored, in chain order; `parent` is the key before `keys[0]` (None for a chain's first block).
    Stored {
        /// Key of the block before `keys[0]`, `null` when `keys[0]` is a chain's first block.
        #[serde(default)]
        parent: Option<BlockKey>,
        /// Keys of the stored blocks, parent first.
        keys: Vec<BlockKey>,
    },
    /// Blocks removed (evicted).
    Removed {
        /// Keys of the removed blocks, in any order.
        keys: Vec<BlockKey>,
    },
    /// Every block of the worker is gone.
    Cleared,
}

/// An event with its worker-side sequence number and epoch.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvEventEnvelope {
    /// Cache incarnation of the worker; a new epoch means the cache restarted from empty.
    pub epoch: u64,
    /// Sequence number within the epoch, +1 per event.
    pub seq: u64,
    /// The event itself (its fields are flattened into the envelope object).
    #[serde(flatten)]
    pub event: KvEvent,
}

/// The SSE event name of a [`WorkerLoad`] message on the KV event stream (`event: load`). Load
/// messages carry no `id` and no sequence number: they are not cache events, a subscriber keeps
/// only the latest one, and resumption ignores them.
pub const LOAD_EVENT_NAME: &str = "load";

/// A worker's queued work, as its engine's scheduler counts it after a step: what a request
/// routed there now would wait behind. Units are tokens, the same units as the gateway's
/// `active_tokens` load (uncached prompt tokens plus output tokens still to generate).
///
/// JSON (`data` of an `event: load` SSE message):
/// `{"running":3,"waiting":1,"prefill_tokens":1480,"decode_tokens":250}`; unknown fields are
/// ignored, missing ones are 0.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct WorkerLoad {
    /// Admitted sequences.
    pub running: u64,
    /// Sequences waiting for admission.
    pub waiting: u64,
    /// Prompt tokens not computed yet: the uncomputed part of every running sequence's prompt
    /// plus the whole prompt of every waiting one (their cache hits are not known before
    /// admission, so this is an upper bound for them).
    pub prefill_tokens: u64,
    /// Output tokens still allowed (`max_tokens` minus generated) over running and waiting
    /// sequences.
    pub decode_tokens: u64,
}

/// A token count moves "enough" to be announced when it changes by at least this many tokens…
pub const LOAD_ANNOUNCE_MIN_TOKENS: u64 = 16;

/// …and by at least 1/`LOAD_ANNOUNCE_FRACTION` of the larger of its old and new values.
pub const LOAD_ANNOUNCE_FRACTION: u64 = 8;

impl WorkerLoad {
    /// Whether this load differs from `announced` (the last one a worker announced) enough to
    /// announce it: a sequence admitted, queued or finished (`running` or `waiting` changed),
    /// a token count that became 0 or stopped being 0, or a token count that moved by at least
    /// [`LOAD_ANNOUNCE_MIN_TOKENS`] and 1/[`LOAD_ANNOUNCE_FRACTION`] of the larger value.
    ///
    /// Decode steps shrink `decode_tokens` by the running count every step, and prefill
    /// chunks shrink `prefill_tokens`; announcing each of those is traffic and wake-ups for
    /// every subscriber with little to learn (a gateway counts the work it routed itself). So
    /// an announced load is at most 1/8 (or 16 tokens) away from the load it describes
    /// between two announcements, while work arriving or leaving shows at once.
    pub fn moved_from(&self, announced: &WorkerLoad) -> bool {
        fn tokens_moved(now: u64, then: u64) -> bool {
            if (now == 0) != (then == 0) {
                return true;
            }
            let delta = now.abs_diff(then);
            delta >= LOAD_ANNOUNCE_MIN_TOKENS && delta >= now.max(then) / LOAD_ANNOUNCE_FRACTION
        }
        self.running != announced.running
            || self.waiting != announced.waiting
            || tokens_moved(self.prefill_tokens, announced.prefill_tokens)
            || tokens_moved(self.decode_tokens, announced.decode_tokens)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn load_moves_enough_on_work_arriving_or_leaving_and_large_token_changes() {
        let at = |running, waiting, prefill_tokens, decode_tokens| WorkerLoad {
            running,
            waiting,
            prefill_tokens,
            decode_tokens,
        };
        let base = at(4, 1, 800, 400);
        assert!(!base.moved_from(&base));
        // A sequence admitted, queued or finished: always.
        assert!(at(5, 0, 800, 400).moved_from(&base));
        assert!(at(4, 2, 800, 400).moved_from(&base));
        assert!(at(3, 1, 800, 400).moved_from(&base));
        // Four decode steps of 4 sequences: 16 tokens, under 1/8 of 400.
        assert!(!at(4, 1, 800, 384).moved_from(&base));
        // 1/8 of the larger value: 50 of 400 moves, 49 does not.
        assert!(at(4, 1, 800, 350).moved_from(&base));
        assert!(!at(4, 1, 800, 351).moved_from(&base));
        assert!(at(4, 1, 700, 400).moved_from(&base));
        assert!(!at(4, 1, 701, 400).moved_from(&base));
        // Growth counts against the new, larger value.
        assert!(!at(4, 1, 800, 456).moved_from(&base));
        assert!(at(4, 1, 800, 457).moved_from(&base));
        // Small counts: at least 16 tokens, except to or from 0.
        let small = at(1, 0, 0, 40);
        assert!(!at(1, 0, 0, 25).moved_from(&small));
        assert!(at(1, 0, 0, 24).moved_from(&small));
        assert!(at(1, 0, 1, 40).moved_from(&small));
        assert!(at(1, 0, 0, 0).moved_from(&at(1, 0, 0, 1)));
        // Saturated values do not overflow.
        assert!(!at(1, 0, u64::MAX, 0).moved_from(&at(1, 0, u64::MAX - 1, 0)));
        assert!(at(1, 0, u64::MAX, 0).moved_from(&at(1, 0, 1, 0)));
    }

    #[test]
    fn load_json_is_pinned() {
        let l = WorkerLoad {
            running: 3,
            waiting: 1,
            prefill_tokens: 1480,
            decode_tokens: 250,
        };
        let json = r#"{"running":3,"waiting":1,"prefill_tokens":1480,"decode_tokens":250}"#;
        assert_eq!(serde_json::to_string(&l).unwrap(), json);
        assert_eq!(serde_json::from_str::<WorkerLoad>(json).unwrap(), l);
        let partial: WorkerLoad =
            serde_json::from_str(r#"{"prefill_tokens":7,"future_field":[1]}"#).unwrap();
        assert_eq!(partial.prefill_tokens, 7);
        assert_eq!(partial.running, 0);
        assert!(serde_json::from_str::<WorkerLoad>(r#"{"running":-1}"#).is_err());
        assert!(serde_json::from_str::<WorkerLoad>(r#""busy""#).is_err());
    }

    fn round_trip(env: &KvEventEnvelope, json: &str) {
        assert_eq!(serde_json::to_string(env).unwrap(), json);
        let back: KvEventEnvelope = serde_json::from_str(json).unwrap();
        assert_eq!(&back, env);
    }

    #[test]
    fn stored_json_is_pinned() {
        round_trip(
            &KvEventEnvelope {
                epoch: 1,
                seq: 5,
                event: KvEvent::Stored {
                    parent: Some(BlockKey(0xaa)),
                    keys: vec![BlockKey(0xbb), BlockKey(0xdead_beef_0000_0001)],
                },
            },
            r#"{"epoch":1,"seq":5,"type":"stored","parent":"00000000000000aa","keys":["00000000000000bb","deadbeef00000001"]}"#,
        );
        round_trip(
            &KvEventEnvelope {
                epoch: 2,
                seq: 0,
                event: KvEvent::Stored {
                    parent: None,
                    keys: vec![BlockKey(1)],
                },
            },
            r#"{"epoch":2,"seq":0,"type":"stored","parent":null,"keys":["0000000000000001"]}"#,
        );
    }

    #[test]
    fn removed_and_cleared_json_is_pinned() {
        round_trip(
            &KvEventEnvelope {
                epoch: 1,
                seq: 6,
                event: KvEvent::Removed {
                    keys: vec![BlockKey(0xbb)],
                },
            },
            r#"{"epoch":1,"seq":6,"type":"removed","keys":["00000000000000bb"]}"#,
        );
        round_trip(
            &KvEventEnvelope {
                epoch: 1,
                seq: 7,
                event: KvEvent::Cleared,
            },
            r#"{"epoch":1,"seq":7,"type":"cleared"}"#,
        );
    }

    #[test]
    fn parent_may_be_omitted_and_bad_input_is_an_error() {
        let e: KvEventEnvelope =
            serde_json::from_str(r#"{"type":"stored","seq":3,"epoch":9,"keys":[]}"#).unwrap();
        assert_eq!(
            e.event,
            KvEvent::Stored {
                parent: None,
                keys: vec![]
            }
        );
        for bad in [
            r#"{"epoch":1,"seq":1,"type":"bogus"}"#,
            r#"{"epoch":1,"seq":1}"#,
            r#"{"epoch":1,"type":"cleared"}"#,
            r#"{"epoch":1,"seq":1,"type":"removed","keys":["xyz"]}"#,
            r#"{"epoch":1,"seq":1,"type":"removed"}"#,
        ] {
            assert!(
                serde_json::from_str::<KvEventEnvelope>(bad).is_err(),
                "{bad}"
            );
        }
    }
}
