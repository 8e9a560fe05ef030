#!/usr/bin/env bash
# The content-addressed image store, side by side in one run (medians):
#   1. import throughput from a warm-cache directory, against `cp -a` and
#      `tar | tar` of the same tree (each followed by `sync`, as an import
#      makes its objects durable; the unsynced copy is shown too)
#   2. a new box root view from a cached image (open_image + root_view, the
#      nestbox-image example view_latency), and `run --rm -- true` start time
#      of a store image against the host image
#   3. disk added per box by 100 boxes of one image before they write
#   4. dedup over two exited boxes' layers (a shared copy of a library tree plus
#      a tree unique to one box): bytes read from files found unique, and rate
#      over the candidates' bytes on cached data
#   5. page cache charged to 10 boxes reading the same ~50 MB of libraries
#      (cgroup file memory), against 10 boxes each reading a private copy
#
# Env: SRC (tree to import, default /usr/lib/x86_64-linux-gnu), RUNS (import
#      repetitions, default 3), BOXES (default 100), NESTBOX_BIN, RESULTS_DIR.
# Writes: $RESULTS_DIR/store.json and store.md
set -euo pipefail
# shellcheck source=lib/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/common.sh"

SRC=${SRC:-/usr/lib/x86_64-linux-gnu}
RUNS=${RUNS:-3}
BOXES=${BOXES:-100}
RESULTS_DIR=${RESULTS_DIR:-$REPO_DIR/bench/results}
VIEW_BIN=${VIEW_BIN:-$REPO_DIR/target/release/examples/view_latency}

require_root
command -v python3 >/dev/null || die "python3 missing (run bench/setup.sh)"
command -v jq >/dev/null || die "jq missing (run bench/setup.sh)"
[[ -d $SRC ]] || die "no source tree $SRC"
[[ -x $VIEW_BIN ]] || die "$VIEW_BIN missing: cargo build --release --example view_latency -p nestbox-image"
[[ -x /bin/busybox ]] || die "/bin/busybox missing (apt-get install busybox-static)"

work=$(make_tmpdir nestbox-bench-store)
R=$work/root
nb() { "$NESTBOX" --root "$R" "$@"; }

cleanup() {
    local status=$?
    nestbox_clean_root "$R"
    remove_tmpdir "$work"
    exit "$status"
}
trap cleanup EXIT
trap 'exit 130' INT TERM
mkdir -p "$RESULTS_DIR"
require_nestbox "$R"

now() { date +%s.%N; }
median() { python3 -c 'import sys,statistics; print(statistics.median(float(x) for x in sys.argv[1:]))' "$@"; }
calc() { python3 -c "print($1)"; }

# ---------------------------------------------------------------- 1. import
bytes=$(find "$SRC" -xdev -type f -printf '%s\n' | awk '{s+=$1} END {print s}')
files=$(find "$SRC" -xdev -type f | wc -l)
log "source $SRC: $files files, $bytes bytes; warming the page cache"
tar -C "$SRC" -cf - . >/dev/null
declare -A t
for m in import cp cp_nosync tar; do t[$m]=""; done
for ((i = 0; i < RUNS; i++)); do
    # A fresh store each run; the root's network (made by the first box) goes
    # first, or its bridge would outlive the state that names it.
    nestbox_clean_root "$R"
    rm -rf "$R" "$work/cp" "$work/tar"
    s=$(now); nb image import -q "$SRC" --name src >/dev/null; e=$(now)
    t[import]+=" $(calc "$e-$s")"
    s=$(now); cp -a "$SRC" "$work/cp"; m=$(now); sync; e=$(now)
    t[cp]+=" $(calc "$e-$s")"; t[cp_nosync]+=" $(calc "$m-$s")"
    mkdir "$work/tar"
    s=$(now); tar -C "$SRC" -cf - . | tar -C "$work/tar" -xf -; sync; e=$(now)
    t[tar]+=" $(calc "$e-$s")"
    rm -rf "$work/cp" "$work/tar"
