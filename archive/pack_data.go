package archive

import (
	"bytes"
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	iofs "io/fs"
	"math"
	"os"
	"sync"

	"golang.org/x/sys/unix"
)

// The data phase is a pipeline: one producer goroutine reads files in
// order and cuts them into blocks (packing small files into fragment
// blocks), Workers goroutines compress blocks in parallel, and the calling
// goroutine writes the results in the producer's order. The order channel's
// capacity bounds the blocks in flight, so memory does not grow with the
// tree.

type jobKind uint8

const (
	jobData        jobKind = iota // a data block of file
	jobFragment                   // a full fragment block
	jobRaw                        // an already compressed block copied from another archive
	jobRawFragment                // an already compressed fragment block copied from another archive
)

type job struct {
	kind  jobKind
	hole  int    // for a data block known to be a hole: its length (in is nil)
	in    []byte // the block (pooled)
	file  *fileData
	frag  uint32
	ready chan struct{}

	// Set by the worker (or the producer for jobRaw) before ready closes.
	out  []byte // bytes to store; aliases in, or a pooled compressed buffer
	comp []byte // pooled buffer to return, if any
	word uint32 // on-disk size word; 0 for a hole
	crc  uint32
	err  error
}

type fragEntry struct {
	start uint64
	word  uint32
}

var zeroBlock = make([]byte, maxBlockSize)

func allZero(b []byte) bool { return bytes.Equal(b, zeroBlock[:len(b)]) }

// bufPool is a free list of block buffers. Unlike a sync.Pool it survives
// garbage collections, so the pipeline's buffers are allocated once per
// pack rather than again after every GC.
type bufPool struct {
	size int
	free chan []byte
}

func newBufPool(size, n int) *bufPool { return &bufPool{size: size, free: make(chan []byte, n)} }

func (b *bufPool) get() []byte {
	select {
	case buf := <-b.free:
		return buf[:b.size]
	default:
		return make([]byte, b.size)
	}
}

func (b *bufPool) put(buf []byte) {
	if cap(buf) < b.size {
		return
	}
	select {
	case b.free <- buf[:cap(buf)]:
	default:
	}
}

// dataWriter carries the state of one data phase.
type dataWriter struct {
	p       *packer
	ctx     context.Context
	jobs    chan *job
	order   chan *job
	in      *bufPool
	comp    *bufPool
	frag    []byte // fragment block being filled (pooled), nil if none
	fragIdx uint32 // its index
	nfrags  uint32 // fragment indexes handed out

	// Dedup: files whose size another file shares are hashed; a later file
	// with the same size and SHA-256 shares the first one's blocks.
	sizeCount map[int64]int
	byHash    map[[32]byte]*fileData
	hashed    map[int64]bool // sizes of which some written file has a hash

	prehash map[*node]*prehash // hashes of later same-size files, computed ahead

	reused map[reuseKey]*fileData // content copied from earlier archives
	// Fragment blocks of earlier archives copied whole (see reuseFragment).
	adopted  map[oldFragment]uint32
	liveFrag map[oldFragment]int64 // bytes of this tree's files in each
	scanned  bool
}

