#!/bin/sh
# Boot on a new host over a WAN-like link: versitygw on 127.0.0.1 behind the
# shaped fault proxy (uploader/faultproxy/cmd/shapedproxy: LINK_RATE shared by
# all connections, LINK_LATENCY added to every request). For each generated
# home size it publishes a snapshot (straight to versitygw, unshaped), then
# measures through the link:
#   - start -> ready on a new host (empty state dir)
#   - the Hermes startup read set replayed right after ready: config.yaml,
#     SOUL.md, memories/MEMORY.md and USER.md, the skills/ tree listed and 20
#     SKILL.md files read, state.db opened with sqlite3 and a query over the 50
#     newest sessions (with their message counts)
#   - start -> background fill complete ("lazy"."complete" in
#     'hermesfs status --json'; a daemon without that field is not lazy, and
#     its archive is complete at ready), and the daemon's peak RSS (VmHWM)
#   - a reboot of the first host after its clean stop (its own final
#     snapshot is the newest): data GETs counted by the proxy (GETs of
#     image bytes: segments, *.seg and *.seg.age, and older snapshots'
#     whole archives, *.sqfs)
#   - a second new host after those sessions stopped cleanly (hot set); the
#     first session writes a row to state.db, as a Hermes session does, so
#     its stop publishes a snapshot (and the hot set with it)
#   - the same new-host boot forced onto the download-then-mount path
#     (HERMESFS_LAZY=0, and --lazy=false when the binary has it)
#   - a plain GET of the image through the same link (curl; the first
#     snapshot of a home is one segment, the whole image)
#   - read-all: every file of the tree read once on host B after its fill
#     completed (from the complete cache), and on host C right after its read
#     set (through the lazy reader while it fetches, and the decryption when
#     encrypted)
#   - a session that reads every file (host E: tar of the home, as a backup
#     or an indexer does, right after a lazy boot), then stops and publishes;
#     then new hosts boot its snapshot and run the read set, in turn with its
#     hot set (hosts F), with the hot set taken out of its manifest (hosts G,
#     the no-hot-set baseline on the same archive and link), and with every
#     chunk of the archive in its hot set, in order (hosts H: what hermesfs
#     up to 8391c3a published after such a session, at most 4096 chunks),
#     TRIALS times each (default 5): the read set's medians, F/G and H/G
# ENCRYPT=1 runs it all on encrypted snapshots (a key made with 'hermesfs
# keygen', HERMESFS_ENCRYPT_TO and HERMESFS_IDENTITY for every host): run it
# with ENCRYPT=0 and ENCRYPT=1 to compare.
# Env: SIZES (default "1G 8G"), ENCRYPT (default 0), LINK_RATE (default 50MB, bytes/s, 10^6),
# LINK_LATENCY (default 20ms), FILL_TIMEOUT (seconds a fill may take before
# the run fails, default 1800), TRIALS (default 5), SCAN_ONLY (1: publish,
# then only hosts E to H), BENCH_DIR (scratch, default
# /var/tmp/hermesfs-bench), HERMESFS_BIN (default bin/hermesfs).
set -eu
cd "$(dirname "$0")/.."
. scripts/bench-s3link.sh
root=$(pwd)
SIZES=${SIZES:-1G 8G}
LINK_RATE=${LINK_RATE:-50MB}
LINK_LATENCY=${LINK_LATENCY:-20ms}
FILL_TIMEOUT=${FILL_TIMEOUT:-1800}
BENCH_DIR=${BENCH_DIR:-/var/tmp/hermesfs-bench}
bin=${HERMESFS_BIN:-$root/bin/hermesfs}
[ -x "$bin" ] || { echo "bench-lazy: $bin missing (make build)" >&2; exit 1; }
gobin=$(go env GOPATH)/bin
vgw=$(command -v versitygw || echo "$gobin/versitygw")
[ -x "$vgw" ] || { echo "bench-lazy: versitygw missing (scripts/deps.sh test)" >&2; exit 1; }
for c in sqlite3 curl python3 bc; do
	command -v $c >/dev/null || { echo "bench-lazy: $c missing" >&2; exit 1; }
done

