package lazy

import (
	"bytes"
	"context"
	"io"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hermesfs/hermesfs/uploader"
)

// holdStore holds the single-chunk Get at object offset hold until release
// is closed (an on-demand fetch stuck in the store), records the offset of
// every Get, and hands multi-chunk bodies (fill requests) to body when set.
type holdStore struct {
	uploader.Store
	hold    int64
	started chan struct{} // gets a value when the held Get begins
	release chan struct{}
	held    atomic.Bool // the held Get is in the store

	body func(ctx context.Context, off int64, rc io.ReadCloser) io.ReadCloser

	mu   sync.Mutex
	offs []int64
}

func newHold(s uploader.Store, hold int64) *holdStore {
	return &holdStore{Store: s, hold: hold, started: make(chan struct{}, 1), release: make(chan struct{})}
}

func (h *holdStore) Get(ctx context.Context, key string, off, length int64) (io.ReadCloser, uploader.ObjectInfo, error) {
	h.mu.Lock()
	h.offs = append(h.offs, off)
	h.mu.Unlock()
	if off == h.hold && length <= testChunk {
		h.held.Store(true)
		h.started <- struct{}{}
		select {
		case <-h.release:
		case <-ctx.Done():
		}
		h.held.Store(false)
	}
	rc, info, err := h.Store.Get(ctx, key, off, length)
	if err == nil && length > testChunk && h.body != nil {
		rc = h.body(ctx, off, rc)
	}
	return rc, info, err
}

func (h *holdStore) gets() []int64 {
	h.mu.Lock()
	defer h.mu.Unlock()
	return slices.Clone(h.offs)
}

// chunksIn returns the chunks of [from, to) that are present or being
// fetched.
func chunksIn(r *Reader, from, to int) []int {
	r.mu.Lock()
	defer r.mu.Unlock()
	var got []int
	for i := from; i < to; i++ {
		if r.present[i] || r.inflight[i] != nil {
			got = append(got, i)
		}
	}
	return got
}

func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(time.Millisecond)
	}
}

func readOK(t *testing.T, r *Reader, o *object, off, n int64) {
	t.Helper()
	buf := make([]byte, n)
	if _, err := r.ReadAt(buf, off); err != nil || !bytes.Equal(buf, o.data[off:off+n]) {
		t.Fatalf("read of %d bytes at %d: %v (right bytes: %v)", n, off, err, bytes.Equal(buf, o.data[off:off+n]))
	}
}

// TestReadAheadOnlyForReadsInOrder: a read starts read-ahead (and has the
// fill follow it) only when it starts where the previous read ended and
// the reads in order cover a chunk; two reads in one chunk, a read further
// on, or the superblock and the header after it (as opening the archive
// reads them) are not a sequential reader.
func TestReadAheadOnlyForReadsInOrder(t *testing.T) {
	t.Parallel()
	o := putObject(t, localStore(t), 16*testChunk)
	opts := o.options(t.TempDir())
	opts.ReadAhead = 4
	r := open(t, opts)
	readOK(t, r, o, 0, 96)
	readOK(t, r, o, 96, 2)
	readOK(t, r, o, 1000, 100)
	if got := chunksIn(r, 0, 16); !slices.Equal(got, []int{0}) {
		t.Fatalf("reads in chunk 0 fetched chunks %v; want [0]", got)
	}
	readOK(t, r, o, 5*testChunk+10, 100)
	if got := chunksIn(r, 0, 16); !slices.Equal(got, []int{0, 5}) {
		t.Fatalf("a read further on fetched chunks %v; want [0 5]", got)
	}
	r.mu.Lock()
	follows := !r.seqAt.IsZero()
	r.mu.Unlock()
	if follows {
		t.Fatal("the fill would follow reads that were not in order")
	}
	// Where the previous read ended: chunks 5-6 read, 7-10 read ahead.
	readOK(t, r, o, 5*testChunk+110, testChunk)
	if got := chunksIn(r, 0, 16); !slices.Equal(got, []int{0, 5, 6, 7, 8, 9, 10}) {
		t.Fatalf("a read in order fetched chunks %v; want [0 5 6 7 8 9 10]", got)
	}
	if n := o.store.gets.Load(); n > 7 {
		t.Fatalf("%d gets for 7 chunks", n)
	}
}

