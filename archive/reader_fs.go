package archive

import (
	"errors"
	"io"
	iofs "io/fs"
	"path"
	"strings"
	"syscall"
	"time"
)

// The io/fs view of a Reader. Paths are slash-separated and relative to the
// archive's root. Open, Stat and ReadDir follow symlinks that stay inside
// the archive; Lstat and ReadLink do not. Files implement io.ReaderAt and
// io.Seeker, and BlockSource (so packing a Reader copies blocks rather than
// recompressing them). FileInfo.Sys() is a *syscall.Stat_t carrying the
// inode number, link count, owners, device number and mtime, so Pack
// preserves them when it packs a Reader.
//
// *Reader itself implements iofs.FS and iofs.ReadLinkFS (Open, Lstat,
// ReadLink). Its Stat and ReadDir methods take inode numbers, so the
// path-based iofs.StatFS and iofs.ReadDirFS live on the view FS returns;
// iofs.Stat and iofs.ReadDir work on either.

// FS is the io/fs view of an archive: iofs.FS, iofs.StatFS, iofs.ReadDirFS
// and iofs.ReadLinkFS.
type FS struct{ r *Reader }

// FS returns the io/fs view of the archive.
func (r *Reader) FS() *FS { return &FS{r: r} }

func (f *FS) Open(name string) (iofs.File, error)          { return f.r.Open(name) }
func (f *FS) Lstat(name string) (iofs.FileInfo, error)     { return f.r.Lstat(name) }
func (f *FS) ReadLink(name string) (string, error)         { return f.r.ReadLink(name) }
func (f *FS) Stat(name string) (iofs.FileInfo, error)      { return f.r.statPath(name) }
func (f *FS) ReadDir(name string) ([]iofs.DirEntry, error) { return f.r.readDirPath(name) }

var (
	_ iofs.FS         = (*Reader)(nil)
	_ iofs.ReadLinkFS = (*Reader)(nil)
	_ iofs.FS         = (*FS)(nil)
	_ iofs.ReadDirFS  = (*FS)(nil)
	_ iofs.StatFS     = (*FS)(nil)
	_ iofs.ReadLinkFS = (*FS)(nil)

	_ iofs.ReadDirFile = (*file)(nil)
	_ io.ReaderAt      = (*file)(nil)
	_ io.Seeker        = (*file)(nil)
	_ BlockSource      = (*file)(nil)
)

const maxSymlinkHops = 40

var errEscapes = errors.New("symlink leads outside the archive")

// resolve finds the inode name refers to, following symlinks in every
// component but the last, and in the last too when follow is set.
func (r *Reader) resolve(op, name string, follow bool) (Attr, error) {
	fail := func(err error) (Attr, error) { return Attr{}, &iofs.PathError{Op: op, Path: name, Err: err} }
	if !iofs.ValidPath(name) {
		return fail(iofs.ErrInvalid)
	}
	stack := []Inode{r.root}
	var comps []string
	if name != "." {
		comps = strings.Split(name, "/")
	}
	hops := 0
	for i := 0; i < len(comps); i++ {
		c := comps[i]
		switch c {
		case "", ".":
			continue
		case "..":
			if len(stack) == 1 {
				return fail(errEscapes)
			}
			stack = stack[:len(stack)-1]
			continue
		}
		a, err := r.Lookup(stack[len(stack)-1], c)
		if err != nil {
			if errors.Is(err, iofs.ErrNotExist) {
				return fail(iofs.ErrNotExist)
			}
			if errors.Is(err, syscall.ENOTDIR) {
				return fail(syscall.ENOTDIR)
			}
			return fail(err)
		}
		last := i == len(comps)-1
		if a.Mode.Type() == iofs.ModeSymlink && (!last || follow) {
			if hops++; hops > maxSymlinkHops {
				return fail(syscall.ELOOP)
			}
			t, err := r.Readlink(a.Ino)
			if err != nil {
				return fail(err)
			}
			if strings.HasPrefix(t, "/") {
				return fail(errEscapes)
			}
			comps = append(strings.Split(t, "/"), comps[i+1:]...)
			i = -1
			continue
		}
		if last {
			return a, nil
		}
		if !a.Mode.IsDir() {
			return fail(syscall.ENOTDIR)
		}
		stack = append(stack, a.Ino)
	}
	a, err := r.Stat(stack[len(stack)-1])
	if err != nil {
		return fail(err)
	}
	return a, nil
}

