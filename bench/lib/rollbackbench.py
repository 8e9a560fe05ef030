#!/usr/bin/env python3
"""Rollback with the processes (`snapshot --checkpoint`), side by side in one
interleaved run (bench/snapshot.sh).

Usage: rollbackbench.py NESTBOX ROOT SERVER_FILE N OUT.json

The ~67 MiB Python HTTP server of bench/clone.sh (SERVER_FILE, bound into the
box read-only) runs as box `rbk` on the default bridge network and is warmed
with 10 requests. Then, N rounds, in an order that rotates every round:

  snapshot --checkpoint   `nestbox snapshot --json --checkpoint BOX` (files and
                          processes in one freeze)
  snapshot                `nestbox snapshot --json BOX` (files only)
  checkpoint              `nestbox checkpoint --leave-running BOX` (processes and
                          a copy of the layer; removed after)

and N rounds, alternating, to the first HTTP answer on the box's address:

  rollback, processes     `nestbox rollback BOX S` to a snapshot taken with
                          --checkpoint: the box's processes killed, the
                          snapshot's files swapped in, its processes restored
                          (the count answered is the snapshot's, checked)
  rollback, restart       the same to a files-only snapshot: the box's command
                          started again (Python's start and the 48 MiB of state
                          made again), the baseline a rollback without the
                          processes gives

Medians (and p90) are printed and written to OUT.json with the load average
at the start and at the end.
"""

import json
import socket
import statistics
import subprocess
import sys
import time


def sh(nb, root, *args):
    out = subprocess.run([nb, "--root", root, *args], capture_output=True, text=True, timeout=120)
    if out.returncode != 0:
        raise SystemExit(f"nestbox {' '.join(args)} failed: {out.stderr.strip()}")
    return out.stdout


def get(addr):
    with socket.create_connection((addr, 8080), timeout=2) as s:
        s.sendall(b"GET / HTTP/1.0\r\n\r\n")
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    if not data.startswith(b"HTTP/1.0 200"):
        raise OSError(f"bad answer {data[:40]!r}")
    return data.split(b"\r\n\r\n", 1)[1].decode().split()[0]


def until_answer(addr, limit=30.0):
    end = time.monotonic() + limit
    while True:
        try:
            return get(addr)
        except OSError:
            if time.monotonic() > end:
                raise SystemExit(f"no answer from {addr}:8080 within {limit}s")
            time.sleep(0.0005)


def load():
    return float(open("/proc/loadavg").read().split()[0])


def stats(xs):
    xs = sorted(xs)
    return {
        "median_ms": round(statistics.median(xs), 2),
        "p90_ms": round(xs[min(len(xs) - 1, int(0.9 * (len(xs) - 1) + 0.5))], 2),
        "min_ms": round(xs[0], 2),
        "n": len(xs),
    }


def main():
    nb, root, server, n, out_path = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]
    box = "rbk"
    load_start = load()
    sh(nb, root, "run", "-d", "--name", box, "-v", f"{server}:/srv.py:ro", "--", "python3", "/srv.py")
    addr = json.loads(sh(nb, root, "inspect", box))["state"]["network"]["address"]
    until_answer(addr)
    for _ in range(10):
        get(addr)
    t = {"snapshot_checkpoint": [], "snapshot_checkpoint_frozen": [], "snapshot": [], "checkpoint": [],
         "rollback_processes": [], "rollback_restart": []}
    kinds = ["snapshot_checkpoint", "snapshot", "checkpoint"]
    for r in range(n):
        for k in kinds[r % 3:] + kinds[:r % 3]:
            t0 = time.perf_counter()
            if k == "snapshot_checkpoint":
                sh(nb, root, "snapshot", "--json", "--checkpoint", box, f"p{r}")
            elif k == "snapshot":
                sh(nb, root, "snapshot", "--json", box, f"f{r}")
            else:
                sh(nb, root, "checkpoint", box, "--as", f"c{r}", "--leave-running")
            t[k].append((time.perf_counter() - t0) * 1e3)
            if k == "checkpoint":
                sh(nb, root, "checkpoint", "rm", f"c{r}")
    # The snapshots to go back to: the count at each is known.
    at_p = int(get(addr))
    sh(nb, root, "snapshot", box, "back-p", "--checkpoint")
    sh(nb, root, "snapshot", box, "back-f")
    for r in range(n):
        for k in (["rollback_processes", "rollback_restart"] if r % 2 == 0 else
                  ["rollback_restart", "rollback_processes"]):
            snap = "back-p" if k == "rollback_processes" else "back-f"
            t0 = time.perf_counter()
            sh(nb, root, "rollback", box, snap)
            count = int(until_answer(addr))
            t[k].append((time.perf_counter() - t0) * 1e3)
            if k == "rollback_processes" and count != at_p + 1:
                raise SystemExit(f"rolled back with its processes, the count is {count}, not {at_p + 1}")
            if k == "rollback_restart" and count != 1:
                raise SystemExit(f"restarted, the count is {count}, not 1")
    result = {
        "runs": n,
        "load_start": load_start,
        "load_end": load(),
        **{k: stats(v) for k, v in t.items() if v},
    }
    with open(out_path, "w") as f:
        json.dump(result, f, indent=2)
    print(f"| ~67 MiB Python server, N={n}, load {load_start:.2f} -> {result['load_end']:.2f} | median ms (p90) |")
    print("|---|---|")
    for k, label in [("snapshot_checkpoint", "`snapshot --checkpoint` (files and processes, one freeze)"),
                     ("snapshot", "`snapshot` (files only)"),
                     ("checkpoint", "`checkpoint --leave-running` (processes and a copy of the layer)"),
                     ("rollback_processes", "`rollback` to a snapshot with its processes, to the first answer"),
                     ("rollback_restart", "`rollback` to a files-only snapshot (the command started again), to the first answer")]:
        print(f"| {label} | {result[k]['median_ms']} ({result[k]['p90_ms']}) |")


if __name__ == "__main__":
    main()
