//! The pre-tokenizers of byte-pair GGUF vocabularies, by `tokenizer.ggml.pre`.
//!
//! A GGUF names its pre-tokenizer (`tokenizer.ggml.pre`, written by llama.cpp's converter from
//! a hash of the HF tokenizer's output); llama.cpp maps each name to a list of regular
//! expressions and a few flags (`llama-vocab.cpp`). This table is that mapping, as data: the
//! regexes split the text in order (each one splits every piece the previous produced, keeping
//! matches and the text between them — `tokenizers`' `Split(…, Isolated)`), then the pieces are
//! byte-encoded (GPT-2's byte-to-unicode map) unless the family works on raw UTF-8.
//!
//! The reference is what the HF tokenizer gives (llama.cpp's `.out` test files are HF output);
//! the regexes run on Oniguruma, the engine of the HF `tokenizers` library. Two pre-tokenizers
//! are not regular expressions at all in llama.cpp (`kimi-k2`, `afmoe`: hand-written splitters)
//! and are refused.

/// GPT-2's pattern as llama.cpp writes it (HF's `ByteLevel(use_regex = true)` applies the same
/// split with a trailing `|\s+`, which only names a piece the split keeps anyway).
pub(crate) const GPT2: &str =
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)";

pub(crate) const LLAMA3: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const JAIS2: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s{512}(?!\S)|\s{256}(?!\S)|\s{128}(?!\S)|\s{64}(?!\S)|\s{32}(?!\S)|\s{16}(?!\S)|\s{8}(?!\S)|\s{4}(?!\S)|\s{1,2}(?!\S)|\s{1}";
pub(crate) const QWEN2: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN35: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
// The letter classes of DeepSeek-LLM, as escapes (exact code points; no normalization in transit).
const DEEPSEEK_LLM_LETTERS: &str = "\\s?[A-Za-z\u{b5}\u{c0}-\u{d6}\u{d8}-\u{f6}\u{f8}-\u{1ba}\u{1bc}-\u{1bf}\u{1c4}-\u{293}\u{295}-\u{2af}\u{370}-\u{373}\u{376}\u{377}\u{37b}-\u{37d}\u{37f}\u{386}\u{388}-\u{38a}\u{38c}\u{38e}-\u{3a1}\u{3a3}-\u{3f5}\u{3f7}-\u{481}\u{48a}-\u{52f}\u{531}-\u{556}\u{10a0}-\u{10c5}\u{13a0}-\u{13f5}\u{13f8}-\u{13fd}\u{1c90}-\u{1cba}\u{1cbd}-\u{1cbf}\u{1d00}-\u{1d2b}\u{1d6b}-\u{1d77}\u{1d79}-\u{1d9a}\u{1e00}-\u{1f15}\u{1f18}-\u{1f1d}\u{1f20}-\u{1f45}\u{1f48}-\u{1f4d}\u{1f50}-\u{1f57}\u{1f59}\u{1f5b}\u{1f5d}\u{1f5f}-\u{1f7d}\u{1f80}-\u{1fb4}\u{1fb6}-\u{1fbc}\u{1fbe}\u{1fc2}-\u{1fc4}\u{1fc6}-\u{1fcc}\u{1fd0}-\u{1fd3}\u{1fd6}-\u{1fdb}\u{1fe0}-\u{1fec}\u{1ff2}-\u{1ff4}\u{1ff6}-\u{1ffc}\u{2102}\u{2107}\u{210a}-\u{2113}\u{2115}\u{2119}-\u{211d}\u{2124}\u{2126}\u{2128}\u{212a}-\u{212d}\u{212f}-\u{2134}\u{2139}\u{213c}-\u{213f}\u{2145}-\u{2149}\u{214e}\u{2183}\u{2184}\u{2c00}-\u{2c7b}\u{2c7e}-\u{2ce4}\u{2ceb}-\u{2cee}\u{2cf2}\u{2cf3}\u{a640}-\u{a66d}\u{a680}-\u{a69b}\u{a722}-\u{a76f}\u{a771}-\u{a787}\u{a78b}-\u{a78e}\u{ab70}-\u{abbf}\u{fb00}-\u{fb06}\u{fb13}-\u{fb17}\u{ff21}-\u{ff3a}\u{ff41}-\u{ff5a}\u{10400}-\u{1044f}\u{104b0}-\u{104d3}\u{104d8}-\u{104fb}\u{10c80}-\u{10cb2}\u{10cc0}-\u{10cf2}\u{118a0}-\u{118df}\u{1e900}-\u{1e943}]+";
const CJK_KO: &str = r"[一-龥ࠀ-一가-퟿]+";
const DEEPSEEK3_WORDS: &str = r"[!\x22#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const SPARK_WORDS: &str = r"[!\x22#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+|[\r\n]|\s+(?!\S)|\s+";
const CJK_KANA: &str = r"[一-龥぀-ゟ゠-ヿ]+";
const YOUTU_CJK: &str = r"[가-힣ㄱ-ㆎ]+|[！…“”‘’—：；，、-〿︰-﹏]+|[ㄅ-ㄯ]+|[一-龥぀-ゟ゠-ヿ]+";
const YOUTU_WORDS: &str = r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const BLOOM: &str = r" ?[^(\s|.,!?…。，、।۔،)]+";
const TEKKEN: &str = r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const GPT4O: &str = r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const GRANITE_EMB_MULTI: &str = r"[^\r\n\p{L}\p{N}]?((?=[\p{L}\p{M}])([^a-z]))*((?=[\p{L}\p{M}])([^A-Z]))+(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|[^\r\n\p{L}\p{N}]?((?=[\p{L}\p{M}])([^a-z]))+((?=[\p{L}\p{M}])([^A-Z]))*(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const TINY_AYA_WORDS: &str = r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const BAILINGMOE: &str = r"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+";
const SEED_CODER: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+";
const UFAKZEKA: &str =
    r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const EXAONE_MOE: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?(?:\p{L}\p{M}*(?: \p{L}\p{M}*)*)+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]?|\s*[\r\n]|\s+(?!\S)|\s+";
