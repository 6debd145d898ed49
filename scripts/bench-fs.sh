#!/bin/sh
# Filesystem (overlay) benchmark, run by `make bench` through scripts/bench.sh.
#
# On a generated Hermes home of BENCH_SIZE (default 1G; cached under
# BENCH_DIR by scripts/genhome/cached.sh), scripts/fsbench packs the home,
# mounts it as the lower layer of the overlay and runs each workload on the
# mount and on native disk in the same run, printing overlay/native ratios:
# stat and read every file (cold: page cache dropped, and warm), open and
# close every file (what the OPEN round trip alone costs), 5k files
# created the Hermes way (temp + fsync + rename), 3,000 SQLite autocommit
# inserts in WAL mode, 4 KiB random writes to a copied-up file (again with
# writable passthrough raised to cover it, and the freeze it then costs),
# the stall of the first write into a 1 GiB lower file, passthrough against
# daemon-served reads of upper files, and the freeze stall with 10 and 100
# MiB dirty; and the copy-up group: the first write into 1 and 4 GiB lower files
# by range against whole-file copy-up, a fresh session's first SQLite commit, random
# writes while a partial file completes, the freeze with a partial file.
# Needs root (FUSE, drop_caches) and sqlite3.
set -eu
cd "$(dirname "$0")/.."
SIZE=${BENCH_SIZE:-1G}
DIR=${BENCH_DIR:-/var/tmp/hermesfs-bench}
RUNS=${BENCH_RUNS:-3}
BIG=${BENCH_BIG_MIB:-1024}
command -v sqlite3 >/dev/null || { echo "bench-fs: sqlite3 not installed (scripts/deps.sh test)" >&2; exit 1; }
[ "$(id -u)" = 0 ] || { echo "bench-fs: needs root (FUSE mounts, drop_caches)" >&2; exit 1; }

home=$(scripts/genhome/cached.sh "$SIZE" 1)
work="$DIR/fs-work"
img="$DIR/fs-lower.sqfs" # packed by the first run, reused by the second
bin="$DIR/fsbench"
go build -o "$bin" ./scripts/fsbench
cleanup() {
	for m in "$work/mnt" "$work/loopmnt"; do
		mountpoint -q "$m" 2>/dev/null && umount -l "$m"
	done
	rm -rf "$work" "$work.out2" "$img"
}
trap cleanup EXIT INT TERM
echo "machine: $(uname -srm), $(nproc) cores, $(awk '/MemTotal/ {printf "%.0f GiB", $2/1048576}' /proc/meminfo), disk $(df -h "$DIR" | awk 'NR==2 {print $1}')"
rm -f "$img"
"$bin" -home "$home" -work "$work" -runs "$RUNS" -big "$BIG" -image "$img"
# The writes again with writable passthrough for files up to 512 MiB (the
# copied-up state.db included): faster writes, a longer freeze for them.
echo "# again with -ptwrite-max 512 (PassthroughWriteMax 512 MiB):"
# (A pipe would hide fsbench's exit status from set -e.)
"$bin" -home "$home" -work "$work" -runs "$RUNS" -big "$BIG" -image "$img" -only writes -ptwrite-max 512 >"$work.out2"
grep -v '^workload' "$work.out2"
rm -f "$work.out2"
