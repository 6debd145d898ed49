package archive

import (
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"slices"
	"sort"
	"sync"

	"github.com/klauspost/compress/zstd"
)

// The integrity trailer, version 2: records attached to the blocks they
// describe, grouped into pages that never change once written, so that an
// image extended from another reuses the other's pages by byte range and a
// reader loads only the pages of the blocks it reads.
//
//	file:   [image][zero padding to 4 KiB][groups...][root][footer]
//	group:  [page]...[page][index page]
//	footer: "HFSFOOT1" | version u32 (2) | flags u32 | root offset u64 |
//	        root length u64 | tail offset u64 | root crc u32 |
//	        footer crc u32                                (48 bytes, at EOF)
//
// Offsets are from the start of the archive. The root lists the groups in
// image order; together they cover the image from offset 0 to bytes_used
// exactly, each a run of whole blocks of one region (the superblock and
// compressor options; the data and fragment blocks; the inode table; the
// directory table; each of the fragment, export and id tables; each index
// array). Where a group's bytes are in the file is free: the groups of
// the regions after the directory table, and the first region's, are
// written last, from the tail offset on, so that Open reads them and the
// root with one request.
//
//	root:   "HFSROOT2" | version u32 | flags u32 | image bytes u64 |
//	        superblock crc u32 | generation u32 | lineage [16] |
//	        next inode u32 | live inodes u32 | garbage bytes u64 |
//	        reserved u64 | group count u32 | reserved u32 | groups...
//	group:  index page offset u64 | image bytes u64 | pages u32 |
//	        index page length u32 | index page crc u32 | reserved u32
//	index page: per page: stored length u32 (bit 31: zstd) | raw length u32 |
//	        crc of the stored bytes u32 | blocks u32 | image bytes u64
//
// A group's pages lie right before its index page, in order; a page's
// position in the file and its first block's position in the image follow
// from the lengths before it. A page holds one record per block, in image
// order:
//
//	record: length|kind<<24 u32 | crc-32c u32 | by kind:
//	        data block: content sum [32] (zeros: unknown)
//	        inode table block: count u16, then for each inode that starts
//	          in the block: offset in the block u16 | mtime nanoseconds u32
//	          (bit 31: a content sum follows) | [content sum [32]]
//	        others: nothing
//
// Nothing in a page, index page or group names an absolute position: a
// page is valid wherever its group puts it, and a group wherever the root
// does. The footer's crc covers the root, the root's each index page, an
// index page's each page. Root flags: bit 0, content sums are recorded.
const (
	formatVersion2 = 2
	rootMagic      = "HFSROOT2"
	rootHeaderSize = 80
	groupEntrySize = 32
	pageEntrySize  = 24

	// A page is cut once its raw records reach pageTarget bytes or
	// pageRecords records; a group once it has groupPages pages.
	pageTarget  = 8 << 10
	pageRecords = 256
	groupPages  = 64

	pageCompressed = 1 << 31
	maxPageRaw     = 1 << 20 // a reader refuses pages larger than this
	minRecord      = 8       // the raw bytes of the smallest record
	inodeHasSum    = 1 << 31
	rootHasSums    = 1
)

// blockRec is the trailer's record of one image block.
type blockRec struct {
	length uint32
	kind   extentKind
	crc    uint32
	sum    sum        // data blocks: content sum, zero if unknown
	inodes []inodeRec // inode table blocks: the inodes that start in the block
}

// inodeRec is what the trailer adds to one inode: the nanoseconds of its
// mtime (squashfs keeps seconds) and, for a regular file, its content sum.
type inodeRec struct {
	off    uint16 // where the inode starts in its uncompressed metadata block
	ns     uint32
	sum    sum
	hasSum bool
	ino    uint32 // not stored: the inode's number, for the version 1 writer
}

// Lineage identifies a line of images: a fresh pack starts one, and the
// images packed by extending it (PackOptions.Extend) or by compacting it
// (Compact) carry it on, with the same inode numbers for the same objects.
type Lineage [16]byte

// rootInfo is the trailer root's counters.
type rootInfo struct {
	flags      uint32
	imageBytes uint64
	sbCRC      uint32
	generation uint32
	lineage    Lineage
	nextInode  uint32
	liveInodes uint32
	garbage    uint64
}

