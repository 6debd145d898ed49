#!/bin/sh
# Measures what the default retention policy keeps in the store for a
# typical home: packs a generated home (scripts/genhome, default 1G), then
# applies a day of agent activity to a copy (12 new sessions, a turn
# appended to 48 others, 600 messages added to state.db, MEMORY.md edited)
# and packs it on the previous archive, twice. The archive sizes give the
# per-snapshot size and its daily growth, which
# uploader/internal/retentioncost turns into objects and bytes kept after
# 30 days at the 15-minute interval (every snapshot a whole object).
#   usage: scripts/retention-cost.sh [SIZE]
set -eu
cd "$(dirname "$0")/.."
home=$(scripts/genhome/cached.sh "${1:-${BENCH_SIZE:-1G}}")
work=$(mktemp -d "${BENCH_DIR:-/var/tmp/hermesfs-bench}/retention.XXXXXX")
trap 'rm -rf "$work"' EXIT
go build -o "$work/hermesfs" ./cmd/hermesfs
cp -a --reflink=auto "$home" "$work/home"
"$work/hermesfs" pack "$work/home" "$work/day0.sqfs" >/dev/null

# A day of agent activity on the copy: 12 new sessions (shuffled lines of
# existing ones: new bytes with the text's statistics), a 2 KiB turn
# appended to 48 others, 600 messages added to state.db, MEMORY.md edited.
h="$work/home"
day() {
	ls "$h/sessions" | grep -v _new_ | shuf -n 60 --random-source="$work/day0.sqfs" >"$work/sessions"
	i=0
	while read -r s; do
		i=$((i + 1))
		if [ $i -le 12 ]; then
			shuf "$h/sessions/$s" >"$h/sessions/session_new_$1_$i.json"
		else
			head -c 2048 "$h/sessions/$s" >>"$h/sessions/$s"
		fi
	done <"$work/sessions"
	sqlite3 "$h/state.db" "insert into messages(session_id, role, content, timestamp)
	  select session_id, role, content || ' ' || abs(random()), timestamp + 86400 from messages order by random() limit 600;"
	echo "- noted on day $1" >>"$h/memories/MEMORY.md"
}
# The first day also makes state.db differ from its copy in
# state-snapshots/ (until then stored once): a one-time step. The second
# day's growth is the daily rate.
day 1
"$work/hermesfs" pack --base "$work/day0.sqfs" "$h" "$work/day1.sqfs" >/dev/null
day 2
"$work/hermesfs" pack --base "$work/day1.sqfs" "$h" "$work/day2.sqfs" >/dev/null

s0=$(stat -c %s "$work/day0.sqfs")
s1=$(stat -c %s "$work/day1.sqfs")
s2=$(stat -c %s "$work/day2.sqfs")
echo "home $(du -sh --apparent-size "$home" | cut -f1): archive $s0 bytes; after day 1 $s1 bytes; after day 2 $s2 bytes (growth $((s2 - s1)) bytes a day)"
for g in 0 0.25; do
	go run ./uploader/internal/retentioncost -size "$s1" -growth "$((s2 - s1))" -garbage "$g" | sed "s/^/garbage share $g: /"
done
