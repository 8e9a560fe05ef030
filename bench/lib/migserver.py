#!/usr/bin/env python3
"""The server bench/migrate.sh moves: MIB MiB of random bytes (argv[1],
default 100), a thread rewriting RATE MiB/s of it (argv[2], default 10) in
steps of 1/10 s, and an HTTP server on :8080 counting requests by id
(GET /req/ID; GET / answers the count)."""
import http.server
import os
import sys
import threading
import time

MIB = int(sys.argv[1]) if len(sys.argv) > 1 else 100
RATE = int(sys.argv[2]) if len(sys.argv) > 2 else 10
mem = bytearray(os.urandom(MIB << 20))
seen = set()
lock = threading.Lock()


def dirty():
    pages = (MIB << 20) // 4096
    step = RATE * 256 // 10  # pages per 1/10 s
    i = 0
    while True:
        for _ in range(step):
            at = (i % pages) * 4096
            mem[at] = (mem[at] + 1) % 256
            i += 1
        time.sleep(0.1)


class H(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"

    def do_GET(self):
        if self.path.startswith("/req/"):
            with lock:
                seen.add(int(self.path[5:]))
        b = str(len(seen)).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(b)))
        self.end_headers()
        self.wfile.write(b)

    def log_message(self, *a):
        pass


threading.Thread(target=dirty, daemon=True).start()
print("ready", flush=True)
http.server.ThreadingHTTPServer(("0.0.0.0", 8080), H).serve_forever()
