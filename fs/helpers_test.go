package fs

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/hermesfs/hermesfs/archive"
	"github.com/hermesfs/hermesfs/fs/testwatch"
)

// strict is set by `make test`: a missing tool fails instead of skipping.
var strict = os.Getenv("HERMESFS_TEST_STRICT") == "1"

// testRoot is where every test of this package makes its directories, so
// TestMain can find mounts left behind.
var testRoot string

func TestMain(m *testing.M) {
	if h := os.Getenv(helperEnv); h != "" {
		os.Exit(runHelper(h))
	}
	var err error
	testRoot, err = os.MkdirTemp("", "hermesfs-fstest-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
	// Unprivileged helpers must be able to reach their directories.
	os.Chmod(testRoot, 0o755)
	// The helpers this binary runs as (mount helpers, mmapWrite) exit
	// without the race runtime's second of sleep: mounttest's
	// RaceChildrenExitAtOnce, which these tests cannot import.
	if g := os.Getenv("GORACE"); !strings.Contains(g, "atexit_sleep_ms") {
		os.Setenv("GORACE", strings.TrimSpace(g+" atexit_sleep_ms=0"))
	}
	// A test hung past its deadline ends the run (testwatch): its mounts
	// go first.
	testwatch.OnExpire(func() {
		for _, mp := range MountsBelow(testRoot) {
			unix.Unmount(mp, unix.MNT_DETACH)
		}
	})
	code := m.Run()
	if left := MountsBelow(testRoot); len(left) > 0 {
		fmt.Fprintf(os.Stderr, "FAIL: FUSE mounts left behind: %v\n", left)
		for _, mp := range left {
			unix.Unmount(mp, unix.MNT_DETACH)
		}
		code = 1
	}
	os.RemoveAll(testRoot)
	os.Exit(code)
}

// tempDir is t.TempDir under testRoot.
func tempDir(t testing.TB) string {
	t.Helper()
	d, err := os.MkdirTemp(testRoot, strings.NewReplacer("/", "_", " ", "_").Replace(t.Name())+"-")
	if err != nil {
		t.Fatal(err)
	}
	os.Chmod(d, 0o755)
	t.Cleanup(func() { os.RemoveAll(d) })
	return d
}

// need skips (or, in strict mode, fails) unless cond holds.
func need(t testing.TB, cond bool, what string) {
	t.Helper()
	if cond {
		return
	}
	if strict {
		t.Fatalf("missing: %s", what)
	}
	t.Skipf("missing: %s", what)
}

// must fails the test on an error that the test does not examine.
func must(t testing.TB, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

func needFuse(t testing.TB) {
	t.Helper()
	_, err := os.Stat("/dev/fuse")
	need(t, err == nil, "/dev/fuse")
	need(t, os.Geteuid() == 0, "root (tests mount FUSE)")
}

func needTool(t testing.TB, name string) string {
	t.Helper()
	p, err := exec.LookPath(name)
	need(t, err == nil, name)
	return p
}

func testLogger(t testing.TB) *slog.Logger {
	return slog.New(slog.NewTextHandler(testWriter{t}, &slog.HandlerOptions{Level: slog.LevelWarn}))
}

type testWriter struct{ t testing.TB }

func (w testWriter) Write(p []byte) (int, error) {
	w.t.Log(strings.TrimRight(string(p), "\n"))
	return len(p), nil
}

// packLower builds a squashfs image of the tree made by fill with the real
// mksquashfs and opens it with the archive reader. It returns the image
// path too.
func packLower(t testing.TB, fill func(dir string)) (*archive.Reader, string) {
	t.Helper()
	mk := needTool(t, "mksquashfs")
	base := tempDir(t)
	src := filepath.Join(base, "src")
	if err := os.Mkdir(src, 0o755); err != nil {
		t.Fatal(err)
	}
	fill(src)
	img := filepath.Join(base, "lower.sqfs")
	out, err := exec.Command(mk, src, img, "-noappend", "-comp", "zstd", "-quiet", "-no-progress", "-no-xattrs").CombinedOutput()
	if err != nil {
		t.Fatalf("mksquashfs: %v\n%s", err, out)
	}
	return openLower(t, img), img
}

func openLower(t testing.TB, img string) *archive.Reader {
	t.Helper()
	f, err := os.Open(img)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.Close() })
	st, err := f.Stat()
	if err != nil {
		t.Fatal(err)
	}
	r, err := archive.Open(f, st.Size(), archive.ReaderOptions{Name: img})
	if err != nil {
		t.Fatalf("open %s: %v", img, err)
	}
	return r
}

