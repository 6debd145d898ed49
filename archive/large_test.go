package archive

import (
	"bytes"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// A file over 4 GiB (sparse, so the test stays fast) needs an extended
// inode; its data past 4 GiB must read back through our reader,
// unsquashfs and the kernel.
func TestFileOver4GiB(t *testing.T) {
	src := filepath.Join(t.TempDir(), "tree")
	os.MkdirAll(src, 0o755)
	const size = 4<<30 + 300<<10 + 123
	marks := map[int64][]byte{
		0:           []byte("start of a very large sparse database"),
		2 << 30:     text(200<<10, 7),
		4<<30 + 5:   []byte("past four gibibytes"),
		size - 1000: text(1000, 8),
	}
	f, err := os.Create(filepath.Join(src, "huge.db"))
	if err != nil {
		t.Fatal(err)
	}
	for off, b := range marks {
		if _, err := f.WriteAt(b, off); err != nil {
			t.Fatal(err)
		}
	}
	if err := f.Truncate(size); err != nil {
		t.Fatal(err)
	}
	f.Close()

	p, res := packToFile(t, src, PackOptions{})
	if res.Size > 2<<20 {
		t.Errorf("archive of a sparse file is %d bytes: holes not stored as holes", res.Size)
	}
	r := openFile(t, p)
	a, err := r.Lookup(r.Root(), "huge.db")
	if err != nil {
		t.Fatal(err)
	}
	if a.Size != size {
		t.Fatalf("size %d, want %d", a.Size, size)
	}
	check := func(name string, ra io.ReaderAt) {
		t.Helper()
		for off, want := range marks {
			got := make([]byte, len(want)+10)
			n, err := ra.ReadAt(got, off-5)
			if off == 0 {
				n, err = ra.ReadAt(got[5:], 0)
				n += 5
			}
			if err != nil && err != io.EOF {
				t.Fatalf("%s: ReadAt %d: %v", name, off, err)
			}
			if !bytes.Equal(got[5:5+len(want)], want) {
				t.Errorf("%s: data at %d differs", name, off)
			}
			if off != 0 && !bytes.Equal(got[:5], make([]byte, 5)) {
				t.Errorf("%s: hole before %d is not zeros", name, off)
			}
			_ = n
		}
		tail := make([]byte, 10)
		if n, err := ra.ReadAt(tail, size-5); n != 5 || err != io.EOF {
			t.Errorf("%s: read across EOF: %d, %v", name, n, err)
		}
	}
	check("reader", readerAt{r, a.Ino})

	unsquashfs := needTool(t, "unsquashfs")
	out := filepath.Join(t.TempDir(), "out")
	run(t, unsquashfs, "-no-progress", "-d", out, p)
	uf, err := os.Open(filepath.Join(out, "huge.db"))
	if err != nil {
		t.Fatal(err)
	}
	defer uf.Close()
	if st, _ := uf.Stat(); st.Size() != size {
		t.Fatalf("unsquashfs: size %d", st.Size())
	}
	check("unsquashfs", uf)

	mnt, err := tryKernelMount(t, p)
	if err != nil {
		t.Log(err)
		return
	}
	kf, err := os.Open(filepath.Join(mnt, "huge.db"))
	if err != nil {
		t.Fatal(err)
	}
	defer kf.Close()
	check("kernel", kf)
}

type readerAt struct {
	r   *Reader
	ino Inode
}

func (ra readerAt) ReadAt(p []byte, off int64) (int, error) { return ra.r.ReadAt(ra.ino, p, off) }

// 100k files: counts, lookups and reads hold up, and unsquashfs agrees.
func TestHundredThousandFiles(t *testing.T) {
	src := filepath.Join(t.TempDir(), "tree")
	const dirs, per = 50, 2000
	for d := range dirs {
		dir := filepath.Join(src, fmt.Sprintf("cron-%02d", d))
		if err := os.MkdirAll(dir, 0o755); err != nil {
			t.Fatal(err)
		}
		for i := range per {
			name := fmt.Sprintf("out-%04d.md", i)
			var data []byte
			if i%3 != 0 {
				data = []byte(fmt.Sprintf("job %d run %d\n", d, i))
			}
			if err := os.WriteFile(filepath.Join(dir, name), data, 0o644); err != nil {
				t.Fatal(err)
			}
		}
	}
	p, res := packToFile(t, src, PackOptions{})
	if res.Files != dirs*per || res.Dirs != dirs+1 {
		t.Fatalf("packed %d files in %d dirs", res.Files, res.Dirs)
	}
	r := openFile(t, p)
	if r.Inodes() != dirs*per+dirs+1 {
		t.Fatalf("%d inodes", r.Inodes())
	}
	for d := 0; d < dirs; d += 7 {
		da, err := r.Lookup(r.Root(), fmt.Sprintf("cron-%02d", d))
		if err != nil {
			t.Fatal(err)
		}
		for i := 1; i < per; i += 331 {
			a, err := r.Lookup(da.Ino, fmt.Sprintf("out-%04d.md", i))
			if err != nil {
				t.Fatal(err)
			}
			buf := make([]byte, a.Size)
			r.ReadAt(a.Ino, buf, 0)
			if want := fmt.Sprintf("job %d run %d\n", d, i); i%3 != 0 && string(buf) != want {
				t.Fatalf("read %q, want %q", buf, want)
			}
		}
	}
	if err := r.Verify(t.Context()); err != nil {
		t.Fatal(err)
	}
	unsquashfs := needTool(t, "unsquashfs")
	list := run(t, unsquashfs, "-l", p)
	if got := strings.Count(list, "\n"); got < dirs*per {
		t.Fatalf("unsquashfs lists %d lines", got)
	}
}
