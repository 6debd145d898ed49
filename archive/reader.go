package archive

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	iofs "io/fs"
	"log/slog"
	"sort"
	"sync"
	"syscall"
	"time"
)

// Inode is a squashfs inode number: stable for the life of an archive,
// shared by the hard links of one file, never 0.
type Inode uint32

// Attr is what an archive records about an inode.
type Attr struct {
	Ino   Inode
	Mode  iofs.FileMode // type and permission bits, setuid/setgid/sticky included
	Uid   uint32
	Gid   uint32
	Size  int64 // bytes for files, target length for symlinks, listing size for directories
	Mtime time.Time
	Nlink uint32
	Rdev  uint64 // device number of device nodes (Linux dev_t encoding, as in syscall.Stat_t)
}

// DirEntry is one entry of a directory listing.
type DirEntry struct {
	Name string
	Ino  Inode
	Mode iofs.FileMode // type bits only
}

// ReaderOptions configures Open.
type ReaderOptions struct {
	Name       string // names the archive in errors
	CacheBytes int64  // bound on cached decompressed data blocks; default 32 MiB
	// MetaCacheBytes bounds the decoded metadata kept: metadata blocks,
	// directory listings, file block lists and trailer pages. Default
	// 8 MiB. Metadata not kept is read again when used again.
	MetaCacheBytes int64
	Logger         *slog.Logger
}

// maxObject bounds one inode's block list or one directory's listing as
// read from the tables, so that a hostile image cannot make a read allocate
// without limit (a listing of a million entries is about 40 MiB).
const maxObject = 256 << 20

// Reader gives random access to an archive. All methods are safe for
// concurrent use. Open reads the superblock, the trailer's root and the
// tables' small index arrays; inodes, directory listings and data blocks
// are read, checked and decoded when first used, and kept in caches
// bounded in bytes.
type Reader struct {
	ra   io.ReaderAt
	size int64
	name string
	log  *slog.Logger
	sb   superblock
	dec  decompressor
	bs   int

	tr  *trailer  // a version 1 trailer, read whole at Open
	tr2 *trailer2 // a version 2 trailer, read as used

	ids       []uint32
	fragIdx   []uint64 // the fragment table's index array
	exportIdx []uint64 // the export table's index array; nil without one
	dirEnd    uint64   // where the directory table ends
	refs      map[Inode]uint64
	root      Inode

	cache *blockCache
	meta  *lru[metaKey, any]
	pre   struct {
		off uint64
		b   []byte
	} // bytes Open read ahead, while it runs

	fragUseOnce sync.Once
	fragUse     []int64 // see fragmentUse

	indexOnce sync.Once
	idx       *contentIndex // see index
	sums      sync.Map      // Inode -> sum, computed by contentSum
}

// metaKey names a cached piece of decoded metadata.
type metaKey struct {
	k    uint8
	a, b uint64
}

const (
	mkBlock   = iota + 1 // a metadata block at image offset a
	mkListing            // the listing at table position a (block<<16|offset), b bytes
	mkLayout             // the block list of inode a
	mkTrIndex            // the index page of trailer group a
	mkTrPage             // page b of trailer group a
)

func (r *Reader) corrupt(off uint64, what string, err error) error {
	return &CorruptError{Name: r.name, Offset: int64(off), What: what, Err: err}
}

func (r *Reader) corruptf(off uint64, what, format string, a ...any) error {
	return r.corrupt(off, what, fmt.Errorf(format, a...))
}

