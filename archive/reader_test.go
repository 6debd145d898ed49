package archive

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	iofs "io/fs"
	"math/rand/v2"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
)

// Many goroutines reading random ranges of many files through a small
// cache (so blocks are evicted and loaded concurrently) always get the
// right bytes.
func TestConcurrentReadAt(t *testing.T) {
	src := makeTree(t)
	p, _ := packToFile(t, src, PackOptions{BlockSize: 16 << 10})
	f, _ := os.Open(p)
	defer f.Close()
	st, _ := f.Stat()
	r, err := Open(f, st.Size(), ReaderOptions{Name: "a", CacheBytes: 64 << 10})
	if err != nil {
		t.Fatal(err)
	}
	type file struct {
		ino  Inode
		data []byte
	}
	var files []file
	for _, name := range []string{"sessions/big.json", "random.bin", "sparse.db", "logs/agent.log", "sessions/small.json", "config.yaml", "sessions/dup-of-big.json"} {
		a, err := r.resolve("t", name, false)
		if err != nil {
			t.Fatal(err)
		}
		data, _ := os.ReadFile(filepath.Join(src, name))
		files = append(files, file{a.Ino, data})
	}
	var wg sync.WaitGroup
	var bad atomic.Int32
	for g := range 16 {
		wg.Go(func() {
			rng := rand.New(rand.NewPCG(uint64(g), 7))
			buf := make([]byte, 70000)
			for range 300 {
				fl := files[rng.IntN(len(files))]
				off := rng.Int64N(int64(len(fl.data)) + 10)
				n := rng.IntN(len(buf))
				got, err := r.ReadAt(fl.ino, buf[:n], off)
				want := max(0, min(int64(n), int64(len(fl.data))-off))
				if int64(got) != want || (err != nil && err != io.EOF) || (want < int64(n) && err != io.EOF) {
					bad.Add(1)
					t.Errorf("ReadAt(%d, %d bytes, %d): %d, %v; want %d", fl.ino, n, off, got, err, want)
					return
				}
				if want > 0 && !bytes.Equal(buf[:got], fl.data[off:off+want]) {
					bad.Add(1)
					t.Errorf("ReadAt(%d, %d bytes, %d): wrong bytes", fl.ino, n, off)
					return
				}
			}
		})
	}
	wg.Wait()
	if r.cache.cur > r.cache.max {
		t.Errorf("cache holds %d bytes, bound %d", r.cache.cur, r.cache.max)
	}
}

// countingReaderAt records the reads a Reader makes, as a ranged reader
// over an object store would see them.
type countingReaderAt struct {
	ra     io.ReaderAt
	calls  atomic.Int64
	bytes  atomic.Int64
	lo, hi int64 // reads overlapping [lo, hi) are counted in inRange
	inRng  atomic.Int64
}

func (c *countingReaderAt) ReadAt(p []byte, off int64) (int, error) {
	c.calls.Add(1)
	c.bytes.Add(int64(len(p)))
	if off < c.hi && c.lo < off+int64(len(p)) {
		c.inRng.Add(1)
	}
	return c.ra.ReadAt(p, off)
}

// Open reads a handful of small ranges, none of them proportional to the
// number of files and none in the data; a lookup reads metadata only, and
// a second one nothing; reading a small file reads its fragment block.
func TestOpenReadsOnlyMetadata(t *testing.T) {
	openBytes := map[int]int64{}
	for _, files := range []int{2000, 20000} {
		src := filepath.Join(t.TempDir(), "tree")
		writeFile(t, filepath.Join(src, "config.yaml"), []byte("a: 1\n"), 0o644)
		for i := range files {
			writeFile(t, filepath.Join(src, fmt.Sprintf("d%02d", i%50), fmt.Sprintf("f%05d.js", i)), text(100+i%300, i), 0o644)
		}
		p, res := packToFile(t, src, PackOptions{})
		f, _ := os.Open(p)
		defer f.Close()
		r0 := openFile(t, p)
		c := &countingReaderAt{ra: f, lo: superblockSize, hi: int64(r0.sb.InodeTable)}
		r, err := Open(c, res.Size, ReaderOptions{Name: "a"})
		if err != nil {
			t.Fatal(err)
		}
		if n := c.calls.Load(); n > 6 {
			t.Errorf("%d files: Open made %d reads", files, n)
		}
		if n := c.inRng.Load(); n > 0 {
			t.Errorf("%d files: Open made %d reads in the data", files, n)
		}
		openBytes[files] = c.bytes.Load()
		t.Logf("%d files: Open read %d bytes in %d reads (image %d bytes)", files, c.bytes.Load(), c.calls.Load(), res.Size)

		before := c.calls.Load()
		a, err := r.resolve("t", "d07/f00007.js", false)
		if err != nil {
			t.Fatal(err)
		}
		if n := c.inRng.Load(); n > 0 {
			t.Errorf("a lookup read the data (%d reads)", n)
		}
		if c.calls.Load() == before {
			t.Error("the first lookup read nothing: is the metadata read at Open?")
		}
		before = c.calls.Load()
		if _, err := r.resolve("t", "d07/f00007.js", false); err != nil {
			t.Fatal(err)
		}
		if c.calls.Load() != before {
			t.Error("a second lookup of the same name read the archive")
		}
		buf := make([]byte, a.Size)
		if _, err := r.ReadAt(a.Ino, buf, 0); err != nil {
			t.Fatal(err)
		}
		if n := c.inRng.Load(); n != 1 {
			t.Errorf("reading a small file made %d reads in the data, want 1 (its fragment block)", n)
		}
	}
	// The end of the trailer and the end of the image, each at most
	// tailRead (the index arrays past that are read on their own).
	for files, n := range openBytes {
		if n > 3*tailRead {
			t.Errorf("%d files: Open read %d bytes", files, n)
		}
	}
}

