package archive

import (
	"encoding/binary"
	"fmt"
	"math"
	"sort"
	"syscall"
	"time"
)

// Metadata is read where it is used: an inode when its number or a
// directory entry is looked up, a listing when its directory is listed or
// searched, a block list when its file is read. Every piece comes from
// metadata blocks read one at a time (the trailer gives each block's
// length, so one request reads it), checked against the trailer and kept
// decoded in the reader's metadata cache.

// mblock is a decoded metadata block.
type mblock struct {
	b []byte // its content
	n uint64 // its stored length, header included
}

// metaBlock returns the metadata block of kind at image offset off, in a
// table that ends at end.
func (r *Reader) metaBlock(off uint64, kind extentKind, end uint64) (*mblock, error) {
	v, err := r.meta.get(metaKey{k: mkBlock, a: off, b: uint64(kind)}, func() (any, int64, error) {
		m, err := r.loadMeta(off, kind, end)
		if err != nil {
			return nil, 0, err
		}
		return m, int64(cap(m.b)) + 64, nil
	})
	if err != nil {
		return nil, err
	}
	m := v.(*mblock)
	if off+m.n > end {
		return nil, r.corruptf(off, kind.String(), "block runs past the end of its table")
	}
	return m, nil
}

func (r *Reader) loadMeta(off uint64, kind extentKind, end uint64) (*mblock, error) {
	what := kind.String()
	if off >= end || end-off < 3 {
		return nil, r.corruptf(off, what, "metadata block outside its table")
	}
	var b []byte
	var err error
	if r.Checksummed() {
		bi, ok, err := r.blockAt(off)
		if err != nil {
			return nil, err
		}
		if !ok {
			return nil, r.corruptf(off, what, "no checksum recorded for a block at this offset")
		}
		if bi.kind != kind {
			return nil, r.corruptf(off, what, "the trailer records a %s here", bi.kind)
		}
		n := uint64(bi.length)
		if n < 3 || n > metaBlockSize+2 || n > end-off {
			return nil, r.corruptf(off, what, "block of %d bytes", n)
		}
		if b, err = r.readAt(off, n, what); err != nil {
			return nil, err
		}
		if crc32c(b) != bi.crc {
			return nil, r.corrupt(off, what, errChecksum)
		}
	} else if b, err = r.readAt(off, min(metaBlockSize+2, end-off), what); err != nil {
		return nil, err
	}
	h := binary.LittleEndian.Uint16(b)
	n := uint64(h &^ metaUncompBit)
	if n == 0 || n > metaBlockSize || n+2 > uint64(len(b)) || (r.Checksummed() && n+2 != uint64(len(b))) {
		return nil, r.corruptf(off, what, "metadata block length %d", n)
	}
	b = b[:n+2]
	if h&metaUncompBit != 0 {
		return &mblock{b: b[2:], n: n + 2}, nil
	}
	out, err := r.dec.decompress(nil, b[2:], metaBlockSize)
	if err != nil {
		return nil, r.corruptf(off, what, "decompress: %v", err)
	}
	return &mblock{b: out, n: n + 2}, nil
}

// metaPos is a position in a metadata table: the image offset of a block
// and an offset in its content.
type metaPos struct {
	blk uint64
	off int
}

// metaCursor reads a metadata table as the stream its blocks make, from
// a position on.
type metaCursor struct {
	r          *Reader
	kind       extentKind
	start, end uint64 // the table, as image offsets
	pos        metaPos
	m          *mblock
}

// cursor starts reading the table of kind at [start, end) at the
// reference (block relative to the table, offset in it); the offset must
// lie inside the block, as the kernel requires.
func (r *Reader) cursor(kind extentKind, start, end, blk uint64, off uint16) (*metaCursor, error) {
	if blk >= end-start {
		return nil, r.corruptf(start, kind.String(), "reference to block %d outside the table", blk)
	}
	c := &metaCursor{r: r, kind: kind, start: start, end: end, pos: metaPos{blk: start + blk, off: int(off)}}
	if err := c.load(); err != nil {
		return nil, err
	}
	if c.pos.off >= len(c.m.b) {
		return nil, r.corruptf(c.pos.blk, kind.String(), "offset %d past the block's %d bytes", off, len(c.m.b))
	}
	return c, nil
}

