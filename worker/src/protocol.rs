//! Wire types of the worker's HTTP API: the OpenAI-compatible request and response bodies
//! (`/v1/chat/completions`, `/v1/completions`, `/v1/models`), the OpenAI error object, and the
//! kvgate operations bodies (`/v1/profile`, `/v1/tokenize`, `/v1/keys`). The exact JSON of each
//! is pinned by the round-trip tests at the bottom and documented in `docs/worker-api.md`.
//!
//! Requests are parsed in two steps (see `validate`): the body is first read as a JSON
//! object whose keys are checked against [`CHAT_FIELDS`] / [`COMPLETION_FIELDS`] (an unknown key
//! is a 400 naming it), then deserialized into the typed structs below with
//! `serde_path_to_error`, so a wrong type is a 400 naming the exact field path.

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// Every top-level key a chat completion request may carry. Keys listed here but not supported
/// (e.g. `functions`) are accepted only with their neutral value; see `validate`.
pub const CHAT_FIELDS: &[&str] = &[
    "model",
    "messages",
    "stream",
    "stream_options",
    "max_tokens",
    "max_completion_tokens",
    "stop",
    "seed",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "n",
    "user",
    "cache_salt",
    "kvgate",
    "logprobs",
    "top_logprobs",
    "tools",
    "tool_choice",
    "documents",
    "chat_template_kwargs",
    "add_generation_prompt",
    "continue_final_message",
    "truncation",
    "functions",
    "function_call",
    "parallel_tool_calls",
    "response_format",
    "logit_bias",
    "store",
    "metadata",
    "service_tier",
    "modalities",
    "audio",
    "prediction",
    "reasoning_effort",
    "web_search_options",
    "prompt_cache_key",
    "prompt_cache_retention",
    "prompt_cache_options",
    "safety_identifier",
    "ignore_eos",
    "min_tokens",
    "stop_token_ids",
    "skip_special_tokens",
    "include_stop_str_in_output",
    "no_stop_trim",
    "return_hidden_states",
    "separate_reasoning",
    "stream_reasoning",
];

/// Every top-level key a (legacy) completion request may carry.
pub const COMPLETION_FIELDS: &[&str] = &[
    "model",
    "prompt",
    "stream",
    "stream_options",
    "max_tokens",
    "stop",
    "seed",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "n",
    "user",
    "cache_salt",
    "kvgate",
    "logprobs",
    "echo",
    "suffix",
    "best_of",
    "logit_bias",
    "ignore_eos",
    "min_tokens",
    "stop_token_ids",
    "skip_special_tokens",
    "include_stop_str_in_output",
    "no_stop_trim",
    "return_hidden_states",
];

/// `stream_options`.
#[derive(Clone, Debug, Default, Deserialize)]
pub struct StreamOptions {
    /// Send a last chunk with `usage` (and `choices: []`) before `[DONE]`.
    #[serde(default)]
    pub include_usage: Option<bool>,
}

/// `stop`: one string or up to four strings.
#[derive(Clone, Debug, Deserialize)]
#[serde(untagged, expecting = "a string or an array of strings")]
pub enum StopSpec {
    One(String),
    Many(Vec<String>),
}

impl StopSpec {
    /// The stop strings as a list.
    pub fn into_vec(self) -> Vec<String> {
        match self {
            StopSpec::One(s) => vec![s],
            StopSpec::Many(v) => v,
        }
    }
}

/// The kvgate extension object `"kvgate": {...}` of a request body.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KvgateOptions {
    /// `false` = privacy opt-out: nothing of this request enters the worker's prefix cache
    /// (its prompt may still *reuse* cached blocks). Default `true`.
    #[serde(default)]
    pub cache: Option<bool>,
}

