//! Wire types the gateway reads or writes: the part of an OpenAI request body that routing
//! needs, a worker's `GET /v1/profile` answer, and the admin plane's worker status.
//!
//! The gateway never re-serializes a client body: it forwards the bytes it received. These
//! types only *read* what routing needs, so unknown fields are ignored here (the worker is the
//! one that refuses unsupported parameters).

use prompt_profile::{BodyError, ChatMessage, ChatTemplateFields, CompletionPrompt, PromptSource};
use serde::{Deserialize, Serialize};

use crate::error::GatewayError;

/// Which OpenAI endpoint a body was parsed for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Endpoint {
    /// `POST /v1/chat/completions`.
    Chat,
    /// `POST /v1/completions`.
    Completion,
    /// `POST /v1/responses`: read as the chat request it asks for
    /// (`prompt_profile::responses_to_chat`, the worker's own reading).
    Responses,
}

impl Endpoint {
    /// The endpoint for a request path, if it is one that carries a prompt.
    pub fn from_path(path: &str) -> Option<Endpoint> {
        match path.trim_end_matches('/') {
            "/v1/chat/completions" => Some(Endpoint::Chat),
            "/v1/completions" => Some(Endpoint::Completion),
            "/v1/responses" => Some(Endpoint::Responses),
            _ => None,
        }
    }
}

/// The fields of an OpenAI body that routing reads.
#[derive(Clone, Debug, PartialEq)]
pub struct InferenceBody {
    /// The body's `model`.
    pub model: Option<String>,
    /// Messages or prompt, as the prompt contract (`prompt_profile`) reads them.
    pub prompt: PromptSource,
    /// `max_completion_tokens`, else `max_tokens`.
    pub max_tokens: Option<u64>,
    /// The choices `n` asks for (`prompt_profile::choices`: 1 unless an integer in 1..=16).
    pub choices: usize,
    /// The per-request `cache_salt`.
    pub cache_salt: Option<String>,
    /// `stream`.
    pub stream: bool,
    /// A completion asking its prompt's log probabilities (`prompt_profile::scores_prompt`):
    /// the worker reuses no cached prefix for it, so none is predicted.
    pub scores_prompt: bool,
}

/// `POST /v1/responses/input_tokens`: the gateway counts the prompt itself (`proxy`,
/// `route::input_tokens`).
pub const INPUT_TOKENS_PATH: &str = "/v1/responses/input_tokens";

/// The one method the OpenAI API serves on `path`, for the paths it defines; `None` for other
/// paths (a round-robin service may forward anything there).
pub fn allowed_method(path: &str) -> Option<&'static str> {
    match path.trim_end_matches('/') {
        "/v1/chat/completions"
        | "/v1/completions"
        | "/v1/responses"
        | "/v1/embeddings"
        | INPUT_TOKENS_PATH => Some("POST"),
        "/v1/models" => Some("GET"),
        _ => None,
    }
}

/// `Ok` when `body` is one JSON object (not parsed into anything: O(body), no allocation per
/// value); the error names what is wrong.
pub fn check_json_object(body: &[u8]) -> Result<(), GatewayError> {
    let json = serde_json::from_slice::<serde::de::IgnoredAny>(body)
        .map_err(|e| GatewayError::Body(BodyError::not_json(&e)));
    if body.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'{') {
        json?;
        return Err(GatewayError::Body(BodyError::not_an_object()));
    }
    json.map(|_| ())
}

/// Reads only `model` from a JSON body, for service matching. `None` for a body that is not a
/// JSON object with a string `model` (matching then treats the model as absent).
pub fn peek_model(body: &[u8]) -> Option<String> {
    #[derive(Deserialize)]
    struct ModelOnly {
        model: Option<String>,
    }
    if body.is_empty() {
        return None;
    }
    serde_json::from_slice::<ModelOnly>(body)
        .ok()
        .and_then(|m| m.model)
}

/// The output tokens a body asks for (`prompt_profile::work::requested_output_tokens`), 0 when
/// it names none: a tenant's token rate limit.
pub fn peek_output_tokens(body: &[u8]) -> u64 {
    prompt_profile::work::requested_output_tokens(body).unwrap_or(0)
}

