#!/usr/bin/env bash
# Run the OCI runtime-tools validation suite (opencontainers/runtime-tools,
# its validation/*/*.t executables, as `make localvalidation` runs them)
# against nestbox-runc and, in the same run, against runc, and print one line
# per executable: its result with each runtime.
#
# Usage: scripts/oci-validation.sh [NAME...]       (default: every executable)
#
# Environment:
#   RUNTIME_TOOLS_SRC  a runtime-tools source tree to build (e.g. a checkout at
#                      its head). Without it the module is taken from the Go
#                      module proxy (`go mod download`), which serves tagged
#                      versions only: v0.9.0 today, which has no go.mod and does
#                      not build with today's dependencies (the script then
#                      says so and stops), so in practice this is needed.
#   NESTBOX_RUNC       the binary under test (default: target/release/nestbox-runc,
#                      built here if missing).
#   RUNC               the comparison runtime (default: runc on PATH; Debian's
#                      runc package is installed when missing). RUNC=none skips it.
#   OUT                where the table goes (default: target/oci-validation.txt).
#   TEST_TIMEOUT       seconds one executable may run (default 120).
#
# Needs root. Installs Go (Debian's golang) and runc when they are missing.
# Every executable runs in a fresh directory with its own runtime root; after
# each one the script removes what it may leak: containers still in the
# runtime's root, mounts that appeared in the host's mount table (one test
# mounts /proc, /dev and /sys on the host when its runtime lets it run without
# a mount namespace), cgroup directories it created, and its /tmp/ocitest*
# bundles.
set -uo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
[ "$(id -u)" = 0 ] || { echo "oci-validation: needs root" >&2; exit 1; }

export PATH="$PATH:/usr/local/go/bin:/root/go/bin"
if ! command -v go >/dev/null; then
  apt-get install -y -qq golang >/dev/null || { apt-get update -qq && apt-get install -y -qq golang >/dev/null; } \
    || { echo "oci-validation: cannot install Go (apt golang)" >&2; exit 1; }
fi
RUNC=${RUNC:-$(command -v runc || true)}
if [ -z "$RUNC" ]; then
  apt-get install -y -qq runc >/dev/null || { apt-get update -qq && apt-get install -y -qq runc >/dev/null; }
  RUNC=$(command -v runc) || { echo "oci-validation: cannot install runc" >&2; exit 1; }
fi
NESTBOX_RUNC=${NESTBOX_RUNC:-$repo/target/release/nestbox-runc}
if [ ! -x "$NESTBOX_RUNC" ]; then
  cargo build --release -p nestbox-oci --bin nestbox-runc >/dev/null || exit 1
fi
OUT=${OUT:-$repo/target/oci-validation.txt}
TEST_TIMEOUT=${TEST_TIMEOUT:-120}

# The suite's sources.
work=/var/tmp/nestbox-oci-validation
mkdir -p "$work"
if [ -n "${RUNTIME_TOOLS_SRC:-}" ]; then
  src=$RUNTIME_TOOLS_SRC
else
  dir=$(cd "$work" && GOFLAGS=-mod=mod go mod download -json github.com/opencontainers/runtime-tools@latest \
        | sed -n 's/^\t"Dir": "\(.*\)",$/\1/p')
  [ -n "$dir" ] || { echo "oci-validation: go mod download of runtime-tools failed" >&2; exit 1; }
  if [ ! -f "$dir/go.mod" ]; then
    echo "oci-validation: the Go module proxy serves runtime-tools ${dir##*@}, which predates Go modules and does not build with today's dependencies; give a checkout of its head with RUNTIME_TOOLS_SRC=DIR" >&2
    exit 1
  fi
  src=$work/src-$(basename "$dir")
  [ -d "$src" ] || { cp -r "$dir" "$src" && chmod -R u+w "$src"; }
fi
# Build runtimetest and the executables (once; make skips nothing, so check).
(
  cd "$src" || exit 1
  flags=()
  [ -d vendor ] && flags=(-mod=vendor)
  [ -x runtimetest ] || CGO_ENABLED=1 go build "${flags[@]}" -tags "netgo osusergo" \
      -ldflags "-extldflags -static" -o runtimetest ./cmd/runtimetest || exit 1
  for g in $(find ./validation -name '*.go' | grep -v util | sort); do
    t=${g%.go}.t
    [ -x "$t" ] || go build "${flags[@]}" -o "$t" "$g" || exit 1
  done
) || { echo "oci-validation: building the suite failed" >&2; exit 1; }