// TestReadAheadForBlocksOutOfOrder: a sequential reader's blocks reach the
// reader in parallel and out of order (the archive reader reads a FUSE
// read's blocks and its read-ahead concurrently): that is still a
// sequential reader, and gets read-ahead.
func TestReadAheadForBlocksOutOfOrder(t *testing.T) {
	t.Parallel()
	o := putObject(t, localStore(t), 32*testChunk)
	opts := o.options(t.TempDir())
	opts.ReadAhead = 4
	r := open(t, opts)
	const block = testChunk / 4
	// Blocks 0..11 of a file from chunk 8 on (chunks 8-10), in this order.
	order := []int64{3, 0, 7, 1, 5, 2, 6, 4, 11, 9, 8, 10}
	var wg sync.WaitGroup
	for _, b := range order {
		wg.Go(func() { readOK(t, r, o, 8*testChunk+b*block, block) })
		time.Sleep(time.Millisecond) // arrivals in this order, mostly
	}
	wg.Wait()
	waitFor(t, "read-ahead of chunks 11-14", func() bool {
		got := chunksIn(r, 0, 32)
		return slices.Equal(got, []int{8, 9, 10, 11, 12, 13, 14})
	})
}

// TestFillFollowsOnlyAfterHotChunks: with a sequential reader to follow,
// the fill still fetches the hot chunks first, then follows the reader.
func TestFillFollowsOnlyAfterHotChunks(t *testing.T) {
	t.Parallel()
	o := putObject(t, localStore(t), 32*testChunk)
	opts := o.options(t.TempDir())
	opts.FillSpan, opts.FillParallel, opts.ReadAhead = 4*testChunk, 1, 1
	opts.followFor = time.Hour
	opts.Hot = []int64{5, 9}
	r := open(t, opts)
	readOK(t, r, o, 16*testChunk, testChunk)
	readOK(t, r, o, 17*testChunk, testChunk)
	waitFor(t, "the read-ahead of chunk 18", func() bool {
		r.mu.Lock()
		defer r.mu.Unlock()
		return r.present[18]
	})
	var mu sync.Mutex
	var order []int64
	rec := func(off int64, b []byte) []byte {
		mu.Lock()
		order = append(order, off/testChunk)
		mu.Unlock()
		return b
	}
	o.store.mangle.Store(&rec)
	r.Fill()
	waitComplete(t, r)
	mu.Lock()
	defer mu.Unlock()
	// 18 is the read's read-ahead: the fill follows from 19.
	if len(order) < 3 || !slices.Equal(order[:3], []int64{5, 9, 19}) {
		t.Fatalf("fill requests started at chunks %v; want the hot chunks 5, 9, then 19", order)
	}
}

// TestHotChunksWaitForMisses: while an on-demand read waits (its fetch
// stuck in the store), the fill starts no request, the hot set's neither;
// once the read is served, the fill fetches the hot chunks first.
func TestHotChunksWaitForMisses(t *testing.T) {
	t.Parallel()
	o := putObject(t, localStore(t), 16*testChunk)
	opts := o.options(t.TempDir())
	opts.FillSpan, opts.FillParallel, opts.ReadAhead = 4*testChunk, 1, -1
	opts.ReadTimeout = time.Minute // the held read is not a failure
	opts.Hot = []int64{3, 9}
	h := newHold(o.store, 12*testChunk)
	opts.Store = h
	var heldBack atomic.Int64
	opts.heldBack = func() { heldBack.Add(1) }
	r := open(t, opts)
	done := make(chan error, 1)
	go func() {
		buf := make([]byte, 100)
		_, err := r.ReadAt(buf, 12*testChunk)
		if err == nil && !bytes.Equal(buf, o.data[12*testChunk:12*testChunk+100]) {
			err = io.ErrUnexpectedEOF
		}
		done <- err
	}()
	<-h.started
	waitFor(t, "the read to wait", func() bool { return r.waiting.Load() > 0 })
	r.Fill()
	waitFor(t, "the fill to hold back for the read", func() bool { return heldBack.Load() > 2 })
	if got := h.gets(); !slices.Equal(got, []int64{12 * testChunk}) {
		t.Fatalf("gets at %v while a read waits; want chunk 12 (the read) only", got)
	}
	close(h.release)
	if err := <-done; err != nil {
		t.Fatalf("the held read: %v", err)
	}
	waitComplete(t, r)
	if got := h.gets(); len(got) < 3 || !slices.Equal(got[:3], []int64{12 * testChunk, 3 * testChunk, 9 * testChunk}) {
		t.Fatalf("gets at %v; want chunk 12 (the read), then 3 and 9 (hot)", got)
	}
}

