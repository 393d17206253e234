//! The one error type of the `gateway` crate, and its OpenAI-style rendering.
//!
//! Every variant maps to an HTTP status and a stable `error_type()` string. That string is the
//! `code` of the OpenAI error JSON a client receives, the `reason`/`code` label in metrics and
//! the `outcome.error` field of the decision log, so it never changes once published.

use serde::Serialize;

/// Everything that can go wrong in the gateway, on the request path or in its control plane.
#[derive(Debug, thiserror::Error)]
pub enum GatewayError {
    /// No service matches the request (listener/Host, path, `model`).
    #[error("no service matches {method} {path} (model {model:?})")]
    ServiceNotFound {
        /// Request method.
        method: String,
        /// Request path.
        path: String,
        /// The body's `model`, when it had one.
        model: Option<String>,
    },
    /// `GET /v1/models/{model}` names a model no service here lists.
    #[error("no service here serves the model {model:?}")]
    ModelNotFound {
        /// The model asked for.
        model: String,
    },
    /// The OpenAI API does not serve this method on this path.
    #[error("{method} is not allowed on {path} (allowed: {allowed})")]
    MethodNotAllowed {
        /// Request method.
        method: String,
        /// Request path.
        path: String,
        /// The method the path serves.
        allowed: &'static str,
    },
    /// The request body is larger than the service's limit.
    #[error("request body exceeds the limit of {limit} bytes")]
    BodyTooLarge {
        /// The limit in bytes.
        limit: usize,
    },
    /// `previous_response_id` names a response this gateway does not hold for the caller, or a
    /// conversation one of whose turns it no longer holds (deleted, expired, evicted).
    #[error("{}", previous_not_found(id, missing))]
    PreviousResponseNotFound {
        /// The id the request named.
        id: String,
        /// The turn that is missing (`id` itself, or an earlier turn of its conversation).
        missing: String,
    },
    /// `previous_response_id` names a background response (or a conversation holding one)
    /// that has no answer to continue: still running, failed or cancelled.
    #[error(
        "response {id} is {status}: only a completed (or incomplete) response can be continued"
    )]
    PreviousResponseNotReady {
        /// The turn that has no answer.
        id: String,
        /// Its status.
        status: String,
    },
    /// `POST /v1/responses/{id}/cancel` of a response not made with `background: true`.
    #[error("response {id} was not made with `background: true`: only a background response can be cancelled")]
    NotBackground {
        /// The id asked for.
        id: String,
    },
    /// A `background: true` request while the gateway runs as many background responses as
    /// it may.
    #[error("this gateway runs {limit} background responses already: try again later")]
    TooManyBackground {
        /// `--max-background-responses`.
        limit: usize,
    },
    /// `GET`/`DELETE /v1/responses/{id}`: no stored response of the caller has this id.
    #[error("no stored response with id {id:?}")]
    ResponseNotFound {
        /// The id asked for.
        id: String,
    },
    /// `POST /v1/responses/input_tokens` on a service that pins no prompt profile (round
    /// robin) and has no kvgate worker to count with.
    #[error(
        "service {service} pins no prompt profile and none of its workers counts input tokens \
         (kvgate workers do): counting needs one or the other"
    )]
    InputTokensUnavailable {
        /// The service matched.
        service: String,
    },
    /// A conversation continued with `previous_response_id` (or `conversation`) is larger than
    /// the service's `max_body_bytes`.
    #[error(
        "the conversation continued by {param} is {bytes} bytes, over the service's limit of \
         {limit}: start a new conversation, or send a shorter one in `input`"
    )]
    ConversationTooLarge {
        /// The field that named it.
        param: &'static str,
        /// Bytes of the continued request.
        bytes: usize,
        /// The service's `max_body_bytes`.
        limit: u64,
    },
    /// No conversation of the caller has this id (never made here, deleted, expired, evicted).
    #[error("no conversation with id {id:?}")]
    ConversationNotFound {
        /// The id asked for.
        id: String,
    },
    /// A conversation has no item with this id.
    #[error("conversation {conversation} has no item with id {id:?}")]
    ItemNotFound {
        /// The conversation.
        conversation: String,
        /// The item id asked for.
        id: String,
    },
    /// A change would make a conversation's record larger than one record may be.
    #[error(
        "conversation {id} would be {bytes} bytes, over the {limit} one conversation may hold: \
         start a new conversation"
    )]
    ConversationFull {
        /// The conversation.
        id: String,
        /// Its record's size after the change.
        bytes: usize,
        /// The most one record may take (`--response-store-mb` / 4, at most 16 MiB).
        limit: usize,
    },
    /// A conversation changed by other requests at each of its tries.
    #[error("conversation {id} is being changed by other requests: try again")]
    ConversationConflict {
        /// The conversation.
        id: String,
    },
    /// The Conversations API on a gateway that stores nothing (`--response-store-mb 0`).
    #[error("this gateway stores no conversations (--response-store-mb 0)")]
    ConversationsOff,
    /// The body is not the JSON a `kv_exact` service needs (or is not JSON at all).
    #[error("invalid request body: {reason}")]
    InvalidBody {
        /// What is wrong, naming the field when there is one.
        reason: String,
    },
    /// A KV-exact body the prompt contract refuses, answered with the code and param the
    /// worker gives the same fault (`prompt_profile::BodyError`: `invalid_json`,
    /// `invalid_type`, `missing_parameter`, `invalid_value`, `unsupported_parameter`, the
    /// template's own codes).
    #[error("{0}")]
    Body(prompt_profile::BodyError),
    /// Rendered prompt + requested output + reserve exceed the context limit.
    #[error(
        "this request needs {prompt_tokens} prompt tokens + {max_tokens} output tokens + \
         {reserve_tokens} reserved tokens, more than the context limit of {context_limit}"
    )]
    ContextLengthExceeded {
        /// The field at fault, as the worker names it: `max_tokens` when the request named its
        /// output count, else the prompt's field (`messages` or `prompt`).
        param: &'static str,
        /// Tokens of the rendered prompt.
        prompt_tokens: usize,
        /// Requested output tokens.
        max_tokens: usize,
        /// The worker's native reserve.
        reserve_tokens: usize,
        /// The profile's context limit.
        context_limit: usize,
    },
    /// The service's profile failed on a prompt for a reason of its own (its model files, not
    /// the request: a request the template or tokenizer refuses is a [`GatewayError::Body`]).
    #[error("cannot render or tokenize the prompt: {reason}")]
    Prompt {
        /// The profile crate's message.
        reason: String,
    },
    /// The gateway's own bounded work queue is full; retry shortly.
    #[error("the gateway is overloaded: {what}")]
    Overloaded {
        /// Which queue.
        what: &'static str,
    },
    /// No healthy worker is left for this request.
    #[error("no healthy worker available for service {service:?}")]
    NoHealthyWorker {
        /// The matched service.
        service: String,
    },
    /// Every candidate refused the connection.
    #[error("could not reach any worker of service {service:?}: {reason}")]
    UpstreamUnavailable {
        /// The matched service.
        service: String,
        /// The last connect error.
        reason: String,
    },
    /// The upstream failed after the request was sent (no retry: it may have been accepted).
    #[error("upstream worker {worker} failed: {reason}")]
    Upstream {
        /// The worker.
        worker: String,
        /// What happened.
        reason: String,
    },
    /// Admin plane: missing or wrong bearer token.
    #[error("missing or invalid bearer token")]
    Unauthorized,
    /// A service with `auth = "api_key"`: no `Authorization: Bearer` key, or one no tenant has.
    #[error("{reason}")]
    InvalidApiKey {
        /// What was wrong (never echoes the key).
        reason: &'static str,
    },
    /// The tenant's request or token rate is used up; retry after `retry_after_s`.
    #[error("rate limit of tenant {tenant:?} reached ({limit}); retry after {retry_after_s} s")]
    RateLimited {
        /// The tenant.
        tenant: String,
        /// `requests` or `tokens`.
        limit: &'static str,
        /// Whole seconds to wait (rounded up, at least 1), also sent as `Retry-After`.
        retry_after_s: u64,
    },
    /// Admin plane: unknown path or resource.
    #[error("not found: {what}")]
    NotFound {
        /// What was not found.
        what: String,
    },
    /// Admin plane: the rules change was refused (validation or contract); the old version stays.
    #[error("rules change refused: {reason}")]
    RulesRejected {
        /// Every problem, joined.
        reason: String,
    },
    /// Cluster mode: another replica changed the rules first (compare-and-set lost).
    #[error("the rules changed meanwhile: the cluster is at version {current}; re-read and retry")]
    RulesConflict {
        /// The cluster's current rules version.
        current: u64,
    },
    /// Cluster mode: the shared store cannot be reached, so a rules change cannot be made
    /// everywhere at once; serving goes on with the rules in force.
    #[error("the cluster store is unavailable: {reason}")]
    ClusterUnavailable {
        /// Why.
        reason: String,
    },
    /// A `kv_exact` pool's workers disagree with the service's pinned profile.
    #[error("contract check failed: {reason}")]
    Contract {
        /// The workers and fields that differ.
        reason: String,
    },
    /// Start-up or configuration problem (bad file, key, address).
    #[error("configuration: {reason}")]
    Config {
        /// What is wrong.
        reason: String,
    },
    /// Signing the route ticket or writing the decision log failed.
    #[error("internal error: {reason}")]
    Internal {
        /// What failed.
        reason: String,
    },
}

