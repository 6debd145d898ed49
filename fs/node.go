package fs

import (
	"context"
	"errors"
	iofs "io/fs"
	"log/slog"
	"os"
	"sort"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	fusefs "github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"
	"golang.org/x/sys/unix"

	"github.com/hermesfs/hermesfs/archive"
)

// upperInoBase separates the st_ino of objects born in the upper layer from
// those that come from the lower layer: squashfs inode numbers are 32-bit,
// so an upper inode number plus 2^32 never collides with one.
const upperInoBase = 1 << 32

// overlay is the state shared by all nodes of one mount.
type overlay struct {
	u     *upper
	lower Lower
	// lowerBlock is the lower layer's block size, if it has one
	// (blockSizer): reads are split at its block boundaries.
	lowerBlock int64
	guard      Guard
	log        *slog.Logger
	opts       Options

	root  *node
	gate  gate
	gen   atomic.Uint64
	inos  *inoMap
	dirty dirtyTracker
	views viewSet
	// partials holds the files copied up by range (partial.go).
	partials *partialSet

	// passthrough is set once the kernel has agreed to FUSE passthrough
	// and the daemon may register backing files.
	passthrough atomic.Bool
	server      *fuse.Server
	// pendingPT links a passthrough handle made by Open to its OPEN reply,
	// keyed by the request's cancel channel (passthrough.go).
	pendingPT sync.Map
	// ptw tracks writable passthrough handles, barriers the freezes
	// holding their writes, freezeMu serialises freezes (ptwrite.go).
	ptw       ptWriters
	ptWriteOK atomic.Bool // the barrier was verified (ptcheck.go)
	barriers  sync.Map    // *node -> *barrier
	freezeMu  sync.Mutex

	// probes are rawFS's lookups of a node by its FUSE node id
	// (readdir.go): cancel channel -> **node.
	probes sync.Map
	// fillOff: the kernel refused a page cache fill (lowerfill.go).
	fillOff atomic.Bool

	unmounted atomic.Bool
	// writesRefused: every change fails with EROFS (writegate.go).
	writesRefused atomic.Bool
	// prefetching counts read-ahead goroutines (lowerread.go); Unmount
	// waits for them, so none reads the lower layer after it returns.
	prefetching sync.WaitGroup
	closeOnce   sync.Once

	aliasOnce sync.Once
	aliases   map[archive.Inode][]string // lower hard links: inode -> lower paths
	aliasErr  error
}

