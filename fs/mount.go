package fs

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	fusefs "github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"
	"golang.org/x/sys/unix"
)

// Mounted is a mounted overlay (fs.Mount returns it).
type Mounted struct {
	ov         *overlay
	server     *fuse.Server
	mountpoint string
	dev        uint64 // st_dev of the mount, names its FUSE connection
	mntID      int    // its mount id in /proc (0: unknown)
	done       chan struct{}
}

// FsName is the source name of hermesfs mounts in /proc/self/mounts.
const FsName = "hermesfs"

// Mount mounts the overlay of opts.Lower and opts.Upper at mountpoint and
// returns once the mount answers requests. On error nothing stays mounted.
func Mount(ctx context.Context, mountpoint string, opts Options) (*Mounted, error) {
	opts = opts.withDefaults()
	if opts.Upper == "" {
		return nil, errors.New("fs: mount: no upper directory")
	}
	mountpoint, err := filepath.Abs(mountpoint)
	if err != nil {
		return nil, fmt.Errorf("fs: mount %s: %w", mountpoint, err)
	}
	ov, err := newOverlay(opts)
	if err != nil {
		return nil, err
	}
	if err := ctx.Err(); err != nil {
		ov.close()
		return nil, err
	}

	rootSt, err := statFd(ov.u.root)
	if err != nil {
		ov.close()
		return nil, fmt.Errorf("fs: stat %s: %w", opts.Upper, err)
	}
	root := &node{ov: ov, kind: syscall.S_IFDIR, ino: rootSt.ino + upperInoBase}
	if ov.lower != nil {
		root.lower = ov.lower.Root()
		root.ino = uint64(root.lower)
	}
	root.upper.Store(true)
	ov.root = root

	logger := slog.NewLogLogger(opts.Logger.Handler(), slog.LevelDebug)
	mountOpts := []string{"default_permissions"}
	var directFlags uintptr
	if opts.ReadOnly {
		// fusermount3 turns "ro" into MS_RDONLY; a direct mount takes the
		// flag itself.
		mountOpts = append(mountOpts, "ro")
		directFlags = syscall.MS_NOSUID | syscall.MS_NODEV | syscall.MS_RDONLY
	}
	fopts := &fusefs.Options{
		EntryTimeout:    &opts.EntryTimeout,
		AttrTimeout:     &opts.AttrTimeout,
		NegativeTimeout: &opts.NegativeTimeout,
		// Report modes exactly as stored: default_permissions makes the
		// kernel check them.
		NullPermissions: true,
		RootStableAttr:  &fusefs.StableAttr{Ino: root.ino, Gen: 1},
		Logger:          logger,
		MountOptions: fuse.MountOptions{
			FsName:        FsName,
			Name:          FsName,
			Options:       mountOpts,
			AllowOther:    opts.AllowOther,
			DisableXAttrs: true,
			MaxWrite:      opts.MaxWrite,
			MaxBackground: 64,
			// The guard needs O_TRUNC inside OPEN: a separate truncate
			// would empty a guarded file before its new content is
			// checked.
			ExtraCapabilities: fuse.CAP_ATOMIC_O_TRUNC,
			Debug:             opts.Debug,
			Logger:            logger,
			// Direct mount(2) when privileged; fusermount3 otherwise.
			DirectMount:      ov.u.privileged,
			DirectMountFlags: directFlags,
		},
	}
	var raw fuse.RawFileSystem = &rawFS{RawFileSystem: fusefs.NewNodeFS(root, fopts), ov: ov}
	if opts.RefuseWrites && !opts.ReadOnly {
		ov.writesRefused.Store(true)
		raw = &writeGate{RawFileSystem: raw, ov: ov}
	}
	if opts.Stats != nil {
		raw = &timedFS{RawFileSystem: raw, s: opts.Stats}
	}
	server, err := fuse.NewServer(raw, mountpoint, &fopts.MountOptions)
	if err != nil {
		ov.close()
		return nil, fmt.Errorf("fs: mount %s: %w", mountpoint, err)
	}
	ov.server = server
	noteFuseDevs()
	go server.Serve()
	// WaitMount asks the mount for a poll: a request to our own mount.
	if err := ownRequest(server.WaitMount); err != nil {
		detach(mountpoint, ov.u.privileged)
		ov.close()
		return nil, fmt.Errorf("fs: mount %s: %w", mountpoint, err)
	}
	m := &Mounted{ov: ov, server: server, mountpoint: mountpoint, done: make(chan struct{})}
	go func() {
		server.Wait()
		close(m.done)
	}()
	var st unix.Stat_t
	if err := ownRequest(func() error { return unix.Stat(mountpoint, &st) }); err != nil {
		m.Unmount(context.Background())
		return nil, fmt.Errorf("fs: mount %s: not answering: %w", mountpoint, err)
	}
	m.dev = st.Dev
	m.mntID = mountID(mountpoint, st.Dev)
	if opts.ReadAhead > 0 && ov.u.privileged {
		m.setReadAhead(opts.ReadAhead)
	}
	if !opts.NoPassthrough && ov.u.privileged && server.KernelSettings().Flags64()&fuse.CAP_PASSTHROUGH != 0 {
		ov.passthrough.Store(true)
		if !opts.ReadOnly && opts.PassthroughWriteMax > 0 {
			if err := ptBarrierHolds(filepath.Join(opts.Upper, workDirName)); err != nil {
				ov.log.Warn("writes go through the daemon: the kernel's stop for passthrough writes could not be verified", "err", err)
			} else {
				ov.ptWriteOK.Store(true)
			}
		}
	}
	ov.log.Info("mounted", "mountpoint", mountpoint, "upper", opts.Upper, "lower", ov.lower != nil, "passthrough", ov.passthrough.Load(), "read_only", opts.ReadOnly, "allow_other", opts.AllowOther)
	return m, nil
}

