package fs

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

func TestTranslate(t *testing.T) {
	renames := []renameRec{
		{from: "a", to: "b"},
		{from: "b/x", to: "y"},
		{from: "p", to: "q", exchange: true},
	}
	for in, want := range map[string]string{
		"a":     "b",
		"a/x":   "y",
		"a/x/z": "y/z",
		"a/w":   "b/w",
		"ab":    "ab",
		"p/1":   "q/1",
		"q/2":   "p/2",
		"other": "other",
	} {
		if got := translate(in, renames); got != want {
			t.Errorf("translate(%q) = %q, want %q", in, got, want)
		}
	}
}

func TestWhiteoutNames(t *testing.T) {
	if m, hashed := whiteoutName("x"); m != ".wh.x" || hashed {
		t.Errorf("short name: %q %v", m, hashed)
	}
	long := strings.Repeat("y", 252)
	m, hashed := whiteoutName(long)
	if !hashed || len(m) > nameMax || !strings.HasPrefix(m, hashedPrefix) {
		t.Errorf("long name: %q %v", m, hashed)
	}
	dir := t.TempDir()
	fd, err := unix.Open(dir, unix.O_PATH|unix.O_DIRECTORY, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(fd)
	work, _ := unix.Open(dir, unix.O_PATH|unix.O_DIRECTORY, 0)
	defer unix.Close(work)
	u := &upper{root: fd, work: work}
	for _, name := range []string{"x", long} {
		if err := u.addWhiteout(fd, name); err != nil {
			t.Fatal(err)
		}
		if ok, err := whitedOut(fd, name); !ok || err != nil {
			t.Errorf("%.10s: whited out %v %v", name, ok, err)
		}
		// Adding it again is fine.
		if err := u.addWhiteout(fd, name); err != nil {
			t.Fatal(err)
		}
	}
	if ok, _ := whitedOut(fd, "z"); ok {
		t.Error("z whited out")
	}
	if ok, _ := whitedOut(fd, strings.Repeat("w", 252)); ok {
		t.Error("another long name whited out")
	}
}

func TestInoMapRepair(t *testing.T) {
	dir := t.TempDir()
	fd, err := unix.Open(dir, unix.O_PATH|unix.O_DIRECTORY, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(fd)
	m, err := openInoMap(fd)
	if err != nil {
		t.Fatal(err)
	}
	m.put(10, inoRec{btime: 5, ino: 77, gen: 1})
	m.put(11, inoRec{btime: 6, ino: 78, gen: 1})
	m.close()
	// A torn record at the end (crash mid-append) is dropped.
	f, _ := os.OpenFile(filepath.Join(dir, inoMapName), os.O_WRONLY|os.O_APPEND, 0)
	f.Write([]byte{1, 2, 3})
	f.Close()
	m, err = openInoMap(fd)
	if err != nil {
		t.Fatal(err)
	}
	defer m.close()
	if ino, _ := m.number(&ustat{ino: 10, btime: 5}); ino != 77 {
		t.Errorf("record 10: %d", ino)
	}
	if ino, _ := m.number(&ustat{ino: 11, btime: 999}); ino != 11+upperInoBase {
		t.Errorf("a record with another birth time matched (inode number reused): %d", ino)
	}
	if st, _ := os.Stat(filepath.Join(dir, inoMapName)); st.Size() != 2*inoRecSize {
		t.Errorf("map not repaired: %d bytes", st.Size())
	}
}

// TestInoMapClaimed: an upper inode whose own number a record of another
// inode keeps (a guarded file replaced its old inode, whose number the
// upper file system gave to this one) gets a number of its own, the same
// again after a reopen, and distinct from every other.
func TestInoMapClaimed(t *testing.T) {
	dir := t.TempDir()
	fd, err := unix.Open(dir, unix.O_PATH|unix.O_DIRECTORY, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(fd)
	m, err := openInoMap(fd)
	if err != nil {
		t.Fatal(err)
	}
	// Upper inode 20 keeps the number of inode 30, now gone.
	must(t, m.put(20, inoRec{btime: 1, ino: 30 + upperInoBase, gen: 1}))
	reused := &ustat{ino: 30, btime: 9} // a new inode with number 30
	a, _ := m.number(reused)
	if a == 30+upperInoBase || a < allocInoBase {
		t.Fatalf("inode 30 reborn reports %d, the number inode 20 keeps, or one not allocated", a)
	}
	if again, _ := m.number(reused); again != a {
		t.Errorf("allocated %d, then %d", a, again)
	}
	must(t, m.put(21, inoRec{btime: 2, ino: 31 + upperInoBase, gen: 1}))
	b, _ := m.number(&ustat{ino: 31, btime: 3})
	if b == a || b < allocInoBase {
		t.Errorf("second allocation %d (first %d)", b, a)
	}
	if own, _ := m.number(&ustat{ino: 32, btime: 3}); own != 32+upperInoBase {
		t.Errorf("an unclaimed inode reports %d", own)
	}
	m.close()
	m, err = openInoMap(fd)
	if err != nil {
		t.Fatal(err)
	}
	defer m.close()
	if got, _ := m.number(reused); got != a {
		t.Errorf("after a reopen: %d, want %d", got, a)
	}
	if c, _ := m.number(&ustat{ino: 30, btime: 10}); c == a || c == b || c < allocInoBase {
		t.Errorf("a third inode 30 after a reopen reports %d (allocated before: %d, %d)", c, a, b)
	}
}

func TestMountinfoParsing(t *testing.T) {
	info := "36 35 98:0 / /mnt/with\\040space rw - fuse.hermesfs hermesfs rw\n37 35 98:0 / /plain rw - ext4 /dev/x rw\n"
	if !mountedAt(info, "/mnt/with space") || !mountedAt(info, "/plain") || mountedAt(info, "/mnt") {
		t.Error("mountedAt")
	}
}
