package archive

import (
	"fmt"
	iofs "io/fs"
	"math/rand/v2"
	"os"
	"path"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

// randomRun changes a tree at random, generation after generation, and
// packs each generation by extending the previous image (compacting it
// now and then): every image is checked by every reader against the tree,
// and inode numbers are checked to stay with their objects.
type randomRun struct {
	t       *testing.T
	rng     *rand.Rand
	dir     string
	tr      *changeTracker
	bs      int
	when    time.Time
	hardOps bool // this generation touched a hard-linked file
}

// TestExtendRandomRun runs 64 generations (HERMESFS_EXTEND_GENERATIONS
// for more: the long run is 200, nine minutes of a loaded machine under
// -race, too long for the suite; HERMESFS_EXTEND_FULL=1 to have every
// image extracted by unsquashfs too; HERMESFS_EXTEND_SEED to replay one).
func TestExtendRandomRun(t *testing.T) {
	gens := 64
	if v, err := strconv.Atoi(os.Getenv("HERMESFS_EXTEND_GENERATIONS")); err == nil && v > 0 {
		gens = v
	}
	seed := uint64(time.Now().UnixNano())
	if v, err := strconv.ParseUint(os.Getenv("HERMESFS_EXTEND_SEED"), 10, 64); err == nil {
		seed = v
	}
	t.Logf("seed %d (HERMESFS_EXTEND_SEED=%d replays it)", seed, seed)
	rr := &randomRun{t: t, rng: rand.New(rand.NewPCG(seed, 27)), dir: filepath.Join(t.TempDir(), "tree"),
		bs: 4 << 10, when: time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)}
	rr.seed()
	opts := PackOptions{BlockSize: rr.bs}
	basePath, _ := packToFile(t, rr.dir, opts)
	baseBytes, _ := os.ReadFile(basePath)
	base := openFile(t, basePath)
	rr.tr = newTracker(rr.dir, base)
	uses := map[string]int{}
	full := 0
	for g := range gens {
		// Now and then the image is compacted before the next change
		// (halfway at the latest).
		compacted := false
		if g > 0 && (rr.rng.IntN(25) == 0 || g == gens/2 && uses["compact"] == 0) {
			img, data, res := compactImage(t, base, baseBytes, opts)
			uses["compact"]++
			if res.Base != BaseCompacted {
				t.Fatalf("generation %d: Compact: Base %q", g, res.Base)
			}
			r := checkImageWith(t, img, scanTree(t, rr.dir), true)
			full++
			rr.checkNumbers(g, base, r)
			if r.Generation() != 0 || r.GarbageBytes() != 0 {
				t.Errorf("generation %d: compacted image has generation %d, garbage %d", g, r.Generation(), r.GarbageBytes())
			}
			rr.checkLineage(g, base, r)
			if t.Failed() {
				t.Fatalf("generation %d: compaction failed", g)
			}
			base, baseBytes, compacted = r, data, true
			rr.tr.reset(base)
		}
		rr.hardOps = false
		for range 1 + rr.rng.IntN(6) {
			rr.op()
		}
		img, data, res := extendImage(t, rr.tr, base, baseBytes, opts)
		if res.Base != BaseExtended && !rr.hardOps {
			t.Fatalf("generation %d: not extended (%q): %s", g, res.Base, res.ExtendFallback)
		}
		uses[string(res.Base)]++
		want := scanTree(t, rr.dir)
		// Every image is read by our reader (and Verify), unsquashfs -l,
		// go-diskfs and the kernel; every eighth (and the last, every one
		// after a compaction or fallen back) also extracted by unsquashfs,
		// every one with HERMESFS_EXTEND_FULL=1.
		all := g%8 == 0 || g == gens-1 || compacted || res.Base != BaseExtended || os.Getenv("HERMESFS_EXTEND_FULL") == "1"
		r := checkImageWith(t, img, want, all)
		if all {
			full++
		}
		rr.checkNumbers(g, base, r)
		rr.checkLineage(g, base, r)
		if t.Failed() {
			t.Fatalf("generation %d failed (%s, segment %d bytes)", g, res.Base, res.SegmentSize)
		}
		base, baseBytes = r, data
		rr.tr.reset(base)
	}
	t.Logf("%d generations: %v; %d checked by every reader", gens, uses, full)
}

