#!/usr/bin/env bash
# Box start latency: wall-clock time of a complete "start a sandbox, run
# /bin/true in it, tear it down" cycle, for
#   nestbox  nestbox run --rm -- /bin/true
#            (pid/mount/uts/ipc/net/cgroup namespaces, a cgroup, overlay root
#             over the host's /usr and /etc; --rm removes the box's record at
#             exit, as `runc run` deletes its container): a cold start, in a
#            root without pools (nestbox-none: --network none);
#            nestbox-pool: with the network pool (namespaces attached ahead);
#            nestbox-shells / nestbox-shells-none: the same commands in a root
#            that keeps SHELLS box shells ready per shape (`nestbox pool size`:
#            namespaces, cgroup, root, network made ahead; what the
#            machine-wide root does by default), so the box is claimed, not made
#   runc     runc run of an equivalent OCI bundle (same namespaces, a cgroup,
#            read-only root with /usr and /etc bind-mounted read-only); runc
#            deletes the container when it exits
#   bwrap    bwrap --unshare-all with /usr and /etc bound read-only, fresh
#            /proc and /dev (no cgroup)
# measured interleaved round-robin (see lib/timing.py).
#
# Env: N (runs per command, default 200), WARMUP (default 10),
#      BENCHES (subset/order of the names above; the first is the one the
#      ratios are relative to; every one's median is also given relative to
#      bwrap's), SHELLS (default 2), NESTBOX_RUN_FLAGS (default "--rm"),
#      NESTBOX_BIN, RESULTS_DIR; NESTBOX_BASE_BIN (another build, e.g. the
#      previous head: benches base-none, base-pool, base-shells and
#      base-shells-none run it interleaved with the others, in roots of its
#      own).
# Writes: $RESULTS_DIR/start-samples.csv, start-summary.json, start.md
set -euo pipefail
# shellcheck source-path=SCRIPTDIR

# shellcheck source=lib/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/common.sh"
# shellcheck source=lib/runc-bundle.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/runc-bundle.sh"

N=${N:-200}
WARMUP=${WARMUP:-10}
NESTBOX_RUN_FLAGS=${NESTBOX_RUN_FLAGS---rm}
PAUSE=${PAUSE:-0.05}
POOL=${POOL:-4}
SHELLS=${SHELLS:-2}
read -r -a benches <<<"${BENCHES:-nestbox nestbox-pool nestbox-none nestbox-shells nestbox-shells-none runc bwrap}"

require_root
command -v python3 >/dev/null || die "python3 missing (run bench/setup.sh)"

work=$(make_tmpdir nestbox-bench-start)
nb_root=$work/nestbox-root
nb_pool_root=$work/nestbox-pool-root
nb_shells_root=$work/nestbox-shells-root
base_root=$work/base-root
base_pool_root=$work/base-pool-root
base_shells_root=$work/base-shells-root
runc_root=$work/runc-state
bundle=$work/bundle

