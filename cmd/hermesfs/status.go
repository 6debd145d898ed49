package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/hermesfs/hermesfs/cmd/hermesfs/internal/daemon"
	"github.com/hermesfs/hermesfs/fs"
)

func init() {
	var (
		asJSON   bool
		stateDir string
	)
	register(&command{
		name:    "status",
		summary: "show a mount's state: base snapshot, dirty data, last snapshot, errors",
		usage:   "[--json] [--state-dir DIR] [MOUNTPOINT]",
		help: `
Asks the running daemon of MOUNTPOINT (through the control socket in its state
dir) for: the store, the base snapshot, what changed since the last published
snapshot (files, bytes), how old the oldest change not in the store is (what
a host lost now would lose: the recovery point, with a WARNING once it is past
its bound), the write-back delay, the last snapshot (id, time, size,
duration, bytes uploaded), when the next one is due, the last error, the
lease and recent memory-hook rejections. Without MOUNTPOINT, every running mount is shown.

When no daemon runs for MOUNTPOINT, status says so and shows what its state
dir records (for instance local changes that were never published): the
state dir its last mount used (the registry in the runtime dir remembers it
until a reboot), else the default one. When neither holds any state, status
says so: pass the --state-dir the mount was made with.

A daemon that is not ready yet (a first mount packing and uploading a big
home) is shown as starting, with what it does. A live mount whose daemon
runs as another user (root, with --owner) is shown as running, with its pid
and user and what to run to see the rest: its state is that user's alone.

Exit codes: 0 running, 1 not running (or an error), 2 bad command line.

Examples:
  hermesfs status ~/.hermes
  hermesfs status --json ~/.hermes | jq .last_snapshot.id
  hermesfs status`,
		flags: func(fs *flag.FlagSet) {
			fs.BoolVar(&asJSON, "json", false, "print JSON")
			fs.StringVar(&stateDir, "state-dir", "", "state dir of the mount (env HERMESFS_STATE_DIR; default: the one its last mount used, as registered in the runtime dir, else the default state dir)")
		},
		run: func(ctx context.Context, e *env, fs *flag.FlagSet, args []string) error {
			switch len(args) {
			case 0:
				return statusAll(ctx, e, asJSON)
			case 1:
				return statusOne(ctx, e, args[0], stateDir, asJSON)
			}
			return usageError("at most one MOUNTPOINT")
		},
	})
}

func statusOne(ctx context.Context, e *env, mountpoint, stateDir string, asJSON bool) error {
	loc, err := daemon.LocateDaemon(e.getenv, mountpoint, stateDir)
	if err != nil {
		return err
	}
	resp, err := daemon.ControlCall(ctx, loc.Socket, daemon.ControlRequest{Op: "status"})
	if err == nil && resp.Status != nil {
		return printStatus(e.stdout, []daemon.StatusReport{*resp.Status}, asJSON)
	}
	if errors.Is(err, daemon.ErrNoDaemon) || errors.Is(err, os.ErrPermission) {
		// Not ours to read: a daemon of another user (root, with
		// --owner) may serve the mount.
		if others := daemon.OtherUserMounts(loc.Mountpoint, true); len(others) > 0 {
			return printStatus(e.stdout, []daemon.StatusReport{otherUserReport(others[0])}, asJSON)
		}
	}
	if !errors.Is(err, daemon.ErrNoDaemon) {
		if err == nil {
			err = errors.New("empty answer")
		}
		return err
	}
	if r, ok := daemon.BootingReport(loc.Mountpoint, loc.StateDir); ok {
		// Not ready yet: its control socket answers once it is.
		return printStatus(e.stdout, []daemon.StatusReport{r}, asJSON)
	}
	if !stateKnown(loc.StateDir) {
		return noStateKnown(loc)
	}
	st, serr := daemon.ReadState(loc.StateDir)
	r := daemon.StatusReport{Mountpoint: loc.Mountpoint, StateDir: loc.StateDir, Lease: "none"}
	if serr == nil {
		r.Store, r.Host, r.Base, r.LastPublished, r.Unpublished = st.Store, st.Host, st.Base, st.LastPublished, st.Unpublished
		if !st.PublishedAt.IsZero() {
			r.Last = &daemon.SnapshotRecord{ID: st.LastPublished, Time: st.PublishedAt}
		}
	}
	if changed, err := fs.UpperHasChanges(loc.StateDir + "/upper"); err == nil && changed {
		r.Unpublished = r.Unpublished || !st.CleanShutdown
	}
	printStatus(e.stdout, []daemon.StatusReport{r}, asJSON)
	msg := "not running"
	if fs.IsMountpoint(loc.Mountpoint) {
		msg += " (but something is mounted there: a killed daemon? 'hermesfs umount' detaches it)"
	}
	if r.Unpublished {
		msg += "; the state dir holds local changes not yet published: the next 'hermesfs mount' publishes them"
	}
	return withCode(exitFailure, errors.New(msg))
}

