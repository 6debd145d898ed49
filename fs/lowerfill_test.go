package fs

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/hermesfs/hermesfs/archive"
)

// opCalls returns the requests of each operation counted so far.
func opCalls(st *Stats) map[string]uint64 {
	m := map[string]uint64{}
	for _, o := range st.Ops() {
		m[o.Op] = o.Calls
	}
	return m
}

// TestOpenFill: the first read-only open of a small lower file hands its
// content to the page cache, so reading it whole makes no READ request;
// the bytes are the file's; later opens fill nothing; a file over the
// limit is read through READ; a file copied up and changed after it was
// filled reads its new content through every open.
func TestOpenFill(t *testing.T) {
	t.Parallel()
	small := map[string][]byte{}
	lower, _ := packLower(t, func(dir string) {
		for i := range 20 {
			name := fmt.Sprintf("m%02d.pyc", i)
			small[name] = randBytes(100+i*6000, uint64(i))
			os.WriteFile(filepath.Join(dir, name), small[name], 0o644)
		}
		os.WriteFile(filepath.Join(dir, "large.so"), randBytes(300<<10, 99), 0o644)
	})
	st := NewStats()
	e := mountEnv(t, lower, Options{Stats: st, NoPassthrough: true})

	before := opCalls(st)
	for name, want := range small {
		got, err := os.ReadFile(e.path(name))
		if err != nil || !bytes.Equal(got, want) {
			t.Fatalf("%s: %d bytes, %v; want its %d bytes", name, len(got), err, len(want))
		}
	}
	after := opCalls(st)
	if n := after["read"] - before["read"]; n != 0 {
		t.Errorf("reading %d small files made %d READ requests, want none", len(small), n)
	}
	if n := after["open"] - before["open"]; n != uint64(len(small)) {
		t.Errorf("%d OPEN requests for %d files", n, len(small))
	}
	if files, bytes := st.Filled(); files != uint64(len(small)) || bytes == 0 {
		t.Errorf("filled %d files (%d bytes), want %d", files, bytes, len(small))
	}

	// Again: the page cache has them, nothing is filled twice.
	for name := range small {
		e.read(name)
	}
	if files, _ := st.Filled(); files != uint64(len(small)) {
		t.Errorf("after second reads: %d files filled, want %d", files, len(small))
	}
	if n := opCalls(st)["read"] - before["read"]; n != 0 {
		t.Errorf("second reads made %d READ requests", n)
	}

	// Over the limit: READ as before.
	r0 := opCalls(st)["read"]
	if got, err := os.ReadFile(e.path("large.so")); err != nil || !bytes.Equal(got, randBytes(300<<10, 99)) {
		t.Fatalf("large.so: %d bytes, %v", len(got), err)
	}
	if opCalls(st)["read"] == r0 {
		t.Error("a file over the fill limit was read without READ requests")
	}

	// Filled, then copied up and changed: a reader opened before and one
	// opened after see the change.
	held, err := os.Open(e.path("m03.pyc"))
	must(t, err)
	defer held.Close()
	must(t, os.WriteFile(e.path("m03.pyc"), []byte("changed"), 0o644))
	if got := e.read("m03.pyc"); got != "changed" {
		t.Errorf("after a change: %q", got)
	}
	buf := make([]byte, 64)
	k, _ := held.ReadAt(buf, 0)
	if string(buf[:k]) != "changed" {
		t.Errorf("handle opened before the change reads %q", buf[:k])
	}
}

// TestOpenFillOff: OpenFillMax < 0 fills nothing; reads go through READ.
func TestOpenFillOff(t *testing.T) {
	t.Parallel()
	lower, _ := packLower(t, sampleTree)
	st := NewStats()
	e := mountEnv(t, lower, Options{Stats: st, OpenFillMax: -1})
	if got := e.read("top.txt"); got != "top" {
		t.Fatalf("top.txt: %q", got)
	}
	if files, _ := st.Filled(); files != 0 || opCalls(st)["read"] == 0 {
		t.Errorf("with fill off: %d files filled, %d READs", files, opCalls(st)["read"])
	}
}

