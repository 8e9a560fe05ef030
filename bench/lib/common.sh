#!/usr/bin/env bash
# Shared helpers for the bench/*.sh scripts. Source it; it defines:
#   BENCH_DIR, REPO_DIR, RESULTS_DIR, NESTBOX (binary path; env NESTBOX_BIN)
#   log, die, require_root, require_nestbox, make_tmpdir, remove_tmpdir,
#   nestbox_box_names ROOT, nestbox_clean_root ROOT

BENCH_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
REPO_DIR=$(cd "$BENCH_DIR/.." && pwd)
RESULTS_DIR=${RESULTS_DIR:-$BENCH_DIR/results}
mkdir -p "$RESULTS_DIR"
NESTBOX=${NESTBOX_BIN:-$REPO_DIR/target/release/nestbox}

# Never wait on a terminal.
export CI=${CI:-true}
exec </dev/null

log() { printf '[%s] %s\n' "$(basename "$0")" "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

require_root() {
    [[ $(id -u) -eq 0 ]] || die "must run as root (namespaces, cgroups, mounts)"
}

# Fail unless the nestbox binary exists and can run a trivial box.
require_nestbox() {
    local root=$1
    [[ -x $NESTBOX ]] || die "nestbox binary not found at $NESTBOX (cargo build --release, or set NESTBOX_BIN)"
    "$NESTBOX" --root "$root" run --rm -- /bin/true ||
        die "'$NESTBOX --root $root run --rm -- /bin/true' failed; nestbox is not usable yet"
}

# make_tmpdir PREFIX: print a new temp dir.
make_tmpdir() { mktemp -d "${TMPDIR:-/tmp}/$1.XXXXXX"; }

# remove_tmpdir DIR: unmount whatever is still mounted below DIR (deepest
# first), then delete it without crossing into other filesystems, so a
# leftover bind mount of a host directory can never be recursed into.
remove_tmpdir() {
    local dir=$1 mnt
    [[ -n $dir && -d $dir ]] || return 0
    dir=$(realpath "$dir")
    # mountinfo field 5 is the mount point (octal escapes for spaces etc.).
    while read -r mnt; do
        umount -l "$mnt" 2>/dev/null || log "warning: cannot unmount $mnt"
    done < <(awk -v d="$dir" '$5 == d || index($5, d "/") == 1 { print $5 }' /proc/self/mountinfo | sort -r)
    if awk -v d="$dir" '$5 == d || index($5, d "/") == 1 { found = 1 } END { exit !found }' /proc/self/mountinfo; then
        log "warning: mounts remain under $dir; leaving it in place"
        return 0
    fi
    rm -rf --one-file-system "$dir"
}

# nestbox_box_names ROOT: print the names of all boxes under ROOT, running or
# not (`nestbox ps -a --json`), one per line. Accepts a JSON array of boxes or an object
# with a "boxes" array; a box is a string or an object with "name"/"id".
nestbox_box_names() {
    "$NESTBOX" --root "$1" ps -a --json |
        jq -r '(if type == "array" then . else (.boxes // []) end)[]
               | if type == "string" then . else (.name // .id) end'
}

# nestbox_clean_root ROOT: remove every box under ROOT (templates and their pools
# too), collect leftovers, and remove ROOT's network (bridge, IFB, NAT table).
nestbox_clean_root() {
    local root=$1 name
    [[ -d $root && -x $NESTBOX ]] || return 0
    # Box shells a pool keeps ready are not listed by ps (a build without
    # shells has no `pool`: that is fine).
    "$NESTBOX" --root "$root" pool drain >/dev/null 2>&1 || true
    while read -r name; do
        [[ -z $name ]] || "$NESTBOX" --root "$root" rm -f "$name" >/dev/null 2>&1 || true
    done < <(nestbox_box_names "$root" 2>/dev/null || true)
    # A template removed while it had clones goes only once its last clone has
    # (its init lingers up to half a second): the network can be removed once
    # no box is left. Bounded: 5 s.
    for _ in $(seq 50); do
        [[ -z $(nestbox_box_names "$root" 2>/dev/null) ]] && break
        sleep 0.1
    done
    "$NESTBOX" --root "$root" gc >/dev/null 2>&1 || true
    "$NESTBOX" --root "$root" network rm >/dev/null 2>&1 || true
}

# with_work_root PREFIX: make $work (a new temp dir) and $root (a nestbox root
# in it, checked usable), both removed at exit; a script that defines
# extra_cleanup has it called first.
with_work_root() {
    work=$(make_tmpdir "$1")
    root=$work/root
    trap _work_root_cleanup EXIT
    trap 'exit 130' INT TERM
    require_nestbox "$root"
}
_work_root_cleanup() {
    local status=$?
    if declare -F extra_cleanup >/dev/null; then extra_cleanup; fi
    nestbox_clean_root "$root"
    remove_tmpdir "$work"
    exit "$status"
}