// ownRequest runs fn, which asks a mount this process serves something
// and keeps no descriptor, on a thread of its own (ownmount.go); where no
// thread can have a table of its own, on this one.
func ownRequest(fn func() error) error {
	err := onOwnMount(fn)
	if errors.Is(err, errNoOwnTable) {
		return fn()
	}
	return err
}

// newOverlay opens the upper layer and the overlay's state in it.
func newOverlay(opts Options) (*overlay, error) {
	_, statErr := os.Stat(opts.Upper)
	created := os.IsNotExist(statErr)
	if err := os.MkdirAll(opts.Upper, 0o700); err != nil {
		return nil, fmt.Errorf("fs: create upper %s: %w", opts.Upper, err)
	}
	rootFd, err := unix.Open(opts.Upper, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("fs: open upper %s: %w", opts.Upper, err)
	}
	if created && opts.Lower != nil {
		// The upper root is the mount root's upper side: a new one takes
		// the archived root's mode, owner and mtime, as a copy-up would.
		if err := copyRootAttrs(rootFd, opts.Lower, os.Geteuid() == 0); err != nil {
			unix.Close(rootFd)
			return nil, fmt.Errorf("fs: upper %s: %w", opts.Upper, err)
		}
	}
	u := &upper{root: rootFd, work: -1, path: opts.Upper, umask: processUmask(), privileged: os.Geteuid() == 0}
	u.realRoot, _ = os.Readlink("/proc/self/fd/" + strconv.Itoa(rootFd))
	ov := &overlay{u: u, lower: opts.Lower, guard: opts.Guard, log: opts.Logger, opts: opts}
	if bs, ok := opts.Lower.(blockSizer); ok {
		ov.lowerBlock = int64(bs.BlockSize())
	}
	fail := func(what string, err error) (*overlay, error) {
		ov.close()
		return nil, fmt.Errorf("fs: %s in %s: %w", what, opts.Upper, err)
	}
	if opts.ReadOnly {
		// Shown, never written: no work directory, the inode map read
		// as it is.
		if ov.inos, err = readInoMap(rootFd); err != nil {
			return fail("inode map", err)
		}
		if ov.partials, err = openPartialSet(ov, rootFd, true); err != nil {
			return fail("partial copy-ups", err)
		}
		if err := u.checkDino(); err != nil {
			return fail("list", err)
		}
		return ov, nil
	}
	if err := unix.Mkdirat(rootFd, workDirName, 0o700); err != nil && err != unix.EEXIST {
		return fail("create work directory", err)
	}
	if u.work, err = unix.Openat(rootFd, workDirName, unix.O_PATH|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0); err != nil {
		return fail("open work directory", err)
	}
	// Temporaries and views of an earlier mount are garbage now.
	if fd, err := u.dirRead(workDirName); err == nil {
		names, err := readNames(fd)
		unix.Close(fd)
		if err != nil {
			return fail("list work directory", err)
		}
		for _, n := range names {
			if strings.HasPrefix(n, ptCheckPrefix) {
				// A barrier check's mount left by a daemon killed
				// in the middle of it.
				unix.Unmount("/proc/self/fd/"+strconv.Itoa(u.work)+"/"+n+"/mnt", unix.MNT_DETACH)
			}
			if err := removeAllAt(u.work, n); err != nil {
				return fail("clean work directory", err)
			}
		}
	}
	if ov.inos, err = openInoMap(rootFd); err != nil {
		return fail("inode map", err)
	}
	ov.inos.log = ov.log.Warn
	if ov.partials, err = openPartialSet(ov, rootFd, false); err != nil {
		return fail("partial copy-ups", err)
	}
	ov.partials.pause = opts.CopyUpPause
	ov.partials.setHold(opts.holdCopyUps)
	if err := fsyncDir(rootFd); err != nil {
		return fail("sync", err)
	}
	if err := u.checkDino(); err != nil {
		return fail("list", err)
	}
	return ov, nil
}

