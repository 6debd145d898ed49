package fs

import (
	"context"
	"sync"
	"sync/atomic"
	"syscall"

	fusefs "github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"
	"golang.org/x/sys/unix"
)

// deferredFile is a read-write open of a lower file that is copied up by
// range (partial.go), before anything changed it. SQLite opens its database
// read-write even to run a query. Copying up at open would make every
// session that only reads the database count as a change (and publish a
// snapshot for it), start a background completion that reads the whole
// file (on a lazy base: downloads it), and put the partial file's map
// syncs under the session's first commit.
//
// The handle reads the lower file until its first write, fallocate or
// truncate, which copies the file up (by range) and turns it into an
// ordinary writable upper handle. An fsync copies nothing: with no change
// through this handle there is nothing of its own to make durable, and if
// another open copied the file up meanwhile, the fsync goes to the upper
// file. An unlink of the file, or a rename over it, while such a handle is
// open copies it up first (copyUpDeferred), so the handle can still write
// the file once it has no name, as on a local file system.
type deferredFile struct {
	n   *node
	pid uint32
	// lower serves reads until the file is in the upper layer, and
	// follows it there when another open copies it up.
	lower *lowerFile

	// up is the handle once copied up; it owns the open counts then. mu
	// serialises making it (a copy-up may wait out a freeze); reads do not
	// wait for that.
	mu sync.Mutex
	up atomic.Pointer[upperFile]
}

var (
	_ fusefs.FileReader    = (*deferredFile)(nil)
	_ fusefs.FileWriter    = (*deferredFile)(nil)
	_ fusefs.FileFsyncer   = (*deferredFile)(nil)
	_ fusefs.FileReleaser  = (*deferredFile)(nil)
	_ fusefs.FileAllocater = (*deferredFile)(nil)
	_ fusefs.FileLseeker   = (*deferredFile)(nil)
)

// openDeferred opens lower file n read-write without copying it up, if it
// is one copy-up by range would take; ok is false otherwise (and for a file
// copied up meanwhile), and the caller copies up as usual.
func (ov *overlay) openDeferred(ctx context.Context, n *node) (h fusefs.FileHandle, fl uint32, ok bool, errno syscall.Errno) {
	rel, relOK := n.rel()
	if !relOK {
		return nil, 0, false, 0
	}
	la, err := ov.lower.Stat(n.lower)
	if err != nil {
		return nil, 0, false, errnoOf(err)
	}
	if !ov.byRange(&la, rel) {
		return nil, 0, false, 0
	}
	n.mu.Lock()
	defer n.mu.Unlock()
	// Under the lock copy-up holds, as for a read-only lower open; and
	// not once the file's name is being removed (copyUpDeferred).
	if n.upper.Load() || n.noDefer {
		return nil, 0, false, 0
	}
	n.cachedOpens++
	n.writers++
	n.deferred++
	d := &deferredFile{n: n, pid: callerPid(ctx), lower: &lowerFile{n: n, up: upperRef{fd: -1}, size: la.Size}}
	return d, fuse.FOPEN_KEEP_CACHE | fuse.FOPEN_NOFLUSH, true, 0
}

// copyUpDeferred copies n up if a deferred read-write handle has it open
// and it is still only in the lower layer: called before its name goes
// (unlink, a rename over it), after which copy-up could not reach it.
func (ov *overlay) copyUpDeferred(ctx context.Context, n *node) error {
	if n == nil || n.upper.Load() {
		return nil
	}
	n.mu.Lock()
	open := n.deferred > 0
	if !open {
		// An open racing with the removal copies up at open.
		n.noDefer = true
	}
	n.mu.Unlock()
	if !open {
		return nil
	}
	return ov.copyUp(ctx, n, true)
}

// upper returns the handle's writable upper file: the file is copied up
// first when copy is set, else nil is returned while the file is only in
// the lower layer.
func (d *deferredFile) upper(ctx context.Context, copy bool) (*upperFile, syscall.Errno) {
	if up := d.up.Load(); up != nil {
		return up, 0
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if up := d.up.Load(); up != nil {
		return up, 0
	}
	n, ov := d.n, d.n.ov
	if !n.upper.Load() {
		if !copy {
			return nil, 0
		}
		if err := ov.copyUp(ctx, n, true); err != nil {
			ov.log.Warn("copy-up failed", "ino", n.ino, "err", err)
			return nil, errnoOf(err)
		}
	}
	fd, errno := n.openUpper(true)
	if errno != 0 {
		return nil, errno
	}
	st, err := statFd(fd)
	if err != nil {
		unix.Close(fd)
		return nil, errnoOf(err)
	}
	// The kernel was told at open: a cached handle, counted as a writer.
	up := &upperFile{n: n, fd: fd, uino: st.ino, writable: true, mode: modeCached, pid: d.pid}
	n.mu.Lock()
	n.deferred--
	n.mu.Unlock()
	d.up.Store(up)
	if p := ov.partials.get(st.ino, fd); p != nil {
		ov.partials.startCompletion(p, n)
	}
	return up, 0
}

func (d *deferredFile) Read(ctx context.Context, dest []byte, off int64) (fuse.ReadResult, syscall.Errno) {
	if up := d.up.Load(); up != nil {
		return up.Read(ctx, dest, off)
	}
	return d.lower.Read(ctx, dest, off)
}

func (d *deferredFile) Write(ctx context.Context, data []byte, off int64) (uint32, syscall.Errno) {
	if d.n.ov.opts.ReadOnly {
		return 0, syscall.EROFS
	}
	up, errno := d.upper(ctx, true)
	if errno != 0 {
		return 0, errno
	}
	return up.Write(ctx, data, off)
}

func (d *deferredFile) Allocate(ctx context.Context, off, size uint64, mode uint32) syscall.Errno {
	if d.n.ov.opts.ReadOnly {
		return syscall.EROFS
	}
	up, errno := d.upper(ctx, true)
	if errno != 0 {
		return errno
	}
	return up.Allocate(ctx, off, size, mode)
}

func (d *deferredFile) Fsync(ctx context.Context, flags uint32) syscall.Errno {
	up, errno := d.upper(ctx, false)
	if errno != 0 || up == nil {
		return errno
	}
	return up.Fsync(ctx, flags)
}

func (d *deferredFile) Lseek(ctx context.Context, off uint64, whence uint32) (uint64, syscall.Errno) {
	up, errno := d.upper(ctx, false)
	if errno != 0 {
		return 0, errno
	}
	if up != nil {
		return up.Lseek(ctx, off, whence)
	}
	return d.lower.Lseek(ctx, off, whence)
}

// statHandle reports the upper file once there is one; before, the node's
// own status (ENOSYS) is the lower file's.
func (d *deferredFile) statHandle(a *fuse.Attr) syscall.Errno {
	up := d.up.Load()
	if up == nil {
		return syscall.ENOSYS
	}
	return up.statHandle(a)
}

func (d *deferredFile) Release(ctx context.Context) syscall.Errno {
	d.lower.released.Store(true)
	d.lower.up.close()
	// The kernel sends no other request of the handle with or after
	// its release: no conversion can be under way.
	if up := d.up.Load(); up != nil {
		return up.Release(ctx)
	}
	n := d.n
	n.mu.Lock()
	n.cachedOpens--
	n.writers--
	n.deferred--
	n.mu.Unlock()
	return 0
}