// Open reads an archive's superblock, integrity trailer and table indexes
// from ra, which holds size bytes: a few ranges, none of them proportional
// to the number of files (for an archive with a version 1 trailer, the
// trailer; for an image without an export table, mksquashfs -no-exports,
// the directory tree, walked to number the inodes). It reads any squashfs
// 4.0 image (zstd, gzip, lz4, xz or lzma); only archives written by Pack
// carry checksums (Checksummed). Damage found here or later is reported
// with errors matching ErrCorrupt.
func Open(ra io.ReaderAt, size int64, opts ReaderOptions) (*Reader, error) {
	r := &Reader{ra: ra, size: size, name: opts.Name, log: opts.Logger}
	if r.log == nil {
		r.log = slog.New(slog.DiscardHandler)
	}
	if opts.CacheBytes <= 0 {
		opts.CacheBytes = 32 << 20
	}
	if opts.MetaCacheBytes <= 0 {
		opts.MetaCacheBytes = 8 << 20
	}
	r.cache = newBlockCache(opts.CacheBytes)
	r.meta = newLRU[metaKey, any](opts.MetaCacheBytes)
	if err := r.open(); err != nil {
		return nil, err
	}
	return r, nil
}

func (r *Reader) readAt(off uint64, n uint64, what string) ([]byte, error) {
	if off > uint64(r.size) || n > uint64(r.size)-off {
		return nil, r.corruptf(off, what, "%d bytes at offset %d lie beyond the end of the file (%d bytes)", n, off, r.size)
	}
	if p := r.pre; off >= p.off && off-p.off <= uint64(len(p.b)) && n <= uint64(len(p.b))-(off-p.off) {
		return append([]byte(nil), p.b[off-p.off:off-p.off+n]...), nil
	}
	b := make([]byte, n)
	m, err := r.ra.ReadAt(b, int64(off))
	if m == len(b) {
		return b, nil
	}
	if err == nil || errors.Is(err, io.EOF) {
		return nil, r.corruptf(off, what, "short read: %d of %d bytes", m, n)
	}
	return nil, fmt.Errorf("archive %s: read %s at offset %d: %w", r.name, what, off, err)
}

// tailRead is how much of the end of the file Open reads at once: the
// footer, and with it, most of the time, the trailer's root and tail.
const tailRead = 64 << 10

func (r *Reader) open() error {
	if r.size < superblockSize {
		return r.corruptf(0, "superblock", "file of %d bytes is too small", r.size)
	}
	sbb, err := r.readAt(0, superblockSize, "superblock")
	if err != nil {
		return err
	}
	if r.size >= superblockSize+footerSize {
		// The trailer starts after the padded image: read no further
		// back than that (if the superblock is sound).
		var sb superblock
		from := uint64(superblockSize)
		if sb.unmarshal(sbb) == nil && sb.BytesUsed <= uint64(r.size) {
			from = max(from, (sb.BytesUsed+padAlign-1)/padAlign*padAlign)
		}
		if err := r.openTrailer(min(from, uint64(r.size)-footerSize)); err != nil {
			return err
		}
	}
	if r.tr2 != nil {
		if crc32c(sbb) != r.tr2.root.sbCRC {
			return r.corrupt(0, "superblock", errChecksum)
		}
	} else if err := r.check(0, sbb, "superblock"); err != nil {
		return err
	}
	if err := r.sb.unmarshal(sbb); err != nil {
		return r.corrupt(0, "superblock", err)
	}
	if err := r.checkSuperblock(); err != nil {
		return err
	}
	if r.dec, err = newDecompressor(r.sb.Compression); err != nil {
		return fmt.Errorf("archive %s: %w", r.name, err)
	}
	if r.sb.Flags&flagCompOpts != 0 && !r.Checksummed() {
		// Present for some compressors; decoding needs none of them, but
		// the block must be sound. (Checksummed archives: Verify.)
		if _, err := r.metaBlock(superblockSize, kindCompOpts, r.sb.InodeTable); err != nil {
			return err
		}
	}
	if err := r.readIndexes(); err != nil {
		return err
	}
	root, err := r.inodeBare(r.sb.RootInode)
	if err != nil {
		return err
	}
	if basicType(root.typ) != typeDir {
		return r.corruptf(r.sb.InodeTable, "inode table", "root inode is not a directory")
	}
	r.root = root.ino
	if r.exportIdx == nil {
		return r.numberByWalk()
	}
	return nil
}

