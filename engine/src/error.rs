//! The engine crate's one error enum. `error_type()` is the stable string used as the
//! OpenAI error `code` and as the metric label.

/// Every error the engine produces.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
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
    /// The step loop died; the engine serves nothing more.
    #[error("engine failed: {0}")]
    EngineFailed(String),
    #[error("invalid request: {0}")]
    InvalidRequest(String),
    /// Generated ids could not be turned into text (an id the tokenizer does not know).
    #[error("detokenization failed: {0}")]
    Detokenize(String),
}

impl EngineError {
    /// Stable machine-readable code (OpenAI `error.code`, metric label).
    pub fn error_type(&self) -> &'static str {
        match self {
            EngineError::Model(_) => "model_error",
            EngineError::Tensor(_) => "engine_error",
            EngineError::QueueFull { .. } => "queue_full",
            EngineError::NeverFits { .. } => "kv_capacity_exceeded",
            EngineError::AdmissionTimeout => "admission_timeout",
            EngineError::EngineStopped => "engine_stopped",
            EngineError::EngineFailed(_) => "engine_failed",
            EngineError::InvalidRequest(_) => "invalid_request",
            EngineError::Detokenize(_) => "detokenize_error",
        }
    }
}

impl From<candle_core::Error> for EngineError {
    fn from(e: candle_core::Error) -> Self {
        EngineError::Tensor(e.to_string())
    }
}
