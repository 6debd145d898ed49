package lazy

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	iofs "io/fs"
	"log/slog"
	"math/rand/v2"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/hermesfs/hermesfs/uploader"
)

// Defaults of Options.
const (
	DefaultReadTimeout  = 30 * time.Second
	DefaultParallel     = 8
	DefaultFillParallel = 3
	DefaultReadAhead    = 4
	// DefaultFillSpan is the most bytes one fill request asks for: a run
	// of absent chunks fetched with one ranged Get, each chunk checked
	// and written as it arrives. A few such requests in flight keep a
	// link of tens of MB/s and tens of ms per request busy.
	DefaultFillSpan = 8 << 20
)

// Options describe the object and the cache. Key, Size, ChunkSize, Chunks,
// SHA256 and Path are required; the rest have defaults.
type Options struct {
	Store uploader.Store
	Key   string
	Size  int64
	// ChunkSize and Chunks (hex sha256 of each chunk) from the manifest.
	ChunkSize int64
	Chunks    []string
	// SHA256 (hex) of the whole object, checked once it is complete; ""
	// when the manifest has none (then the complete file is checked
	// chunk by chunk once more).
	SHA256 string
	// Path is where the complete cache file goes; while incomplete the
	// bytes are in Path+".partial" and the present log in Path+".present".
	Path string

	// ReadTimeout bounds how long a read retries a chunk the store fails
	// to deliver before it fails with EIO.
	ReadTimeout time.Duration
	// Parallel bounds on-demand requests in flight, FillParallel the
	// background fill's, ReadAhead the chunks fetched ahead of a
	// sequential read (0: defaults; ReadAhead < 0 turns it off).
	Parallel, FillParallel, ReadAhead int
	// FillSpan is the most bytes one fill request covers (0: default;
	// at least one chunk).
	FillSpan int64
	// Retry gives the delays between attempts (its MaxRetries is not used:
	// ReadTimeout bounds the attempts).
	Retry uploader.RetryPolicy

	// Budget, if set, bounds the bytes this reader and the others of the
	// budget keep cached, together (see Budget: such a reader's cache is
	// temporary).
	Budget *Budget
	// NoDigests reads an object that has no chunk digests (the archive
	// of a format 1 snapshot): Chunks is empty and ChunkSize any size
	// from 4 KiB to 64 MiB. Nothing is checked chunk by chunk: whoever
	// reads must check what it reads (the archive reader checks every
	// block against the archive's own checksums); SHA256 is required and
	// checks the complete file. The cache starts empty (an earlier
	// partial file is discarded: its bytes could not be checked) and
	// keeps no present log, as with a Budget.
	NoDigests bool

	// Hot chunks are fetched first by Fill.
	Hot []int64
	// HotWindow is how long reads are recorded for Hot (default
	// DefaultHotWindow).
	HotWindow time.Duration

	// OnComplete is called once (on the fill's goroutine) when the cache
	// is complete and verified, with the path of the complete file.
	OnComplete func(path string)

	Logger *slog.Logger

	// writeAt writes to the cache file; tests replace it.
	writeAt func(f *os.File, b []byte, off int64) (int, error)
	// followFor replaces the constant followFor in tests.
	followFor time.Duration
	// yielded, if set, is called when a fill request pauses for an
	// on-demand fetch, heldBack when the fill holds a request back for a
	// waiting read (tests).
	yielded, heldBack func()
}

// maxDigestFails is how many times in a row a chunk may arrive damaged
// before a read gives up on it without waiting for the read timeout.
const maxDigestFails = 3

// ErrDigest is a chunk whose bytes do not have the manifest's digest.
var ErrDigest = errors.New("chunk sha256 does not match the manifest's chunk digest")

// ChunkError is a chunk the store did not deliver intact within the read
// timeout. It satisfies errors.Is(err, syscall.EIO).
type ChunkError struct {
	Key   string
	Chunk int
	Off   int64 // of the chunk in the object
	Len   int64
	Err   error // the last attempt's cause
}

func (e *ChunkError) Error() string {
	return fmt.Sprintf("lazy read of %s chunk %d (bytes %d-%d): %v", e.Key, e.Chunk, e.Off, e.Off+e.Len, e.Err)
}

func (e *ChunkError) Unwrap() []error { return []error{e.Err, syscall.EIO} }

// Stats describe the cache's progress.
type Stats struct {
	TotalBytes     int64 `json:"total_bytes"`
	PresentBytes   int64 `json:"present_bytes"`
	Complete       bool  `json:"complete"`
	OnDemandChunks int64 `json:"on_demand_chunks"`
	FillChunks     int64 `json:"fill_chunks"`
	Waiting        int64 `json:"waiting"`
	Errors         int64 `json:"errors"`
	// Evicted counts the chunks dropped to keep within Options.Budget.
	Evicted int64 `json:"evicted_chunks,omitempty"`
}

type kind int

const (
	onDemand kind = iota
	readAhead
	fill
)

// call is one chunk being fetched; waiters share it.
type call struct {
	done chan struct{}
	// data holds the verified bytes when they are not in the cache file
	// (a call of its own keeps them; a fill request's chunk is read from
	// the file unless the write failed). nil with a nil err: read the file.
	data []byte
	err  error
	// fill is the fill request fetching this chunk among others; nil for
	// a call of its own.
	fill *stream
}

// stream is one fill request: a run of chunks fetched with one ranged Get
// and received in order.
type stream struct {
	at atomic.Int64 // the chunk being received
	// yields: a request of the hot set or the rest of the fill (not one
	// following a reader), which stops reading its body between chunks
	// while on-demand fetches are in the store.
	yields bool
	paused atomic.Bool // it is yielding now
}

// followFor is how long after a sequential read (see readAheadFrom) the
// fill follows it, once the hot set is fetched: its requests start at the
// first absent chunk after that read (within FillParallel requests' span),
// so a file read from start to end gets the fill's ranged requests as its
// read-ahead instead of competing with them; meanwhile the fill does not
// hold back for the read's misses.
const followFor = 500 * time.Millisecond

// streamWait is how many chunks ahead of a fill request's position a read
// still waits for that request; a read further on fetches its chunk itself
// rather than wait for the bytes before it. streamPatience is how long it
// waits before it fetches the chunk itself too (the request may be slow or
// stalled): a miss never waits behind the fill for long.
const (
	streamWait     = 2
	streamPatience = 100 * time.Millisecond
)

// errRefetch completes a fill request's chunk that the request did not
// deliver intact: its waiters fetch the chunk themselves.
var errRefetch = errors.New("the fill request did not deliver the chunk")

