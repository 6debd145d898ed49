package fs

import (
	"context"
	"errors"
	iofs "io/fs"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	fusefs "github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"
	"golang.org/x/sys/unix"
)

// roAttempts tries every kind of change under mnt and returns, for each,
// what it gave (nil: it succeeded). Each must fail with EROFS on a
// read-only mount. The names refer to sampleTree plus "upper.txt", a file
// changed before the mount became read-only.
func roAttempts(mnt string) map[string]error {
	p := func(rel string) string { return filepath.Join(mnt, rel) }
	open := func(rel string, flags int) error {
		fd, err := unix.Open(p(rel), flags|unix.O_CLOEXEC, 0o644)
		if err == nil {
			unix.Close(fd)
		}
		return err
	}
	return map[string]error{
		"create":               open("new.txt", unix.O_CREAT|unix.O_WRONLY),
		"open lower for write": open("a/one.txt", unix.O_WRONLY),
		"open upper for write": open("upper.txt", unix.O_RDWR),
		"open with O_TRUNC":    open("top.txt", unix.O_RDONLY|unix.O_TRUNC),
		"truncate":             unix.Truncate(p("top.txt"), 0),
		"mkdir":                unix.Mkdir(p("d"), 0o755),
		"rmdir":                unix.Rmdir(p("empty")),
		"unlink lower":         unix.Unlink(p("top.txt")),
		"unlink upper":         unix.Unlink(p("upper.txt")),
		"rename":               unix.Rename(p("a/one.txt"), p("moved.txt")),
		"chmod":                unix.Chmod(p("top.txt"), 0o600),
		"chown":                unix.Lchown(p("top.txt"), os.Getuid(), os.Getgid()),
		"utimes":               unix.UtimesNano(p("top.txt"), []unix.Timespec{{Sec: 1}, {Sec: 1}}),
		"symlink":              unix.Symlink("top.txt", p("ln")),
		"link":                 unix.Link(p("top.txt"), p("hard")),
		"mkfifo":               unix.Mkfifo(p("fifo2"), 0o644),
	}
}

// roReads checks that a read-only mount still shows the merged tree.
func roReads(mnt string) error {
	var sfs unix.Statfs_t
	if err := unix.Statfs(mnt, &sfs); err != nil {
		return err
	}
	if sfs.Flags&unix.ST_RDONLY == 0 {
		return errors.New("the kernel does not see a read-only mount")
	}
	if b, err := os.ReadFile(filepath.Join(mnt, "upper.txt")); err != nil || string(b) != "changed before" {
		return errors.New("upper file: " + string(b))
	}
	if b, err := os.ReadFile(filepath.Join(mnt, "a/b/two.txt")); err != nil || string(b) != "two" {
		return errors.New("lower file: " + string(b))
	}
	if _, err := os.Lstat(filepath.Join(mnt, "secret.txt")); !errors.Is(err, iofs.ErrNotExist) {
		return errors.New("a file deleted before is back")
	}
	return nil
}

