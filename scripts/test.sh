#!/usr/bin/env bash
# Set everything up and run the whole test suite: formatting, lints, unit tests,
# integration tests (as root they exercise real namespaces, cgroups and mounts),
# then check that nothing of nestbox is left on the machine.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
if ! command -v cargo >/dev/null 2>&1; then export PATH="$HOME/.cargo/bin:$PATH"; fi

echo "== cargo fmt --check"
cargo fmt --all -- --check
echo "== cargo clippy"
cargo clippy --workspace --all-targets --quiet -- -D warnings
echo "== unit and integration tests"
# Timing-sensitive resource tests run alone in their own pass afterwards.
cargo test --workspace --quiet -- --skip serial_
cargo test --workspace --quiet -- serial_ --test-threads=1
echo "== leak check"
scripts/check-leaks.sh
