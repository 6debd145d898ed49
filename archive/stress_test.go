package archive

import (
	"context"
	"fmt"
	iofs "io/fs"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"syscall"
	"testing"
	"time"
)

// The stress tree: stressFiles files of stressBlocks blocks and a tail,
// one in stressEvery rewritten by stressChange, the others unchanged (their
// blocks are copied from the base), plus every other kind of content.
const (
	stressBS     = 16 << 10
	stressFiles  = 32
	stressBlocks = 4
	stressEvery  = 8
	// stressBudget bounds the rounds after the first: TestPackStress
	// packs every configuration once, then again while the budget lasts.
	stressBudget = 3 * time.Second
)

// stressText returns n bytes of deterministic, compressible text, quickly.
func stressText(n, seed int) []byte {
	words := []string{"session ", "memory ", "agent ", "tool_call ", "result ", "{\"role\": ", "user ", "hermes\n"}
	b := make([]byte, 0, n+32)
	for i := 0; len(b) < n; i++ {
		b = append(b, words[(i*7+seed+i/13)%len(words)]...)
		b = strconv.AppendInt(b, int64((i*seed)%997), 10)
		b = append(b, ' ')
	}
	return b[:n]
}

// stressTree writes, under dir, a tree whose pack takes every path of the
// packer's pipeline: blocks to compress (text) and to store as they are
// (noise), small files for fragments, files longer than a block with a
// short last block, duplicates of big and small files, holes the
// filesystem reports and all-zero blocks written out, an empty file, and
// hard links. Its files come in the data order interleaved so that, once
// changed (stressChange), blocks copied from a base and blocks compressed
// anew are in the pipeline together.
func stressTree(t *testing.T, dir string) {
	t.Helper()
	bs := stressBS
	for i := range stressFiles {
		writeFile(t, filepath.Join(dir, "data", fmt.Sprintf("f%02d.bin", i)), stressText(stressBlocks*bs+100+i, i+1), 0o644)
	}
	for i := range 2 {
		writeFile(t, filepath.Join(dir, "data", fmt.Sprintf("n%02d.bin", i)), noise(3*bs+7, byte(i+1)), 0o644)
	}
	db := stressDB(bs, 9)
	writeFile(t, filepath.Join(dir, "db", "state.db"), db, 0o644)
	writeFile(t, filepath.Join(dir, "db", "state-copy.db"), db, 0o644)
	for i := range 40 {
		b := stressText(100+i*(bs-200)/40, i+7)
		if i%10 == 9 {
			b = stressText(100, 7) // a duplicate of s000
		}
		writeFile(t, filepath.Join(dir, "sessions", fmt.Sprintf("s%03d.json", i)), b, 0o644)
	}
	if err := os.Link(filepath.Join(dir, "sessions", "s001.json"), filepath.Join(dir, "s001.link")); err != nil {
		t.Fatal(err)
	}
	f, err := os.Create(filepath.Join(dir, "sparse.db"))
	if err != nil {
		t.Fatal(err)
	}
	f.WriteAt(stressText(bs, 3), int64(2*bs))
	f.WriteAt(stressText(bs/2, 4), int64(5*bs))
	f.Truncate(int64(8*bs + 50))
	f.Close()
	zeros := append(make([]byte, 2*bs), stressText(bs, 5)...)
	writeFile(t, filepath.Join(dir, "zeros.bin"), append(zeros, make([]byte, bs+9)...), 0o644)
	writeFile(t, filepath.Join(dir, "empty"), nil, 0o644)
}

// stressDB is a database-like file of n blocks, compressible and not by
// turns.
func stressDB(bs, n int) []byte {
	var b []byte
	for i := range n {
		if i%3 == 2 {
			b = append(b, noise(bs, byte(50+i))...)
		} else {
			b = append(b, stressText(bs, 50+i)...)
		}
	}
	return b
}

