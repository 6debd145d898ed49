// Command fsbench measures the overlay (package fs) against native disk on a
// generated Hermes home, each workload run on both in the same process:
//
//	go run ./scripts/fsbench -home DIR -work DIR
//
// DIR of -home is the native tree (scripts/genhome); fsbench packs it with
// archive.PackDir, mounts the archive as the lower layer of an overlay and
// runs every workload on the mount and on native disk (the tree itself for
// reads, a scratch directory on the same disk for writes). Cold runs drop
// the page cache first (root only). Results go to stdout, one line each:
// workload, native, overlay, ratio (overlay / native, lower is better) and
// the goal.
package main

import (
	"bytes"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	iofs "io/fs"
	"log/slog"
	"math/rand/v2"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"runtime/pprof"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	fusefs "github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"
	"golang.org/x/sys/unix"

	"github.com/hermesfs/hermesfs/archive"
	"github.com/hermesfs/hermesfs/fs"
)

func main() {
	home := flag.String("home", "", "generated home (native tree)")
	work := flag.String("work", "", "scratch directory on the same disk")
	runs := flag.Int("runs", 3, "runs of each warm workload (best kept)")
	bigMiB := flag.Int("big", 1024, "size of the lower file for the copy-up stall, MiB")
	only := flag.String("only", "", "comma-separated workload groups to run (default all): "+strings.Join(allGroups, ","))
	entries := flag.Int("entries", 50000, "upper entries for the last freeze-stall measurement (group entries)")
	cpuprofile := flag.String("cpuprofile", "", "write a CPU profile of the workloads (and the overlay serving them) to this file")
	image := flag.String("image", "", "the packed lower layer: reused if it exists, else packed there (default: packed anew in -work)")
	stats := flag.Bool("stats", false, "keep the overlay's monitoring figures (fs.Stats: request counts and sampled latencies), as `hermesfs mount --metrics-addr` does")
	installed := flag.Bool("installed", false, "instead of the workloads above: an installed agent's (-home made by genhome -install): Python imports, node requires, git status, find, stat and read of the whole home, cold and warm, on native disk, the overlay and the kernel's squashfs under overlayfs")
	trials := flag.Int("trials", 5, "with -installed: runs of each workload on each tree (the median is reported)")
	workloadsFlag := flag.String("workloads", "", "with -installed: comma-separated workloads to run (default all): "+strings.Join(installedKeys, ","))
	profileDir := flag.String("profile-dir", "", "with -installed: instead of the timed trials, run each workload once cold and once warm on native disk and the overlay, print the FUSE requests the overlay served for each (fs.Stats), and write a CPU profile of the overlay's process during each run to this directory (WORKLOAD-cold.prof, WORKLOAD-warm.prof)")
	ptwMiB := flag.Int("ptwrite-max", 0, "the overlay's PassthroughWriteMax in MiB (0: its default; -1: no writable passthrough)")
	serve := flag.Bool("serve", false, "with -image: mount the overlay over the image at -work/mnt (upper -work/upper) and serve it until interrupted, for looking at it with other tools")
	flag.Parse()
	if *home == "" || *work == "" {
		flag.Usage()
		os.Exit(2)
	}
	b := &bench{home: *home, work: *work, runs: *runs, bigMiB: *bigMiB, entries: *entries, groups: map[string]bool{}, ptwMax: int64(*ptwMiB) << 20, stats: *stats}
	for _, g := range strings.Split(*only, ",") {
		if g = strings.TrimSpace(g); g == "" {
			continue
		}
		if !slices.Contains(allGroups, g) {
			fmt.Fprintf(os.Stderr, "fsbench: unknown group %q (have %s)\n", g, strings.Join(allGroups, ","))
			os.Exit(2)
		}
		b.groups[g] = true
	}
	b.workloads = map[string]bool{}
	for _, w := range strings.Split(*workloadsFlag, ",") {
		if w = strings.TrimSpace(w); w == "" {
			continue
		}
		if !slices.Contains(installedKeys, w) {
			fmt.Fprintf(os.Stderr, "fsbench: unknown workload %q (have %s)\n", w, strings.Join(installedKeys, ","))
			os.Exit(2)
		}
		b.workloads[w] = true
	}
	b.profile, b.image = *cpuprofile, *image
	run := b.run
	if *serve {
		run = b.serve
	}
	if *installed {
		run = func() error { return b.runInstalled(*trials, *profileDir) }
	}
	// Interrupted: unmount what was mounted before going (-serve waits
	// for the signal itself).
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, os.Interrupt, syscall.SIGTERM)
	b.interrupted = sig
	if !*serve {
		go func() {
			s := <-sig
			fmt.Fprintf(os.Stderr, "fsbench: %v: unmounting\n", s)
			b.cleanup()
			os.Exit(1)
		}()
	}
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "fsbench:", err)
		b.cleanup()
		os.Exit(1)
	}
	b.cleanup()
}

