package archive

import (
	"bytes"
	"context"
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
// blocks), Workers goroutines sum, compress and check blocks in parallel,
// and the calling goroutine writes the results in the producer's order.
// The order channel's capacity bounds the blocks in flight, so memory does
// not grow with the tree. A panic on the producer, a worker or the
// goroutine that sums duplicates ahead (in the source FS's code too) is
// that goroutine's error (PanicError): the pack fails, the process goes on.
//
// Buffers: a job's in buffer belongs to the producer until the job is
// submitted, then to the job until the writer releases it; so does a
// compressed buffer (comp) from the worker that fills it. What a worker
// needs only while it works on a block (a block decompressed to be summed
// or checked) lives in its own scratch buffer, which never leaves it: a
// buffer returned to a pool is another goroutine's the moment it is
// returned.

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
	tails []tail // jobFragment: the file tails it holds, to sum
	ready chan struct{}

	// jobRaw whose source records no sum: the worker decompresses the
	// block from src to sum it.
	src     *Reader
	wantLen int

	// Set by the worker (or the producer for raw jobs) before ready closes.
	out     []byte // bytes to store; aliases in, or a pooled compressed buffer
	comp    []byte // pooled buffer to return, if any
	word    uint32 // on-disk size word; 0 for a hole
	crc     uint32
	sum     sum   // content sum of a data block (chunk); zero if unknown
	baseOff int64 // >= 0: out is the base archive's bytes at baseOff, verbatim
	matched bool  // a read block found in Base by its sum (fromBase)
	err     error

	// PackOptions.Segment: the block is copyLen bytes of copyFrom at
	// copyOff, accounted for but not held (out is nil) nor written.
	copyFrom *Reader
	copyOff  uint64
	copyLen  uint32
}

// tail is a small file's bytes in a fragment block being filled.
type tail struct {
	file   *fileData
	off, n int
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
	tails   []tail // the tails in it
	nfrags  uint32 // fragment indexes handed out

	// Dedup: files whose size another file shares (or a file of the base
	// has) are summed; a later file with the same size and sum shares the
	// first one's blocks.
	sizeCount map[int64]int
	byHash    map[sum]*fileData
	hashed    map[int64]bool // sizes of which some written file has a sum

	prehash map[*node]*prehash // sums of later candidates, computed ahead

	reused map[reuseKey]*fileData // content copied from earlier archives
	// Fragment blocks of earlier archives copied whole (see reuseFragment).
	adopted map[oldFragment]uint32

	// Fragment table entries that point into the shared prefix, by index.
	fixedFrags map[uint32]fragEntry
}

