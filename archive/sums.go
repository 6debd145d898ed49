package archive

import (
	"crypto/sha256"
	"encoding/binary"
	"io"
	"sync"
)

// Content sums identify file content across archives, so a pack can tell,
// without reading a file, that an earlier archive already holds it: a file
// that is unchanged content of one archive, or a copy of a file, is found in
// another archive by its sum and points at the blocks there.
//
// A file is cut into chunks of the block size (the last one short); each
// chunk's sum is the SHA-256 of its bytes, and the file's sum is the SHA-256
// of a domain tag, the size and the chunk sums in order. A data block's sum
// is the sum of the chunk it stores, so a changed file's unchanged blocks
// are found too. Sums depend on the block size: archives with different
// block sizes never share blocks anyway. The zero sum means unknown.
type sum [32]byte

func (s sum) known() bool { return s != sum{} }

const fileSumTag = "hermesfs file sum v1\x00"

func chunkSum(b []byte) sum { return sha256.Sum256(b) }

// fileSum combines the chunk sums of a file of size bytes; it is unknown
// if any chunk sum is.
func fileSum(size int64, chunks []sum) sum {
	h := sha256.New()
	h.Write([]byte(fileSumTag))
	var b [8]byte
	binary.LittleEndian.PutUint64(b[:], uint64(size))
	h.Write(b[:])
	for _, c := range chunks {
		if !c.known() {
			return sum{}
		}
		h.Write(c[:])
	}
	var s sum
	h.Sum(s[:0])
	return s
}

// zeroSums caches the sums of all-zero chunks (holes) by length.
var zeroSums sync.Map // int -> sum

func zeroChunkSum(n int) sum {
	if v, ok := zeroSums.Load(n); ok {
		return v.(sum)
	}
	s := chunkSum(zeroBlock[:n])
	zeroSums.Store(n, s)
	return s
}

// sumStream reads size bytes from r and returns their file sum; n is what
// it read (less than size if r ended early).
func sumStream(r io.Reader, size int64, bs int, buf []byte) (s sum, n int64, err error) {
	var chunks []sum
	for n < size {
		k := int(min(int64(bs), size-n))
		m, err := io.ReadFull(r, buf[:k])
		n += int64(m)
		if err != nil {
			return sum{}, n, err
		}
		chunks = append(chunks, chunkSum(buf[:k]))
	}
	return fileSum(size, chunks), n, nil
}

// blockLoc is a stored data block of an archive.
type blockLoc struct {
	off  uint64
	word uint32
}

// contentIndex is what a pack needs to find content in an archive: file
// and block sums and the reverse maps, built once per Reader.
type contentIndex struct {
	byFile  map[sum]Inode    // a regular inode with that content
	byBlock map[sum]blockLoc // a stored data block with that content
	sizes   map[int64]bool   // sizes of regular files with a known sum
}

// fileSumOf returns the recorded content sum of regular inode ino, or the
// zero sum.
func (r *Reader) fileSumOf(ino Inode) sum {
	if !r.hasSums() {
		return sum{}
	}
	in, err := r.lookupInode(ino)
	if err != nil || !in.hasSum {
		return sum{}
	}
	return in.sum
}

// blockSumAt returns the recorded sum of the data block at off, or the
// zero sum.
func (r *Reader) blockSumAt(off uint64) sum {
	bi, ok, err := r.blockAt(off)
	if err != nil || !ok || bi.kind != kindData {
		return sum{}
	}
	return bi.sum
}

// hasSums reports whether the archive records content sums.
func (r *Reader) hasSums() bool {
	return (r.tr != nil && r.tr.fileSums != nil) || (r.tr2 != nil && r.tr2.root.flags&rootHasSums != 0)
}

// index returns the archive's content index (empty without sums).
func (r *Reader) index() *contentIndex {
	r.indexOnce.Do(func() {
		ix := &contentIndex{byFile: map[sum]Inode{}, byBlock: map[sum]blockLoc{}, sizes: map[int64]bool{}}
		r.idx = ix
		if !r.hasSums() {
			return
		}
		inos, err := r.fileInodes()
		if err != nil {
			return // damage: nothing found by sum, each file packed as it is
		}
		for _, ino := range inos {
			in, err := r.lookupInode(ino)
			if err != nil {
				continue
			}
			if s := in.sum; in.hasSum && s.known() {
				if _, dup := ix.byFile[s]; !dup {
					ix.byFile[s] = ino
				}
				ix.sizes[int64(in.size)] = true
			}
			l, err := r.decodeLayout(in)
			if err != nil {
				continue
			}
			for k, w := range l.words {
				if w == 0 {
					continue
				}
				if s := r.blockSumAt(l.offs[k]); s.known() {
					if _, dup := ix.byBlock[s]; !dup {
						ix.byBlock[s] = blockLoc{off: l.offs[k], word: w}
					}
				}
			}
		}
	})
	return r.idx
}

// crcAt returns the checksum the trailer records for the block of n bytes
// at off, without reading it.
func (r *Reader) crcAt(off uint64, n uint32, what string) (uint32, error) {
	if !r.Checksummed() {
		return 0, r.corruptf(off, what, "no checksums recorded")
	}
	bi, ok, err := r.blockAt(off)
	if err != nil {
		return 0, err
	}
	if !ok {
		return 0, r.corruptf(off, what, "no checksum recorded for a block at this offset")
	}
	if bi.length != n {
		return 0, r.corruptf(off, what, "block is %d bytes, checksum covers %d", n, bi.length)
	}
	return bi.crc, nil
}
