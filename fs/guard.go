package fs

import (
	"context"
	"errors"
	"io"
	"sync"
	"syscall"

	fusefs "github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"
	"golang.org/x/sys/unix"

	"github.com/hermesfs/hermesfs/archive"
)

// GuardedBelower is optionally implemented by a Guard to spare the overlay
// a walk: when a directory moves to rel, the overlay asks whether any path
// below rel may be guarded, and if not skips checking each file the
// directory brings.
type GuardedBelower interface {
	GuardedBelow(rel string) bool
}

// check asks the Guard about a new content and maps its verdict to an
// errno. The FUSE request's context is cancelled by any signal to the
// caller; the Guard gets one that is not, so its audit append completes.
func (ov *overlay) check(ctx context.Context, rel string, old, new []byte, pid uint32) syscall.Errno {
	err := ov.guard.Check(context.WithoutCancel(ctx), rel, old, new, pid)
	switch {
	case err == nil:
		return 0
	case errors.Is(err, syscall.EFBIG):
		return syscall.EFBIG
	case errors.Is(err, syscall.EPERM):
		return syscall.EPERM
	default:
		ov.log.Error("guard check failed", "path", rel, "err", err)
		return syscall.EIO
	}
}

// readContent reads the merged content of regular file n, refusing more
// than GuardMaxBytes.
func (ov *overlay) readContent(n *node) ([]byte, syscall.Errno) {
	if !n.upper.Load() {
		la, err := ov.lower.Stat(n.lower)
		if err != nil {
			return nil, errnoOf(err)
		}
		if la.Size > ov.opts.GuardMaxBytes {
			return nil, syscall.EFBIG
		}
		buf := make([]byte, la.Size)
		k, err := ov.lower.ReadAt(n.lower, buf, 0)
		if err != nil && err != io.EOF {
			return nil, errnoOf(err)
		}
		return buf[:k], 0
	}
	fd, errno := n.openUpper(false)
	if errno != 0 {
		return nil, errno
	}
	defer unix.Close(fd)
	return ov.readFd(fd)
}

func (ov *overlay) readFd(fd int) ([]byte, syscall.Errno) {
	st, err := statFd(fd)
	if err != nil {
		return nil, errnoOf(err)
	}
	if st.size > ov.opts.GuardMaxBytes {
		return nil, syscall.EFBIG
	}
	buf := make([]byte, st.size)
	k, err := preadFull(fd, buf, 0)
	if err != nil {
		return nil, errnoOf(err)
	}
	return buf[:k], 0
}

func preadFull(fd int, buf []byte, off int64) (int, error) {
	done := 0
	for done < len(buf) {
		k, err := unix.Pread(fd, buf[done:], off+int64(done))
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			return done, err
		}
		if k == 0 {
			break
		}
		done += k
	}
	return done, nil
}

// checkTruncate checks truncate(2) of guarded file n to size.
func (ov *overlay) checkTruncate(ctx context.Context, n *node, rel string, size int64) syscall.Errno {
	if size > ov.opts.GuardMaxBytes {
		return syscall.EFBIG
	}
	old, errno := ov.readContent(n)
	if errno != 0 {
		return errno
	}
	next := make([]byte, size)
	copy(next, old)
	return ov.check(ctx, rel, old, next, callerPid(ctx))
}

// checkRenameGuard checks a rename that would put src (and, for an
// exchange, dst) at a guarded path.
func (ov *overlay) checkRenameGuard(ctx context.Context, src, np *node, newName string, dst *node, exchange bool) syscall.Errno {
	if ov.guard == nil {
		return 0
	}
	drel, ok := np.rel()
	if !ok {
		return syscall.ENOENT
	}
	pid := callerPid(ctx)
	if errno := ov.checkMove(ctx, src, joinRel(drel, newName), dst, pid); errno != 0 {
		return errno
	}
	if exchange && dst != nil {
		srel, ok := src.rel()
		if !ok {
			return syscall.ENOENT
		}
		return ov.checkMove(ctx, dst, srel, src, pid)
	}
	return 0
}

