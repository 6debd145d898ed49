package fs

import (
	"errors"
	"fmt"
	"path/filepath"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// Partial files by name.
//
// A present-map is named after its file's upper inode number and birth
// time, which is how the overlay finds it; but a copy of the state dir
// (cp -a, rsync -a, tar, a restore from a file-level backup) gives every
// file a new inode, and a partial file whose map is lost reads as its
// upper file, whose blocks not yet copied in are holes: zeros. So a map
// also records its file's path in the upper layer, which copies keep, and
// keeps it true:
//
//   - the copy-up writes it with the map, before the file has that name;
//   - a rename or an unlink that may move or remove a name of a partial
//     file (the file itself, a directory above its name, a file renamed
//     over it) first records the name as unknown, then, once done, the new
//     name (or, for the file's last name, gone); such changes are
//     serialised by partialSet.nameMu, taken exclusively while partial
//     files exist, so the name recorded last is the name the file has;
//   - a name left unknown (a crash in between, a file with several names
//     that lost the one recorded) is recorded again when the file is next
//     looked up or opened.
//
// A map records its own inode number and birth time too. At mount, a map
// whose own differ was copied: its file is found by the recorded name and
// the map is made again for the file's new inode (after an fdatasync of
// the file, every block recorded present is trusted). A copied map whose
// name is unknown or names no regular file stops the mount with an error
// that names the file and what to do: never a guess, never zeros. A map
// not copied whose recorded name is not its file (a copy-up that never
// completed its rename; a daemon from before these records renamed it)
// is kept, its name recorded as unknown. Maps written before these
// records have neither and are kept as they are. A copied map found its
// file is checked against it first (partial_copied.go): a copy of a
// running daemon's state dir may hold holes where the map says blocks are
// in.

// settle takes the maps read at mount into the set: it drops those of
// files that are gone and makes the copied ones again for their files.
func (s *partialSet) settle(loaded []*partial, readOnly bool) error {
	var copied []*partial
	for _, p := range loaded {
		if p.loaded.gone {
			s.removeLoaded(p, readOnly, "its file was deleted")
			continue
		}
		if p.loaded.hasSelf {
			if self, err := s.selfOf(p); err == nil && self != p.loaded.self {
				copied = append(copied, p)
				continue
			}
		}
		if p.nameKnown && !readOnly {
			st, err := s.statRel(p.recName)
			if err != nil && !errors.Is(err, unix.ENOENT) && !errors.Is(err, unix.ENOTDIR) {
				return fmt.Errorf("fs: partial copy-up: check %s: %w", p.recName, err)
			}
			if err != nil || st.ino != p.uino || st.btime != p.btime {
				// A copy-up that never gave the file its name, a
				// change by a daemon that kept no names: the map
				// stays as it is, without a name.
				s.ov.log.Info("partial copy-up: a present-map's file is not at its recorded name; the name is dropped", "map", p.name, "name", p.recName)
				if err := p.setName("", false); err != nil {
					return fmt.Errorf("fs: partial copy-up: record %s: %w", p.name, err)
				}
			}
		}
		s.m[p.uino] = p
	}
	for _, p := range copied {
		if err := s.rebind(p, readOnly); err != nil {
			return err
		}
	}
	return nil
}

// selfOf is the inode number and birth time of p's map file now.
func (s *partialSet) selfOf(p *partial) ([2]uint64, error) {
	st, err := statxAt(s.dir, p.name)
	if err != nil {
		return [2]uint64{}, err
	}
	return [2]uint64{st.ino, st.btime}, nil
}

// removeLoaded forgets a map read at mount and, unless readOnly, removes
// it.
func (s *partialSet) removeLoaded(p *partial, readOnly bool, why string) {
	if p.mapFd >= 0 {
		unix.Close(p.mapFd)
		p.mapFd = -1
	}
	if readOnly {
		return
	}
	s.ov.log.Info("partial copy-up: removing a stale present-map", "map", p.name, "name", p.loaded.lastName, "why", why)
	unix.Unlinkat(s.dir, p.name, 0)
	fsyncDir(s.dir)
}

// statRel is the status of the upper object at path rel.
func (s *partialSet) statRel(rel string) (ustat, error) {
	dir, name := splitRel(rel)
	dfd, err := s.ov.u.dir(dir)
	if err != nil {
		return ustat{}, err
	}
	defer s.ov.u.put(dfd)
	return statxAt(dfd, name)
}

// copiedStateErr is the error that stops a mount on a copied map that
// cannot be matched to its file.
func (s *partialSet) copiedStateErr(p *partial, why string) error {
	file := "a file copied up by range"
	if p.loaded.lastName != "" {
		file = strconv.Quote(p.loaded.lastName)
	}
	mp := filepath.Join(s.ov.u.path, partialDirName, p.name)
	return fmt.Errorf("the state dir was copied (cp -a, rsync -a, a restore) while %s was still being copied in from the snapshot, and its present-map %s: "+
		"its blocks not yet copied would read as zeros, so it is not mounted. "+
		"Mount the original state dir, read the file once (its background copy resumes when it is used) and wait until `hermesfs status` lists no partial copy-ups, then copy it again; "+
		"or give up that file's changes since the snapshot: remove the file and its map %s (a file left without its map reads zeros where it was not copied in)", file, why, mp)
}

// rebind makes copied map p again for its file, found by name, once the
// copied file holds what the map says it does (checkCopied).
func (s *partialSet) rebind(p *partial, readOnly bool) error {
	if !p.nameKnown {
		if p.complete && p.loaded.closed {
			// Copied after its daemon stopped (its session closed):
			// every block was in the file when the map was copied.
			s.removeLoaded(p, readOnly, "a copy of the map of a complete file")
			return nil
		}
		return s.copiedStateErr(p, "does not say where the file is now (it was being renamed or deleted, or has another name)")
	}
	st, err := s.statRel(p.recName)
	switch {
	case err != nil && (errors.Is(err, unix.ENOENT) || errors.Is(err, unix.ENOTDIR)):
		return s.copiedStateErr(p, "names "+strconv.Quote(p.recName)+", which is not in the copy")
	case err != nil:
		return fmt.Errorf("fs: partial copy-up: check %s: %w", p.recName, err)
	case st.mode&unix.S_IFMT != unix.S_IFREG:
		return s.copiedStateErr(p, "names "+strconv.Quote(p.recName)+", which is not a regular file in the copy")
	}
	if q := s.m[st.ino]; q != nil {
		if q.btime == st.btime {
			// Made again already by a mount that stopped before it
			// removed the copied map.
			s.removeLoaded(p, readOnly, "made again for its file already")
			return nil
		}
		// An earlier inode of that number: its file is gone (verify
		// would drop it too).
		delete(s.m, q.uino)
		s.removeLoaded(q, readOnly, "its inode number is another file's now")
	}
	if err := s.checkCopied(p, &st, readOnly); err != nil {
		return err
	}
	// Which bytes changed is not vouched for across a copy: all did.
	p.changes.init(p.lowerSize, false)
	if p.complete {
		// Every block is in the copied file, as checked: it is whole.
		s.removeLoaded(p, readOnly, "a copy of the map of a complete file")
		return nil
	}
	old := p.name
	p.uino, p.btime, p.name = st.ino, st.btime, mapName(st.ino, st.btime)
	if readOnly {
		// Nothing may be written: the map holds for this mount.
		s.m[p.uino] = p
		return nil
	}
	if err := s.writeRebound(p, old); err != nil {
		return fmt.Errorf("fs: partial copy-up: make the present-map of %s again: %w", p.recName, err)
	}
	s.m[p.uino] = p
	s.ov.log.Warn("partial copy-up: the state dir was copied; present-map taken over by its file", "path", p.recName, "map", p.name, "was", old)
	return nil
}

// writeRebound writes p's map anew under its new name and removes the map
// it was read from (old): the file's data made durable first, then a map
// whose every present block is synced, atomically in place.
func (s *partialSet) writeRebound(p *partial, old string) error {
	dir, name := splitRel(p.recName)
	dfd, err := s.ov.u.dir(dir)
	if err != nil {
		return err
	}
	ffd, err := unix.Openat(dfd, name, unix.O_RDONLY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	s.ov.u.put(dfd)
	if err != nil {
		return err
	}
	err = unix.Fdatasync(ffd)
	unix.Close(ffd)
	if err != nil {
		return err
	}
	tmp := rebindPrefix + strconv.FormatUint(p.uino, 10)
	unix.Unlinkat(s.dir, tmp, 0)
	fd, err := unix.Openat(s.dir, tmp, unix.O_CREAT|unix.O_EXCL|unix.O_RDWR|unix.O_APPEND|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return err
	}
	fail := func(err error) error {
		unix.Close(fd)
		unix.Unlinkat(s.dir, tmp, 0)
		return err
	}
	self, err := statFd(fd)
	if err != nil {
		return fail(err)
	}
	// Written without the tracking flag: which bytes changed is not
	// vouched for across a copy (partial_changes.go).
	b := append(encodeHeader(p, p.lowerMtime, 0), encodeSelf(&self)...)
	b = append(b, encodeName(p.recName, true)...)
	for i := int64(0); i < p.nblocks(); i++ {
		if p.present[i/64]&(1<<(i%64)) != 0 {
			b = append(b, encodeRec(recPresent, i)...)
		}
	}
	if p.limit < p.lowerSize {
		b = append(b, encodeRec(recLimit, p.limit)...)
	}
	b = append(b, encodeRec(recSync, 0)...)
	if err := pwriteAll(fd, b, 0); err != nil {
		return fail(err)
	}
	if err := unix.Fdatasync(fd); err != nil {
		return fail(err)
	}
	if err := unix.Renameat2(s.dir, tmp, s.dir, p.name, unix.RENAME_NOREPLACE); err != nil {
		return fail(err)
	}
	if err := fsyncDir(s.dir); err != nil {
		unix.Close(fd)
		return err
	}
	if p.mapFd >= 0 {
		unix.Close(p.mapFd)
	}
	p.mapFd = fd
	unix.Unlinkat(s.dir, old, 0)
	return fsyncDir(s.dir)
}

// rebindPrefix starts the name of a map being made again (writeRebound);
// one a crash left is removed at mount.
const rebindPrefix = "rebind."

// lockNames is held around every rename and unlink in the upper layer:
// exclusively while partial files exist (excl), so the changes that move
// their names are recorded in the order they are made; shared otherwise
// (the set cannot gain a file meanwhile: a copy-up adds one holding it
// exclusively).
func (s *partialSet) lockNames() (unlock func(), excl bool) {
	if s == nil || s.dir < 0 {
		return func() {}, false
	}
	if s.count.Load() == 0 {
		s.nameMu.RLock()
		if s.count.Load() == 0 {
			return s.nameMu.RUnlock, false
		}
		s.nameMu.RUnlock()
	}
	s.nameMu.Lock()
	return s.nameMu.Unlock, true
}

// nameMove is what a rename or an unlink does to a partial file's
// recorded name.
type nameMove struct {
	p        *partial
	oldName  string
	oldKnown bool
	name     string // after the change
	known    bool
	gone     bool
}

// partials lists the set's files.
func (s *partialSet) partials() []*partial {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make([]*partial, 0, len(s.m))
	for _, p := range s.m {
		out = append(out, p)
	}
	return out
}

// syncData makes the upper file of p durable (its data and size), found
// by the name its map records and checked to be p's file.
func (s *partialSet) syncData(p *partial) error {
	name, known := p.names()
	if !known || name == "" {
		return errors.New("no recorded name")
	}
	dir, base := splitRel(name)
	dfd, err := s.ov.u.dir(dir)
	if err != nil {
		return err
	}
	fd, err := unix.Openat(dfd, base, unix.O_RDONLY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	s.ov.u.put(dfd)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	st, err := statFd(fd)
	if err != nil {
		return err
	}
	if !p.is(&st) {
		return errors.New("another file has its recorded name")
	}
	return unix.Fdatasync(fd)
}

func (p *partial) is(st *ustat) bool { return st != nil && st.ino == p.uino && st.btime == p.btime }

func (p *partial) names() (string, bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.recName, p.nameKnown
}

// below reports whether path name is dir or under it, and the rest.
func below(name, dir string) (string, bool) {
	if name == dir {
		return "", true
	}
	rest, ok := strings.CutPrefix(name, dir+"/")
	if !ok {
		return "", false
	}
	return "/" + rest, true
}

// renameMoves is what renaming from to to (upper paths) does to the
// partial files' names: src is the object that moves (a directory if
// srcDir), dst the one at to (nil if none; a directory if dstDir).
// lockNames is held exclusively.
func (s *partialSet) renameMoves(from, to string, src, dst *ustat, srcDir, dstDir, exchange bool) []nameMove {
	var out []nameMove
	for _, p := range s.partials() {
		name, known := p.names()
		m := nameMove{p: p, oldName: name, oldKnown: known, known: true}
		switch rest, under := below(name, from); {
		case !srcDir && p.is(src):
			m.name = to
		case srcDir && known && under:
			m.name = to + rest
		case exchange && !dstDir && p.is(dst):
			m.name = from
		case exchange && dstDir && known:
			rest, under := below(name, to)
			if !under {
				continue
			}
			m.name = from + rest
		case !exchange && dst != nil && !dstDir && p.is(dst):
			// Renamed over: its last name, or the one recorded.
			switch {
			case dst.nlink <= 1:
				m.gone = true
			case known && name == to:
				m.known = false
			default:
				continue
			}
		default:
			continue
		}
		out = append(out, m)
	}
	return out
}

// unlinkMoves is what unlinking path (object st) does to the partial
// files' names. lockNames is held exclusively.
func (s *partialSet) unlinkMoves(path string, st *ustat) []nameMove {
	for _, p := range s.partials() {
		if !p.is(st) {
			continue
		}
		name, known := p.names()
		m := nameMove{p: p, oldName: name, oldKnown: known}
		switch {
		case st.nlink <= 1:
			m.gone = true
		case known && name == path:
		default:
			return nil
		}
		return []nameMove{m}
	}
	return nil
}

// setName records p's name (or that it is unknown), durably.
func (p *partial) setName(name string, known bool) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.done || p.nameKnown == known && (!known || p.recName == name) {
		return nil
	}
	if err := p.appendRecs(encodeName(name, known)); err != nil {
		return err
	}
	if p.mapFd >= 0 {
		if err := unix.Fdatasync(p.mapFd); err != nil {
			return fmt.Errorf("present-map: %w", err)
		}
	}
	p.recName, p.nameKnown = name, known
	return nil
}

// prepare records the names a change moves as unknown before it is made:
// a crash in the middle leaves no name that is not the file's.
func (s *partialSet) prepare(moves []nameMove) error {
	for _, m := range moves {
		if err := m.p.setName("", false); err != nil {
			return fmt.Errorf("partial copy-up: record a rename: %w", err)
		}
	}
	return nil
}

// finish records the names after the change (done), or the names before
// it again if it failed.
func (s *partialSet) finish(moves []nameMove, done bool) {
	for _, m := range moves {
		var err error
		switch {
		case !done:
			err = m.p.setName(m.oldName, m.oldKnown)
		case m.gone:
			m.p.mu.Lock()
			err = m.p.appendRec(recGone, 0)
			m.p.gone = true
			complete := m.p.complete
			m.p.mu.Unlock()
			if complete && err == nil {
				// Nothing reads it merged: the map goes with the name.
				s.drop(m.p, true)
			}
		default:
			err = m.p.setName(m.name, m.known)
		}
		if err != nil {
			s.ov.log.Error("partial copy-up: recording a file's name failed; it is looked up again when next used", "upper_ino", m.p.uino, "err", err)
		}
	}
}

// noteName records, if the map does not say so, that p's file is named
// name in directory dfd (where a lookup or an open found it), once that
// still holds under lockNames.
func (s *partialSet) noteName(p *partial, dfd int, name string) {
	if s.ov.opts.ReadOnly {
		return
	}
	dir, ok := s.ov.u.relOf(dfd)
	if !ok {
		return
	}
	if n, known := p.names(); known && n == joinRel(dir, name) {
		return
	}
	unlock, _ := s.lockNames()
	defer unlock()
	dir, ok = s.ov.u.relOf(dfd)
	if !ok {
		return
	}
	st, err := statxAt(dfd, name)
	if err != nil || !p.is(&st) {
		return
	}
	if err := p.setName(joinRel(dir, name), true); err != nil {
		s.ov.log.Warn("partial copy-up: recording a file's name failed", "upper_ino", p.uino, "err", err)
	}
}

// noteNameFd is noteName for the file open at fd.
func (s *partialSet) noteNameFd(p *partial, fd int) {
	if s.ov.opts.ReadOnly {
		return
	}
	rel, ok := s.ov.u.relOf(fd)
	if !ok || rel == "" {
		return
	}
	if n, known := p.names(); known && n == rel {
		return
	}
	dir, name := splitRel(rel)
	dfd, err := s.ov.u.dir(dir)
	if err != nil {
		return
	}
	defer s.ov.u.put(dfd)
	s.noteName(p, dfd, name)
}

// syncAll makes every partial file's copied blocks durable and says so in
// its map, at unmount: a state dir copied to another machine (or read
// after a reboot) then trusts all of them. It closes the sessions of
// changes (partial_changes.go).
func (s *partialSet) syncAll() {
	if s == nil || s.ov.opts.ReadOnly {
		return
	}
	defer s.closeSessions()
	var dirty []*partial
	for _, p := range s.partials() {
		p.mu.Lock()
		if p.unsynced && p.mapFd >= 0 {
			dirty = append(dirty, p)
		}
		p.mu.Unlock()
	}
	if len(dirty) == 0 {
		return
	}
	// The copied blocks are the files' data: each file's fdatasync makes
	// them durable, without waiting for the rest of a disk that other
	// programs share (syncfs); a file not found by its recorded name is
	// made durable by syncfs.
	whole := false
	for _, p := range dirty {
		if err := s.syncData(p); err != nil {
			whole = true
			break
		}
	}
	if whole {
		fd, err := unix.Openat(s.ov.u.root, ".", unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
		if err != nil {
			s.ov.log.Warn("partial copy-up: sync at unmount", "err", err)
			return
		}
		err = unix.Syncfs(fd)
		unix.Close(fd)
		if err != nil {
			s.ov.log.Warn("partial copy-up: sync at unmount", "err", err)
			return
		}
	}
	for _, p := range dirty {
		p.mu.Lock()
		err := p.appendRec(recSync, 0)
		if err == nil {
			p.unsynced = false
			err = unix.Fdatasync(p.mapFd)
		}
		p.mu.Unlock()
		if err != nil {
			s.ov.log.Warn("partial copy-up: sync at unmount", "upper_ino", p.uino, "err", err)
		}
	}
}
