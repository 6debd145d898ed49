package fs

import (
	"context"
	"syscall"
	"time"

	fusefs "github.com/hanwen/go-fuse/v2/fs"
	"golang.org/x/sys/unix"
)

// Rename moves name in n to newName in newParent. Lower objects are copied
// up first (a file with its content, a directory as an empty upper directory
// that keeps merging its lower one), so renaming lower files and whole lower
// directories works and never returns EXDEV.
//
// A directory that moves takes its merge source with it: before the move it
// gets a redirect marker naming the lower directory it merges (or an opaque
// marker if it merges none), so at its new place it shows the same children
// and nothing of a lower directory that may lie there. The old place gets a
// whiteout when the lower layer has that name. Both markers are durable
// before the rename; until the rename, the upper entry hides the whiteout.
//
// Rename (guard_moves.go) first asks a GuardMover about guarded paths.
func (n *node) rename(ctx context.Context, name string, newParent fusefs.InodeEmbedder, newName string, flags uint32) syscall.Errno {
	ov := n.ov
	if ov.opts.ReadOnly {
		return syscall.EROFS
	}
	np, ok := newParent.(*node)
	if !ok {
		return syscall.EXDEV
	}
	if isReserved(name) {
		return syscall.EINVAL
	}
	if errno := checkNewName(newName); errno != 0 {
		return errno
	}
	if flags&^(unix.RENAME_NOREPLACE|unix.RENAME_EXCHANGE) != 0 {
		return syscall.EINVAL
	}
	exchange := flags&unix.RENAME_EXCHANGE != 0

	srcIn := n.GetChild(name)
	if srcIn == nil {
		return syscall.ENOENT
	}
	src, ok := srcIn.Operations().(*node)
	if !ok {
		return syscall.EIO
	}
	var dst *node
	if ch := np.GetChild(newName); ch != nil {
		dst, _ = ch.Operations().(*node)
	}
	if dst == src {
		// Two names of one inode: rename(2) does nothing.
		return 0
	}

	// Everything that can fail on content happens before any change.
	if errno := ov.checkRenameGuard(ctx, src, np, newName, dst, exchange); errno != 0 {
		return errno
	}
	if err := ov.copyUp(ctx, src, true); err != nil {
		return errnoOf(err)
	}
	if exchange {
		if dst == nil {
			return syscall.ENOENT
		}
		if err := ov.copyUp(ctx, dst, true); err != nil {
			return errnoOf(err)
		}
	} else if err := ov.copyUpDeferred(ctx, dst); err != nil {
		return errnoOf(err)
	}
	sfd, srel, errno := n.prepDir(ctx)
	if errno != 0 {
		return errno
	}
	defer ov.u.put(sfd)
	dfd, drel, errno := np.prepDir(ctx)
	if errno != 0 {
		return errno
	}
	defer ov.u.put(dfd)

	// A guarded destination must not receive a file someone can still
	// write through an open descriptor.
	if ov.guard != nil && ov.guard.Guarded(joinRel(drel, newName)) && !src.settleOpens() {
		return syscall.EBUSY
	}

	if !ov.gate.enter() {
		return errSealed
	}
	defer ov.gate.leave()

	se, err := ov.resolve(n, sfd, name)
	if err != nil {
		return errnoOf(err)
	}
	if !se.upper {
		return syscall.ENOENT
	}
	de, err := ov.resolve(np, dfd, newName)
	if err != nil {
		return errnoOf(err)
	}
	srcDir := se.ust.mode&syscall.S_IFMT == syscall.S_IFDIR
	// Both directories' entries change; the moved objects' markers and
	// links may too.
	if err := ov.keepDir(sfd); err != nil {
		return errnoOf(err)
	}
	if err := ov.keepDir(dfd); err != nil {
		return errnoOf(err)
	}
	keep := func(dfd int, name string, e *entry) error {
		if e.ust.mode&syscall.S_IFMT == syscall.S_IFDIR {
			// A directory that moves gets a marker; one renamed over
			// goes, with its whiteouts.
			return ov.keepDirAt(dfd, name)
		}
		ov.keepStat(&e.ust)
		return nil
	}
	if err := keep(sfd, name, &se); err != nil {
		return errnoOf(err)
	}
	if de.upper {
		if err := keep(dfd, newName, &de); err != nil {
			return errnoOf(err)
		}
	}

	if exchange {
		if !de.upper {
			return syscall.ENOENT
		}
		if srcDir {
			if err := ov.markMovingDir(sfd, name, src); err != nil {
				return errnoOf(err)
			}
		}
		if de.ust.mode&syscall.S_IFMT == syscall.S_IFDIR && dst != nil {
			if err := ov.markMovingDir(dfd, newName, dst); err != nil {
				return errnoOf(err)
			}
		}
		unlockNames, moves, errno := ov.renameNames(sfd, srel, name, dfd, drel, newName, &se, &de, true)
		if errno != 0 {
			return errno
		}
		unlock := ov.views.lockRenames()
		err := unix.Renameat2(sfd, name, dfd, newName, unix.RENAME_EXCHANGE)
		if err == nil {
			ov.logRename(sfd, srel, name, dfd, drel, newName, true)
		}
		unlock()
		ov.partials.finish(moves, err == nil)
		unlockNames()
		if err != nil {
			return errnoOf(err)
		}
		ov.changed(src.ino, 0)
		if dst != nil {
			ov.changed(dst.ino, 0)
		}
		return 0
	}

	if de.exists() {
		if flags&unix.RENAME_NOREPLACE != 0 {
			return syscall.EEXIST
		}
		dstDir := de.mode()&syscall.S_IFMT == syscall.S_IFDIR
		switch {
		case srcDir && !dstDir:
			return syscall.ENOTDIR
		case !srcDir && dstDir:
			return syscall.EISDIR
		case dstDir:
			empty, err := ov.mergedEmpty(np, dfd, newName, dst, &de)
			if err != nil {
				return errnoOf(err)
			}
			if !empty {
				return syscall.ENOTEMPTY
			}
		}
	}

	if de.upper && !srcDir {
		// Before any change: a file renamed over that open views
		// cannot keep stays.
		if err := ov.views.beforeDestroy(dfd, newName, &de.ust); err != nil {
			return errnoOf(err)
		}
	}
	if srcDir {
		if err := ov.markMovingDir(sfd, name, src); err != nil {
			return errnoOf(err)
		}
	}
	if se.lowerIno != 0 {
		if err := ov.u.addWhiteout(sfd, name); err != nil {
			return errnoOf(err)
		}
	}
	if de.upper && (srcDir || de.ust.nlink <= 1) && dst != nil {
		dst.keepOrphan(dfd, newName)
	}
	unlockNames, moves, errno := ov.renameNames(sfd, srel, name, dfd, drel, newName, &se, &de, false)
	if errno != 0 {
		return errno
	}
	unlock := ov.views.lockRenames()
	err = unix.Renameat(sfd, name, dfd, newName)
	if (err == unix.ENOTEMPTY || err == unix.EEXIST) && de.upper && srcDir {
		// The destination directory is empty in the merged view but
		// holds markers: swap the two atomically, then remove the old
		// destination from its new place.
		if err = unix.Renameat2(sfd, name, dfd, newName, unix.RENAME_EXCHANGE); err == nil {
			err = ov.removeUpperDir(sfd, name)
		}
	}
	if err == nil {
		ov.logRename(sfd, srel, name, dfd, drel, newName, false)
	}
	unlock()
	ov.partials.finish(moves, err == nil)
	unlockNames()
	if err != nil {
		return errnoOf(err)
	}
	ov.changed(src.ino, 0)
	return 0
}