func copyRootAttrs(rootFd int, lower Lower, privileged bool) error {
	la, err := lower.Stat(lower.Root())
	if err != nil {
		return err
	}
	if privileged {
		if err := unix.Fchownat(rootFd, ".", int(la.Uid), int(la.Gid), 0); err != nil {
			return err
		}
	}
	if err := unix.Fchmodat(rootFd, ".", fileModeToUnix(la.Mode)&07777|0o700, 0); err != nil {
		return err
	}
	ts := timespec(la.Mtime)
	return unix.UtimesNanoAt(rootFd, ".", []unix.Timespec{ts, ts}, 0)
}

// maybeClose releases the upper layer's descriptors once the mount is gone
// and no view needs them.
func (ov *overlay) maybeClose() {
	if ov.unmounted.Load() && !ov.views.active() {
		ov.closeOnce.Do(ov.close)
	}
}

func (ov *overlay) close() {
	if ov.inos != nil {
		ov.inos.close()
	}
	if ov.partials != nil {
		ov.partials.close()
	}
	if ov.u.work >= 0 {
		unix.Close(ov.u.work)
	}
	unix.Close(ov.u.root)
}

// Unmount detaches the mount lazily (it disappears from the namespace at
// once, even with files open) and waits, until ctx ends, for the kernel to
// let go of it, which happens when the last open file is closed.
//
// If ctx ends first, Unmount returns an error wrapping ctx's error, after
// trying to abort the FUSE connection through the fusectl file system
// (/sys/fs/fuse/connections, mounted there first if the daemon is root and
// it is not): the files still open then fail every operation with
// ENOTCONN, the mount is gone and Wait returns. Without root (or where /sys
// cannot be mounted on, as in many containers) the connection cannot be
// aborted: the mount keeps serving its open files, invisible in the
// namespace, until they are closed or the process ends; when the process
// ends, the kernel aborts the connection itself and the open files get
// ENOTCONN just the same. Either way, nothing the overlay acknowledged is
// lost: the upper layer is on disk. Once the connection is aborted the
// unmount ends as it would have (background copies stopped and made
// durable, the overlay closed) before the error is returned.
func (m *Mounted) Unmount(ctx context.Context) error {
	var err error
	select {
	case <-m.done:
	default:
		err = detach(m.mountpoint, m.ov.u.privileged)
	}
	if err != nil && !isNotMounted(m.mountpoint) {
		return fmt.Errorf("fs: unmount %s: %w", m.mountpoint, err)
	}
	select {
	case <-m.done:
	case <-ctx.Done():
		err := fmt.Errorf("fs: unmount %s: files still open: %w", m.mountpoint, ctx.Err())
		if m.abort() {
			select {
			case <-m.done:
				m.endUnmount()
			case <-time.After(5 * time.Second):
			}
		}
		return err
	}
	m.endUnmount()
	m.ov.log.Info("unmounted", "mountpoint", m.mountpoint)
	return nil
}

