//! Request validation: a raw body → a checked [`GenerationPlan`] (prompt source, sampling,
//! output budget, stop strings, cache opt-out), or an [`ApiError`] naming the field at fault.
//!
//! Order of checks, each answering 400 with a stable code:
//! 1. the body is a JSON object (`invalid_json`, with line and column);
//! 2. every top-level key is known (`unknown_parameter`, param = the key);
//! 3. types (`invalid_type`, param = the JSON path, e.g. `messages[0].content`) and required
//!    fields (`missing_parameter`);
//! 4. unsupported parameters with a non-neutral value (`unsupported_parameter`): `best_of ≠ n`,
//!    `tool_choice: "required"`, `response_format` `json_schema`, `return_hidden_states`, ...
//! 5. ranges (`invalid_value`): temperature, top_p, penalties, max_tokens ≥ 1, ≤ 4 stop strings.
//!
//! The token budget (needs the rendered prompt) is checked later by [`budget`].

use std::collections::HashSet;
use std::sync::Arc;

use serde::Deserialize;
use serde_json::Value;

use crate::api_error::ApiError;
use crate::output_parser::{ForcedCall, MAX_PARALLEL_CALLS};
use crate::protocol::{
    ChatCompletionRequest, CommonParams, CompletionRequest, CHAT_FIELDS, COMPLETION_FIELDS,
};
use engine::json_schema::CompiledSchema;
use engine::sampler::SamplingParams;
use engine::schema_cache::{SchemaCache, SchemaKey};
use prompt_profile::{BodyError, ChatTemplateFields, ProfileError, PromptSource, ToolChoice};

/// The most stop strings a request may carry (OpenAI's limit).
pub const MAX_STOP_STRINGS: usize = 4;

/// The most choices (`n`) one request may ask for: each is a sequence of its own in the engine
/// (sharing the prompt's prefill), so this bounds one request's work at `n × max_tokens`. The
/// gateway counts output by the same bound (`prompt_profile::choices`).
pub use prompt_profile::MAX_CHOICES;

/// A validated generation request, before tokenization.
#[derive(Clone, Debug)]
pub struct GenerationPlan {
    pub model: String,
    pub prompt: PromptSource,
    pub stream: bool,
    pub include_usage: bool,
    /// Choices to generate (`n`), 1..=[`MAX_CHOICES`].
    pub n: usize,
    /// Requested output tokens (`max_completion_tokens` or `max_tokens`); `None` = default.
    pub max_tokens: Option<usize>,
    pub stop: Vec<String>,
    pub sampling: SamplingParams,
    /// `false` when the body asked `"kvgate": {"cache": false}`.
    pub cache_insert: bool,
    /// The vLLM/SGLang output extensions.
    pub output: OutputSpec,
    /// How the answer text is parsed (chat only).
    pub answer: AnswerSpec,
    /// What the answer must be (`response_format`, chat only; `engine::constraint`).
    pub format: AnswerFormat,
    /// A completion's `echo`: the answer's text starts with the prompt (and its log
    /// probabilities with the prompt's, `OutputSpec::prompt_logprobs`).
    pub echo: bool,
}

/// `response_format`.
#[derive(Clone, Debug, Default)]
pub enum AnswerFormat {
    /// Any text (`{"type": "text"}` or none).
    #[default]
    Text,
    /// One JSON object (`{"type": "json_object"}`).
    JsonObject,
    /// A JSON object of this schema (`{"type": "json_schema", "json_schema": {"schema": …}}`).
    JsonSchema(Arc<CompiledSchema>),
    /// A forced tool call (`tool_choice` `required` or a function): its JSON, of this schema
    /// (the function's `parameters`, or `{"name", "arguments"}` of one of the tools).
    ToolCall(Arc<CompiledSchema>),
}

/// What a chat request asks of the answer parser (`output_parser`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AnswerSpec {
    /// `tools` given (non-empty) and `tool_choice` not `none`: tool calls are parsed.
    pub tool_calls: bool,
    /// `tool_choice` `required` or a function: the answer is that call, as JSON.
    pub forced: Option<crate::output_parser::ForcedCall>,
    /// `parallel_tool_calls: false`: at most one call is given out (a model that writes more
    /// in its own format has the first one kept, as vLLM does).
    pub single_call: bool,
    /// SGLang `separate_reasoning` (default true): reasoning goes to `reasoning_content`.
    pub separate_reasoning: bool,
    /// SGLang `stream_reasoning` (default true): reasoning streams as it forms; false = sent in
    /// one delta when it ends.
    pub stream_reasoning: bool,
}

/// The most `stop_token_ids` a request may carry.
pub const MAX_STOP_TOKEN_IDS: usize = 64;

/// The vLLM/SGLang output extensions of a request, checked (vocabulary ranges are checked
/// against the profile by [`OutputSpec::resolve`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct OutputSpec {
    /// `ignore_eos`: the profile's eos ids do not end the sequence.
    pub ignore_eos: bool,
    /// `stop_token_ids`: more ids that end it.
    pub stop_token_ids: Vec<u32>,
    /// `min_tokens` (0 = off).
    pub min_tokens: usize,
    /// `skip_special_tokens` as given (default: true, or false when the answer's tool-call
    /// format writes special tokens; see [`OutputSpec::resolve`]).
    pub skip_special_tokens: Option<bool>,
    /// `include_stop_str_in_output` or `no_stop_trim`.
    pub include_stop_str: bool,
    /// Chat `logprobs: true` with `top_logprobs` alternatives; completion `logprobs: N`.
    pub logprobs: Option<usize>,
    /// A completion's `logprobs: N` with `echo: true`: the prompt's too
    /// ([`prompt_profile::scores_prompt`]).
    pub prompt_logprobs: Option<usize>,
}

impl OutputSpec {
    /// The engine's stop ids and output parameters for a request with `max_tokens` output
    /// tokens, the profile's `eos` ids and a vocabulary of `vocab_size` ids. `min_tokens` above
    /// a `max_tokens` the token budget chose (the request named none) is clamped to it.
    /// `default_skip_special`: what `skip_special_tokens` is when the request does not say.
    pub fn resolve(
        &self,
        eos: &[u32],
        vocab_size: usize,
        max_tokens: usize,
        default_skip_special: bool,
    ) -> Result<(Vec<u32>, engine::OutputParams), ApiError> {
        if let Some(bad) = self
            .stop_token_ids
            .iter()
            .find(|&&id| id as usize >= vocab_size)
        {
            return Err(invalid_value(
                "stop_token_ids",
                format!("token id {bad} is outside the vocabulary ({vocab_size} ids)"),
            ));
        }
        let mut stop: Vec<u32> = if self.ignore_eos {
            Vec::new()
        } else {
            eos.to_vec()
        };
        for id in &self.stop_token_ids {
            if !stop.contains(id) {
                stop.push(*id);
            }
        }
        Ok((
            stop,
            engine::OutputParams {
                min_tokens: self.min_tokens.min(max_tokens),
                skip_special_tokens: self.skip_special_tokens.unwrap_or(default_skip_special),
                include_stop_str: self.include_stop_str,
                logprobs: self.logprobs,
                prompt_logprobs: self.prompt_logprobs,
            },
        ))
    }
}

