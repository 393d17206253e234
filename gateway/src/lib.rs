//! gateway (skeleton; being written).
