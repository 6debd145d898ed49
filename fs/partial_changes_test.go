package fs

import (
	"bytes"
	"context"
	"fmt"
	"io"
	iofs "io/fs"
	"log/slog"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/hermesfs/hermesfs/archive"
)

// loadMaps reads the present-maps of upper layer upper (over lower) as a
// read-only mount would, without mounting.
func loadMaps(t testing.TB, upper string, lower Lower) []*partial {
	t.Helper()
	dir := filepath.Join(upper, partialDirName)
	fd, err := unix.Open(dir, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(fd)
	names, err := readNames(fd)
	if err != nil {
		t.Fatal(err)
	}
	s := &partialSet{ov: &overlay{lower: lower, log: slog.New(slog.NewTextHandler(io.Discard, nil))}, m: map[uint64]*partial{}, dir: fd}
	var out []*partial
	for _, name := range names {
		p, err := s.load(name, true)
		if err != nil {
			t.Fatalf("map %s: %v", name, err)
		}
		if p != nil {
			out = append(out, p)
		}
	}
	return out
}

// viewChanges opens rel in v and returns the changed function its file
// offers as an archive.PartialSource (nil if it offers none) and its
// frozen content. The source must name lower's inode of rel.
func viewChanges(t testing.TB, v *View, rel string, lower *archive.Reader) (func(off, n int64) bool, []byte) {
	t.Helper()
	f, err := v.Open(rel)
	must(t, err)
	defer f.Close()
	content, err := io.ReadAll(f)
	must(t, err)
	ps, ok := f.(archive.PartialSource)
	if !ok {
		// Not copied up (yet): the lower file itself.
		return nil, content
	}
	r, ino, changed, ok := ps.PartialArchiveSource()
	if !ok {
		return nil, content
	}
	want, err := lower.Lstat(rel)
	must(t, err)
	if r != lower || uint64(ino) != want.Sys().(*syscall.Stat_t).Ino {
		t.Fatalf("%s: partial source names inode %d of %p, want inode %d of the lower %p", rel, ino, r, want.Sys().(*syscall.Stat_t).Ino, lower)
	}
	return changed, content
}

// checkNoFalseUnchanged fails unless every range changed reports
// unchanged holds the lower bytes in content: change blocks, pack
// blocks, and odd ranges around them. It returns how many change blocks
// are reported unchanged.
func checkNoFalseUnchanged(t testing.TB, what string, changed func(off, n int64) bool, content, lower []byte) int {
	t.Helper()
	check := func(off, n int64) bool {
		if n <= 0 || changed(off, n) {
			return false
		}
		if off+n > int64(len(content)) || off+n > int64(len(lower)) || !bytes.Equal(content[off:off+n], lower[off:off+n]) {
			t.Fatalf("%s: bytes [%d, %d) reported unchanged but differ from the lower file's (size %d, lower %d)", what, off, off+n, len(content), len(lower))
		}
		return true
	}
	size := int64(len(content))
	unchanged := 0
	for off := int64(0); off < size+changeBlock; off += changeBlock {
		if check(off, min(changeBlock, size-off)) {
			unchanged++
		}
		check(off, 128<<10)
		check(off+1, 3*changeBlock-2)
		check(max(off-7, 0), 100)
	}
	check(0, size)
	return unchanged
}

// TestPartialChangesWritePaths changes a file copied up by range through
// every path that changes bytes, with its background copy held (partial)
// and complete, and checks what its view offers the packer: the lower
// inode, every change counted, the untouched blocks unchanged; the same
// after a remount.
func TestPartialChangesWritePaths(t *testing.T) {
	t.Parallel()
	const size = 3<<20 + 1234
	img, lowerContent := rangeImg(t, size, 21)
	lower := openLower(t, img)
	patch := randBytes(50_000, 22)
	type op struct {
		name string
		do   func(t *testing.T, e *env, f *os.File)
		// keep: offsets whose change block must be reported unchanged;
		// gone: the file is then not a partial source at all.
		keep []int64
		gone bool
	}
	ops := []op{
		{name: "write", do: func(t *testing.T, e *env, f *os.File) {
			_, err := f.WriteAt(patch[:5], 100_000)
			must(t, err)
		}, keep: []int64{0, 200_000, size - 10}},
		{name: "write-across-blocks", do: func(t *testing.T, e *env, f *os.File) {
			_, err := f.WriteAt(patch, 1_000_000)
			must(t, err)
		}, keep: []int64{0, 900_000, 1_100_000}},
		{name: "write-own-bytes", do: func(t *testing.T, e *env, f *os.File) {
			_, err := f.WriteAt(lowerContent[300_000:300_100], 300_000)
			must(t, err)
		}, keep: []int64{0, 400_000}},
		{name: "append", do: func(t *testing.T, e *env, f *os.File) {
			_, err := f.WriteAt(patch[:100], size+5)
			must(t, err)
		}, keep: []int64{0, size - 20_000}},
		{name: "cut-and-grow", do: func(t *testing.T, e *env, f *os.File) {
			must(t, f.Truncate(2_000_001))
			must(t, f.Truncate(size))
		}, keep: []int64{0, 1_900_000}},
		{name: "truncate-path", do: func(t *testing.T, e *env, f *os.File) {
			must(t, os.Truncate(e.path("big.db"), 2_500_000))
		}, keep: []int64{0, 2_400_000}},
		{name: "punch", do: func(t *testing.T, e *env, f *os.File) {
			must(t, unix.Fallocate(int(f.Fd()), unix.FALLOC_FL_PUNCH_HOLE|unix.FALLOC_FL_KEEP_SIZE, 1<<20, 40_000))
		}, keep: []int64{0, 2 << 20}},
		{name: "zero-range", do: func(t *testing.T, e *env, f *os.File) {
			must(t, unix.Fallocate(int(f.Fd()), unix.FALLOC_FL_ZERO_RANGE, 700_000, 10_000))
		}, keep: []int64{0, 800_000}},
		{name: "allocate", do: func(t *testing.T, e *env, f *os.File) {
			must(t, unix.Fallocate(int(f.Fd()), 0, 0, size+100_000))
		}, keep: []int64{0, 1 << 20, size - 10}},
		{name: "collapse", do: func(t *testing.T, e *env, f *os.File) {
			// FUSE passes neither to the daemon today (EOPNOTSUPP);
			// should it, the map is cut there.
			if err := unix.Fallocate(int(f.Fd()), unix.FALLOC_FL_COLLAPSE_RANGE, 1<<20, 64<<10); err != nil && err != unix.EOPNOTSUPP {
				t.Fatal(err)
			}
		}, keep: []int64{0, 1<<20 - changeBlock}},
		{name: "insert", do: func(t *testing.T, e *env, f *os.File) {
			// FUSE passes neither to the daemon today (EOPNOTSUPP);
			// should it, the map is cut there.
			if err := unix.Fallocate(int(f.Fd()), unix.FALLOC_FL_INSERT_RANGE, 1<<20, 64<<10); err != nil && err != unix.EOPNOTSUPP {
				t.Fatal(err)
			}
		}, keep: []int64{0, 1<<20 - changeBlock}},
		{name: "mmap-shared", do: func(t *testing.T, e *env, f *os.File) {
			mmapWrite(t, e.path("big.db"), 600_000, patch[:3000])
		}, keep: []int64{0, 700_000}},
		{name: "o-trunc", do: func(t *testing.T, e *env, f *os.File) {
			g, err := os.OpenFile(e.path("big.db"), os.O_RDWR|os.O_TRUNC, 0)
			must(t, err)
			_, err = g.WriteAt(lowerContent[:size], 0)
			must(t, err)
			must(t, g.Close())
		}, gone: true},
	}
	for _, held := range []bool{true, false} {
		for _, o := range ops {
			t.Run(fmt.Sprintf("%s/held=%v", o.name, held), func(t *testing.T) {
				t.Parallel()
				opts := rangeOpts(time.Millisecond)
				opts.holdCopyUps = held
				e := mountEnv(t, lower, opts)
				f, err := os.OpenFile(e.path("big.db"), os.O_RDWR, 0)
				must(t, err)
				defer f.Close()
				// The copy-up: a first write of the lower's own bytes.
				_, err = f.WriteAt(lowerContent[50_000:50_010], 50_000)
				must(t, err)
				if held {
					if ps := e.m.PartialCopyUps(); len(ps) != 1 {
						t.Fatalf("not partial: %+v", ps)
					}
				} else {
					waitComplete(t, e.m)
				}
				o.do(t, e, f)
				check := func(what string) {
					t.Helper()
					v, err := e.m.Freeze(t.Context())
					must(t, err)
					defer v.Close()
					changed, content := viewChanges(t, v, "big.db", lower)
					if changed == nil {
						if !o.gone {
							t.Fatalf("%s: no partial source", what)
						}
						return
					}
					if o.gone {
						t.Fatalf("%s: still a partial source", what)
					}
					n := checkNoFalseUnchanged(t, what, changed, content, lowerContent)
					for _, off := range o.keep {
						b := off / changeBlock * changeBlock
						if changed(b, min(changeBlock, int64(min(len(content), len(lowerContent)))-b)) {
							t.Errorf("%s: block at %d reported changed; %d blocks unchanged", what, b, n)
						}
					}
				}
				check("live")
				must(t, f.Close())
				e.remount()
				check("remounted")
				if held {
					e.m.holdCopyUps(false)
					// Resumed when the file is next used.
					_, err := os.Stat(e.path("big.db"))
					must(t, err)
					waitComplete(t, e.m)
					check("completed after the remount")
				}
			})
		}
	}
}

// TestPartialChangesPassthrough: a complete file copied up by range keeps
// its writable opens off passthrough (the daemon records their changes);
// one the kernel forces into passthrough (read-only passthrough handles
// are open) gives the knowledge up first.
func TestPartialChangesPassthrough(t *testing.T) {
	t.Parallel()
	const size = 3 << 20
	img, lowerContent := rangeImg(t, size, 23)
	lower := openLower(t, img)
	e := mountEnv(t, lower, rangeOpts(time.Millisecond))
	needPassthrough(t, e)
	must(t, os.WriteFile(e.path("x"), []byte("x"), 0o644)) // the write check of ptcheck.go
	f, err := os.OpenFile(e.path("big.db"), os.O_RDWR, 0)
	must(t, err)
	_, err = f.WriteAt([]byte("one"), 100_000)
	must(t, err)
	must(t, f.Close())
	waitComplete(t, e.m)
	e.waitReleased("big.db")

	f, err = os.OpenFile(e.path("big.db"), os.O_RDWR, 0)
	must(t, err)
	if e.ptWritable("big.db") {
		t.Fatal("a writable open of a file whose changes are recorded got passthrough")
	}
	_, err = f.WriteAt([]byte("two"), 1_500_000)
	must(t, err)
	must(t, f.Close())
	e.waitReleased("big.db")
	v, err := e.m.Freeze(t.Context())
	must(t, err)
	changed, content := viewChanges(t, v, "big.db", lower)
	if changed == nil || !changed(1_500_000, 3) || changed(0, changeBlock) {
		t.Fatal("the daemon-served write is not recorded, or all is changed")
	}
	checkNoFalseUnchanged(t, "daemon-served", changed, content, lowerContent)
	must(t, v.Close())

	// A read-only open in passthrough, then a writable one: the kernel
	// puts it in passthrough too, its mmap writes unseen.
	r, err := os.Open(e.path("big.db"))
	must(t, err)
	defer r.Close()
	w, err := os.OpenFile(e.path("big.db"), os.O_RDWR, 0)
	must(t, err)
	defer w.Close()
	m, err := unix.Mmap(int(w.Fd()), 0, 1<<20, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err == nil {
		copy(m[300_000:], "three")
		unix.Msync(m, unix.MS_SYNC)
		unix.Munmap(m)
	}
	v, err = e.m.Freeze(t.Context())
	must(t, err)
	defer v.Close()
	if changed, content := viewChanges(t, v, "big.db", lower); changed != nil {
		checkNoFalseUnchanged(t, "passthrough", changed, content, lowerContent)
		if !changed(0, changeBlock) {
			t.Fatal("a writable open in passthrough left bytes reported unchanged")
		}
	}
}

var _ iofs.File = (*viewFile)(nil)

// mmapWrite writes data at off into the file at path through a shared
// mapping, from another process: a page fault on the mount in the process
// that serves it can stall the Go runtime's stop-the-world forever.
func mmapWrite(t testing.TB, path string, off int64, data []byte) {
	t.Helper()
	cmd := exec.Command(os.Args[0])
	cmd.Env = append(os.Environ(), helperEnv+"=mmap-write", "HELPER_FILE="+path, "HELPER_OFF="+strconv.FormatInt(off, 10))
	cmd.Stdin = bytes.NewReader(data)
	if out, err := cmd.CombinedOutput(); err != nil || len(out) != 0 {
		t.Fatalf("mmap write at %d: %v %s", off, err, out)
	}
}

// mmapWriteHelper is mmapWrite's other process: it writes its standard
// input at off into path through a shared mapping, synced.
func mmapWriteHelper(path, offStr string) int {
	fail := func(err error) int {
		fmt.Println("error:", err)
		return 1
	}
	off, err := strconv.ParseInt(offStr, 10, 64)
	if err != nil {
		return fail(err)
	}
	data, err := io.ReadAll(os.Stdin)
	if err != nil {
		return fail(err)
	}
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		return fail(err)
	}
	defer f.Close()
	m, err := unix.Mmap(int(f.Fd()), 0, int(off)+len(data), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		return fail(err)
	}
	copy(m[off:], data)
	if err := unix.Msync(m, unix.MS_SYNC); err != nil {
		return fail(err)
	}
	if err := unix.Munmap(m); err != nil {
		return fail(err)
	}
	return 0
}

// helperChanges freezes m and checks the view's file rel as a partial
// source: every byte reported unchanged must be the lower file's. It
// returns "changes none" (no source), "changes unchanged=N of M" (change
// blocks) or "error: ...".
func helperChanges(m *Mounted, rel string) string {
	v, err := m.Freeze(context.Background())
	if err != nil {
		return "error: " + err.Error()
	}
	defer v.Close()
	f, err := v.Open(rel)
	if err != nil {
		return "error: " + err.Error()
	}
	defer f.Close()
	content, err := io.ReadAll(f)
	if err != nil {
		return "error: " + err.Error()
	}
	ps, ok := f.(archive.PartialSource)
	if !ok {
		// Never copied up: the lower file.
		return "changes none"
	}
	r, ino, changed, ok := ps.PartialArchiveSource()
	if !ok {
		return "changes none"
	}
	a, err := r.Stat(ino)
	if err != nil {
		return "error: " + err.Error()
	}
	lower := make([]byte, a.Size)
	if k, err := r.ReadAt(ino, lower, 0); k != len(lower) {
		return fmt.Sprintf("error: lower read: %d bytes, %v", k, err)
	}
	unchanged, total := 0, 0
	for off := int64(0); off < int64(len(content)); off += changeBlock {
		total++
		n := min(changeBlock, int64(len(content))-off)
		if changed(off, n) {
			continue
		}
		unchanged++
		if off+n > int64(len(lower)) || !bytes.Equal(content[off:off+n], lower[off:off+n]) {
			return fmt.Sprintf("error: bytes [%d, %d) reported unchanged but differ from the lower file's", off, off+n)
		}
	}
	return fmt.Sprintf("changes unchanged=%d of %d", unchanged, total)
}

// TestPartialChangesKill SIGKILLs (or stops) a mount process while a file
// copied up by range is written, cut and punched, then mounts again and
// checks what the view offers the packer: after a kill (no machine crash)
// the changes recorded are all there and the file still has unchanged
// blocks; after a simulated reboot every doubt counts as changed; after a
// clean stop the knowledge survives a reboot, unless the file was changed
// while no mount tracked it.
func TestPartialChangesKill(t *testing.T) {
	t.Parallel()
	type tc struct {
		name          string
		newBoot, held bool
		clean         bool // SIGTERM: an unmount, not a kill
		handEdit      bool // the upper file changed while unmounted
	}
	for _, c := range []tc{
		{name: "kill", held: true},
		{name: "kill-racing-copy"},
		{name: "kill-reboot", newBoot: true, held: true},
		{name: "kill-reboot-racing-copy", newBoot: true},
		{name: "clean-reboot", clean: true, newBoot: true, held: true},
		{name: "clean-hand-edit", clean: true, held: true, handEdit: true},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			seed := uint64(time.Now().UnixNano())
			t.Logf("seed %d", seed)
			rng := rand.New(rand.NewPCG(seed, 7))
			img, _ := rangeImg(t, 2<<20, seed)
			base := tempDir(t)
			mnt, upper := filepath.Join(base, "mnt"), filepath.Join(base, "upper")
			must(t, os.Mkdir(mnt, 0o755))
			first := "HELPER_RANGE=1048576,16384,20ms"
			if c.held {
				first += ",hold"
			}
			mode := "mount"
			if c.clean {
				mode = "mount-exit"
			}
			p, line := startHelper(t, mode, mnt, upper, img, nil, first)
			if line != "ready" {
				t.Fatalf("helper: %s", line)
			}
			t.Cleanup(func() {
				p.cmd.Process.Kill()
				unix.Unmount(mnt, unix.MNT_DETACH)
			})
			f, err := os.OpenFile(filepath.Join(mnt, "big.db"), os.O_RDWR, 0)
			must(t, err)
			var stop atomic.Bool
			done := make(chan struct{})
			go func() {
				defer close(done)
				pool := randBytes(64<<10, seed+1)
				for i := 0; !stop.Load(); i++ {
					var err error
					switch i % 10 {
					case 3:
						cut := int64(1<<20 + rng.IntN(1<<20))
						if err = f.Truncate(cut); err == nil {
							err = f.Truncate(2 << 20)
						}
					case 5:
						err = unix.Fallocate(int(f.Fd()), unix.FALLOC_FL_PUNCH_HOLE|unix.FALLOC_FL_KEEP_SIZE, int64(rng.IntN(2<<20)), int64(1+rng.IntN(40_000)))
					case 7:
						err = f.Sync()
					default:
						n := 1 + rng.IntN(20_000)
						_, err = f.WriteAt(pool[:n], int64(rng.IntN(2<<20-n)))
					}
					if err != nil {
						return
					}
					if i > 40 && c.held {
						// Few changes: most blocks must stay unchanged.
						<-time.After(time.Millisecond)
					}
				}
			}()
			time.Sleep(time.Duration(30+seed%150) * time.Millisecond)
			if c.clean {
				stop.Store(true)
				<-done
				f.Close()
				p.cmd.Process.Signal(unix.SIGTERM)
			} else {
				p.cmd.Process.Kill()
				stop.Store(true)
				<-done
				f.Close()
			}
			p.wait()
			unix.Unmount(mnt, unix.MNT_DETACH)
			if c.handEdit {
				// Every byte of the upper file, changed behind the
				// overlay's back.
				b, err := os.ReadFile(filepath.Join(upper, "big.db"))
				must(t, err)
				for i := range b {
					b[i] ^= 0x5a
				}
				must(t, os.WriteFile(filepath.Join(upper, "big.db"), b, 0o644))
			}
			env := []string{"HELPER_RANGE=1048576,16384,1ms,hold", "HELPER_FILE=big.db"}
			if c.newBoot {
				env = append(env, "HELPER_NEW_BOOT=1")
			}
			p2, line := startHelper(t, "changes", mnt, upper, img, nil, env...)
			rest, err := p2.wait()
			if err != nil || !strings.HasPrefix(line, "changes ") {
				t.Fatalf("changes: %s (%v) %s", line, err, rest)
			}
			t.Log(line)
			var unchanged, total int
			if line != "changes none" {
				if _, err := fmt.Sscanf(line, "changes unchanged=%d of %d", &unchanged, &total); err != nil {
					t.Fatal(err)
				}
			}
			switch {
			case c.handEdit || c.newBoot && !c.clean:
				if unchanged != 0 {
					t.Fatalf("%s: want every byte changed", line)
				}
			case c.held && unchanged == 0:
				t.Fatalf("%s: the knowledge of unchanged blocks was lost", line)
			}
		})
	}
}

