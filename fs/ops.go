package fs

import (
	"context"
	"syscall"

	fusefs "github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"
	"golang.org/x/sys/unix"
)

// This file holds the operations that change the namespace. Each one copies
// up what it needs first (outside the gate, since copy-up may read a whole
// file), then enters the gate, re-resolves the names it works on, and makes
// the change in the upper layer. Overlay metadata (whiteouts, opaque and
// redirect markers) is made durable before the change that relies on it,
// so a crash leaves the state before or after the operation, never one
// where a deleted lower entry reappears.

// checkNewName rejects names a user may not create.
func checkNewName(name string) syscall.Errno {
	if isReserved(name) {
		return syscall.EINVAL
	}
	if len(name) > nameMax {
		return syscall.ENAMETOOLONG
	}
	return 0
}

// prepDir copies directory n up and opens its upper directory.
func (n *node) prepDir(ctx context.Context) (int, string, syscall.Errno) {
	if err := n.ov.copyUpDir(ctx, n); err != nil {
		return -1, "", errnoOf(err)
	}
	fd, rel, err := n.dirFd(false)
	if err != nil {
		return -1, "", errnoOf(err)
	}
	return fd, rel, 0
}

// own gives a new upper entry to the calling user, as a local file system
// would: the caller's uid, and the caller's gid unless the parent
// directory is setgid. Only a privileged daemon can; otherwise everything
// in the upper layer belongs to the daemon's user (who is then the only
// user of the mount).
func (ov *overlay) own(ctx context.Context, dfd int, name string, fd int) error {
	if !ov.u.privileged {
		return nil
	}
	caller, ok := fuse.FromContext(ctx)
	if !ok {
		return nil
	}
	gid := int(caller.Gid)
	if pst, err := statFd(dfd); err == nil && pst.mode&syscall.S_ISGID != 0 {
		gid = -1 // the file system already gave it the directory's group
	}
	if fd >= 0 {
		return unix.Fchown(fd, int(caller.Uid), gid)
	}
	return unix.Fchownat(dfd, name, int(caller.Uid), gid, unix.AT_SYMLINK_NOFOLLOW)
}

func callerPid(ctx context.Context) uint32 {
	if c, ok := fuse.FromContext(ctx); ok {
		return c.Pid
	}
	return 0
}

// newUpperChild makes the node for a just-created upper entry name in n
// and counts the creation (of bytes) as a change.
func (n *node) newUpperChild(ctx context.Context, dfd int, name string, bytes int64, out *fuse.EntryOut) (*fusefs.Inode, syscall.Errno) {
	st, err := statxAt(dfd, name)
	if err != nil {
		n.ov.changed(0, 0)
		return nil, errnoOf(err)
	}
	e := entry{upper: true, ust: st}
	id, err := n.ov.identify(n, dfd, name, &e)
	if err != nil {
		n.ov.changed(0, 0)
		return nil, errnoOf(err)
	}
	n.ov.changed(id.ino, bytes)
	return n.ov.newChild(ctx, n, name, id, &e, out), 0
}

func (n *node) mkdir(ctx context.Context, name string, mode uint32, out *fuse.EntryOut) (*fusefs.Inode, syscall.Errno) {
	if n.ov.opts.ReadOnly {
		return nil, syscall.EROFS
	}
	if errno := checkNewName(name); errno != 0 {
		return nil, errno
	}
	ov := n.ov
	dfd, _, errno := n.prepDir(ctx)
	if errno != 0 {
		return nil, errno
	}
	defer ov.u.put(dfd)
	if !ov.gate.enter() {
		return nil, errSealed
	}
	defer ov.gate.leave()
	e, err := ov.resolve(n, dfd, name)
	if err != nil {
		return nil, errnoOf(err)
	}
	if e.exists() {
		return nil, syscall.EEXIST
	}
	if err := ov.keepDir(dfd); err != nil {
		return nil, errnoOf(err)
	}
	mode &= 07777
	if e.lowerIno == 0 {
		if err := unix.Mkdirat(dfd, name, mode); err != nil {
			return nil, errnoOf(err)
		}
		if err := ov.u.fixMode(dfd, name, mode|ov.inheritedSgid(dfd), -1); err != nil {
			return nil, errnoOf(err)
		}
		if err := ov.own(ctx, dfd, name, -1); err != nil {
			return nil, errnoOf(err)
		}
	} else if err := ov.mkdirOpaque(ctx, dfd, name, mode); err != nil {
		// A deleted lower directory of that name must stay deleted:
		// the new directory is opaque from the moment it appears.
		return nil, errnoOf(err)
	}
	ov.bornAt(dfd, name)
	return n.newUpperChild(ctx, dfd, name, 0, out)
}