fn invalid_json(e: &serde_json::Error) -> ApiError {
    BodyError::not_json(e).into()
}

/// Parses the body as a JSON object and checks its keys against `known`.
fn parse_object(body: &[u8], known: &[&str]) -> Result<Value, ApiError> {
    let value: Value = serde_json::from_slice(body).map_err(|e| invalid_json(&e))?;
    let Some(obj) = value.as_object() else {
        return Err(BodyError::not_an_object().into());
    };
    let known: HashSet<&str> = known.iter().copied().collect();
    // Report the first unknown key in document order (serde_json keeps keys sorted; fine: stable).
    if let Some(k) = obj.keys().find(|k| !known.contains(k.as_str())) {
        return Err(ApiError::bad_request(
            "unknown_parameter",
            Some(k),
            format!("unknown parameter `{k}`"),
        ));
    }
    Ok(value)
}

/// Deserializes with the path of the first failing field (from an owned `Value`, whose
/// strings move into `T`, or from `&Value`, which copies only what `T` keeps).
fn typed<'de, T: Deserialize<'de>, D>(value: D) -> Result<T, ApiError>
where
    D: serde::Deserializer<'de, Error = serde_json::Error>,
{
    serde_path_to_error::deserialize::<_, T>(value).map_err(|e| {
        let path = e.path().to_string();
        BodyError::at(&path, e.into_inner()).into()
    })
}

fn unsupported(param: &str, why: &str) -> ApiError {
    ApiError::bad_request(
        "unsupported_parameter",
        Some(param),
        format!("parameter `{param}` is not supported by this worker: {why}"),
    )
}

fn invalid_value(param: &str, why: impl Into<String>) -> ApiError {
    ApiError::bad_request("invalid_value", Some(param), why.into())
}

/// Null, false, 0, "", [] and {} are the neutral values of an unsupported parameter.
fn is_neutral(v: &Option<Value>) -> bool {
    match v {
        None | Some(Value::Null) | Some(Value::Bool(false)) => true,
        Some(Value::Number(n)) => n.as_f64() == Some(0.0),
        Some(Value::String(s)) => s.is_empty(),
        Some(Value::Array(a)) => a.is_empty(),
        Some(Value::Object(o)) => o.is_empty(),
        Some(Value::Bool(true)) => false,
    }
}

fn reject_unless_neutral(param: &str, v: &Option<Value>, why: &str) -> Result<(), ApiError> {
    if is_neutral(v) {
        Ok(())
    } else {
        Err(unsupported(param, why))
    }
}

fn check_range(param: &str, v: Option<f32>, lo: f32, hi: f32) -> Result<(), ApiError> {
    match v {
        Some(x) if !(x.is_finite() && x >= lo && x <= hi) => Err(invalid_value(
            param,
            format!("`{param}` must be within [{lo}, {hi}], got {x}"),
        )),
        _ => Ok(()),
    }
}

/// The common parameters, checked.
struct Checked {
    stream: bool,
    include_usage: bool,
    n: usize,
    max_tokens: Option<usize>,
    stop: Vec<String>,
    sampling: SamplingParams,
    cache_insert: bool,
    output: OutputSpec,
}

/// `logit_bias`: an object from token ids (decimal strings) to numbers in [-100, 100], at most
/// [`engine::sampler::MAX_LOGIT_BIAS`] entries (whether each id is in the vocabulary is checked
/// once the model is known: `GenerationPlan::check_logit_bias`).
fn logit_bias(v: &Option<Value>) -> Result<Vec<(u32, f32)>, ApiError> {
    let map = match v {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::Object(m)) => m,
        Some(_) => {
            return Err(ApiError::bad_request(
                "invalid_type",
                Some("logit_bias"),
                "`logit_bias` must be an object from token ids to biases",
            ))
        }
    };
    if map.len() > engine::sampler::MAX_LOGIT_BIAS {
        return Err(invalid_value(
            "logit_bias",
            format!(
                "at most {} tokens may be biased, got {}",
                engine::sampler::MAX_LOGIT_BIAS,
                map.len()
            ),
        ));
    }
    map.iter()
        .map(|(k, v)| {
            let id = k
                .parse::<u32>()
                .map_err(|_| invalid_value("logit_bias", format!("{k:?} is not a token id")))?;
            match v.as_f64() {
                Some(b) if (-100.0..=100.0).contains(&b) => Ok((id, b as f32)),
                _ => Err(invalid_value(
                    "logit_bias",
                    format!("the bias of token {id} must be a number in [-100, 100], got {v}"),
                )),
            }
        })
        .collect()
}

impl GenerationPlan {
    /// Every `logit_bias` id is a token of a vocabulary of `vocab_size` ids.
    pub fn check_logit_bias(&self, vocab_size: usize) -> Result<(), ApiError> {
        match self
            .sampling
            .logit_bias
            .iter()
            .find(|(t, _)| *t as usize >= vocab_size)
        {
            Some((t, _)) => Err(invalid_value(
                "logit_bias",
                format!("token {t} is not in the model's vocabulary ({vocab_size} ids)"),
            )),
            None => Ok(()),
        }
    }
}

