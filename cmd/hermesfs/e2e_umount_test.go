package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/hermesfs/hermesfs/fs"
)

// umount never detaches a mount that still answers: from a shell that
// knows neither the daemon's state dir nor its registry, it refuses and
// says what to pass, as often as it is asked; the daemon goes on serving
// and, told its state dir, stops with its final snapshot.
func TestE2EUmountRefusesLiveMountWithoutDaemon(t *testing.T) {
	t.Parallel()
	need(t, "/dev/fuse")
	storeDir := e2eDir(t, "store")
	mp := e2eDir(t, "home")
	a := newHost(t, "file://"+storeDir)
	d := a.mount(mp, "--interval", "0")
	writeFile(t, filepath.Join(mp, "x.txt"), "kept\n", 0o644)

	lost := &host{t: t, runtime: e2eDir(t, "run-other"), store: a.store}
	for range 2 {
		code, out, errOut := lost.run("umount", mp)
		if code != exitFailure || !strings.Contains(errOut, "not detaching it") || !strings.Contains(errOut, "--state-dir") {
			t.Fatalf("umount of a live mount whose daemon it cannot find: exit %d %q %s", code, out, errOut)
		}
		select {
		case <-d.done:
			t.Fatalf("the daemon exited (%d) after a refused umount:\n%s", d.code, d.stderr)
		default:
		}
		if !fs.IsMountpoint(mp) {
			t.Fatal("the live mount was detached")
		}
		if got, err := os.ReadFile(filepath.Join(mp, "x.txt")); err != nil || string(got) != "kept\n" {
			t.Fatalf("read through the mount after a refused umount: %q %v", got, err)
		}
	}
	code, out, errOut := lost.run("umount", "--state-dir", a.state, mp)
	if code != 0 || strings.TrimSpace(out) == "" {
		t.Fatalf("umount --state-dir: exit %d %q %s", code, out, errOut)
	}
	if c := d.wait(); c != 0 {
		t.Fatalf("daemon exit %d:\n%s", c, d.stderr)
	}
	if id := localLatest(t, storeDir); id != strings.TrimSpace(out) {
		t.Errorf("LATEST %s, want the final snapshot %s", id, strings.TrimSpace(out))
	}
}
