#!/bin/sh
# Local speed for an installed agent, run by `make bench` through
# scripts/bench.sh. On a generated home with an installed agent
# (scripts/genhome/cached.sh INSTALL_SIZE 1 INSTALL_ENTRIES: a 300M home
# plus a checkout, venv, node_modules and Node runtime of 120k entries by
# default), scripts/fsbench -installed packs the home once, mounts the image
# as the overlay's lower layer and, as the reference, with the kernel's
# squashfs under overlayfs, and runs on native disk and both mounts, taking
# turns: Python importing 20 packages from the venv (PYTHONHOME pointed at
# it: its stdlib and site-packages are copies of the machine's Python),
# `node -e` requiring 12 packages of the checkout's node_modules (the
# machine's node binary, the modules from the tree), `git status` of the
# checkout, find over the whole home, stat of every entry, read of every
# file. Cold (each mount remounted, then the page cache dropped: see the top
# of scripts/fsbench/installed.go) and warm, the median of TRIALS runs
# each; ratios to native. Needs root (FUSE, loop mounts, drop_caches),
# git, python3 and node.
set -eu
cd "$(dirname "$0")/.."
SIZE=${INSTALL_SIZE:-300M}
ENTRIES=${INSTALL_ENTRIES:-120k}
TRIALS=${TRIALS:-5}
DIR=${BENCH_DIR:-/var/tmp/hermesfs-bench}
[ "$(id -u)" = 0 ] || { echo "bench-installed: needs root (FUSE and loop mounts, drop_caches)" >&2; exit 1; }
for c in git python3 node; do
	command -v $c >/dev/null || { echo "bench-installed: $c missing" >&2; exit 1; }
done
home=$(scripts/genhome/cached.sh "$SIZE" 1 "$ENTRIES")
work="$DIR/installed-work"
bin="$DIR/fsbench-installed"
go build -o "$bin" ./scripts/fsbench
cleanup() {
	for m in "$work/mnt" "$work/kmnt" "$work/klower"; do
		mountpoint -q "$m" 2>/dev/null && umount -l "$m"
	done
	rm -rf "$work"
}
trap cleanup EXIT INT TERM
echo "machine: $(uname -srm), $(nproc) cores, $(awk '/MemTotal/ {printf "%.0f GiB", $2/1048576}' /proc/meminfo), disk $(df -h "$DIR" | awk 'NR==2 {print $1}'); load average before: $(cut -d' ' -f1-3 /proc/loadavg)"
echo "home: $home ($SIZE + installed agent of $ENTRIES entries); python $(python3 -c 'import sys; print(sys.version.split()[0])'), node $(node --version), $(git --version)"
"$bin" -installed -home "$home" -work "$work" -trials "$TRIALS"
echo "load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
