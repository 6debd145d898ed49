package fs

import (
	"crypto/sha256"
	"fmt"
	"io"
	iofs "io/fs"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"sync"
	"syscall"
	"testing"
	"testing/fstest"
	"time"

	"github.com/hermesfs/hermesfs/archive"
)

// changeTree is the lower layer of the ChangeFS tests: a subtree nothing
// touches (untouched/), and one place for each overlay state.
func changeTree(dir string) {
	mustp := func(err error) {
		if err != nil {
			panic(err)
		}
	}
	mk := func(p string) { mustp(os.MkdirAll(filepath.Join(dir, p), 0o755)) }
	put := func(p, c string) {
		mk(path.Dir(p))
		mustp(os.WriteFile(filepath.Join(dir, p), []byte(c), 0o644))
	}
	for i := range 4 {
		for j := range 5 {
			for k := range 8 {
				put(fmt.Sprintf("untouched/d%d/e%d/f%d.txt", i, j, k), fmt.Sprintf("untouched %d %d %d", i, j, k))
			}
		}
	}
	put("sessions/s1.jsonl", strings.Repeat(`{"role":"user","content":"hello"}`+"\n", 50))
	put("sessions/s2.jsonl", "other session\n")
	put("a/b/c/file.txt", "deep file\n")
	put("a/b/sibling.txt", "sibling\n")
	put("a/other/x.txt", "x\n")
	big := make([]byte, 1<<20)
	for i := range big {
		big[i] = byte(i * 7 >> 3)
	}
	mk("data")
	mustp(os.WriteFile(filepath.Join(dir, "data/big.bin"), big, 0o644))
	put("memories/MEMORY.md", "lower memory")
	put("ren/dir/inside.txt", "inside\n")
	put("ren/dir/sub/deeper.txt", "deeper\n")
	put("opq/d/old.txt", "old\n")
	put("hl/x", "linked\n")
	mustp(os.Link(filepath.Join(dir, "hl/x"), filepath.Join(dir, "hl/y")))
	put("hl2/dir/f", "linked twice\n")
	mustp(os.Link(filepath.Join(dir, "hl2/dir/f"), filepath.Join(dir, "hl2/g")))
	put("long/"+strings.Repeat("L", 250), "long name\n")
	put("long/short", "short\n")
	put("atomic/conf.json", `{"v":1}`)
	put("perm/f", "perm\n")
	mk("links")
	mustp(os.Symlink("../perm/f", filepath.Join(dir, "links/old")))
	mustp(os.Symlink("../perm/f", filepath.Join(dir, "links/kept")))
	mk("pdir/inner")
	put("pdir/inner/p.txt", "p\n")
	mk("under/dir")
	put("under/dir/lower.txt", "lower\n")
	mtime := time.Date(2024, 5, 6, 7, 8, 9, 0, time.UTC)
	filepath.Walk(dir, func(p string, info os.FileInfo, err error) error {
		mustp(err)
		if info.Mode()&os.ModeSymlink == 0 {
			mustp(os.Chtimes(p, mtime, mtime))
		}
		return nil
	})
}

// countingFS passes a View to Pack and records what Pack asks of it.
type countingFS struct {
	v  *View
	mu sync.Mutex
	// calls: operation -> paths
	calls map[string][]string
}

func (c *countingFS) note(op, name string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.calls == nil {
		c.calls = map[string][]string{}
	}
	c.calls[op] = append(c.calls[op], name)
}

func (c *countingFS) Open(name string) (iofs.File, error) {
	c.note("open", name)
	return c.v.Open(name)
}

func (c *countingFS) ReadDir(name string) ([]iofs.DirEntry, error) {
	c.note("readdir", name)
	return c.v.ReadDir(name)
}

func (c *countingFS) Lstat(name string) (iofs.FileInfo, error) {
	c.note("lstat", name)
	return c.v.Lstat(name)
}

func (c *countingFS) ReadLink(name string) (string, error) {
	c.note("readlink", name)
	return c.v.ReadLink(name)
}