/// Parameters common to chat and completion requests. Unsupported OpenAI parameters are kept
/// as raw JSON so the validator can accept their neutral values and reject anything else.
#[derive(Clone, Debug, Default, Deserialize)]
pub struct CommonParams {
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    pub max_tokens: Option<u64>,
    pub stop: Option<StopSpec>,
    pub seed: Option<i64>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<i64>,
    pub min_p: Option<f32>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub repetition_penalty: Option<f32>,
    pub n: Option<u64>,
    pub user: Option<String>,
    /// Accepted and NOT applied by the worker: the namespace comes from the route ticket
    /// (where the gateway folded the salt in) or is the worker's default.
    pub cache_salt: Option<String>,
    pub kvgate: Option<KvgateOptions>,
    pub logit_bias: Option<Value>,
    /// vLLM/SGLang: do not stop at the profile's eos ids.
    pub ignore_eos: Option<bool>,
    /// vLLM/SGLang: no eos/stop id and no stop string before this many tokens.
    pub min_tokens: Option<u64>,
    /// vLLM: more token ids that end the sequence (not emitted).
    pub stop_token_ids: Option<Vec<u32>>,
    /// vLLM/SGLang: special tokens produce no text (default true).
    pub skip_special_tokens: Option<bool>,
    /// vLLM: a matched stop string stays in the output.
    pub include_stop_str_in_output: Option<bool>,
    /// SGLang: the same as `include_stop_str_in_output`.
    pub no_stop_trim: Option<bool>,
    /// SGLang: only `false` is served.
    pub return_hidden_states: Option<bool>,
}

/// `POST /v1/chat/completions` body.
#[derive(Clone, Debug, Deserialize)]
pub struct ChatCompletionRequest {
    pub model: String,
    pub messages: Vec<prompt_profile::ChatMessage>,
    pub max_completion_tokens: Option<u64>,
    #[serde(flatten)]
    pub common: CommonParams,
    pub logprobs: Option<Value>,
    pub top_logprobs: Option<Value>,
    pub tools: Option<Vec<Value>>,
    pub tool_choice: Option<Value>,
    pub documents: Option<Vec<Value>>,
    pub chat_template_kwargs: Option<serde_json::Map<String, Value>>,
    pub add_generation_prompt: Option<bool>,
    pub continue_final_message: Option<bool>,
    /// `"auto"` / `"disabled"` (the Responses API's `truncation`, read by the prompt contract).
    pub truncation: Option<String>,
    pub functions: Option<Value>,
    pub function_call: Option<Value>,
    pub parallel_tool_calls: Option<Value>,
    /// SGLang: split reasoning from content when a reasoning parser runs (default true).
    pub separate_reasoning: Option<bool>,
    /// SGLang: stream reasoning as it forms (default true); false = one delta when it ends.
    pub stream_reasoning: Option<bool>,
    pub response_format: Option<Value>,
    pub store: Option<Value>,
    pub metadata: Option<Value>,
    pub service_tier: Option<Value>,
    pub modalities: Option<Value>,
    pub audio: Option<Value>,
    pub prediction: Option<Value>,
    pub reasoning_effort: Option<Value>,
    pub web_search_options: Option<Value>,
    /// OpenAI's hint for routing requests that share a prefix to the same cache: accepted, and
    /// not needed — KV-exact routing matches the prompt's own block keys (it is not a salt: it
    /// isolates nothing).
    pub prompt_cache_key: Option<String>,
    /// OpenAI: how long cached prefixes are kept (`in_memory`, `24h`): accepted; the prefix
    /// cache keeps blocks while the KV cache has room.
    pub prompt_cache_retention: Option<String>,
    /// OpenAI: `{"mode": "implicit" | "explicit", "ttl"}`; `implicit` (every prefix may be
    /// cached, as kvgate always does) is accepted, `explicit` breakpoints are not supported.
    pub prompt_cache_options: Option<Value>,
    /// OpenAI's end-user id for abuse detection (the successor of `user`): accepted, not used.
    pub safety_identifier: Option<String>,
}

