#!/usr/bin/env python3
"""Freeze/clone benchmark driver (see bench/clone.sh).

Measures, side by side in one run, against a cold start of the same server:
  * clone-to-ready through the API: from sending {"op":"clone"} to a running
    `nestbox serve` (Unix socket) to the clone's first HTTP answer on its own
    bridge address (the answer carries the address), both with a new
    connection for each request and on one connection kept open (as a front
    end that makes clones at a rate holds it);
  * clone-to-ready through the CLI: from starting `nestbox clone TEMPLATE -d` to
    the first answer (the address read from the clone's state.json), plus the
    fork alone (the time nestbox records for the remote fork in the clone's state);
  * cold start: from starting `nestbox run -d` of the same server to its first answer;
  * freeze time of the template;
  * memory: private memory of idle clones (smaps_rollup), and the drop of
    MemAvailable for K idle clones beyond the template.
Cold starts and clones are interleaved so both see the same machine noise.

With POOL > 0 the template is frozen with `--pool POOL`: clones are claimed from
the pool (forked ahead of time) and the pool refills in the background.

Every answer is fetched with the same minimal HTTP/1.0 client on a raw socket.

The server is SERVER_FILE, mounted read-only into each box at /srv.<its
extension> and started with COMMAND (a JSON list naming that path; default
["python3", "/srv.py"]).

With KSM=1 in the environment the template runs with `--ksm` (its clones
inherit it) and, after the measurement above, the host's KSM scanner runs
(5000 pages every 10 ms) until what it merges stops growing for two full
scans; the MemAvailable drop is then read again (`..._after_ksm`), and the
scanner's settings are put back.

With DROP_CACHES=1 the page cache and the reclaimable slab caches are dropped
(after a sync) just before each of the two MemAvailable readings of the idle
clones, so that what the page cache does meanwhile (files read and written by
the benchmark and the rest of the machine) does not move the figure: the drop
then counts only memory nothing can reclaim, which is steadier between runs
(the default readings spread by about +-200 KiB a clone here). IDLE_WAIT=S
waits S seconds (default 2) between the clones' creation and the second
reading: idle boxes give memory back after a second of idleness (their
monitor's and init's), the last ones made a few seconds after the first; and
as long (at least 1 s) before the first reading, while the kernel frees what
the boxes removed before it held.

Usage: clonebench.py NESTBOX ROOT SERVER_FILE N K POOL OUT_JSON API_SOCKET [COMMAND]
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import time

from jsonlines import exchange  # bench/lib, beside this script


def sh(nestbox: str, root: str, *args: str, timeout: float = 120) -> str:
    out = subprocess.run([nestbox, "--root", root, *args], capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        raise SystemExit(f"nestbox {' '.join(args)} failed: {out.stderr.strip()}")
    return out.stdout


def state_address(root: str, name: str) -> str:
    """The box's address from its state.json (no nestbox process: as cheap
    for a clone as for a cold start)."""
    with open(f"{root}/run/boxes/{name}/state.json") as f:
        return json.load(f)["network"]["address"]


def address(nestbox: str, root: str, name: str) -> str:
    state = json.loads(sh(nestbox, root, "inspect", name))["state"]
    return state["network"]["address"]


def http_get(addr: str) -> bytes:
    with socket.create_connection((addr, 8080), timeout=2) as s:
        s.sendall(b"GET / HTTP/1.0\r\n\r\n")
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    # Python's http.server answers HTTP/1.0, Node's http module HTTP/1.1.
    if not data.startswith((b"HTTP/1.0 200", b"HTTP/1.1 200")):
        raise OSError(f"bad answer {data[:40]!r}")
    return data


def api_call(s: socket.socket, name: str) -> dict:
    """One clone request on the connected socket `s`."""
    data = exchange(s, {"op": "clone", "template": "tpl", "name": name})
    answer = json.loads(data)
    if not answer.get("ok"):
        raise SystemExit(f"api clone failed: {answer}")
    return answer


def api_clone(sock_path: str, name: str) -> dict:
    """One clone request on a connection of its own."""
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(sock_path)
        return api_call(s, name)


def wait_answer(addr: str, limit: float = 30.0) -> None:
    end = time.monotonic() + limit
    while True:
        try:
            http_get(addr)
            return
        except OSError:
            if time.monotonic() > end:
                raise SystemExit(f"no answer from {addr}:8080 within {limit}s")
            time.sleep(0.0005)


def wait_pool(nestbox: str, root: str, pool: int) -> None:
    """Wait (bounded) until the template's pool is full again."""
    end = time.monotonic() + 30
    while pool and time.monotonic() < end:
        if json.loads(sh(nestbox, root, "template", "ls", "--json"))[0]["pooled"] >= pool:
            return
        time.sleep(0.01)


