package fs

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strconv"
	"sync"
	"time"

	"github.com/hanwen/go-fuse/v2/fuse"
	"golang.org/x/sys/unix"
)

// Writable passthrough.
//
// A daemon-served write(2) is a FUSE round trip: on a small VM 40-60 µs
// against 5 µs for a write to the local disk, so SQLite commits and random
// writes run 2-10x slower than native however little the daemon does. Where
// the kernel allows passthrough, writable opens of upper files of at most
// Options.PassthroughWriteMax bytes are therefore given passthrough too: the
// kernel then writes the upper file itself, and the daemon never sees those
// writes. Two things depend on seeing them, and get them another way:
//
//   - Freeze. A view is copy-on-write: before a daemon-served write changes
//     a frozen block, the block is saved. Passthrough writes cannot be held
//     or intercepted, so Freeze instead stops them for an instant and
//     copies those files whole into the view (their size is bounded by
//     PassthroughWriteMax at open). The stop is a barrier in the kernel:
//     the kernel takes the FUSE inode's lock for every passthrough write,
//     and for a chmod until the daemon answers its SETATTR. Freeze opens
//     each such file through the mount (by its path from the mountpoint,
//     or, with the mountpoint unreachable, through /proc from a process
//     that has it open) and changes its mode to the mode it has; the
//     overlay holds that SETATTR until the file is copied, so no write of
//     it is in progress or can start, then answers it without changing
//     anything. The two kernel behaviours this rests on are tried once
//     per process before the first grant (ptcheck.go); where they do not
//     hold, writable opens stay daemon-served. No new writable
//     passthrough is granted while a
//     view is open or a freeze is under way: those opens are served by the
//     daemon as before (passthrough with direct I/O when the inode already
//     has passthrough handles).
//   - Generation. Changes are counted when the daemon makes them; for files
//     written through passthrough the overlay compares the upper file's
//     size, mtime and ctime with what it noted before, whenever the
//     generation is asked for, at each freeze and when the last handle
//     closes. A note taken within ptRecent of the file's ctime does not
//     prove that a later write in the same clock tick changed it, so the
//     next note counts the file as changed whatever it finds.
//
// Shared writable mmap of such a file writes the upper file directly, as it
// does for any passthrough handle (the -shm of SQLite, which it rebuilds
// from the WAL).

// ptRecent is how close to a file's ctime a note must not be taken to be
// trusted: more than the coarse clock's tick that stamps file times.
const ptRecent = 50 * time.Millisecond

// ptBarrierWait bounds how long Freeze waits for the kernel to stop the
// writes of one file (a write in progress must finish first).
const ptBarrierWait = 30 * time.Second

// ptWriters tracks the nodes with writable passthrough handles.
type ptWriters struct {
	mu sync.Mutex
	// freezing counts freezes under way: no writable passthrough is
	// granted while one is.
	freezing int
	nodes    map[*node]*ptwRec
}

// ptwRec is one node's writable passthrough handles and the status of its
// upper file when its changes were last noted.
type ptwRec struct {
	handles []*upperFile
	size    int64
	mtime   unix.Timespec
	ctime   unix.Timespec
	recent  bool // noted within ptRecent of ctime: trust no equality next time
}

// grantWrite reports whether writable handle h of n, whose upper file has
// status st, may use passthrough, and if so records it. n.mu is held; the
// caller has checked the kernel's constraints (no cached opens of n; a
// backing file, if n has one, open for writing).
func (ov *overlay) grantWrite(n *node, h *upperFile, st *ustat) bool {
	if !ov.passthrough.Load() || !ov.ptWriteOK.Load() || ov.opts.PassthroughWriteMax <= 0 || st.size > ov.opts.PassthroughWriteMax {
		return false
	}
	p := &ov.ptw
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.freezing > 0 || ov.views.active() {
		return false
	}
	if p.nodes == nil {
		p.nodes = map[*node]*ptwRec{}
	}
	r := p.nodes[n]
	if r == nil {
		r = &ptwRec{}
		r.set(st, time.Now())
		p.nodes[n] = r
	}
	r.handles = append(r.handles, h)
	h.ptWrite = true
	return true
}

func (r *ptwRec) set(st *ustat, now time.Time) {
	r.size, r.mtime, r.ctime = st.size, st.mtime, st.ctime
	r.recent = now.Sub(time.Unix(st.ctime.Unix())) < ptRecent
}

// noteLocked counts n as changed if its upper file (status st) may have
// been written since the last note. p.mu is held.
func (ov *overlay) noteLocked(n *node, r *ptwRec, st *ustat, now time.Time) {
	if r.recent || st.size != r.size || st.mtime != r.mtime || st.ctime != r.ctime {
		ov.changed(n.ino, max(0, st.size-r.size))
	}
	r.set(st, now)
}

// notePTWrites counts the files written through passthrough since the last
// note as changed.
func (ov *overlay) notePTWrites() {
	p := &ov.ptw
	p.mu.Lock()
	defer p.mu.Unlock()
	now := time.Now()
	for n, r := range p.nodes {
		st, err := statFd(r.handles[0].fd)
		if err != nil {
			ov.changed(n.ino, 0)
			continue
		}
		ov.noteLocked(n, r, &st, now)
	}
}

