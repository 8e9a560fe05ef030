# The ~67 MiB Python HTTP server of bench/clone.sh and bench/checkpoint.sh: a
# server warmed up with imports and ~50 MB of in-memory state, answering
# "COUNT LEN" on port 8080; GET /grow first adds 1 MiB of random bytes.
import http.server, json, email, html, os, urllib.parse, decimal, fractions, statistics, xml.dom.minidom
state = bytearray(b"x" * (48 << 20))
grown = []
count = 0
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        global count
        if self.path == "/grow":
            grown.append(os.urandom(1 << 20))
        count += 1
        body = f"{count} {len(state)}\n".encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a):
        pass
http.server.HTTPServer(("0.0.0.0", 8080), H).serve_forever()