// resume continues reading at a position an earlier cursor reached.
func (r *Reader) resume(kind extentKind, start, end uint64, p metaPos) *metaCursor {
	return &metaCursor{r: r, kind: kind, start: start, end: end, pos: p}
}

func (c *metaCursor) load() error {
	if c.m != nil {
		return nil
	}
	m, err := c.r.metaBlock(c.pos.blk, c.kind, c.end)
	if err != nil {
		return err
	}
	c.m = m
	return nil
}

// read appends the next n bytes of the stream to dst.
func (c *metaCursor) read(dst []byte, n int) ([]byte, error) {
	for n > 0 {
		if err := c.load(); err != nil {
			return nil, err
		}
		if c.pos.off >= len(c.m.b) {
			c.pos = metaPos{blk: c.pos.blk + c.m.n}
			c.m = nil
			if c.pos.blk >= c.end {
				return nil, c.r.corruptf(c.start, c.kind.String(), "a read runs past the end of the table")
			}
			continue
		}
		k := min(n, len(c.m.b)-c.pos.off)
		dst = append(dst, c.m.b[c.pos.off:c.pos.off+k]...)
		c.pos.off += k
		n -= k
	}
	return dst, nil
}

// inode is a decoded inode.
type inode struct {
	typ   uint16 // as stored (basic or extended)
	perm  uint16
	uid   uint32
	gid   uint32
	mtime uint32
	ino   Inode
	nlink uint32
	size  uint64
	rdev  uint32
	ref   uint64 // where it is

	// From the trailer.
	ns     uint32
	sum    sum
	hasSum bool

	// regular files
	start   uint64
	frag    uint32
	fragOff uint32
	blocks  metaPos // where the block list starts
	// directories
	dirBlk uint32
	dirOff uint16
	parent uint32
	idxCnt uint16
	idxAt  metaPos // where the directory index starts
	// symlinks
	target string
}

const minInodeSize = 20 // the smallest inode (fifo, socket)

// inodeAt decodes the inode at ref, with what the trailer records of it.
func (r *Reader) inodeAt(ref uint64) (*inode, error) {
	in, err := r.inodeBare(ref)
	if err != nil {
		return nil, err
	}
	if err := r.inodeExtra(in); err != nil {
		return nil, err
	}
	return in, nil
}

// inodeBare decodes the inode at ref (its mtime's nanoseconds and content
// sum left out).
func (r *Reader) inodeBare(ref uint64) (*inode, error) {
	sb := &r.sb
	where := sb.InodeTable + refBlock(ref)
	bad := func(format string, a ...any) (*inode, error) {
		return nil, r.corruptf(where, "inode table block", "inode %#x: "+format, append([]any{ref}, a...)...)
	}
	c, err := r.cursor(kindInodeTable, sb.InodeTable, sb.DirTable, refBlock(ref), refOffset(ref))
	if err != nil {
		return nil, err
	}
	var buf [40]byte
	t, err := c.read(buf[:0], 16)
	if err != nil {
		return nil, err
	}
	le := binary.LittleEndian
	in := &inode{
		typ:   le.Uint16(t),
		perm:  le.Uint16(t[2:]),
		mtime: le.Uint32(t[8:]),
		ino:   Inode(le.Uint32(t[12:])),
		nlink: 1,
		ref:   ref,
	}
	uidx, gidx := le.Uint16(t[4:]), le.Uint16(t[6:])
	if int(uidx) >= len(r.ids) || int(gidx) >= len(r.ids) {
		return bad("owner index out of range")
	}
	in.uid, in.gid = r.ids[uidx], r.ids[gidx]
	if in.ino == 0 || uint32(in.ino) > sb.Inodes {
		return bad("inode number %d out of range", in.ino)
	}
	if in.perm&^0o7777 != 0 {
		return bad("mode %#o", in.perm)
	}
	fixed := map[uint16]int{typeDir: 16, typeLDir: 24, typeFile: 16, typeLFile: 40, typeSymlink: 8, typeLSymlink: 8,
		typeBlockDev: 8, typeCharDev: 8, typeLBlock: 8, typeLChar: 8,
		typeFifo: 4, typeSocket: 4, typeLFifo: 4, typeLSocket: 4}[in.typ]
	if fixed == 0 {
		return bad("unknown type %d", in.typ)
	}
	if t, err = c.read(buf[:0], fixed); err != nil {
		return nil, err
	}
	switch in.typ {
	case typeDir:
		in.dirBlk = le.Uint32(t)
		in.nlink = le.Uint32(t[4:])
		in.size = uint64(le.Uint16(t[8:]))
		in.dirOff = le.Uint16(t[10:])
		in.parent = le.Uint32(t[12:])
	case typeLDir:
		in.nlink = le.Uint32(t)
		in.size = uint64(le.Uint32(t[4:]))
		in.dirBlk = le.Uint32(t[8:])
		in.parent = le.Uint32(t[12:])
		in.idxCnt = le.Uint16(t[16:])
		in.dirOff = le.Uint16(t[18:])
		in.idxAt = c.pos
	case typeFile:
		in.start = uint64(le.Uint32(t))
		in.frag = le.Uint32(t[4:])
		in.fragOff = le.Uint32(t[8:])
		in.size = uint64(le.Uint32(t[12:]))
		in.blocks = c.pos
	case typeLFile:
		in.start = le.Uint64(t)
		in.size = le.Uint64(t[8:])
		in.nlink = le.Uint32(t[24:])
		in.frag = le.Uint32(t[28:])
		in.fragOff = le.Uint32(t[32:])
		in.blocks = c.pos
	case typeSymlink, typeLSymlink:
		in.nlink = le.Uint32(t)
		n := uint64(le.Uint32(t[4:]))
		if n == 0 || n > maxSymlinkLen {
			return bad("symlink target of %d bytes", n)
		}
		tb, err := c.read(nil, int(n))
		if err != nil {
			return nil, err
		}
		in.target = string(tb)
		in.size = n
	case typeBlockDev, typeCharDev, typeLBlock, typeLChar:
		in.nlink = le.Uint32(t)
		in.rdev = le.Uint32(t[4:])
	default:
		in.nlink = le.Uint32(t)
	}
	if in.size > math.MaxInt64 {
		return bad("size %d", in.size)
	}
	return in, nil
}

