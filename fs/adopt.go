package fs

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	iofs "io/fs"
	"os"
	"path"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/hermesfs/hermesfs/archive"
)

// Files written underneath a mount.
//
// While no daemon runs, the mountpoint directory is an ordinary directory:
// a writer that outlived the stop, or an agent started before the mount,
// writes into it, and the next mount would cover what it wrote. Adopt
// takes such files into the upper layer before the mount, as changes over
// the lower layer, so that they are in the merged tree and in the next
// snapshot. It never replaces anything: a file whose merged path holds
// something else (a different file, a directory, a guarded memory file)
// is put beside it under a new name, and the directory underneath is left
// as it was (copied from, never moved or changed). A name gone from the
// directory underneath is not a deletion in the merged tree: what a
// directory holds when no mount covers it is not the home.

// AdoptOptions says what Adopt takes and where it puts what it cannot
// put at its own path.
type AdoptOptions struct {
	// Since: an entry whose status last changed (ctime) before it was
	// there when the directory was last accounted for (packed by a first
	// snapshot, or looked at by an earlier Adopt) and is left alone; one
	// changed at it or after is looked at. Take it from the ctime of a
	// file made just before the look, not from a clock read: ctime comes
	// from the kernel's coarse clock. Zero takes every entry.
	Since time.Time
	// Stamp ends the name of a copy put beside what it would replace:
	// NAME.underneath-STAMP (then -2, -3... if taken).
	Stamp string
	// Beside, if set, reports merged paths that adoption must never
	// create or replace (the Guard's files, whose content only the Guard
	// may let in): what would go there goes beside them.
	Beside func(rel string) bool
}

// Adopted is one entry Adopt put into the merged tree.
type Adopted struct {
	Path string `json:"path"`           // where it is in the merged tree ("dir/" for a directory)
	From string `json:"from,omitempty"` // its path underneath, when not Path (a copy beside)
	Size int64  `json:"size"`
}

// Adopt copies into the upper layer directory upper, over lower (nil for
// none), the entries of directory dir that changed after opts.Since:
// regular files, symlinks and directories (sockets, fifos and devices
// hold no data and are left). dir must not be covered by a mount of upper
// (read it before mounting). A file whose merged path holds the same
// content is not copied. Each copy is durable (synced, renamed into place,
// its directory synced) before the next one; on an error what was adopted
// so far stays adopted and is returned with it. The mount then shows the
// entries as changes like any other, and the next snapshot holds them.
func Adopt(ctx context.Context, dir, upper string, lower Lower, opts AdoptOptions) ([]Adopted, error) {
	src, err := unix.Open(dir, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("fs: adopt from %s: %w", dir, err)
	}
	defer unix.Close(src)
	root, err := unix.Open(upper, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("fs: adopt into %s: %w", upper, err)
	}
	defer unix.Close(root)
	a := &adopter{ctx: ctx, upper: upper, lower: lower, opts: opts, root: root, work: -1}
	defer a.close()
	err = a.walk(src, "", "")
	if err != nil {
		err = fmt.Errorf("fs: adopt from %s: %w", dir, err)
	}
	return a.out, err
}

// ChangedUnderneath reports whether directory dir holds anything Adopt
// with opts.Since = since would look at: a regular file, symlink or
// directory, at any depth, whose status changed at since or after (any
// one when since is zero). It may say so of an entry Adopt then finds the
// same as the merged tree's; it never misses one Adopt would take. It only
// reads dir, which may be covered by a mount when named through a
// descriptor opened before it ("/proc/self/fd/N"): the daemon asks it,
// with the home shown over the directory, whether the mount must be made
// again for Adopt to run.
func ChangedUnderneath(ctx context.Context, dir string, since time.Time) (bool, error) {
	fd, err := unix.Open(dir, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return false, fmt.Errorf("fs: look underneath %s: %w", dir, err)
	}
	changed, err := changedBelow(ctx, fd, "", since)
	if err != nil {
		err = fmt.Errorf("fs: look underneath %s: %w", dir, err)
	}
	return changed, err
}

