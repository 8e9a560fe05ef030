#!/usr/bin/env python3
"""An example nestbox monitor: /etc of the box is read-only for its programs
(an open for writing fails with EROFS), and every open is logged.

    python3 examples/monitors/readonly_etc.py /tmp/ro-etc.sock &
    nestbox run --monitor socket:/tmp/ro-etc.sock:open,openat,creat -- \
        sh -c 'cat /etc/hostname; echo x >> /etc/motd'
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "clients", "python"))
import nestbox_monitor as nm  # noqa: E402


def decide(event: nm.Event):
    mode = "write" if event.writes else "read"
    print(f"box pid {event.box_pid}: {event.syscall} {event.path} ({mode})", flush=True)
    if event.path and event.path.startswith("/etc/") and event.writes:
        return nm.deny("EROFS")
    return nm.CONTINUE


if __name__ == "__main__":
    nm.serve(sys.argv[1], decide, ready=lambda: print("listening", flush=True))