func (p *packer) writeData(ctx context.Context, out *output) ([]fragEntry, error) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	workers := p.opts.Workers
	d := &dataWriter{
		p:         p,
		ctx:       ctx,
		jobs:      make(chan *job, workers),
		order:     make(chan *job, 16*workers+16),
		in:        newBufPool(p.bs, 20*workers+20),
		comp:      newBufPool(p.bs, 20*workers+20),
		sizeCount: map[int64]int{},
		byHash:    map[[32]byte]*fileData{},
		hashed:    map[int64]bool{},
	}
	for _, n := range p.order {
		if n.size > 0 {
			d.sizeCount[n.size]++
		}
	}
	var wg sync.WaitGroup
	if later := d.laterCandidates(); len(later) > 0 {
		wg.Go(func() { d.hashAhead(later) })
	}
	for range workers {
		wg.Go(func() {
			bc := p.codec.newWorker()
			for j := range d.jobs {
				d.process(bc, j)
				close(j.ready)
			}
		})
	}
	var prodErr error
	go func() {
		defer close(d.order)
		defer close(d.jobs)
		prodErr = d.produce()
	}()

	var frags []fragEntry
	var werr error
	for j := range d.order {
		<-j.ready
		if werr == nil {
			if j.err != nil {
				werr = j.err
			} else {
				werr = d.store(out, j, &frags)
			}
			if werr != nil {
				cancel()
			}
		}
		d.release(j)
	}
	// The producer is done; stop hashing files it no longer needs.
	cancel()
	wg.Wait()
	if werr != nil {
		return nil, werr
	}
	if prodErr != nil {
		return nil, prodErr
	}
	for i, f := range frags {
		if f.word == 0 {
			return nil, fmt.Errorf("internal error: fragment %d never written", i)
		}
	}
	return frags, nil
}

// store writes one finished block and records where it went.
func (d *dataWriter) store(out *output, j *job, frags *[]fragEntry) error {
	switch j.kind {
	case jobData, jobRaw:
		fd := j.file
		if !fd.started {
			fd.start = out.pos
			fd.started = true
		}
		if j.hole > 0 {
			fd.sparse += uint64(j.hole)
		} else if j.word == 0 {
			fd.sparse += uint64(len(j.in))
		} else {
			out.write(j.out, kindData, j.crc)
		}
		fd.words = append(fd.words, j.word)
	case jobFragment, jobRawFragment:
		// Indexes are handed out when a fragment is started, so blocks
		// copied from another archive can land before the one being
		// filled: place entries by index.
		for uint32(len(*frags)) <= j.frag {
			*frags = append(*frags, fragEntry{})
		}
		(*frags)[j.frag] = fragEntry{start: out.pos, word: j.word}
		out.write(j.out, kindFragment, j.crc)
	}
	return out.err
}

func (d *dataWriter) release(j *job) {
	if j.kind != jobRaw && j.kind != jobRawFragment && j.in != nil {
		d.in.put(j.in)
	}
	if j.comp != nil {
		d.comp.put(j.comp)
	}
	j.in, j.out, j.comp = nil, nil, nil
}

func (d *dataWriter) process(bc blockCompressor, j *job) {
	if j.hole > 0 || (j.kind == jobData && allZero(j.in)) {
		j.word = 0
		return
	}
	buf := d.comp.get()
	c, ok, err := bc.compress(buf, j.in)
	if err != nil {
		d.comp.put(buf)
		j.err = fmt.Errorf("compress: %w", err)
		return
	}
	if ok {
		j.out, j.comp = c, c
		j.word = uint32(len(c))
	} else {
		d.comp.put(buf)
		j.out = j.in
		j.word = uint32(len(j.in)) | dataUncompBit
	}
	j.crc = crc32c(j.out)
}

func (d *dataWriter) submit(j *job) error {
	j.ready = make(chan struct{})
	if j.kind == jobRaw || j.kind == jobRawFragment {
		close(j.ready)
	} else {
		select {
		case d.jobs <- j:
		case <-d.ctx.Done():
			return d.ctx.Err()
		}
	}
	select {
	case d.order <- j:
		return nil
	case <-d.ctx.Done():
		return d.ctx.Err()
	}
}

func (d *dataWriter) produce() error {
	for _, n := range d.p.order {
		if err := d.ctx.Err(); err != nil {
			return err
		}
		if err := d.produceFile(n); err != nil {
			return err
		}
	}
	return d.flushFragment()
}

// flushFragment queues the fragment block being filled.
func (d *dataWriter) flushFragment() error {
	if len(d.frag) == 0 {
		return nil
	}
	j := &job{kind: jobFragment, in: d.frag, frag: d.fragIdx}
	d.frag = nil
	return d.submit(j)
}

