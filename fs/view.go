package fs

import (
	"context"
	"errors"
	"fmt"
	"io"
	iofs "io/fs"
	"runtime/debug"
	"sort"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/hermesfs/hermesfs/archive"
)

// View is the merged tree as it was at a Freeze, readable while the mount
// goes on changing. It implements io/fs.FS, io/fs.ReadDirFS and
// io/fs.ReadLinkFS (Lstat, ReadLink), which is what archive.Pack needs.
// Symlinks are never followed. FileInfo.Sys() is a *syscall.Stat_t with
// Uid, Gid, Rdev, Ino, Nlink and times; Ino identifies an inode within the
// view (names of one upper inode share it, names of one lower inode share
// it), so hard links pack as hard links. Files opened from it implement
// io.ReaderAt; a file that is unchanged lower content also implements
// archive.BlockSource, so its compressed blocks can be copied verbatim.
//
// A View may be read from many goroutines at once. It holds resources in
// the upper layer's work directory until Close.
type View struct {
	ov         *overlay
	gen        uint64
	stall      time.Duration
	writeStall time.Duration
	lower      Lower
	inos       map[uint64]inoRec
	root       *ventry // the upper root

	// origins are the lower numbers inos keeps (copiedUp), made once.
	originsOnce sync.Once
	origins     map[archive.Inode]bool

	// capMu guards the maps below; it is never held across a listing.
	capMu sync.RWMutex
	// dirs are the listings of upper directories, by upper inode
	// number: kept before their first change, or read by the view. A
	// slot enters the map when its listing starts, so the view and
	// mutations of that one directory take turns (see keptListing).
	dirs map[uint64]*dirSlot
	// inodes are the upper inodes the view or a mutation has met since
	// the freeze, by upper inode number.
	inodes map[uint64]*capInode
	// born are upper inodes the overlay created after the freeze.
	born map[uint64]bool

	dirName string // in the work directory: sidecars and pins
	dirfd   int

	mu      sync.Mutex
	renames []renameRec
	pinFds  int
	closed  bool
}

var (
	_ iofs.FS         = (*View)(nil)
	_ iofs.ReadDirFS  = (*View)(nil)
	_ iofs.ReadLinkFS = (*View)(nil)
)

// vdir is the listing of an upper directory at the freeze.
type vdir struct {
	ents        []ventry        // in the order the upper file system lists them
	hidden      map[string]bool // whited-out lower names
	opaque      bool
	redirect    string
	hasRedirect bool

	// index finds entries by name; built at the first lookup, after the
	// freeze.
	indexOnce sync.Once
	index     map[string]*ventry
	statOnce  sync.Once // statEntries
}

// lookup returns the entry name, or nil.
func (d *vdir) lookup(name string) *ventry {
	d.indexOnce.Do(func() {
		d.index = make(map[string]*ventry, len(d.ents))
		for i := range d.ents {
			d.index[d.ents[i].name] = &d.ents[i]
		}
	})
	return d.index[name]
}

// ventry is an entry of an upper directory at the freeze.
type ventry struct {
	name   string
	kind   uint32 // S_IFMT bits
	uino   uint64 // the upper inode
	target string // a symlink's
}

// Generation is the mount's generation at the freeze: every mutation the
// view contains has a generation <= it, every later one a greater one.
func (v *View) Generation() uint64 { return v.gen }

// Stall is how long mutations were blocked while the view was captured
// (not counting the wait for mutations already in flight).
func (v *View) Stall() time.Duration { return v.stall }

// WriteStall is how long the writes of files open for writing with
// passthrough were stopped while Freeze copied them (0 if there were
// none); it includes Stall.
func (v *View) WriteStall() time.Duration { return v.writeStall }

// Close releases the view: saved blocks, pins, descriptors. The mount
// stops saving frozen bytes for it. Files opened from the view must not be
// used after.
func (v *View) Close() error {
	v.ov.views.remove(v)
	// A mutation that took the list of views before the removal may
	// still be saving bytes for this one: let mutations drain first.
	if err := v.ov.gate.freeze(context.Background()); err == nil {
		v.ov.gate.thaw()
	}
	err := v.release()
	v.ov.maybeClose()
	return err
}