fn previous_not_found(id: &str, missing: &str) -> String {
    if id == missing {
        format!("previous response with id {id:?} not found (never stored here, deleted, expired or evicted)")
    } else {
        format!(
            "previous response with id {id:?} cannot be continued: {missing:?}, an earlier turn of \
             its conversation, is no longer stored (deleted, expired or evicted)"
        )
    }
}

impl GatewayError {
    /// A prompt-contract error on the request's prompt (`prompt_param`: `messages` or
    /// `prompt`), answered as the worker answers it: the request's fault is a
    /// [`GatewayError::Body`], a prompt over the context limit [`GatewayError::ContextLengthExceeded`]
    /// with the worker's param and numbers, anything else the profile's own failure.
    pub fn from_prompt(
        e: prompt_profile::ProfileError,
        prompt_param: &'static str,
    ) -> GatewayError {
        if let Some(b) = prompt_profile::BodyError::prompt(&e, prompt_param) {
            return GatewayError::Body(b);
        }
        match e {
            prompt_profile::ProfileError::ContextLengthExceeded {
                context_limit,
                prompt_tokens,
                max_tokens,
                native_reserve,
                requested,
            } => GatewayError::ContextLengthExceeded {
                param: prompt_profile::budget_param(requested, prompt_param),
                prompt_tokens,
                max_tokens,
                reserve_tokens: native_reserve,
                context_limit,
            },
            e => GatewayError::Prompt {
                reason: e.to_string(),
            },
        }
    }

