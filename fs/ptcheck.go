package fs

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	fusefs "github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"
	"golang.org/x/sys/unix"
)

// The freeze's barrier (ptwrite.go) relies on two things the kernel does:
// a passthrough write takes the FUSE inode's lock, and a chmod holds it
// until the daemon answers the SETATTR. Both hold on the kernels this was
// written on, but nothing promises them, and if the first went away a
// freeze would copy files while they are written. So before the first
// writable passthrough of a process, checkPTBarrier tries it: a throwaway
// FUSE mount in the work directory with one file, opened for writing with
// passthrough, a chmod of it held by the daemon, and a write that must not
// finish until the chmod is answered. If any of it fails, writable opens
// are served by the daemon (the log says why).

const ptCheckPrefix = "ptcheck-"

var ptCheck struct {
	once sync.Once
	err  error
}

// ptCheckTimeout bounds the check: a kernel that never lets its write or
// chmod finish must not keep Mount from returning.
const ptCheckTimeout = 20 * time.Second

// ptBarrierHolds runs checkPTBarrier once per process, in a directory under
// work (a path). A check that does not finish in time fails, and its mount
// is detached (the next mount of the upper layer clears the directory).
func ptBarrierHolds(work string) error {
	ptCheck.once.Do(func() {
		done := make(chan error, 1)
		go func() { done <- checkPTBarrier(work) }()
		select {
		case ptCheck.err = <-done:
		case <-time.After(ptCheckTimeout):
			ptCheck.err = fmt.Errorf("the check did not finish in %s", ptCheckTimeout)
			unix.Unmount(filepath.Join(ptCheckDir(work), "mnt"), unix.MNT_DETACH)
		}
	})
	return ptCheck.err
}

// ptCheckDir is this process's check directory under work.
func ptCheckDir(work string) string {
	return filepath.Join(work, ptCheckPrefix+strconv.Itoa(os.Getpid()))
}

// ptCheckFS is the check mount: a root with one file, "f", backed by a
// regular file.
type ptCheckFS struct {
	fusefs.Inode
	backing string
	writes  atomic.Int32 // WRITEs that reached the daemon
	arrived chan struct{}
	hold    chan struct{}
	once    sync.Once
}

type ptCheckFile struct {
	fusefs.Inode
	fs *ptCheckFS
}

type ptCheckHandle struct {
	fd int
	fs *ptCheckFS
}

var (
	_ fusefs.NodeOnAdder         = (*ptCheckFS)(nil)
	_ fusefs.NodeGetattrer       = (*ptCheckFS)(nil)
	_ fusefs.NodeOpener          = (*ptCheckFile)(nil)
	_ fusefs.NodeGetattrer       = (*ptCheckFile)(nil)
	_ fusefs.NodeSetattrer       = (*ptCheckFile)(nil)
	_ fusefs.FileWriter          = (*ptCheckHandle)(nil)
	_ fusefs.FileReleaser        = (*ptCheckHandle)(nil)
	_ fusefs.FilePassthroughFder = (*ptCheckHandle)(nil)
)

func (r *ptCheckFS) OnAdd(ctx context.Context) {
	ch := r.NewPersistentInode(ctx, &ptCheckFile{fs: r}, fusefs.StableAttr{Mode: syscall.S_IFREG, Ino: 2})
	r.AddChild("f", ch, false)
}

func (r *ptCheckFS) Getattr(ctx context.Context, f fusefs.FileHandle, out *fuse.AttrOut) syscall.Errno {
	out.Mode = syscall.S_IFDIR | 0o700
	return 0
}

func (n *ptCheckFile) stat(out *fuse.AttrOut) syscall.Errno {
	var st syscall.Stat_t
	if err := syscall.Stat(n.fs.backing, &st); err != nil {
		return fusefs.ToErrno(err)
	}
	out.FromStat(&st)
	out.Ino = 2
	return 0
}

func (n *ptCheckFile) Getattr(ctx context.Context, f fusefs.FileHandle, out *fuse.AttrOut) syscall.Errno {
	return n.stat(out)
}

