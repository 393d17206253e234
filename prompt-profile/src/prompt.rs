//! The prompt contract between gateway and worker: which part of an OpenAI request is the
//! prompt ([`PromptSource`], [`CompletionPrompt`]), how it becomes token ids
//! ([`PromptProfile::prompt_ids`], one special-token policy), the token budget
//! ([`TokenBudget`]) and the block-key namespace ([`KeySpace`]). The gateway (to predict block
//! keys) and the worker (to run the request) both call exactly these, so the same body gives the
//! same ids, the same budget verdict and the same keys on both sides.
//!
//! Special-token policy (as vLLM and llama.cpp's server do it):
//! - chat messages are rendered with the chat template (generation prompt added) and the text
//!   is tokenized with special-token text parsed (`<|im_start|>` → its id); no BOS is added —
//!   templates that want one write `bos_token` themselves;
//! - completion text is tokenized with special-token text parsed, after a BOS when the model
//!   asks for one (`add_bos_token`);
//! - token ids are used as they are, each checked against the vocabulary.

use prefix_index::{BlockSize, HashAlgorithm, KeyChain, NamespaceInputs, NamespaceSeed};
use serde::Deserialize;

use crate::error::{ProfileError, Result};
use crate::identity::ProfileIdentity;
use crate::message::ChatMessage;
use crate::PromptProfile;

/// A chat conversation and how to render it: everything of a chat request that reaches the
/// chat template.
#[derive(Clone, Debug, PartialEq)]
pub struct ChatPrompt {
    /// The messages, in order.
    pub messages: Vec<ChatMessage>,
    /// End the rendered text with the assistant turn's opening (default true).
    pub add_generation_prompt: bool,
    /// Leave the final (assistant) message open for the model to continue (default false).
    pub continue_final_message: bool,
    /// The request's `tools` (OpenAI function definitions), `None` when it has none.
    pub tools: Option<Vec<serde_json::Value>>,
    /// `documents` for retrieval templates.
    pub documents: Option<Vec<serde_json::Value>>,
    /// `chat_template_kwargs`: extra template variables (e.g. `enable_thinking`).
    pub template_kwargs: serde_json::Map<String, serde_json::Value>,
    /// `truncation: "auto"`: a conversation over the token budget loses its oldest turns
    /// instead of being refused ([`PromptProfile::tokenize_within`]).
    pub truncate: bool,
}

impl ChatPrompt {
    /// `messages` with the generation prompt added (what a chat completion renders).
    pub fn new(messages: Vec<ChatMessage>) -> Self {
        ChatPrompt {
            messages,
            add_generation_prompt: true,
            continue_final_message: false,
            tools: None,
            documents: None,
            template_kwargs: serde_json::Map::new(),
            truncate: false,
        }
    }

    /// What the chat template is rendered with. Messages become JSON objects `{role, content,
    /// …other fields in request order}`; content parts are joined into one string (text parts
    /// with `"\n"`, as vLLM does for templates that take string content); a tool call's
    /// `function.arguments` given as a JSON string holding an object is parsed into that object
    /// (as vLLM does: chat templates index and iterate the arguments).
    pub fn template_inputs(&self) -> crate::template::TemplateInputs {
        let messages = self
            .messages
            .iter()
            .map(|m| {
                let mut o = serde_json::Map::with_capacity(m.extra.len() + 2);
                o.insert("role".into(), serde_json::Value::String(m.role.clone()));
                o.insert(
                    "content".into(),
                    m.text()
                        .map_or(serde_json::Value::Null, serde_json::Value::String),
                );
                for (k, v) in &m.extra {
                    let v = if k == "tool_calls" {
                        parse_tool_call_arguments(v)
                    } else {
                        v.clone()
                    };
                    o.insert(k.clone(), v);
                }
                serde_json::Value::Object(o)
            })
            .collect();
        crate::template::TemplateInputs {
            messages,
            tools: self.tools.clone(),
            documents: self.documents.clone(),
            add_generation_prompt: self.add_generation_prompt,
            continue_final_message: self.continue_final_message,
            kwargs: self.template_kwargs.clone(),
            now: None,
        }
    }
}