// The inode API reports missing names, wrong types and bad inode numbers
// with errors callers can test.
func TestInodeAPIErrors(t *testing.T) {
	src := makeTree(t)
	p, _ := packToFile(t, src, PackOptions{})
	r := openFile(t, p)
	root := r.Root()
	if _, err := r.Lookup(root, "no-such-name"); !errors.Is(err, iofs.ErrNotExist) {
		t.Errorf("Lookup of a missing name: %v", err)
	}
	file, _ := r.Lookup(root, "config.yaml")
	if _, err := r.Lookup(file.Ino, "x"); !errors.Is(err, syscall.ENOTDIR) {
		t.Errorf("Lookup in a file: %v", err)
	}
	if _, err := r.ReadDir(file.Ino); !errors.Is(err, syscall.ENOTDIR) {
		t.Errorf("ReadDir of a file: %v", err)
	}
	if _, err := r.Readlink(file.Ino); !errors.Is(err, syscall.EINVAL) {
		t.Errorf("Readlink of a file: %v", err)
	}
	if _, err := r.ReadAt(root, make([]byte, 1), 0); !errors.Is(err, syscall.EISDIR) {
		t.Errorf("ReadAt of a directory: %v", err)
	}
	for _, ino := range []Inode{0, Inode(r.Inodes() + 1), 1 << 31} {
		if _, err := r.Stat(ino); !errors.Is(err, iofs.ErrNotExist) {
			t.Errorf("Stat(%d): %v", ino, err)
		}
	}
	if _, err := r.ReadAt(file.Ino, make([]byte, 1), -1); err == nil {
		t.Error("ReadAt at a negative offset succeeded")
	}
	n, err := r.ReadAt(file.Ino, make([]byte, 10), file.Size)
	if n != 0 || err != io.EOF {
		t.Errorf("ReadAt at EOF: %d, %v", n, err)
	}
	// Hard links share one inode number and report their link count.
	a, _ := r.resolve("t", "memories/MEMORY.md", false)
	b, _ := r.resolve("t", "state-snapshots/MEMORY.link", false)
	if a.Ino != b.Ino || a.Nlink != 2 {
		t.Errorf("hard links: inodes %d and %d, nlink %d", a.Ino, b.Ino, a.Nlink)
	}
	// Symlinks in the io/fs view: followed inside the archive, refused
	// when they leave it.
	if _, err := r.FS().Stat("absolute"); err == nil {
		t.Error("an absolute symlink was followed")
	}
	if fi, err := r.FS().Stat("bin/sessions-link"); err != nil || !fi.IsDir() {
		t.Errorf("relative symlink to a directory: %v, %v", fi, err)
	}
	if tgt, err := r.ReadLink("dangling"); err != nil || tgt != "does/not/exist" {
		t.Errorf("ReadLink: %q, %v", tgt, err)
	}
}

// Archives written before the version 2 trailer read as they did: every
// entry with its nanoseconds, checked blocks, content sums; and a pack
// on one as its base (the first snapshot after an upgrade) copies its
// blocks and writes a version 2 trailer.
func TestReadTrailerV1(t *testing.T) {
	src := makeTree(t)
	p, _ := packToFile(t, src, PackOptions{trailerV1: true})
	r := openFile(t, p)
	if r.tr == nil || r.tr2 != nil {
		t.Fatal("not read as a version 1 archive")
	}
	if _, ok := r.Lineage(); ok {
		t.Error("a version 1 archive reports a lineage")
	}
	want := scanTree(t, src)
	compareTrees(t, want, scanArchive(t, r), compareOpts{nsec: true, owners: true, dirMtime: true, devices: true})
	if err := r.Verify(t.Context()); err != nil {
		t.Fatal(err)
	}
	q, res := packBase(t, WithBase(os.DirFS(src), r), PackOptions{Base: r})
	if res.ReusedBytes == 0 {
		t.Errorf("nothing reused from the version 1 base: %+v", res)
	}
	r2 := openFile(t, q)
	if r2.tr2 == nil {
		t.Fatal("the new archive has no version 2 trailer")
	}
	compareTrees(t, want, scanArchive(t, r2), compareOpts{nsec: true, owners: true, dirMtime: true, devices: true})
	if err := r2.Verify(t.Context()); err != nil {
		t.Fatal(err)
	}
	ino, off, word := fileBlock(t, r, "sessions/big.json", 1)
	c := copyFile(t, p)
	flipAt(t, c, int64(off)+int64(word&^dataUncompBit)/2)
	rc := openFile(t, c)
	if _, err := rc.ReadAt(ino, make([]byte, 4*r.bs), 0); !errors.Is(err, ErrCorrupt) {
		t.Errorf("a flipped byte in a version 1 archive: %v", err)
	}
}
