package archive

import (
	"context"
	"fmt"
	"io"
	"runtime"
	"slices"
	"sync"
)

// verifyChunk is how much of the image Verify reads per request.
const verifyChunk = 8 << 20

// Verify reads the whole archive and checks every block: against the
// trailer's checksums when the archive has them (superblock, data and
// fragment blocks, metadata blocks, table indexes, trailer pages,
// padding), and by decompressing every data, fragment and metadata block
// in any case. It walks the whole tree, checking that every entry agrees
// with its inode and the export table and that no directory is reached
// twice. Content sums the trailer records are checked against the
// content: each data block's, then each file's. It returns nil or the
// damage at the lowest offset it found, as an error matching ErrCorrupt
// that names the block's kind and offset. Reads are sequential and large,
// so Verify suits a ranged reader too.
func (r *Reader) Verify(ctx context.Context) error {
	blocks, files, err := r.dataBlocks(ctx)
	if err != nil {
		return err
	}
	if !r.Checksummed() {
		return r.verifyBlocks(ctx, blocks)
	}
	words := make(map[uint64]uint32, len(blocks))
	for _, b := range blocks {
		bi, ok, err := r.blockAt(b.off)
		if err != nil {
			return err
		}
		if !ok || bi.length != b.word&^dataUncompBit {
			return r.corruptf(b.off, b.kind.String(), "no checksum recorded for a block of %d bytes here", b.word&^dataUncompBit)
		}
		words[b.off] = b.word
	}
	// Read whole blocks, about verifyChunk bytes at a time.
	type blk struct {
		off uint64
		bi  blockInfo
	}
	var batch []blk
	var batchLen uint64
	flush := func() error {
		if len(batch) == 0 {
			return nil
		}
		buf, err := r.readAt(batch[0].off, batchLen, batch[0].bi.kind.String())
		if err != nil {
			return err
		}
		errs := make([]error, len(batch))
		var wg sync.WaitGroup
		sem := make(chan struct{}, runtime.GOMAXPROCS(0))
		for k, x := range batch {
			b := buf[x.off-batch[0].off : x.off-batch[0].off+uint64(x.bi.length)]
			what := x.bi.kind.String()
			if crc32c(b) != x.bi.crc {
				errs[k] = r.corrupt(x.off, what, errChecksum)
				continue
			}
			sem <- struct{}{}
			wg.Go(func() {
				defer func() { <-sem }()
				errs[k] = r.verifyContent(x.off, b, x.bi, words)
			})
		}
		wg.Wait()
		batch, batchLen = batch[:0], 0
		for _, err := range errs {
			if err != nil {
				return err
			}
		}
		return nil
	}
	var next uint64
	err = r.eachRecord(0, r.sb.BytesUsed, func(off uint64, bi blockInfo, _ *trPage, _ int) error {
		if off != next {
			return r.corruptf(next, "integrity trailer", "no block recorded at %d", next)
		}
		next = off + uint64(bi.length)
		if err := ctx.Err(); err != nil {
			return err
		}
		if batchLen+uint64(bi.length) > verifyChunk {
			if err := flush(); err != nil {
				return err
			}
		}
		batch = append(batch, blk{off, bi})
		batchLen += uint64(bi.length)
		return nil
	})
	if err == nil {
		err = flush()
	}
	if err != nil {
		return err
	}
	if next != r.sb.BytesUsed {
		return r.corruptf(next, "integrity trailer", "blocks recorded up to %d, the image ends at %d", next, r.sb.BytesUsed)
	}
	if err := r.verifyFileSums(ctx, files); err != nil {
		return err
	}
	// Padding between the image and the trailer must be zeros.
	end := r.sb.BytesUsed
	if pad := r.trailerStart() - end; pad > 0 {
		b, err := r.readAt(end, pad, "padding")
		if err != nil {
			return err
		}
		for k, c := range b {
			if c != 0 {
				return r.corruptf(end+uint64(k), "padding", "non-zero byte")
			}
		}
	}
	return nil
}

