//! The Python the tests run (the official `openai` client, `cryptography`): `$KVGATE_PYTHON`,
//! else the project virtualenv `scripts/setup.sh` makes (`.venv/bin/python3`), else `python3`.
#![allow(dead_code)]

use std::path::PathBuf;

/// The interpreter to run.
pub fn python() -> PathBuf {
    if let Some(p) = std::env::var_os("KVGATE_PYTHON") {
        return PathBuf::from(p);
    }
    let venv = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(".venv/bin/python3");
    if venv.is_file() {
        return venv;
    }
    PathBuf::from("python3")
}