// allGroups are the workload groups, in the order they run.
var allGroups = []string{"meta", "read", "freeze", "create", "sqlite", "writes", "copyup", "rangecopy", "upper", "entries", "loopback"}

// newStats is the overlay's Stats when -stats is given, else nil.
func (b *bench) newStats() *fs.Stats {
	if !b.stats {
		return nil
	}
	b.curStats = fs.NewStats()
	return b.curStats
}

// want reports whether group g runs.
func (b *bench) want(g string) bool { return len(b.groups) == 0 || b.groups[g] }

type bench struct {
	home, work  string
	runs        int
	bigMiB      int
	entries     int
	groups      map[string]bool
	workloads   map[string]bool // -installed workloads to run (empty: all)
	interrupted chan os.Signal  // SIGINT, SIGTERM
	profile     string          // CPU profile of the workloads
	ptwMax      int64           // fs.Options.PassthroughWriteMax
	stats       bool            // fs.Options.Stats set
	curStats    *fs.Stats       // the mounted overlay's, when stats is set
	imageReads  countingReader  // reads of the image, counted when stats is set
	img         string          // the lower layer in use
	image       string          // packed lower layer to reuse
	lowerFile   *os.File
	m           *fs.Mounted
	mnt, upper  string
	native      string // scratch dir for native write workloads
	cleanups    []func()
}

func (b *bench) cleanup() {
	for i := len(b.cleanups) - 1; i >= 0; i-- {
		b.cleanups[i]()
	}
	b.cleanups = nil
}

