package archive

import (
	iofs "io/fs"
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

// Compact of an image extended many times: the same tree and inode
// numbers, its lineage, generation 0 and no garbage, data copied by
// reference in long runs, and much less image than the extended one
// carried.
func TestCompact(t *testing.T) {
	src := makeTree(t)
	basePath, _ := packToFile(t, src, PackOptions{})
	baseBytes, _ := os.ReadFile(basePath)
	base := openFile(t, basePath)
	lineage, _ := base.Lineage()
	tr := newTracker(src, base)
	for i := range 6 {
		p := filepath.Join(src, "sessions", "big.json")
		writeFile(t, p, text(3*128<<10+i*1000, 30+i), 0o644)
		tr.touch("sessions/big.json")
		os.Remove(filepath.Join(src, "sessions", "dup-of-small.json"))
		writeFile(t, filepath.Join(src, "sessions", "dup-of-small.json"), text(2000+i, i), 0o644)
		tr.created("sessions/dup-of-small.json")
		img, data, res := extendImage(t, tr, base, baseBytes, PackOptions{})
		if res.Base != BaseExtended {
			t.Fatalf("round %d: %s (%s)", i, res.Base, res.ExtendFallback)
		}
		base, baseBytes = openFile(t, img), data
		tr.reset(base)
	}
	if base.GarbageBytes() == 0 || base.Generation() != 6 {
		t.Fatalf("after 6 extending packs: generation %d, garbage %d", base.Generation(), base.GarbageBytes())
	}
	want := scanTree(t, src)
	img, _, res := compactImage(t, base, baseBytes, PackOptions{})
	r := checkImage(t, img, want)
	t.Logf("extended image %d bytes (garbage estimate %d), compacted %d bytes, segment %d, %d runs", len(baseBytes), base.GarbageBytes(), res.Size, res.SegmentSize, len(res.Runs))
	if l, _ := r.Lineage(); l != lineage || r.Generation() != 0 || r.GarbageBytes() != 0 {
		t.Errorf("compacted: generation %d, garbage %d, lineage kept %v", r.Generation(), r.GarbageBytes(), l == lineage)
	}
	if res.Size >= int64(len(baseBytes)) {
		t.Errorf("compacted image of %d bytes, the extended one had %d", res.Size, len(baseBytes))
	}
	walkBoth(t, base, r, func(name string, a, b Attr) {
		if a.Ino != b.Ino {
			t.Errorf("%s: inode %d after compaction, was %d", name, b.Ino, a.Ino)
		}
	})
	// Data blocks are copied, not written: the segment holds metadata,
	// the trailer and repacked fragment tails.
	var copied int64
	for _, run := range res.Runs {
		if run.Source != nil {
			copied += run.Length
		}
	}
	if copied < res.Size/2 {
		t.Errorf("only %d of %d bytes copied by reference", copied, res.Size)
	}
}

// walkBoth calls fn for every path of a with its attributes in a and b.
func walkBoth(t *testing.T, a, b *Reader, fn func(name string, x, y Attr)) {
	t.Helper()
	iofs.WalkDir(a.FS(), ".", func(p string, d iofs.DirEntry, err error) error {
		if err != nil {
			t.Fatal(err)
		}
		x, err := a.resolve("t", p, false)
		if err != nil {
			t.Fatal(err)
		}
		y, err := b.resolve("t", p, false)
		if err != nil {
			t.Fatalf("%s: %v", p, err)
		}
		fn(p, x, y)
		return nil
	})
}
