package fs

import (
	"context"
	"log/slog"
	"time"

	"github.com/hermesfs/hermesfs/archive"
)

// Lower is the read-only lower layer: the part of *archive.Reader the overlay
// uses. Inode numbers are stable for the life of the Lower and hard links
// share one. All methods may be called concurrently.
//
// A missing name makes Lookup fail with an error matching
// errors.Is(err, io/fs.ErrNotExist); damaged content makes ReadAt and the
// others fail with an error matching errors.Is(err, archive.ErrCorrupt),
// which the overlay reports as EIO.
type Lower interface {
	Root() archive.Inode
	Stat(ino archive.Inode) (archive.Attr, error)
	Lookup(dir archive.Inode, name string) (archive.Attr, error)
	ReadDir(dir archive.Inode) ([]archive.DirEntry, error)
	Readlink(ino archive.Inode) (string, error)
	ReadAt(ino archive.Inode, p []byte, off int64) (int, error)
}

// ArchiveReaderer is optionally implemented by a Lower that wraps an
// *archive.Reader (a *archive.Reader used directly as the Lower needs
// nothing). It lets the files of a View that are unchanged lower content
// hand their compressed blocks to archive.Pack (archive.BlockSource).
type ArchiveReaderer interface {
	ArchiveReader() *archive.Reader
}

// Guard is the memory write hook (implemented by fs/memguard). For a path it
// guards, a change of content is all-or-nothing: the overlay stages the
// writer's bytes privately and calls Check with the complete new content
// before it replaces the old.
//
// Guarded is called on every open, create, rename, link and truncate, with
// rel the slash-separated path relative to the mount root
// ("memories/MEMORY.md"). It must be cheap and must not block.
//
// Check is called with the complete new content (at close(2) of a writer, at
// rename(2) of another file over the guarded name, at truncate(2)); old is
// the content it replaces, nil if the file did not exist. nil accepts. An
// error wrapping syscall.EFBIG or syscall.EPERM rejects the change and is
// returned as that errno by close(2), rename(2) or truncate(2); any other
// error rejects it with EIO. Check may be called from many goroutines at
// once and must not access the mount (that would deadlock).
type Guard interface {
	Guarded(rel string) bool
	Check(ctx context.Context, rel string, old, new []byte, pid uint32) error
}

// GuardWriteChecker is optionally implemented by a Guard to refuse a write
// to a guarded file as soon as the write makes the staged content certain
// to be refused at close, as RLIMIT_FSIZE refuses a write past a size, so
// that a writer that ignores close(2)'s error (a shell redirection) sees
// the write itself fail. CheckWrite gets rel, the committed content (nil if
// the file did not exist before the handle) and the whole content the
// write would produce; appendOnly is true for a write through a handle
// opened with O_APPEND, whose writes all land at the end (only a
// truncation through the handle can take bytes back), and false for other
// writes and for truncations. It is called on every write to a guarded
// handle, must be cheap and must record nothing. An error wrapping EFBIG
// or EPERM fails the write with that errno and poisons the handle: nothing
// it staged is committed, and its close(2) fails too, after Check has
// judged (and recorded) the refused content. The exception: an EPERM
// refusal of an appendOnly write is lifted when the handle truncates the
// file to at most the size it had before that write, since the refused
// bytes are then gone in any case. nil lets the write through; Check at
// close still decides.
type GuardWriteChecker interface {
	CheckWrite(rel string, old, content []byte, appendOnly bool) error
}

