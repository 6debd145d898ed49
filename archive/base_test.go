package archive

import (
	"bytes"
	"errors"
	"fmt"
	iofs "io/fs"
	"math/rand/v2"
	"os"
	"path/filepath"
	"testing"
	"testing/fstest"
	"time"
)

// packBase packs src into a new file with opts (Base set by the caller)
// and checks the result against the file.
func packBase(t *testing.T, src iofs.FS, opts PackOptions) (string, PackResult) {
	t.Helper()
	p := filepath.Join(t.TempDir(), "n.sqfs")
	f, err := os.Create(p)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	res, err := Pack(t.Context(), f, src, opts)
	if err != nil {
		t.Fatal(err)
	}
	if st, _ := f.Stat(); st.Size() != res.Size {
		t.Fatalf("PackResult.Size %d, file has %d bytes", res.Size, st.Size())
	}
	return p, res
}

// checkCopies checks that every range of the copy map really holds the
// same bytes in the new archive and the base, and that the ranges are
// ordered, disjoint, merged and add up to CopiedBytes.
func checkCopies(t *testing.T, newPath, basePath string, res PackResult) {
	t.Helper()
	n, _ := os.ReadFile(newPath)
	b, _ := os.ReadFile(basePath)
	var total, end int64
	for i, c := range res.Copies {
		if c.Length <= 0 || c.Offset < end || c.Offset+c.Length > int64(len(n)) || c.BaseOffset < 0 || c.BaseOffset+c.Length > int64(len(b)) {
			t.Fatalf("copy %d %+v out of order or out of bounds (new %d bytes, base %d)", i, c, len(n), len(b))
		}
		if i > 0 {
			p := res.Copies[i-1]
			if p.Offset+p.Length == c.Offset && p.BaseOffset+p.Length == c.BaseOffset {
				t.Errorf("copies %d and %d are adjacent on both sides but not merged", i-1, i)
			}
		}
		if !bytes.Equal(n[c.Offset:c.Offset+c.Length], b[c.BaseOffset:c.BaseOffset+c.Length]) {
			t.Fatalf("copy %d %+v: bytes differ", i, c)
		}
		total += c.Length
		end = c.Offset + c.Length
	}
	if total != res.CopiedBytes {
		t.Errorf("copies add up to %d bytes, CopiedBytes %d", total, res.CopiedBytes)
	}
	if res.Base == BaseAppended && res.SharedBytes > 0 {
		if len(res.Copies) == 0 || res.Copies[0].Offset != superblockSize || res.Copies[0].BaseOffset != superblockSize ||
			res.Copies[0].Length < res.SharedBytes {
			t.Errorf("appended archive: first copy %+v does not cover the %d shared bytes", res.Copies, res.SharedBytes)
		}
	}
}

// A duplicate of an unchanged file is neither read nor recompressed when
// packing on a base, and counts as reused like the file it duplicates.
func TestReuseCountsDuplicates(t *testing.T) {
	src := filepath.Join(t.TempDir(), "tree")
	db := text(5*128<<10+999, 7)
	writeFile(t, filepath.Join(src, "state.db"), db, 0o644)
	writeFile(t, filepath.Join(src, "state-snapshots", "state-1.db"), db, 0o644)
	writeFile(t, filepath.Join(src, "small.json"), text(3000, 1), 0o644)
	writeFile(t, filepath.Join(src, "small-copy.json"), text(3000, 1), 0o644)
	basePath, _ := packToFile(t, src, PackOptions{})
	base := openFile(t, basePath)
	for _, o := range []PackOptions{{}, {Base: base}} {
		_, res := packBase(t, WithBase(os.DirFS(src), base), o)
		if res.ReusedBytes != res.DataBytes {
			t.Errorf("base %v: reused %d of %d bytes of an unchanged tree", o.Base != nil, res.ReusedBytes, res.DataBytes)
		}
	}
}