// TestPartialChangesRandom runs random writes, cuts grown back, shrinks,
// punches, mmap writes, syncs and remounts on a file copied up by range,
// its background copy held and let go at random, against a shadow, and at
// random points checks the view: its content is the shadow's, no byte
// reported unchanged differs from the lower file's, and every change
// block nothing touched (below the smallest cut) is reported unchanged.
func TestPartialChangesRandom(t *testing.T) {
	t.Parallel()
	for round := range 3 {
		t.Run(strconv.Itoa(round), func(t *testing.T) {
			t.Parallel()
			seed := uint64(time.Now().UnixNano()) + uint64(round)
			if s, err := strconv.ParseUint(os.Getenv("HERMESFS_TEST_SEED"), 10, 64); err == nil {
				seed = s
			}
			t.Logf("seed %d", seed)
			rng := rand.New(rand.NewPCG(seed, 9))
			verbose := os.Getenv("HERMESFS_TEST_SEED") != ""
			const size = 2<<20 + 777
			img, lowerContent := rangeImg(t, size, seed)
			lower := openLower(t, img)
			opts := rangeOpts(time.Millisecond)
			opts.holdCopyUps = true
			e := mountEnv(t, lower, opts)
			model := append([]byte(nil), lowerContent...)
			touched := map[int64]bool{}
			cutMin := int64(size)
			pool := randBytes(1<<20, seed+1)
			open := func() *os.File {
				f, err := os.OpenFile(e.path("big.db"), os.O_RDWR, 0)
				must(t, err)
				return f
			}
			f := open()
			defer func() { f.Close() }()
			touch := func(off, n int64) {
				for b := off / changeBlock; b*changeBlock < off+n; b++ {
					touched[b] = true
				}
			}
			resize := func(n int) {
				if n < len(model) {
					cutMin = min(cutMin, int64(n))
					model = model[:n]
				} else {
					model = append(model, make([]byte, n-len(model))...)
				}
			}
			checks := 0
			copied := false
			for i := 0; i < 600; i++ {
				if i%100 == 0 {
					t.Logf("op %d", i)
				}
				k := rng.IntN(100)
				copied = copied || k < 67
				if verbose {
					t.Logf("op %d: %d (size %d)", i, k, len(model))
				}
				switch {
				case k < 45:
					n := 1 + rng.IntN(40_000)
					off := rng.IntN(len(model) + 30_000)
					_, err := f.WriteAt(pool[:n], int64(off))
					must(t, err)
					if off+n > len(model) {
						resize(off + n)
					}
					copy(model[off:], pool[:n])
					touch(int64(off), int64(n))
				case k < 52:
					c := len(model) - 1 - rng.IntN(min(len(model), 200_000))
					must(t, f.Truncate(int64(c)))
					must(t, f.Truncate(int64(len(model))))
					cutMin = min(cutMin, int64(c))
					clear(model[c:])
				case k < 54 && len(model) > 1<<20:
					c := len(model) - rng.IntN(len(model)/16)
					must(t, f.Truncate(int64(c)))
					resize(c)
				case k < 62:
					off, n := rng.IntN(len(model)), 1+rng.IntN(50_000)
					must(t, unix.Fallocate(int(f.Fd()), unix.FALLOC_FL_PUNCH_HOLE|unix.FALLOC_FL_KEEP_SIZE, int64(off), int64(n)))
					clear(model[off:min(off+n, len(model))])
					touch(int64(off), int64(n))
				case k < 67 && len(model) > 1<<20:
					off, n := rng.IntN(1<<20-5000), 1+rng.IntN(5000)
					mmapWrite(t, e.path("big.db"), int64(off), pool[off:off+n])
					copy(model[off:], pool[off:off+n])
					touch(int64(off), int64(n))
				case k < 72:
					must(t, f.Sync())
				case k < 78:
					e.m.holdCopyUps(rng.IntN(2) == 0)
				case k < 80:
					must(t, f.Close())
					e.remount()
					e.m.holdCopyUps(rng.IntN(2) == 0)
					f = open()
				case k < 90:
					checks++
					v, err := e.m.Freeze(t.Context())
					must(t, err)
					changed, content := viewChanges(t, v, "big.db", lower)
					if !bytes.Equal(content, model) {
						t.Fatalf("op %d: the view's content is not the shadow's", i)
					}
					if changed == nil {
						if copied {
							t.Fatalf("op %d: no partial source", i)
						}
						must(t, v.Close())
						continue
					}
					checkNoFalseUnchanged(t, fmt.Sprintf("op %d", i), changed, content, lowerContent)
					for b := int64(0); (b+1)*changeBlock <= min(cutMin, int64(len(model))); b++ {
						if !touched[b] && changed(b*changeBlock, changeBlock) {
							t.Fatalf("op %d: block %d reported changed, untouched below the cut at %d", i, b, cutMin)
						}
					}
					must(t, v.Close())
				}
			}
			t.Logf("%d checks, %d blocks touched, smallest cut %d", checks, len(touched), cutMin)
		})
	}
}

