//! Wire types the gateway reads or writes: the part of an OpenAI request body that routing
//! needs, a worker's `GET /v1/profile` answer, and the admin plane's worker status.
//!
//! The gateway never re-serializes a client body: it forwards the bytes it received. These
//! types only *read* what routing needs, so unknown fields are ignored here (the worker is the
//! one that refuses unsupported parameters).

use prompt_profile::{ChatMessage, ChatTemplateFields, CompletionPrompt, PromptSource};
use serde::{Deserialize, Serialize};

use crate::error::GatewayError;

/// Which OpenAI endpoint a body was parsed for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Endpoint {
    /// `POST /v1/chat/completions`.
    Chat,
    /// `POST /v1/completions`.
    Completion,
}

impl Endpoint {
    /// The endpoint for a request path, if it is one that carries a prompt.
    pub fn from_path(path: &str) -> Option<Endpoint> {
        match path.trim_end_matches('/') {
            "/v1/chat/completions" => Some(Endpoint::Chat),
            "/v1/completions" => Some(Endpoint::Completion),
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
    /// The per-request `cache_salt`.
    pub cache_salt: Option<String>,
    /// `stream`.
    pub stream: bool,
}

/// The one method the OpenAI API serves on `path`, for the paths it defines; `None` for other
/// paths (a round-robin service may forward anything there).
pub fn allowed_method(path: &str) -> Option<&'static str> {
    match path.trim_end_matches('/') {
        "/v1/chat/completions" | "/v1/completions" | "/v1/embeddings" => Some("POST"),
        "/v1/models" => Some("GET"),
        _ => None,
    }
}

/// `Ok` when `body` is one JSON object (not parsed into anything: O(body), no allocation per
/// value); the error names what is wrong.
pub fn check_json_object(body: &[u8]) -> Result<(), GatewayError> {
    if body.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'{') {
        return Err(
            match serde_json::from_slice::<serde::de::IgnoredAny>(body) {
                Ok(_) => invalid("the body must be a JSON object"),
                Err(e) => invalid(format!("malformed JSON: {e}")),
            },
        );
    }
    serde_json::from_slice::<serde::de::IgnoredAny>(body)
        .map(|_| ())
        .map_err(|e| invalid(format!("malformed JSON: {e}")))
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

/// The output tokens a body asks for (`max_completion_tokens`, else `max_tokens`; 0 when it
/// names neither or the body is not JSON), for a tenant's token rate limit.
pub fn peek_output_tokens(body: &[u8]) -> u64 {
    #[derive(Deserialize)]
    struct OutputOnly {
        max_tokens: Option<u64>,
        max_completion_tokens: Option<u64>,
    }
    if body.is_empty() {
        return 0;
    }
    serde_json::from_slice::<OutputOnly>(body)
        .ok()
        .and_then(|o| o.max_completion_tokens.or(o.max_tokens))
        .unwrap_or(0)
}

fn invalid(reason: impl Into<String>) -> GatewayError {
    GatewayError::InvalidBody {
        reason: reason.into(),
    }
}

/// What routing reads of a body, typed by the same types the worker uses (`ChatMessage`,
/// `CompletionPrompt`); every other field is ignored here (the worker judges them).
#[derive(Deserialize)]
struct RoutingFields {
    #[serde(default)]
    model: Option<String>,
    #[serde(default)]
    messages: Option<Vec<ChatMessage>>,
    #[serde(default)]
    prompt: Option<CompletionPrompt>,
    #[serde(default)]
    max_tokens: Option<u64>,
    #[serde(default)]
    max_completion_tokens: Option<u64>,
    #[serde(default)]
    cache_salt: Option<String>,
    #[serde(default)]
    stream: Option<bool>,
    /// `tools`, `chat_template_kwargs`, … — read by the prompt contract, as the worker does.
    #[serde(flatten)]
    template: ChatTemplateFields,
}

impl InferenceBody {
    /// Parses a chat or completion body. Errors name the field; never panics on client input.
    pub fn parse(endpoint: Endpoint, body: &[u8]) -> Result<InferenceBody, GatewayError> {
        // serde would read a struct from an array too: an object is required.
        if body.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'{') {
            check_json_object(body)?;
        }
        let mut de = serde_json::Deserializer::from_slice(body);
        let fields: RoutingFields = match serde_path_to_error::deserialize(&mut de) {
            Ok(f) => f,
            Err(e) => {
                let path = e.path().to_string();
                let inner = e.into_inner();
                return Err(match inner.classify() {
                    serde_json::error::Category::Syntax | serde_json::error::Category::Eof => {
                        invalid(format!("malformed JSON: {inner}"))
                    }
                    _ if path == "." => invalid(format!("the body must be a JSON object: {inner}")),
                    _ => {
                        let msg = inner.to_string();
                        match msg
                            .strip_prefix("missing field `")
                            .and_then(|r| r.split('`').next())
                        {
                            Some(field) => invalid(format!("`{path}.{field}` is required")),
                            None => invalid(format!("`{path}`: {msg}")),
                        }
                    }
                });
            }
        };
        de.end()
            .map_err(|e| invalid(format!("malformed JSON: {e}")))?;
        let prompt = match endpoint {
            Endpoint::Chat => PromptSource::Chat(
                fields
                    .template
                    .prompt(
                        fields
                            .messages
                            .ok_or_else(|| invalid("`messages` is required"))?,
                    )
                    .map_err(|e| invalid(format!("`{}`: {}", e.param, e.reason)))?,
            ),
            Endpoint::Completion => fields
                .prompt
                .ok_or_else(|| invalid("`prompt` is required"))?
                .into_source()
                .map_err(|e| invalid(format!("`prompt`: {e}")))?,
        };
        Ok(InferenceBody {
            model: fields.model,
            prompt,
            max_tokens: fields.max_completion_tokens.or(fields.max_tokens),
            cache_salt: fields.cache_salt,
            stream: fields.stream.unwrap_or(false),
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

        for (body, needle) in [
            (&b"{not json"[..], "malformed JSON"),
            (b"", "malformed JSON"),
            (br#"{"messages":[]} x"#, "malformed JSON"),
            (b"[1]", "JSON object"),
            (br#"{"messages":"x"}"#, "`messages`"),
            (br#"{}"#, "`messages` is required"),
            (br#"{"messages":[{"content":"x"}]}"#, "messages[0].role"),
            (
                br#"{"messages":[{"role":"user","content":5}]}"#,
                "messages[0].content",
            ),
            (
                br#"{"messages":[{"role":"user","content":[{"type":"image_url"}]}]}"#,
                "messages[0].content",
            ),
            (br#"{"messages":[],"max_tokens":-1}"#, "max_tokens"),
            (br#"{"messages":[],"cache_salt":1}"#, "cache_salt"),
            (br#"{"messages":[],"model":1}"#, "model"),
        ] {
            let e = InferenceBody::parse(Endpoint::Chat, body).unwrap_err();
            assert_eq!(e.error_type(), "invalid_request_body");
            assert!(e.to_string().contains(needle), "{e} should name {needle}");
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
        assert!(p(br#"{"prompt":[-1]}"#).is_err());
        assert!(p(br#"{"prompt":{}}"#).is_err());
        assert!(p(br#"{"prompt":["a","b"]}"#).is_err());
        assert!(p(br#"{}"#).is_err());
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
