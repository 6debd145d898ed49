package main

import (
	"encoding/json"
	iofs "io/fs"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/hermesfs/hermesfs/uploader"
)

// TestE2EUpgradeFromArchives: a store an older hermesfs wrote (whole
// archives: a format 2 snapshot and a format 3 one, without the whole
// sha256) is mounted by this one, lazily; its first snapshot is format 4
// and uses the old archive as a segment (its digests stored beside it),
// uploading only its new bytes. The old snapshots stay restorable, and
// prunable: a prune deletes an old archive only once no remaining snapshot
// uses it as a segment.
func TestE2EUpgradeFromArchives(t *testing.T) {
	need(t, "/dev/fuse")
	t.Parallel()
	storeDir := e2eDir(t, "store")
	store := "file://" + storeDir
	s, err := uploader.NewLocal(storeDir)
	if err != nil {
		t.Fatal(err)
	}
	old := uploader.NewCatalog(s, uploader.CatalogOptions{Host: "old"})
	v1, v2 := e2eDir(t, "v1"), e2eDir(t, "v2")
	lazyHome(t, v1)
	lazyHome(t, v2)
	want := map[string]map[string]entry{}
	m1 := publishTree(t, old, v1)
	m2 := publishTree(t, old, v2)
	want[m1.ID], want[m2.ID] = snapshotTree(t, v1), snapshotTree(t, v2)
	// m2 as a publish with a hole left it: format 3, no whole sha256.
	mp2 := filepath.Join(storeDir, filepath.FromSlash(uploader.ManifestKey(m2.ID)))
	var raw map[string]any
	if err := json.Unmarshal([]byte(mustRead(t, mp2)), &raw); err != nil {
		t.Fatal(err)
	}
	raw["format"] = 3
	delete(raw, "sha256")
	j, _ := json.Marshal(raw)
	if err := os.WriteFile(mp2, j, 0o644); err != nil {
		t.Fatal(err)
	}
	if m := readManifest(t, storeDir, m1.ID); m.Format != 2 || m.Segmented() {
		t.Fatalf("%s: format %d", m1.ID, m.Format)
	}
	if m := readManifest(t, storeDir, m2.ID); m.Format != 3 || m.SHA256 != "" || !m.Lazy() {
		t.Fatalf("%s: format %d, sha256 %q", m2.ID, m.Format, m.SHA256)
	}

	h := newHost(t, store)
	mp := e2eDir(t, "home")
	d := h.mount(mp, "--interval", "0")
	if !strings.Contains(d.stderr.String(), "booting lazily") {
		t.Errorf("a format 3 snapshot was not booted lazily:\n%s", d.stderr)
	}
	if diff := diffTrees(want[m2.ID], snapshotTree(t, mp)); diff != "" {
		t.Fatalf("the old snapshot mounts another tree:\n%s", diff)
	}
	writeFile(t, filepath.Join(mp, "new.txt"), "after the upgrade", 0o644)
	waitLazyComplete(t, h, d)
	d.stopOK(t)
	id3 := localLatest(t, storeDir)
	m3 := readManifest(t, storeDir, id3)
	if !m3.Segmented() || m3.Parent != m2.ID {
		t.Fatalf("the first snapshot of the new hermesfs: format %d, parent %s", m3.Format, m3.Parent)
	}
	if r := segmentRef(t, m3, m2.Archive); r.Bytes < m2.Size/2 {
		t.Errorf("the new image takes %d bytes of the old %d-byte archive", r.Bytes, m2.Size)
	}
	if !fileExists(filepath.Join(storeDir, filepath.FromSlash(uploader.SumsKey(m2.Archive)))) {
		t.Errorf("no digests stored beside the old archive used as a segment")
	}
	sent := publishedFigure(t, d.stderr.String(), id3, "bytes_uploaded")
	t.Logf("the first snapshot after the upgrade uploaded %d bytes (a %d-byte segment) for a %d-byte image; the old archive is %d bytes",
		sent, m3.NewBytes, m3.Size, m2.Size)
	if sent*4 > m2.Size || m3.NewBytes*4 > m2.Size {
		t.Errorf("the first snapshot after the upgrade uploaded %d bytes (a %d-byte segment) for a %d-byte old archive", sent, m3.NewBytes, m2.Size)
	}
	want[id3] = snapshotTree(t, v2)
	want[id3]["new.txt"] = entry{}

	restores := func(ids ...string) {
		t.Helper()
		for _, id := range ids {
			dir := filepath.Join(e2eDir(t, "restore"), "home")
			if code, out, errs := newHost(t, store).run("restore", "--snapshot", id, dir); code != 0 {
				t.Fatalf("restore %s: exit %d %s%s", id, code, out, errs)
			}
			got := snapshotTree(t, dir)
			if _, ok := want[id]["new.txt"]; ok {
				if c := mustRead(t, filepath.Join(dir, "new.txt")); c != "after the upgrade" {
					t.Errorf("restore %s: new.txt = %q", id, c)
				}
				got = withoutNew(got)
				w := map[string]entry{}
				for k, v := range want[id] {
					w[k] = v
				}
				delete(w, "new.txt")
				if diff := diffTrees(w, got); diff != "" {
					t.Errorf("restore %s differs:\n%s", id, diff)
				}
				continue
			}
			if diff := diffTrees(want[id], got); diff != "" {
				t.Errorf("restore %s differs:\n%s", id, diff)
			}
		}
	}
	restores(m1.ID, m2.ID, id3)

	// An hour on (past the orphan grace), keep one: the old snapshots go,
	// m1's archive with them; m2's stays, a segment of the one kept.
	prune := func() string {
		t.Helper()
		ageStore(t, storeDir, 2*time.Hour)
		code, out, errs := newHost(t, store).run("prune", "--keep-last", "1")
		if code != 0 {
			t.Fatalf("prune: exit %d %s%s", code, out, errs)
		}
		return out
	}
	out := prune()
	for _, id := range []string{m1.ID, m2.ID} {
		if fileExists(filepath.Join(storeDir, filepath.FromSlash(uploader.ManifestKey(id)))) {
			t.Errorf("prune kept the old snapshot %s:\n%s", id, out)
		}
	}
	if fileExists(filepath.Join(storeDir, filepath.FromSlash(m1.Archive))) {
		t.Errorf("prune kept the archive of %s, which no snapshot uses", m1.ID)
	}
	for _, k := range []string{m2.Archive, uploader.SumsKey(m2.Archive)} {
		if !fileExists(filepath.Join(storeDir, filepath.FromSlash(k))) {
			t.Fatalf("prune deleted %s, which snapshot %s uses", k, id3)
		}
	}
	restores(id3)

	// Most of the home goes: the snapshot extends the image before it,
	// which keeps the blobs unused; its compaction in the background
	// copies what it keeps of the old archive (a mostly dead segment)
	// into its own segment, and once the snapshots before are pruned,
	// the old archive goes.
	d = h.mount(mp, "--interval", "0")
	if err := os.RemoveAll(filepath.Join(mp, "blobs")); err != nil {
		t.Fatal(err)
	}
	snapshotCompacted(t, h, d)
	d.stopOK(t)
	id4 := localLatest(t, storeDir)
	for _, r := range readManifest(t, storeDir, id4).Segments {
		if r.Key == m2.Archive {
			t.Fatalf("snapshot %s, without the blobs, still uses the old archive %s", id4, m2.Archive)
		}
	}
	want[id4] = snapshotTree(t, v2)
	want[id4]["new.txt"] = entry{}
	for k := range want[id4] {
		if k == "blobs" || strings.HasPrefix(k, "blobs/") {
			delete(want[id4], k)
		}
	}
	out = prune()
	for _, k := range []string{m2.Archive, uploader.SumsKey(m2.Archive), uploader.ManifestKey(id3)} {
		if fileExists(filepath.Join(storeDir, filepath.FromSlash(k))) {
			t.Errorf("prune kept %s, which no snapshot uses:\n%s", k, out)
		}
	}
	restores(id4)
	checkStoreRefs(t, storeCatalog(t, store))
}

// ageStore sets the times of every object of the local store at storeDir
// back by d: what a prune sees once that long has passed (objects younger
// than the orphan grace may be a publish in progress, and stay).
func ageStore(t *testing.T, storeDir string, d time.Duration) {
	t.Helper()
	err := filepath.WalkDir(storeDir, func(p string, de iofs.DirEntry, err error) error {
		if err != nil || de.IsDir() {
			return err
		}
		fi, err := de.Info()
		if err != nil {
			return err
		}
		at := fi.ModTime().Add(-d)
		return os.Chtimes(p, at, at)
	})
	if err != nil {
		t.Fatal(err)
	}
}
