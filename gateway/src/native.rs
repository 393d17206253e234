//! The contract check of upstreams kvgate did not build (`kind = "llama_cpp"`, `"openai"` or
//! `"vllm"`), reached directly or through `kvgate sidecar` (which passes these reads through).
//!
//! - `llama_cpp`: `GET /props` → `chat_template` (its SHA-256 must be the pinned
//!   `template_sha256`: the same hash a kvgate worker reports for the GGUF's template);
//!   `POST /tokenize` (`add_special: false, parse_special: true`) on each of [`PROBES`] → ids
//!   that must equal the pinned profile's tokenizer's (`encode(text, parse_special = true)`);
//!   `GET /v1/models` → the ids served, which must include the pinned `model_id` (start
//!   llama-server with `--alias <model_id>`).
//! - `openai`: `GET /v1/models` only (such servers expose neither template nor tokenizer):
//!   the pinned `model_id` must be served. That is all the gateway can check; the docs say so.
//! - `vllm`: as `openai`, and the sidecar's `GET /v1/kv/config`: the block size it maps vLLM's
//!   events into must be the pinned profile's `block_size` (else no key would ever match). A 404
//!   (a bare vLLM, or a sidecar without `--kv-events`) checks nothing: holdings are approximated.
//!
//! Every call carries the gateway's access token for the worker (a sidecar requiring tickets
//! guards `/tokenize`; a bare engine ignores it). Cost per check: 2 + |PROBES| small requests.

use std::time::Duration;

use routing_rules::schema::{ProfileSpec, UpstreamKind};
use serde::Deserialize;
use sha2::{Digest, Sha256};

use crate::profile::LoadedProfile;

/// Texts tokenized by both sides for the `llama_cpp` contract check: plain words, digits,
/// punctuation and spacing, non-Latin scripts and emoji, code, and chat-template markers of the
/// common families (parsed as special tokens where the vocabulary has them).
pub const PROBES: &[&str] = &[
    "Hello, world! How are you today?",
    "  leading spaces, double  spaces,\ttabs\nand\n\nnewlines  ",
    "2+2=4; 1234567890 3.14159 -0.5e10 $1,000.00 100%",
    "héllo wörld — naïve café, Ελληνικά, русский, 日本語のテキスト, 한국어, العربية 🚀🙂",
    "fn main() { println!(\"{}\", x.iter().map(|v| v * 2).sum::<i32>()); }",
    "<|im_start|>user\nWhat is KV caching?<|im_end|>\n<|im_start|>assistant\n",
    "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>",
    "<s>[INST] Hi [/INST]</s><start_of_turn>user\nHi<end_of_turn>",
];

/// What a native upstream reported.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NativeReport {
    pub kind: UpstreamKind,
    /// `GET /v1/models` ids.
    pub model_ids: Vec<String>,
    /// SHA-256 of `/props`'s `chat_template` (`llama_cpp`; `None` when it reports none).
    pub template_sha256: Option<String>,
    /// The engine's ids for each of [`PROBES`] (`llama_cpp`).
    pub probes: Vec<Vec<u32>>,
    /// The kvgate block size a `vllm` sidecar maps the engine's KV events into (`None`: no
    /// event mapping there).
    pub kv_block_size: Option<u32>,
}

#[derive(Deserialize)]
struct KvConfig {
    block_size: u32,
}

#[derive(Deserialize)]
struct Models {
    data: Vec<ModelCard>,
}

#[derive(Deserialize)]
struct ModelCard {
    id: String,
}

#[derive(Deserialize)]
struct Props {
    #[serde(default)]
    chat_template: Option<String>,
}

#[derive(Deserialize)]
struct Tokens {
    tokens: Vec<u32>,
}

async fn get_json<T: for<'de> Deserialize<'de>>(
    req: reqwest::RequestBuilder,
    what: &str,
) -> Result<T, String> {
    let r = req.send().await.map_err(|e| format!("unreachable: {e}"))?;
    if !r.status().is_success() {
        return Err(format!("{what}: {}", r.status()));
    }
    r.json::<T>()
        .await
        .map_err(|e| format!("bad {what} body: {e}"))
}

