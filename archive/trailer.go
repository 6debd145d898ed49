package archive

import (
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"
	"sort"
)

// The integrity trailer, version 1: what Pack wrote before version 2
// (trailer2.go), still read. It follows the squashfs image after its 4 KiB
// padding, where standard readers never look (they stop at the
// superblock's bytes_used). Layout:
//
//	trailer:  "HFSTRAIL" | version u32 | section count u32 | sections...
//	section:  tag u32 | reserved u32 | length u64 | payload
//	footer:   "HFSFOOT1" | version u32 | flags u32 | trailer offset u64 |
//	          trailer length u64 | image bytes u64 | trailer crc u32 |
//	          footer crc u32                              (48 bytes, at EOF)
//
// Sections:
//
//	extents: count u64, then per extent: length|kind<<24 u32, crc u32.
//	    The extents tile the image from offset 0 to bytes_used in order:
//	    superblock, compressor options, every data and fragment block,
//	    every metadata block and every table index array. A reader looks
//	    a block up by its offset and checks length and CRC-32C before
//	    using the bytes.
//	mtime-ns: count u32, then the nanoseconds of each inode's mtime
//	    (inode n at index n-1); squashfs itself stores whole seconds.
//	block-sums: count u64, then a 32-byte content sum (sums.go) for each
//	    data block extent, in extent order; zeros where unknown.
//	file-sums: count u32, then the 32-byte content sum of each inode
//	    (inode n at index n-1); zeros for other types and where unknown.
//
// Unknown sections are skipped, so later versions can add some.
const (
	trailerMagic  = "HFSTRAIL"
	footerMagic   = "HFSFOOT1"
	footerSize    = 48
	formatVersion = 1

	sectionExtents   = 1
	sectionMtimeNs   = 2
	sectionBlockSums = 3
	sectionFileSums  = 4

	maxExtentLen = 1<<24 - 1
)

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

func crc32c(b []byte) uint32 { return crc32.Checksum(b, castagnoli) }

// extentKind says what an extent holds, for error messages and Verify.
type extentKind uint8

const (
	kindSuperblock extentKind = iota + 1
	kindCompOpts
	kindData
	kindFragment
	kindInodeTable
	kindDirTable
	kindFragTable
	kindExportTable
	kindIDTable
	kindIndex
	kindXattr // mksquashfs images only; never written by us
)

func (k extentKind) String() string {
	switch k {
	case kindSuperblock:
		return "superblock"
	case kindCompOpts:
		return "compressor options"
	case kindData:
		return "data block"
	case kindFragment:
		return "fragment block"
	case kindInodeTable:
		return "inode table block"
	case kindDirTable:
		return "directory table block"
	case kindFragTable:
		return "fragment table block"
	case kindExportTable:
		return "export table block"
	case kindIDTable:
		return "id table block"
	case kindIndex:
		return "table index"
	case kindXattr:
		return "xattr table"
	}
	return "block"
}

type extent struct {
	length uint32
	kind   extentKind
	crc    uint32
}

// extents is the decoded extents section: offsets are implied by the
// lengths, so they are rebuilt once at Open for binary search.
type extents struct {
	off  []uint64 // start of extent i; off[len] is the image end
	len  []uint32
	kind []extentKind
	crc  []uint32
}

// find returns the index of the extent starting exactly at off, or -1.
func (e *extents) find(off uint64) int {
	n := len(e.len)
	i := sort.Search(n, func(i int) bool { return e.off[i] >= off })
	if i < n && e.off[i] == off {
		return i
	}
	return -1
}

type trailer struct {
	ext     extents
	mtimeNs []uint32
	offset  int64 // where the trailer starts in the file

	// Content sums, nil when the archive has none: blockSums is parallel
	// to the extents (zero for other kinds), fileSums indexed by inode-1.
	blockSums []sum
	fileSums  []sum
}

// trailerSums are the content sums a pack records.
type trailerSums struct {
	blocks []sum // per data extent, in order
	files  []sum // per inode
}

func appendSection(b []byte, tag uint32, payload []byte) []byte {
	b = binary.LittleEndian.AppendUint32(b, tag)
	b = binary.LittleEndian.AppendUint32(b, 0)
	b = binary.LittleEndian.AppendUint64(b, uint64(len(payload)))
	return append(b, payload...)
}