cleanup() {
    local status=$? name id
    nestbox_clean_root "$nb_root"
    nestbox_clean_root "$nb_pool_root"
    nestbox_clean_root "$nb_shells_root"
    if [[ -n ${NESTBOX_BASE_BIN:-} ]]; then
        NESTBOX=$NESTBOX_BASE_BIN nestbox_clean_root "$base_root"
        NESTBOX=$NESTBOX_BASE_BIN nestbox_clean_root "$base_pool_root"
        NESTBOX=$NESTBOX_BASE_BIN nestbox_clean_root "$base_shells_root"
    fi
    if [[ -d $runc_root ]]; then
        while read -r id; do
            [[ -z $id ]] || runc --root "$runc_root" delete -f "$id" >/dev/null 2>&1 || true
        done < <(runc --root "$runc_root" list -q 2>/dev/null || true)
    fi
    remove_tmpdir "$work"
    exit "$status"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

args=()
for b in "${benches[@]}"; do
    case $b in
    nestbox)
        require_nestbox "$nb_root"
        args+=(--bench nestbox "$NESTBOX --root $nb_root run $NESTBOX_RUN_FLAGS -- /bin/true")
        ;;
    nestbox-pool)
        require_nestbox "$nb_pool_root"
        "$NESTBOX" --root "$nb_pool_root" network pool "$POOL" >/dev/null
        args+=(--bench nestbox-pool "$NESTBOX --root $nb_pool_root run $NESTBOX_RUN_FLAGS -- /bin/true")
        ;;
    nestbox-none)
        require_nestbox "$nb_root"
        args+=(--bench nestbox-none "$NESTBOX --root $nb_root run --network none $NESTBOX_RUN_FLAGS -- /bin/true")
        ;;
    nestbox-shells | nestbox-shells-none)
        if [[ ! -d $nb_shells_root ]]; then
            require_nestbox "$nb_shells_root"
            "$NESTBOX" --root "$nb_shells_root" pool size "$SHELLS" >/dev/null
        fi
        net=""
        [[ $b == nestbox-shells-none ]] && net="--network none "
        args+=(--bench "$b" "$NESTBOX --root $nb_shells_root run $net$NESTBOX_RUN_FLAGS -- /bin/true")
        ;;
    base-none)
        [[ -x ${NESTBOX_BASE_BIN:-} ]] || die "base-none needs NESTBOX_BASE_BIN"
        NESTBOX=$NESTBOX_BASE_BIN require_nestbox "$base_root"
        args+=(--bench base-none "$NESTBOX_BASE_BIN --root $base_root run --network none $NESTBOX_RUN_FLAGS -- /bin/true")
        ;;
    base-pool)
        [[ -x ${NESTBOX_BASE_BIN:-} ]] || die "base-pool needs NESTBOX_BASE_BIN"
        NESTBOX=$NESTBOX_BASE_BIN require_nestbox "$base_pool_root"
        "$NESTBOX_BASE_BIN" --root "$base_pool_root" network pool "$POOL" >/dev/null
        args+=(--bench base-pool "$NESTBOX_BASE_BIN --root $base_pool_root run $NESTBOX_RUN_FLAGS -- /bin/true")
        ;;
    base-shells | base-shells-none)
        [[ -x ${NESTBOX_BASE_BIN:-} ]] || die "$b needs NESTBOX_BASE_BIN"
        if [[ ! -d $base_shells_root ]]; then
            NESTBOX=$NESTBOX_BASE_BIN require_nestbox "$base_shells_root"
            "$NESTBOX_BASE_BIN" --root "$base_shells_root" pool size "$SHELLS" >/dev/null
        fi
        net=""
        [[ $b == base-shells-none ]] && net="--network none "
        args+=(--bench "$b" "$NESTBOX_BASE_BIN --root $base_shells_root run $net$NESTBOX_RUN_FLAGS -- /bin/true")
        ;;
    runc)
        command -v runc >/dev/null || die "runc missing (run bench/setup.sh)"
        make_runc_bundle "$bundle"
        args+=(--bench runc "runc --root $runc_root run --bundle $bundle bench-{i}")
        ;;
    bwrap)
        command -v bwrap >/dev/null || die "bwrap missing (run bench/setup.sh)"
        bw=(bwrap --unshare-all --ro-bind /usr /usr --ro-bind /etc /etc)
        for d in bin lib lib64 sbin; do
            if [[ -L /$d ]]; then
                bw+=(--symlink "$(readlink "/$d")" "/$d")
            elif [[ -d /$d ]]; then
                bw+=(--ro-bind "/$d" "/$d")
            fi
        done
        bw+=(--proc /proc --dev /dev /bin/true)
        args+=(--bench bwrap "${bw[*]}")
        ;;
    *) die "unknown benchmark '$b' in BENCHES (nestbox, nestbox-pool, nestbox-none, nestbox-shells, nestbox-shells-none, base-none, base-pool, base-shells, base-shells-none, runc, bwrap)" ;;
    esac
done
((${#args[@]})) || die "BENCHES is empty"

log "start latency: ${benches[*]}; N=$N, warm-up $WARMUP each, interleaved"
mkdir -p "$RESULTS_DIR"
started=$(date -u +%Y-%m-%dT%H:%MZ)
load_before=$(cut -d' ' -f1-3 /proc/loadavg)
table=$(python3 "$BENCH_DIR/lib/timing.py" --runs "$N" --warmup "$WARMUP" \
    --pause "$PAUSE" --out "$RESULTS_DIR" --tag start "${args[@]}")
load_after=$(cut -d' ' -f1-3 /proc/loadavg)

# Everything must have cleaned up after itself.
if [[ " ${benches[*]} " == *" nestbox"* && " $NESTBOX_RUN_FLAGS " == *" --rm "* ]]; then
    left=$(nestbox_box_names "$nb_root" | wc -l)
    ((left == 0)) || die "nestbox run --rm left $left box(es) behind"
fi
if [[ " ${benches[*]} " == *" runc "* ]]; then
    left=$(runc --root "$runc_root" list -q | wc -l)
    ((left == 0)) || die "runc left $left container(s) behind"
fi

{
    echo "### Start latency (\`/bin/true\` in a new sandbox), N=$N per command, interleaved"
    echo
    echo "$started, $(nproc) CPUs, load average $load_before before and $load_after after"
    echo
    echo "$table"
    echo
    if [[ " ${benches[*]} " == *" bwrap "* ]]; then
        echo "Median relative to bwrap's: $(jq -r '.stats as $s | [$s | keys_unsorted[] | select(. != "bwrap") | "\(.) \($s[.].median_ms / $s.bwrap.median_ms * 100 | round / 100)x"] | join(", ")' "$RESULTS_DIR/start-summary.json")"
        echo
    fi
    for b in "${benches[@]}"; do
        jq -r --arg b "$b" '"- `\($b)`: `\(.commands[$b])`"' "$RESULTS_DIR/start-summary.json"
    done
} | sed -e "s#$work#\$TMP#g" -e "s#$REPO_DIR/##g" >"$RESULTS_DIR/start.md"
cat "$RESULTS_DIR/start.md"