// openTrailer reads the footer and, by its version, the trailer (version
// 1, whole) or its root and tail (version 2), reading nothing before from
// with the footer.
func (r *Reader) openTrailer(from uint64) error {
	n := min(uint64(r.size)-from, tailRead)
	at := uint64(r.size) - n
	end, err := r.readAt(at, n, "integrity footer")
	if err != nil {
		return err
	}
	fb := end[len(end)-footerSize:]
	foff := uint64(r.size - footerSize)
	version, err := footerVersion(fb)
	switch {
	case errors.Is(err, errNoFooter):
		return nil
	case err != nil:
		return r.corrupt(foff, "integrity footer", err)
	case version == formatVersion:
		f, err := parseFooter(fb, r.size)
		if err != nil {
			return r.corrupt(foff, "integrity footer", err)
		}
		tb, err := r.readAt(f.trailerOff, f.trailerLen, "integrity trailer")
		if err != nil {
			return err
		}
		if r.tr, err = parseTrailer(tb, f); err != nil {
			return r.corrupt(f.trailerOff, "integrity trailer", err)
		}
		return nil
	}
	rootOff, rootLen, tailOff, rootCRC, err := parseFooter2(fb, r.size)
	if err != nil {
		return r.corrupt(foff, "integrity footer", err)
	}
	var tail []byte
	if tailOff >= at {
		tail = end[tailOff-at:]
	} else if tail, err = r.readAt(tailOff, uint64(r.size)-tailOff, "integrity trailer"); err != nil {
		return err
	}
	rb := tail[rootOff-tailOff : rootOff-tailOff+rootLen]
	t, err := parseRoot(rb, rootCRC)
	if err != nil {
		return r.corrupt(rootOff, "integrity trailer root", err)
	}
	t.tailOff, t.tail = tailOff, tail[:rootOff-tailOff]
	t.start = (t.root.imageBytes + padAlign - 1) / padAlign * padAlign
	for _, g := range t.groups {
		if g.idxOff < t.start || g.idxOff > rootOff || uint64(g.idxLen) > rootOff-g.idxOff {
			return r.corruptf(rootOff, "integrity trailer root", "a group's index at %d lies outside the trailer [%d, %d)", g.idxOff, t.start, rootOff)
		}
	}
	r.tr2 = t
	return nil
}

// check verifies b, read at off, against the trailer's record of the block
// there.
func (r *Reader) check(off uint64, b []byte, what string) error {
	if !r.Checksummed() {
		return nil
	}
	bi, ok, err := r.blockAt(off)
	if err != nil {
		return err
	}
	if !ok {
		return r.corruptf(off, what, "no checksum recorded for a block at this offset")
	}
	if int(bi.length) != len(b) {
		return r.corruptf(off, what, "block is %d bytes, checksum covers %d", len(b), bi.length)
	}
	if crc32c(b) != bi.crc {
		return r.corrupt(off, what, errChecksum)
	}
	return nil
}

// blockAt returns the trailer's record of the block starting at off.
func (r *Reader) blockAt(off uint64) (blockInfo, bool, error) {
	switch {
	case r.tr != nil:
		i := r.tr.ext.find(off)
		if i < 0 {
			return blockInfo{}, false, nil
		}
		bi := blockInfo{length: r.tr.ext.len[i], kind: r.tr.ext.kind[i], crc: r.tr.ext.crc[i]}
		if r.tr.blockSums != nil {
			bi.sum = r.tr.blockSums[i]
		}
		return bi, true, nil
	case r.tr2 != nil:
		pg, i, err := r.recordAt(off)
		if err != nil || pg == nil {
			return blockInfo{}, false, err
		}
		return pg.info(i), true, nil
	}
	return blockInfo{}, false, nil
}

func (r *Reader) imageEnd() uint64 {
	switch {
	case r.tr != nil:
		return r.tr.ext.off[len(r.tr.ext.len)]
	case r.tr2 != nil:
		return r.tr2.root.imageBytes
	}
	return r.sb.BytesUsed
}

