package archive

import (
	"context"
	"errors"
	"io"
	iofs "io/fs"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"sync/atomic"
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

// cancelAt cancels a context at the after-th read once after is set.
type cancelAt struct {
	io.ReaderAt
	after  atomic.Int64
	cancel context.CancelFunc
}

func (c *cancelAt) ReadAt(p []byte, off int64) (int, error) {
	if c.after.Load() > 0 && c.after.Add(-1) == 0 {
		c.cancel()
	}
	return c.ReaderAt.ReadAt(p, off)
}

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

	// Cancelled once the file data is being read, however late that
	// comes: an error, never a half-written tree reported as done.
	for _, after := range []int64{1, 3, 10} {
		ctx, cancel := context.WithCancel(t.Context())
		af, err := os.Open(p)
		if err != nil {
			t.Fatal(err)
		}
		st, _ := af.Stat()
		ca := &cancelAt{ReaderAt: af, cancel: cancel}
		r, err := Open(ca, st.Size(), ReaderOptions{})
		if err != nil {
			t.Fatal(err)
		}
		ca.after.Store(after)
		err = Unpack(ctx, r, filepath.Join(t.TempDir(), "out"), UnpackOptions{})
		cancel()
		af.Close()
		if !errors.Is(err, context.Canceled) {
			t.Fatalf("Unpack cancelled after %d reads: %v", after, err)
		}
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
