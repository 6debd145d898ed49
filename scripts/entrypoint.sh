#!/bin/sh
# Container entrypoint: mount the agent's home with hermesfs, run the agent,
# and on SIGTERM/SIGINT stop the agent first (so SQLite closes its database),
# then hermesfs (final snapshot + upload), then exit.
#
# Usage: entrypoint.sh COMMAND [ARGS...]
# Environment:
#   HERMESFS_MOUNTPOINT  the home to mount (default $HOME/.hermes)
#   HERMESFS_BIN         the hermesfs binary (default: hermesfs in PATH)
#   HERMESFS_MOUNT_ARGS  extra flags for 'hermesfs mount' (word-split)
#   HERMESFS_WRITE_BACK  write-back delay (default below: 10s)
#   HERMESFS_STORE, HERMESFS_STATE_DIR, HERMESFS_INTERVAL, AWS_* ... as for
#                        'hermesfs mount'
#
# Exit status: the agent's, unless hermesfs failed to publish the final
# snapshot (it exits 5 and its local state is kept in the state dir): then
# hermesfs' own status, so that whoever restarts the container can tell that
# the last changes are not in the store yet.
set -u

# Write-back (README "Write-back"): each change is published this long after
# it is made, so a container killed without SIGTERM (OOM, its node lost) loses
# about this much instead of everything since the last interval snapshot.
# 0: off. The container's environment wins over this default.
HERMESFS_WRITE_BACK=${HERMESFS_WRITE_BACK:-10s}
export HERMESFS_WRITE_BACK

mp=${HERMESFS_MOUNTPOINT:-${HOME:-/root}/.hermes}
bin=${HERMESFS_BIN:-hermesfs}
if [ $# -eq 0 ]; then
	echo "entrypoint: usage: $0 COMMAND [ARGS...]" >&2
	exit 2
fi
mkdir -p "$mp" || exit 1

tmp=$(mktemp -d) || exit 1
out=$tmp/hermesfs.out
hpid=""
apid=""
stopping=0

# Signals that arrive before the agent runs stop hermesfs alone.
on_signal() {
	stopping=1
	if [ -n "$apid" ]; then
		kill -TERM "$apid" 2>/dev/null
	elif [ -n "$hpid" ]; then
		kill -TERM "$hpid" 2>/dev/null
	fi
}
trap on_signal TERM INT HUP

# wait_for PID: waits until PID has exited (a trapped signal interrupts
# 'wait'; a zombie still answers kill -0, so its status is not lost) and
# sets $status to its exit status.
wait_for() {
	while :; do
		wait "$1"
		status=$?
		kill -0 "$1" 2>/dev/null || return 0
	done
}

# hermesfs prints one line starting "ready " on stdout once the mount answers
# and is writable; its logs go to stderr, which stays the container's. Before
# that it may wait, as it says there: for the store's writer lease (the
# container this one replaces held it: a killed one's lapses within 25s) or
# for the store to answer, up to --lease-wait (HERMESFS_LEASE_WAIT, 5m),
# with the home shown read-only. That is no failure: the agent starts once
# the home is writable.
# shellcheck disable=SC2086
"$bin" mount ${HERMESFS_MOUNT_ARGS:-} "$mp" >"$out" &
hpid=$!
while ! grep -q '^ready ' "$out" 2>/dev/null; do
	if ! kill -0 "$hpid" 2>/dev/null || [ "$stopping" = 1 ]; then
		[ "$stopping" = 1 ] && kill -TERM "$hpid" 2>/dev/null
		wait_for "$hpid"
		echo "entrypoint: hermesfs exited with status $status before the mount was ready" >&2
		rm -rf "$tmp"
		exit "$status"
	fi
	sleep 0.1
done
grep '^ready ' "$out" >&2

# The agent runs in the background so this shell can take signals. Its
# working directory is the container's, never inside the mount by accident.
"$@" &
apid=$!
wait_for "$apid"
astatus=$status
if [ "$stopping" = 1 ]; then
	echo "entrypoint: agent stopped (status $astatus); stopping hermesfs" >&2
else
	echo "entrypoint: agent exited (status $astatus); stopping hermesfs" >&2
fi

apid=""
kill -TERM "$hpid" 2>/dev/null
wait_for "$hpid"
hstatus=$status
rm -rf "$tmp"
if [ "$hstatus" -ne 0 ]; then
	echo "entrypoint: hermesfs exited with status $hstatus: the final snapshot may not be in the store" >&2
	exit "$hstatus"
fi
exit "$astatus"
