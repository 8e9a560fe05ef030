#!/usr/bin/env bash
# Same-page merging (KSM) of boxes: N `--ksm` boxes holding the same MIB MiB
# each; for each scanner setting, the time and ksmd CPU it takes to merge them,
# the memory gained, and the scanner's steady CPU share afterwards
# (bench/lib/ksmbench.py). The host's scanner settings are put back.
#   sudo N=10 MIB=50 bench/ksm.sh              -> bench/results/ksm.json
# SETTINGS (default "100:20 1000:20 5000:10"): PAGES_TO_SCAN:SLEEP_MS pairs;
# 100:20 is the kernel's default.
set -euo pipefail
source "$(dirname "$0")/lib/common.sh"
require_root
N=${N:-10}
MIB=${MIB:-50}
IDLE_S=${IDLE_S:-10}
SETTINGS=${SETTINGS:-"100:20 1000:20 5000:10"}
[[ -e /sys/kernel/mm/ksm/run ]] || die "this kernel has no KSM (CONFIG_KSM)"
ROOT=$(make_tmpdir nestbox-bench-ksm)
cleanup() { nestbox_clean_root "$ROOT"; remove_tmpdir "$ROOT"; }
trap cleanup EXIT
require_nestbox "$ROOT"
mkdir -p "$RESULTS_DIR"
log "N=$N boxes x $MIB MiB, settings $SETTINGS, load $(cut -d' ' -f1 /proc/loadavg)"
# shellcheck disable=SC2086
python3 "$BENCH_DIR/lib/ksmbench.py" "$NESTBOX" "$ROOT" "$N" "$MIB" "$IDLE_S" "$RESULTS_DIR/ksm.json" $SETTINGS
cat "$RESULTS_DIR/ksm.json"
