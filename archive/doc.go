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
// After the padding comes our trailer (see trailer.go): a CRC-32C for every
// byte range of the image (superblock, each data, fragment and metadata
// block, each table index), the nanoseconds of every mtime (squashfs keeps
// seconds), and a fixed-size footer at the very end that locates and
// checksums the trailer. squashfs has no checksums of its own: with the
// trailer, a flipped bit anywhere in the image is reported instead of being
// served.
//
// # Packing
//
// Pack walks an io/fs tree once for its metadata, then streams file
// content through a pipeline: one goroutine reads blocks in order, workers
// compress them in parallel, and the caller's goroutine writes them in
// order. Metadata tables are built in memory (they are small) and written
// after the data, then the superblock at offset 0, as mksquashfs does. The
// same tree and options always give the same bytes. A file that says it is
// unchanged content of an earlier archive (BlockSource) has its compressed
// blocks copied from that archive instead of being recompressed, so a
// snapshot costs what changed; a fragment block of that archive is copied
// whole when at least 3/4 of it is still in use (below that, its live tails
// are repacked, so stale bytes do not accumulate over snapshots).
//
// squashfs puts its superblock first but can only fill it in last. Pack
// therefore writes into an *os.File (anything with WriteAt and ReadAt)
// directly, seeking back once for the superblock and reading the result
// back for its SHA-256; any other io.Writer gets the archive through a
// temporary file.
//
// # Reading
//
// Open reads the superblock, the trailer and all metadata tables (one
// contiguous range at the end of the image) and indexes them: inode number
// to inode, directory to sorted entries. After that, Stat, Lookup, ReadDir
// and Readlink touch no I/O, and ReadAt reads only the data blocks it
// needs. Every block read is checked against the trailer before it is
// decompressed or returned, and decompressed blocks are kept in a bounded
// LRU cache. The reader assumes nothing of its io.ReaderAt beyond ReadAt, so
// a ranged reader over an object store works as well as a local file.
//
// Inode numbers are the squashfs inode numbers: stable for the life of an
// archive, shared by hard links.
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
// and counts are bounded by the file's size before anything is allocated,
// names must be valid single path components, sorted and unique, every
// directory is reached exactly once (no cycles), and entries must agree
// with their inodes. Damage is reported as a *CorruptError (errors.Is
// ErrCorrupt) naming the archive and byte offset; nothing panics.
//
// # Concurrency
//
// A Reader is safe for concurrent use: its index is immutable after Open,
// and the block cache and file layouts are guarded internally. Pack uses
// Workers goroutines and returns only when all have stopped.
package archive
