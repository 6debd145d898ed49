package image

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	iofs "io/fs"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/hermesfs/hermesfs/uploader"
	"github.com/hermesfs/hermesfs/uploader/crypt"
	"github.com/hermesfs/hermesfs/uploader/lazy"
)

// noise is n pseudo-random bytes from seed.
func noise(n int, seed uint64) []byte {
	r := rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15))
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(r.Uint32())
	}
	return b
}

// quick gives up on a chunk the store does not deliver within a second.
var quick = lazy.Options{ReadTimeout: time.Second}

type fixture struct {
	t     *testing.T
	store *uploader.Local
	cat   *uploader.Catalog
	dir   string
	ids   *crypt.Identities
}

func newFixture(t *testing.T, encrypted bool) *fixture {
	t.Helper()
	dir := t.TempDir()
	st, err := uploader.NewLocal(filepath.Join(dir, "store"))
	if err != nil {
		t.Fatal(err)
	}
	o := uploader.CatalogOptions{Host: "test"}
	f := &fixture{t: t, store: st, dir: dir}
	if encrypted {
		key := filepath.Join(dir, "key.txt")
		pub, err := crypt.WriteNewKey(key, "test")
		if err != nil {
			t.Fatal(err)
		}
		if o.Recipients, err = crypt.ParseRecipients([]string{pub}); err != nil {
			t.Fatal(err)
		}
		if f.ids, err = crypt.LoadIdentities([]string{key}); err != nil {
			t.Fatal(err)
		}
		o.Identities = f.ids
	}
	f.cat = uploader.NewCatalog(st, o)
	return f
}

// publish publishes the image new laid out by ext (ranges of "" are taken
// from seg, in order) on top of sources.
func (f *fixture) publish(seg []byte, ext []uploader.Extent, expect string, sources ...uploader.Manifest) uploader.Manifest {
	f.t.Helper()
	p := filepath.Join(f.dir, "seg")
	if err := os.WriteFile(p, seg, 0o600); err != nil {
		f.t.Fatal(err)
	}
	res, err := f.cat.PublishImage(f.t.Context(), uploader.ImageInput{Segment: p, Extents: ext, Sources: sources, Parent: expect, Expect: expect})
	if err != nil {
		f.t.Fatal(err)
	}
	return res.Manifest
}

func (f *fixture) open(m uploader.Manifest, cache string) *Image {
	f.t.Helper()
	m, err := f.cat.Manifest(f.t.Context(), m.ID) // as read back from the store
	if err != nil {
		f.t.Fatal(err)
	}
	im, err := Open(f.t.Context(), m, Options{Store: f.store, CacheDir: cache, Identities: f.ids})
	if err != nil {
		f.t.Fatal(err)
	}
	f.t.Cleanup(func() { im.Close() })
	return im
}

func readAll(t *testing.T, im *Image) []byte {
	t.Helper()
	b := make([]byte, im.Size())
	// Reads of odd sizes across extent boundaries.
	for off := int64(0); off < im.Size(); {
		n := min(int64(70_001), im.Size()-off)
		if _, err := im.ReadAt(b[off:off+n], off); err != nil && err != io.EOF {
			t.Fatalf("read %d+%d: %v", off, n, err)
		}
		off += n
	}
	return b
}

// twoImages publishes image A (all new) and image B (half of A's bytes in
// a new order, and new bytes).
func twoImages(t *testing.T, f *fixture) (a, b uploader.Manifest, wantA, wantB []byte) {
	wantA = noise(3<<20+12345, 1)
	a = f.publish(wantA, []uploader.Extent{{Length: int64(len(wantA))}}, "")
	fresh := noise(700_000, 2)
	segA := a.Segments[0].Key
	ext := []uploader.Extent{
		{Key: segA, Offset: 2 << 20, Length: 1<<20 + 12345}, // A's tail first
		{Offset: 0, Length: 300_000},                        // new
		{Key: segA, Offset: 4096, Length: 500_000},          // A's head
		{Offset: 300_000, Length: 400_000},                  // new
	}
	wantB = append(append(append(append([]byte{}, wantA[2<<20:]...), fresh[:300_000]...), wantA[4096:4096+500_000]...), fresh[300_000:]...)
	b = f.publish(fresh, ext, a.ID, a)
	return a, b, wantA, wantB
}

