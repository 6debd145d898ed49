package daemon

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"

	"golang.org/x/sys/unix"

	"github.com/hermesfs/hermesfs/fs"
)

// What is already mounted at a mountpoint decides whether a mount may go
// there. A live FUSE mount is refused: mounted over, it would stay alive
// underneath, its daemon still packing its own (now hidden) tree, while
// the new mount packed the old one's view into its own store; and
// `hermesfs umount` could later take the live lower mount for a dead one.
// The dead or hung mount a killed daemon left behind is detached, so a
// restart by systemd just works. Anything else mounted there (a volume, a
// bind mount holding the user's existing home) is mounted over, as any
// directory is.

// clearMountpoint deals with the mount already at the mountpoint.
func (d *daemon) clearMountpoint(ctx context.Context) error {
	cfg := d.cfg
	mp := cfg.Mountpoint
	// A daemon killed while a thread of it waited on its own mount (the
	// registered daemon of this mountpoint, or the holder of this state
	// dir's lock) has not finished exiting: its control socket accepts
	// and never answers, so it is not asked. Its mount hangs, which the
	// probe below finds; a live mount answers the probe and is left alone,
	// whoever holds what.
	dying := lockHolder(cfg.StateDir)
	if r, err := lookupRegistry(RuntimeDir(os.Getuid(), d.e.Getenv), mp); err == nil && processDying(r.PID) {
		dying = r.PID
	}
	if !processDying(dying) {
		dying = 0
	}
	if loc, err := locateDaemon(d.e, mp, cfg.StateDir); err == nil && dying == 0 {
		// Bounded: a killed daemon stuck on its own mount (see
		// FUSEHung) still holds its listening socket open.
		cctx, cancel := context.WithTimeout(ctx, hungMountWait)
		resp, err := ControlCall(cctx, loc.Socket, controlRequest{Op: "status"})
		cancel()
		if err == nil {
			who := registryEntry{StateDir: loc.StateDir}
			if st := resp.Status; st != nil {
				who.PID, who.StateDir, who.Store = st.PID, st.StateDir, st.Store
			}
			return fmt.Errorf("%s is already mounted by a running hermesfs (%s); stop it first with 'hermesfs umount %s'", mp, who.describe(), mp)
		}
	}
	switch ProbeFUSE(mp, hungMountWait) {
	case FUSEDead:
		// A daemon that was killed (kill -9, OOM, a crash) leaves its
		// mount behind, answering ENOTCONN; a restart (systemd's
		// Restart=on-failure) must not trip over it. Its changes are in
		// the upper layer, not in the dead mount.
		if err := fs.Detach(mp); err != nil {
			return fmt.Errorf("mountpoint %s: the mount a killed daemon left is dead and cannot be detached: %w", mp, err)
		}
		d.log.Warn("detached the dead mount a killed daemon left at the mountpoint", "mountpoint", mp)
		return nil
	case FUSEHung:
		// No daemon answers the control socket and the mount does not
		// answer either: a daemon killed while one of its own threads
		// waited on its mount never exits, and its mount hangs every
		// request. Aborting the connection frees the processes stuck in
		// it; the changes are in the upper layer.
		if dying > 0 {
			d.log.Warn("the mount at the mountpoint does not answer: its daemon was killed and has not finished exiting (a thread of it waits on a FUSE request); aborting its FUSE connection", "mountpoint", mp, "pid", dying, "waited", hungMountWait)
		} else {
			d.log.Warn("the mount at the mountpoint does not answer and no hermesfs answers its control socket: aborting its FUSE connection", "mountpoint", mp, "waited", hungMountWait)
		}
		if err := fs.AbortConnection(mp, d.log); err != nil {
			return fmt.Errorf("mountpoint %s: a hung FUSE mount is there and cannot be aborted (%w); as root: echo 1 > /sys/fs/fuse/connections/<minor>/abort, then umount -l %s", mp, err, mp)
		}
		d.log.Warn("aborted and detached the hung mount a killed daemon left at the mountpoint", "mountpoint", mp)
		return nil
	}
	fstype, source := MountedFS(mp)
	if !strings.HasPrefix(fstype, "fuse") {
		d.log.Warn("something is mounted at the mountpoint already; mounting over it", "mountpoint", mp, "fstype", fstype, "source", source)
		return nil
	}
	if r, err := lookupRegistry(RuntimeDir(os.Getuid(), d.e.Getenv), mp); err == nil && ProcessAlive(r.PID) {
		if r.Store == "" {
			// Registered by an older daemon: ask it.
			cctx, cancel := context.WithTimeout(ctx, hungMountWait)
			if resp, err := ControlCall(cctx, r.Socket, controlRequest{Op: "status"}); err == nil && resp.Status != nil {
				r.Store = resp.Status.Store
			}
			cancel()
		}
		return fmt.Errorf("%s is already mounted by a running hermesfs (%s); refusing to mount over a live mount: stop it first with 'hermesfs umount --state-dir %s %s'", mp, r.describe(), r.StateDir, mp)
	}
	return fmt.Errorf("%s is already a live FUSE mount (type %s, source %s) that no registered hermesfs serves; refusing to mount over it: unmount it first (if it is a hermesfs mount started with its own --state-dir: 'hermesfs umount --state-dir DIR %s')", mp, fstype, source, mp)
}

