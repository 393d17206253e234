//! Building the tokenizer (from GGUF metadata or a HF `tokenizer.json`) and hashing it.
//!
//! GGUF, by `tokenizer.ggml.model`: `gpt2` / `gemma4` — byte-pair from `tokenizer.ggml.tokens`
//! and `tokenizer.ggml.merges`, with the pre-tokenizer `tokenizer.ggml.pre` names
//! ([`crate::pretokenizer`]: llama.cpp's table of split patterns and flags); `llama` —
//! SentencePiece as a BPE over merges derived from `tokenizer.ggml.scores`; `bert` — WordPiece.
//! Tokens of type 3 (control) and 2 (unknown) are special added tokens, type 4 (user-defined)
//! plain added tokens. Unigram (`t5`) and unknown models or pre-tokenizers are refused rather
//! than approximated. docs/prompt-profiles.md has the per-family details and what is verified.
//!
//! The tokenizer hash is SHA-256 over a canonical JSON form of the built tokenizer (the
//! `tokenizers` serialization with object keys sorted recursively, no whitespace), so it
//! covers vocabulary, merges, added/special tokens, pre-tokenizer and decoder.
//! Building costs O(vocab + merges); encoding is the `tokenizers` BPE (with its word cache).

use std::collections::BTreeMap;
use std::sync::Arc;

use sha2::{Digest, Sha256};
use tokenizers::decoders::byte_fallback::ByteFallback;
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::decoders::fuse::Fuse;
use tokenizers::decoders::sequence::Sequence as DecoderSequence;
use tokenizers::decoders::strip::Strip;
use tokenizers::decoders::wordpiece::WordPiece as WordPieceDecoder;
use tokenizers::decoders::DecoderWrapper;
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::models::wordpiece::WordPiece;
use tokenizers::normalizers::bert::BertNormalizer;
use tokenizers::normalizers::prepend::Prepend;
use tokenizers::normalizers::replace::Replace;
use tokenizers::normalizers::utils::Sequence as NormalizerSequence;
use tokenizers::normalizers::NormalizerWrapper;
use tokenizers::pre_tokenizers::bert::BertPreTokenizer;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::{AddedToken, SplitDelimiterBehavior, Tokenizer};

use crate::bpe::ByteLevelBpe;
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
    let byte_level = has_byte_level;
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

/// Whether a serialized pipeline step is (or contains) a `ByteLevel` one.
fn has_byte_level(v: &serde_json::Value) -> bool {
    match v {
        serde_json::Value::Object(o) => {
            o.get("type").and_then(|t| t.as_str()) == Some("ByteLevel")
                || o.values().any(has_byte_level)
        }
        serde_json::Value::Array(a) => a.iter().any(has_byte_level),
        _ => false,
    }
}

/// Whether the decoder of `tok` is (or contains) a byte-level one: vocabulary strings then
/// spell bytes in GPT-2's byte-to-character map.
fn byte_level_decoder(tok: &Tokenizer) -> bool {
    tok.get_decoder()
        .and_then(|d| serde_json::to_value(d).ok())
        .is_some_and(|v| has_byte_level(&v))
}

