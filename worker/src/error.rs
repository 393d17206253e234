//! The worker crate's one error enum: what can stop a worker from starting or serving.
//! `error_type()` is the stable string used as a metric label and in logs.

use engine::EngineError;

/// Every error the worker crate produces outside a request's own answer (those are
/// [`crate::ApiError`]s).
#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    /// The engine refused or failed (model load, configuration).
    #[error(transparent)]
    Engine(#[from] EngineError),
    /// A worker server could not start (profile, receipt log, listener, smoke inference).
    #[error("worker start-up failed ({what}): {detail}")]
    Startup { what: &'static str, detail: String },
}

impl WorkerError {
    /// Stable machine-readable code.
    pub fn error_type(&self) -> &'static str {
        match self {
            WorkerError::Engine(e) => e.error_type(),
            WorkerError::Startup { .. } => "startup_error",
        }
    }
}
