package fs

import (
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"
	"io"
	"os"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/hanwen/go-fuse/v2/fuse"
	"golang.org/x/sys/unix"

	"github.com/hermesfs/hermesfs/archive"
)

// Copy-up by range (partial upper files).
//
// A write into a lower regular file of at least Options.CopyUpByRangeMin
// bytes does not copy the whole file: the upper file is created sparse at
// the lower size and only the aligned blocks (Options.CopyUpBlock) a write,
// truncation or fallocate touches are copied in before the change applies.
// Reads take copied blocks from the upper file and the others from the
// lower layer. A background task copies the remaining blocks, throttled;
// once every block is in, the file is an ordinary upper file.
//
// The present-map is a sidecar file per partial file in partialDirName (an
// overlay directory at the upper root, never part of the merged tree),
// named after the upper inode number and birth time. It is a 64-byte
// header followed by fixed-size records, each with a CRC (a torn tail is
// ignored):
//
//   - present(block): the block's lower bytes were written to the upper
//     file before the record was appended;
//   - sync: every record before it describes bytes made durable
//     (fdatasync of the upper file) before the sync record was written;
//   - limit(size): the file was truncated to size and that truncation
//     made durable; lower bytes at or past the smallest limit never show
//     again.
//
// Each record carries the kernel's boot id. A present record is trusted if
// a later sync record follows it, or if it was written during the current
// boot: a daemon killed without a machine crash leaves its writes in the
// page cache, where the next daemon reads them, so nothing it wrote is
// lost; after a machine crash only the records that a sync covered count,
// and a block copied in but not synced is read from the lower layer again,
// which is correct since no write into it was acknowledged (fsync of the
// file writes a sync record first). The file's size at load also bounds
// the limit: a shrink that reached the disk without its record still
// hides the lower bytes past it.
//
// A map also says which file it belongs to in a way a copy of the state
// dir keeps (cp -a, rsync -a and tar give every file a new inode number;
// they keep names): see partial_names.go.
//
//   - self: the map file's own inode number and birth time, written at its
//     creation: a map whose own differ was copied;
//   - name: the file's path in the upper layer (in the name-data records
//     after it), or unknown while a rename or unlink that may change it
//     runs; the last one counts;
//   - gone: the file lost its last name; the map is garbage.
//
// Daemons from before these records ignore them. A map also records which
// of the file's bytes may differ from the lower file's, and keeps doing so
// once every block is in: see partial_changes.go.
const (
	partialDirName = ".wh..wh..part" // in the upper root: present-maps of partial files

	partialMagic   = "HFSPART1"
	partialHdrLen  = 64
	partialRecLen  = 32
	recPresent     = 1
	recSync        = 2
	recLimit       = 3
	recSelf        = 4
	recName        = 5
	recNameData    = 6
	recGone        = 7
	recChanged     = 8                 // partial_changes.go
	recCut         = 9                 // partial_changes.go
	recOpen        = 10                // partial_changes.go
	recClose       = 11                // partial_changes.go
	recPayload     = partialRecLen - 8 // bytes of a self or name-data record
	defaultRangeBS = 256 << 10
	defaultRangeMn = 4 << 20
)

// DefaultCopyUpByRangeMin is Options.CopyUpByRangeMin when it is zero.
const DefaultCopyUpByRangeMin = defaultRangeMn

var bootID = func() [16]byte {
	var id [16]byte
	b, err := os.ReadFile("/proc/sys/kernel/random/boot_id")
	s := strings.ReplaceAll(strings.TrimSpace(string(b)), "-", "")
	if err == nil && len(s) == 32 {
		for i := range 16 {
			v, err := strconv.ParseUint(s[2*i:2*i+2], 16, 8)
			if err != nil {
				break
			}
			id[i] = byte(v)
		}
		return id
	}
	// Unknown: a value no earlier boot wrote, so only synced records
	// are trusted after a restart.
	binary.LittleEndian.PutUint64(id[:], uint64(time.Now().UnixNano()))
	id[15] = 0xff
	return id
}()

// partial is one upper file copied up by range.
type partial struct {
	set       *partialSet
	name      string // of its map in the partial directory
	uino      uint64
	btime     uint64
	lower     archive.Inode
	lowerSize int64
	bs        int64
	path      string // at copy-up, for status
	// lowerMtime is the lower file's mtime (ns) the map was made for.
	lowerMtime int64

	verified atomic.Bool  // the upper inode's birth time was checked
	lastFg   atomic.Int64 // UnixNano of the last foreground copy or read

	flushMu sync.Mutex // serialises flushes
	// wmu is held shared by changes of the file's bytes (write,
	// fallocate, truncate) and exclusively by a batch of the background
	// copy, which puts the file's times back as they were: copying in is
	// no change of the file.
	wmu sync.RWMutex

	mu       sync.Mutex
	present  []uint64 // bitmap of blocks copied in
	limit    int64    // lower bytes at or past it never show
	missing  int64    // blocks still to copy
	cursor   int64    // where the background copy looks next
	mapFd    int      // append-only map; -1 on a read-only mount
	unsynced bool     // records appended since the last sync record
	done     bool     // no longer tracked: an ordinary upper file
	complete bool     // every block is in; the map stays for its changes
	running  bool     // a background copy runs
	broken   error    // the lower file is not the one copied from
	orphan   bool     // its last name went: copies are no longer recorded
	// gone: its last name went; once its inode is freed, the upper file
	// system may give the number to another file, which must not be
	// taken for it.
	gone bool
	// recName is the file's path in the upper layer as the map says it
	// (partial_names.go), if nameKnown.
	recName   string
	nameKnown bool

	// What load found, for openPartialSet (partial_names.go).
	loaded loadInfo

	// Which bytes may differ from the lower file's (partial_changes.go);
	// p.mu guards them.
	changes changeState
}

