#!/usr/bin/env bash
# Box networking: box-to-box TCP throughput over a nestbox bridge against a
# plain veth pair between two namespaces, in the same run (iperf3, R rounds
# interleaved, medians), and the latency of attaching a box (allocate + attach,
# median of N, through the nestbox-net library via its netbench example).
#
# The bridge boxes get the default attachment. Traffic between them is not
# shaped (the network's IFB/HTB egress tree, link rate LINK_RATE, shapes what
# leaves the network, and everything a capped box sends): IPv4 takes the BPF
# shortcut from one box's host veth into the other box. Box-to-host TCP, which
# does go through the tree, is measured in the same rounds for information.
#
# Env: R (rounds, default 5), T (seconds per iperf3 run, default 3),
#      N (attaches timed, default 200), LINK_RATE (default 100gbit: the default
#      network's), NETBENCH_BIN (else built with cargo --release), RESULTS_DIR.
# Writes: $RESULTS_DIR/net.json, $RESULTS_DIR/net.md
set -euo pipefail
# shellcheck source-path=SCRIPTDIR
# shellcheck source=lib/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/common.sh"
# shellcheck source=lib/netns.sh
source "$BENCH_DIR/lib/netns.sh"

R=${R:-5}
T=${T:-3}
N=${N:-200}
LINK_RATE=${LINK_RATE:-100gbit}
export LINK_RATE

require_root
for c in iperf3 ip nsenter unshare jq python3; do
    command -v "$c" >/dev/null || die "$c missing (run bench/setup.sh)"
done

if [[ -z ${NETBENCH_BIN:-} ]]; then
    log "building the netbench example (release)"
    (cd "$REPO_DIR" && cargo build --release --quiet -p nestbox-net --example netbench)
    NETBENCH_BIN=${CARGO_TARGET_DIR:-$REPO_DIR/target}/release/examples/netbench
fi
[[ -x $NETBENCH_BIN ]] || die "netbench not found at $NETBENCH_BIN"

work=$(make_tmpdir nestbox-bench-net)
tag=$(( $$ % 10000 ))
bridge=nbb$tag
subnet=10.231.250.0/24
plain_a=nbpa$tag
pids=()

cleanup() {
    local status=$?
    "$NETBENCH_BIN" destroy "$work/net" "$bridge" "$subnet" >/dev/null 2>&1 || true
    "$NETBENCH_BIN" destroy "$work/lat" "nbl$tag" 10.231.251.0/24 >/dev/null 2>&1 || true
    ip link del "$plain_a" 2>/dev/null || true
    stop_holders "${pids[@]}"
    remove_tmpdir "$work"
    exit "$status"
}
trap cleanup EXIT INT TERM

# Four namespaces: two boxes on the bridge, two ends of a plain veth pair.
box_a=$(hold_netns); pids+=("$box_a")
box_b=$(hold_netns); pids+=("$box_b")
veth_a=$(hold_netns); pids+=("$veth_a")
veth_b=$(hold_netns); pids+=("$veth_b")

"$NETBENCH_BIN" attach "$work/net" "$bridge" "$subnet" box-a "$box_a" >/dev/null
addr_b=$("$NETBENCH_BIN" attach "$work/net" "$bridge" "$subnet" box-b "$box_b")
plain_pair "$plain_a" "$veth_a" "$veth_b" 10.231.252.1 10.231.252.2

run_iperf() { # run_iperf CLIENT_PID SERVER_PID SERVER_ADDR -> bits/s
    local cpid=$1 spid=$2 saddr=$3 out
    nsenter --net="/proc/$spid/ns/net" iperf3 -s -1 -B "$saddr" -p 5201 >/dev/null 2>&1 &
    local srv=$!
    sleep 0.3
    out=$(nsenter --net="/proc/$cpid/ns/net" iperf3 -c "$saddr" -p 5201 -t "$T" -J 2>/dev/null) || true
    wait "$srv" 2>/dev/null || true
    jq -r '.end.sum_received.bits_per_second // 0' <<<"$out"
}

gateway=10.231.250.1
bridge_runs=()
plain_runs=()
host_runs=()
for ((i = 1; i <= R; i++)); do
    bridge_runs+=("$(run_iperf "$box_a" "$box_b" "$addr_b")")
    plain_runs+=("$(run_iperf "$veth_a" "$veth_b" 10.231.252.2)")
    host_runs+=("$(run_iperf "$box_a" "$$" "$gateway")")
    log "round $i/$R: bridge ${bridge_runs[-1]} bit/s, plain veth ${plain_runs[-1]} bit/s, box to host ${host_runs[-1]} bit/s"
done

log "timing $N attaches"
latency=$("$NETBENCH_BIN" latency "$work/lat" "nbl$tag" 10.231.251.0/24 "$N")

mkdir -p "$RESULTS_DIR"
python3 - "$RESULTS_DIR" "$latency" "$R" "$T" "$LINK_RATE" \
    "${bridge_runs[*]}" "${plain_runs[*]}" "${host_runs[*]}" <<'EOF'
import json, statistics, sys, os, platform
out, latency, r, t, link = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
bridge = [float(x) for x in sys.argv[6].split()]
plain = [float(x) for x in sys.argv[7].split()]
host = [float(x) for x in sys.argv[8].split()]
mb, mp, mh = statistics.median(bridge), statistics.median(plain), statistics.median(host)
res = {
    "rounds": int(r), "seconds": int(t), "link_rate": link,
    "bridge_bits_per_second": bridge, "plain_veth_bits_per_second": plain,
    "box_to_host_bits_per_second": host,
    "bridge_median_gbit": mb / 1e9, "plain_median_gbit": mp / 1e9,
    "box_to_host_median_gbit": mh / 1e9,
    "ratio": mb / mp if mp else 0.0, "latency": latency,
    "kernel": platform.release(), "cpus": os.cpu_count(),
    "loadavg": open("/proc/loadavg").read().split()[:3],
}
json.dump(res, open(os.path.join(out, "net.json"), "w"), indent=2)
md = f"""### Box networking (`bench/net.sh`), R={r} rounds of {t} s, interleaved; N={latency['n']} attaches

| measure | median | target | met |
|---|---:|---:|---|
| box-to-box TCP over the bridge (default attachment, link {link}) | {mb/1e9:.2f} Gbit/s | | |
| plain veth pair between two namespaces | {mp/1e9:.2f} Gbit/s | | |
| bridge / plain veth | {res['ratio']*100:.0f} % | ≥ 90 % | {'yes' if res['ratio'] >= 0.9 else 'NO'} |
| box-to-host TCP (through the HTB egress tree) | {mh/1e9:.2f} Gbit/s ({mh/mp*100 if mp else 0:.0f} % of plain) | | |
| attach (veth, address, route, class, filters) | {latency['attach_median_ms']:.2f} ms | ≤ 3 ms | {'yes' if latency['attach_median_ms'] <= 3 else 'NO'} |
| allocate + attach | {latency['allocate_attach_median_ms']:.2f} ms | | |
| detach | {latency['detach_median_ms']:.2f} ms | | |

Machine: Linux {platform.release()}, {os.cpu_count()} CPUs, load {' '.join(res['loadavg'])}.
"""
open(os.path.join(out, "net.md"), "w").write(md)
print(md)
EOF