done
declare -A med mbps
for m in import cp cp_nosync tar; do
    # shellcheck disable=SC2086
    med[$m]=$(median ${t[$m]})
    mbps[$m]=$(calc "round($bytes/${med[$m]}/1e6, 1)")
    log "$m: median ${med[$m]} s = ${mbps[$m]} MB/s"
done

# ---------------------------------------------------------------- 2. views
mkdir -p "$work/bb/bin" "$work/bb/etc" "$work/bb/tmp"
cp /bin/busybox "$work/bb/bin/"
for a in sh cat sleep true cp touch; do ln -sf busybox "$work/bb/bin/$a"; done
nb image import -q "$work/bb" --name bb >/dev/null
view=$("$VIEW_BIN" "$R/lib/images" bb 2000)
log "view from cached image: $view"
for img in host bb; do nb run --rm --image "$img" -- true; done
declare -A start
for img in host bb; do start[$img]=""; done
for ((i = 0; i < 30; i++)); do
    for img in host bb; do
        s=$(now); nb run --rm --image "$img" -- true; e=$(now)
        start[$img]+=" $(calc "($e-$s)*1000")"
    done
done
# shellcheck disable=SC2086
start_host=$(median ${start[host]})
# shellcheck disable=SC2086
start_bb=$(median ${start[bb]})
log "run --rm true: host image ${start_host} ms, store image ${start_bb} ms"

# ---------------------------------------------------------------- 3. disk per box
du_k() { du -sk "$@" 2>/dev/null | awk '{s+=$1} END {print s+0}'; }
before=$(du_k "$R/lib" "$R/run")
for ((i = 0; i < BOXES; i++)); do nb run -d --name "d$i" --image bb -- sleep 600 >/dev/null; done
after=$(du_k "$R/lib" "$R/run")
per_box=$(calc "round(($after-$before)/$BOXES, 1)")
layer_only=$(calc "round($(du_k "$R"/lib/boxes)/$BOXES, 1)")
log "$BOXES boxes: +$((after - before)) KiB, $per_box KiB per box ($layer_only KiB in lib/boxes)"
for ((i = 0; i < BOXES; i++)); do nb rm -f "d$i" >/dev/null; done

# ---------------------------------------------------------------- 4. dedup
uniq_src=/usr/share/locale
[[ -d $uniq_src ]] || uniq_src=/usr/share/doc
nb run --name dda --image bb -v "$SRC:/src:ro" -- cp -a /src /tmp/lib
nb run --name ddb --image bb -v "$SRC:/src:ro" -v "$uniq_src:/u:ro" -- sh -c 'cp -a /src /tmp/lib && cp -a /u /tmp/uniq'
nb dedup --dry-run --json >/dev/null # warm
dd_s=""
for ((i = 0; i < 3; i++)); do
    j=$(nb dedup --dry-run --json)
    dd_s+=" $(jq .seconds <<<"$j")"
done
# shellcheck disable=SC2086
dd_med=$(median $dd_s)
cand=$(jq .candidate_bytes <<<"$j")
uniq_b=$(jq .unique_bytes <<<"$j"); uniq_r=$(jq .unique_bytes_read <<<"$j")
dd_rate=$(calc "round($cand/$dd_med/1e6, 1)")
uniq_pct=$(calc "round(100*$uniq_r/max($uniq_b,1), 2)")
levels=$(jq -c .levels <<<"$j")
real=$(nb dedup --json)
real_s=$(jq .seconds <<<"$real"); merged=$(jq .merged_files <<<"$real"); merged_b=$(jq .merged_bytes <<<"$real")
real_rate=$(calc "round($cand/$real_s/1e6, 1)")
log "dedup dry run: ${dd_med} s over $cand bytes = $dd_rate MB/s; unique files: $uniq_r of $uniq_b bytes read ($uniq_pct %)"
log "dedup: merged $merged files ($merged_b bytes) in $real_s s ($real_rate MB/s)"
df_json=$(nb store df --json)
nb rm dda ddb >/dev/null

