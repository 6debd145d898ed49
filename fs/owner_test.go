package fs

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"
)

// Users of an allow_other mount in these tests.
const (
	uidA   = 1601 // owns a/ and files in the archive; member of groupG
	uidB   = 1602 // another user
	groupG = 3000
)

// shAs runs a shell command as uid with primary group uid and groups.
func shAs(uid uint32, groups []uint32, dir, script string) (string, error) {
	cmd := exec.Command("/bin/sh", "-c", script)
	cmd.Dir = dir
	cmd.Env = []string{"PATH=/usr/local/bin:/usr/bin:/bin", "LC_ALL=C"}
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: uid, Gid: uid, Groups: groups}}
	out, err := cmd.CombinedOutput()
	return string(out), err
}

// TestAllowOtherPosixRules: with AllowOther, users other than the daemon's
// meet the permission rules of a local file system, on entries from the
// archive and on entries made in this session alike.
func TestAllowOtherPosixRules(t *testing.T) {
	need(t, os.Geteuid() == 0, "root (allow_other and ownership)")
	lower, _ := packLower(t, func(dir string) {
		for _, d := range []struct {
			name string
			mode os.FileMode
			uid  int
			gid  int
		}{
			{"tmp", 0o777 | os.ModeSticky, 0, 0},
			{"shared", 0o775 | os.ModeSetgid, 0, groupG},
			{"a", 0o755, uidA, uidA},
		} {
			p := filepath.Join(dir, d.name)
			os.Mkdir(p, 0)
			os.Chmod(p, d.mode)
			os.Chown(p, d.uid, d.gid)
		}
		for _, f := range []struct {
			name string
			mode os.FileMode
		}{{"tmp/a-lower", 0o644}, {"a/lower.txt", 0o644}, {"a/suid", 0o755 | os.ModeSetuid | os.ModeSetgid}} {
			p := filepath.Join(dir, f.name)
			os.WriteFile(p, []byte("archived\n"), 0)
			os.Chown(p, uidA, uidA)
			os.Chmod(p, f.mode)
		}
	})
	e := mountEnv(t, lower, Options{AllowOther: true})
	mnt := e.mnt
	asA := func(script string) (string, error) { return shAs(uidA, []uint32{groupG}, mnt, script) }
	asB := func(script string) (string, error) { return shAs(uidB, nil, mnt, script) }
	ok := func(who string, run func(string) (string, error), script string) {
		t.Helper()
		if out, err := run(script); err != nil {
			t.Errorf("%s: %s: %v %s", who, script, err, out)
		}
	}
	refused := func(who string, run func(string) (string, error), script, msg string) {
		t.Helper()
		out, err := run(script)
		if err == nil || !strings.Contains(out, msg) {
			t.Errorf("%s: %s: want %q, got %v %s", who, script, msg, err, out)
		}
	}
	stat := func(rel string) unix.Stat_t {
		t.Helper()
		var st unix.Stat_t
		if err := unix.Lstat(e.path(rel), &st); err != nil {
			t.Fatalf("%s: %v", rel, err)
		}
		return st
	}
	const eperm, eacces = "Operation not permitted", "Permission denied"

	// Sticky directory: only the owner (or root) removes or renames.
	ok("A", asA, "echo x > tmp/a-new")
	if st := stat("tmp/a-new"); st.Uid != uidA || st.Gid != uidA {
		t.Errorf("tmp/a-new owned by %d:%d", st.Uid, st.Gid)
	}
	for _, f := range []string{"tmp/a-new", "tmp/a-lower"} {
		refused("B", asB, "rm -f "+f, eperm)
		refused("B", asB, "mv "+f+" tmp/b-took", eperm)
	}
	ok("A", asA, "mv tmp/a-lower tmp/a-moved && rm tmp/a-new")
	if err := os.Remove(e.path("tmp/a-moved")); err != nil {
		t.Errorf("root removes in a sticky directory: %v", err)
	}

	// Setgid directory: new entries take its group, directories its bit.
	ok("A", asA, "touch shared/f && mkdir shared/d")
	if st := stat("shared/f"); st.Uid != uidA || st.Gid != groupG {
		t.Errorf("shared/f owned by %d:%d, want %d:%d", st.Uid, st.Gid, uidA, groupG)
	}
	if st := stat("shared/d"); st.Gid != groupG || st.Mode&unix.S_ISGID == 0 {
		t.Errorf("shared/d: gid %d mode %o, want the group and setgid", st.Gid, st.Mode&07777)
	}

	// chmod and chown: owners only, and only to what they may.
	ok("A", asA, "echo n > a/new.txt")
	for _, f := range []string{"a/lower.txt", "a/new.txt"} {
		refused("B", asB, "chmod 777 "+f, eperm)
		refused("B", asB, "chown 1602 "+f, eperm)
		refused("A", asA, "chown 1602 "+f, eperm)
		refused("A", asA, "chgrp 4000 "+f, eperm)
		ok("A", asA, "chgrp 3000 "+f+" && chmod 640 "+f)
		refused("B", asB, "cat "+f, eacces)
	}

	// Unlink, rename and create need write permission on the directory.
	refused("B", asB, "rm -f a/lower.txt", eacces)
	refused("B", asB, "mv a/new.txt tmp/stolen", eacces)
	refused("B", asB, "touch a/b-was-here", eacces)

	// Writing clears setuid and setgid; so does chown, even by root.
	ok("A", asA, "echo more >> a/suid")
	if st := stat("a/suid"); st.Mode&(unix.S_ISUID|unix.S_ISGID) != 0 {
		t.Errorf("a/suid after a write: mode %o", st.Mode&07777)
	}
	ok("A", asA, "touch a/s2 && chmod 6755 a/s2")
	if st := stat("a/s2"); st.Mode&07777 != 06755 {
		t.Fatalf("a/s2: mode %o, want 6755", st.Mode&07777)
	}
	if err := os.Chown(e.path("a/s2"), uidB, uidB); err != nil {
		t.Fatal(err)
	}
	if st := stat("a/s2"); st.Mode&(unix.S_ISUID|unix.S_ISGID) != 0 || st.Uid != uidB {
		t.Errorf("a/s2 after chown by root: uid %d mode %o", st.Uid, st.Mode&07777)
	}
}
