package lazy

import (
	"bytes"
	"crypto/rand"
	"errors"
	"strings"
	"syscall"
	"testing"

	"github.com/hermesfs/hermesfs/uploader"
)

// A reader resumed on a partial cache serves its reads from there and so
// has checked nothing of the store's object: CheckSource fetches and
// checks one chunk it lacks (keeping it) before vouching for the object,
// and refuses an object that was replaced meanwhile.
func TestCheckSourceAfterRestart(t *testing.T) {
	t.Parallel()
	s := localStore(t)
	o := putObject(t, s, 8*testChunk)
	dir := t.TempDir()
	opts := o.options(dir)
	opts.ReadAhead = -1
	r := open(t, opts)
	buf := make([]byte, 2*testChunk)
	if _, err := r.ReadAt(buf, 0); err != nil {
		t.Fatal(err)
	}
	info, err := s.Stat(t.Context(), o.key)
	if err != nil {
		t.Fatal(err)
	}
	// It checks a chunk it lacks, and keeps it.
	before := o.store.gets.Load()
	if etag, err := r.CheckSource(t.Context()); err != nil || etag != info.ETag {
		t.Fatalf("CheckSource after fetching: %q, %v; want %q", etag, err, info.ETag)
	}
	if n := o.store.gets.Load() - before; n != 1 {
		t.Errorf("CheckSource made %d requests, want 1", n)
	}
	r.Close()

	r = open(t, opts)
	if _, err := r.ReadAt(buf, 0); err != nil || !bytes.Equal(buf, o.data[:len(buf)]) {
		t.Fatalf("resumed read: %v", err)
	}
	before = o.store.gets.Load()
	etag, err := r.CheckSource(t.Context())
	if err != nil || etag != info.ETag {
		t.Fatalf("CheckSource after a restart: %q, %v; want %q", etag, err, info.ETag)
	}
	if n := o.store.gets.Load() - before; n != 1 {
		t.Errorf("CheckSource after a restart made %d requests, want 1", n)
	}
	if st := r.Stats(); st.PresentBytes != 4*testChunk || st.OnDemandChunks != 1 {
		t.Errorf("the chunk CheckSource fetched was not kept: %+v", st)
	}
	r.Close()

	// The object replaced in the store: a resumed reader does not vouch
	// for it, and says why.
	other := make([]byte, len(o.data))
	rand.Read(other)
	if _, err := s.Put(t.Context(), o.key, bytes.NewReader(other), int64(len(other)), uploader.PutOptions{}); err != nil {
		t.Fatal(err)
	}
	r = open(t, opts)
	if _, err := r.ReadAt(buf, 0); err != nil {
		t.Fatal(err)
	}
	etag, err = r.CheckSource(t.Context())
	var ce *ChunkError
	if err == nil || etag != "" || !errors.As(err, &ce) || !errors.Is(err, ErrDigest) || !uploader.IsPermanent(err) {
		t.Fatalf("CheckSource of a replaced object: %q, %v", etag, err)
	}
}

// An object replaced in the store while a reader reads it is vouched for
// by none, even if the chunk CheckSource fetches is the same in both.
func TestCheckSourceObjectChanged(t *testing.T) {
	t.Parallel()
	s := localStore(t)
	o := putObject(t, s, 8*testChunk)
	opts := o.options(t.TempDir())
	opts.ReadAhead = -1
	r := open(t, opts)
	buf := make([]byte, testChunk)
	if _, err := r.ReadAt(buf, 0); err != nil {
		t.Fatal(err)
	}
	other := bytes.Clone(o.data)
	other[7*testChunk] ^= 1 // not the chunk CheckSource fetches (1)
	if _, err := s.Put(t.Context(), o.key, bytes.NewReader(other), int64(len(other)), uploader.PutOptions{}); err != nil {
		t.Fatal(err)
	}
	if etag, err := r.CheckSource(t.Context()); err == nil || !strings.Contains(err.Error(), "object changed") {
		t.Fatalf("CheckSource of a replaced object: %q, %v", etag, err)
	}
}

// An object replaced while no reader ran, by one that differs only in a
// chunk the cache holds: a resumed reader knows which object its cache
// came from (saved beside the present log) and vouches for no other.
func TestCheckSourceObjectChangedWhileStopped(t *testing.T) {
	t.Parallel()
	s := localStore(t)
	o := putObject(t, s, 8*testChunk)
	opts := o.options(t.TempDir())
	opts.ReadAhead = -1
	r := open(t, opts)
	buf := make([]byte, testChunk)
	if _, err := r.ReadAt(buf, 0); err != nil {
		t.Fatal(err)
	}
	r.Close()
	other := bytes.Clone(o.data)
	other[10] ^= 1 // in chunk 0, which the cache holds
	if _, err := s.Put(t.Context(), o.key, bytes.NewReader(other), int64(len(other)), uploader.PutOptions{}); err != nil {
		t.Fatal(err)
	}
	r = open(t, opts)
	if _, err := r.ReadAt(buf, 0); err != nil || !bytes.Equal(buf, o.data[:testChunk]) {
		t.Fatalf("resumed read from the cache: %v", err)
	}
	if etag, err := r.CheckSource(t.Context()); err == nil || !strings.Contains(err.Error(), "object changed") {
		t.Fatalf("CheckSource of an object replaced while stopped: %q, %v", etag, err)
	}
	r.Close()
	// The original back (another ETag for the same bytes would be refused
	// the same way: a new upload is another object).
	if _, err := s.Put(t.Context(), o.key, bytes.NewReader(o.data), int64(len(o.data)), uploader.PutOptions{}); err != nil {
		t.Fatal(err)
	}
	r = open(t, opts)
	info, err := s.Stat(t.Context(), o.key)
	if err != nil {
		t.Fatal(err)
	}
	etag, err := r.CheckSource(t.Context())
	if info.ETag == r.etag && (err != nil || etag != info.ETag) {
		t.Fatalf("CheckSource with the original back: %q, %v", etag, err)
	}
}

// A chunk whose bytes are wrong on every attempt fails its read with a
// permanent error (retrying the read cannot help); one that fails for a
// while otherwise does not.
func TestChunkErrorPermanentOnDigest(t *testing.T) {
	t.Parallel()
	o := putObject(t, localStore(t), 4*testChunk)
	opts := o.options(t.TempDir())
	opts.ReadAhead = -1
	r := open(t, opts)
	flip := func(off int64, b []byte) []byte {
		if len(b) > 10 {
			b[10] ^= 0x40
		}
		return b
	}
	o.store.mangle.Store(&flip)
	buf := make([]byte, 100)
	_, err := r.ReadAt(buf, testChunk)
	var ce *ChunkError
	if !errors.As(err, &ce) || !errors.Is(err, syscall.EIO) || !errors.Is(err, ErrDigest) || !uploader.IsPermanent(err) {
		t.Fatalf("read of a chunk damaged every time: %v (permanent %v)", err, uploader.IsPermanent(err))
	}
	cut := func(off int64, b []byte) []byte { return b[:len(b)/2] }
	o.store.mangle.Store(&cut)
	_, err = r.ReadAt(buf, 2*testChunk)
	if !errors.As(err, &ce) || uploader.IsPermanent(err) {
		t.Fatalf("read of a truncated chunk: %v (permanent %v)", err, uploader.IsPermanent(err))
	}
}
