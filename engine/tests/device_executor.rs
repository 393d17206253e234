//! The device executor (candle tensor ops, device-resident paged KV cache) on the CPU, checked
//! against the tuned CPU executor: the same greedy tokens on the golden prompts — cold, chunked,
//! prefix-cached and batched with decodes attended together — and close logits; and the same
//! on a generated model of every architecture (biases, per-head norms, partial rotary,
//! sliding windows, post-norms, GELU). On a GPU the same comparisons run from
//! `scripts/gpu-check.sh` (`engine/examples/gpu_check.rs`).
//!
//! Tolerance: the tuned executor multiplies with its own kernels (packed blocks below 32 tokens
//! per step, a panel GEMM above) and attends with its own summation order; this executor uses
//! candle's GEMM and softmax. Both are F32 throughout, so logits differ by summation order
//! only: measured at most 6e-5 on SmolLM2 (logits of magnitude ~20) and 2.2e-6 on the
//! generated models (2026-12-04); the bounds below leave about 10× room.

use std::sync::Arc;

use candle_core::{DType, Device};
use engine::executor::{BlockId, Executor, KvGeometry, SeqChunk};
use engine::model::{AttentionKind, DeviceExecutor, LlamaExecutor, LlamaWeights, WeightFormat};
use engine::EngineError;

mod model_common;
use model_common::*;

const SMOLLM2_LOGIT_TOL: f32 = 6e-4;
const TINY_LOGIT_TOL: f32 = 2e-5;

fn device_exec(w: &Arc<LlamaWeights>, block_size: usize, num_blocks: usize) -> DeviceExecutor {
    DeviceExecutor::new(
        Arc::clone(w),
        KvGeometry {
            block_size,
            num_blocks,
        },
        AttentionKind::Composed,
    )
    .unwrap()
}

/// Runs `prompts` through `exec` together (chunk sizes 7/13/64, joining at steps 0/1/3, block
/// tables scattered over the cache): returns each one's greedy tokens and first logits.
fn batched(
    exec: &mut dyn Executor,
    prompts: &[Vec<u32>],
    n_new: usize,
    block_size: usize,
    num_blocks: usize,
) -> (Vec<Vec<u32>>, Vec<Vec<f32>>) {
    let lens: Vec<usize> = prompts.iter().map(|p| p.len() + n_new).collect();
    let tables = scattered_tables(&lens, block_size, num_blocks, 20_261_204);
    let chunks = [7, 13, 64];
    let joins = [0, 1, 3];
    let mut seqs: Vec<Seq> = prompts
        .iter()
        .zip(tables)
        .enumerate()
        .map(|(i, (p, table))| Seq {
            tokens: p.clone(),
            prompt_len: p.len(),
            done: 0,
            table,
            chunk: chunks[i % 3],
            join_at: joins[i % 3],
            first_logits: None,
        })
        .collect();
    let got = run_batched(exec, &mut seqs, n_new).unwrap();
    let logits = seqs
        .into_iter()
        .map(|s| s.first_logits.expect("logits"))
        .collect();
    (got, logits)
}

/// Cold greedy tokens and first logits of one prompt, prefilled in one step.
fn cold(
    exec: &mut dyn Executor,
    prompt: &[u32],
    n_new: usize,
    table: &[BlockId],
) -> (Vec<u32>, Vec<f32>) {
    let first = exec
        .forward(&[SeqChunk {
            tokens: prompt,
            start_pos: 0,
            block_table: table,
            want_logits: true,
            all_logits: false,
        }])
        .unwrap()
        .remove(0)
        .unwrap();
    // greedy_paged recomputes from position 0 into the same blocks: same values.
    (greedy_paged(exec, prompt, table, 0, n_new).unwrap(), first)
}

