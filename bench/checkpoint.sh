#!/usr/bin/env bash
# Checkpoint and restore of the ~67 MiB Python HTTP server of bench/clone.sh,
# side by side in one interleaved run with a cold start and a clone of the
# same server: checkpoint time (first, and with the pages already in the
# pool), pages written after 1 MiB changed, restore-to-first-answer with a
# warm and a cold page cache, memory of K idle restored boxes.
#   sudo N=20 K=100 COLD=3 bench/checkpoint.sh   -> bench/results/checkpoint.json
# POOL=N: the checkpoint's template (restore --shared) keeps N clones forked
# ahead, so a shared restore claims one (results file gets a -poolN suffix).
# No other checkpoint/restore runs on this machine to compare with: Debian
# 12's CRIU does not run on this kernel, and /dev/kvm cannot boot Firecracker
# guests; their published figures are quoted in docs/benchmarks.md.
set -euo pipefail
source "$(dirname "$0")/lib/common.sh"
require_root
N=${N:-20}
K=${K:-100}
COLD=${COLD:-3}
ROOT=$(make_tmpdir nestbox-bench-checkpoint)
cleanup() {
    "$NESTBOX" --root "$ROOT" checkpoint ls --json 2>/dev/null | jq -r '.[].name' |
        while read -r c; do "$NESTBOX" --root "$ROOT" checkpoint rm "$c" >/dev/null 2>&1 || true; done
    nestbox_clean_root "$ROOT"
    remove_tmpdir "$ROOT"
}
trap cleanup EXIT
require_nestbox "$ROOT"
SERVER=$ROOT/server.py
# The server of bench/clone.sh (~50 MB of state, warmed imports), plus /grow.
cat >"$SERVER" <<'PY'
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
PY
mkdir -p "$RESULTS_DIR"
log "N=$N rounds, K=$K idle restored boxes, $COLD cold-cache restores, load $(cut -d' ' -f1 /proc/loadavg)"
python3 "$BENCH_DIR/lib/ckptbench.py" "$NESTBOX" "$ROOT" "$SERVER" "$N" "$K" "$COLD" "$RESULTS_DIR/checkpoint${POOL:+-pool$POOL}.json"