// changedBelow is ChangedUnderneath of directory fd (rel underneath),
// which it closes.
func changedBelow(ctx context.Context, fd int, rel string, since time.Time) (bool, error) {
	df := os.NewFile(uintptr(fd), rel)
	defer df.Close()
	names, err := df.Readdirnames(-1)
	if err != nil {
		return false, fmt.Errorf("list %q: %w", orDot(rel), err)
	}
	sort.Strings(names)
	for _, name := range names {
		if err := ctx.Err(); err != nil {
			return false, err
		}
		if isReserved(name) {
			continue
		}
		var st unix.Stat_t
		if err := unix.Fstatat(fd, name, &st, unix.AT_SYMLINK_NOFOLLOW); err != nil {
			if err == unix.ENOENT {
				continue
			}
			return false, fmt.Errorf("stat %q: %w", joinAdopt(rel, name), err)
		}
		switch st.Mode & syscall.S_IFMT {
		case syscall.S_IFDIR, syscall.S_IFREG, syscall.S_IFLNK:
		default:
			continue // Adopt leaves them
		}
		if since.IsZero() || st.Ctim.Nano() >= since.UnixNano() {
			return true, nil
		}
		if st.Mode&syscall.S_IFMT != syscall.S_IFDIR {
			continue
		}
		sub, err := unix.Openat(fd, name, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
		if err != nil {
			if err == unix.ENOENT || err == unix.ENOTDIR {
				continue
			}
			return false, fmt.Errorf("open %q: %w", joinAdopt(rel, name), err)
		}
		if changed, err := changedBelow(ctx, sub, joinAdopt(rel, name), since); err != nil || changed {
			return changed, err
		}
	}
	return false, nil
}

type adopter struct {
	ctx   context.Context
	upper string
	lower Lower
	opts  AdoptOptions
	root  int // O_PATH of the upper root
	work  int // the work directory, opened when first needed
	seq   int
	out   []Adopted
}

func (a *adopter) close() {
	if a.work >= 0 {
		unix.Close(a.work)
	}
}

// kind of a merged path.
const (
	mergedAbsent = iota
	mergedDir
	mergedOther
)

// merged resolves rel in the merged tree: its kind and, when it exists,
// what the layer walker found.
func (a *adopter) merged(rel string) (int, found, *layerWalker, error) {
	l := &layerWalker{lower: a.lower, udir: -1}
	fd, err := unix.Openat(a.root, ".", unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return 0, found{}, nil, err
	}
	l.udir = fd
	if a.lower != nil {
		l.ldir = a.lower.Root()
	}
	els := splitPath(rel)
	for _, el := range els[:len(els)-1] {
		if err := l.enter(el); err != nil {
			l.close()
			if errors.Is(err, iofs.ErrNotExist) {
				return mergedAbsent, found{}, nil, nil
			}
			if errors.Is(err, syscall.ENOTDIR) || errors.Is(err, syscall.ELOOP) {
				// Beside something that is not a directory: a name
				// below it is free in the merged tree, but cannot be
				// made; walk maps such directories beside it first.
				return mergedOther, found{}, nil, nil
			}
			return 0, found{}, nil, err
		}
	}
	f, err := l.lookup(els[len(els)-1])
	if errors.Is(err, iofs.ErrNotExist) {
		l.close()
		return mergedAbsent, f, nil, nil
	}
	if err != nil {
		l.close()
		return 0, f, nil, err
	}
	isDir := f.upper && f.ust.mode&syscall.S_IFMT == syscall.S_IFDIR || !f.upper && f.la.Mode.IsDir()
	if isDir {
		return mergedDir, f, l, nil
	}
	return mergedOther, f, l, nil
}

// beside is a free merged name next to rel for what cannot go at rel.
func (a *adopter) beside(rel string) (string, error) {
	dir, base := path.Split(rel)
	suffix := ".underneath-" + a.opts.Stamp
	for i := 1; ; i++ {
		s := suffix
		if i > 1 {
			s += "-" + strconv.Itoa(i)
		}
		b := base
		if len(b)+len(s) > nameMax {
			b = b[:nameMax-len(s)]
		}
		cand := dir + b + s
		k, _, l, err := a.merged(cand)
		if l != nil {
			l.close()
		}
		if err != nil {
			return "", err
		}
		if k == mergedAbsent {
			return cand, nil
		}
	}
}

// besides lists the merged names beside d (NAME.underneath-...), with a
// walker standing in d's directory (nil when that directory is not in the
// merged tree); the caller closes it.
func (a *adopter) besides(d string) (*layerWalker, []string, error) {
	dir, base := path.Split(d)
	dir = path.Clean(dir)
	prefix := base + ".underneath-"
	if len(prefix) > nameMax {
		return nil, nil, nil
	}
	l := &layerWalker{lower: a.lower, udir: -1}
	fd, err := unix.Openat(a.root, ".", unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, nil, err
	}
	l.udir = fd
	if a.lower != nil {
		l.ldir = a.lower.Root()
	}
	if dir != "." {
		for _, el := range splitPath(dir) {
			if err := l.enter(el); err != nil {
				l.close()
				if errors.Is(err, iofs.ErrNotExist) || errors.Is(err, syscall.ENOTDIR) || errors.Is(err, syscall.ELOOP) {
					return nil, nil, nil
				}
				return nil, nil, err
			}
		}
	}
	var names []string
	if l.udir >= 0 {
		lfd, err := unix.Openat(l.udir, ".", unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
		if err != nil {
			l.close()
			return nil, nil, err
		}
		un, err := readNames(lfd)
		unix.Close(lfd)
		if err != nil {
			l.close()
			return nil, nil, err
		}
		names = append(names, un...)
	}
	if l.ldir != 0 {
		ents, err := a.lower.ReadDir(l.ldir)
		if err != nil {
			l.close()
			return nil, nil, err
		}
		for _, e := range ents {
			names = append(names, e.Name)
		}
	}
	sort.Strings(names)
	var out []string
	for i, n := range names {
		if strings.HasPrefix(n, prefix) && (i == 0 || names[i-1] != n) {
			out = append(out, n)
		}
	}
	return l, out, nil
}

// besideAlready reports whether a copy beside d holds what name of sfd
// holds (an earlier look took it in, and it has not changed since).
func (a *adopter) besideAlready(sfd int, name string, st *unix.Stat_t, d string) (bool, error) {
	l, names, err := a.besides(d)
	if l == nil || err != nil {
		return false, err
	}
	defer l.close()
	for _, n := range names {
		f, err := l.lookup(n)
		if errors.Is(err, iofs.ErrNotExist) {
			continue
		}
		if err != nil {
			return false, err
		}
		if same, err := a.same(sfd, name, st, l, n, f); err != nil || same {
			return same, err
		}
	}
	return false, nil
}

// besideDir is a directory beside d an earlier look made ("" if none):
// what a directory underneath holds goes on into it.
func (a *adopter) besideDir(d string) (string, error) {
	l, names, err := a.besides(d)
	if l == nil || err != nil {
		return "", err
	}
	defer l.close()
	for _, n := range names {
		f, err := l.lookup(n)
		if errors.Is(err, iofs.ErrNotExist) {
			continue
		}
		if err != nil {
			return "", err
		}
		if f.upper && f.ust.mode&syscall.S_IFMT == syscall.S_IFDIR || !f.upper && f.la.Mode.IsDir() {
			return path.Join(path.Dir(d), n), nil
		}
	}
	return "", nil
}

func joinAdopt(dir, name string) string {
	if dir == "" {
		return name
	}
	return dir + "/" + name
}

// walk adopts what directory sfd (srel underneath) holds into merged
// directory drel.
func (a *adopter) walk(sfd int, srel, drel string) error {
	dup, err := unix.Dup(sfd)
	if err != nil {
		return err
	}
	df := os.NewFile(uintptr(dup), srel)
	names, err := df.Readdirnames(-1)
	df.Close()
	if err != nil {
		return fmt.Errorf("list %q: %w", orDot(srel), err)
	}
	sort.Strings(names)
	since := a.opts.Since.UnixNano()
	for _, name := range names {
		if err := a.ctx.Err(); err != nil {
			return err
		}
		if isReserved(name) {
			continue // the overlay's namespace: no merged name can hold it
		}
		var st unix.Stat_t
		if err := unix.Fstatat(sfd, name, &st, unix.AT_SYMLINK_NOFOLLOW); err != nil {
			if err == unix.ENOENT {
				continue
			}
			return fmt.Errorf("stat %q: %w", joinAdopt(srel, name), err)
		}
		changed := a.opts.Since.IsZero() || st.Ctim.Nano() >= since
		s, d := joinAdopt(srel, name), joinAdopt(drel, name)
		switch st.Mode & syscall.S_IFMT {
		case syscall.S_IFDIR:
			if err := a.dir(sfd, name, s, d, &st, changed); err != nil {
				return err
			}
		case syscall.S_IFREG, syscall.S_IFLNK:
			if !changed {
				continue
			}
			if err := a.file(sfd, name, s, d, &st); err != nil {
				return err
			}
		}
	}
	return nil
}

// subtreeChanged reports whether directory name of sfd holds, at any
// depth, an entry walk would look at (its status changed at or after
// Since): stats only. An error says "changed": walk then looks and
// reports it.
func (a *adopter) subtreeChanged(sfd int, name string) (bool, error) {
	fd, err := unix.Openat(sfd, name, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return true, err
	}
	df := os.NewFile(uintptr(fd), name)
	defer df.Close()
	names, err := df.Readdirnames(-1)
	if err != nil {
		return true, err
	}
	since := a.opts.Since.UnixNano()
	for _, n := range names {
		if err := a.ctx.Err(); err != nil {
			return true, err
		}
		if isReserved(n) {
			continue
		}
		var st unix.Stat_t
		if err := unix.Fstatat(fd, n, &st, unix.AT_SYMLINK_NOFOLLOW); err != nil {
			if err == unix.ENOENT {
				continue
			}
			return true, err
		}
		switch st.Mode & syscall.S_IFMT {
		case syscall.S_IFDIR:
			if st.Ctim.Nano() >= since {
				return true, nil
			}
			if c, err := a.subtreeChanged(fd, n); err != nil || c {
				return true, err
			}
		case syscall.S_IFREG, syscall.S_IFLNK:
			if st.Ctim.Nano() >= since {
				return true, nil
			}
		}
	}
	return false, nil
}

func orDot(rel string) string {
	if rel == "" {
		return "."
	}
	return rel
}

// dir adopts directory name of sfd (s underneath) at merged path d, or
// beside it when d is not a directory, and walks into it.
func (a *adopter) dir(sfd int, name, s, d string, st *unix.Stat_t, changed bool) error {
	if !changed {
		// Most of what lies underneath (the home the first snapshot was
		// packed from) is as it was: find that with stats alone, without
		// resolving every directory in the merged tree (which reads the
		// lower layer's listings).
		if c, err := a.subtreeChanged(sfd, name); err == nil && !c {
			return nil
		}
	}
	k, _, l, err := a.merged(d)
	if l != nil {
		l.close()
	}
	if err != nil {
		return fmt.Errorf("look up %q: %w", d, err)
	}
	if k == mergedOther {
		prev, err := a.besideDir(d)
		switch {
		case err != nil:
			return err
		case prev != "":
			d, k = prev, mergedDir
		default:
			if d, err = a.beside(d); err != nil {
				return err
			}
			k = mergedAbsent
		}
	}
	made := false
	if k == mergedAbsent && changed {
		fd, err := a.mkdirs(d, st)
		if err != nil {
			return fmt.Errorf("make %q: %w", d, err)
		}
		unix.Close(fd)
		made = true
	}
	sub, err := unix.Openat(sfd, name, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		if err == unix.ENOENT || err == unix.ENOTDIR {
			return nil
		}
		return fmt.Errorf("open %q: %w", s, err)
	}
	defer unix.Close(sub)
	before := len(a.out)
	err = a.walk(sub, s, d)
	if made && len(a.out) == before {
		// Named only when nothing below it is: a file's directories go
		// without saying.
		a.out = append(a.out, Adopted{Path: d + "/", From: fromIf(s, d)})
	}
	return err
}

func fromIf(s, d string) string {
	if s == d {
		return ""
	}
	return s
}

// file adopts regular file or symlink name of sfd (s underneath) at
// merged path d, or beside it, unless d holds the same already.
func (a *adopter) file(sfd int, name, s, d string, st *unix.Stat_t) error {
	k, fo, l, err := a.merged(d)
	if err != nil {
		return fmt.Errorf("look up %q: %w", d, err)
	}
	same := false
	if k == mergedOther && l != nil {
		same, err = a.same(sfd, name, st, l, d, fo)
	}
	if l != nil {
		l.close()
	}
	if err != nil {
		return fmt.Errorf("compare %q with %q: %w", s, d, err)
	}
	if same {
		return nil
	}
	if k != mergedAbsent || a.opts.Beside != nil && a.opts.Beside(d) {
		// Put beside it already (an earlier look took it in, and it
		// has not changed since)?
		if done, err := a.besideAlready(sfd, name, st, d); err != nil || done {
			return err
		}
		if d, err = a.beside(d); err != nil {
			return err
		}
	}
	if err := a.copyIn(sfd, name, st, d); err != nil {
		return fmt.Errorf("copy %q to %q: %w", s, d, err)
	}
	a.out = append(a.out, Adopted{Path: d, From: fromIf(s, d), Size: st.Size})
	return nil
}

// same reports whether merged entry fo (at d, found by l) holds what
// name of sfd holds: the same kind and bytes (a symlink's target).
func (a *adopter) same(sfd int, name string, st *unix.Stat_t, l *layerWalker, d string, fo found) (bool, error) {
	kind := uint32(st.Mode & syscall.S_IFMT)
	var mkind uint32
	var size int64
	if fo.upper {
		mkind, size = fo.ust.mode&syscall.S_IFMT, fo.ust.size
	} else {
		mkind, size = fileModeToUnix(fo.la.Mode)&syscall.S_IFMT, fo.la.Size
	}
	if kind != mkind || kind == syscall.S_IFREG && size != st.Size {
		return false, nil
	}
	base := path.Base(d)
	if kind == syscall.S_IFLNK {
		target, err := readlinkAt(sfd, name)
		if err != nil {
			return false, err
		}
		var mt string
		if fo.upper {
			mt, err = readlinkAt(l.udir, base)
		} else {
			mt, err = a.lower.Readlink(fo.la.Ino)
		}
		return err == nil && mt == target, err
	}
	fd, err := unix.Openat(sfd, name, unix.O_RDONLY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return false, err
	}
	defer unix.Close(fd)
	var other func(p []byte, off int64) (int, error)
	if fo.upper {
		ufd, err := unix.Openat(l.udir, base, unix.O_RDONLY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
		if err != nil {
			return false, err
		}
		defer unix.Close(ufd)
		other = func(p []byte, off int64) (int, error) { return preadFull(ufd, p, off) }
	} else {
		ino := fo.la.Ino
		other = func(p []byte, off int64) (int, error) { return a.lower.ReadAt(ino, p, off) }
	}
	b1, b2 := make([]byte, 1<<20), make([]byte, 1<<20)
	for off := int64(0); off < st.Size; off += int64(len(b1)) {
		n := int(min(int64(len(b1)), st.Size-off))
		k1, err := preadFull(fd, b1[:n], off)
		if err != nil {
			return false, err
		}
		k2, err := other(b2[:n], off)
		if err != nil && err != io.EOF {
			return false, err
		}
		if k1 != n || k2 != n || !bytes.Equal(b1[:n], b2[:n]) {
			return false, nil
		}
	}
	return true, nil
}

func readlinkAt(dfd int, name string) (string, error) {
	buf := make([]byte, 4096)
	n, err := unix.Readlinkat(dfd, name, buf)
	if err != nil {
		return "", err
	}
	return string(buf[:n]), nil
}

// workDir opens (making it if missing) the upper layer's work directory.
func (a *adopter) workDir() (int, error) {
	if a.work >= 0 {
		return a.work, nil
	}
	if err := unix.Mkdirat(a.root, workDirName, 0o700); err != nil && err != unix.EEXIST {
		return -1, err
	}
	fd, err := unix.Openat(a.root, workDirName, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return -1, err
	}
	a.work = fd
	return fd, nil
}

func (a *adopter) tmpName() string {
	a.seq++
	return tmpPrefix + "adopt." + strconv.Itoa(a.seq) + "." + strconv.FormatInt(time.Now().UnixNano(), 36)
}

// mkdirs makes merged directory rel and those above it exist in the
// upper layer, and returns an O_PATH descriptor of it. A directory the
// lower layer has is made as a copy-up makes it (its mode, owner and
// times, merging the lower one); one it does not have (or whose name is
// whited out) takes st's attributes and merges nothing (opaque where a
// lower one was deleted). st may be nil for the directories above.
func (a *adopter) mkdirs(rel string, st *unix.Stat_t) (int, error) {
	udir, err := unix.Openat(a.root, ".", unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return -1, err
	}
	var ldir archive.Inode
	if a.lower != nil {
		ldir = a.lower.Root()
	}
	els := splitPath(rel)
	for i, el := range els {
		var here *unix.Stat_t
		if i == len(els)-1 {
			here = st
		}
		next, nl, err := a.mkdir(udir, ldir, el, here)
		unix.Close(udir)
		if err != nil {
			return -1, err
		}
		udir, ldir = next, nl
	}
	return udir, nil
}

// mkdir makes merged directory name exist in upper directory udir (which
// merges lower directory ldir, 0 for none) and opens it.
func (a *adopter) mkdir(udir int, ldir archive.Inode, name string, st *unix.Stat_t) (int, archive.Inode, error) {
	ust, err := statxAt(udir, name)
	if err == nil {
		if ust.mode&syscall.S_IFMT != syscall.S_IFDIR {
			return -1, 0, syscall.ENOTDIR
		}
		sub, err := unix.Openat(udir, name, unix.O_PATH|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
		if err != nil {
			return -1, 0, err
		}
		m, err := readDirMarkers(sub)
		if err != nil {
			unix.Close(sub)
			return -1, 0, err
		}
		var next archive.Inode
		switch {
		case m.hasRedir:
			if la, err := lowerWalk(a.lower, m.redirect); err == nil && la.Mode.IsDir() {
				next = la.Ino
			}
		case m.opaque:
		case ldir != 0:
			if la, err := a.lower.Lookup(ldir, name); err == nil && la.Mode.IsDir() {
				next = la.Ino
			}
		}
		return sub, next, nil
	}
	if err != unix.ENOENT {
		return -1, 0, err
	}
	wo, err := whitedOut(udir, name)
	if err != nil {
		return -1, 0, err
	}
	var la archive.Attr
	hasLower := false
	if ldir != 0 {
		if la, err = a.lower.Lookup(ldir, name); err == nil {
			hasLower = true
		} else if !errors.Is(err, iofs.ErrNotExist) {
			return -1, 0, err
		}
	}
	mode, uid, gid := uint32(0o755), -1, -1
	var times []unix.Timespec
	switch {
	case hasLower && !wo && la.Mode.IsDir():
		mode, uid, gid = fileModeToUnix(la.Mode)&07777, int(la.Uid), int(la.Gid)
		times = []unix.Timespec{unix.NsecToTimespec(la.Mtime.UnixNano()), unix.NsecToTimespec(la.Mtime.UnixNano())}
	case hasLower && !wo:
		return -1, 0, syscall.ENOTDIR
	case st != nil:
		mode, uid, gid = st.Mode&07777, int(st.Uid), int(st.Gid)
		times = []unix.Timespec{st.Atim, st.Mtim}
	}
	opaque := hasLower && wo // the lower one was deleted: merge nothing of it
	w, err := a.workDir()
	if err != nil {
		return -1, 0, err
	}
	tmp := a.tmpName()
	if err := unix.Mkdirat(w, tmp, 0o700); err != nil {
		return -1, 0, err
	}
	fail := func(err error) (int, archive.Inode, error) {
		unix.Unlinkat(w, tmp+"/"+opaqueMarker, 0)
		unix.Unlinkat(w, tmp, unix.AT_REMOVEDIR)
		return -1, 0, err
	}
	sub, err := unix.Openat(w, tmp, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return fail(err)
	}
	err = func() error {
		defer unix.Close(sub)
		if opaque {
			fd, err := unix.Openat(sub, opaqueMarker, unix.O_CREAT|unix.O_EXCL|unix.O_WRONLY|unix.O_CLOEXEC, 0o600)
			if err != nil {
				return err
			}
			unix.Close(fd)
		}
		if os.Geteuid() == 0 && uid >= 0 {
			if err := unix.Fchown(sub, uid, gid); err != nil {
				return err
			}
		}
		if err := unix.Fchmod(sub, mode); err != nil {
			return err
		}
		if times != nil {
			unix.UtimesNanoAt(sub, ".", times, 0)
		}
		return unix.Fsync(sub)
	}()
	if err != nil {
		return fail(err)
	}
	if err := unix.Renameat2(w, tmp, udir, name, unix.RENAME_NOREPLACE); err != nil {
		return fail(err)
	}
	if err := fsyncDir(udir); err != nil {
		return -1, 0, err
	}
	out, err := unix.Openat(udir, name, unix.O_PATH|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return -1, 0, err
	}
	var next archive.Inode
	if !opaque && hasLower {
		next = la.Ino
	}
	return out, next, nil
}

// copyIn copies name of sfd (status st) to merged path d, which is free:
// built in the work directory, synced, renamed into place.
func (a *adopter) copyIn(sfd int, name string, st *unix.Stat_t, d string) error {
	dir, base := splitRel(d)
	var pfd int
	var err error
	if dir == "" {
		pfd, err = unix.Openat(a.root, ".", unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	} else {
		pfd, err = a.mkdirs(dir, nil)
	}
	if err != nil {
		return err
	}
	defer unix.Close(pfd)
	w, err := a.workDir()
	if err != nil {
		return err
	}
	tmp := a.tmpName()
	if st.Mode&syscall.S_IFMT == syscall.S_IFLNK {
		target, err := readlinkAt(sfd, name)
		if err != nil {
			return err
		}
		if err := unix.Symlinkat(target, w, tmp); err != nil {
			return err
		}
		if os.Geteuid() == 0 {
			unix.Fchownat(w, tmp, int(st.Uid), int(st.Gid), unix.AT_SYMLINK_NOFOLLOW)
		}
		unix.UtimesNanoAt(w, tmp, []unix.Timespec{st.Atim, st.Mtim}, unix.AT_SYMLINK_NOFOLLOW)
	} else if err := copyRegular(sfd, name, w, tmp, st); err != nil {
		unix.Unlinkat(w, tmp, 0)
		return err
	}
	if err := unix.Renameat2(w, tmp, pfd, base, unix.RENAME_NOREPLACE); err != nil {
		unix.Unlinkat(w, tmp, 0)
		return err
	}
	return fsyncDir(pfd)
}

// copyRegular copies regular file name of sfd to tmp in w with st's mode,
// owner and times, durably.
func copyRegular(sfd int, name string, w int, tmp string, st *unix.Stat_t) error {
	in, err := unix.Openat(sfd, name, unix.O_RDONLY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return err
	}
	inf := os.NewFile(uintptr(in), name)
	defer inf.Close()
	out, err := unix.Openat(w, tmp, unix.O_CREAT|unix.O_EXCL|unix.O_WRONLY|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return err
	}
	outf := os.NewFile(uintptr(out), tmp)
	defer outf.Close()
	// io.Copy between files uses copy_file_range: a large file is not
	// carried through this process where the file system can help.
	if _, err := io.Copy(outf, inf); err != nil {
		return err
	}
	if os.Geteuid() == 0 {
		if err := unix.Fchown(out, int(st.Uid), int(st.Gid)); err != nil {
			return err
		}
	}
	if err := unix.Fchmod(out, st.Mode&07777); err != nil {
		return err
	}
	if err := unix.UtimesNanoAt(w, tmp, []unix.Timespec{st.Atim, st.Mtim}, 0); err != nil {
		return err
	}
	return unix.Fsync(out)
}
