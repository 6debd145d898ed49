package fs

import (
	"syscall"

	"github.com/hanwen/go-fuse/v2/fuse"
)

// A mount made with Options.RefuseWrites shows its tree but refuses every
// change with EROFS until Mounted.AllowWrites, without a remount: the
// kernel mount is writable, and writeGate, the outermost layer of the raw
// file system, answers each request that could change the tree (or open a
// file for writing) before the overlay sees it. Nothing can have been
// changed through the mount before AllowWrites, so the tree the overlay
// serves from then on is the one it was mounted with. Once writes are
// allowed the gate costs one atomic load per such request.

// writeGate refuses changes while ov.writesRefused is set.
type writeGate struct {
	fuse.RawFileSystem
	ov *overlay
}

const erofs = fuse.Status(syscall.EROFS)

func (g *writeGate) refused() bool { return g.ov.writesRefused.Load() }

// AllowWrites lifts Options.RefuseWrites: from its return on, changes
// reach the overlay. Calling it again, or on a mount made without
// RefuseWrites, does nothing.
func (m *Mounted) AllowWrites() { m.ov.writesRefused.Store(false) }

// WritesRefused reports whether the mount still refuses changes
// (Options.RefuseWrites, until AllowWrites).
func (m *Mounted) WritesRefused() bool { return m.ov.writesRefused.Load() }

// writeFlags are the open flags that make an open a change.
const writeFlags = syscall.O_WRONLY | syscall.O_RDWR | syscall.O_TRUNC | syscall.O_APPEND | syscall.O_CREAT

func (g *writeGate) Open(c <-chan struct{}, in *fuse.OpenIn, out *fuse.OpenOut) fuse.Status {
	if in.Flags&writeFlags != 0 && g.refused() {
		return erofs
	}
	return g.RawFileSystem.Open(c, in, out)
}

func (g *writeGate) Access(c <-chan struct{}, in *fuse.AccessIn) fuse.Status {
	if in.Mask&2 != 0 && g.refused() { // W_OK
		return erofs
	}
	return g.RawFileSystem.Access(c, in)
}

func (g *writeGate) SetAttr(c <-chan struct{}, in *fuse.SetAttrIn, out *fuse.AttrOut) fuse.Status {
	if g.refused() {
		return erofs
	}
	return g.RawFileSystem.SetAttr(c, in, out)
}

func (g *writeGate) Mknod(c <-chan struct{}, in *fuse.MknodIn, name string, out *fuse.EntryOut) fuse.Status {
	if g.refused() {
		return erofs
	}
	return g.RawFileSystem.Mknod(c, in, name, out)
}

func (g *writeGate) Mkdir(c <-chan struct{}, in *fuse.MkdirIn, name string, out *fuse.EntryOut) fuse.Status {
	if g.refused() {
		return erofs
	}
	return g.RawFileSystem.Mkdir(c, in, name, out)
}

func (g *writeGate) Unlink(c <-chan struct{}, h *fuse.InHeader, name string) fuse.Status {
	if g.refused() {
		return erofs
	}
	return g.RawFileSystem.Unlink(c, h, name)
}

func (g *writeGate) Rmdir(c <-chan struct{}, h *fuse.InHeader, name string) fuse.Status {
	if g.refused() {
		return erofs
	}
	return g.RawFileSystem.Rmdir(c, h, name)
}

func (g *writeGate) Rename(c <-chan struct{}, in *fuse.RenameIn, oldName, newName string) fuse.Status {
	if g.refused() {
		return erofs
	}
	return g.RawFileSystem.Rename(c, in, oldName, newName)
}

func (g *writeGate) Link(c <-chan struct{}, in *fuse.LinkIn, name string, out *fuse.EntryOut) fuse.Status {
	if g.refused() {
		return erofs
	}
	return g.RawFileSystem.Link(c, in, name, out)
}

func (g *writeGate) Symlink(c <-chan struct{}, h *fuse.InHeader, target, name string, out *fuse.EntryOut) fuse.Status {
	if g.refused() {
		return erofs
	}
	return g.RawFileSystem.Symlink(c, h, target, name, out)
}

func (g *writeGate) SetXAttr(c <-chan struct{}, in *fuse.SetXAttrIn, attr string, data []byte) fuse.Status {
	if g.refused() {
		return erofs
	}
	return g.RawFileSystem.SetXAttr(c, in, attr, data)
}

func (g *writeGate) RemoveXAttr(c <-chan struct{}, h *fuse.InHeader, attr string) fuse.Status {
	if g.refused() {
		return erofs
	}
	return g.RawFileSystem.RemoveXAttr(c, h, attr)
}

func (g *writeGate) Create(c <-chan struct{}, in *fuse.CreateIn, name string, out *fuse.CreateOut) fuse.Status {
	if g.refused() {
		return erofs
	}
	return g.RawFileSystem.Create(c, in, name, out)
}

func (g *writeGate) Tmpfile(c <-chan struct{}, in *fuse.CreateIn, out *fuse.CreateOut) fuse.Status {
	if g.refused() {
		return erofs
	}
	return g.RawFileSystem.Tmpfile(c, in, out)
}

func (g *writeGate) Write(c <-chan struct{}, in *fuse.WriteIn, data []byte) (uint32, fuse.Status) {
	if g.refused() {
		return 0, erofs
	}
	return g.RawFileSystem.Write(c, in, data)
}

func (g *writeGate) Writev(c <-chan struct{}, in *fuse.WriteIn, data [][]byte) (uint32, fuse.Status) {
	if g.refused() {
		return 0, erofs
	}
	return g.RawFileSystem.Writev(c, in, data)
}

func (g *writeGate) CopyFileRange(c <-chan struct{}, in *fuse.CopyFileRangeIn) (uint32, fuse.Status) {
	if g.refused() {
		return 0, erofs
	}
	return g.RawFileSystem.CopyFileRange(c, in)
}

func (g *writeGate) Fallocate(c <-chan struct{}, in *fuse.FallocateIn) fuse.Status {
	if g.refused() {
		return erofs
	}
	return g.RawFileSystem.Fallocate(c, in)
}