func appendRecord(b []byte, r *blockRec) []byte {
	le := binary.LittleEndian
	b = le.AppendUint32(b, r.length|uint32(r.kind)<<24)
	b = le.AppendUint32(b, r.crc)
	switch r.kind {
	case kindData:
		b = append(b, r.sum[:]...)
	case kindInodeTable:
		b = le.AppendUint16(b, uint16(len(r.inodes)))
		for _, in := range r.inodes {
			b = le.AppendUint16(b, in.off)
			v := in.ns
			if in.hasSum {
				v |= inodeHasSum
			}
			b = le.AppendUint32(b, v)
			if in.hasSum {
				b = append(b, in.sum[:]...)
			}
		}
	}
	return b
}

// trGroup is a group as the root lists it.
type trGroup struct {
	imgOff, imgLen uint64 // the image bytes it covers (imgOff implied by the order)
	idxOff         uint64 // file offset of its index page
	pages          uint32
	idxLen, idxCRC uint32
}

// trIndex is a decoded index page.
type trIndex struct {
	fileOff []uint64 // of each page, and the index page's at the end
	imgOff  []uint64 // of each page's first block, and the group's end
	stored  []uint32 // length|pageCompressed
	raw     []uint32
	crc     []uint32
	blocks  []uint32
}

func (x *trIndex) cost() int64 { return int64(len(x.stored))*40 + 128 }

// trPage is a decoded page.
type trPage struct {
	off  []uint64 // image offset of each record's block, and the page's end
	lk   []uint32 // length | kind<<24
	crc  []uint32
	sums []sum    // per record; nil when the page holds no data block
	ino0 []uint32 // inode records of record i are inos[ino0[i]:ino0[i+1]]
	inos []inodeRec
}

func (p *trPage) cost() int64 {
	return int64(len(p.lk))*20 + int64(len(p.sums))*32 + int64(len(p.inos))*48 + 256
}

// find returns the record of the block starting at off, or -1.
func (p *trPage) find(off uint64) int {
	n := len(p.lk)
	i := sort.Search(n, func(i int) bool { return p.off[i] >= off })
	if i < n && p.off[i] == off {
		return i
	}
	return -1
}

func (p *trPage) info(i int) blockInfo {
	bi := blockInfo{length: p.lk[i] & maxExtentLen, kind: extentKind(p.lk[i] >> 24), crc: p.crc[i]}
	if p.sums != nil {
		bi.sum = p.sums[i]
	}
	return bi
}

// record returns record i as the writer would give it (for reuse).
func (p *trPage) record(i int) blockRec {
	bi := p.info(i)
	r := blockRec{length: bi.length, kind: bi.kind, crc: bi.crc, sum: bi.sum}
	if n := p.ino0[i+1] - p.ino0[i]; n > 0 {
		r.inodes = p.inos[p.ino0[i]:p.ino0[i+1]]
	}
	return r
}

// blockInfo is what a trailer records of one block.
type blockInfo struct {
	length uint32
	kind   extentKind
	crc    uint32
	sum    sum
}

// trailer2 is the decoded root of a version 2 trailer. Index pages and
// pages are loaded when first needed, through the reader's metadata cache.
type trailer2 struct {
	root    rootInfo
	groups  []trGroup
	start   uint64 // where the trailer starts: the padded image end
	tailOff uint64
	tail    []byte // the file from tailOff on, read at Open
}

// parseFooter2 decodes a version 2 footer (the magic, size and crc checked).
func parseFooter2(b []byte, fileSize int64) (rootOff, rootLen, tailOff uint64, rootCRC uint32, err error) {
	le := binary.LittleEndian
	rootOff, rootLen, tailOff = le.Uint64(b[16:]), le.Uint64(b[24:]), le.Uint64(b[32:])
	rootCRC = le.Uint32(b[40:])
	end := uint64(fileSize) - footerSize
	if rootOff > end || rootLen > end-rootOff || rootOff+rootLen != end || tailOff > rootOff {
		return 0, 0, 0, 0, errors.New("footer offsets do not match the file size")
	}
	return
}

