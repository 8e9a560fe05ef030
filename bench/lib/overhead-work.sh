#!/bin/sh
# One isolation-overhead workload, timed from inside (so that starting the
# box or container is not counted); prints the elapsed microseconds.
#   cpu      MD5 of 256 MiB of zeros from a pipe (user-space CPU, few syscalls)
#   syscall  2 million 1-byte dd reads and writes (/dev/zero -> /dev/null)
#   file     128 MiB written to a file in 4 KiB writes, read back, removed
# $1: the workload; $2: a writable directory (the box's own file system).
set -e
t0=$(date +%s%N)
case $1 in
cpu) dd if=/dev/zero bs=1048576 count=256 2>/dev/null | md5sum >/dev/null ;;
syscall) dd if=/dev/zero of=/dev/null bs=1 count=2000000 2>/dev/null ;;
file)
    dd if=/dev/zero of="$2/overhead-file" bs=4096 count=32768 2>/dev/null
    dd if="$2/overhead-file" of=/dev/null bs=4096 2>/dev/null
    rm -f "$2/overhead-file"
    ;;
*) echo "unknown workload $1" >&2; exit 2 ;;
esac
t1=$(date +%s%N)
echo $(((t1 - t0) / 1000))
