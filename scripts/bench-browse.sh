#!/bin/sh
# What browsing history costs: publishes a generated home of BENCH_SIZE
# (default 1G) to a local store (the mount's seed path), then mounts the
# store with 'hermesfs browse' and reports the requests and bytes that
# 'ls' of the root and 'cat' of one small file of the snapshot fetch, and
# what 'restore --path' of that file fetches, against the image's size.
#   usage: scripts/bench-browse.sh      (BENCH_SIZE=64M for a quick run)
set -eu
cd "$(dirname "$0")/.."
size=${BENCH_SIZE:-1G}
home=$(scripts/genhome/cached.sh "$size")
work=${BENCH_DIR:-/var/tmp/hermesfs-bench}/browse-$size
bin="$work/hermesfs"
cleanup() {
	[ -n "${pid:-}" ] && kill -INT "$pid" 2>/dev/null && wait "$pid" 2>/dev/null || true
	grep -q " $work/" /proc/mounts && umount -l "$work"/mnt "$work"/home 2>/dev/null || true
}
trap cleanup EXIT
rm -rf "$work"
mkdir -p "$work/home" "$work/mnt"
go build -o "$bin" ./cmd/hermesfs
store="file://$work/store"
cp -a "$home/." "$work/home/"
"$bin" mount --store "$store" --state-dir "$work/state" --background "$work/home" >/dev/null
"$bin" umount --state-dir "$work/state" "$work/home" >/dev/null
id=$("$bin" list --store "$store" --json | sed -n 's/.*"id": *"\([^"]*\)".*/\1/p' | head -1)
# The image's size (format 4: the manifest's "size"; its first snapshot is
# one segment holding the whole image).
asize=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["size"])' "$work/store/snapshots/$id.json")
echo "home $size, snapshot $id, image $asize bytes"

"$bin" browse --store "$store" "$work/mnt" >"$work/browse.out" 2>"$work/browse.err" &
pid=$!
i=0
until grep -q '^ready ' "$work/browse.out"; do
	i=$((i + 1)); [ $i -lt 300 ] || { cat "$work/browse.err"; exit 1; }
	sleep 0.1
done
ls "$work/mnt" >/dev/null
cat "$work/mnt/latest/memories/MEMORY.md" >/dev/null
kill -INT "$pid"; wait "$pid"; pid=
echo "browse, ls + cat memories/MEMORY.md: $(grep '^unmounted' "$work/browse.out")"
"$bin" restore --store "$store" --snapshot "$id" --path memories/MEMORY.md "$work/MEMORY.md"