// parseRoot decodes and checks a root read from the file.
func parseRoot(b []byte, crc uint32) (*trailer2, error) {
	if crc32c(b) != crc {
		return nil, errChecksum
	}
	le := binary.LittleEndian
	if len(b) < rootHeaderSize || string(b[:8]) != rootMagic {
		return nil, errors.New("bad trailer root")
	}
	if v := le.Uint32(b[8:]); v != formatVersion2 {
		return nil, fmt.Errorf("unsupported trailer root version %d", v)
	}
	t := &trailer2{}
	ri := &t.root
	ri.flags = le.Uint32(b[12:])
	ri.imageBytes = le.Uint64(b[16:])
	ri.sbCRC = le.Uint32(b[24:])
	ri.generation = le.Uint32(b[28:])
	copy(ri.lineage[:], b[32:48])
	ri.nextInode = le.Uint32(b[48:])
	ri.liveInodes = le.Uint32(b[52:])
	ri.garbage = le.Uint64(b[56:])
	n := uint64(le.Uint32(b[72:]))
	if n == 0 || n != uint64(len(b)-rootHeaderSize)/groupEntrySize || uint64(len(b)-rootHeaderSize)%groupEntrySize != 0 {
		return nil, errors.New("group count does not match the root's length")
	}
	t.groups = make([]trGroup, n)
	var img uint64
	for i := range t.groups {
		e := b[rootHeaderSize+groupEntrySize*i:]
		g := &t.groups[i]
		g.idxOff = le.Uint64(e)
		g.imgLen = le.Uint64(e[8:])
		g.pages = le.Uint32(e[16:])
		g.idxLen = le.Uint32(e[20:])
		g.idxCRC = le.Uint32(e[24:])
		g.imgOff = img
		if g.imgLen == 0 || g.pages == 0 || uint64(g.idxLen) != uint64(g.pages)*pageEntrySize || g.imgLen > ri.imageBytes-img {
			return nil, fmt.Errorf("group %d is malformed", i)
		}
		img += g.imgLen
	}
	if img != ri.imageBytes {
		return nil, fmt.Errorf("groups cover %d bytes, image has %d", img, ri.imageBytes)
	}
	return t, nil
}

// groupAt returns the group covering image offset off, or -1.
func (t *trailer2) groupAt(off uint64) int {
	i := sort.Search(len(t.groups), func(i int) bool { return t.groups[i].imgOff+t.groups[i].imgLen > off })
	if i == len(t.groups) {
		return -1
	}
	return i
}

// trailerBytes reads n bytes of the trailer at file offset off: from the
// tail read at Open when they lie there.
func (r *Reader) trailerBytes(off, n uint64, what string) ([]byte, error) {
	t := r.tr2
	if off >= t.tailOff && off-t.tailOff <= uint64(len(t.tail)) && n <= uint64(len(t.tail))-(off-t.tailOff) {
		return t.tail[off-t.tailOff : off-t.tailOff+n], nil
	}
	return r.readAt(off, n, what)
}

// trIndexOf loads (or finds cached) the index page of group g.
func (r *Reader) trIndexOf(g int) (*trIndex, error) {
	v, err := r.meta.get(metaKey{k: mkTrIndex, a: uint64(g)}, func() (any, int64, error) {
		x, err := r.loadTrIndex(g)
		if err != nil {
			return nil, 0, err
		}
		return x, x.cost(), nil
	})
	if err != nil {
		return nil, err
	}
	return v.(*trIndex), nil
}

