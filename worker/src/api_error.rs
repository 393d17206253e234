//! [`ApiError`]: one HTTP error answer — status, stable `code`, OpenAI `type`, the offending
//! `param` — rendered as OpenAI's `{"error": {...}}` body. Every error path of the server goes
//! through here, so codes stay stable (they are also the `reason` label of the rejection metric).
//!
//! The codes are listed in `docs/worker-api.md`; tests pin them.

use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::Value;

use crate::protocol::{ErrorBody, ErrorObject};
use engine::EngineError;

/// One error answer.
#[derive(Clone, Debug)]
pub struct ApiError {
    pub status: StatusCode,
    /// Stable machine-readable code (`error.code`).
    pub code: &'static str,
    pub message: String,
    /// The request field at fault (`error.param`).
    pub param: Option<String>,
    /// Extra structured fields merged into the error object (boxed: errors travel in `Result`s
    /// on hot paths and stay small).
    pub details: Box<serde_json::Map<String, Value>>,
    /// Seconds for a `Retry-After` header (429 / 503).
    pub retry_after_s: Option<u64>,
}

impl From<prompt_profile::BodyError> for ApiError {
    /// A body the prompt contract refuses: 400 with its code and param (the gateway answers
    /// the same fault with the same ones).
    fn from(b: prompt_profile::BodyError) -> Self {
        ApiError::bad_request(b.code, b.param.as_deref(), b.message)
    }
}

impl ApiError {
    /// A new error with no param.
    pub fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        ApiError {
            status,
            code,
            message: message.into(),
            param: None,
            details: Box::default(),
            retry_after_s: None,
        }
    }

    /// 400 with the field at fault.
    pub fn bad_request(
        code: &'static str,
        param: Option<&str>,
        message: impl Into<String>,
    ) -> Self {
        ApiError::new(StatusCode::BAD_REQUEST, code, message).with_param(param)
    }

    /// Sets `param`.
    pub fn with_param(mut self, param: Option<&str>) -> Self {
        self.param = param.map(str::to_string);
        self
    }

    /// Adds a detail field.
    pub fn with_detail(mut self, key: &str, value: impl Into<Value>) -> Self {
        self.details.insert(key.to_string(), value.into());
        self
    }

    /// 401 for a route-ticket problem.
    pub fn unauthorized(code: &'static str, message: impl Into<String>) -> Self {
        ApiError::new(StatusCode::UNAUTHORIZED, code, message)
    }

    /// 404.
    pub fn not_found(code: &'static str, message: impl Into<String>) -> Self {
        ApiError::new(StatusCode::NOT_FOUND, code, message)
    }

    /// The OpenAI `type` for this status.
    pub fn kind(&self) -> &'static str {
        match self.status.as_u16() {
            401 => "authentication_error",
            404 => "not_found_error",
            429 => "rate_limit_error",
            400..=499 => "invalid_request_error",
            _ => "server_error",
        }
    }

    /// The JSON body.
    pub fn body(&self) -> ErrorBody {
        ErrorBody {
            error: ErrorObject {
                message: self.message.clone(),
                kind: self.kind().to_string(),
                param: self.param.clone(),
                code: self.code.to_string(),
                details: (*self.details).clone(),
            },
        }
    }

    /// The engine's refusal of a submission (or a `Failed` event before any token), mapped to
    /// an HTTP answer: overload → 429 with `Retry-After`, never-fits → 400, stopped → 503.
    pub fn from_engine(e: &EngineError, retry_after_s: u64) -> Self {
        let code = e.error_type();
        match e {
            EngineError::QueueFull { .. } | EngineError::AdmissionTimeout => {
                let mut err = ApiError::new(StatusCode::TOO_MANY_REQUESTS, code, e.to_string());
                err.retry_after_s = Some(retry_after_s);
                err
            }
            EngineError::NeverFits { needed, total } => {
                ApiError::bad_request(code, Some("max_tokens"), e.to_string())
                    .with_detail("blocks_needed", *needed)
                    .with_detail("blocks_total", *total)
            }
            EngineError::InvalidRequest(_) => ApiError::bad_request(code, None, e.to_string()),
            EngineError::EngineStopped | EngineError::EngineFailed(_) => {
                let mut err = ApiError::new(StatusCode::SERVICE_UNAVAILABLE, code, e.to_string());
                err.retry_after_s = Some(retry_after_s);
                err
            }
            _ => ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, code, e.to_string()),
        }
    }

    /// An engine `Failed { code }` event that arrived before any token.
    pub fn from_failed(code: &str, message: String, retry_after_s: u64) -> Self {
        let (status, code): (StatusCode, &'static str) = match code {
            "admission_timeout" => (StatusCode::TOO_MANY_REQUESTS, "admission_timeout"),
            "queue_full" => (StatusCode::TOO_MANY_REQUESTS, "queue_full"),
            "engine_stopped" => (StatusCode::SERVICE_UNAVAILABLE, "engine_stopped"),
            "engine_failed" => (StatusCode::SERVICE_UNAVAILABLE, "engine_failed"),
            "kv_capacity_exceeded" => (StatusCode::BAD_REQUEST, "kv_capacity_exceeded"),
            "invalid_request" => (StatusCode::BAD_REQUEST, "invalid_request"),
            _ => (StatusCode::INTERNAL_SERVER_ERROR, "engine_error"),
        };
        let mut err = ApiError::new(status, code, message);
        if matches!(status.as_u16(), 429 | 503) {
            err.retry_after_s = Some(retry_after_s);
        }
        err
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = serde_json::to_vec(&self.body()).unwrap_or_default();
        let mut resp = (
            self.status,
            [(
                axum::http::header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            )],
            body,
        )
            .into_response();
        if let Some(s) = self.retry_after_s {
            resp.headers_mut()
                .insert(axum::http::header::RETRY_AFTER, HeaderValue::from(s));
        }
        resp
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn engine_errors_map_to_stable_statuses() {
        let e = ApiError::from_engine(&EngineError::QueueFull { waiting: 3 }, 2);
        assert_eq!(e.status, StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(e.code, "queue_full");
        assert_eq!(e.retry_after_s, Some(2));
        assert_eq!(e.kind(), "rate_limit_error");
        let e = ApiError::from_engine(
            &EngineError::NeverFits {
                needed: 9,
                total: 4,
            },
            2,
        );
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
        assert_eq!(e.details["blocks_needed"], 9);
        let e = ApiError::from_failed("admission_timeout", "late".into(), 1);
        assert_eq!(e.status, StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(e.retry_after_s, Some(1));
        let e = ApiError::from_failed("whatever", "x".into(), 1);
        assert_eq!(e.status, StatusCode::INTERNAL_SERVER_ERROR);
        assert_eq!(e.code, "engine_error");
        assert_eq!(e.retry_after_s, None);
    }
}
