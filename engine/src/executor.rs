//! The contract between the scheduler and whatever computes tokens: the candle model
//! (`model`) or the timing simulator (`sim`). The executor owns the paged KV *storage*;
//! the engine's block pool owns which block ids are in use.

use crate::EngineError;

/// Index of one block in the executor's KV storage, `0..num_blocks`.
pub type BlockId = u32;

/// Geometry of the paged KV storage an executor owns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvGeometry {
    /// Tokens per block.
    pub block_size: usize,
    /// Number of blocks preallocated.
    pub num_blocks: usize,
}

impl KvGeometry {
    /// `(src, dst)` as indices when both name blocks of this geometry (an
    /// [`Executor::copy_block`]'s arguments), else the error every executor returns.
    pub fn block_copy(&self, src: BlockId, dst: BlockId) -> Result<(usize, usize), EngineError> {
        let (src, dst) = (src as usize, dst as usize);
        if src >= self.num_blocks || dst >= self.num_blocks {
            return Err(EngineError::InvalidRequest(format!(
                "KV block copy {src} → {dst} outside {} blocks",
                self.num_blocks
            )));
        }
        Ok((src, dst))
    }
}

/// One sequence's share of a forward step.
#[derive(Clone, Copy, Debug)]
pub struct SeqChunk<'a> {
    /// Tokens whose K/V this step computes and stores, at positions
    /// `start_pos..start_pos + tokens.len()`.
    pub tokens: &'a [u32],
    /// Position of `tokens[0]`; positions `0..start_pos` are already in the KV blocks.
    pub start_pos: usize,
    /// The sequence's block table, covering at least positions `0..start_pos + tokens.len()`:
    /// position `p` lives in block `block_table[p / block_size]` at slot `p % block_size`.
    pub block_table: &'a [BlockId],
    /// Return the logits of this chunk's last token.
    pub want_logits: bool,
    /// Return the logits of *every* token of this chunk, `tokens.len() × vocab` values in
    /// position order (row `i`: the distribution of the token after `tokens[i]`), whether or
    /// not `want_logits` is set — a prompt's log probabilities
    /// ([`crate::OutputParams::prompt_logprobs`]). Never asked with an argmax flag
    /// ([`Executor::forward_sampled`]).
    pub all_logits: bool,
}

/// What a step gives back for a chunk that wants its next token
/// ([`Executor::forward_sampled`]).
#[derive(Clone, Debug, PartialEq)]
pub enum Sampled {
    /// The logits of the chunk's last token.
    Logits(Vec<f32>),
    /// Only their argmax ([`crate::sampler::argmax`]'s: the lowest id among equal maxima, never
    /// a NaN), for plain greedy sampling.
    Token(u32),
}

/// Computes one forward step over a batch of chunks from different sequences.
pub trait Executor: Send {
    /// The KV storage this executor preallocated.
    fn geometry(&self) -> KvGeometry;
    /// Length of the logits vectors returned.
    fn vocab_size(&self) -> usize;
    /// Run one step: write the K/V of every chunk's tokens into its blocks and return, per
    /// chunk in order, `Some(logits of its last token)` when `want_logits`, `Some(logits of
    /// each of its tokens)` when `all_logits`, else `None`.
    fn forward(&mut self, chunks: &[SeqChunk<'_>]) -> Result<Vec<Option<Vec<f32>>>, EngineError>;

    /// Whether [`Executor::copy_block`] works here (the scheduler only asks executors that
    /// say so; the default is no).
    fn copies_blocks(&self) -> bool {
        false
    }

    /// Copies block `src`'s K/V — every layer, every slot — into block `dst`, for a request
    /// that reuses the first tokens of a cached block it must not write into. O(one block's
    /// K/V). The default refuses.
    fn copy_block(&mut self, src: BlockId, dst: BlockId) -> Result<(), EngineError> {
        Err(EngineError::InvalidRequest(format!(
            "this executor does not copy KV blocks ({src} → {dst})"
        )))
    }

    /// [`Executor::forward`] where the chunks flagged in `argmax` (one flag per chunk) need only
    /// the argmax of their logits: those come back as [`Sampled::Token`], the other chunks that
    /// want logits as [`Sampled::Logits`]. The default takes the argmax on the host; an
    /// executor whose logits live elsewhere (a GPU) takes it there and copies back the ids.
    fn forward_sampled(
        &mut self,
        chunks: &[SeqChunk<'_>],
        argmax: &[bool],
    ) -> Result<Vec<Option<Sampled>>, EngineError> {
        let outs = self.forward(chunks)?;
        Ok(outs
            .into_iter()
            .enumerate()
            .map(|(i, o)| {
                o.map(|l| match argmax.get(i) {
                    Some(true) => Sampled::Token(crate::sampler::argmax(&l)),
                    _ => Sampled::Logits(l),
                })
            })
            .collect())
    }
}
