#!/bin/sh
# End-to-end benchmark of 'hermesfs mount' against versitygw on 127.0.0.1:
#   - first mount over an existing home (seed: pack + upload)
#   - start to ready on a new host (empty cache: download, verify, mount)
#   - snapshot after (a) no change, (b) 1% of the files changed, (c) the
#     database grown by 10 MiB, (d) a copy of the database made (as Hermes
#     does in state-snapshots/): wall time, pack time, bytes uploaded, the
#     new segment's bytes, live bytes rewritten out of mostly-dead segments,
#     and the image's extents and segments
#   - baseline in the same run: mksquashfs of the same tree + one plain S3 PUT
#     of the archive (what a hand-written squashfs cron script does), and for
#     boot its restore: a plain GET of that archive, and GET + unsquashfs
#   - encrypted vs plaintext (BENCH_ENCRYPT=0 skips it): the same home
#     published with --encrypt-to into another prefix: seed CPU (pack +
#     encrypt), snapshot after 1% changed (wall, bytes uploaded), start to
#     ready on a new host (download + decrypt), read-all throughput
# Env: BENCH_SIZE (default 1G), BENCH_DIR (scratch, default
# /var/tmp/hermesfs-bench), HERMESFS_BIN (default bin/hermesfs).
set -eu
cd "$(dirname "$0")/.."
. scripts/bench-s3link.sh
root=$(pwd)
BENCH_SIZE=${BENCH_SIZE:-1G}
BENCH_DIR=${BENCH_DIR:-/var/tmp/hermesfs-bench}
bin=${HERMESFS_BIN:-$root/bin/hermesfs}
[ -x "$bin" ] || { echo "bench-e2e: $bin missing (make build)" >&2; exit 1; }
gobin=$(go env GOPATH)/bin
vgw=$(command -v versitygw || echo "$gobin/versitygw")
[ -x "$vgw" ] || { echo "bench-e2e: versitygw missing (scripts/deps.sh test)" >&2; exit 1; }

