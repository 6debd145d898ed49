package fs

import (
	"errors"
	"fmt"
	"os"
	"runtime"
	"strconv"
	"sync"

	"golang.org/x/sys/unix"
)

// Requests to our own mount.
//
// A thread whose FUSE request the daemon has read cannot be killed: the
// kernel waits for the answer whatever signal comes. When that thread is
// one of the daemon's own, a kill -9 of the daemon never completes: the
// thread keeps the process's descriptor table, and with it /dev/fuse, open,
// so the connection is never aborted and the answer never comes. The
// daemon stays a zombie, its mount hangs every request, and a writer
// stopped behind such a request (the freeze's barrier, ptwrite.go) waits in
// D state, unkillable, until someone aborts the connection by hand.
//
// So every request the daemon makes to a mount it serves runs on a thread
// of its own whose descriptor table is a private copy with no /dev/fuse
// descriptor in it (ownThread). When the daemon dies, its other threads
// drop the process's table, the last /dev/fuse descriptor closes, the
// kernel aborts the connection, every request in flight fails, and that
// thread ends too: the process exits at once and the writers it held go
// on. (/dev/fuse descriptors are close-on-exec for the same reason: a
// child holding one would keep a dead daemon's connection alive.)
//
// Such a thread sees the descriptors open when it started (except
// /dev/fuse) and those it opens itself, which close when it ends. It must
// not use *os.File (the runtime's poller) nor hand a descriptor it opened
// to another thread.

// fuseDevs are the descriptors of /dev/fuse this process opened (mounts,
// the barrier check), by number.
var fuseDevs struct {
	mu  sync.Mutex
	fds map[int]bool
}

// noteFuseDevs records the process's /dev/fuse descriptors for ownThread
// and makes them close-on-exec. Call it after each mount.
func noteFuseDevs() {
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		return
	}
	fuseDevs.mu.Lock()
	defer fuseDevs.mu.Unlock()
	if fuseDevs.fds == nil {
		fuseDevs.fds = map[int]bool{}
	}
	for _, e := range ents {
		fd, err := strconv.Atoi(e.Name())
		if err != nil || !isFuseDev("/proc/self/fd/"+e.Name()) {
			continue
		}
		fuseDevs.fds[fd] = true
		unix.FcntlInt(uintptr(fd), unix.F_SETFD, unix.FD_CLOEXEC)
	}
}

// isFuseDev reports whether the magic link at p (a descriptor in /proc)
// names /dev/fuse. Reading the link asks no file system anything.
func isFuseDev(p string) bool {
	var b [16]byte
	n, err := unix.Readlink(p, b[:])
	return err == nil && string(b[:n]) == "/dev/fuse"
}

// errNoOwnTable reports that a thread could not get a descriptor table of
// its own (a seccomp policy refusing both close_range and unshare).
var errNoOwnTable = errors.New("no private descriptor table for requests to our own mount")

// ownThread runs fn on a new thread with a private descriptor table
// without /dev/fuse (see above), and returns at once; fn gets nil, or
// errNoOwnTable (and then must not touch the mount). The thread ends
// with fn.
func ownThread(fn func(error)) {
	go func() {
		// Never unlocked: the runtime ends the thread, and its table,
		// when this goroutine returns.
		runtime.LockOSThread()
		if unix.Gettid() == unix.Getpid() {
			// The main thread must keep the process's table: it never
			// ends (the runtime parks it instead) and /proc/self shows
			// its table. Held by this goroutine, it cannot run the next
			// one, which locks a thread of its own before this one
			// lets the main thread go.
			locked := make(chan struct{})
			go func() {
				runtime.LockOSThread()
				close(locked)
				fn(privateTable())
			}()
			<-locked
			runtime.UnlockOSThread()
			return
		}
		fn(privateTable())
	}()
}

// onOwnMount runs fn as ownThread does and waits for it.
func onOwnMount(fn func() error) error {
	ch := make(chan error, 1)
	ownThread(func(err error) {
		if err == nil {
			err = fn()
		}
		ch <- err
	})
	return <-ch
}

// privateTable gives the calling thread (locked to its goroutine) a copy
// of the descriptor table and closes /dev/fuse in it.
func privateTable() error {
	fuseDevs.mu.Lock()
	fds := make([]int, 0, len(fuseDevs.fds))
	for fd := range fuseDevs.fds {
		fds = append(fds, fd)
	}
	fuseDevs.mu.Unlock()
	// close_range(2) with CLOSE_RANGE_UNSHARE copies the table and closes
	// in the copy; an fd that does not exist is no error. Where seccomp
	// refuses it, unshare(2).
	const none = uint(^uint32(0))
	if err := unix.CloseRange(none, none, unix.CLOSE_RANGE_UNSHARE); err != nil {
		if err := unix.Unshare(unix.CLONE_FILES); err != nil {
			return fmt.Errorf("%w: %v", errNoOwnTable, err)
		}
	}
	for _, fd := range fds {
		// The number may have been reused since: close only /dev/fuse.
		if isFuseDev("/proc/thread-self/fd/" + strconv.Itoa(fd)) {
			unix.Close(fd)
		}
	}
	return nil
}
