package fs

import (
	"context"
	"errors"
	"fmt"
	"syscall"

	"golang.org/x/sys/unix"

	"github.com/hermesfs/hermesfs/archive"
)

// copyUpBuf is the chunk size of content copy-up.
const copyUpBuf = 1 << 20

// copyUpDir makes directory n exist in the upper layer, with its parents,
// keeping the lower directory's mode, owner and mtime. The new upper
// directory has no markers: it keeps merging the lower directory of the same
// path (relative to its parent's merge source).
func (ov *overlay) copyUpDir(ctx context.Context, n *node) error {
	if n.upper.Load() {
		return nil
	}
	if ov.opts.ReadOnly {
		return syscall.EROFS
	}
	p, name, ok := n.parent()
	if !ok {
		return syscall.ENOENT
	}
	if err := ov.copyUpDir(ctx, p); err != nil {
		return err
	}
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.upper.Load() {
		return nil
	}
	la, err := ov.lower.Stat(n.lower)
	if err != nil {
		return err
	}
	pfd, prel, err := p.dirFd(false)
	if err != nil {
		return err
	}
	defer ov.u.put(pfd)
	if !ov.gate.enter() {
		return errSealed
	}
	defer ov.gate.leave()
	if err := ov.keepDir(pfd); err != nil {
		return fmt.Errorf("fs: copy up %s/%s: %w", prel, name, err)
	}
	if err := ov.mkdirLike(pfd, name, &la); err != nil {
		return fmt.Errorf("fs: copy up %s/%s: %w", prel, name, err)
	}
	if st, err := statxAt(pfd, name); err == nil {
		n.uino.Store(st.ino)
	}
	n.upper.Store(true)
	ov.changed(n.ino, 0)
	return nil
}

// mkdirLike creates directory name in pfd with la's metadata, durably,
// unless it exists already. The gate is held.
func (ov *overlay) mkdirLike(pfd int, name string, la *archive.Attr) error {
	mode := fileModeToUnix(la.Mode) & 07777
	err := unix.Mkdirat(pfd, name, mode)
	if err == unix.EEXIST {
		return nil
	}
	if err != nil {
		return err
	}
	ov.bornAt(pfd, name)
	if ov.u.privileged {
		if err := unix.Fchownat(pfd, name, int(la.Uid), int(la.Gid), unix.AT_SYMLINK_NOFOLLOW); err != nil {
			return err
		}
	}
	if err := unix.Fchmodat(pfd, name, mode, 0); err != nil {
		return err
	}
	ts := timespec(la.Mtime)
	if err := unix.UtimesNanoAt(pfd, name, []unix.Timespec{ts, ts}, unix.AT_SYMLINK_NOFOLLOW); err != nil {
		return err
	}
	return fsyncDir(pfd)
}

