//! Tests on small hand-built models (no model file needed): a tiny byte-level BPE written
//! both as GGUF metadata and as a HF `tokenizer.json`, differential tests between the two
//! loaders, and every error path of the GGUF reader and the loaders.

mod fixture_dir;

use std::path::{Path, PathBuf};

use prompt_profile::{parse_messages, ChatMessage, GgufMetadata, GgufValue, PromptProfile};
use proptest::prelude::*;
use rand::{Rng, SeedableRng};
use serde_json::json;

// ---------------------------------------------------------------- a tiny model

const SPECIALS: [&str; 3] = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];
const MERGES: [&str; 8] = [
    "h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "Ġ Ġ",
];
const TEMPLATE: &str = "{% for message in messages %}{% if message['role'] not in ['system', 'user', 'assistant'] %}{{ raise_exception('unknown role: ' + message['role']) }}{% endif %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

/// GPT-2's byte → unicode table.
fn byte_chars() -> Vec<char> {
    let mut printable: Vec<u32> = ('!' as u32..='~' as u32).collect();
    printable.extend('¡' as u32..='¬' as u32);
    printable.extend('®' as u32..='ÿ' as u32);
    let mut out = vec!['\0'; 256];
    let mut n = 0;
    for b in 0..256u32 {
        out[b as usize] = if printable.contains(&b) {
            char::from_u32(b).unwrap()
        } else {
            n += 1;
            char::from_u32(255 + n).unwrap()
        };
    }
    out
}

/// (tokens, token types): specials, the 256 byte tokens, then one token per merge.
fn tiny_vocab() -> (Vec<String>, Vec<i32>) {
    let mut tokens: Vec<String> = SPECIALS.iter().map(|s| s.to_string()).collect();
    let mut types = vec![3; SPECIALS.len()];
    for c in byte_chars() {
        tokens.push(c.to_string());
        types.push(1);
    }
    for m in MERGES {
        tokens.push(m.replace(' ', ""));
        types.push(1);
    }
    (tokens, types)
}

#[derive(Clone)]
enum V {
    U32(u32),
    Bool(bool),
    Str(String),
    StrArr(Vec<String>),
    I32Arr(Vec<i32>),
    Raw(u32, Vec<u8>),
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend((s.len() as u64).to_le_bytes());
    out.extend(s.as_bytes());
}

/// Serialize a GGUF v3 header + metadata (+ a few fake tensor bytes after it).
fn gguf_bytes(version: u32, kvs: &[(&str, V)]) -> Vec<u8> {
    let mut out = b"GGUF".to_vec();
    out.extend(version.to_le_bytes());
    out.extend(0u64.to_le_bytes());
    out.extend((kvs.len() as u64).to_le_bytes());
    for (k, v) in kvs {
        put_str(&mut out, k);
        match v {
            V::U32(x) => {
                out.extend(4u32.to_le_bytes());
                out.extend(x.to_le_bytes());
            }
            V::Bool(b) => {
                out.extend(7u32.to_le_bytes());
                out.push(u8::from(*b));
            }
            V::Str(s) => {
                out.extend(8u32.to_le_bytes());
                put_str(&mut out, s);
            }
            V::StrArr(items) => {
                out.extend(9u32.to_le_bytes());
                out.extend(8u32.to_le_bytes());
                out.extend((items.len() as u64).to_le_bytes());
                for s in items {
                    put_str(&mut out, s);
                }
            }
            V::I32Arr(items) => {
                out.extend(9u32.to_le_bytes());
                out.extend(5u32.to_le_bytes());
                out.extend((items.len() as u64).to_le_bytes());
                for x in items {
                    out.extend(x.to_le_bytes());
                }
            }
            V::Raw(ty, bytes) => {
                out.extend(ty.to_le_bytes());
                out.extend(bytes);
            }
        }
    }
    out
}

