package fs

import (
	"context"
	"errors"
	"fmt"
	"os"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
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
//     hold, writable opens stay daemon-served. A file enters writable
//     passthrough only while no view is open and no freeze is under way
//     (its writable opens are served by the daemon otherwise), and stays
//     among the files every freeze stops and copies until its last
//     passthrough handle, of any access mode, is closed: every such handle
//     shares the writable backing file, and its mmap writes to it.
//   - Generation. Changes are counted when the daemon makes them; for files
//     written through passthrough the overlay compares the upper file's
//     size, mtime and ctime with what it noted before, whenever the
//     generation is asked for, at each freeze and when the last handle
//     closes. A note taken within ptRecent (the coarse clock's tick that
//     stamps file times) of the file's ctime does not prove that a later
//     write in the same tick changed it, so the next note counts the file
//     as changed whatever it finds. A freeze, whose instant must be exact,
//     holds its barriers past that tick and notes again.
//
// Shared writable mmap of such a file writes the upper file directly, as it
// does for any passthrough handle (the -shm of SQLite, which it rebuilds
// from the WAL). A store into a page already dirty changes no file time,
// so a freeze starts the writeback of each such file after copying it
// (cleanPages): writeback write-protects the mapped pages, and the next
// store faults and stamps the file as changed.

// ptRecent is how close to a file's ctime a note must not be taken to be
// trusted: the coarse clock's tick that stamps file times (jiffies), plus a
// margin for the two clocks' skew; 50 ms if the tick cannot be read.
var ptRecent = func() time.Duration {
	var ts unix.Timespec
	if err := unix.ClockGetres(unix.CLOCK_REALTIME_COARSE, &ts); err != nil || ts.Nano() <= 0 || ts.Nano() > int64(50*time.Millisecond) {
		return 50 * time.Millisecond
	}
	return time.Duration(ts.Nano()) + time.Millisecond
}()

// ptBarrierWait bounds how long Freeze waits for the kernel to stop the
// writes of the files written through passthrough (a write in progress
// must finish first), over all rounds.
const ptBarrierWait = 30 * time.Second

// ptWriters tracks the nodes whose passthrough handles share a writable
// backing file (node.ptWrite): every freeze stops and copies them. A node
// is in it from the writable open that gave it passthrough until its last
// passthrough handle, of any access mode, closes: a read-only handle kept
// open keeps the backing file, and another open's mmap writes to it.
type ptWriters struct {
	mu sync.Mutex
	// freezing counts freezes under way: no node joins while one is;
	// sealed: none ever again (Seal).
	freezing int
	sealed   bool
	nodes    map[*node]*ptwRec
}

// ptwRec is one node's record: a descriptor of its upper file, the
// processes that opened it in passthrough, and the file's status when its
// changes were last noted.
type ptwRec struct {
	fd     int
	pids   []uint32
	size   int64
	mtime  unix.Timespec
	ctime  unix.Timespec
	recent bool // noted within ptRecent of ctime: trust no equality next time
	// revoked: the kernel fails its reads and writes (revokePTWrites).
	revoked bool
}

// grantWrite reports whether writable handle h of n, whose upper file has
// status st, may use passthrough, and records it. n.mu is held and n has
// no cached opens. A node already in passthrough joins only if its backing
// file is writable; a node not yet in it only if no view is open or being
// taken (a view could not see its writes) and the file is small enough.
func (ov *overlay) grantWrite(n *node, h *upperFile, st *ustat) bool {
	if !ov.passthrough.Load() || !ov.ptWriteOK.Load() || ov.opts.PassthroughWriteMax <= 0 {
		return false
	}
	p := &ov.ptw
	if n.ptOpens > 0 {
		if n.ptWrite {
			p.join(n, h.pid)
		}
		return n.ptWrite
	}
	if st.size > ov.opts.PassthroughWriteMax {
		return false
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.freezing > 0 || p.sealed || ov.views.active() {
		return false
	}
	fd, err := unix.FcntlInt(uintptr(h.fd), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		return false
	}
	if p.nodes == nil {
		p.nodes = map[*node]*ptwRec{}
	}
	r := &ptwRec{fd: fd, pids: []uint32{h.pid}}
	r.set(st, time.Now())
	p.nodes[n] = r
	n.ptWrite = true
	return true
}

// join notes that process pid opened n, a node in passthrough with a
// writable backing file.
func (p *ptWriters) join(n *node, pid uint32) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if r := p.nodes[n]; r != nil && !slices.Contains(r.pids, pid) {
		r.pids = append(r.pids, pid)
	}
}

// ptClosed counts one passthrough handle of n gone (released, or never
// opened); with the last, n leaves ptw, its changes noted. n.mu is held.
func (ov *overlay) ptClosed(n *node) {
	n.ptOpens--
	if n.ptOpens > 0 || !n.ptWrite {
		return
	}
	n.ptWrite = false
	p := &ov.ptw
	p.mu.Lock()
	defer p.mu.Unlock()
	r := p.nodes[n]
	if r == nil {
		return
	}
	if st, err := statFd(r.fd); err == nil {
		ov.noteLocked(n, r, &st, time.Now())
	} else {
		ov.changed(n.ino, 0)
	}
	unix.Close(r.fd)
	delete(p.nodes, n)
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

// settlePTWrites is called by a freeze that has noted the files behind
// barriers bs and holds them: it waits until none of them was written
// within ptRecent, so that a write after the barriers are released gets a
// later ctime, and clears their recent marks. Nothing could write them
// since that note, so a file that still looks the same has not changed:
// the next note after the freeze is exact, and a file written just before
// the freeze is not counted as changed after it.
func (ov *overlay) settlePTWrites(bs []*barrier) {
	p := &ov.ptw
	p.mu.Lock()
	var wait time.Duration
	for _, b := range bs {
		r := p.nodes[b.n]
		if r != nil && r.recent && b.found {
			wait = max(wait, time.Until(time.Unix(r.ctime.Unix()).Add(ptRecent)))
		}
	}
	// Not holding p.mu meanwhile: opens and notes of other files go on
	// (the barriers keep these files' records in place).
	p.mu.Unlock()
	if wait > 0 {
		time.Sleep(wait)
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	now := time.Now()
	for _, b := range bs {
		r := p.nodes[b.n]
		if r == nil || !r.recent || !b.found {
			continue
		}
		st, err := statFd(r.fd)
		if err != nil {
			ov.changed(b.n.ino, 0)
			continue
		}
		if st.size == r.size && st.mtime == r.mtime && st.ctime == r.ctime {
			r.set(&st, now)
		} else {
			ov.noteLocked(b.n, r, &st, now)
		}
	}
}

// cleanPages starts the writeback of the dirty pages of the upper file open
// at fd (after waiting for any under way), which write-protects them where
// they are mapped: the next store through a shared mapping faults and
// updates the file's times, which the notes compare. Without it, a store
// into a page dirty since before a freeze would change the file unseen.
func cleanPages(fd int) {
	unix.SyncFileRange(fd, 0, 0, unix.SYNC_FILE_RANGE_WAIT_BEFORE|unix.SYNC_FILE_RANGE_WRITE)
}

// notePTWrites counts the files written through passthrough since the last
// note as changed.
func (ov *overlay) notePTWrites() {
	p := &ov.ptw
	p.mu.Lock()
	defer p.mu.Unlock()
	now := time.Now()
	for n, r := range p.nodes {
		st, err := statFd(r.fd)
		if err != nil {
			ov.changed(n.ino, 0)
			continue
		}
		ov.noteLocked(n, r, &st, now)
	}
}

// barrier stops the passthrough writes of one node for a freeze: a thread
// of its own (ownThread: a kill of the daemon must not strand it) opens
// the file through the mount and changes its mode to the mode it has; the
// overlay holds that SETATTR (holdBarrier) until the freeze releases it.
type barrier struct {
	n       *node
	mode    uint32
	upperFd int // a duplicate of a handle's upper descriptor, for the copy
	uino    uint64
	// found: the thread opened the file through the mount (and holds it
	// open until its chmod returns), or the file's writes are revoked
	// (revoked: no thread, nothing to hold); why: why not. Set before
	// opened is closed.
	found   bool
	revoked bool
	why     string
	opened  chan struct{}
	issue   chan bool // true: issue the chmod; false: close the file and end
	arrived chan struct{}
	release chan struct{}
	once    sync.Once
	started bool       // the chmod was issued
	done    chan error // its result, once the thread closed the file
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

// ptTarget is a file whose passthrough writes a freeze stops: its node, a
// duplicate of its writable backing descriptor, and the processes that
// opened it for writing.
type ptTarget struct {
	n       *node
	fd      int
	pids    []uint32
	revoked bool
}

// ptTargets lists the files with writable passthrough handles, with
// duplicates of their descriptors for the caller to close, and counts a
// freeze under way (no new ones are granted until resumePTWrites, which
// the caller must call however this returns); seal: none ever again.
func (ov *overlay) ptTargets(seal bool) ([]ptTarget, error) {
	p := &ov.ptw
	var ts []ptTarget
	p.mu.Lock()
	defer p.mu.Unlock()
	p.freezing++
	p.sealed = p.sealed || seal
	for n, r := range p.nodes {
		// A duplicate: the node may leave meanwhile.
		fd, err := unix.FcntlInt(uintptr(r.fd), unix.F_DUPFD_CLOEXEC, 0)
		if err != nil {
			for _, t := range ts {
				unix.Close(t.fd)
			}
			return nil, fmt.Errorf("stop passthrough writes: %w", err)
		}
		ts = append(ts, ptTarget{n: n, fd: fd, pids: slices.Clone(r.pids), revoked: r.revoked})
	}
	return ts, nil
}

// stopPTWrites stops the writes of every file with writable passthrough
// handles (all of them at the time of the call: no new ones are granted
// until resumePTWrites, which the caller must call however this returns)
// and returns the barriers to release. A file that is in no directory any
// more is in no view and is skipped.
func (m *Mounted) stopPTWrites(ctx context.Context) ([]*barrier, error) {
	ov := m.ov
	ts, err := ov.ptTargets(false)
	if err != nil {
		return nil, err
	}
	defer func() {
		for _, t := range ts {
			unix.Close(t.fd)
		}
	}()
	if len(ts) == 0 {
		return nil, nil
	}
	// A held barrier keeps its file's inode lock. A rename of one written
	// file over another takes both files' locks: started while one
	// barrier was held, it waits for it with the other file's lock taken,
	// which the other barrier needs. Rounds break that cycle: a round that
	// does not stop every file within ptBarrierRound lets the barriers
	// it holds go (the rename goes through) and tries again. A barrier
	// whose chmod has not arrived yet is carried into the next round as
	// it is: one chmod per file in flight, so none of them is ever applied
	// for real with a mode that is no longer the file's.
	deadline := time.Now().Add(ptBarrierWait)
	var pending map[*node]*barrier
	for {
		bs, next, err := m.stopPTWritesOnce(ctx, ts, pending, min(ptBarrierRound, time.Until(deadline)))
		if err != errBarrierRound {
			return bs, err
		}
		pending = next
		if !time.Now().Before(deadline) {
			var left []*barrier
			for _, b := range pending {
				left = append(left, b)
			}
			releaseBarriers(ov, left)
			return nil, fmt.Errorf("stop passthrough writes: writes did not stop within %v", ptBarrierWait)
		}
		ov.log.Debug("freeze: passthrough barriers not all held; trying again", "files", len(ts))
	}
}

// ptBarrierRound bounds one try of stopPTWrites to hold every barrier.
const ptBarrierRound = 2 * time.Second

// errBarrierRound: a try of stopPTWritesOnce ran out of its time.
var errBarrierRound = errors.New("passthrough barriers not held within a round")

// stopPTWritesOnce tries once, for at most wait, to stop the writes of the
// files ts, reusing the barriers of pending (an earlier round's, their
// chmod not arrived): the barriers when all are held. When the time runs
// out it releases the barriers it holds and returns errBarrierRound and
// those still waiting for their chmod; on any other error it releases all.
func (m *Mounted) stopPTWritesOnce(ctx context.Context, ts []ptTarget, pending map[*node]*barrier, wait time.Duration) ([]*barrier, map[*node]*barrier, error) {
	ov := m.ov
	var bs []*barrier
	fail := func(err error) ([]*barrier, map[*node]*barrier, error) {
		releaseBarriers(ov, bs)
		return nil, nil, fmt.Errorf("stop passthrough writes: %w", err)
	}
	timer := time.NewTimer(wait)
	defer timer.Stop()
	// Time is up: the barriers held go, those whose chmod is on its way
	// stay for the next round.
	roundOver := func() ([]*barrier, map[*node]*barrier, error) {
		var held []*barrier
		next := map[*node]*barrier{}
		for _, b := range bs {
			select {
			case <-b.arrived:
				held = append(held, b)
			default:
				if b.started {
					next[b.n] = b
				} else {
					held = append(held, b)
				}
			}
		}
		releaseBarriers(ov, held)
		return nil, next, errBarrierRound
	}
	// Open every file first, before any is stopped: a lookup needs its
	// parents, which a rename blocked behind a barrier would hold. Each
	// barrier's thread opens its own, all at once.
	for _, t := range ts {
		if b := pending[t.n]; b != nil {
			bs = append(bs, b)
			continue
		}
		// Each barrier closes its own duplicate when released.
		fd, err := unix.FcntlInt(uintptr(t.fd), unix.F_DUPFD_CLOEXEC, 0)
		if err != nil {
			return fail(err)
		}
		var b *barrier
		if t.revoked {
			b, err = m.revokedBarrier(t.n, fd)
		} else {
			b, err = m.newBarrier(t.n, fd, t.pids, false)
		}
		if b == nil {
			unix.Close(fd)
		} else {
			bs = append(bs, b)
		}
		if err != nil {
			return fail(err)
		}
	}
	all := bs
	bs = nil
	for i, b := range all {
		if !b.started {
			select {
			case <-b.opened:
			case <-timer.C:
				bs = append(bs, all[i:]...)
				return roundOver()
			case <-ctx.Done():
				bs = append(bs, all[i:]...)
				return fail(ctx.Err())
			}
			if !b.found && !ov.ptw.open(b.n) {
				// Released meanwhile: nothing writes it any more.
				releaseBarriers(ov, []*barrier{b})
				continue
			}
			if !b.found {
				ov.log.Warn("freeze: cannot stop the writes of a file written through passthrough; copying it as it is being written", "upper_ino", b.uino, "why", b.why)
			}
		}
		bs = append(bs, b)
	}
	for _, b := range bs {
		if !b.found || b.revoked || b.started {
			continue
		}
		ov.barriers.Store(b.n, b)
		b.started = true
		b.issue <- true
	}
	for _, b := range bs {
		if !b.found || b.revoked {
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
			return roundOver()
		case <-ctx.Done():
			return fail(ctx.Err())
		}
	}
	return bs, nil, nil
}

// newBarrier makes node n's barrier, taking over upperFd, and starts its
// thread, which opens n through the mount; nil if n is in no directory any
// more. revoke: the thread revokes n's passthrough writes instead of
// waiting to be issued a chmod (revokePTWrites), and closes opened when it
// is done.
func (m *Mounted) newBarrier(n *node, upperFd int, pids []uint32, revoke bool) (*barrier, error) {
	ust, err := statFd(upperFd)
	if err != nil {
		return nil, err
	}
	if ust.nlink == 0 {
		return nil, nil // unlinked: in no view
	}
	b := &barrier{
		n: n, mode: ust.mode & 07777, upperFd: upperFd, uino: ust.ino,
		opened: make(chan struct{}), issue: make(chan bool, 1),
		arrived: make(chan struct{}), release: make(chan struct{}), done: make(chan error, 1),
	}
	ownThread(func(err error) {
		if err != nil {
			b.why = err.Error()
			close(b.opened)
			return
		}
		fd := m.openThroughMount(n, pids, &b.why)
		if fd < 0 {
			close(b.opened)
			return
		}
		if revoke {
			if err := revokeFile(fd, b.mode); err != nil {
				b.why = err.Error()
			} else {
				b.found = true
			}
			unix.Close(fd)
			close(b.opened)
			return
		}
		b.found = true
		close(b.opened)
		if !<-b.issue {
			unix.Close(fd)
			return
		}
		err = unix.Fchmod(fd, b.mode)
		unix.Close(fd)
		b.done <- err
	})
	return b, nil
}

// revokedBarrier is the barrier of node n, whose writes were revoked: it
// takes over upperFd for the copy and holds nothing.
func (m *Mounted) revokedBarrier(n *node, upperFd int) (*barrier, error) {
	ust, err := statFd(upperFd)
	if err != nil {
		return nil, err
	}
	if ust.nlink == 0 {
		return nil, nil
	}
	b := &barrier{
		n: n, mode: ust.mode & 07777, upperFd: upperFd, uino: ust.ino, found: true, revoked: true,
		opened: make(chan struct{}), issue: make(chan bool, 1),
		arrived: make(chan struct{}), release: make(chan struct{}), done: make(chan error, 1),
	}
	close(b.opened)
	return b, nil
}

// openThroughMount opens node n through the mount, on a thread of its own
// (ownThread): -1 if it cannot, with why set. The path from the mount's
// root comes first, looked up again if a rename moved it meanwhile;
// failing that, a descriptor of one of the processes that opened it for
// writing (pids), which works with the mountpoint unreachable too.
func (m *Mounted) openThroughMount(n *node, pids []uint32, why *string) int {
	same := func(fd int) bool {
		var st unix.Stat_t
		return unix.Fstat(fd, &st) == nil && st.Dev == m.dev && st.Ino == n.ino
	}
	*why = "not found under the mount nor among its writers' open files"
	root, err := m.openRoot()
	if err != nil {
		*why = err.Error()
	} else {
		defer unix.Close(root)
		for try := 0; try < 10; try++ {
			rel, ok := n.rel()
			if !ok || rel == "" {
				break
			}
			fd, err := unix.Openat(root, rel, unix.O_RDONLY|unix.O_NOFOLLOW|unix.O_NONBLOCK|unix.O_CLOEXEC, 0)
			if err == nil && same(fd) {
				return fd
			}
			if err == nil {
				unix.Close(fd) // another file has the name now
			}
			time.Sleep(time.Duration(try) * time.Millisecond)
		}
	}
	for _, pid := range pids {
		if fd := m.openFromProcess(pid, n.ino); fd >= 0 {
			return fd
		}
	}
	return -1
}

// openRoot opens the mount's root through its mountpoint, checking that
// the path still leads to this mount. It is opened for each freeze and
// closed after: a descriptor kept would keep a mount detached from outside
// alive. Only on a thread of its own (ownThread).
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

// openFromProcess opens the file of this mount with inode number ino that
// process (or thread) pid has open, through /proc; -1 if it has none. Only
// on a thread of its own (ownThread).
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

// releaseBarriers lets the writes stopped by bs go on. A chmod still
// waiting in the kernel (a barrier that never arrived) returns when the
// write ahead of it ends; its thread then closes what it opened.
func releaseBarriers(ov *overlay, bs []*barrier) {
	for _, b := range bs {
		close(b.release)
		if !b.started {
			b.issue <- false
			unix.Close(b.upperFd)
			continue
		}
		go func(b *barrier) {
			if err := <-b.done; err != nil {
				ov.log.Warn("freeze: passthrough barrier", "ino", b.n.ino, "err", err)
			}
			ov.barriers.CompareAndDelete(b.n, b)
			unix.Close(b.upperFd)
		}(b)
	}
}

// revokePTWrites revokes, for good, the passthrough writes of every file
// with writable passthrough handles (Seal): from its return on, their
// reads and writes fail with EIO and no write of them is under way, and
// no file is given writable passthrough again. It returns their barriers
// (never held: the files can no longer be written) for the caller to copy
// and release; found is false for a file whose writes could not be
// revoked (the log says why). The caller must call resumePTWrites however
// this returns.
func (m *Mounted) revokePTWrites(ctx context.Context) ([]*barrier, error) {
	ov := m.ov
	ts, err := ov.ptTargets(true)
	if err != nil {
		return nil, err
	}
	defer func() {
		for _, t := range ts {
			unix.Close(t.fd)
		}
	}()
	var bs []*barrier
	for _, t := range ts {
		fd, err := unix.FcntlInt(uintptr(t.fd), unix.F_DUPFD_CLOEXEC, 0)
		if err != nil {
			releaseBarriers(ov, bs)
			return nil, fmt.Errorf("revoke passthrough writes: %w", err)
		}
		b, err := m.newBarrier(t.n, fd, t.pids, true)
		if b == nil {
			unix.Close(fd)
			if err == nil {
				ov.ptw.markRevoked(t.n) // in no directory: nothing to refuse
			}
		} else {
			bs = append(bs, b)
		}
		if err != nil {
			releaseBarriers(ov, bs)
			return nil, fmt.Errorf("revoke passthrough writes: %w", err)
		}
	}
	timer := time.NewTimer(ptBarrierWait)
	defer timer.Stop()
	for _, b := range bs {
		select {
		case <-b.opened:
		case <-timer.C:
			releaseBarriers(ov, bs)
			return nil, fmt.Errorf("revoke passthrough writes: writes did not stop within %v", ptBarrierWait)
		case <-ctx.Done():
			releaseBarriers(ov, bs)
			return nil, fmt.Errorf("revoke passthrough writes: %w", ctx.Err())
		}
		if b.found {
			ov.ptw.markRevoked(b.n)
		} else if ov.ptw.open(b.n) {
			ov.log.Warn("seal: cannot refuse the writes of a file written through passthrough; what it writes from now on is not in the final snapshot (the stop sees it and keeps it locally)", "upper_ino", b.uino, "why", b.why)
		}
	}
	return bs, nil
}

// revokers are the threads revoking a file's passthrough writes (revoke),
// by thread id; revoking counts them, so that GETATTR pays one atomic
// load when none is.
var (
	revokers sync.Map // uint32 -> struct{}
	revoking atomic.Int32
)

// revokedAttr makes a revoking thread's GETATTR answer a status of no file
// type (see revoke); out is the answer to caller's request.
func revokedAttr(caller uint32, out *fuse.AttrOut) {
	if revoking.Load() == 0 {
		return
	}
	if _, ok := revokers.Load(caller); ok {
		out.Mode &^= syscall.S_IFMT
	}
}

// revokeFile makes the kernel fail every later read and write of the FUSE
// file open at fd (on this thread: ownThread), of every open file of it,
// and waits for the writes under way to end; nil if it could.
//
// The kernel marks an inode bad when a GETATTR of it answers a status of
// no (or another) file type, and from then on fails every read and write
// of every open file of it with EIO, passthrough ones included: the check
// comes before the write. A chmod of a bad inode still takes the inode's
// lock, which a passthrough write holds while it writes, and then fails
// without a request: once it returns, the writes that passed the check
// before are done. (A write preempted between the check and its taking of
// the lock can still land after: it changes the file's ctime, which
// Generation compares, so the stop sees it and keeps the upper layer. A
// file system with multigrain timestamps (ext4, xfs, btrfs, tmpfs from
// kernel 6.13) gives a change after a stat a later ctime even within the
// clock's tick; elsewhere such a write in the same tick as the seal's
// note would go unseen.) The kernel behaviour is verified once per
// process (ptcheck.go).
func revokeFile(fd int, mode uint32) error {
	tid := uint32(unix.Gettid())
	revokers.Store(tid, struct{}{})
	revoking.Add(1)
	var stx unix.Statx_t
	err := unix.Statx(fd, "", unix.AT_EMPTY_PATH|unix.AT_STATX_FORCE_SYNC, unix.STATX_TYPE|unix.STATX_MODE, &stx)
	revoking.Add(-1)
	revokers.Delete(tid)
	if err != unix.EIO {
		return fmt.Errorf("the kernel took the revoking status (%v) without failing the file", err)
	}
	var b [1]byte
	if _, err := unix.Pread(fd, b[:], 0); err != unix.EIO {
		return fmt.Errorf("a read after the revoke gave %v, not EIO", err)
	}
	unix.Fchmod(fd, mode) // EIO, once the writes under way are done
	return nil
}

// markRevoked notes that n's passthrough writes are revoked.
func (p *ptWriters) markRevoked(n *node) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if r := p.nodes[n]; r != nil {
		r.revoked = true
	}
}

// open reports whether n is still in passthrough with a writable backing.
func (p *ptWriters) open(n *node) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.nodes[n] != nil
}

// resumePTWrites ends a freeze's hold on new writable passthrough grants.
func (ov *overlay) resumePTWrites() {
	ov.ptw.mu.Lock()
	ov.ptw.freezing--
	ov.ptw.mu.Unlock()
}
