//! `kvgate tokenize` end to end: the real binary on the pinned default model (found in
//! `$KVGATE_MODEL_DIR` or `<workspace>/models/`; the tests fail with a clear message when it
//! is missing) and on small hand-written HF files, plus every bad-input path.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

const MODEL_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

fn model_path() -> PathBuf {
    let dir = match std::env::var_os("KVGATE_MODEL_DIR") {
        Some(d) => PathBuf::from(d),
        None => PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("models"),
    };
    let path = dir.join(MODEL_FILE);
    assert!(
        path.is_file(),
        "default model not found at {} (set KVGATE_MODEL_DIR or run scripts/fetch-model.sh)",
        path.display()
    );
    path
}

fn kvgate(args: &[&str], stdin: Option<&str>) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvgate"))
        .arg("tokenize")
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut pipe = child.stdin.take().unwrap();
    if let Some(input) = stdin {
        pipe.write_all(input.as_bytes()).unwrap();
    }
    drop(pipe);
    child.wait_with_output().unwrap()
}

fn ok_json(args: &[&str], stdin: Option<&str>) -> serde_json::Value {
    let mut all = args.to_vec();
    all.push("--json");
    let out = kvgate(&all, stdin);
    assert!(
        out.status.success(),
        "{:?} failed: {}",
        args,
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

/// Asserts a clean failure: exit status 1, exactly one stderr line, no panic. Returns it.
fn one_line_error(args: &[&str], stdin: Option<&str>) -> String {
    let out = kvgate(args, stdin);
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(out.status.code(), Some(1), "{args:?}: {stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert_eq!(stderr.trim_end().lines().count(), 1, "{args:?}: {stderr:?}");
    assert!(stderr.starts_with("kvgate: error: "), "{stderr}");
    assert!(out.stdout.is_empty());
    stderr
}

fn write(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, bytes).unwrap();
    p
}

#[test]
fn raw_text_golden_ids() {
    let model = model_path();
    let v = ok_json(
        &[
            "--model",
            model.to_str().unwrap(),
            "--raw",
            "--text",
            "<|im_start|>user\n",
        ],
        None,
    );
    assert_eq!(v["ids"], serde_json::json!([1, 4093, 198]));
    assert_eq!(v["num_tokens"], 3);
    assert_eq!(v["identity"]["context_limit"], 8192);
    assert_eq!(v["identity"]["eos_token_ids"], serde_json::json!([2]));
    assert_eq!(v["identity"]["model_id"], "SmolLM2-135M-Instruct.Q4_1");
    assert_eq!(v["digest"].as_str().unwrap().len(), 64);
}

#[test]
fn messages_file_and_stdin_render_the_conversation() {
    let model = model_path();
    let model = model.to_str().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let body = r#"{"model": "m", "messages": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": [{"type": "text", "text": "What is 2+2?"}]},
        {"role": "assistant", "content": "4."},
        {"role": "user", "content": "And 3+3?"}]}"#;
    let file = write(dir.path(), "chat.json", body.as_bytes());
    let expected = "<|im_start|>system\nYou are terse.<|im_end|>\n\
                    <|im_start|>user\nWhat is 2+2?<|im_end|>\n\
                    <|im_start|>assistant\n4.<|im_end|>\n\
                    <|im_start|>user\nAnd 3+3?<|im_end|>\n\
                    <|im_start|>assistant\n";
    let v = ok_json(
        &["--model", model, "--messages", file.to_str().unwrap()],
        None,
    );
    assert_eq!(v["prompt"], expected);
    let ids = v["ids"].as_array().unwrap();
    assert_eq!(ids[0], 1);
    assert_eq!(ids.iter().filter(|i| **i == 2).count(), 4);

    let v2 = ok_json(&["--model", model, "--messages", "-"], Some(body));
    assert_eq!(v2, v, "stdin gives the same result");

    let v3 = ok_json(
        &[
            "--model",
            model,
            "--messages",
            file.to_str().unwrap(),
            "--no-generation-prompt",
        ],
        None,
    );
    assert_eq!(
        format!("{}<|im_start|>assistant\n", v3["prompt"].as_str().unwrap()),
        expected
    );

    let v4 = ok_json(
        &["--model", model, "--text", "Hi", "--revision", "r1"],
        None,
    );
    assert_eq!(v4["identity"]["revision"], "r1");
    assert!(v4["prompt"].as_str().unwrap().contains("named SmolLM"));
    assert_ne!(v4["digest"], v["digest"]);
}

