package mounttest

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"time"

	fusefs "github.com/hanwen/go-fuse/v2/fs"
)

// script is scripts/check-mounts.sh of this checkout.
func script(t *testing.T) string {
	_, file, _, _ := runtime.Caller(0)
	return filepath.Join(filepath.Dir(file), "..", "..", "scripts", "check-mounts.sh")
}

// mountFUSE mounts an empty FUSE file system at dir, as another program's
// (or a test's) mount; it is unmounted at the end of the test.
func mountFUSE(t *testing.T, dir string) {
	t.Helper()
	if _, err := os.Stat("/dev/fuse"); err != nil {
		if os.Getenv("HERMESFS_TEST_STRICT") != "" {
			t.Fatalf("/dev/fuse: %v (HERMESFS_TEST_STRICT)", err)
		}
		t.Skipf("no FUSE: %v", err)
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	srv, err := fusefs.Mount(dir, &fusefs.Inode{}, &fusefs.Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { srv.Unmount() })
}

func runScript(t *testing.T, args ...string) (code int, stdout, stderr string) {
	t.Helper()
	var out, errb bytes.Buffer
	cmd := exec.Command(script(t), args...)
	cmd.Stdout, cmd.Stderr = &out, &errb
	err := cmd.Run()
	if ee, ok := err.(*exec.ExitError); ok {
		return ee.ExitCode(), out.String(), errb.String()
	} else if err != nil {
		t.Fatal(err)
	}
	return 0, out.String(), errb.String()
}

// TestCheckMountsOnlyTheSuites: the leak check of `make test` looks only
// below the directories the suite uses. A FUSE mount another program makes
// elsewhere while the suite runs is ignored; one left below the suite's
// directories is reported by name.
func TestCheckMountsOnlyTheSuites(t *testing.T) {
	suite, outside := t.TempDir(), t.TempDir()
	before := filepath.Join(t.TempDir(), "before")
	if code, _, errOut := runScript(t, "record", before, suite); code != 0 {
		t.Fatalf("record: exit %d: %s", code, errOut)
	}
	mountFUSE(t, filepath.Join(outside, "rclone"))
	if code, out, errOut := runScript(t, "check", before, suite); code != 0 || !strings.Contains(out, "no mounts left behind") {
		t.Errorf("a mount outside the suite's directories: exit %d\n%s%s", code, out, errOut)
	}
	left := filepath.Join(suite, "a test's mount")
	mountFUSE(t, left)
	code, out, errOut := runScript(t, "check", before, suite)
	if code != 1 || !strings.Contains(errOut, left+"\n") || strings.Contains(errOut, "rclone") {
		t.Errorf("a mount left below the suite's directory: exit %d\n%s%s", code, out, errOut)
	}
}

// TestCheckMountsRun: `check-mounts.sh run` gives the command a TMPDIR of
// its own and checks below it and the --root dirs only: a mount made
// elsewhere during the run passes, one left in its TMPDIR fails the run and
// keeps that directory.
func TestCheckMountsRun(t *testing.T) {
	for _, leak := range []bool{false, true} {
		dir := t.TempDir()
		ready, proceed, tmpOut := filepath.Join(dir, "ready"), filepath.Join(dir, "go"), filepath.Join(dir, "tmpdir")
		var out, errb bytes.Buffer
		cmd := exec.Command(script(t), "run", "--root", filepath.Join(dir, "repo"), "--", "sh", "-c",
			`echo "$TMPDIR" >"$1"; touch "$2"; while [ ! -e "$3" ]; do sleep 0.05; done`, "sh", tmpOut, ready, proceed)
		os.Mkdir(filepath.Join(dir, "repo"), 0o755)
		cmd.Stdout, cmd.Stderr = &out, &errb
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		exited := make(chan error, 1)
		go func() { exited <- cmd.Wait() }()
		deadline := time.Now().Add(time.Minute)
		for _, err := os.Stat(ready); err != nil; _, err = os.Stat(ready) {
			select {
			case err := <-exited:
				t.Fatalf("the script exited (%v) before its command started: %s", err, errb.String())
			case <-time.After(20 * time.Millisecond):
			}
			if time.Now().After(deadline) {
				cmd.Process.Kill()
				t.Fatalf("the command never started: %s", errb.String())
			}
		}
		b, _ := os.ReadFile(tmpOut)
		runTmp := strings.TrimSpace(string(b))
		if !strings.Contains(filepath.Base(runTmp), "hermesfs-test.") {
			t.Fatalf("TMPDIR of the command: %q", runTmp)
		}
		mountFUSE(t, filepath.Join(dir, "elsewhere")) // another program's, during the run
		inside := filepath.Join(runTmp, "TestX", "home")
		if leak {
			// Kept by the script (something is mounted below it): removed
			// after the unmount, which the later cleanup does first.
			t.Cleanup(func() { os.RemoveAll(runTmp) })
			mountFUSE(t, inside)
		}
		os.WriteFile(proceed, nil, 0o644)
		err := <-exited
		code := 0
		if ee, ok := err.(*exec.ExitError); ok {
			code = ee.ExitCode()
		}
		switch {
		case !leak && (code != 0 || strings.Contains(errb.String(), "elsewhere")):
			t.Errorf("run with a mount made elsewhere: exit %d\n%s%s", code, out.String(), errb.String())
		case !leak:
			if _, err := os.Stat(runTmp); !os.IsNotExist(err) {
				t.Errorf("the run's TMPDIR %s was not removed: %v", runTmp, err)
			}
		case code != 1 || !strings.Contains(errb.String(), inside) || strings.Contains(errb.String(), "elsewhere"):
			t.Errorf("run with a mount left in its TMPDIR: exit %d\n%s%s", code, out.String(), errb.String())
		default:
			if _, err := os.Stat(runTmp); err != nil {
				t.Errorf("the run's TMPDIR was removed with a mount below it: %v", err)
			}
		}
	}
}