func (b *bench) run() error {
	if err := os.RemoveAll(b.work); err != nil {
		return err
	}
	b.mnt = filepath.Join(b.work, "mnt")
	b.upper = filepath.Join(b.work, "upper")
	b.native = filepath.Join(b.work, "native")
	for _, d := range []string{b.mnt, b.native} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			return err
		}
	}
	b.cleanups = append(b.cleanups, func() { os.RemoveAll(b.work) })

	// The lower layer: the home plus one big file for the copy-up stall.
	src := filepath.Join(b.work, "src")
	if err := os.Symlink(b.home, src); err != nil {
		return err
	}
	img := filepath.Join(b.work, "lower.sqfs")
	if b.image != "" {
		img = b.image
	}
	if _, err := os.Stat(img); b.image == "" || err != nil {
		bigDir := filepath.Join(b.work, "bigsrc")
		os.MkdirAll(bigDir, 0o755)
		if err := writePatterned(filepath.Join(bigDir, "big.bin"), int64(b.bigMiB)<<20); err != nil {
			return err
		}
		start := time.Now()
		if err := packTree(b.home, bigDir, img); err != nil {
			return err
		}
		fmt.Printf("# packed %s (+ %d MiB big.bin) in %s\n", b.home, b.bigMiB, time.Since(start).Round(time.Millisecond))
	} else {
		fmt.Printf("# reusing %s\n", img)
	}
	b.img = img
	if err := b.mount(img, false); err != nil {
		return err
	}
	if b.profile != "" {
		f, err := os.Create(b.profile)
		if err != nil {
			return err
		}
		pprof.StartCPUProfile(f)
		b.cleanups = append(b.cleanups, func() { pprof.StopCPUProfile(); f.Close() })
	}
	fmt.Printf("# overlay passthrough for read-only opens of upper files: %v\n", b.m.Passthrough())
	fmt.Printf("%-44s %12s %12s %7s  %s\n", "workload", "native", "overlay", "ratio", "goal")

	rootLower := b.mnt
	// Metadata and reads over the whole home: native tree vs the mount
	// (everything in the lower layer).
	files, bytes := countTree(b.home)
	fmt.Printf("# home: %d files, %.1f MiB\n", files, float64(bytes)/(1<<20))
	if b.want("meta") {
		b.cold("stat every file (cold)", "<= 2.5", func(root string) error { return statAll(root) }, b.home, rootLower)
		b.warm("stat every file (warm)", "<= 2.5", func(root string) error { return statAll(root) }, b.home, rootLower)
	}
	if b.want("read") {
		for i := 0; i < b.runs; i++ {
			b.cold("read every file (cold)", "<= 1.3", func(root string) error { return readAll(root) }, b.home, rootLower)
		}
		readN, _ := b.warm("read every file (warm)", "<= 1.3", func(root string) error { return readAll(root) }, b.home, rootLower)
		// What an OPEN round trip alone costs per file, and the
		// ratio reading every file could reach if nothing else did.
		openN, openO := b.warm("open+close every file (warm)", "info", func(root string) error { return openAll(root) }, b.home, rootLower)
		walkN, walkO := b.warm("walk every directory (warm)", "info", func(root string) error { return openAllIf(root, false) }, b.home, rootLower)
		if readN > 0 && openN > 0 && walkN > 0 && files > 0 {
			extra := (openO - walkO) - (openN - walkN)
			fmt.Printf("# opening a file through the mount costs %s more than natively; with only that, read every file (warm) would be %.2f\n",
				dur(extra/time.Duration(files)), float64(readN+extra)/float64(readN))
		}
	}

	// The freeze stall with 10 and 100 MiB freshly dirty in a young upper
	// layer (tens of files).
	if b.want("freeze") {
		for _, mib := range []int{10, 100} {
			if err := b.freezeStall(mib); err != nil {
				return err
			}
		}
	}

	// Hermes-style writes into fresh directories of both.
	runsOn := map[string]int{}
	if b.want("create") || b.want("upper") {
		b.warm("create 5k files (temp+fsync+rename)", "<= 2.5", func(root string) error {
			runsOn[root]++
			return createFiles(filepath.Join(root, fmt.Sprintf("sessions-bench-%d", runsOn[root])), 5000)
		}, b.native, b.mnt)
	}
	if b.want("sqlite") {
		b.warm("3000 SQLite inserts, WAL, autocommit", "<= 1.3", func(root string) error {
			runsOn[root]++
			return sqliteInserts(filepath.Join(root, fmt.Sprintf("bench-%d.db", runsOn[root])), 3000)
		}, b.native, b.mnt)
	}

	// Random 4 KiB writes to a file copied up from the lower layer, and to
	// a copy of it on native disk.
	dbRel := "state.db"
	if b.want("writes") || b.want("upper") {
		if _, err := os.Stat(filepath.Join(b.home, dbRel)); err != nil {
			return fmt.Errorf("home has no %s: %w", dbRel, err)
		}
		if err := copyFile(filepath.Join(b.home, dbRel), filepath.Join(b.native, dbRel)); err != nil {
			return err
		}
		t0 := time.Now()
		if err := touchWrite(filepath.Join(b.mnt, dbRel)); err != nil {
			return err
		}
		st, _ := os.Stat(filepath.Join(b.mnt, dbRel))
		fmt.Printf("# copy-up of %s (%.0f MiB) took %s\n", dbRel, float64(st.Size())/(1<<20), time.Since(t0).Round(time.Millisecond))
	}
	if b.want("writes") {
		b.warm("4 KiB random writes (20k) to a copied-up file", "<= 1.3", func(root string) error {
			return randomWrites(filepath.Join(root, dbRel), 20000, false)
		}, b.native, b.mnt)
		b.warm("4 KiB random writes+fdatasync (2k)", "<= 1.3", func(root string) error {
			return randomWrites(filepath.Join(root, dbRel), 2000, true)
		}, b.native, b.mnt)
		if err := b.freezeWithWriter(dbRel); err != nil {
			return err
		}
	}

	// The stall of the first write into the big lower file.
	if b.want("copyup") {
		if err := dropCaches(); err == nil {
			t0 := time.Now()
			if err := touchWrite(filepath.Join(b.mnt, "big.bin")); err != nil {
				return err
			}
			fmt.Printf("%-44s %12s %12s %7s  %s\n", fmt.Sprintf("first 4 KiB write into a %d MiB lower file", b.bigMiB), "-", dur(time.Since(t0)), "-", "info (cold; default copy-up)")
		}
	}

	if b.want("rangecopy") {
		if err := b.rangeCopy(); err != nil {
			return err
		}
	}

	// Reads of upper files: passthrough against daemon-served.
	if b.want("upper") {
		if err := b.passthroughCost(); err != nil {
			return err
		}
	}

	// The freeze stall grows with the entries of the upper layer (now
	// holding the sessions created above), then with 20k more, then up to
	// -entries.
	if b.want("entries") {
		if err := b.freezeStall(0); err != nil {
			return err
		}
		if err := createFiles(filepath.Join(b.mnt, "many"), 20000); err != nil {
			return err
		}
		if err := b.freezeStall(0); err != nil {
			return err
		}
		if n := b.entries - upperEntries(b.upper); n > 0 {
			if err := createPlain(filepath.Join(b.mnt, "more"), n); err != nil {
				return err
			}
			if err := b.freezeStall(0); err != nil {
				return err
			}
		}
	}
	if b.want("loopback") {
		if err := b.writeModes(); err != nil {
			return err
		}
	}
	return nil
}

