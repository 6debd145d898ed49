// Package archive writes and reads hermesfs snapshot archives: standard
// squashfs 4.0 images (zstd by default) followed by an integrity trailer.
//
// # Format
//
// The image is what mksquashfs would write for the same tree: superblock,
// compressor options, data and fragment blocks, then the inode, directory,
// fragment, export and id tables, padded to 4 KiB. unsquashfs, the kernel
// (mount -t squashfs) and other readers read it and stop at the
// superblock's bytes_used. zstd frames use a window no larger than the
// kernel accepts (128 KiB). Files smaller than a block are packed into
// fragments; all-zero blocks are stored as holes; files with the same
// content are stored once; hard links share one inode.
//
// After the padding comes our trailer (trailer2.go): a record of every
// block of the image (superblock, compressor options, each data, fragment
// and metadata block, each table index), in image order: its length, kind
// and CRC-32C, a content sum (SHA-256 based, see sums.go) for a data
// block, and for an inode table block the nanoseconds of the mtime of
// each inode starting in it (squashfs keeps seconds) and each regular
// file's content sum. Records are grouped into pages of about 8 KiB
// (zstd-compressed when that is smaller), pages into groups of up to 64
// under an index page, and a root lists the groups; a fixed-size footer at
// the very end locates and checksums the root. A page never spans two
// regions of the image (the data, each table, each index array) and names
// no absolute position, so an image extended from another reuses the
// other's pages and groups by byte range. squashfs has no checksums of
// its own: with the trailer, a flipped bit anywhere in the image is
// reported instead of being served. The content sums let a later pack
// recognise content it already has without reading it. The root also
// carries the image's lineage, generation, next inode number and garbage
// estimate (see "Extending"). Archives written before this format carry
// the version 1 trailer (trailer.go: one table of the whole image, read
// whole at Open); they are still read.
//
// # Packing
//
// Pack walks an io/fs tree once for its metadata, then streams file
// content through a pipeline: one goroutine reads blocks in order, workers
// compress them in parallel, and the caller's goroutine writes them in
// order. Metadata tables are built in memory (they are small) and written
// after the data, then the superblock at offset 0, as mksquashfs does. The
// same tree, options and base always give the same bytes. A file that says
// it is unchanged content of an earlier archive (BlockSource) has its
// compressed blocks copied from that archive instead of being recompressed;
// a fragment block of that archive is copied whole when at least 3/4 of it
// is still in use (below that, its live tails are repacked, so stale bytes
// do not accumulate over snapshots).
//
// Pack checks its own work before it hands an archive back. Every content
// sum it computes (of a new block, of a block copied from an archive that
// records no sums, of a file tail in a fragment block) is checked, by the
// worker that finished the block, against what the bytes to be written
// decode to, and the writer checks that the bytes it writes are the ones
// checked (their CRC). A mismatch is a packer bug, not damage of an
// input: Pack fails with a *CorruptError naming the archive being written
// and the block, rather than return an archive its own verifier would
// reject. The sums an earlier archive records for blocks copied from it
// are taken as they are (the copied bytes are checked against that
// archive's checksums). The check decodes and
// hashes each new block once more: a fifth to a quarter more CPU for a
// pack where every block is new (BenchmarkPackCheck), in proportion to
// the new data otherwise.
//
// # Snapshots that cost what changed
//
// A squashfs image keeps a file's data blocks contiguous, so a changed file
// cannot point at its old blocks inside one image: sharing between
// snapshots has to live outside the image. PackOptions.Segment packs for
// that. Every block Pack would copy verbatim from an earlier archive (the
// unchanged file of a lower layer, BlockSource; the unchanged blocks of a
// file copied up by range and written to, PartialSource; a block of a
// changed file whose content sum the Base archive records as a whole
// block, such as the untouched pages of a database or the leading blocks of
// an appended log) is neither read nor written: Pack only checks that the
// source's trailer vouches for it and records where it stands.
// PackResult.Runs then describes the image in order, as stretches that are
// either new (the destination's bytes: new and changed blocks, fragment
// blocks, the metadata tables, the trailer) or a range of a source
// archive. The destination is a sparse file holding only the new bytes,
// superblock first; the caller stores those as one new segment and the
// copied ranges as extents of the segments the sources are made of
// (package uploader), so a snapshot uploads and stores what changed. This
// layout is fresh, in tree order: nothing is appended, and no garbage of
// the previous image stays referenced; but its metadata tables and
// trailer are rewritten whole, which costs in proportion to the files
// (PackOptions.Extend, below, does not).
//
//	image:  [sb][opts][ copy of A ][new][ copy of B ][new][tables][trailer]
//	runs:    new........  A@x        new  B@y          new.................
//
// The image the runs describe is byte for byte the one Pack would write
// without Segment: standard squashfs plus our trailer, with the sums and
// checksums of copied blocks taken from their sources' trailers.
//
// Without Segment, PackOptions.Base (hermesfs pack --base) instead lays
// the new archive out to share bytes with Base at the same offsets where
// it can ("appending": Base's data region first, new blocks after it,
// PackResult.Copies the shared ranges) until Base's blocks that no file
// uses any more would exceed PackOptions.MaxGarbage (default 1/4) of the
// data; then it compacts. Appending needs Base to carry our trailer and the
// same compression, compressor options and block size; copying blocks
// needs the same compression and block size. Every block taken from Base
// is checked against Base's checksums first: a damaged Base fails the
// pack.
//
// Either way the image is complete on its own: it references no byte
// outside itself, and unsquashfs, the kernel and other readers read it
// like any other.
//
// squashfs puts its superblock first but can only fill it in last. Pack
// therefore writes into an *os.File (anything with WriteAt and ReadAt)
// directly, seeking back once for the superblock and reading the result
// back for its SHA-256; any other io.Writer gets the archive through a
// temporary file.
//
// # Extending
//
// PackOptions.Extend (with Segment and a Base this package wrote with a
// version 2 trailer, the same compression, compressor options and block
// size) grows Base's image instead of laying one out afresh: every region
// of Base stays where it is, as runs of Base, and what the pack writes
// goes after it (pack_extend.go):
//
//	[sb][opts][ Base's data ][ new data and fragment blocks ]
//	[ Base's inode table ][ new inode blocks ]
//	[ Base's directory table ][ new listings ]
//	[ fragment table: Base's full blocks, its last re-encoded + new ][ idx ]
//	[ export table: Base's blocks, changed re-encoded, new ][ idx ]
//	[ id table ][ idx ][ padding ][ trailer: Base's pages, new pages, root ]
//
// References to inodes and listings are (block, offset) relative to the
// start of their table, and file inodes point at data by absolute offset:
// copied as the start of the new tables and data region, Base's bytes stay
// valid, so an unchanged inode keeps its number and its record. A changed
// or new entry is written new, and so is the listing and inode of each
// directory on its path up to the root (a listing names its children's
// references); a directory moved unchanged gets a new inode record (it
// names its parent) over its old listing. Base's last inode and directory
// blocks are left short and the new ones start afresh (all readers accept
// that, see below). The fragment, export and id tables are addressed by
// index arithmetic and so stay contiguous, whole blocks each: they are laid
// out every time, the fragment and export tables as runs of Base's blocks
// where nothing in them changed, the id table (a block) and the index
// arrays written new. The trailer's pages name no absolute position, so
// Base's pages and groups that describe regions the new image keeps are
// reused as runs too; the pages at a region's growing end, the groups of
// the small tables, the root and the footer are new. A one-line change
// writes a few metadata blocks, a few trailer pages and the root, whatever
// the number of files: BenchmarkExtendOneLine measures 10 KiB per change at
// 120k entries, 24 KiB at 1M (the export table's index array, 8 bytes per
// 1024 inodes, grows with the inode count), and about 5 ms of packing.
//
// The source tells Pack what changed by implementing ChangeFS: a
// directory it says is Base's inode unchanged is reused whole, without
// being listed, stat'ed or read below; the others are listed and each
// entry Lstat'ed; files that changed are packed as by any pack (sums,
// BlockSource, PartialSource). Every entry reused is checked against
// Base's inode (type, mode, owner, mtime seconds, size, target, device):
// a ChangeFS that calls a changed entry unchanged fails the pack instead
// of publishing a wrong image. Without ChangeFS, Extend lays the image
// out afresh (PackResult.ExtendFallback says why), as it does when Base
// does not qualify, and when a hard link changed through a name in a
// listed directory while another of its names is in a directory reused
// whole (its link count would be wrong): the fresh layout then keeps the
// numbers the ChangeFS names and Base's lineage, so the next pack can
// extend again.
//
// Inode numbers along a lineage: an unchanged or changed object keeps its
// number; a new object takes the number of a Base inode that went from
// the same directory under the same name and type (an atomic
// write-and-rename keeps st_ino), else a number past every one the
// lineage used (the trailer root's next inode number; sb.Inodes is the
// highest number in use or given before). The numbers of objects that
// went are holes: their export entries name the root's record, which
// names another number, and the reader reports them as not found.
//
// What an extending pack does not do: find content by whole-file sum in
// all of Base (that index is O(files)). It looks only in the old versions
// of the files that changed and in the files that went (an appended log,
// a database rewritten in place, a file renamed over another); a file
// with the content of an unrelated file elsewhere in Base is stored again.
//
// Garbage: the records, listings and blocks an extending pack replaces
// or drops stay in the image (their bytes are runs of older segments).
// The trailer root keeps an estimate of them (Reader.GarbageBytes, an
// over-estimate: blocks shared by deduplicated files count as freed),
// with the generation since the last fresh or compacted image
// (Reader.Generation) and the lineage (Reader.Lineage). Compact writes an
// image's tree afresh as a Segment pack on it: the same content and
// inode numbers, data blocks copied by reference in Base's order (long
// runs), dense metadata and trailer, generation 0, no garbage. When to
// compact is the caller's policy.
//
// # What readers accept (TestFormatProbes)
//
// Measured against unsquashfs 4.5.1 (listing and extraction), the go-diskfs
// reader and the kernel (mount -t squashfs, lookups through a directory
// index, st_ino):
//
//   - A metadata block left short in the middle of the inode or the
//     directory table is read by all three, provided nothing spans it: the
//     inodes and listings after it start in a fresh block. References are
//     (block start, offset) pairs and every reader follows the blocks' real
//     lengths. The kernel's directory index does assume that the blocks a
//     listing spans are full (it finds an entry's offset in its block as
//     the listing's offset modulo 8 KiB), so a listing never spans a short
//     block.
//   - Inode numbers with holes, and sb.Inodes past the highest number in
//     use, are read by all three: unsquashfs sizes its hard-link table by
//     sb.Inodes, the kernel uses the export table only for NFS.
//   - The fragment, export and id tables are addressed by index
//     arithmetic (entry i in block i/entries-per-block), and the kernel
//     checks that their index arrays point at increasing blocks at most
//     8 KiB+2 apart ending right before the array: these tables stay
//     whole blocks laid out contiguously, every block full but the last.
//
// # Reading
//
// Open reads the superblock, the end of the file (footer, trailer root and
// the groups of the small tables, written last for this) and the end of
// the image (the fragment, export and id tables' index arrays and the id
// table): a few ranges, none proportional to the number of files.
// Everything else is read when first used, one metadata block or trailer
// page at a time, each checked against its record before it is decoded:
// an inode by number through the export table, a directory's listing when
// it is listed (a name in a large directory is found through the
// directory index, reading a block or two of its listing), a file's block
// list when it is read, a data block when its bytes are. Decoded metadata
// (blocks, listings, block lists, trailer pages) is kept in a cache
// bounded in bytes (ReaderOptions.MetaCacheBytes), decompressed data
// blocks in another (CacheBytes): a reader's memory does not grow with the
// archive. The reader assumes nothing of its io.ReaderAt beyond ReadAt, so
// a ranged reader over an object store works as well as a local file.
// Images without an export table (mksquashfs -no-exports) are walked once
// at Open to number their inodes.
//
// Inode numbers are the squashfs inode numbers: stable for the life of an
// archive, shared by hard links, and, along a lineage (PackOptions.Extend,
// Compact), kept by the objects they name. A number with no live inode (a
// hole) is not found. A lookup checks that the entry and its inode agree
// (number, type, the export table's reference, a directory's parent), so
// a directory reachable by two paths or a cycle is reported as damage.
// Whole-archive work (Verify, Unpack, the content index a fresh pack on a
// base builds, ChunkFiles) walks the tree.
//
// # Unpacking
//
// Unpack walks the tree in one goroutine, creating every entry relative
// to an open descriptor of its parent (O_NOFOLLOW, O_EXCL: nothing lands
// outside the target), while workers fill in file content a few blocks at
// a time. Directory metadata is applied after the directory's entries,
// file metadata after the file's content. Files the archive stores once
// are decompressed once and copied in the kernel (copy_file_range) around
// their holes.
//
// # Hostile input
//
// Open and every read check what they decode before they use it: sizes
// and counts are bounded by the file's size (or by what the tables really
// hold, read a piece at a time) before much is allocated, names must be
// valid single path components, sorted and unique, entries must agree
// with their inodes, and a directory names the one it is listed in as its
// parent (no cycles); walks visit each directory once. Damage is
// reported as a *CorruptError (errors.Is ErrCorrupt) naming the archive
// and byte offset; nothing panics.
//
// # Concurrency
//
// A Reader is safe for concurrent use: what Open reads is immutable, and
// the caches are guarded internally (concurrent misses on one block load
// it once). Pack uses
// Workers goroutines and returns only when all have stopped.
package archive
