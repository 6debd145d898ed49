package main

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/hermesfs/hermesfs/fs"
	"github.com/hermesfs/hermesfs/uploader"
)

// onAnotherMachine makes h's daemons run as on another machine: in a UTS
// namespace of their own, with hostname name (a lease names the machine by
// its hostname and machine id).
func onAnotherMachine(t *testing.T, h *host, name string) {
	t.Helper()
	need(t, "unshare", "hostname")
	if os.Geteuid() != 0 {
		t.Skip("a UTS namespace needs root")
	}
	h.wrap = []string{"unshare", "--uts", "sh", "-c", `hostname "$0" && exec "$@"`, name}
}

// TestE2EReplacementHostWaitsForLease: a host holds the store's writer
// lease; a replacement host (another machine, its own state dir) is
// started once, as systemd or a container runtime would. Its one `hermesfs
// mount` does not exit: it shows the home read-only at once (writes fail
// with EROFS), says what it waits for (stderr, status), and once the first
// host is killed (kill -9, its state dir lost) and its lease lapses it
// becomes ready and writable, and a write made there reaches the store.
func TestE2EReplacementHostWaitsForLease(t *testing.T) {
	need(t, "/dev/fuse", "unsquashfs")
	storeDir := e2eDir(t, "store")
	store := "file://" + storeDir
	mpOld, mpNew := e2eDir(t, "home-old"), e2eDir(t, "home-new")
	old, repl := newHost(t, store), newHost(t, store)
	// A short lease, so that the test waits seconds, not 25 s.
	old.extraEnv = []string{"HERMESFS_TEST_LEASE_TTL=3s"}
	repl.extraEnv = []string{"HERMESFS_TEST_LEASE_TTL=3s"}
	onAnotherMachine(t, old, "old-vm")

	dOld := old.mount(mpOld, "--interval", "0")
	writeFile(t, filepath.Join(mpOld, "memories", "MEMORY.md"), "written on the old host\n", 0o644)
	if code, _, errOut := old.run("snapshot", mpOld); code != 0 {
		t.Fatalf("snapshot on the old host: %d %s", code, errOut)
	}

	d := repl.start(mpNew, "--interval", "0")
	deadline := time.Now().Add(90 * time.Second)
	var r waitSeen
	for {
		select {
		case <-d.done:
			t.Fatalf("the replacement host's mount exited %d while the old host held the lease:\n%s", d.code, d.stderr)
		default:
		}
		if fs.IsMountpoint(mpNew) {
			if st, code := repl.statusJSON(mpNew); code == 0 && st.Waiting != nil && st.Waiting.Showing != "" {
				r = waitSeen{st.Lease, st.Waiting.For, st.Waiting.Holder, st.Waiting.Showing}
				break
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("the replacement host shows nothing while it waits:\n%s", d.stderr)
		}
		time.Sleep(20 * time.Millisecond)
	}
	if got := mustRead(t, filepath.Join(mpNew, "memories", "MEMORY.md")); got != "written on the old host\n" {
		t.Errorf("while waiting, MEMORY.md reads %q", got)
	}
	if err := os.WriteFile(filepath.Join(mpNew, "new.txt"), []byte("x"), 0o644); !errors.Is(err, syscall.EROFS) {
		t.Errorf("a write before the lease is ours: %v, want EROFS", err)
	}
	if r.lease != "waiting" || r.waitFor != "lease" || !strings.Contains(r.holder, "on host old-vm (another machine") {
		t.Errorf("status while waiting: %+v", r)
	}
	code, out, _ := repl.run("status", mpNew)
	if code != 0 || !strings.Contains(out, "not writable yet") || !strings.Contains(out, "for the writer lease, held by hermesfs mount "+mpOld+" on host old-vm") {
		t.Errorf("status while waiting: exit %d\n%s", code, out)
	}
	if !strings.Contains(d.stderr.String(), "waiting for the writer lease held by hermesfs mount "+mpOld+" on host old-vm") {
		t.Errorf("stderr does not say what the mount waits for:\n%s", d.stderr)
	}
	select {
	case line := <-d.readyCh:
		t.Fatalf("ready (%q) while the old host held the lease", line)
	default:
	}

	// The old host vanishes: kill -9, and its state dir is lost.
	dOld.cmd.Process.Kill()
	dOld.wait()
	syscall.Unmount(mpOld, syscall.MNT_DETACH)
	os.RemoveAll(old.state)

	d.waitReady()
	writeFile(t, filepath.Join(mpNew, "new.txt"), "written on the replacement host\n", 0o644)
	if code, _, errOut := repl.run("snapshot", mpNew); code != 0 {
		t.Fatalf("snapshot on the replacement host: %d %s", code, errOut)
	}
	dir := unsquashLatest(t, storeDir)
	if got := mustRead(t, filepath.Join(dir, "new.txt")); got != "written on the replacement host\n" {
		t.Errorf("new.txt in the store: %q", got)
	}
	if got := mustRead(t, filepath.Join(dir, "memories", "MEMORY.md")); got != "written on the old host\n" {
		t.Errorf("MEMORY.md in the store: %q", got)
	}
	d.stopOK(t)
}

// waitSeen is what a test keeps of the status of a mount that waits.
type waitSeen struct{ lease, waitFor, holder, showing string }

// TestE2EBackgroundRefusedLeavesNoStateDir: a --background mount refused
// by the daemon (here: the lease is another host's and --lease-wait 0)
// says why, with the daemon's last log lines, and leaves no state dir
// behind: not even the log file that was made for it.
func TestE2EBackgroundRefusedLeavesNoStateDir(t *testing.T) {
	need(t, "/dev/fuse")
	storeDir := e2eDir(t, "store")
	mp := e2eDir(t, "home")
	s, err := uploader.NewLocal(storeDir)
	if err != nil {
		t.Fatal(err)
	}
	other := uploader.NewCatalog(s, uploader.CatalogOptions{Host: "vm2-1a2b3c4d", Machine: uploader.Machine{Hostname: "vm2", ID: "2"}})
	l, err := other.AcquireLease(t.Context(), uploader.LeaseOptions{Holder: "hermesfs mount /elsewhere", Heartbeat: -1, TTL: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Release(t.Context())
	h := newHost(t, "file://"+storeDir)
	parent := filepath.Join(e2eDir(t, "states"), "new")
	h.state = filepath.Join(parent, "state")
	code, out, errOut := h.run("mount", "--background", "--lease-wait", "0", mp)
	if code != exitConflict || out != "" || !strings.Contains(errOut, "the store is in use by hermesfs mount /elsewhere on host vm2") {
		t.Errorf("refused --background mount: exit %d %q\n%s", code, out, errOut)
	}
	if _, err := os.Stat(parent); !errors.Is(err, os.ErrNotExist) {
		ents, _ := filepath.Glob(filepath.Join(parent, "*", "*"))
		t.Errorf("a refused --background mount left %s behind (%v): %v", parent, err, ents)
	}
	if fs.IsMountpoint(mp) {
		t.Error("a refused mount left a mount")
	}
}
