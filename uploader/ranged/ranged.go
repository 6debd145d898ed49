// Package ranged reads store objects by range through a size-bounded local
// cache: an io.ReaderAt over an archive in the store that fetches only the
// chunks a reader touches.
//
// An object is read in fixed-size chunks (Options.ChunkSize, or the chunk
// size its digests were computed with). A chunk is fetched with one ranged
// Get the first time any reader needs it, kept as a file in the cache
// directory, and served from there until the cache needs the space: the
// cache holds at most Options.MaxBytes of chunks, and the least recently
// used go first. Concurrent misses of one chunk share one Get. A reader
// that reads sequentially has the next Options.ReadAhead chunks fetched in
// the background.
//
// Verification: when the object comes with per-chunk sha256 digests
// (Digests), every chunk is checked on arrival and never cached or served
// if it does not match. Without them nothing is checked here: the archive
// reader above checks each block against the checksums the archive
// carries, so damage is still an I/O error, never wrong bytes, but it is
// noticed block by block rather than at the chunk.
//
// All methods are safe for concurrent use.
package ranged

import (
	"container/list"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hermesfs/hermesfs/uploader"
)

// Defaults of Options.
const (
	DefaultMaxBytes  = 1 << 30
	DefaultChunkSize = 256 << 10
	DefaultReadAhead = 4
	// DefaultFetchTimeout bounds one chunk's fetch, retries included.
	DefaultFetchTimeout = 30 * time.Second
)

// Options configures a Cache. The zero value works.
type Options struct {
	// Dir is where the cache makes its directory of chunks (default the
	// system's temporary directory). Close removes that directory; a
	// process that dies leaves a "hermesfs-chunks-*" directory behind.
	Dir string
	// MaxBytes bounds the bytes of cached chunks (default 1 GiB). The
	// chunks being read right now may exceed it for a moment.
	MaxBytes int64
	// ChunkSize is the unit of fetching and caching for objects without
	// digests (default 256 KiB).
	ChunkSize int64
	// ReadAhead is how many chunks after a sequential read are fetched in
	// the background (default 4; negative: none).
	ReadAhead int
	// FetchTimeout bounds one chunk's fetch, retries included (default
	// 30s); a read waiting on it then fails.
	FetchTimeout time.Duration
	Logger       *slog.Logger
}

// Digests are the sha256 of each ChunkSize slice of an object as stored
// (the last may be short), hex-encoded.
type Digests struct {
	ChunkSize int64
	SHA256    []string
}

// Stats counts what a cache did since it was made.
type Stats struct {
	Gets         int64 // ranged Gets sent to the store
	BytesFetched int64 // bytes those Gets returned
	Hits, Misses int64 // chunk lookups served from the cache / needing a fetch
	Evicted      int64 // chunks dropped to stay within MaxBytes
	CachedBytes  int64 // bytes of chunks cached now
}

// ErrCorrupt marks a chunk whose bytes do not match its digest.
var ErrCorrupt = fmt.Errorf("chunk does not match its digest: %w", uploader.ErrCorrupt)

// Cache is a bounded cache of chunks of store objects.
type Cache struct {
	store uploader.Store
	opts  Options
	log   *slog.Logger

	mu       sync.Mutex
	lru      *list.List // of *chunk, most recently used first
	chunks   map[chunkKey]*list.Element
	inflight map[chunkKey]*fetch
	used     int64
	closed   bool

	bg    sync.WaitGroup
	bgSem chan struct{} // bounds background fetches of the whole cache
	stop  context.CancelFunc
	bgCtx context.Context

	gets, fetched, hits, misses, evicted atomic.Int64
}

type chunkKey struct {
	key string
	idx int64
}

type chunk struct {
	k    chunkKey
	path string
	size int64
}

type fetch struct {
	done chan struct{}
	err  error
}

