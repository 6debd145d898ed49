package archive

import (
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"sync/atomic"
	"testing"
	"time"
)

// manyFiles writes a tree of about n entries shaped like an installed
// package tree: directories of 20 small files, three levels deep.
func manyFiles(tb testing.TB, root string, n int) {
	tb.Helper()
	body := make([]byte, 4096)
	for i := range body {
		body[i] = "abcdefghijklmnopqrstuvwxyz{}();\n "[i*7%33]
	}
	dirs := n / 21
	for d := range dirs {
		dir := filepath.Join(root, "node_modules", fmt.Sprintf("pkg%03d", d/100), fmt.Sprintf("lib%02d", d%100))
		if err := os.MkdirAll(dir, 0o755); err != nil {
			tb.Fatal(err)
		}
		for f := range 20 {
			size := 100 + (d*31+f*17)%1900
			if err := os.WriteFile(filepath.Join(dir, fmt.Sprintf("m%02d.js", f)), body[:size], 0o644); err != nil {
				tb.Fatal(err)
			}
		}
	}
}

// benchEntries is the tree size of the benchmarks below: 120k entries, or
// HERMESFS_BENCH_ENTRIES.
func benchEntries() int {
	if v, err := strconv.Atoi(os.Getenv("HERMESFS_BENCH_ENTRIES")); err == nil && v > 0 {
		return v
	}
	return 120_000
}

type countReads struct {
	f     *os.File
	calls atomic.Int64
	bytes atomic.Int64
}

func (c *countReads) ReadAt(p []byte, off int64) (int, error) {
	c.calls.Add(1)
	c.bytes.Add(int64(len(p)))
	return c.f.ReadAt(p, off)
}

// BenchmarkOpenMany opens an archive of benchEntries entries: the time and
// bytes of Open, then the reader's heap after a walk of the whole tree
// (every directory listed, every entry looked up).
func BenchmarkOpenMany(b *testing.B) {
	src := filepath.Join(b.TempDir(), "tree")
	n := benchEntries()
	manyFiles(b, src, n)
	p := filepath.Join(b.TempDir(), "a.sqfs")
	f, err := os.Create(p)
	if err != nil {
		b.Fatal(err)
	}
	res, err := PackDir(b.Context(), f, src, PackOptions{})
	f.Close()
	if err != nil {
		b.Fatal(err)
	}
	f, _ = os.Open(p)
	defer f.Close()
	var r *Reader
	var c *countReads
	var m, m0, m1 runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&m)
	b.ResetTimer()
	for b.Loop() {
		c = &countReads{f: f}
		if r, err = Open(c, res.Size, ReaderOptions{}); err != nil {
			b.Fatal(err)
		}
	}
	b.StopTimer()
	b.ReportMetric(float64(c.calls.Load()), "open-reads")
	b.ReportMetric(float64(c.bytes.Load())/1024, "open-KiB")
	runtime.GC()
	runtime.ReadMemStats(&m0)
	start, cpu := time.Now(), cpuTime()
	entries := 0
	queue := []Inode{r.Root()}
	for len(queue) > 0 {
		d := queue[0]
		queue = queue[1:]
		ents, err := r.ReadDir(d)
		if err != nil {
			b.Fatal(err)
		}
		for _, e := range ents {
			if _, err := r.Lookup(d, e.Name); err != nil {
				b.Fatal(err)
			}
			entries++
			if e.Mode.IsDir() {
				queue = append(queue, e.Ino)
			}
		}
	}
	walk, walkCPU := time.Since(start), cpuTime()-cpu
	b.ReportMetric(float64(c.calls.Load()), "walk-reads")
	runtime.GC()
	runtime.ReadMemStats(&m1)
	runtime.KeepAlive(r)
	b.ReportMetric(float64(entries), "entries")
	b.ReportMetric(float64(res.Size)/(1<<20), "image-MiB")
	b.ReportMetric(float64(walk.Milliseconds()), "walk-ms")
	b.ReportMetric(float64(walkCPU.Milliseconds()), "walk-cpu-ms")
	b.ReportMetric(float64(int64(m0.HeapInuse)-int64(m.HeapInuse))/(1<<20), "open-heap-MiB")
	b.ReportMetric(float64(int64(m1.HeapInuse)-int64(m.HeapInuse))/(1<<20), "walked-heap-MiB")
}