// loadInfo is what a map read at mount says about its file's identity.
type loadInfo struct {
	self     [2]uint64 // the map file's inode number and birth time at its creation
	hasSelf  bool
	gone     bool   // the file lost its last name
	lastName string // the last name it was known by, for messages

	// The last session of changes (partial_changes.go): open (recOpen
	// last, in this boot or not), or closed with the file's ctime.
	sessOpen     bool
	sessThisBoot bool
	closed       bool
	closeCtime   int64
}

// partialSet is the mount's partial files by upper inode number.
type partialSet struct {
	ov    *overlay
	count atomic.Int64 // live entries: the name paths check it first
	// open counts the live entries not complete: the I/O paths that
	// read or copy in check it first.
	open atomic.Int64
	// lastFg is when the mount last served a file's I/O (UnixNano), noted
	// only while partial files exist: background copies slow down then.
	lastFg atomic.Int64
	mu     sync.Mutex
	m      map[uint64]*partial
	dir    int // descriptor of the partial directory; -1 if none
	stop   chan struct{}
	wg     sync.WaitGroup
	// pause is the background copy's pause between batches.
	pause time.Duration
	// nameMu orders the changes of partial files' names
	// (partial_names.go).
	nameMu sync.RWMutex
	// held, while not nil, stops background copies before their next
	// batch until it is closed (setHold; tests reach the partial states
	// this way instead of racing the copy).
	holdMu sync.Mutex
	held   chan struct{}
}

// setHold stops (on) or lets go on (off) the background copies: a held
// copy waits before its next batch.
func (s *partialSet) setHold(on bool) {
	if s == nil {
		return
	}
	s.holdMu.Lock()
	defer s.holdMu.Unlock()
	switch {
	case on && s.held == nil:
		s.held = make(chan struct{})
	case !on && s.held != nil:
		close(s.held)
		s.held = nil
	}
}

// waitHold waits while background copies are held; false if the mount
// stops meanwhile.
func (s *partialSet) waitHold() bool {
	for {
		s.holdMu.Lock()
		ch := s.held
		s.holdMu.Unlock()
		if ch == nil {
			return true
		}
		select {
		case <-s.stop:
			return false
		case <-ch:
		}
	}
}

func (p *partial) lowerEnd() int64 { return min(p.lowerSize, p.limit) }

// needs reports whether block i must still be copied in. p.mu is held.
func (p *partial) needs(i int64) bool {
	if i*p.bs >= p.lowerEnd() {
		return false
	}
	return p.present[i/64]&(1<<(i%64)) == 0
}

func (p *partial) nblocks() int64 { return (p.lowerSize + p.bs - 1) / p.bs }

// recount sets missing from the bitmap and the limit. p.mu is held.
func (p *partial) recount() {
	var k int64
	for i := int64(0); i < p.nblocks(); i++ {
		if p.needs(i) {
			k++
		}
	}
	p.missing = k
}

