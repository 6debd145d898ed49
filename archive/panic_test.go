package archive

import (
	"bytes"
	"errors"
	iofs "io/fs"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"time"
)

// panicFS is a source whose file name panics when read, as a buggy file
// system would.
type panicFS struct {
	iofs.FS
	name string
}

func (p *panicFS) Open(name string) (iofs.File, error) {
	f, err := p.FS.Open(name)
	if err == nil && name == p.name {
		return panicFile{f}, nil
	}
	return f, err
}
func (p *panicFS) ReadDir(name string) ([]iofs.DirEntry, error) { return iofs.ReadDir(p.FS, name) }
func (p *panicFS) Lstat(name string) (iofs.FileInfo, error)     { return iofs.Lstat(p.FS, name) }
func (p *panicFS) ReadLink(name string) (string, error)         { return iofs.ReadLink(p.FS, name) }

type panicFile struct{ iofs.File }

func (panicFile) Read([]byte) (int, error) { panic("injected: a bug in the source file system") }

// A panic in the goroutines that read the source (the producer, the
// duplicate summer) fails the pack with a PanicError carrying the stack,
// and leaves no goroutine behind; the process goes on.
func TestPackPanicInSource(t *testing.T) {
	src := t.TempDir()
	same := bytes.Repeat([]byte("x"), 300<<10)
	writeFile(t, filepath.Join(src, "a.bin"), same, 0o644)
	writeFile(t, filepath.Join(src, "b.bin"), same, 0o644) // same size: summed ahead
	writeFile(t, filepath.Join(src, "c.txt"), []byte("unique"), 0o644)
	before := runtime.NumGoroutine()
	for _, name := range []string{"a.bin", "b.bin", "c.txt"} {
		f, err := os.Create(filepath.Join(t.TempDir(), "out.sqfs"))
		if err != nil {
			t.Fatal(err)
		}
		_, err = Pack(t.Context(), f, &panicFS{FS: os.DirFS(src), name: name}, PackOptions{})
		f.Close()
		var pe *PanicError
		if !errors.As(err, &pe) {
			t.Fatalf("pack with %s panicking: %v, want a PanicError", name, err)
		}
		if !strings.Contains(pe.Error(), "injected") || !strings.Contains(string(pe.Stack), "panicFile.Read") {
			t.Errorf("pack with %s panicking: %q, stack:\n%s", name, pe.Error(), pe.Stack)
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
