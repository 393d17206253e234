//! Wire types the gateway reads or writes: the part of an OpenAI request body that routing
//! needs, a worker's `GET /v1/profile` answer, and the admin plane's worker status.
//!
//! The gateway never re-serializes a client body: it forwards the bytes it received. These
//! types only *read* what routing needs, so unknown fields are ignored here (the worker is the
//! one that refuses unsupported parameters).

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

/// A completion prompt: a string, token ids, or a one-element array of either.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PromptInput {
    /// Text, to be tokenized (no chat template).
    Text(String),
    /// Token ids, used as they are.
    Tokens(Vec<u32>),
}

/// The prompt of a request as routing sees it.
#[derive(Clone, Debug, PartialEq)]
pub enum PromptSource {
    /// Chat messages, each a JSON object with `role` and `content` (string or text parts).
    Messages(Vec<serde_json::Value>),
    /// A completion prompt.
    Prompt(PromptInput),
}

/// The fields of an OpenAI body that routing reads.
#[derive(Clone, Debug, PartialEq)]
pub struct InferenceBody {
    /// The body's `model`.
    pub model: Option<String>,
    /// Messages or prompt.
    pub prompt: PromptSource,
    /// `max_completion_tokens`, else `max_tokens`.
    pub max_tokens: Option<u64>,
    /// The per-request `cache_salt`.
    pub cache_salt: Option<String>,
    /// `stream`.
    pub stream: bool,
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

fn invalid(reason: impl Into<String>) -> GatewayError {
    GatewayError::InvalidBody {
        reason: reason.into(),
    }
}

fn opt_u64(
    obj: &serde_json::Map<String, serde_json::Value>,
    field: &str,
) -> Result<Option<u64>, GatewayError> {
    match obj.get(field) {
        None | Some(serde_json::Value::Null) => Ok(None),
        Some(v) => v
            .as_u64()
            .map(Some)
            .ok_or_else(|| invalid(format!("`{field}` must be a non-negative integer"))),
    }
}

impl InferenceBody {
    /// Parses a chat or completion body. Errors name the field; never panics on client input.
    pub fn parse(endpoint: Endpoint, body: &[u8]) -> Result<InferenceBody, GatewayError> {
        let value: serde_json::Value =
            serde_json::from_slice(body).map_err(|e| invalid(format!("malformed JSON: {e}")))?;
        let obj = value
            .as_object()
            .ok_or_else(|| invalid("the body must be a JSON object"))?;
        let model = match obj.get("model") {
            None | Some(serde_json::Value::Null) => None,
            Some(serde_json::Value::String(s)) => Some(s.clone()),
            Some(_) => return Err(invalid("`model` must be a string")),
        };
        let prompt = match endpoint {
            Endpoint::Chat => {
                let messages = obj
                    .get("messages")
                    .and_then(|m| m.as_array())
                    .ok_or_else(|| invalid("`messages` must be an array"))?;
                for (i, m) in messages.iter().enumerate() {
                    let role_ok = m.get("role").is_some_and(|r| r.is_string());
                    if !role_ok {
                        return Err(invalid(format!("`messages[{i}].role` must be a string")));
                    }
                    match m.get("content") {
                        None
                        | Some(serde_json::Value::Null)
                        | Some(serde_json::Value::String(_)) => {}
                        Some(serde_json::Value::Array(parts)) => {
                            for (j, p) in parts.iter().enumerate() {
                                let text_part = p.get("type").and_then(|t| t.as_str())
                                    == Some("text")
                                    && p.get("text").is_some_and(|t| t.is_string());
                                if !text_part {
                                    return Err(invalid(format!(
                                        "`messages[{i}].content[{j}]` must be a text part"
                                    )));
                                }
                            }
                        }
                        Some(_) => {
                            return Err(invalid(format!(
                                "`messages[{i}].content` must be a string or an array of text parts"
                            )))
                        }
                    }
                }
                PromptSource::Messages(messages.clone())
            }
            Endpoint::Completion => PromptSource::Prompt(parse_prompt(obj.get("prompt"))?),
        };
        let max_tokens = match opt_u64(obj, "max_completion_tokens")? {
            Some(n) => Some(n),
            None => opt_u64(obj, "max_tokens")?,
        };
        let cache_salt = match obj.get("cache_salt") {
            None | Some(serde_json::Value::Null) => None,
            Some(serde_json::Value::String(s)) => Some(s.clone()),
            Some(_) => return Err(invalid("`cache_salt` must be a string")),
        };
        let stream = match obj.get("stream") {
            None | Some(serde_json::Value::Null) => false,
            Some(serde_json::Value::Bool(b)) => *b,
            Some(_) => return Err(invalid("`stream` must be a boolean")),
        };
        Ok(InferenceBody {
            model,
            prompt,
            max_tokens,
            cache_salt,
            stream,
        })
    }
}

fn parse_prompt(v: Option<&serde_json::Value>) -> Result<PromptInput, GatewayError> {
    use serde_json::Value;
    let bad = || {
        invalid(
            "`prompt` must be a string, an array of token ids, or a one-element array of either",
        )
    };
    match v {
        Some(Value::String(s)) => Ok(PromptInput::Text(s.clone())),
        Some(Value::Array(items)) => {
            if items.len() == 1 {
                match &items[0] {
                    Value::String(s) => return Ok(PromptInput::Text(s.clone())),
                    Value::Array(inner) => return token_ids(inner).ok_or_else(bad),
                    _ => {}
                }
            }
            token_ids(items).ok_or_else(bad)
        }
        _ => Err(bad()),
    }
}

fn token_ids(items: &[serde_json::Value]) -> Option<PromptInput> {
    items
        .iter()
        .map(|t| t.as_u64().and_then(|n| u32::try_from(n).ok()))
        .collect::<Option<Vec<u32>>>()
        .map(PromptInput::Tokens)
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
    /// SHA-256 (hex) of the chat template text.
    pub template_sha256: String,
    /// SHA-256 (hex) of the canonical tokenizer serialization.
    pub tokenizer_sha256: String,
    /// Tokens per block.
    pub block_size: u32,
    /// `xxh3` or `sha256`.
    pub hash_algorithm: String,
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
        let PromptSource::Messages(m) = p.prompt else {
            panic!("messages expected")
        };
        assert_eq!(m.len(), 2);

        let b = br#"{"model":"m","messages":[],"max_tokens":3,"max_completion_tokens":9}"#;
        assert_eq!(
            InferenceBody::parse(Endpoint::Chat, b).unwrap().max_tokens,
            Some(9)
        );

        for (body, needle) in [
            (&b"{not json"[..], "malformed JSON"),
            (b"[1]", "JSON object"),
            (br#"{"messages":"x"}"#, "`messages`"),
            (br#"{"messages":[{"content":"x"}]}"#, "messages[0].role"),
            (
                br#"{"messages":[{"role":"user","content":5}]}"#,
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
            PromptSource::Prompt(PromptInput::Text("abc".into()))
        );
        assert_eq!(
            p(br#"{"prompt":[1,2,3]}"#).unwrap(),
            PromptSource::Prompt(PromptInput::Tokens(vec![1, 2, 3]))
        );
        assert_eq!(
            p(br#"{"prompt":[[4,5]]}"#).unwrap(),
            PromptSource::Prompt(PromptInput::Tokens(vec![4, 5]))
        );
        assert_eq!(
            p(br#"{"prompt":["x"]}"#).unwrap(),
            PromptSource::Prompt(PromptInput::Text("x".into()))
        );
        assert!(p(br#"{"prompt":[-1]}"#).is_err());
        assert!(p(br#"{"prompt":{}}"#).is_err());
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