// stateKnown reports whether dir holds a mount's state: its state.json,
// or local changes.
func stateKnown(dir string) bool {
	if _, err := os.Stat(filepath.Join(dir, "state.json")); err == nil {
		return true
	}
	changed, err := fs.UpperHasChanges(filepath.Join(dir, "upper"))
	return err == nil && changed
}

// noStateKnown is status' answer for a mountpoint whose state dir holds
// nothing: not a mount that never published, but a state dir status cannot
// find, and what to do about it.
func noStateKnown(loc daemon.RegistryEntry) error {
	var msg string
	switch loc.From {
	case daemon.FromDefault:
		msg = fmt.Sprintf("not running, and no state is known for %s: no mount of it is registered (in this boot) and its default state dir %s holds none; if it was mounted with --state-dir (or HERMESFS_STATE_DIR), pass the same --state-dir", loc.Mountpoint, loc.StateDir)
	case daemon.FromRegistry:
		msg = fmt.Sprintf("not running, and no state is known for %s: its last mount used the state dir %s, which holds none now (removed?)", loc.Mountpoint, loc.StateDir)
	default:
		msg = fmt.Sprintf("not running, and no state is known for %s in %s (given by %s): it was never mounted with that state dir, or the state dir was emptied", loc.Mountpoint, loc.StateDir, loc.From)
	}
	if fs.IsMountpoint(loc.Mountpoint) {
		msg += "; something is mounted there (a killed daemon? 'hermesfs umount' detaches it)"
	}
	return withCode(exitFailure, errors.New(msg))
}

func statusAll(ctx context.Context, e *env, asJSON bool) error {
	entries, err := daemon.ListRegistry(daemon.RuntimeDir(os.Getuid(), e.getenv))
	if err != nil {
		return err
	}
	var reports []daemon.StatusReport
	for _, en := range entries {
		resp, err := daemon.ControlCall(ctx, en.Socket, daemon.ControlRequest{Op: "status"})
		if err != nil || resp.Status == nil {
			continue // stale entry
		}
		reports = append(reports, *resp.Status)
	}
	if os.Getuid() != 0 {
		// Mounts of daemons of other users (root, with --owner), whose
		// registry this user cannot read.
		known := map[string]bool{}
		for _, r := range reports {
			known[r.Mountpoint] = true
		}
		for _, o := range daemon.OtherUserMounts("/", false) {
			if !known[o.Mountpoint] {
				reports = append(reports, otherUserReport(o))
			}
		}
	}
	if len(reports) == 0 && !asJSON {
		fmt.Fprintln(e.stdout, "no hermesfs mounts are running")
		return nil
	}
	return printStatus(e.stdout, reports, asJSON)
}

// otherUserReport is what status can say of a mount whose daemon runs as
// another user: that it runs, as whom, and how to see the rest.
func otherUserReport(o daemon.OtherUserDaemon) daemon.StatusReport {
	sudo := "sudo "
	if o.UID != 0 {
		sudo = "as " + o.User + ": "
	}
	return daemon.StatusReport{
		Mountpoint: o.Mountpoint, Running: true, PID: o.PID, RunsAs: o.User,
		Restricted: fmt.Sprintf("its state dir and control socket are readable by %s only: run '%shermesfs status %s'", o.User, sudo, o.Mountpoint),
	}
}