// Packing on a base appends: the new archive starts with the base's data
// region, unchanged files point into it, a copy of a file or a file
// written back unchanged costs nothing, and a changed file's unchanged
// blocks are copied rather than compressed. The result is a standard,
// self-contained archive that every reader reads as the tree.
func TestAppendToBase(t *testing.T) {
	unsquashfs := needTool(t, "unsquashfs")
	src := makeTree(t)
	bs := 128 << 10
	db := noise(10*bs, 3)
	writeFile(t, filepath.Join(src, "state.db"), db, 0o644)
	basePath, _ := packToFile(t, src, PackOptions{})
	base := openFile(t, basePath)

	// Change one block of the database, grow it; a copy of it appears.
	copy(db[7*bs+100:], noise(5000, 9))
	db = append(db, noise(bs+17, 10)...)
	writeFile(t, filepath.Join(src, "state.db"), db, 0o644)
	writeFile(t, filepath.Join(src, "state-snapshots", "state-2.db"), db, 0o644)
	// The same content written back (new mtime: not a BlockSource).
	b, _ := os.ReadFile(filepath.Join(src, "random.bin"))
	writeFile(t, filepath.Join(src, "random.bin"), b, 0o644)
	f, _ := os.OpenFile(filepath.Join(src, "logs", "agent.log"), os.O_APPEND|os.O_WRONLY, 0)
	f.WriteString("one more line\n")
	f.Close()
	os.Remove(filepath.Join(src, "sessions", "small.json"))
	writeFile(t, filepath.Join(src, "sessions", "new.json"), text(50000, 11), 0o644)
	if err := os.Rename(filepath.Join(src, "bin"), filepath.Join(src, "tools")); err != nil {
		t.Fatal(err)
	}

	// The database is most of this tree, so its old blocks are most of the
	// garbage: allow it, to append.
	p, res := packBase(t, WithBase(os.DirFS(src), base), PackOptions{Base: base, MaxGarbage: 0.7})
	if res.Base != BaseAppended || res.SharedBytes < int64(5*bs) {
		t.Fatalf("not appended: %+v", res)
	}
	checkCopies(t, p, basePath, res)
	// What is new: the changed block, the growth, the log's last block
	// and the small files; nowhere near the two copies of the database.
	if fresh := res.Size - res.CopiedBytes; fresh > int64(3*bs+256<<10) {
		t.Errorf("%d of %d bytes are not copies of the base", fresh, res.Size)
	}

	want := scanTree(t, src)
	r := openFile(t, p)
	all := compareOpts{nsec: true, owners: true, dirMtime: true, devices: true}
	compareTrees(t, want, scanArchive(t, r), all)
	if err := r.Verify(t.Context()); err != nil {
		t.Fatal(err)
	}
	freshPath, _ := packToFile(t, src, PackOptions{})
	compareTrees(t, scanArchive(t, openFile(t, freshPath)), scanArchive(t, r), all)
	dir := filepath.Join(t.TempDir(), "x")
	run(t, unsquashfs, "-no-progress", "-d", dir, p)
	root := os.Geteuid() == 0
	compareTrees(t, want, scanTree(t, dir), compareOpts{owners: root, devices: root})
	checkGoDiskfs(t, p, want)
	t.Run("kernel", func(t *testing.T) {
		compareTrees(t, want, scanTree(t, kernelMount(t, p)), compareOpts{owners: true, dirMtime: true, devices: true})
	})
	// Deleting the base changes nothing: the archive stands alone.
	os.Remove(basePath)
	compareTrees(t, want, scanArchive(t, openFile(t, p)), all)
}

// testing/fstest finds nothing wrong with an appended archive.
func TestAppendFSTest(t *testing.T) {
	src := filepath.Join(t.TempDir(), "tree")
	writeFile(t, filepath.Join(src, "state.db"), noise(5*128<<10, 1), 0o644)
	writeFile(t, filepath.Join(src, "a", "one.json"), text(3000, 1), 0o644)
	writeFile(t, filepath.Join(src, "a", "two.json"), text(200, 2), 0o644)
	writeFile(t, filepath.Join(src, "b", "c", "three.md"), text(140000, 3), 0o644)
	os.Symlink("a/one.json", filepath.Join(src, "link"))
	basePath, _ := packToFile(t, src, PackOptions{})
	base := openFile(t, basePath)
	f, _ := os.OpenFile(filepath.Join(src, "state.db"), os.O_WRONLY, 0)
	f.WriteAt(noise(100, 2), 200000)
	f.Close()
	os.Remove(filepath.Join(src, "a", "two.json"))
	writeFile(t, filepath.Join(src, "b", "new.json"), text(5000, 4), 0o644)
	p, res := packBase(t, WithBase(os.DirFS(src), base), PackOptions{Base: base, MaxGarbage: 0.9})
	if res.Base != BaseAppended {
		t.Fatalf("not appended: %s", res.Base)
	}
	names := []string{"state.db", "a", "a/one.json", "b", "b/c", "b/c/three.md", "b/new.json", "link"}
	if err := fstest.TestFS(openFile(t, p).FS(), names...); err != nil {
		t.Fatal(err)
	}
}

