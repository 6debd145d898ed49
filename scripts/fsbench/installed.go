package main

// -installed: what an installed agent does with its home (genhome
// -install): imports, requires, git status, walks and reads, on native
// disk, on the overlay, and on the kernel's squashfs under overlayfs, all
// three over the same tree (the two mounts over the same image), in one
// run.
//
// Cold means: the tree freshly mounted and the page cache dropped. Before
// each cold run, the overlay is unmounted and mounted again over a fresh
// archive.Open of the image (so nothing the overlay and its reader keep in
// memory survives: decompressed blocks, directory and inode lookups), the
// kernel's overlayfs and squashfs likewise (the squashfs caches live with
// its superblock), then `sync; echo 3 > /proc/sys/vm/drop_caches` empties
// the page cache, dentries and inodes for all three. The upper layers are
// kept: the git index each mount rewrote on its first status (its inode
// numbers are not the native tree's) stays rewritten, as on a host that ran
// git there before. Warm means: the same command run just before on the
// same tree. Each figure is the median of -trials runs; the trees take
// turns, so all three see the same machine.

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime/pprof"
	"slices"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/hermesfs/hermesfs/archive"
	"github.com/hermesfs/hermesfs/fs"
)

// The packages the import and require benchmarks load: the ones genhome
// -install copies into the tree (BenchImports and BenchRequires in
// scripts/genhome/install.go).
var (
	installedImports = []string{"yaml", "requests", "jinja2", "pydantic", "prompt_toolkit", "pygments.lexers.python", "click", "dotenv",
		"dateutil.parser", "attrs", "jsonschema", "cryptography.fernet", "sniffio", "regex", "orjson", "werkzeug", "flask", "docutils.core",
		"pyparsing", "wrapt"}
	installedRequires = []string{"@npmcli/arborist", "pacote", "cacache", "make-fetch-happen", "tar", "glob", "semver", "minimatch",
		"chalk", "debug", "lru-cache", "npm-registry-fetch"}
)

type workload struct {
	key  string // names it in -workloads
	name string
	fn   func(root string) error
}

// installedKeys are the -installed workloads, in the order they run.
var installedKeys = []string{"python", "node", "git", "find", "stat", "read"}

type tree struct {
	name  string
	root  string
	fresh func() error // remounts it (nil: native disk)
}

