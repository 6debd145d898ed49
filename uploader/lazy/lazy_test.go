package lazy

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"io"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/hermesfs/hermesfs/uploader"
	"github.com/hermesfs/hermesfs/uploader/faultproxy"
	"github.com/hermesfs/hermesfs/uploader/s3"
	"github.com/hermesfs/hermesfs/uploader/s3test"
)

const testChunk = 64 << 10

// object is a random object in a store, with what a manifest says of it.
type object struct {
	store  *countingStore
	key    string
	data   []byte
	sha    string
	chunks []string
}

func putObject(t *testing.T, s uploader.Store, size int) *object {
	t.Helper()
	b := make([]byte, size)
	rand.Read(b)
	o := &object{store: &countingStore{Store: s}, key: "snapshots/x.sqfs", data: b}
	if _, err := s.Put(t.Context(), o.key, bytes.NewReader(b), int64(size), uploader.PutOptions{}); err != nil {
		t.Fatal(err)
	}
	whole, chunks, _, err := uploader.ChunkSums(t.Context(), bytes.NewReader(b), testChunk)
	if err != nil {
		t.Fatal(err)
	}
	o.sha, o.chunks = whole, chunks
	return o
}

func localStore(t *testing.T) uploader.Store {
	s, err := uploader.NewLocal(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func (o *object) options(dir string) Options {
	return Options{
		Store: o.store, Key: o.key, Size: int64(len(o.data)), ChunkSize: testChunk, Chunks: o.chunks, SHA256: o.sha,
		Path: filepath.Join(dir, "x.sqfs"), ReadTimeout: 2 * time.Second,
		Retry: uploader.RetryPolicy{Base: 5 * time.Millisecond, Cap: 50 * time.Millisecond},
	}
}

func open(t *testing.T, o Options) *Reader {
	t.Helper()
	r, err := Open(o)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { r.Close() })
	return r
}

// countingStore counts Gets and can damage what they return.
type countingStore struct {
	uploader.Store
	gets   atomic.Int64
	mangle atomic.Pointer[func(off int64, b []byte) []byte]
}

func (c *countingStore) Get(ctx context.Context, key string, off, length int64) (io.ReadCloser, uploader.ObjectInfo, error) {
	c.gets.Add(1)
	rc, info, err := c.Store.Get(ctx, key, off, length)
	if err != nil {
		return rc, info, err
	}
	if f := c.mangle.Load(); f != nil {
		b, err := io.ReadAll(rc)
		rc.Close()
		if err != nil {
			return nil, info, err
		}
		return io.NopCloser(bytes.NewReader((*f)(off, b))), info, nil
	}
	return rc, info, nil
}

func waitComplete(t *testing.T, r *Reader) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for !r.Complete() {
		if time.Now().After(deadline) {
			t.Fatalf("fill did not complete: %+v, err %v", r.Stats(), r.FillErr())
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func checkReads(t *testing.T, r *Reader, data []byte) {
	t.Helper()
	var wg sync.WaitGroup
	for w := range 4 {
		wg.Go(func() {
			for off := w * 777; off < len(data); off += 4 * 50000 {
				n := min(50000, len(data)-off)
				buf := make([]byte, n)
				if _, err := r.ReadAt(buf, int64(off)); err != nil && err != io.EOF {
					t.Errorf("read at %d: %v", off, err)
					return
				}
				if !bytes.Equal(buf, data[off:off+n]) {
					t.Errorf("read at %d: wrong bytes", off)
					return
				}
			}
		})
	}
	wg.Wait()
}

func TestReadFillComplete(t *testing.T) {
	t.Parallel()
	run := func(t *testing.T, s uploader.Store) {
		o := putObject(t, s, 2<<20+12345)
		dir := t.TempDir()
		r := open(t, o.options(dir))
		checkReads(t, r, o.data)
		r.Fill()
		waitComplete(t, r)
		got, err := os.ReadFile(filepath.Join(dir, "x.sqfs"))
		if err != nil || !bytes.Equal(got, o.data) {
			t.Fatalf("complete cache differs from the object (err %v)", err)
		}
		if _, err := os.Stat(filepath.Join(dir, "x.sqfs.present")); !os.IsNotExist(err) {
			t.Fatalf("present log left behind: %v", err)
		}
		st := r.Stats()
		if !st.Complete || st.PresentBytes != st.TotalBytes || st.OnDemandChunks+st.FillChunks < int64(len(o.chunks)) {
			t.Fatalf("stats %+v", st)
		}
		checkReads(t, r, o.data)
		r.Close()
		// A second open finds the complete file and fetches nothing.
		before := o.store.gets.Load()
		r2 := open(t, o.options(dir))
		checkReads(t, r2, o.data)
		if n := o.store.gets.Load() - before; n != 0 || !r2.Complete() {
			t.Fatalf("reopened complete cache made %d gets (complete %v)", n, r2.Complete())
		}
	}
	t.Run("local", func(t *testing.T) { t.Parallel(); run(t, localStore(t)) })
	t.Run("s3", func(t *testing.T) {
		t.Parallel()
		endpoint, bucket, access, secret := s3test.Start(t)
		st, err := s3.New(t.Context(), s3.Config{
			Bucket: bucket, Prefix: "hermes", Endpoint: endpoint, Region: "us-east-1", PathStyle: true,
			AccessKeyID: access, SecretAccessKey: secret, PartSize: s3.MinPartSize,
		})
		if err != nil {
			t.Fatal(err)
		}
		run(t, st)
	})
}

func TestConcurrentMissesCoalesce(t *testing.T) {
	t.Parallel()
	o := putObject(t, localStore(t), 4*testChunk)
	opts := o.options(t.TempDir())
	opts.ReadAhead = -1
	r := open(t, opts)
	var wg sync.WaitGroup
	for range 16 {
		wg.Go(func() {
			buf := make([]byte, 100)
			if _, err := r.ReadAt(buf, testChunk+5); err != nil || !bytes.Equal(buf, o.data[testChunk+5:testChunk+105]) {
				t.Errorf("read: %v", err)
			}
		})
	}
	wg.Wait()
	if n := o.store.gets.Load(); n != 1 {
		t.Fatalf("16 concurrent reads of one chunk made %d gets, want 1", n)
	}
}

func TestDamagedBytesNeverServed(t *testing.T) {
	t.Parallel()
	o := putObject(t, localStore(t), 8*testChunk)
	opts := o.options(t.TempDir())
	opts.ReadTimeout = 300 * time.Millisecond
	r := open(t, opts)
	flip := func(off int64, b []byte) []byte {
		if off == 3*testChunk && len(b) > 10 {
			b[10] ^= 0x40
		}
		return b
	}
	o.store.mangle.Store(&flip)
	buf := make([]byte, 1000)
	_, err := r.ReadAt(buf, 3*testChunk+5)
	var ce *ChunkError
	if !errors.As(err, &ce) || ce.Chunk != 3 || !errors.Is(err, ErrDigest) || !errors.Is(err, syscall.EIO) {
		t.Fatalf("read of a damaged chunk: %v", err)
	}
	if st := r.Stats(); st.Errors == 0 || st.PresentBytes != 0 {
		t.Fatalf("stats after a damaged chunk %+v", st)
	}
	// Other chunks are fine meanwhile.
	if _, err := r.ReadAt(buf, 0); err != nil || !bytes.Equal(buf, o.data[:1000]) {
		t.Fatalf("read of an intact chunk: %v", err)
	}
	// A later read tries again.
	o.store.mangle.Store(nil)
	if _, err := r.ReadAt(buf, 3*testChunk+5); err != nil || !bytes.Equal(buf, o.data[3*testChunk+5:3*testChunk+1005]) {
		t.Fatalf("read after the store recovered: %v", err)
	}
	// Truncated responses are caught too.
	cut := func(off int64, b []byte) []byte { return b[:len(b)/2] }
	o.store.mangle.Store(&cut)
	if _, err := r.ReadAt(buf, 5*testChunk); !errors.Is(err, syscall.EIO) {
		t.Fatalf("read of a truncated chunk: %v", err)
	}
}

func TestObjectReplacedUnderReader(t *testing.T) {
	t.Parallel()
	s := localStore(t)
	o := putObject(t, s, 4*testChunk)
	opts := o.options(t.TempDir())
	opts.ReadTimeout = 200 * time.Millisecond
	opts.ReadAhead = -1
	r := open(t, opts)
	buf := make([]byte, 10)
	if _, err := r.ReadAt(buf, 0); err != nil {
		t.Fatal(err)
	}
	other := make([]byte, len(o.data))
	rand.Read(other)
	time.Sleep(10 * time.Millisecond) // a new mtime, so a new ETag
	if _, err := s.Put(t.Context(), o.key, bytes.NewReader(other), int64(len(other)), uploader.PutOptions{}); err != nil {
		t.Fatal(err)
	}
	_, err := r.ReadAt(buf, 2*testChunk)
	if !errors.Is(err, ErrDigest) || !bytes.Contains([]byte(err.Error()), []byte("object changed")) {
		t.Fatalf("read after the object was replaced: %v", err)
	}
	// What was cached before still reads.
	if _, err := r.ReadAt(buf, 0); err != nil || !bytes.Equal(buf, o.data[:10]) {
		t.Fatalf("cached chunk: %v", err)
	}
}

func TestResumeAfterInterruptedFill(t *testing.T) {
	t.Parallel()
	o := putObject(t, localStore(t), 16*testChunk+7)
	dir := t.TempDir()
	r := open(t, o.options(dir))
	buf := make([]byte, 3*testChunk)
	if _, err := r.ReadAt(buf, 4*testChunk); err != nil {
		t.Fatal(err)
	}
	r.Close()
	// A crash could leave a torn record at the log's end.
	f, err := os.OpenFile(filepath.Join(dir, "x.sqfs.present"), os.O_APPEND|os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	f.Write([]byte{1, 2, 3})
	f.Close()

	before := o.store.gets.Load()
	r2 := open(t, o.options(dir))
	if st := r2.Stats(); st.PresentBytes < 3*testChunk {
		t.Fatalf("resumed cache lost what was fetched: %+v", st)
	}
	if _, err := r2.ReadAt(buf, 4*testChunk); err != nil || !bytes.Equal(buf, o.data[4*testChunk:7*testChunk]) {
		t.Fatalf("resumed read: %v", err)
	}
	if n := o.store.gets.Load() - before; n != 0 {
		t.Fatalf("resumed read of cached chunks made %d gets", n)
	}
	r2.Fill()
	waitComplete(t, r2)
	if n := o.store.gets.Load() - before; n > 17-3 {
		t.Fatalf("fill fetched %d chunks, at most 14 were absent", n)
	}
	got, _ := os.ReadFile(filepath.Join(dir, "x.sqfs"))
	if !bytes.Equal(got, o.data) {
		t.Fatal("completed cache differs")
	}
}

func TestPresentLogOfAnotherObjectIsDiscarded(t *testing.T) {
	t.Parallel()
	o := putObject(t, localStore(t), 4*testChunk)
	dir := t.TempDir()
	r := open(t, o.options(dir))
	buf := make([]byte, testChunk)
	r.ReadAt(buf, 0)
	r.Close()
	o2 := putObject(t, localStore(t), 4*testChunk)
	r2 := open(t, o2.options(dir))
	if st := r2.Stats(); st.PresentBytes != 0 {
		t.Fatalf("another object's chunks taken as present: %+v", st)
	}
	if _, err := r2.ReadAt(buf, 0); err != nil || !bytes.Equal(buf, o2.data[:testChunk]) {
		t.Fatalf("read: %v", err)
	}
}

func TestDiskFullStopsFillKeepsServing(t *testing.T) {
	t.Parallel()
	o := putObject(t, localStore(t), 8*testChunk)
	dir := t.TempDir()
	opts := o.options(dir)
	var writes atomic.Int64
	opts.writeAt = func(f *os.File, b []byte, off int64) (int, error) {
		if writes.Add(1) > 2 {
			return 0, syscall.ENOSPC
		}
		return f.WriteAt(b, off)
	}
	r := open(t, opts)
	r.Fill()
	deadline := time.Now().Add(30 * time.Second)
	for r.FillErr() == nil && time.Now().Before(deadline) {
		time.Sleep(5 * time.Millisecond)
	}
	if !errors.Is(r.FillErr(), syscall.ENOSPC) {
		t.Fatalf("fill error %v", r.FillErr())
	}
	checkReads(t, r, o.data)
	if r.Complete() {
		t.Fatal("complete without the bytes on disk")
	}
	r.Close()
	// What the log marks present is on disk and right.
	r2 := open(t, o.options(dir))
	st := r2.Stats()
	if st.PresentBytes > 2*testChunk {
		t.Fatalf("%d bytes marked present, at most 2 chunks were written", st.PresentBytes)
	}
	r2.Fill()
	waitComplete(t, r2)
}

func TestHotChunksFirst(t *testing.T) {
	t.Parallel()
	o := putObject(t, localStore(t), 8*testChunk)
	opts := o.options(t.TempDir())
	opts.Hot = []int64{6, 2}
	opts.FillParallel = 1
	var order []int64
	var mu sync.Mutex
	rec := func(off int64, b []byte) []byte {
		mu.Lock()
		order = append(order, off/testChunk)
		mu.Unlock()
		return b
	}
	o.store.mangle.Store(&rec)
	r := open(t, opts)
	r.Fill()
	waitComplete(t, r)
	if len(order) < 2 || order[0] != 6 || order[1] != 2 {
		t.Fatalf("fill order %v, want the hot chunks 6, 2 first", order)
	}
	// Reads are recorded in first-read order.
	r2 := open(t, o.options(t.TempDir()))
	buf := make([]byte, 10)
	for _, off := range []int64{5*testChunk + 3, 0, 5 * testChunk, testChunk - 5} {
		r2.ReadAt(buf, off)
	}
	if got := r2.Hot(); len(got) != 3 || got[0] != 5 || got[1] != 0 || got[2] != 1 {
		t.Fatalf("hot %v, want [5 0 1]", got)
	}
}

func TestPrefetchAndSum(t *testing.T) {
	t.Parallel()
	o := putObject(t, localStore(t), 8*testChunk)
	r := open(t, o.options(t.TempDir()))
	if err := r.Prefetch(t.Context(), 6*testChunk+1, 8*testChunk); err != nil {
		t.Fatal(err)
	}
	if st := r.Stats(); st.PresentBytes != 2*testChunk {
		t.Fatalf("prefetch: %+v", st)
	}
	sum := sha256.Sum256(o.data)
	if hex.EncodeToString(sum[:]) != o.sha {
		t.Fatal("test object sum")
	}
}

// TestFlakyStoreThroughFaultProxy reads and fills through a proxy that
// fails about 30% of the GETs in the ways networks fail: every byte read
// is right, and the fill completes.
func TestFlakyStoreThroughFaultProxy(t *testing.T) {
	t.Parallel()
	endpoint, bucket, access, secret := s3test.Start(t)
	fp, err := faultproxy.Start(endpoint)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { fp.Close() })
	st, err := s3.New(t.Context(), s3.Config{
		Bucket: bucket, Prefix: "hermes", Endpoint: fp.URL, Region: "us-east-1", PathStyle: true,
		AccessKeyID: access, SecretAccessKey: secret, PartSize: s3.MinPartSize,
	})
	if err != nil {
		t.Fatal(err)
	}
	o := putObject(t, st, 1<<20+333)
	faults := []faultproxy.Fault{faultproxy.Error500, faultproxy.Reset, faultproxy.Truncate, faultproxy.SlowDown}
	fp.SetRule(func(r faultproxy.Request) faultproxy.Fault {
		if r.Op != "GetObject" || r.Seq%10 >= 3 {
			return faultproxy.Pass
		}
		return faults[r.Seq%len(faults)]
	})
	opts := o.options(t.TempDir())
	opts.ReadTimeout = 20 * time.Second
	r := open(t, opts)
	checkReads(t, r, o.data)
	r.Fill()
	waitComplete(t, r)
	if _, f := fp.Counts(); len(f) == 0 {
		t.Fatal("the proxy injected no fault")
	}
}

// TestDamagedCacheRefetched: a chunk the log lists but whose bytes on
// disk changed (bit rot, a stray write) is fetched again, not served; a
// log whose data file is gone vouches for nothing.
func TestDamagedCacheRefetched(t *testing.T) {
	t.Parallel()
	o := putObject(t, localStore(t), 6*testChunk)
	dir := t.TempDir()
	opts := o.options(dir)
	opts.ReadAhead = -1
	r := open(t, opts)
	buf := make([]byte, 2*testChunk)
	if _, err := r.ReadAt(buf, 2*testChunk); err != nil {
		t.Fatal(err)
	}
	r.Close()
	part := filepath.Join(dir, "x.sqfs.partial")
	f, err := os.OpenFile(part, os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	f.WriteAt([]byte{0xff, 0xee}, 3*testChunk+100)
	f.Close()
	before := o.store.gets.Load()
	r2 := open(t, opts)
	if _, err := r2.ReadAt(buf, 2*testChunk); err != nil || !bytes.Equal(buf, o.data[2*testChunk:4*testChunk]) {
		t.Fatalf("read of a damaged cached chunk: %v", err)
	}
	if n := o.store.gets.Load() - before; n != 1 {
		t.Fatalf("%d gets; want 1 (the damaged chunk only)", n)
	}
	r2.Close()
	os.Remove(part)
	r3 := open(t, opts)
	if st := r3.Stats(); st.PresentBytes != 0 {
		t.Fatalf("chunks present without a data file: %+v", st)
	}
}

// TestFillRepairsDamagedCache: the fill completes a cache whose earlier
// run left a damaged chunk that no read touched.
func TestFillRepairsDamagedCache(t *testing.T) {
	t.Parallel()
	o := putObject(t, localStore(t), 6*testChunk)
	dir := t.TempDir()
	r := open(t, o.options(dir))
	buf := make([]byte, 3*testChunk)
	if _, err := r.ReadAt(buf, 0); err != nil {
		t.Fatal(err)
	}
	r.Close()
	f, err := os.OpenFile(filepath.Join(dir, "x.sqfs.partial"), os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	f.WriteAt([]byte{0xff, 0xee}, testChunk+7)
	f.Close()
	r2 := open(t, o.options(dir))
	r2.Fill()
	waitComplete(t, r2)
	got, _ := os.ReadFile(filepath.Join(dir, "x.sqfs"))
	if !bytes.Equal(got, o.data) {
		t.Fatal("completed cache differs")
	}
}

func TestHotRecorderBounds(t *testing.T) {
	t.Parallel()
	h := NewHotRecorder(nil, testChunk, time.Hour)
	limit := int(uploader.MaxHotBytes / testChunk)
	for i := range limit + 10 {
		h.Note(int64(i)*testChunk, 1)
	}
	if got := h.Hot(); len(got) != limit || got[0] != 0 || got[len(got)-1] != int64(limit)-1 {
		t.Fatalf("%d hot chunks recorded, want the first %d (%d MiB)", len(got), limit, uploader.MaxHotBytes>>20)
	}
	h = NewHotRecorder(nil, testChunk, time.Nanosecond)
	time.Sleep(time.Millisecond)
	h.Note(0, 10)
	if got := h.Hot(); len(got) != 0 {
		t.Fatalf("recorded %v after the window closed", got)
	}
}
