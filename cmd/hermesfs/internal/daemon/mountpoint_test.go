package daemon

import (
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"
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