// A file that is unchanged content of another archive (the lower layer of
// a view, when the base is the last snapshot made of it) is found in the
// base by its content sum and points into the shared prefix.
func TestAppendFindsOtherArchivesContent(t *testing.T) {
	src := makeTree(t)
	writeFile(t, filepath.Join(src, "state.db"), noise(9*128<<10, 4), 0o644)
	lowerPath, _ := packToFile(t, src, PackOptions{})
	lower := openFile(t, lowerPath)
	// The first snapshot: the lower layer with a change, on the lower.
	writeFile(t, filepath.Join(src, "sessions", "new.json"), text(70000, 5), 0o644)
	s1Path, res := packBase(t, WithBase(os.DirFS(src), lower), PackOptions{Base: lower})
	if res.Base != BaseAppended {
		t.Fatalf("first snapshot not appended: %+v", res)
	}
	s1 := openFile(t, s1Path)
	// The second: the unchanged files are still the lower layer's, the
	// base is the first snapshot.
	s2Path, res := packBase(t, WithBase(os.DirFS(src), lower), PackOptions{Base: s1})
	if res.Base != BaseAppended || res.ReusedBytes != res.DataBytes {
		t.Errorf("second snapshot: %s, reused %d of %d bytes", res.Base, res.ReusedBytes, res.DataBytes)
	}
	checkCopies(t, s2Path, s1Path, res)
	if fresh := res.Size - res.CopiedBytes; fresh > 64<<10 {
		t.Errorf("an unchanged tree wrote %d new bytes", fresh)
	}
	r := openFile(t, s2Path)
	compareTrees(t, scanTree(t, src), scanArchive(t, r), compareOpts{nsec: true, owners: true, dirMtime: true, devices: true})
	if err := r.Verify(t.Context()); err != nil {
		t.Fatal(err)
	}
}

// Ten snapshots in a row, each on the one before, with random changes:
// every one reads as its tree and verifies, and garbage never grows past
// the limit: the pack compacts instead.
func TestSnapshotChain(t *testing.T) {
	unsquashfs := needTool(t, "unsquashfs")
	rng := rand.New(rand.NewPCG(1, 2))
	src := filepath.Join(t.TempDir(), "tree")
	bs := 16 << 10
	// The database is about a quarter of the data, as in a Hermes home
	// (noise: the sizes stay what they are, compressed).
	db := noise(24*bs, 1)
	writeFile(t, filepath.Join(src, "state.db"), db, 0o644)
	session := func(i int) []byte {
		return append(text(500+rng.IntN(2*bs), i), noise(rng.IntN(3*bs), byte(i))...)
	}
	for i := range 40 {
		writeFile(t, filepath.Join(src, "sessions", fmt.Sprintf("s%02d.json", i)), session(i), 0o644)
	}
	opts := PackOptions{BlockSize: bs, MaxGarbage: 0.3}
	prevPath, _ := packToFile(t, src, opts)
	uses := map[BaseUse]int{}
	when := time.Date(2026, 5, 1, 0, 0, 0, 0, time.UTC)
	for round := range 10 {
		touched := func(p string) {
			when = when.Add(time.Second + 7)
			os.Chtimes(p, when, when)
		}
		// The database: a few pages rewritten, sometimes grown.
		for range 1 + rng.IntN(3) {
			off := rng.IntN(len(db) - 4096)
			copy(db[off:], noise(4096, byte(rng.IntN(256))))
		}
		if rng.IntN(2) == 0 {
			db = append(db, noise(bs/2+rng.IntN(bs), byte(round))...)
		}
		writeFile(t, filepath.Join(src, "state.db"), db, 0o644)
		touched(filepath.Join(src, "state.db"))
		if round%3 == 0 {
			// Hermes keeps copies of the database.
			p := filepath.Join(src, "state-snapshots", fmt.Sprintf("state-%d.db", round))
			writeFile(t, p, db, 0o644)
			touched(p)
		}
		for range 4 {
			i := rng.IntN(50)
			p := filepath.Join(src, "sessions", fmt.Sprintf("s%02d.json", i))
			if rng.IntN(4) == 0 {
				os.Remove(p)
				continue
			}
			writeFile(t, p, session(i+100*round), 0o644)
			touched(p)
		}
		if round == 6 {
			// Most of the old data goes: the next pack must compact.
			os.RemoveAll(filepath.Join(src, "state-snapshots"))
			db = noise(24*bs, 99)
			writeFile(t, filepath.Join(src, "state.db"), db, 0o644)
			touched(filepath.Join(src, "state.db"))
		}
		prev := openFile(t, prevPath)
		p, res := packBase(t, WithBase(os.DirFS(src), prev), PackOptions{BlockSize: bs, MaxGarbage: 0.3, Base: prev})
		uses[res.Base]++
		t.Logf("round %d: %s, %d bytes, %d copied, %d garbage", round, res.Base, res.Size, res.CopiedBytes, res.GarbageBytes)
		// The limit is weighed on an estimate of the new data; it holds
		// within a margin.
		if res.Base == BaseAppended && float64(res.GarbageBytes) > 0.4*float64(res.Size) {
			t.Errorf("round %d: %d bytes of garbage in a %d-byte archive", round, res.GarbageBytes, res.Size)
		}
		if res.Base == BaseCompacted && res.GarbageBytes != 0 {
			t.Errorf("round %d: compacted archive reports %d bytes of garbage", round, res.GarbageBytes)
		}
		checkCopies(t, p, prevPath, res)
		r := openFile(t, p)
		want := scanTree(t, src)
		compareTrees(t, want, scanArchive(t, r), compareOpts{nsec: true, owners: true, dirMtime: true})
		if err := r.Verify(t.Context()); err != nil {
			t.Fatalf("round %d: %v", round, err)
		}
		if round%3 == 2 || res.Base == BaseCompacted {
			dir := filepath.Join(t.TempDir(), "x")
			run(t, unsquashfs, "-no-progress", "-d", dir, p)
			compareTrees(t, want, scanTree(t, dir), compareOpts{})
		}
		prevPath = p
	}
	if uses[BaseAppended] < 4 || uses[BaseCompacted] < 1 {
		t.Errorf("packs: %v; want mostly appended and at least one compaction", uses)
	}
}

