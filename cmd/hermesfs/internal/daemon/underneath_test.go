package daemon

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestRunAdoptsFilesWrittenUnderneath: files written into the mountpoint
// directory while no daemon runs (a writer that outlived the stop) are in
// the next mount and in the store; a file there that the home holds
// otherwise (the seeded original, edited underneath; a memory file) is
// beside it, never over it; what the seed packed is not taken in again,
// a file deleted underneath stays in the home, and the directory
// underneath is left as it was.
func TestRunAdoptsFilesWrittenUnderneath(t *testing.T) {
	needFUSE(t)
	root := tempDir(t)
	store, mp, runDir := filepath.Join(root, "store"), filepath.Join(root, "home"), filepath.Join(root, "run")
	state := filepath.Join(root, "state")
	for _, d := range []string{store, mp} {
		if err := os.Mkdir(d, 0o700); err != nil {
			t.Fatal(err)
		}
	}
	write := func(p, s string) {
		t.Helper()
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte(s), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	// The first mount seeds the store from the directory.
	write(filepath.Join(mp, "seeded.txt"), "seeded\n")
	write(filepath.Join(mp, "config.yaml"), "model: x\n")
	d1 := startDaemon(t, store, mp, state, runDir)
	write(filepath.Join(mp, "home.txt"), "through the mount\n")
	if got := daemonStatus(t, filepath.Join(state, "control.sock")).Adopted; len(got) != 0 {
		t.Errorf("the seed's own files taken in again: %+v", got)
	}
	if err := d1.stop(t); err != nil {
		t.Fatalf("stop: %v", err)
	}

	// No daemon runs: a writer writes into the directory underneath.
	busy := strings.Repeat("a line the writer wrote after the stop\n", 10)
	write(filepath.Join(mp, "busy.log"), busy)
	write(filepath.Join(mp, "logs/agent/run.log"), "early\n")
	write(filepath.Join(mp, "seeded.txt"), "seeded\nedited underneath\n")
	write(filepath.Join(mp, "memories/MEMORY.md"), "not through the guard\n")
	if err := os.Remove(filepath.Join(mp, "config.yaml")); err != nil {
		t.Fatal(err)
	}
	underneath := snapshotDir(t, mp)

	d2 := startDaemon(t, store, mp, state, runDir)
	checkFile(t, filepath.Join(mp, "busy.log"), busy)
	checkFile(t, filepath.Join(mp, "logs/agent/run.log"), "early\n")
	checkFile(t, filepath.Join(mp, "seeded.txt"), "seeded\n")
	checkFile(t, filepath.Join(mp, "config.yaml"), "model: x\n")
	checkFile(t, filepath.Join(mp, "home.txt"), "through the mount\n")
	checkFile(t, onlyMatch(t, filepath.Join(mp, "seeded.txt.underneath-*")), "seeded\nedited underneath\n")
	checkFile(t, onlyMatch(t, filepath.Join(mp, "memories/MEMORY.md.underneath-*")), "not through the guard\n")
	if _, err := os.Stat(filepath.Join(mp, "memories/MEMORY.md")); !os.IsNotExist(err) {
		t.Errorf("a memory file was written around the guard: %v", err)
	}
	st := daemonStatus(t, filepath.Join(state, "control.sock"))
	var paths []string
	for _, a := range st.Adopted {
		paths = append(paths, a.Path)
	}
	if len(st.Adopted) != 4 || !strings.Contains(strings.Join(paths, " "), "busy.log") {
		t.Errorf("status of what was taken in: %+v", st.Adopted)
	}
	if logs := d2.logs.String(); !strings.Contains(logs, "written into the mountpoint directory while no mount covered it") || !strings.Contains(logs, "busy.log") {
		t.Errorf("no warning naming the files taken in:\n%s", logs)
	}
	// Deleted in the home: not back at the next mount, though it is
	// still underneath (written just before this mount started).
	if err := os.Remove(filepath.Join(mp, "logs/agent/run.log")); err != nil {
		t.Fatal(err)
	}
	if err := d2.stop(t); err != nil {
		t.Fatalf("stop: %v", err)
	}
	if got := snapshotDir(t, mp); got != underneath {
		t.Errorf("the directory underneath changed:\n%s\nwant\n%s", got, underneath)
	}
	if got := newestFile(t, store, "busy.log"); got != busy {
		t.Errorf("busy.log in the store: %q", got)
	}

	// Taken in once: the next mount finds nothing new.
	d3 := startDaemon(t, store, mp, state, runDir)
	if got := daemonStatus(t, filepath.Join(state, "control.sock")).Adopted; len(got) != 0 {
		t.Errorf("taken in again: %+v", got)
	}
	if _, err := os.Stat(filepath.Join(mp, "logs/agent/run.log")); !os.IsNotExist(err) {
		t.Errorf("a file deleted in the home came back from underneath: %v", err)
	}
	if err := d3.stop(t); err != nil {
		t.Fatalf("stop: %v", err)
	}
}

// snapshotDir lists dir's regular files with their content.
func snapshotDir(t *testing.T, dir string) string {
	t.Helper()
	var b strings.Builder
	err := filepath.Walk(dir, func(p string, fi os.FileInfo, err error) error {
		if err != nil || !fi.Mode().IsRegular() {
			return err
		}
		c, err := os.ReadFile(p)
		b.WriteString(p + ": " + string(c) + "\n")
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	return b.String()
}

func onlyMatch(t *testing.T, pattern string) string {
	t.Helper()
	m, err := filepath.Glob(pattern)
	if err != nil || len(m) != 1 {
		t.Fatalf("%s: %v, %v", pattern, m, err)
	}
	return m[0]
}