func (p *packer) writeData(ctx context.Context, out *output) ([]fragEntry, error) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	workers := p.opts.Workers
	d := &dataWriter{
		p:          p,
		ctx:        ctx,
		jobs:       make(chan *job, workers),
		order:      make(chan *job, 16*workers+16),
		in:         newBufPool(p.bs, 20*workers+20),
		comp:       newBufPool(p.bs, 20*workers+20),
		sizeCount:  map[int64]int{},
		byHash:     map[sum]*fileData{},
		hashed:     map[int64]bool{},
		reused:     map[reuseKey]*fileData{},
		adopted:    map[oldFragment]uint32{},
		fixedFrags: map[uint32]fragEntry{},
	}
	if p.extend != nil {
		// The base's fragments keep their indexes; new ones follow.
		d.nfrags = p.extend.base.sb.Fragments
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
	dec, err := newDecompressor(p.codec.id())
	if err != nil {
		return nil, err
	}
	for range workers {
		wg.Go(func() {
			w := &worker{bc: p.codec.newWorker(), dec: dec, scratch: make([]byte, p.bs)}
			for j := range d.jobs {
				d.processContained(w, j)
				if p.opts.tamper != nil {
					p.opts.tamper(j)
				}
				if j.err == nil && !p.opts.noCheck {
					j.err = w.check(j)
				}
				close(j.ready)
			}
		})
	}
	var prodErr error
	go func() {
		defer close(d.order)
		defer close(d.jobs)
		defer recovered(&prodErr) // set before order closes
		prodErr = d.produce()
	}()

	var frags []fragEntry
	var werr error
	for j := range d.order {
		<-j.ready
		if werr == nil {
			if j.err != nil {
				werr = d.blockError(out, j, j.err)
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
	for idx, f := range d.fixedFrags {
		for uint32(len(frags)) <= idx {
			frags = append(frags, fragEntry{})
		}
		frags[idx] = f
	}
	first := 0
	if p.extend != nil {
		first = int(p.extend.base.sb.Fragments)
		for len(frags) < first {
			frags = append(frags, fragEntry{})
		}
	}
	for i, f := range frags[first:] {
		if f.word == 0 {
			return nil, fmt.Errorf("internal error: fragment %d never written", first+i)
		}
	}
	return frags[first:], nil
}

// store writes one finished block and records where it went.
func (d *dataWriter) store(out *output, j *job, frags *[]fragEntry) error {
	at := out.pos
	if j.word != 0 && j.copyFrom == nil && !d.p.opts.noCheck && crc32c(j.out) != j.crc {
		// The bytes changed since they were checked: whoever else
		// wrote into the buffer, they are not what was checked.
		return d.blockError(out, j, fmt.Errorf("%w (its bytes changed after they were checked)", errSelfCheck))
	}
	switch j.kind {
	case jobData, jobRaw:
		fd := j.file
		if !fd.started {
			fd.start = out.pos
			fd.started = true
		}
		switch {
		case j.hole > 0:
			fd.sparse += uint64(j.hole)
		case j.word == 0:
			fd.sparse += uint64(len(j.in))
		case j.copyFrom != nil:
			out.copyExtent(j.copyLen, kindData, j.crc, j.sum, j.copyFrom, j.copyOff)
		default:
			out.writeData(j.out, j.crc, j.sum)
		}
		if j.matched {
			d.p.res.MatchedBytes += int64(len(j.in))
		}
		fd.words = append(fd.words, j.word)
		fd.chunks = append(fd.chunks, j.sum)
	case jobFragment, jobRawFragment:
		// Indexes are handed out when a fragment is started, so blocks
		// copied from another archive can land before the one being
		// filled: place entries by index.
		for uint32(len(*frags)) <= j.frag {
			*frags = append(*frags, fragEntry{})
		}
		(*frags)[j.frag] = fragEntry{start: out.pos, word: j.word}
		if j.copyFrom != nil {
			out.copyExtent(j.copyLen, kindFragment, j.crc, sum{}, j.copyFrom, j.copyOff)
		} else {
			out.write(j.out, kindFragment, j.crc)
		}
	}
	if j.baseOff >= 0 && j.word != 0 {
		out.copied(at, uint64(j.baseOff), uint64(len(j.out)))
	}
	if e := d.p.extend; e != nil && j.copyFrom != nil {
		if j.copyFrom == d.p.opts.Base {
			e.copied[j.copyOff] = true
		}
		if (j.kind == jobData || j.kind == jobRaw) && j.sum.known() {
			e.copiedSums[j.sum] = true
		}
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
	j.in, j.out, j.comp, j.tails = nil, nil, nil, nil
}

// processContained is process with a panic made the job's error.
func (d *dataWriter) processContained(w *worker, j *job) {
	defer recovered(&j.err)
	d.process(w, j)
}

// blockError is the error of job j, about to be stored at out.pos: a
// failed check of Pack's own work names the block in the new archive.
func (d *dataWriter) blockError(out *output, j *job, err error) error {
	if !errors.Is(err, errSelfCheck) {
		return err
	}
	what := kindData.String()
	if j.kind == jobFragment || j.kind == jobRawFragment {
		what = kindFragment.String()
	}
	return &CorruptError{Name: out.name(), Offset: int64(out.pos), What: what, Err: err}
}

// worker is the state of one of the goroutines that process blocks.
type worker struct {
	bc      blockCompressor
	dec     decompressor // of the archive being written
	scratch []byte       // a block's content, decoded; never leaves the worker
}

// content decodes b, a block stored with size word w, into the worker's
// scratch buffer; the result is valid until the worker's next call.
func (w *worker) content(b []byte, word uint32) ([]byte, error) {
	if word&dataUncompBit != 0 {
		return b, nil
	}
	return w.dec.decompress(w.scratch[:0], b, len(w.scratch))
}

// check is Pack's check of its own work, made on each block once it is
// final and before the writer takes it: every content sum this pack
// computed for the block (a new block's or a changed block's, one copied
// from an archive that records none, the tails of a fragment block) must
// be the sum of what the bytes to be stored decode to. Sums that come
// with the bytes they cover from an earlier archive's trailer (the copy
// checked against its checksum) are that archive's, and are not
// recomputed. The writer then checks that the bytes are still the ones
// checked (store). A failure is a packer bug, never damage of an input:
// the pack fails instead of producing an archive whose blocks do not
// match their sums.
func (w *worker) check(j *job) error {
	if j.copyFrom != nil && j.out == nil {
		// A block of another archive, neither read nor written
		// (PackOptions.Segment): its bytes and sum are that archive's.
		return nil
	}
	switch j.kind {
	case jobData, jobRaw:
		n := len(j.in)
		if j.hole > 0 {
			n = j.hole
		} else if j.kind == jobRaw {
			n = j.wantLen
		}
		if j.word == 0 {
			if j.sum != zeroChunkSum(n) {
				return fmt.Errorf("%w (a hole of %d bytes)", errSelfCheck, n)
			}
			return nil
		}
		c, err := w.content(j.out, j.word)
		if err != nil {
			return fmt.Errorf("%w (it does not decompress: %v)", errSelfCheck, err)
		}
		if len(c) != n {
			return fmt.Errorf("%w (it holds %d bytes, not %d)", errSelfCheck, len(c), n)
		}
		if chunkSum(c) != j.sum {
			return errSelfCheck
		}
	case jobFragment:
		c, err := w.content(j.out, j.word)
		if err != nil {
			return fmt.Errorf("%w (it does not decompress: %v)", errSelfCheck, err)
		}
		if len(c) != len(j.in) {
			return fmt.Errorf("%w (it holds %d bytes, not %d)", errSelfCheck, len(c), len(j.in))
		}
		for _, t := range j.tails {
			if chunkSum(c[t.off:t.off+t.n]) != t.file.tailSum {
				return fmt.Errorf("%w (the file tail of %d bytes at %d)", errSelfCheck, t.n, t.off)
			}
		}
	}
	return nil
}

func (d *dataWriter) process(w *worker, j *job) {
	switch j.kind {
	case jobRaw:
		// A copied block comes here only when its source archive
		// records no sum for it (submit): learn the sum from its
		// content, so the new archive records one. The content is
		// decoded into the worker's own buffer: from a shared pool it
		// could be taken, and written, by another worker before the
		// sum is done.
		b, err := j.src.blockContent(w.scratch[:0], j.out, j.word)
		if err == nil && len(b) != j.wantLen {
			err = fmt.Errorf("block holds %d bytes, want %d", len(b), j.wantLen)
		}
		if err != nil {
			j.err = fmt.Errorf("reuse block of %s: %w", j.src.name, err)
			return
		}
		j.sum = chunkSum(b)
		return
	case jobFragment:
		for _, t := range j.tails {
			t.file.tailSum = chunkSum(j.in[t.off : t.off+t.n])
		}
	}
	if j.hole > 0 {
		j.sum = zeroChunkSum(j.hole)
		j.word = 0
		return
	}
	if j.kind == jobData {
		if !j.sum.known() {
			j.sum = chunkSum(j.in)
		}
		if allZero(j.in) {
			j.word = 0
			return
		}
		if ok, err := d.fromBase(j); ok || err != nil {
			j.err = err
			return
		}
	}
	buf := d.comp.get()
	c, ok, err := w.bc.compress(buf, j.in)
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

// fromBase stores a data block whose content the base archive already
// holds as that block, copied verbatim (checked) instead of compressed: an
// unchanged block of a changed file.
func (d *dataWriter) fromBase(j *job) (bool, error) {
	b := d.p.base
	if b == nil || b.ix == nil {
		return false, nil
	}
	loc, ok := b.ix.byBlock[j.sum]
	if !ok {
		return false, nil
	}
	r := b.r
	n := loc.word &^ dataUncompBit
	if d.p.opts.Segment {
		crc, err := r.crcAt(loc.off, n, kindData.String())
		if err != nil {
			return true, fmt.Errorf("copy block from base: %w", err)
		}
		j.word, j.crc, j.copyFrom, j.copyOff, j.copyLen = loc.word, crc, r, loc.off, n
		j.matched = true
		return true, nil
	}
	raw, err := r.readAt(loc.off, uint64(n), kindData.String())
	if err == nil {
		err = r.check(loc.off, raw, kindData.String())
	}
	if err != nil {
		return true, fmt.Errorf("copy block from base: %w", err)
	}
	j.out, j.word, j.crc, j.baseOff = raw, loc.word, crc32c(raw), int64(loc.off)
	j.matched = true
	return true, nil
}

func (d *dataWriter) submit(j *job) error {
	if j.kind != jobRaw && j.kind != jobRawFragment {
		j.baseOff = -1
	}
	j.ready = make(chan struct{})
	if (j.kind == jobRaw && (j.sum.known() || j.src == nil)) || j.kind == jobRawFragment {
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
	report := d.p.opts.Progress
	var pr PackProgress
	if report != nil {
		for _, n := range d.p.order {
			pr.TotalFiles++
			pr.TotalBytes += n.size
		}
		report(pr)
	}
	for _, n := range d.p.order {
		if err := d.ctx.Err(); err != nil {
			return err
		}
		if err := d.produceFile(n); err != nil {
			return err
		}
		if report != nil {
			pr.Files++
			pr.Bytes += n.size
			report(pr)
		}
	}
	return d.flushFragment()
}

// flushFragment queues the fragment block being filled.
func (d *dataWriter) flushFragment() error {
	if len(d.frag) == 0 {
		return nil
	}
	j := &job{kind: jobFragment, in: d.frag, frag: d.fragIdx, tails: d.tails}
	d.frag, d.tails = nil, nil
	return d.submit(j)
}

// fragmentSpace returns room for n bytes of fd in the current fragment
// block, starting a new one when they do not fit, and where they go.
func (d *dataWriter) fragmentSpace(fd *fileData, n int) ([]byte, uint32, uint32, error) {
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
	d.tails = append(d.tails, tail{file: fd, off: off, n: n})
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
	if p.base != nil && p.base.appending && n.inBase != 0 {
		return d.inPlace(n, fd)
	}
	if n.sum.known() {
		// Summed before packing (its size is one of the base's) and not
		// found there; maybe a duplicate of a file written already.
		if prior := d.byHash[n.sum]; prior != nil && prior.size == n.size {
			n.file = prior
			p.res.ReusedBytes += prior.reusedBytes
			return nil
		}
	} else if ph := d.prehash[n]; ph != nil && d.hashed[n.size] {
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
			p.res.ReusedBytes += prior.reusedBytes
			return nil
		}
	}
	if n.inBase != 0 {
		return d.reuse(n, fd, p.base.r, n.inBase)
	}
	var f iofs.File
	if !n.checked {
		var err error
		if f, err = p.src.Open(n.path); err != nil {
			return fmt.Errorf("open %s: %w", n.path, err)
		}
		defer f.Close()
		p.sourceOf(n, f)
	}
	if n.src != nil {
		return d.reuse(n, fd, n.src.r, n.src.ino)
	}
	if f == nil {
		var err error
		if f, err = p.src.Open(n.path); err != nil {
			return fmt.Errorf("open %s: %w", n.path, err)
		}
		defer f.Close()
	}
	// Asked even when plan asked for a BlockSource already.
	if ps, ok := f.(PartialSource); ok && n.size >= int64(p.bs) {
		if done, err := d.reusePartial(n, fd, ps); done || err != nil {
			return err
		}
	}
	var rd io.Reader = f
	if u, ok := f.(interface{ unwrap() iofs.File }); ok {
		rd = u.unwrap()
	}
	summed := d.sizeCount[n.size] > 1
	s, err := d.readBlocks(n, fd, rd, summed)
	if err != nil {
		return err
	}
	if summed {
		d.remember(fd, s)
	}
	return nil
}

// remember makes fd's content, of sum s, a target for later duplicates.
func (d *dataWriter) remember(fd *fileData, s sum) {
	if !s.known() {
		return
	}
	if d.byHash[s] == nil {
		d.byHash[s] = fd
	}
	d.hashed[fd.size] = true
}

// readBlocks reads the file's content and queues its blocks: files smaller
// than a block go into a fragment, larger ones into blocks of their own
// (the last one short), as mksquashfs does by default. With summed set it
// returns the content's sum, computed as it reads.
func (d *dataWriter) readBlocks(n *node, fd *fileData, r io.Reader, summed bool) (sum, error) {
	bs := int64(d.p.bs)
	if n.size < bs {
		buf, idx, off, err := d.fragmentSpace(fd, int(n.size))
		if err != nil {
			return sum{}, err
		}
		if err := readFull(r, buf, n.path); err != nil {
			return sum{}, err
		}
		fd.frag, fd.fragOff = idx, off
		if summed {
			return fileSum(n.size, []sum{chunkSum(buf)}), nil
		}
		return sum{}, nil
	}
	nblocks := (n.size + bs - 1) / bs
	fd.words = make([]uint32, 0, nblocks)
	fd.chunks = make([]sum, 0, nblocks)
	var chunks []sum
	// Local files are read with pread, skipping the holes the filesystem
	// reports (sparse database files) without reading their zeros.
	osf, _ := r.(*os.File)
	holes := holeFinder{f: osf}
	for i := range nblocks {
		off := i * bs
		k := min(bs, n.size-off)
		if holes.hole(off, k) {
			if summed {
				chunks = append(chunks, zeroChunkSum(int(k)))
			}
			if err := d.submit(&job{kind: jobData, hole: int(k), file: fd}); err != nil {
				return sum{}, err
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
			return sum{}, err
		}
		j := &job{kind: jobData, in: buf, file: fd}
		if summed {
			j.sum = chunkSum(buf)
			chunks = append(chunks, j.sum)
		}
		if err := d.submit(j); err != nil {
			return sum{}, err
		}
	}
	if summed {
		return fileSum(n.size, chunks), nil
	}
	return sum{}, nil
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

// prehash is the content sum of a file that may duplicate an earlier one,
// computed by hashAhead while earlier files are being compressed.
type prehash struct {
	done    chan struct{}
	sum     sum
	skipped bool // the file is an earlier archive's content: reuse decides
	err     error
}

// laterCandidates lists, in data order, the files to sum ahead: those whose
// size an earlier file has, which may duplicate what is already written.
// Files known to come from an archive are left to reuse, and files summed
// before packing need no second sum.
func (d *dataWriter) laterCandidates() []*node {
	var later []*node
	seen := map[int64]bool{}
	d.prehash = map[*node]*prehash{}
	for _, n := range d.p.order {
		if n.size == 0 {
			continue
		}
		earlier := seen[n.size]
		seen[n.size] = true
		if earlier && n.src == nil && n.inBase == 0 && !n.sum.known() {
			later = append(later, n)
			d.prehash[n] = &prehash{done: make(chan struct{})}
		}
	}
	return later
}

// hashAhead sums the later candidates in order, off the producer's path,
// so that deciding whether a big file (a copy of state.db) is a duplicate
// does not stall the pipeline.
func (d *dataWriter) hashAhead(later []*node) {
	buf := make([]byte, d.p.bs)
	for _, n := range later {
		ph := d.prehash[n]
		if d.ctx.Err() != nil {
			ph.err = d.ctx.Err()
		} else {
			ph.sum, ph.skipped, ph.err = d.p.sumFileContained(n, buf)
		}
		close(ph.done)
	}
}

// sumFileContained is sumFile with a panic made its error.
func (p *packer) sumFileContained(n *node, buf []byte) (s sum, skipped bool, err error) {
	defer recovered(&err)
	return p.sumFile(n, buf)
}

// sumFile reads a whole file for its content sum. Files that come from
// an earlier archive are left to reuse (when no plan asked them before),
// and so are files that are an earlier archive's content with some bytes
// changed (PartialSource): reading them whole is what reusePartial
// spares.
func (p *packer) sumFile(n *node, buf []byte) (sum, bool, error) {
	f, err := p.src.Open(n.path)
	if err != nil {
		return sum{}, false, fmt.Errorf("open %s: %w", n.path, err)
	}
	defer f.Close()
	if bsrc, ok := f.(BlockSource); ok {
		if _, _, ok := bsrc.ArchiveSource(); ok {
			return sum{}, true, nil
		}
	}
	if ps, ok := f.(PartialSource); ok && n.size >= int64(p.bs) {
		if r, _, changed, ok := ps.PartialArchiveSource(); ok && r != nil && changed != nil {
			return sum{}, true, nil
		}
	}
	s, m, err := sumStream(onlyReader{f}, n.size, p.bs, buf)
	if m != n.size && (err == nil || errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF)) {
		return sum{}, false, fmt.Errorf("read %s: file shrank while being packed", n.path)
	}
	if err != nil {
		return sum{}, false, fmt.Errorf("read %s: %w", n.path, err)
	}
	return s, false, nil
}

// onlyReader hides WriterTo/ReaderFrom so reads use our buffer.
type onlyReader struct{ io.Reader }