// marshalTrailer encodes the trailer and footer for an image of imageBytes
// bytes whose padded end (where the trailer starts) is at offset.
func marshalTrailer(ex []extent, mtimeNs []uint32, sums *trailerSums, offset, imageBytes uint64) []byte {
	le := binary.LittleEndian
	var b []byte
	b = append(b, trailerMagic...)
	b = le.AppendUint32(b, formatVersion)
	nsec := uint32(1)
	if mtimeNs != nil {
		nsec++
	}
	if sums != nil {
		nsec += 2
	}
	b = le.AppendUint32(b, nsec)

	p := make([]byte, 0, 8+8*len(ex))
	p = le.AppendUint64(p, uint64(len(ex)))
	for _, e := range ex {
		p = le.AppendUint32(p, e.length|uint32(e.kind)<<24)
		p = le.AppendUint32(p, e.crc)
	}
	b = appendSection(b, sectionExtents, p)
	if mtimeNs != nil {
		p = make([]byte, 0, 4+4*len(mtimeNs))
		p = le.AppendUint32(p, uint32(len(mtimeNs)))
		for _, ns := range mtimeNs {
			p = le.AppendUint32(p, ns)
		}
		b = appendSection(b, sectionMtimeNs, p)
	}
	if sums != nil {
		p = make([]byte, 0, 8+32*len(sums.blocks))
		p = le.AppendUint64(p, uint64(len(sums.blocks)))
		for _, s := range sums.blocks {
			p = append(p, s[:]...)
		}
		b = appendSection(b, sectionBlockSums, p)
		p = make([]byte, 0, 4+32*len(sums.files))
		p = le.AppendUint32(p, uint32(len(sums.files)))
		for _, s := range sums.files {
			p = append(p, s[:]...)
		}
		b = appendSection(b, sectionFileSums, p)
	}

	tlen := uint64(len(b))
	tcrc := crc32c(b)
	f := make([]byte, 0, footerSize)
	f = append(f, footerMagic...)
	f = le.AppendUint32(f, formatVersion)
	f = le.AppendUint32(f, 0)
	f = le.AppendUint64(f, offset)
	f = le.AppendUint64(f, tlen)
	f = le.AppendUint64(f, imageBytes)
	f = le.AppendUint32(f, tcrc)
	f = le.AppendUint32(f, crc32c(f))
	return append(b, f...)
}

type footer struct {
	trailerOff, trailerLen, imageBytes uint64
	trailerCRC                         uint32
}

var errNoFooter = errors.New("no integrity footer")

// footerVersion checks the footer's magic and checksum and returns its
// version: 1 or 2 (trailer2.go). errNoFooter when the magic is absent (an
// image from another tool).
func footerVersion(b []byte) (uint32, error) {
	le := binary.LittleEndian
	if len(b) != footerSize || string(b[:8]) != footerMagic {
		return 0, errNoFooter
	}
	if crc32c(b[:44]) != le.Uint32(b[44:]) {
		return 0, errors.New("footer checksum mismatch")
	}
	switch v := le.Uint32(b[8:]); v {
	case formatVersion, formatVersion2:
		return v, nil
	default:
		return 0, fmt.Errorf("unsupported trailer version %d", v)
	}
}

// parseFooter decodes the last footerSize bytes of a file. It returns
// errNoFooter when the magic is absent (an image from another tool).
func parseFooter(b []byte, fileSize int64) (footer, error) {
	le := binary.LittleEndian
	var f footer
	if len(b) != footerSize || string(b[:8]) != footerMagic {
		return f, errNoFooter
	}
	if crc32c(b[:44]) != le.Uint32(b[44:]) {
		return f, errors.New("footer checksum mismatch")
	}
	if v := le.Uint32(b[8:]); v != formatVersion {
		return f, fmt.Errorf("unsupported trailer version %d", v)
	}
	f.trailerOff = le.Uint64(b[16:])
	f.trailerLen = le.Uint64(b[24:])
	f.imageBytes = le.Uint64(b[32:])
	f.trailerCRC = le.Uint32(b[40:])
	if f.trailerOff > uint64(fileSize) || f.trailerLen > uint64(fileSize) ||
		f.trailerOff+f.trailerLen+footerSize != uint64(fileSize) || f.imageBytes > f.trailerOff {
		return f, errors.New("footer offsets do not match the file size")
	}
	return f, nil
}