func (v *View) release() error {
	// v.mu and capMu are taken one after the other, never nested.
	// Mutations no longer see the view (Close drained them), and readers
	// see closed.
	v.mu.Lock()
	if v.closed {
		v.mu.Unlock()
		return nil
	}
	v.closed = true
	v.mu.Unlock()
	v.capMu.Lock()
	defer v.capMu.Unlock()
	for _, ci := range v.inodes {
		ci.mu.Lock()
		if ci.sidecar >= 0 {
			unix.Close(ci.sidecar)
			ci.sidecar = -1
		}
		if ci.pinFd >= 0 {
			unix.Close(ci.pinFd)
			ci.pinFd = -1
		}
		ci.mu.Unlock()
	}
	if v.dirfd > 0 {
		unix.Close(v.dirfd)
		v.dirfd = -1
	}
	if v.dirName != "" {
		if err := removeAllAt(v.ov.u.work, v.dirName); err != nil {
			return fmt.Errorf("fs: close view: %w", err)
		}
	}
	return nil
}

// vobj is one object of the frozen merged tree.
type vobj struct {
	name  string
	path  string        // in the tree at the freeze ("" for the root), the upper path too
	up    *ventry       // the upper entry, nil for a lower object
	dir   *vdir         // the upper listing, for an upper directory
	lower archive.Inode // lower object; for a directory the one it merges
	lattr archive.Attr
}

func (o *vobj) isDir() bool {
	if o.up != nil {
		return o.up.kind == syscall.S_IFDIR
	}
	return o.lattr.Mode.IsDir()
}

func (v *View) rootObj() (vobj, error) {
	o := vobj{name: ".", up: v.root}
	d, err := v.listing(v.root, "")
	if err != nil {
		return o, err
	}
	o.dir = d
	if v.lower != nil {
		la, err := v.lower.Stat(v.lower.Root())
		if err != nil {
			return o, err
		}
		o.lower, o.lattr = la.Ino, la
	}
	return o, nil
}

// child resolves name in directory d.
func (v *View) child(d *vobj, name string) (vobj, error) {
	c := vobj{name: name, path: joinRel(d.path, name)}
	var hidden bool
	if d.dir != nil && !isReserved(name) {
		if e := d.dir.lookup(name); e != nil {
			c.up = e
			if e.kind == syscall.S_IFDIR {
				sub, err := v.listing(e, c.path)
				if err != nil {
					return c, err
				}
				c.dir = sub
				// Its merge source, as the live overlay works it out.
				switch {
				case sub.hasRedirect:
					if a, err := v.lowerWalk(sub.redirect); err == nil && a.Mode.IsDir() {
						c.lower, c.lattr = a.Ino, a
					}
				case sub.opaque:
				case d.lower != 0:
					if a, err := v.lower.Lookup(d.lower, name); err == nil && a.Mode.IsDir() {
						c.lower, c.lattr = a.Ino, a
					}
				}
			}
			return c, nil
		}
		hidden = d.dir.hidden[name]
	}
	if !hidden && d.lower != 0 && v.lower != nil {
		a, err := v.lower.Lookup(d.lower, name)
		if err == nil {
			c.lower, c.lattr = a.Ino, a
			return c, nil
		}
		if !errors.Is(err, iofs.ErrNotExist) {
			return c, err
		}
	}
	return c, iofs.ErrNotExist
}

func (v *View) lowerWalk(p string) (archive.Attr, error) {
	return lowerWalk(v.lower, p)
}

// resolve walks name (an io/fs path) without following symlinks.
func (v *View) resolve(op, name string) (vobj, error) {
	rel, ok := cleanRel(name)
	if !ok {
		return vobj{}, &iofs.PathError{Op: op, Path: name, Err: iofs.ErrInvalid}
	}
	o, err := v.rootObj()
	if err != nil {
		return o, &iofs.PathError{Op: op, Path: name, Err: err}
	}
	if rel == "" {
		return o, nil
	}
	for _, el := range splitPath(rel) {
		if !o.isDir() {
			return o, &iofs.PathError{Op: op, Path: name, Err: iofs.ErrNotExist}
		}
		if o, err = v.child(&o, el); err != nil {
			return o, &iofs.PathError{Op: op, Path: name, Err: err}
		}
	}
	return o, nil
}

