package fs

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

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

// TestOpenFillAhead: the second open of a small file in a directory (not
// the first) starts reading the small files after it, before they are
// opened, up to the window; files past the window are left alone until an
// open nearer to them; every file reads its own bytes.
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
	// One file of a directory read: nothing ahead yet.
	if c := lower.count(ino[1]); c != 0 {
		t.Errorf("mod01 read %d times after the first open in its directory", c)
	}
	if got := e.read("pkg/__pycache__/" + names[1]); got != string(randBytes(size, 1)) {
		t.Fatal("mod01: wrong bytes")
	}
	// The window after mod01: fillAhead bytes of files.
	inWindow := 1 + fillAhead/size
	deadline := time.Now().Add(30 * time.Second)
	for lower.count(ino[inWindow]) == 0 {
		if time.Now().After(deadline) {
			t.Fatalf("files after the ones opened were not read ahead (mod02: %d reads, mod%02d: %d)", lower.count(ino[2]), inWindow, lower.count(ino[inWindow]))
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

// TestOpenFillThenWrite: a small lower file filled at a read-only open and
// then opened for writing without O_TRUNC is copied up at that open, and a
// write into its middle reads back with the filled bytes around it, through
// the mount and in the upper file; a guarded file is never filled, and its
// writes still reach the guard with the lower content as the old one.
func TestOpenFillThenWrite(t *testing.T) {
	t.Parallel()
	content := randBytes(20<<10, 5)
	lower, _ := packLower(t, func(dir string) {
		os.MkdirAll(filepath.Join(dir, "memories"), 0o755)
		os.WriteFile(filepath.Join(dir, "memories/MEMORY.md"), []byte("lower memory"), 0o644)
		os.WriteFile(filepath.Join(dir, "mod.pyc"), content, 0o644)
	})
	g := &testGuard{max: 64}
	st := NewStats()
	e := mountEnv(t, lower, Options{Stats: st, Guard: g})

	if got := e.read("memories/MEMORY.md"); got != "lower memory" {
		t.Fatalf("guarded file: %q", got)
	}
	if files, _ := st.Filled(); files != 0 {
		t.Fatalf("a guarded file was filled (%d files)", files)
	}
	if got := e.read("mod.pyc"); got != string(content) {
		t.Fatal("mod.pyc: wrong bytes")
	}
	if files, _ := st.Filled(); files != 1 {
		t.Fatalf("%d files filled, want mod.pyc", files)
	}

	_, done0 := st.CopyUps()
	f, err := os.OpenFile(e.path("mod.pyc"), os.O_RDWR, 0)
	must(t, err)
	if _, done := st.CopyUps(); done != done0+1 {
		t.Errorf("open for writing: %d copy-ups done, want one", done-done0)
	}
	if _, err := f.WriteAt([]byte("NEW BYTES"), 5000); err != nil {
		t.Fatal(err)
	}
	must(t, f.Close())
	want := slices.Clone(content)
	copy(want[5000:], "NEW BYTES")
	if got := e.read("mod.pyc"); got != string(want) {
		t.Error("after a write into the filled file: wrong bytes through the mount")
	}
	if got, err := os.ReadFile(filepath.Join(e.upper, "mod.pyc")); err != nil || !bytes.Equal(got, want) {
		t.Errorf("the upper file after the write: %d bytes, %v", len(got), err)
	}

	// The guarded file: a write through an O_RDWR open is checked against
	// the lower content and read back.
	g.reset()
	if _, err := writeClose(e.path("memories/MEMORY.md"), unix.O_RDWR|unix.O_APPEND, " and more"); err != nil {
		t.Fatal(err)
	}
	if c := g.calls(); len(c) != 1 || c[0].old != "lower memory" || c[0].new != "lower memory and more" {
		t.Errorf("guard checks: %+v", c)
	}
	if got := e.read("memories/MEMORY.md"); got != "lower memory and more" {
		t.Errorf("guarded file after its write: %q", got)
	}
	if files, _ := st.Filled(); files != 1 {
		t.Errorf("%d files filled, want only mod.pyc", files)
	}
}

// TestOpenFillNotBesideDeferredWriter: a read-only open of a lower file
// that a read-write handle has open, not yet copied up (copy-up by range
// defers it to the first write), fills nothing: the writer's pages are the
// kernel's, and a fill could put lower bytes over them. The reader sees
// the write.
func TestOpenFillNotBesideDeferredWriter(t *testing.T) {
	t.Parallel()
	content := randBytes(64<<10, 6)
	lower, _ := packLower(t, func(dir string) {
		os.WriteFile(filepath.Join(dir, "f"), content, 0o644)
	})
	st := NewStats()
	e := mountEnv(t, lower, Options{Stats: st, CopyUpByRangeMin: 16 << 10})
	w, err := os.OpenFile(e.path("f"), os.O_RDWR, 0)
	must(t, err)
	defer w.Close()
	if e.inUpper("f") {
		t.Fatal("the read-write open copied the file up: the test needs a deferred copy-up")
	}
	r, err := os.Open(e.path("f"))
	must(t, err)
	defer r.Close()
	if files, _ := st.Filled(); files != 0 {
		t.Errorf("a read-only open beside a deferred writer filled %d files", files)
	}
	if _, err := w.WriteAt([]byte("written"), 100); err != nil {
		t.Fatal(err)
	}
	want := slices.Clone(content)
	copy(want[100:], "written")
	got := make([]byte, len(content)+1)
	k, _ := r.ReadAt(got, 0)
	if !bytes.Equal(got[:k], want) {
		t.Errorf("the reader does not see the write (%d bytes)", k)
	}
}

// TestOpenFillAheadCorrupt: a damaged small file in the window of its
// neighbours' opens is read ahead, and still never served: its own
// open succeeds and its read fails with EIO.
func TestOpenFillAheadCorrupt(t *testing.T) {
	t.Parallel()
	needFuse(t)
	src := tempDir(t)
	// Each one block (of 32 KiB): a fragment block shared by both would be
	// damaged for both.
	first := randBytes(32<<10, 7)
	good := randBytes(32<<10, 8)
	bad := randBytes(32<<10, 9) // uncompressible: the damage hits its bytes
	must(t, os.WriteFile(filepath.Join(src, "0-first"), first, 0o644))
	must(t, os.WriteFile(filepath.Join(src, "a-good"), good, 0o644))
	must(t, os.WriteFile(filepath.Join(src, "b-bad"), bad, 0o644))
	img := filepath.Join(tempDir(t), "img.sqfs")
	f, err := os.Create(img)
	must(t, err)
	_, err = archive.PackDir(t.Context(), f, src, archive.PackOptions{BlockSize: 32 << 10})
	f.Close()
	must(t, err)
	raw, err := os.ReadFile(img)
	must(t, err)
	i := bytes.Index(raw, bad[2000:2100])
	if i < 0 {
		t.Fatal("b-bad's bytes not found in the image")
	}
	raw[i] ^= 0xff
	must(t, os.WriteFile(img, raw, 0o644))

	ar := openLower(t, img)
	lower := &readsLower{Lower: ar, reads: map[archive.Inode]int{}}
	st := NewStats()
	e := mountEnv(t, lower, Options{Stats: st})
	if got := e.read("0-first"); got != string(first) {
		t.Fatal("0-first: wrong bytes")
	}
	if got := e.read("a-good"); got != string(good) {
		t.Fatal("a-good: wrong bytes")
	}
	a, err := ar.Lookup(ar.Root(), "b-bad")
	must(t, err)
	deadline := time.Now().Add(time.Minute)
	for lower.count(a.Ino) == 0 {
		if time.Now().After(deadline) {
			t.Fatal("b-bad was not read ahead after a-good's open")
		}
		time.Sleep(5 * time.Millisecond)
	}
	h, err := os.Open(e.path("b-bad"))
	if err != nil {
		t.Fatalf("open of a file with a damaged block: %v", err)
	}
	defer h.Close()
	buf := make([]byte, len(bad))
	if k, err := h.ReadAt(buf, 0); !errors.Is(err, syscall.EIO) {
		t.Fatalf("read of a damaged file read ahead: %d bytes, %v; want EIO", k, err)
	}
	if files, _ := st.Filled(); files != 2 {
		t.Errorf("%d files filled, want 0-first and a-good only", files)
	}
}

// blockingLower holds the lower reads of one inode until released.
type blockingLower struct {
	*readsLower
	hold    archive.Inode
	held    chan struct{} // closed when a read of hold waits
	release chan struct{}
	once    sync.Once
}

func (l *blockingLower) ReadAt(ino archive.Inode, p []byte, off int64) (int, error) {
	if ino == l.hold {
		l.once.Do(func() { close(l.held) })
		<-l.release
	}
	return l.readsLower.ReadAt(ino, p, off)
}

// TestOpenFillAheadStopsAtUnmount: an unmount waits for the read-ahead of
// a directory's small files in progress, and nothing more of the window is
// read once it began.
func TestOpenFillAheadStopsAtUnmount(t *testing.T) {
	t.Parallel()
	names := make([]string, 8)
	ar, _ := packLower(t, func(dir string) {
		for i := range names {
			names[i] = fmt.Sprintf("mod%02d.pyc", i)
			os.WriteFile(filepath.Join(dir, names[i]), randBytes(20<<10, uint64(i)), 0o644)
		}
	})
	ino := make([]archive.Inode, len(names))
	for i, n := range names {
		a, err := ar.Lookup(ar.Root(), n)
		must(t, err)
		ino[i] = a.Ino
	}
	lower := &blockingLower{
		readsLower: &readsLower{Lower: ar, reads: map[archive.Inode]int{}},
		hold:       ino[2], held: make(chan struct{}), release: make(chan struct{}),
	}
	e := mountEnv(t, lower, Options{})
	for i := range 2 {
		if got := e.read(names[i]); got != string(randBytes(20<<10, uint64(i))) {
			t.Fatalf("%s: wrong bytes", names[i])
		}
	}
	select {
	case <-lower.held:
	case <-time.After(time.Minute):
		t.Fatal("the files after mod01 were not read ahead")
	}
	unmounted := make(chan struct{})
	m := e.m
	e.m = nil
	go func() {
		defer close(unmounted)
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		if err := m.Unmount(ctx); err != nil {
			t.Errorf("unmount: %v", err)
		}
	}()
	// The unmount waits for the read in progress (wait until it began).
	for !m.ov.unmounted.Load() {
		select {
		case <-unmounted:
			t.Fatal("unmount returned while a read ahead was in progress")
		case <-time.After(time.Millisecond):
		}
	}
	select {
	case <-unmounted:
		t.Fatal("unmount returned while a read ahead was in progress")
	default:
	}
	close(lower.release)
	<-unmounted
	for i := 3; i < len(names); i++ {
		if c := lower.count(ino[i]); c != 0 {
			t.Errorf("%s read %d times ahead after the unmount began", names[i], c)
		}
	}
}