// upperEntries counts the entries of the upper layer (the overlay's own
// bookkeeping included).
func upperEntries(upper string) int {
	n := 0
	filepath.WalkDir(upper, func(p string, d iofs.DirEntry, err error) error {
		if err == nil && p != upper {
			n++
		}
		return nil
	})
	return n
}

// createPlain creates n small files without syncing, 500 to a directory:
// upper entries for the freeze stall.
func createPlain(dir string, n int) error {
	body := bytes.Repeat([]byte("x"), 512)
	for i := 0; i < n; i++ {
		sub := filepath.Join(dir, fmt.Sprintf("d%03d", i/500))
		if i%500 == 0 {
			if err := os.MkdirAll(sub, 0o755); err != nil {
				return err
			}
		}
		if err := os.WriteFile(filepath.Join(sub, fmt.Sprintf("f%04d", i%500)), body, 0o644); err != nil {
			return err
		}
	}
	return nil
}

func (b *bench) mount(img string, noPT bool) error {
	if b.lowerFile == nil {
		f, err := os.Open(img)
		if err != nil {
			return err
		}
		b.lowerFile = f
		b.cleanups = append(b.cleanups, func() { f.Close() })
	}
	st, _ := b.lowerFile.Stat()
	var ra io.ReaderAt = b.lowerFile
	if b.stats {
		ra = &b.imageReads
	}
	b.imageReads.ra = b.lowerFile
	r, err := archive.Open(ra, st.Size(), archive.ReaderOptions{Name: img})
	if err != nil {
		return err
	}
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	m, err := fs.Mount(context.Background(), b.mnt, fs.Options{Upper: b.upper, Lower: r, Logger: log, NoPassthrough: noPT, PassthroughWriteMax: b.ptwMax, Stats: b.newStats()})
	if err != nil {
		return err
	}
	b.m = m
	b.cleanups = append(b.cleanups, func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if b.m == m {
			m.Unmount(ctx)
			b.m = nil
		}
	})
	return nil
}

func (b *bench) remount(noPT bool) error {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := b.m.Unmount(ctx); err != nil {
		return err
	}
	b.m = nil
	return b.mount(b.img, noPT)
}

// report prints one result line.
func report(name, goal string, native, overlay time.Duration) {
	ratio := float64(overlay) / float64(native)
	mark := ""
	if g, ok := strings.CutPrefix(goal, "<= "); ok {
		var lim float64
		fmt.Sscan(g, &lim)
		if ratio > lim {
			mark = "  MISSED"
		}
	}
	fmt.Printf("%-44s %12s %12s %7.2f  %s%s\n", name, dur(native), dur(overlay), ratio, goal, mark)
}

func dur(d time.Duration) string {
	switch {
	case d >= time.Second:
		return fmt.Sprintf("%.2fs", d.Seconds())
	case d >= time.Millisecond:
		return fmt.Sprintf("%.1fms", float64(d)/float64(time.Millisecond))
	}
	return fmt.Sprintf("%.0fµs", float64(d)/float64(time.Microsecond))
}

// warm runs fn on both roots b.runs times, alternating so that both see
// the same disk weather, and reports and returns the best time of each
// (-1, -1 if fn failed).
func (b *bench) warm(name, goal string, fn func(root string) error, native, overlay string) (time.Duration, time.Duration) {
	bestN, bestO := time.Duration(-1), time.Duration(-1)
	once := func(root string, best *time.Duration) bool {
		t := time.Now()
		if err := fn(root); err != nil {
			fmt.Fprintf(os.Stderr, "fsbench: %s on %s: %v\n", name, root, err)
			return false
		}
		if e := time.Since(t); *best < 0 || e < *best {
			*best = e
		}
		return true
	}
	for i := 0; i < b.runs; i++ {
		if !once(native, &bestN) || !once(overlay, &bestO) {
			return -1, -1
		}
	}
	report(name, goal, bestN, bestO)
	return bestN, bestO
}

// cold runs fn once on each root after dropping the page cache (and, for
// the mount, the kernel's FUSE dentries and attributes with it).
func (b *bench) cold(name, goal string, fn func(root string) error, native, overlay string) {
	if err := dropCaches(); err != nil {
		fmt.Printf("%-44s skipped: %v\n", name, err)
		return
	}
	t := time.Now()
	if err := fn(native); err != nil {
		fmt.Fprintln(os.Stderr, "fsbench:", err)
	}
	dn := time.Since(t)
	dropCaches()
	t = time.Now()
	if err := fn(overlay); err != nil {
		fmt.Fprintln(os.Stderr, "fsbench:", err)
	}
	report(name, goal, dn, time.Since(t))
}

