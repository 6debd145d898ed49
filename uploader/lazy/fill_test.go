package lazy

import (
	"bytes"
	"context"
	"io"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hermesfs/hermesfs/uploader"
)

// gateStore holds the bodies of multi-chunk Gets (fill requests) at a
// byte offset of the object until open is closed, and damages one chunk
// in them if told to. Single-chunk Gets pass untouched.
type gateStore struct {
	uploader.Store
	hold    int64 // object offset where multi-chunk bodies stop; -1: none
	open    chan struct{}
	damage  int64 // chunk damaged in multi-chunk bodies; -1: none
	multi   atomic.Int64
	started chan struct{} // gets a value per multi-chunk Get
}

func newGate(s uploader.Store, hold, damage int64) *gateStore {
	return &gateStore{Store: s, hold: hold, open: make(chan struct{}), damage: damage, started: make(chan struct{}, 100)}
}

func (g *gateStore) Get(ctx context.Context, key string, off, length int64) (io.ReadCloser, uploader.ObjectInfo, error) {
	rc, info, err := g.Store.Get(ctx, key, off, length)
	if err != nil || length <= testChunk {
		return rc, info, err
	}
	g.multi.Add(1)
	g.started <- struct{}{}
	return &gatedBody{g: g, ctx: ctx, rc: rc, pos: off}, info, nil
}

type gatedBody struct {
	g   *gateStore
	ctx context.Context
	rc  io.ReadCloser
	pos int64 // object offset of the next byte
}

func (b *gatedBody) Read(p []byte) (int, error) {
	if h := b.g.hold; h >= 0 {
		if b.pos >= h {
			select {
			case <-b.g.open:
			case <-b.ctx.Done():
				return 0, b.ctx.Err()
			}
		} else if b.pos+int64(len(p)) > h {
			p = p[:h-b.pos]
		}
	}
	n, err := b.rc.Read(p)
	if d := b.g.damage; d >= 0 {
		at := d*testChunk + 10
		if at >= b.pos && at < b.pos+int64(n) {
			p[at-b.pos] ^= 0x40
		}
	}
	b.pos += int64(n)
	return n, err
}

func (b *gatedBody) Close() error { return b.rc.Close() }

// TestFillRequestChecksEachChunk: one fill request covers several chunks;
// the one that arrives damaged in the middle is neither served to the read
// waiting for it nor written, the others are kept, and it is fetched again.
func TestFillRequestChecksEachChunk(t *testing.T) {
	t.Parallel()
	o := putObject(t, localStore(t), 12*testChunk+100)
	dir := t.TempDir()
	opts := o.options(dir)
	opts.FillSpan, opts.FillParallel, opts.ReadAhead = 8*testChunk, 1, -1
	g := newGate(o.store, 4*testChunk+1, 5)
	opts.Store = g
	r := open(t, opts)
	r.Fill()
	// The request stops inside chunk 4, chunks 0-3 written.
	deadline := time.Now().Add(30 * time.Second)
	for r.Stats().PresentBytes < 4*testChunk {
		if time.Now().After(deadline) {
			t.Fatalf("the fill request did not deliver its first chunks: %+v", r.Stats())
		}
		time.Sleep(time.Millisecond)
	}
	// A read of chunk 5, next after the request's position, waits for it.
	got := make([]byte, 1000)
	var rerr error
	var wg sync.WaitGroup
	wg.Go(func() { _, rerr = r.ReadAt(got, 5*testChunk) })
	for r.waiting.Load() == 0 && time.Now().Before(deadline) {
		time.Sleep(time.Millisecond)
	}
	close(g.open)
	wg.Wait()
	if rerr != nil || !bytes.Equal(got, o.data[5*testChunk:5*testChunk+1000]) {
		t.Fatalf("read of a chunk that arrived damaged in a fill request: %v (right bytes: %v)", rerr, bytes.Equal(got, o.data[5*testChunk:5*testChunk+1000]))
	}
	waitComplete(t, r)
	st := r.Stats()
	if st.Errors == 0 || g.multi.Load() != 2 || st.FillChunks+st.OnDemandChunks != 13 {
		t.Fatalf("stats %+v after %d multi-chunk gets (want errors, 2 fill requests, 13 chunks fetched)", st, g.multi.Load())
	}
	b, err := os.ReadFile(filepath.Join(dir, "x.sqfs"))
	if err != nil || !bytes.Equal(b, o.data) {
		t.Fatalf("complete cache differs from the object (err %v)", err)
	}
}

// TestMissServedWhileFillStalls: with every fill request stalled in the
// store, reads of chunks inside them (near the requests' position and
// far from it) are still served, from requests of their own.
func TestMissServedWhileFillStalls(t *testing.T) {
	t.Parallel()
	o := putObject(t, localStore(t), 16*testChunk)
	dir := t.TempDir()
	opts := o.options(dir)
	opts.FillSpan, opts.FillParallel, opts.ReadAhead = 8*testChunk, 2, -1
	opts.ReadTimeout = time.Minute // the stall is not a failure
	g := newGate(o.store, 0, -1)
	opts.Store = g
	r := open(t, opts)
	r.Fill()
	for range 2 {
		select {
		case <-g.started:
		case <-time.After(30 * time.Second):
			t.Fatal("the fill made no requests")
		}
	}
	for _, off := range []int64{1*testChunk + 3, 12*testChunk + 5, 8 * testChunk} {
		got := make([]byte, 500)
		if _, err := r.ReadAt(got, off); err != nil || !bytes.Equal(got, o.data[off:off+500]) {
			t.Fatalf("read at %d while the fill stalls: %v", off, err)
		}
	}
	// The reads did not wait for the stalled requests to time out (that
	// would have made them retry).
	if st := r.Stats(); st.FillChunks != 0 || st.OnDemandChunks != 3 || g.multi.Load() != 2 {
		t.Fatalf("stats %+v and %d fill requests while the fill stalls; want 3 chunks on demand, 2 requests", st, g.multi.Load())
	}
	close(g.open)
	waitComplete(t, r)
	b, err := os.ReadFile(filepath.Join(dir, "x.sqfs"))
	if err != nil || !bytes.Equal(b, o.data) {
		t.Fatalf("complete cache differs from the object (err %v)", err)
	}
}

// TestFillFollowsSequentialRead: after a file was read sequentially, the
// fill's next request starts after the read (beyond its read-ahead), not
// at the fill's own place.
func TestFillFollowsSequentialRead(t *testing.T) {
	t.Parallel()
	o := putObject(t, localStore(t), 32*testChunk)
	opts := o.options(t.TempDir())
	opts.FillSpan, opts.FillParallel, opts.ReadAhead = 4*testChunk, 1, 1
	opts.followFor = time.Hour
	var mu sync.Mutex
	first := int64(-1)
	rec := func(off int64, b []byte) []byte {
		mu.Lock()
		if len(b) > testChunk && first < 0 {
			first = off
		}
		mu.Unlock()
		return b
	}
	o.store.mangle.Store(&rec)
	r := open(t, opts)
	buf := make([]byte, testChunk)
	for _, c := range []int64{16, 17} {
		if _, err := r.ReadAt(buf, c*testChunk); err != nil || !bytes.Equal(buf, o.data[c*testChunk:(c+1)*testChunk]) {
			t.Fatalf("read of chunk %d: %v", c, err)
		}
	}
	r.Fill()
	waitComplete(t, r)
	mu.Lock()
	defer mu.Unlock()
	// Chunk 18 is the read's read-ahead: the fill starts at 19.
	if first != 19*testChunk {
		t.Fatalf("the first fill request started at chunk %d, want 19", first/testChunk)
	}
}
