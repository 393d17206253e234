//! receipts (skeleton; being written).
