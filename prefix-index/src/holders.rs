//! Compact sets of worker slots: which workers hold one block key.
//!
//! A set is a sorted list of 64-bit words `(word index, bits)`: slot `s` is bit `s % 64` of
//! word `s / 64`. Almost every key is held by workers whose slots fall in one word (64 workers
//! or fewer, or a shared prefix among neighbours), so that case is stored inline in 16 bytes
//! ([`Holders::One`]); other keys spill to a heap list.
//!
//! Complexity: insert / remove / contains are O(w) in the number of words of the set (1 almost
//! always); [`intersect_into`] is O(w_a + w_b).

/// One word of a slot set: slots `64 * .0 .. 64 * .0 + 63`, present where `.1` has a bit.
pub(crate) type Word = (u32, u64);

/// The set of worker slots that hold one key. Never empty while stored in a map.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Holders {
    /// All holders in one word (16 bytes with the tag).
    One { word: u32, bits: u64 },
    /// Holders in two or more words, sorted by word index, no zero words. Boxed on purpose
    /// (a thin pointer keeps the enum at 16 bytes; a bare `Vec` would make every entry 24).
    #[allow(clippy::box_collection)]
    Many(Box<Vec<Word>>),
}

#[inline]
fn split(slot: u32) -> (u32, u64) {
    (slot / 64, 1u64 << (slot % 64))
}

impl Holders {
    /// A set holding only `slot`.
    #[inline]
    pub(crate) fn single(slot: u32) -> Self {
        let (word, bit) = split(slot);
        Holders::One { word, bits: bit }
    }

    /// Calls `f` with the set's words as a slice (no allocation).
    #[inline]
    pub(crate) fn with_words<R>(&self, f: impl FnOnce(&[Word]) -> R) -> R {
        match self {
            Holders::One { word, bits } => f(&[(*word, *bits)]),
            Holders::Many(v) => f(v),
        }
    }

    /// Is `slot` in the set?
    pub(crate) fn contains(&self, slot: u32) -> bool {
        let (w, bit) = split(slot);
        match self {
            Holders::One { word, bits } => *word == w && bits & bit != 0,
            Holders::Many(v) => v
                .binary_search_by_key(&w, |x| x.0)
                .is_ok_and(|i| v[i].1 & bit != 0),
        }
    }

    /// Adds `slot`; true when it was not there.
    #[inline]
    pub(crate) fn insert(&mut self, slot: u32) -> bool {
        let (w, bit) = split(slot);
        match self {
            Holders::One { word, bits } if *word == w => {
                let new = *bits & bit == 0;
                *bits |= bit;
                new
            }
            Holders::One { word, bits } => {
                let mut v = vec![(*word, *bits), (w, bit)];
                v.sort_unstable_by_key(|x| x.0);
                *self = Holders::Many(Box::new(v));
                true
            }
            Holders::Many(v) => match v.binary_search_by_key(&w, |x| x.0) {
                Ok(i) => {
                    let new = v[i].1 & bit == 0;
                    v[i].1 |= bit;
                    new
                }
                Err(i) => {
                    v.insert(i, (w, bit));
                    true
                }
            },
        }
    }

    /// Removes `slot`; true when it was there. The set may become empty
    /// ([`Holders::is_empty`]); the caller then drops it from its map.
    #[inline]
    pub(crate) fn remove(&mut self, slot: u32) -> bool {
        let (w, bit) = split(slot);
        match self {
            Holders::One { word, bits } => {
                if *word == w && *bits & bit != 0 {
                    *bits &= !bit;
                    true
                } else {
                    false
                }
            }
            Holders::Many(v) => {
                let Ok(i) = v.binary_search_by_key(&w, |x| x.0) else {
                    return false;
                };
                if v[i].1 & bit == 0 {
                    return false;
                }
                v[i].1 &= !bit;
                if v[i].1 == 0 {
                    v.remove(i);
                }
                if v.len() == 1 {
                    let (word, bits) = v[0];
                    *self = Holders::One { word, bits };
                }
                true
            }
        }
    }