// trailerStart is where the trailer begins (the padded end of the image),
// or the file's end without one.
func (r *Reader) trailerStart() uint64 {
	switch {
	case r.tr != nil:
		return uint64(r.tr.offset)
	case r.tr2 != nil:
		return r.tr2.start
	}
	return uint64(r.size)
}

func (r *Reader) checkSuperblock() error {
	sb := &r.sb
	bad := func(format string, a ...any) error { return r.corruptf(0, "superblock", format, a...) }
	if sb.Major != 4 || sb.Minor != 0 {
		return bad("squashfs version %d.%d, want 4.0", sb.Major, sb.Minor)
	}
	bs := sb.BlockSize
	if bs < minBlockSize || bs > maxBlockSize || bs&(bs-1) != 0 || sb.BlockLog > 20 || 1<<sb.BlockLog != bs {
		return bad("block size %d (log %d)", bs, sb.BlockLog)
	}
	r.bs = int(bs)
	if sb.BytesUsed > uint64(r.size) {
		return bad("image of %d bytes in a file of %d", sb.BytesUsed, r.size)
	}
	if r.Checksummed() && sb.BytesUsed != r.imageEnd() {
		return bad("image size %d does not match the trailer's %d", sb.BytesUsed, r.imageEnd())
	}
	if !r.Checksummed() {
		// Images from other tools end at bytes_used or its 4 KiB padding
		// (or sit in a larger device). Bytes after the padding that are not
		// a valid footer mean our footer was damaged: refuse rather than
		// silently read without checksums.
		padded := (sb.BytesUsed + padAlign - 1) / padAlign * padAlign
		if uint64(r.size) > padded {
			tail, err := r.readAt(uint64(r.size)-min(uint64(r.size)-padded, footerSize), min(uint64(r.size)-padded, footerSize), "integrity footer")
			if err != nil {
				return err
			}
			for _, c := range tail {
				if c != 0 {
					return r.corruptf(uint64(r.size)-uint64(len(tail)), "integrity footer", "data after the image but no valid footer")
				}
			}
		}
	}
	if sb.Inodes == 0 {
		return bad("no inodes")
	}
	if sb.IDs == 0 {
		return bad("empty id table")
	}
	end := sb.BytesUsed
	if !(superblockSize <= sb.InodeTable && sb.InodeTable < sb.DirTable && sb.DirTable <= end) {
		return bad("inode table at %d, directory table at %d, image end %d", sb.InodeTable, sb.DirTable, end)
	}
	for _, t := range []struct {
		name  string
		start uint64
		opt   bool
	}{{"id table", sb.IDTable, false}, {"fragment table", sb.FragmentTable, false},
		{"export table", sb.ExportTable, true}, {"xattr table", sb.XattrTable, true}} {
		if t.opt && t.start == noTable {
			continue
		}
		if t.start < sb.DirTable || t.start > end {
			return bad("%s at %d outside [%d, %d]", t.name, t.start, sb.DirTable, end)
		}
	}
	if uint64(sb.Fragments) > (end-sb.DirTable)/8*fragsPerBlock {
		return bad("%d fragments cannot fit", sb.Fragments)
	}
	if sb.ExportTable != noTable {
		if eb := (uint64(sb.Inodes) + refsPerBlock - 1) / refsPerBlock; eb > (end-sb.ExportTable)/8 {
			return bad("%d inodes cannot fit the export table", sb.Inodes)
		}
	} else if uint64(sb.Inodes) > (sb.DirTable-sb.InodeTable)*(metaBlockSize/minInodeSize) {
		return bad("%d inodes cannot fit the inode table", sb.Inodes)
	}
	return nil
}

