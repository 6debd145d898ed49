package fs

import (
	"strconv"

	"github.com/hanwen/go-fuse/v2/fuse"
	"golang.org/x/sys/unix"
)

// FUSE passthrough. The kernel allows one backing file per inode, and while
// any open file of an inode is in passthrough mode it requires every other
// open of it to be too (and refuses passthrough while files are open in
// cached mode). The overlay counts the open handles of each node by mode
// (node.ptOpens, node.cachedOpens) and chooses accordingly (Open).
//
// go-fuse's own passthrough support drops a node's backing reference when
// any handle of the node is released, passthrough or not; a release racing
// with a passthrough open then closes the backing file under the open and
// the kernel fails it with EIO. So the overlay manages backing files itself:
// Open parks a passthrough handle in pendingPT under the request's cancel
// channel, and rawFS, wrapping go-fuse's raw file system, registers the
// backing file and fills the OPEN reply once go-fuse has registered the
// handle. Each passthrough handle holds a reference, dropped when it is
// released; the backing file is unregistered with the last one. The kernel
// drops its own use of a file before it sends RELEASE, so a reference is
// never dropped under a file the kernel still serves.

// rawFS intercepts OPEN replies to attach backing files.
type rawFS struct {
	fuse.RawFileSystem
	ov *overlay
}

func (r *rawFS) Open(cancel <-chan struct{}, in *fuse.OpenIn, out *fuse.OpenOut) fuse.Status {
	st := r.RawFileSystem.Open(cancel, in, out)
	r.attach(cancel, st, out)
	return st
}

// GetAttr answers the GETATTR of a thread revoking passthrough writes with
// no file type (revokedAttr).
func (r *rawFS) GetAttr(cancel <-chan struct{}, in *fuse.GetAttrIn, out *fuse.AttrOut) fuse.Status {
	st := r.RawFileSystem.GetAttr(cancel, in, out)
	if st == fuse.OK {
		revokedAttr(in.Caller.Pid, out)
	}
	return st
}

// Create attaches the backing file of a file created and opened for
// writing with passthrough.
func (r *rawFS) Create(cancel <-chan struct{}, in *fuse.CreateIn, name string, out *fuse.CreateOut) fuse.Status {
	st := r.RawFileSystem.Create(cancel, in, name, out)
	r.attach(cancel, st, &out.OpenOut)
	return st
}

func (r *rawFS) attach(cancel <-chan struct{}, st fuse.Status, out *fuse.OpenOut) {
	v, ok := r.ov.pendingPT.LoadAndDelete(cancel)
	if !ok {
		return
	}
	h := v.(*upperFile)
	if st == fuse.OK {
		r.ov.attachBacking(h, out)
		return
	}
	// The open failed after Open counted it.
	h.n.mu.Lock()
	r.ov.ptClosed(h.n)
	h.n.mu.Unlock()
}

// attachBacking gives handle h (a passthrough handle) a reference on its
// node's backing file, registering it if needed, and marks out for
// passthrough. If the kernel refuses the registration, passthrough is
// turned off for the mount and h becomes an ordinary daemon-served handle.
func (ov *overlay) attachBacking(h *upperFile, out *fuse.OpenOut) {
	n := h.n
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.backingID == 0 {
		fd := h.fd
		if n.ptWrite && !h.writable {
			// The first passthrough open of n to arrive here is not the
			// writable one that decided the mode: register the file
			// for writing all the same.
			if rw, err := unix.Open("/proc/self/fd/"+strconv.Itoa(h.fd), unix.O_RDWR|unix.O_CLOEXEC, 0); err == nil {
				defer unix.Close(rw)
				fd = rw
			} else {
				ov.log.Warn("passthrough: cannot open the upper file for writing", "ino", n.ino, "err", err)
			}
		}
		id, errno := ov.server.RegisterBackingFd(&fuse.BackingMap{Fd: int32(fd)})
		if errno != 0 {
			if ov.passthrough.Swap(false) {
				ov.log.Warn("FUSE passthrough refused by the kernel; serving reads through the daemon", "err", errno)
			}
			// Only the first passthrough handle of a node registers:
			// no other passthrough handle of n is open.
			ov.ptClosed(n)
			n.cachedOpens++
			h.mode = modeCached
			out.OpenFlags &^= fuse.FOPEN_DIRECT_IO
			return
		}
		n.backingID = id
	}
	n.backingRefs++
	h.attached = true
	out.BackingID = n.backingID
	out.OpenFlags |= fuse.FOPEN_PASSTHROUGH
	out.OpenFlags &^= fuse.FOPEN_KEEP_CACHE
}

// detachBacking drops one reference on n's backing file. n.mu is held.
func (ov *overlay) detachBacking(n *node) {
	n.backingRefs--
	if n.backingRefs == 0 && n.backingID != 0 {
		if errno := ov.server.UnregisterBackingFd(n.backingID); errno != 0 {
			ov.log.Warn("unregister backing file", "err", errno)
		}
		n.backingID = 0
	}
}