// info is the FileInfo of o.
func (v *View) info(o *vobj) (*vinfo, error) {
	fi := &vinfo{name: o.name}
	st := &syscall.Stat_t{}
	if o.up != nil {
		u, err := v.attrs(o.up, o.path)
		if err != nil {
			return nil, err
		}
		st.Mode = u.mode
		st.Nlink = uint64(u.nlink)
		st.Uid, st.Gid = u.uid, u.gid
		st.Rdev = u.rdev
		st.Size = u.size
		st.Blksize = int64(u.blksize)
		st.Blocks = u.blocks
		st.Atim = syscall.Timespec(u.atime)
		st.Mtim = syscall.Timespec(u.mtime)
		st.Ctim = syscall.Timespec(u.ctime)
		// Upper inodes are numbered apart from lower ones: a copied-up
		// file and a lower name of the same lower inode are different
		// inodes now and must not pack as one.
		st.Ino = u.ino + upperInoBase
		if o.dir != nil && o.lower != 0 {
			st.Nlink = v.mergedNlink(o)
		}
	} else {
		a := &o.lattr
		st.Mode = fileModeToUnix(a.Mode)
		st.Nlink = uint64(max(a.Nlink, 1))
		st.Uid, st.Gid = a.Uid, a.Gid
		st.Rdev = a.Rdev
		st.Size = a.Size
		st.Blksize = 4096
		st.Blocks = (a.Size + 511) / 512
		ts := syscall.NsecToTimespec(a.Mtime.UnixNano())
		st.Atim, st.Mtim, st.Ctim = ts, ts, ts
		st.Ino = uint64(a.Ino)
	}
	fi.sys = st
	fi.mode = unixToFileMode(st.Mode)
	return fi, nil
}

// listing returns the listing at the freeze of upper directory e, at path
// p in the frozen tree: the one kept by its first change, or, if nothing
// changed it yet, read now (a change of it waits meanwhile: keptListing).
func (v *View) listing(e *ventry, p string) (*vdir, error) {
	return v.keptListing(e.uino, func() (*vdir, []ustat, error) {
		return v.readDir(e.uino, p)
	})
}

// testHookListing, if set by a test, runs as a view starts reading the
// listing of an upper directory (by inode number), holding its slot and
// its descriptor.
var testHookListing func(uino uint64)

// dirSlot holds the listing of one upper directory once done is closed;
// a failed listing leaves the map (err says why to those who waited).
type dirSlot struct {
	done chan struct{}
	d    *vdir
	err  error
}

// keptListing returns the listing of upper directory uino at the freeze,
// reading it with read if nobody has yet. Its slot is in the map while
// read runs, so a change of that directory (which keeps the listing
// first) waits for it, and the view waits for a change's keeping; both
// run read with the directory unchanged since the freeze. Changes of
// other directories and files do not wait: capMu is not held across the
// listing. If the read of whoever got the slot fails, a waiter reads
// itself: a view's failure (closed, directory gone) is not a mutation's.
func (v *View) keptListing(uino uint64, read func() (*vdir, []ustat, error)) (*vdir, error) {
	for {
		v.capMu.RLock()
		s := v.dirs[uino]
		v.capMu.RUnlock()
		if s == nil {
			v.capMu.Lock()
			if s = v.dirs[uino]; s == nil {
				s = &dirSlot{done: make(chan struct{})}
				v.dirs[uino] = s
				v.capMu.Unlock()
				return v.fillSlot(uino, s, read)
			}
			v.capMu.Unlock()
		}
		<-s.done
		if s.err == nil {
			return s.d, nil
		}
	}
}

// fillSlot runs read for the slot of uino it just put in the map.
func (v *View) fillSlot(uino uint64, s *dirSlot, read func() (*vdir, []ustat, error)) (*vdir, error) {
	d, stats, err := read()
	if err != nil {
		v.capMu.Lock()
		delete(v.dirs, uino)
		v.capMu.Unlock()
	}
	s.d, s.err = d, err
	close(s.done)
	if err != nil {
		return nil, err
	}
	v.keepAll(stats)
	return d, nil
}