// runInstalled packs the home, mounts the overlay and the kernel's
// reference over it, and runs every workload cold and warm.
func (b *bench) runInstalled(trials int, profileDir string) error {
	if profileDir != "" {
		b.stats = true
		if err := os.MkdirAll(profileDir, 0o755); err != nil {
			return err
		}
	}
	if err := os.RemoveAll(b.work); err != nil {
		return err
	}
	b.mnt = filepath.Join(b.work, "mnt")
	b.upper = filepath.Join(b.work, "upper")
	if err := os.MkdirAll(b.mnt, 0o755); err != nil {
		return err
	}
	b.cleanups = append(b.cleanups, func() { os.RemoveAll(b.work) })
	if _, err := os.Stat(filepath.Join(b.home, "hermes-agent", "venv", "pyvenv.cfg")); err != nil {
		return fmt.Errorf("%s has no installed agent (genhome -install): %w", b.home, err)
	}
	img := b.image
	if img == "" {
		img = filepath.Join(b.work, "lower.sqfs")
	}
	if _, err := os.Stat(img); err != nil {
		start := time.Now()
		f, err := os.Create(img)
		if err != nil {
			return err
		}
		_, err = archive.PackDir(context.Background(), f, b.home, archive.PackOptions{})
		if cerr := f.Close(); err == nil {
			err = cerr
		}
		if err != nil {
			return err
		}
		fmt.Printf("# packed %s in %s\n", b.home, time.Since(start).Round(time.Millisecond))
	} else {
		fmt.Printf("# reusing %s\n", img)
	}
	b.img = img
	if err := b.mount(img, false); err != nil {
		return err
	}
	trees := []tree{
		{"native", b.home, nil},
		{"hermesfs", b.mnt, func() error { return b.remount(false) }},
	}
	k, err := b.kernelOverlay(img)
	if err != nil {
		fmt.Printf("# kernel squashfs + overlayfs: skipped: %v\n", err)
	} else {
		trees = append(trees, k)
	}

	venv := "hermes-agent/venv"
	node, err := exec.LookPath("node")
	if err != nil {
		return err
	}
	script := "import " + strings.Join(installedImports, ", ")
	var js strings.Builder
	for _, r := range installedRequires {
		fmt.Fprintf(&js, "require(%q);", r)
	}
	workloads := []workload{
		{"python", fmt.Sprintf("python: import %d packages from the venv", len(installedImports)), func(root string) error {
			v := filepath.Join(root, venv)
			return command(root, []string{"PYTHONHOME=" + v, "PYTHONNOUSERSITE=1", "PYTHONDONTWRITEBYTECODE=1"}, "", filepath.Join(v, "bin", "python3"), "-c", script)
		}},
		{"node", fmt.Sprintf("node -e: require %d packages", len(installedRequires)), func(root string) error {
			return command(filepath.Join(root, "hermes-agent"), nil, "", node, "-e", js.String())
		}},
		{"git", "git status of the checkout", func(root string) error {
			return command(filepath.Join(root, "hermes-agent"), nil, "", "git", "status", "--porcelain")
		}},
		{"find", "find over the whole home", func(root string) error { return command(root, nil, "-", "find", ".") }},
		{"stat", "stat every entry", statAll},
		{"read", "read every file", readAll},
	}
	if len(b.workloads) > 0 {
		var keep []workload
		for _, w := range workloads {
			if b.workloads[w.key] {
				keep = append(keep, w)
			}
		}
		workloads = keep
	}
	// The first git status on a mount rewrites the index (the inode
	// numbers differ from the native tree's); every tree runs each
	// workload once before anything is measured.
	for _, w := range workloads {
		for _, t := range trees {
			if err := w.fn(t.root); err != nil {
				return fmt.Errorf("%s on %s: %w", w.name, t.name, err)
			}
		}
	}
	if profileDir != "" {
		return b.profileInstalled(trees[:2], workloads, profileDir)
	}
	files, size := countTree(b.home)
	fmt.Printf("# home: %d files, %.1f MiB; median of %d runs; ratios to native\n", files, float64(size)/(1<<20), trials)
	fmt.Printf("%-46s %-5s", "workload", "")
	for _, t := range trees {
		fmt.Printf(" %12s", t.name)
		if t.fresh != nil {
			fmt.Printf(" %7s", "ratio")
		}
	}
	fmt.Println()
	for _, w := range workloads {
		for _, cold := range []bool{true, false} {
			times := make([][]time.Duration, len(trees))
			for i := 0; i < trials; i++ {
				for ti, t := range trees {
					if cold {
						if t.fresh != nil {
							if err := t.fresh(); err != nil {
								return fmt.Errorf("remounting %s: %w", t.name, err)
							}
						}
						if err := dropCaches(); err != nil {
							return fmt.Errorf("cold runs need root: %w", err)
						}
					}
					start := time.Now()
					if err := w.fn(t.root); err != nil {
						return fmt.Errorf("%s on %s: %w", w.name, t.name, err)
					}
					times[ti] = append(times[ti], time.Since(start))
				}
			}
			mode := "warm"
			if cold {
				mode = "cold"
			}
			fmt.Printf("%-46s %-5s", w.name, mode)
			base := median(times[0])
			for ti, t := range trees {
				m := median(times[ti])
				fmt.Printf(" %12s", dur(m))
				if t.fresh != nil {
					fmt.Printf(" %7.2f", float64(m)/float64(base))
				}
			}
			fmt.Println()
		}
	}
	return nil
}

func median(d []time.Duration) time.Duration {
	s := slices.Clone(d)
	slices.Sort(s)
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}

// command runs name in dir; with out "-" its output is discarded,
// otherwise it must print nothing (git status of a clean checkout).
func command(dir string, env []string, out string, name string, args ...string) error {
	cmd := exec.Command(name, args...)
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), env...)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("%s: %v: %s", name, err, stderr.Bytes())
	}
	if out != "-" && stdout.Len() > 0 {
		return fmt.Errorf("%s printed %q", name, firstLines(stdout.String(), 5))
	}
	return nil
}

func firstLines(s string, n int) string {
	l := strings.SplitN(s, "\n", n+1)
	return strings.Join(l[:min(n, len(l))], "\n")
}

