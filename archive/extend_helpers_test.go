package archive

import (
	iofs "io/fs"
	"os"
	"path"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
)

// changeTracker is a ChangeFS over a directory on disk: the test tells it
// what it changes since the base, as the overlay knows it.
type changeTracker struct {
	dir    string
	fsys   iofs.FS
	base   *Reader
	dirty  map[string]bool   // entries changed, created or moved since the base (and their ancestors)
	origin map[string]string // entries created or moved: the base path they were ("" for none)
}

func newTracker(dir string, base *Reader) *changeTracker {
	c := &changeTracker{dir: dir, fsys: os.DirFS(dir)}
	c.reset(base)
	return c
}

func (c *changeTracker) reset(base *Reader) {
	c.base, c.dirty, c.origin = base, map[string]bool{}, map[string]string{}
}

func (c *changeTracker) Open(name string) (iofs.File, error) { return c.fsys.Open(name) }
func (c *changeTracker) ReadDir(name string) ([]iofs.DirEntry, error) {
	return iofs.ReadDir(c.fsys, name)
}
func (c *changeTracker) Lstat(name string) (iofs.FileInfo, error) { return iofs.Lstat(c.fsys, name) }
func (c *changeTracker) ReadLink(name string) (string, error)     { return iofs.ReadLink(c.fsys, name) }

func (c *changeTracker) BaseInode(name string) (Inode, bool, bool) {
	orig, ok := c.originOf(name)
	if !ok {
		return 0, false, false
	}
	a, err := c.base.resolve("t", orig, false)
	if err != nil {
		return 0, false, false
	}
	unchanged := !c.dirty[name]
	if unchanged {
		for p := range c.dirty {
			if name == "." || strings.HasPrefix(p, name+"/") {
				unchanged = false
				break
			}
		}
	}
	return a.Ino, unchanged, true
}

// originOf is the base path of the entry at p, false for one created
// since the base.
func (c *changeTracker) originOf(p string) (string, bool) {
	for q := p; ; q = path.Dir(q) {
		if o, ok := c.origin[q]; ok {
			if o == "" {
				return "", false
			}
			if q == p {
				return o, true
			}
			return o + strings.TrimPrefix(p, q), true
		}
		if q == "." || q == "/" {
			return p, true
		}
	}
}

// touch marks p and its ancestors changed.
func (c *changeTracker) touch(p string) {
	for q := p; ; q = path.Dir(q) {
		c.dirty[q] = true
		if q == "." {
			return
		}
	}
}

// created marks p as a new entry.
func (c *changeTracker) created(p string) {
	c.origin[p] = ""
	c.touch(p)
}

// removed forgets p and everything below it.
func (c *changeTracker) removed(p string) {
	c.rekey(p, "")
	c.touch(path.Dir(p))
}

// moved records a rename of from to to (over whatever was at to).
func (c *changeTracker) moved(from, to string) {
	o, ok := c.originOf(from)
	c.rekey(to, "")
	c.rekey(from, to)
	if ok {
		c.origin[to] = o
	} else {
		c.origin[to] = ""
	}
	c.touch(path.Dir(from))
	c.touch(to)
}

// rekey moves the records below from to below to ("" drops them).
func (c *changeTracker) rekey(from, to string) {
	for _, m := range []map[string]bool{c.dirty} {
		for p := range m {
			if p == from || strings.HasPrefix(p, from+"/") {
				delete(m, p)
				if to != "" {
					m[to+strings.TrimPrefix(p, from)] = true
				}
			}
		}
	}
	for p, o := range c.origin {
		if p == from || strings.HasPrefix(p, from+"/") {
			delete(c.origin, p)
			if to != "" {
				c.origin[to+strings.TrimPrefix(p, from)] = o
			}
		}
	}
}

// extendImage packs src as an extension of base (Segment, Extend) and
// returns the image, laid out from its runs and written to a file.
func extendImage(t *testing.T, src iofs.FS, base *Reader, baseBytes []byte, opts PackOptions) (string, []byte, PackResult) {
	t.Helper()
	opts.Base, opts.Segment, opts.Extend = base, true, true
	segPath := filepath.Join(t.TempDir(), "seg")
	sf, err := os.Create(segPath)
	if err != nil {
		t.Fatal(err)
	}
	res, err := Pack(t.Context(), sf, src, opts)
	sf.Close()
	if err != nil {
		t.Fatal(err)
	}
	seg, _ := os.ReadFile(segPath)
	if int64(len(seg)) != res.SegmentSize {
		t.Fatalf("segment has %d bytes, SegmentSize %d", len(seg), res.SegmentSize)
	}
	im := &image{seg: seg, runs: res.Runs, src: map[*Reader][]byte{base: baseBytes}, size: res.Size}
	b := im.bytes(t)
	p := filepath.Join(t.TempDir(), "image.sqfs")
	if err := os.WriteFile(p, b, 0o644); err != nil {
		t.Fatal(err)
	}
	return p, b, res
}

