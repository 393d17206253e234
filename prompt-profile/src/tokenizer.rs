//! Building the tokenizer (from GGUF metadata or a HF `tokenizer.json`) and hashing it.
//!
//! GGUF (`tokenizer.ggml.model = "gpt2"`): a byte-level BPE from `tokenizer.ggml.tokens` and
//! `tokenizer.ggml.merges` (each merge split at its first space), no normalizer, the
//! pre-tokenizer named by `tokenizer.ggml.pre` (`smollm`/`starcoder`: split every `\p{N}`
//! character off, then GPT-2 byte-level without prefix space; `gpt2`: byte-level only), a
//! byte-level decoder, tokens of type 3 (control) added as special tokens and of type 4
//! (user-defined) as non-special added tokens. Other tokenizer models or pre-tokenizers
//! are refused rather than approximated.
//!
//! The tokenizer hash is SHA-256 over a canonical JSON form of the built tokenizer (the
//! `tokenizers` serialization with object keys sorted recursively, no whitespace), so it
//! covers vocabulary, merges, added/special tokens, pre-tokenizer and decoder.
//! Building costs O(vocab + merges); encoding is the `tokenizers` BPE (with its word cache).

use std::collections::BTreeMap;
use std::sync::Arc;

use sha2::{Digest, Sha256};
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::{AddedToken, SplitDelimiterBehavior, Tokenizer};

use crate::error::{tk_err, ProfileError, Result};
use crate::gguf::{GgufMetadata, GgufValue};
use crate::segments::{SegmentEncoder, DEFAULT_CACHE_BYTES};

/// GGUF token type of control tokens (`<|im_start|>`, …).
const TOKEN_TYPE_CONTROL: i128 = 3;
/// GGUF token type of user-defined tokens.
const TOKEN_TYPE_USER_DEFINED: i128 = 4;

/// A built tokenizer plus what the profile needs to know about it.
#[derive(Clone)]
pub(crate) struct BuiltTokenizer {
    /// Matches special tokens in the input text.
    pub parse_special: Tokenizer,
    /// Treats special token text as plain text.
    pub plain: Tokenizer,
    /// `special[id]` is true for special tokens.
    pub special: Vec<bool>,
    /// One past the largest token id.
    pub vocab_size: usize,
    /// SHA-256 hex of the canonical serialization.
    pub sha256: String,
    /// Cached segment-wise encoding with special tokens parsed (`None`: not applicable).
    pub segments: Option<Arc<SegmentEncoder>>,
    /// The most input bytes one token can stand for, when that is known exactly: for a
    /// byte-level BPE without a normalizer, each token covers as many input bytes as its string
    /// has characters (an added token: its content's bytes). `None` otherwise. A text of `n`
    /// bytes then has at least `⌈n / max_token_bytes⌉` tokens.
    pub max_token_bytes: Option<usize>,
}

/// See [`BuiltTokenizer::max_token_bytes`].
fn max_token_bytes(tok: &Tokenizer) -> Option<usize> {
    if tok.get_normalizer().is_some() {
        return None;
    }
    let byte_level = |v: &serde_json::Value| -> bool {
        fn find(v: &serde_json::Value) -> bool {
            match v {
                serde_json::Value::Object(o) => {
                    o.get("type").and_then(|t| t.as_str()) == Some("ByteLevel")
                        || o.values().any(find)
                }
                serde_json::Value::Array(a) => a.iter().any(find),
                _ => false,
            }
        }
        find(v)
    };
    let pre = serde_json::to_value(tok.get_pre_tokenizer()?).ok()?;
    let dec = serde_json::to_value(tok.get_decoder()?).ok()?;
    if !byte_level(&pre) || !byte_level(&dec) {
        return None;
    }
    let added: std::collections::HashMap<u32, usize> = tok
        .get_added_tokens_decoder()
        .into_iter()
        .map(|(id, t)| (id, t.content.len()))
        .collect();
    tok.get_vocab(true)
        .iter()
        .map(|(s, id)| added.get(id).copied().unwrap_or_else(|| s.chars().count()))
        .max()
        .filter(|&n| n > 0)
}

impl BuiltTokenizer {
    pub(crate) fn from_tokenizer(tok: Tokenizer) -> Result<Self> {
        let vocab = tok.get_vocab(true);
        let vocab_size = vocab.values().map(|&id| id as usize + 1).max().unwrap_or(0);
        let mut special = vec![false; vocab_size];
        for (id, added) in tok.get_added_tokens_decoder() {
            if added.special {
                if let Some(slot) = special.get_mut(id as usize) {
                    *slot = true;
                }
            }
        }
        let sha256 = canonical_sha256(&tok)?;
        let mut plain = tok.clone();
        plain.set_encode_special_tokens(true);
        let segments = SegmentEncoder::new(&tok, DEFAULT_CACHE_BYTES).map(Arc::new);
        let max_token_bytes = max_token_bytes(&tok);
        Ok(BuiltTokenizer {
            segments,
            max_token_bytes,
            parse_special: tok,
            plain,
            special,
            vocab_size,
            sha256,
        })
    }
}

