package daemon

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hermesfs/hermesfs/uploader"
	"github.com/hermesfs/hermesfs/uploader/lazy"
)

// Lazy boot (README "Lazy boot"): when the cache lacks the snapshot to mount
// and its manifest has chunk digests, the daemon opens it through a
// lazy.Reader instead of downloading it, fetches chunk 0 and the metadata
// tail, mounts, and fills the cache in the background after ready. The
// partial cache survives restarts; once complete it is cache/<id>.sqfs,
// exactly as a download leaves it.
//
// An encrypted snapshot is read the same way, through age's decrypting
// ReaderAt over the lazy reader (daemon_lazy_crypt.go): the partial cache
// holds ciphertext (cache/<id>.sqfs.age.partial), and once complete and
// verified it is decrypted into the plaintext cache/<id>.sqfs, again
// exactly what a download leaves.

// errNotLazy: the snapshot's manifest has no chunk digests (format 1).
var errNotLazy = errors.New("the snapshot's manifest has no chunk digests")

// sizedReaderAt is an archive's bytes: a lazy reader, or the plaintext
// decrypted from one.
type sizedReaderAt interface {
	io.ReaderAt
	Size() int64
}

// lazyArchives maps a cache path to the reader standing in for the file
// while it is incomplete, so that OpenArchive (the mount, the packer)
// reads through it.
var lazyArchives sync.Map // string -> sizedReaderAt

// lazyOpen is an archive opened lazily (catalog.OpenLazy).
type lazyOpen struct {
	r *lazy.Reader
	// src is what the archive reader reads: r, or the plaintext of an
	// encrypted snapshot decrypted from r.
	src  sizedReaderAt
	seed *os.File
	m    uploader.Manifest
	// metaStart is where, in the stored object, the bytes of the
	// archive's metadata tail begin: what boot fetches before the mount.
	metaStart int64
	// finish completes the cache of a reader that was complete when it
	// opened (what the fill's OnComplete does otherwise).
	finish func()
}

// lazyBase is the base archive read lazily.
type lazyBase struct {
	r      *lazy.Reader
	src    sizedReaderAt
	id     string
	path   string
	seed   *os.File
	finish func()
	cancel context.CancelFunc // stops the decryption of a complete fill
	// done is set once the complete archive is in place at path (for an
	// encrypted snapshot: decrypted there, after the fill completed).
	done atomic.Bool
	wg   sync.WaitGroup
	once sync.Once
	err  error
}

// OpenLazy implements catalog: snapshot id's archive as a lazy reader with
// its cache at path, seeded from the complete archive at seed ("" = none).
func (a *catalogAdapter) OpenLazy(ctx context.Context, id, path, seed string, o lazyOptions) (*lazyOpen, error) {
	m, err := a.c.Manifest(ctx, id)
	if err != nil {
		return nil, err
	}
	if !m.Lazy() {
		return nil, errNotLazy
	}
	if m.Encryption != nil {
		return a.openLazyEncrypted(ctx, m, path, o)
	}
	lo := lazy.Options{
		Store: a.c.Store(), Key: m.Archive, Size: m.Size, ChunkSize: m.ChunkSize, Chunks: m.Chunks, SHA256: m.SHA256,
		Path: path, ReadTimeout: o.ReadTimeout, Hot: m.Hot, Logger: o.Logger,
	}
	if o.OnComplete != nil {
		lo.OnComplete = func(string) { o.OnComplete(m.SHA256) }
	}
	var sf *os.File
	if seed != "" && m.SharedPrefix > 0 {
		if sf, err = os.Open(seed); err == nil {
			lo.Seed, lo.SeedLen = sf, m.SharedPrefix
		}
	}
	r, err := lazy.Open(lo)
	if err != nil {
		if sf != nil {
			sf.Close()
		}
		return nil, err
	}
	tail := m.MetaOffset
	if tail <= 0 {
		tail = m.Size - 1 // at least the integrity footer
	}
	fin := func() {
		if lo.OnComplete != nil {
			lo.OnComplete(path)
		}
	}
	return &lazyOpen{r: r, src: r, seed: sf, m: m, metaStart: tail, finish: fin}, nil
}

