//! Close decisions of this replica whose cluster claim is still in flight, and the decisions
//! that follow them (docs/cluster.md, "Claims").
//!
//! A close decision (a new prompt: [`crate::route::Decision::close`] ≥ 2) takes its
//! routing-time holding on its local first choice at once, under the service's placement lock,
//! and only then claims in Redis ([`crate::cluster::Claims::settle`]), which may move it to
//! another worker (another replica's fresh placement or lead). A second request of the same
//! new prefix on this replica that places in between sees that holding, is a clear winner there
//! and does not claim: without more, it stays on the local first choice while the first request
//! moves, and the prefix is computed on two workers. So the close decision leaves a *mark*
//! here, in the same critical section as its holding, and a later decision whose first choice
//! matched into that holding waits for the claim (at most the claim timeout) and goes where it
//! went.
//!
//! A mark is keyed by the first block key its holding added (the blocks before it were held
//! there already): a follower matched into the holding exactly when its own chain reaches that
//! key on the marked worker. Marks live while their claim does (the settling request resolves
//! its mark as it ends, also when it is dropped), one per concurrent close decision.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;
use prefix_index::{BlockKey, WorkerId};
use tokio::sync::watch;

/// A close decision's mark ([`InFlightClaims::mark`]), kept in its decision.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ClaimMark {
    key: u64,
    id: u64,
}

/// One service's marks (per rules version, as its placement lock).
#[derive(Debug, Default)]
pub struct InFlightClaims {
    next: AtomicU64,
    marks: Mutex<HashMap<u64, Mark>>,
}

#[derive(Debug)]
struct Mark {
    id: u64,
    worker: WorkerId,
    /// The claim's outcome: the worker the claiming request finally went to (`None` until it
    /// settled). Dropped without a value when the claim gave up.
    outcome: watch::Sender<Option<WorkerId>>,
}

/// A follower's wait for a marked claim ([`InFlightClaims::follow`]).
#[derive(Debug)]
pub struct Following {
    /// How many of the follower's first blocks its first choice held, the marked holding
    /// included (they go where the claim went).
    pub blocks: usize,
    outcome: watch::Receiver<Option<WorkerId>>,
}

impl Following {
    /// The worker the marked claim's request went to; `None` when the claim gave up (the
    /// request stayed where it was: so does the follower) or `timeout` passed.
    pub async fn outcome(mut self, timeout: std::time::Duration) -> Option<WorkerId> {
        match tokio::time::timeout(timeout, self.outcome.wait_for(Option::is_some)).await {
            Ok(Ok(w)) => w.clone(),
            _ => None,
        }
    }
}

impl InFlightClaims {
    /// Marks a close decision that holds `keys[held..]` on `worker` from now on and is about to
    /// claim. `None` when the holding added nothing (`held` ≥ the keys). Under the service's
    /// placement lock, with the holding. A second mark on the same key replaces the first
    /// (whose followers then stay where they are).
    pub fn mark(&self, keys: &[BlockKey], held: usize, worker: &WorkerId) -> Option<ClaimMark> {
        let key = keys.get(held)?.0;
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let (outcome, _) = watch::channel(None);
        self.marks.lock().insert(
            key,
            Mark {
                id,
                worker: worker.clone(),
                outcome,
            },
        );
        Some(ClaimMark { key, id })
    }

    /// A decision whose first choice `worker` holds its first `blocks` keys: if that chain
    /// reaches a mark's first key on `worker`, the wait for that mark's claim. O(`blocks`)
    /// hash lookups, none while no claim is in flight.
    pub fn follow(&self, keys: &[BlockKey], blocks: usize, worker: &WorkerId) -> Option<Following> {
        let marks = self.marks.lock();
        if marks.is_empty() {
            return None;
        }
        let blocks = blocks.min(keys.len());
        keys[..blocks].iter().find_map(|k| {
            let m = marks.get(&k.0).filter(|m| &m.worker == worker)?;
            Some(Following {
                blocks,
                outcome: m.outcome.subscribe(),
            })
        })
    }

    /// Ends `mark`: its followers learn `outcome` (`None`: they stay). Once per mark; a mark
    /// replaced since is left alone.
    pub fn resolve(&self, mark: ClaimMark, outcome: Option<WorkerId>) {
        let removed = {
            let mut marks = self.marks.lock();
            match marks.get(&mark.key) {
                Some(m) if m.id == mark.id => marks.remove(&mark.key),
                _ => None,
            }
        };
        if let (Some(m), Some(w)) = (removed, outcome) {
            m.outcome.send_replace(Some(w));
        }
    }

    /// Marks in flight.
    pub fn len(&self) -> usize {
        self.marks.lock().len()
    }

    /// Whether no claim is in flight.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Resolves a mark when dropped: with the outcome set, or as given up (a settling request that
/// ends early, or whose future is dropped, releases its followers at once).
pub struct Resolving<'a> {
    claims: &'a InFlightClaims,
    mark: Option<ClaimMark>,
    /// Where the claiming request went, once its claim settled.
    pub outcome: Option<WorkerId>,
}

