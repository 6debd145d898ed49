package daemon

import (
	"context"
	"errors"
	"io"
	iofs "io/fs"

	"github.com/hermesfs/hermesfs/uploader"
)

// The daemon drives three parts through these small interfaces; the real
// implementations (package fs, archive, uploader) are wired in
// daemon_wire.go. Keeping the daemon's logic on interfaces keeps the
// decisions (what to mount, when to publish, what to keep) readable in one
// place, apart from how each part does its job.

// overlay is the mounted filesystem.
type overlay interface {
	// Generation increments on every mutation of the merged tree.
	Generation() uint64
	// Dirty approximates the files and bytes changed after generation since.
	Dirty(since uint64) (files int, bytes int64)
	// Freeze captures the merged tree at one instant.
	Freeze(ctx context.Context) (frozenView, error)
	// Unmount detaches the mount (lazily, open files allowed) and waits for
	// the server to stop.
	Unmount(ctx context.Context) error
	// Done is closed once the mount is gone, however it went.
	Done() <-chan struct{}
}

// frozenView is the merged tree at a freeze instant, packable by the
// archive writer.
type frozenView interface {
	iofs.FS
	Generation() uint64
	// SameAsLower reports whether the tree is the lower layer's,
	// directory times aside (fs.View.SameAsLower).
	SameAsLower() (bool, error)
	Close() error
}

// snapshotInfo names one published snapshot.
type snapshotInfo struct {
	ID     string
	Size   int64
	SHA256 string // hex
	// Pointer is what LATEST named when it was read ("" when absent, even
	// if snapshots exist): the value the next publish must replace.
	Pointer string
	// Host and Parent come from the manifest, when Latest could read it.
	Host, Parent string
}

// publishResult is what publishing one archive cost.
type publishResult struct {
	snapshotInfo
	// BytesUploaded were sent to the store; BytesCopied the store copied
	// from the delta's source archive instead.
	BytesUploaded, BytesCopied int64
}

// catalog is the snapshot catalog of one store prefix.
type catalog interface {
	// Latest returns the snapshot LATEST names (the newest complete one
	// when LATEST is missing); ID "" when the store holds no snapshot.
	Latest(ctx context.Context) (snapshotInfo, error)
	// Fetch downloads snapshot id (the newest one that verifies when id is
	// "") to the file dst, verifying its size and sha256 on the way. A
	// corrupt newest snapshot is skipped for the next older one; the ids
	// skipped are returned.
	Fetch(ctx context.Context, id, dst string) (got snapshotInfo, skipped []string, err error)
	// Publish uploads the archive at path and moves LATEST to it, provided
	// LATEST still names expect ("" = absent). A failed condition is
	// errConflict. parent is recorded in the manifest. With a delta in
	// meta, a store that can copies those ranges from the source
	// snapshot's archive instead of receiving them (anything wrong with
	// that: a plain upload).
	Publish(ctx context.Context, path string, meta publishMeta, expect string) (publishResult, error)
	// Has reports whether the store holds snapshot id.
	Has(ctx context.Context, id string) (bool, error)
	// Prune applies the retention policy.
	Prune(ctx context.Context, policy uploader.RetentionPolicy) error
	// Lease acquires the writer lease of the prefix for holder, refusing
	// with errLeaseHeld while another live holder has it.
	Lease(ctx context.Context, holder string) (lease, error)
	// OpenLazy opens snapshot id's archive as a lazy reader caching at
	// path (daemon_lazy.go); errNotLazy when its manifest has no chunk
	// digests. seed, if not "", is a complete older archive to copy the
	// shared prefix from.
	OpenLazy(ctx context.Context, id, path, seed string, o lazyOptions) (*lazyOpen, error)
	// Close releases the catalog's resources.
	Close() error
}

// publishMeta goes into a snapshot's manifest, with what the upload may
// copy from an earlier snapshot.
type publishMeta struct {
	Parent string
	Files  int64
	Host   string
	// SHA256 (hex) and Size of the archive as the packer wrote it, so
	// that publishing does not read it again to hash it.
	SHA256 string
	Size   int64
	// DeltaSource is the snapshot whose archive the archive was packed on,
	// Copies the ranges the two share.
	DeltaSource string
	Copies      []copyRange
	// Hot is the chunks of this archive holding the file bytes the
	// session read first (manifest "hot").
	Hot []int64
	// Hole is the range of the archive left unwritten (packed on a base
	// still being fetched); Fill reads the base there, ChunkSize is the
	// base's chunk size (the hole is aligned to it).
	Hole      uploader.Hole
	Fill      io.ReaderAt
	ChunkSize int64
}

// copyRange is a byte range of a new archive that is a copy of a range
// of the archive it was packed on.
type copyRange struct {
	Offset, BaseOffset, Length int64
}

// lease is a held writer lease; it heartbeats in the background.
type lease interface {
	// Lost is closed when another holder took the lease over; the daemon
	// must stop publishing.
	Lost() <-chan struct{}
	// Release gives the lease up.
	Release(ctx context.Context) error
}

var (
	errConflict  = errors.New("another host published since")
	errLeaseHeld = errors.New("the store's writer lease is held by another host")
	errLeaseLost = errors.New("the writer lease was taken over: this host no longer publishes")
	errBadBase   = errors.New("the archive to pack on is unusable")
)

// marked is an error that prints as err but also matches kind (errors.Is),
// so a part's own message reaches the user without a prefix repeating it.
type marked struct {
	err, kind error
}

func (m marked) Error() string   { return m.err.Error() }
func (m marked) Unwrap() []error { return []error{m.err, m.kind} }
func mark(err, kind error) error { return marked{err, kind} }

// packStats are the figures of one pack.
type packStats struct {
	Files       int64
	BytesPacked int64
	Size        int64
	BytesReused int64
	SHA256      string

	// Against the base archive, when packed on one: how it was used
	// ("appended", "compacted", "" not at all), the ranges shared with
	// it, and the bytes of garbage carried in the shared prefix.
	BaseUse      string
	Copies       []copyRange
	BytesCopied  int64
	GarbageBytes int64
	// Hole: the range left unwritten (archive.PackResult.Hole); SHA256
	// is "" then.
	Hole uploader.Hole
}

// parts builds the real parts; tests of the wiring do not replace it (the
// end-to-end tests run the real binary).
type parts interface {
	openCatalog(ctx context.Context, d *daemon) (catalog, error)
	// packDir packs directory dir to the file out (atomically).
	packDir(ctx context.Context, dir, out string) (packStats, error)
	// packView packs a frozen view to the file out (atomically). base, if
	// not "", is the archive of an earlier snapshot of the tree to build
	// on (archive.PackOptions.Base); a base that cannot be opened is an
	// error marked errBadBase.
	packView(ctx context.Context, v frozenView, out, base string) (packStats, error)
	// mount opens the lower archive (path; "" = empty lower) and mounts
	// the overlay.
	mount(ctx context.Context, d *daemon, lowerPath string) (overlay, error)
	// verify checks every block of the archive at path.
	verify(ctx context.Context, path string) error
	// rejections returns the newest n memory-hook rejections.
	rejections(auditPath string, n int) []auditRecord
	// storeURL is the store's URL with credentials redacted.
	storeURL(d *daemon) string
}