// A base written before archives recorded content sums is appended to all
// the same, and the new archive records the sums it lacked.
func TestAppendToBaseWithoutSums(t *testing.T) {
	src := makeTree(t)
	writeFile(t, filepath.Join(src, "state.db"), noise(6*128<<10, 8), 0o644)
	basePath, _ := packToFile(t, src, PackOptions{noSums: true})
	base := openFile(t, basePath)
	if base.hasSums() {
		t.Fatal("noSums archive records sums")
	}
	writeFile(t, filepath.Join(src, "sessions", "new.json"), text(7000, 5), 0o644)
	p, res := packBase(t, WithBase(os.DirFS(src), base), PackOptions{Base: base})
	if res.Base != BaseAppended || res.ReusedBytes < res.DataBytes-7000 {
		t.Errorf("%s, reused %d of %d bytes", res.Base, res.ReusedBytes, res.DataBytes)
	}
	checkCopies(t, p, basePath, res)
	r := openFile(t, p)
	if err := r.Verify(t.Context()); err != nil {
		t.Fatal(err)
	}
	for _, e := range allEntries(t, r) {
		if e.Mode.IsRegular() && !r.fileSumOf(e.Ino).known() {
			t.Errorf("%s: no content sum recorded", e.Name)
		}
	}
	compareTrees(t, scanTree(t, src), scanArchive(t, r), compareOpts{nsec: true, owners: true, dirMtime: true, devices: true})

	// Blocks copied from it into a new archive (not appended: what
	// `hermesfs pack --base` does), stored uncompressed among them (the
	// noise), get their sums learnt from their content too.
	p2, res2 := packBase(t, WithBase(os.DirFS(src), base), PackOptions{})
	if res2.ReusedBytes == 0 {
		t.Errorf("nothing reused: %+v", res2)
	}
	r2 := openFile(t, p2)
	if err := r2.Verify(t.Context()); err != nil {
		t.Fatal(err)
	}
	for _, e := range allEntries(t, r2) {
		if e.Mode.IsRegular() && !r2.fileSumOf(e.Ino).known() {
			t.Errorf("copied into a new archive: %s: no content sum recorded", e.Name)
		}
	}
	compareTrees(t, scanTree(t, src), scanArchive(t, r2), compareOpts{nsec: true, owners: true, dirMtime: true, devices: true})
}

// Bases that cannot be appended to: blocks are still copied where the
// compression matches, never where it does not.
func TestBaseCompatibility(t *testing.T) {
	src := makeTree(t)
	writeFile(t, filepath.Join(src, "state.db"), noise(6*128<<10, 8), 0o644)
	for _, c := range []struct {
		base, opts PackOptions
		use        BaseUse
		copies     bool
	}{
		{PackOptions{Level: 5}, PackOptions{}, BaseCompacted, true},          // other compressor options
		{PackOptions{Compression: Gzip}, PackOptions{}, BaseUnused, false},   // other compression
		{PackOptions{BlockSize: 64 << 10}, PackOptions{}, BaseUnused, false}, // other block size
		{PackOptions{}, PackOptions{MaxGarbage: -1}, BaseCompacted, true},    // appending refused
	} {
		basePath, _ := packToFile(t, src, c.base)
		base := openFile(t, basePath)
		o := c.opts
		o.Base = base
		p, res := packBase(t, WithBase(os.DirFS(src), base), o)
		if res.Base != c.use || (res.CopiedBytes > 0) != c.copies {
			t.Errorf("base %+v, pack %+v: %q with %d bytes copied", c.base, c.opts, res.Base, res.CopiedBytes)
		}
		checkCopies(t, p, basePath, res)
		r := openFile(t, p)
		compareTrees(t, scanTree(t, src), scanArchive(t, r), compareOpts{nsec: true, owners: true, dirMtime: true, devices: true})
		if err := r.Verify(t.Context()); err != nil {
			t.Fatal(err)
		}
	}
}

