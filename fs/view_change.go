package fs

import (
	"syscall"

	"github.com/hermesfs/hermesfs/archive"
)

// What a view knows of its change (archive.ChangeFS).
//
// The lower layer is immutable, and every change the overlay makes leaves
// a trace in the upper layer that lasts as long as the lower layer does:
// a changed lower object is copied up (and keeps its lower number in the
// inode map), a directory something changed in is copied up and stays
// (removing or renaming it leaves a whiteout or a redirect in its parent,
// never nothing), a deleted lower name leaves a whiteout. So an entry the
// frozen tree shows from the lower layer alone, with no upper object on
// it or below it, is that lower inode exactly, whatever happened since the
// mount, and a pack can take it from any image that holds the lower
// layer's inodes under their numbers without looking below it.

var _ archive.ChangeFS = (*View)(nil)

// BaseInode implements archive.ChangeFS in the lower layer's inode
// numbers: a pack may use it only with a Base that holds the lower
// layer's unchanged inodes under the lower layer's numbers (the lower
// archive itself, or an image packed from views of this upper layer over
// it by extending or compacting such an image: each keeps those numbers).
//
//   - An entry the frozen tree shows from the lower layer alone (no upper
//     object) is that lower inode, unchanged, with all that is below a
//     directory. Except a file with several names of which another was
//     copied up (its names under a renamed directory are left alone, see
//     "Copy-up" in doc.go): that copy claims the number too, so this name
//     says changed.
//   - A directory of the upper layer that merges a lower one (at its
//     place, or through a redirect) stands for it, changed: its entries,
//     markers or attributes may differ.
//   - A file of the upper layer whose inode map record keeps a lower
//     number (a copy-up, by range too, or a guarded file replaced by its
//     staged content) stands for that lower inode, changed.
//   - Everything else (born in the upper layer, an opaque directory,
//     files taken in from underneath) stands for none.
//
// The root is the upper root directory and so always changed: a pack
// lists it.
func (v *View) BaseInode(name string) (ino archive.Inode, unchanged, ok bool) {
	defer func() {
		if r := recover(); r != nil {
			// A bug: say "new" (the pack reads it) rather than
			// "unchanged" (the pack would trust it).
			v.ov.log.Error("snapshot view: internal error in BaseInode", "path", name, "panic", r)
			ino, unchanged, ok = 0, false, false
		}
	}()
	if v.lower == nil {
		return 0, false, false
	}
	o, err := v.resolve("baseinode", name)
	if err != nil {
		return 0, false, false
	}
	switch {
	case o.up == nil:
		if o.lower == 0 {
			return 0, false, false
		}
		if !o.lattr.Mode.IsDir() && o.lattr.Nlink > 1 && v.copiedUp(o.lower) {
			return o.lower, false, true
		}
		return o.lower, true, true
	case o.up.kind == syscall.S_IFDIR:
		if o.lower == 0 {
			return 0, false, false
		}
		return o.lower, false, true
	}
	u, err := v.attrs(o.up, o.path)
	if err != nil {
		return 0, false, false
	}
	if r, found := v.inos[u.ino]; found && r.btime == u.btime && r.ino != 0 && r.ino < upperInoBase {
		return archive.Inode(r.ino), false, true
	}
	return 0, false, false
}

// copiedUp reports whether lower inode ino was copied up (its number is
// kept by an upper file, as far as the inode map at the freeze says; a
// record of a copy deleted since counts too).
func (v *View) copiedUp(ino archive.Inode) bool {
	v.originsOnce.Do(func() {
		v.origins = map[archive.Inode]bool{}
		for _, r := range v.inos {
			if r.ino != 0 && r.ino < upperInoBase {
				v.origins[archive.Inode(r.ino)] = true
			}
		}
	})
	return v.origins[ino]
}
