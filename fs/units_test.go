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
	if r, ok := m.get(10, 5); !ok || r.ino != 77 {
		t.Errorf("record 10: %+v %v", r, ok)
	}
	if _, ok := m.get(11, 999); ok {
		t.Error("a record with another birth time matched (inode number reused)")
	}
	if st, _ := os.Stat(filepath.Join(dir, inoMapName)); st.Size() != 2*inoRecSize {
		t.Errorf("map not repaired: %d bytes", st.Size())
	}
}

func TestMountinfoParsing(t *testing.T) {
	info := "36 35 98:0 / /mnt/with\\040space rw - fuse.hermesfs hermesfs rw\n37 35 98:0 / /plain rw - ext4 /dev/x rw\n"
	if !mountedAt(info, "/mnt/with space") || !mountedAt(info, "/plain") || mountedAt(info, "/mnt") {
		t.Error("mountedAt")
	}
}
