package main

import (
	"bufio"
	"errors"
	"fmt"
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
	t.Parallel()
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

// `make demo` after its daemon was killed: the dead mount it left at
// DEMO_DIR/home does not stop the recipe; the mount is detached and the
// demo comes back with the changes the killed daemon had not published.
func TestE2EDemoAfterKill9(t *testing.T) {
	t.Parallel()
	need(t, "/dev/fuse", "make", "fusermount3", "sqlite3") // sqlite3: scripts/deps.sh demo wants it
	if os.Geteuid() != 0 {
		t.Skip("standing in for the dead mount (below) mounts FUSE by hand, which needs root")
	}
	bin := hermesfsBin(t)
	root, err := filepath.Abs("../..")
	if err != nil {
		t.Fatal(err)
	}
	demo := e2eDir(t, "demo")
	home := filepath.Join(demo, "home")
	writeFile(t, filepath.Join(home, "config.yaml"), "model: demo\n", 0o644) // no sample to generate
	h := &host{t: t, state: filepath.Join(demo, "state"), runtime: e2eDir(t, "run"), store: "file://" + filepath.Join(demo, "store")}

	// makeDemo runs the demo target (its build step taken as done) and
	// returns once the mount is ready, with the daemon's pid.
	makeDemo := func() (pid int, ready string) {
		t.Helper()
		cmd := exec.Command("make", "-C", root, "-o", "build", "demo", "BIN="+bin, "DEMO_DIR="+demo)
		cmd.Env = append(os.Environ(), "HERMESFS_RUNTIME_DIR="+h.runtime, "NOTIFY_SOCKET=")
		cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
		out, err := cmd.StdoutPipe()
		if err != nil {
			t.Fatal(err)
		}
		var errOut syncBuffer
		cmd.Stderr = &errOut
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		done := make(chan struct{})
		go func() { cmd.Wait(); close(done) }()
		t.Cleanup(func() {
			syscall.Kill(-cmd.Process.Pid, syscall.SIGTERM) // make and the daemon: their own group
			select {
			case <-done:
			case <-time.After(time.Minute):
				syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
				<-done
			}
			if fs.IsMountpoint(home) {
				syscall.Unmount(home, syscall.MNT_DETACH)
			}
		})
		lines := make(chan string, 1)
		go func() {
			sc := bufio.NewScanner(out)
			for sc.Scan() {
				if strings.HasPrefix(sc.Text(), "ready ") {
					lines <- sc.Text()
				}
			}
			close(lines)
		}()
		select {
		case l, ok := <-lines:
			if !ok {
				<-done
				t.Fatalf("make demo ended before the mount was ready:\n%s", errOut.String())
			}
			ready = l
		case <-time.After(90 * time.Second):
			t.Fatalf("make demo: no ready line:\n%s", errOut.String())
		}
		r, code := h.statusJSON(home)
		if code != 0 || r.PID <= 0 {
			t.Fatalf("status of the demo mount: exit %d %+v", code, r)
		}
		return r.PID, ready
	}

	pid, _ := makeDemo()
	writeFile(t, filepath.Join(home, "memories", "MEMORY.md"), "not yet published\n", 0o644)
	syscall.Kill(pid, syscall.SIGKILL)
	for deadline := time.Now().Add(30 * time.Second); daemonAlive(pid) && time.Now().Before(deadline); {
		time.Sleep(20 * time.Millisecond)
	}
	if !fs.IsMountpoint(home) {
		t.Fatal("kill -9 left no dead mount behind")
	}
	// The kernel answers stat of the dead mount's root from its cache
	// (the mount's attribute timeout, an hour) and ENOTCONN after that:
	// the state `make demo` found. Stand in for it: the same mount, but
	// with nothing cached (a FUSE connection that died unanswered).
	if err := syscall.Unmount(home, syscall.MNT_DETACH); err != nil {
		t.Fatal(err)
	}
	deadFUSEMount(t, home)
	if _, err := os.Stat(home); !errors.Is(err, syscall.ENOTCONN) {
		t.Fatalf("stat of the dead mount: %v, want ENOTCONN", err)
	}

	_, ready := makeDemo()
	if !strings.Contains(ready, "local=recovered") {
		t.Errorf("ready line after the crash %q: want the recovered changes", ready)
	}
	if got := mustRead(t, filepath.Join(home, "memories", "MEMORY.md")); got != "not yet published\n" {
		t.Errorf("MEMORY.md after the crash and make demo: %q", got)
	}
	if got := mustRead(t, filepath.Join(home, "config.yaml")); got != "model: demo\n" {
		t.Errorf("config.yaml after the crash and make demo: %q", got)
	}
}

// deadFUSEMount mounts at mp a FUSE file system (type fuse.hermesfs)
// whose server went away before answering anything: every request,
// stat of its root included, fails with ENOTCONN.
func deadFUSEMount(t *testing.T, mp string) {
	t.Helper()
	fd, err := syscall.Open("/dev/fuse", syscall.O_RDWR|syscall.O_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	opts := fmt.Sprintf("fd=%d,rootmode=40000,user_id=%d,group_id=%d", fd, os.Getuid(), os.Getgid())
	err = syscall.Mount("hermesfs", mp, "fuse.hermesfs", syscall.MS_NOSUID|syscall.MS_NODEV, opts)
	syscall.Close(fd)
	if err != nil {
		t.Fatalf("mount a dead FUSE file system at %s: %v", mp, err)
	}
	t.Cleanup(func() {
		if fs.IsMountpoint(mp) {
			syscall.Unmount(mp, syscall.MNT_DETACH)
		}
	})
}

// daemonAlive reports whether process pid still exists (a zombie counts
// as gone).
func daemonAlive(pid int) bool {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return false
	}
	_, rest, _ := strings.Cut(string(b), ") ")
	return !strings.HasPrefix(rest, "Z")
}

// --background runs the daemon in "/": every path given relative to the
// working directory (identity, recipients file, store, state dir, log
// file, mountpoint) still names what it named there.
func TestE2EBackgroundRelativePaths(t *testing.T) {
	t.Parallel()
	need(t, "/dev/fuse")
	work := e2eDir(t, "cwd")
	runtime := e2eDir(t, "run")
	storeName := filepath.Base(work) + "-store" // unique: see the check at the end
	if err := os.Mkdir(filepath.Join(work, "home"), 0o755); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		// A daemon that resolved the store in its own working directory
		// put it there.
		if strayed := filepath.Join("/", storeName); fileExists(strayed) {
			t.Errorf("the relative store went to %s", strayed)
			os.RemoveAll(strayed)
		}
	})
	run := func(args ...string) (int, string, string) {
		t.Helper()
		cmd := exec.Command(hermesfsBin(t), args...)
		cmd.Dir = work
		cmd.Env = append(os.Environ(), "HERMESFS_RUNTIME_DIR="+runtime, "HERMESFS_STORE=", "HERMESFS_STATE_DIR=", "HERMESFS_IDENTITY=", "NOTIFY_SOCKET=")
		var out, errOut strings.Builder
		cmd.Stdout, cmd.Stderr = &out, &errOut
		err := cmd.Run()
		if code := exitCode(err); code >= 0 {
			return code, out.String(), errOut.String()
		}
		t.Fatal(err)
		return 0, "", ""
	}
	code, pub, errOut := run("keygen", "key.txt")
	if code != 0 {
		t.Fatalf("keygen: exit %d %s", code, errOut)
	}
	writeFile(t, filepath.Join(work, "recipients.txt"), pub, 0o644)
	mount := []string{"mount", "--background", "--interval", "0", "--store", storeName, "--state-dir", "state",
		"--log-file", "logs/hermesfs.log", "--identity", "key.txt", "--encrypt-to", "@recipients.txt", "home"}
	umount := func() {
		t.Helper()
		if code, out, errOut := run("umount", "--state-dir", "state", "home"); code != 0 {
			t.Fatalf("umount: exit %d %q %s", code, out, errOut)
		}
	}
	mp := filepath.Join(work, "home")
	t.Cleanup(func() {
		if fs.IsMountpoint(mp) {
			run("umount", "--state-dir", "state", "home")
		}
	})

	code, out, errOut := run(mount...)
	if code != 0 || !strings.HasPrefix(out, "ready "+mp+" ") {
		t.Fatalf("mount --background with relative paths: exit %d %q\n%s", code, out, errOut)
	}
	writeFile(t, filepath.Join(mp, "x.txt"), "encrypted, in the relative store\n", 0o644)
	umount()
	if snaps := localSnapshots(t, filepath.Join(work, storeName)); len(snaps) == 0 {
		t.Fatalf("no snapshot in %s", filepath.Join(work, storeName))
	}
	if !fileExists(filepath.Join(work, "state", "state.json")) || !strings.Contains(mustRead(t, filepath.Join(work, "logs", "hermesfs.log")), "snapshot published") {
		t.Errorf("the state dir or the log file is not where the relative flags named them")
	}

	// A new host boots the encrypted snapshot: the relative identity is
	// what opens it.
	if err := os.RemoveAll(filepath.Join(work, "state")); err != nil {
		t.Fatal(err)
	}
	code, out, errOut = run(mount...)
	if code != 0 {
		t.Fatalf("second mount --background: exit %d %q\n%s", code, out, errOut)
	}
	if got := mustRead(t, filepath.Join(mp, "x.txt")); got != "encrypted, in the relative store\n" {
		t.Errorf("x.txt on the new host: %q", got)
	}
	umount()
}