func (r *Reader) loadTrIndex(g int) (*trIndex, error) {
	t := r.tr2
	grp := &t.groups[g]
	what := "integrity trailer index page"
	if grp.idxOff < uint64(t.start) || grp.idxOff > uint64(r.size) || uint64(grp.idxLen) > uint64(r.size)-grp.idxOff {
		return nil, r.corruptf(grp.idxOff, what, "outside the file")
	}
	b, err := r.trailerBytes(grp.idxOff, uint64(grp.idxLen), what)
	if err != nil {
		return nil, err
	}
	if crc32c(b) != grp.idxCRC {
		return nil, r.corrupt(grp.idxOff, what, errChecksum)
	}
	le := binary.LittleEndian
	n := int(grp.pages)
	x := &trIndex{
		fileOff: make([]uint64, n+1), imgOff: make([]uint64, n+1),
		stored: make([]uint32, n), raw: make([]uint32, n), crc: make([]uint32, n), blocks: make([]uint32, n),
	}
	var total, img uint64
	for i := range n {
		e := b[pageEntrySize*i:]
		x.stored[i] = le.Uint32(e)
		x.raw[i] = le.Uint32(e[4:])
		x.crc[i] = le.Uint32(e[8:])
		x.blocks[i] = le.Uint32(e[12:])
		imgLen := le.Uint64(e[16:])
		sl := uint64(x.stored[i] &^ pageCompressed)
		// Every record takes at least minRecord raw bytes: the count
		// bounds what decoding the page allocates.
		if sl == 0 || x.raw[i] == 0 || x.raw[i] > maxPageRaw || sl > maxPageRaw || x.blocks[i] == 0 ||
			x.blocks[i] > x.raw[i]/minRecord || imgLen == 0 || imgLen > grp.imgLen-img {
			return nil, r.corruptf(grp.idxOff, what, "page %d is malformed", i)
		}
		if x.stored[i]&pageCompressed == 0 && sl != uint64(x.raw[i]) {
			return nil, r.corruptf(grp.idxOff, what, "page %d: stored and raw lengths differ", i)
		}
		x.imgOff[i] = grp.imgOff + img
		img += imgLen
		total += sl
	}
	if img != grp.imgLen {
		return nil, r.corruptf(grp.idxOff, what, "pages cover %d bytes, the group %d", img, grp.imgLen)
	}
	if total > grp.idxOff-t.start {
		return nil, r.corruptf(grp.idxOff, what, "pages lie before the trailer")
	}
	x.imgOff[n] = grp.imgOff + grp.imgLen
	off := grp.idxOff - total
	for i := range n {
		x.fileOff[i] = off
		off += uint64(x.stored[i] &^ pageCompressed)
	}
	x.fileOff[n] = grp.idxOff
	return x, nil
}

// trPageOf loads (or finds cached) page p of group g.
func (r *Reader) trPageOf(g, p int) (*trPage, error) {
	v, err := r.meta.get(metaKey{k: mkTrPage, a: uint64(g), b: uint64(p)}, func() (any, int64, error) {
		x, err := r.trIndexOf(g)
		if err != nil {
			return nil, 0, err
		}
		pg, err := r.loadTrPage(x, p)
		if err != nil {
			return nil, 0, err
		}
		return pg, pg.cost(), nil
	})
	if err != nil {
		return nil, err
	}
	return v.(*trPage), nil
}

var pageDecoder = sync.OnceValues(func() (*zstd.Decoder, error) {
	return zstd.NewReader(nil, zstd.WithDecoderConcurrency(0), zstd.WithDecoderMaxMemory(2*maxPageRaw))
})

var pageEncoder = sync.OnceValues(func() (*zstd.Encoder, error) {
	return zstd.NewWriter(nil, zstd.WithEncoderLevel(zstd.SpeedDefault), zstd.WithEncoderCRC(false), zstd.WithZeroFrames(true))
})

func (r *Reader) loadTrPage(x *trIndex, p int) (*trPage, error) {
	what := "integrity trailer page"
	off := x.fileOff[p]
	sl := uint64(x.stored[p] &^ pageCompressed)
	b, err := r.trailerBytes(off, sl, what)
	if err != nil {
		return nil, err
	}
	if crc32c(b) != x.crc[p] {
		return nil, r.corrupt(off, what, errChecksum)
	}
	if x.stored[p]&pageCompressed != 0 {
		dec, err := pageDecoder()
		if err != nil {
			return nil, err
		}
		raw, err := dec.DecodeAll(b, make([]byte, 0, x.raw[p]))
		if err != nil || len(raw) != int(x.raw[p]) {
			return nil, r.corruptf(off, what, "does not decompress to %d bytes (%v)", x.raw[p], err)
		}
		b = raw
	}
	pg, err := decodePage(b, int(x.blocks[p]), x.imgOff[p], x.imgOff[p+1])
	if err != nil {
		return nil, r.corrupt(off, what, err)
	}
	return pg, nil
}

