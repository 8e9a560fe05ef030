#!/usr/bin/env bash
# The E2B SDK against `nestbox serve --http` on loopback, side by side in one
# interleaved run: Sandbox.create() from the pooled `base` template (a clone)
# and cold (template "host": a box started with `run -d`), each to the SDK call
# returning, and commands.run("true") round trips in both
# (lib/e2bbench.py). Needs the e2b Python package (scripts/setup.sh).
#   sudo ROUNDS=20 RUNS=10 bench/e2b.sh   -> bench/results/e2b.json
set -euo pipefail
source "$(dirname "$0")/lib/common.sh"
require_root
ROUNDS=${ROUNDS:-20}
RUNS=${RUNS:-10}
PAUSE=${PAUSE:-0.3}
PORT=${PORT:-18480}
KEY=bench-key
OUT=$RESULTS_DIR/e2b.json
python3 -c 'import e2b' 2>/dev/null || die "the e2b Python package is missing (scripts/setup.sh installs it)"
ROOT=$(make_tmpdir nestbox-bench-e2b)
SERVE_PID=
cleanup() {
    [[ -z $SERVE_PID ]] || { kill "$SERVE_PID" 2>/dev/null; wait "$SERVE_PID" 2>/dev/null || true; }
    nestbox_clean_root "$ROOT"
    remove_tmpdir "$ROOT"
}
trap cleanup EXIT
require_nestbox "$ROOT"
"$NESTBOX" --root "$ROOT" serve --socket "$ROOT/api.sock" --http "127.0.0.1:$PORT" --api-key "$KEY" \
    2>"$ROOT/serve.log" &
SERVE_PID=$!
for _ in $(seq 100); do
    (exec 3<>"/dev/tcp/127.0.0.1/$PORT") 2>/dev/null && break
    sleep 0.1
done
mkdir -p "$RESULTS_DIR"
log "rounds=$ROUNDS runs=$RUNS pause=${PAUSE}s binary=$NESTBOX"
E2B_API_URL="http://127.0.0.1:$PORT" E2B_SANDBOX_URL="http://127.0.0.1:$PORT" E2B_API_KEY=$KEY \
    python3 "$BENCH_DIR/lib/e2bbench.py" "$ROUNDS" "$RUNS" "$PAUSE" | tee "$OUT.tmp"
{
    printf '{"machine": "%s, %s CPUs, %s", "sdk": "e2b %s", "rounds": %s, "runs": %s, "results": ' \
        "$(uname -r)" "$(nproc)" "$(awk '/MemTotal/ {printf "%.0f GiB", $2/1048576}' /proc/meminfo)" \
        "$(python3 -c 'from importlib.metadata import version; print(version("e2b"))')" "$ROUNDS" "$RUNS"
    cat "$OUT.tmp"
    echo "}"
} >"$OUT"
rm -f "$OUT.tmp"
log "wrote $OUT"