// verifyContent checks what a block holds, its checksum already checked:
// a data or fragment block some file uses must decompress (to the sum the
// trailer records, if any), a metadata block must decode.
func (r *Reader) verifyContent(off uint64, b []byte, bi blockInfo, words map[uint64]uint32) error {
	what := bi.kind.String()
	switch bi.kind {
	case kindInodeTable, kindDirTable, kindFragTable, kindExportTable, kindIDTable, kindCompOpts:
		if len(b) < 3 {
			return r.corruptf(off, what, "metadata block of %d bytes", len(b))
		}
		h := uint16(b[0]) | uint16(b[1])<<8
		if n := int(h &^ metaUncompBit); n != len(b)-2 {
			return r.corruptf(off, what, "metadata block length %d in a block of %d bytes", n, len(b))
		}
		if h&metaUncompBit == 0 {
			if _, err := r.dec.decompress(nil, b[2:], metaBlockSize); err != nil {
				return r.corruptf(off, what, "decompress: %v", err)
			}
		}
		return nil
	}
	w, ok := words[off]
	if !ok || (w&dataUncompBit != 0 && !bi.sum.known()) {
		return nil
	}
	c, err := r.blockContent(nil, b, w)
	if err != nil {
		return r.corruptf(off, what, "decompress: %v", err)
	}
	if bi.sum.known() && chunkSum(c) != bi.sum {
		return r.corruptf(off, what, "content does not match its recorded sum")
	}
	return nil
}

// verifyFileSums checks every recorded file sum against the file's
// content: the (already checked) sums of its blocks, and its fragment
// tail's bytes.
func (r *Reader) verifyFileSums(ctx context.Context, files []*inode) error {
	if !r.hasSums() {
		return nil
	}
	bs := int64(r.bs)
	buf := make([]byte, r.bs)
	for _, in := range files {
		want := in.sum
		if !in.hasSum || !want.known() {
			continue
		}
		if err := ctx.Err(); err != nil {
			return err
		}
		l, err := r.decodeLayout(in)
		if err != nil {
			return err
		}
		var chunks []sum
		for k, w := range l.words {
			blen := min(bs, l.size-int64(k)*bs)
			s := zeroChunkSum(int(blen))
			if w != 0 {
				if s = r.blockSumAt(l.offs[k]); !s.known() {
					if _, err := r.readLayout(l, buf[:blen], int64(k)*bs); err != nil && err != io.EOF {
						return err
					}
					s = chunkSum(buf[:blen])
				}
			}
			chunks = append(chunks, s)
		}
		if l.frag >= 0 {
			off := int64(len(l.words)) * bs
			if _, err := r.readLayout(l, buf[:l.size-off], off); err != nil && err != io.EOF {
				return err
			}
			chunks = append(chunks, chunkSum(buf[:l.size-off]))
		}
		if fileSum(l.size, chunks) != want {
			return r.corruptf(r.sb.InodeTable+refBlock(in.ref), "inode table block", "inode %d: content does not match its recorded sum", in.ino)
		}
	}
	return nil
}

type blockRef struct {
	off  uint64
	word uint32
	kind extentKind
}

// dataBlocks walks the whole tree, checking it, and lists every stored
// data and fragment block, by offset, and every regular file inode.
func (r *Reader) dataBlocks(ctx context.Context) ([]blockRef, []*inode, error) {
	var out []blockRef
	var files []*inode
	seen := map[Inode]bool{}
	err := r.walk(true, func(_ Inode, ents []DirEntry, refs []uint64) error {
		if err := ctx.Err(); err != nil {
			return err
		}
		for i, e := range ents {
			if !e.Mode.IsRegular() || seen[e.Ino] {
				continue
			}
			seen[e.Ino] = true
			in, err := r.inodeAt(refs[i])
			if err != nil {
				return err
			}
			l, err := r.decodeLayout(in)
			if err != nil {
				return err
			}
			for k, w := range l.words {
				if w != 0 {
					out = append(out, blockRef{off: l.offs[k], word: w, kind: kindData})
				}
			}
			files = append(files, in)
		}
		return nil
	})
	if err != nil {
		return nil, nil, err
	}
	for i := range r.sb.Fragments {
		f, err := r.fragAt(i)
		if err != nil {
			return nil, nil, err
		}
		if f.word&^dataUncompBit == 0 {
			return nil, nil, r.corruptf(r.sb.FragmentTable, "fragment table", "empty fragment at %d", f.start)
		}
		out = append(out, blockRef{off: f.start, word: f.word, kind: kindFragment})
	}
	slices.SortFunc(out, func(a, b blockRef) int {
		switch {
		case a.off < b.off:
			return -1
		case a.off > b.off:
			return 1
		}
		return 0
	})
	return slices.CompactFunc(out, func(a, b blockRef) bool { return a.off == b.off }), files, nil
}

// verifyBlocks decompresses every block of an archive without checksums.
func (r *Reader) verifyBlocks(ctx context.Context, blocks []blockRef) error {
	for _, b := range blocks {
		if err := ctx.Err(); err != nil {
			return err
		}
		if _, err := r.loadBlock(b.off, b.word, b.kind); err != nil {
			return fmt.Errorf("%w", err)
		}
	}
	return nil
}
