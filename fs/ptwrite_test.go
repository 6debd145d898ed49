package fs

import (
	"bytes"
	"context"
	"encoding/binary"
	"fmt"
	iofs "io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// ptWritable reports whether the file at rel is open in passthrough with a
// writable backing file.
func (e *env) ptWritable(rel string) bool {
	e.t.Helper()
	ino := e.ino(rel)
	p := &e.m.ov.ptw
	p.mu.Lock()
	defer p.mu.Unlock()
	for n := range p.nodes {
		if n.ino == ino {
			return true
		}
	}
	return false
}

// waitReleased waits until the mount has no open handle of rel (RELEASE
// comes after close(2) returns).
func (e *env) waitReleased(rel string) {
	e.t.Helper()
	busy := func() bool {
		if e.ptWritable(rel) {
			return true
		}
		cur := e.m.ov.root.EmbeddedInode()
		for _, el := range strings.Split(rel, "/") {
			if cur = cur.GetChild(el); cur == nil {
				return false
			}
		}
		n := cur.Operations().(*node)
		n.mu.Lock()
		defer n.mu.Unlock()
		return n.cachedOpens+n.ptOpens > 0
	}
	for deadline := time.Now().Add(5 * time.Second); busy(); {
		if time.Now().After(deadline) {
			e.t.Fatalf("%s: handles never released", rel)
		}
		time.Sleep(time.Millisecond)
	}
}

// ptWriter writes content to rel and opens it for writing, which must be
// given passthrough; it is closed at cleanup.
func (e *env) ptWriter(rel, content string) *os.File {
	e.t.Helper()
	e.write(rel, content)
	f, err := os.OpenFile(e.path(rel), os.O_RDWR, 0)
	must(e.t, err)
	e.t.Cleanup(func() { f.Close() })
	if !e.ptWritable(rel) {
		e.t.Fatalf("%s: no writable passthrough", rel)
	}
	return f
}

func needPassthrough(t *testing.T, e *env) {
	t.Helper()
	if !e.m.Passthrough() {
		t.Skip("kernel without FUSE passthrough, or not root")
	}
}

// TestPassthroughWriteFreezeConsistent: files written through passthrough
// by a process that keeps writing come out of every freeze as of one
// instant. The writer stamps a counter into file a, then b, then a block
// of a further on: a view must show a's counter equal to b's or one ahead,
// never behind, no block of a stamped later than its first, and must keep
// showing the same after the writer went on.
func TestPassthroughWriteFreezeConsistent(t *testing.T) {
	e := mountEnv(t, nil, Options{})
	needPassthrough(t, e)
	const size = 4 << 20
	for _, name := range []string{"a", "b"} {
		must(t, os.WriteFile(e.path(name), make([]byte, size), 0o644))
	}
	p, line := startHelper(t, "stamp", "", "", "", nil, "HELPER_A="+e.path("a"), "HELPER_B="+e.path("b"))
	defer func() {
		p.cmd.Process.Kill()
		p.wait()
	}()
	if line != "open" {
		t.Fatalf("writer: %s", line)
	}
	if !e.ptWritable("a") || !e.ptWritable("b") {
		t.Fatal("writable opens were not given passthrough")
	}
	counter := func(b []byte) uint64 { return binary.LittleEndian.Uint64(b) }
	// The live file, read through the mount.
	progress := func() uint64 {
		var buf [8]byte
		f, err := os.Open(e.path("b"))
		must(t, err)
		defer f.Close()
		if _, err := f.ReadAt(buf[:], 0); err != nil {
			t.Fatal(err)
		}
		return counter(buf[:])
	}
	waitFor := func(n uint64) {
		deadline := time.Now().Add(10 * time.Second)
		for progress() < n {
			if time.Now().After(deadline) {
				t.Fatalf("writer stuck before %d", n)
			}
			time.Sleep(time.Millisecond)
		}
	}
	waitFor(100)
	for round := 0; round < 5; round++ {
		v, err := e.m.Freeze(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		a1, err := iofs.ReadFile(v, "a")
		must(t, err)
		b1, err := iofs.ReadFile(v, "b")
		must(t, err)
		x, y := counter(a1), counter(b1)
		if x != y && x != y+1 {
			t.Errorf("round %d: the view has a at %d and b at %d: not one instant", round, x, y)
		}
		for off := 4096; off < len(a1); off += 4096 {
			if c := counter(a1[off:]); c > x {
				t.Errorf("round %d: block %d of a at %d, after a's first block (%d)", round, off/4096, c, x)
				break
			}
		}
		if v.WriteStall() <= 0 {
			t.Errorf("round %d: no write stall reported with two files written through passthrough", round)
		}
		waitFor(x + 1000)
		a2, err := iofs.ReadFile(v, "a")
		must(t, err)
		if !bytes.Equal(a1, a2) {
			t.Errorf("round %d: the view's a changed while the writer went on", round)
		}
		t.Logf("round %d: view at %d, writes stopped for %v", round, x, v.WriteStall())
		must(t, v.Close())
	}
	// After the views, writes still go through passthrough.
	if !e.ptWritable("a") {
		t.Error("a lost its passthrough handle")
	}
}

// TestPassthroughWriteGeneration: writes the daemon never sees still move
// the generation (the daemon's "anything to snapshot?"), and a file open
// for writing but not written does not.
func TestPassthroughWriteGeneration(t *testing.T) {
	e := mountEnv(t, nil, Options{})
	needPassthrough(t, e)
	f := e.ptWriter("f", "0123456789")
	settle := func() uint64 {
		time.Sleep(2 * ptRecent)
		e.m.Generation()
		return e.m.Generation()
	}
	g0 := settle()
	if g := e.m.Generation(); g != g0 {
		t.Errorf("generation moved from %d to %d with nothing written", g0, g)
	}
	if _, err := f.WriteAt([]byte("x"), 3); err != nil {
		t.Fatal(err)
	}
	if g := e.m.Generation(); g == g0 {
		t.Error("a write through passthrough did not move the generation")
	}
	g1 := settle()
	// An overwrite with the same size, right after a note was taken.
	e.m.Generation()
	if _, err := f.WriteAt([]byte("y"), 4); err != nil {
		t.Fatal(err)
	}
	if g := e.m.Generation(); g == g1 {
		t.Error("a same-size overwrite did not move the generation")
	}
	g2 := settle()
	if _, err := f.WriteAt([]byte("z"), 5); err != nil {
		t.Fatal(err)
	}
	must(t, f.Close())
	// The last close notes the change.
	e.waitReleased("f")
	if g := e.m.Generation(); g == g2 {
		t.Error("a write by a handle closed since did not move the generation")
	}
	if got := e.read("f"); got != "012xyz6789" {
		t.Errorf("content %q", got)
	}
}

// TestPassthroughWriteMmapAcrossFreeze: a store through a shared writable
// mapping into a page that was dirty before a freeze still moves the
// generation (the freeze cleans the pages, so the store faults and stamps
// the file), or the daemon would take the last snapshot for the whole of
// it.
func TestPassthroughWriteMmapAcrossFreeze(t *testing.T) {
	e := mountEnv(t, nil, Options{})
	needPassthrough(t, e)
	f := e.ptWriter("f", strings.Repeat("a", 8192))
	b, err := unix.Mmap(int(f.Fd()), 0, 8192, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	must(t, err)
	copy(b, "dirty before the freeze")
	v, err := e.m.Freeze(t.Context())
	must(t, err)
	must(t, v.Close())
	time.Sleep(2 * ptRecent)
	e.m.Generation()
	g := e.m.Generation()
	copy(b, "stored after the freeze") // the page is still dirty: no fault
	must(t, unix.Munmap(b))
	must(t, f.Close())
	e.waitReleased("f")
	if got := e.m.Generation(); got == g {
		t.Error("a store through a shared mapping into a page dirty since before a freeze did not move the generation")
	}
	if live := e.read("f"); !strings.HasPrefix(live, "stored after the freeze") {
		t.Errorf("the mount shows %.30q", live)
	}
}

// TestPassthroughWriteLimit: files larger than PassthroughWriteMax are
// written through the daemon; so are opens while a view is open.
func TestPassthroughWriteLimit(t *testing.T) {
	e := mountEnv(t, nil, Options{PassthroughWriteMax: 8192})
	needPassthrough(t, e)
	must(t, os.WriteFile(e.path("big"), make([]byte, 8193), 0o644))
	must(t, os.WriteFile(e.path("small"), make([]byte, 8192), 0o644))
	// The writers' RELEASEs reach the daemon after close(2) returns.
	e.waitReleased("big")
	e.waitReleased("small")
	f, err := os.OpenFile(e.path("big"), os.O_RDWR, 0)
	must(t, err)
	if e.ptWritable("big") {
		t.Error("a file over the limit got writable passthrough")
	}
	f.Close()
	v, err := e.m.Freeze(context.Background())
	must(t, err)
	g, err := os.OpenFile(e.path("small"), os.O_RDWR, 0)
	must(t, err)
	if e.ptWritable("small") {
		t.Error("writable passthrough granted while a view is open")
	}
	if _, err := g.WriteAt([]byte("changed"), 0); err != nil {
		t.Fatal(err)
	}
	got, err := iofs.ReadFile(v, "small")
	must(t, err)
	if !bytes.Equal(got, make([]byte, 8192)) {
		t.Error("the view sees a write made after the freeze")
	}
	g.Close()
	must(t, v.Close())
	e.waitReleased("small")
	h, err := os.OpenFile(e.path("small"), os.O_RDWR, 0)
	must(t, err)
	defer h.Close()
	if !e.ptWritable("small") {
		t.Error("no writable passthrough once the view is closed")
	}
}

// TestPassthroughWriteFreezeEdges: a freeze with files written through
// passthrough that were unlinked, renamed (with their directory), or
// chmod'ed meanwhile.
func TestPassthroughWriteFreezeEdges(t *testing.T) {
	e := mountEnv(t, nil, Options{})
	needPassthrough(t, e)
	must(t, os.MkdirAll(e.path("d/e"), 0o755))
	kept := e.ptWriter("d/e/kept", "kept")
	gone := e.ptWriter("gone", "gone")
	must(t, os.Remove(e.path("gone")))
	must(t, os.Rename(e.path("d"), e.path("moved")))
	must(t, os.Chmod(e.path("moved/e/kept"), 0o600))
	if _, err := kept.WriteAt([]byte("KEPT"), 0); err != nil {
		t.Fatal(err)
	}
	v, err := e.m.Freeze(context.Background())
	must(t, err)
	got, err := iofs.ReadFile(v, "moved/e/kept")
	must(t, err)
	if string(got) != "KEPT" {
		t.Errorf("view: %q", got)
	}
	if _, err := iofs.Stat(v, "gone"); err == nil {
		t.Error("an unlinked file is in the view")
	}
	st, err := iofs.Stat(v, "moved/e/kept")
	must(t, err)
	if st.Mode().Perm() != 0o600 {
		t.Errorf("view mode %v", st.Mode())
	}
	must(t, v.Close())
	// The barrier left the mode and the writers alone.
	fi, err := os.Stat(e.path("moved/e/kept"))
	must(t, err)
	if fi.Mode().Perm() != 0o600 {
		t.Errorf("mode after the freeze %v", fi.Mode())
	}
	if _, err := gone.WriteAt([]byte("still"), 0); err != nil {
		t.Errorf("write to the unlinked file after the freeze: %v", err)
	}
	// A chmod to the mode the file has, and one to another, both work.
	must(t, os.Chmod(e.path("moved/e/kept"), 0o600))
	must(t, os.Chmod(e.path("moved/e/kept"), 0o640))
	fi, err = os.Stat(e.path("moved/e/kept"))
	must(t, err)
	if fi.Mode().Perm() != 0o640 {
		t.Errorf("mode after chmod %v", fi.Mode())
	}
}

// TestPassthroughWriteFreezeShadowed: a freeze reaches the files written
// through passthrough through the mount itself, not its path: with another
// file system mounted over the mountpoint it still stops and copies them.
func TestPassthroughWriteFreezeShadowed(t *testing.T) {
	e := mountEnv(t, nil, Options{})
	needPassthrough(t, e)
	f := e.ptWriter("f", "before")
	if err := unix.Mount("shadow", e.mnt, "tmpfs", 0, "size=1m"); err != nil {
		t.Skipf("mount tmpfs over the mountpoint: %v", err)
	}
	t.Cleanup(func() { unix.Unmount(e.mnt, unix.MNT_DETACH) })
	if _, err := f.WriteAt([]byte("BEFORE"), 0); err != nil {
		t.Fatal(err)
	}
	v, err := e.m.Freeze(context.Background())
	must(t, err)
	defer v.Close()
	if _, err := f.WriteAt([]byte("after!"), 0); err != nil {
		t.Fatal(err)
	}
	got, err := iofs.ReadFile(v, "f")
	must(t, err)
	if string(got) != "BEFORE" {
		t.Errorf("view: %q", got)
	}
	must(t, unix.Unmount(e.mnt, 0))
}

// TestPassthroughOpenRacesCopyUp: a read-only open of a lower file racing
// with a writable open that copies it up must not be given a cached handle
// beside the writer's passthrough one (the kernel fails the later open with
// EIO).
func TestPassthroughOpenRacesCopyUp(t *testing.T) {
	const files = 200
	lower, _ := packLower(t, func(dir string) {
		for i := 0; i < files; i++ {
			must(t, os.WriteFile(filepath.Join(dir, fmt.Sprintf("f%03d", i)), []byte("lower"), 0o644))
		}
	})
	e := mountEnv(t, lower, Options{})
	needPassthrough(t, e)
	for i := 0; i < files; i++ {
		p := e.path(fmt.Sprintf("f%03d", i))
		var wg sync.WaitGroup
		var werr, rerr error
		var w, r *os.File
		wg.Go(func() { w, werr = os.OpenFile(p, os.O_RDWR, 0) })
		wg.Go(func() { r, rerr = os.Open(p) })
		wg.Wait()
		for _, f := range []*os.File{w, r} {
			if f != nil {
				f.Close()
			}
		}
		if werr != nil || rerr != nil {
			t.Fatalf("%s: writable open: %v; read-only open: %v", p, werr, rerr)
		}
	}
}

// TestPTBarrierCheck: the kernel check behind writable passthrough passes
// here, leaves no mount behind, and a check mount left by a killed daemon
// is cleared at the next mount.
func TestPTBarrierCheck(t *testing.T) {
	e := mountEnv(t, nil, Options{})
	needPassthrough(t, e)
	if !e.m.ov.ptWriteOK.Load() {
		t.Fatalf("barrier check failed: %v", ptCheck.err)
	}
	work := filepath.Join(e.upper, workDirName)
	t0 := time.Now()
	if err := checkPTBarrier(work); err != nil {
		t.Fatalf("check again: %v", err)
	}
	t.Logf("the check took %v", time.Since(t0))
	if ms := MountsBelow(work); len(ms) != 0 {
		t.Fatalf("check mounts left: %v", ms)
	}
	if _, err := os.Stat(filepath.Join(work, ptCheckPrefix+strconv.Itoa(os.Getpid()))); !os.IsNotExist(err) {
		t.Errorf("check directory left: %v", err)
	}
	// A leftover: a mounted check directory in the work directory.
	e.unmount()
	left := filepath.Join(work, ptCheckPrefix+"1", "mnt")
	must(t, os.MkdirAll(left, 0o700))
	must(t, unix.Mount("leftover", left, "tmpfs", 0, "size=1m"))
	t.Cleanup(func() { unix.Unmount(left, unix.MNT_DETACH) })
	e.mount()
	if ms := MountsBelow(work); len(ms) != 0 {
		t.Errorf("leftover check mount not cleared: %v", ms)
	}
}

// TestPassthroughWriteBackingOutlivesWriter: a read-only open that shares
// the writable backing file of a passthrough writer keeps the file among
// those a freeze stops and copies after the writer closes; a writable open
// during the view then reaches that backing file through mmap, and the
// view must not see what it writes.
func TestPassthroughWriteBackingOutlivesWriter(t *testing.T) {
	e := mountEnv(t, nil, Options{})
	needPassthrough(t, e)
	w := e.ptWriter("f", strings.Repeat("a", 8192))
	r, err := os.Open(e.path("f"))
	must(t, err)
	defer r.Close()
	must(t, w.Close())
	n := e.m.ov.root.GetChild("f").Operations().(*node)
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(time.Millisecond) {
		n.mu.Lock()
		left := n.ptOpens
		n.mu.Unlock()
		if left == 1 {
			break // the writer's RELEASE is in
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d passthrough handles, want the reader's only", left)
		}
	}
	if !e.ptWritable("f") {
		t.Fatal("the file left the writers' record while a passthrough handle shares its writable backing")
	}
	v, err := e.m.Freeze(t.Context())
	must(t, err)
	defer v.Close()
	if v.WriteStall() <= 0 {
		t.Error("the freeze did not stop and copy the file")
	}
	m, err := os.OpenFile(e.path("f"), os.O_RDWR, 0)
	must(t, err)
	defer m.Close()
	b, err := unix.Mmap(int(m.Fd()), 0, 8192, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	must(t, err)
	copy(b, "changed after the freeze")
	must(t, unix.Msync(b, unix.MS_SYNC))
	must(t, unix.Munmap(b))
	got, err := iofs.ReadFile(v, "f")
	must(t, err)
	if string(got) != strings.Repeat("a", 8192) {
		t.Errorf("the view shows a write made after the freeze: %.30q", got)
	}
	if live := e.read("f"); !strings.HasPrefix(live, "changed after the freeze") {
		t.Errorf("the mount lost the write: %.30q", live)
	}
}
