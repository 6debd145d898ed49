package fs

import (
	"bytes"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/hermesfs/hermesfs/archive"
)

// TestReadLowerSplits: a read spanning many archive blocks, decompressed
// in parallel, returns exactly what one ReadAt would, at any offset and
// length, at the end of the file and past it.
func TestReadLowerSplits(t *testing.T) {
	src := tempDir(t)
	want := randBytes(3<<20+12345, 9)
	must(t, os.WriteFile(filepath.Join(src, "f"), want, 0o644))
	must(t, os.WriteFile(filepath.Join(src, "small"), []byte("tail only"), 0o644))
	img := filepath.Join(tempDir(t), "a.sqfs")
	f, err := os.Create(img)
	must(t, err)
	_, err = archive.PackDir(t.Context(), f, src, archive.PackOptions{BlockSize: 64 << 10})
	f.Close()
	must(t, err)
	r := openLower(t, img)
	ov := &overlay{lower: r, lowerBlock: int64(r.BlockSize())}
	a, err := r.Lookup(r.Root(), "f")
	must(t, err)
	size := int64(len(want))
	rnd := rand.New(rand.NewPCG(1, 2))
	cases := [][2]int64{{0, size}, {0, size + 100}, {size - 1, 10}, {size, 10}, {size + 5, 10}, {1, 64 << 10}, {64<<10 - 1, 2}}
	for i := 0; i < 60; i++ {
		cases = append(cases, [2]int64{rnd.Int64N(size + 1000), 1 + rnd.Int64N(1<<20)})
	}
	for _, c := range cases {
		off, n := c[0], c[1]
		p := make([]byte, n)
		k, err := ov.readLower(a.Ino, p, off)
		wk, werr := r.ReadAt(a.Ino, make([]byte, n), off)
		if k != wk || (err == nil) != (werr == nil) {
			t.Fatalf("readLower(%d, %d) = %d, %v; ReadAt gives %d, %v", off, n, k, err, wk, werr)
		}
		if off < size && !bytes.Equal(p[:k], want[off:off+int64(k)]) {
			t.Fatalf("readLower(%d, %d): wrong bytes", off, n)
		}
	}
}

// TestReadAheadMount: a root mount raises its read-ahead, and sequential
// and scattered reads of a large lower file, with read-ahead decompressing
// in the background, give its exact content.
func TestReadAheadMount(t *testing.T) {
	want := randBytes(5<<20+777, 4)
	lower, _ := packLower(t, func(dir string) {
		os.WriteFile(filepath.Join(dir, "big"), want, 0o644)
		for i := 0; i < 30; i++ {
			os.WriteFile(filepath.Join(dir, fmt.Sprintf("s%02d", i)), randBytes(1000+i*5000, uint64(i)), 0o644)
		}
	})
	e := mountEnv(t, lower, Options{})
	var st unix.Stat_t
	must(t, unix.Stat(e.mnt, &st))
	b, err := os.ReadFile(fmt.Sprintf("/sys/class/bdi/%d:%d/read_ahead_kb", unix.Major(st.Dev), unix.Minor(st.Dev)))
	if err != nil || string(bytes.TrimSpace(b)) != "1024" {
		t.Errorf("read-ahead of the mount: %q, %v; want 1024 KiB", b, err)
	}
	f, err := os.Open(e.path("big"))
	must(t, err)
	got, err := io.ReadAll(struct{ io.Reader }{f})
	f.Close()
	if err != nil || !bytes.Equal(got, want) {
		t.Fatalf("sequential read: %d bytes, %v", len(got), err)
	}
	e.remount() // a cold page cache for the scattered reads
	f2, err := os.Open(e.path("big"))
	must(t, err)
	defer f2.Close()
	rnd := rand.New(rand.NewPCG(3, 4))
	for i := 0; i < 30; i++ {
		off := rnd.Int64N(int64(len(want)))
		p := make([]byte, 1+rnd.IntN(2<<20))
		k, err := f2.ReadAt(p, off)
		if (err != nil && err != io.EOF) || !bytes.Equal(p[:k], want[off:off+int64(k)]) {
			t.Fatalf("pread(%d, %d): %d, %v", off, len(p), k, err)
		}
	}
	for i := 0; i < 30; i++ {
		name := fmt.Sprintf("s%02d", i)
		if got, err := os.ReadFile(e.path(name)); err != nil || !bytes.Equal(got, randBytes(1000+i*5000, uint64(i))) {
			t.Fatalf("%s: %d bytes, %v", name, len(got), err)
		}
	}
}
