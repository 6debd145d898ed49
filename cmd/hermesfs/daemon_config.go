package main

import (
	"flag"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/hermesfs/hermesfs/cmd/hermesfs/internal/daemon"
	"github.com/hermesfs/hermesfs/fs"
	"github.com/hermesfs/hermesfs/uploader"
	"github.com/hermesfs/hermesfs/uploader/image"
	"github.com/hermesfs/hermesfs/uploader/storeurl"
)

// mountConfig is everything `hermesfs mount` can be told: the daemon's
// Config and what only the command line has (--keep, --background, sizes
// and the owner as text). Flags map onto its fields one to one, and
// HERMESFS_* environment variables onto the flags (a flag given on the
// command line wins over the variable). Defaults are set in newMountConfig
// and nowhere else.
type mountConfig struct {
	daemon.Config

	// Keep is --keep, the same as --keep-last (0: not given). Env
	// HERMESFS_KEEP. retentionPolicy reads it from the flag set.
	Keep int

	// Background returns once the mount is ready, leaving the daemon running
	// in its own session with its output in LogFile.
	Background bool

	// LogFile receives the daemon's logs in background mode; default
	// <state dir>/hermesfs.log.
	LogFile string

	// WritePassthroughMax is --write-passthrough-max as given (a size such
	// as 32M, or 0 for none); validate parses it into
	// Config.PassthroughWriteMax.
	WritePassthroughMax string

	// CompactSpec is --compact as given; validate parses it into
	// Config.Compact.
	CompactSpec string

	// CopyUpByRangeMin is --copy-up-by-range-min as given ("off" copies
	// every file whole); validate parses it into Config.CopyUpMin.
	CopyUpByRangeMin string

	// OwnerSpec is --owner (USER[:GROUP]); validate parses it into
	// Config.Owner. Env HERMESFS_OWNER.
	OwnerSpec string

	// flags holds the store and encryption flags (declared by
	// addStoreFlags, addIdentityFlag, addEncryptFlags), read when the
	// daemon opens the store.
	flags *flag.FlagSet
}

// defaultWriteBack is --write-back's default: a change reaches the store
// about 10 s after it is made (README "Write-back" and BENCHMARKS.md say
// what that costs and why not 2 s or 60 s).
const defaultWriteBack = 10 * time.Second

// defaultLeaseWait is --lease-wait's default: longer than a dead host's
// lease takes to lapse (25 s) and than a live host's stop takes to
// release it (--stop-timeout, 90 s by default), short enough that a host
// refused by a live holder says so within minutes.
const defaultLeaseWait = 5 * time.Minute

// newMountConfig returns the defaults.
func newMountConfig() *mountConfig {
	return &mountConfig{
		Config: daemon.Config{
			Interval:    15 * time.Minute,
			WriteBack:   defaultWriteBack,
			StopTimeout: 90 * time.Second,
			LeaseWait:   defaultLeaseWait,
			LogFormat:   "text",
			LogLevel:    "info",
			MemoryLimit: 2200,
			UserLimit:   1375,
			Lazy:        true,
			ReadTimeout: 30 * time.Second,
		},

		WritePassthroughMax: strconv.Itoa(fs.DefaultPassthroughWriteMax>>20) + "M",
		CopyUpByRangeMin:    strconv.Itoa(fs.DefaultCopyUpByRangeMin>>20) + "M",
	}
}

// envFlags maps environment variables onto mount flags.
var envFlags = map[string]string{
	"HERMESFS_STATE_DIR":    "state-dir",
	"HERMESFS_INTERVAL":     "interval",
	"HERMESFS_WRITE_BACK":   "write-back",
	"HERMESFS_KEEP":         "keep",
	"HERMESFS_STOP_TIMEOUT": "stop-timeout",
	"HERMESFS_LEASE_WAIT":   "lease-wait",
	"HERMESFS_LOG_FORMAT":   "log-format",
	"HERMESFS_LOG_LEVEL":    "log-level",
	"HERMESFS_OWNER":        "owner",

	"HERMESFS_WRITE_PASSTHROUGH_MAX": "write-passthrough-max",
	"HERMESFS_METRICS_ADDR":          "metrics-addr",
	"HERMESFS_LAZY":                  "lazy",
	"HERMESFS_STANDALONE":            "standalone",
	"HERMESFS_READ_TIMEOUT":          "read-timeout",
	"HERMESFS_COMPACT":               "compact",
}

