package daemon

import (
	"context"
	"fmt"
	"io"
	iofs "io/fs"
	"os"
	"path/filepath"

	"github.com/hermesfs/hermesfs/archive"
	"github.com/hermesfs/hermesfs/fs"
	"github.com/hermesfs/hermesfs/fs/memguard"
	"github.com/hermesfs/hermesfs/uploader"
	"github.com/hermesfs/hermesfs/uploader/image"
)

// realParts wires the daemon to the archive writer and reader, the overlay,
// the memory guard and the snapshot catalog.
type realParts struct{}

var _ parts = realParts{}

// packTo packs with pack into out, atomically: a temp file in out's
// directory, fsynced, renamed.
func packTo(out string, pack func(f *os.File) (archive.PackResult, error)) (res archive.PackResult, err error) {
	f, err := os.CreateTemp(filepath.Dir(out), "."+filepath.Base(out)+".tmp*")
	if err != nil {
		return res, err
	}
	defer func() {
		if err != nil {
			f.Close()
			os.Remove(f.Name())
		}
	}()
	// A panic on this goroutine (the caller's: the packer's own recover
	// theirs) fails the pack, and the temp file still goes.
	if err = contain(func() error {
		var perr error
		res, perr = pack(f)
		return perr
	}); err != nil {
		return res, err
	}
	if err = f.Sync(); err != nil {
		return res, fmt.Errorf("fsync %s: %w", f.Name(), err)
	}
	if err = f.Close(); err != nil {
		return res, err
	}
	if err = os.Rename(f.Name(), out); err != nil {
		return res, err
	}
	return res, uploader.SyncDir(filepath.Dir(out))
}

// statsOf are the figures of a segment pack whose image is laid out by
// ext, its segment at out.
func statsOf(res archive.PackResult, ext []uploader.Extent, out string) packStats {
	ps := packStats{
		Files: res.Files, BytesPacked: res.DataBytes, Size: res.Size, BytesReused: res.ReusedBytes,
		Segment: res.SegmentSize, Extents: ext, Matched: res.MatchedBytes,
	}
	if f, err := os.Open(out); err == nil {
		// The superblock is the segment's first bytes.
		ps.MetaOffset = uploader.SquashfsMetaOffset(f, res.Size)
		f.Close()
	}
	return ps
}

func (realParts) packDir(ctx context.Context, dir, out string, progress func(archive.PackProgress)) (packStats, error) {
	res, err := packTo(out, func(f *os.File) (archive.PackResult, error) {
		return archive.PackDir(ctx, f, dir, archive.PackOptions{Segment: true, Progress: progress})
	})
	if err != nil {
		return packStats{}, err
	}
	return statsOf(res, []uploader.Extent{{Length: res.Size}}, out), nil
}

func (realParts) packView(ctx context.Context, d *daemon, v frozenView, out string, base *openImage, extend bool) (packStats, error) {
	opts := archive.PackOptions{Segment: true}
	sources := map[*archive.Reader]*openImage{}
	if base != nil {
		r, err := base.archive()
		if err != nil {
			return packStats{}, mark(err, errBadBase)
		}
		if lr, lo := d.lowerArchive(); lr != nil && lo == base {
			// The lower layer's own reader: the blocks the view's files
			// hand over (BlockSource, PartialSource) are then Base's,
			// which the pack counts as kept, not freed.
			r = lr
		}
		opts.Base = r
		opts.Extend = extend
		sources[r] = base
	}
	if r, o := d.lowerArchive(); r != nil {
		sources[r] = o
	}
	res, err := packTo(out, func(f *os.File) (archive.PackResult, error) {
		return archive.Pack(ctx, f, v.(*viewAdapter), opts)
	})
	if err != nil {
		return packStats{}, err
	}
	images := make(map[*archive.Reader]*image.Image, len(sources))
	for r, o := range sources {
		images[r] = o.im
	}
	ext, rewritten, err := image.LayOut(ctx, res.Runs, out, images, d.encryption != nil)
	if err != nil {
		os.Remove(out)
		return packStats{}, fmt.Errorf("lay the image out: %w", err)
	}
	ps := statsOf(res, ext, out)
	ps.Segment += rewritten
	ps.Rewritten = rewritten
	ps.Extended, ps.Fallback, ps.KeptNumbers = res.Base == archive.BaseExtended, res.ExtendFallback, res.KeptNumbers
	ps.Generation, ps.Garbage = res.Generation, res.GarbageBytes
	return ps, nil
}

func (realParts) verify(ctx context.Context, path string) error {
	r, f, err := OpenArchive(path, archive.ReaderOptions{})
	if err != nil {
		return err
	}
	defer f.Close()
	return r.Verify(ctx)
}

func (realParts) rejections(auditPath string, n int) []auditRecord {
	evs, err := memguard.ReadAudit(auditPath, n, true)
	if err != nil {
		return nil
	}
	out := make([]auditRecord, 0, len(evs))
	for _, ev := range evs {
		out = append(out, auditRecord{Time: ev.Time, File: ev.File, Verdict: ev.Verdict, Reason: ev.Reason})
	}
	return out
}

