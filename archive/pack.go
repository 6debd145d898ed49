package archive

import (
	"bufio"
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	iofs "io/fs"
	"log/slog"
	"math"
	"os"
	"path"
	"runtime"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// PackOptions configures Pack. The zero value packs with zstd level 3 in
// 128 KiB blocks on all cores.
type PackOptions struct {
	Compression Compression // default Zstd
	// Level is the compressor's level; 0 means its default (zstd 3, gzip 9,
	// lz4 fast). zstd 1..22 map onto four encoder speeds (1-2 fastest,
	// 3-5 default, 6-9 better, 10+ best); gzip 1..9; lz4 0..9 (2+ is HC).
	Level int
	// BlockSize is the data block size: a power of two from 4 KiB to 1 MiB.
	// Default 128 KiB.
	BlockSize int
	// Workers is the number of goroutines compressing blocks. Default
	// runtime.GOMAXPROCS(0).
	Workers int
	// ModTime is the superblock's creation time. Zero means the newest
	// mtime in the tree, so the same tree always packs to the same bytes.
	ModTime time.Time
	Logger  *slog.Logger

	// Base is an earlier archive of the same tree, usually the previous
	// snapshot, that the new archive builds on (see "Snapshots that cost
	// what changed" in the package documentation). Files whose content it
	// holds — files that are its content (BlockSource), files whose
	// content sum it records (copies, files written back unchanged) —
	// are not read again, and a changed file's unchanged blocks are
	// copied from it. When Base was written by Pack with the same
	// compression, options and block size, the new archive starts with
	// Base's data region byte for byte and unchanged files point into it,
	// unless more than MaxGarbage of that region is garbage; then the
	// archive is laid out afresh (compacted). PackResult.Copies lists the
	// byte ranges the new archive shares with Base. nil: no base.
	Base *Reader
	// MaxGarbage is the share of the new archive's data that may be
	// garbage (Base's blocks of deleted or changed files) for Pack to
	// still append to Base; it is weighed before packing, estimating the
	// new data at Base's compression ratio. 0 means DefaultMaxGarbage; a
	// negative value never appends.
	MaxGarbage float64
	// Segment makes the destination receive only the image's new bytes:
	// every block copied from another archive (Base, a file's
	// BlockSource or PartialSource) is neither read nor written, and
	// PackResult.Runs says which archive's bytes stand there. The
	// destination gets the rest in image order, superblock first: the
	// segment a store keeps for this image (see uploader's extents). The
	// layout is always fresh (never appended to Base: the copies cost
	// nothing either way, and garbage would keep old bytes in use), and
	// PackResult.SHA256 is not computed. The destination must be an
	// *os.File (WriteAt puts the superblock at its start).
	Segment bool
	// Extend makes a Segment pack on Base grow Base's image instead of
	// laying out a fresh one: Base's data region, inode and directory
	// tables and trailer pages stay where they are (copies, no new bytes),
	// and the pack writes only what changed, after them (see "Extending"
	// in the package documentation). The source must implement ChangeFS:
	// Pack then lists only the directories it does not say are unchanged,
	// and reads only the files that changed. Unchanged objects keep their
	// inode numbers (and Base's inode records); changed ones keep their
	// numbers. It needs Base written by Pack with a version 2 trailer, the
	// same compression, compressor options and block size; when it cannot
	// extend (those, a source without ChangeFS, a hard link changed while
	// another of its names is in an unchanged directory) Pack lays the
	// image out afresh and says why in PackResult.ExtendFallback; with a
	// ChangeFS source it still keeps Base's numbers (on a base without
	// a version 2 trailer, in a new lineage), so the next pack can
	// extend the image (PackResult.KeptNumbers). PackResult.Base is
	// BaseExtended when it extended.
	Extend bool

	// Progress, if set, is called on Pack's goroutine once the files'
	// content is about to be read (all zero but the totals) and after each
	// regular file is read or found elsewhere, with the counts so far. It
	// must return quickly; rate-limiting what it shows is its business.
	Progress func(PackProgress)

	noSums    bool         // tests: record no content sums, as archives did before them
	trailerV1 bool         // tests: write the version 1 trailer, as archives did before version 2
	noCheck   bool         // benchmarks: skip Pack's check of its own blocks (worker.check, store)
	tamper    func(*job)   // tests: alter a processed block before it is checked
	probe     *formatProbe // tests: write layouts our packs never write, to see what readers accept
}

// formatProbe bends the layout for TestFormatProbes.
type formatProbe struct {
	cutBefore string // before this directory's listing and inode, end the current inode and directory metablocks short
	inoGap    uint32 // number inodes 1*gap, 2*gap, ...: the numbers between are holes (export entry 0)
	inoExtra  uint32 // sb.Inodes this far past the highest number in use
}

// PackProgress is how far Pack is through the files' content.
type PackProgress struct {
	Files, Bytes           int64 // regular files and their bytes done
	TotalFiles, TotalBytes int64 // of the whole tree
}

// PackResult describes a packed archive.
type PackResult struct {
	Size        int64    // bytes written to w
	SHA256      [32]byte // of those bytes; zero when Hole is set
	Inodes      int64    // inodes in the archive (hard links share one)
	Files       int64    // regular files (inodes)
	Dirs        int64    // directories, the root included
	DataBytes   int64    // bytes of regular file content in the tree
	ReusedBytes int64    // of DataBytes, bytes of files whose content was taken from an earlier archive (BlockSource, Base) instead of being read and compressed
	// MatchedBytes, of DataBytes, are bytes read that Base already
	// stores as a data block of the same content (found by its sum): the
	// block is copied from Base instead of compressed. An appended log's
	// leading blocks, a file rewritten with most blocks the same.
	MatchedBytes int64

	// How PackOptions.Base was used, and what the archive shares with it.
	Base BaseUse
	// Copies are the byte ranges of the archive that are verbatim copies
	// of ranges of Base, in increasing Offset, adjacent ones merged: the
	// shared prefix when appending, then blocks copied from Base.
	Copies []CopyRange
	// CopiedBytes is the total length of Copies: the bytes a store that
	// can copy from Base need not receive again.
	CopiedBytes int64
	// SharedBytes is the length of the prefix (from the end of the
	// superblock) that sits at the same offsets as in Base.
	SharedBytes int64
	// GarbageBytes are the bytes of the shared prefix that no file uses
	// any more; GarbageBytes/Size is what compaction bounds.
	GarbageBytes int64

	// Runs lay the image out when packed with PackOptions.Segment, in
	// order; SegmentSize is the bytes the destination received.
	Runs        []Run
	SegmentSize int64

	// Lineage and Generation are the image's (see Reader.Lineage and
	// Reader.Generation). When the image extended Base (BaseExtended) or
	// was compacted, GarbageBytes is its trailer's estimate of bytes no
	// longer used (Reader.GarbageBytes) rather than the shared prefix's,
	// Inodes counts the inodes in use, and Files and Dirs count those this
	// pack wrote.
	Lineage    Lineage
	Generation int
	// ExtendFallback says why PackOptions.Extend was asked for but the
	// image laid out afresh; empty otherwise.
	ExtendFallback string
	// KeptNumbers: every inode the source's ChangeFS says stands for an
	// inode of Base (changed or not) has Base's number in the image, so
	// the image may in turn be the Base of an extending pack whose
	// ChangeFS answers in Base's numbers. True when the pack extended
	// Base, when an extending pack fell back to a fresh layout, and for
	// Compact.
	KeptNumbers bool
}

// Run is a stretch of an image packed with PackOptions.Segment: Length
// bytes that are new, the destination's bytes from Offset (Source nil),
// or a copy of the archive Source's bytes from Offset.
type Run struct {
	Source         *Reader
	Offset, Length int64
}

// BlockSource is an optional interface of the files Pack opens from its
// source FS. A file that is byte-for-byte the content of inode ino of the
// archive r (for example an unchanged file of a lower layer) returns them
// with ok=true; Pack then copies the compressed blocks verbatim from r,
// verifying their checksums as it goes, instead of reading and
// recompressing the content. Pack only does so when r is checksummed and
// was written with the same compression and block size as the new archive,
// and the inode's size matches the file's; otherwise it reads the file.
type BlockSource interface {
	ArchiveSource() (r *Reader, ino Inode, ok bool)
}

// PartialSource is an optional interface of the files Pack opens from its
// source FS: a file that is inode ino of the archive r with some of its
// bytes changed (a file copied up by range and written to, a log
// appended to). changed(off, n) reports whether any of the file's bytes
// [off, off+n) may differ from the inode's bytes at the same offsets;
// bytes past the inode's end always count as changed. Pack copies the
// compressed blocks no changed byte falls in from r (checked, or with
// PackOptions.Segment not even read) and reads only the others, through
// the file's ReadAt. Conditions on r are BlockSource's.
type PartialSource interface {
	io.ReaderAt
	PartialArchiveSource() (r *Reader, ino Inode, changed func(off, n int64) bool, ok bool)
}

// packFile is what Pack needs of the destination when it writes straight
// into it: sequential writes, the superblock written last at the start, and
// the finished bytes read back for the checksum. *os.File qualifies.
type packFile interface {
	io.Writer
	io.WriterAt
	io.ReaderAt
}

// PackDir packs the directory tree at dir (see Pack).
func PackDir(ctx context.Context, w io.Writer, dir string, opts PackOptions) (PackResult, error) {
	st, err := os.Stat(dir)
	if err != nil {
		return PackResult{}, fmt.Errorf("archive: pack %s: %w", dir, err)
	}
	if !st.IsDir() {
		return PackResult{}, fmt.Errorf("archive: pack %s: not a directory", dir)
	}
	return Pack(ctx, w, os.DirFS(dir), opts)
}

// Pack writes the tree of src as a squashfs 4.0 image followed by an
// integrity trailer, and returns its size and SHA-256.
//
// src must implement iofs.ReadDirFS and iofs.ReadLinkFS; ownership, device
// numbers and hard links come from FileInfo.Sys() when it is a
// *syscall.Stat_t (entries with the same Dev and Ino and Nlink > 1 become
// one inode). The output depends only on the tree and opts: the same input
// packs to the same bytes.
//
// A squashfs superblock describes tables that come after the data, so it is
// written last. When w is an *os.File (anything with WriteAt and ReadAt),
// Pack writes the image into it from its current offset, then the
// superblock, then reads the result back once to compute the SHA-256. Any
// other io.Writer receives the archive from a temporary file under
// os.TempDir(), streamed through once it is complete.
//
// Every content sum Pack computes is checked against what the bytes it
// writes decode to (see "Packing" in the package documentation); a
// mismatch, a packer bug, fails Pack with a *CorruptError naming the
// destination, whose content must then not be used.
//
// Memory stays bounded by the block pipeline (up to 16 blocks per worker) plus
// the metadata of the tree (roughly 200 bytes per entry).
func Pack(ctx context.Context, w io.Writer, src iofs.FS, opts PackOptions) (PackResult, error) {
	p, err := newPacker(src, opts)
	if err != nil {
		return PackResult{}, fmt.Errorf("archive: pack: %w", err)
	}
	if f, ok := w.(packFile); ok && !appendOnly(w) {
		return p.packTo(ctx, f)
	}
	tmp, err := os.CreateTemp("", "hermesfs-pack-*.sqfs")
	if err != nil {
		return PackResult{}, fmt.Errorf("archive: pack: %w", err)
	}
	defer os.Remove(tmp.Name())
	defer tmp.Close()
	res, err := p.packTo(ctx, tmp)
	if err != nil {
		return res, err
	}
	n, err := io.Copy(w, io.NewSectionReader(tmp, 0, res.Size))
	if err != nil {
		return res, fmt.Errorf("archive: pack: write: %w", err)
	}
	if n != res.Size {
		return res, fmt.Errorf("archive: pack: wrote %d of %d bytes", n, res.Size)
	}
	return res, nil
}

// node is one entry of the source tree.
type node struct {
	name     string
	path     string // in src; "." for the root
	mode     iofs.FileMode
	uid, gid uint32
	mtime    time.Time
	rdev     uint64
	size     int64
	target   string // symlinks
	children []*node
	subdirs  uint32

	// Hard links: every link points at the node that owns the inode.
	owner *node
	nlink uint32 // links within the archive (owner only)

	ino  uint32 // squashfs inode number (owner only)
	ref  uint64 // inode reference, once written (owner only)
	file *fileData

	// PackOptions.Extend (pack_extend.go).
	claim     Inode       // the base inode the source says the entry stands for; 0: none
	unchanged bool        // ... and that it is that inode exactly
	reused    bool        // the base's inode as it is: ino and ref are the base's
	relist    bool        // a directory whose base listing is kept under a new inode (its parent changed)
	baseIn    *inode      // the base inode it keeps the number of (owner only)
	baseList  *dirListing // a listed directory's base listing
	srcIno    uint64      // the source's inode number (Stat_t.Ino)

	// Regular files: where the content already is, learnt before packing.
	src     *fileSource // the file said it is an earlier archive's content
	checked bool        // src was asked for
	inBase  Inode       // the inode of the base holding the same content
	sum     sum         // content sum, when summed before packing (else zero)
}

func (n *node) inode() *node {
	if n.owner != nil {
		return n.owner
	}
	return n
}

// fileData is where a regular file's content lives in the image.
type fileData struct {
	size    int64
	start   uint64   // offset of the first stored block
	words   []uint32 // on-disk size word of each block; 0 = hole
	frag    uint32   // fragment index or noFragment
	fragOff uint32
	sparse  uint64 // bytes in holes
	started bool

	// Content sum (sums.go): given (sumSet), or computed from the sums of
	// the stored chunks or of the fragment tail.
	chunks      []sum // per entry of words
	tailSum     sum
	sum         sum
	sumSet      bool
	reusedBytes int64 // of size, bytes taken from an earlier archive
}

// contentSum is the file's content sum, or zero if unknown.
func (fd *fileData) contentSum() sum {
	switch {
	case fd.sumSet:
		return fd.sum
	case fd.size == 0:
		return fileSum(0, nil)
	case fd.frag == noFragment:
		return fileSum(fd.size, fd.chunks)
	case len(fd.words) == 0:
		return fileSum(fd.size, []sum{fd.tailSum})
	}
	return sum{}
}

type linkKey struct{ dev, ino uint64 }

type packer struct {
	src   iofs.FS
	opts  PackOptions
	log   *slog.Logger
	codec codec
	bs    int
	root  *node

	inodes    uint32
	order     []*node // regular-file inode owners in data order
	inodeRecs [][]inodeRec
	newest    time.Time
	res       PackResult

	base     *baseState
	liveFrag map[oldFragment]int64 // bytes of this tree's files in each earlier fragment block
	extend   *extender             // PackOptions.Extend, while extending
	keep     *keepNumbers          // a fresh layout that keeps a lineage's numbers
	compact  bool                  // Compact: files in the order of their blocks in the base
	lineage  Lineage
}

func newPacker(src iofs.FS, opts PackOptions) (*packer, error) {
	if opts.BlockSize == 0 {
		opts.BlockSize = 128 << 10
	}
	bs := opts.BlockSize
	if bs < minBlockSize || bs > maxBlockSize || bs&(bs-1) != 0 {
		return nil, fmt.Errorf("block size %d: want a power of two from 4 KiB to 1 MiB", bs)
	}
	if opts.Workers <= 0 {
		opts.Workers = runtime.GOMAXPROCS(0)
	}
	if opts.Compression == "" {
		opts.Compression = Zstd
	}
	c, err := newCodec(opts.Compression, opts.Level, bs, opts.Workers)
	if err != nil {
		return nil, err
	}
	log := opts.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	if _, ok := src.(iofs.ReadLinkFS); !ok {
		return nil, errors.New("source FS does not implement io/fs.ReadLinkFS (Lstat, ReadLink)")
	}
	return &packer{src: src, opts: opts, log: log, codec: c, bs: bs}, nil
}

// scan walks src into the node tree, sorted by name as squashfs requires.
func (p *packer) scan(ctx context.Context) error {
	lfs := p.src.(iofs.ReadLinkFS)
	links := map[linkKey]*node{}
	var walk func(n *node) error
	walk = func(dir *node) error {
		if err := ctx.Err(); err != nil {
			return err
		}
		ents, err := iofs.ReadDir(p.src, dir.path)
		if err != nil {
			return fmt.Errorf("read dir %s: %w", dir.path, err)
		}
		// ReadDir sorts by name in byte order, which is the order squashfs
		// lookups rely on; entries are checked rather than re-sorted.
		for i, e := range ents {
			name := e.Name()
			if !validName(name) {
				return fmt.Errorf("%s: invalid entry name %q", dir.path, name)
			}
			if i > 0 && ents[i-1].Name() >= name {
				return fmt.Errorf("%s: directory listing not sorted or has duplicates at %q", dir.path, name)
			}
			cpath := path.Join(dir.path, name)
			fi, err := lfs.Lstat(cpath)
			if err != nil {
				return fmt.Errorf("lstat %s: %w", cpath, err)
			}
			c := &node{name: name, path: cpath}
			if err := p.fill(c, fi); err != nil {
				return fmt.Errorf("%s: %w", cpath, err)
			}
			if c.mode.IsDir() {
				dir.subdirs++
			} else if st, ok := fi.Sys().(*syscall.Stat_t); ok && st.Nlink > 1 {
				k := linkKey{uint64(st.Dev), st.Ino}
				if o := links[k]; o != nil {
					if o.mode.Type() != c.mode.Type() {
						return fmt.Errorf("%s: hard link to %s changed type", cpath, o.path)
					}
					c.owner = o
					o.nlink++
				} else {
					links[k] = c
				}
			}
			if c.mode.Type() == iofs.ModeSymlink {
				t, err := lfs.ReadLink(cpath)
				if err != nil {
					return fmt.Errorf("readlink %s: %w", cpath, err)
				}
				if len(t) == 0 || len(t) > maxSymlinkLen {
					return fmt.Errorf("%s: symlink target of %d bytes", cpath, len(t))
				}
				c.target = t
				c.size = int64(len(t))
			}
			dir.children = append(dir.children, c)
			if c.mode.IsDir() {
				if err := walk(c); err != nil {
					return err
				}
			} else if c.owner == nil && c.mode.IsRegular() {
				p.order = append(p.order, c)
			}
		}
		return nil
	}
	fi, err := lfs.Lstat(".")
	if err != nil {
		return fmt.Errorf("lstat root: %w", err)
	}
	if !fi.IsDir() {
		return errors.New("root is not a directory")
	}
	p.root = &node{path: "."}
	if err := p.fill(p.root, fi); err != nil {
		return err
	}
	return walk(p.root)
}

func (p *packer) fill(n *node, fi iofs.FileInfo) error {
	n.mode = fi.Mode()
	if inodeTypeOf(n.mode) == 0 {
		return fmt.Errorf("unsupported file type %v", n.mode.Type())
	}
	n.mtime = fi.ModTime()
	n.nlink = 1
	if n.mtime.After(p.newest) {
		p.newest = n.mtime
	}
	if n.mode.IsRegular() {
		n.size = fi.Size()
		if n.size < 0 {
			return fmt.Errorf("negative size %d", n.size)
		}
	}
	if st, ok := fi.Sys().(*syscall.Stat_t); ok {
		n.uid, n.gid, n.srcIno = st.Uid, st.Gid, st.Ino
		if n.mode&iofs.ModeDevice != 0 {
			n.rdev = uint64(st.Rdev)
		}
	}
	return nil
}

// number assigns inode numbers in the order the inodes will be written:
// children before their directory (a directory's entry points at its
// children's inodes), hard links at their first appearance.
func (p *packer) number(d *node) {
	for _, c := range d.children {
		if c.mode.IsDir() {
			p.number(c)
		} else if o := c.inode(); o.ino == 0 {
			p.inodes++
			o.ino = p.inodes
		}
	}
	p.inodes++
	d.ino = p.inodes
}

// keepNumbers makes a fresh layout keep the inode numbers of a base of
// its lineage (Compact, and an extending pack that could not extend):
// every inode that claims a number the base gives an inode of its type
// keeps it (the first one, if several claim one), the others get numbers
// no image of the lineage used.
type keepNumbers struct {
	base    *Reader
	claim   func(n *node) Inode
	lineage Lineage
	next    uint32
}

// keepNumbers renumbers the tree so (after number) and returns the count
// of inodes.
func (p *packer) keepNumbers() uint32 {
	k := p.keep
	var owners []*node
	var walk func(d *node)
	walk = func(d *node) {
		for _, c := range d.children {
			if c.mode.IsDir() {
				walk(c)
			} else if o := c.inode(); o.ino != 0 {
				o.ino = 0
				owners = append(owners, o)
			}
		}
		d.ino = 0
		owners = append(owners, d)
	}
	walk(p.root)
	taken := map[Inode]bool{}
	for _, o := range owners {
		x := k.claim(o)
		if x == 0 || taken[x] || uint32(x) >= k.next {
			continue
		}
		if in, err := k.base.lookupBare(x); err != nil || basicType(in.typ) != inodeTypeOf(o.mode) {
			continue
		}
		taken[x] = true
		o.ino = uint32(x)
	}
	next := k.next
	for _, o := range owners {
		if o.ino == 0 {
			o.ino = next
			next++
		}
	}
	p.inodes = next - 1
	return uint32(len(owners))
}

// regap multiplies every inode number by gap (formatProbe).
func (p *packer) regap(d *node, gap uint32) {
	d.ino *= gap
	for _, c := range d.children {
		if c.mode.IsDir() {
			p.regap(c, gap)
		} else if c.owner == nil {
			c.ino *= gap
		}
	}
}

// output counts and buffers what goes to the destination, and records the
// extents for the trailer.
type output struct {
	f      packFile
	bw     *bufio.Writer
	base   int64  // offset of the image in f
	pos    uint64 // bytes of image written
	ext    []extent
	sums   []sum // per data extent
	copies []CopyRange
	err    error

	// PackOptions.Segment: the image's runs, and the bytes written.
	segment bool
	runs    []Run
	spos    int64
}

// grow records n more image bytes: new ones (src nil), written at the
// segment's end, or a copy of src's bytes at srcOff.
func (o *output) grow(n int64, src *Reader, srcOff int64) {
	if !o.segment || n == 0 {
		return
	}
	off := srcOff
	if src == nil {
		off = o.spos
		o.spos += n
	}
	if k := len(o.runs) - 1; k >= 0 && o.runs[k].Source == src && o.runs[k].Offset+o.runs[k].Length == off {
		o.runs[k].Length += n
		return
	}
	o.runs = append(o.runs, Run{Source: src, Offset: off, Length: n})
}

// copyExtent accounts for one block of src, at srcOff, of n bytes whose
// checksum (and sum, for a data block) src recorded: a copy the
// destination does not receive (PackOptions.Segment).
func (o *output) copyExtent(n uint32, kind extentKind, crc uint32, s sum, src *Reader, srcOff uint64) {
	if o.err != nil {
		return
	}
	o.pos += uint64(n)
	o.ext = append(o.ext, extent{length: n, kind: kind, crc: crc})
	if kind == kindData {
		o.sums = append(o.sums, s)
	}
	o.grow(int64(n), src, int64(srcOff))
}

func (o *output) write(b []byte, kind extentKind, crc uint32) {
	if o.err != nil || len(b) == 0 {
		return
	}
	_, o.err = o.bw.Write(b)
	o.pos += uint64(len(b))
	o.grow(int64(len(b)), nil, 0)
	for len(b) > 0 {
		// Extents longer than the trailer can describe (only ever index
		// arrays) are split; each piece gets its own checksum.
		n := min(len(b), maxExtentLen)
		c := crc
		if n != len(b) || crc == 0 {
			c = crc32c(b[:n])
		}
		o.ext = append(o.ext, extent{length: uint32(n), kind: kind, crc: c})
		b = b[n:]
	}
}

// writeData writes one data block with its content sum.
func (o *output) writeData(b []byte, crc uint32, s sum) {
	o.write(b, kindData, crc)
	o.sums = append(o.sums, s)
}

// appendExtent writes one block copied from another archive, whose
// checksum (and sum, for a data block) that archive recorded.
func (o *output) appendExtent(b []byte, kind extentKind, crc uint32, s sum) {
	if o.err != nil {
		return
	}
	_, o.err = o.bw.Write(b)
	o.pos += uint64(len(b))
	o.grow(int64(len(b)), nil, 0)
	o.ext = append(o.ext, extent{length: uint32(len(b)), kind: kind, crc: crc})
	if kind == kindData {
		o.sums = append(o.sums, s)
	}
}

// trailerWrite writes trailer bytes (new ones).
func (o *output) trailerWrite(b []byte) {
	if o.err != nil || len(b) == 0 {
		return
	}
	_, o.err = o.bw.Write(b)
	o.grow(int64(len(b)), nil, 0)
}

// trailerCopy accounts for n trailer bytes that are src's bytes at off
// (PackOptions.Segment only: the destination does not receive them).
func (o *output) trailerCopy(n int64, src *Reader, off int64) {
	if o.err != nil || n == 0 {
		return
	}
	if !o.segment {
		o.err = errors.New("internal error: trailer bytes copied outside a segment pack")
		return
	}
	o.grow(n, src, off)
}

// name names the archive being written in errors.
func (o *output) name() string {
	if f, ok := o.f.(interface{ Name() string }); ok {
		return f.Name()
	}
	return "(being packed)"
}

// copied records that n bytes at dst are the base's bytes at src.
func (o *output) copied(dst, src, n uint64) {
	if n == 0 {
		return
	}
	if k := len(o.copies) - 1; k >= 0 {
		last := &o.copies[k]
		if uint64(last.Offset+last.Length) == dst && uint64(last.BaseOffset+last.Length) == src {
			last.Length += int64(n)
			return
		}
	}
	o.copies = append(o.copies, CopyRange{Offset: int64(dst), BaseOffset: int64(src), Length: int64(n)})
}

// skip writes n zero bytes that the trailer accounts for elsewhere.
func (o *output) skip(n int) {
	if o.err != nil {
		return
	}
	_, o.err = o.bw.Write(make([]byte, n))
	o.pos += uint64(n)
	o.grow(int64(n), nil, 0)
}

func (p *packer) packTo(ctx context.Context, f packFile) (res PackResult, err error) {
	start := time.Now()
	defer func() {
		if err != nil {
			err = fmt.Errorf("archive: pack: %w", err)
		}
	}()
	if p.opts.Extend {
		why := p.extendable()
		if why == "" {
			res, err := p.packExtend(ctx, f)
			var fb *extendFallback
			if !errors.As(err, &fb) {
				return res, err
			}
			why = fb.reason
		}
		// Nothing was written: pack afresh.
		p.log.Info("pack: the base cannot be extended; packing afresh", "reason", why)
		opts := p.opts
		opts.Extend = false
		q, err := newPacker(p.src, opts)
		if err != nil {
			return res, err
		}
		q.res.ExtendFallback = why
		if cfs, ok := p.src.(ChangeFS); ok && p.opts.Base != nil {
			// Keep the numbers all the same: the lineage's, or, on a
			// base that has none (a version 1 trailer), the base's, in
			// a new lineage that the next pack can extend.
			b := p.opts.Base
			q.keep = &keepNumbers{base: b, next: b.sb.Inodes + 1,
				claim: func(n *node) Inode {
					x, _, ok := cfs.BaseInode(n.path)
					if !ok {
						return 0
					}
					return x
				}}
			if b.tr2 != nil {
				q.keep.lineage, q.keep.next = b.tr2.root.lineage, max(b.tr2.root.nextInode, b.sb.Inodes+1)
			}
		}
		return q.packTo(ctx, f)
	}
	if err := p.scan(ctx); err != nil {
		return res, err
	}
	p.number(p.root)
	live := p.inodes
	if p.keep != nil {
		live = p.keepNumbers()
	}
	if pr := p.opts.probe; pr != nil && pr.inoGap > 1 {
		p.regap(p.root, pr.inoGap)
		p.inodes = p.inodes*pr.inoGap + pr.inoExtra
	}
	p.base = p.newBase(p.opts.Base)
	if p.opts.Segment && p.base != nil {
		p.base.canAppend = false
	}
	if err := p.plan(ctx); err != nil {
		return res, err
	}
	if p.compact {
		p.sortByBase()
	}
	p.log.Debug("pack: tree scanned", "inodes", p.inodes, "elapsed", time.Since(start))
	var base int64
	if s, ok := f.(io.Seeker); ok {
		if base, err = s.Seek(0, io.SeekCurrent); err != nil {
			return res, err
		}
	}
	out := &output{f: f, bw: bufio.NewWriterSize(f, 1<<20), base: base, segment: p.opts.Segment}

	// The superblock is written last; reserve its place.
	out.skip(superblockSize)
	opts := p.codec.options()
	if opts != nil {
		blk := append([]byte{byte(len(opts)), byte(len(opts)>>8 | metaUncompBit>>8)}, opts...)
		out.write(blk, kindCompOpts, 0)
	}
	if b := p.base; b != nil && b.appending {
		if err := b.copyPrefix(ctx, out); err != nil {
			return res, err
		}
		p.log.Debug("pack: base copied", "bytes", b.end-b.start, "elapsed", time.Since(start))
	}

	frags, err := p.writeData(ctx, out)
	if err != nil {
		return res, err
	}
	p.log.Debug("pack: data written", "elapsed", time.Since(start))
	sb, err := p.writeTables(out, frags)
	if err != nil {
		return res, err
	}
	imageBytes := out.pos
	padded := (imageBytes + padAlign - 1) / padAlign * padAlign
	if pad := padded - imageBytes; pad > 0 {
		if _, err := out.bw.Write(make([]byte, pad)); err != nil {
			return res, err
		}
		out.grow(int64(pad), nil, 0)
	}
	sbBytes := sb.marshal()
	exts := append([]extent{{length: superblockSize, kind: kindSuperblock, crc: crc32c(sbBytes)}}, out.ext...)
	var trailerEnd uint64
	if p.opts.trailerV1 {
		tr := p.trailerV1(exts, out.sums, padded, imageBytes)
		out.trailerWrite(tr)
		trailerEnd = padded + uint64(len(tr))
	} else {
		ri := rootInfo{imageBytes: imageBytes, sbCRC: crc32c(sbBytes), nextInode: p.inodes + 1, liveInodes: live}
		if p.keep != nil {
			ri.lineage = p.keep.lineage
		}
		if !p.opts.noSums {
			ri.flags |= rootHasSums
		}
		b := newTrBuilder(out, padded)
		if err := b.fresh(p.records(exts, out.sums)); err != nil {
			return res, err
		}
		if err := b.finish(ri, sbBytes); err != nil {
			return res, err
		}
		trailerEnd = b.pos
		p.lineage = b.root.lineage
	}
	if out.err != nil {
		return res, out.err
	}
	if err := out.bw.Flush(); err != nil {
		return res, err
	}
	if _, err := f.WriteAt(sbBytes, base); err != nil {
		return res, fmt.Errorf("write superblock: %w", err)
	}
	p.log.Debug("pack: tables written", "elapsed", time.Since(start))
	total := int64(trailerEnd)
	switch {
	case out.segment:
		p.res.Runs, p.res.SegmentSize = out.runs, out.spos
	default:
		h := sha256.New()
		if _, err := io.CopyBuffer(h, io.NewSectionReader(f, base, total), make([]byte, 1<<20)); err != nil {
			return res, fmt.Errorf("read back: %w", err)
		}
		copy(p.res.SHA256[:], h.Sum(nil))
	}
	p.res.Size = total
	p.res.Inodes = int64(live)
	p.res.Lineage = p.lineage
	p.res.KeptNumbers = p.keep != nil
	if b := p.base; b != nil {
		p.res.Base = BaseCompacted
		if b.appending {
			p.res.Base = BaseAppended
			p.res.SharedBytes = int64(b.end - superblockSize)
			p.res.GarbageBytes = int64(b.end - b.start - b.prefixLive)
		}
		p.res.Copies = out.copies
		for _, c := range out.copies {
			p.res.CopiedBytes += c.Length
		}
	}
	p.log.Info("packed archive", "bytes", total, "inodes", p.inodes, "files", p.res.Files,
		"data_bytes", p.res.DataBytes, "reused_bytes", p.res.ReusedBytes, "matched_bytes", p.res.MatchedBytes, "base", p.res.Base,
		"copied_bytes", p.res.CopiedBytes, "garbage_bytes", p.res.GarbageBytes, "elapsed", time.Since(start))
	return p.res, nil
}

// records gives the trailer's record of every block of the image: the
// extents with their data blocks' sums and their inode blocks' inodes.
func (p *packer) records(exts []extent, sums []sum) []blockRec {
	recs := make([]blockRec, len(exts))
	d, k := 0, 0
	for i, e := range exts {
		recs[i] = blockRec{length: e.length, kind: e.kind, crc: e.crc}
		switch e.kind {
		case kindData:
			if d < len(sums) && !p.opts.noSums {
				recs[i].sum = sums[d]
			}
			d++
		case kindInodeTable:
			if k < len(p.inodeRecs) {
				recs[i].inodes = p.inodeRecs[k]
			}
			k++
		}
	}
	return recs
}

// trailerV1 encodes the version 1 trailer (tests: the archives written
// before version 2).
func (p *packer) trailerV1(exts []extent, blockSums []sum, padded, imageBytes uint64) []byte {
	mtimeNs := make([]uint32, p.inodes)
	fileSums := make([]sum, p.inodes)
	for _, blk := range p.inodeRecs {
		for _, in := range blk {
			mtimeNs[in.ino-1] = in.ns
			fileSums[in.ino-1] = in.sum
		}
	}
	sums := &trailerSums{blocks: blockSums, files: fileSums}
	if p.opts.noSums {
		sums = nil
	}
	return marshalTrailer(exts, mtimeNs, sums, padded, imageBytes)
}

// mtimeSecs clamps t to what squashfs can store and returns the
// nanoseconds the trailer carries.
func mtimeSecs(t time.Time) (uint32, uint32) {
	s := t.Unix()
	if s < 0 {
		return 0, 0
	}
	if s > math.MaxUint32 {
		return math.MaxUint32, 0
	}
	return uint32(s), uint32(t.Nanosecond())
}

// appendOnly reports whether w is a file opened with O_APPEND, where
// WriteAt cannot put the superblock in place.
func appendOnly(w io.Writer) bool {
	f, ok := w.(*os.File)
	if !ok {
		return false
	}
	fl, err := unix.FcntlInt(f.Fd(), unix.F_GETFL, 0)
	return err == nil && fl&unix.O_APPEND != 0
}
