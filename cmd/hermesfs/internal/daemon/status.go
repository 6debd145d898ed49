package daemon

import (
	"context"
	"fmt"
	"log/slog"
	"strings"
	"time"

	"github.com/hermesfs/hermesfs/fs"
	"github.com/hermesfs/hermesfs/fs/memguard"
	"github.com/hermesfs/hermesfs/uploader/lazy"
)

// statusReport is what `status` shows; the daemon fills it.
type statusReport struct {
	Mountpoint string `json:"mountpoint"`
	Running    bool   `json:"running"`
	PID        int    `json:"pid,omitempty"`
	// Stopping is what a daemon that is stopping does now (empty while
	// it serves); StopDeadline is when it gives up (--stop-timeout).
	Stopping     string    `json:"stopping,omitempty"`
	StopDeadline time.Time `json:"stop_deadline,omitzero"`
	Store        string    `json:"store"`
	StateDir     string    `json:"state_dir"`
	Host         string    `json:"host,omitempty"`
	ReadOnly     bool      `json:"read_only,omitempty"`
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
	// LastErrorOver is when the condition of the last error ended (a
	// snapshot published after a store outage), LastErrorOverBy how;
	// zero while it may still hold.
	LastErrorOver   time.Time `json:"last_error_over_at,omitzero"`
	LastErrorOverBy string    `json:"last_error_over_by,omitempty"`

	// WriteBack is --write-back (0: off).
	WriteBack time.Duration `json:"write_back_ns,omitempty"`
	// UnpublishedSince is when the oldest change not in the store was made
	// (zero: the store has everything), UnpublishedAge how long ago: what a
	// host lost now would lose. RecoveryPointBound is the age past which
	// RecoveryPointWarning says that something holds the changes back.
	UnpublishedSince     time.Time     `json:"unpublished_since,omitzero"`
	UnpublishedAge       time.Duration `json:"unpublished_age_ns,omitempty"`
	RecoveryPointBound   time.Duration `json:"recovery_point_bound_ns,omitempty"`
	RecoveryPointWarning string        `json:"recovery_point_warning,omitempty"`

	// Lease: "held", "lost" (another host took it over: publishing
	// stopped), "lapsed" (the store did not answer its renewals: taken
	// again when it does), "waiting" (at boot: see Waiting), "none"
	// (read-only) or "released".
	Lease string `json:"lease"`
	// Waiting is what a mount that is not writable yet waits for: the
	// writer lease another holder has, or the store (leasewait.go).
	Waiting *waitReport `json:"waiting,omitempty"`
	// Encryption is how this mount encrypts new snapshots; absent when it
	// publishes plaintext. Never key material.
	Encryption *encryptionInfo `json:"encryption,omitempty"`
	Rejections []auditRecord   `json:"memory_rejections,omitempty"`
	Started    time.Time       `json:"started,omitzero"`
	// Lazy is the fill of a base read lazily; absent otherwise.
	Lazy *lazy.Stats `json:"lazy,omitempty"`
	// MemoryLimits are the limits in force ("memory", "user");
	// MemoryConfigProblems say why config.yaml does not set them as it
	// means to (memoryStatus).
	MemoryLimits         map[string]int `json:"memory_limits,omitempty"`
	MemoryConfigProblems []string       `json:"memory_config_problems,omitempty"`

	// PartialCopyUps are files copied up by range whose background copy
	// has not finished.
	PartialCopyUps []fs.PartialCopyUp `json:"partial_copy_ups,omitempty"`

	// Boot is what a daemon that is not ready yet does (BootingReport:
	// read from boot.json by `status`, never from the control socket).
	Boot string `json:"boot,omitempty"`

	// Restricted is set by `status` (never by the daemon) for a mount whose
	// daemon runs as another user, whose state it cannot read: why the
	// rest of the report is missing, and what to run instead.
	Restricted string `json:"restricted,omitempty"`
	// RunsAs is that daemon's user.
	RunsAs string `json:"runs_as,omitempty"`

	// Adopted is what this mount took in at boot from the mountpoint
	// directory: files written there while no mount covered it.
	Adopted []fs.Adopted `json:"adopted_underneath,omitempty"`

	// Compaction is the background compaction of the last published
	// image (daemon_compact.go); absent on a read-only mount.
	Compaction *compactionStatus `json:"compaction,omitempty"`
}

// compactionStatus is the "compaction" part of status.
type compactionStatus struct {
	Running bool              `json:"running"`
	Policy  string            `json:"policy"`
	Done    int               `json:"done"`
	Failed  int               `json:"failed,omitempty"`
	Last    *compactionRecord `json:"last,omitempty"`
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

func OrNone(s string) string {
	if s == "" {
		return "none (empty)"
	}
	return s
}

func HumanBytes(n int64) string {
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

// memoryReporter is the overlay's view of the memory hook for status.
type memoryReporter interface {
	MemoryLimits() map[string]int
	MemoryConfigProblems() []string
}

func (m *mountAdapter) MemoryLimits() map[string]int {
	out := map[string]int{}
	for k, v := range m.guard.Limits(context.Background()) {
		out[string(k)] = v
	}
	return out
}

func (m *mountAdapter) MemoryConfigProblems() []string { return m.guard.ConfigProblems() }

// memoryStatus fills in the memory hook's limits and config problems.
func (d *daemon) memoryStatus(r *statusReport) {
	if mr, ok := d.ov.(memoryReporter); ok {
		r.MemoryLimits = mr.MemoryLimits()
		r.MemoryConfigProblems = mr.MemoryConfigProblems()
	}
}

// warnMemoryConfig says at startup, as an error, what in config.yaml's
// memory limits needs fixing (memguard.Guard.ConfigProblems): the limits in
// force are what Hermes Agent makes of the file, which may not be what its
// author meant.
func warnMemoryConfig(log *slog.Logger, g *memguard.Guard) {
	problems := g.ConfigProblems()
	if len(problems) == 0 {
		return
	}
	lim := g.Limits(context.Background())
	log.Error("config.yaml's memory limits need fixing: hermesfs enforces what Hermes Agent makes of them, which may not be what was meant (fix config.yaml; `hermesfs status` shows this until then)",
		"problems", strings.Join(problems, "; "), "memory_limit", lim[memguard.KindMemory], "user_limit", lim[memguard.KindUser])
}

// recoveredNote ends the ready line when the mount shows local changes a
// crash or a failed upload left over its base snapshot.
func recoveredNote(pending bool) string {
	if !pending {
		return ""
	}
	return " local=recovered (unpublished changes over that snapshot; publishing them now)"
}