// readDir lists upper directory uino, unchanged since the freeze (its
// slot is held: no change of its entries can begin), where it is now.
func (v *View) readDir(uino uint64, p string) (*vdir, []ustat, error) {
	fd, err := v.frozenDir(uino, p)
	if err != nil {
		return nil, nil, err
	}
	defer v.ov.u.put(fd)
	if testHookListing != nil {
		testHookListing(uino)
	}
	return v.listDir(fd, p)
}

// frozenDir opens upper directory uino, at p in the frozen tree, where it
// is now: at p as moved by later renames (which wait meanwhile), checked
// by inode number. The descriptor stays right whatever moves the
// directory later; the caller puts it back (upper.put).
func (v *View) frozenDir(uino uint64, p string) (int, error) {
	unlock := v.ov.views.lockRenames()
	defer unlock()
	if err := v.checkOpen(); err != nil {
		return -1, err
	}
	fd, err := v.ov.u.dir(translate(p, v.renameLog()))
	if err != nil {
		return -1, fmt.Errorf("upper directory %q: %w", p, err)
	}
	if st, err := statFd(fd); err != nil || st.ino != uino {
		v.ov.u.put(fd)
		return -1, fmt.Errorf("upper directory %q (inode %d) is gone", p, uino)
	}
	return fd, nil
}

func (v *View) checkOpen() error {
	v.mu.Lock()
	defer v.mu.Unlock()
	if v.closed {
		return iofs.ErrClosed
	}
	return nil
}

func (v *View) renameLog() []renameRec {
	v.mu.Lock()
	defer v.mu.Unlock()
	return v.renames
}

// attrs returns the status at the freeze of upper entry e, at path p in
// the frozen tree: the one kept by the first change to it, or, if nothing
// changed it yet, its status now, read under the inode's attrMu so that no
// change can slip in between (a change keeps first, under the same lock).
func (v *View) attrs(e *ventry, p string) (*ustat, error) {
	ci := v.node(e.uino, e.kind)
	if err := ci.keepWith(func() (ustat, error) { return v.statCaptured(ci, p) }); err != nil {
		return nil, err
	}
	return &ci.st, nil
}

// statEntries takes the statuses of the entries of listing d (upper
// directory uino, at p in the frozen tree) that nothing has kept yet, in
// one pass over the directory where it is now: a statx per entry, instead
// of a walk of its path each time one is asked for. An entry's name that
// leads elsewhere now is left for attrs: its own status was kept when it
// moved or went.
func (v *View) statEntries(d *vdir, uino uint64, p string) {
	d.statOnce.Do(func() {
		fd, err := v.frozenDir(uino, p)
		if err != nil {
			return
		}
		defer v.ov.u.put(fd)
		for i := range d.ents {
			e := &d.ents[i]
			ci := v.node(e.uino, e.kind)
			ci.keepWith(func() (ustat, error) { return statxAt(fd, e.name) })
		}
	})
}

// statCaptured stats upper inode ci, named p at the freeze, where it is
// now: at p as moved by later renames (which wait meanwhile), or its pin.
func (v *View) statCaptured(ci *capInode, p string) (ustat, error) {
	unlock := v.ov.views.lockRenames()
	defer unlock()
	if err := v.checkOpen(); err != nil {
		return ustat{}, err
	}
	if p == "" {
		return statFd(v.ov.u.root)
	}
	dir, name := splitRel(translate(p, v.renameLog()))
	if dfd, err := v.ov.u.dir(dir); err == nil {
		st, err := statxAt(dfd, name)
		v.ov.u.put(dfd)
		if err == nil && st.ino == ci.uino {
			return st, nil
		}
	}
	fd, err := v.openPin(ci)
	if err != nil {
		return ustat{}, err
	}
	if fd < 0 {
		return ustat{}, fmt.Errorf("upper inode %d (%s at the freeze) is gone", ci.uino, p)
	}
	defer unix.Close(fd)
	return statFd(fd)
}

// openPin opens ci's pin (its descriptor again, or its link in the view's
// directory), or returns -1 when it has none. It holds v.mu, which Close
// takes to mark the view closed before it drops pins.
func (v *View) openPin(ci *capInode) (int, error) {
	v.mu.Lock()
	defer v.mu.Unlock()
	switch {
	case v.closed:
		return -1, iofs.ErrClosed
	case ci.pinFd >= 0:
		return unix.FcntlInt(uintptr(ci.pinFd), unix.F_DUPFD_CLOEXEC, 0)
	case ci.pinned != "":
		return unix.Openat(v.dirfd, ci.pinned, unix.O_RDONLY|unix.O_CLOEXEC, 0)
	}
	return -1, nil
}

