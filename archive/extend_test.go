package archive

import (
	"os"
	"path/filepath"
	"testing"
	"time"
)

// A one-line change to a file deep in a tree: the extended image holds
// the tree, every reader reads it, unchanged objects keep their numbers,
// and the segment holds little more than the change.
func TestExtendOneChange(t *testing.T) {
	src := makeTree(t)
	basePath, _ := packToFile(t, src, PackOptions{})
	baseBytes, _ := os.ReadFile(basePath)
	base := openFile(t, basePath)
	before := scanArchive(t, base)
	_ = before

	tr := newTracker(src, base)
	p := filepath.Join(src, "sessions", "small.json")
	data, _ := os.ReadFile(p)
	writeFile(t, p, append(data, "one more line\n"...), 0o644)
	when := time.Date(2026, 5, 1, 0, 0, 0, 0, time.UTC)
	os.Chtimes(p, when, when)
	tr.touch("sessions/small.json")

	img, _, res := extendImage(t, tr, base, baseBytes, PackOptions{})
	t.Logf("extended: %s, image %d bytes, segment %d, runs %d", res.Base, res.Size, res.SegmentSize, len(res.Runs))
	if res.Base != BaseExtended {
		t.Fatalf("Base = %q (%s), want extended", res.Base, res.ExtendFallback)
	}
	r := checkImage(t, img, scanTree(t, src))
	for _, name := range []string{"config.yaml", "sessions/big.json", "memories/MEMORY.md", "sessions/small.json", "sessions", "."} {
		a, err := base.resolve("t", name, false)
		if err != nil {
			t.Fatal(err)
		}
		b, err := r.resolve("t", name, false)
		if err != nil {
			t.Fatal(err)
		}
		if a.Ino != b.Ino {
			t.Errorf("%s: inode %d, was %d", name, b.Ino, a.Ino)
		}
	}
	if g := r.Generation(); g != 1 {
		t.Errorf("generation %d", g)
	}
	if res.SegmentSize > 64<<10 {
		t.Errorf("segment of %d bytes for a one-line change", res.SegmentSize)
	}
}
