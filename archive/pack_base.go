package archive

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
)

// Packing on a base archive (PackOptions.Base). See "Snapshots that cost
// what changed" in doc.go for the layout; this file decides between
// appending and compacting, places unchanged files in the shared prefix
// and copies that prefix.

// BaseUse says how Pack used PackOptions.Base.
type BaseUse string

const (
	// BaseUnused: no base, or one whose blocks cannot be used (another
	// compression or block size, no integrity trailer).
	BaseUnused BaseUse = ""
	// BaseAppended: the archive starts with the base's data region, byte
	// for byte at the same offsets; unchanged files point into it.
	BaseAppended BaseUse = "appended"
	// BaseCompacted: the base's data region carried too much garbage, so
	// the archive is laid out afresh; unchanged files' blocks are still
	// copied from the base rather than recompressed.
	BaseCompacted BaseUse = "compacted"
	// BaseExtended: the image is the base's image grown at the end of
	// each region (PackOptions.Extend): only what changed was written.
	BaseExtended BaseUse = "extended"
)

// errStop ends an iteration early.
var errStop = errors.New("stop")

// CopyRange is a byte range of a packed archive that is a verbatim copy of
// a range of the same length of the base archive.
type CopyRange struct {
	Offset     int64 // in the new archive
	BaseOffset int64 // in the base
	Length     int64
}

// DefaultMaxGarbage is the share of the new archive's data that may be
// garbage (blocks no file uses any more) for a pack to still append to
// the base.
const DefaultMaxGarbage = 0.25

// baseState is the base archive of one pack.
type baseState struct {
	r  *Reader
	ix *contentIndex // nil when the base records no content sums

	// For appending: the base's data region [start, end), which must be
	// data and fragment blocks only, and what in it is still in use.
	canAppend  bool
	start, end uint64
	appending  bool
	live       map[uint64]uint64 // block offset -> on-disk length, of blocks in use
	inPlace    map[Inode]*fileData
	fragIndex  map[int]uint32 // base fragment -> fragment index in the new archive
	prefixLive uint64         // bytes of live in the region
}

// lookup returns the base's regular inode of size bytes whose content has
// sum s, or 0.
func (b *baseState) lookup(s sum, size int64) Inode {
	if b == nil || b.ix == nil || !s.known() {
		return 0
	}
	ino, ok := b.ix.byFile[s]
	if !ok {
		return 0
	}
	if a, err := b.r.Stat(ino); err != nil || a.Size != size {
		return 0
	}
	return ino
}

// newBase checks what base can be used for by this pack: nothing unless
// it has our checksums, the same block size and the same compression.
func (p *packer) newBase(r *Reader) *baseState {
	if r == nil || !r.Checksummed() || r.bs != p.bs || r.Compression() != p.opts.Compression {
		return nil
	}
	b := &baseState{r: r, live: map[uint64]uint64{}, inPlace: map[Inode]*fileData{}, fragIndex: map[int]uint32{}}
	if r.hasSums() {
		b.ix = r.index()
	}
	// Appending needs the very same compressor options (they precede the
	// data region) and a data region of blocks only.
	opts := p.codec.options()
	b.start = superblockSize
	if opts != nil {
		b.start += 2 + uint64(len(opts))
	}
	want := r.sb.Flags&flagCompOpts != 0
	if want != (opts != nil) {
		return b
	}
	if opts != nil {
		hb, err := r.readAt(superblockSize, b.start-superblockSize, kindCompOpts.String())
		if err != nil || !bytes.Equal(hb[2:], opts) {
			return b
		}
	}
	b.end = r.sb.InodeTable
	if b.end < b.start {
		return b
	}
	// The region must be data and fragment blocks only, from its first
	// byte to its last.
	next := b.start
	err := r.eachRecord(b.start, b.end, func(off uint64, bi blockInfo, _ *trPage, _ int) error {
		if off != next || (bi.kind != kindData && bi.kind != kindFragment) {
			return errStop
		}
		next = off + uint64(bi.length)
		return nil
	})
	if err != nil || next != b.end {
		return b
	}
	b.canAppend = true
	return b
}

