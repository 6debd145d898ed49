package fs

import (
	"io"
	"sort"
	"strings"
	"sync"
	"syscall"

	"github.com/hermesfs/hermesfs/archive"
)

// Filling the page cache at open. A program that opens a small lower file
// reads it whole next (Python's import reads each module's .pyc, node each
// .js), and on a cold page cache every such read is a READ request: one
// more round trip per file, on top of the OPEN, the decompression of its
// block, and, with the request, the invalidation of the file's atime, so
// that its next stat(2) is a GETATTR too. Instead, the first read-only open
// of a small lower file decompresses it (through the archive's verified
// reads, as a READ would) and hands it to the kernel's page cache
// (FUSE_NOTIFY_STORE) before the OPEN is answered with FOPEN_KEEP_CACHE:
// the reads that follow find their pages and never reach the daemon.
//
// Only the first open of a node during the mount fills: the page cache is
// kept across opens (FOPEN_KEEP_CACHE), so a later open would only copy the
// same bytes again. If the kernel dropped the pages since (memory
// pressure), its reads come as READ requests as usual. Larger files are
// left to READ and read-ahead: a program may map a large file and touch
// little of it.
//
// The stored bytes must never hide a change. The fill runs under node.mu,
// which copy-up holds too, and only while the node has no upper file: a
// copy-up (and every write after it, which the kernel puts into the page
// cache itself) comes after the fill. Nor while a read-write handle of the
// lower file is open with its copy-up deferred to its first write
// (deferred.go): the kernel puts that write into the page cache before the
// daemon sees it, and a fill could lay the lower bytes over it (or wait for
// the page the write holds locked, while the write waits for node.mu).
// Guarded files, whose commits replace the content behind the kernel's
// back, are not filled.

// Decompressing a small file at its first open waits, on a cold page
// cache, for the image's bytes to come from the disk (or the store). A
// program that opens one file of a directory usually opens others next
// (the modules of a package sit in one __pycache__), and packing puts a
// directory's files together, several to a fragment block: so the first
// open of a file also starts decompressing, in the background, the blocks
// of the small files after it in the directory, up to fillAhead bytes of
// them, into the archive's block cache. Their own first opens then find
// their bytes decompressed. The window moves on as later files of the
// directory are opened, never back. It opens at the second small file of a
// directory filled, not the first (fillAheadAfter).

// defaultFillMax is Options.OpenFillMax when it is zero.
const defaultFillMax = 128 << 10

var fillBufs = sync.Pool{New: func() any { b := make([]byte, defaultFillMax); return &b }}

// fillOnOpen hands the content of lower file n (size bytes) to the kernel's
// page cache, if it is small enough and has not been filled during this
// mount. n.mu is held, and n has no upper file. Failures are not the
// open's: a damaged block is reported by the READ that meets it.
func (ov *overlay) fillOnOpen(n *node, size int64) {
	if size <= 0 || size > ov.opts.OpenFillMax || n.filled || n.deferred > 0 || ov.fillOff.Load() {
		return
	}
	n.filled = true
	ov.fillAhead(n)
	bp := fillBufs.Get().(*[]byte)
	defer fillBufs.Put(bp)
	if int64(cap(*bp)) < size {
		*bp = make([]byte, size)
	}
	buf := (*bp)[:size]
	k, err := ov.readLower(n.lower, buf, 0)
	if (err != nil && err != io.EOF) || int64(k) != size {
		return
	}
	if errno := n.WriteCache(0, buf); errno != 0 {
		if errno == syscall.ENOSYS || errno == syscall.EINVAL {
			// The kernel does not take stores: stop trying.
			ov.fillOff.Store(true)
		}
		return
	}
	if s := ov.opts.Stats; s != nil {
		s.filled.Add(1)
		s.filledBytes.Add(uint64(size))
	}
}

// fillAhead is how many bytes of small files after one opened are
// decompressed ahead of their opens.
const fillAhead = 512 << 10

// fillAheadAfter is how many small files of a directory are filled before
// its files are decompressed ahead: a program that reads one file of each
// directory (git status reads each directory's .gitignore) would have the
// daemon decompress, beside it, files nobody reads.
const fillAheadAfter = 2

// fillAhead starts decompressing the blocks of the small lower files that
// follow file n in its directory, from where an earlier fill ahead in that
// directory stopped, in the background (bounded by decodeSlots, waited for
// by Unmount).
func (ov *overlay) fillAhead(n *node) {
	d, name, ok := n.parent()
	if !ok || d.lower == 0 || ov.unmounted.Load() {
		return
	}
	if d.fillOpens.Add(1) < fillAheadAfter {
		// One file of the directory read: not yet a reader of many.
		return
	}
	ents := d.lowerListing()
	i, found := sort.Find(len(ents), func(i int) int { return strings.Compare(name, ents[i].Name) })
	if !found || ents[i].Ino != n.lower {
		return
	}
	// The window: the small files after i, up to fillAhead bytes.
	type file struct {
		at  int
		ino archive.Inode
	}
	var win []file
	var bytes int64
	end := i + 1
	for ; end < len(ents) && bytes < fillAhead; end++ {
		if !ents[end].Mode.IsRegular() {
			continue
		}
		a, err := ov.lower.Stat(ents[end].Ino)
		if err != nil || a.Size == 0 || a.Size > ov.opts.OpenFillMax {
			continue
		}
		win = append(win, file{end, ents[end].Ino})
		bytes += a.Size
	}
	// Claim the part of it no earlier open claimed.
	var from int64
	for {
		from = d.fillAheadTo.Load()
		if int64(end) <= from {
			return
		}
		if d.fillAheadTo.CompareAndSwap(from, int64(end)) {
			break
		}
	}
	var todo []archive.Inode
	for _, f := range win {
		if int64(f.at) >= from {
			todo = append(todo, f.ino)
		}
	}
	if len(todo) == 0 {
		return
	}
	ov.prefetching.Add(1)
	go func() {
		defer ov.prefetching.Done()
		var one [1]byte
		for _, ino := range todo {
			decodeSlots <- struct{}{}
			if ov.unmounted.Load() {
				<-decodeSlots
				return
			}
			// One byte loads (reads, checks, decompresses) the block
			// holding the file's start into the block cache.
			ov.lowerReadAt(ino, one[:], 0)
			<-decodeSlots
		}
	}()
}

// lowerListing returns directory d's lower listing, kept on the node (it
// never changes); nil if it cannot be read.
func (d *node) lowerListing() []archive.DirEntry {
	if l := d.lowerEnts.Load(); l != nil {
		return *l
	}
	ents, err := d.ov.lower.ReadDir(d.lower)
	if err != nil {
		return nil
	}
	d.lowerEnts.Store(&ents)
	return ents
}
