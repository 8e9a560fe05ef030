#!/usr/bin/env python3
"""A nest box saved with the boxes inside it, against one with none inside
(bench/nest.sh, docs/nesting.md "Freezing, cloning, checkpointing and
migrating a nest box").

A nest box (`--nest --network none`) whose command is bench/lib/pyserver.py,
with one box inside it running the same server (or none), N rounds each:

  checkpoint   `checkpoint NEST --as K --leave-running` (the box inside is
               suspended, saved with the nest box, and resumed)
  restore      `restore K --name R -d` (the box inside resumed in R, checked
               to answer)
then the nest box frozen once (`freeze`), and N clones of it (`clone -d`,
the box inside resumed in each, checked to answer). Prints the medians.

Usage (root): nestsavebench.py NESTBOX ROOT N
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
GET = "import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:8080/', timeout=10).read().decode())"


def main() -> None:
    nestbox, root, n = sys.argv[1], sys.argv[2], int(sys.argv[3])

    def sh(*args: str) -> str:
        return subprocess.run([nestbox, "--root", root, *args], check=True, capture_output=True, text=True).stdout

    def timed(*args: str) -> float:
        t0 = time.perf_counter()
        sh(*args)
        return (time.perf_counter() - t0) * 1e3

    def answers(top: str) -> None:
        sh("exec", top, "--", "nestbox", "exec", "s", "--", "python3", "-c", GET)

    def wait_answer(args: list[str]) -> None:
        for _ in range(300):
            if subprocess.run([nestbox, "--root", root, *args, "python3", "-c", GET], capture_output=True).returncode == 0:
                return
            time.sleep(0.05)
        raise SystemExit(f"no answer from {args}")

    server = ["-v", f"{HERE}:/bench:ro", "--", "python3", "/bench/pyserver.py"]
    rows = {}
    for inside in (True, False):
        sh("run", "-d", "--name", "nest", "--nest", "--network", "none", *server)
        wait_answer(["exec", "nest", "--"])
        if inside:
            sh("exec", "nest", "--", "nestbox", "run", "-d", "--name", "s", "-v", "/bench:/bench:ro", "--", "python3", "/bench/pyserver.py")
            wait_answer(["exec", "nest", "--", "nestbox", "exec", "s", "--"])
        ck, rs, cl = [], [], []
        for i in range(n):
            ck.append(timed("checkpoint", "nest", "--as", f"k{i}", "--leave-running"))
            rs.append(timed("restore", f"k{i}", "--name", f"r{i}", "-d"))
            if inside:
                answers(f"r{i}")
            sh("rm", "-f", f"r{i}")
            sh("checkpoint", "rm", f"k{i}")
        freeze = timed("freeze", "nest", "--as", "t")
        for i in range(n):
            cl.append(timed("clone", "t", "-d", "--name", f"c{i}"))
            if inside:
                answers(f"c{i}")
        sh("rm", "-f", *[f"c{i}" for i in range(n)], "nest")
        m = statistics.median
        rows[inside] = (m(ck), m(rs), freeze, m(cl))
    print("| nest box | checkpoint --leave-running | restore -d | freeze (once) | clone -d |")
    print("|---|---:|---:|---:|---:|")
    for inside, (ck, rs, fz, cl) in rows.items():
        what = "with a server box inside" if inside else "no box inside"
        print(f"| {what} | {ck:.1f} ms | {rs:.1f} ms | {fz:.1f} ms | {cl:.1f} ms |")


if __name__ == "__main__":
    main()