// checkMove checks object s appearing at path to, replacing r (nil: none).
func (ov *overlay) checkMove(ctx context.Context, s *node, to string, r *node, pid uint32) syscall.Errno {
	if s.isDir() {
		if gb, ok := ov.guard.(GuardedBelower); ok && !gb.GuardedBelow(to) {
			return 0
		}
		return ov.checkTree(ctx, s, to, pid)
	}
	if !ov.guard.Guarded(to) {
		return 0
	}
	if s.kind != syscall.S_IFREG {
		return syscall.EPERM
	}
	var a fuse.Attr
	if errno := s.stat(nil, &a); errno != 0 {
		return errno
	}
	if a.Nlink > 1 {
		return syscall.EPERM
	}
	next, errno := ov.readContent(s)
	if errno != 0 {
		return errno
	}
	var old []byte
	if r != nil && r.kind == syscall.S_IFREG {
		if old, errno = ov.readContent(r); errno != 0 {
			return errno
		}
	}
	return ov.check(ctx, to, old, next, pid)
}

// checkTree checks every file of directory d as if it sat below path to.
func (ov *overlay) checkTree(ctx context.Context, d *node, to string, pid uint32) syscall.Errno {
	rel, ok := d.rel()
	if !ok {
		return syscall.ENOENT
	}
	var walk func(upperRel string, upper bool, lower archive.Inode, dest string) syscall.Errno
	walk = func(upperRel string, hasUpper bool, lower archive.Inode, dest string) syscall.Errno {
		tmp := &node{ov: ov, kind: syscall.S_IFDIR, lower: lower}
		tmp.upper.Store(hasUpper)
		ents, err := ov.listAt(tmp, upperRel)
		if err != nil {
			return errnoOf(err)
		}
		for _, e := range ents {
			p := joinRel(dest, e.name)
			if e.mode == syscall.S_IFDIR {
				if errno := walk(joinRel(upperRel, e.name), e.upper, e.lower, p); errno != 0 {
					return errno
				}
				continue
			}
			if !ov.guard.Guarded(p) {
				continue
			}
			if e.mode != syscall.S_IFREG {
				return syscall.EPERM
			}
			var content []byte
			var errno syscall.Errno
			if e.upper {
				fd, err := ov.u.dir(upperRel)
				if err != nil {
					return errnoOf(err)
				}
				ffd, err := unix.Openat(fd, e.name, unix.O_RDONLY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
				ov.u.put(fd)
				if err != nil {
					return errnoOf(err)
				}
				content, errno = ov.readFd(ffd)
				unix.Close(ffd)
			} else {
				ln := &node{ov: ov, kind: syscall.S_IFREG, lower: e.lower}
				content, errno = ov.readContent(ln)
			}
			if errno != 0 {
				return errno
			}
			if errno := ov.check(ctx, p, nil, content, pid); errno != 0 {
				return errno
			}
		}
		return 0
	}
	return walk(rel, d.upper.Load(), d.lower, to)
}

// openGuarded opens guarded file n for writing: the handle stages the
// content privately and commits it at close if the Guard accepts it.
//
// created is the upper inode number of the file when this open created it
// (0 otherwise): if its first content is refused, the file goes again.
func (ov *overlay) openGuarded(ctx context.Context, n *node, rel string, flags uint32, created uint64) (fusefs.FileHandle, uint32, syscall.Errno) {
	g := &guardFile{
		n:          n,
		ov:         ov,
		rel:        rel,
		pid:        callerPid(ctx),
		appendMode: flags&syscall.O_APPEND != 0,
		stage:      -1,
		liftAt:     -1,
		existed:    created == 0,
		createdIno: created,
	}
	if flags&syscall.O_TRUNC != 0 {
		if errno := g.restage(false); errno != 0 {
			return nil, 0, errno
		}
		g.dirty = true
	}
	n.mu.Lock()
	if n.ptOpens > 0 {
		n.mu.Unlock()
		g.discard()
		return nil, 0, syscall.EBUSY
	}
	n.writers++
	n.mu.Unlock()
	// Direct I/O: every read and write reaches the staging file; the page
	// cache and shared mmap cannot go around it.
	return g, fuse.FOPEN_DIRECT_IO, 0
}

// guardFile is a writable handle of a guarded file. Writes go to a staging
// file in the work directory (a copy of the committed content, made at the
// first write); reads see the staged bytes. At flush (close(2)) the staged
// content is handed to Guard.Check: accepted, it replaces the file in one
// rename; rejected, it is dropped and close fails with the Guard's errno.
type guardFile struct {
	n          *node
	ov         *overlay
	rel        string
	pid        uint32
	appendMode bool

	mu        sync.Mutex
	stage     int // staging file descriptor, -1 when not staged
	stageName string
	dirty     bool // staged content not yet committed
	written   bool // dirty by a write, not only by O_TRUNC
	existed   bool // the file existed before this handle (else Check gets old == nil)
	// createdIno is the upper inode this handle created empty, until a
	// content is committed; a refused first content removes it.
	createdIno uint64
	// refused is the content a write refused by the GuardWriteChecker
	// would have made, and refusedErrno its errno: the handle then
	// commits nothing, and its close judges (and audits) refused instead.
	refused      []byte
	refusedErrno syscall.Errno
	// liftAt is the staged size before an append refused for its content
	// (-1 for any other refusal): a truncation through the handle to at
	// most that size takes away everything the refused append would have
	// added, and with it the refusal.
	liftAt int64
}

var (
	_ fusefs.FileReader    = (*guardFile)(nil)
	_ fusefs.FileWriter    = (*guardFile)(nil)
	_ fusefs.FileFlusher   = (*guardFile)(nil)
	_ fusefs.FileReleaser  = (*guardFile)(nil)
	_ fusefs.FileFsyncer   = (*guardFile)(nil)
	_ fusefs.FileAllocater = (*guardFile)(nil)
)

// restage starts a new staging file, a copy of the committed content
// unless empty.
func (g *guardFile) restage(copyContent bool) syscall.Errno {
	ov := g.ov
	name := ov.u.tmpName()
	fd, err := unix.Openat(ov.u.work, name, unix.O_CREAT|unix.O_EXCL|unix.O_RDWR|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return errnoOf(err)
	}
	if copyContent {
		content, errno := ov.readContent(g.n)
		if errno == syscall.ENOENT {
			content, errno = nil, 0
		}
		if errno == 0 {
			errno = errnoOf(pwriteAll(fd, content, 0))
		}
		if errno != 0 {
			unix.Close(fd)
			unix.Unlinkat(ov.u.work, name, 0)
			return errno
		}
	}
	g.stage, g.stageName = fd, name
	return 0
}

// discard drops the staged content.
func (g *guardFile) discard() {
	if g.stage >= 0 {
		unix.Close(g.stage)
		unix.Unlinkat(g.ov.u.work, g.stageName, 0)
		g.stage, g.stageName = -1, ""
	}
	g.dirty, g.written = false, false
	g.refused, g.refusedErrno, g.liftAt = nil, 0, -1
}

func (g *guardFile) Read(ctx context.Context, dest []byte, off int64) (fuse.ReadResult, syscall.Errno) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.stage < 0 {
		if errno := g.restage(true); errno != 0 {
			return nil, errno
		}
	}
	k, err := preadFull(g.stage, dest, off)
	if err != nil {
		return nil, errnoOf(err)
	}
	return fuse.ReadResultData(dest[:k]), 0
}