// endUnmount ends an unmount once the server is done.
func (m *Mounted) endUnmount() {
	m.ov.unmounted.Store(true)
	m.ov.partials.stopAll()
	m.ov.partials.syncAll()
	m.ov.prefetching.Wait() // no READ can start one any more: the server is done
	m.ov.maybeClose()
}

func detach(mountpoint string, privileged bool) error {
	if privileged {
		if err := unix.Unmount(mountpoint, unix.MNT_DETACH); err == nil {
			return nil
		}
	}
	var last error
	for _, bin := range []string{"fusermount3", "fusermount"} {
		out, err := exec.Command(bin, "-u", "-z", mountpoint).CombinedOutput()
		if err == nil {
			return nil
		}
		last = fmt.Errorf("%s: %v: %s", bin, err, out)
	}
	return last
}

// isNotMounted reports whether nothing is mounted at mountpoint any more.
func isNotMounted(mountpoint string) bool {
	b, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		return false
	}
	return !mountedAt(string(b), mountpoint)
}

// IsMountpoint reports whether something is mounted at path (as
// /proc/self/mountinfo spells it: absolute, clean).
func IsMountpoint(path string) bool {
	b, err := os.ReadFile("/proc/self/mountinfo")
	return err == nil && mountedAt(string(b), path)
}

// Detach lazily unmounts the FUSE mount at mountpoint, as one whose daemon
// is gone: umount2 with MNT_DETACH as root, else fusermount3 (or fuse2's
// fusermount) -u -z.
func Detach(mountpoint string) error { return detach(mountpoint, os.Geteuid() == 0) }

// setReadAhead sets the read-ahead of the mount's backing device, which
// FUSE starts at 128 KiB and lets only root change.
func (m *Mounted) setReadAhead(bytes int) {
	p := fmt.Sprintf("/sys/class/bdi/%d:%d/read_ahead_kb", unix.Major(m.dev), unix.Minor(m.dev))
	if err := os.WriteFile(p, []byte(strconv.Itoa(bytes>>10)), 0); err != nil {
		m.ov.log.Info("cannot raise the read-ahead; reads use the kernel's default", "path", p, "err", err)
	}
}

// fusectlDir is where the fusectl file system is mounted, with a directory
// per FUSE connection named by the minor device number of its mounts.
const fusectlDir = "/sys/fs/fuse/connections"

// abort aborts the FUSE connection through fusectl, mounting fusectl first
// if it is not and the daemon is root. It reports whether it could.
func (m *Mounted) abort() bool {
	if err := abortConn(unix.Minor(m.dev), m.ov.u.privileged, m.ov.log); err != nil {
		m.ov.log.Warn("cannot abort the FUSE connection; open files keep it until closed or until the daemon exits", "err", err)
		return false
	}
	m.ov.log.Warn("aborted the FUSE connection: files still open get ENOTCONN", "mountpoint", m.mountpoint)
	return true
}

