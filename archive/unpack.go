package archive

import (
	"context"
	"errors"
	"fmt"
	iofs "io/fs"
	"log/slog"
	"os"
	"path"

	"golang.org/x/sys/unix"
)

// UnpackOptions configures Unpack.
type UnpackOptions struct {
	Logger *slog.Logger
	// NoOwners skips restoring owners even when running as root (as
	// non-root, owners are never restored).
	NoOwners bool
	// Progress, if set, is called after each regular file with the bytes
	// of file content written so far and the total to write.
	Progress func(done, total int64)
}

// Unpack extracts the whole archive into dir, which must not exist or be
// an empty directory. It restores file content (holes stay holes), modes
// including setuid/setgid/sticky, mtimes (to the nanosecond when the
// archive carries them), symlinks, hard links, fifos and sockets, and, when
// running as root, owners and device nodes (device nodes are skipped with a
// warning otherwise).
//
// Memory stays bounded (one block buffer plus the reader's cache). Every
// entry is created relative to an open descriptor of its parent directory,
// with O_NOFOLLOW and O_EXCL, so nothing is written outside dir whatever the
// archive holds. On error the partial tree is left in place for inspection.
func Unpack(ctx context.Context, r *Reader, dir string, opts UnpackOptions) error {
	u := &unpacker{r: r, ctx: ctx, opts: opts, root: dir, links: map[Inode]string{}}
	u.log = opts.Logger
	if u.log == nil {
		u.log = slog.New(slog.DiscardHandler)
	}
	u.isRoot = os.Geteuid() == 0
	u.owners = u.isRoot && !opts.NoOwners
	if err := u.run(); err != nil {
		return fmt.Errorf("archive: unpack %s into %s: %w", r.name, dir, err)
	}
	return nil
}

type unpacker struct {
	r      *Reader
	ctx    context.Context
	opts   UnpackOptions
	log    *slog.Logger
	root   string
	rootFd int
	isRoot bool
	owners bool
	links  map[Inode]string // first extracted path (relative to root) of multiply linked inodes
	buf    []byte
	done   int64
	total  int64
	skips  int
}

func (u *unpacker) run() error {
	if err := os.Mkdir(u.root, 0o700); err != nil {
		if !errors.Is(err, iofs.ErrExist) {
			return err
		}
		ents, err := os.ReadDir(u.root)
		if err != nil {
			return err
		}
		if len(ents) > 0 {
			return fmt.Errorf("%s is not empty", u.root)
		}
	}
	fd, err := unix.Open(u.root, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return &os.PathError{Op: "open", Path: u.root, Err: err}
	}
	defer unix.Close(fd)
	u.rootFd = fd
	u.buf = make([]byte, u.r.bs)
	if u.opts.Progress != nil {
		u.total = u.r.contentBytes()
	}
	root, err := u.r.Stat(u.r.Root())
	if err != nil {
		return err
	}
	if err := u.dir(fd, root, "."); err != nil {
		return err
	}
	// The root's own metadata, like every directory's, goes last.
	if err := u.setMetaAt(unix.AT_FDCWD, u.root, root, false); err != nil {
		return err
	}
	if u.skips > 0 {
		u.log.Warn("device nodes skipped: not running as root", "count", u.skips)
	}
	return nil
}

// contentBytes sums the sizes of the archive's regular files (each inode
// once).
func (r *Reader) contentBytes() int64 {
	var total int64
	seen := map[Inode]bool{}
	for _, e := range r.entries {
		if e.Mode.IsRegular() && !seen[e.Ino] {
			seen[e.Ino] = true
			if a, err := r.Stat(e.Ino); err == nil {
				total += a.Size
			}
		}
	}
	return total
}

// dir extracts the entries of directory a into the open directory fd.
func (u *unpacker) dir(fd int, a Attr, rel string) error {
	ents, err := u.r.dirEntries(a.Ino)
	if err != nil {
		return err
	}
	for _, e := range ents {
		if err := u.ctx.Err(); err != nil {
			return err
		}
		crel := path.Join(rel, e.Name)
		ca, err := u.r.Stat(e.Ino)
		if err != nil {
			return err
		}
		if err := u.entry(fd, e.Name, crel, ca); err != nil {
			return fmt.Errorf("%s: %w", crel, err)
		}
	}
	return nil
}