// inodeExtra fills in what the trailer records of in: its mtime's
// nanoseconds and content sum.
func (r *Reader) inodeExtra(in *inode) error {
	switch {
	case r.tr != nil:
		if i := int(in.ino) - 1; i < len(r.tr.mtimeNs) {
			in.ns = r.tr.mtimeNs[i]
		}
		if i := int(in.ino) - 1; i < len(r.tr.fileSums) {
			in.sum, in.hasSum = r.tr.fileSums[i], basicType(in.typ) == typeFile
		}
	case r.tr2 != nil:
		off := r.sb.InodeTable + refBlock(in.ref)
		pg, i, err := r.recordAt(off)
		if err != nil {
			return err
		}
		if pg == nil {
			return r.corruptf(off, "inode table block", "no checksum recorded for a block at this offset")
		}
		ents := pg.inos[pg.ino0[i]:pg.ino0[i+1]]
		want := refOffset(in.ref)
		k := sort.Search(len(ents), func(k int) bool { return ents[k].off >= want })
		if k == len(ents) || ents[k].off != want {
			return r.corruptf(off, "inode table block", "inode %#x: the trailer records no inode at offset %d", in.ref, want)
		}
		in.ns = ents[k].ns
		in.sum, in.hasSum = ents[k].sum, ents[k].hasSum
	}
	return nil
}

func (in *inode) attr() Attr {
	a := Attr{
		Ino:   in.ino,
		Mode:  goMode(in.perm, in.typ),
		Uid:   in.uid,
		Gid:   in.gid,
		Size:  int64(in.size),
		Nlink: in.nlink,
		Mtime: time.Unix(int64(in.mtime), int64(in.ns)),
	}
	if m := basicType(in.typ); m == typeBlockDev || m == typeCharDev {
		a.Rdev = decodeDev(in.rdev)
	}
	return a
}

// dirListing is a decoded directory listing.
type dirListing struct {
	ents []DirEntry
	refs []uint64
}

func (l *dirListing) cost() int64 {
	c := int64(64 + 48*len(l.ents))
	for _, e := range l.ents {
		c += int64(len(e.Name))
	}
	return c
}

// listingReader parses a listing from its stream, entry by entry,
// checking it as it goes: headers, entry types and inode numbers in
// range, names valid, sorted and unique.
type listingReader struct {
	r       *Reader
	c       *metaCursor
	d       *inode
	left    uint64 // bytes of the listing not read yet
	count   int    // entries left under the current header
	blk     uint32
	baseIno uint32
	prev    string
	first   bool
	buf     []byte
}

