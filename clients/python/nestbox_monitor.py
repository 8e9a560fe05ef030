"""Write a nestbox monitor in Python.

A box started with ``nestbox run --monitor socket:PATH:CALL,CALL... -- CMD``
stops each of the named system calls of its processes and asks the program
listening on the Unix socket PATH what to do with it: one JSON line per call
(the event), one JSON line back (the answer). This module is that program's
side of the protocol (docs/monitors.md describes it in full)::

    import nestbox_monitor as nm

    def decide(event):
        if event.path and event.path.startswith("/etc/") and event.writes:
            return nm.deny("EROFS")
        return nm.CONTINUE

    nm.serve("/run/my-monitor.sock", decide)

An event has ``id``, ``pid`` (the host's), ``box_pid`` (the box's),
``syscall`` (its name), ``nr``, ``args`` (six integers), and ``path`` (an open,
exec, stat... call's path, absolute in the box) or ``addr`` (a connect, bind
or sendto call's address: ``{"inet": "10.0.0.1:80"}`` or ``{"unix": "/x"}``).
Answers: ``CONTINUE`` (let it run), ``deny(errno)`` (fail it), ``value(v)``
(return v without running it), ``open_instead(path)`` (an open call opens
that path of the box instead).

Answer every event: the calling thread waits until you do. If the connection
breaks, nestbox refuses the box's subscribed calls with EPERM from then on.
"""

from __future__ import annotations

import errno as _errno
import json
import os
import socket
import threading
from dataclasses import dataclass, field
from typing import Callable, Optional

CONTINUE = {"action": "continue"}


def deny(err) -> dict:
    """Fail the call with errno ``err`` (a number or a name such as "EACCES")."""
    if isinstance(err, str):
        err = getattr(_errno, err)
    return {"action": "errno", "errno": int(err)}


def value(v: int) -> dict:
    """Answer the call with ``v`` without running it."""
    return {"action": "value", "value": int(v)}


def open_instead(path: str) -> dict:
    """Make an open call open ``path`` (absolute, in the box) instead."""
    return {"action": "open", "path": path}


@dataclass
class Event:
    """One stopped call."""

    id: int
    pid: int
    syscall: str
    nr: int
    args: list
    box_pid: Optional[int] = None
    path: Optional[str] = None
    addr: Optional[dict] = None
    raw: dict = field(default_factory=dict, repr=False)

    @property
    def writes(self) -> bool:
        """Whether an open call opens for writing (or creates)."""
        flags = {"open": 1, "openat": 2}.get(self.syscall)
        if self.syscall == "creat":
            return True
        if flags is None:
            return False
        f = self.args[flags]
        return (f & os.O_ACCMODE) != os.O_RDONLY or bool(f & (os.O_CREAT | os.O_TRUNC))


def _event(d: dict) -> Event:
    return Event(
        id=d["id"], pid=d["pid"], syscall=d["syscall"], nr=d["nr"], args=d["args"],
        box_pid=d.get("box_pid"), path=d.get("path"), addr=d.get("addr"), raw=d,
    )


def _connection(conn: socket.socket, decide: Callable[[Event], Optional[dict]]) -> None:
    with conn, conn.makefile("rb") as reader:
        for line in reader:
            answer = decide(_event(json.loads(line))) or CONTINUE
            conn.sendall(json.dumps(answer).encode() + b"\n")


def serve(path: str, decide: Callable[[Event], Optional[dict]],
          ready: Optional[Callable[[], None]] = None) -> None:
    """Listen on Unix socket ``path`` and answer every box that connects with
    ``decide`` (each box's connection in a thread of its own). ``ready`` is
    called once the socket listens. Runs until the process is stopped."""
    if os.path.exists(path):
        os.unlink(path)
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen()
    if ready:
        ready()
    while True:
        conn, _ = srv.accept()
        threading.Thread(target=_connection, args=(conn, decide), daemon=True).start()
