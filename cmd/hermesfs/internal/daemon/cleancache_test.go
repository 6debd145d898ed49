package daemon

import (
	"encoding/json"
	"os"
	"path/filepath"
	"slices"
	"testing"

	"github.com/hermesfs/hermesfs/uploader"
)

// cleanCache keeps what the images it keeps use, the temporary files of
// their atomic writes in progress included (a range reader writes its
// .etag and .present so, at the boot that calls cleanCache): removing one
// failed the rename, and the reader then stopped recording its cache and
// its fill for good. What no kept image uses goes, temporary files too.
func TestCleanCacheKeepsWritesInProgress(t *testing.T) {
	dir := t.TempDir()
	d := &daemon{sd: &stateDir{path: dir}}
	segs := d.sd.segmentsDir()
	if err := os.MkdirAll(segs, 0o700); err != nil {
		t.Fatal(err)
	}
	keep, other := "20261128T120000.000Z-a-00000001", "20261128T110000.000Z-a-00000002"
	m := uploader.Manifest{Format: 4, ID: keep, Extents: uploader.ExtentsKey(keep),
		Segments: []uploader.SegmentRef{{Key: uploader.SegmentKey(keep, false)}, {Key: uploader.SegmentKey(other, true)}}}
	b, _ := json.Marshal(m)
	if err := os.WriteFile(d.sd.manifestPath(keep), b, 0o600); err != nil {
		t.Fatal(err)
	}
	gone := "20261128T100000.000Z-a-00000003"
	files := map[string]bool{ // name: kept
		keep + ".seg.partial":            true,
		keep + ".seg.present":            true,
		"." + keep + ".seg.etag.tmp123":  true,
		"." + keep + ".seg.present.tmp9": true,
		keep + ".seg.sums":               true,
		keep + ".extents":                true,
		other + ".seg.age.partial":       true,
		"." + other + ".seg.tmp-77":      true, // its decryption
		gone + ".seg":                    false,
		gone + ".seg.sums":               false,
		"." + gone + ".seg.etag.tmp5":    false,
		"." + gone + ".seg.age.tmp-age-": false,
	}
	for n := range files {
		if err := os.WriteFile(filepath.Join(segs, n), []byte("x"), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	d.cleanCache(keep)
	ents, _ := os.ReadDir(segs)
	var left []string
	for _, e := range ents {
		left = append(left, e.Name())
	}
	for n, kept := range files {
		if slices.Contains(left, n) != kept {
			t.Errorf("%s: kept %v, want %v (left: %v)", n, !kept, kept, left)
		}
	}
}
