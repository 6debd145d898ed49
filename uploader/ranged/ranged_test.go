package ranged_test

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"io"
	"os"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hermesfs/hermesfs/uploader"
	"github.com/hermesfs/hermesfs/uploader/ranged"
)

// gated is a store whose Gets can be held, to make misses overlap.
type gated struct {
	uploader.Store
	gets atomic.Int64
	hold chan struct{} // nil: pass
}

func (g *gated) Get(ctx context.Context, key string, off, length int64) (io.ReadCloser, uploader.ObjectInfo, error) {
	g.gets.Add(1)
	if g.hold != nil {
		<-g.hold
	}
	return g.Store.Get(ctx, key, off, length)
}

func newObject(t *testing.T, n int) (*gated, []byte) {
	t.Helper()
	s, err := uploader.NewLocal(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	data := make([]byte, n)
	rand.Read(data)
	if _, err := s.Put(t.Context(), "obj", bytes.NewReader(data), int64(n), uploader.PutOptions{}); err != nil {
		t.Fatal(err)
	}
	return &gated{Store: s}, data
}

func digests(data []byte, cs int) ranged.Digests {
	d := ranged.Digests{ChunkSize: int64(cs)}
	for off := 0; off < len(data); off += cs {
		s := sha256.Sum256(data[off:min(len(data), off+cs)])
		d.SHA256 = append(d.SHA256, hex.EncodeToString(s[:]))
	}
	return d
}

func TestReadsOnlyWhatIsAsked(t *testing.T) {
	t.Parallel()
	st, data := newObject(t, 1<<20+123)
	c, err := ranged.New(st, ranged.Options{ChunkSize: 64 << 10, ReadAhead: -1})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	o, err := c.Object("obj", int64(len(data)), ranged.Digests{})
	if err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 100)
	if _, err := o.ReadAt(buf, 300<<10); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(buf, data[300<<10:300<<10+100]) {
		t.Fatal("wrong bytes")
	}
	if s := c.Stats(); s.Gets != 1 || s.BytesFetched != 64<<10 {
		t.Fatalf("one small read: %+v, want one 64 KiB get", s)
	}
	// Again: from the cache.
	if _, err := o.ReadAt(buf, 300<<10+50); err != nil {
		t.Fatal(err)
	}
	if s := c.Stats(); s.Gets != 1 {
		t.Fatalf("cached read fetched again: %+v", s)
	}
	// A read across chunks, and the short tail.
	tail := make([]byte, 200<<10)
	n, err := o.ReadAt(tail, int64(len(data))-150<<10)
	if n != 150<<10 || err != io.EOF {
		t.Fatalf("tail read: %d, %v", n, err)
	}
	if !bytes.Equal(tail[:n], data[len(data)-150<<10:]) {
		t.Fatal("wrong tail bytes")
	}
	if _, err := o.ReadAt(buf, int64(len(data))); err != io.EOF {
		t.Fatalf("read at the end: %v", err)
	}
}

func TestEvictsLeastRecentlyUsed(t *testing.T) {
	t.Parallel()
	st, data := newObject(t, 1<<20)
	const cs = 64 << 10
	c, err := ranged.New(st, ranged.Options{ChunkSize: cs, MaxBytes: 4 * cs, ReadAhead: -1})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	o, _ := c.Object("obj", int64(len(data)), ranged.Digests{})
	buf := make([]byte, 10)
	read := func(chunk int) {
		t.Helper()
		if _, err := o.ReadAt(buf, int64(chunk*cs)); err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(buf, data[chunk*cs:chunk*cs+10]) {
			t.Fatalf("chunk %d: wrong bytes", chunk)
		}
	}
	for i := range 4 {
		read(i)
	}
	read(0) // 0 is now the most recently used; 1 the least
	read(4) // evicts 1
	if s := c.Stats(); s.Gets != 5 || s.Evicted != 1 || s.CachedBytes != 4*cs {
		t.Fatalf("after 5 chunks in a 4-chunk cache: %+v", s)
	}
	read(0)
	if g := c.Stats().Gets; g != 5 {
		t.Fatalf("chunk 0 was evicted though recently used (%d gets)", g)
	}
	read(1)
	if g := c.Stats().Gets; g != 6 {
		t.Fatalf("chunk 1 should have been evicted and fetched again (%d gets)", g)
	}
	ents, _ := os.ReadDir(c.Dir())
	if len(ents) != 4 {
		t.Fatalf("%d chunk files in the cache dir, want 4", len(ents))
	}
}

