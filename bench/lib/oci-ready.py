#!/usr/bin/env python3
"""Cold containers against containers forked from a nestbox template
(annotation nestbox.template), side by side: N rounds, each making one of
each (the order alternating), with the same nestbox-runc and runtime root.

For each container it times
  create   the `create` command, until it returns;
  ready    from `create` returning until the container's process runs its
           program: `start` has returned and the process is past the
           runtime (cold: it has exec'd the program, which `start` waits
           for; clone: it is no longer stopped, i.e. it runs the template's
           continued state);
then deletes it (`delete --force`, not timed).

Usage: oci-ready.py RUNC ROOT COLD_BUNDLE CLONE_BUNDLE RUNS WARMUP OUT_DIR
Prints a markdown table (median, p90, min in ms) and writes
OUT_DIR/oci-ready-samples.csv.
"""

import csv
import json
import os
import subprocess
import sys
import tempfile
import time


def percentile(values, p):
    s = sorted(values)
    if not s:
        return float("nan")
    k = (len(s) - 1) * p / 100
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def call(argv):
    # stderr to a file, not a pipe: a created container keeps the runtime's
    # stdio open after `create` returned.
    with tempfile.TemporaryFile() as err:
        proc = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err)
        if proc.returncode != 0:
            err.seek(0)
            text = err.read().decode(errors="replace").strip()
            sys.exit(f"oci-ready: {' '.join(argv)}: exit {proc.returncode}: {text}")


def proc_state(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return "?"
    return stat[stat.rfind(")") + 2]


def one(runc, root, bundle, cid, clone):
    base = [runc, "--root", root]
    t0 = time.perf_counter_ns()
    call(base + ["create", "--bundle", bundle, cid])
    t1 = time.perf_counter_ns()
    call(base + ["start", cid])
    with open(os.path.join(root, cid, "state.json")) as f:
        rec = json.load(f)
    if clone:
        pid = rec["clone"]["process"]
        # start sent SIGCONT: wait (bounded) until the process is no longer stopped.
        deadline = time.monotonic() + 5
        while proc_state(pid) in ("T", "t"):
            if time.monotonic() > deadline:
                sys.exit(f"oci-ready: clone {cid} still stopped 5 s after start")
    else:
        pid = rec["pid"]
        if os.readlink(f"/proc/{pid}/exe") == os.path.realpath(runc):
            sys.exit(f"oci-ready: {cid} has not exec'd its program after start")
    t2 = time.perf_counter_ns()
    call(base + ["delete", "--force", cid])
    return (t1 - t0) / 1e6, (t2 - t1) / 1e6


def main():
    runc, root, cold, clone, runs, warmup, out = sys.argv[1:8]
    runs, warmup = int(runs), int(warmup)
    samples = {"cold": [], "clone": []}
    for i in range(warmup + runs):
        order = [("cold", cold), ("clone", clone)]
        if i % 2:
            order.reverse()
        for kind, bundle in order:
            c, r = one(runc, root, bundle, f"{kind}{i}", kind == "clone")
            if i >= warmup:
                samples[kind].append((c, r))
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "oci-ready-samples.csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["kind", "create_ms", "ready_ms"])
        for kind, rows in samples.items():
            for c, r in rows:
                w.writerow([kind, f"{c:.3f}", f"{r:.3f}"])
    print("| container | create median ms | create p90 | ready after create median ms | ready p90 | ready min | create + ready median |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for kind, rows in samples.items():
        c = [x for x, _ in rows]
        r = [y for _, y in rows]
        tot = [x + y for x, y in rows]
        print(
            f"| {kind} | {percentile(c, 50):.2f} | {percentile(c, 90):.2f} | {percentile(r, 50):.2f} "
            f"| {percentile(r, 90):.2f} | {min(r):.2f} | {percentile(tot, 50):.2f} |"
        )


if __name__ == "__main__":
    main()