// TestPartialChangesPack packs the view of a file copied up by range and
// written, partial and complete, live and after a remount: the image holds
// the frozen content (unsquashfs), and only the blocks with a change were
// read and compressed; every other one is the lower archive's block,
// reused (PackResult.ReusedBytes).
func TestPartialChangesPack(t *testing.T) {
	t.Parallel()
	unsq := needTool(t, "unsquashfs")
	const bs = 128 << 10 // the pack's block size
	const size = 24 * bs
	img, lowerContent := rangeImg(t, size, 31)
	lower := openLower(t, img)
	for _, held := range []bool{true, false} {
		t.Run(fmt.Sprintf("held=%v", held), func(t *testing.T) {
			t.Parallel()
			opts := rangeOpts(time.Millisecond)
			opts.holdCopyUps = held
			e := mountEnv(t, lower, opts)
			want := append([]byte(nil), lowerContent...)
			write := func(off int64, b []byte) {
				t.Helper()
				f, err := os.OpenFile(e.path("big.db"), os.O_RDWR, 0)
				must(t, err)
				_, err = f.WriteAt(b, off)
				must(t, err)
				must(t, f.Close())
			}
			// Blocks 0 and 7 (across into 8) change.
			write(100_000, []byte("first"))
			copy(want[100_000:], "first")
			patch := randBytes(50_000, 32)
			write(8*bs-20_000, patch)
			copy(want[8*bs-20_000:], patch)
			if held {
				if ps := e.m.PartialCopyUps(); len(ps) != 1 {
					t.Fatalf("not partial: %+v", ps)
				}
			} else {
				waitComplete(t, e.m)
			}
			pack := func(what string, changedBlocks int64) {
				t.Helper()
				v, err := e.m.Freeze(t.Context())
				must(t, err)
				defer v.Close()
				// After the freeze: block 20 changes; the image must
				// not have it.
				write(20*bs+5, []byte("after"))
				defer func() {
					write(20*bs+5, lowerContent[20*bs+5:20*bs+10])
				}()
				// Without a base, and with the lower as Base as the
				// daemon packs (the file's size is one Base has: it
				// must not be read whole to look for it there).
				for _, base := range []*archive.Reader{nil, lower} {
					what := fmt.Sprintf("%s, base %v", what, base != nil)
					out := filepath.Join(tempDir(t), "snap.sqfs")
					of, err := os.Create(out)
					must(t, err)
					res, err := archive.Pack(t.Context(), of, v, archive.PackOptions{BlockSize: bs, Base: base})
					of.Close()
					must(t, err)
					dest := filepath.Join(tempDir(t), "x")
					if b, err := exec.Command(unsq, "-no-xattrs", "-d", dest, out).CombinedOutput(); err != nil {
						t.Fatalf("%s: unsquashfs: %v\n%s", what, err, b)
					}
					checkFile(t, filepath.Join(dest, "big.db"), want, what+": packed file")
					checkFile(t, filepath.Join(dest, "small.txt"), []byte("small"), what+": packed small file")
					// small.txt (5 bytes) is the lower file itself,
					// reused whole. Of the blocks read, block 20 (its
					// frozen bytes the lower's) is found in Base.
					wantMatched := int64(0)
					if base != nil {
						wantMatched = bs
					}
					if wantReused := (size/bs-changedBlocks)*bs + 5; res.ReusedBytes != wantReused || res.MatchedBytes != wantMatched {
						t.Errorf("%s: %d bytes reused, %d read and found in Base, want %d reused (every block but the %d changed) and %d found", what, res.ReusedBytes, res.MatchedBytes, wantReused, changedBlocks, wantMatched)
					}
				}
			}
			// Blocks 0, 7, 8 written; 20 changed after the freeze (read
			// from the view, the lower's bytes).
			pack("live", 4)
			e.remount()
			pack("remounted", 4)
			if held {
				e.m.holdCopyUps(false)
				_, err := os.Stat(e.path("big.db"))
				must(t, err)
				waitComplete(t, e.m)
				pack("completed after the remount", 4)
			}
		})
	}
}