// copyUp makes non-directory n exist in the upper layer: its content (unless
// content is false, for an object about to be truncated to nothing), mode,
// owner and mtime, under its lower inode number. The copy is made in the
// work directory, synced, recorded in the inode map and renamed into place,
// so a crash leaves either the lower object or the complete copy.
func (ov *overlay) copyUp(ctx context.Context, n *node, content bool) error {
	if n.upper.Load() {
		return nil
	}
	if ov.opts.ReadOnly {
		return syscall.EROFS
	}
	// The FUSE request's context ends with any signal to the caller
	// (SIGURG included); a copy-up, once started, is finished.
	ctx = context.WithoutCancel(ctx)
	if n.isDir() {
		return ov.copyUpDir(ctx, n)
	}
	defer ov.opts.Stats.copyUpStarted()()
	p, name, ok := n.parent()
	if !ok {
		return syscall.ENOENT
	}
	if err := ov.copyUpDir(ctx, p); err != nil {
		return err
	}
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.upper.Load() {
		return nil
	}
	if ov.gate.sealed.Load() {
		return errSealed // nothing to copy for
	}
	la, err := ov.lower.Stat(n.lower)
	if err != nil {
		return err
	}
	pfd, prel, err := p.dirFd(false)
	if err != nil {
		return err
	}
	defer ov.u.put(pfd)
	rel := joinRel(prel, name)

	tmp := ov.u.tmpName()
	byRange := content && ov.byRange(&la, rel)
	if err := ov.copyLowerTo(ctx, tmp, n.lower, &la, content && !byRange, byRange); err != nil {
		unix.Unlinkat(ov.u.work, tmp, 0)
		return fmt.Errorf("fs: copy up %s: %w", rel, err)
	}
	st, err := statxAt(ov.u.work, tmp)
	if err == nil {
		err = ov.inos.put(st.ino, inoRec{btime: st.btime, ino: n.ino, gen: 1})
	}
	var part *partial
	if err == nil && byRange {
		// The sparse file at the lower size, then its map, durable
		// before the file gets its name: an upper file without a map
		// is whole.
		part, err = ov.partials.create(&st, n.lower, &la, ov.opts.CopyUpBlock, rel)
	}
	if err != nil {
		unix.Unlinkat(ov.u.work, tmp, 0)
		return fmt.Errorf("fs: copy up %s: %w", rel, err)
	}
	if !ov.gate.enter() {
		if part != nil {
			ov.partials.discard(part)
		}
		unix.Unlinkat(ov.u.work, tmp, 0)
		return errSealed
	}
	if part != nil {
		// Renames wait, so the name the map gets is the file's
		// (partial_names.go).
		ov.partials.nameMu.Lock()
	}
	err = ov.keepDir(pfd)
	if err == nil {
		err = unix.Renameat2(ov.u.work, tmp, pfd, name, unix.RENAME_NOREPLACE)
	}
	if err == nil {
		err = fsyncDir(pfd)
	}
	if err == nil {
		if part != nil {
			ov.partials.add(part)
			if r, ok := ov.u.relOf(pfd); ok && joinRel(r, name) != rel {
				// A directory above moved since the map was made.
				if err := part.setName(joinRel(r, name), true); err != nil {
					ov.log.Error("partial copy-up: recording the file's name failed; it is looked up again when next used", "path", rel, "err", err)
				}
			}
		}
		n.upper.Store(true)
		ov.born(st.ino)
		ov.changed(n.ino, st.size)
	}
	if part != nil {
		ov.partials.nameMu.Unlock()
	}
	ov.gate.leave()
	if err != nil {
		if part != nil {
			ov.partials.discard(part)
		}
		unix.Unlinkat(ov.u.work, tmp, 0)
		return fmt.Errorf("fs: copy up %s: %w", rel, err)
	}
	if part != nil {
		ov.partials.startCompletion(part, n)
	}
	if la.Nlink > 1 {
		if err := ov.copyUpAliases(ctx, n, rel); err != nil {
			ov.log.Warn("copy-up of hard link aliases incomplete", "path", rel, "err", err)
		}
	}
	return nil
}

// byRange reports whether lower file la, at rel, is copied up by range.
func (ov *overlay) byRange(la *archive.Attr, rel string) bool {
	if ov.partials == nil || ov.partials.dir < 0 || ov.opts.CopyUpByRangeMin < 0 || !la.Mode.IsRegular() || la.Size < ov.opts.CopyUpByRangeMin {
		return false
	}
	// A guarded file's staging reads its upper file whole.
	return ov.guard == nil || !ov.guard.Guarded(rel)
}

