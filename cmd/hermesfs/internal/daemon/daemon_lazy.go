package daemon

import (
	"errors"
	"fmt"
	"io"
	"path/filepath"
	"strings"
	"sync"

	"github.com/hermesfs/hermesfs/archive"
	"github.com/hermesfs/hermesfs/fs"
	"github.com/hermesfs/hermesfs/uploader"
	"github.com/hermesfs/hermesfs/uploader/lazy"
)

// Lazy boot (README "Lazy boot"): the base is an image read through its
// segments' range readers (daemon_images.go): boot fetches what opening
// its archive reads (the first chunk and the metadata tail), mounts, and
// fills the segments' caches in the background after ready, the hot set
// first. The caches survive restarts; once complete, a segment is a local
// file and reads need the store no more.

// sizedReaderAt is an archive's bytes as OpenArchive and the mount read
// them: an image.
type sizedReaderAt interface {
	io.ReaderAt
	Size() int64
}

// lazyArchives maps a cache path (cache/<id>.sqfs) to the image standing
// in for the archive file, so that OpenArchive (the mount, the packer,
// verify) reads through it.
var lazyArchives sync.Map // string -> sizedReaderAt

// isKeyError reports an encrypted snapshot the identities at hand cannot
// open: a boot stops there (exit 6) rather than fall back.
func isKeyError(err error) bool {
	_, ok := errors.AsType[*uploader.KeyError](err)
	return ok
}

// startLazyFill starts the background fill of the base's segments once the
// mount is ready.
func (d *daemon) startLazyFill() {
	if _, o := d.lowerArchive(); o != nil && !o.im.Complete() {
		o.im.Fill()
	}
}

// stopLazyFill stops the background fill (a stop): the final snapshot
// does not wait behind it, nor share the link with it. The next start
// resumes it.
func (d *daemon) stopLazyFill() {
	if _, o := d.lowerArchive(); o != nil {
		o.im.StopFill()
	}
}

// lazyFillOf reports o's fill to the metrics.
func lazyFillOf(o *openImage) func() (lazyFillStats, bool) {
	return func() (lazyFillStats, bool) {
		s := o.im.Stats()
		return lazyFillStats{
			TotalBytes: s.TotalBytes, PresentBytes: s.PresentBytes,
			OnDemandChunks: uint64(s.OnDemandChunks), FillChunks: uint64(s.FillChunks), Errors: uint64(s.Errors),
		}, true
	}
}

// lazyStats is the "lazy" part of status; nil when the base was complete
// in the cache at boot.
func (d *daemon) lazyStats() *lazy.Stats {
	_, o := d.lowerArchive()
	if o == nil || !d.lazyBoot {
		return nil
	}
	s := o.im.Stats()
	s.Complete = o.im.Complete()
	return &s
}

// beginHot starts the hot set's recording once the lower archive is open:
// its superblock and tables, read by the open, are no part of it.
func (d *daemon) beginHot() {
	if d.hot != nil {
		d.hot.Begin()
	}
}

// resolveHot ends the hot set's recording, at the first snapshot (before
// its pack reads the lower), and keeps the files' bytes it read.
func (d *daemon) resolveHot() {
	if d.hot == nil {
		return
	}
	n, err := d.hot.Resolve()
	switch {
	case err != nil:
		d.log.Warn("the hot set is lost", "err", err)
	case d.hot.Scanned():
		d.log.Info("the session read in bulk (a scan of the archive in order); the hot set keeps what it read before",
			"chunks", len(d.hot.Hot()), "file_ranges", n)
	case n > 0:
		d.log.Debug("hot set resolved", "chunks", len(d.hot.Hot()), "file_ranges", n)
	}
}

// hotSet is the chunks of the image ra (size bytes; just packed) that hold
// the file bytes the mount read first, for its manifest. sameNumbers: the
// image keeps the lower layer's inode numbers (extended or compacted over
// it), so the files read are found by number, at the cost of what was
// read; otherwise by path, which walks the lower archive's tree once.
func (d *daemon) hotSet(ra io.ReaderAt, size int64, sameNumbers bool) []int64 {
	if d.hot == nil {
		return nil
	}
	chunks := d.hot.ChunksByPath
	if sameNumbers {
		chunks = d.hot.Chunks
	}
	hot, err := chunks(ra, size, uploader.DefaultChunkSize)
	if err != nil {
		d.log.Warn("no hot set for the new snapshot", "err", err)
	}
	return hot
}

// openLower opens the lower archive's bytes: the image registered for
// path (cache/<id>.sqfs). The hot-set recorder wraps it.
func (d *daemon) openLower(path string) (io.ReaderAt, int64, io.Closer, error) {
	src, ok := lazyLookup(path)
	if !ok {
		return nil, 0, nil, fmt.Errorf("internal error: no image open for %s", path)
	}
	h := lazy.NewHotFiles(src, src.Size(), uploader.DefaultChunkSize, 0)
	d.hot = h
	id := strings.TrimSuffix(filepath.Base(path), uploader.ArchiveExt)
	if o := d.openedImage(id); o != nil {
		d.lowMu.Lock()
		d.lowerImage = o
		d.lowMu.Unlock()
	}
	return h, src.Size(), nopCloser{}, nil
}

type nopCloser struct{}

func (nopCloser) Close() error { return nil }

// lazyLookup returns the image standing in for the archive at path.
func lazyLookup(path string) (sizedReaderAt, bool) {
	v, ok := lazyArchives.Load(filepath.Clean(path))
	if !ok {
		return nil, false
	}
	return v.(sizedReaderAt), true
}

// LazyLine is the "lazy fill" row of status.
func LazyLine(l *lazy.Stats) string {
	pct := 100.0
	if l.TotalBytes > 0 {
		pct = 100 * float64(l.PresentBytes) / float64(l.TotalBytes)
	}
	s := fmt.Sprintf("%s of %s present (%.0f%%)", HumanBytes(l.PresentBytes), HumanBytes(l.TotalBytes), pct)
	if l.Complete {
		s += ", complete and verified"
	}
	s += fmt.Sprintf("; chunks fetched on demand %d, by the fill %d", l.OnDemandChunks, l.FillChunks)
	if l.Waiting > 0 {
		s += fmt.Sprintf("; %d reads waiting", l.Waiting)
	}
	if l.Errors > 0 {
		s += fmt.Sprintf("; %d fetch errors", l.Errors)
	}
	return s
}

// hotLower is the lower archive as the overlay reads it, noting the file
// reads of the hot set's recording (lazy.HotFiles.NoteFile): what the
// session read is then carried to the next images by inode number.
type hotLower struct {
	*archive.Reader
	hot *lazy.HotFiles
}

func (l hotLower) ReadAt(ino archive.Inode, p []byte, off int64) (int, error) {
	n, err := l.Reader.ReadAt(ino, p, off)
	if n > 0 {
		l.hot.NoteFile(ino, off, int64(n))
	}
	return n, err
}

// ArchiveReader implements fs.ArchiveReaderer.
func (l hotLower) ArchiveReader() *archive.Reader { return l.Reader }

var _ fs.ArchiveReaderer = hotLower{}