/// Checks and converts the parameters common to both endpoints.
/// `zero_output`: `max_tokens = 0` is accepted (a completion with `echo`: the prompt alone).
fn common(
    c: CommonParams,
    max_completion_tokens: Option<u64>,
    zero_output: bool,
) -> Result<Checked, ApiError> {
    let n = match c.n {
        None => 1,
        Some(n) if (1..=MAX_CHOICES as u64).contains(&n) => n as usize,
        Some(n) => {
            return Err(invalid_value(
                "n",
                format!("`n` must be between 1 and {MAX_CHOICES} (got {n})"),
            ))
        }
    };
    let logit_bias = logit_bias(&c.logit_bias)?;
    let stream = c.stream.unwrap_or(false);
    let include_usage = match &c.stream_options {
        Some(o) if !stream => {
            let _ = o;
            return Err(invalid_value(
                "stream_options",
                "`stream_options` is only allowed when `stream` is true",
            ));
        }
        Some(o) => o.include_usage.unwrap_or(false),
        None => false,
    };
    let max_tokens = match (c.max_tokens, max_completion_tokens) {
        (Some(a), Some(b)) if a != b => {
            return Err(invalid_value(
                "max_completion_tokens",
                format!("`max_tokens` ({a}) and `max_completion_tokens` ({b}) disagree"),
            ))
        }
        (a, b) => b.or(a),
    };
    let max_tokens = match max_tokens {
        Some(0) if !zero_output => {
            let p = if max_completion_tokens.is_some() {
                "max_completion_tokens"
            } else {
                "max_tokens"
            };
            let only_echo = match max_completion_tokens {
                None if c.max_tokens.is_some() => " (0 only in a completion with `echo: true`)",
                _ => "",
            };
            return Err(invalid_value(
                p,
                format!("`{p}` must be at least 1{only_echo}"),
            ));
        }
        Some(n) => Some(usize::try_from(n).unwrap_or(usize::MAX)),
        None => None,
    };
    let stop = c.stop.map(|s| s.into_vec()).unwrap_or_default();
    if stop.len() > MAX_STOP_STRINGS {
        return Err(invalid_value(
            "stop",
            format!(
                "at most {MAX_STOP_STRINGS} stop strings, got {}",
                stop.len()
            ),
        ));
    }
    if stop.iter().any(String::is_empty) {
        return Err(invalid_value("stop", "stop strings must not be empty"));
    }
    check_range("temperature", c.temperature, 0.0, 2.0)?;
    if let Some(p) = c.top_p {
        if !(p.is_finite() && p > 0.0 && p <= 1.0) {
            return Err(invalid_value(
                "top_p",
                format!("`top_p` must be within (0, 1], got {p}"),
            ));
        }
    }
    check_range("min_p", c.min_p, 0.0, 1.0)?;
    check_range("presence_penalty", c.presence_penalty, -2.0, 2.0)?;
    check_range("frequency_penalty", c.frequency_penalty, -2.0, 2.0)?;
    if let Some(r) = c.repetition_penalty {
        if !(r.is_finite() && r > 0.0 && r <= 10.0) {
            return Err(invalid_value(
                "repetition_penalty",
                format!("`repetition_penalty` must be within (0, 10], got {r}"),
            ));
        }
    }
    let top_k = match c.top_k {
        None | Some(-1) | Some(0) => 0,
        Some(k) if k > 0 => usize::try_from(k).unwrap_or(usize::MAX),
        Some(k) => {
            return Err(invalid_value(
                "top_k",
                format!("`top_k` must be -1, 0 (off) or positive, got {k}"),
            ))
        }
    };
    let sampling = SamplingParams {
        // OpenAI's default temperature is 1.0.
        temperature: c.temperature.unwrap_or(1.0),
        top_p: c.top_p.unwrap_or(1.0),
        top_k,
        min_p: c.min_p.unwrap_or(0.0),
        repetition_penalty: c.repetition_penalty.unwrap_or(1.0),
        presence_penalty: c.presence_penalty.unwrap_or(0.0),
        frequency_penalty: c.frequency_penalty.unwrap_or(0.0),
        // i64 → u64 bit pattern: negative seeds are valid and distinct.
        seed: c.seed.map(|s| s as u64),
        logit_bias,
    };
    let cache_insert = c.kvgate.and_then(|k| k.cache).unwrap_or(true);
    if c.return_hidden_states == Some(true) {
        return Err(unsupported(
            "return_hidden_states",
            "hidden states are not returned",
        ));
    }
    let stop_token_ids = c.stop_token_ids.unwrap_or_default();
    if stop_token_ids.len() > MAX_STOP_TOKEN_IDS {
        return Err(invalid_value(
            "stop_token_ids",
            format!(
                "at most {MAX_STOP_TOKEN_IDS} stop token ids, got {}",
                stop_token_ids.len()
            ),
        ));
    }
    let min_tokens = usize::try_from(c.min_tokens.unwrap_or(0)).unwrap_or(usize::MAX);
    if let Some(max) = max_tokens {
        if min_tokens > max {
            return Err(invalid_value(
                "min_tokens",
                format!("`min_tokens` ({min_tokens}) exceeds the maximum output ({max})"),
            ));
        }
    }
    let include_stop_str = match (c.include_stop_str_in_output, c.no_stop_trim) {
        (Some(a), Some(b)) if a != b => {
            return Err(invalid_value(
                "no_stop_trim",
                "`include_stop_str_in_output` and `no_stop_trim` disagree",
            ))
        }
        (a, b) => a.or(b).unwrap_or(false),
    };
    let output = OutputSpec {
        ignore_eos: c.ignore_eos.unwrap_or(false),
        stop_token_ids,
        min_tokens,
        skip_special_tokens: c.skip_special_tokens,
        include_stop_str,
        logprobs: None,
        prompt_logprobs: None,
    };
    Ok(Checked {
        stream,
        include_usage,
        n,
        max_tokens,
        stop,
        sampling,
        cache_insert,
        output,
    })
}