// decodePage decodes the n records of a page covering image bytes
// [start, end).
func decodePage(b []byte, n int, start, end uint64) (*trPage, error) {
	le := binary.LittleEndian
	pg := &trPage{off: make([]uint64, n+1), lk: make([]uint32, n), crc: make([]uint32, n), ino0: make([]uint32, n+1)}
	pos := start
	for i := range n {
		if len(b) < 8 {
			return nil, errors.New("truncated record")
		}
		lk := le.Uint32(b)
		pg.lk[i], pg.crc[i] = lk, le.Uint32(b[4:])
		b = b[8:]
		l := uint64(lk & maxExtentLen)
		if l == 0 || l > end-pos {
			return nil, fmt.Errorf("record %d of %d bytes overruns the page's %d", i, l, end-start)
		}
		pg.off[i] = pos
		pos += l
		switch extentKind(lk >> 24) {
		case kindData:
			if len(b) < 32 {
				return nil, errors.New("truncated record")
			}
			if pg.sums == nil {
				pg.sums = make([]sum, n)
			}
			copy(pg.sums[i][:], b)
			b = b[32:]
		case kindInodeTable:
			if len(b) < 2 {
				return nil, errors.New("truncated record")
			}
			cnt := int(le.Uint16(b))
			b = b[2:]
			if cnt > metaBlockSize/minInodeSize+1 {
				return nil, fmt.Errorf("record %d lists %d inodes", i, cnt)
			}
			prev := -1
			for range cnt {
				if len(b) < 6 {
					return nil, errors.New("truncated record")
				}
				in := inodeRec{off: le.Uint16(b)}
				v := le.Uint32(b[2:])
				b = b[6:]
				in.ns = v &^ inodeHasSum % 1e9
				if v&inodeHasSum != 0 {
					if len(b) < 32 {
						return nil, errors.New("truncated record")
					}
					in.hasSum = true
					copy(in.sum[:], b)
					b = b[32:]
				}
				if int(in.off) <= prev || in.off >= metaBlockSize {
					return nil, fmt.Errorf("record %d: inode offsets not increasing", i)
				}
				prev = int(in.off)
				pg.inos = append(pg.inos, in)
			}
		}
		pg.ino0[i+1] = uint32(len(pg.inos))
	}
	if pos != end || len(b) != 0 {
		return nil, errors.New("records do not fill the page")
	}
	pg.off[n] = end
	return pg, nil
}

// recordAt returns the page and index of the record of the block starting
// at image offset off; a nil page when no block starts there.
func (r *Reader) recordAt(off uint64) (*trPage, int, error) {
	t := r.tr2
	g := t.groupAt(off)
	if g < 0 {
		return nil, -1, nil
	}
	x, err := r.trIndexOf(g)
	if err != nil {
		return nil, -1, err
	}
	p := sort.Search(len(x.stored), func(i int) bool { return x.imgOff[i+1] > off })
	if p == len(x.stored) {
		return nil, -1, nil
	}
	pg, err := r.trPageOf(g, p)
	if err != nil {
		return nil, -1, err
	}
	i := pg.find(off)
	if i < 0 {
		return nil, -1, nil
	}
	return pg, i, nil
}

// eachRecord calls fn for every block the trailer describes in [from, to),
// in image order, with the records loaded a page at a time.
func (r *Reader) eachRecord(from, to uint64, fn func(off uint64, bi blockInfo, pg *trPage, i int) error) error {
	if r.tr != nil {
		ex := &r.tr.ext
		i := sort.Search(len(ex.len), func(i int) bool { return ex.off[i] >= from })
		for ; i < len(ex.len) && ex.off[i] < to; i++ {
			bi := blockInfo{length: ex.len[i], kind: ex.kind[i], crc: ex.crc[i]}
			if r.tr.blockSums != nil {
				bi.sum = r.tr.blockSums[i]
			}
			if err := fn(ex.off[i], bi, nil, -1); err != nil {
				return err
			}
		}
		return nil
	}
	t := r.tr2
	for g := max(t.groupAt(from), 0); g < len(t.groups) && t.groups[g].imgOff < to; g++ {
		x, err := r.trIndexOf(g)
		if err != nil {
			return err
		}
		for p := range x.stored {
			if x.imgOff[p+1] <= from || x.imgOff[p] >= to {
				continue
			}
			pg, err := r.trPageOf(g, p)
			if err != nil {
				return err
			}
			for i := range pg.lk {
				if pg.off[i] < from || pg.off[i] >= to {
					continue
				}
				if err := fn(pg.off[i], pg.info(i), pg, i); err != nil {
					return err
				}
			}
		}
	}
	return nil
}

