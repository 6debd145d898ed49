#!/bin/sh
# Packing benchmark (run by `make bench` through scripts/bench.sh).
#
# On a generated Hermes home of BENCH_SIZE (default 1G; cached under
# BENCH_DIR by scripts/genhome/cached.sh), in the same run:
#   pack:   hermesfs pack  vs  mksquashfs -comp zstd -Xcompression-level 3
#           -processors $(nproc): wall time, CPU time (user+sys), output size
#           and peak RSS, printed as ratios (goal: time <= 1.0 at size <= 1.02,
#           hermesfs peak RSS < 256 MiB)
#   unpack: hermesfs unpack  vs  unsquashfs, both of the hermesfs archive
#   reuse:  repack after changing about 1% of the tree, with --base (blocks of
#           unchanged files copied from the previous archive) vs a full pack
# Each measurement is the best of BENCH_RUNS (default 3) runs, with the tree
# (or archive) read into the page cache just before each run (through a pipe:
# GNU tar skips reading file data when its output is /dev/null).
# Uses $HERMESFS_BIN, else bin/hermesfs (built if missing).
set -eu
cd "$(dirname "$0")/.."
BIN=${HERMESFS_BIN:-bin/hermesfs}
[ -x "$BIN" ] || make build >/dev/null
SIZE=${BENCH_SIZE:-1G}
DIR=${BENCH_DIR:-/var/tmp/hermesfs-bench}
RUNS=${BENCH_RUNS:-3}
NPROC=$(nproc)
for tool in mksquashfs unsquashfs /usr/bin/time; do
	command -v "$tool" >/dev/null || { echo "bench-pack: $tool not installed (scripts/deps.sh test)" >&2; exit 1; }
done

home=$(scripts/genhome/cached.sh "$SIZE" 1)
work="$DIR/pack-work"
rm -rf "$work"
mkdir -p "$work"
trap 'rm -rf "$work"' EXIT

# Both packers read the tree from the page cache: it is warmed before every
# run (other benchmarks on the machine may drop caches in between).
warm="tar cf - -C '$home' . | cat >/dev/null"

# best LABEL PREP CMD...: runs CMD $RUNS times (running the shell snippet
# PREP before each, untimed) and keeps the fastest run's
# "wall user sys maxrss_kib" in $work/LABEL.
best() {
	label=$1 prep=$2
	shift 2
	: >"$work/$label.all"
	i=0
	while [ $i -lt "$RUNS" ]; do
		sh -c "$prep"
		/usr/bin/time -f "%e %U %S %M" -o "$work/$label.one" "$@" >/dev/null 2>"$work/$label.err" ||
			{ cat "$work/$label.err" >&2; exit 1; }
		cat "$work/$label.one" >>"$work/$label.all"
		i=$((i + 1))
	done
	sort -n "$work/$label.all" | head -1 >"$work/$label"
}
field() { awk -v f="$2" '{print $f}' "$work/$1"; }
cpu() { awk '{printf "%.2f", $2 + $3}' "$work/$1"; }
mib() { awk -v b="$1" 'BEGIN {printf "%.1f", b / 1048576}'; }
ratio() { awk -v a="$1" -v b="$2" 'BEGIN {if (b > 0) printf "%.3f", a / b; else print "n/a"}'; }
size() { stat -c %s "$1"; }

treebytes=$(du -sb "$home" | cut -f1)
files=$(find "$home" -type f | wc -l)
echo "tree: $home ($(mib "$treebytes") MiB, $files files)"

# --- pack
best hpack "rm -f '$work/h.sqfs'; $warm" "$BIN" pack "$home" "$work/h.sqfs"
best mpack "rm -f '$work/m.sqfs'; $warm" mksquashfs "$home" "$work/m.sqfs" -comp zstd -Xcompression-level 3 \
	-processors "$NPROC" -noappend -quiet -no-progress