// renameNames takes the partial files' name lock for a rename of name in
// sfd (at srel) to newName in dfd (at drel), entries se and de, and
// records the names it moves as unknown until it is done (see
// partial_names.go); the caller calls partials.finish, then unlock.
func (ov *overlay) renameNames(sfd int, srel, name string, dfd int, drel, newName string, se, de *entry, exchange bool) (unlock func(), moves []nameMove, errno syscall.Errno) {
	unlock, excl := ov.partials.lockNames()
	if !excl {
		return unlock, nil, 0
	}
	var dst *ustat
	if de.upper {
		dst = &de.ust
	}
	isDir := func(st *ustat) bool { return st != nil && st.mode&syscall.S_IFMT == syscall.S_IFDIR }
	moves = ov.partials.renameMoves(ov.freshRel(sfd, srel, name), ov.freshRel(dfd, drel, newName), &se.ust, dst, isDir(&se.ust), isDir(dst), exchange)
	if err := ov.partials.prepare(moves); err != nil {
		unlock()
		ov.log.Error("rename", "err", err)
		return nil, nil, syscall.EIO
	}
	return unlock, moves, 0
}

// freshRel is the upper path of name in directory fd as the kernel knows
// it now (rel if it cannot say).
func (ov *overlay) freshRel(fd int, rel, name string) string {
	if r, ok := ov.u.relOf(fd); ok {
		rel = r
	}
	return joinRel(rel, name)
}

