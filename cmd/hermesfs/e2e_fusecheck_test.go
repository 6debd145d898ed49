package main

import (
	"errors"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

// TestE2ENoFUSEChecksBeforeSeeding: where the mount cannot be made, a
// first mount of a non-empty home is refused before it publishes
// anything: no snapshot in the store, no state dir left, a message that
// says what is missing. Each case is a mount namespace or a process made
// as a host that lacks it would be:
//   - no /dev/fuse (a container without --device /dev/fuse);
//   - root without CAP_SYS_ADMIN (a container without --cap-add SYS_ADMIN);
//   - a user without root who cannot open /dev/fuse (0600 root, as some
//     images make it): fusermount3 opens it as that user, setuid or not;
//   - a user without root whose process may not gain privileges
//     (no_new_privs), so the setuid fusermount3 cannot mount;
//   - a user without a name (an arbitrary uid, not in /etc/passwd), for
//     whom fusermount3 does not mount.
//
// And one that can: a user without root, /dev/fuse usable, mounts.
func TestE2ENoFUSEChecksBeforeSeeding(t *testing.T) {
	need(t, "unshare", "mknod", "setpriv", "fusermount3")
	if os.Geteuid() != 0 {
		t.Skip("mount namespaces and other users need root")
	}
	// A /dev of the namespace's own: null, and /dev/fuse with mode mode
	// (none without).
	devWith := func(mode string) string {
		s := `mount -t tmpfs tmpfs /dev && mknod -m 666 /dev/null c 1 3`
		if mode != "" {
			s += ` && mknod -m ` + mode + ` /dev/fuse c 10 229`
		}
		return s
	}
	const (
		user    = "setpriv --reuid=65534 --regid=65534 --clear-groups" // nobody
		noName  = "setpriv --reuid=1501 --regid=1501 --clear-groups"
		nobody  = 65534
		unnamed = 1501
	)
	for _, c := range []struct {
		name string
		ns   string   // shell run as root in a new mount namespace first
		as   string   // the command the daemon runs through
		uid  int      // the daemon's user (0: root)
		says []string // nil: the mount is made
	}{
		{"no /dev/fuse", devWith(""), "", 0, []string{"FUSE is not available here", "/dev/fuse"}},
		{"root without CAP_SYS_ADMIN", "true", "setpriv --bounding-set=-sys_admin --inh-caps=-sys_admin", 0,
			[]string{"without CAP_SYS_ADMIN", "--cap-add SYS_ADMIN"}},
		{"a user who cannot open /dev/fuse", devWith("600"), user, nobody,
			[]string{"cannot mount without root", "cannot open /dev/fuse", "chmod 0666 /dev/fuse"}},
		{"a user who may not gain privileges", devWith("666"), user + " --no-new-privs", nobody,
			[]string{"cannot mount without root", "no_new_privs", "fusermount3"}},
		{"a user without a name", devWith("666"), noName, unnamed,
			[]string{"cannot mount without root", "uid 1501 has no user name"}},
		{"a user who can mount", devWith("666"), user, nobody, nil},
	} {
		t.Run(strings.ReplaceAll(c.name, " ", "_"), func(t *testing.T) {
			storeDir := e2eDir(t, "store")
			mp := e2eDir(t, "home")
			writeFile(t, filepath.Join(mp, "memories", "MEMORY.md"), "my home before hermesfs\n", 0o644)
			h := newHost(t, "file://"+storeDir)
			states := e2eDir(t, "states")
			h.state = filepath.Join(states, "state")
			if c.uid != 0 {
				// Directories the user owns, below ones it may traverse.
				if err := os.Chmod(tmpRoot, 0o711); err != nil {
					t.Fatal(err)
				}
				for _, d := range []string{storeDir, mp, filepath.Join(mp, "memories"), filepath.Join(mp, "memories", "MEMORY.md"), states, h.runtime} {
					if err := os.Chown(d, c.uid, c.uid); err != nil {
						t.Fatal(err)
					}
				}
			}
			h.wrap = []string{"unshare", "-m", "--propagation", "private", "sh", "-c", c.ns + ` && exec ` + c.as + ` "$@"`, "sh"}
			d := h.start(mp, "--interval", "0")
			if c.says == nil {
				// Mounted in the daemon's mount namespace (and, without
				// allow_other, for its user alone).
				select {
				case _, ok := <-d.readyCh:
					if !ok {
						<-d.done
						t.Fatalf("exit %d before ready:\n%s", d.code, d.stderr)
					}
				case <-time.After(90 * time.Second):
					t.Fatalf("no ready line after 90s:\n%s", d.stderr)
				}
				pid := strconv.Itoa(d.cmd.Process.Pid)
				if mi, err := os.ReadFile(filepath.Join("/proc", pid, "mountinfo")); err != nil || !strings.Contains(string(mi), " "+mp+" ") {
					t.Errorf("ready, but %s is not mounted in the daemon's namespace (%v)", mp, err)
				}
				if code := d.stop(syscall.SIGTERM); code != 0 {
					t.Errorf("stop: exit %d\n%s", code, d.stderr)
				}
				if ents, _ := os.ReadDir(filepath.Join(storeDir, "snapshots")); len(ents) == 0 {
					t.Error("the mount published nothing")
				}
				return
			}
			code := d.wait()
			msg := d.stderr.String()
			ok := code != 0
			for _, s := range c.says {
				ok = ok && strings.Contains(msg, s)
			}
			if !ok {
				t.Errorf("exit %d, want a refusal saying %q:\n%s", code, c.says, msg)
			}
			if ents, _ := os.ReadDir(filepath.Join(storeDir, "snapshots")); len(ents) > 0 {
				t.Errorf("the store was seeded before the mount could be made: %d objects in snapshots/", len(ents))
			}
			if _, err := os.Stat(h.state); !errors.Is(err, os.ErrNotExist) {
				t.Errorf("the refused mount left its state dir: %v", err)
			}
		})
	}
}