// A damaged block in the base's data region fails the pack instead of
// being carried into the new archive, even a block no file uses.
func TestAppendChecksBase(t *testing.T) {
	src := makeTree(t)
	orig, _ := packToFile(t, src, PackOptions{})
	os.Remove(filepath.Join(src, "random.bin"))
	p := copyFile(t, orig)
	r0 := openFile(t, p)
	_, off, word := fileBlock(t, r0, "random.bin", 0)
	flipAt(t, p, int64(off)+int64(word&^dataUncompBit)/2)
	base := openFile(t, p)
	f, err := os.Create(filepath.Join(t.TempDir(), "n.sqfs"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	_, err = Pack(t.Context(), f, WithBase(os.DirFS(src), base), PackOptions{Base: base, MaxGarbage: 0.9})
	wantCorrupt(t, err, off, "data block")
	if !errors.Is(err, ErrCorrupt) {
		t.Fatalf("want ErrCorrupt, got %v", err)
	}
}

// A file the base holds although nothing says so (a database copied up
// by the overlay but not changed since the base) keeps its blocks alive:
// the pack appends instead of compacting, and the file costs nothing.
func TestAppendKeepsRewrittenContent(t *testing.T) {
	src := filepath.Join(t.TempDir(), "tree")
	db := noise(12*128<<10, 5)
	writeFile(t, filepath.Join(src, "state.db"), db, 0o644)
	writeFile(t, filepath.Join(src, "a.json"), text(9000, 1), 0o644)
	basePath, _ := packToFile(t, src, PackOptions{})
	base := openFile(t, basePath)
	writeFile(t, filepath.Join(src, "state.db"), db, 0o644) // new mtime, same bytes
	os.Chtimes(filepath.Join(src, "state.db"), time.Now(), time.Now().Add(time.Hour))
	writeFile(t, filepath.Join(src, "b.json"), text(5000, 2), 0o644)
	p, res := packBase(t, WithBase(os.DirFS(src), base), PackOptions{Base: base})
	if res.Base != BaseAppended || res.GarbageBytes != 0 || res.ReusedBytes < int64(len(db)) {
		t.Fatalf("%s, %d bytes of garbage, %d reused", res.Base, res.GarbageBytes, res.ReusedBytes)
	}
	if fresh := res.Size - res.CopiedBytes; fresh > 64<<10 {
		t.Errorf("%d new bytes for a new small file", fresh)
	}
	checkCopies(t, p, basePath, res)
	r := openFile(t, p)
	compareTrees(t, scanTree(t, src), scanArchive(t, r), compareOpts{nsec: true})
	if err := r.Verify(t.Context()); err != nil {
		t.Fatal(err)
	}
}

// A base with an empty data region and no compressor options (nothing but
// directories, stored uncompressed) is appended to with no copy range at
// all, not an empty one.
func TestAppendToEmptyBase(t *testing.T) {
	src := t.TempDir()
	if err := os.MkdirAll(filepath.Join(src, "a", "b"), 0o755); err != nil {
		t.Fatal(err)
	}
	basePath, _ := packToFile(t, src, PackOptions{Compression: None})
	base := openFile(t, basePath)
	writeFile(t, filepath.Join(src, "a", "new.txt"), text(5000, 1), 0o644)
	p, res := packBase(t, WithBase(os.DirFS(src), base), PackOptions{Compression: None, Base: base})
	if res.Base != BaseAppended || res.SharedBytes != 0 || len(res.Copies) != 0 {
		t.Errorf("%s, %d shared bytes, copies %+v; want appended, nothing to copy", res.Base, res.SharedBytes, res.Copies)
	}
	checkCopies(t, p, basePath, res)
	compareTrees(t, scanTree(t, src), scanArchive(t, openFile(t, p)), compareOpts{nsec: true, owners: true, dirMtime: true, devices: true})
}
