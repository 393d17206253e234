//! Block keys of a 4,096-token prompt (B = 16 → 256 keys), xxh3 and sha256.
//! Targets on the 2-vCPU dev machine: ≤ 5 µs (xxh3), ≤ 50 µs (sha256).

use criterion::{black_box, criterion_group, criterion_main, Criterion, Throughput};
use prefix_index::{BlockKey, BlockSize, HashAlgorithm, KeyChain, NamespaceInputs};
use std::time::Duration;

fn keys(c: &mut Criterion) {
    let tokens: Vec<u32> = (0..4096u32)
        .map(|i| i.wrapping_mul(2_654_435_761) % 49_152)
        .collect();
    let mut g = c.benchmark_group("keys_4096_tokens_b16");
    g.throughput(Throughput::Elements(tokens.len() as u64));
    for alg in [HashAlgorithm::Xxh3, HashAlgorithm::Sha256] {
        let chain = KeyChain::from_inputs(&NamespaceInputs {
            model_id: "HuggingFaceTB/SmolLM2-135M-Instruct",
            revision: "main",
            template_sha256: "t",
            tokenizer_sha256: "k",
            block_size: BlockSize::default(),
            algorithm: alg,
            salt: Some("tenant"),
            adapter: None,
        });
        g.bench_function(alg.as_str(), |b| b.iter(|| chain.keys(black_box(&tokens))));
        let mut out: Vec<BlockKey> = Vec::new();
        g.bench_function(format!("{}_reuse_buffer", alg.as_str()), |b| {
            b.iter(|| {
                chain.keys_into(black_box(&tokens), &mut out);
                out.len()
            })
        });
        g.bench_function(format!("{}_incremental_next", alg.as_str()), |b| {
            b.iter(|| {
                let mut link = chain.root();
                for block in black_box(&tokens).chunks_exact(16) {
                    link = chain.next(&link, block).unwrap();
                }
                link.key()
            })
        });
    }
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().warm_up_time(Duration::from_secs(1)).measurement_time(Duration::from_secs(3)).sample_size(30);
    targets = keys
}
criterion_main!(benches);
