package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync"
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

// errNotLazy: the snapshot's manifest has no chunk digests (format 1).
var errNotLazy = errors.New("the snapshot's manifest has no chunk digests")

// errEncryptedNotLazy: encrypted snapshots are downloaded whole (and
// decrypted into the cache) before the mount; lazy reads of their
// ciphertext are not wired yet.
var errEncryptedNotLazy = errors.New("the snapshot is encrypted")

// lazyArchives maps a cache path to the lazy reader standing in for the
// file while it is incomplete, so that openArchive (the mount, the packer)
// reads through it.
var lazyArchives sync.Map // string -> *lazy.Reader

// lazyBase is the base archive read lazily.
type lazyBase struct {
	r    *lazy.Reader
	id   string
	path string
	seed *os.File
	once sync.Once
	err  error
}

// OpenLazy implements catalog: snapshot id's archive as a lazy reader with
// its cache at path, seeded from the complete archive at seed ("" = none).
func (a *catalogAdapter) OpenLazy(ctx context.Context, id, path, seed string, o lazyOptions) (*lazy.Reader, *os.File, uploader.Manifest, error) {
	m, err := a.c.Manifest(ctx, id)
	if err != nil {
		return nil, nil, m, err
	}
	if !m.Lazy() {
		return nil, nil, m, errNotLazy
	}
	if m.Encryption != nil {
		return nil, nil, m, errEncryptedNotLazy
	}
	lo := lazy.Options{
		Store: a.c.Store(), Key: m.Archive, Size: m.Size, ChunkSize: m.ChunkSize, Chunks: m.Chunks, SHA256: m.SHA256,
		Path: path, ReadTimeout: o.ReadTimeout, Hot: m.Hot, OnComplete: o.OnComplete, Logger: o.Logger,
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
		return nil, nil, m, err
	}
	return r, sf, m, nil
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
	r, sf, m, err := d.cat.OpenLazy(ctx, id, path, seed, lazyOptions{
		ReadTimeout: d.cfg.ReadTimeout,
		Logger:      d.base.With("component", "lazy"),
		OnComplete:  func(string) { d.lazyComplete(id) },
	})
	if err != nil {
		return m, err
	}
	t0 := time.Now()
	tail := m.MetaOffset
	if tail <= 0 {
		tail = m.Size - 1 // at least the integrity footer
	}
	var wg sync.WaitGroup
	var e1, e2 error
	wg.Go(func() { e1 = r.Prefetch(ctx, 0, min(m.ChunkSize, m.Size)) })
	wg.Go(func() { e2 = r.Prefetch(ctx, tail, m.Size) })
	wg.Wait()
	if err := errors.Join(e1, e2); err != nil {
		r.Close()
		if sf != nil {
			sf.Close()
		}
		return m, fmt.Errorf("fetch the archive's metadata: %w", err)
	}
	d.lazy = &lazyBase{r: r, id: id, path: path, seed: sf}
	lazyArchives.Store(path, r)
	st := r.Stats()
	d.log.Info("booting lazily: data is fetched as it is read and filled in the background", "id", id, "size", m.Size,
		"present_bytes", st.PresentBytes, "metadata_fetch", time.Since(t0).Round(time.Millisecond), "hot_chunks", len(m.Hot))
	return m, nil
}

// lazyOptions are what the daemon sets on a lazy reader.
type lazyOptions struct {
	ReadTimeout time.Duration
	Logger      *slog.Logger
	OnComplete  func(path string)
}

// bootLazy makes snapshot id the base without downloading it, if it can:
// false when the manifest has no chunk digests, lazy boot is off, or the
// metadata could not be fetched (the caller then downloads it whole).
func (d *daemon) bootLazy(ctx context.Context, id string) (string, bool) {
	if !d.cfg.Lazy || d.cfg.ReadOnly {
		return "", false
	}
	m, err := d.openLazy(ctx, id)
	if err != nil {
		switch {
		case errors.Is(err, errEncryptedNotLazy):
			d.log.Info("the snapshot is encrypted: downloading and decrypting it whole before the mount", "id", id)
		case !errors.Is(err, errNotLazy):
			d.log.Warn("cannot boot lazily; downloading the snapshot whole", "id", id, "err", err)
		default:
			d.log.Info("the snapshot has no chunk digests (an older hermesfs made it); downloading it whole", "id", id)
		}
		return "", false
	}
	st := &d.st
	st.Base, st.BaseSHA256 = m.ID, m.SHA256
	if st.LastPublished != m.ID {
		st.LastPublished = ""
	}
	if err := d.sd.save(*st); err != nil {
		d.log.Error("state", "err", err)
	}
	return d.sd.cached(id), true
}

// lazyComplete runs when the fill completed and verified the base.
func (d *daemon) lazyComplete(id string) {
	d.mu.Lock()
	base := d.st.Base
	d.mu.Unlock()
	if base == id {
		d.cleanCache(id)
	}
}

// startLazyFill starts the background fill once the mount is ready.
func (d *daemon) startLazyFill() {
	if d.lazy != nil {
		d.lazy.r.Fill()
	}
}

// Close stops the fill and closes the reader; later calls return the first
// one's result.
func (l *lazyBase) Close() error {
	l.once.Do(func() {
		lazyArchives.Delete(l.path)
		l.err = l.r.Close()
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
	return &s
}

// lazyIncomplete reports whether the base is still being fetched.
func (d *daemon) lazyIncomplete() bool {
	return d.lazy != nil && !d.lazy.r.Complete()
}

// hotSet is the chunks the mount read first, for the next manifest.
func (d *daemon) hotSet() []int64 {
	if d.hot == nil {
		return nil
	}
	return d.hot.Hot()
}

// openLower opens the lower archive's bytes: the lazy reader standing in
// for path, or the file. The hot-set recorder wraps either.
func (d *daemon) openLower(path string) (io.ReaderAt, int64, io.Closer, error) {
	if d.lazy != nil && d.lazy.path == path && !fileExists(path) {
		h := lazy.NewHotRecorder(d.lazy.r, d.lazy.r.ChunkSize(), 0)
		d.hot = h
		return h, d.lazy.r.Size(), d.lazy, nil
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
	h := lazy.NewHotRecorder(f, uploader.DefaultChunkSize, 0)
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

// lazyLookup returns the lazy reader standing in for the archive at path.
func lazyLookup(path string) (*lazy.Reader, bool) {
	v, ok := lazyArchives.Load(filepath.Clean(path))
	if !ok {
		return nil, false
	}
	return v.(*lazy.Reader), true
}

// lazyLine is the "lazy fill" row of status.
func lazyLine(l *lazy.Stats) string {
	pct := 100.0
	if l.TotalBytes > 0 {
		pct = 100 * float64(l.PresentBytes) / float64(l.TotalBytes)
	}
	s := fmt.Sprintf("%s of %s present (%.0f%%)", humanBytes(l.PresentBytes), humanBytes(l.TotalBytes), pct)
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
