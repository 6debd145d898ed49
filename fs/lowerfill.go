package fs

import (
	"io"
	"sync"
	"syscall"
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
// cache itself) comes after the fill. Guarded files, whose commits replace
// the content behind the kernel's back, are not filled.

// defaultFillMax is Options.OpenFillMax when it is zero.
const defaultFillMax = 128 << 10

var fillBufs = sync.Pool{New: func() any { b := make([]byte, defaultFillMax); return &b }}

// fillOnOpen hands the content of lower file n (size bytes) to the kernel's
// page cache, if it is small enough and has not been filled during this
// mount. n.mu is held, and n has no upper file. Failures are not the
// open's: a damaged block is reported by the READ that meets it.
func (ov *overlay) fillOnOpen(n *node, size int64) {
	if size <= 0 || size > ov.opts.OpenFillMax || n.filled || ov.fillOff.Load() {
		return
	}
	n.filled = true
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
