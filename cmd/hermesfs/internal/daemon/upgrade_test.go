package daemon

import (
	"bytes"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/hermesfs/hermesfs/uploader"
)

// A store an older hermesfs wrote: a format 2 snapshot (one whole
// archive) with a version 1 trailer (testdata/v1home.sqfs, packed by
// hermesfs at 1ea490b). The mount boots from it; its first snapshot is
// laid out afresh (a version 1 trailer cannot be extended) but keeps the
// old archive's inode numbers, in a new lineage, and the next snapshot
// extends it. The old snapshot stays restorable, and prunable only once
// nothing uses its archive as a segment.
func TestRunUpgradeFromVersion1Trailer(t *testing.T) {
	testUpgradeFromVersion1Trailer(t, func(t *testing.T, s uploader.Store) []uploader.Published {
		old, err := uploader.NewCatalog(s, uploader.CatalogOptions{Host: "old"}).Publish(t.Context(), uploader.PublishInput{Path: filepath.Join("testdata", "v1home.sqfs"), Files: 44})
		if err != nil {
			t.Fatal(err)
		}
		return []uploader.Published{{Manifest: old}}
	})
}

// The same upgrade from what hermesfs published last before the version 2
// trailer: format 4 snapshots, images of extents over segments with a
// version 1 trailer. The second old snapshot's image spans two segments
// (the archive's head in the first snapshot's, its tail in its own), as
// the snapshots of a mount did.
func TestRunUpgradeFromVersion1TrailerSegments(t *testing.T) {
	testUpgradeFromVersion1Trailer(t, func(t *testing.T, s uploader.Store) []uploader.Published {
		src := filepath.Join("testdata", "v1home.sqfs")
		b, err := os.ReadFile(src)
		if err != nil {
			t.Fatal(err)
		}
		size := int64(len(b))
		meta := uploader.SquashfsMetaOffset(bytes.NewReader(b), size)
		cat := uploader.NewCatalog(s, uploader.CatalogOptions{Host: "old"})
		first, err := cat.PublishImage(t.Context(), uploader.ImageInput{
			Segment: src, Extents: []uploader.Extent{{Offset: 0, Length: size}}, Files: 44, MetaOffset: meta,
		})
		if err != nil {
			t.Fatal(err)
		}
		if len(first.Segments) != 1 {
			t.Fatalf("the first old snapshot has segments %+v, want one", first.Segments)
		}
		head := size / 2
		tail := filepath.Join(tempDir(t), "tail.seg")
		if err := os.WriteFile(tail, b[head:], 0o600); err != nil {
			t.Fatal(err)
		}
		second, err := cat.PublishImage(t.Context(), uploader.ImageInput{
			Segment: tail, Extents: []uploader.Extent{{Key: first.Segments[0].Key, Offset: 0, Length: head}, {Offset: 0, Length: size - head}},
			Sources: []uploader.Manifest{first.Manifest}, Parent: first.ID, Expect: first.ID, Files: 44, MetaOffset: meta,
		})
		if err != nil {
			t.Fatal(err)
		}
		if second.Format != 4 || len(second.Segments) != 2 || second.Size != size {
			t.Fatalf("the second old snapshot: format %d, %d bytes over segments %+v; want format 4, %d bytes over two", second.Format, second.Size, second.Segments, size)
		}
		return []uploader.Published{first, second}
	})
}

// testUpgradeFromVersion1Trailer boots a mount on the last of the
// snapshots publish puts in the store (images with a version 1 trailer,
// all of the one tree of testdata/v1home.sqfs).
func testUpgradeFromVersion1Trailer(t *testing.T, publish func(*testing.T, uploader.Store) []uploader.Published) {
	needFUSE(t)
	root := tempDir(t)
	store, mp, runDir, state := filepath.Join(root, "store"), filepath.Join(root, "home"), filepath.Join(root, "run"), filepath.Join(root, "state")
	for _, dir := range []string{store, mp} {
		if err := os.Mkdir(dir, 0o700); err != nil {
			t.Fatal(err)
		}
	}
	s, err := uploader.NewLocal(store)
	if err != nil {
		t.Fatal(err)
	}
	olds := publish(t, s)
	old := olds[len(olds)-1]
	v1 := snapshotImage(t, store, old.ID)
	if _, ok := v1.Lineage(); ok {
		t.Fatal("testdata/v1home.sqfs has a version 2 trailer")
	}
	const unchanged, session = "agent/pkg/m7.py", "sessions/s1.jsonl"
	ino := inoOf(t, v1, unchanged)

	d := startDaemon(t, store, mp, state, runDir)
	if got := stIno(t, filepath.Join(mp, unchanged)); got != uint64(ino) {
		t.Errorf("%s has st_ino %d on the mount, %d in the archive", unchanged, got, ino)
	}
	appendLine(t, filepath.Join(mp, session), `{"n":1}`)
	s1 := requestSnapshot(t, state)
	r1 := snapshotImage(t, store, s1.ID)
	if _, ok := r1.Lineage(); !ok || r1.Generation() != 0 {
		t.Errorf("the first snapshot on a version 1 base: generation %d (lineage %v); want a new lineage, laid out afresh", r1.Generation(), ok)
	}
	if got := inoOf(t, r1, unchanged); got != ino {
		t.Errorf("the first snapshot numbers %s %d, the old archive %d", unchanged, got, ino)
	}
	if st, _ := ReadState(state); st.LastNumbersOf != st.Base || st.Base != old.ID {
		t.Errorf("state after the first snapshot: base %s, last %s numbered as %q", st.Base, st.LastPublished, st.LastNumbersOf)
	}
	appendLine(t, filepath.Join(mp, session), `{"n":2}`)
	s2 := requestSnapshot(t, state)
	r2 := snapshotImage(t, store, s2.ID)
	if r2.Generation() != 1 || inoOf(t, r2, unchanged) != ino {
		t.Errorf("the second snapshot: generation %d, %s numbered %d; want it to extend the first, keeping %d", r2.Generation(), unchanged, inoOf(t, r2, unchanged), ino)
	}
	if m := manifestOf(t, store, s2.ID); m.NewBytes > 64<<10 {
		t.Errorf("the second snapshot uploaded a %d-byte segment for a one-line change", m.NewBytes)
	}
	if err := d.stop(t); err != nil {
		t.Fatal(err)
	}

	// The old snapshots still read back whole (snapshotImage verifies
	// them).
	for _, o := range olds {
		snapshotImage(t, store, o.ID)
	}
	// Keeping the newest only, hours later: the old snapshots go, the
	// segments (or archive) the image kept uses stay.
	later := uploader.NewCatalog(s, uploader.CatalogOptions{Host: "pruner", Now: func() time.Time { return time.Now().Add(3 * time.Hour) }})
	res, err := later.PruneWith(t.Context(), uploader.PruneOptions{Policy: uploader.RetentionPolicy{Last: 1}})
	if err != nil {
		t.Fatal(err)
	}
	for _, o := range olds {
		if !slices.Contains(res.Deleted, o.ID) {
			t.Errorf("prune keeping 1 kept the old snapshot %s: %+v", o.ID, res.Decisions)
		}
	}
	latest := manifestOf(t, store, strings.TrimSpace(readFileT(t, filepath.Join(store, "LATEST"))))
	for _, seg := range latest.Segments {
		if _, err := os.Stat(filepath.Join(store, filepath.FromSlash(seg.Key))); err != nil {
			t.Errorf("segment %s of %s was pruned: %v", seg.Key, latest.ID, err)
		}
	}
	snapshotImage(t, store, latest.ID)
}
