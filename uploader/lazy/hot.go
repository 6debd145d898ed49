package lazy

import (
	"fmt"
	"io"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hermesfs/hermesfs/archive"
	"github.com/hermesfs/hermesfs/uploader"
)

// DefaultHotWindow is how long after opening reads are recorded in the hot
// set.
const DefaultHotWindow = 2 * time.Minute

// HotRecorder is an io.ReaderAt that records which chunks are read during a
// window after it was made: the chunk indexes, once each, in first-read
// order, at most uploader.MaxHot. Nothing else is recorded.
type HotRecorder struct {
	ra        io.ReaderAt
	chunkSize int64

	closed atomic.Bool // the window passed, the list is full or Stop was called

	mu    sync.Mutex
	until time.Time
	seen  map[int64]bool
	order []int64
}

// NewHotRecorder wraps ra (nil: only Note records) and records for window
// (<= 0: DefaultHotWindow) from now.
func NewHotRecorder(ra io.ReaderAt, chunkSize int64, window time.Duration) *HotRecorder {
	if window <= 0 {
		window = DefaultHotWindow
	}
	if chunkSize <= 0 {
		chunkSize = uploader.DefaultChunkSize
	}
	return &HotRecorder{ra: ra, chunkSize: chunkSize, until: time.Now().Add(window), seen: map[int64]bool{}}
}

// ReadAt implements io.ReaderAt.
func (h *HotRecorder) ReadAt(p []byte, off int64) (int, error) {
	h.Note(off, int64(len(p)))
	return h.ra.ReadAt(p, off)
}

// Note records a read of n bytes at off.
func (h *HotRecorder) Note(off, n int64) {
	if n <= 0 || off < 0 || h.closed.Load() {
		return
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.closed.Load() {
		return // Stop came in meanwhile
	}
	if len(h.order) >= uploader.MaxHot || time.Now().After(h.until) {
		h.closed.Store(true)
		return
	}
	for i := off / h.chunkSize; i <= (off+n-1)/h.chunkSize && len(h.order) < uploader.MaxHot; i++ {
		if !h.seen[i] {
			h.seen[i] = true
			h.order = append(h.order, i)
		}
	}
}

// Stop ends the recording before the window does: no Note (nor ReadAt)
// records anything once Stop returned; Hot keeps what was recorded. It
// may be called more than once, and concurrently with the other methods.
func (h *HotRecorder) Stop() {
	h.mu.Lock()
	h.closed.Store(true)
	h.mu.Unlock()
}

// Hot returns the chunk indexes recorded so far, in first-read order.
func (h *HotRecorder) Hot() []int64 {
	h.mu.Lock()
	defer h.mu.Unlock()
	return append([]int64(nil), h.order...)
}

// ChunkSize is the chunk size the indexes are in.
func (h *HotRecorder) ChunkSize() int64 { return h.chunkSize }

// HotFiles carries a hot set from the archive a session reads to the
// archives its snapshots pack. The recorded chunk indexes name bytes of
// the archive read (the lower layer); a new archive of the same tree puts
// changed files elsewhere, so the indexes would name the wrong bytes
// there. Resolve turns the recorded chunks into the file bytes they hold
// (once: at the first snapshot, which also ends the recording, so the
// pack's own reads of the lower are not recorded); Chunks maps those file
// bytes into each new archive. The file ranges stay in memory: a
// manifest records only its own archive's chunk indexes.
type HotFiles struct {
	*HotRecorder // reads through it are recorded, until Resolve
	size         int64

	once  sync.Once
	mu    sync.Mutex
	files []archive.FileRange
}

// NewHotFiles records reads of the archive ra (size bytes) in chunks of
// chunkSize for window (see NewHotRecorder).
func NewHotFiles(ra io.ReaderAt, size, chunkSize int64, window time.Duration) *HotFiles {
	return &HotFiles{HotRecorder: NewHotRecorder(ra, chunkSize, window), size: size}
}

// Resolve stops the recording and turns the chunks recorded into the file
// byte ranges they hold, read from the archive's metadata (not recorded).
// Only the first call does anything; it returns how many ranges it found.
func (s *HotFiles) Resolve() (int, error) {
	var (
		n   int
		err error
	)
	s.once.Do(func() {
		s.Stop()
		hot := s.Hot()
		if len(hot) == 0 || s.ra == nil {
			return
		}
		var r *archive.Reader
		r, err = archive.Open(s.ra, s.size, archive.ReaderOptions{Name: "lower", CacheBytes: 1})
		if err != nil {
			err = fmt.Errorf("hot set: %w", err)
			return
		}
		files := archive.ChunkFiles(r, s.chunkSize, hot)
		s.mu.Lock()
		s.files = files
		s.mu.Unlock()
		n = len(files)
	})
	return n, err
}

// Chunks returns the chunks (of chunkSize; 0: uploader.DefaultChunkSize)
// of the archive file at path that hold the file bytes Resolve found, in
// their order, at most uploader.MaxHot; nil before Resolve.
func (s *HotFiles) Chunks(path string, chunkSize int64) ([]int64, error) {
	s.mu.Lock()
	files := s.files
	s.mu.Unlock()
	if len(files) == 0 {
		return nil, nil
	}
	if chunkSize <= 0 {
		chunkSize = uploader.DefaultChunkSize
	}
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return nil, err
	}
	r, err := archive.Open(f, fi.Size(), archive.ReaderOptions{Name: path, CacheBytes: 1})
	if err != nil {
		return nil, fmt.Errorf("hot set: %w", err)
	}
	return archive.FileChunks(r, chunkSize, files, uploader.MaxHot), nil
}
