package fs

import (
	"context"
	"io"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"

	fusefs "github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"
	"golang.org/x/sys/unix"
)

// Open opens a regular file. Read-only opens of lower files read the
// archive and keep the kernel's page cache (the content never changes). Any
// open that may change the file copies it up first. A guarded path gets a
// staging handle (guard.go).
//
// Upper files are opened in one of three kernel I/O modes, chosen per
// node: passthrough for read-only opens when no daemon-served handle is
// open (the kernel then reads the upper file itself); daemon-served with
// the page cache otherwise; and, for an open that arrives while passthrough
// handles are open, passthrough with FOPEN_DIRECT_IO: the kernel insists on
// passthrough for every open of an inode in passthrough mode, and direct
// I/O makes it still send read(2) and write(2) to the daemon, where the
// freeze gate sees them (only mmap of such a handle goes to the file
// directly). Writes therefore always pass through the daemon.
func (n *node) Open(ctx context.Context, flags uint32) (fusefs.FileHandle, uint32, syscall.Errno) {
	ov := n.ov
	ov.partials.foreground()
	writable := flags&syscall.O_ACCMODE != syscall.O_RDONLY
	trunc := flags&syscall.O_TRUNC != 0
	if (writable || trunc) && (ov.opts.ReadOnly || ov.gate.sealed.Load()) {
		return nil, 0, syscall.EROFS
	}
	guardedPath := false
	// Taken before the upper file is opened: a commit after it makes the
	// handle open the file again (upperRef).
	replaced := n.replaced.Load()
	if ov.guard != nil {
		if rel, ok := n.rel(); ok && ov.guard.Guarded(rel) {
			if writable || trunc {
				return ov.openGuarded(ctx, n, rel, flags, 0)
			}
			guardedPath = true
		}
	}
	if !n.upper.Load() {
		if !writable && !trunc {
			la, err := ov.lower.Stat(n.lower)
			if err != nil {
				return nil, 0, errnoOf(err)
			}
			n.mu.Lock()
			// Checked again under the lock copy-up holds: an open of
			// the upper file may have chosen passthrough meanwhile,
			// and the kernel refuses a cached open beside it (EIO).
			lower := !n.upper.Load()
			if lower {
				n.cachedOpens++
				if !guardedPath {
					ov.fillOnOpen(n, la.Size)
				}
			}
			n.mu.Unlock()
			if lower {
				// No read-ahead at open: with the page cache kept
				// across opens, a file read before is served
				// without a READ, and decompressing it again would
				// only take CPU from readers. The first READ starts
				// the read-ahead; a small file is filled once
				// (lowerfill.go).
				h := &lowerFile{n: n, up: upperRef{fd: -1}, size: la.Size}
				return h, fuse.FOPEN_KEEP_CACHE | fuse.FOPEN_NOFLUSH, 0
			}
		}
	}
	if writable && !trunc && !guardedPath && !n.upper.Load() {
		h, fl, ok, errno := ov.openDeferred(ctx, n)
		if errno != 0 || ok {
			return h, fl, errno
		}
	}
	if !n.upper.Load() {
		if err := ov.copyUp(ctx, n, !trunc); err != nil {
			ov.log.Warn("copy-up failed", "ino", n.ino, "err", err)
			return nil, 0, errnoOf(err)
		}
	}
	fd, errno := n.openUpper(writable)
	if errno != 0 {
		return nil, 0, errno
	}
	if trunc {
		if errno := ov.truncateFd(n, fd, 0); errno != 0 {
			unix.Close(fd)
			return nil, 0, errno
		}
	}
	h, fl := ov.newUpperHandle(ctx, n, fd, writable, guardedPath)
	if guardedPath {
		// Read-only (a writable open is a guardFile): it follows commits.
		h.follow = &upperRef{fd: fd, gen: replaced}
	}
	return h, fl, 0
}