// New returns a cache reading objects of store.
func New(store uploader.Store, o Options) (*Cache, error) {
	if o.MaxBytes <= 0 {
		o.MaxBytes = DefaultMaxBytes
	}
	if o.ChunkSize <= 0 {
		o.ChunkSize = DefaultChunkSize
	}
	if o.ReadAhead == 0 {
		o.ReadAhead = DefaultReadAhead
	}
	if o.FetchTimeout <= 0 {
		o.FetchTimeout = DefaultFetchTimeout
	}
	if o.Logger == nil {
		o.Logger = slog.New(slog.DiscardHandler)
	}
	c := &Cache{store: store, opts: o, log: o.Logger, lru: list.New(),
		chunks: map[chunkKey]*list.Element{}, inflight: map[chunkKey]*fetch{}, bgSem: make(chan struct{}, 4)}
	if o.Dir != "" {
		if err := os.MkdirAll(o.Dir, 0o700); err != nil {
			return nil, fmt.Errorf("ranged: cache dir: %w", err)
		}
	}
	dir, err := os.MkdirTemp(o.Dir, "hermesfs-chunks-")
	if err != nil {
		return nil, fmt.Errorf("ranged: cache dir: %w", err)
	}
	c.opts.Dir = dir
	c.bgCtx, c.stop = context.WithCancel(context.Background())
	return c, nil
}

// Dir is the directory holding the cached chunks.
func (c *Cache) Dir() string { return c.opts.Dir }

// Stats returns the cache's counters.
func (c *Cache) Stats() Stats {
	c.mu.Lock()
	used := c.used
	c.mu.Unlock()
	return Stats{Gets: c.gets.Load(), BytesFetched: c.fetched.Load(), Hits: c.hits.Load(),
		Misses: c.misses.Load(), Evicted: c.evicted.Load(), CachedBytes: used}
}

// Close stops background fetches, waits for them, and removes the cached
// chunks and their directory. Readers fail afterwards.
func (c *Cache) Close() error {
	c.mu.Lock()
	c.closed = true
	c.mu.Unlock()
	c.stop()
	c.bg.Wait()
	c.mu.Lock()
	defer c.mu.Unlock()
	c.lru.Init()
	clear(c.chunks)
	c.used = 0
	if err := os.RemoveAll(c.opts.Dir); err != nil {
		return fmt.Errorf("ranged: remove the cache: %w", err)
	}
	return nil
}

// Object returns a reader of the size bytes of store object key. With
// digests (d.SHA256 non-empty) every chunk is verified; their count must
// match the size.
func (c *Cache) Object(key string, size int64, d Digests) (*Object, error) {
	o := &Object{c: c, key: key, size: size, chunkSize: c.opts.ChunkSize}
	if len(d.SHA256) > 0 {
		if d.ChunkSize <= 0 {
			return nil, fmt.Errorf("ranged: %s: digests without a chunk size", key)
		}
		if want := (size + d.ChunkSize - 1) / d.ChunkSize; int64(len(d.SHA256)) != want {
			return nil, fmt.Errorf("ranged: %s: %d chunk digests for %d bytes in chunks of %d (want %d)", key, len(d.SHA256), size, d.ChunkSize, want)
		}
		o.chunkSize = d.ChunkSize
		o.sums = make([][sha256.Size]byte, len(d.SHA256))
		for i, s := range d.SHA256 {
			b, err := hex.DecodeString(s)
			if err != nil || len(b) != sha256.Size {
				return nil, fmt.Errorf("ranged: %s: chunk digest %d is not a hex sha256", key, i)
			}
			copy(o.sums[i][:], b)
		}
	}
	o.name = hex.EncodeToString(func() []byte { s := sha256.Sum256([]byte(key)); return s[:8] }())
	return o, nil
}

// Object is an io.ReaderAt over one store object, read through the cache.
type Object struct {
	c         *Cache
	key       string
	name      string // of the object's chunk files
	size      int64
	chunkSize int64
	sums      [][sha256.Size]byte // nil: not verified here

	mu       sync.Mutex
	lastEnd  int64 // where the previous read ended, to spot sequential reads
	runStart int64 // where the current run of sequential reads started
}

// Size is the object's size.
func (o *Object) Size() int64 { return o.size }

// Verified reports whether chunks are checked against digests.
func (o *Object) Verified() bool { return o.sums != nil }

// ReadAt reads len(p) bytes at off, fetching the chunks it spans that are
// not cached (in parallel). Reads past the end return io.EOF.
func (o *Object) ReadAt(p []byte, off int64) (int, error) {
	return o.ReadAtContext(context.Background(), p, off)
}