impl BuiltTokenizer {
    /// The bytes each token id stands for in generated text (`None`: a special token, which
    /// stands for no text). Byte-level vocabularies map each character back to its byte;
    /// others (SentencePiece) read `<0xNN>` byte tokens as that byte and `▁` as a space; an
    /// added token that is not special stands for its content.
    pub(crate) fn token_bytes(&self) -> Vec<Option<Vec<u8>>> {
        let tok = &self.plain;
        let byte_level = byte_level_decoder(tok);
        let char_byte: std::collections::HashMap<char, u8> =
            (0..=255u8).map(|b| (crate::bpe::byte_char(b), b)).collect();
        let added: std::collections::HashMap<u32, String> = tok
            .get_added_tokens_decoder()
            .into_iter()
            .map(|(id, t)| (id, t.content))
            .collect();
        let mut out = vec![None; self.vocab_size];
        for (s, id) in tok.get_vocab(true) {
            let Some(slot) = out.get_mut(id as usize) else {
                continue;
            };
            if self.special.get(id as usize).copied().unwrap_or(false) {
                continue;
            }
            *slot = Some(if let Some(content) = added.get(&id) {
                content.as_bytes().to_vec()
            } else if byte_level {
                match s.chars().map(|c| char_byte.get(&c).copied()).collect() {
                    Some(b) => b,
                    None => s.as_bytes().to_vec(),
                }
            } else if let Some(b) = s
                .strip_prefix("<0x")
                .and_then(|h| h.strip_suffix('>'))
                .filter(|h| h.len() == 2)
                .and_then(|h| u8::from_str_radix(h, 16).ok())
            {
                vec![b]
            } else {
                s.replace('\u{2581}', " ").into_bytes()
            });
        }
        out
    }

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
        let json = tok.to_string(false).map_err(tk_err)?;
        let serialized: serde_json::Value = serde_json::from_str(&json).map_err(tk_err)?;
        let sha256 = canonical_sha256(&serialized, json.len());
        let mut plain = tok.clone();
        plain.set_encode_special_tokens(true);
        let fast = ByteLevelBpe::from_serialized(&serialized);
        let segments = SegmentEncoder::new(&tok, fast, DEFAULT_CACHE_BYTES).map(Arc::new);
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

/// GGUF token type of an unknown-token entry (`<unk>`, placeholder pads).
const TOKEN_TYPE_UNKNOWN: i128 = 2;

/// A tokenizer built from GGUF metadata, with the BOS/EOS policy of its family.
pub(crate) struct GgufTokenizer {
    pub tokenizer: Tokenizer,
    /// `bpe/<pre-tokenizer kind>`, `spm` or `wpm`.
    pub family: String,
    /// BOS before raw text: the family's default unless `tokenizer.ggml.add_bos_token` says.
    pub add_bos: bool,
    /// EOS after raw text (`tokenizer.ggml.add_eos_token`, default false).
    pub add_eos: bool,
}

fn unsupported(reason: impl Into<String>) -> ProfileError {
    ProfileError::UnsupportedTokenizer {
        reason: reason.into(),
    }
}

impl BuiltTokenizer {
    /// Tokenize `text` (see `PromptProfile::encode`): with `parse_special` through the piece
    /// cache when there is one.
    pub(crate) fn encode(&self, text: &str, parse_special: bool) -> Result<Vec<u32>> {
        if parse_special {
            if let Some(seg) = &self.segments {
                return seg.encode(&self.parse_special, text);
            }
        }
        self.encode_uncached(text, parse_special)
    }

    /// Special tokens parsed, stopping once more than `max` ids were produced.
    pub(crate) fn encode_until(&self, text: &str, max: usize) -> Result<Vec<u32>> {
        if let Some(seg) = &self.segments {
            return seg.encode_until(&self.parse_special, text, max);
        }
        self.encode_uncached(text, true)
    }

    /// See `PromptProfile::uses_direct_bpe`.
    pub(crate) fn uses_direct_bpe(&self) -> bool {
        self.segments.as_ref().is_some_and(|s| s.is_direct_bpe())
    }

    /// Straight through the `tokenizers` pipeline.
    pub(crate) fn encode_uncached(&self, text: &str, parse_special: bool) -> Result<Vec<u32>> {
        let tok = if parse_special {
            &self.parse_special
        } else {
            &self.plain
        };
        let enc = tok.encode_fast(text, false).map_err(tk_err)?;
        Ok(enc.get_ids().to_vec())
    }