    /// True when no slot is left.
    #[inline]
    pub(crate) fn is_empty(&self) -> bool {
        match self {
            Holders::One { bits, .. } => *bits == 0,
            Holders::Many(v) => v.is_empty(),
        }
    }

    /// Heap bytes owned by this set beyond its inline 16 bytes.
    pub(crate) fn heap_bytes(&self) -> usize {
        match self {
            Holders::One { .. } => 0,
            Holders::Many(v) => {
                std::mem::size_of::<Vec<Word>>() + v.capacity() * std::mem::size_of::<Word>()
            }
        }
    }
}

/// Intersects the sorted word list `active` with `other` in place. Every slot that leaves
/// `active` is passed to `dropped`. O(len(active) + len(other)).
#[inline]
pub(crate) fn intersect_into(active: &mut Vec<Word>, other: &[Word], mut dropped: impl FnMut(u32)) {
    let mut j = 0;
    let mut keep = 0;
    for i in 0..active.len() {
        let (w, bits) = active[i];
        while j < other.len() && other[j].0 < w {
            j += 1;
        }
        let theirs = if j < other.len() && other[j].0 == w {
            other[j].1
        } else {
            0
        };
        let kept = bits & theirs;
        let mut gone = bits & !theirs;
        while gone != 0 {
            let b = gone.trailing_zeros();
            dropped(w * 64 + b);
            gone &= gone - 1;
        }
        if kept != 0 {
            active[keep] = (w, kept);
            keep += 1;
        }
    }
    active.truncate(keep);
}

/// Calls `f` for every slot of a word list.
#[inline]
pub(crate) fn for_each_slot(words: &[Word], mut f: impl FnMut(u32)) {
    for &(w, bits) in words {
        let mut b = bits;
        while b != 0 {
            f(w * 64 + b.trailing_zeros());
            b &= b - 1;
        }
    }
}

/// Builds a sorted word list from slots given in any order (appends to `out`, which must be
/// empty).
pub(crate) fn words_from_slots(slots: impl Iterator<Item = u32>, out: &mut Vec<Word>) {
    for s in slots {
        let (w, bit) = split(s);
        match out.binary_search_by_key(&w, |x| x.0) {
            Ok(i) => out[i].1 |= bit,
            Err(i) => out.insert(i, (w, bit)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    #[test]
    fn holders_is_16_bytes() {
        assert_eq!(std::mem::size_of::<Holders>(), 16);
    }

    #[test]
    fn insert_remove_across_words() {
        let mut h = Holders::single(3);
        assert!(!h.insert(3));
        assert!(h.insert(200));
        assert!(h.insert(64));
        assert!(matches!(h, Holders::Many(_)));
        assert!(h.contains(3) && h.contains(64) && h.contains(200) && !h.contains(4));
        let mut slots = vec![];
        h.with_words(|w| for_each_slot(w, |s| slots.push(s)));
        assert_eq!(slots, vec![3, 64, 200]);
        assert!(h.remove(200));
        assert!(!h.remove(200));
        assert!(h.remove(64));
        assert_eq!(h, Holders::single(3));
        assert!(h.remove(3));
        assert!(h.is_empty());
    }

    #[test]
    fn intersect_reports_dropped_slots() {
        let mut a = vec![];
        words_from_slots([1u32, 2, 70, 300].into_iter(), &mut a);
        let mut b = vec![];
        words_from_slots([2u32, 300, 500].into_iter(), &mut b);
        let mut dropped = BTreeSet::new();
        intersect_into(&mut a, &b, |s| {
            dropped.insert(s);
        });
        let mut kept = vec![];
        for_each_slot(&a, |s| kept.push(s));
        assert_eq!(kept, vec![2, 300]);
        assert_eq!(dropped.into_iter().collect::<Vec<_>>(), vec![1, 70]);
    }
}
