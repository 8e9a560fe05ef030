#!/usr/bin/env bash
# Run the E2B Python SDK's own test suite (packages/python-sdk/tests of the
# E2B repository) against `nestbox serve --http`: its sandbox lifecycle,
# commands, files and snapshot tests, sync and async.
#
#   scripts/e2b-sdk-suite.sh [E2B_CHECKOUT] [-- PYTEST_ARGS...]
#   scripts/e2b-sdk-suite.sh --prepare [E2B_CHECKOUT]   (only make the venv;
#                                                      scripts/setup.sh does)
#
# E2B_CHECKOUT is a clone (or a bare git directory) of github.com/e2b-dev/E2B;
# default /work/.mirror/e2b-dev+E2B/repo. Its tests are not part of this
# repository: they are copied from the checkout into a temporary directory
# for the run. The SDK version those tests are written for (the `version` of
# packages/python-sdk/pyproject.toml) is installed from PyPI, with pytest,
# into a private venv (E2B_SUITE_VENV, default
# /var/cache/nestbox/e2b-sdk-suite-VERSION), made on the first run.
#
# The server runs on a private root (/tmp/nestbox-test-e2bsuite.*) and a
# free loopback port, as root, with the binary NESTBOX_BIN (default
# target/debug/nestbox); everything it made is removed at the end (the bench
# helpers' nestbox_clean_root: boxes, network, root).
# The tests this server cannot pass are deselected, each with its reason
# below (the same list is in docs/e2b.md). Exit status: pytest's.
set -euo pipefail