/// Validates a `/v1/chat/completions` body; a `json_schema` or a forced tool call's schema is
/// compiled once and kept in `schemas` (`engine::schema_cache`).
pub fn chat(body: &[u8], schemas: &SchemaCache) -> Result<GenerationPlan, ApiError> {
    let value = parse_object(body, CHAT_FIELDS)?;
    // The common parameters first, on their own: serde loses the field path inside
    // `#[serde(flatten)]`, so this pass names a mistyped common field exactly.
    let _: CommonParams = typed(&value)?;
    let r: ChatCompletionRequest = typed(value)?;
    let logprobs = chat_logprobs(&r.logprobs, &r.top_logprobs)?;
    reject_unless_neutral(
        "functions",
        &r.functions,
        "the deprecated `functions` API is not supported; send `tools`",
    )?;
    match &r.function_call {
        None | Some(Value::Null) => {}
        Some(Value::String(s)) if s == "none" => {}
        Some(_) => {
            return Err(unsupported(
                "function_call",
                "function calling is not supported",
            ))
        }
    }
    // OpenAI's default: a `required` answer may make several calls.
    let parallel_calls = !matches!(r.parallel_tool_calls, Some(Value::Bool(false)));
    match &r.parallel_tool_calls {
        None | Some(Value::Null) | Some(Value::Bool(_)) => {}
        Some(_) => {
            return Err(ApiError::bad_request(
                "invalid_type",
                Some("parallel_tool_calls"),
                "`parallel_tool_calls` must be a boolean",
            ))
        }
    }
    let format = match &r.response_format {
        None | Some(Value::Null) => AnswerFormat::Text,
        Some(Value::Object(o)) => match o.get("type").and_then(Value::as_str) {
            Some("text") => AnswerFormat::Text,
            Some("json_object") => AnswerFormat::JsonObject,
            Some("json_schema") => {
                let schema = o
                    .get("json_schema")
                    .and_then(|j| j.get("schema"))
                    .ok_or_else(|| {
                        invalid_value(
                            "response_format",
                            "`json_schema` needs `{\"json_schema\": {\"name\": …, \"schema\": {…}}}`",
                        )
                    })?;
                let compiled = schemas
                    .get_or_compile(SchemaKey::schema(schema), || {
                        CompiledSchema::compile(schema)
                    })
                    .map_err(|e| unsupported("response_format", &format!("json_schema: {e}")))?;
                AnswerFormat::JsonSchema(compiled)
            }
            _ => {
                return Err(invalid_value(
                    "response_format",
                    "`response_format.type` must be `text`, `json_object` or `json_schema`",
                ))
            }
        },
        Some(_) => {
            return Err(ApiError::bad_request(
                "invalid_type",
                Some("response_format"),
                "`response_format` must be an object",
            ))
        }
    };
    reject_unless_neutral("store", &r.store, "stored completions are not supported")?;
    match &r.metadata {
        None | Some(Value::Null) | Some(Value::Object(_)) => {}
        Some(_) => {
            return Err(ApiError::bad_request(
                "invalid_type",
                Some("metadata"),
                "`metadata` must be an object",
            ))
        }
    }
    match &r.service_tier {
        None | Some(Value::Null) => {}
        Some(Value::String(s)) if s == "auto" || s == "default" => {}
        Some(_) => return Err(unsupported("service_tier", "only `auto`/`default`")),
    }
    match &r.modalities {
        None | Some(Value::Null) => {}
        Some(Value::Array(a)) if a.iter().all(|m| m.as_str() == Some("text")) => {}
        Some(_) => return Err(unsupported("modalities", "only text output")),
    }
    reject_unless_neutral("audio", &r.audio, "audio output is not supported")?;
    reject_unless_neutral(
        "prediction",
        &r.prediction,
        "predicted outputs are not supported",
    )?;
    reject_unless_neutral(
        "reasoning_effort",
        &r.reasoning_effort,
        "not a reasoning model",
    )?;
    reject_unless_neutral("web_search_options", &r.web_search_options, "no web search")?;
    match r.prompt_cache_retention.as_deref() {
        None | Some("in_memory" | "24h") => {}
        Some(_) => {
            return Err(invalid_value(
                "prompt_cache_retention",
                "`prompt_cache_retention` must be `in_memory` or `24h`",
            ))
        }
    }
    prompt_cache_options(r.prompt_cache_options.as_ref())?;
    if r.messages.is_empty() {
        return Err(invalid_value("messages", "`messages` must not be empty"));
    }
    let Checked {
        stream,
        include_usage,
        n,
        max_tokens,
        stop,
        sampling,
        cache_insert,
        mut output,
    } = common(r.common, r.max_completion_tokens, false)?;
    output.logprobs = logprobs;
    // The prompt-shaping fields, read by the prompt contract (the gateway reads them the same).
    let fields = ChatTemplateFields {
        tools: r.tools,
        tool_choice: r.tool_choice,
        documents: r.documents,
        chat_template_kwargs: r.chat_template_kwargs,
        add_generation_prompt: r.add_generation_prompt,
        continue_final_message: r.continue_final_message,
        truncation: r.truncation,
    };
    // An invalid `tool_choice` is refused by the prompt contract below, naming the field.
    let choice = fields.tool_choice().ok();
    let mut answer = AnswerSpec {
        tool_calls: fields.tools.as_ref().is_some_and(|t| !t.is_empty())
            && choice != Some(ToolChoice::None),
        forced: None,
        single_call: !parallel_calls,
        separate_reasoning: r.separate_reasoning.unwrap_or(true),
        stream_reasoning: r.stream_reasoning.unwrap_or(true),
    };
    if !matches!(format, AnswerFormat::Text) && answer.tool_calls {
        return Err(unsupported(
            "response_format",
            "JSON mode cannot be combined with tools (a tool call is not a JSON object answer); send `tool_choice: \"none\"` or no tools",
        ));
    }
    let mut format = format;
    if let Some(forced) = forced_call(
        fields.tools.as_deref().unwrap_or_default(),
        choice,
        parallel_calls,
        schemas,
    )? {
        answer.forced = Some(forced.0);
        format = AnswerFormat::ToolCall(forced.1);
    }
    let chat = fields.prompt(r.messages).map_err(field_error)?;
    Ok(GenerationPlan {
        model: r.model,
        prompt: PromptSource::Chat(chat),
        stream,
        include_usage,
        n,
        max_tokens,
        stop,
        sampling,
        cache_insert,
        output,
        answer,
        format,
        echo: false,
    })
}

/// `prompt_cache_options`: `mode` `implicit` (the default: kvgate's prefix cache is automatic
/// and exact) and a `ttl` string are accepted; `explicit` breakpoints are not supported.
fn prompt_cache_options(v: Option<&Value>) -> Result<(), ApiError> {
    let o = match v {
        None | Some(Value::Null) => return Ok(()),
        Some(Value::Object(o)) => o,
        Some(_) => {
            return Err(ApiError::bad_request(
                "invalid_type",
                Some("prompt_cache_options"),
                "`prompt_cache_options` must be an object",
            ))
        }
    };
    for (k, v) in o {
        let param = format!("prompt_cache_options.{k}");
        match (k.as_str(), v) {
            ("mode", Value::String(m)) if m == "implicit" => {}
            ("mode", Value::String(m)) if m == "explicit" => {
                return Err(unsupported(
                    &param,
                    "explicit cache breakpoints are not supported: every prompt prefix is cached and matched exactly",
                ))
            }
            ("mode", _) => {
                return Err(invalid_value(&param, "`mode` must be `implicit` or `explicit`"))
            }
            ("ttl", Value::String(_)) => {}
            ("ttl", _) => {
                return Err(ApiError::bad_request(
                    "invalid_type",
                    Some(&param),
                    "`ttl` must be a string",
                ))
            }
            _ => {
                return Err(ApiError::bad_request(
                    "unknown_parameter",
                    Some(&param),
                    format!("unknown field `{k}`"),
                ))
            }
        }
    }
    Ok(())
}

