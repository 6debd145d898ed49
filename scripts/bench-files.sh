#!/bin/sh
# What the file count costs: a home with an installed agent (its checkout,
# venv, node_modules and Node runtime: `genhome -install`, ENTRIES entries
# beside a FILES_SIZE generated home) against the same home without them,
# in one run, with restic side by side on the same trees and the same
# changes. versitygw (posix) on 127.0.0.1 behind the shaped fault proxy
# (uploader/faultproxy/cmd/shapedproxy: LINK_RATE each way, LINK_LATENCY a
# request), which counts every contender's bytes and requests.
#
# Part "change", for each entry count in FILES_ENTRIES (default 120k; with
# FILES_1M=1 also 1M), on the installed home and on the plain one
# (scripts/genhome/cached.sh FILES_SIZE 1 [ENTRIES]):
#   - seeding: `hermesfs mount --interval 0 --write-back 0` over a copy of
#     the home through the link (the mount's first snapshot is the store's
#     first), timed to ready;
#   - a one-line change, TRIALS (3) times: one JSON line appended to the
#     newest session file, then `hermesfs snapshot`: request bytes and
#     requests through the proxy, bytes the store grew by, the daemon's
#     pack= and bytes_uploaded, the command's wall time (whole snapshot);
#   - the busy agent, CHURN_ROUNDS (3) rounds of `genhome churn` (10
#     sessions appended to, 200 rows into state.db, MEMORY.md rewritten, 2
#     skills, 1 file deleted), a snapshot after each: the same figures;
#   - SIGTERM after a one-line change, STOP_TRIALS (3) times: the time until
#     the daemon exits 0 (its final snapshot in the store: LATEST is
#     checked), then a remount from the cache (the same state dir, the
#     store unchanged): start to ready, and the daemon's RSS at ready;
#   - a new host, NEW_TRIALS (2) times: an empty state dir and mountpoint,
#     start to ready through the link, RSS at ready, then a walk (find
#     -printf of every entry's size: a stat each) and RSS (and peak RSS)
#     after it;
#   - restic (the installed one, repository version 2) on a plain copy of
#     the same home: init and a first backup through the link, then the
#     same one-line changes and churn rounds, a `restic backup .` after
#     each: bytes, requests, stored growth, backup wall time.
# Then per entry count the must-hold comparison: the installed home's
# one-line snapshot upload (limit 256 KiB), and its snapshot, SIGTERM stop
# and new-host ready over the plain home's (limit 2x each).
#
# Part "writeback": the write-back cost table of scripts/bench-rpo.sh (its
# part "cost": a busy agent's requests, bytes uploaded and daemon CPU per
# hour) on the installed home, for each D in WB_DS (default "2s 10s"),
# WB_ROUNDS (3) rounds of WB_ROUND_SECONDS (60) each.
#
# Env: FILES_SIZE (300M), FILES_ENTRIES (120k), FILES_1M (0), TRIALS,
# CHURN_ROUNDS, STOP_TRIALS, NEW_TRIALS, WB_DS, WB_ROUNDS, WB_ROUND_SECONDS,
# PARTS ("change writeback"), LINK_RATE (50MB), LINK_LATENCY (20ms),
# BENCH_DIR (scratch, default /var/tmp/hermesfs-bench; logs kept in
# $BENCH_DIR/files-logs), HERMESFS_BIN (default bin/hermesfs). The
# installed homes are generated once and cached (about 40 s and 1.4 GB at
# 120k, several minutes and about 4 GB at 1M).
set -eu
cd "$(dirname "$0")/.."
. scripts/bench-s3link.sh
root=$(pwd)
BENCH_DIR=${BENCH_DIR:-/var/tmp/hermesfs-bench}
FILES_SIZE=${FILES_SIZE:-300M}
FILES_ENTRIES=${FILES_ENTRIES:-120k}
[ "${FILES_1M:-0}" = 1 ] && FILES_ENTRIES="$FILES_ENTRIES 1M"
TRIALS=${TRIALS:-3}
CHURN_ROUNDS=${CHURN_ROUNDS:-3}
STOP_TRIALS=${STOP_TRIALS:-3}
NEW_TRIALS=${NEW_TRIALS:-2}
WB_DS=${WB_DS:-2s 10s}
WB_ROUNDS=${WB_ROUNDS:-3}
WB_ROUND_SECONDS=${WB_ROUND_SECONDS:-60}
PARTS=${PARTS:-change writeback}
LINK_RATE=${LINK_RATE:-50MB}
LINK_LATENCY=${LINK_LATENCY:-20ms}
bin=${HERMESFS_BIN:-$root/bin/hermesfs}
[ -x "$bin" ] || { echo "bench-files: $bin missing (make build)" >&2; exit 1; }
gobin=$(go env GOPATH)/bin
vgw=$(command -v versitygw || echo "$gobin/versitygw")
[ -x "$vgw" ] || { echo "bench-files: versitygw missing (scripts/deps.sh test)" >&2; exit 1; }
for c in sqlite3 curl python3 restic git node; do
	command -v $c >/dev/null || { echo "bench-files: $c missing (restic: apt-get install restic)" >&2; exit 1; }
