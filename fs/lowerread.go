package fs

import (
	"fmt"
	"io"
	"runtime"
	"runtime/debug"
	"sync"

	"github.com/hermesfs/hermesfs/archive"
)

// Reading the lower layer costs decompression, block by block, and on a
// cold cache it is what a reader of archived files waits for. Three things
// keep it off the reader's path and use every core:
//
//   - a request spanning several archive blocks decompresses them in
//     parallel (readLower);
//   - a sequential reader has the window after the one it asked for
//     decompressed in the background, in parallel too, while the kernel
//     copies the current one out, so its next request finds the blocks in
//     the archive's block cache (prefetch);
//   - nothing is decompressed at open: the page cache is kept across
//     opens, so a file read before needs no READ at all, and work started
//     at open would be wasted on it (measured on the 1 GiB home: warm
//     reads took 1.27–1.40 s with a first window decompressed at every
//     open, 0.95–1.03 s without; cold reads gained nothing measurable).
//
// The kernel's read-ahead decides how large requests are; Options.ReadAhead
// raises it where the daemon may.

// blockSizer is implemented by a Lower that reads in blocks, as
// *archive.Reader does: requests are split at its block boundaries.
type blockSizer interface{ BlockSize() int }

// prefetchWindow is the least that is decompressed ahead of a sequential
// reader: a whole request of the default read-ahead.
const prefetchWindow = 1 << 20

var prefetchBufs = sync.Pool{New: func() any { b := make([]byte, prefetchWindow); return &b }}

// decodeSlots bounds the background decompression of all mounts to one
// goroutine per core: prefetching must not starve the requests it serves.
var decodeSlots = make(chan struct{}, runtime.GOMAXPROCS(0))

// readLower reads lower file ino at off into p, with io.ReaderAt
// semantics, decompressing the blocks p spans in parallel.
func (ov *overlay) readLower(ino archive.Inode, p []byte, off int64) (int, error) {
	bs := ov.lowerBlock
	if bs <= 0 || int64(len(p)) <= bs {
		return ov.lower.ReadAt(ino, p, off)
	}
	// Chunks end at block boundaries, so no block is decompressed by two.
	type chunk struct {
		lo, hi int // in p
		n      int
		err    error
	}
	var chunks []chunk
	for lo := 0; lo < len(p); {
		hi := min(len(p), lo+int(bs-(off+int64(lo))%bs))
		chunks = append(chunks, chunk{lo: lo, hi: hi})
		lo = hi
	}
	workers := min(runtime.GOMAXPROCS(0), len(chunks))
	var next sync.Mutex
	i := 0
	work := func() {
		for {
			next.Lock()
			if i == len(chunks) {
				next.Unlock()
				return
			}
			c := &chunks[i]
			i++
			next.Unlock()
			c.n, c.err = ov.lowerReadAt(ino, p[c.lo:c.hi], off+int64(c.lo))
		}
	}
	var wg sync.WaitGroup
	for w := 1; w < workers; w++ {
		wg.Go(work)
	}
	work()
	wg.Wait()
	n := 0
	for _, c := range chunks {
		n += c.n
		if c.err != nil && c.err != io.EOF {
			return n, c.err
		}
		if c.n < c.hi-c.lo {
			return n, io.EOF
		}
	}
	return n, nil
}

// lowerReadAt is Lower.ReadAt as the goroutines of readLower and prefetch
// call it: a panic in it (a bug in the lower layer's reader) fails this
// read with an error, as go-fuse does for the request's own goroutine,
// instead of ending the process (a snapshot's packer reads through here
// too).
func (ov *overlay) lowerReadAt(ino archive.Inode, p []byte, off int64) (n int, err error) {
	defer func() {
		if r := recover(); r != nil {
			ov.log.Error("lower layer: internal error in a read", "ino", ino, "off", off, "panic", r, "stack", string(debug.Stack()))
			n, err = 0, fmt.Errorf("read lower inode %d at %d: internal error: %v", ino, off, r)
		}
	}()
	return ov.lower.ReadAt(ino, p, off)
}

// readAhead is called after a read of lower file h ended at end: if the
// reads are sequential, the window after it (at least prefetchWindow, or
// as much as the read asked for) is decompressed in the background, from
// where earlier read-ahead stopped.
func (h *lowerFile) readAhead(end, window int64) {
	target := min(end+max(window, prefetchWindow), h.size)
	for {
		ahead := h.ahead.Load()
		if ahead >= target {
			return
		}
		if h.ahead.CompareAndSwap(ahead, target) {
			h.prefetch(max(ahead, end), target)
			return
		}
	}
}

// prefetch decompresses [off, end) of h's lower file into the archive's
// block cache in the background, block by block, each in one of the
// decodeSlots. It stops early once the handle is released or the mount
// is gone; Unmount waits for it (overlay.prefetching).
func (h *lowerFile) prefetch(off, end int64) {
	ov, ino := h.n.ov, h.n.lower
	bs := ov.lowerBlock
	if bs <= 0 {
		bs = prefetchWindow
	}
	stopped := func() bool { return h.released.Load() || ov.unmounted.Load() }
	ov.prefetching.Add(1)
	go func() {
		defer ov.prefetching.Done()
		for off < end {
			k := min(end, (off/bs+1)*bs) - off
			decodeSlots <- struct{}{}
			if stopped() {
				<-decodeSlots
				return
			}
			ov.prefetching.Add(1)
			go func(off, k int64) {
				defer ov.prefetching.Done()
				defer func() { <-decodeSlots }()
				bp := prefetchBufs.Get().(*[]byte)
				if int64(len(*bp)) < k {
					*bp = make([]byte, k)
				}
				ov.lowerReadAt(ino, (*bp)[:k], off)
				prefetchBufs.Put(bp)
			}(off, k)
			off += k
		}
	}()
}
