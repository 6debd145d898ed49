package fs

import (
	"os"
	"testing"

	"golang.org/x/sys/unix"
)

// TestMergedDirNlink: a directory with both an upper and a lower side
// reports 2 plus its subdirectories, as an unchanged one does, through
// mkdir, rmdir and renames, and after a remount.
func TestMergedDirNlink(t *testing.T) {
	lower, _ := packLower(t, sampleTree)
	e := mountEnv(t, lower, Options{})
	nlink := func(rel string) uint64 {
		t.Helper()
		var st unix.Stat_t
		if err := unix.Lstat(e.path(rel), &st); err != nil {
			t.Fatal(err)
		}
		return uint64(st.Nlink)
	}
	want := func(rel string, n uint64) {
		t.Helper()
		if got := nlink(rel); got != n {
			t.Errorf("%s: nlink %d, want %d", rel, got, n)
		}
	}
	want("a", 3) // a/b, unchanged
	e.write("a/new.txt", "x")
	want("a", 3) // merged now: a file is no link
	must(t, os.Mkdir(e.path("a/c"), 0o755))
	want("a", 4)
	must(t, os.Remove(e.path("a/b/two.txt")))
	must(t, os.Remove(e.path("a/b")))
	want("a", 3)
	rootBefore := nlink(".")
	must(t, os.Rename(e.path("a/c"), e.path("c2")))
	want("a", 2)
	want(".", rootBefore+1)
	for i := 0; i < 20; i++ {
		e.write("a/f.txt", "y") // files come and go: the count stays
		must(t, os.Remove(e.path("a/f.txt")))
	}
	want("a", 2)
	e.remount()
	want("a", 2)
	want(".", rootBefore+1)
}