// openUpper opens n's upper file through its path.
func (n *node) openUpper(writable bool) (int, syscall.Errno) {
	mode := unix.O_RDONLY
	if writable {
		// Read access too, so a freeze can save the bytes a write
		// replaces.
		mode = unix.O_RDWR
	}
	p, name, ok := n.parent()
	if !ok {
		// No name any more: reopen the object itself if it was kept,
		// else have the kernel look the path up again (ESTALE makes
		// open(2) retry with revalidation).
		ofd := n.orphanFd()
		if ofd < 0 {
			return -1, syscall.ESTALE
		}
		fd, err := unix.Open("/proc/self/fd/"+strconv.Itoa(ofd), mode|unix.O_CLOEXEC, 0)
		if err == unix.EACCES && writable {
			fd, err = unix.Open("/proc/self/fd/"+strconv.Itoa(ofd), unix.O_WRONLY|unix.O_CLOEXEC, 0)
		}
		return fd, errnoOf(err)
	}
	pfd, _, err := p.dirFd(false)
	if err != nil {
		return -1, errnoOf(err)
	}
	defer n.ov.u.put(pfd)
	fd, err := unix.Openat(pfd, name, mode|unix.O_CLOEXEC|unix.O_NOFOLLOW, 0)
	if err == unix.EACCES && writable {
		fd, err = unix.Openat(pfd, name, unix.O_WRONLY|unix.O_CLOEXEC|unix.O_NOFOLLOW, 0)
	}
	if err != nil {
		return -1, errnoOf(err)
	}
	return fd, 0
}

// truncateFd truncates n's upper file open at fd to size, saving the bytes
// it drops for open views first.
func (ov *overlay) truncateFd(n *node, fd int, size int64) syscall.Errno {
	if !ov.gate.enter() {
		return errSealed
	}
	defer ov.gate.leave()
	if errno := ov.truncateGated(fd, size); errno != 0 {
		return errno
	}
	ov.changed(n.ino, 0)
	return 0
}

// truncateGated truncates upper file fd, saving for open views what the
// truncation removes first. The caller holds the gate.
func (ov *overlay) truncateGated(fd int, size int64) syscall.Errno {
	p := ov.partials.track(0, fd)
	if p != nil {
		p.wmu.RLock()
		defer p.wmu.RUnlock()
	}
	if ov.views.active() {
		st, err := statFd(fd)
		if err != nil {
			return errnoOf(err)
		}
		if err := ov.views.preserve(st.ino, fd, size, 1<<62); err != nil {
			ov.log.Error("freeze: saving truncated bytes failed", "err", err)
			return syscall.EIO
		}
	}
	if p != nil {
		// Lower bytes past the new size must never show again, even
		// if the file grows back: the map says so once the
		// truncation is durable.
		if err := p.truncate(fd, size); err != nil {
			ov.log.Error("partial copy-up: truncate failed", "err", err)
			return syscall.EIO
		}
		defer ov.partials.retire(p)
	}
	return errnoOf(unix.Ftruncate(fd, size))
}