fn tiny_kvs() -> Vec<(&'static str, V)> {
    let (tokens, types) = tiny_vocab();
    vec![
        ("general.architecture", V::Str("llama".into())),
        ("general.name", V::Str("tiny".into())),
        ("llama.context_length", V::U32(512)),
        ("tokenizer.ggml.model", V::Str("gpt2".into())),
        ("tokenizer.ggml.pre", V::Str("smollm".into())),
        ("tokenizer.ggml.tokens", V::StrArr(tokens)),
        ("tokenizer.ggml.token_type", V::I32Arr(types)),
        (
            "tokenizer.ggml.merges",
            V::StrArr(MERGES.iter().map(|s| s.to_string()).collect()),
        ),
        ("tokenizer.ggml.bos_token_id", V::U32(1)),
        ("tokenizer.ggml.eos_token_id", V::U32(2)),
        ("tokenizer.ggml.add_bos_token", V::Bool(false)),
        ("tokenizer.chat_template", V::Str(TEMPLATE.into())),
    ]
}

fn with(
    kvs: Vec<(&'static str, V)>,
    key: &'static str,
    value: Option<V>,
) -> Vec<(&'static str, V)> {
    let mut kvs: Vec<_> = kvs.into_iter().filter(|(k, _)| *k != key).collect();
    if let Some(v) = value {
        kvs.push((key, v));
    }
    kvs
}

fn write(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, bytes).unwrap();
    p
}

fn tiny_gguf(dir: &Path) -> PathBuf {
    let mut bytes = gguf_bytes(3, &tiny_kvs());
    bytes.extend([0xAB; 64]); // stands in for tensor info/data, never read
    write(dir, "tiny.gguf", &bytes)
}

/// The same tokenizer as a HF tokenizer.json + tokenizer_config.json.
fn tiny_hf(dir: &Path, config: serde_json::Value) -> (PathBuf, PathBuf) {
    let (tokens, _) = tiny_vocab();
    let vocab: serde_json::Map<String, serde_json::Value> = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.clone(), json!(i)))
        .collect();
    let added: Vec<serde_json::Value> = SPECIALS
        .iter()
        .enumerate()
        .map(|(i, s)| json!({"id": i, "content": s, "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true}))
        .collect();
    let tok = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": "\\p{N}"}, "behavior": "Isolated", "invert": false},
            {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true}
        ]},
        "post_processor": null,
        "decoder": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                  "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                  "vocab": vocab, "merges": MERGES}
    });
    let t = write(dir, "tokenizer.json", tok.to_string().as_bytes());
    let c = write(dir, "tokenizer_config.json", config.to_string().as_bytes());
    (t, c)
}

fn hf_config() -> serde_json::Value {
    json!({"bos_token": "<|im_start|>", "eos_token": {"content": "<|im_end|>", "special": true},
           "model_max_length": 512, "chat_template": TEMPLATE, "add_bos_token": false})
}

// ---------------------------------------------------------------- happy paths

#[test]
fn tiny_gguf_loads_encodes_and_renders() {
    let dir = tempfile::tempdir().unwrap();
    let p = PromptProfile::from_gguf(tiny_gguf(dir.path())).unwrap();
    let n_byte = 256;
    assert_eq!(p.vocab_size(), SPECIALS.len() + n_byte + MERGES.len());
    let hello = p.encode("hello world", true).unwrap();
    let id = |t: &str| p.token_to_id(t).unwrap();
    assert_eq!(hello, vec![id("hello"), id("Ġwor"), id("l"), id("d")]);
    assert_eq!(p.encode("<|im_start|>hello", true).unwrap()[0], 1);
    assert!(p.encode("<|im_start|>", false).unwrap().len() > 1);
    // digits are isolated even where a merge would join them (no merge exists, so count)
    assert_eq!(p.encode("2024", true).unwrap().len(), 4);
    assert_eq!(p.decode(&hello, false).unwrap(), "hello world");
    assert!(p.is_special(2) && !p.is_special(3));

    let id = p.identity();
    assert_eq!(id.model_id, "tiny");
    assert_eq!(id.context_limit, 512);
    assert_eq!(id.eos_token_ids, vec![2]);
    assert_eq!(id.bos_token_id, Some(1));
    assert!(id.revision.starts_with("gguf-meta:"));

    let msgs = vec![ChatMessage::new("user", "hello")];
    let r = p.render_and_encode(&msgs).unwrap();
    assert_eq!(
        r.text,
        "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
    );
    assert_eq!(p.decode(&r.ids, false).unwrap(), r.text);
    assert_eq!(p.decode(&r.ids, true).unwrap(), "user\nhello\nassistant\n");
}

