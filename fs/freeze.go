package fs

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// Freeze captures the merged tree at one instant and returns it as a View.
//
// It closes the gate (new mutations wait, those in flight finish), notes
// the instant (the generation, the inode map, the upper root's status) and
// reopens the gate: mutations are blocked for a constant time, however
// many entries the upper layer holds and however much data changed.
// Nothing is copied or listed then.
//
// The view is copy-on-write from then on, until View.Close: before a
// mutation changes an upper inode that may be part of the frozen tree, the
// overlay keeps for every open view what the change would lose. A
// directory's listing (names, inode numbers, types, symlink targets,
// whiteouts and markers) is kept before its first change of entries, an
// inode's status before its first change, a regular file's bytes before
// the first change of each block (in a sidecar), and a regular file about
// to lose its name is pinned. Inodes the overlay creates after the freeze
// are noted as such and cost nothing. Whatever nothing changed, the view
// reads from the upper layer itself when it needs it, under the same locks
// the mutations take to keep, so nothing can change in between. The lower
// layer is immutable and needs nothing.
//
// Files open for writing with passthrough are the exception: the kernel
// writes them without the daemon, so they cannot be copied on write.
// Freeze stops their writes first, and copies them whole into the view
// before letting the writes go on (ptwrite.go); their writers wait for
// that copy (View.WriteStall).
//
// Freeze honours ctx while it waits for mutations in flight.
func (m *Mounted) Freeze(ctx context.Context) (*View, error) { return m.freeze(ctx, false) }

// Seal takes the mount's last view, for a stop: it is Freeze, except that
// the gate never opens again and files written through passthrough are
// revoked instead of stopped for an instant (revokePTWrites). From the
// freeze on, every mutation fails with EROFS (opens for writing too), and
// every read and write of a file that was open for writing through
// passthrough fails with EIO; so the view is the last state any writer was
// told succeeded. Only stores into a shared mapping of such a file, made
// before or after, can still change the upper layer (no system call
// carries them); Generation counts them as changes after the view.
//
// The mount is sealed however Seal returns: on an error (ctx ended while
// mutations were in flight) those finish, the rest fail, and no view says
// what the upper layer holds. Freezes after Seal take views of the sealed
// tree, at once.
func (m *Mounted) Seal(ctx context.Context) (*View, error) { return m.freeze(ctx, true) }

func (m *Mounted) freeze(ctx context.Context, seal bool) (*View, error) {
	ov := m.ov
	what := "freeze"
	if seal {
		what = "seal"
		// Sealed whatever happens below.
		defer ov.gate.seal()
	}
	ov.freezeMu.Lock()
	defer ov.freezeMu.Unlock()
	defer ov.resumePTWrites()
	start := time.Now()
	var bs []*barrier
	var err error
	if seal {
		bs, err = m.revokePTWrites(ctx)
	} else {
		bs, err = m.stopPTWrites(ctx)
	}
	if err != nil {
		return nil, fmt.Errorf("fs: %s: %w", what, err)
	}
	// Noted before the gate closes, not while every mutation waits: the
	// barriers hold these files already (or they are revoked).
	ov.notePTWrites()
	if err := ov.gate.freeze(ctx); err != nil {
		releaseBarriers(ov, bs)
		return nil, fmt.Errorf("fs: %s: %w", what, err)
	}
	closed := time.Now()
	v, err := ov.capture()
	if err == nil {
		ov.views.add(v)
		ov.dirty.newEpoch(v.gen)
		ov.opts.Stats.noteFreeze()
	}
	v.stall = time.Since(closed)
	if seal {
		ov.gate.seal() // before the thaw: the waiters wake to EROFS
	}
	ov.gate.thaw()
	if err != nil {
		releaseBarriers(ov, bs)
		return nil, fmt.Errorf("fs: %s: %w", what, err)
	}
	for _, b := range bs {
		if err = v.preserve(b.uino, b.upperFd, 0, 1<<62); err != nil {
			err = fmt.Errorf("fs: %s: copy upper inode %d written through passthrough: %w", what, b.uino, err)
			break
		}
		cleanPages(b.upperFd)
	}
	if len(bs) > 0 && err == nil {
		ov.settlePTWrites(bs)
	}
	releaseBarriers(ov, bs)
	if len(bs) > 0 {
		v.writeStall = time.Since(start)
	}
	if err != nil {
		v.Close()
		return nil, err
	}
	if seal {
		ov.log.Info("sealed: the mount refuses every change from now on", "generation", v.gen, "stall", v.stall, "passthrough_files", len(bs), "passthrough_stall", v.writeStall)
	} else {
		ov.log.Info("frozen", "generation", v.gen, "stall", v.stall, "passthrough_files", len(bs), "passthrough_stall", v.writeStall)
	}
	return v, nil
}