func TestImagesShareSegments(t *testing.T) {
	for _, enc := range []bool{false, true} {
		t.Run(map[bool]string{false: "plaintext", true: "encrypted"}[enc], func(t *testing.T) {
			f := newFixture(t, enc)
			a, b, wantA, wantB := twoImages(t, f)
			if len(b.Segments) != 2 || b.NewBytes != 700_000 {
				t.Fatalf("B: %d segments, %d new bytes; want 2 and 700000", len(b.Segments), b.NewBytes)
			}
			cache := t.TempDir()
			if got := readAll(t, f.open(a, cache)); !bytes.Equal(got, wantA) {
				t.Fatal("image A read back differs")
			}
			imB := f.open(b, cache)
			if got := readAll(t, imB); !bytes.Equal(got, wantB) {
				t.Fatal("image B read back differs")
			}
			// Completing B's caches leaves complete local segments that a
			// new reader serves without the store.
			imB.Fill()
			waitDone(t, imB)
			if err := os.RemoveAll(f.store.Root()); err != nil {
				t.Fatal(err)
			}
			m := imB.Manifest()
			im2, err := Open(t.Context(), m, Options{Store: f.store, CacheDir: cache, Identities: f.ids})
			if err != nil {
				t.Fatalf("open from a complete cache without the store: %v", err)
			}
			defer im2.Close()
			if got := readAll(t, im2); !bytes.Equal(got, wantB) {
				t.Fatal("image B from the complete cache differs")
			}
		})
	}
}

