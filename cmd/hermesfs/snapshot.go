package main

import (
	"context"
	"errors"
	"flag"
	"fmt"

	"github.com/hermesfs/hermesfs/cmd/hermesfs/internal/daemon"
)

func init() {
	var stateDir string
	register(&command{
		name:    "snapshot",
		summary: "take a snapshot of a running mount now and print its id",
		usage:   "[--state-dir DIR] MOUNTPOINT",
		help: `
Asks the daemon of MOUNTPOINT to snapshot now, as its timer would: freeze,
pack the merged tree, upload, publish. Prints the new snapshot id once it is
published. When nothing changed since the last published snapshot nothing is
uploaded, and that snapshot's id is printed with "(unchanged)".

Exit codes: 0 published (or unchanged), 1 failed (the local state is kept and
the daemon retries at its next tick), 4 another host took the store over.

Example:
  hermesfs snapshot ~/.hermes`,
		flags: func(fs *flag.FlagSet) {
			fs.StringVar(&stateDir, "state-dir", "", "state dir of the mount (env HERMESFS_STATE_DIR; default: the one its last mount used, as registered in the runtime dir, else the default state dir)")
		},
		run: func(ctx context.Context, e *env, fs *flag.FlagSet, args []string) error {
			if len(args) != 1 {
				return usageError("want one MOUNTPOINT")
			}
			loc, err := daemon.LocateDaemon(e.getenv, args[0], stateDir)
			if err != nil {
				return err
			}
			resp, err := daemon.ControlCall(ctx, loc.Socket, daemon.ControlRequest{Op: "snapshot"})
			if errors.Is(err, daemon.ErrNoDaemon) {
				return fmt.Errorf("%s: %w", loc.Mountpoint, err)
			}
			if err != nil {
				return err
			}
			if resp.Snapshot == nil {
				return errors.New("empty answer from the daemon")
			}
			if resp.Snapshot.Unchanged {
				fmt.Fprintf(e.stdout, "%s (unchanged)\n", daemon.OrNone(resp.Snapshot.ID))
				return nil
			}
			fmt.Fprintln(e.stdout, resp.Snapshot.ID)
			return nil
		},
	})
}
