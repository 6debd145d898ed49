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
// fragment blocks, metadata blocks, table indexes, padding), and by
// decompressing every data and fragment block in any case. Content sums
// the trailer records are checked against the content: each data block's,
// then each file's. It returns nil or the damage at the lowest offset, as
// an error matching ErrCorrupt that names the block's kind and offset.
// Reads are sequential and large, so Verify suits a ranged reader too.
func (r *Reader) Verify(ctx context.Context) error {
	blocks, err := r.dataBlocks()
	if err != nil {
		return err
	}
	if r.tr == nil {
		return r.verifyBlocks(ctx, blocks)
	}
	ex := &r.tr.ext
	for _, b := range blocks {
		i := ex.find(b.off)
		if i < 0 || ex.len[i] != b.word&^dataUncompBit {
			return r.corruptf(b.off, b.kind.String(), "no checksum recorded for a block of %d bytes here", b.word&^dataUncompBit)
		}
	}
	words := make(map[uint64]uint32, len(blocks))
	for _, b := range blocks {
		words[b.off] = b.word
	}
	n := len(ex.len)
	for i := 0; i < n; {
		if err := ctx.Err(); err != nil {
			return err
		}
		// Read whole extents, about verifyChunk bytes at a time.
		j := i + 1
		for j < n && ex.off[j+1]-ex.off[i] <= verifyChunk {
			j++
		}
		buf, err := r.readAt(ex.off[i], ex.off[j]-ex.off[i], ex.kind[i].String())
		if err != nil {
			return err
		}
		if err := r.verifyExtents(buf, i, j, words); err != nil {
			return err
		}
		i = j
	}
	if err := r.verifyFileSums(ctx); err != nil {
		return err
	}
	// Padding between the image and the trailer must be zeros.
	end := r.sb.BytesUsed
	if pad := uint64(r.tr.offset) - end; pad > 0 {
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

// verifyExtents checks extents [i, j) held in buf, decompressing data and
// fragment blocks on all cores, and returns the error at the lowest offset.
func (r *Reader) verifyExtents(buf []byte, i, j int, words map[uint64]uint32) error {
	ex := &r.tr.ext
	base := ex.off[i]
	errs := make([]error, j-i)
	var wg sync.WaitGroup
	sem := make(chan struct{}, runtime.GOMAXPROCS(0))
	for k := i; k < j; k++ {
		b := buf[ex.off[k]-base : ex.off[k+1]-base]
		what := ex.kind[k].String()
		if crc32c(b) != ex.crc[k] {
			errs[k-i] = r.corrupt(ex.off[k], what, errChecksum)
			continue
		}
		w, ok := words[ex.off[k]]
		var want sum
		if r.tr.blockSums != nil {
			want = r.tr.blockSums[k]
		}
		if !ok || (w&dataUncompBit != 0 && !want.known()) {
			continue
		}
		sem <- struct{}{}
		wg.Go(func() {
			defer func() { <-sem }()
			c, err := r.blockContent(nil, b, w)
			if err != nil {
				errs[k-i] = r.corruptf(ex.off[k], what, "decompress: %v", err)
				return
			}
			if want.known() && chunkSum(c) != want {
				errs[k-i] = r.corruptf(ex.off[k], what, "content does not match its recorded sum")
			}
		})
	}
	wg.Wait()
	for _, err := range errs {
		if err != nil {
			return err
		}
	}
	return nil
}

// verifyFileSums checks every recorded file sum against the file's
// content: the (already checked) sums of its blocks, and its fragment
// tail's bytes.
func (r *Reader) verifyFileSums(ctx context.Context) error {
	if !r.hasSums() {
		return nil
	}
	bs := int64(r.bs)
	buf := make([]byte, r.bs)
	for _, ino := range r.fileInodes() {
		want := r.fileSumOf(ino)
		if !want.known() {
			continue
		}
		if err := ctx.Err(); err != nil {
			return err
		}
		in, err := r.lookupInode(ino)
		if err != nil {
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
			return r.corruptf(r.sb.InodeTable, "inode table", "inode %d: content does not match its recorded sum", ino)
		}
	}
	return nil
}

type blockRef struct {
	off  uint64
	word uint32
	kind extentKind
}

// dataBlocks lists every stored data and fragment block, by offset.
func (r *Reader) dataBlocks() ([]blockRef, error) {
	var out []blockRef
	for _, ino := range r.fileInodes() {
		l, err := r.layout(ino)
		if err != nil {
			return nil, err
		}
		for k, w := range l.words {
			if w != 0 {
				out = append(out, blockRef{off: l.offs[k], word: w, kind: kindData})
			}
		}
		// Layouts of a full verify are not worth keeping.
		r.layouts.Delete(ino)
	}
	for _, f := range r.frags {
		if f.word&^dataUncompBit == 0 {
			return nil, r.corruptf(r.sb.FragmentTable, "fragment table", "empty fragment at %d", f.start)
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
	return slices.CompactFunc(out, func(a, b blockRef) bool { return a.off == b.off }), nil
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
