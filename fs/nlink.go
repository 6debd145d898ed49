package fs

import (
	"context"
	"syscall"

	fusefs "github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"
)

// A merged directory (an upper side and a lower side) has no one link
// count to take: its subdirectories are spread over both layers. It
// reports what a local file system would, 2 plus one per subdirectory of
// the merged listing. The count is taken by listing once, kept in the node
// with the node's subdirectory version, and taken again only after a
// subdirectory came or went (Mkdir, Rmdir, Rename of a directory bump the
// version): creating and deleting files, which make the kernel ask for the
// directory's attributes again, never list it.

// mergedNlink is the link count of merged directory n; 1 (the "unknown"
// of find's -noleaf) if it cannot be listed.
func (ov *overlay) mergedNlink(n *node) uint32 {
	return ov.mergedNlinkIn(n, nil, "")
}

// mergedNlinkIn is mergedNlink for n found as name in directory d, before
// the kernel links n under d (a Lookup): n has no path of its own yet.
func (ov *overlay) mergedNlinkIn(n, d *node, name string) uint32 {
	ver := n.subdirVer.Load()
	if c := n.subdirs.Load(); c != 0 && uint32(c>>32) == ver {
		return uint32(c) + 1
	}
	var ents []mergedEntry
	var err error
	if d == nil {
		ents, err = ov.list(n)
	} else if rel, ok := d.rel(); ok {
		ents, err = ov.listAt(n, joinRel(rel, name))
	} else {
		err = syscall.ENOENT
	}
	if err != nil {
		return 1
	}
	k := uint32(1) // stored as count+1 so that 0 means unknown
	for _, e := range ents {
		if e.mode == syscall.S_IFDIR {
			k++
		}
	}
	n.subdirs.Store(int64(ver)<<32 | int64(k))
	return k + 1
}

// subdirsChanged says that a subdirectory of n came or went.
func (n *node) subdirsChanged() { n.subdirVer.Add(1) }

func (n *node) Mkdir(ctx context.Context, name string, mode uint32, out *fuse.EntryOut) (*fusefs.Inode, syscall.Errno) {
	ch, errno := n.mkdir(ctx, name, mode, out)
	if errno == 0 {
		n.subdirsChanged()
	}
	return ch, errno
}

func (n *node) Rmdir(ctx context.Context, name string) syscall.Errno {
	errno := n.remove(ctx, name, true)
	if errno == 0 {
		n.subdirsChanged()
	}
	return errno
}

// Rename is renameGuarded (guard_moves.go), keeping the link counts of
// both directories when a directory moves.
func (n *node) Rename(ctx context.Context, name string, newParent fusefs.InodeEmbedder, newName string, flags uint32) syscall.Errno {
	dirs := false
	if ch := n.GetChild(name); ch != nil && ch.StableAttr().Mode == syscall.S_IFDIR {
		dirs = true
	}
	np, _ := newParent.(*node)
	if np != nil {
		if ch := np.GetChild(newName); ch != nil && ch.StableAttr().Mode == syscall.S_IFDIR {
			dirs = true
		}
	}
	errno := n.renameGuarded(ctx, name, newParent, newName, flags)
	if errno == 0 && dirs {
		n.subdirsChanged()
		if np != nil {
			np.subdirsChanged()
		}
	}
	return errno
}

// mergedNlink is the link count of merged directory o of the view, as the
// mount reports it: 2 plus its subdirectories in both layers.
func (v *View) mergedNlink(o *vobj) uint64 {
	n := uint64(2)
	seen := make(map[string]bool, len(o.dir.ents))
	for i := range o.dir.ents {
		e := &o.dir.ents[i]
		seen[e.name] = true
		if e.kind == syscall.S_IFDIR {
			n++
		}
	}
	if v.lower == nil {
		return n
	}
	lents, err := v.lower.ReadDir(o.lower)
	if err != nil {
		return 1
	}
	for _, le := range lents {
		if le.Mode.IsDir() && !seen[le.Name] && !o.dir.hidden[le.Name] {
			n++
		}
	}
	return n
}
