#!/usr/bin/env bash
# The time-travel disk (docs/snapshots.md), side by side in one interleaved
# run (medians): snapshot of a layer with FILES changed files against `cp -a`
# (alone, and followed by `sync -f`: a snapshot is durable) and `tar` of the
# same upper directory; a snapshot with nothing changed;
# rollback of the running box (stop, swap, restart) and of the stopped box,
# against the naive restore (`rm -rf` + `cp -a` of a saved layer). Then the
# rollback with the processes (`snapshot --checkpoint`) of the ~67 MiB Python
# server of bench/clone.sh, to its first answer, against a rollback that
# starts the command again (bench/lib/rollbackbench.py; PROC_N rounds, 0 to
# leave it out).
#   sudo N=15 FILES=1000 bench/snapshot.sh   -> bench/results/snapshot.json,
#                                               bench/results/rollback-processes.json
set -euo pipefail
# shellcheck source=lib/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/common.sh"
require_root
N=${N:-15}
FILES=${FILES:-1000}
command -v python3 >/dev/null || die "python3 missing (run bench/setup.sh)"
command -v jq >/dev/null || die "jq missing (run bench/setup.sh)"
[[ -x /bin/busybox ]] || die "/bin/busybox missing (apt-get install busybox-static)"
ROOT=$(make_tmpdir nestbox-bench-snapshot)
cleanup() {
    nestbox_clean_root "$ROOT"
    remove_tmpdir "$ROOT"
}
trap cleanup EXIT
[[ -x $NESTBOX ]] || die "nestbox binary not found at $NESTBOX (cargo build --release, or set NESTBOX_BIN)"
# A busybox image: the box's shell and the applets the driver uses.
rootfs=$ROOT/rootfs
mkdir -p "$rootfs"/{bin,etc,tmp}
cp /bin/busybox "$rootfs/bin/"
for a in sh cat ls rm mkdir echo sleep seq head; do ln -s busybox "$rootfs/bin/$a"; done
"$NESTBOX" --root "$ROOT" image import -q "$rootfs" --name bb >/dev/null
mkdir -p "$RESULTS_DIR"
log "N=$N rounds, $FILES files, load $(cut -d' ' -f1 /proc/loadavg)"
python3 "$BENCH_DIR/lib/snapbench.py" "$NESTBOX" "$ROOT" "$N" "$FILES" "$RESULTS_DIR/snapshot.json"
PROC_N=${PROC_N:-$N}
if [[ $PROC_N -gt 0 ]]; then
    cp "$BENCH_DIR/lib/pyserver.py" "$ROOT/server.py"
    log "rollback with the processes: $PROC_N rounds, load $(cut -d' ' -f1 /proc/loadavg)"
    python3 "$BENCH_DIR/lib/rollbackbench.py" "$NESTBOX" "$ROOT" "$ROOT/server.py" "$PROC_N" \
        "$RESULTS_DIR/rollback-processes.json"
fi
