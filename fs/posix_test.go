package fs

import (
	"sort"
	"testing"

	"github.com/hanwen/go-fuse/v2/posixtest"
)

// TestPosix runs go-fuse's POSIX conformance suite against the overlay, in
// a directory that comes from the lower layer (so every test also copies
// it up), one mount per test.
func TestPosix(t *testing.T) {
	lower, _ := packLower(t, sampleTree)
	var names []string
	for name := range posixtest.All {
		// POSIX record locks belong to the process: a second open in
		// the same process gets the lock, on any local file system
		// (ext4 too). Cross-process locking is TestLocks.
		if name != "FcntlFlockLocksFile" {
			names = append(names, name)
		}
	}
	sort.Strings(names)
	for _, name := range names {
		fn := posixtest.All[name]
		t.Run(name, func(t *testing.T) {
			e := mountEnv(t, lower, Options{})
			fn(t, e.path("t"))
		})
	}
	// And once in an upper-only mount (first boot, no lower layer).
	t.Run("NoLower", func(t *testing.T) {
		for _, name := range names {
			fn := posixtest.All[name]
			t.Run(name, func(t *testing.T) {
				e := mountEnv(t, nil, Options{})
				fn(t, e.mnt)
			})
		}
	})
}
