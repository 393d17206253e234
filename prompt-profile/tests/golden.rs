//! Golden tests against the pinned default model (SmolLM2-135M-Instruct Q4_1 GGUF).
//!
//! The model is found in `$KVGATE_MODEL_DIR` or `<workspace>/models/`; the tests fail with a
//! clear message when it is missing (fetch it with the README's set-up command).

mod fixture_dir;

use std::path::PathBuf;
use std::sync::OnceLock;

use prompt_profile::{parse_messages, ChatMessage, PromptProfile};
use rand::{Rng, SeedableRng};

const MODEL_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

fn model_path() -> PathBuf {
    let dir = match std::env::var_os("KVGATE_MODEL_DIR") {
        Some(d) => PathBuf::from(d),
        None => PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models"),
    };
    let path = dir.join(MODEL_FILE);
    assert!(
        path.is_file(),
        "default model not found at {} (set KVGATE_MODEL_DIR or run scripts/fetch-model.sh)",
        path.display()
    );
    path
}

fn profile() -> &'static PromptProfile {
    static P: OnceLock<PromptProfile> = OnceLock::new();
    P.get_or_init(|| PromptProfile::from_gguf(model_path()).unwrap())
}

#[test]
fn im_start_user_newline() {
    assert_eq!(
        profile().encode("<|im_start|>user\n", true).unwrap(),
        vec![1, 4093, 198]
    );
}

#[test]
fn special_text_is_plain_without_parse_special() {
    let ids = profile().encode("<|im_start|>user\n", false).unwrap();
    assert!(!ids.contains(&1), "{ids:?}");
    assert!(ids.len() > 3);
    assert_eq!(profile().decode(&ids, false).unwrap(), "<|im_start|>user\n");
}

#[test]
fn no_leading_space_and_single_digit_tokens() {
    let p = profile();
    let hello = p.encode("Hello", true).unwrap();
    assert_eq!(hello.len(), 1);
    assert_eq!(p.id_to_token(hello[0]).unwrap(), "Hello");
    // digits are split one per token: "2+2" -> 2, +, 2
    let ids = p.encode("2+2", true).unwrap();
    assert_eq!(ids, vec![34, 27, 34]);
    let ids = p.encode("12345", true).unwrap();
    assert_eq!(ids.len(), 5);
}

#[test]
fn round_trip_mixed_text() {
    let text = "fn main() {\n    let x: Vec<u32> = (0..10).map(|i| i * 2).collect();\n    println!(\"{x:?}\");\n}\n\
        Prices: 3.14159, 1,000,000 and 2024-11-29T12:34:56Z.\n\
        Unicode: naïve café, Grüße, 日本語のテキスト, Ελληνικά, עברית, हिन्दी.\n\
        Emoji: 😀🎉👩‍👩‍👧‍👦 🇫🇷 ✓\n\
        \ttabs\t and   spaces  \r\n trailing ";
    let p = profile();
    let ids = p.encode(text, true).unwrap();
    assert_eq!(p.decode(&ids, false).unwrap(), text);
    let ids = p.encode(text, false).unwrap();
    assert_eq!(p.decode(&ids, false).unwrap(), text);
}

#[test]
fn round_trip_random_unicode_seeded() {
    let seed = fixture_dir::test_seed(0x5eed_2026);
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let pools: [&[char]; 5] = [
        &['a', 'b', 'z', ' ', '\n', '1', '9', '.', '{', '}', '_'],
        &['é', 'ß', 'ø', 'ü'],
        &['日', '本', '語', 'ق', 'ж'],
        &['😀', '🎉', '👍', '\u{200d}', '\u{fe0f}'],
        &['\u{0}', '\u{7f}', '\u{ffff}', '\u{10ffff}', '\u{fffd}'],
    ];
    let p = profile();
    for case in 0..200 {
        let len = rng.gen_range(0..60);
        let s: String = (0..len)
            .map(|_| {
                let pool = pools[rng.gen_range(0..pools.len())];
                pool[rng.gen_range(0..pool.len())]
            })
            .collect();
        let ids = p.encode(&s, false).unwrap();
        assert_eq!(p.decode(&ids, false).unwrap(), s, "seed {seed} case {case}");
        // streaming decode gives the same text
        let mut stream = p.decode_stream(false);
        let mut out = String::new();
        for &id in &ids {
            if let Some(piece) = stream.step(id).unwrap() {
                assert!(!piece.contains('\u{fffd}') || s.contains('\u{fffd}'));
                out.push_str(&piece);
            }
        }
        if let Some(rest) = stream.flush().unwrap() {
            out.push_str(&rest);
        }
        assert_eq!(out, s, "stream, seed {seed} case {case}");
    }
}