// openLazy makes a lazy reader the base archive id at its cache path and
// fetches what opening it reads (chunk 0 and the metadata tail).
func (d *daemon) openLazy(ctx context.Context, id string) (uploader.Manifest, error) {
	path := d.sd.cached(id)
	seed := ""
	if d.st.Base != "" && d.st.Base != id {
		if p := d.sd.cached(d.st.Base); fileExists(p) {
			seed = p
		}
	}
	lctx, cancel := context.WithCancel(context.Background())
	lo, err := d.cat.OpenLazy(ctx, id, path, seed, lazyOptions{
		ReadTimeout: d.cfg.ReadTimeout,
		Logger:      d.base.With("component", "lazy"),
		OnComplete:  func(sha string) { d.lazyComplete(id, sha) },
		Ctx:         lctx,
	})
	if err != nil {
		cancel()
		return uploader.Manifest{}, err
	}
	r, m := lo.r, lo.m
	t0 := time.Now()
	var wg sync.WaitGroup
	var e1, e2 error
	wg.Go(func() { e1 = r.Prefetch(ctx, 0, min(m.ChunkSize, m.Size)) })
	wg.Go(func() { e2 = r.Prefetch(ctx, lo.metaStart, m.Size) })
	wg.Wait()
	if err := errors.Join(e1, e2); err != nil {
		cancel()
		r.Close()
		if lo.seed != nil {
			lo.seed.Close()
		}
		return m, fmt.Errorf("fetch the archive's metadata: %w", err)
	}
	d.lazy = &lazyBase{r: r, src: lo.src, id: id, path: path, seed: lo.seed, finish: lo.finish, cancel: cancel}
	lazyArchives.Store(path, lo.src)
	st := r.Stats()
	d.log.Info("booting lazily: data is fetched as it is read and filled in the background", "id", id, "size", m.Size,
		"present_bytes", st.PresentBytes, "metadata_fetch", time.Since(t0).Round(time.Millisecond), "hot_chunks", len(m.Hot),
		"encrypted", m.Encryption != nil)
	return m, nil
}

// lazyOptions are what the daemon sets on a lazy reader.
type lazyOptions struct {
	ReadTimeout time.Duration
	Logger      *slog.Logger
	// OnComplete runs once the complete archive is in place at the
	// cache path, verified, with the sha256 of that file (the plaintext
	// for an encrypted snapshot).
	OnComplete func(sha string)
	// Ctx bounds the work that completes the cache (the decryption).
	Ctx context.Context
}

// bootLazy makes snapshot id the base without downloading it, if it can:
// false when the manifest has no chunk digests, lazy boot is off, or the
// metadata could not be fetched (the caller then downloads it whole).
//
// An error is returned (and nothing is downloaded) when the snapshot is
// encrypted and the identities at hand do not open it.
func (d *daemon) bootLazy(ctx context.Context, id string) (string, bool, error) {
	if !d.cfg.Lazy || d.cfg.ReadOnly {
		return "", false, nil
	}
	m, err := d.openLazy(ctx, id)
	if err != nil {
		switch {
		case isKeyError(err):
			return "", false, err
		case !errors.Is(err, errNotLazy):
			d.log.Warn("cannot boot lazily; downloading the snapshot whole", "id", id, "err", err)
		default:
			d.log.Info("the snapshot has no chunk digests (an older hermesfs made it); downloading it whole", "id", id)
		}
		return "", false, nil
	}
	st := &d.st
	st.Base, st.BaseSHA256 = m.ID, m.SHA256
	if m.Encryption != nil {
		// The sha256 of the plaintext cache file is known once the fill
		// completed and decrypted it (lazyComplete).
		st.BaseSHA256 = ""
	}
	if st.LastPublished != m.ID {
		st.LastPublished = ""
	}
	if err := d.sd.save(*st); err != nil {
		d.log.Error("state", "err", err)
	}
	return d.sd.cached(id), true, nil
}

// lazyComplete runs when the fill completed and verified the base: the
// cache file holds it, with sha256 sha.
func (d *daemon) lazyComplete(id, sha string) {
	if l := d.lazy; l != nil && l.id == id {
		l.done.Store(true)
	}
	d.mu.Lock()
	base := d.st.Base
	if base == id && d.st.BaseSHA256 == "" && sha != "" {
		d.st.BaseSHA256 = sha
		if err := d.sd.save(d.st); err != nil {
			d.log.Error("state", "err", err)
		}
	}
	sha = d.st.BaseSHA256
	d.mu.Unlock()
	if base != id {
		return
	}
	d.cleanCache(id)
	if sha == "" {
		// A manifest without a whole-archive sha256 (published with a
		// hole): the complete file, every chunk of it checked, gets one
		// now, so that the next start finds it in the cache by it.
		p := d.sd.cached(id)
		f, err := os.Open(p)
		if err != nil {
			return
		}
		defer f.Close()
		h := sha256.New()
		if _, err := io.Copy(h, f); err != nil {
			return
		}
		d.mu.Lock()
		if d.st.Base == id && d.st.BaseSHA256 == "" {
			d.st.BaseSHA256 = hex.EncodeToString(h.Sum(nil))
			if err := d.sd.save(d.st); err != nil {
				d.log.Warn("state", "err", err)
			}
		}
		d.mu.Unlock()
	}
}