// TestOpenFillCorrupt: a small file whose block is damaged is never handed
// to the page cache: its open succeeds and its read fails with EIO, never
// giving wrong bytes.
func TestOpenFillCorrupt(t *testing.T) {
	t.Parallel()
	needFuse(t)
	src := tempDir(t)
	// Uncompressible, so the damage lands in the file's own bytes.
	bad := randBytes(50<<10, 7)
	must(t, os.WriteFile(filepath.Join(src, "a-bad"), bad, 0o644))
	img := filepath.Join(tempDir(t), "img.sqfs")
	f, err := os.Create(img)
	must(t, err)
	_, err = archive.PackDir(t.Context(), f, src, archive.PackOptions{})
	f.Close()
	must(t, err)
	raw, err := os.ReadFile(img)
	must(t, err)
	i := bytes.Index(raw, bad[1000:1100])
	if i < 0 {
		t.Fatal("a-bad's bytes not found in the image")
	}
	raw[i] ^= 0xff
	must(t, os.WriteFile(img, raw, 0o644))

	st := NewStats()
	e := mountEnv(t, openLower(t, img), Options{Stats: st})
	h, err := os.Open(e.path("a-bad"))
	if err != nil {
		t.Fatalf("open of a file with a damaged block: %v (the read reports it)", err)
	}
	defer h.Close()
	buf := make([]byte, len(bad))
	k, err := h.ReadAt(buf, 0)
	if !errors.Is(err, syscall.EIO) {
		t.Fatalf("read of a damaged small file: %d bytes, %v; want EIO", k, err)
	}
	if files, _ := st.Filled(); files != 0 {
		t.Errorf("%d damaged files filled", files)
	}
}

// readsLower counts the lower reads of each inode.
type readsLower struct {
	Lower
	mu    sync.Mutex
	reads map[archive.Inode]int
}

func (l *readsLower) ReadAt(ino archive.Inode, p []byte, off int64) (int, error) {
	l.mu.Lock()
	l.reads[ino]++
	l.mu.Unlock()
	return l.Lower.ReadAt(ino, p, off)
}

func (l *readsLower) count(ino archive.Inode) int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.reads[ino]
}

// TestOpenFillAhead: the first open of a small file starts reading the
// small files after it in its directory, before they are opened, up to the
// window; files past the window are left alone until an open nearer to
// them; every file reads its own bytes.
func TestOpenFillAhead(t *testing.T) {
	t.Parallel()
	const size = 40 << 10
	names := make([]string, 40) // 1.6 MB: beyond one window
	ar, _ := packLower(t, func(dir string) {
		os.MkdirAll(filepath.Join(dir, "pkg", "__pycache__"), 0o755)
		for i := range names {
			names[i] = fmt.Sprintf("mod%02d.pyc", i)
			os.WriteFile(filepath.Join(dir, "pkg", "__pycache__", names[i]), randBytes(size, uint64(i)), 0o644)
		}
	})
	lower := &readsLower{Lower: ar, reads: map[archive.Inode]int{}}
	e := mountEnv(t, lower, Options{})
	dir, err := ar.Lookup(ar.Root(), "pkg")
	must(t, err)
	dir, err = ar.Lookup(dir.Ino, "__pycache__")
	must(t, err)
	ino := make([]archive.Inode, len(names))
	for i, n := range names {
		a, err := ar.Lookup(dir.Ino, n)
		must(t, err)
		ino[i] = a.Ino
	}
	if got := e.read("pkg/__pycache__/" + names[0]); got != string(randBytes(size, 0)) {
		t.Fatal("mod00: wrong bytes")
	}
	// The window after mod00: fillAhead bytes of files.
	inWindow := fillAhead / size
	deadline := time.Now().Add(30 * time.Second)
	for lower.count(ino[inWindow]) == 0 {
		if time.Now().After(deadline) {
			t.Fatalf("files after the one opened were not read ahead (mod01: %d reads, mod%02d: %d)", lower.count(ino[1]), inWindow, lower.count(ino[inWindow]))
		}
		time.Sleep(5 * time.Millisecond)
	}
	if c := lower.count(ino[len(names)-1]); c != 0 {
		t.Errorf("the last file, past the window, was read %d times before any open near it", c)
	}
	for i := len(names) - 1; i >= 0; i-- {
		if got := e.read("pkg/__pycache__/" + names[i]); got != string(randBytes(size, uint64(i))) {
			t.Fatalf("%s: wrong bytes", names[i])
		}
	}
}
