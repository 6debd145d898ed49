package lazy

import (
	"bytes"
	"crypto/sha256"
	"io"
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
	got, err := hf.Chunks(newPath, testChunk)
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
