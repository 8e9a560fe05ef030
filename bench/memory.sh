#!/usr/bin/env bash
# Memory added per idle detached box.
#
# Starts K boxes with `nestbox run -d -- sleep infinity` and, for each box,
# adds up the RSS and the PSS (/proc/PID/smaps_rollup) of nestbox's own
# processes: the per-box monitor and the box's init (host pids from
# `nestbox inspect`: state.monitor_pid, state.init_pid). The `sleep` the box
# runs is the user's program and is not counted. Reports the median per box,
# plus the system-wide MemAvailable drop divided by K (which also sees kernel
# memory: namespaces, mounts, cgroups, page tables), and, for scale, the RSS
# and PSS of one bare `sleep infinity` on the host. Then removes every box
# with `rm -f` and checks that none is left.
#
# Env: K (boxes, default 20), TARGET_KIB (default 2048: the ≤ 2 MiB goal),
#      NESTBOX_BIN, RESULTS_DIR.
# Writes: $RESULTS_DIR/memory.json, memory.md
set -euo pipefail
# shellcheck source-path=SCRIPTDIR

# shellcheck source=lib/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/common.sh"

K=${K:-20}
TARGET_KIB=${TARGET_KIB:-2048}

require_root
command -v python3 >/dev/null || die "python3 missing (run bench/setup.sh)"
command -v jq >/dev/null || die "jq missing (run bench/setup.sh)"

work=$(make_tmpdir nestbox-bench-memory)
nb_root=$work/nestbox-root
boxes=()
ref_pid=

