package daemon

import (
	"crypto/sha256"
	"errors"
	"fmt"
	iofs "io/fs"
	"math/rand/v2"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/hermesfs/hermesfs/archive"
	"github.com/hermesfs/hermesfs/uploader"
	"github.com/hermesfs/hermesfs/uploader/image"
)

// treeEntry is what a snapshot must hold of one path.
type treeEntry struct {
	desc string    // kind, mode, owner, size, content or target
	ino  uint64    // st_ino on the mount
	link string    // the first path of its hard-link group ("" if alone)
	mt   time.Time // mtime (files and symlinks)
}

// mountTree reads the mounted tree at mp.
func mountTree(t *testing.T, mp string) map[string]treeEntry {
	t.Helper()
	out := map[string]treeEntry{}
	first := map[uint64]string{}
	err := filepath.WalkDir(mp, func(p string, d iofs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(mp, p)
		if rel == "." {
			return nil
		}
		fi, err := os.Lstat(p)
		if err != nil {
			return err
		}
		st := fi.Sys().(*syscall.Stat_t)
		e := treeEntry{ino: st.Ino, mt: fi.ModTime()}
		e.desc = fmt.Sprintf("%v %d:%d", fi.Mode(), st.Uid, st.Gid)
		switch {
		case fi.Mode().IsRegular():
			b, err := os.ReadFile(p)
			if err != nil {
				return err
			}
			e.desc += fmt.Sprintf(" %d %x", len(b), sha256.Sum256(b))
			if st.Nlink > 1 {
				if f, ok := first[st.Ino]; ok {
					e.link = f
				} else {
					first[st.Ino] = rel
					e.link = rel
				}
			}
		case fi.Mode()&iofs.ModeSymlink != 0:
			l, err := os.Readlink(p)
			if err != nil {
				return err
			}
			e.desc += " -> " + l
		}
		out[rel] = e
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// checkImageTree fails t unless image r holds the tree want (as
// mountTree read it when the snapshot was taken): every path, kind, mode,
// owner, content, symlink target, mtime (seconds), hard-link group; and
// every object the mount numbered from the lower layer (below 2^32) has
// that number in the image.
func checkImageTree(t *testing.T, id string, r *archive.Reader, want map[string]treeEntry) {
	t.Helper()
	got := map[string]bool{}
	inoOfGroup := map[string]uint64{}
	seen := map[uint64]string{}
	err := iofs.WalkDir(r.FS(), ".", func(p string, d iofs.DirEntry, err error) error {
		if err != nil || p == "." {
			return err
		}
		got[p] = true
		w, ok := want[p]
		if !ok {
			t.Errorf("snapshot %s holds %s, which the tree did not", id, p)
			return nil
		}
		fi, err := r.FS().Lstat(p)
		if err != nil {
			return err
		}
		st := fi.Sys().(*syscall.Stat_t)
		desc := fmt.Sprintf("%v %d:%d", fi.Mode(), st.Uid, st.Gid)
		switch {
		case fi.Mode().IsRegular():
			b, err := iofs.ReadFile(r.FS(), p)
			if err != nil {
				return err
			}
			desc += fmt.Sprintf(" %d %x", len(b), sha256.Sum256(b))
		case fi.Mode()&iofs.ModeSymlink != 0:
			l, err := r.ReadLink(p)
			if err != nil {
				return err
			}
			desc += " -> " + l
		}
		if desc != w.desc {
			t.Errorf("snapshot %s: %s is %q, was %q", id, p, desc, w.desc)
		}
		if !fi.IsDir() && fi.ModTime().Unix() != w.mt.Unix() {
			t.Errorf("snapshot %s: %s mtime %v, was %v", id, p, fi.ModTime(), w.mt)
		}
		if w.ino < 1<<32 && st.Ino != w.ino {
			t.Errorf("snapshot %s: %s is inode %d, the mount numbers it %d", id, p, st.Ino, w.ino)
		}
		if prev, ok := seen[st.Ino]; ok && !fi.IsDir() && (w.link == "" || want[prev].link != w.link) {
			t.Errorf("snapshot %s: %s and %s share inode %d but are not hard links", id, p, prev, st.Ino)
		}
		seen[st.Ino] = p
		if w.link != "" {
			if g, ok := inoOfGroup[w.link]; ok && g != st.Ino {
				t.Errorf("snapshot %s: %s is a hard link of %s on the mount, not in the image", id, p, w.link)
			}
			inoOfGroup[w.link] = st.Ino
		}
		return nil
	})
	if err != nil {
		t.Fatalf("snapshot %s: %v", id, err)
	}
	for p := range want {
		if !got[p] {
			t.Errorf("snapshot %s lacks %s", id, p)
		}
	}
}

// randomTreeOps changes the tree at mp as an agent and its tools might.
type randomTreeOps struct {
	t   *testing.T
	mp  string
	rng *rand.Rand
	n   int
}

func (o *randomTreeOps) pick(dirs bool) string {
	var all []string
	filepath.WalkDir(o.mp, func(p string, d iofs.DirEntry, err error) error {
		if err != nil {
			return nil
		}
		rel, _ := filepath.Rel(o.mp, p)
		if rel != "." && d.IsDir() == dirs && !strings.HasPrefix(rel, "memories") {
			all = append(all, rel)
		}
		return nil
	})
	if len(all) == 0 {
		return ""
	}
	sort.Strings(all)
	return all[o.rng.IntN(len(all))]
}

func (o *randomTreeOps) data(n int) []byte {
	b := make([]byte, n)
	for i := range b {
		b[i] = "abcdefgh \n"[o.rng.IntN(10)]
	}
	return b
}

func (o *randomTreeOps) dir() string {
	if d := o.pick(true); d != "" && o.rng.IntN(4) > 0 {
		return d
	}
	return "."
}

// step applies one random change; errors of racing ops (a name gone)
// are ignored, anything else fails the test.
func (o *randomTreeOps) step() {
	o.n++
	mp, name := o.mp, "f"+strconv.Itoa(o.n)
	ok := func(err error) {
		if err != nil && !errors.Is(err, iofs.ErrNotExist) && !errors.Is(err, iofs.ErrExist) && !errors.Is(err, syscall.ENOTEMPTY) && !errors.Is(err, syscall.EINVAL) {
			o.t.Fatalf("op %d: %v", o.n, err)
		}
	}
	switch k := o.rng.IntN(15); k {
	case 0, 1: // a new file
		ok(os.WriteFile(filepath.Join(mp, o.dir(), name), o.data(o.rng.IntN(300<<10)), 0o644))
	case 2, 3: // append
		if f := o.pick(false); f != "" {
			fh, err := os.OpenFile(filepath.Join(mp, f), os.O_WRONLY|os.O_APPEND, 0)
			if err == nil {
				_, err = fh.Write(o.data(1 + o.rng.IntN(5000)))
				fh.Close()
			}
			ok(err)
		}
	case 4: // rewrite a piece in place
		if f := o.pick(false); f != "" {
			fh, err := os.OpenFile(filepath.Join(mp, f), os.O_WRONLY, 0)
			if err == nil {
				fi, _ := fh.Stat()
				if fi.Mode().IsRegular() && fi.Size() > 0 {
					_, err = fh.WriteAt(o.data(1+o.rng.IntN(4096)), o.rng.Int64N(fi.Size()))
				}
				fh.Close()
			}
			ok(err)
		}
	case 5: // truncate
		if f := o.pick(false); f != "" {
			if fi, err := os.Lstat(filepath.Join(mp, f)); err == nil && fi.Mode().IsRegular() {
				ok(os.Truncate(filepath.Join(mp, f), o.rng.Int64N(fi.Size()+1)))
			}
		}
	case 6: // delete
		if f := o.pick(false); f != "" {
			ok(os.Remove(filepath.Join(mp, f)))
		}
	case 7: // rename a file, maybe over another
		if f := o.pick(false); f != "" {
			to := filepath.Join(o.dir(), name)
			if g := o.pick(false); g != "" && o.rng.IntN(3) == 0 {
				to = g
			}
			ok(os.Rename(filepath.Join(mp, f), filepath.Join(mp, to)))
		}
	case 8: // rename a directory
		if d := o.pick(true); d != "" {
			to := filepath.Join(o.dir(), "d"+strconv.Itoa(o.n))
			if !strings.HasPrefix(to+"/", d+"/") {
				ok(os.Rename(filepath.Join(mp, d), filepath.Join(mp, to)))
			}
		}
	case 9: // a deep directory
		p := filepath.Join(mp, o.dir(), "deep"+strconv.Itoa(o.n), "a", "b", "c")
		ok(os.MkdirAll(p, 0o755))
		ok(os.WriteFile(filepath.Join(p, "leaf"), o.data(100), 0o600))
	case 10: // remove a directory tree
		if d := o.pick(true); d != "" && o.rng.IntN(3) == 0 {
			ok(os.RemoveAll(filepath.Join(mp, d)))
		}
	case 11: // chmod
		if f := o.pick(false); f != "" {
			if fi, err := os.Lstat(filepath.Join(mp, f)); err == nil && fi.Mode().IsRegular() {
				ok(os.Chmod(filepath.Join(mp, f), []os.FileMode{0o600, 0o644, 0o755}[o.rng.IntN(3)]))
			}
		}
	case 12: // hard link
		if f := o.pick(false); f != "" {
			if fi, err := os.Lstat(filepath.Join(mp, f)); err == nil && fi.Mode().IsRegular() {
				ok(os.Link(filepath.Join(mp, f), filepath.Join(mp, o.dir(), name)))
			}
		}
	case 13: // symlink
		ok(os.Symlink("../target-"+name, filepath.Join(mp, o.dir(), name)))
	case 14: // a big directory: past a metadata block and the directory index
		d := filepath.Join(mp, o.dir(), "big"+strconv.Itoa(o.n))
		ok(os.Mkdir(d, 0o755))
		for i := range 300 {
			ok(os.WriteFile(filepath.Join(d, fmt.Sprintf("entry-with-a-longer-name-%04d.txt", i)), []byte(strconv.Itoa(i)), 0o644))
		}
	}
}

// A random run through the daemon: snapshots after random changes (files
// and directories made, written, appended to, truncated, deleted and
// renamed, modes changed, hard links, symlinks, deep trees, big
// directories), clean restarts (a rebase) and crash-like ones (the mount
// gone with changes unpublished) now and then, and compactions in the
// background. Every snapshot published, compactions included, is read
// back from the store and must be the tree the mount showed when it was
// taken, under the numbers the mount gave. HERMESFS_RANDOM_SNAPSHOTS sets
// how many (default 40; the long run is 200); HERMESFS_RANDOM_SEED
// replays a run.
func TestRunRandomSnapshots(t *testing.T) {
	needFUSE(t)
	n := 40
	if v, err := strconv.Atoi(os.Getenv("HERMESFS_RANDOM_SNAPSHOTS")); err == nil && v > 0 {
		n = v
	}
	seed := uint64(time.Now().UnixNano())
	if v, err := strconv.ParseUint(os.Getenv("HERMESFS_RANDOM_SEED"), 10, 64); err == nil {
		seed = v
	}
	t.Logf("seed %d (replay with HERMESFS_RANDOM_SEED=%d)", seed, seed)
	root := tempDir(t)
	store, mp, runDir, state := filepath.Join(root, "store"), filepath.Join(root, "home"), filepath.Join(root, "run"), filepath.Join(root, "state")
	if err := os.Mkdir(store, 0o700); err != nil {
		t.Fatal(err)
	}
	ops := &randomTreeOps{t: t, mp: mp, rng: rand.New(rand.NewPCG(seed, 7))}
	for i := range 5 {
		d := filepath.Join(mp, "agent", fmt.Sprintf("pkg%d", i))
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
		for j := range 20 {
			if err := os.WriteFile(filepath.Join(d, fmt.Sprintf("m%02d.py", j)), ops.data(100+ops.rng.IntN(20000)), 0o644); err != nil {
				t.Fatal(err)
			}
		}
	}
	policy := image.CompactPolicy{GarbageShare: 0.3, Extents: 40, Generation: 15}
	edit := func(c *Config, _ *Options) {
		c.Compact = &policy
		c.Retention = uploader.RetentionPolicy{Last: 1000}
	}
	d := startDaemonWith(t, store, mp, state, runDir, edit)

	s, err := uploader.NewLocal(store)
	if err != nil {
		t.Fatal(err)
	}
	cat := uploader.NewCatalog(s, uploader.CatalogOptions{Host: "checker"})
	want := map[string]map[string]treeEntry{} // by snapshot id
	checked := map[string]bool{}
	if st, err := ReadState(state); err != nil || st.Base == "" {
		t.Fatalf("state after the seed: %+v, %v", st, err)
	} else {
		want[st.Base] = mountTree(t, mp) // the seed: the tree as it was
	}
	compactions, restarts, crashes := 0, 0, 0
	check := func() {
		t.Helper()
		snaps, err := cat.Snapshots(t.Context())
		if err != nil {
			t.Fatal(err)
		}
		for _, sn := range snaps {
			if checked[sn.ID] || sn.Incomplete || sn.Err != nil {
				continue
			}
			m, err := cat.Manifest(t.Context(), sn.ID)
			if err != nil {
				continue // pruned meanwhile (a compacted one)
			}
			w := want[sn.ID]
			if m.Compacts != "" {
				w = want[m.Compacts]
				want[sn.ID] = w
				compactions++
			}
			if w == nil {
				t.Fatalf("snapshot %s (parent %s, compacts %q): no tree recorded for it", sn.ID, m.Parent, m.Compacts)
			}
			r, err := restoredImage(t, cat, sn.ID)
			if err != nil {
				if _, merr := cat.Manifest(t.Context(), sn.ID); errors.Is(merr, iofs.ErrNotExist) {
					continue // pruned meanwhile: a compaction took its place
				}
				t.Fatalf("snapshot %s: %v", sn.ID, err)
			}
			checkImageTree(t, sn.ID, r, w)
			checked[sn.ID] = true
		}
	}
	for i := 0; i < n; i++ {
		for range 1 + ops.rng.IntN(6) {
			ops.step()
		}
		res := requestSnapshot(t, state)
		if res.Unchanged {
			continue
		}
		want[res.ID] = mountTree(t, mp)
		check()
		if t.Failed() {
			t.Fatalf("after snapshot %d (%s); logs:\n%s", i, res.ID, d.logs)
		}
		switch ops.rng.IntN(40) {
		case 0: // a clean restart: the last snapshot becomes the base
			if err := d.stop(t); err != nil {
				t.Fatal(err)
			}
			d = startDaemonWith(t, store, mp, state, runDir, edit)
			restarts++
		case 1: // the mount goes with a change unpublished, as in a crash
			ops.step()
			if err := syscall.Unmount(mp, syscall.MNT_DETACH); err != nil {
				t.Fatal(err)
			}
			select {
			case <-d.done:
			case <-time.After(2 * time.Minute):
				t.Fatalf("the daemon did not stop when its mount went away; logs:\n%s", d.logs)
			}
			d = startDaemonWith(t, store, mp, state, runDir, edit)
			crashes++
			// The recovered change is published at once.
			rec := waitStatus(t, d, state, "the recovered change published", func(s statusReport) bool { return !s.Unpublished && !s.InProgress })
			want[rec.LastPublished] = mountTree(t, mp)
		}
	}
	// Let a compaction in progress finish, then check what it published.
	waitStatus(t, d, state, "no compaction running", func(s statusReport) bool { return s.Compaction == nil || !s.Compaction.Running })
	check()
	if err := d.stop(t); err != nil {
		t.Fatal(err)
	}
	check()
	t.Logf("%d snapshots checked (%d compactions), %d clean restarts, %d crash-like restarts, %d ops", len(checked), compactions, restarts, crashes, ops.n)
	if compactions == 0 {
		t.Error("no compaction in the run")
	}
}

// restoredImage restores snapshot id from cat into a temporary file and
// opens and verifies its archive.
func restoredImage(t *testing.T, cat *uploader.Catalog, id string) (*archive.Reader, error) {
	t.Helper()
	dst := filepath.Join(tempDir(t), id+".sqfs")
	if _, err := cat.Restore(t.Context(), dst, uploader.RestoreOptions{ID: id, Image: image.Opener(cat.Store(), nil, "")}); err != nil {
		return nil, err
	}
	f, err := os.Open(dst)
	if err != nil {
		return nil, err
	}
	t.Cleanup(func() { f.Close(); os.Remove(dst) })
	fi, err := f.Stat()
	if err != nil {
		return nil, err
	}
	r, err := archive.Open(f, fi.Size(), archive.ReaderOptions{Name: id})
	if err != nil {
		return nil, err
	}
	return r, r.Verify(t.Context())
}