// readIndex reads and checks the index array of count block pointers at
// idx; every pointer must lie in [lo, idx).
func (r *Reader) readIndex(idx, count, lo uint64, what string) ([]uint64, error) {
	end := r.sb.BytesUsed
	if count > (end-idx)/8 {
		return nil, r.corruptf(idx, "table index", "%d entries do not fit", count)
	}
	b, err := r.readChecked(idx, 8*count, kindIndex)
	if err != nil {
		return nil, err
	}
	out := make([]uint64, count)
	for i := range out {
		p := binary.LittleEndian.Uint64(b[8*i:])
		if p < lo || p >= idx {
			return nil, r.corruptf(idx+8*uint64(i), "table index", "%s block at %d outside [%d, %d)", what, p, lo, idx)
		}
		out[i] = p
	}
	return out, nil
}

// readChecked reads n bytes at off, which the trailer describes as one
// block or a run of blocks of kind, and checks them.
func (r *Reader) readChecked(off, n uint64, kind extentKind) ([]byte, error) {
	b, err := r.readAt(off, n, kind.String())
	if err != nil || !r.Checksummed() {
		return b, err
	}
	for at := uint64(0); at < n; {
		bi, ok, err := r.blockAt(off + at)
		if err != nil {
			return nil, err
		}
		if !ok || uint64(bi.length) > n-at {
			return nil, r.corruptf(off+at, kind.String(), "no checksum recorded for a block of %d bytes here", n-at)
		}
		if crc32c(b[at:at+uint64(bi.length)]) != bi.crc {
			return nil, r.corrupt(off+at, kind.String(), errChecksum)
		}
		at += uint64(bi.length)
	}
	return b, nil
}

// readIndexes reads the id table and the fragment and export tables'
// index arrays, and works out where the directory table ends (where the
// next table's first block starts).
func (r *Reader) readIndexes() error {
	sb := &r.sb
	dirEnd := sb.BytesUsed
	lower := func(v uint64) {
		if v > sb.DirTable && v < dirEnd {
			dirEnd = v
		}
	}
	lower(sb.FragmentTable)
	lower(sb.IDTable)
	if sb.ExportTable != noTable {
		lower(sb.ExportTable)
	}
	if sb.XattrTable != noTable {
		lower(sb.XattrTable)
	}
	var err error
	idBlocks := (uint64(sb.IDs) + idsPerBlock - 1) / idsPerBlock
	// The index arrays and the id table's blocks (which lie right before
	// its index) are near the image's end: one read when they are close.
	lo := sb.DirTable
	if idBlocks*(metaBlockSize+2) < sb.IDTable-lo {
		lo = sb.IDTable - idBlocks*(metaBlockSize+2)
	}
	if sb.FragmentTable < lo && sb.BytesUsed-sb.FragmentTable <= tailRead {
		lo = sb.FragmentTable
	}
	if sb.ExportTable < lo && sb.BytesUsed-sb.ExportTable <= tailRead {
		lo = sb.ExportTable
	}
	if sb.BytesUsed-lo <= tailRead+idBlocks*(metaBlockSize+2) {
		if b, err := r.readAt(lo, sb.BytesUsed-lo, "tables"); err == nil {
			r.pre.off, r.pre.b = lo, b
			defer func() { r.pre.b = nil }()
		}
	}
	idIdx, err := r.readIndex(sb.IDTable, idBlocks, sb.DirTable, "id table")
	if err != nil {
		return err
	}
	r.ids = make([]uint32, 0, sb.IDs)
	for k, p := range idIdx {
		lower(p)
		m, err := r.metaBlock(p, kindIDTable, sb.IDTable)
		if err != nil {
			return err
		}
		want := min(uint64(sb.IDs)-uint64(k)*idsPerBlock, idsPerBlock)
		if uint64(len(m.b)) < 4*want {
			return r.corruptf(p, "id table", "holds %d bytes for %d ids", len(m.b), want)
		}
		for i := range want {
			r.ids = append(r.ids, binary.LittleEndian.Uint32(m.b[4*i:]))
		}
	}
	if sb.Fragments > 0 {
		fb := (uint64(sb.Fragments) + fragsPerBlock - 1) / fragsPerBlock
		if r.fragIdx, err = r.readIndex(sb.FragmentTable, fb, sb.DirTable, "fragment table"); err != nil {
			return err
		}
		lower(r.fragIdx[0])
	}
	if sb.ExportTable != noTable {
		eb := (uint64(sb.Inodes) + refsPerBlock - 1) / refsPerBlock
		if r.exportIdx, err = r.readIndex(sb.ExportTable, eb, sb.DirTable, "export table"); err != nil {
			return err
		}
		lower(r.exportIdx[0])
	}
	r.dirEnd = dirEnd
	return nil
}

