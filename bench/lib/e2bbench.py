"""Timing of the E2B Python SDK against `nestbox serve --http` (bench/e2b.sh).

Interleaved rounds: each round creates one sandbox from the pooled `base`
template and one cold sandbox (template "host": a box of the host image started
with `run -d`, the same user and home, not a clone), times `Sandbox.create()`
to the SDK call returning, then `commands.run("true")` RUNS times in each, and
kills both. Prints a JSON object with the samples' medians and p90s (ms).
Needs E2B_API_URL, E2B_SANDBOX_URL and E2B_API_KEY in the environment.
"""

import json
import statistics
import sys
import time

from e2b import Sandbox

ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 20
RUNS = int(sys.argv[2]) if len(sys.argv) > 2 else 10
PAUSE = float(sys.argv[3]) if len(sys.argv) > 3 else 0.3


def ms(t0):
    return (time.perf_counter() - t0) * 1000


def summary(xs):
    xs = sorted(xs)
    return {
        "n": len(xs),
        "median_ms": round(statistics.median(xs), 2),
        "p90_ms": round(xs[int(0.9 * (len(xs) - 1))], 2),
        "min_ms": round(xs[0], 2),
    }


# Warm up: imports, the connection pools, the base template being ready.
w = Sandbox.create()
w.commands.run("true")
w.kill()

samples = {k: [] for k in ("pooled_create", "pooled_run_true", "cold_create", "cold_run_true")}
for _ in range(ROUNDS):
    for kind, template in (("pooled", "base"), ("cold", "host")):
        t0 = time.perf_counter()
        sb = Sandbox.create(template=template)
        samples[kind + "_create"].append(ms(t0))
        for _ in range(RUNS):
            t0 = time.perf_counter()
            r = sb.commands.run("true")
            samples[kind + "_run_true"].append(ms(t0))
            assert r.exit_code == 0
        sb.kill()
        # Let the pool refill, as it does between requests of a moderate rate.
        time.sleep(PAUSE)

print(json.dumps({k: summary(v) for k, v in samples.items()}, indent=2))