#[test]
fn general_version_is_the_revision_and_overrides_apply() {
    let dir = tempfile::tempdir().unwrap();
    let kvs = with(tiny_kvs(), "general.version", Some(V::Str("v1.2".into())));
    let path = write(dir.path(), "m.gguf", &gguf_bytes(3, &kvs));
    let p = PromptProfile::from_gguf(&path).unwrap();
    assert_eq!(p.identity().revision, "v1.2");
    let q = p.clone().with_revision("r9").with_model_id("svc-model");
    assert_eq!(q.identity().revision, "r9");
    assert_eq!(q.identity().model_id, "svc-model");
    assert_eq!(p.identity().revision, "v1.2", "the original is untouched");
    assert_eq!(
        q.identity().differing_fields(p.identity()),
        vec!["model_id", "revision"]
    );
}

#[test]
fn gguf_v2_and_other_value_types_read() {
    let dir = tempfile::tempdir().unwrap();
    let mut kvs = tiny_kvs();
    // u8 .. f64 scalars and a nested array (array of arrays of u16)
    kvs.push(("x.u8", V::Raw(0, vec![7])));
    kvs.push(("x.i8", V::Raw(1, vec![0xFF])));
    kvs.push(("x.u16", V::Raw(2, 513u16.to_le_bytes().to_vec())));
    kvs.push(("x.i16", V::Raw(3, (-2i16).to_le_bytes().to_vec())));
    kvs.push(("x.f32", V::Raw(6, 1.5f32.to_le_bytes().to_vec())));
    kvs.push(("x.u64", V::Raw(10, u64::MAX.to_le_bytes().to_vec())));
    kvs.push(("x.i64", V::Raw(11, (-5i64).to_le_bytes().to_vec())));
    kvs.push(("x.f64", V::Raw(12, 2.25f64.to_le_bytes().to_vec())));
    let mut nested = 2u32.to_le_bytes().to_vec(); // elem type u16
    nested.extend(2u64.to_le_bytes());
    nested.extend(1u16.to_le_bytes());
    nested.extend(2u16.to_le_bytes());
    let mut outer = 9u32.to_le_bytes().to_vec(); // elem type array
    outer.extend(1u64.to_le_bytes());
    outer.extend(&nested);
    kvs.push(("x.nested", V::Raw(9, outer)));
    let path = write(dir.path(), "v2.gguf", &gguf_bytes(2, &kvs));
    let meta = GgufMetadata::read(&path).unwrap();
    assert_eq!(meta.version, 2);
    assert_eq!(meta.get("x.u8"), Some(&GgufValue::U8(7)));
    assert_eq!(meta.get("x.i8"), Some(&GgufValue::I8(-1)));
    assert_eq!(meta.get("x.u16"), Some(&GgufValue::U16(513)));
    assert_eq!(meta.get("x.i16"), Some(&GgufValue::I16(-2)));
    assert_eq!(meta.get("x.f32"), Some(&GgufValue::F32(1.5)));
    assert_eq!(meta.get("x.u64"), Some(&GgufValue::U64(u64::MAX)));
    assert_eq!(meta.get("x.i64"), Some(&GgufValue::I64(-5)));
    assert_eq!(meta.get("x.f64"), Some(&GgufValue::F64(2.25)));
    assert_eq!(
        meta.get("x.nested"),
        Some(&GgufValue::Array(vec![GgufValue::Array(vec![
            GgufValue::U16(1),
            GgufValue::U16(2)
        ])]))
    );
    assert!(meta.get_u32("x.u64").is_err(), "out of u32 range");
    PromptProfile::from_gguf_metadata(&meta).unwrap();
}

