package fs

import (
	"context"
	"syscall"

	fusefs "github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"
	"golang.org/x/sys/unix"
)

// Setattr changes mode, owner, size or times, copying the object up first.
// A size change of a guarded file is checked by the Guard like any other
// change of its content; through a guarded handle it changes the staged
// content instead.
func (n *node) Setattr(ctx context.Context, f fusefs.FileHandle, in *fuse.SetAttrIn, out *fuse.AttrOut) syscall.Errno {
	ov := n.ov
	if ov.holdBarrier(n, in) {
		// A freeze's barrier (ptwrite.go): nothing to change.
		return n.stat(f, &out.Attr)
	}
	if ov.opts.ReadOnly && in.Valid&(fuse.FATTR_MODE|fuse.FATTR_UID|fuse.FATTR_GID|fuse.FATTR_SIZE|fuse.FATTR_ATIME|fuse.FATTR_MTIME) != 0 {
		return syscall.EROFS
	}
	size, hasSize := in.GetSize()
	if g, ok := f.(*guardFile); ok && hasSize {
		if errno := g.truncate(int64(size)); errno != 0 {
			return errno
		}
		in.Valid &^= fuse.FATTR_SIZE
		hasSize = false
	} else if hasSize && ov.guard != nil && !n.isDir() {
		if rel, ok := n.rel(); ok && ov.guard.Guarded(rel) {
			if errno := ov.checkTruncate(ctx, n, rel, int64(size)); errno != 0 {
				return errno
			}
		}
	}
	if in.Valid&(fuse.FATTR_MODE|fuse.FATTR_UID|fuse.FATTR_GID|fuse.FATTR_SIZE|fuse.FATTR_ATIME|fuse.FATTR_MTIME) != 0 {
		if err := ov.copyUp(ctx, n, !(hasSize && size == 0)); err != nil {
			return errnoOf(err)
		}
		if errno := n.setattrUpper(ctx, f, in, hasSize, int64(size)); errno != 0 {
			return errno
		}
	}
	return n.stat(f, &out.Attr)
}