// openPartialSet opens (or, unless readOnly, creates) the partial
// directory and loads the maps in it.
func openPartialSet(ov *overlay, rootFd int, readOnly bool) (*partialSet, error) {
	s := &partialSet{ov: ov, m: map[uint64]*partial{}, dir: -1, stop: make(chan struct{}), pause: time.Millisecond}
	if !readOnly {
		if err := unix.Mkdirat(rootFd, partialDirName, 0o700); err != nil && err != unix.EEXIST {
			return nil, fmt.Errorf("create %s: %w", partialDirName, err)
		}
	}
	fd, err := unix.Openat(rootFd, partialDirName, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err == unix.ENOENT && readOnly {
		return s, nil
	}
	if err != nil {
		return nil, fmt.Errorf("open %s: %w", partialDirName, err)
	}
	s.dir = fd
	names, err := readNames(fd)
	if err != nil {
		return nil, fmt.Errorf("list %s: %w", partialDirName, err)
	}
	var loaded []*partial
	for _, name := range names {
		if strings.HasPrefix(name, rebindPrefix) {
			if !readOnly {
				unix.Unlinkat(fd, name, 0)
			}
			continue
		}
		p, err := s.load(name, readOnly)
		if err != nil {
			ov.log.Error("partial copy-up: unreadable present-map; the file reads as the lower layer where unknown", "map", name, "err", err)
			continue
		}
		if p == nil {
			continue
		}
		loaded = append(loaded, p)
	}
	if err := s.settle(loaded, readOnly); err != nil {
		for _, p := range loaded {
			if p.mapFd >= 0 {
				unix.Close(p.mapFd)
				p.mapFd = -1
			}
		}
		s.close()
		return nil, err
	}
	s.recountLocked()
	return s, nil
}

func (s *partialSet) close() {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, p := range s.m {
		if p.mapFd >= 0 {
			unix.Close(p.mapFd)
			p.mapFd = -1
		}
	}
	if s.dir >= 0 {
		unix.Close(s.dir)
		s.dir = -1
	}
}

func mapName(uino, btime uint64) string {
	return strconv.FormatUint(uino, 10) + "-" + strconv.FormatUint(btime, 10)
}

// hdrTracksChanges, in the header's flags, says that the map records
// which bytes may differ from the lower file's since its creation
// (partial_changes.go).
const hdrTracksChanges = 1

func encodeHeader(p *partial, lowerMtime int64, flags uint32) []byte {
	h := make([]byte, partialHdrLen)
	copy(h, partialMagic)
	le := binary.LittleEndian
	le.PutUint64(h[8:], p.uino)
	le.PutUint64(h[16:], p.btime)
	le.PutUint64(h[24:], uint64(p.lower))
	le.PutUint64(h[32:], uint64(p.lowerSize))
	le.PutUint64(h[40:], uint64(p.bs))
	le.PutUint64(h[48:], uint64(lowerMtime))
	le.PutUint32(h[56:], flags)
	le.PutUint32(h[60:], crc32.ChecksumIEEE(h[:60]))
	return h
}

func encodeRec(kind byte, v int64) []byte {
	r := make([]byte, partialRecLen)
	r[0] = kind
	binary.LittleEndian.PutUint64(r[8:], uint64(v))
	copy(r[16:], bootID[:])
	binary.LittleEndian.PutUint32(r[4:], crc32.ChecksumIEEE(r[8:]))
	return r
}

// encodePayload is a record whose 24 bytes after the CRC are payload.
func encodePayload(kind byte, payload []byte) []byte {
	r := make([]byte, partialRecLen)
	r[0] = kind
	copy(r[8:], payload)
	binary.LittleEndian.PutUint32(r[4:], crc32.ChecksumIEEE(r[8:]))
	return r
}

// encodeSelf is the self record of a map file with status st.
func encodeSelf(st *ustat) []byte {
	var b [16]byte
	binary.LittleEndian.PutUint64(b[:], st.ino)
	binary.LittleEndian.PutUint64(b[8:], st.btime)
	return encodePayload(recSelf, b[:])
}

// encodeName is the name records of path name, or of an unknown name.
func encodeName(name string, known bool) []byte {
	if !known {
		return encodeRec(recName, 0)
	}
	b := encodeRec(recName, int64(len(name)))
	for i := 0; i < len(name); i += recPayload {
		b = append(b, encodePayload(recNameData, []byte(name[i:min(i+recPayload, len(name))]))...)
	}
	return b
}

// load reads one map. A name that is not a map is ignored (nil).
func (s *partialSet) load(name string, readOnly bool) (*partial, error) {
	ino, bt, ok := strings.Cut(name, "-")
	if !ok {
		return nil, nil
	}
	if _, err := strconv.ParseUint(ino, 10, 64); err != nil {
		return nil, nil
	}
	if _, err := strconv.ParseUint(bt, 10, 64); err != nil {
		return nil, nil
	}
	mode := unix.O_RDWR | unix.O_APPEND
	if readOnly {
		mode = unix.O_RDONLY
	}
	fd, err := unix.Openat(s.dir, name, mode|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, err
	}
	f := os.NewFile(uintptr(fd), name)
	b, err := io.ReadAll(io.NewSectionReader(f, 0, 1<<40))
	if err != nil {
		f.Close()
		return nil, err
	}
	le := binary.LittleEndian
	if len(b) < partialHdrLen || string(b[:8]) != partialMagic || le.Uint32(b[60:]) != crc32.ChecksumIEEE(b[:60]) {
		f.Close()
		return nil, errors.New("bad header")
	}
	p := &partial{
		set: s, name: name,
		uino: le.Uint64(b[8:]), btime: le.Uint64(b[16:]),
		lower: archive.Inode(le.Uint64(b[24:])), lowerSize: int64(le.Uint64(b[32:])), bs: int64(le.Uint64(b[40:])),
		mapFd: -1,
	}
	if p.bs <= 0 || p.lowerSize < 0 || mapName(p.uino, p.btime) != name {
		f.Close()
		return nil, errors.New("bad header")
	}
	mtime := int64(le.Uint64(b[48:]))
	p.limit = p.lowerSize
	p.present = make([]uint64, (p.nblocks()+63)/64)
	p.lowerMtime = mtime
	p.changes.init(p.lowerSize, le.Uint32(b[56:])&hdrTracksChanges != 0)
	var pending []int64 // present records of earlier boots not yet covered by a sync
	valid := func(r []byte) bool { return le.Uint32(r[4:]) == crc32.ChecksumIEEE(r[8:]) }
records:
	for off := partialHdrLen; off+partialRecLen <= len(b); off += partialRecLen {
		r := b[off : off+partialRecLen]
		if !valid(r) {
			break // a torn tail
		}
		v := int64(le.Uint64(r[8:]))
		thisBoot := [16]byte(r[16:32]) == bootID
		switch r[0] {
		case recSelf:
			p.loaded.self = [2]uint64{le.Uint64(r[8:]), le.Uint64(r[16:])}
			p.loaded.hasSelf = true
		case recName:
			if v <= 0 {
				p.recName, p.nameKnown = "", false
				break
			}
			k := (int(v) + recPayload - 1) / recPayload
			if v > 1<<20 || off+(k+1)*partialRecLen > len(b) {
				break records // torn
			}
			name := make([]byte, 0, k*recPayload)
			for j := 1; j <= k; j++ {
				d := b[off+j*partialRecLen : off+(j+1)*partialRecLen]
				if !valid(d) || d[0] != recNameData {
					break records
				}
				name = append(name, d[8:]...)
			}
			p.recName, p.nameKnown = string(name[:v]), true
			p.loaded.lastName = p.recName
			off += k * partialRecLen
		case recGone:
			p.loaded.gone = true
		case recPresent:
			if v < 0 || v >= p.nblocks() {
				continue
			}
			if thisBoot {
				p.present[v/64] |= 1 << (v % 64)
			} else {
				pending = append(pending, v)
			}
		case recSync:
			for _, i := range pending {
				p.present[i/64] |= 1 << (i % 64)
			}
			pending = pending[:0]
		case recLimit:
			p.limit = min(p.limit, max(v, 0))
		case recChanged, recCut, recOpen, recClose:
			p.loadChange(r[0], v, thisBoot)
		}
	}
	if s.ov.lower == nil {
		p.broken = errors.New("no lower layer")
	} else if la, err := s.ov.lower.Stat(p.lower); err != nil || la.Size != p.lowerSize || la.Mtime.UnixNano() != mtime || !la.Mode.IsRegular() {
		p.broken = fmt.Errorf("lower inode %d is not the file upper inode %d was copied from", p.lower, p.uino)
	}
	if readOnly {
		f.Close()
	} else {
		// Keep the descriptor; os.File must not close it.
		dup, err := unix.Dup(fd)
		f.Close()
		if err != nil {
			return nil, err
		}
		unix.CloseOnExec(dup)
		p.mapFd = dup
	}
	p.recount()
	p.complete = p.missing == 0
	return p, nil
}

// create writes the map of a new partial file (upper inode st, made
// from lower inode ino with attributes la) durably, before the file gets
// its name. Without a map an upper file is whole.
func (s *partialSet) create(st *ustat, ino archive.Inode, la *archive.Attr, bs int64, path string) (*partial, error) {
	if s.dir < 0 {
		return nil, syscall.EROFS
	}
	p := &partial{set: s, uino: st.ino, btime: st.btime, lower: ino, lowerSize: la.Size, bs: bs, path: path, mapFd: -1, lowerMtime: la.Mtime.UnixNano()}
	p.name = mapName(p.uino, p.btime)
	p.limit = p.lowerSize
	p.present = make([]uint64, (p.nblocks()+63)/64)
	p.recount()
	p.changes.init(p.lowerSize, true)
	p.verified.Store(true)
	// Left over by a crash after an earlier inode of the same number and
	// birth time? Impossible; but a stale map must not be appended to.
	unix.Unlinkat(s.dir, p.name, 0)
	fd, err := unix.Openat(s.dir, p.name, unix.O_CREAT|unix.O_EXCL|unix.O_RDWR|unix.O_APPEND|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return nil, err
	}
	// The header, the map's own identity and the file's name (where
	// the copy-up puts it; copyUp records another if a rename moved it
	// meanwhile).
	self, err := statFd(fd)
	if err != nil {
		unix.Close(fd)
		unix.Unlinkat(s.dir, p.name, 0)
		return nil, err
	}
	p.recName, p.nameKnown = path, true
	head := append(encodeHeader(p, p.lowerMtime, hdrTracksChanges), encodeSelf(&self)...)
	head = append(head, encodeName(path, true)...)
	// Its first session of changes, durable with the rest.
	head = append(head, p.openSession()...)
	if err := pwriteAll(fd, head, 0); err != nil {
		unix.Close(fd)
		unix.Unlinkat(s.dir, p.name, 0)
		return nil, err
	}
	if err := unix.Fdatasync(fd); err != nil {
		unix.Close(fd)
		unix.Unlinkat(s.dir, p.name, 0)
		return nil, err
	}
	if err := fsyncDir(s.dir); err != nil {
		unix.Close(fd)
		unix.Unlinkat(s.dir, p.name, 0)
		return nil, err
	}
	p.mapFd = fd
	return p, nil
}

// add registers p once its file has its name.
func (s *partialSet) add(p *partial) {
	s.mu.Lock()
	s.m[p.uino] = p
	s.recountLocked()
	s.mu.Unlock()
}

// discard removes the map of p, whose file never got its name.
func (s *partialSet) discard(p *partial) {
	if p.mapFd >= 0 {
		unix.Close(p.mapFd)
		p.mapFd = -1
	}
	unix.Unlinkat(s.dir, p.name, 0)
}

// get returns the partial state of the upper file open at fd, whose inode
// number is uino (0: stat fd), or nil if the file is whole.
func (s *partialSet) get(uino uint64, fd int) *partial {
	if s == nil || s.open.Load() == 0 {
		return nil
	}
	p := s.lookup(uino, fd)
	if p == nil {
		return nil
	}
	p.mu.Lock()
	done := p.done || p.complete
	p.mu.Unlock()
	if done {
		return nil
	}
	return p
}

// track returns the map of the upper file open at fd, whose inode number
// is uino (0: stat fd), complete or not, or nil if it has none: a change
// of the file's bytes records itself there first (partial_changes.go).
func (s *partialSet) track(uino uint64, fd int) *partial {
	if s == nil || s.count.Load() == 0 {
		return nil
	}
	p := s.lookup(uino, fd)
	if p == nil {
		return nil
	}
	p.mu.Lock()
	done := p.done
	p.mu.Unlock()
	if done {
		return nil
	}
	return p
}

// lookup finds the map of the upper file open at fd (inode number uino,
// 0: stat fd), checked against the file the first time.
func (s *partialSet) lookup(uino uint64, fd int) *partial {
	if uino == 0 {
		st, err := statFd(fd)
		if err != nil {
			return nil
		}
		uino = st.ino
	}
	s.mu.Lock()
	p := s.m[uino]
	s.mu.Unlock()
	if p == nil {
		return nil
	}
	p.mu.Lock()
	gone := p.gone
	p.mu.Unlock()
	switch {
	case gone:
		// Not verify: a map of another inode of the number is not
		// this one's to drop.
		st, err := statFd(fd)
		if err != nil || !p.is(&st) {
			return nil
		}
	case !p.verified.Load():
		st, err := statFd(fd)
		if err != nil || !s.verify(p, &st) {
			return nil
		}
	}
	return p
}

// recountLocked sets count and open from the set. s.mu is held.
func (s *partialSet) recountLocked() {
	var open int64
	for _, p := range s.m {
		p.mu.Lock()
		if !p.complete && !p.done {
			open++
		}
		p.mu.Unlock()
	}
	s.count.Store(int64(len(s.m)))
	s.open.Store(open)
}

// fillBlocks reports a partial file's blocks as if its lower content were
// all in: what it takes once complete, and what du expects of a file
// without holes.
func (s *partialSet) fillBlocks(a *fuse.Attr, st *ustat) {
	if s == nil || s.open.Load() == 0 {
		return
	}
	s.mu.Lock()
	p := s.m[st.ino]
	s.mu.Unlock()
	if p == nil || !p.verified.Load() || p.btime != st.btime {
		return
	}
	p.mu.Lock()
	if !p.done && !p.complete {
		a.Blocks = max(a.Blocks, uint64(min(p.lowerEnd(), st.size)+511)/512)
	}
	p.mu.Unlock()
}

// verify checks, the first time a map loaded at mount meets its file
// (status st), that the file is the one it describes, and bounds its
// limit by the file's size. A map of an earlier inode of the same number
// (its file went while no daemon watched) is removed.
func (s *partialSet) verify(p *partial, st *ustat) bool {
	if st.ino != p.uino {
		return false
	}
	if st.btime != p.btime {
		p.mu.Lock()
		gone := p.gone
		p.mu.Unlock()
		if !gone {
			// A map of an earlier inode of the number, left while no
			// daemon watched.
			s.drop(p, true)
		}
		return false
	}
	p.mu.Lock()
	if !p.verified.Load() {
		p.limit = min(p.limit, st.size)
		p.recount()
		p.beginSession(st)
		p.verified.Store(true)
	}
	p.mu.Unlock()
	return true
}

// resume starts the background copy of a file loaded partial at mount
// when the kernel first looks it up (status st, node n, named name in
// upper directory dfd), so that it completes without waiting for an open,
// and records the name if its map does not know it.
func (s *partialSet) resume(st *ustat, n *node, dfd int, name string) {
	if s == nil || s.count.Load() == 0 || st.mode&syscall.S_IFMT != syscall.S_IFREG {
		return
	}
	s.mu.Lock()
	p := s.m[st.ino]
	s.mu.Unlock()
	if p == nil || !s.verify(p, st) {
		return
	}
	s.noteName(p, dfd, name)
	s.startCompletion(p, n)
}

// drop forgets p and, with removeMap, removes its map durably.
func (s *partialSet) drop(p *partial, removeMap bool) {
	s.mu.Lock()
	if s.m[p.uino] == p {
		delete(s.m, p.uino)
	}
	s.recountLocked()
	s.mu.Unlock()
	p.mu.Lock()
	p.done = true
	if p.mapFd >= 0 {
		unix.Close(p.mapFd)
		p.mapFd = -1
	}
	p.mu.Unlock()
	if removeMap && s.dir >= 0 {
		unix.Unlinkat(s.dir, p.name, 0)
		fsyncDir(s.dir)
	}
}

// appendRec appends one record. p.mu is held.
func (p *partial) appendRec(kind byte, v int64) error {
	return p.appendRecs(encodeRec(kind, v))
}

// appendRecs appends records, in one write. p.mu is held.
func (p *partial) appendRecs(r []byte) error {
	if p.mapFd < 0 {
		if p.orphan {
			return nil // no name: nothing to recover after a crash
		}
		return syscall.EROFS
	}
	for {
		k, err := unix.Write(p.mapFd, r)
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			return fmt.Errorf("present-map: %w", err)
		}
		if k != len(r) {
			return fmt.Errorf("present-map: short write")
		}
		return nil
	}
}

