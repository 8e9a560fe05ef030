#!/usr/bin/env bash
# Isolation overhead (issue 15): a CPU-bound, a syscall-bound and a
# file-IO-bound workload (lib/overhead-work.sh, timed inside, the host's own
# coreutils everywhere) run interleaved round-robin (lib/overheadbench.py) as:
#   host               a shell on the host (the reference)
#   host+allow-all     the host under a one-instruction seccomp filter that
#                      allows every call: what any filter costs
#   nestbox            a default box (--network none), writing to its overlay
#   nestbox-unconfined the same with --security-opt seccomp=unconfined
#   runc-docker        runc with Docker's default seccomp profile (containers-
#                      common's seccomp.json, the same rules, converted as
#                      Docker/podman do), writing to a bind-mounted host dir
#   runc-unconfined    the same bundle without a seccomp section
#
# Env: ROUNDS (default 7), RESULTS_DIR. Writes $RESULTS_DIR/overhead.md and
# overhead-summary.json.
set -euo pipefail
# shellcheck source=lib/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/common.sh"
# shellcheck source=lib/runc-bundle.sh
source "$BENCH_DIR/lib/runc-bundle.sh"

ROUNDS=${ROUNDS:-7}
PROFILE=/usr/share/containers/seccomp.json
require_root
command -v runc >/dev/null || die "runc missing (run bench/setup.sh)"
command -v jq >/dev/null || die "jq missing (run bench/setup.sh)"
[[ -f $PROFILE ]] || die "$PROFILE missing (Debian's golang-github-containers-common, installed with podman by scripts/setup.sh)"

extra_cleanup() {
    local id
    for id in $(runc --root "$work/runc-root" list -q 2>/dev/null); do
        runc --root "$work/runc-root" delete --force "$id" >/dev/null 2>&1 || true
    done
}
with_work_root nestbox-bench-overhead

lib=$work/lib
mkdir -p "$lib" "$work/host-scratch" "$work/scratch"
cp "$BENCH_DIR/lib/overhead-work.sh" "$BENCH_DIR/lib/seccomp-allow-all.py" "$lib/"

bundle() { # bundle DIR [docker]: busybox-free bundle on the host's /usr, running the workload {w}
    make_runc_bundle "$1"
    jq --arg lib "$lib" --arg scratch "$work/scratch" '
        .process.args = ["/bin/sh", "/b/overhead-work.sh", "WORKLOAD", "/scratch"]
        | .mounts += [{destination: "/b", type: "bind", source: $lib, options: ["rbind", "ro"]},
                      {destination: "/scratch", type: "bind", source: $scratch, options: ["rbind", "rw"]}]
        | del(.linux.seccomp)
    ' "$1/config.json" >"$1/config.json.new"
    mv "$1/config.json.new" "$1/config.json"
    if [[ ${2:-} == docker ]]; then
        python3 "$BENCH_DIR/lib/docker-seccomp-to-oci.py" "$PROFILE" "$1/config.json"
    fi
    # One bundle per workload: runc takes the process from the bundle.
    local w
    for w in cpu syscall file; do
        mkdir -p "$1-$w"
        cp -a "$1/rootfs" "$1-$w/"
        sed "s/\"WORKLOAD\"/\"$w\"/" "$1/config.json" >"$1-$w/config.json"
    done
}
bundle "$work/docker" docker
bundle "$work/plain"

box="$NESTBOX --root $root run --rm --network none -v $lib:/b:ro --"
load0=$(cut -d' ' -f1-3 /proc/loadavg)
log "isolation overhead: ROUNDS=$ROUNDS, interleaved; load $load0"
mkdir -p "$RESULTS_DIR"
table=$(python3 "$BENCH_DIR/lib/overheadbench.py" --rounds "$ROUNDS" --out "$RESULTS_DIR" \
    --variant host "sh $lib/overhead-work.sh {w} $work/host-scratch" \
    --variant host+allow-all "python3 $lib/seccomp-allow-all.py sh $lib/overhead-work.sh {w} $work/host-scratch" \
    --variant nestbox "$box sh /b/overhead-work.sh {w} /tmp" \
    --variant nestbox-unconfined "$NESTBOX --root $root run --rm --network none --security-opt seccomp=unconfined -v $lib:/b:ro -- sh /b/overhead-work.sh {w} /tmp" \
    --variant runc-docker "runc --root $work/runc-root run --bundle $work/docker-{w} ov-d" \
    --variant runc-unconfined "runc --root $work/runc-root run --bundle $work/plain-{w} ov-p")
left=$(runc --root "$work/runc-root" list -q | wc -l)
((left == 0)) || die "runc left $left container(s) behind"
{
    echo "### Isolation overhead, ROUNDS=$ROUNDS, interleaved (times measured inside)"
    echo
    echo "load average before: $load0, after: $(cut -d' ' -f1-3 /proc/loadavg)"
    echo
    echo "$table"
} | sed -e "s#$work#\$TMP#g" | tee "$RESULTS_DIR/overhead.md"