#[test]
fn device_executor_on_cpu_gives_the_tuned_executors_greedy_tokens_on_smollm2() {
    let tuned = Arc::new(
        LlamaWeights::load(model_path(), &Device::Cpu, WeightFormat::CPU_DEFAULT).unwrap(),
    );
    let dense = Arc::new(
        LlamaWeights::load(model_path(), &Device::Cpu, WeightFormat::Device(DType::F32)).unwrap(),
    );
    let prompts = vec![
        CHAT_PROMPT.to_vec(),
        germany_prompt(),
        COLORS_PROMPT.to_vec(),
    ];
    let n_new = 16;
    let (bs, nb) = (8, 96);

    // The tuned executor's cold runs are the reference.
    let mut reference = LlamaExecutor::new(
        Arc::clone(&tuned),
        KvGeometry {
            block_size: bs,
            num_blocks: nb,
        },
    )
    .unwrap();
    let table: Vec<BlockId> =
        (0..((CHAT_PROMPT.len() + n_new).div_ceil(bs) + 4) as BlockId).collect();
    let mut want = Vec::new();
    let mut want_logits = Vec::new();
    for p in &prompts {
        let (t, l) = cold(&mut reference, p, n_new, &table);
        want.push(t);
        want_logits.push(l);
    }
    assert_eq!(want[0], GOLDEN, "the tuned executor's golden tokens");

    let mut exec = device_exec(&dense, bs, nb);
    // Cold, one step per prompt (the chat's blocks 0.. stay filled for the cached runs).
    for (i, p) in prompts.iter().enumerate() {
        let (t, l) = cold(&mut exec, p, n_new, &table);
        let diff = max_abs_diff(&l, &want_logits[i]);
        println!("prompt {i}: cold, first logits max |diff| {diff}");
        assert!(
            diff < SMOLLM2_LOGIT_TOL,
            "prompt {i}: logits differ by {diff}"
        );
        assert_eq!(t, want[i], "prompt {i}: cold greedy tokens");
    }
    // The argmax taken by the executor (forward_sampled: what the engine asks for greedy
    // requests) gives the same tokens.
    for (i, p) in prompts.iter().enumerate() {
        let got = greedy_sampled(&mut exec, p, &table, 0, n_new).unwrap();
        assert_eq!(got, want[i], "prompt {i}: argmax by the executor");
    }
    // Prefix-cached: the chat prompt's first 4 blocks (32 positions) are in the cache.
    let chat_table: Vec<BlockId> =
        (0..((CHAT_PROMPT.len() + n_new).div_ceil(bs)) as BlockId).collect();
    let _ = cold(&mut exec, &CHAT_PROMPT, 1, &chat_table);
    for (i, p) in prompts.iter().enumerate().take(2) {
        let mut t = chat_table[..4].to_vec();
        let base = 40 + 10 * i as BlockId;
        t.extend((0..((p.len() + n_new).div_ceil(bs) - 4) as BlockId).map(|b| base + b));
        let got = greedy_paged(&mut exec, p, &t, 32, n_new).unwrap();
        assert_eq!(got, want[i], "prompt {i}: 32 cached tokens");
    }
    // A block copy (the scheduler's reuse of a cached block's first tokens): the chat's block 4
    // (positions 32..40) copied to block 80, then positions 35.. recomputed over it.
    exec.copy_block(chat_table[4], 80).unwrap();
    let mut t = chat_table[..4].to_vec();
    t.push(80);
    t.extend((0..((CHAT_PROMPT.len() + n_new).div_ceil(bs) - 5) as BlockId).map(|b| 81 + b));
    let got = greedy_paged(&mut exec, &CHAT_PROMPT, &t, 35, n_new).unwrap();
    assert_eq!(
        got, want[0],
        "35 cached tokens, 3 of them through a block copy"
    );
    // Chunked and batched: prefill chunks of 7/13/64 beside decodes, decodes attended together.
    let mut fresh = device_exec(&dense, bs, nb);
    let (got, logits) = batched(&mut fresh, &prompts, n_new, bs, nb);
    for i in 0..prompts.len() {
        let diff = max_abs_diff(&logits[i], &want_logits[i]);
        println!("prompt {i}: batched, first logits max |diff| {diff}");
        assert!(
            diff < SMOLLM2_LOGIT_TOL,
            "prompt {i}: batched logits differ by {diff}"
        );
        assert_eq!(
            got[i], want[i],
            "prompt {i}: chunked + batched greedy tokens"
        );
    }
}