/// The call `tool_choice` forces, with the schema of its JSON: `required` → one call of one of
/// the tools (`{"name", "arguments"}`), or with `parallel` a list of 1 to
/// [`MAX_PARALLEL_CALLS`] of them; a named function → its arguments (one call). A function's
/// `parameters` (absent: no arguments, `{}`) must be a schema the automaton holds
/// (`engine::json_schema`), else `400 unsupported_parameter` naming the tool.
fn forced_call(
    tools: &[Value],
    choice: Option<ToolChoice>,
    parallel: bool,
    schemas: &SchemaCache,
) -> Result<Option<(ForcedCall, Arc<CompiledSchema>)>, ApiError> {
    let empty = serde_json::json!({"type": "object", "properties": {}});
    let name_params = |t: &Value| {
        let f = t.get("function");
        let name = f
            .and_then(|f| f.get("name"))
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string();
        let params = f
            .and_then(|f| f.get("parameters"))
            .filter(|p| !p.is_null())
            .cloned()
            .unwrap_or_else(|| empty.clone());
        (name, params)
    };
    let refused = |i: usize, e: engine::json_schema::SchemaError| {
        ApiError::bad_request(
            "unsupported_parameter",
            Some(&format!("tools[{i}].function.parameters")),
            format!("a forced tool call holds the answer to the tool's parameters, and {e}"),
        )
    };
    match choice {
        Some(ToolChoice::Function(i)) => {
            let (name, params) = tools.get(i).map(name_params).unwrap_or_default();
            let schema = schemas
                .get_or_compile(SchemaKey::call(&params), || {
                    CompiledSchema::compile(&params)
                })
                .map_err(|e| refused(i, e))?;
            Ok(Some((ForcedCall::Named(name), schema)))
        }
        Some(ToolChoice::Required) => {
            let all: Vec<(String, Value)> = tools.iter().map(name_params).collect();
            let refs: Vec<(&str, &Value)> = all.iter().map(|(n, p)| (n.as_str(), p)).collect();
            let (key, call) = if parallel {
                (
                    SchemaKey::call_list(&refs, MAX_PARALLEL_CALLS),
                    ForcedCall::RequiredList,
                )
            } else {
                (SchemaKey::calls(&refs), ForcedCall::Required)
            };
            let schema = schemas
                .get_or_compile(key, || {
                    if parallel {
                        CompiledSchema::compile_call_list(&refs, MAX_PARALLEL_CALLS)
                    } else {
                        CompiledSchema::compile_calls(&refs)
                    }
                })
                .map_err(|(i, e)| refused(i, e))?;
            Ok(Some((call, schema)))
        }
        _ => Ok(None),
    }
}

/// Validates a `/v1/completions` body.
pub fn completion(body: &[u8]) -> Result<GenerationPlan, ApiError> {
    let value = parse_object(body, COMPLETION_FIELDS)?;
    let _: CommonParams = typed(&value)?;
    let r: CompletionRequest = typed(value)?;
    let logprobs = match &r.logprobs {
        None | Some(Value::Null) => None,
        Some(v) => Some(top_count("logprobs", v)?),
    };
    let echo = match &r.echo {
        None | Some(Value::Null) | Some(Value::Bool(false)) => false,
        Some(Value::Bool(true)) => true,
        Some(_) => {
            return Err(ApiError::bad_request(
                "invalid_type",
                Some("echo"),
                "`echo` must be a boolean",
            ))
        }
    };
    reject_unless_neutral("suffix", &r.suffix, "suffix (insertion) is not supported")?;
    let prompt = r
        .prompt
        .into_source()
        .map_err(|e| prompt_error(&e, "prompt"))?;
    let Checked {
        stream,
        include_usage,
        n,
        max_tokens,
        stop,
        sampling,
        cache_insert,
        mut output,
    } = common(r.common, None, echo)?;
    // `best_of` > `n` would generate more and return the likeliest `n`: not served.
    match &r.best_of {
        None | Some(Value::Null) => {}
        Some(v) if v.as_u64() == Some(n as u64) => {}
        Some(_) => return Err(unsupported("best_of", "only best_of = n is served")),
    }
    output.logprobs = logprobs;
    // The rule the gateway reads too (it predicts no cached tokens for such a request).
    if prompt_profile::scores_prompt(r.echo.as_ref(), r.logprobs.as_ref()) {
        output.prompt_logprobs = logprobs;
    }
    Ok(GenerationPlan {
        echo,
        model: r.model,
        prompt,
        stream,
        include_usage,
        n,
        max_tokens,
        stop,
        sampling,
        cache_insert,
        output,
        answer: AnswerSpec::default(),
        format: AnswerFormat::Text,
    })
}

/// An alternatives count (`top_logprobs`, completion `logprobs`): an integer in
/// 0..=[`engine::MAX_TOP_LOGPROBS`].
fn top_count(param: &str, v: &Value) -> Result<usize, ApiError> {
    match v.as_u64() {
        Some(n) if n <= engine::MAX_TOP_LOGPROBS as u64 => Ok(n as usize),
        Some(n) => Err(invalid_value(
            param,
            format!(
                "`{param}` must be at most {}, got {n}",
                engine::MAX_TOP_LOGPROBS
            ),
        )),
        None => Err(ApiError::bad_request(
            "invalid_type",
            Some(param),
            format!("`{param}` must be a non-negative integer"),
        )),
    }
}

/// Chat `logprobs` (boolean) and `top_logprobs` (0..=20, only with `logprobs: true`).
fn chat_logprobs(logprobs: &Option<Value>, top: &Option<Value>) -> Result<Option<usize>, ApiError> {
    let on = match logprobs {
        None | Some(Value::Null) | Some(Value::Bool(false)) => false,
        Some(Value::Bool(true)) => true,
        Some(_) => {
            return Err(ApiError::bad_request(
                "invalid_type",
                Some("logprobs"),
                "`logprobs` must be a boolean",
            ))
        }
    };
    let k = match top {
        None | Some(Value::Null) => 0,
        Some(v) => top_count("top_logprobs", v)?,
    };
    if k > 0 && !on {
        return Err(invalid_value(
            "top_logprobs",
            "`top_logprobs` needs `logprobs: true`",
        ));
    }
    Ok(on.then_some(k))
}

/// A chat-template field the prompt contract refused, as the worker answers it: 400
/// `unsupported_parameter` for a valid value not served, else `invalid_value`.
pub fn field_error(e: prompt_profile::FieldError) -> ApiError {
    BodyError::field(e).into()
}