// copyIn copies block i from the lower layer into the upper file open at
// fd and records it. p.mu is held.
func (p *partial) copyIn(fd int, i int64, buf []byte) error {
	if p.broken != nil {
		return p.broken
	}
	lo := i * p.bs
	hi := min(lo+p.bs, p.lowerEnd())
	want := buf[:hi-lo]
	k, err := p.set.ov.readLower(p.lower, want, lo)
	if k == len(want) {
		err = nil
	} else if err == nil || err == io.EOF {
		err = fmt.Errorf("short lower read at %d", lo+int64(k))
	}
	if err != nil {
		return fmt.Errorf("copy in block %d: %w", i, err)
	}
	if err := pwriteAll(fd, want, lo); err != nil {
		return fmt.Errorf("copy in block %d: %w", i, err)
	}
	if err := p.appendRec(recPresent, i); err != nil {
		return err
	}
	p.present[i/64] |= 1 << (i % 64)
	p.missing--
	p.unsynced = true
	return nil
}

// ensure copies in the blocks [off, end) touches that are not in yet, so
// that a change of those bytes can apply to the upper file open at fd.
func (p *partial) ensure(fd int, off, end int64) error {
	if end <= off {
		return nil
	}
	p.lastFg.Store(time.Now().UnixNano())
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.done || p.complete {
		return nil
	}
	var buf []byte
	for i := off / p.bs; i*p.bs < end && i < p.nblocks(); i++ {
		if !p.needs(i) {
			continue
		}
		if buf == nil {
			buf = make([]byte, p.bs)
		}
		if err := p.copyIn(fd, i, buf); err != nil {
			return err
		}
	}
	return nil
}

