package browse

import (
	"context"
	"errors"
	"io"
	iofs "io/fs"
	"os"
	"syscall"
	"time"

	fusefs "github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"

	"github.com/hermesfs/hermesfs/archive"
	"github.com/hermesfs/hermesfs/fs"
)

// rootNode lists the snapshots and their aliases.
type rootNode struct {
	fusefs.Inode
	t *tree
}

var (
	_ = (fusefs.NodeLookuper)((*rootNode)(nil))
	_ = (fusefs.NodeReaddirer)((*rootNode)(nil))
	_ = (fusefs.NodeGetattrer)((*rootNode)(nil))
	_ = (fusefs.NodeStatfser)((*rootNode)(nil))
)

func (r *rootNode) Getattr(ctx context.Context, f fusefs.FileHandle, out *fuse.AttrOut) syscall.Errno {
	out.Mode = syscall.S_IFDIR | 0o555
	out.Nlink = 2
	out.Uid, out.Gid = uint32(os.Getuid()), uint32(os.Getgid())
	// The root changes when a snapshot is taken: its time is the newest's.
	if t := r.t.newest(); !t.IsZero() {
		sec := uint64(t.Unix())
		out.Mtime, out.Atime, out.Ctime = sec, sec, sec
	}
	out.SetTimeout(rootTimeout)
	return 0
}

func (t *tree) newest() time.Time {
	t.mu.Lock()
	defer t.mu.Unlock()
	if len(t.listed) == 0 {
		return time.Time{}
	}
	return t.snaps[t.listed[len(t.listed)-1]].created
}

func (r *rootNode) Statfs(ctx context.Context, out *fuse.StatfsOut) syscall.Errno {
	out.Bsize = 4096
	out.Frsize = 4096
	out.NameLen = 255
	return 0
}

func (r *rootNode) Readdir(ctx context.Context) (fusefs.DirStream, syscall.Errno) {
	t := r.t
	t.refreshIfStale(ctx)
	t.mu.Lock()
	defer t.mu.Unlock()
	ents := make([]fuse.DirEntry, 0, len(t.listed)+len(t.aliases))
	for name := range t.aliases {
		ents = append(ents, fuse.DirEntry{Name: name, Mode: syscall.S_IFLNK, Ino: t.aliasIno[name]})
	}
	for _, id := range t.listed {
		ents = append(ents, fuse.DirEntry{Name: id, Mode: syscall.S_IFDIR, Ino: t.snaps[id].ino})
	}
	return fusefs.NewListDirStream(ents), 0
}

func (r *rootNode) Lookup(ctx context.Context, name string, out *fuse.EntryOut) (*fusefs.Inode, syscall.Errno) {
	t := r.t
	s, target, aino := t.entry(name)
	if s == nil && target == "" {
		t.refreshIfStale(ctx)
		if s, target, aino = t.entry(name); s == nil && target == "" {
			return nil, syscall.ENOENT
		}
	}
	out.SetEntryTimeout(rootTimeout)
	out.SetAttrTimeout(rootTimeout)
	if s == nil {
		a := &aliasNode{t: t, name: name}
		a.fill(target, &out.Attr)
		return r.NewInode(ctx, a, fusefs.StableAttr{Mode: syscall.S_IFLNK, Ino: aino}), 0
	}
	n := &node{t: t, s: s}
	if errno := n.attr(&out.Attr); errno != 0 {
		return nil, errno
	}
	return r.NewInode(ctx, n, fusefs.StableAttr{Mode: syscall.S_IFDIR, Ino: s.ino}), 0
}

// aliasNode is "latest" or a date alias: a symlink to a snapshot id.
type aliasNode struct {
	fusefs.Inode
	t    *tree
	name string
}

var (
	_ = (fusefs.NodeReadlinker)((*aliasNode)(nil))
	_ = (fusefs.NodeGetattrer)((*aliasNode)(nil))
)

// target is the id the alias names now ("" once it is gone).
func (a *aliasNode) target() string {
	a.t.mu.Lock()
	defer a.t.mu.Unlock()
	return a.t.aliases[a.name]
}

func (a *aliasNode) fill(target string, out *fuse.Attr) {
	out.Mode = syscall.S_IFLNK | 0o777
	out.Nlink = 1
	out.Size = uint64(len(target))
	out.Uid, out.Gid = uint32(os.Getuid()), uint32(os.Getgid())
	if s := a.t.snapshotByID(target); s != nil {
		sec := uint64(s.created.Unix())
		out.Mtime, out.Atime, out.Ctime = sec, sec, sec
	}
}

func (a *aliasNode) Readlink(ctx context.Context) ([]byte, syscall.Errno) {
	id := a.target()
	if id == "" {
		return nil, syscall.ENOENT
	}
	return []byte(id), 0
}

func (a *aliasNode) Getattr(ctx context.Context, f fusefs.FileHandle, out *fuse.AttrOut) syscall.Errno {
	a.fill(a.target(), &out.Attr)
	out.SetTimeout(rootTimeout)
	return 0
}

func (t *tree) snapshotByID(id string) *snapshot {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.snaps[id]
}

// node is an inode of a snapshot's archive; ino 0 is the snapshot's
// directory, the archive's root, which is opened only when entered.
type node struct {
	fusefs.Inode
	t   *tree
	s   *snapshot
	ino archive.Inode
}

