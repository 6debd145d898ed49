#!/bin/sh
# What a snapshot costs: bytes uploaded and stored, pack time, and how long a
# stop takes to make its final snapshot durable, against restic and a cron
# script, on the same churn. versitygw (posix backend) on 127.0.0.1 behind
# the shaped fault proxy (uploader/faultproxy/cmd/shapedproxy: LINK_RATE
# each way, shared by all connections, LINK_LATENCY added to every
# request), which counts the bytes and requests of every contender.
#
# The churn, the same for every contender: `genhome churn` (scripts/genhome,
# churn.go), one round of a busy agent = 10 session files appended to, 200
# rows into state.db, MEMORY.md rewritten, 2 skills added, 1 file deleted.
#
# Part "churn", for each size in COST_SIZES (default "500M 1G"): ROUNDS (12)
# rounds, one snapshot after each, on four copies of the generated home
# (scripts/genhome/cached.sh SIZE 1):
#   - hermesfs, plaintext: `hermesfs mount --interval 0 --keep-last 1000`
#     over the copy (the mount's first snapshot seeds the store), then per
#     round the churn in the mount and `hermesfs snapshot`;
#   - hermesfs, encrypted: the same with --encrypt-to (a key from
#     `hermesfs keygen`) and --identity;
#   - restic (the installed one; repository version 2, compression auto):
#     `restic init` on the same versitygw through the same proxy, then per
#     round `restic backup .` of a plain copy of the home with the churn
#     applied;
#   - a cron script: `mksquashfs -comp zstd -Xcompression-level 3` of that
#     plain copy and one PUT of the whole archive (curl), every archive kept.
# Reported: per round, the request body bytes uploaded and the requests
# (the proxy's counters, zeroed before each snapshot; for hermesfs they
# include the prune after each snapshot and any lease renewal meanwhile);
# the bytes stored after the rounds (the sum of the object files under the
# contender's prefix in versitygw's directory, every snapshot kept); the
# daemon's "snapshot published" figures (pack, upload, freeze_stall,
# bytes_uploaded, segment_bytes, rewritten_bytes, extents, segments); the
# wall time of `restic backup` and of mksquashfs; ratios to restic.
#
# Part "retention", for each size in RET_SIZES (default $BENCH_SIZE or 1G):
# uploader/internal/retentioncost simulates RET_DAYS (30) days with a
# snapshot every RET_EVERY (1h), RET_ROUNDS (1) churn rounds before each,
# packed and published with the real code under a fake clock and pruned
# with the default policy after each; restic backs up the same tree after
# each round (restic backup --time) and forgets with the same policy and
# prunes (forget --keep-last 10 --keep-hourly 24 --keep-daily 14
# --keep-weekly 8 --prune) every RET_RESTIC_PRUNE_EVERY (1) snapshots. Both
# on local directories (bytes: the sum of their files). RET_ENCRYPT=1 runs
# hermesfs encrypted there too. After each run: what the store keeps that
# no kept snapshot uses (segment_use).
#
# Part "stop", for each size in STOP_SIZES (default $SIZES or "1G 8G"),
# plaintext and encrypted: a mount (--interval 0) seeds the store through
# the link from a copy of the home; then, STOP_TRIALS (3) times (the
# mount restarted on its state dir between trials), 200 rows inserted into
# state.db (each its own commit), SIGTERM, and the time until the process
# exits 0, which it does once the final snapshot is in the store and LATEST
# names it (checked here against the store); with the daemon log's phases:
# "stopping" to the final "snapshot published" (durable), and from there to
# "stopped" (unmount, rebase, lease release). Each figure carries the load
# average; the summaries mark the issue's goals (ok, limit, MISS).
#
# Env: COST_SIZES, RET_SIZES, STOP_SIZES, ROUNDS, RET_DAYS, RET_EVERY,
# RET_ROUNDS, RET_RESTIC_PRUNE_EVERY, RET_ENCRYPT, STOP_TRIALS, LINK_RATE
# (50MB, bytes/s, 10^6), LINK_LATENCY (20ms), PARTS ("churn retention
# stop"), BENCH_DIR (scratch, default /var/tmp/hermesfs-bench; logs are
# kept in $BENCH_DIR/cost-logs), COST_TAG (runs with different tags use
# their own $BENCH_DIR/cost-TAG and cost-TAG-logs, so two runs can share a
# BENCH_DIR and its cached homes; a run refuses a directory another live
# run holds), HERMESFS_BIN (default bin/hermesfs).
set -eu
cd "$(dirname "$0")/.."
. scripts/bench-s3link.sh
root=$(pwd)
BENCH_DIR=${BENCH_DIR:-/var/tmp/hermesfs-bench}
COST_SIZES=${COST_SIZES:-500M 1G}
RET_SIZES=${RET_SIZES:-${BENCH_SIZE:-1G}}
STOP_SIZES=${STOP_SIZES:-${SIZES:-1G 8G}}
ROUNDS=${ROUNDS:-12}
RET_DAYS=${RET_DAYS:-30}
RET_EVERY=${RET_EVERY:-1h}
RET_ROUNDS=${RET_ROUNDS:-1}
RET_RESTIC_PRUNE_EVERY=${RET_RESTIC_PRUNE_EVERY:-1}
RET_ENCRYPT=${RET_ENCRYPT:-0}
STOP_TRIALS=${STOP_TRIALS:-3}
LINK_RATE=${LINK_RATE:-50MB}
LINK_LATENCY=${LINK_LATENCY:-20ms}
PARTS=${PARTS:-churn retention stop}
bin=${HERMESFS_BIN:-$root/bin/hermesfs}
[ -x "$bin" ] || { echo "bench-cost: $bin missing (make build)" >&2; exit 1; }
gobin=$(go env GOPATH)/bin
vgw=$(command -v versitygw || echo "$gobin/versitygw")
[ -x "$vgw" ] || { echo "bench-cost: versitygw missing (scripts/deps.sh test)" >&2; exit 1; }
for c in sqlite3 curl python3 restic mksquashfs; do
	command -v $c >/dev/null || { echo "bench-cost: $c missing" >&2; exit 1; }
