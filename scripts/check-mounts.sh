#!/bin/sh
# Fails if a hermesfs or test FUSE mount is still mounted: tests must clean up
# after themselves. Prints the offenders.
left=$(awk '$3 ~ /^fuse/ && ($1 ~ /hermesfs/ || $3 ~ /hermesfs/ || $2 ~ /\/(hermesfs|Test)/) {print $2}' /proc/self/mounts)
if [ -n "$left" ]; then
	echo "check-mounts: FUSE mounts left behind by the tests:" >&2
	echo "$left" >&2
	exit 1
fi
echo "check-mounts: no mounts left behind"
