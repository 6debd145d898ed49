package archive

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	iofs "io/fs"
	"log/slog"
	"math"
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
	CacheBytes int64  // bound on cached decompressed blocks; default 32 MiB
	Logger     *slog.Logger
}

// maxMetadata bounds the decompressed inode, directory and lookup tables a
// reader keeps, so a hostile image cannot make Open allocate without limit.
const maxMetadata = 1 << 30

// Reader gives random access to an archive. All methods are safe for
// concurrent use. Open reads the superblock, the trailer and all metadata
// tables once; data blocks are read, checked and decompressed on demand.
type Reader struct {
	ra   io.ReaderAt
	size int64
	name string
	log  *slog.Logger
	sb   superblock
	dec  decompressor
	tr   *trailer // nil for archives without our trailer
	bs   int

	inodeTab []byte
	inodeBlk blockMap
	dirTab   string
	dirBlk   blockMap
	frags    []fragEntry
	ids      []uint32

	refs    []uint64 // by inode number; refSet marks known entries
	dirs    map[Inode]dirSpan
	entries []DirEntry
	root    Inode

	cache   *blockCache
	layouts sync.Map // Inode -> *fileLayout

	fragUseOnce sync.Once
	fragUse     []int64 // see fragmentUse

	indexOnce sync.Once
	idx       *contentIndex // see index
	sums      sync.Map      // Inode -> sum, computed by contentSum
}

const refSet = 1 << 63

type dirSpan struct{ start, n uint32 }

// blockMap maps the on-disk start of each metadata block of a table
// (relative to the table) to where its bytes begin in the decompressed
// table.
type blockMap struct {
	disk   []uint64
	uncomp []uint64
}

func (m *blockMap) lookup(disk uint64) (uint64, bool) {
	i := sort.Search(len(m.disk), func(i int) bool { return m.disk[i] >= disk })
	if i < len(m.disk) && m.disk[i] == disk {
		return m.uncomp[i], true
	}
	return 0, false
}

func (r *Reader) corrupt(off uint64, what string, err error) error {
	return &CorruptError{Name: r.name, Offset: int64(off), What: what, Err: err}
}

func (r *Reader) corruptf(off uint64, what, format string, a ...any) error {
	return r.corrupt(off, what, fmt.Errorf(format, a...))
}

// Open reads an archive's superblock, trailer and metadata tables from r,
// which holds size bytes. It reads any squashfs 4.0 image (zstd, gzip, lz4,
// xz or lzma); only archives written by Pack carry checksums (Checksummed).
// Damage found here or later is reported with errors matching ErrCorrupt.
func Open(ra io.ReaderAt, size int64, opts ReaderOptions) (*Reader, error) {
	r := &Reader{ra: ra, size: size, name: opts.Name, log: opts.Logger}
	if r.log == nil {
		r.log = slog.New(slog.DiscardHandler)
	}
	if opts.CacheBytes <= 0 {
		opts.CacheBytes = 32 << 20
	}
	if err := r.open(); err != nil {
		return nil, err
	}
	r.cache = newBlockCache(opts.CacheBytes)
	return r, nil
}

