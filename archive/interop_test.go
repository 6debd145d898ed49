package archive

import (
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	iofs "io/fs"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"strings"
	"testing"

	diskfile "github.com/diskfs/go-diskfs/backend/file"
	"github.com/diskfs/go-diskfs/filesystem/squashfs"
)

// Every compression round-trips through unsquashfs and our reader.
func TestCompressions(t *testing.T) {
	unsquashfs := needTool(t, "unsquashfs")
	src := makeTree(t)
	want := scanTree(t, src)
	for _, o := range []PackOptions{
		{Compression: Zstd, Level: 1},
		{Compression: Zstd, Level: 19, BlockSize: 1 << 20},
		{Compression: Zstd, BlockSize: 4 << 10},
		{Compression: Gzip},
		{Compression: Gzip, Level: 1, BlockSize: 64 << 10},
		{Compression: LZ4},
		{Compression: LZ4, Level: 9},
		{Compression: None},
	} {
		name := fmt.Sprintf("%s-%d-%d", o.Compression, o.Level, o.BlockSize)
		t.Run(name, func(t *testing.T) {
			p, _ := packToFile(t, src, o)
			r := openFile(t, p)
			if got := r.Compression(); got != o.Compression {
				t.Errorf("Compression() = %q", got)
			}
			compareTrees(t, want, scanArchive(t, r), compareOpts{nsec: true, owners: true, dirMtime: true, devices: true})
			if err := r.Verify(t.Context()); err != nil {
				t.Fatal(err)
			}
			out := filepath.Join(t.TempDir(), "out")
			run(t, unsquashfs, "-no-progress", "-d", out, p)
			root := os.Geteuid() == 0
			compareTrees(t, want, scanTree(t, out), compareOpts{owners: root, devices: root})
		})
	}
}

// The kernel mounts what we write (where the machine lets the test mount).
func TestKernelMount(t *testing.T) {
	src := makeTree(t)
	want := scanTree(t, src)
	for _, o := range []PackOptions{{Compression: Zstd}, {Compression: Gzip}, {Compression: LZ4}, {Compression: None},
		{Compression: Zstd, BlockSize: 4 << 10}, {Compression: Zstd, Level: 19, BlockSize: 1 << 20}} {
		t.Run(fmt.Sprintf("%s-%d", o.Compression, o.BlockSize), func(t *testing.T) {
			p, _ := packToFile(t, src, o)
			mnt := kernelMount(t, p)
			compareTrees(t, want, scanTree(t, mnt), compareOpts{owners: true, dirMtime: true, devices: true})
		})
	}
}

// go-diskfs, an independent reader, agrees on names, types and content.
func TestGoDiskfsReads(t *testing.T) {
	src := makeTree(t)
	p, _ := packToFile(t, src, PackOptions{})
	checkGoDiskfs(t, p, scanTree(t, src))
}

// checkGoDiskfs reads the archive at p with go-diskfs and compares names,
// types, permissions, owners, mtimes (seconds), symlink targets and
// content with want.
func checkGoDiskfs(t *testing.T, p string, want map[string]entryInfo) {
	t.Helper()
	checkGoDiskfsSample(t, p, want, 1)
}

// checkGoDiskfsSample is checkGoDiskfs reading the content of only every
// nth file of a directory of more than 50 entries (go-diskfs looks each
// path up from the root, listing every directory on the way).
func checkGoDiskfsSample(t *testing.T, p string, want map[string]entryInfo, every int) {
	t.Helper()
	f, err := os.Open(p)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	st, _ := f.Stat()
	fsys, err := squashfs.Read(diskfile.New(f, true), st.Size(), 0, 0)
	if err != nil {
		t.Fatal(err)
	}
	seen := 0
	var walk func(dir string)
	walk = func(dir string) {
		ents, err := fsys.ReadDir(dir)
		if err != nil {
			t.Fatalf("go-diskfs ReadDir %s: %v", dir, err)
		}
		for i, e := range ents {
			p := path.Join(dir, e.Name())
			w, ok := want[p]
			if !ok {
				t.Errorf("go-diskfs lists unexpected %s", p)
				continue
			}
			seen++
			if e.Type() != w.mode.Type() {
				t.Errorf("%s: go-diskfs type %v, want %v", p, e.Type(), w.mode.Type())
			}
			if fi, err := e.Info(); err != nil {
				t.Errorf("%s: go-diskfs Info: %v", p, err)
			} else {
				st, _ := fi.Sys().(*squashfs.StatT)
				switch {
				case fi.Mode().Perm() != w.mode.Perm():
					t.Errorf("%s: go-diskfs permissions %v, want %v", p, fi.Mode().Perm(), w.mode.Perm())
				case fi.ModTime().Unix() != w.mtime.Unix():
					t.Errorf("%s: go-diskfs mtime %v, want %v", p, fi.ModTime(), w.mtime)
				case st == nil || st.UID != w.uid || st.GID != w.gid:
					t.Errorf("%s: go-diskfs owner %+v, want %d:%d", p, st, w.uid, w.gid)
				case w.mode.Type() == iofs.ModeSymlink && st.LinkTarget != w.target:
					t.Errorf("%s: go-diskfs symlink target %q, want %q", p, st.LinkTarget, w.target)
				case w.mode.IsRegular() && fi.Size() != w.size:
					t.Errorf("%s: go-diskfs size %d, want %d", p, fi.Size(), w.size)
				}
			}
			switch {
			case e.IsDir():
				walk(p)
			case w.mode.IsRegular() && (len(ents) <= 50 || i%every == 0):
				rf, err := fsys.Open(p)
				if err != nil {
					t.Fatalf("go-diskfs open %s: %v", p, err)
				}
				h := sha256.New()
				if _, err := io.Copy(h, rf); err != nil {
					t.Fatalf("go-diskfs read %s: %v", p, err)
				}
				rf.Close()
				if [32]byte(h.Sum(nil)) != w.sum {
					t.Errorf("%s: go-diskfs reads different content", p)
				}
			}
		}
	}
	walk(".")
	if seen != len(want)-1 {
		t.Errorf("go-diskfs saw %d entries, want %d", seen, len(want)-1)
	}
}

