//! routing-rules (skeleton; being written).
