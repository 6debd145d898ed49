package archive

import (
	iofs "io/fs"
	"os"
	"path/filepath"
	"strconv"
	"syscall"
	"testing"
	"time"
)

// BenchmarkPackCheck measures what Pack's check of its own blocks
// (worker.check, and the CRC the writer takes again) costs: the same pack
// with and without it, turn about, in the same process. It reports the
// ratios of wall and CPU time (check/nocheck), the CPU and wall seconds
// the check adds per GiB of file data, and, less noisy on a loaded
// machine, the check's work alone (every block of the archive decoded and
// hashed on one goroutine) as CPU seconds per GiB and as an estimated
// CPU ratio.
//
// HERMESFS_BENCH_TREE names the tree (scripts/genhome/cached.sh makes a
// 1 GiB Hermes home); without it a small generated tree is used. By
// default the pack is afresh: every block is new and checked, the worst
// case. HERMESFS_BENCH_BASE=N packs on a base holding all but every Nth
// regular file, as a snapshot does (those files are new, the others are
// the base's blocks, appended to, neither read nor checked).
func BenchmarkPackCheck(b *testing.B) {
	dir := os.Getenv("HERMESFS_BENCH_TREE")
	if dir == "" {
		dir = filepath.Join(b.TempDir(), "tree")
		for i := range 64 {
			writeFile(b, filepath.Join(dir, "f", string(rune('a'+i%26))+string(rune('a'+i/26))), text(1<<20+i, i+1), 0o644)
		}
		writeFile(b, filepath.Join(dir, "noise"), noise(8<<20, 1), 0o644)
	}
	var src iofs.FS = os.DirFS(dir)
	var opts PackOptions
	if every := envInt(b, "HERMESFS_BENCH_BASE"); every > 0 {
		f, err := os.Create(filepath.Join(b.TempDir(), "base.sqfs"))
		if err != nil {
			b.Fatal(err)
		}
		defer f.Close()
		res, err := Pack(b.Context(), f, &skipFS{FS: src, every: every}, PackOptions{})
		if err != nil {
			b.Fatal(err)
		}
		base, err := Open(f, res.Size, ReaderOptions{})
		if err != nil {
			b.Fatal(err)
		}
		src, opts.Base = WithBase(src, base), base
	}
	p := filepath.Join(b.TempDir(), "n.sqfs")
	var wall, cpu [2]time.Duration // [check, nocheck]
	var res PackResult
	for k := 0; b.Loop(); k++ {
		// Turn about, so that neither always runs first.
		for _, i := range [2][2]int{{0, 1}, {1, 0}}[k%2] {
			o := opts
			o.noCheck = i == 1
			c0, t0 := cpuTime(), time.Now()
			r, err := packInto(b.Context(), p, src, o)
			if err != nil {
				b.Fatal(err)
			}
			wall[i] += time.Since(t0)
			cpu[i] += cpuTime() - c0
			res = r
		}
	}
	n, gib := float64(b.N), float64(res.DataBytes)/(1<<30)
	b.ReportMetric(wall[0].Seconds()/wall[1].Seconds(), "wall-check/nocheck")
	b.ReportMetric(cpu[0].Seconds()/cpu[1].Seconds(), "cpu-check/nocheck")
	b.ReportMetric(cpu[1].Seconds()/n, "nocheck-cpu-s/pack")
	b.ReportMetric((cpu[0]-cpu[1]).Seconds()/n/gib, "check-cpu-s/GiB")
	b.ReportMetric((wall[0]-wall[1]).Seconds()/n/gib, "check-wall-s/GiB")
	if opts.Base != nil {
		b.ReportMetric(float64(res.Size-res.CopiedBytes)/(1<<20), "new-MiB")
		return
	}

	// The check's work alone: decode and hash every block of the
	// archive, as worker.check does for each new block.
	f, err := os.Open(p)
	if err != nil {
		b.Fatal(err)
	}
	defer f.Close()
	r, err := Open(f, res.Size, ReaderOptions{})
	if err != nil {
		b.Fatal(err)
	}
	blocks, _, err := r.dataBlocks(b.Context())
	if err != nil {
		b.Fatal(err)
	}
	w := &worker{dec: r.dec, scratch: make([]byte, r.bs)}
	c0 := cpuTime()
	for _, blk := range blocks {
		raw, err := r.readAt(blk.off, uint64(blk.word&^dataUncompBit), "block")
		if err != nil {
			b.Fatal(err)
		}
		c, err := w.content(raw, blk.word)
		if err != nil {
			b.Fatal(err)
		}
		chunkSum(c)
	}
	work := cpuTime() - c0
	b.ReportMetric(work.Seconds()/gib, "checkwork-cpu-s/GiB")
	b.ReportMetric(1+work.Seconds()/(cpu[1].Seconds()/n), "cpu-est-check/nocheck")
}

// skipFS hides every Nth regular file of an FS, in ReadDir order.
type skipFS struct {
	iofs.FS
	every int
	n     int
}

func (s *skipFS) ReadDir(name string) ([]iofs.DirEntry, error) {
	ents, err := iofs.ReadDir(s.FS, name)
	var out []iofs.DirEntry
	for _, e := range ents {
		if e.Type().IsRegular() {
			if s.n++; s.n%s.every == 0 {
				continue
			}
		}
		out = append(out, e)
	}
	return out, err
}

func (s *skipFS) Lstat(name string) (iofs.FileInfo, error) { return iofs.Lstat(s.FS, name) }
func (s *skipFS) ReadLink(name string) (string, error)     { return iofs.ReadLink(s.FS, name) }

// cpuTime is the process's user and system time so far.
func cpuTime() time.Duration {
	var ru syscall.Rusage
	syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

func envInt(b *testing.B, k string) int {
	v := os.Getenv(k)
	if v == "" {
		return 0
	}
	n, err := strconv.Atoi(v)
	if err != nil || n < 1 {
		b.Fatalf("%s=%q: want a positive number", k, v)
	}
	return n
}