// watchedBody is a fill request's body: reads at or past gate wait until
// open is closed, and a read starting at or past stop while the store
// holds an on-demand fetch is reported on bad.
type watchedBody struct {
	h          *holdStore
	ctx        context.Context
	rc         io.ReadCloser
	pos        int64
	gate, stop int64
	open       chan struct{}
	bad        chan int64
}

func (b *watchedBody) Read(p []byte) (int, error) {
	if b.pos >= b.stop && b.h.held.Load() {
		select {
		case b.bad <- b.pos:
		default:
		}
	}
	if b.pos >= b.gate {
		select {
		case <-b.open:
		case <-b.ctx.Done():
			return 0, b.ctx.Err()
		}
	} else if b.pos+int64(len(p)) > b.gate {
		p = p[:b.gate-b.pos]
	}
	n, err := b.rc.Read(p)
	b.pos += int64(n)
	return n, err
}

func (b *watchedBody) Close() error { return b.rc.Close() }

// TestFillYieldsToOnDemandFetch: while an on-demand fetch is in flight,
// a fill request stops reading its body at the next chunk boundary (the
// link goes to the miss), misses do not wait for it meanwhile, and it goes
// on once the fetch is done.
func TestFillYieldsToOnDemandFetch(t *testing.T) {
	t.Parallel()
	o := putObject(t, localStore(t), 16*testChunk)
	opts := o.options(t.TempDir())
	opts.FillSpan, opts.FillParallel, opts.ReadAhead = 8*testChunk, 1, -1
	opts.ReadTimeout = time.Minute
	h := newHold(o.store, 12*testChunk)
	gateOpen := make(chan struct{})
	bad := make(chan int64, 1)
	var bodies atomic.Int64
	h.body = func(ctx context.Context, off int64, rc io.ReadCloser) io.ReadCloser {
		if bodies.Add(1) > 1 {
			return rc
		}
		// The first request (chunks 0-7) stops in chunk 2 until open;
		// chunk 3 on must wait for the held fetch.
		return &watchedBody{h: h, ctx: ctx, rc: rc, pos: off, gate: 2 * testChunk, stop: 3 * testChunk, open: gateOpen, bad: bad}
	}
	opts.Store = h
	yielded := make(chan struct{}, 1)
	opts.yielded = func() {
		select {
		case yielded <- struct{}{}:
		default:
		}
	}
	r := open(t, opts)
	r.Fill()
	waitFor(t, "the fill's first chunks", func() bool { return r.Stats().PresentBytes >= 2*testChunk })
	done := make(chan error, 1)
	go func() {
		buf := make([]byte, 100)
		_, err := r.ReadAt(buf, 12*testChunk)
		if err == nil && !bytes.Equal(buf, o.data[12*testChunk:12*testChunk+100]) {
			err = io.ErrUnexpectedEOF
		}
		done <- err
	}()
	<-h.started
	close(gateOpen)
	select {
	case <-yielded:
	case pos := <-bad:
		t.Fatalf("the fill read its body at %d (chunk %d) while an on-demand fetch was in flight", pos, pos/testChunk)
	case <-time.After(20 * time.Second):
		t.Fatal("the fill neither paused nor read on")
	}
	// A miss on the paused request's next chunk does not wait for it.
	r.mu.Lock()
	c := r.startLocked(3, onDemand)
	r.mu.Unlock()
	if c.fill != nil {
		t.Fatal("a miss on the next chunk of a paused fill request waits for the request")
	}
	<-c.done
	select {
	case pos := <-bad:
		t.Fatalf("the fill read its body at %d after it paused", pos)
	default:
	}
	close(h.release)
	if err := <-done; err != nil {
		t.Fatalf("the on-demand read: %v", err)
	}
	waitComplete(t, r)
	if st := r.Stats(); st.OnDemandChunks != 2 || st.FillChunks != 14 {
		t.Fatalf("stats %+v; want chunks 3 and 12 on demand, the other 14 by the fill", st)
	}
}

// meteredBody is a fill request's body on a link the test meters: each
// chunk of it takes a token from link before it passes (or passes freely
// once free is closed), and counts in passed.
type meteredBody struct {
	ctx    context.Context
	rc     io.ReadCloser
	pos    int64
	link   chan struct{}
	free   chan struct{}
	passed *atomic.Int64
}

func (b *meteredBody) Read(p []byte) (int, error) {
	if b.pos%testChunk == 0 {
		select {
		case <-b.link:
		case <-b.free:
		case <-b.ctx.Done():
			return 0, b.ctx.Err()
		}
		b.passed.Add(1)
	}
	if n := testChunk - b.pos%testChunk; int64(len(p)) > n {
		p = p[:n]
	}
	n, err := b.rc.Read(p)
	b.pos += int64(n)
	return n, err
}

