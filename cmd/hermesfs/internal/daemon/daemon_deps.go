package daemon

import (
	"context"
	"errors"
	iofs "io/fs"

	"github.com/hermesfs/hermesfs/archive"
	"github.com/hermesfs/hermesfs/fs"
	"github.com/hermesfs/hermesfs/uploader"
	"github.com/hermesfs/hermesfs/uploader/crypt"
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
	// Seal is the stop's freeze: after it, every change fails
	// (fs.Mounted.Seal).
	Seal(ctx context.Context) (frozenView, error)
	// Unrevoked counts the files open for writing through passthrough
	// whose writes Seal could not refuse.
	Unrevoked() int
	// Holders lists (at most max of) the files open on the mount.
	Holders(max int) []fs.Holder
	// Unmount detaches the mount (lazily, open files allowed) and waits for
	// the server to stop.
	Unmount(ctx context.Context) error
	// Done is closed once the mount is gone, however it went.
	Done() <-chan struct{}
	// AllowWrites lets changes through a mount made refusing them
	// (daemon.refuseWrites).
	AllowWrites()
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
	SHA256 string // hex; "" for an image stored as extents
	// Pointer is what LATEST named when it was read ("" when absent, even
	// if snapshots exist): the value the next publish must replace.
	Pointer string
	// Host and Parent come from the manifest, when Latest could read it;
	// NewBytes too (the bytes of the snapshot's own segment).
	Host, Parent string
	NewBytes     int64
	// Compacts: the snapshot this one is a compaction of (manifest).
	Compacts string
}

// catalog is the snapshot catalog of one store prefix.
type catalog interface {
	// Latest returns the snapshot LATEST names (the newest complete one
	// when LATEST is missing); ID "" when the store holds no snapshot.
	Latest(ctx context.Context) (snapshotInfo, error)
	// Manifest reads snapshot id's manifest.
	Manifest(ctx context.Context, id string) (uploader.Manifest, error)
	// Older lists the complete snapshots older than id, newest first: the
	// ones a boot falls back to when id is damaged.
	Older(ctx context.Context, id string) ([]string, error)
	// Fetch downloads snapshot id's whole archive to the file dst,
	// verifying its size and sha256 on the way: how a snapshot whose
	// manifest has no chunk digests (an older hermesfs's) is read.
	Fetch(ctx context.Context, id, dst string) (got snapshotInfo, err error)
	// PublishImage publishes an image as extents of segments and moves
	// LATEST to it, provided LATEST still names in.Expect. A failed
	// condition is errConflict; a lost lease errLeaseLost.
	PublishImage(ctx context.Context, in uploader.ImageInput) (uploader.Published, error)
	// Has reports whether the store holds snapshot id.
	Has(ctx context.Context, id string) (bool, error)
	// Prune applies the retention policy.
	Prune(ctx context.Context, policy uploader.RetentionPolicy) error
	// Lease acquires the writer lease of the prefix for holder, refusing
	// with errLeaseHeld while another live holder has it.
	Lease(ctx context.Context, holder string) (lease, error)
	// Store and Identities are what the image pool reads with.
	Store() uploader.Store
	Identities() *crypt.Identities
	// Close releases the catalog's resources.
	Close() error
}

// lease is a held writer lease; it heartbeats in the background.
type lease interface {
	// Lost is closed when another holder took the lease over; the daemon
	// must stop publishing.
	Lost() <-chan struct{}
	// Release gives the lease up.
	Release(ctx context.Context) error
	// Err is nil while the lease is held; once lost, why
	// (uploader.ErrLeaseLapsed: the store did not answer its renewals).
	Err() error
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
	Size        int64 // the image
	BytesReused int64
	// Segment is the bytes of the image that are new (the file the pack
	// wrote); Extents lay the image out over them (Key "") and over the
	// segments of the images it copies from; MetaOffset is where its
	// metadata tables start.
	Segment    int64
	Extents    []uploader.Extent
	MetaOffset int64
	// Rewritten: image bytes copied into the new segment from segments
	// the image would otherwise keep alive for little (mostly dead, or
	// of the other kind than the new snapshot's encryption).
	Rewritten int64
	// Matched: file bytes read because they might have changed, found in
	// the base by their block sums and copied rather than compressed
	// (archive.PackResult.MatchedBytes).
	Matched int64
	// Extended: the image is the base's grown by the change
	// (archive.BaseExtended); Fallback says why an extending pack laid
	// the image out afresh instead. KeptNumbers: the image holds the
	// lower layer's inode numbers as the view gave them
	// (archive.PackResult.KeptNumbers), so the next pack may extend it.
	Extended    bool
	Fallback    string
	KeptNumbers bool
	// Generation, Garbage: the image's extending packs since its
	// lineage's last fresh or compacted one, and its estimate of the
	// bytes nothing uses any more (archive.Reader.Generation,
	// GarbageBytes).
	Generation int
	Garbage    int64
}

// parts builds the real parts; tests of the wiring do not replace it (the
// end-to-end tests run the real binary).
type parts interface {
	openCatalog(ctx context.Context, d *daemon) (catalog, error)
	// packDir packs directory dir as a new image: its one segment goes
	// to the file out (atomically). progress, if set, is archive's
	// PackOptions.Progress.
	packDir(ctx context.Context, dir, out string, progress func(archive.PackProgress)) (packStats, error)
	// packView packs a frozen view as an image: the bytes no source image
	// holds go to the file out (atomically), the rest are extents of the
	// sources: the image base (an earlier snapshot of the tree, nil for
	// none) and the image the view's lower layer is, opened by d. A base
	// that cannot be read is an error marked errBadBase. extend: the
	// pack grows base's image by the change the view knows of
	// (archive.PackOptions.Extend); only for a base that holds the lower
	// layer's inode numbers (packOn).
	packView(ctx context.Context, d *daemon, v frozenView, out string, base *openImage, extend bool) (packStats, error)
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
