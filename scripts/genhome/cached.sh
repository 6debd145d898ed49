#!/bin/sh
# Prints the path of a generated Hermes home of SIZE (default $BENCH_SIZE or
# 1G) and SEED (default 1), generating it first if it is not cached yet.
# Benchmarks share it: $BENCH_DIR/home-<size>-seed<seed>-g<generator
# version> (default BENCH_DIR /var/tmp/hermesfs-bench). A .complete marker,
# written last, tells a finished tree from an interrupted one. Bump gen
# below whenever genhome's output for a seed changes.
#   usage: scripts/genhome/cached.sh [SIZE [SEED]]
set -eu
size=${1:-${BENCH_SIZE:-1G}}
seed=${2:-1}
gen=2
dir=${BENCH_DIR:-/var/tmp/hermesfs-bench}
home="$dir/home-$size-seed$seed-g$gen"
if [ ! -e "$home.complete" ]; then
	cd "$(dirname "$0")/../.."
	mkdir -p "$dir"
	rm -rf "$home" "$home.tmp"
	go run ./scripts/genhome -size "$size" -seed "$seed" -out "$home.tmp" >&2
	mv "$home.tmp" "$home"
	touch "$home.complete"
fi
echo "$home"