done

mkdir -p "$BENCH_DIR"
work=$BENCH_DIR/cost${COST_TAG:+-$COST_TAG}
logs=$work-logs
# One run a directory: the cleanup below removes $work whole.
if [ -e "$work.pid" ] && kill -0 "$(cat "$work.pid")" 2>/dev/null; then
	echo "bench-cost: $work is in use by process $(cat "$work.pid"); set COST_TAG to run beside it" >&2
	exit 1
fi
echo $$ >"$work.pid"
pids=""
hpid=""
cleanup() {
	for p in $hpid $pids; do kill "$p" 2>/dev/null || true; done
	for m in "$work"/*/mnt; do
		mountpoint -q "$m" 2>/dev/null && umount -l "$m"
	done
	for p in $hpid $pids; do wait "$p" 2>/dev/null || true; done
	mkdir -p "$logs"
	for f in "$work"/*.log "$work"/*/*.log "$work"/*/*.out "$work"/*/*.txt; do
		[ -e "$f" ] || continue
		case $f in "$work"/key/*) continue ;; esac
		d=$(basename "$(dirname "$f")")
		[ "$d" = cost ] && d= || d=$d-
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
maxof() { sort -g | tail -1; }
load1() { cut -d' ' -f1 /proc/loadavg; }
mb() { python3 -c "print('%.2f' % ($1 / 1e6))"; }
ratio() { python3 -c "print('%.2f' % ($1 / $2) if $2 else '-')"; }
# goal VALUE GOAL [LIMIT]: "ok" if VALUE <= GOAL, "limit" if <= LIMIT,
# else "MISS" (the issue's goals: ratios to restic 1.2, at most 2; pack
# 0.3 s at 1 GiB; stop 1 s at 1 GiB, 2 s at 8 GiB).
goal() { python3 -c "v, g, l = '$1', $2, ${3:-$2}
print('-' if v in ('', '-') else 'ok' if float(v) <= g else 'limit' if float(v) <= l else 'MISS')"; }

go build -o "$work/genhome" ./scripts/genhome
go build -o "$work/retentioncost" ./uploader/internal/retentioncost

# versitygw on a free loopback port, one bucket; the shaped link in front.
s3link_start bench-cost
# published LOG: one line per "snapshot published" log line of a daemon:
# reason pack_s upload_s freeze_stall_ms bytes_uploaded segment_bytes
# rewritten_bytes extents segments size id.
published() {
	python3 - "$1" <<'EOF'
import re, sys
def dur(v):
    t = 0.0
    for n, u in re.findall(r"([0-9.]+)(ns|µs|us|ms|s|m|h)", v):
        t += float(n) * {"ns": 1e-9, "µs": 1e-6, "us": 1e-6, "ms": 1e-3, "s": 1, "m": 60, "h": 3600}[u]
    return t
for line in open(sys.argv[1], encoding="utf-8"):
    if 'msg="snapshot published"' not in line:
        continue
    f = dict(re.findall(r'(\w+)=("[^"]*"|\S+)', line))
    g = lambda k: f.get(k, "0").strip('"')
    print(g("reason"), "%.3f" % dur(g("pack")), "%.3f" % dur(g("upload")), "%.3f" % (dur(g("freeze_stall")) * 1000),
          g("bytes_uploaded"), g("segment_bytes"), g("rewritten_bytes"), g("extents"), g("segments"), g("size"), g("id"))
EOF
}
# stop_phases LOG: of the last stop in a daemon log, the seconds from its
# "stopping" line to its final "snapshot published" line (the snapshot
# durable, LATEST moved) and from there to "stopped" (the rebase on the
# final snapshot and the lease release).
stop_phases() {
	python3 - "$1" <<'EOF'
import re, sys
from datetime import datetime
def ts(l):
    return datetime.strptime(re.search(r"time=(\S+?)Z? ", l).group(1)[:26], "%Y-%m-%dT%H:%M:%S.%f")
t = {}
for l in open(sys.argv[1], encoding="utf-8"):
    if "msg=stopping" in l:
        t = {"stop": ts(l)}
    elif 'msg="snapshot published"' in l and "reason=final" in l and "stop" in t:
        t["pub"] = ts(l)
    elif "msg=stopped" in l and "pub" in t:
        t["end"] = ts(l)
if "end" in t:
    print("%.3f %.3f" % ((t["pub"] - t["stop"]).total_seconds(), (t["end"] - t["pub"]).total_seconds()))
else:
    print("- -")
EOF
}
# segment_use STORE: of a local store (format 4), the segments' bytes, how
# many of them the kept snapshots' extents use, and the metadata objects'
# bytes: what a store keeps that no kept snapshot reads (segments are
# collected whole; one is rewritten only when a new image uses < 1/4 of
# it). Encrypted segments are counted as stored, their use in plaintext.
segment_use() {
	python3 - "$1" <<'EOF'
import collections, glob, os, sys
st = sys.argv[1]
used = collections.defaultdict(list)
for e in glob.glob(os.path.join(st, "snapshots", "*.extents")):
    for line in open(e):
        k, off, n = line.split()
        used[k].append((int(off), int(off) + int(n)))
tot = live = 0
shares = []
for p in glob.glob(os.path.join(st, "segments", "*.seg")) + glob.glob(os.path.join(st, "segments", "*.seg.age")):
    size, u, end = os.path.getsize(p), 0, -1
    for a, b in sorted(used.get(os.path.relpath(p, st), [])):
        a = max(a, end)
        if b > a:
            u, end = u + b - a, b
    tot, live = tot + size, live + min(u, size)
    shares.append(min(u, size) / size if size else 1)
meta = sum(os.path.getsize(p) for p in glob.glob(os.path.join(st, "snapshots", "*")) + glob.glob(os.path.join(st, "segments", "*.sums")))
bands = [sum(lo <= f < hi for f in shares) for lo, hi in ((0, .25), (.25, .5), (.5, .75), (.75, 2))]
print("store: %d segments, %d bytes, of which the kept snapshots use %d and none uses %d (%.0f%%); segments by share used <1/4 %d, 1/4-1/2 %d, 1/2-3/4 %d, >=3/4 %d; manifests, extents and sums %d bytes" % (
    len(shares), tot, live, tot - live, 100.0 * (tot - live) / max(tot, 1), *bands, meta))
EOF
}
export HERMESFS_LOG_LEVEL=info RESTIC_PASSWORD=bench-password

mkdir -p "$work/key"
chmod 700 "$work/key"
recipient=$("$bin" keygen "$work/key/key.txt" 2>/dev/null)

echo "machine: $(uname -srm), $(nproc) cores; load average before: $(cut -d" " -f1-3 /proc/loadavg)"
echo "link: $LINK_RATE/s each way, $LINK_LATENCY per request (shapedproxy in front of versitygw posix); $(restic version | cut -d' ' -f1-2); $(mksquashfs -version 2>&1 | head -1)"

# mount NAME DIR [FLAGS]: starts hermesfs on DIR with state dir
# $work/NAME/state through the link, waits for its ready line; sets hpid.
mount_host() {
	name=$1 dir=$2
	shift 2
	: >"$work/$name/mount.out"
	"$bin" mount --state-dir "$work/$name/state" "$@" "$dir" >>"$work/$name/mount.out" 2>>"$work/$name/daemon.log" &
	hpid=$!
	until grep -q '^ready ' "$work/$name/mount.out"; do
		kill -0 "$hpid" 2>/dev/null || { echo "bench-cost: hermesfs ($name) exited:" >&2; tail -20 "$work/$name/daemon.log" >&2; exit 1; }
		sleep 0.05
	done
}
stop_host() {
	kill -TERM "$hpid"
	wait "$hpid" || { echo "bench-cost: hermesfs exited $? on SIGTERM" >&2; tail -20 "$work/$1/daemon.log" >&2; exit 1; }
	hpid=""
}
store_url() { echo "s3://bench/$1?endpoint=$pep&region=us-east-1&path_style=true"; }

# hermesfs_rounds SIZE MODE: the churn rounds on a mount (MODE plain or
# enc); writes $work/NAME/rounds.txt (round bytes_up requests) and the
# daemon log.
hermesfs_rounds() {
	name=cost-$1-$2 mode=$2
	mkdir -p "$work/$name/mnt"
	cp -a "$home/." "$work/$name/mnt/"
	export HERMESFS_STORE="$(store_url "$name")"
	set -- --interval 0 --keep-last 1000
	[ "$mode" = enc ] && set -- "$@" --encrypt-to "$recipient" --identity "$work/key/key.txt"
	reset_counts
	t0=$(now)
	mount_host "$name" "$work/$name/mnt" "$@"
	echo "0 $(counts) $(since "$t0") $(load1)" >"$work/$name/rounds.txt"
	r=1
	while [ $r -le "$ROUNDS" ]; do
		"$work/genhome" churn -dir "$work/$name/mnt" -round $((r - 1))
		reset_counts
		t0=$(now)
		"$bin" snapshot --state-dir "$work/$name/state" "$work/$name/mnt" >/dev/null
		echo "$r $(counts) $(since "$t0") $(load1)" >>"$work/$name/rounds.txt"
		r=$((r + 1))
	done
	stop_host "$name"
	unset HERMESFS_STORE
}

# baseline_rounds SIZE: restic and the cron script on one plain copy;
# writes $work/NAME/restic.txt and cron.txt (round bytes_up requests
# seconds).
baseline_rounds() {
	name=cost-$1-copy
	mkdir -p "$work/$name/home"
	cp -a "$home/." "$work/$name/home/"
	export RESTIC_REPOSITORY="s3:$pep/bench/restic-$1"
	restic init --repository-version 2 >"$work/$name/restic.log" 2>&1
	: >"$work/$name/restic.txt"
	: >"$work/$name/cron.txt"
	r=0
	while [ $r -le "$ROUNDS" ]; do
		[ $r -gt 0 ] && "$work/genhome" churn -dir "$work/$name/home" -round $((r - 1))
		reset_counts
		t0=$(now)
		(cd "$work/$name/home" && restic backup --host bench --quiet .) >>"$work/$name/restic.log" 2>&1
		echo "$r $(counts) $(since "$t0") $(load1)" >>"$work/$name/restic.txt"
		t0=$(now)
		mksquashfs "$work/$name/home" "$work/$name/home.sqfs" -comp zstd -Xcompression-level 3 -processors 2 -noappend -quiet >/dev/null
		pack=$(since "$t0")
		reset_counts
		s3curl -X PUT -T "$work/$name/home.sqfs" "$pep/bench/cron-$1/home-$r.sqfs" >/dev/null
		echo "$r $(counts) $pack $(load1)" >>"$work/$name/cron.txt"
		rm -f "$work/$name/home.sqfs"
		r=$((r + 1))
	done
	unset RESTIC_REPOSITORY
	rm -rf "$work/$name/home"
}

# col FILE N: column N of rounds 1.. of a rounds file.
col() { awk -v n="$2" '$1 > 0 {print $n}' "$1"; }

case " $PARTS " in *" churn "*)
	summary="size contender MB_up/round(median) requests/round stored_MB_after_${ROUNDS} up_vs_restic stored_vs_restic pack_s(median) pack_s(max) goals(up,stored,pack)"
	for size in $COST_SIZES; do
		home=$(scripts/genhome/cached.sh "$size" 1)
		echo "== churn, $size home ($(find "$home/" -type f | wc -l) files, $(du -sh --apparent-size "$home/" | cut -f1)), $ROUNDS rounds"
		for mode in plain enc; do
			hermesfs_rounds "$size" "$mode"
		done
		baseline_rounds "$size"
		rup=$(col "$work/cost-$size-copy/restic.txt" 2 | med)
		set -- $(stored "restic-$size")
		rstored=$1
		for c in plain enc restic cron; do
			case $c in
			plain | enc)
				f=$work/cost-$size-$c/rounds.txt
				published "$work/cost-$size-$c/daemon.log" | grep '^requested ' >"$work/cost-$size-$c/published.txt" || true
				echo "hermesfs $c, $size: per round (round, bytes up, requests, snapshot command s, load | reason pack_s upload_s freeze_stall_ms bytes_uploaded segment_bytes rewritten_bytes extents segments image_size id):"
				awk '$1 > 0' "$f" | paste -d'|' - "$work/cost-$size-$c/published.txt" | sed 's/^/  /'
				seed=$(awk '$1 == 0 {print $2}' "$f")
				echo "  seeding (pack + upload of the whole home, in the mount's start): $(mb "$seed") MB up"
				pk=$(awk '$1 == "requested" {print $2}' "$work/cost-$size-$c/published.txt")
				pmed=$(echo "$pk" | med)
				pmax=$(echo "$pk" | maxof)
				set -- $(stored "cost-$size-$c")
				st=$1
				label="hermesfs-$c"
				;;
			restic)
				f=$work/cost-$size-copy/restic.txt
				echo "restic, $size: per round (round, bytes up, requests, backup s, load):"
				sed 's/^/  /' "$f"
				st=$rstored
				pmed=$(col "$f" 4 | med)
				pmax=$(col "$f" 4 | maxof)
				label=restic
				;;
			cron)
				f=$work/cost-$size-copy/cron.txt
				echo "cron (mksquashfs + PUT), $size: per round (round, bytes up, requests, mksquashfs s, load):"
				sed 's/^/  /' "$f"
				set -- $(stored "cron-$size")
				st=$1
				pmed=$(col "$f" 4 | med)
				pmax=$(col "$f" 4 | maxof)
				label=cron
				;;
			esac
			up=$(col "$f" 2 | med)
			req=$(col "$f" 3 | med)
			verdict=-
			case $c in plain | enc)
				pg=-
				[ "$size" = 1G ] && pg=$(goal "$pmed" 0.3)
				verdict=$(goal "$(ratio "$up" "$rup")" 1.2 2),$(goal "$(ratio "$st" "$rstored")" 1.2 2),$pg
				;;
			esac
			summary="$summary
$size $label $(mb "$up") $req $(mb "$st") $(ratio "$up" "$rup") $(ratio "$st" "$rstored") $pmed $pmax $verdict"
		done
	done
	echo "== summary: churn (uploaded: request bodies through the proxy; stored: every snapshot kept; pack: hermesfs pack=, restic backup wall, mksquashfs wall)"
	echo "$summary" | column -t
	;;
esac

case " $PARTS " in *" retention "*)
	for size in $RET_SIZES; do
		home=$(scripts/genhome/cached.sh "$size" 1)
		modes=plain
		[ "$RET_ENCRYPT" = 1 ] && modes="plain enc"
		for mode in $modes; do
			rw=$work/ret-$size-$mode
			mkdir -p "$rw"
			cp -a "$home/." "$rw/home/"
			set --
			[ "$mode" = enc ] && set -- -encrypt-to "$recipient" -identity "$work/key/key.txt"
			[ "$mode" = plain ] && set -- -restic "$rw/restic" -restic-prune-every "$RET_RESTIC_PRUNE_EVERY"
			echo "== retention, $size home, hermesfs $mode$([ "$mode" = plain ] && echo " and restic"): $RET_DAYS days, a snapshot every $RET_EVERY after $RET_ROUNDS round(s)"
			TZ=UTC "$work/retentioncost" -home "$rw/home" -store "$rw/store" -cache "$rw/cache" -churn "$work/genhome" \
				-days "$RET_DAYS" -every "$RET_EVERY" -rounds "$RET_ROUNDS" "$@" >"$rw/retention.txt" 2>"$rw/retention.log" || {
				echo "bench-cost: retentioncost failed:" >&2
				tail -5 "$rw/retention.log" >&2
				exit 1
			}
			# One line a simulated day (its last snapshot), then the summary.
			awk '/^#/ {print; next} /^summary/ {s = $0; next} {split($2, t, "T"); last[t[1]] = $0; if (!(t[1] in seen)) {seen[t[1]] = 1; order[++n] = t[1]}} END {for (i = 1; i <= n; i++) print last[order[i]]; print s}' "$rw/retention.txt"
			segment_use "$rw/store"
			echo "load average at the end: $(cut -d' ' -f1-3 /proc/loadavg)"
			rm -rf "$rw/home" "$rw/store" "$rw/cache" "$rw/restic"
		done
	done
	;;
esac

case " $PARTS " in *" stop "*)
	summary="size mode trial stop_s to_durable_s after_s pack_s upload_s bytes_uploaded load1 goal"
	for size in $STOP_SIZES; do
		home=$(scripts/genhome/cached.sh "$size" 1)
		for mode in plain enc; do
			name=stop-$size-$mode
			mkdir -p "$work/$name/mnt"
			cp -a "$home/." "$work/$name/mnt/"
			export HERMESFS_STORE="$(store_url "$name")"
			set -- --interval 0
			[ "$mode" = enc ] && set -- "$@" --encrypt-to "$recipient" --identity "$work/key/key.txt"
			echo "== stop, $size home, $mode: seeding the store through the link"
			mount_host "$name" "$work/$name/mnt" "$@"
			trial=1
			while [ $trial -le "$STOP_TRIALS" ]; do
				[ $trial -gt 1 ] && mount_host "$name" "$work/$name/mnt" "$@"
				python3 - "$work/$name/mnt/state.db" "$trial" <<'EOF'
import sqlite3, sys, time
db = sqlite3.connect(sys.argv[1], isolation_level=None)
sid = "stop_bench_%s_%d" % (sys.argv[2], time.time_ns())
db.execute("INSERT INTO sessions(id, source, started_at, title) VALUES (?, 'cli', ?, 'stop bench')", (sid, time.time()))
for i in range(200):
    db.execute("INSERT INTO messages(session_id, role, content, timestamp) VALUES (?, 'assistant', ?, ?)",
               (sid, ("message %d of the stop benchmark. " % i) * 40, time.time()))
db.close()
EOF
				n0=$(grep -c 'msg="snapshot published"' "$work/$name/daemon.log" || true)
				t0=$(now)
				kill -TERM "$hpid"
				wait "$hpid" && code=0 || code=$?
				took=$(since "$t0")
				hpid=""
				[ "$code" = 0 ] || { echo "bench-cost: hermesfs exited $code on SIGTERM" >&2; tail -20 "$work/$name/daemon.log" >&2; exit 1; }
				line=$(published "$work/$name/daemon.log" | tail -n +"$((n0 + 1))" | grep '^final ' | tail -1)
				[ -n "$line" ] || { echo "bench-cost: no final snapshot published on SIGTERM" >&2; tail -20 "$work/$name/daemon.log" >&2; exit 1; }
				set -- $line
				latest=$(cat "$work/s3/bench/$name/LATEST" | tr -d '[:space:]')
				[ "$latest" = "${11}" ] || { echo "bench-cost: LATEST is $latest, the final snapshot ${11}" >&2; exit 1; }
				ph=$(stop_phases "$work/$name/daemon.log")
				echo "trial $trial: SIGTERM to exit 0 in ${took}s (final snapshot ${11}: pack $2 s, upload $3 s, $5 bytes uploaded, freeze stall $4 ms; the daemon's stopping to published, then to stopped: $ph s); LATEST names it"
				case $size in 1G) sg=$(goal "$took" 1) ;; 8G) sg=$(goal "$took" 2) ;; *) sg=- ;; esac
				summary="$summary
$size $mode $trial $took $ph $2 $3 $5 $(cut -d' ' -f1 /proc/loadavg) $sg"
				set -- --interval 0
				[ "$mode" = enc ] && set -- "$@" --encrypt-to "$recipient" --identity "$work/key/key.txt"
				trial=$((trial + 1))
			done
			unset HERMESFS_STORE
			rm -rf "$work/$name/mnt" "$work/$name/state" "$work/s3/bench/$name"
		done
	done
	echo "== summary: stop (stop_s: SIGTERM to exit 0, the final snapshot durable; to_durable_s: the daemon's stopping to snapshot published; after_s: published to stopped, the rebase and lease release)"
	echo "$summary" | column -t
	;;
esac
