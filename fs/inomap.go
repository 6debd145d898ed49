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
//
// A number kept by a guarded file is its old upper inode's number plus
// upperInoBase, and that inode is gone: the upper file system gives its
// number to the next inode it creates, whose own number would then be the
// kept one. Such an inode (its number is claimed by a record of another)
// gets a number of its own instead, allocated from allocInoBase on and
// recorded like the others, so no two live files ever report one number.
type inoMap struct {
	mu sync.Mutex
	f  *os.File
	m  map[uint64]inoRec // by upper inode number
	// claims counts the records of m that report each number.
	claims map[uint64]int
	// next is the next number to allocate: past every allocated number
	// the log holds.
	next uint64
	// log reports a failed append of an allocation (kept in memory).
	log func(msg string, args ...any)
}

// allocInoBase starts the numbers allocated to upper inodes whose own
// number is kept by another file: far above the upper inode numbers plus
// upperInoBase of any real file system, and below 2^63 for readers that
// take st_ino as signed.
const allocInoBase = 1 << 62

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
		return &inoMap{m: map[uint64]inoRec{}, claims: map[uint64]int{}, next: allocInoBase}, nil
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
	m = &inoMap{m: make(map[uint64]inoRec, len(data)/inoRecSize), claims: map[uint64]int{}, next: allocInoBase}
	n := len(data) / inoRecSize * inoRecSize
	for off := 0; off < n; off += inoRecSize {
		r := data[off : off+inoRecSize]
		rec := inoRec{
			btime: binary.LittleEndian.Uint64(r[8:]),
			ino:   binary.LittleEndian.Uint64(r[16:]),
			gen:   binary.LittleEndian.Uint64(r[24:]),
		}
		m.m[binary.LittleEndian.Uint64(r)] = rec
		if rec.ino >= m.next {
			m.next = rec.ino + 1
		}
	}
	for _, r := range m.m {
		m.claims[r.ino]++
	}
	return m, int64(n), int64(len(data)), nil
}

// number returns the st_ino and generation upper inode st reports: its
// record's, else its own number plus upperInoBase unless a record of
// another inode claims that, else a number allocated to it now (see
// inoMap).
func (m *inoMap) number(st *ustat) (uint64, uint64) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if r, ok := m.m[st.ino]; ok && r.btime == st.btime {
		return r.ino, r.gen
	}
	own := st.ino + upperInoBase
	if m.claims[own] == 0 {
		return own, genOf(st)
	}
	r := inoRec{btime: st.btime, ino: m.next, gen: genOf(st)}
	m.next++
	if m.f == nil {
		// A read-only mount: distinct for this mount all the same.
		m.setLocked(st.ino, r)
	} else if err := m.putLocked(st.ino, r); err != nil {
		// Distinct for this mount all the same; the next mount
		// allocates again.
		if m.log != nil {
			m.log("inode map: recording an allocated inode number failed; it holds until unmount", "upper_ino", st.ino, "ino", r.ino, "err", err)
		}
		m.setLocked(st.ino, r)
	}
	return r.ino, r.gen
}

// known reports whether upper inode number uino has a record or its own
// number is claimed: then only its birth time (number) tells what it
// reports. Directory listings, which have d_ino and no birth time, stat
// such entries.
func (m *inoMap) known(uino uint64) bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	_, ok := m.m[uino]
	return ok || m.claims[uino+upperInoBase] > 0
}

// setLocked makes r the record of uino in memory. m.mu is held.
func (m *inoMap) setLocked(uino uint64, r inoRec) {
	if old, ok := m.m[uino]; ok {
		if m.claims[old.ino]--; m.claims[old.ino] <= 0 {
			delete(m.claims, old.ino)
		}
	}
	m.m[uino] = r
	m.claims[r.ino]++
}

// put records that upper inode uino born at btime reports r.ino and r.gen,
// durably, before returning.
func (m *inoMap) put(uino uint64, r inoRec) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.putLocked(uino, r)
}

// putLocked is put with m.mu held.
func (m *inoMap) putLocked(uino uint64, r inoRec) error {
	var b [inoRecSize]byte
	binary.LittleEndian.PutUint64(b[:], uino)
	binary.LittleEndian.PutUint64(b[8:], r.btime)
	binary.LittleEndian.PutUint64(b[16:], r.ino)
	binary.LittleEndian.PutUint64(b[24:], r.gen)
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
	m.setLocked(uino, r)
	if r.ino >= m.next {
		m.next = r.ino + 1
	}
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
