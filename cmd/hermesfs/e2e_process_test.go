package main

import (
	"bufio"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/hermesfs/hermesfs/fs"
)

// A daemon whose stdout and stderr pipe closes (journald restarting, a
// closed `docker logs`, Ctrl-C of `hermesfs mount | tee`) goes on: the
// next log lines fail, SIGPIPE kills nothing, and SIGTERM still publishes
// the change made after the pipe went away and exits 0.
func TestE2ESurvivesClosedLogPipe(t *testing.T) {
	need(t, "/dev/fuse", "unsquashfs")
	storeDir := e2eDir(t, "store")
	mp := e2eDir(t, "home")
	h := newHost(t, "file://"+storeDir)
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(hermesfsBin(t), "mount", "--interval", "0", mp)
	cmd.Env, cmd.Dir = h.env(), "/"
	cmd.Stdout, cmd.Stderr = w, w // one pipe, as a shell's | gives
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	w.Close()
	var waitErr error
	done := make(chan struct{})
	go func() { waitErr = cmd.Wait(); close(done) }()
	t.Cleanup(func() {
		select {
		case <-done:
		default:
			cmd.Process.Signal(syscall.SIGTERM)
			select {
			case <-done:
			case <-time.After(time.Minute):
				cmd.Process.Kill()
				<-done
			}
		}
		if fs.IsMountpoint(mp) {
			syscall.Unmount(mp, syscall.MNT_DETACH)
		}
	})
	ready := make(chan bool, 1)
	go func() {
		sc := bufio.NewScanner(r)
		for sc.Scan() {
			if strings.HasPrefix(sc.Text(), "ready ") {
				ready <- true
				return
			}
		}
		ready <- false
	}()
	select {
	case ok := <-ready:
		if !ok {
			<-done
			t.Fatalf("the daemon's output ended before its ready line: %v", waitErr)
		}
	case <-time.After(90 * time.Second):
		t.Fatal("no ready line")
	}
	r.Close() // whoever read the daemon's output is gone

	// A snapshot logs to the broken pipe while the mount serves, the
	// final one while it stops.
	writeFile(t, filepath.Join(mp, "snapshot.txt"), "published by a snapshot\n", 0o644)
	if code, out, errOut := h.run("snapshot", mp); code != 0 {
		select {
		case <-done:
			t.Fatalf("the daemon died (exit %d; 141 is death by SIGPIPE) once its log pipe closed: snapshot: %s", exitCode(waitErr), errOut)
		case <-time.After(5 * time.Second):
		}
		t.Fatalf("snapshot after the pipe closed: exit %d %q %s", code, out, errOut)
	}
	writeFile(t, filepath.Join(mp, "final.txt"), "published at the stop\n", 0o644)
	cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-done:
	case <-time.After(2 * time.Minute):
		t.Fatal("the daemon did not exit after SIGTERM")
	}
	if waitErr != nil && exitCode(waitErr) < 0 {
		t.Fatal(waitErr)
	}
	code := exitCode(waitErr)
	if code != 0 {
		t.Fatalf("daemon exit %d after its log pipe closed, want 0 (141 is death by SIGPIPE)", code)
	}
	latest := unsquashLatest(t, storeDir)
	for name, want := range map[string]string{"snapshot.txt": "published by a snapshot\n", "final.txt": "published at the stop\n"} {
		if got := mustRead(t, filepath.Join(latest, name)); got != want {
			t.Errorf("%s in the newest snapshot: %q, want %q", name, got, want)
		}
	}
}

// exitCode is the exit code of a process that ended with err (cmd.Wait's),
// 128+N for a death by signal N, -1 if it did not run.
func exitCode(err error) int {
	var ee *exec.ExitError
	if !errors.As(err, &ee) {
		if err != nil {
			return -1
		}
		return 0
	}
	if ws, ok := ee.Sys().(syscall.WaitStatus); ok && ws.Signaled() {
		return 128 + int(ws.Signal())
	}
	return ee.ExitCode()
}
