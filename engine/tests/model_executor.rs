//! Model-backed tests of the paged, batched executor against the plain uncached reference
//! forward, and a golden test pinning SmolLM2's greedy output. Needs the default model at
//! `$KVGATE_MODEL_DIR` or `<workspace>/models/` (fails with a message when missing).

use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

use engine::executor::{BlockId, Executor, KvGeometry, SeqChunk};
use engine::model::{reference, LlamaExecutor, LlamaWeights, WeightFormat};

const MODEL_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

fn model_path() -> PathBuf {
    let dir = std::env::var_os("KVGATE_MODEL_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models"));
    let p = dir.join(MODEL_FILE);
    assert!(
        p.is_file(),
        "model file {} is missing: fetch it (see README) or set KVGATE_MODEL_DIR",
        p.display()
    );
    p
}

fn weights(format: WeightFormat) -> Arc<LlamaWeights> {
    static F32: OnceLock<Arc<LlamaWeights>> = OnceLock::new();
    static DEFAULT: OnceLock<Arc<LlamaWeights>> = OnceLock::new();
    let cell = match format {
        WeightFormat::F32 => &F32,
        WeightFormat::CPU_DEFAULT => &DEFAULT,
        other => panic!("no cached weights for {other:?}"),
    };
    Arc::clone(cell.get_or_init(|| {
        Arc::new(LlamaWeights::load(model_path(), &candle_core::Device::Cpu, format).unwrap())
    }))
}

/// ChatML for system "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
/// and user "What is the capital of France?", with the assistant turn opened. Encoded with a
/// tokenizer built from the GGUF's own token list and merges (BPE, `\p{N}` split + ByteLevel
/// pre-tokenizer, control tokens as specials); decoding these ids round-trips to the text.
const CHAT_PROMPT: [u32; 37] = [
    1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407,
    19712, 8182, 2, 198, 1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531,
    198,
];

// The comparisons against the reference use F32 weights (the default `Exact` format computes
// the same products, see `prefix_cached_greedy_equals_uncached_default_format`): with Q8_0
// weights candle's kernel
// also quantizes activations to 8 bits per 32-value block, which turns the last-bit
// differences between two correct attention implementations (summation order, RoPE angles in
// f64 vs f32) into logit differences of up to ~2 at 37 tokens (measured), so only the F32
// path supports a tight tolerance. Both paths share the same matmul code.

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// One sequence driven through the executor.
struct Seq {
    tokens: Vec<u32>,
    prompt_len: usize,
    /// Positions already in the KV cache.
    done: usize,
    table: Vec<BlockId>,
    chunk: usize,
    /// Step at which the sequence joins the batch.
    join_at: usize,
    first_logits: Option<Vec<f32>>,
}

/// Runs all sequences together: chunked prefill, then batched greedy decode of `n_new` tokens,
/// each step one forward over every active sequence. Returns the generated tokens.
fn run_batched(exec: &mut LlamaExecutor, seqs: &mut [Seq], n_new: usize) -> Vec<Vec<u32>> {
    let mut step = 0;
    loop {
        let mut plan = Vec::new();
        for (i, s) in seqs.iter().enumerate() {
            if step < s.join_at || s.tokens.len() >= s.prompt_len + n_new {
                continue;
            }
            let end = if s.done < s.prompt_len {
                (s.done + s.chunk).min(s.prompt_len)
            } else {
                s.tokens.len()
            };
            plan.push((i, s.done, end));
        }
        if plan.is_empty() && seqs.iter().all(|s| step >= s.join_at) {
            break;
        }
        let chunks: Vec<SeqChunk<'_>> = plan
            .iter()
            .map(|&(i, start, end)| SeqChunk {
                tokens: &seqs[i].tokens[start..end],
                start_pos: start,
                block_table: &seqs[i].table,
                want_logits: end >= seqs[i].prompt_len,
            })
            .collect();
        let out = if chunks.is_empty() {
            Vec::new()
        } else {
            exec.forward(&chunks).unwrap()
        };
        drop(chunks);
        assert_eq!(out.len(), plan.len());
        for (&(i, _, end), logits) in plan.iter().zip(out) {
            let s = &mut seqs[i];
            s.done = end;
            if end >= s.prompt_len {
                let logits = logits.expect("logits requested");
                s.first_logits.get_or_insert_with(|| logits.clone());
                s.tokens.push(reference::argmax(&logits));
            } else {
                assert!(logits.is_none(), "logits not requested");
            }
        }
        step += 1;
    }
    seqs.iter()
        .map(|s| s.tokens[s.prompt_len..].to_vec())
        .collect()
}