// inFile is a finished call whose chunk is in the cache file.
var inFile = func() *call {
	c := &call{done: make(chan struct{})}
	close(c.done)
	return c
}()

// Reader is the io.ReaderAt. Its methods may be called concurrently.
type Reader struct {
	o      Options
	log    *slog.Logger
	n      int
	f      *os.File // the cache file (partial, or complete)
	plog   *os.File // the present log; nil once complete
	hot    *HotRecorder
	ctx    context.Context
	cancel context.CancelFunc
	wg     sync.WaitGroup

	demand, ahead, filling chan struct{}
	waiting                atomic.Int64
	fillOff                atomic.Bool // StopFill
	fillCtx                context.Context
	fillCancel             context.CancelFunc // StopFill: ends the fill's requests in flight
	flush                  chan struct{}
	bufs                   chan []byte // the fill requests' chunk buffers, reused

	syncMu sync.Mutex // one sync at a time

	mu       sync.Mutex
	present  []bool
	checked  []bool // present chunks whose bytes on disk were checked since Open
	have     int    // chunks present
	complete bool
	noWrite  error // the cache write failure that stopped writing
	inflight map[int]*call
	durable  []int // written, not yet in the present log
	logged   map[int]bool
	// etag is the ETag of the object the cached chunks came from: the
	// first one a fetch saw, or, after a restart, the one saved beside the
	// present log (etagSaved) before any chunk it vouches for was logged.
	etag      string
	etagSaved bool
	// The run of reads near each other, for read-ahead: the bytes it
	// spans ([runMin, runMax), runMax -1 before the first read) and the
	// bytes its reads asked for.
	runMin, runMax, runBytes int64
	seqNext                  int           // the chunk after the last read that continued the one before
	seqAt                    time.Time     // when that read came
	fetching                 int           // on-demand fetches in the store
	quiet                    chan struct{} // closed when fetching drops to 0; nil while it is 0
	stats                    Stats
	fillErr                  error
	completed                bool

	// gone is the store's answer that the object does not exist: keys are
	// never reused, so it will not come back; the fill stops.
	gone error

	// With a Budget: the reads and writes in progress of each chunk in
	// the cache file (it is not evicted under them), and the chunks
	// charged to the budget.
	pins        []int32
	held        []*held
	punchFailed bool
}

// Open opens (or resumes) the cache of the object described by o. It does
// no store request; reads and Fill do.
func Open(o Options) (*Reader, error) {
	if o.NoDigests {
		if o.ChunkSize < 4<<10 || o.ChunkSize > 64<<20 || len(o.Chunks) > 0 || o.Size <= 0 || len(o.SHA256) != 64 {
			return nil, fmt.Errorf("lazy %s: reading without chunk digests needs a chunk size from 4 KiB to 64 MiB, the object's size and sha256, and no seed", o.Key)
		}
	} else if !uploader.ValidChunkSize(o.ChunkSize) || len(o.Chunks) != uploader.NumChunks(o.Size, o.ChunkSize) || o.Size <= 0 {
		return nil, fmt.Errorf("lazy %s: %d chunk digests of %d bytes for %d bytes: not a lazily readable manifest", o.Key, len(o.Chunks), o.ChunkSize, o.Size)
	}
	if o.ReadTimeout <= 0 {
		o.ReadTimeout = DefaultReadTimeout
	}
	if o.Parallel <= 0 {
		o.Parallel = DefaultParallel
	}
	if o.FillParallel <= 0 {
		o.FillParallel = DefaultFillParallel
	}
	if o.ReadAhead == 0 {
		o.ReadAhead = DefaultReadAhead
	}
	if o.FillSpan <= 0 {
		o.FillSpan = DefaultFillSpan
	}
	if o.followFor <= 0 {
		o.followFor = followFor
	}
	if o.Logger == nil {
		o.Logger = slog.New(slog.DiscardHandler)
	}
	if o.writeAt == nil {
		o.writeAt = (*os.File).WriteAt
	}
	r := &Reader{
		o: o, log: o.Logger, n: uploader.NumChunks(o.Size, o.ChunkSize),
		hot:      newHotRecorder(nil, o.ChunkSize, uploader.HotLimit(o.Size, o.ChunkSize), o.HotWindow),
		demand:   make(chan struct{}, o.Parallel),
		ahead:    make(chan struct{}, max(1, o.Parallel/2)),
		filling:  make(chan struct{}, o.FillParallel),
		flush:    make(chan struct{}, 1),
		bufs:     make(chan []byte, o.FillParallel),
		inflight: map[int]*call{},
		logged:   map[int]bool{},
		runMax:   -1,
	}
	r.stats.TotalBytes = o.Size
	r.ctx, r.cancel = context.WithCancel(context.Background())
	r.fillCtx, r.fillCancel = context.WithCancel(r.ctx)
	if r.o.Budget != nil {
		r.pins, r.held = make([]int32, r.n), make([]*held, r.n)
	}
	open := r.openCache
	if r.ephemeral() {
		open = r.openEmpty
	}
	if err := open(); err != nil {
		r.cancel()
		return nil, err
	}
	if !r.complete && r.plog != nil {
		r.wg.Add(1)
		go r.persist()
	}
	return r, nil
}

func (r *Reader) partial() string  { return r.o.Path + ".partial" }
func (r *Reader) logPath() string  { return r.o.Path + ".present" }
func (r *Reader) etagPath() string { return r.o.Path + ".etag" }

// ephemeral reports whether the cache is kept in memory only, without a
// present log (Budget, NoDigests).
func (r *Reader) ephemeral() bool { return r.o.Budget != nil || r.o.NoDigests }

// openEmpty opens a cache that starts empty and keeps no present log
// (ephemeral): a complete file at Path is used as it is, anything partial
// there is discarded.
func (r *Reader) openEmpty() error {
	r.present, r.checked = make([]bool, r.n), make([]bool, r.n)
	if f, err := os.Open(r.o.Path); err == nil {
		if fi, err := f.Stat(); err == nil && fi.Size() == r.o.Size {
			r.f, r.complete, r.completed = f, true, true
			for i := range r.present {
				r.present[i], r.checked[i] = true, true
			}
			r.have, r.stats.PresentBytes, r.stats.Complete = r.n, r.o.Size, true
			return nil
		}
		f.Close()
	}
	os.Remove(r.logPath())
	os.Remove(r.etagPath())
	f, err := os.OpenFile(r.partial(), os.O_RDWR|os.O_CREATE|os.O_TRUNC, 0o600)
	if err == nil {
		if err = f.Truncate(r.o.Size); err != nil {
			f.Close()
		}
	}
	if err != nil {
		return fmt.Errorf("lazy cache: %w", err)
	}
	r.f = f
	return nil
}