/// `tool_calls[*].function.arguments` as a JSON string holding an object → that object.
fn parse_tool_call_arguments(calls: &serde_json::Value) -> serde_json::Value {
    let mut calls = calls.clone();
    if let serde_json::Value::Array(items) = &mut calls {
        for call in items {
            if let Some(args) = call
                .get_mut("function")
                .and_then(|f| f.get_mut("arguments"))
            {
                if let serde_json::Value::String(s) = args {
                    if let Ok(v @ serde_json::Value::Object(_)) = serde_json::from_str(s) {
                        *args = v;
                    }
                }
            }
        }
    }
    calls
}

/// The fields of a chat request that shape its prompt besides `messages` — `tools`,
/// `tool_choice`, `documents`, `chat_template_kwargs`, `add_generation_prompt`,
/// `continue_final_message` — read the same way by the gateway (to predict block keys) and the
/// worker (to run the request).
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
pub struct ChatTemplateFields {
    /// OpenAI function tools: `[{"type": "function", "function": {"name": …, …}}]`.
    #[serde(default)]
    pub tools: Option<Vec<serde_json::Value>>,
    /// `"none"`, `"auto"`, `"required"` or `{"type": "function", "function": {"name": …}}`.
    #[serde(default)]
    pub tool_choice: Option<serde_json::Value>,
    /// Retrieval documents (templates that take `documents`).
    #[serde(default)]
    pub documents: Option<Vec<serde_json::Value>>,
    /// Extra template variables.
    #[serde(default)]
    pub chat_template_kwargs: Option<serde_json::Map<String, serde_json::Value>>,
    /// Default true.
    #[serde(default)]
    pub add_generation_prompt: Option<bool>,
    /// Default false; with `add_generation_prompt` true it is refused (as vLLM does).
    #[serde(default)]
    pub continue_final_message: Option<bool>,
    /// `"auto"`: drop the oldest turns of a conversation over the budget; `"disabled"` (the
    /// default): refuse it. The Responses API's `truncation`, carried to chat.
    #[serde(default)]
    pub truncation: Option<String>,
}

/// Template variables a request's `chat_template_kwargs` may not replace.
const RESERVED_TEMPLATE_VARS: &[&str] = &[
    "messages",
    "tools",
    "documents",
    "add_generation_prompt",
    "continue_final_message",
];

/// A request field the prompt contract refuses, with the reason (the caller's 400).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FieldError {
    /// The field (`tools`, `tools[1].function.name`, …).
    pub param: String,
    /// Why.
    pub reason: String,
    /// A valid value this server does not serve (e.g. a tool of another type than `function`), not a
    /// malformed one.
    pub unsupported: bool,
}

/// What `tool_choice` asks of the answer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ToolChoice {
    /// `none`: no tool call (the tools still reach the template).
    None,
    /// `auto` (the default): the model may call tools, in its own format.
    Auto,
    /// `required`: the answer is one call of one of the tools.
    Required,
    /// `{"type": "function", "function": {"name": …}}`: the answer is one call of that tool
    /// (its index in `tools`).
    Function(usize),
}

