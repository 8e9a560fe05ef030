#!/usr/bin/env bash
# Stress and fault suite (not a benchmark: it measures nothing, it checks).
#   sudo bench/stress.sh                                  # 2000 cycles, 8 clients, 200 kills
#   sudo CYCLES=100 CLIENTS=4 KILLS=20 bench/stress.sh    # the short version run in CI
# Phase 1: CLIENTS concurrent clients perform CYCLES operations in all (run --rm,
# run -d, exec, stop, rm -f, freeze [--pool], clone through the CLI and through
# `nestbox serve`, template rm, network pool) on shared names, so they race.
# Phase 2: KILLS cycles, each SIGKILLing the CLI, a box's monitor or `nestbox
# serve` at a random moment (0-50 ms), then `nestbox gc`.
# Every error must be a documented one (docs/errors.md, of an allowed kind);
# after each phase nothing of the root may be left (mounts, cgroups, processes,
# links, nft table, address leases, state). Exits non-zero otherwise.
# The driver is lib/stress.py; its report goes to $RESULTS_DIR/stress.json.
set -euo pipefail
source "$(dirname "$0")/lib/common.sh"
require_root
CYCLES=${CYCLES:-2000}
CLIENTS=${CLIENTS:-8}
KILLS=${KILLS:-200}
SEED=${SEED:-}
command -v nft >/dev/null || die "nft is needed (apt-get install nftables)"
[[ -x $NESTBOX ]] || die "nestbox binary not found at $NESTBOX (scripts/setup.sh, or set NESTBOX_BIN)"
ROOT=$(make_tmpdir nestbox-stress)
# A private copy of the binary: a concurrent build cannot change it mid-run.
BIN=$ROOT/nestbox
cp "$NESTBOX" "$BIN"
NESTBOX=$BIN
cleanup() {
    nestbox_clean_root "$ROOT"
    remove_tmpdir "$ROOT"
}
trap cleanup EXIT
mkdir -p "$RESULTS_DIR"
log "root $ROOT, $CYCLES cycles x $CLIENTS clients, $KILLS kill cycles, load $(cut -d' ' -f1 /proc/loadavg)"
start=$(date +%s)
rc=0
python3 "$BENCH_DIR/lib/stress.py" --nestbox "$BIN" --root "$ROOT" \
    --errors "$REPO_DIR/docs/errors.md" --cycles "$CYCLES" --clients "$CLIENTS" \
    --kills "$KILLS" ${SEED:+--seed "$SEED"} --json "$RESULTS_DIR/stress.json" || rc=$?
log "done in $(( $(date +%s) - start )) s: $([[ $rc -eq 0 ]] && echo PASS || echo FAIL) (report: $RESULTS_DIR/stress.json)"
exit "$rc"
