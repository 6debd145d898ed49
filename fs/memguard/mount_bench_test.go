package memguard_test

import (
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"github.com/hermesfs/hermesfs/fs/memguard"
)

// BenchmarkHook measures what the memory hook costs. The same workloads run on
// overlay mounts in one process, one with the memory Guard and two with no
// Guard at all, interleaved round by round (rotating which goes first) so
// that drift on a busy machine hits all alike. The second unguarded mount is
// the control: its ratio to the first is the noise floor against which the
// guard's ratio is read. scripts/bench-hook.sh prints the metrics as ratios.
//
//   - small: files of other names created the safe way (temp file, write
//     1 KiB, fsync, rename), as session and state files are;
//   - w4k: 4 KiB writes to one large file;
//   - memupdate: one guarded MEMORY.md update the way Hermes saves it (temp
//     file, write, fsync, rename over MEMORY.md), against the same steps on
//     the unguarded mount and on the native disk.
func BenchmarkHook(b *testing.B) {
	plain := mountHome(b, memguard.Options{}, false, nil)
	guarded := mountHome(b, memguard.Options{}, true, nil)
	control := mountHome(b, memguard.Options{}, false, nil)
	native := b.TempDir()
	if err := os.Mkdir(filepath.Join(native, "memories"), 0o755); err != nil {
		b.Fatal(err)
	}
	rounds := envInt("BENCH_HOOK_ROUNDS", 20)
	smallPerRound := envInt("BENCH_HOOK_FILES", 5000) / rounds
	w4kPerRound := envInt("BENCH_HOOK_WRITES", 50000) / rounds
	memPerRound := envInt("BENCH_HOOK_MEM", 200) / rounds

	// Mount indexes: 0 no guard, 1 guard, 2 native disk (MEMORY.md updates)
	// or the control mount (other files).
	roots := [3]string{plain.root, guarded.root, native}
	others := [3]string{plain.root, guarded.root, control.root}
	files := [3]*os.File{}
	for i := range 3 {
		f, err := os.OpenFile(filepath.Join(others[i], "big.bin"), os.O_RDWR|os.O_CREATE, 0o644)
		if err != nil {
			b.Fatal(err)
		}
		defer f.Close()
		files[i] = f
	}
	versions := [2][]byte{chars("Prefers tea. ", 2100), chars("Prefers coffee. ", 2100)}
	block := make([]byte, 4096)
	// Per round and per mount.
	var small, w4k, mem [][3]time.Duration

	for b.Loop() {
		small = make([][3]time.Duration, rounds)
		w4k = make([][3]time.Duration, rounds)
		mem = make([][3]time.Duration, rounds)
		for r := range rounds {
			for k := range 3 {
				i := (r + k) % 3
				small[r][i] = timeIt(b, func() error { return smallFiles(others[i], r, smallPerRound) })
				w4k[r][i] = timeIt(b, func() error { return writes4k(files[i], r*w4kPerRound, w4kPerRound, block) })
			}
			for k := range 3 {
				i := (r + k) % 3
				mem[r][i] = timeIt(b, func() error {
					for u := range memPerRound {
						if err := saveMemory(roots[i], versions[u%2]); err != nil {
							return err
						}
					}
					return nil
				})
			}
		}
	}
	nSmall, nW4k, nMem := rounds*smallPerRound, rounds*w4kPerRound, rounds*memPerRound
	b.ReportMetric(perOp(small, 0, nSmall), "small-noguard-us/file")
	b.ReportMetric(perOp(small, 1, nSmall), "small-guard-us/file")
	b.ReportMetric(medianRatio(small, 1, 0), "small-median-ratio")
	b.ReportMetric(perOp(small, 2, nSmall), "small-control-us/file")
	b.ReportMetric(medianRatio(small, 2, 0), "small-control-median-ratio")
	b.ReportMetric(perOp(w4k, 0, nW4k), "w4k-noguard-us/write")
	b.ReportMetric(perOp(w4k, 1, nW4k), "w4k-guard-us/write")
	b.ReportMetric(medianRatio(w4k, 1, 0), "w4k-median-ratio")
	b.ReportMetric(perOp(w4k, 2, nW4k), "w4k-control-us/write")
	b.ReportMetric(medianRatio(w4k, 2, 0), "w4k-control-median-ratio")
	b.ReportMetric(perOp(mem, 1, nMem), "mem-guard-us/update")
	b.ReportMetric(perOp(mem, 0, nMem), "mem-noguard-us/update")
	b.ReportMetric(perOp(mem, 2, nMem), "mem-native-us/update")
	b.ReportMetric(medianRatio(mem, 1, 0), "mem-median-ratio")
	b.ReportMetric(float64(nSmall), "small-files")
	b.ReportMetric(float64(nW4k), "w4k-writes")
	b.ReportMetric(float64(nMem), "mem-updates")

	// The guarded updates really were judged and recorded: a benchmark of a
	// hook that did nothing would measure nothing.
	ev, err := memguard.ReadAudit(guarded.audit, 0, false)
	if err != nil || len(ev) < nMem {
		b.Fatalf("audit log holds %d events for %d guarded updates: %v", len(ev), nMem, err)
	}
}