// copyLowerTo creates tmp in the work directory as a copy of lower inode ino
// (with sparse, of its size only: copy-up by range).
func (ov *overlay) copyLowerTo(ctx context.Context, tmp string, ino archive.Inode, la *archive.Attr, content, sparse bool) error {
	w := ov.u.work
	mode := fileModeToUnix(la.Mode)
	switch mode & syscall.S_IFMT {
	case syscall.S_IFREG:
		fd, err := unix.Openat(w, tmp, unix.O_CREAT|unix.O_EXCL|unix.O_RDWR|unix.O_CLOEXEC, 0o600)
		if err != nil {
			return err
		}
		defer unix.Close(fd)
		if content && la.Size > 0 {
			if err := ov.copyContent(ctx, fd, ino, la.Size); err != nil {
				return err
			}
		}
		if sparse {
			if err := unix.Ftruncate(fd, la.Size); err != nil {
				return err
			}
		}
		if ov.u.privileged {
			if err := unix.Fchown(fd, int(la.Uid), int(la.Gid)); err != nil {
				return err
			}
		}
		if err := unix.Fchmod(fd, mode&07777); err != nil {
			return err
		}
		ts := timespec(la.Mtime)
		if err := futimens(fd, []unix.Timespec{ts, ts}); err != nil {
			return err
		}
		return unix.Fsync(fd)
	case syscall.S_IFLNK:
		target, err := ov.lower.Readlink(ino)
		if err != nil {
			return err
		}
		if err := unix.Symlinkat(target, w, tmp); err != nil {
			return err
		}
	default:
		if err := unix.Mknodat(w, tmp, mode, int(la.Rdev)); err != nil {
			return err
		}
		if err := unix.Fchmodat(w, tmp, mode&07777, 0); err != nil {
			return err
		}
	}
	if ov.u.privileged {
		if err := unix.Fchownat(w, tmp, int(la.Uid), int(la.Gid), unix.AT_SYMLINK_NOFOLLOW); err != nil {
			return err
		}
	}
	ts := timespec(la.Mtime)
	return unix.UtimesNanoAt(w, tmp, []unix.Timespec{ts, ts}, unix.AT_SYMLINK_NOFOLLOW)
}

// copyContent copies size bytes of lower inode ino into fd, leaving holes
// where the content is zeros. Each chunk spans several archive blocks,
// which readLower decompresses in parallel: a large file's copy-up is
// bound by decompression.
func (ov *overlay) copyContent(ctx context.Context, fd int, ino archive.Inode, size int64) error {
	buf := make([]byte, copyUpBuf)
	for off := int64(0); off < size; {
		if err := ctx.Err(); err != nil {
			return err
		}
		want := min(int64(len(buf)), size-off)
		k, err := ov.readLower(ino, buf[:want], off)
		if int64(k) == want {
			err = nil // io.EOF with the last bytes
		} else if err == nil {
			err = fmt.Errorf("short read at %d", off+int64(k))
		}
		if err != nil {
			return err
		}
		if !allZero(buf[:k]) {
			if err := pwriteAll(fd, buf[:k], off); err != nil {
				return err
			}
		}
		off += int64(k)
	}
	return unix.Ftruncate(fd, size)
}

func allZero(b []byte) bool {
	for len(b) >= 8 {
		if b[0]|b[1]|b[2]|b[3]|b[4]|b[5]|b[6]|b[7] != 0 {
			return false
		}
		b = b[8:]
	}
	for _, c := range b {
		if c != 0 {
			return false
		}
	}
	return true
}

func pwriteAll(fd int, b []byte, off int64) error {
	for len(b) > 0 {
		k, err := unix.Pwrite(fd, b, off)
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			return err
		}
		b, off = b[k:], off+int64(k)
	}
	return nil
}

// copyUpAliases gives the other lower paths of a hard-linked lower file,
// now copied up at rel, upper links to the same upper inode, so all its
// names keep sharing one inode. An alias whose path no longer leads to the
// lower file by the same names (a parent renamed or deleted) is left alone.
func (ov *overlay) copyUpAliases(ctx context.Context, n *node, rel string) error {
	ov.aliasOnce.Do(func() { ov.aliases, ov.aliasErr = ov.indexAliases() })
	if ov.aliasErr != nil {
		return ov.aliasErr
	}
	for _, q := range ov.aliases[n.lower] {
		if q == rel {
			continue
		}
		if err := ov.linkAlias(ctx, n, rel, q); err != nil {
			return fmt.Errorf("alias %s: %w", q, err)
		}
	}
	return nil
}