// describe names a running daemon for a message.
func (r registryEntry) describe() string {
	var parts []string
	if r.PID > 0 {
		parts = append(parts, fmt.Sprintf("pid %d", r.PID))
	}
	if r.StateDir != "" {
		parts = append(parts, "state dir "+r.StateDir)
	}
	if r.Store != "" {
		parts = append(parts, "store "+r.Store)
	}
	return strings.Join(parts, ", ")
}

// MountedFS returns the file system type and source of the topmost mount
// at mp (absolute, clean), as /proc/self/mountinfo lists it; "" if none.
func MountedFS(mp string) (fstype, source string) {
	b, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		return "", ""
	}
	for _, line := range strings.Split(string(b), "\n") {
		f := strings.Fields(line)
		if len(f) < 5 || fs.UnescapeMountinfo(f[4]) != mp {
			continue
		}
		// Optional fields, then "-", the type and the source. A later
		// line is a mount on top of an earlier one.
		for i := 5; i+2 < len(f); i++ {
			if f[i] == "-" {
				fstype, source = f[i+1], fs.UnescapeMountinfo(f[i+2])
				break
			}
		}
	}
	return fstype, source
}

// ResolveMountpoint returns the absolute, clean path mp names with every
// symlink in it resolved: the directory a mount of mp covers. The mount,
// its registry entry, its default state dir and the check for a live mount
// there all go by that path, so a symlink to a live mount is found to be
// one. A last component that cannot be looked at (a dead FUSE mount
// answers ENOTCONN) or does not exist is kept as it is: later checks say
// what is wrong with it.
func ResolveMountpoint(mp string) (string, error) {
	p, err := filepath.Abs(mp)
	if err != nil {
		return "", err
	}
	p = filepath.Clean(p)
	for range 40 {
		dir, base := filepath.Split(p)
		if base == "" {
			return p, nil // the root
		}
		rdir, err := filepath.EvalSymlinks(dir)
		if err != nil {
			return p, nil
		}
		p = filepath.Join(rdir, base)
		if fstype, _ := MountedFS(p); fstype != "" {
			// A mountpoint is never a symlink (mount follows them), and
			// a look at it asks the mount's root: a killed daemon's hung
			// mount would never answer, and the takeover of that mount
			// comes after this.
			return p, nil
		}
		fi, err := os.Lstat(p)
		if err != nil || fi.Mode()&os.ModeSymlink == 0 {
			return p, nil
		}
		target, err := os.Readlink(p)
		if err != nil {
			return "", fmt.Errorf("mountpoint %s: %w", mp, err)
		}
		if !filepath.IsAbs(target) {
			target = filepath.Join(rdir, target)
		}
		p = filepath.Clean(target)
	}
	return "", fmt.Errorf("mountpoint %s: too many levels of symbolic links", mp)
}