// trBuilder lays out a version 2 trailer. Regions are added one at a time,
// in any order (the file order): add records of new blocks, or reuse a
// range of the base archive's image whose blocks this image holds
// verbatim at the same relative positions (their pages and groups are
// copied by range when they lie wholly inside it). finish checks that the
// groups tile the image and writes the root and footer.
type trBuilder struct {
	out  *output
	pos  uint64 // file offset (from the archive's start) of the next trailer byte
	img  uint64 // image offset of the next block
	tail uint64

	groups []trGroup

	// The group being filled: its pages so far.
	gPages [][]byte // index entries
	gImg0  uint64
	gImgN  uint64

	// The page being filled.
	pRaw    []byte
	pBlocks uint32
	pImgN   uint64

	reused, written int64 // trailer bytes copied from the base, and new
	root            rootInfo
}

func newTrBuilder(out *output, start uint64) *trBuilder {
	return &trBuilder{out: out, pos: start, tail: ^uint64(0)}
}

// region starts a region at image offset off: pages and groups never span
// two.
func (b *trBuilder) region(off uint64) error {
	if err := b.flushGroup(); err != nil {
		return err
	}
	b.img = off
	return nil
}

// markTail notes that what follows is read by Open with the root.
func (b *trBuilder) markTail() error {
	if err := b.flushGroup(); err != nil {
		return err
	}
	b.tail = b.pos
	return nil
}

func (b *trBuilder) add(r *blockRec) error {
	if r.length == 0 || r.length > maxExtentLen {
		return fmt.Errorf("internal error: trailer record of %d bytes", r.length)
	}
	if len(b.gPages) == 0 && b.pBlocks == 0 {
		b.gImg0 = b.img
	}
	b.pRaw = appendRecord(b.pRaw, r)
	b.pBlocks++
	b.pImgN += uint64(r.length)
	b.img += uint64(r.length)
	if len(b.pRaw) >= pageTarget || b.pBlocks >= pageRecords {
		return b.flushPage()
	}
	return nil
}

func pageEntry(stored, raw, crc, blocks uint32, imgLen uint64) []byte {
	le := binary.LittleEndian
	e := le.AppendUint32(nil, stored)
	e = le.AppendUint32(e, raw)
	e = le.AppendUint32(e, crc)
	e = le.AppendUint32(e, blocks)
	return le.AppendUint64(e, imgLen)
}

func (b *trBuilder) flushPage() error {
	if b.pBlocks == 0 {
		return nil
	}
	raw := b.pRaw
	stored, word := raw, uint32(len(raw))
	enc, err := pageEncoder()
	if err != nil {
		return err
	}
	if c := enc.EncodeAll(raw, nil); len(c) < len(raw) {
		stored, word = c, uint32(len(c))|pageCompressed
	}
	b.out.trailerWrite(stored)
	b.pos += uint64(len(stored))
	b.written += int64(len(stored))
	b.gPages = append(b.gPages, pageEntry(word, uint32(len(raw)), crc32c(stored), b.pBlocks, b.pImgN))
	b.gImgN += b.pImgN
	b.pRaw, b.pBlocks, b.pImgN = b.pRaw[:0], 0, 0
	if len(b.gPages) >= groupPages {
		return b.flushGroup()
	}
	return b.out.err
}

func (b *trBuilder) flushGroup() error {
	if err := b.flushPage(); err != nil {
		return err
	}
	if len(b.gPages) == 0 {
		return nil
	}
	idx := slices.Concat(b.gPages...)
	b.groups = append(b.groups, trGroup{imgOff: b.gImg0, imgLen: b.gImgN, idxOff: b.pos, pages: uint32(len(b.gPages)),
		idxLen: uint32(len(idx)), idxCRC: crc32c(idx)})
	b.out.trailerWrite(idx)
	b.pos += uint64(len(idx))
	b.written += int64(len(idx))
	b.gPages, b.gImgN = b.gPages[:0], 0
	return b.out.err
}

// reusePage puts page p of group g of base here, copied by range.
func (b *trBuilder) reusePage(base *Reader, x *trIndex, p int) error {
	if err := b.flushPage(); err != nil {
		return err
	}
	if len(b.gPages) == 0 {
		b.gImg0 = b.img
	}
	sl := uint64(x.stored[p] &^ pageCompressed)
	b.out.trailerCopy(int64(sl), base, int64(x.fileOff[p]))
	b.pos += sl
	b.reused += int64(sl)
	n := x.imgOff[p+1] - x.imgOff[p]
	b.gPages = append(b.gPages, pageEntry(x.stored[p], x.raw[p], x.crc[p], x.blocks[p], n))
	b.gImgN += n
	b.img += n
	if len(b.gPages) >= groupPages {
		return b.flushGroup()
	}
	return b.out.err
}

