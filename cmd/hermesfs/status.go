package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/hermesfs/hermesfs/fs"
	"github.com/hermesfs/hermesfs/uploader/lazy"
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
snapshot (files, bytes), the last snapshot (id, time, size, duration, bytes
uploaded), when the next one is due, the last error, the lease and recent
memory-hook rejections. Without MOUNTPOINT, every running mount is shown.

When no daemon runs for MOUNTPOINT, status says so and shows what its state
dir records (for instance local changes that were never published).

Exit codes: 0 running, 1 not running (or an error), 2 bad command line.

Examples:
  hermesfs status ~/.hermes
  hermesfs status --json ~/.hermes | jq .last_snapshot.id
  hermesfs status`,
		flags: func(fs *flag.FlagSet) {
			fs.BoolVar(&asJSON, "json", false, "print JSON")
			fs.StringVar(&stateDir, "state-dir", "", "state dir of the mount, if not the default (env HERMESFS_STATE_DIR)")
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

// statusReport is what `status` shows; the daemon fills it.
type statusReport struct {
	Mountpoint string `json:"mountpoint"`
	Running    bool   `json:"running"`
	PID        int    `json:"pid,omitempty"`
	Store      string `json:"store"`
	StateDir   string `json:"state_dir"`
	Host       string `json:"host,omitempty"`
	ReadOnly   bool   `json:"read_only,omitempty"`
	// Base is the snapshot the lower layer is; LastPublished the newest
	// snapshot published from this mount.
	Base          string `json:"base,omitempty"`
	LastPublished string `json:"last_published,omitempty"`
	// Unpublished: the upper layer holds changes no published snapshot has.
	Unpublished bool            `json:"unpublished"`
	DirtyFiles  int             `json:"dirty_files"`
	DirtyBytes  int64           `json:"dirty_bytes"`
	Generation  uint64          `json:"generation"`
	Snapshots   int             `json:"snapshots"` // published by this daemon
	Last        *snapshotRecord `json:"last_snapshot,omitempty"`
	NextDue     time.Time       `json:"next_due,omitzero"`
	InProgress  bool            `json:"snapshot_in_progress,omitempty"`
	LastError   string          `json:"last_error,omitempty"`
	LastErrorAt time.Time       `json:"last_error_at,omitzero"`
	// Lease: "held", "lost" (another host took it over: publishing
	// stopped), "none" (read-only) or "released".
	Lease string `json:"lease"`
	// Encryption is how this mount encrypts new snapshots; absent when it
	// publishes plaintext. Never key material.
	Encryption *encryptionInfo `json:"encryption,omitempty"`
	Rejections []auditRecord   `json:"memory_rejections,omitempty"`
	Started    time.Time       `json:"started,omitzero"`
	// Lazy is the fill of a base read lazily; absent otherwise.
	Lazy *lazy.Stats `json:"lazy,omitempty"`
	// MemoryLimits are the limits in force ("memory", "user");
	// MemoryConfigProblems say why config.yaml does not set them as it
	// means to (memory_status.go).
	MemoryLimits         map[string]int `json:"memory_limits,omitempty"`
	MemoryConfigProblems []string       `json:"memory_config_problems,omitempty"`

	// PartialCopyUps are files copied up by range whose background copy
	// has not finished.
	PartialCopyUps []fs.PartialCopyUp `json:"partial_copy_ups,omitempty"`
}

// snapshotFigures are the measurements of one snapshot, logged and shown.
type snapshotFigures struct {
	Files         int64         `json:"files"`
	BytesPacked   int64         `json:"bytes_packed"` // file data read into the archive
	Size          int64         `json:"size"`         // archive size
	BytesReused   int64         `json:"bytes_reused"` // compressed bytes copied from the base archive
	BytesUploaded int64         `json:"bytes_uploaded"`
	FreezeStall   time.Duration `json:"freeze_stall_ns"`
	PackTime      time.Duration `json:"pack_ns"`
	UploadTime    time.Duration `json:"upload_ns"`
	Duration      time.Duration `json:"duration_ns"`
}

// snapshotRecord is the last snapshot published.
type snapshotRecord struct {
	ID   string    `json:"id"`
	Time time.Time `json:"time"`
	snapshotFigures
}

// auditRecord is one memory-hook verdict as status shows it.
type auditRecord struct {
	Time    time.Time `json:"time"`
	File    string    `json:"file"`
	Verdict string    `json:"verdict"`
	Reason  string    `json:"reason"`
}

func statusOne(ctx context.Context, e *env, mountpoint, stateDir string, asJSON bool) error {
	loc, err := locateDaemon(e, mountpoint, stateDir)
	if err != nil {
		return err
	}
	resp, err := controlCall(ctx, loc.Socket, controlRequest{Op: "status"})
	if err == nil && resp.Status != nil {
		return printStatus(e.stdout, []statusReport{*resp.Status}, asJSON)
	}
	if !errors.Is(err, errNoDaemon) {
		if err == nil {
			err = errors.New("empty answer")
		}
		return err
	}
	st, serr := readState(loc.StateDir)
	r := statusReport{Mountpoint: loc.Mountpoint, StateDir: loc.StateDir, Lease: "none"}
	if serr == nil {
		r.Store, r.Host, r.Base, r.LastPublished, r.Unpublished = st.Store, st.Host, st.Base, st.LastPublished, st.Unpublished
		if !st.PublishedAt.IsZero() {
			r.Last = &snapshotRecord{ID: st.LastPublished, Time: st.PublishedAt}
		}
	}
	if changed, err := upperHasChanges(loc.StateDir + "/upper"); err == nil && changed {
		r.Unpublished = r.Unpublished || !st.CleanShutdown
	}
	printStatus(e.stdout, []statusReport{r}, asJSON)
	msg := "not running"
	if isMountpoint(loc.Mountpoint) {
		msg += " (but something is mounted there: a killed daemon? 'hermesfs umount' detaches it)"
	}
	if r.Unpublished {
		msg += "; the state dir holds local changes not yet published: the next 'hermesfs mount' publishes them"
	}
	return withCode(exitFailure, errors.New(msg))
}

func statusAll(ctx context.Context, e *env, asJSON bool) error {
	entries, err := listRegistry(runtimeDir(os.Getuid(), e.getenv))
	if err != nil {
		return err
	}
	var reports []statusReport
	for _, en := range entries {
		resp, err := controlCall(ctx, en.Socket, controlRequest{Op: "status"})
		if err != nil || resp.Status == nil {
			continue // stale entry
		}
		reports = append(reports, *resp.Status)
	}
	if len(reports) == 0 && !asJSON {
		fmt.Fprintln(e.stdout, "no hermesfs mounts are running")
		return nil
	}
	return printStatus(e.stdout, reports, asJSON)
}

func printStatus(w io.Writer, rs []statusReport, asJSON bool) error {
	if asJSON {
		enc := json.NewEncoder(w)
		enc.SetIndent("", "  ")
		if len(rs) == 1 {
			return enc.Encode(rs[0])
		}
		if rs == nil {
			rs = []statusReport{}
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
		}
		row("mountpoint", "%s", r.Mountpoint)
		row("state", "%s", state)
		row("store", "%s", r.Store)
		row("state dir", "%s", r.StateDir)
		row("base snapshot", "%s", orNone(r.Base))
		if l := r.Lazy; l != nil {
			row("lazy fill", "%s", lazyLine(l))
		}
		if r.Running {
			row("changed", "%s", changedLine(r))
		}
		if r.Unpublished {
			row("unpublished", "yes: local changes not yet in any snapshot")
		}
		if r.Last != nil {
			row("last snapshot", "%s", lastSnapshotLine(r.Last))
		} else {
			row("last snapshot", "none yet")
		}
		if r.InProgress {
			row("next snapshot", "in progress")
		} else if !r.NextDue.IsZero() {
			row("next snapshot", "due %s (in %s)", r.NextDue.Local().Format(time.TimeOnly), time.Until(r.NextDue).Round(time.Second))
		}
		if r.LastError != "" {
			row("last error", "%s (%s)", r.LastError, r.LastErrorAt.Local().Format(time.DateTime))
		}
		row("lease", "%s", r.Lease)
		if r.Encryption != nil {
			row("encryption", "%s, to %s recipients", r.Encryption.Scheme, strings.Join(r.Encryption.RecipientTypes, ", "))
		}
		printMemoryStatus(row, r)
		printPartials(row, r.PartialCopyUps)
		for _, a := range r.Rejections {
			row("memory rejected", "%s %s: %s", a.Time.Local().Format(time.DateTime), a.File, a.Reason)
		}
		tw.Flush()
	}
	return nil
}

func orNone(s string) string {
	if s == "" {
		return "none (empty)"
	}
	return s
}

func humanBytes(n int64) string {
	const unit = 1024
	if n < unit {
		return fmt.Sprintf("%d B", n)
	}
	div, exp := int64(unit), 0
	for m := n / unit; m >= unit; m /= unit {
		div *= unit
		exp++
	}
	return fmt.Sprintf("%.1f %ciB", float64(n)/float64(div), "KMGTPE"[exp])
}

// redactURL drops credentials from a store URL for logs and state.json:
// user info and query parameters that look like secrets.
func redactURL(s string) string {
	if i := strings.Index(s, "://"); i >= 0 {
		rest := s[i+3:]
		if at := strings.IndexByte(rest, '@'); at >= 0 && (strings.IndexByte(rest, '/') < 0 || at < strings.IndexByte(rest, '/')) {
			s = s[:i+3] + "REDACTED@" + rest[at+1:]
		}
	}
	q := strings.IndexByte(s, '?')
	if q < 0 {
		return s
	}
	parts := strings.Split(s[q+1:], "&")
	for i, p := range parts {
		k, _, _ := strings.Cut(p, "=")
		lk := strings.ToLower(k)
		if strings.Contains(lk, "secret") || strings.Contains(lk, "key") || strings.Contains(lk, "token") || strings.Contains(lk, "password") || strings.Contains(lk, "credential") {
			parts[i] = k + "=REDACTED"
		}
	}
	return s[:q+1] + strings.Join(parts, "&")
}
