#!/bin/sh
# The steps of `make demo` after the build: the first time, generate a
# small sample Hermes home in DEMO_DIR/home; then mount it in the
# foreground on a local store in DEMO_DIR/store (Ctrl-C stops it).
# Usage: scripts/demo.sh HERMESFS_BIN DEMO_DIR   (env GO: the go command)
set -eu
bin=$1
dir=$2
case $bin in /*) ;; *) bin=$PWD/$bin ;; esac
case $dir in /*) ;; *) dir=$PWD/$dir ;; esac
home=$dir/home

# Whether something is mounted at $1 (a path without blanks or
# backslashes, which mountinfo would escape). Asked of mountinfo, not of
# the path: the dead mount a killed demo daemon leaves answers every stat
# with ENOTCONN, so test -e and mkdir -p take it for missing and fail.
mounted() {
	awk -v mp="$1" '$5 == mp { found = 1 } END { exit !found }' /proc/self/mountinfo
}

if mounted "$home"; then
	# hermesfs mount deals with it: it detaches the dead or hung mount a
	# killed daemon left (the changes are in the state dir) and refuses a
	# live one, naming its daemon.
	:
elif [ ! -e "$home" ] && [ ! -e "$dir/store" ]; then
	echo "demo: generating a sample Hermes home in $home"
	"${GO:-go}" run ./scripts/genhome -size 20M -out "$home"
else
	mkdir -p "$home"
fi
# The demo's binary is not on PATH, and its store is not the default one:
# say how to reach both from another terminal.
cat <<EOF
demo: once the mount below says "ready", try from another terminal:
  $bin status $home
  $bin snapshot $home
  $bin list --store $dir/store
  $bin export --store $dir/store $dir/latest.sqfs && unsquashfs -l $dir/latest.sqfs
demo: Ctrl-C here stops it (a final snapshot, then the unmount).
EOF
echo "HERMESFS_STORE=file://$dir/store HERMESFS_STATE_DIR=$dir/state $bin mount --interval 1m $home"
HERMESFS_STORE=file://$dir/store HERMESFS_STATE_DIR=$dir/state exec "$bin" mount --interval 1m "$home"