/// `POST /v1/completions` body.
#[derive(Clone, Debug, Deserialize)]
pub struct CompletionRequest {
    pub model: String,
    /// Parsed by the prompt contract's own type (shared with the gateway).
    pub prompt: prompt_profile::CompletionPrompt,
    #[serde(flatten)]
    pub common: CommonParams,
    pub logprobs: Option<Value>,
    pub echo: Option<Value>,
    pub suffix: Option<Value>,
    pub best_of: Option<Value>,
}

/// `POST /v1/tokenize` body: chat `messages` (rendered with the chat template) or a `prompt`.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TokenizeRequest {
    #[serde(default)]
    pub model: Option<String>,
    #[serde(default)]
    pub messages: Option<Vec<prompt_profile::ChatMessage>>,
    #[serde(default)]
    pub prompt: Option<String>,
    /// Only with `messages`; default `true`.
    #[serde(default)]
    pub add_generation_prompt: Option<bool>,
    /// Only with `messages`: rendered with the template as a chat completion would be.
    #[serde(default)]
    pub continue_final_message: Option<bool>,
    /// Only with `messages`.
    #[serde(default)]
    pub tools: Option<Vec<Value>>,
    /// Only with `messages`.
    #[serde(default)]
    pub tool_choice: Option<Value>,
    /// Only with `messages`.
    #[serde(default)]
    pub documents: Option<Vec<Value>>,
    /// Only with `messages`.
    #[serde(default)]
    pub chat_template_kwargs: Option<serde_json::Map<String, Value>>,
}

/// `POST /v1/tokenize` response.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct TokenizeResponse {
    /// The text that was encoded (the rendered template for `messages`).
    pub prompt: String,
    pub tokens: Vec<u32>,
    pub count: usize,
    pub context_limit: usize,
    /// Keys of the full blocks in the worker's default namespace (16-hex-digit strings).
    pub block_keys: Vec<prefix_index::BlockKey>,
}

/// `usage.prompt_tokens_details`.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct PromptTokensDetails {
    /// Prompt tokens the engine reused from its prefix cache.
    pub cached_tokens: usize,
}

/// `usage`.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct UsageBody {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub total_tokens: usize,
    pub prompt_tokens_details: PromptTokensDetails,
}

impl UsageBody {
    /// From the engine's counts.
    pub fn new(prompt_tokens: usize, cached_tokens: usize, completion_tokens: usize) -> Self {
        UsageBody {
            prompt_tokens,
            completion_tokens,
            total_tokens: prompt_tokens + completion_tokens,
            prompt_tokens_details: PromptTokensDetails { cached_tokens },
        }
    }
}

/// An assistant message in a non-streaming chat response.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct AssistantMessage {
    pub role: String,
    /// The answer text; `null` when the answer is only tool calls.
    pub content: Option<String>,
    /// The model's reasoning, when a reasoning parser separated it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
    /// The tool calls the answer made (parsed from the model's text).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCallBody>,
}

/// One tool call of an answer (OpenAI shape).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct ToolCallBody {
    pub id: String,
    /// Always `function`.
    #[serde(rename = "type")]
    pub kind: String,
    pub function: FunctionCallBody,
}

/// The function of a tool call: its name and its arguments as JSON text.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct FunctionCallBody {
    pub name: String,
    pub arguments: String,
}

/// A streamed piece of a tool call: the first delta of a call carries `id`, `type` and the
/// function's `name` (arguments `""`), the next its `arguments`.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct ToolCallDelta {
    pub index: usize,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    #[serde(default, rename = "type", skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
    pub function: FunctionDelta,
}

/// The function part of a [`ToolCallDelta`].
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct FunctionDelta {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub arguments: Option<String>,
}

/// One choice of a non-streaming chat response.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct ChatChoice {
    pub index: usize,
    pub message: AssistantMessage,
    pub logprobs: Option<Value>,
    pub finish_reason: String,
    /// The content was written after the tool calls (a forced list cut by `max_tokens`: its
    /// cut call's text), not before them: the Responses API's items keep that order. Not part
    /// of the chat answer.
    #[serde(skip)]
    pub content_after_calls: bool,
}

