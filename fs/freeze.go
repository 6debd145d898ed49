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
// It closes the gate (new mutations wait, those in flight finish), records
// the upper layer's names (one getdents per directory: entries with their
// inode numbers and types, symlink targets, whiteouts, opaque and redirect
// markers), and reopens the gate. Mutations are blocked only for that
// listing: no content is copied, no entry is stat'ed, no descriptor is kept.
//
// From then on, until View.Close, the overlay keeps what the view needs of
// every captured upper inode: before the first change to an inode's
// attributes (a write, truncate, chmod, a new entry in a directory, a link
// or unlink) its status as it still is is kept for the view; the first
// write, truncate or fallocate into a captured file's frozen bytes first
// saves the blocks it changes into a sidecar; and a captured file about to
// lose its name (unlink, rename over it) is pinned first. Attributes of
// inodes nothing changed are read when the view asks for them. The lower
// layer is immutable and needs nothing.
//
// Freeze honours ctx while it waits for mutations in flight.
func (m *Mounted) Freeze(ctx context.Context) (*View, error) {
	ov := m.ov
	if err := ov.gate.freeze(ctx); err != nil {
		return nil, fmt.Errorf("fs: freeze: %w", err)
	}
	start := time.Now()
	v, err := ov.capture()
	if err == nil {
		ov.views.add(v)
		ov.dirty.newEpoch(v.gen)
	}
	v.stall = time.Since(start)
	ov.gate.thaw()
	if err != nil {
		return nil, fmt.Errorf("fs: freeze: %w", err)
	}
	ov.log.Info("frozen", "generation", v.gen, "stall", v.stall, "upper_inodes", len(v.inodes))
	return v, nil
}

var viewSeq atomic.Uint64

// capture lists the upper layer into a new View. The gate is closed.
func (ov *overlay) capture() (*View, error) {
	v := &View{
		ov:     ov,
		gen:    ov.gen.Load(),
		lower:  ov.lower,
		inos:   ov.inos.snapshot(),
		inodes: map[uint64]*capInode{},
	}
	v.dirfd = -1
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
	if n := ov.lastInodes.Load(); n > 0 {
		v.inodes = make(map[uint64]*capInode, n+n/8)
	}
	rootSt, err := statFd(ov.u.root)
	if err == nil {
		var rfd int
		if rfd, err = ov.u.dirRead(""); err == nil {
			root := &capInode{uino: rootSt.ino, kind: syscall.S_IFDIR, pinFd: -1, sidecar: -1}
			root.keep(&rootSt)
			v.inodes[root.uino] = root
			v.root = &ventry{name: ".", kind: syscall.S_IFDIR, node: root}
			v.root.dir, err = v.walk(rfd, "")
			unix.Close(rfd)
		}
	}
	if err != nil {
		v.release()
		return v, err
	}
	ov.lastInodes.Store(int64(len(v.inodes)))
	return v, nil
}