func (b *meteredBody) Close() error { return b.rc.Close() }

// TestHotPrefetchYieldsToMiss: with a hot set of the whole archive but one
// chunk (what a session that read everything left), an on-demand read of
// that chunk is served while the hot prefetch has most of it left: while
// the miss is in the store, each hot request in flight delivers at most
// the chunk it is in, then leaves the link to the miss.
func TestHotPrefetchYieldsToMiss(t *testing.T) {
	t.Parallel()
	const n, miss = 64, 40
	o := putObject(t, localStore(t), n*testChunk)
	opts := o.options(t.TempDir())
	opts.FillSpan, opts.FillParallel, opts.ReadAhead = 8*testChunk, 3, -1
	opts.ReadTimeout = time.Minute
	for i := range int64(n) {
		if i != miss {
			opts.Hot = append(opts.Hot, i)
		}
	}
	h := newHold(o.store, miss*testChunk)
	link, free := make(chan struct{}, 4*n), make(chan struct{})
	var passed atomic.Int64
	h.body = func(ctx context.Context, off int64, rc io.ReadCloser) io.ReadCloser {
		return &meteredBody{ctx: ctx, rc: rc, pos: off, link: link, free: free, passed: &passed}
	}
	opts.Store = h
	var yields atomic.Int64
	opts.yielded = func() { yields.Add(1) }
	r := open(t, opts)
	t.Cleanup(func() {
		select {
		case <-free:
		default:
			close(free)
		}
	})
	r.Fill()
	link <- struct{}{}
	link <- struct{}{}
	waitFor(t, "the hot prefetch's first chunks, its requests in flight", func() bool {
		return r.Stats().FillChunks == 2 && len(h.gets()) == opts.FillParallel
	})
	done := make(chan error, 1)
	go func() {
		buf := make([]byte, 100)
		_, err := r.ReadAt(buf, miss*testChunk)
		if err == nil && !bytes.Equal(buf, o.data[miss*testChunk:miss*testChunk+100]) {
			err = io.ErrUnexpectedEOF
		}
		done <- err
	}()
	<-h.started // the miss is in the store
	before := passed.Load()
	for range 3 * n {
		link <- struct{}{} // plenty of link for the hot prefetch to take
	}
	waitFor(t, "the hot prefetch to yield to the miss, or to run on", func() bool {
		return yields.Load() >= int64(opts.FillParallel) || passed.Load()-before > int64(opts.FillParallel)
	})
	took, filled := passed.Load()-before, r.Stats().FillChunks
	close(h.release)
	if err := <-done; err != nil {
		t.Fatalf("the miss: %v", err)
	}
	if took > int64(opts.FillParallel) {
		t.Fatalf("the hot prefetch took %d chunks of the link while the miss was in the store (%d of %d hot chunks fetched); want at most %d (one per request in flight)",
			took, filled, n-1, opts.FillParallel)
	}
	close(free)
	waitComplete(t, r)
	if st := r.Stats(); st.OnDemandChunks != 1 || st.FillChunks != n-1 {
		t.Fatalf("stats %+v; want the miss on demand, the other %d chunks by the fill", st, n-1)
	}
}

// TestFillBoundsHotSet: a manifest of an older hermesfs may name the whole
// archive hot; the fill takes the first uploader.HotLimit chunks of it as
// the hot set (here 4 MiB of an 8 MiB object), then fetches the rest in
// order, in runs.
func TestFillBoundsHotSet(t *testing.T) {
	t.Parallel()
	const n = 128
	o := putObject(t, localStore(t), n*testChunk)
	opts := o.options(t.TempDir())
	opts.FillSpan, opts.FillParallel, opts.ReadAhead = 8*testChunk, 1, -1
	for i := int64(n - 1); i >= 0; i-- {
		opts.Hot = append(opts.Hot, i)
	}
	h := newHold(o.store, -1)
	opts.Store = h
	r := open(t, opts)
	r.Fill()
	waitComplete(t, r)
	var want []int64
	for i := int64(n - 1); i >= n/2; i-- {
		want = append(want, i*testChunk)
	}
	for i := int64(0); i < n/2; i += 8 {
		want = append(want, i*testChunk)
	}
	if got := h.gets(); !slices.Equal(got, want) {
		t.Fatalf("gets at %v;\nwant %v: the first 64 hot chunks one by one, then the rest in runs of 8", got, want)
	}
}
