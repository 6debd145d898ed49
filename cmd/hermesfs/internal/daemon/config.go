package daemon

import (
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/hermesfs/hermesfs/uploader"
	"github.com/hermesfs/hermesfs/uploader/image"
)

// Config is what one daemon is told: `hermesfs mount` fills it from its
// flags and environment (cmd/hermesfs/daemon_config.go, which also sets the
// defaults and validates it). Paths are absolute.
type Config struct {
	// Mountpoint is the absolute path of the directory to mount over.
	Mountpoint string

	// StateDir holds the lower archive cache, the upper layer, the control
	// socket and state.json; one per mountpoint. Empty means the default
	// (see DefaultStateDir). Env HERMESFS_STATE_DIR.
	StateDir string

	// Interval between periodic snapshots; 0 disables them (snapshots are
	// then taken only on demand and at shutdown). Env HERMESFS_INTERVAL.
	Interval time.Duration

	// WriteBack, if not 0, publishes a snapshot WriteBack after the first
	// change the store does not have (a burst of writes: one snapshot; a
	// steady stream: at most one per WriteBack), and retries a failed one
	// with the store's backoff. Interval still runs. Env HERMESFS_WRITE_BACK.
	WriteBack time.Duration

	// Retention is the policy the --keep-* flags make, applied after
	// every publish.
	Retention uploader.RetentionPolicy

	// ReadOnly mounts the newest snapshot read-only and never publishes.
	ReadOnly bool

	// LeaseWait bounds how long a writable mount waits to become
	// writable when it cannot take the store's writer lease at boot:
	// another host holds it (until that lease lapses or is released), or
	// the store does not answer. Meanwhile the mount shows what it safely
	// can, read-only (writes fail with EROFS), and says what it waits
	// for. 0 refuses at once (exit 4 for a held lease). Env
	// HERMESFS_LEASE_WAIT.
	LeaseWait time.Duration

	// LeaseTTL is the writer lease's life without renewal; 0 is
	// uploader.DefaultLeaseTTL. Tests shorten it (HERMESFS_TEST_LEASE_TTL).
	LeaseTTL time.Duration

	// OnConflict says what to do when the upper layer holds unpublished
	// changes but another host published since: "" (refuse), "keep-local"
	// or "discard-local".
	OnConflict string

	// StopTimeout bounds shutdown: final snapshot, upload and unmount.
	// systemd's TimeoutStopSec must be larger. Env HERMESFS_STOP_TIMEOUT.
	StopTimeout time.Duration

	// LogFormat is "text" or "json"; LogLevel is debug, info, warn or error.
	// Env HERMESFS_LOG_FORMAT, HERMESFS_LOG_LEVEL. Unused when
	// Options.Logger is set.
	LogFormat string
	LogLevel  string

	// MemoryLimit and UserLimit are the character limits of
	// memories/MEMORY.md and memories/USER.md when the home's config.yaml
	// does not set them.
	MemoryLimit int
	UserLimit   int

	// PassthroughWriteMax is the largest file opened for writing with
	// FUSE passthrough (root, Linux >= 6.9), or -1 for none (0: the
	// fs default). Each snapshot stops such files' writes for as long as
	// it takes to copy them (fs.Options.PassthroughWriteMax).
	PassthroughWriteMax int64

	// CopyUpMin is the smallest lower file copied up by range, -1 to copy
	// every file whole (0: the fs default; fs.Options.CopyUpByRangeMin).
	CopyUpMin int64

	// Debug logs every FUSE request.
	Debug bool

	// MetricsAddr, if set, is the HOST:PORT where Prometheus metrics are
	// served (/metrics). Env HERMESFS_METRICS_ADDR.
	MetricsAddr string
	// Standalone also stores each snapshot's image whole, as one object
	// standard tools read straight from the bucket (see
	// uploader.ImageInput.Standalone): at the storage cost of a whole
	// image per snapshot. Env HERMESFS_STANDALONE.
	Standalone bool
	// Lazy boots from a snapshot whose manifest has chunk digests without
	// downloading it first: ready after its metadata, data fetched as it
	// is read and filled in the background. Env HERMESFS_LAZY.
	Lazy bool
	// ReadTimeout bounds how long a lazy read retries a chunk the store
	// does not deliver before it fails with EIO. Env HERMESFS_READ_TIMEOUT.
	ReadTimeout time.Duration
	// Owner is the user a root daemon serves (--owner): the mount
	// root becomes theirs, with the mode of the directory it covers, and
	// every user of the host may use the mount under the kernel's
	// permission checks (allow_other, default_permissions). Nil: the
	// mount is the mounting user's alone.
	Owner *Owner

	// recoveryGrace replaces defaultRecoveryGrace (writeback.go) in tests.
	recoveryGrace time.Duration
	// Compact is when the last published image is compacted in the
	// background (daemon_compact.go); nil: image.DefaultCompactPolicy.
	Compact *image.CompactPolicy
}

