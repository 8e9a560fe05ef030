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
  echo "setup: cargo (Rust >= 1.85, the workspace's rust-version) is required and was not found on PATH or in ~/.cargo/bin" >&2
  exit 1
fi

# Debian packages the test suite runs inside boxes or uses to check the host;
# e2fsprogs formats the image of a box's `--disk` layer (mkfs.ext4); gdb is what
# `nestbox debug` runs.
need=()
for pkg in python3 procps util-linux iproute2 ca-certificates busybox-static nftables iptables e2fsprogs gdb; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || need+=("$pkg")
done
# Programs the clone tests of real multi-threaded servers run (crates/nestbox/tests/
# clone_apps.rs), looked for where those tests look: the box sees the host's /usr.
[ -x /usr/bin/node ] || need+=(nodejs)
# npm installs the E2B JavaScript SDK below.
command -v npm >/dev/null 2>&1 || need+=(npm)
# The venv of the E2B SDK's own tests (scripts/e2b-sdk-suite.sh), for a
# python3 that has no venv module of its own (Debian's).
python3 -c 'import ensurepip, venv' 2>/dev/null || need+=(python3-venv)
[ -x /usr/bin/java ] || need+=(default-jdk-headless)
[ -x /usr/local/go/bin/go ] || command -v go >/dev/null 2>&1 || need+=(golang-go)
# podman drives nestbox-runc in crates/nestbox-oci/tests/podman.rs (netavark: its
# network backend, which it looks for at start even with --network none).
command -v podman >/dev/null 2>&1 || need+=(podman netavark)
# podman's `container checkpoint/restore` asks criu for its version before it
# calls the runtime (nestbox-runc never runs criu; docs/oci.md).
[ -x /usr/sbin/criu ] || command -v criu >/dev/null 2>&1 || need+=(criu)
# containerd (with its runc shim) drives nestbox-runc in crates/nestbox-oci/tests/containerd.rs.
command -v containerd-shim-runc-v2 >/dev/null 2>&1 || need+=(containerd)
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

# The E2B Python SDK, which the tests of `nestbox serve --http` (crates/nestbox/
# tests/e2b.rs) and bench/e2b.sh drive, for the python3 on PATH. Pinned: the
# API is checked against this version's generated client (docs/e2b.md).
E2B_SDK_VERSION=2.63.0
if ! python3 -c "import e2b, sys; from importlib.metadata import version; sys.exit(version('e2b') != '$E2B_SDK_VERSION')" 2>/dev/null; then
  echo "setup: installing the e2b Python SDK $E2B_SDK_VERSION"
  python3 -m pip --version >/dev/null 2>&1 || python3 -m ensurepip --upgrade >/dev/null 2>&1 || {
    echo "setup: python3 has no pip (apt-get install python3-pip)" >&2
    exit 1
  }
  # Debian's own python3 refuses system-wide installs without this flag.
  extra=()
  python3 -m pip install --help 2>/dev/null | grep -q -- --break-system-packages && extra+=(--break-system-packages)
  python3 -m pip install --quiet --disable-pip-version-check "${extra[@]}" "e2b==$E2B_SDK_VERSION"
fi

# The E2B JavaScript SDK, for the smoke test of the same API from Node.js
# (e2b_js_sdk_smoke in crates/nestbox/tests/e2b.rs, which looks for it here).
E2B_JS_VERSION=2.51.0
E2B_JS_DIR=/opt/nestbox/e2b-js
if ! grep -qs "\"version\": \"$E2B_JS_VERSION\"" "$E2B_JS_DIR/node_modules/e2b/package.json"; then
  echo "setup: installing the e2b npm package $E2B_JS_VERSION in $E2B_JS_DIR"
  command -v npm >/dev/null 2>&1 || {
    echo "setup: npm is missing (apt-get install npm)" >&2
    exit 1
  }
  mkdir -p "$E2B_JS_DIR"
  npm install --silent --no-audit --no-fund --prefix "$E2B_JS_DIR" "e2b@$E2B_JS_VERSION"
fi

# The private venv of the E2B SDK's own test suite (the SDK version its tests
# are written for, from PyPI), when the E2B checkout it reads is here.
E2B_CHECKOUT=${E2B_CHECKOUT:-/work/.mirror/e2b-dev+E2B/repo}
if [ -d "$E2B_CHECKOUT" ] && [ "$(id -u)" -eq 0 ]; then
  scripts/e2b-sdk-suite.sh --prepare "$E2B_CHECKOUT"
fi

echo "setup: building nestbox (release, statically linked)"
# The binary is linked statically: with no shared libraries to load it starts
# about 0.5 ms sooner (measured: docs/benchmarks.md), it runs in any image
# (nestbox inside a box), and a clone's init may take a fresh image of it in
# the box (docs/clones.md). It is not position-independent: a static-pie
# binary relocates 120 KiB of pointers at every start, private memory each
# box's monitor and init would pay again. Cargo would apply RUSTFLAGS to
# proc-macros too unless a target is named, so it is built for the host's
# triple and installed where `cargo build --release` puts it (a plain
# `cargo build --release` still works and gives a dynamically linked binary).
host=$(rustc -vV | sed -n 's/^host: //p')
RUSTFLAGS="-C target-feature=+crt-static -C relocation-model=static" cargo build --release --quiet --target "$host" -p nestbox
mkdir -p target/release
install -m 0755 "target/$host/release/nestbox" target/release/nestbox.new
mv -f target/release/nestbox.new target/release/nestbox
echo "setup: ready: $(pwd)/target/release/nestbox"
