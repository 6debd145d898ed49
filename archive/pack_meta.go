package archive

import (
	"encoding/binary"
	"fmt"
	iofs "io/fs"
	"math"
)

// metaWriter builds one metadata table in memory: a stream cut into 8 KiB
// pieces, each stored compressed (or as is when that is not smaller) behind
// a two-byte header. Tables are small next to the data, so they are kept
// until the data is written, as mksquashfs does.
type metaWriter struct {
	comp   blockCompressor
	kind   extentKind
	prefix uint64 // bytes of the table before this writer's first block (an extended image's base blocks)
	buf    []byte // the piece being filled, < metaBlockSize bytes
	out    []byte // finished blocks
	starts []uint64
	exts   []extent
	total  uint64 // uncompressed bytes written
	tmp    []byte
}

// pos is where the next byte goes: the start of its block in the table and
// the offset inside the uncompressed block.
func (m *metaWriter) pos() (uint64, uint16) { return m.prefix + uint64(len(m.out)), uint16(len(m.buf)) }

func (m *metaWriter) write(b []byte) error {
	m.total += uint64(len(b))
	for len(b) > 0 {
		n := min(len(b), metaBlockSize-len(m.buf))
		m.buf = append(m.buf, b[:n]...)
		b = b[n:]
		if len(m.buf) == metaBlockSize {
			if err := m.flush(); err != nil {
				return err
			}
		}
	}
	return nil
}

func (m *metaWriter) flush() error {
	if len(m.buf) == 0 {
		return nil
	}
	var payload []byte
	var hdr uint16
	c, ok, err := m.comp.compress(m.tmp, m.buf)
	if err != nil {
		return fmt.Errorf("compress metadata: %w", err)
	}
	if ok {
		m.tmp = c
		payload, hdr = c, uint16(len(c))
	} else {
		payload, hdr = m.buf, uint16(len(m.buf))|metaUncompBit
	}
	start := len(m.out)
	m.starts = append(m.starts, uint64(start))
	m.out = binary.LittleEndian.AppendUint16(m.out, hdr)
	m.out = append(m.out, payload...)
	blk := m.out[start:]
	m.exts = append(m.exts, extent{length: uint32(len(blk)), kind: m.kind, crc: crc32c(blk)})
	m.buf = m.buf[:0]
	return nil
}

// cut ends the block being filled short (formatProbe) and moves the
// stream position to the next block, as if it had been full.
func (m *metaWriter) cut() error {
	if len(m.buf) == 0 {
		return nil
	}
	m.total += uint64(metaBlockSize - len(m.buf))
	return m.flush()
}

// emit writes the finished table to out and returns where it started.
func (m *metaWriter) emit(out *output) (uint64, error) {
	if err := m.flush(); err != nil {
		return 0, err
	}
	start := out.pos
	b := m.out
	for _, e := range m.exts {
		out.write(b[:e.length], e.kind, e.crc)
		b = b[e.length:]
	}
	return start, out.err
}

// emitIndexed writes a table that is found through an index (an array of
// the absolute start of each of its blocks after the blocks), and returns
// the index's position, which is what the superblock points at.
func (m *metaWriter) emitIndexed(out *output) (uint64, error) {
	start, err := m.emit(out)
	if err != nil {
		return 0, err
	}
	idx := make([]byte, 0, 8*len(m.starts))
	for _, s := range m.starts {
		idx = binary.LittleEndian.AppendUint64(idx, start+s)
	}
	at := out.pos
	out.write(idx, kindIndex, 0)
	return at, out.err
}

type tables struct {
	inodes, dirs *metaWriter
	// inodeRecs lists, per inode table block, the inodes that start in
	// it, for the trailer.
	inodeRecs [][]inodeRec
	ids       []uint32
	idIndex   map[uint32]uint16
	export    []uint64
	written   []bool // by inode number

	// An extending pack's: the export entries it changes, and the
	// inodes it wrote, by number (the number space may be large).
	extend     bool
	exportMap  map[uint32]uint64
	writtenMap map[uint32]bool
}

func (t *tables) isWritten(ino uint32) bool {
	if t.extend {
		return t.writtenMap[ino]
	}
	return t.written[ino]
}