// numberByWalk finds where every inode is for an image without an export
// table (mksquashfs -no-exports), walking the tree once.
func (r *Reader) numberByWalk() error {
	r.refs = map[Inode]uint64{r.root: r.sb.RootInode}
	return r.walk(true, func(dir Inode, ents []DirEntry, refs []uint64) error {
		for i, e := range ents {
			if _, ok := r.refs[e.Ino]; !ok {
				r.refs[e.Ino] = refs[i]
			}
		}
		return nil
	})
}

// Checksummed reports whether the archive carries our integrity trailer.
// Archives made by other tools are read without checksums.
func (r *Reader) Checksummed() bool { return r.tr != nil || r.tr2 != nil }

// Root returns the root directory's inode.
func (r *Reader) Root() Inode { return r.root }

// Compression reports how the archive's blocks are compressed.
func (r *Reader) Compression() Compression {
	return compressionName(r.sb.Compression, r.sb.Flags)
}

// BlockSize is the archive's data block size.
func (r *Reader) BlockSize() int { return r.bs }

// Inodes is the archive's inode number space: every inode's number is at
// most this. An image packed fresh numbers its inodes 1..Inodes; one packed
// by extending another keeps the numbers of objects that went away unused,
// so it may hold fewer.
func (r *Reader) Inodes() int { return int(r.sb.Inodes) }

// Size is the archive file's size in bytes.
func (r *Reader) Size() int64 { return r.size }

// ModTime is the archive's creation time as recorded in the superblock.
func (r *Reader) ModTime() time.Time { return time.Unix(int64(r.sb.MkfsTime), 0) }

// Lineage returns the line of images this archive belongs to (see
// PackOptions.Extend and Compact); ok is false for an archive written
// without a version 2 trailer, which belongs to none.
func (r *Reader) Lineage() (l Lineage, ok bool) {
	if r.tr2 == nil {
		return Lineage{}, false
	}
	return r.tr2.root.lineage, true
}

// Generation is the number of extending packs since the lineage's last
// fresh pack or compaction: 0 for those themselves (and for archives
// without a lineage).
func (r *Reader) Generation() int {
	if r.tr2 == nil {
		return 0
	}
	return int(r.tr2.root.generation)
}

// GarbageBytes estimates the bytes of the archive that nothing in its tree
// uses any more: the inodes, listings, table blocks, trailer pages and data
// blocks that extending packs replaced or whose files went away, counted
// as they went (a block shared by a file that went and one that stayed
// may count; the estimate errs high). Compact brings it to 0.
func (r *Reader) GarbageBytes() int64 {
	if r.tr2 == nil {
		return 0
	}
	return int64(r.tr2.root.garbage)
}

// refOf returns where inode ino is: its export table entry, or what the
// walk at Open found. A number the image does not use gives ErrNotExist.
func (r *Reader) refOf(ino Inode) (uint64, error) {
	if ino == 0 || uint64(ino) > uint64(r.sb.Inodes) {
		return 0, fmt.Errorf("archive %s: inode %d: %w", r.name, ino, iofs.ErrNotExist)
	}
	if r.exportIdx == nil {
		ref, ok := r.refs[ino]
		if !ok {
			return 0, fmt.Errorf("archive %s: inode %d: %w", r.name, ino, iofs.ErrNotExist)
		}
		return ref, nil
	}
	k := uint64(ino-1) / refsPerBlock
	m, err := r.metaBlock(r.exportIdx[k], kindExportTable, r.sb.ExportTable)
	if err != nil {
		return 0, err
	}
	at := uint64(ino-1) % refsPerBlock * 8
	if at+8 > uint64(len(m.b)) {
		return 0, r.corruptf(r.exportIdx[k], "export table block", "holds %d bytes, inode %d is at %d", len(m.b), ino, at)
	}
	return binary.LittleEndian.Uint64(m.b[at:]), nil
}

