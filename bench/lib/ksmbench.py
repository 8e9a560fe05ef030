#!/usr/bin/env python3
"""Same-page merging (KSM) of boxes: what it saves and what the scanner costs.

N boxes started with `--ksm` fill MIB MiB each with the same data (every page
holds its own index, so pages are alike across boxes, not within one). With the
scanner stopped, MemAvailable is read; then for each scanner setting in turn
(`nestbox ksm --on --pages-to-scan P --sleep-ms S`), starting from nothing
merged, the scanner runs until the host's pages_sharing stops growing: the
wall time to merge, the CPU time ksmd used for it (and as a share of one CPU),
and the MemAvailable gained. Then the scanner's steady cost with nothing new to
merge: ksmd CPU time over IDLE_S seconds, as a share of one CPU. The host's
scanner settings are put back at the end.

Usage: ksmbench.py NESTBOX ROOT N MIB IDLE_S OUT_JSON SETTINGS...
SETTINGS are PAGES:SLEEP_MS pairs, e.g. 100:20 (the kernel's default) 5000:10.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

KSM = "/sys/kernel/mm/ksm"

FILL = r"""
import mmap, struct, sys, time
n = int(sys.argv[1]) * 256
m = mmap.mmap(-1, n * 4096, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
for i in range(n):
    m[i * 4096:(i + 1) * 4096] = struct.pack('Q', i + 1) * 512
print('ready', flush=True)
while True:
    time.sleep(3600)
"""


def sh(nb: str, root: str, *args: str) -> str:
    out = subprocess.run([nb, "--root", root, *args], capture_output=True, text=True, timeout=300)
    if out.returncode != 0:
        raise SystemExit(f"nestbox {' '.join(args)} failed: {out.stderr.strip()}")
    return out.stdout


def host(nb: str, root: str) -> dict:
    return json.loads(sh(nb, root, "ksm", "--json"))


def mem_available() -> int:
    for line in open("/proc/meminfo"):
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def unmerge_all() -> None:
    # run=2 unmerges every merged page and stops the scanner.
    with open(f"{KSM}/run", "w") as f:
        f.write("2")


def main() -> None:
    nb, root, n, mib, idle_s, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5]), sys.argv[6]
    settings = [tuple(int(x) for x in s.split(":")) for s in sys.argv[7:]] or [(100, 20)]
    saved = {f: open(f"{KSM}/{f}").read().strip() for f in ("run", "pages_to_scan", "sleep_millisecs")}
    names = [f"ksm{i}" for i in range(n)]
    results = []
    try:
        unmerge_all()
        for name in names:
            sh(nb, root, "run", "-d", "--ksm", "--network", "none", "--name", name, "--", "python3", "-c", FILL, str(mib))
        for name in names:
            deadline = time.time() + 120
            while "ready" not in sh(nb, root, "logs", name):
                if time.time() > deadline:
                    raise SystemExit(f"{name} did not get ready")
                time.sleep(0.2)
        for pages, sleep_ms in settings:
            unmerge_all()
            time.sleep(2)
            before_avail = mem_available()
            h0 = host(nb, root)
            t0 = time.perf_counter()
            sh(nb, root, "ksm", "--on", "--pages-to-scan", str(pages), "--sleep-ms", str(sleep_ms))
            # Merged when pages_sharing has not grown for two full scans.
            last, stable_scans, scans_seen = -1, 0, h0["full_scans"]
            while True:
                time.sleep(0.2)
                h = host(nb, root)
                if h["full_scans"] > scans_seen:
                    scans_seen = h["full_scans"]
                    stable_scans = stable_scans + 1 if h["pages_sharing"] == last and last > 0 else 0
                    last = h["pages_sharing"]
                if stable_scans >= 2 or time.perf_counter() - t0 > 900:
                    break
            merge_s = time.perf_counter() - t0
            h1 = host(nb, root)
            after_avail = mem_available()
            # Steady cost: nothing new to merge, the scanner keeps scanning.
            c0, w0 = host(nb, root)["ksmd_cpu_ms"], time.perf_counter()
            time.sleep(idle_s)
            c1, w1 = host(nb, root)["ksmd_cpu_ms"], time.perf_counter()
            cpu_merge_ms = h1["ksmd_cpu_ms"] - h0["ksmd_cpu_ms"]
            results.append({
                "pages_to_scan": pages,
                "sleep_ms": sleep_ms,
                "merge_wall_s": merge_s,
                "ksmd_cpu_ms_to_merge": cpu_merge_ms,
                "ksmd_cpu_share_while_merging": cpu_merge_ms / 1e3 / merge_s,
                "pages_sharing": h1["pages_sharing"],
                "pages_shared": h1["pages_shared"],
                "mem_available_gained_mib": (after_avail - before_avail) / 2**20,
                "ksmd_cpu_share_steady": (c1 - c0) / 1e3 / (w1 - w0),
            })
            print(json.dumps(results[-1]), flush=True)
    finally:
        subprocess.run([nb, "--root", root, "rm", "-f", *names], capture_output=True, timeout=300)
        unmerge_all()
        for f, v in (("pages_to_scan", saved["pages_to_scan"]), ("sleep_millisecs", saved["sleep_millisecs"]), ("run", saved["run"])):
            with open(f"{KSM}/{f}", "w") as fh:
                fh.write(v)
    result = {"boxes": n, "mib_each": mib, "data_mib": n * mib, "idle_s": idle_s, "settings": results}
    with open(out, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