func (t *tables) id(v uint32) (uint16, error) {
	if i, ok := t.idIndex[v]; ok {
		return i, nil
	}
	if len(t.ids) > math.MaxUint16 {
		return 0, fmt.Errorf("more than %d distinct uids and gids", math.MaxUint16+1)
	}
	i := uint16(len(t.ids))
	t.ids = append(t.ids, v)
	t.idIndex[v] = i
	return i, nil
}

func (p *packer) writeTables(out *output, frags []fragEntry) (*superblock, error) {
	bc := p.codec.newWorker()
	t := &tables{
		inodes:  &metaWriter{comp: bc, kind: kindInodeTable},
		dirs:    &metaWriter{comp: bc, kind: kindDirTable},
		idIndex: map[uint32]uint16{},
		export:  make([]uint64, p.inodes),
		written: make([]bool, p.inodes+1),
	}
	if err := p.writeDir(t, p.root, p.inodes+1); err != nil {
		return nil, err
	}

	sb := &superblock{
		Inodes:      p.inodes,
		BlockSize:   uint32(p.bs),
		Fragments:   uint32(len(frags)),
		Compression: p.codec.id(),
		Flags:       flagNoXattrs | flagDuplicates | flagExportable,
		Major:       4,
		RootInode:   p.root.ref,
		XattrTable:  noTable,
	}
	for sb.BlockLog = 0; 1<<sb.BlockLog < p.bs; sb.BlockLog++ {
	}
	if p.codec.options() != nil {
		sb.Flags |= flagCompOpts
	}
	if _, ok := p.codec.(noneCodec); ok {
		sb.Flags |= flagUncompInodes | flagUncompData | flagUncompFrags | flagUncompIDs
	}
	mt := p.opts.ModTime
	if mt.IsZero() {
		mt = p.newest
	}
	sb.MkfsTime, _ = mtimeSecs(mt)

	var err error
	if sb.InodeTable, err = t.inodes.emit(out); err != nil {
		return nil, err
	}
	if sb.DirTable, err = t.dirs.emit(out); err != nil {
		return nil, err
	}
	// With no fragments the fragment table is empty but its position still
	// marks the end of the directory table for unsquashfs.
	sb.FragmentTable = out.pos
	if len(frags) > 0 {
		ft := &metaWriter{comp: bc, kind: kindFragTable}
		var e [fragEntrySize]byte
		for _, f := range frags {
			binary.LittleEndian.PutUint64(e[0:], f.start)
			binary.LittleEndian.PutUint32(e[8:], f.word)
			ft.write(e[:])
		}
		if sb.FragmentTable, err = ft.emitIndexed(out); err != nil {
			return nil, err
		}
	}
	et := &metaWriter{comp: bc, kind: kindExportTable}
	for _, ref := range t.export {
		et.write(binary.LittleEndian.AppendUint64(nil, ref))
	}
	if sb.ExportTable, err = et.emitIndexed(out); err != nil {
		return nil, err
	}
	it := &metaWriter{comp: bc, kind: kindIDTable}
	for _, id := range t.ids {
		it.write(binary.LittleEndian.AppendUint32(nil, id))
	}
	if sb.IDTable, err = it.emitIndexed(out); err != nil {
		return nil, err
	}
	sb.IDs = uint16(len(t.ids))
	sb.BytesUsed = out.pos
	p.inodeRecs = t.inodeRecs
	return sb, nil
}

// header appends the part common to all inodes.
func (p *packer) header(t *tables, b []byte, typ uint16, n *node) ([]byte, error) {
	uid, err := t.id(n.uid)
	if err != nil {
		return nil, err
	}
	gid, err := t.id(n.gid)
	if err != nil {
		return nil, err
	}
	secs, _ := mtimeSecs(n.mtime)
	le := binary.LittleEndian
	b = le.AppendUint16(b, typ)
	b = le.AppendUint16(b, squashMode(n.mode))
	b = le.AppendUint16(b, uid)
	b = le.AppendUint16(b, gid)
	b = le.AppendUint32(b, secs)
	return le.AppendUint32(b, n.ino), nil
}

