package lazy

import (
	"fmt"
	"io"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hermesfs/hermesfs/archive"
	"github.com/hermesfs/hermesfs/uploader"
)

// DefaultHotWindow is how long after opening reads are recorded in the hot
// set, at most.
const DefaultHotWindow = 2 * time.Minute

// A scan (a backup, tar, grep -r, an indexer) reads the archive in order:
// reads near each other (within scanSlack) that ask for at least half of
// the bytes they span and record scanBytes of chunks not read before (or
// half the byte bound, if that is less: the scan is told before the bound
// is reached).
// What a startup reads is small pieces of a few files here and there, and
// its reads of a file in order are short (or served well without the hot
// set: the fill follows a sequential read).
const (
	scanBytes = 8 << 20
	scanSlack = 1 << 20
	// scanRuns is how many runs of reads are told apart: the reads of a
	// scan come with reads of the archive's metadata elsewhere.
	scanRuns = 4
)

// HotRecorder is an io.ReaderAt that records which chunks are read first
// after it was made: the chunk indexes, once each, in first-read order.
// Nothing else is recorded. Recording ends at the first of: the byte bound
// (uploader.HotLimit chunks), the window, Stop, and a scan. A scan's own
// chunks are dropped from the set: a session that reads everything keeps
// what it read before it.
type HotRecorder struct {
	ra        io.ReaderAt
	chunkSize int64
	limit     int // chunks

	closed atomic.Bool // the window passed, the list is full, a scan, or Stop

	mu     sync.Mutex
	window time.Duration
	until  time.Time
	seen   map[int64]bool
	order  []int64
	runs   [scanRuns]hotRun
	tick   int64 // orders the runs' use
	scan   bool  // recording ended at a scan
}

// hotRun is a run of reads near each other: the bytes [lo, hi) they span,
// how many they asked for, and the chunks they recorded first while it was
// dense (fresh: what a scan takes back).
type hotRun struct {
	lo, hi, read int64
	fresh        []int64
	used         int64 // HotRecorder.tick when last extended; 0: unused
}

// NewHotRecorder wraps ra (nil: only Note records) and records for window
// (<= 0: DefaultHotWindow) from now, at most uploader.MaxHotBytes.
func NewHotRecorder(ra io.ReaderAt, chunkSize int64, window time.Duration) *HotRecorder {
	if chunkSize <= 0 {
		chunkSize = uploader.DefaultChunkSize
	}
	return newHotRecorder(ra, chunkSize, min(int(uploader.MaxHotBytes/chunkSize), uploader.MaxHot), window)
}

func newHotRecorder(ra io.ReaderAt, chunkSize int64, limit int, window time.Duration) *HotRecorder {
	if window <= 0 {
		window = DefaultHotWindow
	}
	return &HotRecorder{ra: ra, chunkSize: chunkSize, limit: max(limit, 1), window: window, until: time.Now().Add(window), seen: map[int64]bool{}}
}

// Begin forgets what was recorded and records from now, for the window:
// what opening the archive read (its superblock and tables, which a boot
// fetches anyway) is not what a session reads. No-op once the recording
// ended.
func (h *HotRecorder) Begin() {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.closed.Load() {
		return
	}
	h.until = time.Now().Add(h.window)
	h.seen = map[int64]bool{}
	h.order = nil
	h.runs = [scanRuns]hotRun{}
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
	if len(h.order) >= h.limit || time.Now().After(h.until) {
		h.closed.Store(true)
		return
	}
	run, dense := h.runOf(off, off+n)
	for i := off / h.chunkSize; i <= (off+n-1)/h.chunkSize && len(h.order) < h.limit; i++ {
		if !h.seen[i] {
			h.seen[i] = true
			h.order = append(h.order, i)
			if dense {
				run.fresh = append(run.fresh, i)
			}
		}
	}
	if int64(len(run.fresh))*h.chunkSize >= min(scanBytes, int64(h.limit)*h.chunkSize/2) && run.dense() {
		h.dropScan(run)
	}
}

// runOf returns the run the read of [off, end) continues, extended by it,
// or a new one in the place of the least recently extended; dense reports
// whether the read continues a run that was dense before it (a read that
// starts a run, or continues a sparse one, records chunks no scan takes
// back: a startup's reads near where a scan passes later stay). h.mu is
// held.
func (h *HotRecorder) runOf(off, end int64) (run *hotRun, dense bool) {
	h.tick++
	for k := range h.runs {
		r := &h.runs[k]
		if r.used > 0 && off <= r.hi+scanSlack && end >= r.lo-scanSlack {
			run, dense = r, r.dense()
			break
		}
	}
	if run == nil {
		for k := range h.runs {
			if r := &h.runs[k]; run == nil || r.used < run.used {
				run = r
			}
		}
		*run = hotRun{lo: off, hi: end, fresh: run.fresh[:0]}
	}
	run.lo, run.hi = min(run.lo, off), max(run.hi, end)
	run.read += end - off
	run.used = h.tick
	return run, dense
}