func (c *countingFS) BaseInode(name string) (archive.Inode, bool, bool) {
	c.note("baseinode", name)
	return c.v.BaseInode(name)
}

// visited is every path Pack asked anything about.
func (c *countingFS) visited() []string {
	c.mu.Lock()
	defer c.mu.Unlock()
	var out []string
	for _, ps := range c.calls {
		out = append(out, ps...)
	}
	return out
}

// extendView packs v with Extend on base (whose file is baseImg) and
// returns the result and the image the runs lay out, opened.
func extendView(t *testing.T, fsys iofs.FS, base *archive.Reader, baseImg string) (archive.PackResult, *archive.Reader, string) {
	t.Helper()
	seg := filepath.Join(tempDir(t), "seg")
	f, err := os.Create(seg)
	must(t, err)
	res, err := archive.Pack(t.Context(), f, fsys, archive.PackOptions{Segment: true, Extend: true, Base: base})
	f.Close()
	must(t, err)
	img := filepath.Join(tempDir(t), "image.sqfs")
	layRuns(t, res, seg, map[*archive.Reader]string{base: baseImg}, img)
	return res, openLower(t, img), img
}

// layRuns writes the image res.Runs describe into img: new bytes from the
// segment file seg, copies from the files of their source archives.
func layRuns(t *testing.T, res archive.PackResult, seg string, files map[*archive.Reader]string, img string) {
	t.Helper()
	out, err := os.Create(img)
	must(t, err)
	defer out.Close()
	open := map[string]*os.File{}
	for _, r := range res.Runs {
		name := seg
		if r.Source != nil {
			if name = files[r.Source]; name == "" {
				t.Fatalf("a run copies from an archive the test does not know")
			}
		}
		src := open[name]
		if src == nil {
			src, err = os.Open(name)
			must(t, err)
			defer src.Close()
			open[name] = src
		}
		if _, err := io.Copy(out, io.NewSectionReader(src, r.Offset, r.Length)); err != nil {
			t.Fatal(err)
		}
	}
	fi, err := out.Stat()
	must(t, err)
	if fi.Size() != res.Size {
		t.Fatalf("the runs lay out %d bytes, the pack says %d", fi.Size(), res.Size)
	}
}

// treeDesc describes every entry of fsys (type, permissions, owner,
// mtime seconds, size, content digest, symlink target) and which regular
// files are one inode.
func treeDesc(t *testing.T, fsys iofs.FS, skip []string) (map[string]string, [][]string) {
	t.Helper()
	out := map[string]string{}
	links := map[uint64][]string{}
	err := iofs.WalkDir(fsys, ".", func(p string, d iofs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if slices.Contains(skip, p) {
			return nil
		}
		fi, err := iofs.Lstat(fsys, p)
		if err != nil {
			return err
		}
		st := fi.Sys().(*syscall.Stat_t)
		desc := fmt.Sprintf("%v %d:%d mtime=%d", fi.Mode(), st.Uid, st.Gid, fi.ModTime().Unix())
		switch {
		case fi.Mode().IsRegular():
			b, err := iofs.ReadFile(fsys, p)
			if err != nil {
				return err
			}
			desc += fmt.Sprintf(" size=%d sha=%x", len(b), sha256.Sum256(b))
			if st.Nlink > 1 {
				links[st.Ino] = append(links[st.Ino], p)
			}
		case fi.Mode()&iofs.ModeSymlink != 0:
			tg, err := iofs.ReadLink(fsys, p)
			if err != nil {
				return err
			}
			desc += " -> " + tg
		}
		if p == "." {
			desc = fmt.Sprintf("%v", fi.Mode()) // the root's owner and time are the upper root's
		}
		out[p] = desc
		return nil
	})
	must(t, err)
	var groups [][]string
	for _, g := range links {
		if len(g) > 1 {
			sort.Strings(g)
			groups = append(groups, g)
		}
	}
	sort.Slice(groups, func(i, j int) bool { return groups[i][0] < groups[j][0] })
	return out, groups
}

// mountFS is the mounted tree as an io/fs FS with Lstat and ReadLink.
type mountFS struct{ dir string }

