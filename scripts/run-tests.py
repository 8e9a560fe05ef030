#!/usr/bin/env python3
"""Run every test binary of the workspace and prove that each ran every test it lists.

cargo test alone cannot tell a binary that ran all its tests from one that ran
none (a harness ignoring filters prints "0 passed" and exits 0). So this script
asks cargo for the test binaries, asks each for its list (`--list`, libtest's
format), runs it in two passes — everything but the timing-sensitive `serial_`
tests, then those alone on one thread — and fails if any binary

  * reports a failure or exits non-zero,
  * ran fewer (or more) tests than it lists,
  * ignored a test (an ignored test is a skip, and CI fails on a skip).

Skips inside a test (a test that cannot run here) are a failure under CI=true
(crates/nestbox-testkit). Doc tests run afterwards through cargo. The last line is
"tests: N passed, M failed".

Usage: scripts/run-tests.py [cargo test options, e.g. -p nestbox-net]
"""

import json
import os
import re
import subprocess
import sys

RESULT = re.compile(
    r"^test result: (?:ok|FAILED)\. (\d+) passed; (\d+) failed; (\d+) ignored; (\d+) measured; (\d+) filtered out"
)
PASSES = [
    ("all but serial_", ["--skip", "serial_"]),
    ("serial_ alone", ["serial_", "--test-threads=1"]),
]


def test_binaries(cargo_args):
    """(label, executable, package directory) of every test binary cargo builds."""
    scope = [] if any(a in ("-p", "--package") for a in cargo_args) else ["--workspace"]
    cmd = ["cargo", "test", *scope, "--no-run", "--message-format=json-render-diagnostics", *cargo_args]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        sys.exit(f"run-tests: building the tests failed: {' '.join(cmd)}")
    found = []
    for line in proc.stdout.splitlines():
        try:
            msg = json.loads(line)
        except json.JSONDecodeError:
            continue
        if msg.get("reason") != "compiler-artifact" or not msg.get("executable"):
            continue
        if not msg.get("profile", {}).get("test"):
            continue
        target = msg["target"]
        package_dir = os.path.dirname(msg["manifest_path"])
        package = os.path.basename(package_dir)
        label = f"{package}::{target['name']}" if "lib" not in target["kind"] else f"{package} (unit)"
        found.append((label, msg["executable"], package_dir))
    return found


def listed(exe, cwd):
    out = subprocess.run([exe, "--list"], cwd=cwd, stdout=subprocess.PIPE, text=True, check=True).stdout
    return [line[: -len(": test")] for line in out.splitlines() if line.endswith(": test")]


def listed_exact(exe, cwd, name):
    out = subprocess.run([exe, "--list", "--exact", name], cwd=cwd, stdout=subprocess.PIPE, text=True, check=True).stdout
    return [line[: -len(": test")] for line in out.splitlines() if line.endswith(": test")]


def run_pass(exe, cwd, args, env):
    """Run one pass, echo its output, and return (passed, failed, ignored, exit code)."""
    proc = subprocess.Popen([exe, "-q", *args], cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    counts = None
    for line in proc.stdout:
        sys.stdout.write(line)
        m = RESULT.match(line.strip())
        if m:
            counts = tuple(int(g) for g in m.groups()[:3])
    code = proc.wait()
    sys.stdout.flush()
    if counts is None:
        return (0, 0, 0, code if code != 0 else 1)
    return (*counts, code)


def main():
    cargo_args = sys.argv[1:]
    problems = []
    total_passed = total_failed = 0
    binaries = test_binaries(cargo_args)
    if not binaries:
        sys.exit("run-tests: cargo built no test binary")
    for label, exe, cwd in binaries:
        names = listed(exe, cwd)
        # A harness that ignores libtest's filters would run everything (or
        # nothing) in each pass: check that an exact filter selects one test.
        if names and listed_exact(exe, cwd, names[0]) != [names[0]]:
            problems.append(f"{label}: does not honour libtest's filters (--list --exact {names[0]})")
        env = dict(os.environ, CARGO_MANIFEST_DIR=cwd, CARGO_PKG_NAME=os.path.basename(cwd))
        ran = passed = failed = ignored = 0
        bad_exit = False
        for pass_name, args in PASSES:
            # A pass that would select no test is not run (it would only print
            # "0 passed"); the count check below still covers every test.
            serial = [n for n in names if "serial_" in n]
            if not (serial if args[0] == "serial_" else [n for n in names if n not in serial]):
                continue
            print(f"== {label}: {pass_name}", flush=True)
            p, f, i, code = run_pass(exe, cwd, args, env)
            passed, failed, ignored = passed + p, failed + f, ignored + i
            ran += p + f
            if code != 0:
                bad_exit = True
        total_passed += passed
        total_failed += failed
        print(f"-- {label}: lists {len(names)}, ran {ran} ({passed} passed, {failed} failed, {ignored} ignored)", flush=True)
        if failed or bad_exit:
            problems.append(f"{label}: {failed} failed" + (" (non-zero exit)" if bad_exit else ""))
        if ran != len(names):
            problems.append(f"{label}: ran {ran} of the {len(names)} tests it lists")
        if ignored:
            problems.append(f"{label}: {ignored} ignored (a skipped test fails CI)")

    print("== doc tests", flush=True)
    scope = [] if any(a in ("-p", "--package") for a in cargo_args) else ["--workspace"]
    doc = subprocess.run(["cargo", "test", *scope, "--doc", "-q", *cargo_args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    # Crates without doc tests print an empty run; only the others are shown.
    for block in doc.stdout.split("\n\n"):
        if "running 0 tests" not in block and "0 passed; 0 failed; 0 ignored; 0 measured; 0 filtered out" not in block:
            sys.stdout.write(block.strip("\n") + "\n")
    for line in doc.stdout.splitlines():
        m = RESULT.match(line.strip())
        if m:
            p, f, i = (int(g) for g in m.groups()[:3])
            total_passed, total_failed = total_passed + p, total_failed + f
            if i:
                problems.append(f"doc tests: {i} ignored")
    if doc.returncode != 0:
        problems.append("doc tests failed")

    print()
    for problem in problems:
        print(f"run-tests: FAILED: {problem}")
    print(f"tests: {total_passed} passed, {total_failed} failed")
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