// checkFUSE checks, before anything is created or published (a first boot
// seeds the store before it mounts), what the mount will need of FUSE.
// With root, the daemon mounts itself: it opens /dev/fuse and needs
// CAP_SYS_ADMIN (a container's root often lacks it). Without root,
// fusermount3 (or fuse2's fusermount) mounts for it: that helper opens
// /dev/fuse as the calling user, and mounts only if it runs setuid root
// (which no_new_privs and a nosuid file system prevent).
func checkFUSE() error {
	const dev = "/dev/fuse"
	hint := "load the fuse module (modprobe fuse); in a container, pass the device (docker run --device /dev/fuse --cap-add SYS_ADMIN)"
	fi, err := os.Stat(dev)
	if err != nil {
		return fmt.Errorf("FUSE is not available here: %w; %s", err, hint)
	}
	if fi.Mode()&os.ModeCharDevice == 0 {
		return fmt.Errorf("FUSE is not available here: %s is not a character device; %s", dev, hint)
	}
	f, openErr := os.OpenFile(dev, os.O_RDWR|syscall.O_CLOEXEC, 0)
	if openErr == nil {
		f.Close()
	}
	proc := readProcStatus()
	if os.Geteuid() == 0 {
		if openErr != nil {
			return fmt.Errorf("FUSE is not available here: %w; %s", openErr, hint)
		}
		if eff, ok := proc.caps("CapEff"); ok && eff&capSysAdmin == 0 {
			return errors.New("cannot mount: this process runs as root but without CAP_SYS_ADMIN, which mounting needs (a container started without --cap-add SYS_ADMIN, or a unit with CapabilityBoundingSet= that leaves it out)")
		}
		return nil
	}
	const asRoot = "or run hermesfs as root"
	if openErr != nil {
		return fmt.Errorf("cannot mount without root: this user cannot open %s (%w), and fusermount3, which makes a mount without root, opens it as the calling user; "+
			"make it usable by this user (distributions make it 0666: chmod 0666 %s), %s", dev, openErr, dev, asRoot)
	}
	bin := fusermount()
	if bin == "" {
		return fmt.Errorf("cannot mount without root: fusermount3, through which a mount without root is made, is not installed (install the fuse3 package), %s", asRoot)
	}
	st, err := os.Stat(bin)
	if err != nil {
		return fmt.Errorf("cannot mount without root: %w", err)
	}
	if sys, ok := st.Sys().(*syscall.Stat_t); !ok || st.Mode()&os.ModeSetuid == 0 || sys.Uid != 0 {
		return fmt.Errorf("cannot mount without root: %s is not setuid root (as the fuse3 package installs it: chmod u+s), %s", bin, asRoot)
	}
	if err := unix.Access(bin, unix.X_OK); err != nil {
		return fmt.Errorf("cannot mount without root: this user may not run %s (%w; some distributions keep it to the fuse group), %s", bin, err, asRoot)
	}
	if proc["NoNewPrivs"] == "1" {
		return fmt.Errorf("cannot mount without root: this process may not gain privileges (no_new_privs: systemd NoNewPrivileges=, docker --security-opt no-new-privileges, Kubernetes allowPrivilegeEscalation: false), so the setuid %s cannot mount; %s", bin, asRoot)
	}
	var sfs unix.Statfs_t
	if unix.Statfs(bin, &sfs) == nil && sfs.Flags&unix.ST_NOSUID != 0 {
		return fmt.Errorf("cannot mount without root: %s is on a file system mounted nosuid, so it cannot run as root; %s", bin, asRoot)
	}
	if bnd, ok := proc.caps("CapBnd"); ok && bnd&capSysAdmin == 0 {
		return fmt.Errorf("cannot mount without root: CAP_SYS_ADMIN is not in this process's bounding set, so the setuid %s cannot mount; %s", bin, asRoot)
	}
	if uid := os.Getuid(); !hasUserName(uid) {
		// fusermount3 records the mount under the user's name.
		return fmt.Errorf("cannot mount without root: uid %d has no user name (no entry in /etc/passwd, as for a container run with an arbitrary uid), and %s refuses to mount for a user it cannot name; add one, %s", uid, bin, asRoot)
	}
	return nil
}

// hasUserName reports whether uid has a user name, as fusermount3 asks
// for it (getpwuid); true when that cannot be told.
func hasUserName(uid int) bool {
	_, err := user.LookupId(strconv.Itoa(uid))
	var unknown user.UnknownUserIdError
	return !errors.As(err, &unknown)
}

// capSysAdmin is CAP_SYS_ADMIN's bit in /proc/self/status's capability sets.
const capSysAdmin = 1 << 21

// procStatus is /proc/self/status: its fields by name.
type procStatus map[string]string

func readProcStatus() procStatus {
	b, _ := os.ReadFile("/proc/self/status")
	out := procStatus{}
	for _, l := range strings.Split(string(b), "\n") {
		if k, v, ok := strings.Cut(l, ":"); ok {
			out[k] = strings.TrimSpace(v)
		}
	}
	return out
}

// caps is the capability set name ("CapEff"); ok is false if unknown.
func (p procStatus) caps(name string) (uint64, bool) {
	v, err := strconv.ParseUint(p[name], 16, 64)
	return v, err == nil
}

// fusermount is the helper go-fuse mounts through without root (it looks
// in PATH, then /bin), "" if there is none.
func fusermount() string {
	for _, name := range []string{"fusermount3", "fusermount"} {
		if p, err := exec.LookPath(name); err == nil {
			return p
		}
		if p := filepath.Join("/bin", name); isExecutable(p) {
			return p
		}
	}
	return ""
}

func isExecutable(p string) bool {
	fi, err := os.Stat(p)
	return err == nil && fi.Mode().IsRegular() && fi.Mode()&0o111 != 0
}
