package main

import (
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/hermesfs/hermesfs/cmd/hermesfs/internal/daemon"
	"github.com/hermesfs/hermesfs/fs"
)

// mountInProcess runs `hermesfs mount args...` in this process (the CLI's
// own code, daemon.Run under it) until the ready line; stop cancels it, as
// SIGTERM does, and returns its exit code.
func mountInProcess(t *testing.T, environ map[string]string, args ...string) (stop func() int) {
	t.Helper()
	var out, errb syncBuffer
	e := &env{stdout: &out, stderr: &errb, getenv: func(k string) string { return environ[k] }}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan int, 1)
	go func() { done <- e.main(ctx, append([]string{"mount"}, args...)) }()
	code := -1
	stop = func() int {
		cancel()
		if code < 0 {
			select {
			case code = <-done:
			case <-time.After(2 * time.Minute):
				t.Fatalf("mount did not stop; stderr:\n%s", errb.String())
			}
		}
		return code
	}
	t.Cleanup(func() { stop() })
	deadline := time.Now().Add(time.Minute)
	for !strings.HasPrefix(out.String(), "ready ") {
		select {
		case code = <-done:
			t.Fatalf("mount exited %d before ready; stderr:\n%s", code, errb.String())
		case <-time.After(20 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			t.Fatalf("no ready line in a minute; stderr:\n%s", errb.String())
		}
	}
	return stop
}

// TestStoppedMountFoundInRegistry: status and umount of a mount whose
// daemon is gone look in the state dir it really used (the registry keeps
// it), not in the default one: a stopped mount made with --state-dir shows
// its store and base snapshot, a killed one's stale mount is detached
// naming the state dir that holds its changes, and a mountpoint with no
// known state says so and what to pass instead of showing an empty state.
func TestStoppedMountFoundInRegistry(t *testing.T) {
	need(t, "/dev/fuse")
	mp, store, state := e2eDir(t, "home"), e2eDir(t, "store"), filepath.Join(e2eDir(t, "custom"), "state")
	runDir := e2eDir(t, "run")
	environ := map[string]string{"HERMESFS_RUNTIME_DIR": runDir}

	stop := mountInProcess(t, environ, "--store", "file://"+store, "--state-dir", state, "--interval", "0", "--log-level", "warn", mp)
	if err := os.WriteFile(filepath.Join(mp, "notes.md"), []byte("kept in the store\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	// The running daemon's registry entry, as a kill -9 would leave it.
	entries, _ := filepath.Glob(filepath.Join(runDir, "*.json"))
	if len(entries) != 1 {
		t.Fatalf("registry %q, want one entry", entries)
	}
	running, err := os.ReadFile(entries[0])
	if err != nil {
		t.Fatal(err)
	}
	if code := stop(); code != exitOK {
		t.Fatalf("mount stopped with %d", code)
	}

	// Stopped: status finds the state dir the mount used.
	code, out, errOut := runCLIEnv(t, environ, "status", "--json", mp)
	var r daemon.StatusReport
	if code != exitFailure || json.Unmarshal([]byte(out), &r) != nil {
		t.Fatalf("status of the stopped mount: exit %d\n%s\n%s", code, out, errOut)
	}
	if r.StateDir != state || r.Base == "" || r.Store != "file://"+store || r.Running {
		t.Errorf("status of the stopped mount: state dir %q, base %q, store %q; want %s, the final snapshot, file://%s", r.StateDir, r.Base, r.Store, state, store)
	}
	if _, text, _ := runCLIEnv(t, environ, "status", mp); !strings.Contains(text, "base snapshot:  "+r.Base) || !strings.Contains(text, "state dir:      "+state) {
		t.Errorf("status text of the stopped mount:\n%s", text)
	}

	// Not in this registry (another boot): no state is known; status says
	// so and to pass --state-dir, instead of an empty report.
	elsewhere := map[string]string{"HERMESFS_RUNTIME_DIR": e2eDir(t, "run2")}
	code, out, errOut = runCLIEnv(t, elsewhere, "status", mp)
	if code != exitFailure || out != "" || !strings.Contains(errOut, "no state is known for "+mp) || !strings.Contains(errOut, "--state-dir") {
		t.Errorf("status without a registry entry: exit %d\nstdout %q\nstderr %q", code, out, errOut)
	}
	if code, out, _ = runCLIEnv(t, elsewhere, "status", "--state-dir", state, mp); code != exitFailure || !strings.Contains(out, r.Base) {
		t.Errorf("status --state-dir: exit %d\n%s", code, out)
	}

	// Killed: the entry keeps the dead daemon's pid, and its dead FUSE
	// mount stays. umount detaches it and names the state dir that holds
	// the changes.
	var e map[string]any
	if err := json.Unmarshal(running, &e); err != nil {
		t.Fatal(err)
	}
	dead := exec.Command("true")
	if err := dead.Run(); err != nil {
		t.Fatal(err)
	}
	e["pid"] = dead.Process.Pid
	b, _ := json.Marshal(e)
	if err := os.WriteFile(entries[0], b, 0o600); err != nil {
		t.Fatal(err)
	}
	deadFUSEMount(t, mp)
	code, out, errOut = runCLIEnv(t, environ, "umount", mp)
	if code != exitOK || !strings.Contains(out, "detached the stale mount at "+mp+" (local changes stay in "+state+" ") {
		t.Errorf("umount of the killed mount: exit %d\nstdout %q\nstderr %q", code, out, errOut)
	}
	if fs.IsMountpoint(mp) {
		t.Error("the stale mount is still there")
	}
}
