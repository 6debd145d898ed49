package archive

import (
	"os"
	"path/filepath"
	"testing"
)

// An extending pack on a base written before version 2 trailers (an
// upgrade: the first snapshot on an older one) lays the image out afresh
// but keeps the base's numbers for what the source says stands for them,
// in a new lineage, and says so (KeptNumbers): the next pack extends it.
func TestExtendV1BaseKeepsNumbers(t *testing.T) {
	src := makeTree(t)
	basePath, _ := packToFile(t, src, PackOptions{trailerV1: true})
	baseBytes, _ := os.ReadFile(basePath)
	base := openFile(t, basePath)
	if _, ok := base.Lineage(); ok {
		t.Fatal("a version 1 trailer has a lineage")
	}
	tr := newTracker(src, base)
	p := filepath.Join(src, "sessions", "small.json")
	data, _ := os.ReadFile(p)
	writeFile(t, p, append(data, "one more line\n"...), 0o644)
	tr.touch("sessions/small.json")
	writeFile(t, filepath.Join(src, "new.txt"), []byte("new\n"), 0o644)
	tr.created("new.txt")

	img, imgBytes, res := extendImage(t, tr, base, baseBytes, PackOptions{})
	if res.Base == BaseExtended || res.ExtendFallback == "" {
		t.Fatalf("Base = %q, fallback %q: a version 1 base cannot be extended", res.Base, res.ExtendFallback)
	}
	if !res.KeptNumbers {
		t.Fatal("the fresh layout on a version 1 base does not keep its numbers")
	}
	r := checkImage(t, img, scanTree(t, src))
	for _, name := range []string{".", "config.yaml", "sessions", "sessions/big.json", "sessions/small.json", "memories/MEMORY.md"} {
		a, err := base.resolve("t", name, false)
		if err != nil {
			t.Fatal(err)
		}
		b, err := r.resolve("t", name, false)
		if err != nil {
			t.Fatal(err)
		}
		if a.Ino != b.Ino {
			t.Errorf("%s: inode %d, was %d in the version 1 base", name, b.Ino, a.Ino)
		}
	}
	n, err := r.resolve("t", "new.txt", false)
	if err != nil {
		t.Fatal(err)
	}
	if uint32(n.Ino) <= base.sb.Inodes {
		t.Errorf("new.txt has inode %d, one the base may use (it numbers up to %d)", n.Ino, base.sb.Inodes)
	}
	if _, ok := r.Lineage(); !ok {
		t.Fatal("the new image starts no lineage")
	}

	// The next pack extends it.
	tr.reset(r)
	writeFile(t, p, append(data, "two more lines\n"...), 0o644)
	tr.touch("sessions/small.json")
	img2, _, res2 := extendImage(t, tr, r, imgBytes, PackOptions{})
	if res2.Base != BaseExtended || !res2.KeptNumbers {
		t.Fatalf("the pack after the upgrade: Base %q (%s), KeptNumbers %v; want extended", res2.Base, res2.ExtendFallback, res2.KeptNumbers)
	}
	checkImage(t, img2, scanTree(t, src))
}

// A pack without Extend numbers its inodes afresh and says so.
func TestFreshPackKeepsNoNumbers(t *testing.T) {
	src := makeTree(t)
	_, res := packToFile(t, src, PackOptions{})
	if res.KeptNumbers {
		t.Error("a fresh pack says it kept a base's numbers")
	}
}
