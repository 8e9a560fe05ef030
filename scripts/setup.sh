#!/usr/bin/env bash
# One-time set-up for building and testing nestbox on a fresh Debian machine:
# installs the Debian packages the tests use (only those missing) and builds the
# release binary. Idempotent; needs root for apt-get.
set -euo pipefail
cd "$(dirname "$0")/.."

# The Rust toolchain comes from rustup on these machines; make sure it is on PATH.
if ! command -v cargo >/dev/null 2>&1 && [ -x "$HOME/.cargo/bin/cargo" ]; then
  export PATH="$HOME/.cargo/bin:$PATH"
fi
if ! command -v cargo >/dev/null 2>&1; then
  echo "setup: cargo (Rust >= 1.80) is required and was not found on PATH or in ~/.cargo/bin" >&2
  exit 1
fi

# Debian packages the test suite runs inside boxes or uses to check the host.
need=()
for pkg in python3 procps util-linux iproute2 ca-certificates busybox-static nftables; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || need+=("$pkg")
done
if [ "${#need[@]}" -gt 0 ]; then
  if [ "$(id -u)" -ne 0 ]; then
    echo "setup: missing Debian packages (${need[*]}); run as root to install them" >&2
    exit 1
  fi
  echo "setup: installing ${need[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi

echo "setup: building nestbox (release)"
cargo build --release --quiet
echo "setup: ready: $(pwd)/target/release/nestbox"