func waitDone(t *testing.T, im *Image) {
	t.Helper()
	for i := 0; !im.Complete(); i++ {
		if i > 6000 {
			t.Fatalf("the image's caches did not complete: %+v", im.Stats())
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func TestExtentsListRebuildsImage(t *testing.T) {
	// What the README's recipe does with dd: the extents list alone,
	// against the store's files, gives the image.
	f := newFixture(t, false)
	_, b, _, wantB := twoImages(t, f)
	text, err := os.ReadFile(filepath.Join(f.store.Root(), filepath.FromSlash(b.Extents)))
	if err != nil {
		t.Fatal(err)
	}
	var got []byte
	for line := range strings.Lines(string(text)) {
		var key string
		var off, n int64
		if _, err := fmt.Sscan(line, &key, &off, &n); err != nil {
			t.Fatalf("extents line %q: %v", line, err)
		}
		seg, err := os.ReadFile(filepath.Join(f.store.Root(), filepath.FromSlash(key)))
		if err != nil {
			t.Fatal(err)
		}
		got = append(got, seg[off:off+n]...)
	}
	if !bytes.Equal(got, wantB) {
		t.Fatal("the image rebuilt from the extents list differs")
	}
}

// tamper applies change to the stored object key and reports what opening
// and reading image m then gives.
func tamperRead(t *testing.T, f *fixture, m uploader.Manifest, key string, change func([]byte) []byte) error {
	t.Helper()
	p := filepath.Join(f.store.Root(), filepath.FromSlash(key))
	b, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(p, change(bytes.Clone(b)), 0o600); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.WriteFile(p, b, 0o600) })
	m, err = f.cat.Manifest(t.Context(), m.ID)
	if err != nil {
		return err
	}
	im, err := Open(t.Context(), m, Options{Store: f.store, CacheDir: t.TempDir(), Identities: f.ids, Lazy: quick})
	if err != nil {
		return err
	}
	defer im.Close()
	buf := make([]byte, im.Size())
	_, err = im.ReadAt(buf, 0)
	return err
}

func TestTamperedSegmentsFail(t *testing.T) {
	f := newFixture(t, false)
	a, b, _, _ := twoImages(t, f)
	segA := a.Segments[0].Key
	segB := b.Segments[len(b.Segments)-1].Key
	if segB == segA {
		segB = b.Segments[0].Key
	}
	cases := []struct {
		name   string
		key    string
		change func([]byte) []byte
	}{
		{"flipped byte in a segment", segA, func(b []byte) []byte { b[2<<20+100] ^= 1; return b }},
		{"truncated segment", segA, func(b []byte) []byte { return b[:len(b)-1000] }},
		{"swapped segment", segB, func([]byte) []byte { return noise(700_000, 99) }},
		{"flipped byte in the extents list", b.Extents, func(b []byte) []byte { b[len(b)-3] ^= 1; return b }},
		{"segment digests changed", uploader.SumsKey(segA), func(b []byte) []byte { return bytes.Replace(b, []byte(`"chunks":["`), []byte(`"chunks":["0`), 1) }},
		{"segment deleted", segA, nil},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			var err error
			if c.change == nil {
				p := filepath.Join(f.store.Root(), filepath.FromSlash(c.key))
				saved, _ := os.ReadFile(p)
				os.Remove(p)
				t.Cleanup(func() { os.WriteFile(p, saved, 0o600) })
				m, _ := f.cat.Manifest(t.Context(), b.ID)
				var im *Image
				im, err = Open(t.Context(), m, Options{Store: f.store, CacheDir: t.TempDir(), Lazy: quick})
				if err == nil {
					buf := make([]byte, im.Size())
					_, err = im.ReadAt(buf, 0)
					im.Close()
				}
				if !errors.Is(err, iofs.ErrNotExist) && !errors.As(err, new(*uploader.SegmentGoneError)) {
					t.Fatalf("read of a pruned segment: %v; want a segment-gone error", err)
				}
				return
			}
			err = tamperRead(t, f, b, c.key, c.change)
			if err == nil {
				t.Fatal("the tampered image was read without an error")
			}
			t.Logf("error, as wanted: %v", err)
		})
	}
}

func TestLegacyArchiveAsSegment(t *testing.T) {
	// A format 2 snapshot (one archive object) is the base of a format 4
	// one, which takes ranges of that archive as a segment.
	for _, enc := range []bool{false, true} {
		t.Run(map[bool]string{false: "plaintext", true: "encrypted"}[enc], func(t *testing.T) {
			f := newFixture(t, enc)
			old := noise(2<<20+777, 5)
			p := filepath.Join(f.dir, "old.sqfs")
			if err := os.WriteFile(p, old, 0o600); err != nil {
				t.Fatal(err)
			}
			lm, err := f.cat.Publish(t.Context(), uploader.PublishInput{Path: p})
			if err != nil {
				t.Fatal(err)
			}
			if lm.Segmented() {
				t.Fatal("the legacy publish wrote format 4")
			}
			cache := t.TempDir()
			if got := readAll(t, f.open(lm, cache)); !bytes.Equal(got, old) {
				t.Fatal("the legacy snapshot read as an image differs")
			}
			fresh := noise(100_000, 6)
			m := f.publish(fresh, []uploader.Extent{{Key: lm.Archive, Offset: 0, Length: 1 << 20}, {Length: 100_000}}, lm.ID, lm)
			want := append(append([]byte{}, old[:1<<20]...), fresh...)
			if got := readAll(t, f.open(m, t.TempDir())); !bytes.Equal(got, want) {
				t.Fatal("the format 4 image over a legacy archive differs")
			}
			if _, err := f.store.Stat(t.Context(), uploader.SumsKey(lm.Archive)); err != nil {
				t.Fatalf("digests of the legacy archive used as a segment: %v", err)
			}
		})
	}
}