tests=()
if [ $# -gt 0 ]; then
  for n in "$@"; do tests+=("$(find "$src/validation" -name "$n.t" | head -1)"); done
else
  mapfile -t tests < <(find "$src/validation" -name '*.t' | sort)
fi

cgroup_dirs() { find /sys/fs/cgroup -mindepth 1 -type d 2>/dev/null | sort; }
mount_ids() { awk '{print $1" "$5}' /proc/self/mountinfo | sort; }

# Remove what one executable may have left; $1 is its runtime, $2 its root.
clean_up() {
  local rt=$1 root=$2 before_mounts=$3 before_cgroups=$4 id
  for id in $("$rt" --root "$root" list -q 2>/dev/null); do
    "$rt" --root "$root" delete --force "$id" >/dev/null 2>&1
  done
  # New mounts the suite leaves on the host (a runtime without a mount
  # namespace mounts /proc, /dev and /sys there), and any below this run's
  # directories, deepest first. Only those: other programs on this machine
  # mount things meanwhile, and they are not ours to touch.
  comm -13 "$before_mounts" <(mount_ids) | awk '{print $2}' |
    grep -E '^/(proc|sys|dev)(/|$)|^/tmp/(oci-validation-run-|ocitest)' | sort -r |
    while read -r mp; do
      umount -l "$mp" 2>/dev/null
    done
  # New cgroups of the suite's own (its cgroupsPath values hold
  # "cgrouptest"): kill what is in them, then remove them, deepest first.
  # Never another cgroup: other sessions' processes and boxes are in theirs.
  comm -13 "$before_cgroups" <(cgroup_dirs) | grep 'cgrouptest' | sort -r | while read -r cg; do
    for p in $(cat "$cg/cgroup.procs" 2>/dev/null); do kill -9 "$p" 2>/dev/null; done
    for _ in 1 2 3 4 5; do rmdir "$cg" 2>/dev/null && break; sleep 0.1; done
  done
  rm -rf /tmp/ocitest* 2>/dev/null
  rm -rf "$root"
}

# Run executable $1 with runtime $2; prints pass, fail or timeout.
run_one() {
  local t=$1 rt=$2 dir root wrapper code
  dir=$(mktemp -d /tmp/oci-validation-run-XXXXXX)
  root=$dir/root
  wrapper=$dir/runtime
  printf '#!/bin/sh\nexec %q --root %q "$@"\n' "$rt" "$root" > "$wrapper"
  chmod +x "$wrapper"
  cp "$src/runtimetest" "$src/rootfs-amd64.tar.gz" "$dir/"
  mount_ids > "$dir/mounts.before"
  cgroup_dirs > "$dir/cgroups.before"
  (cd "$dir" && RUNTIME=$wrapper timeout -k 5 "$TEST_TIMEOUT" "$t" > "$dir/tap" 2>&1)
  code=$?
  clean_up "$rt" "$root" "$dir/mounts.before" "$dir/cgroups.before"
  local name; name=$(basename "$t" .t)
  cp "$dir/tap" "$work/tap-$name-$(basename "$rt")" 2>/dev/null
  if [ "$code" = 124 ] || [ "$code" = 137 ]; then
    echo timeout
  elif [ "$code" = 0 ] && grep -q '^TAP version' "$dir/tap" && ! grep -q '^not ok' "$dir/tap" \
      && { grep -q '^ok' "$dir/tap" || ! grep -q '"error"' "$dir/tap"; }; then
    # Passed: TAP without a failed point, and either some passed points or
    # (the hook tests' "1..0" plans) no error diagnostic.
    echo pass
  else
    echo fail
  fi
  rm -rf "$dir"
}

{
  echo "# runtime-tools: $src ($(cd "$src" && cat VERSION 2>/dev/null))"
  echo "# nestbox-runc: $NESTBOX_RUNC; runc: $RUNC ($("$RUNC" --version 2>/dev/null | head -1))"
  echo "# load: $(cut -d' ' -f1-3 /proc/loadavg); $(date -u +%FT%TZ)"
  printf '%-40s %-8s %-8s\n' executable runc nestbox
} | tee "$OUT"
np=0; rp=0; n=0
for t in "${tests[@]}"; do
  name=$(basename "$t" .t)
  r=skipped
  [ "$RUNC" != none ] && r=$(run_one "$t" "$RUNC")
  nb=$(run_one "$t" "$NESTBOX_RUNC")
  n=$((n + 1)); [ "$r" = pass ] && rp=$((rp + 1)); [ "$nb" = pass ] && np=$((np + 1))
  printf '%-40s %-8s %-8s\n' "$name" "$r" "$nb" | tee -a "$OUT"
done
echo "# passed: runc $rp of $n, nestbox $np of $n (TAP outputs in $work/tap-*)" | tee -a "$OUT"