// AbortConnection aborts the FUSE connection of the FUSE mount at
// mountpoint (through fusectl, mounted first if the caller is root and it
// is not), then detaches the mount. It finds the connection by the device
// number /proc/self/mountinfo gives, so it never touches the mount, which
// may not answer at all: a daemon killed while one of its own threads
// waited on its own mount (the freeze's held chmod) never exits, and its
// mount then hangs every request instead of failing with ENOTCONN. The
// processes waiting on it get ECONNABORTED. Nothing the overlay
// acknowledged is lost: the upper layer is on disk.
func AbortConnection(mountpoint string, log *slog.Logger) error {
	b, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		return err
	}
	minor, fstype, ok := mountDevice(string(b), mountpoint)
	if !ok {
		return fmt.Errorf("fs: nothing is mounted at %s", mountpoint)
	}
	if !strings.HasPrefix(fstype, "fuse") {
		return fmt.Errorf("fs: %s is a %s mount, not a FUSE one", mountpoint, fstype)
	}
	if err := abortConn(minor, os.Geteuid() == 0, log); err != nil {
		return err
	}
	return detach(mountpoint, os.Geteuid() == 0)
}

// mountDevice returns the minor device number (which names the FUSE
// connection in fusectl) and the type of the mount at mountpoint.
func mountDevice(mountinfo, mountpoint string) (minor uint32, fstype string, ok bool) {
	for _, line := range strings.Split(mountinfo, "\n") {
		f := strings.Fields(line)
		if len(f) < 7 || UnescapeMountinfo(f[4]) != mountpoint {
			continue
		}
		_, mi, found := strings.Cut(f[2], ":")
		n, err := strconv.ParseUint(mi, 10, 32)
		if !found || err != nil {
			continue
		}
		// The fields after the optional ones: "- fstype source options".
		for i := 6; i+1 < len(f); i++ {
			if f[i] == "-" {
				fstype = f[i+1]
				break
			}
		}
		minor, ok = uint32(n), true // the last match is the topmost mount
	}
	return minor, fstype, ok
}

// abortConn writes to the abort file of FUSE connection minor, mounting
// fusectl first if it is not mounted and privileged is set.
func abortConn(minor uint32, privileged bool, log *slog.Logger) error {
	p := fusectlDir + "/" + strconv.FormatUint(uint64(minor), 10) + "/abort"
	err := os.WriteFile(p, []byte("1"), 0)
	if errors.Is(err, os.ErrNotExist) && privileged && !fusectlMounted() {
		if merr := unix.Mount("fusectl", fusectlDir, "fusectl", 0, ""); merr != nil {
			return fmt.Errorf("cannot mount fusectl at %s to abort the connection: %w", fusectlDir, merr)
		}
		log.Info("mounted fusectl to abort the connection", "dir", fusectlDir)
		err = os.WriteFile(p, []byte("1"), 0)
	}
	return err
}

// fusectlMounted reports whether fusectl is mounted at fusectlDir.
func fusectlMounted() bool {
	b, err := os.ReadFile("/proc/self/mountinfo")
	return err == nil && mountedAt(string(b), fusectlDir)
}

// mountID is the id /proc/self/mountinfo gives the mount of device dev at
// mountpoint (the topmost); 0 if none.
func mountID(mountpoint string, dev uint64) int {
	b, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		return 0
	}
	want := fmt.Sprintf("%d:%d", unix.Major(dev), unix.Minor(dev))
	id := 0
	for _, line := range strings.Split(string(b), "\n") {
		f := strings.Fields(line)
		if len(f) > 4 && f[2] == want && UnescapeMountinfo(f[4]) == mountpoint {
			id, _ = strconv.Atoi(f[0])
		}
	}
	return id
}

// Holder is a file open on a mount.
type Holder struct {
	PID     int
	Command string // the process's name
	Path    string
}

func (h Holder) String() string {
	return fmt.Sprintf("%s (pid %d %s)", h.Path, h.PID, h.Command)
}