// TestReadOnly mounts an upper layer with changes read-only: the changes
// show, every kind of change fails with EROFS at the kernel and, called
// directly, in the overlay, and the upper layer is left exactly as it was.
func TestReadOnly(t *testing.T) {
	lower, _ := packLower(t, sampleTree)
	e := mountEnv(t, lower, Options{})
	e.write("upper.txt", "changed before")
	must(t, os.Remove(e.path("secret.txt")))
	e.unmount()
	before := stateOfDir(t, e.upper)

	e.opts.ReadOnly = true
	e.mount()
	if err := roReads(e.mnt); err != nil {
		t.Fatal(err)
	}
	for what, err := range roAttempts(e.mnt) {
		if !errors.Is(err, syscall.EROFS) {
			t.Errorf("%s on a read-only mount: %v, want EROFS", what, err)
		}
	}

	// The overlay refuses on its own: the operations called as the
	// kernel would, had it let them through.
	ctx := context.Background()
	root := e.m.ov.root
	var out fuse.EntryOut
	child := func(name string) *node {
		t.Helper()
		ch := root.GetChild(name)
		if ch == nil {
			if _, errno := root.Lookup(ctx, name, &out); errno != 0 {
				t.Fatalf("lookup %s: %v", name, errno)
			}
			ch = root.GetChild(name)
		}
		return ch.Operations().(*node)
	}
	top, upper := child("top.txt"), child("upper.txt")
	var ao fuse.AttrOut
	sizeIn := &fuse.SetAttrIn{SetAttrInCommon: fuse.SetAttrInCommon{Valid: fuse.FATTR_SIZE}}
	modeIn := &fuse.SetAttrIn{SetAttrInCommon: fuse.SetAttrInCommon{Valid: fuse.FATTR_MODE, Mode: 0o600}}
	_, _, _, createErr := root.Create(ctx, "x", uint32(os.O_WRONLY), 0o644, &out)
	_, openErr := func() (fusefs.FileHandle, syscall.Errno) {
		h, _, errno := top.Open(ctx, uint32(os.O_RDWR))
		return h, errno
	}()
	_, openUpperErr := func() (fusefs.FileHandle, syscall.Errno) {
		h, _, errno := upper.Open(ctx, uint32(os.O_WRONLY|os.O_TRUNC))
		return h, errno
	}()
	_, mkdirErr := root.Mkdir(ctx, "d", 0o755, &out)
	_, mknodErr := root.Mknod(ctx, "f", syscall.S_IFIFO|0o644, 0, &out)
	_, symlinkErr := root.Symlink(ctx, "t", "l", &out)
	_, linkErr := root.Link(ctx, top, "h", &out)
	direct := map[string]syscall.Errno{
		"Create":       createErr,
		"Open O_RDWR":  openErr,
		"Open O_TRUNC": openUpperErr,
		"Mkdir":        mkdirErr,
		"Mknod":        mknodErr,
		"Symlink":      symlinkErr,
		"Link":         linkErr,
		"Unlink":       root.Unlink(ctx, "top.txt"),
		"Rmdir":        root.Rmdir(ctx, "empty"),
		"Rename":       root.Rename(ctx, "top.txt", root, "t2", 0),
		"Setattr size": top.Setattr(ctx, nil, sizeIn, &ao),
		"Setattr mode": upper.Setattr(ctx, nil, modeIn, &ao),
	}
	for what, errno := range direct {
		if errno != syscall.EROFS {
			t.Errorf("%s called directly on a read-only overlay: %v, want EROFS", what, errno)
		}
	}
	// A read-only handle of an upper file refuses writes too.
	h, _, errno := upper.Open(ctx, uint32(os.O_RDONLY))
	if errno != 0 {
		t.Fatal(errno)
	}
	if _, errno := h.(fusefs.FileWriter).Write(ctx, []byte("x"), 0); errno != syscall.EROFS {
		t.Errorf("Write on a read-only overlay: %v", errno)
	}
	h.(fusefs.FileReleaser).Release(ctx)

	// A freeze works and shows the same tree.
	want := stateOfDir(t, e.mnt)
	v, err := e.m.Freeze(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	diffStates(t, "read-only view", stateOfFS(t, v), want)
	must(t, v.Close())
	e.unmount()
	diffStates(t, "upper layer after a read-only mount", stateOfDir(t, e.upper), before)

	// A read-only mount of an upper layer that does not exist yet.
	e.upper = filepath.Join(tempDir(t), "fresh")
	e.opts.Upper = e.upper
	e.mount()
	if b, err := os.ReadFile(e.path("top.txt")); err != nil || string(b) != "top" {
		t.Errorf("fresh read-only mount: %q, %v", b, err)
	}
	if err := unix.Mkdir(e.path("d"), 0o755); !errors.Is(err, syscall.EROFS) {
		t.Errorf("mkdir: %v", err)
	}
	e.unmount()
	if names, _ := os.ReadDir(e.upper); len(names) != 0 {
		t.Errorf("read-only mount wrote %v into a new upper layer", names)
	}
}

// roChecks is what the unprivileged read-only helper checks, in its own
// process.
func roChecks(m *Mounted, mnt string) error {
	if err := roReads(mnt); err != nil {
		return err
	}
	var bad []string
	for what, err := range roAttempts(mnt) {
		if !errors.Is(err, syscall.EROFS) {
			bad = append(bad, what+": "+errString(err))
		}
	}
	if len(bad) > 0 {
		return errors.New("not EROFS: " + strings.Join(bad, "; "))
	}
	return nil
}

func errString(err error) string {
	if err == nil {
		return "succeeded"
	}
	return err.Error()
}
