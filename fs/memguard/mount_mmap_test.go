package memguard_test

import (
	"errors"
	"os"
	"syscall"
	"testing"

	"github.com/hermesfs/hermesfs/fs/memguard"
	"golang.org/x/sys/unix"
)

// TestMountMmap: what mmap of a memory file gives, as README says. Readers
// map it freely; a shared writable mapping would write around the check at
// close, and the kernel refuses it (ENODEV) before hermesfs hears of it.
func TestMountMmap(t *testing.T) {
	h := mountHome(t, memguard.Options{}, true, nil)
	h.mustWrite(t, memRel, []byte("Prefers tea."))

	// The mappings are made and dropped, never touched: a page fault on
	// a file this process serves itself can stall the Go runtime's
	// stop-the-world behind the fault, and the fault behind the
	// stopped server goroutines.
	ro := h.open(t, memRel, os.O_RDONLY, 0)
	m, err := unix.Mmap(int(ro.Fd()), 0, 12, unix.PROT_READ, unix.MAP_SHARED)
	if err != nil {
		t.Fatalf("read-only shared mmap: %v", err)
	}
	unix.Munmap(m)

	rw := h.open(t, memRel, os.O_RDWR, 0)
	if _, err := unix.Mmap(int(rw.Fd()), 0, 12, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED); !errors.Is(err, syscall.ENODEV) {
		t.Errorf("shared writable mmap: %v, want ENODEV", err)
	}
	p, err := unix.Mmap(int(rw.Fd()), 0, 12, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE)
	if err != nil {
		t.Fatalf("private writable mmap: %v", err)
	}
	unix.Munmap(p)
	if err := rw.Close(); err != nil {
		t.Fatal(err)
	}
	h.expect(t, memRel, []byte("Prefers tea."))
}