// stressChange changes the tree as a session does: some big files
// rewritten, a database changed in a few blocks and grown, a copy of its
// old content, sessions deleted, rewritten and added, a hole filled.
func stressChange(t *testing.T, dir string) {
	t.Helper()
	bs := stressBS
	for i := 1; i < stressFiles; i += stressEvery {
		writeFile(t, filepath.Join(dir, "data", fmt.Sprintf("f%02d.bin", i)), stressText(stressBlocks*bs+100+i, i+100), 0o644)
	}
	old, err := os.ReadFile(filepath.Join(dir, "db", "state.db"))
	if err != nil {
		t.Fatal(err)
	}
	db := append([]byte(nil), old...)
	copy(db[3*bs+10:], noise(500, 9))
	copy(db[7*bs:], stressText(bs, 99))
	db = append(db, stressText(bs+bs/2, 98)...)
	writeFile(t, filepath.Join(dir, "db", "state.db"), db, 0o644)
	writeFile(t, filepath.Join(dir, "db", "state-backup.db"), old, 0o644)
	for i := 10; i < 16; i++ {
		os.Remove(filepath.Join(dir, "sessions", fmt.Sprintf("s%03d.json", i)))
	}
	for i := 20; i < 26; i++ {
		writeFile(t, filepath.Join(dir, "sessions", fmt.Sprintf("s%03d.json", i)), stressText(300+i*50, i+200), 0o644)
	}
	for i := range 12 {
		writeFile(t, filepath.Join(dir, "sessions", fmt.Sprintf("t%03d.json", i)), stressText(200+i*97, i+300), 0o644)
	}
	f, err := os.OpenFile(filepath.Join(dir, "sparse.db"), os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	f.WriteAt(stressText(bs, 6), int64(7*bs))
	f.Close()
	writeFile(t, filepath.Join(dir, "data", "new.bin"), stressText(3*bs+3, 400), 0o644)
}

// stressSums is the content sum of every regular file of the tree at
// dir, by path, as Pack computes it with stressBS blocks.
func stressSums(t *testing.T, dir string) map[string]sum {
	t.Helper()
	out := map[string]sum{}
	buf := make([]byte, stressBS)
	err := filepath.WalkDir(dir, func(p string, d iofs.DirEntry, err error) error {
		if err != nil || !d.Type().IsRegular() {
			return err
		}
		f, err := os.Open(p)
		if err != nil {
			return err
		}
		defer f.Close()
		fi, err := f.Stat()
		if err != nil {
			return err
		}
		s, _, err := sumStream(f, fi.Size(), stressBS, buf)
		rel, _ := filepath.Rel(dir, p)
		out[rel] = s
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// checkStressArchive checks the archive r of the tree described by want
// (metadata) and sums (content) without reading file content again:
// Verify has checked every block and every file against the sums the
// archive records, so a recorded sum equal to the source file's sum
// means equal content.
func checkStressArchive(t *testing.T, what string, r *Reader, want map[string]entryInfo, sums map[string]sum) {
	t.Helper()
	seen := 0
	var walk func(ino Inode, rel string)
	walk = func(ino Inode, rel string) {
		a, err := r.Stat(ino)
		if err != nil {
			t.Fatalf("%s: %s: %v", what, rel, err)
		}
		w, ok := want[rel]
		seen++
		switch {
		case !ok:
			t.Fatalf("%s: %s: not in the tree", what, rel)
		case a.Mode != w.mode || !a.Mtime.Equal(w.mtime) || a.Uid != w.uid || a.Gid != w.gid:
			t.Fatalf("%s: %s: %v %v %d:%d, want %v %v %d:%d", what, rel, a.Mode, a.Mtime, a.Uid, a.Gid, w.mode, w.mtime, w.uid, w.gid)
		case a.Mode.IsRegular() && (a.Size != w.size || r.fileSumOf(ino) != sums[rel]):
			t.Fatalf("%s: %s: content differs from the tree's (size %d, want %d)", what, rel, a.Size, w.size)
		}
		if a.Mode.IsDir() {
			ents, err := r.ReadDir(ino)
			if err != nil {
				t.Fatalf("%s: %s: %v", what, rel, err)
			}
			for _, e := range ents {
				walk(e.Ino, filepath.Join(rel, e.Name))
			}
		}
	}
	walk(r.Root(), ".")
	if seen != len(want) {
		t.Fatalf("%s: %d entries, the tree has %d", what, seen, len(want))
	}
}

// TestPackStress packs a changed tree every way Pack can, again and again
// with several workers: afresh; on a base that records content sums
// (appending to it, compacting, and its blocks copied into a new layout)
// and on one that records none (the same three). Every archive is checked
// with its own verifier (checksums, every block's and every file's
// content sum) and against the tree; the copy map against the base; and,
// for the first round, with the real unsquashfs. The pipeline's workers
// hand buffers to one another: a sum taken from a buffer another worker
// is already reusing is wrong only when the two happen to overlap, so
// the packs run with more goroutines than cores, which the kernel then
// interleaves at any instruction. HERMESFS_STRESS_ROUNDS=N runs N rounds
// whatever they take.
func TestPackStress(t *testing.T) {
	unsquashfs := needTool(t, "unsquashfs")
	defer runtime.GOMAXPROCS(runtime.GOMAXPROCS(max(8, runtime.NumCPU())))
	dir := filepath.Join(t.TempDir(), "tree")
	stressTree(t, dir)
	// Two bases: one as archives were before they recorded sums, and the
	// same tree with sums, learnt by copying the first one's blocks: a
	// pack that compresses nothing, of the kind this test is about, and
	// cheap, so it is made a few times.
	var bases [2]string // without sums, with sums
	bases[0], _ = packToFile(t, dir, PackOptions{BlockSize: stressBS, Level: 1, noSums: true})
	noSums := openFile(t, bases[0])
	if noSums.hasSums() {
		t.Fatal("a base packed without sums records sums")
	}
	if err := noSums.Verify(t.Context()); err != nil {
		t.Fatal(err)
	}
	var withSums *Reader
	for i, workers := range []int{8, 2, 8, 3} {
		bases[1] = filepath.Join(t.TempDir(), "sums.sqfs")
		what := fmt.Sprintf("base with sums, copy %d, %d workers", i, workers)
		if _, err := packInto(t.Context(), bases[1], WithBase(os.DirFS(dir), noSums), PackOptions{BlockSize: stressBS, Level: 1, Workers: workers}); err != nil {
			t.Fatalf("%s: %v", what, err)
		}
		withSums = openFile(t, bases[1])
		if !withSums.hasSums() {
			t.Fatalf("%s records no sums", what)
		}
		if err := withSums.Verify(t.Context()); err != nil {
			t.Fatalf("%s: %v", what, err)
		}
	}
	stressChange(t, dir)
	want, sums := scanTree(t, dir), stressSums(t, dir)

	type config struct {
		name     string
		base     int  // BlockSource of unchanged files: 0 none, 1 base without sums, 2 with
		asBase   bool // and PackOptions.Base
		compact  bool // MaxGarbage < 0
		wantBase BaseUse
	}
	configs := []config{{name: "afresh"}}
	for b := 1; b <= 2; b++ {
		name := [3]string{1: "nosums", 2: "sums"}[b]
		configs = append(configs,
			config{name: name + "-copy", base: b},
			config{name: name + "-append", base: b, asBase: true, wantBase: BaseAppended},
			config{name: name + "-compact", base: b, asBase: true, compact: true, wantBase: BaseCompacted})
	}
	readers := [3]*Reader{nil, noSums, withSums}

	rounds, minRounds := 1<<20, 1
	if s := os.Getenv("HERMESFS_STRESS_ROUNDS"); s != "" {
		n, err := strconv.Atoi(s)
		if err != nil || n < 1 {
			t.Fatalf("HERMESFS_STRESS_ROUNDS=%q: want a positive number", s)
		}
		rounds, minRounds = n, n
	}
	p := filepath.Join(t.TempDir(), "n.sqfs")
	start := time.Now()
	packs := 0
	for round := 0; round < rounds && (round < minRounds || time.Since(start) < stressBudget); round++ {
		workers := []int{8, 2, 4, 3}[round%4]
		for _, c := range configs {
			if round > 0 && c.base == 0 {
				continue // nothing but compression: once is enough
			}
			var src iofs.FS = os.DirFS(dir)
			opts := PackOptions{BlockSize: stressBS, Level: 1, Workers: workers}
			if c.base > 0 {
				src = WithBase(src, readers[c.base])
			}
			if c.asBase {
				opts.Base = readers[c.base]
			}
			if c.compact {
				opts.MaxGarbage = -1
			}
			what := fmt.Sprintf("round %d, %s, %d workers", round, c.name, workers)
			res, err := packInto(t.Context(), p, src, opts)
			if err != nil {
				t.Fatalf("%s: %v", what, err)
			}
			packs++
			if res.Base != c.wantBase || (c.base > 0 && res.ReusedBytes == 0) {
				t.Fatalf("%s: base used as %q, %d bytes reused", what, res.Base, res.ReusedBytes)
			}
			if c.asBase {
				checkCopies(t, p, bases[c.base-1], res)
			}
			f, err := os.Open(p)
			if err != nil {
				t.Fatal(err)
			}
			r, err := Open(f, res.Size, ReaderOptions{Name: what})
			if err == nil {
				err = r.Verify(t.Context())
			}
			if err != nil {
				f.Close()
				t.Fatal(err)
			}
			checkStressArchive(t, what, r, want, sums)
			f.Close()
			if round == 0 {
				out := filepath.Join(t.TempDir(), "x")
				run(t, unsquashfs, "-no-progress", "-d", out, p)
				compareTrees(t, want, scanTree(t, out), compareOpts{owners: syscall.Geteuid() == 0})
				if t.Failed() {
					t.FailNow()
				}
			}
		}
	}
	t.Logf("%d packs in %v", packs, time.Since(start).Round(time.Millisecond))
}

// packInto packs src into a new file at p (replacing what is there).
func packInto(ctx context.Context, p string, src iofs.FS, opts PackOptions) (PackResult, error) {
	f, err := os.Create(p)
	if err != nil {
		return PackResult{}, err
	}
	defer f.Close()
	return Pack(ctx, f, src, opts)
}