#[test]
fn device_executor_on_cpu_matches_the_cpu_executor_on_every_architecture() {
    let dir = tempfile::tempdir().unwrap();
    for arch in [
        "llama",
        "llama3",
        "qwen2",
        "qwen3",
        "phi3",
        "gemma3",
        "llama-q4_1",
    ] {
        let path = dir.path().join(format!("{arch}.gguf"));
        engine::model::tiny::write_tiny_gguf(arch, &model_path(), &path).unwrap();
        let cpu = Arc::new(LlamaWeights::load(&path, &Device::Cpu, WeightFormat::F32).unwrap());
        let dense = Arc::new(
            LlamaWeights::load(&path, &Device::Cpu, WeightFormat::Device(DType::F32)).unwrap(),
        );
        // Prompts longer than gemma3's 4-position window, with ids across the vocabulary.
        let prompts: Vec<Vec<u32>> = [(11usize, 3u32), (23, 7), (9, 11)]
            .iter()
            .map(|&(n, k)| {
                (0..n as u32)
                    .map(|i| (i * 7919 * k + 13) % 49_000)
                    .collect()
            })
            .collect();
        let (bs, nb) = (4, 64);
        let n_new = 8;
        let geometry = KvGeometry {
            block_size: bs,
            num_blocks: nb,
        };
        let mut reference = LlamaExecutor::new(Arc::clone(&cpu), geometry).unwrap();
        let (want, want_logits) = batched(&mut reference, &prompts, n_new, bs, nb);
        let mut exec = device_exec(&dense, bs, nb);
        let (got, logits) = batched(&mut exec, &prompts, n_new, bs, nb);
        for i in 0..prompts.len() {
            let diff = max_abs_diff(&logits[i], &want_logits[i]);
            println!("{arch} prompt {i}: first logits max |diff| {diff}");
            assert!(
                diff < TINY_LOGIT_TOL,
                "{arch} prompt {i}: logits differ by {diff}"
            );
            assert_eq!(got[i], want[i], "{arch} prompt {i}: greedy tokens");
        }
        // Decoding alone, one sequence per step (no batch): the per-chunk path.
        let table: Vec<BlockId> = (0..16).collect();
        let mut solo = device_exec(&dense, bs, nb);
        let (t, _) = cold(&mut solo, &prompts[1], n_new, &table);
        assert_eq!(t, want[1], "{arch}: one sequence alone");
    }
}

#[test]
fn device_executor_refuses_what_it_cannot_run() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("llama.gguf");
    engine::model::tiny::write_tiny_gguf("llama", &model_path(), &path).unwrap();
    let geometry = KvGeometry {
        block_size: 4,
        num_blocks: 8,
    };
    // Weights for the host kernels have no device copy to run from.
    let host =
        Arc::new(LlamaWeights::load(&path, &Device::Cpu, WeightFormat::CPU_DEFAULT).unwrap());
    let e = DeviceExecutor::new(Arc::clone(&host), geometry, AttentionKind::Composed).unwrap_err();
    assert!(matches!(e, EngineError::Model(_)), "{e}");
    let dense = Arc::new(
        LlamaWeights::load(&path, &Device::Cpu, WeightFormat::Device(DType::F32)).unwrap(),
    );
    // The fused kernels are CUDA code.
    let e = DeviceExecutor::new(Arc::clone(&dense), geometry, AttentionKind::Fused).unwrap_err();
    assert!(e.to_string().contains("CUDA"), "{e}");
    // Bad chunks are refused before anything runs, as by the CPU executor.
    let mut exec = device_exec(&dense, 4, 8);
    let bad_block = exec
        .forward(&[SeqChunk {
            tokens: &[1, 2, 3],
            start_pos: 0,
            block_table: &[8],
            want_logits: true,
            all_logits: false,
        }])
        .unwrap_err();
    assert!(
        matches!(bad_block, EngineError::InvalidRequest(_)),
        "{bad_block}"
    );
    let bad_token = exec
        .forward(&[SeqChunk {
            tokens: &[u32::MAX],
            start_pos: 0,
            block_table: &[0],
            want_logits: true,
            all_logits: false,
        }])
        .unwrap_err();
    assert!(
        matches!(bad_token, EngineError::InvalidRequest(_)),
        "{bad_token}"
    );
    let short_table = exec
        .forward(&[SeqChunk {
            tokens: &[1, 2, 3, 4, 5],
            start_pos: 0,
            block_table: &[0],
            want_logits: true,
            all_logits: false,
        }])
        .unwrap_err();
    assert!(
        matches!(short_table, EngineError::InvalidRequest(_)),
        "{short_table}"
    );
}