func (m mountFS) Open(name string) (iofs.File, error) { return os.DirFS(m.dir).Open(name) }
func (m mountFS) Lstat(name string) (iofs.FileInfo, error) {
	return os.Lstat(filepath.Join(m.dir, name))
}
func (m mountFS) ReadLink(name string) (string, error) {
	return os.Readlink(filepath.Join(m.dir, name))
}

// sameTree compares two trees, the paths in skip aside.
func sameTree(t *testing.T, what string, got, want iofs.FS, skip ...string) {
	t.Helper()
	g, gl := treeDesc(t, got, skip)
	w, wl := treeDesc(t, want, skip)
	for p, d := range w {
		if g[p] != d {
			t.Errorf("%s: %s is %q, want %q", what, p, g[p], d)
		}
	}
	for p := range g {
		if _, ok := w[p]; !ok {
			t.Errorf("%s: %s should not be there", what, p)
		}
	}
	if fmt.Sprint(gl) != fmt.Sprint(wl) {
		t.Errorf("%s: hard links %v, want %v", what, gl, wl)
	}
}

// TestViewChangeFS takes the overlay through every state it has (a
// one-line append, a deep change, a copy-up by range, a guarded file
// replaced by its staged content, a renamed lower directory, an opaque
// directory, hard links copied up with their names and one under a
// renamed directory left alone, a whiteout of a long name, an atomic
// write-and-rename, a chmod, symlinks made and removed, new trees, files
// taken in from underneath at boot) and packs the view by extending the
// lower archive: the pack extends (no fallback), visits nothing of the
// subtrees nobody touched, and its image is the mounted tree, read by our
// reader and by unsquashfs, with the numbers the lower objects had.
func TestViewChangeFS(t *testing.T) {
	t.Parallel()
	unsq := needTool(t, "unsquashfs")
	src := tempDir(t)
	changeTree(src)
	lowerImg := filepath.Join(tempDir(t), "lower.sqfs")
	lf, err := os.Create(lowerImg)
	must(t, err)
	_, err = archive.PackDir(t.Context(), lf, src, archive.PackOptions{})
	lf.Close()
	must(t, err)
	lower := openLower(t, lowerImg)
	lowerIno := func(p string) archive.Inode {
		fi, err := lower.FS().Lstat(p)
		must(t, err)
		return archive.Inode(fi.Sys().(*syscall.Stat_t).Ino)
	}

	g := &testGuard{max: 1 << 10}
	e := mountEnv(t, lower, Options{Guard: g, CopyUpByRangeMin: 256 << 10})

	// Files taken in from underneath: written into the mountpoint while
	// no mount covers it, adopted at the next mount.
	e.unmount()
	must(t, os.MkdirAll(filepath.Join(e.mnt, "under/dir"), 0o755))
	must(t, os.WriteFile(filepath.Join(e.mnt, "under/dir/adopted.txt"), []byte("from underneath\n"), 0o644))
	must(t, os.MkdirAll(filepath.Join(e.mnt, "underneath-new"), 0o755))
	must(t, os.WriteFile(filepath.Join(e.mnt, "underneath-new/n.txt"), []byte("new underneath\n"), 0o644))
	if _, err := Adopt(t.Context(), e.mnt, e.upper, lower, AdoptOptions{Stamp: "t"}); err != nil {
		t.Fatal(err)
	}
	os.RemoveAll(filepath.Join(e.mnt, "under"))
	os.RemoveAll(filepath.Join(e.mnt, "underneath-new"))
	e.mount()

	// The one-line change.
	s, err := os.OpenFile(e.path("sessions/s1.jsonl"), os.O_WRONLY|os.O_APPEND, 0)
	must(t, err)
	_, err = s.WriteString(`{"role":"assistant","content":"one line"}` + "\n")
	must(t, err)
	must(t, s.Close())
	e.write("a/b/c/file.txt", "deep file, changed\n")
	// Copy-up by range: a few bytes in the middle of a 1 MiB file.
	bf, err := os.OpenFile(e.path("data/big.bin"), os.O_WRONLY, 0)
	must(t, err)
	_, err = bf.WriteAt([]byte("changed in place"), 300<<10)
	must(t, err)
	must(t, bf.Close())
	// A guarded file replaced by its staged content.
	e.write("memories/MEMORY.md", "new memory")
	// A renamed lower directory (redirect marker), with a new file in it.
	must(t, os.Rename(e.path("ren/dir"), e.path("ren/moved")))
	e.write("ren/moved/added.txt", "added\n")
	// An opaque directory: removed and made again.
	must(t, os.RemoveAll(e.path("opq/d")))
	must(t, os.Mkdir(e.path("opq/d"), 0o755))
	e.write("opq/d/new.txt", "new\n")
	// A hard-linked lower file changed through one name: both names
	// become upper links to the copy.
	e.write("hl/x", "linked, changed\n")
	// A hard-linked lower file one of whose names is under a renamed
	// directory: that name stays the lower file.
	must(t, os.Rename(e.path("hl2/dir"), e.path("hl2/dir2")))
	must(t, os.Chmod(e.path("hl2/g"), 0o600))
	// A whiteout of a name too long for the prefix.
	must(t, os.Remove(e.path("long/"+strings.Repeat("L", 250))))
	// An atomic write-and-rename over a lower file.
	e.write("atomic/.conf.tmp", `{"v":2}`)
	must(t, os.Rename(e.path("atomic/.conf.tmp"), e.path("atomic/conf.json")))
	// Attributes only.
	must(t, os.Chmod(e.path("perm/f"), 0o640))
	must(t, os.Chmod(e.path("pdir"), 0o700))
	// Symlinks made and removed; new trees.
	must(t, os.Remove(e.path("links/old")))
	must(t, os.Symlink("../a/b/sibling.txt", e.path("links/new")))
	must(t, os.MkdirAll(e.path("newdir/sub"), 0o755))
	e.write("newdir/sub/file", "brand new\n")
	must(t, os.Link(e.path("newdir/sub/file"), e.path("newdir/hard")))

	v, err := e.m.Freeze(t.Context())
	must(t, err)
	defer v.Close()

	// What the view says of each state.
	claims := []struct {
		path      string
		ino       archive.Inode
		unchanged bool
		ok        bool
	}{
		{".", lower.Root(), false, true},
		{"untouched", lowerIno("untouched"), true, true},
		{"sessions", lowerIno("sessions"), false, true},
		{"sessions/s1.jsonl", lowerIno("sessions/s1.jsonl"), false, true},
		{"sessions/s2.jsonl", lowerIno("sessions/s2.jsonl"), true, true},
		{"a/b/c/file.txt", lowerIno("a/b/c/file.txt"), false, true},
		{"a/b/sibling.txt", lowerIno("a/b/sibling.txt"), true, true},
		{"a/other", lowerIno("a/other"), true, true},
		{"data/big.bin", lowerIno("data/big.bin"), false, true},
		{"memories/MEMORY.md", lowerIno("memories/MEMORY.md"), false, true},
		{"ren/moved", lowerIno("ren/dir"), false, true},
		{"ren/moved/sub", lowerIno("ren/dir/sub"), true, true},
		{"ren/moved/inside.txt", lowerIno("ren/dir/inside.txt"), true, true},
		{"ren/moved/added.txt", 0, false, false},
		{"opq/d", 0, false, false},
		{"opq/d/new.txt", 0, false, false},
		{"hl/x", lowerIno("hl/x"), false, true},
		{"hl/y", lowerIno("hl/x"), false, true},
		{"hl2/g", lowerIno("hl2/g"), false, true},
		{"hl2/dir2/f", lowerIno("hl2/g"), false, true}, // its copy claims the number too
		{"long", lowerIno("long"), false, true},
		{"long/short", lowerIno("long/short"), true, true},
		{"atomic/conf.json", 0, false, false},
		{"perm/f", lowerIno("perm/f"), false, true},
		{"pdir", lowerIno("pdir"), false, true},
		{"pdir/inner", lowerIno("pdir/inner"), true, true},
		{"links/kept", lowerIno("links/kept"), true, true},
		{"links/new", 0, false, false},
		{"newdir", 0, false, false},
		{"under/dir", lowerIno("under/dir"), false, true},
		{"under/dir/lower.txt", lowerIno("under/dir/lower.txt"), true, true},
		{"under/dir/adopted.txt", 0, false, false},
		{"underneath-new/n.txt", 0, false, false},
	}
	for _, c := range claims {
		ino, unch, ok := v.BaseInode(c.path)
		if ino != c.ino || unch != c.unchanged || ok != c.ok {
			t.Errorf("BaseInode(%s) = %d, %v, %v; want %d, %v, %v", c.path, ino, unch, ok, c.ino, c.unchanged, c.ok)
		}
	}

	cfs := &countingFS{v: v}
	res, img, imgPath := extendView(t, cfs, lower, lowerImg)
	if res.Base != archive.BaseExtended || res.ExtendFallback != "" {
		t.Fatalf("the pack did not extend the lower archive: base %q, fallback %q", res.Base, res.ExtendFallback)
	}
	for _, p := range cfs.visited() {
		if p == "untouched" {
			continue // listed in the root, then reused whole
		}
		for _, never := range []string{"untouched/", "a/other/", "ren/moved/sub/", "pdir/inner/"} {
			if strings.HasPrefix(p, never) {
				t.Errorf("the pack asked the view about %s, below a subtree nothing changed", p)
			}
		}
	}
	for _, p := range cfs.calls["readdir"] {
		switch p {
		case ".", "sessions", "a", "a/b", "a/b/c", "data", "memories", "ren", "ren/moved", "opq", "opq/d",
			"hl", "hl2", "hl2/dir2", "long", "atomic", "perm", "pdir", "links", "newdir", "newdir/sub",
			"under", "under/dir", "underneath-new":
		default:
			t.Errorf("the pack listed %s, which holds no change", p)
		}
	}
	t.Logf("view calls: %d readdir, %d lstat, %d baseinode, %d open; segment %d bytes of a %d-byte image",
		len(cfs.calls["readdir"]), len(cfs.calls["lstat"]), len(cfs.calls["baseinode"]), len(cfs.calls["open"]), res.SegmentSize, res.Size)

	// The mount confuses the two names of hl2 (a hard-linked file left
	// under a renamed directory when another name was copied up: the
	// copy and the lower file share the lower number, so one node, and
	// whichever name is looked up first hides the other): the view,
	// which reads the layers, has both.
	sameTree(t, "extended image against the view", img.FS(), v)
	sameTree(t, "extended image against the mount", img.FS(), mountFS{e.mnt}, "hl2/dir2/f", "hl2/g")
	dest := filepath.Join(tempDir(t), "x")
	if b, err := exec.Command(unsq, "-no-xattrs", "-d", dest, imgPath).CombinedOutput(); err != nil {
		t.Fatalf("unsquashfs: %v\n%s", err, b)
	}
	sameTree(t, "unsquashfs of the extended image", mountFS{dest}, v)

	// Numbers: unchanged and changed lower objects keep theirs; a file
	// replaced at its path by a write-and-rename takes the number of the
	// one it replaced.
	newIno := func(p string) archive.Inode {
		fi, err := img.FS().Lstat(p)
		must(t, err)
		return archive.Inode(fi.Sys().(*syscall.Stat_t).Ino)
	}
	for _, c := range []struct{ now, was string }{
		{"untouched/d1/e2/f3.txt", "untouched/d1/e2/f3.txt"},
		{"sessions/s1.jsonl", "sessions/s1.jsonl"},
		{"a/b/c/file.txt", "a/b/c/file.txt"},
		{"data/big.bin", "data/big.bin"},
		{"memories/MEMORY.md", "memories/MEMORY.md"},
		{"ren/moved", "ren/dir"},
		{"ren/moved/inside.txt", "ren/dir/inside.txt"},
		{"hl/x", "hl/x"},
		{"hl/y", "hl/x"},
		{"perm/f", "perm/f"},
		{"atomic/conf.json", "atomic/conf.json"},
	} {
		if got, want := newIno(c.now), lowerIno(c.was); got != want {
			t.Errorf("%s is inode %d in the new image, want %d (%s in the lower)", c.now, got, want, c.was)
		}
	}
}