var (
	_ = (fusefs.NodeLookuper)((*node)(nil))
	_ = (fusefs.NodeReaddirer)((*node)(nil))
	_ = (fusefs.NodeGetattrer)((*node)(nil))
	_ = (fusefs.NodeSetattrer)((*node)(nil))
	_ = (fusefs.NodeReadlinker)((*node)(nil))
	_ = (fusefs.NodeOpener)((*node)(nil))
	_ = (fusefs.NodeReader)((*node)(nil))
)

// lower opens the snapshot if needed and returns its archive and this
// node's inode in it.
func (n *node) lower(ctx context.Context) (fs.Lower, archive.Inode, syscall.Errno) {
	l, errno := n.t.open(ctx, n.s)
	if errno != 0 {
		return nil, 0, errno
	}
	if n.ino == 0 {
		return l, l.Root(), 0
	}
	return l, n.ino, 0
}

// attr fills out with the node's attributes. The directory of a snapshot
// not entered yet shows the snapshot's time and read-only permissions;
// once entered, the archive root's attributes.
func (n *node) attr(out *fuse.Attr) syscall.Errno {
	n.s.mu.Lock()
	l := n.s.lower
	n.s.mu.Unlock()
	if l == nil {
		out.Mode = syscall.S_IFDIR | 0o555
		out.Nlink = 2
		out.Uid, out.Gid = uint32(os.Getuid()), uint32(os.Getgid())
		sec := uint64(n.s.created.Unix())
		out.Mtime, out.Atime, out.Ctime = sec, sec, sec
		return 0
	}
	ino := n.ino
	if ino == 0 {
		ino = l.Root()
	}
	a, err := l.Stat(ino)
	if err != nil {
		return errno(err)
	}
	fs.FillArchiveAttr(out, &a)
	return 0
}

func (n *node) timeout() time.Duration {
	if n.ino == 0 {
		return rootTimeout
	}
	return immutableTimeout
}

func (n *node) Getattr(ctx context.Context, f fusefs.FileHandle, out *fuse.AttrOut) syscall.Errno {
	out.SetTimeout(n.timeout())
	return n.attr(&out.Attr)
}

func (n *node) Setattr(ctx context.Context, f fusefs.FileHandle, in *fuse.SetAttrIn, out *fuse.AttrOut) syscall.Errno {
	return syscall.EROFS
}

func (n *node) Lookup(ctx context.Context, name string, out *fuse.EntryOut) (*fusefs.Inode, syscall.Errno) {
	l, dir, e := n.lower(ctx)
	if e != 0 {
		return nil, e
	}
	a, err := l.Lookup(dir, name)
	if err != nil {
		return nil, errno(err)
	}
	fs.FillArchiveAttr(&out.Attr, &a)
	out.SetEntryTimeout(immutableTimeout)
	out.SetAttrTimeout(immutableTimeout)
	child := &node{t: n.t, s: n.s, ino: a.Ino}
	return n.NewInode(ctx, child, fusefs.StableAttr{Mode: out.Attr.Mode & syscall.S_IFMT, Ino: n.s.ino | uint64(a.Ino)}), 0
}

func (n *node) Readdir(ctx context.Context) (fusefs.DirStream, syscall.Errno) {
	l, dir, e := n.lower(ctx)
	if e != 0 {
		return nil, e
	}
	ents, err := l.ReadDir(dir)
	if err != nil {
		return nil, errno(err)
	}
	out := make([]fuse.DirEntry, len(ents))
	for i, d := range ents {
		out[i] = fuse.DirEntry{Name: d.Name, Mode: fs.UnixMode(d.Mode) & syscall.S_IFMT, Ino: n.s.ino | uint64(d.Ino)}
	}
	return fusefs.NewListDirStream(out), 0
}

func (n *node) Readlink(ctx context.Context) ([]byte, syscall.Errno) {
	l, ino, e := n.lower(ctx)
	if e != 0 {
		return nil, e
	}
	s, err := l.Readlink(ino)
	if err != nil {
		return nil, errno(err)
	}
	return []byte(s), 0
}

func (n *node) Open(ctx context.Context, flags uint32) (fusefs.FileHandle, uint32, syscall.Errno) {
	if flags&syscall.O_ACCMODE != syscall.O_RDONLY || flags&syscall.O_TRUNC != 0 {
		return nil, 0, syscall.EROFS
	}
	// A snapshot never changes: what the kernel cached stays valid.
	return nil, fuse.FOPEN_KEEP_CACHE, 0
}

func (n *node) Read(ctx context.Context, f fusefs.FileHandle, dest []byte, off int64) (fuse.ReadResult, syscall.Errno) {
	l, ino, e := n.lower(ctx)
	if e != 0 {
		return nil, e
	}
	k, err := l.ReadAt(ino, dest, off)
	if err != nil && !errors.Is(err, io.EOF) {
		n.t.log.Error("read failed", "snapshot", n.s.id, "inode", ino, "offset", off, "err", err)
		// A read has no name to miss: whatever failed is EIO, also a
		// store object that is gone (its error matches ErrNotExist, which
		// errno would make ENOENT, "no such file", of a file just opened).
		return nil, syscall.EIO
	}
	return fuse.ReadResultData(dest[:k]), 0
}

// errno converts an archive error: a missing name is ENOENT, a
// syscall.Errno passes through, anything else (damage, a store that does
// not answer) is EIO.
func errno(err error) syscall.Errno {
	var e syscall.Errno
	switch {
	case errors.Is(err, iofs.ErrNotExist):
		return syscall.ENOENT
	case errors.As(err, &e):
		return e
	}
	return syscall.EIO
}