#[test]
fn hf_loader_matches_gguf_loader() {
    let dir = tempfile::tempdir().unwrap();
    let g = PromptProfile::from_gguf(tiny_gguf(dir.path())).unwrap();
    let hf_dir = dir.path().join("tiny-hf");
    std::fs::create_dir(&hf_dir).unwrap();
    let (t, c) = tiny_hf(&hf_dir, hf_config());
    let h = PromptProfile::from_hf(&t, &c).unwrap();
    assert_eq!(h.identity().model_id, "tiny-hf");
    assert!(h.identity().revision.starts_with("hf-files:"));
    assert_eq!(h.identity().context_limit, 512);
    assert_eq!(h.identity().eos_token_ids, vec![2]);
    assert_eq!(h.identity().bos_token_id, Some(1));
    assert_eq!(h.identity().template_sha256, g.identity().template_sha256);
    assert_eq!(
        h.identity().tokenizer_sha256,
        g.identity().tokenizer_sha256,
        "same tokenizer, same canonical hash"
    );
    assert_eq!(h.vocab_size(), g.vocab_size());

    // seeded differential test over random text
    let seed = fixture_dir::test_seed(20261129);
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let alphabet: Vec<&str> = vec![
        "h",
        "e",
        "l",
        "o",
        " ",
        "w",
        "r",
        "d",
        "1",
        "7",
        "é",
        "日",
        "😀",
        "\n",
        "<|im_end|>",
        "<|im_start|>",
    ];
    for case in 0..300 {
        let n = rng.gen_range(0..40);
        let s: String = (0..n)
            .map(|_| alphabet[rng.gen_range(0..alphabet.len())])
            .collect();
        for special in [true, false] {
            let a = g.encode(&s, special).unwrap();
            let b = h.encode(&s, special).unwrap();
            assert_eq!(a, b, "seed {seed} case {case} {s:?}");
            assert_eq!(g.decode(&a, false).unwrap(), s, "seed {seed} case {case}");
        }
    }
}

