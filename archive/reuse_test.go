package archive

import (
	"fmt"
	"os"
	"path/filepath"
	"testing"
)

// Packing with a base archive copies the unchanged files' blocks, and the
// result holds exactly what a fresh pack of the changed tree holds.
func TestReuseFromBase(t *testing.T) {
	unsquashfs := needTool(t, "unsquashfs")
	src := makeTree(t)
	basePath, _ := packToFile(t, src, PackOptions{})
	base := openFile(t, basePath)

	// Change the tree: rewrite a big file, grow a log, add and remove files.
	writeFile(t, filepath.Join(src, "sessions", "big.json"), text(3*128<<10+777, 42), 0o644)
	f, _ := os.OpenFile(filepath.Join(src, "logs", "agent.log"), os.O_APPEND|os.O_WRONLY, 0)
	f.WriteString("one more line\n")
	f.Close()
	writeFile(t, filepath.Join(src, "sessions", "new.json"), text(50000, 11), 0o644)
	os.Remove(filepath.Join(src, "sessions", "small.json"))

	p := filepath.Join(t.TempDir(), "reuse.sqfs")
	out, _ := os.Create(p)
	res, err := Pack(t.Context(), out, WithBase(os.DirFS(src), base), PackOptions{})
	out.Close()
	if err != nil {
		t.Fatal(err)
	}
	// Unchanged multi-block files: dup-of-big.json (3 blocks + short
	// block), random.bin, sparse.db's data blocks, exact-block.json.
	if res.ReusedBytes < 3*128<<10 {
		t.Errorf("ReusedBytes %d: unchanged files were recompressed", res.ReusedBytes)
	}
	want := scanTree(t, src)
	r := openFile(t, p)
	compareTrees(t, want, scanArchive(t, r), compareOpts{nsec: true, owners: true, dirMtime: true, devices: true})
	if err := r.Verify(t.Context()); err != nil {
		t.Fatal(err)
	}
	fresh, _ := packToFile(t, src, PackOptions{})
	compareTrees(t, scanArchive(t, openFile(t, fresh)), scanArchive(t, r), compareOpts{nsec: true, owners: true, dirMtime: true, devices: true})
	dir := filepath.Join(t.TempDir(), "x")
	run(t, unsquashfs, "-no-progress", "-d", dir, p)
	root := os.Geteuid() == 0
	compareTrees(t, want, scanTree(t, dir), compareOpts{owners: root, devices: root})
}

// Repacking a Reader (its files are BlockSources) copies every block and
// keeps owners, devices and hard links.
func TestRepackReader(t *testing.T) {
	src := makeTree(t)
	p, first := packToFile(t, src, PackOptions{})
	r := openFile(t, p)
	q := filepath.Join(t.TempDir(), "repack.sqfs")
	out, _ := os.Create(q)
	res, err := Pack(t.Context(), out, r, PackOptions{})
	out.Close()
	if err != nil {
		t.Fatal(err)
	}
	if res.ReusedBytes == 0 || res.DataBytes != first.DataBytes {
		t.Errorf("repack: reused %d of %d bytes (first pack read %d)", res.ReusedBytes, res.DataBytes, first.DataBytes)
	}
	compareTrees(t, scanArchive(t, r), scanArchive(t, openFile(t, q)), compareOpts{nsec: true, owners: true, dirMtime: true, devices: true})
	// Different compression: nothing can be copied, content still equal.
	q2 := filepath.Join(t.TempDir(), "gz.sqfs")
	out, _ = os.Create(q2)
	res, err = Pack(t.Context(), out, r, PackOptions{Compression: Gzip})
	out.Close()
	if err != nil || res.ReusedBytes != 0 {
		t.Fatalf("gzip repack: reused %d, %v", res.ReusedBytes, err)
	}
	compareTrees(t, scanArchive(t, r), scanArchive(t, openFile(t, q2)), compareOpts{nsec: true, owners: true, dirMtime: true, devices: true})
}

// A damaged block in the base archive fails the pack instead of being
// copied into the new archive.
func TestReuseChecksBaseBlocks(t *testing.T) {
	src := makeTree(t)
	orig, _ := packToFile(t, src, PackOptions{})
	p := copyFile(t, orig)
	r0 := openFile(t, p)
	_, off, word := fileBlock(t, r0, "random.bin", 0)
	flipAt(t, p, int64(off)+int64(word&^dataUncompBit)/2)
	r := openFile(t, p)
	q := filepath.Join(t.TempDir(), "out.sqfs")
	out, _ := os.Create(q)
	defer out.Close()
	_, err := Pack(t.Context(), out, r, PackOptions{})
	wantCorrupt(t, err, off, "data block")
}

// Small files share fragment blocks; a fragment block whose files are
// still mostly there is copied whole, one that is mostly stale is not.
func TestReuseFragments(t *testing.T) {
	src := filepath.Join(t.TempDir(), "tree")
	const n = 60 // 10 KB each: about 12 files per 128 KiB fragment block
	name := func(i int) string { return filepath.Join(src, "cron", fmt.Sprintf("out-%03d.md", i)) }
	for i := range n {
		writeFile(t, name(i), text(10000, i), 0o644)
	}
	basePath, _ := packToFile(t, src, PackOptions{})
	base := openFile(t, basePath)

	repack := func() (string, PackResult) {
		t.Helper()
		p := filepath.Join(t.TempDir(), "next.sqfs")
		f, _ := os.Create(p)
		defer f.Close()
		res, err := Pack(t.Context(), f, WithBase(os.DirFS(src), base), PackOptions{})
		if err != nil {
			t.Fatal(err)
		}
		return p, res
	}
	check := func(p string) {
		t.Helper()
		r := openFile(t, p)
		compareTrees(t, scanTree(t, src), scanArchive(t, r), compareOpts{nsec: true})
		if err := r.Verify(t.Context()); err != nil {
			t.Fatal(err)
		}
	}

	// Unchanged: every fragment block is copied, the archive is the same.
	p, res := repack()
	check(p)
	if res.ReusedBytes != n*10000 {
		t.Errorf("unchanged tree: reused %d bytes, want %d", res.ReusedBytes, n*10000)
	}
	a, _ := os.ReadFile(basePath)
	b, _ := os.ReadFile(p)
	if string(a) != string(b) {
		t.Error("repacking an unchanged tree with its own archive as base changed the bytes")
	}

	// One file changed, one gone: their blocks' neighbours are reused,
	// the changed file is packed anew.
	writeFile(t, name(3), text(10000, 1000), 0o644)
	os.Remove(name(30))
	p, res = repack()
	check(p)
	if res.ReusedBytes < (n-2-12)*10000 {
		t.Errorf("one change: reused only %d bytes", res.ReusedBytes)
	}
	fresh, _ := packToFile(t, src, PackOptions{})
	fs1, _ := os.Stat(fresh)
	fs2, _ := os.Stat(p)
	if fs2.Size() > fs1.Size()*13/10 {
		t.Errorf("reusing archive is %d bytes, a fresh one %d", fs2.Size(), fs1.Size())
	}

	// Most files gone: copying their blocks would mostly copy stale bytes.
	for i := range n {
		if i%4 != 0 {
			os.Remove(name(i))
		}
	}
	p, res = repack()
	check(p)
	if res.ReusedBytes != 0 {
		t.Errorf("mostly stale fragment blocks were copied: reused %d bytes", res.ReusedBytes)
	}
}