func printStatus(w io.Writer, rs []daemon.StatusReport, asJSON bool) error {
	if asJSON {
		enc := json.NewEncoder(w)
		enc.SetIndent("", "  ")
		if len(rs) == 1 {
			return enc.Encode(rs[0])
		}
		if rs == nil {
			rs = []daemon.StatusReport{}
		}
		return enc.Encode(rs)
	}
	for i, r := range rs {
		if i > 0 {
			fmt.Fprintln(w)
		}
		tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
		row := func(k, f string, a ...any) { fmt.Fprintf(tw, "%s:\t"+f+"\n", append([]any{k}, a...)...) }
		state := "not running"
		if r.Running {
			state = fmt.Sprintf("running (pid %d, since %s)", r.PID, r.Started.Local().Format(time.DateTime))
			if r.ReadOnly {
				state += ", read-only"
			}
			if r.Waiting != nil {
				state += ", not writable yet"
			}
			if r.Stopping != "" {
				state = fmt.Sprintf("stopping (pid %d): %s; gives up at %s", r.PID, r.Stopping, r.StopDeadline.Local().Format(time.TimeOnly))
			}
		}
		if r.Boot != "" {
			row("mountpoint", "%s", r.Mountpoint)
			row("state", "starting, not ready yet (pid %d, since %s)", r.PID, r.Started.Local().Format(time.DateTime))
			row("state dir", "%s", r.StateDir)
			row("doing", "%s", r.Boot)
			tw.Flush()
			continue
		}
		if r.Restricted != "" {
			state = "running (as " + r.RunsAs + ")"
			if r.PID > 0 {
				state = fmt.Sprintf("running (pid %d, as %s)", r.PID, r.RunsAs)
			}
			row("mountpoint", "%s", r.Mountpoint)
			row("state", "%s", state)
			row("details", "%s", r.Restricted)
			tw.Flush()
			continue
		}
		row("mountpoint", "%s", r.Mountpoint)
		row("state", "%s", state)
		row("store", "%s", r.Store)
		row("state dir", "%s", r.StateDir)
		if r.Waiting != nil {
			row("waiting", "%s (since %s)", r.Waiting.Describe(), r.Waiting.Since.Local().Format(time.TimeOnly))
			row("lease", "%s", r.Lease)
			tw.Flush()
			continue
		}
		row("base snapshot", "%s", daemon.OrNone(r.Base))
		if l := r.Lazy; l != nil {
			row("lazy fill", "%s", daemon.LazyLine(l))
		}
		if r.Running {
			row("changed", "%s", changedLine(r))
		}
		if r.Unpublished {
			row("unpublished", "%s", unpublishedLine(r))
		}
		if r.Running && !r.ReadOnly {
			row("write-back", "%s", writeBackLine(r))
		}
		if r.Last != nil {
			row("last snapshot", "%s", lastSnapshotLine(r.Last))
		} else {
			row("last snapshot", "none yet")
		}
		if r.InProgress {
			row("next snapshot", "in progress")
		} else if !r.NextDue.IsZero() {
			row("next snapshot", "due %s (in %s)", clockTime(r.NextDue, time.Now()), time.Until(r.NextDue).Round(time.Second))
		}
		if r.LastError != "" {
			when := r.LastErrorAt.Local().Format(time.DateTime)
			if !r.LastErrorOver.IsZero() {
				when += fmt.Sprintf("; over since %s: %s", r.LastErrorOver.Local().Format(time.DateTime), r.LastErrorOverBy)
			}
			row("last error", "%s (%s)", r.LastError, when)
		}
		row("lease", "%s", r.Lease)
		if r.Encryption != nil {
			row("encryption", "%s, to %s recipients", r.Encryption.Scheme, strings.Join(r.Encryption.RecipientTypes, ", "))
		}
		printMemoryStatus(row, r)
		printPartials(row, r.PartialCopyUps)
		printAdopted(row, r.Adopted)
		printCompaction(row, r.Compaction)
		for _, a := range r.Rejections {
			row("memory rejected", "%s %s: %s", a.Time.Local().Format(time.DateTime), a.File, a.Reason)
		}
		tw.Flush()
	}
	return nil
}