/// The piece cache of `encode` gives exactly the ids of the direct pipeline, on random text
/// with special tokens and on a growing conversation (turn N+1 reuses turn N's pieces).
#[test]
fn cached_encode_equals_direct_seeded() {
    let seed = fixture_dir::test_seed(0xCAC4E);
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let pieces = [
        "<|im_start|>",
        "<|im_end|>",
        "<|endoftext|>",
        "<file_sep>",
        "<|im_",
        "<",
        "|>",
        "\n",
        " the",
        "Hello",
        " world",
        "123",
        " 4.5",
        "é",
        "😀",
        "fn x() {}",
        "  ",
        "\t",
    ];
    let p = profile();
    p.clear_token_cache();
    for case in 0..300 {
        let n = rng.gen_range(0..30);
        let s: String = (0..n)
            .map(|_| pieces[rng.gen_range(0..pieces.len())])
            .collect();
        let direct = p.encode_uncached(&s, true).unwrap();
        assert_eq!(
            p.encode(&s, true).unwrap(),
            direct,
            "seed {seed} case {case} {s:?}"
        );
        assert_eq!(
            p.encode(&s, true).unwrap(),
            direct,
            "cached, seed {seed} case {case}"
        );
    }
    let mut messages = vec![ChatMessage::new("system", "You are terse.")];
    for turn in 0..8 {
        let role = if turn % 2 == 0 { "user" } else { "assistant" };
        let text: String = (0..rng.gen_range(1..40))
            .map(|_| pieces[rng.gen_range(0..pieces.len())])
            .collect();
        messages.push(ChatMessage::new(role, text));
        let r = p.render_and_encode(&messages).unwrap();
        assert_eq!(
            r.ids,
            p.encode_uncached(&r.text, true).unwrap(),
            "turn {turn}"
        );
    }
}

#[test]
fn two_turn_conversation_renders_exactly() {
    let messages = vec![
        ChatMessage::new("system", "You are terse."),
        ChatMessage::new("user", "What is 2+2?"),
        ChatMessage::new("assistant", "4."),
        ChatMessage::new("user", "And 3+3?"),
    ];
    let text = profile().render(&messages, true).unwrap();
    assert_eq!(
        text,
        "<|im_start|>system\nYou are terse.<|im_end|>\n\
         <|im_start|>user\nWhat is 2+2?<|im_end|>\n\
         <|im_start|>assistant\n4.<|im_end|>\n\
         <|im_start|>user\nAnd 3+3?<|im_end|>\n\
         <|im_start|>assistant\n"
    );
    let without = profile().render(&messages, false).unwrap();
    assert_eq!(format!("{without}<|im_start|>assistant\n"), text);

    let rendered = profile().render_and_encode(&messages).unwrap();
    assert_eq!(rendered.text, text);
    assert_eq!(rendered.ids.first(), Some(&1));
    // ends with the generation prompt <|im_start|>assistant\n
    let tail = profile().encode("<|im_start|>assistant\n", true).unwrap();
    assert_eq!(tail[0], 1);
    assert_eq!(tail.last(), Some(&198));
    assert!(rendered.ids.ends_with(&tail), "{:?}", rendered.ids);
    assert_eq!(profile().decode(&rendered.ids, false).unwrap(), text);
    assert_eq!(
        rendered.ids.iter().filter(|&&id| id == 2).count(),
        4,
        "one <|im_end|> per message"
    );
}

#[test]
fn default_system_prompt_when_none_given() {
    let messages = vec![ChatMessage::new("user", "Hi")];
    let text = profile().render(&messages, true).unwrap();
    assert_eq!(
        text,
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n\
         <|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    );
    // no default prompt when a system message is given
    let with_system = vec![
        ChatMessage::new("system", "S"),
        ChatMessage::new("user", "Hi"),
    ];
    let text = profile().render(&with_system, true).unwrap();
    assert!(!text.contains("SmolLM"), "{text}");
}