cleanup() {
    local status=$?
    if [[ -n $ref_pid ]]; then kill "$ref_pid" 2>/dev/null || true; fi
    nestbox_clean_root "$nb_root"
    remove_tmpdir "$work"
    exit "$status"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

mem_available_kib() { awk '$1 == "MemAvailable:" { print $2 }' /proc/meminfo; }

# Median of 5 MemAvailable readings 200 ms apart (it moves on its own).
mem_available_median() {
    local i
    for i in 1 2 3 4 5; do
        mem_available_kib
        sleep 0.2
    done | sort -n | sed -n 3p
}

comm_of() { cat "/proc/$1/comm" 2>/dev/null || echo "?"; }

# children_of PID: direct children (host pids) of PID.
children_of() {
    local t
    for t in /proc/"$1"/task/*/children; do
        cat "$t" 2>/dev/null || true
    done | tr ' ' '\n' | sed '/^$/d'
}

# wait_for_child_comm PID COMM: wait up to 10 s for a child of PID named COMM.
wait_for_child_comm() {
    local pid=$1 want=$2 i c
    for ((i = 0; i < 100; i++)); do
        for c in $(children_of "$pid"); do
            [[ $(comm_of "$c") == "$want" ]] && return 0
        done
        sleep 0.1
    done
    return 1
}

require_nestbox "$nb_root" # also builds the cached root skeleton before measuring
mkdir -p "$RESULTS_DIR"

# Reference: one bare `sleep infinity` on the host.
sleep infinity &
ref_pid=$!
sleep 0.3
ref_json=$(echo "sleep $ref_pid" | python3 "$BENCH_DIR/lib/procmem.py")
kill "$ref_pid"
wait "$ref_pid" 2>/dev/null || true
ref_pid=

log "starting $K detached boxes (sleep infinity)"
avail_before=$(mem_available_median)
for ((i = 1; i <= K; i++)); do
    out=$("$NESTBOX" --root "$nb_root" run -d -- sleep infinity) ||
        die "nestbox run -d failed for box $i"
    name=$(printf '%s\n' "$out" | sed '/^[[:space:]]*$/d' | tail -n1 | tr -d '[:space:]')
    [[ -n $name ]] || die "nestbox run -d printed no box name"
    boxes+=("$name")
done

groups=$work/groups.txt
: >"$groups"
for name in "${boxes[@]}"; do
    info=$("$NESTBOX" --root "$nb_root" inspect "$name") || die "inspect $name failed"
    read -r monitor init < <(jq -r '(if type == "array" then .[0] else . end).state
                                    | "\(.monitor_pid) \(.init_pid)"' <<<"$info")
    [[ $monitor =~ ^[0-9]+$ && $init =~ ^[0-9]+$ ]] ||
        die "inspect $name: no numeric state.monitor_pid/state.init_pid ($monitor, $init)"
    [[ -d /proc/$monitor && -d /proc/$init ]] || die "box $name: monitor $monitor or init $init is not running"
    wait_for_child_comm "$init" sleep || die "box $name: init $init never started 'sleep'"
    for pid in "$monitor" "$init"; do
        [[ $(comm_of "$pid") == nestbox* ]] ||
            log "warning: box $name: pid $pid is '$(comm_of "$pid")', expected nestbox's own process"
    done
    echo "$name $monitor $init" >>"$groups"
done
sleep 2 # let lazily-touched memory settle; monitors and inits drop their file pages after 1 s idle
avail_after=$(mem_available_median)
box_json=$(python3 "$BENCH_DIR/lib/procmem.py" <"$groups")

log "removing $K boxes"
monitors=$(awk '{ print $2 }' "$groups")
for name in "${boxes[@]}"; do
    "$NESTBOX" --root "$nb_root" rm -f "$name" >/dev/null || die "rm -f $name failed"
done
boxes=()
left=$(nestbox_box_names "$nb_root" | wc -l)
((left == 0)) || die "$left box(es) still listed by 'nestbox ps -a' after rm -f"
monitor_alive() { [[ -d /proc/$1 && $(comm_of "$1") == nestbox ]]; }
for pid in $monitors; do
    for ((i = 0; i < 50; i++)); do
        monitor_alive "$pid" || break
        sleep 0.1
    done
    if monitor_alive "$pid"; then
        die "monitor $pid still running 5 s after rm -f"
    fi
done

jq -n --argjson k "$K" --argjson target "$TARGET_KIB" \
    --argjson before "$avail_before" --argjson after "$avail_after" \
    --argjson boxes "$box_json" --argjson ref "$ref_json" '{
        boxes: $k,
        target_kib: $target,
        per_box_rss_kib: $boxes.rss_kib,
        per_box_pss_kib: $boxes.pss_kib,
        mem_available_before_kib: $before,
        mem_available_after_kib: $after,
        mem_available_delta_per_box_kib: (($before - $after) / $k),
        bare_sleep_rss_kib: $ref.groups[0].rss_kib,
        bare_sleep_pss_kib: $ref.groups[0].pss_kib,
        samples: $boxes.groups
    }' >"$RESULTS_DIR/memory.json"

jq -r '
    def mib: . / 1024 * 100 | round / 100;
    def verdict($t): if . <= $t then "met" else "NOT met" end;
    .target_kib as $t |
    "### Memory per idle detached box (`nestbox run -d -- sleep infinity`), K=\(.boxes)",
    "",
    "| view | median KiB | min KiB | max KiB | MiB (median) |",
    "|---|---:|---:|---:|---:|",
    "| RSS, monitor + init | \(.per_box_rss_kib.median) | \(.per_box_rss_kib.min) | \(.per_box_rss_kib.max) | \(.per_box_rss_kib.median | mib) |",
    "| PSS, monitor + init | \(.per_box_pss_kib.median) | \(.per_box_pss_kib.min) | \(.per_box_pss_kib.max) | \(.per_box_pss_kib.median | mib) |",
    "| MemAvailable drop / K (whole system, incl. kernel and the boxes'"'"' `sleep`) | \(.mem_available_delta_per_box_kib | round) | | | \(.mem_available_delta_per_box_kib | mib) |",
    "",
    "Reference: one bare `sleep infinity` on the host: RSS \(.bare_sleep_rss_kib) KiB, PSS \(.bare_sleep_pss_kib) KiB.",
    "Target ≤ \(.target_kib) KiB per box: PSS \(.per_box_pss_kib.median | verdict($t)), RSS \(.per_box_rss_kib.median | verdict($t))."
' "$RESULTS_DIR/memory.json" >"$RESULTS_DIR/memory.md"
cat "$RESULTS_DIR/memory.md"
