package daemon

import (
	"bufio"
	"context"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	fusefs "github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"

	"github.com/hermesfs/hermesfs/fs"
)

// lockHolderEnv makes this test binary a stand-in for a daemon that is
// killed while one of its own threads waits on its own mount. Given
// "STATE:MOUNTPOINT", it takes the lock of the state dir, mounts a file
// system at the mountpoint and one in the state dir's work directory
// (where the barrier check mounts), chmods a file of the latter from
// another thread, holds that request for ever, and prints "ready".
const lockHolderEnv = "HERMESFS_TEST_LOCK_HOLDER"

func init() {
	if spec := os.Getenv(lockHolderEnv); spec != "" {
		state, mp, _ := strings.Cut(spec, ":")
		os.Exit(runLockHolder(state, mp))
	}
}

type holdRoot struct {
	fusefs.Inode
	arrived chan struct{}
	once    sync.Once
}

type holdFile struct {
	fusefs.Inode
	r *holdRoot
}

func (r *holdRoot) OnAdd(ctx context.Context) {
	ch := r.NewPersistentInode(ctx, &holdFile{r: r}, fusefs.StableAttr{Mode: syscall.S_IFREG, Ino: 2})
	r.AddChild("f", ch, false)
}

func (f *holdFile) Getattr(ctx context.Context, fh fusefs.FileHandle, out *fuse.AttrOut) syscall.Errno {
	out.Mode = syscall.S_IFREG | 0o644
	return 0
}

func (f *holdFile) Setattr(ctx context.Context, fh fusefs.FileHandle, in *fuse.SetAttrIn, out *fuse.AttrOut) syscall.Errno {
	f.r.once.Do(func() { close(f.r.arrived) })
	select {} // never answered
}

// holderLock keeps the stand-in's lock file open.
var holderLock *os.File

func runLockHolder(state, mp string) int {
	fail := func(err error) int { fmt.Println("error:", err); return 1 }
	mnt := filepath.Join(state, "upper", ".wh..wh..work", "ptcheck-"+strconv.Itoa(os.Getpid()), "mnt")
	if err := os.MkdirAll(mnt, 0o700); err != nil {
		return fail(err)
	}
	lock, err := os.OpenFile(filepath.Join(state, "lock"), os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		return fail(err)
	}
	if err := syscall.Flock(int(lock.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); err != nil {
		return fail(err)
	}
	lock.Truncate(0)
	lock.WriteAt([]byte(strconv.Itoa(os.Getpid())+"\n"), 0)
	// Referenced for ever: a collected *os.File closes its descriptor,
	// and its lock with it.
	holderLock = lock
	opts := &fusefs.Options{MountOptions: fuse.MountOptions{FsName: "hermesfs", Name: "hermesfs", DirectMount: true}}
	if _, err := fusefs.Mount(mp, &holdRoot{arrived: make(chan struct{})}, opts); err != nil {
		return fail(err)
	}
	r := &holdRoot{arrived: make(chan struct{})}
	if _, err := fusefs.Mount(mnt, r, &fusefs.Options{MountOptions: fuse.MountOptions{FsName: "hermesfs-check", Name: "hermesfs-check", DirectMount: true}}); err != nil {
		return fail(err)
	}
	go os.Chmod(filepath.Join(mnt, "f"), 0o600)
	<-r.arrived
	fmt.Println("ready")
	select {}
}

// threadStates lists the states of pid's threads ("R", "S", "D", "Z"...).
func threadStates(pid int) string {
	tasks, _ := filepath.Glob(fmt.Sprintf("/proc/%d/task/*/stat", pid))
	var out []string
	for _, p := range tasks {
		if b, err := os.ReadFile(p); err == nil {
			if i := strings.LastIndexByte(string(b), ')'); i >= 0 && i+2 < len(b) {
				out = append(out, string(b[i+2]))
			}
		}
	}
	return strings.Join(out, "")
}

// TestBootTakesOverAKilledDaemonsStateDir: a daemon killed while one of
// its threads waited on a mount it served never finishes exiting by
// itself (a zombie whose stuck thread keeps the state dir's lock, and its
// mount at the mountpoint, which hangs). The next mount must take the
// mountpoint and the state dir over on its first try: abort the hung
// mount and what the killed daemon waits on, wait for it to go, and come
// up.
func TestBootTakesOverAKilledDaemonsStateDir(t *testing.T) {
	needFUSE(t)
	if os.Geteuid() != 0 {
		t.Skip("the stand-in daemon mounts directly: needs root")
	}
	root := tempDir(t)
	store, mp, runDir, state := filepath.Join(root, "store"), filepath.Join(root, "home"), filepath.Join(root, "run"), filepath.Join(root, "state")
	for _, d := range []string{store, mp} {
		if err := os.Mkdir(d, 0o700); err != nil {
			t.Fatal(err)
		}
	}
	holder := exec.Command(os.Args[0])
	holder.Env = append(os.Environ(), lockHolderEnv+"="+state+":"+mp)
	holder.Dir = "/"
	out, err := holder.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := holder.Start(); err != nil {
		t.Fatal(err)
	}
	reaped := make(chan struct{})
	line := make(chan string, 1)
	go func() {
		sc := bufio.NewScanner(out)
		sc.Scan()
		line <- sc.Text()
		for sc.Scan() {
		}
		holder.Wait()
		close(reaped)
	}()
	t.Cleanup(func() {
		holder.Process.Kill()
		for _, m := range append(fs.MountsBelow(state), fs.MountsBelow(mp)...) {
			fs.AbortConnection(m, slog.Default())
		}
		<-reaped
	})
	select {
	case l := <-line:
		if l != "ready" {
			t.Fatalf("stand-in daemon: %s", l)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("the stand-in daemon did not get ready")
	}
	pid := holder.Process.Pid
	holder.Process.Kill()
	for deadline := time.Now().Add(30 * time.Second); !strings.HasPrefix(threadStates(pid), "Z") || len(threadStates(pid)) < 2; {
		if time.Now().After(deadline) {
			t.Fatalf("the killed stand-in did not become a zombie with a stuck thread: threads %q", threadStates(pid))
		}
		time.Sleep(10 * time.Millisecond)
	}

	d := startDaemon(t, store, mp, state, runDir)
	select {
	case <-reaped:
	case <-time.After(30 * time.Second):
		t.Errorf("the killed daemon is still there after the next mount came up: threads %q", threadStates(pid))
	}
	logs := d.logs.String()
	if !strings.Contains(logs, "took over the state dir of the killed daemon") {
		t.Errorf("the boot does not say it took the state dir over:\n%s", logs)
	}
	if !strings.Contains(logs, "its daemon was killed and has not finished exiting") {
		t.Errorf("the boot does not say whose hung mount it aborted at the mountpoint:\n%s", logs)
	}
	if err := d.stop(t); err != nil {
		t.Fatalf("stop: %v", err)
	}
}
