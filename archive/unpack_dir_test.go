package archive

import (
	"os"
	"path/filepath"
	"testing"
)

func TestUnpackSubtree(t *testing.T) {
	src := makeTree(t)
	p, _ := packToFile(t, src, PackOptions{})
	r := openFile(t, p)
	a, err := r.Lookup(r.Root(), "sessions")
	if err != nil {
		t.Fatal(err)
	}
	out := filepath.Join(t.TempDir(), "out")
	if err := Unpack(t.Context(), r, out, UnpackOptions{Dir: a.Ino}); err != nil {
		t.Fatal(err)
	}
	root := os.Geteuid() == 0
	compareTrees(t, scanTree(t, filepath.Join(src, "sessions")), scanTree(t, out), compareOpts{nsec: true, owners: root, dirMtime: true})
	f, err := r.Lookup(r.Root(), "config.yaml")
	if err != nil {
		t.Fatal(err)
	}
	if err := Unpack(t.Context(), r, filepath.Join(t.TempDir(), "x"), UnpackOptions{Dir: f.Ino}); err == nil {
		t.Error("Unpack of a file inode as a directory succeeded")
	}
}
