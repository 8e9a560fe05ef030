#!/usr/bin/env python3
"""Checkpoint/restore benchmark driver (see bench/checkpoint.sh).

One run, interleaved, on the ~67 MiB Python HTTP server of bench/clone.sh
(plus a /grow path that adds 1 MiB of random data):
  * checkpoint time of the running server (`nestbox checkpoint --leave-running
    --json`): the first one (every page new to the pool) and later ones (pages
    already in the pool), wall time of the command and the box's frozen time;
  * pages written by a checkpoint after the server changed 1 MiB;
  * restore-to-first-answer (`nestbox restore` to the first HTTP answer on the
    restored box's own address) with the page pool in the page cache, side by
    side with a cold start (`nestbox run -d` to first answer) and a clone of a
    template of the same server (`nestbox clone -d` to first answer);
  * restore-to-first-answer after dropping the page cache (echo 3 >
    /proc/sys/vm/drop_caches), a few rounds;
  * restore --shared to first answer (a clone of the checkpoint's template,
    made by a first restore --shared before the rounds);
  * K boxes restored --shared from one checkpoint (and up to 20 restored each
    on its own): private memory of each idle box's process (smaps_rollup) and
    the MemAvailable drop per box.

Usage: ckptbench.py NESTBOX ROOT SERVER_FILE N K COLD OUT_JSON
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from clonebench import meminfo_available, private_bytes, sh, state_address, summary, wait_answer


def wait_pool(nestbox: str, root: str, template: str, pool: int) -> None:
    """Wait (bounded) until template's pool is full again."""
    end = time.monotonic() + 30
    while time.monotonic() < end:
        for t in json.loads(sh(nestbox, root, "template", "ls", "--json")):
            if t["name"] == template and t["pooled"] >= pool:
                return
        time.sleep(0.01)


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def checkpoint(nestbox: str, root: str, box: str, name: str) -> tuple[float, dict]:
    t0 = time.perf_counter()
    out = sh(nestbox, root, "checkpoint", box, "--as", name, "--leave-running", "--json")
    wall = (time.perf_counter() - t0) * 1e3
    return wall, json.loads(out)["stats"]


def main_pid(root: str, name: str) -> int:
    with open(f"{root}/run/boxes/{name}/state.json") as f:
        init = json.load(f)["init"]["pid"]
    with open(f"/proc/{init}/task/{init}/children") as f:
        return int(f.read().split()[0])


