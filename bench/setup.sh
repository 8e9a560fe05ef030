#!/usr/bin/env bash
# Install what the benchmarks compare against (runc, bubblewrap) and use
# (hyperfine if available, jq, python3, wrk for bench/service.sh), from Debian packages. Idempotent:
# `apt-get update` runs only when something is missing.
set -euo pipefail

export DEBIAN_FRONTEND=noninteractive

if [[ $(id -u) -ne 0 ]]; then
    echo "setup.sh: must run as root (apt-get install)" >&2
    exit 1
fi

# package -> command it provides
declare -A wanted=(
    [runc]=runc
    [bubblewrap]=bwrap
    [jq]=jq
    [python3]=python3
    [busybox-static]=busybox
    [iperf3]=iperf3
    [nftables]=nft
    [wrk]=wrk
)
optional=(hyperfine)

missing=()
for pkg in "${!wanted[@]}"; do
    command -v "${wanted[$pkg]}" >/dev/null 2>&1 || missing+=("$pkg")
done
for pkg in "${optional[@]}"; do
    command -v "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
done

if ((${#missing[@]})); then
    echo "setup.sh: installing ${missing[*]}"
    apt-get update -qq
    for pkg in "${optional[@]}"; do
        # Drop optional packages this Debian does not have.
        if [[ " ${missing[*]} " == *" $pkg "* ]] && ! apt-cache show "$pkg" >/dev/null 2>&1; then
            echo "setup.sh: optional package $pkg unavailable, skipping"
            missing=("${missing[@]/$pkg}")
        fi
    done
    # shellcheck disable=SC2046  # word splitting intended; drops empty entries
    apt-get install -y -qq --no-install-recommends $(printf '%s ' "${missing[@]}") >/dev/null
fi

for pkg in "${!wanted[@]}"; do
    command -v "${wanted[$pkg]}" >/dev/null 2>&1 || {
        echo "setup.sh: ${wanted[$pkg]} still missing after install" >&2
        exit 1
    }
done

echo "runc:      $(runc --version | head -n1)"
echo "bwrap:     $(bwrap --version)"
echo "jq:        $(jq --version)"
echo "python3:   $(python3 --version 2>&1)"
if command -v hyperfine >/dev/null 2>&1; then
    echo "hyperfine: $(hyperfine --version)"
else
    echo "hyperfine: (not installed)"
fi
