#!/usr/bin/env bash
# Freeze and clone against a cold start of the same ~50 MB Python HTTP server, in
# one interleaved run: clone-to-ready (clone command to first HTTP answer on the
# clone's own address), the fork alone, cold start to first answer, freeze time,
# private memory of idle clones and MemAvailable drop for K idle clones.
#   sudo N=20 K=200 POOL=4 bench/clone.sh          -> bench/results/clone-pool4.json
#   sudo APP=node N=20 K=200 POOL=4 bench/clone.sh -> bench/results/clone-node-pool4.json
# POOL=0 measures clones forked on demand (no pool). APP=python (default) is a
# single-threaded ~67 MiB Python server; APP=node a Node.js HTTP server (its
# runtime has 7 threads) holding a counter and a warmed-up JIT. KSM=1 runs the
# template with --ksm and adds the MemAvailable drop once the host's KSM scanner
# has merged what it can (results file gets a -ksm suffix). DROP_CACHES=1 drops
# the page cache and slab caches before each MemAvailable reading of the idle
# clones (steadier: only memory nothing can reclaim is counted).
set -euo pipefail
source "$(dirname "$0")/lib/common.sh"
require_root
N=${N:-20}
K=${K:-200}
POOL=${POOL:-4}
APP=${APP:-python}
ROOT=$(make_tmpdir nestbox-bench-clone)
SERVE_PID=
cleanup() {
    [[ -z $SERVE_PID ]] || { kill "$SERVE_PID" 2>/dev/null; wait "$SERVE_PID" 2>/dev/null || true; }
    nestbox_clean_root "$ROOT"
    remove_tmpdir "$ROOT"
}
trap cleanup EXIT
require_nestbox "$ROOT"
case $APP in
python)
    SERVER=$ROOT/server.py
    COMMAND='["python3", "/srv.py"]'
    OUT=$RESULTS_DIR/clone-pool$POOL.json
    cp "$BENCH_DIR/lib/pyserver.py" "$SERVER"
    ;;
node)
    command -v node >/dev/null || die "APP=node needs node (apt-get install nodejs)"
    SERVER=$ROOT/server.js
    COMMAND='["node", "/srv.js"]'
    OUT=$RESULTS_DIR/clone-node-pool$POOL.json
    # The same answer as the Python server, from Node's http module.
    cat >"$SERVER" <<'JS'
const http = require("http");
let count = 0;
const state = Buffer.alloc(16 << 20, "x");
http.createServer((req, res) => {
  count += 1;
  const body = `${count} ${state.length}\n`;
  res.writeHead(200, { "Content-Length": Buffer.byteLength(body) });
  res.end(body);
}).listen(8080, "0.0.0.0");
JS
    ;;
*) die "APP must be python or node, not $APP" ;;
esac
[[ ${KSM:-0} != 1 ]] || OUT=${OUT%.json}-ksm.json
[[ ${DROP_CACHES:-0} != 1 ]] || OUT=${OUT%.json}-dropcaches.json
log "N=$N clone/cold pairs, K=$K idle clones, pool $POOL, load $(cut -d' ' -f1 /proc/loadavg)"
"$NESTBOX" --root "$ROOT" serve --socket "$ROOT/api.sock" &
SERVE_PID=$!
for _ in $(seq 100); do [[ -S $ROOT/api.sock ]] && break; sleep 0.05; done
[[ -S $ROOT/api.sock ]] || die "nestbox serve did not start"
python3 "$BENCH_DIR/lib/clonebench.py" "$NESTBOX" "$ROOT" "$SERVER" "$N" "$K" "$POOL" "$OUT" "$ROOT/api.sock" "$COMMAND"