// mountAdapter is an *fs.Mounted as the daemon's overlay, owning the lower
// archive file and the guard.
type mountAdapter struct {
	*fs.Mounted
	done  chan struct{}
	lower io.Closer
	guard *memguard.Guard
}

type viewAdapter struct{ *fs.View }

func (v *viewAdapter) ReadDir(name string) ([]iofs.DirEntry, error) {
	if h := testViewHook.Load(); h != nil && h.readDir != nil {
		h.readDir(name)
	}
	return v.View.ReadDir(name)
}

func (v *viewAdapter) Open(name string) (iofs.File, error) {
	f, err := v.View.Open(name)
	if h := testViewHook.Load(); h != nil && h.open != nil && err == nil {
		f = h.open(name, f)
	}
	return f, err
}

func (m *mountAdapter) Freeze(ctx context.Context) (frozenView, error) {
	v, err := m.Mounted.Freeze(ctx)
	if err != nil {
		return nil, err
	}
	return &viewAdapter{v}, nil
}

func (m *mountAdapter) Seal(ctx context.Context) (frozenView, error) {
	v, err := m.Mounted.Seal(ctx)
	if err != nil {
		return nil, err
	}
	return &viewAdapter{v}, nil
}

func (m *mountAdapter) Done() <-chan struct{} { return m.done }

func (m *mountAdapter) Unmount(ctx context.Context) error {
	err := m.Mounted.Unmount(ctx)
	select {
	case <-m.done:
		m.guard.Close()
		if m.lower != nil {
			m.lower.Close()
		}
	default:
	}
	return err
}

func (realParts) mount(ctx context.Context, d *daemon, lowerPath string) (overlay, error) {
	log := d.base
	var (
		lowerFile io.Closer
		reader    *archive.Reader
	)
	if lowerPath != "" {
		ra, size, c, err := d.openLower(lowerPath)
		if err != nil {
			return nil, err
		}
		reader, err = archive.Open(ra, size, archive.ReaderOptions{Name: lowerPath, Logger: log.With("component", "archive")})
		if err != nil {
			c.Close()
			return nil, ArchiveError(err)
		}
		d.lowMu.Lock()
		d.lowerReader = reader
		d.lowMu.Unlock()
		d.beginHot()
		lowerFile = c
	}
	closeLower := func() {
		if lowerFile != nil {
			lowerFile.Close()
		}
	}
	upper := d.sd.upper()
	if reader != nil {
		// The root directory's own mode comes from the upper layer's
		// directory: make it the home's, as the archive recorded it.
		if a, err := reader.Stat(reader.Root()); err == nil {
			os.Chmod(upper, a.Mode.Perm())
		}
	}
	if d.cfg.ReadOnly {
		// A read-only mount never shows or keeps local changes: an empty
		// throwaway upper layer, and the overlay mounts read-only (EROFS).
		upper = filepath.Join(d.sd.path, "ro-upper")
		os.RemoveAll(upper)
	}
	if o := d.cfg.Owner; o != nil {
		if err := o.giveRoot(upper, d.cfg.Mountpoint); err != nil {
			closeLower()
			return nil, err
		}
	}
	var lower fs.Lower
	if reader != nil {
		lower = reader
		if d.hot != nil {
			lower = hotLower{Reader: reader, hot: d.hot}
		}
	}
	guard, err := memguard.New(memguard.Options{
		MemoryLimit: d.cfg.MemoryLimit,
		UserLimit:   d.cfg.UserLimit,
		AuditLog:    d.sd.auditLog(),
		// Read from the layers, not through the mount: the guard is
		// asked while the overlay waits for its verdict.
		ConfigYAML: func() ([]byte, error) { return fs.ReadFile(upper, lower, "config.yaml") },
		Logger:     log.With("component", "memguard"),
		OnVerdict:  d.met.verdictFunc(),
	})
	if err != nil {
		closeLower()
		return nil, err
	}
	warnMemoryConfig(log.With("component", "memguard"), guard)
	if err := d.adoptUnderneath(ctx, upper, lower, guard.Guarded); err != nil {
		guard.Close()
		closeLower()
		return nil, err
	}
	opts := fs.Options{
		Upper:    upper,
		Lower:    lower,
		Guard:    guard,
		ReadOnly: d.cfg.ReadOnly,
		Logger:   d.root.With("component", "fs"),
		Debug:    d.cfg.Debug,

		PassthroughWriteMax: d.cfg.PassthroughWriteMax,
		Stats:               d.met.fsStats(),
		AllowOther:          d.cfg.Owner != nil,
		CopyUpByRangeMin:    d.cfg.CopyUpMin,
	}
	// Shown while the writer lease is awaited (leasewait.go).
	opts.RefuseWrites = d.refuseWrites
	m, err := fs.Mount(ctx, d.cfg.Mountpoint, opts)
	if err != nil {
		guard.Close()
		closeLower()
		return nil, err
	}
	ma := &mountAdapter{Mounted: m, done: make(chan struct{}), lower: lowerFile, guard: guard}
	d.met.setPartialCopyUps(partialCopyUpsOf(m))
	if _, o := d.lowerArchive(); o != nil && d.lazyBoot {
		d.met.setLazyFill(lazyFillOf(o))
	}
	go func() { m.Wait(); close(ma.done) }()
	return ma, nil
}