// kernelMount mounts the archive at p with the kernel's squashfs until the
// test ends, or skips the test where the machine does not allow it.
func kernelMount(t *testing.T, p string) string {
	t.Helper()
	mnt, err := tryKernelMount(t, p)
	if err != nil {
		t.Skip(err)
	}
	return mnt
}

// tryKernelMount is kernelMount for the end of a test that has checked
// everything else: it says why it cannot mount instead of skipping.
func tryKernelMount(t *testing.T, p string) (string, error) {
	t.Helper()
	if os.Geteuid() != 0 {
		return "", errors.New("kernel squashfs mount needs root")
	}
	mnt := filepath.Join(t.TempDir(), "mnt")
	os.Mkdir(mnt, 0o755)
	out, err := exec.Command("mount", "-t", "squashfs", "-o", "loop,ro", p, mnt).CombinedOutput()
	if err != nil {
		return "", fmt.Errorf("kernel squashfs mount not available here: %v: %s", err, out)
	}
	t.Cleanup(func() {
		if out, err := exec.Command("umount", mnt).CombinedOutput(); err != nil {
			t.Errorf("umount: %v: %s", err, out)
		}
	})
	return mnt, nil
}

// Our reader reads mksquashfs images identically to the tree they came from.
func TestReadMksquashfsImages(t *testing.T) {
	mksquashfs := needTool(t, "mksquashfs")
	src := makeTree(t)
	want := scanTree(t, src)
	for _, args := range [][]string{
		{"-comp", "zstd"},
		{"-comp", "gzip"},
		{"-comp", "lz4"},
		{"-comp", "lz4", "-Xhc"},
		{"-comp", "xz"},
		{"-comp", "lzma"},
		{"-comp", "zstd", "-b", "4K", "-always-use-fragments", "-no-exports", "-no-duplicates"},
		{"-comp", "gzip", "-noI", "-noD", "-noF", "-noX", "-no-fragments", "-nopad"},
	} {
		t.Run(strings.Join(args, ""), func(t *testing.T) {
			img := filepath.Join(t.TempDir(), "m.sqfs")
			cmd := append([]string{src, img, "-noappend", "-quiet", "-no-progress", "-no-xattrs"}, args...)
			if out, err := exec.Command(mksquashfs, cmd...).CombinedOutput(); err != nil {
				if strings.Contains(string(out), "not supported") || strings.Contains(string(out), "invalid compressor") {
					t.Skipf("this mksquashfs lacks %v: %s", args, out)
				}
				t.Fatalf("mksquashfs: %v\n%s", err, out)
			}
			r := openFile(t, img)
			if r.Checksummed() {
				t.Error("mksquashfs image reported as checksummed")
			}
			compareTrees(t, want, scanArchive(t, r), compareOpts{owners: true, dirMtime: true, devices: true})
			if err := r.Verify(t.Context()); err != nil {
				t.Fatal(err)
			}
		})
	}
}

// The same tree packs to the same bytes, whatever the worker count.
func TestReproducible(t *testing.T) {
	src := makeTree(t)
	_, a := packToFile(t, src, PackOptions{Workers: 1})
	_, b := packToFile(t, src, PackOptions{Workers: 7})
	if a.SHA256 != b.SHA256 || a.Size != b.Size {
		t.Fatalf("two packs differ: %x (%d) vs %x (%d)", a.SHA256, a.Size, b.SHA256, b.Size)
	}
}