// fragmentSpace returns room for n bytes in the current fragment block,
// starting a new one when they do not fit, and where they go.
func (d *dataWriter) fragmentSpace(n int) ([]byte, uint32, uint32, error) {
	if d.frag != nil && len(d.frag)+n > d.p.bs {
		if err := d.flushFragment(); err != nil {
			return nil, 0, 0, err
		}
	}
	if d.frag == nil {
		d.frag = d.in.get()[:0]
		d.fragIdx = d.nfrags
		d.nfrags++
	}
	off := len(d.frag)
	d.frag = d.frag[:off+n]
	return d.frag[off : off+n], d.fragIdx, uint32(off), nil
}

func (d *dataWriter) produceFile(n *node) error {
	p := d.p
	fd := &fileData{size: n.size, frag: noFragment}
	n.file = fd
	p.res.Files++
	if n.size == 0 {
		return nil
	}
	p.res.DataBytes += n.size
	dupCandidate := d.sizeCount[n.size] > 1
	if ph := d.prehash[n]; ph != nil && d.hashed[n.size] {
		select {
		case <-ph.done:
		case <-d.ctx.Done():
			return d.ctx.Err()
		}
		if ph.err != nil {
			return ph.err
		}
		if prior := d.byHash[ph.sum]; !ph.skipped && prior != nil && prior.size == n.size {
			n.file = prior
			return nil
		}
	}

	f, err := p.src.Open(n.path)
	if err != nil {
		return fmt.Errorf("open %s: %w", n.path, err)
	}
	defer f.Close()
	if bsrc, ok := f.(BlockSource); ok {
		done, err := d.reuse(n, fd, bsrc)
		if err != nil || done {
			return err
		}
	}
	var h hashWriter
	if dupCandidate {
		h = sha256.New()
	}
	var rd io.Reader = f
	if u, ok := f.(interface{ unwrap() iofs.File }); ok {
		rd = u.unwrap()
	}
	if err := d.readBlocks(n, fd, rd, h); err != nil {
		return err
	}
	if h != nil {
		var sum [32]byte
		copy(sum[:], h.Sum(nil))
		if d.byHash[sum] == nil {
			d.byHash[sum] = fd
		}
		d.hashed[n.size] = true
	}
	return nil
}

type hashWriter interface {
	io.Writer
	Sum([]byte) []byte
}

// readBlocks reads the file's content and queues its blocks: files smaller
// than a block go into a fragment, larger ones into blocks of their own
// (the last one short), as mksquashfs does by default.
func (d *dataWriter) readBlocks(n *node, fd *fileData, r io.Reader, h hashWriter) error {
	bs := int64(d.p.bs)
	if n.size < bs {
		buf, idx, off, err := d.fragmentSpace(int(n.size))
		if err != nil {
			return err
		}
		if err := readFull(r, buf, n.path); err != nil {
			return err
		}
		if h != nil {
			h.Write(buf)
		}
		fd.frag, fd.fragOff = idx, off
		return nil
	}
	nblocks := (n.size + bs - 1) / bs
	fd.words = make([]uint32, 0, nblocks)
	// Local files are read with pread, skipping the holes the filesystem
	// reports (sparse database files) without reading their zeros.
	osf, _ := r.(*os.File)
	holes := holeFinder{f: osf}
	for i := range nblocks {
		off := i * bs
		k := min(bs, n.size-off)
		if holes.hole(off, k) {
			if h != nil {
				h.Write(zeroBlock[:k])
			}
			if err := d.submit(&job{kind: jobData, hole: int(k), file: fd}); err != nil {
				return err
			}
			continue
		}
		buf := d.in.get()[:k]
		var err error
		if osf != nil {
			err = readFull(io.NewSectionReader(osf, off, k), buf, n.path)
		} else {
			err = readFull(r, buf, n.path)
		}
		if err != nil {
			d.in.put(buf)
			return err
		}
		if h != nil {
			h.Write(buf)
		}
		if err := d.submit(&job{kind: jobData, in: buf, file: fd}); err != nil {
			return err
		}
	}
	return nil
}

