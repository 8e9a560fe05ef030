#!/usr/bin/env python3
"""Start latency of a box in a box against a top-level box, interleaved.

Usage:
    nestbench.py --nestbox BIN --root DIR [--runs N] [--warmup W] [--out DIR]

Benchmarks (each "start a box, run /bin/true in it, remove it"):
  top        nestbox run --rm --network none -- /bin/true        (on the host)
  top-userns nestbox run --rm --userns --network none -- /bin/true (on the host)
  nested     nestbox run --rm -- /bin/true inside a running `run --nest` box
             (a user namespace of its own, network none: the defaults there)
  nested-2   the same one level deeper (inside a nest box inside a nest box)

The host ones are timed here around subprocess.run(). The nested ones are
timed inside the box, by a small agent (this file with --agent) started with
`nestbox exec`, which reads one line per run on stdin, times the command the
same way and answers with the nanoseconds: so the time of `exec` itself is
not counted. All four run round-robin (top, top-userns, nested, nested-2,
top, ...), first W times unrecorded, then N times each, so that they see the
same machine noise. A failing run aborts the benchmark.

Prints a markdown table (median, p90, min, mean in ms; each median over the
top-level one's) and, with --out, writes DIR/nest-samples.csv and
DIR/nest-summary.json (with the load average before and after).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import time
from pathlib import Path

NESTED_CMD = ["nestbox", "run", "--rm", "--", "/bin/true"]


def agent() -> int:
    """Inside a box: time NESTED_CMD once per line read, answer in ns."""
    for line in sys.stdin:
        if not line.strip():
            continue
        start = time.perf_counter_ns()
        proc = subprocess.run(
            NESTED_CMD,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            check=False,
        )
        took = time.perf_counter_ns() - start
        if proc.returncode != 0:
            msg = proc.stderr.decode(errors="replace").strip().replace("\n", " | ")
            print(f"ERR {proc.returncode} {msg}", flush=True)
        else:
            print(took, flush=True)
    return 0


def percentile(values: list[int], p: float) -> float:
    s = sorted(values)
    k = (len(s) - 1) * p / 100.0
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def summarize(ns: list[int]) -> dict[str, float]:
    ms = 1e-6
    return {
        "n": len(ns),
        "median_ms": percentile(ns, 50) * ms,
        "p90_ms": percentile(ns, 90) * ms,
        "min_ms": min(ns) * ms,
        "mean_ms": sum(ns) / len(ns) * ms,
    }


class Agent:
    """An agent process inside a box, driven over its stdin/stdout."""

    def __init__(self, argv: list[str]):
        self.proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
        )

    def run(self) -> int:
        assert self.proc.stdin and self.proc.stdout
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline().strip()
        if not line.isdigit():
            raise SystemExit(f"nested run failed: {line or 'the agent died'}")
        return int(line)

    def close(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()
        self.proc.wait(timeout=30)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--agent", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--nestbox")
    ap.add_argument("--root")
    ap.add_argument("--runs", type=int, default=100)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--out")
    a = ap.parse_args()
    if a.agent:
        return agent()
    nb, root = a.nestbox, a.root
    here = Path(__file__).resolve()
    host = lambda *args: [nb, "--root", root, *args]  # noqa: E731

    def check(argv: list[str]) -> None:
        subprocess.run(argv, check=True, stdout=subprocess.DEVNULL)

    # The outer boxes: l1 (a nest box), and l2 (a nest box in l1). The agent
    # script is bound read-only into l1 and reached from l2 through l1's state
    # directory (l2's own /var/lib/nestbox would not have it): it is copied.
    check(host("run", "-d", "--nest", "--network", "none", "--name", "bench-l1",
               "-v", f"{here.parent}:/bench:ro", "--", "sleep", "infinity"))
    check(host("exec", "bench-l1", "--", "sh", "-c",
               "mkdir -p /var/lib/nestbox/bench && cp /bench/nestbench.py /var/lib/nestbox/bench/"))
    check(host("exec", "bench-l1", "--", "nestbox", "run", "-d", "--nest", "--name", "bench-l2",
               "-v", "/var/lib/nestbox/bench:/bench:ro", "--", "sleep", "infinity"))
    agents = {
        "nested": Agent(host("exec", "bench-l1", "--", "python3", "/bench/nestbench.py", "--agent")),
        "nested-2": Agent(host("exec", "bench-l1", "--", "nestbox", "exec", "bench-l2", "--",
                               "python3", "/bench/nestbench.py", "--agent")),
    }
    tops = {
        "top": host("run", "--rm", "--network", "none", "--", "/bin/true"),
        "top-userns": host("run", "--rm", "--userns", "--network", "none", "--", "/bin/true"),
    }
    order = ["top", "top-userns", "nested", "nested-2"]

    def once(name: str) -> int:
        if name in agents:
            return agents[name].run()
        start = time.perf_counter_ns()
        proc = subprocess.run(tops[name], stdin=subprocess.DEVNULL,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, check=False)
        took = time.perf_counter_ns() - start
        if proc.returncode != 0:
            raise SystemExit(f"{name} failed: {proc.stderr.decode(errors='replace')}")
        return took

    load_before = os.getloadavg()
    samples: dict[str, list[int]] = {n: [] for n in order}
    try:
        for _ in range(a.warmup):
            for n in order:
                once(n)
        for _ in range(a.runs):
            for n in order:
                samples[n].append(once(n))
    finally:
        for ag in agents.values():
            ag.close()
        subprocess.run(host("rm", "-f", "bench-l1"), stdout=subprocess.DEVNULL, check=False)
    load_after = os.getloadavg()
    summary = {n: summarize(v) for n, v in samples.items()}
    base = summary["top"]["median_ms"]
    lines = [
        "| box | median ms | p90 ms | min ms | mean ms | × top |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for n in order:
        s = summary[n]
        lines.append(
            f"| {n} | {s['median_ms']:.2f} | {s['p90_ms']:.2f} | {s['min_ms']:.2f} "
            f"| {s['mean_ms']:.2f} | {s['median_ms'] / base:.2f} |"
        )
    print("\n".join(lines))
    print(f"\nload average before {load_before[0]:.2f}, after {load_after[0]:.2f}; "
          f"{os.cpu_count()} CPUs; N={a.runs} each, interleaved")
    if a.out:
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        with open(out / "nest-samples.csv", "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["bench", "run", "ns"])
            for n, v in samples.items():
                for i, ns in enumerate(v):
                    w.writerow([n, i, ns])
        (out / "nest-summary.json").write_text(json.dumps({
            "summary": summary,
            "load_before": load_before,
            "load_after": load_after,
            "cpus": os.cpu_count(),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
