package main

import (
	"flag"
	"fmt"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/hermesfs/hermesfs/fs"
	"github.com/hermesfs/hermesfs/uploader"
)

// mountConfig is everything `hermesfs mount` can be told. Flags map onto its
// fields one to one, and HERMESFS_* environment variables onto the flags (a
// flag given on the command line wins over the variable). Defaults are set in
// newMountConfig and nowhere else.
type mountConfig struct {
	// Mountpoint is the absolute path of the directory to mount over.
	Mountpoint string

	// StateDir holds the lower archive cache, the upper layer, the control
	// socket and state.json; one per mountpoint. Empty means the default
	// (see defaultStateDir). Env HERMESFS_STATE_DIR.
	StateDir string

	// Interval between periodic snapshots; 0 disables them (snapshots are
	// then taken only on demand and at shutdown). Env HERMESFS_INTERVAL.
	Interval time.Duration

	// Keep is --keep, the same as --keep-last. Env HERMESFS_KEEP.
	Keep int
	// Retention is the policy the --keep-* flags make (see retention.go),
	// resolved by validate.
	Retention uploader.RetentionPolicy

	// ReadOnly mounts the newest snapshot read-only and never publishes.
	ReadOnly bool

	// OnConflict says what to do when the upper layer holds unpublished
	// changes but another host published since: "" (refuse), "keep-local"
	// or "discard-local".
	OnConflict string

	// StopTimeout bounds shutdown: final snapshot, upload and unmount.
	// systemd's TimeoutStopSec must be larger. Env HERMESFS_STOP_TIMEOUT.
	StopTimeout time.Duration

	// Background returns once the mount is ready, leaving the daemon running
	// in its own session with its output in LogFile.
	Background bool

	// LogFile receives the daemon's logs in background mode; default
	// <state dir>/hermesfs.log.
	LogFile string

	// LogFormat is "text" or "json"; LogLevel is debug, info, warn or error.
	// Env HERMESFS_LOG_FORMAT, HERMESFS_LOG_LEVEL.
	LogFormat string
	LogLevel  string

	// MemoryLimit and UserLimit are the character limits of
	// memories/MEMORY.md and memories/USER.md when the home's config.yaml
	// does not set them.
	MemoryLimit int
	UserLimit   int

	// WritePassthroughMax is the largest file opened for writing with
	// FUSE passthrough (root, Linux >= 6.9): a size such as 32M, or 0 for
	// none. Each snapshot stops such files' writes for as long as it takes
	// to copy them (fs.Options.PassthroughWriteMax).
	WritePassthroughMax string
	writePTMax          int64 // parsed by validate; -1 for none

	// CopyUpByRangeMin is the smallest lower file copied up by range
	// (copyup.go); "off" copies every file whole.
	CopyUpByRangeMin string
	copyUpMin        int64 // parsed by validate; -1 for off

	// Debug logs every FUSE request.
	Debug bool

	// MetricsAddr, if set, is the HOST:PORT where Prometheus metrics are
	// served (/metrics). Env HERMESFS_METRICS_ADDR.
	MetricsAddr string
	// Lazy boots from a snapshot whose manifest has chunk digests without
	// downloading it first: ready after its metadata, data fetched as it
	// is read and filled in the background. Env HERMESFS_LAZY.
	Lazy bool
	// ReadTimeout bounds how long a lazy read retries a chunk the store
	// does not deliver before it fails with EIO. Env HERMESFS_READ_TIMEOUT.
	ReadTimeout time.Duration
	// Owner (USER[:GROUP]) is the user a root daemon serves: the mount
	// root becomes theirs, with the mode of the directory it covers, and
	// every user of the host may use the mount under the kernel's
	// permission checks (allow_other, default_permissions). Empty: the
	// mount is the mounting user's alone. Env HERMESFS_OWNER.
	Owner string
	owner *owner // parsed by validate

	// flags holds the store flags (declared by addStoreFlags), read with
	// storeOptions when the store is opened.
	flags *flag.FlagSet
}

// newMountConfig returns the defaults.
func newMountConfig() *mountConfig {
	return &mountConfig{
		Interval:    15 * time.Minute,
		Keep:        10,
		StopTimeout: 90 * time.Second,
		LogFormat:   "text",
		LogLevel:    "info",
		MemoryLimit: 2200,
		UserLimit:   1375,
		Lazy:        true,
		ReadTimeout: 30 * time.Second,

		WritePassthroughMax: strconv.Itoa(fs.DefaultPassthroughWriteMax>>20) + "M",
		CopyUpByRangeMin:    strconv.Itoa(fs.DefaultCopyUpByRangeMin>>20) + "M",
	}
}

