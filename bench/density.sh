#!/usr/bin/env bash
# Density (issue 15, "1000 boxes on one host"): K idle clones of a small
# Python HTTP server, with networking, in one root.
#   sudo K=1000 N=20 bench/density.sh      -> bench/results/density.json, density.md
# Measures, in this order:
#   * the start of a new box (`run --rm -- /bin/true`, default network) on an
#     empty host: N runs, median;
#   * `clone tpl -d -n K` of the frozen server on a network of its own with
#     room for K boxes (`network create --subnet`), once the machine is quiet
#     (the kernel frees an earlier run's namespaces in the background for a
#     minute or more; SETTLE_MAX s at most): wall time of the command, the CPU
#     time the whole machine was busy meanwhile (lower noise than wall time),
#     then the MemAvailable drop per clone (IDLE_WAIT s after), the private memory
#     (smaps_rollup) of a sample of clones' processes, and an HTTP answer from
#     a sample of clones on their own addresses;
#   * the same new-box start while the K clones idle: N runs, median, and the
#     ratio to the empty host's;
#   * `rm -f` of the K clones in one command: wall time.
# Env: K (default 1000), N (default 20), SUBNET (default 10.201.0.0/20),
#      SETTLE_MAX (default 120),
#      IDLE_WAIT (seconds waited before each MemAvailable reading, default 2),
#      DROP_CACHES=1 (caches dropped before each reading: see bench/clone.sh),
#      NESTBOX_BIN, RESULTS_DIR.
set -euo pipefail
# shellcheck source=lib/common.sh
source "$(dirname "$0")/lib/common.sh"
require_root
K=${K:-1000}
N=${N:-20}
SUBNET=${SUBNET:-10.201.0.0/20}
command -v python3 >/dev/null || die "python3 missing (run bench/setup.sh)"
ROOT=$(make_tmpdir nestbox-bench-density)
cleanup() {
    nestbox_clean_root "$ROOT"
    "$NESTBOX" --root "$ROOT" network rm dense >/dev/null 2>&1 || true
    remove_tmpdir "$ROOT"
}
trap cleanup EXIT
require_nestbox "$ROOT"
log "K=$K clones, N=$N starts, subnet $SUBNET, load $(cut -d' ' -f1 /proc/loadavg)"
python3 "$BENCH_DIR/lib/densitybench.py" "$NESTBOX" "$ROOT" "$K" "$N" "$SUBNET" \
    "$RESULTS_DIR/density.json" | tee "$RESULTS_DIR/density.md"
log "done, load $(cut -d' ' -f1 /proc/loadavg)"