// checkLineage checks that r carries old's lineage on.
func (rr *randomRun) checkLineage(g int, old, r *Reader) {
	lo, _ := old.Lineage()
	if lr, ok := r.Lineage(); !ok || lr != lo {
		rr.t.Fatalf("generation %d: the lineage changed", g)
	}
}

// checkNumbers checks that every object of the new image the tracker says
// stood for an inode of the old one has its number, and that no two
// objects share one.
func (rr *randomRun) checkNumbers(g int, old, r *Reader) {
	t := rr.t
	byIno := map[Inode]string{}
	filepath.WalkDir(rr.dir, func(p string, d iofs.DirEntry, err error) error {
		if err != nil {
			t.Fatal(err)
		}
		rel, _ := filepath.Rel(rr.dir, p)
		rel = filepath.ToSlash(rel)
		a, err := r.resolve("t", rel, false)
		if err != nil {
			t.Fatalf("generation %d: %s: %v", g, rel, err)
		}
		if first, ok := byIno[a.Ino]; ok {
			f1, _ := os.Lstat(filepath.Join(rr.dir, first))
			f2, _ := os.Lstat(p)
			if !os.SameFile(f1, f2) {
				t.Fatalf("generation %d: %s and %s share inode %d", g, first, rel, a.Ino)
			}
		} else {
			byIno[a.Ino] = rel
		}
		if x, _, ok := rr.tr.BaseInode(rel); ok && x != a.Ino {
			st := "extended"
			if _, ok := r.Lineage(); !ok {
				st = "no lineage"
			}
			t.Fatalf("generation %d (%s): %s stood for inode %d, now has %d", g, st, rel, x, a.Ino)
		}
		return nil
	})
}

