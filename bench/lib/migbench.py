#!/usr/bin/env python3
"""Live migration against stop-and-copy, side by side (bench/migrate.sh).

Usage: migbench.py NESTBOX ROOT_A ROOT_B NETNS ADDR_B SERVER N MIB RATE OUT

Root A is on this host's network, root B in network namespace NETNS
(reached at ADDR_B): two hosts. Each round starts the server of
migserver.py (MIB MiB, RATE MiB/s rewritten) in a fresh box on A, lets it
run 2 s, and moves it to B, alternately with `nestbox migrate` (pre-copy)
and with `nestbox checkpoint -o - | nestbox restore -` (stop and copy), while
a client sends GET /req/ID every millisecond or so to A, switching to B once
A stops answering. Measured: the longest gap between two answers the client
saw (the downtime as a client sees it), the command's own time, and for
migrate its figures (rounds, bytes, the stop as it measures it). Every
request the client saw answered must be counted by the box on B.
"""
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time

nestbox, root_a, root_b, netns, addr_b, server, n, mib, rate, out = sys.argv[1:]
N, MIB, RATE = int(n), int(mib), int(rate)
PORT = 18700


def a(*args, check=True, **kw):
    return subprocess.run([nestbox, "--root", root_a, *args], check=check,
                          capture_output=True, text=True, **kw)


def b_cmd(*args):
    return ["nsenter", f"--net=/run/netns/{netns}", nestbox, "--root", root_b, *args]


def b(*args, check=True, **kw):
    return subprocess.run(b_cmd(*args), check=check, capture_output=True, text=True, **kw)


def get(host, path, timeout=1.0):
    try:
        with socket.create_connection((host, PORT), timeout=timeout) as s:
            s.settimeout(timeout)
            s.sendall(f"GET {path} HTTP/1.0\r\n\r\n".encode())
            data = b""
            while True:
                chunk = s.recv(4096)
                if not chunk:
                    break
                data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        return body.decode() if head.startswith(b"HTTP/1.0 200") else None
    except OSError:
        return None


class Client(threading.Thread):
    """Requests with ids 0, 1, … each retried until answered, at A then at B."""

    def __init__(self):
        super().__init__(daemon=True)
        self.stop = False
        self.answers = []  # time of each answer
        self.answered = 0

    def run(self):
        hosts = ["127.0.0.1", addr_b]
        at = 0
        rid = 0
        while not self.stop:
            while not self.stop:
                if get(hosts[at], f"/req/{rid}") is not None:
                    break
                at = 1 - at if get(hosts[1 - at], "/", 0.2) is not None else at
                time.sleep(0.001)
            else:
                break
            self.answers.append(time.perf_counter())
            rid += 1
            self.answered = rid
            time.sleep(0.001)


def start_box():
    a("run", "-d", "--name", "web", "-p", f"{PORT}:8080", "-v", f"{server}:/app/s.py:ro",
      "--", "python3", "/app/s.py", str(MIB), str(RATE))
    for _ in range(300):
        if "ready" in a("logs", "web").stdout:
            break
        time.sleep(0.1)
    time.sleep(2)


def clean_b():
    b("rm", "-f", "web", check=False)
    names = json.loads(b("checkpoint", "ls", "--json").stdout)
    for c in names:
        b("checkpoint", "rm", c["name"], check=False)


def one(mode, r):
    start_box()
    client = Client()
    client.start()
    time.sleep(0.5)
    t0 = time.perf_counter()
    if mode in ("migrate", "migrate-lazy"):
        recv = subprocess.Popen(b_cmd("receive", "--listen", f"{addr_b}:7171"),
                                stdout=subprocess.PIPE, text=True)
        assert recv.stdout.readline().startswith("listening")
        t0 = time.perf_counter()
        lazy = ["--lazy"] if mode == "migrate-lazy" else []
        res = a("migrate", "web", "--to", f"tcp:{addr_b}:7171", "--json", *lazy)
        elapsed = time.perf_counter() - t0
        recv.wait(timeout=60)
        stats = json.loads(res.stdout)
    else:
        send = subprocess.Popen([nestbox, "--root", root_a, "checkpoint", "web", "-o", "-"],
                                stdout=subprocess.PIPE)
        subprocess.run(b_cmd("restore", "-", "--name", "web"), stdin=send.stdout,
                       check=True, capture_output=True)
        send.wait()
        elapsed = time.perf_counter() - t0
        assert send.returncode == 0
        a("rm", "-f", "web")
        stats = {}
    time.sleep(0.5)
    client.stop = True
    client.join()
    t = client.answers
    gaps = [y - x for x, y in zip(t, t[1:]) if y > t0 - 0.5]
    counted = int(get(addr_b, "/"))
    assert counted == client.answered, f"{mode}: {counted} counted, {client.answered} answered"
    clean_b()
    return {"mode": mode, "gap_ms": max(gaps) * 1e3, "command_ms": elapsed * 1e3,
            "requests": client.answered, **{k: stats[k] for k in
            ("downtime_ms", "save_ms", "files_ms", "handover_ms", "answer_ms", "total_ms", "bytes", "last_read") if k in stats},
            "rounds": len(stats.get("rounds", [])),
            "restore_ms": stats.get("arrived", {}).get("restore_ms"),
            "shell_ms": stats.get("arrived", {}).get("shell_ms"),
            "target_ms": stats.get("arrived", {}).get("target_ms"),
            "unpack_ms": stats.get("arrived", {}).get("unpack_ms")}


# MODES: which, interleaved in each round (migrate-lazy: `migrate --lazy`,
# the target restores lazily).
MODES = os.environ.get("MODES", "migrate stop-and-copy").split()
results = []
for r in range(N):
    for mode in MODES:
        res = one(mode, r)
        print(json.dumps(res), file=sys.stderr, flush=True)
        results.append(res)


def med(mode, key):
    vals = [x[key] for x in results if x["mode"] == mode and x.get(key) is not None]
    return statistics.median(vals) if vals else None


summary = {m: {k: med(m, k) for k in ("gap_ms", "command_ms", "downtime_ms", "save_ms",
                                      "files_ms", "handover_ms", "answer_ms", "restore_ms", "shell_ms", "target_ms",
                                      "unpack_ms", "total_ms",
                                      "bytes", "rounds", "requests")}
           for m in MODES}
if "migrate" in MODES and "stop-and-copy" in MODES:
    summary["gap_ratio"] = summary["migrate"]["gap_ms"] / summary["stop-and-copy"]["gap_ms"]
summary["mib"], summary["rate_mib_s"], summary["n"] = MIB, RATE, N
json.dump({"summary": summary, "runs": results}, open(out, "w"), indent=1)
print(json.dumps(summary, indent=1))