// Holders lists the files open on the mount, at most max, as /proc shows
// them: it asks the mount nothing. Call it before Unmount: the paths of a
// detached mount's files no longer start at the mountpoint.
func (m *Mounted) Holders(max int) []Holder {
	if m.mntID == 0 {
		return nil
	}
	procs, err := os.ReadDir("/proc")
	if err != nil {
		return nil
	}
	want := "mnt_id:\t" + strconv.Itoa(m.mntID) + "\n"
	var out []Holder
	for _, p := range procs {
		pid, err := strconv.Atoi(p.Name())
		if err != nil {
			continue
		}
		dir := "/proc/" + p.Name()
		fds, err := os.ReadDir(dir + "/fdinfo")
		if err != nil {
			continue
		}
		var comm string
		for _, fd := range fds {
			info, err := os.ReadFile(dir + "/fdinfo/" + fd.Name())
			if err != nil || !strings.Contains(string(info), want) {
				continue
			}
			target, err := os.Readlink(dir + "/fd/" + fd.Name())
			if err != nil {
				continue
			}
			if comm == "" {
				c, _ := os.ReadFile(dir + "/comm")
				comm = strings.TrimSpace(string(c))
			}
			out = append(out, Holder{PID: pid, Command: comm, Path: target})
			if len(out) >= max {
				return out
			}
		}
	}
	return out
}

// Unrevoked counts the files open for writing through passthrough whose
// writes the seal could not refuse (Seal logs why): what they write after
// it is in no view.
func (m *Mounted) Unrevoked() int {
	p := &m.ov.ptw
	p.mu.Lock()
	defer p.mu.Unlock()
	if !p.sealed {
		return 0
	}
	n := 0
	for _, r := range p.nodes {
		if !r.revoked {
			n++
		}
	}
	return n
}

// Wait blocks until the mount is gone (unmounted by Unmount or externally).
func (m *Mounted) Wait() { <-m.done }

// Generation increases with every mutation. Equal generations mean nothing
// changed in between.
func (m *Mounted) Generation() uint64 {
	m.ov.notePTWrites()
	return m.ov.gen.Load()
}

// Dirty returns the number of objects changed after generation since and
// the bytes written to them. It is exact when since is the generation of a
// View (the latest snapshot) and an overestimate otherwise (see
// dirtyTracker).
func (m *Mounted) Dirty(since uint64) (files int, bytes int64) {
	m.ov.notePTWrites()
	return m.ov.dirty.dirty(since)
}

// Passthrough reports whether read-only opens of upper files may use FUSE
// passthrough on this mount.
func (m *Mounted) Passthrough() bool { return m.ov.passthrough.Load() }

// Mountpoint is the absolute path of the mount.
func (m *Mounted) Mountpoint() string { return m.mountpoint }

// mountedAt reports whether mountinfo (the text of /proc/self/mountinfo)
// lists a mount at mountpoint.
func mountedAt(mountinfo, mountpoint string) bool {
	for _, line := range strings.Split(mountinfo, "\n") {
		f := strings.Fields(line)
		if len(f) > 4 && UnescapeMountinfo(f[4]) == mountpoint {
			return true
		}
	}
	return false
}

// MountsBelow lists the mountpoints below dir (not dir itself), from
// /proc/self/mountinfo.
func MountsBelow(dir string) []string {
	b, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		return nil
	}
	var out []string
	for _, line := range strings.Split(string(b), "\n") {
		f := strings.Fields(line)
		if len(f) > 4 {
			if mp := UnescapeMountinfo(f[4]); strings.HasPrefix(mp, dir+"/") {
				out = append(out, mp)
			}
		}
	}
	return out
}

// UnescapeMountinfo undoes the octal escapes (\040 for a space) of a path
// in /proc's mount tables.
func UnescapeMountinfo(s string) string {
	if !strings.Contains(s, "\\") {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+3 < len(s) {
			if v, err := strconv.ParseUint(s[i+1:i+4], 8, 8); err == nil {
				b.WriteByte(byte(v))
				i += 3
				continue
			}
		}
		b.WriteByte(s[i])
	}
	return b.String()
}