// Setattr holds a mode-only SETATTR until the check lets it go.
func (n *ptCheckFile) Setattr(ctx context.Context, f fusefs.FileHandle, in *fuse.SetAttrIn, out *fuse.AttrOut) syscall.Errno {
	if in.Valid&^fuse.FATTR_CTIME == fuse.FATTR_MODE {
		first := false
		n.fs.once.Do(func() { first = true })
		if first {
			close(n.fs.arrived)
			<-n.fs.hold
		}
	}
	return n.stat(out)
}

func (n *ptCheckFile) Open(ctx context.Context, flags uint32) (fusefs.FileHandle, uint32, syscall.Errno) {
	fd, err := syscall.Open(n.fs.backing, syscall.O_RDWR|syscall.O_CLOEXEC, 0)
	if err != nil {
		return nil, 0, fusefs.ToErrno(err)
	}
	return &ptCheckHandle{fd: fd, fs: n.fs}, 0, 0
}

func (h *ptCheckHandle) PassthroughFd() (int, bool) { return h.fd, true }

func (h *ptCheckHandle) Write(ctx context.Context, data []byte, off int64) (uint32, syscall.Errno) {
	h.fs.writes.Add(1)
	k, err := syscall.Pwrite(h.fd, data, off)
	return uint32(max(k, 0)), fusefs.ToErrno(err)
}

func (h *ptCheckHandle) Release(ctx context.Context) syscall.Errno {
	syscall.Close(h.fd)
	return 0
}

// checkPTBarrier mounts the check file system under work and tries the
// barrier (see above). nil means writable passthrough is safe to use.
func checkPTBarrier(work string) (err error) {
	dir := ptCheckDir(work)
	os.RemoveAll(dir)
	mnt := filepath.Join(dir, "mnt")
	if err := os.MkdirAll(mnt, 0o700); err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	r := &ptCheckFS{backing: filepath.Join(dir, "data"), arrived: make(chan struct{}), hold: make(chan struct{})}
	if err := os.WriteFile(r.backing, make([]byte, 8192), 0o600); err != nil {
		return err
	}
	zero := time.Duration(0)
	srv, err := fusefs.Mount(mnt, r, &fusefs.Options{
		EntryTimeout: &zero, AttrTimeout: &zero,
		MountOptions: fuse.MountOptions{FsName: FsName + "-check", Name: FsName + "-check", DisableXAttrs: true, DirectMount: true},
	})
	if err != nil {
		// go-fuse can fail after the mount is made (it did not
		// answer): never leave it.
		unix.Unmount(mnt, unix.MNT_DETACH)
		return fmt.Errorf("check mount: %w", err)
	}
	defer func() {
		if srv.Unmount() != nil {
			unix.Unmount(mnt, unix.MNT_DETACH)
			srv.Wait()
		}
	}()
	released := false
	release := func() {
		if !released {
			released = true
			close(r.hold)
		}
	}
	defer release()
	w, err := os.OpenFile(filepath.Join(mnt, "f"), os.O_RDWR, 0)
	if err != nil {
		return fmt.Errorf("open for writing: %w", err)
	}
	defer w.Close()
	if _, err := w.WriteAt([]byte("x"), 0); err != nil {
		return fmt.Errorf("write: %w", err)
	}
	if r.writes.Load() != 0 {
		return errors.New("the kernel did not give the writable open passthrough")
	}
	chmodDone := make(chan error, 1)
	go func() { chmodDone <- os.Chmod(filepath.Join(mnt, "f"), 0o600) }()
	select {
	case <-r.arrived:
	case err := <-chmodDone:
		return fmt.Errorf("chmod was not held (%v)", err)
	case <-time.After(5 * time.Second):
		return errors.New("chmod never reached the daemon")
	}
	wrote := make(chan error, 1)
	go func() { _, err := w.WriteAt([]byte("y"), 4096); wrote <- err }()
	select {
	case <-wrote:
		return errors.New("a passthrough write went through while a chmod of the file was held")
	case <-time.After(50 * time.Millisecond):
	}
	release()
	select {
	case err := <-wrote:
		if err != nil {
			return fmt.Errorf("write after the barrier: %w", err)
		}
	case <-time.After(5 * time.Second):
		return errors.New("the write did not finish after the barrier")
	}
	if err := <-chmodDone; err != nil {
		return fmt.Errorf("chmod: %w", err)
	}
	return nil
}
