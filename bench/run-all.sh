#!/usr/bin/env bash
# Run every benchmark and write $RESULTS_DIR/summary.md, ready to paste into
# docs/benchmarks.md: machine, versions, then each benchmark's table.
#
#   sudo bench/run-all.sh            # N=200 start runs, K=20 boxes
#   sudo N=50 K=10 bench/run-all.sh  # quicker
#
# Env: N, WARMUP (start.sh), K, TARGET_KIB (memory.sh), NESTBOX_BIN,
#      RESULTS_DIR, SKIP_SETUP=1 (do not call setup.sh).
set -euo pipefail
# shellcheck source-path=SCRIPTDIR

# shellcheck source=lib/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/common.sh"

export N=${N:-200} WARMUP=${WARMUP:-10} K=${K:-20} RESULTS_DIR

require_root
if [[ ${SKIP_SETUP:-0} != 1 ]]; then
    "$BENCH_DIR/setup.sh"
fi

# Benchmark a private copy of the binary, so a concurrent `cargo build`
# cannot swap it in the middle of a run.
[[ -x $NESTBOX ]] || die "nestbox binary not found at $NESTBOX (cargo build --release, or set NESTBOX_BIN)"
bin_dir=$(make_tmpdir nestbox-bench-bin)
trap 'remove_tmpdir "$bin_dir"' EXIT
cp "$NESTBOX" "$bin_dir/nestbox"
nestbox_sha=$(sha256sum "$bin_dir/nestbox" | cut -c1-12)
nestbox_src=${NESTBOX#"$REPO_DIR/"}
export NESTBOX_BIN=$bin_dir/nestbox
NESTBOX=$NESTBOX_BIN

load_before=$(cut -d' ' -f1-3 /proc/loadavg)
if awk -v n="$(nproc)" '{ exit !($1 > n / 2) }' /proc/loadavg; then
    log "warning: load average is $load_before on $(nproc) CPUs; results will be noisy"
fi

mkdir -p "$RESULTS_DIR"
rm -f "$RESULTS_DIR"/{start,memory}{.md,.json,-samples.csv,-summary.json} "$RESULTS_DIR/summary.md"

"$BENCH_DIR/start.sh" | sed "s#$bin_dir/nestbox#$nestbox_src#g"
"$BENCH_DIR/memory.sh"
sed -i "s#$bin_dir/nestbox#$nestbox_src#g" "$RESULTS_DIR/start.md" "$RESULTS_DIR/start-summary.json"

cpu_model=$(awk -F': ' '/^model name/ { print $2; exit }' /proc/cpuinfo)
nestbox_version=$("$NESTBOX" --version 2>/dev/null | head -n1 || true)
git_rev=$(git -C "$REPO_DIR" rev-parse --short HEAD 2>/dev/null || echo "no commit")
if [[ -n $(git -C "$REPO_DIR" status --porcelain -- crates Cargo.toml Cargo.lock 2>/dev/null) ]]; then
    git_rev+=" + uncommitted changes"
fi
{
    echo "## nestbox benchmarks"
    echo
    echo "| | |"
    echo "|---|---|"
    echo "| date | $(date -u '+%Y-%m-%d %H:%M UTC') |"
    echo "| kernel | $(uname -r) |"
    echo "| CPUs | $(nproc) × ${cpu_model:-unknown} |"
    echo "| memory | $(awk '$1 == "MemTotal:" { printf "%.1f GiB", $2 / 1048576 }' /proc/meminfo) |"
    echo "| nestbox | ${nestbox_version:-(no --version)}, git $git_rev, binary sha256 $nestbox_sha… |"
    echo "| runc | $(runc --version | head -n1) |"
    echo "| bwrap | $(bwrap --version) |"
    echo "| start runs | N=$N per command after $WARMUP warm-up runs each, interleaved |"
    echo "| idle boxes | K=$K |"
    echo "| load average at start | $load_before |"
    echo
    cat "$RESULTS_DIR/start.md"
    echo
    cat "$RESULTS_DIR/memory.md"
    echo
    echo "Reproduce: \`sudo N=$N K=$K bench/run-all.sh\` (see bench/README.md)."
} >"$RESULTS_DIR/summary.md"

log "summary written to $RESULTS_DIR/summary.md"
cat "$RESULTS_DIR/summary.md"
