package uploader_test

import (
	"bytes"
	"context"
	"errors"
	"io"
	"os"
	"path/filepath"
	"sync"
	"testing"

	"github.com/hermesfs/hermesfs/uploader"
)

// countingReaderAt counts the distinct 4 KiB pages read from it (a store
// may read a part twice: to hash it, then to send it).
type countingReaderAt struct {
	r     io.ReaderAt
	mu    sync.Mutex
	pages map[int64]bool
}

func (c *countingReaderAt) ReadAt(p []byte, off int64) (int, error) {
	n, err := c.r.ReadAt(p, off)
	c.mu.Lock()
	if c.pages == nil {
		c.pages = map[int64]bool{}
	}
	for pg := off >> 12; pg<<12 < off+int64(n); pg++ {
		c.pages[pg] = true
	}
	c.mu.Unlock()
	return n, err
}

// vouchedFill is a fill that vouches for the store's object with ETag
// etag (uploader.SourceChecker).
type vouchedFill struct {
	*countingReaderAt
	etag string
}

func (v vouchedFill) CheckSource(context.Context) (string, error) { return v.etag, nil }

func (c *countingReaderAt) bytes() int64 {
	c.mu.Lock()
	defer c.mu.Unlock()
	return int64(len(c.pages)) << 12
}

// An archive whose shared prefix is a hole publishes without its bytes
// being hashed or (where the store can copy) read: the manifest carries
// the source's chunk digests and no sha256, and a restore on another host
// checks every chunk and gets the whole archive.
func TestPublishHole(t *testing.T) {
	eachStore(t, func(t *testing.T, s uploader.Store) {
		hc := newHoleCase(t, s)
		cat, base, want, hole, in := hc.cat, hc.base, hc.want, hc.hole, hc.in
		fill := &countingReaderAt{r: bytes.NewReader(hc.baseData)}
		bi, err := s.Stat(t.Context(), base.Archive)
		if err != nil {
			t.Fatal(err)
		}
		in.Fill = vouchedFill{fill, bi.ETag}
		p, err := cat.PublishReport(t.Context(), in)
		if err != nil {
			t.Fatal(err)
		}
		if p.SHA256 != "" || !p.Lazy() || p.Format != 3 {
			t.Errorf("manifest sha256 %q, lazy %v, format %d", p.SHA256, p.Lazy(), p.Format)
		}
		if p.Copied < hole.Len()-5<<20 {
			t.Errorf("copied %d bytes of a %d-byte hole", p.Copied, hole.Len())
		}
		// What is read from the fill: at most what the first part takes
		// of it (S3), nothing on a local store.
		if n := fill.bytes(); n > 5<<20+8<<10 {
			t.Errorf("%d bytes of the hole read to publish it", n)
		}
		other := uploader.NewCatalog(s, uploader.CatalogOptions{Host: "b"})
		dst := filepath.Join(t.TempDir(), "restored")
		res, err := other.Restore(t.Context(), dst, uploader.RestoreOptions{})
		if err != nil {
			t.Fatal(err)
		}
		got, _ := os.ReadFile(dst)
		if res.Manifest.ID != p.ID || !bytes.Equal(got, want) {
			t.Fatalf("restored %s (%d bytes), want %s (%d bytes) equal to the archive", res.Manifest.ID, len(got), p.ID, len(want))
		}

		// A store whose copy is wrong is caught by the chunk digests.
		if l, ok := s.(*uploader.Local); ok {
			f, _ := os.OpenFile(filepath.Join(l.Root(), filepath.FromSlash(p.Archive)), os.O_WRONLY, 0)
			f.WriteAt([]byte("x"), hole.From+77)
			f.Close()
			_, err := other.Restore(t.Context(), dst, uploader.RestoreOptions{ID: p.ID})
			if !errors.Is(err, uploader.ErrCorrupt) {
				t.Fatalf("restore of a damaged archive: %v", err)
			}
		}
	})
}