mkdir -p "$BENCH_DIR"
# The generated home, shared with the other benchmarks.
home=$(scripts/genhome/cached.sh "$BENCH_SIZE" 1)
work=$BENCH_DIR/e2e
cleanup() {
	for m in "$work/mnt-a" "$work/mnt-b" "$work/mnt-c" "$work/mnt-d"; do
		mountpoint -q "$m" 2>/dev/null && umount -l "$m"
	done
	for p in ${pids:-}; do kill "$p" 2>/dev/null && wait "$p" 2>/dev/null; done
	# Keep the daemons' logs for a look at the figures of each snapshot.
	mkdir -p "$BENCH_DIR/e2e-logs" && cp "$work"/*.log "$BENCH_DIR/e2e-logs/" 2>/dev/null
	rm -rf "$work"
}
trap cleanup EXIT INT TERM
rm -rf "$work"
mkdir -p "$work/s3" "$work/mnt-b"

# versitygw on a free loopback port, one bucket.
pids=""
s3_start bench-e2e
export HERMESFS_STORE="s3://bench/home?endpoint=$ep&region=us-east-1&path_style=true"
export HERMESFS_LOG_LEVEL=info

now() { date +%s.%N; }
# cpu PID: user + system CPU seconds the process has used so far.
cpu() { awk -v hz="$(getconf CLK_TCK)" '{print ($14 + $15) / hz}' "/proc/$1/stat"; }
# readall DIR: read every file's bytes; prints seconds.
readall() {
	t0=$(now)
	find "$1" -type f -print0 | xargs -0 cat >/dev/null
	t1=$(now)
	elapsed "$t0" "$t1"
}
elapsed() { echo "$2 - $1" | bc; }
ratio() { echo "scale=2; $1 / $2" | bc; }
files=$(find "$home" -type f | wc -l)
bytes=$(du -sb "$home" | cut -f1)
echo "load average before: $(cut -d" " -f1-3 /proc/loadavg)"
echo "tree: $files files, $(echo "scale=1; $bytes / 1048576" | bc) MiB ($home)"

# Baseline: mksquashfs + one PUT of the archive.
t0=$(now)
mksquashfs "$home" "$work/base.sqfs" -comp zstd -Xcompression-level 3 -processors "$(nproc)" -noappend -quiet >/dev/null
t1=$(now)
s3curl -T "$work/base.sqfs" "$ep/bench/baseline.sqfs" >/dev/null
t2=$(now)
base_pack=$(elapsed "$t0" "$t1")
base_up=$(elapsed "$t1" "$t2")
base_total=$(elapsed "$t0" "$t2")
base_size=$(stat -c %s "$work/base.sqfs")
echo "baseline mksquashfs + PUT: ${base_total}s (pack ${base_pack}s, upload ${base_up}s), $base_size bytes"

# Host A: seed from a copy of the home (the original is the user's).
cp -a "$home" "$work/mnt-a"
ready() { # $1 log: wait for the ready line
	until grep -q '^ready ' "$1"; do
		kill -0 "$2" 2>/dev/null || { echo "bench-e2e: hermesfs exited:" >&2; cat "$1" >&2; exit 1; }
		sleep 0.05
	done
}
t0=$(now)
HERMESFS_STATE_DIR=$work/state-a "$bin" mount --interval 0 "$work/mnt-a" >"$work/a.out" 2>"$work/a.log" &
apid=$!
ready "$work/a.out" "$apid"
t1=$(now)
seed=$(elapsed "$t0" "$t1")
acpu=$(cpu "$apid")
echo "first mount over the existing home (pack + upload + mount): ${seed}s ($(ratio "$seed" "$base_total")x baseline)"

snap() { # $1 label
	t0=$(now)
	id=$(HERMESFS_STATE_DIR=$work/state-a "$bin" snapshot "$work/mnt-a")
	t1=$(now)
	s=$(elapsed "$t0" "$t1")
	case $id in *unchanged*)
		echo "snapshot after $1: ${s}s ($(ratio "$s" "$base_total")x baseline), nothing uploaded"
		return ;;
	esac
	up=$(HERMESFS_STATE_DIR=$work/state-a "$bin" status --json "$work/mnt-a" | python3 -c 'import json,sys; r=json.load(sys.stdin); l=r.get("last_snapshot") or {}; print(l.get("bytes_uploaded",0), l.get("size",0), l.get("bytes_reused",0))')
	set -- "$1" $up
	# The figures status does not carry are in the daemon's log line.
	line=$(grep 'snapshot published' "$work/a.log" | tail -1)
	field() { echo "$line" | tr ' ' '\n' | sed -n "s/^$1=//p" | head -1; }
	echo "snapshot after $1: ${s}s ($(ratio "$s" "$base_total")x baseline), pack $(field pack), upload $(field upload)," \
		"uploaded $2 bytes for a $3-byte image (segment $(field segment_bytes), rewritten $(field rewritten_bytes))," \
		"$4 bytes of file data reused, $(field extents) extents over $(field segments) segments"
}
snap "no change"
# (b) 1% of the files changed (appended to), through the mount.
n=$((files / 100))
find "$work/mnt-a" -type f -name '*.json' | head -n "$n" | while read -r f; do echo '{"changed":true}' >>"$f"; done
snap "1% of files changed ($n files)"
# (c) the database grown by 10 MiB.
db=$(find "$work/mnt-a" -maxdepth 1 -name '*.db' | head -1)
# Text rows (hex), compressible about as well as transcripts: 160 x 64 KiB.
sqlite3 "$db" "CREATE TABLE IF NOT EXISTS bench_growth(t TEXT); WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x+1 FROM c WHERE x < 160) INSERT INTO bench_growth SELECT hex(randomblob(32768)) FROM c;"
snap "database grown by 10 MiB"
# (d) Hermes copies the database into state-snapshots/.
cp "$db" "$work/mnt-a/state-snapshots/state-bench-copy.db"
snap "a copy of the database made"

t0=$(now)
kill -TERM "$apid"
wait "$apid" || { echo "bench-e2e: host A exited $?" >&2; cat "$work/a.log" >&2; exit 1; }
t1=$(now)
echo "stop (final snapshot: nothing changed, unmount, rebase): $(elapsed "$t0" "$t1")s"

# Host B: empty cache, empty mountpoint: download, verify, mount.
t0=$(now)
HERMESFS_STATE_DIR=$work/state-b "$bin" mount --interval 0 "$work/mnt-b" >"$work/b.out" 2>"$work/b.log" &
bpid=$!
ready "$work/b.out" "$bpid"
t1=$(now)
boot=$(elapsed "$t0" "$t1")
# The cron script's restore of the same tree: GET its archive (the
# baseline's, the same tree as the seed), then unsquashfs.
t2=$(now)
s3curl -o "$work/dl.sqfs" "$ep/bench/baseline.sqfs"
t3=$(now)
unsquashfs -q -no-progress -d "$work/unpacked" "$work/dl.sqfs" >/dev/null
t4=$(now)
dl=$(elapsed "$t2" "$t3")
dlx=$(elapsed "$t2" "$t4")
echo "start to ready, new host, empty cache: ${boot}s; the cron script's archive of the tree: plain GET ${dl}s ($(ratio "$boot" "$dl")x), GET + unsquashfs ${dlx}s ($(ratio "$boot" "$dlx")x)"
rb=$(readall "$work/mnt-b")
echo "read-all through the mount (new host, plaintext): ${rb}s, $(echo "scale=1; $bytes / 1048576 / $rb" | bc) MiB/s"
kill -TERM "$bpid"
wait "$bpid" || true
grep 'snapshot published' "$work/a.log" | sed 's/^/  log: /' | cut -c1-300

[ "${BENCH_ENCRYPT:-1}" = 1 ] || exit 0
# Encrypted vs plaintext: host C seeds another prefix with --encrypt-to,
# takes a snapshot after 1% of the files changed; host D boots from it.
"$bin" keygen "$work/key.txt" >"$work/recipient" 2>/dev/null
export HERMESFS_ENCRYPT_TO="$(cat "$work/recipient")" HERMESFS_IDENTITY="$work/key.txt"
export HERMESFS_STORE="s3://bench/enc?endpoint=$ep&region=us-east-1&path_style=true"
cp -a "$home" "$work/mnt-c"
: >"$work/c.out"
t0=$(now)
HERMESFS_STATE_DIR=$work/state-c "$bin" mount --interval 0 "$work/mnt-c" >"$work/c.out" 2>"$work/c.log" &
cpid=$!
ready "$work/c.out" "$cpid"
t1=$(now)
eseed=$(elapsed "$t0" "$t1")
ccpu=$(cpu "$cpid")
echo "encrypted: first mount (pack + encrypt + upload): ${eseed}s against ${seed}s plaintext; CPU ${ccpu}s against ${acpu}s ($(ratio "$ccpu" "$acpu")x)"
find "$work/mnt-c" -type f -name '*.json' | head -n "$n" | while read -r f; do echo '{"changed":true}' >>"$f"; done
t0=$(now)
HERMESFS_STATE_DIR=$work/state-c "$bin" snapshot "$work/mnt-c" >/dev/null
t1=$(now)
line=$(grep 'snapshot published' "$work/c.log" | tail -1)
field() { echo "$line" | tr ' ' '\n' | sed -n "s/^$1=//p" | head -1; }
echo "encrypted: snapshot after 1% of files changed ($n files): $(elapsed "$t0" "$t1")s, pack $(field pack), upload $(field upload)," \
	"uploaded $(field bytes_uploaded) bytes for a $(field size)-byte image (segment $(field segment_bytes)), $(field extents) extents over $(field segments) segments"
kill -TERM "$cpid"
wait "$cpid" || { echo "bench-e2e: host C exited $?" >&2; cat "$work/c.log" >&2; exit 1; }
mkdir -p "$work/mnt-d"
: >"$work/d.out"
t0=$(now)
HERMESFS_STATE_DIR=$work/state-d "$bin" mount --interval 0 "$work/mnt-d" >"$work/d.out" 2>"$work/d.log" &
dpid=$!
ready "$work/d.out" "$dpid"
t1=$(now)
eboot=$(elapsed "$t0" "$t1")
echo "encrypted: start to ready, new host, empty cache (download + decrypt): ${eboot}s against ${boot}s plaintext ($(ratio "$eboot" "$boot")x)"
rd=$(readall "$work/mnt-d")
echo "encrypted: read-all through the mount: ${rd}s against ${rb}s plaintext ($(ratio "$rd" "$rb")x)"
kill -TERM "$dpid"
wait "$dpid" || true
# Pack and encryption CPU of the same tree, each measured alone.
cpuof() { python3 -c 'import resource, subprocess, sys
subprocess.run(sys.argv[1:], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
r = resource.getrusage(resource.RUSAGE_CHILDREN); print(round(r.ru_utime + r.ru_stime, 2))' "$@"; }
pcpu=$(cpuof "$bin" pack "$home" "$work/p.sqfs")
if command -v age >/dev/null 2>&1; then
	ecpu=$(cpuof age -r "$HERMESFS_ENCRYPT_TO" -o "$work/p.sqfs.age" "$work/p.sqfs")
	echo "encrypted: pack CPU ${pcpu}s; age encryption of its $(stat -c %s "$work/p.sqfs")-byte archive CPU ${ecpu}s (+$(echo "scale=1; 100 * $ecpu / $pcpu" | bc)%)"
fi