func (r *Reader) openCache() error {
	if f, err := os.Open(r.o.Path); err == nil {
		// Complete already (the caller checked it, or a fill finished
		// between its check and this open).
		if fi, err := f.Stat(); err == nil && fi.Size() == r.o.Size {
			r.f, r.complete, r.completed = f, true, true
			r.present, r.checked = make([]bool, r.n), make([]bool, r.n)
			for i := range r.present {
				r.present[i], r.checked[i] = true, true
			}
			r.have, r.stats.PresentBytes, r.stats.Complete = r.n, r.o.Size, true
			return nil
		}
		f.Close()
	}
	_, serr := os.Stat(r.partial())
	fresh := errors.Is(serr, os.ErrNotExist)
	f, err := os.OpenFile(r.partial(), os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		return fmt.Errorf("lazy cache: %w", err)
	}
	pl, err := os.OpenFile(r.logPath(), os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		f.Close()
		return fmt.Errorf("lazy cache: %w", err)
	}
	if fresh {
		// A log without its data file vouches for nothing.
		if err := pl.Truncate(0); err != nil {
			f.Close()
			pl.Close()
			return fmt.Errorf("lazy cache: %w", err)
		}
	}
	present, reset, err := loadPresent(pl, r.identity(), r.o.Size, r.o.ChunkSize, r.n)
	if err == nil && reset {
		// Another object's bytes, or none: start from a hole.
		err = f.Truncate(0)
		os.Remove(r.etagPath())
	}
	if err == nil && !reset {
		if b, rerr := os.ReadFile(r.etagPath()); rerr == nil && len(bytes.TrimSpace(b)) > 0 {
			r.etag, r.etagSaved = string(bytes.TrimSpace(b)), true
		}
	}
	if err == nil {
		if fi, serr := f.Stat(); serr != nil {
			err = serr
		} else if fi.Size() != r.o.Size {
			err = f.Truncate(r.o.Size)
		}
	}
	if err != nil {
		f.Close()
		pl.Close()
		return fmt.Errorf("lazy cache %s: %w", r.partial(), err)
	}
	r.f, r.plog, r.present, r.checked = f, pl, present, make([]bool, r.n)
	for i, p := range present {
		if p {
			r.have++
			r.stats.PresentBytes += r.chunkLen(i)
		}
	}
	if r.have > 0 {
		r.log.Info("resuming a partly fetched archive", "key", r.o.Key, "present_bytes", r.stats.PresentBytes, "total_bytes", r.o.Size)
	}
	return nil
}

func (r *Reader) chunkLen(i int) int64 {
	return min(r.o.ChunkSize, r.o.Size-int64(i)*r.o.ChunkSize)
}

// Size is the object's size.
func (r *Reader) Size() int64 { return r.o.Size }

// Hot returns the chunks first read since Open (see HotRecorder).
func (r *Reader) Hot() []int64 { return r.hot.Hot() }

// ChunkSize is the chunk size.
func (r *Reader) ChunkSize() int64 { return r.o.ChunkSize }

// Stats returns the current figures.
func (r *Reader) Stats() Stats {
	r.mu.Lock()
	defer r.mu.Unlock()
	s := r.stats
	s.Waiting = r.waiting.Load()
	return s
}

// Complete reports whether the whole object is cached and verified.
func (r *Reader) Complete() bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.completed
}

// ReadAt implements io.ReaderAt. Bytes not cached are fetched (and
// verified) first; see the package doc for failures.
func (r *Reader) ReadAt(p []byte, off int64) (int, error) {
	if off < 0 {
		return 0, fmt.Errorf("lazy %s: negative offset %d", r.o.Key, off)
	}
	if off >= r.o.Size {
		return 0, io.EOF
	}
	if r.ctx.Err() != nil {
		return 0, fmt.Errorf("lazy %s: read after close", r.o.Key)
	}
	end := min(off+int64(len(p)), r.o.Size)
	r.hot.Note(off, end-off)
	first, last := int(off/r.o.ChunkSize), int((end-1)/r.o.ChunkSize)
	r.readAheadFrom(off, end)

	// Start every missing chunk first, so they are fetched in parallel.
	calls := make(map[int]*call)
	r.mu.Lock()
	for i := first; i <= last; i++ {
		if !r.present[i] || !r.checked[i] {
			calls[i] = r.startLocked(i, onDemand)
		}
	}
	r.mu.Unlock()
	for i := first; i <= last; i++ {
		cs := int64(i) * r.o.ChunkSize
		lo, hi := max(off, cs), min(end, cs+r.chunkLen(i))
		if err := r.readChunk(i, calls[i], p[lo-off:hi-off], lo-cs); err != nil {
			return 0, err
		}
	}
	if end-off < int64(len(p)) {
		return int(end - off), io.EOF
	}
	return len(p), nil
}

// readChunk copies chunk i's bytes from in on into dst: from what call c
// (nil: none was needed) delivered, or from the cache file. A chunk read
// from the file is pinned there meanwhile (Budget); one evicted since it
// was found present is fetched again.
func (r *Reader) readChunk(i int, c *call, dst []byte, in int64) error {
	for {
		if c != nil {
			var err error
			if c, err = r.wait(r.ctx, i, c); err != nil {
				return fmt.Errorf("lazy %s: closed", r.o.Key)
			}
			if c.err != nil {
				return c.err
			}
			if c.data != nil {
				copy(dst, c.data[in:])
				return nil
			}
		}
		// Without a budget a chunk in the file stays there.
		if r.o.Budget == nil {
			return r.readFile(i, dst, in)
		}
		r.mu.Lock()
		if r.completed || r.present[i] && r.checked[i] {
			r.pinLocked(i)
			r.mu.Unlock()
			err := r.readFile(i, dst, in)
			r.unpin(i)
			return err
		}
		c = r.startLocked(i, onDemand)
		r.mu.Unlock()
	}
}

func (r *Reader) readFile(i int, dst []byte, in int64) error {
	off := int64(i)*r.o.ChunkSize + in
	if _, err := r.f.ReadAt(dst, off); err != nil {
		return fmt.Errorf("lazy %s: read cache %s at %d: %w", r.o.Key, r.f.Name(), off, err)
	}
	return nil
}

