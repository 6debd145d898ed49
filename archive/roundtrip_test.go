package archive

import (
	"os"
	"path/filepath"
	"syscall"
	"testing"
	"testing/fstest"
)

func TestRoundTripReader(t *testing.T) {
	src := makeTree(t)
	p, res := packToFile(t, src, PackOptions{})
	r := openFile(t, p)
	if !r.Checksummed() {
		t.Fatal("archive has no trailer")
	}
	want := scanTree(t, src)
	compareTrees(t, want, scanArchive(t, r), compareOpts{nsec: true, owners: true, dirMtime: true, devices: true})
	if res.Files == 0 || res.Dirs == 0 || res.Inodes == 0 {
		t.Errorf("result counts: %+v", res)
	}
	if err := r.Verify(t.Context()); err != nil {
		t.Fatal(err)
	}
}

func TestFSTest(t *testing.T) {
	src := makeTree(t)
	// Open follows symlinks, as os.DirFS does; fstest requires every
	// listed entry to open, so drop the ones that point nowhere.
	os.Remove(filepath.Join(src, "dangling"))
	os.Remove(filepath.Join(src, "absolute"))
	p, _ := packToFile(t, src, PackOptions{})
	r := openFile(t, p)
	var expect []string
	filepath.WalkDir(src, func(p string, d os.DirEntry, err error) error {
		if rel, _ := filepath.Rel(src, p); rel != "." {
			expect = append(expect, filepath.ToSlash(rel))
		}
		return nil
	})
	if err := fstest.TestFS(r.FS(), expect...); err != nil {
		t.Fatal(err)
	}
	if err := fstest.TestFS(r, expect...); err != nil {
		t.Fatal(err)
	}
}

func TestRoundTripUnsquashfs(t *testing.T) {
	unsquashfs := needTool(t, "unsquashfs")
	src := makeTree(t)
	p, _ := packToFile(t, src, PackOptions{})
	out := filepath.Join(t.TempDir(), "out")
	run(t, unsquashfs, "-no-progress", "-d", out, p)
	compareTrees(t, scanTree(t, src), scanTree(t, out), compareOpts{owners: os.Geteuid() == 0, devices: os.Geteuid() == 0})
}

func TestUnpack(t *testing.T) {
	src := makeTree(t)
	p, _ := packToFile(t, src, PackOptions{})
	r := openFile(t, p)
	out := filepath.Join(t.TempDir(), "out")
	var last, total int64
	err := Unpack(t.Context(), r, out, UnpackOptions{Progress: func(done, tot int64) { last, total = done, tot }})
	if err != nil {
		t.Fatal(err)
	}
	root := os.Geteuid() == 0
	compareTrees(t, scanTree(t, src), scanTree(t, out), compareOpts{nsec: true, owners: root, dirMtime: true, devices: root})
	if last != total || total == 0 {
		t.Errorf("progress ended at %d of %d", last, total)
	}
	// Holes stay holes, also in the copy made from the first extraction.
	for _, name := range []string{"sparse.db", "state-snapshots/sparse-copy.db"} {
		var st syscall.Stat_t
		if err := syscall.Stat(filepath.Join(out, name), &st); err != nil {
			t.Fatal(err)
		}
		if st.Blocks*512 >= 4*128<<10 {
			t.Errorf("%s: %d bytes allocated for 5000 bytes of data: holes filled in", name, st.Blocks*512)
		}
	}
	if err := Unpack(t.Context(), r, out, UnpackOptions{}); err == nil {
		t.Error("Unpack into a non-empty directory succeeded")
	}
}