// newUpperHandle wraps fd in a handle and picks its kernel I/O mode (see
// Open). A passthrough handle is attached to its backing file by the raw
// layer once go-fuse has registered the handle (passthrough.go); ctx
// carries the request identity that links the two.
func (ov *overlay) newUpperHandle(ctx context.Context, n *node, fd int, writable, noPassthrough bool) (*upperFile, uint32) {
	st, err := statFd(fd)
	if err != nil {
		// No passthrough without the file's status; the handle works.
		noPassthrough = true
	}
	h := &upperFile{n: n, fd: fd, uino: st.ino, writable: writable}
	var tracked *partial
	if err == nil {
		if p := ov.partials.get(st.ino, fd); p != nil {
			// The kernel would read its holes: daemon-served until
			// complete.
			noPassthrough = true
			ov.partials.noteNameFd(p, fd)
			ov.partials.startCompletion(p, n)
		}
		if writable {
			// Its changes are recorded as the daemon makes them
			// (partial_changes.go): its writes must reach the daemon.
			if tracked = ov.partials.track(st.ino, fd); tracked != nil {
				noPassthrough = true
			}
		}
	}
	fc, _ := ctx.(*fuse.Context)
	if fc != nil {
		h.pid = fc.Caller.Pid
	}
	n.mu.Lock()
	defer n.mu.Unlock()
	if writable {
		n.writers++
	}
	// Writable passthrough (ptwrite.go): the kernel writes the upper file
	// itself; read-only passthrough for files of PassthroughMinSize on.
	passthrough := fc != nil && !noPassthrough && n.cachedOpens == 0 &&
		(writable && ov.grantWrite(n, h, &st) ||
			!writable && st.size >= ov.opts.PassthroughMinSize && ov.passthrough.Load())
	switch {
	case passthrough:
		if n.ptOpens == 0 {
			n.cacheStale = true
		}
		n.ptOpens++
		h.mode = modePassthrough
		ov.pendingPT.Store(fc.Cancel, h)
		return h, fuse.FOPEN_NOFLUSH
	case fc != nil && n.ptOpens > 0:
		// Its mmap reaches the backing file: a writable one is the
		// node's, which freezes copy whole (ptwrite.go).
		if tracked != nil {
			if err := ov.partials.giveUp(tracked); err != nil {
				ov.log.Error("partial copy-up: recording a writable passthrough open failed", "err", err)
			}
		}
		n.ptOpens++
		if n.ptWrite {
			ov.ptw.join(n, h.pid)
		}
		h.mode = modePassthrough
		ov.pendingPT.Store(fc.Cancel, h)
		return h, fuse.FOPEN_DIRECT_IO | fuse.FOPEN_NOFLUSH
	default:
		n.cachedOpens++
		h.mode = modeCached
		// Nothing to do at close(2): FLUSH would be a round trip per
		// close for nothing.
		var fl uint32 = fuse.FOPEN_KEEP_CACHE | fuse.FOPEN_NOFLUSH
		if n.cacheStale {
			fl &^= fuse.FOPEN_KEEP_CACHE
			n.cacheStale = false
		}
		return h, fl
	}
}

type ioMode int

const (
	modeCached ioMode = iota
	modePassthrough
)

// upperFile is an open upper-layer file served by the daemon (and, in
// passthrough mode, read by the kernel directly).
type upperFile struct {
	n        *node
	fd       int
	uino     uint64 // upper inode number, for the freeze's byte saving
	writable bool
	mode     ioMode // guarded by n.mu
	attached bool   // holds a reference on n's backing file; guarded by n.mu
	pid      uint32 // the process (thread) that opened it
	// follow, for a read-only open of a guarded file, holds the upper
	// file it reads: a commit replaces the file, not its bytes. It owns
	// fd then.
	follow *upperRef
}

var (
	_ fusefs.FileReader    = (*upperFile)(nil)
	_ fusefs.FileWriter    = (*upperFile)(nil)
	_ fusefs.FileFsyncer   = (*upperFile)(nil)
	_ fusefs.FileReleaser  = (*upperFile)(nil)
	_ fusefs.FileAllocater = (*upperFile)(nil)
	_ fusefs.FileLseeker   = (*upperFile)(nil)
)

func (h *upperFile) Read(ctx context.Context, dest []byte, off int64) (fuse.ReadResult, syscall.Errno) {
	h.n.ov.partials.foreground()
	if h.follow != nil {
		return h.follow.read(h.n, dest, off)
	}
	if p := h.n.ov.partials.get(h.uino, h.fd); p != nil {
		return p.fuseRead(h.fd, dest, off)
	}
	return fuse.ReadResultFd(uintptr(h.fd), off, len(dest)), 0
}

func (h *upperFile) Write(ctx context.Context, data []byte, off int64) (uint32, syscall.Errno) {
	ov := h.n.ov
	if ov.opts.ReadOnly {
		return 0, syscall.EROFS
	}
	ov.partials.foreground()
	if !ov.gate.enter() {
		return 0, errSealed
	}
	defer ov.gate.leave()
	if p := ov.partials.track(h.uino, h.fd); p != nil {
		p.wmu.RLock()
		defer p.wmu.RUnlock()
		if err := p.ensure(h.fd, off, off+int64(len(data))); err != nil {
			ov.log.Error("partial copy-up: copying in blocks before a write failed", "err", err)
			return 0, syscall.EIO
		}
		if err := p.noteChange(off, off+int64(len(data))); err != nil {
			ov.log.Error("partial copy-up: recording a write failed", "err", err)
			return 0, syscall.EIO
		}
	}
	if ov.views.active() {
		if err := ov.views.preserve(h.uino, h.fd, off, off+int64(len(data))); err != nil {
			ov.log.Error("freeze: saving overwritten bytes failed", "err", err)
			return 0, syscall.EIO
		}
	}
	k, err := unix.Pwrite(h.fd, data, off)
	if k > 0 {
		ov.changed(h.n.ino, int64(k))
	}
	if err != nil {
		return uint32(max(k, 0)), errnoOf(err)
	}
	return uint32(k), 0
}