// wait waits for call c of chunk i and returns the call that delivered it.
// When c is a fill request's, the chunk is also fetched on demand if the
// request has not delivered it within streamPatience, and the first of the
// two to deliver serves; when the request fails to deliver it, the
// on-demand fetch does. It fails only when ctx ends.
func (r *Reader) wait(ctx context.Context, i int, c *call) (*call, error) {
	r.waiting.Add(1)
	defer r.waiting.Add(-1)
	var own *call // fetching on demand beside c
	for {
		var patience <-chan time.Time
		var t *time.Timer
		if c.fill != nil && own == nil {
			t = time.NewTimer(streamPatience)
			patience = t.C
		}
		var ownDone <-chan struct{}
		if own != nil {
			ownDone = own.done
		}
		select {
		case <-c.done:
		case <-ownDone:
			c, own = own, nil
		case <-patience:
			if r.ctx.Err() != nil {
				return nil, r.ctx.Err()
			}
			r.mu.Lock()
			own = r.ownLocked(i)
			r.mu.Unlock()
			continue
		case <-ctx.Done():
			if t != nil {
				t.Stop()
			}
			return nil, ctx.Err()
		}
		if t != nil {
			t.Stop()
		}
		if c.err != errRefetch {
			return c, nil
		}
		if own != nil {
			c, own = own, nil
			continue
		}
		if r.ctx.Err() != nil {
			return nil, r.ctx.Err()
		}
		r.mu.Lock()
		c = r.ownLocked(i)
		r.mu.Unlock()
	}
}

// ownLocked returns a call fetching chunk i on its own (not as part of a
// fill request), starting one if there is none; inFile if the chunk is
// cached and checked. r.mu is held.
func (r *Reader) ownLocked(i int) *call {
	if r.present[i] && r.checked[i] {
		return inFile
	}
	if c := r.inflight[i]; c != nil && c.fill == nil {
		return c
	}
	return r.newLocked(i, onDemand)
}

