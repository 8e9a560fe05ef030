#!/usr/bin/env bash
# What monitors cost (issue 14), interleaved round-robin in one run, each box
# timing itself (lib/monitor-work.c, compiled here with gcc: ns per getppid and
# per 1-byte read+write pair, each the best of 5 batches):
#   none      a default box, no monitor
#   null      --monitor null:getppid: getppid stops and a monitor that lets
#             everything through answers (the cost of one interposed call);
#             read/write are not subscribed (the cost of a call nobody
#             subscribes to: the second filter's evaluation)
#   null x3   three such monitors stacked
#   trace     --monitor trace:getppid (a built-in that writes a log line)
# Env: ROUNDS (default 7), CALLS (interposed calls per batch, default 20000),
# RW (read+write pairs per batch, default 300000), RESULTS_DIR.
set -euo pipefail
# shellcheck source=lib/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/common.sh"
ROUNDS=${ROUNDS:-7}
CALLS=${CALLS:-20000}
RW=${RW:-300000}
require_root
with_work_root nestbox-bench-monitor
command -v gcc >/dev/null || die "gcc missing (apt-get install gcc)"
gcc -O2 -o "$work/work" "$BENCH_DIR/lib/monitor-work.c"
load0=$(cut -d' ' -f1-3 /proc/loadavg)
log "monitor cost: ROUNDS=$ROUNDS CALLS=$CALLS RW=$RW; load $load0"
python3 - "$NESTBOX" "$root" "$work" "$ROUNDS" "$CALLS" "$RW" <<'PY' | tee "$RESULTS_DIR/monitor.md"
import statistics, subprocess, sys
nestbox, root, work, rounds, calls, rw = sys.argv[1:7]
rounds = int(rounds)
variants = {
    "none": [],
    "null": ["--monitor", "null:getppid"],
    "null x3": ["--monitor", "null:getppid"] * 3,
    "trace": ["--monitor", "trace:getppid"],
}
samples = {k: ([], []) for k in variants}
for r in range(rounds + 1):
    for name, extra in variants.items():
        out = subprocess.run(
            [nestbox, "--root", root, "run", "--rm", "--network", "none", "-v", f"{work}:/w:ro", *extra,
             "--", "/w/work", calls, rw],
            check=True, capture_output=True, text=True).stdout.split()
        if r > 0:
            samples[name][0].append(float(out[0]))
            samples[name][1].append(float(out[1]))
base_p = statistics.median(samples["none"][0])
base_rw = statistics.median(samples["none"][1])
print(f"### Monitor cost, ROUNDS={rounds}, {calls} getppid and {rw} read+write pairs per run, interleaved\n")
print("| variant | getppid ns (median) | added per interposed call | read+write ns (median) | vs none |")
print("|---|---:|---:|---:|---:|")
for name in variants:
    p = statistics.median(samples[name][0])
    w = statistics.median(samples[name][1])
    print(f"| {name} | {p:.0f} | {(p - base_p) / 1000:.2f} µs | {w:.0f} | {w / base_rw:.3f}× |")
PY
echo
echo "load average before: $load0, after: $(cut -d' ' -f1-3 /proc/loadavg)"