// lookupInode returns inode ino. A number that names no inode (a hole in
// the numbers, or an entry whose record carries another number) gives
// ErrNotExist.
func (r *Reader) lookupInode(ino Inode) (*inode, error) {
	ref, err := r.refOf(ino)
	if err != nil {
		return nil, err
	}
	in, err := r.inodeAt(ref)
	if err != nil {
		return nil, err
	}
	if in.ino != ino {
		return nil, fmt.Errorf("archive %s: inode %d: %w", r.name, ino, iofs.ErrNotExist)
	}
	return in, nil
}

// Stat returns the attributes of ino.
func (r *Reader) Stat(ino Inode) (Attr, error) {
	in, err := r.lookupInode(ino)
	if err != nil {
		return Attr{}, err
	}
	return in.attr(), nil
}

// lookupBare is lookupInode without what the trailer records of the
// inode (Attr.Mtime's nanoseconds), for those that need no Attr.
func (r *Reader) lookupBare(ino Inode) (*inode, error) {
	ref, err := r.refOf(ino)
	if err != nil {
		return nil, err
	}
	in, err := r.inodeBare(ref)
	if err != nil {
		return nil, err
	}
	if in.ino != ino {
		return nil, fmt.Errorf("archive %s: inode %d: %w", r.name, ino, iofs.ErrNotExist)
	}
	return in, nil
}

// dirEntries returns the listing of directory dir (shared: callers must
// not modify it).
func (r *Reader) dirEntries(dir Inode) ([]DirEntry, error) {
	in, err := r.lookupBare(dir)
	if err != nil {
		return nil, err
	}
	l, err := r.listing(in)
	if err != nil {
		return nil, err
	}
	return l.ents, nil
}

// Lookup finds name in directory dir. A missing name gives an error
// matching iofs.ErrNotExist; dir not being a directory, syscall.ENOTDIR.
func (r *Reader) Lookup(dir Inode, name string) (Attr, error) {
	d, err := r.lookupBare(dir)
	if err != nil {
		return Attr{}, err
	}
	if basicType(d.typ) != typeDir {
		return Attr{}, fmt.Errorf("archive %s: inode %d: %w", r.name, dir, syscall.ENOTDIR)
	}
	e, ref, ok, err := r.find(d, name)
	if err != nil {
		return Attr{}, err
	}
	if !ok {
		return Attr{}, fmt.Errorf("archive %s: lookup %q in inode %d: %w", r.name, name, dir, iofs.ErrNotExist)
	}
	in, err := r.entryInode(d, e, ref)
	if err != nil {
		return Attr{}, err
	}
	return in.attr(), nil
}

// entryInode reads the inode directory d's entry e names at ref, and
// checks that they agree: the inode carries the entry's number and type,
// the export table puts that number at ref, and a directory names d as
// its parent (so no directory is reachable by two paths: no cycles).
func (r *Reader) entryInode(d *inode, e DirEntry, ref uint64) (*inode, error) {
	in, err := r.inodeAt(ref)
	if err != nil {
		return nil, err
	}
	where := r.sb.DirTable + uint64(d.dirBlk)
	bad := func(format string, a ...any) (*inode, error) {
		return nil, r.corruptf(where, "directory table block", "directory inode %d: entry %q: "+format, append([]any{d.ino, e.Name}, a...)...)
	}
	if in.ino != e.Ino {
		return bad("names inode %d, inode says %d", e.Ino, in.ino)
	}
	if e.Ino == r.root {
		return bad("names the root directory (a cycle)")
	}
	if typeMode(in.typ) != e.Mode {
		return bad("type disagrees with its inode")
	}
	if basicType(in.typ) == typeDir && in.parent != uint32(d.ino) {
		return bad("directory whose parent is inode %d (linked twice, or a cycle)", in.parent)
	}
	if r.exportIdx == nil {
		if xref, ok := r.refs[e.Ino]; ok && xref != ref {
			return bad("inode %d has two locations", e.Ino)
		}
		return in, nil
	}
	xref, err := r.refOf(e.Ino)
	if err != nil {
		return nil, err
	}
	if xref != ref {
		return bad("inode %d is at %#x, the export table says %#x", e.Ino, ref, xref)
	}
	return in, nil
}

