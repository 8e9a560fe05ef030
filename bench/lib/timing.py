#!/usr/bin/env python3
"""Interleaved wall-clock timing of commands.

Usage:
    timing.py [--runs N] [--warmup W] [--timeout S] [--out DIR] [--tag TAG]
              --bench NAME 'COMMAND' [--bench NAME 'COMMAND' ...]

Each COMMAND is split with shlex (no shell is involved, so the shell's own
start-up is not timed); every occurrence of ``{i}`` is replaced by a number
unique to that run (e.g. for container ids).

The commands are run round-robin -- a, b, c, a, b, c, ... -- first W times
each as a warm-up (not recorded), then N times each, so that all of them see
the same machine noise. Each run is timed with time.perf_counter_ns() around
subprocess.run(); stdin and stdout are /dev/null, stderr is captured. A run
that exits non-zero or times out aborts the whole benchmark (exit 1) with the
command and its stderr: a failing command is never timed.

Prints a markdown table (median, p90, p99, min, mean in ms; the ratio of the
first benchmark's median to each other's) and, with --out, writes
DIR/TAG-samples.csv (every sample) and DIR/TAG-summary.json.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path


def percentile(sorted_values: list[int], p: float) -> float:
    """The p-th percentile (0..100) with linear interpolation between ranks."""
    if not sorted_values:
        raise ValueError("no samples")
    k = (len(sorted_values) - 1) * p / 100.0
    lo = int(k)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (k - lo)


def summarize(samples_ns: list[int]) -> dict[str, float]:
    s = sorted(samples_ns)
    ms = 1e-6
    return {
        "n": len(s),
        "median_ms": percentile(s, 50) * ms,
        "p90_ms": percentile(s, 90) * ms,
        "p99_ms": percentile(s, 99) * ms,
        "min_ms": s[0] * ms,
        "max_ms": s[-1] * ms,
        "mean_ms": sum(s) / len(s) * ms,
    }


class RunFailed(Exception):
    pass


def run_once(name: str, template: list[str], index: int, timeout: float) -> int:
    argv = [arg.replace("{i}", str(index)) for arg in template]
    start = time.perf_counter_ns()
    try:
        proc = subprocess.run(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired as e:
        raise RunFailed(f"{name}: timed out after {timeout}s: {shlex.join(argv)}") from e
    except OSError as e:
        raise RunFailed(f"{name}: cannot run {shlex.join(argv)}: {e}") from e
    elapsed = time.perf_counter_ns() - start
    if proc.returncode != 0:
        stderr = proc.stderr.decode(errors="replace").strip()
        raise RunFailed(
            f"{name}: exit status {proc.returncode}: {shlex.join(argv)}\n"
            + (f"stderr:\n{stderr}" if stderr else "(no stderr)")
        )
    return elapsed


def markdown_table(names: list[str], stats: dict[str, dict[str, float]]) -> str:
    base = names[0]
    lines = [
        f"| command | median ms | p90 ms | p99 ms | min ms | mean ms | {base} / this (median) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name in names:
        st = stats[name]
        ratio = stats[base]["median_ms"] / st["median_ms"]
        lines.append(
            f"| {name} | {st['median_ms']:.2f} | {st['p90_ms']:.2f} | {st['p99_ms']:.2f} "
            f"| {st['min_ms']:.2f} | {st['mean_ms']:.2f} | {ratio:.2f}x |"
        )
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=200, help="recorded runs per command")
    ap.add_argument("--warmup", type=int, default=10, help="unrecorded runs per command first")
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds before one run counts as failed")
    ap.add_argument("--out", type=Path, help="directory for raw samples and the JSON summary")
    ap.add_argument("--tag", default="timing", help="file name prefix in --out")
    ap.add_argument("--pause", type=float, default=0.0, help="seconds of idle time before every run (all commands alike)")
    ap.add_argument("--bench", nargs=2, action="append", metavar=("NAME", "COMMAND"), required=True)
    args = ap.parse_args()

    if args.runs < 1 or args.warmup < 0:
        ap.error("--runs must be >= 1 and --warmup >= 0")
    names = [name for name, _ in args.bench]
    if len(set(names)) != len(names):
        ap.error("benchmark names must be unique")
    templates = {name: shlex.split(cmd) for name, cmd in args.bench}

    samples: dict[str, list[int]] = {name: [] for name in names}
    rows: list[tuple[int, str, int]] = []
    counter = 0
    total_rounds = args.warmup + args.runs
    try:
        for rnd in range(total_rounds):
            for name in names:
                counter += 1
                if args.pause > 0:
                    time.sleep(args.pause)
                ns = run_once(name, templates[name], counter, args.timeout)
                if rnd >= args.warmup:
                    samples[name].append(ns)
                    rows.append((rnd - args.warmup, name, ns))
            if (rnd + 1) % 50 == 0:
                print(f"  ... {rnd + 1}/{total_rounds} rounds", file=sys.stderr, flush=True)
    except RunFailed as e:
        print(f"timing.py: FAILED: {e}", file=sys.stderr)
        return 1

    stats = {name: summarize(samples[name]) for name in names}
    base = names[0]
    ratios = {f"{base}/{name}": stats[base]["median_ms"] / stats[name]["median_ms"] for name in names[1:]}
    print(markdown_table(names, stats))

    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        with open(args.out / f"{args.tag}-samples.csv", "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["round", "command", "ns"])
            w.writerows(rows)
        summary = {
            "runs": args.runs,
            "warmup": args.warmup,
            "order": "interleaved round-robin",
            "pause_s": args.pause,
            "commands": {name: " ".join(shlex.quote(a) for a in templates[name]) for name in names},
            "stats": stats,
            "median_ratios": ratios,
            "time_unix": int(time.time()),
            "nproc": os.cpu_count(),
        }
        (args.out / f"{args.tag}-summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
