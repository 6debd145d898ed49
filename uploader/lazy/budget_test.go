package lazy

import (
	"bytes"
	"crypto/rand"
	"errors"
	"fmt"
	"io"
	mrand "math/rand/v2"
	"os"
	"path/filepath"
	"sync"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/hermesfs/hermesfs/uploader"
)

// putKey is putObject under key.
func putKey(t *testing.T, s uploader.Store, key string, size int) *object {
	t.Helper()
	b := make([]byte, size)
	rand.Read(b)
	o := &object{store: &countingStore{Store: s}, key: key, data: b}
	if _, err := s.Put(t.Context(), key, bytes.NewReader(b), int64(size), uploader.PutOptions{}); err != nil {
		t.Fatal(err)
	}
	whole, chunks, _, err := uploader.ChunkSums(t.Context(), bytes.NewReader(b), testChunk)
	if err != nil {
		t.Fatal(err)
	}
	o.sha, o.chunks = whole, chunks
	return o
}

// budgeted opens object o in dir with budget b and no read-ahead.
func (o *object) budgeted(t *testing.T, dir string, b *Budget) *Reader {
	t.Helper()
	opts := o.options(dir)
	opts.Path = filepath.Join(dir, filepath.Base(o.key))
	opts.Budget, opts.ReadAhead = b, -1
	return open(t, opts)
}

// diskBytes is the data the files in dir hold on disk: the bytes of their
// data extents (a punched hole holds none; the file system's own blocks,
// such as a fragmented file's extent tree, are not counted).
func diskBytes(t *testing.T, dir string) int64 {
	t.Helper()
	var n int64
	ents, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range ents {
		n += dataBytes(t, filepath.Join(dir, e.Name()))
	}
	return n
}

// DataBytes is the bytes of path's data extents (SEEK_DATA, SEEK_HOLE).
func dataBytes(t testing.TB, path string) int64 {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var n, off int64
	for {
		start, err := unix.Seek(int(f.Fd()), off, unix.SEEK_DATA)
		if errors.Is(err, unix.ENXIO) {
			return n
		}
		if err != nil {
			t.Fatal(err)
		}
		end, err := unix.Seek(int(f.Fd()), start, unix.SEEK_HOLE)
		if err != nil {
			t.Fatal(err)
		}
		n += end - start
		off = end
	}
}

func readChunkOK(t *testing.T, r *Reader, o *object, chunk int) {
	t.Helper()
	off := int64(chunk) * testChunk
	buf := make([]byte, min(testChunk, int64(len(o.data))-off))
	if _, err := r.ReadAt(buf, off); err != nil && err != io.EOF {
		t.Fatalf("%s chunk %d: %v", o.key, chunk, err)
	}
	if !bytes.Equal(buf, o.data[off:off+int64(len(buf))]) {
		t.Fatalf("%s chunk %d: wrong bytes", o.key, chunk)
	}
}

// Readers sharing a budget keep at most its bytes on disk, together; the
// least recently used chunk of any of them goes first, and a read of an
// evicted chunk fetches it again.
func TestBudgetEvictsLeastRecentlyUsed(t *testing.T) {
	s := localStore(t)
	a, b := putKey(t, s, "segments/a.seg", 8*testChunk), putKey(t, s, "segments/b.seg", 8*testChunk)
	dir := t.TempDir()
	budget := NewBudget(4 * testChunk)
	ra, rb := a.budgeted(t, dir, budget), b.budgeted(t, dir, budget)
	for i := range 4 {
		readChunkOK(t, ra, a, i)
	}
	readChunkOK(t, ra, a, 0) // 0 is now the most recently used; 1 the least
	readChunkOK(t, rb, b, 0) // evicts a's 1
	if st := budget.Stats(); st.Used != 4*testChunk || st.Evicted != 1 {
		t.Fatalf("after 5 chunks in a 4-chunk budget: %+v", st)
	}
	if got := diskBytes(t, dir); got > 4*testChunk {
		t.Fatalf("the cache files take %d bytes on disk, more than the budget's %d", got, 4*testChunk)
	}
	gets := a.store.gets.Load()
	readChunkOK(t, ra, a, 0)
	if a.store.gets.Load() != gets {
		t.Fatal("chunk 0 was evicted though recently used")
	}
	readChunkOK(t, ra, a, 1)
	if a.store.gets.Load() != gets+1 {
		t.Fatalf("chunk 1 should have been evicted and fetched again (%d gets, then %d)", gets, a.store.gets.Load())
	}
	if st := ra.Stats(); st.PresentBytes != 3*testChunk || st.Evicted != 2 {
		t.Fatalf("a's figures: %+v; want 3 chunks present, 2 evicted", st)
	}
	for i := range 8 {
		readChunkOK(t, rb, b, i)
	}
	if got := diskBytes(t, dir); got > 4*testChunk {
		t.Fatalf("the cache files take %d bytes on disk, more than the budget's %d", got, 4*testChunk)
	}
	if st := ra.Stats(); st.PresentBytes != 0 {
		t.Fatalf("a keeps %d bytes after b read 8 chunks in a 4-chunk budget", st.PresentBytes)
	}
	// A reader closed gives its bytes back, and its file goes.
	if err := rb.Close(); err != nil {
		t.Fatal(err)
	}
	if st := budget.Stats(); st.Used != 0 {
		t.Fatalf("after the only reader holding chunks closed: %+v", st)
	}
	if _, err := os.Stat(filepath.Join(dir, "b.seg.partial")); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("a closed budgeted reader left its cache file: %v", err)
	}
	if _, err := os.Stat(filepath.Join(dir, "a.seg.present")); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("a budgeted reader wrote a present log: %v", err)
	}
}