mkdir -p "$BENCH_DIR"
work=$BENCH_DIR/lazy
pids=""
cleanup() {
	for p in $pids; do kill "$p" 2>/dev/null || true; done
	for m in "$work"/*/mnt-*; do
		mountpoint -q "$m" 2>/dev/null && umount -l "$m"
	done
	for p in $pids; do wait "$p" 2>/dev/null || true; done
	mkdir -p "$BENCH_DIR/lazy-logs"
	for f in "$work"/*.log "$work"/*/*.log "$work"/*/*.out; do
		[ -e "$f" ] || continue
		d=$(basename "$(dirname "$f")")
		[ "$d" = lazy ] && d= || d=$d-
		cp "$f" "$BENCH_DIR/lazy-logs/$d$(basename "$f")" || true
	done
	rm -rf "$work"
}
trap cleanup EXIT INT TERM
rm -rf "$work" "$BENCH_DIR/lazy-logs"
mkdir -p "$work/s3" "$BENCH_DIR/lazy-logs"
ENCRYPT=${ENCRYPT:-0}
if [ "$ENCRYPT" = 1 ]; then
	mkdir -p "$work/key"
	chmod 700 "$work/key"
	HERMESFS_ENCRYPT_TO=$("$bin" keygen "$work/key/key.txt")
	HERMESFS_IDENTITY=$work/key/key.txt
	export HERMESFS_ENCRYPT_TO HERMESFS_IDENTITY
	echo "encrypted snapshots (age, to $(printf %s "$HERMESFS_ENCRYPT_TO" | cut -c1-12)…)"
fi

now() { date +%s.%N; }
elapsed() { printf '%.3f' "$(echo "$2 - $1" | bc)"; }
ratio() { printf '%.2f' "$(echo "scale=4; $1 / $2" | bc)"; }
mib() { printf '%.1f' "$(echo "scale=2; $1 / 1048576" | bc)"; }

# versitygw on a free loopback port, one bucket; the shaped link in front.
s3link_start bench-lazy
# data_gets prints "DATA_GETS ALL_GETS BYTES" counted since the last reset:
# DATA_GETS are the GETs of image bytes (segments/*.seg, *.seg.age; whole
# archives snapshots/*.sqfs of older snapshots), not of manifests, extents
# lists, digests, LATEST or the lease.
data_gets() {
	curl -sS "$ctl/stats" | python3 -c 'import json,sys
s=json.load(sys.stdin); g=s.get("gets") or {}
data=(".seg", ".seg.age", ".sqfs", ".sqfs.age")
print(sum(v for k,v in g.items() if k.endswith(data)), sum(g.values()), s.get("bytes_down",0))'
}

if "$bin" mount -h 2>&1 | grep -q -- '-lazy'; then
	haslazy=1
	oldflag=--lazy=false
	default="lazy"
	short=lazy
else
	haslazy=0
	oldflag=
	default="default (this hermesfs has no lazy boot: it downloads, then mounts)"
	short=default
	echo "NOTE: $bin has no --lazy flag: no lazy boot; the default path below is the download-then-mount path"
fi
echo "load average before: $(cut -d" " -f1-3 /proc/loadavg)"
echo "link: $LINK_RATE/s shared, $LINK_LATENCY per request (shapedproxy in front of versitygw posix)"
export HERMESFS_LOG_LEVEL=info

# start_host NAME [ENV=V...] [-- MOUNT FLAGS]: starts 'hermesfs mount' with
# state dir and mountpoint under $sw, waits for its ready line. Sets hpid
# and boot (seconds from start to ready).
start_host() {
	name=$1
	shift
	envs=""
	while [ $# -gt 0 ] && [ "$1" != "--" ]; do envs="$envs $1"; shift; done
	[ $# -gt 0 ] && shift
	mkdir -p "$sw/mnt-$name"
	: >"$sw/$name.out"
	t0=$(now)
	# shellcheck disable=SC2086
	env HERMESFS_STATE_DIR="$sw/state-$name" $envs "$bin" mount --interval 0 "$@" "$sw/mnt-$name" >>"$sw/$name.out" 2>>"$sw/$name.log" &
	hpid=$!
	pids="$pids $hpid"
	until grep -q '^ready ' "$sw/$name.out"; do
		kill -0 "$hpid" 2>/dev/null || { echo "bench-lazy: hermesfs ($name) exited:" >&2; tail -20 "$sw/$name.log" >&2; exit 1; }
		sleep 0.02
	done
	t1=$(now)
	boot=$(elapsed "$t0" "$t1")
	snapshot=$(sed -n 's/^ready .* snapshot=\([^ ]*\) .*/\1/p' "$sw/$name.out" | tail -1)
}
stop_host() { # $1 pid
	kill -TERM "$1"
	wait "$1" || { echo "bench-lazy: hermesfs exited $? on SIGTERM" >&2; exit 1; }
}
# readset MOUNT: what Hermes reads when it starts; sets rsn (seconds) and
# rs (seconds and their split: small files, skills, sqlite3).
readset() {
	t0=$(now)
	cat "$1/config.yaml" "$1/SOUL.md" "$1/memories/MEMORY.md" "$1/memories/USER.md" >/dev/null
	t1=$(now)
	find "$1/skills" -name SKILL.md | sort | head -n 20 | while read -r f; do cat "$f"; done >/dev/null
	t2=$(now)
	sqlite3 "$1/state.db" "SELECT s.id, s.title, s.started_at, (SELECT count(*) FROM messages m WHERE m.session_id = s.id) FROM sessions s ORDER BY s.started_at DESC LIMIT 50;" >/dev/null
	t3=$(now)
	rsn=$(elapsed "$t0" "$t3")
	rs="${rsn}s (files $(elapsed "$t0" "$t1"), skills $(elapsed "$t1" "$t2"), sqlite3 $(elapsed "$t2" "$t3"))"
}
# lazy_state NAME: "absent", or "COMPLETE PRESENT TOTAL" from status --json.
lazy_state() {
	"$bin" status --json --state-dir "$sw/state-$1" "$sw/mnt-$1" 2>/dev/null | python3 -c 'import json,sys
try: r=json.load(sys.stdin)
except Exception: print("error"); sys.exit()
l=r.get("lazy")
print("absent" if l is None else "%s %d %d" % (str(bool(l.get("complete"))).lower(), l.get("present_bytes",0), l.get("total_bytes",0)))'
}
# wait_fill NAME START: waits for the fill; sets fill (seconds since START,
# the time the host was started), lazy ("absent" or "true ...").
wait_fill() {
	lazy=$(lazy_state "$1")
	deadline=$(($(date +%s) + FILL_TIMEOUT))
	while :; do
		case $lazy in
		absent | true*) break ;;
		error) echo "bench-lazy: 'hermesfs status --json' failed for $1" >&2; exit 1 ;;
		esac
		[ "$(date +%s)" -lt "$deadline" ] || { echo "bench-lazy: the fill of $1 is not complete after ${FILL_TIMEOUT}s (present, total: ${lazy#* })" >&2; exit 1; }
		sleep 0.1
		lazy=$(lazy_state "$1")
	done
	fill=$(elapsed "$2" "$(now)")
	# Not lazy: the archive was complete (downloaded, verified) at ready.
	[ "$lazy" = absent ] && fill=$boot
	return 0
}
# session_row MOUNT NAME: a session and its first message in state.db.
session_row() {
	sqlite3 "$1/state.db" "INSERT INTO sessions(id, source, started_at, title) VALUES ('bench_$2_$$', 'cli', unixepoch('now'), 'bench session $2');
INSERT INTO messages(session_id, role, content, timestamp) VALUES ('bench_$2_$$', 'user', 'hello from host $2', unixepoch('now'));" >/dev/null
}
hwm() { awk '/^VmHWM/ {printf "%.0f", $2/1024}' "/proc/$1/status"; }
# hot_of ID: "CHUNKS MIB TOTAL_MIB" of snapshot ID's hot set, from its
# manifest in the store.
hot_of() {
	s3curl "$ep/bench/home-$size/snapshots/$1.json" | python3 -c 'import json,sys
m=json.load(sys.stdin); h=m.get("hot") or []; cs=m.get("chunk_size") or 0
print(len(h), "%.1f" % (len(h)*cs/1048576), "%.1f" % (m["size"]/1048576))'
}
# segments_of ID: "IMAGE_BYTES KEY..." of snapshot ID: its image size and
# the store keys of its segments (format 4), or of its archive (older).
segments_of() {
	s3curl "$ep/bench/home-$size/snapshots/$1.json" | python3 -c 'import json,sys
m=json.load(sys.stdin)
keys=[s["key"] for s in m.get("segments") or []] or [m["archive"]]
print(m["size"], *keys)'
}
latest_id() { s3curl "$ep/bench/home-$size/LATEST" | tr -d '[:space:]'; }
median() { tr ' ' '\n' | grep . | sort -n | awk '{v[NR]=$1} END {print (NR%2) ? v[(NR+1)/2] : (v[NR/2]+v[NR/2+1])/2}'; }
TRIALS=${TRIALS:-5}
SCAN_ONLY=${SCAN_ONLY:-0}