// putInode writes inode bytes b for n and records its reference.
func (p *packer) putInode(t *tables, n *node, b []byte) error {
	blk, off := t.inodes.pos()
	if blk > 0xFFFFFFFF {
		return fmt.Errorf("inode table larger than 4 GiB")
	}
	n.ref = inodeRef(blk, off)
	if t.extend {
		t.exportMap[n.ino] = n.ref
		t.writtenMap[n.ino] = true
	} else {
		t.export[n.ino-1] = n.ref
		t.written[n.ino] = true
	}
	k := len(t.inodes.starts) // the block being filled
	for len(t.inodeRecs) <= k {
		t.inodeRecs = append(t.inodeRecs, nil)
	}
	_, ns := mtimeSecs(n.mtime)
	rec := inodeRec{off: off, ns: ns, ino: n.ino}
	if n.mode.IsRegular() && n.file != nil && !p.opts.noSums {
		if s := n.file.contentSum(); s.known() {
			rec.sum, rec.hasSum = s, true
		}
	}
	t.inodeRecs[k] = append(t.inodeRecs[k], rec)
	return t.inodes.write(b)
}

func (p *packer) writeLeaf(t *tables, n *node) error {
	le := binary.LittleEndian
	var b []byte
	var err error
	switch n.mode.Type() {
	case 0:
		fd := n.file
		if fd == nil {
			return fmt.Errorf("internal error: %s has no data", n.path)
		}
		if n.nlink == 1 && fd.size <= math.MaxUint32 && fd.start <= math.MaxUint32 && fd.sparse == 0 {
			if b, err = p.header(t, b, typeFile, n); err != nil {
				return err
			}
			b = le.AppendUint32(b, uint32(fd.start))
			b = le.AppendUint32(b, fd.frag)
			b = le.AppendUint32(b, fd.fragOff)
			b = le.AppendUint32(b, uint32(fd.size))
		} else {
			if b, err = p.header(t, b, typeLFile, n); err != nil {
				return err
			}
			b = le.AppendUint64(b, fd.start)
			b = le.AppendUint64(b, uint64(fd.size))
			b = le.AppendUint64(b, fd.sparse)
			b = le.AppendUint32(b, n.nlink)
			b = le.AppendUint32(b, fd.frag)
			b = le.AppendUint32(b, fd.fragOff)
			b = le.AppendUint32(b, noXattr)
		}
		for _, w := range fd.words {
			b = le.AppendUint32(b, w)
		}
	case iofs.ModeSymlink:
		if b, err = p.header(t, b, typeSymlink, n); err != nil {
			return err
		}
		b = le.AppendUint32(b, n.nlink)
		b = le.AppendUint32(b, uint32(len(n.target)))
		b = append(b, n.target...)
	case iofs.ModeDevice, iofs.ModeDevice | iofs.ModeCharDevice:
		typ := uint16(typeBlockDev)
		if n.mode.Type() == iofs.ModeDevice|iofs.ModeCharDevice {
			typ = typeCharDev
		}
		if b, err = p.header(t, b, typ, n); err != nil {
			return err
		}
		b = le.AppendUint32(b, n.nlink)
		b = le.AppendUint32(b, encodeDev(n.rdev))
	case iofs.ModeNamedPipe, iofs.ModeSocket:
		typ := uint16(typeFifo)
		if n.mode.Type() == iofs.ModeSocket {
			typ = typeSocket
		}
		if b, err = p.header(t, b, typ, n); err != nil {
			return err
		}
		b = le.AppendUint32(b, n.nlink)
	default:
		return fmt.Errorf("%s: unsupported file type %v", n.path, n.mode.Type())
	}
	return p.putInode(t, n, b)
}

type dirIndex struct {
	index, start uint32
	name         string
}

