package daemon

import (
	"bytes"
	"context"
	iofs "io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/hermesfs/hermesfs/archive"
	"github.com/hermesfs/hermesfs/fs"
	"github.com/hermesfs/hermesfs/fs/mounttest"
	"github.com/hermesfs/hermesfs/fs/testwatch"
	"github.com/hermesfs/hermesfs/uploader"
	"github.com/hermesfs/hermesfs/uploader/image"
	"github.com/hermesfs/hermesfs/uploader/storeurl"
)

// testRoot holds every test's directories, so that TestMain can tell the
// mounts they left from any others.
var testRoot string

func TestMain(m *testing.M) {
	// A test hung past its deadline ends the run (testwatch): its mounts
	// go first.
	testwatch.OnExpire(func() {
		for _, mp := range fs.MountsBelow(testRoot) {
			syscall.Unmount(mp, syscall.MNT_DETACH)
		}
	})
	mounttest.Main(m, "hermesfs-daemontest", &testRoot)
}

// tempDir is t.TempDir under testRoot.
func tempDir(t *testing.T) string {
	t.Helper()
	d, err := os.MkdirTemp(testRoot, strings.ReplaceAll(t.Name(), "/", "_")+"-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(d) })
	return d
}

// needFUSE skips without /dev/fuse, or fails under HERMESFS_TEST_STRICT.
func needFUSE(t *testing.T) {
	t.Helper()
	if _, err := os.Stat("/dev/fuse"); err != nil {
		if os.Getenv("HERMESFS_TEST_STRICT") != "" {
			t.Fatalf("/dev/fuse: %v (HERMESFS_TEST_STRICT)", err)
		}
		t.Skipf("no FUSE: %v", err)
	}
}

// readyWriter is a daemon's stdout: it closes ready at the ready line.
type readyWriter struct {
	mu    sync.Mutex
	buf   bytes.Buffer
	ready chan struct{}
	once  sync.Once
}

func (w *readyWriter) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.buf.Write(p)
	if strings.HasPrefix(w.buf.String(), "ready ") {
		w.once.Do(func() { close(w.ready) })
	}
	return len(p), nil
}

// lockedBuffer collects a daemon's logs, shown when the test fails.
type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// running is a daemon started in-process by startDaemon.
type running struct {
	cancel context.CancelFunc
	done   chan struct{} // closed when Run returned, with err set
	err    error
	logs   *lockedBuffer
}

// stop cancels the daemon's context (as a signal does) and returns Run's
// error.
func (r *running) stop(t *testing.T) error {
	t.Helper()
	r.cancel()
	select {
	case <-r.done:
		return r.err
	case <-time.After(2 * time.Minute):
		t.Fatalf("Run did not return after its context was cancelled; logs:\n%s", r.logs)
		return nil
	}
}

// startDaemon runs Run for mountpoint mp over the local store dir with
// state dir state, and returns once the mount is ready. The cleanup stops
// it and detaches the mount if it is still there.
func startDaemon(t *testing.T, store, mp, state, runDir string) *running {
	t.Helper()
	return startDaemonWith(t, store, mp, state, runDir, nil)
}

// startDaemonWith is startDaemon with edit, if not nil, changing the
// config and options first.
func startDaemonWith(t *testing.T, store, mp, state, runDir string, edit func(*Config, *Options)) *running {
	t.Helper()
	r, ready := launchDaemonWith(t, store, mp, state, runDir, edit)
	select {
	case <-ready:
	case <-r.done:
		t.Fatalf("Run returned before ready: %v; logs:\n%s", r.err, r.logs)
	case <-time.After(time.Minute):
		t.Fatalf("no ready line within a minute; logs:\n%s", r.logs)
	}
	return r
}

// launchDaemon is startDaemon without the wait: ready is closed at the
// ready line.
func launchDaemon(t *testing.T, store, mp, state, runDir string) (r *running, ready <-chan struct{}) {
	t.Helper()
	return launchDaemonWith(t, store, mp, state, runDir, nil)
}