// node is one object of the merged tree. go-fuse keeps one node per
// (st_ino, generation), so a node stands for an inode, not a path: hard
// links share it, and its path is found through the tree (Parent).
type node struct {
	fusefs.Inode
	ov *overlay

	kind uint32 // S_IFMT bits
	ino  uint64 // the st_ino reported, stable for the object's life

	// lower is the lower inode behind this object: for a file, its content
	// until copied up; for a directory, the lower directory it merges
	// (0 when opaque or upper-only). lowerPath is that directory's path in
	// the lower layer (for redirect markers when it is renamed).
	lower     archive.Inode
	lowerPath string

	// upper is set once the object exists in the upper layer. It never
	// goes back.
	upper atomic.Bool
	// uino is the inode number of a directory's upper directory, once
	// known (0 before): dirFd checks it.
	uino atomic.Uint64
	// subdirs caches a merged directory's subdirectory count and
	// subdirVer versions it (nlink.go).
	subdirs   atomic.Int64
	subdirVer atomic.Uint32

	// replaced counts the guarded commits that renamed a new upper file
	// over this node's (guard.go); read handles follow it (upperRef).
	replaced atomic.Uint32

	// mu serialises copy-up and the open-mode accounting below.
	mu sync.Mutex
	// Open handles by the kernel I/O mode they were given: cached (page
	// cache, daemon-served), passthrough (kernel to the backing file), and
	// writable (any mode).
	cachedOpens int
	ptOpens     int
	writers     int
	// deferred counts read-write opens of the lower file that copy it up
	// only at their first change (deferred.go).
	deferred int
	// noDefer: a removal of the file's name began with no deferred open;
	// read-write opens copy up at open from then on.
	noDefer bool
	// filled: the lower content was handed to the page cache at an open
	// (lowerfill.go).
	filled bool
	// cacheStale is set when the content changed behind the page cache
	// (passthrough writes, a guarded commit): the next cached open drops
	// the kernel's cache instead of keeping it.
	cacheStale bool
	// orphan keeps an O_PATH descriptor of the upper object once its last
	// name is removed while the kernel still knows it: an open(2) or
	// stat(2) that resolved the name just before the unlink or the rename
	// over it must still reach the object, as on a local file system.
	orphan *os.File
	// backingID is the kernel's id of the upper file registered for
	// passthrough, held by backingRefs open handles; 0 if none.
	backingID   int32
	backingRefs int
	// fillAheadTo is the index in a lower directory's listing up to which
	// the blocks of its small files were decompressed ahead (lowerfill.go).
	fillAheadTo atomic.Int64
	// fillOpens counts the small lower files of a directory filled at
	// their first open (lowerfill.go).
	fillOpens atomic.Int32
	lowerEnts atomic.Pointer[[]archive.DirEntry] // lowerListing
	// listings are a directory's listings being read (readdir.go).
	listings *dirListings
	// ptWrite: the passthrough handles of this node share a writable
	// backing file (decided by the first of them, a writable open given
	// passthrough); the node is in overlay.ptw until the last one closes.
	ptWrite bool
}

var (
	_ fusefs.InodeEmbedder   = (*node)(nil)
	_ fusefs.NodeLookuper    = (*node)(nil)
	_ fusefs.NodeGetattrer   = (*node)(nil)
	_ fusefs.NodeSetattrer   = (*node)(nil)
	_ fusefs.NodeReadlinker  = (*node)(nil)
	_ fusefs.NodeOpener      = (*node)(nil)
	_ fusefs.NodeCreater     = (*node)(nil)
	_ fusefs.NodeMkdirer     = (*node)(nil)
	_ fusefs.NodeMknoder     = (*node)(nil)
	_ fusefs.NodeSymlinker   = (*node)(nil)
	_ fusefs.NodeLinker      = (*node)(nil)
	_ fusefs.NodeUnlinker    = (*node)(nil)
	_ fusefs.NodeRmdirer     = (*node)(nil)
	_ fusefs.NodeRenamer     = (*node)(nil)
	_ fusefs.NodeStatfser    = (*node)(nil)
	_ fusefs.NodeFsyncer     = (*node)(nil)
	_ fusefs.NodeOnForgetter = (*node)(nil)
)

// OnForget releases what the node kept for the kernel.
func (n *node) OnForget() {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.orphan != nil {
		n.orphan.Close()
		n.orphan = nil
	}
}

// orphanFd returns the descriptor kept for an unnamed object, or -1.
func (n *node) orphanFd() int {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.orphan == nil {
		return -1
	}
	return int(n.orphan.Fd())
}

