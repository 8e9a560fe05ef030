#!/usr/bin/env bash
# Checkpoint and restore of the ~67 MiB Python HTTP server of bench/clone.sh,
# side by side in one interleaved run with a cold start and a clone of the
# same server: checkpoint time (first, and with the pages already in the
# pool), pages written after 1 MiB changed, restore-to-first-answer with a
# warm and a cold page cache, memory of K idle restored boxes.
#   sudo N=20 K=100 COLD=3 bench/checkpoint.sh   -> bench/results/checkpoint.json
# POOL=N: the checkpoint's template (restore --shared) keeps N clones forked
# ahead, so a shared restore claims one (results file gets a -poolN suffix).
# No other checkpoint/restore runs on this machine to compare with: Debian
# 12's CRIU does not run on this kernel, and /dev/kvm cannot boot Firecracker
# guests; their published figures are quoted in docs/benchmarks.md.
set -euo pipefail
source "$(dirname "$0")/lib/common.sh"
require_root
N=${N:-20}
K=${K:-100}
COLD=${COLD:-3}
ROOT=$(make_tmpdir nestbox-bench-checkpoint)
cleanup() {
    "$NESTBOX" --root "$ROOT" checkpoint ls --json 2>/dev/null | jq -r '.[].name' |
        while read -r c; do "$NESTBOX" --root "$ROOT" checkpoint rm "$c" >/dev/null 2>&1 || true; done
    nestbox_clean_root "$ROOT"
    remove_tmpdir "$ROOT"
}
trap cleanup EXIT
require_nestbox "$ROOT"
SERVER=$ROOT/server.py
# The server of bench/clone.sh (bench/lib/pyserver.py).
cp "$BENCH_DIR/lib/pyserver.py" "$SERVER"
log "N=$N rounds, K=$K idle restored boxes, $COLD cold-cache restores, load $(cut -d' ' -f1 /proc/loadavg)"
python3 "$BENCH_DIR/lib/ckptbench.py" "$NESTBOX" "$ROOT" "$SERVER" "$N" "$K" "$COLD" "$RESULTS_DIR/checkpoint${POOL:+-pool$POOL}.json"