func dropCaches() error {
	unix.Sync()
	return os.WriteFile("/proc/sys/vm/drop_caches", []byte("3"), 0)
}

func countTree(root string) (files int, bytes int64) {
	filepath.WalkDir(root, func(p string, d iofs.DirEntry, err error) error {
		if err == nil && d.Type().IsRegular() {
			if fi, err := d.Info(); err == nil {
				files++
				bytes += fi.Size()
			}
		}
		return nil
	})
	return
}

// skipBig is the big lower file, which the home has not.
func skipBig(root, p string) bool { return p == filepath.Join(root, "big.bin") }

func statAll(root string) error {
	n := 0
	err := filepath.WalkDir(root, func(p string, d iofs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if skipBig(root, p) {
			return nil
		}
		var st unix.Stat_t
		n++
		return unix.Lstat(p, &st)
	})
	if n == 0 && err == nil {
		err = errors.New("empty tree")
	}
	return err
}

var copyBuf = make([]byte, 1<<20)

func readAll(root string) error {
	return filepath.WalkDir(root, func(p string, d iofs.DirEntry, err error) error {
		if err != nil || !d.Type().IsRegular() || skipBig(root, p) {
			return err
		}
		f, err := os.Open(p)
		if err != nil {
			return err
		}
		_, err = io.CopyBuffer(io.Discard, struct{ io.Reader }{f}, copyBuf)
		f.Close()
		return err
	})
}

// openAll opens and closes every regular file under root, reading nothing.
func openAll(root string) error { return openAllIf(root, true) }

// openAllIf is openAll, or with open false only the walk it makes.
func openAllIf(root string, open bool) error {
	return filepath.WalkDir(root, func(p string, d iofs.DirEntry, err error) error {
		if err != nil || !open || !d.Type().IsRegular() || skipBig(root, p) {
			return err
		}
		fd, err := unix.Open(p, unix.O_RDONLY|unix.O_CLOEXEC, 0)
		if err != nil {
			return &os.PathError{Op: "open", Path: p, Err: err}
		}
		return unix.Close(fd)
	})
}

// createFiles writes n small JSON files the way Hermes saves state: temp
// file, write, fsync, rename.
func createFiles(dir string, n int) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	r := rand.New(rand.NewPCG(1, 2))
	body := bytes.Repeat([]byte(`{"role":"assistant","content":"lorem ipsum dolor sit amet"},`), 80)
	for i := 0; i < n; i++ {
		tmp := filepath.Join(dir, fmt.Sprintf(".tmp_%d", i))
		f, err := os.OpenFile(tmp, os.O_CREATE|os.O_EXCL|os.O_WRONLY, 0o644)
		if err != nil {
			return err
		}
		if _, err := f.Write(body[:1024+r.IntN(3000)]); err != nil {
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
		if err := os.Rename(tmp, filepath.Join(dir, fmt.Sprintf("session_%05d.json", i))); err != nil {
			return err
		}
	}
	return nil
}

func sqliteInserts(db string, n int) error {
	var sb strings.Builder
	sb.WriteString("PRAGMA journal_mode=WAL;\nCREATE TABLE IF NOT EXISTS messages(id INTEGER PRIMARY KEY, session TEXT, role TEXT, content TEXT, ts REAL);\n")
	for i := 0; i < n; i++ {
		fmt.Fprintf(&sb, "INSERT INTO messages(session, role, content, ts) VALUES('s%d', 'user', hex(randomblob(200)), %d);\n", i%50, i)
	}
	cmd := exec.Command("sqlite3", db)
	cmd.Stdin = strings.NewReader(sb.String())
	cmd.Dir = "/"
	out, err := cmd.CombinedOutput()
	if err != nil {
		return fmt.Errorf("sqlite3: %v: %s", err, out)
	}
	return nil
}

func randomWrites(path string, n int, sync bool) error {
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		return err
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return err
	}
	blocks := st.Size() / 4096
	r := rand.New(rand.NewPCG(3, 4))
	buf := bytes.Repeat([]byte{0xab}, 4096)
	for i := 0; i < n; i++ {
		if _, err := f.WriteAt(buf, r.Int64N(blocks)*4096); err != nil {
			return err
		}
		if sync {
			if err := unix.Fdatasync(int(f.Fd())); err != nil {
				return err
			}
		}
	}
	return nil
}

// touchWrite writes 4 KiB into the middle of path (copying it up).
func touchWrite(path string) error {
	f, err := os.OpenFile(path, os.O_WRONLY, 0)
	if err != nil {
		return err
	}
	defer f.Close()
	st, _ := f.Stat()
	_, err = f.WriteAt(make([]byte, 4096), st.Size()/2&^4095)
	return err
}

