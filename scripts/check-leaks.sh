#!/usr/bin/env bash
# After the test suite: nothing of nestbox may be left on this machine — no mount,
# cgroup, process, network link or state directory. Exits non-zero and lists what
# is left otherwise.
set -uo pipefail
left=()
while read -r mp; do left+=("mount $mp"); done < <(grep -i nestbox /proc/self/mountinfo | awk '{print $5}')
while read -r cg; do left+=("cgroup $cg"); done < <(find /sys/fs/cgroup -mindepth 1 -maxdepth 8 -type d -name 'nestbox-*' 2>/dev/null)
# Monitors of detached boxes end reparented to the machine's init, which may take a
# few seconds to reap them: give that a bounded grace period; whatever is still
# there afterwards (zombie or not) is a leak.
procs() { ps -eo pid=,stat=,comm=,args= | awk '$3 ~ /nestbox/ && $0 !~ /check-leaks/ {print $1" "$2" "$4}'; }
for _ in $(seq 30); do [ -z "$(procs)" ] && break; sleep 0.5; done
while read -r p; do left+=("process $p"); done < <(procs)
# Links: box veths (nbv*), test-root bridges and IFB devices (nb<8 hex>[ifb]),
# user-defined networks' (nbu<8 hex>[ifb]: tests make them in their own roots only), the
# network crate's own test links (nbt*, nbo*). The machine-wide network (nbx0) is
# persistent by design, like docker0, and not counted.
# (grep -E, not awk: Debian's mawk has no {n} repetition.)
while read -r l; do left+=("link $l"); done < <(ip -o link show 2>/dev/null | awk -F': ' '{sub(/@.*/, "", $2); print $2}' | grep -Ei '^(nestbox|nbv|nbt|nbo)|nestbox|^nbu?[0-9a-f]{8}(ifb)?$')
if command -v nft >/dev/null; then
  while read -r t; do left+=("nft table $t"); done < <(nft list tables 2>/dev/null | awk '{print $2" "$3}' | grep -E ' nestbox-nb(u?[0-9a-f]{8}|t)')
fi
for d in /tmp/nestbox-net-test-*; do [ -e "$d" ] && left+=("network test dir $d"); done
for d in /run/nestbox/boxes /var/lib/nestbox/boxes; do
  [ -d "$d" ] && [ -n "$(ls -A "$d" 2>/dev/null)" ] && left+=("state $d: $(ls -A "$d" | tr '\n' ' ')")
done
for d in /tmp/nestbox-test-*; do [ -e "$d" ] && left+=("test root $d"); done
if [ "${#left[@]}" -gt 0 ]; then
  echo "leak check: FAILED, left on the machine:" >&2
  printf '  %s\n' "${left[@]}" >&2
  exit 1
fi
echo "leak check: nothing of nestbox left (mounts, cgroups, processes, links, nft tables, state)"
