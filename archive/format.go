package archive

import (
	"encoding/binary"
	"fmt"
	iofs "io/fs"
)

// On-disk constants of squashfs 4.0. All integers are little-endian.
const (
	sqMagic        = 0x73717368 // "hsqs"
	superblockSize = 96
	metaBlockSize  = 8192 // uncompressed size of a metadata block
	metaUncompBit  = 0x8000
	dataUncompBit  = 1 << 24
	maxBlockSize   = 1 << 20
	minBlockSize   = 4 << 10
	maxNameLen     = 256
	maxSymlinkLen  = 4096 // the kernel refuses longer targets
	noFragment     = 0xFFFFFFFF
	noXattr        = 0xFFFFFFFF
	noTable        = 0xFFFFFFFFFFFFFFFF
	dirMaxRun      = 256 // entries under one directory header
	padAlign       = 4096

	fragEntrySize = 16
	fragsPerBlock = metaBlockSize / fragEntrySize
	idsPerBlock   = metaBlockSize / 4
	refsPerBlock  = metaBlockSize / 8
)

// Superblock flags.
const (
	flagUncompInodes = 0x0001
	flagUncompData   = 0x0002
	flagUncompFrags  = 0x0008
	flagNoFragments  = 0x0010
	flagDuplicates   = 0x0040
	flagExportable   = 0x0080
	flagUncompXattrs = 0x0100
	flagNoXattrs     = 0x0200
	flagCompOpts     = 0x0400
	flagUncompIDs    = 0x0800
)

// Compressor ids in the superblock.
const (
	compGzip = 1
	compLzma = 2
	compLzo  = 3
	compXz   = 4
	compLz4  = 5
	compZstd = 6
)

// Inode types. The basic types 1..7 also appear in directory entries.
const (
	typeDir      = 1
	typeFile     = 2
	typeSymlink  = 3
	typeBlockDev = 4
	typeCharDev  = 5
	typeFifo     = 6
	typeSocket   = 7
	typeLDir     = 8
	typeLFile    = 9
	typeLSymlink = 10
	typeLBlock   = 11
	typeLChar    = 12
	typeLFifo    = 13
	typeLSocket  = 14
)

// basicType maps extended inode types onto the basic type stored in
// directory entries.
func basicType(t uint16) uint16 {
	if t >= typeLDir && t <= typeLSocket {
		return t - 7
	}
	return t
}

// superblock is the fixed 96-byte header at offset 0.
type superblock struct {
	Inodes        uint32
	MkfsTime      uint32
	BlockSize     uint32
	Fragments     uint32
	Compression   uint16
	BlockLog      uint16
	Flags         uint16
	IDs           uint16
	Major, Minor  uint16
	RootInode     uint64
	BytesUsed     uint64
	IDTable       uint64
	XattrTable    uint64
	InodeTable    uint64
	DirTable      uint64
	FragmentTable uint64
	ExportTable   uint64
}

func (s *superblock) marshal() []byte {
	b := make([]byte, superblockSize)
	le := binary.LittleEndian
	le.PutUint32(b[0:], sqMagic)
	le.PutUint32(b[4:], s.Inodes)
	le.PutUint32(b[8:], s.MkfsTime)
	le.PutUint32(b[12:], s.BlockSize)
	le.PutUint32(b[16:], s.Fragments)
	le.PutUint16(b[20:], s.Compression)
	le.PutUint16(b[22:], s.BlockLog)
	le.PutUint16(b[24:], s.Flags)
	le.PutUint16(b[26:], s.IDs)
	le.PutUint16(b[28:], s.Major)
	le.PutUint16(b[30:], s.Minor)
	le.PutUint64(b[32:], s.RootInode)
	le.PutUint64(b[40:], s.BytesUsed)
	le.PutUint64(b[48:], s.IDTable)
	le.PutUint64(b[56:], s.XattrTable)
	le.PutUint64(b[64:], s.InodeTable)
	le.PutUint64(b[72:], s.DirTable)
	le.PutUint64(b[80:], s.FragmentTable)
	le.PutUint64(b[88:], s.ExportTable)
	return b
}

