package uploader_test

import (
	"crypto/rand"
	"os"
	"path/filepath"
	"sync"
	"testing"

	"github.com/hermesfs/hermesfs/uploader"
)

// TestPublishImageProgress: the upload of a new segment reports the bytes
// the store has read of it, up to the whole segment, never more.
func TestPublishImageProgress(t *testing.T) {
	s, err := uploader.NewLocal(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	c := uploader.NewCatalog(s, uploader.CatalogOptions{Host: "box"})
	const n = 3<<20 + 123
	b := make([]byte, n)
	rand.Read(b)
	p := filepath.Join(t.TempDir(), "seg")
	if err := os.WriteFile(p, b, 0o600); err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	var sent, total, calls int64
	res, err := c.PublishImage(t.Context(), uploader.ImageInput{Segment: p, Extents: []uploader.Extent{{Length: n}},
		Progress: func(s, tot int64) {
			mu.Lock()
			defer mu.Unlock()
			if s > tot || s < 0 {
				t.Errorf("progress %d of %d", s, tot)
			}
			sent, total, calls = max(sent, s), tot, calls+1
		}})
	if err != nil {
		t.Fatal(err)
	}
	if calls == 0 || sent != n || total != n {
		t.Errorf("progress: %d calls, last %d of %d; want %d of %d (segment %s)", calls, sent, total, n, n, res.Segment)
	}
}