// ensureAll copies in every block (before a change that moves bytes
// between offsets: collapse or insert range).
func (p *partial) ensureAll(fd int) error {
	return p.ensure(fd, 0, p.lowerSize)
}

// readAt reads the merged content of the partial file open at fd (for
// reading) into buf at off: copied blocks from the upper file, the others
// from the lower layer. It returns fewer bytes only at the end of the file.
func (p *partial) readAt(fd int, buf []byte, off int64) (int, error) {
	p.lastFg.Store(time.Now().UnixNano())
	type seg struct{ lo, hi int64 }
	var segs []seg
	end := off + int64(len(buf))
	p.mu.Lock()
	if !p.done && !p.complete {
		le := p.lowerEnd()
		for i := off / p.bs; i*p.bs < min(end, le); i++ {
			if !p.needs(i) {
				continue
			}
			// A block cut by a truncation holds lower bytes only up
			// to the cut; past it (up to a later growth) the upper
			// file's zeros. A read starting past the cut takes
			// nothing of it from the lower layer.
			lo, hi := max(i*p.bs, off), min((i+1)*p.bs, end, le)
			if lo >= hi {
				continue
			}
			if n := len(segs); n > 0 && segs[n-1].hi == lo {
				segs[n-1].hi = hi
			} else {
				segs = append(segs, seg{lo, hi})
			}
		}
	}
	broken := p.broken
	p.mu.Unlock()
	k, err := preadFull(fd, buf, off)
	if err != nil {
		return 0, err
	}
	if len(segs) > 0 && broken != nil {
		return 0, broken
	}
	for _, s := range segs {
		if s.lo >= off+int64(k) {
			break
		}
		hi := min(s.hi, off+int64(k))
		want := buf[s.lo-off : hi-off]
		n, err := p.set.ov.readLower(p.lower, want, s.lo)
		if n < len(want) {
			if err == nil || err == io.EOF {
				err = fmt.Errorf("short lower read at %d", s.lo+int64(n))
			}
			return 0, err
		}
	}
	return k, nil
}