done

mkdir -p "$BENCH_DIR"
work=$BENCH_DIR/files
logs=$work-logs
if [ -e "$work.pid" ] && kill -0 "$(cat "$work.pid")" 2>/dev/null; then
	echo "bench-files: $work is in use by process $(cat "$work.pid")" >&2
	exit 1
fi
echo $$ >"$work.pid"
pids=""
hpid=""
cleanup() {
	for p in $hpid $pids; do kill "$p" 2>/dev/null || true; done
	for m in "$work"/*/mnt "$work"/*/new-*; do
		mountpoint -q "$m" 2>/dev/null && umount -l "$m"
	done
	for p in $hpid $pids; do wait "$p" 2>/dev/null || true; done
	mkdir -p "$logs"
	for f in "$work"/*.log "$work"/*/*.log "$work"/*/*.txt; do
		[ -e "$f" ] || continue
		d=$(basename "$(dirname "$f")")
		[ "$d" = files ] && d= || d=$d-
		cp "$f" "$logs/$d$(basename "$f")" || true
	done
	rm -rf "$work" "$work.pid"
}
trap cleanup EXIT INT TERM
rm -rf "$work" "$logs"
mkdir -p "$work/s3" "$logs"

now() { date +%s.%N; }
since() { python3 -c "import sys; print('%.3f' % ($(now) - $1))"; }
med() { sort -g | awk '{a[NR] = $1} END {if (NR == 0) print "-"; else if (NR % 2) print a[(NR + 1) / 2]; else print (a[NR / 2] + a[NR / 2 + 1]) / 2}'; }
load1() { cut -d' ' -f1 /proc/loadavg; }
ratio() { python3 -c "print('%.2f' % ($1 / $2) if $2 else '-')"; }
kib() { python3 -c "print('%.1f' % ($1 / 1024))"; }
rss() { awk '/^VmRSS/ {printf "%.0f", $2/1024}' "/proc/$1/status"; }
hwm() { awk '/^VmHWM/ {printf "%.0f", $2/1024}' "/proc/$1/status"; }
# verdict VALUE LIMIT: ok or MISS.
verdict() { python3 -c "print('ok' if float('$1') <= $2 else 'MISS')"; }

go build -o "$work/genhome" ./scripts/genhome

# versitygw on a free loopback port, one bucket; the shaped link in front.
s3link_start bench-files
# published LOG: "pack_s bytes_uploaded segment_bytes id" of every
# "snapshot published" line of a daemon log.
published() {
	python3 - "$1" <<'EOF'
import re, sys
def dur(v):
    t = 0.0
    for n, u in re.findall(r"([0-9.]+)(ns|µs|us|ms|s|m|h)", v):
        t += float(n) * {"ns": 1e-9, "µs": 1e-6, "us": 1e-6, "ms": 1e-3, "s": 1, "m": 60, "h": 3600}[u]
    return t
for line in open(sys.argv[1], encoding="utf-8"):
    if 'msg="snapshot published"' in line:
        f = dict(re.findall(r'(\w+)=("[^"]*"|\S+)', line))
        g = lambda k: f.get(k, "0").strip('"')
        print("%.3f" % dur(g("pack")), g("bytes_uploaded"), g("segment_bytes"), g("id"))
EOF
}
export HERMESFS_LOG_LEVEL=info RESTIC_PASSWORD=bench-password
store_url() { echo "s3://bench/$1?endpoint=$pep&region=us-east-1&path_style=true"; }

echo "machine: $(uname -srm), $(nproc) cores, $(awk '/MemTotal/ {printf "%.0f GiB", $2/1048576}' /proc/meminfo); load average before: $(cut -d" " -f1-3 /proc/loadavg)"
echo "link: $LINK_RATE/s each way, $LINK_LATENCY per request (shapedproxy in front of versitygw posix); $(restic version | cut -d' ' -f1-2)"

# mount_host NAME STATE MNT [FLAGS]: hermesfs on MNT with state dir STATE
# through the link, waits for its ready line; sets hpid and took (seconds
# from start to ready).
mount_host() {
	name=$1 st=$2 mp=$3
	shift 3
	: >"$work/$name/mount.out"
	t0=$(now)
	HERMESFS_STORE=$(store_url "$name") "$bin" mount --state-dir "$st" --interval 0 --write-back 0 "$@" "$mp" >>"$work/$name/mount.out" 2>>"$work/$name/daemon.log" &
	hpid=$!
	until grep -q '^ready ' "$work/$name/mount.out"; do
		kill -0 "$hpid" 2>/dev/null || { echo "bench-files: hermesfs ($name) exited:" >&2; tail -20 "$work/$name/daemon.log" >&2; exit 1; }
		sleep 0.02
	done
	took=$(since "$t0")
}
stop_host() {
	kill -TERM "$hpid"
	wait "$hpid" || { echo "bench-files: hermesfs exited $? on SIGTERM" >&2; tail -20 "$work/$1/daemon.log" >&2; exit 1; }
	hpid=""
}
# one_line DIR TAG: the one-line change, the same in every tree: a JSON line
# appended to the newest session file.
one_line() {
	printf '{"role": "user", "content": "one more line (%s)", "timestamp": "2026-03-01T00:00:00Z"}\n' "$2" >>"$1/sessions/$session"
}

# hermesfs_part NAME HOME: every hermesfs measurement on one home; writes
# $work/NAME/*.txt.
hermesfs_part() {
	name=$1 home=$2
	d=$work/$name
	mkdir -p "$d/mnt"
	cp -a "$home/." "$d/mnt/"
	reset_counts
	mount_host "$name" "$d/state" "$d/mnt"
	set -- $(counts)
	echo "seeding: ready in ${took}s, $1 bytes up in $2 requests, load $(load1)" >"$d/seed.txt"
	# One-line changes, then churn rounds: one snapshot after each.
	: >"$d/snap.txt"
	k=1
	while [ $k -le $((TRIALS + CHURN_ROUNDS)) ]; do
		if [ $k -le "$TRIALS" ]; then
			kind=line
			one_line "$d/mnt" "trial $k"
		else
			kind=churn
			"$work/genhome" churn -dir "$d/mnt" -round $((k - TRIALS - 1))
		fi
		s0=$(stored "$name" | cut -d" " -f1)
		n0=$(published "$d/daemon.log" | wc -l)
		reset_counts
		t0=$(now)
		"$bin" snapshot --state-dir "$d/state" "$d/mnt" >/dev/null
		took=$(since "$t0")
		set -- $(counts)
		up=$1 req=$2
		s1=$(stored "$name" | cut -d" " -f1)
		pub=$(published "$d/daemon.log" | tail -n +"$((n0 + 1))" | tail -1)
		[ -n "$pub" ] || { echo "bench-files: no snapshot published for $name $kind $k" >&2; exit 1; }
		# kind up requests stored_delta snapshot_s pack_s bytes_uploaded segment_bytes load
		echo "$kind $up $req $((s1 - s0)) $took $(echo "$pub" | cut -d' ' -f1-3) $(load1)" >>"$d/snap.txt"
		k=$((k + 1))
	done
	# SIGTERM after a one-line change, then a remount from the cache.
	: >"$d/stop.txt"
	k=1
	while [ $k -le "$STOP_TRIALS" ]; do
		one_line "$d/mnt" "stop $k"
		n0=$(published "$d/daemon.log" | wc -l)
		t0=$(now)
		kill -TERM "$hpid"
		wait "$hpid" && code=0 || code=$?
		stop=$(since "$t0")
		hpid=""
		[ "$code" = 0 ] || { echo "bench-files: hermesfs exited $code on SIGTERM" >&2; tail -20 "$d/daemon.log" >&2; exit 1; }
		pub=$(published "$d/daemon.log" | tail -n +"$((n0 + 1))" | tail -1)
		[ -n "$pub" ] || { echo "bench-files: no final snapshot on SIGTERM ($name)" >&2; exit 1; }
		latest=$(tr -d '[:space:]' <"$work/s3/bench/$name/LATEST")
		[ "$latest" = "${pub##* }" ] || { echo "bench-files: LATEST is $latest, the final snapshot ${pub##* }" >&2; exit 1; }
		l=$(load1)
		mount_host "$name" "$d/state" "$d/mnt"
		# stop_s pack_s bytes_uploaded remount_s rss_mib load
		echo "$stop $(echo "$pub" | cut -d' ' -f1-2) $took $(rss "$hpid") $l" >>"$d/stop.txt"
		k=$((k + 1))
	done
	stop_host "$name"
	# New hosts.
	: >"$d/new.txt"
	k=1
	while [ $k -le "$NEW_TRIALS" ]; do
		mkdir -p "$d/new-$k"
		mount_host "$name" "$d/newstate-$k" "$d/new-$k"
		ready=$took
		r0=$(rss "$hpid")
		t0=$(now)
		walked=$(find "$d/new-$k/" -printf '%s\n' | wc -l)
		walk=$(since "$t0")
		# ready_s rss_ready walk_s entries rss_after_walk peak_rss load
		echo "$ready $r0 $walk $walked $(rss "$hpid") $(hwm "$hpid") $(load1)" >>"$d/new.txt"
		stop_host "$name"
		rm -rf "$d/newstate-$k"
		k=$((k + 1))
	done
	rm -rf "$d/mnt" "$d/state"
}

# restic_part NAME HOME: restic on a plain copy, the same changes; writes
# $work/NAME/restic.txt.
restic_part() {
	name=$1 home=$2
	d=$work/$name
	mkdir -p "$d/copy"
	cp -a "$home/." "$d/copy/"
	export RESTIC_REPOSITORY="s3:$pep/bench/restic-$name"
	restic init --repository-version 2 >"$d/restic.log" 2>&1
	reset_counts
	t0=$(now)
	(cd "$d/copy" && restic backup --host bench --quiet .) >>"$d/restic.log" 2>&1
	took=$(since "$t0")
	set -- $(counts)
	echo "seeding: backup in ${took}s, $1 bytes up in $2 requests, load $(load1)" >"$d/restic-seed.txt"
	: >"$d/restic.txt"
	k=1
	while [ $k -le $((TRIALS + CHURN_ROUNDS)) ]; do
		if [ $k -le "$TRIALS" ]; then
			kind=line
			one_line "$d/copy" "trial $k"
		else
			kind=churn
			"$work/genhome" churn -dir "$d/copy" -round $((k - TRIALS - 1))
		fi
		s0=$(stored "restic-$name" | cut -d" " -f1)
		reset_counts
		t0=$(now)
		(cd "$d/copy" && restic backup --host bench --quiet .) >>"$d/restic.log" 2>&1
		took=$(since "$t0")
		set -- $(counts)
		s1=$(stored "restic-$name" | cut -d" " -f1)
		# kind up requests stored_delta backup_s load
		echo "$kind $1 $2 $((s1 - s0)) $took $(load1)" >>"$d/restic.txt"
		k=$((k + 1))
	done
	unset RESTIC_REPOSITORY
	rm -rf "$d/copy"
}

# col FILE KIND N: column N of FILE's lines of KIND.
col() { awk -v k="$2" -v n="$3" '$1 == k {print $n}' "$1"; }

case " $PARTS " in *" change "*)
	summary="home entries snap_KiB_up snap_requests snap_stored_KiB pack_s snapshot_s restic_KiB_up restic_stored_KiB restic_backup_s up_vs_restic churn_MB_up churn_snapshot_s restic_churn_MB_up stop_s remount_s rss_ready_MiB newhost_s newhost_rss_MiB walk_s rss_walk_MiB"
	musthold=""
	for entries in $FILES_ENTRIES; do
		inst=$(scripts/genhome/cached.sh "$FILES_SIZE" 1 "$entries")
		plain=$(scripts/genhome/cached.sh "$FILES_SIZE" 1)
		session=$(cd "$plain/sessions" && ls | grep '^session_.*\.json$' | sort | tail -1)
		for variant in installed plain; do
			home=$plain
			[ $variant = installed ] && home=$inst
			name=$variant-$entries
			mkdir -p "$work/$name"
			n=$(find "$home/" | wc -l)
			echo "== $name: $FILES_SIZE home$([ $variant = installed ] && echo " + installed agent ($entries asked)"): $n entries, $(du -sh --apparent-size "$home/" | cut -f1)"
			hermesfs_part "$name" "$home"
			restic_part "$name" "$home"
			d=$work/$name
			echo "hermesfs $(cat "$d/seed.txt")"
			echo "restic $(cat "$d/restic-seed.txt")"
			echo "hermesfs snapshots (kind, bytes up, requests, stored growth, snapshot command s, pack s, bytes_uploaded, segment_bytes, load):"
			sed 's/^/  /' "$d/snap.txt"
			echo "restic backups (kind, bytes up, requests, stored growth, backup s, load):"
			sed 's/^/  /' "$d/restic.txt"
			echo "SIGTERM after a one-line change, then a remount from the cache (stop s, final pack s, its bytes_uploaded, remount ready s, RSS MiB at ready, load):"
			sed 's/^/  /' "$d/stop.txt"
			echo "new hosts (ready s, RSS MiB at ready, walk s, entries walked, RSS MiB after, peak RSS MiB, load):"
			sed 's/^/  /' "$d/new.txt"
			up=$(col "$d/snap.txt" line 2 | med)
			rup=$(col "$d/restic.txt" line 2 | med)
			snap=$(col "$d/snap.txt" line 5 | med)
			stop=$(cut -d' ' -f1 "$d/stop.txt" | med)
			newh=$(cut -d' ' -f1 "$d/new.txt" | med)
			summary="$summary
$variant $n $(kib "$up") $(col "$d/snap.txt" line 3 | med) $(kib "$(col "$d/snap.txt" line 4 | med)") $(col "$d/snap.txt" line 6 | med) $snap $(kib "$rup") $(kib "$(col "$d/restic.txt" line 4 | med)") $(col "$d/restic.txt" line 5 | med) $(ratio "$up" "$rup") $(python3 -c "print('%.2f' % ($(col "$d/snap.txt" churn 2 | med) / 1e6))") $(col "$d/snap.txt" churn 5 | med) $(python3 -c "print('%.2f' % ($(col "$d/restic.txt" churn 2 | med) / 1e6))") $stop $(cut -d' ' -f4 "$d/stop.txt" | med) $(cut -d' ' -f5 "$d/stop.txt" | med) $newh $(cut -d' ' -f2 "$d/new.txt" | med) $(cut -d' ' -f3 "$d/new.txt" | med) $(cut -d' ' -f5 "$d/new.txt" | med)"
			eval "up_$variant=$up snap_$variant=$snap stop_$variant=$stop new_$variant=$newh"
		done
		musthold="$musthold
$entries one-line_upload_KiB $(kib "$up_installed") 256 $(verdict "$(kib "$up_installed")" 256)
$entries snapshot_s_installed/plain $(ratio "$snap_installed" "$snap_plain") 2 $(verdict "$(ratio "$snap_installed" "$snap_plain")" 2)
$entries sigterm_stop_installed/plain $(ratio "$stop_installed" "$stop_plain") 2 $(verdict "$(ratio "$stop_installed" "$stop_plain")" 2)
$entries newhost_ready_installed/plain $(ratio "$new_installed" "$new_plain") 2 $(verdict "$(ratio "$new_installed" "$new_plain")" 2)"
	done
	echo "== summary: file count (medians; KiB = 1024 bytes; snapshot_s: the 'hermesfs snapshot' command; churn: genhome churn rounds)"
	echo "$summary" | column -t
	echo "== must hold (installed home against the same home without the installed agent, one run)"
	echo "entries measure value limit verdict$musthold" | column -t
	echo "load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
	;;
esac

case " $PARTS " in *" writeback "*)
	for entries in $FILES_ENTRIES; do
		echo "== write-back cost on the installed home ($FILES_SIZE + $entries): scripts/bench-rpo.sh, part cost"
		BENCH_SIZE=$FILES_SIZE BENCH_ENTRIES=$entries PARTS=cost COST_DS="$WB_DS" ROUNDS=$WB_ROUNDS ROUND_SECONDS=$WB_ROUND_SECONDS \
			LINK_RATE=$LINK_RATE LINK_LATENCY=$LINK_LATENCY HERMESFS_BIN=$bin sh scripts/bench-rpo.sh
	done
	;;
esac
