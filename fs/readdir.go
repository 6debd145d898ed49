package fs

import (
	"context"
	"syscall"

	"github.com/hanwen/go-fuse/v2/fuse"
)

// Directory listings without OPENDIR. Listing a directory through FUSE
// costs an OPENDIR round trip and a RELEASEDIR, even when the kernel serves
// the listing from its cache (FOPEN_CACHE_DIR): a walk of a tree (find, git
// status, Python's import, which lists each package directory once) pays
// them for every directory. The overlay keeps nothing per open directory,
// so it answers the first OPENDIR with ENOSYS: the kernel then opens
// directories without asking, for the rest of the connection, with
// FOPEN_KEEP_CACHE|FOPEN_CACHE_DIR (what the overlay gave before), and sends
// READDIR(PLUS) requests with no handle, which rawFS serves here.
//
// A listing is taken when a read starts at offset 0 and kept on the node
// until a read finds its end, so that a reader going through it in several
// requests sees one listing whatever changes meanwhile, as the per-handle
// listing did. An entry's offset names its listing (a serial number of the
// node's listings, in the high 31 bits) and its place in it (low 32 bits):
// two readers of one directory each continue in their own listing, and a
// listing no longer kept (a seekdir to an offset after it was dropped, a
// remount) is taken again and read from the same place.
//
// fstat of an open directory now reaches the node without a handle: a
// directory removed or replaced while open keeps its upper directory open
// (node.orphan) for it, as a removed file does.
//
// go-fuse's bridge only serves listings of handles it opened, and keeps
// its node table to itself, so rawFS finds the node of a request's NodeId
// by asking the bridge to look up a name no entry can have, under a cancel
// channel registered in overlay.probes: node.Lookup recognises it and
// reports itself. The entries of READDIRPLUS are looked up through the
// bridge as its own READDIRPLUS does, so the kernel's lookup counts and
// go-fuse's tree agree.

// probeName is the name rawFS looks up to find a directory's node. Lookup
// answers it only under a registered cancel channel: a user's lookup of the
// same name is an ordinary one.
const probeName = reservedPrefix + ".wh.probe"

// keptListings is how many listings a node keeps for readers in progress.
const keptListings = 2

// dirListing is one listing of a directory, "." and ".." first.
type dirListing struct {
	serial  uint32
	entries []fuse.DirEntry
}

// dirListings are the listings a directory node keeps; guarded by node.mu.
type dirListings struct {
	serial uint32
	kept   [keptListings]*dirListing
}

func (r *rawFS) OpenDir(cancel <-chan struct{}, in *fuse.OpenIn, out *fuse.OpenOut) fuse.Status {
	return fuse.ENOSYS
}

func (r *rawFS) ReadDir(cancel <-chan struct{}, in *fuse.ReadIn, out *fuse.DirEntryList) fuse.Status {
	if in.Fh != 0 {
		return r.RawFileSystem.ReadDir(cancel, in, out)
	}
	return r.readDir(cancel, in, out, false)
}

func (r *rawFS) ReadDirPlus(cancel <-chan struct{}, in *fuse.ReadIn, out *fuse.DirEntryList) fuse.Status {
	if in.Fh != 0 {
		return r.RawFileSystem.ReadDirPlus(cancel, in, out)
	}
	return r.readDir(cancel, in, out, true)
}

// nodeOf returns the overlay node of a request's NodeId.
func (r *rawFS) nodeOf(in *fuse.InHeader) *node {
	probe := make(chan struct{})
	var found *node
	r.ov.probes.Store((<-chan struct{})(probe), &found)
	defer r.ov.probes.Delete((<-chan struct{})(probe))
	var out fuse.EntryOut
	r.RawFileSystem.Lookup(probe, &fuse.InHeader{NodeId: in.NodeId, Caller: in.Caller}, probeName, &out)
	return found
}

// probed reports whether a Lookup of name under ctx is rawFS asking for
// n, and answers it.
func (n *node) probed(ctx context.Context, name string) bool {
	if name != probeName {
		return false
	}
	fc, ok := ctx.(*fuse.Context)
	if !ok {
		return false
	}
	v, ok := n.ov.probes.Load(fc.Cancel)
	if !ok {
		return false
	}
	*v.(**node) = n
	return true
}

