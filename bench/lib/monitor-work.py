"""Timed inside a box: nanoseconds per call of getppid (the call monitors
subscribe to in bench/monitor.sh) and per 1-byte dd-style read+write pair
(calls nobody subscribes to). Prints: getppid_ns rw_ns."""
import os
import sys
import time

n = int(sys.argv[1])
t = time.perf_counter_ns()
for _ in range(n):
    os.getppid()
ppid_ns = (time.perf_counter_ns() - t) / n

m = int(sys.argv[2])
src = os.open("/dev/zero", os.O_RDONLY)
dst = os.open("/dev/null", os.O_WRONLY)
t = time.perf_counter_ns()
for _ in range(m):
    os.write(dst, os.read(src, 1))
rw_ns = (time.perf_counter_ns() - t) / m
print(f"{ppid_ns:.0f} {rw_ns:.0f}")