func (n *node) setattrUpper(ctx context.Context, f fusefs.FileHandle, in *fuse.SetAttrIn, hasSize bool, size int64) syscall.Errno {
	ov := n.ov
	var dfd int
	var name string
	if n == ov.root {
		dfd, name = ov.u.root, ""
	} else {
		p, nm, ok := n.parent()
		if !ok {
			// Unlinked but open: only the handle can reach it.
			if uf := upperHandle(f); uf != nil {
				return n.setattrFd(uf, in, hasSize, size)
			}
			return syscall.ENOENT
		}
		fd, _, err := p.dirFd(false)
		if err != nil {
			return errnoOf(err)
		}
		defer ov.u.put(fd)
		dfd, name = fd, nm
	}
	if uf := upperHandle(f); uf != nil && uf.writable && hasSize {
		if errno := ov.truncateFd(n, uf.fd, size); errno != 0 {
			return errno
		}
		hasSize = false
	}

	if !ov.gate.enter() {
		return errSealed
	}
	defer ov.gate.leave()
	if err := ov.keepEntry(dfd, name); err != nil {
		return errnoOf(err)
	}
	at := func(fn func(dirfd int, name string, flags int) error) error {
		if name == "" {
			return fn(dfd, ".", 0)
		}
		return fn(dfd, name, unix.AT_SYMLINK_NOFOLLOW)
	}
	if mode, ok := in.GetMode(); ok {
		if n.kind == syscall.S_IFLNK {
			return syscall.EOPNOTSUPP
		}
		target := name
		if target == "" {
			target = "."
		}
		if err := unix.Fchmodat(dfd, target, mode, 0); err != nil {
			return errnoOf(err)
		}
	}
	uid, uok := in.GetUID()
	gid, gok := in.GetGID()
	if uok || gok {
		su, sg := -1, -1
		if uok {
			su = int(uid)
		}
		if gok {
			sg = int(gid)
		}
		if err := at(func(d int, nm string, fl int) error { return unix.Fchownat(d, nm, su, sg, fl) }); err != nil {
			return errnoOf(err)
		}
	}
	if hasSize {
		if n.kind != syscall.S_IFREG {
			return syscall.EINVAL
		}
		fd, err := unix.Openat(dfd, name, unix.O_RDWR|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
		if err == unix.EACCES {
			fd, err = unix.Openat(dfd, name, unix.O_WRONLY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
		}
		if err != nil {
			return errnoOf(err)
		}
		errno := ov.truncateGated(fd, size)
		unix.Close(fd)
		if errno != 0 {
			return errno
		}
	}
	if ts, ok := setattrTimes(in); ok {
		if err := at(func(d int, nm string, fl int) error { return unix.UtimesNanoAt(d, nm, ts, fl) }); err != nil {
			return errnoOf(err)
		}
	}
	ov.changed(n.ino, 0)
	return 0
}

// setattrFd applies changes to an unlinked file through its open handle.
func (n *node) setattrFd(uf *upperFile, in *fuse.SetAttrIn, hasSize bool, size int64) syscall.Errno {
	ov := n.ov
	if hasSize {
		if errno := ov.truncateFd(n, uf.fd, size); errno != 0 {
			return errno
		}
	}
	if !ov.gate.enter() {
		return errSealed
	}
	defer ov.gate.leave()
	if err := ov.keepFd(uf.uino, uf.fd); err != nil {
		return errnoOf(err)
	}
	if mode, ok := in.GetMode(); ok {
		if err := unix.Fchmod(uf.fd, mode); err != nil {
			return errnoOf(err)
		}
	}
	uid, uok := in.GetUID()
	gid, gok := in.GetGID()
	if uok || gok {
		su, sg := -1, -1
		if uok {
			su = int(uid)
		}
		if gok {
			sg = int(gid)
		}
		if err := unix.Fchown(uf.fd, su, sg); err != nil {
			return errnoOf(err)
		}
	}
	if ts, ok := setattrTimes(in); ok {
		if err := futimens(uf.fd, ts); err != nil {
			return errnoOf(err)
		}
	}
	ov.changed(n.ino, 0)
	return 0
}

// setattrTimes turns the time fields of a SETATTR into utimensat arguments,
// using UTIME_NOW so the upper file system stamps "now" itself.
func setattrTimes(in *fuse.SetAttrIn) ([]unix.Timespec, bool) {
	if in.Valid&(fuse.FATTR_ATIME|fuse.FATTR_MTIME) == 0 {
		return nil, false
	}
	omit := unix.Timespec{Nsec: unix.UTIME_OMIT}
	now := unix.Timespec{Nsec: unix.UTIME_NOW}
	ts := []unix.Timespec{omit, omit}
	if in.Valid&fuse.FATTR_ATIME != 0 {
		if in.Valid&fuse.FATTR_ATIME_NOW != 0 {
			ts[0] = now
		} else {
			ts[0] = unix.Timespec{Sec: int64(in.Atime), Nsec: int64(in.Atimensec)}
		}
	}
	if in.Valid&fuse.FATTR_MTIME != 0 {
		if in.Valid&fuse.FATTR_MTIME_NOW != 0 {
			ts[1] = now
		} else {
			ts[1] = unix.Timespec{Sec: int64(in.Mtime), Nsec: int64(in.Mtimensec)}
		}
	}
	return ts, true
}

// upperHandle returns the daemon-served upper handle behind f, if any.
func upperHandle(f fusefs.FileHandle) *upperFile {
	switch h := f.(type) {
	case *upperFile:
		return h
	case *deferredFile:
		// Setattr copied the file up before asking.
		up, _ := h.upper(context.Background(), false)
		return up
	}
	return nil
}