func (h *upperFile) Allocate(ctx context.Context, off, size uint64, mode uint32) syscall.Errno {
	ov := h.n.ov
	if ov.opts.ReadOnly {
		return syscall.EROFS
	}
	if !ov.gate.enter() {
		return errSealed
	}
	defer ov.gate.leave()
	if p := ov.partials.track(h.uino, h.fd); p != nil {
		p.wmu.RLock()
		defer p.wmu.RUnlock()
		var err error
		switch {
		case mode&(unix.FALLOC_FL_COLLAPSE_RANGE|unix.FALLOC_FL_INSERT_RANGE) != 0:
			// Bytes move between offsets: every block first.
			err = p.ensureAll(h.fd)
			if err == nil {
				err = p.noteCut(int64(off))
			}
		case mode&^unix.FALLOC_FL_KEEP_SIZE != 0:
			// Punching, zeroing (and anything else than allocating,
			// which changes no byte: past the end is changed anyway).
			err = p.ensure(h.fd, int64(off), int64(off+size))
			if err == nil {
				err = p.noteChange(int64(off), int64(off+size))
			}
		}
		if err != nil {
			ov.log.Error("partial copy-up: copying in blocks before fallocate failed", "err", err)
			return syscall.EIO
		}
	}
	if ov.views.active() {
		// Punching, zeroing, collapsing or inserting changes bytes:
		// save what the view may still read. Any mode may change the
		// size or times: keep them.
		end := int64(off)
		if mode&^unix.FALLOC_FL_KEEP_SIZE != 0 {
			end = int64(off + size)
		}
		if mode&(unix.FALLOC_FL_COLLAPSE_RANGE|unix.FALLOC_FL_INSERT_RANGE) != 0 {
			end = 1 << 62
		}
		if err := ov.views.preserve(h.uino, h.fd, int64(off), end); err != nil {
			return syscall.EIO
		}
	}
	if err := unix.Fallocate(h.fd, mode, int64(off), int64(size)); err != nil {
		return errnoOf(err)
	}
	ov.changed(h.n.ino, 0)
	return 0
}

func (h *upperFile) Lseek(ctx context.Context, off uint64, whence uint32) (uint64, syscall.Errno) {
	if h.follow != nil {
		var pos int64
		errno := h.follow.with(h.n, func(fd int) (err error) {
			pos, err = unix.Seek(fd, int64(off), int(whence))
			return err
		})
		return uint64(pos), errno
	}
	if p := h.n.ov.partials.get(h.uino, h.fd); p != nil {
		// Lower content has no holes: report none until complete.
		st, err := statFd(h.fd)
		if err != nil {
			return 0, errnoOf(err)
		}
		return seekNoHoles(off, whence, uint64(st.size))
	}
	n, err := unix.Seek(h.fd, int64(off), int(whence))
	return uint64(n), errnoOf(err)
}

func (h *upperFile) Fsync(ctx context.Context, flags uint32) syscall.Errno {
	h.n.ov.partials.foreground()
	if p := h.n.ov.partials.get(h.uino, h.fd); p != nil {
		if err := p.flush(h.fd); err != nil {
			h.n.ov.log.Error("partial copy-up: sync failed", "err", err)
			return syscall.EIO
		}
	}
	if flags&fsyncDatasync != 0 {
		return errnoOf(unix.Fdatasync(h.fd))
	}
	return errnoOf(unix.Fsync(h.fd))
}

func (h *upperFile) Release(ctx context.Context) syscall.Errno {
	n := h.n
	n.mu.Lock()
	if h.writable {
		n.writers--
	}
	if h.mode == modePassthrough {
		n.ov.ptClosed(n)
	} else {
		n.cachedOpens--
	}
	if h.attached {
		h.n.ov.detachBacking(n)
		h.attached = false
	}
	n.mu.Unlock()
	if h.follow != nil {
		h.follow.close()
	} else {
		unix.Close(h.fd)
	}
	return 0
}

