#!/usr/bin/env bash
# Set everything up, then show the main job: programs running in isolated boxes
# built from the default image (the host's system directories, read-only).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
nb=target/release/nestbox
root=$(mktemp -d /tmp/nestbox-demo.XXXXXX)
export NESTBOX_ROOT="$root"
cleanup() {
    "$nb" rm -f demo-web c-1 c-2 c-3 back counter >/dev/null 2>&1 || true
    "$nb" checkpoint rm saved >/dev/null 2>&1 || true
    "$nb" gc >/dev/null 2>&1 || true
    "$nb" network rm >/dev/null 2>&1 || true
    rm -rf "$root"
}
trap cleanup EXIT

say() { printf '\n\033[1m$ %s\033[0m\n' "$*"; }

say nestbox run -- python3 -c 'print(1)'
"$nb" run --rm -- python3 -c 'print(1)'

say "nestbox run --hostname sandbox -- sh -c 'hostname; ps -e; ls /; id'"
"$nb" run --rm --hostname sandbox -- sh -c 'hostname; echo "-- processes:"; ps -e; echo "-- root:"; ls /; id'

say "nestbox run --memory 32m -- python3 (allocates 200 MiB)"
"$nb" run --rm --memory 32m -- python3 -c 'b = bytearray(200 << 20); print("allocated")' || echo "exit code: $?"

say "nestbox run --pids 20 -- sh -c 'fork bomb'"
"$nb" run --rm --pids 20 -- sh -c 'for i in $(seq 100); do sleep 5 & done 2>/dev/null; echo "started: $(jobs -p | wc -l) of 100"' || true

say "nestbox run -d --name demo-web --cpus 0.5 -- python3 -m http.server 8000"
"$nb" run -d --name demo-web --cpus 0.5 -- python3 -m http.server 8000
sleep 1
say nestbox exec demo-web -- python3 -c 'urllib.request.urlopen("http://127.0.0.1:8000/")'
"$nb" exec demo-web -- python3 -c 'import urllib.request; print(urllib.request.urlopen("http://127.0.0.1:8000/").status)'
say nestbox ps
"$nb" ps
say nestbox stats demo-web
"$nb" stats demo-web
say nestbox logs demo-web
"$nb" logs demo-web
say "nestbox run -d --name counter -- python3 (a server counting its requests)"
"$nb" run -d --name counter -- python3 -c '
import http.server
n = 0
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        global n
        n += 1
        b = f"request {n}\n".encode()
        self.send_response(200); self.send_header("Content-Length", str(len(b))); self.end_headers(); self.wfile.write(b)
    def log_message(self, *a): pass
http.server.HTTPServer(("0.0.0.0", 8080), H).serve_forever()'
get() { "$nb" exec "$1" -- python3 -c 'import urllib.request; print(urllib.request.urlopen("http://127.0.0.1:8080/").read().decode().strip())'; }
sleep 1
for _ in 1 2; do printf 'counter: '; get counter; done
say "nestbox freeze counter --pool 2; nestbox clone counter -n 3 -d --name c"
"$nb" freeze counter --pool 2
"$nb" clone counter -n 3 -d --name c
for c in c-1 c-2 c-3; do printf '%s: ' "$c"; get "$c"; done
printf 'c-1 again: '; get c-1
say nestbox template ls
"$nb" template ls
say "nestbox stats c-2   # memory private to the clone vs shared with its template"
"$nb" stats c-2
say "nestbox checkpoint c-2 --as saved; nestbox rm -f c-2; nestbox restore saved --name back"
"$nb" checkpoint c-2 --as saved
"$nb" rm -f c-2
"$nb" restore saved --name back
printf 'back (restored from c-2, which had answered once): '; get back
"$nb" rm -f c-1 c-3 back counter
"$nb" checkpoint rm saved
say nestbox stop -t 2 demo-web
"$nb" stop -t 2 demo-web
"$nb" ps -a
say nestbox rm demo-web
"$nb" rm demo-web
echo
echo "demo done: every box ran in its own pid, mount, uts, ipc, network and cgroup namespaces with its own cgroup;"
echo "the clones continued from the frozen server's state (request 3), each on its own;"
echo "the box restored from c-2's checkpoint continued from c-2's state (request 4)."