func copyFile(src, dst string) error {
	in, err := os.Open(src)
	if err != nil {
		return err
	}
	defer in.Close()
	out, err := os.Create(dst)
	if err != nil {
		return err
	}
	if _, err := io.Copy(out, in); err != nil {
		out.Close()
		return err
	}
	return out.Close()
}

// writePatterned writes size bytes that compress like a binary blob: each
// 1 MiB holds random bytes (incompressible per block).
func writePatterned(path string, size int64) error {
	if st, err := os.Stat(path); err == nil && st.Size() == size {
		return nil
	}
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	r := rand.New(rand.NewPCG(5, 6))
	buf := make([]byte, 1<<20)
	for off := int64(0); off < size; off += int64(len(buf)) {
		for i := 0; i < len(buf); i += 8 {
			v := r.Uint64()
			for k := 0; k < 8; k++ {
				buf[i+k] = byte(v >> (8 * k))
			}
		}
		if _, err := f.Write(buf[:min(int64(len(buf)), size-off)]); err != nil {
			f.Close()
			return err
		}
	}
	return f.Close()
}

// packTree packs home with big.bin of bigDir added at the top.
func packTree(home, bigDir, img string) error {
	f, err := os.Create(img)
	if err != nil {
		return err
	}
	defer f.Close()
	src := mergedFS{home: os.DirFS(home), big: os.DirFS(bigDir)}
	_, err = archive.Pack(context.Background(), f, src, archive.PackOptions{})
	return err
}

// mergedFS is home with big.bin added at its root.
type mergedFS struct{ home, big iofs.FS }

func (m mergedFS) pick(name string) (iofs.FS, string) {
	if name == "big.bin" {
		return m.big, name
	}
	return m.home, name
}
func (m mergedFS) Open(name string) (iofs.File, error) {
	f, n := m.pick(name)
	return f.Open(n)
}
func (m mergedFS) ReadDir(name string) ([]iofs.DirEntry, error) {
	ents, err := iofs.ReadDir(m.home, name)
	if err != nil || name != "." {
		return ents, err
	}
	big, err := iofs.ReadDir(m.big, ".")
	if err != nil {
		return nil, err
	}
	ents = append(ents, big...)
	slices.SortFunc(ents, func(a, b iofs.DirEntry) int { return strings.Compare(a.Name(), b.Name()) })
	return ents, nil
}
func (m mergedFS) Lstat(name string) (iofs.FileInfo, error) {
	f, n := m.pick(name)
	return iofs.Lstat(f, n)
}
func (m mergedFS) ReadLink(name string) (string, error) {
	f, n := m.pick(name)
	return iofs.ReadLink(f, n)
}

// passthroughCost reads upper files with passthrough and daemon-served:
// small ones (the created sessions, below PassthroughMinSize, so always
// daemon-served with the page cache) and a large one (the copied-up
// state.db), cold and warm.
func (b *bench) passthroughCost() error {
	measure := func(read func(root string) error) (cold, warm time.Duration) {
		dropCaches()
		t := time.Now()
		read(b.mnt)
		cold = time.Since(t)
		best := time.Duration(-1)
		for i := 0; i < b.runs; i++ {
			t = time.Now()
			read(b.mnt)
			if d := time.Since(t); best < 0 || d < best {
				best = d
			}
		}
		return cold, best
	}
	native := func(read func(root string) error) (cold, warm time.Duration) {
		dropCaches()
		t := time.Now()
		read(b.native)
		cold = time.Since(t)
		t = time.Now()
		read(b.native)
		return cold, time.Since(t)
	}
	small := func(root string) error { return readAll(filepath.Join(root, "sessions-bench-1")) }
	large := func(root string) error { return readFile(filepath.Join(root, "state.db")) }
	sc, sw := measure(small)
	pc, pw := measure(large)
	if err := b.remount(true); err != nil {
		return err
	}
	dc, dw := measure(large)
	if err := b.remount(false); err != nil {
		return err
	}
	nsc, nsw := native(small)
	nc, nw := native(large)
	report("read 5k small upper files, cold", "info", nsc, sc)
	report("read 5k small upper files, warm", "info", nsw, sw)
	report("read upper state.db, cold, passthrough", "info", nc, pc)
	report("read upper state.db, cold, daemon-served", "info", nc, dc)
	report("read upper state.db, warm, passthrough", "info", nw, pw)
	report("read upper state.db, warm, daemon-served", "info", nw, dw)
	return nil
}

func readFile(p string) error {
	f, err := os.Open(p)
	if err != nil {
		return err
	}
	defer f.Close()
	_, err = io.CopyBuffer(io.Discard, struct{ io.Reader }{f}, copyBuf)
	return err
}