/// Reads what a native upstream at `base_url` reports (see the module doc).
pub async fn fetch(
    http: &reqwest::Client,
    base_url: &str,
    kind: UpstreamKind,
    bearer: &str,
    timeout: Duration,
) -> Result<NativeReport, String> {
    let models: Models = get_json(
        http.get(format!("{base_url}/v1/models"))
            .bearer_auth(bearer)
            .timeout(timeout),
        "GET /v1/models",
    )
    .await?;
    let mut report = NativeReport {
        kind,
        model_ids: models.data.into_iter().map(|m| m.id).collect(),
        template_sha256: None,
        probes: Vec::new(),
        kv_block_size: None,
    };
    if kind == UpstreamKind::Vllm {
        let r = http
            .get(format!("{base_url}/v1/kv/config"))
            .bearer_auth(bearer)
            .timeout(timeout)
            .send()
            .await
            .map_err(|e| format!("unreachable: {e}"))?;
        if r.status() != reqwest::StatusCode::NOT_FOUND {
            if !r.status().is_success() {
                return Err(format!("GET /v1/kv/config: {}", r.status()));
            }
            let c: KvConfig = r
                .json()
                .await
                .map_err(|e| format!("bad GET /v1/kv/config body: {e}"))?;
            report.kv_block_size = Some(c.block_size);
        }
    }
    if kind != UpstreamKind::LlamaCpp {
        return Ok(report);
    }
    let props: Props = get_json(
        http.get(format!("{base_url}/props"))
            .bearer_auth(bearer)
            .timeout(timeout),
        "GET /props",
    )
    .await?;
    report.template_sha256 = props
        .chat_template
        .filter(|t| !t.is_empty())
        .map(|t| hex::encode(Sha256::digest(t.as_bytes())));
    for text in PROBES {
        let body =
            serde_json::json!({"content": text, "add_special": false, "parse_special": true});
        let t: Tokens = get_json(
            http.post(format!("{base_url}/tokenize"))
                .bearer_auth(bearer)
                .json(&body)
                .timeout(timeout),
            "POST /tokenize",
        )
        .await?;
        report.probes.push(t.tokens);
    }
    Ok(report)
}

/// What differs between a native upstream's report and the pinned profile (`loaded`: the
/// gateway's own load of it, which tokenizes the probes).
pub fn differences(
    pinned: &ProfileSpec,
    loaded: Option<&LoadedProfile>,
    got: &NativeReport,
) -> Vec<String> {
    let mut out = Vec::new();
    if !got.model_ids.iter().any(|m| m == &pinned.model_id) {
        out.push(format!(
            "model_id (pinned {:?}, engine serves {:?}{})",
            pinned.model_id,
            got.model_ids,
            if got.kind == UpstreamKind::LlamaCpp {
                "; start llama-server with --alias <model_id>"
            } else {
                ""
            }
        ));
    }
    if let Some(b) = got.kv_block_size.filter(|&b| b != pinned.block_size) {
        out.push(format!(
            "block_size (pinned {}, the sidecar maps the engine's KV events into blocks of {b}; \
             start it with --block-size {})",
            pinned.block_size, pinned.block_size
        ));
    }
    if got.kind != UpstreamKind::LlamaCpp {
        return out;
    }
    match &got.template_sha256 {
        Some(t) if t == &pinned.template_sha256 => {}
        Some(t) => out.push(format!(
            "template_sha256 (pinned {}, engine's /props chat_template {t})",
            pinned.template_sha256
        )),
        None => out.push("template_sha256 (the engine's /props reports no chat_template)".into()),
    }
    let Some(loaded) = loaded else {
        return out;
    };
    let mut differing = Vec::new();
    for (i, text) in PROBES.iter().enumerate() {
        let ours = loaded.profile.encode(text, true);
        match (ours, got.probes.get(i)) {
            (Ok(a), Some(b)) if &a == b => {}
            (Ok(a), Some(b)) => differing.push(format!(
                "probe {i} {text:?}: pinned {} tokens, engine {} (first difference at {})",
                a.len(),
                b.len(),
                a.iter()
                    .zip(b)
                    .position(|(x, y)| x != y)
                    .unwrap_or(a.len().min(b.len()))
            )),
            (Err(e), _) => differing.push(format!("probe {i}: the pinned tokenizer failed: {e}")),
            (_, None) => differing.push(format!("probe {i}: the engine gave no answer")),
        }
    }
    if !differing.is_empty() {
        out.push(format!(
            "tokenizer (POST /tokenize differs on {} of {} probes: {})",
            differing.len(),
            PROBES.len(),
            differing.join("; ")
        ));
    }
    out
}