const MINICPM5: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}+| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const LINES: &str = r"[^\n]+|[\n]+";

/// How one `tokenizer.ggml.pre` tokenizes.
#[derive(Clone, Copy, Debug)]
pub(crate) struct PreTokenizerSpec {
    /// The llama.cpp pre-tokenizer type it maps to (for messages and docs).
    pub kind: &'static str,
    /// Split patterns, applied in order.
    pub regexes: &'static [&'static str],
    /// GPT-2 byte-level encoding of the pieces (else raw UTF-8 with `<0xXX>` byte fallback).
    pub byte_encode: bool,
    /// Spaces become `▁` before splitting (raw-UTF-8 families).
    pub escape_whitespaces: bool,
    /// A whole piece that is a vocabulary entry is taken as is, before any merge.
    pub ignore_merges: bool,
    /// The family adds a BOS to raw text unless the GGUF says otherwise.
    pub add_bos: bool,
}

const fn bpe(kind: &'static str, regexes: &'static [&'static str]) -> PreTokenizerSpec {
    PreTokenizerSpec {
        kind,
        regexes,
        byte_encode: true,
        escape_whitespaces: false,
        ignore_merges: false,
        add_bos: false,
    }
}

/// The spec of `tokenizer.ggml.pre = name` (`None`: the key is absent, llama.cpp's `default`);
/// `Err` names why a known name is refused or that the name is unknown.
pub(crate) fn spec(name: Option<&str>) -> Result<PreTokenizerSpec, String> {
    const DEFAULT: &[&str] = &[r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"];
    let Some(name) = name else {
        return Ok(bpe("default", DEFAULT));
    };
    let s = match name {
        "default" => bpe("default", DEFAULT),
        "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "falcon-h1" | "pixtral" | "midm-2.0"
        | "lfm2" | "jina-v5-nano" => PreTokenizerSpec {
            ignore_merges: true,
            add_bos: true,
            ..bpe("llama3", &[LLAMA3])
        },
        "minicpm5" => PreTokenizerSpec {
            ignore_merges: true,
            ..bpe("minicpm5", &[r"\p{N}{1,3}", MINICPM5])
        },
        "jais-2" => bpe("jais2", &[JAIS2]),
        "dbrx" | "smaug-bpe" => bpe("dbrx", &[LLAMA3]),
        "deepseek-llm" => bpe(
            "deepseek-llm",
            &[
                "[\r\n]",
                DEEPSEEK_LLM_LETTERS,
                r"\s?[!-/:-~！-／：-～‘-‟　-。]+",
                r"\s+$",
                CJK_KO,
                r"\p{N}+",
            ],
        ),
        "deepseek-v3" | "hunyuan-dense" | "joyai-llm" | "hy_v4" => {
            bpe("deepseek-v3", &[r"\p{N}{1,3}", CJK_KANA, DEEPSEEK3_WORDS])
        }
        "spark2_5" => bpe(
            "spark2_5",
            &[r"\p{N}{1,3}", CJK_KANA, SPARK_WORDS, r"\p{N}"],
        ),
        "youtu" => PreTokenizerSpec {
            ignore_merges: true,
            ..bpe("youtu", &[YOUTU_CJK, YOUTU_WORDS])
        },
        "deepseek-coder" => bpe(
            "deepseek-coder",
            &["[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", CJK_KO, r"\p{N}"],
        ),
        "falcon" => bpe(
            "falcon",
            &[r"[\p{P}\$\+<=>\^~\|`]+", GPT2, r"[0-9][0-9][0-9]"],
        ),
        "starcoder" | "refact" | "command-r" | "smollm" | "codeshell" | "exaone" | "minerva-7b"
        | "mellum2" => bpe("starcoder", &[r"\p{N}", GPT2]),
        "gpt-2" | "phi-2" | "jina-es" | "jina-de" | "gigachat" | "jina-v2-es" | "jina-v2-de"
        | "a.x-4.0" | "mellum" | "modern-bert" | "exaone4" | "mpt" | "olmo" | "jais"
        | "trillion" | "granite-docling" | "jina-v1-en" | "jina-v2-code" | "roberta-bpe" => {
            bpe("gpt2", &[GPT2])
        }
        "qwen2" | "deepseek-r1-qwen" | "kormo" | "f2llmv2" | "megrez" | "stablelm2"
        | "hunyuan" | "solar-open" | "grok-2" => bpe("qwen2", &[QWEN2]),
        "qwen35" => bpe("qwen35", &[QWEN35]),
        "poro-chat" | "bloom" | "gpt3-finnish" => bpe("bloom", &[BLOOM]),
        "viking" => bpe("viking", &[BLOOM, r"\p{N}"]),
        "chatglm-bpe" => bpe("chatglm4", &[LLAMA3]),
        "glm4" | "glm5" => PreTokenizerSpec {
            ignore_merges: true,
            ..bpe("chatglm4", &[LLAMA3])
        },
        "tekken" => PreTokenizerSpec {
            ignore_merges: true,
            add_bos: true,
            ..bpe("tekken", &[TEKKEN])
        },
        "chameleon" => PreTokenizerSpec {
            add_bos: true,
            ..bpe(
                "chameleon",
                &[
                    r"<sentinel:[0-9]+>",
                    r"(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z",
                    r"([\t\n]|    |  )",
                    r"\p{N}",
                    r"[\p{P}!-/:-@\[-`{-~]",
                    GPT2,
                ],
            )
        },
        "gpt-4o" | "llama4" | "kanana2" | "talkie" | "minimax-m2" => bpe("gpt-4o", &[GPT4O]),
        "granite-embed-multi-97m" => PreTokenizerSpec {
            ignore_merges: true,
            ..bpe("granite-embed-multi", &[GRANITE_EMB_MULTI])
        },
        "tiny_aya" | "cohere2moe" => bpe(
            "tiny_aya",
            &[r"\d{1,3}(?=(?:\d{3})*\b)", TINY_AYA_WORDS],
        ),
        "superbpe" => bpe("superbpe", &[r"\p{N}+", r"(?=(\d{3})+(?!\d))"]),
        "bailingmoe" | "bailingmoe2" | "llada-moe" => bpe("bailingmoe", &[BAILINGMOE]),
        "seed-coder" => bpe("seed-coder", &[SEED_CODER]),
        "ufakzeka" => bpe("ufakzeka", &[UFAKZEKA]),
        "laguna" => bpe("laguna", &[LINES, QWEN2]),
        "exaone-moe" => bpe("exaone-moe", &[EXAONE_MOE]),
        "gemma4" | "granite-embed-multi-311m" | "mmbert" | "sarvam-moe" => PreTokenizerSpec {
            byte_encode: false,
            escape_whitespaces: true,
            add_bos: name == "gemma4",
            ..bpe("gemma4", &[LINES])
        },
        "whitespace" => PreTokenizerSpec {
            byte_encode: false,
            ..bpe("whitespace", &[r"\S+"])
        },
        "kimi-k2" | "afmoe" => {
            return Err(format!(
                "tokenizer.ggml.pre = {name:?}: llama.cpp pre-tokenizes it with a hand-written \
                 splitter, not a regular expression; load the model's HF folder \
                 (tokenizer.json) instead"
            ))
        }
        other => {
            return Err(format!(
                "tokenizer.ggml.pre = {other:?} is not a known pre-tokenizer (docs/prompt-profiles.md lists them)"
            ))
        }
    };
    Ok(s)
}

/// Every name [`spec`] accepts (for docs and tests).
#[cfg(test)]
pub(crate) const NAMES: &[&str] = &[
    "default",
    "llama3",
    "llama-v3",
    "llama-bpe",
    "falcon3",
    "falcon-h1",
    "pixtral",
    "midm-2.0",
    "lfm2",
    "jina-v5-nano",
    "minicpm5",
    "jais-2",
    "dbrx",
    "smaug-bpe",
    "deepseek-llm",
    "deepseek-v3",
    "hunyuan-dense",
    "joyai-llm",
    "hy_v4",
    "spark2_5",
    "youtu",
    "deepseek-coder",
    "falcon",
    "starcoder",
    "refact",
    "command-r",
    "smollm",
    "codeshell",
    "exaone",
    "minerva-7b",
    "mellum2",
    "gpt-2",
    "phi-2",
    "jina-es",
    "jina-de",
    "gigachat",
    "jina-v2-es",
    "jina-v2-de",
    "a.x-4.0",
    "mellum",
    "modern-bert",
    "exaone4",
    "mpt",
    "olmo",
    "jais",
    "trillion",
    "granite-docling",
    "jina-v1-en",
    "jina-v2-code",
    "roberta-bpe",
    "qwen2",
    "deepseek-r1-qwen",
    "kormo",
    "f2llmv2",
    "megrez",
    "stablelm2",
    "hunyuan",
    "solar-open",
    "grok-2",
    "qwen35",
    "poro-chat",
    "bloom",
    "gpt3-finnish",
    "viking",
    "chatglm-bpe",
    "glm4",
    "glm5",
    "tekken",
    "chameleon",
    "gpt-4o",
    "llama4",
    "kanana2",
    "talkie",
    "minimax-m2",
    "granite-embed-multi-97m",
    "tiny_aya",
    "cohere2moe",
    "superbpe",
    "bailingmoe",
    "bailingmoe2",
    "llada-moe",
    "seed-coder",
    "ufakzeka",
    "laguna",
    "exaone-moe",
    "gemma4",
    "granite-embed-multi-311m",
    "mmbert",
    "sarvam-moe",
    "whitespace",
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_name_has_a_spec_whose_regexes_compile() {
        for name in NAMES {
            let s = spec(Some(name)).unwrap_or_else(|e| panic!("{name}: {e}"));
            for r in s.regexes {
                tokenizers::pre_tokenizers::split::Split::new(
                    tokenizers::pre_tokenizers::split::SplitPattern::Regex((*r).into()),
                    tokenizers::SplitDelimiterBehavior::Isolated,
                    false,
                )
                .unwrap_or_else(|e| panic!("{name}: {r}: {e}"));
            }
        }
        assert!(spec(Some("kimi-k2")).unwrap_err().contains("hand-written"));
        assert!(spec(Some("nope")).unwrap_err().contains("not a known"));
        assert_eq!(spec(None).unwrap().kind, "default");
    }
}
