package lazy

import (
	"io"
	"sync"
	"sync/atomic"
	"time"

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
