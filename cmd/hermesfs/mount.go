package main

import (
	"context"
	"flag"
	"fmt"

	"github.com/hermesfs/hermesfs/cmd/hermesfs/internal/daemon"
	"github.com/hermesfs/hermesfs/uploader"
)

func init() {
	var cfg *mountConfig
	def := newMountConfig()
	register(&command{
		name:    "mount",
		summary: "mount the home directory and keep it snapshotted to the store",
		usage:   "[flags] MOUNTPOINT",
		help: fmt.Sprintf(`
Mounts MOUNTPOINT (e.g. ~/.hermes): the newest snapshot archive in the store,
verified, is the read-only lower layer; a local upper layer in the state dir
takes every write, at local-disk speed. Every --interval, on 'hermesfs
snapshot' and at shutdown, the merged tree is frozen for an instant, packed
into one squashfs/zstd archive and uploaded; LATEST then names it. Nothing
changed: nothing is uploaded.

Write-back: with --write-back D, a snapshot also goes out D after the first
change the store does not have yet. A burst of writes makes one snapshot, a
steady stream at most one per D, and each uploads what changed since the last
one; nothing changed, nothing happens. A host that dies without a clean stop
(kill -9, an OOM kill, a reclaimed spot VM, a lost disk) then loses about the
last D plus one upload of changes, instead of up to --interval. While the
store is down the changes stay local, writes never wait for it, and
write-back retries with backoff (D, doubling, at most 30s). 'hermesfs status'
shows the age of the oldest change not in the store (the recovery point), and
warns once it passes D (--interval without write-back) plus 5 minutes.
--interval still runs, but no snapshot starts within D of another. Default
%[2]s; --write-back 0 turns it off (snapshots then go out every --interval,
on 'hermesfs snapshot' and at stop).

The first time, on an empty store, a non-empty MOUNTPOINT (your existing
~/.hermes) becomes the first snapshot before anything is mounted over it; the
original directory stays untouched underneath the mount.

Once the mount answers and is writable, one line starting "ready " is printed
on stdout and READY=1 is sent to systemd (NOTIFY_SOCKET); before that, the
systemd status line (STATUS=) says what the boot is doing. Runs in the
foreground unless --background is given.

Stopping: SIGTERM, SIGINT or 'hermesfs umount MOUNTPOINT' stop the daemon
without waiting for the agent. A snapshot in progress finishes; then the
final snapshot seals the mount: from its freeze on, every change is refused
(EROFS; EIO for files open for writing through passthrough), so it holds
exactly what writers were told succeeded and nothing written after it can be
lost. It is uploaded, the mount is detached, files still open on it get up
to a second to be closed (never past 1.5s after the signal; then ENOTCONN),
and the daemon exits: under two seconds with a quick upload, all within
--stop-timeout. Stop the agent first when you
can: its writes fail from the final snapshot on, as on a disk being
unmounted. While it stops, 'hermesfs status' says what it waits for and
until when, and the log says it every 5s. If the final upload fails or
--stop-timeout runs out, the local changes stay in the state dir, the exit
code is 5, and the next mount publishes them. A second SIGINT or SIGTERM
during the final snapshot (Ctrl-C twice) stops at once without it, also
with exit 5 and the local changes kept: in a container without a state
volume, let the first one finish.

After a crash or kill -9, the next mount with the same state dir mounts the
local changes again (nothing written before the crash is lost) and publishes
them at once; the dead mount the killed daemon left at MOUNTPOINT is
detached first, and a killed daemon that has not finished exiting (a zombie
whose thread waits on a FUSE request) is taken over on the first try: the
connections it waits on are aborted. A live FUSE mount at MOUNTPOINT
(another hermesfs, whatever its store) is never mounted over: exit 1, naming
its daemon. A snapshot that fails, even on a bug (a panic), keeps everything
local and the mount serving; the stop then exits 5.

One host writes a store prefix at a time (a lease in the store, renewed every
%[4]s, stale after %[5]s). A mount that finds the lease held by another host (a
killed host's lapses within %[5]s; a host that stops releases it), or the store
not answering, waits for it up to --lease-wait (default 5m) instead of giving
up: meanwhile it shows the home read-only (the newest snapshot, or what the
state dir holds while the store does not answer; writes fail with EROFS) and
says what it waits for on stderr, in 'hermesfs status' and on the systemd
status line. The moment the lease is its own it checks LATEST again, as any
boot does, and becomes writable (showing the newest snapshot first if it
moved meanwhile), then ready. A holder on this machine that is provably gone
(its state dir's lock free, or its process gone) is not waited for. After
--lease-wait: exit 4 (the lease still held) or 1 (the store still silent).
--lease-wait 0 refuses at once. --read-only mounts next to a live writer.

Defaults: --store a local directory under the data dir
(/var/lib/hermesfs/store for root, ~/.local/share/hermesfs/store otherwise);
--state-dir /var/lib/hermesfs/mounts/<mountpoint> for root,
$XDG_STATE_HOME/hermesfs/<mountpoint> (~/.local/state/...) otherwise;
--interval %[1]s; --write-back %[2]s; --stop-timeout %[3]s; retention (after
every publish, as 'hermesfs prune': see its help) %[6]s.

Environment: most flags have a HERMESFS_* variable, named in the flag's help
below (HERMESFS_STORE, HERMESFS_STATE_DIR, HERMESFS_WRITE_BACK...); a flag on
the command line wins. S3 also reads the AWS variables (AWS_ACCESS_KEY_ID,
AWS_SECRET_ACCESS_KEY, AWS_REGION, AWS_ENDPOINT_URL_S3).

Examples:
  hermesfs mount ~/.hermes
  hermesfs mount --store file:///srv/hermes-store ~/.hermes
  hermesfs mount --store s3://my-bucket/agents/alice ~/.hermes
  AWS_ENDPOINT_URL_S3=https://<account>.r2.cloudflarestorage.com AWS_REGION=auto \
    hermesfs mount --store s3://my-bucket/alice --interval 5m ~/.hermes
  hermesfs mount --write-back 10s ~/.hermes          # a change is in the store 10s after it is made
  hermesfs mount --background ~/.hermes && hermes   # boot scripts
  hermesfs mount --encrypt-to age1... --identity ~/.config/hermesfs/key.txt ~/.hermes
                                                    # encrypted snapshots (see hermesfs keygen)

Exit codes:
  0  stopped cleanly: the final snapshot, with every write a writer was
     told succeeded, is in the store
  1  failed (the message says why)
  2  bad command line
  3  a snapshot failed verification and no older one verifies
  4  conflict: another host still holds the store after --lease-wait, or
     published over our unpublished changes (see --on-conflict)
  5  stopped, but the store lacks local changes: the final snapshot did
     not reach it (upload failed, --stop-timeout, a second signal), or
     stores into a shared mapping (mmap) went on after it; local changes
     kept in the state dir for the next mount
  6  the snapshot to mount is encrypted and no --identity opens it, or
     LATEST is encrypted and --encrypt-to is missing (see --allow-plaintext);
     nothing mounted

Signals: SIGTERM and SIGINT stop (final snapshot, which seals the mount); a
second one during the final snapshot stops at once without it (exit 5),
later ones are only acknowledged. Under systemd use Type=notify,
KillMode=mixed and TimeoutStopSec larger than --stop-timeout (see
scripts/hermesfs.service).

`, shortDuration(def.Interval), shortDuration(def.WriteBack), shortDuration(def.StopTimeout),
			shortDuration(uploader.DefaultLeaseHeartbeat), shortDuration(uploader.DefaultLeaseTTL),
			uploader.DefaultRetention().String()) + storeHelp,
		flags: func(fs *flag.FlagSet) {
			cfg = newMountConfig()
			cfg.addFlags(fs)
		},
		run: func(ctx context.Context, e *env, fs *flag.FlagSet, args []string) error {
			if len(args) != 1 {
				return usageError("want one MOUNTPOINT")
			}
			if err := applyEnv(fs, e.getenv); err != nil {
				return err
			}
			cfg.Mountpoint = args[0]
			if err := cfg.validate(); err != nil {
				return err
			}
			if err := cfg.testKnobs(e.getenv); err != nil {
				return err
			}
			if cfg.Background {
				// The daemon refuses these too, but only after the log
				// file is made in the state dir.
				if err := checkStoreFlags(e, fs); err != nil {
					return err
				}
				return runBackground(ctx, e, cfg, fs)
			}
			return daemon.Run(ctx, cfg.Config, cfg.daemonOptions(e))
		},
	})
}