#[test]
fn human_output_lists_identity_prompt_and_ids() {
    let model = model_path();
    let out = kvgate(&["--model", model.to_str().unwrap(), "--text", "Hi"], None);
    assert!(out.status.success());
    let s = String::from_utf8(out.stdout).unwrap();
    for needle in [
        "model_id          SmolLM2-135M-Instruct.Q4_1",
        "context_limit     8192",
        "eos_token_ids     [2]",
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
        "ids (",
        "[1, ",
    ] {
        assert!(s.contains(needle), "missing {needle:?} in\n{s}");
    }
}

#[test]
fn bad_inputs_fail_with_one_line() {
    let model = model_path();
    let model = model.to_str().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let d = |name: &str| dir.path().join(name).to_str().unwrap().to_string();

    let e = one_line_error(&["--model", &d("missing.gguf"), "--text", "hi"], None);
    assert!(e.contains("cannot read"), "{e}");

    let text = write(dir.path(), "notes.gguf", b"just some text, not a model\n");
    let e = one_line_error(&["--model", text.to_str().unwrap(), "--text", "hi"], None);
    assert!(e.contains("not a GGUF file"), "{e}");

    // the first 100 KB of the real model: the metadata is cut short
    let head: Vec<u8> = std::fs::read(model).unwrap()[..100_000].to_vec();
    let cut = write(dir.path(), "cut.gguf", &head);
    let e = one_line_error(&["--model", cut.to_str().unwrap(), "--text", "hi"], None);
    assert!(e.contains("truncated"), "{e}");

    let bad = write(
        dir.path(),
        "bad.json",
        b"[{\"role\": \"user\", \"content\": ",
    );
    let e = one_line_error(
        &["--model", model, "--messages", bad.to_str().unwrap()],
        None,
    );
    assert!(e.contains("invalid JSON"), "{e}");

    let img = write(
        dir.path(),
        "img.json",
        br#"[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]"#,
    );
    let e = one_line_error(
        &["--model", model, "--messages", img.to_str().unwrap()],
        None,
    );
    assert!(e.contains("image_url"), "{e}");

    let e = one_line_error(&["--model", model, "--messages", &d("none.json")], None);
    assert!(e.contains("none.json"), "{e}");

    let e = one_line_error(
        &["--model", model, "--messages", "-"],
        Some("{\"messages\": 3}"),
    );
    assert!(e.contains("messages"), "{e}");
}

/// A HF folder whose template refuses unknown roles (multi-line raise message included).
#[test]
fn hf_folder_and_template_rejection() {
    let dir = tempfile::tempdir().unwrap();
    let tok = serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null,
        "added_tokens": [{"id": 0, "content": "<eos>", "single_word": false, "lstrip": false,
                          "rstrip": false, "normalized": false, "special": true}],
        "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null,
        "decoder": null,
        "model": {"type": "WordLevel", "vocab": {"<eos>": 0, "<unk>": 1, "hi": 2, "user": 3, ":": 4},
                  "unk_token": "<unk>"}
    });
    write(dir.path(), "tokenizer.json", tok.to_string().as_bytes());
    let cfg = serde_json::json!({
        "eos_token": "<eos>", "model_max_length": 64,
        "chat_template": "{% for m in messages %}{% if m.role != 'user' %}{{ raise_exception('Only user\nmessages: got ' + m.role) }}{% endif %}{{ m.role }}: {{ m.content }} {{ eos_token }}{% endfor %}"
    });
    write(
        dir.path(),
        "tokenizer_config.json",
        cfg.to_string().as_bytes(),
    );
    let folder = dir.path().to_str().unwrap();
    let v = ok_json(&["--model", folder, "--text", "hi"], None);
    assert_eq!(v["prompt"], "user: hi <eos>");
    assert_eq!(v["ids"], serde_json::json!([3, 4, 2, 0]));
    assert_eq!(v["identity"]["context_limit"], 64);
    assert_eq!(v["identity"]["eos_token_ids"], serde_json::json!([0]));

    let chat = write(
        dir.path(),
        "c.json",
        br#"[{"role": "wizard", "content": "hi"}]"#,
    );
    let e = one_line_error(
        &["--model", folder, "--messages", chat.to_str().unwrap()],
        None,
    );
    assert!(e.contains("Only user messages: got wizard"), "{e}");
}