// vinfo is an io/fs.FileInfo of the view.
type vinfo struct {
	name string
	mode iofs.FileMode
	sys  *syscall.Stat_t
}

func (i *vinfo) Name() string { return i.name }
func (i *vinfo) Size() int64  { return i.sys.Size }
func (i *vinfo) Mode() iofs.FileMode {
	return i.mode
}
func (i *vinfo) ModTime() time.Time { return time.Unix(i.sys.Mtim.Sec, i.sys.Mtim.Nsec) }
func (i *vinfo) IsDir() bool        { return i.mode.IsDir() }
func (i *vinfo) Sys() any           { return i.sys }

// unixToFileMode converts st_mode bits to an io/fs mode.
func unixToFileMode(m uint32) iofs.FileMode {
	mode := iofs.FileMode(m & 0o777)
	switch m & syscall.S_IFMT {
	case syscall.S_IFDIR:
		mode |= iofs.ModeDir
	case syscall.S_IFLNK:
		mode |= iofs.ModeSymlink
	case syscall.S_IFIFO:
		mode |= iofs.ModeNamedPipe
	case syscall.S_IFSOCK:
		mode |= iofs.ModeSocket
	case syscall.S_IFCHR:
		mode |= iofs.ModeDevice | iofs.ModeCharDevice
	case syscall.S_IFBLK:
		mode |= iofs.ModeDevice
	}
	if m&syscall.S_ISUID != 0 {
		mode |= iofs.ModeSetuid
	}
	if m&syscall.S_ISGID != 0 {
		mode |= iofs.ModeSetgid
	}
	if m&syscall.S_ISVTX != 0 {
		mode |= iofs.ModeSticky
	}
	return mode
}

// recoverRead ends a panic of the view's operation op on path, which a
// bug in the read path may raise, with an error naming the file: a
// snapshot that meets a bug fails, and nothing panics out of the view
// into the packer.
func (v *View) recoverRead(op, path string, err *error) {
	r := recover()
	if r == nil {
		return
	}
	v.ov.log.Error("snapshot view: internal error", "op", op, "path", path, "panic", r, "stack", string(debug.Stack()))
	*err = fmt.Errorf("fs: snapshot view: %s %s: internal error (a bug; the snapshot fails, nothing is lost): %v", op, path, r)
}

// readErr names the file in an error of a view file's read; io.EOF stays
// itself.
func readErr(path string, err error) error {
	if err == nil || err == io.EOF {
		return err
	}
	var pe *iofs.PathError
	if errors.As(err, &pe) {
		return err
	}
	return &iofs.PathError{Op: "read", Path: path, Err: err}
}

// Lstat describes name without following a final symlink.
func (v *View) Lstat(name string) (_ iofs.FileInfo, err error) {
	defer v.recoverRead("lstat", name, &err)
	o, err := v.resolve("lstat", name)
	if err != nil {
		return nil, err
	}
	fi, err := v.info(&o)
	if err != nil {
		return nil, &iofs.PathError{Op: "lstat", Path: name, Err: err}
	}
	if name == "." {
		fi.name = "."
	}
	return fi, nil
}

// Stat is Lstat: the view follows no symlinks.
func (v *View) Stat(name string) (iofs.FileInfo, error) { return v.Lstat(name) }

// ReadLink returns a symlink's target.
func (v *View) ReadLink(name string) (_ string, err error) {
	defer v.recoverRead("readlink", name, &err)
	o, err := v.resolve("readlink", name)
	if err != nil {
		return "", err
	}
	if o.up != nil {
		if o.up.kind != syscall.S_IFLNK {
			return "", &iofs.PathError{Op: "readlink", Path: name, Err: iofs.ErrInvalid}
		}
		return o.up.target, nil
	}
	if o.lattr.Mode&iofs.ModeSymlink == 0 {
		return "", &iofs.PathError{Op: "readlink", Path: name, Err: iofs.ErrInvalid}
	}
	t, err := v.lower.Readlink(o.lower)
	if err != nil {
		return "", &iofs.PathError{Op: "readlink", Path: name, Err: err}
	}
	return t, nil
}

