package archive

import (
	"container/list"
	"encoding/binary"
	"fmt"
	"io"
	"sync"
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
	if v, ok := r.layouts.Load(ino); ok {
		return v.(*fileLayout), nil
	}
	in, err := r.lookupInode(ino)
	if err != nil {
		return nil, err
	}
	if basicType(in.typ) != typeFile {
		if basicType(in.typ) == typeDir {
			return nil, fmt.Errorf("archive %s: read inode %d: %w", r.name, ino, syscall.EISDIR)
		}
		return nil, fmt.Errorf("archive %s: read inode %d: %w", r.name, ino, syscall.EINVAL)
	}
	l, err := r.decodeLayout(in)
	if err != nil {
		return nil, err
	}
	v, _ := r.layouts.LoadOrStore(ino, l)
	return v.(*fileLayout), nil
}

func (r *Reader) decodeLayout(in *inode) (*fileLayout, error) {
	bs := uint64(r.bs)
	where := r.sb.InodeTable
	bad := func(format string, a ...any) (*fileLayout, error) {
		return nil, r.corruptf(where, "inode table block", "inode %d: "+format, append([]any{in.ino}, a...)...)
	}
	l := &fileLayout{size: int64(in.size), frag: -1, fragOff: in.fragOff}
	nblocks := (in.size + bs - 1) / bs
	if in.frag != noFragment {
		if int64(in.frag) >= int64(len(r.frags)) {
			return bad("fragment %d of %d", in.frag, len(r.frags))
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
	if in.blocks > uint64(len(r.inodeTab)) || nblocks > (uint64(len(r.inodeTab))-in.blocks)/4 {
		return bad("block list of %d blocks runs past the inode table", nblocks)
	}
	l.offs = make([]uint64, nblocks)
	l.words = make([]uint32, nblocks)
	off := in.start
	for i := range nblocks {
		w := binary.LittleEndian.Uint32(r.inodeTab[in.blocks+4*i:])
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
		l.offs[i], l.words[i] = off, w
		off += n
	}
	return l, nil
}

// block returns the decompressed content of the block with size word w at
// off, which must decompress to exactly want bytes (or at least want, for
// fragments). The result is shared: callers must not modify it.
func (r *Reader) block(off uint64, w uint32, want int, kind extentKind, exact bool) ([]byte, error) {
	b, err := r.cache.get(cacheKey{off, w}, func() ([]byte, error) { return r.loadBlock(off, w, kind) })
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
	f := r.frags[i]
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

// blockCache is an LRU of decompressed blocks keyed by disk offset, bounded
// in bytes. Concurrent misses on one block load it once.
type blockCache struct {
	mu       sync.Mutex
	max, cur int64
	lru      list.List // of *cacheEntry, most recent first
	m        map[cacheKey]*list.Element
	inflight map[cacheKey]*cacheLoad
}

// cacheKey names a block by offset and size word: a hostile image could
// describe one offset two ways.
type cacheKey struct {
	off  uint64
	word uint32
}

type cacheEntry struct {
	key cacheKey
	b   []byte
}

type cacheLoad struct {
	done chan struct{}
	b    []byte
	err  error
}

func newBlockCache(max int64) *blockCache {
	return &blockCache{max: max, m: map[cacheKey]*list.Element{}, inflight: map[cacheKey]*cacheLoad{}}
}

func (c *blockCache) get(off cacheKey, load func() ([]byte, error)) ([]byte, error) {
	c.mu.Lock()
	if e, ok := c.m[off]; ok {
		c.lru.MoveToFront(e)
		b := e.Value.(*cacheEntry).b
		c.mu.Unlock()
		return b, nil
	}
	if l, ok := c.inflight[off]; ok {
		c.mu.Unlock()
		<-l.done
		return l.b, l.err
	}
	l := &cacheLoad{done: make(chan struct{})}
	c.inflight[off] = l
	c.mu.Unlock()

	l.b, l.err = load()

	c.mu.Lock()
	delete(c.inflight, off)
	if l.err == nil && int64(len(l.b)) <= c.max {
		c.m[off] = c.lru.PushFront(&cacheEntry{key: off, b: l.b})
		c.cur += int64(cap(l.b))
		for c.cur > c.max {
			e := c.lru.Back()
			ce := e.Value.(*cacheEntry)
			c.lru.Remove(e)
			delete(c.m, ce.key)
			c.cur -= int64(cap(ce.b))
		}
	}
	c.mu.Unlock()
	close(l.done)
	return l.b, l.err
}
