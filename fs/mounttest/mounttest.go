// Package mounttest is the TestMain of the packages whose tests mount FUSE
// file systems: a test that leaves a mount behind fails its package.
package mounttest

import (
	"fmt"
	"os"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/hermesfs/hermesfs/fs"
)

// Main makes a directory (prefix-*, in the system's temporary directory)
// for the tests' mounts and sets *root to it, runs the tests, then exits:
// with a failure if a mount is left below root (detached first), after
// removing root.
func Main(m *testing.M, prefix string, root *string) {
	dir, err := os.MkdirTemp("", prefix+"-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
	*root = dir
	code := m.Run()
	if left := fs.MountsBelow(dir); len(left) > 0 {
		fmt.Fprintf(os.Stderr, "FAIL: FUSE mounts left behind by the tests: %v\n", left)
		for _, mp := range left {
			unix.Unmount(mp, unix.MNT_DETACH)
		}
		code = 1
	}
	os.RemoveAll(dir)
	os.Exit(code)
}