// indexAliases walks the lower layer once for non-directories with more
// than one name.
func (ov *overlay) indexAliases() (map[archive.Inode][]string, error) {
	all := map[archive.Inode][]string{}
	var walk func(dir archive.Inode, prefix string) error
	walk = func(dir archive.Inode, prefix string) error {
		ents, err := ov.lower.ReadDir(dir)
		if err != nil {
			return err
		}
		for _, e := range ents {
			p := joinRel(prefix, e.Name)
			if e.Mode.IsDir() {
				if err := walk(e.Ino, p); err != nil {
					return err
				}
				continue
			}
			all[e.Ino] = append(all[e.Ino], p)
		}
		return nil
	}
	if err := walk(ov.lower.Root(), ""); err != nil {
		return nil, err
	}
	out := map[archive.Inode][]string{}
	for ino, paths := range all {
		if len(paths) > 1 {
			out[ino] = paths
		}
	}
	return out, nil
}

// linkAlias links the upper copy at rel to alias path q if q still shows the
// lower file itself.
func (ov *overlay) linkAlias(ctx context.Context, n *node, rel, q string) error {
	// Walk q through the merged tree: every directory on the way must be
	// found by name with the same lower directory behind it; directories
	// the kernel knows are copied up through their nodes, others by path.
	els := splitPath(q)
	cur, known, drel := ov.root, true, ""
	for i, el := range els {
		last := i == len(els)-1
		var cn *node
		if known {
			if ch := cur.GetChild(el); ch != nil {
				if cn, _ = ch.Operations().(*node); cn == nil {
					return nil
				}
			}
		}
		if cn != nil && !last {
			if !cn.isDir() {
				return nil
			}
			if err := ov.copyUpDir(ctx, cn); err != nil {
				return err
			}
			cur, drel = cn, joinRel(drel, el)
			continue
		}
		if cn != nil && cn != n {
			return nil
		}
		dfd, err := ov.u.dir(drel)
		if err != nil {
			return err
		}
		e, err := ov.resolve(cur, dfd, el)
		if err != nil {
			ov.u.put(dfd)
			return err
		}
		if last {
			ov.u.put(dfd)
			if !e.visibleLower() || e.lowerIno != n.lower {
				return nil
			}
			break
		}
		if !e.visibleLower() || !e.lowerAttr.Mode.IsDir() {
			ov.u.put(dfd)
			return nil
		}
		if !ov.gate.enter() {
			ov.u.put(dfd)
			return errSealed
		}
		err = ov.keepDir(dfd)
		if err == nil {
			err = ov.mkdirLike(dfd, el, &e.lowerAttr)
		}
		ov.gate.leave()
		ov.u.put(dfd)
		if err != nil {
			return err
		}
		next := &node{ov: ov, kind: syscall.S_IFDIR, lower: e.lowerIno, lowerPath: joinRel(cur.lowerPath, el), ino: uint64(e.lowerIno)}
		next.upper.Store(true)
		cur, known, drel = next, false, joinRel(drel, el)
	}
	srcDir, srcName := splitRel(rel)
	dstDir, dstName := splitRel(q)
	sfd, err := ov.u.dir(srcDir)
	if err != nil {
		return err
	}
	defer ov.u.put(sfd)
	dfd, err := ov.u.dir(dstDir)
	if err != nil {
		return err
	}
	defer ov.u.put(dfd)
	if !ov.gate.enter() {
		return errSealed
	}
	defer ov.gate.leave()
	if err := ov.keepDir(dfd); err != nil {
		return err
	}
	if err := ov.keepEntry(sfd, srcName); err != nil {
		return err
	}
	if err := unix.Linkat(sfd, srcName, dfd, dstName, 0); err != nil && !errors.Is(err, unix.EEXIST) {
		return err
	}
	return fsyncDir(dfd)
}
