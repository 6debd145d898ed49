package lazy

import (
	"bytes"
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	iofs "io/fs"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/hermesfs/hermesfs/archive"
)

func TestHotRecorderStop(t *testing.T) {
	t.Parallel()
	data := bytes.Repeat([]byte{7}, 8*testChunk)
	h := NewHotRecorder(bytes.NewReader(data), testChunk, time.Hour)
	buf := make([]byte, 10)
	h.ReadAt(buf, 3*testChunk)
	h.Note(testChunk, 1)
	h.Stop()
	h.Stop()
	if n, err := h.ReadAt(buf, 5*testChunk); n != 10 || err != nil {
		t.Fatalf("read after Stop: %d, %v", n, err)
	}
	h.Note(6*testChunk, 1)
	if got := h.Hot(); !slices.Equal(got, []int64{3, 1}) {
		t.Fatalf("hot %v after Stop; want [3 1], what was recorded before", got)
	}
	// Concurrent with notes: nothing is recorded once Stop returned.
	h = NewHotRecorder(nil, testChunk, time.Hour)
	var wg sync.WaitGroup
	for g := range 4 {
		wg.Go(func() {
			for i := range 500 {
				h.Note(int64(g*500+i)*testChunk, 1)
			}
		})
	}
	wg.Go(h.Stop)
	h.Stop()
	at := h.Hot()
	wg.Wait()
	h.Note(1<<40, 1)
	if got := h.Hot(); !slices.Equal(got, at) {
		t.Fatalf("%d chunks recorded after Stop returned", len(got)-len(at))
	}
}

// hotPack packs the tree src into a new archive file and returns its path.
func hotPack(t *testing.T, src string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "a.sqfs")
	f, err := os.Create(p)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if _, err := archive.PackDir(t.Context(), f, src, archive.PackOptions{}); err != nil {
		t.Fatal(err)
	}
	return p
}

func hotNoise(n int, seed byte) []byte {
	b := make([]byte, n)
	h := sha256.Sum256([]byte{seed})
	for i := 0; i < n; i += 32 {
		copy(b[i:], h[:])
		h = sha256.Sum256(h[:])
	}
	return b
}

