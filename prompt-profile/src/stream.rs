//! Incremental detokenization for streaming: feed token ids one at a time, get back the
//! newly completed text. The engine's one detokenizer (every generated token goes through it).
//!
//! Byte-level BPE tokens can end in the middle of a multi-byte UTF-8 character (an emoji is
//! often split over two or three tokens), so decoding each token alone would emit
//! replacement characters. This keeps a small window of ids: `prefix..read` were already
//! emitted and serve as context, `read..` are pending. Each step decodes the window; text is
//! emitted only when it grew past the already-emitted prefix and does not end in U+FFFD
//! (an incomplete character). The window then slides, so a step costs O(tokens since the
//! previous emission + one emission's tokens), independent of the stream length.
//!
//! This is the algorithm of `tokenizers`' own `DecodeStream` (prefix/read offsets), and gives
//! the same pieces (differential test `stream_equals_tokenizers_decode_stream`). It is written
//! here rather than used from `tokenizers` because that type borrows its `Tokenizer` for its
//! whole life, which a sequence living inside the engine's step loop cannot do, and because it
//! works over any [`TokenDecoder`] (the simulated executor's too).
//!
//! The concatenation of every emitted piece plus [`DecodeStream::flush`] equals
//! `decode(all ids)` (property test).

use std::sync::Arc;

use crate::error::{ProfileError, Result};

/// Turns token ids into text. Implemented by [`crate::PromptProfile`]; the engine's simulated
/// executor has its own.
pub trait TokenDecoder: Send + Sync {
    /// The text of `ids`; with `skip_special`, special tokens are left out. Incomplete UTF-8
    /// at the end comes out as U+FFFD. Ids the decoder does not know are an error.
    fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String>;
}

/// An incremental detokenizer over a shared [`TokenDecoder`]. Cheap to create.
#[derive(Clone)]
pub struct DecodeStream {
    decoder: Arc<dyn TokenDecoder>,
    skip_special: bool,
    ids: Vec<u32>,
    /// Start of the context (already emitted) part of `ids`.
    prefix: usize,
    /// Start of the pending part of `ids`.
    read: usize,
}

impl std::fmt::Debug for DecodeStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DecodeStream")
            .field("skip_special", &self.skip_special)
            .field("ids", &self.ids)
            .field("prefix", &self.prefix)
            .field("read", &self.read)
            .finish_non_exhaustive()
    }
}

impl DecodeStream {
    /// A stream over `decoder`; with `skip_special`, special tokens produce no text.
    pub fn new(decoder: Arc<dyn TokenDecoder>, skip_special: bool) -> Self {
        DecodeStream {
            decoder,
            skip_special,
            ids: Vec::new(),
            prefix: 0,
            read: 0,
        }
    }

    /// Feed one token id; returns the text it completed, if any.
    pub fn step(&mut self, id: u32) -> Result<Option<String>> {
        self.ids.push(id);
        let prefix_text = self
            .decoder
            .decode(&self.ids[self.prefix..self.read], self.skip_special)?;
        let new_text = self
            .decoder
            .decode(&self.ids[self.prefix..], self.skip_special)?;
        if new_text.len() <= prefix_text.len() || new_text.ends_with('\u{FFFD}') {
            return Ok(None);
        }
        let Some(piece) = new_text.strip_prefix(prefix_text.as_str()) else {
            return Err(ProfileError::Tokenizer {
                reason: "incremental decode is not prefix-stable for this decoder".into(),
            });
        };
        let piece = piece.to_string();
        // Slide the window: the pending ids become the context of the next step.
        self.ids.drain(..self.read);
        self.prefix = 0;
        self.read = self.ids.len();
        Ok(Some(piece))
    }

    /// Emit whatever is still pending (possibly with U+FFFD for an incomplete character) and
    /// reset the stream.
    pub fn flush(&mut self) -> Result<Option<String>> {
        let prefix_text = self
            .decoder
            .decode(&self.ids[self.prefix..self.read], self.skip_special)?;
        let new_text = self
            .decoder
            .decode(&self.ids[self.prefix..], self.skip_special)?;
        self.ids.clear();
        self.prefix = 0;
        self.read = 0;
        Ok(new_text
            .strip_prefix(prefix_text.as_str())
            .filter(|rest| !rest.is_empty())
            .map(str::to_string))
    }

    /// Number of ids fed that have not been emitted yet.
    pub fn pending(&self) -> usize {
        self.ids.len() - self.read
    }
}