#[path = "../prompt-profile/tests/fixture_dir/mod.rs"]
mod fixture_dir;
use fixture_dir::llama_models;

/// A vocabulary-only GGUF (Llama 3's tokenizer, no chat template) with a template given on the
/// command line: completion text gets the reference ids of llama.cpp's test set (after the BOS
/// the Llama 3 family adds), and a chat renders with the given template.
#[test]
fn a_vocabulary_only_gguf_with_a_chat_template_file() {
    let models = llama_models();
    let vocab = models.join("ggml-vocab-llama-bpe.gguf");
    let vocab = vocab.to_str().unwrap();
    let e = one_line_error(&["--model", vocab, "--text", "hi"], None);
    assert!(e.contains("chat_template"), "{e}");

    let template = models.join("templates/Qwen-Qwen2.5-7B-Instruct.jinja");
    let template = template.to_str().unwrap();
    let inp = std::fs::read_to_string(models.join("ggml-vocab-llama-bpe.gguf.inp")).unwrap();
    let out = std::fs::read_to_string(models.join("ggml-vocab-llama-bpe.gguf.out")).unwrap();
    let tests: Vec<&str> = inp.split("\n__ggml_vocab_test__\n").collect();
    let lines: Vec<&str> = out.lines().collect();
    let mut checked = 0;
    for (text, line) in tests.iter().zip(&lines).filter(|(t, _)| t.len() > 3) {
        let want: Vec<u64> = line
            .split_whitespace()
            .map(|x| x.parse().unwrap())
            .collect();
        let v = ok_json(
            &[
                "--model",
                vocab,
                "--chat-template",
                template,
                "--raw",
                "--text",
                text,
            ],
            None,
        );
        let ids: Vec<u64> = v["ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|i| i.as_u64().unwrap())
            .collect();
        assert_eq!(ids[0], 128000, "Llama 3 adds <|begin_of_text|>");
        assert_eq!(ids[1..], want[..], "{text:?}");
        checked += 1;
        if checked == 5 {
            break;
        }
    }
    assert_eq!(checked, 5);

    let v = ok_json(
        &[
            "--model",
            vocab,
            "--chat-template",
            template,
            "--text",
            "Hi",
        ],
        None,
    );
    let prompt = v["prompt"].as_str().unwrap();
    assert!(
        prompt.starts_with("<|im_start|>system\nYou are Qwen")
            && prompt.ends_with("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"),
        "{prompt}"
    );
    let digest = v["identity"]["template_sha256"].as_str().unwrap();
    assert_eq!(digest.len(), 64);
}

/// A chat completion body's prompt-shaping fields reach the template as in a worker.
#[test]
fn a_body_with_tools_and_template_kwargs() {
    let models = llama_models();
    let template = models.join("templates/Qwen-Qwen3-0.6B.jinja");
    let model = model_path();
    let dir = tempfile::tempdir().unwrap();
    let body = serde_json::json!({
        "model": "m",
        "messages": [{"role": "user", "content": "Weather in Paris?"}],
        "tools": [{"type": "function", "function": {"name": "get_weather",
                   "parameters": {"type": "object", "properties": {}}}}],
        "chat_template_kwargs": {"enable_thinking": false},
        "max_tokens": 5
    });
    let file = write(dir.path(), "body.json", body.to_string().as_bytes());
    let args = [
        "--model",
        model.to_str().unwrap(),
        "--chat-template",
        template.to_str().unwrap(),
        "--messages",
        file.to_str().unwrap(),
    ];
    let v = ok_json(&args, None);
    let prompt = v["prompt"].as_str().unwrap();
    assert!(
        prompt
            .contains("<tools>\n{\"type\": \"function\", \"function\": {\"name\": \"get_weather\""),
        "{prompt}"
    );
    assert!(
        prompt.ends_with("<|im_start|>assistant\n<think>\n\n</think>\n\n"),
        "{prompt}"
    );

    let mut bad = body.clone();
    bad["tool_choice"] = serde_json::json!({"type": "function", "function": {"name": "nope"}});
    let file = write(dir.path(), "bad.json", bad.to_string().as_bytes());
    let mut args = args;
    args[5] = file.to_str().unwrap();
    let e = one_line_error(&args, None);
    assert!(e.contains("tool_choice.function.name"), "{e}");
}