// readAheadFrom starts fetching the chunks after the read of [off, end),
// and has the fill follow it, when the reads near each other that it
// belongs to are a sequential reader's: they ask for a chunk's bytes at
// least, and for most of the bytes they span. Near means within
// runSlack chunks of the run: the archive reader reads a file's blocks
// in parallel (a FUSE read's blocks, the mount's read-ahead), so they
// arrive out of order. Neither a few reads in one chunk nor reads merely
// further on are a sequential reader: opening the archive reads its
// superblock and the 2-byte header right after it, and a mount's first
// metadata and small-file reads, taken for a sequential reader, would send
// read-ahead and the fill's long requests ahead of the hot set.
func (r *Reader) readAheadFrom(off, end int64) {
	if r.o.ReadAhead < 0 {
		return
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	slack := runSlack * r.o.ChunkSize
	if r.runMax < 0 || off < r.runMin-slack || off > r.runMax+slack {
		r.runMin, r.runMax, r.runBytes = off, end, 0
	}
	r.runMin, r.runMax = min(r.runMin, off), max(r.runMax, end)
	r.runBytes += end - off
	if r.runBytes < r.o.ChunkSize || 2*r.runBytes < r.runMax-r.runMin {
		return
	}
	end = r.runMax
	last := int((end - 1) / r.o.ChunkSize)
	r.seqNext, r.seqAt = last+1, time.Now()
	if r.completed {
		return
	}
	for i := last + 1; i <= min(last+r.o.ReadAhead, r.n-1); i++ {
		if r.present[i] || r.inflight[i] != nil {
			continue
		}
		select {
		case r.ahead <- struct{}{}:
		default:
			return // read-ahead's share of requests is busy
		}
		r.newLocked(i, readAhead)
	}
}

// runSlack is how many chunks apart reads may be and still continue a
// run (readAheadFrom).
const runSlack = 4

// startLocked returns the call fetching chunk i, starting it if none is in
// flight (an on-demand read does not wait for a fill request that is
// paused, or would deliver the chunk only after several others). For
// readAhead and fill the caller holds a slot of that pool already, which
// the call releases; an on-demand call takes its slot itself, in its
// goroutine. r.mu is held.
func (r *Reader) startLocked(i int, k kind) *call {
	if c := r.inflight[i]; c != nil && (k != onDemand || c.fill == nil || !c.fill.paused.Load() && int64(i) <= c.fill.at.Load()+streamWait) {
		switch k {
		case readAhead:
			<-r.ahead
		case fill:
			<-r.filling
		}
		return c
	}
	return r.newLocked(i, k)
}

// newLocked starts a call fetching chunk i on its own, in the place of
// any in flight (which still completes). r.mu is held; see startLocked for
// the pool slots.
func (r *Reader) newLocked(i int, k kind) *call {
	c := &call{done: make(chan struct{})}
	r.inflight[i] = c
	r.wg.Add(1)
	go r.run(i, c, k)
	return c
}

// run fetches chunk i for c until it arrives intact or the read timeout
// passes.
func (r *Reader) run(i int, c *call, k kind) {
	defer r.wg.Done()
	switch k {
	case onDemand:
		select {
		case r.demand <- struct{}{}:
			defer func() { <-r.demand }()
		case <-r.ctx.Done():
		}
	case readAhead:
		defer func() { <-r.ahead }()
	case fill:
		defer func() { <-r.filling }()
	}
	ctx, cancel := context.WithTimeout(r.ctx, r.o.ReadTimeout)
	defer cancel()
	var data []byte
	var err error
	cached := false
	if data = r.fromCache(i); data != nil {
		cached = true
	} else {
		data, _, err = r.fetchRetry(ctx, i, k == onDemand)
	}
	if err == nil {
		if inFile, fresh := r.store(i, data); inFile && !fresh {
			// Another call (a fill request racing a read) put it
			// there first: not counted twice.
			cached = true
		}
	}
	r.mu.Lock()
	if r.inflight[i] == c {
		delete(r.inflight, i)
	}
	switch {
	case err != nil && r.ctx.Err() == nil:
		r.stats.Errors++
		if !r.logged[i] {
			r.logged[i] = true
			r.log.Error("could not fetch a chunk of the archive; reads of it fail with EIO until it arrives", "err", err)
		}
	case err == nil && cached:
	case err == nil:
		if r.logged[i] {
			delete(r.logged, i)
			r.log.Info("chunk fetched after earlier failures", "key", r.o.Key, "chunk", i)
		}
		switch {
		case k == fill:
			r.stats.FillChunks++
		default:
			r.stats.OnDemandChunks++
		}
	}
	r.mu.Unlock()
	c.data, c.err = data, err
	close(c.done)
}

// fetchRetry fetches chunk i (fetchFrom), retrying with the store backoff
// until it arrives, ctx ends, or it arrived damaged maxDigestFails times: a
// store that keeps returning the same wrong bytes will not heal within the
// timeout, so a read fails now rather than hang. demand counts the attempts
// as on-demand fetches (demandFetch). The error is a *ChunkError, and
// permanent when every attempt got wrong bytes: the object in the store is
// not the one the manifest describes, and asking again (a retried upload
// reading this) does not change that.
func (r *Reader) fetchRetry(ctx context.Context, i int, demand bool) ([]byte, string, error) {
	digestFails := 0
	for attempt := 0; ; attempt++ {
		if demand {
			r.demandFetch(1)
		}
		data, etag, err := r.fetchFrom(ctx, i)
		if demand {
			r.demandFetch(-1)
		}
		if err == nil {
			return data, etag, nil
		}
		if errors.Is(err, iofs.ErrNotExist) {
			// Keys are never reused: the object will not come back.
			return nil, etag, &ChunkError{Key: r.o.Key, Chunk: i, Off: int64(i) * r.o.ChunkSize, Len: r.chunkLen(i), Err: r.setGone(err)}
		}
		giveUp := false
		if errors.Is(err, ErrDigest) {
			digestFails++
			giveUp = digestFails >= maxDigestFails
		}
		d := r.o.Retry.Delay(attempt, rand.Float64())
		if dl, ok := ctx.Deadline(); giveUp || ctx.Err() != nil || ok && time.Until(dl) < d {
			if errors.Is(err, ErrDigest) && digestFails == attempt+1 {
				err = uploader.Permanent(err)
			}
			return nil, etag, &ChunkError{Key: r.o.Key, Chunk: i, Off: int64(i) * r.o.ChunkSize, Len: r.chunkLen(i), Err: err}
		}
		t := time.NewTimer(d)
		select {
		case <-t.C:
		case <-ctx.Done():
		}
		t.Stop()
	}
}

// fetchFrom is fetch, returning the ETag of the object that answered too.
func (r *Reader) fetchFrom(ctx context.Context, i int) ([]byte, string, error) {
	off, n := int64(i)*r.o.ChunkSize, r.chunkLen(i)
	rc, info, err := r.o.Store.Get(ctx, r.o.Key, off, n)
	if err != nil {
		return nil, "", err
	}
	defer rc.Close()
	buf := make([]byte, n)
	got, err := io.ReadFull(rc, buf)
	changed, serr := r.checkObject(info)
	if serr != nil {
		return nil, info.ETag, serr
	}
	if err != nil {
		return nil, info.ETag, fmt.Errorf("got %d of %d bytes: %w%s", got, n, err, changed)
	}
	if err := r.verify(i, buf); err != nil {
		return nil, info.ETag, fmt.Errorf("%w%s", err, changed)
	}
	return buf, info.ETag, nil
}

// checkObject checks what the store says of the object answering a Get:
// its size, and whether its ETag is still the first one seen (changed
// describes a change, for error messages).
func (r *Reader) checkObject(info uploader.ObjectInfo) (changed string, err error) {
	r.mu.Lock()
	prev := r.etag
	if prev == "" {
		r.etag = info.ETag
	}
	r.mu.Unlock()
	if prev != "" && info.ETag != prev {
		changed = fmt.Sprintf(" (the object changed in the store: ETag %s, was %s)", info.ETag, prev)
	}
	if info.Size != r.o.Size {
		return changed, fmt.Errorf("the store's object has %d bytes, the manifest says %d%s", info.Size, r.o.Size, changed)
	}
	return changed, nil
}

// verify checks b against chunk i's digest.
func (r *Reader) verify(i int, b []byte) error {
	if r.o.NoDigests {
		return nil
	}
	if sum := sha256.Sum256(b); hex.EncodeToString(sum[:]) != r.o.Chunks[i] {
		return fmt.Errorf("%w: got %x, want %s", ErrDigest, sum, r.o.Chunks[i])
	}
	return nil
}

// fromCache returns chunk i from the cache file if the present log lists
// it (from before this Open) and its bytes check out; a chunk that does not
// is marked absent, to be fetched again.
func (r *Reader) fromCache(i int) []byte {
	r.mu.Lock()
	present := r.present[i]
	if present {
		r.pinLocked(i)
	}
	r.mu.Unlock()
	if !present {
		return nil
	}
	off, n := int64(i)*r.o.ChunkSize, r.chunkLen(i)
	buf := make([]byte, n)
	_, err := r.f.ReadAt(buf, off)
	ok := err == nil && r.verify(i, buf) == nil
	r.unpin(i)
	r.mu.Lock()
	defer r.mu.Unlock()
	if ok {
		r.checked[i] = true
		return buf
	}
	if r.present[i] && !r.completed {
		r.present[i] = false
		r.have--
		r.stats.PresentBytes -= n
		r.log.Warn("a cached chunk does not match its digest; fetching it again", "path", r.f.Name(), "chunk", i, "err", err)
	}
	return nil
}

// store writes a verified chunk to the cache and marks it present (the
// durable mark follows the data's fsync, in persist). A failed write stops
// all further writing: the chunk is served from memory meanwhile. inFile
// reports whether the chunk's bytes are in the cache file now (written
// here or before), fresh whether this call put them there.
func (r *Reader) store(i int, data []byte) (inFile, fresh bool) {
	b := r.o.Budget
	r.mu.Lock()
	noWrite := r.noWrite != nil
	have := r.present[i] && r.checked[i] || r.completed
	if !have && !noWrite && b != nil {
		// Charged before it is written: the budget bounds the bytes on
		// disk. Pinned while it is written.
		r.pins[i]++
		b.addLocked(r, i)
	}
	r.mu.Unlock()
	if have || noWrite {
		return have, false
	}
	if _, err := r.o.writeAt(r.f, data, int64(i)*r.o.ChunkSize); err != nil {
		r.mu.Lock()
		if r.noWrite == nil {
			r.noWrite = err
			r.log.Error("cannot write the archive cache; the background fill stops and reads are served from the store", "path", r.partial(), "err", err)
		}
		if b != nil {
			r.pins[i]--
		}
		r.mu.Unlock()
		return false, false
	}
	r.mu.Lock()
	if !r.present[i] {
		r.present[i], r.checked[i] = true, true
		r.have++
		r.stats.PresentBytes += int64(len(data))
		if r.plog != nil {
			r.durable = append(r.durable, i)
		}
		fresh = true
	}
	r.checked[i] = true
	if b != nil {
		r.pins[i]--
	}
	r.mu.Unlock()
	if b != nil {
		b.reclaim()
		return true, fresh
	}
	select {
	case r.flush <- struct{}{}:
	default:
	}
	return true, fresh
}

// persist records written chunks in the present log: the data first, then
// the records, each fsynced.
func (r *Reader) persist() {
	defer r.wg.Done()
	for {
		select {
		case <-r.flush:
		case <-r.ctx.Done():
			r.sync()
			return
		}
		r.sync()
		// Batch what arrives meanwhile.
		select {
		case <-time.After(20 * time.Millisecond):
		case <-r.ctx.Done():
		}
	}
}

// sync makes the chunks written so far durable in the present log. Calls
// are serialised (syncMu): the persister's and finish's may overlap.
func (r *Reader) sync() error {
	r.syncMu.Lock()
	defer r.syncMu.Unlock()
	r.mu.Lock()
	idx := r.durable
	r.durable = nil
	pl := r.plog
	etag, saved := r.etag, r.etagSaved
	r.mu.Unlock()
	if len(idx) == 0 || pl == nil {
		return nil
	}
	err := r.f.Sync()
	if err == nil && !saved && etag != "" {
		// Before the log vouches for chunks of that object: a restart
		// then knows which object the cache holds (CheckSource).
		if err = uploader.WriteFileAtomic(r.etagPath(), []byte(etag+"\n"), 0o600); err == nil {
			r.mu.Lock()
			r.etagSaved = true
			r.mu.Unlock()
		}
	}
	if err == nil {
		rec := make([]byte, 0, 8*len(idx))
		for _, i := range idx {
			rec = append(rec, presentRecord(i)...)
		}
		if _, err = pl.Write(rec); err == nil {
			err = pl.Sync()
		}
	}
	if err != nil {
		// Not recorded: fetched again after a restart. Stop writing, so
		// the log never falls behind data it could later vouch for.
		r.mu.Lock()
		if r.noWrite == nil {
			r.noWrite = err
			r.log.Error("cannot record fetched chunks in the cache; the background fill stops", "path", r.logPath(), "err", err)
		}
		r.mu.Unlock()
	}
	return err
}

// Prefetch fetches the chunks covering [off, end) (in parallel, on-demand
// priority) and returns the first error.
func (r *Reader) Prefetch(ctx context.Context, off, end int64) error {
	if off < 0 || end > r.o.Size || off >= end {
		return nil
	}
	calls := map[int]*call{}
	r.mu.Lock()
	for i := int(off / r.o.ChunkSize); i <= int((end-1)/r.o.ChunkSize); i++ {
		if !r.present[i] {
			calls[i] = r.startLocked(i, onDemand)
		}
	}
	r.mu.Unlock()
	var first error
	for i, c := range calls {
		c, err := r.wait(ctx, i, c)
		if err != nil {
			return err
		}
		if c.err != nil && first == nil {
			first = c.err
		}
	}
	return first
}

// Fill fetches every absent chunk in the background, Options.Hot first (at
// most uploader.HotLimit of them), then in order, yielding to on-demand
// misses throughout; failed chunks are tried again on later passes after a
// pause. When all are present it verifies the whole file and completes the
// cache (see the package doc). It returns at once; Close stops it. A
// reader with a Budget does not fill: it would only evict what it fetched.
func (r *Reader) Fill() {
	if r.o.Budget != nil {
		return
	}
	r.wg.Add(1)
	go func() {
		defer r.wg.Done()
		r.fill()
	}()
}

func (r *Reader) fill() {
	// The hot set, at most uploader.HotLimit chunks of it: a manifest
	// of an older hermesfs may name up to uploader.MaxHot, the whole
	// archive of a session that read everything.
	limit := uploader.HotLimit(r.o.Size, r.o.ChunkSize)
	order := make([]int, 0, r.n+min(len(r.o.Hot), limit))
	seen := make(map[int64]bool, min(len(r.o.Hot), limit))
	for _, h := range r.o.Hot {
		if len(order) == limit {
			break
		}
		if h >= 0 && h < int64(r.n) && !seen[h] {
			seen[h] = true
			order = append(order, int(h))
		}
	}
	hot := len(order) // order[:hot] is the hot set
	for i := range r.n {
		order = append(order, i)
	}
	span := int(max(1, r.o.FillSpan/r.o.ChunkSize))
	t0 := time.Now()
	for pass := 0; ; pass++ {
		for k := 0; k < len(order); k++ {
			i := order[k]
			if r.ctx.Err() != nil || r.stopped() || r.fillOff.Load() {
				return
			}
			if err := r.goneErr(); err != nil {
				r.failFill(err)
				return
			}
			// On-demand misses go first: the fill, the hot set included,
			// issues no request while any wait (after the hot set, unless
			// it follows a sequential read). The hot set is a guess at
			// what the reads to come want; a read waiting is a fact.
			inHot := k < hot
			for r.waiting.Load() > 0 && r.ctx.Err() == nil && (inHot || r.follow(span) < 0) {
				if r.o.heldBack != nil {
					r.o.heldBack()
				}
				time.Sleep(2 * time.Millisecond)
			}
			select {
			case r.filling <- struct{}{}:
			case <-r.ctx.Done():
				return
			}
			r.mu.Lock()
			if f := r.followLocked(span); f >= 0 && !inHot {
				j := f + 1
				for j < r.n && j-f < span && !r.present[j] && r.inflight[j] == nil {
					j++
				}
				r.runLocked(f, j, false)
				r.mu.Unlock()
				k-- // order[k] is still to do
				continue
			}
			if r.present[i] || r.inflight[i] != nil {
				r.mu.Unlock()
				<-r.filling
				continue
			}
			// One request for the run of absent chunks from i (in the
			// fill's order), at most span of them.
			j := i + 1
			for j < r.n && j-i < span && k+1 < len(order) && order[k+1] == j && !r.present[j] && r.inflight[j] == nil {
				j++
				k++
			}
			r.runLocked(i, j, true)
			r.mu.Unlock()
		}
		// Every fill call holds a slot until it is done: holding them all
		// means the pass is over. (Keeping the calls instead would keep
		// their bytes.)
		for range cap(r.filling) {
			select {
			case r.filling <- struct{}{}:
			case <-r.ctx.Done():
				return
			}
		}
		for range cap(r.filling) {
			<-r.filling
		}
		r.mu.Lock()
		done := r.have == r.n
		r.mu.Unlock()
		if done {
			if r.recheck() == 0 {
				r.finish(t0)
				return
			}
			continue // chunks from an earlier run were damaged: fetch them
		}
		if r.stopped() {
			return
		}
		if err := r.goneErr(); err != nil {
			r.failFill(err)
			return
		}
		d := r.o.Retry.Delay(pass, rand.Float64())
		select {
		case <-time.After(d):
		case <-r.ctx.Done():
			return
		}
	}
}

// runLocked starts a fill request for chunks [i, j), holding the fill
// slot the caller took; yields: it pauses for on-demand fetches (see
// stream). r.mu is held.
func (r *Reader) runLocked(i, j int, yields bool) {
	s := &stream{yields: yields}
	s.at.Store(int64(i))
	calls := make([]*call, j-i)
	for x := range calls {
		calls[x] = &call{done: make(chan struct{}), fill: s}
		r.inflight[i+x] = calls[x]
	}
	r.wg.Add(1)
	go r.runStream(i, calls, s)
}

// follow returns the chunk the fill's next request starts at to follow a
// sequential read (see followFor), or -1.
func (r *Reader) follow(span int) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.followLocked(span)
}

