//! prompt-profile (skeleton; being written).