// fuseRead answers a FUSE read of the partial file open at fd.
func (p *partial) fuseRead(fd int, dest []byte, off int64) (fuse.ReadResult, syscall.Errno) {
	k, err := p.readAt(fd, dest, off)
	if err != nil {
		p.set.ov.log.Error("partial copy-up: read failed", "upper_ino", p.uino, "off", off, "err", err)
		return nil, syscall.EIO
	}
	return fuse.ReadResultData(dest[:k]), 0
}

// flush makes the copied blocks durable and says so in the map: the upper
// file's data first, then a sync record, then the map.
func (p *partial) flush(fd int) error {
	p.flushMu.Lock()
	defer p.flushMu.Unlock()
	p.mu.Lock()
	dirty := p.unsynced && p.mapFd >= 0
	p.unsynced = false
	p.mu.Unlock()
	if !dirty {
		return nil
	}
	fail := func(err error) error {
		p.mu.Lock()
		p.unsynced = true
		p.mu.Unlock()
		return fmt.Errorf("partial copy-up: sync: %w", err)
	}
	if err := unix.Fdatasync(fd); err != nil {
		return fail(err)
	}
	p.mu.Lock()
	err := p.appendRec(recSync, 0)
	mfd := p.mapFd
	p.mu.Unlock()
	if err != nil {
		return fail(err)
	}
	if mfd >= 0 {
		if err := unix.Fdatasync(mfd); err != nil {
			return fail(err)
		}
	}
	return nil
}

