//! The one error type of the prompt-profile crate.

use std::path::PathBuf;

/// Everything that can go wrong while loading a profile, rendering a chat, or (de)tokenizing.
///
/// Every message is a single line (no embedded newlines), so a CLI can print it as is.
#[derive(Debug, thiserror::Error)]
pub enum ProfileError {
    /// A file could not be opened or read.
    #[error("cannot read {path}: {cause}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The underlying error (in the message, so not repeated as a `source`).
        cause: std::io::Error,
    },
    /// The file does not start with the GGUF magic.
    #[error("{path} is not a GGUF file (magic {found:?}, expected \"GGUF\")")]
    NotGguf {
        /// The file.
        path: PathBuf,
        /// The first bytes found, lossily decoded.
        found: String,
    },
    /// The GGUF version is not one this reader supports (2 and 3 are).
    #[error("{path}: unsupported GGUF version {version} (supported: 2, 3)")]
    UnsupportedGgufVersion {
        /// The file.
        path: PathBuf,
        /// The version found in the header.
        version: u32,
    },
    /// The GGUF header or metadata ended before a value it announced.
    #[error("{path}: GGUF metadata truncated at byte {offset} while reading {what}")]
    GgufTruncated {
        /// The file.
        path: PathBuf,
        /// Byte offset where reading failed.
        offset: u64,
        /// What was being read.
        what: String,
    },
    /// The GGUF metadata is structurally invalid (unknown type code, bad UTF-8, absurd sizes).
    #[error("{path}: malformed GGUF metadata at byte {offset}: {reason}")]
    GgufMalformed {
        /// The file.
        path: PathBuf,
        /// Byte offset where the problem was found.
        offset: u64,
        /// What is wrong.
        reason: String,
    },
    /// A metadata key the profile needs is absent.
    #[error("missing metadata key `{key}`")]
    MissingMetadata {
        /// The key.
        key: String,
    },
    /// A metadata key has a value of the wrong type or out of range.
    #[error("metadata key `{key}`: expected {expected}, found {found}")]
    WrongMetadataType {
        /// The key.
        key: String,
        /// What was expected.
        expected: String,
        /// What was found.
        found: String,
    },
    /// The tokenizer described by the metadata is not one this crate can build faithfully.
    #[error("unsupported tokenizer: {reason}")]
    UnsupportedTokenizer {
        /// Why.
        reason: String,
    },
    /// The `tokenizers` library reported an error (building, encoding or decoding).
    #[error("tokenizer error: {reason}")]
    Tokenizer {
        /// The library's message.
        reason: String,
    },
    /// A JSON file (tokenizer.json, tokenizer_config.json, messages) is malformed.
    #[error("{path}: invalid JSON: {reason}")]
    Json {
        /// The file.
        path: PathBuf,
        /// The parser's message.
        reason: String,
    },
    /// A required field is missing from a HF configuration file.
    #[error("{path}: {reason}")]
    InvalidConfig {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// The model carries no chat template.
    #[error("the model has no chat template ({origin})")]
    MissingChatTemplate {
        /// Where it was looked for.
        origin: String,
    },
    /// The chat template failed to compile or to render.
    #[error("chat template error: {reason}")]
    Template {
        /// The template engine's message.
        reason: String,
    },
    /// The chat template called `raise_exception(message)`, e.g. for an unsupported role.
    #[error("chat template rejected the conversation: {message}")]
    TemplateRaised {
        /// The message the template raised.
        message: String,
    },
    /// Rendering failed on the request's data (an undefined attribute, a type error in the
    /// template): the template is fine, this conversation does not fit it.
    #[error("chat template failed on this conversation: {reason}")]
    TemplateRender {
        /// What failed.
        reason: String,
    },
    /// A chat message cannot be rendered (e.g. a non-text content part).
    #[error("invalid message {index}: {reason}")]
    InvalidMessage {
        /// Index of the message in the conversation.
        index: usize,
        /// What is wrong.
        reason: String,
    },
    /// A request's prompt is empty (no messages, no text, no ids).
    #[error("`{param}` must not be empty")]
    EmptyPrompt {
        /// The request field (`messages` or `prompt`).
        param: &'static str,
    },
    /// A completion request carries a batch of several prompts; one is served per request.
    #[error("a batch of {len} prompts is not supported; send one prompt per request")]
    PromptBatch {
        /// Prompts in the batch.
        len: usize,
    },
    /// A token id of a completion prompt is outside the vocabulary.
    #[error("token id {id} is outside the vocabulary (size {vocab_size})")]
    PromptTokenOutOfVocab {
        /// Position in the prompt.
        index: usize,
        /// The id.
        id: u32,
        /// The vocabulary size.
        vocab_size: usize,
    },
    /// Prompt + output + reserve exceed the context limit (see [`crate::TokenBudget`]).
    #[error(
        "this model's context limit is {context_limit} tokens, but the request needs {}: \
         {prompt_tokens} prompt tokens + {max_tokens} output tokens + {native_reserve} reserved tokens",
        prompt_tokens.saturating_add(*max_tokens).saturating_add(*native_reserve)
    )]
    ContextLengthExceeded {
        /// The model's context limit.
        context_limit: usize,
        /// Prompt tokens.
        prompt_tokens: usize,
        /// Output tokens asked for (or the one token a request without a count needs).
        max_tokens: usize,
        /// Reserved tokens.
        native_reserve: usize,
        /// Whether the request named its output count (`max_tokens` is then at fault).
        requested: bool,
    },
    /// A token id is outside the vocabulary.
    #[error("token id {id} is outside the vocabulary (size {vocab_size})")]
    UnknownTokenId {
        /// The id.
        id: u32,
        /// The vocabulary size.
        vocab_size: usize,
    },
}