/// Non-streaming `chat.completion` response.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct ChatCompletionResponse {
    pub id: String,
    pub object: String,
    pub created: u64,
    pub model: String,
    pub system_fingerprint: String,
    pub choices: Vec<ChatChoice>,
    pub usage: UsageBody,
}

/// The delta of one streamed chat chunk.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct ChatDelta {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCallDelta>>,
}

/// One choice of a streamed chat chunk.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct ChatChunkChoice {
    pub index: usize,
    pub delta: ChatDelta,
    pub logprobs: Option<Value>,
    pub finish_reason: Option<String>,
}

/// A streamed `chat.completion.chunk`.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct ChatCompletionChunk {
    pub id: String,
    pub object: String,
    pub created: u64,
    pub model: String,
    pub system_fingerprint: String,
    pub choices: Vec<ChatChunkChoice>,
    /// Present (as `null`) on every chunk when `include_usage` is set, filled on the last one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Option<UsageBody>>,
}

/// One choice of a completion response or chunk.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct CompletionChoice {
    pub index: usize,
    pub text: String,
    pub logprobs: Option<Value>,
    pub finish_reason: Option<String>,
}

/// `text_completion` response, and (with `usage` possibly absent) a streamed chunk.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct CompletionResponse {
    pub id: String,
    pub object: String,
    pub created: u64,
    pub model: String,
    pub system_fingerprint: String,
    pub choices: Vec<CompletionChoice>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Option<UsageBody>>,
}

/// One entry of `GET /v1/models`.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct ModelCard {
    pub id: String,
    pub object: String,
    pub created: u64,
    pub owned_by: String,
    /// Context limit of the profile (kvgate extension).
    pub context_limit: usize,
}

/// `GET /v1/models`.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct ModelList {
    pub object: String,
    pub data: Vec<ModelCard>,
}

/// `GET /v1/profile`: the worker's prompt-profile identity and KV-cache contract, compared by
/// the gateway against a `kv_exact` service's pinned profile.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct ProfileBody {
    pub worker_id: String,
    pub model_id: String,
    pub revision: String,
    /// The model architecture, GGUF `general.architecture` (`llama`, `qwen2`, `qwen3`,
    /// `phi3`, `gemma3`, …) as the prompt profile read it; `null` for a profile from a HF
    /// tokenizer.json. Compared by the gateway's contract check.
    pub architecture: Option<String>,
    pub template_sha256: String,
    pub tokenizer_sha256: String,
    /// Digest of the whole profile identity (the prompt-profile crate's stable digest).
    pub profile_digest: String,
    pub eos_token_ids: Vec<u32>,
    /// The ids that end generation: the eos ids and the vocabulary's other end tokens
    /// (`prompt_profile::END_OF_GENERATION_TEXTS`, llama.cpp's list).
    pub end_of_generation_ids: Vec<u32>,
    pub context_limit: usize,
    pub native_reserve: usize,
    pub block_size: usize,
    pub hash_algorithm: prefix_index::HashAlgorithm,
    /// The seed the worker uses for requests without a route ticket (no salt, no adapter).
    pub default_namespace_seed: String,
    /// `model` (candle) or `sim` (simulated executor).
    pub engine: String,
    /// The model engine's arithmetic: `exact` (F32 activations, the CPU default), `llama_cpp`
    /// (`--numerics llama-cpp`), `as_stored` (the file's quantization through candle, the CUDA
    /// default); `null` for the simulated engine.
    pub numerics: Option<String>,
    /// Whether requests without a route ticket are refused.
    pub require_ticket: bool,
}

/// `GET /v1/keys`: the worker's receipt-signing key.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct KeysBody {
    pub worker_id: String,
    pub key_id: String,
    /// SPKI PEM, as `kvgate keygen` writes `<name>.pub`.
    pub public_key_pem: String,
    /// The raw 32-byte Ed25519 public key, lowercase hex.
    pub public_key_hex: String,
}

