#!/usr/bin/env python3
"""Stress and fault suite driver (see bench/stress.sh and bench/README.md).

Phase 1 (stress): CLIENTS threads perform CYCLES operations in all (one
operation = one cycle), each a random pick of run --rm, run -d, exec, stop,
rm -f, freeze --as T [--pool N], clone T (CLI), clone T (through `nestbox
serve`'s socket), template rm T, network pool N, pool size N (the pool of box
shells, which runs then claim from), on box and template names
shared by all clients, so that they race on the same objects.

Phase 2 (faults): KILLS cycles; each starts an operation and SIGKILLs, after a
random 0-50 ms, the CLI, the monitor of the box concerned, or `nestbox serve`;
then runs `nestbox gc`.

Every outcome is checked: success, or exit code 125/126/127 (or the command's
own status for run/exec) with one line `nestbox: error: MESSAGE` where MESSAGE
matches a row of docs/errors.md of an allowed kind. A message of kind system or
corrupt, an undocumented message, another exit code, a panic, extra stderr, or
an operation over its timeout is a failure. A checker thread meanwhile parses
`nestbox ps -a --json` and every spec.json/state.json of the root.

After each phase every box is removed, `gc` and `network rm` run, and nothing of
the root may be left: mount, cgroup, process, link, nft table, address lease,
state or pool directory.

Usage: stress.py --nestbox BIN --root DIR --errors docs/errors.md
                 [--cycles N] [--clients N] [--kills N] [--seed N] [--json OUT]
Exit status 0 when no failure and no leftover was found.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time

from jsonlines import exchange  # bench/lib, beside this script

OP_TIMEOUT = 60.0  # seconds; an operation that takes longer is a hang
ALLOWED_KINDS = {"input", "missing", "conflict", "limit"}
FAILURE_KINDS = {"system", "corrupt"}


# ---------------------------------------------------------------- error list


class ErrorList:
    """The documented messages: every table row of docs/errors.md whose first
    cell is a backticked pattern and whose second cell is its kind."""

    ROW = re.compile(r"^\|\s*`(?P<pat>[^`]+)`\s*\|\s*(?P<kind>[a-z]+)\s*\|")

    def __init__(self, path: str):
        self.rows: list[tuple[str, re.Pattern, str]] = []
        self.contexts: list[tuple[str, re.Pattern]] = []
        with open(path, encoding="utf-8") as f:
            for line in f:
                m = self.ROW.match(line)
                if not m:
                    continue
                pat, kind = m.group("pat"), m.group("kind")
                if kind == "context":
                    prefix = re.sub(r": \{[^}]*\}$", "", pat)
                    self.contexts.append((pat, self.compile(prefix)))
                else:
                    self.rows.append((pat, self.compile(pat), kind))
        if len(self.rows) < 20:
            raise SystemExit(f"{path}: only {len(self.rows)} message rows found: is it the error list?")

    @staticmethod
    def compile(pat: str) -> re.Pattern:
        out = []
        for part in re.split(r"(\{[^}]*\})", pat):
            if part == "{errno}":
                out.append(r"(?:E[A-Z0-9]+: [^:]+|[^:]+ \(os error \d+\)|[A-Z][^:]*)")
            elif part.startswith("{") and part.endswith("}") and len(part) > 2:
                out.append(r".+")
            else:
                out.append(re.escape(part))
        return re.compile("".join(out), re.S)

    def classify(self, msg: str, depth: int = 0) -> tuple[str, str] | None:
        """(kind, pattern) of the documented message `msg`, None if undocumented.
        An allowed kind wins over a failure kind when both match."""
        found: list[tuple[str, str]] = []
        for pat, rx, kind in self.rows:
            if rx.fullmatch(msg):
                found.append((kind, pat))
        if depth < 4:
            for pat, rx in self.contexts:
                for m in re.finditer(": ", msg):
                    if rx.fullmatch(msg[: m.start()]):
                        inner = self.classify(msg[m.end():], depth + 1)
                        if inner:
                            found.append(inner)
        if not found:
            return None
        for kind, pat in found:
            if kind in ALLOWED_KINDS:
                return kind, pat
        return found[0]


# ---------------------------------------------------------------- bookkeeping


class Stats:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.ops: collections.Counter = collections.Counter()  # kind -> count
        self.ok: collections.Counter = collections.Counter()
        self.errors: collections.Counter = collections.Counter()  # (op, pattern) -> count
        self.failures: list[str] = []
        self.durations: dict[str, list[float]] = collections.defaultdict(list)

    def fail(self, what: str) -> None:
        with self.lock:
            self.failures.append(what)
        print(f"stress: FAILURE: {what}", file=sys.stderr, flush=True)


class Checker(threading.Thread):
    """Parses `ps -a --json` and every record of the root while the clients run;
    remembers every box id seen (for the veth names of the leak check)."""

    def __init__(self, nb: "Nestbox", stats: Stats):
        super().__init__(daemon=True)
        self.nb, self.stats = nb, stats
        self.stop = threading.Event()
        self.ids: set[str] = set()
        self.passes = 0

    def run(self) -> None:
        while not self.stop.is_set():
            self.check_once()
            self.stop.wait(0.3)

    def check_once(self) -> None:
        self.passes += 1
        rc, out, err, _ = self.nb.call(["ps", "-a", "--json"])
        if rc != 0:
            self.stats.fail(f"ps -a --json exited {rc}: {err.strip()}")
        else:
            try:
                for b in json.loads(out):
                    self.ids.add(b["id"])
            except (ValueError, KeyError, TypeError) as e:
                self.stats.fail(f"ps -a --json: unparsable output ({e}): {out[:200]!r}")
        self.collect_ids()
        boxes = os.path.join(self.nb.root, "run", "boxes")
        for name in listdir(boxes):
            for f in ("spec.json", "state.json"):
                self.parse(os.path.join(boxes, name, f))
        for d in listdir(os.path.join(self.nb.root, "lib", "network")):
            for f in ("config.json", "state.json"):
                self.parse(os.path.join(self.nb.root, "lib", "network", d, f))

    def collect_ids(self) -> None:
        self.ids.update(listdir(os.path.join(self.nb.root, "lib", "boxes")))
        for d in listdir(os.path.join(self.nb.root, "run", "netpool")):
            try:
                with open(os.path.join(self.nb.root, "run", "netpool", d, "pool-id")) as f:
                    self.ids.add(f.read().strip())
            except OSError:
                pass
        for d in listdir(os.path.join(self.nb.root, "lib", "network")):
            try:
                with open(os.path.join(self.nb.root, "lib", "network", d, "state.json")) as f:
                    self.ids.update(json.load(f).get("boxes", {}).keys())
            except (OSError, ValueError):
                pass

    def parse(self, path: str) -> None:
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except FileNotFoundError:
            return  # removed meanwhile
        except OSError as e:
            self.stats.fail(f"read {path}: {e}")
            return
        try:
            json.loads(text)
        except ValueError as e:
            self.stats.fail(f"corrupt record {path}: {e}: {text[:200]!r}")


def listdir(path: str, hidden: bool = False) -> list[str]:
    try:
        return [n for n in os.listdir(path) if hidden or not n.startswith(".")]
    except OSError:
        return []


# ---------------------------------------------------------------- nestbox


class Nestbox:
    def __init__(self, binary: str, root: str, errors: ErrorList, stats: Stats):
        self.bin, self.root, self.errors, self.stats = binary, root, errors, stats

    def cmd(self, args: list[str]) -> list[str]:
        return [self.bin, "--root", self.root, *args]

    def call(self, args: list[str], timeout: float = OP_TIMEOUT) -> tuple[int, str, str, float]:
        t0 = time.monotonic()
        p = subprocess.Popen(self.cmd(args), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            out, err = p.communicate()
            return -999, out, err, time.monotonic() - t0
        return p.returncode, out, err, time.monotonic() - t0

    def judge(self, op: str, args: list[str], rc: int, err: str, dur: float,
              command_status: bool = False) -> bool:
        """Record the outcome of `op`; True on success."""
        st = self.stats
        with st.lock:
            st.ops[op] += 1
            st.durations[op].append(dur)
        what = f"{op} ({' '.join(args)})"
        if rc == -999:
            st.fail(f"{what}: no answer within {OP_TIMEOUT:.0f} s (hang)")
            return False
        lines = [line for line in err.splitlines() if line.strip()]
        if rc == 0 and not lines:
            with st.lock:
                st.ok[op] += 1
            return True
        if rc < 0:
            st.fail(f"{what}: killed by signal {-rc}: {err.strip()[:300]}")
            return False
        if "panicked" in err or "RUST_BACKTRACE" in err:
            st.fail(f"{what}: panic: {err.strip()[:500]}")
            return False
        if command_status and not lines and rc not in (125, 126, 127):
            # The command's own status: killed by stop/rm -f of another client.
            with st.lock:
                st.errors[(op, f"command status {rc}")] += 1
            return False
        errs = [line for line in lines if line.startswith("nestbox: error: ")]
        if len(lines) != 1 or len(errs) != 1:
            st.fail(f"{what}: exit {rc}, stderr not one error line: {err.strip()[:500]!r}")
            return False
        msg = errs[0][len("nestbox: error: "):]
        if rc in (126, 127):
            with st.lock:
                st.errors[(op, f"exit {rc}")] += 1
            return False
        if rc != 125:
            st.fail(f"{what}: exit {rc} (undocumented) with {msg!r}")
            return False
        return self.judge_message(op, what, msg)

    def judge_message(self, op: str, what: str, msg: str) -> bool:
        st = self.stats
        c = self.errors.classify(msg)
        if c is None:
            st.fail(f"{what}: undocumented message {msg!r}")
        elif c[0] in FAILURE_KINDS:
            st.fail(f"{what}: {c[0]} failure {msg!r} (pattern {c[1]!r})")
        else:
            with st.lock:
                st.errors[(op, c[1])] += 1
        return False


# ---------------------------------------------------------------- the API


class Serve:
    """A `nestbox serve` process on ROOT/api.sock; its stderr goes to a file
    (anything it prints is reported)."""

    def __init__(self, nb: Nestbox):
        self.nb = nb
        self.sock = os.path.join(nb.root, "api.sock")
        self.log_path = os.path.join(nb.root, "serve.stderr")
        self.proc: subprocess.Popen | None = None
        self.lock = threading.Lock()

    def start(self) -> None:
        log = open(self.log_path, "a")
        self.proc = subprocess.Popen(self.nb.cmd(["serve", "--socket", self.sock]),
                                     stdin=subprocess.DEVNULL, stdout=log, stderr=log)
        log.close()
        end = time.monotonic() + 10
        while time.monotonic() < end:
            try:
                with socket.socket(socket.AF_UNIX) as s:
                    s.connect(self.sock)
                    return
            except OSError:
                time.sleep(0.01)
        raise SystemExit("nestbox serve did not start within 10 s")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def request(self, req: dict, timeout: float = OP_TIMEOUT) -> tuple[dict | None, str]:
        """(answer, problem): the answer, or None and why not."""
        try:
            with socket.socket(socket.AF_UNIX) as s:
                s.settimeout(timeout)
                s.connect(self.sock)
                data = exchange(s, req)
        except socket.timeout:
            return None, "hang"
        except OSError as e:
            return None, f"socket: {e}"
        if not data:
            return None, "connection closed without an answer"
        try:
            return json.loads(data), ""
        except ValueError as e:
            return None, f"answer is not JSON ({e}): {data[:200]!r}"


# ---------------------------------------------------------------- phase 1


class World:
    """Names shared by every client, so that they race on the same objects."""

    def __init__(self, rng: random.Random):
        self.lock = threading.Lock()
        self.boxes = [f"s{i}" for i in range(10)]
        self.templates = [f"t{i}" for i in range(5)]
        self.clones: list[str] = []

    def add_clone(self, name: str) -> None:
        with self.lock:
            self.clones.append(name)

    def any_box(self, rng: random.Random) -> str:
        with self.lock:
            if self.clones and rng.random() < 0.5:
                return rng.choice(self.clones)
        return rng.choice(self.boxes)

    def take_clone(self, rng: random.Random) -> str | None:
        with self.lock:
            if not self.clones:
                return None
            return self.clones.pop(rng.randrange(len(self.clones)))


OPS = [  # (name, weight)
    ("run_rm", 6), ("run_d", 14), ("exec", 10), ("stop", 3), ("rm", 10),
    ("freeze", 14), ("clone_cli", 12), ("clone_api", 12), ("template_rm", 3),
    ("network_pool", 3), ("checkpoint", 4), ("restore", 4), ("checkpoint_rm", 2),
    ("shell_pool", 3),
]

CHECKPOINTS = [f"c{i}" for i in range(3)]


class Client(threading.Thread):
    def __init__(self, idx: int, nb: Nestbox, serve: Serve, world: World, budget: "Budget",
                 seed: int):
        super().__init__(daemon=True)
        self.idx, self.nb, self.serve, self.world, self.budget = idx, nb, serve, world, budget
        self.rng = random.Random(seed)

    def run(self) -> None:
        names, weights = zip(*OPS)
        while self.budget.take():
            op = self.rng.choices(names, weights)[0]
            with self.world.lock:
                many = len(self.world.clones) > 12
            if many and op in ("clone_cli", "clone_api"):
                op = "rm_clone"
            getattr(self, "op_" + op)()

    def do(self, op: str, args: list[str], command_status: bool = False) -> tuple[bool, str]:
        rc, out, err, dur = self.nb.call(args)
        return self.nb.judge(op, args, rc, err, dur, command_status), out

    def op_run_rm(self) -> None:
        net = self.rng.choice([[], [], ["--network", "none"]])
        self.do("run_rm", ["run", "--rm", *net, "--", "/bin/true"])

    def op_run_d(self) -> None:
        self.do("run_d", ["run", "-d", "--name", self.rng.choice(self.world.boxes), "--",
                          "sleep", "infinity"])

    def op_exec(self) -> None:
        self.do("exec", ["exec", self.world.any_box(self.rng), "--", "/bin/true"],
                command_status=True)

    def op_stop(self) -> None:
        self.do("stop", ["stop", "-t", "1", self.world.any_box(self.rng)])

    def op_rm(self) -> None:
        self.do("rm", ["rm", "-f", self.world.any_box(self.rng)])

    def op_rm_clone(self) -> None:
        name = self.world.take_clone(self.rng)
        if name:
            self.do("rm", ["rm", "-f", name])

    def op_freeze(self) -> None:
        args = ["freeze", self.rng.choice(self.world.boxes), "--as",
                self.rng.choice(self.world.templates)]
        if self.rng.random() < 0.5:
            args += ["--pool", str(self.rng.randint(1, 2))]
        self.do("freeze", args)

    def op_clone_cli(self) -> None:
        ok, out = self.do("clone_cli", ["clone", self.rng.choice(self.world.templates), "-d"])
        if ok:
            for name in out.split():
                self.world.add_clone(name)

    def op_clone_api(self) -> None:
        template = self.rng.choice(self.world.templates)
        t0 = time.monotonic()
        answer, problem = self.serve.request({"op": "clone", "template": template})
        st = self.nb.stats
        with st.lock:
            st.ops["clone_api"] += 1
            st.durations["clone_api"].append(time.monotonic() - t0)
        what = f"clone_api (template {template})"
        if answer is None:
            st.fail(f"{what}: {problem}")
        elif answer.get("ok"):
            with st.lock:
                st.ok["clone_api"] += 1
            self.world.add_clone(answer["name"])
        elif not isinstance(answer.get("error"), str):
            st.fail(f"{what}: answer without an error message: {answer}")
        else:
            self.nb.judge_message("clone_api", what, answer["error"])

    def op_checkpoint(self) -> None:
        self.do("checkpoint", ["checkpoint", self.world.any_box(self.rng), "--as",
                               self.rng.choice(CHECKPOINTS), "--leave-running"])

    def op_restore(self) -> None:
        # Racing for the names of run_d's boxes; half of them shared.
        shared = ["--shared"] if self.rng.random() < 0.5 else []
        ok, out = self.do("restore", ["restore", self.rng.choice(CHECKPOINTS), *shared,
                                      "--name", self.rng.choice(self.world.boxes)])

    def op_checkpoint_rm(self) -> None:
        self.do("checkpoint_rm", ["checkpoint", "rm", self.rng.choice(CHECKPOINTS)])

    def op_template_rm(self) -> None:
        self.do("template_rm", ["template", "rm", self.rng.choice(self.world.templates)])

    def op_network_pool(self) -> None:
        self.do("network_pool", ["network", "pool", str(self.rng.randint(0, 2))])

    def op_shell_pool(self) -> None:
        # The pool of box shells: run --rm and run -d then claim shells.
        self.do("shell_pool", ["pool", "size", str(self.rng.randint(0, 2))])


class Budget:
    def __init__(self, n: int):
        self.n, self.lock, self.done = n, threading.Lock(), 0

    def take(self) -> bool:
        with self.lock:
            if self.done >= self.n:
                return False
            self.done += 1
            return True


# ---------------------------------------------------------------- phase 2


class Killer:
    def __init__(self, nb: Nestbox, serve: Serve, rng: random.Random):
        self.nb, self.serve, self.rng = nb, serve, rng
        self.targets: collections.Counter = collections.Counter()
        self.n = 0
        self.cycles = 0
        self.orphans_checked = 0
        self.template = "kt"

    def state(self, name: str) -> dict | None:
        try:
            with open(os.path.join(self.nb.root, "run", "boxes", name, "state.json")) as f:
                return json.load(f)
        except (OSError, ValueError):
            return None

    def monitor_pid(self, name: str, limit: float) -> int | None:
        end = time.monotonic() + limit
        while True:
            s = self.state(name)
            if s and s.get("monitor"):
                return s["monitor"]["pid"]
            if time.monotonic() > end:
                return None
            time.sleep(0.002)

    def delay(self) -> None:
        time.sleep(self.rng.uniform(0, 0.05))

    def live_box(self) -> str:
        """A running box of this phase, started if need be."""
        self.n += 1
        name = f"k{self.n}"
        rc, _, err, dur = self.nb.call(["run", "-d", "--name", name, "--", "sleep", "infinity"])
        self.nb.judge("kill_setup", ["run", "-d", name], rc, err, dur)
        return name

    def ensure_template(self) -> str:
        """The name of a live template (frozen now if need be)."""
        if any(t.get("name") == self.template and not t.get("removed")
               for t in self.templates()):
            return self.template
        name = self.live_box()
        self.template = f"kt{self.n}"
        rc, _, err, dur = self.nb.call(["freeze", name, "--as", self.template, "--pool", "1"])
        self.nb.judge("kill_setup", ["freeze", name, "--as", self.template], rc, err, dur)
        return self.template

    def ensure_checkpoint(self) -> str:
        """The name of a checkpoint (taken now, of a live box, if need be)."""
        rc, out, err, _ = self.nb.call(["checkpoint", "ls", "--json"])
        if rc == 0 and any(c.get("name") == "kc" for c in json.loads(out)):
            return "kc"
        name = self.live_box()
        rc, _, err, dur = self.nb.call(["checkpoint", name, "--as", "kc", "--leave-running"])
        self.nb.judge("kill_setup", ["checkpoint", name, "--as", "kc"], rc, err, dur)
        return "kc"

    def templates(self) -> list[dict]:
        rc, out, err, _ = self.nb.call(["template", "ls", "--json"])
        if rc != 0:
            self.nb.stats.fail(f"template ls --json exited {rc}: {err.strip()}")
            return []
        return json.loads(out)

    def cycle(self) -> None:
        target = self.rng.choice(["cli", "cli", "monitor", "monitor", "serve"])
        self.targets[target] += 1
        getattr(self, "kill_" + target)()
        rc, _, err, dur = self.nb.call(["gc"])
        self.nb.judge("gc", ["gc"], rc, err, dur)
        self.cycles += 1
        if self.cycles % 10 == 0:
            self.check_after_gc()
        # Keep the number of boxes bounded: remove some of what the cycle left.
        rc, out, _, _ = self.nb.call(["ps", "-a", "--json"])
        if rc == 0:
            boxes = json.loads(out)
            if len(boxes) > 8:
                for b in self.rng.sample(boxes, len(boxes) - 6):
                    rc, _, err, dur = self.nb.call(["rm", "-f", b["name"]])
                    self.nb.judge("kill_cleanup", ["rm", "-f", b["name"]], rc, err, dur)

    def orphans(self) -> set[str]:
        """What no record of the root owns, and boxes gc should have removed."""
        tag = fnv_tag(os.path.join(self.nb.root, "run").encode())
        ids, out = set(), set()
        boxes = os.path.join(self.nb.root, "run", "boxes")
        for name in listdir(boxes):
            try:
                with open(os.path.join(boxes, name, "state.json")) as f:
                    st = json.load(f)
            except (OSError, ValueError):
                continue  # going, or not written yet
            ids.add(st["id"])
        rc, text, _, _ = self.nb.call(["ps", "-a", "--json"])
        if rc == 0:
            for b in json.loads(text):
                if b.get("status") == "dead":
                    out.add(f"dead box {b['name']}")
        # The leases first, then the pool's entries: a refill started by gc
        # may be making an entry meanwhile (its address is leased before its
        # directory is renamed into place), and read in this order its
        # address is always found with its entry.
        netdir = os.path.join(self.nb.root, "lib", "network")
        leases: dict[str, list[str]] = {}
        for d in listdir(netdir):
            try:
                with open(os.path.join(netdir, d, "state.json")) as f:
                    leases[d] = list(json.load(f).get("boxes", {}))
            except (OSError, ValueError):
                continue
        pool_ids = set()
        netpool = os.path.join(self.nb.root, "run", "netpool")
        for d in listdir(netpool, hidden=True):
            if d.startswith("box-") and d[4:] not in ids:
                out.add(f"pooled namespace {d} of no box")
            try:
                with open(os.path.join(netpool, d, "pool-id")) as f:
                    pool_ids.add(f.read().strip())
            except OSError:
                pass
        for i in listdir(os.path.join(self.nb.root, "lib", "boxes")):
            if i not in ids:
                out.add(f"layer dir lib/boxes/{i} of no box")
        for d, leased in leases.items():
            for i in leased:
                if i not in ids and i not in pool_ids:
                    out.add(f"address lease {d}/{i} of no box")
        for dirpath, dirnames, _ in os.walk("/sys/fs/cgroup"):
            for d in list(dirnames):
                if d.startswith(f"nestbox-{tag}-"):
                    if d[len(f"nestbox-{tag}-"):] not in ids:
                        out.add(f"cgroup {d} of no box")
                    dirnames.remove(d)
            if dirpath.count("/") > 10:
                dirnames.clear()
        return out

    def check_after_gc(self) -> None:
        """After gc, nothing may be left that no box owns. A refill or a start in
        progress makes things before their record says so: only what is orphaned
        in two looks 1.5 s apart (after a second gc) counts."""
        first = self.orphans()
        if not first:
            self.orphans_checked += 1
            return
        time.sleep(1.5)
        rc, _, err, dur = self.nb.call(["gc"])
        self.nb.judge("gc", ["gc"], rc, err, dur)
        for item in sorted(first & self.orphans()):
            self.nb.stats.fail(f"after gc (kill cycle {self.cycles}): {item}")
        self.orphans_checked += 1

    def kill_cli(self) -> None:
        self.n += 1
        choice = self.rng.choice(["run_d", "run_rm", "rm", "stop", "freeze", "clone", "template_rm",
                                  "network_pool", "exec", "checkpoint", "restore", "shell_pool"])
        box, template = "", ""
        if choice in ("rm", "stop", "freeze", "exec", "checkpoint"):
            box = self.live_box()
        if choice in ("clone", "template_rm"):
            template = self.ensure_template()
        if choice == "restore":
            self.ensure_checkpoint()
        args = {
            "run_d": ["run", "-d", "--name", f"k{self.n}", "--", "sleep", "infinity"],
            "run_rm": ["run", "--rm", "--", "/bin/true"],
            "rm": ["rm", "-f", box],
            "stop": ["stop", "-t", "1", box],
            "freeze": ["freeze", box, "--as", f"kf{self.n}", "--pool", "1"],
            "clone": ["clone", template, "-d"],
            "template_rm": ["template", "rm", template],
            "network_pool": ["network", "pool", str(self.rng.randint(0, 2))],
            "shell_pool": ["pool", "size", str(self.rng.randint(0, 2))],
            "exec": ["exec", box, "--", "/bin/true"],
            "checkpoint": ["checkpoint", box, "--as", f"kc{self.n}", "--leave-running"],
            "restore": ["restore", "kc", "--name", f"k{self.n}"],
        }[choice]
        self.targets["cli:" + choice] += 1
        p = subprocess.Popen(self.nb.cmd(args), stdin=subprocess.DEVNULL,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.delay()
        p.kill()
        p.wait()

    def kill_monitor(self) -> None:
        if self.rng.random() < 0.5:
            # While the box starts.
            self.n += 1
            name = f"k{self.n}"
            p = subprocess.Popen(self.nb.cmd(["run", "-d", "--name", name, "--", "sleep", "infinity"]),
                                 stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                 stderr=subprocess.DEVNULL)
            self.delay()
            pid = self.monitor_pid(name, 2.0)
            self.targets["monitor:start"] += 1
            if pid:
                kill(pid)
            p.wait()
        else:
            # While something is done to a running box (or a clone).
            box = self.live_box()
            choice = self.rng.choice(["stop", "rm", "exec", "freeze", "idle"])
            self.targets["monitor:" + choice] += 1
            pid = self.monitor_pid(box, 2.0)
            args = {
                "stop": ["stop", "-t", "1", box],
                "rm": ["rm", "-f", box],
                "exec": ["exec", box, "--", "/bin/true"],
                "freeze": ["freeze", box, "--as", f"kf{self.n}", "--pool", "1"],
                "idle": None,
            }[choice]
            p = None
            if args:
                p = subprocess.Popen(self.nb.cmd(args), stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            self.delay()
            if pid:
                kill(pid)
            if p:
                try:
                    _, err = p.communicate(timeout=OP_TIMEOUT)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.communicate()
                    self.nb.stats.fail(f"{' '.join(args)} after its box's monitor was killed: hang")
                    return
                if "panicked" in err:
                    self.nb.stats.fail(f"{' '.join(args)}: panic: {err.strip()[:300]}")

    def kill_serve(self) -> None:
        template = self.ensure_template()
        result: list = []
        t = threading.Thread(target=lambda: result.append(
            self.serve.request({"op": "clone", "template": template}, timeout=OP_TIMEOUT)))
        t.start()
        self.delay()
        if self.serve.proc:
            self.serve.proc.kill()
            self.serve.proc.wait()
        t.join(OP_TIMEOUT + 5)
        if t.is_alive():
            self.nb.stats.fail("clone request to a killed serve: no end")
        self.serve.start()


def kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


# ---------------------------------------------------------------- clean-up and leaks


def fnv_tag(data: bytes) -> str:
    h = 0xCBF29CE484222325
    for b in data:
        h ^= b
        h = (h * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return f"{h & 0xFFFFFFFF:08x}"


def veth_name(bridge: str, box_id: str) -> str:
    h = 0xCBF29CE484222325
    for b in bridge.encode() + b"/" + box_id.encode():
        h ^= b
        h = (h * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return f"nbv{h & 0xFFFFFFFFFFFF:012x}"


def clean_root(nb: Nestbox, stats: Stats) -> None:
    """Remove everything of the root with the documented commands."""
    def step(args: list[str]) -> None:
        rc, _, err, dur = nb.call(args)
        nb.judge("cleanup", args, rc, err, dur)

    # Box shells of the pool are not listed by ps.
    step(["pool", "drain"])
    rc, out, _, _ = nb.call(["template", "ls", "--json"])
    if rc == 0:
        names = [t["name"] for t in json.loads(out) if not t.get("removed")]
        if names:
            step(["template", "rm", *names])
    rc, out, _, _ = nb.call(["ps", "-a", "--json"])
    if rc == 0:
        for b in json.loads(out):
            # A removed template's box may go by itself meanwhile (its last clone
            # went): "no box named" is fine.
            step(["rm", "-f", b["name"]])
    # Once every rm -f has returned, what it removed is gone: a removed template's
    # box too (with its last clone), so nothing may still be listed, and the
    # network must be removable at once.
    rc, out, _, _ = nb.call(["ps", "-a", "--json"])
    if rc == 0 and json.loads(out):
        stats.fail(f"boxes still listed after every rm -f returned: {[b['name'] for b in json.loads(out)]}")
        end = time.monotonic() + 15
        while time.monotonic() < end:
            rc, out, _, _ = nb.call(["ps", "-a", "--json"])
            if rc == 0 and not json.loads(out):
                break
            time.sleep(0.2)
    step(["network", "pool", "0"])
    step(["gc"])
    # gc leaves a record being made or removed (.new-*, .rm-*) alone until it is
    # 5 s old (its maker may be at work): one left by a killed command goes then.
    try:
        half = [n for n in os.listdir(os.path.join(nb.root, "run", "boxes"))
                if n.startswith((".new-", ".rm-"))]
    except OSError:
        half = []
    if half:
        time.sleep(6)
        step(["gc"])
    rc, _, err, _ = nb.call(["network", "rm"])
    if rc != 0:
        stats.fail(f"network rm after every box was removed: exit {rc}: {err.strip()}")


def leftovers(nb: Nestbox, ids: set[str], binary: str) -> list[str]:
    root = os.path.realpath(nb.root)
    tag = fnv_tag(os.path.join(nb.root, "run").encode())
    bridge = f"nb{tag}"
    left: list[str] = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            if root in line:
                left.append(f"mount {line.split()[4]}")
    for dirpath, dirnames, _ in os.walk("/sys/fs/cgroup"):
        depth = dirpath.count("/") - 3
        for d in list(dirnames):
            if d.startswith(f"nestbox-{tag}-"):
                left.append(f"cgroup {dirpath}/{d}")
        if depth > 8:
            dirnames.clear()
    me = {os.getpid(), os.getppid()}
    for pid in listdir("/proc"):
        if not pid.isdigit() or int(pid) in me:
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
            with open(f"/proc/{pid}/cgroup") as f:
                cg = f.read()
        except OSError:
            continue
        if root.encode() in cmdline or f"nestbox-{tag}-" in cg:
            text = cmdline.replace(b"\0", b" ").decode(errors="replace")[:120]
            left.append(f"process {pid} {text}")
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    names = {line.split(": ")[1].split("@")[0] for line in links.splitlines() if ": " in line}
    for n in (bridge, bridge + "ifb"):
        if n in names:
            left.append(f"link {n}")
    for i in ids:
        if veth_name(bridge, i) in names:
            left.append(f"link {veth_name(bridge, i)} (box id {i})")
    for line in links.splitlines():
        if f" master {bridge} " in line:
            left.append(f"link {line.split(': ')[1]} (enslaved to {bridge})")
    nft = subprocess.run(["nft", "list", "tables"], capture_output=True, text=True).stdout
    if f"nestbox-{bridge}" in nft.split():
        left.append(f"nft table nestbox-{bridge}")
    netdir = os.path.join(nb.root, "lib", "network")
    for d in listdir(netdir):
        try:
            with open(os.path.join(netdir, d, "state.json")) as f:
                leased = json.load(f).get("boxes", {})
        except FileNotFoundError:
            continue
        except (OSError, ValueError) as e:
            left.append(f"unreadable network state {d}: {e}")
            continue
        for box_id in leased:
            left.append(f"address lease {d}/{box_id}")
    for sub in (("run", "boxes"), ("lib", "boxes"), ("run", "netpool")):
        try:
            names = os.listdir(os.path.join(nb.root, *sub))  # dot entries too
        except OSError:
            names = []
        for n in names:
            left.append(f"state {'/'.join(sub)}/{n}")
    return left


def check_leaks(nb: Nestbox, ids: set[str], binary: str, phase: str) -> list[str]:
    """Leftovers after a phase; processes and cgroups get 10 s to go."""
    end = time.monotonic() + 10
    while True:
        left = leftovers(nb, ids, binary)
        if not left or time.monotonic() > end:
            break
        time.sleep(0.5)
    for item in left:
        print(f"stress: LEFT after {phase}: {item}", file=sys.stderr, flush=True)
    return left


# ---------------------------------------------------------------- main


def end_phase(nb: Nestbox, serve, checker, stats: Stats, binary: str, phase: str) -> list[str]:
    """Stop the server and the record checker (one last check), remove every box
    and template of the root, and return what of it is left on the machine."""
    serve.stop()
    checker.stop.set()
    checker.join()
    checker.check_once()
    clean_root(nb, stats)
    checker.collect_ids()
    return check_leaks(nb, checker.ids, binary, phase)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nestbox", required=True)
    ap.add_argument("--root", required=True)
    ap.add_argument("--errors", required=True)
    ap.add_argument("--cycles", type=int, default=2000)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--kills", type=int, default=200)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    seed = a.seed if a.seed is not None else random.SystemRandom().randrange(1 << 32)
    errors = ErrorList(a.errors)
    stats = Stats()
    nb = Nestbox(a.nestbox, a.root, errors, stats)
    rng = random.Random(seed)
    report: dict = {"seed": seed, "cycles": a.cycles, "clients": a.clients, "kills": a.kills,
                    "documented_patterns": len(errors.rows) + len(errors.contexts)}
    print(f"stress: seed {seed}, {a.cycles} cycles x {a.clients} clients, {a.kills} kills, "
          f"{report['documented_patterns']} documented message patterns", file=sys.stderr)

    checker = Checker(nb, stats)
    serve = Serve(nb)
    serve.start()
    checker.start()

    # Phase 1.
    t0 = time.monotonic()
    world, budget = World(rng), Budget(a.cycles)
    clients = [Client(i, nb, serve, world, budget, rng.randrange(1 << 32)) for i in range(a.clients)]
    for c in clients:
        c.start()
    last = time.monotonic()
    while any(c.is_alive() for c in clients):
        for c in clients:
            c.join(1)
        if time.monotonic() - last > 30:
            last = time.monotonic()
            print(f"stress: {budget.done}/{a.cycles} cycles, {len(stats.failures)} failures",
                  file=sys.stderr, flush=True)
    report["stress_seconds"] = round(time.monotonic() - t0, 1)
    report["stress_leftovers"] = end_phase(nb, serve, checker, stats, a.nestbox, "the stress phase")

    # Phase 2.
    t1 = time.monotonic()
    checker = Checker(nb, stats)
    serve.start()
    checker.start()
    killer = Killer(nb, serve, rng)
    for i in range(a.kills):
        killer.cycle()
        if (i + 1) % 50 == 0:
            print(f"stress: {i + 1}/{a.kills} kill cycles, {len(stats.failures)} failures",
                  file=sys.stderr, flush=True)
    report["kill_seconds"] = round(time.monotonic() - t1, 1)
    report["kill_leftovers"] = end_phase(nb, serve, checker, stats, a.nestbox, "the kill phase")

    try:
        with open(serve.log_path) as f:
            serve_err = [line.rstrip() for line in f if line.strip()]
    except OSError:
        serve_err = []
    for line in serve_err:
        stats.fail(f"nestbox serve printed: {line}")

    report["ops"] = dict(stats.ops)
    report["ok"] = dict(stats.ok)
    report["kill_targets"] = dict(killer.targets)
    report["orphan_checks_after_gc"] = killer.orphans_checked
    report["refused"] = {f"{op}: {pat}": n for (op, pat), n in sorted(stats.errors.items())}
    report["failures"] = stats.failures
    report["durations_p50_ms"] = {k: round(sorted(v)[len(v) // 2] * 1000, 1)
                                  for k, v in stats.durations.items() if v}
    report["durations_max_ms"] = {k: round(max(v) * 1000, 1) for k, v in stats.durations.items() if v}
    report["checker_passes"] = checker.passes
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=2)
    print(json.dumps({k: report[k] for k in ("seed", "cycles", "clients", "kills", "stress_seconds",
                                             "kill_seconds", "ops", "ok", "kill_targets", "refused")},
                     indent=1), file=sys.stderr)
    nfail = len(stats.failures)
    nleft = len(report["stress_leftovers"]) + len(report["kill_leftovers"])
    print(f"stress: {nfail} failures, {nleft} leftovers", file=sys.stderr)
    return 0 if nfail == 0 and nleft == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