// plan learns, before any data is written, which files are an earlier
// archive's content (their BlockSource) and which of those the base holds,
// and from that whether the new archive appends to the base.
//
// Without a base, files are asked as they are packed instead (opening each
// file twice would cost a plain pack of many small files dearly).
func (p *packer) plan(ctx context.Context) error {
	b := p.base
	if b == nil {
		return nil
	}
	for _, n := range p.order {
		if n.size == 0 {
			continue
		}
		p.source(n)
		if n.src == nil {
			continue
		}
		if n.src.r == b.r {
			n.inBase = n.src.ino
		} else {
			// Unchanged content of another archive (the layer a view
			// sits on, when the base is the last snapshot made of it).
			s := n.src.r.fileSumOf(n.src.ino)
			if !s.known() && b.ix != nil {
				// That archive records no sums (written before they
				// were): learn them once from its content.
				var err error
				if s, err = n.src.r.contentSum(ctx, n.src.ino, p.bs); err != nil {
					return fmt.Errorf("sum %s: %w", n.path, err)
				}
			}
			n.inBase = b.lookup(s, n.size)
		}
	}
	// Files the base may hold although nothing says so (written back
	// unchanged, copies, a database copied up but not changed since the
	// base): those of a size the base has are summed now, so that what
	// they keep alive counts before appending is decided.
	if b.ix != nil {
		buf := make([]byte, p.bs)
		for _, n := range p.order {
			if n.size == 0 || n.src != nil || n.inBase != 0 || !b.ix.sizes[n.size] {
				continue
			}
			if err := ctx.Err(); err != nil {
				return err
			}
			s, skipped, err := p.sumFile(n, buf)
			if err != nil {
				return err
			}
			if !skipped {
				n.sum = s
				n.inBase = b.lookup(s, n.size)
			}
		}
	}
	if p.extend != nil {
		// Only base files matter, and they are used in place.
		return nil
	}
	if err := p.scanFragments(ctx); err != nil {
		return err
	}
	if !b.canAppend {
		return nil
	}
	for _, n := range p.order {
		if n.inBase != 0 {
			if err := b.markLive(n.inBase); err != nil {
				return err
			}
		}
	}
	// Garbage is weighed against the archive to be: the region plus what
	// is not in it yet, estimated at the base's compression ratio.
	region := b.end - b.start
	var newBytes int64
	for _, n := range p.order {
		if n.inBase == 0 {
			newBytes += n.size
		}
	}
	est := float64(region)
	if total := b.r.contentBytes(); total > 0 {
		est += float64(newBytes) * float64(region) / float64(total)
	}
	limit := p.opts.MaxGarbage
	if limit == 0 {
		limit = DefaultMaxGarbage
	}
	b.appending = limit >= 0 && float64(region-b.prefixLive) <= limit*est
	return nil
}

// scanFragments learns, once per pack, how many bytes of each earlier
// fragment block the small files to be packed use, so that reuseFragment
// can tell whether copying the block whole is worth it.
func (p *packer) scanFragments(ctx context.Context) error {
	p.liveFrag = map[oldFragment]int64{}
	for _, n := range p.order {
		if n.size == 0 || n.size >= int64(p.bs) {
			continue
		}
		if err := ctx.Err(); err != nil {
			return err
		}
		p.source(n)
		r, ino := p.effectiveSource(n)
		if r == nil {
			continue
		}
		if l, err := r.layout(ino); err == nil && l.frag >= 0 {
			p.liveFrag[oldFragment{r, l.frag}] += n.size
		}
	}
	return nil
}

// effectiveSource is the archive and inode a file's content will be copied
// from, if any.
func (p *packer) effectiveSource(n *node) (*Reader, Inode) {
	switch {
	case n.inBase != 0:
		return p.base.r, n.inBase
	case n.src != nil:
		return n.src.r, n.src.ino
	}
	return nil, 0
}

// markLive records the blocks of base inode ino as in use.
func (b *baseState) markLive(ino Inode) error {
	l, err := b.r.layout(ino)
	if err != nil {
		return err
	}
	for i, w := range l.words {
		if w != 0 {
			b.use(l.offs[i], uint64(w&^dataUncompBit))
		}
	}
	if l.frag >= 0 {
		f, err := b.r.fragAt(uint32(l.frag))
		if err != nil {
			return err
		}
		b.use(f.start, uint64(f.word&^dataUncompBit))
	}
	return nil
}

func (b *baseState) use(off, n uint64) {
	if _, ok := b.live[off]; !ok && off >= b.start && off+n <= b.end {
		b.live[off] = n
		b.prefixLive += n
	}
}