impl ChatTemplateFields {
    /// The request's `tool_choice`, checked against its `tools`; the error is (param, reason).
    /// `required` and a named function need tools (the function one of them).
    pub fn tool_choice(&self) -> std::result::Result<ToolChoice, (String, String)> {
        let tools = self.tools.as_deref().unwrap_or_default();
        let name_of = |t: &serde_json::Value| {
            t.get("function")
                .and_then(|f| f.get("name"))
                .and_then(|n| n.as_str())
                .map(str::to_string)
        };
        let bad = |reason: &str| Err(("tool_choice".to_string(), reason.to_string()));
        match &self.tool_choice {
            None | Some(serde_json::Value::Null) => Ok(ToolChoice::Auto),
            Some(serde_json::Value::String(s)) if s == "none" => Ok(ToolChoice::None),
            Some(serde_json::Value::String(s)) if s == "auto" => Ok(ToolChoice::Auto),
            Some(serde_json::Value::String(s)) if s == "required" => {
                if tools.is_empty() {
                    return bad("`required` needs `tools`");
                }
                Ok(ToolChoice::Required)
            }
            Some(serde_json::Value::Object(o)) => {
                if o.get("type").and_then(|t| t.as_str()) != Some("function") {
                    return Err(("tool_choice.type".into(), "must be `function`".into()));
                }
                let Some(name) = o
                    .get("function")
                    .and_then(|f| f.get("name"))
                    .and_then(|n| n.as_str())
                else {
                    return Err((
                        "tool_choice.function.name".into(),
                        "a named tool choice needs `function.name`".into(),
                    ));
                };
                match tools
                    .iter()
                    .position(|t| name_of(t).as_deref() == Some(name))
                {
                    Some(i) => Ok(ToolChoice::Function(i)),
                    None => Err((
                        "tool_choice.function.name".into(),
                        format!("{name:?} is not one of the request's `tools`"),
                    )),
                }
            }
            Some(_) => bad("must be `none`, `auto`, `required` or a function"),
        }
    }

    /// The chat prompt of `messages` under these fields, or the field that is wrong.
    pub fn prompt(self, messages: Vec<ChatMessage>) -> std::result::Result<ChatPrompt, FieldError> {
        let err = |param: String, reason: String| FieldError {
            param,
            reason,
            unsupported: false,
        };
        let unsupported = |param: String, reason: String| FieldError {
            param,
            reason,
            unsupported: true,
        };
        if let Some(tools) = &self.tools {
            for (i, t) in tools.iter().enumerate() {
                let ok_type = t.get("type").and_then(|v| v.as_str()) == Some("function");
                let name = t
                    .get("function")
                    .and_then(|f| f.get("name"))
                    .and_then(|n| n.as_str());
                if !ok_type {
                    return Err(unsupported(
                        format!("tools[{i}].type"),
                        "only `function` tools are supported".into(),
                    ));
                }
                if name.is_none_or(str::is_empty) {
                    return Err(err(
                        format!("tools[{i}].function.name"),
                        "a function tool needs a non-empty `name`".into(),
                    ));
                }
            }
        }
        self.tool_choice()
            .map_err(|(param, reason)| err(param, reason))?;
        if let Some(docs) = &self.documents {
            if let Some(i) = docs.iter().position(|d| !d.is_object()) {
                return Err(err(
                    format!("documents[{i}]"),
                    "a document must be an object".into(),
                ));
            }
        }
        let kwargs = self.chat_template_kwargs.unwrap_or_default();
        if let Some(k) = kwargs
            .keys()
            .find(|k| RESERVED_TEMPLATE_VARS.contains(&k.as_str()))
        {
            return Err(err(
                format!("chat_template_kwargs.{k}"),
                "is set by the request itself, not by template kwargs".into(),
            ));
        }
        let add_generation_prompt = self.add_generation_prompt.unwrap_or(true);
        let continue_final_message = self.continue_final_message.unwrap_or(false);
        if continue_final_message && add_generation_prompt {
            return Err(err(
                "continue_final_message".into(),
                "cannot be combined with add_generation_prompt = true (set it to false)".into(),
            ));
        }
        let truncate = match self.truncation.as_deref() {
            None | Some("disabled") => false,
            Some("auto") => true,
            Some(_) => {
                return Err(err(
                    "truncation".into(),
                    "must be `auto` or `disabled`".into(),
                ))
            }
        };
        Ok(ChatPrompt {
            messages,
            add_generation_prompt,
            continue_final_message,
            tools: self.tools,
            documents: self.documents,
            template_kwargs: kwargs,
            truncate,
        })
    }
}