// inheritedSgid is S_ISGID when directory dfd is setgid (new directories
// inherit it).
func (ov *overlay) inheritedSgid(dfd int) uint32 {
	if st, err := statFd(dfd); err == nil && st.mode&syscall.S_ISGID != 0 {
		return syscall.S_ISGID
	}
	return 0
}

// mkdirOpaque creates an opaque directory name in dfd atomically: built in
// the work directory with its marker, then renamed into place.
func (ov *overlay) mkdirOpaque(ctx context.Context, dfd int, name string, mode uint32) error {
	tmp := ov.u.tmpName()
	w := ov.u.work
	if err := unix.Mkdirat(w, tmp, 0o700); err != nil {
		return err
	}
	err := func() error {
		sub, err := unix.Openat(w, tmp, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
		if err != nil {
			return err
		}
		defer unix.Close(sub)
		fd, err := unix.Openat(sub, opaqueMarker, unix.O_CREAT|unix.O_EXCL|unix.O_WRONLY|unix.O_CLOEXEC, 0o600)
		if err != nil {
			return err
		}
		unix.Close(fd)
		if err := unix.Fsync(sub); err != nil {
			return err
		}
		if ov.u.privileged {
			if c, ok := fuse.FromContext(ctx); ok {
				gid := int(c.Gid)
				if pst, err := statFd(dfd); err == nil && pst.mode&syscall.S_ISGID != 0 {
					gid = int(pst.gid)
				}
				if err := unix.Fchown(sub, int(c.Uid), gid); err != nil {
					return err
				}
			}
		}
		if err := unix.Fchmod(sub, mode|ov.inheritedSgid(dfd)); err != nil {
			return err
		}
		if err := unix.Renameat2(w, tmp, dfd, name, unix.RENAME_NOREPLACE); err != nil {
			return err
		}
		return fsyncDir(dfd)
	}()
	if err != nil {
		removeAllAt(w, tmp)
	}
	return err
}

func (n *node) Mknod(ctx context.Context, name string, mode uint32, rdev uint32, out *fuse.EntryOut) (*fusefs.Inode, syscall.Errno) {
	if n.ov.opts.ReadOnly {
		return nil, syscall.EROFS
	}
	if errno := checkNewName(name); errno != 0 {
		return nil, errno
	}
	ov := n.ov
	if ov.guarded(n, name) {
		return nil, ov.refused(ctx, relOf(n, name), syscall.EPERM, "a memory file must be a regular file (mknod)")
	}
	dfd, _, errno := n.prepDir(ctx)
	if errno != 0 {
		return nil, errno
	}
	defer ov.u.put(dfd)
	if !ov.gate.enter() {
		return nil, errSealed
	}
	defer ov.gate.leave()
	e, err := ov.resolve(n, dfd, name)
	if err != nil {
		return nil, errnoOf(err)
	}
	if e.exists() {
		return nil, syscall.EEXIST
	}
	if err := ov.keepDir(dfd); err != nil {
		return nil, errnoOf(err)
	}
	if err := unix.Mknodat(dfd, name, mode, int(rdev)); err != nil {
		return nil, errnoOf(err)
	}
	if err := ov.u.fixMode(dfd, name, mode, -1); err != nil {
		return nil, errnoOf(err)
	}
	if err := ov.own(ctx, dfd, name, -1); err != nil {
		return nil, errnoOf(err)
	}
	ov.bornAt(dfd, name)
	return n.newUpperChild(ctx, dfd, name, 0, out)
}

func (n *node) Symlink(ctx context.Context, target, name string, out *fuse.EntryOut) (*fusefs.Inode, syscall.Errno) {
	if n.ov.opts.ReadOnly {
		return nil, syscall.EROFS
	}
	if errno := checkNewName(name); errno != 0 {
		return nil, errno
	}
	ov := n.ov
	if ov.guarded(n, name) {
		// A guarded name holds checked content, never a pointer to
		// unchecked content elsewhere.
		return nil, ov.refused(ctx, relOf(n, name), syscall.EPERM, "a memory file cannot be a symbolic link")
	}
	dfd, _, errno := n.prepDir(ctx)
	if errno != 0 {
		return nil, errno
	}
	defer ov.u.put(dfd)
	if !ov.gate.enter() {
		return nil, errSealed
	}
	defer ov.gate.leave()
	e, err := ov.resolve(n, dfd, name)
	if err != nil {
		return nil, errnoOf(err)
	}
	if e.exists() {
		return nil, syscall.EEXIST
	}
	if err := ov.keepDir(dfd); err != nil {
		return nil, errnoOf(err)
	}
	if err := unix.Symlinkat(target, dfd, name); err != nil {
		return nil, errnoOf(err)
	}
	if err := ov.own(ctx, dfd, name, -1); err != nil {
		return nil, errnoOf(err)
	}
	ov.bornAt(dfd, name)
	return n.newUpperChild(ctx, dfd, name, int64(len(target)), out)
}

func (n *node) Link(ctx context.Context, target fusefs.InodeEmbedder, name string, out *fuse.EntryOut) (*fusefs.Inode, syscall.Errno) {
	if n.ov.opts.ReadOnly {
		return nil, syscall.EROFS
	}
	if errno := checkNewName(name); errno != 0 {
		return nil, errno
	}
	ov := n.ov
	t, ok := target.(*node)
	if !ok || t.isDir() {
		return nil, syscall.EPERM
	}
	if ov.guarded(n, name) || ov.guardedNode(t) {
		// A second name for a guarded file would be a way to change it
		// without the hook.
		return nil, ov.refused(ctx, relOf(n, name), syscall.EPERM, "a memory file cannot have a second name (hard link)")
	}
	if err := ov.copyUp(ctx, t, true); err != nil {
		return nil, errnoOf(err)
	}
	dfd, _, errno := n.prepDir(ctx)
	if errno != 0 {
		return nil, errno
	}
	defer ov.u.put(dfd)
	tp, tname, ok := t.parent()
	if !ok {
		return nil, syscall.ENOENT
	}
	tfd, _, err := tp.dirFd(false)
	if err != nil {
		return nil, errnoOf(err)
	}
	defer ov.u.put(tfd)
	if !ov.gate.enter() {
		return nil, errSealed
	}
	defer ov.gate.leave()
	e, err := ov.resolve(n, dfd, name)
	if err != nil {
		return nil, errnoOf(err)
	}
	if e.exists() {
		return nil, syscall.EEXIST
	}
	if err := ov.keepDir(dfd); err != nil {
		return nil, errnoOf(err)
	}
	if err := ov.keepEntry(tfd, tname); err != nil {
		return nil, errnoOf(err)
	}
	if err := unix.Linkat(tfd, tname, dfd, name, 0); err != nil {
		return nil, errnoOf(err)
	}
	st, err := statxAt(dfd, name)
	if err != nil {
		return nil, errnoOf(err)
	}
	ov.changed(t.ino, 0)
	fillAttr(&out.Attr, &st)
	out.Attr.Ino = t.ino
	return n.NewInode(ctx, t, t.StableAttr()), 0
}

func (n *node) Unlink(ctx context.Context, name string) syscall.Errno {
	return n.remove(ctx, name, false)
}

// remove deletes name (a directory when dir): a whiteout first when the
// lower layer has that name, then the upper entry.
func (n *node) remove(ctx context.Context, name string, dir bool) syscall.Errno {
	if n.ov.opts.ReadOnly {
		return syscall.EROFS
	}
	if isReserved(name) {
		return syscall.EINVAL
	}
	ov := n.ov
	e, err := ov.resolve(n, -1, name)
	if err != nil {
		return errnoOf(err)
	}
	if !e.exists() {
		return syscall.ENOENT
	}
	isDir := e.mode()&syscall.S_IFMT == syscall.S_IFDIR
	switch {
	case dir && !isDir:
		return syscall.ENOTDIR
	case !dir && isDir:
		return syscall.EISDIR
	}
	if dir {
		ch := n.GetChild(name)
		if ch == nil {
			return syscall.ENOENT
		}
		cn, ok := ch.Operations().(*node)
		if !ok {
			return syscall.EIO
		}
		list, err := ov.list(cn)
		if err != nil {
			return errnoOf(err)
		}
		if len(list) > 0 {
			return syscall.ENOTEMPTY
		}
	}
	if !dir {
		if ch := n.GetChild(name); ch != nil {
			cn, _ := ch.Operations().(*node)
			if err := ov.copyUpDeferred(ctx, cn); err != nil {
				return errnoOf(err)
			}
		}
	}
	dfd, drel, errno := n.prepDir(ctx)
	if errno != 0 {
		return errno
	}
	defer ov.u.put(dfd)

	if !ov.gate.enter() {
		return errSealed
	}
	defer ov.gate.leave()
	if e, err = ov.resolve(n, dfd, name); err != nil {
		return errnoOf(err)
	}
	if !e.exists() {
		return syscall.ENOENT
	}
	if err := ov.keepDir(dfd); err != nil {
		return errnoOf(err)
	}
	if e.upper && dir {
		// Its whiteouts and markers shape the frozen tree below it.
		if err := ov.keepDirAt(dfd, name); err != nil {
			return errnoOf(err)
		}
	}
	if e.upper && !dir {
		// Before any change: a file open views cannot keep stays.
		if err := ov.views.beforeDestroy(dfd, name, &e.ust); err != nil {
			return errnoOf(err)
		}
	}
	if e.lowerIno != 0 {
		if err := ov.u.addWhiteout(dfd, name); err != nil {
			return errnoOf(err)
		}
	}
	if e.upper {
		if dir {
			// fstat of the directory still open answers from it
			// (directories are opened without a handle).
			if ch := n.GetChild(name); ch != nil {
				if cn, ok := ch.Operations().(*node); ok {
					cn.keepOrphan(dfd, name)
				}
			}
			if err := ov.removeUpperDir(dfd, name); err != nil {
				return errnoOf(err)
			}
		} else {
			if e.ust.nlink <= 1 {
				if ch := n.GetChild(name); ch != nil {
					if cn, ok := ch.Operations().(*node); ok {
						cn.keepOrphan(dfd, name)
					}
				}
			}
			unlockNames, excl := ov.partials.lockNames()
			var moves []nameMove
			if excl {
				moves = ov.partials.unlinkMoves(ov.freshRel(dfd, drel, name), &e.ust)
				if err := ov.partials.prepare(moves); err != nil {
					unlockNames()
					ov.log.Error("unlink", "err", err)
					return syscall.EIO
				}
			}
			err := unix.Unlinkat(dfd, name, 0)
			ov.partials.finish(moves, err == nil)
			unlockNames()
			if err != nil {
				return errnoOf(err)
			}
		}
	}
	var ino uint64
	if ch := n.GetChild(name); ch != nil {
		ino = ch.StableAttr().Ino
	}
	ov.changed(ino, 0)
	if gm := ov.guardMover(); gm != nil && !dir {
		if rel, ok := n.rel(); ok && ov.guard.Guarded(joinRel(rel, name)) {
			gm.Removed(context.WithoutCancel(ctx), joinRel(rel, name), callerPid(ctx))
		}
	}
	return 0
}

// removeUpperDir removes an upper directory that is empty in the merged
// view but may still hold the overlay's markers: it is moved into the work
// directory in one rename and deleted there.
func (ov *overlay) removeUpperDir(dfd int, name string) error {
	err := unix.Unlinkat(dfd, name, unix.AT_REMOVEDIR)
	if err != unix.ENOTEMPTY && err != unix.EEXIST {
		return err
	}
	tmp := ov.u.tmpName()
	if err := unix.Renameat(dfd, name, ov.u.work, tmp); err != nil {
		return err
	}
	if err := fsyncDir(dfd); err != nil {
		return err
	}
	return removeAllAt(ov.u.work, tmp)
}

// guarded reports whether name in directory d is a guarded path.
func (ov *overlay) guarded(d *node, name string) bool {
	if ov.guard == nil {
		return false
	}
	rel, ok := d.rel()
	if !ok {
		return false
	}
	return ov.guard.Guarded(joinRel(rel, name))
}

// guardedNode reports whether n's path is guarded.
func (ov *overlay) guardedNode(n *node) bool {
	if ov.guard == nil {
		return false
	}
	rel, ok := n.rel()
	return ok && ov.guard.Guarded(rel)
}
