package uploader_test

import (
	"bytes"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"os"
	"path/filepath"
	"testing"

	"github.com/hermesfs/hermesfs/uploader"
)

// nextArchive writes a file made mostly of ranges of prev (as a pack on a
// base makes one) and returns it with the delta against snapshot id.
func nextArchive(t *testing.T, prev []byte, id string) (string, string, []byte, *uploader.Delta) {
	t.Helper()
	var b []byte
	d := &uploader.Delta{Source: id}
	fresh := func(n int) {
		x := make([]byte, n)
		rand.Read(x)
		b = append(b, x...)
	}
	copied := func(off, n int) {
		d.Ranges = append(d.Ranges, uploader.ComposeRange{Offset: int64(len(b)), SourceOffset: int64(off), Length: int64(n)})
		b = append(b, prev[off:off+n]...)
	}
	fresh(96)
	copied(96, 10<<20)
	fresh(1 << 20)
	copied(11<<20, len(prev)-11<<20)
	fresh(100_000)
	p := filepath.Join(t.TempDir(), "next.sqfs")
	if err := os.WriteFile(p, b, 0o600); err != nil {
		t.Fatal(err)
	}
	s := sha256.Sum256(b)
	return p, hex.EncodeToString(s[:]), b, d
}

// Publishing with a delta: a store that copies receives only the new
// bytes, one that cannot receives everything; either way the snapshot
// restores, verified, to the local file. When the source is gone, changed
// or unknown, the publish falls back to a plain upload.
func TestCatalogPublishDelta(t *testing.T) {
	eachStore(t, func(t *testing.T, s uploader.Store) {
		ctx := t.Context()
		_, copies := s.(uploader.Composer)
		if _, local := s.(*uploader.Local); local {
			copies = false // it copies only what the caller lacks (ComposeRange.Unchecked)
		}
		c := uploader.NewCatalog(uploader.WithRetry(s, uploader.RetryPolicy{}, nil), uploader.CatalogOptions{Host: "h", Version: "test"})
		first, _ := archiveFile(t, 20<<20)
		m0, err := c.Publish(ctx, uploader.PublishInput{Path: first})
		if err != nil {
			t.Fatal(err)
		}
		prev, _ := os.ReadFile(first)
		restore := func(id, sum string, want []byte) {
			t.Helper()
			dst := filepath.Join(t.TempDir(), "r")
			res, err := c.Restore(ctx, dst, uploader.RestoreOptions{ID: id})
			if err != nil || res.Manifest.SHA256 != sum {
				t.Fatalf("restore %s: %+v, %v", id, res.Manifest, err)
			}
			if got, _ := os.ReadFile(dst); !bytes.Equal(got, want) {
				t.Fatalf("restored %s differs from what was published", id)
			}
		}

		p, sum, b, d := nextArchive(t, prev, m0.ID)
		pub, err := c.PublishReport(ctx, uploader.PublishInput{Path: p, Parent: m0.ID, Expect: m0.ID, Delta: d})
		if err != nil {
			t.Fatal(err)
		}
		size := int64(len(b))
		if pub.Sent+pub.Copied != size || pub.Size != size || pub.SHA256 != sum {
			t.Fatalf("published %+v for a %d-byte archive", pub, size)
		}
		// Sent by a copying store: the first 5 MiB part (every part but
		// the last is at least 5 MiB, and the header is new), the new MiB
		// in the middle widened to 5 MiB, the new tail.
		if copies && (pub.Copied < 9<<20 || pub.Sent > 11<<20) {
			t.Errorf("copying store: sent %d, copied %d", pub.Sent, pub.Copied)
		}
		if !copies && pub.Sent != size {
			t.Errorf("plain store: sent %d of %d bytes", pub.Sent, size)
		}
		restore(pub.ID, sum, b)
		// The new snapshot stands alone: its source may go.
		if err := s.Delete(ctx, uploader.ArchiveKey(m0.ID)); err != nil {
			t.Fatal(err)
		}
		restore(pub.ID, sum, b)
		if !copies {
			return // the rest falls back to what this store always does
		}

		// Source gone: a plain upload.
		p2, sum2, b2, d2 := nextArchive(t, prev, m0.ID)
		pub2, err := c.PublishReport(ctx, uploader.PublishInput{Path: p2, Parent: pub.ID, Expect: pub.ID, Delta: d2})
		if err != nil || pub2.Sent != int64(len(b2)) || pub2.Copied != 0 {
			t.Fatalf("source gone: %+v, %v", pub2, err)
		}
		restore(pub2.ID, sum2, b2)

		// Source replaced by other bytes of the same size (its manifest
		// says otherwise): the copies do not match, a plain upload.
		p3, sum3, b3, d3 := nextArchive(t, b2, pub2.ID)
		other := make([]byte, len(b2))
		rand.Read(other)
		if _, err := s.Put(ctx, uploader.ArchiveKey(pub2.ID), bytes.NewReader(other), int64(len(other)), uploader.PutOptions{}); err != nil {
			t.Fatal(err)
		}
		pub3, err := c.PublishReport(ctx, uploader.PublishInput{Path: p3, Parent: pub2.ID, Expect: pub2.ID, Delta: d3})
		if err != nil || pub3.Sent != int64(len(b3)) || pub3.Copied != 0 {
			t.Fatalf("source replaced: %+v, %v", pub3, err)
		}
		restore(pub3.ID, sum3, b3)

		// An unknown source: a plain upload.
		p4, sum4, b4, d4 := nextArchive(t, b3, "20990101T000000.000Z-nowhere-00000000")
		pub4, err := c.PublishReport(ctx, uploader.PublishInput{Path: p4, Parent: pub3.ID, Expect: pub3.ID, Delta: d4})
		if err != nil || pub4.Sent != int64(len(b4)) {
			t.Fatalf("unknown source: %+v, %v", pub4, err)
		}
		restore(pub4.ID, sum4, b4)
	})
}
