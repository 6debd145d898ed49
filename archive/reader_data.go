package archive

import (
	"encoding/binary"
	"fmt"
	"io"
	"syscall"
)

// fileLayout is where a regular file's blocks are: decoded from its inode
// once and kept, since a FUSE read needs it on every call.
type fileLayout struct {
	size    int64
	offs    []uint64 // disk offset of each block
	words   []uint32 // size word of each block; 0 = hole
	frag    int      // fragment index, -1 if none
	fragOff uint32
}

func (r *Reader) layout(ino Inode) (*fileLayout, error) {
	v, err := r.meta.get(metaKey{k: mkLayout, a: uint64(ino)}, func() (any, int64, error) {
		in, err := r.lookupBare(ino)
		if err != nil {
			return nil, 0, err
		}
		if basicType(in.typ) != typeFile {
			if basicType(in.typ) == typeDir {
				return nil, 0, fmt.Errorf("archive %s: read inode %d: %w", r.name, ino, syscall.EISDIR)
			}
			return nil, 0, fmt.Errorf("archive %s: read inode %d: %w", r.name, ino, syscall.EINVAL)
		}
		l, err := r.decodeLayout(in)
		if err != nil {
			return nil, 0, err
		}
		return l, l.cost(), nil
	})
	if err != nil {
		return nil, err
	}
	return v.(*fileLayout), nil
}

func (l *fileLayout) cost() int64 { return int64(12*len(l.offs)) + 96 }

func (r *Reader) decodeLayout(in *inode) (*fileLayout, error) {
	bs := uint64(r.bs)
	where := r.sb.InodeTable
	bad := func(format string, a ...any) (*fileLayout, error) {
		return nil, r.corruptf(where, "inode table block", "inode %d: "+format, append([]any{in.ino}, a...)...)
	}
	l := &fileLayout{size: int64(in.size), frag: -1, fragOff: in.fragOff}
	nblocks := (in.size + bs - 1) / bs
	if in.frag != noFragment {
		if in.frag >= r.sb.Fragments {
			return bad("fragment %d of %d", in.frag, r.sb.Fragments)
		}
		tail := in.size % bs
		if in.size > 0 && tail == 0 {
			tail = bs // a whole last block in a fragment (unusual but valid)
		}
		if uint64(in.fragOff)+tail > bs {
			return bad("fragment tail at %d+%d beyond the block", in.fragOff, tail)
		}
		nblocks = (in.size - tail) / bs
		l.frag = int(in.frag)
	}
	if nblocks > maxObject/4 {
		return bad("block list of %d blocks", nblocks)
	}
	c := r.resume(kindInodeTable, r.sb.InodeTable, r.sb.DirTable, in.blocks)
	// Read a piece at a time: a hostile size must meet the table's end
	// before it allocates much.
	l.offs = make([]uint64, 0, min(nblocks, 4096))
	l.words = make([]uint32, 0, min(nblocks, 4096))
	off := in.start
	var buf []byte
	for i := range nblocks {
		if i%1024 == 0 {
			var err error
			if buf, err = c.read(buf[:0], int(4*min(1024, nblocks-i))); err != nil {
				return nil, err
			}
		}
		w := binary.LittleEndian.Uint32(buf[4*(i%1024):])
		n := uint64(w &^ dataUncompBit)
		if n > bs || w&^(dataUncompBit|(dataUncompBit-1)) != 0 {
			return bad("block %d has size word %#x", i, w)
		}
		if off > r.sb.BytesUsed || n > r.sb.BytesUsed-off {
			return bad("block %d at %d+%d beyond the image", i, off, n)
		}
		if n == 0 {
			w = 0
		}
		l.offs = append(l.offs, off)
		l.words = append(l.words, w)
		off += n
	}
	return l, nil
}

// block returns the decompressed content of the block with size word w at
// off, which must decompress to exactly want bytes (or at least want, for
// fragments). The result is shared: callers must not modify it.
func (r *Reader) block(off uint64, w uint32, want int, kind extentKind, exact bool) ([]byte, error) {
	b, err := r.cache.get(cacheKey{off, w}, func() ([]byte, int64, error) {
		b, err := r.loadBlock(off, w, kind)
		return b, int64(cap(b)), err
	})
	if err != nil {
		return nil, err
	}
	// Checked on every use: a hostile image may point two inodes at one
	// block with different expectations.
	if len(b) < want || (exact && len(b) != want) {
		return nil, r.corruptf(off, kind.String(), "decompressed to %d bytes, want %d", len(b), want)
	}
	return b, nil
}

// loadBlock reads, checks and decompresses one data or fragment block.
func (r *Reader) loadBlock(off uint64, w uint32, kind extentKind) ([]byte, error) {
	_, b, err := r.loadBlockInto(nil, nil, off, w, kind)
	return b, err
}

// blockContent returns the content of a data or fragment block whose
// stored bytes are raw and size word w: raw itself when it is stored
// uncompressed, else raw decompressed into dst.
func (r *Reader) blockContent(dst, raw []byte, w uint32) ([]byte, error) {
	if w&dataUncompBit != 0 {
		return raw, nil
	}
	return r.dec.decompress(dst, raw, r.bs)
}

// fragment returns fragment block i, decompressed.
func (r *Reader) fragment(i int, need int) ([]byte, error) {
	f, err := r.fragAt(uint32(i))
	if err != nil {
		return nil, err
	}
	return r.block(f.start, f.word, need, kindFragment, false)
}

// ReadAt reads len(p) bytes of regular file ino at off, with io.ReaderAt
// semantics: fewer bytes only at the end of the file, with io.EOF. It is
// safe for concurrent use. Every block is checked against the archive's
// checksums before any byte of it is returned; damage gives an error
// matching ErrCorrupt.
func (r *Reader) ReadAt(ino Inode, p []byte, off int64) (int, error) {
	l, err := r.layout(ino)
	if err != nil {
		return 0, err
	}
	return r.readLayout(l, p, off)
}

func (r *Reader) readLayout(l *fileLayout, p []byte, off int64) (int, error) {
	if off < 0 {
		return 0, fmt.Errorf("archive %s: read at negative offset %d", r.name, off)
	}
	bs := int64(r.bs)
	n := 0
	for n < len(p) && off < l.size {
		bi := off / bs
		within := int(off % bs)
		blen := int(min(bs, l.size-bi*bs)) // bytes of this block in the file
		var c int
		switch {
		case bi < int64(len(l.words)) && l.words[bi] == 0:
			c = min(len(p)-n, blen-within)
			clear(p[n : n+c])
		case bi < int64(len(l.words)):
			b, err := r.block(l.offs[bi], l.words[bi], blen, kindData, true)
			if err != nil {
				return n, err
			}
			c = copy(p[n:], b[within:])
		default:
			b, err := r.fragment(l.frag, int(l.fragOff)+blen)
			if err != nil {
				return n, err
			}
			c = copy(p[n:], b[int(l.fragOff)+within:int(l.fragOff)+blen])
		}
		if c == 0 { // unreachable: block checks sizes; never loop on a bad image
			return n, r.corruptf(uint64(off), "file layout", "no progress reading at file offset %d", off)
		}
		n += c
		off += int64(c)
	}
	if n < len(p) {
		return n, io.EOF
	}
	return n, nil
}
