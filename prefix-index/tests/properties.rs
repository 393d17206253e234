//! Property tests (proptest): key chaining and longest-match results.

use std::collections::HashSet;

use prefix_index::{
    BlockKey, BlockSize, HashAlgorithm, IndexConfig, KeyChain, KvEvent, NamespaceInputs,
    PrefixIndex, WorkerId,
};
use proptest::prelude::*;

fn inputs<'a>(alg: HashAlgorithm, b: u32, salt: Option<&'a str>) -> NamespaceInputs<'a> {
    NamespaceInputs {
        model_id: "m",
        revision: "r",
        template_sha256: "t",
        tokenizer_sha256: "k",
        block_size: BlockSize::new(b).unwrap(),
        algorithm: alg,
        salt,
        adapter: None,
    }
}

fn alg() -> impl Strategy<Value = HashAlgorithm> {
    prop_oneof![Just(HashAlgorithm::Xxh3), Just(HashAlgorithm::Sha256)]
}

proptest! {
    #![proptest_config(ProptestConfig { failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn keys_of_a_prefix_are_a_prefix_of_the_keys(
        alg in alg(),
        b in 1u32..=32,
        tokens in proptest::collection::vec(any::<u32>(), 0..300),
        cut in 0usize..300,
    ) {
        let chain = KeyChain::from_inputs(&inputs(alg, b, None));
        let all = chain.keys(&tokens);
        prop_assert_eq!(all.len(), tokens.len() / b as usize);
        let cut = cut.min(tokens.len());
        let part = chain.keys(&tokens[..cut]);
        prop_assert_eq!(&all[..part.len()], &part[..]);
        prop_assert_eq!(part.len(), cut / b as usize);
    }

    #[test]
    fn incremental_chain_equals_batch(
        alg in alg(),
        b in 1u32..=80,
        tokens in proptest::collection::vec(any::<u32>(), 0..400),
    ) {
        let chain = KeyChain::from_inputs(&inputs(alg, b, Some("s")));
        let mut link = chain.root();
        let mut inc = Vec::new();
        for block in tokens.chunks_exact(b as usize) {
            link = chain.next(&link, block).unwrap();
            inc.push(link.key());
        }
        prop_assert_eq!(inc, chain.keys(&tokens));
    }

    #[test]
    fn a_changed_token_changes_its_block_and_every_later_key(
        alg in alg(),
        b in 1u32..=16,
        tokens in proptest::collection::vec(any::<u32>(), 1..200),
        pos in any::<proptest::sample::Index>(),
        delta in 1u32..,
    ) {
        let chain = KeyChain::from_inputs(&inputs(alg, b, None));
        let i = pos.index(tokens.len());
        let mut other = tokens.clone();
        other[i] = other[i].wrapping_add(delta);
        let (a, c) = (chain.keys(&tokens), chain.keys(&other));
        let first_changed = i / b as usize;
        for k in 0..a.len() {
            if k < first_changed {
                prop_assert_eq!(a[k], c[k]);
            } else {
                prop_assert_ne!(a[k], c[k]);
            }
        }
    }

    #[test]
    fn different_salts_share_no_key(
        alg in alg(),
        s1 in "[a-z]{0,6}",
        s2 in "[a-z]{0,6}",
        tokens in proptest::collection::vec(any::<u32>(), 16..160),
    ) {
        prop_assume!(s1 != s2);
        let k1: HashSet<BlockKey> =
            KeyChain::from_inputs(&inputs(alg, 16, Some(&s1))).keys(&tokens).into_iter().collect();
        let k2 = KeyChain::from_inputs(&inputs(alg, 16, Some(&s2))).keys(&tokens);
        prop_assert!(k2.iter().all(|k| !k1.contains(k)));
    }

    /// Workers hold random subsets of a chain (stored in random batches, some twice); the
    /// match of each worker is the length of the run of held keys from the chain's start.
    #[test]
    fn matches_are_the_held_prefix_run(
        holdings in proptest::collection::vec(
            (proptest::collection::vec(any::<bool>(), 0..24), 1usize..5, any::<bool>()),
            1..80,
        ),
        query_len in 0usize..24,
    ) {
        let idx = PrefixIndex::new(IndexConfig { shards: 8, ..IndexConfig::default() }).unwrap();
        let chain: Vec<BlockKey> = (0..24u64).map(|i| BlockKey(i.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 77)).collect();
        let mut want = Vec::new();
        for (wi, (held, batch, twice)) in holdings.iter().enumerate() {
            let id = WorkerId(format!("w{wi:03}"));
            idx.add_worker(&id);
            let keys: Vec<BlockKey> =
                held.iter().enumerate().filter(|(_, h)| **h).map(|(i, _)| chain[i]).collect();
            for _ in 0..(1 + usize::from(*twice)) {
                for part in keys.chunks(*batch) {
                    idx.apply_event(&id, &KvEvent::Stored { parent: None, keys: part.to_vec() }).unwrap();
                }
            }
            let run = held.iter().take(query_len).take_while(|h| **h).count();
            if run > 0 {
                want.push((id, run));
            }
            prop_assert_eq!(idx.worker_stats(&WorkerId(format!("w{wi:03}"))).unwrap().precise_blocks as usize, keys.len());
        }
        want.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
        let got: Vec<(WorkerId, usize)> = idx
            .longest_matches(&chain[..query_len])
            .into_iter()
            .map(|m| (m.worker, m.blocks))
            .collect();
        prop_assert_eq!(got, want);
    }
}