func (r *rawFS) readDir(cancel <-chan struct{}, in *fuse.ReadIn, out *fuse.DirEntryList, plus bool) fuse.Status {
	n := r.nodeOf(&in.InHeader)
	if n == nil {
		return fuse.EIO
	}
	if !n.isDir() {
		return fuse.ENOTDIR
	}
	l, idx, errno := n.listingAt(in.Offset)
	if errno != 0 {
		return fuse.Status(errno)
	}
	if idx >= len(l.entries) {
		// The end: a reader that comes back starts over, at offset 0.
		n.dropListing(l)
		return fuse.OK
	}
	for ; idx < len(l.entries); idx++ {
		de := l.entries[idx]
		if !plus {
			if !out.AddDirEntry(de) {
				break
			}
			continue
		}
		eo := out.AddDirLookupEntry(de)
		if eo == nil {
			break
		}
		if de.Name == "." || de.Name == ".." {
			// The kernel ignores their attributes.
			continue
		}
		if st := r.RawFileSystem.Lookup(cancel, &fuse.InHeader{NodeId: in.NodeId, Caller: in.Caller}, de.Name, eo); st == fuse.OK && eo.NodeId != 0 {
			if eo.Attr.Mode&syscall.S_IFMT != de.Mode&syscall.S_IFMT {
				// It changed since the listing was taken.
				out.FixMode(eo.Attr.Mode)
			}
		} else {
			// Gone since: the kernel takes the name without
			// attributes (a node id of 0).
			*eo = fuse.EntryOut{}
		}
	}
	return fuse.OK
}

// dropListing forgets listing l of directory n.
func (n *node) dropListing(l *dirListing) {
	n.mu.Lock()
	defer n.mu.Unlock()
	if ls := n.listings; ls != nil {
		for i, k := range ls.kept {
			if k == l {
				ls.kept[i] = nil
			}
		}
	}
}

// listingAt returns the listing a read at offset off continues, taking a
// new one at offset 0 or when the one off names is no longer kept, and the
// index of the entry to return first.
func (n *node) listingAt(off uint64) (*dirListing, int, syscall.Errno) {
	serial, idx := uint32(off>>32), int(off&0xffffffff)
	if off != 0 {
		n.mu.Lock()
		if ls := n.listings; ls != nil {
			for _, k := range ls.kept {
				if k != nil && k.serial == serial {
					n.mu.Unlock()
					return k, idx, 0
				}
			}
		}
		n.mu.Unlock()
	}
	list, err := n.ov.list(n)
	if err != nil {
		return nil, 0, errnoOf(err)
	}
	parentIno := n.ino
	if p, _, ok := n.parent(); ok {
		parentIno = p.ino
	}
	n.mu.Lock()
	if n.listings == nil {
		n.listings = &dirListings{}
	}
	ls := n.listings
	ls.serial = (ls.serial + 1) & (1<<31 - 1)
	if ls.serial == 0 {
		ls.serial = 1
	}
	l := &dirListing{serial: ls.serial}
	n.mu.Unlock()
	base := uint64(l.serial) << 32
	l.entries = make([]fuse.DirEntry, 0, len(list)+2)
	l.entries = append(l.entries,
		fuse.DirEntry{Name: ".", Mode: syscall.S_IFDIR, Ino: n.ino, Off: base | 1},
		fuse.DirEntry{Name: "..", Mode: syscall.S_IFDIR, Ino: parentIno, Off: base | 2})
	for i, e := range list {
		l.entries = append(l.entries, fuse.DirEntry{Name: e.name, Mode: e.mode, Ino: e.ino, Off: base | uint64(i+3)})
	}
	n.mu.Lock()
	copy(ls.kept[1:], ls.kept[:keptListings-1])
	ls.kept[0] = l
	n.mu.Unlock()
	if off == 0 {
		idx = 0
	}
	return l, idx, 0
}
