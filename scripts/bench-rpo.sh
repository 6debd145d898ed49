#!/bin/sh
# What a host that vanishes loses with write-back, and what write-back costs.
# versitygw on 127.0.0.1 behind the shaped fault proxy
# (uploader/faultproxy/cmd/shapedproxy: LINK_RATE each way, shared by all
# connections; LINK_LATENCY added to every request), on the generated home
# (BENCH_SIZE), published first straight to versitygw (not measured).
#
# Part 1, recovery point. A host mounts with --write-back RPO_D; a writer
# appends a JSON line to sessions/rpo.jsonl with fsync every 100 ms and
# commits a message row to state.db (WAL, synchronous=FULL) every 500 ms,
# logging each write once it returned. After a random RUN_MIN..RUN_MAX
# seconds the daemon is killed (kill -9) and its state dir deleted: a VM
# reclaimed with its disk. A new host (a fresh state dir, the same
# mountpoint) then mounts the store, retrying while the dead host's writer
# lease is still live (25 s), and reads the newest line and row it has.
# Seconds lost, per trial: the newest write acknowledged before the kill
# minus the newest present, the worse of the two files. The new host is the
# next trial's writer. TRIALS trials; max and median. Goal with
# --write-back 2s: at most 5 s in every trial.
#
# Part 2, what a busy agent costs per hour with write-back D, for each D in
# COST_DS: ROUNDS rounds of agent activity, one every ROUND_SECONDS
# (churn_round below: for 20 s a message every 2 s, appended to a session
# transcript and inserted in state.db, then MEMORY.md rewritten, a skill
# written, a log appended), then D more seconds for the last write-back.
# Measured once the new host's lazy fill is complete. Reported per hour:
# store requests and bytes uploaded (the proxy's counters, lease renewals
# included), daemon CPU seconds (utime + stime),
# snapshots, and the longest freeze stall (freeze_stall of the daemon's
# "snapshot published" lines) with the longest wait of the writes.
#
# Env: BENCH_SIZE (default 1G), BENCH_ENTRIES (an installed agent of that
# many entries in the home: genhome -install; default none), TRIALS (20), RPO_D (2s), RUN_MIN, RUN_MAX
# (5, 20 seconds), COST_DS ("2s 10s 60s"), ROUNDS (12), ROUND_SECONDS (60),
# LINK_RATE (50MB, bytes/s, 10^6), LINK_LATENCY (20ms), SEED (random; the
# kill moments), BENCH_DIR (scratch, default /var/tmp/hermesfs-bench),
# HERMESFS_BIN (default bin/hermesfs). PARTS ("rpo cost") picks the parts.
set -eu
cd "$(dirname "$0")/.."
. scripts/bench-s3link.sh
root=$(pwd)
BENCH_SIZE=${BENCH_SIZE:-1G}
BENCH_DIR=${BENCH_DIR:-/var/tmp/hermesfs-bench}
TRIALS=${TRIALS:-20}
RPO_D=${RPO_D:-2s}
RUN_MIN=${RUN_MIN:-5}
RUN_MAX=${RUN_MAX:-20}
COST_DS=${COST_DS:-2s 10s 60s}
ROUNDS=${ROUNDS:-12}
ROUND_SECONDS=${ROUND_SECONDS:-60}
LINK_RATE=${LINK_RATE:-50MB}
LINK_LATENCY=${LINK_LATENCY:-20ms}
SEED=${SEED:-$(od -An -N2 -tu2 /dev/urandom | tr -d ' ')}
PARTS=${PARTS:-rpo cost}
bin=${HERMESFS_BIN:-$root/bin/hermesfs}
[ -x "$bin" ] || { echo "bench-rpo: $bin missing (make build)" >&2; exit 1; }
gobin=$(go env GOPATH)/bin
vgw=$(command -v versitygw || echo "$gobin/versitygw")
[ -x "$vgw" ] || { echo "bench-rpo: versitygw missing (scripts/deps.sh test)" >&2; exit 1; }
for c in sqlite3 curl python3; do
	command -v $c >/dev/null || { echo "bench-rpo: $c missing" >&2; exit 1; }
