//! The one error type of the `prefix-index` crate.
//!
//! Every variant carries the offending value; [`IndexError::error_type`] gives a stable
//! snake_case string for metric labels and API error codes.

/// Everything that can go wrong in `prefix-index`. No function of this crate panics on input
/// that came from a client, a worker or a file: it returns one of these instead.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IndexError {
    /// A block size outside `1..=1024`.
    #[error("invalid block size {value}: must be within 1..=1024")]
    InvalidBlockSize {
        /// The rejected value.
        value: u64,
    },
    /// A hash algorithm name other than `xxh3` or `sha256`.
    #[error("unknown hash algorithm {name:?}: expected \"xxh3\" or \"sha256\"")]
    UnknownAlgorithm {
        /// The rejected name.
        name: String,
    },
    /// A hex string (block key or namespace seed) of the wrong length or with non-hex characters.
    #[error("invalid {what}: {reason}")]
    InvalidHex {
        /// What was being parsed (`block key`, `namespace seed`).
        what: &'static str,
        /// Why it was rejected.
        reason: String,
    },
    /// A block handed to [`crate::KeyChain::next`] whose length is not the chain's block size.
    #[error("block of {got} tokens, but the chain's block size is {expected}")]
    BlockLength {
        /// The chain's block size.
        expected: usize,
        /// The length of the block given.
        got: usize,
    },
    /// An operation on a worker the index does not know (never added, or removed).
    #[error("unknown worker {worker:?}")]
    UnknownWorker {
        /// The worker's id.
        worker: String,
    },
    /// An invalid [`crate::IndexConfig`] value.
    #[error("invalid index config: {reason}")]
    InvalidConfig {
        /// What is wrong.
        reason: String,
    },
}

impl IndexError {
    /// A stable, snake_case name of the error kind, for metric labels and error codes.
    pub fn error_type(&self) -> &'static str {
        match self {
            IndexError::InvalidBlockSize { .. } => "invalid_block_size",
            IndexError::UnknownAlgorithm { .. } => "unknown_hash_algorithm",
            IndexError::InvalidHex { .. } => "invalid_hex",
            IndexError::BlockLength { .. } => "block_length_mismatch",
            IndexError::UnknownWorker { .. } => "unknown_worker",
            IndexError::InvalidConfig { .. } => "invalid_config",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_types_are_stable_and_distinct() {
        let all = [
            IndexError::InvalidBlockSize { value: 0 },
            IndexError::UnknownAlgorithm { name: "md5".into() },
            IndexError::InvalidHex {
                what: "block key",
                reason: "x".into(),
            },
            IndexError::BlockLength {
                expected: 16,
                got: 3,
            },
            IndexError::UnknownWorker { worker: "w".into() },
            IndexError::InvalidConfig { reason: "r".into() },
        ];
        let names: Vec<&str> = all.iter().map(IndexError::error_type).collect();
        assert_eq!(
            names,
            [
                "invalid_block_size",
                "unknown_hash_algorithm",
                "invalid_hex",
                "block_length_mismatch",
                "unknown_worker",
                "invalid_config"
            ]
        );
        assert_eq!(
            IndexError::InvalidBlockSize { value: 2000 }.to_string(),
            "invalid block size 2000: must be within 1..=1024"
        );
    }
}
