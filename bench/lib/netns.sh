#!/usr/bin/env bash
# Network namespaces for bench/net.sh. Source it; it defines:
#   hold_netns             start a process in a new network namespace (lo up)
#                          that holds it; print its pid
#   stop_holders PID...    kill those processes (their namespaces go with them)
#   plain_pair HOSTNAME PID_A PID_B ADDR_A ADDR_B
#                          a plain veth pair between the namespaces of PID_A and
#                          PID_B (/24 addresses, up): the baseline of net.sh

hold_netns() {
    unshare --net sh -c 'ip link set lo up; exec sleep infinity' </dev/null >/dev/null 2>&1 &
    local pid=$!
    # Wait until the child is inside its own namespace.
    for _ in $(seq 100); do
        [[ $(readlink "/proc/$pid/ns/net") != $(readlink /proc/self/ns/net) ]] && break
        sleep 0.01
    done
    echo "$pid"
}

stop_holders() {
    local pid
    for pid in "$@"; do
        kill "$pid" 2>/dev/null || true
        wait "$pid" 2>/dev/null || true
    done
}

plain_pair() {
    local name=$1 a=$2 b=$3 addr_a=$4 addr_b=$5
    ip link add "$name" netns "/proc/$a/ns/net" type veth peer name eth0 netns "/proc/$b/ns/net"
    nsenter --net="/proc/$a/ns/net" sh -c "ip link set $name name eth0 && ip addr add $addr_a/24 dev eth0 && ip link set eth0 up"
    nsenter --net="/proc/$b/ns/net" sh -c "ip addr add $addr_b/24 dev eth0 && ip link set eth0 up"
}
