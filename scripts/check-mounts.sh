#!/bin/sh
# Tests must unmount everything they mount. Only the mounts the suite makes
# are checked: those below its own temporary directory and below the
# checkout. Mounts elsewhere (a user's own hermesfs, rclone, sshfs...), even
# ones made while the suite runs, are none of its business.
#
#   check-mounts.sh run [--root DIR]... -- COMMAND [ARG]...
#       runs COMMAND with TMPDIR set to a fresh directory of its own (every
#       t.TempDir and fs/mounttest root of the go tests is below it), then
#       fails, naming them, if mounts are left below that directory or a
#       --root that were not there before. The directory is removed unless
#       something is still mounted below it. Exits with COMMAND's status,
#       or 1 for mounts left behind.
#   check-mounts.sh record FILE DIR...
#       notes the mounts below the DIRs in FILE.
#   check-mounts.sh check FILE DIR...
#       fails, naming them, if mounts below the DIRs are not in FILE.
set -eu

work=$(mktemp -d "${TMPDIR:-/tmp}/check-mounts.XXXXXX")
trap 'rm -rf "$work"' EXIT

# below DIR...: the mount points strictly below one of the DIRs, sorted,
# as /proc/self/mountinfo escapes them (\040 for a space).
below() {
	for d in "$@"; do
		d=$(cd "$d" && pwd -P) || return 2
		printf '%s/\n' "$d" | sed 's/\\/\\134/g; s/ /\\040/g; s/	/\\011/g'
	done >"$work/prefixes"
	awk 'NR == FNR { p[$0] = 1; next }
		{ for (x in p) if (index($5, x) == 1) { print $5; break } }' \
		"$work/prefixes" /proc/self/mountinfo | sort -u
}

record() { # FILE DIR...
	f=$1
	shift
	below "$@" >"$f"
}

check() { # FILE DIR...
	f=$1
	shift
	left=$(below "$@" | comm -13 "$f" -)
	if [ -n "$left" ]; then
		echo "check-mounts: mounts left behind by the tests:" >&2
		printf '%s\n' "$left" | sed 's/\\040/ /g; s/\\011/\t/g; s/\\012/\n/g; s/\\134/\\/g' >&2
		return 1
	fi
	echo "check-mounts: no mounts left behind"
}

case "${1:-}" in
record | check)
	[ $# -ge 3 ] || { echo "usage: check-mounts.sh $1 FILE DIR..." >&2; exit 2; }
	"$@"
	;;
run)
	shift
	run=$(mktemp -d "${TMPDIR:-/tmp}/hermesfs-test.XXXXXX")
	# As /tmp is: tests run processes as other users (the unprivileged
	# mount, --owner), which must reach their files below it.
	chmod 1777 "$run"
	echo "$run" >"$work/roots"
	while [ $# -gt 0 ] && [ "$1" != "--" ]; do
		case "$1" in
		--root) [ $# -ge 2 ] || { echo "check-mounts: --root needs a DIR" >&2; exit 2; }
			echo "$2" >>"$work/roots"
			shift 2 ;;
		*) echo "check-mounts: unknown option $1" >&2; exit 2 ;;
		esac
	done
	[ $# -ge 2 ] || { echo "usage: check-mounts.sh run [--root DIR]... -- COMMAND..." >&2; exit 2; }
	shift
	# roots FUNC FILE: FUNC FILE with every root as an argument (one a
	# line in $work/roots: they may hold spaces).
	roots() (
		set -f
		IFS='
'
		# shellcheck disable=SC2046
		set -- "$1" "$2" $(cat "$work/roots")
		unset IFS
		"$@"
	)
	roots record "$work/before"
	# A Ctrl-C stops the tests, and the check still runs.
	trap 'echo "check-mounts: interrupted" >&2' INT TERM
	rc=0
	TMPDIR=$run "$@" || rc=$?
	trap - INT TERM
	roots check "$work/before" || rc=1
	if [ -z "$(below "$run")" ]; then
		rm -rf "$run"
	else
		echo "check-mounts: left $run in place (something is mounted below it)" >&2
	fi
	exit "$rc"
	;;
*)
	echo "usage: check-mounts.sh run [--root DIR]... -- COMMAND... | record FILE DIR... | check FILE DIR..." >&2
	exit 2
	;;
esac
