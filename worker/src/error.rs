//! The worker crate's one error enum. `error_type()` is the stable string used as the
//! OpenAI error `code` and as the metric label.

/// Every error the worker crate produces.
#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    #[error("model file error: {0}")]
    Model(String),
    #[error("tensor error: {0}")]
    Tensor(String),
    #[error("waiting queue is full ({waiting} waiting)")]
    QueueFull { waiting: usize },
    #[error("request needs {needed} KV blocks but the cache has {total}")]
    NeverFits { needed: usize, total: usize },
    #[error("admission deadline passed before KV blocks were free")]
    AdmissionTimeout,
    #[error("engine is shut down")]
    EngineStopped,
    #[error("invalid request: {0}")]
    InvalidRequest(String),
    /// A worker server could not start (profile, receipt log, listener, smoke inference).
    #[error("worker start-up failed ({what}): {detail}")]
    Startup { what: &'static str, detail: String },
}

impl WorkerError {
    /// Stable machine-readable code (OpenAI `error.code`, metric label).
    pub fn error_type(&self) -> &'static str {
        match self {
            WorkerError::Model(_) => "model_error",
            WorkerError::Tensor(_) => "engine_error",
            WorkerError::QueueFull { .. } => "queue_full",
            WorkerError::NeverFits { .. } => "kv_capacity_exceeded",
            WorkerError::AdmissionTimeout => "admission_timeout",
            WorkerError::EngineStopped => "engine_stopped",
            WorkerError::InvalidRequest(_) => "invalid_request",
            WorkerError::Startup { .. } => "startup_error",
        }
    }
}

impl From<candle_core::Error> for WorkerError {
    fn from(e: candle_core::Error) -> Self {
        WorkerError::Tensor(e.to_string())
    }
}