done
"$bin" mount -h 2>&1 | grep -q -- '-write-back' || { echo "bench-rpo: $bin has no --write-back" >&2; exit 1; }

mkdir -p "$BENCH_DIR"
work=$BENCH_DIR/rpo
mp=$work/mnt
pids=""
hpid=""
wpid=""
cleanup() {
	for p in $wpid $hpid $pids; do kill "$p" 2>/dev/null || true; done
	for m in "$mp" "$work/seed"; do
		mountpoint -q "$m" 2>/dev/null && umount -l "$m"
	done
	for p in $wpid $hpid $pids; do wait "$p" 2>/dev/null || true; done
	rm -rf "$BENCH_DIR/rpo-logs"
	mkdir -p "$BENCH_DIR/rpo-logs"
	cp "$work"/*.log "$work"/*.out "$BENCH_DIR/rpo-logs/" 2>/dev/null || true
	rm -rf "$work"
}
trap cleanup EXIT INT TERM
rm -rf "$work"
mkdir -p "$work/s3" "$mp"

now() { date +%s.%N; }

# The writer of part 1 and the agent activity of part 2.
cat >"$work/writer.py" <<'EOF'
import json, os, sqlite3, sys, time
mp, acks, tag = sys.argv[1:4]
os.makedirs(os.path.join(mp, "sessions"), exist_ok=True)
sess = open(os.path.join(mp, "sessions", "rpo.jsonl"), "a")
ack = open(acks, "a", buffering=1)
db = sqlite3.connect(os.path.join(mp, "state.db"), timeout=60, isolation_level=None)
db.execute("PRAGMA journal_mode=WAL")
db.execute("PRAGMA synchronous=FULL")
db.execute("INSERT OR IGNORE INTO sessions(id, source, started_at, title) VALUES (?, 'rpo', ?, 'rpo bench')", (tag, time.time()))
nj = ns = time.time()
while True:
    if time.time() >= nj:
        t = time.time()
        sess.write(json.dumps({"t": t, "tag": tag}) + "\n")
        sess.flush()
        os.fsync(sess.fileno())
        ack.write("j %.6f %.6f\n" % (t, time.time() - t))
        nj += 0.1
    if time.time() >= ns:
        t = time.time()
        db.execute("INSERT INTO messages(session_id, role, content, timestamp) VALUES (?, 'user', 'rpo', ?)", (tag, t))
        ack.write("s %.6f %.6f\n" % (t, time.time() - t))
        ns += 0.5
    time.sleep(max(0.0, min(nj, ns) - time.time()))
EOF
cat >"$work/churn.py" <<'EOF'
# One round of a busy agent: for 20 s, a message every 2 s (a line appended
# to the session's transcript with fsync, a row committed to state.db), then
# MEMORY.md rewritten (temp file, fsync, rename), a skill written, a log
# appended. Prints the longest time one write took.
import json, os, sqlite3, sys, time
mp, r, acks = sys.argv[1], int(sys.argv[2]), sys.argv[3]
worst = 0.0
def timed(f):
    global worst
    t = time.time(); f(); worst = max(worst, time.time() - t)
db = sqlite3.connect(os.path.join(mp, "state.db"), timeout=60, isolation_level=None)
db.execute("PRAGMA journal_mode=WAL")
sid = "busy_%d_%d" % (os.getpid(), r)
timed(lambda: db.execute("INSERT INTO sessions(id, source, started_at, title) VALUES (?, 'cli', ?, 'busy agent')", (sid, time.time())))
os.makedirs(os.path.join(mp, "sessions"), exist_ok=True)
tr = open(os.path.join(mp, "sessions", sid + ".jsonl"), "a")
def line(i):
    tr.write(json.dumps({"role": "assistant", "n": i, "content": "x" * 1500}) + "\n"); tr.flush(); os.fsync(tr.fileno())
for i in range(10):
    t0 = time.time()
    timed(lambda: line(i))
    timed(lambda: db.execute("INSERT INTO messages(session_id, role, content, timestamp) VALUES (?, 'assistant', ?, ?)", (sid, "y" * 1500, time.time())))
    time.sleep(max(0.0, 2.0 - (time.time() - t0)))
def memory():
    p = os.path.join(mp, "memories", "MEMORY.md")
    with open(p + ".tmp", "w") as f:
        f.write(("round %d\n\u00a7\n" % r) * 100); f.flush(); os.fsync(f.fileno())
    os.rename(p + ".tmp", p)
timed(memory)
def skill():
    d = os.path.join(mp, "skills", "busy", "skill-%d" % r)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "SKILL.md"), "w") as f:
        f.write("# skill %d\n" % r + "step\n" * 700); f.flush(); os.fsync(f.fileno())
timed(skill)
def log():
    os.makedirs(os.path.join(mp, "logs"), exist_ok=True)
    with open(os.path.join(mp, "logs", "agent.log"), "a") as f:
        f.write(("%.3f busy agent round %d\n" % (time.time(), r)) * 50)
timed(log)
with open(acks, "a") as f:
    f.write("%.6f\n" % worst)
EOF

# versitygw on a free loopback port, one bucket; the shaped link in front.
s3link_start bench-rpo
export HERMESFS_LOG_LEVEL=info

home=$(scripts/genhome/cached.sh "$BENCH_SIZE" 1 ${BENCH_ENTRIES:-})
echo "machine: $(uname -srm), $(nproc) cores; load average before: $(cut -d" " -f1-3 /proc/loadavg)"
echo "home: $BENCH_SIZE generated ($(find "$home/" -type f | wc -l) files, $(du -sh "$home/" | cut -f1)); link: $LINK_RATE/s each way, $LINK_LATENCY per request (shapedproxy in front of versitygw posix)"

# host NAME [FLAGS...]: mounts the store on $mp with state dir
# $work/state-NAME through the link, retrying while another host's lease
# is live; sets hpid.
host() {
	name=$1
	shift
	deadline=$(($(date +%s) + 180))
	while :; do
		: >"$work/$name.out"
		"$bin" mount --state-dir "$work/state-$name" "$@" "$mp" >>"$work/$name.out" 2>>"$work/$name.log" &
		hpid=$!
		while ! grep -q '^ready ' "$work/$name.out"; do
			if ! kill -0 "$hpid" 2>/dev/null; then
				wait "$hpid" && code=0 || code=$?
				hpid=""
				[ "$code" = 4 ] && [ "$(date +%s)" -lt "$deadline" ] || {
					echo "bench-rpo: hermesfs ($name) exited $code:" >&2
					tail -20 "$work/$name.log" >&2
					exit 1
				}
				rm -rf "$work/state-$name"
				sleep 2
				continue 2
			fi
			sleep 0.05
		done
		return 0
	done
}
stop_host() {
	kill -TERM "$hpid"
	wait "$hpid" || { echo "bench-rpo: hermesfs exited $? on SIGTERM" >&2; exit 1; }
	hpid=""
}
# wait_fill NAME: waits until the host's lazy fill of the base is complete
# (its GETs are boot's, not write-back's).
wait_fill() {
	deadline=$(($(date +%s) + 1800))
	until "$bin" status --json --state-dir "$work/state-$1" "$mp" 2>/dev/null | python3 -c 'import json,sys
l = json.load(sys.stdin).get("lazy")
sys.exit(0 if l is None or l.get("complete") else 1)'; do
		[ "$(date +%s)" -lt "$deadline" ] || { echo "bench-rpo: the fill of $1 did not complete" >&2; exit 1; }
		sleep 0.5
	done
}
cpu() { awk '{printf "%.2f", ($14 + $15) / 100}' "/proc/$1/stat"; }

# Publish the home, straight to versitygw.
export HERMESFS_STORE="s3://bench/home?endpoint=$ep&region=us-east-1&path_style=true"
mkdir -p "$work/seed"
cp -a "$home/." "$work/seed/"
mp0=$mp
mp=$work/seed
host seed --interval 0
stop_host
mp=$mp0
rm -rf "$work/seed"
export HERMESFS_STORE="s3://bench/home?endpoint=$pep&region=us-east-1&path_style=true"

# newest_ack FILE KIND BEFORE: the newest write of KIND (j, s) in an ack log
# that had returned before BEFORE (lines: kind, time written, time taken).
newest_ack() {
	awk -v k="$2" -v b="$3" '$1 == k && $2 + $3 < b && $2 > m {m = $2} END {printf "%.6f", m}' "$1"
}
# present: "JSON SQLITE", the newest write times on the mount.
present() {
	python3 - "$mp" <<'EOF'
import json, os, sqlite3, sys
mp = sys.argv[1]
j = 0.0
try:
    for line in open(os.path.join(mp, "sessions", "rpo.jsonl")):
        try:
            j = max(j, json.loads(line)["t"])
        except Exception:
            pass
except FileNotFoundError:
    pass
db = sqlite3.connect("file:" + os.path.join(mp, "state.db") + "?mode=ro", uri=True)
s = db.execute("SELECT coalesce(max(timestamp), 0) FROM messages WHERE content = 'rpo'").fetchone()[0]
print("%.6f %.6f" % (j, s))
EOF
}
med() { sort -n | awk '{a[NR] = $1} END {if (NR % 2) print a[(NR + 1) / 2]; else printf "%.3f\n", (a[NR / 2] + a[NR / 2 + 1]) / 2}'; }

case " $PARTS " in *" rpo "*)
	echo "== recovery point: --write-back $RPO_D, $TRIALS trials, kill -9 and state dir lost after ${RUN_MIN}-${RUN_MAX}s of writes (seed $SEED)"
	host h0 --write-back "$RPO_D"
	losses=""
	trial=1
	rnd=$SEED
	while [ $trial -le "$TRIALS" ]; do
		acks=$work/acks-$trial.log
		: >"$acks"
		python3 "$work/writer.py" "$mp" "$acks" "rpo_$trial" 2>"$work/writer-$trial.log" &
		wpid=$!
		rnd=$(((rnd * 1103515245 + 12345) % 2147483648))
		run=$((RUN_MIN + rnd % (RUN_MAX - RUN_MIN + 1)))
		sleep "$run"
		kill -0 "$wpid" 2>/dev/null || { echo "bench-rpo: the writer died:" >&2; cat "$work/writer-$trial.log" >&2; exit 1; }
		tk=$(now)
		kill -KILL "$hpid"
		wait "$hpid" 2>/dev/null || true
		hpid=""
		rm -rf "$work/state-h$((trial - 1))"
		kill "$wpid" 2>/dev/null || true
		wait "$wpid" 2>/dev/null || true
		wpid=""
		umount -l "$mp" 2>/dev/null || true
		t0=$(now)
		host "h$trial" --write-back "$RPO_D"
		boot=$(python3 -c "print('%.1f' % ($(now) - $t0))")
		set -- $(present)
		aj=$(newest_ack "$acks" j "$tk")
		as=$(newest_ack "$acks" s "$tk")
		lost=$(python3 -c "print('%.2f' % max($aj - $1, $as - $2, 0))")
		lj=$(python3 -c "print('%.2f' % max($aj - $1, 0))")
		ls=$(python3 -c "print('%.2f' % max($as - $2, 0))")
		wait_max=$(awk 'BEGIN {m = 0} $3 > m {m = $3} END {printf "%.3f", m}' "$acks")
		snaps=$(grep -c 'msg="snapshot published"' "$work/h$((trial - 1)).log" || true)
		echo "trial $trial: killed after ${run}s of writes; lost ${lost}s (session file ${lj}s, state.db ${ls}s); $snaps snapshots by the killed host; slowest write ${wait_max}s; new host ready after ${boot}s (the dead host's lease lapses in 25s)"
		losses="$losses $lost"
		trial=$((trial + 1))
	done
	stop_host
	max=$(for l in $losses; do echo "$l"; done | sort -n | tail -1)
	median=$(for l in $losses; do echo "$l"; done | med)
	echo "recovery point, --write-back $RPO_D: seconds lost per trial:$losses; max ${max}s, median ${median}s (goal: at most 5s in every trial)"
	;;
esac

case " $PARTS " in *" cost "*)
	echo "== a busy agent per hour: $ROUNDS rounds, one every ${ROUND_SECONDS}s"
	summary="D requests/h MB_uploaded/h cpu_s/h snapshots/h max_freeze_stall_ms max_write_wait_ms"
	for D in $COST_DS; do
		name=cost-$D
		rm -rf "$work/state-$name"
		host "$name" --write-back "$D"
		wait_fill "$name"
		curl -sS -X POST "$ctl/reset" >/dev/null
		: >"$work/waits-$D.log"
		lines0=$(wc -l <"$work/$name.log")
		c0=$(cpu "$hpid")
		t0=$(now)
		r=1
		while [ $r -le "$ROUNDS" ]; do
			python3 "$work/churn.py" "$mp" "$r" "$work/waits-$D.log"
			next=$(python3 -c "print(max(0.0, $t0 + $r * $ROUND_SECONDS - $(now)))")
			sleep "$next"
			r=$((r + 1))
		done
		# The last round's write-back (at most D after it).
		sleep "$(python3 -c "import re; m = re.fullmatch(r'(\d+)s', '$D'); print(int(m.group(1)) + 5 if m else 5)")"
		t1=$(now)
		c1=$(cpu "$hpid")
		stats=$(curl -sS "$ctl/stats")
		tail -n +"$((lines0 + 1))" "$work/$name.log" >"$work/$name.window"
		stop_host
		row=$(python3 - "$D" "$t0" "$t1" "$c0" "$c1" "$work/$name.window" "$work/waits-$D.log" "$stats" <<'EOF'
import json, re, sys
D, t0, t1, c0, c1, logf, waitsf, stats = sys.argv[1:]
h = 3600.0 / (float(t1) - float(t0))
s = json.loads(stats)
reqs = sum(s.get("ops", {}).values())
up = s.get("bytes_up", 0)
def dur(v):
    m = re.fullmatch(r"([0-9.]+)(ns|µs|us|ms|s|m)", v)
    if not m:
        return 0.0
    return float(m.group(1)) * {"ns": 1e-6, "µs": 1e-3, "us": 1e-3, "ms": 1, "s": 1e3, "m": 6e4}[m.group(2)]
stalls, snaps = [], 0
for line in open(logf, encoding="utf-8"):
    if 'msg="snapshot published"' in line:
        snaps += 1
        m = re.search(r"freeze_stall=(\S+)", line)
        if m:
            stalls.append(dur(m.group(1)))
waits = [float(x) for x in open(waitsf) if x.strip()]
print("%s %.0f %.1f %.1f %.0f %.1f %.0f" % (D, reqs * h, up / 1e6 * h, (float(c1) - float(c0)) * h, snaps * h,
      max(stalls or [0]), max(waits or [0]) * 1000))
EOF
)
		ops=$(echo "$stats" | python3 -c 'import json,sys
o = json.load(sys.stdin).get("ops") or {}
print(", ".join("%s %d" % kv for kv in sorted(o.items(), key=lambda kv: -kv[1])))')
		echo "$row" | awk -v ops="$ops" '{printf "--write-back %s: %s requests/h, %s MB uploaded/h, %s CPU s/h, %s snapshots/h, longest freeze stall %s ms, slowest agent write %s ms (requests in the run: %s)\n", $1, $2, $3, $4, $5, $6, $7, ops}'
		summary="$summary
$row"
	done
	echo "== summary (per hour of a busy agent)"
	echo "$summary" | column -t
	;;
esac