// ReadAtContext is ReadAt whose waiting ends with ctx. A fetch another
// reader shares goes on when one of them gives up.
func (o *Object) ReadAtContext(ctx context.Context, p []byte, off int64) (int, error) {
	if off < 0 {
		return 0, fmt.Errorf("ranged: %s: negative offset %d", o.key, off)
	}
	if off >= o.size {
		if len(p) == 0 {
			return 0, nil
		}
		return 0, io.EOF
	}
	want := p
	if rest := o.size - off; int64(len(want)) > rest {
		want = want[:rest]
	}
	first, last := off/o.chunkSize, (off+int64(len(want))-1)/o.chunkSize
	if first < last {
		// Fetch the missing chunks of a wide read together.
		var wg sync.WaitGroup
		for i := first; i <= last; i++ {
			wg.Go(func() { o.c.ensure(ctx, o, i) })
		}
		wg.Wait()
	}
	n := 0
	for n < len(want) {
		pos := off + int64(n)
		idx := pos / o.chunkSize
		in := pos - idx*o.chunkSize
		k, err := o.readChunk(ctx, idx, want[n:min(len(want), n+int(o.chunkSize-in))], in)
		n += k
		if err != nil {
			return n, err
		}
	}
	o.readAhead(off, off+int64(n))
	if n < len(p) {
		return n, io.EOF
	}
	return n, nil
}

// readChunk copies chunk idx's bytes at in into p, fetching it if needed.
// A chunk evicted between lookup and read is fetched again.
func (o *Object) readChunk(ctx context.Context, idx int64, p []byte, in int64) (int, error) {
	for attempt := 0; ; attempt++ {
		path, err := o.c.ensure(ctx, o, idx)
		if err != nil {
			return 0, err
		}
		f, err := os.Open(path)
		if errors.Is(err, os.ErrNotExist) && attempt < 3 {
			continue
		}
		if err != nil {
			return 0, fmt.Errorf("ranged: %s: cached chunk %d: %w", o.key, idx, err)
		}
		k, err := f.ReadAt(p, in)
		f.Close()
		if err != nil && !(errors.Is(err, io.EOF) && k == len(p)) {
			return k, fmt.Errorf("ranged: %s: cached chunk %d: %w", o.key, idx, err)
		}
		return k, nil
	}
}

// readAhead fetches the chunks after a read in the background once reads
// have gone on sequentially for at least a chunk: a few small reads in a
// row (an archive's superblock, then its tables) are not a stream.
func (o *Object) readAhead(off, end int64) {
	o.mu.Lock()
	if off != o.lastEnd {
		o.runStart = off
	}
	o.lastEnd = end
	stream := end-o.runStart >= o.chunkSize
	o.mu.Unlock()
	if !stream || o.c.opts.ReadAhead < 0 {
		return
	}
	next := (end + o.chunkSize - 1) / o.chunkSize
	for i := next; i < next+int64(o.c.opts.ReadAhead) && i*o.chunkSize < o.size; i++ {
		o.c.prefetch(o, i)
	}
}

func (o *Object) chunkLen(idx int64) int64 {
	return min(o.chunkSize, o.size-idx*o.chunkSize)
}

// prefetch fetches chunk idx of o in the background unless it is cached,
// being fetched, or the background is busy.
func (c *Cache) prefetch(o *Object, idx int64) {
	select {
	case c.bgSem <- struct{}{}:
	default:
		return
	}
	_, f, err := c.claim(o, idx)
	if f == nil || err != nil {
		<-c.bgSem
		return
	}
	c.bg.Go(func() {
		defer func() { <-c.bgSem }()
		if _, err := c.fill(c.bgCtx, o, idx, f); err != nil && c.bgCtx.Err() == nil {
			c.log.Debug("read-ahead failed", "key", o.key, "chunk", idx, "err", err)
		}
	})
}

// claim looks chunk idx of o up: its path if cached; else a fetch the
// caller now owns and must fill (f non-nil); else "" and nil when another
// fetch of it is in flight, which the caller may wait for (wait).
func (c *Cache) claim(o *Object, idx int64) (path string, f *fetch, err error) {
	k := chunkKey{o.key, idx}
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return "", nil, fmt.Errorf("ranged: %s: cache closed", o.key)
	}
	if el, ok := c.chunks[k]; ok {
		c.lru.MoveToFront(el)
		c.hits.Add(1)
		return el.Value.(*chunk).path, nil, nil
	}
	if c.inflight[k] != nil {
		return "", nil, nil
	}
	f = &fetch{done: make(chan struct{})}
	c.inflight[k] = f
	c.misses.Add(1)
	return "", f, nil
}