// writeDir writes the inodes below d (children first), then d's listing in
// the directory table, then d's inode.
func (p *packer) writeDir(t *tables, d *node, parent uint32) error {
	for _, c := range d.children {
		switch o := c.inode(); {
		case o.reused:
			// An extending pack's unchanged entry: the base's inode.
		case o.relist:
			if err := p.writeRelisted(t, o, d.ino); err != nil {
				return err
			}
		case c.mode.IsDir():
			if err := p.writeDir(t, c, d.ino); err != nil {
				return err
			}
		case !t.isWritten(o.ino):
			if err := p.writeLeaf(t, o); err != nil {
				return err
			}
		}
	}
	p.res.Dirs++
	if pr := p.opts.probe; pr != nil && pr.cutBefore != "" && d.name == pr.cutBefore {
		if err := t.inodes.cut(); err != nil {
			return err
		}
		if err := t.dirs.cut(); err != nil {
			return err
		}
	}

	le := binary.LittleEndian
	dw := t.dirs
	startBlk, startOff := dw.pos()
	listStart := dw.total
	var index []dirIndex
	var (
		count   int // entries under the open header
		hdrBlk  uint64
		hdrIno  uint32
		hdrMeta uint64 // metadata block number of the open header
		lastIdx = listStart / metaBlockSize
	)
	// A run (a header and its entries) is built in buf and handed to the
	// table when the next header starts, so the header's count is known and
	// each header's position in the table is where the table stands.
	var buf []byte
	closeRun := func() error {
		if count == 0 {
			return nil
		}
		le.PutUint32(buf, uint32(count-1))
		err := dw.write(buf)
		buf, count = buf[:0], 0
		return err
	}
	for _, c := range d.children {
		o := c.inode()
		blk, off := refBlock(o.ref), refOffset(o.ref)
		delta := int64(o.ino) - int64(hdrIno)
		entryAt := dw.total + uint64(len(buf))
		if count == 0 || count == dirMaxRun || blk != hdrBlk || delta < math.MinInt16 || delta > math.MaxInt16 ||
			entryAt/metaBlockSize != hdrMeta {
			if err := closeRun(); err != nil {
				return err
			}
			if blk > math.MaxUint32 {
				return fmt.Errorf("inode table larger than 4 GiB")
			}
			hdrBlk, hdrIno = blk, o.ino
			hdrMeta = dw.total / metaBlockSize
			if hdrMeta != lastIdx {
				tb, _ := dw.pos()
				index = append(index, dirIndex{index: uint32(dw.total - listStart), start: uint32(tb), name: c.name})
				lastIdx = hdrMeta
			}
			buf = le.AppendUint32(buf, 0) // count, set by closeRun
			buf = le.AppendUint32(buf, uint32(blk))
			buf = le.AppendUint32(buf, o.ino)
			delta = 0
		}
		buf = le.AppendUint16(buf, off)
		buf = le.AppendUint16(buf, uint16(int16(delta)))
		buf = le.AppendUint16(buf, basicType(inodeTypeOf(c.mode)))
		buf = le.AppendUint16(buf, uint16(len(c.name)-1))
		buf = append(buf, c.name...)
		count++
	}
	if err := closeRun(); err != nil {
		return err
	}
	listLen := dw.total - listStart
	size := listLen + 3
	if startBlk > math.MaxUint32 {
		return fmt.Errorf("directory table larger than 4 GiB")
	}

	var b []byte
	var err error
	nlink := 2 + d.subdirs
	if len(index) == 0 && size <= math.MaxUint16 {
		if b, err = p.header(t, b, typeDir, d); err != nil {
			return err
		}
		b = le.AppendUint32(b, uint32(startBlk))
		b = le.AppendUint32(b, nlink)
		b = le.AppendUint16(b, uint16(size))
		b = le.AppendUint16(b, startOff)
		b = le.AppendUint32(b, parent)
	} else {
		if size > math.MaxUint32 || len(index) > math.MaxUint16 {
			return fmt.Errorf("%s: directory too large", d.path)
		}
		if b, err = p.header(t, b, typeLDir, d); err != nil {
			return err
		}
		b = le.AppendUint32(b, nlink)
		b = le.AppendUint32(b, uint32(size))
		b = le.AppendUint32(b, uint32(startBlk))
		b = le.AppendUint32(b, parent)
		b = le.AppendUint16(b, uint16(len(index)))
		b = le.AppendUint16(b, startOff)
		b = le.AppendUint32(b, noXattr)
		for _, ix := range index {
			b = le.AppendUint32(b, ix.index)
			b = le.AppendUint32(b, ix.start)
			b = le.AppendUint32(b, uint32(len(ix.name)-1))
			b = append(b, ix.name...)
		}
	}
	return p.putInode(t, d, b)
}