summary=""
for size in $SIZES; do
	echo "== home $size"
	home=$(scripts/genhome/cached.sh "$size" 1)
	sw=$work/$size
	mkdir -p "$sw"
	echo "tree: $(find "$home/" -type f | wc -l) files, $(mib "$(du -sb "$home/" | cut -f1)") MiB ($home)"

	# Publish: host A over a copy of the home, straight to versitygw.
	export HERMESFS_STORE="s3://bench/home-$size?endpoint=$ep&region=us-east-1&path_style=true"
	mkdir "$sw/mnt-a"
	cp -a "$home/." "$sw/mnt-a/"
	start_host a
	stop_host "$hpid"
	echo "published (unshaped, not measured): pack + upload + stop done"
	export HERMESFS_STORE="s3://bench/home-$size?endpoint=$pep&region=us-east-1&path_style=true"

	if [ "$SCAN_ONLY" != 1 ]; then
		# Host B: a new host through the link.
		reset_counts
		ts=$(now)
		start_host b
		bpid=$hpid
		boot_b=$boot
		readset "$sw/mnt-b"
		rs_b=$rs
		rsn_b=$rsn
		# The session writes its row, as every Hermes session does: its stop
		# then publishes a snapshot, which carries the hot set to host C.
		session_row "$sw/mnt-b" b
		wait_fill b "$ts"
		fill_b=$fill
		lazy_b=$lazy
		rss_b=$(hwm "$bpid")
		t0=$(now)
		readall=$(find "$sw/mnt-b/" -type f -exec cat {} + | wc -c)
		readall_t=$(elapsed "$t0" "$(now)")
		echo "read-all on host B after the fill: $(mib "$readall") MiB in ${readall_t}s ($(echo "scale=1; $readall / 1000000 / $readall_t" | bc) MB/s)"
		set -- $(data_gets)
		gets_b="$1 data GETs, $(mib "$3") MiB through the link"
		archive=$snapshot
		set -- $(segments_of "$archive")
		size_b=$1
		shift
		segkeys="$*"
		if [ "$lazy_b" = absent ]; then
			echo "$default, new host: ready ${boot_b}s, read set ${rs_b} after ready, archive complete at ready (no lazy status), peak RSS ${rss_b} MiB, $gets_b"
		else
			echo "$default, new host: ready ${boot_b}s, read set ${rs_b} after ready, fill complete ${fill_b}s after start, peak RSS ${rss_b} MiB during the fill, $gets_b"
	fi
	stop_host "$bpid"
	set -- $(hot_of "$(latest_id)")
	hot_b="$1 chunks, $2 MiB of $3 MiB"
	echo "host B's snapshot (after its read set and row): hot set $hot_b"

	# Host B again: a reboot after a clean stop.
	reset_counts
	start_host b
	boot_r=$boot
	readset "$sw/mnt-b"
	rs_r=$rs
	rsn_r=$rsn
	set -- $(data_gets)
	gets_r=$1
	echo "$default, reboot of host B after a clean stop: ready ${boot_r}s, read set ${rs_r}, $gets_r data GETs ($2 GETs in all, $(mib "$3") MiB through the link)"
	stop_host "$hpid"

	# Host C: a second new host after host B's session.
	reset_counts
	start_host c
	cpid=$hpid
	boot_c=$boot
	readset "$sw/mnt-c"
	rs_c=$rs
	rsn_c=$rsn
	set -- $(data_gets)
	echo "$default, second new host (after the sessions of host B): ready ${boot_c}s, read set ${rs_c} after ready ($1 data GETs by then)"
	t0=$(now)
	readall_c=$(find "$sw/mnt-c/" -type f -exec cat {} + | wc -c)
	readall_ct=$(elapsed "$t0" "$(now)")
	echo "read-all on host C right after its read set (data fetched through the link as it is read): $(mib "$readall_c") MiB in ${readall_ct}s ($(echo "scale=1; $readall_c / 1000000 / $readall_ct" | bc) MB/s)"
	stop_host "$cpid"

	# Host D: a new host on the download-then-mount path.
	reset_counts
	start_host d HERMESFS_LAZY=0 -- $oldflag
	dpid=$hpid
	boot_d=$boot
	readset "$sw/mnt-d"
	rs_d=$rs
	rsn_d=$rsn
	rss_d=$(hwm "$dpid")
	set -- $(data_gets)
	echo "download-then-mount (HERMESFS_LAZY=0 $oldflag), new host: ready ${boot_d}s, read set ${rs_d} after ready, peak RSS ${rss_d} MiB, $1 data GETs ($(mib "$3") MiB through the link)"
	stop_host "$dpid"

	# A plain GET of the same image through the same link: its segments,
	# one after the other (a published home's first snapshot is one
	# segment, the whole image).
	t0=$(now)
	for k in $segkeys; do
		s3curl -o /dev/null "$pep/bench/home-$size/$k"
	done
	t1=$(now)
	get=$(elapsed "$t0" "$t1")
	echo "plain GET of the image ($(mib "$size_b") MiB, $(echo "$segkeys" | wc -w) segment(s)) through the link: ${get}s ($(echo "scale=1; $size_b / 1000000 / $get" | bc) MB/s)"

	fi

	# Host E: a session that reads every file right after a lazy boot (tar
	# of the home, as a backup or an indexer does), writes its row, stops
	# and publishes. Then new hosts boot its snapshot and run the read set:
	# hosts F with its hot set, G with the hot set taken out of its
	# manifest (the same archive, nothing else changed), H with every chunk
	# hot (the most a manifest may name), in turn.
	reset_counts
	# Its stop packs while the lazy fill may still be running, on a loaded
	# machine: give it more than the default 90 s. The stop is not what is
	# measured here.
	start_host e -- --stop-timeout 10m
	epid=$hpid
	t0=$(now)
	scanned=$(tar -cf - -C "$sw/mnt-e" . 2>>"$sw/e-tar.log" | wc -c)
	scan_t=$(elapsed "$t0" "$(now)")
	session_row "$sw/mnt-e" e
	stop_host "$epid"
	scan_id=$(latest_id)
	set -- $(hot_of "$scan_id")
	hot_e="$1 chunks, $2 MiB of $3 MiB"
	echo "host E (new host) read every file (tar): $(mib "$scanned") MiB in ${scan_t}s; its snapshot's hot set: $hot_e"
	mkey="$ep/bench/home-$size/snapshots/$scan_id.json"
	s3curl -o "$sw/scan-f.json" "$mkey"
	python3 -c 'import json,sys
