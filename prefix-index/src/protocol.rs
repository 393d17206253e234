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

#[cfg(test)]
mod tests {
    use super::*;

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