func (r *Reader) readAt(off uint64, n uint64, what string) ([]byte, error) {
	if off > uint64(r.size) || n > uint64(r.size)-off {
		return nil, r.corruptf(off, what, "%d bytes at offset %d lie beyond the end of the file (%d bytes)", n, off, r.size)
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

func (r *Reader) open() error {
	if r.size < superblockSize {
		return r.corruptf(0, "superblock", "file of %d bytes is too small", r.size)
	}
	if r.size >= superblockSize+footerSize {
		fb, err := r.readAt(uint64(r.size-footerSize), footerSize, "integrity footer")
		if err != nil {
			return err
		}
		f, err := parseFooter(fb, r.size)
		switch {
		case errors.Is(err, errNoFooter):
		case err != nil:
			return r.corrupt(uint64(r.size-footerSize), "integrity footer", err)
		default:
			tb, err := r.readAt(f.trailerOff, f.trailerLen, "integrity trailer")
			if err != nil {
				return err
			}
			if r.tr, err = parseTrailer(tb, f); err != nil {
				return r.corrupt(f.trailerOff, "integrity trailer", err)
			}
		}
	}
	sbb, err := r.readAt(0, superblockSize, "superblock")
	if err != nil {
		return err
	}
	if err := r.check(0, sbb, "superblock"); err != nil {
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
	if r.sb.Flags&flagCompOpts != 0 {
		// Present for some compressors; decoding needs none of them, but
		// the block must be sound.
		if _, _, err := r.readMetaAt(superblockSize, kindCompOpts); err != nil {
			return err
		}
	}
	if err := r.readTables(); err != nil {
		return err
	}
	return r.walk()
}

// check verifies b, read at off, against the trailer's extent there.
func (r *Reader) check(off uint64, b []byte, what string) error {
	if r.tr == nil {
		return nil
	}
	i := r.tr.ext.find(off)
	if i < 0 {
		return r.corruptf(off, what, "no checksum recorded for a block at this offset")
	}
	if int(r.tr.ext.len[i]) != len(b) {
		return r.corruptf(off, what, "block is %d bytes, checksum covers %d", len(b), r.tr.ext.len[i])
	}
	if crc32c(b) != r.tr.ext.crc[i] {
		return r.corrupt(off, what, errChecksum)
	}
	return nil
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
	if r.tr != nil && sb.BytesUsed != r.tr.ext.off[len(r.tr.ext.len)] {
		return bad("image size %d does not match the trailer's %d", sb.BytesUsed, r.tr.ext.off[len(r.tr.ext.len)])
	}
	if r.tr == nil {
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
	return nil
}

// readMetaAt reads one metadata block at off: it returns the decompressed
// bytes and the block's on-disk length.
func (r *Reader) readMetaAt(off uint64, kind extentKind) ([]byte, uint64, error) {
	hb, err := r.readAt(off, 2, kind.String())
	if err != nil {
		return nil, 0, err
	}
	h := binary.LittleEndian.Uint16(hb)
	n := uint64(h &^ metaUncompBit)
	if n == 0 || n > metaBlockSize {
		return nil, 0, r.corruptf(off, kind.String(), "metadata block length %d", n)
	}
	b, err := r.readAt(off, n+2, kind.String())
	if err != nil {
		return nil, 0, err
	}
	out, err := r.metaBlock(off, b, kind)
	return out, n + 2, err
}

// metaBlock checks and decodes a metadata block b (header included) read at
// off.
func (r *Reader) metaBlock(off uint64, b []byte, kind extentKind) ([]byte, error) {
	if err := r.check(off, b, kind.String()); err != nil {
		return nil, err
	}
	h := binary.LittleEndian.Uint16(b)
	if h&metaUncompBit != 0 {
		return b[2:], nil
	}
	out, err := r.dec.decompress(nil, b[2:], metaBlockSize)
	if err != nil {
		return nil, r.corruptf(off, kind.String(), "decompress: %v", err)
	}
	return out, nil
}

// metaRegion is the tail of the image holding every table, read at once so
// that a ranged reader needs one request for all metadata.
type metaRegion struct {
	r     *Reader
	start uint64
	b     []byte
	used  uint64 // decompressed bytes so far, bounded by maxMetadata
}

// block decodes the metadata block at absolute offset off, returning its
// bytes and on-disk length.
func (m *metaRegion) block(off uint64, kind extentKind) ([]byte, uint64, error) {
	r := m.r
	if off < m.start || off+2 > m.start+uint64(len(m.b)) {
		return nil, 0, r.corruptf(off, kind.String(), "metadata block outside the tables")
	}
	rel := off - m.start
	h := binary.LittleEndian.Uint16(m.b[rel:])
	n := uint64(h &^ metaUncompBit)
	if n == 0 || n > metaBlockSize || rel+2+n > uint64(len(m.b)) {
		return nil, 0, r.corruptf(off, kind.String(), "metadata block length %d", n)
	}
	out, err := r.metaBlock(off, m.b[rel:rel+2+n], kind)
	if err != nil {
		return nil, 0, err
	}
	m.used += uint64(len(out))
	if m.used > maxMetadata {
		return nil, 0, r.corruptf(off, kind.String(), "more than %d bytes of metadata", maxMetadata)
	}
	return out, n + 2, nil
}

// table decodes the consecutive metadata blocks from start to end into one
// stream.
func (m *metaRegion) table(start, end uint64, kind extentKind) ([]byte, blockMap, error) {
	var out []byte
	var bm blockMap
	for off := start; off < end; {
		b, n, err := m.block(off, kind)
		if err != nil {
			return nil, bm, err
		}
		bm.disk = append(bm.disk, off-start)
		bm.uncomp = append(bm.uncomp, uint64(len(out)))
		out = append(out, b...)
		off += n
		if off > end {
			return nil, bm, m.r.corruptf(off-n, kind.String(), "block runs past the end of its table")
		}
	}
	return out, bm, nil
}

// indexed decodes a table found through an index of count block pointers at
// idx, returning the concatenated blocks and the lowest block start.
func (m *metaRegion) indexed(idx uint64, count uint64, limit uint64, kind extentKind) ([]byte, uint64, error) {
	r := m.r
	if idx < m.start || count > (limit-idx)/8 || idx+8*count > m.start+uint64(len(m.b)) {
		return nil, 0, r.corruptf(idx, "table index", "%d entries do not fit", count)
	}
	var out []byte
	first := uint64(math.MaxUint64)
	for i := range count {
		at := idx + 8*i
		p := binary.LittleEndian.Uint64(m.b[at-m.start:])
		if p >= idx {
			return nil, 0, r.corruptf(at, "table index", "points at %d, after the index", p)
		}
		b, _, err := m.block(p, kind)
		if err != nil {
			return nil, 0, err
		}
		out = append(out, b...)
		first = min(first, p)
	}
	return out, first, nil
}

func (r *Reader) readTables() error {
	sb := &r.sb
	end := sb.BytesUsed
	if end-sb.InodeTable > maxMetadata {
		return r.corruptf(sb.InodeTable, "inode table", "metadata of %d bytes", end-sb.InodeTable)
	}
	b, err := r.readAt(sb.InodeTable, end-sb.InodeTable, "metadata tables")
	if err != nil {
		return err
	}
	m := &metaRegion{r: r, start: sb.InodeTable, b: b}
	if r.tr != nil {
		// Check every extent of the region (index arrays included) up
		// front; blocks decoded below are checked again as they are read.
		i := r.tr.ext.find(sb.InodeTable)
		if i < 0 {
			return r.corruptf(sb.InodeTable, "inode table", "no checksum recorded for the table start")
		}
		ex := &r.tr.ext
		for ; i < len(ex.len); i++ {
			rel := ex.off[i] - sb.InodeTable
			if err := r.check(ex.off[i], b[rel:rel+uint64(ex.len[i])], ex.kind[i].String()); err != nil {
				return err
			}
		}
	}

	// The directory table ends where the next table's first block starts.
	dirEnd := end
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

	idBlocks := (uint64(sb.IDs) + idsPerBlock - 1) / idsPerBlock
	idb, first, err := m.indexed(sb.IDTable, idBlocks, end, kindIDTable)
	if err != nil {
		return err
	}
	lower(first)
	if uint64(len(idb)) < 4*uint64(sb.IDs) {
		return r.corruptf(sb.IDTable, "id table", "holds %d bytes for %d ids", len(idb), sb.IDs)
	}
	r.ids = make([]uint32, sb.IDs)
	for i := range r.ids {
		r.ids[i] = binary.LittleEndian.Uint32(idb[4*i:])
	}

	if sb.Fragments > 0 {
		fb := (uint64(sb.Fragments) + fragsPerBlock - 1) / fragsPerBlock
		ftab, first, err := m.indexed(sb.FragmentTable, fb, end, kindFragTable)
		if err != nil {
			return err
		}
		lower(first)
		if uint64(len(ftab)) < fragEntrySize*uint64(sb.Fragments) {
			return r.corruptf(sb.FragmentTable, "fragment table", "holds %d bytes for %d fragments", len(ftab), sb.Fragments)
		}
		r.frags = make([]fragEntry, sb.Fragments)
		for i := range r.frags {
			e := ftab[fragEntrySize*i:]
			r.frags[i] = fragEntry{start: binary.LittleEndian.Uint64(e), word: binary.LittleEndian.Uint32(e[8:])}
		}
	}
	if sb.ExportTable != noTable {
		// Only its position matters (it bounds the directory table); inode
		// numbers are resolved by walking the tree, which also checks it.
		eb := (uint64(sb.Inodes) + refsPerBlock - 1) / refsPerBlock
		if sb.ExportTable >= m.start && eb <= (end-sb.ExportTable)/8 {
			lower(binary.LittleEndian.Uint64(m.b[sb.ExportTable-m.start:]))
		}
	}

	var bm blockMap
	if r.inodeTab, bm, err = m.table(sb.InodeTable, sb.DirTable, kindInodeTable); err != nil {
		return err
	}
	r.inodeBlk = bm
	dt, bm, err := m.table(sb.DirTable, dirEnd, kindDirTable)
	if err != nil {
		return err
	}
	r.dirTab, r.dirBlk = string(dt), bm
	return nil
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

	// regular files
	start   uint64
	frag    uint32
	fragOff uint32
	blocks  uint64 // position of the block list in the inode table
	// directories
	dirBlk uint32
	dirOff uint16
	parent uint32
	idxCnt uint16
	idxAt  uint64 // position of the directory index in the inode table
	// symlinks
	target string
}

const minInodeSize = 20 // the smallest inode (fifo, socket)

// inodeAt decodes the inode at ref.
func (r *Reader) inodeAt(ref uint64) (*inode, error) {
	base, ok := r.inodeBlk.lookup(refBlock(ref))
	if !ok {
		return nil, r.corruptf(r.sb.InodeTable+refBlock(ref), "inode table block", "inode reference %#x names no metadata block", ref)
	}
	pos := base + uint64(refOffset(ref))
	t := r.inodeTab
	where := r.sb.InodeTable + refBlock(ref)
	bad := func(format string, a ...any) (*inode, error) {
		return nil, r.corruptf(where, "inode table block", "inode %#x: "+format, append([]any{ref}, a...)...)
	}
	need := func(n uint64) bool { return pos <= uint64(len(t)) && n <= uint64(len(t))-pos }
	if !need(16) {
		return bad("truncated")
	}
	le := binary.LittleEndian
	in := &inode{
		typ:   le.Uint16(t[pos:]),
		perm:  le.Uint16(t[pos+2:]),
		mtime: le.Uint32(t[pos+8:]),
		ino:   Inode(le.Uint32(t[pos+12:])),
		nlink: 1,
	}
	uidx, gidx := le.Uint16(t[pos+4:]), le.Uint16(t[pos+6:])
	if int(uidx) >= len(r.ids) || int(gidx) >= len(r.ids) {
		return bad("owner index out of range")
	}
	in.uid, in.gid = r.ids[uidx], r.ids[gidx]
	if in.ino == 0 || uint32(in.ino) > r.sb.Inodes {
		return bad("inode number %d out of range", in.ino)
	}
	if in.perm&^0o7777 != 0 {
		return bad("mode %#o", in.perm)
	}
	pos += 16
	switch in.typ {
	case typeDir:
		if !need(16) {
			return bad("truncated")
		}
		in.dirBlk = le.Uint32(t[pos:])
		in.nlink = le.Uint32(t[pos+4:])
		in.size = uint64(le.Uint16(t[pos+8:]))
		in.dirOff = le.Uint16(t[pos+10:])
		in.parent = le.Uint32(t[pos+12:])
	case typeLDir:
		if !need(24) {
			return bad("truncated")
		}
		in.nlink = le.Uint32(t[pos:])
		in.size = uint64(le.Uint32(t[pos+4:]))
		in.dirBlk = le.Uint32(t[pos+8:])
		in.parent = le.Uint32(t[pos+12:])
		in.idxCnt = le.Uint16(t[pos+16:])
		in.dirOff = le.Uint16(t[pos+18:])
		in.idxAt = pos + 24
	case typeFile:
		if !need(16) {
			return bad("truncated")
		}
		in.start = uint64(le.Uint32(t[pos:]))
		in.frag = le.Uint32(t[pos+4:])
		in.fragOff = le.Uint32(t[pos+8:])
		in.size = uint64(le.Uint32(t[pos+12:]))
		in.blocks = pos + 16
	case typeLFile:
		if !need(40) {
			return bad("truncated")
		}
		in.start = le.Uint64(t[pos:])
		in.size = le.Uint64(t[pos+8:])
		in.nlink = le.Uint32(t[pos+24:])
		in.frag = le.Uint32(t[pos+28:])
		in.fragOff = le.Uint32(t[pos+32:])
		in.blocks = pos + 40
	case typeSymlink, typeLSymlink:
		if !need(8) {
			return bad("truncated")
		}
		in.nlink = le.Uint32(t[pos:])
		n := uint64(le.Uint32(t[pos+4:]))
		if n == 0 || n > maxSymlinkLen {
			return bad("symlink target of %d bytes", n)
		}
		pos += 8
		if !need(n) {
			return bad("truncated")
		}
		in.target = string(t[pos : pos+n])
		in.size = n
	case typeBlockDev, typeCharDev, typeLBlock, typeLChar:
		if !need(8) {
			return bad("truncated")
		}
		in.nlink = le.Uint32(t[pos:])
		in.rdev = le.Uint32(t[pos+4:])
	case typeFifo, typeSocket, typeLFifo, typeLSocket:
		if !need(4) {
			return bad("truncated")
		}
		in.nlink = le.Uint32(t[pos:])
	default:
		return bad("unknown type %d", in.typ)
	}
	if in.size > math.MaxInt64 {
		return bad("size %d", in.size)
	}
	return in, nil
}

func (in *inode) attr(r *Reader) Attr {
	a := Attr{
		Ino:   in.ino,
		Mode:  goMode(in.perm, in.typ),
		Uid:   in.uid,
		Gid:   in.gid,
		Size:  int64(in.size),
		Nlink: in.nlink,
	}
	var ns uint32
	if r.tr != nil && int(in.ino) <= len(r.tr.mtimeNs) {
		ns = r.tr.mtimeNs[in.ino-1]
	}
	a.Mtime = time.Unix(int64(in.mtime), int64(ns))
	if m := basicType(in.typ); m == typeBlockDev || m == typeCharDev {
		a.Rdev = decodeDev(in.rdev)
	}
	return a
}

// walk resolves every inode number reachable from the root and indexes the
// directories, checking the structure as it goes: names valid, sorted and
// unique; entries agreeing with their inodes; no directory reached twice
// (which rules out cycles).
func (r *Reader) walk() error {
	sb := &r.sb
	if uint64(sb.Inodes) > uint64(len(r.inodeTab))/minInodeSize {
		return r.corruptf(sb.InodeTable, "inode table", "%d inodes cannot fit in %d bytes", sb.Inodes, len(r.inodeTab))
	}
	root, err := r.inodeAt(sb.RootInode)
	if err != nil {
		return err
	}
	if basicType(root.typ) != typeDir {
		return r.corruptf(sb.InodeTable, "inode table", "root inode is not a directory")
	}
	r.root = root.ino
	r.refs = make([]uint64, sb.Inodes+1)
	r.refs[root.ino] = sb.RootInode | refSet
	r.dirs = map[Inode]dirSpan{}
	queue := []*inode{root}
	for len(queue) > 0 {
		d := queue[0]
		queue = queue[1:]
		start := len(r.entries)
		err := r.parseDir(d, func(e DirEntry, ref uint64) error {
			seen := r.refs[e.Ino] != 0
			if seen && r.refs[e.Ino] != ref|refSet {
				return fmt.Errorf("inode %d has two locations", e.Ino)
			}
			if seen && e.Mode.IsDir() {
				return fmt.Errorf("directory inode %d is linked twice (a cycle)", e.Ino)
			}
			in, err := r.inodeAt(ref)
			if err != nil {
				return err
			}
			if in.ino != e.Ino {
				return fmt.Errorf("entry %q names inode %d, inode says %d", e.Name, e.Ino, in.ino)
			}
			if typeMode(in.typ) != e.Mode {
				return fmt.Errorf("entry %q type disagrees with its inode", e.Name)
			}
			if !seen {
				r.refs[e.Ino] = ref | refSet
				if e.Mode.IsDir() {
					queue = append(queue, in)
				}
			}
			r.entries = append(r.entries, e)
			return nil
		})
		if err != nil {
			var ce *CorruptError
			if errors.As(err, &ce) {
				return err
			}
			return r.corrupt(sb.DirTable+uint64(d.dirBlk), "directory table block", err)
		}
		if len(r.entries)-start > math.MaxUint32 {
			return r.corruptf(sb.DirTable, "directory table", "directory too large")
		}
		r.dirs[d.ino] = dirSpan{start: uint32(start), n: uint32(len(r.entries) - start)}
	}
	return nil
}

// parseDir decodes the listing of directory d, calling fn for each entry
// in order.
func (r *Reader) parseDir(d *inode, fn func(e DirEntry, ref uint64) error) error {
	if d.size < 3 {
		return fmt.Errorf("directory inode %d: size %d", d.ino, d.size)
	}
	n := d.size - 3
	if n == 0 {
		return nil
	}
	base, ok := r.dirBlk.lookup(uint64(d.dirBlk))
	if !ok {
		return fmt.Errorf("directory inode %d: listing at %d names no metadata block", d.ino, d.dirBlk)
	}
	pos := base + uint64(d.dirOff)
	t := r.dirTab
	if pos > uint64(len(t)) || n > uint64(len(t))-pos {
		return fmt.Errorf("directory inode %d: listing of %d bytes runs past the table", d.ino, n)
	}
	t = t[pos : pos+n]
	var prev string
	first := true
	for len(t) > 0 {
		if len(t) < 12 {
			return fmt.Errorf("directory inode %d: truncated header", d.ino)
		}
		count := uint64(u32s(t, 0)) + 1
		blk := u32s(t, 4)
		baseIno := u32s(t, 8)
		t = t[12:]
		if count > dirMaxRun {
			return fmt.Errorf("directory inode %d: header with %d entries", d.ino, count)
		}
		for range count {
			if len(t) < 8 {
				return fmt.Errorf("directory inode %d: truncated entry", d.ino)
			}
			off := u16s(t, 0)
			delta := int16(u16s(t, 2))
			typ := u16s(t, 4)
			nlen := uint64(u16s(t, 6)) + 1
			t = t[8:]
			if nlen > uint64(len(t)) || nlen > maxNameLen {
				return fmt.Errorf("directory inode %d: name of %d bytes", d.ino, nlen)
			}
			name := t[:nlen]
			t = t[nlen:]
			if !validName(name) {
				return fmt.Errorf("directory inode %d: invalid name %q", d.ino, name)
			}
			if !first && name <= prev {
				return fmt.Errorf("directory inode %d: names not sorted or duplicated at %q", d.ino, name)
			}
			first, prev = false, name
			ino := int64(baseIno) + int64(delta)
			if ino <= 0 || ino > int64(r.sb.Inodes) {
				return fmt.Errorf("directory inode %d: entry %q names inode %d", d.ino, name, ino)
			}
			if typ < typeDir || typ > typeSocket {
				return fmt.Errorf("directory inode %d: entry %q has type %d", d.ino, name, typ)
			}
			e := DirEntry{Name: name, Ino: Inode(ino), Mode: typeMode(typ)}
			if err := fn(e, inodeRef(uint64(blk), off)); err != nil {
				return err
			}
		}
	}
	return nil
}

// Checksummed reports whether the archive carries our integrity trailer.
// Archives made by other tools are read without checksums.
func (r *Reader) Checksummed() bool { return r.tr != nil }

// Root returns the root directory's inode.
func (r *Reader) Root() Inode { return r.root }

// Compression reports how the archive's blocks are compressed.
func (r *Reader) Compression() Compression {
	return compressionName(r.sb.Compression, r.sb.Flags)
}

// BlockSize is the archive's data block size.
func (r *Reader) BlockSize() int { return r.bs }

// Inodes is the number of inodes in the archive.
func (r *Reader) Inodes() int { return int(r.sb.Inodes) }

// Size is the archive file's size in bytes.
func (r *Reader) Size() int64 { return r.size }

// ModTime is the archive's creation time as recorded in the superblock.
func (r *Reader) ModTime() time.Time { return time.Unix(int64(r.sb.MkfsTime), 0) }

func (r *Reader) lookupInode(ino Inode) (*inode, error) {
	if ino == 0 || int(ino) >= len(r.refs) || r.refs[ino] == 0 {
		return nil, fmt.Errorf("archive %s: inode %d: %w", r.name, ino, iofs.ErrNotExist)
	}
	return r.inodeAt(r.refs[ino] &^ refSet)
}

// Stat returns the attributes of ino.
func (r *Reader) Stat(ino Inode) (Attr, error) {
	in, err := r.lookupInode(ino)
	if err != nil {
		return Attr{}, err
	}
	return in.attr(r), nil
}

func (r *Reader) dirEntries(dir Inode) ([]DirEntry, error) {
	sp, ok := r.dirs[dir]
	if !ok {
		if _, err := r.lookupInode(dir); err != nil {
			return nil, err
		}
		return nil, fmt.Errorf("archive %s: inode %d: %w", r.name, dir, syscall.ENOTDIR)
	}
	return r.entries[sp.start : sp.start+sp.n], nil
}

// Lookup finds name in directory dir. A missing name gives an error
// matching iofs.ErrNotExist; dir not being a directory, syscall.ENOTDIR.
func (r *Reader) Lookup(dir Inode, name string) (Attr, error) {
	ents, err := r.dirEntries(dir)
	if err != nil {
		return Attr{}, err
	}
	i := sort.Search(len(ents), func(i int) bool { return ents[i].Name >= name })
	if i == len(ents) || ents[i].Name != name {
		return Attr{}, fmt.Errorf("archive %s: lookup %q in inode %d: %w", r.name, name, dir, iofs.ErrNotExist)
	}
	return r.Stat(ents[i].Ino)
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
	in, err := r.lookupInode(ino)
	if err != nil {
		return "", err
	}
	if basicType(in.typ) != typeSymlink {
		return "", fmt.Errorf("archive %s: readlink inode %d: %w", r.name, ino, syscall.EINVAL)
	}
	return in.target, nil
}

func u16s(s string, i int) uint16 { return uint16(s[i]) | uint16(s[i+1])<<8 }
func u32s(s string, i int) uint32 { return uint32(u16s(s, i)) | uint32(u16s(s, i+2))<<16 }