impl ProfileError {
    /// A stable, machine-readable name for the error kind (metric label, OpenAI error `code`).
    pub fn error_type(&self) -> &'static str {
        match self {
            ProfileError::Io { .. } => "io",
            ProfileError::NotGguf { .. } => "not_gguf",
            ProfileError::UnsupportedGgufVersion { .. } => "unsupported_gguf_version",
            ProfileError::GgufTruncated { .. } => "gguf_truncated",
            ProfileError::GgufMalformed { .. } => "gguf_malformed",
            ProfileError::MissingMetadata { .. } => "missing_metadata",
            ProfileError::WrongMetadataType { .. } => "wrong_metadata_type",
            ProfileError::UnsupportedTokenizer { .. } => "unsupported_tokenizer",
            ProfileError::Tokenizer { .. } => "tokenizer",
            ProfileError::Json { .. } => "invalid_json",
            ProfileError::InvalidConfig { .. } => "invalid_config",
            ProfileError::MissingChatTemplate { .. } => "missing_chat_template",
            ProfileError::Template { .. } => "template_error",
            ProfileError::TemplateRaised { .. } => "template_raised",
            ProfileError::TemplateRender { .. } => "template_render_failed",
            ProfileError::InvalidMessage { .. } => "invalid_message",
            ProfileError::UnknownTokenId { .. } => "unknown_token_id",
            ProfileError::EmptyPrompt { .. } => "empty_prompt",
            ProfileError::PromptBatch { .. } => "prompt_batch_not_supported",
            ProfileError::PromptTokenOutOfVocab { .. } => "token_out_of_vocabulary",
            ProfileError::ContextLengthExceeded { .. } => "context_length_exceeded",
        }
    }

    /// True when the error was caused by the request (messages, template rejection, ids),
    /// false when it comes from the model files. A server maps the former to HTTP 400.
    pub fn is_client_error(&self) -> bool {
        matches!(
            self,
            ProfileError::TemplateRaised { .. }
                | ProfileError::TemplateRender { .. }
                | ProfileError::InvalidMessage { .. }
                | ProfileError::UnknownTokenId { .. }
                | ProfileError::EmptyPrompt { .. }
                | ProfileError::PromptBatch { .. }
                | ProfileError::PromptTokenOutOfVocab { .. }
                | ProfileError::ContextLengthExceeded { .. }
        )
    }
}

/// A `tokenizers` library error as [`ProfileError::Tokenizer`].
pub(crate) fn tk_err(e: impl std::fmt::Display) -> ProfileError {
    ProfileError::Tokenizer {
        reason: one_line(e.to_string()),
    }
}

/// Replace line breaks so that an error message stays on one line.
pub(crate) fn one_line(s: impl AsRef<str>) -> String {
    let s = s.as_ref().trim();
    let mut out = String::with_capacity(s.len());
    let mut last_space = false;
    for c in s.chars() {
        if c == '\n' || c == '\r' {
            if !last_space {
                out.push(' ');
            }
            last_space = true;
        } else {
            out.push(c);
            last_space = c == ' ';
        }
    }
    out
}

/// Result alias of this crate.
pub type Result<T, E = ProfileError> = std::result::Result<T, E>;