var viewSeq atomic.Uint64

// capture starts a new View. The gate is closed.
func (ov *overlay) capture() (*View, error) {
	v := &View{
		ov:     ov,
		gen:    ov.gen.Load(),
		lower:  ov.lower,
		inos:   ov.inos.snapshot(),
		dirs:   map[uint64]*dirSlot{},
		inodes: map[uint64]*capInode{},
		born:   map[uint64]bool{},
		dirfd:  -1,
	}
	if !ov.opts.ReadOnly {
		// Sidecars and pins go here; a read-only mount changes nothing
		// and needs none.
		v.dirName = "view-" + strconv.FormatUint(viewSeq.Add(1), 10) + "-" + strconv.FormatInt(time.Now().UnixNano(), 36)
		if err := unix.Mkdirat(ov.u.work, v.dirName, 0o700); err != nil {
			return v, err
		}
		fd, err := unix.Openat(ov.u.work, v.dirName, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
		if err != nil {
			removeAllAt(ov.u.work, v.dirName)
			v.dirName = ""
			return v, err
		}
		v.dirfd = fd
	}
	st, err := statFd(ov.u.root)
	if err != nil {
		v.release()
		return v, err
	}
	root := v.node(st.ino, syscall.S_IFDIR)
	root.keep(&st)
	v.root = &ventry{name: ".", kind: syscall.S_IFDIR, uino: st.ino}
	return v, nil
}

// listDir reads the listing of the upper directory open at fd (any mode):
// its entries by inode number and type, symlink targets, whiteouts and
// markers. Entries are stat'ed only where getdents' inode numbers are not
// stat's (upper.dinoStat) or its type is unknown; those statuses are
// returned for the caller to keep (with keepAll, once it holds no lock of
// the view), which is right whoever lists: an inode's status has not
// changed since the freeze unless a change kept it first.
func (v *View) listDir(fd int, where string) (*vdir, []ustat, error) {
	rfd, err := unix.Openat(fd, ".", unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, nil, fmt.Errorf("open %q: %w", where, err)
	}
	defer unix.Close(rfd)
	ents, err := readDirents(rfd)
	if err != nil {
		return nil, nil, fmt.Errorf("list %q: %w", where, err)
	}
	var stats []ustat
	n := 0
	for i := range ents {
		if !isReserved(ents[i].name) {
			n++
		}
	}
	d := &vdir{ents: make([]ventry, 0, n)}
	for _, de := range ents {
		name := de.name
		if isReserved(name) {
			switch {
			case name == opaqueMarker:
				d.opaque = true
			case name == redirectMarker:
				s, err := readSmall(rfd, name)
				if err != nil {
					return nil, nil, fmt.Errorf("read %q in %q: %w", name, where, err)
				}
				d.redirect, d.hasRedirect = s, true
			default:
				if s, ok := whiteoutTarget(rfd, name); ok {
					if d.hidden == nil {
						d.hidden = map[string]bool{}
					}
					d.hidden[s] = true
				}
			}
			continue
		}
		e := ventry{name: name, kind: dtToMode(de.typ), uino: de.ino}
		if v.ov.u.dinoStat || de.typ == unix.DT_UNKNOWN {
			st, err := statxAt(rfd, name)
			if err != nil {
				return nil, nil, fmt.Errorf("stat %q in %q: %w", name, where, err)
			}
			e.kind, e.uino = st.mode&syscall.S_IFMT, st.ino
			stats = append(stats, st)
		}
		if e.kind == syscall.S_IFLNK {
			// Symlinks never change, but one can go away with its
			// directory's next change, which keeps this listing.
			buf := make([]byte, 4096)
			k, err := unix.Readlinkat(rfd, name, buf)
			if err != nil {
				return nil, nil, fmt.Errorf("readlink %q in %q: %w", name, where, err)
			}
			e.target = string(buf[:k])
		}
		d.ents = append(d.ents, e)
	}
	return d, stats, nil
}

// keepAll keeps statuses listDir took.
func (v *View) keepAll(stats []ustat) {
	for i := range stats {
		v.node(stats[i].ino, stats[i].mode&syscall.S_IFMT).keep(&stats[i])
	}
}

// node returns the captured inode uino, made on first use.
func (v *View) node(uino uint64, kind uint32) *capInode {
	v.capMu.RLock()
	ci := v.inodes[uino]
	v.capMu.RUnlock()
	if ci != nil {
		return ci
	}
	v.capMu.Lock()
	defer v.capMu.Unlock()
	if ci = v.inodes[uino]; ci == nil {
		ci = &capInode{uino: uino, kind: kind, pinFd: -1, sidecar: -1}
		v.inodes[uino] = ci
	}
	return ci
}

// frozenNode returns the captured inode uino for a mutation about to
// change it, or nil if the overlay created it after the freeze (it cannot
// be part of the view). Its keep and keepWith do nothing once its status
// is kept.
func (v *View) frozenNode(uino uint64, kind uint32) *capInode {
	v.capMu.RLock()
	ci, born := v.inodes[uino], v.born[uino]
	v.capMu.RUnlock()
	switch {
	case born:
		return nil
	case ci != nil:
		return ci
	}
	return v.node(uino, kind)
}

// preserveBlock is the granularity at which frozen bytes are saved: the
// first write into a captured block copies the whole block to the sidecar.
const preserveBlock = 16 << 10

// capInode is one upper inode as a view keeps it: its status at the
// freeze, kept by the first change to it after the freeze or read by the
// view when it first needs it if nothing changed it before, and for a
// regular file its frozen bytes, kept block by block before they change,
// and a pin once its names go away.
type capInode struct {
	uino uint64
	kind uint32 // S_IFMT bits

	// attrMu serialises the keeping of st between mutations and the view.
	attrMu    sync.Mutex
	attrsKept atomic.Bool
	st        ustat // the status at the freeze, once attrsKept

	mu       sync.Mutex
	saved    []uint64 // bitmap of preserveBlock blocks saved in the sidecar
	sidecar  int      // sparse file holding saved blocks at their own offsets; -1 until needed
	pinned   string   // name of a hard link kept in the view directory, once its names went away
	pinFd    int      // or a descriptor kept open for the same purpose; -1 if none
	nsavedBl int
}

// keep records st as ci's frozen status unless one is recorded already.
// st must describe ci as it was at the freeze: taken before any change to
// it (every mutation keeps first).
func (ci *capInode) keep(st *ustat) {
	if ci.attrsKept.Load() {
		return
	}
	ci.attrMu.Lock()
	if !ci.attrsKept.Load() {
		ci.st = *st
		ci.attrsKept.Store(true)
	}
	ci.attrMu.Unlock()
}

// keepWith is keep with the status taken by stat, only if none is kept yet.
func (ci *capInode) keepWith(stat func() (ustat, error)) error {
	if ci.attrsKept.Load() {
		return nil
	}
	ci.attrMu.Lock()
	defer ci.attrMu.Unlock()
	if ci.attrsKept.Load() {
		return nil
	}
	st, err := stat()
	if err != nil {
		return err
	}
	if st.ino != ci.uino {
		return fmt.Errorf("keep status of upper inode %d: found inode %d", ci.uino, st.ino)
	}
	ci.st = st
	ci.attrsKept.Store(true)
	return nil
}

func (ci *capInode) isSaved(b int64) bool {
	i := b / 64
	return int(i) < len(ci.saved) && ci.saved[i]&(1<<(b%64)) != 0
}

func (ci *capInode) markSaved(b int64) {
	i := int(b / 64)
	for len(ci.saved) <= i {
		ci.saved = append(ci.saved, 0)
	}
	ci.saved[i] |= 1 << (b % 64)
	ci.nsavedBl++
}

// preserve keeps the status of file uino, open at fd and about to change,
// and saves its frozen bytes in [off, end) that are not saved yet.
func (v *View) preserve(uino uint64, fd int, off, end int64) error {
	ci := v.frozenNode(uino, syscall.S_IFREG)
	if ci == nil {
		return nil
	}
	if err := ci.keepWith(func() (ustat, error) { return statFd(fd) }); err != nil {
		return err
	}
	end = min(end, ci.st.size)
	if ci.kind != syscall.S_IFREG || off >= end || off < 0 {
		return nil
	}
	ci.mu.Lock()
	defer ci.mu.Unlock()
	// A partial file's holes are lower content: read it merged.
	part := v.ov.partials.get(uino, fd)
	pread := preadFull
	if part != nil {
		pread = part.readAt
	}
	if part == nil && off == 0 && ci.nsavedBl == 0 && end == ci.st.size && end > 4*preserveBlock {
		// The whole file, nothing saved yet (a freeze copying a file
		// written through passthrough, a truncation to zero, an
		// O_TRUNC open): copied by the kernel, which costs no read
		// into the daemon; what it could not copy (a file system or
		// descriptor without copy_file_range) the loop below saves.
		if err := v.copyWhole(ci, fd); err != nil {
			return err
		}
	}
	var buf []byte
	rfd := -1
	defer func() {
		if rfd >= 0 && rfd != fd {
			unix.Close(rfd)
		}
	}()
	for b := off / preserveBlock; b*preserveBlock < end; b++ {
		if ci.isSaved(b) {
			continue
		}
		if err := v.openSidecar(ci); err != nil {
			return err
		}
		if buf == nil {
			buf = make([]byte, preserveBlock)
		}
		boff := b * preserveBlock
		want := min(int64(preserveBlock), ci.st.size-boff)
		if rfd < 0 {
			rfd = fd
		}
		k, err := pread(rfd, buf[:want], boff)
		if err == unix.EBADF && rfd == fd {
			// A write-only descriptor: read through a fresh one.
			rfd, err = unix.Open("/proc/self/fd/"+strconv.Itoa(fd), unix.O_RDONLY|unix.O_CLOEXEC, 0)
			if err == nil {
				k, err = pread(rfd, buf[:want], boff)
			}
		}
		if err != nil {
			return fmt.Errorf("read frozen bytes: %w", err)
		}
		clear(buf[k:want])
		if err := pwriteAll(ci.sidecar, buf[:want], boff); err != nil {
			return fmt.Errorf("sidecar: %w", err)
		}
		ci.markSaved(b)
	}
	return nil
}

// copyWhole copies the frozen bytes of ci, open at fd, to its sidecar with
// copy_file_range and marks the blocks copied. ci.mu is held. Descriptors
// or file systems that cannot do it copy nothing and are no error.
func (v *View) copyWhole(ci *capInode, fd int) error {
	if err := v.openSidecar(ci); err != nil {
		return err
	}
	var done int64
	for done < ci.st.size {
		roff, woff := done, done
		k, err := unix.CopyFileRange(fd, &roff, ci.sidecar, &woff, int(min(ci.st.size-done, 1<<30)), 0)
		if err != nil || k == 0 {
			break
		}
		done += int64(k)
	}
	for b := int64(0); (b+1)*preserveBlock <= done || (done == ci.st.size && b*preserveBlock < done); b++ {
		ci.markSaved(b)
	}
	return nil
}

// openSidecar makes ci's sidecar file if it has none yet. ci.mu is held.
func (v *View) openSidecar(ci *capInode) error {
	if ci.sidecar >= 0 {
		return nil
	}
	sc, err := unix.Openat(v.dirfd, "data-"+strconv.FormatUint(ci.uino, 10), unix.O_CREAT|unix.O_RDWR|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return fmt.Errorf("sidecar: %w", err)
	}
	ci.sidecar = sc
	return nil
}

// keepDir keeps the listing of upper directory dir (status st, open at fd)
// before its entries change, unless it is kept already.
func (v *View) keepDir(st *ustat, fd int) error {
	v.capMu.RLock()
	born := v.born[st.ino]
	v.capMu.RUnlock()
	if born {
		return nil
	}
	_, err := v.keptListing(st.ino, func() (*vdir, []ustat, error) {
		return v.listDir(fd, "upper directory "+strconv.FormatUint(st.ino, 10))
	})
	return err
}

// pin keeps captured file ci, named name in dfd, reachable before that
// name goes away. If it cannot, the name must not go: the view would lose
// a file it promised.
func (v *View) pin(dfd int, name string, ci *capInode) error {
	v.mu.Lock()
	defer v.mu.Unlock()
	if ci.pinned != "" || ci.pinFd >= 0 {
		return nil
	}
	// A descriptor costs no link count; beyond a budget, hard links do
	// the same without using up descriptors.
	if v.pinFds < maxPinFds {
		fd, err := unix.Openat(dfd, name, unix.O_RDONLY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
		if err == nil {
			ci.pinFd = fd
			v.pinFds++
			return nil
		}
	}
	pn := "pin-" + strconv.FormatUint(ci.uino, 10)
	err := unix.Linkat(dfd, name, v.dirfd, pn, 0)
	if err == nil {
		ci.pinned = pn
		return nil
	}
	v.ov.log.Error("freeze: cannot keep a captured file for an open snapshot; refusing to remove it", "name", name, "err", err)
	return fmt.Errorf("keep %s for an open snapshot: %w", name, err)
}

const maxPinFds = 1024

// renameRec is one rename made while the view was open.
type renameRec struct {
	from, to string
	exchange bool
}

func (v *View) renamed(from, to string, exchange bool) {
	v.mu.Lock()
	v.renames = append(v.renames, renameRec{from, to, exchange})
	v.mu.Unlock()
}

// translate follows a captured path through the renames made since.
func translate(p string, renames []renameRec) string {
	moved := func(p, from, to string) (string, bool) {
		if p == from {
			return to, true
		}
		if strings.HasPrefix(p, from) && p[len(from)] == '/' {
			return to + p[len(from):], true
		}
		return p, false
	}
	for _, r := range renames {
		if q, ok := moved(p, r.from, r.to); ok {
			p = q
		} else if r.exchange {
			p, _ = moved(p, r.to, r.from)
		}
	}
	return p
}

// viewSet holds the open views of a mount. The write path asks active()
// on every write, so the list is read without a lock. The list changes
// only under the closed gate, so it is stable for a mutation's duration.
type viewSet struct {
	mu   sync.Mutex
	list atomic.Pointer[[]*View]
	// renameMu orders the renames the views log as the file system
	// orders them: the kernel runs renames in unrelated directories
	// concurrently, and a rename of a directory and a rename inside it
	// must be translated in the order they happened.
	renameMu sync.Mutex
}

// lockRenames serialises a rename with its logging while views are open
// (a mutation holds the gate, so that cannot change meanwhile). It returns
// the unlock.
func (s *viewSet) lockRenames() func() {
	if !s.active() {
		return func() {}
	}
	s.renameMu.Lock()
	return s.renameMu.Unlock
}

func (s *viewSet) snapshot() []*View {
	if p := s.list.Load(); p != nil {
		return *p
	}
	return nil
}

func (s *viewSet) active() bool { return len(s.snapshot()) > 0 }

func (s *viewSet) add(v *View) {
	s.mu.Lock()
	defer s.mu.Unlock()
	l := append([]*View(nil), s.snapshot()...)
	l = append(l, v)
	s.list.Store(&l)
}

func (s *viewSet) remove(v *View) {
	s.mu.Lock()
	defer s.mu.Unlock()
	var l []*View
	for _, x := range s.snapshot() {
		if x != v {
			l = append(l, x)
		}
	}
	s.list.Store(&l)
}

func (s *viewSet) renamed(from, to string, exchange bool) {
	for _, v := range s.snapshot() {
		v.renamed(from, to, exchange)
	}
}

// The functions below are called under the gate, before a mutation
// changes the upper layer, so that open views keep what the change would
// lose (see Freeze). They cost nothing while no view is open.

// keepStat keeps st, the status of an upper inode taken under the gate
// before it changes.
func (ov *overlay) keepStat(st *ustat) {
	for _, v := range ov.views.snapshot() {
		if ci := v.frozenNode(st.ino, st.mode&syscall.S_IFMT); ci != nil {
			ci.keep(st)
		}
	}
}

// keepFd keeps the status of upper file uino, open at fd, before it
// changes.
func (ov *overlay) keepFd(uino uint64, fd int) error {
	for _, v := range ov.views.snapshot() {
		if ci := v.frozenNode(uino, syscall.S_IFREG); ci != nil {
			if err := ci.keepWith(func() (ustat, error) { return statFd(fd) }); err != nil {
				return err
			}
		}
	}
	return nil
}

// keepEntry keeps the status of entry name of directory dfd ("" for dfd
// itself), if it exists, before its attributes change.
func (ov *overlay) keepEntry(dfd int, name string) error {
	if !ov.views.active() {
		return nil
	}
	st, err := statxAt(dfd, name)
	if err == unix.ENOENT {
		return nil
	}
	if err != nil {
		return err
	}
	ov.keepStat(&st)
	return nil
}

// keepDir keeps the listing and the status of the upper directory open at
// dfd (any mode) before its entries change: a create, link, unlink,
// rename, whiteout or marker in it.
func (ov *overlay) keepDir(dfd int) error {
	if !ov.views.active() {
		return nil
	}
	st, err := statFd(dfd)
	if err != nil {
		return err
	}
	ov.keepStat(&st)
	for _, v := range ov.views.snapshot() {
		if err := v.keepDir(&st, dfd); err != nil {
			return err
		}
	}
	return nil
}

// keepDirAt is keepDir for the subdirectory name of dfd: one about to get
// a marker (it moves) or to go (rmdir, renamed over).
func (ov *overlay) keepDirAt(dfd int, name string) error {
	if !ov.views.active() {
		return nil
	}
	fd, err := unix.Openat(dfd, name, unix.O_PATH|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	return ov.keepDir(fd)
}

// bornAt is born for entry name of dfd ("" for dfd itself).
func (ov *overlay) bornAt(dfd int, name string) {
	if !ov.views.active() {
		return
	}
	if st, err := statxAt(dfd, name); err == nil {
		ov.born(st.ino)
	}
}

// born notes, under the gate that covered its creation, that the overlay
// has just created the upper inode uino: open views, frozen before it
// existed, need nothing of it. (Noted later, a view frozen in between
// would wrongly ignore it; not noted at all, it only costs keeping.)
func (ov *overlay) born(uino uint64) {
	for _, v := range ov.views.snapshot() {
		v.capMu.Lock()
		if v.inodes[uino] == nil {
			v.born[uino] = true
		}
		v.capMu.Unlock()
	}
}

// preserve saves, for every open view, the frozen bytes of file uino (open
// at fd) in [off, end) before they change.
func (s *viewSet) preserve(uino uint64, fd int, off, end int64) error {
	for _, v := range s.snapshot() {
		if err := v.preserve(uino, fd, off, end); err != nil {
			return err
		}
	}
	return nil
}

// beforeDestroy is called before the upper entry name in dfd, whose status
// st is, loses that name (unlink, rename over it, a guarded commit): views
// keep its status and, for a regular file, pin it. The directory holding
// it must have been kept (keepDir) first. An error means the name must
// stay.
func (s *viewSet) beforeDestroy(dfd int, name string, st *ustat) error {
	for _, v := range s.snapshot() {
		ci := v.frozenNode(st.ino, st.mode&syscall.S_IFMT)
		if ci == nil {
			continue
		}
		ci.keep(st)
		if ci.kind == syscall.S_IFREG {
			if err := v.pin(dfd, name, ci); err != nil {
				return err
			}
		}
	}
	return nil
}