    /// A stable snake_case name, used as the OpenAI error `code`, a metric label and in logs.
    pub fn error_type(&self) -> &'static str {
        match self {
            GatewayError::ServiceNotFound { .. } => "service_not_found",
            GatewayError::ModelNotFound { .. } => "model_not_found",
            GatewayError::MethodNotAllowed { .. } => "method_not_allowed",
            GatewayError::BodyTooLarge { .. } => "request_too_large",
            GatewayError::InvalidBody { .. } => "invalid_request_body",
            GatewayError::PreviousResponseNotFound { .. } => "previous_response_not_found",
            GatewayError::ResponseNotFound { .. } => "response_not_found",
            GatewayError::PreviousResponseNotReady { .. } => "previous_response_not_ready",
            GatewayError::NotBackground { .. } => "response_not_background",
            GatewayError::TooManyBackground { .. } => "too_many_background_responses",
            GatewayError::ConversationTooLarge { .. } | GatewayError::ConversationFull { .. } => {
                "conversation_too_large"
            }
            GatewayError::ConversationNotFound { .. } => "conversation_not_found",
            GatewayError::ItemNotFound { .. } => "item_not_found",
            GatewayError::ConversationConflict { .. } => "conversation_conflict",
            GatewayError::ConversationsOff => "conversations_unavailable",
            GatewayError::InputTokensUnavailable { .. } => "input_tokens_unavailable",
            GatewayError::Body(b) => b.code,
            GatewayError::ContextLengthExceeded { .. } => "context_length_exceeded",
            GatewayError::Prompt { .. } => "prompt_render_failed",
            GatewayError::NoHealthyWorker { .. } => "no_healthy_worker",
            GatewayError::Overloaded { .. } => "gateway_overloaded",
            GatewayError::UpstreamUnavailable { .. } => "upstream_unavailable",
            GatewayError::Upstream { .. } => "upstream_error",
            GatewayError::Unauthorized => "unauthorized",
            GatewayError::InvalidApiKey { .. } => "invalid_api_key",
            GatewayError::RateLimited { .. } => "rate_limit_exceeded",
            GatewayError::NotFound { .. } => "not_found",
            GatewayError::RulesRejected { .. } => "rules_rejected",
            GatewayError::Contract { .. } => "contract_mismatch",
            GatewayError::RulesConflict { .. } => "rules_conflict",
            GatewayError::ClusterUnavailable { .. } => "cluster_unavailable",
            GatewayError::Config { .. } => "config_error",
            GatewayError::Internal { .. } => "internal_error",
        }
    }

    /// The HTTP status a client gets for this error.
    pub fn status(&self) -> u16 {
        match self {
            GatewayError::ServiceNotFound { .. }
            | GatewayError::ModelNotFound { .. }
            | GatewayError::NotFound { .. }
            | GatewayError::ResponseNotFound { .. }
            | GatewayError::ConversationNotFound { .. }
            | GatewayError::ItemNotFound { .. } => 404,
            GatewayError::MethodNotAllowed { .. } => 405,
            GatewayError::BodyTooLarge { .. }
            | GatewayError::ConversationTooLarge { .. }
            | GatewayError::ConversationFull { .. } => 413,
            GatewayError::InvalidBody { .. }
            | GatewayError::PreviousResponseNotFound { .. }
            | GatewayError::PreviousResponseNotReady { .. }
            | GatewayError::NotBackground { .. }
            | GatewayError::InputTokensUnavailable { .. }
            | GatewayError::ConversationsOff
            | GatewayError::Body(_)
            | GatewayError::ContextLengthExceeded { .. }
            | GatewayError::RulesRejected { .. }
            | GatewayError::Contract { .. } => 400,
            GatewayError::Unauthorized | GatewayError::InvalidApiKey { .. } => 401,
            GatewayError::RulesConflict { .. } | GatewayError::ConversationConflict { .. } => 409,
            GatewayError::RateLimited { .. } | GatewayError::TooManyBackground { .. } => 429,
            GatewayError::NoHealthyWorker { .. }
            | GatewayError::UpstreamUnavailable { .. }
            | GatewayError::Overloaded { .. }
            | GatewayError::ClusterUnavailable { .. } => 503,
            GatewayError::Upstream { .. } => 502,
            GatewayError::Config { .. }
            | GatewayError::Prompt { .. }
            | GatewayError::Internal { .. } => 500,
        }
    }

    /// The OpenAI `type` field: `invalid_request_error` for 4xx, `server_error` otherwise.
    fn openai_type(&self) -> &'static str {
        match self.status() {
            401 => "authentication_error",
            429 => "rate_limit_error",
            400..=499 => "invalid_request_error",
            _ => "server_error",
        }
    }

    /// The parameter an error is about, when there is one (OpenAI's `param`).
    fn param(&self) -> Option<&str> {
        match self {
            GatewayError::Body(b) => b.param.as_deref(),
            GatewayError::ContextLengthExceeded { param, .. } => Some(param),
            GatewayError::PreviousResponseNotFound { .. }
            | GatewayError::PreviousResponseNotReady { .. } => Some("previous_response_id"),
            GatewayError::ConversationTooLarge { param, .. } => Some(param),
            GatewayError::ServiceNotFound { model: Some(_), .. }
            | GatewayError::ModelNotFound { .. } => Some("model"),
            _ => None,
        }
    }

    /// The OpenAI-style error body: `{"error":{"message","type","param","code"}}`.
    pub fn to_openai_json(&self) -> Vec<u8> {
        let budget = match self {
            GatewayError::ContextLengthExceeded {
                prompt_tokens,
                max_tokens,
                reserve_tokens,
                context_limit,
                ..
            } => Some(BudgetDetails {
                context_limit: *context_limit,
                prompt_tokens: *prompt_tokens,
                max_tokens: *max_tokens,
                native_reserve: *reserve_tokens,
            }),
            _ => None,
        };
        let body = OpenAiErrorBody {
            error: OpenAiError {
                message: self.to_string(),
                kind: self.openai_type(),
                param: self.param(),
                code: self.error_type(),
                budget,
            },
        };
        // Serializing a struct of strings cannot fail; fall back to a fixed body anyway.
        serde_json::to_vec(&body).unwrap_or_else(|_| {
            br#"{"error":{"message":"internal error","type":"server_error","param":null,"code":"internal_error"}}"#
                .to_vec()
        })
    }
}