func (r *Reader) followLocked(span int) int {
	if r.seqAt.IsZero() || time.Since(r.seqAt) > r.o.followFor {
		return -1
	}
	for i := r.seqNext; i < min(r.n, r.seqNext+r.o.FillParallel*span); i++ {
		if !r.present[i] && r.inflight[i] == nil {
			return i
		}
	}
	return -1
}

// runStream fetches the run of chunks from first, one call each, with one
// ranged Get (more after a failure, for the rest of the run), verifying
// and writing each chunk as it arrives into one reused buffer: no request
// holds more than a chunk in memory. A chunk that arrives damaged, and
// the rest of the run when the store fails past the read timeout, are
// left absent for the fill's next pass; their waiters fetch them on
// demand. It holds a slot of the fill's pool, which it releases.
func (r *Reader) runStream(first int, calls []*call, s *stream) {
	defer r.wg.Done()
	defer func() { <-r.filling }()
	var buf []byte
	select {
	case buf = <-r.bufs:
	default:
		buf = make([]byte, r.o.ChunkSize)
	}
	defer func() {
		select {
		case r.bufs <- buf:
		default:
		}
	}()
	// The read timeout bounds the time without progress, not the
	// request: a long run on a slow link is not cut while bytes flow.
	ctx, cancel := context.WithCancel(r.fillCtx)
	defer cancel()
	watchdog := time.AfterFunc(r.o.ReadTimeout, cancel)
	defer watchdog.Stop()
	progress := func() { watchdog.Reset(r.o.ReadTimeout) }
	// A pause for on-demand fetches is not a stall.
	pause := func() error {
		return r.yieldToDemand(ctx, s, func() { watchdog.Stop() }, progress)
	}
	next := 0 // calls[:next] are done
	var err error
	for attempt := 0; ; attempt++ {
		var n int
		t0 := time.Now()
		n, err = r.receive(ctx, first+next, calls[next:], s, buf, progress, pause)
		if n > 0 {
			attempt = 0
		}
		next += n
		if errors.Is(err, iofs.ErrNotExist) {
			err = r.setGone(err)
			break
		}
		if err == nil || next == len(calls) || ctx.Err() != nil || r.stopped() {
			break
		}
		d := r.o.Retry.Delay(attempt, rand.Float64())
		if n == 0 && time.Since(t0)+d > r.o.ReadTimeout {
			break
		}
		t := time.NewTimer(d)
		select {
		case <-t.C:
		case <-ctx.Done():
		}
		t.Stop()
	}
	// A key gone from the store was logged as such (setGone): no retry
	// will find it.
	if next < len(calls) && err != nil && r.goneErr() == nil && r.fillCtx.Err() == nil && !r.stopped() {
		r.mu.Lock()
		r.stats.Errors++
		r.mu.Unlock()
		r.log.Warn("a fill request failed; its chunks are fetched again later", "key", r.o.Key,
			"chunks", fmt.Sprintf("%d-%d", first+next, first+len(calls)-1), "err", err)
	}
	for x := next; x < len(calls); x++ {
		r.chunkDone(first+x, calls[x], nil, errRefetch)
	}
}

