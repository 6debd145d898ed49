#!/bin/sh
# Memory hook: what the memory-file guard costs. Runs BenchmarkHook
# (fs/memguard), which drives overlay mounts in one process, one with the
# guard and two without any (the second is a control: its ratio to the first
# is the noise floor), through the same workloads interleaved round by round,
# and prints the results as ratios. Sizes: BENCH_HOOK_FILES (small
# files, default 5000), BENCH_HOOK_WRITES (4 KiB writes, default 50000),
# BENCH_HOOK_MEM (guarded MEMORY.md updates, default 200), in
# BENCH_HOOK_ROUNDS rounds (default 20). Scratch data goes under BENCH_DIR.
set -eu
cd "$(dirname "$0")/.."
BENCH_DIR=${BENCH_DIR:-/var/tmp/hermesfs-bench}
mkdir -p "$BENCH_DIR"
out=$(TMPDIR=$BENCH_DIR go test -run '^$' -bench '^BenchmarkHook$' -benchtime 1x -count 1 -timeout 30m ./fs/memguard) || {
	echo "$out" >&2
	exit 1
}
echo "$out" | awk '
/^BenchmarkHook/ {
	for (i = 3; i < NF; i += 2) m[$(i + 1)] = $i
	found = 1
}
END {
	if (!found) { print "bench-hook: no result" > "/dev/stderr"; exit 1 }
	printf "hook: other files, %d x (1 KiB temp file + fsync + rename): no guard %.1f us/file, guard %.1f us/file: ratio %.3f, median of rounds %.3f; control (a second unguarded mount) %.3f, median %.3f\n",
		m["small-files"], m["small-noguard-us/file"], m["small-guard-us/file"],
		m["small-guard-us/file"] / m["small-noguard-us/file"], m["small-median-ratio"],
		m["small-control-us/file"] / m["small-noguard-us/file"], m["small-control-median-ratio"]
	printf "hook: other files, %d x 4 KiB write to one file: no guard %.2f us/write, guard %.2f us/write: ratio %.3f, median of rounds %.3f; control %.3f, median %.3f\n",
		m["w4k-writes"], m["w4k-noguard-us/write"], m["w4k-guard-us/write"],
		m["w4k-guard-us/write"] / m["w4k-noguard-us/write"], m["w4k-median-ratio"],
		m["w4k-control-us/write"] / m["w4k-noguard-us/write"], m["w4k-control-median-ratio"]
	printf "hook: MEMORY.md update (Hermes temp + fsync + rename, ~2,100 chars), %d updates: guard %.0f us, no guard %.0f us: ratio %.2f, median of rounds %.2f; native disk %.0f us\n",
		m["mem-updates"], m["mem-guard-us/update"], m["mem-noguard-us/update"],
		m["mem-guard-us/update"] / m["mem-noguard-us/update"], m["mem-median-ratio"], m["mem-native-us/update"]
}'