// dropWrite forgets writable passthrough handle h (released, or refused
// by the kernel), noting its changes if it was n's last.
func (ov *overlay) dropWrite(h *upperFile) {
	p := &ov.ptw
	p.mu.Lock()
	defer p.mu.Unlock()
	r := p.nodes[h.n]
	if r == nil {
		return
	}
	for i, o := range r.handles {
		if o == h {
			r.handles = append(r.handles[:i], r.handles[i+1:]...)
			break
		}
	}
	if len(r.handles) > 0 {
		return
	}
	if st, err := statFd(h.fd); err == nil {
		ov.noteLocked(h.n, r, &st, time.Now())
	} else {
		ov.changed(h.n.ino, 0)
	}
	delete(p.nodes, h.n)
}

// barrier stops the passthrough writes of one node for a freeze: the
// overlay holds a SETATTR of it that changes nothing (holdBarrier).
type barrier struct {
	n       *node
	mode    uint32
	fd      int // the node opened through the mount; -1 once closed
	upperFd int // a duplicate of a handle's upper descriptor, for the copy
	uino    uint64
	arrived chan struct{}
	release chan struct{}
	once    sync.Once
	started bool       // the chmod was issued
	done    chan error // its result
}

// holdBarrier is called first by Setattr: a SETATTR that only sets n's
// mode to the mode a pending barrier of n set out to set is the barrier
// itself (or a chmod to the same mode, which changes nothing either): it
// is held until the freeze releases it and answered without a change.
func (ov *overlay) holdBarrier(n *node, in *fuse.SetAttrIn) bool {
	v, ok := ov.barriers.Load(n)
	if !ok || in.Valid&^fuse.FATTR_CTIME != fuse.FATTR_MODE {
		return false
	}
	b := v.(*barrier)
	if mode, ok := in.GetMode(); !ok || mode&07777 != b.mode {
		return false
	}
	held := false
	b.once.Do(func() { held = true })
	if !held {
		return false
	}
	close(b.arrived)
	<-b.release
	return true
}

// stopPTWrites stops the writes of every file with writable passthrough
// handles (all of them at the time of the call: no new ones are granted
// until resumePTWrites, which the caller must call however this returns)
// and returns the barriers to release. A file that is in no directory any
// more is in no view and is skipped.
func (m *Mounted) stopPTWrites(ctx context.Context) ([]*barrier, error) {
	ov := m.ov
	p := &ov.ptw
	type target struct {
		n    *node
		fd   int
		pids []uint32
	}
	var ts []target
	p.mu.Lock()
	p.freezing++
	for n, r := range p.nodes {
		// A duplicate: the handle may be released meanwhile.
		fd, err := unix.FcntlInt(uintptr(r.handles[0].fd), unix.F_DUPFD_CLOEXEC, 0)
		if err != nil {
			p.mu.Unlock()
			for _, t := range ts {
				unix.Close(t.fd)
			}
			return nil, fmt.Errorf("stop passthrough writes: %w", err)
		}
		t := target{n: n, fd: fd}
		for _, h := range r.handles {
			t.pids = append(t.pids, h.pid)
		}
		ts = append(ts, t)
	}
	p.mu.Unlock()
	if len(ts) == 0 {
		return nil, nil
	}
	var bs []*barrier
	fail := func(err error) ([]*barrier, error) {
		releaseBarriers(ov, bs)
		return nil, fmt.Errorf("stop passthrough writes: %w", err)
	}
	// Open every file first, before any is stopped: a lookup needs its
	// parents, which a rename blocked behind a barrier would hold.
	root, rootErr := m.openRoot()
	if root >= 0 {
		defer unix.Close(root)
	}
	for i, t := range ts {
		b, err := m.openBarrier(root, rootErr, t.n, t.fd, t.pids)
		if b == nil {
			unix.Close(t.fd)
		} else {
			bs = append(bs, b)
		}
		if err != nil {
			for _, t := range ts[i+1:] {
				unix.Close(t.fd)
			}
			return fail(err)
		}
	}
	for _, b := range bs {
		if b.fd < 0 {
			continue
		}
		ov.barriers.Store(b.n, b)
		b.started = true
		go func(b *barrier) { b.done <- unix.Fchmod(b.fd, b.mode) }(b)
	}
	timer := time.NewTimer(ptBarrierWait)
	defer timer.Stop()
	for _, b := range bs {
		if b.fd < 0 {
			continue
		}
		select {
		case <-b.arrived:
		case err := <-b.done:
			// Answered without being held: the chmod failed.
			b.done <- err
			if err == nil {
				err = errors.New("not held")
			}
			return fail(fmt.Errorf("upper inode %d: %w", b.uino, err))
		case <-timer.C:
			return fail(fmt.Errorf("upper inode %d: writes did not stop within %v", b.uino, ptBarrierWait))
		case <-ctx.Done():
			return fail(ctx.Err())
		}
	}
	return bs, nil
}

