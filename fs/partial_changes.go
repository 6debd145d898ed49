package fs

import (
	"fmt"

	"golang.org/x/sys/unix"
)

// Which bytes of a file copied up by range may differ from the lower file.
//
// A snapshot packs such a file as the lower file's compressed blocks with
// the changed ones read and compressed again (View, archive.PartialSource),
// so a map also records, before each change of the file's bytes, which
// bytes it may change, and keeps doing so once every block is in. A byte
// reported unchanged must equal the lower file's byte at the same offset:
// a false "unchanged" would put the lower byte into the snapshot instead
// of the written one. So every doubt counts as a change.
//
// The records (after the map's creation, whose header says it tracks
// changes; a map without the flag, from an older daemon or made again for
// a copied state dir, reports every byte changed):
//
//   - changed(first, n): the changeBlock blocks [first, first+n) may
//     differ; appended before the write, punch or zeroing that changes
//     them is made;
//   - cut(off): every byte at or past off may differ (collapse or insert
//     range, a writable passthrough open, a lost session); the present
//     map's limit (a truncation) counts the same way, and so do bytes at
//     or past the lower size;
//   - open: a session of changes begins (a mount's first meeting with the
//     file); made durable (fdatasync of the map) before the session's
//     first change;
//   - close(ctime): the session ended at an unmount with every change
//     recorded above, the upper file's ctime then.
//
// Killed without a machine crash, the next mount reads every record
// written (the page cache keeps them): nothing is lost. After a machine
// crash a record may be lost while the bytes it announced reached the
// disk, so a session open at the crash (its open record from an earlier
// boot, not closed) reports every byte changed. A session closed at an
// unmount is trusted if the file's ctime is still the one recorded: a
// file changed while no tracking daemon ran (a daemon from before these
// records, a hand edit of the state dir) reports every byte changed.
//
// Tracking ends (the map goes) when the file is complete and nothing of it
// can be unchanged any more (truncated to zero, all cut), and, as for any
// map, when the file is deleted; a writable open that the kernel serves
// by passthrough would write unseen, so a tracked file's writable opens
// are served by the daemon, and one that cannot be (the inode is in
// passthrough already) cuts the map at zero first.

// changeBlock is the granularity of change records.
const changeBlock = 16 << 10

// changeState is what a map knows of its file's changes. The partial's mu
// guards it.
type changeState struct {
	tracks bool     // recorded since the map's creation (its header says so)
	bits   []uint64 // changeBlock blocks that may differ
	cut    int64    // every byte at or past it may differ
	// session: this mount's session of changes is open (its record
	// appended); durable: that record is on disk, so changes may be
	// recorded after it.
	session bool
	durable bool
}

func (c *changeState) init(lowerSize int64, tracks bool) {
	nb := (lowerSize + changeBlock - 1) / changeBlock
	c.tracks = tracks
	c.bits = make([]uint64, (nb+63)/64)
	c.cut = lowerSize
	if !tracks {
		c.cut = 0
	}
}

func (c *changeState) isSet(b int64) bool { return c.bits[b/64]&(1<<(b%64)) != 0 }

func (c *changeState) set(first, n int64) {
	nb := int64(len(c.bits)) * 64
	for b := max(first, 0); b < first+n && b < nb; b++ {
		c.bits[b/64] |= 1 << (b % 64)
	}
}

// loadChange takes one change record read at mount.
func (p *partial) loadChange(kind byte, v int64, thisBoot bool) {
	c, l := &p.changes, &p.loaded
	switch kind {
	case recChanged:
		c.set(int64(uint64(v)>>16), v&0xffff+1)
	case recCut:
		c.cut = min(c.cut, max(v, 0))
	case recOpen:
		l.sessOpen, l.sessThisBoot, l.closed = true, thisBoot, false
	case recClose:
		l.sessOpen, l.closed, l.closeCtime = false, true, v
	}
}

// openSession is the record of a new session of changes; the caller
// appends it. p.mu is held.
func (p *partial) openSession() []byte {
	p.changes.session = true
	p.changes.durable = false
	return encodeRec(recOpen, 0)
}

// beginSession is the first meeting of this mount with a map it loaded
// (status st of its file): it decides whether the changes recorded can
// be trusted and opens the mount's session. p.mu is held.
func (p *partial) beginSession(st *ustat) {
	c, l := &p.changes, &p.loaded
	var recs []byte
	was := c.cut
	switch {
	case c.cut == 0:
	case l.sessOpen && !l.sessThisBoot:
		// The machine stopped in a session: a change record may be
		// lost, the change not.
		p.set.ov.log.Info("partial copy-up: the machine stopped while the file was being changed; all of it counts as changed", "upper_ino", p.uino)
		c.cut = 0
	case l.closed && st.ctime.Nano() != l.closeCtime:
		p.set.ov.log.Info("partial copy-up: the file changed while no mount tracked it; all of it counts as changed", "upper_ino", p.uino)
		c.cut = 0
	case !l.sessOpen && !l.closed:
		c.cut = 0
	}
	if was != 0 && c.cut == 0 {
		recs = encodeRec(recCut, 0)
	}
	if p.mapFd < 0 || p.set.ov.opts.ReadOnly {
		return
	}
	recs = append(recs, p.openSession()...)
	if err := p.appendRecs(recs); err != nil {
		// Unknown on disk: nothing of it is trusted.
		c.cut, c.session = 0, false
		p.set.ov.log.Warn("partial copy-up: recording a session failed; all of the file counts as changed", "upper_ino", p.uino, "err", err)
	}
}