    /// Ids back to text; ids outside the vocabulary are an error.
    pub(crate) fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String> {
        if let Some(&id) = ids.iter().find(|&&id| id as usize >= self.vocab_size) {
            return Err(ProfileError::UnknownTokenId {
                id,
                vocab_size: self.vocab_size,
            });
        }
        self.parse_special.decode(ids, skip_special).map_err(tk_err)
    }
}

/// Build the tokenizer described by GGUF metadata: byte-pair (`gpt2`, `gemma4`, with the
/// pre-tokenizer of [`crate::pretokenizer`]), SentencePiece-BPE (`llama`) or WordPiece
/// (`bert`). Unigram (`t5`) and other models are refused with the reason.
pub(crate) fn from_gguf(meta: &GgufMetadata) -> Result<GgufTokenizer> {
    let model =
        meta.get_str("tokenizer.ggml.model")?
            .ok_or_else(|| ProfileError::MissingMetadata {
                key: "tokenizer.ggml.model".into(),
            })?;
    let tokens = string_array(meta, "tokenizer.ggml.tokens")?;
    let types = token_types(meta, tokens.len())?;
    u32::try_from(tokens.len()).map_err(|_| ProfileError::WrongMetadataType {
        key: "tokenizer.ggml.tokens".into(),
        expected: "at most 2^32 tokens".into(),
        found: format!("{} tokens", tokens.len()),
    })?;
    let (tok, family, default_bos) = match model {
        "gpt2" | "gemma4" => {
            // A `gemma4` vocabulary carries no `pre`: llama.cpp forces its pre-tokenizer.
            let pre = if model == "gemma4" {
                Some("gemma4")
            } else {
                meta.get_str("tokenizer.ggml.pre")?
            };
            let spec = crate::pretokenizer::spec(pre).map_err(unsupported)?;
            let tok = bpe_tokenizer(meta, &tokens, &types, &spec)?;
            (tok, format!("bpe/{}", spec.kind), spec.add_bos)
        }
        "llama" => (
            spm_tokenizer(meta, &tokens, &types)?,
            "spm".to_owned(),
            true,
        ),
        "bert" => (
            wpm_tokenizer(meta, &tokens, &types)?,
            "wpm".to_owned(),
            true,
        ),
        "t5" => return Err(unsupported(
            "tokenizer.ggml.model = \"t5\" (Unigram, embedding models such as nomic-bert-moe): \
                 not supported — no reference test material to prove a port against",
        )),
        other => {
            return Err(unsupported(format!(
                "tokenizer.ggml.model = {other:?}; supported: \"gpt2\", \"gemma4\" (byte-pair), \
                 \"llama\" (SentencePiece), \"bert\" (WordPiece)"
            )))
        }
    };
    let mut add_bos = meta
        .get_bool("tokenizer.ggml.add_bos_token")?
        .unwrap_or(default_bos);
    if model == "gemma4" {
        // llama.cpp forces it for Gemma 4 whatever the file says.
        add_bos = true;
    }
    let add_eos = meta
        .get_bool("tokenizer.ggml.add_eos_token")?
        .unwrap_or(false);
    Ok(GgufTokenizer {
        tokenizer: tok,
        family,
        add_bos,
        add_eos,
    })
}

fn token_types(meta: &GgufMetadata, n: usize) -> Result<Vec<i128>> {
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
    if !types.is_empty() && types.len() != n {
        return Err(ProfileError::WrongMetadataType {
            key: "tokenizer.ggml.token_type".into(),
            expected: format!("{n} entries (one per token)"),
            found: format!("{} entries", types.len()),
        });
    }
    Ok(types)
}

/// Token string → first id (a duplicated string keeps its first id; later ones are unreachable).
fn vocab_of(tokens: &[&str]) -> Vocab {
    let mut vocab = Vocab::default();
    vocab.reserve(tokens.len());
    for (id, tok) in (0u32..).zip(tokens.iter()) {
        vocab.entry((*tok).to_string()).or_insert(id);
    }
    vocab
}

/// Registers control (and unknown-type) tokens as special added tokens, user-defined ones as
/// plain added tokens (`normalized` only when there is no normalizer to skip, which keeps the
/// byte-pair families' serialization as it always was).
fn add_tokens(tok: &mut Tokenizer, tokens: &[&str], types: &[i128], raw_user: bool) -> Result<()> {
    let mut special = Vec::new();
    let mut user = Vec::new();
    for (t, ty) in tokens.iter().zip(types) {
        match *ty {
            TOKEN_TYPE_CONTROL | TOKEN_TYPE_UNKNOWN => {
                special.push(AddedToken::from((*t).to_string(), true))
            }
            TOKEN_TYPE_USER_DEFINED => {
                let a = AddedToken::from((*t).to_string(), false);
                user.push(if raw_user { a.normalized(false) } else { a })
            }
            _ => {}
        }
    }
    tok.add_special_tokens(special).map_err(tk_err)?;
    tok.add_tokens(user).map_err(tk_err)?;
    Ok(())
}

fn split(pattern: &str) -> Result<PreTokenizerWrapper> {
    Ok(PreTokenizerWrapper::Split(
        Split::new(
            SplitPattern::Regex(pattern.into()),
            SplitDelimiterBehavior::Isolated,
            false,
        )
        .map_err(tk_err)?,
    ))
}

fn sequence_or_one(mut steps: Vec<PreTokenizerWrapper>) -> Option<PreTokenizerWrapper> {
    match steps.len() {
        0 => None,
        1 => steps.pop(),
        _ => Some(PreTokenizerWrapper::Sequence(Sequence::new(steps))),
    }
}

/// Byte-pair: vocabulary and merges from the GGUF, the pre-tokenizer's splits, GPT-2 byte
/// encoding (or raw UTF-8 with `<0xXX>` byte fallback).
fn bpe_tokenizer(
    meta: &GgufMetadata,
    tokens: &[&str],
    types: &[i128],
    spec: &crate::pretokenizer::PreTokenizerSpec,
) -> Result<Tokenizer> {
    let merges_raw = string_array(meta, "tokenizer.ggml.merges")?;
    let mut merges = Vec::with_capacity(merges_raw.len());
    for (i, m) in merges_raw.iter().enumerate() {
        // The separator is the first space after the first character (a piece never starts
        // with a raw space in these vocabularies, but the first character may be one).
        let at = m
            .char_indices()
            .skip(1)
            .find(|(_, c)| *c == ' ')
            .map(|(i, _)| i)
            .ok_or_else(|| ProfileError::WrongMetadataType {
                key: "tokenizer.ggml.merges".into(),
                expected: "merges of the form \"left right\"".into(),
                found: format!("entry {i} = {m:?}"),
            })?;
        merges.push((m[..at].to_string(), m[at + 1..].to_string()));
    }
    let mut builder = BPE::builder()
        .vocab_and_merges(vocab_of(tokens), merges)
        .ignore_merges(spec.ignore_merges);
    if !spec.byte_encode {
        builder = builder.byte_fallback(true);
    }
    let bpe = builder.build().map_err(tk_err)?;
    let mut tok = Tokenizer::new(bpe);
    let mut steps = Vec::new();
    if spec.byte_encode {
        // A list ending in GPT-2's own pattern lets the byte-level step apply it (the same
        // split; it keeps the serialization of the vocabularies built before this table).
        let (splits, gpt2_last) = match spec.regexes.split_last() {
            Some((last, rest)) if *last == crate::pretokenizer::GPT2 => (rest, true),
            _ => (spec.regexes, false),
        };
        for r in splits {
            steps.push(split(r)?);
        }
        steps.push(PreTokenizerWrapper::ByteLevel(ByteLevel::new(
            false, true, gpt2_last,
        )));
        tok.with_decoder(Some(ByteLevelDecoder::new(false, true, true)));
    } else {
        for r in spec.regexes {
            steps.push(split(r)?);
        }
        tok.with_decoder(Some(DecoderWrapper::Sequence(DecoderSequence::new(vec![
            DecoderWrapper::Replace(Replace::new("▁", " ").map_err(tk_err)?),
            DecoderWrapper::ByteFallback(ByteFallback::new()),
            DecoderWrapper::Fuse(Fuse::new()),
        ]))));
    }
    if spec.escape_whitespaces {
        tok.with_normalizer(Some(NormalizerWrapper::Replace(
            Replace::new(" ", "▁").map_err(tk_err)?,
        )))
        .map_err(tk_err)?;
    }
    tok.with_pre_tokenizer(sequence_or_one(steps));
    add_tokens(&mut tok, tokens, types, spec.escape_whitespaces)?;
    Ok(tok)
}

/// SentencePiece (`llama`): a BPE whose merges are derived from the token scores the way
/// `transformers`' SentencePiece converter does (every split of a piece into two pieces of
/// the vocabulary, ordered by the merged piece's score, highest first; within a piece by the
/// ids of the two halves), `▁` for spaces with one prepended per text fragment when
/// `add_space_prefix` (default), and `<0xXX>` byte fallback.
fn spm_tokenizer(meta: &GgufMetadata, tokens: &[&str], types: &[i128]) -> Result<Tokenizer> {
    let scores: Vec<f64> = meta
        .require_array("tokenizer.ggml.scores")?
        .iter()
        .map(|v| match v {
            GgufValue::F32(f) => Ok(f64::from(*f)),
            GgufValue::F64(f) => Ok(*f),
            other => Err(ProfileError::WrongMetadataType {
                key: "tokenizer.ggml.scores".into(),
                expected: "array of floats".into(),
                found: format!("array of {}", other.type_name()),
            }),
        })
        .collect::<Result<_>>()?;
    if scores.len() != tokens.len() {
        return Err(ProfileError::WrongMetadataType {
            key: "tokenizer.ggml.scores".into(),
            expected: format!("{} entries (one per token)", tokens.len()),
            found: format!("{} entries", scores.len()),
        });
    }
    let vocab = vocab_of(tokens);
    let mut merges: Vec<(u32, u32, f64)> = Vec::new();
    for (piece, score) in tokens.iter().zip(&scores) {
        let start = merges.len();
        for (i, _) in piece.char_indices().skip(1) {
            if let (Some(&l), Some(&r)) = (vocab.get(&piece[..i]), vocab.get(&piece[i..])) {
                merges.push((l, r, *score));
            }
        }
        merges[start..].sort_by_key(|(l, r, _)| (*l, *r));
    }
    // Stable: pieces of equal score keep their vocabulary order.
    merges.sort_by(|a, b| b.2.partial_cmp(&a.2).unwrap_or(std::cmp::Ordering::Equal));
    let mut seen = std::collections::HashSet::with_capacity(merges.len());
    let merges: Vec<(String, String)> = merges
        .into_iter()
        .filter(|(l, r, _)| seen.insert((*l, *r)))
        .map(|(l, r, _)| {
            (
                tokens[l as usize].to_string(),
                tokens[r as usize].to_string(),
            )
        })
        .collect();
    let unk = meta
        .get_u32("tokenizer.ggml.unknown_token_id")?
        .and_then(|id| tokens.get(id as usize).copied())
        .unwrap_or("<unk>");
    let mut builder = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .byte_fallback(true)
        .fuse_unk(true);
    if tokens.contains(&unk) {
        builder = builder.unk_token(unk.to_string());
    }
    let bpe = builder.build().map_err(tk_err)?;
    let mut tok = Tokenizer::new(bpe);
    let prefix = meta
        .get_bool("tokenizer.ggml.add_space_prefix")?
        .unwrap_or(true);
    let replace = NormalizerWrapper::Replace(Replace::new(" ", "▁").map_err(tk_err)?);
    tok.with_normalizer(Some(if prefix {
        NormalizerWrapper::Sequence(NormalizerSequence::new(vec![
            NormalizerWrapper::Prepend(Prepend::new("▁".into())),
            replace,
        ]))
    } else {
        replace
    }))
    .map_err(tk_err)?;
    let mut decoders = vec![
        DecoderWrapper::Replace(Replace::new("▁", " ").map_err(tk_err)?),
        DecoderWrapper::ByteFallback(ByteFallback::new()),
        DecoderWrapper::Fuse(Fuse::new()),
    ];
    if prefix {
        decoders.push(DecoderWrapper::Strip(Strip::new(' ', 1, 0)));
    }
    tok.with_decoder(Some(DecoderWrapper::Sequence(DecoderSequence::new(
        decoders,
    ))));
    add_tokens(&mut tok, tokens, types, true)?;
    Ok(tok)
}

/// WordPiece (`bert`): the GGUF writes word starts as `▁x` and continuations bare; the HF
/// vocabulary they came from has `x` and `##x`. BERT's normalizer (clean, CJK split, lowercase,
/// accents stripped) and pre-tokenizer.
fn wpm_tokenizer(meta: &GgufMetadata, tokens: &[&str], types: &[i128]) -> Result<Tokenizer> {
    let mut vocab = Vocab::default();
    for (id, (t, ty)) in (0u32..).zip(tokens.iter().zip(types.iter().chain(std::iter::repeat(&1))))
    {
        let word = if *ty == TOKEN_TYPE_CONTROL || *ty == TOKEN_TYPE_UNKNOWN {
            (*t).to_string()
        } else if let Some(start) = t.strip_prefix('▁') {
            start.to_string()
        } else {
            format!("##{t}")
        };
        vocab.entry(word).or_insert(id);
    }
    let unk = meta
        .get_u32("tokenizer.ggml.unknown_token_id")?
        .and_then(|id| tokens.get(id as usize).copied())
        .unwrap_or("[UNK]");
    let wp = WordPiece::builder()
        .vocab(vocab)
        .unk_token(unk.to_string())
        .continuing_subword_prefix("##".into())
        .max_input_chars_per_word(100)
        .build()
        .map_err(tk_err)?;
    let mut tok = Tokenizer::new(wp);
    tok.with_normalizer(Some(NormalizerWrapper::BertNormalizer(
        BertNormalizer::new(true, true, None, true),
    )))
    .map_err(tk_err)?;
    tok.with_pre_tokenizer(Some(PreTokenizerWrapper::BertPreTokenizer(
        BertPreTokenizer,
    )));
    tok.with_decoder(Some(DecoderWrapper::WordPiece(WordPieceDecoder::default())));
    add_tokens(&mut tok, tokens, types, true)?;
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

/// SHA-256 hex of the tokenizer's canonical JSON serialization (`value`, `len` bytes long).
fn canonical_sha256(value: &serde_json::Value, len: usize) -> String {
    let mut out = String::with_capacity(len);
    write_canonical(&mut out, value);
    hex::encode(Sha256::digest(out.as_bytes()))
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