/// Where a request's prompt comes from.
#[derive(Clone, Debug, PartialEq)]
pub enum PromptSource {
    /// Chat messages (`/v1/chat/completions`), rendered with the profile's template.
    Chat(ChatPrompt),
    /// Completion text (`/v1/completions`), tokenized as it is.
    Text(String),
    /// Completion token ids, used as they are.
    Tokens(Vec<u32>),
}

impl PromptSource {
    /// The request field the prompt came from (`messages` or `prompt`), for error messages.
    pub fn param(&self) -> &'static str {
        match self {
            PromptSource::Chat(_) => "messages",
            PromptSource::Text(_) | PromptSource::Tokens(_) => "prompt",
        }
    }

    /// A chat that asks to lose its oldest turns rather than be refused (`truncation: "auto"`):
    /// tokenizing it needs the token budget, whatever the caller's refusal policy.
    pub fn truncates(&self) -> bool {
        matches!(self, PromptSource::Chat(c) if c.truncate)
    }

    /// No messages, no text, no ids.
    pub fn is_empty(&self) -> bool {
        match self {
            PromptSource::Chat(c) => c.messages.is_empty(),
            PromptSource::Text(t) => t.is_empty(),
            PromptSource::Tokens(t) => t.is_empty(),
        }
    }
}

/// The `prompt` of a completion request as JSON carries it: a string, token ids, or a batch of
/// either (only a batch of one is served).
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(
    untagged,
    expecting = "a string, an array of token ids (0 to 4294967295), or an array of strings or of token-id arrays"
)]
pub enum CompletionPrompt {
    /// `"text"`.
    Text(String),
    /// `[1, 2, 3]`.
    Tokens(Vec<u32>),
    /// `["text", ...]`.
    TextBatch(Vec<String>),
    /// `[[1, 2], ...]`.
    TokenBatch(Vec<Vec<u32>>),
}

impl CompletionPrompt {
    /// The prompt source, or an error for a batch of more than one prompt or an empty prompt.
    pub fn into_source(self) -> Result<PromptSource> {
        let source = match self {
            CompletionPrompt::Text(t) => PromptSource::Text(t),
            CompletionPrompt::Tokens(t) => PromptSource::Tokens(t),
            CompletionPrompt::TextBatch(mut b) if b.len() == 1 => PromptSource::Text(b.remove(0)),
            CompletionPrompt::TokenBatch(mut b) if b.len() == 1 => {
                PromptSource::Tokens(b.remove(0))
            }
            CompletionPrompt::TextBatch(b) => {
                return Err(ProfileError::PromptBatch { len: b.len() })
            }
            CompletionPrompt::TokenBatch(b) => {
                return Err(ProfileError::PromptBatch { len: b.len() })
            }
        };
        if source.is_empty() {
            return Err(ProfileError::EmptyPrompt { param: "prompt" });
        }
        Ok(source)
    }
}

/// A prompt's token ids, and the text a chat was rendered to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PromptTokens {
    /// The chat template's output (`None` for completion text and ids).
    pub rendered: Option<String>,
    /// The token ids.
    pub ids: Vec<u32>,
}

impl PromptProfile {
    /// The token ids of a prompt (and a chat's rendered text), by the crate's one
    /// special-token policy (module docs). Errors are client errors
    /// ([`ProfileError::is_client_error`]) except tokenizer or template failures that come from
    /// the model files.
    pub fn tokenize_prompt(&self, source: &PromptSource) -> Result<PromptTokens> {
        let unbounded = TokenBudget {
            context_limit: usize::MAX,
            native_reserve: 0,
        };
        self.tokenize_within(source, unbounded, None)
    }

    /// [`Self::tokenize_prompt`]'s ids.
    pub fn prompt_ids(&self, source: &PromptSource) -> Result<Vec<u32>> {
        Ok(self.tokenize_prompt(source)?.ids)
    }

