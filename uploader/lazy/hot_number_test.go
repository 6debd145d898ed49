package lazy

import (
	"io"
	iofs "io/fs"
	"os"
	"path/filepath"
	"slices"
	"syscall"
	"testing"
	"time"

	"github.com/hermesfs/hermesfs/archive"
)

// changeDir is a directory tree whose changes since base are known: the
// paths in changed (and the root) changed, the rest of base's are
// unchanged (archive.ChangeFS).
type changeDir struct {
	iofs.FS
	base    *archive.Reader
	changed map[string]bool
}

func (c changeDir) ReadDir(name string) ([]iofs.DirEntry, error) { return iofs.ReadDir(c.FS, name) }
func (c changeDir) Lstat(name string) (iofs.FileInfo, error)     { return iofs.Lstat(c.FS, name) }
func (c changeDir) ReadLink(name string) (string, error)         { return iofs.ReadLink(c.FS, name) }

func (c changeDir) BaseInode(name string) (archive.Inode, bool, bool) {
	fi, err := c.base.Lstat(name)
	if err != nil {
		return 0, false, false
	}
	ino := archive.Inode(fi.Sys().(*syscall.Stat_t).Ino)
	return ino, name != "." && !c.changed[name], true
}

// extendPack packs src over base by extending it and writes the whole
// image (the runs laid end to end) to a new file; returns its path.
func extendPack(t *testing.T, src, basePath string, base *archive.Reader, changed map[string]bool) string {
	t.Helper()
	seg := filepath.Join(t.TempDir(), "seg")
	f, err := os.Create(seg)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	res, err := archive.Pack(t.Context(), f, changeDir{FS: os.DirFS(src), base: base, changed: changed}, archive.PackOptions{Segment: true, Base: base, Extend: true})
	if err != nil {
		t.Fatal(err)
	}
	if res.Base != archive.BaseExtended {
		t.Fatalf("the pack did not extend its base: %s", res.ExtendFallback)
	}
	bf, err := os.Open(basePath)
	if err != nil {
		t.Fatal(err)
	}
	defer bf.Close()
	out := filepath.Join(t.TempDir(), "next.sqfs")
	o, err := os.Create(out)
	if err != nil {
		t.Fatal(err)
	}
	defer o.Close()
	for _, r := range res.Runs {
		from := io.ReaderAt(f)
		if r.Source != nil {
			from = bf
		}
		if _, err := io.Copy(o, io.NewSectionReader(from, r.Offset, r.Length)); err != nil {
			t.Fatal(err)
		}
	}
	return out
}

// The files a session read are carried to an image that keeps the lower
// layer's inode numbers by number: the chunks holding what was read of
// them, wherever they are now (a file appended to since has its new tail
// elsewhere), with no walk of either tree.
func TestHotFilesFollowFilesByNumber(t *testing.T) {
	t.Parallel()
	src := t.TempDir()
	write := func(name string, b []byte) {
		if err := os.WriteFile(filepath.Join(src, name), b, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	const readLen = 3*128<<10 + 500
	write("m-read.bin", hotNoise(readLen, 1))
	write("z-state.db", hotNoise(8*128<<10, 2))
	lowerPath := hotPack(t, src)
	lf, err := os.Open(lowerPath)
	if err != nil {
		t.Fatal(err)
	}
	defer lf.Close()
	st, _ := lf.Stat()
	hf := NewHotFiles(lf, st.Size(), testChunk, time.Hour)
	lower, err := archive.Open(hf, st.Size(), archive.ReaderOptions{Name: "lower"})
	if err != nil {
		t.Fatal(err)
	}
	fi, err := lower.Lstat("m-read.bin")
	if err != nil {
		t.Fatal(err)
	}
	ino := archive.Inode(fi.Sys().(*syscall.Stat_t).Ino)
	buf := make([]byte, 64<<10)
	for off := int64(0); off < readLen; off += int64(len(buf)) {
		n, err := lower.ReadAt(ino, buf, off)
		if err != nil && err != io.EOF {
			t.Fatal(err)
		}
		hf.NoteFile(ino, off, int64(n)) // as the overlay notes its reads
	}
	if n, err := hf.Resolve(); n != 1 || err != nil {
		t.Fatalf("Resolve kept %d file ranges (%v), want the one file read", n, err)
	}

	// The next image extends the lower: a new file, the read file
	// appended to, the database rewritten.
	base, err := archive.Open(lf, st.Size(), archive.ReaderOptions{})
	if err != nil {
		t.Fatal(err)
	}
	write("a-new.bin", hotNoise(5*128<<10, 3))
	f, err := os.OpenFile(filepath.Join(src, "m-read.bin"), os.O_WRONLY|os.O_APPEND, 0)
	if err != nil {
		t.Fatal(err)
	}
	f.Write(hotNoise(200<<10, 5))
	f.Close()
	write("z-state.db", hotNoise(9*128<<10, 4))
	nextPath := extendPack(t, src, lowerPath, base, map[string]bool{"m-read.bin": true, "z-state.db": true, "a-new.bin": true})
	got, err := func() ([]int64, error) {
		f, err := os.Open(nextPath)
		if err != nil {
			return nil, err
		}
		defer f.Close()
		fi, _ := f.Stat()
		return hf.Chunks(f, fi.Size(), testChunk)
	}()
	if err != nil {
		t.Fatal(err)
	}
	nf, err := os.Open(nextPath)
	if err != nil {
		t.Fatal(err)
	}
	defer nf.Close()
	nst, _ := nf.Stat()
	next, err := archive.Open(nf, nst.Size(), archive.ReaderOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if err := next.Verify(t.Context()); err != nil {
		t.Fatal(err)
	}
	chunksOf := func(name string, upTo int64) []int64 {
		a, err := next.Lstat(name)
		if err != nil {
			t.Fatal(err)
		}
		ext, err := next.Extents(archive.Inode(a.Sys().(*syscall.Stat_t).Ino))
		if err != nil {
			t.Fatal(err)
		}
		var out []int64
		for _, e := range ext {
			if e.Off >= upTo {
				continue
			}
			for c := e.At / testChunk; c <= (e.At+e.Size-1)/testChunk; c++ {
				if !slices.Contains(out, c) {
					out = append(out, c)
				}
			}
		}
		return out
	}
	if a, _ := next.Lstat("m-read.bin"); archive.Inode(a.Sys().(*syscall.Stat_t).Ino) != ino {
		t.Fatalf("the extending pack renumbered the file")
	}
	read := chunksOf("m-read.bin", readLen)
	for _, c := range read {
		if !slices.Contains(got, c) {
			t.Fatalf("hot chunks %v of the next image miss chunk %d of the bytes read (their chunks %v)", got, c, read)
		}
	}
	for _, c := range got {
		if !slices.Contains(read, c) {
			t.Fatalf("hot chunk %d of %v holds none of the bytes read (%v)", c, got, read)
		}
	}
}
