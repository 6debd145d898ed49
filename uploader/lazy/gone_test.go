package lazy

import (
	"errors"
	"syscall"
	"testing"
	"time"

	"github.com/hermesfs/hermesfs/uploader"
)

// An object missing from the store (its snapshot pruned under the
// reader) fails a read at the first answer that says so: keys are never
// reused, so retrying until the read timeout would only make the read
// wait. The fill stops with the same error.
func TestMissingObjectFailsAtOnce(t *testing.T) {
	t.Parallel()
	s := localStore(t)
	o := putObject(t, s, 4*testChunk)
	opts := o.options(t.TempDir())
	opts.ReadTimeout = 5 * time.Second // retried, a read would send many GETs meanwhile
	opts.ReadAhead = -1
	r := open(t, opts)
	readChunkOK(t, r, o, 0)
	if err := s.Delete(t.Context(), o.key); err != nil {
		t.Fatal(err)
	}
	gets := o.store.gets.Load()
	_, err := r.ReadAt(make([]byte, 10), testChunk)
	var gone *uploader.SegmentGoneError
	if !errors.As(err, &gone) || gone.Key != o.key || !errors.Is(err, syscall.EIO) || !uploader.IsPermanent(err) {
		t.Fatalf("read of a chunk of a deleted object: %v; want a permanent SegmentGoneError naming %s, EIO", err, o.key)
	}
	if n := o.store.gets.Load() - gets; n != 1 {
		t.Fatalf("a read of a deleted object sent %d GETs; want 1", n)
	}
	readChunkOK(t, r, o, 0) // cached: still served
	r.Fill()
	waitFor(t, "the fill to stop", func() bool { return r.FillErr() != nil })
	if err := r.FillErr(); !errors.As(err, &gone) {
		t.Fatalf("fill of a deleted object stopped with %v; want a SegmentGoneError", err)
	}
}

// An object without chunk digests (a format 1 archive) is read by range
// in the chunk size given, nothing checked per chunk; the complete file
// is checked against the whole sha256, and an object that does not match
// it is never put in place as complete.
func TestNoDigests(t *testing.T) {
	t.Parallel()
	s := localStore(t)
	o := putObject(t, s, 1<<20+777)
	opts := o.options(t.TempDir())
	opts.Chunks, opts.ChunkSize, opts.NoDigests = nil, 20<<10, true
	r := open(t, opts)
	checkReads(t, r, o.data)
	r.Fill()
	waitComplete(t, r)
	checkReads(t, r, o.data)

	bad := opts
	bad.Path = t.TempDir() + "/x.sqfs"
	bad.SHA256 = o.chunks[0] // any other sha256
	r = open(t, bad)
	r.Fill()
	waitFor(t, "the fill to fail", func() bool { return r.FillErr() != nil })
	if r.Complete() {
		t.Fatal("an object that does not match the sha256 completed")
	}
	for _, c := range []Options{func() Options { c := opts; c.SHA256 = ""; return c }(), func() Options { c := opts; c.ChunkSize = 1000; return c }()} {
		if _, err := Open(c); err == nil {
			t.Errorf("no digests with sha256 %q, chunk size %d: opened", c.SHA256, c.ChunkSize)
		}
	}
}