impl<'a> Resolving<'a> {
    pub fn new(claims: &'a InFlightClaims, mark: Option<ClaimMark>) -> Resolving<'a> {
        Resolving {
            claims,
            mark,
            outcome: None,
        }
    }
}

impl Drop for Resolving<'_> {
    fn drop(&mut self) {
        if let Some(m) = self.mark.take() {
            self.claims.resolve(m, self.outcome.take());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn keys(n: u64, base: u64) -> Vec<BlockKey> {
        (0..n).map(|i| BlockKey(base + i)).collect()
    }

    fn rt() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap()
    }

    /// A follower whose chain reaches the mark's first added key on the marked worker waits
    /// for the outcome; one that stops short of it, or whose first choice is another worker,
    /// or whose chain differs, does not.
    #[test]
    fn followers_are_those_matched_into_the_marked_holding() {
        let claims = InFlightClaims::default();
        let (w1, w2) = (WorkerId("w1".into()), WorkerId("w2".into()));
        // The first block (a shared system prompt) was held on w1 before: the mark is on the
        // second key.
        let a = keys(10, 100);
        let mark = claims.mark(&a, 1, &w1).unwrap();
        assert_eq!(claims.len(), 1);
        let mut b = keys(6, 100);
        b.extend(keys(4, 900));
        assert_eq!(claims.follow(&b, 6, &w1).unwrap().blocks, 6);
        assert!(
            claims.follow(&b, 1, &w1).is_none(),
            "only the block held before"
        );
        assert!(claims.follow(&b, 6, &w2).is_none(), "another worker");
        let mut other = keys(1, 100);
        other.extend(keys(5, 500));
        assert!(claims.follow(&other, 6, &w1).is_none(), "another chain");
        // More blocks than keys: bounded by the keys.
        assert_eq!(claims.follow(&b, 99, &w1).unwrap().blocks, 10);
        claims.resolve(mark, Some(w2.clone()));
        assert!(claims.is_empty());
        assert!(claims.follow(&b, 6, &w1).is_none(), "resolved");
        // A holding that added nothing leaves no mark.
        assert!(claims.mark(&a, 10, &w1).is_none());
        assert!(claims.is_empty());
    }

    /// Followers learn where the claim went; a claim that gave up (or whose request ended)
    /// releases them at once with no outcome; one that never settles holds them at most the
    /// timeout.
    #[test]
    fn followers_learn_the_outcome_or_stay() {
        let rt = rt();
        let claims = InFlightClaims::default();
        let (w1, w3) = (WorkerId("w1".into()), WorkerId("w3".into()));
        let a = keys(8, 1);
        rt.block_on(async {
            let mark = claims.mark(&a, 0, &w1).unwrap();
            let f = claims.follow(&a, 8, &w1).unwrap();
            let late = claims.follow(&a, 4, &w1).unwrap();
            {
                let mut r = Resolving::new(&claims, Some(mark));
                r.outcome = Some(w3.clone());
            }
            assert_eq!(f.outcome(Duration::from_secs(5)).await, Some(w3.clone()));
            // Subscribed before the outcome, read after the mark is gone: still the outcome.
            assert_eq!(late.outcome(Duration::from_secs(5)).await, Some(w3.clone()));

            let mark = claims.mark(&a, 0, &w1).unwrap();
            let f = claims.follow(&a, 8, &w1).unwrap();
            drop(Resolving::new(&claims, Some(mark)));
            let t = std::time::Instant::now();
            assert_eq!(f.outcome(Duration::from_secs(5)).await, None);
            assert!(t.elapsed() < Duration::from_secs(1));

            let _mark = claims.mark(&a, 0, &w1).unwrap();
            let f = claims.follow(&a, 8, &w1).unwrap();
            assert_eq!(f.outcome(Duration::from_millis(20)).await, None);
        });
    }

    /// A second mark on the same key replaces the first: the first's resolution leaves the
    /// second alone, and the first's followers stay.
    #[test]
    fn a_replaced_mark_is_left_alone() {
        let rt = rt();
        let claims = InFlightClaims::default();
        let (w1, w2) = (WorkerId("w1".into()), WorkerId("w2".into()));
        let a = keys(4, 7);
        let first = claims.mark(&a, 0, &w1).unwrap();
        let f = claims.follow(&a, 4, &w1).unwrap();
        let second = claims.mark(&a, 0, &w2).unwrap();
        claims.resolve(first, Some(w2.clone()));
        assert_eq!(claims.len(), 1);
        assert!(claims.follow(&a, 4, &w2).is_some());
        assert_eq!(rt.block_on(f.outcome(Duration::from_secs(5))), None);
        claims.resolve(second, None);
        assert!(claims.is_empty());
    }
}