#[test]
fn hf_template_and_limit_fallbacks() {
    let dir = tempfile::tempdir().unwrap();
    // chat_template as a named list, model_max_length = HF's "unset" sentinel, config.json
    let mut cfg = hf_config();
    cfg["chat_template"] =
        json!([{"name": "tool_use", "template": "x"}, {"name": "default", "template": TEMPLATE}]);
    cfg["model_max_length"] = json!(1000000000000000019884624838656.0f64);
    let (t, c) = tiny_hf(dir.path(), cfg.clone());
    let err = PromptProfile::from_hf(&t, &c).unwrap_err();
    assert_eq!(err.error_type(), "invalid_config", "{err}");
    write(
        dir.path(),
        "config.json",
        br#"{"max_position_embeddings": 2048}"#,
    );
    write(
        dir.path(),
        "generation_config.json",
        br#"{"eos_token_id": [2, 0]}"#,
    );
    let p = PromptProfile::from_hf(&t, &c).unwrap();
    assert_eq!(p.identity().context_limit, 2048);
    assert_eq!(p.identity().eos_token_ids, vec![2, 0]);
    assert_eq!(p.template_source(), TEMPLATE);

    // no chat_template in the config: chat_template.jinja beside it, else chat_template.json
    // (newer transformers), else an error
    cfg.as_object_mut().unwrap().remove("chat_template");
    let (t, c) = tiny_hf(dir.path(), cfg);
    assert_eq!(
        PromptProfile::from_hf(&t, &c).unwrap_err().error_type(),
        "missing_chat_template"
    );
    write(dir.path(), "chat_template.json", br#"{"template": 1}"#);
    assert_eq!(
        PromptProfile::from_hf(&t, &c).unwrap_err().error_type(),
        "invalid_config"
    );
    write(
        dir.path(),
        "chat_template.json",
        br#"{"chat_template": "{{ messages[0]['content'] }}!"}"#,
    );
    let p = PromptProfile::from_hf(&t, &c).unwrap();
    assert_eq!(
        p.render(&[ChatMessage::new("user", "hey")], true).unwrap(),
        "hey!"
    );
    write(
        dir.path(),
        "chat_template.jinja",
        b"{{ messages[0]['content'] }}",
    );
    let p = PromptProfile::from_hf(&t, &c).unwrap();
    assert_eq!(
        p.render(&[ChatMessage::new("user", "hey")], true).unwrap(),
        "hey"
    );
}

// ---------------------------------------------------------------- error paths

#[test]
fn missing_file_and_not_gguf() {
    let dir = tempfile::tempdir().unwrap();
    let err = PromptProfile::from_gguf(dir.path().join("nope.gguf")).unwrap_err();
    assert_eq!(err.error_type(), "io");
    let text = write(dir.path(), "t.gguf", b"hello, this is not a model");
    assert_eq!(
        PromptProfile::from_gguf(&text).unwrap_err().error_type(),
        "not_gguf"
    );
    let empty = write(dir.path(), "e.gguf", b"");
    assert_eq!(
        PromptProfile::from_gguf(&empty).unwrap_err().error_type(),
        "not_gguf"
    );
    // a directory is an io error, not a panic
    assert_eq!(
        PromptProfile::from_gguf(dir.path())
            .unwrap_err()
            .error_type(),
        "io"
    );
}

#[test]
fn unsupported_versions() {
    let dir = tempfile::tempdir().unwrap();
    let v1 = write(dir.path(), "v1.gguf", &gguf_bytes(1, &tiny_kvs()));
    let err = PromptProfile::from_gguf(&v1).unwrap_err();
    assert_eq!(err.error_type(), "unsupported_gguf_version");
    let mut be = gguf_bytes(3, &[]);
    be[4..8].copy_from_slice(&3u32.to_be_bytes());
    let be = write(dir.path(), "be.gguf", &be);
    let err = PromptProfile::from_gguf(&be).unwrap_err();
    assert!(err.to_string().contains("big-endian"), "{err}");
}

#[test]
fn every_truncation_is_an_error_not_a_panic() {
    let bytes = gguf_bytes(3, &tiny_kvs());
    // Every strict prefix of the metadata must fail cleanly. Step through all cut points.
    for cut in 0..bytes.len() {
        let r = GgufMetadata::from_reader(&bytes[..cut], cut as u64, "cut.gguf".into());
        let err = r.unwrap_err();
        let kind = err.error_type();
        assert!(
            matches!(kind, "not_gguf" | "gguf_truncated" | "gguf_malformed"),
            "cut {cut}: {kind}: {err}"
        );
        assert!(!err.to_string().contains('\n'));
    }
    assert!(GgufMetadata::from_reader(&bytes[..], bytes.len() as u64, "ok".into()).is_ok());
}

#[test]
fn absurd_lengths_are_refused_without_allocating() {
    // a string array claiming 2^60 elements
    let mut arr = 8u32.to_le_bytes().to_vec();
    arr.extend((1u64 << 60).to_le_bytes());
    let bytes = gguf_bytes(3, &[("x", V::Raw(9, arr))]);
    let err = GgufMetadata::from_reader(&bytes[..], bytes.len() as u64, "a".into()).unwrap_err();
    assert_eq!(err.error_type(), "gguf_truncated", "{err}");
    // a string claiming u64::MAX bytes
    let mut s = u64::MAX.to_le_bytes().to_vec();
    s.extend(b"abc");
    let bytes = gguf_bytes(3, &[("x", V::Raw(8, s))]);
    let err = GgufMetadata::from_reader(&bytes[..], bytes.len() as u64, "a".into()).unwrap_err();
    assert_eq!(err.error_type(), "gguf_truncated", "{err}");
    // a kv count of u64::MAX
    let mut bytes = gguf_bytes(3, &[]);
    bytes[16..24].copy_from_slice(&u64::MAX.to_le_bytes());
    let err = GgufMetadata::from_reader(&bytes[..], bytes.len() as u64, "a".into()).unwrap_err();
    assert_eq!(err.error_type(), "gguf_truncated", "{err}");
    // unknown type code, invalid bool, invalid UTF-8, arrays nested too deep
    for (ty, payload) in [
        (13u32, vec![0u8; 8]),
        (7, vec![2]),
        (
            8,
            [3u64.to_le_bytes().to_vec(), vec![0xff, 0xfe, 0xfd]].concat(),
        ),
    ] {
        let bytes = gguf_bytes(3, &[("x", V::Raw(ty, payload))]);
        let err =
            GgufMetadata::from_reader(&bytes[..], bytes.len() as u64, "a".into()).unwrap_err();
        assert_eq!(err.error_type(), "gguf_malformed", "{err}");
    }
    let mut deep = Vec::new();
    for _ in 0..20 {
        deep.extend(9u32.to_le_bytes());
        deep.extend(1u64.to_le_bytes());
    }
    deep.extend(4u32.to_le_bytes());
    deep.extend(0u64.to_le_bytes());
    let bytes = gguf_bytes(3, &[("x", V::Raw(9, deep))]);
    let err = GgufMetadata::from_reader(&bytes[..], bytes.len() as u64, "a".into()).unwrap_err();
    assert_eq!(err.error_type(), "gguf_malformed", "{err}");
}

#[test]
fn metadata_problems_are_typed_errors() {
    let dir = tempfile::tempdir().unwrap();
    let cases: Vec<(Vec<(&'static str, V)>, &str)> = vec![
        (
            with(tiny_kvs(), "tokenizer.chat_template", None),
            "missing_chat_template",
        ),
        (
            // SentencePiece needs its scores.
            with(
                tiny_kvs(),
                "tokenizer.ggml.model",
                Some(V::Str("llama".into())),
            ),
            "missing_metadata",
        ),
        (
            with(
                tiny_kvs(),
                "tokenizer.ggml.model",
                Some(V::Str("t5".into())),
            ),
            "unsupported_tokenizer",
        ),
        (
            with(
                tiny_kvs(),
                "tokenizer.ggml.pre",
                Some(V::Str("kimi-k2".into())),
            ),
            "unsupported_tokenizer",
        ),
        (
            with(
                tiny_kvs(),
                "tokenizer.ggml.pre",
                Some(V::Str("no-such-pre".into())),
            ),
            "unsupported_tokenizer",
        ),
        (
            with(tiny_kvs(), "tokenizer.ggml.tokens", None),
            "missing_metadata",
        ),
        (
            with(tiny_kvs(), "llama.context_length", None),
            "missing_metadata",
        ),
        (
            with(
                tiny_kvs(),
                "tokenizer.ggml.eos_token_id",
                Some(V::U32(100_000)),
            ),
            "wrong_metadata_type",
        ),
        (
            with(
                tiny_kvs(),
                "tokenizer.ggml.eos_token_id",
                Some(V::Str("2".into())),
            ),
            "wrong_metadata_type",
        ),
        (
            with(
                tiny_kvs(),
                "tokenizer.ggml.token_type",
                Some(V::I32Arr(vec![1, 3])),
            ),
            "wrong_metadata_type",
        ),
        (
            with(
                tiny_kvs(),
                "tokenizer.ggml.merges",
                Some(V::StrArr(vec!["nospace".into()])),
            ),
            "wrong_metadata_type",
        ),
        (
            with(
                tiny_kvs(),
                "tokenizer.ggml.merges",
                Some(V::StrArr(vec!["Q Z9".into()])),
            ),
            "tokenizer",
        ),
        (
            with(
                tiny_kvs(),
                "tokenizer.chat_template",
                Some(V::Str("{% for %}".into())),
            ),
            "template_error",
        ),
    ];
    for (i, (kvs, want)) in cases.into_iter().enumerate() {
        let path = write(dir.path(), &format!("c{i}.gguf"), &gguf_bytes(3, &kvs));
        let err = PromptProfile::from_gguf(&path).unwrap_err();
        assert_eq!(err.error_type(), want, "case {i}: {err}");
        assert!(!err.to_string().contains('\n'), "case {i}: {err}");
    }
}

#[test]
fn hf_error_paths() {
    let dir = tempfile::tempdir().unwrap();
    let (t, c) = tiny_hf(dir.path(), hf_config());
    let missing = dir.path().join("missing.json");
    assert_eq!(
        PromptProfile::from_hf(&missing, &c)
            .unwrap_err()
            .error_type(),
        "io"
    );
    let bad = write(dir.path(), "bad.json", b"{not json");
    assert_eq!(
        PromptProfile::from_hf(&bad, &c).unwrap_err().error_type(),
        "invalid_json"
    );
    assert_eq!(
        PromptProfile::from_hf(&t, &bad).unwrap_err().error_type(),
        "invalid_json"
    );
    let mut cfg = hf_config();
    cfg["eos_token"] = json!("<nope>");
    let c2 = write(dir.path(), "cfg2.json", cfg.to_string().as_bytes());
    assert_eq!(
        PromptProfile::from_hf(&t, &c2).unwrap_err().error_type(),
        "invalid_config"
    );
}

#[test]
fn template_rejections_and_bad_messages() {
    let dir = tempfile::tempdir().unwrap();
    let p = PromptProfile::from_gguf(tiny_gguf(dir.path())).unwrap();
    let err = p
        .render(&[ChatMessage::new("robot", "hi")], true)
        .unwrap_err();
    assert_eq!(err.error_type(), "template_raised");
    assert!(err.is_client_error());
    assert!(err.to_string().contains("unknown role: robot"), "{err}");
    // null content concatenated by the template: the conversation does not fit the template
    // (a client error), not a panic
    let msgs =
        parse_messages(&json!([{"role": "assistant", "content": null, "tool_calls": []}])).unwrap();
    let err = p.render(&msgs, true).unwrap_err();
    assert_eq!(err.error_type(), "template_render_failed");
    assert!(err.is_client_error());
    for bad in [
        json!({"nope": 1}),
        json!([{"content": "no role"}]),
        json!([{"role": "user", "content": 5}]),
        json!([{"role": "user", "content": [{"text": "no type"}]}]),
        json!([{"role": "user", "content": [{"type": "text"}]}]),
        json!([{"role": "user", "content": ["str"]}]),
        json!("string"),
    ] {
        let err = parse_messages(&bad).unwrap_err();
        assert_eq!(err.error_type(), "invalid_message", "{bad}");
        assert!(!err.to_string().contains('\n'));
    }
    // name / tool_calls pass through to the template
    let t = PromptProfile::from_gguf(tiny_gguf(dir.path())).unwrap();
    let msgs = parse_messages(&json!([{"role": "user", "content": "x", "name": "bob"}])).unwrap();
    assert_eq!(msgs[0].extra.get("name"), Some(&json!("bob")));
    assert!(t.render(&msgs, false).is_ok());
}

// ---------------------------------------------------------------- property tests

const REPLACEMENT: char = '\u{fffd}';

fn tiny_profile() -> &'static PromptProfile {
    static P: std::sync::OnceLock<PromptProfile> = std::sync::OnceLock::new();
    P.get_or_init(|| {
        let dir = tempfile::tempdir().unwrap();
        PromptProfile::from_gguf(tiny_gguf(dir.path())).unwrap()
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn prop_round_trip_and_stream(s in "\\PC{0,40}") {
        let p = tiny_profile();
        let ids = p.encode(&s, false).unwrap();
        prop_assert_eq!(&p.decode(&ids, false).unwrap(), &s);
        let mut stream = p.decode_stream(false);
        let mut out = String::new();
        for &id in &ids {
            if let Some(piece) = stream.step(id).unwrap() {
                let incomplete = piece.ends_with(REPLACEMENT) && !s.contains(REPLACEMENT);
                prop_assert!(!incomplete, "emitted an incomplete character: {:?}", piece);
                out.push_str(&piece);
            }
        }
        prop_assert!(stream.pending() <= ids.len());
        if let Some(rest) = stream.flush().unwrap() {
            out.push_str(&rest);
        }
        prop_assert_eq!(out, s);
    }

    #[test]
    fn prop_cached_encode_equals_direct(
        parts in proptest::collection::vec(
            prop_oneof![
                Just("<|im_start|>".to_string()),
                Just("<|im_end|>".to_string()),
                Just("<|im_".to_string()),
                Just("<<|im_end|>".to_string()),
                "[a-z <|>\n1-9é😀]{0,40}",
            ],
            0..12,
        )
    ) {
        let p = tiny_profile();
        let s: String = parts.concat();
        let direct = p.encode_uncached(&s, true).unwrap();
        prop_assert_eq!(&p.encode(&s, true).unwrap(), &direct);
        // second time from the cache
        prop_assert_eq!(&p.encode(&s, true).unwrap(), &direct);
    }

    #[test]
    fn prop_corrupted_metadata_never_panics(seed in any::<u64>(), flips in 1usize..8) {
        let mut bytes = gguf_bytes(3, &tiny_kvs());
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        for _ in 0..flips {
            let i = rng.gen_range(0..bytes.len());
            bytes[i] = rng.gen();
        }
        if let Ok(meta) = GgufMetadata::from_reader(&bytes[..], bytes.len() as u64, "x".into()) {
            let _ = PromptProfile::from_gguf_metadata(&meta);
        }
    }
}

#[test]
fn stream_holds_back_split_characters() {
    let p = tiny_profile();
    // "😀" is 4 bytes = 4 byte tokens: nothing is emitted before the last one
    let ids = p.encode("😀!", false).unwrap();
    assert_eq!(ids.len(), 5);
    let mut stream = p.decode_stream(false);
    let pieces: Vec<Option<String>> = ids.iter().map(|&id| stream.step(id).unwrap()).collect();
    assert_eq!(
        pieces,
        vec![
            None,
            None,
            None,
            Some("😀".to_string()),
            Some("!".to_string())
        ]
    );
    // a dangling partial character is flushed lossily
    let mut stream = p.decode_stream(false);
    assert_eq!(stream.step(ids[0]).unwrap(), None);
    assert_eq!(stream.flush().unwrap(), Some("\u{fffd}".to_string()));
    // special tokens are skipped when asked
    let mut stream = p.decode_stream(true);
    assert_eq!(stream.step(2).unwrap(), None);
    assert_eq!(
        stream.step(p.token_to_id("hello").unwrap()).unwrap(),
        Some("hello".into())
    );
    let mut stream = p.decode_stream(false);
    assert_eq!(stream.step(2).unwrap(), Some("<|im_end|>".into()));
    assert_eq!(
        stream.step(u32::MAX).unwrap_err().error_type(),
        "unknown_token_id"
    );
}