#[test]
fn content_parts_render_like_strings() {
    let parts: serde_json::Value = serde_json::json!([
        {"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "world"}]}
    ]);
    let plain: serde_json::Value = serde_json::json!([{"role": "user", "content": "Hello\nworld"}]);
    let a = profile()
        .render(&parse_messages(&parts).unwrap(), true)
        .unwrap();
    let b = profile()
        .render(&parse_messages(&plain).unwrap(), true)
        .unwrap();
    assert_eq!(a, b);
    let image = serde_json::json!({"messages": [
        {"role": "user", "content": "ok"},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
    ]});
    let err = parse_messages(&image).unwrap_err();
    assert_eq!(err.error_type(), "invalid_message");
    let msg = err.to_string();
    assert!(
        msg.contains("message 1") && msg.contains("image_url"),
        "{msg}"
    );
}

#[test]
fn identity_of_default_model() {
    let p = profile();
    let id = p.identity();
    assert_eq!(id.model_id, "SmolLM2-135M-Instruct.Q4_1");
    assert!(id.revision.starts_with("gguf-meta:"), "{}", id.revision);
    assert_eq!(id.context_limit, 8192);
    assert_eq!(id.eos_token_ids, vec![2]);
    assert_eq!(id.bos_token_id, Some(1));
    assert_eq!(p.vocab_size(), 49152);
    assert!(p.is_special(0) && p.is_special(1) && p.is_special(2) && p.is_special(16));
    assert!(!p.is_special(17) && !p.is_special(4093) && !p.is_special(1_000_000));
    assert_eq!(id.template_sha256.len(), 64);
    assert_eq!(id.tokenizer_sha256.len(), 64);
    // Loading twice gives the same identity (stable hashes, no map-order dependence).
    let again = PromptProfile::from_gguf(model_path()).unwrap();
    assert_eq!(again.identity(), id);
    assert_eq!(again.identity().digest(), id.digest());
    let other = again.with_revision("v2");
    assert_eq!(other.identity().differing_fields(id), vec!["revision"]);
    assert_ne!(other.identity().digest(), id.digest());
    // skip_special drops control tokens
    let ids = p.encode("<|im_start|>user\nhi<|im_end|>", true).unwrap();
    assert_eq!(p.decode(&ids, true).unwrap(), "user\nhi");
    assert_eq!(
        p.decode(&[49152], false).unwrap_err().error_type(),
        "unknown_token_id"
    );
}

#[test]
fn huge_prompts_are_refused_before_they_are_tokenized() {
    use prompt_profile::{ChatPrompt, ProfileError, PromptSource, TokenBudget};
    let p = profile();
    let budget = TokenBudget {
        context_limit: p.context_limit() as usize,
        native_reserve: 0,
    };
    // The floor is a true lower bound: for real text it never exceeds the exact count.
    let sample = "The quick brown fox jumps over the lazy dog. 12345 — ünïcödé\n".repeat(50);
    let exact = p.encode(&sample, true).unwrap().len();
    let floor = p.tokens_floor(sample.len());
    assert!(floor > 0 && floor <= exact, "floor {floor}, exact {exact}");
    // A 4 MiB message: refused with a lower bound, without running the tokenizer over it.
    let huge = "word ".repeat(4 << 20 >> 2);
    let chat = PromptSource::Chat(ChatPrompt::new(vec![ChatMessage::new(
        "user",
        huge.clone(),
    )]));
    match p.tokenize_within(&chat, budget, Some(16)).unwrap_err() {
        ProfileError::ContextLengthExceeded {
            prompt_tokens,
            context_limit,
            ..
        } => {
            assert!(prompt_tokens > context_limit, "{prompt_tokens}");
            assert!(prompt_tokens <= huge.len(), "{prompt_tokens}");
        }
        other => panic!("{other:?}"),
    }
    // Between the floor and the limit, tokenizing stops once the count passes the limit: a
    // conversation of many turns is cut off after the turn that crossed it.
    let turn = "Tell me more about the history of the printing press, please. ".repeat(4);
    let msgs: Vec<ChatMessage> = (0..400)
        .map(|i| ChatMessage::new(if i % 2 == 0 { "user" } else { "assistant" }, turn.clone()))
        .collect();
    let text = p.render(&msgs, true).unwrap();
    let full = p.encode(&text, true).unwrap();
    let limit = budget.max_prompt_tokens(Some(16));
    assert!(full.len() > limit && p.tokens_floor(text.len()) <= limit);
    let cut = p.encode_until(&text, limit).unwrap();
    assert!(
        cut.len() > limit && cut.len() < full.len(),
        "{} of {}",
        cut.len(),
        full.len()
    );
    assert_eq!(cut[..], full[..cut.len()]);
    let e = p
        .tokenize_within(&PromptSource::Chat(ChatPrompt::new(msgs)), budget, Some(16))
        .unwrap_err();
    assert_eq!(e.error_type(), "context_length_exceeded");
    // Inside the budget the result is the full, exact encoding.
    let small = PromptSource::Text(sample.clone());
    assert_eq!(
        p.tokenize_within(&small, budget, Some(16)).unwrap().ids,
        p.prompt_ids(&small).unwrap()
    );
}

#[test]
fn architecture_and_end_of_generation_ids() {
    let p = profile();
    assert_eq!(p.architecture(), Some("llama"));
    // eos <|im_end|> (2), then <|endoftext|> (0), an end token of llama.cpp's list.
    assert_eq!(p.eos_token_ids(), &[2]);
    assert_eq!(p.end_of_generation_ids(), &[2, 0]);
    assert_eq!(p.id_to_token(0).as_deref(), Some("<|endoftext|>"));

    // Gemma 3 270M (scripts/fetch-gemma3.sh): the GGUF names <eos> (1) only; a chat turn ends
    // with <end_of_turn> (106). The file has no chat template; any will do for this.
    let gemma = model_path().with_file_name("gemma-3-270m-q4_k_m.gguf");
    assert!(
        gemma.is_file(),
        "{} is missing: run scripts/fetch-gemma3.sh",
        gemma.display()
    );
    let g = PromptProfile::from_gguf_with_template(&gemma, "{{ messages }}".into()).unwrap();
    assert_eq!(g.architecture(), Some("gemma3"));
    assert_eq!(g.eos_token_ids(), &[1]);
    assert_eq!(g.end_of_generation_ids()[0], 1);
    assert!(
        g.end_of_generation_ids().contains(&106),
        "{:?}",
        g.end_of_generation_ids()
    );
    assert_eq!(g.id_to_token(106).as_deref(), Some("<end_of_turn>"));
}

/// `truncation: "auto"`: a conversation over the budget keeps its system message and its
/// newest turns — as few turns dropped as fit — and is tokenized exactly as that shorter
/// conversation sent whole; a cut never starts at an assistant or tool message; a last user
/// message too long alone is still refused; within the budget nothing is dropped.
#[test]
fn truncation_auto_drops_the_oldest_turns_that_do_not_fit() {
    use prompt_profile::{ChatPrompt, PromptSource, TokenBudget};
    let p = profile();
    let budget = TokenBudget {
        context_limit: 2048,
        native_reserve: 0,
    };
    let turn = |i: usize| format!("Turn {i}: tell me about the printing press. ").repeat(8);
    let mut msgs = vec![ChatMessage::new("system", "You are brief.".to_owned())];
    for i in 0..40 {
        msgs.push(ChatMessage::new("user", turn(i)));
        msgs.push(ChatMessage::new("assistant", format!("Answer {i}.")));
    }
    msgs.push(ChatMessage::new("user", "And now?".to_owned()));
    let chat = |m: Vec<ChatMessage>, truncate: bool| {
        let mut c = ChatPrompt::new(m);
        c.truncate = truncate;
        PromptSource::Chat(c)
    };
    let refused = p.tokenize_within(&chat(msgs.clone(), false), budget, Some(64));
    assert_eq!(refused.unwrap_err().error_type(), "context_length_exceeded");
    let cut = p
        .tokenize_within(&chat(msgs.clone(), true), budget, Some(64))
        .unwrap();
    assert!(cut.ids.len() <= budget.max_prompt_tokens(Some(64)));
    // The same as the conversation from its first kept user turn, sent whole; one more turn
    // would not fit.
    let text = cut.rendered.as_deref().unwrap();
    assert!(text.contains("You are brief."));
    let first = (1..msgs.len())
        .find(|&i| msgs[i].role == "user" && text.contains(&turn((i - 1) / 2)))
        .unwrap();
    let kept: Vec<ChatMessage> = msgs[..1].iter().chain(&msgs[first..]).cloned().collect();
    let whole = p
        .tokenize_within(&chat(kept, false), budget, Some(64))
        .unwrap();
    assert_eq!(whole.ids, cut.ids);
    let one_more: Vec<ChatMessage> = msgs[..1]
        .iter()
        .chain(&msgs[first - 2..])
        .cloned()
        .collect();
    assert!(p
        .tokenize_within(&chat(one_more, false), budget, Some(64))
        .is_err());
    println!(
        "truncation auto: kept {} of {} messages, {} tokens",
        msgs.len() - first + 1,
        msgs.len(),
        cut.ids.len()
    );
    // Within the budget: nothing dropped.
    let short = msgs[..1]
        .iter()
        .chain(&msgs[75..])
        .cloned()
        .collect::<Vec<_>>();
    assert_eq!(
        p.tokenize_within(&chat(short.clone(), true), budget, Some(64))
            .unwrap()
            .ids,
        p.tokenize_within(&chat(short, false), budget, Some(64))
            .unwrap()
            .ids
    );
    // A last user message over the budget alone: refused as before.
    let mut long = msgs.clone();
    long.push(ChatMessage::new("assistant", "ok".to_owned()));
    long.push(ChatMessage::new("user", "word ".repeat(4000)));
    let e = p
        .tokenize_within(&chat(long, true), budget, Some(64))
        .unwrap_err();
    assert_eq!(e.error_type(), "context_length_exceeded");
}
