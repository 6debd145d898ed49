package main

import (
	"errors"
	iofs "io/fs"
	"os"
	"path"
	"syscall"

	"github.com/hermesfs/hermesfs/archive"
)

// changeFS is the home as an archive.ChangeFS over the last image, the
// way the daemon's overlay knows its change, found here by comparing
// (restic's way with a parent snapshot): an entry whose type, mode,
// owner, mtime (nanoseconds), size and symlink target are the image's at
// the same path is unchanged; a directory is unchanged when it is so
// and holds the same names, all unchanged. It walks the whole home once
// per snapshot (stats only): the simulator measures bytes, not the walk.
type changeFS struct {
	iofs.FS
	base  *archive.Reader
	state map[string]entryState
}

type entryState struct {
	ino       archive.Inode
	unchanged bool
}

func newChangeFS(home string, base *archive.Reader) (*changeFS, error) {
	c := &changeFS{FS: os.DirFS(home), base: base, state: map[string]entryState{}}
	if _, err := c.compare("."); err != nil {
		return nil, err
	}
	return c, nil
}

func (c *changeFS) ReadDir(name string) ([]iofs.DirEntry, error) { return iofs.ReadDir(c.FS, name) }
func (c *changeFS) Lstat(name string) (iofs.FileInfo, error)     { return iofs.Lstat(c.FS, name) }
func (c *changeFS) ReadLink(name string) (string, error)         { return iofs.ReadLink(c.FS, name) }

// BaseInode implements archive.ChangeFS.
func (c *changeFS) BaseInode(name string) (archive.Inode, bool, bool) {
	s, ok := c.state[name]
	return s.ino, s.unchanged, ok
}

// compare records name's state (and everything below a directory) and
// reports whether it is unchanged.
func (c *changeFS) compare(name string) (bool, error) {
	fi, err := iofs.Lstat(c.FS, name)
	if err != nil {
		return false, err
	}
	bi, err := c.base.FS().Lstat(name)
	if err != nil {
		if errors.Is(err, iofs.ErrNotExist) {
			return false, c.walkNew(name, fi)
		}
		return false, err
	}
	ino := archive.Inode(bi.Sys().(*syscall.Stat_t).Ino)
	if fi.Mode().Type() != bi.Mode().Type() {
		// Another kind of object at the path: a new one.
		return false, c.walkNew(name, fi)
	}
	same := fi.Mode() == bi.Mode() && fi.ModTime().Equal(bi.ModTime()) && sameOwner(fi, bi)
	switch {
	case fi.IsDir():
		ents, err := iofs.ReadDir(c.FS, name)
		if err != nil {
			return false, err
		}
		bents, err := iofs.ReadDir(c.base.FS(), name)
		if err != nil {
			return false, err
		}
		same = same && len(ents) == len(bents)
		for i, e := range ents {
			u, err := c.compare(path.Join(name, e.Name()))
			if err != nil {
				return false, err
			}
			same = same && u && i < len(bents) && bents[i].Name() == e.Name()
		}
	case fi.Mode().Type() == iofs.ModeSymlink:
		t, err := iofs.ReadLink(c.FS, name)
		if err != nil {
			return false, err
		}
		bt, err := iofs.ReadLink(c.base.FS(), name)
		same = same && err == nil && t == bt
	default:
		st := fi.Sys().(*syscall.Stat_t)
		same = same && fi.Size() == bi.Size() && st.Nlink == 1
	}
	c.state[name] = entryState{ino: ino, unchanged: same}
	return same, nil
}

// walkNew records name and everything below it as new.
func (c *changeFS) walkNew(name string, fi iofs.FileInfo) error {
	if !fi.IsDir() {
		return nil
	}
	ents, err := iofs.ReadDir(c.FS, name)
	if err != nil {
		return err
	}
	for _, e := range ents {
		p := path.Join(name, e.Name())
		cfi, err := iofs.Lstat(c.FS, p)
		if err != nil {
			return err
		}
		if err := c.walkNew(p, cfi); err != nil {
			return err
		}
	}
	return nil
}

func sameOwner(a, b iofs.FileInfo) bool {
	sa, ok1 := a.Sys().(*syscall.Stat_t)
	sb, ok2 := b.Sys().(*syscall.Stat_t)
	return ok1 && ok2 && sa.Uid == sb.Uid && sa.Gid == sb.Gid
}