func TestRestoreImageFallsBackPastDamage(t *testing.T) {
	f := newFixture(t, false)
	_, b, wantA, wantB := twoImages(t, f)
	open := func(ctx context.Context, m uploader.Manifest) (uploader.ImageReader, error) {
		return Open(ctx, m, Options{Store: f.store, CacheDir: t.TempDir(), Lazy: quick})
	}
	dst := filepath.Join(t.TempDir(), "image")
	res, err := f.cat.Restore(t.Context(), dst, uploader.RestoreOptions{Image: open})
	if err != nil {
		t.Fatal(err)
	}
	if got, _ := os.ReadFile(dst); res.Manifest.ID != b.ID || !bytes.Equal(got, wantB) {
		t.Fatalf("restored %s: the image differs from B", res.Manifest.ID)
	}
	// B's own segment damaged: the restore names B as corrupt and
	// restores A.
	p := filepath.Join(f.store.Root(), filepath.FromSlash(ownKey(b)))
	seg, _ := os.ReadFile(p)
	seg[10] ^= 0xff
	os.WriteFile(p, seg, 0o600)
	res, err = f.cat.Restore(t.Context(), dst, uploader.RestoreOptions{Image: open})
	if err != nil {
		t.Fatal(err)
	}
	if got, _ := os.ReadFile(dst); !slices.Equal(res.SkippedIDs(), []string{b.ID}) || !bytes.Equal(got, wantA) {
		t.Fatalf("after damage: restored %s skipping %v; want A, skipping B", res.Manifest.ID, res.SkippedIDs())
	}
}

func ownKey(m uploader.Manifest) string { return uploader.SegmentKey(m.ID, m.Encryption != nil) }

// countGets counts ranged Gets of segment objects.
type countGets struct {
	uploader.Store
	mu sync.Mutex
	n  map[string]int
}

func (c *countGets) Get(ctx context.Context, key string, off, length int64) (io.ReadCloser, uploader.ObjectInfo, error) {
	c.mu.Lock()
	c.n[key]++
	c.mu.Unlock()
	return c.Store.Get(ctx, key, off, length)
}