func (r *Reader) listingAt(d *inode, blk uint64, off uint16, skip uint64) (*listingReader, error) {
	if d.size < 3 {
		return nil, r.corruptf(r.sb.DirTable+uint64(d.dirBlk), "directory table block", "directory inode %d: size %d", d.ino, d.size)
	}
	n := d.size - 3
	lr := &listingReader{r: r, d: d, left: n - skip, first: true}
	if n == 0 {
		return lr, nil
	}
	if n > maxObject {
		return nil, r.corruptf(r.sb.DirTable+uint64(d.dirBlk), "directory table block", "directory inode %d: listing of %d bytes", d.ino, n)
	}
	c, err := r.cursor(kindDirTable, r.sb.DirTable, r.dirEnd, blk, off)
	if err != nil {
		return nil, err
	}
	lr.c = c
	return lr, nil
}

func (lr *listingReader) bad(format string, a ...any) error {
	return lr.r.corruptf(lr.r.sb.DirTable+uint64(lr.d.dirBlk), "directory table block",
		"directory inode %d: "+format, append([]any{lr.d.ino}, a...)...)
}

func (lr *listingReader) take(n int) ([]byte, error) {
	if uint64(n) > lr.left {
		return nil, lr.bad("truncated listing")
	}
	b, err := lr.c.read(lr.buf[:0], n)
	if err != nil {
		return nil, err
	}
	lr.buf = b
	lr.left -= uint64(n)
	return b, nil
}

// next returns the next entry; ok false at the listing's end.
func (lr *listingReader) next() (e DirEntry, ref uint64, ok bool, err error) {
	if lr.count == 0 {
		if lr.left == 0 {
			return e, 0, false, nil
		}
		h, err := lr.take(12)
		if err != nil {
			return e, 0, false, err
		}
		le := binary.LittleEndian
		cnt := uint64(le.Uint32(h)) + 1
		if cnt > dirMaxRun {
			return e, 0, false, lr.bad("header with %d entries", cnt)
		}
		lr.count, lr.blk, lr.baseIno = int(cnt), le.Uint32(h[4:]), le.Uint32(h[8:])
	}
	b, err := lr.take(8)
	if err != nil {
		return e, 0, false, err
	}
	le := binary.LittleEndian
	off := le.Uint16(b)
	delta := int16(le.Uint16(b[2:]))
	typ := le.Uint16(b[4:])
	nlen := int(le.Uint16(b[6:])) + 1
	if nlen > maxNameLen {
		return e, 0, false, lr.bad("name of %d bytes", nlen)
	}
	nb, err := lr.take(nlen)
	if err != nil {
		return e, 0, false, err
	}
	name := string(nb)
	lr.count--
	if !validName(name) {
		return e, 0, false, lr.bad("invalid name %q", name)
	}
	if !lr.first && name <= lr.prev {
		return e, 0, false, lr.bad("names not sorted or duplicated at %q", name)
	}
	lr.first, lr.prev = false, name
	ino := int64(lr.baseIno) + int64(delta)
	if ino <= 0 || ino > int64(lr.r.sb.Inodes) {
		return e, 0, false, lr.bad("entry %q names inode %d", name, ino)
	}
	if typ < typeDir || typ > typeSocket {
		return e, 0, false, lr.bad("entry %q has type %d", name, typ)
	}
	return DirEntry{Name: name, Ino: Inode(ino), Mode: typeMode(typ)}, inodeRef(uint64(lr.blk), off), true, nil
}

// listing returns directory d's listing, decoded (and kept).
func (r *Reader) listing(d *inode) (*dirListing, error) {
	if basicType(d.typ) != typeDir {
		return nil, fmt.Errorf("archive %s: inode %d: %w", r.name, d.ino, syscall.ENOTDIR)
	}
	key := metaKey{k: mkListing, a: uint64(d.dirBlk)<<16 | uint64(d.dirOff), b: d.size}
	v, err := r.meta.get(key, func() (any, int64, error) {
		lr, err := r.listingAt(d, uint64(d.dirBlk), d.dirOff, 0)
		if err != nil {
			return nil, 0, err
		}
		l := &dirListing{}
		for {
			e, ref, ok, err := lr.next()
			if err != nil {
				return nil, 0, err
			}
			if !ok {
				break
			}
			l.ents = append(l.ents, e)
			l.refs = append(l.refs, ref)
		}
		return l, l.cost(), nil
	})
	if err != nil {
		return nil, err
	}
	return v.(*dirListing), nil
}

