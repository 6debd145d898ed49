// Package scripttest tests the shell scripts of scripts/ that have no Go
// package of their own.
package scripttest

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// depsScript is scripts/deps.sh of this checkout.
func depsScript() string {
	_, file, _, _ := runtime.Caller(0)
	return filepath.Join(filepath.Dir(file), "..", "deps.sh")
}

// fakeAptGet makes a bin directory that holds an apt-get which, as the
// real one, fails at once ("Could not get lock", exit 100) while lock is
// held and logs its arguments otherwise, and the tools deps.sh uses, but no
// fusermount3: so `deps.sh run` installs fuse3 with it. (Its check matches
// the inode alone: enough for a test's own files.)
func fakeAptGet(t *testing.T, dir, lock string) (bin, log string) {
	t.Helper()
	bin, log = filepath.Join(dir, "bin"), filepath.Join(dir, "apt.log")
	if err := os.Mkdir(bin, 0o755); err != nil {
		t.Fatal(err)
	}
	for _, tool := range []string{"id", "tr", "sort", "stat", "awk", "cat", "date", "sleep", "env"} {
		p, err := exec.LookPath(tool)
		if err != nil {
			t.Fatalf("%s: %v", tool, err)
		}
		if err := os.Symlink(p, filepath.Join(bin, tool)); err != nil {
			t.Fatal(err)
		}
	}
	// Held: /proc/locks lists a lock (POSIX or flock) on its inode.
	script := "#!/bin/sh\nino=$(stat -c %i " + lock + ")\n" +
		"if awk -v ino=\"$ino\" '$2 != \"->\" { n = split($6, f, \":\"); if (f[n] == ino) held = 1 } END { exit !held }' /proc/locks; then\n" +
		"  echo \"E: Could not get lock " + lock + "\" >&2; exit 100\nfi\necho \"$*\" >>" + log + "\n"
	if err := os.WriteFile(filepath.Join(bin, "apt-get"), []byte(script), 0o755); err != nil {
		t.Fatal(err)
	}
	return bin, log
}

// holdLock takes a lock on path as apt and dpkg do (fcntl, POSIX) or as
// flock(1) does, and returns a function that releases it.
func holdLock(t *testing.T, path string, posix bool) (release func()) {
	t.Helper()
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE, 0o644)
	if err != nil {
		t.Fatal(err)
	}
	if posix {
		err = syscall.FcntlFlock(f.Fd(), syscall.F_SETLK, &syscall.Flock_t{Type: syscall.F_WRLCK, Whence: 0})
	} else {
		err = syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB)
	}
	if err != nil {
		t.Fatal(err)
	}
	done := false
	release = func() {
		if !done {
			done = true
			f.Close() // drops both kinds of lock
		}
	}
	t.Cleanup(release)
	return release
}

// lockedBuffer is a bytes.Buffer a command writes while the test reads.
type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// runDeps is `deps.sh run` with only bin in PATH, waiting for locks.
func runDeps(bin, locks string, env ...string) *exec.Cmd {
	cmd := exec.Command(depsScript(), "run")
	cmd.Env = append([]string{"PATH=" + bin, "DEPS_APT_LOCKS=" + locks}, env...)
	return cmd
}

// TestDepsWaitsForAptLock: while another package manager holds a lock
// apt-get needs, deps.sh waits, saying who holds which lock, and runs
// apt-get only once it is free, passing it a lock timeout of its own.
// The lock is held as apt holds it (fcntl) and as flock(1) holds it.
func TestDepsWaitsForAptLock(t *testing.T) {
	for _, posix := range []bool{true, false} {
		dir := t.TempDir()
		lock := filepath.Join(dir, "lock-frontend")
		bin, log := fakeAptGet(t, dir, lock)
		release := holdLock(t, lock, posix)

		cmd := runDeps(bin, filepath.Join(dir, "lists-lock")+" "+lock)
		var stderr lockedBuffer
		cmd.Stderr = &stderr
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		exited := make(chan error, 1)
		go func() { exited <- cmd.Wait() }()
		// It says what it waits for, and does not run apt-get meanwhile.
		want := "to release " + lock
		deadline := time.Now().Add(time.Minute)
		for !strings.Contains(stderr.String(), want) {
			select {
			case err := <-exited:
				t.Fatalf("deps.sh exited (%v) while the lock was held:\n%s", err, stderr.String())
			case <-time.After(50 * time.Millisecond):
			}
			if time.Now().After(deadline) {
				t.Fatalf("deps.sh never said it waits for %s:\n%s", lock, stderr.String())
			}
		}
		if !strings.Contains(stderr.String(), "(pid "+strconv.Itoa(os.Getpid())+")") {
			t.Errorf("the message does not name the holder's pid %d:\n%s", os.Getpid(), stderr.String())
		}
		if b, _ := os.ReadFile(log); len(b) != 0 {
			t.Fatalf("apt-get ran while the lock was held: %s", b)
		}
		release()
		select {
		case err := <-exited:
			if err != nil {
				t.Fatalf("deps.sh: %v\n%s", err, stderr.String())
			}
		case <-time.After(time.Minute):
			cmd.Process.Kill()
			t.Fatalf("deps.sh still waits after the lock was released:\n%s", stderr.String())
		}
		b, _ := os.ReadFile(log)
		lines := strings.Split(strings.TrimSpace(string(b)), "\n")
		if len(lines) != 2 || !strings.HasPrefix(lines[0], "-o DPkg::Lock::Timeout=") || !strings.HasSuffix(lines[0], " update -qq") ||
			!strings.HasPrefix(lines[1], "-o DPkg::Lock::Timeout=") || !strings.HasSuffix(lines[1], " install -y -qq fuse3") {
			t.Errorf("apt-get runs (posix lock %v):\n%s", posix, b)
		}
	}
}

// TestDepsGivesUpOnAptLock: a lock held for longer than DEPS_LOCK_WAIT
// makes deps.sh fail, naming it, without running apt-get.
func TestDepsGivesUpOnAptLock(t *testing.T) {
	dir := t.TempDir()
	lock := filepath.Join(dir, "lock")
	bin, log := fakeAptGet(t, dir, lock)
	holdLock(t, lock, true)
	var stderr bytes.Buffer
	cmd := runDeps(bin, lock, "DEPS_LOCK_WAIT=1")
	cmd.Stderr = &stderr
	err := cmd.Run()
	if ee, ok := err.(*exec.ExitError); !ok || ee.ExitCode() != 1 || !strings.Contains(stderr.String(), "gave up after 1s") || !strings.Contains(stderr.String(), "still holds "+lock) {
		t.Errorf("deps.sh with the lock held past DEPS_LOCK_WAIT: %v\n%s", err, stderr.String())
	}
	if b, _ := os.ReadFile(log); len(b) != 0 {
		t.Errorf("apt-get ran: %s", b)
	}
}
