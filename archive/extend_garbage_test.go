package archive

import (
	iofs "io/fs"
	"os"
	"path/filepath"
	"testing"
)

// A file rewritten with most of its blocks the same (a database with a
// page changed) keeps those blocks: the extending pack copies them (the
// same stored bytes at the file's new place), so the garbage estimate
// counts only the blocks that changed, not the whole old file, and a
// policy on it does not compact after every such snapshot.
func TestExtendGarbageCountsOnlyWhatChanged(t *testing.T) {
	src := t.TempDir()
	db := text(16*128<<10, 7) // 16 blocks
	writeFile(t, filepath.Join(src, "state.db"), db, 0o644)
	writeFile(t, filepath.Join(src, "notes.txt"), text(5000, 8), 0o644)
	basePath, _ := packToFile(t, src, PackOptions{})
	baseBytes, _ := os.ReadFile(basePath)
	base := openFile(t, basePath)
	tr := newTracker(src, base)

	// One page of one block rewritten in place.
	changed := append([]byte(nil), db...)
	copy(changed[5*128<<10+100:], text(4096, 9))
	writeFile(t, filepath.Join(src, "state.db"), changed, 0o644)
	tr.touch("state.db")
	img, _, res := extendImage(t, tr, base, baseBytes, PackOptions{})
	if res.Base != BaseExtended {
		t.Fatalf("%s (%s)", res.Base, res.ExtendFallback)
	}
	r := checkImage(t, img, scanTree(t, src))
	blocks, err := base.Extents(inoAt(t, base, "state.db"))
	if err != nil {
		t.Fatal(err)
	}
	var whole int64
	for _, e := range blocks {
		whole += e.Size
	}
	if res.MatchedBytes < 14*128<<10 {
		t.Fatalf("%d bytes matched in the base; want the 15 unchanged blocks", res.MatchedBytes)
	}
	// The changed block, and the replaced metadata: well under the old
	// file's stored size.
	if g := r.GarbageBytes(); g >= whole/2 {
		t.Errorf("garbage estimate %d bytes after one block of a %d-byte (stored) file changed", g, whole)
	}
}

func inoAt(t *testing.T, r *Reader, name string) Inode {
	t.Helper()
	a, err := r.resolve("t", name, false)
	if err != nil {
		t.Fatal(err)
	}
	return a.Ino
}

// rangeFS is a changeTracker whose file name is read by range against
// inode ino of the archive lower (another reader of the base's bytes, as
// the overlay's lower layer is): only the block holding the changed range
// is read.
type rangeFS struct {
	*changeTracker
	name         string
	lower        *Reader
	ino          Inode
	changedStart int64
}

type rangeFile struct {
	*os.File
	fs *rangeFS
}

func (f rangeFile) PartialArchiveSource() (*Reader, Inode, func(off, n int64) bool, bool) {
	start := f.fs.changedStart
	return f.fs.lower, f.fs.ino, func(off, n int64) bool { return off <= start+4096 && off+n > start }, true
}

func (p *rangeFS) Open(name string) (iofs.File, error) {
	if name != p.name {
		return p.changeTracker.Open(name)
	}
	f, err := os.Open(filepath.Join(p.dir, name))
	if err != nil {
		return nil, err
	}
	return rangeFile{File: f, fs: p}, nil
}

// The same when the unchanged blocks come from the lower layer's own
// reader rather than Base (a file copied up by range, packed on an image
// that extends the lower): the blocks are the same content, and counted
// as kept.
func TestExtendGarbageCopiesFromLower(t *testing.T) {
	src := t.TempDir()
	db := text(16*128<<10, 7)
	writeFile(t, filepath.Join(src, "state.db"), db, 0o644)
	basePath, _ := packToFile(t, src, PackOptions{})
	baseBytes, _ := os.ReadFile(basePath)
	base, lower := openFile(t, basePath), openFile(t, basePath)
	changed := append([]byte(nil), db...)
	copy(changed[5*128<<10+100:], text(4096, 9))
	writeFile(t, filepath.Join(src, "state.db"), changed, 0o644)
	tr := newTracker(src, base)
	tr.touch("state.db")
	p := &rangeFS{changeTracker: tr, name: "state.db", lower: lower, ino: inoAt(t, lower, "state.db"), changedStart: 5*128<<10 + 100}
	segPath := filepath.Join(t.TempDir(), "seg")
	sf, err := os.Create(segPath)
	if err != nil {
		t.Fatal(err)
	}
	res, err := Pack(t.Context(), sf, p, PackOptions{Base: base, Segment: true, Extend: true})
	sf.Close()
	if err != nil {
		t.Fatal(err)
	}
	if res.Base != BaseExtended {
		t.Fatalf("%s (%s)", res.Base, res.ExtendFallback)
	}
	seg, _ := os.ReadFile(segPath)
	im := &image{seg: seg, runs: res.Runs, src: map[*Reader][]byte{base: baseBytes, lower: baseBytes}, size: res.Size}
	img := filepath.Join(t.TempDir(), "image.sqfs")
	if err := os.WriteFile(img, im.bytes(t), 0o644); err != nil {
		t.Fatal(err)
	}
	r := checkImage(t, img, scanTree(t, src))
	if res.ReusedBytes < 14*128<<10 {
		t.Fatalf("%d bytes taken from the lower; want the 15 unchanged blocks", res.ReusedBytes)
	}
	blocks, err := lower.Extents(p.ino)
	if err != nil {
		t.Fatal(err)
	}
	var whole int64
	for _, e := range blocks {
		whole += e.Size
	}
	if g := r.GarbageBytes(); g >= whole/2 {
		t.Errorf("garbage estimate %d bytes after one block of a %d-byte (stored) file changed", g, whole)
	}
}
