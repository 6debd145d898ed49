package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

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

The daemon is looked for through the registry of running mounts, --state-dir
(or HERMESFS_STATE_DIR) and the default state dir. If none answers and the
mount there is dead (the daemon was killed), it is detached and the message
says so; local changes stay in the state dir for the next mount. A mount that
still answers is never detached: umount says so and exits 1 (pass the
--state-dir of the daemon serving it).

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
			cands, err := daemon.LocateDaemons(e.getenv, args[0], stateDir)
			if err != nil {
				return err
			}
			var resp daemon.ControlResponse
			err = daemon.ErrNoDaemon
			for _, c := range cands {
				if resp, err = daemon.ControlCall(ctx, c.Socket, daemon.ControlRequest{Op: "shutdown"}); !errors.Is(err, daemon.ErrNoDaemon) {
					break
				}
			}
			if errors.Is(err, daemon.ErrNoDaemon) {
				return detachStale(e, cands, err)
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

// detachStale detaches the mount no daemon answered for (cands, all
// tried), if it is dead or hung: the mount of a killed daemon. A mount
// that answers is refused: its daemon may be alive where none of cands
// looked, and detaching would cut it off without its final snapshot.
func detachStale(e *env, cands []daemon.RegistryEntry, noDaemon error) error {
	mp := cands[0].Mountpoint
	if !fs.IsMountpoint(mp) {
		return fmt.Errorf("%s: %w, and nothing is mounted there", mp, noDaemon)
	}
	if daemon.ProbeFUSE(mp, 5*time.Second) == daemon.FUSELive {
		var dirs []string
		for _, c := range cands {
			dirs = append(dirs, c.StateDir)
		}
		fstype, source := daemon.MountedFS(mp)
		return fmt.Errorf("%s is a live mount (type %s, source %s), but no hermesfs daemon answers for it (state dirs tried: %s); "+
			"not detaching it, which would cut its daemon off without a final snapshot. "+
			"If hermesfs serves it from another state dir, pass --state-dir DIR; to detach it anyway: umount -l %s",
			mp, fstype, source, strings.Join(dirs, ", "), mp)
	}
	if err := fs.Detach(mp); err != nil {
		return fmt.Errorf("%s: no daemon answers and detaching the stale mount failed: %w", mp, err)
	}
	// The local changes are in the first of the state dirs tried that
	// holds a mount's state.
	where := cands[0].StateDir
	for _, c := range cands {
		if _, err := os.Stat(filepath.Join(c.StateDir, "state.json")); err == nil {
			where = c.StateDir
			break
		}
	}
	fmt.Fprintf(e.stdout, "no daemon answered; detached the stale mount at %s (local changes stay in %s for the next mount)\n", mp, where)
	return nil
}