// find looks name up in directory d: in its listing when it is cached or
// small, else from the entry the directory index points at (a metadata
// block or so of a large listing).
func (r *Reader) find(d *inode, name string) (DirEntry, uint64, bool, error) {
	key := metaKey{k: mkListing, a: uint64(d.dirBlk)<<16 | uint64(d.dirOff), b: d.size}
	v, cached := r.meta.peek(key)
	if cached || d.idxCnt == 0 {
		var l *dirListing
		if cached {
			l = v.(*dirListing)
		} else {
			var err error
			if l, err = r.listing(d); err != nil {
				return DirEntry{}, 0, false, err
			}
		}
		if i := sortedFind(l.ents, name); i >= 0 {
			return l.ents[i], l.refs[i], true, nil
		}
		return DirEntry{}, 0, false, nil
	}
	// The index: entries of (position in the listing, table block, name
	// of the first entry there), sorted by name.
	c := r.resume(kindInodeTable, r.sb.InodeTable, r.sb.DirTable, d.idxAt)
	var (
		at      uint64
		blk     = uint64(d.dirBlk)
		first   string
		haveIdx bool
		buf     []byte
		err     error
	)
	for range d.idxCnt {
		if buf, err = c.read(buf[:0], 12); err != nil {
			return DirEntry{}, 0, false, err
		}
		le := binary.LittleEndian
		idx, start, nlen := le.Uint32(buf), le.Uint32(buf[4:]), int(le.Uint32(buf[8:]))+1
		if nlen > maxNameLen {
			return DirEntry{}, 0, false, r.corruptf(r.sb.InodeTable+refBlock(d.ref), "inode table block", "directory inode %d: index name of %d bytes", d.ino, nlen)
		}
		if buf, err = c.read(buf[:0], nlen); err != nil {
			return DirEntry{}, 0, false, err
		}
		if string(buf) > name {
			break
		}
		at, blk, first, haveIdx = uint64(idx), uint64(start), string(buf), true
	}
	off := d.dirOff
	if haveIdx {
		// The kernel's arithmetic: the blocks a listing spans are full.
		if at == 0 || at >= d.size-3 || blk > uint64(math.MaxUint32) {
			return DirEntry{}, 0, false, r.corruptf(r.sb.InodeTable+refBlock(d.ref), "inode table block", "directory inode %d: index entry at %d", d.ino, at)
		}
		off = uint16((uint64(d.dirOff) + at) % metaBlockSize)
	}
	lr, err := r.listingAt(d, blk, off, at)
	if err != nil {
		return DirEntry{}, 0, false, err
	}
	for n := 0; ; n++ {
		e, ref, ok, err := lr.next()
		if err != nil || !ok {
			return DirEntry{}, 0, false, err
		}
		if n == 0 && haveIdx && e.Name != first {
			return DirEntry{}, 0, false, lr.bad("index names %q, the listing has %q there", first, e.Name)
		}
		if e.Name == name {
			return e, ref, true, nil
		}
		if e.Name > name {
			return DirEntry{}, 0, false, nil
		}
	}
}

// fragAt returns fragment table entry i.
func (r *Reader) fragAt(i uint32) (fragEntry, error) {
	if i >= r.sb.Fragments {
		return fragEntry{}, r.corruptf(r.sb.FragmentTable, "fragment table", "fragment %d of %d", i, r.sb.Fragments)
	}
	k := i / fragsPerBlock
	m, err := r.metaBlock(r.fragIdx[k], kindFragTable, r.sb.FragmentTable)
	if err != nil {
		return fragEntry{}, err
	}
	at := int(i%fragsPerBlock) * fragEntrySize
	if at+fragEntrySize > len(m.b) {
		return fragEntry{}, r.corruptf(r.fragIdx[k], "fragment table block", "holds %d bytes, fragment %d is at %d", len(m.b), i, at)
	}
	e := m.b[at:]
	return fragEntry{start: binary.LittleEndian.Uint64(e), word: binary.LittleEndian.Uint32(e[8:])}, nil
}
