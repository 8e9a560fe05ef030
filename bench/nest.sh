#!/usr/bin/env bash
# Start latency of a box in a box (`nestbox run --nest`, docs/nesting.md)
# against a top-level box: `run --rm -- /bin/true` on the host (network
# none, with and without a user namespace), inside a nest box, and inside a
# nest box inside a nest box; interleaved round-robin, the nested ones timed
# inside their box so that `exec` is not counted (lib/nestbench.py).
# Target: a nested start within 2x a top-level one.
# Then a nest box saved with a box inside it against one with none inside
# (checkpoint --leave-running, restore, freeze, clone: lib/nestsavebench.py).
#
# Env: N (runs per box, default 100), WARMUP (default 10), SAVE_N (rounds of
#      the save benchmark, default 7; 0 skips it), NESTBOX_BIN, RESULTS_DIR.
# Writes: $RESULTS_DIR/nest-samples.csv, nest-summary.json, nest.md
set -euo pipefail

# shellcheck source=lib/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/common.sh"

N=${N:-100}
WARMUP=${WARMUP:-10}
SAVE_N=${SAVE_N:-7}

require_root
command -v python3 >/dev/null || die "python3 missing (run bench/setup.sh)"

work=$(make_tmpdir nestbox-bench-nest)
# A box's root in a user namespace (an unprivileged host uid) must reach
# its layers under the root directory.
chmod 755 "$work"
nb_root=$work/nestbox-root
cleanup() {
    local status=$?
    nestbox_clean_root "$nb_root"
    remove_tmpdir "$work"
    exit "$status"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

require_nestbox "$nb_root"
log "nested start latency; N=$N, warm-up $WARMUP each, interleaved"
mkdir -p "$RESULTS_DIR"
table=$(python3 "$BENCH_DIR/lib/nestbench.py" --nestbox "$NESTBOX" --root "$nb_root" \
    --runs "$N" --warmup "$WARMUP" --out "$RESULTS_DIR")
saved=""
if ((SAVE_N > 0)); then
    log "a nest box saved with a box inside; $SAVE_N rounds"
    saved=$(python3 "$BENCH_DIR/lib/nestsavebench.py" "$NESTBOX" "$nb_root" "$SAVE_N")
fi
left=$(nestbox_box_names "$nb_root" | wc -l)
((left == 0)) || die "the benchmark left $left box(es) behind"
{
    echo "### Nested start latency (\`run --rm -- /bin/true\`), N=$N per box, interleaved"
    echo
    echo "$table"
    if [[ -n $saved ]]; then
        echo
        echo "### A nest box saved with a box inside (medians of $SAVE_N rounds; bench/lib/pyserver.py in both)"
        echo
        echo "$saved"
    fi
} >"$RESULTS_DIR/nest.md"
cat "$RESULTS_DIR/nest.md"
