#!/usr/bin/env bash
# Fuzz the importers and parsers (issue 11): every target runs for
# ${FUZZ_SECS:-600} seconds of wall time, ${FUZZ_JOBS:-2} targets at a time, in
# release mode. A target is one or more proptest properties of a `fuzz_*` test
# file (see bench/fuzz/budget.rs), run concurrently for the whole time. Prints
# per target: seconds, cases run, failures; exits 1 if any target failed.
# Not root-only; needs no network. Logs go to ${FUZZ_LOGS:-target/fuzz-logs}.
set -euo pipefail
cd "$(dirname "$0")/.."

secs=${FUZZ_SECS:-600}
jobs=${FUZZ_JOBS:-2}
logs=${FUZZ_LOGS:-target/fuzz-logs}
mkdir -p "$logs"

# name | package | test file | libtest arguments (filter / skip)
targets=(
  "tar|nestbox-store|fuzz_import|tar_import_"
  "oci|nestbox-store|fuzz_import|oci_and_docker_import"
  "size_spec|nestbox-runtime|fuzz_parsers|--skip api_request_parser"
  "rate|nestbox-net|fuzz_rate|"
  "api|nestbox-runtime|fuzz_parsers|api_request_parser"
)
if [ $# -gt 0 ]; then
  wanted=" $* "
  kept=()
  for t in "${targets[@]}"; do
    [[ $wanted == *" ${t%%|*} "* ]] && kept+=("$t")
  done
  targets=("${kept[@]}")
fi

# Built once per test file, exactly as the runs below invoke them (one package
# at a time: building packages together unifies features differently).
echo "building the fuzz tests (release)..."
for t in "${targets[@]}"; do
  IFS='|' read -r _ pkg file _ <<<"$t"
  cargo test --release -q -p "$pkg" --test "$file" --no-run
done

run_target() {
  local name=$1 pkg=$2 file=$3 args=$4 log="$logs/$1.log" start end rc=0
  start=$(date +%s.%N)
  # shellcheck disable=SC2086 # args holds the filter words
  NESTBOX_FUZZ_SECS=$secs cargo test --release -q -p "$pkg" --test "$file" -- \
    --nocapture --test-threads=16 $args >"$log" 2>&1 || rc=$?
  end=$(date +%s.%N)
  awk -v name="$name" -v wall="$(echo "$end - $start" | bc)" -v rc="$rc" '
    # libtest may put its progress dots before the line.
    match($0, /fuzz-stats .*/) {
      n = split(substr($0, RSTART), w, " ")
      for (i = 2; i <= n; i++) { split(w[i], kv, "="); f[kv[1]] = kv[2] }
      props++; cases += f["cases"]; fails += f["failures"]
      detail = detail sprintf("    %-36s %8.1f s %10d cases %d failures\n", f["target"], f["seconds"], f["cases"], f["failures"])
    }
    END {
      if (rc != 0 && fails == 0) fails = "exit " rc
      printf "%-10s %8.1f s %10d cases  failures: %s  (%d properties)\n%s", name, wall, cases, fails, props, detail
    }' "$log" >"$logs/$name.summary"
  return "$rc"
}

echo "fuzzing ${#targets[@]} targets for ${secs}s each, $jobs at a time; logs in $logs"
pids=()
names=()
status=0
for t in "${targets[@]}"; do
  IFS='|' read -r name pkg file args <<<"$t"
  while [ "$(jobs -rp | wc -l)" -ge "$jobs" ]; do
    wait -n || status=1
  done
  run_target "$name" "$pkg" "$file" "$args" &
  pids+=($!)
  names+=("$name")
done
for p in "${pids[@]}"; do
  wait "$p" || status=1
done

printf "%-10s %10s %10s  %s\n" TARGET SECONDS CASES FAILURES
for n in "${names[@]}"; do
  cat "$logs/$n.summary"
done
if [ "$status" -ne 0 ]; then
  echo "FAILED: see $logs/*.log (the shrunk input is printed there)"
fi
exit "$status"
