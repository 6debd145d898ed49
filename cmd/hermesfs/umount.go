package main

import (
	"context"
	"errors"
	"flag"
	"fmt"

	"github.com/hermesfs/hermesfs/cmd/hermesfs/internal/daemon"
	"github.com/hermesfs/hermesfs/fs"
)

func init() {
	var stateDir string
	register(&command{
		name:    "umount",
		summary: "take a final snapshot, then unmount",
		usage:   "[--state-dir DIR] MOUNTPOINT",
		help: `
Asks the daemon of MOUNTPOINT to stop, exactly as SIGTERM does: final
snapshot and upload, unmount, exit. Waits for it and prints the final
snapshot id. The exit code is the daemon's: 0 all published, 5 the final
upload failed (the local changes are kept in the state dir and published by
the next 'hermesfs mount').

A read-only tree of 'hermesfs browse' is simply unmounted.

If no daemon answers but something is still mounted there (the daemon was
killed), the mount is detached and the message says so; local changes stay in
the state dir for the next mount.

Example:
  hermesfs umount ~/.hermes`,
		flags: func(fs *flag.FlagSet) {
			fs.StringVar(&stateDir, "state-dir", "", "state dir of the mount (env HERMESFS_STATE_DIR; default: the one its last mount used, as registered in the runtime dir, else the default state dir)")
		},
		run: func(ctx context.Context, e *env, _ *flag.FlagSet, args []string) error {
			if len(args) != 1 {
				return usageError("want one MOUNTPOINT")
			}
			if done, err := umountBrowse(e, args[0]); done {
				return err
			}
			loc, err := daemon.LocateDaemon(e.getenv, args[0], stateDir)
			if err != nil {
				return err
			}
			resp, err := daemon.ControlCall(ctx, loc.Socket, daemon.ControlRequest{Op: "shutdown"})
			if errors.Is(err, daemon.ErrNoDaemon) {
				if !fs.IsMountpoint(loc.Mountpoint) {
					return fmt.Errorf("%s: %w, and nothing is mounted there", loc.Mountpoint, err)
				}
				if err := fs.Detach(loc.Mountpoint); err != nil {
					return fmt.Errorf("%s: no daemon answers and detaching the stale mount failed: %w", loc.Mountpoint, err)
				}
				fmt.Fprintf(e.stdout, "no daemon answered; detached the stale mount at %s (local changes stay in %s for the next mount)\n", loc.Mountpoint, loc.StateDir)
				return nil
			}
			if err != nil {
				return err
			}
			r := resp.Shutdown
			if r == nil {
				return errors.New("empty answer from the daemon")
			}
			if r.FinalID != "" {
				fmt.Fprintln(e.stdout, r.FinalID)
			}
			if r.Code != exitOK {
				return withCode(r.Code, errors.New(r.Error))
			}
			return nil
		},
	})
}
