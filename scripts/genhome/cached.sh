#!/bin/sh
# Prints the path of a generated Hermes home of SIZE (default $BENCH_SIZE or
# 1G) and SEED (default 1), generating it first if it is not cached yet.
# With ENTRIES (e.g. 120k, 1M) the home also holds an installed agent of
# that many entries (genhome -install -entries ENTRIES).
# Benchmarks share it: $BENCH_DIR/home-<size>-seed<seed>[-i<entries>-i<install
# version>]-g<generator version> (default BENCH_DIR /var/tmp/hermesfs-bench).
# A .complete marker, written last, tells a finished tree from an
# interrupted one. Bump gen below whenever genhome's output for a seed
# changes, igen whenever -install's does.
#   usage: scripts/genhome/cached.sh [SIZE [SEED [ENTRIES]]]
set -eu
size=${1:-${BENCH_SIZE:-1G}}
seed=${2:-1}
entries=${3:-}
gen=2
igen=1
dir=${BENCH_DIR:-/var/tmp/hermesfs-bench}
home="$dir/home-$size-seed$seed-g$gen"
set --
if [ -n "$entries" ]; then
	home="$dir/home-$size-seed$seed-i$entries-i$igen-g$gen"
	set -- -install -entries "$entries"
fi
if [ ! -e "$home.complete" ]; then
	cd "$(dirname "$0")/../.."
	mkdir -p "$dir"
	rm -rf "$home" "$home.tmp"
	go run ./scripts/genhome -size "$size" -seed "$seed" "$@" -out "$home.tmp" >&2
	mv "$home.tmp" "$home"
	touch "$home.complete"
fi
echo "$home"