/// What routing reads of a chat body, typed by the same types the worker uses (`ChatMessage`,
/// the template fields); every other field is ignored here (the worker judges them).
#[derive(Deserialize)]
struct ChatFields {
    #[serde(default)]
    model: Option<String>,
    /// Required, as the worker reads it: absent is `missing_parameter`, `null` `invalid_type`.
    messages: Vec<ChatMessage>,
    #[serde(default)]
    max_tokens: Option<u64>,
    #[serde(default)]
    max_completion_tokens: Option<u64>,
    /// Read leniently (`prompt_profile::choices`): the worker judges it.
    #[serde(default)]
    n: Option<serde_json::Value>,
    #[serde(default)]
    cache_salt: Option<String>,
    #[serde(default)]
    stream: Option<bool>,
    /// `tools`, `chat_template_kwargs`, … — read by the prompt contract, as the worker does.
    #[serde(flatten)]
    template: ChatTemplateFields,
}

/// What routing reads of a completion body (`CompletionPrompt`, as the worker reads it). Not
/// the chat fields: a completion body carrying `messages`, `tools` or `max_completion_tokens`
/// is the worker's to refuse (`unknown_parameter`), so the gateway does not judge them first.
#[derive(Deserialize)]
struct CompletionFields {
    #[serde(default)]
    model: Option<String>,
    /// Required (see `ChatFields::messages`).
    prompt: CompletionPrompt,
    #[serde(default)]
    max_tokens: Option<u64>,
    /// Read leniently (`prompt_profile::choices`): the worker judges it.
    #[serde(default)]
    n: Option<serde_json::Value>,
    #[serde(default)]
    cache_salt: Option<String>,
    #[serde(default)]
    stream: Option<bool>,
    /// Read leniently (`prompt_profile::scores_prompt`): the worker judges them.
    #[serde(default)]
    echo: Option<serde_json::Value>,
    #[serde(default)]
    logprobs: Option<serde_json::Value>,
}

/// Reads `T` from a whole body; errors as the worker classifies them.
fn typed<'de, T: Deserialize<'de>>(body: &'de [u8]) -> Result<T, GatewayError> {
    let mut de = serde_json::Deserializer::from_slice(body);
    let fields = serde_path_to_error::deserialize(&mut de).map_err(|e| {
        let path = e.path().to_string();
        GatewayError::Body(BodyError::at(&path, e.into_inner()))
    })?;
    de.end()
        .map_err(|e| GatewayError::Body(BodyError::not_json(&e)))?;
    Ok(fields)
}

impl InferenceBody {
    /// Parses a chat or completion body. Errors name the field; never panics on client input.
    pub fn parse(endpoint: Endpoint, body: &[u8]) -> Result<InferenceBody, GatewayError> {
        // serde would read a struct from an array too: an object is required.
        if body.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'{') {
            check_json_object(body)?;
        }
        Ok(match endpoint {
            Endpoint::Responses => {
                let chat = prompt_profile::responses_to_chat(body).map_err(GatewayError::Body)?;
                return InferenceBody::parse(Endpoint::Chat, &chat);
            }
            Endpoint::Chat => {
                let f: ChatFields = typed(body)?;
                let chat = f
                    .template
                    .prompt(f.messages)
                    .map_err(|e| GatewayError::Body(BodyError::field(e)))?;
                InferenceBody {
                    model: f.model,
                    prompt: PromptSource::Chat(chat),
                    max_tokens: f.max_completion_tokens.or(f.max_tokens),
                    choices: prompt_profile::choices(f.n.as_ref()),
                    cache_salt: f.cache_salt,
                    stream: f.stream.unwrap_or(false),
                    scores_prompt: false,
                }
            }
            Endpoint::Completion => {
                let f: CompletionFields = typed(body)?;
                let prompt = f
                    .prompt
                    .into_source()
                    .map_err(|e| GatewayError::from_prompt(e, "prompt"))?;
                InferenceBody {
                    model: f.model,
                    prompt,
                    max_tokens: f.max_tokens,
                    choices: prompt_profile::choices(f.n.as_ref()),
                    cache_salt: f.cache_salt,
                    stream: f.stream.unwrap_or(false),
                    scores_prompt: prompt_profile::scores_prompt(
                        f.echo.as_ref(),
                        f.logprobs.as_ref(),
                    ),
                }
            }
        })
    }
}