// truncate shrinks the limit to size (if lower) for the file open at fd,
// which the caller truncates right after: ftruncate, made durable, then
// the record. Called under the gate.
func (p *partial) truncate(fd int, size int64) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.done || size >= p.limit {
		return nil
	}
	if p.complete {
		// No lower byte is read any more: the truncation only changes
		// bytes (partial_changes.go), recorded before it is made.
		return p.noteCutLocked(size)
	}
	if err := unix.Ftruncate(fd, size); err != nil {
		return err
	}
	if err := unix.Fdatasync(fd); err != nil {
		return err
	}
	if err := p.appendRec(recLimit, size); err != nil {
		return err
	}
	if p.mapFd >= 0 {
		if err := unix.Fdatasync(p.mapFd); err != nil {
			return err
		}
	}
	p.limit = size
	p.recount()
	return nil
}

// complete runs the background copy of p for node n until every block is
// in (then the file is an ordinary upper file), the file is gone, or the
// mount ends.
func (s *partialSet) startCompletion(p *partial, n *node) {
	if s.ov.opts.ReadOnly || p.broken != nil {
		return
	}
	p.mu.Lock()
	if p.running || p.done || p.complete {
		p.mu.Unlock()
		return
	}
	p.running = true
	p.mu.Unlock()
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		err := s.complete(p, n)
		p.mu.Lock()
		p.running = false
		p.mu.Unlock()
		if err != nil {
			s.ov.log.Warn("partial copy-up: background copy stopped", "upper_ino", p.uino, "err", err)
		}
	}()
}

// completionBatch is how many blocks the background copy takes between
// pauses; busyPause multiplies the pause while the mount is busy.
const (
	completionBatch = 4
	busyPause       = 10
)

// A background copy starts once the mount's file I/O has paused for
// completionIdle, and at the latest completionStartMax after it was asked.
const (
	completionIdle     = 100 * time.Millisecond
	completionStartMax = time.Second
)

// foreground notes file I/O being served, for the background copies.
func (s *partialSet) foreground() {
	if s != nil && s.open.Load() > 0 {
		s.lastFg.Store(time.Now().UnixNano())
	}
}