// ensure returns the path of chunk idx of o in the cache, fetching it
// first if needed; concurrent callers share one fetch.
func (c *Cache) ensure(ctx context.Context, o *Object, idx int64) (string, error) {
	k := chunkKey{o.key, idx}
	for {
		path, f, err := c.claim(o, idx)
		switch {
		case err != nil:
			return "", err
		case path != "":
			return path, nil
		case f != nil:
			// The fetch outlives a caller that gives up: others may wait on it.
			return c.fill(context.WithoutCancel(ctx), o, idx, f)
		}
		c.mu.Lock()
		f = c.inflight[k]
		c.mu.Unlock()
		if f == nil {
			continue // done in between: look again
		}
		select {
		case <-f.done:
		case <-ctx.Done():
			return "", ctx.Err()
		}
		if f.err != nil {
			return "", f.err
		}
		// Cached now (or already evicted: fetch again).
	}
}

// fill runs the fetch f claimed for chunk idx of o and publishes its
// outcome to the cache and to those waiting on f.
func (c *Cache) fill(ctx context.Context, o *Object, idx int64, f *fetch) (string, error) {
	k := chunkKey{o.key, idx}
	fctx, cancel := context.WithTimeout(ctx, c.opts.FetchTimeout)
	path, size, err := c.fetch(fctx, o, idx)
	cancel()
	c.mu.Lock()
	delete(c.inflight, k)
	if err == nil {
		if c.closed {
			os.Remove(path)
			err = fmt.Errorf("ranged: %s: cache closed", o.key)
		} else {
			c.chunks[k] = c.lru.PushFront(&chunk{k: k, path: path, size: size})
			c.used += size
			c.evictLocked()
		}
	}
	f.err = err
	c.mu.Unlock()
	close(f.done)
	if err != nil {
		return "", err
	}
	return path, nil
}

// evictLocked drops least recently used chunks until the cache fits,
// keeping the newest.
func (c *Cache) evictLocked() {
	for c.used > c.opts.MaxBytes && c.lru.Len() > 1 {
		el := c.lru.Back()
		ch := el.Value.(*chunk)
		c.lru.Remove(el)
		delete(c.chunks, ch.k)
		c.used -= ch.size
		c.evicted.Add(1)
		if err := os.Remove(ch.path); err != nil && !errors.Is(err, os.ErrNotExist) {
			c.log.Warn("could not remove a cached chunk", "path", ch.path, "err", err)
		}
	}
}

// fetch gets chunk idx of o from the store, checks it, and writes it to a
// new file of the cache.
func (c *Cache) fetch(ctx context.Context, o *Object, idx int64) (string, int64, error) {
	off, n := idx*o.chunkSize, o.chunkLen(idx)
	rc, info, err := c.store.Get(ctx, o.key, off, n)
	if err != nil {
		return "", 0, fmt.Errorf("ranged: get %s [%d, %d): %w", o.key, off, off+n, err)
	}
	c.gets.Add(1)
	buf := make([]byte, n)
	k, err := io.ReadFull(rc, buf)
	rc.Close()
	c.fetched.Add(int64(k))
	if err != nil {
		return "", 0, fmt.Errorf("ranged: get %s [%d, %d): %w", o.key, off, off+n, err)
	}
	if info.Size != 0 && info.Size != o.size {
		return "", 0, fmt.Errorf("ranged: %s holds %d bytes, expected %d: the object changed", o.key, info.Size, o.size)
	}
	if o.sums != nil {
		if sha256.Sum256(buf) != o.sums[idx] {
			return "", 0, fmt.Errorf("ranged: %s chunk %d [%d, %d): %w", o.key, idx, off, off+n, ErrCorrupt)
		}
	}
	path := filepath.Join(c.opts.Dir, o.name+"-"+strconv.FormatInt(o.chunkSize, 36)+"-"+strconv.FormatInt(idx, 10))
	if err := os.WriteFile(path, buf, 0o600); err != nil {
		os.Remove(path)
		return "", 0, fmt.Errorf("ranged: cache chunk of %s: %w", o.key, err)
	}
	return path, n, nil
}