// ReadDir lists a directory sorted by name.
func (v *View) ReadDir(name string) (_ []iofs.DirEntry, err error) {
	defer v.recoverRead("readdir", name, &err)
	o, err := v.resolve("readdir", name)
	if err != nil {
		return nil, err
	}
	if !o.isDir() {
		return nil, &iofs.PathError{Op: "readdir", Path: name, Err: syscall.ENOTDIR}
	}
	ents, err := v.list(&o)
	if err != nil {
		return nil, &iofs.PathError{Op: "readdir", Path: name, Err: err}
	}
	return ents, nil
}

func (v *View) list(d *vobj) ([]iofs.DirEntry, error) {
	var out []iofs.DirEntry
	var hidden map[string]bool
	seen := map[string]bool{}
	if d.dir != nil {
		hidden = d.dir.hidden
		v.statEntries(d.dir, d.up.uino, d.path)
		for i := range d.dir.ents {
			name := d.dir.ents[i].name
			c, err := v.child(d, name)
			if err != nil {
				return nil, err
			}
			seen[name] = true
			fi, err := v.info(&c)
			if err != nil {
				return nil, err
			}
			out = append(out, &vdirent{fi: fi})
		}
	}
	if d.lower != 0 && v.lower != nil {
		lents, err := v.lower.ReadDir(d.lower)
		if err != nil {
			return nil, err
		}
		for _, le := range lents {
			if seen[le.Name] || hidden[le.Name] {
				continue
			}
			out = append(out, &vdirent{v: v, name: le.Name, ino: le.Ino, mode: le.Mode})
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Name() < out[j].Name() })
	return out, nil
}

// vdirent is a directory entry; a lower one stats its inode on demand.
type vdirent struct {
	fi   *vinfo
	v    *View
	name string
	ino  archive.Inode
	mode iofs.FileMode
}

func (e *vdirent) Name() string {
	if e.fi != nil {
		return e.fi.name
	}
	return e.name
}

func (e *vdirent) IsDir() bool { return e.Type().IsDir() }

func (e *vdirent) Type() iofs.FileMode {
	if e.fi != nil {
		return e.fi.mode.Type()
	}
	return e.mode.Type()
}

func (e *vdirent) Info() (_ iofs.FileInfo, err error) {
	if e.fi != nil {
		return e.fi, nil
	}
	defer e.v.recoverRead("stat", e.name, &err)
	a, err := e.v.lower.Stat(e.ino)
	if err != nil {
		return nil, err
	}
	o := vobj{name: e.name, lower: e.ino, lattr: a}
	return e.v.info(&o)
}

func (e *vdirent) String() string { return iofs.FormatDirEntry(e) }

// Open opens name for reading. Directories implement iofs.ReadDirFile.
func (v *View) Open(name string) (_ iofs.File, err error) {
	defer v.recoverRead("open", name, &err)
	o, err := v.resolve("open", name)
	if err != nil {
		return nil, err
	}
	fi, err := v.info(&o)
	if err != nil {
		return nil, &iofs.PathError{Op: "open", Path: name, Err: err}
	}
	if name == "." {
		fi.name = "."
	}
	switch {
	case o.isDir():
		return &viewDir{v: v, o: o, fi: fi, path: name}, nil
	case fi.mode.Type() != 0:
		return &viewSpecial{fi: fi}, nil
	case o.up != nil:
		ci := v.node(o.up.uino, o.up.kind)
		fd, err := v.openCaptured(ci, o.path)
		if err != nil {
			return nil, &iofs.PathError{Op: "open", Path: name, Err: err}
		}
		return &viewFile{v: v, path: name, fi: fi, cf: ci, size: fi.sys.Size, fd: fd, parts: v.ov.partials}, nil
	default:
		return &lowerViewFile{v: v, path: name, fi: fi, ino: o.lower, size: o.lattr.Size}, nil
	}
}

