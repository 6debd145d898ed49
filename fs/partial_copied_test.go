package fs

import (
	"bytes"
	iofs "io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

// liveCopyFixture is a mount whose big.db was changed in a few places and
// is copied up by range with its background copy held: the state a copy
// of a running daemon's state dir meets.
type liveCopyFixture struct {
	e       *env
	lower   Lower
	opts    Options
	content []byte // what a reader of big.db saw before the copy
	mapPath string // big.db's present-map in the upper layer
}

func newLiveCopyFixture(t *testing.T, seed uint64) *liveCopyFixture {
	t.Helper()
	lower, content := rangeLower(t, 6<<20+777, seed)
	// Blocks of four change ranges, so a block holds changed and
	// unchanged ranges.
	opts := Options{CopyUpByRangeMin: 1 << 20, CopyUpBlock: 4 * changeBlock, CopyUpPause: time.Millisecond, holdCopyUps: true}
	e := mountEnv(t, lower, opts)
	f, err := os.OpenFile(e.path("big.db"), os.O_RDWR, 0)
	must(t, err)
	for i, off := range []int{5, 70_000, 1_000_000, 2_222_222, len(content) - 12_100} {
		b := randBytes(7+i*3000, seed+uint64(i)+100)
		if _, err := f.WriteAt(b, int64(off)); err != nil {
			t.Fatal(err)
		}
		copy(content[off:], b)
	}
	must(t, f.Close())
	if ps := e.m.PartialCopyUps(); len(ps) != 1 || ps[0].Present*4 >= ps[0].Size {
		t.Fatalf("not partial: %+v", ps)
	}
	checkFile(t, e.path("big.db"), content, "before the copy")
	maps, err := filepath.Glob(filepath.Join(e.upper, partialDirName, "*-*"))
	must(t, err)
	if len(maps) != 1 {
		t.Fatalf("present-maps: %v", maps)
	}
	return &liveCopyFixture{e: e, lower: lower, opts: opts, content: content, mapPath: maps[0]}
}

// letCopyInRun lets the held background copy bring every block in.
func (x *liveCopyFixture) letCopyInRun(t *testing.T) {
	t.Helper()
	x.e.m.holdCopyUps(false)
	waitComplete(t, x.e.m)
}

// mountCopy mounts a copy of the upper layer and returns it, or the error
// of a refused mount.
func (x *liveCopyFixture) mountCopy(t *testing.T, upper string) (*env, error) {
	t.Helper()
	mnt := filepath.Join(tempDir(t), "mnt")
	must(t, os.Mkdir(mnt, 0o755))
	o := x.opts
	o.holdCopyUps = false
	o.Upper, o.Lower, o.Logger = upper, x.lower, testLogger(t)
	m, err := Mount(t.Context(), mnt, o)
	if err != nil {
		return nil, err
	}
	c := &env{t: t, m: m, mnt: mnt, upper: upper, opts: o}
	t.Cleanup(c.unmount)
	return c, nil
}

// checkCopy checks every byte of the copy's big.db, while its copy runs,
// once complete, in a snapshot view, and after a remount.
func (x *liveCopyFixture) checkCopy(t *testing.T, c *env, want []byte) {
	t.Helper()
	checkFile(t, c.path("big.db"), want, "the copy")
	waitComplete(t, c.m)
	checkFile(t, c.path("big.db"), want, "the copy, completed")
	v, err := c.m.Freeze(t.Context())
	must(t, err)
	got, err := iofs.ReadFile(v, "big.db")
	v.Close()
	must(t, err)
	if !bytes.Equal(got, want) {
		t.Fatal("the copy's snapshot view of big.db differs from what a reader saw before the copy")
	}
	c.remount()
	checkFile(t, c.path("big.db"), want, "the copy, remounted")
}

// TestPartialCopyUpCopiedLiveStateDir copies the upper layer of a running
// mount while a file's background copy by range runs, so that the copy
// reads the file before blocks come in and the map after (as rsync does,
// and cp -a of the directory followed by the map again). Mounting the copy
// serves every byte as a reader saw it before the copy, never zeros, also
// once the copy completes and in a snapshot.
func TestPartialCopyUpCopiedLiveStateDir(t *testing.T) {
	t.Parallel()
	t.Run("rsync", func(t *testing.T) {
		t.Parallel()
		rsync, strace := needTool(t, "rsync"), needTool(t, "strace")
		x := newLiveCopyFixture(t, 61)
		// One plain rsync -a of the live upper layer. rsync lists a
		// directory when the files listed before it are under way: with
		// many files in one that sorts before the map's, it reads
		// big.db before it lists the map's directory. Its sender stops
		// there (SIGSTOP, by strace, at its first getdents64 of that
		// directory), and meanwhile every block is copied in.
		must(t, os.Mkdir(x.e.path("!many"), 0o755))
		for i := range 1100 {
			must(t, os.WriteFile(x.e.path("!many/f"+strconv.Itoa(i)), []byte("x"), 0o644))
		}
		upper := filepath.Join(tempDir(t), "upper")
		trace := filepath.Join(tempDir(t), "strace.log")
		cmd := exec.Command(strace, "-f", "-qq", "-o", trace, "-P", filepath.Dir(x.mapPath),
			"-e", "trace=getdents64", "-e", "inject=getdents64:signal=SIGSTOP:when=1",
			rsync, "-a", x.e.upper+"/", upper)
		var out bytes.Buffer
		cmd.Stdout, cmd.Stderr = &out, &out
		must(t, cmd.Start())
		done := make(chan error, 1)
		go func() { done <- cmd.Wait() }()
		t.Cleanup(func() {
			cmd.Process.Kill()
			<-done
		})
		stopped := 0
		for deadline := time.Now().Add(60 * time.Second); stopped == 0; {
			select {
			case err := <-done:
				done <- err
				t.Fatalf("rsync ended before it read the map (%v): the copy did not meet a running copy-up\n%s", err, out.String())
			case <-time.After(5 * time.Millisecond):
			}
			if time.Now().After(deadline) {
				t.Fatalf("rsync did not stop at the map\n%s", out.String())
			}
			stopped = stoppedBySIGSTOP(trace)
		}
		x.letCopyInRun(t)
		must(t, syscall.Kill(stopped, syscall.SIGCONT))
		if err := <-done; err != nil {
			done <- err
			t.Fatalf("rsync: %v\n%s", err, out.String())
		}
		done <- nil
		// The copy met a running copy-up: it read blocks of big.db as
		// holes that its map says are in.
		copied, err := os.ReadFile(filepath.Join(upper, "big.db"))
		must(t, err)
		holes := 0
		for i := 0; i+4096 <= len(copied); i += 4096 {
			if allZero(copied[i:i+4096]) && !allZero(x.content[i:i+4096]) {
				holes++
			}
		}
		if holes == 0 {
			t.Fatal("rsync read big.db after the blocks came in: nothing tested")
		}
		t.Logf("the copy of big.db holds %d pages of zeros where it has data", holes)
		c, err := x.mountCopy(t, upper)
		if err != nil {
			t.Fatalf("mount the copy: %v", err)
		}
		x.checkCopy(t, c, x.content)
	})
	t.Run("cp", func(t *testing.T) {
		t.Parallel()
		cp := needTool(t, "cp")
		x := newLiveCopyFixture(t, 62)
		upper := filepath.Join(tempDir(t), "upper")
		run(t, cp, "-a", x.e.upper, upper)
		x.letCopyInRun(t)
		run(t, cp, "-a", filepath.Dir(x.mapPath)+"/.", filepath.Join(upper, partialDirName))
		c, err := x.mountCopy(t, upper)
		if err != nil {
			t.Fatalf("mount the copy: %v", err)
		}
		x.checkCopy(t, c, x.content)
	})
}

// TestPartialCopyUpCopiedLiveDoubt: where a copy of a live state dir
// holds zeros over a range the map says was changed, neither the zeros
// nor the lower bytes can be vouched for: the mount is refused, naming
// the file. A copy made after the daemon stopped is trusted with the
// same zeros (they are the user's).
func TestPartialCopyUpCopiedLiveDoubt(t *testing.T) {
	t.Parallel()
	cp := needTool(t, "cp")
	t.Run("changed-after-the-file-was-copied", func(t *testing.T) {
		t.Parallel()
		x := newLiveCopyFixture(t, 63)
		upper := filepath.Join(tempDir(t), "upper")
		run(t, cp, "-a", x.e.upper, upper)
		// A write into a block not yet in: it comes in, and changes,
		// after the copy read the file, before it reads the map.
		f, err := os.OpenFile(x.e.path("big.db"), os.O_RDWR, 0)
		must(t, err)
		_, err = f.WriteAt(randBytes(50_000, 7), 4_000_000)
		must(t, err)
		must(t, f.Close())
		run(t, cp, "-a", filepath.Dir(x.mapPath)+"/.", filepath.Join(upper, partialDirName))
		wantDoubt(t, x, upper)
	})
	t.Run("zeros-written-before", func(t *testing.T) {
		t.Parallel()
		x := newLiveCopyFixture(t, 64)
		f, err := os.OpenFile(x.e.path("big.db"), os.O_RDWR, 0)
		must(t, err)
		_, err = f.WriteAt(make([]byte, 3000), 3_000_100)
		must(t, err)
		must(t, f.Close())
		clear(x.content[3_000_100:3_003_100])
		upper := filepath.Join(tempDir(t), "upper")
		run(t, cp, "-a", x.e.upper, upper)
		wantDoubt(t, x, upper)

		// The same zeros in a copy made after the daemon stopped.
		x.e.unmount()
		upper = filepath.Join(tempDir(t), "upper2")
		run(t, cp, "-a", x.e.upper, upper)
		c, err := x.mountCopy(t, upper)
		if err != nil {
			t.Fatalf("a copy of a stopped daemon's state dir was refused: %v", err)
		}
		x.checkCopy(t, c, x.content)
	})
}

func wantDoubt(t *testing.T, x *liveCopyFixture, upper string) {
	t.Helper()
	c, err := x.mountCopy(t, upper)
	if err == nil {
		got, rerr := os.ReadFile(c.path("big.db"))
		t.Fatalf("the copy mounted (big.db the same as before the copy: %v, read error %v)", bytes.Equal(got, x.content), rerr)
	}
	t.Logf("refused: %v", err)
	for _, want := range []string{"state dir was copied", `"big.db"`, "not mounted", "hermesfs umount", partialDirName} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("the refusal does not say %q", want)
		}
	}
}

func run(t *testing.T, name string, args ...string) {
	t.Helper()
	if out, err := exec.Command(name, args...).CombinedOutput(); err != nil {
		t.Fatalf("%s %s: %v\n%s", name, strings.Join(args, " "), err, out)
	}
}

// stoppedBySIGSTOP is the id of the process strace's log (-f) says was
// stopped by SIGSTOP, or 0.
func stoppedBySIGSTOP(log string) int {
	b, _ := os.ReadFile(log)
	for _, line := range strings.Split(string(b), "\n") {
		if pid, rest, ok := strings.Cut(line, " "); ok && strings.Contains(rest, "--- stopped by SIGSTOP ---") {
			n, _ := strconv.Atoi(pid)
			return n
		}
	}
	return 0
}