def pct(values: list[float], p: float) -> float:
    v = sorted(values)
    k = (len(v) - 1) * p / 100
    lo, hi = int(k), min(int(k) + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def summary(values: list[float]) -> dict:
    return {
        "n": len(values),
        "median_ms": statistics.median(values),
        "p90_ms": pct(values, 90),
        "p99_ms": pct(values, 99),
        "min_ms": min(values),
    }


def meminfo_available() -> int:
    for line in open("/proc/meminfo"):
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def settled_available(drop_caches: bool) -> int:
    """MemAvailable; with `drop_caches`, read right after dropping the page
    cache and reclaimable slab caches (and a second's pause)."""
    if drop_caches:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        time.sleep(1)
    return meminfo_available()


def merge_with_ksm(nestbox: str, root: str) -> dict:
    """Run the host's KSM scanner until it has merged what it can (pages_sharing
    unchanged over two full scans); MemAvailable then, and the scanner's
    figures. The scanner's settings are put back."""
    ksm = "/sys/kernel/mm/ksm"
    saved = {f: open(f"{ksm}/{f}").read().strip() for f in ("run", "pages_to_scan", "sleep_millisecs")}
    try:
        h0 = json.loads(sh(nestbox, root, "ksm", "--json"))
        t0 = time.perf_counter()
        sh(nestbox, root, "ksm", "--on", "--pages-to-scan", "5000", "--sleep-ms", "10")
        last, stable, scans = -1, 0, h0["full_scans"]
        while stable < 2 and time.perf_counter() - t0 < 600:
            time.sleep(0.2)
            h = json.loads(sh(nestbox, root, "ksm", "--json"))
            if h["full_scans"] > scans:
                scans = h["full_scans"]
                stable = stable + 1 if h["pages_sharing"] == last else 0
                last = h["pages_sharing"]
        merge_s = time.perf_counter() - t0
        time.sleep(1)
        available = meminfo_available()
        h1 = json.loads(sh(nestbox, root, "ksm", "--json"))
    finally:
        for f in ("pages_to_scan", "sleep_millisecs", "run"):
            with open(f"{ksm}/{f}", "w") as fh:
                fh.write(saved[f])
    return {
        "available": available,
        "ksm": {
            "merge_wall_s": merge_s,
            "ksmd_cpu_ms": h1["ksmd_cpu_ms"] - h0["ksmd_cpu_ms"],
            "pages_sharing": h1["pages_sharing"],
            "pages_shared": h1["pages_shared"],
        },
    }


def private_bytes(pid: int) -> int:
    total = 0
    for line in open(f"/proc/{pid}/smaps_rollup"):
        if line.startswith(("Private_Clean:", "Private_Dirty:")):
            total += int(line.split()[1]) * 1024
    return total


def main() -> None:
    nestbox, root, server = sys.argv[1], sys.argv[2], sys.argv[3]
    n, k, pool, out = int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6]), sys.argv[7]
    api_socket = sys.argv[8]
    command = json.loads(sys.argv[9]) if len(sys.argv) > 9 else ["python3", "/srv.py"]
    inside = "/srv" + server[server.rfind("."):]
    vol = f"{server}:{inside}:ro"
    # The template: started, warmed with a request, frozen.
    t0 = time.perf_counter()
    ksm = os.environ.get("KSM") == "1"
    sh(nestbox, root, "run", "-d", "--name", "tpl", "-v", vol, *(["--ksm"] if ksm else []), "--", *command)
    taddr = address(nestbox, root, "tpl")
    wait_answer(taddr)
    template_cold_ms = (time.perf_counter() - t0) * 1e3
    sh(nestbox, root, "freeze", "tpl", "--pool", str(pool))
    tstate = json.loads(sh(nestbox, root, "inspect", "tpl"))["state"]
    freeze_ms = tstate["template"]["freeze_ms"]
    tpid = tstate["template"]["process"]["pid"]
    template_rss = sum(int(l.split()[1]) for l in open(f"/proc/{tpid}/smaps_rollup") if l.startswith("Rss:")) * 1024

    clone_ms, command_ms, fork_ms, cold_ms = [], [], [], []
    api_ms, api_call_ms, kept_ms, kept_call_ms = [], [], [], []
    kept = socket.socket(socket.AF_UNIX)
    kept.connect(api_socket)
    for i in range(n):
        # Clone to ready through the API: a connection for each request, and
        # the connection kept open.
        for name, call, call_ms, ready_ms in (
            (f"a{i}", lambda n: api_clone(api_socket, n), api_call_ms, api_ms),
            (f"k{i}", lambda n: api_call(kept, n), kept_call_ms, kept_ms),
        ):
            t = time.perf_counter()
            answer = call(name)
            call_ms.append((time.perf_counter() - t) * 1e3)
            wait_answer(answer["address"])
            ready_ms.append((time.perf_counter() - t) * 1e3)
            sh(nestbox, root, "rm", "-f", name)
            wait_pool(nestbox, root, pool)
        # Clone to ready through the CLI.
        name = f"c{i}"
        t = time.perf_counter()
        sh(nestbox, root, "clone", "tpl", "-d", "--name", name)
        command_ms.append((time.perf_counter() - t) * 1e3)
        wait_answer(state_address(root, name))
        clone_ms.append((time.perf_counter() - t) * 1e3)
        st = json.loads(sh(nestbox, root, "inspect", name))["state"]
        fork_ms.append(st["clone"]["fork_ms"])
        sh(nestbox, root, "rm", "-f", name)
        wait_pool(nestbox, root, pool)
        # Cold start of the same server in a fresh box.
        name = f"cold{i}"
        t = time.perf_counter()
        sh(nestbox, root, "run", "-d", "--name", name, "-v", vol, "--", *command)
        wait_answer(state_address(root, name))
        cold_ms.append((time.perf_counter() - t) * 1e3)
        sh(nestbox, root, "rm", "-f", name)
    kept.close()

    # K idle clones: private memory each, and what they take from the machine.
    drop_caches = os.environ.get("DROP_CACHES") == "1"
    idle_wait = float(os.environ.get("IDLE_WAIT", "2"))
    # What the boxes removed above still hold (network namespaces, cgroups)
    # is freed by the kernel in the background: wait as long before the
    # first reading as before the second.
    time.sleep(max(1.0, idle_wait))
    before = settled_available(drop_caches)
    names = sh(nestbox, root, "clone", "tpl", "-d", "-n", str(k), "--name", "idle", timeout=900).split()
    time.sleep(idle_wait)
    after = settled_available(drop_caches)
    after_ksm = merge_with_ksm(nestbox, root) if ksm else None
    privates = []
    for name in names:
        st = json.loads(sh(nestbox, root, "inspect", name))["state"]
        privates.append(private_bytes(st["clone"]["process"]["pid"]))
    sh(nestbox, root, "rm", "-f", *names, timeout=900)
    sh(nestbox, root, "rm", "-f", "tpl")

    result = {
        "command": command,
        "pool": pool,
        "template_rss_bytes": template_rss,
        "template_first_answer_ms": template_cold_ms,
        "freeze_ms": freeze_ms,
        "api_clone_to_ready": summary(api_ms),
        "api_request_only": summary(api_call_ms),
        "api_speedup_median": statistics.median(cold_ms) / statistics.median(api_ms),
        "api_kept_clone_to_ready": summary(kept_ms),
        "api_kept_request_only": summary(kept_call_ms),
        "api_kept_speedup_median": statistics.median(cold_ms) / statistics.median(kept_ms),
        "clone_to_ready": summary(clone_ms),
        "clone_command_only": summary(command_ms),
        "fork_only": summary(fork_ms),
        "cold_start_to_ready": summary(cold_ms),
        "speedup_median": statistics.median(cold_ms) / statistics.median(clone_ms),
        "idle_clones": k,
        "private_per_clone_median_kib": statistics.median(privates) / 1024,
        "mem_available_drop_total_mib": (before - after) / 2**20,
        "mem_available_drop_per_clone_kib": (before - after) / 1024 / max(k, 1),
        "caches_dropped_before_readings": drop_caches,
        "idle_wait_s": idle_wait,
    }
    if after_ksm is not None:
        result["ksm"] = after_ksm["ksm"]
        result["mem_available_drop_per_clone_kib_after_ksm"] = (before - after_ksm["available"]) / 1024 / max(k, 1)
    with open(out, "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