// startLazyFill starts the background fill once the mount is ready (or
// completes a cache that was complete already).
func (d *daemon) startLazyFill() {
	l := d.lazy
	if l == nil {
		return
	}
	if l.r.Complete() {
		if l.finish != nil {
			l.wg.Go(l.finish)
		}
		return
	}
	l.r.Fill()
}

// stopLazyFill stops the background fill (a stop): the final snapshot
// does not wait behind it, nor share the link with it. The next start
// resumes it.
func (d *daemon) stopLazyFill() {
	if d.lazy != nil {
		d.lazy.r.StopFill()
	}
}

// Close stops the fill and closes the reader; later calls return the first
// one's result.
func (l *lazyBase) Close() error {
	l.once.Do(func() {
		lazyArchives.Delete(l.path)
		if l.cancel != nil {
			l.cancel()
		}
		l.wg.Wait()
		l.err = l.r.Close()
		if c, ok := l.src.(io.Closer); ok {
			c.Close()
		}
		if l.seed != nil {
			l.seed.Close()
		}
	})
	return l.err
}

// closeLazy closes the lazy base, if any, once nothing reads it any more.
func (d *daemon) closeLazy() {
	if d.lazy != nil {
		d.lazy.Close()
	}
}

// lazyStats is the "lazy" part of status; nil when the base is not lazy.
// lazyFillOf reports r's fill to the metrics (done once complete).
func lazyFillOf(r *lazy.Reader) func() (lazyFillStats, bool) {
	return func() (lazyFillStats, bool) {
		s := r.Stats()
		return lazyFillStats{
			TotalBytes: s.TotalBytes, PresentBytes: s.PresentBytes,
			OnDemandChunks: uint64(s.OnDemandChunks), FillChunks: uint64(s.FillChunks), Errors: uint64(s.Errors),
		}, true
	}
}

func (d *daemon) lazyStats() *lazy.Stats {
	if d.lazy == nil {
		return nil
	}
	s := d.lazy.r.Stats()
	// Complete means the archive is in place, verified (and decrypted).
	s.Complete = s.Complete && d.lazy.done.Load()
	return &s
}

// lazyIncomplete reports whether the base is still being fetched.
func (d *daemon) lazyIncomplete() bool {
	return d.lazy != nil && !d.lazy.r.Complete()
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

// hotSet is the chunks of the archive at path (just packed) that hold the
// file bytes the mount read first, for its manifest.
func (d *daemon) hotSet(path string, chunkSize int64) []int64 {
	if d.hot == nil {
		return nil
	}
	hot, err := d.hot.Chunks(path, chunkSize)
	if err != nil {
		d.log.Warn("no hot set for the new snapshot", "err", err)
	}
	return hot
}

// openLower opens the lower archive's bytes: the lazy reader standing in
// for path, or the file. The hot-set recorder wraps either.
func (d *daemon) openLower(path string) (io.ReaderAt, int64, io.Closer, error) {
	if d.lazy != nil && d.lazy.path == path && !fileExists(path) {
		h := lazy.NewHotFiles(d.lazy.src, d.lazy.src.Size(), d.lazy.r.ChunkSize(), 0)
		d.hot = h
		return h, d.lazy.src.Size(), d.lazy, nil
	}
	f, err := os.Open(path)
	if err != nil {
		return nil, 0, nil, err
	}
	fi, err := f.Stat()
	if err != nil {
		f.Close()
		return nil, 0, nil, err
	}
	var closer io.Closer = f
	if d.lazy != nil {
		// Completed between boot and mount: the file serves, the
		// reader still needs closing.
		closer = multiCloser{f, d.lazy}
	}
	h := lazy.NewHotFiles(f, fi.Size(), uploader.DefaultChunkSize, 0)
	d.hot = h
	return h, fi.Size(), closer, nil
}

type multiCloser []io.Closer

func (m multiCloser) Close() error {
	var errs []error
	for _, c := range m {
		errs = append(errs, c.Close())
	}
	return errors.Join(errs...)
}

func fileExists(p string) bool {
	_, err := os.Stat(p)
	return err == nil
}

// keepInCache reports whether name, a file in the cache dir, is the
// archive keep: keep.sqfs, or its partial file and present log while
// keep.sqfs is not complete.
func keepInCache(dir, name, keep string) bool {
	if name == keep+".sqfs" {
		return true
	}
	return strings.HasPrefix(name, keep+".sqfs.") && !fileExists(filepath.Join(dir, keep+".sqfs"))
}

// lazyLookup returns the reader standing in for the archive at path.
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
	if l.LocalChunks > 0 {
		s += fmt.Sprintf(", from an older local archive %d", l.LocalChunks)
	}
	if l.Waiting > 0 {
		s += fmt.Sprintf("; %d reads waiting", l.Waiting)
	}
	if l.Errors > 0 {
		s += fmt.Sprintf("; %d fetch errors", l.Errors)
	}
	return s
}
