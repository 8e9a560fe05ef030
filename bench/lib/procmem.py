#!/usr/bin/env python3
"""Resident memory of groups of processes, from /proc/PID/smaps_rollup.

Usage: procmem.py < GROUPS
GROUPS has one group per line: a label, then the host pids whose memory is
added up for that group (e.g. "box-1 4242 4243"). Prints JSON:

    {"groups": [{"label": ..., "pids": [...], "rss_kib": N, "pss_kib": N}, ...],
     "count": N,
     "rss_kib": {"median": .., "min": .., "max": .., "total": ..},
     "pss_kib": {...}}

RSS counts every page a process maps, shared or not (so pages shared between
groups are counted in each); PSS divides each shared page by the number of
processes mapping it, so the PSS of all groups adds up to what they really
cost together. A pid that does not exist is an error (exit 1).
"""

from __future__ import annotations

import json
import statistics
import sys


def rollup(pid: int) -> dict[str, int]:
    """Rss and Pss in KiB of one process."""
    out: dict[str, int] = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("Rss", "Pss"):
                out[key] = int(rest.split()[0])
    return out


def spread(values: list[int]) -> dict[str, float]:
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "total": sum(values),
    }


def main() -> int:
    groups = []
    for line in sys.stdin:
        fields = line.split()
        if not fields:
            continue
        label, pids = fields[0], [int(p) for p in fields[1:]]
        rss = pss = 0
        for pid in pids:
            try:
                r = rollup(pid)
            except OSError as e:
                print(f"procmem.py: {label}: pid {pid}: {e}", file=sys.stderr)
                return 1
            rss += r["Rss"]
            pss += r["Pss"]
        groups.append({"label": label, "pids": pids, "rss_kib": rss, "pss_kib": pss})
    if not groups:
        print("procmem.py: no groups on stdin", file=sys.stderr)
        return 1
    result = {
        "groups": groups,
        "count": len(groups),
        "rss_kib": spread([g["rss_kib"] for g in groups]),
        "pss_kib": spread([g["pss_kib"] for g in groups]),
    }
    json.dump(result, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