// walk lists the upper directory open at fd (path rel). The stall of a
// freeze is this walk: one getdents per directory, one open per
// subdirectory, one readlink per symlink, and the overlay's markers.
// Entries are known by the inode number and type getdents gives; their
// status is taken later (capInode). Where getdents cannot be trusted for
// that (an unknown type, or inode numbers that differ from stat's, as on
// some stacked file systems), entries are stat'ed here instead. It
// allocates per directory, not per entry, where it can: the stall is
// short only if the garbage collector has little to do.
func (v *View) walk(fd int, rel string) (*vdir, error) {
	ents, err := readDirents(fd)
	if err != nil {
		return nil, fmt.Errorf("list %q: %w", rel, err)
	}
	if rel == "" && len(ents) > 0 {
		// One comparison tells whether getdents' inode numbers are
		// stat's on this file system.
		st, err := statxAt(fd, ents[0].name)
		if err != nil {
			return nil, fmt.Errorf("stat %q: %w", ents[0].name, err)
		}
		v.statAll = st.ino != ents[0].ino
	}
	n := 0
	for i := range ents {
		if !isReserved(ents[i].name) {
			n++
		}
	}
	d := &vdir{path: rel, ents: make([]ventry, 0, n)}
	inodes := make([]capInode, n) // a slab: hard links leave some unused
	for _, de := range ents {
		name := de.name
		if isReserved(name) {
			switch {
			case name == opaqueMarker:
				d.opaque = true
			case name == redirectMarker:
				s, err := readSmall(fd, name)
				if err != nil {
					return nil, err
				}
				d.redirect, d.hasRedirect = s, true
			default:
				if s, ok := whiteoutTarget(fd, name); ok {
					if d.hidden == nil {
						d.hidden = map[string]bool{}
					}
					d.hidden[s] = true
				}
			}
			continue
		}
		var st *ustat
		ino, kind := de.ino, dtToMode(de.typ)
		if v.statAll || de.typ == unix.DT_UNKNOWN {
			s, err := statxAt(fd, name)
			if err != nil {
				return nil, fmt.Errorf("stat %q: %w", joinRel(rel, name), err)
			}
			st, ino, kind = &s, s.ino, s.mode&syscall.S_IFMT
		}
		d.ents = append(d.ents, ventry{name: name, kind: kind, parent: d})
		e := &d.ents[len(d.ents)-1]
		ci := v.inodes[ino]
		if ci == nil {
			ci = &inodes[0]
			inodes = inodes[1:]
			ci.uino, ci.kind, ci.pinFd, ci.sidecar, ci.name0 = ino, kind, -1, -1, e
			v.inodes[ino] = ci
		} else {
			ci.more = append(ci.more, e)
		}
		e.node = ci
		if st != nil {
			ci.keep(st)
		}
		switch kind {
		case syscall.S_IFDIR:
			sub, err := unix.Openat(fd, name, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
			if err != nil {
				return nil, fmt.Errorf("open %q: %w", joinRel(rel, name), err)
			}
			e.dir, err = v.walk(sub, joinRel(rel, name))
			unix.Close(sub)
			if err != nil {
				return nil, err
			}
		case syscall.S_IFLNK:
			// Symlinks never change; one that goes away is not pinned, so
			// its target is read now.
			buf := make([]byte, 4096)
			k, err := unix.Readlinkat(fd, name, buf)
			if err != nil {
				return nil, fmt.Errorf("readlink %q: %w", joinRel(rel, name), err)
			}
			e.target = string(buf[:k])
		}
	}
	return d, nil
}

// preserveBlock is the granularity at which frozen bytes are saved: the
// first write into a captured block copies the whole block to the sidecar.
const preserveBlock = 16 << 10

// capInode is one captured upper inode (all its names). Its status at the
// freeze is kept by the first change to it after the freeze, or read by the
// view when it first needs it if nothing changed it before; a regular
// file's frozen bytes are kept by the first change to each block.
type capInode struct {
	uino uint64
	kind uint32 // S_IFMT bits
	// name0 and more are its names at the freeze (none for the root).
	name0 *ventry
	more  []*ventry

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

// paths returns ci's upper paths at the freeze.
func (ci *capInode) paths() []string {
	if ci.name0 == nil {
		return []string{""}
	}
	out := make([]string, 0, 1+len(ci.more))
	out = append(out, ci.name0.path())
	for _, e := range ci.more {
		out = append(out, e.path())
	}
	return out
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

// preserve keeps the status of captured file uino and saves the frozen
// bytes of [off, end) that are not saved yet, reading them from fd (the
// file, about to be changed).
func (v *View) preserve(uino uint64, fd int, off, end int64) error {
	ci := v.inodes[uino]
	if ci == nil {
		return nil
	}
	if err := ci.keepWith(func() (ustat, error) { return statFd(fd) }); err != nil {
		return err
	}
	if ci.kind != syscall.S_IFREG {
		return nil
	}
	end = min(end, ci.st.size)
	if off >= end || off < 0 {
		return nil
	}
	ci.mu.Lock()
	defer ci.mu.Unlock()
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
		if ci.sidecar < 0 {
			sc, err := unix.Openat(v.dirfd, "data-"+strconv.FormatUint(uino, 10), unix.O_CREAT|unix.O_RDWR|unix.O_CLOEXEC, 0o600)
			if err != nil {
				return fmt.Errorf("sidecar: %w", err)
			}
			ci.sidecar = sc
		}
		if buf == nil {
			buf = make([]byte, preserveBlock)
		}
		boff := b * preserveBlock
		want := min(int64(preserveBlock), ci.st.size-boff)
		if rfd < 0 {
			rfd = fd
		}
		k, err := preadFull(rfd, buf[:want], boff)
		if err == unix.EBADF && rfd == fd {
			// A write-only descriptor: read through a fresh one.
			rfd, err = unix.Open("/proc/self/fd/"+strconv.Itoa(fd), unix.O_RDONLY|unix.O_CLOEXEC, 0)
			if err == nil {
				k, err = preadFull(rfd, buf[:want], boff)
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

// pin keeps captured file ci, named name in dfd, reachable before that
// name goes away.
func (v *View) pin(dfd int, name string, ci *capInode) {
	v.mu.Lock()
	defer v.mu.Unlock()
	if ci.pinned != "" || ci.pinFd >= 0 {
		return
	}
	// A descriptor costs no link count; beyond a budget, hard links do
	// the same without using up descriptors.
	if v.pinFds < maxPinFds {
		fd, err := unix.Openat(dfd, name, unix.O_RDONLY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
		if err == nil {
			ci.pinFd = fd
			v.pinFds++
			return
		}
	}
	pn := "pin-" + strconv.FormatUint(ci.uino, 10)
	if err := unix.Linkat(dfd, name, v.dirfd, pn, 0); err == nil {
		ci.pinned = pn
		return
	}
	v.ov.log.Error("freeze: cannot keep a captured file", "name", name)
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

func (s *viewSet) preserve(uino uint64, fd int, off, n int64) error {
	for _, v := range s.snapshot() {
		if err := v.preserve(uino, fd, off, off+n); err != nil {
			return err
		}
	}
	return nil
}

func (s *viewSet) preserveTruncate(uino uint64, fd int, size int64) error {
	for _, v := range s.snapshot() {
		if err := v.preserve(uino, fd, size, 1<<62); err != nil {
			return err
		}
	}
	return nil
}

// beforeDestroy is called before the upper entry name in dfd, whose status
// st is, loses that name (unlink, rename over it, a guarded commit): views
// keep its status and, for a regular file, pin it.
func (s *viewSet) beforeDestroy(dfd int, name string, st *ustat) {
	for _, v := range s.snapshot() {
		ci := v.inodes[st.ino]
		if ci == nil {
			continue
		}
		ci.keep(st)
		if ci.kind == syscall.S_IFREG {
			v.pin(dfd, name, ci)
		}
	}
}

func (s *viewSet) renamed(from, to string, exchange bool) {
	for _, v := range s.snapshot() {
		v.renamed(from, to, exchange)
	}
}

// The keep functions are called under the gate before a mutation changes
// an upper inode (its content or attributes, or a directory's entries):
// open views that captured the inode and have not kept its status yet take
// it now, as it still is. They cost nothing while no view is open.

// keepStat keeps st, the status of an inode taken under the gate before
// the change.
func (ov *overlay) keepStat(st *ustat) {
	for _, v := range ov.views.snapshot() {
		if ci := v.inodes[st.ino]; ci != nil {
			ci.keep(st)
		}
	}
}

// keepFd keeps the status of the upper inode uino open at fd.
func (ov *overlay) keepFd(uino uint64, fd int) error {
	for _, v := range ov.views.snapshot() {
		if ci := v.inodes[uino]; ci != nil {
			if err := ci.keepWith(func() (ustat, error) { return statFd(fd) }); err != nil {
				return err
			}
		}
	}
	return nil
}

// keepAt keeps the status of entry name in directory dfd ("" for dfd
// itself), if it exists: before its attributes change or, for a directory,
// its entries.
func (ov *overlay) keepAt(dfd int, name string) error {
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