// holeFinder asks the filesystem where a file's data is (SEEK_DATA), so
// whole blocks inside holes need not be read.
type holeFinder struct {
	f      *os.File
	dataAt int64 // next data at or after the last query; -1 unknown
	valid  bool
	off    bool // SEEK_DATA unsupported or failed: stop asking
}

// hole reports whether [off, off+n) lies entirely in a hole.
func (h *holeFinder) hole(off, n int64) bool {
	if h.f == nil || h.off {
		return false
	}
	if !h.valid || h.dataAt < off {
		d, err := unix.Seek(int(h.f.Fd()), off, unix.SEEK_DATA)
		switch {
		case err == unix.ENXIO:
			d = math.MaxInt64 // no data after off
		case err != nil:
			h.off = true
			return false
		}
		h.dataAt, h.valid = d, true
	}
	return h.dataAt >= off+n
}

func readFull(r io.Reader, buf []byte, name string) error {
	_, err := io.ReadFull(r, buf)
	if errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, io.EOF) {
		return fmt.Errorf("read %s: file shrank while being packed", name)
	}
	if err != nil {
		return fmt.Errorf("read %s: %w", name, err)
	}
	return nil
}

// prehash is the content hash of a file that may duplicate an earlier one,
// computed by hashAhead while earlier files are being compressed.
type prehash struct {
	done    chan struct{}
	sum     [32]byte
	skipped bool // the file comes from an earlier archive: reuse decides
	err     error
}

// laterCandidates lists, in data order, the files whose size an earlier
// file has: only they may turn out to be duplicates of what is already
// written.
func (d *dataWriter) laterCandidates() []*node {
	var later []*node
	seen := map[int64]bool{}
	d.prehash = map[*node]*prehash{}
	for _, n := range d.p.order {
		if n.size == 0 || d.sizeCount[n.size] < 2 {
			continue
		}
		if seen[n.size] {
			later = append(later, n)
			d.prehash[n] = &prehash{done: make(chan struct{})}
		}
		seen[n.size] = true
	}
	return later
}

// hashAhead hashes the later candidates in order, off the producer's path,
// so that deciding whether a big file (a copy of state.db) is a duplicate
// does not stall the pipeline.
func (d *dataWriter) hashAhead(later []*node) {
	buf := make([]byte, 1<<20)
	for _, n := range later {
		ph := d.prehash[n]
		if d.ctx.Err() != nil {
			ph.err = d.ctx.Err()
		} else {
			ph.sum, ph.skipped, ph.err = d.hashFile(n, buf)
		}
		close(ph.done)
	}
}

// hashFile reads a whole file to learn whether it duplicates one already
// written; files that come from an earlier archive are left to reuse.
func (d *dataWriter) hashFile(n *node, buf []byte) (sum [32]byte, skipped bool, err error) {
	f, err := d.p.src.Open(n.path)
	if err != nil {
		return sum, false, fmt.Errorf("open %s: %w", n.path, err)
	}
	defer f.Close()
	if bsrc, ok := f.(BlockSource); ok {
		if _, _, ok := bsrc.ArchiveSource(); ok {
			return sum, true, nil
		}
	}
	h := sha256.New()
	m, err := io.CopyBuffer(h, io.LimitReader(onlyReader{f}, n.size), buf)
	if err != nil {
		return sum, false, fmt.Errorf("read %s: %w", n.path, err)
	}
	if m != n.size {
		return sum, false, fmt.Errorf("read %s: file shrank while being packed", n.path)
	}
	copy(sum[:], h.Sum(nil))
	return sum, false, nil
}

// onlyReader hides WriterTo/ReaderFrom so CopyBuffer uses our buffer.
type onlyReader struct{ io.Reader }
