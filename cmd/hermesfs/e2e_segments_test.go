package main

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/hermesfs/hermesfs/uploader/s3test"
)

// Snapshots on S3 cost what changed: each uploads one segment with the
// image bytes no earlier segment holds (new and changed blocks, the
// metadata), the rest of its image being extents of older segments; yet
// every one restores on a new host, verified, to exactly the tree it was
// taken of, and exports as a standard squashfs image.
func TestE2ESegmentSnapshotsS3(t *testing.T) {
	t.Parallel()
	need(t, "/dev/fuse", "sqlite3", "unsquashfs")
	endpoint, bucket, _, _ := s3test.Start(t) // its credentials are in the environment (TestMain)
	store := fmt.Sprintf("s3://%s/agents/delta?endpoint=%s&region=%s&path_style=true", bucket, endpoint, s3test.Region)

	// A home whose archive is a few times S3's 5 MiB minimum part: a
	// database of incompressible rows, sessions, skills.
	mp := filepath.Join(e2eDir(t, "home"), "hermes")
	seedHome(t, mp)
	db := filepath.Join(mp, "state.db")
	sqlite(t, db, "CREATE TABLE blobs(id INTEGER PRIMARY KEY, b BLOB); "+
		"WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x+1 FROM c WHERE x < 2400) INSERT INTO blobs(b) SELECT randomblob(8000) FROM c;")
	for i := range 30 {
		writeFile(t, filepath.Join(mp, "cron", fmt.Sprintf("out-%02d.md", i)), strings.Repeat(fmt.Sprintf("run %d ok\n", i), 3000+i*100), 0o644)
	}

	a := newHost(t, store)
	d := a.mount(mp, "--interval", "0")
	type snap struct {
		id                      string
		tree                    map[string]entry
		uploaded, size, segment int64
		hasDB                   bool
	}
	var snaps []snap
	take := func(what string) snap {
		t.Helper()
		code, out, errOut := a.run("snapshot", mp)
		if code != 0 {
			t.Fatalf("snapshot after %s: exit %d: %s%s", what, code, out, errOut)
		}
		st, _ := a.statusJSON(mp)
		if st.Last == nil || st.Last.ID != strings.TrimSpace(out) {
			t.Fatalf("snapshot after %s: printed %q, status says %+v", what, out, st.Last)
		}
		_, err := os.Stat(db)
		s := snap{id: st.Last.ID, tree: snapshotTree(t, mp), uploaded: st.Last.BytesUploaded, size: st.Last.Size, hasDB: err == nil}
		for _, line := range strings.Split(d.stderr.String(), "\n") {
			if strings.Contains(line, "snapshot published") && strings.Contains(line, "id="+s.id) {
				fmt.Sscanf(line[strings.Index(line, "segment_bytes="):], "segment_bytes=%d", &s.segment)
			}
			if strings.Contains(line, "level=WARN") {
				t.Logf("daemon: %s", line)
			}
		}
		t.Logf("after %s: %s uploaded %d bytes (a segment of %d) for a %d-byte image", what, s.id, s.uploaded, s.segment, s.size)
		snaps = append(snaps, s)
		return s
	}

	// A session grows: the archive is the previous one plus a few blocks.
	f, err := os.OpenFile(filepath.Join(mp, "sessions", "s001.json"), os.O_APPEND|os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	f.WriteString(`{"turn":99,"text":"more"}`)
	f.Close()
	if s := take("a session grew"); s.uploaded*3 > s.size {
		t.Errorf("a small change uploaded %d bytes of a %d-byte archive", s.uploaded, s.size)
	}
	// The database grows: its unchanged blocks are extents of the older
	// segments; only the changed and new ones (480 KB of rows) go up.
	sqlite(t, db, "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x+1 FROM c WHERE x < 60) INSERT INTO blobs(b) SELECT randomblob(8000) FROM c;")
	if s := take("the database grew"); s.uploaded*3 > s.size {
		t.Errorf("database growth: %d bytes uploaded for a %d-byte image", s.uploaded, s.size)
	}
	// A copy of the database, as Hermes keeps in state-snapshots/: the
	// archive has its content already.
	writeFile(t, filepath.Join(mp, "state-snapshots", "state-1.db"), mustRead(t, db), 0o644)
	if s := take("the database was copied"); s.uploaded*3 > s.size {
		t.Errorf("a copy of the database uploaded %d bytes of a %d-byte archive", s.uploaded, s.size)
	}
	// Most of the data goes: the snapshot extends the image before it,
	// where the dead data stays unused; the compaction that follows in
	// the background holds only what is left, and copies what it keeps of
	// a mostly dead segment into its own.
	before := snaps[len(snaps)-1].size
	os.Remove(db)
	os.RemoveAll(filepath.Join(mp, "state-snapshots"))
	writeFile(t, filepath.Join(mp, "notes.md"), "a fresh start\n", 0o644)
	s := take("most data was deleted")
	comp := waitCompaction(t, a, d, s.id)
	st, _ := a.statusJSON(mp)
	after := s.size - st.Compaction.Last.Freed
	t.Logf("its compaction %s: a %d-byte image, %d bytes uploaded", comp, after, st.Compaction.Last.Uploaded)
	if after*2 > before {
		t.Errorf("the compacted image after most data went is %d bytes, %d before", after, before)
	}
	// The compaction takes the place of the snapshot it compacts (the
	// same tree), which retention then drops.
	snaps[len(snaps)-1] = snap{id: comp, tree: s.tree, size: after, hasDB: s.hasDB}
	d.stopOK(t)

	// Every snapshot, on a new host: downloaded, verified, extracted.
	for i, s := range snaps {
		b := newHost(t, store)
		dir := filepath.Join(e2eDir(t, "restore"), "home")
		if code, out, errOut := b.run("restore", "--snapshot", s.id, dir); code != 0 {
			t.Fatalf("restore %s: exit %d: %s%s", s.id, code, out, errOut)
		}
		if diff := diffTrees(s.tree, snapshotTree(t, dir)); diff != "" {
			t.Errorf("snapshot %d (%s) restores to another tree:\n%s", i, s.id, diff)
		}
		if s.hasDB {
			integrityOK(t, filepath.Join(dir, "state.db"))
		}
	}
	// Each exports as one plain squashfs image that unsquashfs reads.
	for _, s := range []snap{snaps[2], snaps[len(snaps)-1]} {
		p := filepath.Join(e2eDir(t, "dl"), "snap.sqfs")
		if code, out, errOut := newHost(t, store).run("export", "--snapshot", s.id, p); code != 0 {
			t.Fatalf("export %s: exit %d: %s%s", s.id, code, out, errOut)
		}
		if diff := diffTrees(s.tree, snapshotTree(t, unsquash(t, p))); diff != "" {
			t.Errorf("unsquashfs of the exported %s:\n%s", s.id, diff)
		}
	}
	// And a new host mounts the last one.
	mp2 := filepath.Join(e2eDir(t, "home2"), "hermes")
	os.MkdirAll(mp2, 0o755)
	c := newHost(t, store)
	d2 := c.mount(mp2)
	if diff := diffTrees(snaps[len(snaps)-1].tree, snapshotTree(t, mp2)); diff != "" {
		t.Errorf("new host mounts another tree:\n%s", diff)
	}
	d2.stopOK(t)
}