    /// A lower bound on the token count of `bytes` bytes of text, known without tokenizing:
    /// `⌈bytes / max token bytes⌉` when the tokenizer allows that bound (byte-level BPE: every
    /// token covers at most that many input bytes), else 0. O(1).
    pub fn tokens_floor(&self, bytes: usize) -> usize {
        self.inner
            .tokenizer
            .max_token_bytes
            .map_or(0, |l| bytes.div_ceil(l))
    }

    /// [`Self::tokenize_prompt`], refusing first — before tokenizing — a prompt whose token
    /// count provably breaks `budget`: the ids' count, or [`Self::tokens_floor`] of the
    /// completion text or of the *rendered* chat (rendering is O(text); the bound is taken on
    /// what the template actually produced, since templates may drop parts of messages). The
    /// refusal is the same `ContextLengthExceeded`, its `prompt_tokens` a lower bound. This
    /// bounds what a huge body costs to O(its bytes) without the tokenizer's per-token memory:
    /// what gateway and worker both do.
    pub fn tokenize_within(
        &self,
        source: &PromptSource,
        budget: TokenBudget,
        requested: Option<usize>,
    ) -> Result<PromptTokens> {
        let check = |at_least: usize| -> Result<()> {
            if at_least > budget.max_prompt_tokens(requested) {
                budget.output_tokens(at_least, requested, usize::MAX)?;
            }
            Ok(())
        };
        match source {
            PromptSource::Chat(chat) => {
                if chat.messages.is_empty() {
                    return Err(ProfileError::EmptyPrompt { param: "messages" });
                }
                let whole = self.chat_within(chat, &check, budget, requested);
                match whole {
                    Err(e @ ProfileError::ContextLengthExceeded { .. }) if chat.truncate => {
                        self.truncated(chat, &check, budget, requested).ok_or(e)
                    }
                    whole => whole,
                }
            }
            PromptSource::Text(t) => {
                check(self.tokens_floor(t.len()))?;
                let mut ids = self.encode_until(t, budget.max_prompt_tokens(requested))?;
                check(ids.len())?;
                if let (true, Some(bos)) = (self.add_bos_token(), self.bos_token_id()) {
                    ids.insert(0, bos);
                }
                Ok(PromptTokens {
                    rendered: None,
                    ids,
                })
            }
            PromptSource::Tokens(t) => {
                check(t.len())?;
                let vocab_size = self.vocab_size();
                if let Some((index, &id)) = t
                    .iter()
                    .enumerate()
                    .find(|(_, &id)| id as usize >= vocab_size)
                {
                    return Err(ProfileError::PromptTokenOutOfVocab {
                        index,
                        id,
                        vocab_size,
                    });
                }
                Ok(PromptTokens {
                    rendered: None,
                    ids: t.clone(),
                })
            }
        }
    }
}

impl PromptProfile {
    /// A chat prompt's tokens within `budget` (`check` refuses a count that breaks it).
    fn chat_within(
        &self,
        chat: &ChatPrompt,
        check: &dyn Fn(usize) -> Result<()>,
        budget: TokenBudget,
        requested: Option<usize>,
    ) -> Result<PromptTokens> {
        let text = self.render_chat(chat)?;
        check(self.tokens_floor(text.len()))?;
        let ids = self.encode_until(&text, budget.max_prompt_tokens(requested))?;
        check(ids.len())?;
        Ok(PromptTokens {
            rendered: Some(text),
            ids,
        })
    }

