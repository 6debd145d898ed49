package fs

import (
	"context"
	"encoding/binary"
	"errors"
	iofs "io/fs"
	"os"
	"syscall"
	"testing"
	"time"
)

// sealWriter writes an increasing counter at offset 0 of f until a write
// fails, then tries once more; last is the last counter a write returned
// for, err the failure, again the second try's.
type sealWriter struct {
	last       uint64
	err, again error
	started    chan struct{}
	done       chan struct{}
}

func startSealWriter(f *os.File) *sealWriter {
	w := &sealWriter{started: make(chan struct{}), done: make(chan struct{})}
	go func() {
		defer close(w.done)
		var buf [8]byte
		for seq := uint64(1); ; seq++ {
			binary.LittleEndian.PutUint64(buf[:], seq)
			if _, err := f.WriteAt(buf[:], 0); err != nil {
				w.err = err
				_, w.again = f.WriteAt(buf[:], 0)
				return
			}
			w.last = seq
			if seq == 100 {
				close(w.started)
			}
		}
	}()
	return w
}

// TestSealIsTheLastCut: Seal is a stop's last cut. Writers that keep
// writing through it, one through passthrough and one through the daemon,
// find in its view exactly the last write that returned to them; every
// write after it fails (EIO through passthrough, EROFS through the
// daemon), and so does every other change of the tree, while reads go
// on; the generation stays the view's, and a freeze after it sees the same.
func TestSealIsTheLastCut(t *testing.T) {
	e := mountEnv(t, nil, Options{PassthroughWriteMax: 1 << 20})
	pt := e.m.Passthrough() && e.m.ov.ptWriteOK.Load()
	must(t, os.WriteFile(e.path("pt"), make([]byte, 4096), 0o644))
	must(t, os.WriteFile(e.path("served"), make([]byte, 2<<20), 0o644))
	e.write("keep", "kept")
	must(t, os.Mkdir(e.path("dir"), 0o755))
	names := []string{"served"}
	if pt {
		names = append(names, "pt")
	} else {
		t.Log("no writable passthrough here: only the daemon-served writer runs")
	}
	writers := map[string]*sealWriter{}
	for _, name := range names {
		f, err := os.OpenFile(e.path(name), os.O_RDWR, 0)
		must(t, err)
		defer f.Close()
		if got, want := e.ptWritable(name), name == "pt"; got != want {
			t.Fatalf("%s: writable passthrough %v, want %v", name, got, want)
		}
		writers[name] = startSealWriter(f)
	}
	for _, w := range writers {
		select {
		case <-w.started:
		case <-time.After(30 * time.Second):
			t.Fatal("writer did not start")
		}
	}
	v, err := e.m.Seal(context.Background())
	must(t, err)
	defer v.Close()
	for name, w := range writers {
		select {
		case <-w.done:
		case <-time.After(30 * time.Second):
			t.Fatalf("%s: the writer's writes did not fail after the seal", name)
		}
		b, err := iofs.ReadFile(v, name)
		must(t, err)
		if got := binary.LittleEndian.Uint64(b); got != w.last {
			t.Errorf("%s: the view holds write %d, the last write that returned was %d", name, got, w.last)
		}
		want := syscall.EROFS
		if name == "pt" {
			want = syscall.EIO
		}
		if !errors.Is(w.err, want) || !errors.Is(w.again, want) {
			t.Errorf("%s: writes after the seal failed with %v, then %v; want %v", name, w.err, w.again, want)
		}
		t.Logf("%s: %d writes before the seal, then %v", name, w.last, w.err)
	}

	changes := map[string]func() error{
		"create":         func() error { return os.WriteFile(e.path("new"), nil, 0o644) },
		"open for write": func() error { f, err := os.OpenFile(e.path("keep"), os.O_WRONLY, 0); f.Close(); return err },
		"truncate":       func() error { return os.Truncate(e.path("keep"), 0) },
		"chmod":          func() error { return os.Chmod(e.path("keep"), 0o600) },
		"unlink":         func() error { return os.Remove(e.path("keep")) },
		"rename":         func() error { return os.Rename(e.path("keep"), e.path("moved")) },
		"mkdir":          func() error { return os.Mkdir(e.path("dir2"), 0o755) },
		"rmdir":          func() error { return os.Remove(e.path("dir")) },
		"symlink":        func() error { return os.Symlink("keep", e.path("link")) },
		"link":           func() error { return os.Link(e.path("keep"), e.path("hard")) },
	}
	for what, change := range changes {
		if err := change(); !errors.Is(err, syscall.EROFS) {
			t.Errorf("%s after the seal: %v, want EROFS", what, err)
		}
	}
	if got := e.read("keep"); got != "kept" {
		t.Errorf("keep reads %q after the seal", got)
	}
	if got := e.names(""); len(got) != 4 {
		t.Errorf("the tree after the seal: %v", got)
	}
	if g := e.m.Generation(); g != v.Generation() {
		t.Errorf("generation %d after the seal, the view's is %d", g, v.Generation())
	}
	v2, err := e.m.Freeze(context.Background())
	must(t, err)
	defer v2.Close()
	for name, w := range writers {
		b, err := iofs.ReadFile(v2, name)
		must(t, err)
		if got := binary.LittleEndian.Uint64(b); got != w.last {
			t.Errorf("%s: a freeze after the seal holds write %d, want %d", name, got, w.last)
		}
	}
}