// TestViewChangeFSOneLine packs a one-line change in a home of 120,000
// files by extending the lower archive: the pack asks the view about the
// directories on the changed file's path and their entries, and nothing
// else, whatever the home holds.
func TestViewChangeFSOneLine(t *testing.T) {
	t.Parallel()
	home := fstest.MapFS{}
	mtime := time.Date(2024, 5, 6, 7, 8, 9, 0, time.UTC)
	dir := &fstest.MapFile{Mode: iofs.ModeDir | 0o755, ModTime: mtime}
	const dirs, perDir = 400, 300 // 120,000 files in 400 directories of 4 trees
	for d := range dirs {
		p := fmt.Sprintf("agent/t%d/d%03d", d%4, d)
		home[p] = dir
		for f := range perDir {
			home[fmt.Sprintf("%s/f%03d.py", p, f)] = &fstest.MapFile{Data: []byte(fmt.Sprintf("# %d %d\n", d, f)), Mode: 0o644, ModTime: mtime}
		}
	}
	for _, p := range []string{".", "agent", "agent/t0", "agent/t1", "agent/t2", "agent/t3", "sessions"} {
		home[p] = dir
	}
	home["sessions/s1.jsonl"] = &fstest.MapFile{Data: []byte(`{"role":"user"}` + "\n"), Mode: 0o644, ModTime: mtime}
	lowerImg := filepath.Join(tempDir(t), "lower.sqfs")
	lf, err := os.Create(lowerImg)
	must(t, err)
	t0 := time.Now()
	_, err = archive.Pack(t.Context(), lf, home, archive.PackOptions{})
	lf.Close()
	must(t, err)
	t.Logf("lower: %d files packed in %v", len(home), time.Since(t0))
	lower := openLower(t, lowerImg)
	e := mountEnv(t, lower, Options{})
	s, err := os.OpenFile(e.path("sessions/s1.jsonl"), os.O_WRONLY|os.O_APPEND, 0)
	must(t, err)
	_, err = s.WriteString(`{"role":"assistant"}` + "\n")
	must(t, err)
	must(t, s.Close())

	v, err := e.m.Freeze(t.Context())
	must(t, err)
	defer v.Close()
	cfs := &countingFS{v: v}
	t1 := time.Now()
	res, img, _ := extendView(t, cfs, lower, lowerImg)
	t.Logf("pack %v: segment %d bytes; view calls: readdir %v, lstat %v, baseinode %v, open %v", time.Since(t1), res.SegmentSize,
		cfs.calls["readdir"], cfs.calls["lstat"], cfs.calls["baseinode"], cfs.calls["open"])
	if res.Base != archive.BaseExtended {
		t.Fatalf("the pack did not extend the lower archive: %q", res.ExtendFallback)
	}
	if got := fmt.Sprint(cfs.calls["readdir"]); got != "[. sessions]" {
		t.Errorf("the pack listed %s, want the root and sessions", got)
	}
	for _, p := range cfs.calls["open"] {
		if p != "sessions/s1.jsonl" {
			t.Errorf("the pack opened %s; only the changed file needs reading", p)
		}
	}
	for _, op := range []string{"lstat", "baseinode"} {
		for _, p := range cfs.calls[op] {
			if strings.HasPrefix(p, "agent/") {
				t.Errorf("the pack asked %s about %s, below a subtree nothing changed", op, p)
			}
		}
	}
	b, err := iofs.ReadFile(img.FS(), "sessions/s1.jsonl")
	must(t, err)
	if want := `{"role":"user"}` + "\n" + `{"role":"assistant"}` + "\n"; string(b) != want {
		t.Errorf("the changed file reads %q from the image, want %q", b, want)
	}
	if b, err := iofs.ReadFile(img.FS(), "agent/t3/d399/f299.py"); err != nil || string(b) != "# 399 299\n" {
		t.Errorf("an unchanged file reads %q, %v from the image", b, err)
	}
}