// kernelOverlay mounts img with the kernel's squashfs (loop) as the lower
// layer of an overlayfs with an empty upper: the reference.
func (b *bench) kernelOverlay(img string) (tree, error) {
	lower := filepath.Join(b.work, "klower")
	upper := filepath.Join(b.work, "kupper")
	wd := filepath.Join(b.work, "kwork")
	mnt := filepath.Join(b.work, "kmnt")
	for _, d := range []string{lower, upper, wd, mnt} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			return tree{}, err
		}
	}
	up := func() error {
		if out, err := exec.Command("mount", "-t", "squashfs", "-o", "loop,ro", img, lower).CombinedOutput(); err != nil {
			return fmt.Errorf("mount -t squashfs: %v: %s", err, out)
		}
		opts := fmt.Sprintf("lowerdir=%s,upperdir=%s,workdir=%s", lower, upper, wd)
		if out, err := exec.Command("mount", "-t", "overlay", "overlay", "-o", opts, mnt).CombinedOutput(); err != nil {
			unix.Unmount(lower, unix.MNT_DETACH)
			return fmt.Errorf("mount -t overlay: %v: %s", err, out)
		}
		return nil
	}
	down := func() error {
		if err := unix.Unmount(mnt, 0); err != nil {
			return fmt.Errorf("umount %s: %w", mnt, err)
		}
		return unix.Unmount(lower, 0)
	}
	if err := up(); err != nil {
		return tree{}, err
	}
	b.cleanups = append(b.cleanups, func() {
		unix.Unmount(mnt, unix.MNT_DETACH)
		unix.Unmount(lower, unix.MNT_DETACH)
	})
	return tree{"kernel", mnt, func() error {
		if err := down(); err != nil {
			return err
		}
		return up()
	}}, nil
}

// profileInstalled runs each workload once cold and once warm on native
// disk (trees[0]) and the overlay (trees[1]), and prints the FUSE requests
// the overlay served for each run by operation, with their mean sampled
// latency; a CPU profile of this process (the overlay serving the run)
// goes to dir for each.
func (b *bench) profileInstalled(trees []tree, workloads []workload, dir string) error {
	for _, w := range workloads {
		for i, cold := range []bool{true, false, false} {
			mode := "warm"
			if cold {
				mode = "cold"
			}
			if i == 1 {
				// Just after the cold run: what it left to refresh.
				mode = "warm1"
			}
			var took [2]time.Duration
			var ops []fs.OpStat
			var reads struct {
				calls, size int64
				took        time.Duration
			}
			for ti, t := range trees {
				if cold {
					if t.fresh != nil {
						if err := t.fresh(); err != nil {
							return fmt.Errorf("remounting %s: %w", t.name, err)
						}
					}
					if err := dropCaches(); err != nil {
						return fmt.Errorf("cold runs need root: %w", err)
					}
				}
				var before []fs.OpStat
				var prof *os.File
				if t.fresh != nil {
					before = b.curStats.Ops()
					b.imageReads.take()
					f, err := os.Create(filepath.Join(dir, profileName(w.name)+"-"+mode+".prof"))
					if err != nil {
						return err
					}
					prof = f
					if err := pprof.StartCPUProfile(f); err != nil {
						f.Close()
						return err
					}
				}
				start := time.Now()
				err := w.fn(t.root)
				took[ti] = time.Since(start)
				if prof != nil {
					pprof.StopCPUProfile()
					prof.Close()
					ops = opsSince(before, b.curStats.Ops())
					reads.calls, reads.size, reads.took = b.imageReads.take()
				}
				if err != nil {
					return fmt.Errorf("%s on %s: %w", w.name, t.name, err)
				}
			}
			fmt.Printf("%s, %s: native %s, hermesfs %s (%.2fx)\n", w.name, mode, dur(took[0]), dur(took[1]), float64(took[1])/float64(took[0]))
			var total uint64
			for _, o := range ops {
				total += o.Calls
				mean := time.Duration(0)
				if o.Samples > 0 {
					mean = o.Sum / time.Duration(o.Samples)
				}
				fmt.Printf("    %-12s %8d  mean %s\n", o.Op, o.Calls, dur(mean))
			}
			fmt.Printf("    %-12s %8d\n", "total", total)
			fmt.Printf("    image reads %d, %.1f MiB, %s in all\n", reads.calls, float64(reads.size)/(1<<20), dur(reads.took))
		}
	}
	return nil
}

// opsSince returns the requests of after not yet in before (the latency
// figures are after's own: sampled over the mount's life).
func opsSince(before, after []fs.OpStat) []fs.OpStat {
	var out []fs.OpStat
	for _, a := range after {
		for _, o := range before {
			if o.Op == a.Op {
				a.Calls -= o.Calls
				a.Samples -= o.Samples
				a.Sum -= o.Sum
			}
		}
		if a.Calls > 0 {
			out = append(out, a)
		}
	}
	return out
}

// profileName turns a workload's name into a file name.
func profileName(name string) string {
	f := strings.Fields(strings.Map(func(r rune) rune {
		if r >= 'a' && r <= 'z' || r >= '0' && r <= '9' {
			return r
		}
		return ' '
	}, strings.ToLower(name)))
	return strings.Join(f[:min(len(f), 3)], "-")
}