// ensureSession makes the session's open record durable before its first
// change. p.mu is held.
func (p *partial) ensureSession() error {
	c := &p.changes
	if !c.session {
		if err := p.appendRecs(p.openSession()); err != nil {
			return err
		}
	}
	if !c.durable && p.mapFd >= 0 {
		if err := unix.Fdatasync(p.mapFd); err != nil {
			return fmt.Errorf("present-map: %w", err)
		}
	}
	c.durable = true
	return nil
}

// unchangedEnd is where the bytes that may be unchanged end. p.mu is held.
func (p *partial) unchangedEnd() int64 {
	if p.done || p.broken != nil {
		return 0
	}
	return min(p.changes.cut, p.limit, p.lowerSize)
}

// noteChange records, before the file's bytes in [off, end) change, that
// they may differ from the lower file's. An error means the change must
// not be made.
func (p *partial) noteChange(off, end int64) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	c := &p.changes
	hi := min(end, p.unchangedEnd())
	if off < 0 || off >= hi {
		return nil
	}
	first, last := off/changeBlock, (hi-1)/changeBlock
	var recs []byte
	for b := first; b <= last; {
		if c.isSet(b) {
			b++
			continue
		}
		e := b + 1
		for e <= last && !c.isSet(e) && e-b < 1<<16 {
			e++
		}
		recs = append(recs, encodeRec(recChanged, b<<16|(e-b-1))...)
		b = e
	}
	if recs == nil {
		return nil
	}
	if err := p.ensureSession(); err != nil {
		return err
	}
	if err := p.appendRecs(recs); err != nil {
		return err
	}
	c.set(first, last-first+1)
	return nil
}

// noteCut records, before a change that may move or replace every byte
// from off on, that they may differ from the lower file's.
func (p *partial) noteCut(off int64) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.noteCutLocked(off)
}

// noteCutLocked is noteCut with p.mu held.
func (p *partial) noteCutLocked(off int64) error {
	off = max(off, 0)
	if off >= p.unchangedEnd() {
		return nil
	}
	if err := p.ensureSession(); err != nil {
		return err
	}
	if err := p.appendRec(recCut, off); err != nil {
		return err
	}
	p.changes.cut = off
	return nil
}

// changedRange reports whether any byte of [off, off+n) may differ from
// the lower file's byte at the same offset: archive.PartialSource's
// changed. Changes made after a freeze are reported too, which only
// makes the view's file read more.
func (p *partial) changedRange(off, n int64) bool {
	if n <= 0 {
		return false
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	end := off + n
	if off < 0 || end > p.unchangedEnd() {
		return true
	}
	c := &p.changes
	for b := off / changeBlock; b*changeBlock < end; b++ {
		if c.isSet(b) {
			return true
		}
	}
	return false
}

// useful reports whether some byte of the file may still be unchanged:
// once complete, a map is kept only then. p.mu is held.
func (p *partial) useful() bool { return p.changes.tracks && p.unchangedEnd() > 0 }

// completed is called once every block of p is in: reads need no lower
// layer any more; the map stays while it knows unchanged bytes.
func (s *partialSet) completed(p *partial) {
	p.mu.Lock()
	p.complete = true
	keep := p.useful()
	p.mu.Unlock()
	if !keep {
		s.drop(p, true)
		return
	}
	s.mu.Lock()
	s.recountLocked()
	s.mu.Unlock()
}

// retire drops the map of a complete file that knows no unchanged byte
// any more (truncated to zero, cut at zero).
func (s *partialSet) retire(p *partial) {
	p.mu.Lock()
	gone := p.complete && !p.done && !p.useful()
	p.mu.Unlock()
	if gone {
		s.drop(p, true)
	}
}

// giveUp counts every byte of p's file as changed from now on, before a
// change the overlay will not see (a writable open served by passthrough).
func (s *partialSet) giveUp(p *partial) error {
	if err := p.noteCut(0); err != nil {
		return err
	}
	s.retire(p)
	return nil
}

// closeSessions ends, at unmount, the session of every map this mount met
// whose file it can still find, recording the file's ctime, durably.
func (s *partialSet) closeSessions() {
	for _, p := range s.partials() {
		p.mu.Lock()
		open := p.changes.session && p.changes.tracks && p.mapFd >= 0 && !p.done
		name, known := p.recName, p.nameKnown
		p.mu.Unlock()
		if !open || !known {
			continue
		}
		st, err := s.statRel(name)
		if err != nil || !p.is(&st) {
			continue
		}
		p.mu.Lock()
		if p.changes.session && p.mapFd >= 0 && !p.done {
			err = p.appendRec(recClose, st.ctime.Nano())
			if err == nil {
				p.changes.session = false
				err = unix.Fdatasync(p.mapFd)
			}
		}
		p.mu.Unlock()
		if err != nil {
			s.ov.log.Warn("partial copy-up: closing a session of changes", "upper_ino", p.uino, "err", err)
		}
	}
}
