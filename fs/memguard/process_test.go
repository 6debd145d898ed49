package memguard

import (
	"os"
	"path/filepath"
	"runtime"
	"syscall"
	"testing"
)

func TestProcessOfThread(t *testing.T) {
	// Any thread of this process, not only the main one, resolves to it.
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	tid := uint32(syscall.Gettid())
	pid, name := process("/proc", tid)
	if pid != uint32(os.Getpid()) {
		t.Errorf("process(%d) = %d, want %d", tid, pid, os.Getpid())
	}
	comm, err := os.ReadFile("/proc/self/comm")
	if err != nil {
		t.Fatal(err)
	}
	if want := string(comm[:len(comm)-1]); name != want {
		t.Errorf("process name %q, want %q", name, want)
	}

	// An id /proc does not know is kept; 0 (no caller) stays 0.
	if pid, name := process(t.TempDir(), 4242); pid != 4242 || name != "" {
		t.Errorf("unknown id: %d %q", pid, name)
	}
	if pid, name := process("/proc", 0); pid != 0 || name != "" {
		t.Errorf("id 0: %d %q", pid, name)
	}

	// Through Check, into the audit log.
	g := newTestGuard(t, Options{})
	g.proc = "/proc"
	if err := g.Check(t.Context(), memFile, nil, []byte("x"), tid); err != nil {
		t.Fatal(err)
	}
	ev, err := ReadAudit(g.audit, 1, false)
	if err != nil || len(ev) != 1 || ev[0].PID != uint32(os.Getpid()) || ev[0].Process != name {
		t.Fatalf("audit: %+v %v", ev, err)
	}
}

func TestProcessStatusWithoutTgid(t *testing.T) {
	proc := t.TempDir()
	if err := os.MkdirAll(filepath.Join(proc, "77"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(proc, "77", "status"), []byte("Name:\tsed\nState:\tR\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if pid, name := process(proc, 77); pid != 77 || name != "sed" {
		t.Errorf("process = %d %q, want 77 sed", pid, name)
	}
}
