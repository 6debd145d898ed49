// Package mounttest is the TestMain of the packages whose tests mount FUSE
// file systems: a test that leaves a mount behind fails its package.
package mounttest

import (
	"fmt"
	"os"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/hermesfs/hermesfs/fs"
)

// Main makes a directory (prefix-*, in the system's temporary directory)
// for the tests' mounts and sets *root to it, runs the tests, then exits:
// with a failure if a mount is left below root (detached first), after
// removing root. The tests' child processes built with -race exit without
// the race runtime's pause (RaceChildrenExitAtOnce).
func Main(m *testing.M, prefix string, root *string) {
	RaceChildrenExitAtOnce()
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

// RaceChildrenExitAtOnce makes the programs built with -race that the
// tests start (hermesfs, the test binary as a helper process) exit as
// soon as they are done. The race runtime otherwise sleeps a second in
// every exit (GORACE atexit_sleep_ms, 1000 by default), for goroutines
// still running to report races: a second for each of the hundreds of
// commands and helpers a test run starts, while every race is still
// reported when it happens. A GORACE that sets atexit_sleep_ms is kept.
func RaceChildrenExitAtOnce() {
	if g := os.Getenv("GORACE"); !strings.Contains(g, "atexit_sleep_ms") {
		os.Setenv("GORACE", strings.TrimSpace(g+" atexit_sleep_ms=0"))
	}
}