// The hot set read in one archive names, in the next archive, the chunks
// holding the files that were read, though they moved; reads after
// Resolve (a snapshot's pack) are not in it.
func TestHotFilesFollowFiles(t *testing.T) {
	t.Parallel()
	src := t.TempDir()
	write := func(name string, b []byte) {
		if err := os.WriteFile(filepath.Join(src, name), b, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	write("m-read.bin", hotNoise(3*128<<10+500, 1))
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
	readAll := func(r *archive.Reader, name string) []byte {
		f, err := r.Open(name)
		if err != nil {
			t.Fatal(err)
		}
		b, err := io.ReadAll(f)
		if err != nil {
			t.Fatal(err)
		}
		return b
	}
	readAll(lower, "m-read.bin")
	if _, err := hf.Resolve(); err != nil {
		t.Fatal(err)
	}
	recorded := hf.Hot()
	readAll(lower, "z-state.db") // the pack reading the lower
	if got := hf.Hot(); !slices.Equal(got, recorded) {
		t.Fatalf("reads after Resolve recorded: %v, then %v", recorded, got)
	}
	if n, err := hf.Resolve(); n != 0 || err != nil {
		t.Fatalf("second Resolve: %d %v", n, err)
	}

	// The next archive: a new file before everything moves the read one.
	write("a-new.bin", hotNoise(5*128<<10, 3))
	write("z-state.db", hotNoise(9*128<<10, 4))
	newPath := hotPack(t, src)
	got, err := chunksOfFile(hf, newPath, testChunk)
	if err != nil {
		t.Fatal(err)
	}
	nr, err := os.Open(newPath)
	if err != nil {
		t.Fatal(err)
	}
	defer nr.Close()
	nst, _ := nr.Stat()
	next, err := archive.Open(nr, nst.Size(), archive.ReaderOptions{})
	if err != nil {
		t.Fatal(err)
	}
	chunksOf := func(name string) []int64 {
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
			for c := e.At / testChunk; c <= (e.At+e.Size-1)/testChunk; c++ {
				if !slices.Contains(out, c) {
					out = append(out, c)
				}
			}
		}
		return out
	}
	read, db := chunksOf("m-read.bin"), chunksOf("z-state.db")
	for _, c := range read {
		if !slices.Contains(got, c) {
			t.Fatalf("hot chunks %v of the next archive miss chunk %d of the file read (its chunks %v; recorded in the lower %v)", got, c, read, recorded)
		}
	}
	inDB := 0
	for _, c := range got {
		if slices.Contains(db, c) && !slices.Contains(read, c) {
			inDB++
		}
	}
	if inDB >= 8 {
		t.Fatalf("%d of the hot chunks %v are the database's, read only after Resolve", inDB, got)
	}
	if slices.Equal(got, recorded) {
		t.Fatalf("hot chunks %v unchanged though the file moved", got)
	}
}

// hotBound is the hot set's byte bound README "Lazy boot" gives for an
// archive of size bytes: an eighth of it, at least 4 MiB, at most 64 MiB.
func hotBound(size int64) int64 { return min(64<<20, max(4<<20, size/8)) }

// A session that reads every chunk, after a few reads here and there (a
// startup), records a hot set within the byte bound that keeps those
// first reads, first: whether it reads everything in order (a scan: tar,
// grep -r) or in no order at all.
func TestHotRecorderBoundedByBytes(t *testing.T) {
	t.Parallel()
	const chunks = 8192 // 512 MiB of 64 KiB chunks
	early := []int64{5000, 17, 3000, 900, 901}
	startup := func(h *HotRecorder) {
		for _, c := range early {
			h.Note(c*testChunk+100, 4096)
		}
	}
	check := func(t *testing.T, got []int64) {
		t.Helper()
		if n := int64(len(got)) * testChunk; n > hotBound(chunks*testChunk) {
			t.Fatalf("hot set of %d chunks (%d MiB): more than the bound, %d MiB", len(got), n>>20, hotBound(chunks*testChunk)>>20)
		}
		if len(got) < len(early) || !slices.Equal(got[:len(early)], early) {
			t.Fatalf("hot set starts %v; want the early reads %v first", got[:min(len(got), 8)], early)
		}
	}
	t.Run("scan", func(t *testing.T) {
		h := NewHotRecorder(nil, testChunk, time.Hour)
		startup(h)
		for off := int64(0); off < chunks*testChunk; off += 128 << 10 {
			h.Note(off, 128<<10)
		}
		got := h.Hot()
		check(t, got)
		// The scan's own chunks are no startup's.
		if int64(len(got))*testChunk >= hotBound(chunks*testChunk)/2 {
			t.Fatalf("hot set of %d chunks after a scan; want the %d early ones and little of the scan", len(got), len(early))
		}
	})
	t.Run("everything out of order", func(t *testing.T) {
		h := NewHotRecorder(nil, testChunk, time.Hour)
		startup(h)
		for k := range int64(chunks) {
			h.Note((k*4099)%chunks*testChunk, 4096) // every chunk, far apart
		}
		got := h.Hot()
		check(t, got)
		if int64(len(got))*testChunk < hotBound(chunks*testChunk)/2 {
			t.Fatalf("hot set of %d chunks; scattered reads are no scan, the bound should fill it", len(got))
		}
	})
}

// The same through an archive: a startup reads a few files, then the
// session reads every file in the tree's order (a tar); the next
// archive's hot set is within the bound and holds the startup's files.
func TestHotFilesScanKeepsStartup(t *testing.T) {
	t.Parallel()
	src := t.TempDir()
	write := func(name string, b []byte) {
		p := filepath.Join(src, name)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, b, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	write("config.yaml", hotNoise(3000, 1))
	write("memories/MEMORY.md", hotNoise(5000, 2))
	for i := range 48 {
		write(fmt.Sprintf("sessions/s%03d.json", i), hotNoise(512<<10+i*100, byte(10+i)))
	}
	write("state.db", hotNoise(2<<20, 3))
	lowerPath := hotPack(t, src)
	lf, err := os.Open(lowerPath)
	if err != nil {
		t.Fatal(err)
	}
	defer lf.Close()
	st, _ := lf.Stat()
	hf := NewHotFiles(lf, st.Size(), testChunk, time.Hour)
	lower, err := archive.Open(hf, st.Size(), archive.ReaderOptions{Name: "lower", CacheBytes: 1})
	if err != nil {
		t.Fatal(err)
	}
	read := func(name string, off, n int64) {
		t.Helper()
		f, err := lower.Open(name)
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		b := make([]byte, n)
		if _, err := f.(io.ReaderAt).ReadAt(b, off); err != nil && err != io.EOF {
			t.Fatal(err)
		}
	}
	read("config.yaml", 0, 3000)
	read("memories/MEMORY.md", 0, 5000)
	read("state.db", 1<<20, 4096)
	read("sessions/s047.json", 0, 4096)
	// The scan: every file, start to finish, in the tree's order.
	err = iofs.WalkDir(lower.FS(), ".", func(p string, d iofs.DirEntry, err error) error {
		if err != nil || !d.Type().IsRegular() {
			return err
		}
		b, err := iofs.ReadFile(lower.FS(), p)
		if err == nil && len(b) == 0 {
			err = errors.New("empty")
		}
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := hf.Resolve(); err != nil {
		t.Fatal(err)
	}
	// The next archive: one more session file, the rest unchanged.
	write("sessions/s100.json", hotNoise(300<<10, 99))
	newPath := hotPack(t, src)
	got, err := chunksOfFile(hf, newPath, testChunk)
	if err != nil {
		t.Fatal(err)
	}
	nf, err := os.Open(newPath)
	if err != nil {
		t.Fatal(err)
	}
	defer nf.Close()
	nst, _ := nf.Stat()
	if n := int64(len(got)) * testChunk; n > hotBound(nst.Size()) {
		t.Fatalf("hot set of %d chunks (%d KiB) for a %d KiB archive: more than the bound, %d KiB", len(got), n>>10, nst.Size()>>10, hotBound(nst.Size())>>10)
	}
	next, err := archive.Open(nf, nst.Size(), archive.ReaderOptions{})
	if err != nil {
		t.Fatal(err)
	}
	for _, name := range []string{"config.yaml", "memories/MEMORY.md"} {
		a, err := next.Lstat(name)
		if err != nil {
			t.Fatal(err)
		}
		ext, err := next.Extents(archive.Inode(a.Sys().(*syscall.Stat_t).Ino))
		if err != nil {
			t.Fatal(err)
		}
		for _, e := range ext {
			if c := e.At / testChunk; !slices.Contains(got, c) {
				t.Fatalf("hot set %v lacks chunk %d of %s, read first", got, c, name)
			}
		}
	}
}

// Begin forgets what opening the archive read; after the recording ended
// it changes nothing.
func TestHotRecorderBegin(t *testing.T) {
	t.Parallel()
	h := NewHotRecorder(nil, testChunk, time.Hour)
	h.Note(0, 96)               // the superblock
	h.Note(90*testChunk, 3<<20) // the tables
	h.Begin()
	h.Note(7*testChunk, 10)
	h.Note(2*testChunk, 10)
	if got := h.Hot(); !slices.Equal(got, []int64{7, 2}) {
		t.Fatalf("hot %v; want [7 2], what was read after Begin", got)
	}
	h.Stop()
	h.Begin()
	h.Note(5*testChunk, 10)
	if got := h.Hot(); !slices.Equal(got, []int64{7, 2}) {
		t.Fatalf("hot %v after Stop and Begin; want [7 2]", got)
	}
}

// chunksOfFile is hf.ChunksByPath of the archive file at path (packed
// afresh: its numbers are not the lower's).
func chunksOfFile(hf *HotFiles, path string, cs int64) ([]int64, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return nil, err
	}
	return hf.ChunksByPath(f, fi.Size(), cs)
}