// receive gets the chunks of calls (from chunk first on) with one ranged
// Get and completes each call as its chunk arrives. It returns how many
// calls it completed, and why it stopped before the end. pause is called
// before the Get and between chunks (see yieldToDemand).
func (r *Reader) receive(ctx context.Context, first int, calls []*call, s *stream, buf []byte, progress func(), pause func() error) (int, error) {
	off := int64(first) * r.o.ChunkSize
	end := min(int64(first+len(calls))*r.o.ChunkSize, r.o.Size)
	if err := pause(); err != nil {
		return 0, err
	}
	rc, info, err := r.o.Store.Get(ctx, r.o.Key, off, end-off)
	if err != nil {
		return 0, err
	}
	defer rc.Close()
	changed, err := r.checkObject(info)
	if err != nil {
		return 0, err
	}
	for x, c := range calls {
		i := first + x
		if x > 0 {
			if err := pause(); err != nil {
				return x, err
			}
		}
		s.at.Store(int64(i))
		b := buf[:r.chunkLen(i)]
		if got, err := io.ReadFull(rc, b); err != nil {
			return x, fmt.Errorf("chunk %d: got %d of %d bytes: %w%s", i, got, len(b), err, changed)
		}
		if err := r.verify(i, b); err != nil {
			// The next chunks are still where they belong in the body.
			r.chunkDone(i, c, nil, fmt.Errorf("%w%s", err, changed))
			continue
		}
		r.chunkDone(i, c, b, nil)
		progress()
		if r.stopped() {
			return x + 1, r.FillErr()
		}
	}
	return len(calls), nil
}

// demandFetch counts on-demand fetches entering (d = 1) and leaving
// (d = -1) the store.
func (r *Reader) demandFetch(d int) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.fetching == 0 {
		r.quiet = make(chan struct{})
	}
	if r.fetching += d; r.fetching == 0 {
		close(r.quiet)
		r.quiet = nil
	}
}

// yieldToDemand holds a fill request that yields (s.yields: the hot set's
// and the rest of the fill's) while on-demand fetches are in the store: its body left unread, the
// link's flow control gives the bandwidth to the misses. hold and resume
// bracket a pause. It fails only when ctx ends.
func (r *Reader) yieldToDemand(ctx context.Context, s *stream, hold, resume func()) error {
	if !s.yields {
		return nil
	}
	for {
		r.mu.Lock()
		q := r.quiet
		r.mu.Unlock()
		if q == nil {
			return nil
		}
		hold()
		s.paused.Store(true)
		if r.o.yielded != nil {
			r.o.yielded()
		}
		select {
		case <-q:
		case <-ctx.Done():
		}
		s.paused.Store(false)
		resume()
		if ctx.Err() != nil {
			return ctx.Err()
		}
	}
}