func TestConcurrentMissesShareOneGet(t *testing.T) {
	t.Parallel()
	st, data := newObject(t, 256<<10)
	st.hold = make(chan struct{})
	c, err := ranged.New(st, ranged.Options{ChunkSize: 256 << 10, ReadAhead: -1})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	o, _ := c.Object("obj", int64(len(data)), ranged.Digests{})
	var wg sync.WaitGroup
	errs := make(chan error, 8)
	for i := range 8 {
		wg.Go(func() {
			buf := make([]byte, 1000)
			if _, err := o.ReadAt(buf, int64(i*1000)); err != nil {
				errs <- err
			} else if !bytes.Equal(buf, data[i*1000:i*1000+1000]) {
				errs <- errors.New("wrong bytes")
			}
		})
	}
	// Let the first Get through once it is waiting; the others must be
	// waiting on it rather than sending their own.
	for st.gets.Load() == 0 {
		runtime.Gosched()
	}
	close(st.hold)
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	if g := st.gets.Load(); g != 1 {
		t.Fatalf("%d gets for 8 concurrent readers of one chunk", g)
	}
}

func TestSequentialReadAhead(t *testing.T) {
	t.Parallel()
	st, data := newObject(t, 1<<20)
	const cs = 64 << 10
	c, err := ranged.New(st, ranged.Options{ChunkSize: cs, ReadAhead: 2})
	if err != nil {
		t.Fatal(err)
	}
	o, _ := c.Object("obj", int64(len(data)), ranged.Digests{})
	buf := make([]byte, cs)
	for i := range 3 {
		if _, err := o.ReadAt(buf, int64(i*cs)); err != nil {
			t.Fatal(err)
		}
	}
	defer c.Close()
	deadline := time.Now().Add(30 * time.Second)
	for c.Stats().Gets < 5 && time.Now().Before(deadline) {
		time.Sleep(time.Millisecond)
	}
	if g := c.Stats().Gets; g != 5 {
		t.Fatalf("3 sequential chunk reads with read-ahead 2: %d gets, want 5", g)
	}
}

func TestVerifiesDigests(t *testing.T) {
	t.Parallel()
	st, data := newObject(t, 200<<10)
	c, err := ranged.New(st, ranged.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	d := digests(data, 64<<10)
	o, err := c.Object("obj", int64(len(data)), d)
	if err != nil {
		t.Fatal(err)
	}
	if !o.Verified() {
		t.Fatal("not verified")
	}
	buf := make([]byte, 10)
	if _, err := o.ReadAt(buf, 70<<10); err != nil {
		t.Fatal(err)
	}
	if s := c.Stats(); s.BytesFetched != 64<<10 {
		t.Fatalf("the digests' chunk size was not used: %+v", s)
	}
	// A digest that does not match: an error, never the bytes.
	d.SHA256[2] = d.SHA256[0]
	bad, err := c.Object("obj", int64(len(data)), d)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := bad.ReadAt(buf, 130<<10); !errors.Is(err, ranged.ErrCorrupt) {
		t.Fatalf("mismatching chunk: %v, want ErrCorrupt", err)
	}
	if _, err := c.Object("obj", int64(len(data)), ranged.Digests{ChunkSize: 64 << 10, SHA256: d.SHA256[:2]}); err == nil {
		t.Fatal("too few digests accepted")
	}
}
