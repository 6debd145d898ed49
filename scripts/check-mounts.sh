#!/bin/sh
# Tests must unmount everything they mount. `check-mounts.sh record FILE`
# notes the FUSE mounts that exist before the suite (a user's own hermesfs
# mount, say); `check-mounts.sh check FILE` then fails, naming them, if any
# FUSE mount not in that list is still mounted.
set -eu
mounts() { awk '$3 ~ /^fuse/ && $3 != "fusectl" {print $2}' /proc/self/mounts | sort; }
case "${1:-}" in
record) mounts >"$2" ;;
check)
	left=$(mounts | comm -13 "$2" -)
	rm -f "$2"
	if [ -n "$left" ]; then
		echo "check-mounts: FUSE mounts left behind by the tests:" >&2
		echo "$left" >&2
		exit 1
	fi
	echo "check-mounts: no mounts left behind"
	;;
*) echo "usage: check-mounts.sh record|check FILE" >&2; exit 2 ;;
esac
