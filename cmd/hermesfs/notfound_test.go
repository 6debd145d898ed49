package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/hermesfs/hermesfs/uploader"
)

// TestNamedSnapshotNotFound: a well-formed snapshot id the store has no
// trace of is a wrong id, not a corrupt snapshot: every command that takes
// one says "no snapshot ID", points to 'hermesfs list', and exits 7. A
// snapshot the store holds part of (no manifest) is still corrupt (3).
func TestNamedSnapshotNotFound(t *testing.T) {
	storeDir := t.TempDir()
	s, err := uploader.NewLocal(storeDir)
	if err != nil {
		t.Fatal(err)
	}
	cat := uploader.NewCatalog(s, uploader.CatalogOptions{Host: "box"})
	publishTree(t, cat, makeTree(t, 1))
	partial := publishTree(t, cat, makeTree(t, 2))
	if err := os.Remove(filepath.Join(storeDir, filepath.FromSlash(uploader.ManifestKey(partial.ID)))); err != nil {
		t.Fatal(err)
	}
	environ := map[string]string{"HERMESFS_STORE": "file://" + storeDir}
	const missing = "20261122T134501.123Z-box-1a2b3c4d"
	out := t.TempDir()
	for _, args := range [][]string{
		{"restore", "--snapshot", missing, filepath.Join(out, "r1")},
		{"restore", "--snapshot", missing, "--path", "memories", filepath.Join(out, "r2")},
		{"export", "--snapshot", missing, filepath.Join(out, "e.sqfs")},
		{"verify", missing},
	} {
		code, _, stderr := runCLIEnv(t, environ, args...)
		if code != exitNotFound || !strings.Contains(stderr, "no snapshot "+missing) || !strings.Contains(stderr, "hermesfs list") || strings.Contains(stderr, "corrupt") {
			t.Errorf("%q: exit %d, want %d with \"no snapshot %s\" and a pointer to 'hermesfs list':\n%s", args, code, exitNotFound, missing, stderr)
		}
	}
	if ents, _ := os.ReadDir(out); len(ents) != 0 {
		t.Errorf("a refused command left %d entries in the output dir", len(ents))
	}
	code, _, stderr := runCLIEnv(t, environ, "restore", "--snapshot", partial.ID, filepath.Join(out, "r3"))
	if code != exitCorrupt {
		t.Errorf("restore of a snapshot whose manifest is gone: exit %d, want %d (corrupt):\n%s", code, exitCorrupt, stderr)
	}
}
