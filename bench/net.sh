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
# Egress policy: a "far" namespace joined to the host by a veth pair stands for
# the internet behind the gateway. Box A (no egress policy) and box C (an
# allow-list of 100 entries, the far address last, so every new connection
# walks all of them) send to it through the gateway (forwarded, NATed): TCP
# throughput, and new connections per second (a connect-and-close loop), side
# by side in the same rounds.
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
    ip link del "nbof$tag" 2>/dev/null || true
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

# The far side and box C with a 100-entry allow-list (99 decoys, far last).
far_ns=$(hold_netns); pids+=("$far_ns")
far_link=nbof$tag
far=10.231.253.2
ip link add "$far_link" type veth peer name eth0 netns "/proc/$far_ns/ns/net"
ip addr add 10.231.253.1/30 dev "$far_link"
ip link set "$far_link" up
echo 1 >"/proc/sys/net/ipv4/conf/$far_link/forwarding"
nsenter --net="/proc/$far_ns/ns/net" sh -c "ip addr add $far/30 dev eth0 && ip link set eth0 up"
box_c=$(hold_netns); pids+=("$box_c")
allow=$(python3 -c "print(','.join([f'198.18.{i}.0/24:443' for i in range(99)] + ['$far']))")
"$NETBENCH_BIN" attach "$work/net" "$bridge" "$subnet" box-c "$box_c" "$allow" >/dev/null
rules=$(nft list chain inet "nestbox-$bridge" "egress_$(nsenter --net="/proc/$box_c/ns/net" ip -4 -o addr show dev eth0 | awk '{print $4}' | cut -d/ -f1 | tr . _)" | grep -c ' accept$')
[[ $rules -eq 100 ]] || die "box C's egress chain has $rules accept rules, not 100"
# An accept-and-close server for the connection rate.
nsenter --net="/proc/$far_ns/ns/net" python3 -c "
import socket
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(('$far', 5202)); s.listen(512)
while True:
    c, _ = s.accept(); c.close()
" </dev/null >/dev/null 2>&1 &
pids+=("$!")
sleep 0.3

connect_rate() { # connect_rate CLIENT_PID -> new connections per second (1000 in a row)
    nsenter --net="/proc/$1/ns/net" python3 -c "
import socket, time
n = 1000
t = time.perf_counter()
for _ in range(n):
    socket.create_connection(('$far', 5202), timeout=5).close()
print(n / (time.perf_counter() - t))
"
}

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
open_runs=()
listed_runs=()
open_conn=()
listed_conn=()
for ((i = 1; i <= R; i++)); do
    bridge_runs+=("$(run_iperf "$box_a" "$box_b" "$addr_b")")
    plain_runs+=("$(run_iperf "$veth_a" "$veth_b" 10.231.252.2)")
    host_runs+=("$(run_iperf "$box_a" "$$" "$gateway")")
    open_runs+=("$(run_iperf "$box_a" "$far_ns" "$far")")
    listed_runs+=("$(run_iperf "$box_c" "$far_ns" "$far")")
    open_conn+=("$(connect_rate "$box_a")")
    listed_conn+=("$(connect_rate "$box_c")")
    log "round $i/$R: bridge ${bridge_runs[-1]} bit/s, plain veth ${plain_runs[-1]} bit/s, box to host ${host_runs[-1]} bit/s"
    log "  beyond the gateway: no policy ${open_runs[-1]} bit/s ${open_conn[-1]} conn/s, 100-entry allow-list ${listed_runs[-1]} bit/s ${listed_conn[-1]} conn/s"
done

log "timing $N attaches"
latency=$("$NETBENCH_BIN" latency "$work/lat" "nbl$tag" 10.231.251.0/24 "$N")

mkdir -p "$RESULTS_DIR"
python3 - "$RESULTS_DIR" "$latency" "$R" "$T" "$LINK_RATE" \
    "${bridge_runs[*]}" "${plain_runs[*]}" "${host_runs[*]}" \
    "${open_runs[*]}" "${listed_runs[*]}" "${open_conn[*]}" "${listed_conn[*]}" <<'EOF'
import json, statistics, sys, os, platform
out, latency, r, t, link = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
bridge = [float(x) for x in sys.argv[6].split()]
plain = [float(x) for x in sys.argv[7].split()]
host = [float(x) for x in sys.argv[8].split()]
eg_open = [float(x) for x in sys.argv[9].split()]
eg_list = [float(x) for x in sys.argv[10].split()]
cn_open = [float(x) for x in sys.argv[11].split()]
cn_list = [float(x) for x in sys.argv[12].split()]
mb, mp, mh = statistics.median(bridge), statistics.median(plain), statistics.median(host)
meo, mel = statistics.median(eg_open), statistics.median(eg_list)
mco, mcl = statistics.median(cn_open), statistics.median(cn_list)
eg_ratio = mel / meo if meo else 0.0
res = {
    "rounds": int(r), "seconds": int(t), "link_rate": link,
    "bridge_bits_per_second": bridge, "plain_veth_bits_per_second": plain,
    "box_to_host_bits_per_second": host,
    "bridge_median_gbit": mb / 1e9, "plain_median_gbit": mp / 1e9,
    "box_to_host_median_gbit": mh / 1e9,
    "ratio": mb / mp if mp else 0.0, "latency": latency,
    "beyond_gateway_no_policy_bits_per_second": eg_open,
    "beyond_gateway_allow_list_100_bits_per_second": eg_list,
    "beyond_gateway_no_policy_connections_per_second": cn_open,
    "beyond_gateway_allow_list_100_connections_per_second": cn_list,
    "egress_throughput_ratio": eg_ratio,
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
| box beyond the gateway, no egress policy | {meo/1e9:.2f} Gbit/s, {mco:.0f} conn/s | | |
| box beyond the gateway, 100-entry egress allow-list | {mel/1e9:.2f} Gbit/s, {mcl:.0f} conn/s | | |
| allow-list / no policy, throughput | {eg_ratio*100:.0f} % | ≥ 90 % | {'yes' if eg_ratio >= 0.9 else 'NO'} |
| allow-list / no policy, new connections per second | {mcl/mco*100 if mco else 0:.0f} % | | |
| attach (veth, address, route, class, filters) | {latency['attach_median_ms']:.2f} ms | ≤ 3 ms | {'yes' if latency['attach_median_ms'] <= 3 else 'NO'} |
| allocate + attach | {latency['allocate_attach_median_ms']:.2f} ms | | |
| detach | {latency['detach_median_ms']:.2f} ms | | |

Machine: Linux {platform.release()}, {os.cpu_count()} CPUs, load {' '.join(res['loadavg'])}.
"""
open(os.path.join(out, "net.md"), "w").write(md)
print(md)
EOF
