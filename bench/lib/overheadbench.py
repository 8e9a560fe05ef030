#!/usr/bin/env python3
"""Interleaved isolation-overhead runs: each VARIANT command is run with each
workload (overhead-work.sh prints the microseconds it took, measured inside),
round-robin over variants and workloads, R rounds after one warm-up round.

Usage: overheadbench.py --rounds R --out DIR --variant NAME 'COMMAND' ...
COMMAND contains {w} (the workload) and is split with shlex.
Prints a markdown table: per workload, each variant's median (ms), range,
and its ratio to the first variant's median."""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
from pathlib import Path

WORKLOADS = ["cpu", "syscall", "file"]


def run(cmd: str, workload: str) -> int:
    argv = shlex.split(cmd.replace("{w}", workload))
    p = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300)
    if p.returncode != 0:
        sys.exit(f"failed ({p.returncode}): {' '.join(argv)}\n{p.stderr}")
    try:
        return int(p.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        sys.exit(f"no time printed by: {' '.join(argv)}\nstdout: {p.stdout!r}\nstderr: {p.stderr}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--variant", nargs=2, action="append", metavar=("NAME", "COMMAND"), required=True)
    a = ap.parse_args()
    samples: dict[str, dict[str, list[int]]] = {w: {n: [] for n, _ in a.variant} for w in WORKLOADS}
    for r in range(a.rounds + 1):
        for w in WORKLOADS:
            for name, cmd in a.variant:
                us = run(cmd, w)
                if r > 0:
                    samples[w][name].append(us)
    base = a.variant[0][0]
    lines = ["| workload | variant | median ms | min–max ms | vs " + base + " |", "|---|---|---:|---:|---:|"]
    summary = {}
    for w in WORKLOADS:
        ref = statistics.median(samples[w][base])
        for name, _ in a.variant:
            s = samples[w][name]
            med = statistics.median(s)
            summary.setdefault(w, {})[name] = {"median_us": med, "samples_us": s}
            lines.append(f"| {w} | {name} | {med / 1e3:.1f} | {min(s) / 1e3:.1f}–{max(s) / 1e3:.1f} | {med / ref:.3f}× |")
    print("\n".join(lines))
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "overhead-summary.json").write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