m=json.load(open(sys.argv[1]))
m.pop("hot",None); json.dump(m,open(sys.argv[2],"w"))
cs=m.get("chunk_size") or 262144
m["chunk_size"]=cs
m["hot"]=list(range(min(4096,(m["size"]+cs-1)//cs))); json.dump(m,open(sys.argv[3],"w"))' "$sw/scan-f.json" "$sw/scan-g.json" "$sw/scan-h.json"
	rs_f=""
	rs_g=""
	rs_h=""
	for k in $(seq "$TRIALS"); do
		for v in f g h; do
			s3curl -X PUT -T "$sw/scan-$v.json" "$mkey" >/dev/null
			start_host "$v$k"
			readset "$sw/mnt-$v$k"
			stop_host "$hpid"
			case $v in
			f) what="its hot set"; rs_f="$rs_f $rsn" ;;
			g) what="no hot set"; rs_g="$rs_g $rsn" ;;
			h) what="every chunk hot"; rs_h="$rs_h $rsn" ;;
			esac
			echo "  host $v$k ($what): ready ${boot}s, read set $rs"
		done
	done
	s3curl -X PUT -T "$sw/scan-f.json" "$mkey" >/dev/null
	med_f=$(echo "$rs_f" | median)
	med_g=$(echo "$rs_g" | median)
	med_h=$(echo "$rs_h" | median)
	echo "second new host after a read-everything session, read set (median of $TRIALS): with its hot set ${med_f}s, without ${med_g}s ($(ratio "$med_f" "$med_g")x); every chunk hot ${med_h}s ($(ratio "$med_h" "$med_g")x)"

	if [ "$SCAN_ONLY" = 1 ]; then
		summary="$summary
$size - - - - - - - - - - - - - ${hot_e%% *} $med_f $med_g $med_h"
	else
		echo "ratios: ready $short / download-then-mount $(ratio "$boot_b" "$boot_d")x;" \
			"first read set + ready vs download-then-mount $(ratio "$(echo "$boot_b + $rsn_b" | bc)" "$(echo "$boot_d + $rsn_d" | bc)")x;" \
			"fill complete / plain GET $(ratio "$fill_b" "$get")x; download-then-mount ready / plain GET $(ratio "$boot_d" "$get")x"
		summary="$summary
$size $(mib "$size_b") $boot_b $rsn_b $fill_b $readall_t $rss_b $boot_c $rsn_c $readall_ct $gets_r $boot_d $rsn_d $get ${hot_e%% *} $med_f $med_g $med_h"
	fi
	for f in "$sw"/*.log "$sw"/*.out; do cp "$f" "$BENCH_DIR/lazy-logs/$size-$(basename "$f")" || true; done
	rm -rf "$sw"
done

echo "== summary (seconds; MiB)"
echo "size archive ready readset fill readall rss ready2 readset2 readall2 rebootGETs old_ready old_readset plainGET scanHot scanReadset scanNoHot scanAllHot$summary" | column -t