// parseTrailer decodes and checks the trailer body. imageBytes bounds the
// extents, which must tile [0, imageBytes) exactly.
func parseTrailer(b []byte, f footer) (*trailer, error) {
	le := binary.LittleEndian
	if crc32c(b) != f.trailerCRC {
		return nil, errChecksum
	}
	if len(b) < 16 || string(b[:8]) != trailerMagic {
		return nil, errors.New("bad trailer magic")
	}
	if v := le.Uint32(b[8:]); v != formatVersion {
		return nil, fmt.Errorf("unsupported trailer version %d", v)
	}
	nsec := le.Uint32(b[12:])
	b = b[16:]
	t := &trailer{offset: int64(f.trailerOff)}
	haveExtents := false
	var blockSums []sum
	for range nsec {
		if len(b) < 16 {
			return nil, errors.New("truncated trailer section")
		}
		tag := le.Uint32(b)
		n := le.Uint64(b[8:])
		b = b[16:]
		if n > uint64(len(b)) {
			return nil, errors.New("trailer section overruns the trailer")
		}
		p := b[:n]
		b = b[n:]
		switch tag {
		case sectionExtents:
			if len(p) < 8 {
				return nil, errors.New("short extents section")
			}
			cnt := le.Uint64(p)
			p = p[8:]
			if cnt != uint64(len(p))/8 || uint64(len(p))%8 != 0 {
				return nil, errors.New("extent count does not match the section length")
			}
			ex := extents{
				off:  make([]uint64, cnt+1),
				len:  make([]uint32, cnt),
				kind: make([]extentKind, cnt),
				crc:  make([]uint32, cnt),
			}
			var pos uint64
			for i := range cnt {
				lk := le.Uint32(p[8*i:])
				ex.off[i] = pos
				ex.len[i] = lk & maxExtentLen
				ex.kind[i] = extentKind(lk >> 24)
				ex.crc[i] = le.Uint32(p[8*i+4:])
				if ex.len[i] == 0 {
					return nil, errors.New("empty extent")
				}
				pos += uint64(ex.len[i])
			}
			ex.off[cnt] = pos
			if pos != f.imageBytes {
				return nil, fmt.Errorf("extents cover %d bytes, image has %d", pos, f.imageBytes)
			}
			t.ext = ex
			haveExtents = true
		case sectionMtimeNs:
			if len(p) < 4 {
				return nil, errors.New("short mtime section")
			}
			cnt := le.Uint32(p)
			p = p[4:]
			if uint64(cnt)*4 != uint64(len(p)) {
				return nil, errors.New("mtime count does not match the section length")
			}
			t.mtimeNs = make([]uint32, cnt)
			for i := range t.mtimeNs {
				t.mtimeNs[i] = le.Uint32(p[4*i:]) % 1e9
			}
		case sectionBlockSums:
			if len(p) < 8 {
				return nil, errors.New("short block sums section")
			}
			cnt := le.Uint64(p)
			p = p[8:]
			if cnt != uint64(len(p))/32 || uint64(len(p))%32 != 0 {
				return nil, errors.New("block sum count does not match the section length")
			}
			blockSums = make([]sum, cnt)
			for i := range blockSums {
				copy(blockSums[i][:], p[32*i:])
			}
		case sectionFileSums:
			if len(p) < 4 {
				return nil, errors.New("short file sums section")
			}
			cnt := le.Uint32(p)
			p = p[4:]
			if uint64(cnt)*32 != uint64(len(p)) {
				return nil, errors.New("file sum count does not match the section length")
			}
			t.fileSums = make([]sum, cnt)
			for i := range t.fileSums {
				copy(t.fileSums[i][:], p[32*i:])
			}
		}
	}
	if !haveExtents {
		return nil, errors.New("trailer has no extents section")
	}
	if blockSums != nil {
		// Spread over the extents, so a block's sum is found by its offset.
		t.blockSums = make([]sum, len(t.ext.len))
		k := 0
		for i, kind := range t.ext.kind {
			if kind != kindData {
				continue
			}
			if k == len(blockSums) {
				return nil, errors.New("fewer block sums than data blocks")
			}
			t.blockSums[i] = blockSums[k]
			k++
		}
		if k != len(blockSums) {
			return nil, errors.New("more block sums than data blocks")
		}
	}
	return t, nil
}