// Open opens the named file (following symlinks).
func (r *Reader) Open(name string) (iofs.File, error) {
	a, err := r.resolve("open", name, true)
	if err != nil {
		return nil, err
	}
	f := &file{r: r, name: name, attr: a}
	if a.Mode.IsRegular() {
		if f.l, err = r.layout(a.Ino); err != nil {
			return nil, &iofs.PathError{Op: "open", Path: name, Err: err}
		}
	}
	return f, nil
}

func (r *Reader) statPath(name string) (iofs.FileInfo, error) {
	a, err := r.resolve("stat", name, true)
	if err != nil {
		return nil, err
	}
	return &fileInfo{name: path.Base(name), a: a}, nil
}

// Lstat describes the named file without following a final symlink.
func (r *Reader) Lstat(name string) (iofs.FileInfo, error) {
	a, err := r.resolve("lstat", name, false)
	if err != nil {
		return nil, err
	}
	return &fileInfo{name: path.Base(name), a: a}, nil
}

// ReadLink returns the target of the named symlink.
func (r *Reader) ReadLink(name string) (string, error) {
	a, err := r.resolve("readlink", name, false)
	if err != nil {
		return "", err
	}
	t, err := r.Readlink(a.Ino)
	if err != nil {
		return "", &iofs.PathError{Op: "readlink", Path: name, Err: syscall.EINVAL}
	}
	return t, nil
}

func (r *Reader) readDirPath(name string) ([]iofs.DirEntry, error) {
	a, err := r.resolve("readdir", name, true)
	if err != nil {
		return nil, err
	}
	return r.fsEntries("readdir", name, a)
}

func (r *Reader) fsEntries(op, name string, a Attr) ([]iofs.DirEntry, error) {
	ents, err := r.dirEntries(a.Ino)
	if err != nil {
		return nil, &iofs.PathError{Op: op, Path: name, Err: syscall.ENOTDIR}
	}
	out := make([]iofs.DirEntry, len(ents))
	for i, e := range ents {
		out[i] = &dirEntry{r: r, e: e}
	}
	return out, nil
}

// Read-only access to an inode with io/fs semantics.

type fileInfo struct {
	name string
	a    Attr
}

func (fi *fileInfo) Name() string {
	if fi.name == "." || fi.name == "/" {
		return "."
	}
	return fi.name
}
func (fi *fileInfo) Size() int64         { return fi.a.Size }
func (fi *fileInfo) Mode() iofs.FileMode { return fi.a.Mode }
func (fi *fileInfo) ModTime() time.Time  { return fi.a.Mtime }
func (fi *fileInfo) IsDir() bool         { return fi.a.Mode.IsDir() }

// Sys returns a *syscall.Stat_t, as os.Lstat does, so that Pack keeps
// owners, devices and hard links when it packs a Reader.
func (fi *fileInfo) Sys() any {
	a := fi.a
	st := &syscall.Stat_t{
		Ino:   uint64(a.Ino),
		Nlink: uint64(a.Nlink),
		Uid:   a.Uid,
		Gid:   a.Gid,
		Rdev:  a.Rdev,
		Size:  a.Size,
		Mtim:  syscall.NsecToTimespec(a.Mtime.UnixNano()),
	}
	st.Mode = uint32(a.Mode.Perm())
	return st
}

type dirEntry struct {
	r *Reader
	e DirEntry
}