// Options configures Mount. Zero values take the defaults documented on
// each field (set in one place, withDefaults).
type Options struct {
	// Upper is the upper layer directory, created if missing. It persists
	// across mounts: it holds every change since the lower layer was made,
	// plus the overlay's own state under names starting with ".wh." (see
	// the package documentation). Required.
	Upper string

	// Lower is the read-only lower layer; nil means an empty one (first
	// boot).
	Lower Lower

	// Guard is the memory write hook; nil guards nothing.
	Guard Guard

	// ReadOnly mounts the merged tree read-only, with or without root: the
	// kernel refuses every change with EROFS (the "ro" mount option), and
	// the overlay refuses any that reaches it anyway. The upper layer is
	// shown but never written: it is created empty if missing, and
	// neither its work directory nor its inode map is touched.
	ReadOnly bool

	// RefuseWrites mounts the merged tree with every change refused
	// (EROFS) until Mounted.AllowWrites, which needs no remount: the
	// kernel mount is writable and the refusal is the daemon's. A mount
	// that may become writable (a daemon waiting for the store's writer
	// lease) shows its tree this way meanwhile. Ignored with ReadOnly.
	RefuseWrites bool

	// AllowOther lets every user of the host use the mount (the
	// "allow_other" mount option), not only the one who mounted it. The
	// kernel still checks every access against the modes shown
	// (default_permissions), and a privileged daemon gives what a user
	// creates to that user, so the mount behaves as a local file system
	// shared by several users. It takes a privileged daemon, or
	// user_allow_other in /etc/fuse.conf.
	AllowOther bool

	// Logger receives the overlay's diagnostics; nil discards them.
	Logger *slog.Logger

	// Debug logs every FUSE request and reply (go-fuse's debug output)
	// through Logger at debug level.
	Debug bool

	// EntryTimeout and AttrTimeout are how long the kernel may cache names
	// and attributes, NegativeTimeout missing names. The overlay is the only
	// writer of its upper layer and every change goes through the kernel
	// (which updates its caches itself), except a guarded file's new
	// content, which the overlay announces with an invalidation. So they
	// can be long: default 1h each. Nothing but the overlay may change the
	// upper directory while it is mounted.
	EntryTimeout    time.Duration
	AttrTimeout     time.Duration
	NegativeTimeout time.Duration

	// NoPassthrough turns FUSE passthrough off. By default read-only opens
	// of upper-layer files (PassthroughMinSize) and writable opens of
	// smaller ones (PassthroughWriteMax) are served by the kernel straight
	// from the upper file where the kernel allows it (kernel >= 6.9, a
	// daemon with CAP_SYS_ADMIN), and by the daemon otherwise.
	NoPassthrough bool

	// PassthroughMinSize is the smallest upper file opened read-only with
	// passthrough. Below it, the page cache of a daemon-served open is
	// faster: passthrough costs two ioctls per open and bypasses the
	// cache the kernel keeps across opens. Default 1 MiB.
	PassthroughMinSize int64

	// PassthroughWriteMax is the largest upper file opened for writing
	// with passthrough (where passthrough is on): the kernel then writes
	// it without a round trip to the daemon. Each freeze stops those
	// files' writes and copies them whole into the view (ptwrite.go), so
	// this bounds what a freeze copies per file opened (a file may grow
	// while open). Larger files are
	// written through the daemon, which saves only the blocks a write
	// changes. Default 32 MiB; negative turns writable passthrough off.
	PassthroughWriteMax int64

	// GuardMaxBytes caps the content of a guarded file handed to
	// Guard.Check: a larger new content is rejected with EFBIG without
	// reading it into memory. Default 4 MiB.
	GuardMaxBytes int64

	// Stats, if set, receives the mount's figures for monitoring (see
	// Stats); nil keeps none and adds nothing to the request path.
	Stats *Stats

	// MaxWrite is the largest read or write request the kernel sends.
	// Default 1 MiB.
	MaxWrite int

	// ReadAhead is how far the kernel reads ahead of a sequential reader
	// of the mount, which is also the size of its read requests (up to
	// MaxWrite): larger requests mean fewer round trips, and more archive
	// blocks to decompress in parallel per request. FUSE starts every
	// mount at 128 KiB; only a daemon running as root can raise it (it is
	// a sysfs setting of the mount's backing device). Default 1 MiB;
	// negative leaves the kernel's default.
	ReadAhead int

	// CopyUpByRangeMin is the smallest lower regular file copied up by
	// range (partial.go): its first change copies only the blocks it
	// touches and the rest follows in the background. Smaller files are
	// copied whole before the change. Default DefaultCopyUpByRangeMin
	// (4 MiB); negative copies every file whole.
	CopyUpByRangeMin int64

	// CopyUpBlock is the block size of copy-up by range: a power of two,
	// default 256 KiB.
	CopyUpBlock int64

	// CopyUpPause is the pause of the background copy of a partial file
	// between batches of blocks (longer while the file is in use).
	// Default 1ms.
	CopyUpPause time.Duration

	// OpenFillMax is the largest lower file whose content the daemon
	// hands to the kernel's page cache at its first read-only open, so
	// that reading it needs no READ request (lowerfill.go). Default 128
	// KiB; negative turns it off.
	OpenFillMax int64

	// holdCopyUps starts the mount with its background copies held
	// (partialSet.setHold), for tests.
	holdCopyUps bool
}

const (
	defaultTimeout        = time.Hour
	defaultGuardMaxBytes  = 4 << 20
	defaultMaxWrite       = 1 << 20
	defaultPassthroughMin = 1 << 20
	defaultReadAhead      = 1 << 20
)

// DefaultPassthroughWriteMax is PassthroughWriteMax when it is zero.
const DefaultPassthroughWriteMax = 32 << 20

func (o Options) withDefaults() Options {
	if o.Logger == nil {
		o.Logger = slog.New(slog.DiscardHandler)
	}
	if o.EntryTimeout == 0 {
		o.EntryTimeout = defaultTimeout
	}
	if o.AttrTimeout == 0 {
		o.AttrTimeout = defaultTimeout
	}
	if o.NegativeTimeout == 0 {
		o.NegativeTimeout = defaultTimeout
	}
	if o.GuardMaxBytes == 0 {
		o.GuardMaxBytes = defaultGuardMaxBytes
	}
	if o.PassthroughMinSize == 0 {
		o.PassthroughMinSize = defaultPassthroughMin
	}
	if o.PassthroughWriteMax == 0 {
		o.PassthroughWriteMax = DefaultPassthroughWriteMax
	}
	if o.MaxWrite == 0 {
		o.MaxWrite = defaultMaxWrite
	}
	if o.ReadAhead == 0 {
		o.ReadAhead = defaultReadAhead
	}
	if o.CopyUpByRangeMin == 0 {
		o.CopyUpByRangeMin = DefaultCopyUpByRangeMin
	}
	if o.CopyUpBlock <= 0 || o.CopyUpBlock&(o.CopyUpBlock-1) != 0 {
		o.CopyUpBlock = defaultRangeBS
	}
	if o.OpenFillMax == 0 {
		o.OpenFillMax = defaultFillMax
	}
	if o.CopyUpPause <= 0 {
		o.CopyUpPause = time.Millisecond
	}
	return o
}
