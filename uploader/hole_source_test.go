package uploader_test

import (
	"bytes"
	"context"
	"crypto/rand"
	"errors"
	"io"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/hermesfs/hermesfs/uploader"
	"github.com/hermesfs/hermesfs/uploader/lazy"
)

// gets counts a store's Gets of one key.
type gets struct {
	uploader.Store
	key string
	n   atomic.Int64
}

func (g *gets) Get(ctx context.Context, key string, off, length int64) (io.ReadCloser, uploader.ObjectInfo, error) {
	if key == g.key {
		g.n.Add(1)
	}
	return g.Store.Get(ctx, key, off, length)
}

// holeCase is a base snapshot in a store and the next archive, packed on
// the base while it was fetched lazily: its shared prefix is a hole.
type holeCase struct {
	cat      *uploader.Catalog
	base     uploader.Manifest
	baseData []byte
	want     []byte // the next archive
	in       uploader.PublishInput
	hole     uploader.Hole
}

const holeCS = 64 << 10

func newHoleCase(t *testing.T, s uploader.Store) *holeCase {
	t.Helper()
	cat := uploader.NewCatalog(s, uploader.CatalogOptions{Host: "a"})
	// Longer than an S3 part (5 MiB), which the new head is sent in.
	baseData := make([]byte, 12<<20+123)
	rand.Read(baseData)
	dir := t.TempDir()
	bp := filepath.Join(dir, "base")
	os.WriteFile(bp, baseData, 0o600)
	base, err := cat.Publish(t.Context(), uploader.PublishInput{Path: bp, ChunkSize: holeCS})
	if err != nil {
		t.Fatal(err)
	}
	shared := int64(11<<20 + 4567)
	want := append([]byte(nil), baseData[:shared]...)
	copy(want, "new head")
	tail := make([]byte, 300<<10)
	rand.Read(tail)
	want = append(want, tail...)
	hole := uploader.Hole{From: holeCS, To: shared / holeCS * holeCS}
	np := filepath.Join(dir, "next")
	holey := append([]byte(nil), want...)
	clear(holey[hole.From:hole.To])
	os.WriteFile(np, holey, 0o600)
	return &holeCase{cat: cat, base: base, baseData: baseData, want: want, hole: hole, in: uploader.PublishInput{
		Path: np, ChunkSize: holeCS, Parent: base.ID, Expect: base.ID, Hole: hole,
		Delta: &uploader.Delta{Source: base.ID, Ranges: []uploader.ComposeRange{{Offset: 96, SourceOffset: 96, Length: shared - 96}}},
	}}
}

