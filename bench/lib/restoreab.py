#!/usr/bin/env python3
"""Restore-to-first-answer of two nestbox builds, interleaved (issue 13).

Both builds restore the same checkpoint in the same root, eager and
`--lazy`, each round in random order, so the machine's load falls on both
alike: a change to the restore path is compared with the build before it
more tightly than two `bench/checkpoint.sh` runs one after the other. The
root must hold checkpoint CKPT of a server answering HTTP on port 8080 (as
bench/checkpoint.sh's, e.g. `nestbox --root ROOT run -d --name srv -v
bench/lib/pyserver.py:/srv.py:ro -- python3 /srv.py`, then `nestbox --root
ROOT checkpoint srv --as CKPT --leave-running`). Prints, per mode and build,
the median time to the first answer, its p90 and minimum, and the medians of
the command's own `restore_ms` and `shell_ms`.

Usage (root): restoreab.py BASE_NESTBOX NEW_NESTBOX ROOT CKPT N
"""

from __future__ import annotations

import json
import random
import statistics
import sys
import time

from clonebench import sh, state_address, wait_answer


def main() -> None:
    base, new, root, ckpt, n = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])
    got: dict[tuple[str, str], list[tuple[float, float, float]]] = {}
    for i in range(n):
        for mode in ("eager", "lazy"):
            order = [("base", base), ("new", new)]
            random.shuffle(order)
            for which, nestbox in order:
                name = f"ab{which[0]}{mode[0]}{i}"
                extra = ["--lazy"] if mode == "lazy" else []
                t0 = time.perf_counter()
                out = json.loads(sh(nestbox, root, "restore", ckpt, *extra, "--name", name, "--json"))
                wait_answer(state_address(root, name))
                ms = (time.perf_counter() - t0) * 1e3
                got.setdefault((mode, which), []).append((ms, out["restore_ms"], out["shell_ms"]))
                sh(nestbox, root, "rm", "-f", name)
    for (mode, which), rows in sorted(got.items()):
        answer = sorted(r[0] for r in rows)
        p90 = answer[max(0, int(len(answer) * 0.9) - 1)]
        print(
            f"{mode:5} {which:4} n={len(rows)} to first answer median {statistics.median(answer):6.1f} ms"
            f" (p90 {p90:6.1f}, min {answer[0]:6.1f}); restore_ms {statistics.median(r[1] for r in rows):6.1f};"
            f" shell_ms {statistics.median(r[2] for r in rows):5.1f}"
        )
    for mode in ("eager", "lazy"):
        b = statistics.median(r[0] for r in got[(mode, "base")])
        w = statistics.median(r[0] for r in got[(mode, "new")])
        print(f"{mode}: new/base = {w / b:.2f}")


if __name__ == "__main__":
    main()