/// Build the tokenizer described by GGUF metadata.
pub(crate) fn from_gguf(meta: &GgufMetadata) -> Result<Tokenizer> {
    let model =
        meta.get_str("tokenizer.ggml.model")?
            .ok_or_else(|| ProfileError::MissingMetadata {
                key: "tokenizer.ggml.model".into(),
            })?;
    if model != "gpt2" {
        return Err(ProfileError::UnsupportedTokenizer {
            reason: format!(
                "tokenizer.ggml.model = {model:?}; only byte-level BPE (\"gpt2\") is supported"
            ),
        });
    }
    let pre = meta.get_str("tokenizer.ggml.pre")?.unwrap_or("default");
    let byte_level = PreTokenizerWrapper::ByteLevel(ByteLevel::new(false, true, true));
    let pre_tokenizer = match pre {
        "smollm" | "starcoder" => {
            let digits = Split::new(
                SplitPattern::Regex(r"\p{N}".into()),
                SplitDelimiterBehavior::Isolated,
                false,
            )
            .map_err(tk_err)?;
            PreTokenizerWrapper::Sequence(Sequence::new(vec![
                PreTokenizerWrapper::Split(digits),
                byte_level,
            ]))
        }
        "gpt2" => byte_level,
        other => {
            return Err(ProfileError::UnsupportedTokenizer {
                reason: format!(
                    "tokenizer.ggml.pre = {other:?}; supported: \"smollm\", \"starcoder\", \"gpt2\""
                ),
            })
        }
    };

    let tokens = string_array(meta, "tokenizer.ggml.tokens")?;
    let merges_raw = string_array(meta, "tokenizer.ggml.merges")?;
    let types = match meta.get("tokenizer.ggml.token_type") {
        None => Vec::new(),
        Some(GgufValue::Array(items)) => items
            .iter()
            .map(|v| {
                v.as_i128().ok_or_else(|| ProfileError::WrongMetadataType {
                    key: "tokenizer.ggml.token_type".into(),
                    expected: "array of integers".into(),
                    found: format!("array of {}", v.type_name()),
                })
            })
            .collect::<Result<Vec<_>>>()?,
        Some(other) => {
            return Err(ProfileError::WrongMetadataType {
                key: "tokenizer.ggml.token_type".into(),
                expected: "array".into(),
                found: other.type_name().into(),
            })
        }
    };
    if !types.is_empty() && types.len() != tokens.len() {
        return Err(ProfileError::WrongMetadataType {
            key: "tokenizer.ggml.token_type".into(),
            expected: format!("{} entries (one per token)", tokens.len()),
            found: format!("{} entries", types.len()),
        });
    }
    let vocab_len = u32::try_from(tokens.len()).map_err(|_| ProfileError::WrongMetadataType {
        key: "tokenizer.ggml.tokens".into(),
        expected: "at most 2^32 tokens".into(),
        found: format!("{} tokens", tokens.len()),
    })?;

    let mut vocab = Vocab::default();
    vocab.reserve(tokens.len());
    for (id, tok) in (0..vocab_len).zip(tokens.iter()) {
        // A duplicated token string keeps its first id (later duplicates are unreachable).
        vocab.entry((*tok).to_string()).or_insert(id);
    }
    let mut merges = Vec::with_capacity(merges_raw.len());
    for (i, m) in merges_raw.iter().enumerate() {
        let (a, b) = m
            .split_once(' ')
            .ok_or_else(|| ProfileError::WrongMetadataType {
                key: "tokenizer.ggml.merges".into(),
                expected: "merges of the form \"left right\"".into(),
                found: format!("entry {i} = {m:?}"),
            })?;
        merges.push((a.to_string(), b.to_string()));
    }
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .build()
        .map_err(tk_err)?;

    let mut tok = Tokenizer::new(bpe);
    tok.with_pre_tokenizer(Some(pre_tokenizer));
    tok.with_decoder(Some(ByteLevelDecoder::new(false, true, true)));

    let mut special = Vec::new();
    let mut user = Vec::new();
    for (i, t) in types.iter().enumerate() {
        match *t {
            TOKEN_TYPE_CONTROL => special.push(AddedToken::from(tokens[i].to_string(), true)),
            TOKEN_TYPE_USER_DEFINED => user.push(AddedToken::from(tokens[i].to_string(), false)),
            _ => {}
        }
    }
    tok.add_special_tokens(special).map_err(tk_err)?;
    tok.add_tokens(user).map_err(tk_err)?;
    Ok(tok)
}

fn string_array<'a>(meta: &'a GgufMetadata, key: &str) -> Result<Vec<&'a str>> {
    meta.require_array(key)?
        .iter()
        .map(|v| {
            v.as_str().ok_or_else(|| ProfileError::WrongMetadataType {
                key: key.into(),
                expected: "array of strings".into(),
                found: format!("array of {}", v.type_name()),
            })
        })
        .collect()
}

/// SHA-256 hex of the tokenizer's canonical JSON serialization.
fn canonical_sha256(tok: &Tokenizer) -> Result<String> {
    let json = tok.to_string(false).map_err(tk_err)?;
    let value: serde_json::Value = serde_json::from_str(&json).map_err(tk_err)?;
    let mut out = String::with_capacity(json.len());
    write_canonical(&mut out, &value);
    Ok(hex::encode(Sha256::digest(out.as_bytes())))
}

/// Compact JSON with object keys sorted (recursively); independent of serde_json's map order.
pub(crate) fn write_canonical(out: &mut String, v: &serde_json::Value) {
    match v {
        serde_json::Value::Object(map) => {
            let sorted: BTreeMap<&String, &serde_json::Value> = map.iter().collect();
            out.push('{');
            for (i, (k, v)) in sorted.into_iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                out.push_str(&serde_json::Value::String(k.clone()).to_string());
                out.push(':');
                write_canonical(out, v);
            }
            out.push('}');
        }
        serde_json::Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                write_canonical(out, item);
            }
            out.push(']');
        }
        other => out.push_str(&other.to_string()),
    }
}