// reuseGroup puts group g of base here, pages and index page copied by
// range.
func (b *trBuilder) reuseGroup(base *Reader, g int, x *trIndex) error {
	if err := b.flushGroup(); err != nil {
		return err
	}
	grp := base.tr2.groups[g]
	start := x.fileOff[0]
	n := grp.idxOff + uint64(grp.idxLen) - start
	b.out.trailerCopy(int64(n), base, int64(start))
	b.groups = append(b.groups, trGroup{imgOff: b.img, imgLen: grp.imgLen, idxOff: b.pos + grp.idxOff - start,
		pages: grp.pages, idxLen: grp.idxLen, idxCRC: grp.idxCRC})
	b.pos += n
	b.reused += int64(n)
	b.img += grp.imgLen
	return b.out.err
}

// addBase describes base's image bytes [from, to), which this image holds
// verbatim from the builder's current image offset on: whole groups and
// pages of base inside the range are reused as they are (but a small last
// one is merged with what follows, so that extending an image many times
// does not pile up small pages), records of the others copied. The range
// must start and end at block boundaries. It returns the bytes of base's
// pages it read.
func (b *trBuilder) addBase(base *Reader, from, to uint64) error {
	if from >= to {
		return nil
	}
	t := base.tr2
	if t == nil {
		return errors.New("internal error: reusing the trailer of an archive without a version 2 trailer")
	}
	for g := t.groupAt(from); g >= 0 && g < len(t.groups) && t.groups[g].imgOff < to; g++ {
		grp := t.groups[g]
		x, err := base.trIndexOf(g)
		if err != nil {
			return err
		}
		gEnd := grp.imgOff + grp.imgLen
		if grp.imgOff >= from && gEnd <= to && (gEnd < to || grp.pages >= groupPages/4) {
			if err := b.reuseGroup(base, g, x); err != nil {
				return err
			}
			continue
		}
		for p := range x.stored {
			ps, pe := x.imgOff[p], x.imgOff[p+1]
			if pe <= from || ps >= to {
				continue
			}
			if ps >= from && pe <= to && (pe < to || x.raw[p] >= pageTarget/4) {
				if err := b.reusePage(base, x, p); err != nil {
					return err
				}
				continue
			}
			pg, err := base.trPageOf(g, p)
			if err != nil {
				return err
			}
			for i := range pg.lk {
				s, e := pg.off[i], pg.off[i+1]
				if e <= from || s >= to {
					continue
				}
				if s < from || e > to {
					return fmt.Errorf("internal error: base range [%d, %d) cuts the block at %d", from, to, s)
				}
				rec := pg.record(i)
				if err := b.add(&rec); err != nil {
					return err
				}
			}
		}
	}
	return nil
}

// trRegion is a region of the image as the trailer describes it: spans
// of new blocks' records, or of base image bytes held verbatim.
type trRegion struct {
	off   uint64
	class int
	spans []trSpan
}

type trSpan struct {
	recs     []blockRec
	base     *Reader
	from, to uint64
}

// regionClass says which region a block of kind belongs to.
func regionClass(k extentKind) int {
	switch k {
	case kindSuperblock, kindCompOpts:
		return 0
	case kindData, kindFragment:
		return int(kindData)
	}
	return int(k)
}

// regions cuts the records of a whole image, from offset 0, into regions.
func regions(recs []blockRec) []trRegion {
	var out []trRegion
	var off uint64
	for i := 0; i < len(recs); {
		c := regionClass(recs[i].kind)
		j := i
		var n uint64
		for j < len(recs) && regionClass(recs[j].kind) == c {
			n += uint64(recs[j].length)
			j++
		}
		out = append(out, trRegion{off: off, class: c, spans: []trSpan{{recs: recs[i:j]}}})
		off += n
		i = j
	}
	return out
}

// fresh describes an image all of whose records are new.
func (b *trBuilder) fresh(recs []blockRec) error { return b.build(regions(recs)) }

