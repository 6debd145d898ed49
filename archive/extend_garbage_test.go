package archive

import (
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