// A chunk fetched again after its eviction is checked like any miss: the
// store's damage is an error, never the bytes.
func TestBudgetRefetchIsVerified(t *testing.T) {
	s := localStore(t)
	o := putKey(t, s, "segments/a.seg", 4*testChunk)
	budget := NewBudget(testChunk)
	r := o.budgeted(t, t.TempDir(), budget)
	readChunkOK(t, r, o, 0)
	readChunkOK(t, r, o, 1) // evicts 0
	flip := func(off int64, b []byte) []byte {
		b = bytes.Clone(b)
		b[len(b)/2] ^= 1
		return b
	}
	o.store.mangle.Store(&flip)
	buf := make([]byte, 100)
	n, err := r.ReadAt(buf, 10)
	if !errors.Is(err, ErrDigest) || !errors.Is(err, syscall.EIO) {
		t.Fatalf("a damaged refetch of an evicted chunk: %d bytes, %v; want EIO, ErrDigest", n, err)
	}
	o.store.mangle.Store(nil)
	readChunkOK(t, r, o, 0)
}

// Readers of one budget read concurrently while the budget evicts their
// chunks under them: every read gets the right bytes (a chunk being read
// from its cache file is never punched out under it), and once the reads
// are done the files hold no more than the budget.
func TestBudgetEvictionNeverRacesReads(t *testing.T) {
	s := localStore(t)
	dir := t.TempDir()
	budget := NewBudget(3 * testChunk)
	var objs []*object
	var readers []*Reader
	for k := range 3 {
		o := putKey(t, s, fmt.Sprintf("segments/%d.seg", k), 6*testChunk+1000*k)
		objs = append(objs, o)
		opts := o.options(dir)
		opts.Path = filepath.Join(dir, fmt.Sprintf("%d.seg", k))
		opts.Budget = budget // with read-ahead
		readers = append(readers, open(t, opts))
	}
	var wg sync.WaitGroup
	for w := range 8 {
		wg.Go(func() {
			rng := mrand.New(mrand.NewPCG(uint64(w), 7))
			for range 300 {
				k := rng.IntN(len(objs))
				o, r := objs[k], readers[k]
				off := rng.Int64N(int64(len(o.data)))
				n := min(1+rng.Int64N(3*testChunk), int64(len(o.data))-off)
				buf := make([]byte, n)
				if _, err := r.ReadAt(buf, off); err != nil && err != io.EOF {
					t.Errorf("%s at %d+%d: %v", o.key, off, n, err)
					return
				}
				if !bytes.Equal(buf, o.data[off:off+n]) {
					t.Errorf("%s at %d+%d: wrong bytes", o.key, off, n)
					return
				}
			}
		})
	}
	wg.Wait()
	// Read-ahead may still be fetching: wait until no fetch is in flight
	// (a fetch leaves once its chunk is stored and the budget reclaimed).
	waitFor(t, "the read-ahead to end", func() bool {
		for _, r := range readers {
			r.mu.Lock()
			n := len(r.inflight)
			r.mu.Unlock()
			if n > 0 {
				return false
			}
		}
		return true
	})
	if got := diskBytes(t, dir); got > 3*testChunk {
		t.Fatalf("the cache files take %d bytes on disk, more than the budget's %d (%+v)", got, 3*testChunk, budget.Stats())
	}
	st := budget.Stats()
	t.Logf("budget after 2400 concurrent reads: %+v", st)
	if st.Evicted == 0 {
		t.Fatal("nothing was evicted: the test did not exercise eviction")
	}
}