// inPlace points n at the blocks of its content in the shared prefix: no
// byte of it is read, copied or written.
func (d *dataWriter) inPlace(n *node, fd *fileData) error {
	b := d.p.base
	y := n.inBase
	if prior := b.inPlace[y]; prior != nil {
		n.file = prior
		d.p.res.ReusedBytes += prior.reusedBytes
		return nil
	}
	b.inPlace[y] = fd
	in, err := b.r.lookupInode(y)
	if err != nil {
		return err
	}
	l, err := b.r.layout(y)
	if err != nil {
		return err
	}
	if err := b.markLive(y); err != nil {
		return err
	}
	bs := int64(d.p.bs)
	fd.start, fd.started = in.start, true
	fd.words = append([]uint32(nil), l.words...)
	for i, w := range l.words {
		if w == 0 {
			fd.sparse += uint64(min(bs, n.size-int64(i)*bs))
		}
	}
	if l.frag >= 0 && d.p.extend != nil {
		// An extending pack keeps the base's fragment table entries.
		fd.frag, fd.fragOff = uint32(l.frag), l.fragOff
	} else if l.frag >= 0 {
		idx, ok := b.fragIndex[l.frag]
		if !ok {
			idx = d.nfrags
			d.nfrags++
			b.fragIndex[l.frag] = idx
			if d.fixedFrags[idx], err = b.r.fragAt(uint32(l.frag)); err != nil {
				return err
			}
		}
		fd.frag, fd.fragOff = idx, l.fragOff
	}
	fd.reusedBytes = n.size
	d.p.res.ReusedBytes += fd.reusedBytes
	s := b.r.fileSumOf(y)
	if !s.known() && n.src != nil {
		s = n.src.r.fileSumOf(n.src.ino)
	}
	if !s.known() {
		// A base without sums: learn this file's from its content once,
		// so the new archive records it.
		if s, err = b.r.contentSum(d.ctx, y, d.p.bs); err != nil {
			return fmt.Errorf("sum %s in the base: %w", n.path, err)
		}
	}
	fd.sum, fd.sumSet = s, true
	d.remember(fd, s)
	return nil
}

// copyPrefix writes the base's data region into the new archive, checking
// every block against the base's checksums on the way, and records it as
// copied. out must stand at the region's start.
func (b *baseState) copyPrefix(ctx context.Context, out *output) error {
	if out.pos != b.start {
		return fmt.Errorf("internal error: prefix starts at %d, output at %d", b.start, out.pos)
	}
	r := b.r
	type blk struct {
		off uint64
		bi  blockInfo
	}
	var batch []blk
	var n uint64
	copyBatch := func() error {
		if len(batch) == 0 {
			return nil
		}
		if err := ctx.Err(); err != nil {
			return err
		}
		chunk, err := r.readAt(batch[0].off, n, "data region")
		if err != nil {
			return fmt.Errorf("read base at %d: %w", batch[0].off, err)
		}
		for _, x := range batch {
			b := chunk[x.off-batch[0].off : x.off-batch[0].off+uint64(x.bi.length)]
			if crc32c(b) != x.bi.crc {
				return r.corrupt(x.off, x.bi.kind.String(), errChecksum)
			}
			out.appendExtent(b, x.bi.kind, x.bi.crc, x.bi.sum)
		}
		batch, n = batch[:0], 0
		return out.err
	}
	// Whole blocks, about 4 MiB at a time.
	err := r.eachRecord(b.start, b.end, func(off uint64, bi blockInfo, _ *trPage, _ int) error {
		if n+uint64(bi.length) > 4<<20 {
			if err := copyBatch(); err != nil {
				return err
			}
		}
		batch = append(batch, blk{off, bi})
		n += uint64(bi.length)
		return nil
	})
	if err == nil {
		err = copyBatch()
	}
	if err != nil {
		return err
	}
	// The compressor options before the region are the same bytes too.
	out.copied(superblockSize, superblockSize, b.end-superblockSize)
	return out.err
}

// contentSum computes the content sum of regular inode ino by reading it,
// for archives that record none; results are kept.
func (r *Reader) contentSum(ctx context.Context, ino Inode, bs int) (sum, error) {
	if v, ok := r.sums.Load(ino); ok {
		return v.(sum), nil
	}
	if bs != r.bs {
		return sum{}, nil
	}
	l, err := r.layout(ino)
	if err != nil {
		return sum{}, err
	}
	var chunks []sum
	buf := make([]byte, bs)
	for off := int64(0); off < l.size; off += int64(bs) {
		if err := ctx.Err(); err != nil {
			return sum{}, err
		}
		k := min(int64(bs), l.size-off)
		if _, err := r.readLayout(l, buf[:k], off); err != nil && err != io.EOF {
			return sum{}, err
		}
		chunks = append(chunks, chunkSum(buf[:k]))
	}
	s := fileSum(l.size, chunks)
	r.sums.Store(ino, s)
	return s, nil
}