// dense reports whether the run's reads asked for at least half of the
// bytes it spans.
func (r *hotRun) dense() bool { return 2*r.read >= r.hi-r.lo }

// dropScan ends the recording at a scan and takes the chunks the scan
// recorded out of the set. h.mu is held.
func (h *HotRecorder) dropScan(run *hotRun) {
	drop := make(map[int64]bool, len(run.fresh))
	for _, i := range run.fresh {
		drop[i] = true
	}
	h.order = slices.DeleteFunc(h.order, func(i int64) bool { return drop[i] })
	h.scan = true
	h.closed.Store(true)
	for k := range h.runs {
		h.runs[k] = hotRun{}
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

// Scanned reports whether the recording ended at a scan.
func (h *HotRecorder) Scanned() bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.scan
}

// ChunkSize is the chunk size the indexes are in.
func (h *HotRecorder) ChunkSize() int64 { return h.chunkSize }

// HotFiles carries a hot set from the archive a session reads to the
// archives its snapshots pack. The recorded chunk indexes name bytes of
// the archive read (the lower layer); a new archive of the same tree puts
// changed files elsewhere, so the indexes would name the wrong bytes
// there. So the files read are recorded too (NoteFile: inode, offset,
// length, by the layer that reads the archive's files), and Resolve keeps
// the file reads whose bytes lie in the recorded chunks (once: at the
// first snapshot, which also ends the recording, so the pack's own reads
// of the lower are not recorded); Chunks maps those file bytes into each
// new archive by inode number, which an archive that keeps the lower's
// numbers (extended, compacted) gives them. Nothing walks the tree: the
// cost is the files read. For an archive that numbers its inodes anew,
// ChunksByPath maps them by path, which takes a walk of the lower
// archive's tree (once). The file ranges stay in memory: a manifest
// records only its own archive's chunk indexes.
type HotFiles struct {
	*HotRecorder // reads through it are recorded, until Resolve
	size         int64

	once     sync.Once
	mu       sync.Mutex
	reads    []HotRange            // NoteFile's, in first-read order, while recording
	last     map[archive.Inode]int // the latest entry of reads per inode
	files    []HotRange            // what Resolve kept
	resolved bool                  // Resolve ran

	pathsOnce sync.Once
	paths     []archive.FileRange
	pathsErr  error
}

// HotRange is bytes [Off, Off+Len) of regular file Ino of an archive.
type HotRange struct {
	Ino      archive.Inode
	Off, Len int64
}

// maxFileReads bounds the file reads HotFiles keeps while recording.
const maxFileReads = 1 << 16

// NewHotFiles records reads of the archive ra (size bytes) in chunks of
// chunkSize for window, at most uploader.HotLimit chunks (see
// NewHotRecorder).
func NewHotFiles(ra io.ReaderAt, size, chunkSize int64, window time.Duration) *HotFiles {
	if chunkSize <= 0 {
		chunkSize = uploader.DefaultChunkSize
	}
	return &HotFiles{HotRecorder: newHotRecorder(ra, chunkSize, uploader.HotLimit(size, chunkSize), window), size: size, last: map[archive.Inode]int{}}
}

// NoteFile records a read of n bytes at off of regular file ino of the
// archive, while the recording goes on. A read that continues or overlaps
// the file's latest one extends it. Safe for concurrent use; cheap once
// the recording ended.
func (s *HotFiles) NoteFile(ino archive.Inode, off, n int64) {
	if n <= 0 || off < 0 || s.closed.Load() {
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed.Load() {
		return
	}
	if i, ok := s.last[ino]; ok {
		r := &s.reads[i]
		if off <= r.Off+r.Len && off+n >= r.Off {
			end := max(r.Off+r.Len, off+n)
			r.Off = min(r.Off, off)
			r.Len = end - r.Off
			return
		}
	}
	if len(s.reads) >= maxFileReads {
		return
	}
	s.last[ino] = len(s.reads)
	s.reads = append(s.reads, HotRange{Ino: ino, Off: off, Len: n})
}

// Resolve stops the recording and keeps the file reads whose bytes lie in
// the chunks recorded, read from the archive's metadata (not recorded):
// per file read, the file's block list. Only the first call does
// anything; it returns how many ranges it kept.
func (s *HotFiles) Resolve() (int, error) {
	var (
		n   int
		err error
	)
	s.once.Do(func() {
		s.Stop()
		hot := s.Hot()
		s.mu.Lock()
		reads := s.reads
		s.reads, s.last, s.resolved = nil, nil, true
		s.mu.Unlock()
		if len(hot) == 0 || s.ra == nil {
			return
		}
		var r *archive.Reader
		r, err = archive.Open(s.ra, s.size, archive.ReaderOptions{Name: "lower", CacheBytes: 1})
		if err != nil {
			err = fmt.Errorf("hot set: %w", err)
			return
		}
		in := make(map[int64]bool, len(hot))
		for _, c := range hot {
			in[c] = true
		}
		var files []HotRange
		for _, fr := range reads {
			ext, err := r.Extents(fr.Ino)
			if err != nil {
				continue
			}
			if s.anyHot(ext, fr, in) {
				files = append(files, fr)
			}
		}
		s.mu.Lock()
		s.files = files
		s.mu.Unlock()
		n = len(files)
	})
	return n, err
}

// anyHot reports whether any stored block of file range fr (its file's
// extents ext) lies in a chunk of in.
func (s *HotFiles) anyHot(ext []archive.Extent, fr HotRange, in map[int64]bool) bool {
	for _, e := range ext {
		if e.Off+e.Len <= fr.Off || e.Off >= fr.Off+fr.Len || e.Size <= 0 {
			continue
		}
		for c := e.At / s.chunkSize; c <= (e.At+e.Size-1)/s.chunkSize; c++ {
			if in[c] {
				return true
			}
		}
	}
	return false
}

// Chunks returns the chunks (of chunkSize; 0: uploader.DefaultChunkSize)
// of the archive ra (size bytes) that hold the file bytes Resolve kept,
// in their order, at most uploader.HotLimit of that archive; nil before
// Resolve. The archive must give the files the inode numbers the archive
// read gave them (archive.PackResult.KeptNumbers of a pack over it, or an
// image of that lineage); only the metadata of the files read is read.
func (s *HotFiles) Chunks(ra io.ReaderAt, size, chunkSize int64) ([]int64, error) {
	s.mu.Lock()
	files := s.files
	s.mu.Unlock()
	if len(files) == 0 {
		return nil, nil
	}
	if chunkSize <= 0 {
		chunkSize = uploader.DefaultChunkSize
	}
	r, err := archive.Open(ra, size, archive.ReaderOptions{Name: "new image", CacheBytes: 1})
	if err != nil {
		return nil, fmt.Errorf("hot set: %w", err)
	}
	limit := uploader.HotLimit(size, chunkSize)
	var out []int64
	seen := map[int64]bool{}
	for _, fr := range files {
		a, err := r.Stat(fr.Ino)
		if err != nil || !a.Mode.IsRegular() {
			continue
		}
		ext, err := r.Extents(fr.Ino)
		if err != nil {
			continue
		}
		for _, e := range ext {
			if e.Off+e.Len <= fr.Off || e.Off >= fr.Off+fr.Len || e.Size <= 0 {
				continue
			}
			for c := e.At / chunkSize; c <= (e.At+e.Size-1)/chunkSize; c++ {
				if seen[c] {
					continue
				}
				if len(out) >= limit {
					return out, nil
				}
				seen[c] = true
				out = append(out, c)
			}
		}
	}
	return out, nil
}

// ChunksByPath is Chunks for an archive that numbers its inodes anew:
// the chunks recorded are turned into the file bytes they hold by path
// (archive.ChunkFiles, a walk of the archive read's whole tree, done
// once), and those into ra's chunks (archive.FileChunks).
func (s *HotFiles) ChunksByPath(ra io.ReaderAt, size, chunkSize int64) ([]int64, error) {
	if chunkSize <= 0 {
		chunkSize = uploader.DefaultChunkSize
	}
	s.mu.Lock()
	resolved := s.resolved
	s.mu.Unlock()
	if !resolved || s.ra == nil {
		return nil, nil
	}
	s.pathsOnce.Do(func() {
		r, err := archive.Open(s.ra, s.size, archive.ReaderOptions{Name: "lower", CacheBytes: 1})
		if err != nil {
			s.pathsErr = fmt.Errorf("hot set: %w", err)
			return
		}
		s.paths = archive.ChunkFiles(r, s.chunkSize, s.Hot())
	})
	if s.pathsErr != nil || len(s.paths) == 0 {
		return nil, s.pathsErr
	}
	r, err := archive.Open(ra, size, archive.ReaderOptions{Name: "new image", CacheBytes: 1})
	if err != nil {
		return nil, fmt.Errorf("hot set: %w", err)
	}
	return archive.FileChunks(r, chunkSize, s.paths, uploader.HotLimit(size, chunkSize)), nil
}