# ---------------------------------------------------------------- 5. page cache
# ~50 MB of the largest libraries of the source, in images made of busybox plus
# /data: one shared image, and 10 images each with a private copy (other mtime,
# so other inodes: what boxes would cost without the store's sharing).
mapfile -t libs < <(cd "$SRC" && find . -xdev -type f -name '*.so*' -printf '%s %P\n' | sort -rn |
    awk '$1 + s <= 50e6 {s += $1; print $2}')
set_bytes=$( (cd "$SRC" && du -cb --apparent-size "${libs[@]}") | tail -1 | cut -f1)
mkrootfs() { # DIR [MTIME]
    mkdir -p "$1/bin" "$1/data"
    cp /bin/busybox "$1/bin/"
    for a in sh cat sleep; do ln -sf busybox "$1/bin/$a"; done
    local i=0 f
    for f in "${libs[@]}"; do
        cp "$SRC/$f" "$1/data/$i"
        [[ -z ${2:-} ]] || touch -d "@$2" "$1/data/$i"
        i=$((i + 1))
    done
}
evict_tree() { # drop the page cache of an image's files (posix_fadvise DONTNEED)
    python3 - "$(nb image inspect "$1" | jq -r .tree)/data" <<'EOF'
import os, sys
for n in os.listdir(sys.argv[1]):
    fd = os.open(os.path.join(sys.argv[1], n), os.O_RDONLY)
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
EOF
}
file_mem() { # file-backed memory charged to a box's memory cgroup, bytes
    local dir
    dir=$(nb inspect "$1" | jq -r '.cgroup.memory // empty')
    [[ -n $dir && -f $dir/memory.stat ]] || { echo 0; return; }
    awk '$1=="cache"||$1=="file" {print $2; exit}' "$dir/memory.stat"
}
read_in_boxes() { # IMAGE... : one reader box per image; total file memory charged
    local total=0 i=0 img v j
    for img in "$@"; do
        nb run -d --name "pc$i" --image "$img" -- sh -c 'cat /data/* > /dev/null; echo READY; sleep 600' >/dev/null
        for _ in $(seq 400); do nb logs "pc$i" | grep -q READY && break; sleep 0.05; done
        i=$((i + 1))
    done
    for ((j = 0; j < i; j++)); do
        v=$(file_mem "pc$j"); total=$((total + v)); nb rm -f "pc$j" >/dev/null
    done
    echo "$total"
}
mkrootfs "$work/rs-shared"
nb image import -q "$work/rs-shared" --name shared >/dev/null
privs=()
for ((i = 0; i < 10; i++)); do
    mkrootfs "$work/rs-$i" $((1600000000 + i))
    nb image import -q "$work/rs-$i" --name "priv$i" >/dev/null
    privs+=("priv$i")
done
rm -rf "$work"/rs-*
evict_tree shared
shared_total=$(read_in_boxes shared shared shared shared shared shared shared shared shared shared)
for p in "${privs[@]}"; do evict_tree "$p"; done
private_total=$(read_in_boxes "${privs[@]}")
log "page cache, 10 boxes reading $set_bytes bytes: shared image $shared_total, private copies $private_total"