func (s *partialSet) complete(p *partial, n *node) error {
	fd, errno := n.openUpper(true)
	for t0 := time.Now(); errno == syscall.ESTALE && time.Since(t0) < completionStartMax; {
		// A lookup resumes the copy before go-fuse has linked the
		// node to its parent (that happens once Lookup returns): the
		// node has no name for a moment.
		select {
		case <-s.stop:
			return nil
		case <-time.After(10 * time.Millisecond):
		}
		fd, errno = n.openUpper(true)
	}
	if errno == syscall.ENOENT || errno == syscall.ESTALE {
		// Gone from its name before its copy started (deleted, or a
		// rename under way): the next lookup of it resumes the copy,
		// and a mount drops the map of a file that no longer exists.
		s.ov.log.Debug("partial copy-up: file gone before its background copy", "upper_ino", p.uino, "err", errno)
		return nil
	}
	if errno != 0 {
		return errno
	}
	defer unix.Close(fd)
	if st, err := statFd(fd); err != nil || st.ino != p.uino {
		return fmt.Errorf("upper file of inode %d not found", p.uino)
	}
	// Start once file I/O has paused: the write that made the file
	// partial is usually the first of a transaction, whose commit should
	// not share the disk and the cores with copying the rest in.
	start := time.Now()
	for {
		idle := time.Since(time.Unix(0, max(p.lastFg.Load(), s.lastFg.Load())))
		wait := min(completionIdle-idle, completionStartMax-time.Since(start))
		if wait <= 0 {
			break
		}
		select {
		case <-s.stop:
			return nil
		case <-time.After(wait):
		}
	}
	buf := make([]byte, p.bs)
	for {
		select {
		case <-s.stop:
			return nil
		default:
		}
		if !s.waitHold() {
			return nil
		}
		st, err := statFd(fd)
		if err != nil {
			return err
		}
		if st.nlink == 0 {
			// Deleted: nothing to complete; open handles keep reading
			// merged content from memory's map.
			s.mu.Lock()
			p.mu.Lock()
			if p.mapFd >= 0 {
				unix.Close(p.mapFd)
				p.mapFd = -1
			}
			p.orphan, p.gone = true, true
			p.mu.Unlock()
			s.mu.Unlock()
			unix.Unlinkat(s.dir, p.name, 0)
			return nil
		}
		p.wmu.Lock()
		before, serr := statFd(fd)
		copied := false
		for range completionBatch {
			p.mu.Lock()
			if p.done || p.complete || p.missing == 0 {
				p.mu.Unlock()
				break
			}
			nb := p.nblocks()
			for p.cursor < nb && !p.needs(p.cursor) {
				p.cursor++
			}
			if p.cursor >= nb {
				p.cursor = 0
				p.mu.Unlock()
				continue
			}
			err := p.copyIn(fd, p.cursor, buf)
			p.mu.Unlock()
			if err != nil {
				p.wmu.Unlock()
				return err
			}
			copied = true
		}
		if copied && serr == nil {
			futimens(fd, []unix.Timespec{before.atime, before.mtime})
		}
		p.wmu.Unlock()
		p.mu.Lock()
		left, done := p.missing, p.done || p.complete
		p.mu.Unlock()
		if done {
			return nil
		}
		if left == 0 {
			if err := p.flush(fd); err != nil {
				return err
			}
			p.mu.Lock()
			complete := p.missing == 0
			p.mu.Unlock()
			if complete {
				s.completed(p)
				s.ov.log.Info("partial copy-up complete", "upper_ino", p.uino, "path", p.path)
				return nil
			}
			continue
		}
		// Yield to the foreground: a pause per batch, much longer
		// while the mount serves reads and writes.
		pause := s.pause
		if time.Since(time.Unix(0, max(p.lastFg.Load(), s.lastFg.Load()))) < 20*time.Millisecond {
			pause *= busyPause
		}
		select {
		case <-s.stop:
			return nil
		case <-time.After(pause):
		}
	}
}

// stopAll ends the background copies and waits for them.
func (s *partialSet) stopAll() {
	if s == nil {
		return
	}
	s.mu.Lock()
	select {
	case <-s.stop:
	default:
		close(s.stop)
	}
	s.mu.Unlock()
	s.wg.Wait()
}

// PartialCopyUp is the progress of one file copied up by range.
type PartialCopyUp struct {
	Path      string `json:"path,omitempty"` // as its map records it (at copy-up if unknown since; empty if neither)
	UpperIno  uint64 `json:"upper_ino"`
	Size      int64  `json:"size"`   // bytes of lower content it may still need
	Present   int64  `json:"copied"` // of those, bytes in the upper file
	Running   bool   `json:"running"`
	LowerGone bool   `json:"lower_mismatch,omitempty"`
}

// holdCopyUps holds (on) or lets go on (off) the mount's background
// copies of partial files; for tests.
func (m *Mounted) holdCopyUps(on bool) { m.ov.partials.setHold(on) }

// PartialCopyUps lists the files copied up by range that are not complete.
func (m *Mounted) PartialCopyUps() []PartialCopyUp {
	s := m.ov.partials
	if s == nil {
		return nil
	}
	s.mu.Lock()
	ps := make([]*partial, 0, len(s.m))
	for _, p := range s.m {
		ps = append(ps, p)
	}
	s.mu.Unlock()
	out := make([]PartialCopyUp, 0, len(ps))
	for _, p := range ps {
		p.mu.Lock()
		if p.complete || p.done {
			p.mu.Unlock()
			continue
		}
		le := p.lowerEnd()
		need := (le + p.bs - 1) / p.bs
		present := max(need-p.missing, 0) * p.bs
		path := p.path
		if p.nameKnown {
			path = p.recName
		}
		out = append(out, PartialCopyUp{Path: path, UpperIno: p.uino, Size: le, Present: min(present, le), Running: p.running, LowerGone: p.broken != nil})
		p.mu.Unlock()
	}
	sort.Slice(out, func(i, j int) bool { return out[i].UpperIno < out[j].UpperIno })
	return out
}