// openRoot opens the mount's root through its mountpoint, checking that
// the path still leads to this mount. It is opened for each freeze and
// closed after: a descriptor kept would keep a mount detached from outside
// alive.
func (m *Mounted) openRoot() (int, error) {
	fd, err := unix.Open(m.mountpoint, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return -1, err
	}
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil || st.Dev != m.dev || st.Ino != m.ov.root.ino {
		unix.Close(fd)
		return -1, fmt.Errorf("%s does not lead to this mount (unmounted, or another mount over it)", m.mountpoint)
	}
	return fd, nil
}

// openBarrier opens node n through the mount and makes its barrier, taking
// over upperFd; nil if n is in no directory any more, or its writers all
// closed it. The path from the mount's root (root, if open) comes first,
// looked up again if a rename moved it meanwhile; failing that, a
// descriptor of one of the processes that opened it for writing (pids),
// which works with the mountpoint unreachable too. A file found neither
// way while still open for writing gets a barrier that stops nothing
// (fd -1): it is copied while it may be written, and the log says so.
func (m *Mounted) openBarrier(root int, rootErr error, n *node, upperFd int, pids []uint32) (*barrier, error) {
	ust, err := statFd(upperFd)
	if err != nil {
		return nil, err
	}
	if ust.nlink == 0 {
		return nil, nil // unlinked: in no view
	}
	b := &barrier{
		n: n, mode: ust.mode & 07777, fd: -1, upperFd: upperFd, uino: ust.ino,
		arrived: make(chan struct{}), release: make(chan struct{}), done: make(chan error, 1),
	}
	same := func(fd int) bool {
		var st unix.Stat_t
		return unix.Fstat(fd, &st) == nil && st.Dev == m.dev && st.Ino == n.ino
	}
	var rel string
	for try := 0; root >= 0 && try < 10; try++ {
		var ok bool
		if rel, ok = n.rel(); !ok || rel == "" {
			break
		}
		fd, err := unix.Openat(root, rel, unix.O_RDONLY|unix.O_NOFOLLOW|unix.O_NONBLOCK|unix.O_CLOEXEC, 0)
		if err == nil && same(fd) {
			b.fd = fd
			return b, nil
		}
		if err == nil {
			unix.Close(fd) // another file has the name now
		}
		time.Sleep(time.Duration(try) * time.Millisecond)
	}
	for _, pid := range pids {
		if fd := m.openFromProcess(pid, n.ino); fd >= 0 {
			b.fd = fd
			return b, nil
		}
	}
	if !m.ov.ptw.open(n) {
		return nil, nil // released meanwhile: nothing writes it any more
	}
	why := "not found under the mount nor among its writers' open files"
	if rootErr != nil {
		why = rootErr.Error()
	}
	m.ov.log.Warn("freeze: cannot stop the writes of a file written through passthrough; copying it as it is being written", "path", rel, "upper_ino", ust.ino, "why", why)
	return b, nil
}

// openFromProcess opens the file of this mount with inode number ino that
// process (or thread) pid has open, through /proc; -1 if it has none.
func (m *Mounted) openFromProcess(pid uint32, ino uint64) int {
	dir := "/proc/" + strconv.FormatUint(uint64(pid), 10) + "/fd"
	ents, err := os.ReadDir(dir)
	if err != nil {
		return -1
	}
	for _, e := range ents {
		p := dir + "/" + e.Name()
		var st unix.Stat_t
		if unix.Stat(p, &st) != nil || st.Dev != m.dev || st.Ino != ino {
			continue
		}
		fd, err := unix.Open(p, unix.O_RDONLY|unix.O_NONBLOCK|unix.O_CLOEXEC, 0)
		if err != nil {
			continue
		}
		if unix.Fstat(fd, &st) == nil && st.Dev == m.dev && st.Ino == ino {
			return fd
		}
		unix.Close(fd)
	}
	return -1
}

// releaseBarriers lets the writes stopped by bs go on. What each opened is
// closed once its chmod returns, which for a chmod still waiting in the
// kernel (a barrier that never arrived) is when the write ahead of it ends.
func releaseBarriers(ov *overlay, bs []*barrier) {
	for _, b := range bs {
		close(b.release)
		if !b.started {
			if b.fd >= 0 {
				unix.Close(b.fd)
			}
			unix.Close(b.upperFd)
			continue
		}
		go func(b *barrier) {
			if err := <-b.done; err != nil {
				ov.log.Warn("freeze: passthrough barrier", "ino", b.n.ino, "err", err)
			}
			ov.barriers.CompareAndDelete(b.n, b)
			unix.Close(b.fd)
			unix.Close(b.upperFd)
		}(b)
	}
}

// open reports whether n still has writable passthrough handles.
func (p *ptWriters) open(n *node) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	r := p.nodes[n]
	return r != nil && len(r.handles) > 0
}

// resumePTWrites ends a freeze's hold on new writable passthrough grants.
func (ov *overlay) resumePTWrites() {
	ov.ptw.mu.Lock()
	ov.ptw.freezing--
	ov.ptw.mu.Unlock()
}