/// A prompt-contract error (`prompt_profile`) as the worker answers it: the request's fault
/// is a 400 naming the field (`param`: the prompt's field, `messages` or `prompt`, when the
/// error names none), a model-file failure a 500.
pub fn prompt_error(e: &ProfileError, param: &str) -> ApiError {
    if let Some(b) = BodyError::prompt(e, param) {
        return b.into();
    }
    match e {
        ProfileError::ContextLengthExceeded {
            context_limit,
            prompt_tokens,
            max_tokens,
            native_reserve,
            requested,
        } => ApiError::bad_request(
            e.error_type(),
            Some(prompt_profile::budget_param(*requested, param)),
            e.to_string(),
        )
        .with_detail("context_limit", *context_limit)
        .with_detail("prompt_tokens", *prompt_tokens)
        .with_detail("max_tokens", *max_tokens)
        .with_detail("native_reserve", *native_reserve),
        e => ApiError::new(
            axum::http::StatusCode::INTERNAL_SERVER_ERROR,
            e.error_type(),
            e.to_string(),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use prompt_profile::TokenBudget;

    /// `super::chat` with a cache that keeps nothing.
    fn chat(body: &[u8]) -> Result<GenerationPlan, ApiError> {
        super::chat(body, &SchemaCache::new(0))
    }

    fn chat_err(body: &str) -> ApiError {
        chat(body.as_bytes()).unwrap_err()
    }

    const MSG: &str = r#""model":"m","messages":[{"role":"user","content":"hi"}]"#;

    #[test]
    fn minimal_chat_is_accepted_with_openai_defaults() {
        let p = chat(format!("{{{MSG}}}").as_bytes()).unwrap();
        assert!(!p.stream);
        assert!(p.max_tokens.is_none());
        assert_eq!(p.sampling.temperature, 1.0);
        assert!(p.cache_insert);
    }

    #[test]
    fn errors_name_the_field() {
        let e = chat_err("{not json");
        assert_eq!(e.code, "invalid_json");
        let e = chat_err(&format!(r#"{{{MSG},"bogus":1}}"#));
        assert_eq!(
            (e.code, e.param.as_deref()),
            ("unknown_parameter", Some("bogus"))
        );
        let e = chat_err(&format!(r#"{{{MSG},"temperature":"hot"}}"#));
        assert_eq!(
            (e.code, e.param.as_deref()),
            ("invalid_type", Some("temperature"))
        );
        let e = chat_err(r#"{"model":"m","messages":[{"role":"user","content":5}]}"#);
        assert_eq!(e.code, "invalid_type");
        assert!(e.param.unwrap().starts_with("messages[0]"));
        let e = chat_err(r#"{"model":"m"}"#);
        assert_eq!(
            (e.code, e.param.as_deref()),
            ("missing_parameter", Some("messages"))
        );
        assert_eq!(
            chat(format!(r#"{{{MSG},"n":16}}"#).as_bytes()).unwrap().n,
            16
        );
        assert_eq!(chat(format!("{{{MSG}}}").as_bytes()).unwrap().n, 1);
        for bad in ["0", "17", "100000000000"] {
            let e = chat_err(&format!(r#"{{{MSG},"n":{bad}}}"#));
            assert_eq!((e.code, e.param.as_deref()), ("invalid_value", Some("n")));
        }
        let e = chat_err(&format!(r#"{{{MSG},"n":-1}}"#));
        assert_eq!((e.code, e.param.as_deref()), ("invalid_type", Some("n")));
        let p = completion(br#"{"model":"m","prompt":"x","n":3,"best_of":3}"#).unwrap();
        assert_eq!(p.n, 3);
        let e = completion(br#"{"model":"m","prompt":"x","n":2,"best_of":3}"#).unwrap_err();
        assert_eq!(
            (e.code, e.param.as_deref()),
            ("unsupported_parameter", Some("best_of"))
        );
        // Tools reach the template; choices that need constrained decoding are refused.
        let p = chat(
            format!(r#"{{{MSG},"tools":[{{"type":"function","function":{{"name":"f"}}}}],"tool_choice":"auto"}}"#)
                .as_bytes(),
        )
        .unwrap();
        let PromptSource::Chat(c) = &p.prompt else {
            panic!("chat expected")
        };
        assert_eq!(c.tools.as_ref().map(Vec::len), Some(1));
        for (v, param) in [
            (
                r#""tools":[{"type":"function","function":{}}]"#,
                "tools[0].function.name",
            ),
            (
                r#""chat_template_kwargs":{"messages":[]}"#,
                "chat_template_kwargs.messages",
            ),
            (r#""continue_final_message":true"#, "continue_final_message"),
        ] {
            let e = chat_err(&format!(r#"{{{MSG},{v}}}"#));
            assert_eq!(
                (e.code, e.param.as_deref()),
                ("invalid_value", Some(param)),
                "{v}"
            );
        }
        let schema = r#"{"type":"json_schema","json_schema":{"schema":{"type":"object","properties":{"a":{"type":"array","items":{"type":"integer"},"uniqueItems":true}}}}}"#;
        let e = chat_err(&format!(r#"{{{MSG},"response_format":{schema}}}"#));
        assert_eq!(
            (e.code, e.param.as_deref()),
            ("unsupported_parameter", Some("response_format"))
        );
        // Forced tool calls: `required` and a named function need tools (the function one of
        // them) whose parameters the automaton holds; the answer is then held to the call.
        let tools = r#""tools":[{"type":"function","function":{"name":"f","parameters":{"type":"object","properties":{"x":{"type":"integer"}}}}},{"type":"function","function":{"name":"g"}}]"#;
        for (choice, param, code) in [
            (r#""required""#, "tool_choice", "invalid_value"),
            (
                r#"{"type":"function","function":{"name":"f"}}"#,
                "tool_choice.function.name",
                "invalid_value",
            ),
        ] {
            let e = chat_err(&format!(r#"{{{MSG},"tool_choice":{choice}}}"#));
            assert_eq!(
                (e.code, e.param.as_deref()),
                (code, Some(param)),
                "{choice}"
            );
        }
        // `required`: a list of calls unless `parallel_tool_calls` is false (OpenAI's default
        // allows several); a named function: one call either way.
        for (choice, parallel, forced) in [
            (r#""required""#, "", ForcedCall::RequiredList),
            (
                r#""required""#,
                r#","parallel_tool_calls":true"#,
                ForcedCall::RequiredList,
            ),
            (
                r#""required""#,
                r#","parallel_tool_calls":false"#,
                ForcedCall::Required,
            ),
            (
                r#"{"type":"function","function":{"name":"g"}}"#,
                "",
                ForcedCall::Named("g".into()),
            ),
            (
                r#"{"type":"function","function":{"name":"g"}}"#,
                r#","parallel_tool_calls":true"#,
                ForcedCall::Named("g".into()),
            ),
        ] {
            let p =
                chat(format!(r#"{{{MSG},{tools},"tool_choice":{choice}{parallel}}}"#).as_bytes())
                    .unwrap();
            assert_eq!(p.answer.forced, Some(forced), "{choice}");
            assert!(matches!(p.format, AnswerFormat::ToolCall(_)), "{choice}");
        }
        let p = chat(format!(r#"{{{MSG},{tools},"tool_choice":"auto"}}"#).as_bytes()).unwrap();
        assert!(p.answer.forced.is_none() && matches!(p.format, AnswerFormat::Text));
        assert!(!p.answer.single_call);
        let p = chat(
            format!(r#"{{{MSG},{tools},"tool_choice":"auto","parallel_tool_calls":false}}"#)
                .as_bytes(),
        )
        .unwrap();
        assert!(p.answer.single_call);
        let hostile = r#""tools":[{"type":"function","function":{"name":"f"}},{"type":"function","function":{"name":"h","parameters":{"type":"object","properties":{"d":{"type":"string","format":"iri"}}}}}]"#;
        let e = chat_err(&format!(r#"{{{MSG},{hostile},"tool_choice":"required"}}"#));
        assert_eq!(
            (e.code, e.param.as_deref()),
            (
                "unsupported_parameter",
                Some("tools[1].function.parameters")
            )
        );
        assert!(e.message.contains("/properties/d"), "{}", e.message);
        // Under `auto` the same tool is only offered: nothing to hold the answer to.
        assert!(chat(format!(r#"{{{MSG},{hostile}}}"#).as_bytes()).is_ok());
        for (k, v) in [
            ("temperature", "3"),
            ("top_p", "0"),
            ("max_tokens", "0"),
            ("top_k", "-5"),
        ] {
            let e = chat_err(&format!(r#"{{{MSG},"{k}":{v}}}"#));
            assert_eq!(
                (e.code, e.param.as_deref()),
                ("invalid_value", Some(k)),
                "{k}"
            );
        }
        let e = chat_err(&format!(r#"{{{MSG},"tools":[{{"type":"retrieval"}}]}}"#));
        assert_eq!(
            (e.code, e.param.as_deref()),
            ("unsupported_parameter", Some("tools[0].type"))
        );
        let e = chat_err(&format!(
            r#"{{{MSG},"stream_options":{{"include_usage":true}}}}"#
        ));
        assert_eq!(e.param.as_deref(), Some("stream_options"));
        let e = chat_err(&format!(r#"{{{MSG},"stop":["a","b","c","d","e"]}}"#));
        assert_eq!(e.param.as_deref(), Some("stop"));
    }

    #[test]
    fn vllm_and_sglang_output_extensions_are_read_and_checked() {
        // What the SGLang model gateway sends with every chat request.
        let p = chat(
            format!(
                r#"{{{MSG},"max_completion_tokens":9,"ignore_eos":true,"min_tokens":3,"stop_token_ids":[5,7],"skip_special_tokens":false,"no_stop_trim":true,"separate_reasoning":true,"stream_reasoning":true,"return_hidden_states":false,"continue_final_message":false,"top_k":4,"min_p":0.1,"repetition_penalty":1.1}}"#
            )
            .as_bytes(),
        )
        .unwrap();
        assert_eq!(
            p.output,
            OutputSpec {
                ignore_eos: true,
                stop_token_ids: vec![5, 7],
                min_tokens: 3,
                skip_special_tokens: Some(false),
                include_stop_str: true,
                logprobs: None,
                prompt_logprobs: None,
            }
        );
        for (v, want) in [
            (r#""logprobs":true"#, Some(0)),
            (r#""logprobs":true,"top_logprobs":5"#, Some(5)),
            (r#""logprobs":false"#, None),
        ] {
            let p = chat(format!("{{{MSG},{v}}}").as_bytes()).unwrap();
            assert_eq!(p.output.logprobs, want, "{v}");
        }
        for (v, code, param) in [
            (r#""top_logprobs":2"#, "invalid_value", "top_logprobs"),
            (
                r#""logprobs":true,"top_logprobs":21"#,
                "invalid_value",
                "top_logprobs",
            ),
            (r#""logprobs":1"#, "invalid_type", "logprobs"),
        ] {
            let e = chat_err(&format!(r#"{{{MSG},{v}}}"#));
            assert_eq!((e.code, e.param.as_deref()), (code, Some(param)), "{v}");
        }
        let c = completion(br#"{"model":"m","prompt":"x","logprobs":3}"#).unwrap();
        assert_eq!(c.output.logprobs, Some(3));
        let (stop, out) = p.output.resolve(&[2], 100, 9, true).unwrap();
        assert_eq!(stop, vec![5, 7], "ignore_eos drops the profile's eos ids");
        assert_eq!(out.min_tokens, 3);
        assert!(!out.skip_special_tokens && out.include_stop_str);
        let d = chat(format!("{{{MSG}}}").as_bytes()).unwrap().output;
        assert_eq!(d.resolve(&[2], 100, 9, true).unwrap().0, vec![2]);
        assert!(d.skip_special_tokens.is_none() && !d.include_stop_str && d.min_tokens == 0);
        assert!(d.resolve(&[2], 100, 9, true).unwrap().1.skip_special_tokens);
        assert!(
            !d.resolve(&[2], 100, 9, false)
                .unwrap()
                .1
                .skip_special_tokens
        );
        // min_tokens beyond a budget-chosen max is clamped; beyond an explicit one refused.
        let p = chat(format!(r#"{{{MSG},"min_tokens":50}}"#).as_bytes()).unwrap();
        assert_eq!(
            p.output.resolve(&[2], 100, 20, true).unwrap().1.min_tokens,
            20
        );
        let e = p.output.clone();
        let bad = OutputSpec {
            stop_token_ids: vec![100],
            ..e
        };
        let err = bad.resolve(&[2], 100, 20, true).unwrap_err();
        assert_eq!(err.param.as_deref(), Some("stop_token_ids"));
        // The completion endpoint reads them too.
        let p = completion(
            br#"{"model":"m","prompt":"x","ignore_eos":true,"include_stop_str_in_output":true}"#,
        )
        .unwrap();
        assert!(p.output.ignore_eos && p.output.include_stop_str);
        for (v, code, param) in [
            (
                r#""min_tokens":8,"max_tokens":4"#,
                "invalid_value",
                "min_tokens",
            ),
            (
                r#""return_hidden_states":true"#,
                "unsupported_parameter",
                "return_hidden_states",
            ),
            (
                r#""no_stop_trim":true,"include_stop_str_in_output":false"#,
                "invalid_value",
                "no_stop_trim",
            ),
            (r#""ignore_eos":"yes""#, "invalid_type", "ignore_eos"),
            (
                r#""stop_token_ids":[-1]"#,
                "invalid_type",
                "stop_token_ids[0]",
            ),
            (r#""regex":"a+""#, "unknown_parameter", "regex"),
            (r#""json_schema":"{}""#, "unknown_parameter", "json_schema"),
        ] {
            let e = chat_err(&format!(r#"{{{MSG},{v}}}"#));
            assert_eq!((e.code, e.param.as_deref()), (code, Some(param)), "{v}");
        }
        let many: Vec<String> = (0..=MAX_STOP_TOKEN_IDS).map(|i| i.to_string()).collect();
        let e = chat_err(&format!(
            r#"{{{MSG},"stop_token_ids":[{}]}}"#,
            many.join(",")
        ));
        assert_eq!(e.param.as_deref(), Some("stop_token_ids"));
    }

    #[test]
    fn neutral_values_of_unsupported_parameters_pass() {
        let p = chat(
            format!(
                r#"{{{MSG},"n":1,"logprobs":false,"tools":[],"tool_choice":"none","response_format":{{"type":"text"}},"max_completion_tokens":7,"max_tokens":7,"stop":"x","seed":-3,"kvgate":{{"cache":false}},"cache_salt":"t","user":"u","stream":true,"stream_options":{{"include_usage":true}}}}"#
            )
            .as_bytes(),
        )
        .unwrap();
        assert_eq!(p.max_tokens, Some(7));
        assert_eq!(p.stop, vec!["x".to_string()]);
        assert_eq!(p.sampling.seed, Some((-3i64) as u64));
        assert!(!p.cache_insert);
        assert!(p.stream && p.include_usage);
    }

    #[test]
    fn openai_cache_hints_and_the_safety_identifier_are_accepted() {
        let p = chat(
            format!(
                r#"{{{MSG},"prompt_cache_key":"conv-42","prompt_cache_retention":"24h","safety_identifier":"user-hash"}}"#
            )
            .as_bytes(),
        );
        assert!(p.is_ok(), "{:?}", p.err());
        assert!(
            chat(format!(r#"{{{MSG},"prompt_cache_retention":"in_memory"}}"#).as_bytes()).is_ok()
        );
        assert!(chat(
            format!(r#"{{{MSG},"prompt_cache_options":{{"mode":"implicit","ttl":"30m"}}}}"#)
                .as_bytes()
        )
        .is_ok());
        for (v, code, param) in [
            (
                r#""prompt_cache_retention":"forever""#,
                "invalid_value",
                "prompt_cache_retention",
            ),
            (
                r#""prompt_cache_key":7"#,
                "invalid_type",
                "prompt_cache_key",
            ),
            (
                r#""safety_identifier":[]"#,
                "invalid_type",
                "safety_identifier",
            ),
            (
                r#""prompt_cache_options":{"mode":"explicit"}"#,
                "unsupported_parameter",
                "prompt_cache_options.mode",
            ),
            (
                r#""prompt_cache_options":{"mode":"x"}"#,
                "invalid_value",
                "prompt_cache_options.mode",
            ),
            (
                r#""prompt_cache_options":{"ttl":30}"#,
                "invalid_type",
                "prompt_cache_options.ttl",
            ),
            (
                r#""prompt_cache_options":{"other":1}"#,
                "unknown_parameter",
                "prompt_cache_options.other",
            ),
            (
                r#""prompt_cache_options":[]"#,
                "invalid_type",
                "prompt_cache_options",
            ),
        ] {
            let e = chat_err(&format!(r#"{{{MSG},{v}}}"#));
            assert_eq!((e.code, e.param.as_deref()), (code, Some(param)), "{v}");
        }
    }

    #[test]
    fn completion_prompts() {
        let p = completion(br#"{"model":"m","prompt":[1,2,3]}"#).unwrap();
        assert!(matches!(p.prompt, PromptSource::Tokens(ref t) if t == &[1, 2, 3]));
        let p = completion(br#"{"model":"m","prompt":["one"]}"#).unwrap();
        assert!(matches!(p.prompt, PromptSource::Text(ref t) if t == "one"));
        let e = completion(br#"{"model":"m","prompt":["a","b"]}"#).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("prompt"));
        let e = completion(br#"{"model":"m","prompt":""}"#).unwrap_err();
        assert_eq!(e.code, "invalid_value");
    }

    /// `echo`: a boolean; with `logprobs` the prompt's log probabilities are asked too (the
    /// rule the gateway reads, `prompt_profile::scores_prompt`); `max_tokens = 0` only with it.
    #[test]
    fn completion_echo() {
        let p = completion(br#"{"model":"m","prompt":"x","echo":true}"#).unwrap();
        assert!(p.echo);
        assert_eq!(p.output.prompt_logprobs, None);
        let p =
            completion(br#"{"model":"m","prompt":"x","echo":true,"logprobs":2,"max_tokens":0}"#)
                .unwrap();
        assert!(p.echo);
        assert_eq!(
            (p.output.logprobs, p.output.prompt_logprobs),
            (Some(2), Some(2))
        );
        assert_eq!(p.max_tokens, Some(0));
        let p = completion(br#"{"model":"m","prompt":"x","logprobs":2}"#).unwrap();
        assert!(!p.echo);
        assert_eq!(
            (p.output.logprobs, p.output.prompt_logprobs),
            (Some(2), None)
        );
        let p = completion(br#"{"model":"m","prompt":"x","echo":false}"#).unwrap();
        assert!(!p.echo);
        let e = completion(br#"{"model":"m","prompt":"x","echo":"yes"}"#).unwrap_err();
        assert_eq!((e.code, e.param.as_deref()), ("invalid_type", Some("echo")));
        let e = completion(br#"{"model":"m","prompt":"x","max_tokens":0}"#).unwrap_err();
        assert_eq!(
            (e.code, e.param.as_deref()),
            ("invalid_value", Some("max_tokens"))
        );
        assert!(e.message.contains("echo"), "{}", e.message);
        let e = chat(br#"{"model":"m","messages":[{"role":"user","content":"x"}],"max_tokens":0}"#)
            .unwrap_err();
        assert_eq!(
            (e.code, e.param.as_deref()),
            ("invalid_value", Some("max_tokens"))
        );
    }

    #[test]
    fn budget_errors_name_the_field_and_the_numbers() {
        let b = TokenBudget {
            context_limit: 200,
            native_reserve: 10,
        };
        let e = prompt_error(
            &b.output_tokens(100, Some(95), 1000).unwrap_err(),
            "messages",
        );
        assert_eq!(e.code, "context_length_exceeded");
        assert_eq!(e.param.as_deref(), Some("max_tokens"));
        assert_eq!(e.details["prompt_tokens"], 100);
        assert_eq!(e.details["max_tokens"], 95);
        assert_eq!(e.details["native_reserve"], 10);
        assert_eq!(e.details["context_limit"], 200);
        let e = prompt_error(&b.output_tokens(195, None, 1000).unwrap_err(), "prompt");
        assert_eq!(e.param.as_deref(), Some("prompt"));
        assert_eq!(e.status, axum::http::StatusCode::BAD_REQUEST);
    }
}
