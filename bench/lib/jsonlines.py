"""One request on nestbox serve's protocol: a JSON object per line each way.

Shared by the clone benchmark (clonebench.py) and the stress driver (stress.py).
"""

from __future__ import annotations

import json
import socket


def exchange(s: socket.socket, req: dict) -> bytes:
    """Send `req` as one line on the connected socket `s` and return the answer
    line as read (empty if the server closed the connection first)."""
    s.sendall(json.dumps(req).encode() + b"\n")
    data = b""
    while not data.endswith(b"\n"):
        chunk = s.recv(65536)
        if not chunk:
            break
        data += chunk
    return data
