#!/bin/sh
# Installs what building and testing hermesfs need, skipping what is present.
# Usage: scripts/deps.sh [run|demo|test|bench]
#        scripts/deps.sh install PACKAGE...
#   run      fuse3 (fusermount3), for mounting
#   demo     also sqlite3, to generate the demo's sample home
#   test     also squashfs-tools, sqlite3, strace, age, versitygw and staticcheck
#   bench    what test needs, and restic (the benchmarks' baseline), git,
#            curl and bc
#   install  the packages named, with apt-get as below
#
# Another package manager may hold apt's and dpkg's locks (a fresh VM runs
# its first-boot updates for minutes): apt-get would fail at once with
# "Could not get lock /var/lib/dpkg/lock-frontend". deps.sh waits for them,
# saying who holds which, for up to DEPS_LOCK_WAIT seconds (default 600),
# and passes the rest of that time to apt-get (-o DPkg::Lock::Timeout, apt
# >= 1.9.11) for any lock taken in between.
# For tests: DEPS_APT_GET is the apt-get to run, DEPS_APT_LOCKS the lock
# files to wait for (space-separated).
set -eu

apt=${DEPS_APT_GET:-apt-get}
locks=${DEPS_APT_LOCKS:-/var/lib/dpkg/lock-frontend /var/lib/dpkg/lock /var/lib/apt/lists/lock /var/cache/apt/archives/lock}
wait_max=${DEPS_LOCK_WAIT:-600}
case "$wait_max" in '' | *[!0-9]*) echo "deps: DEPS_LOCK_WAIT=$wait_max: want a number of seconds" >&2; exit 2 ;; esac

# holder FILE: "PID NAME" of a process holding a lock on FILE (POSIX, OFD
# or flock, as /proc/locks lists them; PID -1 for an OFD lock), or nothing.
holder() {
	st=$(stat -L -c '%D %i' "$1" 2>/dev/null) || return 0
	set -- "$1" $st
	dev=$((0x$2))
	major=$(((dev >> 8 & 0xfff) | (dev >> 32 & 0xfffff000)))
	minor=$(((dev & 0xff) | (dev >> 12 & 0xffffff00)))
	id=$(printf '%02x:%02x:%s' "$major" "$minor" "$3")
	pid=$(awk -v id="$id" '$2 != "->" && $6 == id { print $5; exit }' /proc/locks)
	[ -n "$pid" ] || return 0
	name=$(cat "/proc/$pid/comm" 2>/dev/null || echo "a process")
	echo "$pid $name"
}

# wait_locks DEADLINE: returns once none of the lock files is held, or
# fails at DEADLINE (seconds since the epoch), saying who holds what.
wait_locks() {
	said=""
	while :; do
		busy=""
		for f in $locks; do
			h=$(holder "$f")
			if [ -n "$h" ]; then
				busy="$f ${h#* } (pid ${h%% *})"
				break
			fi
		done
		[ -n "$busy" ] || return 0
		now=$(date +%s)
		if [ "$now" -ge "$1" ]; then
			echo "deps: gave up after ${wait_max}s: ${busy#* } still holds ${busy%% *}; run this again once it is done (or raise DEPS_LOCK_WAIT)" >&2
			return 1
		fi
		if [ "$busy" != "$said" ]; then
			echo "deps: waiting for ${busy#* } to release ${busy%% *} (another package manager is running, e.g. a new machine's first-boot updates); waiting up to $(($1 - now))s more" >&2
			said=$busy
		fi
		sleep 1
	done
}

# apt_get ARG...: apt-get ARG..., once no other package manager holds the
# locks; a lock taken by another one in between is waited for again.
apt_get() {
	deadline=$(($(date +%s) + wait_max))
	tries=0
	while :; do
		wait_locks "$deadline" || return 1
		left=$((deadline - $(date +%s)))
		[ "$left" -gt 0 ] || left=1
		rc=0
		$sudo env DEBIAN_FRONTEND=noninteractive $apt -o "DPkg::Lock::Timeout=$left" "$@" || rc=$?
		[ "$rc" -ne 0 ] || return 0
		tries=$((tries + 1))
		held=""
		for f in $locks; do
			[ -z "$(holder "$f")" ] || held=yes
		done
		if [ -z "$held" ] || [ "$tries" -ge 3 ]; then
			return "$rc"
		fi
		echo "deps: apt-get $1 failed while another package manager took a lock; trying again" >&2
	done
}

install_packages() { # PACKAGE...
	sudo=""
	if [ "$(id -u)" != 0 ]; then
		command -v sudo >/dev/null 2>&1 || { echo "deps: need root or sudo to install: $*" >&2; exit 1; }
		sudo=sudo
	fi
	echo "deps: installing $*" >&2
	apt_get update -qq
	apt_get install -y -qq "$@" >/dev/null
}

want=${1:-test}
if [ "$want" = install ]; then
	shift
	[ $# -gt 0 ] || { echo "usage: scripts/deps.sh install PACKAGE..." >&2; exit 2; }
	install_packages "$@"
	exit 0
fi

missing=""
need() { command -v "$1" >/dev/null 2>&1 || missing="$missing $2"; }
need fusermount3 fuse3
if [ "$want" = demo ]; then
	need sqlite3 sqlite3
fi
if [ "$want" = bench ]; then
	need restic restic
	need git git
	need curl curl
	need bc bc
	want=test
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
	# shellcheck disable=SC2046
	install_packages $(echo "$missing" | tr ' ' '\n' | sort -u)
fi

if [ "$want" = test ]; then
	gobin=$(go env GOPATH)/bin
	[ -x "$gobin/versitygw" ] || command -v versitygw >/dev/null 2>&1 ||
		{ echo "deps: go install versitygw" >&2; go install github.com/versity/versitygw/cmd/versitygw@v1.8.0; }
	[ -x "$gobin/staticcheck" ] || command -v staticcheck >/dev/null 2>&1 ||
		{ echo "deps: go install staticcheck" >&2; go install honnef.co/go/tools/cmd/staticcheck@v0.8.2; }
fi
exit 0