// seed makes the first tree: a bit of everything (devices and other
// owners where the test runs as root), a deep one, and a directory past
// one metadata block and past the index threshold.
func (rr *randomRun) seed() {
	t := rr.t
	for i := range 30 {
		rr.write(filepath.Join(rr.dir, "sessions", fmt.Sprintf("s%03d.json", i)), rr.content())
	}
	for i := range 600 {
		rr.write(filepath.Join(rr.dir, "big", fmt.Sprintf("entry-%04d-%s.js", i, strings.Repeat("n", i%40))), []byte(strconv.Itoa(i)))
	}
	deep := filepath.Join(rr.dir, "deep")
	for i := range 12 {
		deep = filepath.Join(deep, fmt.Sprintf("d%d", i))
	}
	rr.write(filepath.Join(deep, "leaf.txt"), rr.content())
	os.Symlink("sessions/s001.json", filepath.Join(rr.dir, "link"))
	os.Link(filepath.Join(rr.dir, "sessions", "s002.json"), filepath.Join(rr.dir, "s002.hard"))
	if err := syscall.Mkfifo(filepath.Join(rr.dir, "fifo"), 0o640); err != nil {
		t.Fatal(err)
	}
	if os.Geteuid() == 0 {
		if err := os.MkdirAll(filepath.Join(rr.dir, "dev"), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := syscall.Mknod(filepath.Join(rr.dir, "dev", "null"), syscall.S_IFCHR|0o666, int(mkdev(1, 3))); err != nil {
			t.Fatal(err)
		}
		if err := syscall.Mknod(filepath.Join(rr.dir, "dev", "loop"), syscall.S_IFBLK|0o660, int(mkdev(7, 300))); err != nil {
			t.Fatal(err)
		}
		os.Lchown(filepath.Join(rr.dir, "sessions", "s003.json"), 1000, 1000)
		os.Lchown(filepath.Join(rr.dir, "link"), 1000, 100)
	}
	rr.settle(rr.dir)
}

// settle gives every entry below dir a distinct sub-second mtime.
func (rr *randomRun) settle(dir string) {
	filepath.WalkDir(dir, func(p string, d iofs.DirEntry, err error) error {
		if err == nil {
			rr.stamp(p)
		}
		return err
	})
}

func (rr *randomRun) stamp(p string) {
	rr.when = rr.when.Add(1001*time.Millisecond + time.Duration(rr.rng.IntN(1e9)))
	ts := []syscall.Timespec{syscall.NsecToTimespec(rr.when.UnixNano()), syscall.NsecToTimespec(rr.when.UnixNano())}
	if err := utimesNoFollow(p, ts); err != nil {
		rr.t.Fatal(err)
	}
}

func (rr *randomRun) content() []byte {
	switch rr.rng.IntN(4) {
	case 0:
		return nil
	case 1:
		return text(1+rr.rng.IntN(rr.bs-1), rr.rng.IntN(1000))
	case 2:
		return append(text(rr.rng.IntN(3*rr.bs), rr.rng.IntN(1000)), noise(rr.rng.IntN(2*rr.bs), byte(rr.rng.IntN(256)))...)
	}
	return text(rr.bs*(1+rr.rng.IntN(6)), rr.rng.IntN(1000))
}

func (rr *randomRun) write(p string, data []byte) {
	writeFile(rr.t, p, data, 0o644)
}

// entries lists the tree's paths (relative), directories if dirs, else
// the other entries; "." excluded.
func (rr *randomRun) entries(dirs bool) []string {
	var out []string
	filepath.WalkDir(rr.dir, func(p string, d iofs.DirEntry, err error) error {
		if err != nil || p == rr.dir {
			return err
		}
		if d.IsDir() == dirs {
			rel, _ := filepath.Rel(rr.dir, p)
			out = append(out, filepath.ToSlash(rel))
		}
		return nil
	})
	sort.Strings(out)
	return out
}

func (rr *randomRun) pick(dirs bool) string {
	es := rr.entries(dirs)
	if len(es) == 0 {
		return ""
	}
	return es[rr.rng.IntN(len(es))]
}

// pickDir is a directory ("." included).
func (rr *randomRun) pickDir() string {
	if rr.rng.IntN(4) == 0 {
		return "."
	}
	if d := rr.pick(true); d != "" {
		return d
	}
	return "."
}

func (rr *randomRun) abs(rel string) string { return filepath.Join(rr.dir, filepath.FromSlash(rel)) }

func (rr *randomRun) regular(rel string) bool {
	fi, err := os.Lstat(rr.abs(rel))
	return err == nil && fi.Mode().IsRegular()
}

// linked reports whether rel is a hard-linked file: changing it makes an
// extending pack fall back when its other name is elsewhere.
func (rr *randomRun) linked(rel string) bool {
	fi, err := os.Lstat(rr.abs(rel))
	return err == nil && fi.Sys().(*syscall.Stat_t).Nlink > 1
}

func (rr *randomRun) newName(dir string) string {
	return path.Join(dir, fmt.Sprintf("n%06d%s", rr.rng.IntN(1e6), []string{"", ".json", ".md", ".db"}[rr.rng.IntN(4)]))
}

// op applies one random change to the tree and tells the tracker.
func (rr *randomRun) op() {
	t, tr := rr.t, rr.tr
	switch rr.rng.IntN(17) {
	case 0, 1: // create a file
		p := rr.newName(rr.pickDir())
		if _, err := os.Lstat(rr.abs(p)); err == nil {
			return
		}
		rr.write(rr.abs(p), rr.content())
		rr.stamp(rr.abs(p))
		rr.stamp(filepath.Dir(rr.abs(p)))
		tr.created(p)
	case 2, 3: // write into, append to or truncate a file
		p := rr.pick(false)
		if p == "" || !rr.regular(p) {
			return
		}
		rr.hardOps = rr.hardOps || rr.linked(p)
		f, err := os.OpenFile(rr.abs(p), os.O_WRONLY, 0)
		if err != nil {
			t.Fatal(err)
		}
		st, _ := f.Stat()
		switch rr.rng.IntN(3) {
		case 0:
			f.WriteAt(noise(1+rr.rng.IntN(100), byte(rr.rng.IntN(256))), rr.rng.Int64N(st.Size()+1))
		case 1:
			f.WriteAt(text(1+rr.rng.IntN(2*rr.bs), rr.rng.IntN(100)), st.Size())
		case 2:
			f.Truncate(rr.rng.Int64N(st.Size() + int64(rr.bs)))
		}
		f.Close()
		rr.stamp(rr.abs(p))
		tr.touch(p)
	case 4: // atomic write-and-rename over a file: a new object at the same path
		p := rr.pick(false)
		if p == "" || !rr.regular(p) {
			return
		}
		rr.hardOps = rr.hardOps || rr.linked(p)
		tmp := p + ".tmp"
		rr.write(rr.abs(tmp), rr.content())
		rr.stamp(rr.abs(tmp))
		tr.created(tmp)
		if err := os.Rename(rr.abs(tmp), rr.abs(p)); err != nil {
			t.Fatal(err)
		}
		rr.stamp(filepath.Dir(rr.abs(p)))
		tr.moved(tmp, p)
	case 5: // delete a file
		p := rr.pick(false)
		if p == "" {
			return
		}
		rr.hardOps = rr.hardOps || rr.linked(p)
		os.Remove(rr.abs(p))
		rr.stamp(filepath.Dir(rr.abs(p)))
		tr.removed(p)
	case 6: // rename a file, maybe into another directory, maybe over another
		p := rr.pick(false)
		if p == "" {
			return
		}
		to := rr.newName(rr.pickDir())
		if rr.rng.IntN(3) == 0 {
			if q := rr.pick(false); q != "" && q != p {
				to = q
			}
		}
		if fi, err := os.Lstat(rr.abs(to)); err == nil && (fi.IsDir() || rr.linked(to)) {
			return
		}
		rr.hardOps = rr.hardOps || rr.linked(p)
		if err := os.Rename(rr.abs(p), rr.abs(to)); err != nil {
			t.Fatal(err)
		}
		rr.stamp(filepath.Dir(rr.abs(p)))
		rr.stamp(filepath.Dir(rr.abs(to)))
		tr.moved(p, to)
	case 7: // rename a directory
		d := rr.pick(true)
		to := rr.newName(rr.pickDir())
		if d == "" || d == "big" || to == d || strings.HasPrefix(to, d+"/") {
			return
		}
		if err := os.Rename(rr.abs(d), rr.abs(to)); err != nil {
			t.Fatal(err)
		}
		rr.stamp(filepath.Dir(rr.abs(d)))
		rr.stamp(filepath.Dir(rr.abs(to)))
		tr.moved(d, to)
	case 8: // make a directory, maybe a deep one with files
		p := rr.newName(rr.pickDir())
		q := p
		for range rr.rng.IntN(4) {
			q = path.Join(q, fmt.Sprintf("x%d", rr.rng.IntN(10)))
		}
		if err := os.MkdirAll(rr.abs(q), 0o755); err != nil {
			t.Fatal(err)
		}
		for i := range rr.rng.IntN(5) {
			rr.write(rr.abs(path.Join(q, fmt.Sprintf("f%d", i))), rr.content())
		}
		rr.settle(rr.abs(p))
		rr.stamp(filepath.Dir(rr.abs(p)))
		tr.created(p)
	case 9: // delete a directory and everything below
		d := rr.pick(true)
		if d == "" || d == "big" {
			return
		}
		hard := false
		filepath.WalkDir(rr.abs(d), func(p string, e iofs.DirEntry, err error) error {
			if err == nil && !e.IsDir() {
				if fi, err := os.Lstat(p); err == nil && fi.Sys().(*syscall.Stat_t).Nlink > 1 {
					hard = true
				}
			}
			return nil
		})
		rr.hardOps = rr.hardOps || hard
		os.RemoveAll(rr.abs(d))
		rr.stamp(filepath.Dir(rr.abs(d)))
		tr.removed(d)
	case 10: // chmod
		p := rr.pick(rr.rng.IntN(3) == 0)
		if p == "" {
			return
		}
		fi, err := os.Lstat(rr.abs(p))
		if err != nil || fi.Mode()&iofs.ModeSymlink != 0 {
			return
		}
		rr.hardOps = rr.hardOps || rr.linked(p)
		mode := []iofs.FileMode{0o600, 0o644, 0o755, 0o700, 0o4755, 0o1777}[rr.rng.IntN(6)]
		os.Chmod(rr.abs(p), mode)
		rr.stamp(rr.abs(p))
		tr.touch(p)
	case 11: // a hard link
		p := rr.pick(false)
		if p == "" || !rr.regular(p) {
			return
		}
		to := rr.newName(rr.pickDir())
		if err := os.Link(rr.abs(p), rr.abs(to)); err != nil {
			return
		}
		rr.hardOps = true
		rr.stamp(filepath.Dir(rr.abs(to)))
		rr.stamp(rr.abs(p))
		tr.touch(p)
		o, ok := tr.originOf(p)
		tr.touch(to)
		if ok {
			tr.origin[to] = o
		} else {
			tr.origin[to] = ""
		}
	case 12: // a symlink
		p := rr.newName(rr.pickDir())
		if err := os.Symlink(strings.Repeat("../", rr.rng.IntN(3))+rr.pick(false), rr.abs(p)); err != nil {
			return
		}
		rr.stamp(rr.abs(p))
		rr.stamp(filepath.Dir(rr.abs(p)))
		tr.created(p)
	case 13: // many new names in the big directory
		for range 1 + rr.rng.IntN(60) {
			p := rr.newName("big")
			if _, err := os.Lstat(rr.abs(p)); err == nil {
				continue
			}
			rr.write(rr.abs(p), []byte(p))
			rr.stamp(rr.abs(p))
			tr.created(p)
		}
		rr.stamp(rr.abs("big"))
	case 14: // many names out of the big directory
		ents := rr.entries(false)
		for _, p := range ents {
			if strings.HasPrefix(p, "big/") && rr.rng.IntN(20) == 0 && !rr.linked(p) {
				os.Remove(rr.abs(p))
				tr.removed(p)
			}
		}
		rr.stamp(rr.abs("big"))
		tr.touch("big")
	case 16: // chown (root only): owners the image may not have yet
		p := rr.pick(rr.rng.IntN(3) == 0)
		if p == "" || os.Geteuid() != 0 {
			return
		}
		rr.hardOps = rr.hardOps || rr.linked(p)
		ids := []int{0, 1000, 1001, 2000 + rr.rng.IntN(40), 65534}
		if err := os.Lchown(rr.abs(p), ids[rr.rng.IntN(len(ids))], ids[rr.rng.IntN(len(ids))]); err != nil {
			t.Fatal(err)
		}
		tr.touch(p)
	case 15: // touch only
		p := rr.pick(rr.rng.IntN(2) == 0)
		if p == "" {
			return
		}
		rr.hardOps = rr.hardOps || rr.linked(p)
		rr.stamp(rr.abs(p))
		tr.touch(p)
	}
}

// compactImage compacts base (Compact) and returns the image laid out
// from its runs.
func compactImage(t *testing.T, base *Reader, baseBytes []byte, opts PackOptions) (string, []byte, PackResult) {
	t.Helper()
	segPath := filepath.Join(t.TempDir(), "seg")
	sf, err := os.Create(segPath)
	if err != nil {
		t.Fatal(err)
	}
	res, err := Compact(t.Context(), sf, base, CompactOptions{Workers: opts.Workers})
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
	p := filepath.Join(t.TempDir(), "compact.sqfs")
	if err := os.WriteFile(p, b, 0o644); err != nil {
		t.Fatal(err)
	}
	return p, b, res
}