// ReadDir lists directory dir, sorted by name. The slice is the caller's.
func (r *Reader) ReadDir(dir Inode) ([]DirEntry, error) {
	ents, err := r.dirEntries(dir)
	if err != nil {
		return nil, err
	}
	return append([]DirEntry(nil), ents...), nil
}

// Readlink returns the target of symlink ino.
func (r *Reader) Readlink(ino Inode) (string, error) {
	in, err := r.lookupBare(ino)
	if err != nil {
		return "", err
	}
	if basicType(in.typ) != typeSymlink {
		return "", fmt.Errorf("archive %s: readlink inode %d: %w", r.name, ino, syscall.EINVAL)
	}
	return in.target, nil
}

// walk visits every directory reachable from the root, breadth first,
// with its listing and the references of its entries. Each directory is
// visited once; with check set, every entry's inode is read and checked
// against the entry (entryInode), so a directory reached twice or a cycle
// is reported as damage.
func (r *Reader) walk(check bool, fn func(dir Inode, ents []DirEntry, refs []uint64) error) error {
	root, err := r.inodeBare(r.sb.RootInode)
	if err != nil {
		return err
	}
	if check && r.exportIdx != nil {
		if ref, err := r.refOf(root.ino); err != nil {
			return err
		} else if ref != r.sb.RootInode {
			return r.corruptf(r.sb.ExportTable, "export table", "the root inode %d is at %#x, the superblock says %#x", root.ino, ref, r.sb.RootInode)
		}
	}
	seen := map[Inode]bool{root.ino: true}
	queue := []*inode{root}
	for len(queue) > 0 {
		d := queue[0]
		queue = queue[1:]
		l, err := r.listing(d)
		if err != nil {
			return err
		}
		for i, e := range l.ents {
			if !check && !e.Mode.IsDir() {
				continue
			}
			var in *inode
			if check {
				if in, err = r.entryInode(d, e, l.refs[i]); err != nil {
					return err
				}
			} else if in, err = r.inodeBare(l.refs[i]); err != nil {
				return err
			}
			if e.Mode.IsDir() {
				if seen[e.Ino] || in.ino != e.Ino {
					return r.corruptf(r.sb.DirTable+uint64(d.dirBlk), "directory table block", "directory inode %d is linked twice (a cycle)", e.Ino)
				}
				seen[e.Ino] = true
				queue = append(queue, in)
			}
		}
		if err := fn(d.ino, l.ents, l.refs); err != nil {
			return err
		}
	}
	return nil
}

// fileInodes lists the archive's regular file inodes, each once (hard
// links share one), in directory order. It walks the whole tree.
func (r *Reader) fileInodes() ([]Inode, error) {
	var out []Inode
	seen := map[Inode]bool{}
	err := r.walk(false, func(_ Inode, ents []DirEntry, _ []uint64) error {
		for _, e := range ents {
			if e.Mode.IsRegular() && !seen[e.Ino] {
				seen[e.Ino] = true
				out = append(out, e.Ino)
			}
		}
		return nil
	})
	return out, err
}

// sortedFind returns the index of name in ents (sorted), or -1.
func sortedFind(ents []DirEntry, name string) int {
	i := sort.Search(len(ents), func(i int) bool { return ents[i].Name >= name })
	if i < len(ents) && ents[i].Name == name {
		return i
	}
	return -1
}