func (g *guardFile) Write(ctx context.Context, data []byte, off int64) (uint32, syscall.Errno) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.stage < 0 {
		if errno := g.restage(true); errno != 0 {
			return 0, errno
		}
	}
	if g.appendMode {
		st, err := statFd(g.stage)
		if err != nil {
			return 0, errnoOf(err)
		}
		off = st.size
	}
	if off+int64(len(data)) > g.ov.opts.GuardMaxBytes {
		return 0, g.ov.refused(ctx, g.rel, syscall.EFBIG, "write past the overlay's cap on a memory file (GuardMaxBytes)")
	}
	errno := g.checkWrite(g.appendMode, off, func(cur []byte) []byte {
		if end := off + int64(len(data)); end > int64(len(cur)) {
			cur = append(cur, make([]byte, end-int64(len(cur)))...)
		}
		copy(cur[off:], data)
		return cur
	})
	switch errno {
	case 0:
	case syscall.EFBIG:
		return 0, g.ov.refused(ctx, g.rel, errno, "the write takes the memory file past its limit (its close fails too)")
	case syscall.EPERM:
		return 0, g.ov.refused(ctx, g.rel, errno, "the write appends content that is refused whatever follows (its close fails too)")
	default:
		return 0, errno
	}
	if err := pwriteAll(g.stage, data, off); err != nil {
		return 0, errnoOf(err)
	}
	g.dirty, g.written = true, true
	return uint32(len(data)), 0
}

