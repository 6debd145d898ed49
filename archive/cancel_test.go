package archive

import (
	"context"
	"errors"
	iofs "io/fs"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"time"
)

// cancelFS cancels a context when a given file is opened, so a test can
// stop Pack in the middle of its data phase.
type cancelFS struct {
	iofs.FS
	name   string
	cancel context.CancelFunc
}

func (c *cancelFS) Open(name string) (iofs.File, error) {
	if strings.HasSuffix(name, c.name) {
		c.cancel()
	}
	return c.FS.Open(name)
}
func (c *cancelFS) ReadDir(name string) ([]iofs.DirEntry, error) { return iofs.ReadDir(c.FS, name) }
func (c *cancelFS) Lstat(name string) (iofs.FileInfo, error)     { return iofs.Lstat(c.FS, name) }
func (c *cancelFS) ReadLink(name string) (string, error)         { return iofs.ReadLink(c.FS, name) }

// A cancelled Pack or Unpack stops, says why, and leaves no goroutine
// behind.
func TestCancel(t *testing.T) {
	src := makeTree(t)
	before := runtime.NumGoroutine()

	ctx, cancel := context.WithCancel(t.Context())
	f, _ := os.Create(filepath.Join(t.TempDir(), "a.sqfs"))
	defer f.Close()
	_, err := Pack(ctx, f, &cancelFS{FS: os.DirFS(src), name: "random.bin", cancel: cancel}, PackOptions{})
	if !errors.Is(err, context.Canceled) {
		t.Fatalf("Pack after cancel: %v", err)
	}

	p, _ := packToFile(t, src, PackOptions{})
	r := openFile(t, p)
	ctx, cancel = context.WithCancel(t.Context())
	cancel()
	if err := Unpack(ctx, r, filepath.Join(t.TempDir(), "out"), UnpackOptions{}); !errors.Is(err, context.Canceled) {
		t.Fatalf("Unpack after cancel: %v", err)
	}
	if err := r.Verify(ctx); !errors.Is(err, context.Canceled) {
		t.Fatalf("Verify after cancel: %v", err)
	}

	deadline := time.Now().Add(5 * time.Second)
	for runtime.NumGoroutine() > before && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	if n := runtime.NumGoroutine(); n > before {
		buf := make([]byte, 1<<16)
		t.Fatalf("%d goroutines left behind:\n%s", n-before, buf[:runtime.Stack(buf, true)])
	}
}
