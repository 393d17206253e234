//! A request body the prompt contract cannot read, as a client is answered: one classification
//! that the gateway (reading a KV-exact service's body) and the worker (validating every body)
//! both call, so that the same fault gets the same 400 `code` and `param` whichever of them
//! finds it (docs/worker-api.md, "Errors").
//!
//! | fault | `code` | `param` |
//! |---|---|---|
//! | not JSON, trailing bytes, not an object | `invalid_json` | — |
//! | a required field missing | `missing_parameter` | its path, `messages[0].role` |
//! | a field of the wrong type | `invalid_type` | its path, `messages[1].content` |
//! | a value the contract refuses (empty prompt, token id out of the vocabulary, a malformed tool) | `invalid_value` | the field |
//! | a valid value not served (a batch of prompts, a tool that is not a `function`) | `unsupported_parameter` | the field |
//! | the chat template refuses the conversation | the [`ProfileError::error_type`]: `template_raised`, `template_render_failed`, `invalid_message`, `unknown_token_id` | `messages` or `prompt` |
//!
//! A prompt over the context limit is not here: both answer it with its numbers
//! (`context_length_exceeded`), and a failure of the model's files is the server's (500).

use std::fmt;

use crate::prompt::FieldError;
use crate::ProfileError;

/// Why a body is refused: the OpenAI error's `code`, `param` and `message` (status 400).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BodyError {
    /// The stable code (see the module table).
    pub code: &'static str,
    /// The field at fault, as a JSON path (`messages[0].content`), when there is one.
    pub param: Option<String>,
    /// What is wrong, for a person.
    pub message: String,
}

impl BodyError {
    fn new(code: &'static str, param: Option<&str>, message: impl Into<String>) -> BodyError {
        BodyError {
            code,
            param: param.map(str::to_owned),
            message: message.into(),
        }
    }

    /// The body is not JSON (syntax error, truncated, trailing bytes).
    pub fn not_json(e: &serde_json::Error) -> BodyError {
        BodyError::new(
            "invalid_json",
            None,
            format!(
                "request body is not valid JSON: {e} (line {}, column {})",
                e.line(),
                e.column()
            ),
        )
    }

    /// The body is JSON but not one object.
    pub fn not_an_object() -> BodyError {
        BodyError::new("invalid_json", None, "request body must be a JSON object")
    }

    /// A typed read of the body failed at `path` (`serde_path_to_error`'s path; `.` or empty
    /// for the body itself).
    pub fn at(path: &str, e: serde_json::Error) -> BodyError {
        use serde_json::error::Category;
        if matches!(
            e.classify(),
            Category::Syntax | Category::Eof | Category::Io
        ) {
            return BodyError::not_json(&e);
        }
        let inner = e.to_string();
        let path = (path != "." && !path.is_empty()).then_some(path);
        if let Some(field) = inner
            .strip_prefix("missing field `")
            .and_then(|r| r.split('`').next())
        {
            let full = match path {
                Some(p) => format!("{p}.{field}"),
                None => field.to_owned(),
            };
            let message = format!("missing required parameter `{full}`");
            return BodyError::new("missing_parameter", Some(&full), message);
        }
        let message = format!("invalid value for `{}`: {inner}", path.unwrap_or("body"));
        BodyError::new("invalid_type", path, message)
    }

    /// A chat-template field ([`crate::ChatTemplateFields::prompt`]) refused.
    pub fn field(e: FieldError) -> BodyError {
        let code = if e.unsupported {
            "unsupported_parameter"
        } else {
            "invalid_value"
        };
        BodyError::new(code, Some(&e.param), e.reason)
    }

    /// A prompt the contract refuses because of the request (`param`: the prompt's field,
    /// `messages` or `prompt`, where the error names none). `None` for a prompt over the
    /// context limit (answered with its numbers) and for failures of the model's files.
    pub fn prompt(e: &ProfileError, param: &str) -> Option<BodyError> {
        Some(match e {
            ProfileError::PromptBatch { .. } => {
                BodyError::new("unsupported_parameter", Some("prompt"), e.to_string())
            }
            ProfileError::EmptyPrompt { param } => {
                BodyError::new("invalid_value", Some(param), e.to_string())
            }
            ProfileError::PromptTokenOutOfVocab { index, .. } => BodyError::new(
                "invalid_value",
                Some(&format!("prompt[{index}]")),
                e.to_string(),
            ),
            ProfileError::ContextLengthExceeded { .. } => return None,
            e if e.is_client_error() => BodyError::new(e.error_type(), Some(param), e.to_string()),
            _ => return None,
        })
    }
}

/// The field a prompt over the context limit is blamed on, as gateway and worker both answer
/// `context_length_exceeded`: `max_tokens` when the request named its output count, else the
/// prompt's field (`prompt_param`: `messages` or `prompt`).
pub fn budget_param(requested: bool, prompt_param: &str) -> &str {
    if requested {
        "max_tokens"
    } else {
        prompt_param
    }
}

impl fmt::Display for BodyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for BodyError {}

#[cfg(test)]
mod tests {
    use super::*;

    fn typed_error(json: &str) -> BodyError {
        #[derive(serde::Deserialize, Debug)]
        #[allow(dead_code)]
        struct M {
            role: String,
            content: String,
        }
        #[derive(serde::Deserialize, Debug)]
        #[allow(dead_code)]
        struct B {
            messages: Vec<M>,
            max_tokens: Option<u64>,
        }
        let mut de = serde_json::Deserializer::from_str(json);
        let e = serde_path_to_error::deserialize::<_, B>(&mut de).unwrap_err();
        let path = e.path().to_string();
        BodyError::at(&path, e.into_inner())
    }

    #[test]
    fn each_fault_has_its_code_and_path() {
        for (body, code, param) in [
            (
                r#"{"messages": [{"role": "user", "content": 5}]}"#,
                "invalid_type",
                "messages[0].content",
            ),
            (
                r#"{"messages": [{"content": "x"}]}"#,
                "missing_parameter",
                "messages[0].role",
            ),
            (r#"{"max_tokens": 1}"#, "missing_parameter", "messages"),
            (
                r#"{"messages": [], "max_tokens": "ten"}"#,
                "invalid_type",
                "max_tokens",
            ),
        ] {
            let e = typed_error(body);
            assert_eq!((e.code, e.param.as_deref()), (code, Some(param)), "{body}");
        }
        let e = typed_error(r#"{"messages": ["#);
        assert_eq!((e.code, e.param), ("invalid_json", None));
        assert!(e.message.contains("line 1"), "{}", e.message);
        let batch = ProfileError::PromptBatch { len: 2 };
        let e = BodyError::prompt(&batch, "prompt").unwrap();
        assert_eq!(
            (e.code, e.param.as_deref()),
            ("unsupported_parameter", Some("prompt"))
        );
        let over = ProfileError::ContextLengthExceeded {
            context_limit: 1,
            prompt_tokens: 2,
            max_tokens: 0,
            native_reserve: 0,
            requested: false,
        };
        assert_eq!(BodyError::prompt(&over, "messages"), None);
    }
}
