//! Shared fixtures for the integration tests.
#![allow(dead_code)]

use std::path::PathBuf;

/// A valid rules file used as the base of most tests.
pub const BASE: &str = r#"
[[workers]]
id = "w1"
url = "http://127.0.0.1:8101"

[[workers]]
id = "w2"
url = "http://127.0.0.1:8102"

[[pools]]
id = "local"
workers = ["w1", "w2"]

[[profiles]]
id = "smol"
model_id = "m"
revision = "r"
source = { gguf = "models/x.gguf" }
template_sha256 = "1111111111111111111111111111111111111111111111111111111111111111"
tokenizer_sha256 = "2222222222222222222222222222222222222222222222222222222222222222"
block_size = 16
context_limit = 8192

[[services]]
name = "chat-rr"
pool = "local"
match = { models = ["rr"] }
rule = { type = "round_robin" }

[[services]]
name = "chat"
pool = "local"
match = { models = ["exact"] }
rule = { type = "kv_exact", profile = "smol" }
"#;

/// The workspace root (parent of this crate).
pub fn workspace_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(PathBuf::from)
        .unwrap_or_default()
}