# ---------------------------------------------------------------- report
host=$(hostname); kernel=$(uname -r); cpu=$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ //')
jq -n --arg src "$SRC" --argjson files "$files" --argjson bytes "$bytes" --argjson runs "$RUNS" \
    --argjson imp "${med[import]}" --argjson cp "${med[cp]}" --argjson cpn "${med[cp_nosync]}" --argjson tar "${med[tar]}" \
    --argjson view "$view" --argjson sh "$start_host" --argjson sb "$start_bb" \
    --argjson boxes "$BOXES" --argjson perbox "$per_box" --argjson layer "$layer_only" \
    --argjson ddmed "$dd_med" --argjson cand "$cand" --argjson ub "$uniq_b" --argjson ur "$uniq_r" \
    --argjson levels "$levels" --argjson real "$real" --argjson df "$df_json" \
    --argjson setb "$set_bytes" --argjson shared "$shared_total" --argjson private "$private_total" \
    '{source: $src, files: $files, bytes: $bytes, runs: $runs,
      import_s: {nestbox: $imp, cp_a_sync: $cp, cp_a: $cpn, tar_sync: $tar},
      view: $view, start_ms: {host: $sh, store: $sb},
      boxes: $boxes, kib_per_box: $perbox, kib_per_box_layers: $layer,
      dedup: {dry_run_median_s: $ddmed, candidate_bytes: $cand, unique_bytes: $ub, unique_bytes_read: $ur, levels: $levels, real: $real},
      df: $df, page_cache: {set_bytes: $setb, shared_total: $shared, private_total: $private}}' >"$RESULTS_DIR/store.json"

mb() { calc "round($1/1e6, 1)"; }
{
    echo "## Image store (bench/store.sh)"
    echo
    echo "| what | value |"
    echo "|---|---|"
    echo "| machine | $host, $cpu, kernel $kernel, $(nproc) CPUs |"
    echo "| source | \`$SRC\`: $files files, $(mb "$bytes") MB, warm page cache; $RUNS runs each, interleaved, median |"
    echo
    echo "| import of the same tree | median s | MB/s | nestbox / this |"
    echo "|---|---:|---:|---:|"
    for m in import cp tar cp_nosync; do
        label=$m
        case $m in import) label="nestbox image import (syncfs)" ;; cp) label="cp -a + sync" ;; tar) label="tar \\| tar + sync" ;; cp_nosync) label="cp -a (no sync)" ;; esac
        echo "| $label | $(calc "round(${med[$m]}, 3)") | ${mbps[$m]} | $(calc "round(${med[$m]}/${med[import]}, 2)")x |"
    done
    echo
    echo "| measure | target | measured |"
    echo "|---|---|---|"
    echo "| import from a warm directory | ≥ 200 MB/s | ${mbps[import]} MB/s |"
    echo "| new box view from a cached image (open_image + root_view, 2000 runs) | ≤ 2 ms | median $(jq .median_us <<<"$view") µs, p90 $(jq .p90_us <<<"$view") µs |"
    echo "| \`run --rm -- true\`, 30 runs each | — | host image $(calc "round($start_host,2)") ms, store image $(calc "round($start_bb,2)") ms |"
    echo "| disk added per box, $BOXES running boxes of one image, before writing | ≤ 100 KiB | $per_box KiB ($layer_only KiB of it in the layer/log directory) |"
    echo "| dedup: bytes read of files found unique | ≤ 10 % | $uniq_r of $uniq_b bytes ($uniq_pct %) |"
    echo "| dedup rate on cached data (dry run, candidate bytes / time) | ≥ 500 MB/s | $dd_rate MB/s ($(mb "$cand") MB in $(calc "round($dd_med, 3)") s) |"
    echo "| dedup rate, real run (merging $merged files, $(mb "$merged_b") MB) | — | $real_rate MB/s ($(calc "round($real_s, 3)") s) |"
    echo "| page cache of 10 boxes reading the same $(mb "$set_bytes") MB (sum of cgroup file memory) | ≈ $(mb "$set_bytes") MB | $(mb "$shared_total") MB (private copies: $(mb "$private_total") MB) |"
    echo
    echo "Dedup levels (dry run): \`$levels\`"
    echo
    echo "Reproduce: \`cargo build --release && cargo build --release --example view_latency -p nestbox-image && sudo bench/store.sh\`"
} >"$RESULTS_DIR/store.md"
cat "$RESULTS_DIR/store.md"
