#!/usr/bin/env bash
# nestbox-runc against runc on the same busybox bundle (the OCI default config
# `nestbox-runc spec` writes, running /bin/true, root read-only; rootfs: the
# static busybox of Debian's busybox-static), measured interleaved
# round-robin (lib/timing.py):
#   cycle   create + start + delete --force (lib/oci-cycle.sh, one sh process
#           around three runtime calls, the same for both)
#   run     `run` (create, start, wait, delete in one call)
#
# Env: N (runs per command, default 200), WARMUP (default 10),
#      NESTBOX_RUNC (default target/release/nestbox-runc), RESULTS_DIR.
# Writes: $RESULTS_DIR/oci-samples.csv, oci-summary.json, oci.md
set -euo pipefail
# shellcheck source=lib/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/common.sh"

N=${N:-200}
WARMUP=${WARMUP:-10}
NESTBOX_RUNC=${NESTBOX_RUNC:-$REPO_DIR/target/release/nestbox-runc}
require_root
[[ -x $NESTBOX_RUNC ]] || die "nestbox-runc not found at $NESTBOX_RUNC (cargo build --release -p nestbox-oci)"
command -v runc >/dev/null || die "runc missing (run bench/setup.sh)"
[[ -x /bin/busybox ]] || die "busybox missing (run bench/setup.sh)"

work=$(make_tmpdir nestbox-bench-oci)
cleanup() {
    local status=$? rt id
    for rt in "$NESTBOX_RUNC:$work/nb-root" "runc:$work/runc-root"; do
        [[ -d ${rt#*:} ]] || continue
        for id in $("${rt%%:*}" --root "${rt#*:}" list -q 2>/dev/null); do
            "${rt%%:*}" --root "${rt#*:}" delete --force "$id" >/dev/null 2>&1 || true
        done
    done
    remove_tmpdir "$work"
    exit "$status"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

bundle=$work/bundle
mkdir -p "$bundle/rootfs/bin" "$bundle/rootfs/proc" "$bundle/rootfs/sys" "$bundle/rootfs/dev"
cp /bin/busybox "$bundle/rootfs/bin/busybox"
for a in sh true; do ln -s busybox "$bundle/rootfs/bin/$a"; done
"$NESTBOX_RUNC" spec --bundle "$bundle"
python3 - "$bundle/config.json" <<'PY'
import json, sys
p = sys.argv[1]
c = json.load(open(p))
c["process"]["terminal"] = False
c["process"]["args"] = ["/bin/true"]
json.dump(c, open(p, "w"), indent=1)
PY

cycle=$BENCH_DIR/lib/oci-cycle.sh
load0=$(cut -d' ' -f1-3 /proc/loadavg)
log "OCI runtimes: nestbox-runc vs runc; N=$N, warm-up $WARMUP each, interleaved; load $(cut -d' ' -f1-3 /proc/loadavg)"
mkdir -p "$RESULTS_DIR"
table=$(python3 "$BENCH_DIR/lib/timing.py" --runs "$N" --warmup "$WARMUP" --out "$RESULTS_DIR" --tag oci \
    --bench nestbox-cycle "$cycle $NESTBOX_RUNC $work/nb-root $bundle c{i}" \
    --bench runc-cycle "$cycle runc $work/runc-root $bundle c{i}" \
    --bench nestbox-run "$NESTBOX_RUNC --root $work/nb-root run --bundle $bundle r{i}" \
    --bench runc-run "runc --root $work/runc-root run --bundle $bundle r{i}")
for rt in "$NESTBOX_RUNC:$work/nb-root" "runc:$work/runc-root"; do
    left=$("${rt%%:*}" --root "${rt#*:}" list -q | wc -l)
    ((left == 0)) || die "${rt%%:*} left $left container(s) behind"
done
{
    echo "### OCI runtime: nestbox-runc vs runc (busybox bundle, /bin/true), N=$N per command, interleaved"
    echo
    echo "load average before: $load0, after: $(cut -d' ' -f1-3 /proc/loadavg)"
    echo
    echo "$table"
} | sed -e "s#$work#\$TMP#g" -e "s#$REPO_DIR/##g" | tee "$RESULTS_DIR/oci.md"
