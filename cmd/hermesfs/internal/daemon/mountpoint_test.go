package daemon

import (
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/hermesfs/hermesfs/fs"
)

// A mount over a live hermesfs mount of another store and state dir is
// refused, naming the running daemon (from the registry when it knows it,
// else the mount's type): nothing is mounted, nothing packed into the
// other store, and the live mount goes on to publish its own tree.
func TestMountRefusedOverLiveMount(t *testing.T) {
	needFUSE(t)
	root := tempDir(t)
	storeA, storeB, mp := filepath.Join(root, "storeA"), filepath.Join(root, "storeB"), filepath.Join(root, "home")
	stateA, stateB, runDir := filepath.Join(root, "stateA"), filepath.Join(root, "stateB"), filepath.Join(root, "run")
	for _, d := range []string{storeA, storeB, mp} {
		if err := os.Mkdir(d, 0o700); err != nil {
			t.Fatal(err)
		}
	}
	a := startDaemon(t, storeA, mp, stateA, runDir)
	writeFileT(t, filepath.Join(mp, "a.txt"), "the first mount's\n")

	for _, c := range []struct {
		runDir string
		want   []string
	}{
		{runDir, []string{"refusing to mount over a live mount", "pid " + strconv.Itoa(os.Getpid()), "state dir " + stateA, "store file://" + storeA}},
		// A registry that does not know it (another runtime dir).
		{filepath.Join(root, "run-other"), []string{"refusing to mount over it", "fuse.hermesfs"}},
	} {
		b, ready := launchDaemon(t, storeB, mp, stateB, c.runDir)
		select {
		case <-ready:
			t.Fatalf("a second daemon is ready over the live mount; logs:\n%s", b.logs)
		case <-b.done:
		case <-time.After(time.Minute):
			t.Fatalf("the second daemon neither refused nor got ready; logs:\n%s", b.logs)
		}
		if b.err == nil || ExitCode(b.err) != ExitFailure {
			t.Fatalf("second daemon over a live mount: %v (exit %d)", b.err, ExitCode(b.err))
		}
		t.Logf("refused: %v", b.err)
		for _, w := range c.want {
			if !strings.Contains(b.err.Error(), w) {
				t.Errorf("refusal %q does not say %q", b.err, w)
			}
		}
	}
	checkFile(t, filepath.Join(mp, "a.txt"), "the first mount's\n")
	writeFileT(t, filepath.Join(mp, "b.txt"), "written after the refusals\n")
	if names, _ := filepath.Glob(filepath.Join(storeB, "*", "*")); len(names) > 0 {
		t.Errorf("the refused mount wrote to its store: %v", names)
	}
	if err := a.stop(t); err != nil {
		t.Fatalf("the first mount's stop: %v", err)
	}
	for name, want := range map[string]string{"a.txt": "the first mount's\n", "b.txt": "written after the refusals\n"} {
		if got := newestFile(t, storeA, name); got != want {
			t.Errorf("%s in the first mount's store: %q, want %q", name, got, want)
		}
	}
}

// TestRunSymlinkedMountpoint: a mountpoint given as a symlink is the
// directory it names. A symlink to a live hermesfs mount is refused like
// that mount's own path (nothing seeded, the live mount still served); a
// symlink to a plain directory mounts that directory, registered under its
// path, and the symlink finds the running daemon.
func TestRunSymlinkedMountpoint(t *testing.T) {
	needFUSE(t)
	root := tempDir(t)
	storeA, storeB, mpA, mpB, runDir := filepath.Join(root, "store-a"), filepath.Join(root, "store-b"), filepath.Join(root, "home-a"), filepath.Join(root, "home-b"), filepath.Join(root, "run")
	for _, d := range []string{storeA, storeB, mpA, mpB} {
		if err := os.Mkdir(d, 0o700); err != nil {
			t.Fatal(err)
		}
	}
	a := startDaemon(t, storeA, mpA, filepath.Join(root, "state-a"), runDir)
	if err := os.WriteFile(filepath.Join(mpA, "a.txt"), []byte("served by A\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	linkA := filepath.Join(root, "link-a")
	if err := os.Symlink("home-a", linkA); err != nil {
		t.Fatal(err)
	}
	logs, err := runRefused(t, storeB, linkA, filepath.Join(root, "state-b"), nil) // its runtime dir: root/run
	if err == nil || !strings.Contains(err.Error(), "already mounted by a running hermesfs") {
		t.Errorf("a mount through a symlink to a live mount: %v (exit %d), want it refused naming the daemon; logs:\n%s", err, ExitCode(err), logs)
	}
	if ents, _ := os.ReadDir(storeB); len(ents) > 0 {
		t.Errorf("the refused mount wrote to its store: %v", ents)
	}
	if got, err := os.ReadFile(filepath.Join(mpA, "a.txt")); err != nil || string(got) != "served by A\n" {
		t.Errorf("A's mount after the refusal: %q %v", got, err)
	}
	if err := a.stop(t); err != nil {
		t.Fatalf("A: %v", err)
	}

	linkB := filepath.Join(root, "link-b")
	if err := os.Symlink(mpB, linkB); err != nil {
		t.Fatal(err)
	}
	b := startDaemon(t, storeB, linkB, filepath.Join(root, "state-b"), runDir)
	if !fs.IsMountpoint(mpB) {
		t.Fatalf("nothing mounted at %s, the directory the symlink names", mpB)
	}
	if _, err := os.Stat(registryPath(runDir, mpB)); err != nil {
		t.Errorf("registry entry under the directory's path: %v", err)
	}
	loc, err := locateDaemon(&env{Options{Getenv: func(k string) string {
		if k == "HERMESFS_RUNTIME_DIR" {
			return runDir
		}
		return ""
	}}}, linkB, "")
	if err != nil || loc.From != FromRunning || loc.Mountpoint != mpB {
		t.Errorf("locating the daemon through the symlink: %+v %v", loc, err)
	}
	if err := b.stop(t); err != nil {
		t.Fatal(err)
	}
}
