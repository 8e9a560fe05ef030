#!/usr/bin/env bash
# Live migration of a box (nestbox migrate: pre-copy of its memory while it
# runs) against stop and copy (checkpoint -o - | restore -), side by side,
# between two roots standing for two hosts: the second in a network
# namespace of its own behind a veth pair. The box: a Python HTTP server
# holding MIB MiB it rewrites at RATE MiB/s; a client sends it requests
# without a pause and the longest gap between answers is the downtime a
# client sees (bench/lib/migbench.py). No request answered may be lost.
#   sudo N=5 MIB=100 RATE=10 bench/migrate.sh   -> bench/results/migrate.json
# MODES="migrate migrate-lazy stop-and-copy": which to run (default: migrate
# stop-and-copy; migrate-lazy is `migrate --lazy`, the target restoring lazily).
# CRIU, the usual tool for this, does not run on this kernel (Debian 12).
set -euo pipefail
source "$(dirname "$0")/lib/common.sh"
require_root
N=${N:-5}
MIB=${MIB:-100}
RATE=${RATE:-10}
NETNS=nbbench-mig$$
VETH=nbbmv$$
ROOT_A=$(make_tmpdir nestbox-bench-migrate-a)
ROOT_B=$(make_tmpdir nestbox-bench-migrate-b)
in_b() { nsenter --net="/run/netns/$NETNS" "$@"; }
cleanup() {
    local c
    for c in $("$NESTBOX" --root "$ROOT_A" checkpoint ls --json 2>/dev/null | jq -r '.[].name'); do
        "$NESTBOX" --root "$ROOT_A" checkpoint rm "$c" >/dev/null 2>&1 || true
    done
    nestbox_clean_root "$ROOT_A"
    if [[ -e /run/netns/$NETNS ]]; then
        in_b "$NESTBOX" --root "$ROOT_B" rm -f web >/dev/null 2>&1 || true
        for c in $(in_b "$NESTBOX" --root "$ROOT_B" checkpoint ls --json 2>/dev/null | jq -r '.[].name'); do
            in_b "$NESTBOX" --root "$ROOT_B" checkpoint rm "$c" >/dev/null 2>&1 || true
        done
        in_b "$NESTBOX" --root "$ROOT_B" gc >/dev/null 2>&1 || true
        in_b "$NESTBOX" --root "$ROOT_B" network rm >/dev/null 2>&1 || true
        ip netns del "$NETNS" || true
    fi
    ip link del "$VETH" 2>/dev/null || true
    remove_tmpdir "$ROOT_A"
    remove_tmpdir "$ROOT_B"
}
trap cleanup EXIT
require_nestbox "$ROOT_A"
ip netns add "$NETNS"
ip link add "$VETH" type veth peer name "${VETH}p"
ip link set "${VETH}p" netns "$NETNS"
ip addr add 198.18.200.1/30 dev "$VETH"
ip link set "$VETH" up
ip netns exec "$NETNS" sh -c "ip addr add 198.18.200.2/30 dev ${VETH}p && ip link set ${VETH}p up && ip link set lo up && sysctl -qw net.ipv4.ip_forward=1"
mkdir -p "$RESULTS_DIR"
log "N=$N rounds each, $MIB MiB rewritten at $RATE MiB/s, load $(cut -d' ' -f1 /proc/loadavg)"
python3 "$BENCH_DIR/lib/migbench.py" "$NESTBOX" "$ROOT_A" "$ROOT_B" "$NETNS" 198.18.200.2 \
    "$BENCH_DIR/lib/migserver.py" "$N" "$MIB" "$RATE" "$RESULTS_DIR/migrate.json"
