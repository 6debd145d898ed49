package daemon

import (
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
	old, err := uploader.NewCatalog(s, uploader.CatalogOptions{Host: "old"}).Publish(t.Context(), uploader.PublishInput{Path: filepath.Join("testdata", "v1home.sqfs"), Files: 44})
	if err != nil {
		t.Fatal(err)
	}
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

	// The old snapshot still reads back whole (snapshotImage verifies it).
	snapshotImage(t, store, old.ID)
	// Keeping the newest only, hours later: the old snapshot goes, its
	// archive stays while the image kept uses it as a segment.
	later := uploader.NewCatalog(s, uploader.CatalogOptions{Host: "pruner", Now: func() time.Time { return time.Now().Add(3 * time.Hour) }})
	res, err := later.PruneWith(t.Context(), uploader.PruneOptions{Policy: uploader.RetentionPolicy{Last: 1}})
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Contains(res.Deleted, old.ID) {
		t.Errorf("prune keeping 1 kept the old snapshot: %+v", res.Decisions)
	}
	latest := manifestOf(t, store, strings.TrimSpace(readFileT(t, filepath.Join(store, "LATEST"))))
	usesOld := slices.ContainsFunc(latest.Segments, func(r uploader.SegmentRef) bool { return r.Key == old.Archive })
	if _, err := os.Stat(filepath.Join(store, filepath.FromSlash(old.Archive))); usesOld && err != nil {
		t.Errorf("the old archive, a segment of %s, was pruned: %v", latest.ID, err)
	}
	snapshotImage(t, store, latest.ID)
}