// checkImage reads the image at p with every reader we promise and
// compares each with want: our reader (and Verify), unsquashfs (listing
// and extraction), go-diskfs and the kernel where it can mount.
func checkImage(t *testing.T, p string, want map[string]entryInfo) *Reader {
	t.Helper()
	return checkImageWith(t, p, want, true)
}

// checkImageWith is checkImage; without all, it leaves out unsquashfs's
// extraction (its listing, go-diskfs, our reader and the kernel are
// always checked).
func checkImageWith(t *testing.T, p string, want map[string]entryInfo, all bool) *Reader {
	t.Helper()
	r := openFile(t, p)
	compareTrees(t, want, scanArchive(t, r), compareOpts{nsec: true, owners: true, dirMtime: true, devices: true})
	if err := r.Verify(t.Context()); err != nil {
		t.Fatalf("Verify: %v", err)
	}
	unsquashfs := needTool(t, "unsquashfs")
	checkListing(t, run(t, unsquashfs, "-l", "-no-progress", p), want)
	root := os.Geteuid() == 0
	if all {
		out := filepath.Join(t.TempDir(), "x")
		run(t, unsquashfs, "-no-progress", "-d", out, p)
		compareTrees(t, want, scanTree(t, out), compareOpts{owners: root, devices: root, dirMtime: true})
	}
	checkGoDiskfsSample(t, p, want, 25)
	if mnt, err := tryKernelMount(t, p); err == nil {
		compareTrees(t, want, scanTree(t, mnt), compareOpts{owners: true, devices: true, dirMtime: true})
		checkKernelInodes(t, r, mnt)
	} else if os.Getenv("HERMESFS_TEST_STRICT") == "1" && root {
		t.Fatal(err)
	} else {
		t.Log(err)
	}
	return r
}

// checkListing compares the paths unsquashfs -l lists with want's.
func checkListing(t *testing.T, out string, want map[string]entryInfo) {
	t.Helper()
	listed := map[string]bool{}
	for _, l := range strings.Split(strings.TrimSuffix(out, "\n"), "\n") {
		rel, ok := strings.CutPrefix(l, "squashfs-root")
		if !ok {
			t.Errorf("unsquashfs -l: unexpected line %q", l)
			continue
		}
		if rel = strings.TrimPrefix(rel, "/"); rel == "" {
			rel = "."
		}
		if listed[rel] {
			t.Errorf("unsquashfs -l lists %s twice", rel)
		}
		listed[rel] = true
		if _, ok := want[rel]; !ok {
			t.Errorf("unsquashfs -l lists unexpected %s", rel)
		}
	}
	for p := range want {
		if !listed[p] {
			t.Errorf("unsquashfs -l does not list %s", p)
		}
	}
}

// checkKernelInodes checks that the kernel reports our inode numbers.
func checkKernelInodes(t *testing.T, r *Reader, mnt string) {
	t.Helper()
	bad := 0
	filepath.WalkDir(mnt, func(p string, d iofs.DirEntry, err error) error {
		if err != nil || bad > 5 {
			return err
		}
		rel, _ := filepath.Rel(mnt, p)
		a, err := r.resolve("t", filepath.ToSlash(rel), false)
		if err != nil {
			t.Errorf("%s: %v", rel, err)
			bad++
			return nil
		}
		fi, err := os.Lstat(p)
		if err != nil {
			return err
		}
		if st := fi.Sys().(*syscall.Stat_t); st.Ino != uint64(a.Ino) {
			t.Errorf("%s: kernel st_ino %d, archive inode %d", rel, st.Ino, a.Ino)
			bad++
		}
		return nil
	})
}

// callLog is a changeTracker that records the calls Pack makes of it.
type callLog struct {
	*changeTracker
	mu    sync.Mutex
	calls map[string][]string // method -> names, in call order
}

func (c *callLog) log(method, name string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.calls == nil {
		c.calls = map[string][]string{}
	}
	c.calls[method] = append(c.calls[method], name)
}

// list returns the names method was called with, in order.
func (c *callLog) list(method string) []string {
	c.mu.Lock()
	defer c.mu.Unlock()
	return slices.Clone(c.calls[method])
}

func (c *callLog) Open(name string) (iofs.File, error) {
	c.log("Open", name)
	return c.changeTracker.Open(name)
}

func (c *callLog) ReadDir(name string) ([]iofs.DirEntry, error) {
	c.log("ReadDir", name)
	return c.changeTracker.ReadDir(name)
}

func (c *callLog) Lstat(name string) (iofs.FileInfo, error) {
	c.log("Lstat", name)
	return c.changeTracker.Lstat(name)
}

func (c *callLog) ReadLink(name string) (string, error) {
	c.log("ReadLink", name)
	return c.changeTracker.ReadLink(name)
}