prepare=
if [ "${1:-}" = "--prepare" ]; then prepare=1; shift; fi
checkout=/work/.mirror/e2b-dev+E2B/repo
if [ $# -gt 0 ] && [ "$1" != "--" ]; then checkout=$1; shift; fi
[ "${1:-}" = "--" ] && shift
here=$(cd "$(dirname "$0")/.." && pwd)
# The bench helpers: require_root, nestbox_clean_root, remove_tmpdir, log.
NESTBOX_BIN=${NESTBOX_BIN:-${NESTBOX:-$here/target/debug/nestbox}}
source "$here/bench/lib/common.sh"

if [ ! -d "$checkout" ]; then
  echo "e2b-sdk-suite: no E2B checkout at $checkout (give the path of a clone of github.com/e2b-dev/E2B)" >&2
  exit 2
fi

work=$(mktemp -d /tmp/e2b-sdk-suite-XXXXXX)
root=
server=
cleanup() {
  if [ -z "$root" ]; then
    rm -rf "$work"
    return
  fi
  if [ -n "$server" ]; then
    kill -TERM "$server" 2>/dev/null || true
    wait "$server" 2>/dev/null || true
  fi
  # The sandboxes stay after the server (for the next one): every box of the
  # root goes, then its network and the root itself.
  nestbox_clean_root "$root"
  remove_tmpdir "$root"
  rm -rf "$work"
}
trap cleanup EXIT

# The SDK's tests, pytest.ini and pyproject.toml, from the checkout.
sdk=packages/python-sdk
if [ -d "$checkout/$sdk/tests" ]; then
  mkdir -p "$work/$sdk"
  cp -r "$checkout/$sdk/tests" "$checkout/$sdk/pytest.ini" "$checkout/$sdk/pyproject.toml" "$work/$sdk/"
elif git --git-dir="$checkout" rev-parse --verify -q HEAD >/dev/null 2>&1; then
  git --git-dir="$checkout" archive HEAD "$sdk/tests" "$sdk/pytest.ini" "$sdk/pyproject.toml" | tar -x -C "$work"
else
  echo "e2b-sdk-suite: $checkout holds no $sdk/tests (not a checkout of github.com/e2b-dev/E2B?)" >&2
  exit 2
fi
version=$(sed -n 's/^version = "\(.*\)"/\1/p' "$work/$sdk/pyproject.toml" | head -1)
[ -n "$version" ] || { echo "e2b-sdk-suite: no version in $sdk/pyproject.toml" >&2; exit 2; }

venv=${E2B_SUITE_VENV:-/var/cache/nestbox/e2b-sdk-suite-$version}
if ! "$venv/bin/python" -c "from importlib.metadata import version; assert version('e2b') == '$version'; import pytest, pytest_asyncio, pytest_timeout" 2>/dev/null; then
  echo "e2b-sdk-suite: installing e2b==$version and pytest in $venv"
  rm -rf "$venv"
  mkdir -p "$(dirname "$venv")"
  python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet --disable-pip-version-check "e2b==$version" \
    'pytest>=9,<10' 'pytest-asyncio>=1.3,<2' 'pytest-timeout>=2.4,<3'
fi

[ -z "$prepare" ] || exit 0
[ -x "$NESTBOX" ] || die "no nestbox binary at $NESTBOX (cargo build -p nestbox, or set NESTBOX_BIN)"
require_root
root=$(make_tmpdir nestbox-test-e2bsuite)

# The sandbox lifecycle, commands, files and snapshot tests, sync and async.
tests=()
for flavour in sync async; do
  t=tests/$flavour
  s=$t/sandbox_$flavour
  tests+=("$t/api_$flavour" "$s/commands" "$s/files"
    "$s/test_create.py" "$s/test_kill.py" "$s/test_connect.py" "$s/test_timeout.py"
    "$s/test_fork.py" "$s/test_snapshot.py" "$s/test_snapshot_api.py"
    "$s/test_snapshot_filesystem_only.py")
done
tests+=(tests/sync/sandbox_sync/test_sync_client_lifecycle.py)

# Deselected: "file::test|reason" (for both flavours: sandbox_F is
# sandbox_sync and sandbox_async).
excluded=(
  "files/test_metadata.py|file metadata (user.e2b.* xattrs) is an envd 0.6.2 feature; nestbox announces envd 0.5.7"
  "files/test_watch.py::test_watch_directory_changes_with_entry_info|entry info in watch events is a newer envd feature than 0.5.7"
  "files/test_watch.py::test_watch_directory_changes_with_network_mounts_allowed|watching network mounts is a newer envd feature than 0.5.7"
  "commands/test_env_vars.py::test_bash_command_scoped_env_vars|runs sudo, which E2B's base image has and the host image of nestbox's base does not"
  "test_create.py::test_auto_pause_filesystem_only_reboots|a filesystem-only pause (autoPauseMemory false) is not offered; and boot_id is the host kernel's in every box"
  "test_snapshot_filesystem_only.py::test_pause_filesystem_only|a filesystem-only pause (keep_memory=False) is not offered; and boot_id is the host kernel's in every box"
  "test_create.py::test_auto_resume_wakes_on_http_request|needs the sandbox's public host (get_host: https://PORT-ID.DOMAIN), which nestbox does not serve"
)
deselect=()
for e in "${excluded[@]}"; do
  test=${e%%|*}
  for flavour in sync async; do
    file=tests/$flavour/sandbox_$flavour/${test%%::*}
    if [ "$test" = "${test%%::*}" ]; then
      deselect+=(--ignore "$file")
    else
      deselect+=(--deselect "$file::${test#*::}")
    fi
  done
done

port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
key=e2b_$(head -c 20 /dev/urandom | od -An -tx1 | tr -d ' \n')
"$NESTBOX" --root "$root" serve --socket "$root/api.sock" --http "127.0.0.1:$port" --api-key "$key" \
  </dev/null >"$work/serve.log" 2>&1 &
server=$!
for _ in $(seq 200); do
  (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null && break
  kill -0 "$server" 2>/dev/null || { cat "$work/serve.log" >&2; exit 1; }
  sleep 0.1
done

echo "e2b-sdk-suite: E2B SDK $version tests from $checkout against nestbox serve on 127.0.0.1:$port"
printf 'e2b-sdk-suite: deselected (both flavours): %s\n' "${excluded[@]%%|*}"
cd "$work/$sdk"
status=0
E2B_API_URL=http://127.0.0.1:$port E2B_SANDBOX_URL=http://127.0.0.1:$port E2B_API_KEY=$key \
  "$venv/bin/python" -m pytest -p no:cacheprovider -q -rfE "${deselect[@]}" "$@" "${tests[@]}" || status=$?
if [ "$status" != 0 ]; then
  echo "e2b-sdk-suite: server log (last 40 lines):"
  tail -40 "$work/serve.log"
fi
exit "$status"