// launchDaemonWith is launchDaemon with edit, as startDaemonWith.
func launchDaemonWith(t *testing.T, store, mp, state, runDir string, edit func(*Config, *Options)) (r *running, ready <-chan struct{}) {
	t.Helper()
	testwatch.Start(t)
	cfg := Config{
		Mountpoint:  mp,
		StateDir:    state,
		Retention:   uploader.DefaultRetention(),
		StopTimeout: time.Minute,
		MemoryLimit: 2200,
		UserLimit:   1375,
		Lazy:        true,
		ReadTimeout: 30 * time.Second,
	}
	getenv := func(k string) string {
		if k == "HERMESFS_RUNTIME_DIR" {
			return runDir // the registry of running mounts, kept out of /run
		}
		return ""
	}
	out := &readyWriter{ready: make(chan struct{})}
	logs := &lockedBuffer{}
	opts := Options{
		Stdout:  out,
		Getenv:  getenv,
		Logger:  slog.New(slog.NewTextHandler(logs, &slog.HandlerOptions{Level: slog.LevelDebug})),
		Version: "test",
		Store: func(*slog.Logger) (string, storeurl.Options, error) {
			return "file://" + store, storeurl.Options{Getenv: getenv, UID: os.Getuid()}, nil
		},
	}
	if edit != nil {
		edit(&cfg, &opts)
	}
	ctx, cancel := context.WithCancel(context.Background())
	r = &running{cancel: cancel, done: make(chan struct{}), logs: logs}
	go func() {
		r.err = Run(ctx, cfg, opts)
		close(r.done)
	}()
	t.Cleanup(func() {
		cancel()
		select {
		case <-r.done:
		case <-time.After(2 * time.Minute):
			t.Errorf("Run did not return after its context was cancelled")
		}
		if fs.IsMountpoint(mp) {
			syscall.Unmount(mp, syscall.MNT_DETACH)
		}
		if t.Failed() {
			t.Logf("daemon logs (%s):\n%s", mp, logs)
		}
	})
	return r, out.ready
}

// TestRunSnapshotRestore drives the daemon through its library API, with
// neither the CLI nor the binary: a fresh home on a local store takes a
// file, a snapshot requested on the control socket publishes it, and a
// second daemon on a fresh state dir (a new host) mounts it back.
func TestRunSnapshotRestore(t *testing.T) {
	needFUSE(t)
	root := tempDir(t)
	store, mp, runDir := filepath.Join(root, "store"), filepath.Join(root, "home"), filepath.Join(root, "run")
	for _, d := range []string{store, mp} {
		if err := os.Mkdir(d, 0o700); err != nil {
			t.Fatal(err)
		}
	}
	const name, content = "memories/notes.md", "written through the mount\n"

	d1 := startDaemon(t, store, mp, filepath.Join(root, "state1"), runDir)
	if err := os.MkdirAll(filepath.Join(mp, "memories"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(mp, name), []byte(content), 0o644); err != nil {
		t.Fatal(err)
	}
	resp, err := ControlCall(t.Context(), filepath.Join(root, "state1", "control.sock"), controlRequest{Op: "snapshot"})
	if err != nil || resp.Error != "" || resp.Snapshot == nil || resp.Snapshot.ID == "" || resp.Snapshot.Unchanged {
		t.Fatalf("snapshot on the control socket: %+v, %v", resp, err)
	}
	id := resp.Snapshot.ID
	if err := d1.stop(t); err != nil {
		t.Fatalf("first daemon stopped with %v (exit %d)", err, ExitCode(err))
	}
	if fs.IsMountpoint(mp) {
		t.Fatal("the mountpoint is still mounted after Run returned")
	}

	// The store holds the file: restore the newest snapshot as the
	// restore command does and read it from the archive.
	s, err := uploader.NewLocal(store)
	if err != nil {
		t.Fatal(err)
	}
	dst := filepath.Join(root, "restored.sqfs")
	res, err := uploader.NewCatalog(s, uploader.CatalogOptions{Host: "checker"}).Restore(t.Context(), dst, uploader.RestoreOptions{Image: image.Opener(s, nil, "")})
	if err != nil {
		t.Fatal(err)
	}
	if res.Manifest.ID != id {
		t.Errorf("newest snapshot %s, want %s (the one the control socket took; nothing changed after it)", res.Manifest.ID, id)
	}
	f, err := os.Open(dst)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		t.Fatal(err)
	}
	ar, err := archive.Open(f, fi.Size(), archive.ReaderOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if got, err := iofs.ReadFile(ar.FS(), name); err != nil || string(got) != content {
		t.Fatalf("%s in snapshot %s: %q, %v; want %q", name, res.Manifest.ID, got, err, content)
	}

	// A new host: a fresh state dir mounts the newest snapshot.
	d2 := startDaemon(t, store, mp, filepath.Join(root, "state2"), runDir)
	got, err := os.ReadFile(filepath.Join(mp, name))
	if err != nil || string(got) != content {
		t.Fatalf("%s through the second mount: %q, %v; want %q", name, got, err, content)
	}
	if err := d2.stop(t); err != nil {
		t.Fatalf("second daemon stopped with %v (exit %d)", err, ExitCode(err))
	}
}
