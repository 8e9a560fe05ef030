#!/bin/sh
# One OCI container cycle, as a caller such as containerd's shim drives it:
# create, start, delete --force. Usage: oci-cycle.sh RUNTIME ROOT BUNDLE ID
# (the runtime's stdio goes to /dev/null; a failing step fails the cycle).
set -e
rt=$1 root=$2 bundle=$3 id=$4
"$rt" --root "$root" create --bundle "$bundle" "$id" >/dev/null
"$rt" --root "$root" start "$id"
"$rt" --root "$root" delete --force "$id"