// chunkDone completes call c of chunk i in a fill request: with the
// verified bytes b (written to the cache, or kept in memory if they could
// not be), or with the cause the request did not deliver it (its waiters
// then fetch it themselves).
func (r *Reader) chunkDone(i int, c *call, b []byte, cause error) {
	var data []byte
	fresh := false
	if cause == nil {
		var ok bool
		if ok, fresh = r.store(i, b); !ok {
			data = bytes.Clone(b)
		}
	}
	r.mu.Lock()
	if r.inflight[i] == c {
		delete(r.inflight, i)
	}
	switch {
	case cause == nil && fresh:
		r.stats.FillChunks++
		if r.logged[i] {
			delete(r.logged, i)
			r.log.Info("chunk fetched after earlier failures", "key", r.o.Key, "chunk", i)
		}
	case cause != nil && cause != errRefetch:
		r.stats.Errors++
		if !r.logged[i] {
			r.logged[i] = true
			r.log.Warn("a chunk arrived damaged; it is fetched again", "key", r.o.Key, "chunk", i, "err", cause)
		}
	}
	r.mu.Unlock()
	if cause != nil {
		c.err = errRefetch
	} else {
		c.data = data
	}
	close(c.done)
}

// setGone records that the store says the object does not exist, and
// returns the error that says so: a *uploader.SegmentGoneError, marked
// permanent.
func (r *Reader) setGone(err error) error {
	gone := uploader.Permanent(&uploader.SegmentGoneError{Key: r.o.Key, Err: err})
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.gone == nil {
		r.gone = gone
		r.log.Error("the object is gone from the store; reads of chunks not cached fail", "key", r.o.Key, "err", err)
	}
	return gone
}

// goneErr is the error setGone recorded, if any.
func (r *Reader) goneErr() error {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.gone
}

func (r *Reader) stopped() bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.noWrite != nil
}

// recheck checks the chunks listed by an earlier run's log that no read
// checked yet, marks the damaged ones absent and returns how many.
func (r *Reader) recheck() int {
	bad := 0
	for i := range r.n {
		r.mu.Lock()
		unchecked := r.present[i] && !r.checked[i]
		r.mu.Unlock()
		if unchecked && r.fromCache(i) == nil {
			bad++
		}
	}
	return bad
}

// finish verifies the complete file and puts it in place.
func (r *Reader) finish(t0 time.Time) {
	if err := r.sync(); err != nil {
		return
	}
	if r.o.SHA256 == "" {
		m := uploader.Manifest{Size: r.o.Size, ChunkSize: r.o.ChunkSize, Chunks: r.o.Chunks}
		if err := uploader.VerifyChunks(context.Background(), io.NewSectionReader(r.f, 0, r.o.Size), m); err != nil {
			r.failFill(fmt.Errorf("the complete archive: %w", err))
			return
		}
	} else if got, err := fileSHA256(r.f, r.o.Size); err != nil {
		r.failFill(fmt.Errorf("read the cache back: %w", err))
		return
	} else if got != r.o.SHA256 {
		// Every chunk matched its digest, so the manifest contradicts
		// itself; keep serving (the chunks are right) but do not call
		// the file a verified archive.
		r.failFill(fmt.Errorf("the complete archive has sha256 %s, the manifest says %s", got, r.o.SHA256))
		return
	}
	err := r.f.Sync()
	if err == nil {
		err = os.Rename(r.partial(), r.o.Path)
	}
	if err == nil {
		err = uploader.SyncDir(filepath.Dir(r.o.Path))
	}
	if err != nil {
		r.failFill(fmt.Errorf("put the complete archive in place: %w", err))
		return
	}
	r.mu.Lock()
	r.completed, r.stats.Complete = true, true
	pl := r.plog
	r.plog = nil
	r.mu.Unlock()
	if pl != nil {
		pl.Close()
	}
	os.Remove(r.logPath())
	os.Remove(r.etagPath())
	r.log.Info("archive fully fetched and verified", "key", r.o.Key, "size", r.o.Size, "took", time.Since(t0).Round(time.Millisecond))
	if r.o.OnComplete != nil {
		r.o.OnComplete(r.o.Path)
	}
}

func (r *Reader) failFill(err error) {
	r.mu.Lock()
	r.fillErr = err
	r.stats.Errors++
	r.mu.Unlock()
	r.log.Error("archive cache not completed", "key", r.o.Key, "err", err)
}

// FillErr is why the fill could not complete the cache, if it could not.
func (r *Reader) FillErr() error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.fillErr != nil {
		return r.fillErr
	}
	return r.noWrite
}

// StopFill stops the background fill for good (a stopping mount needs its
// link for the final snapshot, not for bytes nobody reads any more): its
// requests in flight end (their chunks not yet arrived are fetched by the
// reads that need them), what was fetched stays, reads go on.
func (r *Reader) StopFill() {
	r.fillOff.Store(true)
	r.fillCancel()
}

// Close stops the fill and fetches in flight, records what was written and
// closes the files. Reads after Close fail. An ephemeral cache (Budget,
// NoDigests) is removed unless it is complete, and its chunks are taken
// off the budget.
func (r *Reader) Close() error {
	r.cancel()
	r.wg.Wait()
	r.mu.Lock()
	pl := r.plog
	r.plog = nil
	if r.o.Budget != nil {
		r.releaseBudgetLocked()
	}
	completed := r.completed
	r.mu.Unlock()
	if pl != nil {
		pl.Close()
	}
	err := r.f.Close()
	if r.ephemeral() && !completed {
		os.Remove(r.partial())
	}
	return err
}

// identity names the object in the present log: its sha256, else a digest
// of its chunk digests.
func (r *Reader) identity() string {
	if r.o.SHA256 != "" {
		return r.o.SHA256
	}
	h := sha256.New()
	for _, c := range r.o.Chunks {
		io.WriteString(h, c)
	}
	return "chunks-" + hex.EncodeToString(h.Sum(nil))
}

func fileSHA256(f io.ReaderAt, size int64) (string, error) {
	h := sha256.New()
	if _, err := io.Copy(h, io.NewSectionReader(f, 0, size)); err != nil {
		return "", err
	}
	return hex.EncodeToString(h.Sum(nil)), nil
}