// addFlags declares c's flags on fs, with c's current values as defaults.
func (c *mountConfig) addFlags(fs *flag.FlagSet) {
	c.flags = fs
	addStoreFlags(fs)
	addIdentityFlag(fs)
	addEncryptFlags(fs)
	fs.StringVar(&c.StateDir, "state-dir", c.StateDir, "state directory for this mountpoint (env HERMESFS_STATE_DIR; default /var/lib/hermesfs/mounts/<mountpoint> for root, ~/.local/state/hermesfs/<mountpoint> otherwise)")
	fs.DurationVar(&c.Interval, "interval", c.Interval, "time between periodic snapshots; 0 disables them (env HERMESFS_INTERVAL)")
	fs.DurationVar(&c.WriteBack, "write-back", c.WriteBack, "publish a snapshot this long after the first change the store does not have yet (a burst of writes: one snapshot; steady writes: at most one per D), so a host that dies without a clean stop (kill -9, OOM, a reclaimed VM) loses about D plus one upload, not up to --interval; failed ones retry with backoff. At least 1s; 0: off, snapshots only every --interval, on 'hermesfs snapshot' and at stop (env HERMESFS_WRITE_BACK)")
	addRetentionFlags(fs, &c.Keep)
	fs.BoolVar(&c.ReadOnly, "read-only", c.ReadOnly, "mount the newest snapshot read-only and never publish (allowed while another host holds the store)")
	fs.StringVar(&c.OnConflict, "on-conflict", c.OnConflict, "when local unpublished changes meet a snapshot published by another host: keep-local or discard-local (default: refuse)")
	fs.DurationVar(&c.LeaseWait, "lease-wait", c.LeaseWait, "how long to wait, at boot, for the store's writer lease another host holds (a dead host's lapses within 25s; a host that stops releases it) or for a store that does not answer; meanwhile the home is shown read-only (writes fail with EROFS) and the wait is in the log, 'hermesfs status' and the systemd status line. 0: refuse at once, exit 4 (env HERMESFS_LEASE_WAIT)")
	fs.DurationVar(&c.StopTimeout, "stop-timeout", c.StopTimeout, "bound on shutdown (final snapshot, upload, unmount; files the agent keeps open do not extend it: the final snapshot seals the mount); set systemd TimeoutStopSec larger (env HERMESFS_STOP_TIMEOUT)")
	fs.BoolVar(&c.Background, "background", c.Background, "return once the mount is ready; the daemon keeps running, logging to --log-file")
	fs.StringVar(&c.LogFile, "log-file", c.LogFile, "log file in --background mode (default <state dir>/hermesfs.log)")
	fs.StringVar(&c.LogFormat, "log-format", c.LogFormat, "log format: text or json (env HERMESFS_LOG_FORMAT)")
	fs.StringVar(&c.LogLevel, "log-level", c.LogLevel, "log level: debug, info, warn or error (env HERMESFS_LOG_LEVEL)")
	fs.IntVar(&c.MemoryLimit, "memory-limit", c.MemoryLimit, "character limit of memories/MEMORY.md when config.yaml sets none")
	fs.IntVar(&c.UserLimit, "user-limit", c.UserLimit, "character limit of memories/USER.md when config.yaml sets none")
	fs.StringVar(&c.WritePassthroughMax, "write-passthrough-max", c.WritePassthroughMax, "largest file written by the kernel straight to local disk (FUSE passthrough; root, Linux >= 6.9), e.g. 32M; 0 for none. Larger files are written through the daemon. Each snapshot stops such files' writes while it copies them; the final one, at stop, makes their reads and writes fail (EIO) (env HERMESFS_WRITE_PASSTHROUGH_MAX)")
	fs.BoolVar(&c.Debug, "debug", c.Debug, "log every FUSE request")
	fs.StringVar(&c.MetricsAddr, "metrics-addr", c.MetricsAddr, "serve Prometheus metrics at http://HOST:PORT/metrics (port 0: any free one, logged); off by default (env HERMESFS_METRICS_ADDR)")
	fs.BoolVar(&c.Standalone, "standalone", c.Standalone, "also store each snapshot's image whole, as snapshots/<id>.sqfs that unsquashfs reads straight from the bucket, composed by the store from the segments where it can copy (costs a whole image of storage per snapshot; encrypted: one age file uploaded whole) (env HERMESFS_STANDALONE)")
	fs.BoolVar(&c.Lazy, "lazy", c.Lazy, "boot without downloading the snapshot first: fetch its data as it is read and fill the cache in the background; --lazy=false downloads it whole before mounting (env HERMESFS_LAZY)")
	fs.DurationVar(&c.ReadTimeout, "read-timeout", c.ReadTimeout, "how long a lazy read retries data the store does not deliver before it fails with EIO (env HERMESFS_READ_TIMEOUT)")
	fs.StringVar(&c.OwnerSpec, "owner", c.OwnerSpec, "USER[:GROUP] the mount serves when the daemon runs as root: the mount root becomes theirs, and other users may use the mount as the modes allow (allow_other); files belong to whoever creates them (env HERMESFS_OWNER)")
	fs.StringVar(&c.CompactSpec, "compact", "default", "when to compact the snapshots' image in the background (rewrite it afresh: what extending snapshots left unused goes, extents are fewer): off, or bounds like garbage=25%,extents=300,snapshots=1000 (any of them; 0 turns one off; default: "+image.DefaultCompactPolicy().String()+") (env HERMESFS_COMPACT)")
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
	// Symlinks resolved: the state dir's name, the registry and the check
	// for a live mount all go by the directory mounted over.
	mp, err := daemon.ResolveMountpoint(c.Mountpoint)
	if err != nil {
		return usageError("%v", err)
	}
	c.Mountpoint = mp
	if c.Interval < 0 {
		return usageError("--interval %s: must not be negative", c.Interval)
	}
	if c.Interval > 0 && c.Interval < 500*time.Millisecond {
		return usageError("--interval %s: too short (minimum 500ms)", c.Interval)
	}
	if c.WriteBack < 0 {
		return usageError("--write-back %s: must not be negative (0 turns write-back off)", c.WriteBack)
	}
	if c.WriteBack > 0 && c.WriteBack < time.Second {
		return usageError("--write-back %s: too short (minimum 1s; 0 turns write-back off)", c.WriteBack)
	}
	if c.Retention, err = retentionPolicy(c.flags); err != nil {
		return err
	}
	if c.StopTimeout <= 0 {
		return usageError("--stop-timeout %s: must be positive", c.StopTimeout)
	}
	if c.LeaseWait < 0 {
		return usageError("--lease-wait %s: must not be negative (0 refuses at once)", c.LeaseWait)
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
		c.PassthroughWriteMax = -1
	} else if c.PassthroughWriteMax, err = parseSize(v); err != nil {
		return usageError("--write-passthrough-max: %v", err)
	}
	if c.MetricsAddr != "" {
		if _, _, err := net.SplitHostPort(c.MetricsAddr); err != nil {
			return usageError("--metrics-addr %q: want HOST:PORT, e.g. 127.0.0.1:9452 (%v)", c.MetricsAddr, err)
		}
	}
	if c.OwnerSpec != "" {
		if c.Owner, err = daemon.ParseOwner(c.OwnerSpec); err != nil {
			return usageError("--owner %v", err)
		}
		if os.Geteuid() != 0 {
			return usageError("--owner needs a daemon running as root (it gives files to the users who create them); without root, run the daemon as %s instead", c.OwnerSpec)
		}
	}
	if err := c.validateCopyUp(); err != nil {
		return err
	}
	if c.CompactSpec != "default" {
		p, err := image.ParseCompactPolicy(c.CompactSpec)
		if err != nil {
			return usageError("--compact %v", err)
		}
		c.Compact = &p
	}
	if _, err := daemon.ParseLevel(c.LogLevel); err != nil {
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

// daemonOptions connects the daemon to this process: stdout for the ready
// line, the environment, and the store and encryption flags, resolved when
// the daemon opens the store.
func (c *mountConfig) daemonOptions(e *env) daemon.Options {
	return daemon.Options{
		Stdout:  e.stdout,
		Getenv:  e.getenv,
		Version: version,
		Store: func(logger *slog.Logger) (string, storeurl.Options, error) {
			return storeOptions(e, c.flags, logger)
		},
		Encryption: func(o *uploader.CatalogOptions) error {
			return cryptOptions(e, c.flags, o)
		},
	}
}

// testKnobs reads the settings only tests change, from the environment:
// HERMESFS_TEST_LEASE_TTL shortens the writer lease's TTL (25s), so that
// a test of a host that takes over from a killed one runs in seconds.
// Nothing else about the lease changes.
func (c *mountConfig) testKnobs(getenv func(string) string) error {
	if v := getenv("HERMESFS_TEST_LEASE_TTL"); v != "" {
		d, err := time.ParseDuration(v)
		if err != nil || d < time.Second {
			return usageError("HERMESFS_TEST_LEASE_TTL=%q: want a duration of at least 1s", v)
		}
		c.LeaseTTL = d
	}
	return nil
}

// shortDuration writes d as a person would: 15m, not 15m0s.
func shortDuration(d time.Duration) string {
	s := d.String()
	if strings.HasSuffix(s, "m0s") {
		s = strings.TrimSuffix(s, "0s")
	}
	if strings.HasSuffix(s, "h0m") {
		s = strings.TrimSuffix(s, "0m")
	}
	return s
}