func (g *guardFile) truncate(size int64) syscall.Errno {
	g.mu.Lock()
	defer g.mu.Unlock()
	if size > g.ov.opts.GuardMaxBytes {
		return syscall.EFBIG
	}
	if g.stage < 0 {
		if errno := g.restage(size > 0); errno != 0 {
			return errno
		}
	}
	if g.refused != nil && g.liftAt >= 0 && size <= g.liftAt {
		// What the refused append would have added is cut away: the
		// handle goes on as if that append had succeeded.
		g.refused, g.refusedErrno, g.liftAt = nil, 0, -1
	}
	if errno := g.checkWrite(false, 0, func(cur []byte) []byte {
		if size <= int64(len(cur)) {
			return cur[:size]
		}
		return append(cur, make([]byte, size-int64(len(cur)))...)
	}); errno != 0 {
		return errno
	}
	if err := unix.Ftruncate(g.stage, size); err != nil {
		return errnoOf(err)
	}
	g.dirty, g.written = true, true
	return 0
}

func (g *guardFile) Allocate(ctx context.Context, off, size uint64, mode uint32) syscall.Errno {
	g.mu.Lock()
	defer g.mu.Unlock()
	if int64(off+size) > g.ov.opts.GuardMaxBytes && mode&unix.FALLOC_FL_KEEP_SIZE == 0 {
		return syscall.EFBIG
	}
	if g.stage < 0 {
		if errno := g.restage(true); errno != 0 {
			return errno
		}
	}
	if err := unix.Fallocate(g.stage, mode, int64(off), int64(size)); err != nil {
		return errnoOf(err)
	}
	g.dirty, g.written = true, true
	return 0
}

// checkWrite asks a GuardWriteChecker about the staged content as change
// would make it; appendOnly as GuardWriteChecker says, and an append starts
// at off. The stage is open. A refusal poisons the handle: nothing it
// staged is committed, and its close reports the refusal again, unless a
// truncation lifts it (liftAt).
func (g *guardFile) checkWrite(appendOnly bool, off int64, change func([]byte) []byte) syscall.Errno {
	wc, ok := g.ov.guard.(GuardWriteChecker)
	if !ok {
		return 0
	}
	cur, errno := g.ov.readFd(g.stage)
	if errno != 0 {
		return errno
	}
	var old []byte
	if g.existed {
		if old, errno = g.ov.readContent(g.n); errno == syscall.ENOENT {
			old, errno = nil, 0
		}
		if errno != 0 {
			return errno
		}
	}
	next := change(cur)
	err := wc.CheckWrite(g.rel, old, next, appendOnly)
	switch {
	case err == nil:
		return 0
	case errors.Is(err, syscall.EFBIG):
		errno = syscall.EFBIG
	case errors.Is(err, syscall.EPERM):
		errno = syscall.EPERM
	default:
		g.ov.log.Error("guard write check failed", "path", g.rel, "err", err)
		return syscall.EIO
	}
	switch {
	case !appendOnly || errno != syscall.EPERM:
		g.liftAt = -1
	case g.refused == nil:
		g.liftAt = off
	}
	g.refused, g.refusedErrno = next, errno
	g.dirty, g.written = true, true
	return errno
}

// Fsync has nothing durable to do: staged bytes become the file only at
// close, and the commit is synced then.
func (g *guardFile) Fsync(ctx context.Context, flags uint32) syscall.Errno { return 0 }

// Flush commits the staged content; close(2) returns the verdict. Every
// close of a dup'd descriptor flushes, so a flush commits only content that
// was written: a shell redirect (open with O_TRUNC, dup2, close, write,
// exit) must not commit the empty file its first close sees. An open with
// O_TRUNC and no write at all is committed at release, whose verdict has no
// caller to go to (it is logged).
func (g *guardFile) Flush(ctx context.Context) syscall.Errno {
	g.mu.Lock()
	defer g.mu.Unlock()
	if !g.dirty || !g.written {
		return 0
	}
	return g.commit(ctx)
}