/// `GET /ready`.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct ReadyBody {
    pub ready: bool,
    /// Why not ready (smoke inference pending or failed), absent when ready.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

/// The body of every error answer: `{"error": {...}}` as OpenAI sends it, plus kvgate fields
/// (numbers of a token-budget failure) flattened into the object when present.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct ErrorBody {
    pub error: ErrorObject,
}

/// OpenAI's error object.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct ErrorObject {
    pub message: String,
    #[serde(rename = "type")]
    pub kind: String,
    pub param: Option<String>,
    pub code: String,
    /// Extra structured details (e.g. the three numbers of `context_length_exceeded`).
    #[serde(flatten, skip_serializing_if = "serde_json::Map::is_empty", default)]
    pub details: serde_json::Map<String, Value>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_body_json_is_pinned() {
        let mut details = serde_json::Map::new();
        details.insert("context_limit".into(), 8192.into());
        let e = ErrorBody {
            error: ErrorObject {
                message: "m".into(),
                kind: "invalid_request_error".into(),
                param: Some("messages".into()),
                code: "context_length_exceeded".into(),
                details,
            },
        };
        let s = serde_json::to_string(&e).unwrap();
        assert_eq!(
            s,
            r#"{"error":{"message":"m","type":"invalid_request_error","param":"messages","code":"context_length_exceeded","context_limit":8192}}"#
        );
        let back: ErrorBody = serde_json::from_str(&s).unwrap();
        assert_eq!(back, e);
        let plain = ErrorBody {
            error: ErrorObject {
                message: "m".into(),
                kind: "t".into(),
                param: None,
                code: "c".into(),
                details: Default::default(),
            },
        };
        assert_eq!(
            serde_json::to_string(&plain).unwrap(),
            r#"{"error":{"message":"m","type":"t","param":null,"code":"c"}}"#
        );
    }

    #[test]
    fn chat_chunk_json_is_pinned() {
        let chunk = ChatCompletionChunk {
            id: "chatcmpl-r1".into(),
            object: "chat.completion.chunk".into(),
            created: 7,
            model: "m".into(),
            system_fingerprint: "fp".into(),
            choices: vec![ChatChunkChoice {
                index: 0,
                delta: ChatDelta {
                    content: Some("hi".into()),
                    ..ChatDelta::default()
                },
                logprobs: None,
                finish_reason: None,
            }],
            usage: Some(None),
        };
        assert_eq!(
            serde_json::to_string(&chunk).unwrap(),
            r#"{"id":"chatcmpl-r1","object":"chat.completion.chunk","created":7,"model":"m","system_fingerprint":"fp","choices":[{"index":0,"delta":{"content":"hi"},"logprobs":null,"finish_reason":null}],"usage":null}"#
        );
        let last = ChatCompletionChunk {
            choices: vec![],
            usage: Some(Some(UsageBody::new(10, 4, 3))),
            ..chunk
        };
        assert_eq!(
            serde_json::to_string(&last).unwrap(),
            r#"{"id":"chatcmpl-r1","object":"chat.completion.chunk","created":7,"model":"m","system_fingerprint":"fp","choices":[],"usage":{"prompt_tokens":10,"completion_tokens":3,"total_tokens":13,"prompt_tokens_details":{"cached_tokens":4}}}"#
        );
    }

    #[test]
    fn stop_accepts_openai_shapes() {
        let s: StopSpec = serde_json::from_str(r#""x""#).unwrap();
        assert_eq!(s.into_vec(), vec!["x".to_string()]);
        let s: StopSpec = serde_json::from_str(r#"["x","y"]"#).unwrap();
        assert_eq!(s.into_vec(), vec!["x".to_string(), "y".to_string()]);
    }

    #[test]
    fn field_lists_have_no_duplicates() {
        for list in [CHAT_FIELDS, COMPLETION_FIELDS] {
            let mut v = list.to_vec();
            v.sort_unstable();
            let n = v.len();
            v.dedup();
            assert_eq!(v.len(), n);
        }
    }
}