// compactPolicy is when the last published image is compacted
// (daemon_compact.go).
func (c *Config) compactPolicy() image.CompactPolicy {
	if c.Compact != nil {
		return *c.Compact
	}
	return image.DefaultCompactPolicy()
}

// ParseLevel reads a log level: debug, info, warn or error.
func ParseLevel(s string) (slog.Level, error) {
	var l slog.Level
	if err := l.UnmarshalText([]byte(s)); err != nil {
		return 0, fmt.Errorf("%q: want debug, info, warn or error", s)
	}
	return l, nil
}

// newLogger builds the process logger: text or JSON to w at level.
func newLogger(w *os.File, format, level string) *slog.Logger {
	l, err := ParseLevel(level)
	if err != nil {
		l = slog.LevelInfo
	}
	opts := &slog.HandlerOptions{Level: l}
	if format == "json" {
		return slog.New(slog.NewJSONHandler(w, opts))
	}
	return slog.New(slog.NewTextHandler(w, opts))
}

// DefaultStateDir is the state directory for mountpoint when none is given:
// /var/lib/hermesfs/mounts/<escaped> for root (a level below the default
// store, /var/lib/hermesfs/store, so that a mountpoint named /store cannot
// meet it), $XDG_STATE_HOME/hermesfs/<escaped> (else
// ~/.local/state/hermesfs/<escaped>) for others.
func DefaultStateDir(mountpoint string, uid int, getenv func(string) string) (string, error) {
	name := escapePath(mountpoint)
	if uid == 0 {
		return filepath.Join("/var/lib/hermesfs", "mounts", name), nil
	}
	if x := getenv("XDG_STATE_HOME"); x != "" && filepath.IsAbs(x) {
		return filepath.Join(x, "hermesfs", name), nil
	}
	home := getenv("HOME")
	if home == "" {
		return "", fmt.Errorf("no state directory: HOME is not set (use --state-dir)")
	}
	return filepath.Join(home, ".local", "state", "hermesfs", name), nil
}

// RuntimeDir is where running mounts register themselves for `status`
// without arguments: $XDG_RUNTIME_DIR/hermesfs, else /run/hermesfs for root,
// else a per-user directory under the temp dir.
func RuntimeDir(uid int, getenv func(string) string) string {
	if x := getenv("HERMESFS_RUNTIME_DIR"); x != "" {
		return x
	}
	if x := getenv("XDG_RUNTIME_DIR"); x != "" && filepath.IsAbs(x) {
		return filepath.Join(x, "hermesfs")
	}
	if uid == 0 {
		return "/run/hermesfs"
	}
	return filepath.Join(os.TempDir(), "hermesfs-"+strconv.Itoa(uid))
}

// escapePath turns an absolute path into one file name, reversibly:
// "/home/u/.hermes" -> "home-u-%2Ehermes". Letters, digits, '_' and '.'
// (not leading a component) stay; '/' becomes '-'; every other byte %XX.
func escapePath(p string) string {
	p = strings.Trim(filepath.Clean(p), "/")
	if p == "" {
		return "-"
	}
	var b strings.Builder
	lead := true
	for i := 0; i < len(p); i++ {
		c := p[i]
		switch {
		case c == '/':
			b.WriteByte('-')
			lead = true
			continue
		case c >= 'a' && c <= 'z', c >= 'A' && c <= 'Z', c >= '0' && c <= '9', c == '_':
			b.WriteByte(c)
		case c == '.' && !lead:
			b.WriteByte(c)
		default:
			fmt.Fprintf(&b, "%%%02X", c)
		}
		lead = false
	}
	return b.String()
}