// keepOrphan is called before the upper entry name in dfd, which is node
// victim's, loses its last name.
func (n *node) keepOrphan(dfd int, name string) {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.orphan != nil {
		return
	}
	fd, err := unix.Openat(dfd, name, unix.O_PATH|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err == nil {
		n.orphan = os.NewFile(uintptr(fd), name)
	}
}

func (n *node) isDir() bool { return n.kind == syscall.S_IFDIR }

// rel returns the node's path relative to the mount root ("" for the
// root), or false for an object that is in no directory any more.
func (n *node) rel() (string, bool) {
	root := n.ov.root.EmbeddedInode()
	cur := n.EmbeddedInode()
	var segs []string
	for cur != root {
		name, p := cur.Parent()
		if p == nil {
			return "", false
		}
		segs = append(segs, name)
		cur = p
	}
	size := 0
	for _, s := range segs {
		size += len(s) + 1
	}
	b := make([]byte, 0, size)
	for i := len(segs) - 1; i >= 0; i-- {
		if len(b) > 0 {
			b = append(b, '/')
		}
		b = append(b, segs[i]...)
	}
	return string(b), true
}

// dirFd opens directory node d's upper directory, for reading if read is
// set (else O_PATH), and returns it with its path; release it with
// upper.put. The kernel locks only the parents of a rename, so an ancestor
// of d may be renamed at the same time and d's path be stale for an
// instant: the directory opened is checked to be d's own by its inode
// number, and looked up again if it is not.
func (d *node) dirFd(read bool) (int, string, error) {
	u := d.ov.u
	mode := unix.O_PATH
	if read {
		mode = unix.O_RDONLY
	}
	for try := 0; ; try++ {
		rel, ok := d.rel()
		if !ok {
			return -1, "", syscall.ENOENT
		}
		var fd int
		var err error
		if read {
			fd, err = u.dirRead(rel)
		} else {
			fd, err = u.openDir(rel, mode)
		}
		want := d.uino.Load()
		if err == nil && (want == 0 || rel == "") {
			return fd, rel, nil
		}
		if err == nil {
			st, serr := statFd(fd)
			if serr == nil && st.ino == want {
				return fd, rel, nil
			}
			u.put(fd)
			err = syscall.ESTALE
		}
		if try == 20 || (err != syscall.ESTALE && err != syscall.ENOENT && err != syscall.ENOTDIR) {
			return -1, "", err
		}
		// The rename that moved it has not reached the tree yet.
		time.Sleep(time.Duration(try+1) * 50 * time.Microsecond)
	}
}

// parent returns the directory node holding n and n's name in it.
func (n *node) parent() (*node, string, bool) {
	name, p := n.EmbeddedInode().Parent()
	if p == nil {
		return nil, "", false
	}
	pn, ok := p.Operations().(*node)
	return pn, name, ok
}

// entry is what one name in a merged directory resolves to.
type entry struct {
	upper bool
	ust   ustat // when upper

	// lowerIno is the lower entry of that name in the directory's merge
	// source (whether visible or hidden by a whiteout or an upper entry).
	lowerIno  archive.Inode
	lowerAttr archive.Attr
	whiteout  bool // the lower entry is whited out
}

func (e *entry) exists() bool       { return e.upper || e.visibleLower() }
func (e *entry) visibleLower() bool { return !e.upper && e.lowerIno != 0 && !e.whiteout }

func (e *entry) mode() uint32 {
	if e.upper {
		return e.ust.mode
	}
	return fileModeToUnix(e.lowerAttr.Mode)
}

// resolve looks name up in directory d, whose upper directory (if d.upper) is
// open at dfd (-1 to open it here).
func (ov *overlay) resolve(d *node, dfd int, name string) (entry, error) {
	var e entry
	if d.upper.Load() && !isReserved(name) {
		if dfd < 0 {
			fd, _, err := d.dirFd(false)
			if err != nil {
				return e, err
			}
			defer ov.u.put(fd)
			dfd = fd
		}
		st, err := statxAt(dfd, name)
		switch {
		case err == nil:
			e.upper, e.ust = true, st
		case err == unix.ENOENT:
			wo, err := whitedOut(dfd, name)
			if err != nil {
				return e, err
			}
			e.whiteout = wo
		default:
			return e, err
		}
	}
	if d.lower != 0 && ov.lower != nil {
		a, err := ov.lower.Lookup(d.lower, name)
		switch {
		case err == nil:
			e.lowerIno, e.lowerAttr = a.Ino, a
		case errors.Is(err, iofs.ErrNotExist):
		default:
			return e, err
		}
	}
	return e, nil
}

// lowerWalk resolves a lower path from the lower root.
func (ov *overlay) lowerWalk(p string) (archive.Attr, error) {
	return lowerWalk(ov.lower, p)
}

func splitPath(p string) []string {
	var out []string
	for len(p) > 0 {
		dir, name := splitRel(p)
		out = append(out, name)
		p = dir
	}
	for i, j := 0, len(out)-1; i < j; i, j = i+1, j-1 {
		out[i], out[j] = out[j], out[i]
	}
	return out
}

// identity is how a child found by resolve is represented as a node.
type identity struct {
	kind      uint32
	ino, gen  uint64
	lower     archive.Inode
	lowerPath string
	upper     bool
	merged    bool // a directory with both an upper and a lower side
}

// identify works out the node identity of entry e named name in directory d.
// dfd is d's upper directory when e.upper.
func (ov *overlay) identify(d *node, dfd int, name string, e *entry) (identity, error) {
	if !e.upper {
		id := identity{kind: e.mode() & syscall.S_IFMT, ino: uint64(e.lowerIno), gen: 1, lower: e.lowerIno}
		if id.kind == syscall.S_IFDIR {
			id.lowerPath = joinRel(d.lowerPath, name)
		}
		return id, nil
	}
	id := identity{kind: e.ust.mode & syscall.S_IFMT, upper: true}
	if id.kind != syscall.S_IFDIR {
		id.ino, id.gen = ov.upperIno(&e.ust)
		if id.ino < upperInoBase {
			id.lower = archive.Inode(id.ino)
		}
		return id, nil
	}
	sub, err := unix.Openat(dfd, name, unix.O_PATH|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return id, err
	}
	m, err := readDirMarkers(sub)
	unix.Close(sub)
	if err != nil {
		return id, err
	}
	switch {
	case m.hasRedir:
		if a, err := ov.lowerWalk(m.redirect); err == nil && a.Mode.IsDir() {
			id.lower, id.lowerPath = a.Ino, m.redirect
		}
	case m.opaque:
	case e.lowerIno != 0 && e.lowerAttr.Mode.IsDir():
		id.lower, id.lowerPath = e.lowerIno, joinRel(d.lowerPath, name)
	}
	if id.lower != 0 {
		id.ino, id.gen, id.merged = uint64(id.lower), 1, true
	} else {
		id.ino, id.gen = ov.upperIno(&e.ust)
	}
	return id, nil
}

// upperIno is the st_ino and generation an upper object reports (a
// directory that merges a lower one reports that one's instead).
func (ov *overlay) upperIno(st *ustat) (uint64, uint64) {
	return ov.inos.number(st)
}

func genOf(st *ustat) uint64 {
	if st.btime == 0 {
		return 1
	}
	return st.btime
}

// newChild makes (or finds) the node for identity id, named name under d,
// and fills out.
func (ov *overlay) newChild(ctx context.Context, d *node, name string, id identity, e *entry, out *fuse.EntryOut) *fusefs.Inode {
	n := &node{ov: ov, kind: id.kind, ino: id.ino, lower: id.lower, lowerPath: id.lowerPath}
	n.upper.Store(id.upper)
	if id.upper && id.kind == syscall.S_IFDIR {
		n.uino.Store(e.ust.ino)
	}
	ch := d.NewInode(ctx, n, fusefs.StableAttr{Mode: id.kind, Ino: id.ino, Gen: id.gen})
	if got, ok := ch.Operations().(*node); ok && got != n && id.upper {
		got.upper.Store(true)
		if id.kind == syscall.S_IFDIR {
			got.uino.Store(e.ust.ino)
		}
	}
	ov.fillEntryAttr(&out.Attr, id, e)
	if cn, ok := ch.Operations().(*node); ok && id.merged {
		out.Attr.Nlink = ov.mergedNlinkIn(cn, d, name)
	}
	return ch
}

func (ov *overlay) fillEntryAttr(a *fuse.Attr, id identity, e *entry) {
	if e.upper {
		fillAttr(a, &e.ust)
		if id.merged {
			a.Nlink = 1
		}
	} else {
		fillLowerAttr(a, &e.lowerAttr)
	}
	a.Ino = id.ino
}

func fillAttr(a *fuse.Attr, st *ustat) {
	a.Mode = st.mode
	a.Nlink = st.nlink
	a.Uid, a.Gid = st.uid, st.gid
	a.Size = uint64(st.size)
	a.Blocks = uint64(st.blocks)
	a.Blksize = st.blksize
	a.Rdev = uint32(st.rdev)
	a.Atime, a.Atimensec = uint64(st.atime.Sec), uint32(st.atime.Nsec)
	a.Mtime, a.Mtimensec = uint64(st.mtime.Sec), uint32(st.mtime.Nsec)
	a.Ctime, a.Ctimensec = uint64(st.ctime.Sec), uint32(st.ctime.Nsec)
}

func fillLowerAttr(a *fuse.Attr, la *archive.Attr) {
	a.Mode = fileModeToUnix(la.Mode)
	a.Nlink = la.Nlink
	if a.Nlink == 0 {
		a.Nlink = 1
	}
	a.Uid, a.Gid = la.Uid, la.Gid
	a.Size = uint64(la.Size)
	a.Blocks = uint64(la.Size+511) / 512
	a.Blksize = 4096
	a.Rdev = uint32(la.Rdev)
	sec, nsec := uint64(la.Mtime.Unix()), uint32(la.Mtime.Nanosecond())
	a.Atime, a.Atimensec = sec, nsec
	a.Mtime, a.Mtimensec = sec, nsec
	a.Ctime, a.Ctimensec = sec, nsec
}

// fileModeToUnix converts an io/fs mode to st_mode bits.
func fileModeToUnix(m iofs.FileMode) uint32 {
	mode := uint32(m.Perm())
	switch {
	case m.IsDir():
		mode |= syscall.S_IFDIR
	case m&iofs.ModeSymlink != 0:
		mode |= syscall.S_IFLNK
	case m&iofs.ModeNamedPipe != 0:
		mode |= syscall.S_IFIFO
	case m&iofs.ModeSocket != 0:
		mode |= syscall.S_IFSOCK
	case m&iofs.ModeDevice != 0 && m&iofs.ModeCharDevice != 0:
		mode |= syscall.S_IFCHR
	case m&iofs.ModeDevice != 0:
		mode |= syscall.S_IFBLK
	default:
		mode |= syscall.S_IFREG
	}
	if m&iofs.ModeSetuid != 0 {
		mode |= syscall.S_ISUID
	}
	if m&iofs.ModeSetgid != 0 {
		mode |= syscall.S_ISGID
	}
	if m&iofs.ModeSticky != 0 {
		mode |= syscall.S_ISVTX
	}
	return mode
}

// Lookup finds name in the merged directory: the upper entry if there is
// one, else the lower entry unless a whiteout hides it.
func (n *node) Lookup(ctx context.Context, name string, out *fuse.EntryOut) (*fusefs.Inode, syscall.Errno) {
	if n.probed(ctx, name) {
		return nil, syscall.ENOENT
	}
	ov := n.ov
	dfd := -1
	if n.upper.Load() {
		fd, _, err := n.dirFd(false)
		if err != nil {
			return nil, errnoOf(err)
		}
		defer ov.u.put(fd)
		dfd = fd
	}
	e, err := ov.resolve(n, dfd, name)
	if err != nil {
		return nil, errnoOf(err)
	}
	if !e.exists() {
		return nil, syscall.ENOENT
	}
	id, err := ov.identify(n, dfd, name, &e)
	if err != nil {
		return nil, errnoOf(err)
	}
	ch := ov.newChild(ctx, n, name, id, &e, out)
	if e.upper {
		if cn, ok := ch.Operations().(*node); ok {
			ov.partials.resume(&e.ust, cn, dfd, name)
		}
	}
	return ch, 0
}

// stat returns n's current attributes.
func (n *node) stat(f fusefs.FileHandle, a *fuse.Attr) syscall.Errno {
	if h, ok := f.(interface {
		statHandle(*fuse.Attr) syscall.Errno
	}); ok {
		if errno := h.statHandle(a); errno != syscall.ENOSYS {
			return errno
		}
	}
	if !n.upper.Load() {
		if n.ov.lower == nil {
			return syscall.ENOENT
		}
		la, err := n.ov.lower.Stat(n.lower)
		if err != nil {
			return errnoOf(err)
		}
		fillLowerAttr(a, &la)
		a.Ino = n.ino
		return 0
	}
	st, errno := n.ustat()
	if errno != 0 {
		return errno
	}
	n.fillUpperAttr(a, &st)
	return 0
}

func (n *node) fillUpperAttr(a *fuse.Attr, st *ustat) {
	fillAttr(a, st)
	a.Ino = n.ino
	if st.mode&syscall.S_IFMT == syscall.S_IFREG {
		n.ov.partials.fillBlocks(a, st)
	}
	if n.isDir() && n.lower != 0 {
		a.Nlink = n.ov.mergedNlink(n)
	}
}

// ustat stats n's upper object by path.
func (n *node) ustat() (ustat, syscall.Errno) {
	if n == n.ov.root {
		st, err := statFd(n.ov.u.root)
		return st, errnoOf(err)
	}
	p, name, ok := n.parent()
	if !ok {
		if fd := n.orphanFd(); fd >= 0 {
			st, err := statFd(fd)
			return st, errnoOf(err)
		}
		return ustat{}, syscall.ENOENT
	}
	pfd, _, err := p.dirFd(false)
	if err != nil {
		return ustat{}, errnoOf(err)
	}
	defer n.ov.u.put(pfd)
	st, err := statxAt(pfd, name)
	return st, errnoOf(err)
}

func (n *node) Getattr(ctx context.Context, f fusefs.FileHandle, out *fuse.AttrOut) syscall.Errno {
	return n.stat(f, &out.Attr)
}

func (n *node) Readlink(ctx context.Context) ([]byte, syscall.Errno) {
	if !n.upper.Load() {
		s, err := n.ov.lower.Readlink(n.lower)
		if err != nil {
			return nil, errnoOf(err)
		}
		return []byte(s), 0
	}
	p, name, ok := n.parent()
	if !ok {
		return nil, syscall.ENOENT
	}
	pfd, _, err := p.dirFd(false)
	if err != nil {
		return nil, errnoOf(err)
	}
	defer n.ov.u.put(pfd)
	for size := 256; ; size *= 2 {
		buf := make([]byte, size)
		k, err := unix.Readlinkat(pfd, name, buf)
		if err != nil {
			return nil, errnoOf(err)
		}
		if k < size {
			return buf[:k], 0
		}
	}
}

func (n *node) Statfs(ctx context.Context, out *fuse.StatfsOut) syscall.Errno {
	var s unix.Statfs_t
	if err := unix.Fstatfs(n.ov.u.root, &s); err != nil {
		return errnoOf(err)
	}
	out.Blocks, out.Bfree, out.Bavail = s.Blocks, s.Bfree, s.Bavail
	out.Files, out.Ffree = s.Files, s.Ffree
	out.Bsize, out.Frsize = uint32(s.Bsize), uint32(s.Frsize)
	// The upper layer takes every name; report what it accepts, not
	// squashfs' 256.
	out.NameLen = nameMax
	return 0
}

// Fsync on a node without a handle (fsync of a directory through a path
// the kernel resolved) syncs the upper object if there is one.
func (n *node) Fsync(ctx context.Context, f fusefs.FileHandle, flags uint32) syscall.Errno {
	if fs, ok := f.(fusefs.FileFsyncer); ok {
		return fs.Fsync(ctx, flags)
	}
	if !n.upper.Load() {
		return 0
	}
	if n.isDir() {
		fd, _, err := n.dirFd(true)
		if err != nil {
			return errnoOf(err)
		}
		defer unix.Close(fd)
		return errnoOf(unix.Fsync(fd))
	}
	return 0
}

// mergedEntry is one name of a merged directory listing.
type mergedEntry struct {
	name  string
	mode  uint32 // S_IFMT bits
	ino   uint64
	upper bool          // the entry is in the upper layer
	lower archive.Inode // its lower object (a directory: the one it merges), 0 if none
}

// list returns the merged listing of directory n, sorted by name, without
// "." and "..".
func (ov *overlay) list(n *node) ([]mergedEntry, error) {
	fd := -1
	if n.upper.Load() {
		var err error
		if fd, _, err = n.dirFd(true); err != nil {
			return nil, err
		}
		defer unix.Close(fd)
	}
	return ov.listFd(n, fd)
}

// listAt lists directory d whose upper directory (if d.upper) is at rel.
func (ov *overlay) listAt(d *node, rel string) ([]mergedEntry, error) {
	fd := -1
	if d.upper.Load() {
		var err error
		if fd, err = ov.u.dirRead(rel); err != nil {
			return nil, err
		}
		defer unix.Close(fd)
	}
	return ov.listFd(d, fd)
}

// listFd lists directory d whose upper directory (if d.upper) is open for
// reading at fd. Upper names hide lower ones; whiteouts hide lower names;
// the overlay's own names are skipped.
func (ov *overlay) listFd(d *node, fd int) ([]mergedEntry, error) {
	var out []mergedEntry
	seen := map[string]bool{}
	hidden := map[string]bool{}
	if fd >= 0 {
		ents, err := readDirents(fd)
		if err != nil {
			return nil, err
		}
		for _, de := range ents {
			if isReserved(de.name) {
				if s, ok := whiteoutTarget(fd, de.name); ok {
					hidden[s] = true
				}
				continue
			}
			seen[de.name] = true
			me := mergedEntry{name: de.name, mode: dtToMode(de.typ), upper: true}
			if me.mode == syscall.S_IFDIR {
				// A directory's st_ino and merge source depend on its
				// markers and the lower layer: resolve it as Lookup does.
				e := entry{upper: true}
				if st, err := statxAt(fd, de.name); err == nil {
					e.ust = st
					if d.lower != 0 && ov.lower != nil {
						if a, err := ov.lower.Lookup(d.lower, de.name); err == nil {
							e.lowerIno, e.lowerAttr = a.Ino, a
						}
					}
					if id, err := ov.identify(d, fd, de.name, &e); err == nil {
						me.ino, me.lower = id.ino, id.lower
					}
				}
			} else if ov.inos.known(de.ino) {
				// Copied up, guarded, or its own number kept by
				// another file: its birth time says which.
				me.ino = de.ino + upperInoBase
				if st, err := statxAt(fd, de.name); err == nil {
					me.ino, _ = ov.upperIno(&st)
				}
			} else {
				me.ino = de.ino + upperInoBase
			}
			out = append(out, me)
		}
	}
	if d.lower != 0 && ov.lower != nil {
		lents, err := ov.lower.ReadDir(d.lower)
		if err != nil {
			return nil, err
		}
		for _, le := range lents {
			if seen[le.Name] || hidden[le.Name] {
				continue
			}
			out = append(out, mergedEntry{name: le.Name, mode: fileModeToUnix(le.Mode) & syscall.S_IFMT, ino: uint64(le.Ino), lower: le.Ino})
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].name < out[j].name })
	return out, nil
}

func dtToMode(t uint8) uint32 {
	switch t {
	case unix.DT_DIR:
		return syscall.S_IFDIR
	case unix.DT_LNK:
		return syscall.S_IFLNK
	case unix.DT_FIFO:
		return syscall.S_IFIFO
	case unix.DT_SOCK:
		return syscall.S_IFSOCK
	case unix.DT_CHR:
		return syscall.S_IFCHR
	case unix.DT_BLK:
		return syscall.S_IFBLK
	default:
		return syscall.S_IFREG
	}
}

// timespec converts a time to a unix.Timespec.
func timespec(t time.Time) unix.Timespec {
	return unix.NsecToTimespec(t.UnixNano())
}