// freezeWithWriter measures a freeze while rel, just written, is open for
// writing: written through passthrough (within -ptwrite-max), the freeze
// stops its writes and copies it whole; written through the daemon, it
// costs the freeze nothing.
func (b *bench) freezeWithWriter(rel string) error {
	f, err := os.OpenFile(filepath.Join(b.mnt, rel), os.O_RDWR, 0)
	if err != nil {
		return err
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return err
	}
	if _, err := f.WriteAt(make([]byte, 4096), st.Size()/2); err != nil {
		return err
	}
	v, err := b.m.Freeze(context.Background())
	if err != nil {
		return err
	}
	defer v.Close()
	how := "written through the daemon: nothing copied"
	if v.WriteStall() > 0 {
		how = fmt.Sprintf("written through passthrough: its writes stopped %s while copied", v.WriteStall().Round(time.Millisecond))
	}
	fmt.Printf("%-44s %12s %12s %7s  %s\n", fmt.Sprintf("freeze, %s (%.0f MiB) open for writing", filepath.Base(rel), float64(st.Size())/(1<<20)), "-", dur(max(v.Stall(), v.WriteStall())), "-", "info ("+how+"; gate closed "+dur(v.Stall())+")")
	return nil
}

// freezeStall dirties mib MiB in fresh upper files, then freezes while a
// writer keeps writing: it reports how long Freeze took, how long the gate
// was closed, and the longest a single 4 KiB write waited.
func (b *bench) freezeStall(mib int) error {
	dir := filepath.Join(b.mnt, fmt.Sprintf("dirty-%d", mib))
	os.MkdirAll(dir, 0o755)
	chunk := bytes.Repeat([]byte("x"), 1<<20)
	for i := 0; i < mib; i++ {
		if err := os.WriteFile(filepath.Join(dir, fmt.Sprintf("f%03d", i%10)), chunk, 0o644); err != nil {
			return err
		}
		f, _ := os.OpenFile(filepath.Join(dir, fmt.Sprintf("f%03d", i%10)), os.O_WRONLY|os.O_APPEND, 0)
		f.Write(chunk)
		f.Close()
	}
	// Baseline write latency, then latency across a freeze.
	f, err := os.OpenFile(filepath.Join(dir, "hot"), os.O_CREATE|os.O_RDWR, 0o644)
	if err != nil {
		return err
	}
	defer f.Close()
	var maxLat atomic.Int64
	stop := make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		buf := make([]byte, 4096)
		for i := 0; ; i++ {
			select {
			case <-stop:
				return
			default:
			}
			t := time.Now()
			f.WriteAt(buf, int64(i%1024)*4096)
			if l := int64(time.Since(t)); l > maxLat.Load() {
				maxLat.Store(l)
			}
		}
	}()
	bigDir, bigN := largestDir(b.upper)
	time.Sleep(200 * time.Millisecond)
	before := time.Duration(maxLat.Swap(0))
	t := time.Now()
	v, err := b.m.Freeze(context.Background())
	took := time.Since(t)
	time.Sleep(50 * time.Millisecond)
	close(stop)
	wg.Wait()
	if err != nil {
		return err
	}
	// The view keeps a directory's listing before its first change: the
	// first create in the largest one pays for listing it.
	t = time.Now()
	probe := filepath.Join(b.mnt, bigDir, fmt.Sprintf("probe-%d", time.Now().UnixNano()))
	if err := os.WriteFile(probe, nil, 0o644); err != nil {
		return err
	}
	firstCreate := time.Since(t)
	os.Remove(probe)
	// What packing pays to read the view's metadata.
	t = time.Now()
	nv := 0
	err = iofs.WalkDir(v, ".", func(p string, d iofs.DirEntry, err error) error {
		if err == nil {
			_, err = iofs.Lstat(v, p)
			nv++
		}
		return err
	})
	walk := time.Since(t)
	stall := v.Stall()
	v.Close()
	if err != nil {
		return fmt.Errorf("walk the view: %w", err)
	}
	files, entries, dirtyBytes := 0, 0, int64(0)
	filepath.WalkDir(b.upper, func(p string, d iofs.DirEntry, err error) error {
		if err == nil && p != b.upper {
			entries++
		}
		if err == nil && d.Type().IsRegular() {
			files++
			if fi, err := d.Info(); err == nil {
				dirtyBytes += fi.Size()
			}
		}
		return nil
	})
	name := fmt.Sprintf("freeze, %d MiB freshly dirty", mib)
	if mib == 0 {
		name = fmt.Sprintf("freeze, %d upper entries", entries)
	}
	fmt.Printf("%-44s %12s %12s %7s  %s\n", name, "-", dur(took),
		"-", fmt.Sprintf("< 100ms (gate closed %s; worst write %s, %s before; upper: %d files, %.0f MiB)",
			dur(stall), dur(time.Duration(maxLat.Load())), dur(before), files, float64(dirtyBytes)/(1<<20)))
	fmt.Printf("%-44s %12s %12s %7s  %s\n", "  then: first create in the largest directory", "-", dur(firstCreate), "-",
		fmt.Sprintf("info (%s, %d entries, listed for the view)", bigDir, bigN))
	fmt.Printf("%-44s %12s %12s %7s  %s\n", "  then: lstat every name of the view", "-", dur(walk), "-", fmt.Sprintf("info (%d names)", nv))
	return nil
}