func (g *guardFile) commit(ctx context.Context) syscall.Errno {
	ov, n := g.ov, g.n
	if g.stage < 0 {
		if errno := g.restage(false); errno != 0 {
			return errno
		}
	}
	next, errno := ov.readFd(g.stage)
	if errno != 0 {
		g.discard()
		return errno
	}
	var old []byte
	if g.existed {
		if old, errno = ov.readContent(n); errno == syscall.ENOENT {
			old, errno = nil, 0
		}
		if errno != 0 {
			g.discard()
			return errno
		}
	}
	if g.refused != nil {
		// A write was refused: judge and audit what the writer asked for,
		// and commit none of what it staged around the refusal.
		errno := ov.check(ctx, g.rel, old, g.refused, g.pid)
		if errno == 0 {
			errno = g.refusedErrno
		}
		g.discard()
		g.removeCreated()
		return errno
	}
	if errno := ov.check(ctx, g.rel, old, next, g.pid); errno != 0 {
		g.discard()
		g.removeCreated()
		return errno
	}

	p, name, ok := n.parent()
	if !ok {
		// Deleted while open: nothing to replace.
		g.discard()
		return 0
	}
	if err := ov.copyUpDir(ctx, p); err != nil {
		g.discard()
		return errnoOf(err)
	}
	pfd, _, err := p.dirFd(false)
	if err != nil {
		g.discard()
		return errnoOf(err)
	}
	defer ov.u.put(pfd)

	// The new version takes the old one's mode, owner, and st_ino.
	var a fuse.Attr
	if errno := n.stat(nil, &a); errno == 0 {
		unix.Fchmod(g.stage, a.Mode&07777)
		if ov.u.privileged {
			unix.Fchown(g.stage, int(a.Uid), int(a.Gid))
		}
	}
	if err := unix.Fsync(g.stage); err != nil {
		g.discard()
		return errnoOf(err)
	}
	st, err := statFd(g.stage)
	if err == nil {
		err = ov.inos.put(st.ino, inoRec{btime: st.btime, ino: n.ino, gen: n.StableAttr().Gen})
	}
	if err != nil {
		g.discard()
		return errnoOf(err)
	}

	if !ov.gate.enter() {
		g.discard()
		return errSealed
	}
	err = ov.keepDir(pfd)
	if err == nil && ov.views.active() {
		if ust, serr := statxAt(pfd, name); serr == nil {
			err = ov.views.beforeDestroy(pfd, name, &ust)
		}
	}
	if err == nil {
		err = unix.Renameat(ov.u.work, g.stageName, pfd, name)
	}
	if err == nil {
		err = fsyncDir(pfd)
	}
	if err == nil {
		n.upper.Store(true)
		n.replaced.Add(1)
		ov.born(st.ino)
		ov.changed(n.ino, st.size)
	}
	ov.gate.leave()
	if err != nil {
		g.discard()
		return errnoOf(err)
	}
	unix.Close(g.stage)
	g.stage, g.stageName, g.dirty, g.written, g.existed, g.createdIno = -1, "", false, false, true, 0

	n.mu.Lock()
	n.cacheStale = true
	n.mu.Unlock()
	// Readers holding the page cache of the old version must drop it; the
	// kernel cannot take the notification while it waits for this reply.
	go n.NotifyContent(0, 0)
	return 0
}

// removeCreated takes away the empty file this handle created, once its
// first content is refused: a refused creation leaves no file. The kernel is
// told before the refusal returns, so a stat right after close(2) sees the
// name gone.
func (g *guardFile) removeCreated() {
	if g.createdIno == 0 {
		return
	}
	ino := g.createdIno
	g.createdIno = 0
	ov, n := g.ov, g.n
	p, name, ok := n.parent()
	if !ok {
		return
	}
	pfd, _, err := p.dirFd(false)
	if err != nil {
		return
	}
	defer ov.u.put(pfd)
	if !ov.gate.enter() {
		return // sealed: the mount changes nothing any more
	}
	st, err := statxAt(pfd, name)
	if err == nil {
		err = ov.keepDir(pfd)
	}
	if err != nil || st.ino != ino || st.size != 0 {
		err = syscall.ESTALE
	} else if err = ov.views.beforeDestroy(pfd, name, &st); err == nil {
		if st.nlink <= 1 {
			n.keepOrphan(pfd, name)
		}
		err = unix.Unlinkat(pfd, name, 0)
		ov.changed(n.ino, 0)
	}
	ov.gate.leave()
	if err == nil {
		p.NotifyDelete(name, n.EmbeddedInode())
	}
}

func (g *guardFile) Release(ctx context.Context) syscall.Errno {
	g.mu.Lock()
	if g.dirty {
		if errno := g.commit(ctx); errno != 0 {
			g.ov.log.Warn("guarded file: change refused at release", "path", g.rel, "errno", errno)
		}
	}
	g.discard()
	g.mu.Unlock()
	g.n.mu.Lock()
	g.n.writers--
	g.n.mu.Unlock()
	return 0
}
