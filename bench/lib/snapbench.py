#!/usr/bin/env python3
"""The time-travel disk, side by side in one interleaved run (bench/snapshot.sh).

Usage: snapbench.py NESTBOX ROOT N FILES OUT.json

A box of a busybox image (imported by the caller as `bb`) writes FILES files
of 4 KiB into /w. Then, N rounds, each:

  1. the box appends a line to every file (not timed: FILES changed files);
  2. timed, in an order that rotates every round:
       snapshot     `nestbox snapshot --json BOX`          (incremental: FILES read)
       cp -a        `cp -a UPPER DIR`                      (the naive copy of the layer)
       cp -a+sync   the same, then `sync -f DIR`           (as durable as a snapshot, whose
                                                            objects and record are synced)
       tar          `tar -C UPPER -cf FILE .`              (the same, as one archive)
  3. `nestbox snapshot` again with nothing changed (only stamps compared).

Rollback, N rounds, alternating between two snapshots that differ in all FILES
files (each restores FILES files' contents):

  rollback (running)   `nestbox rollback --json BOX SNAP` of the running box:
                       materialise the snapshot's layer, then stop, swap, start
                       again (downtime_ms: from the stop to the command running)
  rollback (stopped)   the same of the box stopped (files only)
  cp -a restore        `rm -rf UPPER2; cp -a SAVED UPPER2` (naive restore of a
                       saved copy of the layer)

Each timed figure is the wall clock around the command (time.perf_counter_ns),
plus nestbox's own figures from --json. Medians are printed and written to
OUT.json with the load average at the start and at the end.
"""

import json
import os
import shutil
import statistics
import subprocess
import sys
import time