#[derive(Serialize)]
struct OpenAiErrorBody<'a> {
    error: OpenAiError<'a>,
}

#[derive(Serialize)]
struct OpenAiError<'a> {
    message: String,
    #[serde(rename = "type")]
    kind: &'static str,
    param: Option<&'a str>,
    code: &'static str,
    /// `context_length_exceeded`'s numbers, the fields the worker's answer carries.
    #[serde(flatten, skip_serializing_if = "Option::is_none")]
    budget: Option<BudgetDetails>,
}

#[derive(Serialize)]
struct BudgetDetails {
    context_limit: usize,
    prompt_tokens: usize,
    max_tokens: usize,
    native_reserve: usize,
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn openai_error_json_is_pinned() {
        let e = GatewayError::ContextLengthExceeded {
            param: "messages",
            prompt_tokens: 10,
            max_tokens: 20,
            reserve_tokens: 4,
            context_limit: 30,
        };
        assert_eq!(e.status(), 400);
        let v: serde_json::Value = serde_json::from_slice(&e.to_openai_json()).unwrap();
        assert_eq!(v["error"]["code"], "context_length_exceeded");
        assert_eq!(v["error"]["type"], "invalid_request_error");
        assert_eq!(v["error"]["param"], "messages");
        assert_eq!(
            (
                &v["error"]["context_limit"],
                &v["error"]["prompt_tokens"],
                &v["error"]["max_tokens"],
                &v["error"]["native_reserve"]
            ),
            (&json!(30), &json!(10), &json!(20), &json!(4))
        );
        assert!(v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("context limit of 30"));
    }

    #[test]
    fn statuses_cover_the_stable_codes() {
        let cases: Vec<(GatewayError, u16, &str)> = vec![
            (
                GatewayError::BodyTooLarge { limit: 1 },
                413,
                "request_too_large",
            ),
            (GatewayError::Unauthorized, 401, "unauthorized"),
            (
                GatewayError::InvalidApiKey { reason: "x" },
                401,
                "invalid_api_key",
            ),
            (
                GatewayError::RateLimited {
                    tenant: "t".into(),
                    limit: "requests",
                    retry_after_s: 1,
                },
                429,
                "rate_limit_exceeded",
            ),
            (
                GatewayError::NoHealthyWorker {
                    service: "s".into(),
                },
                503,
                "no_healthy_worker",
            ),
            (
                GatewayError::ServiceNotFound {
                    method: "GET".into(),
                    path: "/x".into(),
                    model: None,
                },
                404,
                "service_not_found",
            ),
            (
                GatewayError::InvalidBody { reason: "x".into() },
                400,
                "invalid_request_body",
            ),
        ];
        for (e, status, code) in cases {
            assert_eq!(e.status(), status, "{e}");
            assert_eq!(e.error_type(), code);
        }
    }
}