// Pack to a writer that cannot seek gets the same bytes as to a file.
func TestPackToStream(t *testing.T) {
	src := makeTree(t)
	p, want := packToFile(t, src, PackOptions{})
	pr, pw := io.Pipe()
	type result struct {
		res PackResult
		err error
	}
	ch := make(chan result, 1)
	go func() {
		res, err := PackDir(t.Context(), pw, src, PackOptions{})
		pw.CloseWithError(err)
		ch <- result{res, err}
	}()
	got, err := io.ReadAll(pr)
	if err != nil {
		t.Fatal(err)
	}
	r := <-ch
	if r.err != nil {
		t.Fatal(r.err)
	}
	disk, _ := os.ReadFile(p)
	if sha256.Sum256(got) != want.SHA256 || r.res.SHA256 != want.SHA256 || string(got) != string(disk) {
		t.Fatal("streamed archive differs from the file archive")
	}
}

// A directory large enough to need an index (more than one metadata
// block) and many inodes: kernel lookup, unsquashfs and our reader agree.
func TestLargeDirectory(t *testing.T) {
	unsquashfs := needTool(t, "unsquashfs")
	src := filepath.Join(t.TempDir(), "big")
	os.MkdirAll(filepath.Join(src, "d"), 0o755)
	const n = 3000
	for i := range n {
		name := fmt.Sprintf("session-%05d-%s.json", i, strings.Repeat("x", i%200))
		if err := os.WriteFile(filepath.Join(src, "d", name), []byte(name), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	p, _ := packToFile(t, src, PackOptions{})
	r := openFile(t, p)
	d, err := r.Lookup(r.Root(), "d")
	if err != nil {
		t.Fatal(err)
	}
	if in, err := r.lookupInode(d.Ino); err != nil || in.typ != typeLDir || in.idxCnt == 0 {
		t.Fatalf("large directory is not an extended directory with an index: %+v, %v", in, err)
	}
	ents, err := r.ReadDir(d.Ino)
	if err != nil || len(ents) != n {
		t.Fatalf("ReadDir: %d entries, %v", len(ents), err)
	}
	for i := 0; i < n; i += 97 {
		name := fmt.Sprintf("session-%05d-%s.json", i, strings.Repeat("x", i%200))
		a, err := r.Lookup(d.Ino, name)
		if err != nil {
			t.Fatal(err)
		}
		buf := make([]byte, a.Size)
		if _, err := r.ReadAt(a.Ino, buf, 0); err != nil || string(buf) != name {
			t.Fatalf("%s: read %q, %v", name, buf, err)
		}
	}
	out := filepath.Join(t.TempDir(), "out")
	run(t, unsquashfs, "-no-progress", "-d", out, p)
	compareTrees(t, scanTree(t, src), scanTree(t, out), compareOpts{})
	mnt, err := tryKernelMount(t, p)
	if err != nil {
		t.Log(err)
		return
	}
	// Lookups by name go through the directory index.
	for i := 0; i < n; i += 37 {
		name := fmt.Sprintf("session-%05d-%s.json", i, strings.Repeat("x", i%200))
		data, err := os.ReadFile(filepath.Join(mnt, "d", name))
		if err != nil || string(data) != name {
			t.Fatalf("kernel: %s: %q, %v", name, data, err)
		}
	}
	if _, err := os.Stat(filepath.Join(mnt, "d", "session-99999")); !os.IsNotExist(err) {
		t.Errorf("kernel: stat of a missing name: %v", err)
	}
	list, _ := os.ReadDir(filepath.Join(mnt, "d"))
	if len(list) != n {
		t.Errorf("kernel lists %d entries, want %d", len(list), n)
	}
}

// A file opened for appending cannot take the superblock at its start
// afterwards; Pack notices and still writes the archive after what is
// there.
func TestPackToAppendOnlyFile(t *testing.T) {
	src := makeTree(t)
	_, want := packToFile(t, src, PackOptions{})
	p := filepath.Join(t.TempDir(), "append.sqfs")
	f, err := os.OpenFile(p, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		t.Fatal(err)
	}
	f.WriteString("prefix")
	res, err := PackDir(t.Context(), f, src, PackOptions{})
	f.Close()
	if err != nil {
		t.Fatal(err)
	}
	data, _ := os.ReadFile(p)
	if res.SHA256 != want.SHA256 || sha256.Sum256(data[6:]) != want.SHA256 || string(data[:6]) != "prefix" {
		t.Fatal("archive appended to a file differs")
	}
}