    /// `truncation: "auto"`: the conversation without its oldest turns, as few dropped as fit
    /// `budget`. The leading `system` / `developer` messages stay; a turn starts at a `user`
    /// message, so a cut never separates a tool call from its result; the last `user` message
    /// stays. `None` when even that does not fit (the caller's error stands). Fewer turns never
    /// make a longer prompt, so the first cut that fits is found by bisection: O(log turns)
    /// renderings.
    fn truncated(
        &self,
        chat: &ChatPrompt,
        check: &dyn Fn(usize) -> Result<()>,
        budget: TokenBudget,
        requested: Option<usize>,
    ) -> Option<PromptTokens> {
        let m = &chat.messages;
        let lead = m
            .iter()
            .take_while(|x| matches!(x.role.as_str(), "system" | "developer"))
            .count();
        // Cuts: drop messages lead..cut, for each later `user` message at `cut`.
        let cuts: Vec<usize> = (lead + 1..m.len())
            .filter(|&i| m[i].role == "user")
            .collect();
        let attempt = |cut: usize| {
            let mut shorter = chat.clone();
            shorter.messages = m[..lead].iter().chain(&m[cut..]).cloned().collect();
            self.chat_within(&shorter, check, budget, requested).ok()
        };
        let (mut lo, mut hi, mut best) = (0, cuts.len(), None);
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            match attempt(cuts[mid]) {
                Some(t) => {
                    best = Some(t);
                    hi = mid;
                }
                None => lo = mid + 1,
            }
        }
        best
    }
}

/// The most choices (`n`) one request may ask for. The worker refuses more (`400
/// invalid_value`); the gateway counts a request's output as `choices × max_tokens`
/// ([`choices`]), as the worker generates it: one sequence per choice.
pub const MAX_CHOICES: usize = 16;

/// The choices a body's `n` asks for, as the gateway counts them: `n` when it is an integer in
/// 1..=[`MAX_CHOICES`], else 1 (absent, or a value the worker refuses anyway).
pub fn choices(n: Option<&serde_json::Value>) -> usize {
    n.and_then(serde_json::Value::as_u64)
        .filter(|n| (1..=MAX_CHOICES as u64).contains(n))
        .map_or(1, |n| n as usize)
}

/// Whether a `/v1/completions` body asks for its prompt's log probabilities: `echo: true` with
/// `logprobs` (an integer). The worker then computes every prompt position — it reuses no
/// cached prefix, a reused position having no logits — and the gateway predicts no cached
/// tokens for it. Read leniently, as [`choices`] is: values the worker refuses count as not
/// asking.
pub fn scores_prompt(
    echo: Option<&serde_json::Value>,
    logprobs: Option<&serde_json::Value>,
) -> bool {
    echo.and_then(serde_json::Value::as_bool) == Some(true)
        && logprobs.and_then(serde_json::Value::as_u64).is_some()
}

/// The token budget of a served model: `prompt + output + native_reserve <= context_limit`,
/// else the request is refused (never silently truncated).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TokenBudget {
    /// Context length in tokens (prompt + output).
    pub context_limit: usize,
    /// Tokens kept free beyond prompt and output.
    pub native_reserve: usize,
}

impl TokenBudget {
    /// The output tokens of a request: `requested`, or (when the request names none) the
    /// remaining context capped at `default_cap`, at least 1. `Err(ContextLengthExceeded)` with
    /// the numbers when they do not fit. Whether a request fits never depends on `default_cap`
    /// (without a requested count, one output token must fit), so a gateway that does not know
    /// the worker's cap reaches the same verdict with any cap.
    pub fn output_tokens(
        &self,
        prompt_tokens: usize,
        requested: Option<usize>,
        default_cap: usize,
    ) -> Result<usize> {
        let remaining = self
            .context_limit
            .saturating_sub(prompt_tokens)
            .saturating_sub(self.native_reserve);
        let max_tokens = requested.unwrap_or_else(|| remaining.min(default_cap).max(1));
        let needed = prompt_tokens
            .saturating_add(max_tokens)
            .saturating_add(self.native_reserve);
        if needed > self.context_limit {
            return Err(ProfileError::ContextLengthExceeded {
                context_limit: self.context_limit,
                prompt_tokens,
                max_tokens,
                native_reserve: self.native_reserve,
                requested: requested.is_some(),
            });
        }
        Ok(max_tokens)
    }

