// Package daemon is the daemon of `hermesfs mount` as a library: Run boots
// a mount from a Config and serves it until its context ends. The command
// (cmd/hermesfs) keeps the flags, the environment, the help text and the
// output; tests drive Run in-process. daemon.go describes the daemon's life,
// goroutines and lock order; export.go gives the types the other commands
// share with it their exported names.
package daemon

import (
	"context"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"sync"
	"syscall"

	"github.com/hermesfs/hermesfs/uploader"
	"github.com/hermesfs/hermesfs/uploader/storeurl"
)

// Options connect a daemon to its process: where the ready line goes, the
// environment it reads (systemd's NOTIFY_SOCKET, the runtime and state
// directories) and how the store and its encryption are resolved.
type Options struct {
	// Stdout receives the ready line ("ready MOUNTPOINT snapshot=..."),
	// once the mount answers. Nil: discarded.
	Stdout io.Writer
	// Getenv reads the environment. Nil: os.Getenv.
	Getenv func(string) string
	// Logger receives the daemon's logs. Nil: a logger on os.Stderr as
	// Config.LogFormat and Config.LogLevel say.
	Logger *slog.Logger
	// Version names the build in manifests and metrics.
	Version string
	// Signals delivers the signals that arrive while the daemon stops
	// (the first one ended Run's context): a second SIGINT or SIGTERM
	// during the final snapshot abandons it (exit 5, local changes
	// kept). Nil: the daemon asks for SIGINT and SIGTERM itself while it
	// stops.
	Signals <-chan os.Signal

	// Store resolves the store: its URL and how to open it. Called at
	// boot (logger is the store's) and for messages (logger nil); an
	// error is returned by Run as it is, a URL that cannot be right as
	// a usage error (ExitUsage), before the state dir is touched.
	Store func(logger *slog.Logger) (string, storeurl.Options, error)
	// Encryption, if set, fills in the catalog's identities, recipients
	// and AllowPlaintext; its error is returned by Run as it is. It is
	// called once before the state dir is touched, to refuse early, and
	// again when the store opens.
	Encryption func(o *uploader.CatalogOptions) error
}

// env is what the daemon sees of its process: Options, with the defaults
// filled in.
type env struct{ Options }

// Run runs the daemon of cfg.Mountpoint in the foreground until ctx is
// done (a signal), `hermesfs umount` asks it to stop or the mount goes
// away: boot, ready line, periodic and requested snapshots, then the final
// snapshot, unmount and release. The error carries the exit code
// (ExitCode): nil is a clean stop with everything published.
func Run(ctx context.Context, cfg Config, opts Options) error {
	if opts.Stdout == nil {
		opts.Stdout = io.Discard
	}
	if opts.Getenv == nil {
		opts.Getenv = os.Getenv
	}
	if opts.Store == nil {
		opts.Store = func(*slog.Logger) (string, storeurl.Options, error) {
			return "", storeurl.Options{Getenv: opts.Getenv, UID: os.Getuid()}, nil
		}
	}
	if opts.Encryption == nil {
		opts.Encryption = func(*uploader.CatalogOptions) error { return nil }
	}
	survivePipes()
	e := &env{opts}
	return runDaemon(ctx, e, &cfg, realParts{})
}

var pipesOnce sync.Once

// survivePipes keeps the daemon alive when the pipe its output goes to
// closes (journald restarting, a closed `docker logs`, `hermesfs mount |
// tee` whose tee was interrupted): with SIGPIPE at its default, the first
// log line after that kills the process, with the unpublished changes and
// the mount. Go's runtime raises SIGPIPE for a write to a broken pipe on
// fds 1 and 2 unless the program asks for the signal; asked for (on a
// channel nobody reads: the runtime never blocks on it), such a write
// fails with EPIPE instead, which the logger and the ready line ignore.
// Children (fusermount3) still start with SIGPIPE at its default.
func survivePipes() {
	pipesOnce.Do(func() { signal.Notify(make(chan os.Signal, 1), syscall.SIGPIPE) })
}