/// A worker's `GET /v1/profile` answer (the contract check's input; the worker's
/// `docs/worker-api.md` is the reference). Fields the gateway does not compare are ignored.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkerProfile {
    /// Model id.
    pub model_id: String,
    /// Model revision.
    #[serde(default)]
    pub revision: Option<String>,
    /// GGUF `general.architecture` of the worker's profile (absent or null: none reported).
    #[serde(default)]
    pub architecture: Option<String>,
    /// SHA-256 (hex) of the chat template text.
    pub template_sha256: String,
    /// SHA-256 (hex) of the canonical tokenizer serialization.
    pub tokenizer_sha256: String,
    /// Tokens per block.
    pub block_size: u32,
    /// `xxh3` or `sha256`.
    pub hash_algorithm: prefix_index::HashAlgorithm,
    /// Context limit in tokens.
    #[serde(default)]
    pub context_limit: Option<u64>,
    /// Tokens the worker keeps in reserve.
    #[serde(default, alias = "native_reserve_tokens")]
    pub native_reserve: Option<u64>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_chat_bodies_and_names_bad_fields() {
        let b = br#"{"model":"m","messages":[{"role":"user","content":"hi"},{"role":"user","content":[{"type":"text","text":"x"}]}],"max_tokens":7,"cache_salt":"t","stream":true}"#;
        let p = InferenceBody::parse(Endpoint::Chat, b).unwrap();
        assert_eq!(p.model.as_deref(), Some("m"));
        assert_eq!(p.max_tokens, Some(7));
        assert_eq!(p.cache_salt.as_deref(), Some("t"));
        assert!(p.stream);
        let PromptSource::Chat(c) = p.prompt else {
            panic!("messages expected")
        };
        assert_eq!(c.messages.len(), 2);
        assert!(c.add_generation_prompt);

        let b = br#"{"model":"m","messages":[],"max_tokens":3,"max_completion_tokens":9}"#;
        assert_eq!(
            InferenceBody::parse(Endpoint::Chat, b).unwrap().max_tokens,
            Some(9)
        );

        // `n` choices: counted, leniently (the worker judges the value).
        for (n, choices) in [
            ("3", 3),
            ("16", 16),
            ("17", 1),
            ("0", 1),
            ("\"x\"", 1),
            ("null", 1),
        ] {
            let b = format!(r#"{{"messages":[],"max_tokens":5,"n":{n}}}"#);
            let p = InferenceBody::parse(Endpoint::Chat, b.as_bytes()).unwrap();
            assert_eq!(p.choices, choices, "n = {n}");
            assert_eq!(
                peek_output_tokens(b.as_bytes()),
                5 * choices as u64,
                "n = {n}"
            );
        }
        let b = br#"{"prompt":"x","max_tokens":4,"n":2}"#;
        assert_eq!(
            InferenceBody::parse(Endpoint::Completion, b)
                .unwrap()
                .choices,
            2
        );
        assert_eq!(peek_output_tokens(b), 8);
        assert_eq!(peek_output_tokens(br#"{"n":4}"#), 0);

        // The codes and params the worker gives the same faults (`prompt_profile::BodyError`).
        for (body, code, param) in [
            (&b"{not json"[..], "invalid_json", None),
            (b"", "invalid_json", None),
            (br#"{"messages":[]} x"#, "invalid_json", None),
            (b"[1]", "invalid_json", None),
            (br#"{"messages":"x"}"#, "invalid_type", Some("messages")),
            (br#"{}"#, "missing_parameter", Some("messages")),
            (
                br#"{"messages":[{"content":"x"}]}"#,
                "missing_parameter",
                Some("messages[0].role"),
            ),
            (
                br#"{"messages":[{"role":"user","content":5}]}"#,
                "invalid_type",
                Some("messages[0].content"),
            ),
            (
                br#"{"messages":[{"role":"user","content":[{"type":"image_url"}]}]}"#,
                "invalid_type",
                Some("messages[0].content"),
            ),
            (
                br#"{"messages":[],"max_tokens":-1}"#,
                "invalid_type",
                Some("max_tokens"),
            ),
            (
                br#"{"messages":[],"cache_salt":1}"#,
                "invalid_type",
                Some("cache_salt"),
            ),
            (
                br#"{"messages":[],"model":1}"#,
                "invalid_type",
                Some("model"),
            ),
            (
                br#"{"messages":[],"tool_choice":"sometimes"}"#,
                "invalid_value",
                Some("tool_choice"),
            ),
        ] {
            let e = InferenceBody::parse(Endpoint::Chat, body).unwrap_err();
            let GatewayError::Body(b) = &e else {
                panic!("{e:?}")
            };
            assert_eq!(
                (b.code, b.param.as_deref()),
                (code, param),
                "{}",
                String::from_utf8_lossy(body)
            );
            assert_eq!(e.error_type(), code);
            assert_eq!(e.status(), 400);
        }
    }

    #[test]
    fn parses_completion_prompts() {
        let p = |b: &[u8]| InferenceBody::parse(Endpoint::Completion, b).map(|x| x.prompt);
        assert_eq!(
            p(br#"{"prompt":"abc"}"#).unwrap(),
            PromptSource::Text("abc".into())
        );
        assert_eq!(
            p(br#"{"prompt":[1,2,3]}"#).unwrap(),
            PromptSource::Tokens(vec![1, 2, 3])
        );
        assert_eq!(
            p(br#"{"prompt":[[4,5]]}"#).unwrap(),
            PromptSource::Tokens(vec![4, 5])
        );
        assert_eq!(
            p(br#"{"prompt":["x"]}"#).unwrap(),
            PromptSource::Text("x".into())
        );
        let code = |b: &[u8]| match p(b) {
            Err(GatewayError::Body(e)) => (e.code, e.param),
            other => panic!("{other:?}"),
        };
        assert_eq!(
            code(br#"{"prompt":[-1]}"#),
            ("invalid_type", Some("prompt".into()))
        );
        assert_eq!(
            code(br#"{"prompt":{}}"#),
            ("invalid_type", Some("prompt".into()))
        );
        assert_eq!(
            code(br#"{"prompt":["a","b"]}"#),
            ("unsupported_parameter", Some("prompt".into()))
        );
        assert_eq!(code(br#"{}"#), ("missing_parameter", Some("prompt".into())));
    }

    #[test]
    fn peeks_model_without_failing() {
        assert_eq!(peek_model(br#"{"model":"a","x":1}"#).as_deref(), Some("a"));
        assert_eq!(peek_model(b"garbage"), None);
        assert_eq!(peek_model(b""), None);
        assert_eq!(
            Endpoint::from_path("/v1/chat/completions"),
            Some(Endpoint::Chat)
        );
        assert_eq!(Endpoint::from_path("/v1/models"), None);
    }

    proptest::proptest! {
        /// Arbitrary bytes never panic the parsers, and a parsed body's fields are what the JSON says.
        #[test]
        fn parsing_never_panics(bytes in proptest::collection::vec(proptest::num::u8::ANY, 0..256)) {
            let _ = InferenceBody::parse(Endpoint::Chat, &bytes);
            let _ = InferenceBody::parse(Endpoint::Completion, &bytes);
            let _ = peek_model(&bytes);
        }

        #[test]
        fn max_tokens_and_salt_round_trip(n in 0u64..1_000_000, salt in "[a-z0-9]{0,12}", model in "[a-z]{1,8}") {
            let body = serde_json::json!({"model": model, "messages": [{"role": "user", "content": "x"}], "max_tokens": n, "cache_salt": salt});
            let p = InferenceBody::parse(Endpoint::Chat, body.to_string().as_bytes()).unwrap();
            proptest::prop_assert_eq!(p.max_tokens, Some(n));
            proptest::prop_assert_eq!(p.cache_salt.as_deref(), Some(salt.as_str()));
            proptest::prop_assert_eq!(p.model.as_deref(), Some(model.as_str()));
        }
    }
}