// build writes the groups of the regions: those of the data, inode table
// and directory table first, the others (the ones Open reads) last.
func (b *trBuilder) build(rs []trRegion) error {
	front := func(c int) bool { return c == int(kindData) || c == int(kindInodeTable) || c == int(kindDirTable) }
	for pass := range 2 {
		if pass == 1 {
			if err := b.markTail(); err != nil {
				return err
			}
		}
		for _, rg := range rs {
			if front(rg.class) != (pass == 0) {
				continue
			}
			if err := b.region(rg.off); err != nil {
				return err
			}
			for _, sp := range rg.spans {
				if sp.base != nil {
					if err := b.addBase(sp.base, sp.from, sp.to); err != nil {
						return err
					}
					continue
				}
				for i := range sp.recs {
					if err := b.add(&sp.recs[i]); err != nil {
						return err
					}
				}
			}
		}
	}
	return nil
}

// finish writes the root and the footer: the groups must tile the image.
// A zero lineage in ri starts a new one (newLineage of sb and the groups).
func (b *trBuilder) finish(ri rootInfo, sb []byte) error {
	if err := b.flushGroup(); err != nil {
		return err
	}
	gs := slices.Clone(b.groups)
	slices.SortFunc(gs, func(a, c trGroup) int {
		switch {
		case a.imgOff < c.imgOff:
			return -1
		case a.imgOff > c.imgOff:
			return 1
		}
		return 0
	})
	var img uint64
	for _, g := range gs {
		if g.imgOff != img {
			return fmt.Errorf("internal error: trailer groups leave image bytes [%d, %d) undescribed", img, g.imgOff)
		}
		img += g.imgLen
	}
	if img != ri.imageBytes {
		return fmt.Errorf("internal error: trailer groups cover %d bytes, the image has %d", img, ri.imageBytes)
	}
	if ri.lineage == (Lineage{}) {
		ri.lineage = newLineage(sb, gs)
	}
	b.root = ri
	le := binary.LittleEndian
	root := []byte(rootMagic)
	root = le.AppendUint32(root, formatVersion2)
	root = le.AppendUint32(root, ri.flags)
	root = le.AppendUint64(root, ri.imageBytes)
	root = le.AppendUint32(root, ri.sbCRC)
	root = le.AppendUint32(root, ri.generation)
	root = append(root, ri.lineage[:]...)
	root = le.AppendUint32(root, ri.nextInode)
	root = le.AppendUint32(root, ri.liveInodes)
	root = le.AppendUint64(root, ri.garbage)
	root = le.AppendUint64(root, 0)
	root = le.AppendUint32(root, uint32(len(gs)))
	root = le.AppendUint32(root, 0)
	for _, g := range gs {
		root = le.AppendUint64(root, g.idxOff)
		root = le.AppendUint64(root, g.imgLen)
		root = le.AppendUint32(root, g.pages)
		root = le.AppendUint32(root, g.idxLen)
		root = le.AppendUint32(root, g.idxCRC)
		root = le.AppendUint32(root, 0)
	}
	tail := min(b.tail, b.pos)
	f := make([]byte, 0, footerSize)
	f = append(f, footerMagic...)
	f = le.AppendUint32(f, formatVersion2)
	f = le.AppendUint32(f, 0)
	f = le.AppendUint64(f, b.pos)
	f = le.AppendUint64(f, uint64(len(root)))
	f = le.AppendUint64(f, tail)
	f = le.AppendUint32(f, crc32c(root))
	f = le.AppendUint32(f, crc32c(f))
	b.out.trailerWrite(root)
	b.out.trailerWrite(f)
	b.pos += uint64(len(root) + len(f))
	b.written += int64(len(root) + len(f))
	return b.out.err
}

// newLineage names the line a fresh image starts: derived from what the
// image is (its superblock and the checksums of its trailer's groups), so
// that the same tree packs to the same bytes.
func newLineage(sb []byte, groups []trGroup) Lineage {
	h := sha256.New()
	h.Write([]byte("hermesfs lineage v1\x00"))
	h.Write(sb)
	for _, g := range groups {
		h.Write(binary.LittleEndian.AppendUint32(nil, g.idxCRC))
	}
	var l Lineage
	copy(l[:], h.Sum(nil))
	return l
}