// settleOpens reports whether n has no handle open for writing or in
// passthrough. close(2) returns before the kernel's RELEASE reaches the
// daemon (it is sent in the background), so a writer that has just closed
// the file may still be counted: give such releases a moment to arrive.
func (n *node) settleOpens() bool {
	for wait := 100 * time.Microsecond; ; wait *= 2 {
		n.mu.Lock()
		busy := n.writers > 0 || n.ptOpens > 0
		n.mu.Unlock()
		if !busy {
			return true
		}
		if wait > 200*time.Millisecond {
			return false
		}
		time.Sleep(wait)
	}
}

// logRename tells open views about a rename, with the directories' paths
// as they are now: the paths found before the rename may be stale if an
// ancestor moved meanwhile (the descriptors are not).
func (ov *overlay) logRename(sfd int, srel, name string, dfd int, drel, newName string, exchange bool) {
	if !ov.views.active() {
		return
	}
	if r, ok := ov.u.relOf(sfd); ok {
		srel = r
	}
	if r, ok := ov.u.relOf(dfd); ok {
		drel = r
	}
	ov.views.renamed(joinRel(srel, name), joinRel(drel, newName), exchange)
}

// markMovingDir gives the upper directory name in dfd, about to move, a
// marker that keeps its merge source: a redirect to the lower directory it
// merges, or opaque if it merges none.
func (ov *overlay) markMovingDir(dfd int, name string, d *node) error {
	sub, err := unix.Openat(dfd, name, unix.O_PATH|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return err
	}
	defer unix.Close(sub)
	m, err := readDirMarkers(sub)
	if err != nil {
		return err
	}
	if m.hasRedir || m.opaque {
		return nil
	}
	if d != nil && d.lower != 0 {
		return ov.u.writeMarker(sub, redirectMarker, []byte(d.lowerPath))
	}
	fd, err := unix.Openat(sub, opaqueMarker, unix.O_CREAT|unix.O_WRONLY|unix.O_CLOEXEC|unix.O_NOFOLLOW, 0o600)
	if err != nil {
		return err
	}
	unix.Close(fd)
	return fsyncDir(sub)
}

// mergedEmpty reports whether directory name in d (entry e, node dn if the
// kernel knows it) has no visible entries.
func (ov *overlay) mergedEmpty(d *node, dfd int, name string, dn *node, e *entry) (bool, error) {
	if dn == nil {
		id, err := ov.identify(d, dfd, name, e)
		if err != nil {
			return false, err
		}
		dn = &node{ov: ov, kind: id.kind, ino: id.ino, lower: id.lower, lowerPath: id.lowerPath}
		dn.upper.Store(id.upper)
		if id.upper {
			// Not in the tree: list it through a node parented at d.
			return ov.mergedEmptyAt(dfd, name, dn)
		}
	}
	list, err := ov.list(dn)
	return len(list) == 0, err
}

// mergedEmptyAt lists a directory the kernel does not know, by its upper
// directory fd.
func (ov *overlay) mergedEmptyAt(dfd int, name string, dn *node) (bool, error) {
	sub, err := unix.Openat(dfd, name, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return false, err
	}
	defer unix.Close(sub)
	ents, err := readDirents(sub)
	if err != nil {
		return false, err
	}
	hidden := map[string]bool{}
	for _, de := range ents {
		if !isReserved(de.name) {
			return false, nil
		}
		if s, ok := whiteoutTarget(sub, de.name); ok {
			hidden[s] = true
		}
	}
	if dn.lower != 0 && ov.lower != nil {
		lents, err := ov.lower.ReadDir(dn.lower)
		if err != nil {
			return false, err
		}
		for _, le := range lents {
			if !hidden[le.Name] {
				return false, nil
			}
		}
	}
	return true, nil
}

// whiteoutTarget decodes a whiteout marker's name into the name it hides.
func whiteoutTarget(dirfd int, marker string) (string, bool) {
	switch {
	case !isReserved(marker):
		return "", false
	case marker == opaqueMarker || marker == redirectMarker || marker == workDirName || marker == inoMapName || marker == partialDirName:
		return "", false
	case len(marker) > len(hashedPrefix) && marker[:len(hashedPrefix)] == hashedPrefix:
		s, err := readSmall(dirfd, marker)
		return s, err == nil
	case !isReserved(marker[len(reservedPrefix):]):
		return marker[len(reservedPrefix):], true
	}
	return "", false
}