// lazyBase opens a lazy reader of the base archive, its cache at path.
func (h *holeCase) lazyBase(t *testing.T, s uploader.Store, path string) *lazy.Reader {
	t.Helper()
	r, err := lazy.Open(lazy.Options{
		Store: s, Key: h.base.Archive, Size: h.base.Size, ChunkSize: h.base.ChunkSize, Chunks: h.base.Chunks,
		SHA256: h.base.SHA256, Path: path, ReadTimeout: 10 * time.Second, ReadAhead: -1,
		Retry: uploader.RetryPolicy{Base: time.Millisecond, Cap: 5 * time.Millisecond},
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { r.Close() })
	return r
}

// firstPart is the chunks of the head an S3 store sends (its first part
// is at least 5 MiB), and reads through the fill.
var firstPart = func() []int64 {
	var c []int64
	for i := range int64(6<<20) / holeCS {
		c = append(c, i)
	}
	return c
}()

// readChunks reads chunks of the base through r and checks them.
func (h *holeCase) readChunks(t *testing.T, r io.ReaderAt, chunks ...int64) {
	t.Helper()
	for _, i := range chunks {
		b := make([]byte, holeCS)
		if _, err := r.ReadAt(b, i*holeCS); err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(b, h.baseData[i*holeCS:(i+1)*holeCS]) {
			t.Fatalf("chunk %d read wrong", i)
		}
	}
}

// replaceBase puts other bytes of the same size under the base's key.
func (h *holeCase) replaceBase(t *testing.T, s uploader.Store) {
	t.Helper()
	other := make([]byte, len(h.baseData))
	rand.Read(other)
	copy(other, h.baseData[:holeCS]) // the same superblock, say
	if _, err := s.Put(t.Context(), h.base.Archive, bytes.NewReader(other), int64(len(other)), uploader.PutOptions{}); err != nil {
		t.Fatal(err)
	}
}

// failed checks that a publish failed over the replaced source and left
// the catalog as it was.
func (h *holeCase) failed(t *testing.T, err error) {
	t.Helper()
	if err == nil {
		t.Fatal("published an archive whose hole came from a replaced source")
	}
	if !strings.Contains(err.Error(), "does not match") {
		t.Errorf("publish error does not name the mismatch: %v", err)
	}
	if id, lerr := h.cat.LatestID(t.Context()); lerr != nil || id != h.base.ID {
		t.Errorf("LATEST %q (%v), want %s", id, lerr, h.base.ID)
	}
	snaps, serr := h.cat.Snapshots(t.Context())
	if serr != nil {
		t.Fatal(serr)
	}
	for _, sn := range snaps {
		if sn.ID != h.base.ID && !sn.Incomplete {
			t.Errorf("snapshot %s left in the catalog", sn.ID)
		}
	}
}

// The base object was replaced in the store after the lazy reader checked
// chunks of it: the store must not copy the hole from the new object; the
// archive goes up whole through the reader, which refuses the new bytes,
// and the publish fails with LATEST where it was.
func TestPublishHoleSourceReplaced(t *testing.T) {
	eachStore(t, func(t *testing.T, s uploader.Store) {
		h := newHoleCase(t, s)
		r := h.lazyBase(t, s, filepath.Join(t.TempDir(), "cache"))
		h.readChunks(t, r, append(firstPart, int64(len(h.baseData))/holeCS-1)...)
		h.replaceBase(t, s)
		h.in.Fill = r
		_, err := h.cat.PublishReport(t.Context(), h.in)
		h.failed(t, err)
	})
}

// The same with a reader resumed on a partial cache, which has fetched
// nothing from the store this run: it checks the object before vouching
// for it.
func TestPublishHoleSourceReplacedRestart(t *testing.T) {
	eachStore(t, func(t *testing.T, s uploader.Store) {
		h := newHoleCase(t, s)
		cache := filepath.Join(t.TempDir(), "cache")
		r := h.lazyBase(t, s, cache)
		h.readChunks(t, r, firstPart...)
		r.Close()
		h.replaceBase(t, s)
		r = h.lazyBase(t, s, cache)
		h.readChunks(t, r, firstPart...)
		h.in.Fill = r
		_, err := h.cat.PublishReport(t.Context(), h.in)
		h.failed(t, err)
	})
}

// A lazy reader resumed on a partial cache checks one chunk of the store's
// object it lacks before the store copies the hole from that object; the
// snapshot restores intact, every chunk checked.
func TestPublishHoleChecksSourceFirst(t *testing.T) {
	eachStore(t, func(t *testing.T, s uploader.Store) {
		h := newHoleCase(t, s)
		cache := filepath.Join(t.TempDir(), "cache")
		r := h.lazyBase(t, s, cache)
		h.readChunks(t, r, firstPart...)
		r.Close()
		g := &gets{Store: s, key: h.base.Archive}
		r = h.lazyBase(t, g, cache)
		h.readChunks(t, r, firstPart...)
		if n := g.n.Load(); n != 0 {
			t.Fatalf("the resumed reader fetched %d times from its cache's chunks", n)
		}
		h.in.Fill = r
		p, err := h.cat.PublishReport(t.Context(), h.in)
		if err != nil {
			t.Fatal(err)
		}
		if g.n.Load() == 0 {
			t.Error("the hole was copied from a source no read had checked this run")
		}
		if p.Copied < h.hole.Len()-5<<20 {
			t.Errorf("copied %d bytes of a %d-byte hole", p.Copied, h.hole.Len())
		}
		other := uploader.NewCatalog(s, uploader.CatalogOptions{Host: "b"})
		dst := filepath.Join(t.TempDir(), "restored")
		res, err := other.Restore(t.Context(), dst, uploader.RestoreOptions{})
		if err != nil {
			t.Fatal(err)
		}
		got, _ := os.ReadFile(dst)
		if res.Manifest.ID != p.ID || !bytes.Equal(got, h.want) {
			t.Fatalf("restored %s (%d bytes), want %s (%d bytes) equal to the archive", res.Manifest.ID, len(got), p.ID, len(h.want))
		}
	})
}

// A chunk that arrives with the wrong bytes on every attempt fails the
// upload that reads it at once: the retry decorator does not read it again.
func TestPublishHoleDamagedNotRetried(t *testing.T) {
	s := newLocal(t)
	h := newHoleCase(t, s)
	g := &gets{Store: s, key: h.base.Archive}
	r := h.lazyBase(t, g, filepath.Join(t.TempDir(), "cache"))
	h.readChunks(t, r, 0)
	h.replaceBase(t, s)
	sleeps := 0
	cat := uploader.NewCatalog(uploader.WithRetry(s, uploader.RetryPolicy{MaxRetries: 3, Sleep: func(context.Context, time.Duration) error {
		sleeps++
		return nil
	}}, nil), uploader.CatalogOptions{Host: "a"})
	h.cat = cat
	h.in.Fill = r
	_, err := cat.PublishReport(t.Context(), h.in)
	h.failed(t, err)
	var ce *lazy.ChunkError
	if !errors.As(err, &ce) || !errors.Is(err, syscall.EIO) || !uploader.IsPermanent(err) {
		t.Errorf("publish error %v: want a permanent lazy.ChunkError", err)
	}
	if sleeps != 0 {
		t.Errorf("the upload was retried %d times", sleeps)
	}
}

// A local store's ETag is the content hash stored with the file, which a
// write into the file itself (not through the store) leaves as it was: the
// check right before the copy still finds the replaced bytes.
func TestPublishHoleSourceOverwrittenInPlace(t *testing.T) {
	s := newLocal(t)
	h := newHoleCase(t, s)
	r := h.lazyBase(t, s, filepath.Join(t.TempDir(), "cache"))
	h.readChunks(t, r, firstPart...)
	before, err := s.Stat(t.Context(), h.base.Archive)
	if err != nil {
		t.Fatal(err)
	}
	f, err := os.OpenFile(filepath.Join(s.(*uploader.Local).Root(), filepath.FromSlash(h.base.Archive)), os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	junk := make([]byte, h.hole.To-int64(len(firstPart))*holeCS)
	rand.Read(junk)
	f.WriteAt(junk, int64(len(firstPart))*holeCS)
	f.Close()
	if after, _ := s.Stat(t.Context(), h.base.Archive); after.ETag != before.ETag {
		t.Skip("this local store's ETag changed with the file's bytes")
	}
	h.in.Fill = r
	_, err = h.cat.PublishReport(t.Context(), h.in)
	h.failed(t, err)
}