// perOp is the mean time in microseconds of one of n operations on mount i.
func perOp(rounds [][3]time.Duration, i, n int) float64 {
	var total time.Duration
	for _, r := range rounds {
		total += r[i]
	}
	return float64(total.Microseconds()) / float64(n)
}

// medianRatio is the median over rounds of mount a's time over mount b's: a
// round that a burst of other load hit says little about the hook.
func medianRatio(rounds [][3]time.Duration, a, b int) float64 {
	ratios := make([]float64, 0, len(rounds))
	for _, r := range rounds {
		if r[b] > 0 {
			ratios = append(ratios, float64(r[a])/float64(r[b]))
		}
	}
	if len(ratios) == 0 {
		return 0
	}
	slices.Sort(ratios)
	return ratios[len(ratios)/2]
}

func timeIt(b *testing.B, f func() error) time.Duration {
	start := time.Now()
	if err := f(); err != nil {
		b.Fatal(err)
	}
	return time.Since(start)
}

func smallFiles(root string, round, n int) error {
	dir := filepath.Join(root, "state", fmt.Sprint(round))
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	data := make([]byte, 1024)
	for i := range n {
		f, err := os.CreateTemp(dir, ".tmp-*")
		if err != nil {
			return err
		}
		if _, err := f.Write(data); err != nil {
			f.Close()
			return err
		}
		if err := f.Sync(); err != nil {
			f.Close()
			return err
		}
		if err := f.Close(); err != nil {
			return err
		}
		if err := os.Rename(f.Name(), filepath.Join(dir, fmt.Sprintf("f%05d.json", i))); err != nil {
			return err
		}
	}
	return nil
}

// writes4k writes n 4 KiB blocks from block index first on, wrapping at 64 MiB.
func writes4k(f *os.File, first, n int, block []byte) error {
	const span = 64 << 20
	for i := range n {
		off := int64((first+i)*len(block)) % span
		if _, err := f.WriteAt(block, off); err != nil {
			return err
		}
	}
	return nil
}

// saveMemory is Hermes' save: mkstemp in memories/, write, fsync, replace.
func saveMemory(root string, content []byte) error {
	dir := filepath.Join(root, "memories")
	f, err := os.CreateTemp(dir, ".mem_*.tmp")
	if err != nil {
		return err
	}
	if _, err := f.Write(content); err != nil {
		f.Close()
		return err
	}
	if err := f.Sync(); err != nil {
		f.Close()
		return err
	}
	if err := f.Close(); err != nil {
		return err
	}
	return os.Rename(f.Name(), filepath.Join(dir, "MEMORY.md"))
}

func envInt(name string, def int) int {
	var n int
	if _, err := fmt.Sscan(os.Getenv(name), &n); err != nil || n <= 0 {
		return def
	}
	return n
}
