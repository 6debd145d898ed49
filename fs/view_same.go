package fs

import "syscall"

// SameAsLower reports whether the frozen tree is the lower layer's tree,
// directory times aside: at the freeze the upper layer held no entry but
// directories that the lower layer has at the same path, with the same
// mode and owner, and no whiteout, opaque directory or redirected one.
// That is what a session that changed nothing leaves behind, whatever it
// created and removed meanwhile: SQLite creates and removes a database's
// -wal and -shm even for a query, which moves the generation and the
// times of their directory, and leaves nothing else (a name the lower
// layer never had leaves no whiteout). The upper root's own mode and
// owner are compared with the lower root's; with no lower layer, the tree
// is the same as it when the upper root holds no entry.
//
// It reads only the upper layer's listings (cached by the view for
// whoever reads it next) and stops at the first difference.
func (v *View) SameAsLower() (bool, error) {
	root, err := v.rootObj()
	if err != nil {
		return false, err
	}
	if v.lower != nil {
		if same, err := v.sameAttrs(&root); err != nil || !same {
			return false, err
		}
	}
	return v.sameBelow(&root)
}

// sameBelow reports whether the upper listing of directory d holds only
// directories that are SameAsLower, recursively.
func (v *View) sameBelow(d *vobj) (bool, error) {
	dir := d.dir
	if len(dir.hidden) > 0 || dir.opaque || dir.hasRedirect {
		return false, nil
	}
	for i := range dir.ents {
		if dir.ents[i].kind != syscall.S_IFDIR {
			return false, nil
		}
		c, err := v.child(d, dir.ents[i].name)
		if err != nil || c.lower == 0 {
			return false, err
		}
		if same, err := v.sameAttrs(&c); err != nil || !same {
			return false, err
		}
		if same, err := v.sameBelow(&c); err != nil || !same {
			return false, err
		}
	}
	return true, nil
}

// sameAttrs reports whether upper directory o has the mode and owner of
// the lower directory it merges: what a pack of the view records of it,
// times aside.
func (v *View) sameAttrs(o *vobj) (bool, error) {
	u, err := v.attrs(o.up, o.path)
	if err != nil {
		return false, err
	}
	a := &o.lattr
	return u.mode == fileModeToUnix(a.Mode) && u.uid == a.Uid && u.gid == a.Gid, nil
}
