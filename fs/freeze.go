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
// It closes the gate (new mutations wait, those in flight finish), walks the
// upper layer's metadata (entries, modes, owners, times, sizes, symlink
// targets, whiteouts, opaque and redirect markers), and reopens the gate.
// Mutations are blocked only for that walk: O(entries in the upper layer),
// independent of how much data changed. No file content is copied.
//
// From then on, until View.Close, the overlay keeps the frozen content of
// every captured upper file reachable: the first write, truncate or
// fallocate into a captured file's frozen bytes first saves the blocks it
// changes into a sidecar, and a captured file about to lose its name
// (unlink, rename over it) is pinned first. The lower layer is immutable and
// needs nothing.
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
	ov.log.Info("frozen", "generation", v.gen, "stall", v.stall, "upper_files", len(v.files))
	return v, nil
}

var viewSeq atomic.Uint64

// capture walks the upper layer into a new View. The gate is closed.
func (ov *overlay) capture() (*View, error) {
	v := &View{
		ov:    ov,
		gen:   ov.gen.Load(),
		lower: ov.lower,
		inos:  ov.inos.snapshot(),
		files: map[uint64]*capFile{},
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
	rootSt, err := statFd(ov.u.root)
	if err == nil {
		var rfd int
		if rfd, err = ov.u.dirRead(""); err == nil {
			v.root = &ventry{name: ".", st: rootSt}
			v.root.dir, err = v.walk(rfd, "", true)
			unix.Close(rfd)
		}
	}
	if err != nil {
		v.release()
		return v, err
	}
	return v, nil
}

// walk captures the upper directory open at fd (path rel). The stall of a
// freeze is this walk: one getdents per directory and one statx per entry.
func (v *View) walk(fd int, rel string, root bool) (*vdir, error) {
	ents, err := readDirents(fd)
	if err != nil {
		return nil, fmt.Errorf("list %q: %w", rel, err)
	}
	d := &vdir{entries: make(map[string]*ventry, len(ents))}
	names := make([]string, 0, len(ents))
	for _, de := range ents {
		name := de.name
		if !isReserved(name) {
			names = append(names, name)
			continue
		}
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
	}
	es := make([]ventry, len(names))
	errs := make([]error, len(names))
	for i, name := range names {
		es[i].name = name
		es[i].st, errs[i] = statxAt(fd, name)
	}
	for i := range es {
		e := &es[i]
		if errs[i] == unix.ENOENT {
			continue
		}
		p := joinRel(rel, e.name)
		if errs[i] != nil {
			return nil, fmt.Errorf("stat %q: %w", p, errs[i])
		}
		switch e.st.mode & syscall.S_IFMT {
		case syscall.S_IFDIR:
			sub, err := unix.Openat(fd, e.name, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
			if err != nil {
				return nil, fmt.Errorf("open %q: %w", p, err)
			}
			e.dir, err = v.walk(sub, p, false)
			unix.Close(sub)
			if err != nil {
				return nil, err
			}
		case syscall.S_IFLNK:
			buf := make([]byte, 4096)
			k, err := unix.Readlinkat(fd, e.name, buf)
			if err != nil {
				return nil, fmt.Errorf("readlink %q: %w", p, err)
			}
			e.target = string(buf[:k])
		case syscall.S_IFREG:
			cf := v.files[e.st.ino]
			if cf == nil {
				cf = &capFile{uino: e.st.ino, size: e.st.size, pinFd: -1, sidecar: -1}
				v.files[e.st.ino] = cf
			}
			cf.paths = append(cf.paths, p)
			e.file = cf
		}
		d.entries[e.name] = e
	}
	return d, nil
}

// preserveBlock is the granularity at which frozen bytes are saved: the
// first write into a captured block copies the whole block to the sidecar.
const preserveBlock = 16 << 10

// capFile is one captured upper regular file (all its names).
type capFile struct {
	uino  uint64
	size  int64    // size at the freeze
	paths []string // its upper paths at the freeze

	mu       sync.Mutex
	saved    []uint64 // bitmap of preserveBlock blocks saved in the sidecar
	sidecar  int      // sparse file holding saved blocks at their own offsets; -1 until needed
	pinned   string   // name of a hard link kept in the view directory, once its names went away
	pinFd    int      // or a descriptor kept open for the same purpose; -1 if none
	nsavedBl int
}

func (cf *capFile) isSaved(b int64) bool {
	i := b / 64
	return int(i) < len(cf.saved) && cf.saved[i]&(1<<(b%64)) != 0
}

func (cf *capFile) markSaved(b int64) {
	i := int(b / 64)
	for len(cf.saved) <= i {
		cf.saved = append(cf.saved, 0)
	}
	cf.saved[i] |= 1 << (b % 64)
	cf.nsavedBl++
}

// preserve saves the frozen bytes of [off, end) of the file that are not
// saved yet, reading them from fd (the file, about to be changed).
func (v *View) preserve(uino uint64, fd int, off, end int64) error {
	cf := v.files[uino]
	if cf == nil {
		return nil
	}
	end = min(end, cf.size)
	if off >= end || off < 0 {
		return nil
	}
	cf.mu.Lock()
	defer cf.mu.Unlock()
	var buf []byte
	rfd := -1
	defer func() {
		if rfd >= 0 && rfd != fd {
			unix.Close(rfd)
		}
	}()
	for b := off / preserveBlock; b*preserveBlock < end; b++ {
		if cf.isSaved(b) {
			continue
		}
		if cf.sidecar < 0 {
			sc, err := unix.Openat(v.dirfd, "data-"+strconv.FormatUint(uino, 10), unix.O_CREAT|unix.O_RDWR|unix.O_CLOEXEC, 0o600)
			if err != nil {
				return fmt.Errorf("sidecar: %w", err)
			}
			cf.sidecar = sc
		}
		if buf == nil {
			buf = make([]byte, preserveBlock)
		}
		boff := b * preserveBlock
		want := min(int64(preserveBlock), cf.size-boff)
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
		if err := pwriteAll(cf.sidecar, buf[:want], boff); err != nil {
			return fmt.Errorf("sidecar: %w", err)
		}
		cf.markSaved(b)
	}
	return nil
}

// pin keeps captured file uino, named name in dfd, reachable before that
// name goes away.
func (v *View) pin(dfd int, name string, uino uint64) {
	cf := v.files[uino]
	if cf == nil {
		return
	}
	v.mu.Lock()
	defer v.mu.Unlock()
	if cf.pinned != "" || cf.pinFd >= 0 {
		return
	}
	// A descriptor costs no link count; beyond a budget, hard links do
	// the same without using up descriptors.
	if v.pinFds < maxPinFds {
		fd, err := unix.Openat(dfd, name, unix.O_RDONLY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
		if err == nil {
			cf.pinFd = fd
			v.pinFds++
			return
		}
	}
	pn := "pin-" + strconv.FormatUint(uino, 10)
	if err := unix.Linkat(dfd, name, v.dirfd, pn, 0); err == nil {
		cf.pinned = pn
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

func (s *viewSet) beforeDestroy(dfd int, name string, uino uint64) {
	for _, v := range s.snapshot() {
		v.pin(dfd, name, uino)
	}
}

func (s *viewSet) renamed(from, to string, exchange bool) {
	for _, v := range s.snapshot() {
		v.renamed(from, to, exchange)
	}
}
