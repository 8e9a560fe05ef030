#!/usr/bin/env bash
# Freeze and clone against a cold start of the same ~50 MB Python HTTP server, in
# one interleaved run: clone-to-ready (clone command to first HTTP answer on the
# clone's own address), the fork alone, cold start to first answer, freeze time,
# private memory of idle clones and MemAvailable drop for K idle clones.
#   sudo N=20 K=200 POOL=4 bench/clone.sh   -> bench/results/clone-pool4.json
# POOL=0 measures clones forked on demand (no pool).
set -euo pipefail
source "$(dirname "$0")/lib/common.sh"
require_root
N=${N:-20}
K=${K:-200}
POOL=${POOL:-4}
ROOT=$(make_tmpdir nestbox-bench-clone)
SERVE_PID=
cleanup() {
    [[ -z $SERVE_PID ]] || { kill "$SERVE_PID" 2>/dev/null; wait "$SERVE_PID" 2>/dev/null || true; }
    nestbox_clean_root "$ROOT"
    remove_tmpdir "$ROOT"
}
trap cleanup EXIT
require_nestbox "$ROOT"
SERVER=$ROOT/server.py
# A server warmed up with imports and ~50 MB of in-memory state.
cat >"$SERVER" <<'PY'
import http.server, json, email, html, urllib.parse, decimal, fractions, statistics, xml.dom.minidom
state = bytearray(b"x" * (48 << 20))
count = 0
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        global count
        count += 1
        body = f"{count} {len(state)}\n".encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a):
        pass
http.server.HTTPServer(("0.0.0.0", 8080), H).serve_forever()
PY
mkdir -p "$RESULTS_DIR"
log "N=$N clone/cold pairs, K=$K idle clones, pool $POOL, load $(cut -d' ' -f1 /proc/loadavg)"
"$NESTBOX" --root "$ROOT" serve --socket "$ROOT/api.sock" &
SERVE_PID=$!
for _ in $(seq 100); do [[ -S $ROOT/api.sock ]] && break; sleep 0.05; done
[[ -S $ROOT/api.sock ]] || die "nestbox serve did not start"
python3 "$BENCH_DIR/lib/clonebench.py" "$NESTBOX" "$ROOT" "$SERVER" "$N" "$K" "$POOL" "$RESULTS_DIR/clone-pool$POOL.json" "$ROOT/api.sock"
