#!/usr/bin/env bash
# make_runc_bundle DIR: create an OCI bundle in DIR equivalent to nestbox's
# default box: a read-only root holding the host's /usr and /etc bind-mounted
# read-only (plus merged-usr symlinks), new pid/mount/uts/ipc/net/cgroup
# namespaces, process /bin/true, no terminal.
# Meant to be sourced; needs runc and jq.

make_runc_bundle() {
    local bundle=$1
    mkdir -p "$bundle/rootfs"
    (
        cd "$bundle/rootfs" || exit 1
        mkdir -p usr etc proc dev sys tmp
        # Mirror the host's merged-usr layout (symlinks when the host has them).
        local d
        for d in bin lib lib64 sbin; do
            if [[ -L /$d ]]; then
                ln -sfn "$(readlink "/$d")" "$d"
            elif [[ -d /$d ]]; then
                mkdir -p "$d"
            fi
        done
    )
    (cd "$bundle" && runc spec)

    # Bind mounts for the host's system dirs; real (non-symlink) /bin etc.
    # on non-merged-usr hosts get bound too.
    local mounts='[]' d
    for d in usr etc bin lib lib64 sbin; do
        [[ -d /$d && ! -L /$d ]] || continue
        mounts=$(jq -c --arg d "/$d" \
            '. + [{destination: $d, type: "bind", source: $d,
                   options: ["rbind", "ro", "nosuid", "nodev"]}]' <<<"$mounts")
    done

    jq --argjson extra "$mounts" '
        .process.terminal = false
        | .process.args = ["/bin/true"]
        | .root.readonly = true
        | .mounts += $extra
        | .linux.namespaces |= (if any(.type == "cgroup") then . else . + [{type: "cgroup"}] end)
    ' "$bundle/config.json" >"$bundle/config.json.new"
    mv "$bundle/config.json.new" "$bundle/config.json"
}
