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

// The freeze's barrier and the seal's revoke (ptwrite.go) rely on things
// the kernel does: a passthrough write takes the FUSE inode's lock, a
// chmod holds it until the daemon answers the SETATTR, and a GETATTR
// answered with no file type makes every later read and write of the file
// fail. They hold on the kernels this was written on, but nothing promises
// them, and if one went away a freeze would copy files while they are
// written, or a stop would let writes through after its final snapshot.
// Both also need requests to our own mount from threads of their own
// (ownmount.go). So before the first writable passthrough of a process,
// checkPTBarrier tries it all: a throwaway FUSE mount in the work
// directory with one file, opened for writing with passthrough, a chmod of
// it held by the daemon, a write that must not finish until the chmod is
// answered, then a revoke after which a write must fail. If any of it
// fails, writable opens are served by the daemon (the log says why).

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

// ptCheckRaw is the check mount's raw file system: GETATTRs answer a
// revoke as the overlay's do (revokedAttr).
type ptCheckRaw struct{ fuse.RawFileSystem }

func (r *ptCheckRaw) GetAttr(cancel <-chan struct{}, in *fuse.GetAttrIn, out *fuse.AttrOut) fuse.Status {
	st := r.RawFileSystem.GetAttr(cancel, in, out)
	if st == fuse.OK {
		revokedAttr(in.Caller.Pid, out)
	}
	return st
}

// checkPTBarrier mounts the check file system under work and tries the
// barrier and the revoke (see above). nil means writable passthrough is
// safe to use. Every request to the check mount comes from a thread of its
// own, as the overlay's do.
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
	opts := &fusefs.Options{
		EntryTimeout: &zero, AttrTimeout: &zero,
		MountOptions: fuse.MountOptions{FsName: FsName + "-check", Name: FsName + "-check", DisableXAttrs: true, DirectMount: true},
	}
	srv, err := fuse.NewServer(&ptCheckRaw{fusefs.NewNodeFS(r, opts)}, mnt, &opts.MountOptions)
	if err != nil {
		// go-fuse can fail after the mount is made: never leave it.
		unix.Unmount(mnt, unix.MNT_DETACH)
		return fmt.Errorf("check mount: %w", err)
	}
	noteFuseDevs()
	go srv.Serve()
	defer func() {
		if srv.Unmount() != nil {
			unix.Unmount(mnt, unix.MNT_DETACH)
			srv.Wait()
		}
	}()
	if err := onOwnMount(srv.WaitMount); err != nil {
		return fmt.Errorf("check mount: %w", err)
	}
	released := false
	release := func() {
		if !released {
			released = true
			close(r.hold)
		}
	}
	defer release()
	f := filepath.Join(mnt, "f")

	// The writer: its own thread, its descriptor with it. It writes at
	// once, then once per step, and sends each write's result.
	step := make(chan struct{})
	wrote := make(chan error, 3)
	ownThread(func(err error) {
		if err != nil {
			wrote <- err
			return
		}
		fd, err := unix.Open(f, unix.O_RDWR|unix.O_CLOEXEC, 0)
		if err != nil {
			wrote <- fmt.Errorf("open for writing: %w", err)
			return
		}
		defer unix.Close(fd)
		for _, off := range []int64{0, 4096, 0} {
			_, err := unix.Pwrite(fd, []byte("x"), off)
			wrote <- err
			if _, ok := <-step; !ok {
				return
			}
		}
	})
	defer close(step)
	next := func(what string) error {
		select {
		case err := <-wrote:
			return err
		case <-time.After(5 * time.Second):
			return fmt.Errorf("%s did not finish", what)
		}
	}
	if err := next("the first write"); err != nil {
		return fmt.Errorf("write: %w", err)
	}
	if r.writes.Load() != 0 {
		return errors.New("the kernel did not give the writable open passthrough")
	}
	chmodDone := make(chan error, 1)
	ownThread(func(err error) {
		if err == nil {
			err = unix.Chmod(f, 0o600)
		}
		chmodDone <- err
	})
	select {
	case <-r.arrived:
	case err := <-chmodDone:
		return fmt.Errorf("chmod was not held (%v)", err)
	case <-time.After(5 * time.Second):
		return errors.New("chmod never reached the daemon")
	}
	step <- struct{}{}
	select {
	case <-wrote:
		return errors.New("a passthrough write went through while a chmod of the file was held")
	case <-time.After(50 * time.Millisecond):
	}
	release()
	if err := next("the write after the barrier"); err != nil {
		return fmt.Errorf("write after the barrier: %w", err)
	}
	if err := <-chmodDone; err != nil {
		return fmt.Errorf("chmod: %w", err)
	}
	// The revoke: the writer's next write must fail.
	if err := onOwnMount(func() error {
		fd, err := unix.Open(f, unix.O_RDONLY|unix.O_CLOEXEC, 0)
		if err != nil {
			return err
		}
		defer unix.Close(fd)
		return revokeFile(fd, 0o600)
	}); err != nil {
		return fmt.Errorf("revoke: %w", err)
	}
	step <- struct{}{}
	if err := next("the write after the revoke"); err != unix.EIO {
		return fmt.Errorf("a passthrough write after the revoke gave %v, not EIO", err)
	}
	return nil
}
