package fs

import (
	"errors"
	"fmt"
	"io"
	iofs "io/fs"
	"os"
	"syscall"

	"golang.org/x/sys/unix"

	"github.com/hermesfs/hermesfs/archive"
)

// This file reads the layers without a mount: what the daemon needs to know
// about an upper layer before or beside mounting it, answered with the
// overlay's own rules so that nothing outside this package depends on how
// the upper layer is laid out.

// UpperHasChanges reports whether the upper layer directory upper holds any
// change to the merged tree: an entry, a whiteout, a marker. The overlay's
// own bookkeeping at the upper root (the inode map and the work directory,
// which every mount empties) changes nothing by itself. A missing directory
// holds no changes. The upper root's own attributes are not compared with
// the lower root's: a chmod of the mount root alone is not reported.
func UpperHasChanges(upper string) (bool, error) {
	f, err := os.Open(upper)
	if errors.Is(err, iofs.ErrNotExist) {
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("fs: upper %s: %w", upper, err)
	}
	defer f.Close()
	for {
		names, err := f.Readdirnames(64)
		for _, n := range names {
			if n != inoMapName && n != workDirName && n != partialDirName {
				return true, nil
			}
		}
		if err == io.EOF {
			return false, nil
		}
		if err != nil {
			return false, fmt.Errorf("fs: list upper %s: %w", upper, err)
		}
	}
}

// ReadFile returns the content of the regular file at rel (a slash-separated
// io/fs path, "memories/MEMORY.md") in the merged tree of the upper layer
// directory upper over lower (nil for none), read from the layers
// themselves, never through a mountpoint: a Guard may call it while the
// overlay waits for its verdict. It resolves rel as the mounted overlay
// does: an upper entry hides the lower one, a whiteout hides a lower name,
// an opaque directory merges nothing below it, and a renamed directory
// merges the lower directory it came from.
//
// A missing name fails with an error matching errors.Is(err,
// io/fs.ErrNotExist). Symlinks are not followed, not even inside the tree
// (a link may lead back through the mountpoint): a symlink at or on the way
// to rel fails with an error matching syscall.ELOOP. A directory fails with
// one matching syscall.EISDIR, a path through a non-directory with
// syscall.ENOTDIR. If the mount is live, the result is the file as it is at
// some instant of the call, like a read through the mount.
func ReadFile(upper string, lower Lower, rel string) ([]byte, error) {
	fail := func(err error) ([]byte, error) {
		return nil, &iofs.PathError{Op: "read", Path: rel, Err: err}
	}
	if !iofs.ValidPath(rel) || rel == "." {
		return fail(iofs.ErrInvalid)
	}
	l := layerWalker{lower: lower, udir: -1}
	defer l.close()
	fd, err := unix.Open(upper, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	switch {
	case err == nil:
		l.udir = fd
	case err != unix.ENOENT:
		return fail(fmt.Errorf("upper %s: %w", upper, err))
	}
	if lower != nil {
		l.ldir = lower.Root()
	}
	els := splitPath(rel)
	for _, el := range els[:len(els)-1] {
		if err := l.enter(el); err != nil {
			return fail(err)
		}
	}
	b, err := l.read(els[len(els)-1])
	if err != nil {
		return fail(err)
	}
	return b, nil
}

// layerWalker resolves a path through both layers, one name at a time: it
// stands in a merged directory whose upper side is open at udir (-1 if the
// upper layer has none) and which merges lower directory ldir (0 if none).
type layerWalker struct {
	lower Lower
	udir  int
	ldir  archive.Inode
}

func (l *layerWalker) close() {
	if l.udir >= 0 {
		unix.Close(l.udir)
		l.udir = -1
	}
}

// found is what a name resolves to in the current directory: an upper
// entry (ust) or a visible lower one (la).
type found struct {
	upper bool
	ust   ustat
	lower bool
	la    archive.Attr
}

func (l *layerWalker) lookup(name string) (found, error) {
	var f found
	if l.udir >= 0 && !isReserved(name) {
		st, err := statxAt(l.udir, name)
		switch {
		case err == nil:
			f.upper, f.ust = true, st
		case err == unix.ENOENT:
			wo, err := whitedOut(l.udir, name)
			if err != nil {
				return f, err
			}
			if wo {
				return f, iofs.ErrNotExist
			}
		default:
			return f, err
		}
	}
	if l.ldir != 0 && l.lower != nil {
		a, err := l.lower.Lookup(l.ldir, name)
		switch {
		case err == nil:
			f.lower, f.la = true, a
		case !errors.Is(err, iofs.ErrNotExist):
			return f, err
		}
	}
	if !f.upper && !f.lower {
		return f, iofs.ErrNotExist
	}
	return f, nil
}

// enter moves into directory name.
func (l *layerWalker) enter(name string) error {
	f, err := l.lookup(name)
	if err != nil {
		return err
	}
	if !f.upper {
		if !f.la.Mode.IsDir() {
			return notDir(fileModeToUnix(f.la.Mode))
		}
		l.close()
		l.ldir = f.la.Ino
		return nil
	}
	if f.ust.mode&syscall.S_IFMT != syscall.S_IFDIR {
		return notDir(f.ust.mode)
	}
	sub, err := unix.Openat(l.udir, name, unix.O_PATH|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return err
	}
	m, err := readDirMarkers(sub)
	if err != nil {
		unix.Close(sub)
		return err
	}
	// The directory's merge source, as identify works it out.
	var next archive.Inode
	switch {
	case m.hasRedir:
		if a, err := lowerWalk(l.lower, m.redirect); err == nil && a.Mode.IsDir() {
			next = a.Ino
		}
	case m.opaque:
	case f.lower && f.la.Mode.IsDir():
		next = f.la.Ino
	}
	l.close()
	l.udir, l.ldir = sub, next
	return nil
}

// read reads regular file name.
func (l *layerWalker) read(name string) ([]byte, error) {
	f, err := l.lookup(name)
	if err != nil {
		return nil, err
	}
	if !f.upper {
		if mode := fileModeToUnix(f.la.Mode); mode&syscall.S_IFMT != syscall.S_IFREG {
			return nil, notRegular(mode)
		}
		buf := make([]byte, f.la.Size)
		k, err := l.lower.ReadAt(f.la.Ino, buf, 0)
		if err != nil && err != io.EOF {
			return nil, err
		}
		return buf[:k], nil
	}
	if f.ust.mode&syscall.S_IFMT != syscall.S_IFREG {
		return nil, notRegular(f.ust.mode)
	}
	fd, err := unix.Openat(l.udir, name, unix.O_RDONLY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, err
	}
	file := os.NewFile(uintptr(fd), name)
	defer file.Close()
	return io.ReadAll(file)
}

func notDir(mode uint32) error {
	if mode&syscall.S_IFMT == syscall.S_IFLNK {
		return syscall.ELOOP
	}
	return syscall.ENOTDIR
}

func notRegular(mode uint32) error {
	switch mode & syscall.S_IFMT {
	case syscall.S_IFLNK:
		return syscall.ELOOP
	case syscall.S_IFDIR:
		return syscall.EISDIR
	}
	return syscall.EINVAL
}

// lowerWalk resolves a lower path ("" for the root) from the lower root.
func lowerWalk(lower Lower, p string) (archive.Attr, error) {
	if lower == nil {
		return archive.Attr{}, iofs.ErrNotExist
	}
	a, err := lower.Stat(lower.Root())
	if err != nil || p == "" {
		return a, err
	}
	for _, el := range splitPath(p) {
		if a, err = lower.Lookup(a.Ino, el); err != nil {
			return a, err
		}
	}
	return a, nil
}