    /// The most prompt tokens a request asking for `requested` output tokens (1 when `None`)
    /// can have and still fit: a tokenizer may stop counting once it passes this.
    pub fn max_prompt_tokens(&self, requested: Option<usize>) -> usize {
        self.context_limit
            .saturating_sub(self.native_reserve)
            .saturating_sub(requested.unwrap_or(1))
    }
}

/// Everything a block-key namespace folds in besides the salt: the profile identity's model
/// id, revision and hashes, the block size and the hash algorithm (docs/block-keys.md §1).
/// The gateway builds it from a pinned profile, the worker from its loaded profile; the
/// contract check makes the two equal.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeySpace {
    /// Model id.
    pub model_id: String,
    /// Model revision.
    pub revision: String,
    /// SHA-256 hex of the chat template.
    pub template_sha256: String,
    /// SHA-256 hex of the canonical tokenizer.
    pub tokenizer_sha256: String,
    /// Tokens per block.
    pub block_size: BlockSize,
    /// Hash algorithm of the chain.
    pub algorithm: HashAlgorithm,
}

impl KeySpace {
    /// The key space of a loaded profile.
    pub fn of(identity: &ProfileIdentity, block_size: BlockSize, algorithm: HashAlgorithm) -> Self {
        KeySpace {
            model_id: identity.model_id.clone(),
            revision: identity.revision.clone(),
            template_sha256: identity.template_sha256.clone(),
            tokenizer_sha256: identity.tokenizer_sha256.clone(),
            block_size,
            algorithm,
        }
    }

    /// The namespace seed for `salt` (no adapter).
    pub fn seed(&self, salt: Option<&str>) -> NamespaceSeed {
        NamespaceSeed::derive(&NamespaceInputs {
            model_id: &self.model_id,
            revision: &self.revision,
            template_sha256: &self.template_sha256,
            tokenizer_sha256: &self.tokenizer_sha256,
            block_size: self.block_size,
            algorithm: self.algorithm,
            salt,
            adapter: None,
        })
    }