// envFlags maps environment variables onto mount flags.
var envFlags = map[string]string{
	"HERMESFS_STATE_DIR":    "state-dir",
	"HERMESFS_INTERVAL":     "interval",
	"HERMESFS_KEEP":         "keep",
	"HERMESFS_STOP_TIMEOUT": "stop-timeout",
	"HERMESFS_LOG_FORMAT":   "log-format",
	"HERMESFS_LOG_LEVEL":    "log-level",
	"HERMESFS_OWNER":        "owner",

	"HERMESFS_WRITE_PASSTHROUGH_MAX": "write-passthrough-max",
	"HERMESFS_METRICS_ADDR":          "metrics-addr",
	"HERMESFS_LAZY":                  "lazy",
	"HERMESFS_READ_TIMEOUT":          "read-timeout",
}

// addFlags declares c's flags on fs, with c's current values as defaults.
func (c *mountConfig) addFlags(fs *flag.FlagSet) {
	c.flags = fs
	addStoreFlags(fs)
	addIdentityFlag(fs)
	addEncryptFlags(fs)
	fs.StringVar(&c.StateDir, "state-dir", c.StateDir, "state directory for this mountpoint (env HERMESFS_STATE_DIR; default /var/lib/hermesfs/mounts/<mountpoint> for root, ~/.local/state/hermesfs/<mountpoint> otherwise)")
	fs.DurationVar(&c.Interval, "interval", c.Interval, "time between periodic snapshots; 0 disables them (env HERMESFS_INTERVAL)")
	addRetentionFlags(fs, &c.Keep)
	fs.BoolVar(&c.ReadOnly, "read-only", c.ReadOnly, "mount the newest snapshot read-only and never publish (allowed while another host holds the store)")
	fs.StringVar(&c.OnConflict, "on-conflict", c.OnConflict, "when local unpublished changes meet a snapshot published by another host: keep-local or discard-local (default: refuse)")
	fs.DurationVar(&c.StopTimeout, "stop-timeout", c.StopTimeout, "bound on shutdown (final snapshot, upload, unmount); set systemd TimeoutStopSec larger (env HERMESFS_STOP_TIMEOUT)")
	fs.BoolVar(&c.Background, "background", c.Background, "return once the mount is ready; the daemon keeps running, logging to --log-file")
	fs.StringVar(&c.LogFile, "log-file", c.LogFile, "log file in --background mode (default <state dir>/hermesfs.log)")
	fs.StringVar(&c.LogFormat, "log-format", c.LogFormat, "log format: text or json (env HERMESFS_LOG_FORMAT)")
	fs.StringVar(&c.LogLevel, "log-level", c.LogLevel, "log level: debug, info, warn or error (env HERMESFS_LOG_LEVEL)")
	fs.IntVar(&c.MemoryLimit, "memory-limit", c.MemoryLimit, "character limit of memories/MEMORY.md when config.yaml sets none")
	fs.IntVar(&c.UserLimit, "user-limit", c.UserLimit, "character limit of memories/USER.md when config.yaml sets none")
	fs.StringVar(&c.WritePassthroughMax, "write-passthrough-max", c.WritePassthroughMax, "largest file written by the kernel straight to local disk (FUSE passthrough; root, Linux >= 6.9), e.g. 32M; 0 for none. Larger files are written through the daemon. Each snapshot stops such files' writes while it copies them (env HERMESFS_WRITE_PASSTHROUGH_MAX)")
	fs.BoolVar(&c.Debug, "debug", c.Debug, "log every FUSE request")
	fs.StringVar(&c.MetricsAddr, "metrics-addr", c.MetricsAddr, "serve Prometheus metrics at http://HOST:PORT/metrics (port 0: any free one, logged); off by default (env HERMESFS_METRICS_ADDR)")
	fs.BoolVar(&c.Lazy, "lazy", c.Lazy, "boot without downloading the snapshot first: fetch its data as it is read and fill the cache in the background; --lazy=false downloads it whole before mounting (env HERMESFS_LAZY)")
	fs.DurationVar(&c.ReadTimeout, "read-timeout", c.ReadTimeout, "how long a lazy read retries data the store does not deliver before it fails with EIO (env HERMESFS_READ_TIMEOUT)")
	fs.StringVar(&c.Owner, "owner", c.Owner, "USER[:GROUP] the mount serves when the daemon runs as root: the mount root becomes theirs, and other users may use the mount as the modes allow (allow_other); files belong to whoever creates them (env HERMESFS_OWNER)")
	c.addCopyUpFlags(fs)
}

// applyEnv sets, from the environment, every flag of fs that has a variable
// in envFlags and was not given on the command line.
func applyEnv(fs *flag.FlagSet, getenv func(string) string) error {
	set := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { set[f.Name] = true })
	for env, name := range envFlags {
		v := getenv(env)
		if v == "" || set[name] || fs.Lookup(name) == nil {
			continue
		}
		if err := fs.Set(name, v); err != nil {
			return usageError("%s=%q: %v", env, v, err)
		}
	}
	return nil
}

