#!/usr/bin/env bash
# The whole test suite: installs what it needs, fetches the pinned model, runs every test.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
./scripts/setup.sh
# Model-backed tests share 2 cores; keep test threads modest so they don't starve each other.
export RUST_TEST_THREADS="${RUST_TEST_THREADS:-2}"
cargo test --workspace --all-targets --no-fail-fast
# Doc tests (not part of --all-targets)
cargo test --workspace --doc