func (h *upperFile) statHandle(a *fuse.Attr) syscall.Errno {
	var st ustat
	stat := func(fd int) (err error) {
		st, err = statFd(fd)
		return err
	}
	var errno syscall.Errno
	if h.follow != nil {
		errno = h.follow.with(h.n, stat)
	} else {
		errno = errnoOf(stat(h.fd))
	}
	if errno != 0 {
		return errno
	}
	h.n.fillUpperAttr(a, &st)
	return 0
}

// lowerFile is a read-only open of a lower file. If the file is copied up
// while it is open (another open writes it), reads follow it to the upper
// layer: the open file is the same inode and must see its new content.
type lowerFile struct {
	n    *node
	size int64 // of the lower file
	// up is the upper file once the node has one (copy-up by another
	// open, a guarded commit).
	up upperRef
	// nextOff is where the last read ended; a read starting there is
	// sequential and has what comes after it decompressed ahead.
	nextOff atomic.Int64
	// ahead is where read-ahead has been started up to (lowerread.go).
	ahead atomic.Int64
	// released: the kernel closed the handle; its read-ahead stops.
	released atomic.Bool
}

var (
	_ fusefs.FileReader   = (*lowerFile)(nil)
	_ fusefs.FileReleaser = (*lowerFile)(nil)
	_ fusefs.FileLseeker  = (*lowerFile)(nil)
)

func (h *lowerFile) Read(ctx context.Context, dest []byte, off int64) (fuse.ReadResult, syscall.Errno) {
	n := h.n
	n.ov.partials.foreground()
	if n.upper.Load() {
		// Reads follow the file to the upper layer, unless it cannot be
		// reached there any more.
		res, errno := h.up.read(n, dest, off)
		if errno != syscall.ENOENT && errno != syscall.ESTALE {
			return res, errno
		}
	}
	k, err := n.ov.readLower(n.lower, dest, off)
	if err != nil && err != io.EOF {
		n.ov.log.Error("lower read failed", "ino", n.lower, "off", off, "err", err)
		return nil, syscall.EIO
	}
	end := off + int64(k)
	if h.nextOff.Swap(end) == off && err == nil && k == len(dest) {
		h.readAhead(end, int64(len(dest)))
	}
	return fuse.ReadResultData(dest[:k]), 0
}

func (h *lowerFile) Lseek(ctx context.Context, off uint64, whence uint32) (uint64, syscall.Errno) {
	// Lower files have no holes: data everywhere up to the size.
	var a fuse.Attr
	if errno := h.n.stat(nil, &a); errno != 0 {
		return 0, errno
	}
	return seekNoHoles(off, whence, a.Size)
}

// seekNoHoles answers SEEK_DATA and SEEK_HOLE for a file of size bytes
// without holes.
func seekNoHoles(off uint64, whence uint32, size uint64) (uint64, syscall.Errno) {
	switch whence {
	case unix.SEEK_DATA:
		if off >= size {
			return 0, syscall.ENXIO
		}
		return off, 0
	case unix.SEEK_HOLE:
		if off > size {
			return 0, syscall.ENXIO
		}
		return size, 0
	}
	return 0, syscall.EINVAL
}

func (h *lowerFile) Release(ctx context.Context) syscall.Errno {
	h.released.Store(true)
	h.up.close()
	h.n.mu.Lock()
	h.n.cachedOpens--
	h.n.mu.Unlock()
	return 0
}

