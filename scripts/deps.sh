#!/bin/sh
# Installs what building and testing hermesfs need, skipping what is present.
# Usage: scripts/deps.sh [run|demo|test]
#   run   fuse3 (fusermount3), for mounting
#   demo  also sqlite3, to generate the demo's sample home
#   test  also squashfs-tools, sqlite3, strace, age, versitygw and staticcheck
set -eu
want=${1:-test}

missing=""
need() { command -v "$1" >/dev/null 2>&1 || missing="$missing $2"; }
need fusermount3 fuse3
if [ "$want" = demo ]; then
	need sqlite3 sqlite3
fi
if [ "$want" = test ]; then
	need mksquashfs squashfs-tools
	need unsquashfs squashfs-tools
	need sqlite3 sqlite3
	need strace strace
	need chattr e2fsprogs # the torture tests make mountpoints immutable
	need gcc gcc # the race detector needs cgo
	need age age # interop of encrypted snapshots with the age CLI
	need rsync rsync # a state dir copied mid copy-up (fs tests)
fi
if [ -n "$missing" ]; then
	pkgs=$(echo "$missing" | tr ' ' '\n' | sort -u | tr '\n' ' ')
	sudo=""
	if [ "$(id -u)" != 0 ]; then
		command -v sudo >/dev/null 2>&1 || { echo "deps: need root or sudo to install:$pkgs" >&2; exit 1; }
		sudo=sudo
	fi
	echo "deps: installing$pkgs" >&2
	$sudo apt-get update -qq
	DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq $pkgs >/dev/null
fi

if [ "$want" = test ]; then
	gobin=$(go env GOPATH)/bin
	[ -x "$gobin/versitygw" ] || command -v versitygw >/dev/null 2>&1 ||
		{ echo "deps: go install versitygw" >&2; go install github.com/versity/versitygw/cmd/versitygw@v1.8.0; }
	[ -x "$gobin/staticcheck" ] || command -v staticcheck >/dev/null 2>&1 ||
		{ echo "deps: go install staticcheck" >&2; go install honnef.co/go/tools/cmd/staticcheck@v0.8.2; }
fi
exit 0