func (s *superblock) unmarshal(b []byte) error {
	if len(b) < superblockSize {
		return fmt.Errorf("superblock: short read")
	}
	le := binary.LittleEndian
	if m := le.Uint32(b[0:]); m != sqMagic {
		return fmt.Errorf("not a squashfs image (magic %#08x)", m)
	}
	s.Inodes = le.Uint32(b[4:])
	s.MkfsTime = le.Uint32(b[8:])
	s.BlockSize = le.Uint32(b[12:])
	s.Fragments = le.Uint32(b[16:])
	s.Compression = le.Uint16(b[20:])
	s.BlockLog = le.Uint16(b[22:])
	s.Flags = le.Uint16(b[24:])
	s.IDs = le.Uint16(b[26:])
	s.Major = le.Uint16(b[28:])
	s.Minor = le.Uint16(b[30:])
	s.RootInode = le.Uint64(b[32:])
	s.BytesUsed = le.Uint64(b[40:])
	s.IDTable = le.Uint64(b[48:])
	s.XattrTable = le.Uint64(b[56:])
	s.InodeTable = le.Uint64(b[64:])
	s.DirTable = le.Uint64(b[72:])
	s.FragmentTable = le.Uint64(b[80:])
	s.ExportTable = le.Uint64(b[88:])
	return nil
}

// inodeRef packs the position of an inode: the start of its metadata block
// relative to the inode table, and its offset in the uncompressed block.
func inodeRef(block uint64, offset uint16) uint64 { return block<<16 | uint64(offset) }

func refBlock(ref uint64) uint64  { return ref >> 16 }
func refOffset(ref uint64) uint16 { return uint16(ref) }

// encodeDev converts a Linux dev_t (glibc encoding, as in Stat_t.Rdev) to the
// 32-bit form squashfs stores (the kernel's new_encode_dev).
func encodeDev(rdev uint64) uint32 {
	major := uint32((rdev>>8)&0xfff) | uint32((rdev>>32)&^0xfff)
	minor := uint32(rdev&0xff) | uint32((rdev>>12)&^0xff)
	return minor&0xff | major<<8 | (minor&^0xff)<<12
}

// decodeDev is the inverse of encodeDev.
func decodeDev(d uint32) uint64 {
	major := uint64((d & 0xfff00) >> 8)
	minor := uint64(d&0xff) | uint64((d>>12)&0xfff00)
	return (major&0xfff)<<8 | (major&^0xfff)<<32 | minor&0xff | (minor&^0xff)<<12
}

// squashMode converts Go permission bits (incl. setuid/setgid/sticky) to the
// 12 low bits squashfs stores; the type lives in the inode type.
func squashMode(m iofs.FileMode) uint16 {
	v := uint16(m.Perm())
	if m&iofs.ModeSetuid != 0 {
		v |= 0o4000
	}
	if m&iofs.ModeSetgid != 0 {
		v |= 0o2000
	}
	if m&iofs.ModeSticky != 0 {
		v |= 0o1000
	}
	return v
}

// goMode is the inverse of squashMode plus the type of basic inode type t.
func goMode(perm uint16, t uint16) iofs.FileMode {
	m := iofs.FileMode(perm & 0o777)
	if perm&0o4000 != 0 {
		m |= iofs.ModeSetuid
	}
	if perm&0o2000 != 0 {
		m |= iofs.ModeSetgid
	}
	if perm&0o1000 != 0 {
		m |= iofs.ModeSticky
	}
	return m | typeMode(t)
}

func typeMode(t uint16) iofs.FileMode {
	switch basicType(t) {
	case typeDir:
		return iofs.ModeDir
	case typeSymlink:
		return iofs.ModeSymlink
	case typeBlockDev:
		return iofs.ModeDevice
	case typeCharDev:
		return iofs.ModeDevice | iofs.ModeCharDevice
	case typeFifo:
		return iofs.ModeNamedPipe
	case typeSocket:
		return iofs.ModeSocket
	}
	return 0
}

// inodeTypeOf gives the basic squashfs type of a Go mode, 0 if unsupported.
func inodeTypeOf(m iofs.FileMode) uint16 {
	switch m.Type() {
	case 0:
		return typeFile
	case iofs.ModeDir:
		return typeDir
	case iofs.ModeSymlink:
		return typeSymlink
	case iofs.ModeDevice:
		return typeBlockDev
	case iofs.ModeDevice | iofs.ModeCharDevice:
		return typeCharDev
	case iofs.ModeNamedPipe:
		return typeFifo
	case iofs.ModeSocket:
		return typeSocket
	}
	return 0
}

// validName reports whether name can be a directory entry: what squashfs
// can hold and what cannot escape or alias a directory when extracted.
func validName(name string) bool {
	if name == "" || name == "." || name == ".." || len(name) > maxNameLen {
		return false
	}
	for i := 0; i < len(name); i++ {
		if name[i] == '/' || name[i] == 0 {
			return false
		}
	}
	return true
}