hs=$(size "$work/h.sqfs")
ms=$(size "$work/m.sqfs")
printf "pack   hermesfs:   wall %6.2fs  cpu %6.2fs  size %8.1f MiB  peak RSS %6.1f MiB\n" \
	"$(field hpack 1)" "$(cpu hpack)" "$(mib "$hs")" "$(mib $(($(field hpack 4) * 1024)))"
printf "pack   mksquashfs: wall %6.2fs  cpu %6.2fs  size %8.1f MiB  peak RSS %6.1f MiB\n" \
	"$(field mpack 1)" "$(cpu mpack)" "$(mib "$ms")" "$(mib $(($(field mpack 4) * 1024)))"
echo "pack   ratio hermesfs/mksquashfs: time $(ratio "$(field hpack 1)" "$(field mpack 1)")" \
	"cpu $(ratio "$(cpu hpack)" "$(cpu mpack)") size $(ratio "$hs" "$ms")" \
	"rss $(ratio "$(field hpack 4)" "$(field mpack 4)")  (goal: time <= 1.0, size <= 1.02, RSS < 256 MiB)"

# --- unpack (both tools extract the hermesfs archive)
best hunpack "rm -rf '$work/hu'; cat '$work/h.sqfs' >/dev/null" "$BIN" unpack "$work/h.sqfs" "$work/hu"
best uunpack "rm -rf '$work/uu'; cat '$work/h.sqfs' >/dev/null" unsquashfs -no-progress -processors "$NPROC" -d "$work/uu" "$work/h.sqfs"
printf "unpack hermesfs:   wall %6.2fs  cpu %6.2fs  peak RSS %6.1f MiB\n" \
	"$(field hunpack 1)" "$(cpu hunpack)" "$(mib $(($(field hunpack 4) * 1024)))"
printf "unpack unsquashfs: wall %6.2fs  cpu %6.2fs  peak RSS %6.1f MiB\n" \
	"$(field uunpack 1)" "$(cpu uunpack)" "$(mib $(($(field uunpack 4) * 1024)))"
echo "unpack ratio hermesfs/unsquashfs: time $(ratio "$(field hunpack 1)" "$(field uunpack 1)") cpu $(ratio "$(cpu hunpack)" "$(cpu uunpack)")"
diff -r --no-dereference "$work/hu" "$work/uu" >/dev/null 2>&1 || { echo "bench-pack: hermesfs unpack and unsquashfs disagree" >&2; exit 1; }
rm -rf "$work/hu" "$work/uu"

# --- repack after a 1% change, reusing the previous archive's blocks
cp -a "$home" "$work/tree"
changed=$(find "$work/tree/sessions" -name '*.json' | sort | awk -v t="$treebytes" '
	{ cmd = "stat -c %s \"" $0 "\""; cmd | getline s; close(cmd)
	  if (sum < t / 100) { print $0; sum += s } }' | while read -r f; do
	printf '\n{"appended": "a new turn in this session"}\n' >>"$f"
	echo "$f"
done | wc -l)
best full "rm -f '$work/full.sqfs'; tar cf - -C '$work/tree' . | cat >/dev/null" "$BIN" pack "$work/tree" "$work/full.sqfs"
best reuse "rm -f '$work/reuse.sqfs'; tar cf - -C '$work/tree' . | cat >/dev/null; cat '$work/h.sqfs' >/dev/null" "$BIN" pack --base "$work/h.sqfs" "$work/tree" "$work/reuse.sqfs"
"$BIN" verify "$work/reuse.sqfs" >/dev/null
printf "reuse  full pack:        wall %6.2fs  cpu %6.2fs  size %8.1f MiB\n" \
	"$(field full 1)" "$(cpu full)" "$(mib "$(size "$work/full.sqfs")")"
printf "reuse  pack --base:      wall %6.2fs  cpu %6.2fs  size %8.1f MiB  (%s session files changed, ~1%% of bytes)\n" \
	"$(field reuse 1)" "$(cpu reuse)" "$(mib "$(size "$work/reuse.sqfs")")" "$changed"
echo "reuse  ratio --base/full: time $(ratio "$(field reuse 1)" "$(field full 1)") cpu $(ratio "$(cpu reuse)" "$(cpu full)")"
