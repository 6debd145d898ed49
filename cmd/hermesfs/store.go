package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	iofs "io/fs"
	"log/slog"
	"os"
	"strconv"
	"strings"
	"syscall"
	"time"
	"unsafe"

	"github.com/hermesfs/hermesfs/archive"
	"github.com/hermesfs/hermesfs/cmd/hermesfs/internal/daemon"
	"github.com/hermesfs/hermesfs/uploader"
	"github.com/hermesfs/hermesfs/uploader/storeurl"
)

// Store flags are shared by every command that talks to the store: list,
// restore, prune, verify (for snapshot ids) and mount. A command declares
// them with addStoreFlags and opens the store with openStore; the
// environment fills in what the command line leaves out.

// storeEnv maps each store flag to its environment variable.
var storeEnv = map[string]string{
	"store":         "HERMESFS_STORE",
	"s3-endpoint":   "HERMESFS_S3_ENDPOINT",
	"s3-region":     "HERMESFS_S3_REGION",
	"s3-path-style": "HERMESFS_S3_PATH_STYLE",
}

// storeHelp teaches store URLs; commands append it to their help.
const storeHelp = `Store URLs (--store, or HERMESFS_STORE):
  file:///var/lib/hermesfs/store          a local directory (the default: $XDG_DATA_HOME/hermesfs/store,
                                          ~/.local/share/hermesfs/store, or /var/lib/hermesfs/store for root)
  s3://my-bucket/agents/alice             Amazon S3 (region from AWS_REGION or ~/.aws/config)
  s3://my-bucket/alice?endpoint=https://ACCOUNT_ID.r2.cloudflarestorage.com
                                          Cloudflare R2 (region "auto" is implied)
  s3://hermes/alice?endpoint=http://127.0.0.1:9000
                                          MinIO or another S3-compatible server (path-style is implied
                                          with a custom endpoint; --s3-path-style=false to turn it off)
Credentials come from the standard AWS chain: AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY,
AWS_PROFILE and ~/.aws/credentials, SSO, or an instance role. They never go in the URL.
The endpoint may also come from AWS_ENDPOINT_URL_S3.`

// addStoreFlags declares the store flags on fs.
func addStoreFlags(fs *flag.FlagSet) {
	fs.String("store", "", "store URL: file:///dir or s3://bucket/prefix[?endpoint=URL&region=R&path_style=true] (env HERMESFS_STORE; default: a local store under the data dir)")
	fs.String("s3-endpoint", "", "S3 endpoint URL for R2, MinIO and other S3-compatible servers (env HERMESFS_S3_ENDPOINT, AWS_ENDPOINT_URL_S3)")
	fs.String("s3-region", "", "S3 region; \"auto\" for R2 (env HERMESFS_S3_REGION, AWS_REGION)")
	fs.Var(&optBool{}, "s3-path-style", "address S3 buckets path-style (default: true with a custom endpoint) (env HERMESFS_S3_PATH_STYLE)")
}

// optBool is a bool flag that knows whether it was set.
type optBool struct{ v *bool }

func (b *optBool) String() string {
	if b == nil || b.v == nil {
		return ""
	}
	return strconv.FormatBool(*b.v)
}

func (b *optBool) Set(s string) error {
	v, err := strconv.ParseBool(s)
	if err != nil {
		return err
	}
	b.v = &v
	return nil
}

func (b *optBool) IsBoolFlag() bool { return true }

// storeSetting returns flag name's value, or its environment variable's.
func storeSetting(e *env, fs *flag.FlagSet, name string) string {
	f := fs.Lookup(name)
	if f == nil {
		return e.getenv(storeEnv[name])
	}
	set := false
	fs.Visit(func(v *flag.Flag) { set = set || v.Name == name })
	if set {
		return f.Value.String()
	}
	return e.getenv(storeEnv[name])
}