// Create makes a new file in the upper layer and opens it.
func (n *node) Create(ctx context.Context, name string, flags uint32, mode uint32, out *fuse.EntryOut) (*fusefs.Inode, fusefs.FileHandle, uint32, syscall.Errno) {
	if n.ov.opts.ReadOnly {
		return nil, nil, 0, syscall.EROFS
	}
	if errno := checkNewName(name); errno != 0 {
		return nil, nil, 0, errno
	}
	ov := n.ov
	guardedPath := ov.guarded(n, name)
	dfd, drel, errno := n.prepDir(ctx)
	if errno != 0 {
		return nil, nil, 0, errno
	}
	defer ov.u.put(dfd)

	if !ov.gate.enter() {
		return nil, nil, 0, errSealed
	}
	e, err := ov.resolve(n, dfd, name)
	if err != nil {
		ov.gate.leave()
		return nil, nil, 0, errnoOf(err)
	}
	if e.exists() {
		ov.gate.leave()
		return nil, nil, 0, syscall.EEXIST
	}
	if err := ov.keepDir(dfd); err != nil {
		ov.gate.leave()
		return nil, nil, 0, errnoOf(err)
	}
	fd, err := unix.Openat(dfd, name, unix.O_CREAT|unix.O_EXCL|unix.O_RDWR|unix.O_CLOEXEC|unix.O_NOFOLLOW, mode&07777)
	if err == nil {
		err = ov.u.fixMode(dfd, name, mode&07777, fd)
		if err == nil {
			err = ov.own(ctx, dfd, name, fd)
		}
		if err != nil {
			unix.Close(fd)
			unix.Unlinkat(dfd, name, 0)
		}
	}
	if err == nil {
		ov.bornAt(fd, "")
	}
	ov.gate.leave()
	if err != nil {
		return nil, nil, 0, errnoOf(err)
	}
	ch, errno := n.newUpperChild(ctx, dfd, name, 0, out)
	if errno != 0 {
		unix.Close(fd)
		return nil, nil, 0, errno
	}
	cn := ch.Operations().(*node)
	if guardedPath {
		var created uint64 = 1
		if st, err := statFd(fd); err == nil {
			created = st.ino
		}
		unix.Close(fd)
		h, fl, errno := ov.openGuarded(ctx, cn, joinRel(drel, name), flags, created)
		return ch, h, fl, errno
	}
	h, fl := ov.newUpperHandle(ctx, cn, fd, flags&syscall.O_ACCMODE != syscall.O_RDONLY, false)
	return ch, h, fl, 0
}

// fsyncDatasync is FUSE_FSYNC_FDATASYNC: fsync_flags bit 0.
const fsyncDatasync = 1

// upperRef is the upper file a read handle reads when that file can be
// replaced under it: a guarded commit renames a new file over the node's,
// and a reader opened before must read the new content, as one does on a
// disk where the file is written in place. It opens the current file again
// once n.replaced moved, and closes the one it replaced: its reads copy
// (pread) rather than splice, so no reply still refers to a descriptor
// once the call that used it returned.
type upperRef struct {
	mu  sync.RWMutex
	fd  int    // -1 until opened
	gen uint32 // n.replaced when fd was opened
}

// with runs fn on a descriptor of n's current upper file.
func (r *upperRef) with(n *node, fn func(fd int) error) syscall.Errno {
	gen := n.replaced.Load()
	r.mu.RLock()
	if r.fd >= 0 && r.gen == gen {
		defer r.mu.RUnlock()
		return errnoOf(fn(r.fd))
	}
	r.mu.RUnlock()
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.fd < 0 || r.gen != gen {
		fd, errno := n.openUpper(false)
		switch {
		case errno == 0:
			if r.fd >= 0 {
				unix.Close(r.fd)
			}
			r.fd, r.gen = fd, gen
		case r.fd >= 0:
			// Gone (unlinked) since: the file this handle had is
			// still the one it reads.
			r.gen = gen
		default:
			return errno
		}
	}
	return errnoOf(fn(r.fd))
}

// read reads n's current upper file (merged, if it is a partial copy-up).
func (r *upperRef) read(n *node, dest []byte, off int64) (fuse.ReadResult, syscall.Errno) {
	var k int
	errno := r.with(n, func(fd int) error {
		var err error
		if p := n.ov.partials.get(0, fd); p != nil {
			k, err = p.readAt(fd, dest, off)
		} else {
			k, err = preadFull(fd, dest, off)
		}
		return err
	})
	if errno != 0 {
		return nil, errno
	}
	return fuse.ReadResultData(dest[:k]), 0
}

func (r *upperRef) close() {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.fd >= 0 {
		unix.Close(r.fd)
	}
	r.fd = -1
}
