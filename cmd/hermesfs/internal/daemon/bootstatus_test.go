package daemon

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// TestSeedSaysWhatItDoes: while a first seed packs and uploads a home
// (minutes for a big one), the daemon is not ready and its control socket
// does not answer; it says at once on its log that it seeds, and status
// (BootingReport, from boot.json) says it is starting and what it does.
// Once ready, boot.json is gone.
func TestSeedSaysWhatItDoes(t *testing.T) {
	needFUSE(t)
	dir := tempDir(t)
	store, mp, state, run := filepath.Join(dir, "store"), filepath.Join(dir, "home"), filepath.Join(dir, "state"), filepath.Join(dir, "run")
	for i, name := range []string{"a", "b/c", "b/d"} {
		p := filepath.Join(mp, name)
		os.MkdirAll(filepath.Dir(p), 0o755)
		if err := os.WriteFile(p, []byte(strings.Repeat("x", 1000*(i+1))), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	packed, release := make(chan struct{}), make(chan struct{})
	seedPacked = func() {
		close(packed)
		<-release
	}
	t.Cleanup(func() { seedPacked = nil })
	r, ready := launchDaemon(t, store, mp, state, run)
	select {
	case <-packed:
	case <-r.done:
		t.Fatalf("Run returned before the seed was packed: %v", r.err)
	case <-time.After(time.Minute):
		t.Fatal("the seed was not packed within a minute")
	}
	// Said as the seed begins, not once the pack is done.
	if logs := r.logs.String(); !strings.Contains(logs, "seeding the store from the existing directory: the store is empty and the mountpoint directory is not") {
		t.Errorf("the log does not say as it begins that the store is being seeded:\n%s", logs)
	}
	rep, ok := BootingReport(mp, state)
	if !ok || !rep.Running || rep.PID != os.Getpid() || !strings.Contains(rep.Boot, "seeding the store from the existing directory: packed 3 files") || !strings.Contains(rep.Boot, "uploading") {
		t.Errorf("status while the seed uploads: %v %+v", ok, rep)
	}
	close(release)
	select {
	case <-ready:
	case <-r.done:
		t.Fatalf("Run returned before ready: %v", r.err)
	case <-time.After(time.Minute):
		t.Fatal("no ready line within a minute of the seed's upload")
	}
	if rep, ok := BootingReport(mp, state); ok {
		t.Errorf("ready, and status still says it boots: %+v", rep)
	}
	if _, err := os.Stat(filepath.Join(state, bootFile)); !os.IsNotExist(err) {
		t.Errorf("boot.json after ready: %v", err)
	}
	if err := r.stop(t); err != nil {
		t.Fatal(err)
	}
}
