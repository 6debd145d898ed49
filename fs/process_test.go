package fs

import (
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"
)

// TestKill9 kills a mount's daemon with SIGKILL after deletes, a directory
// rename and a synced write, and mounts the same layers again: the
// whiteouts, the redirect and the data are all there.
func TestKill9(t *testing.T) {
	needFuse(t)
	_, img := packLower(t, sampleTree)
	base := tempDir(t)
	mnt, upper := filepath.Join(base, "mnt"), filepath.Join(base, "upper")
	os.Mkdir(mnt, 0o755)
	p, line := startHelper(t, "mount", mnt, upper, img, nil)
	if line != "ready" {
		t.Fatalf("helper: %s", line)
	}
	killed := false
	t.Cleanup(func() {
		if !killed {
			p.cmd.Process.Kill()
		}
		p.wait()
		unix.Unmount(mnt, unix.MNT_DETACH)
	})

	path := func(rel string) string { return filepath.Join(mnt, rel) }
	steps := []func() error{
		func() error { return os.Remove(path("top.txt")) },
		func() error { return os.RemoveAll(path("a/b")) },
		func() error { return os.Rename(path("skills/web"), path("skills/renamed")) },
		func() error {
			f, err := os.OpenFile(path("a/one.txt"), os.O_WRONLY|os.O_TRUNC, 0)
			if err != nil {
				return err
			}
			defer f.Close()
			if _, err := f.WriteString("durable"); err != nil {
				return err
			}
			return f.Sync()
		},
	}
	for i, step := range steps {
		if err := step(); err != nil {
			t.Fatalf("step %d: %v", i, err)
		}
	}
	inoOne := lstat(t, path("a/one.txt")).Ino

	p.cmd.Process.Signal(syscall.SIGKILL)
	killed = true
	p.wait()
	// The dead mount answers ENOTCONN until detached.
	if _, err := os.ReadDir(mnt); !errors.Is(err, syscall.ENOTCONN) {
		t.Fatalf("readdir of the dead mount: %v, want ENOTCONN", err)
	}
	if err := unix.Unmount(mnt, unix.MNT_DETACH); err != nil {
		t.Fatalf("detach dead mount: %v", err)
	}

	e := &env{t: t, mnt: mnt, upper: upper, opts: Options{Upper: upper, Lower: openLower(t, img), Logger: testLogger(t)}}
	e.mount()
	e.missing("top.txt")
	e.missing("a/b")
	e.missing("skills/web")
	if got := e.names("skills/renamed"); !slices.Equal(got, []string{"SKILL.md", "sub"}) {
		t.Errorf("renamed dir lists %v", got)
	}
	if got := e.read("a/one.txt"); got != "durable" {
		t.Errorf("synced write: %q", got)
	}
	if got := e.ino("a/one.txt"); got != inoOne {
		t.Errorf("st_ino after crash %d, want %d", got, inoOne)
	}
}

// unprivSetup prepares an unprivileged mount as uid/gid 65534 through
// fusermount3: /dev/fuse usable by that user, and the image of sampleTree,
// a mountpoint and an upper directory owned by it. It returns the image,
// the mountpoint and the upper directory.
func unprivSetup(t *testing.T) (img, mnt, upper string) {
	needFuse(t)
	_, err := exec.LookPath("fusermount3")
	need(t, err == nil, "fusermount3")
	// fusermount3 opens /dev/fuse as the calling user; distributions make
	// it 0666 (udev). Some images ship it 0600: give it its usual mode for
	// the test and put it back after.
	var dev unix.Stat_t
	if err := unix.Stat("/dev/fuse", &dev); err != nil {
		t.Fatal(err)
	}
	if dev.Mode&0o006 != 0o006 {
		t.Logf("/dev/fuse is %o; making it 0666 for this test", dev.Mode&0o777)
		if err := os.Chmod("/dev/fuse", 0o666); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { os.Chmod("/dev/fuse", os.FileMode(dev.Mode&0o777)) })
	}
	// The user's home: its files belong to the user.
	_, img = packLower(t, func(dir string) {
		sampleTree(dir)
		filepath.Walk(dir, func(p string, _ os.FileInfo, _ error) error { return os.Lchown(p, 65534, 65534) })
	})
	os.Chmod(img, 0o644)
	os.Chmod(filepath.Dir(img), 0o755)
	base := tempDir(t)
	mnt, upper = filepath.Join(base, "mnt"), filepath.Join(base, "upper")
	for _, d := range []string{mnt, upper} {
		if err := os.Mkdir(d, 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.Chown(d, 65534, 65534); err != nil {
			t.Fatal(err)
		}
	}
	t.Cleanup(func() {
		if left := MountsBelow(base); len(left) > 0 {
			t.Errorf("helper left %v mounted", left)
			unix.Unmount(mnt, unix.MNT_DETACH)
		}
	})
	return img, mnt, upper
}

// TestUnprivileged mounts as uid/gid 65534 through fusermount3 and does
// basic I/O in that process; passthrough must be off.
func TestUnprivileged(t *testing.T) {
	img, mnt, upper := unprivSetup(t)
	p, line := startHelper(t, "unpriv", mnt, upper, img, &syscall.Credential{Uid: 65534, Gid: 65534})
	rest, err := p.wait()
	if line != "ok" || err != nil {
		t.Fatalf("unprivileged helper: %s %s (%v)", line, strings.TrimSpace(rest), err)
	}
	// The helper's changes are in the upper layer, owned by it.
	var st unix.Stat_t
	if err := unix.Lstat(filepath.Join(upper, "moved.txt"), &st); err != nil {
		t.Fatal(err)
	}
	if st.Uid != 65534 {
		t.Errorf("upper file owned by %d", st.Uid)
	}
	if _, err := os.Lstat(filepath.Join(upper, ".wh.top.txt")); err != nil {
		t.Errorf("whiteout made without privileges: %v", err)
	}
}

// TestUnprivilegedReadOnly mounts an upper layer with changes read-only as
// uid/gid 65534: without root, every change fails with EROFS, and the upper
// layer is left as it was.
func TestUnprivilegedReadOnly(t *testing.T) {
	img, mnt, upper := unprivSetup(t)
	// Changes made by an ordinary mount first, as the user.
	e := mountEnv(t, openLower(t, img), Options{})
	e.write("upper.txt", "changed before")
	must(t, os.Remove(e.path("secret.txt")))
	e.unmount()
	must(t, os.RemoveAll(upper))
	must(t, os.Rename(e.upper, upper))
	filepath.Walk(upper, func(p string, _ os.FileInfo, _ error) error { return os.Lchown(p, 65534, 65534) })
	before := stateOfDir(t, upper)

	p, line := startHelper(t, "unpriv-ro", mnt, upper, img, &syscall.Credential{Uid: 65534, Gid: 65534})
	rest, err := p.wait()
	if line != "ok" || err != nil {
		t.Fatalf("unprivileged read-only helper: %s %s (%v)", line, strings.TrimSpace(rest), err)
	}
	diffStates(t, "upper layer after an unprivileged read-only mount", stateOfDir(t, upper), before)
}