func (d *dirEntry) Name() string        { return d.e.Name }
func (d *dirEntry) IsDir() bool         { return d.e.Mode.IsDir() }
func (d *dirEntry) Type() iofs.FileMode { return d.e.Mode.Type() }
func (d *dirEntry) Info() (iofs.FileInfo, error) {
	a, err := d.r.Stat(d.e.Ino)
	if err != nil {
		return nil, err
	}
	return &fileInfo{name: d.e.Name, a: a}, nil
}
func (d *dirEntry) String() string { return iofs.FormatDirEntry(d) }

type file struct {
	r      *Reader
	name   string
	attr   Attr
	l      *fileLayout // regular files
	off    int64
	ents   []DirEntry // directories, once listed
	listed bool
	closed bool
}

func (f *file) Stat() (iofs.FileInfo, error) {
	if f.closed {
		return nil, &iofs.PathError{Op: "stat", Path: f.name, Err: iofs.ErrClosed}
	}
	return &fileInfo{name: path.Base(f.name), a: f.attr}, nil
}

func (f *file) Read(p []byte) (int, error) {
	if f.closed {
		return 0, &iofs.PathError{Op: "read", Path: f.name, Err: iofs.ErrClosed}
	}
	if f.attr.Mode.IsDir() {
		return 0, &iofs.PathError{Op: "read", Path: f.name, Err: syscall.EISDIR}
	}
	if f.l == nil {
		return 0, io.EOF
	}
	if f.off >= f.l.size {
		return 0, io.EOF
	}
	n, err := f.r.readLayout(f.l, p, f.off)
	f.off += int64(n)
	if err == io.EOF && n > 0 {
		err = nil
	}
	return n, err
}

func (f *file) ReadAt(p []byte, off int64) (int, error) {
	if f.closed {
		return 0, &iofs.PathError{Op: "read", Path: f.name, Err: iofs.ErrClosed}
	}
	if f.l == nil {
		if f.attr.Mode.IsDir() {
			return 0, &iofs.PathError{Op: "read", Path: f.name, Err: syscall.EISDIR}
		}
		return 0, io.EOF
	}
	return f.r.readLayout(f.l, p, off)
}

func (f *file) Seek(offset int64, whence int) (int64, error) {
	if f.closed {
		return 0, &iofs.PathError{Op: "seek", Path: f.name, Err: iofs.ErrClosed}
	}
	switch whence {
	case io.SeekStart:
	case io.SeekCurrent:
		offset += f.off
	case io.SeekEnd:
		offset += f.attr.Size
	default:
		return 0, &iofs.PathError{Op: "seek", Path: f.name, Err: iofs.ErrInvalid}
	}
	if offset < 0 {
		return 0, &iofs.PathError{Op: "seek", Path: f.name, Err: iofs.ErrInvalid}
	}
	f.off = offset
	return offset, nil
}

func (f *file) ReadDir(n int) ([]iofs.DirEntry, error) {
	if f.closed {
		return nil, &iofs.PathError{Op: "readdir", Path: f.name, Err: iofs.ErrClosed}
	}
	if !f.listed {
		ents, err := f.r.dirEntries(f.attr.Ino)
		if err != nil {
			return nil, &iofs.PathError{Op: "readdir", Path: f.name, Err: syscall.ENOTDIR}
		}
		f.ents, f.listed = ents, true
	}
	k := len(f.ents)
	if n > 0 {
		if k == 0 {
			return nil, io.EOF
		}
		k = min(k, n)
	}
	out := make([]iofs.DirEntry, k)
	for i := range out {
		out[i] = &dirEntry{r: f.r, e: f.ents[i]}
	}
	f.ents = f.ents[k:]
	return out, nil
}

func (f *file) Close() error {
	if f.closed {
		return &iofs.PathError{Op: "close", Path: f.name, Err: iofs.ErrClosed}
	}
	f.closed = true
	return nil
}

// ArchiveSource lets Pack copy this file's blocks from the archive.
func (f *file) ArchiveSource() (*Reader, Inode, bool) {
	return f.r, f.attr.Ino, f.attr.Mode.IsRegular()
}