def drop_caches() -> None:
    subprocess.run(["sync"], check=True)
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def main() -> None:
    nestbox, root, server = sys.argv[1], sys.argv[2], sys.argv[3]
    n, k, cold_rounds, out = int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6]), sys.argv[7]
    vol = f"{server}:/srv.py:ro"
    sh(nestbox, root, "run", "-d", "--name", "srv", "-v", vol, "--", "python3", "/srv.py")
    addr = state_address(root, "srv")
    wait_answer(addr)
    rss = private_bytes(main_pid(root, "srv"))

    # Checkpoints: the first fills the pool; the next ones find their pages.
    first_wall, first = checkpoint(nestbox, root, "srv", "ck0")
    walls, frozen = [], []
    for i in range(1, n + 1):
        wall, st = checkpoint(nestbox, root, "srv", f"ck{i}")
        walls.append(wall)
        frozen.append(st["frozen_ms"])
        sh(nestbox, root, "checkpoint", "rm", f"ck{i}")
    # 1 MiB of new data, then a checkpoint: what it writes.
    wait_answer(addr)
    with __import__("socket").create_connection((addr, 8080), timeout=5) as s:
        s.sendall(b"GET /grow HTTP/1.0\r\n\r\n")
        while s.recv(65536):
            pass
    _, grown = checkpoint(nestbox, root, "srv", "grown")
    grown_written = grown["pages_written"] * 4096
    sh(nestbox, root, "checkpoint", "rm", "grown")

    # The template for the clones, from the same server.
    sh(nestbox, root, "run", "-d", "--name", "tpl", "-v", vol, "--", "python3", "/srv.py")
    wait_answer(state_address(root, "tpl"))
    sh(nestbox, root, "freeze", "tpl")

    restore_ms, lazy_ms, shared_ms, cold_ms, clone_ms = [], [], [], [], []
    # The checkpoint's template for `restore --shared`, made by a first one.
    pool = os.environ.get("POOL", "0")
    sh(nestbox, root, "restore", "ck0", "--shared", "--pool", pool, "--name", "first")
    sh(nestbox, root, "rm", "-f", "first")
    for i in range(n):
        def restore():
            sh(nestbox, root, "restore", "ck0", "--name", f"r{i}")
            wait_answer(state_address(root, f"r{i}"))

        def lazy():
            sh(nestbox, root, "restore", "ck0", "--lazy", "--name", f"l{i}")
            wait_answer(state_address(root, f"l{i}"))

        def shared():
            sh(nestbox, root, "restore", "ck0", "--shared", "--name", f"s{i}")
            wait_answer(state_address(root, f"s{i}"))

        if pool != "0":
            wait_pool(nestbox, root, "ckpt-ck0", int(pool))

        def cold():
            sh(nestbox, root, "run", "-d", "--name", f"c{i}", "-v", vol, "--", "python3", "/srv.py")
            wait_answer(state_address(root, f"c{i}"))

        def clone():
            sh(nestbox, root, "clone", "tpl", "-d", "--name", f"k{i}")
            wait_answer(state_address(root, f"k{i}"))

        restore_ms.append(timed(restore))
        lazy_ms.append(timed(lazy))
        shared_ms.append(timed(shared))
        cold_ms.append(timed(cold))
        clone_ms.append(timed(clone))
        sh(nestbox, root, "rm", "-f", f"r{i}", f"l{i}", f"s{i}", f"c{i}", f"k{i}")

    cold_cache_ms = []
    for i in range(cold_rounds):
        drop_caches()

        def restore():
            sh(nestbox, root, "restore", "ck0", "--name", f"d{i}")
            wait_answer(state_address(root, f"d{i}"))

        cold_cache_ms.append(timed(restore))
        sh(nestbox, root, "rm", "-f", f"d{i}")

    # K idle boxes restored --shared, then (fewer) restored each on its own.
    sh(nestbox, root, "rm", "-f", "tpl")
    idle = {}
    for mode, count in (("shared", k), ("alone", min(k, 20))):
        time.sleep(2)
        before = meminfo_available()
        names = [f"{mode}{i}" for i in range(count)]
        for name in names:
            extra = ["--shared"] if mode == "shared" else []
            sh(nestbox, root, "restore", "ck0", *extra, "--name", name)
        for name in names:
            wait_answer(state_address(root, name))
        time.sleep(3)
        after = meminfo_available()
        private = sorted(private_bytes(main_pid(root, name)) for name in names)
        idle[mode] = {
            "k": count,
            "private_bytes_median": private[len(private) // 2],
            "memavailable_drop_per_box": (before - after) / max(count, 1),
        }
        subprocess.run([nestbox, "--root", root, "rm", "-f", *names], capture_output=True, timeout=600)
    result = {
        "server_private_bytes": rss,
        "checkpoint_first": {"wall_ms": first_wall, **first},
        "checkpoint_again": {"wall": summary(walls), "frozen": summary(frozen)},
        "checkpoint_after_1mib": {"pages_written": grown["pages_written"], "bytes_written": grown_written},
        "restore_to_answer_warm": summary(restore_ms),
        "restore_lazy_to_answer_warm": summary(lazy_ms),
        "restore_shared_to_answer": summary(shared_ms),
        "cold_start_to_answer": summary(cold_ms),
        "clone_to_answer": summary(clone_ms),
        "restore_to_answer_cold_cache": summary(cold_cache_ms) if cold_cache_ms else None,
        "idle_restored": idle,
    }
    with open(out, "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
