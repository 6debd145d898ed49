#!/bin/sh
# Stress run of 'hermesfs mount' on a local store: two concurrent SQLite
# writers, an untar/verify/delete loop and small-file churn, with a snapshot
# every STRESS_INTERVAL (default 2s), for STRESS_SECONDS (default 60). Then
# SIGTERM (final snapshot) and a check of EVERY published snapshot: unsquashfs
# extracts it, and its database passes PRAGMA integrity_check.
# Env: HERMESFS_BIN (default bin/hermesfs), STRESS_DIR (default a temp dir).
set -eu
[ -n "${STRESS_TRACE:-}" ] && set -x
cd "$(dirname "$0")/.."
bin=${HERMESFS_BIN:-$(pwd)/bin/hermesfs}
secs=${STRESS_SECONDS:-60}
interval=${STRESS_INTERVAL:-2s}
dir=${STRESS_DIR:-}
keep=1
[ -n "$dir" ] || { dir=$(mktemp -d /tmp/hermesfs-stress.XXXXXX); keep=0; }
mp=$dir/home
mkdir -p "$mp"
export HERMESFS_STORE=file://$dir/store HERMESFS_STATE_DIR=$dir/state HERMESFS_RUNTIME_DIR=$dir/run

pids=""
cleanup() {
	for p in $pids; do kill "$p" 2>/dev/null || true; done
	[ -n "${hpid:-}" ] && kill -TERM "$hpid" 2>/dev/null && wait "$hpid" 2>/dev/null
	mountpoint -q "$mp" 2>/dev/null && umount -l "$mp"
	return 0
}
trap cleanup EXIT INT TERM

"$bin" mount --interval "$interval" --keep 1000 "$mp" >"$dir/out" 2>"$dir/log" &
hpid=$!
until grep -q '^ready ' "$dir/out"; do
	kill -0 "$hpid" 2>/dev/null || { cat "$dir/log" >&2; exit 1; }
	sleep 0.1
done
echo "stress: mounted $mp, snapshots every $interval, running ${secs}s"

sqlite3 "$mp/state.db" "PRAGMA journal_mode=WAL; CREATE TABLE t(id INTEGER PRIMARY KEY, w INTEGER, v TEXT);" >/dev/null
end=$(($(date +%s) + secs))
writer() {
	i=0
	while [ "$(date +%s)" -lt "$end" ]; do
		i=$((i + 1))
		sqlite3 "$mp/state.db" "PRAGMA busy_timeout=5000; BEGIN; INSERT INTO t(w,v) VALUES ($1, hex(randomblob(300))); UPDATE t SET v=hex(randomblob(50)) WHERE id % 97 = $i % 97; COMMIT;" >/dev/null || exit 1
	done
}
writer 1 & pids="$pids $!"
writer 2 & pids="$pids $!"
(
	tar -C /usr/share -cf "$dir/src.tar" doc 2>/dev/null || true
	while [ "$(date +%s)" -lt "$end" ]; do
		mkdir -p "$mp/untar"
		tar -C "$mp/untar" -xf "$dir/src.tar" || exit 1
		tar -C "$mp/untar" -df "$dir/src.tar" >/dev/null || { echo "stress: untarred tree differs" >&2; exit 1; }
		rm -rf "$mp/untar"
	done
) & pids="$pids $!"
(
	i=0
	while [ "$(date +%s)" -lt "$end" ]; do
		i=$((i + 1))
		printf '%s\n' "$i" >"$mp/churn.$((i % 50)).tmp" && mv "$mp/churn.$((i % 50)).tmp" "$mp/churn.$((i % 50))"
		if [ $((i % 7)) -eq 0 ]; then rm -f "$mp/churn.$(((i + 13) % 50))"; fi
	done
) & pids="$pids $!"

status=0
for p in $pids; do wait "$p" || status=1; done
pids=""
[ $status -eq 0 ] || { echo "stress: a workload failed" >&2; exit 1; }
kill -TERM "$hpid"
wait "$hpid" || { echo "stress: hermesfs exited $?" >&2; tail "$dir/log" >&2; exit 1; }
hpid=""

n=0
for a in "$dir"/store/snapshots/*.sqfs; do
	rm -rf "$dir/x"
	unsquashfs -q -no-progress -d "$dir/x" "$a" >/dev/null
	ok=$(sqlite3 "$dir/x/state.db" "PRAGMA integrity_check;")
	[ "$ok" = ok ] || { echo "stress: $a: integrity_check: $ok" >&2; exit 1; }
	n=$((n + 1))
done
rm -rf "$dir/x"
echo "stress: $n snapshots, every one extracts and its database passes integrity_check"
grep -c 'snapshot published' "$dir/log" | sed 's/^/stress: snapshot log lines: /'
[ "$keep" = 1 ] || rm -rf "$dir"