func (u *unpacker) entry(fd int, name, rel string, a Attr) error {
	if !a.Mode.IsDir() && a.Nlink > 1 {
		if first, ok := u.links[a.Ino]; ok {
			return unix.Linkat(u.rootFd, first, fd, name, 0)
		}
		u.links[a.Ino] = rel
	}
	perm := uint32(a.Mode.Perm())
	switch a.Mode.Type() {
	case iofs.ModeDir:
		if err := unix.Mkdirat(fd, name, 0o700); err != nil {
			return err
		}
		cfd, err := unix.Openat(fd, name, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
		if err != nil {
			return err
		}
		err = u.dir(cfd, a, rel)
		unix.Close(cfd)
		if err != nil {
			return err
		}
	case 0:
		return u.file(fd, name, a)
	case iofs.ModeSymlink:
		t, err := u.r.Readlink(a.Ino)
		if err != nil {
			return err
		}
		if err := unix.Symlinkat(t, fd, name); err != nil {
			return err
		}
		return u.setMetaAt(fd, name, a, true)
	case iofs.ModeNamedPipe:
		if err := unix.Mknodat(fd, name, unix.S_IFIFO|perm, 0); err != nil {
			return err
		}
	case iofs.ModeSocket:
		if err := unix.Mknodat(fd, name, unix.S_IFSOCK|perm, 0); err != nil {
			return err
		}
	case iofs.ModeDevice, iofs.ModeDevice | iofs.ModeCharDevice:
		if !u.isRoot {
			u.skips++
			delete(u.links, a.Ino)
			return nil
		}
		typ := uint32(unix.S_IFBLK)
		if a.Mode&iofs.ModeCharDevice != 0 {
			typ = unix.S_IFCHR
		}
		if err := unix.Mknodat(fd, name, typ|perm, int(a.Rdev)); err != nil {
			return err
		}
	default:
		return fmt.Errorf("unsupported type %v", a.Mode.Type())
	}
	return u.setMetaAt(fd, name, a, false)
}

func (u *unpacker) file(dirfd int, name string, a Attr) error {
	fd, err := unix.Openat(dirfd, name, unix.O_WRONLY|unix.O_CREAT|unix.O_EXCL|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return err
	}
	f := os.NewFile(uintptr(fd), name)
	defer f.Close()
	l, err := u.r.layout(a.Ino)
	if err != nil {
		return err
	}
	bs := int64(u.r.bs)
	for off := int64(0); off < l.size; off += bs {
		bi := off / bs
		if bi < int64(len(l.words)) && l.words[bi] == 0 {
			continue // a hole: leave it one
		}
		n := min(bs, l.size-off)
		if _, err := u.r.readLayout(l, u.buf[:n], off); err != nil {
			return err
		}
		if _, err := f.WriteAt(u.buf[:n], off); err != nil {
			return err
		}
	}
	if err := f.Truncate(l.size); err != nil {
		return err
	}
	if err := f.Close(); err != nil {
		return err
	}
	u.done += l.size
	if u.opts.Progress != nil {
		u.opts.Progress(u.done, u.total)
	}
	return u.setMetaAt(dirfd, name, a, false)
}

// setMetaAt restores owner, mode and mtime of name in directory fd, after
// its content: chown first (it clears setuid/setgid), the mtime last.
func (u *unpacker) setMetaAt(fd int, name string, a Attr, symlink bool) error {
	if u.owners {
		if err := unix.Fchownat(fd, name, int(a.Uid), int(a.Gid), unix.AT_SYMLINK_NOFOLLOW); err != nil {
			return err
		}
	}
	if !symlink {
		if err := unix.Fchmodat(fd, name, uint32(squashMode(a.Mode)), 0); err != nil {
			return err
		}
	}
	ts := []unix.Timespec{unix.NsecToTimespec(a.Mtime.UnixNano()), unix.NsecToTimespec(a.Mtime.UnixNano())}
	return unix.UtimesNanoAt(fd, name, ts, unix.AT_SYMLINK_NOFOLLOW)
}