/// `all_logits` on the device executor: every row equals the tuned executor's row for the same
/// prompt (a chunk that wants every row is never given back as an argmax, even when flagged),
/// and a batched chunk flagged for its argmax still gets the tuned executor's greedy token.
#[test]
fn every_rows_logits_on_the_device_executor_equal_the_tuned_executors() {
    let tuned = Arc::new(
        LlamaWeights::load(model_path(), &Device::Cpu, WeightFormat::CPU_DEFAULT).unwrap(),
    );
    let dense = Arc::new(
        LlamaWeights::load(model_path(), &Device::Cpu, WeightFormat::Device(DType::F32)).unwrap(),
    );
    let (bs, nb) = (8, 16);
    let a_table: Vec<BlockId> = vec![9, 3, 12, 0, 5];
    let b_table: Vec<BlockId> = vec![1, 2, 4];
    let chunks = [
        SeqChunk {
            tokens: &CHAT_PROMPT,
            start_pos: 0,
            block_table: &a_table,
            want_logits: true,
            all_logits: true,
        },
        SeqChunk {
            tokens: &COLORS_PROMPT,
            start_pos: 0,
            block_table: &b_table,
            want_logits: true,
            all_logits: false,
        },
    ];
    let mut reference = LlamaExecutor::new(
        Arc::clone(&tuned),
        KvGeometry {
            block_size: bs,
            num_blocks: nb,
        },
    )
    .unwrap();
    let want = reference.forward(&chunks).unwrap();
    let want_rows = want[0].clone().unwrap();
    let want_b = engine::sampler::argmax(want[1].as_ref().unwrap());
    let mut exec = device_exec(&dense, bs, nb);
    let got = exec.forward_sampled(&chunks, &[true, true]).unwrap();
    let vocab = exec.vocab_size();
    match (&got[0], &got[1]) {
        (
            Some(engine::executor::Sampled::Logits(rows)),
            Some(engine::executor::Sampled::Token(b)),
        ) => {
            assert_eq!(rows.len(), CHAT_PROMPT.len() * vocab, "one row per token");
            let diff = max_abs_diff(rows, &want_rows);
            println!("every row: logits max |diff| {diff}");
            assert!(diff < SMOLLM2_LOGIT_TOL, "rows differ by {diff}");
            for (i, (g, w)) in rows
                .chunks_exact(vocab)
                .zip(want_rows.chunks_exact(vocab))
                .enumerate()
            {
                // Where the tuned executor's top two are further apart than the tolerance
                // (a nearer tie may flip within it).
                let mut sorted = w.to_vec();
                sorted.sort_by(|a, b| b.total_cmp(a));
                if sorted[0] - sorted[1] > 2.0 * SMOLLM2_LOGIT_TOL {
                    assert_eq!(
                        engine::sampler::argmax(g),
                        engine::sampler::argmax(w),
                        "row {i}'s greedy token"
                    );
                }
            }
            assert_eq!(*b, want_b, "the argmax chunk's token");
        }
        other => panic!(
            "expected every row's logits and an argmax, got {:?}",
            other.0.is_some()
        ),
    }
}
