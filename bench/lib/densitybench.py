#!/usr/bin/env python3
"""Driver of bench/density.sh: K idle clones of a small Python HTTP server
with networking, the start of a new box before and while they idle, and the
time to make and remove them. See bench/density.sh.

usage: densitybench.py NESTBOX ROOT K N SUBNET OUT.json
"""

import json
import os
import random
import statistics
import subprocess
import sys
import time

from clonebench import http_get, private_bytes, settled_available, sh, state_address, wait_answer

# A small server: the standard library's HTTP server, a counter.
SERVER = """import http.server
count = 0
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        global count
        count += 1
        body = f"{count}\\n".encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a):
        pass
http.server.HTTPServer(("0.0.0.0", 8080), H).serve_forever()
"""


def starts(nestbox: str, root: str, n: int) -> list[float]:
    """Wall times (ms) of `run --rm -- /bin/true`, default network."""
    out = []
    for _ in range(n + 3):
        t = time.perf_counter()
        sh(nestbox, root, "run", "--rm", "--", "/bin/true")
        out.append((time.perf_counter() - t) * 1e3)
        time.sleep(0.05)
    return out[3:]


def busy_cpu_s() -> float:
    """CPU seconds the whole machine has spent not idle (every process and
    the kernel's own threads: user, nice, system, irq, softirq, steal)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields[:8]
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def settle(limit_s: float) -> float:
    """Wait (up to `limit_s`) until the machine is quiet: under 5 % of one CPU
    busy over a second. The kernel frees the namespaces of boxes removed by
    an earlier run in the background for a minute or more; that work would
    otherwise be counted as this run's. Returns the seconds waited."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < limit_s:
        b = busy_cpu_s()
        time.sleep(1)
        if busy_cpu_s() - b < 0.05:
            break
    return time.perf_counter() - t0


def main() -> None:
    nestbox, root, k, n, subnet, out = sys.argv[1:7]
    k, n = int(k), int(n)
    server = os.path.join(root, "srv.py")
    with open(server, "w") as f:
        f.write(SERVER)
    result: dict = {"clones": k, "subnet": subnet, "load_before": os.getloadavg()[0]}

    settle_max = float(os.environ.get("SETTLE_MAX", "120"))
    settle(settle_max)
    empty = starts(nestbox, root, n)
    sh(nestbox, root, "network", "create", "dense", "--subnet", subnet)
    sh(nestbox, root, "run", "-d", "--name", "tpl", "--network", "dense",
       "-v", f"{server}:/srv.py:ro", "--", "python3", "/srv.py")
    wait_answer(state_address(root, "tpl"))
    sh(nestbox, root, "freeze", "tpl")
    # IDLE_WAIT and DROP_CACHES as in clonebench.py: the boxes of the starts
    # above are freed by the kernel in the background for a while.
    idle_wait = float(os.environ.get("IDLE_WAIT", "2"))
    drop_caches = os.environ.get("DROP_CACHES") == "1"
    time.sleep(max(1.0, idle_wait))

    settled_s = settle(settle_max)
    before = settled_available(drop_caches)
    t, cpu0 = time.perf_counter(), busy_cpu_s()
    names = sh(nestbox, root, "clone", "tpl", "-d", "-n", str(k), "--name", "c",
               timeout=1800).split()
    create_s = time.perf_counter() - t
    create_cpu_s = busy_cpu_s() - cpu0
    time.sleep(idle_wait)
    after = settled_available(drop_caches)
    if len(names) != k:
        raise SystemExit(f"clone -n {k} made {len(names)} clones")
    sample = random.Random(1).sample(names, min(20, k))
    privates = []
    for name in sample:
        answer = http_get(state_address(root, name))
        body = answer.split(b"\r\n\r\n", 1)[-1]
        if not answer.startswith(b"HTTP/1.0 200") or not body.strip().isdigit():
            raise SystemExit(f"clone {name} answered {answer!r}")
        st = json.loads(sh(nestbox, root, "inspect", name))["state"]
        privates.append(private_bytes(st["clone"]["process"]["pid"]))
    busy = starts(nestbox, root, n)

    t = time.perf_counter()
    sh(nestbox, root, "rm", "-f", *names, timeout=1800)
    remove_s = time.perf_counter() - t
    sh(nestbox, root, "rm", "-f", "tpl")
    for _ in range(100):
        if not json.loads(sh(nestbox, root, "ps", "-a", "--json")):
            break
        time.sleep(0.1)
    sh(nestbox, root, "network", "rm", "dense")

    med = statistics.median
    result.update({
        "create_s": create_s,
        "create_ms_per_clone": create_s * 1e3 / k,
        "create_cpu_s": create_cpu_s,
        "create_cpu_ms_per_clone": create_cpu_s * 1e3 / k,
        "settled_s": settled_s,
        "remove_s": remove_s,
        "mem_available_drop_mib": (before - after) / 2**20,
        "mem_available_drop_per_clone_kib": (before - after) / 1024 / k,
        "caches_dropped_before_readings": drop_caches,
        "idle_wait_s": idle_wait,
        "private_per_clone_median_kib": med(privates) / 1024,
        "start_empty_ms": med(empty),
        "start_while_idle_ms": med(busy),
        "start_ratio": med(busy) / med(empty),
        "load_after": os.getloadavg()[0],
    })
    with open(out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"| what | figure | target |\n|---|---:|---|")
    print(f"| `clone tpl -d -n {k}` | {create_s:.2f} s ({create_s * 1e3 / k:.1f} ms a clone) | ≤ 10 s |")
    print(f"| CPU busy during the create (all processes and kernel threads) | {create_cpu_s:.2f} s ({create_cpu_s * 1e3 / k:.1f} ms a clone; machine quiet after {settled_s:.0f} s) | |")
    print(f"| MemAvailable drop | {(before - after) / 1024 / k:.0f} KiB a clone ({(before - after) / 2**20:.0f} MiB) | ≤ 512 KiB |")
    print(f"| private memory of a clone's process (median of {len(sample)}) | {med(privates) / 1024:.0f} KiB | |")
    print(f"| `rm -f` of the {k} | {remove_s:.2f} s | ≤ 10 s |")
    print(f"| `run --rm -- /bin/true`: empty host / {k} clones idle | {med(empty):.2f} / {med(busy):.2f} ms ({med(busy) / med(empty):.2f}×) | ≤ 1.5× |")


if __name__ == "__main__":
    main()