// openCaptured opens upper file cf, named p at the freeze, wherever its
// content lives now: pinned, or at p as moved by later renames. Renames
// wait meanwhile (they log themselves under the same lock), so the
// translated name matches the tree; a name being destroyed is pinned
// before it goes.
func (v *View) openCaptured(cf *capInode, p string) (int, error) {
	unlock := v.ov.views.lockRenames()
	defer unlock()
	if fd, err := v.openPin(cf); fd >= 0 || err != nil {
		return fd, err
	}
	dir, name := splitRel(translate(p, v.renameLog()))
	if dfd, err := v.ov.u.dir(dir); err == nil {
		fd, err := unix.Openat(dfd, name, unix.O_RDONLY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
		v.ov.u.put(dfd)
		if err == nil {
			if st, err := statFd(fd); err == nil && st.ino == cf.uino {
				return fd, nil
			}
			unix.Close(fd)
		}
	}
	// An unlink racing with this open pins the file first: look again.
	if fd, err := v.openPin(cf); fd >= 0 || err != nil {
		return fd, err
	}
	return -1, fmt.Errorf("captured file %s is gone", p)
}

// viewFile reads a captured upper file: its live bytes, with the blocks
// changed since the freeze read back from the sidecar, clipped to the
// frozen size.
type viewFile struct {
	v    *View
	path string // in the view
	fi   *vinfo
	cf   *capInode
	size int64 // at the freeze
	fd   int
	// parts finds the file's partial state: a copy-up by range reads
	// merged with the lower layer until complete.
	parts *partialSet
	off   int64
	mu    sync.Mutex
	// buf holds the bytes at bufOff for sequential Reads.
	buf    []byte
	bufOff int64
}

func (f *viewFile) Stat() (iofs.FileInfo, error) { return f.fi, nil }

func (f *viewFile) Close() error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.fd < 0 {
		return iofs.ErrClosed
	}
	err := unix.Close(f.fd)
	f.fd = -1
	return err
}

func (f *viewFile) Read(p []byte) (_ int, err error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	defer f.v.recoverRead("read", f.path, &err)
	defer func() { err = readErr(f.path, err) }()
	if len(p) >= viewReadBuf {
		k, err := f.readAt(p, f.off)
		f.off += int64(k)
		return k, err
	}
	if f.off < f.bufOff || f.off >= f.bufOff+int64(len(f.buf)) {
		if f.buf == nil {
			f.buf = make([]byte, viewReadBuf)
		}
		k, err := f.readAt(f.buf[:viewReadBuf], f.off)
		f.buf, f.bufOff = f.buf[:k], f.off
		if k == 0 {
			return 0, err
		}
	}
	k := copy(p, f.buf[f.off-f.bufOff:])
	f.off += int64(k)
	return k, nil
}

// viewReadBuf is the read-ahead of sequential small Reads.
const viewReadBuf = 64 << 10

func (f *viewFile) ReadAt(p []byte, off int64) (_ int, err error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	defer f.v.recoverRead("read", f.path, &err)
	k, err := f.readAt(p, off)
	return k, readErr(f.path, err)
}

func (f *viewFile) readAt(p []byte, off int64) (int, error) {
	if f.fd < 0 {
		return 0, iofs.ErrClosed
	}
	cf := f.cf
	if off < 0 {
		return 0, iofs.ErrInvalid
	}
	if off >= f.size {
		return 0, io.EOF
	}
	want := min(int64(len(p)), f.size-off)
	buf := p[:want]
	pread := preadFull
	if part := f.parts.get(cf.uino, f.fd); part != nil {
		pread = part.readAt
	}
	k, err := pread(f.fd, buf, off)
	if err != nil {
		return 0, err
	}
	clear(buf[k:])
	// Saved blocks were recorded before the live bytes changed, so
	// reading live first and overlaying saved blocks after cannot miss a
	// change.
	cf.mu.Lock()
	defer cf.mu.Unlock()
	if cf.nsavedBl > 0 {
		end := off + want
		for b := off / preserveBlock; b*preserveBlock < end; b++ {
			if !cf.isSaved(b) {
				continue
			}
			lo := max(b*preserveBlock, off)
			hi := min((b+1)*preserveBlock, end)
			if _, err := preadFull(cf.sidecar, buf[lo-off:hi-off], lo); err != nil {
				return 0, err
			}
		}
	}
	if off+want == f.size {
		return int(want), io.EOF
	}
	return int(want), nil
}

