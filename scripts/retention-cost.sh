#!/bin/sh
# Measures what the default retention policy keeps in the store for a
# typical home: packs a generated home (scripts/genhome, default 1G), then
# applies a day of agent activity to a copy (12 new sessions, a turn
# appended to 48 others, 600 messages added to state.db, MEMORY.md edited)
# and packs it on the first archive, as the mount does. The two archive
# sizes give the per-snapshot size and its daily growth, which
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

# A day of activity.
h="$work/home"
ls "$h/sessions" | head -60 >"$work/sessions"
i=0
while read -r s; do
	i=$((i + 1))
	if [ $i -le 12 ]; then
		shuf "$h/sessions/$s" >"$h/sessions/session_new_$i.json"
	else
		head -c 2048 "$h/sessions/$s" >>"$h/sessions/$s"
	fi
done <"$work/sessions"
sqlite3 "$h/state.db" "insert into messages(session_id, role, content, timestamp)
  select session_id, role, content || ' ' || abs(random()), timestamp + 86400 from messages order by random() limit 600;"
echo "- noted on day 1: $(date)" >>"$h/memories/MEMORY.md"
"$work/hermesfs" pack --base "$work/day0.sqfs" "$h" "$work/day1.sqfs" >/dev/null

s0=$(stat -c %s "$work/day0.sqfs")
s1=$(stat -c %s "$work/day1.sqfs")
echo "home $(du -sh --apparent-size "$home" | cut -f1): archive $s0 bytes, after a day of activity $s1 bytes (growth $((s1 - s0)) bytes a day)"
for g in 0 0.25; do
	go run ./uploader/internal/retentioncost -size "$s0" -growth "$((s1 - s0))" -garbage "$g" | sed "s/^/garbage share $g: /"
done