def run(cmd, **kw):
    return subprocess.run(cmd, check=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def timed(cmd, **kw):
    t = time.perf_counter_ns()
    out = run(cmd, **kw)
    return (time.perf_counter_ns() - t) / 1e6, out.stdout


def load():
    return float(open("/proc/loadavg").read().split()[0])


def med(xs):
    return round(statistics.median(xs), 2) if xs else None


def main():
    nb, root, n, files, out_path = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    base = [nb, "--root", root]
    box = "snapbench"
    load_start = load()
    run(base + ["run", "-d", "--name", box, "--network", "none", "--image", "bb", "--", "sleep", "1000000"])
    run(base + ["exec", box, "--", "sh", "-c",
                f"mkdir /w; for i in $(seq 1 {files}); do head -c 4096 /dev/urandom > /w/f$i; done"])
    box_id = json.loads(run(base + ["inspect", box]).stdout)["state"]["id"]
    upper = os.path.join(root, "lib/boxes", box_id, "upper-0")
    scratch = os.path.join(root, "scratch")
    os.makedirs(scratch)
    change = ["exec", box, "--", "sh", "-c", f"for i in $(seq 1 {files}); do echo $RANDOM >> /w/f$i; done"]

    s = {"snapshot": [], "snapshot_self": [], "snapshot_publish": [], "snapshot_read": [], "cp": [], "cp_sync": [], "tar": [],
         "unchanged": [], "unchanged_self": []}
    kinds = ["snapshot", "cp", "cp_sync", "tar"]
    for r in range(n):
        run(base + change)
        order = kinds[r % len(kinds):] + kinds[:r % len(kinds)]
        for k in order:
            if k == "snapshot":
                ms, o = timed(base + ["snapshot", "--json", box])
                j = json.loads(o)
                s["snapshot"].append(ms)
                s["snapshot_self"].append(j["ms"])
                s["snapshot_publish"].append(j.get("publish_ms", 0.0))
                s["snapshot_read"].append(j["files_read"])
            elif k == "cp":
                dst = os.path.join(scratch, "cp")
                ms, _ = timed(["cp", "-a", upper, dst])
                s["cp"].append(ms)
                shutil.rmtree(dst)
                run(["sync", "-f", scratch])
            elif k == "cp_sync":
                # As durable as a snapshot: the copy flushed to disk.
                dst = os.path.join(scratch, "cp")
                t = time.perf_counter_ns()
                run(["cp", "-a", upper, dst])
                run(["sync", "-f", dst])
                s["cp_sync"].append((time.perf_counter_ns() - t) / 1e6)
                shutil.rmtree(dst)
                run(["sync", "-f", scratch])
            else:
                dst = os.path.join(scratch, "layer.tar")
                ms, _ = timed(["tar", "-C", upper, "-cf", dst, "."])
                s["tar"].append(ms)
                os.unlink(dst)
                run(["sync", "-f", scratch])
        ms, o = timed(base + ["snapshot", "--json", box])
        s["unchanged"].append(ms)
        s["unchanged_self"].append(json.loads(o)["ms"])

    # Two snapshots differing in every file, and a saved copy of the layer
    # for the naive restore.
    run(base + change)
    run(base + ["snapshot", box, "ra"])
    saved = os.path.join(scratch, "saved")
    run(["cp", "-a", upper, saved])
    run(base + change)
    run(base + ["snapshot", box, "rb"])
    rb = {"running": [], "running_swap": [], "running_materialise": [], "running_down": [], "stopped": [],
          "stopped_swap": [], "stopped_materialise": [], "cp_restore": []}
    target = os.path.join(scratch, "upper2")
    for r in range(n):
        snap = "ra" if r % 2 == 0 else "rb"
        ms, o = timed(base + ["rollback", "--json", box, snap])
        j = json.loads(o)
        assert j["restarted"], j
        rb["running"].append(ms)
        rb["running_swap"].append(j["swap_ms"])
        rb["running_materialise"].append(j["materialise_ms"])
        rb["running_down"].append(j["downtime_ms"])
        if os.path.exists(target):
            shutil.rmtree(target)
        run(["cp", "-a", upper, target])
        t = time.perf_counter_ns()
        shutil.rmtree(target)
        run(["cp", "-a", saved, target])
        rb["cp_restore"].append((time.perf_counter_ns() - t) / 1e6)
    run(base + ["stop", "-t", "1", box])
    for r in range(n):
        snap = "ra" if r % 2 == 0 else "rb"
        ms, o = timed(base + ["rollback", "--json", box, snap])
        j = json.loads(o)
        rb["stopped"].append(ms)
        rb["stopped_swap"].append(j["swap_ms"])
        rb["stopped_materialise"].append(j["materialise_ms"])
    shutil.rmtree(scratch)
    result = {
        "files": files,
        "runs": n,
        "load_start": load_start,
        "load_end": load(),
        "snapshot": {k: med(v) for k, v in s.items()},
        "rollback": {k: med(v) for k, v in rb.items()},
        "min": {k: round(min(v), 2) for k, v in list(s.items()) + list(rb.items()) if v},
        "samples": {k: [round(x, 2) for x in v] for k, v in list(s.items()) + list(rb.items())},
    }
    with open(out_path, "w") as f:
        json.dump(result, f, indent=2)
    sn, rl, mn = result["snapshot"], result["rollback"], result["min"]
    print(f"| {files} changed files, N={n}, load {load_start:.2f} -> {result['load_end']:.2f} | median ms |")
    print("|---|---|")
    print(f"| `snapshot` (CLI wall clock; {sn['snapshot_read']:.0f} files read) | {sn['snapshot']} (min {mn['snapshot']}) |")
    print(f"| `snapshot`, its own figure (of which publish: syncfs, renames, syncfs) | {sn['snapshot_self']} ({sn['snapshot_publish']}) |")
    print(f"| `cp -a` of the upper dir | {sn['cp']} (min {mn['cp']}) |")
    print(f"| `cp -a` of the upper dir, then `sync -f` (as durable as a snapshot) | {sn['cp_sync']} (min {mn['cp_sync']}) |")
    print(f"| `tar -cf` of the upper dir | {sn['tar']} |")
    print(f"| `snapshot` with nothing changed | {sn['unchanged']} (own {sn['unchanged_self']}) |")
    print(f"| `rollback` of the running box (stop, swap, restart) | {rl['running']} (materialise {rl['running_materialise']}, then down {rl['running_down']}: stop, swap {rl['running_swap']}, start) |")
    print(f"| `rollback` of the stopped box | {rl['stopped']} (materialise {rl['stopped_materialise']}, swap {rl['stopped_swap']}) |")
    print(f"| naive restore: `rm -rf` + `cp -a` of a saved layer | {rl['cp_restore']} |")


if __name__ == "__main__":
    main()
