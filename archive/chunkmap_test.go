package archive

import (
	"bytes"
	"fmt"
	"io"
	iofs "io/fs"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"sync"
	"testing"
)

const mapChunk = 64 << 10 // small chunks: many per archive, several per block

// mapTree writes a tree with fragments, multi-block files, a file of whole
// blocks, a sparse file and a database, and returns its path.
func mapTree(t *testing.T) string {
	t.Helper()
	bs := 128 << 10
	src := filepath.Join(t.TempDir(), "tree")
	writeFile(t, filepath.Join(src, "a", "notes.md"), text(3000, 1), 0o644)
	writeFile(t, filepath.Join(src, "a", "config.yaml"), text(700, 2), 0o644)
	writeFile(t, filepath.Join(src, "big.bin"), noise(5*bs+1234, 3), 0o644)
	writeFile(t, filepath.Join(src, "exact.bin"), noise(2*bs, 4), 0o644)
	writeFile(t, filepath.Join(src, "logs", "agent.log"), text(400000, 5), 0o644)
	writeFile(t, filepath.Join(src, "state.db"), noise(6*bs+99, 6), 0o644)
	writeFile(t, filepath.Join(src, "sparse.bin"), append(make([]byte, 2*bs), noise(100, 7)...), 0o644)
	for i := range 30 {
		writeFile(t, filepath.Join(src, "sessions", fmt.Sprintf("s%02d.json", i)), text(2000+i*300, 10+i), 0o644)
	}
	return src
}

// changeTree changes the tree the way a session does: the database is
// rewritten and grows, a file appears before everything else in name
// order, one is deleted.
func changeTree(t *testing.T, src string) {
	t.Helper()
	writeFile(t, filepath.Join(src, "state.db"), noise(7*128<<10+5, 60), 0o644)
	writeFile(t, filepath.Join(src, "0-new.bin"), noise(3*128<<10+77, 61), 0o644)
	if err := os.Remove(filepath.Join(src, "a", "config.yaml")); err != nil {
		t.Fatal(err)
	}
}