// env is one mounted overlay of a test.
type env struct {
	t     testing.TB
	m     *Mounted
	mnt   string
	upper string
	opts  Options
}

// mountEnv mounts an overlay of lower (nil: empty) in fresh directories and
// unmounts it at cleanup.
func mountEnv(t testing.TB, lower Lower, opts Options) *env {
	t.Helper()
	needFuse(t)
	testwatch.Start(t)
	base := tempDir(t)
	e := &env{t: t, mnt: filepath.Join(base, "mnt"), upper: filepath.Join(base, "upper")}
	if err := os.Mkdir(e.mnt, 0o755); err != nil {
		t.Fatal(err)
	}
	opts.Upper = e.upper
	if lower != nil {
		opts.Lower = lower
	}
	if opts.Logger == nil {
		opts.Logger = testLogger(t)
	}
	e.opts = opts
	e.mount()
	return e
}

func (e *env) mount() {
	e.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	m, err := Mount(ctx, e.mnt, e.opts)
	if err != nil {
		e.t.Fatal(err)
	}
	e.m = m
	e.t.Cleanup(func() { e.unmount() })
}

func (e *env) unmount() {
	if e.m == nil {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := e.m.Unmount(ctx); err != nil {
		e.t.Errorf("unmount: %v", err)
	}
	e.m = nil
}

// remount unmounts and mounts the same layers again.
func (e *env) remount() {
	e.t.Helper()
	e.unmount()
	e.mount()
}

func (e *env) path(rel string) string { return filepath.Join(e.mnt, rel) }

func (e *env) write(rel, content string) {
	e.t.Helper()
	if err := os.WriteFile(e.path(rel), []byte(content), 0o644); err != nil {
		e.t.Fatal(err)
	}
}

func (e *env) read(rel string) string {
	e.t.Helper()
	b, err := os.ReadFile(e.path(rel))
	if err != nil {
		e.t.Fatal(err)
	}
	return string(b)
}

func (e *env) ino(rel string) uint64 {
	e.t.Helper()
	var st unix.Stat_t
	if err := unix.Lstat(e.path(rel), &st); err != nil {
		e.t.Fatal(err)
	}
	return st.Ino
}

func (e *env) missing(rel string) {
	e.t.Helper()
	if _, err := os.Lstat(e.path(rel)); !os.IsNotExist(err) {
		e.t.Fatalf("%s: got %v, want it gone", rel, err)
	}
}

// names lists a directory of the mount, sorted.
func (e *env) names(rel string) []string {
	e.t.Helper()
	ents, err := os.ReadDir(e.path(rel))
	if err != nil {
		e.t.Fatal(err)
	}
	var out []string
	for _, de := range ents {
		out = append(out, de.Name())
	}
	return out
}

// sampleTree is the lower layer most overlay tests use.
func sampleTree(dir string) {
	must := func(err error) {
		if err != nil {
			panic(err)
		}
	}
	mtime := time.Date(2024, 5, 6, 7, 8, 9, 0, time.UTC)
	for _, d := range []string{"a", "a/b", "skills/web", "skills/web/sub", "empty", "t"} {
		must(os.MkdirAll(filepath.Join(dir, d), 0o755))
	}
	files := map[string]string{
		"top.txt":                 "top",
		"a/one.txt":               "one",
		"a/b/two.txt":             "two",
		"skills/web/SKILL.md":     "# web",
		"skills/web/sub/deep.txt": "deep",
		"big.bin":                 string(bytes.Repeat([]byte("0123456789abcdef"), 64<<10)),
		"secret.txt":              "s3cret",
	}
	for p, c := range files {
		must(os.WriteFile(filepath.Join(dir, p), []byte(c), 0o644))
	}
	must(os.Chmod(filepath.Join(dir, "secret.txt"), 0o600))
	must(os.Symlink("top.txt", filepath.Join(dir, "link")))
	must(os.Link(filepath.Join(dir, "a/one.txt"), filepath.Join(dir, "a/one-hard.txt")))
	must(syscall.Mkfifo(filepath.Join(dir, "fifo"), 0o644))
	must(os.Chown(filepath.Join(dir, "a/one.txt"), 1234, 5678))
	filepath.Walk(dir, func(p string, info os.FileInfo, err error) error {
		must(err)
		if info.Mode()&os.ModeSymlink == 0 {
			must(os.Chtimes(p, mtime, mtime))
		}
		return nil
	})
}

func unsafePointer(b *byte) unsafe.Pointer { return unsafe.Pointer(b) }
