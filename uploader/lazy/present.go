package lazy

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"hash/crc32"
	"io"
	"os"
)

// The present log: a header line naming the object, then one 8-byte record
// per chunk whose bytes are in the partial file (index u32, CRC-32C of the
// index u32, little endian). A torn or damaged record ends the log: it and
// what follows are dropped at load.

const presentMagic = "hermesfs-present 1"

var presentCRC = crc32.MakeTable(crc32.Castagnoli)

// presentHeader names the object a log belongs to: a log of another object
// (another snapshot, another chunk size) is discarded.
func presentHeader(sha string, size, chunkSize int64) []byte {
	return fmt.Appendf(nil, "%s %s %d %d\n", presentMagic, sha, size, chunkSize)
}

func presentRecord(i int) []byte {
	var b [8]byte
	binary.LittleEndian.PutUint32(b[0:], uint32(i))
	binary.LittleEndian.PutUint32(b[4:], crc32.Checksum(b[0:4], presentCRC))
	return b[:]
}

// loadPresent reads the log f (opened read-write) and returns the chunks it
// marks present. A log for another object is reset to an empty one for
// this object; a torn tail is cut off. f is left positioned at its end.
func loadPresent(f *os.File, sha string, size, chunkSize int64, n int) (present []bool, reset bool, err error) {
	hdr := presentHeader(sha, size, chunkSize)
	b, err := io.ReadAll(io.NewSectionReader(f, 0, 1<<40))
	if err != nil {
		return nil, false, err
	}
	present = make([]bool, n)
	if !bytes.HasPrefix(b, hdr) {
		if err := f.Truncate(0); err != nil {
			return nil, false, err
		}
		if _, err := f.WriteAt(hdr, 0); err != nil {
			return nil, false, err
		}
		if err := f.Sync(); err != nil {
			return nil, false, err
		}
		_, err := f.Seek(int64(len(hdr)), io.SeekStart)
		return present, true, err
	}
	end := len(hdr)
	for rec := b[len(hdr):]; len(rec) >= 8; rec = rec[8:] {
		i := binary.LittleEndian.Uint32(rec[0:])
		if binary.LittleEndian.Uint32(rec[4:]) != crc32.Checksum(rec[0:4], presentCRC) || int(i) >= n {
			break
		}
		present[i] = true
		end += 8
	}
	if end != len(b) {
		if err := f.Truncate(int64(end)); err != nil {
			return nil, false, err
		}
	}
	_, err = f.Seek(int64(end), io.SeekStart)
	return present, false, err
}