/// Block tables drawn from a shuffled pool so that positions are scattered over the cache.
fn scattered_tables(
    lens: &[usize],
    block_size: usize,
    num_blocks: usize,
    seed: u64,
) -> Vec<Vec<BlockId>> {
    let mut ids: Vec<BlockId> = (0..num_blocks as BlockId).collect();
    let mut s = seed | 1;
    for i in (1..ids.len()).rev() {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        ids.swap(i, (s % (i as u64 + 1)) as usize);
    }
    let mut next = 0;
    lens.iter()
        .map(|&l| {
            let n = l.div_ceil(block_size);
            let t = ids[next..next + n].to_vec();
            next += n;
            t
        })
        .collect()
}

#[test]
fn paged_batched_chunked_prefill_matches_reference() {
    let seed = 20_251_129u64;
    println!("block shuffle seed {seed}");
    let w = weights(WeightFormat::F32);
    let n_new = 6;
    let prompts: Vec<Vec<u32>> = vec![
        CHAT_PROMPT.to_vec(),
        CHAT_PROMPT[21..].to_vec(),
        // "<|im_start|>user\nHi! Name three colors.<|im_end|>\n<|im_start|>assistant\n"
        vec![
            1, 4093, 198, 26843, 17, 10181, 1296, 4683, 30, 2, 198, 1, 520, 9531, 198,
        ],
    ];
    let chunk_sizes = [7, 13, 64];
    let join_at = [0, 1, 3];
    let block_size = 5;
    let lens: Vec<usize> = prompts.iter().map(|p| p.len() + n_new).collect();
    let num_blocks = 40;
    let tables = scattered_tables(&lens, block_size, num_blocks, seed);
    let mut exec = LlamaExecutor::new(
        Arc::clone(&w),
        KvGeometry {
            block_size,
            num_blocks,
        },
    )
    .unwrap();
    let mut seqs: Vec<Seq> = prompts
        .iter()
        .zip(tables)
        .enumerate()
        .map(|(i, (p, table))| Seq {
            tokens: p.clone(),
            prompt_len: p.len(),
            done: 0,
            table,
            chunk: chunk_sizes[i],
            join_at: join_at[i],
            first_logits: None,
        })
        .collect();
    let got = run_batched(&mut exec, &mut seqs, n_new);
    for (i, (p, s)) in prompts.iter().zip(&seqs).enumerate() {
        let want_logits = reference::last_logits(&w, p).unwrap();
        let diff = max_abs_diff(s.first_logits.as_ref().unwrap(), &want_logits);
        println!("sequence {i}: first-token logits max |diff| {diff}");
        assert!(diff < 1e-3, "sequence {i}: logits differ by {diff}");
        let want = reference::greedy(&w, p, n_new).unwrap();
        assert_eq!(got[i], want, "sequence {i}: greedy tokens differ");
    }
}

#[test]
fn prefix_reuse_matches_reference() {
    let w = weights(WeightFormat::F32);
    let block_size = 8;
    let mut exec = LlamaExecutor::new(
        Arc::clone(&w),
        KvGeometry {
            block_size,
            num_blocks: 16,
        },
    )
    .unwrap();
    // A: the chat prompt (37 tokens) in blocks 9, 3, 12, 0, 5.
    let a_table: Vec<BlockId> = vec![9, 3, 12, 0, 5];
    exec.forward(&[SeqChunk {
        tokens: &CHAT_PROMPT,
        start_pos: 0,
        block_table: &a_table,
        want_logits: true,
    }])
    .unwrap();
    // B shares A's first 32 tokens (4 full blocks), then a second user turn:
    // "\n<|im_start|>user\nWhat is the capital of Germany?<|im_end|>\n<|im_start|>assistant\n".
    let mut b = CHAT_PROMPT[..32].to_vec();
    b.extend_from_slice(&[
        198, 1, 4093, 198, 1780, 314, 260, 3575, 282, 4521, 47, 2, 198, 1, 520, 9531, 198,
    ]);
    let mut b_table = a_table[..4].to_vec();
    b_table.extend_from_slice(&[7, 14, 2]);
    let out = exec
        .forward(&[SeqChunk {
            tokens: &b[32..],
            start_pos: 32,
            block_table: &b_table,
            want_logits: true,
        }])
        .unwrap();
    let got = out[0].clone().unwrap();
    let want = reference::last_logits(&w, &b).unwrap();
    let diff = max_abs_diff(&got, &want);
    println!("prefix reuse: logits max |diff| {diff}");
    assert!(diff < 1e-3, "logits differ by {diff}");
    assert_eq!(reference::argmax(&got), reference::argmax(&want));
}

/// Prefills `prompt[cached..]` in one step (positions `0..cached` must already be in `table`'s
/// blocks), then decodes `n_new` tokens one step at a time. Returns the greedy tokens.
fn greedy_paged(
    exec: &mut LlamaExecutor,
    prompt: &[u32],
    table: &[BlockId],
    cached: usize,
    n_new: usize,
) -> Vec<u32> {
    let mut tokens = prompt.to_vec();
    let mut done = cached;
    for _ in 0..n_new {
        let out = exec
            .forward(&[SeqChunk {
                tokens: &tokens[done..],
                start_pos: done,
                block_table: table,
                want_logits: true,
            }])
            .unwrap();
        done = tokens.len();
        tokens.push(reference::argmax(out[0].as_ref().unwrap()));
    }
    tokens[prompt.len()..].to_vec()
}

