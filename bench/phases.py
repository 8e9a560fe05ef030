#!/usr/bin/env python3
"""Where the time of one start goes: run a nestbox command N times with
NESTBOX_PHASES set to the CLOCK_MONOTONIC time of the launch, collect the
phase lines nestbox prints on stderr (see crates/nestbox-runtime/src/phases.rs)
and print, per phase, the median time since the launch and the median time
since the previous phase, plus the median wall time of the whole command
(until the caller saw it exit).

usage: phases.py [-n N] [--pause S] -- nestbox --root R run --rm -- /bin/true
"""

import argparse
import os
import statistics
import subprocess
import sys
import time


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("-n", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--pause", type=float, default=0.05)
    ap.add_argument("cmd", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    cmd = a.cmd[1:] if a.cmd and a.cmd[0] == "--" else a.cmd
    if not cmd:
        ap.error("no command")
    at = {}  # phase -> [ms since launch]
    step = {}  # phase -> [ms since previous phase]
    order = {}  # phase -> [rank]
    walls = []
    for i in range(a.warmup + a.n):
        env = dict(os.environ)
        t0 = time.monotonic_ns()
        env["NESTBOX_PHASES"] = str(t0)
        p = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE, text=True)
        t1 = time.monotonic_ns()
        if p.returncode != 0:
            sys.exit(f"exit {p.returncode}: {p.stderr}")
        time.sleep(a.pause)
        if i < a.warmup:
            continue
        walls.append((t1 - t0) / 1e6)
        rank = 0
        for line in p.stderr.splitlines():
            if not line.startswith("phase "):
                continue
            parts = line.split()
            # phase PID NAME... AT STEP
            name = " ".join(parts[2:-2])
            at.setdefault(name, []).append(float(parts[-2]))
            step.setdefault(name, []).append(float(parts[-1]))
            order.setdefault(name, []).append(rank)
            rank += 1
    med = statistics.median
    rows = sorted(at, key=lambda n: med(at[n]))
    print(f"{'phase':<46} {'at ms':>8} {'step ms':>8}  (medians of {a.n})")
    for n in rows:
        print(f"{n:<46} {med(at[n]):>8.3f} {med(step[n]):>8.3f}")
    walls.sort()
    print(f"{'wall (caller saw the exit)':<46} {med(walls):>8.3f}"
          f"   p90 {walls[int(0.9 * (len(walls) - 1))]:.3f}")


if __name__ == "__main__":
    main()
