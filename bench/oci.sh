#!/usr/bin/env bash
# nestbox-runc against runc on the same busybox bundle (the OCI default config
# `nestbox-runc spec` writes, running /bin/true, root read-only; rootfs: the
# static busybox of Debian's busybox-static), measured interleaved
# round-robin (lib/timing.py):
#   cycle   create + start + delete --force (lib/oci-cycle.sh, one sh process
#           around three runtime calls, the same for both)
#   run     `run` (create, start, wait, delete in one call)
# and then, side by side (lib/oci-ready.py, alternating), a cold container
# (busybox `sleep`) against one forked from a nestbox template through the
# annotation nestbox.template (a frozen box of a private nestbox root whose
# Python process counts in a loop): how long `create` takes, and how long after it
# returns the container's process runs its program (`start` returned, the
# program exec'd / the clone no longer stopped).
#
# Env: N (runs per command, default 200), WARMUP (default 10),
#      NESTBOX_RUNC (default target/release/nestbox-runc),
#      NESTBOX_BIN (default target/release/nestbox), READY_N (default N),
#      ONLY_READY=1 (only the cold vs clone figure),
#      RESULTS_DIR.
# Writes: $RESULTS_DIR/oci-samples.csv, oci-summary.json,
#         oci-ready-samples.csv, oci.md
set -euo pipefail
# shellcheck source=lib/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/common.sh"

N=${N:-200}
WARMUP=${WARMUP:-10}
NESTBOX_RUNC=${NESTBOX_RUNC:-$REPO_DIR/target/release/nestbox-runc}
READY_N=${READY_N:-$N}
require_root
[[ -x $NESTBOX_RUNC ]] || die "nestbox-runc not found at $NESTBOX_RUNC (cargo build --release -p nestbox-oci)"
[[ -x $NESTBOX ]] || die "nestbox not found at $NESTBOX (cargo build --release -p nestbox)"
command -v runc >/dev/null || die "runc missing (run bench/setup.sh)"
[[ -x /bin/busybox ]] || die "busybox missing (run bench/setup.sh)"

work=$(make_tmpdir nestbox-bench-oci)
cleanup() {
    local status=$? rt id b
    for rt in "$NESTBOX_RUNC:$work/nb-root" "runc:$work/runc-root" "$NESTBOX_RUNC:$work/ready-root"; do
        [[ -d ${rt#*:} ]] || continue
        for id in $("${rt%%:*}" --root "${rt#*:}" list -q 2>/dev/null); do
            "${rt%%:*}" --root "${rt#*:}" delete --force "$id" >/dev/null 2>&1 || true
        done
    done
    if [[ -d $work/nestbox ]]; then
        for b in $("$NESTBOX" --root "$work/nestbox" ps -a --json 2>/dev/null | python3 -c 'import json,sys; [print(b["name"]) for b in json.load(sys.stdin)]'); do
            "$NESTBOX" --root "$work/nestbox" rm -f "$b" >/dev/null 2>&1 || true
        done
        "$NESTBOX" --root "$work/nestbox" gc >/dev/null 2>&1 || true
    fi
    remove_tmpdir "$work"
    exit "$status"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

bundle=$work/bundle
mkdir -p "$bundle/rootfs/bin" "$bundle/rootfs/proc" "$bundle/rootfs/sys" "$bundle/rootfs/dev"
cp /bin/busybox "$bundle/rootfs/bin/busybox"
for a in sh true sleep; do ln -s busybox "$bundle/rootfs/bin/$a"; done
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
if [[ ${ONLY_READY:-0} == 1 ]]; then
    table="(runc comparison skipped: ONLY_READY=1)"
else
table=$(python3 "$BENCH_DIR/lib/timing.py" --runs "$N" --warmup "$WARMUP" --out "$RESULTS_DIR" --tag oci \
    --bench nestbox-cycle "$cycle $NESTBOX_RUNC $work/nb-root $bundle c{i}" \
    --bench runc-cycle "$cycle runc $work/runc-root $bundle c{i}" \
    --bench nestbox-run "$NESTBOX_RUNC --root $work/nb-root run --bundle $bundle r{i}" \
    --bench runc-run "runc --root $work/runc-root run --bundle $bundle r{i}")
for rt in "$NESTBOX_RUNC:$work/nb-root" "runc:$work/runc-root"; do
    left=$("${rt%%:*}" --root "${rt#*:}" list -q | wc -l)
    ((left == 0)) || die "${rt%%:*} left $left container(s) behind"
done
fi
# Cold against cloned: a template in a private nestbox root, and two
# bundles on the same rootfs (the clone's process is the template's).
log "template for the clone figure"
"$NESTBOX" --root "$work/nestbox" run -d --name tpl --network none -- python3 -c '
import os, time
i = 0
while True:
    i += 1
    with open("/count.tmp", "w") as f:
        f.write(str(i))
    os.rename("/count.tmp", "/count")
    time.sleep(0.01)
' >/dev/null
sleep 0.5
"$NESTBOX" --root "$work/nestbox" freeze tpl >/dev/null
for b in cold clone; do
    mkdir -p "$work/$b"
    ln -s "$bundle/rootfs" "$work/$b/rootfs"
done
python3 - "$bundle/config.json" "$work" <<'PY'
import json, sys
c = json.load(open(sys.argv[1]))
c["root"]["path"] = "rootfs"
c["process"]["args"] = ["/bin/sleep", "1000"]
json.dump(c, open(sys.argv[2] + "/cold/config.json", "w"), indent=1)
c["annotations"] = {"nestbox.template": "tpl", "nestbox.root": sys.argv[2] + "/nestbox"}
json.dump(c, open(sys.argv[2] + "/clone/config.json", "w"), indent=1)
PY
log "cold vs clone: READY_N=$READY_N, warm-up $WARMUP, alternating; load $(cut -d' ' -f1-3 /proc/loadavg)"
ready_load0=$(cut -d' ' -f1-3 /proc/loadavg)
ready=$(python3 "$BENCH_DIR/lib/oci-ready.py" "$NESTBOX_RUNC" "$work/ready-root" "$work/cold" "$work/clone" \
    "$READY_N" "$WARMUP" "$RESULTS_DIR")
left=$("$NESTBOX_RUNC" --root "$work/ready-root" list -q | wc -l)
((left == 0)) || die "nestbox-runc left $left container(s) behind"
{
    echo "### OCI runtime: nestbox-runc vs runc (busybox bundle, /bin/true), N=$N per command, interleaved"
    echo
    echo "load average before: $load0, after: $(cut -d' ' -f1-3 /proc/loadavg)"
    echo
    echo "$table"
    echo
    echo "### nestbox-runc: cold container vs one forked from a template (nestbox.template), N=$READY_N each, alternating"
    echo
    echo "load average before: $ready_load0, after: $(cut -d' ' -f1-3 /proc/loadavg)"
    echo
    echo "$ready"
} | sed -e "s#$work#\$TMP#g" -e "s#$REPO_DIR/##g" | tee "$RESULTS_DIR/oci.md"
