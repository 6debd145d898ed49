package fs

import (
	"encoding/binary"
	"fmt"
	"io"
	"os"
	"sync"
	"syscall"

	"golang.org/x/sys/unix"
)

// inoMap remembers which st_ino an upper-layer inode reports when that is not
// the one its own inode number gives: a file copied up from the lower layer
// keeps the lower file's number, and a guarded file replaced by its staged
// content keeps the number it had. It is an append-only log of 32-byte
// records in the upper layer (inoMapName), fsynced before the change that
// needs it becomes visible, so a remount (after a crash too) reports the same
// numbers.
//
// A record is keyed by the upper inode number and its birth time: upper file
// systems reuse inode numbers, and a record whose birth time no longer
// matches belongs to a deleted file and is ignored. So records are never
// removed; the log grows by one record per copy-up.
type inoMap struct {
	mu sync.Mutex
	f  *os.File
	m  map[uint64]inoRec // by upper inode number
}

type inoRec struct {
	btime uint64 // birth time of the upper inode, ns; 0 if the fs has none
	ino   uint64 // the st_ino reported
	gen   uint64 // the FUSE generation reported with it
}

const inoRecSize = 32

func openInoMap(dirfd int) (*inoMap, error) {
	fd, err := unix.Openat(dirfd, inoMapName, unix.O_RDWR|unix.O_CREAT|unix.O_APPEND|unix.O_CLOEXEC|unix.O_NOFOLLOW, 0o600)
	if err != nil {
		return nil, fmt.Errorf("fs: open inode map: %w", err)
	}
	f := os.NewFile(uintptr(fd), inoMapName)
	m, whole, size, err := loadInoMap(f)
	if err != nil {
		f.Close()
		return nil, err
	}
	if whole != size {
		// A record torn by a crash was never acknowledged: drop it.
		if err := f.Truncate(whole); err != nil {
			f.Close()
			return nil, fmt.Errorf("fs: repair inode map: %w", err)
		}
	}
	m.f = f
	return m, nil
}

// readInoMap loads the inode map of a read-only mount: the records as they
// are (none if there is no map), and no file to append to.
func readInoMap(dirfd int) (*inoMap, error) {
	fd, err := unix.Openat(dirfd, inoMapName, unix.O_RDONLY|unix.O_CLOEXEC|unix.O_NOFOLLOW, 0)
	if err == unix.ENOENT {
		return &inoMap{m: map[uint64]inoRec{}}, nil
	}
	if err != nil {
		return nil, fmt.Errorf("fs: open inode map: %w", err)
	}
	f := os.NewFile(uintptr(fd), inoMapName)
	defer f.Close()
	m, _, _, err := loadInoMap(f)
	return m, err
}

// loadInoMap reads the records of f; whole is where the last complete one
// ends, size the file's length.
func loadInoMap(f *os.File) (m *inoMap, whole, size int64, err error) {
	data, err := io.ReadAll(f)
	if err != nil {
		return nil, 0, 0, fmt.Errorf("fs: read inode map: %w", err)
	}
	m = &inoMap{m: make(map[uint64]inoRec, len(data)/inoRecSize)}
	n := len(data) / inoRecSize * inoRecSize
	for off := 0; off < n; off += inoRecSize {
		r := data[off : off+inoRecSize]
		m.m[binary.LittleEndian.Uint64(r)] = inoRec{
			btime: binary.LittleEndian.Uint64(r[8:]),
			ino:   binary.LittleEndian.Uint64(r[16:]),
			gen:   binary.LittleEndian.Uint64(r[24:]),
		}
	}
	return m, int64(n), int64(len(data)), nil
}

// get returns the record for upper inode uino born at btime.
func (m *inoMap) get(uino, btime uint64) (inoRec, bool) {
	m.mu.Lock()
	r, ok := m.m[uino]
	m.mu.Unlock()
	if !ok || r.btime != btime {
		return inoRec{}, false
	}
	return r, true
}

// guess returns the record for upper inode uino without checking its birth
// time. Directory listings use it: they have d_ino but no birth time, and a
// stale record there only costs a d_ino that disagrees with st_ino for a
// file whose upper inode number was reused after a crash.
func (m *inoMap) guess(uino uint64) (inoRec, bool) {
	m.mu.Lock()
	r, ok := m.m[uino]
	m.mu.Unlock()
	return r, ok
}

// put records that upper inode uino born at btime reports r.ino and r.gen,
// durably, before returning.
func (m *inoMap) put(uino uint64, r inoRec) error {
	var b [inoRecSize]byte
	binary.LittleEndian.PutUint64(b[:], uino)
	binary.LittleEndian.PutUint64(b[8:], r.btime)
	binary.LittleEndian.PutUint64(b[16:], r.ino)
	binary.LittleEndian.PutUint64(b[24:], r.gen)
	m.mu.Lock()
	defer m.mu.Unlock()
	if old, ok := m.m[uino]; ok && old == r {
		return nil
	}
	if m.f == nil {
		return fmt.Errorf("fs: append inode map: %w", syscall.EROFS)
	}
	if _, err := m.f.Write(b[:]); err != nil {
		return fmt.Errorf("fs: append inode map: %w", err)
	}
	if err := unix.Fdatasync(int(m.f.Fd())); err != nil {
		return fmt.Errorf("fs: sync inode map: %w", err)
	}
	m.m[uino] = r
	return nil
}

// snapshot copies the map (for a View).
func (m *inoMap) snapshot() map[uint64]inoRec {
	m.mu.Lock()
	defer m.mu.Unlock()
	c := make(map[uint64]inoRec, len(m.m))
	for k, v := range m.m {
		c[k] = v
	}
	return c
}

func (m *inoMap) close() error {
	if m.f == nil {
		return nil
	}
	return m.f.Close()
}