    /// The key chain of a namespace seed in this key space.
    pub fn chain(&self, seed: NamespaceSeed) -> KeyChain {
        KeyChain::new(seed, self.algorithm, self.block_size)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_prompt_is_scored_only_with_echo_and_logprobs() {
        use serde_json::json;
        for (echo, logprobs, want) in [
            (Some(json!(true)), Some(json!(0)), true),
            (Some(json!(true)), Some(json!(5)), true),
            (Some(json!(true)), None, false),
            (Some(json!(true)), Some(json!(null)), false),
            (Some(json!(false)), Some(json!(5)), false),
            (None, Some(json!(5)), false),
            (Some(json!("yes")), Some(json!(5)), false),
            (Some(json!(true)), Some(json!(-1)), false),
        ] {
            assert_eq!(
                scores_prompt(echo.as_ref(), logprobs.as_ref()),
                want,
                "echo {echo:?}, logprobs {logprobs:?}"
            );
        }
    }

    #[test]
    fn tool_choice_is_checked_against_the_tools() {
        let fields = |tools: serde_json::Value, choice: serde_json::Value| ChatTemplateFields {
            tools: serde_json::from_value(tools).unwrap(),
            tool_choice: Some(choice),
            ..ChatTemplateFields::default()
        };
        let two = serde_json::json!([
            {"type": "function", "function": {"name": "a"}},
            {"type": "function", "function": {"name": "b"}}
        ]);
        let named = |n: &str| serde_json::json!({"type": "function", "function": {"name": n}});
        for (tools, choice, want) in [
            (two.clone(), serde_json::json!("none"), Ok(ToolChoice::None)),
            (two.clone(), serde_json::json!("auto"), Ok(ToolChoice::Auto)),
            (two.clone(), serde_json::Value::Null, Ok(ToolChoice::Auto)),
            (
                two.clone(),
                serde_json::json!("required"),
                Ok(ToolChoice::Required),
            ),
            (two.clone(), named("b"), Ok(ToolChoice::Function(1))),
            (two.clone(), named("c"), Err("tool_choice.function.name")),
            (
                two.clone(),
                serde_json::json!({"type": "function"}),
                Err("tool_choice.function.name"),
            ),
            (
                two.clone(),
                serde_json::json!({"type": "tool", "function": {"name": "a"}}),
                Err("tool_choice.type"),
            ),
            (
                two.clone(),
                serde_json::json!("sometimes"),
                Err("tool_choice"),
            ),
            (
                serde_json::Value::Null,
                serde_json::json!("required"),
                Err("tool_choice"),
            ),
            (
                serde_json::json!([]),
                named("a"),
                Err("tool_choice.function.name"),
            ),
        ] {
            let f = fields(tools, choice.clone());
            assert_eq!(
                f.tool_choice().map_err(|(p, _)| p),
                want.clone().map_err(str::to_string),
                "{choice}"
            );
            // The prompt contract refuses what `tool_choice` refuses, naming the same field.
            if let Err(p) = want {
                let e = f.prompt(Vec::new()).unwrap_err();
                assert_eq!((e.param.as_str(), e.unsupported), (p, false), "{choice}");
            }
        }
    }

    #[test]
    fn budget_reports_the_numbers_and_ignores_the_cap_for_the_verdict() {
        let b = TokenBudget {
            context_limit: 200,
            native_reserve: 10,
        };
        assert_eq!(b.output_tokens(100, Some(50), 1000).unwrap(), 50);
        assert_eq!(b.output_tokens(100, None, 1000).unwrap(), 90);
        assert_eq!(b.output_tokens(100, None, 16).unwrap(), 16);
        match b.output_tokens(100, Some(95), 1000).unwrap_err() {
            ProfileError::ContextLengthExceeded {
                context_limit: 200,
                prompt_tokens: 100,
                max_tokens: 95,
                native_reserve: 10,
                requested: true,
            } => {}
            other => panic!("{other:?}"),
        }
        let e = b.output_tokens(195, None, 1000).unwrap_err();
        assert_eq!(e.error_type(), "context_length_exceeded");
        assert!(e.is_client_error());
        // The verdict without a requested count is the same for every cap.
        for prompt in [0, 100, 189, 190, 191, 250] {
            let a = b.output_tokens(prompt, None, 1).is_ok();
            let c = b.output_tokens(prompt, None, usize::MAX).is_ok();
            assert_eq!(a, c, "prompt {prompt}");
            assert_eq!(a, prompt <= b.max_prompt_tokens(None), "prompt {prompt}");
        }
        assert_eq!(b.max_prompt_tokens(Some(50)), 140);
        assert!(b.output_tokens(140, Some(50), 1).is_ok());
        assert!(b.output_tokens(141, Some(50), 1).is_err());
    }

    #[test]
    fn completion_prompts_become_sources() {
        let p = |j: &str| {
            serde_json::from_str::<CompletionPrompt>(j)
                .unwrap()
                .into_source()
        };
        assert_eq!(p(r#""abc""#).unwrap(), PromptSource::Text("abc".into()));
        assert_eq!(p("[1,2,3]").unwrap(), PromptSource::Tokens(vec![1, 2, 3]));
        assert_eq!(p("[[4,5]]").unwrap(), PromptSource::Tokens(vec![4, 5]));
        assert_eq!(p(r#"["x"]"#).unwrap(), PromptSource::Text("x".into()));
        assert_eq!(
            p(r#"["a","b"]"#).unwrap_err().error_type(),
            "prompt_batch_not_supported"
        );
        assert_eq!(p(r#""""#).unwrap_err().error_type(), "empty_prompt");
        assert_eq!(p("[]").unwrap_err().error_type(), "empty_prompt");
        assert!(serde_json::from_str::<CompletionPrompt>("[-1]").is_err());
        assert!(serde_json::from_str::<CompletionPrompt>("{}").is_err());
    }
}