/// With the DEFAULT weight format, a prompt whose prefix is served from the KV cache gives the
/// same greedy tokens as the same prompt prefilled uncached in one step — even though the
/// uncached prefill of a long prompt and the short cached remainder take different matmul
/// paths (dense GEMM vs the packed kernel). Checked for the golden prompt (cached from its own
/// earlier run), a second chat that shares the golden prompt's first 32 tokens (cached from
/// the golden run) and a short prompt (one cached block).
#[test]
fn prefix_cached_greedy_equals_uncached_default_format() {
    let w = weights(WeightFormat::CPU_DEFAULT);
    let bs = 8;
    let mut exec = LlamaExecutor::new(
        Arc::clone(&w),
        KvGeometry {
            block_size: bs,
            num_blocks: 64,
        },
    )
    .unwrap();
    let mut germany = CHAT_PROMPT[..32].to_vec();
    germany.extend_from_slice(&[
        198, 1, 4093, 198, 1780, 314, 260, 3575, 282, 4521, 47, 2, 198, 1, 520, 9531, 198,
    ]);
    let colors: Vec<u32> = vec![
        1, 4093, 198, 26843, 17, 10181, 1296, 4683, 30, 2, 198, 1, 520, 9531, 198,
    ];
    let mut next_block: BlockId = 0;
    let mut take = |tokens: usize| -> Vec<BlockId> {
        let n = tokens.div_ceil(bs) as BlockId;
        let t = (next_block..next_block + n).collect();
        next_block += n;
        t
    };
    // Uncached golden run; its first 4 blocks (positions 0..32) become the cached prefix.
    let n_golden = 16;
    let golden_table = take(CHAT_PROMPT.len() + n_golden);
    let uncached = greedy_paged(&mut exec, &CHAT_PROMPT, &golden_table, 0, n_golden);
    assert_eq!(uncached, GOLDEN, "uncached golden run");
    let mut cached_table = golden_table[..4].to_vec();
    cached_table.extend(take(CHAT_PROMPT.len() + n_golden - 32));
    let cached = greedy_paged(&mut exec, &CHAT_PROMPT, &cached_table, 32, n_golden);
    assert_eq!(cached, uncached, "golden prompt: cached vs uncached");

    let n_new = 8;
    let table = take(germany.len() + n_new);
    let uncached = greedy_paged(&mut exec, &germany, &table, 0, n_new);
    let mut cached_table = golden_table[..4].to_vec();
    cached_table.extend(take(germany.len() + n_new - 32));
    let cached = greedy_paged(&mut exec, &germany, &cached_table, 32, n_new);
    println!("germany: {uncached:?}");
    assert_eq!(cached, uncached, "shared-prefix prompt: cached vs uncached");

    let table = take(colors.len() + n_new);
    let uncached = greedy_paged(&mut exec, &colors, &table, 0, n_new);
    let mut cached_table = table[..1].to_vec();
    cached_table.extend(take(colors.len() + n_new - bs));
    let cached = greedy_paged(&mut exec, &colors, &cached_table, bs, n_new);
    println!("colors: {uncached:?}");
    assert_eq!(cached, uncached, "short prompt: cached vs uncached");
}

#[test]
fn golden_smollm2_first_16_greedy_tokens() {
    let w = weights(WeightFormat::CPU_DEFAULT);
    let mut exec = LlamaExecutor::new(
        Arc::clone(&w),
        KvGeometry {
            block_size: 16,
            num_blocks: 4,
        },
    )
    .unwrap();
    let mut seqs = vec![Seq {
        tokens: CHAT_PROMPT.to_vec(),
        prompt_len: CHAT_PROMPT.len(),
        done: 0,
        table: vec![3, 1, 0, 2],
        chunk: CHAT_PROMPT.len(),
        join_at: 0,
        first_logits: None,
    }];
    let got = run_batched(&mut exec, &mut seqs, 16).remove(0);
    println!("{got:?}");
    assert_eq!(got, GOLDEN);
}

/// SmolLM2-135M-Instruct's greedy continuation of [`CHAT_PROMPT`] with the default CPU weights
/// (`WeightFormat::Exact`: the file's weights exactly, F32 activations; the same tokens as the
/// earlier dense-F32-prefill / Q8_0-decode default and as the F32 reference): "The capital of France is Paris." then
/// `<|im_end|>` (id 2) — the engine would stop there; the raw executor keeps going with
/// "\n<|im_end|><|im_start|>system\n<|im_end|>\n<|im_start|>".
const GOLDEN: [u32; 16] = [
    504, 3575, 282, 4649, 314, 7042, 30, 2, 198, 2, 1, 9690, 198, 2, 198, 1,
];