// regularFiles lists the archive's regular files by path.
func regularFiles(t *testing.T, r *Reader) map[string]Inode {
	t.Helper()
	out := map[string]Inode{}
	err := iofs.WalkDir(r.FS(), ".", func(p string, d iofs.DirEntry, err error) error {
		if err != nil || !d.Type().IsRegular() {
			return err
		}
		a, err := r.resolve("walk", p, false)
		out[p] = a.Ino
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// normalize turns ranges into each file's sorted, merged intervals.
func normalize(rs []FileRange) map[string][][2]int64 {
	by := map[string][][2]int64{}
	for _, fr := range rs {
		by[fr.Path] = append(by[fr.Path], [2]int64{fr.Off, fr.Off + fr.Len})
	}
	for p, iv := range by {
		sort.Slice(iv, func(i, j int) bool { return iv[i][0] < iv[j][0] })
		var m [][2]int64
		for _, x := range iv {
			if n := len(m); n > 0 && x[0] <= m[n-1][1] {
				m[n-1][1] = max(m[n-1][1], x[1])
				continue
			}
			m = append(m, x)
		}
		by[p] = m
	}
	return by
}

func overlapsChunk(e Extent, chunks []int64) bool {
	for _, c := range chunks {
		if c >= 0 && e.At < (c+1)*mapChunk && e.At+e.Size > c*mapChunk {
			return true
		}
	}
	return false
}

// chunkLog is an io.ReaderAt recording which chunks are read while on.
type chunkLog struct {
	ra  io.ReaderAt
	mu  sync.Mutex
	on  bool
	got map[int64]bool
}

func (l *chunkLog) ReadAt(p []byte, off int64) (int, error) {
	l.mu.Lock()
	if l.on && len(p) > 0 {
		for c := off / mapChunk; c <= (off+int64(len(p))-1)/mapChunk; c++ {
			l.got[c] = true
		}
	}
	l.mu.Unlock()
	return l.ra.ReadAt(p, off)
}

// checkMap maps chunks of the archive at aPath to file ranges, checks them
// against the files' extents, maps them into the archive at bPath (packed
// from src) and checks that reading those file bytes from it reads
// exactly the chunks FileChunks gave, and the right bytes.
func checkMap(t *testing.T, aPath, bPath, src string, chunks []int64) {
	t.Helper()
	a := openFile(t, aPath)
	ranges := ChunkFiles(a, mapChunk, chunks)
	if len(ranges) == 0 {
		t.Fatal("no file ranges for chunks holding data")
	}

	// The ranges are exactly the bytes of the blocks overlapping the chunks.
	var want []FileRange
	for p, ino := range regularFiles(t, a) {
		ext, err := a.Extents(ino)
		if err != nil {
			t.Fatal(err)
		}
		for _, e := range ext {
			if overlapsChunk(e, chunks) {
				want = append(want, FileRange{Path: p, Off: e.Off, Len: e.Len})
			}
		}
	}
	if got, w := normalize(ranges), normalize(want); fmt.Sprint(got) != fmt.Sprint(w) {
		t.Fatalf("ChunkFiles gave\n%v\nthe blocks overlapping the chunks hold\n%v", got, w)
	}
	// Merged, and in the chunks' order: the first range is data of the
	// first chunk.
	for i := 1; i < len(ranges); i++ {
		p, c := ranges[i-1], ranges[i]
		if p.Path == c.Path && p.Off+p.Len == c.Off {
			t.Errorf("ranges %d and %d (%+v, %+v) adjacent but not merged", i-1, i, p, c)
		}
	}
	first := ranges[0]
	ext, _ := a.Extents(regularFiles(t, a)[first.Path])
	in := false
	for _, e := range ext {
		if e.Off <= first.Off && first.Off < e.Off+e.Len && overlapsChunk(e, chunks[:1]) {
			in = true
		}
	}
	if !in {
		t.Errorf("first range %+v is not data of the first chunk %d", first, chunks[0])
	}

	// Into the second archive.
	f, err := os.Open(bPath)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	st, _ := f.Stat()
	log := &chunkLog{ra: f, got: map[int64]bool{}}
	b, err := Open(log, st.Size(), ReaderOptions{Name: "b"})
	if err != nil {
		t.Fatal(err)
	}
	hot := FileChunks(b, mapChunk, ranges, 0)
	if len(hot) == 0 {
		t.Fatal("no chunks in the second archive")
	}
	seen := map[int64]bool{}
	for _, c := range hot {
		if seen[c] || c < 0 || c*mapChunk >= st.Size() {
			t.Fatalf("chunk %d repeated or outside the archive in %v", c, hot)
		}
		seen[c] = true
	}
	log.mu.Lock()
	log.on = true
	log.mu.Unlock()
	read := 0
	for _, fr := range ranges {
		content, err := os.ReadFile(filepath.Join(src, fr.Path))
		if os.IsNotExist(err) {
			continue
		}
		if err != nil {
			t.Fatal(err)
		}
		if fr.Off >= int64(len(content)) {
			continue
		}
		end := min(fr.Off+fr.Len, int64(len(content)))
		bf, err := b.Open(fr.Path)
		if err != nil {
			t.Fatal(err)
		}
		got := make([]byte, end-fr.Off)
		if _, err := bf.(io.ReaderAt).ReadAt(got, fr.Off); err != nil && err != io.EOF {
			t.Fatal(err)
		}
		if !bytes.Equal(got, content[fr.Off:end]) {
			t.Fatalf("%s [%d, %d) read wrong", fr.Path, fr.Off, end)
		}
		read++
	}
	if read == 0 {
		t.Fatal("no range left to read in the second archive")
	}
	log.mu.Lock()
	gotChunks := slices.Sorted(func(yield func(int64) bool) {
		for c := range log.got {
			if !yield(c) {
				return
			}
		}
	})
	log.mu.Unlock()
	wantChunks := slices.Sorted(slices.Values(hot))
	if !slices.Equal(gotChunks, wantChunks) {
		t.Fatalf("reading the ranges from the second archive read chunks\n%v\nFileChunks gave\n%v", gotChunks, wantChunks)
	}
	if lim := FileChunks(b, mapChunk, ranges, 2); !slices.Equal(lim, hot[:2]) {
		t.Errorf("FileChunks with max 2 gave %v, want %v", lim, hot[:2])
	}
}

// pickChunks chooses chunks of the archive: the one holding a small
// file's fragment, one in the middle of a multi-block file, the first of
// the database, one of a compressible log, the last (metadata only), a
// repeat and a negative index.
func pickChunks(t *testing.T, r *Reader) []int64 {
	t.Helper()
	files := regularFiles(t, r)
	ext := func(p string, i int) Extent {
		e, err := r.Extents(files[p])
		if err != nil || len(e) == 0 {
			t.Fatalf("%s: extents %v, %v", p, e, err)
		}
		if i < 0 {
			i += len(e)
		}
		return e[i]
	}
	notes := ext("a/notes.md", 0)
	big := ext("big.bin", 2)
	db := ext("state.db", 0)
	log := ext("logs/agent.log", 1)
	last := (r.Size() - 1) / mapChunk
	return []int64{notes.At / mapChunk, (big.At + big.Size/2) / mapChunk, db.At / mapChunk, log.At / mapChunk, last, big.At / mapChunk, -1}
}

// Chunks of one archive map to the file bytes they hold, and those file
// bytes map to the chunks of a later archive of the changed tree that
// hold them — whether the later archive was packed afresh (everything
// moved), appended to the first or compacted from it.
func TestMapChunks(t *testing.T) {
	src := mapTree(t)
	aPath, _ := packToFile(t, src, PackOptions{})
	a := openFile(t, aPath)
	chunks := pickChunks(t, a)
	changeTree(t, src)

	t.Run("fresh", func(t *testing.T) {
		bPath, _ := packToFile(t, src, PackOptions{})
		checkMap(t, aPath, bPath, src, chunks)
	})
	t.Run("appended", func(t *testing.T) {
		bPath, res := packBase(t, WithBase(os.DirFS(src), a), PackOptions{Base: a, MaxGarbage: 0.9})
		if res.Base != BaseAppended {
			t.Fatalf("not appended: %+v", res.Base)
		}
		checkMap(t, aPath, bPath, src, chunks)
	})
	t.Run("compacted", func(t *testing.T) {
		bPath, res := packBase(t, WithBase(os.DirFS(src), a), PackOptions{Base: a, MaxGarbage: -1})
		if res.Base != BaseCompacted {
			t.Fatalf("not compacted: %+v", res.Base)
		}
		checkMap(t, aPath, bPath, src, chunks)
	})
}

// The edges: metadata-only chunks hold no file bytes; ranges of missing
// paths, of non-files and past a file's end give no chunks; sparse blocks
// have no extent; a file's extents cover it.
func TestMapChunksEdges(t *testing.T) {
	src := mapTree(t)
	p, _ := packToFile(t, src, PackOptions{})
	r := openFile(t, p)
	files := regularFiles(t, r)
	var dataEnd int64
	for _, ino := range files {
		ext, _ := r.Extents(ino)
		for _, e := range ext {
			dataEnd = max(dataEnd, e.At+e.Size)
		}
	}
	const small = 1024
	meta := (dataEnd + small - 1) / small
	if (meta+1)*small > r.Size() {
		t.Fatalf("no whole %d-byte chunk of metadata after the data (ends at %d of %d)", small, dataEnd, r.Size())
	}
	if got := ChunkFiles(r, small, []int64{meta, r.Size()/small + 5}); len(got) != 0 {
		t.Errorf("metadata and beyond-the-end chunks gave %v", got)
	}
	if got := ChunkFiles(r, small, []int64{meta - 1}); len(got) == 0 {
		t.Errorf("the chunk holding the end of the data gave no ranges")
	}
	if got := ChunkFiles(r, 0, []int64{0}); got != nil {
		t.Errorf("chunk size 0 gave %v", got)
	}
	bad := []FileRange{{Path: "missing", Len: 10}, {Path: "a", Len: 10}, {Path: "big.bin", Off: 1 << 30, Len: 10}, {Path: "big.bin", Off: 5, Len: 0}, {Path: "../x", Len: 1}}
	if got := FileChunks(r, mapChunk, bad, 0); len(got) != 0 {
		t.Errorf("ranges naming no file bytes gave %v", got)
	}
	sp, err := r.Extents(files["sparse.bin"])
	if err != nil {
		t.Fatal(err)
	}
	if len(sp) != 1 || sp[0].Off != 2*128<<10 || sp[0].Len != 100 {
		t.Errorf("sparse.bin extents %+v, want only its 100-byte tail", sp)
	}
	for path, ino := range files {
		a, _ := r.Stat(ino)
		ext, err := r.Extents(ino)
		if err != nil {
			t.Fatal(err)
		}
		var covered int64
		for _, e := range ext {
			if e.Size <= 0 || e.At < superblockSize || e.At+e.Size > r.Size() {
				t.Errorf("%s: extent %+v outside the archive", path, e)
			}
			covered += e.Len
		}
		if path != "sparse.bin" && covered != a.Size {
			t.Errorf("%s: extents cover %d of %d bytes", path, covered, a.Size)
		}
	}
	// A whole file maps to the chunks its extents overlap.
	e, _ := r.Extents(files["exact.bin"])
	got := FileChunks(r, mapChunk, []FileRange{{Path: "exact.bin", Len: 2 * 128 << 10}}, 0)
	var want []int64
	for _, x := range e {
		for c := x.At / mapChunk; c <= (x.At+x.Size-1)/mapChunk; c++ {
			if !slices.Contains(want, c) {
				want = append(want, c)
			}
		}
	}
	if !slices.Equal(got, want) {
		t.Errorf("exact.bin: chunks %v, want %v", got, want)
	}
}