// PartialArchiveSource implements archive.PartialSource for a file copied
// up by range: the lower inode it was copied from, and which of its bytes
// may have changed since (partial_changes.go). A file of which no byte can
// be unchanged, or that has no map, is not one (ok false).
func (f *viewFile) PartialArchiveSource() (*archive.Reader, archive.Inode, func(off, n int64) bool, bool) {
	f.mu.Lock()
	fd := f.fd
	f.mu.Unlock()
	if fd < 0 {
		return nil, 0, nil, false
	}
	r := archiveOf(f.v.lower)
	if r == nil || !f.cf.attrsKept.Load() {
		return nil, 0, nil, false
	}
	p := f.parts.track(f.cf.uino, fd)
	if p == nil || !p.is(&f.cf.st) {
		return nil, 0, nil, false
	}
	p.mu.Lock()
	ok := p.useful()
	p.mu.Unlock()
	if !ok {
		return nil, 0, nil, false
	}
	return r, p.lower, p.changedRange, true
}

var _ archive.PartialSource = (*viewFile)(nil)

// archiveOf is the archive a lower layer reads, if it is one.
func archiveOf(l Lower) *archive.Reader {
	switch l := l.(type) {
	case *archive.Reader:
		return l
	case ArchiveReaderer:
		return l.ArchiveReader()
	}
	return nil
}

// lowerViewFile reads unchanged lower content.
type lowerViewFile struct {
	v    *View
	path string // in the view
	fi   *vinfo
	ino  archive.Inode
	size int64
	mu   sync.Mutex
	off  int64
}

func (f *lowerViewFile) Stat() (iofs.FileInfo, error) { return f.fi, nil }
func (f *lowerViewFile) Close() error                 { return nil }

func (f *lowerViewFile) Read(p []byte) (int, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	k, err := f.ReadAt(p, f.off)
	f.off += int64(k)
	return k, err
}

func (f *lowerViewFile) ReadAt(p []byte, off int64) (_ int, err error) {
	defer f.v.recoverRead("read", f.path, &err)
	defer func() { err = readErr(f.path, err) }()
	if off >= f.size {
		return 0, io.EOF
	}
	want := min(int64(len(p)), f.size-off)
	k, err := f.v.lower.ReadAt(f.ino, p[:want], off)
	if err == nil && int64(k) == want && off+want == f.size {
		err = io.EOF
	}
	return k, err
}

// ArchiveSource implements archive.BlockSource: the content is the lower
// inode itself.
func (f *lowerViewFile) ArchiveSource() (*archive.Reader, archive.Inode, bool) {
	if r := archiveOf(f.v.lower); r != nil {
		return r, f.ino, true
	}
	return nil, 0, false
}

var _ archive.BlockSource = (*lowerViewFile)(nil)

// viewDir is an open directory of the view.
type viewDir struct {
	v    *View
	path string // in the view
	o    vobj
	fi   *vinfo
	mu   sync.Mutex
	ents []iofs.DirEntry
	read bool
}

func (d *viewDir) Stat() (iofs.FileInfo, error) { return d.fi, nil }
func (d *viewDir) Close() error                 { return nil }
func (d *viewDir) Read([]byte) (int, error) {
	return 0, &iofs.PathError{Op: "read", Path: d.fi.name, Err: syscall.EISDIR}
}

func (d *viewDir) ReadDir(n int) (_ []iofs.DirEntry, err error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	defer d.v.recoverRead("readdir", d.path, &err)
	if !d.read {
		ents, err := d.v.list(&d.o)
		if err != nil {
			return nil, err
		}
		d.ents, d.read = ents, true
	}
	if n <= 0 {
		out := d.ents
		d.ents = nil
		return out, nil
	}
	if len(d.ents) == 0 {
		return nil, io.EOF
	}
	k := min(n, len(d.ents))
	out := d.ents[:k]
	d.ents = d.ents[k:]
	return out, nil
}

// viewSpecial is an open symlink, device, fifo or socket: it can be
// stat'ed; it has no content.
type viewSpecial struct{ fi *vinfo }

func (s *viewSpecial) Stat() (iofs.FileInfo, error) { return s.fi, nil }
func (s *viewSpecial) Close() error                 { return nil }
func (s *viewSpecial) Read([]byte) (int, error)     { return 0, io.EOF }
