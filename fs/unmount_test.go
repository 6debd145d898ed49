package fs

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// TestUnmountAbortsOpenFiles: when a file stays open past Unmount's
// deadline, a root daemon aborts the connection through fusectl (mounting
// it if needed): the open file fails with ENOTCONN, the mount is gone, and
// the unmount ends as it would have without the open file.
func TestUnmountAbortsOpenFiles(t *testing.T) {
	had := fusectlMounted()
	t.Cleanup(func() {
		// Leave the machine as it was.
		if !had && fusectlMounted() {
			unix.Unmount(fusectlDir, 0)
		}
	})
	e := mountEnv(t, nil, Options{})
	e.write("f", "x")
	f, err := os.Open(e.path("f"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	m := e.m
	e.m = nil
	ctx, cancel := context.WithTimeout(t.Context(), 300*time.Millisecond)
	defer cancel()
	err = m.Unmount(ctx)
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("unmount with a file open past the deadline: %v", err)
	}
	if !fusectlMounted() {
		// The fallback (no abort) is tested unprivileged below.
		t.Skip("fusectl cannot be mounted on this machine")
	}
	select {
	case <-m.done:
	case <-time.After(10 * time.Second):
		t.Fatal("the server still runs after the abort")
	}
	if !isNotMounted(e.mnt) {
		t.Error("still mounted after the abort")
	}
	if !m.ov.unmounted.Load() {
		t.Error("the aborted unmount did not end as an unmount does (background copies stopped and synced, the overlay closed)")
	}
	if _, err := f.ReadAt(make([]byte, 1), 0); !errors.Is(err, syscall.ENOTCONN) {
		t.Errorf("read of a file open across the abort: %v, want ENOTCONN", err)
	}
}

// TestUnmountOpenFilesUnprivileged: an unprivileged daemon cannot abort
// the connection; Unmount reports the files still open, and when the
// daemon then exits, the kernel aborts the connection itself: the file
// held open by another process fails with ENOTCONN, and no mount is left.
func TestUnmountOpenFilesUnprivileged(t *testing.T) {
	img, mnt, upper := unprivSetup(t)
	nobody := &syscall.Credential{Uid: 65534, Gid: 65534}
	d, line := startHelper(t, "mount-exit", mnt, upper, img, nobody)
	if line != "ready" {
		out, err := d.wait()
		t.Fatalf("mount helper: %s %s (%v)", line, out, err)
	}
	// Another process of the user holds a file open (root may not enter
	// a mount without allow_other): a large one, whose bytes are not in
	// the page cache (a small file's are put there at open, and a read
	// of them needs no daemon).
	h, line := startHelper(t, "hold", mnt, upper, img, nobody, "HELPER_FILE="+filepath.Join(mnt, "big.bin"))
	if line != "open" {
		d.cmd.Process.Signal(syscall.SIGTERM)
		d.wait()
		out, err := h.wait()
		t.Fatalf("holder: %s %s (%v)", line, out, err)
	}
	d.cmd.Process.Signal(syscall.SIGTERM)
	out, err := d.wait()
	if err != nil || !strings.Contains(out, "files still open") {
		t.Errorf("daemon's unmount with a file open: %q (%v)", strings.TrimSpace(out), err)
	}
	if left := MountsBelow(filepath.Dir(mnt)); len(left) > 0 {
		t.Errorf("mount left after the daemon exited: %v", left)
	}
	h.cmd.Process.Signal(syscall.SIGUSR1)
	out, err = h.wait()
	if err != nil || strings.TrimSpace(out) != "read: ENOTCONN" {
		t.Errorf("holder's read after the daemon exited: %q (%v), want ENOTCONN", strings.TrimSpace(out), err)
	}
}
