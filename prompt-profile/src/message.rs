//! OpenAI chat messages as the chat template sees them.
//!
//! `content` may be a string, `null`, or an array of content parts; only `{"type":"text"}`
//! parts are supported (any other part type is refused with a message naming it). Text parts
//! are joined with `"\n"` before rendering (what vLLM does for templates that expect string
//! content), so both forms render identically for the default model.
//! Other message fields (`name`, `tool_calls`, `tool_call_id`, anything else) pass through
//! to the template unchanged.

use serde::de::Error as _;
use serde::{Deserialize, Deserializer, Serialize};

/// One chat message.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant`, `tool`, …; the template decides what it accepts.
    pub role: String,
    /// The content; `None` for JSON `null` or when absent (e.g. assistant tool calls).
    #[serde(default)]
    pub content: Option<MessageContent>,
    /// Every other field of the message (`name`, `tool_calls`, …), passed to the template.
    #[serde(flatten)]
    pub extra: serde_json::Map<String, serde_json::Value>,
}

impl ChatMessage {
    /// A message with string content.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        ChatMessage {
            role: role.into(),
            content: Some(MessageContent::Text(content.into())),
            extra: serde_json::Map::new(),
        }
    }

    /// The content as one string (text parts joined with `"\n"`), `None` for no content.
    pub fn text(&self) -> Option<String> {
        self.content.as_ref().map(MessageContent::to_text)
    }
}

/// Message content: a string or an array of content parts.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(untagged)]
pub enum MessageContent {
    /// Plain string content.
    Text(String),
    /// An array of content parts.
    Parts(Vec<ContentPart>),
}

impl MessageContent {
    /// The content as one string; text parts are joined with `"\n"`.
    pub fn to_text(&self) -> String {
        match self {
            MessageContent::Text(s) => s.clone(),
            MessageContent::Parts(parts) => {
                let mut out = String::new();
                for (i, ContentPart::Text { text }) in parts.iter().enumerate() {
                    if i > 0 {
                        out.push('\n');
                    }
                    out.push_str(text);
                }
                out
            }
        }
    }
}

impl<'de> Deserialize<'de> for MessageContent {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        match serde_json::Value::deserialize(deserializer)? {
            serde_json::Value::String(s) => Ok(MessageContent::Text(s)),
            serde_json::Value::Array(items) => {
                let mut parts = Vec::with_capacity(items.len());
                for (i, item) in items.into_iter().enumerate() {
                    parts.push(ContentPart::from_json(item, i).map_err(D::Error::custom)?);
                }
                Ok(MessageContent::Parts(parts))
            }
            other => Err(D::Error::custom(format!(
                "message content must be a string or an array of content parts, found {}",
                json_kind(&other)
            ))),
        }
    }
}

/// One content part. Only text parts are supported.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ContentPart {
    /// `{"type": "text", "text": "..."}`.
    Text {
        /// The text.
        text: String,
    },
}

impl ContentPart {
    fn from_json(value: serde_json::Value, index: usize) -> Result<Self, String> {
        let serde_json::Value::Object(mut map) = value else {
            return Err(format!(
                "content part {index} must be an object, found {}",
                json_kind(&value)
            ));
        };
        match map.get("type").and_then(|t| t.as_str()) {
            Some("text") => match map.remove("text") {
                Some(serde_json::Value::String(text)) => Ok(ContentPart::Text { text }),
                _ => Err(format!(
                    "content part {index} of type `text` needs a string field `text`"
                )),
            },
            Some(other) => Err(format!(
                "content part {index} has type `{other}`; only `text` parts are supported"
            )),
            None => Err(format!("content part {index} has no string field `type`")),
        }
    }
}

fn json_kind(v: &serde_json::Value) -> &'static str {
    match v {
        serde_json::Value::Null => "null",
        serde_json::Value::Bool(_) => "a boolean",
        serde_json::Value::Number(_) => "a number",
        serde_json::Value::String(_) => "a string",
        serde_json::Value::Array(_) => "an array",
        serde_json::Value::Object(_) => "an object",
    }
}
