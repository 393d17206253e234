//! Reproduces every test vector of `docs/block-keys.md` (read from the document itself, so the
//! document and the code cannot drift apart), in batch and incremental form.

use prefix_index::{BlockSize, HashAlgorithm, KeyChain, NamespaceInputs, NamespaceSeed};
use serde::Deserialize;

#[derive(Deserialize)]
struct Vector {
    name: String,
    model_id: String,
    revision: String,
    template_sha256: String,
    tokenizer_sha256: String,
    block_size: BlockSize,
    algorithm: HashAlgorithm,
    salt: Option<String>,
    adapter: Option<String>,
    tokens: Vec<u32>,
    seed_input: String,
    seed: NamespaceSeed,
    keys: Vec<String>,
}

fn doc_vectors() -> Vec<Vector> {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/block-keys.md");
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("reading {path}: {e}"));
    let marker = "```json vectors";
    let start = text
        .find(marker)
        .expect("vector block in docs/block-keys.md")
        + marker.len();
    let len = text[start..].find("```").expect("end of vector block");
    serde_json::from_str(&text[start..start + len]).expect("vectors are valid JSON")
}

#[test]
fn vectors_from_docs() {
    let vectors = doc_vectors();
    assert!(
        vectors.len() >= 6,
        "the document must keep at least 6 vectors"
    );
    let mut algs = std::collections::HashSet::new();
    let mut sizes = std::collections::HashSet::new();
    let (mut salted, mut unsalted, mut long_chain) = (false, false, false);
    for v in &vectors {
        let inputs = NamespaceInputs {
            model_id: &v.model_id,
            revision: &v.revision,
            template_sha256: &v.template_sha256,
            tokenizer_sha256: &v.tokenizer_sha256,
            block_size: v.block_size,
            algorithm: v.algorithm,
            salt: v.salt.as_deref(),
            adapter: v.adapter.as_deref(),
        };
        assert_eq!(
            hex::encode(NamespaceSeed::encode_inputs(&inputs)),
            v.seed_input,
            "{}: seed input",
            v.name
        );
        let chain = KeyChain::from_inputs(&inputs);
        assert_eq!(chain.seed(), v.seed, "{}: seed", v.name);
        let keys: Vec<String> = chain
            .keys(&v.tokens)
            .iter()
            .map(|k| k.to_string())
            .collect();
        assert_eq!(keys, v.keys, "{}: keys", v.name);
        // incremental form gives the same keys
        let mut link = chain.root();
        for (block, want) in v.tokens.chunks_exact(v.block_size.get()).zip(&v.keys) {
            link = chain.next(&link, block).unwrap();
            assert_eq!(&link.key().to_string(), want, "{}: incremental", v.name);
        }
        algs.insert(v.algorithm);
        sizes.insert(v.block_size.get());
        salted |= v.salt.is_some();
        unsalted |= v.salt.is_none();
        long_chain |= v.keys.len() >= 3;
    }
    assert_eq!(algs.len(), 2, "both algorithms covered");
    assert!(
        sizes.contains(&16) && sizes.contains(&4),
        "B = 16 and B = 4 covered"
    );
    assert!(
        salted && unsalted && long_chain,
        "salt / no salt / ≥ 3-block chain covered"
    );
}
