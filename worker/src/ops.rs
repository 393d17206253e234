//! Operations endpoints: `/health`, `/ready`, `GET /v1/models`, `GET /v1/profile`,
//! `POST /v1/tokenize`, `GET /metrics`, `GET /v1/keys`, `GET /v1/receipts/{request_id}`.
//! Shapes in `protocol.rs` and `docs/worker-api.md`.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use prompt_profile::{ChatTemplateFields, PromptSource};

use crate::api_error::ApiError;
use crate::protocol::{
    KeysBody, ModelCard, ModelList, ProfileBody, ReadyBody, TokenizeRequest, TokenizeResponse,
};
use crate::AppState;

/// `GET /health`: the process is up.
pub async fn health() -> Response {
    (StatusCode::OK, Json(serde_json::json!({"status": "ok"}))).into_response()
}

/// `GET /ready`: 200 once the start-up smoke inference produced a token and while the engine
/// serves; 503 with the reason otherwise (not yet ready, engine failed, draining, shutting
/// down).
pub async fn ready(State(st): State<Arc<AppState>>) -> Response {
    let engine = match st.engine.health() {
        engine::EngineHealth::Running => None,
        engine::EngineHealth::Stopped => Some("the engine is shut down".to_string()),
        engine::EngineHealth::Failed(msg) => Some(format!("the engine failed: {msg}")),
    };
    if let Some(reason) = engine {
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(ReadyBody {
                ready: false,
                reason: Some(reason),
            }),
        )
            .into_response();
    }
    if let Some(refusal) = crate::drain::ready_refusal(&st.drain) {
        return refusal;
    }
    if st.ready.load(Ordering::Acquire) {
        (
            StatusCode::OK,
            Json(ReadyBody {
                ready: true,
                reason: None,
            }),
        )
            .into_response()
    } else {
        let reason = st.ready_reason.lock().clone();
        (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(ReadyBody {
                ready: false,
                reason: Some(reason),
            }),
        )
            .into_response()
    }
}

/// `GET /v1/models`.
pub async fn models(State(st): State<Arc<AppState>>) -> Response {
    let created = st.started_at_ms / 1000;
    let mut names = st.settings.served_model_names.clone();
    if names.is_empty() {
        names.push(st.identity.model_id.clone());
    }
    let data = names
        .into_iter()
        .map(|id| ModelCard {
            id,
            object: "model".into(),
            created,
            owned_by: "kvgate".into(),
            context_limit: st.context_limit,
        })
        .collect();
    Json(ModelList {
        object: "list".into(),
        data,
    })
    .into_response()
}

/// The `/v1/profile` body.
pub fn profile_body(st: &AppState) -> ProfileBody {
    ProfileBody {
        worker_id: st.settings.worker_id.clone(),
        model_id: st.identity.model_id.clone(),
        revision: st.identity.revision.clone(),
        architecture: st.profile.architecture().map(str::to_string),
        template_sha256: st.identity.template_sha256.clone(),
        tokenizer_sha256: st.identity.tokenizer_sha256.clone(),
        profile_digest: st.profile_digest.clone(),
        eos_token_ids: st.identity.eos_token_ids.clone(),
        end_of_generation_ids: st.profile.end_of_generation_ids().to_vec(),
        context_limit: st.context_limit,
        native_reserve: st.settings.native_reserve,
        block_size: st.block_size.get(),
        hash_algorithm: st.settings.hash_algorithm,
        default_namespace_seed: st.tickets.default_namespace.to_hex(),
        engine: st.engine_kind.to_string(),
        numerics: st.numerics.map(str::to_string),
        require_ticket: st.settings.ticket_policy == crate::TicketPolicy::Require,
    }
}

/// `GET /v1/profile`.
pub async fn profile(State(st): State<Arc<AppState>>) -> Response {
    Json(profile_body(&st)).into_response()
}