// cliLogger shows warnings and errors (retries, fallbacks) on stderr.
func cliLogger(e *env) *slog.Logger {
	return slog.New(slog.NewTextHandler(e.stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
}

// storeOptions resolves the store flags and environment into storeurl
// options.
func storeOptions(e *env, fs *flag.FlagSet, logger *slog.Logger) (string, storeurl.Options, error) {
	o := storeurl.Options{
		Getenv:   e.getenv,
		UID:      os.Getuid(),
		Endpoint: storeSetting(e, fs, "s3-endpoint"),
		Region:   storeSetting(e, fs, "s3-region"),
		Logger:   logger,
	}
	if v := storeSetting(e, fs, "s3-path-style"); v != "" {
		b, err := strconv.ParseBool(v)
		if err != nil {
			return "", o, usageError("s3 path style %q: want true or false", v)
		}
		o.PathStyle = &b
	}
	return storeSetting(e, fs, "store"), o, nil
}

// openStore opens the store the flags name, wrapped in the default retry
// policy, and returns its location for messages.
func openStore(ctx context.Context, e *env, fs *flag.FlagSet, logger *slog.Logger) (uploader.Store, storeurl.Location, error) {
	raw, o, err := storeOptions(e, fs, logger)
	if err != nil {
		return nil, storeurl.Location{}, err
	}
	// The store commands never create a store (only mount does): a
	// mistyped URL is reported, not turned into a new empty directory.
	o.NoCreate = true
	loc, err := storeurl.Parse(raw, o)
	if err != nil {
		return nil, loc, usageError("%v", err) // the URL cannot be right
	}
	s, err := loc.Open(ctx, o)
	if err != nil {
		return nil, loc, err // no store there (iofs.ErrNotExist), or it cannot be reached
	}
	return uploader.WithRetry(s, uploader.RetryPolicy{}, logger), loc, nil
}

// checkStoreFlags refuses a store URL that cannot be right and encryption
// flags that cannot be used (usage errors), before a command starts
// anything.
func checkStoreFlags(e *env, fs *flag.FlagSet) error {
	raw, o, err := storeOptions(e, fs, nil)
	if err != nil {
		return err
	}
	if _, err := storeurl.Parse(raw, o); err != nil {
		return usageError("%v", err)
	}
	var co uploader.CatalogOptions
	return cryptOptions(e, fs, &co)
}

// openCatalog opens the snapshot catalog of the store the flags name.
func openCatalog(ctx context.Context, e *env, fs *flag.FlagSet) (*uploader.Catalog, storeurl.Location, error) {
	logger := cliLogger(e)
	s, loc, err := openStore(ctx, e, fs, logger)
	if err != nil {
		return nil, loc, err
	}
	host, _ := os.Hostname()
	o := uploader.CatalogOptions{Host: host, Version: version, Logger: logger}
	if err := cryptOptions(e, fs, &o); err != nil {
		return nil, loc, err
	}
	return uploader.NewCatalog(s, o), loc, nil
}

// verifyArchive is the block-level check of a downloaded snapshot, run by
// the catalog after the size and sha256 matched.
func verifyArchive(ctx context.Context, f *os.File, m uploader.Manifest) error {
	fi, err := f.Stat() // the manifest's size is the ciphertext's when encrypted
	if err != nil {
		return err
	}
	r, err := archive.Open(f, fi.Size(), archive.ReaderOptions{Name: m.ID})
	if err != nil {
		return err
	}
	return r.Verify(ctx)
}

// snapshotError gives store errors their exit codes.
func snapshotError(err error) error {
	switch {
	case errors.Is(err, uploader.ErrCorrupt), errors.Is(err, archive.ErrCorrupt):
		return withCode(exitCorrupt, err)
	case errors.Is(err, uploader.ErrConflict), errors.Is(err, uploader.ErrLeaseHeld):
		return withCode(exitConflict, err)
	}
	return daemon.CryptError(err)
}

// checkNamedSnapshot says, before a command reads anything of it, whether
// the store holds snapshot id, which the user named: when the store has
// no trace of it (no manifest, no extents, no archive), the id is wrong,
// not the snapshot corrupt: exit 7, pointing to 'hermesfs list'. A
// snapshot with some of its objects but no manifest (a publish in
// progress, or one that crashed), or one pruned later, while the command
// reads it, is the command's to report, as corrupt.
func checkNamedSnapshot(ctx context.Context, cat *uploader.Catalog, loc storeurl.Location, id string) error {
	if id == "" {
		return nil
	}
	if _, err := cat.Manifest(ctx, id); err == nil || !errors.Is(err, iofs.ErrNotExist) {
		return nil
	}
	for _, key := range []string{uploader.ManifestKey(id), uploader.ExtentsKey(id), uploader.ArchiveKey(id)} {
		if _, err := cat.Store().Stat(ctx, key); !errors.Is(err, iofs.ErrNotExist) {
			return nil
		}
	}
	return withCode(exitNotFound, fmt.Errorf("no snapshot %s in %s ('hermesfs list' shows the snapshots it holds)", id, loc))
}

// progressEvery is how often a long download, export or extraction says
// how far it is when stderr is not a terminal (a log, a pipe, systemd):
// often enough that it never looks hung, rarely enough for a log.
const progressEvery = 5 * time.Second

// progress shows how far a long transfer is on stderr: on a terminal, a
// one-line bar redrawn in place as the percentage moves; elsewhere, a
// plain line every progressEvery (none for what ends sooner).
type progress struct {
	w     io.Writer
	label string
	tty   bool
	now   func() time.Time

	last            int // percentage drawn (terminal)
	shown           bool
	start, lastLine time.Time
}

func newProgress(w io.Writer, label string) *progress {
	return newProgressAt(w, label, isTerminal(w), time.Now)
}

func newProgressAt(w io.Writer, label string, tty bool, now func() time.Time) *progress {
	t := now()
	return &progress{w: w, label: strings.TrimSpace(label), tty: tty, now: now, last: -1, start: t, lastLine: t}
}

func (p *progress) update(done, total int64) {
	if p.w == nil || total <= 0 {
		return
	}
	pct := int(done * 100 / total)
	if p.tty {
		if pct == p.last {
			return
		}
		p.last, p.shown = pct, true
		bar := strings.Repeat("#", pct/4) + strings.Repeat(".", 25-pct/4)
		fmt.Fprintf(p.w, "\r%-8s [%s] %3d%% %s / %s", p.label, bar, pct, daemon.HumanBytes(done), daemon.HumanBytes(total))
		return
	}
	now := p.now()
	if now.Sub(p.lastLine) < progressEvery || done >= total {
		return
	}
	p.lastLine = now
	rate := ""
	if secs := now.Sub(p.start).Seconds(); secs > 0 {
		rate = fmt.Sprintf(", %s/s", daemon.HumanBytes(int64(float64(done)/secs)))
	}
	fmt.Fprintf(p.w, "%s: %s of %s (%d%%%s)\n", p.label, daemon.HumanBytes(done), daemon.HumanBytes(total), pct, rate)
}

func (p *progress) done() {
	if p.tty && p.shown {
		fmt.Fprintln(p.w)
	}
}

func isTerminal(w io.Writer) bool {
	f, ok := w.(*os.File)
	if !ok {
		return false
	}
	var t syscall.Termios
	_, _, errno := syscall.Syscall(syscall.SYS_IOCTL, f.Fd(), syscall.TCGETS, uintptr(unsafe.Pointer(&t)))
	return errno == 0
}
