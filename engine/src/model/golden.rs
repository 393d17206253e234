//! The golden prompts of SmolLM2-135M-Instruct and drivers that run them through any
//! [`Executor`]: used by the executors' tests, by `engine/examples/gpu_check.rs` (device vs CPU
//! on a GPU) and by the engine benchmark's callers. Token ids are the chat template rendered
//! and tokenized by the default model's own profile.

use crate::executor::{BlockId, Executor, Sampled, SeqChunk};
use crate::model::reference;
use crate::EngineError;

/// ChatML for system "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
/// and user "What is the capital of France?", with the assistant turn opened. Encoded with a
/// tokenizer built from the GGUF's own token list and merges (BPE, `\p{N}` split + ByteLevel
/// pre-tokenizer, control tokens as specials); decoding these ids round-trips to the text.
pub const CHAT_PROMPT: [u32; 37] = [
    1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407,
    19712, 8182, 2, 198, 1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531,
    198,
];

/// The golden prompt's first 32 tokens, then a second user turn: "\n<|im_start|>user\nWhat is
/// the capital of Germany?<|im_end|>\n<|im_start|>assistant\n" (shares 4 blocks of 8).
pub fn germany_prompt() -> Vec<u32> {
    let mut b = CHAT_PROMPT[..32].to_vec();
    b.extend_from_slice(&[
        198, 1, 4093, 198, 1780, 314, 260, 3575, 282, 4521, 47, 2, 198, 1, 520, 9531, 198,
    ]);
    b
}

/// "<|im_start|>user\nHi! Name three colors.<|im_end|>\n<|im_start|>assistant\n".
pub const COLORS_PROMPT: [u32; 15] = [
    1, 4093, 198, 26843, 17, 10181, 1296, 4683, 30, 2, 198, 1, 520, 9531, 198,
];

/// SmolLM2-135M-Instruct's greedy continuation of [`CHAT_PROMPT`] with the default CPU weights
/// (`WeightFormat::Exact`: the file's weights exactly, F32 activations; the same tokens as the
/// earlier dense-F32-prefill / Q8_0-decode default and as the F32 reference): "The capital of France is Paris." then
/// `<|im_end|>` (id 2) — the engine would stop there; the raw executor keeps going with
/// "\n<|im_end|><|im_start|>system\n<|im_end|>\n<|im_start|>".
pub const GOLDEN: [u32; 16] = [
    504, 3575, 282, 4649, 314, 7042, 30, 2, 198, 2, 1, 9690, 198, 2, 198, 1,
];

/// One sequence driven through the executor.
pub struct Seq {
    pub tokens: Vec<u32>,
    pub prompt_len: usize,
    /// Positions already in the KV cache.
    pub done: usize,
    pub table: Vec<BlockId>,
    pub chunk: usize,
    /// Step at which the sequence joins the batch.
    pub join_at: usize,
    pub first_logits: Option<Vec<f32>>,
}

/// Runs all sequences together: chunked prefill, then batched greedy decode of `n_new` tokens,
/// each step one forward over every active sequence. Returns the generated tokens.
pub fn run_batched(
    exec: &mut dyn Executor,
    seqs: &mut [Seq],
    n_new: usize,
) -> Result<Vec<Vec<u32>>, EngineError> {
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
                all_logits: false,
            })
            .collect();
        let out = if chunks.is_empty() {
            Vec::new()
        } else {
            exec.forward(&chunks)?
        };
        drop(chunks);
        if out.len() != plan.len() {
            return Err(EngineError::Tensor(format!(
                "{} results for {} chunks",
                out.len(),
                plan.len()
            )));
        }
        for (&(i, _, end), logits) in plan.iter().zip(out) {
            let s = &mut seqs[i];
            s.done = end;
            match (end >= s.prompt_len, logits) {
                (true, Some(logits)) => {
                    s.first_logits.get_or_insert_with(|| logits.clone());
                    s.tokens.push(reference::argmax(&logits));
                }
                (false, None) => {}
                (want, got) => {
                    return Err(EngineError::Tensor(format!(
                        "logits {} but {}",
                        if want { "requested" } else { "not requested" },
                        if got.is_some() { "returned" } else { "missing" }
                    )))
                }
            }
        }
        step += 1;
    }
    Ok(seqs
        .iter()
        .map(|s| s.tokens[s.prompt_len..].to_vec())
        .collect())
}

/// Prefills `prompt[cached..]` in one step (positions `0..cached` must already be in `table`'s
/// blocks), then decodes `n_new` tokens one step at a time. Returns the greedy tokens.
pub fn greedy_paged(
    exec: &mut dyn Executor,
    prompt: &[u32],
    table: &[BlockId],
    cached: usize,
    n_new: usize,
) -> Result<Vec<u32>, EngineError> {
    greedy_steps(prompt, table, cached, n_new, |chunk| {
        let out = exec.forward(&[chunk])?;
        let logits = out
            .first()
            .and_then(Option::as_ref)
            .ok_or_else(|| EngineError::Tensor("no logits returned".into()))?;
        Ok(reference::argmax(logits))
    })
}

/// [`greedy_paged`] through [`Executor::forward_sampled`] with every step asking for the argmax
/// only (what the engine does for plain greedy requests): must give the same tokens.
pub fn greedy_sampled(
    exec: &mut dyn Executor,
    prompt: &[u32],
    table: &[BlockId],
    cached: usize,
    n_new: usize,
) -> Result<Vec<u32>, EngineError> {
    greedy_steps(prompt, table, cached, n_new, |chunk| {
        match exec
            .forward_sampled(&[chunk], &[true])?
            .into_iter()
            .next()
            .flatten()
        {
            Some(Sampled::Token(t)) => Ok(t),
            Some(Sampled::Logits(l)) => Ok(reference::argmax(&l)),
            None => Err(EngineError::Tensor("no output returned".into())),
        }
    })
}

/// The loop of [`greedy_paged`] and [`greedy_sampled`]: `next` runs one step's chunk (the
/// prompt's uncached rest first, then each new token) and gives the greedy token.
fn greedy_steps(
    prompt: &[u32],
    table: &[BlockId],
    cached: usize,
    n_new: usize,
    mut next: impl FnMut(SeqChunk<'_>) -> Result<u32, EngineError>,
) -> Result<Vec<u32>, EngineError> {
    let mut tokens = prompt.to_vec();
    let mut done = cached;
    for _ in 0..n_new {
        let token = next(SeqChunk {
            tokens: &tokens[done..],
            start_pos: done,
            block_table: table,
            want_logits: true,
            all_logits: false,
        })?;
        done = tokens.len();
        tokens.push(token);
    }
    Ok(tokens[prompt.len()..].to_vec())
}