// largestDir returns the upper directory (relative to upper) with the most
// entries, and how many.
func largestDir(upper string) (string, int) {
	best, bestN := ".", -1
	filepath.WalkDir(upper, func(p string, d iofs.DirEntry, err error) error {
		if err != nil || !d.IsDir() {
			return nil
		}
		if strings.HasPrefix(d.Name(), ".wh.") {
			return filepath.SkipDir
		}
		if ents, err := os.ReadDir(p); err == nil && len(ents) > bestN {
			best, bestN = p, len(ents)
		}
		return nil
	})
	rel, _ := filepath.Rel(upper, best)
	return rel, bestN
}

// writeModes measures what the overlay gives up by serving writes itself
// (for the freeze): random 4 KiB writes through a plain go-fuse loopback
// with the writeback cache, and with passthrough for writable opens.
func (b *bench) writeModes() error {
	dir := filepath.Join(b.work, "loop")
	mnt := filepath.Join(b.work, "loopmnt")
	os.MkdirAll(dir, 0o755)
	os.MkdirAll(mnt, 0o755)
	if err := copyFile(filepath.Join(b.native, "state.db"), filepath.Join(dir, "state.db")); err != nil {
		return err
	}
	for _, mode := range []string{"daemon-served", "writeback cache", "passthrough"} {
		root, err := fusefs.NewLoopbackRoot(dir)
		if err != nil {
			return err
		}
		opts := &fusefs.Options{MountOptions: fuse.MountOptions{DisableXAttrs: true, MaxWrite: 1 << 20}}
		switch mode {
		case "writeback cache":
			opts.ExtraCapabilities = fuse.CAP_WRITEBACK_CACHE
			opts.DisabledCapabilities = fuse.CAP_PASSTHROUGH
		case "daemon-served":
			opts.DisabledCapabilities = fuse.CAP_PASSTHROUGH
		}
		srv, err := fusefs.Mount(mnt, root, opts)
		if err != nil {
			return err
		}
		best := time.Duration(-1)
		for i := 0; i < b.runs; i++ {
			t := time.Now()
			err = randomWrites(filepath.Join(mnt, "state.db"), 20000, false)
			if d := time.Since(t); best < 0 || d < best {
				best = d
			}
		}
		srv.Unmount()
		if err != nil {
			return err
		}
		t := time.Now()
		randomWrites(filepath.Join(b.native, "state.db"), 20000, false)
		report("go-fuse loopback, 4 KiB random writes: "+mode, "info", time.Since(t), best)
	}
	return nil
}

var _ = syscall.Getpid

// countingReader counts the reads of the image and the time they take.
type countingReader struct {
	ra          io.ReaderAt
	calls, size atomic.Int64
	took        atomic.Int64 // nanoseconds
}

func (c *countingReader) ReadAt(p []byte, off int64) (int, error) {
	t := time.Now()
	n, err := c.ra.ReadAt(p, off)
	c.took.Add(int64(time.Since(t)))
	c.calls.Add(1)
	c.size.Add(int64(n))
	return n, err
}

// take returns the figures since the last take.
func (c *countingReader) take() (calls, size int64, took time.Duration) {
	return c.calls.Swap(0), c.size.Swap(0), time.Duration(c.took.Swap(0))
}

// serve mounts the overlay over -image and serves it until SIGINT or
// SIGTERM, printing the mountpoint and, at the end, the requests served.
func (b *bench) serve() error {
	if b.image == "" {
		return errors.New("-serve needs -image")
	}
	b.mnt = filepath.Join(b.work, "mnt")
	b.upper = filepath.Join(b.work, "upper")
	if err := os.MkdirAll(b.mnt, 0o755); err != nil {
		return err
	}
	b.stats = true
	b.img = b.image
	if err := b.mount(b.image, false); err != nil {
		return err
	}
	fmt.Println(b.mnt)
	<-b.interrupted
	for _, o := range b.curStats.Ops() {
		fmt.Printf("%-12s %8d\n", o.Op, o.Calls)
	}
	return nil
}