/// `POST /v1/tokenize`: `{"messages": [...]}` (rendered with the template and the generation
/// prompt unless `add_generation_prompt` is false) or `{"prompt": "..."}`.
pub async fn tokenize(State(st): State<Arc<AppState>>, headers: HeaderMap, body: Body) -> Response {
    let _ = headers;
    let bytes = match axum::body::to_bytes(body, st.settings.max_body_bytes).await {
        Ok(b) => b,
        Err(_) => {
            return ApiError::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                "body_too_large",
                format!(
                    "request body exceeds the limit of {} bytes",
                    st.settings.max_body_bytes
                ),
            )
            .into_response()
        }
    };
    let req: TokenizeRequest = match serde_json::from_slice::<serde_json::Value>(&bytes) {
        Err(e) => {
            return ApiError::bad_request("invalid_json", None, format!("invalid JSON: {e}"))
                .into_response()
        }
        Ok(v) => match serde_path_to_error::deserialize(v) {
            Ok(r) => r,
            Err(e) => {
                let p = e.path().to_string();
                return ApiError::bad_request("invalid_type", Some(&p), e.into_inner().to_string())
                    .into_response();
            }
        },
    };
    let profile = st.profile.clone();
    let chain = st.key_space.chain(st.tickets.default_namespace);
    let context_limit = st.context_limit;
    let job = move || -> Result<TokenizeResponse, ApiError> {
        let source = match (req.messages, req.prompt) {
            (Some(messages), None) => {
                let fields = ChatTemplateFields {
                    tools: req.tools,
                    tool_choice: req.tool_choice,
                    documents: req.documents,
                    chat_template_kwargs: req.chat_template_kwargs,
                    add_generation_prompt: req.add_generation_prompt,
                    continue_final_message: req.continue_final_message,
                    truncation: None,
                };
                PromptSource::Chat(
                    fields
                        .prompt(messages)
                        .map_err(crate::validate::field_error)?,
                )
            }
            (None, Some(p)) => PromptSource::Text(p),
            _ => {
                return Err(ApiError::bad_request(
                    "invalid_value",
                    Some("messages"),
                    "give exactly one of `messages` or `prompt`",
                ))
            }
        };
        let tokenized = profile
            .tokenize_prompt(&source)
            .map_err(|e| crate::validate::prompt_error(&e, source.param()))?;
        let tokens = tokenized.ids;
        let prompt = match (tokenized.rendered, source) {
            (Some(text), _) | (None, PromptSource::Text(text)) => text,
            (None, _) => String::new(),
        };
        Ok(TokenizeResponse {
            count: tokens.len(),
            block_keys: chain.keys(&tokens),
            prompt,
            tokens,
            context_limit,
        })
    };
    match tokio::task::spawn_blocking(job).await {
        Ok(Ok(r)) => Json(r).into_response(),
        Ok(Err(e)) => e.into_response(),
        Err(e) => ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal_error",
            e.to_string(),
        )
        .into_response(),
    }
}

/// `GET /metrics`: OpenMetrics or classic Prometheus text, by `Accept`.
pub async fn metrics(State(st): State<Arc<AppState>>, headers: HeaderMap) -> Response {
    render_metrics(&st.registry, &headers)
}

/// `registry` in the exposition format `headers` ask for.
pub(crate) fn render_metrics(
    registry: &prometheus_client::registry::Registry,
    headers: &HeaderMap,
) -> Response {
    let accept = headers
        .get(axum::http::header::ACCEPT)
        .and_then(|v| v.to_str().ok());
    let format = exposition::Format::negotiate(accept);
    match exposition::render(registry, format) {
        Ok(text) => (
            StatusCode::OK,
            [(axum::http::header::CONTENT_TYPE, format.content_type())],
            text,
        )
            .into_response(),
        Err(_) => ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal_error",
            "metrics encoding failed",
        )
        .into_response(),
    }
}

/// `GET /v1/keys`.
pub async fn keys(State(st): State<Arc<AppState>>) -> Response {
    keys_body(&st.key, &st.settings.worker_id)
}

/// The `GET /v1/keys` answer of the worker (or sidecar) `worker_id` signing with `key`.
pub(crate) fn keys_body(key: &receipts::KeyPair, worker_id: &str) -> Response {
    let public = key.public();
    let pem = match public.to_pem() {
        Ok(p) => p,
        Err(e) => {
            return ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "internal_error",
                e.to_string(),
            )
            .into_response()
        }
    };
    Json(KeysBody {
        worker_id: worker_id.to_string(),
        key_id: key.key_id().to_string(),
        public_key_pem: pem,
        public_key_hex: hex::encode(public.to_bytes()),
    })
    .into_response()
}

/// `GET /v1/receipts/{request_id}`: the latest receipt of that request, exactly the signed line
/// of the log.
pub async fn receipt(State(st): State<Arc<AppState>>, Path(id): Path<String>) -> Response {
    receipt_line(st.receipts.clone(), id).await
}

/// The latest receipt of request `id` in `log`, as its signed line (404 `receipt_not_found`).
pub(crate) async fn receipt_line(log: Arc<receipts::ReceiptLog>, id: String) -> Response {
    let id2 = id.clone();
    let found = tokio::task::spawn_blocking(move || {
        let r = log.get(&id2)?;
        r.map(|r| r.to_line()).transpose()
    })
    .await;
    match found {
        Ok(Ok(Some(line))) => (
            StatusCode::OK,
            [(axum::http::header::CONTENT_TYPE, "application/json")],
            line,
        )
            .into_response(),
        Ok(Ok(None)) => ApiError::not_found(
            "receipt_not_found",
            format!("no receipt for request `{id}` in this worker's log"),
        )
        .into_response(),
        Ok(Err(e)) => ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            e.error_type(),
            e.to_string(),
        )
        .into_response(),
        Err(e) => ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal_error",
            e.to_string(),
        )
        .into_response(),
    }
}