func TestPoolSharesSegments(t *testing.T) {
	f := newFixture(t, false)
	a, b, wantA, wantB := twoImages(t, f)
	cg := &countGets{Store: f.store, n: map[string]int{}}
	pool, err := NewPool(Options{Store: cg, CacheDir: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	am, _ := f.cat.Manifest(t.Context(), a.ID)
	bm, _ := f.cat.Manifest(t.Context(), b.ID)
	var completed sync.WaitGroup
	completed.Add(2)
	imA, err := pool.Open(t.Context(), am, completed.Done)
	if err != nil {
		t.Fatal(err)
	}
	imB, err := pool.Open(t.Context(), bm, completed.Done)
	if err != nil {
		t.Fatal(err)
	}
	if got := readAll(t, imA); !bytes.Equal(got, wantA) {
		t.Fatal("A differs")
	}
	gets := cg.n[ownKey(a)]
	if got := readAll(t, imB); !bytes.Equal(got, wantB) {
		t.Fatal("B differs")
	}
	if cg.n[ownKey(a)] != gets {
		t.Errorf("B's reads of A's segment went to the store again (%d Gets, then %d): the pool must share the segment's cache", gets, cg.n[ownKey(a)])
	}
	imB.Fill()
	completed.Wait() // both images complete: each told once
	imA.Close()
	if got := readAll(t, imB); !bytes.Equal(got, wantB) {
		t.Fatal("B differs once A is closed")
	}
	imB.Close()
}

// dataBytes is the bytes of the data extents of the files in dir whose
// names end in suffix (SEEK_DATA, SEEK_HOLE: a punched hole holds none).
func dataBytes(t *testing.T, dir, suffix string) int64 {
	t.Helper()
	ents, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	var n int64
	for _, e := range ents {
		if !strings.HasSuffix(e.Name(), suffix) {
			continue
		}
		f, err := os.Open(filepath.Join(dir, e.Name()))
		if err != nil {
			t.Fatal(err)
		}
		for off := int64(0); ; {
			start, err := unix.Seek(int(f.Fd()), off, unix.SEEK_DATA)
			if errors.Is(err, unix.ENXIO) {
				break
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
		f.Close()
	}
	return n
}

// Images of one pool with a budget (browse) share segments and one bound:
// reading both images whole, again and again and concurrently, keeps the
// bytes cached in all segments' files within it; what was evicted is
// fetched again when read, and checked again.
func TestPoolBudget(t *testing.T) {
	for _, enc := range []bool{false, true} {
		t.Run(map[bool]string{false: "plaintext", true: "encrypted"}[enc], func(t *testing.T) { testPoolBudget(t, enc) })
	}
}

func testPoolBudget(t *testing.T, enc bool) {
	f := newFixture(t, enc)
	a, b, wantA, wantB := twoImages(t, f)
	cg := &countGets{Store: f.store, n: map[string]int{}}
	const max = 1 << 20
	budget := lazy.NewBudget(max)
	cache := t.TempDir()
	// No read-ahead: once the reads return, no fetch is in flight.
	pool, err := NewPool(Options{Store: cg, CacheDir: cache, Identities: f.ids,
		Lazy: lazy.Options{ReadTimeout: 10 * time.Second, ReadAhead: -1, Budget: budget}})
	if err != nil {
		t.Fatal(err)
	}
	am, _ := f.cat.Manifest(t.Context(), a.ID)
	bm, _ := f.cat.Manifest(t.Context(), b.ID)
	imA, err := pool.Open(t.Context(), am, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer imA.Close()
	imB, err := pool.Open(t.Context(), bm, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer imB.Close()
	gets := func() int {
		cg.mu.Lock()
		defer cg.mu.Unlock()
		return cg.n[ownKey(a)] + cg.n[ownKey(b)]
	}
	var wg sync.WaitGroup
	for w := range 4 {
		wg.Go(func() {
			im, want := imA, wantA
			if w%2 == 1 {
				im, want = imB, wantB
			}
			for range 3 {
				got := make([]byte, im.Size())
				for off := int64(0); off < im.Size(); off += 100_000 {
					n := min(100_000, im.Size()-off)
					if _, err := im.ReadAt(got[off:off+n], off); err != nil && err != io.EOF {
						t.Errorf("read %d+%d: %v", off, n, err)
						return
					}
				}
				if !bytes.Equal(got, want) {
					t.Error("an image read through the budget differs")
					return
				}
			}
		})
	}
	wg.Wait()
	st := budget.Stats()
	onDisk := dataBytes(t, cache, ".partial")
	t.Logf("3 passes over 2 images (%d + %d bytes) by 4 readers in a %d-byte budget: %d GETs, %d bytes on disk, %+v",
		imA.Size(), imB.Size(), max, gets(), onDisk, st)
	if st.Evicted == 0 {
		t.Fatal("nothing evicted: the images fit the budget, the test proves nothing")
	}
	if onDisk > max || st.Used > max {
		t.Fatalf("the segments' cache files hold %d bytes; the budget is %d", onDisk, max)
	}
	// A's bytes at 1 MiB, which B does not use, are evicted by a read of
	// B whole (more than the budget); read again, they are fetched again,
	// and checked: the store's damage is an error, never the bytes.
	const at = 1 << 20
	buf := make([]byte, 1000)
	if _, err := imA.ReadAt(buf, at); err != nil || !bytes.Equal(buf, wantA[at:at+1000]) {
		t.Fatalf("A at 1 MiB: %v", err)
	}
	if got := readAll(t, imB); !bytes.Equal(got, wantB) {
		t.Fatal("B differs")
	}
	p := filepath.Join(f.store.Root(), filepath.FromSlash(ownKey(a)))
	seg, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	bad := bytes.Clone(seg)
	bad[at+100] ^= 1
	if err := os.WriteFile(p, bad, 0o600); err != nil {
		t.Fatal(err)
	}
	before := gets()
	if _, err := imA.ReadAt(buf, at); err == nil || !errors.Is(err, uploader.ErrCorrupt) {
		t.Fatalf("a damaged refetch of an evicted chunk: %v; want a corrupt-snapshot error", err)
	}
	if gets() == before {
		t.Fatal("the evicted bytes of A were not fetched again")
	}
	if err := os.WriteFile(p, seg, 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := imA.ReadAt(buf, at); err != nil || !bytes.Equal(buf, wantA[at:at+1000]) {
		t.Fatalf("A at 1 MiB once the store holds it again: %v", err)
	}
}

// A segment deleted from the store under an open image (its snapshots
// pruned) fails a read of bytes not cached at the store's first "no such
// key", with a SegmentGoneError; it is not retried until the read timeout.
func TestSegmentGoneFailsAtOnce(t *testing.T) {
	f := newFixture(t, false)
	a, b, _, wantB := twoImages(t, f)
	cg := &countGets{Store: f.store, n: map[string]int{}}
	bm, _ := f.cat.Manifest(t.Context(), b.ID)
	// Retried, a read would send many GETs within the timeout.
	im, err := Open(t.Context(), bm, Options{Store: cg, CacheDir: t.TempDir(),
		Lazy: lazy.Options{ReadTimeout: 5 * time.Second, ReadAhead: -1, Retry: uploader.RetryPolicy{Base: 5 * time.Millisecond, Cap: 50 * time.Millisecond}}})
	if err != nil {
		t.Fatal(err)
	}
	defer im.Close()
	buf := make([]byte, 1000)
	if _, err := im.ReadAt(buf, 0); err != nil || !bytes.Equal(buf, wantB[:1000]) {
		t.Fatalf("read before the prune: %v", err)
	}
	segA := ownKey(a)
	if err := f.store.Delete(t.Context(), segA); err != nil {
		t.Fatal(err)
	}
	cg.mu.Lock()
	before := cg.n[segA]
	cg.mu.Unlock()
	// B's bytes at 1 MiB come from A's segment, far from what was read.
	_, err = im.ReadAt(buf, 1<<20)
	var gone *uploader.SegmentGoneError
	if !errors.As(err, &gone) || gone.Key != segA || !errors.Is(err, iofs.ErrNotExist) {
		t.Fatalf("read of a pruned segment: %v; want a SegmentGoneError naming %s", err, segA)
	}
	cg.mu.Lock()
	n := cg.n[segA] - before
	cg.mu.Unlock()
	if n != 1 {
		t.Fatalf("the read of a pruned segment sent %d GETs; want 1: a missing key does not come back", n)
	}
	// The bytes cached are still served.
	if _, err := im.ReadAt(buf, 0); err != nil || !bytes.Equal(buf, wantB[:1000]) {
		t.Fatalf("cached bytes after the prune: %v", err)
	}
}

// A format 1 snapshot (no chunk digests) opens only when the caller reads
// such archives by range (NoDigestsChunkSize), and then reads right.
func TestFormat1ByRange(t *testing.T) {
	f := newFixture(t, false)
	data := noise(1<<20+4321, 9)
	p := filepath.Join(f.dir, "v1.sqfs")
	if err := os.WriteFile(p, data, 0o600); err != nil {
		t.Fatal(err)
	}
	m, err := f.cat.Publish(t.Context(), uploader.PublishInput{Path: p})
	if err != nil {
		t.Fatal(err)
	}
	m.Format, m.ChunkSize, m.Chunks, m.MetaOffset = 1, 0, nil, 0
	mj, _ := json.Marshal(m)
	if _, err := f.store.Put(t.Context(), uploader.ManifestKey(m.ID), bytes.NewReader(mj), int64(len(mj)), uploader.PutOptions{}); err != nil {
		t.Fatal(err)
	}
	m, err = f.cat.Manifest(t.Context(), m.ID)
	if err != nil || m.Lazy() {
		t.Fatalf("format 1 manifest read back: %v, chunk digests %d", err, len(m.Chunks))
	}
	if _, err := Open(t.Context(), m, Options{Store: f.store, CacheDir: t.TempDir()}); !errors.Is(err, ErrNoDigests) {
		t.Fatalf("format 1 without NoDigestsChunkSize: %v; want ErrNoDigests", err)
	}
	cg := &countGets{Store: f.store, n: map[string]int{}}
	im, err := Open(t.Context(), m, Options{Store: cg, CacheDir: t.TempDir(), NoDigestsChunkSize: 64 << 10, Lazy: lazy.Options{ReadAhead: -1}})
	if err != nil {
		t.Fatal(err)
	}
	defer im.Close()
	buf := make([]byte, 100)
	if _, err := im.ReadAt(buf, 500_000); err != nil || !bytes.Equal(buf, data[500_000:500_100]) {
		t.Fatalf("format 1 by range: %v", err)
	}
	if st := im.Stats(); st.PresentBytes != 64<<10 || cg.n[m.Archive] != 1 {
		t.Fatalf("a 100-byte read of a format 1 archive: %d GETs, %+v; want one 64 KiB chunk", cg.n[m.Archive], st)
	}
	if got := readAll(t, im); !bytes.Equal(got, data) {
		t.Fatal("format 1 by range differs")
	}
}

// TestPrefetchManyExtents: an image that lays out a segment's bytes in
// many small extents is prefetched with no chunk of the segment fetched
// twice, and reads back exactly; encrypted too (decrypted a bounded piece
// at a time).
func TestPrefetchManyExtents(t *testing.T) {
	for _, enc := range []bool{false, true} {
		t.Run(fmt.Sprint("encrypted=", enc), func(t *testing.T) {
			f := newFixture(t, enc)
			wantA := noise(6<<20, 3)
			a := f.publish(wantA, []uploader.Extent{{Length: int64(len(wantA))}}, "")
			segA := a.Segments[0].Key
			// B: A's bytes in 48 extents of 64 KiB, every other one
			// skipped (gaps smaller than a chunk), then a new tail.
			fresh := noise(10_000, 4)
			var ext []uploader.Extent
			var wantB []byte
			for i := int64(0); i < 48; i++ {
				off := i * 2 * (64 << 10)
				ext = append(ext, uploader.Extent{Key: segA, Offset: off, Length: 64 << 10})
				wantB = append(wantB, wantA[off:off+64<<10]...)
			}
			ext = append(ext, uploader.Extent{Length: int64(len(fresh))})
			wantB = append(wantB, fresh...)
			b := f.publish(fresh, ext, a.ID, a)
			bm, err := f.cat.Manifest(t.Context(), b.ID)
			if err != nil {
				t.Fatal(err)
			}
			cg := &countGets{Store: f.store, n: map[string]int{}}
			im, err := Open(t.Context(), bm, Options{Store: cg, CacheDir: t.TempDir(), Identities: f.ids})
			if err != nil {
				t.Fatal(err)
			}
			defer im.Close()
			before := cg.n[segA]
			if err := im.Prefetch(t.Context(), 0, im.Size()); err != nil {
				t.Fatal(err)
			}
			chunks := int((6<<20 + uploader.DefaultChunkSize - 1) / uploader.DefaultChunkSize)
			if gets := cg.n[segA] - before; gets == 0 || gets > chunks {
				t.Errorf("prefetch of 48 extents of one segment: %d Gets of it, more than its %d chunks", gets, chunks)
			}
			if got := readAll(t, im); !bytes.Equal(got, wantB) {
				t.Fatal("image differs after prefetch")
			}
		})
	}
}
