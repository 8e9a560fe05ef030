#!/usr/bin/env bash
# Services: requests per second through a service of REPLICAS replicas
# (`nestbox service create --rejuvenate`, the in-process proxy) against the
# same load on one box's published port (DNAT), with wrk, R rounds
# interleaved, medians and the ratio; failed requests (wrk's socket errors
# and non-2xx answers) of every run, and the rejuvenations the service made.
# The server is a small Python ThreadingHTTPServer answering its hostname
# (HTTP/1.0: one connection per request, so every request is a new connection
# the proxy balances).
#   sudo bench/service.sh          -> bench/results/service.json, service.md
# Env: R (rounds, default 3), D (seconds per wrk run, default 10), C (wrk
#      connections, default 16), REPLICAS (default 4), REJUVENATE (default 10s).
set -euo pipefail
source "$(dirname "$0")/lib/common.sh"
require_root
R=${R:-3}
D=${D:-10}
C=${C:-16}
REPLICAS=${REPLICAS:-4}
REJUVENATE=${REJUVENATE:-10s}
command -v wrk >/dev/null || die "wrk missing (run bench/setup.sh)"
ROOT=$(make_tmpdir nestbox-bench-service)
cleanup() {
    "$NESTBOX" --root "$ROOT" service rm svc >/dev/null 2>&1 || true
    nestbox_clean_root "$ROOT"
    remove_tmpdir "$ROOT"
}
trap cleanup EXIT INT TERM
require_nestbox "$ROOT"
mkdir -p "$RESULTS_DIR"

cat >"$ROOT/server.py" <<'PY'
import http.server, socket
class H(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"
    def do_GET(self):
        body = socket.gethostname().encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a):
        pass
http.server.ThreadingHTTPServer(("0.0.0.0", 8080), H).serve_forever()
PY
free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])'; }
ONE_PORT=$(free_port)
SVC_PORT=$(free_port)
wait_http() {
    for _ in $(seq 100); do
        python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$1/', timeout=1)" 2>/dev/null && return 0
        sleep 0.1
    done
    die "nothing answers on port $1"
}

"$NESTBOX" --root "$ROOT" run -d --name one -p "$ONE_PORT:8080" -v "$ROOT/server.py:/srv.py:ro" -- python3 /srv.py >/dev/null
"$NESTBOX" --root "$ROOT" run -d --name tmpl-box -v "$ROOT/server.py:/srv.py:ro" -- python3 /srv.py >/dev/null
wait_http "$ONE_PORT"
"$NESTBOX" --root "$ROOT" freeze tmpl-box --as tmpl >/dev/null
"$NESTBOX" --root "$ROOT" service create svc --template tmpl --replicas "$REPLICAS" \
    --rejuvenate "$REJUVENATE" -p "$SVC_PORT:8080" >/dev/null
wait_http "$SVC_PORT"
log "R=$R rounds of ${D}s, $C connections, $REPLICAS replicas rejuvenated every $REJUVENATE; load $(cut -d' ' -f1-3 /proc/loadavg)"

# run_wrk PORT -> "RPS FAILED"
run_wrk() {
    wrk -t2 -c"$C" -d"${D}s" "http://127.0.0.1:$1/" 2>&1 | python3 -c '
import re, sys
t = sys.stdin.read()
m = re.search(r"Requests/sec:\s+([\d.]+)", t)
rps = float(m.group(1)) if m else 0.0
errs = sum(int(n) for n in re.findall(r"(?:connect|read|write|timeout) (\d+)", t))
non2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", t)
print(rps, errs + (int(non2xx.group(1)) if non2xx else 0) + (0 if m else 1))'
}
one_rps=() svc_rps=() one_failed=0 svc_failed=0
for i in $(seq "$R"); do
    read -r rps failed < <(run_wrk "$ONE_PORT")
    one_rps+=("$rps"); one_failed=$((one_failed + failed))
    read -r rps failed < <(run_wrk "$SVC_PORT")
    svc_rps+=("$rps"); svc_failed=$((svc_failed + failed))
    log "round $i: one box ${one_rps[-1]} req/s, service ${svc_rps[-1]} req/s"
done
state=$("$NESTBOX" --root "$ROOT" service inspect svc)
load=$(cut -d' ' -f1-3 /proc/loadavg)
python3 - "$RESULTS_DIR" "$state" "$load" "$one_failed" "$svc_failed" "${one_rps[*]}" "${svc_rps[*]}" "$REPLICAS" "$REJUVENATE" "$C" "$D" <<'PY'
import json, statistics, sys
out, state, load, one_failed, svc_failed, one, svc, replicas, rejuvenate, conns, secs = sys.argv[1:]
one = [float(x) for x in one.split()]
svc = [float(x) for x in svc.split()]
st = json.loads(state)["state"]
r = {
    "one_box_rps": one, "service_rps": svc,
    "one_box_median": statistics.median(one), "service_median": statistics.median(svc),
    "ratio": statistics.median(svc) / statistics.median(one),
    "one_box_failed": int(one_failed), "service_failed": int(svc_failed),
    "proxy_failed": st["failed"], "rejuvenated": st["rejuvenated"],
    "replaced_dead": st["replaced_dead"], "replicas": int(replicas),
    "rejuvenate": rejuvenate, "connections": int(conns), "seconds": int(secs), "load": load,
}
json.dump(r, open(f"{out}/service.json", "w"), indent=1)
md = f"""| | median req/s | runs | failed |
|---|---|---|---|
| one box, published port | {r['one_box_median']:.0f} | {', '.join(f'{x:.0f}' for x in one)} | {r['one_box_failed']} |
| service of {replicas} replicas (rejuvenate {rejuvenate}) | {r['service_median']:.0f} | {', '.join(f'{x:.0f}' for x in svc)} | {r['service_failed']} |

ratio service / one box: {r['ratio']:.2f}; rejuvenations during the runs: {r['rejuvenated']}; load average {load}
"""
open(f"{out}/service.md", "w").write(md)
print(md)
PY
