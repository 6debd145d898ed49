#!/bin/sh
# Runs every benchmark part (scripts/bench-*.sh) in turn. BENCH_SIZE sets the
# generated home's size (default 1G); BENCH_DIR where scratch data goes.
# bench-lazy.sh takes its sizes from SIZES (default "1G 8G"); bench-rpo.sh
# its trials and rounds from TRIALS (20) and ROUNDS (12, one a minute).
set -eu
cd "$(dirname "$0")/.."
export BENCH_SIZE=${BENCH_SIZE:-1G}
export BENCH_DIR=${BENCH_DIR:-/var/tmp/hermesfs-bench}
mkdir -p "$BENCH_DIR"
echo "machine: $(uname -srm), $(nproc) cores, $(awk '/MemTotal/ {printf "%.0f GiB", $2/1048576}' /proc/meminfo)"
status=0
for part in scripts/bench-*.sh; do
	[ -e "$part" ] || continue
	echo "== $part"
	sh "$part" || { echo "$part failed" >&2; status=1; }
done
exit $status