// validate checks c and makes paths absolute.
func (c *mountConfig) validate() error {
	if c.Mountpoint == "" {
		return usageError("missing MOUNTPOINT")
	}
	mp, err := filepath.Abs(c.Mountpoint)
	if err != nil {
		return usageError("mountpoint %s: %v", c.Mountpoint, err)
	}
	c.Mountpoint = filepath.Clean(mp)
	if c.Interval < 0 {
		return usageError("--interval %s: must not be negative", c.Interval)
	}
	if c.Interval > 0 && c.Interval < 500*time.Millisecond {
		return usageError("--interval %s: too short (minimum 500ms)", c.Interval)
	}
	if c.Keep < 1 {
		return usageError("--keep %d: must keep at least 1 snapshot", c.Keep)
	}
	if c.Retention, err = retentionPolicy(c.flags); err != nil {
		return err
	}
	if c.StopTimeout <= 0 {
		return usageError("--stop-timeout %s: must be positive", c.StopTimeout)
	}
	if c.ReadTimeout <= 0 {
		return usageError("--read-timeout %s: must be positive", c.ReadTimeout)
	}
	switch c.OnConflict {
	case "", "keep-local", "discard-local":
	default:
		return usageError("--on-conflict %q: want keep-local or discard-local", c.OnConflict)
	}
	if c.MemoryLimit < 1 || c.UserLimit < 1 {
		return usageError("--memory-limit and --user-limit must be positive")
	}
	if v := strings.TrimSpace(c.WritePassthroughMax); v == "0" {
		c.writePTMax = -1
	} else if c.writePTMax, err = parseSize(v); err != nil {
		return usageError("--write-passthrough-max: %v", err)
	}
	if c.MetricsAddr != "" {
		if _, _, err := net.SplitHostPort(c.MetricsAddr); err != nil {
			return usageError("--metrics-addr %q: want HOST:PORT, e.g. 127.0.0.1:9452 (%v)", c.MetricsAddr, err)
		}
	}
	if c.Owner != "" {
		if c.owner, err = parseOwner(c.Owner); err != nil {
			return usageError("--owner %v", err)
		}
		if os.Geteuid() != 0 {
			return usageError("--owner needs a daemon running as root (it gives files to the users who create them); without root, run the daemon as %s instead", c.Owner)
		}
	}
	if err := c.validateCopyUp(); err != nil {
		return err
	}
	if _, err := parseLevel(c.LogLevel); err != nil {
		return usageError("--log-level: %v", err)
	}
	if c.LogFormat != "text" && c.LogFormat != "json" {
		return usageError("--log-format %q: want text or json", c.LogFormat)
	}
	if c.StateDir != "" {
		if c.StateDir, err = filepath.Abs(c.StateDir); err != nil {
			return usageError("--state-dir: %v", err)
		}
		if within(c.StateDir, c.Mountpoint) {
			return usageError("--state-dir %s is inside the mountpoint %s", c.StateDir, c.Mountpoint)
		}
	}
	return nil
}

// within reports whether path is dir or below it.
func within(path, dir string) bool {
	rel, err := filepath.Rel(dir, path)
	return err == nil && rel != ".." && !strings.HasPrefix(rel, "../")
}

func parseLevel(s string) (slog.Level, error) {
	var l slog.Level
	if err := l.UnmarshalText([]byte(s)); err != nil {
		return 0, fmt.Errorf("%q: want debug, info, warn or error", s)
	}
	return l, nil
}

// newLogger builds the process logger: text or JSON to w at level.
func newLogger(w *os.File, format, level string) *slog.Logger {
	l, err := parseLevel(level)
	if err != nil {
		l = slog.LevelInfo
	}
	opts := &slog.HandlerOptions{Level: l}
	if format == "json" {
		return slog.New(slog.NewJSONHandler(w, opts))
	}
	return slog.New(slog.NewTextHandler(w, opts))
}

// defaultStateDir is the state directory for mountpoint when none is given:
// /var/lib/hermesfs/mounts/<escaped> for root (a level below the default
// store, /var/lib/hermesfs/store, so that a mountpoint named /store cannot
// meet it), $XDG_STATE_HOME/hermesfs/<escaped> (else
// ~/.local/state/hermesfs/<escaped>) for others.
func defaultStateDir(mountpoint string, uid int, getenv func(string) string) (string, error) {
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

// runtimeDir is where running mounts register themselves for `status`
// without arguments: $XDG_RUNTIME_DIR/hermesfs, else /run/hermesfs for root,
// else a per-user directory under the temp dir.
func runtimeDir(uid int, getenv func(string) string) string {
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
